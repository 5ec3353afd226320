"""transformers' ALiBi models (BLOOM, MPT, Falcon with ``alibi=True``) with poslsh attention.

    import poslsh.transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(...)   # BLOOM, MPT or Falcon-ALiBi
    poslsh.transformers.use_poslsh(model, method="exact")            # in place; returns model
    model.generate(ids, attention_mask=mask, max_new_tokens=32)      # attention on poslsh
    poslsh.transformers.restore(model)                               # transformers' eager again

``use_poslsh(model, method="exact", *, samples=16, seed=0, band_error=1e-3, error=1e-2,
precision="matrix_units")`` keeps the model's weights, config and cache objects (``DynamicCache``)
and replaces only the attention product: for query head h of a layer with softmax scale tau and
effective slope m_h (below),

    out_i = softmax_j(tau q_i . k_j - m_h (P_i - P_j)) v_j   over the keys j <= i that are not padding,

computed by ``poslsh.torch.flash_attn_func`` (FlashAttention-2's call: causal, ``alibi_slopes``,
bottom-right aligned queries; decoding steps of the exact method, up to 16 query rows without
gradients, by ``poslsh.alibi_attention_decode_exact`` head by head), so no (heads, L, L) score or
bias tensor is formed. Because softmax is invariant to a per-row constant, this is the models'
``+ m_h P_j`` key bias.

Methods (``method=``): a name of ``poslsh.torch.flash_attn_func``'s ``method`` ("exact",
"banded", "lsh", "lsh_per_sample", "fixed_blocks", "mean_of_outputs" or a table name of
``poslsh.method_names()``) for every head; a list of such names, one per query head; or "plan":
per head the cheapest method ``poslsh.plan_heads(L, 1 / m_h, error, head_dim=d,
lsh_samplers=["independent"])`` predicts within relative output error ``error`` for the L keys
of the call (exact heads in one call; a banded head with band W as "banded" with its own
``band_error = exp(-(W - 1/2) m_h)``, so that ``band_for_bias_error`` gives W, or band 0 as
"exact" in the window (0, 0); LSH heads with the plan's sample count, hashes of the same law as
the plan's). samples, seed, band_error, precision: as flash_attn_func. Every method trains
(gradients of q, k, v, hence of every parameter); the slopes are constants.

Conventions, as transformers 5.x computes them (read from each model's code):

- **BLOOM** (``BloomModel``): slopes ``build_alibi_tensor`` (Press et al.: ``2^(-8(h+1)/p)``
  for p = 2^floor(log2 H) heads, then the odd powers of the 2p-head base); key positions
  ``(cumsum(attention_mask) - 1) * attention_mask``, i.e. padding does not shift positions: a
  token's position is the number of non-padding tokens before it. The bias is added after the
  scale (``baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d))``): m_h = slope_h, tau = 1/sqrt(d).
- **Falcon** (``alibi=True``): the same slopes and positions, but ``build_alibi_tensor``
  rounds the slopes to bfloat16 and multiplies in bfloat16, and the model divides the bias by
  sqrt(d) (``alibi / sqrt(head_dim)`` added to the scaled scores): m_h = bf16(slope_h) /
  sqrt(d), tau = 1/sqrt(d). poslsh applies m_h (P_i - P_j) in float32; transformers' bias is
  ``bf16(bf16(slope_h) P_j)``, which equals it only while that product is a bfloat16 number
  (e.g. for slopes that are powers of two, H <= 8, and positions below 256); beyond, its
  rounding (up to 2^-9 of m_h P_j) is transformers' and not poslsh's. Multi-query and
  grouped-query Falcon (``multi_query``, ``new_decoder_architecture``) run as grouped-query
  attention.
- **MPT** (``MptModel``): slopes ``build_mpt_alibi_tensor``, ``2^(-8(h+1)/H')`` for H' the
  next power of two, interleaved as Press et al.'s for other H. transformers builds them with
  the default ``alibi_bias_max=8`` whatever ``config.attn_config.alibi_bias_max`` says, and so
  does poslsh (m_h = slope_h, tau = ``attn_config.softmax_scale`` or 1/sqrt(d)). The bias is
  ``slope_h (j - (L - 1))`` over the key *slots* j (positions ``1 - L .. 0``): padding is masked
  but positions are not shifted. poslsh packs each row's non-padding tokens, which gives the
  same distances when they are contiguous (left or right padding); a mask with padding
  between tokens raises ValueError for MPT. transformers' MPT cannot run more than
  ``max_seq_len`` keys (its bias tensor has that length); poslsh has no such limit.

Padding (``attention_mask``, 2-D, 1 for tokens, 0 for padding; left- or right-padded batches,
``generate()`` with left padding): each batch row runs on its own non-padding keys with the
queries bottom-right aligned, i.e. its positions from 0 (BLOOM, Falcon) or its slot distances
(MPT), as above. Query rows at padding slots get zeros (transformers' values there are
meaningless and masked from every other token; so the logits at padding slots differ, and a
left-padded training batch whose labels make the last padding slot predict the first token has
a different loss: set those labels to -100). The cache: ``past_key_values``/``cache`` as the
model passes it (``DynamicCache``: its keys are every token so far); caches whose queries are
not the last slots (e.g. ``StaticCache``), 4-D masks, packed sequences given by
``position_ids`` and attention dropout in training (``p > 0``) raise ValueError.

**The bounded cache** (``BoundedCache``): ``DynamicCache`` keeps the keys and values of every
token, however far back the heads can read. ``BoundedCache(model, max_length, page_size=256)``
is a transformers ``Cache`` for a model set up by use_poslsh that keeps, per layer and batch
row, only the keys its heads can still read, as ``poslsh.torch.BoundedKVCache``:

    cache = poslsh.transformers.BoundedCache(model, max_length=prompt_length + 256)
    model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=256)

(``past_key_values=cache`` too, transformers' deprecated name). A banded head with band W drops
key j once t - j > W, an exact head with a window beyond it, an LSH head ("lsh",
"lsh_per_sample", "fixed_blocks", "mean_of_outputs") once t is past the end of j's block in
every sample (t the first position of the latest tokens); an exact head without a window keeps
every key. Each call of a layer's heads whose keys are dropped (a group of heads with one
method; the plan's banded heads, one call each, together) stores its keys in a poslsh
``BoundedKVCache`` of pages of ``page_size`` positions (pages of dead keys return to the pool),
read in place by the attention; the calls of exact heads without a window read a dense buffer,
as over a full cache. Every output (prefill,
chunked prefill with ``prefill_chunk_size``, decoding; left-padded batches; padding between
tokens for BLOOM and Falcon) is bitwise the one over ``DynamicCache`` under the same use_poslsh
settings. With method="plan" the cache's heads are fixed: those of the plan for
``plan_length`` keys (use_poslsh's keyword) when given, else for ``max_length`` keys, in every
call through the cache; give use_poslsh ``plan_length`` for a ``DynamicCache`` run with the same
heads. ``cache.bytes_in_use`` gives the bytes held (pages and dense rows),
``cache.full_cache_bytes()`` those of ``DynamicCache`` after the same calls.
``max_length`` is the most tokens a batch row holds (padding excluded): it sizes the pools
(reserved; memory is committed as pages are written) and the dense buffers; a row past it raises
ValueError naming it. MPT's config sets ``use_cache=False``: pass ``use_cache=True`` to
``generate()`` and to the model's calls (as with ``DynamicCache``; without it generate() feeds
every token again: ValueError naming 'use_cache'). Grouped-query Falcon under per-head methods or the
plan: each call stores the K/V heads its query heads read (a K/V head read by calls of
several methods is stored by each; once per query head where the call's query heads of one K/V
head are not contiguous), so the bytes can exceed ``DynamicCache``'s. Not supported (ValueError naming the argument): beam
search (``num_beams`` > 1: the rows cannot be reordered), assisted decoding (a cache that cannot
be cropped: transformers' own ValueError), selecting or repeating the rows of a filled cache, a
cache used with another model or other use_poslsh settings, or with a batch of another shape,
padding between tokens for MPT (``attention_mask``), gradients (inference only), and a model
whose attention is not poslsh's (its first operation on the cache's keys raises ValueError
naming 'cache': ``update`` returns markers, the keys are read through the cache).

``output_attentions`` gives None for the attention weights (no probability matrix is formed).
``torch.compile(model)`` runs with graph breaks (the padding bookkeeping reads the mask, the
decode kernel is not an operator); ``fullgraph=True`` is not supported.

How: the attention modules of BLOOM and MPT compute attention inline, so use_poslsh sets their
``forward`` as an instance attribute (the class's forward is untouched); Falcon calls
transformers' attention interface, where this module registers "poslsh_alibi"
(``IMPLEMENTATION``, in ``AttentionInterface`` and ``AttentionMaskInterface``, at import), and
use_poslsh sets ``use_alibi = False`` on the ``FalconModel`` so that it builds no dense bias.
For all three, use_poslsh sets ``config._attn_implementation = "poslsh_alibi"``:
``create_causal_mask`` then returns the 2-D padding mask (batch, L) instead of a
(batch, 1, L, L) mask, and the layers receive it. ``restore(model)`` undoes all of it (the
previous implementation, ``use_alibi`` and the classes' forward). No parameter or buffer is
added: ``state_dict()`` is unchanged, ``save_pretrained`` writes the model as transformers would
(``_attn_implementation`` is not saved) and keeps poslsh attention working on the saved model;
``from_pretrained`` gives transformers' own attention, and use_poslsh must be applied again to
the loaded model (``attn_implementation="poslsh_alibi"`` alone raises ValueError when the model
runs), as to a ``copy.deepcopy`` of a model set up (the copy raises ValueError until then).

For other models whose attention goes through ``AttentionInterface`` (unpadded batches, the
slopes on the modules), ``poslsh.torch.attention_forward`` is the generic attention function.
This module needs PyTorch and transformers; it is imported only on request.
"""

import math
import types
import weakref

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, prepare_padding_mask

from . import _core, _methods
from .flash import _method as _flash_method, _sigmas, _window, flash_attn_func
from .modules import _BOUNDED_DTYPES, _UNBOUNDED_CAPACITY, _binding_view, _pool_pages

__all__ = ["use_poslsh", "restore", "is_poslsh", "model_slopes", "attention_forward", "BoundedCache",
           "IMPLEMENTATION"]

# The name registered in transformers' attention and mask interfaces ("poslsh" is left to
# poslsh.torch.attention_forward, the generic function a user registers for other models).
IMPLEMENTATION = "poslsh_alibi"

_FUNCTION = "poslsh.transformers.use_poslsh"
_PLAN = "plan"

# Per attention module: its model's state (weak: nothing is kept alive by this module).
_LAYERS = weakref.WeakKeyDictionary()
# Per model (weak): the state use_poslsh set up, for restore().
_MODELS = weakref.WeakKeyDictionary()
# The configs of models set up by use_poslsh: id -> weak reference.
_CONFIGS = {}


def _fail(name, rule, error=ValueError, function=_FUNCTION):
    raise error(f"{function}: argument '{name}' {rule}")


# The models. ----------------------------------------------------------------------------------


def _families():
    """{kind: (base model class, attention class, modeling module)} of the installed transformers."""
    from transformers.models.bloom import modeling_bloom
    from transformers.models.falcon import modeling_falcon
    from transformers.models.mpt import modeling_mpt
    return {
        "bloom": (modeling_bloom.BloomModel, modeling_bloom.BloomAttention, modeling_bloom),
        "mpt": (modeling_mpt.MptModel, modeling_mpt.MptAttention, modeling_mpt),
        "falcon": (modeling_falcon.FalconModel, modeling_falcon.FalconAttention, modeling_falcon),
    }


def _find(model):
    """(kind, base model) of a BLOOM, MPT or Falcon model (the model itself or the base model it
    holds, e.g. BloomForCausalLM.transformer); TypeError for other models."""
    families = _families()
    for kind, (base_class, _, _) in families.items():
        if isinstance(model, base_class):
            return kind, model
    for kind, (base_class, _, _) in families.items():
        for module in model.modules():
            if isinstance(module, base_class):
                return kind, module
    raise TypeError(f"{_FUNCTION}: argument 'model' is a {type(model).__name__}: must be a transformers BLOOM, MPT "
                    "or Falcon (alibi=True) model (BloomModel, MptModel, FalconModel or a model holding one)")


def model_slopes(model):
    """The effective ALiBi slopes m_h (float32 tensor (heads,)) of a BLOOM, MPT or Falcon model:
    the bias per unit of key position added to the scaled scores, computed by the model's own
    slope code (module docstring)."""
    kind, base = _find(model)
    modeling = _families()[kind][2]
    if kind == "bloom":
        heads = base.num_heads
        ones = torch.ones((1, 2), dtype=torch.long)
        return base.build_alibi_tensor(ones, heads, torch.float32).reshape(heads, 2)[:, 1].clone()
    if kind == "mpt":
        heads = base.num_heads
        # As MptModel.forward calls it (alibi_bias_max left at its default); positions -1, 0.
        return (-base.build_mpt_alibi_tensor(heads, 2, device=torch.device("cpu"))[:, 0, 0]).float().contiguous()
    heads = base.num_heads
    ones = torch.ones((1, 2), dtype=torch.long)
    rounded = modeling.build_alibi_tensor(ones, heads, torch.float32).reshape(heads, 2)[:, 1]
    return (rounded / math.sqrt(base.config.hidden_size // heads)).float().contiguous()


# The methods. ---------------------------------------------------------------------------------


class _Group:
    """One flash_attn_func call of a layer: query heads `heads` (None: all), the K/V heads they
    read (`kv`: None for all, a slice, or an index tensor of one K/V head per query head; `kv_of`:
    for each of the call's query heads, its K/V head's index in the K/V tensor the call reads), the
    method and its keywords, the slopes of those heads."""

    def __init__(self, heads, kv, method, slopes, samples, band_error, window, kv_of, plan=None):
        self.heads, self.kv, self.method = heads, kv, method
        self.slopes, self.samples, self.band_error, self.window = slopes, samples, band_error, window
        self.kv_of, self.plan = kv_of, plan  # plan: the HeadPlan of a banded head of the plan


def _band_error(sigma, band):
    """The band_error for which band_for_bias_error(sigma, band_error) = ceil(sigma ln(1 /
    band_error)) is `band`: exp(-(band - 1/2) / sigma), nudged within the band's interval should
    rounding move the ceiling; None when there is none (band 0)."""
    for offset in (0.5, 0.25, 0.75, 0.1, 0.9):
        error = math.exp(-(band - offset) / sigma)
        if 0.0 < error < 1.0 and _core.band_for_bias_error(sigma, error) == band:
            return error
    return None


def _selection(indices, total):
    """None (all of `total`), a slice (a contiguous run) or an int64 index tensor."""
    indices = list(indices)
    if indices == list(range(total)):
        return None
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return torch.tensor(indices, dtype=torch.long)


def _kv_selection(heads, group_size, kv_heads):
    """The K/V heads of query heads `heads` (grouped-query: query head h reads K/V head
    h // group_size): None (all K/V heads, for all query heads), a slice (whole groups), or an
    index tensor with one K/V head per query head."""
    heads = list(heads)
    if heads == list(range(group_size * kv_heads)):
        return None
    first, count = heads[0], len(heads)
    if heads == list(range(first, first + count)) and first % group_size == 0 and count % group_size == 0:
        return slice(first // group_size, (first + count) // group_size)
    return torch.tensor([h // group_size for h in heads], dtype=torch.long)


class _State:
    """What a model's attention layers share: slopes, methods, options and small caches."""

    def __init__(self, kind, base, slopes, method, samples, seed, band_error, error, precision, plan_length):
        self.kind, self.slopes = kind, slopes
        self.plan_length = plan_length
        self.heads = slopes.shape[0]
        self.method, self.samples, self.seed = method, samples, seed
        self.band_error, self.error, self.precision = band_error, error, precision
        self.use_cache = True
        self.sigmas = [1.0 / float(s) for s in slopes.tolist()]
        self._groups = {}
        self._rows = None
        self.saved = {}

    def groups(self, length, kv_heads, head_dim):
        """The calls of a layer over `length` keys with `kv_heads` K/V heads: a list of _Group,
        and the head order of their concatenated outputs (None when it is 0..H-1). The plan is made
        for plan_length keys when use_poslsh was given one."""
        length = self.plan_length or length
        key = (length, kv_heads, head_dim) if self.method == _PLAN else (kv_heads,)
        if key not in self._groups:
            if len(self._groups) > 256:
                self._groups.clear()
            self._groups[key] = self._make_groups(length, kv_heads, head_dim)
        return self._groups[key]

    def _make_groups(self, length, kv_heads, head_dim):
        heads = self.heads
        size = heads // kv_heads
        # (heads, method, samples, band_error, window) of every call.
        calls = []
        banded = {}
        if isinstance(self.method, str) and self.method != _PLAN:
            calls.append((list(range(heads)), self.method, self.samples, self.band_error, (-1, -1)))
        elif isinstance(self.method, str):
            plans = _core.plan_heads(max(length, 1), self.sigmas, self.error, head_dim=head_dim, seed=self.seed,
                                     lsh_samplers=["independent"])
            exact = [h for h, p in enumerate(plans) if p.method == "exact_tiled"]
            if exact:
                calls.append((exact, "exact", self.samples, self.band_error, (-1, -1)))
            by_samples, banded = {}, {}
            for h, p in enumerate(plans):
                if p.method == "exact_banded":
                    error = _band_error(self.sigmas[h], p.band)
                    if error is None:  # the keys within the band: exact attention in that window
                        calls.append(([h], "exact", self.samples, self.band_error, (p.band, 0)))
                    else:
                        calls.append(([h], "banded", self.samples, error, (-1, -1)))
                        banded[h] = p
                elif p.method == "lsh_fused":
                    by_samples.setdefault(p.samples, []).append(h)
            for samples, members in by_samples.items():
                calls.append((members, "lsh", samples, self.band_error, (-1, -1)))
        else:
            by_method = {}
            for h, name in enumerate(self.method):
                by_method.setdefault(name, []).append(h)
            calls.extend((members, name, self.samples, self.band_error, (-1, -1))
                         for name, members in by_method.items())
        calls.sort(key=lambda call: call[0][0])
        groups = []
        for members, method, samples, band_error, window in calls:
            selection = _selection(members, heads)
            slopes = self.slopes if selection is None else self.slopes[torch.tensor(members)].contiguous()
            groups.append(_Group(selection, _kv_selection(members, size, kv_heads), method, slopes, samples,
                                 band_error, window, [h // size for h in members],
                                 banded.get(members[0]) if method == "banded" else None))
        order = [h for members, *_ in calls for h in members]
        inverse = None if order == list(range(heads)) else torch.from_numpy(np.argsort(order))
        return groups, inverse

    def rows(self, mask, queries):
        """Per batch row (key slots, query slots, key count, query count) of a (batch, L) bool
        padding mask and `queries` query rows (the last slots): slots as a slice (contiguous) or an
        index tensor; None when nothing is padded. Cached for the mask object of one forward."""
        cached = self._rows
        if cached is not None and cached[0] is mask and cached[1] == mask._version and cached[2] == queries:
            return cached[3]
        rows = None
        if not bool(mask.all()):
            rows = []
            slots = mask.detach().cpu().numpy()
            length = slots.shape[1]
            for b in range(slots.shape[0]):
                keys = np.nonzero(slots[b])[0]
                query_slots = np.nonzero(slots[b, length - queries:])[0]
                contiguous = len(keys) == 0 or keys[-1] - keys[0] + 1 == len(keys)
                if self.kind == "mpt" and not contiguous:
                    raise ValueError(
                        f"{_FUNCTION}: MPT's attention_mask has padding between tokens in batch row {b}: MPT biases "
                        "by key slot, which poslsh represents only for contiguous tokens (left or right padding)")
                rows.append((_slots(keys), _slots(query_slots), len(keys), len(query_slots)))
        self._rows = (mask, mask._version, queries, rows)
        return rows


def _slots(indices):
    """A slice for a contiguous run of indices (empty included), else an int64 index tensor."""
    if len(indices) == 0:
        return slice(0, 0)
    if indices[-1] - indices[0] + 1 == len(indices):
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))


def _take(x, axis, selection):
    if selection is None:
        return x
    if isinstance(selection, slice):
        return x[(slice(None),) * axis + (selection,)]
    return x.index_select(axis, selection)


# The attention. -------------------------------------------------------------------------------


# Decoding (at most this many query rows, no gradients) with the exact method goes to the
# library's decode kernel, head by head: flash_attn_func's tiled path costs about as much for one
# query row as for a tile of them.
_DECODE_ROWS = 16
_DECODE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _kernel_argument(x):
    """A CPU tensor as the library's functions read it in place (bfloat16: BFloat16Bits)."""
    x = x.detach()
    return _core.BFloat16Bits(x.view(torch.int16).numpy()) if x.dtype == torch.bfloat16 else x.numpy()


def _decodes(group, q, k, v):
    return (group.method in ("exact", "exact_tiled") and group.window == (-1, -1) and q.shape[0] == 1
            and q.shape[1] <= _DECODE_ROWS and q.dtype in _DECODE_DTYPES and q.dtype == k.dtype == v.dtype
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))))


def _decode_exact(state, group, q, k, v, scale):
    """The heads of `group` for q (1, m, H, d) over k, v (1, L, H_kv, d) by
    poslsh.alibi_attention_decode_exact (queries at positions L - m .. L - 1): (1, m, H_g, d_v)."""
    heads = _members(group, state.heads)
    length = k.shape[1]
    out = torch.empty((1, q.shape[1], len(heads), v.shape[3]), dtype=q.dtype)
    for column, (h, g) in enumerate(zip(heads, group.kv_of)):
        _core.alibi_attention_decode_exact(
            _kernel_argument(q[0, :, h]), _kernel_argument(k[0, :, g]), _kernel_argument(v[0, :, g]),
            length - 1, state.sigmas[h], scale=scale, out=_kernel_argument(out[0, :, column]))
    return out


def _members(group, heads):
    """The query heads of `group` (a list)."""
    if group.heads is None:
        return list(range(heads))
    if isinstance(group.heads, slice):
        return list(range(group.heads.start, group.heads.stop))
    return group.heads.tolist()


def _group_call(state, group, q, k, v, scale):
    """The heads of `group` for q (B, m, H, d) over k, v (B, n, *, d) (queries bottom-right): one
    flash_attn_func call, or the decode kernel for a decoding step of the exact method:
    (B, m, H_g, d_v)."""
    if _decodes(group, q, k, v):
        return _decode_exact(state, group, q, k, v, scale)
    return flash_attn_func(
        _take(q, 2, group.heads), _take(k, 2, group.kv), _take(v, 2, group.kv), 0.0, scale, True,
        group.window, 0.0, group.slopes, method=group.method, samples=group.samples, seed=state.seed,
        band_error=group.band_error, precision=state.precision)


def _joined(pieces, inverse):
    """The outputs of a layer's calls (B, m, H_g, d_v each) as (B, m, H, d_v) in head order."""
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    return out if inverse is None else out.index_select(2, inverse)


def _heads_call(state, q, k, v, scale):
    """Attention of q (B, m, H, d) over k, v (B, n, H_kv, d) (no padding, queries bottom-right),
    every group of heads in one flash_attn_func call (a decoding step of the exact method: the
    decode kernel): (B, m, H, d_v)."""
    groups, inverse = state.groups(k.shape[1], k.shape[2], q.shape[3])
    return _joined([_group_call(state, group, q, k, v, scale) for group in groups], inverse)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The "poslsh_alibi" entry of transformers' AttentionInterface (the signature of
    ``eager_attention_forward``): query (B, H, m, d), key and value (B, H_kv, L, d) after the
    cache update, attention_mask the (B, L) bool padding mask this module's mask function returns
    (True for tokens) or None; returns (output (B, m, H, d_v), None). The module must belong to a
    model set up by use_poslsh (its slopes and methods)."""
    state = _LAYERS.get(module)
    if state is None:
        raise ValueError(f"poslsh.transformers.attention_forward: argument 'module' is a {type(module).__name__} "
                         "that poslsh.transformers.use_poslsh(model) has not set up (attn_implementation="
                         f"'{IMPLEMENTATION}' alone does not: call use_poslsh on the model)")
    if dropout:
        raise ValueError(f"poslsh.transformers: attention dropout {dropout} in training is not supported by poslsh; "
                         "set the model's attention dropout to 0")
    scale = (1.0 / math.sqrt(query.shape[-1])) if scaling is None else float(scaling)
    if isinstance(key, _CachedKeys):  # a BoundedCache: its pages read in place
        return key._layer.attend(module, state, query, attention_mask, scale), None
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    batch, m, length = q.shape[0], q.shape[1], k.shape[1]
    mask = attention_mask
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"poslsh.transformers: the attention mask is {shape}: poslsh takes the 2-D padding mask "
                         "(batch, keys); 4-D masks are not supported")
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise ValueError(f"poslsh.transformers: the padding mask has shape {tuple(mask.shape)} for {length} keys "
                         f"and batch {batch}: poslsh supports caches whose keys are the tokens so far "
                         "(DynamicCache)")
    rows = None if mask is None else state.rows(mask, m)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if rows is None and (batch == 1 or m == length or grad):
        return _heads_call(state, q, k, v, scale), None
    if rows is None:  # decoding a batch: each row's cache read in place (no copy of the batch)
        rows = [(slice(0, length), slice(0, m), length, m)] * batch
    outs = []
    for b, (keys, queries, count_k, count_q) in enumerate(rows):
        if count_q == 0 or count_k == 0:
            outs.append(q.new_zeros((1, m, q.shape[2], v.shape[3])))
            continue
        out = _heads_call(state, _take(q[b:b + 1], 1, queries), _take(k[b:b + 1], 1, keys),
                          _take(v[b:b + 1], 1, keys), scale)
        if count_q != m:
            if isinstance(queries, slice):
                out = torch.nn.functional.pad(out, (0, 0, 0, 0, queries.start, m - queries.stop))
            else:
                out = out.new_zeros((1, m) + tuple(out.shape[2:])).index_copy(1, queries, out)
        outs.append(out)
    return torch.cat(outs, dim=0), None


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                  attention_mask=None, config=None, **kwargs):
    """The "poslsh_alibi" entry of transformers' AttentionMaskInterface: the (batch, kv_length) bool
    padding mask (True for tokens; all True without attention_mask), which the layers of a model
    set up by use_poslsh receive in place of a 4-D mask."""
    if config is not None:
        ref = _CONFIGS.get(id(config))
        if ref is None or ref() is not config:
            raise ValueError(f"poslsh.transformers: attn_implementation '{IMPLEMENTATION}' is set on a model that "
                             "poslsh.transformers.use_poslsh has not set up: call use_poslsh(model)")
    if mask_function is not causal_mask_function:
        raise ValueError("poslsh.transformers: the model asks for a mask other than causal with padding (packed "
                         "sequences given by position_ids, or an added mask function), which poslsh does not "
                         "represent")
    if int(kv_offset) != 0 or int(q_offset) + q_length != kv_length:
        raise ValueError(f"poslsh.transformers: the cache puts {q_length} queries at slot {int(q_offset)} of "
                         f"{kv_length} keys (offset {int(kv_offset)}): poslsh supports caches whose keys are the "
                         "tokens so far, the queries last (DynamicCache)")
    if attention_mask is None:
        return torch.ones((batch_size, kv_length), dtype=torch.bool)
    mask = prepare_padding_mask(attention_mask, kv_length, 0)[:, :kv_length].to(torch.bool)
    # transformers pads a shorter mask with padding (zeros) on the right: marked for BoundedCache,
    # whose new tokens would be taken for padding (e.g. generate() with use_cache=False).
    mask._poslsh_padded = attention_mask.shape[-1] < kv_length
    return mask


AttentionInterface.register(IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, _padding_mask)


# The attention modules of BLOOM and MPT (inline attention). ----------------------------------


def _check_dropout(module, p):
    if module.training and p > 0.0:
        raise ValueError(f"poslsh.transformers: {type(module).__name__} has attention dropout {p} in training, which "
                         "poslsh does not support; set it to 0 (config.attention_dropout / attn_config.attn_pdrop)")


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    """BloomAttention.forward with the attention product on poslsh (the projections, the cache
    update, the tensor-parallel slices and dropout_add as transformers')."""
    from transformers.models.bloom.modeling_bloom import dropout_add
    batch_size, q_length, _ = hidden_states.shape
    fused_qkv = self.query_key_value(hidden_states)
    query_layer, key_layer, value_layer = self._reshape(fused_qkv)
    if layer_past is not None:
        key_layer, value_layer = layer_past.update(key_layer, value_layer, self.layer_idx)
    _check_dropout(self, self.attention_dropout.p)
    context_layer, _ = attention_forward(self, query_layer, key_layer, value_layer, attention_mask,
                                         scaling=self.inv_norm_factor)
    context_layer = context_layer.reshape(batch_size, q_length, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output_tensor = torch.zeros_like(context_layer)
        for i in range(self.pretraining_tp):
            output_tensor = output_tensor + torch.nn.functional.linear(
                context_layer[:, :, int(i * slices):int((i + 1) * slices)],
                self.dense.weight[:, int(i * slices):int((i + 1) * slices)],
            )
    else:
        output_tensor = self.dense(context_layer)
    output_tensor = dropout_add(output_tensor, residual, self.hidden_dropout, self.training)
    return output_tensor, None


def _mpt_forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None, past_key_values=None,
                 **kwargs):
    """MptAttention.forward with the attention product on poslsh (projections, clip_qkv, the
    cache update and out_proj as transformers')."""
    if cache is None:
        cache = past_key_values
    batch_size, seq_length = hidden_states.shape[:2]
    mixed_qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query_states, key_states, value_states = mixed_qkv.chunk(3, dim=2)
    query_states = query_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
    key_states = key_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
    value_states = value_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    _check_dropout(self, float(self.attn_dropout_p or 0.0))
    context, _ = attention_forward(self, query_states, key_states, value_states, attention_mask,
                                   scaling=self.softmax_scale)
    return self.out_proj(context.reshape(batch_size, seq_length, -1)), None


_FORWARDS = {"bloom": _bloom_forward, "mpt": _mpt_forward}


# Public calls. --------------------------------------------------------------------------------


def _check_method(method, heads):
    accepted = _methods.accepted()
    names = ", ".join(repr(name) for name in accepted)
    if isinstance(method, str):
        if method != _PLAN and method not in accepted:
            _fail("method", f"is {method!r}: must be 'plan', one of {names}, or a list of those names, one per head")
        return method
    if isinstance(method, (list, tuple)):
        if len(method) != heads:
            _fail("method", f"has {len(method)} entries: must have one per query head ({heads})")
        for name in method:
            if not isinstance(name, str) or name not in accepted:
                _fail("method", f"holds {name!r}: each entry must be one of {names}")
        return tuple(method)
    _fail("method", f"must be a str or a list of str, got {type(method).__name__}", TypeError)


def use_poslsh(model, method="exact", *, samples=16, seed=0, band_error=1e-3, error=1e-2, precision="matrix_units",
               plan_length=None):
    """Runs the attention of a transformers BLOOM, MPT or Falcon (alibi=True) model on poslsh,
    in place, and returns the model (module docstring: formula, conventions, padding, caches).

    method: a flash_attn_func method name for every head ("exact", "banded", "lsh", ...), a list
    of names (one per query head), or "plan" (per head and key count, poslsh.plan_heads at
    relative output error `error`; with plan_length, the plan for plan_length keys in every
    call, as a BoundedCache runs it). samples, seed, band_error, precision: flash_attn_func's
    keywords. Calling it again replaces the settings; restore(model) undoes it. TypeError for
    other models, ValueError for a Falcon without ALiBi or a bad option."""
    kind, base = _find(model)
    config = base.config
    if kind == "falcon" and not config.alibi:
        _fail("model", "is a Falcon with alibi=False (rotary embeddings): poslsh computes ALiBi attention only")
    slopes = model_slopes(base)
    method = _check_method(method, slopes.shape[0])
    for name, value, low in (("samples", samples, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            _fail(name, f"is {value!r}: must be an int >= {low}")
    for name, value in (("band_error", band_error), ("error", error)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
            _fail(name, f"is {value!r}: must be a float in (0, 1)")
    if plan_length is not None and (isinstance(plan_length, bool) or not isinstance(plan_length, (int, np.integer))
                                    or plan_length < 1):
        _fail("plan_length", f"is {plan_length!r}: must be None or an int >= 1")
    if precision not in _core.precision_names():
        _fail("precision", f"is {precision!r}: must be one of {', '.join(map(repr, _core.precision_names()))}")
    for key in (model, base):
        if key in _MODELS:
            restore(key)
    state = _State(kind, base, slopes, method, int(samples), int(seed), float(band_error), float(error), precision,
                   None if plan_length is None else int(plan_length))
    # A model copied (copy.deepcopy) or loaded with attn_implementation="poslsh" goes back to eager.
    previous = config._attn_implementation
    state.saved["attn_implementation"] = "eager" if previous == IMPLEMENTATION else previous
    attention_class = _families()[kind][1]
    modules = [m for m in base.modules() if isinstance(m, attention_class)]
    for module in modules:
        _LAYERS[module] = state
        if kind in _FORWARDS:
            module.forward = types.MethodType(_FORWARDS[kind], module)
    if kind == "falcon":
        state.saved["use_alibi"] = bool(config.alibi)  # FalconModel's own value
        base.use_alibi = False
    state.hook = base.register_forward_pre_hook(_note_use_cache, with_kwargs=True)
    state.modules = modules
    state.base = base
    _CONFIGS[id(config)] = weakref.ref(config)
    config._attn_implementation = IMPLEMENTATION
    _MODELS[model] = state
    if base is not model:
        _MODELS[base] = state
    return model


def _note_use_cache(base, args, kwargs):
    """Forward pre-hook of the base model: whether this forward runs with use_cache (a
    BoundedCache refuses a forward without it, where generate() feeds every token again)."""
    state = _MODELS.get(base)
    if state is not None:
        use_cache = kwargs.get("use_cache")
        state.use_cache = bool(base.config.use_cache if use_cache is None else use_cache)


def restore(model):
    """Undoes use_poslsh on `model` (the model, or the base model inside it): transformers' own
    attention, the previous attn_implementation and Falcon's use_alibi. Returns the model; a
    model use_poslsh has not set up is returned unchanged."""
    state = _MODELS.get(model)
    if state is None:
        return model
    for module in state.modules:
        _LAYERS.pop(module, None)
        module.__dict__.pop("forward", None)
    base = state.base
    state.hook.remove()
    if "use_alibi" in state.saved:
        base.use_alibi = state.saved["use_alibi"]
    base.config._attn_implementation = state.saved["attn_implementation"]
    _CONFIGS.pop(id(base.config), None)
    for key in [m for m, s in _MODELS.items() if s is state]:
        del _MODELS[key]
    return model


def is_poslsh(model):
    """Whether use_poslsh has set up `model` (and restore has not undone it)."""
    return model in _MODELS


# The bounded cache. ---------------------------------------------------------------------------

_CACHE = "poslsh.transformers.BoundedCache"


class _CachedKeys(torch.Tensor):
    """What BoundedCache.update returns in place of the keys and of the values: a marker without
    data that poslsh's attention reads the cache through. Any torch operation on it raises
    ValueError: an attention other than poslsh's (a model use_poslsh has not set up) would
    otherwise read the new tokens only."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__str__):
            return f"<{_CACHE} keys of layer {args[0]._layer.index}>"
        raise ValueError(f"{_CACHE}: argument 'cache' is read by an attention that is not poslsh's ({func.__name__}"
                         " on its keys): use the cache with the model it was built for, set up by "
                         "poslsh.transformers.use_poslsh")


def _marker(layer):
    marker = torch.Tensor._make_subclass(_CachedKeys, torch.empty(0))
    marker._layer = layer
    return marker


class _PagedGroup:
    """The keys of calls of a layer whose heads drop keys: a poslsh BoundedKVCache with their heads
    (their query heads, the K/V heads they read), one sequence per batch row. One call, or the
    plan's banded heads of a layer (one call each, their bands differing) in one cache built from
    their plans (planned_head_methods: the same band W, so the same outputs per head)."""

    def __init__(self, state, groups, batch, kv_heads, dim, dim_v, dtype, max_length, page_size):
        function = "BoundedCache"
        members = [h for group in groups for h in _members(group, state.heads)]
        self.heads = _selection(members, state.heads)
        self.size = len(members)
        # The K/V head of each query head, each K/V head once when they come in whole runs.
        per_head = [g for group in groups for g in group.kv_of]
        distinct = list(dict.fromkeys(per_head))
        run = len(per_head) // len(distinct)
        if per_head == [distinct[i // run] for i in range(len(per_head))]:
            self.kv_heads = len(distinct)
            self.kv = None if distinct == list(range(kv_heads)) else torch.tensor(distinct, dtype=torch.long)
        else:
            self.kv_heads, self.kv = len(per_head), torch.tensor(per_head, dtype=torch.long)
        pages = _pool_pages(batch, self.kv_heads, max_length, page_size)
        common = (self.kv_heads, dim, dim_v, page_size, pages)
        if len(groups) > 1:
            self.core = _core.BoundedKVCache(*common, dtype=_BOUNDED_DTYPES[dtype],
                                             plans=[group.plan for group in groups])
        else:
            group = groups[0]
            _, left, right = _window(function, group.window, True, _UNBOUNDED_CAPACITY)
            self.core = _core.BoundedKVCache(
                *common, dtype=_BOUNDED_DTYPES[dtype], query_heads=len(members),
                method=_flash_method(function, group.method), sigmas=_sigmas(group.slopes.tolist(), len(members)),
                samples=group.samples, seed=state.seed, band_error=group.band_error, window=(left, right))
        self.sequences = [self.core.open() for _ in range(batch)]

    @property
    def bytes_in_use(self):
        return self.core.bytes_in_use


def _keeps_every_key(group):
    """Whether the heads of a call read every key (exact attention without a window)."""
    _, left, _ = _window("BoundedCache", group.window, True, _UNBOUNDED_CAPACITY)
    return _flash_method("BoundedCache", group.method) == "exact_tiled" and left < 0


class _LayerStore:
    """The keys and values of one layer in a BoundedCache: a _PagedGroup per call whose heads drop
    keys, and for the calls of exact heads without a window (they keep every key) one dense
    (batch, max_length, K/V heads they read, d) buffer, read by the same calls as a full cache."""

    def __init__(self, state, batch, kv_heads, dim, dim_v, dtype, max_length, page_size):
        self.shape = (batch, kv_heads, dim, dim_v, dtype)
        self.lengths = [0] * batch           # tokens (non-padding) of each row
        self.runs = [0] * batch              # MPT: 0 no token yet, 1 in the tokens, 2 padding after them
        groups, _ = state.groups(max_length, kv_heads, dim)
        dense = sorted({g for group in groups if _keeps_every_key(group) for g in group.kv_of})
        self.dense_heads = dense
        if dense:
            self.keys = torch.empty((batch, max_length, len(dense), dim), dtype=dtype)
            self.values = torch.empty((batch, max_length, len(dense), dim_v), dtype=dtype)
        banded = [group for group in groups if group.plan is not None]
        if len(banded) < 2:
            banded = []
        shape = (batch, kv_heads, dim, dim_v, dtype, max_length, page_size)
        self.calls = [_PagedGroup(state, banded, *shape)] if banded else []
        for group in groups:
            if _keeps_every_key(group):
                self.calls.append(self._local(group, dense, kv_heads))
            elif not any(group is other for other in banded):
                self.calls.append(_PagedGroup(state, [group], *shape))
        order = [h for call in self.calls for h in _members(call, state.heads)]
        self.inverse = None if order == list(range(state.heads)) else torch.from_numpy(np.argsort(order))

    @staticmethod
    def _local(group, dense, kv_heads):
        """The call `group` over the dense buffer's K/V heads `dense` (the same selection form)."""
        where = {g: i for i, g in enumerate(dense)}
        if group.kv is None:
            kv = None if dense == list(range(kv_heads)) else torch.tensor([where[g] for g in range(kv_heads)])
        elif isinstance(group.kv, slice):
            kv = slice(where[group.kv.start], where[group.kv.start] + group.kv.stop - group.kv.start)
        else:
            kv = torch.tensor([where[int(g)] for g in group.kv.tolist()], dtype=torch.long)
        return _Group(group.heads, kv, group.method, group.slopes, group.samples, group.band_error, group.window,
                      [where[g] for g in group.kv_of])

    def bytes_in_use(self):
        _, _, dim, dim_v, dtype = self.shape
        size = torch.empty((), dtype=dtype).element_size()
        dense = sum(self.lengths) * len(self.dense_heads) * (dim + dim_v) * size
        return dense + sum(call.bytes_in_use for call in self.calls if isinstance(call, _PagedGroup))


class _BoundedLayer(CacheLayerMixin):
    """One layer of a BoundedCache (transformers' cache layer interface)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache, index):
        super().__init__()
        self.cache, self.index = weakref.proxy(cache), index
        self.slots = 0
        self.pending = None
        self.store = None
        self.slot_bytes = 0  # bytes of one slot of every K/V head in a full cache

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Takes the new tokens' keys and values (batch, K/V heads, m, d), which poslsh's attention
        appends to the cache and reads in place; returns markers (_CachedKeys) for both."""
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                _fail(name, f"must be a 4-D tensor (batch, heads, tokens, head_dim), got "
                      f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}", function=_CACHE)
        if self.pending is not None:
            raise ValueError(f"{_CACHE}: argument 'cache' got new keys for layer {self.index} before poslsh's "
                             "attention read the previous ones: the model does not run poslsh attention (use the "
                             "cache with the model it was built for, set up by poslsh.transformers.use_poslsh)")
        self.is_initialized = True
        self.pending = (key_states, value_states)
        return _marker(self), _marker(self)

    def get_mask_sizes(self, query_length):
        return self.slots + query_length, 0

    def get_seq_length(self):
        return self.slots

    def get_max_length(self):
        return -1

    def reset(self):
        self.slots, self.pending, self.store, self.is_initialized = 0, None, None, False

    def reorder_cache(self, beam_idx):
        raise ValueError(f"{_CACHE}: argument 'num_beams' > 1 (beam search) reorders the cache's rows, which a "
                         "bounded cache cannot (the rows' dropped keys differ); use num_beams=1 or a DynamicCache")

    def crop(self, tokens_to_remove):
        if tokens_to_remove:
            raise ValueError(f"{_CACHE}: argument 'tokens_to_remove' is {tokens_to_remove}: a bounded cache cannot "
                             "be cropped (assisted decoding, rollbacks); use a DynamicCache")

    def batch_repeat_interleave(self, repeats):
        if repeats != 1 and self.store is not None:
            raise ValueError(f"{_CACHE}: argument 'repeats' is {repeats}: a bounded cache holding tokens cannot "
                             "repeat its rows (num_return_sequences > 1 from a filled cache); use a new cache")

    def batch_select_indices(self, indices):
        raise ValueError(f"{_CACHE}: argument 'indices': a bounded cache cannot select rows; use a DynamicCache")

    def offload(self):
        pass

    def prefetch(self):
        pass

    def attend(self, module, state, query, attention_mask, scale):
        """poslsh's attention of query (B, H, m, d) with the pending keys and values appended to the
        cache: (B, m, H, d_v), each row as attention_forward computes it over a full cache."""
        cache = self.cache
        if cache.state is not state:
            raise ValueError(f"{_CACHE}: argument 'cache' was built for another model or other use_poslsh "
                             f"settings than the {type(module).__name__}'s: build a BoundedCache for this model")
        (key, value), self.pending = self.pending, None
        if not state.use_cache:
            _fail("use_cache", "is False in this forward: the tokens already in the cache would be appended again "
                  "(generate() feeds every token without a cache); pass use_cache=True (MPT's config defaults to "
                  "False)", function=_CACHE)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
            raise ValueError(f"{_CACHE}: argument 'cache' is used while autograd records: the bounded cache is "
                             "inference only (generate(), or call the model under torch.no_grad())")
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        batch, m, kv_heads, dim, dim_v = q.shape[0], q.shape[1], k.shape[2], k.shape[3], v.shape[3]
        length = self.slots + m
        if k.dtype not in _BOUNDED_DTYPES or k.device.type != "cpu":
            _fail("cache", f"holds keys of {k.dtype} on {k.device}: the bounded cache stores CPU float32, bfloat16, "
                  "float16 or float64 keys", TypeError, _CACHE)
        shape = (batch, kv_heads, dim, dim_v, k.dtype)
        if self.store is None:
            self.store = _LayerStore(state, batch, kv_heads, dim, dim_v, k.dtype, cache.max_length, cache.page_size)
            self.slot_bytes = kv_heads * (dim + dim_v) * k.element_size()
        elif self.store.shape != shape:
            _fail("cache", f"holds rows of (batch, K/V heads, d, d_v, dtype) = {self.store.shape}: got {shape} (a "
                  "cache is for one batch of one model; build a new one)", function=_CACHE)
        store = self.store
        if attention_mask is None:
            new = np.ones((batch, m), dtype=bool)
            padded = False
        else:
            mask = attention_mask
            if getattr(mask, "_poslsh_padded", False):
                _fail("attention_mask", f"covers fewer slots than the cache's {length}: the new tokens would be "
                      "taken for padding (generate() with use_cache=False feeds every token again: pass "
                      "use_cache=True)", function=_CACHE)
            if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, length):
                got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                _fail("attention_mask", f"has shape {got}: the bounded cache takes the 2-D padding mask "
                      f"(batch, keys) = ({batch}, {length})", function=_CACHE)
            new = mask[:, length - m:].detach().cpu().numpy().astype(bool)
            padded = not bool(mask.all())
        padded = padded or any(n != self.slots for n in store.lengths)
        slots = [np.nonzero(new[b])[0] for b in range(batch)]
        runs = list(store.runs)
        for b in range(batch):
            if state.kind == "mpt":
                runs[b] = _mpt_run(runs[b], slots[b], m, b)
            if store.lengths[b] + len(slots[b]) > cache.max_length:
                _fail("max_length", f"is {cache.max_length}: batch row {b} would hold "
                      f"{store.lengths[b] + len(slots[b])} tokens", function=_CACHE)
        # Nothing has changed so far; now append, then attend.
        rows = [b for b in range(batch) if len(slots[b])]
        takes = [_slots(slots[b]) for b in range(batch)]
        pieces = []
        for call in store.calls:
            if isinstance(call, _PagedGroup):
                pieces.append(_paged_call(call, state, q, k, v, rows, takes, store.lengths, scale))
            else:
                pieces.append(_dense_call(store, call, state, q, k, v, rows, takes, padded, length, scale))
        for b in rows:
            store.lengths[b] += len(slots[b])
        store.runs = runs
        self.slots = length
        return _joined(pieces, store.inverse)


def _mpt_run(run, slots, m, row):
    """MPT's token run state of a batch row after new slots (0 none yet, 1 in the tokens, 2
    padding after them); ValueError for padding between tokens (MPT biases by slot)."""
    if len(slots):
        if run == 2 or slots[-1] - slots[0] + 1 != len(slots) or (run == 1 and slots[0] != 0):
            _fail("attention_mask", f"has padding between tokens in batch row {row}: MPT biases by key slot, which "
                  "the bounded cache represents only for contiguous tokens", function=_CACHE)
        return 1 if slots[-1] == m - 1 else 2
    return 2 if run == 1 else run


def _paged_call(call, state, q, k, v, rows, takes, lengths, scale):
    """Appends the new tokens of the rows to call's bounded cache and attends: (B, m, H_g, d_v)."""
    out = q.new_zeros((q.shape[0], q.shape[1], call.size, v.shape[3]))
    if not rows:
        return out
    for b in rows:
        k_b = _take(_take(k[b], 0, takes[b]), 1, call.kv).contiguous()
        v_b = _take(_take(v[b], 0, takes[b]), 1, call.kv).contiguous()
        call.core.append(call.sequences[b], lengths[b], _binding_view(k_b), _binding_view(v_b))
    flat = torch.cat([_take(_take(q[b], 0, takes[b]), 1, call.heads) for b in rows]).contiguous()
    counts = [_count(takes[b]) for b in rows]
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    result = torch.empty((flat.shape[0], out.shape[2], out.shape[3]), dtype=q.dtype)
    call.core.attention(_binding_view(flat), [call.sequences[b] for b in rows], cu, masking="causal", scale=scale,
                        out=_binding_view(result), precision=state.precision)
    for b, piece in zip(rows, torch.split(result, counts)):
        out[b, takes[b]] = piece
    return out


def _count(take):
    """The number of slots a _slots selection takes."""
    return take.stop - take.start if isinstance(take, slice) else len(take)


def _dense_call(store, group, state, q, k, v, rows, takes, padded, length, scale):
    """Appends the new tokens of the rows to the dense buffer and attends as attention_forward
    does over a full cache (one call for an unpadded batch's prefill or a batch of one, else row
    by row): (B, m, H_g, d_v)."""
    heads = store.dense_heads
    select = None if heads == list(range(k.shape[2])) else torch.tensor(heads, dtype=torch.long)
    for b in rows:
        n, count = store.lengths[b], _count(takes[b])
        store.keys[b, n:n + count] = _take(_take(k[b], 0, takes[b]), 1, select)
        store.values[b, n:n + count] = _take(_take(v[b], 0, takes[b]), 1, select)
    batch, m = q.shape[0], q.shape[1]
    if not padded and (batch == 1 or m == length):
        return _group_call(state, group, q, store.keys[:, :length], store.values[:, :length], scale)
    out = q.new_zeros((batch, m, len(_members(group, state.heads)), v.shape[3]))
    for b in rows:
        n = store.lengths[b] + _count(takes[b])
        out[b:b + 1, takes[b]] = _group_call(state, group, _take(q[b:b + 1], 1, takes[b]), store.keys[b:b + 1, :n],
                                             store.values[b:b + 1, :n], scale)
    return out


class BoundedCache(Cache):
    """A transformers ``Cache`` for generation with a model set up by use_poslsh that keeps, per
    layer and batch row, only the keys and values the layer's heads can still read (module
    docstring, "The bounded cache"):

        cache = poslsh.transformers.BoundedCache(model, max_length=prompt + new_tokens)
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens)

    max_length: the most tokens (non-padding) a batch row will hold; it sizes the page pools
    (reserved, committed only as pages are written and reused once released) and the buffers of
    exact heads without a window; a row past it raises ValueError naming it. page_size: positions
    per page, a positive multiple of 64. With method="plan", the heads are those of the plan for
    use_poslsh's plan_length keys when given, else for max_length keys, in every call through the
    cache.

    bytes_in_use: bytes of the keys and values held; full_cache_bytes(): what a DynamicCache
    holds for the same calls. Inference only; one batch of one model per cache."""

    def __init__(self, model, max_length, *, page_size=256):
        state = _MODELS.get(model)
        if state is None:
            _find(model)  # TypeError for other models
            _fail("model", "has not been set up by poslsh.transformers.use_poslsh (or was restored): the cache's "
                  "heads are use_poslsh's", function=_CACHE)
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
            _fail("max_length", f"is {max_length!r}: must be an int >= 1 (the most tokens of a batch row)",
                  function=_CACHE)
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 64 \
                or page_size % 64:
            _fail("page_size", f"is {page_size!r}: must be a positive multiple of 64", function=_CACHE)
        self.state, self.max_length, self.page_size = state, int(max_length), int(page_size)
        super().__init__(layers=[_BoundedLayer(self, i) for i in range(len(state.modules))])

    def reorder_cache(self, beam_idx):
        self.layers[0].reorder_cache(beam_idx)

    @property
    def bytes_in_use(self):
        """Bytes of the keys and values the cache holds (pages of the bounded caches, rows of the
        heads that keep every key)."""
        return sum(layer.store.bytes_in_use() for layer in self.layers if layer.store is not None)

    def full_cache_bytes(self):
        """Bytes a DynamicCache holds after the same calls: every slot of every row and K/V head."""
        return sum(layer.slots * layer.store.shape[0] * layer.slot_bytes for layer in self.layers
                   if layer.store is not None)
