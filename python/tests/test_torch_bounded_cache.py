"""poslsh.torch.BoundedKVCache: chunked prefill then decode steps through the torch API, every
output (and softmax_lse) bitwise flash_attn_with_kvcache's over a full cache of the same heads,
AlibiSelfAttention decoding through a bounded cache bitwise as through a KVCache, the bytes held
bounded by the live keys, and bad input named (nothing changed)."""

import pytest

torch = pytest.importorskip("torch")
import poslsh  # noqa: E402
import poslsh.torch as pt  # noqa: E402

BATCH, HEADS, KV_HEADS, DIM = 2, 4, 2, 16
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.1])  # sigmas 2, 4, 8, 10
PAGE = 64


def _inputs(n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, n, HEADS, DIM, generator=g).to(dtype)
    k = torch.randn(BATCH, n, KV_HEADS, DIM, generator=g).to(dtype)
    v = torch.randn(BATCH, n, KV_HEADS, DIM, generator=g).to(dtype)
    return q, k, v


def _live_pages(t, length, lefts):
    """Pages K/V head g holds at frontier t: from the page of its first live key max(0, t - W_g)
    (W_g the widest band or window of its query heads) to the last written page."""
    return [-(-length // PAGE) - max(0, t - w) // PAGE for w in lefts]


CASES = [("banded", (-1, -1)), ("lsh", (-1, -1)), ("lsh_per_sample", (-1, -1)), ("fixed_blocks", (-1, -1)),
         ("mean_of_outputs", (-1, -1)), ("exact", (80, 0)), ("exact", (-1, -1))]


@pytest.mark.parametrize("method,window,causal", [case + (True,) for case in CASES]
                         + [("banded", (-1, -1), False), ("lsh", (-1, -1), False)])
def test_prefill_then_decode_is_bitwise_flash_attn_with_kvcache(method, window, causal):
    n, dtype = 300, torch.float32
    q, k, v = _inputs(n, 1, dtype)
    keywords = dict(alibi_slopes=SLOPES, causal=causal, window_size=window, method=method, samples=4, seed=3)
    cache = pt.BoundedKVCache(BATCH, HEADS, KV_HEADS, DIM, max_seqlen=n, page_size=PAGE, dtype=dtype, **keywords)
    k_full = torch.zeros(BATCH, n, KV_HEADS, DIM, dtype=dtype)
    v_full = torch.zeros_like(k_full)
    with_lse = method != "mean_of_outputs"
    bounds = [0, 70, 140] + list(range(141, n + 1))
    if method == "banded":
        bands = [poslsh.band_for_bias_error(1.0 / s, 1e-3) for s in SLOPES.tolist()]
        lefts = [max(bands[2 * g], bands[2 * g + 1]) for g in range(KV_HEADS)]
    elif window[0] >= 0:
        lefts = [window[0]] * KV_HEADS
    else:
        lefts = None
    for a, b in zip(bounds[:-1], bounds[1:]):
        step = (q[:, a:b], k[:, a:b], v[:, a:b])
        want = pt.flash_attn_with_kvcache(step[0], k_full, v_full, k=step[1], v=step[2], cache_seqlens=a,
                                          return_softmax_lse=with_lse, **keywords)
        got = cache.attention(*step, return_softmax_lse=with_lse)
        if with_lse:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (a, b)
            assert got[1].shape == (BATCH, HEADS, b - a)
        else:
            assert torch.equal(got, want), (a, b)
        if lefts is not None:
            pages = _live_pages(a, b, lefts)
            assert cache.bytes_in_use == BATCH * sum(pages) * cache.core.page_bytes, (a, b)
    assert cache.cache_seqlens.tolist() == [n] * BATCH
    assert cache.full_cache_bytes() == BATCH * n * KV_HEADS * 2 * DIM * 4
    if method == "exact" and window == (-1, -1):
        assert cache.bytes_in_use == BATCH * KV_HEADS * -(-n // PAGE) * cache.core.page_bytes  # every key
    else:
        assert cache.bytes_in_use <= cache.full_cache_bytes() / 2


@pytest.mark.parametrize("dtype,q_dtype,method", [(torch.bfloat16, torch.bfloat16, "banded"),
                                                   (torch.bfloat16, torch.float32, "lsh"),
                                                   (torch.float16, torch.float16, "lsh"),
                                                   (torch.float16, torch.float32, "banded")])
def test_half_precision_caches(dtype, q_dtype, method):
    n = 250
    q, k, v = _inputs(n, 2, dtype)
    q = _inputs(n, 2, q_dtype)[0]
    keywords = dict(alibi_slopes=SLOPES, causal=True, method=method, samples=4, seed=5)
    cache = pt.BoundedKVCache(BATCH, HEADS, KV_HEADS, DIM, num_pages=64, page_size=PAGE, dtype=dtype, **keywords)
    k_full = torch.zeros(BATCH, n, KV_HEADS, DIM, dtype=dtype)
    v_full = torch.zeros_like(k_full)
    bounds = [0, 150] + list(range(151, n + 1))
    for a, b in zip(bounds[:-1], bounds[1:]):
        step = (q[:, a:b], k[:, a:b], v[:, a:b])
        want = pt.flash_attn_with_kvcache(step[0], k_full, v_full, k=step[1], v=step[2], cache_seqlens=a,
                                          return_softmax_lse=True, **keywords)
        got = cache.attention(*step, return_softmax_lse=True)
        assert got[0].dtype == q_dtype and got[1].dtype == torch.float32
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (a, b)
    assert cache.bytes_in_use < cache.full_cache_bytes()


@pytest.mark.parametrize("method,window", [("banded", (-1, -1)), ("lsh", (-1, -1)), ("exact", (60, -1)),
                                           ("exact", (-1, -1))])
def test_alibi_self_attention_decodes_through_a_bounded_cache(method, window):
    torch.manual_seed(0)
    n, hidden = 260, 64
    attn = pt.AlibiSelfAttention(hidden, HEADS, KV_HEADS, slopes=SLOPES, method=method, samples=4, seed=7,
                                 window_size=window)
    x = torch.randn(BATCH, n, hidden)
    full = pt.KVCache.for_module(attn, BATCH, n)
    bounded = pt.KVCache.for_module(attn, BATCH, n, bounded=True, page_size=PAGE)
    assert isinstance(bounded, pt.BoundedKVCache)
    bounds = [0, 100, 180] + list(range(181, n + 1))
    with torch.no_grad():
        for a, b in zip(bounds[:-1], bounds[1:]):
            want = attn(x[:, a:b], cache=full)
            got = attn(x[:, a:b], cache=bounded)
            assert torch.equal(got, want), (a, b)
    assert torch.equal(bounded.cache_seqlens, full.cache_seqlens)
    keeps_all = method == "exact" and window[0] < 0
    first = [bounded.core.first_key(s, g) for s in bounded.sequences for g in range(KV_HEADS)]
    assert all(f == 0 for f in first) == keeps_all
    if not keeps_all:
        assert bounded.bytes_in_use < bounded.full_cache_bytes()


def test_bad_input_is_named_and_changes_nothing():
    n = 200
    q, k, v = _inputs(n, 4, torch.float32)
    cache = pt.BoundedKVCache(BATCH, HEADS, KV_HEADS, DIM, num_pages=16, page_size=PAGE, alibi_slopes=SLOPES,
                              method="banded")
    cache.attention(q[:, :70], k[:, :70], v[:, :70])
    state = (cache.cache_seqlens.tolist(), cache.bytes_in_use)
    with pytest.raises(ValueError, match="'cache_seqlens'"):  # a position out of order
        cache.attention(q[:, 3:4], k[:, 3:4], v[:, 3:4], cache_seqlens=3)
    with pytest.raises(ValueError, match="'cache_seqlens'"):
        cache.attention(q[:, 70:71], k[:, 70:71], v[:, 70:71], cache_seqlens=torch.tensor([70, 71]))
    with pytest.raises(TypeError, match="'k'"):
        cache.attention(q[:, 70:71], k[:, 70:71].double(), v[:, 70:71])
    with pytest.raises(TypeError, match="'q'"):
        cache.attention(q[:, 70:71].half(), k[:, 70:71], v[:, 70:71])
    with pytest.raises(ValueError, match="'v'"):
        cache.attention(q[:, 70:71], k[:, 70:71], v[:, 70:72])
    with pytest.raises(ValueError, match="'q'"):  # queries before the appended tokens
        cache.attention(q[:, 69:71], k[:, 70:71], v[:, 70:71])
    with pytest.raises(ValueError, match="'q'"):
        cache.attention(q[:1, 70:71], k[:, 70:71], v[:, 70:71])
    assert state == (cache.cache_seqlens.tolist(), cache.bytes_in_use)
    # 2 pages per sequence (one per K/V head): the second sequence does not fit, the first is not
    # appended either.
    small = pt.BoundedKVCache(BATCH, HEADS, KV_HEADS, DIM, num_pages=3, page_size=PAGE)
    with pytest.raises(ValueError, match="'k'.*num_pages"):
        small.attention(q[:, :1], k[:, :1], v[:, :1])
    assert small.cache_seqlens.tolist() == [0, 0] and small.core.free_pages == 3
    out = cache.attention(q[:, 70:71], k[:, 70:71], v[:, 70:71], cache_seqlens=torch.tensor([70, 70],
                                                                                           dtype=torch.int32))
    assert out.shape == (BATCH, 1, HEADS, DIM) and bool(torch.isfinite(out).all())
    with pytest.raises(TypeError, match="'dtype'"):
        pt.BoundedKVCache(BATCH, HEADS, KV_HEADS, DIM, num_pages=4, dtype=torch.int8)
    with pytest.raises(ValueError, match="'alibi_slopes'"):  # one set of heads for every sequence
        pt.BoundedKVCache(BATCH, HEADS, KV_HEADS, DIM, num_pages=4, alibi_slopes=SLOPES.expand(BATCH, HEADS))
    with pytest.raises(ValueError, match="'num_pages'"):
        pt.BoundedKVCache(BATCH, HEADS, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="'page_size'"):
        pt.BoundedKVCache(BATCH, HEADS, KV_HEADS, DIM, num_pages=4, page_size=100)
    attn = pt.AlibiSelfAttention(64, HEADS, KV_HEADS, method="banded")  # other slopes than SLOPES
    with torch.no_grad(), pytest.raises(ValueError, match="'cache'"):
        attn(torch.randn(BATCH, 1, 64), cache=cache)
