"""poslsh.torch forward-only kernels on bfloat16 and float16 CPU tensors, without copies, against
dense float64 formulas on the rounded inputs (rounded by torch). The bitwise rules (the float32
call on the widened tensors, rounded once) are those of precision="float_products";
test_matrix_units.py checks bfloat16 under the default, "matrix_units"."""

import numpy as np
import pytest

import poslsh
from conftest import masking_of
import reference
from test_multihead import expected_heads

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import poslsh.torch as ptorch  # noqa: E402
from test_half_training import float32_gradients  # noqa: E402

HALF = [torch.bfloat16, torch.float16]


def rounded(shape, dtype, seed):
    """Uniform [-1, 1) values rounded to `dtype` by torch."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator, dtype=torch.float64).mul_(2).sub_(1).to(dtype)


def as64(tensor):
    return tensor.to(torch.float64).numpy()


def max_error(out, expected):
    return float(np.abs(out.to(torch.float64).numpy() - expected).max())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("function", ["alibi", "lsh"])
@pytest.mark.parametrize("causal", [True, False])
def test_single_head_forward(dtype, function, causal):
    n, d, sigma = 160, 32, 7.0
    q, k, v = (rounded((n, d), dtype, seed) for seed in (1, 2, 3))
    hashes = poslsh.rbf_hashes(sigma, 10, seed=2)
    if function == "alibi":
        kernel = lambda *args, **kw: ptorch.alibi_attention_forward(*args, sigma, masking=masking_of(causal),  # noqa: E731
                                                                    precision="float_products", **kw)
        expected = reference.alibi_attention(as64(q), as64(k), as64(v), sigma, causal)
    else:
        kernel = lambda *args, **kw: ptorch.lsh_attention_forward(*args, hashes, masking=masking_of(causal),  # noqa: E731
                                                                  precision="float_products", **kw)
        expected = reference.lsh_attention(as64(q), as64(k), as64(v), hashes.widths, hashes.offsets, causal)
    q32, k32, v32 = (x.float() for x in (q, k, v))
    out32 = kernel(q32, k32, v32)
    assert out32.dtype == torch.float32
    float_error = max_error(out32, expected)
    assert float_error < 1e-4
    wide = kernel(q, k, v, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and max_error(wide, expected) <= 2 * float_error
    assert torch.equal(wide, out32)
    out = kernel(q, k, v)
    assert out.dtype == dtype and out.shape == (n, d)
    assert torch.equal(out, out32.to(dtype))  # the float32 result rounded once
    mixed = kernel(q32, k, v)  # float32 queries over a half-precision KV cache
    assert mixed.dtype == torch.float32 and max_error(mixed, expected) <= 2 * float_error
    assert torch.equal(mixed, out32)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("method", ["lsh_fused", "exact_tiled", "exact_banded", "lsh_per_sample"])
def test_multihead_forward(dtype, layout, method):
    n, heads, kv_heads, d = 80, 4, 2, 16
    q_shape, kv_shape = ((n, heads, d), (n, kv_heads, d)) if layout == "nhd" else ((heads, n, d), (kv_heads, n, d))
    q = rounded(q_shape, dtype, 4)
    k, v = rounded(kv_shape, dtype, 5), rounded(kv_shape, dtype, 6)
    keywords = dict(layout=layout, method=method, samples=6, seed=1, band_error=1e-2, precision="float_products")
    nhd = (lambda x: x) if layout == "nhd" else (lambda x: x.transpose(1, 0, 2))
    expected = expected_heads(nhd(as64(q)), nhd(as64(k)), nhd(as64(v)), method, True,
                              1 / reference.alibi_slopes(heads), samples=6, seed=1, band_error=1e-2)
    out32 = ptorch.multihead_attention_forward(q.float(), k.float(), v.float(), **keywords)
    float_error = float(np.abs(nhd(out32.double().numpy()) - expected).max())
    wide = ptorch.multihead_attention_forward(q, k, v, out_dtype=torch.float32, **keywords)
    assert float(np.abs(nhd(wide.double().numpy()) - expected).max()) <= 2 * float_error
    assert torch.equal(wide, out32)
    out = ptorch.multihead_attention_forward(q, k, v, **keywords)
    assert out.dtype == dtype and out.shape == q_shape
    assert torch.equal(out, out32.to(dtype))
    assert torch.equal(ptorch.multihead_attention_forward(q.float(), k, v, **keywords), out32)


@pytest.mark.parametrize("dtype", HALF)
def test_strided_views_are_read_and_written_in_place(dtype):
    """Heads of a packed [n, 3, H, d] tensor go in as views (the int16 view of a bfloat16 tensor
    shares its memory), and out= a view of a larger tensor is written through."""
    n, heads, d, sigma = 100, 3, 8, 5.0
    qkv = rounded((n, 3, heads, d), dtype, 7)
    q, k, v = qkv[:, 0, 1], qkv[:, 1, 1], qkv[:, 2, 1]
    assert q.stride() == (3 * heads * d, 1)
    if dtype == torch.bfloat16:
        assert np.shares_memory(q.view(torch.int16).numpy(), qkv.view(torch.int16).numpy())
    parent = torch.full((n, heads, d), float("nan"), dtype=dtype)
    returned = ptorch.alibi_attention_forward(q, k, v, sigma, out=parent[:, 2])
    assert returned.data_ptr() == parent[:, 2].data_ptr()
    expected = ptorch.alibi_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), sigma)
    assert torch.equal(parent[:, 2], expected)
    assert torch.isnan(parent[:, :2]).all()
    packed = torch.full((n, 2, heads, d), float("nan"), dtype=torch.float32)
    ptorch.multihead_attention_forward(qkv[:, 0], qkv[:, 1], qkv[:, 2], method="exact_tiled",
                                       out=packed[:, 0], out_dtype=torch.float32)
    contiguous = [qkv[:, i].contiguous() for i in range(3)]
    assert torch.equal(packed[:, 0], ptorch.multihead_attention_forward(*contiguous, method="exact_tiled",
                                                                        out_dtype=torch.float32))
    assert torch.isnan(packed[:, 1]).all()


def test_errors():
    n, d = 20, 4
    q, k, v = (rounded((n, d), torch.bfloat16, s) for s in (1, 2, 3))
    with pytest.raises(TypeError, match="argument 'k' has dtype float64: must be bfloat16"):
        ptorch.alibi_attention_forward(q, k.double(), v, 4.0)
    with pytest.raises(TypeError, match="argument 'k' .*float16: must be bfloat16"):
        ptorch.alibi_attention_forward(q, k.half(), v, 4.0)
    with pytest.raises(TypeError, match="argument 'out' has dtype float16: must be bfloat16"):
        ptorch.alibi_attention_forward(q, k, v, 4.0, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="argument 'q' has dtype torch.int16"):
        ptorch.lsh_attention_forward(q.view(torch.int16), k, v, poslsh.rbf_hashes(4.0, 2, seed=0))
    with pytest.raises(ValueError, match="its last axis must be contiguous"):
        ptorch.alibi_attention_forward(q, k, v.t().contiguous().t(), 4.0)
    with pytest.raises(ValueError, match="argument 'q' has 3 dimensions: must be a 2-D array"):
        ptorch.alibi_attention_forward(q[None], k, v, 4.0)
    with pytest.raises(RuntimeError, match="forward-only"):
        ptorch.alibi_attention_forward(q.float().requires_grad_(), k, v, 4.0)
    with torch.no_grad():
        out = ptorch.alibi_attention_forward(q.float().requires_grad_(), k, v, 4.0)
    assert not out.requires_grad
    # The autograd Functions widen half precision only when q, k, v share one dtype.
    with pytest.raises(TypeError, match="argument 'k' has dtype torch.float32: must be torch.bfloat16 like 'q'"):
        ptorch.alibi_attention(q, k.float(), v, 4.0)
    with pytest.raises(TypeError, match="argument 'v' has dtype torch.float16: must be torch.bfloat16 like 'q'"):
        ptorch.multihead_attention(q[:, None], k[:, None], v[:, None].half())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("function", ["alibi", "lsh", "multihead", "packed"])
def test_half_precision_autograd_is_the_widened_float32_call_rounded(dtype, function):
    """bfloat16 and float16 tensors through the differentiable functions with
    precision="float_products": the output is bitwise that of the float32 call on the widened
    tensors, rounded once, and the forward-only half-precision kernel's; the gradients are
    bitwise the float32 backward's on the widened tensors and that rounded output, cast once."""
    n, d = 40, 8
    shape = (n, d) if function in ("alibi", "lsh") else (n, 2, d)
    q, k, v, dout = (rounded(shape, dtype, seed) for seed in (11, 12, 13, 14))
    hashes = poslsh.rbf_hashes(5.0, 6, seed=3)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    fp = dict(precision="float_products")
    calls = {
        "alibi": (lambda a, b, c: ptorch.alibi_attention(a, b, c, 5.0, **fp),
                  lambda a, b, c: ptorch.alibi_attention_forward(a, b, c, 5.0, **fp)),
        "lsh": (lambda a, b, c: ptorch.lsh_attention(a, b, c, hashes, **fp),
                lambda a, b, c: ptorch.lsh_attention_forward(a, b, c, hashes, **fp)),
        "multihead": (lambda a, b, c: ptorch.multihead_attention(a, b, c, samples=6, seed=2, **fp),
                      lambda a, b, c: ptorch.multihead_attention_forward(a, b, c, samples=6, seed=2, **fp)),
        "packed": (lambda a, b, c: ptorch.multihead_attention(a, b, c, method="exact_tiled", cu_seqlens=cu, **fp),
                   None),
    }
    differentiable, forward_only = calls[function]
    half = [x.clone().requires_grad_(True) for x in (q, k, v)]
    widened = [x.float().requires_grad_(True) for x in (q, k, v)]
    out = differentiable(*half)
    out_float = differentiable(*widened)
    assert out.dtype == dtype
    assert torch.equal(out, out_float.to(dtype))
    if forward_only is not None:
        with torch.no_grad():
            assert torch.equal(out, forward_only(q, k, v))
    out.backward(dout)
    # The gradients: the float32 backward's on the widened inputs and the rounded out, cast once.
    _, want = float32_gradients(function, q, k, v, out, dout, 5.0, hashes, dict(samples=6, seed=2) if function ==
                                "multihead" else dict(method="exact_tiled"), cu)
    for got, expected in zip(half, want):
        assert got.grad.dtype == dtype
        assert torch.equal(got.grad, torch.from_numpy(expected).to(dtype))
