"""Context parallelism over torch.distributed: one sequence sharded over the ranks of a group.

    out = poslsh.distributed.context_parallel_attention(q, k, v, group=None, method="lsh_fused",
                                                        masking="causal", layout="contiguous", ...)

Each rank holds its shard of the sequence: q [n_local, H, d], k and v [n_local, H_kv, d] and
[n_local, H_kv, d_v] (CPU torch tensors, float32 or float64, layout 'nhd'), and gets its rows
of the single-process poslsh.torch.multihead_attention on the whole sequence, differentiable in
q, k, v. Shard layouts (poslsh.shard_ranges):

- 'contiguous': rank r holds one range of positions, ranks in order. Shard lengths may differ
  from rank to rank (they are exchanged); n is their sum.
- 'zigzag': the n positions are cut in 2R chunks [n c // 2R, n (c + 1) // 2R) and rank r holds
  chunks r and 2R - 1 - r, concatenated in increasing position order (balanced causal work);
  the lengths must be those of poslsh.shard_ranges.

Transport: this module only moves buffers between ranks (torch.distributed isend/irecv and
collectives); every plan, message layout and piece of attention arithmetic is the C++ library's
(poslsh/parallel/), through poslsh._core.ContextParallelPlan and its rank(...) object, the same
calls as examples/mpi_context_parallel.cpp.

- Halo methods (lsh_fused, lsh_per_sample, fixed_blocks, exact_banded, exact_tiled with a local
  window): each rank sends every peer the message ContextParallelRank.pack packs (per
  destination chunk, K/V head and position range of the rows of the sender's shard that the
  destination reads: K then V rows; the backward adds the Q, out, dout rows and lse of the K/V
  head's query heads), one message per peer, and computes its rows from the messages it
  receives (halo_forward, halo_backward on the plan's 'keys' and 'window'): the rows and the
  gradients are BITWISE the single-process call, and no gradient is sent back.
- Ring (exact_tiled without a local window): K and V go around the ring (R - 1 steps, the next
  transfer posted before the current step's attention; ContextParallelRank.ring_step); each
  step's slices are merged by log-sum-exp (RingForward); the backward passes K and V around
  again and computes the exact gradients of every slice with the merged lse (RingBackward),
  then returns the dK/dV partials to their owners, added there in increasing rank order.
  Equal to the single-process call to rounding.

Byte counting (the optional ``stats`` dict): 'forward_bytes_sent', 'forward_bytes_received',
'backward_bytes_sent', 'backward_bytes_received' count the payload of the tensors moved between
this rank and the other ranks by point-to-point messages: numel times the element size of every
message sent or received (rows of K, V, Q, out, dout, lse and, for the ring, of dK and dV). Rows
a rank holds itself are copied, not counted; the small records exchanged by collectives
(arguments, shard lengths) are metadata and not counted. 'messages' counts the point-to-point
messages this rank sent plus those it received (empty messages are never sent), forward and
backward; 'forward_messages' and 'backward_messages' split it. A halo forward receives, per own
chunk and K/V head g, the rows of keys[g] that lie outside the rank's own shard, each
(d + d_v) elements; the halo backward, per own chunk and g, the rows of window[g] outside the
own shard, each d + d_v + G (d + 2 d_v + 1) elements (K, V; and Q, out, dout, lse of the G
query heads of g). poslsh._core.ContextParallelPlan(...).traffic(d, d_v, itemsize) gives the same
counts from the plan alone (transport='ring' for the ring).

Before any attention every rank all_gathers a record of its arguments and of its local checks:
if a rank's check failed, every rank raises that rank's error; if an argument differs across
ranks, every rank raises a ValueError naming it. Only collectives every rank reaches are used
before the transfers, so a bad call raises instead of hanging.

Helpers: shard(x, rank, world_size, layout) (a rank's rows of a whole-sequence tensor),
unshard(parts, layout) (its inverse over all ranks' parts) and gather_sequence(local, group,
layout) (all_gather and unshard).
"""

import numpy as np
import torch
import torch.distributed as dist

from . import _core

__all__ = ["context_parallel_attention", "ContextParallelAttention", "shard", "unshard", "gather_sequence"]

_FUNCTION = "poslsh.distributed.context_parallel_attention"
_LAYOUTS = ("contiguous", "zigzag")
_DTYPES = (torch.float32, torch.float64)
_STATS = ("forward_bytes_sent", "forward_bytes_received", "backward_bytes_sent", "backward_bytes_received", "messages",
          "forward_messages", "backward_messages")


# Shards of a whole-sequence tensor. -------------------------------------------------------------

def _layout(layout, function):
    if layout not in _LAYOUTS:
        raise ValueError(f"{function}: argument 'layout' = {layout!r} must be 'contiguous' or 'zigzag'")
    return layout


def _cat(pieces, dim, like):
    if isinstance(like, np.ndarray):
        return np.concatenate(pieces, axis=dim)
    return torch.cat(pieces, dim=dim)


def _narrow(x, dim, begin, end):
    if isinstance(x, np.ndarray):
        index = [slice(None)] * x.ndim
        index[dim] = slice(begin, end)
        return x[tuple(index)]
    return x.narrow(dim, begin, end - begin)


def shard(x, rank, world_size, layout="contiguous", dim=0):
    """The rows of rank `rank` of `world_size` of a whole-sequence tensor (or numpy array) `x`
    along `dim` (poslsh.shard_ranges): contiguous, a view of one range; zigzag, its two chunks
    concatenated in increasing position order."""
    _layout(layout, "poslsh.distributed.shard")
    ranges = _core.shard_ranges(x.shape[dim], world_size, rank, layout=layout)
    if len(ranges) == 1:
        return _narrow(x, dim, *ranges[0])
    return _cat([_narrow(x, dim, b, e) for b, e in ranges], dim, x)


def _zigzag_lengths(n, ranks):
    return [sum(e - b for b, e in _core.shard_ranges(n, ranks, r, layout="zigzag")) for r in range(ranks)]


def unshard(parts, layout="contiguous", dim=0):
    """The whole-sequence tensor from the list of every rank's part (rank order), the inverse of
    shard: contiguous, the parts concatenated (any lengths); zigzag, each part's two chunks put
    back at their positions (the lengths must be those of poslsh.shard_ranges)."""
    function = "poslsh.distributed.unshard"
    _layout(layout, function)
    parts = list(parts)
    if not parts:
        raise ValueError(f"{function}: argument 'parts' is empty: give every rank's part")
    if layout == "contiguous":
        return _cat(parts, dim, parts[0])
    ranks = len(parts)
    lengths = [part.shape[dim] for part in parts]
    n = sum(lengths)
    expected = _zigzag_lengths(n, ranks)
    if lengths != expected:
        raise ValueError(f"{function}: the parts hold {lengths} rows along dim {dim}: layout 'zigzag' over "
                         f"{n} rows and {ranks} ranks needs {expected}")
    chunks = []
    for r, part in enumerate(parts):
        local = 0
        for b, e in _core.shard_ranges(n, ranks, r, layout="zigzag"):
            chunks.append((b, _narrow(part, dim, local, local + e - b)))
            local += e - b
    chunks.sort(key=lambda item: item[0])
    return _cat([chunk for _, chunk in chunks], dim, parts[0])


def _rank_and_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


def gather_sequence(local, group=None, layout="contiguous", dim=0):
    """Every rank's part of a sequence along `dim` (lengths may differ for 'contiguous'),
    all_gathered over `group` and unsharded: the whole-sequence tensor, on every rank."""
    _layout(layout, "poslsh.distributed.gather_sequence")
    rank, size = _rank_and_size(group)
    lengths = [None] * size
    dist.all_gather_object(lengths, int(local.shape[dim]), group=group)
    longest = max(lengths)
    padded = local.movedim(dim, 0).contiguous()
    if padded.shape[0] < longest:
        padded = torch.cat([padded, padded.new_zeros((longest - padded.shape[0],) + padded.shape[1:])])
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    parts = [g[:length].movedim(0, dim) for g, length in zip(gathered, lengths)]
    return unshard(parts, layout=layout, dim=dim)


# Point-to-point transport. ---------------------------------------------------------------------

def _global_rank(group, rank):
    if group is None or group is dist.group.WORLD:
        return rank
    getter = getattr(dist, "get_global_rank", None)
    if getter is None:
        getter = dist.distributed_c10d._get_global_rank
    return getter(group, rank)


class _Transport:
    """Point-to-point messages of one call over a group, counted into a stats dict."""

    def __init__(self, group, rank, size, stats):
        self.group, self.rank, self.size, self.stats = group, rank, size, stats
        self.peers = [_global_rank(group, r) for r in range(size)]

    def _count(self, phase, sent, received, messages):
        if self.stats is None:
            return
        self.stats[phase + "_bytes_sent"] += sent
        self.stats[phase + "_bytes_received"] += received
        self.stats[phase + "_messages"] += messages
        self.stats["messages"] += messages

    def start(self, phase, sends, receives):
        """Posts the receives (peer -> flat tensor to fill) and the sends (peer -> flat tensor),
        empty ones skipped; returns the requests."""
        requests, sent, received, messages = [], 0, 0, 0
        for peer, buffer in receives.items():
            if buffer.numel():
                requests.append(dist.irecv(buffer, src=self.peers[peer], group=self.group))
                received += buffer.numel() * buffer.element_size()
                messages += 1
        for peer, buffer in sends.items():
            if buffer.numel():
                requests.append(dist.isend(buffer, dst=self.peers[peer], group=self.group))
                sent += buffer.numel() * buffer.element_size()
                messages += 1
        self._count(phase, sent, received, messages)
        return requests

    @staticmethod
    def wait(requests):
        for request in requests:
            request.wait()

    def exchange(self, phase, sends, receives):
        self.wait(self.start(phase, sends, receives))


# Arguments and their check across ranks. -------------------------------------------------------

def _check_local(q, k, v, keywords, layout, num_threads):
    """The local checks of one rank; returns the record of its arguments."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_FUNCTION}: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"{_FUNCTION}: argument '{name}' is on {x.device}: only CPU tensors are supported")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{_FUNCTION}: argument '{name}' has dtype {x.dtype}: must be torch.float32 or "
                            "torch.float64")
        if x.dim() != 3:
            raise ValueError(f"{_FUNCTION}: argument '{name}' has shape {tuple(x.shape)}: must be [n_local, heads, "
                             "dim] (layout 'nhd')")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{_FUNCTION}: argument '{name}' has dtype {x.dtype}: must be {q.dtype} like 'q'")
        if x.shape[0] != q.shape[0]:
            raise ValueError(f"{_FUNCTION}: argument '{name}' has shape {tuple(x.shape)}: must hold the {q.shape[0]} "
                             "tokens of 'q' (this rank's shard)")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"{_FUNCTION}: argument 'v' has shape {tuple(v.shape)}: must have the {k.shape[1]} heads of "
                         "'k'")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{_FUNCTION}: argument 'k' has shape {tuple(k.shape)}: must have the head dim "
                         f"{q.shape[2]} of 'q'")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{_FUNCTION}: argument 'k' has {k.shape[1]} heads: must divide the {q.shape[1]} query "
                         "heads of 'q'")
    _layout(layout, _FUNCTION)
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"{_FUNCTION}: argument 'num_threads' = {num_threads!r} must be None or an int >= 1")
    # The keywords as the compiled functions check them (names, sigmas per head, window).
    _core.context_parallel_plan(q.shape[0], 1, query_heads=q.shape[1], kv_heads=k.shape[1], **keywords)


def _record(q, k, v, keywords, layout):
    def shape(x, axis):
        return int(x.shape[axis]) if isinstance(x, torch.Tensor) and x.dim() == 3 else None

    return {
        **{name: keywords[name] for name in ("method", "masking", "scale", "sigmas", "samples", "seed",
                                             "band_error", "window")},
        "layout": layout,
        "query_heads": shape(q, 1),
        "kv_heads": shape(k, 1),
        "head_dim": shape(q, 2),
        "value_head_dim": shape(v, 2),
        "dtype": str(q.dtype) if isinstance(q, torch.Tensor) else None,
    }


_COMPARED = ("method", "masking", "scale", "sigmas", "samples", "seed", "band_error", "window", "layout",
             "query_heads", "kv_heads", "head_dim", "value_head_dim", "dtype")
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def _normalize(keywords):
    """The keywords in the form the compiled functions take (and the records compare)."""
    keywords = dict(keywords)
    if keywords["scale"] is not None:
        keywords["scale"] = float(keywords["scale"])
    if keywords["sigmas"] is not None:
        keywords["sigmas"] = [float(x) for x in keywords["sigmas"]]
    window = tuple(int(x) for x in keywords["window"])
    if len(window) != 2:
        raise ValueError(f"{_FUNCTION}: argument 'window' = {keywords['window']!r} must be (left, right)")
    keywords["window"] = window
    keywords["samples"], keywords["seed"] = int(keywords["samples"]), int(keywords["seed"])
    keywords["band_error"] = float(keywords["band_error"])
    return keywords


def _agree(q, k, v, keywords, layout, num_threads, group, rank, size):
    """all_gathers every rank's record and raises on every rank if a check failed or an argument
    differs; returns the shard lengths and the keywords in the compiled functions' form."""
    entry = {"error": None, "record": None, "tokens": None}
    try:
        keywords = _normalize(keywords)
        entry["record"] = _record(q, k, v, keywords, layout)
        entry["tokens"] = int(q.shape[0]) if isinstance(q, torch.Tensor) and q.dim() >= 1 else None
        _check_local(q, k, v, keywords, layout, num_threads)
    except Exception as error:  # noqa: BLE001 -- reported to every rank below
        entry["error"] = (type(error).__name__, str(error))
    entries = [None] * size
    dist.all_gather_object(entries, entry, group=group)
    failed = [(r, e["error"]) for r, e in enumerate(entries) if e["error"] is not None]
    if failed:
        r, (kind, message) = failed[0]
        others = "" if len(failed) == 1 else f" (ranks {[f for f, _ in failed[1:]]} failed too)"
        raise _ERRORS.get(kind, RuntimeError)(f"{_FUNCTION}: rank {r} of {size} failed its checks{others}: {message}")
    for name in _COMPARED:
        values = [e["record"][name] for e in entries]
        if any(value != values[0] for value in values[1:]):
            listed = ", ".join(f"rank {r}: {value!r}" for r, value in enumerate(values))
            raise ValueError(f"{_FUNCTION}: {name!r} differs across ranks: {listed}; every rank must pass the "
                             "same value")
    lengths = [e["tokens"] for e in entries]
    n = sum(lengths)
    if layout == "zigzag":
        expected = _zigzag_lengths(n, size)
        for r, (got, want) in enumerate(zip(lengths, expected)):
            if got != want:
                raise ValueError(f"{_FUNCTION}: argument 'q' holds {got} tokens on rank {r}: layout 'zigzag' over "
                                 f"n = {n} tokens and {size} ranks gives that rank {want} (poslsh.shard_ranges; "
                                 f"every rank's lengths: {lengths})")
    return lengths, keywords


# The autograd Function. ------------------------------------------------------------------------

class _Config:
    """What the Function needs besides the tensors (not a tensor: autograd leaves it alone)."""

    def __init__(self, group, keywords, layout, num_threads, stats):
        self.group, self.keywords, self.layout = group, keywords, layout
        self.num_threads, self.stats = num_threads, stats


def _numpy(x):
    return x.detach().contiguous().numpy()


def _received(receives, rank, size):
    """The buffers received from every rank, as the bindings take them (None for the rank
    itself and for peers that sent nothing)."""
    return [receives[p].numpy() if p in receives else None for p in range(size)]


class ContextParallelAttention(torch.autograd.Function):
    """context_parallel_attention as an autograd Function: apply(q, k, v, config)."""

    @staticmethod
    def forward(ctx, q, k, v, config):
        group = config.group
        rank, size = _rank_and_size(group)
        lengths, config.keywords = _agree(q, k, v, config.keywords, config.layout, config.num_threads, group, rank,
                                          size)
        n = sum(lengths)
        if config.layout == "contiguous":
            starts = [sum(lengths[:r]) for r in range(size)]
            shards = [[(s, s + m)] for s, m in zip(starts, lengths)]
        else:
            shards = [[tuple(x) for x in _core.shard_ranges(n, size, r, layout="zigzag")] for r in range(size)]
        plan = _core.ContextParallelPlan(n, size, query_heads=q.shape[1], kv_heads=k.shape[1], layout=config.layout,
                                         shards=shards, **config.keywords)
        me = plan.rank(rank, head_dim=q.shape[2], value_dim=v.shape[2], num_threads=config.num_threads)
        if config.stats is not None:
            config.stats.update({key: 0 for key in _STATS})
        transport = _Transport(group, rank, size, config.stats)
        q, k, v = (x.detach().contiguous() for x in (q, k, v))
        if me.ring:
            out, lse = _ring_forward(me, transport, q, k, v)
        else:
            out, lse = _halo_forward(me, transport, q, k, v)
        out, lse = torch.from_numpy(out), torch.from_numpy(lse)
        ctx.me, ctx.config = me, config
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        me, config = ctx.me, ctx.config
        transport = _Transport(config.group, me.rank, me.ranks, config.stats)
        arrays = dict(q=_numpy(q), k=_numpy(k), v=_numpy(v), out=_numpy(out), lse=_numpy(lse),
                      dout=_numpy(dout.to(out.dtype)))
        if me.ring:
            dq, dk, dv = _ring_backward(me, transport, arrays)
        else:
            dq, dk, dv = _halo_backward(me, transport, arrays)
        return torch.from_numpy(dq), torch.from_numpy(dk), torch.from_numpy(dv), None


# Halo transport. -------------------------------------------------------------------------------

def _halo_exchange(me, transport, phase, arrays, like):
    """Sends every peer its message of `phase` (packed by the binding) and receives theirs."""
    peers = [p for p in range(me.ranks) if p != me.rank]
    sends = {p: torch.from_numpy(me.pack(p, phase, **arrays)) for p in peers}
    receives = {p: like.new_empty(me.received_elements(p, phase)) for p in peers}
    transport.exchange(phase, sends, receives)
    return _received(receives, me.rank, me.ranks)


def _halo_forward(me, transport, q, k, v):
    arrays = dict(q=q.numpy(), k=k.numpy(), v=v.numpy())
    return me.halo_forward(messages=_halo_exchange(me, transport, "forward", arrays, q), **arrays)


def _halo_backward(me, transport, arrays):
    messages = _halo_exchange(me, transport, "backward", arrays, torch.from_numpy(arrays["q"]))
    return me.halo_backward(messages=messages, **arrays)


# Ring transport (exact_tiled without a local window). ------------------------------------------

def _ring(me, transport, phase, k, v, visit):
    """K and V around the ring: visit(source, shard) with the ring buffer of the shard this rank
    holds at each step (ContextParallelRank.ring_step), the transfer of the next step posted
    before the current visit."""
    current = torch.from_numpy(me.pack_ring_shard(k, v))
    for step in range(me.ranks):
        at = me.ring_step(step)
        requests, incoming = [], None
        if at["transfers"]:
            incoming = current.new_empty(me.ring_shard_elements(at["arriving"]))
            requests = transport.start(phase, {at["send_to"]: current}, {at["receive_from"]: incoming})
        visit(at["source"], current.numpy())
        transport.wait(requests)
        current = incoming


def _ring_forward(me, transport, q, k, v):
    ring, queries = me.ring_forward(), q.numpy()
    _ring(me, transport, "forward", k.numpy(), v.numpy(), lambda source, shard: ring.add(queries, source, shard))
    return ring.result()


def _ring_backward(me, transport, arrays):
    ring = me.ring_backward()
    rows = [arrays[name] for name in ("q", "out", "lse", "dout")]
    _ring(me, transport, "backward", arrays["k"], arrays["v"], lambda source, shard: ring.add(*rows, source, shard))
    # The dK/dV partials back to their owners.
    peers = [p for p in range(me.ranks) if p != me.rank]
    sends = {p: torch.from_numpy(ring.partial(p)) for p in peers}
    like = torch.from_numpy(arrays["q"])
    receives = {p: like.new_empty(me.ring_shard_elements(me.rank)) for p in peers}
    transport.exchange("backward", sends, receives)
    return ring.result(_received(receives, me.rank, me.ranks))


# The public function. --------------------------------------------------------------------------

def context_parallel_attention(q, k, v, group=None, *, method="lsh_fused", masking="causal", scale=None, sigmas=None,
                               samples=16, seed=0, band_error=1e-3, window=(-1, -1), layout="contiguous",
                               num_threads=None, stats=None):
    """This rank's rows [n_local, H, d_v] of poslsh.torch.multihead_attention on the whole
    sequence sharded over the ranks of `group` (default: the default process group),
    differentiable in q, k, v.

    q [n_local, H, d], k [n_local, H_kv, d], v [n_local, H_kv, d_v]: this rank's shard (CPU,
    float32 or float64, layout 'nhd'; grouped-query attention when H_kv < H). layout:
    'contiguous' (ranks hold consecutive ranges in rank order, lengths may differ) or 'zigzag'
    (chunks r and 2R - 1 - r of 2R, lengths of poslsh.shard_ranges). method, masking, scale,
    sigmas, samples, seed, band_error and window: as poslsh.multihead_attention (window: the
    local window (left, right) of the exact methods), the same on every rank. num_threads: the
    kernels' threads on this rank. stats: a dict filled with this rank's bytes and messages
    (the module docstring defines them; reset by the forward, the backward adds its own when it
    runs).

    Halo methods (every method but exact_tiled without a local window): output and gradients
    bitwise the single-process call. exact_tiled without a local window (ring): to rounding.
    Raises on every rank if a rank's arguments fail their checks or differ across ranks."""
    keywords = dict(method=method, masking=masking, scale=scale, sigmas=sigmas, samples=samples, seed=seed,
                    band_error=band_error, window=window)
    return ContextParallelAttention.apply(q, k, v, _Config(group, keywords, layout, num_threads, stats))
