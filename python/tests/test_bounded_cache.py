"""poslsh._core.BoundedKVCache: chunked prefill then decode steps, every output bitwise that of
multihead_attention over every key (the same heads), the memory bounded by the live keys, pages
shared between sequences, and bad input named (nothing changed)."""

import numpy as np
import pytest

import poslsh
from poslsh._core import BoundedKVCache

HEADS, KV_HEADS, DIM, DIM_V = 4, 2, 16, 24
SIGMAS = [2.0, 8.0, 20.0, 50.0]


def _inputs(n, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, HEADS, DIM)).astype(dtype)
    k = rng.standard_normal((n, KV_HEADS, DIM)).astype(dtype)
    v = rng.standard_normal((n, KV_HEADS, DIM_V)).astype(dtype)
    return q, k, v


def _method_keywords(method, window=(-1, -1)):
    return dict(method=method, sigmas=SIGMAS, samples=4, seed=3, band_error=1e-3, window=window)


def _full(q, k, v, a, b, masking, keywords):
    return poslsh.multihead_attention(q[a:b], k[:b], v[:b], masking=masking, query_offset=a,
                                      **keywords)


@pytest.mark.parametrize("masking", ["causal", "bidirectional"])
@pytest.mark.parametrize(
    "method,window",
    [("lsh_fused", (-1, -1)), ("lsh_per_sample", (-1, -1)), ("mean_of_outputs", (-1, -1)),
     ("fixed_blocks", (-1, -1)), ("exact_banded", (-1, -1)), ("exact_tiled", (80, -1)),
     ("exact_tiled", (-1, -1))])
def test_prefill_then_decode_is_bitwise_the_full_cache(method, window, masking):
    n, prefill, page = 900, 300, 64
    q, k, v = _inputs(n, 1)
    keywords = _method_keywords(method, window)
    cache = BoundedKVCache(KV_HEADS, DIM, DIM_V, page, KV_HEADS * (n // page + 1),
                           query_heads=HEADS, **keywords)
    seq = cache.open()
    bounds = [0, 170, prefill] + list(range(prefill + 1, n + 1))
    for a, b in zip(bounds[:-1], bounds[1:]):
        cache.append(seq, a, k[a:b], v[a:b])
        got = cache.attention(q[a:b], [seq], masking=masking, num_threads=1)
        want = _full(q, k, v, a, b, masking, keywords)
        assert got.dtype == np.float32 and got.shape == (b - a, HEADS, DIM_V)
        assert np.array_equal(got, want), (a, b)
    keeps_all = method == "exact_tiled" and window[0] < 0
    for g in range(KV_HEADS):
        first = cache.first_key(seq, g)
        assert (first == 0) == keeps_all
        # The head holds its pages from the first key's page to the last written one.
        assert len(cache.held_pages(seq, g)) == -(-n // page) - first // page
    if not keeps_all:
        assert cache.bytes_in_use < cache.full_cache_bytes(seq) / 2


def test_held_pages_follow_the_retention_rule_of_each_kv_head():
    # K/V head 0 reads with sigmas 2 and 8, head 1 with 20 and 50 (the wider keeps more).
    n, page, band_error = 1200, 64, 1e-3
    q, k, v = _inputs(n, 2)
    cache = BoundedKVCache(KV_HEADS, DIM, DIM_V, page, 64, query_heads=HEADS,
                           **_method_keywords("exact_banded"))
    seq = cache.open()
    bands = [poslsh.band_for_bias_error(s, band_error) for s in SIGMAS]
    for t in range(n):
        cache.append(seq, t, k[t:t + 1], v[t:t + 1])
        for g in range(KV_HEADS):
            # Key j is dead once t - j > W for both query heads of the group.
            first_live = max(0, t - max(bands[2 * g], bands[2 * g + 1]))
            assert cache.first_key(seq, g) == first_live // page * page
    assert cache.pages_in_use <= KV_HEADS * (max(bands) // page + 2)


def test_float16_cache_and_float32_queries():
    n, page = 500, 64
    q, k, v = _inputs(n, 3, np.float16)
    keywords = _method_keywords("lsh_fused")
    cache = BoundedKVCache(KV_HEADS, DIM, DIM_V, page, 40, dtype="float16", query_heads=HEADS,
                           **keywords)
    seq = cache.open()
    cache.append(seq, 0, k[:200], v[:200])
    for t in range(200, n):
        cache.append(seq, t, k[t:t + 1], v[t:t + 1])
        got = cache.attention(q[t:t + 1], [seq])
        assert got.dtype == np.float16
        assert np.array_equal(got, _full(q, k, v, t, t + 1, "causal", keywords))
        wide = cache.attention(q[t:t + 1].astype(np.float32), [seq])
        assert wide.dtype == np.float32
        want = poslsh.multihead_attention(q[t:t + 1].astype(np.float32), k[:t + 1], v[:t + 1],
                                          query_offset=t, **keywords)
        assert np.array_equal(wide, want)


def test_sequences_share_the_pool_and_a_batched_call_matches_each():
    n, page = 700, 64
    keywords = _method_keywords("lsh_fused")
    cache = BoundedKVCache(KV_HEADS, DIM, DIM_V, page, 36, query_heads=HEADS, **keywords)
    data = [_inputs(n, 10 + s) for s in range(3)]
    seqs = [cache.open() for _ in data]
    for s, (q, k, v) in zip(seqs, data):
        cache.append(s, 0, k[:50], v[:50])
    holders = {}
    for t in range(50, n):
        for s, (q, k, v) in zip(seqs, data):
            cache.append(s, t, k[t:t + 1], v[t:t + 1])
            for g in range(KV_HEADS):
                for p in cache.held_pages(s, g):
                    holders.setdefault(p, set()).add(s)
        qs = np.stack([q[t] for q, _, _ in data])
        got = cache.attention(qs, seqs, np.arange(4, dtype=np.int32))
        for i, (q, k, v) in enumerate(data):
            assert np.array_equal(got[i:i + 1], _full(q, k, v, t, t + 1, "causal", keywords))
    # Full caches would need 3 x 2 x 11 pages; pages went from one sequence to another.
    assert cache.pages_in_use <= 36
    assert any(len(owners) > 1 for owners in holders.values())
    held = sum(len(cache.held_pages(seqs[0], g)) for g in range(KV_HEADS))
    free = cache.free_pages
    cache.close(seqs[0])
    assert cache.free_pages == free + held
    assert not cache.is_open(seqs[0])


def test_plans_give_the_planned_heads():
    n = 600
    plans = poslsh.plan_heads(4096, SIGMAS, 0.01, head_dim=DIM)
    q, k, v = _inputs(n, 4)
    cache = BoundedKVCache(KV_HEADS, DIM, DIM_V, 64, 40, plans=plans)
    seq = cache.open()
    for a, b in [(0, 256)] + [(t, t + 1) for t in range(256, n)]:
        cache.append(seq, a, k[a:b], v[a:b])
        got = cache.attention(q[a:b], [seq])
        want = poslsh.multihead_attention(q[a:b], k[:b], v[:b], query_offset=a, plans=plans)
        assert np.array_equal(got, want)


def test_bad_input_is_named_and_changes_nothing():
    q, k, v = _inputs(200, 5)
    cache = BoundedKVCache(KV_HEADS, DIM, DIM_V, 64, 4, query_heads=HEADS,
                           **_method_keywords("exact_tiled"))
    seq = cache.open()
    cache.append(seq, 0, k[:64], v[:64])
    state = (cache.length(seq), cache.free_pages,
             [cache.held_pages(seq, g) for g in range(KV_HEADS)])
    with pytest.raises(ValueError, match="'position'"):
        cache.append(seq, 3, k[3:4], v[3:4])
    with pytest.raises(ValueError, match="'keys'"):  # 2 more pages per head, 2 free
        cache.append(seq, 64, k[64:129], v[64:129])
    with pytest.raises(ValueError, match="'values'"):
        cache.append(seq, 64, k[64:65], v[64:66])
    with pytest.raises(TypeError, match="'k'"):
        cache.append(seq, 64, k[64:65].astype(np.float64), v[64:65])
    assert state == (cache.length(seq), cache.free_pages,
                     [cache.held_pages(seq, g) for g in range(KV_HEADS)])
    cache.append(seq, 64, k[64:65], v[64:65])
    with pytest.raises(ValueError, match="'cu_seqlens_q'"):  # a query before the frontier
        cache.attention(q[63:65], [seq])
    with pytest.raises(ValueError, match="'query_offsets'"):
        cache.attention(q[63:64], [seq], query_offsets=[63])
    cache.close(seq)
    with pytest.raises(ValueError, match="'sequence'"):
        cache.append(seq, 65, k[65:66], v[65:66])
    with pytest.raises(ValueError, match="'sequences'"):
        cache.attention(q[64:65], [seq])
    with pytest.raises(ValueError, match="'page_size'"):
        BoundedKVCache(KV_HEADS, DIM, DIM_V, 100, 4, query_heads=HEADS)
    with pytest.raises(ValueError, match="'kv_heads'"):
        BoundedKVCache(3, DIM, DIM_V, 64, 4, query_heads=HEADS)
    with pytest.raises(ValueError, match="'dtype'"):
        BoundedKVCache(KV_HEADS, DIM, DIM_V, 64, 4, query_heads=HEADS, dtype="int8")
