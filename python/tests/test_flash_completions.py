"""poslsh.torch's FlashAttention-2 drop-in, completed: softmax_lse of causal ALiBi calls as
FlashAttention-2 returns it, non-causal calls with seqlen_q > seqlen_k, KV caches with strides
read and written in place, window_size as any pair of integers, and the qkv- and kv-packed
calls. Each against a dense float64 reference written here from FlashAttention-2's definitions
(its bias, alignment, window and lse), gradients against torch autograd through it."""

import inspect
import math

import numpy as np
import pytest

import poslsh

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import poslsh.torch as ptorch  # noqa: E402

flash_attn_func = ptorch.flash_attn_func
flash_attn_varlen_func = ptorch.flash_attn_varlen_func
flash_attn_with_kvcache = ptorch.flash_attn_with_kvcache


def reference(q, k, v, slopes=None, causal=False, window=(-1, -1), scale=None, counts=None, bound=None):
    """FlashAttention-2's attention written out in float64: q (B, sq, H, d), k, v (B, sk, Hk, d),
    query head h reading K/V head h // (H / Hk); query i at key position P = i + sk - sq; the
    window (left, right) after FlashAttention-2's conversions (a negative side or one >= sk is
    unbounded, or >= bound when given: flash_attn_with_kvcache's cache capacity; causal sets
    right = 0) keeps P - left <= j <= P + right. The ALiBi bias of its
    kernels: +slope_h * j in the causal kernel (left unbounded, right = 0), -slope_h |P - j|
    otherwise. counts (H, sq, sk), when given, weights the keys (LSH: the scores plus log c_ij).
    Returns out (B, sq, H, d_v) and lse (B, H, sq), +inf for rows without a visible key (whose
    out is 0), as FlashAttention-2 returns them. Differentiable in q, k, v and slopes."""
    batch, sq, heads, d = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    kx, vx = k.repeat_interleave(heads // heads_k, 2), v.repeat_interleave(heads // heads_k, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, kx) * (1.0 / math.sqrt(d) if scale is None else scale)
    left, right = window
    bound = sk if bound is None else bound
    left = -1 if left < 0 or left >= bound else left
    right = 0 if causal else (-1 if right < 0 or right >= bound else right)
    position = torch.arange(sq)[:, None] + sk - sq
    key = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= key >= position - left
    if right >= 0:
        keep &= key <= position + right
    if slopes is not None:
        m = slopes.double()
        m = (m.expand(batch, heads) if m.dim() == 1 else m)[:, :, None, None]
        bias = key.double() if (left == -1 and right == 0) else -(position - key).abs().double()
        scores = scores + m * bias
    if counts is not None:
        scores = scores + torch.log(counts.double())[None]
    scores = scores.masked_fill(~keep, -math.inf)
    has_key = torch.isfinite(scores).any(dim=-1, keepdim=True)  # rows without one: out 0, no gradient
    scores = scores.masked_fill(~has_key, 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~has_key[..., 0], math.inf)
    probs = torch.softmax(scores, dim=-1) * has_key
    return torch.einsum("bhij,bjhd->bihd", probs, vx), lse


def rand(shape, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator, dtype=torch.float64).mul_(2).sub_(1).to(dtype)


def qkv(batch, sq, sk, heads, heads_k, d, dtype=torch.float64, seed=0):
    return (rand((batch, sq, heads, d), dtype, seed), rand((batch, sk, heads_k, d), dtype, seed + 1),
            rand((batch, sk, heads_k, d), dtype, seed + 2))


def slopes_of(shape, seed=5):
    """Slopes of any values >= 0 (one of them 0), float32 as FlashAttention-2 takes them."""
    values = rand(shape, torch.float64, seed).abs().mul(0.7).add(0.05)
    values.view(-1)[0] = 0.0
    return values.float()


def assert_lse(lse, expected, tol):
    """Equal to tol; the same rows +inf (no visible key)."""
    assert lse.dtype == torch.float32
    empty = torch.isinf(expected)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] > 0).all())
    np.testing.assert_allclose(lse[~empty].double().numpy(), expected[~empty].numpy(), rtol=tol, atol=tol)


def leaves(*tensors):
    return [x.detach().clone().requires_grad_() for x in tensors]


# softmax_lse of causal calls. --------------------------------------------------------------------


@pytest.mark.parametrize("sq, sk", [(6, 6), (3, 9), (8, 5)])
@pytest.mark.parametrize("slopes_shape", ["h", "bh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_lse_is_flash_attention_2s(sq, sk, slopes_shape, dtype):
    """FlashAttention-2's causal kernel adds +slope*j: its lse is the log-sum-exp of those scores
    (out the same softmax). Rows before the first key (sq > sk) keep +inf."""
    batch, heads = 2, 4
    q, k, v = qkv(batch, sq, sk, heads, 2, 8, dtype, seed=10)
    slopes = slopes_of((heads,) if slopes_shape == "h" else (batch, heads))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    expected, expected_lse = reference(q, k, v, slopes, causal=True)
    tol = 1e-12 if dtype == torch.float64 else 3e-6
    np.testing.assert_allclose(out.double().numpy(), expected.numpy(), atol=tol, rtol=0)
    assert_lse(lse, expected_lse, 2e-6)
    # The window (-1, 0) is FlashAttention-2's causal call: the same out and lse.
    out_w, lse_w, _ = flash_attn_func(q, k, v, window_size=(-1, 0), alibi_slopes=slopes, return_attn_probs=True)
    assert torch.equal(out_w, out) and torch.equal(lse_w, lse)


def test_lse_of_the_other_kernels_is_unchanged():
    """Non-causal calls and causal calls with a left window (FlashAttention-2's local kernel) keep
    the bias -slope |P - j| in their lse."""
    q, k, v = qkv(2, 5, 9, 4, 4, 8, seed=20)
    slopes = slopes_of((4,))
    for causal, window in ((False, (-1, -1)), (False, (3, 2)), (True, (2, -1)), (False, (4, 0))):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                      return_attn_probs=True)
        expected, expected_lse = reference(q, k, v, slopes, causal, window)
        np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=1e-12, rtol=0)
        assert_lse(lse, expected_lse, 2e-6)


def test_causal_lse_of_varlen_and_kvcache_calls():
    """The same convention in flash_attn_varlen_func (per sequence, (batch, nheads) slopes) and
    flash_attn_with_kvcache (contiguous and paged caches, over cache_seqlens + new keys)."""
    heads, d = 4, 8
    lengths_q, lengths_k = [3, 1, 5], [7, 4, 5]
    slopes = slopes_of((3, heads))
    q = rand((sum(lengths_q), heads, d), seed=30)
    k, v = rand((sum(lengths_k), 2, d), seed=31), rand((sum(lengths_k), 2, d), seed=32)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                         alibi_slopes=slopes, return_attn_probs=True)
    for b in range(3):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        expected, expected_lse = reference(q[None, qs], k[None, ks], v[None, ks], slopes[b:b + 1], causal=True)
        np.testing.assert_allclose(out[qs].numpy(), expected[0].numpy(), atol=1e-12, rtol=0)
        assert_lse(lse[:, qs], expected_lse[0], 2e-6)

    batch, capacity, new = 2, 12, 2
    cache_k, cache_v = rand((batch, capacity, 2, d), seed=33), rand((batch, capacity, 2, d), seed=34)
    q, k_new, v_new = rand((batch, 3, heads, d), seed=35), rand((batch, new, 2, d), seed=36), rand((batch, new, 2, d),
                                                                                                 seed=37)
    seqlens = torch.tensor([4, 9], dtype=torch.int32)
    slopes = slopes_of((heads,))
    pages_k = cache_k.reshape(batch * 3, 4, 2, d).clone()
    pages_v = cache_v.reshape(batch * 3, 4, 2, d).clone()
    table = torch.arange(batch * 3, dtype=torch.int32).reshape(batch, 3)
    for name, (ck, cv, extra) in {"contiguous": (cache_k.clone(), cache_v.clone(), {}),
                                  "paged": (pages_k, pages_v, {"block_table": table})}.items():
        out, lse = flash_attn_with_kvcache(q, ck, cv, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                           alibi_slopes=slopes, return_softmax_lse=True, **extra)
        for b in range(batch):
            total = int(seqlens[b]) + new
            keys = torch.cat([cache_k[b, :int(seqlens[b])], k_new[b]])
            values = torch.cat([cache_v[b, :int(seqlens[b])], v_new[b]])
            expected, expected_lse = reference(q[b:b + 1], keys[None], values[None], slopes, causal=True)
            assert keys.shape[0] == total
            np.testing.assert_allclose(out[b].numpy(), expected[0].numpy(), atol=1e-12, rtol=0, err_msg=name)
            assert_lse(lse[b], expected_lse[0], 2e-6)


def test_causal_gradients_are_unchanged_by_the_lse_convention():
    """The backward reads the library's lse, not the returned one: dq, dk, dv and d alibi_slopes
    of a causal call that returns softmax_lse equal torch autograd through the reference's out;
    the returned lse takes no gradient."""
    q, k, v = qkv(2, 5, 7, 4, 2, 8, seed=40)
    slopes = slopes_of((4,)).double()
    inputs = leaves(q, k, v, slopes)
    out, lse, _ = flash_attn_func(*inputs[:3], causal=True, alibi_slopes=inputs[3], return_attn_probs=True)
    assert not lse.requires_grad
    grad = rand(out.shape, seed=41)
    dq, dk, dv, ds = torch.autograd.grad(out, inputs, grad)
    ref_inputs = leaves(q, k, v, slopes)
    expected, _ = reference(*ref_inputs[:3], ref_inputs[3], causal=True)
    for got, want in zip((dq, dk, dv, ds), torch.autograd.grad(expected, ref_inputs, grad)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-11, rtol=1e-11)


# Non-causal calls with seqlen_q > seqlen_k. -------------------------------------------------------


@pytest.mark.parametrize("window", [(-1, -1), (3, 1), (0, 0), (2, 6)])
@pytest.mark.parametrize("slopes_shape", ["h", "bh"])
def test_more_queries_than_keys_forward_lse_and_gradients(window, slopes_shape):
    """Bottom-right alignment with rows before the first key (negative key positions): out, lse
    and dq, dk, dv, d alibi_slopes of the exact method against the reference (rows whose window
    holds no key: out 0, lse +inf, no gradient); grouped-query heads."""
    batch, sq, sk, heads = 2, 9, 4, 4
    q, k, v = qkv(batch, sq, sk, heads, 2, 8, seed=50)
    slopes = slopes_of((heads,) if slopes_shape == "h" else (batch, heads)).double()
    inputs = leaves(q, k, v, slopes)
    out, lse, _ = flash_attn_func(*inputs[:3], window_size=window, alibi_slopes=inputs[3], return_attn_probs=True)
    ref_inputs = leaves(q, k, v, slopes)
    expected, expected_lse = reference(*ref_inputs[:3], ref_inputs[3], window=window)
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), atol=1e-12, rtol=0)
    assert_lse(lse, expected_lse.detach(), 2e-6)
    grad = rand(out.shape, seed=51)
    for got, want, name in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, ref_inputs, grad),
                               ("dq", "dk", "dv", "dslopes")):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-11, rtol=1e-11, err_msg=name)
    # Without gradients: the same out and lse.
    with torch.no_grad():
        plain, plain_lse, _ = flash_attn_func(q, k, v, window_size=window, alibi_slopes=slopes,
                                              return_attn_probs=True)
    assert torch.equal(plain, out.detach()) and torch.equal(plain_lse, lse)


def test_more_queries_than_keys_varlen_banded_and_float32():
    """A packed batch mixing sequences with more queries than keys, fewer, and none; the banded
    method (its band on |P - j|); float32 against the float64 reference."""
    heads, d = 2, 4
    lengths_q, lengths_k = [6, 2, 3, 0], [2, 5, 0, 3]
    q = rand((sum(lengths_q), heads, d), torch.float32, seed=60)
    k, v = rand((sum(lengths_k), heads, d), torch.float32, seed=61), rand((sum(lengths_k), heads, d), torch.float32,
                                                                          seed=62)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    slopes = slopes_of((4, heads))
    inputs = leaves(q, k, v)
    out, lse, _ = flash_attn_varlen_func(*inputs, cu_q, cu_k, 6, 5, alibi_slopes=slopes, return_attn_probs=True)
    grad = rand(out.shape, torch.float32, seed=63)
    dq, dk, dv = torch.autograd.grad(out, inputs, grad)
    for b in range(4):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = leaves(q[None, qs], k[None, ks], v[None, ks])
        expected, expected_lse = reference(*ref, slopes[b:b + 1])
        np.testing.assert_allclose(out[qs].detach().numpy(), expected[0].detach().numpy(), atol=3e-6, rtol=0)
        assert_lse(lse[:, qs], expected_lse[0].detach(), 3e-6)
        if lengths_q[b] and lengths_k[b]:
            want = torch.autograd.grad(expected, ref, grad[None, qs].double())
            for got, w in zip((dq[qs], dk[ks], dv[ks]), want):
                np.testing.assert_allclose(got.numpy(), w[0].numpy(), atol=3e-5, rtol=0)
        else:
            assert not bool(dq[qs].any()) and not bool(dk[ks].any())
    q, k, v = qkv(1, 7, 3, 2, 2, 4, seed=64)
    slopes = torch.tensor([0.9, 0.3], dtype=torch.float32)
    band_error = 0.05
    bands = [poslsh.band_for_bias_error(1.0 / s, band_error) for s in slopes.tolist()]
    out, lse, _ = flash_attn_func(q, k, v, alibi_slopes=slopes, method="banded", band_error=band_error,
                                  return_attn_probs=True)
    counts = torch.stack([(torch.arange(7)[:, None] - 4 - torch.arange(3)[None, :]).abs() <= band
                          for band in bands]).double()
    expected, expected_lse = reference(q, k, v, slopes, counts=counts)
    np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=1e-12, rtol=0)
    assert_lse(lse, expected_lse, 2e-6)


def _lsh_counts(slopes, samples, seed, positions_q, positions_k):
    """c_ij = #{samples k: bin_k(P_i) = bin_k(P_j)}, bin_k(x) = floor((x - offset_k) / width_k) of
    rbf_hashes(sigma_h = 1 / slope_h, samples, seed, stream=h) (H, sq, sk)."""
    counts = []
    for h, slope in enumerate(slopes.tolist()):
        hashes = poslsh.rbf_hashes(1.0 / slope, samples, seed, stream=h)
        widths, offsets = np.asarray(hashes.widths)[:, None], np.asarray(hashes.offsets)[:, None]
        bins_q = np.floor((np.asarray(positions_q, dtype=np.float64)[None] - offsets) / widths)
        bins_k = np.floor((np.asarray(positions_k, dtype=np.float64)[None] - offsets) / widths)
        counts.append((bins_q[:, :, None] == bins_k[:, None, :]).sum(axis=0))
    return torch.tensor(np.stack(counts), dtype=torch.float64)


@pytest.mark.parametrize("method", ["lsh", "lsh_per_sample"])
def test_more_queries_than_keys_lsh_positions(method):
    """The LSH methods count shared bins at the positions: query row i at i, key j at
    seqlen_q - seqlen_k + j (from the first query): out, lse (log sum_j c_ij e^{tau q_i.k_j}) and
    dq, dk, dv against the count-weighted reference."""
    sq, sk, heads, samples, seed = 10, 4, 2, 6, 3
    q, k, v = qkv(1, sq, sk, heads, heads, 4, seed=70)
    slopes = torch.tensor([0.4, 0.15], dtype=torch.float32)
    inputs = leaves(q, k, v)
    out, lse, _ = flash_attn_func(*inputs, alibi_slopes=slopes, method=method, samples=samples, seed=seed,
                                  return_attn_probs=True)
    counts = _lsh_counts(slopes, samples, seed, np.arange(sq), np.arange(sk) + sq - sk)
    ref = leaves(q, k, v)
    expected, expected_lse = reference(*ref, counts=counts)
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), atol=1e-12, rtol=0)
    assert_lse(lse, expected_lse.detach(), 2e-6)
    grad = rand(out.shape, seed=71)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, ref, grad)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-11, rtol=1e-11)


def test_more_queries_than_keys_lsh_in_a_packed_batch():
    """A varlen batch mixing sequences with more queries than keys, fewer, and none: each
    sequence's LSH bins at its positions (from its first query when it has more queries, else
    from its first key), out and gradients against the count-weighted reference."""
    heads, d, samples, seed = 2, 4, 5, 9
    lengths_q, lengths_k = [9, 3, 0, 2], [4, 6, 2, 0]
    q = rand((sum(lengths_q), heads, d), seed=75)
    k, v = rand((sum(lengths_k), heads, d), seed=76), rand((sum(lengths_k), heads, d), seed=77)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    slopes = torch.tensor([0.3, 0.1], dtype=torch.float32)
    inputs = leaves(q, k, v)
    out = flash_attn_varlen_func(*inputs, cu_q, cu_k, 9, 6, alibi_slopes=slopes, method="lsh", samples=samples,
                                 seed=seed)
    grad = rand(out.shape, seed=78)
    dq, dk, dv = torch.autograd.grad(out, inputs, grad)
    for b, (m, length) in enumerate(zip(lengths_q, lengths_k)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if not (m and length):
            assert not bool(out[qs].any()) and not bool(dk[ks].any()) and not bool(dv[ks].any())
            continue
        first = min(0, length - m)  # P of query row 0 when it sits before the first key
        counts = _lsh_counts(slopes, samples, seed, np.arange(m) + length - m - first, np.arange(length) - first)
        ref = leaves(q[None, qs], k[None, ks], v[None, ks])
        expected, _ = reference(*ref, counts=counts)
        np.testing.assert_allclose(out[qs].detach().numpy(), expected[0].detach().numpy(), atol=1e-12, rtol=0)
        for got, want in zip((dq[qs], dk[ks], dv[ks]), torch.autograd.grad(expected, ref, grad[None, qs])):
            np.testing.assert_allclose(got.numpy(), want[0].numpy(), atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("paged", [False, True])
def test_more_queries_than_keys_over_a_kv_cache(paged):
    """flash_attn_with_kvcache without causal, a batch row with fewer keys (cache_seqlens + new)
    than queries and one with more: out and softmax_lse against the reference on each row's
    keys (the window bounded by the cache capacity, as FlashAttention-2); rows whose window holds
    no key have out 0 and lse +inf."""
    batch, sq, heads, d, new = 3, 6, 4, 8, 1
    if paged:
        k_cache, v_cache = rand((6, 4, 2, d), seed=85), rand((6, 4, 2, d), seed=86)
        table = torch.tensor([[5, 1], [0, 2], [3, 4]], dtype=torch.int32)
        extra = {"block_table": table}
    else:
        k_cache, v_cache = rand((batch, 8, 2, d), seed=85), rand((batch, 8, 2, d), seed=86)
        extra = {}
    q = rand((batch, sq, heads, d), seed=87)
    k_new, v_new = rand((batch, new, 2, d), seed=88), rand((batch, new, 2, d), seed=89)
    seqlens = torch.tensor([2, 7, 0], dtype=torch.int32)
    slopes = slopes_of((batch, heads))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, window_size=(2, 3),
                                       alibi_slopes=slopes, return_softmax_lse=True, **extra)
    for b in range(batch):
        total = int(seqlens[b]) + new
        if paged:
            keys = torch.stack([k_cache[int(table[b, t // 4]), t % 4] for t in range(total)])
            values = torch.stack([v_cache[int(table[b, t // 4]), t % 4] for t in range(total)])
        else:
            keys, values = k_cache[b, :total], v_cache[b, :total]
        expected, expected_lse = reference(q[b:b + 1], keys[None], values[None], slopes[b:b + 1], window=(2, 3),
                                           bound=8)
        np.testing.assert_allclose(out[b].numpy(), expected[0].numpy(), atol=1e-12, rtol=0)
        assert_lse(lse[b], expected_lse[0], 2e-6)


def test_more_queries_than_keys_in_bfloat16_reads_the_float32_result():
    """bfloat16 inputs: the float32 call on the widened inputs, rounded (float products)."""
    q, k, v = qkv(1, 8, 3, 2, 2, 16, torch.bfloat16, seed=80)
    slopes = slopes_of((2,))
    out = flash_attn_func(q, k, v, alibi_slopes=slopes, precision="float_products")
    wide = flash_attn_func(q.float(), k.float(), v.float(), alibi_slopes=slopes)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.to(torch.bfloat16))


# Caches with strides. -----------------------------------------------------------------------------


def _spy(monkeypatch, names):
    """Records the arguments of the compiled functions `names` as flash.py calls them."""
    calls = []
    for name in names:
        function = getattr(poslsh._core, name)

        def spy(*args, _function=function, _name=name, **kwargs):
            calls.append((_name, args, kwargs))
            return _function(*args, **kwargs)

        monkeypatch.setattr(poslsh._core, name, spy)
    return calls


@pytest.mark.parametrize("paged", [False, True])
def test_packed_kv_cache_is_read_and_written_in_place(monkeypatch, paged):
    """k_cache = kv_cache[:, :, 0], v_cache = kv_cache[:, :, 1] of one packed cache: the new keys
    land in kv_cache itself, the kernel reads the views (sharing kv_cache's memory, no copy), and
    out and lse equal the reference on the appended keys."""
    batch, heads, heads_k, d, new = 2, 4, 2, 8, 3
    if paged:
        kv_cache = rand((6, 4, 2, heads_k, d), seed=90)
        table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
        extra = {"block_table": table}
    else:
        kv_cache = rand((batch, 12, 2, heads_k, d), seed=90)
        extra = {}
    before = kv_cache.clone()
    pointer = kv_cache.data_ptr()
    k_cache, v_cache = kv_cache[:, :, 0], kv_cache[:, :, 1]
    assert not k_cache.is_contiguous()
    q = rand((batch, 2, heads, d), seed=91)
    k_new, v_new = rand((batch, new, heads_k, d), seed=92), rand((batch, new, heads_k, d), seed=93)
    seqlens = torch.tensor([5, 8], dtype=torch.int32)
    slopes = slopes_of((heads,))
    calls = _spy(monkeypatch, ["multihead_attention_paged", "multihead_attention_paged_with_lse"])
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                       alibi_slopes=slopes, return_softmax_lse=True, **extra)
    assert kv_cache.data_ptr() == pointer
    (_, args, _), = calls
    buffer = kv_cache.numpy()
    assert np.shares_memory(args[1], buffer) and np.shares_memory(args[2], buffer)
    for b in range(batch):
        if paged:
            rows = [(int(table[b, t // 4]), t % 4) for t in range(int(seqlens[b]) + new)]
            keys = torch.stack([kv_cache[p, r, 0] for p, r in rows])
            values = torch.stack([kv_cache[p, r, 1] for p, r in rows])
            old_keys = torch.stack([before[p, r, 0] for p, r in rows[:int(seqlens[b])]])
        else:
            keys, values = kv_cache[b, :int(seqlens[b]) + new, 0], kv_cache[b, :int(seqlens[b]) + new, 1]
            old_keys = before[b, :int(seqlens[b]), 0]
        assert torch.equal(keys[int(seqlens[b]):], k_new[b]) and torch.equal(values[int(seqlens[b]):], v_new[b])
        assert torch.equal(keys[:int(seqlens[b])], old_keys)
        expected, expected_lse = reference(q[b:b + 1], keys[None], values[None], slopes, causal=True)
        np.testing.assert_allclose(out[b].numpy(), expected[0].numpy(), atol=1e-12, rtol=0)
        assert_lse(lse[b], expected_lse[0], 2e-6)
    # Nothing else of the buffer changed.
    changed = (kv_cache != before).any(dim=(-1, -2))
    assert int(changed.sum()) <= batch * new * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_half_precision_cache_equals_its_contiguous_copy(dtype):
    """A half-precision packed kv cache read through its views: out, softmax_lse and the
    appended rows bitwise those of the same cache as two contiguous tensors."""
    kv_cache = rand((2, 8, 2, 2, 16), dtype, seed=97)
    k_copy, v_copy = kv_cache[:, :, 0].contiguous(), kv_cache[:, :, 1].contiguous()
    q = rand((2, 2, 4, 16), dtype, seed=98)
    k_new, v_new = rand((2, 1, 2, 16), dtype, seed=99), rand((2, 1, 2, 16), dtype, seed=100)
    keywords = dict(cache_seqlens=torch.tensor([2, 5], dtype=torch.int32), alibi_slopes=slopes_of((4,)),
                    causal=True, return_softmax_lse=True)
    out, lse = flash_attn_with_kvcache(q, kv_cache[:, :, 0], kv_cache[:, :, 1], k_new, v_new, **keywords)
    want, want_lse = flash_attn_with_kvcache(q, k_copy, v_copy, k_new, v_new, **keywords)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(kv_cache[:, :, 0], k_copy) and torch.equal(kv_cache[:, :, 1], v_copy)


def test_cache_with_a_strided_last_axis_is_rejected():
    cache = rand((2, 6, 2, 8), seed=95)
    for name, k_cache, v_cache in (("k_cache", cache[..., ::2], cache[..., :4]),
                                   ("v_cache", cache[..., :4], cache[..., ::2])):
        with pytest.raises(ValueError, match=name):
            flash_attn_with_kvcache(rand((2, 1, 2, 4), seed=96), k_cache, v_cache, cache_seqlens=3)


# window_size forms. -------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["tuple", "list", "tensor64", "tensor32", "numpy", "numpy ints", "0-d tensors"])
def test_window_size_as_any_pair_of_integers(form):
    q, k, v = qkv(2, 5, 8, 4, 2, 8, seed=100)
    slopes = slopes_of((4,))
    window = (3, 1)
    given = {"tuple": window, "list": list(window), "tensor64": torch.tensor(window),
             "tensor32": torch.tensor(window, dtype=torch.int32), "numpy": np.array(window),
             "numpy ints": (np.int64(3), np.int32(1)), "0-d tensors": (torch.tensor(3), torch.tensor(1))}[form]
    out = flash_attn_func(q, k, v, window_size=given, alibi_slopes=slopes)
    expected, _ = reference(q, k, v, slopes, window=window)
    np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=1e-12, rtol=0)


def test_window_sides_negative_or_beyond_the_keys_are_unbounded():
    """FlashAttention-2's conversions: any negative side, or one >= seqlen_k, is unbounded (so the
    LSH methods, which take no window, accept them)."""
    q, k, v = qkv(1, 4, 6, 2, 2, 8, seed=110)
    full = flash_attn_func(q, k, v)
    for window in ((-5, -1), (-1, -7), (6, 100), (torch.tensor(-3), 6)):
        assert torch.equal(flash_attn_func(q, k, v, window_size=window), full)
    lsh = flash_attn_func(q, k, v, method="lsh", samples=3)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(6, -2), method="lsh", samples=3), lsh)
    causal = flash_attn_func(q, k, v, causal=True, method="lsh", samples=3)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(-1, 0), method="lsh", samples=3), causal)


@pytest.mark.parametrize("window", [(1.0, 2), (1, 2, 3), 3, "12", (True, 1), torch.tensor([1.0, 2.0]),
                                    torch.tensor([[1, 2]]), np.array([1, 2, 3]), None])
def test_window_size_not_a_pair_of_integers_is_a_type_error(window):
    q, k, v = qkv(1, 3, 3, 2, 2, 4, seed=120)
    for call in (lambda: flash_attn_func(q, k, v, window_size=window),
                 lambda: flash_attn_with_kvcache(q, k.clone(), v.clone(), window_size=window)):
        with pytest.raises(TypeError, match="window_size"):
            call()


def test_window_with_a_method_without_one_is_the_librarys_value_error():
    q, k, v = qkv(1, 6, 6, 2, 2, 4, seed=130)
    with pytest.raises(ValueError, match="window"):
        flash_attn_func(q, k, v, window_size=(2, 2), method="lsh")


# The packed forms. --------------------------------------------------------------------------------

# FlashAttention-2's signatures (flash_attn/flash_attn_interface.py), in order.
FA2_SIGNATURES = {
    "flash_attn_qkvpacked_func": ["qkv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                  "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_kvpacked_func": ["q", "kv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                 "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", "dropout_p", "softmax_scale", "causal",
                                         "window_size", "softcap", "alibi_slopes", "deterministic",
                                         "return_attn_probs"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                        "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                        "alibi_slopes", "deterministic", "return_attn_probs"],
}


@pytest.mark.parametrize("name", sorted(FA2_SIGNATURES))
def test_packed_signatures_are_flash_attention_2s(name):
    parameters = inspect.signature(getattr(ptorch, name)).parameters.values()
    positional = [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FA2_SIGNATURES[name]
    assert name in ptorch.__all__
    defaults = {p.name: p.default for p in parameters}
    assert defaults["window_size"] == (-1, -1) and defaults["dropout_p"] == 0.0 and defaults["causal"] is False


def _pointers(calls, buffer):
    """Whether each recorded kernel call's q, k, v arguments share memory with `buffer`."""
    return [[np.shares_memory(a, buffer) for a in args[:3]] for _, args, _ in calls]


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_reads_the_packed_tensor_and_its_gradients_reach_it(monkeypatch, causal):
    batch, seqlen, heads, d = 2, 6, 4, 8
    qkv_tensor = rand((batch, seqlen, 3, heads, d), seed=140)
    slopes = slopes_of((heads,))
    calls = _spy(monkeypatch, ["multihead_attention_with_lse", "multihead_attention_backward"])
    packed = qkv_tensor.clone().requires_grad_()
    out, lse, _ = ptorch.flash_attn_qkvpacked_func(packed, causal=causal, alibi_slopes=slopes,
                                                   return_attn_probs=True)
    grad = rand(out.shape, seed=141)
    out.backward(grad)
    assert all(all(shared) for shared in _pointers(calls, packed.detach().numpy())) and len(calls) == 2
    ref = qkv_tensor.clone().requires_grad_()
    expected, expected_lse = reference(ref[:, :, 0], ref[:, :, 1], ref[:, :, 2], slopes, causal)
    expected.backward(grad)
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), atol=1e-12, rtol=0)
    assert_lse(lse, expected_lse.detach(), 2e-6)
    np.testing.assert_allclose(packed.grad.numpy(), ref.grad.numpy(), atol=1e-11, rtol=1e-11)


def test_kvpacked_and_its_gradients(monkeypatch):
    batch, sq, sk, heads, heads_k, d = 2, 4, 7, 4, 2, 8
    q = rand((batch, sq, heads, d), seed=150)
    kv_tensor = rand((batch, sk, 2, heads_k, d), seed=151)
    slopes = slopes_of((batch, heads)).double()
    calls = _spy(monkeypatch, ["multihead_attention_with_lse"])
    inputs = [q.clone().requires_grad_(), kv_tensor.clone().requires_grad_(), slopes.clone().requires_grad_()]
    out = ptorch.flash_attn_kvpacked_func(inputs[0], inputs[1], window_size=(2, 1), alibi_slopes=inputs[2])
    buffer = inputs[1].detach().numpy()
    assert [shared[1:] for shared in _pointers(calls, buffer)] == [[True, True]]
    ref = [x.detach().clone().requires_grad_() for x in (q, kv_tensor, slopes)]
    expected, _ = reference(ref[0], ref[1][:, :, 0], ref[1][:, :, 1], ref[2], window=(2, 1))
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), atol=1e-12, rtol=0)
    grad = rand(out.shape, seed=152)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, ref, grad)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-11, rtol=1e-11)


def test_varlen_packed_forms_and_their_gradients(monkeypatch):
    heads, heads_k, d = 4, 2, 8
    lengths = [5, 3, 6]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = sum(lengths)
    qkv_tensor = rand((total, 3, heads, d), seed=160)
    slopes = slopes_of((heads,))
    calls = _spy(monkeypatch, ["multihead_attention_with_lse", "multihead_attention_backward"])
    packed = qkv_tensor.clone().requires_grad_()
    out, lse, _ = ptorch.flash_attn_varlen_qkvpacked_func(packed, cu, max(lengths), causal=True, alibi_slopes=slopes,
                                                          return_attn_probs=True)
    grad = rand(out.shape, seed=161)
    out.backward(grad)
    assert len(calls) == 2 and all(all(shared) for shared in _pointers(calls, packed.detach().numpy()))
    ref = qkv_tensor.clone().requires_grad_()
    for b in range(3):
        s = slice(int(cu[b]), int(cu[b + 1]))
        expected, expected_lse = reference(ref[None, s, 0], ref[None, s, 1], ref[None, s, 2], slopes, causal=True)
        np.testing.assert_allclose(out[s].detach().numpy(), expected[0].detach().numpy(), atol=1e-12, rtol=0)
        assert_lse(lse[:, s], expected_lse[0].detach(), 2e-6)
        expected.backward(grad[None, s])
    np.testing.assert_allclose(packed.grad.numpy(), ref.grad.numpy(), atol=1e-11, rtol=1e-11)

    lengths_k = [7, 2, 6]
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    q = rand((total, heads, d), seed=162)
    kv_tensor = rand((sum(lengths_k), 2, heads_k, d), seed=163)
    inputs = [q.clone().requires_grad_(), kv_tensor.clone().requires_grad_()]
    out = ptorch.flash_attn_varlen_kvpacked_func(inputs[0], inputs[1], cu, cu_k, max(lengths), max(lengths_k),
                                                 alibi_slopes=slopes)
    grad = rand(out.shape, seed=164)
    dq, dkv = torch.autograd.grad(out, inputs, grad)
    ref = [x.clone().requires_grad_() for x in (q, kv_tensor)]
    for b in range(3):
        qs, ks = slice(int(cu[b]), int(cu[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        expected, _ = reference(ref[0][None, qs], ref[1][None, ks, 0], ref[1][None, ks, 1], slopes)
        np.testing.assert_allclose(out[qs].detach().numpy(), expected[0].detach().numpy(), atol=1e-12, rtol=0)
        expected.backward(grad[None, qs])
    np.testing.assert_allclose(dq.numpy(), ref[0].grad.numpy(), atol=1e-11, rtol=1e-11)
    np.testing.assert_allclose(dkv.numpy(), ref[1].grad.numpy(), atol=1e-11, rtol=1e-11)


def test_packed_forms_name_their_bad_arguments():
    qkv_tensor = rand((2, 4, 3, 2, 4), seed=170)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    cases = [
        (lambda: ptorch.flash_attn_qkvpacked_func(qkv_tensor[:, :, :2]), ValueError, "flash_attn_qkvpacked_func.*qkv"),
        (lambda: ptorch.flash_attn_qkvpacked_func(qkv_tensor[0]), ValueError, "'qkv'"),
        (lambda: ptorch.flash_attn_qkvpacked_func(qkv_tensor.numpy()), TypeError, "'qkv'"),
        (lambda: ptorch.flash_attn_kvpacked_func(qkv_tensor[:, :, 0], qkv_tensor), ValueError,
         "flash_attn_kvpacked_func.*'kv'"),
        (lambda: ptorch.flash_attn_varlen_qkvpacked_func(qkv_tensor[0], cu, 4, window_size=(1,)), TypeError,
         "window_size"),
        (lambda: ptorch.flash_attn_varlen_qkvpacked_func(qkv_tensor[0, :, :2], cu, 4), ValueError, "'qkv'"),
        (lambda: ptorch.flash_attn_varlen_kvpacked_func(qkv_tensor[0, :, 0], qkv_tensor[0, :, :1], cu, cu, 4, 4),
         ValueError, "'kv'"),
        (lambda: ptorch.flash_attn_qkvpacked_func(qkv_tensor, dropout_p=0.1), ValueError, "dropout_p"),
    ]
    for call, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            call()
