"""FlashAttention-2's calls with ALiBi slopes on CPU tensors, computed by poslsh's kernels.

    out = flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                          deterministic=False, return_attn_probs=False,
                          *, method="exact", samples=16, seed=0, band_error=1e-3)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 ..., block_table=None, *, method=..., ...)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                  rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                  cache_leftpad=None, block_table=None, softmax_scale=None,
                                  causal=False, window_size=(-1, -1), softcap=0.0,
                                  rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                  return_softmax_lse=False, *, method=..., ...)
    out = flash_attn_qkvpacked_func(qkv, ...), flash_attn_kvpacked_func(q, kv, ...),
          flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, ...),
          flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, ...)

The positional order is FlashAttention 2.6's (softcap after window_size). Conventions, as
FlashAttention-2 defines them:

- q is (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim);
  nheads_k divides nheads (grouped-query: query head h reads K/V head h // (nheads / nheads_k)).
  varlen: (total_q, nheads, headdim) and (total_k, nheads_k, headdim), sequence b owning the
  tokens cu_seqlens[b] .. cu_seqlens[b+1] - 1 (int32 cu_seqlens of batch + 1 entries).
- Query row i of a sequence sits at key position P_i = i + seqlen_k - seqlen_q (bottom-right
  alignment). With scale tau = softmax_scale (default 1/sqrt(headdim)) and slope m_h,

      out_i = softmax_j(tau q_i . k_j - m_h |P_i - j|) V   over the visible keys j,

  key j visible iff P_i - left <= j <= P_i + right for window_size = (left, right), and
  j <= P_i when causal. window_size is any pair of integers (tuple, list, 1-D integer tensor or
  numpy array of 2); as FlashAttention-2, a negative side or one >= seqlen_k (max_seqlen_k for
  varlen, the cache's capacity for flash_attn_with_kvcache) is unbounded, causal sets the right
  side to 0, and the window (-1, 0) is a causal call. A row with no visible key (causal with
  P_i < 0, or a window before the first key) has out 0 and softmax_lse +inf.
- seqlen_q > seqlen_k without causal: the first rows sit before the first key (P_i < 0) and
  see every key (within their window) at distance |P_i - j|. The LSH methods count bins at the
  positions i (query row) and seqlen_q - seqlen_k + j (key j), positions from the first query;
  mean_of_outputs (no log-sum-exp) rejects these calls.
- alibi_slopes: float32 (or float64) of shape (nheads,) or (batch, nheads), any values >= 0;
  None means plain softmax attention (slope 0). poslsh's kernels take sigma_h = 1 / m_h; a slope
  of 0 runs with sigma = 1e300 (the largest the hashes accept), where the bias
  |i - j| / sigma is below any score's rounding and every LSH hash puts all positions in one bin:
  plain softmax attention.
- return_attn_probs=True returns (out, softmax_lse, None): softmax_lse float32
  (batch, nheads, seqlen_q) (varlen: (nheads, total_q)), lse_i = log sum_j e^{x_ij} over the
  visible keys (the LSH methods: log sum_j c_ij e^{tau q_i.k_j}); None for the dropout mask,
  which poslsh never draws. As FlashAttention-2 returns it: its causal kernel (causal, no left
  window) adds +m_h j to the scores instead of -m_h (P_i - j) (the same softmax), so for those
  calls softmax_lse is lse_i + m_h P_i; the others' bias is -m_h |P_i - j| and softmax_lse is
  lse_i. The gradients never read the returned value (the operators keep their own lse).

Keyword-only extras: method "exact" (alibi_attention_tiled, every visible pair but those whose
weight is provably below the float's smallest normal, which it skips; a window skips the tiles
outside it), "banded" (exact ALiBi on |P_i - j| <= W_h = band_for_bias_error(sigma_h,
band_error), dropping entries whose bias weight is below band_error), "lsh" (the count-weighted
Positional-LSH estimator, lsh_attention_fused), "lsh_per_sample" (the same estimator sample by
sample), "fixed_blocks" (plain attention in blocks of width 2 sigma_h), "mean_of_outputs" (the
mean over samples of plain attention inside each sample's blocks); poslsh's names exact_tiled,
exact_banded and lsh_fused are accepted too. LSH head h uses rbf_hashes(sigma_h, samples, seed,
stream=h): the hashes depend on neither the batch row nor the sequence length, so a decode step
over a KV cache equals the rows of one longer prefill. The LSH methods and fixed_blocks take no
window; mean_of_outputs has no softmax_lse.

Autograd (flash_attn_func, flash_attn_varlen_func): dq, dk, dv for every method, and
d alibi_slopes (dL/dm_h = -sum_ij dS_ij |P_i - j|, summed over the batch for (nheads,)
slopes) for "exact" and "banded"; the LSH methods raise ValueError when the slopes require
grad (sampled bins are not differentiable in the slope). float32 and float64 tensors are
computed in their dtype. Half precision (keyword-only ``precision``, the last extra):
with precision="matrix_units" (the default), bfloat16 q, k, v on a CPU with a matrix unit
(poslsh.matrix_unit("bfloat16", "bfloat16") is not "float_products") give the output of the
bfloat16 kernels read in place: bfloat16 products on the unit, float32 accumulation and
softmax, probabilities rounded to bfloat16 before P V (FlashAttention's bfloat16 arithmetic).
Otherwise (precision="float_products", float16, a float32 query over a half-precision cache,
or no unit) half-precision values are widened to float32 and the output is the float32 result
rounded once (bitwise; q, k, v of one half-precision dtype, and a half-precision KV cache, are
read in place by the kernels that compute it). softmax_lse without gradients comes from the
same forward with lse as the output. With gradients, bfloat16 and float16 q, k, v (one
dtype) are read in place by the half-precision forward with lse and backward under the same
precision (one forward, no float32 copies; with the unit, the backward's products take
bfloat16 operands too, P and dS rounded to bfloat16): softmax_lse and the gradients are
float32, the gradients cast once to the inputs' dtype. Without the unit the gradients are
bitwise the float32 backward's on the widened inputs and the rounded output. Method
"mean_of_outputs" (which has no lse: its backward recomputes each sample's attention) takes the
float32 backward of each head's inputs widened to float32.

A call without gradients (softmax_lse included) is one library call on the packed sequences,
multihead_attention_varlen (with lse: multihead_attention_with_lse), in the operators
flash_attn and flash_attn_varlen (no state kept for a backward); the library places the rows of
a sequence with more queries than keys as above (causal: the rows before the first key see no
key; not causal: every key, positions counted from the first query). Calls that need gradients
with seqlen_q < seqlen_k take their forward from the same library call and, for the methods
with a slice backward (every method but mean_of_outputs), their gradients from the packed
slice backward (multihead_attention_backward with cu_seqlens and cu_seqlens_k: each
sequence's queries at positions seqlen_k - seqlen_q .., the cost of seqlen_q query rows; for
lsh_per_sample and fixed_blocks the count-weighted pass of lsh_fused on their hashes, the same
estimator's gradients, each pair once); mean_of_outputs runs the self-attention kernels with q
padded at the front to seqlen_k rows (zero queries, zero incoming gradient: they change no
output row and add exactly zero to dk, dv), at the cost of seqlen_k query rows. Non-causal
calls with seqlen_q > seqlen_k take their forward from the same library call; their gradients
come from the packed slice backward (the same call: exact methods, alibi_slopes included) or
from the self-attention backward with the keys padded at the front by zero rows (the other
methods: a zero key adds nothing to dq, and the real keys' probabilities come from the real
lse).

The packed forms read q, k, v as views of the packed tensor (no copy) and their gradients
reach it through those views. KV caches may have strides (e.g. k_cache = kv_cache[:, :, 0] of
a packed cache; the last axis contiguous): flash_attn_with_kvcache reads and appends to them
in place.

Not supported, ValueError saying so: dropout_p > 0, softcap != 0, rotary embeddings,
cache_leftpad, varlen block_table.

The calls are the registered operators (torch.library custom ops, torch >= 2.13; each with a
fake implementation for meta tensors, FakeTensor and torch.compile) torch.ops.poslsh.flash_attn
and flash_attn_varlen (without autograd recording), flash_attn_train and flash_attn_varlen_train
(while autograd records: they also return the lse the backward reads), whose autograd formula
calls the operator flash_attn_varlen_backward (dq, dk, dv, d alibi_slopes), and
flash_attn_with_kvcache (mutates_args: k_cache, v_cache; no gradients). torch.compile(...,
fullgraph=True) and torch.jit.trace record them; flash_attn and flash_attn_varlen recorded
without gradients and called with them run the training forward again in their backward.
The operators check their arguments; the public calls check what only Python sees (argument
types, window_size, requires_grad of slopes under an LSH method). The LSH methods' hashes come
from (samples, seed), arguments of the operators.
"""

import math
import operator

import numpy as np
import torch

from . import _core, _methods, _torch_version

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]

# The accepted method names and poslsh's method of each: FlashAttention-style short names and
# every name of the library's method table (poslsh.method_names()).
_METHODS = _methods.accepted()
# The methods with gradients in the slopes, and those with a slice backward (the table's traits).
_SLOPE_GRADIENTS = _core.method_names(has_slope_gradients=True)
_SLICE_BACKWARD = _core.method_names(has_slice_backward=True)
_TAKES_WINDOW = _core.method_names(takes_window=True)

# sigma of a zero slope: poslsh.max_hash_sigma, the largest sigma every kernel accepts.
_FLAT_SIGMA = 1e300

_FLOATS = (torch.float32, torch.float64)
_HALF = (torch.bfloat16, torch.float16)
_INPUT_DTYPES = _FLOATS + _HALF


def _fail(function, name, rule, error=ValueError):
    raise error(f"poslsh.torch.{function}: argument '{name}' {rule}")


# Argument checks. -------------------------------------------------------------------------


def _tensor(function, x, name, ndim, shape_text, dtypes=_INPUT_DTYPES):
    """x after checking: a torch.Tensor on the CPU (or meta) of `ndim` dimensions and a dtype in
    `dtypes`."""
    if not isinstance(x, torch.Tensor):
        _fail(function, name, f"must be a torch.Tensor, got {type(x).__name__}", TypeError)
    if x.device.type not in ("cpu", "meta"):
        _fail(function, name, f"is on {x.device}: only CPU tensors are supported")
    if x.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        _fail(function, name, f"has dtype {x.dtype}: must be one of {names}", TypeError)
    if x.dim() != ndim:
        _fail(function, name, f"has {x.dim()} dimensions (shape {tuple(x.shape)}): must be {ndim}-D {shape_text}")
    return x


def _check_heads(function, q, k, v):
    """Shapes of q, k, v agree: head dims, nheads_k dividing nheads, k and v alike on every axis
    but the last; returns (nheads, nheads_k)."""
    heads, heads_k = q.shape[-2], k.shape[-2]
    if k.shape[:-1] != v.shape[:-1]:
        _fail(function, "v", f"has shape {tuple(v.shape)}: must match k {tuple(k.shape)} on every axis but the last")
    if q.shape[-1] != k.shape[-1]:
        _fail(function, "k", f"has headdim {k.shape[-1]}: must equal q's headdim {q.shape[-1]}")
    if heads_k < 1 or heads % heads_k != 0:
        _fail(function, "k", f"has {heads_k} heads: nheads_k must divide q's nheads {heads}")
    if q.shape[-1] < 1 or v.shape[-1] < 1:
        _fail(function, "q", "must have headdim >= 1")
    return heads, heads_k


def _check_dtypes(function, q, k, v):
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            _fail(function, name, f"has dtype {x.dtype}: must equal q's dtype {q.dtype}", TypeError)


def _unsupported(function, dropout_p, softcap):
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0.0:
        _fail(function, "dropout_p", f"is {dropout_p!r}: dropout is not supported by poslsh (only 0.0)")
    if not isinstance(softcap, (int, float)) or softcap != 0.0:
        _fail(function, "softcap", f"is {softcap!r}: logit soft-capping is not supported by poslsh (only 0.0)")


def _window(function, window_size, causal, seqlen_k):
    """FlashAttention's window_size and causal as the kernels take them: (causal, left, right),
    sides -1 (unbounded) or >= 0.

    window_size is any pair of integers: a tuple or list of two ints (Python or numpy integers,
    or 0-d integer tensors), or a 1-D integer tensor or numpy array of 2 (TypeError naming the
    argument otherwise). FlashAttention-2's conversions: a negative side, or one >= seqlen_k
    (the keys a row can reach; the cache's capacity for flash_attn_with_kvcache), is unbounded;
    causal bounds the right side at 0, and a window (-1, 0) is causal (returned as causal True,
    right -1: the kernels' causal mask). Whether the method takes a window is the library's one
    check of the value (ValueError from the kernels' validator)."""
    try:
        if isinstance(window_size, (torch.Tensor, np.ndarray)):
            if window_size.dtype in (torch.bool, np.bool_) or tuple(window_size.shape) != (2,):
                raise TypeError
            window_size = window_size.tolist()
        if isinstance(window_size, (str, bytes)) or len(window_size) != 2:
            raise TypeError
        if any(isinstance(side, (bool, np.bool_)) for side in window_size):
            raise TypeError
        left, right = (operator.index(side) for side in window_size)
    except (TypeError, ValueError, RuntimeError):
        _fail(function, "window_size", f"is {window_size!r}: must be a pair (left, right) of integers (a tuple, "
              "list, or 1-D integer tensor or array of 2)", TypeError)
    left = -1 if left < 0 or left >= seqlen_k else left
    right = 0 if causal else (-1 if right < 0 or right >= seqlen_k else right)
    if left == -1 and right == 0:  # FlashAttention-2's causal call
        return True, -1, -1
    return bool(causal), left, right


def _method(function, method):
    """poslsh's method of an accepted name (a short name or a name of the table)."""
    if method not in _METHODS:
        _fail(function, "method", f"is {method!r}: must be one of {', '.join(repr(m) for m in _METHODS)}")
    return _METHODS[method]


def _integer(function, value, name, low=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        _fail(function, name, f"must be an int, got {type(value).__name__}", TypeError)
    if low is not None and value < low:
        _fail(function, name, f"is {value}: must be >= {low}")
    return int(value)


def _number(function, value, name, optional=False):
    """A float argument of the operator schema: an int or a float (or None when optional)."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a float or None" if optional else "a float"
        _fail(function, name, f"must be {kind}, got {type(value).__name__}", TypeError)
    return float(value)


def _string(function, value, name):
    if not isinstance(value, str):
        _fail(function, name, f"must be a str, got {type(value).__name__}", TypeError)
    return value


def _slopes(function, slopes, batch, heads):
    """Checks alibi_slopes: None, or a float32/float64 tensor (heads,) or (batch, heads) of
    finite values >= 0. Returns its values as (nested) Python floats (None for None and meta
    tensors)."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        _fail(function, "alibi_slopes", f"must be a torch.Tensor or None, got {type(slopes).__name__}", TypeError)
    if slopes.device.type not in ("cpu", "meta"):
        _fail(function, "alibi_slopes", f"is on {slopes.device}: only CPU tensors are supported")
    if slopes.dtype not in _FLOATS:
        _fail(function, "alibi_slopes", f"has dtype {slopes.dtype}: must be torch.float32 (or torch.float64)",
              TypeError)
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        _fail(function, "alibi_slopes", f"has shape {tuple(slopes.shape)}: must be (nheads,) = ({heads},) or "
              f"(batch, nheads) = ({batch}, {heads})")
    if slopes.device.type != "cpu":
        return None
    values = slopes.detach().tolist()
    flat = values if slopes.dim() == 1 else [x for row in values for x in row]
    if not all(0.0 <= x < math.inf for x in flat):  # False for NaN too
        _fail(function, "alibi_slopes", "must hold finite values >= 0 (the bias is -slope * |i - j|)")
    return values


def _cu_seqlens(function, cu, name, total):
    """cu_seqlens as an int64 numpy array, checked: int32 1-D tensor from 0, non-decreasing, last
    entry = total."""
    if not isinstance(cu, torch.Tensor):
        _fail(function, name, f"must be a torch.Tensor, got {type(cu).__name__}", TypeError)
    if cu.dtype != torch.int32:
        _fail(function, name, f"has dtype {cu.dtype}: must be torch.int32", TypeError)
    if cu.dim() != 1 or cu.shape[0] < 1:
        _fail(function, name, f"has shape {tuple(cu.shape)}: must be 1-D with batch + 1 entries")
    values = cu.detach().cpu().numpy().astype(np.int64)
    if values[0] != 0 or bool((np.diff(values) < 0).any()):
        _fail(function, name, f"is {values.tolist()}: must start at 0 and be non-decreasing")
    if values[-1] != total:
        _fail(function, name, f"ends at {values[-1]}: must end at the token count {total}")
    return values


# The computation on packed sequences (varlen form). ------------------------------------


class _Config:
    """The options of one call, as the kernels take them."""

    def __init__(self, method, scale, causal, left, right, samples, seed, band_error, precision):
        self.method, self.scale, self.causal = method, scale, causal
        self.left, self.right = left, right
        self.samples, self.seed, self.band_error = samples, seed, band_error
        self.precision = precision

    def keywords(self, sigmas):
        keywords = dict(layout="nhd", method=self.method, masking="causal" if self.causal else "bidirectional",
                        scale=self.scale, sigmas=sigmas, samples=self.samples, seed=self.seed,
                        band_error=self.band_error)
        if (self.left, self.right) != (-1, -1):
            keywords["window"] = (self.left, self.right)
        return keywords


def _sigmas(slopes_row, heads):
    """sigma_h = 1 / m_h for one row of slopes (a list of floats; None: slope 0); a zero slope
    gives _FLAT_SIGMA."""
    if slopes_row is None:
        return [_FLAT_SIGMA] * heads
    return [min(1.0 / s, _FLAT_SIGMA) if s > 0.0 else _FLAT_SIGMA for s in slopes_row]


class _Rows:
    """Where each query row sits: P = i + L_b - m_b in its sequence. `src` are the rows with a
    key position (P >= 0), `dst` their token index among the keys."""

    def __init__(self, cu_q, cu_k):
        m, lengths = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        self.total_q, self.total_k = int(cu_q[-1]), int(cu_k[-1])
        self.all_valid = bool((m <= lengths).all())
        self.self_attention = self.all_valid and bool((m == lengths).all())
        self.cu_q = cu_q
        self.cu_k = cu_k.astype(np.int32)
        self.m, self.lengths = m, lengths
        self._placed = None

    def _place(self):
        if self._placed is None:
            m, lengths, cu_q = self.m, self.lengths, self.cu_q
            seq = np.repeat(np.arange(len(m)), m)
            position = np.arange(self.total_q) - cu_q[:-1][seq] + (lengths - m)[seq]
            valid = position >= 0
            self._placed = np.nonzero(valid)[0], self.cu_k[:-1].astype(np.int64)[seq[valid]] + position[valid]
        return self._placed

    @property
    def src(self):
        return self._place()[0]

    @property
    def dst(self):
        return self._place()[1]


def _kernel_view(x):
    """x as the kernels read it (last axis contiguous, positive strides), a numpy view; a
    bfloat16 tensor as poslsh.BFloat16Bits over its int16 view."""
    if not x.is_contiguous() and (x.shape[-1] > 1 and x.stride(-1) != 1
                                  or any(x.shape[a] > 1 and x.stride(a) <= 0 for a in range(x.dim()))):
        x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return _core.BFloat16Bits(x.detach().view(torch.int16).numpy())
    return x.detach().numpy()


def _index(indices):
    return torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))


def _moved_rows(x, total, target, source):
    """A new (total, ...) tensor, zero but for rows `target`, which hold x's rows `source`."""
    moved = x.new_zeros((total,) + tuple(x.shape[1:]))
    if len(source):
        moved.index_copy_(0, _index(target), x.index_select(0, _index(source)))
    return moved


def _pad_rows(x, rows):
    """x (total_q, H, d) placed at the key positions of its rows: (total_k, H, d), zero elsewhere."""
    return x if rows.self_attention else _moved_rows(x, rows.total_k, rows.dst, rows.src)


def _unpad_rows(x, rows):
    """The inverse of _pad_rows: (total_q, H, d), zero for the rows without a key position."""
    return x if rows.self_attention else _moved_rows(x, rows.total_q, rows.src, rows.dst)


def _moved_lse(lse, total, target, source):
    """A new (nheads, total) lse, +inf (probability 0) but for columns `target`, which hold lse's
    columns `source`."""
    moved = torch.full((lse.shape[0], total), math.inf, dtype=lse.dtype)
    if len(source):
        moved[:, _index(target)] = lse[:, _index(source)]
    return moved


def _unpad_lse(lse, rows):
    return lse if rows.self_attention else _moved_lse(lse, rows.total_q, rows.src, rows.dst)


def _lse_dtype(x):
    """The dtype of the lse and the gradients of a call on tensors of x's dtype: float32 for the
    half-precision dtypes, else x's."""
    return torch.float32 if x.dtype in _HALF else x.dtype


def _training_forward(q, k, v, rows, sigmas, config):
    """out (total_q, H, d_v), lse (H, total_q) and what the backward needs, for the packed
    sequences of `rows` (sigmas: _call_sigmas). q, k, v: float32 or float64 tensors, or bfloat16
    or float16 ones of one dtype (the half-precision forward with lse: out in their dtype, lse
    float32), under config.precision. The rows run at their key positions (_pad_rows) so that
    the backward is the self-attention backward; a _shifted call keeps them as they are (its
    backward reads the rows of _forward). A method without lse (mean_of_outputs) trains from
    its forward alone."""
    heads = q.shape[1]
    if rows.total_k == 0 or rows.total_q == 0:
        out = q.new_zeros((rows.total_q, heads, v.shape[2]))
        lse = torch.full((heads, rows.total_q), math.inf, dtype=_lse_dtype(q))
        return out, lse, None
    if _shifted(rows, config):
        out, lse = _forward(q, k, v, rows.cu_q, rows.cu_k, config, True)
        return out, lse, (None, out, lse)
    keywords = config.keywords(sigmas)
    padded = _pad_rows(q, rows)
    out = torch.empty((rows.total_k, heads, v.shape[2]), dtype=q.dtype)
    if not _core.method_has_lse(config.method):  # mean_of_outputs: its backward reads no lse
        _core.multihead_attention_varlen(_kernel_view(padded), _kernel_view(k), _kernel_view(v), rows.cu_k, rows.cu_k,
                                         out=_kernel_view(out), precision=config.precision, **keywords)
        return _unpad_rows(out, rows), None, (padded, out, None)
    lse = torch.empty((heads, rows.total_k), dtype=_lse_dtype(q))
    _core.multihead_attention_with_lse(_kernel_view(padded), _kernel_view(k), _kernel_view(v), out=_kernel_view(out),
                                       lse=lse.numpy(), cu_seqlens=rows.cu_k, precision=config.precision, **keywords)
    return _unpad_rows(out, rows), _unpad_lse(lse, rows), (padded, out, lse)


def _backward_group(q, k, v, rows, sigmas, config, saved, dout, slopes_grad):
    """(dq, dk, dv, dslopes or None) of the packed sequences from their forward's saved tensors
    (gradients in _lse_dtype(q): float32 for half-precision q, k, v, out and dout; dslopes one
    per entry of sigmas)."""
    heads = q.shape[1]
    if saved is None:  # no keys or no queries
        return tuple(torch.zeros(x.shape, dtype=_lse_dtype(x)) for x in (q, k, v)) + (
            np.zeros(len(sigmas)) if slopes_grad else None,)
    if _shifted(rows, config):
        return _shifted_backward(q, k, v, rows, sigmas, config, saved[1], saved[2], dout, slopes_grad)
    padded, out, lse = saved
    dout_padded = _pad_rows(dout, rows)
    if lse is None:  # a method without lse (mean_of_outputs): its backward does not read it
        lse = torch.empty((heads, rows.total_k), dtype=_lse_dtype(q))
    dq, dk, dv = (torch.empty(x.shape, dtype=lse.dtype) for x in (padded, k, v))
    extra = {}
    dslopes = None
    if slopes_grad:
        dslopes = np.zeros(len(sigmas))  # per query head, or per sequence and query head
        extra["dslopes"] = dslopes
    _core.multihead_attention_backward(_kernel_view(padded), _kernel_view(k), _kernel_view(v), _kernel_view(out),
                                       lse.numpy(), _kernel_view(dout_padded), dq=dq.numpy(), dk=dk.numpy(),
                                       dv=dv.numpy(), cu_seqlens=rows.cu_k, precision=config.precision,
                                       **config.keywords(sigmas), **extra)
    return _unpad_rows(dq, rows), dk, dv, dslopes


def _shifted(rows, config):
    """Whether a training call keeps its query rows as _forward computes them (no padding to the
    key positions), its backward taking them as they are (_shifted_backward): a non-causal
    call with a sequence of more queries than keys (its first rows sit before the first key), and
    a call with fewer queries than keys in some sequence and none with more under a method with
    a slice backward (every method but mean_of_outputs: it reads the m rows at their positions,
    where the padded call would run L)."""
    if rows.self_attention:
        return False
    if not rows.all_valid:
        return not config.causal
    return config.method in _SLICE_BACKWARD


def _library_slice_backward(rows, config):
    """Whether the library's packed slice backward takes a _shifted call: a method with one whose
    queries may sit anywhere (the exact methods, which take a window) or, for the LSH methods
    (whose counts of a slice need its queries among its keys), no sequence with more queries
    than keys."""
    return config.method in _SLICE_BACKWARD and (rows.all_valid or config.method in _TAKES_WINDOW)


def _shifted_backward(q, k, v, rows, sigmas, config, out, lse, dout, slopes_grad):
    """(dq, dk, dv, dslopes or None) of a _shifted call from its out and lse. Where the library
    takes it (_library_slice_backward): one call of the packed slice backward
    (multihead_attention_backward with cu_seqlens and cu_seqlens_k: each sequence's slice at its
    bottom-right offsets; dslopes included). Otherwise: the self-attention backward of each sequence padded to max(m, L) tokens, queries and
    keys at the end (query row i at position max(0, L - m) + i, key j at max(0, m - L) + j), the
    padding rows zero: a zero key adds nothing to dq and the real keys' P_ij are read from the
    real lse, so dq, dk, dv are the slice's."""
    heads = q.shape[1]
    keywords = config.keywords(sigmas)
    dslopes = np.zeros(len(sigmas)) if slopes_grad else None
    if _library_slice_backward(rows, config):  # the library writes every row of dq, dk, dv
        dq, dk, dv = (torch.empty(x.shape, dtype=lse.dtype) for x in (q, k, v))
        extra = {"dslopes": dslopes} if slopes_grad else {}
        _core.multihead_attention_backward(
            _kernel_view(q), _kernel_view(k), _kernel_view(v), _kernel_view(out), lse.numpy(), _kernel_view(dout),
            cu_seqlens=rows.cu_q.astype(np.int32), cu_seqlens_k=rows.cu_k, dq=dq.numpy(), dk=dk.numpy(),
            dv=dv.numpy(), precision=config.precision, **keywords, **extra)
        return dq, dk, dv, dslopes
    m, lengths = rows.m, rows.lengths
    n = np.maximum(m, lengths)
    cu_n = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    total = int(cu_n[-1])

    def targets(counts, cu):  # each token's row in the padded sequences (at their end)
        seq = np.repeat(np.arange(len(counts)), counts)
        return cu_n[:-1][seq] + (n - counts)[seq] + np.arange(int(counts.sum())) - cu[:-1][seq]

    q_rows, k_rows = targets(m, rows.cu_q.astype(np.int64)), targets(lengths, rows.cu_k.astype(np.int64))
    q_all, k_all = np.arange(rows.total_q), np.arange(rows.total_k)
    padded_q, padded_out, padded_dout = (_moved_rows(x, total, q_rows, q_all) for x in (q, out, dout))
    padded_k, padded_v = (_moved_rows(x, total, k_rows, k_all) for x in (k, v))
    padded_lse = torch.zeros((heads, total), dtype=lse.dtype)  # padding queries: zero rows, zero dout
    padded_lse[:, _index(q_rows)] = lse
    grads = [torch.empty(x.shape, dtype=lse.dtype) for x in (padded_q, padded_k, padded_v)]
    _core.multihead_attention_backward(_kernel_view(padded_q), _kernel_view(padded_k), _kernel_view(padded_v),
                                       _kernel_view(padded_out), padded_lse.numpy(), _kernel_view(padded_dout),
                                       dq=grads[0].numpy(), dk=grads[1].numpy(), dv=grads[2].numpy(),
                                       cu_seqlens=cu_n.astype(np.int32), precision=config.precision, **keywords)
    return (grads[0].index_select(0, _index(q_rows)), grads[1].index_select(0, _index(k_rows)),
            grads[2].index_select(0, _index(k_rows)), dslopes)


def _call_sigmas(config, batch, heads):
    """The sigmas of a call: one per query head ((nheads,) slopes or None), or one per sequence
    and query head, sequence-major ((batch, nheads) slopes: the library's sigmas of a packed
    batch)."""
    values = config.slope_values
    if values is None or not config.slopes_per_row:
        return _sigmas(values, heads)
    return [sigma for b in range(batch) for sigma in _sigmas(values[b], heads)]


def _training_compute(q, k, v, cu_q, cu_k, config):
    """The training forward of every sequence (_training_forward): out, lse (float32 (H, total_q)
    or None) and the state of the backward."""
    sigmas = _call_sigmas(config, len(cu_q) - 1, q.shape[1])
    rows = _Rows(cu_q, cu_k)
    out, lse, saved = _training_forward(q, k, v, rows, sigmas, config)
    return out, None if lse is None else lse.float(), (rows, sigmas, saved)


def _gradients(q, k, v, state, config, dout, slopes, slopes_grad):
    rows, sigmas, saved = state
    dq, dk, dv, dslopes = _backward_group(q, k, v, rows, sigmas, config, saved, dout, slopes_grad)
    if slopes_grad:  # (nheads,): summed over the sequences; (batch, nheads): per sequence
        dslopes = dslopes.reshape(tuple(slopes.shape))
    return dq, dk, dv, dslopes


def _widen(x):
    return x.float() if x.dtype in _HALF else x


def _saved_lse(state, q):
    """The lse the backward reads, from a training forward's state (_training_compute): one
    entry per query row, (nheads, total_q) in _lse_dtype(q), +inf for rows without a key position;
    empty when there are no keys or no queries, or for a method without lse (mean_of_outputs)."""
    rows, _, saved = state
    if saved is None or saved[2] is None:
        return q.new_empty((0,), dtype=_lse_dtype(q))
    return saved[2] if saved[0] is None else _unpad_lse(saved[2], rows)


def _pad_lse(lse, rows):
    """The inverse of _unpad_lse: (nheads, total_k), +inf at the key positions without a query
    (their probabilities exp(x - lse) are 0)."""
    return lse if rows.self_attention else _moved_lse(lse, rows.total_k, rows.dst, rows.src)


def _packed_gradients(dout, q, k, v, out, saved_lse, cu_q, cu_k, slopes, config, recompute, slopes_grad):
    """(dq, dk, dv, dslopes or None) of packed sequences (the varlen form; float32 gradients of
    half-precision q, k, v, read in place), from the training forward's out and saved_lse
    (_saved_lse). The backward reads the rows at their key positions (_pad_rows, _pad_lse): the
    positions without a query get a zero query, a zero incoming gradient and probability 0, so
    they add exactly zero to every gradient. When some rows have no key position (a non-causal
    call with more queries than keys) the state stays per query row. With recompute (a forward
    run without its state, e.g. one recorded by torch.jit.trace without gradients) the training
    forward runs again first."""
    if recompute:
        _, _, state = _training_compute(q, k, v, cu_q, cu_k, config)
    else:
        rows = _Rows(cu_q, cu_k)
        saved = None
        if rows.total_k and rows.total_q:
            lse = saved_lse if saved_lse.numel() else None
            if _shifted(rows, config):
                saved = (None, out, lse)
            else:
                saved = (_pad_rows(q, rows), _pad_rows(out, rows), None if lse is None else _pad_lse(lse, rows))
        state = (rows, _call_sigmas(config, len(cu_q) - 1, q.shape[1]), saved)
    return _gradients(q, k, v, state, config, dout.to(q.dtype), slopes, slopes_grad)


# The operators. ----------------------------------------------------------------------------


def _prepare(function, q, k, v, slopes, m, lengths, softmax_scale, causal, window_left, window_right, method,
             samples, seed, band_error, precision, batch, same_dtypes=True):
    """Checks shared by the three calls (m, lengths: the query and key counts of the sequences,
    numpy arrays); returns the config."""
    heads, _ = _check_heads(function, q, k, v)
    if same_dtypes:
        _check_dtypes(function, q, k, v)
    slope_values = _slopes(function, slopes, batch, heads)
    if slopes is not None and slope_values is None and q.device.type != "meta":
        _fail(function, "alibi_slopes", f"is on {slopes.device} while q is on {q.device}: must be a CPU tensor")
    # The values of method, samples, seed, band_error, softmax_scale and precision are the
    # library's to check (samples for the methods that draw hashes, band_error for exact_banded);
    # only the short method names are this module's.
    method = _method(function, method)
    left, right = int(window_left), int(window_right)  # converted by the public call (_window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    config = _Config(method, scale, bool(causal), left, right, samples, seed, band_error, precision)
    config.slope_values = slope_values
    config.slopes_per_row = slopes is not None and slopes.dim() == 2
    if not causal and not _core.method_has_lse(method) and bool((m > lengths).any()):
        b = int(np.nonzero(m > lengths)[0][0])
        _fail(function, "method", f"is {method!r} with seqlen_q {int(m[b])} > seqlen_k {int(lengths[b])} (sequence {b}, "
              "not causal): keys before the first query are computed as a slice with its log-sum-exp, which this "
              "method has not (every other method computes it)")
    if slopes is not None and slopes.requires_grad and torch.is_grad_enabled():
        _check_slope_gradients(function, config.method)
    return config


def _flash_lse(lse):
    """lse in FlashAttention-2's convention, in place: +inf for the rows that see no key, where
    the library writes -inf."""
    return lse.masked_fill_(lse == -math.inf, math.inf)


def _forward(q, k, v, cu_q, cu_k, config, want_lse):
    """out (total_q, H, d_v) in q's dtype and lse (H, total_q; empty unless want_lse) of packed
    sequences, without autograd state: one library call, multihead_attention_varlen (with lse:
    multihead_attention_with_lse), which places the rows of a sequence with more queries than
    keys as FlashAttention-2 does. Tensors of one dtype are read in place (half precision: the
    half-precision kernels under config.precision, lse float32); otherwise (a float32 query over
    a half-precision cache) float32 copies. lse in _lse_dtype of the inputs read, +inf for the
    rows that see no key (_flash_lse)."""
    dtype = q.dtype
    if not dtype == k.dtype == v.dtype:
        q, k, v = (_widen(x) for x in (q, k, v))
    q, k, v = (x.detach() for x in (q, k, v))
    heads, total_q = q.shape[1], q.shape[0]
    lse_shape = (heads, total_q) if want_lse else (0,)
    if total_q == 0 or k.shape[0] == 0:
        return q.new_zeros((total_q, heads, v.shape[2]), dtype=dtype), torch.full(lse_shape, math.inf,
                                                                                  dtype=_lse_dtype(q))
    out = torch.empty((total_q, heads, v.shape[2]), dtype=q.dtype)
    lse = torch.empty(lse_shape, dtype=_lse_dtype(q))
    views = [_kernel_view(x) for x in (q, k, v)]
    keywords = config.keywords(_call_sigmas(config, len(cu_q) - 1, heads))
    cu_q, cu_k = (np.asarray(cu, dtype=np.int32) for cu in (cu_q, cu_k))
    if want_lse:
        _core.multihead_attention_with_lse(*views, out=_kernel_view(out), lse=lse.numpy(), cu_seqlens=cu_q,
                                           cu_seqlens_k=cu_k, precision=config.precision, **keywords)
        _flash_lse(lse)
    else:
        _core.multihead_attention_varlen(*views, cu_q, cu_k, out=_kernel_view(out), precision=config.precision,
                                         **keywords)
    return out.to(dtype), lse


def _packed_training(q, k, v, cu_q, cu_k, config, want_lse, training):
    """out and lse (empty unless want_lse) of packed sequences by the forward the backward reads
    (q, k, v of one dtype read in place, half precision by the half-precision forward with lse),
    its _saved_lse appended to the list `training`."""
    out, lse, state = _training_compute(q.detach(), k.detach(), v.detach(), cu_q, cu_k, config)
    training.append(_saved_lse(state, q))
    if not want_lse or lse is None:
        lse = out.new_empty((0,), dtype=torch.float32)
    return out.to(q.dtype), lse


def _dense_cu(batch, seqlen):
    return np.arange(batch + 1, dtype=np.int64) * seqlen


def _flash_attn_impl(q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right, method, samples, seed,
                     band_error, return_lse, precision="matrix_units", training=None):
    function = "flash_attn_func"
    _tensor(function, q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    _tensor(function, k, "k", 4, "(batch, seqlen_k, nheads_k, headdim)")
    _tensor(function, v, "v", 4, "(batch, seqlen_k, nheads_k, headdim)")
    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    if k.shape[0] != batch:
        _fail(function, "k", f"has batch {k.shape[0]}: must equal q's batch {batch}")
    if v.shape[0] != batch:
        _fail(function, "v", f"has batch {v.shape[0]}: must equal q's batch {batch}")
    seqlen_k = k.shape[1]
    cu_q, cu_k = _dense_cu(batch, seqlen_q), _dense_cu(batch, seqlen_k)
    config = _prepare(function, q, k, v, alibi_slopes, cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1], softmax_scale,
                      causal, window_left, window_right, method, samples, seed, band_error, precision, batch)
    if return_lse and not _core.method_has_lse(config.method):
        _fail(function, "return_attn_probs", f"is True: method {config.method!r} has no softmax_lse")
    if q.device.type == "meta":
        return _meta_out(q, v, (batch, seqlen_q, heads), (batch, heads, seqlen_q), return_lse)
    flat = [x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:])) for x in (q, k, v)]
    if training is None:
        out, lse = _forward(*flat, cu_q, cu_k, config, return_lse)
    else:
        out, lse = _packed_training(*flat, cu_q, cu_k, config, return_lse, training)
    out = out.reshape(batch, seqlen_q, heads, v.shape[3])
    if return_lse:
        lse = lse.float().reshape(heads, batch, seqlen_q).transpose(0, 1).contiguous()
    return out, lse


def _meta_out(q, v, out_shape, lse_shape, return_lse):
    out = q.new_empty(tuple(out_shape) + (v.shape[-1],))
    lse = q.new_empty(lse_shape if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _flash_attn_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, causal, window_left,
                            window_right, method, samples, seed, band_error, return_lse, precision="matrix_units",
                            training=None):
    function = "flash_attn_varlen_func"
    _tensor(function, q, "q", 3, "(total_q, nheads, headdim)")
    _tensor(function, k, "k", 3, "(total_k, nheads_k, headdim)")
    _tensor(function, v, "v", 3, "(total_k, nheads_k, headdim)")
    if q.device.type == "meta":
        _check_heads(function, q, k, v)
        return _meta_out(q, v, (q.shape[0], q.shape[1]), (q.shape[1], q.shape[0]), return_lse)
    cu_q = _cu_seqlens(function, cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = _cu_seqlens(function, cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if len(cu_q) != len(cu_k):
        _fail(function, "cu_seqlens_k", f"has {len(cu_k)} entries: must have as many as cu_seqlens_q ({len(cu_q)})")
    config = _prepare(function, q, k, v, alibi_slopes, cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1], softmax_scale,
                      causal, window_left, window_right, method, samples, seed, band_error, precision,
                      len(cu_q) - 1)
    if return_lse and not _core.method_has_lse(config.method):
        _fail(function, "return_attn_probs", f"is True: method {config.method!r} has no softmax_lse")
    if training is None:
        out, lse = _forward(q, k, v, cu_q, cu_k, config, return_lse)
        return out, lse.float()
    return _packed_training(q, k, v, cu_q, cu_k, config, return_lse, training)


# flash_attn_with_kvcache. -------------------------------------------------------------------


def _cache_positions(function, cache_seqlens, batch, capacity, new):
    """The cache lengths before the append, int64 numpy (batch,), checked against the capacity."""
    if cache_seqlens is None:
        if new:
            _fail(function, "cache_seqlens", "is None while k, v are given: the append position is needed")
        return np.full(batch, capacity, dtype=np.int64)
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        lengths = np.full(batch, int(cache_seqlens), dtype=np.int64)
    elif isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype not in (torch.int32, torch.int64):
            _fail(function, "cache_seqlens", f"has dtype {cache_seqlens.dtype}: must be torch.int32", TypeError)
        if tuple(cache_seqlens.shape) != (batch,):
            _fail(function, "cache_seqlens", f"has shape {tuple(cache_seqlens.shape)}: must be (batch,) = ({batch},)")
        lengths = cache_seqlens.detach().cpu().numpy().astype(np.int64)
    else:
        _fail(function, "cache_seqlens", f"must be an int or an int32 tensor, got {type(cache_seqlens).__name__}",
              TypeError)
    if bool((lengths < 0).any()):
        _fail(function, "cache_seqlens", f"is {lengths.tolist()}: must be >= 0")
    if bool((lengths + new > capacity).any()):
        b = int(np.nonzero(lengths + new > capacity)[0][0])
        _fail(function, "cache_seqlens", f"is {int(lengths[b])} at batch row {b}: with {new} appended tokens the cache "
              f"of {capacity} tokens per sequence is too small")
    return lengths


def _flash_attn_with_kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                                  softmax_scale, causal, window_left, window_right, method, samples, seed, band_error,
                                  return_lse, precision="matrix_units"):
    function = "flash_attn_with_kvcache"
    _tensor(function, q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    paged = block_table is not None
    cache_text = ("(num_blocks, block_size, nheads_k, headdim)" if paged
                  else "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _tensor(function, k_cache, "k_cache", 4, cache_text)
    _tensor(function, v_cache, "v_cache", 4, cache_text)
    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    heads, heads_k = _check_heads(function, q, k_cache, v_cache)
    if v_cache.dtype != k_cache.dtype:
        _fail(function, "v_cache", f"has dtype {v_cache.dtype}: must equal k_cache's dtype {k_cache.dtype}", TypeError)
    if q.dtype != k_cache.dtype and not (q.dtype == torch.float32 and k_cache.dtype in _HALF):
        _fail(function, "k_cache", f"has dtype {k_cache.dtype}: must equal q's dtype {q.dtype} (or be bfloat16/float16 "
              "under float32 queries)", TypeError)
    if (k is None) != (v is None):
        _fail(function, "v" if v is None else "k", "must be given together with " + ("k" if v is None else "v"))
    new = 0
    if k is not None:
        _tensor(function, k, "k", 4, "(batch, seqlen_new, nheads_k, headdim)")
        _tensor(function, v, "v", 4, "(batch, seqlen_new, nheads_k, headdim)")
        for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if x.dtype != cache.dtype:
                _fail(function, name, f"has dtype {x.dtype}: must equal the cache's dtype {cache.dtype}", TypeError)
            if x.shape[0] != batch or x.shape[2:] != cache.shape[2:] or x.shape[1] != k.shape[1]:
                _fail(function, name, f"has shape {tuple(x.shape)}: must be (batch, seqlen_new, nheads_k, headdim) = "
                      f"({batch}, {k.shape[1]}, {cache.shape[2]}, {cache.shape[3]})")
        new = k.shape[1]
    if cache_batch_idx is not None and paged:
        _fail(function, "cache_batch_idx", "is given with block_table: a paged cache is indexed by block_table")
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            _fail(function, "block_table", "must be an int32 torch.Tensor (batch, max_num_blocks)", TypeError)
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            _fail(function, "block_table", f"has shape {tuple(block_table.shape)}: must be "
                  f"(batch, max_num_blocks) with batch {batch}")
        block_size = k_cache.shape[1]
        capacity = block_table.shape[1] * block_size
        rows_of = None
    else:
        if cache_batch_idx is not None:
            if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype not in (torch.int32, torch.int64):
                _fail(function, "cache_batch_idx", "must be an int32 torch.Tensor (batch,)", TypeError)
            if tuple(cache_batch_idx.shape) != (batch,):
                _fail(function, "cache_batch_idx", f"has shape {tuple(cache_batch_idx.shape)}: must be ({batch},)")
            rows_of = cache_batch_idx.detach().cpu().numpy().astype(np.int64)
            if bool(((rows_of < 0) | (rows_of >= k_cache.shape[0])).any()):
                _fail(function, "cache_batch_idx",
                      f"is {rows_of.tolist()}: entries must lie in [0, {k_cache.shape[0]})")
        else:
            if k_cache.shape[0] != batch:
                _fail(function, "k_cache", f"has batch {k_cache.shape[0]}: must equal q's batch {batch}")
            rows_of = np.arange(batch)
        capacity = k_cache.shape[1]
    lengths = _cache_positions(function, cache_seqlens, batch, capacity, new)
    total = lengths + new
    if paged:
        table = block_table.detach().cpu().numpy()
        # The pages the sequences use after the append, checked before anything is written.
        used = np.arange(table.shape[1])[None, :] * block_size < total[:, None]
        bad = used & ((table < 0) | (table >= k_cache.shape[0]))
        if bool(bad.any()):
            _fail(function, "block_table", f"holds block {int(table[bad][0])} for a used position: entries must lie "
                  f"in [0, num_blocks = {k_cache.shape[0]})")
    config = _prepare(function, q, k_cache, v_cache, alibi_slopes, np.full(batch, seqlen_q), total, softmax_scale,
                      causal, window_left, window_right, method, samples, seed, band_error, precision, batch,
                      same_dtypes=False)
    if return_lse and not _core.method_has_lse(config.method):
        _fail(function, "return_softmax_lse", f"is True: method {config.method!r} has no softmax_lse")
    if q.device.type == "meta":
        return _meta_out(q, v_cache, (batch, seqlen_q, heads), (batch, heads, seqlen_q), return_lse)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):  # read and written in place
        if cache.shape[-1] > 1 and cache.stride(-1) != 1 or any(
                cache.shape[axis] > 1 and cache.stride(axis) <= 0 for axis in range(3)):
            _fail(function, name, f"has strides {cache.stride()}: the last axis must be contiguous and the others "
                  "have positive strides (the cache is read and written in place)")
    if new:
        _append(k_cache, v_cache, k, v, table if paged else rows_of, paged, cache_batch_idx is None, lengths)
    # A contiguous cache is the paged cache of one page (its row) per sequence.
    if not paged:
        table = np.asarray(rows_of, dtype=np.int32).reshape(batch, 1)
    table = np.ascontiguousarray(table, dtype=np.int32)
    return _cache_attention(q, k_cache, v_cache, table, total, config, return_lse)


def _append(k_cache, v_cache, k, v, rows, paged, in_order, lengths):
    """Writes k, v (batch, seqlen_new, nheads_k, headdim) into the cache tensors in place (any
    strides, e.g. views of a packed kv cache) at positions lengths[b] .. of each sequence: of its
    cache row rows[b] (contiguous), or of the pages of its block table row rows[b] (paged)."""
    batch, new = k.shape[0], k.shape[1]
    with torch.no_grad():
        if paged:
            block_size = k_cache.shape[1]
            position = lengths[:, None] + np.arange(new)[None, :]  # (batch, new)
            pages = np.take_along_axis(rows.astype(np.int64), position // block_size, axis=1)
            page, row = _index(pages.reshape(-1)), _index((position % block_size).reshape(-1))
            for cache, x in ((k_cache, k), (v_cache, v)):
                cache[page, row] = x.detach().reshape((-1,) + tuple(x.shape[2:]))
        elif in_order and batch and bool((lengths == lengths[0]).all()):
            start = int(lengths[0])
            k_cache.narrow(1, start, new).copy_(k.detach())
            v_cache.narrow(1, start, new).copy_(v.detach())
        else:
            for b in range(batch):
                row, start = int(rows[b]), int(lengths[b])
                k_cache[row].narrow(0, start, new).copy_(k[b].detach())
                v_cache[row].narrow(0, start, new).copy_(v[b].detach())


def _cache_view(cache):
    """A cache tensor as the kernels read it in place: a numpy view (bfloat16: poslsh.BFloat16Bits
    over its int16 view)."""
    cache = cache.detach()
    if cache.dtype == torch.bfloat16:
        return _core.BFloat16Bits(cache.view(torch.int16).numpy())
    return cache.numpy()


def _cache_attention(q, k_pages, v_pages, table, lengths, config, want_lse):
    """flash_attn_with_kvcache's attention after the append: q (batch, seqlen_q, nheads, d) over
    the lengths[b] tokens of sequence b of the paged cache k_pages, v_pages (num_pages,
    page_size, nheads_k, d) with block table `table` (int32 numpy (batch, max_pages)), in one
    multihead_attention_paged call that reads q and the caller's cache tensors in place (q and a
    half-precision cache of one dtype on the unit config.precision selects; a float32 query over
    a half-precision cache in float32). The library places the rows of a sequence with more
    queries than cached tokens as flash_attn_varlen_func's (causal: out 0 and softmax_lse +inf
    for the rows before the first key)."""
    batch, seqlen_q, heads, d = q.shape
    out = torch.empty((batch, seqlen_q, heads, v_pages.shape[3]), dtype=q.dtype)
    cu_q = (np.arange(batch + 1) * seqlen_q).astype(np.int32)
    arguments = (_kernel_view(q.detach().reshape(batch * seqlen_q, heads, d)), _cache_view(k_pages),
                 _cache_view(v_pages), table, lengths.astype(np.int32), cu_q)
    keywords = config.keywords(_call_sigmas(config, batch, heads))
    rows_out = _kernel_view(out.view(batch * seqlen_q, heads, -1))
    if not want_lse:
        _core.multihead_attention_paged(*arguments, out=rows_out, precision=config.precision, **keywords)
        return out, out.new_empty((0,), dtype=torch.float32)
    _, lse = _core.multihead_attention_paged_with_lse(*arguments, out=rows_out, precision=config.precision,
                                                      **keywords)
    lse = _flash_lse(torch.from_numpy(lse).float())
    return out, lse.reshape(heads, batch, seqlen_q).transpose(0, 1).contiguous()


# Registration. ------------------------------------------------------------------------------
#
# Each call is a torch.library custom operator (namespace poslsh) with a fake implementation
# (output shapes and dtypes, for FakeTensor, meta tensors and torch.compile) and, for the
# differentiable ones, an autograd formula whose backward is an operator too, so a compiled
# graph calls it. The implementations check the arguments (with the library's validator).
#
#   flash_attn, flash_attn_varlen               forward; differentiable (the backward runs the
#                                               training forward again: the state is not kept)
#   flash_attn_train, flash_attn_varlen_train   forward that also returns the lse the backward
#                                               reads: what the public calls use when autograd
#                                               records
#   flash_attn_varlen_backward                  dq, dk, dv, d alibi_slopes of both forms
#   flash_attn_with_kvcache                     writes k_cache, v_cache (mutates_args); no gradients

_torch_version.require("poslsh.flash")

_EXTRAS = ("Tensor? alibi_slopes, float? softmax_scale, bool causal, int window_left, int window_right, "
           "str method, int samples, int seed, float band_error, bool return_lse, str precision=\"matrix_units\"")
_VARLEN_ARGS = "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k"


def _fake_heads(function, q, k, v, slopes, ndim, layout):
    """The checks of the shapes and devices only (FakeTensor and meta tensors carry no values):
    q, k, v of `ndim` dimensions, their heads, slopes on q's device; returns nheads."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _tensor(function, x, name, ndim, layout.replace("@", "q" if name == "q" else "k"))
    heads, _ = _check_heads(function, q, k, v)
    if slopes is not None and slopes.device != q.device:
        _fail(function, "alibi_slopes", f"is on {slopes.device} while q is on {q.device}: must be a CPU tensor")
    return heads


def _fake_saved_lse(q, method, total_q, total_k):
    """The shape of _saved_lse for a call on (total_q, nheads) queries and total_k keys."""
    if total_q == 0 or total_k == 0 or not _core.method_has_lse(_method("flash_attn_func", method)):
        return q.new_empty((0,), dtype=_lse_dtype(q))
    return q.new_empty((q.shape[-2], total_q), dtype=_lse_dtype(q))


def _flash_attn_fake(q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right, method, samples, seed,
                     band_error, return_lse, precision="matrix_units"):
    heads = _fake_heads("flash_attn_func", q, k, v, alibi_slopes, 4, "(batch, seqlen_@, nheads, headdim)")
    batch, seqlen_q = q.shape[0], q.shape[1]
    return _meta_out(q, v, (batch, seqlen_q, heads), (batch, heads, seqlen_q), return_lse)


def _flash_attn_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, causal, window_left,
                            window_right, method, samples, seed, band_error, return_lse, precision="matrix_units"):
    heads = _fake_heads("flash_attn_varlen_func", q, k, v, alibi_slopes, 3, "(total_@, nheads, headdim)")
    return _meta_out(q, v, (q.shape[0], heads), (heads, q.shape[0]), return_lse)


def _unaliased(lse, saved_lse):
    """lse, copied when it shares memory with saved_lse (an operator's outputs never alias)."""
    if lse.numel() and saved_lse.numel() and lse.untyped_storage().data_ptr() == \
            saved_lse.untyped_storage().data_ptr():
        return lse.clone()
    return lse


def _flash_attn_train_impl(*args):
    training = []
    out, lse = _flash_attn_impl(*args, training=training)
    return out, _unaliased(lse, training[0]), training[0]


def _flash_attn_varlen_train_impl(*args):
    training = []
    out, lse = _flash_attn_varlen_impl(*args, training=training)
    return out, _unaliased(lse, training[0]), training[0]


def _flash_attn_train_fake(q, k, v, *args):
    out, lse = _flash_attn_fake(q, k, v, *args)
    method = args[5]
    return out, lse, _fake_saved_lse(q, method, q.shape[0] * q.shape[1], k.shape[0] * k.shape[1])


def _flash_attn_varlen_train_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    out, lse = _flash_attn_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
    method = args[5]
    return out, lse, _fake_saved_lse(q, method, q.shape[0], k.shape[0])


def _flash_backward_impl(dout, q, k, v, out, saved_lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale,
                         causal, window_left, window_right, method, samples, seed, band_error, precision, recompute,
                         slopes_grad):
    function = "flash_attn_varlen_func"
    cu_q = _cu_seqlens(function, cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = _cu_seqlens(function, cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    lengths = cu_k[1:] - cu_k[:-1]
    config = _prepare(function, q, k, v, alibi_slopes, cu_q[1:] - cu_q[:-1], lengths, softmax_scale, causal,
                      window_left, window_right, method, samples, seed, band_error, precision, len(cu_q) - 1)
    slopes_grad = bool(slopes_grad) and alibi_slopes is not None
    if slopes_grad:
        _check_slope_gradients(function, config.method)
    dq, dk, dv, dslopes = _packed_gradients(dout, q, k, v, out, saved_lse, cu_q, cu_k, alibi_slopes, config,
                                            recompute, slopes_grad)
    dslopes = torch.from_numpy(dslopes).to(alibi_slopes.dtype) if slopes_grad else \
        q.new_empty((0,), dtype=torch.float32)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dslopes


def _flash_backward_fake(dout, q, k, v, out, saved_lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, *args):
    slopes_grad = args[-1] and alibi_slopes is not None
    dslopes = alibi_slopes.new_empty(alibi_slopes.shape) if slopes_grad else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dslopes


def _flash_setup_context(ctx, inputs, output):
    """Saves what the backward needs: q, k, v, out, the saved lse (the _train forms) or nothing
    (the backward runs the training forward again), the slopes and the options."""
    ctx.dense = len(inputs) == 14
    q, k, v = inputs[:3]
    cu = (None, None) if ctx.dense else inputs[3:5]
    slopes = inputs[3 if ctx.dense else 5]
    ctx.options = tuple(inputs[4 if ctx.dense else 6:-2]) + (inputs[-1],)  # softmax_scale .. band_error, precision
    ctx.recompute = len(output) == 2
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(q, k, v, output[0], None if ctx.recompute else output[2], slopes, *cu)


def _flash_backward(ctx, dout, *_):
    q, k, v, out, saved_lse, slopes, cu_q, cu_k = ctx.saved_tensors
    shapes = q.shape, k.shape, v.shape
    if ctx.dense:  # the varlen form of equal-length sequences
        batch = q.shape[0]
        cu_q = torch.arange(batch + 1, dtype=torch.int32) * q.shape[1]
        cu_k = torch.arange(batch + 1, dtype=torch.int32) * k.shape[1]
        q, k, v, out, dout = (x.reshape((-1,) + tuple(x.shape[2:])) for x in (q, k, v, out, dout))
    if saved_lse is None:
        saved_lse = q.new_empty((0,), dtype=_lse_dtype(q))
    slopes_grad = slopes is not None and ctx.needs_input_grad[3 if ctx.dense else 5]
    dq, dk, dv, dslopes = torch.ops.poslsh.flash_attn_varlen_backward(
        dout, q, k, v, out, saved_lse, cu_q, cu_k, slopes, *ctx.options, ctx.recompute, slopes_grad)
    dq, dk, dv = (g.reshape(shape) for g, shape in zip((dq, dk, dv), shapes))
    slope_gradient = (dslopes if slopes_grad else None,)
    if ctx.dense:
        return (dq, dk, dv) + slope_gradient + (None,) * 10
    return (dq, dk, dv, None, None) + slope_gradient + (None,) * 10


def _with_kvcache_impl(*args):
    with torch.no_grad():
        return _flash_attn_with_kvcache_impl(*args)


def _with_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                       softmax_scale, causal, window_left, window_right, method, samples, seed, band_error, return_lse,
                       precision="matrix_units"):
    function = "flash_attn_with_kvcache"
    heads = _fake_heads(function, q, k_cache, v_cache, alibi_slopes, 4, "(batch, seqlen_@, nheads, headdim)")
    return _meta_out(q, v_cache, (q.shape[0], q.shape[1], heads), (q.shape[0], heads, q.shape[1]), return_lse)


def _define(name, schema, impl, fake, mutates_args=()):
    op = torch.library.custom_op(f"poslsh::{name}", impl, mutates_args=mutates_args, schema=schema)
    op.register_fake(fake)
    return op


for _op in (_define("flash_attn", f"(Tensor q, Tensor k, Tensor v, {_EXTRAS}) -> (Tensor, Tensor)", _flash_attn_impl,
                    _flash_attn_fake),
            _define("flash_attn_varlen", f"({_VARLEN_ARGS}, {_EXTRAS}) -> (Tensor, Tensor)", _flash_attn_varlen_impl,
                    _flash_attn_varlen_fake),
            _define("flash_attn_train", f"(Tensor q, Tensor k, Tensor v, {_EXTRAS}) -> (Tensor, Tensor, Tensor)",
                    _flash_attn_train_impl, _flash_attn_train_fake),
            _define("flash_attn_varlen_train", f"({_VARLEN_ARGS}, {_EXTRAS}) -> (Tensor, Tensor, Tensor)",
                    _flash_attn_varlen_train_impl, _flash_attn_varlen_train_fake)):
    _op.register_autograd(_flash_backward, setup_context=_flash_setup_context)
_define("flash_attn_varlen_backward",
        f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor saved_lse, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, Tensor? alibi_slopes, float? softmax_scale, bool causal, int window_left, "
        "int window_right, str method, int samples, int seed, float band_error, str precision, bool recompute, "
        "bool slopes_grad) -> (Tensor, Tensor, Tensor, Tensor)", _flash_backward_impl, _flash_backward_fake)
_define("flash_attn_with_kvcache",
        "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
        f"Tensor? cache_batch_idx, Tensor? block_table, {_EXTRAS}) -> (Tensor, Tensor)", _with_kvcache_impl,
        _with_kvcache_fake, mutates_args=("k_cache", "v_cache"))


def _records(*tensors):
    """Whether autograd records a call on `tensors` (grad mode on, one of them requiring grad)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)


def _forward_operator(operator, training_operator, *tensors):
    """The forward operator of a call: its training form (which also returns the state the
    backward reads, kept by autograd) when autograd records the call on `tensors`, else the
    plain form."""
    return training_operator if _records(*tensors) else operator


def _check_slope_gradients(function, method):
    """ValueError for gradients in the slopes under a method (poslsh's name) without them."""
    if method not in _SLOPE_GRADIENTS:
        _fail(function, "alibi_slopes", f"requires grad: method {method!r} samples position bins from the slopes, "
              "which are not differentiable in the slope (gradients of alibi_slopes: "
              f"{_methods.short_names(_SLOPE_GRADIENTS)})")


def _slope_gradients(function, method, slopes):
    """The methods without gradients in the slopes reject slopes that require grad while autograd
    records (only the caller sees requires_grad: an operator's forward runs without grad mode)."""
    if _records(slopes) and method in _METHODS:
        _check_slope_gradients(function, _METHODS[method])


# The public calls. ----------------------------------------------------------------------------


def _check_call(function, tensors, optional, method, samples, seed, band_error, softmax_scale, precision):
    """The argument types the operator schema would otherwise reject with a RuntimeError, and a
    seed the library's unsigned 64-bit seed holds (the schema's int is signed)."""
    for name, x in tensors:
        if not isinstance(x, torch.Tensor):
            _fail(function, name, f"must be a torch.Tensor, got {type(x).__name__}", TypeError)
    for name, x in optional:
        if x is not None and not isinstance(x, torch.Tensor):
            _fail(function, name, f"must be a torch.Tensor or None, got {type(x).__name__}", TypeError)
    _string(function, method, "method")
    _integer(function, samples, "samples")
    if _integer(function, seed, "seed", 0) >= 2**63:
        _fail(function, "seed", f"is {seed}: must be < 2**63")
    _number(function, band_error, "band_error")
    _number(function, softmax_scale, "softmax_scale", optional=True)
    _string(function, precision, "precision")


def _axis(x, axis):
    """x.shape[axis] of a tensor with that axis (0 otherwise: the operator reports the shape)."""
    return x.shape[axis] if isinstance(x, torch.Tensor) and x.dim() > axis else 0


def _causal_lse(lse, slopes, slope_rows, positions):
    """softmax_lse as FlashAttention-2 returns it for a causal call (window (-1, 0)) with ALiBi
    slopes. Its causal kernels add +slope_h * j to the scores: the bias -slope_h (P_i - j) plus
    the row constant slope_h P_i, the same softmax and out, so its lse is poslsh's plus
    slope_h * P_i, P_i = i + seqlen_k - seqlen_q the row's key position (rows without a visible
    key keep +inf). lse (..., H, rows) float32; slope_rows(s): the slopes (float64, detached)
    broadcast to lse's shape; positions: P of each row, broadcast to lse's shape. Non-causal
    calls return poslsh's lse unchanged: FlashAttention-2's non-causal bias is -slope_h |P_i - j|,
    poslsh's. The gradients never read the value returned here (the operators keep their own)."""
    if slopes is None:
        return lse
    shift = slope_rows(slopes.detach().to(device=lse.device, dtype=torch.float64)) * positions.to(lse.device)
    return (lse.double() + shift).to(lse.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, method="exact", samples=16,
                    seed=0, band_error=1e-3, precision="matrix_units"):
    """FlashAttention-2's flash_attn_func on CPU tensors (torch.ops.poslsh.flash_attn).

    q (batch, seqlen_q, nheads, headdim), k, v (batch, seqlen_k, nheads_k, headdim), nheads_k
    dividing nheads. For query row i (key position P_i = i + seqlen_k - seqlen_q) of head h:

        out_i = softmax_j(softmax_scale q_i . k_j - alibi_slopes[h] |P_i - j|) v_j

    over the keys j with P_i - left <= j <= P_i + right (window_size = (left, right), any pair
    of integers, a negative side or one >= seqlen_k unbounded; causal: j <= P_i); seqlen_q >
    seqlen_k is allowed with or without causal. Returns out (batch, seqlen_q, nheads,
    headdim_v), or with return_attn_probs (out, softmax_lse (batch, nheads, seqlen_q) float32,
    None), softmax_lse as FlashAttention-2's (causal: plus alibi_slopes[h] P_i; module
    docstring). method,
    samples, seed, band_error: poslsh's estimator (module docstring). precision:
    "matrix_units" (default) or "float_products", how bfloat16 tensors are multiplied (module
    docstring); float32 and float64 ignore it. deterministic is accepted and has no effect:
    every method is deterministic. Differentiable in q, k, v and (exact, banded)
    alibi_slopes."""
    function = "flash_attn_func"
    _unsupported(function, dropout_p, softcap)
    _check_call(function, (("q", q), ("k", k), ("v", v)), (("alibi_slopes", alibi_slopes),), method, samples, seed,
                band_error, softmax_scale, precision)
    _slope_gradients(function, method, alibi_slopes)
    seqlen_q, seqlen_k = _axis(q, 1), _axis(k, 1)
    causal, left, right = _window(function, window_size, causal, seqlen_k)
    arguments = (q, k, v, alibi_slopes, softmax_scale, bool(causal), left, right, method, samples, seed, band_error,
                 bool(return_attn_probs), precision)
    operator = _forward_operator(torch.ops.poslsh.flash_attn, torch.ops.poslsh.flash_attn_train, q, k, v,
                                 alibi_slopes)
    out, lse = operator(*arguments)[:2]
    if not return_attn_probs:
        return out
    if causal and left == -1:  # rows (batch, nheads, seqlen_q)
        positions = torch.arange(seqlen_q, dtype=torch.float64) + (seqlen_k - seqlen_q)
        lse = _causal_lse(lse, alibi_slopes, lambda m: m[..., None], positions)
    return out, lse, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, method="exact",
                           samples=16, seed=0, band_error=1e-3, precision="matrix_units"):
    """FlashAttention-2's flash_attn_varlen_func on CPU tensors
    (torch.ops.poslsh.flash_attn_varlen).

    q (total_q, nheads, headdim), k, v (total_k, nheads_k, headdim); sequence b owns query tokens
    cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 and key tokens cu_seqlens_k[b] .. cu_seqlens_k[b+1]
    - 1 (int32, batch + 1 entries from 0, non-decreasing; empty sequences allowed), attending
    only to itself with flash_attn_func's formula (bottom-right alignment per sequence).
    max_seqlen_q, max_seqlen_k: at least the longest sequence (checked). alibi_slopes (nheads,)
    or (batch, nheads). Returns out (total_q, nheads, headdim_v), or with return_attn_probs
    (out, softmax_lse (nheads, total_q) float32, None). block_table (paged keys) is not
    supported here (flash_attn_with_kvcache takes a paged cache). precision as
    flash_attn_func."""
    function = "flash_attn_varlen_func"
    _unsupported(function, dropout_p, softcap)
    if block_table is not None:
        _fail(function, "block_table", "is given: a paged varlen call is not supported (use flash_attn_with_kvcache)")
    _check_call(function,
                (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)),
                (("alibi_slopes", alibi_slopes),), method, samples, seed, band_error, softmax_scale, precision)
    # max_seqlen_k bounds the window as FlashAttention-2's (checked below).
    seqlen_k = int(max_seqlen_k) if isinstance(max_seqlen_k, (int, np.integer)) else 0
    causal, left, right = _window(function, window_size, causal, seqlen_k)
    for name, bound, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q), ("max_seqlen_k", max_seqlen_k,
                                                                           cu_seqlens_k)):
        _integer(function, bound, name, 0)
        if torch.jit.is_tracing() or torch.compiler.is_compiling():  # the bound is not recorded (the operator
            # checks the cu_seqlens; the kernels never read the bound)
            continue
        if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.shape[0] > 1 and cu.dtype == torch.int32:
            longest = int(torch.diff(cu.detach().cpu()).max())
            if longest > bound:
                _fail(function, name, f"is {bound}: a sequence has {longest} tokens")
    _slope_gradients(function, method, alibi_slopes)
    arguments = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, bool(causal), left, right, method,
                 samples, seed, band_error, bool(return_attn_probs), precision)
    operator = _forward_operator(torch.ops.poslsh.flash_attn_varlen, torch.ops.poslsh.flash_attn_varlen_train, q, k,
                                 v, alibi_slopes)
    out, lse = operator(*arguments)[:2]
    if not return_attn_probs:
        return out
    if causal and left == -1:  # rows (nheads, total_q): token t of sequence b at t - cu_q[b] + L_b - m_b
        token = torch.arange(q.shape[0])
        b = torch.searchsorted(cu_seqlens_q[1:].to(torch.int64), token, right=True)
        cu_q, cu_k = cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)
        positions = (token - cu_q[b] + (cu_k[b + 1] - cu_k[b]) - (cu_q[b + 1] - cu_q[b])).double()
        lse = _causal_lse(lse, alibi_slopes, lambda m: m[:, None] if m.dim() == 1 else m[b].t(), positions)
    return out, lse, None


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, method="exact", samples=16,
                            seed=0, band_error=1e-3, precision="matrix_units"):
    """FlashAttention-2's flash_attn_with_kvcache on CPU tensors
    (torch.ops.poslsh.flash_attn_with_kvcache); inference only (no gradients).

    When k, v (batch, seqlen_new, nheads_k, headdim) are given they are written into the cache in
    place at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1, then q
    (batch, seqlen_q, nheads, headdim) attends to the cache_seqlens[b] + seqlen_new keys of
    its row with flash_attn_func's formula (bottom-right: query i at key position
    i + seqlen_k - seqlen_q). The cache: (batch_cache, seqlen_cache, nheads_k, headdim) (row
    cache_batch_idx[b], default b), or paged (num_blocks, block_size, nheads_k, headdim) with
    block_table int32 (batch, max_num_blocks): token t of row b is row t % block_size of block
    block_table[b, t // block_size]; any strides with the last axis contiguous (e.g.
    kv_cache[:, :, 0] of a packed cache), read and written in place. Its dtype is q's, or bfloat16/float16
    under float32 q (computed in float32). cache_seqlens: int or int32 (batch,) (None: the whole
    contiguous cache, nothing appended). The attention is one call of
    poslsh.multihead_attention_paged (with _with_lse for softmax_lse) on the caller's cache
    tensors, read in place, never gathered: a paged cache through block_table, a contiguous one as
    the paged cache of one page (its cache row, cache_batch_idx[b]) per sequence; every batch row
    over its first cache_seqlens[b] + seqlen_new tokens, bitwise the call on those tokens
    gathered into a packed batch. bfloat16/float16 caches are read as they are (float32 sums;
    under float32 q, out and softmax_lse of the float32 computation on the widened cache).
    Returns out (batch, seqlen_q, nheads, headdim_v), or (out, softmax_lse (batch, nheads,
    seqlen_q) float32) with return_softmax_lse. The LSH methods (mean_of_outputs included, which
    has no softmax_lse) draw the prefill's hashes (same seed, samples, slopes): a decode step
    equals the rows of one longer prefill. precision as
    flash_attn_func: bfloat16 q over a bfloat16 cache reach the matrix unit under
    "matrix_units", and out and softmax_lse come from that one computation. rotary
    embeddings, cache_leftpad and softcap are not supported (ValueError); num_splits has no effect.
    A non-causal call with more queries than a batch row's keys (rows before the first key) is
    computed as flash_attn_varlen_func computes it, on the rows' keys gathered from the cache (a
    copy, for those calls only). softmax_lse of causal calls with slopes as FlashAttention-2's
    (module docstring); the window's sides are bounded by the cache's capacity per sequence."""
    function = "flash_attn_with_kvcache"
    _unsupported(function, 0.0, softcap)
    if rotary_cos is not None or rotary_sin is not None:
        _fail(function, "rotary_cos",
              "is given: rotary embeddings are not supported by poslsh (ALiBi models have none)")
    if cache_leftpad is not None:
        _fail(function, "cache_leftpad", "is given: left-padded caches are not supported")
    _check_call(function, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)),
                (("k", k), ("v", v), ("cache_batch_idx", cache_batch_idx), ("block_table", block_table),
                 ("alibi_slopes", alibi_slopes)), method, samples, seed, band_error, softmax_scale, precision)
    # The cache's capacity per sequence bounds the window, as FlashAttention-2's seqlen_k.
    capacity = _axis(k_cache, 1) * (_axis(block_table, 1) if block_table is not None else 1)
    causal, left, right = _window(function, window_size, causal, capacity)
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        batch = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() >= 1 else 1
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32)
    out, lse = torch.ops.poslsh.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                                        block_table, alibi_slopes, softmax_scale, causal, left,
                                                        right, method, samples, seed, band_error,
                                                        bool(return_softmax_lse), precision)
    if not return_softmax_lse:
        return out
    if causal and left == -1:  # rows (batch, nheads, seqlen_q) over total[b] = cache_seqlens[b] + seqlen_new keys
        seqlen_q = q.shape[1]
        total = (torch.full((q.shape[0],), capacity, dtype=torch.int64) if cache_seqlens is None
                 else cache_seqlens.to(torch.int64)) + (0 if k is None else k.shape[1])
        positions = (torch.arange(seqlen_q)[None, :] + (total - seqlen_q)[:, None]).double()[:, None, :]
        lse = _causal_lse(lse, alibi_slopes, lambda m: m[None, :, None] if m.dim() == 1 else m[:, :, None],
                          positions)
    return out, lse


# The packed forms. ----------------------------------------------------------------------------


def _unpacked(function, packed, name, ndim, axis, count, shape_text):
    """The `count` views packed.unbind(axis) of a packed tensor (q, k, v or k, v: views sharing its
    memory, read in place; their gradients reach the packed tensor), after checking that it is
    a CPU tensor of `ndim` dimensions with `count` entries on `axis`."""
    _tensor(function, packed, name, ndim, shape_text)
    if packed.shape[axis] != count:
        _fail(function, name, f"has shape {tuple(packed.shape)}: must be {shape_text} (axis {axis} of size {count})")
    return packed.unbind(axis)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              method="exact", samples=16, seed=0, band_error=1e-3, precision="matrix_units"):
    """FlashAttention-2's flash_attn_qkvpacked_func: flash_attn_func on q, k, v =
    qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2] of qkv (batch, seqlen, 3, nheads, headdim), views read
    in place (no copy), the gradients flowing to qkv. Arguments, keyword-only extras and returns
    as flash_attn_func."""
    function = "flash_attn_qkvpacked_func"
    q, k, v = _unpacked(function, qkv, "qkv", 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, method=method, samples=samples, seed=seed, band_error=band_error,
                           precision=precision)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             method="exact", samples=16, seed=0, band_error=1e-3, precision="matrix_units"):
    """FlashAttention-2's flash_attn_kvpacked_func: flash_attn_func on q and k, v = kv[:, :, 0],
    kv[:, :, 1] of kv (batch, seqlen_k, 2, nheads_k, headdim), views read in place (no copy), the
    gradients flowing to kv. Arguments, keyword-only extras and returns as flash_attn_func."""
    function = "flash_attn_kvpacked_func"
    k, v = _unpacked(function, kv, "kv", 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, method=method, samples=samples, seed=seed, band_error=band_error,
                           precision=precision)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, method="exact", samples=16, seed=0, band_error=1e-3,
                                     precision="matrix_units"):
    """FlashAttention-2's flash_attn_varlen_qkvpacked_func: flash_attn_varlen_func on q, k, v =
    qkv[:, 0], qkv[:, 1], qkv[:, 2] of qkv (total, 3, nheads, headdim), views read in place (no
    copy), the gradients flowing to qkv, with cu_seqlens and max_seqlen for both the queries and
    the keys (self-attention of each sequence). Arguments, keyword-only extras and returns as
    flash_attn_varlen_func."""
    function = "flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpacked(function, qkv, "qkv", 4, 1, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  method=method, samples=samples, seed=seed, band_error=band_error,
                                  precision=precision)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    method="exact", samples=16, seed=0, band_error=1e-3, precision="matrix_units"):
    """FlashAttention-2's flash_attn_varlen_kvpacked_func: flash_attn_varlen_func on q and k, v =
    kv[:, 0], kv[:, 1] of kv (total_k, 2, nheads_k, headdim), views read in place (no copy), the
    gradients flowing to kv. Arguments, keyword-only extras and returns as
    flash_attn_varlen_func."""
    function = "flash_attn_varlen_kvpacked_func"
    k, v = _unpacked(function, kv, "kv", 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, method=method, samples=samples, seed=seed,
                                  band_error=band_error, precision=precision)
