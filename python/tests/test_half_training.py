"""Training on bfloat16 and float16 inputs without float32 copies: the forwards with lse and the
backward passes of the compiled module on half-precision q, k, v, out and dout (lse and the
gradients float32), and poslsh.torch / poslsh.flash autograd on half-precision tensors.

Rules checked:
  - precision="float_products": out and lse bitwise the float32 forward with lse on the widened
    inputs (out rounded once), the gradients bitwise the float32 backward on the widened inputs
    and that rounded out (the torch gradients: those, cast once to the inputs' dtype);
  - precision="matrix_units" on a CPU with a unit: out bitwise the kernel without lse, and the
    gradients within FlashAttention's accuracy rule, at most 2x the error of a plain bfloat16
    backward (numpy below) against float64 torch autograd on the same rounded inputs.
"""

import numpy as np
import pytest

import poslsh
from conftest import masking_of
from test_matrix_units import (FLOAT_PRODUCTS, alibi_additive, bf16, bf16_bits, bf16_values, lsh_additive,
                               lsh_counts, max_error, needs_unit, wrap)

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import poslsh.torch as ptorch  # noqa: E402

BF16 = torch.bfloat16


def half_inputs(shapes, seed, dtype):
    """Random arrays rounded to `dtype` ("bfloat16": bit patterns, "float16"), and their exact
    float32 values."""
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(s) for s in shapes]
    if dtype == "bfloat16":
        stored = [bf16_bits(x) for x in values]
        return stored, [bf16_values(x) for x in stored]
    stored = [x.astype(np.float16) for x in values]
    return stored, [x.astype(np.float32) for x in stored]


def as_argument(x):
    """A stored half-precision array as the kernels take it."""
    return wrap(x) if x.dtype == np.uint16 else x


def widened_values(x):
    """The exact float32 values of a kernel's half-precision result."""
    return bf16_values(x.bits) if isinstance(x, poslsh.BFloat16Bits) else np.asarray(x, dtype=np.float32)


def single_head_calls(n, causal):
    """(name, with_lse(q, k, v, **kw), backward(q, k, v, out, lse, dout, **kw)) of every
    single-head kernel."""
    sigma, band = 6.0, 20
    hashes = poslsh.rbf_hashes(sigma, 4, seed=3)
    return [
        ("tiled", lambda *a, **kw: poslsh.alibi_attention_tiled_with_lse(*a, sigma, masking=masking_of(causal), **kw),
         lambda q, k, v, *rest, **kw: poslsh.alibi_attention_tiled_backward(q, k, v, sigma, *rest, masking=masking_of(causal),
                                                                            **kw)),
        ("banded", lambda *a, **kw: poslsh.alibi_attention_banded_with_lse(*a, sigma, band, masking=masking_of(causal), **kw),
         lambda q, k, v, *rest, **kw: poslsh.alibi_attention_banded_backward(q, k, v, sigma, band, *rest,
                                                                             masking=masking_of(causal), **kw)),
        ("fused", lambda *a, **kw: poslsh.lsh_attention_fused_with_lse(*a, hashes, masking=masking_of(causal), **kw),
         lambda q, k, v, *rest, **kw: poslsh.lsh_attention_fused_backward(q, k, v, hashes, *rest, masking=masking_of(causal),
                                                                          **kw)),
        ("per_sample", lambda *a, **kw: poslsh.lsh_attention_per_sample_with_lse(*a, hashes, masking=masking_of(causal), **kw),
         lambda q, k, v, *rest, **kw: poslsh.lsh_attention_per_sample_backward(q, k, v, hashes, *rest,
                                                                               masking=masking_of(causal), **kw)),
        ("fixed_blocks", lambda *a, **kw: poslsh.fixed_blocks_attention_with_lse(*a, sigma, masking=masking_of(causal), **kw),
         lambda q, k, v, *rest, **kw: poslsh.fixed_blocks_attention_backward(q, k, v, sigma, *rest, masking=masking_of(causal),
                                                                             **kw)),
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [True, False])
def test_single_head_float_products_are_the_float32_calls(dtype, causal):
    n, d, d_v = 100, 24, 16
    (q, k, v, dout), (qf, kf, vf, doutf) = half_inputs(((n, d), (n, d), (n, d_v), (n, d_v)), 7, dtype)
    for name, with_lse, backward in single_head_calls(n, causal):
        out, lse = with_lse(*map(as_argument, (q, k, v)), precision=FLOAT_PRODUCTS)
        out_float, lse_float = with_lse(qf, kf, vf)
        assert lse.dtype == np.float32
        np.testing.assert_array_equal(lse, lse_float, err_msg=name)
        rounded = widened_values(out)
        expected = bf16(out_float) if dtype == "bfloat16" else out_float.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(rounded, expected, err_msg=name)
        grads = backward(*map(as_argument, (q, k, v)), out, lse, as_argument(dout), precision=FLOAT_PRODUCTS)
        wide = backward(qf, kf, vf, rounded, lse, doutf)
        for got, want in zip(grads, wide):
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want, err_msg=name)


@needs_unit
@pytest.mark.parametrize("causal", [True, False])
def test_single_head_on_the_unit_out_is_the_kernel_without_lse(causal):
    n, d = 100, 32
    (q, k, v), _ = half_inputs(((n, d),) * 3, 8, "bfloat16")
    kernels = {"tiled": lambda *a, **kw: poslsh.alibi_attention_tiled(*a, 6.0, masking=masking_of(causal), **kw),
               "banded": lambda *a, **kw: poslsh.alibi_attention_banded(*a, 6.0, 20, masking=masking_of(causal), **kw),
               "fused": lambda *a, **kw: poslsh.lsh_attention_fused(*a, poslsh.rbf_hashes(6.0, 4, seed=3),
                                                                      masking=masking_of(causal), **kw)}
    for name, with_lse, _ in single_head_calls(n, causal):
        out, lse = with_lse(*map(wrap, (q, k, v)))
        assert np.isfinite(lse).all()
        if name in kernels:
            np.testing.assert_array_equal(out.bits, kernels[name](*map(wrap, (q, k, v))).bits, err_msg=name)
        wide_out, wide_lse = with_lse(*map(wrap, (q, k, v)), precision=FLOAT_PRODUCTS)
        assert not np.array_equal(out.bits, wide_out.bits)
        np.testing.assert_allclose(lse, wide_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("method", ["exact_tiled", "exact_banded", "lsh_fused", "lsh_per_sample", "fixed_blocks"])
def test_multihead_float_products_are_the_float32_calls(dtype, method):
    """Grouped-query heads (4 over 2), one sequence and a packed batch."""
    n, heads, heads_k, d = 100, 4, 2, 16
    shapes = ((n, heads, d), (n, heads_k, d), (n, heads_k, d), (n, heads, d))
    (q, k, v, dout), (qf, kf, vf, doutf) = half_inputs(shapes, 9, dtype)
    keywords = dict(method=method, samples=3, seed=4, band_error=1e-2)
    for cu in (None, np.array([0, 37, n], dtype=np.int32)):
        out, lse = poslsh.multihead_attention_with_lse(*map(as_argument, (q, k, v)), cu_seqlens=cu,
                                                       precision=FLOAT_PRODUCTS, **keywords)
        out_float, lse_float = poslsh.multihead_attention_with_lse(qf, kf, vf, cu_seqlens=cu, **keywords)
        np.testing.assert_array_equal(lse, lse_float)
        rounded = widened_values(out)
        if dtype == "bfloat16":
            np.testing.assert_array_equal(rounded, bf16(out_float))
        else:
            np.testing.assert_array_equal(out, out_float.astype(np.float16))
        grads = poslsh.multihead_attention_backward(*map(as_argument, (q, k, v)), out, lse, as_argument(dout),
                                                    cu_seqlens=cu, precision=FLOAT_PRODUCTS, **keywords)
        wide = poslsh.multihead_attention_backward(qf, kf, vf, rounded, lse, doutf, cu_seqlens=cu, **keywords)
        for got, want in zip(grads, wide):
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want)


@needs_unit
def test_multihead_on_the_unit_out_is_the_forward_without_lse():
    n, heads, heads_k, d = 100, 4, 2, 32
    (q, k, v), _ = half_inputs(((n, heads, d), (n, heads_k, d), (n, heads_k, d)), 10, "bfloat16")
    for method in ("exact_tiled", "lsh_fused", "lsh_per_sample"):
        out, lse = poslsh.multihead_attention_with_lse(*map(wrap, (q, k, v)), method=method, samples=3)
        plain = poslsh.multihead_attention(*map(wrap, (q, k, v)), method=method, samples=3)
        np.testing.assert_array_equal(out.bits, plain.bits)
        assert np.isfinite(lse).all()


def test_half_training_bindings_name_a_bad_argument():
    n, d = 20, 8
    (q, k, v), (qf, _, _) = half_inputs(((n, d),) * 3, 11, "bfloat16")
    with pytest.raises(ValueError, match="precision"):
        poslsh.alibi_attention_tiled_with_lse(*map(wrap, (q, k, v)), 4.0, precision="fast")
    with pytest.raises(TypeError, match="'k'"):
        poslsh.alibi_attention_tiled_with_lse(wrap(q), qf, wrap(v), 4.0)
    with pytest.raises(TypeError, match="'lse'"):
        poslsh.alibi_attention_tiled_with_lse(*map(wrap, (q, k, v)), 4.0, lse=np.zeros(n, np.float64))
    out, lse = poslsh.alibi_attention_tiled_with_lse(*map(wrap, (q, k, v)), 4.0)
    with pytest.raises(TypeError, match="'dq'"):
        poslsh.alibi_attention_tiled_backward(*map(wrap, (q, k, v)), 4.0, out, lse, out, dq=np.zeros((n, d)))
    with pytest.raises(TypeError, match="'out'"):
        poslsh.alibi_attention_tiled_backward(*map(wrap, (q, k, v)), 4.0, qf, lse, out)
    with pytest.raises(ValueError, match="'lse'"):
        poslsh.multihead_attention_backward(*(wrap(x.reshape(n, 2, d // 2)) for x in (q, k, v)),
                                            wrap(q.reshape(n, 2, d // 2)), np.zeros((3, n), np.float32),
                                            wrap(q.reshape(n, 2, d // 2)))


# poslsh.torch and poslsh.flash on half-precision tensors. -----------------------------------


def plain_bf16_gradients(q, k, v, dout, tau, additive, weights=None):
    """The gradients (dq, dk, dv) as a plain bfloat16 attention backward computes them, dense:
    q, k, v, dout hold bfloat16 values; the forward of plain_bf16_attention (its out rounded to
    bfloat16, its lse in float32); S = Q K^T and dP = dO V^T with float32 sums, P from the lse,
    D = rowsum(dO o out), dS = tau P o (dP - D) (the softmax scale folded in, as FlashAttention's
    Triton backward does), P and dS rounded to bfloat16 before dV = P^T dO, dq = dS K and
    dk = dS^T Q (float32 sums). additive and weights as in
    plain_bf16_attention."""
    f32 = np.float32
    scores = q @ k.T
    if weights is None:
        logits = f32(tau) * scores + additive.astype(f32)
        log_weights = np.zeros_like(logits)
    else:
        logits = np.where(weights > 0, f32(tau) * scores, -np.inf).astype(f32)
        with np.errstate(divide="ignore"):
            log_weights = np.log(weights).astype(f32)
    top = logits.max(axis=1, keepdims=True)
    weight = np.exp(log_weights) if weights is not None else 1.0
    total = (weight * np.exp(logits - top)).sum(axis=1, keepdims=True, dtype=f32)
    lse = top + np.log(total)
    p = (weight * np.exp(logits - lse)).astype(f32)
    out = bf16((bf16(p) @ v))
    dp = dout @ v.T
    delta = (dout * out).sum(axis=1, keepdims=True, dtype=f32)
    ds = f32(tau) * p * (dp - delta)
    return bf16(ds) @ k, bf16(ds).T @ q, bf16(p).T @ dout


def float64_gradients(q, k, v, dout, tau, additive):
    """Torch autograd of softmax(tau Q K^T + additive) V in float64."""
    leaves = [torch.from_numpy(np.asarray(x, dtype=np.float64)).requires_grad_(True) for x in (q, k, v)]
    logits = tau * leaves[0] @ leaves[1].T + torch.from_numpy(additive)
    out = torch.softmax(logits, dim=1) @ leaves[2]
    return [g.numpy() for g in torch.autograd.grad(out, leaves, torch.from_numpy(dout.astype(np.float64)))]


def values_of(tensor):
    return tensor.detach().float().numpy()


def check_gradient_rule(got, q, k, v, dout, tau, additive, weights=None):
    """got (bfloat16 gradient tensors): each within twice the plain bfloat16 backward's error
    against float64 autograd (after the cast to bfloat16 of both)."""
    values = [values_of(x) for x in (q, k, v, dout)]
    exact = float64_gradients(*values, tau, additive)
    plain = plain_bf16_gradients(*values, tau, additive, weights)
    for name, g, p, e in zip("qkv", got, plain, exact):
        assert g.dtype == BF16
        unit_error, plain_error = max_error(values_of(g), e), max_error(bf16(p), e)
        assert unit_error <= 2 * plain_error, (name, unit_error, plain_error)


def bf16_tensor(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(BF16)


@needs_unit
@pytest.mark.parametrize("function", ["alibi", "lsh"])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_bf16_gradients_on_the_unit(function, causal):
    n, d, sigma = 100, 32, 8.0
    q, k, v, dout = (bf16_tensor((n, d), seed) for seed in (61, 62, 63, 64))
    tau = 1 / np.sqrt(d)
    hashes = poslsh.rbf_hashes(sigma, 4, seed=2)
    if function == "alibi":
        call = lambda a, b, c, **kw: ptorch.alibi_attention(a, b, c, sigma, masking=masking_of(causal), **kw)  # noqa: E731
        additive, weights = alibi_additive(n, n, sigma, causal), None
    else:
        call = lambda a, b, c, **kw: ptorch.lsh_attention(a, b, c, hashes, masking=masking_of(causal), **kw)  # noqa: E731
        additive, weights = lsh_additive(hashes, n, causal), lsh_counts(hashes, n, causal)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = call(*leaves)
    assert out.dtype == BF16
    with torch.no_grad():
        assert torch.equal(out, call(q, k, v))
    grads = torch.autograd.grad(out, leaves, dout)
    check_gradient_rule(grads, q, k, v, dout, tau, additive, weights)


def float32_gradients(function, q, k, v, out, dout, sigma, hashes, keywords, cu=None, argument=None):
    """What poslsh.torch's differentiable `function` ("alibi", "lsh", "multihead" with
    `keywords`, "packed": multihead with cu_seqlens=cu) returns under
    precision="float_products" on half-precision tensors, from the compiled float32 calls:
    the output of the forward with lse on the widened inputs, and the gradients of the float32
    backward on the widened inputs and the output as the half-precision call returned it
    (`out`), before the cast to the inputs' dtype. `argument` (default: the widened float32
    values) turns a tensor into the compiled calls' argument: bfloat16 tensors as they are
    (kernel_argument) give the compiled bfloat16 calls under the default precision."""
    qf, kf, vf, doutf, outf = (values_of(x) if argument is None else argument(x.detach()) for x in
                                (q, k, v, dout, out))
    if function == "alibi":
        outw, lse = poslsh.alibi_attention_tiled_with_lse(qf, kf, vf, sigma)
        return outw, poslsh.alibi_attention_tiled_backward(qf, kf, vf, sigma, outf, lse, doutf)
    if function == "lsh":
        outw, lse = poslsh.lsh_attention_fused_with_lse(qf, kf, vf, hashes)
        return outw, poslsh.lsh_attention_fused_backward(qf, kf, vf, hashes, outf, lse, doutf)
    packed = dict(cu_seqlens=np.asarray(cu, dtype=np.int32)) if function == "packed" else {}
    outw, lse = poslsh.multihead_attention_with_lse(qf, kf, vf, **keywords, **packed)
    return outw, poslsh.multihead_attention_backward(qf, kf, vf, outf, lse, doutf, **keywords, **packed)


@pytest.mark.parametrize("function", ["alibi", "lsh", "multihead", "packed"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_torch_half_gradients_under_float_products(function, dtype):
    """The gradients are the float32 backward's on the widened inputs and the rounded out (the
    compiled float32 call), cast once; out is the widened float32 forward's, rounded once."""
    n, d = 90, 16
    shape = (n, d) if function in ("alibi", "lsh") else (n, 2, d)
    generator = torch.Generator().manual_seed(70)
    q, k, v, dout = (torch.randn(shape, generator=generator).to(dtype) for _ in range(4))
    hashes = poslsh.rbf_hashes(6.0, 4, seed=3)
    cu = np.array([0, 35, n], dtype=np.int32)
    fp = dict(precision=FLOAT_PRODUCTS)
    keywords = dict(method="exact_tiled") if function == "packed" else dict(samples=4, seed=2)
    calls = {
        "alibi": lambda a, b, c: ptorch.alibi_attention(a, b, c, 6.0, **fp),
        "lsh": lambda a, b, c: ptorch.lsh_attention(a, b, c, hashes, **fp),
        "multihead": lambda a, b, c: ptorch.multihead_attention(a, b, c, **keywords, **fp),
        "packed": lambda a, b, c: ptorch.multihead_attention(a, b, c, cu_seqlens=cu, **keywords, **fp),
    }
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = calls[function](*leaves)
    grads = torch.autograd.grad(out, leaves, dout)
    outw, want = float32_gradients(function, q, k, v, out, dout, 6.0, hashes, keywords, cu)
    assert out.dtype == dtype and torch.equal(out.detach(), torch.from_numpy(outw).to(dtype))
    for got, expected in zip(grads, want):
        assert got.dtype == dtype and torch.equal(got, torch.from_numpy(expected).to(dtype))


@needs_unit
@pytest.mark.parametrize("causal", [True, False])
def test_multihead_and_flash_bf16_gradients_on_the_unit(causal):
    """Grouped-query heads (4 over 2): poslsh.torch.multihead_attention and
    poslsh.flash.flash_attn_func, each head within the accuracy rule."""
    n, heads, heads_k, d = 100, 4, 2, 32
    q, dout = bf16_tensor((n, heads, d), 81), bf16_tensor((n, heads, d), 84)
    k, v = bf16_tensor((n, heads_k, d), 82), bf16_tensor((n, heads_k, d), 83)
    sigmas = [2.0, 8.0, 32.0, 128.0]
    tau = 1 / np.sqrt(d)
    masking = "causal" if causal else "bidirectional"
    slopes = torch.tensor([1 / s for s in sigmas], dtype=torch.float32)
    calls = [
        lambda a, b, c: ptorch.multihead_attention(a, b, c, method="exact_tiled", masking=masking, sigmas=sigmas),
        lambda a, b, c: ptorch.flash_attn_func(a[None], b[None], c[None], causal=causal, alibi_slopes=slopes)[0],
    ]
    for call in calls:
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = call(*leaves)
        assert out.dtype == BF16
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        for h in range(heads):
            g = h // 2
            additive = alibi_additive(n, n, sigmas[h], causal)
            values = [values_of(x) for x in (q[:, h], k[:, g], v[:, g], dout[:, h])]
            exact = float64_gradients(*values, tau, additive)
            plain = plain_bf16_gradients(*values, tau, additive)
            assert max_error(values_of(dq[:, h]), exact[0]) <= 2 * max_error(bf16(plain[0]), exact[0]), h
        # dk, dv of a K/V head: the sum over its query heads, against the float64 sums.
        for g in range(heads_k):
            exact_k = exact_v = plain_k = plain_v = 0
            for h in (2 * g, 2 * g + 1):
                additive = alibi_additive(n, n, sigmas[h], causal)
                values = [values_of(x) for x in (q[:, h], k[:, g], v[:, g], dout[:, h])]
                exact = float64_gradients(*values, tau, additive)
                plain = plain_bf16_gradients(*values, tau, additive)
                exact_k, exact_v = exact_k + exact[1], exact_v + exact[2]
                plain_k, plain_v = plain_k + plain[1], plain_v + plain[2]
            assert max_error(values_of(dk[:, g]), exact_k) <= 2 * max_error(bf16(plain_k), exact_k), g
            assert max_error(values_of(dv[:, g]), exact_v) <= 2 * max_error(bf16(plain_v), exact_v), g
