"""PyTorch autograd Functions for exact ALiBi attention and LSH attention on CPU tensors.

The tensors are handed to the C++ kernels through ``Tensor.numpy()``, which shares memory: no
copy in either direction. Inputs are CPU float32 or float64 tensors (half precision: below)
of shape ``[n, d]`` (one head) whose last dimension has stride 1; any row stride (e.g.
``x[:, h, :]`` of an ``[n, H, d]`` tensor). The output is a new contiguous tensor.

    out = poslsh.torch.alibi_attention(q, k, v, sigma, masking="causal", scale=None)
        softmax(tau Q K^T - |i-j| / sigma) V
    out = poslsh.torch.lsh_attention(q, k, v, hashes, masking="causal", scale=None)
        D~^-1 (A o M~) V, A_ij = exp(tau q_i.k_j), M~ the mean of the block masks of ``hashes``
    out = poslsh.torch.multihead_attention(q, k, v, layout="nhd", method="lsh_fused", ...)
        poslsh.multihead_attention on [n, H, d] (or [H, n, d]) tensors, grouped-query included;
        gradients from poslsh.multihead_attention_backward

Gradients (dQ, dK, dV; not sigma, scale or the hashes) come from the library's backward
passes, which recompute the probabilities from the forward's log-sum-exp tile by tile (no
n x n buffer). These three also take bfloat16 or float16 tensors (q, k, v of one dtype), read
in place: the library's half-precision forward with lse and backward run on them directly (no
float32 copy, one forward). The output is in the inputs' dtype, the gradients are the
backward's float32 gradients cast once to it (as FlashAttention returns them). With
``precision="matrix_units"`` (the default) and bfloat16 inputs on a CPU with a matrix unit
(``poslsh.matrix_unit``) the products take bfloat16 operands on the unit (float32 accumulation
and softmax; the probabilities rounded to bfloat16 before P V, and P and dS before the
backward's products); otherwise (``precision="float_products"``, float16, or no unit) every
value is widened to float32 as it is read: the output is the float32 call's on the widened
tensors rounded once, and the float32 gradients are bitwise those of the float32 backward on
the widened inputs and that rounded output. float32 and float64 inputs ignore ``precision``.

Forward-only kernels for inference on half-precision tensors (no autograd):

    out = poslsh.torch.alibi_attention_forward(q, k, v, sigma, ..., out_dtype=None, out=None)
    out = poslsh.torch.lsh_attention_forward(q, k, v, hashes, ...)
    out = poslsh.torch.multihead_attention_forward(q, k, v, layout="nhd", method="lsh_fused", ...)

take torch.bfloat16 and torch.float16 tensors (also float32 queries over a bfloat16 or float16
KV cache, and plain float32/float64), with float32 accumulation and softmax, output in q's dtype
(the float32 result rounded once) or float32 with out_dtype=torch.float32. bfloat16 tensors go
to the kernels as poslsh.BFloat16Bits over ``tensor.view(torch.int16).numpy()``: the same
memory. ``precision=`` ("matrix_units", default, or "float_products") is the kernels' keyword:
bfloat16 q, k, v use the CPU's matrix unit under "matrix_units" where it has one.

This module is imported only on request (``import poslsh.torch``) and needs PyTorch.
"""

import torch

from . import _core
from .flash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .modules import AlibiSelfAttention, KVCache, attention_forward, make_alibi_slopes

__all__ = ["AlibiAttention", "LshAttention", "MultiheadAttention", "alibi_attention", "alibi_attention_forward",
           "lsh_attention", "lsh_attention_forward", "multihead_attention", "multihead_attention_forward",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "AlibiSelfAttention", "KVCache", "attention_forward", "make_alibi_slopes"]

_DTYPES = (torch.float32, torch.float64)


def _cpu_tensor(tensor, name, dtypes, rule):
    """`tensor` detached, after checking that it is a CPU tensor of one of `dtypes` (`rule` names
    them in the message)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"poslsh.torch: argument '{name}' must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"poslsh.torch: argument '{name}' is on {tensor.device}: only CPU tensors are supported")
    if tensor.dtype not in dtypes:
        raise TypeError(f"poslsh.torch: argument '{name}' has dtype {tensor.dtype}: must be {rule}")
    return tensor.detach()


def _array(tensor, name):
    """The numpy view of a CPU tensor (shares memory; never a copy)."""
    return _cpu_tensor(tensor, name, _DTYPES, "torch.float32, torch.float64 (or torch.bfloat16, torch.float16 for q, "
                       "k, v of the differentiable functions)").numpy()


def _gradient(tensor):
    """The incoming gradient as the kernels need it: a last dimension of stride 1 and positive
    row strides. Autograd may pass an expanded tensor (stride 0, e.g. after ``sum()``); only
    then is it copied."""
    rows_ok = tensor.dim() != 2 or tensor.shape[0] <= 1 or tensor.stride(0) > 0
    last_ok = tensor.shape[-1] <= 1 or tensor.stride(-1) == 1
    return tensor if rows_ok and last_ok else tensor.contiguous()


def _heads_gradient(tensor):
    """A 3-D incoming gradient as the multi-head kernels need it: a last dimension of stride 1
    and positive strides on the other two; only otherwise (e.g. expanded by ``sum()``) copied."""
    last_ok = tensor.shape[-1] <= 1 or tensor.stride(-1) == 1
    axes_ok = all(tensor.shape[axis] <= 1 or tensor.stride(axis) > 0 for axis in (0, 1))
    return tensor if last_ok and axes_ok else tensor.contiguous()


_WIDENED = (torch.bfloat16, torch.float16)


def _half_inputs(q, k, v):
    """Whether q, k, v are half-precision tensors (bfloat16 or float16, all three of one dtype:
    TypeError otherwise), which the kernels read in place with float32 lse and gradients."""
    dtypes = tuple(getattr(x, "dtype", None) for x in (q, k, v))
    if not any(dtype in _WIDENED for dtype in dtypes):
        return False
    for name, dtype in zip("kv", dtypes[1:]):
        if dtype != dtypes[0]:
            raise TypeError(f"poslsh.torch: argument '{name}' has dtype {dtype}: must be {dtypes[0]} like "
                            "'q' (half-precision q, k, v share one dtype)")
    return True


def _kernel_array(tensor, name, half):
    """The argument of a training kernel: the numpy view of a float32/float64 tensor, or the
    shared storage (_storage) of a half-precision one."""
    return _storage(tensor, name) if half else _array(tensor, name)


def _single_head_forward(ctx, kernel, q, k, v, parameter, masking, scale, precision):
    """Forward with lse of the single-head kernel `kernel` of the core module (its argument
    after v is `parameter`: sigma or a HashSet) on [n, d] tensors, read in place (half precision
    too: out in q's dtype, lse float32); saves q, k, v, out and lse for the backward."""
    ctx.half = _half_inputs(q, k, v)
    q, k, v = (x.detach() for x in (q, k, v))
    out = torch.empty((q.shape[0], v.shape[1]), dtype=q.dtype)
    lse = torch.empty((q.shape[0],), dtype=torch.float32 if ctx.half else q.dtype)
    getattr(_core, kernel + "_with_lse")(
        _kernel_array(q, "q", ctx.half), _kernel_array(k, "k", ctx.half), _kernel_array(v, "v", ctx.half), parameter,
        masking=masking, scale=scale, out=_kernel_array(out, "out", ctx.half), lse=lse.numpy(), precision=precision)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.kernel, ctx.parameter, ctx.masking, ctx.scale, ctx.precision = kernel, parameter, masking, scale, precision
    return out


def _single_head_backward(ctx, dout):
    """(dq, dk, dv) of the forward saved by _single_head_forward, from its out and lse (float32
    gradients of half-precision inputs cast once to their dtype)."""
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = (torch.empty(x.shape, dtype=lse.dtype) for x in (q, k, v))
    half = ctx.half
    getattr(_core, ctx.kernel + "_backward")(
        _kernel_array(q, "q", half), _kernel_array(k, "k", half), _kernel_array(v, "v", half), ctx.parameter,
        _kernel_array(out, "out", half), lse.numpy(), _kernel_array(_gradient(dout.to(out.dtype)), "dout", half),
        masking=ctx.masking, scale=ctx.scale, dq=dq.numpy(), dk=dk.numpy(), dv=dv.numpy(), precision=ctx.precision,
    )
    return tuple(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))


class _SingleHeadAttention(torch.autograd.Function):
    """The backward of the single-head Functions below: gradients in q, k, v only."""

    @staticmethod
    def backward(ctx, dout):
        return *_single_head_backward(ctx, dout), None, None, None, None


class AlibiAttention(_SingleHeadAttention):
    """Exact ALiBi attention softmax(tau Q K^T - |i-j| / sigma) V on [n, d] CPU tensors."""

    @staticmethod
    def forward(ctx, q, k, v, sigma, masking="causal", scale=None, precision="matrix_units"):
        return _single_head_forward(ctx, "alibi_attention_tiled", q, k, v, sigma, masking, scale, precision)


class LshAttention(_SingleHeadAttention):
    """LSH ALiBi attention D~^-1 (A o M~) V (the fused kernel) on [n, d] CPU tensors."""

    @staticmethod
    def forward(ctx, q, k, v, hashes, masking="causal", scale=None, precision="matrix_units"):
        return _single_head_forward(ctx, "lsh_attention_fused", q, k, v, hashes, masking, scale, precision)


def alibi_attention(q, k, v, sigma, *, masking="causal", scale=None, precision="matrix_units"):
    """Exact ALiBi attention softmax(tau Q K^T - |i-j| / sigma) V (differentiable in q, k, v).
    precision: "matrix_units" (default) or "float_products", for bfloat16 inputs (module
    docstring); float32 and float64 inputs ignore it."""
    return AlibiAttention.apply(q, k, v, sigma, masking, scale, precision)


def lsh_attention(q, k, v, hashes, *, masking="causal", scale=None, precision="matrix_units"):
    """LSH ALiBi attention softmax(tau Q K^T + log M~) V for a poslsh.HashSet (differentiable
    in q, k, v). precision as alibi_attention."""
    return LshAttention.apply(q, k, v, hashes, masking, scale, precision)


class MultiheadAttention(torch.autograd.Function):
    """poslsh.multihead_attention (self-attention) on [n, H, d] or [H, n, d] CPU tensors."""

    @staticmethod
    def forward(ctx, q, k, v, keywords, precision="matrix_units"):
        half = _half_inputs(q, k, v)
        q, k, v = (x.detach() for x in (q, k, v))
        tokens, heads = (q.shape[0], q.shape[1]) if keywords["layout"] == "nhd" else (q.shape[1], q.shape[0])
        shape = (tokens, heads, v.shape[2]) if keywords["layout"] == "nhd" else (heads, tokens, v.shape[2])
        out = torch.empty(shape, dtype=q.dtype)
        lse = torch.empty((heads, tokens), dtype=torch.float32 if half else q.dtype)
        _core.multihead_attention_with_lse(
            _kernel_array(q, "q", half), _kernel_array(k, "k", half), _kernel_array(v, "v", half), **keywords,
            out=_kernel_array(out, "out", half), lse=lse.numpy(), precision=precision)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.keywords, ctx.half, ctx.precision = keywords, half, precision
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        half = ctx.half
        dq, dk, dv = (torch.empty(x.shape, dtype=lse.dtype) for x in (q, k, v))
        _core.multihead_attention_backward(
            _kernel_array(q, "q", half), _kernel_array(k, "k", half), _kernel_array(v, "v", half),
            _kernel_array(out, "out", half), lse.numpy(),
            _kernel_array(_heads_gradient(dout.to(out.dtype)), "dout", half), **ctx.keywords,
            dq=dq.numpy(), dk=dk.numpy(), dv=dv.numpy(), precision=ctx.precision,
        )
        return (*(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v))), None, None)


def multihead_attention(q, k, v, *, layout="nhd", method="lsh_fused", masking="causal", scale=None, sigmas=None,
                        samples=16, seed=0, band_error=1e-3, window=(-1, -1), cu_seqlens=None,
                        precision="matrix_units"):
    """poslsh.multihead_attention (self-attention, grouped-query when k, v have fewer heads),
    differentiable in q, k, v: for query head h (K/V head h // G)
    out_h = method(Q_h, K_{h//G}, V_{h//G}; sigma_h), dK and dV summed over each group.
    window=(left, right): a local window (exact methods; -1 leaves a side unbounded).
    cu_seqlens (int32 tensor or array of B + 1 token offsets): a packed batch of B sequences,
    each attending only to itself at positions 0 .. m_b - 1 (multihead_attention_varlen).
    precision: "matrix_units" (default) or "float_products", for bfloat16 inputs (module
    docstring); float32 and float64 inputs ignore it."""
    keywords = dict(layout=layout, method=method, masking=masking, scale=scale,
                    sigmas=None if sigmas is None else [float(x) for x in sigmas], samples=samples, seed=seed,
                    band_error=band_error, window=tuple(window))
    if cu_seqlens is not None:
        keywords["cu_seqlens"] = cu_seqlens.numpy() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    return MultiheadAttention.apply(q, k, v, keywords, precision)


# Forward-only kernels on half-precision tensors (inference). -------------------------------

_HALF_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _storage(tensor, name):
    """The argument the compiled kernels take for a CPU tensor, sharing its memory: a numpy view
    (float16, float32, float64) or, for bfloat16 (numpy has no such dtype), poslsh.BFloat16Bits
    over the tensor's int16 view (the bit patterns, same strides)."""
    tensor = _cpu_tensor(tensor, name, _HALF_DTYPES, "torch.bfloat16, torch.float16, torch.float32 or torch.float64")
    if tensor.dtype == torch.bfloat16:
        return _core.BFloat16Bits(tensor.view(torch.int16).numpy())
    return tensor.numpy()


def _forward_only(function, tensors):
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"poslsh.torch.{function} is forward-only (no gradients): call it under torch.no_grad() or on "
            "tensors that do not require grad; alibi_attention, lsh_attention and multihead_attention are "
            "differentiable")


def _forward_out(out, shape, q, out_dtype):
    """The output tensor: `out` as given, or a new contiguous tensor of `shape` in out_dtype
    (default: q's dtype)."""
    if out is not None:
        return out
    return torch.empty(shape, dtype=q.dtype if out_dtype is None else out_dtype)


def _forward_only_call(function, kernel, q, k, v, parameter, out, out_dtype, **keywords):
    """The forward-only call `function` of a single-head kernel of _core on q, k, v and its
    parameter (sigma or hashes): the output tensor (`out`, or a new [m, d_v] one) written by
    kernel(..., out=..., **keywords) and returned."""
    _forward_only(function, (q, k, v))
    result = _forward_out(out, (q.shape[0], v.shape[-1]) if q.dim() == 2 else (0, 0), q, out_dtype)
    kernel(_storage(q, "q"), _storage(k, "k"), _storage(v, "v"), parameter, out=_storage(result, "out"), **keywords)
    return result


def alibi_attention_forward(q, k, v, sigma, *, masking="causal", scale=None, query_offset=None, out_dtype=None,
                            out=None, precision="matrix_units"):
    """Exact ALiBi attention softmax(tau Q K^T - |i-j| / sigma) V (poslsh.alibi_attention_tiled),
    forward only, on CPU tensors of shape [m, d] (q), [L, d] (k), [L, d_v] (v), read in place.

    dtypes: q, k, v all bfloat16, all float16, all float32 or all float64; or float32 q over
    bfloat16 or float16 k, v. Half precision accumulates in float32; the output is q's dtype
    (bfloat16 and float16: the float32 result rounded once) unless out_dtype=torch.float32
    (half-precision q only). out: a tensor written in place (any row stride) and returned.
    precision: "matrix_units" (default: bfloat16 q, k, v on the CPU's matrix unit where it has
    one) or "float_products" (every value widened to float32: the float32 call on the widened
    tensors); float32 and float64 inputs ignore it.
    Not differentiable (RuntimeError if an input requires grad while grad mode is on)."""
    return _forward_only_call("alibi_attention_forward", _core.alibi_attention_tiled, q, k, v, sigma, out,
                              out_dtype, masking=masking, scale=scale, query_offset=query_offset,
                              precision=precision)


def lsh_attention_forward(q, k, v, hashes, *, masking="causal", scale=None, query_offset=None, out_dtype=None,
                          out=None, precision="matrix_units"):
    """LSH ALiBi attention D~^-1 (A o M~) V, A_ij = exp(tau q_i.k_j), M~ the mean of the block
    masks of `hashes` (poslsh.lsh_attention_fused), forward only; dtypes, out_dtype, out and
    precision as alibi_attention_forward."""
    return _forward_only_call("lsh_attention_forward", _core.lsh_attention_fused, q, k, v, hashes, out,
                              out_dtype, masking=masking, scale=scale, query_offset=query_offset,
                              precision=precision)


def multihead_attention_forward(q, k, v, *, layout="nhd", method="lsh_fused", masking="causal", scale=None,
                                sigmas=None, samples=16, seed=0, band_error=1e-3, query_offset=None,
                                out_dtype=None, out=None, precision="matrix_units"):
    """poslsh.multihead_attention, forward only, on [m, H_q, d] / [L, H_kv, d] tensors (layout
    "nhd") or [H, n, d] ("hnd"): for query head h (K/V head h // G)
    out_h = method(Q_h, K_{h//G}, V_{h//G}; sigma_h). dtypes, out_dtype, out and precision as
    alibi_attention_forward."""
    _forward_only("multihead_attention_forward", (q, k, v))
    shape = (q.shape[0], q.shape[1], v.shape[-1]) if q.dim() == 3 else (0, 0, 0)  # [m, H, d_v] or [H, m, d_v]
    result = _forward_out(out, shape, q, out_dtype)
    _core.multihead_attention(
        _storage(q, "q"), _storage(k, "k"), _storage(v, "v"), layout=layout, method=method, masking=masking,
        scale=scale, sigmas=None if sigmas is None else [float(x) for x in sigmas], samples=samples, seed=seed,
        band_error=band_error, query_offset=query_offset, out=_storage(result, "out"), precision=precision)
    return result
