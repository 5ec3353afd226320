"""ALiBi attention layers for PyTorch models: a self-attention module with a KV cache, and an
attention function of the signature Hugging Face transformers registers.

    attn = poslsh.torch.AlibiSelfAttention(hidden_size=512, num_heads=8, num_kv_heads=2)
    y = attn(x)                                           # x, y: (batch, seqlen, hidden_size)
    cache = poslsh.torch.KVCache.for_module(attn, batch_size=1, max_seqlen=2048)
    y = attn(prompt, cache=cache); y = attn(next_token, cache=cache)   # generation
    cache = poslsh.torch.KVCache.for_module(attn, 1, 2048, bounded=True)  # memory bounded

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

import numpy as np
import torch
import torch.nn as nn

from . import _core, _methods
from .flash import _causal_lse, _fail, _method, _sigmas, _window
from .flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["AlibiSelfAttention", "BoundedKVCache", "KVCache", "attention_forward", "make_alibi_slopes"]


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
    def for_module(cls, module, batch_size, max_seqlen, *, dtype=None, bounded=False, num_pages=None, page_size=256):
        """A cache shaped for `module` (an AlibiSelfAttention); dtype defaults to the dtype of
        the module's projection weights. bounded=True returns a BoundedKVCache with the module's
        heads instead (BoundedKVCache.for_module; num_pages and page_size are its pool), which
        keeps only the keys the heads can still read; an exact head without a window keeps
        every key there too."""
        if bounded:
            return BoundedKVCache.for_module(module, batch_size, max_seqlen, dtype=dtype, num_pages=num_pages,
                                             page_size=page_size)
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


_BOUNDED_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
                   torch.float16: "float16"}

# A window side bound for a cache without a capacity (FlashAttention-2 treats a side >= the
# capacity as unbounded).
_UNBOUNDED_CAPACITY = 2**62


def _pool_pages(sequences, kv_heads, max_length, page_size):
    """Pages of a bounded cache's pool for `sequences` sequences of up to `max_length` tokens: a
    sequence's K/V head holds at most ceil(live keys / page_size) + 1 pages at any time."""
    return sequences * kv_heads * (-(-max_length // page_size) + 1)


def _binding_view(x):
    """A CPU tensor (last axis contiguous) as the binding reads it in place: a numpy view, or
    poslsh.BFloat16Bits over the int16 view of a bfloat16 tensor."""
    x = x.detach()
    if x.dtype == torch.bfloat16:
        return _core.BFloat16Bits(x.view(torch.int16).numpy())
    return x.numpy()


class BoundedKVCache:
    """A KV cache for generation whose memory does not grow with the context: poslsh's
    BoundedKVCache (the binding poslsh.BoundedKVCache, reachable as ``.core``) holding
    ``batch_size`` sequences, each K/V head keeping only the keys its query heads can still read

        banded head (method "banded", band W_h = band_for_bias_error(sigma_h, band_error)):
                                           key j dropped once t - j > W_h
        exact head with window_size (L, .): key j dropped once t - j > L
        LSH heads ("lsh", "lsh_per_sample", "mean_of_outputs", "fixed_blocks"):
                                           dropped once t is past the end of j's block in every
                                           hash sample
        exact head without a window:       never (the head keeps its full cache)

    (t the position of the first token of the latest append; sigma_h = 1 / alibi_slopes[h]; a
    K/V head keeps the union of its query heads' keys). Keys and values live in a pool of
    ``num_pages`` pages of ``page_size`` positions of one K/V head, in ``dtype`` (float32,
    bfloat16, float16 or float64); dropped pages return to the pool. Per K/V head of a sequence
    at most ceil(live keys / page_size) + 1 pages are held, whatever the length.

    The heads are fixed at construction with flash_attn_with_kvcache's keywords (alibi_slopes of
    shape (num_heads,), method, samples, seed, band_error, window_size, causal, softmax_scale,
    precision; window sides >= max_seqlen, or any side when max_seqlen is None, as
    FlashAttention-2 bounds them by the capacity). Then, for each step,

        out = cache.attention(q, k, v)            # or (out, softmax_lse) with return_softmax_lse

    with q (batch_size, seqlen_q, num_heads, head_dim) and the new tokens' k, v (batch_size,
    seqlen_new, num_kv_heads, head_dim / head_dim_v), seqlen_q <= seqlen_new: k and v are copied
    into the pages at each sequence's length L_b (the only copy), then q attends with
    flash_attn_with_kvcache's formula (query i at position L_b + seqlen_new - seqlen_q + i)
    over the pages read in place. Every output is bitwise flash_attn_with_kvcache's over a cache
    holding every key (same heads, dtypes and precision; finite keys and values), and
    softmax_lse is FlashAttention-2's as there. q is of the cache's dtype, or float32 over a
    bfloat16/float16 cache; out has q's dtype.

    num_pages: the pool size; default, with max_seqlen given, the pages of full caches of
    max_seqlen tokens (the pool's memory is committed only as pages are written, and released
    pages are reused first). Sizing it smaller bounds the reservation too: for banded and
    windowed heads, batch_size * num_kv_heads * (ceil((W + chunk) / page_size) + 2) pages
    suffice, W the widest band or window and chunk the longest append.

    Errors (TypeError or ValueError naming the argument; a pool too small for the new tokens
    of every sequence: ValueError naming 'k' and num_pages) leave the tokens of every sequence
    unchanged (pages already dead may have been released). Inference only: no gradients."""

    def __init__(self, batch_size, num_heads, num_kv_heads, head_dim, *, head_dim_v=None, max_seqlen=None,
                 num_pages=None, page_size=256, dtype=torch.float32, alibi_slopes=None, method="exact", samples=16,
                 seed=0, band_error=1e-3, window_size=(-1, -1), causal=True, softmax_scale=None,
                 precision="matrix_units"):
        function = "BoundedKVCache"
        _positive_int(batch_size, "batch_size")
        _positive_int(num_heads, "num_heads")
        _positive_int(num_kv_heads, "num_kv_heads")
        _positive_int(head_dim, "head_dim")
        head_dim_v = head_dim if head_dim_v is None else _positive_int(head_dim_v, "head_dim_v")
        _positive_int(page_size, "page_size")
        if max_seqlen is not None:
            _positive_int(max_seqlen, "max_seqlen")
        if num_heads % num_kv_heads:
            _fail(function, "num_kv_heads", f"is {num_kv_heads}: must divide num_heads ({num_heads})")
        if dtype not in _BOUNDED_DTYPES:
            _fail(function, "dtype", f"is {dtype}: must be torch.float32, torch.bfloat16, torch.float16 or "
                  "torch.float64", TypeError)
        if not isinstance(causal, bool):
            _fail(function, "causal", f"must be a bool, got {type(causal).__name__}", TypeError)
        if num_pages is None:
            if max_seqlen is None:
                _fail(function, "num_pages", "is None without max_seqlen: give the pool size or max_seqlen")
            num_pages = _pool_pages(batch_size, num_kv_heads, max_seqlen, page_size)
        _positive_int(num_pages, "num_pages")
        if alibi_slopes is None:
            slopes = None
        else:
            if not isinstance(alibi_slopes, torch.Tensor):
                _fail(function, "alibi_slopes", f"must be a torch.Tensor or None, got {type(alibi_slopes).__name__}",
                      TypeError)
            if alibi_slopes.dtype not in (torch.float32, torch.float64):
                _fail(function, "alibi_slopes", f"has dtype {alibi_slopes.dtype}: must be torch.float32 (or "
                      "torch.float64)", TypeError)
            if tuple(alibi_slopes.shape) != (num_heads,):
                _fail(function, "alibi_slopes", f"has shape {tuple(alibi_slopes.shape)}: must be (num_heads,) = "
                      f"({num_heads},) (the heads of every sequence of the cache are the same)")
            slopes = alibi_slopes.detach().cpu().clone()
            if not all(0.0 <= x < math.inf for x in slopes.tolist()):
                _fail(function, "alibi_slopes", "must hold finite values >= 0 (the bias is -slope * |i - j|)")
        capacity = _UNBOUNDED_CAPACITY if max_seqlen is None else max_seqlen
        causal, left, right = _window(function, window_size, causal, capacity)
        kernel_method = _method(function, method)
        self.batch_size, self.num_heads, self.num_kv_heads = batch_size, num_heads, num_kv_heads
        self.head_dim, self.head_dim_v, self.max_seqlen = head_dim, head_dim_v, max_seqlen
        self.dtype, self.causal, self.window = dtype, causal, (left, right)
        self.method, self.samples, self.seed, self.band_error = kernel_method, samples, seed, band_error
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        self.precision = precision
        self.alibi_slopes = slopes
        self.core = _core.BoundedKVCache(
            num_kv_heads, head_dim, head_dim_v, page_size, num_pages, dtype=_BOUNDED_DTYPES[dtype],
            query_heads=num_heads, method=kernel_method,
            sigmas=_sigmas(None if slopes is None else slopes.tolist(), num_heads), samples=samples, seed=seed,
            band_error=band_error, window=(left, right))
        self._sequences = [self.core.open() for _ in range(batch_size)]

    @classmethod
    def for_module(cls, module, batch_size, max_seqlen=None, *, dtype=None, num_pages=None, page_size=256):
        """A bounded cache with the heads of `module` (an AlibiSelfAttention: its slopes, method,
        samples, seed, window_size, causal, softmax_scale and precision); dtype defaults to the
        dtype of the module's projection weights. max_seqlen bounds the window as KVCache's
        capacity does (and sizes the default pool)."""
        if not isinstance(module, AlibiSelfAttention):
            _fail("BoundedKVCache.for_module", "module", f"must be an AlibiSelfAttention, got "
                  f"{type(module).__name__}", TypeError)
        if dtype is None:
            dtype = module.o_proj.weight.dtype
        return cls(batch_size, module.num_heads, module.num_kv_heads, module.head_dim, max_seqlen=max_seqlen,
                   num_pages=num_pages, page_size=page_size, dtype=dtype, alibi_slopes=module.alibi_slopes,
                   method=module.method, samples=module.samples, seed=module.seed,
                   band_error=getattr(module, "band_error", 1e-3), window_size=module.window_size,
                   causal=module.causal, softmax_scale=module.softmax_scale, precision=module.precision)

    def _matches(self, module):
        """Whether `module` computes the heads this cache keeps keys for (ValueError otherwise)."""
        slopes = module.alibi_slopes.detach().cpu()
        capacity = _UNBOUNDED_CAPACITY if self.max_seqlen is None else self.max_seqlen
        causal, left, right = _window("AlibiSelfAttention.forward", module.window_size, module.causal, capacity)
        scale = 1.0 / math.sqrt(module.head_dim) if module.softmax_scale is None else float(module.softmax_scale)
        mine = self.alibi_slopes
        same = ((module.num_heads, module.num_kv_heads, module.head_dim) == (self.num_heads, self.num_kv_heads,
                                                                          self.head_dim)
                and _method("AlibiSelfAttention.forward", module.method) == self.method
                and (module.samples, module.seed, causal, (left, right), scale, module.precision)
                == (self.samples, self.seed, self.causal, self.window, self.softmax_scale, self.precision)
                and mine is not None and slopes.tolist() == mine.tolist())
        if not same:
            _fail("AlibiSelfAttention.forward", "cache", "is a BoundedKVCache built for other heads (slopes, "
                  "method, samples, seed, window, causal, scale, precision or shapes): the keys it keeps follow "
                  "those heads; build it with BoundedKVCache.for_module(module, ...)")

    @property
    def cache_seqlens(self):
        """The number of tokens appended to each sequence, int32 (batch_size,) (a new tensor)."""
        return torch.tensor([self.core.length(s) for s in self._sequences], dtype=torch.int32)

    @property
    def sequences(self):
        """The binding's sequence ids of the batch rows (for ``core``'s per-sequence queries:
        first_key, held_pages, frontier)."""
        return list(self._sequences)

    @property
    def bytes_in_use(self):
        """Bytes of the pages the sequences hold (keys and values)."""
        return self.core.bytes_in_use

    def full_cache_bytes(self):
        """Bytes a cache keeping every key of every sequence would take."""
        return sum(self.core.full_cache_bytes(s) for s in self._sequences)

    def reset(self):
        """Forgets every token: the sequences' pages return to the pool."""
        for s in self._sequences:
            self.core.close(s)
        self._sequences = [self.core.open() for _ in range(self.batch_size)]

    def attention(self, q, k, v, *, cache_seqlens=None, return_softmax_lse=False, num_threads=None):
        """Appends k, v (batch_size, seqlen_new, num_kv_heads, head_dim / head_dim_v) at each
        sequence's length L_b, then returns flash_attn_with_kvcache's out (batch_size, seqlen_q,
        num_heads, head_dim_v) of q (batch_size, seqlen_q, num_heads, head_dim), seqlen_q <=
        seqlen_new, over the cache (class docstring), or (out, softmax_lse (batch_size,
        num_heads, seqlen_q) float32) with return_softmax_lse. cache_seqlens (optional, int or
        int32 tensor (batch_size,)): the positions the caller means to append at; ValueError
        unless they are the sequences' lengths (the cache appends in order only)."""
        function = "BoundedKVCache.attention"
        dtypes = tuple(_BOUNDED_DTYPES)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                _fail(function, name, f"must be a torch.Tensor, got {type(x).__name__}", TypeError)
            if x.device.type != "cpu":
                _fail(function, name, f"is on {x.device}: only CPU tensors are supported")
            if x.dtype not in dtypes:
                _fail(function, name, f"has dtype {x.dtype}: must be {self.dtype} like the cache", TypeError)
            if x.dim() != 4:
                _fail(function, name, f"has shape {tuple(x.shape)}: must be 4-D (batch, seqlen, heads, head_dim)")
        for name, x in (("k", k), ("v", v)):
            if x.dtype != self.dtype:
                _fail(function, name, f"has dtype {x.dtype}: must be the cache's dtype {self.dtype}", TypeError)
        if q.dtype != self.dtype and not (q.dtype == torch.float32 and self.dtype in (torch.bfloat16, torch.float16)):
            _fail(function, "q", f"has dtype {q.dtype}: must be the cache's dtype {self.dtype} (or torch.float32 "
                  "over a bfloat16 or float16 cache)", TypeError)
        batch, seqlen_q = self.batch_size, q.shape[1]
        if (q.shape[0], q.shape[2], q.shape[3]) != (batch, self.num_heads, self.head_dim):
            _fail(function, "q", f"has shape {tuple(q.shape)}: must be (batch_size, seqlen_q, num_heads, head_dim) "
                  f"= ({batch}, *, {self.num_heads}, {self.head_dim})")
        new = k.shape[1]
        for name, x, width in (("k", k, self.head_dim), ("v", v, self.head_dim_v)):
            if tuple(x.shape) != (batch, new, self.num_kv_heads, width):
                _fail(function, name, f"has shape {tuple(x.shape)}: must be (batch_size, seqlen_new, num_kv_heads, "
                      f"{'head_dim' if name == 'k' else 'head_dim_v'}) = ({batch}, {new}, {self.num_kv_heads}, "
                      f"{width})")
            if width > 1 and x.stride(-1) != 1:
                _fail(function, name, f"has strides {x.stride()}: the last axis must be contiguous")
        if seqlen_q > new:
            _fail(function, "q", f"has seqlen_q {seqlen_q} > seqlen_new {new}: the queries must be among the "
                  "appended tokens (earlier positions' keys may have been released)")
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            _fail(function, "q", "requires grad while autograd records: the bounded cache is inference only "
                  "(call it under torch.no_grad())")
        lengths = [self.core.length(s) for s in self._sequences]
        if cache_seqlens is not None:
            if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
                given = [int(cache_seqlens)] * batch
            elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype in (torch.int32, torch.int64) \
                    and tuple(cache_seqlens.shape) == (batch,):
                given = cache_seqlens.tolist()
            else:
                _fail(function, "cache_seqlens", f"must be an int or an int32 tensor ({batch},), got "
                      f"{cache_seqlens!r}", TypeError)
            if given != lengths:
                _fail(function, "cache_seqlens", f"is {given}: the bounded cache appends each sequence at its "
                      f"length, {lengths} (positions in order only; released keys cannot be rewritten)")
        # All or nothing: the pages dead at the new tokens' first positions are released first
        # (what each append does first), then the pool must hold every sequence's new pages.
        for b, sequence in enumerate(self._sequences):
            self.core.advance(sequence, lengths[b])
        page = self.core.page_size
        needed = sum(self.num_kv_heads * (-(-(length + new) // page) - -(-length // page)) for length in lengths)
        if needed > self.core.free_pages:
            _fail(function, "k", f"has {new} new tokens per sequence, which need {needed} new pages: the pool has "
                  f"{self.core.free_pages} free of num_pages = {self.core.num_pages}")
        for b, sequence in enumerate(self._sequences):
            self.core.append(sequence, lengths[b], _binding_view(k[b]), _binding_view(v[b]))
        flat_q = q.detach().reshape(batch * seqlen_q, self.num_heads, self.head_dim)
        if self.head_dim > 1 and flat_q.stride(-1) != 1:
            flat_q = flat_q.contiguous()
        out = torch.empty((batch * seqlen_q, self.num_heads, self.head_dim_v), dtype=q.dtype)
        cu = np.arange(batch + 1, dtype=np.int32) * seqlen_q
        keywords = dict(masking="causal" if self.causal else "bidirectional", scale=self.softmax_scale,
                        out=_binding_view(out), num_threads=num_threads, precision=self.precision)
        if not return_softmax_lse:
            self.core.attention(_binding_view(flat_q), self._sequences, cu, **keywords)
            return out.view(batch, seqlen_q, self.num_heads, self.head_dim_v)
        _, lse = self.core.attention_with_lse(_binding_view(flat_q), self._sequences, cu, **keywords)
        lse = torch.from_numpy(lse).float().reshape(self.num_heads, batch, seqlen_q).transpose(0, 1).contiguous()
        if self.causal and self.window[0] == -1:  # FlashAttention-2's lse of causal calls with slopes
            total = torch.tensor(lengths, dtype=torch.int64) + new
            positions = (torch.arange(seqlen_q)[None, :] + (total - seqlen_q)[:, None]).double()[:, None, :]
            lse = _causal_lse(lse, self.alibi_slopes, lambda m: m[None, :, None], positions)
        return out.view(batch, seqlen_q, self.num_heads, self.head_dim_v), lse


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
    seqlen. With a BoundedKVCache (KVCache.for_module(..., bounded=True)) the same tokens are
    appended to its pages and attend through it, bitwise the KVCache path's outputs, while the
    cache keeps only the keys the heads can still read (banded, LSH and windowed heads; an
    exact head without a window keeps every key). The cached path is for inference: under
    torch.no_grad() (ValueError while autograd records with parameters or x requiring grad)."""

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
        elif isinstance(cache, BoundedKVCache):
            if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
                raise ValueError("poslsh.torch: argument 'cache' is given while autograd records: the cached path "
                                 "is inference only; call it under torch.no_grad()")
            if cache.batch_size != batch:
                raise ValueError(f"poslsh.torch: argument 'cache' holds {cache.batch_size} sequences: x has batch "
                                 f"{batch}")
            cache._matches(self)
            if cache.max_seqlen is not None:
                free = cache.max_seqlen - int(cache.cache_seqlens.max())
                if length > free:
                    raise ValueError(f"poslsh.torch: argument 'cache' has room for {free} more tokens (max_seqlen "
                                     f"{cache.max_seqlen}) in its fullest row: x has {length}")
            out = cache.attention(q, k.to(cache.dtype), v.to(cache.dtype))
        else:
            if not isinstance(cache, KVCache):
                raise TypeError(f"poslsh.torch: argument 'cache' must be a poslsh.torch.KVCache or "
                                f"BoundedKVCache, got {type(cache).__name__}")
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
