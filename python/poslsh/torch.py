"""PyTorch operators for exact ALiBi attention and LSH attention on CPU tensors (torch >= 2.13).

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

The calls are the registered operators (torch.library custom ops, registered once at import)
torch.ops.poslsh.alibi_attention, lsh_attention and multihead_attention, each returning (out,
lse) with a fake implementation (shapes, for meta tensors, FakeTensor and torch.compile) and an
autograd formula that calls the operator <name>_backward, and alibi_attention_forward,
lsh_attention_forward and multihead_attention_forward, which write their argument ``out``
(mutates_args) and have no gradients. torch.compile(..., fullgraph=True) records them without a
graph break. The hashes are inputs of the operators: lsh_attention passes its HashSet's widths and
offsets as float64 tensors, multihead_attention its (sigmas, samples, seed) (seed < 2**63). The
operators check their arguments; the calls check what only Python sees (argument types,
requires_grad). AlibiAttention, LshAttention and MultiheadAttention keep their ``apply``
(``MultiheadAttention.apply(q, k, v, keywords, precision)`` with the kernels' keywords as a dict).
The FlashAttention calls are poslsh.flash's operators. AlibiSelfAttention, KVCache and
BoundedKVCache (a KV cache that keeps only the keys its heads can still read, with
flash_attn_with_kvcache-style calls) are poslsh.modules'.

This module is imported only on request (``import poslsh.torch``) and needs PyTorch 2.13 or
newer (ImportError naming the version otherwise).
"""

import numpy as np
import torch

from . import _core, _torch_version

_torch_version.require("poslsh.torch")

from .flash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,  # noqa: E402
                    flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                    flash_attn_with_kvcache)
from .modules import AlibiSelfAttention, BoundedKVCache, KVCache, attention_forward, make_alibi_slopes  # noqa: E402

__all__ = ["AlibiAttention", "LshAttention", "MultiheadAttention", "alibi_attention", "alibi_attention_forward",
           "lsh_attention", "lsh_attention_forward", "multihead_attention", "multihead_attention_forward",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "AlibiSelfAttention", "BoundedKVCache", "KVCache", "attention_forward", "make_alibi_slopes"]

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


def _lse_dtype(q, half):
    return torch.float32 if half else q.dtype


# The public calls' checks of what only Python sees (the operators check the rest). ---------


def _tensors(function, **tensors):
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"poslsh.torch.{function}: argument '{name}' must be a torch.Tensor, got "
                            f"{type(x).__name__}")


def _float(function, value, name, optional=False):
    """A float argument of an operator schema (an int, a float or a numpy scalar; None when
    optional)."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        kind = "a float or None" if optional else "a float"
        raise TypeError(f"poslsh.torch.{function}: argument '{name}' must be {kind}, got {type(value).__name__}")
    return float(value)


def _int(function, value, name, optional=False):
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"poslsh.torch.{function}: argument '{name}' must be an int, got {type(value).__name__}")
    return int(value)


def _str(function, value, name):
    if not isinstance(value, str):
        raise TypeError(f"poslsh.torch.{function}: argument '{name}' must be a str, got {type(value).__name__}")
    return value


def _seed(function, seed):
    """The seed as the operators take it: an int in [0, 2**63) (the schema's int is signed)."""
    seed = _int(function, seed, "seed")
    if not 0 <= seed < 2**63:
        raise ValueError(f"poslsh.torch.{function}: argument 'seed' is {seed}: must be in [0, 2**63)")
    return seed


def _hash_tensors(function, hashes):
    """A poslsh.HashSet as the operators take it: its widths and offsets (float64 tensors), from
    which the operator rebuilds the same HashSet; the hashes are inputs, never drawn inside."""
    if not isinstance(hashes, _core.HashSet):
        raise TypeError(f"poslsh.torch.{function}: argument 'hashes' must be a poslsh.HashSet, got "
                        f"{type(hashes).__name__}")
    return (torch.from_numpy(np.array(hashes.widths, dtype=np.float64)),
            torch.from_numpy(np.array(hashes.offsets, dtype=np.float64)))


def _hash_set(widths, offsets):
    return _core.HashSet(widths.tolist(), offsets.tolist())


def _records(*tensors):
    """Whether autograd records a call on `tensors` (grad mode on, one of them requiring grad)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)


# Registration. ------------------------------------------------------------------------------
#
# Each call is a torch.library custom operator (namespace poslsh) with a fake implementation
# (shapes and dtypes) and, for the differentiable ones, an autograd formula whose backward is an
# operator too:
#
#   alibi_attention, lsh_attention, multihead_attention     (out, lse); differentiable in q, k, v
#   alibi_attention_backward, lsh_attention_backward,
#   multihead_attention_backward                            (dq, dk, dv)
#   alibi_attention_forward, lsh_attention_forward,
#   multihead_attention_forward                             write `out` (mutates_args); no gradients
#
# lsh_attention's hashes are the tensors hash_widths and hash_offsets of a poslsh.HashSet; the
# multi-head operators draw theirs from (sigmas, samples, seed), arguments of the call.

_SINGLE_HEAD = "str masking, float? scale, str precision"
_MULTIHEAD = ("str layout, str method, str masking, float? scale, float[]? sigmas, int samples, int seed, "
              "float band_error, int[] window, Tensor? cu_seqlens, str precision")
_QKV = "Tensor q, Tensor k, Tensor v"
_BACKWARD = "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse"


def _define(name, schema, impl, fake, mutates_args=()):
    op = torch.library.custom_op(f"poslsh::{name}", impl, mutates_args=mutates_args, schema=schema)
    op.register_fake(fake)
    return op


def _save_inputs(ctx, tensors, options):
    """Saves the tensors (q, k, v, out, lse) and the other inputs `options` for the backward
    (tensors among them through save_for_backward)."""
    ctx.is_tensor = [isinstance(x, torch.Tensor) for x in options]
    ctx.save_for_backward(*tensors, *(x for x in options if isinstance(x, torch.Tensor)))
    ctx.others = [x for x in options if not isinstance(x, torch.Tensor)]
    ctx.count = len(tensors)


def _saved_inputs(ctx):
    saved = ctx.saved_tensors
    tensors, rest = iter(saved[ctx.count:]), iter(ctx.others)
    return saved[:ctx.count], [next(tensors) if is_tensor else next(rest) for is_tensor in ctx.is_tensor]


def _gradients_fake(dout, q, k, v, out, lse, *arguments):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    _save_inputs(ctx, tuple(inputs[:3]) + tuple(output), inputs[3:])


def _define_differentiable(name, options_schema, forward, forward_fake, backward):
    """poslsh::<name>(q, k, v, <options_schema>) -> (out, lse) and poslsh::<name>_backward(dout, q,
    k, v, out, lse, <options_schema>) -> (dq, dk, dv), the first's autograd formula calling the
    second (lse not differentiable; the other inputs get no gradient)."""
    backward_op = _define(name + "_backward", f"({_BACKWARD}, {options_schema}) -> (Tensor, Tensor, Tensor)",
                          backward, _gradients_fake)

    def autograd(ctx, dout, _):
        tensors, options = _saved_inputs(ctx)
        return tuple(backward_op(dout, *tensors, *options)) + (None,) * len(options)

    op = _define(name, f"({_QKV}, {options_schema}) -> (Tensor, Tensor)", forward, forward_fake)
    op.register_autograd(autograd, setup_context=_setup_context)


def _single_head(name, kernel, parameter_schema, parameter):
    """poslsh::<name>(q, k, v, <parameter_schema>, masking, scale, precision) -> (out, lse), the
    forward with lse of the single-head kernel `kernel` of the core module on [n, d] tensors read
    in place (half precision too: out in q's dtype, lse float32), and poslsh::<name>_backward.
    parameter(*arguments) is the kernel's argument after v (sigma or a HashSet)."""
    count = parameter_schema.count(",") + 1

    def forward(q, k, v, *arguments):
        half = _half_inputs(q, k, v)
        masking, scale, precision = arguments[count:]
        out = torch.empty((q.shape[0], v.shape[1]), dtype=q.dtype)
        lse = torch.empty((q.shape[0],), dtype=_lse_dtype(q, half))
        getattr(_core, kernel + "_with_lse")(
            _kernel_array(q, "q", half), _kernel_array(k, "k", half), _kernel_array(v, "v", half),
            parameter(*arguments[:count]), masking=masking, scale=scale, out=_kernel_array(out, "out", half),
            lse=lse.numpy(), precision=precision)
        return out, lse

    def forward_fake(q, k, v, *arguments):
        half = _half_inputs(q, k, v)
        if q.dim() != 2 or v.dim() != 2:
            raise ValueError(f"poslsh.torch.{name}: arguments 'q' {tuple(q.shape)} and 'v' {tuple(v.shape)} must be "
                             "2-D [n, d]")
        return q.new_empty((q.shape[0], v.shape[1])), q.new_empty((q.shape[0],), dtype=_lse_dtype(q, half))

    def backward_impl(dout, q, k, v, out, lse, *arguments):
        """(dq, dk, dv) from the forward's out and lse (float32 gradients of half-precision
        inputs cast once to their dtype)."""
        half = _half_inputs(q, k, v)
        masking, scale, precision = arguments[count:]
        dq, dk, dv = (torch.empty(x.shape, dtype=lse.dtype) for x in (q, k, v))
        getattr(_core, kernel + "_backward")(
            _kernel_array(q, "q", half), _kernel_array(k, "k", half), _kernel_array(v, "v", half),
            parameter(*arguments[:count]), _kernel_array(out, "out", half), lse.numpy(),
            _kernel_array(_gradient(dout.to(out.dtype)), "dout", half), masking=masking, scale=scale,
            dq=dq.numpy(), dk=dk.numpy(), dv=dv.numpy(), precision=precision)
        return tuple(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))

    _define_differentiable(name, f"{parameter_schema}, {_SINGLE_HEAD}", forward, forward_fake, backward_impl)


_single_head("alibi_attention", "alibi_attention_tiled", "float sigma", lambda sigma: sigma)
_single_head("lsh_attention", "lsh_attention_fused", "Tensor hash_widths, Tensor hash_offsets", _hash_set)


def _multihead_keywords(layout, method, masking, scale, sigmas, samples, seed, band_error, window, cu_seqlens):
    keywords = dict(layout=layout, method=method, masking=masking, scale=scale, sigmas=sigmas, samples=samples,
                    seed=seed, band_error=band_error, window=tuple(window))
    if cu_seqlens is not None:
        keywords["cu_seqlens"] = cu_seqlens.numpy()
    return keywords


def _multihead_shapes(q, v, layout):
    """out's and lse's shapes: [n, H, d_v] / [H, n] ("nhd") or [H, n, d_v] / [H, n] ("hnd")."""
    tokens, heads = (q.shape[0], q.shape[1]) if layout == "nhd" else (q.shape[1], q.shape[0])
    shape = (tokens, heads, v.shape[2]) if layout == "nhd" else (heads, tokens, v.shape[2])
    return shape, (heads, tokens)


def _multihead_forward(q, k, v, layout, method, masking, scale, sigmas, samples, seed, band_error, window, cu_seqlens,
                       precision):
    half = _half_inputs(q, k, v)
    out_shape, lse_shape = _multihead_shapes(q, v, layout)
    out = torch.empty(out_shape, dtype=q.dtype)
    lse = torch.empty(lse_shape, dtype=_lse_dtype(q, half))
    _core.multihead_attention_with_lse(
        _kernel_array(q, "q", half), _kernel_array(k, "k", half), _kernel_array(v, "v", half),
        **_multihead_keywords(layout, method, masking, scale, sigmas, samples, seed, band_error, window, cu_seqlens),
        out=_kernel_array(out, "out", half), lse=lse.numpy(), precision=precision)
    return out, lse


def _multihead_forward_fake(q, k, v, layout, *arguments):
    half = _half_inputs(q, k, v)
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"poslsh.torch.multihead_attention: arguments 'q' {tuple(q.shape)} and 'v' "
                         f"{tuple(v.shape)} must be 3-D")
    out_shape, lse_shape = _multihead_shapes(q, v, layout)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=_lse_dtype(q, half))


def _multihead_backward(dout, q, k, v, out, lse, layout, method, masking, scale, sigmas, samples, seed, band_error,
                        window, cu_seqlens, precision):
    half = _half_inputs(q, k, v)
    dq, dk, dv = (torch.empty(x.shape, dtype=lse.dtype) for x in (q, k, v))
    _core.multihead_attention_backward(
        _kernel_array(q, "q", half), _kernel_array(k, "k", half), _kernel_array(v, "v", half),
        _kernel_array(out, "out", half), lse.numpy(), _kernel_array(_heads_gradient(dout.to(out.dtype)), "dout", half),
        **_multihead_keywords(layout, method, masking, scale, sigmas, samples, seed, band_error, window, cu_seqlens),
        dq=dq.numpy(), dk=dk.numpy(), dv=dv.numpy(), precision=precision)
    return tuple(g.to(x.dtype) for g, x in zip((dq, dk, dv), (q, k, v)))


_define_differentiable("multihead_attention", _MULTIHEAD, _multihead_forward, _multihead_forward_fake,
                       _multihead_backward)


# The differentiable calls. -------------------------------------------------------------------


def alibi_attention(q, k, v, sigma, *, masking="causal", scale=None, precision="matrix_units"):
    """Exact ALiBi attention softmax(tau Q K^T - |i-j| / sigma) V (differentiable in q, k, v;
    torch.ops.poslsh.alibi_attention). precision: "matrix_units" (default) or "float_products",
    for bfloat16 inputs (module docstring); float32 and float64 inputs ignore it."""
    function = "alibi_attention"
    _tensors(function, q=q, k=k, v=v)
    out, _ = torch.ops.poslsh.alibi_attention(q, k, v, _float(function, sigma, "sigma"),
                                              _str(function, masking, "masking"),
                                              _float(function, scale, "scale", True),
                                              _str(function, precision, "precision"))
    return out


def lsh_attention(q, k, v, hashes, *, masking="causal", scale=None, precision="matrix_units"):
    """LSH ALiBi attention softmax(tau Q K^T + log M~) V for a poslsh.HashSet (differentiable
    in q, k, v; torch.ops.poslsh.lsh_attention, which takes the hashes' widths and offsets).
    precision as alibi_attention."""
    function = "lsh_attention"
    _tensors(function, q=q, k=k, v=v)
    out, _ = torch.ops.poslsh.lsh_attention(q, k, v, *_hash_tensors(function, hashes),
                                            _str(function, masking, "masking"),
                                            _float(function, scale, "scale", True),
                                            _str(function, precision, "precision"))
    return out


class AlibiAttention:
    """alibi_attention as ``AlibiAttention.apply(q, k, v, sigma, masking="causal", scale=None,
    precision="matrix_units")`` (the operator torch.ops.poslsh.alibi_attention)."""

    @staticmethod
    def apply(q, k, v, sigma, masking="causal", scale=None, precision="matrix_units"):
        return alibi_attention(q, k, v, sigma, masking=masking, scale=scale, precision=precision)


class LshAttention:
    """lsh_attention as ``LshAttention.apply(q, k, v, hashes, masking="causal", scale=None,
    precision="matrix_units")`` (the operator torch.ops.poslsh.lsh_attention)."""

    @staticmethod
    def apply(q, k, v, hashes, masking="causal", scale=None, precision="matrix_units"):
        return lsh_attention(q, k, v, hashes, masking=masking, scale=scale, precision=precision)


_MULTIHEAD_DEFAULTS = dict(layout="nhd", method="lsh_fused", masking="causal", scale=None, sigmas=None, samples=16,
                           seed=0, band_error=1e-3, window=(-1, -1), cu_seqlens=None)


def _multihead_call(q, k, v, keywords, precision):
    """torch.ops.poslsh.multihead_attention's out for the kernels' keywords (multihead_attention's
    defaults for those not given), converted to the operator's argument types."""
    function = "multihead_attention"
    _tensors(function, q=q, k=k, v=v)
    unknown = set(keywords) - set(_MULTIHEAD_DEFAULTS)
    if unknown:
        raise TypeError(f"poslsh.torch.{function}: unexpected keyword arguments {sorted(unknown)}")
    options = dict(_MULTIHEAD_DEFAULTS, **keywords)
    sigmas, window, cu_seqlens = options["sigmas"], options["window"], options["cu_seqlens"]
    if sigmas is not None:
        sigmas = [_float(function, x, "sigmas") for x in sigmas]
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"poslsh.torch.{function}: argument 'window' is {window!r}: must be a pair (left, right) of "
                        "ints")
    window = [_int(function, side, "window") for side in window]
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.from_numpy(np.asarray(cu_seqlens, dtype=np.int32 if isinstance(cu_seqlens, (list, tuple))
                                                 else None))
    out, _ = torch.ops.poslsh.multihead_attention(
        q, k, v, _str(function, options["layout"], "layout"), _str(function, options["method"], "method"),
        _str(function, options["masking"], "masking"), _float(function, options["scale"], "scale", True), sigmas,
        _int(function, options["samples"], "samples"), _seed(function, options["seed"]),
        _float(function, options["band_error"], "band_error"), window, cu_seqlens,
        _str(function, precision, "precision"))
    return out


class MultiheadAttention:
    """multihead_attention as ``MultiheadAttention.apply(q, k, v, keywords, precision="matrix_units")``
    with the kernels' keywords as a dict (layout, method, masking, scale, sigmas, samples, seed,
    band_error, window, cu_seqlens; multihead_attention's defaults for those not given)."""

    @staticmethod
    def apply(q, k, v, keywords, precision="matrix_units"):
        return _multihead_call(q, k, v, keywords, precision)


def multihead_attention(q, k, v, *, layout="nhd", method="lsh_fused", masking="causal", scale=None, sigmas=None,
                        samples=16, seed=0, band_error=1e-3, window=(-1, -1), cu_seqlens=None,
                        precision="matrix_units"):
    """poslsh.multihead_attention (self-attention, grouped-query when k, v have fewer heads),
    differentiable in q, k, v (torch.ops.poslsh.multihead_attention): for query head h (K/V
    head h // G) out_h = method(Q_h, K_{h//G}, V_{h//G}; sigma_h), dK and dV summed over each
    group. The LSH methods draw head h's hashes from (sigma_h, samples, seed), arguments of the
    operator. window=(left, right): a local window (exact methods; -1 leaves a side unbounded).
    cu_seqlens (int32 tensor or array of B + 1 token offsets): a packed batch of B sequences,
    each attending only to itself at positions 0 .. m_b - 1 (multihead_attention_varlen).
    seed: an int in [0, 2**63). precision: "matrix_units" (default) or "float_products", for
    bfloat16 inputs (module docstring); float32 and float64 inputs ignore it."""
    return _multihead_call(q, k, v, dict(layout=layout, method=method, masking=masking, scale=scale, sigmas=sigmas,
                                         samples=samples, seed=seed, band_error=band_error, window=window,
                                         cu_seqlens=cu_seqlens), precision)


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
    if _records(*tensors):
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


def _forward_only_op(name, kernel, parameter_schema, parameter):
    """poslsh::<name>(q, k, v, <parameter_schema>, masking, scale, query_offset, precision, out),
    the single-head kernel `kernel` of the core module writing `out` (mutates_args)."""
    count = parameter_schema.count(",") + 1

    def impl(q, k, v, *arguments):
        masking, scale, query_offset, precision, out = arguments[count:]
        kernel(_storage(q, "q"), _storage(k, "k"), _storage(v, "v"), parameter(*arguments[:count]),
               out=_storage(out, "out"), masking=masking, scale=scale, query_offset=query_offset,
               precision=precision)

    def fake(q, k, v, *arguments):
        return None

    _define(name, f"({_QKV}, {parameter_schema}, str masking, float? scale, int? query_offset, str precision, "
            "Tensor(a!) out) -> ()", impl, fake, mutates_args=("out",))


_forward_only_op("alibi_attention_forward", _core.alibi_attention_tiled, "float sigma", lambda sigma: sigma)
_forward_only_op("lsh_attention_forward", _core.lsh_attention_fused, "Tensor hash_widths, Tensor hash_offsets",
                 _hash_set)


def _multihead_forward_only(q, k, v, layout, method, masking, scale, sigmas, samples, seed, band_error, query_offset,
                            precision, out):
    _core.multihead_attention(
        _storage(q, "q"), _storage(k, "k"), _storage(v, "v"), layout=layout, method=method, masking=masking,
        scale=scale, sigmas=sigmas, samples=samples, seed=seed, band_error=band_error, query_offset=query_offset,
        out=_storage(out, "out"), precision=precision)


_define("multihead_attention_forward", f"({_QKV}, str layout, str method, str masking, float? scale, float[]? sigmas, "
        "int samples, int seed, float band_error, int? query_offset, str precision, Tensor(a!) out) -> ()",
        _multihead_forward_only, lambda *arguments: None, mutates_args=("out",))


def _forward_only_call(function, q, k, v, out, out_dtype):
    """The checks of a forward-only call and its output tensor (`out`, or a new [m, d_v] one)."""
    _tensors(function, q=q, k=k, v=v)
    if out is not None:
        _tensors(function, out=out)
    _forward_only(function, (q, k, v))
    return _forward_out(out, (q.shape[0], v.shape[-1]) if q.dim() == 2 else (0, 0), q, out_dtype)


def alibi_attention_forward(q, k, v, sigma, *, masking="causal", scale=None, query_offset=None, out_dtype=None,
                            out=None, precision="matrix_units"):
    """Exact ALiBi attention softmax(tau Q K^T - |i-j| / sigma) V (poslsh.alibi_attention_tiled),
    forward only, on CPU tensors of shape [m, d] (q), [L, d] (k), [L, d_v] (v), read in place
    (torch.ops.poslsh.alibi_attention_forward, which writes `out`).

    dtypes: q, k, v all bfloat16, all float16, all float32 or all float64; or float32 q over
    bfloat16 or float16 k, v. Half precision accumulates in float32; the output is q's dtype
    (bfloat16 and float16: the float32 result rounded once) unless out_dtype=torch.float32
    (half-precision q only). out: a tensor written in place (any row stride) and returned.
    precision: "matrix_units" (default: bfloat16 q, k, v on the CPU's matrix unit where it has
    one) or "float_products" (every value widened to float32: the float32 call on the widened
    tensors); float32 and float64 inputs ignore it.
    Not differentiable (RuntimeError if an input requires grad while grad mode is on)."""
    function = "alibi_attention_forward"
    result = _forward_only_call(function, q, k, v, out, out_dtype)
    torch.ops.poslsh.alibi_attention_forward(q, k, v, _float(function, sigma, "sigma"),
                                             _str(function, masking, "masking"), _float(function, scale, "scale", True),
                                             _int(function, query_offset, "query_offset", True),
                                             _str(function, precision, "precision"), result)
    return result


def lsh_attention_forward(q, k, v, hashes, *, masking="causal", scale=None, query_offset=None, out_dtype=None,
                          out=None, precision="matrix_units"):
    """LSH ALiBi attention D~^-1 (A o M~) V, A_ij = exp(tau q_i.k_j), M~ the mean of the block
    masks of `hashes` (poslsh.lsh_attention_fused), forward only
    (torch.ops.poslsh.lsh_attention_forward); dtypes, out_dtype, out and precision as
    alibi_attention_forward."""
    function = "lsh_attention_forward"
    result = _forward_only_call(function, q, k, v, out, out_dtype)
    torch.ops.poslsh.lsh_attention_forward(q, k, v, *_hash_tensors(function, hashes),
                                           _str(function, masking, "masking"), _float(function, scale, "scale", True),
                                           _int(function, query_offset, "query_offset", True),
                                           _str(function, precision, "precision"), result)
    return result


def multihead_attention_forward(q, k, v, *, layout="nhd", method="lsh_fused", masking="causal", scale=None,
                                sigmas=None, samples=16, seed=0, band_error=1e-3, query_offset=None,
                                out_dtype=None, out=None, precision="matrix_units"):
    """poslsh.multihead_attention, forward only, on [m, H_q, d] / [L, H_kv, d] tensors (layout
    "nhd") or [H, n, d] ("hnd"): for query head h (K/V head h // G)
    out_h = method(Q_h, K_{h//G}, V_{h//G}; sigma_h) (torch.ops.poslsh.multihead_attention_forward).
    dtypes, out_dtype, out and precision as alibi_attention_forward; seed an int in [0, 2**63)."""
    function = "multihead_attention_forward"
    _tensors(function, q=q, k=k, v=v)
    if out is not None:
        _tensors(function, out=out)
    _forward_only(function, (q, k, v))
    shape = (q.shape[0], q.shape[1], v.shape[-1]) if q.dim() == 3 else (0, 0, 0)  # [m, H, d_v] or [H, m, d_v]
    result = _forward_out(out, shape, q, out_dtype)
    torch.ops.poslsh.multihead_attention_forward(
        q, k, v, _str(function, layout, "layout"), _str(function, method, "method"), _str(function, masking, "masking"),
        _float(function, scale, "scale", True),
        None if sigmas is None else [_float(function, x, "sigmas") for x in sigmas],
        _int(function, samples, "samples"), _seed(function, seed), _float(function, band_error, "band_error"),
        _int(function, query_offset, "query_offset", True), _str(function, precision, "precision"), result)
    return result
