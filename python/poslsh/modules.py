"""ALiBi attention layers for PyTorch models: a self-attention module with a KV cache, and an
attention function of the signature Hugging Face transformers registers.

    attn = poslsh.torch.AlibiSelfAttention(hidden_size=512, num_heads=8, num_kv_heads=2)
    y = attn(x)                                           # x, y: (batch, seqlen, hidden_size)
    cache = poslsh.torch.KVCache.for_module(attn, batch_size=1, max_seqlen=2048)
    y = attn(prompt, cache=cache); y = attn(next_token, cache=cache)   # generation

    AttentionInterface.register("poslsh", poslsh.torch.attention_forward)   # transformers

Both compute, for query head h of a sequence (key/value head h // (nheads / nheads_k)), with
the query at position i and the key at position j,

    out_h[i] = sum_j softmax_j(scale * q_h[i] . k[j] - slope_h * |i - j|) v[j]
               (causal: only j <= i; scale = 1/sqrt(head_dim) by default)

through ``flash_attn_func`` (training, prefill) and ``flash_attn_with_kvcache`` (decoding), so
the ``method`` argument chooses exact ALiBi or one of poslsh's approximations as there. Both are
torch operators (poslsh.flash): torch.compile(model, fullgraph=True) of a model of
AlibiSelfAttention layers records forward and backward without a graph break; the cached path
reads the cache lengths (a graph break: decode eagerly or without fullgraph).
"""

import math

import torch
import torch.nn as nn

from . import _core, _methods
from .flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["AlibiSelfAttention", "KVCache", "attention_forward", "make_alibi_slopes"]


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"poslsh.torch: argument '{name}' must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"poslsh.torch: argument '{name}' must be positive, got {value}")
    return value


def make_alibi_slopes(num_heads, max_bias=8.0):
    """The ALiBi slopes of Press et al. as a float32 tensor of shape (num_heads,).

    For num_heads = H a power of two, slope_h = 2^(-max_bias * (h + 1) / H), h = 0 .. H-1.
    Otherwise, with p the largest power of two below H, the p slopes of p heads followed by the
    first H - p of the even-indexed slopes of 2p heads (h = 0, 2, 4, ...), as the ALiBi paper's
    code, BLOOM and MPT compute them. max_bias = 8 (the paper's) gives poslsh.alibi_slopes(H)
    rounded to float32. Computed in float64, rounded once."""
    _positive_int(num_heads, "num_heads")
    if isinstance(max_bias, bool) or not isinstance(max_bias, (int, float)) or not math.isfinite(max_bias) \
            or max_bias <= 0:
        raise ValueError(f"poslsh.torch: argument 'max_bias' must be a positive finite number, got {max_bias!r}")

    def power_of_two(n):
        return [2.0 ** (-max_bias * (h + 1) / n) for h in range(n)]

    p = 1 << (num_heads.bit_length() - 1)
    slopes = power_of_two(p)
    if p != num_heads:
        slopes += power_of_two(2 * p)[0::2][:num_heads - p]
    return torch.tensor(slopes, dtype=torch.float64).float()


class KVCache:
    """The keys and values of one attention layer for generation, in FlashAttention's layout:

        k_cache, v_cache: (batch_size, max_seqlen, num_kv_heads, head_dim) tensors of ``dtype``
        cache_seqlens:    (batch_size,) int32, the number of valid tokens of each row

    AlibiSelfAttention.forward(x, cache=cache) appends x's keys and values at cache_seqlens
    (flash_attn_with_kvcache writes them in place), attends over the cache, and advances
    cache_seqlens by x's sequence length. Rows may hold different lengths (set cache_seqlens)."""

    def __init__(self, batch_size, max_seqlen, num_kv_heads, head_dim, *, dtype=torch.float32):
        _positive_int(batch_size, "batch_size")
        _positive_int(max_seqlen, "max_seqlen")
        _positive_int(num_kv_heads, "num_kv_heads")
        _positive_int(head_dim, "head_dim")
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise TypeError(f"poslsh.torch: argument 'dtype' is {dtype}: must be torch.float32, torch.float64, "
                            "torch.bfloat16 or torch.float16")
        shape = (batch_size, max_seqlen, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype)
        self.v_cache = torch.zeros(shape, dtype=dtype)
        self.cache_seqlens = torch.zeros(batch_size, dtype=torch.int32)

    @classmethod
    def for_module(cls, module, batch_size, max_seqlen, *, dtype=None):
        """A cache shaped for `module` (an AlibiSelfAttention); dtype defaults to the dtype of
        the module's projection weights."""
        if not isinstance(module, AlibiSelfAttention):
            raise TypeError(f"poslsh.torch: argument 'module' must be an AlibiSelfAttention, got "
                            f"{type(module).__name__}")
        if dtype is None:
            dtype = module.o_proj.weight.dtype
        return cls(batch_size, max_seqlen, module.num_kv_heads, module.head_dim, dtype=dtype)

    @property
    def batch_size(self):
        return self.k_cache.shape[0]

    @property
    def max_seqlen(self):
        return self.k_cache.shape[1]

    def reset(self):
        """Forgets every token (cache_seqlens = 0); the buffers are kept."""
        self.cache_seqlens.zero_()


# The flash_attn_func methods that give gradients in alibi_slopes (short names included).
_SLOPE_GRADIENT_METHODS = tuple(_methods.accepted(has_slope_gradients=True))


class AlibiSelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention with ALiBi, the attention layer of a BLOOM-,
    MPT- or JinaBERT-style model:

        q, k, v = x W_q, x W_k, x W_v  (num_heads query heads, num_kv_heads key/value heads of
                                        head_dim each; one fused projection if fused_qkv)
        y = attention(q, k, v) W_o     (the formula of this module's docstring, per head)

    Arguments:
      hidden_size, num_heads: the model width and the number of query heads.
      num_kv_heads: key/value heads (grouped-query attention); must divide num_heads. Default
        num_heads.
      head_dim: default hidden_size // num_heads (then num_heads must divide hidden_size).
      fused_qkv: one Linear ``qkv_proj`` of output [q | k | v] (num_heads * head_dim, then
        num_kv_heads * head_dim twice) instead of ``q_proj``, ``k_proj``, ``v_proj``. The output
        projection is ``o_proj``. bias: whether the projections have biases.
      slopes: the per-head slopes (num_heads values, any positive or zero numbers, e.g. a
        tensor-parallel shard of a model's slopes); default make_alibi_slopes(num_heads,
        max_bias). Stored as the float32 attribute ``alibi_slopes``: a buffer, or an
        nn.Parameter with trainable_slopes=True (gradients through the exact and banded
        methods only). They stay float32 when the module is converted (``.double()``,
        ``.to(torch.bfloat16)``).
      method, samples, seed, window_size: as flash_attn_func (``method="exact"`` computes the
        formula exactly; a window makes it banded).
      causal: True (decoder) or False (bidirectional encoder, the bias -slope_h |i - j| on both
        sides). softmax_scale: default 1/sqrt(head_dim).
      precision: "matrix_units" (default) or "float_products", as flash_attn_func: a bfloat16
        module uses the CPU's matrix unit (AVX512-BF16 where present) for its attention
        products under "matrix_units"; other dtypes ignore it.

    forward(x, cache=None): x is (batch, seqlen, hidden_size) (float32, float64, bfloat16 or
    float16, like the weights); returns (batch, seqlen, hidden_size). Without a cache the
    tokens of each row are positions 0 .. seqlen - 1 (flash_attn_func; differentiable). With a
    KVCache the tokens continue the cached ones: their keys and values are appended at
    cache.cache_seqlens, they attend to the cache (flash_attn_with_kvcache: bottom-right
    aligned, the new tokens are the last positions), and cache.cache_seqlens advances by
    seqlen. The cached path is for inference: under torch.no_grad() (ValueError while autograd
    records with parameters or x requiring grad)."""

    def __init__(self, hidden_size, num_heads, num_kv_heads=None, *, head_dim=None, fused_qkv=False, bias=False,
                 slopes=None, max_bias=8.0, trainable_slopes=False, method="exact", samples=16, seed=0,
                 window_size=(-1, -1), causal=True, softmax_scale=None, dtype=None, precision="matrix_units"):
        super().__init__()
        _positive_int(hidden_size, "hidden_size")
        _positive_int(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else _positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads:
            raise ValueError(f"poslsh.torch: argument 'num_kv_heads' ({num_kv_heads}) must divide 'num_heads' "
                             f"({num_heads})")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"poslsh.torch: argument 'num_heads' ({num_heads}) must divide 'hidden_size' "
                                 f"({hidden_size}) unless head_dim is given")
            head_dim = hidden_size // num_heads
        _positive_int(head_dim, "head_dim")
        if not isinstance(causal, bool):
            raise TypeError(f"poslsh.torch: argument 'causal' must be a bool, got {type(causal).__name__}")
        if not isinstance(method, str):
            raise TypeError(f"poslsh.torch: argument 'method' must be a str, got {type(method).__name__}")
        if precision not in _core.precision_names():
            raise ValueError(f"poslsh.torch: argument 'precision' = {precision!r}: must be "
                             + " or ".join(repr(name) for name in _core.precision_names()))
        self.precision = precision
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, \
            head_dim
        self.fused_qkv = bool(fused_qkv)
        self.method, self.samples, self.seed = method, samples, seed
        self.window_size = tuple(window_size)
        self.causal = causal
        self.softmax_scale = softmax_scale
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        factory = {} if dtype is None else {"dtype": dtype}
        if self.fused_qkv:
            self.qkv_proj = nn.Linear(hidden_size, q_width + 2 * kv_width, bias=bias, **factory)
        else:
            self.q_proj = nn.Linear(hidden_size, q_width, bias=bias, **factory)
            self.k_proj = nn.Linear(hidden_size, kv_width, bias=bias, **factory)
            self.v_proj = nn.Linear(hidden_size, kv_width, bias=bias, **factory)
        self.o_proj = nn.Linear(q_width, hidden_size, bias=bias, **factory)

        if slopes is None:
            values = make_alibi_slopes(num_heads, max_bias)
        else:
            if isinstance(slopes, torch.Tensor):
                values = slopes.detach().to(dtype=torch.float32, copy=True)
            else:
                try:
                    values = torch.tensor([float(s) for s in slopes], dtype=torch.float32)
                except (TypeError, ValueError):
                    raise TypeError("poslsh.torch: argument 'slopes' must be a tensor or a sequence of numbers") \
                        from None
            if values.shape != (num_heads,):
                raise ValueError(f"poslsh.torch: argument 'slopes' has shape {tuple(values.shape)}: must be "
                                 f"({num_heads},), one slope per query head")
            if not bool(torch.isfinite(values).all()):
                raise ValueError("poslsh.torch: argument 'slopes' must be finite")
        if trainable_slopes and method not in _SLOPE_GRADIENT_METHODS:
            raise ValueError(f"poslsh.torch: argument 'trainable_slopes' is True with method {method!r}: only the "
                             f"exact methods ({', '.join(_SLOPE_GRADIENT_METHODS)}) differentiate the slopes (LSH "
                             "bins are sampled, not differentiable in the slope)")
        if trainable_slopes:
            self.alibi_slopes = nn.Parameter(values)
        else:
            self.register_buffer("alibi_slopes", values)

    @property
    def is_causal(self):
        """``causal``, under the attribute name Hugging Face's attention functions read."""
        return self.causal

    def _apply(self, fn, *args, **kwargs):
        # Module conversions (.double(), .half(), .to(dtype)) apply to every floating tensor;
        # the slopes stay float32 (only moved).
        slopes = self.alibi_slopes.detach().clone()
        result = super()._apply(fn, *args, **kwargs)
        if self.alibi_slopes.dtype != torch.float32:
            kept = slopes.to(device=self.alibi_slopes.device)
            if isinstance(self.alibi_slopes, nn.Parameter):
                self.alibi_slopes.data = kept
                if self.alibi_slopes.grad is not None:
                    self.alibi_slopes.grad = self.alibi_slopes.grad.float()
            else:
                self._buffers["alibi_slopes"] = kept
        return result

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, method={self.method!r}, causal={self.causal}, "
                f"precision={self.precision!r}, "
                f"trainable_slopes={isinstance(self.alibi_slopes, nn.Parameter)}")

    def _projections(self, x):
        batch, length, _ = x.shape
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused_qkv:
            q, k, v = self.qkv_proj(x).split([q_width, kv_width, kv_width], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.reshape(batch, length, self.num_heads, self.head_dim),
                k.reshape(batch, length, self.num_kv_heads, self.head_dim),
                v.reshape(batch, length, self.num_kv_heads, self.head_dim))

    def forward(self, x, cache=None):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"poslsh.torch: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"poslsh.torch: argument 'x' has shape {tuple(x.shape)}: must be (batch, seqlen, "
                             f"{self.hidden_size})")
        batch, length, _ = x.shape
        q, k, v = self._projections(x)
        keywords = dict(softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
                        alibi_slopes=self.alibi_slopes, method=self.method, samples=self.samples, seed=self.seed,
                        precision=self.precision)
        if cache is None:
            out = flash_attn_func(q, k, v, **keywords)
        else:
            if not isinstance(cache, KVCache):
                raise TypeError(f"poslsh.torch: argument 'cache' must be a poslsh.torch.KVCache, got "
                                f"{type(cache).__name__}")
            if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
                raise ValueError("poslsh.torch: argument 'cache' is given while autograd records: the cached path "
                                 "is inference only (flash_attn_with_kvcache has no gradients); call it under "
                                 "torch.no_grad()")
            if cache.batch_size != batch or cache.k_cache.shape[2:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"poslsh.torch: argument 'cache' holds {tuple(cache.k_cache.shape)} (batch, "
                                 f"max_seqlen, num_kv_heads, head_dim): must be ({batch}, *, {self.num_kv_heads}, "
                                 f"{self.head_dim}) for this module and x")
            free = cache.max_seqlen - int(cache.cache_seqlens.max())
            if length > free:
                raise ValueError(f"poslsh.torch: argument 'cache' has room for {free} more tokens in its fullest "
                                 f"row: x has {length}")
            keywords["alibi_slopes"] = self.alibi_slopes.detach()
            out = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, k=k.to(cache.k_cache.dtype),
                                          v=v.to(cache.v_cache.dtype), cache_seqlens=cache.cache_seqlens,
                                          **keywords)
            cache.cache_seqlens += length
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))


_IGNORED_MASK_NOTE = ("poslsh computes causal (bottom-right aligned) or bidirectional ALiBi attention over all "
                      "tokens: pass no mask, an all-ones padding mask or the causal/full 4-D mask; for padded "
                      "batches use unpadded sequences with flash_attn_varlen_func")


def _packed_sequences(kwargs, batch, q_len, kv_len):
    """(cu_seqlens_q, cu_seqlens_k) int32 of a packed row of sequences, from transformers'
    cu_seq_lens_q / cu_seq_lens_k kwargs or from position_ids restarting at 0; None for an
    ordinary batch (no position_ids, or the positions kv_len - q_len .. kv_len - 1 of every row).
    ValueError for positions the kernels do not compute."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        for name, cu, total in (("cu_seq_lens_q", cu_q, q_len), ("cu_seq_lens_k", cu_k, kv_len)):
            if not isinstance(cu, torch.Tensor):
                raise TypeError(f"poslsh.torch: argument '{name}' must be a torch.Tensor (cu_seq_lens_q and "
                                f"cu_seq_lens_k come together), got {type(cu).__name__}")
            if cu.dim() != 1 or cu.shape[0] < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
                raise ValueError(f"poslsh.torch: argument '{name}' must be 1-D offsets from 0 to {total}, got "
                                 f"{cu.tolist()}")
        if batch != 1:
            raise ValueError(f"poslsh.torch: argument 'cu_seq_lens_q' describes packed sequences, which come as one "
                             f"row (batch 1): got batch {batch}")
        return cu_q.to(torch.int32), cu_k.to(torch.int32)
    positions = kwargs.get("position_ids")
    if positions is None:
        return None
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"poslsh.torch: argument 'position_ids' must be a torch.Tensor or None, got "
                        f"{type(positions).__name__}")
    positions = positions[None] if positions.dim() == 1 else positions
    if positions.dim() != 2 or positions.shape[0] not in (1, batch) or positions.shape[1] != q_len:
        raise ValueError(f"poslsh.torch: argument 'position_ids' has shape {tuple(positions.shape)}: must be "
                         f"(batch or 1, {q_len})")
    if bool((positions == torch.arange(kv_len - q_len, kv_len)).all()):
        return None
    if batch == 1 and q_len == kv_len:
        row = positions[0].long()
        starts = torch.nonzero(row == 0).flatten()
        if len(starts) and int(starts[0]) == 0:
            cu = torch.cat([starts, torch.tensor([q_len])])
            if bool((row == torch.arange(q_len) - torch.repeat_interleave(starts, cu[1:] - cu[:-1])).all()):
                cu = cu.to(torch.int32)
                return cu, cu
    raise ValueError("poslsh.torch: argument 'position_ids' is neither the positions kv_len - q_len .. kv_len - 1 "
                     "of every row nor packed sequences restarting at 0 (batch 1), which poslsh cannot honour: "
                     "the ALiBi bias uses the token indices")


def _patterns(q_len, kv_len, packed):
    """The (causal, full) boolean (q_len, kv_len) patterns the kernels compute: bottom-right
    aligned over the whole row, or within each packed sequence."""
    if packed is None:
        i = torch.arange(q_len)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len)[None, :]
        return j <= i, torch.ones(q_len, kv_len, dtype=torch.bool)
    cu_q, cu_k = (cu.long() for cu in packed)
    seq_q = torch.bucketize(torch.arange(q_len), cu_q[1:], right=True)
    seq_k = torch.bucketize(torch.arange(kv_len), cu_k[1:], right=True)
    row = torch.arange(q_len) - cu_q[seq_q] + (cu_k[seq_q + 1] - cu_k[seq_q]) - (cu_q[seq_q + 1] - cu_q[seq_q])
    column = torch.arange(kv_len) - cu_k[seq_k]
    same = seq_q[:, None] == seq_k[None, :]
    return same & (column[None, :] <= row[:, None]), same


def _mask_causality(mask, batch, q_len, kv_len, packed=None):
    """Which attention a given attention_mask describes: True (causal, bottom-right aligned),
    False (every key), None (both: one query row, or no mask); within each sequence when
    `packed`. ValueError for anything else."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"poslsh.torch: argument 'attention_mask' must be a torch.Tensor or None, got "
                        f"{type(mask).__name__}")
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, kv_len):
            raise ValueError(f"poslsh.torch: argument 'attention_mask' has shape {tuple(mask.shape)}: a 2-D "
                             f"padding mask must be (batch, kv_len) = ({batch}, {kv_len})")
        if not bool((mask != 0).all()):
            raise ValueError("poslsh.torch: argument 'attention_mask' masks padding tokens, which poslsh cannot "
                             "honour: " + _IGNORED_MASK_NOTE)
        return None
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[2:] != (q_len, kv_len):
        raise ValueError(f"poslsh.torch: argument 'attention_mask' has shape {tuple(mask.shape)}: must be None, "
                         f"(batch, kv_len) or (batch or 1, heads or 1, {q_len}, {kv_len})")
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        dropped = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min / 2)
        if not bool((keep | dropped).all()):
            raise ValueError("poslsh.torch: argument 'attention_mask' adds a bias other than 0 or -inf, which "
                             "poslsh cannot honour: " + _IGNORED_MASK_NOTE)
    else:
        raise TypeError(f"poslsh.torch: argument 'attention_mask' has dtype {mask.dtype}: a 4-D mask must be "
                        "torch.bool (True = attend) or floating (0 = attend, -inf or the dtype's minimum = masked)")
    causal, full = (x.expand(keep.shape) for x in _patterns(q_len, kv_len, packed))
    if bool((keep == causal).all()):
        return None if bool((causal == full).all()) else True
    if bool((keep == full).all()):
        return False
    raise ValueError("poslsh.torch: argument 'attention_mask' is neither the causal nor the full mask, which "
                     "poslsh cannot honour: " + _IGNORED_MASK_NOTE)


_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "head_mask")


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """ALiBi attention under Hugging Face transformers' attention-function signature: register it
    with ``AttentionInterface.register("poslsh", attention_forward)`` and load the model with
    ``attn_implementation="poslsh"``. Returns ``(out, None)`` (no attention weights).

    query: (batch, num_heads, q_len, head_dim); key, value: (batch, num_kv_heads, kv_len,
    head_dim), num_kv_heads dividing num_heads (grouped-query). out: (batch, q_len, num_heads,
    head_dim), the layout the model's output projection reshapes. The queries are the last
    q_len of the kv_len positions (bottom-right alignment, as in decoding with a cache):

        out[b, i, h] = sum_j softmax_j(scaling q[b, h, i] . k[b, h // G, j]
                                       - slope_h |i + kv_len - q_len - j|) v[b, h // G, j]

    with j <= i + kv_len - q_len when causal, G = num_heads / num_kv_heads, scaling default
    1/sqrt(head_dim). Computed by flash_attn_func.

    Slopes: ``kwargs["alibi_slopes"]`` if given, else the module's attribute ``alibi_slopes``
    (float32, (num_heads,) or (batch, num_heads)); ValueError when neither exists.
    Causality: a 4-D attention_mask decides; otherwise ``kwargs["is_causal"]``, else the
    module's ``is_causal`` attribute, else True.
    Method: ``kwargs`` or module attributes ``poslsh_method`` (default "exact"),
    ``poslsh_samples`` (16), ``poslsh_seed`` (0) and ``poslsh_precision`` ("matrix_units"), as
    flash_attn_func's method, samples, seed and precision (bfloat16 models use the CPU's matrix
    unit under "matrix_units").

    attention_mask accepted (poslsh never reads a mask; it checks that the mask asks for what
    the kernels compute):
      - None;
      - a 2-D padding mask (batch, kv_len) whose entries are all nonzero (no padding);
      - a 4-D mask (batch or 1, heads or 1, q_len, kv_len), boolean (True = attend) or
        floating (0 = attend, -inf or <= the dtype's minimum / 2 = masked), equal to the causal
        mask (key j for query i iff j <= i + kv_len - q_len) or to the full mask.
    Packed sequences (batch 1, several sequences one after the other, as transformers'
    DataCollatorWithFlattening makes them): ``kwargs["cu_seq_lens_q"]`` and
    ``kwargs["cu_seq_lens_k"]`` (offsets from 0, as flash_attn_varlen_func's cu_seqlens), or
    ``position_ids`` restarting at 0 at each sequence; each sequence then attends only to
    itself (flash_attn_varlen_func), and a 4-D mask must be the block-diagonal causal or full
    mask. Other position_ids must be kv_len - q_len .. kv_len - 1 in every row (ValueError
    otherwise: the bias uses token indices).
    Any other mask (padding, document masks, sliding windows, additive biases) raises ValueError
    saying so; so do dropout > 0 and the kwargs softcap, sliding_window, s_aux, head_mask when
    not None. Other kwargs (cache_position, ...) are ignored."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"poslsh.torch: argument '{name}' must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(f"poslsh.torch: argument '{name}' has shape {tuple(tensor.shape)}: must be 4-D "
                             "(batch, heads, seqlen, head_dim)")
    if key.shape != value.shape[:3] + key.shape[3:] or key.shape[0] != query.shape[0]:
        raise ValueError(f"poslsh.torch: arguments 'key' {tuple(key.shape)} and 'value' {tuple(value.shape)} must "
                         f"share batch, heads and seqlen, with the batch of 'query' {tuple(query.shape)}")
    if not isinstance(dropout, (int, float)) or dropout != 0:
        raise ValueError(f"poslsh.torch: argument 'dropout' is {dropout!r}: poslsh has no attention dropout "
                         "(dropout must be 0.0; set the model's attention dropout to 0)")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"poslsh.torch: argument '{name}' is not supported by poslsh's attention "
                             f"(got {kwargs[name]!r})")
    slopes = kwargs.get("alibi_slopes")
    if slopes is None:
        slopes = getattr(module, "alibi_slopes", None)
    if slopes is None:
        raise ValueError("poslsh.torch: argument 'alibi_slopes' missing: pass alibi_slopes=... or give the "
                         "attention module an 'alibi_slopes' attribute (float32, (num_heads,))")
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    packed = _packed_sequences(kwargs, batch, q_len, kv_len)
    causal = _mask_causality(attention_mask, batch, q_len, kv_len, packed)
    if causal is None:
        causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)

    def setting(name, default):
        value = kwargs.get(name)
        return getattr(module, name, default) if value is None else value

    keywords = dict(softmax_scale=scaling, causal=bool(causal), alibi_slopes=slopes,
                    method=setting("poslsh_method", "exact"), samples=setting("poslsh_samples", 16),
                    seed=setting("poslsh_seed", 0), precision=setting("poslsh_precision", "matrix_units"))
    if packed is None:
        return flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), **keywords), None
    cu_q, cu_k = packed
    if isinstance(slopes, torch.Tensor) and slopes.dim() == 2 and slopes.shape[0] == 1:
        keywords["alibi_slopes"] = slopes[0]        # one row of packed sequences: the row's slopes for each
    out = flash_attn_varlen_func(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q,
                                 cu_k, int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max()),
                                 **keywords)
    return out.unsqueeze(0), None
