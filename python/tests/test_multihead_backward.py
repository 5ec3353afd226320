"""multihead_attention_with_lse and multihead_attention_backward on [n, H, d] and [H, n, d]
arrays (grouped-query included) against dense numpy gradients written here, and against
central finite differences of the forward."""

import numpy as np
import pytest

import poslsh
import reference
from conftest import METHODS


def heads_of(array, layout):
    """[n, H, d] views of an array in the given layout."""
    return array if layout == "nhd" else array.transpose(1, 0, 2)


def head_scores(method, q, k, sigma, h, causal, samples, seed, band_error, tau):
    """(x, w) of query head h: scores x_ij and weights w_ij of the method, n x n, float64."""
    n = q.shape[0]
    keep = reference.visible(n, causal).astype(np.float64)
    scores = tau * (q @ k.T)
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    if method == "exact_tiled":
        return scores - distance / sigma, keep
    if method == "exact_banded":
        band = int(np.ceil(sigma * np.log(1.0 / band_error)))
        return scores - distance / sigma, keep * (distance <= band)
    if method == "fixed_blocks":
        widths, offsets = [2.0 * sigma], [0.0]
    else:
        hashes = poslsh.rbf_hashes(sigma, samples, seed, stream=h)
        widths, offsets = hashes.widths, hashes.offsets
    # c_ij = s M~_ij: the number of samples putting i and j in one block.
    return scores, len(widths) * reference.mean_mask(widths, offsets, n, causal)


def dense_multihead(method, q, k, v, dout, sigmas, causal, samples=4, seed=0, band_error=1e-2, scale=None):
    """out, lse [H, n] and dq, dk, dv of every head from the weighted softmax
    P_ij = w_ij e^{x_ij - lse_i}: dV = P^T dO, dS = P o (dO V^T - D), D_i = dO_i . O_i,
    dQ = tau dS K, dK = tau dS^T Q; dK, dV summed over the query heads of a KV head.
    Arrays [n, H, d] in float64."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    n, heads, d = q.shape
    group = heads // k.shape[1]
    tau = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((n, heads, v.shape[2]))
    lse = np.zeros((heads, n))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for h in range(heads):
        g = h // group
        qh, kh, vh, doh = q[:, h], k[:, g], v[:, g], dout[:, h]
        x, w = head_scores(method, qh, kh, sigmas[h], h, causal, samples, seed, band_error, tau)
        with np.errstate(divide="ignore"):
            logits = x + np.log(w)
        top = logits.max(axis=1, keepdims=True)
        lse[h] = (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))[:, 0]
        p = np.exp(logits - lse[h][:, None])
        oh = p @ vh
        out[:, h] = oh
        delta = (doh * oh).sum(axis=1, keepdims=True)
        ds = p * (doh @ vh.T - delta)
        dq[:, h] = tau * ds @ kh
        dk[:, g] += tau * ds.T @ qh
        dv[:, g] += p.T @ doh
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_equal_the_dense_formulas(rng, method, layout, causal):
    n, heads, kv_heads, d, d_v = 75, 4, 2, 6, 5
    shape = (lambda h, w: (n, h, w)) if layout == "nhd" else (lambda h, w: (h, n, w))
    q = rng.uniform(-1, 1, shape(heads, d))
    k = rng.uniform(-1, 1, shape(kv_heads, d))
    v = rng.uniform(-1, 1, shape(kv_heads, d_v))
    dout = rng.uniform(-1, 1, shape(heads, d_v))
    sigmas = np.array([3.0, 5.0, 8.0, 13.0])
    keywords = dict(layout=layout, method=method, masking="causal" if causal else "bidirectional",
                    sigmas=sigmas, samples=4, seed=7, band_error=1e-2)
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, **keywords)
    assert out.shape == shape(heads, d_v) and lse.shape == (heads, n)
    dq, dk, dv = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, **keywords)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    want = dense_multihead(method, *(heads_of(x, layout) for x in (q, k, v, dout)), sigmas, causal,
                           samples=4, seed=7, band_error=1e-2)
    np.testing.assert_allclose(heads_of(out, layout), want[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want[1], rtol=0, atol=1e-12)
    for got, expected in zip((dq, dk, dv), want[2:]):
        np.testing.assert_allclose(heads_of(got, layout), expected, rtol=0, atol=1e-11)
    # out is bitwise that of multihead_attention.
    np.testing.assert_array_equal(out, poslsh.multihead_attention(q, k, v, **keywords))


@pytest.mark.parametrize("method", ["lsh_fused", "exact_tiled"])
def test_float32_against_the_dense_formulas(rng, method):
    n, heads, d = 130, 2, 16
    q, k, v, dout = (rng.uniform(-1, 1, (n, heads, d)).astype(np.float32) for _ in range(4))
    sigmas = poslsh.alibi_sigmas(heads)
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, method=method, samples=8, seed=2)
    assert out.dtype == lse.dtype == np.float32
    grads = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, method=method, samples=8, seed=2)
    want = dense_multihead(method, q, k, v, dout, sigmas, True, samples=8, seed=2)
    np.testing.assert_allclose(out, want[0], rtol=0, atol=2e-5)
    np.testing.assert_allclose(lse, want[1], rtol=0, atol=2e-5)
    for got, expected in zip(grads, want[2:]):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", ["lsh_fused", "exact_tiled", "fixed_blocks"])
def test_gradients_equal_finite_differences(rng, method):
    """dL/dx for L = sum(dout * out) by central differences of multihead_attention (float64)."""
    n, heads, kv_heads, d = 14, 2, 1, 3
    q = rng.uniform(-1, 1, (n, heads, d))
    k = rng.uniform(-1, 1, (n, kv_heads, d))
    v = rng.uniform(-1, 1, (n, kv_heads, d))
    dout = rng.uniform(-1, 1, (n, heads, d))
    keywords = dict(method=method, sigmas=[2.0, 4.0], samples=3, seed=5, masking="bidirectional")
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, **keywords)
    grads = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, **keywords)
    step = 1e-6
    for array, grad in zip((q, k, v), grads):
        numeric = np.zeros(array.shape)
        for index in np.ndindex(array.shape):
            saved = array[index]
            array[index] = saved + step
            plus = (dout * poslsh.multihead_attention(q, k, v, **keywords)).sum()
            array[index] = saved - step
            minus = (dout * poslsh.multihead_attention(q, k, v, **keywords)).sum()
            array[index] = saved
            numeric[index] = (plus - minus) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=0, atol=1e-8)


def test_without_groups_each_head_is_the_single_head_backward(rng):
    n, heads, d = 140, 3, 8
    q, k, v, dout = (rng.uniform(-1, 1, (n, heads, d)) for _ in range(4))
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, samples=6, seed=4)
    dq, dk, dv = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, samples=6, seed=4)
    sigmas = poslsh.alibi_sigmas(heads)
    for h in range(heads):
        hashes = poslsh.rbf_hashes(sigmas[h], 6, 4, stream=h)
        single_out, single_lse = poslsh.lsh_attention_fused_with_lse(q[:, h], k[:, h], v[:, h], hashes)
        np.testing.assert_array_equal(out[:, h], single_out)
        np.testing.assert_array_equal(lse[h], single_lse)
        single = poslsh.lsh_attention_fused_backward(q[:, h], k[:, h], v[:, h], hashes, out[:, h], lse[h], dout[:, h])
        for got, want in zip((dq[:, h], dk[:, h], dv[:, h]), single):
            np.testing.assert_array_equal(got, want)


def test_outputs_in_place_and_packed_inputs(rng):
    """Inputs are slices of a packed [n, 3, H, d] buffer; out=, lse=, dq=, dk=, dv= are views
    into larger buffers, written in place and returned."""
    n, heads, d = 50, 2, 4
    qkv = rng.uniform(-1, 1, (n, 3, heads, d))
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    dout = rng.uniform(-1, 1, (n, heads, d))
    out_parent = np.full((n, heads + 1, d), np.nan)
    lse_parent = np.full((heads, n + 3), np.nan)
    out, lse = out_parent[:, 1:], lse_parent[:, 2 : n + 2]
    returned = poslsh.multihead_attention_with_lse(q, k, v, method="exact_tiled", out=out, lse=lse)
    assert returned[0] is out and returned[1] is lse
    assert np.isnan(out_parent[:, 0]).all() and np.isnan(lse_parent[:, :2]).all()
    grads_parent = np.full((3, n, heads, d), np.nan)
    dq, dk, dv = grads_parent[0], grads_parent[1], grads_parent[2]
    returned = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, method="exact_tiled", dq=dq, dk=dk, dv=dv)
    assert returned[0] is dq and returned[1] is dk and returned[2] is dv
    want = dense_multihead("exact_tiled", q, k, v, dout, poslsh.alibi_sigmas(heads), True)
    np.testing.assert_allclose(lse, want[1], rtol=0, atol=1e-12)
    for got, expected in zip(grads_parent, want[2:]):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-11)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_packed_batch_is_each_sequence_dense(rng, method, layout):
    """cu_seqlens=: out, lse and the gradients of each sequence are the dense formulas of that
    sequence alone (positions from 0), and out is multihead_attention_varlen's."""
    cu = np.array([0, 30, 30, 31, 75], dtype=np.int32)
    n, heads, kv_heads, d, d_v = 75, 4, 2, 6, 5
    shape = (lambda h, w: (n, h, w)) if layout == "nhd" else (lambda h, w: (h, n, w))
    q, dout = rng.uniform(-1, 1, shape(heads, d)), rng.uniform(-1, 1, shape(heads, d_v))
    k, v = rng.uniform(-1, 1, shape(kv_heads, d)), rng.uniform(-1, 1, shape(kv_heads, d_v))
    sigmas = np.array([3.0, 5.0, 8.0, 13.0])
    keywords = dict(layout=layout, method=method, sigmas=sigmas, samples=4, seed=7, band_error=1e-2)
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, **keywords, cu_seqlens=cu)
    dq, dk, dv = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, **keywords, cu_seqlens=cu)
    np.testing.assert_array_equal(out, poslsh.multihead_attention_varlen(q, k, v, cu, cu, **keywords))
    for a, e in zip(cu[:-1], cu[1:]):
        if a == e:
            continue
        want = dense_multihead(method, *(heads_of(x, layout)[a:e] for x in (q, k, v, dout)), sigmas, True,
                               samples=4, seed=7, band_error=1e-2)
        np.testing.assert_allclose(heads_of(out, layout)[a:e], want[0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[:, a:e], want[1], rtol=0, atol=1e-12)
        for got, expected in zip((dq, dk, dv), want[2:]):
            np.testing.assert_allclose(heads_of(got, layout)[a:e], expected, rtol=0, atol=1e-11)


def test_packed_batch_errors(rng):
    q, k, v = rng.uniform(-1, 1, (10, 2, 4)), rng.uniform(-1, 1, (10, 1, 4)), rng.uniform(-1, 1, (10, 1, 4))
    with pytest.raises(TypeError, match="multihead_attention_varlen: argument 'cu_seqlens' has dtype float64"):
        poslsh.multihead_attention_with_lse(q, k, v, cu_seqlens=np.array([0.0, 10.0]))
    with pytest.raises(ValueError, match="multihead_attention_varlen: argument 'cu_seqlens'"):
        poslsh.multihead_attention_with_lse(q, k, v, cu_seqlens=np.array([0, 4, 9], dtype=np.int32))
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, cu_seqlens=np.array([0, 4, 10], dtype=np.int32))
    with pytest.raises(ValueError, match="multihead_attention_varlen_backward: argument 'cu_seqlens'"):
        poslsh.multihead_attention_backward(q, k, v, out, lse, out, cu_seqlens=np.array([1, 10], dtype=np.int32))


def test_thread_count_does_not_change_bits(rng):
    n, heads, kv_heads, d = 300, 4, 2, 16
    q, dout = (rng.uniform(-1, 1, (n, heads, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.uniform(-1, 1, (n, kv_heads, d)).astype(np.float32) for _ in range(2))
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, num_threads=1)
    one = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, num_threads=1)
    two = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, num_threads=2)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_errors(rng):
    n, heads, d = 10, 4, 8
    q, dout = (rng.uniform(-1, 1, (n, heads, d)) for _ in range(2))
    k, v = (rng.uniform(-1, 1, (n, 2, d)) for _ in range(2))
    out, lse = poslsh.multihead_attention_with_lse(q, k, v)
    backward = poslsh.multihead_attention_backward
    with pytest.raises(TypeError, match="multihead_attention_backward: argument 'dout' has dtype float32: must be float64 like 'q'"):
        backward(q, k, v, out, lse, dout.astype(np.float32))
    with pytest.raises(TypeError, match="argument 'lse' has dtype float32: must be float64"):
        backward(q, k, v, out, lse.astype(np.float32), dout)
    with pytest.raises(ValueError, match=r"argument 'lse' must be a 2-D array of shape \(4, 10\)"):
        backward(q, k, v, out, lse[:, :5], dout)
    with pytest.raises(ValueError, match="multihead_attention_backward: argument 'dk' = 10x4x8: must be 10x2x8"):
        backward(q, k, v, out, lse, dout, dk=np.zeros((n, heads, d)))
    with pytest.raises(ValueError, match="argument 'dq' shares memory with 'dout'"):
        backward(q, k, v, out, lse, dout, dq=dout)
    with pytest.raises(ValueError, match="argument 'dv' shares memory with 'dk'"):
        grads = np.zeros((n, 2, d))
        backward(q, k, v, out, lse, dout, dk=grads, dv=grads)
    with pytest.raises(ValueError, match="argument 'method' = flash: must be lsh_fused, lsh_per_sample, fixed_blocks, exact_tiled, exact_banded or mean_of_outputs"):
        backward(q, k, v, out, lse, dout, method="flash")
    with pytest.raises(ValueError, match="multihead_attention_with_lse: argument 'k.tokens' = 9: must equal q.tokens = 10"):
        poslsh.multihead_attention_with_lse(q, k[:9], v[:9])
    with pytest.raises(ValueError, match="argument 'lse' is read-only"):
        frozen = np.zeros((heads, n))
        frozen.flags.writeable = False
        poslsh.multihead_attention_with_lse(q, k, v, lse=frozen)


def dense_window_head(q, k, v, dout, sigma, causal, window, tau):
    """out and dL/dslope (slope = 1/sigma) of one exact head over FlashAttention's window
    (left, right): P = softmax_j(tau q_i.k_j - |i-j| / sigma) over the kept keys,
    dS = P o (dO V^T - D), dL/dslope = -sum_ij dS_ij |i - j|."""
    n = q.shape[0]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = reference.visible(n, causal)
    if window[0] >= 0:
        keep = keep & (j >= i - window[0])
    if window[1] >= 0:
        keep = keep & (j <= i + window[1])
    x = np.where(keep, tau * (q @ k.T) - np.abs(i - j) / sigma, -np.inf)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dp = dout @ v.T
    ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))
    return p @ v, -(ds * np.abs(i - j)).sum()


@pytest.mark.parametrize("method", ["exact_tiled", "exact_banded"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (9, -1), (4, 13), (-1, 0)])
def test_windows_and_slope_gradients_equal_the_dense_formulas(rng, method, causal, window):
    n, heads, kv_heads, d = 70, 4, 2, 8
    q, k, v = (rng.standard_normal((n, h, d)) for h in (heads, kv_heads, kv_heads))
    dout = rng.standard_normal((n, heads, d))
    sigmas = [0.7, 3.0, 25.0, 1e4]
    keywords = dict(method=method, masking="causal" if causal else "bidirectional", sigmas=sigmas,
                    window=window, band_error=0.5)
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, **keywords)
    dslopes = np.zeros(heads)
    poslsh.multihead_attention_backward(q, k, v, out, lse, dout, dslopes=dslopes, **keywords)
    for h in range(heads):
        window_h = window
        if method == "exact_banded":  # the band narrows the window on both sides
            band = int(np.ceil(sigmas[h] * np.log(2.0)))
            window_h = tuple(band if side < 0 else min(side, band) for side in window)
        dense_out, dense_dslope = dense_window_head(q[:, h], k[:, h // 2], v[:, h // 2], dout[:, h], sigmas[h],
                                                    causal, window_h, 1 / np.sqrt(d))
        np.testing.assert_allclose(out[:, h], dense_out, rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(dslopes[h], dense_dslope, rtol=1e-10, atol=1e-10)


def test_window_and_slope_gradient_errors(rng):
    n, d = 12, 4
    q = rng.standard_normal((n, 2, d))
    # The library's checks of the window, options.window_left and window_right.
    with pytest.raises(ValueError, match="argument 'options.window_left' = 3: a local window needs method "
                                         r"exact_tiled or exact_banded \(got lsh_fused\)"):
        poslsh.multihead_attention(q, q, q, method="lsh_fused", window=(3, -1))
    with pytest.raises(ValueError, match=r"argument 'options.window_left' = -2: must be -1 \(unbounded\) or >= 0"):
        poslsh.multihead_attention(q, q, q, method="exact_tiled", window=(-2, 0))
    out, lse = poslsh.multihead_attention_with_lse(q, q, q, method="exact_tiled")
    with pytest.raises(ValueError, match="'dslopes'"):
        poslsh.multihead_attention_backward(q, q, q, out, lse, q, method="exact_tiled", dslopes=np.zeros(3))
    with pytest.raises(TypeError, match="'dslopes'"):
        poslsh.multihead_attention_backward(q, q, q, out, lse, q, method="exact_tiled",
                                            dslopes=np.zeros(2, dtype=np.float32))
    out, lse = poslsh.multihead_attention_with_lse(q, q, q, method="lsh_fused")
    with pytest.raises(ValueError, match="'dslopes'"):
        poslsh.multihead_attention_backward(q, q, q, out, lse, q, method="lsh_fused", dslopes=np.zeros(2))


def test_slice_backward_by_offsets(rng):
    """query_offset=, key_offset= select the library's slice backward: over the whole sequence
    (both offsets 0) the gradients and dslopes equal the sequence's backward bitwise; the
    gradients are added to given arrays, for lsh_fused too; only the methods with a slice
    backward, one sequence."""
    n, heads, kv_heads, d = 40, 4, 2, 8
    q = rng.uniform(-1, 1, (n, heads, d))
    k, v = rng.uniform(-1, 1, (n, kv_heads, d)), rng.uniform(-1, 1, (n, kv_heads, d))
    dout = rng.uniform(-1, 1, (n, heads, d))
    keywords = dict(method="exact_tiled", masking="causal", sigmas=[2.0, 5.0, 9.0, 30.0], window=(7, -1))
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, **keywords)
    whole_slopes, slice_slopes = np.zeros(heads), np.zeros(heads)
    whole = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, dslopes=whole_slopes, **keywords)
    sliced = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, query_offset=0, key_offset=0,
                                                 dslopes=slice_slopes, **keywords)
    for a, b in zip(whole, sliced):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole_slopes, slice_slopes)
    given = [np.ones_like(x) for x in whole]
    added = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, query_offset=0, key_offset=0,
                                                dq=given[0], dk=given[1], dv=given[2], **keywords)
    for a, b in zip(added, whole):
        np.testing.assert_allclose(a, b + 1.0, rtol=0, atol=1e-14)
    lsh = {**keywords, "method": "lsh_fused", "window": (-1, -1)}
    out, lse = poslsh.multihead_attention_with_lse(q, k, v, **lsh)
    whole = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, **lsh)
    sliced = poslsh.multihead_attention_backward(q, k, v, out, lse, dout, query_offset=0, key_offset=0, **lsh)
    for a, b in zip(whole, sliced):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="multihead_attention_slice_backward: argument 'options.method'"):
        poslsh.multihead_attention_backward(q, k, v, out, lse, dout, query_offset=0, key_offset=0,
                                            **{**lsh, "method": "mean_of_outputs"})
    with pytest.raises(ValueError, match="argument 'query_offset' = 5: must place the 40 queries among the keys"):
        poslsh.multihead_attention_backward(q, k, v, out, lse, dout, query_offset=5, key_offset=0, **lsh)
    cu = np.array([0, 20, 40], dtype=np.int32)
    with pytest.raises(ValueError, match="query_offset"):
        poslsh.multihead_attention_backward(q, k, v, out, lse, dout, query_offset=0, cu_seqlens=cu, **keywords)
