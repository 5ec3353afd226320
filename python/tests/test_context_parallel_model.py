"""poslsh.context_parallel_model: the plan's halos and bytes (ContextParallelPlan, which the
model reads) against a brute force over every position, the expected pair counts against direct
sums and lsh_fused_pair_count, ring bytes against the closed form and the ring's schedule, the
--check format, the generated doc blocks, the projection's speed, and the model's bytes and
messages against poslsh.distributed's stats in spawned gloo worlds (R = 2, 3, 4)."""

import dataclasses
import json
import math
import time
import traceback

import numpy as np
import pytest

import poslsh
from poslsh import context_parallel_model as cpm
from spawned_world import run_world


def bins_of(widths, offsets, n):
    """bin_k(i) = floor((i - offset_k) / width_k) for every sample and position, (s, n)."""
    positions = np.arange(n, dtype=np.float64)[None, :]
    return np.floor((positions - np.asarray(offsets)[:, None]) / np.asarray(widths)[:, None])


def reach_matrix(problem, h):
    """reach[i, j]: query i evaluates key j under query head h (causal: j <= i)."""
    n = problem.n
    i = np.arange(n)
    if problem.method == "exact_tiled":
        reach = np.ones((n, n), bool)
    elif problem.method == "exact_banded":
        band = poslsh.band_for_bias_error(problem.sigmas[h], problem.band_error)
        reach = np.abs(i[:, None] - i[None, :]) <= band
    else:
        sigma = problem.sigmas[h]
        hashes = (poslsh.fixed_blocks_hash(sigma) if problem.method == "fixed_blocks"
                  else poslsh.rbf_hashes(sigma, problem.samples, problem.seed, stream=h))
        b = bins_of(np.asarray(hashes.widths), np.asarray(hashes.offsets), n)
        reach = (b[:, :, None] == b[:, None, :]).any(axis=0)
    if problem.masking == "causal":
        reach &= i[None, :] <= i[:, None]
    return reach


def rows_of(intervals):
    return set(p for x, y in intervals for p in range(x, y))


def shard_list(problem):
    """(begin, end) of every rank's ranges, from shard_ranges (the layout's definition)."""
    return [[tuple(x) for x in poslsh.shard_ranges(problem.n, problem.ranks, r, layout=problem.layout)]
            for r in range(problem.ranks)]


def brute_force(problem):
    """Per rank r and K/V head g, per chunk: the keys its queries reach (forward) and the
    positions from the first key they reach to one past the last query reaching its keys
    (backward window), as sets, and (a, b) of the window; from the weights alone."""
    reach = [reach_matrix(problem, h) for h in range(problem.heads)]
    out = {}
    for r, ranges in enumerate(shard_list(problem)):
        own = rows_of(ranges)
        for g in range(problem.kv_heads):
            heads = range(g * problem.group, (g + 1) * problem.group)
            group_reach = np.logical_or.reduce([reach[h] for h in heads])
            chunks = []
            for s, e in ranges:
                if e == s:
                    chunks.append(None)
                    continue
                reached = np.flatnonzero(group_reach[s:e].any(axis=0))  # keys of the chunk
                reaching = np.flatnonzero(group_reach[:, s:e].any(axis=1))  # its keys' queries
                a, b = min(int(reached.min()), s), max(int(reaching.max()) + 1, e)
                chunks.append(dict(keys=set(reached.tolist()) | set(range(s, e)), ab=(a, b)))
            out[r, g] = dict(own=own, chunks=chunks)
    return out


CASES = [
    # (method, n, ranks, sigmas, kv_heads)
    ("lsh_fused", 300, 4, (1.5, 6.0, 40.0, 400.0), 2),
    ("lsh_fused", 257, 3, (0.5, 3.0, 25.0), 3),
    ("lsh_per_sample", 200, 4, (2.0, 12.0), 1),
    ("fixed_blocks", 300, 4, (1.0, 7.3, 30.0, 200.0), 4),
    ("exact_banded", 300, 4, (1.5, 6.0, 40.0, 400.0), 2),
    ("exact_tiled", 128, 2, (4.0, 8.0), 1),
]


@pytest.mark.parametrize("layout", cpm.LAYOUTS)
@pytest.mark.parametrize("masking", cpm.MASKINGS)
@pytest.mark.parametrize("method,n,ranks,sigmas,kv_heads", CASES)
def test_halo_ranges_match_brute_force(method, n, ranks, sigmas, kv_heads, layout, masking):
    """The model's halos (the library's plan and traffic) against a scan of the weights: the
    keys and windows of every chunk and head, the rows outside the own shard, the bytes received
    and sent (K, V forward; K, V and the G query heads' Q, out, dout, lse backward) and the
    peers."""
    problem = cpm.Problem(n=n, ranks=ranks, sigmas=sigmas, layout=layout, method=method,
                          masking=masking, samples=6, seed=11, kv_heads=kv_heads, d=16, dv=8,
                          itemsize=2)
    expected = brute_force(problem)
    halos = cpm.halo_ranges(problem)
    shards = shard_list(problem)
    row_owner = np.empty(n, np.int64)
    for r, ranges in enumerate(shards):
        for s, e in ranges:
            row_owner[s:e] = r
    G, d, dv, itemsize = problem.group, problem.d, problem.dv, problem.itemsize
    forward_row, window_row = (d + dv) * itemsize, (d + dv + G * (d + 2 * dv + 1)) * itemsize
    recv_f, recv_b, sent_f, sent_b = (np.zeros(ranks, np.int64) for _ in range(4))
    peers_f, peers_b = ([set() for _ in range(ranks)] for _ in range(2))
    for (r, g), want in expected.items():
        rows_f = rows_w = 0
        for c, chunk in enumerate(want["chunks"]):
            if chunk is None:
                continue
            keys = set(range(*halos.keys[r, c, g]))
            assert keys == chunk["keys"]
            assert tuple(halos.window[r, c, g]) == chunk["ab"]
            forward = keys - want["own"]
            window = set(range(*chunk["ab"])) - want["own"]
            rows_f += len(forward)
            rows_w += len(window)
            recv_f[r] += len(forward) * forward_row
            recv_b[r] += len(window) * window_row
            for row in forward:
                sent_f[row_owner[row]] += forward_row
                peers_f[r].add(row_owner[row])
            for row in window:
                sent_b[row_owner[row]] += window_row
                peers_b[r].add(row_owner[row])
        assert halos.forward_rows[r, g] == rows_f
        assert halos.window_rows[r, g] == rows_w
    np.testing.assert_array_equal(halos.forward_recv, recv_f)
    np.testing.assert_array_equal(halos.backward_recv, recv_b)
    np.testing.assert_array_equal(halos.forward_sent, sent_f)
    np.testing.assert_array_equal(halos.backward_sent, sent_b)
    np.testing.assert_array_equal(halos.forward_peers_in, [len(p) for p in peers_f])
    np.testing.assert_array_equal(halos.backward_peers_in, [len(p) for p in peers_b])
    np.testing.assert_array_equal(halos.forward_peers_out,
                                  [sum(o in p for p in peers_f) for o in range(ranks)])
    np.testing.assert_array_equal(halos.backward_peers_out,
                                  [sum(o in p for p in peers_b) for o in range(ranks)])
    assert halos.forward_sent.sum() == halos.forward_recv.sum()
    assert halos.backward_sent.sum() == halos.backward_recv.sum()


@pytest.mark.parametrize("layout", cpm.LAYOUTS)
@pytest.mark.parametrize("masking", cpm.MASKINGS)
@pytest.mark.parametrize("method,n,ranks,sigmas,kv_heads", CASES)
def test_plan_arrays_match_the_plan_dict(method, n, ranks, sigmas, kv_heads, layout, masking):
    """ContextParallelPlan.ranges (the model's arrays) and context_parallel_plan's dict."""
    keywords = dict(query_heads=len(sigmas), kv_heads=kv_heads, layout=layout, method=method,
                    masking=masking, sigmas=list(sigmas), samples=6, seed=11)
    plan = poslsh.context_parallel_plan(n, ranks, **keywords)
    arrays = poslsh._core.ContextParallelPlan(n, ranks, **keywords)
    assert arrays.as_dict() == plan
    for name in ("queries", "key_span", "window_span", "keys", "window"):
        values = arrays.ranges(name)
        for r, chunks in enumerate(plan["chunks"]):
            for c, chunk in enumerate(chunks):
                want = chunk[name]
                got = values[r, c]
                assert ([tuple(x) for x in got] if got.ndim == 2 else tuple(got)) == \
                    ([tuple(x) for x in want] if isinstance(want, list) else tuple(want))


def test_alibi_slopes_follow_the_bloom_and_mpt_rule():
    """The library's slopes (the model's sigmas) against the rule: with p = 2^floor(log2 H),
    m_h = 2^(-b (h+1) / p) for h < p, then 2^(-b (2 (h-p) + 1) / (2 p))."""
    for max_bias in (8.0, 16.0):
        for heads in (1, 2, 3, 5, 8, 12, 24, 32, 40, 64):
            p = 1 << (heads.bit_length() - 1)
            h = np.arange(heads, dtype=np.float64)
            rule = np.exp2(-np.where(h < p, max_bias * (h + 1) / p,
                                     max_bias * (2 * (h - p) + 1) / (2.0 * p)))
            np.testing.assert_allclose(poslsh.alibi_slopes(heads, max_bias=max_bias), rule,
                                       rtol=1e-15)
            np.testing.assert_allclose(cpm.alibi_sigmas(heads, max_bias), 1.0 / rule, rtol=1e-15)
    sigmas = cpm.alibi_sigmas(32, 16.0)  # MPT-7B-StoryWriter
    assert sigmas.max() == 65536.0 and sigmas.min() == pytest.approx(math.sqrt(2))


def kernel_h(problem, t):
    """h(t) summed over query heads, for t >= 0 (the module docstring's law)."""
    total = np.zeros(len(t))
    for h, sigma in enumerate(problem.sigmas):
        if problem.method == "exact_tiled":
            total += 1.0
        elif problem.method == "exact_banded":
            total += t <= poslsh.band_for_bias_error(sigma, problem.band_error)
        elif problem.method == "fixed_blocks":
            total += np.maximum(0.0, 1 - t / (2 * sigma))
        elif problem.method == "lsh_per_sample":
            total += problem.samples * np.exp(-t / sigma)
        else:
            with np.errstate(divide="ignore"):  # t = 0: log1p(-1) = -inf, h = 1
                total += -np.expm1(problem.samples * np.log1p(-np.exp(-t / sigma)))
    return total


@pytest.mark.parametrize("method", cpm.METHODS)
@pytest.mark.parametrize("masking", cpm.MASKINGS)
@pytest.mark.parametrize("samples", [1, 16, 32])
def test_expected_pairs_match_direct_sums(method, masking, samples):
    if samples != 16 and method not in ("lsh_fused", "lsh_per_sample"):
        pytest.skip("samples only matter to the LSH methods")
    n = 240
    problem = cpm.Problem(n=n, ranks=2, sigmas=(0.7, 3.0, 35.0, 2e3, 1e6), method=method,
                          masking=masking, samples=samples)
    i = np.arange(n)
    t = (i[:, None] - i[None, :]).ravel()
    weight = np.where(t >= 0, kernel_h(problem, np.abs(t)), 0.0).reshape(n, n)
    if masking == "bidirectional":
        weight = weight + weight.T - np.diag(np.full(n, kernel_h(problem, np.zeros(1))[0]))
    rng = np.random.default_rng(5)
    for _ in range(30):
        qa, qb = np.sort(rng.integers(0, n + 1, 2))
        ka, kb = np.sort(rng.integers(0, n + 1, 2))
        want = weight[qa:qb, ka:kb].sum()
        got = cpm.pairs(problem, (qa, qb), (ka, kb))
        assert got == pytest.approx(want, rel=1e-9 if samples <= 24 else 1e-7, abs=1e-6)


def test_expected_lsh_pairs_match_lsh_fused_pair_count():
    """The sum over ranks of the model's pairs is the mean of the fused kernel's pair count."""
    n, s = 3000, 16
    for masking in cpm.MASKINGS:
        for sigma in (2.0, 50.0, 700.0):
            problem = cpm.Problem(n=n, ranks=4, sigmas=(sigma,), masking=masking, samples=s)
            model = cpm.halo_compute(problem).own_all.sum()
            counts = [poslsh.lsh_fused_pair_count(poslsh.rbf_hashes(sigma, s, seed, 0), n,
                                                  masking=masking)
                      for seed in range(40)]
            spread = np.std(counts) / math.sqrt(len(counts))
            assert abs(np.mean(counts) - model) < 5 * spread + 1e-3 * model
    # fixed_blocks: the offset-averaged grid against its one fixed grid, within a block's pairs.
    for sigma in (3.0, 40.0):
        problem = cpm.Problem(n=n, ranks=4, sigmas=(sigma,), method="fixed_blocks")
        model = cpm.halo_compute(problem).own_all.sum()
        exact = poslsh.lsh_fused_pair_count(poslsh.fixed_blocks_hash(sigma), n)
        assert abs(model - exact) <= 2 * (2 * sigma) ** 2


@pytest.mark.parametrize("layout", cpm.LAYOUTS)
@pytest.mark.parametrize("masking", cpm.MASKINGS)
@pytest.mark.parametrize("method", ["lsh_fused", "exact_banded", "lsh_per_sample"])
def test_backward_pairs_match_direct_sums(method, masking, layout):
    n = 300
    problem = cpm.Problem(n=n, ranks=3, sigmas=(1.5, 9.0, 60.0, 500.0), kv_heads=2,
                          method=method, masking=masking, layout=layout)
    halos = cpm.halo_ranges(problem)
    i = np.arange(n)
    t = i[:, None] - i[None, :]
    weights = []
    for h, sigma in enumerate(problem.sigmas):
        one = cpm.Problem(n=n, ranks=3, sigmas=(sigma,), method=method, masking=masking)
        w = np.where(t >= 0, kernel_h(one, np.abs(t).ravel()).reshape(n, n), 0.0)
        if masking == "bidirectional":
            w = w + w.T - np.diag(np.full(n, kernel_h(one, np.zeros(1))[0]))
        weights.append(w)
    starts, ends = cpm.shards(problem)
    compute = cpm.halo_compute(problem)
    own_compute = cpm.halo_compute(problem, backward_pairs="own")
    d, dv = problem.d, problem.dv
    for r in range(problem.ranks):
        window = sum(weights[h][x:y, x:y].sum()
                     for h in range(problem.heads)
                     for x, y in halos.window[r, :, h // problem.group])
        assert compute.window[r] == pytest.approx(window, rel=1e-9)
        own = np.zeros(n, bool)
        for s, e in zip(starts[r], ends[r]):
            own[s:e] = True
        total = sum(w[np.ix_(own, own)].sum() * (6 * d + 4 * dv)
                    + w[np.ix_(own, ~own)].sum() * (4 * d + 2 * dv)
                    + w[np.ix_(~own, own)].sum() * (4 * d + 4 * dv) for w in weights)
        assert own_compute.backward_flops[r] == pytest.approx(total, rel=1e-9)
        assert compute.backward_flops[r] == pytest.approx((6 * d + 4 * dv) * window, rel=1e-9)
        assert compute.forward_flops[r] == pytest.approx(
            2 * (d + dv) * sum(w[own].sum() for w in weights), rel=1e-9)


@pytest.mark.parametrize("layout", cpm.LAYOUTS)
@pytest.mark.parametrize("masking", cpm.MASKINGS)
@pytest.mark.parametrize("n", [4096, 4099])  # equal chunks, and unequal ones
def test_ring_pairs_are_the_pairs_of_each_step(layout, masking, n):
    ranks = 4
    for method in ("exact_tiled", "lsh_fused", "exact_banded"):
        problem = cpm.Problem(n=n, ranks=ranks, sigmas=(3.0, 90.0, 2e3), layout=layout,
                              method=method, masking=masking)
        steps = cpm.ring_pairs(problem)
        starts, ends = cpm.shards(problem)
        for r in range(ranks):
            for k in range(ranks):
                owner = (r - k) % ranks
                want = cpm.pairs(problem, (starts[r][:, None], ends[r][:, None]),
                                 (starts[owner][None, :], ends[owner][None, :])).sum()
                assert steps[r, k] == pytest.approx(want, rel=1e-9, abs=1e-6)
        np.testing.assert_allclose(steps.sum(axis=1), cpm.halo_compute(problem).own_all,
                                   rtol=1e-9)
    exact = cpm.Problem(n=n, ranks=ranks, sigmas=(1.0, 2.0), layout=layout, masking=masking,
                        method="exact_tiled")
    total = n * (n + 1) / 2 if masking == "causal" else n * n
    assert cpm.ring_pairs(exact).sum() == pytest.approx(2 * total)


@pytest.mark.parametrize("layout", cpm.LAYOUTS)
def test_ring_bytes_closed_form(layout):
    """R | n: each rank receives (R-1)/R n kv_heads (d + dv) itemsize bytes forward, twice that
    backward (the ring again, then the partials of its shard from the R - 1 others)."""
    for n, ranks in ((2**20, 8), (2**24, 1024), (4096, 16)):
        problem = cpm.Problem(n=n, ranks=ranks, sigmas=(1.0,) * 8, layout=layout, kv_heads=4,
                              d=128, dv=64, itemsize=2, method="exact_tiled")
        ring = cpm.model_bytes(problem, "ring")
        closed = (ranks - 1) * n // ranks * 4 * (128 + 64) * 2
        assert np.all(ring["forward_bytes_per_rank"] == closed)
        assert np.all(ring["backward_bytes_per_rank"] == 2 * closed)
    problem = cpm.Problem(n=1001, ranks=7, sigmas=(1.0,), layout=layout, d=8)
    forward = cpm.model_bytes(problem, "ring")["forward_bytes_per_rank"]
    assert forward.sum() == (7 - 1) * 1001 * problem.kv_row_bytes  # each shard to R-1 ranks


@pytest.mark.parametrize("layout", cpm.LAYOUTS)
@pytest.mark.parametrize("n,ranks", [(1001, 7), (5000, 3), (301, 4), (10, 2), (7, 1)])
def test_ring_bytes_follow_the_schedule(layout, n, ranks):
    """Step k of R - 1: rank r sends the shard it holds (rank r - k's) to r + 1 and receives
    rank r - k - 1's; the backward runs the ring again, then sends each other rank the dK/dV
    partials of its shard. Unequal shards: a rank sends every shard but rank r + 1's."""
    problem = cpm.Problem(n=n, ranks=ranks, sigmas=(1.0,) * 8, layout=layout, kv_heads=4,
                          d=32, dv=32, itemsize=4)
    own = cpm.shard_rows(problem)
    row = 4 * (32 + 32) * 4
    sent, received = np.zeros(ranks, np.int64), np.zeros(ranks, np.int64)
    for r in range(ranks):
        for k in range(ranks - 1):
            sent[r] += own[(r - k) % ranks] * row
            received[r] += own[(r - k - 1) % ranks] * row
    ring = cpm.model_bytes(problem, "ring")
    forward, backward = ring["forward_bytes_per_rank"], ring["backward_bytes_per_rank"]
    forward_sent = ring["forward_sent_bytes_per_rank"]
    backward_sent = ring["backward_sent_bytes_per_rank"]
    np.testing.assert_array_equal(forward, received)
    np.testing.assert_array_equal(forward_sent, sent)
    partials_sent = np.array([(n - own[r]) * row for r in range(ranks)])
    partials_received = (ranks - 1) * own * row
    np.testing.assert_array_equal(backward, received + partials_received)
    np.testing.assert_array_equal(backward_sent, sent + partials_sent)
    assert forward.sum() == forward_sent.sum() and backward.sum() == backward_sent.sum()
    np.testing.assert_array_equal(ring["forward_messages_per_rank"], [2 * (ranks - 1)] * ranks)
    np.testing.assert_array_equal(ring["backward_messages_per_rank"], [4 * (ranks - 1)] * ranks)
    if (n, ranks, layout) == (5000, 3, "contiguous"):  # shards 1666, 1667, 1667
        assert forward_sent[2] == 3414016 and forward[2] == 3412992


def test_check_accepts_the_model_and_flags_a_difference(tmp_path, capsys):
    records = []
    for method, layout, masking in (("lsh_fused", "zigzag", "causal"),
                                    ("exact_banded", "contiguous", "bidirectional"),
                                    ("fixed_blocks", "contiguous", "causal")):
        problem = cpm.Problem(n=5000, ranks=4, sigmas=tuple(cpm.alibi_sigmas(4)), layout=layout,
                              method=method, masking=masking, samples=16, seed=3, kv_heads=2,
                              d=32, dv=32, itemsize=2)
        model = cpm.model_bytes(problem)
        records.append(dict(n=5000, R=4, layout=layout, method=method, masking=masking, heads=4,
                            kv_heads=2, d=32, dv=32, itemsize=2, sigmas=list(problem.sigmas),
                            samples=16, seed=3,
                            forward_bytes_per_rank=model["forward_bytes_per_rank"].tolist(),
                            backward_bytes_per_rank=model["backward_bytes_per_rank"].tolist()))
    ring = cpm.model_bytes(cpm.Problem(n=5000, ranks=4, sigmas=tuple(cpm.alibi_sigmas(2)),
                                       method="exact_tiled", layout="zigzag"), "ring")
    records.append(dict(n=5000, R=4, layout="zigzag", method="exact_tiled", masking="causal",
                        heads=2, kv_heads=2, d=128, dv=128, itemsize=2, sigmas=None, samples=16,
                        seed=0, forward_bytes_per_rank=ring["forward_bytes_per_rank"].tolist(),
                        backward_bytes_per_rank=ring["backward_bytes_per_rank"].tolist()))
    # A local window (exact_tiled with window: halos) is a halo record.
    windowed = cpm.Problem(n=5000, ranks=4, sigmas=tuple(cpm.alibi_sigmas(2)),
                           method="exact_tiled", window=(300, 0), d=32, itemsize=4)
    model = cpm.model_bytes(windowed)
    assert 0 < model["forward_bytes_per_rank"].max() < ring["forward_bytes_per_rank"].min()
    records.append(dict(n=5000, R=4, layout="contiguous", method="exact_tiled", masking="causal",
                        heads=2, kv_heads=2, d=32, dv=32, itemsize=4, sigmas=None, window=[300, 0],
                        transport="halo",
                        forward_bytes_per_rank=model["forward_bytes_per_rank"].tolist()))
    ok, table = cpm.check(records)
    assert ok and table.count("\n") == 2 + 2 * (len(records) - 1)
    path = tmp_path / "bytes.json"
    path.write_text(json.dumps(records))
    assert cpm.main(["--check", str(path)]) == 0
    records[0]["forward_bytes_per_rank"][1] += 4
    path.write_text(json.dumps(records))
    assert cpm.main(["--check", str(path)]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_projection_runs_quickly():
    started = time.perf_counter()
    halos = cpm.halo_ranges(cpm.model_problem("mpt-7b-storywriter", 2**24, 1024, "lsh_fused",
                                              "zigzag"))
    assert time.perf_counter() - started < 5
    assert halos.forward_recv.max() > 0
    started = time.perf_counter()
    records = cpm.projection(ranks=(8, 1024), lengths=(2**20, 2**24))
    assert time.perf_counter() - started < 20
    assert len(records) == 2 * 2 * 2 * len(cpm.PROJECTION_ROWS)
    for x in records:
        assert x["total"] >= x["compute"] > 0
        if x["transport"] == "halo":
            ring = next(y for y in records if y["transport"] == "ring" and
                        all(y[k] == x[k] for k in ("model", "n", "R")))
            assert 0 < x["halo_bytes"] < ring["ring_bytes"]
    table = cpm.full_table(records)
    assert table.count("\n") == len(records) + 1


def test_hybrid_sends_the_widest_heads_around_the_ring():
    machine = cpm.Machine()
    mpt = cpm.model_problem("mpt-7b-storywriter", 2**20, 64, "lsh_fused", "contiguous")
    wide = cpm.ring_heads(mpt, machine)
    order = np.argsort(mpt.sigmas)  # one query head per K/V head here
    assert 0 < wide.sum() < mpt.kv_heads and np.all(np.diff(wide[order].astype(int)) >= 0)
    # A subset keeps its heads' hashes: its halos are those heads' halos in the full problem,
    # and its bytes those heads' rows.
    subset = cpm.head_subset(mpt, wide)
    full, part = cpm.halo_ranges(mpt), cpm.halo_ranges(subset)
    np.testing.assert_array_equal(part.keys, full.keys[:, :, wide])
    np.testing.assert_array_equal(part.window, full.window[:, :, wide])
    np.testing.assert_array_equal(part.forward_recv, full.forward_bytes[:, wide].sum(axis=1))
    assert subset.heads == wide.sum() and cpm.halo_compute(subset).own_all.sum() < \
        cpm.halo_compute(mpt).own_all.sum()
    hybrid = cpm.estimate(mpt, "hybrid", machine)
    assert hybrid.extra["ring_kv_heads"] == wide.sum()
    assert hybrid.total < min(cpm.estimate(mpt, t, machine).total for t in ("halo", "ring"))
    bloom = cpm.model_problem("bloom-7b1", 2**24, 64, "lsh_fused", "contiguous")
    assert not cpm.ring_heads(bloom, machine).any()
    assert cpm.estimate(bloom, "hybrid", machine).total == cpm.estimate(bloom, "halo",
                                                                         machine).total


def test_update_docs_rewrites_the_generated_blocks(tmp_path):
    path = tmp_path / "doc.md"
    path.write_text("# Title\n\ntext\n<!-- context_parallel_model: one -->\nold table\n"
                    "<!-- end context_parallel_model -->\nmore text\n"
                    "<!-- context_parallel_model: two -->\n<!-- end context_parallel_model -->\n")
    machine = cpm.Machine(latency=1e-6, bandwidth=1e9, flops_rate=2e9)
    assert cpm.update_docs(str(path), {"one": "| a |\n|---|\n| 1 |"}, "the command", machine) == \
        ["one"]
    text = path.read_text()
    assert "old table" not in text and "| a |\n|---|\n| 1 |\n<!-- end" in text
    assert "by `the command`" in text and "commit" in text and "latency 1e-06 s" in text
    assert text.startswith("# Title\n\ntext\n") and text.endswith(
        "more text\n<!-- context_parallel_model: two -->\n<!-- end context_parallel_model -->\n")
    with pytest.raises(ValueError, match="three"):
        cpm.update_docs(str(path), {"three": "x"}, "c", machine)


# The model against poslsh.distributed's stats. -------------------------------------------------
#
# One spawned gloo world per R (2, 3, 4) on 127.0.0.1 runs context_parallel_attention forward and
# backward for each case with stats= and reports every rank's stats; the model's bytes (received
# and sent, forward and backward) and messages must equal them exactly. Every wait is bounded
# (gloo timeout in the workers, a deadline in the parent): a broken world fails, never hangs.

try:
    import torch
except ImportError:  # the spawned-world test skips
    torch = None

SPAWN_RANKS = [2, 3, 4]
SPAWN_N = 301  # unequal shards for every R
SPAWN_GLOO_TIMEOUT = 60.0  # seconds, every wait in a worker
SPAWN_DEADLINE = 900.0  # seconds, a whole world in the parent (a guard against a hang)
SPAWN_SIGMAS = (2.0, 9.0, 30.0, 120.0)  # halos from a few rows to several shards


@dataclasses.dataclass(frozen=True)
class SpawnCase:
    name: str
    method: str
    masking: str
    layout: str
    dtype: str = "float32"
    d: int = 8
    dv: int = 8

    @property
    def itemsize(self):
        return 4 if self.dtype == "float32" else 8

    @property
    def transport(self):
        return "ring" if self.method == "exact_tiled" else "halo"


SPAWN_CASES = [
    SpawnCase("lsh_fused-causal", "lsh_fused", "causal", "contiguous"),
    SpawnCase("lsh_fused-causal-zigzag-f64", "lsh_fused", "causal", "zigzag", "float64", 16, 8),
    SpawnCase("exact_banded-bidirectional-zigzag", "exact_banded", "bidirectional", "zigzag"),
    SpawnCase("exact_tiled-ring-causal", "exact_tiled", "causal", "contiguous"),
    SpawnCase("exact_tiled-ring-bidirectional-zigzag-f64", "exact_tiled", "bidirectional",
              "zigzag", "float64", 8, 16),
]
SPAWN_KEYWORDS = dict(sigmas=list(SPAWN_SIGMAS), samples=8, seed=5)
SPAWN_KEYWORDS_MODEL = dict(samples=SPAWN_KEYWORDS["samples"], seed=SPAWN_KEYWORDS["seed"])


def spawn_stats(case, index, rank, world_size):
    """This rank's stats after the forward and backward of one case."""
    from poslsh import distributed as pdist

    generator = torch.Generator().manual_seed(100 + index)
    dtype = getattr(torch, case.dtype)
    heads, kv_heads = len(SPAWN_SIGMAS), 2
    whole = [torch.rand((SPAWN_N, h, width), generator=generator, dtype=dtype) - 0.5
             for h, width in ((heads, case.d), (kv_heads, case.d), (kv_heads, case.dv),
                              (heads, case.dv))]
    q, k, v, dout = (pdist.shard(x, rank, world_size, case.layout).clone() for x in whole)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    stats = {}
    out = pdist.context_parallel_attention(q, k, v, method=case.method, masking=case.masking,
                                           layout=case.layout, num_threads=1, stats=stats,
                                           **SPAWN_KEYWORDS)
    out.backward(dout)
    return dict(stats)


def spawn_checks(rank, world_size, report):
    for index, case in enumerate(SPAWN_CASES):
        try:
            report[case.name] = spawn_stats(case, index, rank, world_size)
        except Exception:  # noqa: BLE001 -- reported to the parent
            report[case.name] = traceback.format_exc()


_SPAWNED = {}


def spawned_world(world_size):
    """{rank: {case: stats dict or traceback}} of one spawned world (run once per R)."""
    if world_size not in _SPAWNED:
        _SPAWNED[world_size] = run_world(spawn_checks, world_size, SPAWN_DEADLINE, SPAWN_GLOO_TIMEOUT)
    return _SPAWNED[world_size]


@pytest.mark.skipif(torch is None, reason="PyTorch is not installed")
@pytest.mark.parametrize("case", SPAWN_CASES, ids=[case.name for case in SPAWN_CASES])
@pytest.mark.parametrize("world_size", SPAWN_RANKS)
def test_model_bytes_equal_the_distributed_stats(world_size, case):
    reports = spawned_world(world_size)
    measured = []
    for rank in range(world_size):
        report = reports[rank]
        assert "world" not in report, f"rank {rank}: {report['world']}"
        assert isinstance(report.get(case.name), dict), f"rank {rank}: {report.get(case.name)}"
        measured.append(report[case.name])
    problem = cpm.Problem(n=SPAWN_N, ranks=world_size, sigmas=SPAWN_SIGMAS, layout=case.layout,
                          method=case.method, masking=case.masking, kv_heads=2, d=case.d,
                          dv=case.dv, itemsize=case.itemsize, **SPAWN_KEYWORDS_MODEL)
    model = cpm.model_bytes(problem, case.transport)
    fields = {"forward_bytes_per_rank": "forward_bytes_received",
              "backward_bytes_per_rank": "backward_bytes_received",
              "forward_sent_bytes_per_rank": "forward_bytes_sent",
              "backward_sent_bytes_per_rank": "backward_bytes_sent",
              "forward_messages_per_rank": "forward_messages",
              "backward_messages_per_rank": "backward_messages"}
    got = {name: [stats[key] for stats in measured] for name, key in fields.items()}
    want = {name: [int(x) for x in model[name]] for name in fields}
    assert got == want
    # The same as a --check record.
    record = dict(n=SPAWN_N, R=world_size, layout=case.layout, method=case.method,
                  masking=case.masking, heads=len(SPAWN_SIGMAS), kv_heads=2, d=case.d,
                  dv=case.dv, itemsize=case.itemsize, sigmas=list(SPAWN_SIGMAS),
                  transport=case.transport, **SPAWN_KEYWORDS_MODEL, **got)
    ok, table = cpm.check([record])
    assert ok, table

