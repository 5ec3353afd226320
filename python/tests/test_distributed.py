"""poslsh.distributed: context parallelism over torch.distributed (gloo), ranks spawned with
torch.multiprocessing.

One world per world size (1, 2, 3, 4) runs every case in its workers (spawning is the expensive
part): each worker builds the whole sequence from a seed, runs the single-process
poslsh.torch.multihead_attention on it (forward and backward with a random upstream gradient)
and context_parallel_attention on its shard, and reports per case either None (passed) or a
message. Halo methods must be bitwise, the ring to rounding; the bytes in `stats` must follow the
plan. Every wait is bounded (gloo timeout in the workers, a deadline in the parent): a broken
case fails, it never hangs.
"""

import dataclasses
import math
import time
import traceback

import numpy as np
import pytest

import poslsh
from spawned_world import run_world

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import torch.distributed as dist  # noqa: E402

import poslsh.torch as ptorch  # noqa: E402
from poslsh import distributed as pdist  # noqa: E402

WORLD_SIZES = [1, 2, 3, 4]
# The process group's timeout bounds every collective and point-to-point wait in the workers;
# a bad call must make every rank raise within it (never a hang). Loose enough for a machine
# whose cores are shared with compile jobs; the world's deadline only guards against a hang.
GLOO_TIMEOUT = 60.0
WORLD_DEADLINE = 900.0  # seconds, a whole world in the parent (spawn, import, every case)
ERROR_DEADLINE = GLOO_TIMEOUT


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    method: str
    masking: str
    dtype: str = "float32"
    layout: str = "contiguous"
    lengths: str = "even"  # 'even' (shard_ranges), 'uneven' (contiguous, rank r ~ r + 1), 'empty_first'
    n: int = 203
    heads: int = 4
    kv_heads: int = 2
    d: int = 8
    d_v: int = 8
    sigmas: tuple = None
    samples: int = 4
    seed: int = 7
    window: tuple = (-1, -1)

    @property
    def ring(self):
        left, right = self.window
        return self.method == "exact_tiled" and (left < 0 or (self.masking == "bidirectional" and right < 0))


BIG_SIGMAS = (300.0, 150.0, 40.0, 8.0)  # blocks of hundreds of tokens over shards of ~50
CASES = [
    Case("lsh_fused-causal-f32", "lsh_fused", "causal"),
    Case("lsh_fused-bidirectional-f64-zigzag", "lsh_fused", "bidirectional", "float64", "zigzag", sigmas=BIG_SIGMAS),
    Case("lsh_fused-causal-f64-uneven-mha", "lsh_fused", "causal", "float64", lengths="uneven", heads=2, kv_heads=2,
         sigmas=(300.0, 20.0)),
    Case("lsh_fused-causal-f32-empty-shard", "lsh_fused", "causal", lengths="empty_first", sigmas=BIG_SIGMAS),
    Case("lsh_per_sample-causal-f64-zigzag", "lsh_per_sample", "causal", "float64", "zigzag"),
    Case("lsh_per_sample-bidirectional-f32-uneven", "lsh_per_sample", "bidirectional", lengths="uneven",
         sigmas=BIG_SIGMAS),
    Case("fixed_blocks-causal-f32-zigzag", "fixed_blocks", "causal", "float32", "zigzag", sigmas=BIG_SIGMAS),
    Case("fixed_blocks-bidirectional-f64", "fixed_blocks", "bidirectional", "float64"),
    Case("exact_banded-causal-f32", "exact_banded", "causal", sigmas=(300.0, 30.0, 10.0, 3.0)),
    Case("exact_banded-bidirectional-f64-zigzag", "exact_banded", "bidirectional", "float64", "zigzag"),
    Case("exact_banded-causal-f64-uneven-dv", "exact_banded", "causal", "float64", lengths="uneven", d=16, d_v=8),
    Case("exact_tiled-window-causal-f32-zigzag", "exact_tiled", "causal", "float32", "zigzag", window=(40, 0)),
    Case("exact_tiled-window-bidirectional-f64-uneven", "exact_tiled", "bidirectional", "float64", lengths="uneven",
         window=(40, 17)),
    Case("exact_tiled-wide-window-causal-f64", "exact_tiled", "causal", "float64", window=(300, -1)),
    Case("ring-causal-f32", "exact_tiled", "causal"),
    Case("ring-causal-f64-zigzag", "exact_tiled", "causal", "float64", "zigzag"),
    Case("ring-bidirectional-f32-zigzag", "exact_tiled", "bidirectional", "float32", "zigzag", sigmas=BIG_SIGMAS),
    Case("ring-bidirectional-f64-uneven-dv", "exact_tiled", "bidirectional", "float64", lengths="uneven", d=16,
         d_v=8),
    Case("ring-bidirectional-left-window-f64", "exact_tiled", "bidirectional", "float64", window=(30, -1)),
    Case("ring-causal-f32-empty-shard", "exact_tiled", "causal", lengths="empty_first"),
]
ERROR_CHECKS = ["bad_shape_on_last_rank", "seed_differs", "method_differs", "query_heads_differ",
                "zigzag_lengths", "bad_method_everywhere"]


# Worker side. ----------------------------------------------------------------------------------

def shard_lengths(case, world_size):
    n = case.n
    if case.lengths == "uneven":
        weights = [r + 1 for r in range(world_size)]
        lengths = [n * w // sum(weights) for w in weights]
        lengths[-1] += n - sum(lengths)
        return lengths
    if case.lengths == "empty_first" and world_size > 1:
        rest = [n * (r + 1) // (world_size - 1) - n * r // (world_size - 1) for r in range(world_size - 1)]
        return [0] + rest
    return None


def shard_of(x, case, rank, world_size):
    lengths = shard_lengths(case, world_size)
    if lengths is None:
        return pdist.shard(x, rank, world_size, case.layout)
    begin = sum(lengths[:rank])
    return x[begin:begin + lengths[rank]]


def plan_shards(case, world_size):
    lengths = shard_lengths(case, world_size)
    if lengths is None:
        return [[tuple(r) for r in poslsh.shard_ranges(case.n, world_size, rank, layout=case.layout)]
                for rank in range(world_size)]
    starts = [sum(lengths[:r]) for r in range(world_size)]
    return [[(s, s + m)] for s, m in zip(starts, lengths)]


def keywords_of(case):
    return dict(method=case.method, masking=case.masking, sigmas=case.sigmas, samples=case.samples, seed=case.seed)


def inputs(case, index):
    generator = torch.Generator().manual_seed(1000 + index)
    dtype = getattr(torch, case.dtype)

    def uniform(*shape):
        return torch.rand(shape, generator=generator, dtype=dtype).mul_(2).sub_(1)

    return (uniform(case.n, case.heads, case.d), uniform(case.n, case.kv_heads, case.d),
            uniform(case.n, case.kv_heads, case.d_v), uniform(case.n, case.heads, case.d_v))


def single_process(case, q, k, v, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    if case.window == (-1, -1):
        out = ptorch.multihead_attention(q, k, v, **keywords_of(case))
    else:  # poslsh.torch.multihead_attention takes no window: the Function with the kernels' keywords
        out = ptorch.MultiheadAttention.apply(q, k, v, dict(layout="nhd", scale=None, band_error=1e-3,
                                                            window=case.window, **keywords_of(case)))
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def outside_rows(ranges, own):
    """Rows of the ranges (one per K/V head) outside the rank's own ranges."""
    total = 0
    for b, e in ranges:
        inside = sum(max(0, min(e, oe) - max(b, ob)) for ob, oe in own)
        total += (e - b) - inside
    return total


def expected_bytes(case, rank, world_size, n_local):
    itemsize = 4 if case.dtype == "float32" else 8
    d, d_v, group = case.d, case.d_v, case.heads // case.kv_heads
    if case.ring:
        forward = (case.n - n_local) * case.kv_heads * (d + d_v) * itemsize
        partials = (world_size - 1) * n_local * case.kv_heads * (d + d_v) * itemsize
        return forward, forward + partials
    shards = plan_shards(case, world_size)
    plan = poslsh.context_parallel_plan(case.n, world_size, query_heads=case.heads, kv_heads=case.kv_heads,
                                        window=case.window, shards=shards, **keywords_of(case))
    own = shards[rank]
    chunks = plan["chunks"][rank]
    forward = sum(outside_rows(chunk["keys"], own) for chunk in chunks) * (d + d_v) * itemsize
    backward = sum(outside_rows(chunk["window"], own) for chunk in chunks) * (
        d + d_v + group * (d + 2 * d_v + 1)) * itemsize
    return forward, backward


def relative_error(got, want):
    scale = want.abs().max().item() if want.numel() else 0.0
    return (got - want).abs().max().item() / max(scale, 1e-300) if want.numel() else 0.0


def run_case(case, index, rank, world_size):
    q, k, v, dout = inputs(case, index)
    reference = single_process(case, q, k, v, dout)
    local = [shard_of(x, case, rank, world_size).clone() for x in (q, k, v, dout)]
    ql, kl, vl = (x.requires_grad_() for x in local[:3])
    stats = {}
    out = pdist.context_parallel_attention(ql, kl, vl, layout=case.layout, window=case.window, num_threads=1,
                                           stats=stats, **keywords_of(case))
    out.backward(local[3])
    problems = []
    tolerance = 1e-6 if case.dtype == "float32" else 1e-12
    for name, got, whole in zip(("out", "dq", "dk", "dv"), (out.detach(), ql.grad, kl.grad, vl.grad), reference):
        want = shard_of(whole, case, rank, world_size)
        if got is None or got.shape != want.shape or got.dtype != want.dtype:
            problems.append(f"{name}: got {None if got is None else (tuple(got.shape), got.dtype)}, want "
                            f"{(tuple(want.shape), want.dtype)}")
        elif case.ring:
            error = relative_error(got, want)
            if not error <= tolerance:
                problems.append(f"{name}: relative error {error:.3g} > {tolerance:g}")
        elif not torch.equal(got, want):
            problems.append(f"{name}: not bitwise, max |diff| {(got - want).abs().max().item():.3g}")
    # The whole output, gathered from every rank, is the single-process output.
    whole_out = pdist.gather_sequence(out.detach(), layout=case.layout)
    if case.ring:
        if not relative_error(whole_out, reference[0]) <= tolerance:
            problems.append("gather_sequence: not the single-process output")
    elif not torch.equal(whole_out, reference[0]):
        problems.append("gather_sequence: not bitwise the single-process output")
    # Bytes: as the plan gives them, and what is sent is received.
    forward, backward = expected_bytes(case, rank, world_size, ql.shape[0])
    if (stats["forward_bytes_received"], stats["backward_bytes_received"]) != (forward, backward):
        problems.append(f"stats: received {stats['forward_bytes_received']}, {stats['backward_bytes_received']} "
                        f"bytes, the plan gives {forward}, {backward}")
    every = [None] * world_size
    dist.all_gather_object(every, stats)
    for phase in ("forward", "backward"):
        sent = sum(s[phase + "_bytes_sent"] for s in every)
        received = sum(s[phase + "_bytes_received"] for s in every)
        if sent != received:
            problems.append(f"stats: {phase} bytes sent {sent} != received {received} over the ranks")
    if world_size == 1 and stats["messages"] != 0:
        problems.append(f"stats: one rank sent {stats['messages']} messages")
    return "; ".join(problems) or None


def run_error_check(check, rank, world_size):
    """Runs a bad call; returns None when this rank raised the expected error in time."""
    case = Case("error", "lsh_fused", "causal")
    q, k, v, _ = inputs(case, 0)
    q, k, v = (pdist.shard(x, rank, world_size) for x in (q, k, v))
    keywords = keywords_of(case)
    layout = "contiguous"
    expected_type, expected = ValueError, []
    if check == "bad_shape_on_last_rank":
        if rank == world_size - 1:
            k = k[:, :, :-1]
        expected = [f"rank {world_size - 1} of {world_size} failed its checks", "'k'"]
    elif check == "seed_differs":
        keywords["seed"] = rank
        expected = ["'seed' differs across ranks", "rank 1: 1"]
    elif check == "method_differs":
        keywords["method"] = "lsh_fused" if rank == 0 else "fixed_blocks"
        expected = ["'method' differs across ranks"]
    elif check == "query_heads_differ":
        if rank == 1:
            q = q[:, :2]
        expected = ["'query_heads' differs across ranks"]
    elif check == "zigzag_lengths":
        layout = "zigzag"
        q, k, v = (pdist.shard(x, rank, world_size, "zigzag") for x in inputs(case, 0)[:3])
        if rank == 0:  # one token moves from rank 0 to rank 1: n is the same, the lengths are not zigzag's
            q, k, v = (x[:-1] for x in (q, k, v))
        elif rank == 1:
            q, k, v = (torch.cat([x, x[:1]]) for x in (q, k, v))
        expected = ["argument 'q'", "zigzag"]
    elif check == "bad_method_everywhere":
        keywords["method"] = "no_such_method"
        expected = ["method"]
    start = time.monotonic()
    try:
        pdist.context_parallel_attention(q, k, v, layout=layout, num_threads=1, **keywords)
    except expected_type as error:
        elapsed = time.monotonic() - start
        message = str(error)
        missing = [part for part in expected if part not in message]
        if missing:
            return f"message {message!r} lacks {missing}"
        if elapsed > ERROR_DEADLINE:
            return f"raised after {elapsed:.1f} s"
        return None
    except Exception as error:  # noqa: BLE001
        return f"raised {type(error).__name__}: {error}"
    return "did not raise"


def checks(rank, world_size, report):
    for index, case in enumerate(CASES):
        if case.lengths == "empty_first" and world_size == 1:
            continue
        try:
            report[case.name] = run_case(case, index, rank, world_size)
        except Exception:  # noqa: BLE001 -- reported to the parent
            report[case.name] = traceback.format_exc()
    if world_size > 1:
        for check in ERROR_CHECKS:
            try:
                report["error:" + check] = run_error_check(check, rank, world_size)
            except Exception:  # noqa: BLE001
                report["error:" + check] = traceback.format_exc()


# Parent side. ----------------------------------------------------------------------------------

_WORLDS = {}


def world(world_size):
    """{rank: {case: None or message}} of one spawned world (run once per world size)."""
    if world_size not in _WORLDS:
        _WORLDS[world_size] = run_world(checks, world_size, WORLD_DEADLINE, GLOO_TIMEOUT)
    return _WORLDS[world_size]


def check_world(world_size, key):
    reports = world(world_size)
    problems = []
    for rank in range(world_size):
        report = reports[rank]
        if "world" in report:
            problems.append(f"rank {rank}: {report['world']}")
        elif key not in report:
            problems.append(f"rank {rank}: no result for {key}")
        elif report[key] is not None:
            problems.append(f"rank {rank}: {report[key]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_single_process(world_size, case):
    if case.lengths == "empty_first" and world_size == 1:
        pytest.skip("an empty shard needs two ranks")
    check_world(world_size, case.name)


@pytest.mark.parametrize("check", ERROR_CHECKS)
@pytest.mark.parametrize("world_size", [w for w in WORLD_SIZES if w > 1])
def test_bad_calls_raise_on_every_rank(world_size, check):
    check_world(world_size, "error:" + check)


# Helpers without a process group. --------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_and_unshard(layout, world_size):
    x = torch.arange(2 * 23 * 3).reshape(2, 23, 3)
    parts = [pdist.shard(x, r, world_size, layout, dim=1) for r in range(world_size)]
    for r, part in enumerate(parts):
        positions = [p for b, e in poslsh.shard_ranges(23, world_size, r, layout=layout) for p in range(b, e)]
        assert torch.equal(part, x[:, positions])
    assert torch.equal(pdist.unshard(parts, layout, dim=1), x)
    array = x.numpy()
    assert np.array_equal(pdist.unshard([pdist.shard(array, r, world_size, layout, dim=1)
                                         for r in range(world_size)], layout, dim=1), array)


def test_unshard_checks_zigzag_lengths():
    parts = [torch.zeros(6), torch.zeros(5)]  # zigzag over 11 rows: 5 and 6
    with pytest.raises(ValueError, match="zigzag"):
        pdist.unshard(parts, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        pdist.shard(torch.zeros(4), 0, 2, "striped")


def test_cases_cover_the_methods():
    """Every method, both maskings, both dtypes and layouts, GQA and the ring are exercised."""
    assert {case.method for case in CASES} == {"lsh_fused", "lsh_per_sample", "fixed_blocks", "exact_banded",
                                               "exact_tiled"}
    assert {case.masking for case in CASES} == {"causal", "bidirectional"}
    assert {case.dtype for case in CASES} == {"float32", "float64"}
    assert {case.layout for case in CASES} == {"contiguous", "zigzag"}
    assert any(case.ring for case in CASES) and any(case.method == "exact_tiled" and not case.ring for case in CASES)
    assert any(case.heads > case.kv_heads for case in CASES)
    assert all(math.gcd(case.n, 2 * 3 * 4) == 1 for case in CASES)  # n divisible by no world size


# The bindings poslsh.distributed calls, every rank simulated in one process. -------------------

def simulated_ranks(case, world_size, dtype):
    """The whole-sequence inputs, the plan and every rank's ContextParallelRank and rows."""
    q, k, v, dout = (x.numpy().astype(dtype) for x in inputs(case, 0))
    plan = poslsh._core.ContextParallelPlan(case.n, world_size, query_heads=case.heads, kv_heads=case.kv_heads,
                                            layout=case.layout, window=case.window, **keywords_of(case))
    ranks = [plan.rank(r, head_dim=case.d, value_dim=case.d_v) for r in range(world_size)]
    rows = [{name: np.ascontiguousarray(pdist.shard(x, r, world_size, case.layout))
             for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout))} for r in range(world_size)]
    return (q, k, v, dout), plan, ranks, rows


def whole_sequence(case, q, k, v, dout):
    keywords = dict(layout="nhd", window=case.window, **keywords_of(case))
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, **keywords)
    return (out, lse) + tuple(poslsh.multihead_attention_backward(q, k, v, out, lse, dout, **keywords))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("method", ["lsh_fused", "exact_banded", "fixed_blocks"])
def test_halo_bindings_are_bitwise_the_whole_sequence(method, layout):
    """pack / received_elements / halo_forward / halo_backward of ContextParallelRank, the
    messages passed by hand: every rank's rows bitwise those of the single-process kernels."""
    case = Case("bindings", method, "bidirectional", layout=layout, sigmas=BIG_SIGMAS)
    world_size = 3
    (q, k, v, dout), plan, ranks, rows = simulated_ranks(case, world_size, np.float64)
    out, lse, dq, dk, dv = whole_sequence(case, q, k, v, dout)
    assert not plan.ring and all(not me.ring for me in ranks)

    def exchange(phase):
        sent = [[me.pack(p, phase, **rows[me.rank]) if p != me.rank else None for p in range(world_size)]
                for me in ranks]
        for me in ranks:
            for p in range(world_size):
                if p != me.rank:
                    assert sent[me.rank][p].size == me.sent_elements(p, phase) == \
                        ranks[p].received_elements(me.rank, phase)
        return [[sent[p][r] for p in range(world_size)] for r in range(world_size)]

    received = exchange("forward")
    for me in ranks:
        got_out, got_lse = me.halo_forward(messages=received[me.rank], q=rows[me.rank]["q"], k=rows[me.rank]["k"],
                                           v=rows[me.rank]["v"])
        assert np.array_equal(got_out, pdist.shard(out, me.rank, world_size, layout))
        assert np.array_equal(got_lse, pdist.shard(lse, me.rank, world_size, layout, dim=1))
        rows[me.rank].update(out=got_out, lse=got_lse)
    received = exchange("backward")
    for me in ranks:
        for got, want in zip(me.halo_backward(messages=received[me.rank], **rows[me.rank]), (dq, dk, dv)):
            assert np.array_equal(got, pdist.shard(want, me.rank, world_size, layout))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("masking", ["causal", "bidirectional"])
def test_ring_bindings_equal_the_whole_sequence(masking, layout, dtype):
    """ring_step, pack_ring_shard, RingForward and RingBackward, the shards passed by hand in
    the schedule's order: every rank's rows and gradients equal the single-process ones to
    rounding; the partials each rank sends are its dK, dV of the peer's shard."""
    case = Case("ring", "exact_tiled", masking, layout=layout, d=16, d_v=8)
    world_size = 4
    (q, k, v, dout), plan, ranks, rows = simulated_ranks(case, world_size, dtype)
    out, lse, dq, dk, dv = whole_sequence(case, q, k, v, dout)
    assert plan.ring and all(me.ring for me in ranks)
    shards = [me.pack_ring_shard(rows[me.rank]["k"], rows[me.rank]["v"]) for me in ranks]
    for me in ranks:
        assert shards[me.rank].size == me.ring_shard_elements(me.rank)

    def run_ring(add):
        for step in range(world_size):
            for me in ranks:
                at = me.ring_step(step)
                assert at["transfers"] == (step + 1 < world_size)
                if at["transfers"]:
                    assert ranks[at["receive_from"]].ring_step(step)["source"] == at["arriving"]
                add(me, at["source"], shards[at["source"]])

    forward = [me.ring_forward() for me in ranks]
    run_ring(lambda me, source, shard: forward[me.rank].add(rows[me.rank]["q"], source, shard))
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    for me in ranks:
        got_out, got_lse = forward[me.rank].result()
        assert got_out.dtype == dtype
        np.testing.assert_allclose(got_out, pdist.shard(out, me.rank, world_size, layout), rtol=0,
                                   atol=tolerance * np.abs(out).max())
        np.testing.assert_allclose(got_lse, pdist.shard(lse, me.rank, world_size, layout, dim=1), rtol=tolerance)
        rows[me.rank].update(out=got_out, lse=got_lse)
    backward = [me.ring_backward() for me in ranks]
    run_ring(lambda me, source, shard: backward[me.rank].add(
        rows[me.rank]["q"], rows[me.rank]["out"], rows[me.rank]["lse"], rows[me.rank]["dout"], source, shard))
    for me in ranks:
        received = [None if p == me.rank else backward[p].partial(me.rank) for p in range(world_size)]
        for got, want in zip(backward[me.rank].result(received), (dq, dk, dv)):
            np.testing.assert_allclose(got, pdist.shard(want, me.rank, world_size, layout), rtol=0,
                                       atol=tolerance * np.abs(want).max())


def test_binding_errors_name_their_argument():
    case = Case("errors", "exact_tiled", "causal")
    (q, k, v, _), plan, ranks, rows = simulated_ranks(case, 2, np.float32)
    me = ranks[0]
    with pytest.raises(ValueError, match="phase"):
        me.sent_elements(1, "sideways")
    with pytest.raises(ValueError, match="'me'"):  # a ring plan has no halo
        me.halo_forward(messages=[None, None], **{n: rows[0][n] for n in "qkv"})
    forward = me.ring_forward()
    shard = me.pack_ring_shard(rows[0]["k"], rows[0]["v"])
    with pytest.raises(ValueError, match="shard"):
        forward.add(rows[0]["q"], 0, shard[:-1])
    with pytest.raises(ValueError, match="source"):
        forward.add(rows[0]["q"], 2, shard)
    forward.add(rows[0]["q"], 0, shard)
    with pytest.raises(TypeError, match="'q'"):
        forward.add(rows[0]["q"].astype(np.float64), 0, shard.astype(np.float64))
    halo = poslsh._core.ContextParallelPlan(case.n, 2, query_heads=case.heads, kv_heads=case.kv_heads,
                                            method="lsh_fused", sigmas=list(BIG_SIGMAS)).rank(0, head_dim=8, value_dim=8)
    with pytest.raises(ValueError, match="messages"):
        halo.halo_forward(messages=[None, np.zeros(3, np.float32)], **{n: rows[0][n] for n in "qkv"})
    with pytest.raises(ValueError, match="name"):
        plan.ranges("nothing")
    with pytest.raises(ValueError, match="transport"):
        plan.traffic(8, 8, 4, transport="carrier pigeon")


def test_distributed_moves_buffers_only():
    """poslsh.distributed calls the library for every piece of attention arithmetic: its source
    names no matrix product, exponential or log-sum-exp."""
    import inspect
    import re

    source = inspect.getsource(pdist)
    assert not re.findall(r"matmul|bmm|einsum|\.exp\(|logsumexp|softmax|\s@\s", source)
