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
The memory of generation stays transformers': ``DynamicCache`` keeps the keys and values of
every token, however far back the heads can read. poslsh's bounded cache (keys dropped once no
later query reads them: ``poslsh.torch.BoundedKVCache``) is not a transformers ``Cache``; it is
used through ``poslsh.torch.AlibiSelfAttention`` (``KVCache.for_module(..., bounded=True)``) or
its own ``attention(q, k, v)`` calls.
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
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, prepare_padding_mask

from . import _core, _methods
from .flash import flash_attn_func

__all__ = ["use_poslsh", "restore", "is_poslsh", "model_slopes", "attention_forward", "IMPLEMENTATION"]

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
    read (`kv`: None for all, a slice, or an index tensor of one K/V head per query head), the
    method and its keywords, the slopes of those heads."""

    def __init__(self, heads, kv, method, slopes, samples, band_error, window=(-1, -1)):
        self.heads, self.kv, self.method = heads, kv, method
        self.slopes, self.samples, self.band_error, self.window = slopes, samples, band_error, window


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

    def __init__(self, kind, base, slopes, method, samples, seed, band_error, error, precision):
        self.kind, self.slopes = kind, slopes
        self.heads = slopes.shape[0]
        self.method, self.samples, self.seed = method, samples, seed
        self.band_error, self.error, self.precision = band_error, error, precision
        self.sigmas = [1.0 / float(s) for s in slopes.tolist()]
        self._groups = {}
        self._rows = None
        self.saved = {}

    def groups(self, length, kv_heads, head_dim):
        """The calls of a layer over `length` keys with `kv_heads` K/V heads: a list of _Group,
        and the head order of their concatenated outputs (None when it is 0..H-1)."""
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
        if isinstance(self.method, str) and self.method != _PLAN:
            calls.append((list(range(heads)), self.method, self.samples, self.band_error, (-1, -1)))
        elif isinstance(self.method, str):
            plans = _core.plan_heads(max(length, 1), self.sigmas, self.error, head_dim=head_dim, seed=self.seed,
                                     lsh_samplers=["independent"])
            exact = [h for h, p in enumerate(plans) if p.method == "exact_tiled"]
            if exact:
                calls.append((exact, "exact", self.samples, self.band_error, (-1, -1)))
            by_samples = {}
            for h, p in enumerate(plans):
                if p.method == "exact_banded":
                    error = _band_error(self.sigmas[h], p.band)
                    if error is None:  # the keys within the band: exact attention in that window
                        calls.append(([h], "exact", self.samples, self.band_error, (p.band, 0)))
                    else:
                        calls.append(([h], "banded", self.samples, error, (-1, -1)))
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
                                 band_error, window))
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
    heads = list(range(state.heads)) if group.heads is None else (
        list(range(group.heads.start, group.heads.stop)) if isinstance(group.heads, slice) else group.heads.tolist())
    size = state.heads // k.shape[2]
    length = k.shape[1]
    out = torch.empty((1, q.shape[1], len(heads), v.shape[3]), dtype=q.dtype)
    for column, h in enumerate(heads):
        _core.alibi_attention_decode_exact(
            _kernel_argument(q[0, :, h]), _kernel_argument(k[0, :, h // size]), _kernel_argument(v[0, :, h // size]),
            length - 1, state.sigmas[h], scale=scale, out=_kernel_argument(out[0, :, column]))
    return out


def _heads_call(state, q, k, v, scale):
    """Attention of q (B, m, H, d) over k, v (B, n, H_kv, d) (no padding, queries bottom-right),
    every group of heads in one flash_attn_func call (a decoding step of the exact method: the
    decode kernel): (B, m, H, d_v)."""
    groups, inverse = state.groups(k.shape[1], k.shape[2], q.shape[3])
    pieces = []
    for group in groups:
        if _decodes(group, q, k, v):
            pieces.append(_decode_exact(state, group, q, k, v, scale))
            continue
        pieces.append(flash_attn_func(
            _take(q, 2, group.heads), _take(k, 2, group.kv), _take(v, 2, group.kv), 0.0, scale, True,
            group.window, 0.0, group.slopes, method=group.method, samples=group.samples, seed=state.seed,
            band_error=group.band_error, precision=state.precision))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    return out if inverse is None else out.index_select(2, inverse)


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
    return prepare_padding_mask(attention_mask, kv_length, 0)[:, :kv_length].to(torch.bool)


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


def use_poslsh(model, method="exact", *, samples=16, seed=0, band_error=1e-3, error=1e-2, precision="matrix_units"):
    """Runs the attention of a transformers BLOOM, MPT or Falcon (alibi=True) model on poslsh,
    in place, and returns the model (module docstring: formula, conventions, padding, caches).

    method: a flash_attn_func method name for every head ("exact", "banded", "lsh", ...), a list
    of names (one per query head), or "plan" (per head and key count, poslsh.plan_heads at
    relative output error `error`). samples, seed, band_error, precision: flash_attn_func's
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
    if precision not in _core.precision_names():
        _fail("precision", f"is {precision!r}: must be one of {', '.join(map(repr, _core.precision_names()))}")
    for key in (model, base):
        if key in _MODELS:
            restore(key)
    state = _State(kind, base, slopes, method, int(samples), int(seed), float(band_error), float(error), precision)
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
    state.modules = modules
    state.base = base
    _CONFIGS[id(config)] = weakref.ref(config)
    config._attn_implementation = IMPLEMENTATION
    _MODELS[model] = state
    if base is not model:
        _MODELS[base] = state
    return model


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
