"""bench/context_parallel_model.py: halo ranges and bytes against a brute force over every
position, the expected pair counts against direct sums and lsh_fused_pair_count, ring bytes
against the closed form and the ring's schedule, the --check format, the projection's speed,
and the model's bytes and messages against poslsh.distributed's stats in spawned gloo worlds
(R = 2, 3, 4)."""

import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

import poslsh
from spawned_world import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import context_parallel_model as cpm  # noqa: E402


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
        widths, offsets = cpm.hash_table(problem)
        b = bins_of(widths[h], offsets[h], n)
        reach = (b[:, :, None] == b[:, None, :]).any(axis=0)
    if problem.masking == "causal":
        reach &= i[None, :] <= i[:, None]
    return reach


def rows_of(intervals):
    return set(p for x, y in intervals for p in range(x, y))


def brute_force(problem):
    """Per rank r and kv head g: forward halo rows, backward window rows (sets, own rows out;
    "chunk_forward", "chunk_window": one set per chunk), and per chunk (a, b) from the positions
    the chunk's queries reach and that reach its keys."""
    starts, ends = cpm.shards(problem)
    reach = [reach_matrix(problem, h) for h in range(problem.heads)]
    out = {}
    for r in range(problem.ranks):
        own = rows_of(zip(starts[r], ends[r]))
        for g in range(problem.kv_heads):
            heads = range(g * problem.group, (g + 1) * problem.group)
            group_reach = np.logical_or.reduce([reach[h] for h in heads])
            keys, ab, chunk_keys = set(), [], []
            for s, e in zip(starts[r], ends[r]):
                reached = np.flatnonzero(group_reach[s:e].any(axis=0))  # keys of the chunk
                reaching = np.flatnonzero(group_reach[:, s:e].any(axis=1))  # its keys' queries
                ab.append((int(reached.min()), int(reaching.max()) + 1))
                keys |= set(reached.tolist())
                chunk_keys.append(set(reached.tolist()) - own)
            out[r, g] = dict(forward=keys - own, ab=ab, own=own, chunk_forward=chunk_keys)
    for (r, g), entry in out.items():  # the backward window of each convention
        windows = []
        for c, (a, b) in enumerate(entry["ab"]):
            if problem.window == "tile":
                windows.append(set(range(a // 64 * 64, b)))
            elif problem.window == "exact":
                windows.append(set(range(a, b)))
            else:
                spans = [out[r, h]["ab"][c] for h in range(problem.kv_heads)]
                windows.append(set(range(min(x for x, _ in spans) // 64 * 64,
                                         max(y for _, y in spans))))
        entry["window"] = set().union(*windows) - entry["own"]
        entry["chunk_window"] = [w - entry["own"] for w in windows]
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


def row_lists(entry, chunks):
    """[(forward rows, window rows)] of one rank and head: per chunk ("separate"), or their
    unions ("merged")."""
    if chunks == "merged":
        return [(entry["forward"], entry["window"])]
    return list(zip(entry["chunk_forward"], entry["chunk_window"]))


@pytest.mark.parametrize("window", cpm.WINDOWS)
@pytest.mark.parametrize("layout", cpm.LAYOUTS)
@pytest.mark.parametrize("masking", cpm.MASKINGS)
@pytest.mark.parametrize("method,n,ranks,sigmas,kv_heads", CASES)
def test_halo_ranges_match_brute_force(method, n, ranks, sigmas, kv_heads, layout, masking,
                                       window):
    problem = cpm.Problem(n=n, ranks=ranks, sigmas=sigmas, layout=layout, method=method,
                          masking=masking, samples=6, seed=11, kv_heads=kv_heads, d=16, dv=8,
                          itemsize=2, stat_itemsize=4, window=window)
    expected = brute_force(problem)
    for chunks in cpm.CHUNK_HALOS if layout == "zigzag" else ("separate",):
        for payload in cpm.BACKWARD_PAYLOADS:
            check_halos(dataclasses.replace(problem, chunks=chunks, backward_payload=payload),
                        expected)


def check_halos(problem, expected):
    n, ranks, layout = problem.n, problem.ranks, problem.layout
    halos = cpm.halo_ranges(problem)
    bounds, owner = cpm.chunk_bounds(n, ranks, layout)
    row_owner = np.repeat(owner, np.diff(bounds))
    kv, G, itemsize = problem.kv_row_bytes, problem.group, problem.itemsize
    d, dv = problem.d, problem.dv
    if problem.backward_payload == "out_lse":  # K, V; Q, out, dO, lse per query head
        window_bytes, new_kv_bytes = (d + dv + G * (d + 2 * dv + 1)) * itemsize, 0
    else:  # Q, dO, lse, D per query head; K, V if not received forward
        window_bytes, new_kv_bytes = G * ((d + dv) * itemsize + 2 * problem.stat_itemsize), kv
    recv_f = np.zeros(ranks, np.int64)
    recv_b = np.zeros(ranks, np.int64)
    sent_f = np.zeros(ranks, np.int64)
    sent_b = np.zeros(ranks, np.int64)
    peers_f = [set() for _ in range(ranks)]
    peers_b = [set() for _ in range(ranks)]
    for (r, g), want in expected.items():
        assert [(int(halos.a[r, c, g]), int(halos.b[r, c, g]))
                for c in range(halos.a.shape[1])] == want["ab"]
        assert rows_of(halos.rank_intervals(r, g)) == want["forward"]
        assert rows_of(halos.rank_intervals(r, g, "window")) == want["window"]
        lists = row_lists(want, problem.chunks)
        assert halos.forward_rows[r, g] == sum(len(f) for f, _ in lists)
        assert halos.window_rows[r, g] == sum(len(w) for _, w in lists)
        for forward, window in lists:
            recv_f[r] += len(forward) * kv
            recv_b[r] += len(window) * window_bytes + len(window - forward) * new_kv_bytes
            for row in forward:
                sent_f[row_owner[row]] += kv
                peers_f[r].add(row_owner[row])
            for row in window:
                sent_b[row_owner[row]] += window_bytes + (new_kv_bytes if row not in forward else 0)
                peers_b[r].add(row_owner[row])
    np.testing.assert_array_equal(halos.forward_recv, recv_f)
    np.testing.assert_array_equal(halos.backward_recv, recv_b)
    np.testing.assert_array_equal(halos.forward_sent, sent_f)
    np.testing.assert_array_equal(halos.backward_sent, sent_b)
    np.testing.assert_array_equal(halos.forward_peers_in, [len(p) for p in peers_f])
    np.testing.assert_array_equal(halos.backward_peers_in, [len(p) for p in peers_b])
    np.testing.assert_array_equal(halos.forward_peers_out,
                                  [sum(o in p for p in peers_f) for o in range(ranks)])
    assert halos.forward_sent.sum() == halos.forward_recv.sum()
    assert halos.backward_sent.sum() == halos.backward_recv.sum()


@pytest.mark.skipif(not hasattr(poslsh, "context_parallel_plan"),
                    reason="poslsh.context_parallel_plan is not bound in this build")
@pytest.mark.parametrize("layout", cpm.LAYOUTS)
@pytest.mark.parametrize("masking", cpm.MASKINGS)
@pytest.mark.parametrize("method,n,ranks,sigmas,kv_heads", CASES)
def test_halo_ranges_match_the_library_plan(method, n, ranks, sigmas, kv_heads, layout,
                                            masking):
    """keys[g] is the forward range, window[g] the "exact" window, window_span the "span"."""
    try:
        plan = poslsh.context_parallel_plan(n, ranks, query_heads=len(sigmas),
                                            kv_heads=kv_heads, layout=layout, method=method,
                                            masking=masking, sigmas=list(sigmas), samples=6,
                                            seed=11)
    except TypeError as error:  # the binding is being written: its signature may move
        pytest.skip(f"context_parallel_plan(n, ranks, query_heads=, layout=, ...): {error}")
    for window in ("exact", "span"):
        problem = cpm.Problem(n=n, ranks=ranks, sigmas=sigmas, layout=layout, method=method,
                              masking=masking, samples=6, seed=11, kv_heads=kv_heads,
                              window=window)
        halos = cpm.halo_ranges(problem)
        for r, chunks in enumerate(plan["chunks"]):
            for c, chunk in enumerate(chunks):
                assert tuple(chunk["queries"]) == (halos.starts[r, c], halos.ends[r, c])
                for g in range(kv_heads):
                    assert tuple(chunk["keys"][g]) == (halos.forward_begin[r, c, g],
                                                       halos.forward_end[r, c, g])
                    if window == "exact":
                        assert tuple(chunk["window"][g]) == (halos.window_begin[r, c, g],
                                                             halos.window_end[r, c, g])
                    else:
                        assert tuple(chunk["window_span"]) == (halos.window_begin[r, c, g],
                                                               halos.window_end[r, c, g])


@pytest.mark.parametrize("sigma", [0.3, 1.0, 2.7, 17.0, 1e4, 1e9])
def test_block_edges_match_the_bins(sigma):
    n = 400
    hashes = poslsh.rbf_hashes(sigma, 8, seed=3, stream=1)
    widths, offsets = np.asarray(hashes.widths), np.asarray(hashes.offsets)
    b = bins_of(widths, offsets, n)
    positions = np.arange(n)
    begin, end = cpm.block_edges(widths[:, None], offsets[:, None], positions[None, :], n)
    for k in range(len(widths)):
        for i in range(0, n, 7):
            same = np.flatnonzero(b[k] == b[k, i])
            assert (begin[k, i], end[k, i]) == (same.min(), same.max() + 1)
    # Huge positions: no materialisation, the edges still bracket the position.
    big = np.array([2**40 - 1, 3 * 2**38 + 5])
    begin, end = cpm.block_edges(widths[:, None], offsets[:, None], big[None, :], 2**40)
    assert np.all(begin <= big) and np.all(end > big) and np.all(end <= 2**40)


def test_alibi_slopes_match_the_library():
    for heads in (1, 2, 3, 5, 8, 12, 24, 32, 40, 64):
        np.testing.assert_allclose(cpm.alibi_slopes(heads), poslsh.alibi_slopes(heads),
                                   rtol=1e-15)
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


@pytest.mark.parametrize("window", cpm.WINDOWS)
@pytest.mark.parametrize("layout", cpm.LAYOUTS)
@pytest.mark.parametrize("masking", cpm.MASKINGS)
@pytest.mark.parametrize("method", ["lsh_fused", "exact_banded", "lsh_per_sample"])
def test_backward_pairs_match_direct_sums(method, masking, layout, window):
    n = 300
    problem = cpm.Problem(n=n, ranks=3, sigmas=(1.5, 9.0, 60.0, 500.0), kv_heads=2,
                          method=method, masking=masking, layout=layout, window=window)
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
    compute = cpm.halo_compute(problem, halos)
    own_compute = cpm.halo_compute(problem, halos, backward_pairs="own")
    d, dv = problem.d, problem.dv
    for r in range(problem.ranks):
        window = sum(weights[h][x:y, x:y].sum()
                     for h in range(problem.heads)
                     for x, y in zip(halos.window_begin[r, :, h // problem.group],
                                     halos.window_end[r, :, h // problem.group]))
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
    for n, ranks in ((2**20, 8), (2**24, 1024), (4096, 16)):
        problem = cpm.Problem(n=n, ranks=ranks, sigmas=(1.0,) * 8, layout=layout, kv_heads=4,
                              d=128, dv=64, itemsize=2)
        forward, backward = cpm.ring_bytes(problem)
        closed = cpm.ring_bytes_closed_form(n, ranks, 4, 128, 64, 2)
        assert np.all(forward == closed) and np.all(backward == 2 * closed)
    problem = cpm.Problem(n=1001, ranks=7, sigmas=(1.0,), layout=layout, d=8)
    forward, _ = cpm.ring_bytes(problem)
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
    forward, backward = cpm.ring_bytes(problem)
    forward_sent, backward_sent = cpm.ring_bytes_sent(problem)
    np.testing.assert_array_equal(forward, received)
    np.testing.assert_array_equal(forward_sent, sent)
    partials_sent = np.array([(n - own[r]) * row for r in range(ranks)])
    partials_received = (ranks - 1) * own * row
    np.testing.assert_array_equal(backward, received + partials_received)
    np.testing.assert_array_equal(backward_sent, sent + partials_sent)
    assert forward.sum() == forward_sent.sum() and backward.sum() == backward_sent.sum()
    forward_messages, backward_messages = cpm.ring_messages(problem)
    np.testing.assert_array_equal(forward_messages, [2 * (ranks - 1)] * ranks)
    np.testing.assert_array_equal(backward_messages, [4 * (ranks - 1)] * ranks)
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
    ring = cpm.Problem(n=5000, ranks=4, sigmas=(1.0, 2.0), method="exact_tiled", layout="zigzag")
    forward, backward = cpm.ring_bytes(ring)
    records.append(dict(n=5000, R=4, layout="zigzag", method="exact_tiled", masking="causal",
                        heads=2, kv_heads=2, d=128, dv=128, itemsize=2, sigmas=None, samples=16,
                        seed=0, forward_bytes_per_rank=forward.tolist(),
                        backward_bytes_per_rank=backward.tolist()))
    ok, table = cpm.check(records)
    assert ok and table.count("\n") == 2 + 2 * len(records) - 1
    # A report of examples/mpi_context_parallel --json: its model record, chunks "merged" (the
    # union of a zigzag rank's chunk halos); a null model record is skipped.
    banded = records[1]  # exact_banded, bidirectional: bands wider than a chunk
    merged = cpm.Problem(n=5000, ranks=4, sigmas=tuple(banded["sigmas"]), layout="zigzag",
                         method=banded["method"], masking=banded["masking"], kv_heads=2, d=32,
                         dv=32, itemsize=2, chunks="merged")
    model = cpm.model_bytes(merged)
    report = dict(program="mpi_context_parallel", model_record=dict(
        {k: v for k, v in banded.items() if not k.endswith("_per_rank")}, layout="zigzag",
        forward_bytes_per_rank=model["forward_bytes_per_rank"].tolist(),
        forward_sent_bytes_per_rank=model["forward_sent_bytes_per_rank"].tolist()))
    separate = cpm.model_bytes(dataclasses.replace(merged, chunks="separate"))
    assert separate["forward_bytes_per_rank"].sum() > model["forward_bytes_per_rank"].sum()
    unwrapped = cpm.measured_records([report, dict(program="mpi_context_parallel",
                                                   model_record=None)])
    assert unwrapped[0]["chunks"] == "merged" and unwrapped[1] is None
    ok, table = cpm.check(unwrapped)
    assert ok and "skipped" in table
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert cpm.main(["--check", str(path)]) == 0
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
    # A subset keeps its heads' hashes: its halos are those heads' halos in the full problem.
    subset = cpm.head_subset(mpt, wide)
    full, part = cpm.halo_ranges(mpt), cpm.halo_ranges(subset)
    np.testing.assert_array_equal(part.a, full.a[:, :, wide])
    np.testing.assert_array_equal(part.b, full.b[:, :, wide])
    hybrid = cpm.estimate(mpt, "hybrid", machine)
    assert hybrid.extra["ring_kv_heads"] == wide.sum()
    assert hybrid.total < min(cpm.estimate(mpt, t, machine).total for t in ("halo", "ring"))
    bloom = cpm.model_problem("bloom-7b1", 2**24, 64, "lsh_fused", "contiguous")
    assert not cpm.ring_heads(bloom, machine).any()
    assert cpm.estimate(bloom, "hybrid", machine).total == cpm.estimate(bloom, "halo",
                                                                         machine).total


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

