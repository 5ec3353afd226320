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

Transport (poslsh.context_parallel_plan, the same on every rank):

- Halo methods (lsh_fused, lsh_per_sample, fixed_blocks, exact_banded, exact_tiled with a local
  window): each rank receives, per own chunk and K/V head, the K/V rows of the keys its queries
  reach (the plan's 'keys') from their owners, one message per peer, and runs
  poslsh.multihead_attention_with_lse on them: the rows are BITWISE the single-process rows.
  A message holds, in the order (destination chunk, K/V head, position range), the K rows then
  the V rows of each range of the sender's shard the destination needs.
  The backward receives the rows of the plan's 'window' (K, V per K/V head; Q, out, dout, lse
  per query head) and runs poslsh.multihead_attention_backward(position=) on it: the own rows
  of dq, dk, dv are BITWISE the single-process gradients, and no gradient is sent back (same
  order; per range K, V, then Q, out, dout and lse of the K/V head's query heads).
- Ring (exact_tiled without a local window): K and V go around the ring (R - 1 steps, the next
  transfer posted before the current step's attention); the slices' results are merged by
  log-sum-exp in the order of the source rank; the backward passes K and V around again,
  computes the exact ALiBi gradients of every (query chunk, key slice) pair in torch with the
  global lse, and returns the dK/dV partials to their owners (added in the order of the source
  rank). Equal to the single-process call to rounding.

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
query heads of g).

Before any attention every rank all_gathers a record of its arguments and of its local checks:
if a rank's check failed, every rank raises that rank's error; if an argument differs across
ranks, every rank raises a ValueError naming it. Only collectives every rank reaches are used
before the transfers, so a bad call raises instead of hanging.

Helpers: shard(x, rank, world_size, layout) (a rank's rows of a whole-sequence tensor),
unshard(parts, layout) (its inverse over all ranks' parts) and gather_sequence(local, group,
layout) (all_gather and unshard).
"""

import math

import numpy as np
import torch
import torch.distributed as dist

from . import _core

__all__ = ["context_parallel_attention", "ContextParallelAttention", "shard", "unshard", "gather_sequence"]

_FUNCTION = "poslsh.distributed.context_parallel_attention"
_LAYOUTS = ("contiguous", "zigzag")
_DTYPES = (torch.float32, torch.float64)
# Elements of the scores block of the ring backward (heads x query rows x keys).
_RING_BLOCK_ELEMENTS = 1 << 22
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


# Plan geometry. --------------------------------------------------------------------------------

def _pieces(owned, begin, end):
    """The parts of [begin, end) that the ranges `owned` (a rank's shard, increasing) hold, as
    (position begin, position end, local row of begin) in position order."""
    pieces, local = [], 0
    for b, e in owned:
        lo, hi = max(b, begin), min(e, end)
        if lo < hi:
            pieces.append((lo, hi, local + lo - b))
        local += e - b
    return pieces


def _segments(plan_chunks, owned, field):
    """For each chunk of a destination, each K/V head g and each piece of chunk[field][g] held by
    a source rank (its shard `owned`): (chunk index, g, begin, end, source local row), in the
    order (chunk, g, position)."""
    segments = []
    for c, chunk in enumerate(plan_chunks):
        for g, (b, e) in enumerate(chunk[field]):
            for lo, hi, local in _pieces(owned, b, e):
                segments.append((c, g, lo, hi, local))
    return segments


# The autograd Function. ------------------------------------------------------------------------

class _Config:
    """What the Function needs besides the tensors (not a tensor: autograd leaves it alone)."""

    def __init__(self, group, keywords, layout, num_threads, stats):
        self.group, self.keywords, self.layout = group, keywords, layout
        self.num_threads, self.stats = num_threads, stats


def _kernel_keywords(config):
    return dict(layout="nhd", **config.keywords, num_threads=config.num_threads)


def _numpy(x):
    return x.detach().contiguous().numpy()


class ContextParallelAttention(torch.autograd.Function):
    """context_parallel_attention as an autograd Function: apply(q, k, v, config)."""

    @staticmethod
    def forward(ctx, q, k, v, config):
        group = config.group
        rank, size = _rank_and_size(group)
        lengths, config.keywords = _agree(q, k, v, config.keywords, config.layout, config.num_threads, group, rank,
                                          size)
        n = sum(lengths)
        heads, kv_heads = q.shape[1], k.shape[1]
        if config.layout == "contiguous":
            starts = [sum(lengths[:r]) for r in range(size)]
            shards = [[(s, s + m)] for s, m in zip(starts, lengths)]
        else:
            shards = [[tuple(x) for x in _core.shard_ranges(n, size, r, layout="zigzag")] for r in range(size)]
        plan = _core.context_parallel_plan(n, size, query_heads=heads, kv_heads=kv_heads, layout=config.layout,
                                           shards=shards, **config.keywords)
        if config.stats is not None:
            config.stats.update({key: 0 for key in _STATS})
        transport = _Transport(group, rank, size, config.stats)
        q, k, v = (x.detach().contiguous() for x in (q, k, v))
        ctx.geometry = (rank, size, n, lengths, shards, plan)
        ctx.config = config
        if plan["ring"]:
            out, lse = _ring_forward(q, k, v, config, transport, rank, size, lengths, shards, plan)
        else:
            out, lse = _halo_forward(q, k, v, config, transport, rank, size, shards, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank, size, n, lengths, shards, plan = ctx.geometry
        config = ctx.config
        transport = _Transport(config.group, rank, size, config.stats)
        dout = dout.detach().to(out.dtype).contiguous()
        if plan["ring"]:
            dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, config, transport, rank, size, lengths, shards, plan)
        else:
            dq, dk, dv = _halo_backward(q, k, v, out, lse, dout, config, transport, rank, size, shards, plan)
        return dq, dk, dv, None


# Halo transport. -------------------------------------------------------------------------------

def _halo_forward(q, k, v, config, transport, rank, size, shards, plan):
    d, d_v, kv_heads = q.shape[2], v.shape[2], k.shape[1]
    mine = plan["chunks"][rank]
    # The rows each other rank needs of this rank's K and V, and those it sends here.
    sends, receives, incoming = {}, {}, {}
    for peer in range(size):
        if peer == rank:
            continue
        out_segments = _segments(plan["chunks"][peer], shards[rank], "keys")
        pieces = []
        for _, g, lo, hi, local in out_segments:
            pieces += [k[local:local + hi - lo, g].reshape(-1), v[local:local + hi - lo, g].reshape(-1)]
        sends[peer] = torch.cat(pieces) if pieces else k.new_empty(0)
        in_segments = _segments(mine, shards[peer], "keys")
        incoming[peer] = in_segments
        receives[peer] = k.new_empty(sum(hi - lo for _, _, lo, hi, _ in in_segments) * (d + d_v))
    transport.exchange("forward", sends, receives)
    # Key buffers per own chunk: zero, the rows of keys[g] filled per head g.
    buffers = []
    for c, chunk in enumerate(mine):
        b, e = chunk["key_span"]
        buffers.append((k.new_zeros((e - b, kv_heads, d)), v.new_zeros((e - b, kv_heads, d_v))))
    for c, chunk in enumerate(mine):
        span_begin = chunk["key_span"][0]
        for g, (b, e) in enumerate(chunk["keys"]):
            for lo, hi, local in _pieces(shards[rank], b, e):
                buffers[c][0][lo - span_begin:hi - span_begin, g] = k[local:local + hi - lo, g]
                buffers[c][1][lo - span_begin:hi - span_begin, g] = v[local:local + hi - lo, g]
    for peer, segments in incoming.items():
        flat, offset = receives[peer], 0
        for c, g, lo, hi, _ in segments:
            rows, span_begin = hi - lo, mine[c]["key_span"][0]
            buffers[c][0][lo - span_begin:hi - span_begin, g] = flat[offset:offset + rows * d].view(rows, d)
            offset += rows * d
            buffers[c][1][lo - span_begin:hi - span_begin, g] = flat[offset:offset + rows * d_v].view(rows, d_v)
            offset += rows * d_v
    outs, lses, local = [], [], 0
    for c, chunk in enumerate(mine):
        b, e = chunk["queries"]
        out, lse = _attention_slice(q[local:local + e - b], buffers[c][0], buffers[c][1], config, b,
                                    chunk["key_span"][0])
        outs.append(out)
        lses.append(lse)
        local += e - b
    return torch.cat(outs), torch.cat(lses, dim=1)


def _attention_slice(q, k, v, config, query_offset, key_offset):
    """multihead_attention_with_lse of queries at query_offset over keys at key_offset: (out
    [m, H, d_v], lse [H, m]); no queries or no keys: zeros and -inf without a kernel call."""
    m, heads, d_v = q.shape[0], q.shape[1], v.shape[2]
    if m == 0 or k.shape[0] == 0:
        return q.new_zeros((m, heads, d_v)), q.new_full((heads, m), -math.inf)
    out, lse = _core.multihead_attention_with_lse(_numpy(q), _numpy(k), _numpy(v), **_kernel_keywords(config),
                                                  query_offset=query_offset, key_offset=key_offset)
    return torch.from_numpy(out), torch.from_numpy(lse)


def _halo_backward(q, k, v, out, lse, dout, config, transport, rank, size, shards, plan):
    d, d_v, heads, kv_heads = q.shape[2], v.shape[2], q.shape[1], k.shape[1]
    group_size = heads // kv_heads
    mine = plan["chunks"][rank]
    row_elements = d + d_v + group_size * (d + 2 * d_v + 1)

    def rows_of(g, lo, hi, local):
        """K, V, then Q, out, dout, lse of the group's query heads, of local rows [local, +hi-lo)."""
        rows, heads_g = slice(local, local + hi - lo), slice(g * group_size, (g + 1) * group_size)
        return [k[rows, g].reshape(-1), v[rows, g].reshape(-1), q[rows, heads_g].reshape(-1),
                out[rows, heads_g].reshape(-1), dout[rows, heads_g].reshape(-1), lse[heads_g, rows].reshape(-1)]

    sends, receives, incoming = {}, {}, {}
    for peer in range(size):
        if peer == rank:
            continue
        pieces = []
        for _, g, lo, hi, local in _segments(plan["chunks"][peer], shards[rank], "window"):
            pieces += rows_of(g, lo, hi, local)
        sends[peer] = torch.cat(pieces) if pieces else q.new_empty(0)
        incoming[peer] = _segments(mine, shards[peer], "window")
        receives[peer] = q.new_empty(sum(hi - lo for _, _, lo, hi, _ in incoming[peer]) * row_elements)
    transport.exchange("backward", sends, receives)
    # Window buffers per own chunk, zero outside each head's window.
    buffers = []
    for chunk in mine:
        b, e = chunk["window_span"]
        w = e - b
        buffers.append([k.new_zeros((w, kv_heads, d)), v.new_zeros((w, kv_heads, d_v)), q.new_zeros((w, heads, d)),
                        out.new_zeros((w, heads, d_v)), dout.new_zeros((w, heads, d_v)), lse.new_zeros((heads, w))])

    def place(c, g, lo, hi, parts):
        kb, vb, qb, ob, dob, lb = buffers[c]
        rows = slice(lo - mine[c]["window_span"][0], hi - mine[c]["window_span"][0])
        heads_g = slice(g * group_size, (g + 1) * group_size)
        kb[rows, g], vb[rows, g] = parts[0], parts[1]
        qb[rows, heads_g], ob[rows, heads_g], dob[rows, heads_g] = parts[2], parts[3], parts[4]
        lb[heads_g, rows] = parts[5]

    for c, chunk in enumerate(mine):
        for g, (b, e) in enumerate(chunk["window"]):
            for lo, hi, local in _pieces(shards[rank], b, e):
                rows, heads_g = slice(local, local + hi - lo), slice(g * group_size, (g + 1) * group_size)
                place(c, g, lo, hi, [k[rows, g], v[rows, g], q[rows, heads_g], out[rows, heads_g],
                                     dout[rows, heads_g], lse[heads_g, rows]])
    for peer, segments in incoming.items():
        flat, offset = receives[peer], 0
        for c, g, lo, hi, _ in segments:
            rows = hi - lo
            shapes = [(rows, d), (rows, d_v), (rows, group_size, d), (rows, group_size, d_v), (rows, group_size, d_v),
                      (group_size, rows)]
            parts = []
            for shape in shapes:
                count = math.prod(shape)
                parts.append(flat[offset:offset + count].view(shape))
                offset += count
            place(c, g, lo, hi, parts)
    dqs, dks, dvs = [], [], []
    for c, chunk in enumerate(mine):
        b, e = chunk["queries"]
        if e == b:
            continue
        kb, vb, qb, ob, dob, lb = buffers[c]
        dq, dk, dv = _core.multihead_attention_backward(
            qb.numpy(), kb.numpy(), vb.numpy(), ob.numpy(), lb.numpy(), dob.numpy(), **_kernel_keywords(config),
            position=chunk["window_span"][0])
        own = slice(b - chunk["window_span"][0], e - chunk["window_span"][0])
        dqs.append(torch.from_numpy(dq[own]))
        dks.append(torch.from_numpy(dk[own]))
        dvs.append(torch.from_numpy(dv[own]))
    if not dqs:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)


# Ring transport (exact_tiled without a local window). ------------------------------------------

def _ring_pairs(chunk, source_ranges, masking):
    """The source ranges (with their local rows in the source's shard) whose keys an own chunk's
    queries may reach: causal skips the ranges that start after the chunk's last query."""
    b, e = chunk["queries"]
    pairs, local = [], 0
    for rb, re_ in source_ranges:
        if b < e and rb < re_ and not (masking == "causal" and rb >= e):
            pairs.append((rb, re_, local))
        local += re_ - rb
    return pairs


def _ring(transport, phase, rank, size, lengths, kv_heads, d, d_v, k, v, visit):
    """K and V around the ring: visit(source, k_source, v_source) for source = rank, rank - 1, ...
    (R steps), the transfer of the next step posted before the current visit."""
    current = torch.cat([k.reshape(-1), v.reshape(-1)])
    for step in range(size):
        source = (rank - step) % size
        requests, incoming = [], None
        if step + 1 < size:
            incoming = current.new_empty(lengths[(source - 1) % size] * kv_heads * (d + d_v))
            requests = transport.start(phase, {(rank + 1) % size: current}, {(rank - 1) % size: incoming})
        rows = lengths[source]
        visit(source, current[:rows * kv_heads * d].view(rows, kv_heads, d),
              current[rows * kv_heads * d:].view(rows, kv_heads, d_v))
        transport.wait(requests)
        current = incoming


def _merge(partials, dtype):
    """Merges (out [m, H, d_v], lse [H, m]) slices by log-sum-exp, in the given order."""
    lses = torch.stack([lse.to(torch.float64) for _, lse in partials])
    top = lses.max(dim=0).values
    finite = torch.isfinite(top)
    shift = torch.where(finite, top, torch.zeros_like(top))
    total, out = torch.zeros_like(top), None
    weights = []
    for slice_lse in lses:
        weight = torch.exp(slice_lse - shift)
        weights.append(weight)
        total = total + weight
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    for (slice_out, _), weight in zip(partials, weights):
        term = slice_out.to(torch.float64) * (weight / safe_total).t().unsqueeze(-1)
        out = term if out is None else out + term
    lse = torch.where(finite, shift + torch.log(safe_total), torch.full_like(top, -math.inf))
    return out.to(dtype), lse.to(dtype)


def _ring_forward(q, k, v, config, transport, rank, size, lengths, shards, plan):
    d, d_v, heads, kv_heads = q.shape[2], v.shape[2], q.shape[1], k.shape[1]
    mine = plan["chunks"][rank]
    masking = config.keywords["masking"]
    partials = [dict() for _ in mine]  # per own chunk: source -> [(out, lse) per source range]
    starts = _local_starts(mine)

    def visit(source, k_source, v_source):
        for c, chunk in enumerate(mine):
            b, e = chunk["queries"]
            slices = []
            for rb, re_, local in _ring_pairs(chunk, shards[source], masking):
                slices.append(_attention_slice(q[starts[c]:starts[c] + e - b], k_source[local:local + re_ - rb],
                                               v_source[local:local + re_ - rb], config, b, rb))
            partials[c][source] = slices

    _ring(transport, "forward", rank, size, lengths, kv_heads, d, d_v, k, v, visit)
    outs, lses = [], []
    for c, chunk in enumerate(mine):
        b, e = chunk["queries"]
        ordered = [s for source in range(size) for s in partials[c].get(source, [])]
        if e == b or not ordered:
            outs.append(q.new_zeros((e - b, heads, d_v)))
            lses.append(q.new_full((heads, e - b), -math.inf))
            continue
        out, lse = _merge(ordered, q.dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _local_starts(chunks):
    starts, local = [], 0
    for chunk in chunks:
        starts.append(local)
        local += chunk["queries"][1] - chunk["queries"][0]
    return starts


def _ring_pair_backward(q, dout_delta, lse, k, v, query_begin, key_begin, slopes, tau, config):
    """The exact ALiBi gradients of one (query chunk, key slice) pair with the global lse:
    (dq [m, H, d], dk [L, H_kv, d], dv [L, H_kv, d_v]) in blocks of query rows."""
    dout, delta = dout_delta
    m, heads, d = q.shape
    length, kv_heads, d_v = k.shape[0], k.shape[1], v.shape[2]
    group = heads // kv_heads
    masking = config.keywords["masking"]
    left, right = config.keywords["window"]
    dq = q.new_zeros(q.shape)
    dk_heads = q.new_zeros((heads, length, d))
    dv_heads = q.new_zeros((heads, length, d_v))
    k_heads = k.permute(1, 0, 2).repeat_interleave(group, dim=0)  # [H, L, d]
    v_heads = v.permute(1, 0, 2).repeat_interleave(group, dim=0)  # [H, L, d_v]
    keys = torch.arange(key_begin, key_begin + length, dtype=torch.float64)
    rows_per_block = max(1, _RING_BLOCK_ELEMENTS // max(1, heads * length))
    for r0 in range(0, m, rows_per_block):
        r1 = min(m, r0 + rows_per_block)
        queries = torch.arange(query_begin + r0, query_begin + r1, dtype=torch.float64)
        offset = queries[:, None] - keys[None, :]  # i - j
        keep = torch.ones(offset.shape, dtype=torch.bool)
        if masking == "causal":
            keep &= offset >= 0
        if left >= 0:
            keep &= offset <= left
        if right >= 0:
            keep &= -offset <= right
        distance = offset.abs().to(q.dtype)
        q_block = q[r0:r1].permute(1, 0, 2)  # [H, b, d]
        dout_block = dout[r0:r1].permute(1, 0, 2)  # [H, b, d_v]
        scores = tau * torch.bmm(q_block, k_heads.transpose(1, 2)) - slopes[:, None, None] * distance
        scores = scores - lse[:, r0:r1, None]
        p = torch.where(keep, torch.exp(torch.where(keep, scores, torch.zeros_like(scores))), torch.zeros_like(scores))
        dv_heads += torch.bmm(p.transpose(1, 2), dout_block)
        ds = p * (torch.bmm(dout_block, v_heads.transpose(1, 2)) - delta[:, r0:r1, None])
        dq[r0:r1] += (tau * torch.bmm(ds, k_heads)).permute(1, 0, 2)
        dk_heads += tau * torch.bmm(ds.transpose(1, 2), q_block)
    dk = dk_heads.view(kv_heads, group, length, d).sum(dim=1).permute(1, 0, 2)
    dv = dv_heads.view(kv_heads, group, length, d_v).sum(dim=1).permute(1, 0, 2)
    return dq, dk, dv


def _ring_backward(q, k, v, out, lse, dout, config, transport, rank, size, lengths, shards, plan):
    d, d_v, heads, kv_heads = q.shape[2], v.shape[2], q.shape[1], k.shape[1]
    mine = plan["chunks"][rank]
    masking = config.keywords["masking"]
    starts = _local_starts(mine)
    scale = config.keywords["scale"]
    tau = scale if scale is not None else 1.0 / math.sqrt(d)
    sigmas = config.keywords["sigmas"]
    sigmas = _core.alibi_sigmas(heads) if sigmas is None else sigmas
    slopes = torch.tensor([1.0 / float(s) for s in sigmas], dtype=q.dtype)
    # D_i = sum(dO_i * O_i) per query head, [H, n_local]; the inputs per own chunk.
    delta = (dout * out).sum(dim=-1).t().contiguous()
    dq_parts = [dict() for _ in mine]  # per own chunk: source -> dq
    dkv_parts = {}  # source -> (dk, dv) of the source's shard, from this rank's queries

    def visit(source, k_source, v_source):
        dk_source = k.new_zeros((lengths[source], kv_heads, d))
        dv_source = v.new_zeros((lengths[source], kv_heads, d_v))
        for c, chunk in enumerate(mine):
            b, e = chunk["queries"]
            rows = slice(starts[c], starts[c] + e - b)
            dq_c = None
            for rb, re_, local in _ring_pairs(chunk, shards[source], masking):
                keys = slice(local, local + re_ - rb)
                dq, dk, dv = _ring_pair_backward(q[rows], (dout[rows], delta[:, rows]), lse[:, rows], k_source[keys],
                                                 v_source[keys], b, rb, slopes, tau, config)
                dq_c = dq if dq_c is None else dq_c + dq
                dk_source[keys] += dk
                dv_source[keys] += dv
            if dq_c is not None:
                dq_parts[c][source] = dq_c
        dkv_parts[source] = (dk_source, dv_source)

    _ring(transport, "backward", rank, size, lengths, kv_heads, d, d_v, k, v, visit)
    # dK/dV partials back to their owners, added there in the order of the source rank.
    sends = {peer: torch.cat([dkv_parts[peer][0].reshape(-1), dkv_parts[peer][1].reshape(-1)])
             for peer in range(size) if peer != rank}
    receives = {peer: k.new_empty(lengths[rank] * kv_heads * (d + d_v)) for peer in range(size) if peer != rank}
    transport.exchange("backward", sends, receives)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    rows = lengths[rank] * kv_heads * d
    for peer in range(size):
        if peer == rank:
            dk += dkv_parts[rank][0]
            dv += dkv_parts[rank][1]
        else:
            dk += receives[peer][:rows].view(k.shape)
            dv += receives[peer][rows:].view(v.shape)
    dq = torch.zeros_like(q)
    for c, chunk in enumerate(mine):
        b, e = chunk["queries"]
        for source in range(size):
            if source in dq_parts[c]:
                dq[starts[c]:starts[c] + e - b] += dq_parts[c][source]
    return dq, dk, dv


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
