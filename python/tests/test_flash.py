"""poslsh.torch's FlashAttention-2 calls (flash_attn_func, flash_attn_varlen_func,
flash_attn_with_kvcache): the exact methods against a dense float64 PyTorch reference with
FlashAttention-2's bias, alignment, window and grouped-query heads; the LSH methods against
what they equal exactly (poslsh's own all-heads call, separate calls, one longer prefill);
gradients, registered operators and argument checks."""

import math

import numpy as np
import pytest

import poslsh

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import poslsh.torch as ptorch  # noqa: E402
from poslsh._methods import short_name  # noqa: E402

flash_attn_func = ptorch.flash_attn_func
flash_attn_varlen_func = ptorch.flash_attn_varlen_func
flash_attn_with_kvcache = ptorch.flash_attn_with_kvcache

# The methods without a window (the LSH estimators and fixed blocks), by FlashAttention-style names.
LSH_METHODS = [short_name(method) for method in poslsh.method_names(takes_window=False)]


def dense(q, k, v, slopes=None, causal=False, window=(-1, -1), scale=None, bands=None):
    """FlashAttention-2's ALiBi attention written out: q (B, sq, H, d), k, v (B, sk, Hk, d);
    query i at key position P = i + sk - sq, bias -slope_h |P - j|, key j kept iff
    P - left <= j <= P + right (-1 unbounded), j <= P when causal, |P - j| <= bands[h] when
    given. Returns out (B, sq, H, d_v) and lse (B, H, sq) as FlashAttention-2 returns it (-inf
    for rows without keys, whose out is 0): its causal kernels (causal, or the window (-1, 0),
    with no left bound) add +slope_h j to the scores instead of -slope_h |P - j| (the same
    softmax), so their lse is the log-sum-exp of the scores plus slope_h P. Differentiable
    (torch autograd) in every tensor argument."""
    batch, sq, heads, d = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    group = heads // heads_k
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kx, vx = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, kx) * scale
    position = torch.arange(sq)[:, None] + sk - sq
    key = torch.arange(sk)[None, :]
    distance = (position - key).abs().to(q.dtype)
    slope = None
    if slopes is not None:
        slope = slopes.to(q.dtype)
        slope = slope.expand(batch, heads) if slope.dim() == 1 else slope
        scores = scores - slope[:, :, None, None] * distance
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        mask &= key <= position
    if window[0] >= 0:
        mask &= key >= position - window[0]
    if window[1] >= 0:
        mask &= key <= position + window[1]
    mask = mask.expand(heads, sq, sk)
    if bands is not None:
        mask = mask & (distance[None] <= torch.tensor(bands, dtype=q.dtype)[:, None, None])
    scores = scores.masked_fill(~mask[None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    causal_kernel = (causal or window[1] == 0) and not 0 <= window[0] < sk
    if causal_kernel and slope is not None:
        lse = lse + slope[:, :, None].detach() * position[:, 0].to(q.dtype)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, vx), lse


def rand(shape, dtype=torch.float64, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=generator, dtype=torch.float64).mul_(2).sub_(1).to(dtype)
    return x.requires_grad_(requires_grad)


def qkv(batch, sq, sk, heads, heads_k, d, dtype=torch.float64, seed=0, requires_grad=False, d_v=None):
    d_v = d if d_v is None else d_v
    return (rand((batch, sq, heads, d), dtype, seed, requires_grad), rand((batch, sk, heads_k, d), dtype, seed + 1,
                                                                            requires_grad),
            rand((batch, sk, heads_k, d_v), dtype, seed + 2, requires_grad))


def slopes_of(shape, dtype=torch.float32, seed=5):
    """Slopes of any values (not only the ALiBi ones), one of them 0."""
    values = rand(shape, torch.float64, seed).abs().mul(0.8).add(0.05)
    values.view(-1)[0] = 0.0
    return values.to(dtype)


def bands_of(slopes, band_error=1e-3):
    """W_h = band_for_bias_error(1 / slope_h) (a zero slope: no band)."""
    return [poslsh.band_for_bias_error(1.0 / s, band_error) if s > 0 else 10**9 for s in slopes.tolist()]


# Forward against the dense reference. ---------------------------------------------------------

CASES = [
    # batch, sq, sk, heads, heads_k, causal, window, slopes shape
    (2, 6, 6, 4, 4, True, (-1, -1), "h"),
    (2, 6, 6, 4, 2, False, (-1, -1), "bh"),
    (2, 3, 9, 4, 1, True, (-1, -1), "h"),
    (2, 3, 9, 4, 2, False, (-1, -1), None),
    (2, 9, 4, 2, 1, True, (-1, -1), "bh"),
    (1, 8, 8, 2, 2, True, (3, -1), "h"),
    (2, 5, 11, 4, 2, False, (2, 1), "bh"),
    (2, 7, 7, 3, 1, False, (4, -1), "h"),
    (1, 4, 10, 2, 1, True, (0, 0), None),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flash_attn_func_matches_dense(case, dtype):
    batch, sq, sk, heads, heads_k, causal, window, slopes_shape = case
    q, k, v = qkv(batch, sq, sk, heads, heads_k, 5, dtype, d_v=3)
    slopes = None if slopes_shape is None else slopes_of((heads,) if slopes_shape == "h" else (batch, heads))
    out, lse, mask = flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                     return_attn_probs=True)
    assert mask is None and out.dtype == dtype and out.shape == (batch, sq, heads, 3)
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, sq)
    expected, expected_lse = dense(q.double(), k.double(), v.double(), slopes, causal, window)
    atol = 1e-12 if dtype == torch.float64 else 2e-6
    np.testing.assert_allclose(out.double().numpy(), expected.numpy(), atol=atol, rtol=0)
    empty = torch.isinf(expected_lse)
    assert bool(torch.isinf(lse[empty]).all()) and bool((lse[empty] > 0).all())  # FlashAttention: +inf
    np.testing.assert_allclose(lse[~empty].double().numpy(), expected_lse[~empty].numpy(), rtol=2e-6, atol=2e-6)
    plain = flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes)
    np.testing.assert_allclose(plain.double().numpy(), expected.numpy(), atol=atol, rtol=0)


def test_softmax_scale_and_method_names():
    q, k, v = qkv(2, 5, 7, 4, 2, 6)
    slopes = slopes_of((4,))
    expected, _ = dense(q, k, v, slopes, True, scale=0.3)
    for method in ("exact", "exact_tiled"):
        out = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, alibi_slopes=slopes, method=method)
        np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=1e-12, rtol=0)
    banded = flash_attn_func(q, k, v, 0.0, 0.3, True, alibi_slopes=slopes, method="banded")
    assert torch.equal(banded, flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, alibi_slopes=slopes,
                                               method="exact_banded"))


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (False, (9, 2))])
def test_banded_matches_dense_with_its_band(causal, window):
    slopes = torch.tensor([0.9, 0.45, 0.3, 0.0])
    q, k, v = qkv(2, 12, 16, 4, 2, 4)
    bands = bands_of(slopes)
    assert min(bands) < 9
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes, method="banded",
                                  return_attn_probs=True)
    expected, expected_lse = dense(q, k, v, slopes, causal, window, bands=bands)
    np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse.double().numpy(), expected_lse.numpy(), rtol=2e-6)


def test_no_slopes_is_plain_softmax_for_every_method():
    """Slope 0: every method is plain softmax attention (one LSH bin holds every position)."""
    q, k, v = qkv(2, 7, 7, 2, 1, 4)
    for causal in (True, False):
        expected, _ = dense(q, k, v, None, causal)
        for method in ["exact", "banded"] + LSH_METHODS:
            out = flash_attn_func(q, k, v, causal=causal, method=method, samples=3)
            np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=1e-12, rtol=0, err_msg=method)


# The LSH methods: exactly poslsh's own all-heads call. ----------------------------------------


@pytest.mark.parametrize("method, core", [("lsh", "lsh_fused"), ("lsh_fused", "lsh_fused"),
                                          ("lsh_per_sample", "lsh_per_sample"), ("fixed_blocks", "fixed_blocks")])
@pytest.mark.parametrize("causal", [True, False])
def test_lsh_methods_equal_poslsh_multihead(method, core, causal):
    batch, sq, sk, heads, heads_k = 2, 5, 9, 4, 2
    q, k, v = qkv(batch, sq, sk, heads, heads_k, 4)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, method=method, samples=5, seed=7)
    sigmas = [1.0 / s for s in slopes.tolist()]
    for b in range(batch):
        expected = poslsh.multihead_attention(q[b].numpy(), k[b].numpy(), v[b].numpy(), method=core,
                                              masking="causal" if causal else "bidirectional", sigmas=sigmas,
                                              samples=5, seed=7, scale=0.5)
        np.testing.assert_array_equal(out[b].numpy(), expected)


def test_mean_of_outputs_equals_poslsh_per_head():
    q, k, v = qkv(1, 8, 8, 2, 1, 4)
    slopes = torch.tensor([0.5, 0.2])
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method="mean_of_outputs", samples=4, seed=3)
    for h in range(2):
        hashes = poslsh.rbf_hashes(1.0 / slopes[h].item(), 4, 3, h)
        expected = poslsh.lsh_attention_mean_of_outputs(q[0, :, h].numpy(), k[0, :, 0].numpy(), v[0, :, 0].numpy(),
                                                        hashes, masking="causal")
        np.testing.assert_array_equal(out[0, :, h].numpy(), expected)


# Varlen. ----------------------------------------------------------------------------------------


def varlen_batch(lengths_q, lengths_k, heads, heads_k, d, dtype=torch.float64, requires_grad=False):
    q = rand((sum(lengths_q), heads, d), dtype, 11, requires_grad)
    k = rand((sum(lengths_k), heads_k, d), dtype, 12, requires_grad)
    v = rand((sum(lengths_k), heads_k, d), dtype, 13, requires_grad)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (False, (2, 1)), (True, (3, -1))])
def test_varlen_matches_dense_per_sequence(causal, window):
    lengths_q, lengths_k = [4, 0, 1, 6, 1, 0], [7, 3, 1, 6, 5, 0]
    heads, heads_k = 4, 2
    q, k, v, cu_q, cu_k = varlen_batch(lengths_q, lengths_k, heads, heads_k, 5)
    slopes = slopes_of((len(lengths_q), heads))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                         window_size=window, alibi_slopes=slopes, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
    for b in range(len(lengths_q)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        expected, expected_lse = dense(q[None, qs], k[None, ks], v[None, ks], slopes[b], causal, window)
        np.testing.assert_allclose(out[qs].numpy(), expected[0].numpy(), atol=1e-12, rtol=0)
        np.testing.assert_allclose(lse[:, qs].double().numpy(), expected_lse[0].numpy(), rtol=2e-6)


def test_varlen_causal_with_more_queries_than_keys():
    q, k, v, cu_q, cu_k = varlen_batch([5, 2, 3], [3, 0, 3], 2, 1, 4)
    slopes = torch.tensor([0.3, 0.7])
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 3, causal=True, alibi_slopes=slopes,
                                         return_attn_probs=True)
    for (qs, qe), (ks, ke) in (((0, 5), (0, 3)), ((5, 7), (3, 3)), ((7, 10), (3, 6))):
        expected, expected_lse = dense(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], slopes, True)
        np.testing.assert_allclose(out[qs:qe].numpy(), expected[0].numpy(), atol=1e-12, rtol=0)
        empty = torch.isinf(expected_lse[0])
        assert bool((lse[:, qs:qe][empty] == math.inf).all())
    assert bool((out[0:2] == 0).all()) and bool((out[5:7] == 0).all())


@pytest.mark.parametrize("method", ["lsh", "lsh_per_sample", "fixed_blocks", "mean_of_outputs", "banded"])
def test_varlen_equals_separate_calls(method):
    lengths = [6, 1, 0, 9]
    q, k, v, cu_q, cu_k = varlen_batch(lengths, lengths, 2, 2, 4)
    slopes = torch.tensor([0.4, 0.15])
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True, alibi_slopes=slopes, method=method,
                                 samples=3, seed=5)
    for b, n in enumerate(lengths):
        s = slice(int(cu_q[b]), int(cu_q[b]) + n)
        separate = flash_attn_func(q[None, s], k[None, s], v[None, s], causal=True, alibi_slopes=slopes,
                                   method=method, samples=3, seed=5)
        assert torch.equal(out[s], separate[0])


# The KV cache. ------------------------------------------------------------------------------------


def test_kvcache_appends_at_different_lengths_and_matches_dense():
    batch, capacity, heads, heads_k, d = 3, 12, 4, 2, 4
    k_cache = rand((batch, capacity, heads_k, d), seed=21)
    v_cache = rand((batch, capacity, heads_k, d), seed=22)
    original_k, original_v = k_cache.clone(), v_cache.clone()
    cache_seqlens = torch.tensor([0, 5, 9], dtype=torch.int32)
    q = rand((batch, 2, heads, d), seed=23)
    k_new, v_new = rand((batch, 2, heads_k, d), seed=24), rand((batch, 2, heads_k, d), seed=25)
    slopes = slopes_of((batch, heads))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens, causal=True,
                                       alibi_slopes=slopes, return_softmax_lse=True)
    for b, length in enumerate(cache_seqlens.tolist()):
        assert torch.equal(k_cache[b, length:length + 2], k_new[b])
        assert torch.equal(v_cache[b, length:length + 2], v_new[b])
        assert torch.equal(k_cache[b, :length], original_k[b, :length])  # untouched before the append
        assert torch.equal(k_cache[b, length + 2:], original_k[b, length + 2:])  # and after it
        assert torch.equal(v_cache[b, :length], original_v[b, :length])
        keys, values = k_cache[None, b, :length + 2], v_cache[None, b, :length + 2]
        expected, expected_lse = dense(q[None, b], keys, values, slopes[b], True)
        np.testing.assert_allclose(out[b].numpy(), expected[0].numpy(), atol=1e-12, rtol=0)
        np.testing.assert_allclose(lse[b].double().numpy(), expected_lse[0].numpy(), rtol=2e-6)


def test_paged_cache_with_shuffled_blocks_equals_contiguous():
    batch, block_size, blocks_per_row, heads, heads_k, d = 2, 4, 3, 2, 1, 4
    contiguous_k = rand((batch, block_size * blocks_per_row, heads_k, d), seed=31)
    contiguous_v = rand((batch, block_size * blocks_per_row, heads_k, d), seed=32)
    order = torch.randperm(batch * blocks_per_row + 2, generator=torch.Generator().manual_seed(3))
    block_table = order[:batch * blocks_per_row].reshape(batch, blocks_per_row).to(torch.int32)
    k_pages = rand((batch * blocks_per_row + 2, block_size, heads_k, d), seed=33)
    v_pages = rand((batch * blocks_per_row + 2, block_size, heads_k, d), seed=34)
    for b in range(batch):
        for j in range(blocks_per_row):
            page = int(block_table[b, j])
            k_pages[page] = contiguous_k[b, j * block_size:(j + 1) * block_size]
            v_pages[page] = contiguous_v[b, j * block_size:(j + 1) * block_size]
    cache_seqlens = torch.tensor([3, 7], dtype=torch.int32)
    q = rand((batch, 1, heads, d), seed=35)
    k_new, v_new = rand((batch, 1, heads_k, d), seed=36), rand((batch, 1, heads_k, d), seed=37)
    slopes = torch.tensor([0.5, 0.1])
    for method in ("exact", "lsh"):
        pk, pv, ck, cv = k_pages.clone(), v_pages.clone(), contiguous_k.clone(), contiguous_v.clone()
        paged = flash_attn_with_kvcache(q, pk, pv, k_new, v_new, cache_seqlens=cache_seqlens, block_table=block_table,
                                        causal=True, alibi_slopes=slopes, method=method)
        flat = flash_attn_with_kvcache(q, ck, cv, k_new, v_new, cache_seqlens=cache_seqlens, causal=True,
                                       alibi_slopes=slopes, method=method)
        assert torch.equal(paged, flat)
        for b, length in enumerate(cache_seqlens.tolist()):
            page, row = int(block_table[b, length // block_size]), length % block_size
            assert torch.equal(pk[page, row], k_new[b, 0]) and torch.equal(pv[page, row], v_new[b, 0])
            if method == "exact":
                expected, _ = dense(q[None, b], ck[None, b, :length + 1], cv[None, b, :length + 1], slopes, True)
                np.testing.assert_allclose(paged[b].numpy(), expected[0].numpy(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype, query_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("precision", ["matrix_units", "float_products"])
def test_paged_and_contiguous_half_caches_give_one_out_and_lse(dtype, query_dtype, precision):
    """A half-precision cache, paged (shuffled blocks) or contiguous, with return_softmax_lse: out
    and lse bitwise equal between the two layouts and equal to the rows of flash_attn_func with
    return_attn_probs=True on the same tokens (q of the cache's dtype: one computation, on the
    matrix unit when precision selects it; float32 q: the widened cache)."""
    batch, block_size, blocks_per_row, heads, heads_k, d, sq = 2, 16, 3, 4, 2, 64, 6
    contiguous_k = rand((batch, block_size * blocks_per_row, heads_k, d), dtype, 61)
    contiguous_v = rand((batch, block_size * blocks_per_row, heads_k, d), dtype, 62)
    order = torch.randperm(batch * blocks_per_row + 1, generator=torch.Generator().manual_seed(4))
    block_table = order[:batch * blocks_per_row].reshape(batch, blocks_per_row).to(torch.int32)
    k_pages = torch.zeros((batch * blocks_per_row + 1, block_size, heads_k, d), dtype=dtype)
    v_pages = torch.zeros_like(k_pages)
    for b in range(batch):
        for j in range(blocks_per_row):
            page = int(block_table[b, j])
            k_pages[page] = contiguous_k[b, j * block_size:(j + 1) * block_size]
            v_pages[page] = contiguous_v[b, j * block_size:(j + 1) * block_size]
    lengths = [29, 48]
    q = rand((batch, sq, heads, d), query_dtype, 63)
    slopes = torch.tensor([0.5, 0.2, 0.05, 0.01])
    for method in ("exact", "lsh"):
        extras = dict(causal=True, alibi_slopes=slopes, method=method, samples=4, seed=2, precision=precision,
                      return_softmax_lse=True)
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        paged, paged_lse = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                   block_table=block_table, **extras)
        flat, flat_lse = flash_attn_with_kvcache(q, contiguous_k, contiguous_v, cache_seqlens=seqlens, **extras)
        assert paged.dtype == flat.dtype == query_dtype and paged_lse.dtype == flat_lse.dtype == torch.float32
        assert torch.equal(paged, flat) and torch.equal(paged_lse, flat_lse), (method, precision)
        del extras["return_softmax_lse"]
        for b, length in enumerate(lengths):
            keys, values = contiguous_k[b:b + 1, :length], contiguous_v[b:b + 1, :length]
            if query_dtype != dtype:
                keys, values = keys.to(query_dtype), values.to(query_dtype)
            queries = torch.cat([torch.zeros((1, length - sq, heads, d), dtype=query_dtype), q[b:b + 1]], 1)
            out, lse, _ = flash_attn_func(queries, keys, values, return_attn_probs=True, **extras)
            assert torch.equal(flat[b], out[0, -sq:]) and torch.equal(flat_lse[b], lse[0, :, -sq:]), (method, b)


@pytest.mark.parametrize("method", ["exact", "banded", "lsh", "lsh_per_sample", "fixed_blocks", "mean_of_outputs"])
def test_decode_rows_equal_one_longer_prefill(method):
    """Prefill of 5 tokens, then decode steps of 1 and 2 tokens through the cache: each step's
    rows are bitwise the rows of one flash_attn_func call on all 8 tokens."""
    batch, n, heads, heads_k, d = 2, 8, 4, 2, 4
    q, k, v = qkv(batch, n, n, heads, heads_k, d, seed=40)
    slopes = torch.tensor([0.6, 0.3, 0.15, 0.075])
    extras = dict(causal=True, alibi_slopes=slopes, method=method, samples=4, seed=9)
    full = flash_attn_func(q, k, v, **extras)
    k_cache, v_cache = torch.zeros(batch, n, heads_k, d, dtype=q.dtype), torch.zeros(batch, n, heads_k, d,
                                                                                     dtype=q.dtype)
    k_cache[:, :5], v_cache[:, :5] = k[:, :5], v[:, :5]
    prefill = flash_attn_func(q[:, :5], k[:, :5], v[:, :5], **extras)
    assert torch.equal(prefill, full[:, :5])
    for start, stop in ((5, 6), (6, 8)):
        step = flash_attn_with_kvcache(q[:, start:stop], k_cache, v_cache, k[:, start:stop], v[:, start:stop],
                                       cache_seqlens=start, **extras)
        assert torch.equal(step, full[:, start:stop])


def test_half_precision_cache_under_float32_queries():
    batch, capacity, heads, d = 2, 6, 2, 8
    q = rand((batch, 1, heads, d), torch.float32, 50)
    for dtype in (torch.bfloat16, torch.float16):
        k_cache, v_cache = rand((batch, capacity, heads, d), dtype, 51), rand((batch, capacity, heads, d), dtype, 52)
        slopes = torch.tensor([0.25, 0.5])
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([4, 6], dtype=torch.int32),
                                      causal=True, alibi_slopes=slopes)
        assert out.dtype == torch.float32
        for b, length in enumerate((4, 6)):
            expected, _ = dense(q[None, b].double(), k_cache[None, b, :length].double(),
                                v_cache[None, b, :length].double(), slopes, True)
            np.testing.assert_allclose(out[b].double().numpy(), expected[0].numpy(), atol=2e-6, rtol=0)


# Gradients. ---------------------------------------------------------------------------------------


GRADIENT_CASES = [
    # batch, sq, sk, heads, heads_k, causal, window, slopes shape
    (2, 4, 4, 2, 1, True, (-1, -1), "h"),
    (2, 3, 6, 2, 2, False, (-1, -1), "bh"),
    (1, 5, 5, 2, 1, False, (2, 1), "h"),
    (2, 5, 3, 2, 1, True, (-1, -1), "bh"),
    # fewer queries than keys with a local window: the slice backward at query_offset sk - sq
    (2, 3, 7, 2, 1, True, (2, -1), "h"),
    (2, 4, 9, 2, 2, False, (3, 2), "bh"),
]


@pytest.mark.parametrize("case", GRADIENT_CASES)
def test_exact_gradients_match_dense_autograd(case):
    batch, sq, sk, heads, heads_k, causal, window, slopes_shape = case
    q, k, v = qkv(batch, sq, sk, heads, heads_k, 4, requires_grad=True)
    slopes = slopes_of((heads,) if slopes_shape == "h" else (batch, heads), torch.float32).requires_grad_()
    dout = rand((batch, sq, heads, 4), seed=60)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes)
    grads = torch.autograd.grad(out, (q, k, v, slopes), dout)
    expected_out, _ = dense(q, k, v, slopes, causal, window)
    expected = torch.autograd.grad(expected_out, (q, k, v, slopes), dout)
    for name, got, want in zip("q k v slopes".split(), grads, expected):
        assert got.dtype == (torch.float32 if name == "slopes" else torch.float64)
        np.testing.assert_allclose(got.double().numpy(), want.double().numpy(), atol=1e-10, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("method, causal", [("exact", True), ("exact", False), ("banded", True),
                                            ("banded", False)])
def test_gradcheck_exact_and_banded_with_slopes(method, causal):
    q, k, v = qkv(2, 4, 6, 2, 1, 3, requires_grad=True)
    slopes = torch.tensor([[1.9, 0.4], [0.7, 2.5]], dtype=torch.float64, requires_grad=True)
    if method == "banded":  # bands 4 and 3 of slopes 1.9 and 2.5 drop pairs (|P - j| up to 5)
        assert min(bands_of(slopes.detach().view(-1))) < 5

    def function(q, k, v, slopes):
        return flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, method=method)

    assert torch.autograd.gradcheck(function, (q, k, v, slopes), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", LSH_METHODS)
def test_gradcheck_lsh_methods(method):
    q, k, v = qkv(2, 5, 5, 2, 1, 3, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)

    def function(q, k, v):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method=method, samples=3, seed=2)

    assert torch.autograd.gradcheck(function, (q, k, v), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["lsh", "lsh_per_sample", "fixed_blocks"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_lsh_with_fewer_queries_than_keys(causal, method):
    q, k, v = qkv(1, 3, 6, 2, 2, 3, requires_grad=True)

    def function(q, k, v):
        return flash_attn_func(q, k, v, causal=causal, alibi_slopes=torch.tensor([0.5, 0.3]), method=method,
                               samples=3)

    assert torch.autograd.gradcheck(function, (q, k, v), eps=1e-6, atol=1e-7)


def test_gradcheck_varlen():
    q, k, v, cu_q, cu_k = varlen_batch([3, 0, 1, 2], [4, 2, 1, 2], 2, 1, 3, requires_grad=True)
    slopes = torch.tensor([0.6, 0.2], dtype=torch.float64, requires_grad=True)

    def function(q, k, v, slopes):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=True, alibi_slopes=slopes)

    assert torch.autograd.gradcheck(function, (q, k, v, slopes), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["exact", "lsh"])
def test_half_precision_is_the_float32_call_rounded(dtype, method):
    """precision="float_products": the output of the float32 call on the widened tensors,
    rounded once; the gradients of each batch row those of the float32 backward on the widened
    tensors and that rounded output, cast once (poslsh.multihead_attention_backward)."""
    q, k, v = qkv(2, 6, 6, 2, 1, 8, dtype, seed=70, requires_grad=True)
    wide = [x.detach().float().requires_grad_() for x in (q, k, v)]
    slopes = torch.tensor([0.3, 0.1])
    dout = rand((2, 6, 2, 8), dtype, 71)
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method=method, precision="float_products")
    out_wide = flash_attn_func(*wide, causal=True, alibi_slopes=slopes, method=method)
    assert out.dtype == dtype and torch.equal(out, out_wide.to(dtype))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keywords = dict(method="exact_tiled" if method == "exact" else "lsh_fused", sigmas=[1.0 / float(s) for s in slopes],
                    samples=16, seed=0)
    for b in range(2):
        qf, kf, vf, outf, doutf = (x[b].detach().float().numpy() for x in (q, k, v, out, dout))
        _, lse = poslsh.multihead_attention_with_lse(qf, kf, vf, **keywords)
        want = poslsh.multihead_attention_backward(qf, kf, vf, outf, lse, doutf, **keywords)
        for got, expected in zip(grads, want):
            assert got.dtype == dtype and torch.equal(got[b], torch.from_numpy(expected).to(dtype))


def test_lsh_rejects_slopes_that_require_grad():
    q, k, v = qkv(1, 4, 4, 2, 2, 3)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    for method in LSH_METHODS:
        with pytest.raises(ValueError, match="alibi_slopes"):
            flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method=method)
    with torch.no_grad():  # inference with trainable slopes is fine
        flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method="lsh")


# Registered operators. ------------------------------------------------------------------------------


def test_jit_trace_records_the_operators():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)

    q, k, v = qkv(2, 5, 5, 4, 2, 4)
    traced = torch.jit.trace(attention, (q, k, v))
    assert "poslsh::flash_attn" in str(traced.graph)
    q2, k2, v2 = qkv(2, 5, 5, 4, 2, 4, seed=80, requires_grad=True)
    out = traced(q2, k2, v2)
    expected, _ = dense(q2, k2, v2, slopes, True)
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), atol=1e-12, rtol=0)
    dq = torch.autograd.grad(out.sum(), q2)[0]
    np.testing.assert_allclose(dq.numpy(), torch.autograd.grad(expected.sum(), q2)[0].numpy(), atol=1e-10)

    lengths = torch.tensor([0, 3, 7], dtype=torch.int32)

    def varlen(q, k, v):
        return flash_attn_varlen_func(q, k, v, lengths, lengths, 4, 4, causal=True, alibi_slopes=slopes)

    q, k, v = (x.reshape(-1, x.shape[2], 4)[:7] for x in qkv(2, 4, 4, 4, 2, 4, seed=90))
    traced = torch.jit.trace(varlen, (q, k, v))
    assert "poslsh::flash_attn_varlen" in str(traced.graph)
    q2, k2, v2 = (x.reshape(-1, x.shape[2], 4)[:7] for x in qkv(2, 4, 4, 4, 2, 4, seed=91))
    assert torch.equal(traced(q2, k2, v2), varlen(q2, k2, v2))


def test_meta_tensors_give_the_shapes():
    q = torch.empty(2, 5, 4, 8, device="meta")
    k, v = torch.empty(2, 7, 2, 8, device="meta"), torch.empty(2, 7, 2, 6, device="meta")
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.device.type == "meta" and out.shape == (2, 5, 4, 6) and lse.shape == (2, 4, 5)
    assert lse.dtype == torch.float32
    out, lse = torch.ops.poslsh.flash_attn_varlen(q[0], k[0], v[0], torch.tensor([0, 5], dtype=torch.int32),
                                                  torch.tensor([0, 7], dtype=torch.int32), None, None, True, -1, -1,
                                                  "exact", 16, 0, 1e-3, True)
    assert out.shape == (5, 4, 6) and lse.shape == (4, 5)


# Bad inputs. -----------------------------------------------------------------------------------------


def _bad_calls():
    q, k, v = qkv(2, 4, 4, 4, 2, 3)
    s = torch.tensor([0.1, 0.2, 0.3, 0.4])
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    flat = [x.reshape(8, x.shape[2], 3) for x in (q, k, v)]
    cache = torch.zeros(2, 6, 2, 3, dtype=torch.float64)
    pages = torch.zeros(4, 2, 2, 3, dtype=torch.float64)
    table = torch.tensor([[0, 1, 2], [3, 9, 1]], dtype=torch.int32)
    seqlens = torch.tensor([4, 5], dtype=torch.int32)
    one = rand((2, 1, 2, 3))
    return [
        ("rank", lambda: flash_attn_func(q[0], k, v), ValueError, "'q'"),
        ("batch", lambda: flash_attn_func(q, k[:1], v[:1]), ValueError, "'k'"),
        ("heads", lambda: flash_attn_func(q[:, :, :3], k, v), ValueError, "nheads_k"),
        ("headdim", lambda: flash_attn_func(q, k[..., :2], v), ValueError, "'k'"),
        ("dtype", lambda: flash_attn_func(q, k.float(), v), TypeError, "'k'"),
        ("int tensor", lambda: flash_attn_func(q.long(), k, v), TypeError, "'q'"),
        ("not a tensor", lambda: flash_attn_func(q.numpy(), k, v), TypeError, "'q'"),
        ("slopes shape", lambda: flash_attn_func(q, k, v, alibi_slopes=s[:3]), ValueError, "alibi_slopes"),
        ("slopes batch", lambda: flash_attn_func(q, k, v, alibi_slopes=s.expand(3, 4)), ValueError, "alibi_slopes"),
        ("slopes dtype", lambda: flash_attn_func(q, k, v, alibi_slopes=s.half()), TypeError, "alibi_slopes"),
        ("slopes list", lambda: flash_attn_func(q, k, v, alibi_slopes=[0.1] * 4), TypeError, "alibi_slopes"),
        ("negative slope", lambda: flash_attn_func(q, k, v, alibi_slopes=-s), ValueError, "alibi_slopes"),
        ("dropout", lambda: flash_attn_func(q, k, v, 0.1), ValueError, "dropout_p"),
        ("softcap", lambda: flash_attn_func(q, k, v, softcap=30.0), ValueError, "softcap"),
        ("window", lambda: flash_attn_func(q, k, v, window_size=(2, 0, 1)), TypeError, "window_size"),
        ("window type", lambda: flash_attn_func(q, k, v, window_size=3), TypeError, "window_size"),
        ("lsh window", lambda: flash_attn_func(q, k, v, window_size=(1, 1), method="lsh"), ValueError, "window"),
        ("method", lambda: flash_attn_func(q, k, v, method="flash"), ValueError, "method"),
        ("samples", lambda: flash_attn_func(q, k, v, method="lsh", samples=0), ValueError, "samples"),
        ("non-causal sq > sk without lse", lambda: flash_attn_func(q, k[:, :2], v[:, :2], method="mean_of_outputs"),
         ValueError, "method"),
        ("lse of mean_of_outputs",
         lambda: flash_attn_func(q, k, v, causal=True, method="mean_of_outputs", return_attn_probs=True),
         ValueError, "return_attn_probs"),
        ("cache lse of mean_of_outputs",
         lambda: flash_attn_with_kvcache(q[:, :1], cache, cache.clone(), cache_seqlens=2, causal=True,
                                         method="mean_of_outputs", return_softmax_lse=True),
         ValueError, "return_softmax_lse"),
        ("cu dtype", lambda: flash_attn_varlen_func(*flat, cu.long(), cu, 4, 4), TypeError, "cu_seqlens_q"),
        ("cu decreasing", lambda: flash_attn_varlen_func(*flat, torch.tensor([0, 5, 4, 8], dtype=torch.int32),
                                                         torch.tensor([0, 2, 6, 8], dtype=torch.int32), 5, 4),
         ValueError, "cu_seqlens_q"),
        ("cu total", lambda: flash_attn_varlen_func(*flat, cu, torch.tensor([0, 4, 7], dtype=torch.int32), 4, 4),
         ValueError, "cu_seqlens_k"),
        ("cu count", lambda: flash_attn_varlen_func(*flat, cu, torch.tensor([0, 8], dtype=torch.int32), 4, 8),
         ValueError, "cu_seqlens_k"),
        ("max_seqlen", lambda: flash_attn_varlen_func(*flat, cu, cu, 3, 4), ValueError, "max_seqlen_q"),
        ("varlen rank", lambda: flash_attn_varlen_func(q, k, v, cu, cu, 4, 4), ValueError, "'q'"),
        ("varlen paged", lambda: flash_attn_varlen_func(*flat, cu, cu, 4, 4, block_table=table), ValueError,
         "block_table"),
        ("cache too small", lambda: flash_attn_with_kvcache(q[:, :1], cache, cache.clone(), one, one.clone(),
                                                            cache_seqlens=torch.tensor([6, 2], dtype=torch.int32)),
         ValueError, "cache_seqlens"),
        ("cache batch", lambda: flash_attn_with_kvcache(q[:, :1], cache[:1], cache[:1].clone(), cache_seqlens=2),
         ValueError, "k_cache"),
        ("block_table range", lambda: flash_attn_with_kvcache(q[:, :1], pages, pages.clone(), one, one.clone(),
                                                              cache_seqlens=seqlens, block_table=table),
         ValueError, "block_table"),
        ("block_table dtype", lambda: flash_attn_with_kvcache(q[:, :1], pages, pages.clone(), cache_seqlens=seqlens,
                                                              block_table=table.long()), TypeError, "block_table"),
        ("seqlens dtype", lambda: flash_attn_with_kvcache(q[:, :1], cache, cache.clone(),
                                                          cache_seqlens=seqlens.float()), TypeError, "cache_seqlens"),
        ("k without v", lambda: flash_attn_with_kvcache(q[:, :1], cache, cache.clone(), one, cache_seqlens=1),
         ValueError, "'v'"),
        ("rotary", lambda: flash_attn_with_kvcache(q[:, :1], cache, cache.clone(), rotary_cos=s, cache_seqlens=1),
         ValueError, "rotary_cos"),
        ("cache dtype", lambda: flash_attn_with_kvcache(q[:, :1], cache.float(), cache.float(), cache_seqlens=1),
         TypeError, "k_cache"),
    ]


@pytest.mark.parametrize("label, call, error, name", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs_name_the_argument(label, call, error, name):
    with pytest.raises(error, match=name):
        call()


def test_band_error_and_samples_are_checked_where_the_method_uses_them():
    """One rule each, the library's: band_error in (0, 1) for the banded method, samples >= 1 for
    the methods that draw hashes; the other methods ignore them."""
    q, k, v = qkv(1, 6, 6, 2, 1, 4)
    flash_attn_func(q, k, v, method="exact", band_error=2.0, samples=0)
    with pytest.raises(ValueError, match="argument 'options.band_error' = 2"):
        flash_attn_func(q, k, v, method="banded", band_error=2.0)
    with pytest.raises(ValueError, match="argument 'options.samples' = 0"):
        flash_attn_func(q, k, v, method="lsh", samples=0)
    with pytest.raises(TypeError, match="argument 'band_error' must be a float"):
        flash_attn_func(q, k, v, band_error="small")
    with pytest.raises(ValueError, match="argument 'options.scale'"):
        flash_attn_func(q, k, v, softmax_scale=math.inf)


def test_block_table_entries_past_the_used_pages_are_not_read():
    """FlashAttention's block tables may hold padding past a row's pages: only used ones are checked."""
    pages = rand((3, 2, 1, 3))
    table = torch.tensor([[0, 2, -1]], dtype=torch.int32)
    q = rand((1, 1, 1, 3))
    out = flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=torch.tensor([3], dtype=torch.int32),
                                  block_table=table, causal=True)
    keys = torch.cat([pages[0], pages[2, :1]])[None]
    expected, _ = dense(q, keys, torch.cat([pages[0], pages[2, :1]])[None], None, True)
    np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=1e-12)


def test_slopes_alone_require_grad():
    q, k, v = qkv(2, 4, 6, 2, 1, 3)
    slopes = torch.tensor([0.4, 0.8], dtype=torch.float64, requires_grad=True)
    dout = rand((2, 4, 2, 3), seed=95)
    for method, bands in (("exact", None), ("banded", bands_of(slopes.detach()))):
        got = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, method=method), slopes,
                                  dout)[0]
        want = torch.autograd.grad(dense(q, k, v, slopes, True, bands=bands)[0], slopes, dout)[0]
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-12)


def test_kvcache_rows_by_cache_batch_idx_and_whole_cache():
    cache_k, cache_v = rand((3, 5, 1, 4), seed=96), rand((3, 5, 1, 4), seed=97)
    q = rand((2, 1, 2, 4), seed=98)
    index = torch.tensor([2, 0], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, cache_k, cache_v, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
                                  cache_batch_idx=index, causal=True)
    for b, (row, length) in enumerate(((2, 3), (0, 5))):
        expected, _ = dense(q[None, b], cache_k[None, row, :length], cache_v[None, row, :length], None, True)
        np.testing.assert_allclose(out[b].numpy(), expected[0].numpy(), atol=1e-12)
    whole = flash_attn_with_kvcache(q, cache_k[:2], cache_v[:2])  # cache_seqlens None: every cached token
    np.testing.assert_allclose(whole.numpy(), dense(q, cache_k[:2], cache_v[:2])[0].numpy(), atol=1e-12)


def test_strided_qkv_of_a_packed_buffer():
    """q, k, v sliced from one (batch, seqlen, 3, nheads, headdim) buffer give the call on copies."""
    packed = rand((2, 6, 3, 2, 4), seed=99, requires_grad=True)
    q, k, v = packed.unbind(2)
    slopes = torch.tensor([0.5, 0.2])
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    copies = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
    expected = flash_attn_func(*copies, causal=True, alibi_slopes=slopes)
    assert torch.equal(out, expected)
    dout = rand((2, 6, 2, 4), seed=100)
    grad = torch.autograd.grad(out, packed, dout)[0]
    assert torch.equal(grad, torch.stack(torch.autograd.grad(expected, copies, dout), 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries_and_cache(dtype):
    """q and cache in half precision with precision="float_products": the float32 call on the
    widened tensors, rounded once."""
    q = rand((2, 2, 4, 8), dtype, 110)
    k_cache, v_cache = rand((2, 7, 2, 8), dtype, 111), rand((2, 7, 2, 8), dtype, 112)
    k_new, v_new = rand((2, 2, 2, 8), dtype, 113), rand((2, 2, 2, 8), dtype, 114)
    lengths = torch.tensor([1, 5], dtype=torch.int32)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    wide_k, wide_v = k_cache.float(), v_cache.float()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True,
                                  alibi_slopes=slopes, precision="float_products")
    wide = flash_attn_with_kvcache(q.float(), wide_k, wide_v, k_new.float(), v_new.float(), cache_seqlens=lengths,
                                   causal=True, alibi_slopes=slopes)
    assert out.dtype == dtype and torch.equal(out, wide.to(dtype))
    assert torch.equal(k_cache.float(), wide_k) and torch.equal(v_cache.float(), wide_v)


# The contiguous cache read in place. ------------------------------------------------------------


def _packed_cache_call(q, k_cache, v_cache, rows, totals, **extras):
    """The gathered-keys computation a KV-cache step equals: the used tokens of each cache row
    copied into one packed batch, then flash_attn_varlen_func. Returns out (batch, sq, H, d_v)
    and lse (batch, H, sq)."""
    batch, sq, heads = q.shape[:3]
    wide = torch.float32 if k_cache.dtype in (torch.bfloat16, torch.float16) else k_cache.dtype
    keys = torch.cat([k_cache[row, :total] for row, total in zip(rows, totals)]).to(wide)
    values = torch.cat([v_cache[row, :total] for row, total in zip(rows, totals)]).to(wide)
    cu_q = torch.arange(batch + 1, dtype=torch.int32) * sq
    cu_k = torch.tensor([0] + np.cumsum(totals).tolist(), dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q.reshape(batch * sq, heads, q.shape[3]).to(wide), keys, values, cu_q,
                                         cu_k, sq, max(totals), return_attn_probs=True, **extras)
    out = out.reshape(batch, sq, heads, v_cache.shape[3])
    return out, lse.reshape(heads, batch, sq).transpose(0, 1)


KV_CASES = [
    # method, causal, window
    ("exact", True, (-1, -1)),
    ("exact", False, (2, 1)),
    ("exact", True, (3, -1)),
    ("banded", True, (-1, -1)),
    ("banded", False, (1, 0)),
    ("lsh", True, (-1, -1)),
    ("lsh", False, (-1, -1)),
    ("lsh_per_sample", True, (-1, -1)),
    ("fixed_blocks", True, (-1, -1)),
]


@pytest.mark.parametrize("method, causal, window", KV_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_contiguous_cache_step_is_bitwise_the_gathered_keys_call(method, causal, window, dtype):
    """Rows chosen by cache_batch_idx, different lengths (causal: a row with more queries than
    keys), grouped-query heads, (batch, nheads) slopes, an append: out and softmax_lse are
    bitwise those of the packed call on the gathered keys; the cache tokens past each row's
    length (NaN here) are never read."""
    batch, capacity, heads, heads_k, d, sq = 2, 10, 4, 2, 4, 3
    k_cache = torch.full((3, capacity, heads_k, d), math.nan, dtype=dtype)
    v_cache = torch.full((3, capacity, heads_k, d), math.nan, dtype=dtype)
    rows, lengths = [2, 0], ([1, 6] if causal else [3, 6])
    for row, length in zip(rows, lengths):
        k_cache[row, :length] = rand((length, heads_k, d), dtype, 120 + row)
        v_cache[row, :length] = rand((length, heads_k, d), dtype, 130 + row)
    q = rand((batch, sq, heads, d), dtype, 140)
    k_new, v_new = rand((batch, 1, heads_k, d), dtype, 141), rand((batch, 1, heads_k, d), dtype, 142)
    extras = dict(causal=causal, window_size=window, alibi_slopes=slopes_of((batch, heads)), method=method,
                  samples=4, seed=3)
    index = torch.tensor(rows, dtype=torch.int32)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                       cache_batch_idx=index, return_softmax_lse=True, **extras)
    for b, (row, length) in enumerate(zip(rows, lengths)):
        assert torch.equal(k_cache[row, length], k_new[b, 0]) and torch.equal(v_cache[row, length], v_new[b, 0])
        assert bool(torch.isnan(k_cache[row, length + 1:]).all())
    totals = [length + 1 for length in lengths]
    expected, expected_lse = _packed_cache_call(q, k_cache, v_cache, rows, totals, **extras)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert bool(torch.isfinite(out).all())
    # Without softmax_lse (the other kernel); the append again at the same positions.
    plain = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, cache_batch_idx=index,
                                    **extras)
    assert torch.equal(plain, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["exact", "lsh"])
@pytest.mark.parametrize("half_queries", [False, True])
def test_half_precision_cache_is_the_float32_kernels_on_the_widened_cache(dtype, method, half_queries):
    """A bfloat16 or float16 cache (read as it is) gives bitwise the float32 computation on the
    widened cache, under float32 or half-precision queries (rounded once; precision
    "float_products"), with softmax_lse too; every cache row in order, equal lengths, appended
    in one copy."""
    batch, capacity, heads, heads_k, d, sq = 2, 9, 4, 2, 8, 2
    k_cache, v_cache = rand((batch, capacity, heads_k, d), dtype, 150), rand((batch, capacity, heads_k, d), dtype, 151)
    q = rand((batch, sq, heads, d), dtype if half_queries else torch.float32, 152)
    k_new, v_new = rand((batch, sq, heads_k, d), dtype, 153), rand((batch, sq, heads_k, d), dtype, 154)
    slopes = torch.tensor([0.5, 0.25, 0.0, 0.0625])
    extras = dict(causal=True, alibi_slopes=slopes, method=method, samples=4, seed=1, precision="float_products")
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=5, return_softmax_lse=True,
                                       **extras)
    assert torch.equal(k_cache[:, 5:7], k_new) and torch.equal(v_cache[:, 5:7], v_new)
    assert torch.equal(k_cache[:, :5], before_k[:, :5]) and torch.equal(k_cache[:, 7:], before_k[:, 7:])
    assert torch.equal(v_cache[:, :5], before_v[:, :5]) and torch.equal(v_cache[:, 7:], before_v[:, 7:])
    expected, expected_lse = _packed_cache_call(q, k_cache, v_cache, [0, 1], [7, 7], **extras)
    assert out.dtype == q.dtype
    assert torch.equal(out, expected.to(q.dtype)) and torch.equal(lse, expected_lse)
    plain = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7, **extras)
    assert torch.equal(plain, expected.to(q.dtype))


def test_contiguous_cache_rows_without_keys():
    """Causal rows before the first key (a cache row of length 0, or fewer keys than queries):
    out 0 and softmax_lse +inf, as flash_attn_func gives them."""
    k_cache, v_cache = rand((2, 6, 1, 4), seed=160), rand((2, 6, 1, 4), seed=161)
    q = rand((2, 3, 2, 4), seed=162)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([0, 2], dtype=torch.int32),
                                       causal=True, return_softmax_lse=True)
    assert bool((out[0] == 0).all()) and bool(torch.isinf(lse[0]).all()) and bool((lse[0] > 0).all())
    expected, expected_lse, _ = flash_attn_func(q[1:], k_cache[1:, :2], v_cache[1:, :2], causal=True,
                                                return_attn_probs=True)
    assert torch.equal(out[1:], expected) and torch.equal(lse[1:], expected_lse)
    assert bool((out[1, 0] == 0).all()) and bool(torch.isinf(lse[1, :, 0]).all())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_slopes_not_finite_name_the_argument(bad):
    q, k, v = qkv(1, 3, 3, 2, 1, 4)
    slopes = torch.tensor([0.5, bad])
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_with_kvcache(q[:, :1], k, v, alibi_slopes=slopes[None].expand(1, 2).contiguous())


def test_noncontiguous_cache_names_the_argument():
    cache = rand((2, 6, 2, 8), seed=170)[..., ::2]  # the last axis not contiguous
    with pytest.raises(ValueError, match="k_cache"):
        flash_attn_with_kvcache(rand((2, 1, 2, 4), seed=171), cache, cache.clone(), cache_seqlens=3)


def test_flash_attn_func_without_gradients_is_bitwise_the_differentiable_call():
    """The forward alone (no tensor requires grad, or grad mode off) gives the output and
    softmax_lse of the call that records gradients."""
    for sq, sk, slopes in ((5, 5, slopes_of((4,))), (2, 7, slopes_of((2, 4))), (6, 3, None)):
        q, k, v = qkv(2, sq, sk, 4, 2, 4, seed=180)
        out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        graded, graded_lse, _ = flash_attn_func(*leaves, causal=True, alibi_slopes=slopes, return_attn_probs=True)
        assert graded.requires_grad and not out.requires_grad
        assert torch.equal(out, graded.detach()) and torch.equal(lse, graded_lse)
        with torch.no_grad():
            assert torch.equal(flash_attn_func(*leaves, causal=True, alibi_slopes=slopes), out)


def test_meta_slopes_with_cpu_tensors_name_the_argument():
    q, k, v = qkv(1, 3, 3, 2, 1, 4)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.empty(2, device="meta"))


# One library call per FlashAttention call, on the caller's tensors. ---------------------------------


class _Calls:
    """Records the calls of poslsh._core's functions `names` (the arrays passed in each)."""

    def __init__(self, monkeypatch, names):
        self.calls = []
        for name in names:
            function = getattr(poslsh._core, name)

            def record(*args, _function=function, _name=name, **kwargs):
                self.calls.append((_name, args, kwargs))
                return _function(*args, **kwargs)
            monkeypatch.setattr(poslsh._core, name, record)


KERNELS = ["multihead_attention", "multihead_attention_varlen", "multihead_attention_with_lse",
           "multihead_attention_backward", "multihead_attention_paged", "multihead_attention_paged_with_lse",
           "lsh_attention_mean_of_outputs", "lsh_attention_mean_of_outputs_backward"]


def _cache_array(x):
    return x.bits if isinstance(x, poslsh.BFloat16Bits) else x


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_lse", [False, True])
def test_kvcache_step_is_one_call_on_the_callers_cache(monkeypatch, layout, dtype, with_lse):
    """A decode step of 3 rows with (batch, nheads) slopes: one multihead_attention_paged call whose
    k_pages and v_pages are the caller's cache tensors (shared memory, no copy), whatever the
    layout; the unused pages (NaN) are never read."""
    batch, block_size, heads, heads_k, d = 3, 8, 4, 2, 8
    slopes = slopes_of((batch, heads), torch.float32)
    q = rand((batch, 1, heads, d), dtype, 200)
    k_new, v_new = rand((batch, 1, heads_k, d), dtype, 201), rand((batch, 1, heads_k, d), dtype, 202)
    lengths = torch.tensor([5, 20, 11], dtype=torch.int32)
    if layout == "paged":
        k_cache = torch.full((10, block_size, heads_k, d), math.nan, dtype=dtype)
        table = torch.tensor([[7, 9, -1], [0, 3, 2], [8, 1, -1]], dtype=torch.int32)
        for b, length in enumerate(lengths.tolist()):
            for t in range(length):
                k_cache[table[b, t // block_size], t % block_size] = rand((heads_k, d), dtype, 300 + 40 * b + t)
        extras = dict(block_table=table)
    else:
        k_cache = torch.full((batch, 24, heads_k, d), math.nan, dtype=dtype)
        for b, length in enumerate(lengths.tolist()):
            k_cache[b, :length] = rand((length, heads_k, d), dtype, 400 + b)
        extras = {}
    v_cache = k_cache.clone()
    calls = _Calls(monkeypatch, KERNELS)
    result = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True,
                                     alibi_slopes=slopes, return_softmax_lse=with_lse, **extras)
    out = result[0] if with_lse else result
    assert [name for name, _, _ in calls.calls] == [
        "multihead_attention_paged_with_lse" if with_lse else "multihead_attention_paged"]
    _, args, kwargs = calls.calls[0]
    for array, cache in ((args[1], k_cache), (args[2], v_cache)):
        array = _cache_array(array)
        assert np.shares_memory(array, cache.view(torch.int16).numpy() if dtype == torch.bfloat16 else cache.numpy())
        assert array.shape == tuple(cache.shape)
    assert len(kwargs["sigmas"]) == batch * heads
    assert bool(torch.isfinite(out).all())
    # Bitwise each row's own call on its tokens gathered.
    for b, length in enumerate(lengths.tolist()):
        if layout == "paged":
            rows = [k_cache[table[b, t // block_size], t % block_size] for t in range(length + 1)]
            keys = torch.stack(rows)[None]
            values = torch.stack([v_cache[table[b, t // block_size], t % block_size] for t in range(length + 1)])[None]
        else:
            keys, values = k_cache[None, b, :length + 1], v_cache[None, b, :length + 1]
        queries = torch.cat([torch.zeros((1, length, heads, d), dtype=dtype), q[b:b + 1]], 1)
        want = flash_attn_func(queries, keys, values, causal=True, alibi_slopes=slopes[b], return_attn_probs=with_lse)
        if with_lse:
            assert torch.equal(out[b], want[0][0, -1:]) and torch.equal(result[1][b], want[1][0, :, -1:])
        else:
            assert torch.equal(out[b], want[0, -1:])


def test_flash_calls_are_one_library_call(monkeypatch):
    """flash_attn_func with (batch, nheads) slopes, forward and backward, and mean_of_outputs: one
    call of the library per pass, through the method table."""
    q, k, v = qkv(3, 5, 5, 4, 2, 4, requires_grad=True)
    slopes = slopes_of((3, 4)).requires_grad_()
    calls = _Calls(monkeypatch, KERNELS)
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    out.sum().backward()
    assert [name for name, _, _ in calls.calls] == ["multihead_attention_with_lse", "multihead_attention_backward"]
    expected, _ = dense(q, k, v, slopes, True)
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), atol=1e-12, rtol=0)
    calls.calls.clear()
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes.detach(), method="mean_of_outputs", samples=3)
    out.sum().backward()
    assert [name for name, _, _ in calls.calls] == ["multihead_attention_varlen", "multihead_attention_backward"]
    assert all(kwargs["method"] == "mean_of_outputs" for _, _, kwargs in calls.calls)


def test_training_with_fewer_queries_than_keys_is_one_call_per_pass(monkeypatch):
    """Exact training calls whose sequences have fewer queries than keys: the forward and the
    packed slice backward (cu_seqlens and cu_seqlens_k), one library call each, no padded rows."""
    q, k, v = qkv(3, 4, 9, 4, 2, 4, requires_grad=True)
    slopes = slopes_of((3, 4)).requires_grad_()
    calls = _Calls(monkeypatch, KERNELS)
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    grads = torch.autograd.grad(out, (q, k, v, slopes), torch.ones_like(out))
    names = [name for name, _, _ in calls.calls]
    assert len(names) == 2 and names[1] == "multihead_attention_backward", names
    assert "cu_seqlens_k" in calls.calls[1][2]
    expected_out, _ = dense(q, k, v, slopes, True)
    expected = torch.autograd.grad(expected_out, (q, k, v, slopes), torch.ones_like(expected_out))
    for name, got, want in zip("q k v slopes".split(), grads, expected):
        np.testing.assert_allclose(got.double().numpy(), want.double().numpy(), atol=1e-10, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("method", ["lsh", "lsh_per_sample", "fixed_blocks"])
def test_lsh_training_with_fewer_queries_than_keys_is_one_call_per_pass(monkeypatch, method):
    """LSH training calls whose sequences have fewer queries than keys: the forward and the
    packed slice backward, one library call each, no padded rows; the gradients those of the
    self-attention backward with the queries padded at the front (zero rows, zero dout; for
    lsh_per_sample and fixed_blocks the per-sample evaluation, sample by sample)."""
    q, k, v = qkv(2, 5, 70, 2, 2, 4, requires_grad=True)
    extras = dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.05]), method=method, samples=4, seed=3)
    dout = rand((2, 5, 2, 4), torch.float64, 81)
    calls = _Calls(monkeypatch, KERNELS)
    grads = torch.autograd.grad(flash_attn_func(q, k, v, **extras), (q, k, v), dout)
    names = [name for name, _, _ in calls.calls]
    assert len(names) == 2 and names[1] == "multihead_attention_backward", names
    assert "cu_seqlens_k" in calls.calls[1][2]
    padded = torch.cat([torch.zeros(2, 65, 2, 4, dtype=q.dtype), q.detach()], dim=1).requires_grad_()
    out_padded = flash_attn_func(padded, k, v, **extras)
    dout_padded = torch.cat([torch.zeros(2, 65, 2, 4, dtype=dout.dtype), dout], dim=1)
    expected = torch.autograd.grad(out_padded, (padded, k, v), dout_padded)
    for name, got, want in zip("qkv", grads, (expected[0][:, 65:], *expected[1:])):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-13, rtol=1e-12, err_msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mean_of_outputs_half_precision(dtype):
    """mean_of_outputs on half-precision tensors read in place: precision="float_products" gives
    the float32 call on the widened tensors rounded once, and the gradients the float32 ones on
    the widened tensors, cast once."""
    q, k, v = qkv(2, 6, 6, 2, 1, 8, dtype, seed=210, requires_grad=True)
    wide = [x.detach().float().requires_grad_() for x in (q, k, v)]
    slopes = torch.tensor([0.3, 0.1])
    extras = dict(causal=True, alibi_slopes=slopes, method="mean_of_outputs", samples=3, seed=1)
    out = flash_attn_func(q, k, v, precision="float_products", **extras)
    out_wide = flash_attn_func(*wide, **extras)
    assert out.dtype == dtype and torch.equal(out, out_wide.to(dtype))
    dout = rand((2, 6, 2, 8), dtype, 211)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads_wide = torch.autograd.grad(out_wide, wide, dout.float())
    for got, want in zip(grads, grads_wide):
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))
