#!/usr/bin/env python3
"""Cost model of context parallelism for poslsh's methods: halo exchange against a K/V ring.

A sequence of n tokens is sharded over R ranks:
  contiguous  rank r holds rows [n r // R, n (r+1) // R);
  zigzag      the sequence is cut in 2R chunks [n c // (2R), n (c+1) // (2R)) and rank r holds
              chunks r and 2R-1-r (balanced causal work).
The banded and LSH methods need only a halo of K/V rows next to a rank's chunks; exact ALiBi
needs every key, so its K/V shards travel around a ring (R-1 steps).

Halo of a chunk [s, e) for key/value head g (union over its query heads h = g G .. g G + G-1,
G = heads / kv_heads; query head h uses rbf_hashes(sigma_h, samples, seed, stream=h)):
  lsh_fused, lsh_per_sample, fixed_blocks:
      a = min over the head's hashes of block_containing(hash, s).begin,
      b = max over the head's hashes of block_containing(hash, e-1).end
      (fixed_blocks: the one hash fixed_blocks_hash(sigma_h), width 2 sigma_h, offset 0);
  exact_banded: a = max(0, s - W_h), b = min(n, e + W_h), W_h = band_for_bias_error(sigma_h,
      band_error); exact_tiled: a = 0, b = n.
  Forward keys: causal [a, e), bidirectional [a, b) (context_parallel_plan's keys[g]).
  Backward window (both maskings): [a, b) (the plan's window[g]: the rows the gradients of the
  own rows read; Problem.window = "exact", the default). Other conventions (Problem.window, a
  record's "window"): "tile" [a64, b), a64 = 64 floor(a / 64); "span" the union over the heads
  with its begin rounded down to 64 (the plan's window_span), for every head.
  A rank receives the rows of these ranges outside its own shard from the ranks that own them.
  Problem.chunks says how a zigzag rank's two chunks combine: "separate" (default, as
  poslsh.distributed sends them: each own chunk receives its ranges, a row two chunks need
  travels twice) or "merged" (the union over the rank's chunks, each row once, as
  examples/mpi_context_parallel.cpp receives its forward halo). Contiguous shards: the same.
Bytes received per rank (kv_heads groups of G query heads, d = head dim of Q/K, dv of V, every
value in the element size `itemsize`), as python/poslsh/distributed.py sends them:
  forward halo    rows(keys[g] outside the own rows) (d + dv) itemsize, summed over g (K, V);
  backward halo   rows(window[g] outside the own rows) (d + dv + G (d + 2 dv + 1)) itemsize,
                  summed over g: K, V, and Q, out, dO, lse of the G query heads
                  (Problem.backward_payload = "out_lse", the default). "lse_d" counts a kernel
                  that would send Q, dO, lse and D instead of out (lse and D in stat_itemsize)
                  and K, V only for the window rows not received forward:
                  rows(window[g] outside own) G ((d + dv) itemsize + 2 stat_itemsize)
                  + rows(window[g] outside own and outside keys[g]) (d + dv) itemsize;
  forward ring    (n - own rows) kv_heads (d + dv) itemsize: every shard but the own one;
  backward ring   the ring again, (n - own rows) kv_heads (d + dv) itemsize, then the dK/dV
                  partials of the own shard from every other rank, (R - 1) (own rows) kv_heads
                  (d + dv) itemsize.
Bytes sent per rank: halo, the same rows counted at their owners; ring forward, the shards of
every rank but rank + 1 (at step k rank r forwards the shard of rank r - k, k = 0 .. R-2):
(n - rows of rank r+1) kv_heads (d + dv) itemsize; ring backward, that again plus its dK/dV
partials of every other rank's shard, (n - own rows) kv_heads (d + dv) itemsize. With unequal
shards a rank's sent and received ring bytes differ.
Messages per rank (sent plus received, as distributed.py's stats count them): a halo pass, one
message to and one from each peer with a nonempty range; a ring forward 2 (R - 1); a ring
backward 4 (R - 1) (empty shards send nothing).

Compute: pairs(Q, K) = the pairs (i in Q, j in K) of non-zero weight, summed over query heads;
for the random methods its expectation over the hashes, exactly, from the distance law
  h(t) = P[key i - t is evaluated for query i], t >= 0:
    exact_tiled 1;  exact_banded [t <= W_h];  lsh_fused 1 - (1 - exp(-t/sigma))^s (the union of
    the s blocks holding i reaches back to the furthest block start; P[one block reaches t back]
    = exp(-t/sigma));  lsh_per_sample s exp(-t/sigma) (each sample's blocks separately);
    fixed_blocks max(0, 1 - t/(2 sigma)) (its block grid averaged over the offset).
  causal pairs([a,b), [c,d)) = K(b-c) - K(a-c) - K(b-d) + K(a-d),
  K(x) = sum_{t=0}^{x-1} (x - t) h(t) for x > 0, else 0 (closed forms in pair_kernel);
  bidirectional pairs(Q, K) = causal(Q, K) + causal(K, Q) - |Q n K|.
  Sum over ranks = lsh_fused_pair_count's expectation (lsh_fused_pair_count itself is O(n s) on
  the whole sequence and cannot split by rank; the tests compare the two).
FLOPs per pair: forward 2 (d + dv) (= 4 d); backward 6 d + 4 dv (S recomputed, dV, dP, dQ, dK:
2.5x the forward for d = dv).
  halo forward   pairs(own queries, all keys);
  halo backward  every pair of each chunk's backward window, per head the window of its K/V
                 head: causal pairs([a, b), [a, b)) = K(b - a) (multihead_attention_window_backward
                 runs self-attention on the window: halo rows pair with halo rows too);
                 --backward-pairs own counts only the pairs with an own query or key instead,
                 6 d + 4 dv when both are own, 4 d + 2 dv (dQ) or 4 d + 4 dv (dK, dV) when one is;
  ring           forward and backward, pairs(own queries, the visiting shard's keys) per step.

Time model, per pass (--passes both: the forward and backward times added), slowest rank:
  halo    max over ranks of  flops / rate + max(messages in, out) latency
                             + max(bytes in, out) / bandwidth
          (one message per peer per pass, all heads packed; exchange, then compute).
  ring    sum over steps k = 0 .. R-2 of max over ranks of
              [max(compute of step k, bytes of one shard / bandwidth) + latency]
          + max over ranks of the compute of the last step
          (step k computes the rank's queries against the K/V shard of rank (r - k) mod R while
          the next shard arrives, K and V forward, K, V, dK, dV backward: transfer and compute
          overlap; poslsh.distributed returns the dK/dV partials in one exchange after its
          backward ring instead: the same bytes, not overlapped).
  hybrid  halos for some key/value heads, a ring for the others, one after the other (times
          add): a K/V head goes to the ring when, alone and without overlap, its ring time
          (pairs(own queries, all keys) (8 d + 6 dv) / rate + 3 (n - own rows) (d + dv)
          itemsize / bandwidth) is below its halo time (its FLOPs / rate + its halo bytes /
          bandwidth): in practice the widest heads.
  compute time = max over ranks of flops / rate; comm time = total - compute (exposed comm).
Rate, latency and bandwidth are parameters: --flops-rate (90e9: one AVX-512 core at
exact_tiled's 180 GFLOP/s on 2 cores, docs/benchmarks.md) times --cores-per-rank, --latency
(5e-6 s), --bandwidth (25e9 B/s per rank and direction).

Measured-bytes files for --check (JSON, one or more): a list of records (or one record)
  {"n": int, "R": int, "layout": "contiguous"|"zigzag",
   "method": "lsh_fused"|"lsh_per_sample"|"fixed_blocks"|"exact_banded"|"exact_tiled",
   "masking": "causal"|"bidirectional", "heads": int, "kv_heads": int, "d": int, "dv": int,
   "itemsize": int, "sigmas": [float per query head] | null (alibi_sigmas(heads)),
   "samples": int, "seed": int,
   "forward_bytes_per_rank": [R ints], "backward_bytes_per_rank": [R ints]}
with optional fields "transport": "halo" (default; "ring" for a ring's bytes; exact_tiled
defaults to "ring"), "band_error" (default 1e-3), "window" ("exact", default; "tile", "span"),
"chunks" ("separate", default; "merged"), "backward_payload" ("out_lse", default; "lse_d"),
"stat_itemsize" (bytes of one lse or D value of "lse_d", default 4),
"forward_sent_bytes_per_rank", "backward_sent_bytes_per_rank", "forward_messages_per_rank",
"backward_messages_per_rank" ([R ints]). Every *_per_rank field present is checked; a record
needs none in particular (the MPI example's forward-only records carry no backward bytes).
The *_bytes_per_rank lists hold the bytes each rank RECEIVES in that pass, the *_sent_* lists
those it sends (a rank's own rows are never counted). An element of the list that holds
"model_record" is a report of examples/mpi_context_parallel --json: its "model_record" is
checked, with "chunks" "merged" unless the record says otherwise (that example receives the
union of its chunks' halos; a null model_record, a local window, is skipped). --check prints,
per record and field, the relative difference |measured - model| / max(model, 1), largest over
the ranks, and fails (exit status 1) above --tolerance (default 0: the model counts the rows the
implementations send, so the bytes must match exactly).

Usage:
  python3 bench/context_parallel_model.py                    # projection tables + plot
  python3 bench/context_parallel_model.py --full             # also the table of every row
  python3 bench/context_parallel_model.py --check bytes.json # compare measured byte counts
  python3 bench/context_parallel_model.py --check report-R2.json report-R3.json  # MPI reports
  python3 bench/context_parallel_model.py --halos --n 65536 --ranks 8 --model mpt-7b-storywriter
Needs numpy and the poslsh module (PYTHONPATH=build-py/python); gnuplot for the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import poslsh

METHODS = ("lsh_fused", "lsh_per_sample", "fixed_blocks", "exact_tiled", "exact_banded")
ALIASES = {"banded": "exact_banded", "exact": "exact_tiled", "lsh": "lsh_fused"}
LAYOUTS = ("contiguous", "zigzag")
MASKINGS = ("causal", "bidirectional")
TRANSPORTS = ("halo", "ring", "hybrid")
TILE = 64  # window_span starts on a multiple of the tile size
# Backward window of key/value head g on a chunk: "exact" [a_g, b_g) (context_parallel_plan's
# window[g]: the rows the gradients read, the rows poslsh.distributed sends); "tile"
# [64 floor(a_g / 64), b_g); "span" [64 floor(min_g a_g / 64), max_g b_g) for every head
# (context_parallel_plan's window_span, the rows multihead_attention_backward(position=) spans).
WINDOWS = ("exact", "tile", "span")
# How a rank's chunks (two for zigzag) combine their halos: "separate" (each chunk receives its
# own ranges, as poslsh.distributed) or "merged" (their union, as the MPI example's forward).
CHUNK_HALOS = ("separate", "merged")
# What the halo backward sends per window row: "out_lse" (K, V; Q, out, dO, lse per query head,
# all in the element size: poslsh.distributed) or "lse_d" (Q, dO, lse, D per query head, lse
# and D in stat_itemsize; K, V only for rows outside the forward halo).
BACKWARD_PAYLOADS = ("out_lse", "lse_d")
MAX_SAMPLES = 32  # lsh_fused's expected pairs: an alternating sum of 2^s, long double above 24

# Model shapes of the projection: query heads, key/value heads, head dim, ALiBi max_bias.
MODELS = {
    "bloom-7b1": dict(label="BLOOM-7b1", heads=32, kv_heads=32, d=128, max_bias=8.0),
    "mpt-7b-storywriter": dict(label="MPT-7B-StoryWriter", heads=32, kv_heads=32, d=128,
                               max_bias=16.0),
}
# (method, transport, layout) rows of the projection.
PROJECTION_ROWS = (("exact_tiled", "ring", "zigzag"), ("lsh_fused", "halo", "contiguous"),
                   ("lsh_fused", "ring", "zigzag"), ("lsh_fused", "hybrid", "contiguous"),
                   ("exact_banded", "halo", "contiguous"))
DEFAULT_RANKS = tuple(2**k for k in range(3, 11))  # 8 .. 1024
DEFAULT_LENGTHS = tuple(2**k for k in range(20, 25))  # 1M .. 16M


def alibi_slopes(heads, max_bias=8.0):
    """include/poslsh/core/slopes.hpp's alibi_slopes (BLOOM / MPT rule, any max_bias): with
    p = 2^floor(log2 H), m_h = 2^(-b (h+1) / p) for h < p, then 2^(-b (2 (h-p) + 1) / (2 p)).
    (The binding poslsh.alibi_slopes has max_bias 8 only.)"""
    if heads < 1 or not (math.isfinite(max_bias) and max_bias > 0):
        raise ValueError("alibi_slopes: heads >= 1 and a finite max_bias > 0")
    p = 1 << (heads.bit_length() - 1)
    h = np.arange(heads, dtype=np.float64)
    exponent = np.where(h < p, max_bias * (h + 1) / p, max_bias * (2 * (h - p) + 1) / (2.0 * p))
    return np.exp2(-exponent)


def alibi_sigmas(heads, max_bias=8.0):
    """sigma_h = 1 / m_h."""
    return 1.0 / alibi_slopes(heads, max_bias)


@dataclass(frozen=True)
class Problem:
    """One sharded attention layer: n tokens over R ranks."""

    n: int
    ranks: int
    sigmas: tuple  # one per query head
    layout: str = "contiguous"
    method: str = "lsh_fused"
    masking: str = "causal"
    samples: int = 16
    seed: int = 0
    kv_heads: int | None = None  # None: heads
    d: int = 128
    dv: int | None = None  # None: d
    itemsize: int = 2
    stat_itemsize: int = 4
    band_error: float = 1e-3
    window: str = "exact"  # backward window convention, WINDOWS
    chunks: str = "separate"  # how a rank's chunks combine their halos, CHUNK_HALOS
    backward_payload: str = "out_lse"  # what a backward window row carries, BACKWARD_PAYLOADS
    streams: tuple | None = None  # hash stream of each query head; None: 0 .. H-1

    def __post_init__(self):
        object.__setattr__(self, "sigmas", tuple(float(x) for x in self.sigmas))
        object.__setattr__(self, "method", ALIASES.get(self.method, self.method))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", len(self.sigmas))
        streams = range(len(self.sigmas)) if self.streams is None else self.streams
        object.__setattr__(self, "streams", tuple(int(x) for x in streams))
        if len(self.streams) != len(self.sigmas):
            raise ValueError("one stream per query head")
        if self.dv is None:
            object.__setattr__(self, "dv", self.d)
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r}: one of {METHODS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: one of {LAYOUTS}")
        if self.masking not in MASKINGS:
            raise ValueError(f"masking {self.masking!r}: one of {MASKINGS}")
        if self.window not in WINDOWS:
            raise ValueError(f"window {self.window!r}: one of {WINDOWS}")
        if self.chunks not in CHUNK_HALOS:
            raise ValueError(f"chunks {self.chunks!r}: one of {CHUNK_HALOS}")
        if self.backward_payload not in BACKWARD_PAYLOADS:
            raise ValueError(f"backward_payload {self.backward_payload!r}: one of "
                             f"{BACKWARD_PAYLOADS}")
        chunks = self.ranks * (2 if self.layout == "zigzag" else 1)
        if self.ranks < 1 or self.n < chunks:
            raise ValueError(f"need ranks >= 1 and n >= {chunks} (one row per chunk)")
        if not self.sigmas or self.heads % self.kv_heads:
            raise ValueError("kv_heads must divide the number of query heads (len(sigmas))")
        if self.method in ("lsh_fused", "lsh_per_sample") and self.samples < 1:
            raise ValueError("samples >= 1")

    @property
    def heads(self):
        return len(self.sigmas)

    @property
    def group(self):
        return self.heads // self.kv_heads

    @property
    def kv_row_bytes(self):
        """Bytes of one K and one V row of one key/value head."""
        return (self.d + self.dv) * self.itemsize

    @property
    def backward_row_bytes(self):
        """(bytes of one backward window row of one key/value head outside the own rows, extra
        bytes when the row is outside the forward halo too): "out_lse", K, V and Q, out, dO, lse
        of the G query heads, (d + dv + G (d + 2 dv + 1)) itemsize, nothing extra; "lse_d",
        Q, dO, lse, D of the G query heads, G ((d + dv) itemsize + 2 stat_itemsize), and K, V,
        (d + dv) itemsize, if not received forward."""
        if self.backward_payload == "out_lse":
            return (self.d + self.dv + self.group * (self.d + 2 * self.dv + 1)) * self.itemsize, 0
        return (self.group * ((self.d + self.dv) * self.itemsize + 2 * self.stat_itemsize),
                self.kv_row_bytes)


# --------------------------------------------------------------------------------------------
# Shards


def chunk_bounds(n, ranks, layout):
    """(bounds, owner): chunk c is [bounds[c], bounds[c+1]), held by rank owner[c]."""
    if layout == "contiguous":
        chunks = np.arange(ranks + 1, dtype=np.int64)
        return (n * chunks) // ranks, np.arange(ranks, dtype=np.int64)
    if layout == "zigzag":
        chunks = np.arange(2 * ranks + 1, dtype=np.int64)
        c = np.arange(2 * ranks, dtype=np.int64)
        return (n * chunks) // (2 * ranks), np.where(c < ranks, c, 2 * ranks - 1 - c)
    raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")


def rank_chunks(ranks, layout):
    """Chunk indices of each rank, shape (R, C): [[r]] or [[r, 2R-1-r]]."""
    r = np.arange(ranks, dtype=np.int64)[:, None]
    return r if layout == "contiguous" else np.concatenate([r, 2 * ranks - 1 - r], axis=1)


def shards(problem):
    """(starts, ends) of every rank's chunks, each of shape (R, C)."""
    bounds, _ = chunk_bounds(problem.n, problem.ranks, problem.layout)
    chunks = rank_chunks(problem.ranks, problem.layout)
    return bounds[chunks], bounds[chunks + 1]


# --------------------------------------------------------------------------------------------
# Hashes and the blocks at the shard edges


@functools.lru_cache(maxsize=512)
def _hash_table(method, sigmas, samples, seed, streams):
    """widths, offsets of every query head's hashes, each (H, S)."""
    if method == "fixed_blocks":
        sets = [poslsh.fixed_blocks_hash(sigma) for sigma in sigmas]
    else:
        sets = [poslsh.rbf_hashes(sigma, samples, seed, stream=h)
                for h, sigma in zip(streams, sigmas)]
    widths = np.array([np.asarray(s.widths) for s in sets], dtype=np.float64)
    offsets = np.array([np.asarray(s.offsets) for s in sets], dtype=np.float64)
    return widths, offsets


def hash_table(problem):
    return _hash_table(problem.method, problem.sigmas, problem.samples, problem.seed,
                       problem.streams)


def _bins(positions, widths, offsets):
    """bin(i) = floor((i - offset) / width) in float64, as BinHash::bin."""
    return np.floor((positions.astype(np.float64) - offsets) / widths)


def _step(edge, widths, offsets, b, move_if, delta):
    """Moves edge by delta while move_if(bin at the probed position) holds; the probed position
    is edge + (delta < 0 ? -1 : 0). Works on the entries still moving only."""
    shift = 1 if delta < 0 else 0
    probe = edge - shift
    active = np.flatnonzero(move_if(probe, _bins(probe, widths, offsets), b))
    while active.size:
        edge[active] += delta
        probe = edge[active] - shift
        move = move_if(probe, _bins(probe, widths[active], offsets[active]), b[active])
        active = active[move]


def block_begin(widths, offsets, positions, n):
    """begin of the block holding each position: block_containing(hash, i, n).begin of
    include/poslsh/lsh/partition.hpp, vectorised over broadcastable arrays (the same estimate
    from the width and offset, corrected against the bins so it agrees with them exactly)."""
    arrays = np.broadcast_arrays(np.asarray(widths, np.float64), np.asarray(offsets, np.float64),
                                 np.asarray(positions, np.int64))
    shape = arrays[0].shape
    widths, offsets, positions = (np.ascontiguousarray(v).ravel() for v in arrays)
    b = _bins(positions, widths, offsets)
    first = np.ceil(b * widths + offsets)
    begin = np.clip(first, 0, positions).astype(np.int64)
    # while bin(begin - 1) == b: --begin; while bin(begin) < b: ++begin
    _step(begin, widths, offsets, b, lambda p, bins, target: (p >= 0) & (bins == target), -1)
    _step(begin, widths, offsets, b, lambda p, bins, target: bins < target, 1)
    return np.where(widths < 1.0, positions, begin).reshape(shape)


def block_end(widths, offsets, positions, n):
    """end of the block holding each position, cut to n: block_containing(hash, i, n).end."""
    arrays = np.broadcast_arrays(np.asarray(widths, np.float64), np.asarray(offsets, np.float64),
                                 np.asarray(positions, np.int64))
    shape = arrays[0].shape
    widths, offsets, positions = (np.ascontiguousarray(v).ravel() for v in arrays)
    b = _bins(positions, widths, offsets)
    following = np.ceil((b + 1) * widths + offsets)
    end = np.clip(following, positions + 1, n).astype(np.int64)
    # while end < n and bin(end) == b: ++end; while bin(end - 1) > b: --end
    _step(end, widths, offsets, b, lambda p, bins, target: (p < n) & (bins == target), 1)
    _step(end, widths, offsets, b, lambda p, bins, target: bins > target, -1)
    return np.where(widths < 1.0, positions + 1, end).reshape(shape)


def block_edges(widths, offsets, positions, n):
    """(begin, end) of the block holding each position, cut to [0, n) (block_containing)."""
    return block_begin(widths, offsets, positions, n), block_end(widths, offsets, positions, n)


def bands(problem):
    """W_h = band_for_bias_error(sigma_h, band_error) per query head (int64)."""
    return np.array([poslsh.band_for_bias_error(s, problem.band_error) for s in problem.sigmas],
                    dtype=np.int64)


def reach(problem, starts, ends):
    """(a, b) of chunks [starts, ends) (int arrays of any shape X) per key/value head: arrays of
    shape (kv_heads,) + X. a = the first key any query of the chunk reaches, b = one past the
    last query that reaches the chunk's last key (see the module docstring)."""
    starts = np.asarray(starts, np.int64)
    ends = np.asarray(ends, np.int64)
    n, heads = problem.n, problem.heads
    shape = (heads,) + starts.shape
    if problem.method == "exact_tiled":
        a = np.zeros(shape, np.int64)
        b = np.full(shape, n, np.int64)
    elif problem.method == "exact_banded":
        w = bands(problem).reshape((heads,) + (1,) * starts.ndim)
        a = np.maximum(0, starts - np.minimum(w, n))
        b = np.minimum(n, ends + np.minimum(w, n))
    else:
        widths, offsets = hash_table(problem)  # (H, S)
        extra = (1,) * starts.ndim
        w = widths.reshape(widths.shape + extra)
        o = offsets.reshape(offsets.shape + extra)
        first = block_begin(w, o, starts[None, None], n)
        last = block_end(w, o, (ends - 1)[None, None], n)
        a = first.min(axis=1)
        b = last.max(axis=1)
    grouped = (problem.kv_heads, problem.group) + starts.shape
    return a.reshape(grouped).min(axis=1), b.reshape(grouped).max(axis=1)


# --------------------------------------------------------------------------------------------
# Halo ranges and bytes


@dataclass
class Halos:
    """Halo ranges of every rank r, chunk c and key/value head g (arrays (R, C, kv_heads)):
    forward keys [forward_begin, forward_end), backward window [window_begin, window_end); the
    chunk itself is [starts, ends) (arrays (R, C)). Bytes and messages: arrays (R,)."""

    problem: Problem
    starts: np.ndarray
    ends: np.ndarray
    a: np.ndarray
    b: np.ndarray
    forward_begin: np.ndarray
    forward_end: np.ndarray
    window_begin: np.ndarray
    window_end: np.ndarray
    # (R, kv_heads): rows received (own rows excluded; Problem.chunks "separate": summed over
    # the rank's chunks, a row two chunks need counted twice)
    forward_rows: np.ndarray = field(default=None)
    window_rows: np.ndarray = field(default=None)
    forward_bytes: np.ndarray = field(default=None)  # (R, kv_heads) bytes received
    backward_bytes: np.ndarray = field(default=None)
    forward_recv: np.ndarray = field(default=None)
    forward_sent: np.ndarray = field(default=None)
    backward_recv: np.ndarray = field(default=None)
    backward_sent: np.ndarray = field(default=None)
    forward_peers_in: np.ndarray = field(default=None)
    forward_peers_out: np.ndarray = field(default=None)
    backward_peers_in: np.ndarray = field(default=None)
    backward_peers_out: np.ndarray = field(default=None)

    def rank_intervals(self, r, g, which="forward"):
        """The halo of rank r, kv head g as a sorted list of disjoint [x, y) (own rows out; the
        union over the rank's chunks)."""
        begin = self.forward_begin if which == "forward" else self.window_begin
        end = self.forward_end if which == "forward" else self.window_end
        union = _merge([(int(x), int(y)) for x, y in zip(begin[r, :, g], end[r, :, g])])
        own = _merge([(int(x), int(y)) for x, y in zip(self.starts[r], self.ends[r])])
        return _subtract(union, own)


def _merge(intervals):
    out = []
    for x, y in sorted(i for i in intervals if i[1] > i[0]):
        if out and x <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], y))
        else:
            out.append((x, y))
    return out


def _subtract(intervals, remove):
    out = []
    for x, y in intervals:
        pieces = [(x, y)]
        for u, v in remove:
            pieces = [p for q in pieces for p in ((q[0], min(q[1], u)), (max(q[0], v), q[1]))
                      if p[1] > p[0]]
        out.extend(pieces)
    return out


def _union_chunks(begin, end):
    """Merge the C <= 2 intervals along axis 1 of (R, C, G) arrays: returns (begin, end) of the
    same shape, disjoint, an absorbed interval emptied (begin = end)."""
    if begin.shape[1] == 1:
        return begin.copy(), end.copy()
    order = np.argsort(begin, axis=1, kind="stable")
    x = np.take_along_axis(begin, order, 1)
    y = np.take_along_axis(end, order, 1)
    overlap = x[:, 1] <= y[:, 0]
    y0 = np.where(overlap, np.maximum(y[:, 0], y[:, 1]), y[:, 0])
    x1 = np.where(overlap, y0, x[:, 1])
    y1 = np.where(overlap, y0, y[:, 1])
    return np.stack([x[:, 0], x1], 1), np.stack([y0, y1], 1)


def _chunk_overlap(x, y, weight, bounds):
    """sum over intervals [x, y) of weight |[x, y) n chunk c| for every chunk c (int64)."""
    x, y, weight = (np.asarray(v, np.int64).ravel() for v in np.broadcast_arrays(x, y, weight))
    keep = y > x
    x, y, weight = x[keep], y[keep], weight[keep]
    m = len(bounds) - 1
    out = np.zeros(m, np.int64)
    cx = np.searchsorted(bounds, x, side="right") - 1
    cy = np.searchsorted(bounds, y - 1, side="right") - 1
    same = cx == cy

    def add(index, values, size=m):  # exact: |values| sums stay far below 2^53
        return np.rint(np.bincount(index, values.astype(np.float64), minlength=size)).astype(
            np.int64)

    out += add(cx[same], weight[same] * (y[same] - x[same]))
    cx, cy, x, y, w = cx[~same], cy[~same], x[~same], y[~same], weight[~same]
    out += add(cx, w * (bounds[cx + 1] - x)) + add(cy, w * (y - bounds[cy]))
    full = add(cx + 1, w, m + 1) - add(cy, w, m + 1)  # chunks cx+1 .. cy-1 covered entirely
    return out + np.cumsum(full)[:m] * np.diff(bounds)


def _peers(begin, end, bounds, owner, ranks):
    """(peers in, peers out) per rank: the ranks owning rows of the union over heads and chunks
    of [begin, end) (arrays (R, C, G)), the rank itself excluded."""
    lo = begin.min(axis=2)  # every head's interval holds the chunk: spans (R, C)
    hi = end.max(axis=2)
    m = len(bounds) - 1
    first = np.searchsorted(bounds, lo, side="right") - 1  # chunks first .. last covered
    last = np.searchsorted(bounds, hi - 1, side="right") - 1
    rows = np.broadcast_to(np.arange(ranks)[:, None] * (m + 1), lo.shape)
    size = ranks * (m + 1)
    cover = (np.bincount((rows + first).ravel(), minlength=size)
             - np.bincount((rows + last + 1).ravel(), minlength=size)).astype(np.int32)
    covered = np.cumsum(cover.reshape(ranks, m + 1), axis=1)[:, :m] > 0  # (R, m)
    peers = np.zeros((ranks, ranks), bool)
    for c in range(covered.shape[1] // ranks):  # owner is a permutation on each block of R
        block = slice(c * ranks, (c + 1) * ranks)
        peers[:, owner[block]] |= covered[:, block]
    np.fill_diagonal(peers, False)
    return peers.sum(axis=1), peers.sum(axis=0)


def halo_ranges(problem):
    """Halo ranges, rows, bytes (received and sent) and peers of every rank (Halos; cached per
    problem: treat the result as read-only)."""
    return _halo_ranges(problem)


def _own_overlap(begin, end, starts, ends):
    """|[begin, end) n the rank's own rows| of (R, C, G) intervals, the rank's chunks [starts,
    ends) of shape (R, C')."""
    lo = np.maximum(begin[..., None], starts[:, None, None, :])
    hi = np.minimum(end[..., None], ends[:, None, None, :])
    return np.maximum(hi - lo, 0).sum(axis=-1)


@functools.lru_cache(maxsize=16)
def _halo_ranges(problem):
    starts, ends = shards(problem)  # (R, C)
    a, b = reach(problem, starts, ends)  # (G, R, C)
    a, b = np.moveaxis(a, 0, -1), np.moveaxis(b, 0, -1)  # (R, C, G)
    e = ends[:, :, None]
    forward_begin = a
    forward_end = np.broadcast_to(e, a.shape).copy() if problem.masking == "causal" else b
    if problem.window == "tile":
        window_begin, window_end = (a // TILE) * TILE, b
    elif problem.window == "exact":
        window_begin, window_end = a, b
    else:
        window_begin = np.broadcast_to((a.min(axis=2, keepdims=True) // TILE) * TILE, a.shape)
        window_end = np.broadcast_to(b.max(axis=2, keepdims=True), b.shape)
    halos = Halos(problem, starts, ends, a, b, forward_begin, forward_end, window_begin,
                  window_end)
    if problem.chunks == "merged":
        fb, fe = _union_chunks(forward_begin, forward_end)
        wb, we = _union_chunks(window_begin, window_end)
    else:
        fb, fe, wb, we = forward_begin, forward_end, window_begin, window_end
    # Rows of each (rank, chunk, head) range that the rank owns: not sent.
    own_forward = _own_overlap(fb, fe, starts, ends)  # (R, C, G)
    own_window = _own_overlap(wb, we, starts, ends)
    halos.forward_rows = ((fe - fb) - own_forward).sum(axis=1)  # (R, G)
    halos.window_rows = ((we - wb) - own_window).sum(axis=1)
    kv = problem.kv_row_bytes
    row, extra = problem.backward_row_bytes  # extra: rows outside the forward halo (lse_d)
    halos.forward_bytes = halos.forward_rows * kv
    # The forward range of a chunk lies inside its window (and so do their unions).
    halos.backward_bytes = (halos.window_rows * row
                            + (halos.window_rows - halos.forward_rows) * extra)
    halos.forward_recv = halos.forward_bytes.sum(axis=1)
    halos.backward_recv = halos.backward_bytes.sum(axis=1)
    bounds, owner = chunk_bounds(problem.n, problem.ranks, problem.layout)
    R = problem.ranks
    # Sent: every range's rows counted at the ranks owning them, minus those a rank owns itself.
    forward_cover = _chunk_overlap(fb, fe, kv, bounds)
    window_cover = _chunk_overlap(wb, we, row + extra, bounds) - _chunk_overlap(fb, fe, extra,
                                                                                bounds)
    halos.forward_sent = (np.bincount(owner, forward_cover, minlength=R).round().astype(np.int64)
                          - own_forward.sum(axis=(1, 2)) * kv)
    halos.backward_sent = (np.bincount(owner, window_cover, minlength=R).round().astype(np.int64)
                           - own_window.sum(axis=(1, 2)) * (row + extra)
                           + own_forward.sum(axis=(1, 2)) * extra)
    halos.forward_peers_in, halos.forward_peers_out = _peers(forward_begin, forward_end, bounds,
                                                             owner, R)
    halos.backward_peers_in, halos.backward_peers_out = _peers(window_begin, window_end, bounds,
                                                               owner, R)
    return halos


def shard_rows(problem):
    """Rows of every rank's shard, (R,)."""
    starts, ends = shards(problem)
    return (ends - starts).sum(axis=1)


def ring_bytes(problem):
    """(forward, backward) bytes each rank receives in the K/V ring of poslsh.distributed (and
    the MPI example's forward): every shard but the own one, (n - own rows) kv_heads (d + dv)
    itemsize; backward that again plus the dK/dV partials of the own shard from the R - 1
    others, (R - 1) (own rows) kv_heads (d + dv) itemsize."""
    own = shard_rows(problem)
    row = problem.kv_heads * problem.kv_row_bytes
    forward = (problem.n - own) * row
    return forward, forward + (problem.ranks - 1) * own * row


def ring_bytes_sent(problem):
    """(forward, backward) bytes each rank sends in the K/V ring: rank r forwards the shards of
    ranks r, r - 1, .., r - R + 2 (every one but rank r + 1's), (n - rows of rank r + 1)
    kv_heads (d + dv) itemsize; backward that again plus its dK/dV partials of every other
    rank's shard, (n - own rows) kv_heads (d + dv) itemsize."""
    own = shard_rows(problem)
    row = problem.kv_heads * problem.kv_row_bytes
    forward = (problem.n - np.roll(own, -1)) * row
    return forward, forward + (problem.n - own) * row


def ring_messages(problem):
    """(forward, backward) messages per rank, sent plus received (empty ones are not sent)."""
    own = shard_rows(problem)
    R = problem.ranks
    r = np.arange(R)
    steps = np.arange(R - 1)
    nonempty = own > 0
    # Step k: rank r sends the shard of rank r - k, receives that of rank r - k - 1.
    ring = (nonempty[(r[:, None] - steps[None, :]) % R].sum(axis=1)
            + nonempty[(r[:, None] - steps[None, :] - 1) % R].sum(axis=1))
    others = nonempty.sum() - nonempty  # dK/dV partials sent to the nonempty other shards
    partials = others + np.where(nonempty, R - 1, 0)  # and received when the own is nonempty
    return ring, ring + partials


def ring_bytes_closed_form(n, ranks, kv_heads, d, dv, itemsize):
    """(R-1)/R n kv_heads (d + dv) itemsize: the forward ring bytes per rank when R | n."""
    return (ranks - 1) * n // ranks * kv_heads * (d + dv) * itemsize


# --------------------------------------------------------------------------------------------
# Pairs (compute)


def _phi(z, dtype=np.float64):
    """z - (1 - e^-z) = e^-z - 1 + z >= 0, accurate for small z: below 0.1 the series
    sum_{k>=2} (-z)^k / k! to k = 14, above expm1(-z) + z (relative error <= 20 ulps)."""
    z = np.asarray(z, dtype)
    out = np.expm1(-z) + z
    small = z < 0.1
    if small.any():
        zs = z[small]
        series = np.zeros_like(zs)
        for k in range(14, 1, -1):  # Horner: z^2 (1/2! - z (1/3! - z (...)))
            series = dtype(1) / dtype(math.factorial(k)) - zs * series
        out[small] = zs * zs * series
    return out


def _geometric_k(x, rate, dtype=np.float64):
    """sum_{t=0}^{x-1} (x - t) e^{-rate t} for x >= 1, without cancellation:
    [phi(rate (x+1)) - (x+1) phi(rate)] / (1 - e^-rate)^2."""
    x1 = np.asarray(x, dtype) + 1
    rate = np.asarray(rate, dtype)
    one_minus_r = -np.expm1(-rate)
    return (_phi(rate * x1, dtype) - x1 * _phi(rate, dtype)) / (one_minus_r * one_minus_r)


def pair_kernel(problem):
    """K(x) summed over query heads, as a function of an int array x (float64 result):
    K(x) = sum_{t=0}^{x-1} (x - t) h(t) for x > 0, 0 otherwise (module docstring).
    kernel.heads(x), x of shape (H, ...): K_h(x[h]) per query head, shape (H, ...)."""
    sigmas = np.array(problem.sigmas, np.float64)[:, None]
    method = problem.method
    heads = problem.heads
    if method == "lsh_fused" and problem.samples > MAX_SAMPLES:
        raise ValueError(f"the lsh_fused pair model takes samples <= {MAX_SAMPLES}")
    if method == "exact_banded":
        w = bands(problem).astype(np.float64)[:, None]

    def values(xp):
        """K_h at xp > 0, xp of shape (1 or H, X): shape (H, X)."""
        if method == "exact_tiled":
            return np.broadcast_to(xp * (xp + 1) / 2, (heads, xp.shape[1]))
        if method == "exact_banded":
            return np.where(xp <= w + 1, xp * (xp + 1) / 2, (w + 1) * xp - w * (w + 1) / 2)
        if method == "fixed_blocks":
            width = np.maximum(2.0 * sigmas, 2.0**-20)
            m = np.minimum(xp - 1, np.ceil(width) - 1)  # last t with t < width and t < x
            s1, s2 = m * (m + 1) / 2, m * (m + 1) * (2 * m + 1) / 6
            return (m + 1) * xp - s1 - xp * s1 / width + s2 / width
        if method == "lsh_per_sample":
            return problem.samples * _geometric_k(xp, 1.0 / sigmas)
        # lsh_fused: h(t) = 1 - (1 - r^t)^s = sum_j beta_j r^{j t}, r = e^{-1/sigma}. The
        # alternating sum loses up to 2^s ulps: float64 to s = 24 (relative error below 1e-9),
        # long double beyond (below 1e-7 at s = 32).
        s = problem.samples
        dtype = np.float64 if s <= 24 else np.longdouble
        j = np.arange(1, s + 1)
        beta = np.array([math.comb(s, int(k)) * (-1) ** (int(k) + 1) for k in j], dtype=dtype)
        rate = (j[None, :] / sigmas).astype(dtype)[:, :, None]  # (H, S, 1)
        terms = _geometric_k(xp[:, None, :], rate, dtype)  # (H, S, X)
        return np.einsum("j,hjx->hx", beta, terms).astype(np.float64)

    def kernel(x):
        x = np.asarray(x, np.int64)
        flat = x.ravel()
        pos = flat > 0
        out = np.zeros(flat.shape, np.float64)
        out[pos] = values(flat[pos].astype(np.float64)[None, :]).sum(axis=0)
        return out.reshape(x.shape)

    def per_head(x):
        x = np.asarray(x, np.int64)
        flat = x.reshape(heads, -1)
        clipped = np.maximum(flat, 1).astype(np.float64)
        return np.where(flat > 0, values(clipped), 0.0).reshape(x.shape)

    kernel.heads = per_head
    # h(0) per head: the pairs (i, i), counted once in a bidirectional pair count.
    kernel.head_diagonal = problem.samples if method == "lsh_per_sample" else 1
    kernel.diagonal = heads * kernel.head_diagonal
    return kernel


def _evaluate_unique(kernel, x):
    values, inverse = np.unique(np.asarray(x, np.int64), return_inverse=True)
    return kernel(values)[inverse].reshape(np.shape(x))


def pairs(problem, q, k, masking=None, kernel=None, per_head=False):
    """Pairs of non-zero weight between query rows q = (begin, end) and keys k = (begin, end)
    (broadcastable int arrays), summed over query heads (expected value for random methods);
    per_head: one value per query head (a leading axis H)."""
    kernel = kernel or pair_kernel(problem)
    masking = masking or problem.masking
    qa, qb = (np.asarray(v, np.int64) for v in q)
    ka, kb = (np.asarray(v, np.int64) for v in k)
    qa, qb, ka, kb = np.broadcast_arrays(qa, qb, ka, kb)
    args = np.stack([qb - ka, qa - ka, qb - kb, qa - kb])
    if masking == "bidirectional":
        args = np.concatenate([args, np.stack([kb - qa, ka - qa, kb - qb, ka - qb])])
    if per_head:
        heads = problem.heads
        values = np.moveaxis(kernel.heads(np.broadcast_to(args, (heads,) + args.shape)), 0, 1)
        diagonal = kernel.head_diagonal
    else:
        values = _evaluate_unique(kernel, args)
        diagonal = kernel.diagonal
    causal = values[0] - values[1] - values[2] + values[3]
    if masking == "causal":
        return causal
    overlap = np.maximum(0, np.minimum(qb, kb) - np.maximum(qa, ka))
    return causal + values[4] - values[5] - values[6] + values[7] - diagonal * overlap


@dataclass
class Compute:
    """Per-rank pairs and FLOPs of the halo scheme (arrays (R,); *_heads: (H, R) per query
    head)."""

    own_all: np.ndarray  # own queries x all keys (forward pairs)
    own_own: np.ndarray
    all_own: np.ndarray  # all queries x own keys
    window: np.ndarray  # every pair inside the backward windows
    forward_flops: np.ndarray
    backward_flops: np.ndarray
    own_all_heads: np.ndarray = None
    window_heads: np.ndarray = None
    forward_flops_heads: np.ndarray = None
    backward_flops_heads: np.ndarray = None


BACKWARD_PAIRS = ("window", "own")


def halo_compute(problem, halos=None, backward_pairs="window", kernel=None):
    """See _halo_compute (cached per problem when halos and kernel are the default ones)."""
    if halos is None and kernel is None:
        return _halo_compute_cached(problem, backward_pairs)
    return _halo_compute(problem, halos, backward_pairs, kernel)


@functools.lru_cache(maxsize=16)
def _halo_compute_cached(problem, backward_pairs):
    return _halo_compute(problem, None, backward_pairs, None)


def _halo_compute(problem, halos, backward_pairs, kernel):
    """Pairs and FLOPs per rank of the halo scheme. Forward: the own queries over every key.
    Backward, backward_pairs = "window": every pair of nonzero weight inside each chunk's
    backward window, per head its key/value head's window (multihead_attention_window_backward
    runs self-attention on the window), 6 d + 4 dv FLOPs a pair; "own": only the pairs with an
    own query or key, 6 d + 4 dv when both are own, 4 d + 2 dv (dQ) or 4 d + 4 dv (dK, dV) when
    one is (module docstring)."""
    if backward_pairs not in BACKWARD_PAIRS:
        raise ValueError(f"backward_pairs {backward_pairs!r}: one of {BACKWARD_PAIRS}")
    kernel = kernel or pair_kernel(problem)
    halos = halos if halos is not None else halo_ranges(problem)
    starts, ends = shards(problem)
    n = problem.n
    own_all_heads = pairs(problem, (starts, ends), (0, n), kernel=kernel,
                          per_head=True).sum(axis=2)  # (H, R)
    all_own_heads = pairs(problem, (0, n), (starts, ends), kernel=kernel,
                          per_head=True).sum(axis=2)
    own_own_heads = pairs(problem, (starts[:, :, None], ends[:, :, None]),
                          (starts[:, None, :], ends[:, None, :]), kernel=kernel,
                          per_head=True).sum(axis=(2, 3))
    own_all, all_own, own_own = (x.sum(axis=0) for x in (own_all_heads, all_own_heads,
                                                          own_own_heads))
    lengths = halos.window_end - halos.window_begin  # (R, C, G)
    per_head = np.repeat(np.moveaxis(lengths, 2, 0), problem.group, axis=0)  # (H, R, C)
    window_heads = kernel.heads(per_head)
    if problem.masking == "bidirectional":
        window_heads = 2 * window_heads - kernel.head_diagonal * per_head
    window_heads = window_heads.sum(axis=2)  # (H, R)
    window = window_heads.sum(axis=0)
    d, dv = problem.d, problem.dv
    forward_heads = 2 * (d + dv) * own_all_heads
    if backward_pairs == "window":
        backward_heads = (6 * d + 4 * dv) * window_heads
    else:
        backward_heads = ((6 * d + 4 * dv) * own_own_heads
                          + (4 * d + 2 * dv) * (own_all_heads - own_own_heads)
                          + (4 * d + 4 * dv) * (all_own_heads - own_own_heads))
    return Compute(own_all, own_own, all_own, window, forward_heads.sum(axis=0),
                   backward_heads.sum(axis=0), own_all_heads, window_heads, forward_heads,
                   backward_heads)


def ring_pairs(problem, kernel=None):
    """P[r, k]: pairs of rank r's queries against the K/V shard it holds at ring step k (the
    shard of rank (r - k) mod R), summed over heads; shape (R, R)."""
    kernel = kernel or pair_kernel(problem)
    bounds, _ = chunk_bounds(problem.n, problem.ranks, problem.layout)
    m = len(bounds) - 1
    sizes = np.diff(bounds)
    R = problem.ranks
    r = np.arange(R)[:, None]
    key_rank = (r - np.arange(R)[None, :]) % R  # the shard rank r holds at step k
    if np.all(sizes == sizes[0]):
        # Equal chunks: pairs of query chunk i and key chunk j depend on i - j only:
        # V(i-j+1) - 2 V(i-j) + V(i-j-1), V(x) = K(x * chunk size).
        values = kernel(np.arange(-m - 1, m + 2, dtype=np.int64) * sizes[0])
        by_gap = values[2:] - 2 * values[1:-1] + values[:-2]  # gap -m .. m
        if problem.masking == "bidirectional":
            by_gap = by_gap + by_gap[::-1]
            by_gap[m] -= kernel.diagonal * sizes[0]
        if problem.layout == "contiguous":
            return by_gap[r - key_rank + m]
        q = (r, 2 * R - 1 - r)
        k = (key_rank, 2 * R - 1 - key_rank)
        return sum(by_gap[qc - kc + m] for qc in q for kc in k)
    # K(bounds[u] - bounds[v]) for all boundary pairs, then the causal chunk pairs
    # K(qb-ka) - K(qa-ka) - K(qb-kb) + K(qa-kb).
    table = _evaluate_unique(kernel, bounds[:, None] - bounds[None, :])
    chunk = table[1:, :-1] - table[:-1, :-1] - table[1:, 1:] + table[:-1, 1:]
    if problem.masking == "bidirectional":
        chunk = chunk + chunk.T - kernel.diagonal * np.diag(sizes).astype(np.float64)
    if problem.layout == "zigzag":
        front, back = slice(0, R), slice(2 * R - 1, R - 1, -1)
        chunk = (chunk[front, front] + chunk[front, back] + chunk[back, front]
                 + chunk[back, back])
    return chunk[r, key_rank]


# --------------------------------------------------------------------------------------------
# Time model


@dataclass(frozen=True)
class Machine:
    latency: float = 5e-6  # seconds per message
    bandwidth: float = 25e9  # bytes per second per rank and direction
    flops_rate: float = 90e9  # FLOP/s per rank


@dataclass
class Estimate:
    """Time of one forward + backward of one layer on the slowest rank, and the bytes."""

    method: str
    transport: str
    layout: str
    halo_bytes: int  # max over ranks of received bytes, forward + backward (halo)
    ring_bytes: int  # max over ranks of received bytes, forward + backward (ring)
    compute: float  # s
    total: float  # s
    messages: int = 0  # max over ranks of messages received, forward + backward
    extra: dict = field(default_factory=dict)

    @property
    def comm(self):
        return self.total - self.compute


def estimate_halo(problem, machine, passes="both", halos=None, backward_pairs="window"):
    """Halo exchange, then compute, no overlap."""
    if halos is None or halos is halo_ranges(problem):
        halos, comp = halo_ranges(problem), halo_compute(problem, None, backward_pairs)
    else:
        comp = halo_compute(problem, halos, backward_pairs)
    total = compute = 0.0
    recv = np.zeros(problem.ranks, np.int64)
    messages = np.zeros(problem.ranks, np.int64)
    for name, flops, bytes_in, bytes_out, peers_in, peers_out in (
            ("forward", comp.forward_flops, halos.forward_recv, halos.forward_sent,
             halos.forward_peers_in, halos.forward_peers_out),
            ("backward", comp.backward_flops, halos.backward_recv, halos.backward_sent,
             halos.backward_peers_in, halos.backward_peers_out)):
        if passes not in ("both", name):
            continue
        seconds = flops / machine.flops_rate
        comm = (np.maximum(peers_in, peers_out) * machine.latency
                + np.maximum(bytes_in, bytes_out) / machine.bandwidth)
        total += float((seconds + comm).max())
        compute += float(seconds.max())
        recv += bytes_in
        messages += peers_in
    return Estimate(problem.method, "halo", problem.layout, int(recv.max()), 0, compute, total,
                    int(messages.max()), dict(halos=halos, pairs=comp))


def estimate_ring(problem, machine, passes="both"):
    """K/V ring (R-1 steps), transfer overlapped with the step's compute, bulk-synchronous."""
    step_pairs = ring_pairs(problem)  # (R, R)
    starts, ends = shards(problem)
    shard_bytes = (ends - starts).sum(axis=1) * problem.kv_heads * problem.kv_row_bytes  # (R,)
    R = problem.ranks
    r = np.arange(R)
    # Bytes rank r receives during step k: the shard of rank (r - k - 1) mod R.
    incoming = shard_bytes[(r[:, None] - np.arange(R)[None, :] - 1) % R][:, :R - 1]
    d, dv = problem.d, problem.dv
    forward_bytes, backward_bytes = ring_bytes(problem)
    total = compute = 0.0
    recv = np.zeros(R, np.int64)
    for name, per_pair, factor, received in (("forward", 2 * (d + dv), 1, forward_bytes),
                                             ("backward", 6 * d + 4 * dv, 2, backward_bytes)):
        if passes not in ("both", name):
            continue
        seconds = step_pairs * per_pair / machine.flops_rate  # (R, R)
        transfer = factor * incoming / machine.bandwidth
        steps = np.maximum(seconds[:, :R - 1], transfer) + machine.latency
        total += float(steps.max(axis=0).sum() + seconds[:, R - 1].max())
        compute += float(seconds.sum(axis=1).max())
        recv += received
    return Estimate(problem.method, "ring", problem.layout, 0, int(recv.max()), compute, total,
                    (R - 1) * (2 if passes == "both" else 1), dict(step_pairs=step_pairs))


def head_subset(problem, kv_mask):
    """The problem restricted to the key/value heads where kv_mask holds (and their query
    heads, keeping their hash streams)."""
    query = np.repeat(np.asarray(kv_mask, bool), problem.group)
    return dataclasses.replace(problem, sigmas=tuple(np.array(problem.sigmas)[query]),
                               streams=tuple(np.array(problem.streams)[query]),
                               kv_heads=int(np.count_nonzero(kv_mask)))


def ring_heads(problem, machine, backward_pairs="window", halos=None):
    """The key/value heads a hybrid sends around the ring: those whose time alone is lower on
    a ring, both without overlap (the slowest rank of each):
      halo  (forward + backward FLOPs of the head) / rate + (its halo bytes) / bandwidth,
      ring  (pairs(own queries, all keys) (8 d + 6 dv)) / rate + 3 (n - own rows) (d + dv)
            itemsize / bandwidth."""
    halos = halos if halos is not None else halo_ranges(problem)
    compute = halo_compute(problem, None if halos is halo_ranges(problem) else halos,
                           backward_pairs)
    d, dv, G = problem.d, problem.dv, problem.group
    kv = problem.kv_row_bytes

    def by_kv(heads):  # (H, R) -> (G_kv, R): sum over each key/value head's query heads
        return heads.reshape(problem.kv_heads, G, -1).sum(axis=1)

    own_all = by_kv(compute.own_all_heads)
    halo_flops = by_kv(compute.forward_flops_heads + compute.backward_flops_heads)
    halo_bytes = (halos.forward_bytes + halos.backward_bytes).T  # (G_kv, R)
    halo_time = halo_flops.max(axis=1) / machine.flops_rate + halo_bytes.max(axis=1) / \
        machine.bandwidth
    starts, ends = shards(problem)
    other = problem.n - (ends - starts).sum(axis=1)
    ring_time = ((8 * d + 6 * dv) * own_all).max(axis=1) / machine.flops_rate + \
        3 * other.max() * kv / machine.bandwidth
    return ring_time < halo_time


def estimate_hybrid(problem, machine, passes="both", backward_pairs="window"):
    """Halos for the key/value heads that are cheaper with a halo, a ring for the others
    (ring_heads: in practice the widest heads), one after the other (times add)."""
    wide = ring_heads(problem, machine, backward_pairs)
    if not wide.any():
        result = estimate_halo(problem, machine, passes, backward_pairs=backward_pairs)
    elif wide.all():
        result = estimate_ring(problem, machine, passes)
    else:
        halo = estimate_halo(head_subset(problem, ~wide), machine, passes,
                             backward_pairs=backward_pairs)
        ring = estimate_ring(head_subset(problem, wide), machine, passes)
        result = Estimate(problem.method, "hybrid", problem.layout, halo.halo_bytes,
                          ring.ring_bytes, halo.compute + ring.compute, halo.total + ring.total,
                          halo.messages + ring.messages)
    result.transport = "hybrid"
    result.extra["ring_kv_heads"] = int(np.count_nonzero(wide))
    return result


def estimate(problem, transport, machine, passes="both", backward_pairs="window"):
    if transport == "halo":
        return estimate_halo(problem, machine, passes, backward_pairs=backward_pairs)
    if transport == "hybrid":
        return estimate_hybrid(problem, machine, passes, backward_pairs)
    if transport == "ring":
        return estimate_ring(problem, machine, passes)
    raise ValueError(f"transport {transport!r}: one of {TRANSPORTS}")


# --------------------------------------------------------------------------------------------
# Projection


def model_problem(model, n, ranks, method, layout, samples=16, seed=0, itemsize=2,
                  masking="causal", window="exact", **options):
    """The Problem of a model of MODELS; options: further Problem fields (chunks,
    backward_payload, ...)."""
    shape = MODELS[model]
    return Problem(n=n, ranks=ranks, sigmas=tuple(alibi_sigmas(shape["heads"], shape["max_bias"])),
                   layout=layout, method=method, masking=masking, samples=samples, seed=seed,
                   kv_heads=shape["kv_heads"], d=shape["d"], itemsize=itemsize, window=window,
                   **options)


def projection(models=tuple(MODELS), ranks=DEFAULT_RANKS, lengths=DEFAULT_LENGTHS,
               rows=PROJECTION_ROWS, machine=Machine(), samples=16, seed=0, itemsize=2,
               masking="causal", passes="both", layout=None, window="exact",
               backward_pairs="window", **options):
    """One record per (model, n, R, row), a row (method, transport, layout) of PROJECTION_ROWS
    (layout None: every row's own; options: further Problem fields): dicts with the Estimate's
    fields."""
    out = []
    for model in models:
        for n in lengths:
            for R in ranks:
                for method, transport, row_layout in rows:
                    chosen = layout or row_layout
                    problem = model_problem(model, n, R, method, chosen, samples, seed, itemsize,
                                            masking, window, **options)
                    result = estimate(problem, transport, machine, passes, backward_pairs)
                    out.append(dict(model=model, n=n, R=R, method=method, transport=transport,
                                    layout=chosen, halo_bytes=result.halo_bytes,
                                    ring_bytes=result.ring_bytes, compute=result.compute,
                                    comm=result.comm, total=result.total,
                                    messages=result.messages,
                                    ring_kv_heads=result.extra.get("ring_kv_heads")))
    return out


SHORT = {"exact_tiled": "exact", "lsh_fused": "LSH", "lsh_per_sample": "LSH per-sample",
         "fixed_blocks": "fixed blocks", "exact_banded": "banded"}


def kind(record):
    """(method, transport, layout) of a projection record."""
    return record["method"], record["transport"], record["layout"]


def label(key):
    method, transport, layout = key
    return f"{SHORT[method]} {transport}, {layout}"


def _tokens(n):
    return f"{n // 2**20}M" if n % 2**20 == 0 else (f"{n // 1024}K" if n % 1024 == 0 else str(n))


def _bytes(b):
    if not b:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b} B"


def _seconds(s):
    if s >= 1e5:
        return f"{s:.3g}"
    if s >= 1:
        return f"{s:.1f}" if s < 100 else f"{s:.0f}"
    return f"{s:.3g}"


def full_table(records):
    """The projection's columns: R, n, method / transport (layout), halo bytes, ring bytes,
    compute, comm, total (per rank, forward + backward)."""
    lines = ["| model | R | n | method / transport (layout) | halo bytes per rank "
             "| ring bytes per rank | compute s | comm s | total s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in records:
        lines.append(f"| {MODELS[x['model']]['label']} | {x['R']} | {_tokens(x['n'])} "
                     f"| {x['method']} / {x['transport']} ({x['layout']}) "
                     f"| {_bytes(x['halo_bytes'])} | {_bytes(x['ring_bytes'])} "
                     f"| {_seconds(x['compute'])} | {_seconds(x['comm'])} "
                     f"| {_seconds(x['total'])} |")
    return "\n".join(lines)


def summary_table(records, model):
    """Per (R, n): each row's total time per rank, the LSH halo and ring bytes per rank, the
    exposed communication of the contiguous LSH halo, and the fastest row."""
    rows = [x for x in records if x["model"] == model]
    kinds = list(dict.fromkeys(kind(x) for x in rows))
    head = ("| R | n | " + " | ".join(f"{label(k)} s" for k in kinds)
            + " | LSH halo bytes | ring bytes | LSH halo comm share | hybrid: K/V heads on the "
            "ring | fastest |")
    lines = [head, "|" + "---|" * (len(kinds) + 7)]
    for n in dict.fromkeys(x["n"] for x in rows):
        for R in dict.fromkeys(x["R"] for x in rows):
            cell = {kind(x): x for x in rows if x["n"] == n and x["R"] == R}
            if not cell:
                continue
            lsh = next((x for x in cell.values() if x["method"] == "lsh_fused"
                        and x["transport"] == "halo"), None)
            ring = next((x for x in cell.values() if x["transport"] == "ring"), None)
            best = min(cell.values(), key=lambda x: x["total"])
            share = f"{lsh['comm'] / lsh['total']:.1%}" if lsh else "-"
            hybrid = next((x for x in cell.values() if x["transport"] == "hybrid"), None)
            ring_heads = "-" if hybrid is None else str(hybrid["ring_kv_heads"])
            lines.append(
                f"| {R} | {_tokens(n)} | "
                + " | ".join(_seconds(cell[k]["total"]) if k in cell else "-" for k in kinds)
                + f" | {_bytes(lsh['halo_bytes']) if lsh else '-'}"
                + f" | {_bytes(ring['ring_bytes']) if ring else '-'} | {share} | {ring_heads}"
                + f" | {label(kind(best))} |")
    return "\n".join(lines)


def widest_halo_table(model, lengths, ranks, samples=16, seed=0):
    """Halo rows of the widest key/value head for LSH and banded against the shard size, and
    the LSH halo's peers: where halos reach over many shards."""
    lines = ["| n | R | shard rows | widest sigma | LSH halo rows (max over ranks) "
             "| banded halo rows | LSH peers (max) |", "|---|---|---|---|---|---|---|"]
    for n in dict.fromkeys(lengths):
        for R in dict.fromkeys(ranks):
            lsh = halo_ranges(model_problem(model, n, R, "lsh_fused", "contiguous", samples,
                                            seed))
            band = halo_ranges(model_problem(model, n, R, "exact_banded", "contiguous", samples,
                                             seed))
            g = int(np.argmax(lsh.problem.sigmas)) // lsh.problem.group
            lines.append(f"| {_tokens(n)} | {R} | {n // R} | {max(lsh.problem.sigmas):.0f} "
                         f"| {int(lsh.forward_rows[:, g].max())} "
                         f"| {int(band.forward_rows[:, g].max())} "
                         f"| {int(lsh.forward_peers_in.max())} |")
    return "\n".join(lines)


def plot(records, output, machine):
    """Time per rank against R, one panel per model, one line per (n, row): colour n, dash the
    method / transport / layout."""
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        print("gnuplot not found: no plot", file=sys.stderr)
        return False
    models = list(dict.fromkeys(x["model"] for x in records))
    lengths = list(dict.fromkeys(x["n"] for x in records))
    kinds = list(dict.fromkeys(kind(x) for x in records))
    colors = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d"]
    dashes = [1, 2, 4, 3, 5, 6]
    points = [7, 5, 9, 13, 11, 3]
    blocks = []
    script = [
        'set terminal pngcairo size 1600,760 enhanced font "sans,11"',
        f'set output "{output}"',
        "set logscale xy", "set logscale x 2", 'set format x "%g"', 'set format y "10^{%T}"',
        'set grid xtics ytics lc rgb "#dddddd"', 'set xlabel "ranks R"',
        'set ylabel "time per rank: forward + backward of one layer (s)"',
        'set key outside right top vertical Left reverse samplen 3 spacing 1.0 font ",9"',
        f'set multiplot layout 1,{len(models)} title "Context parallelism cost model: causal, '
        f'bfloat16, s = 16; latency {machine.latency * 1e6:g} us, {machine.bandwidth / 1e9:g} '
        f'GB/s, {machine.flops_rate / 1e9:g} GFLOP/s per rank" font ",13"',
    ]
    for model in models:
        plots = []
        for i, n in enumerate(lengths):
            for j, key in enumerate(kinds):
                data = [(x["R"], x["total"]) for x in records
                        if x["model"] == model and x["n"] == n and kind(x) == key]
                name = f"d{len(blocks)}"
                blocks.append(f"${name} << EOD\n" + "\n".join(f"{R} {t!r}" for R, t in data)
                              + "\nEOD")
                title = f"n = {_tokens(n)}, {label(key)}" if model == models[-1] else ""
                plots.append(f'${name} using 1:2 with linespoints dt {dashes[j % 6]} '
                             f'pt {points[j % 6]} ps 0.6 lw 1.5 lc rgb "{colors[i % 7]}" '
                             + (f'title "{title}"' if title else "notitle"))
        script.append(f'set title "{MODELS[model]["label"]}"')
        script.append("plot " + ", \\\n  ".join(plots))
    script.append("unset multiplot")
    text = "\n".join(blocks + script) + "\n"
    subprocess.run([gnuplot], input=text, text=True, check=True)
    return True


# --------------------------------------------------------------------------------------------
# Check against measured byte counts


def record_problem(record):
    heads = int(record["heads"])
    sigmas = record.get("sigmas")
    if sigmas is None:
        sigmas = alibi_sigmas(heads, float(record.get("max_bias", 8.0)))
    if len(sigmas) != heads:
        raise ValueError(f"record has {len(sigmas)} sigmas for {heads} heads")
    return Problem(n=int(record["n"]), ranks=int(record["R"]), sigmas=tuple(sigmas),
                   layout=record["layout"], method=record["method"], masking=record["masking"],
                   samples=int(record.get("samples", 16)), seed=int(record.get("seed", 0)),
                   kv_heads=int(record["kv_heads"]), d=int(record["d"]), dv=int(record["dv"]),
                   itemsize=int(record["itemsize"]),
                   stat_itemsize=int(record.get("stat_itemsize", 4)),
                   band_error=float(record.get("band_error", 1e-3)),
                   window=record.get("window", "exact"),
                   chunks=record.get("chunks", "separate"),
                   backward_payload=record.get("backward_payload", "out_lse"))


def model_bytes(problem, transport="halo"):
    """{field: per-rank array} of the bytes (received, sent) and messages the measured records
    carry."""
    if transport == "ring":
        forward, backward = ring_bytes(problem)
        forward_sent, backward_sent = ring_bytes_sent(problem)
        forward_messages, backward_messages = ring_messages(problem)
    elif transport == "halo":
        halos = halo_ranges(problem)
        forward, backward = halos.forward_recv, halos.backward_recv
        forward_sent, backward_sent = halos.forward_sent, halos.backward_sent
        forward_messages = halos.forward_peers_in + halos.forward_peers_out
        backward_messages = halos.backward_peers_in + halos.backward_peers_out
    else:
        raise ValueError(f"transport {transport!r}: 'halo' or 'ring'")
    return {"forward_bytes_per_rank": forward, "backward_bytes_per_rank": backward,
            "forward_sent_bytes_per_rank": forward_sent,
            "backward_sent_bytes_per_rank": backward_sent,
            "forward_messages_per_rank": forward_messages,
            "backward_messages_per_rank": backward_messages}


def relative_difference(measured, model):
    measured = np.asarray(measured, np.float64)
    model = np.asarray(model, np.float64)
    if measured.shape != model.shape:
        raise ValueError(f"{len(measured)} values for {len(model)} ranks")
    return np.abs(measured - model) / np.maximum(model, 1.0)


def measured_records(data):
    """The records of a --check file's JSON: a list of records or one; a report of
    examples/mpi_context_parallel --json (it holds "model_record") stands for its model_record,
    with "chunks" "merged" unless given (None for a null model_record: nothing to check)."""
    out = []
    for item in data if isinstance(data, list) else [data]:
        if "model_record" in item:
            record = item["model_record"]
            if record is not None:
                record = {"chunks": "merged", **record}
            item = record
        out.append(item)
    return out


def check(records, tolerance=0.0):
    """Compares measured records with the model: (ok, rows of a markdown table). A None record
    (a report without a model record) is listed as skipped."""
    lines = ["| # | n | R | layout | method | masking | transport | field | max rel. diff "
             "| measured (rank of max) | model |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for index, record in enumerate(records):
        if record is None:
            lines.append(f"| {index} | - | - | - | - | - | - | no model record (skipped) "
                         "| - | - | - |")
            continue
        problem = record_problem(record)
        transport = record.get("transport", "ring" if problem.method == "exact_tiled" else "halo")
        expected = model_bytes(problem, transport)
        for name, model in expected.items():
            if name not in record:
                continue
            diff = relative_difference(record[name], model)
            worst = int(np.argmax(diff))
            ok &= bool(diff[worst] <= tolerance)
            lines.append(f"| {index} | {problem.n} | {problem.ranks} | {problem.layout} "
                         f"| {problem.method} | {problem.masking} | {transport} | {name} "
                         f"| {diff[worst]:.3g} | {int(record[name][worst])} ({worst}) "
                         f"| {int(model[worst])} |")
    return ok, "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line


def _sizes(text):
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(item[-1:], 1)
        out.append(int(float(item[:-1] if scale > 1 else item) * scale))
    return tuple(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=5e-6, help="seconds per message (5e-6)")
    parser.add_argument("--bandwidth", type=float, default=25e9,
                        help="bytes/s per rank and direction (25e9)")
    parser.add_argument("--flops-rate", type=float, default=90e9,
                        help="attention FLOP/s of one core (90e9: exact_tiled's 180 GFLOP/s on "
                             "the 2 AVX-512 cores of docs/benchmarks.md)")
    parser.add_argument("--cores-per-rank", type=int, default=1)
    parser.add_argument("--ranks", type=_sizes, default=DEFAULT_RANKS)
    parser.add_argument("--lengths", type=_sizes, default=DEFAULT_LENGTHS, help="e.g. 1M,2M")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--itemsize", type=int, default=2)
    parser.add_argument("--masking", choices=MASKINGS, default="causal")
    parser.add_argument("--passes", choices=("both", "forward", "backward"), default="both")
    parser.add_argument("--layout", choices=LAYOUTS, default=None,
                        help="one layout for every row (default: each row's own, PROJECTION_ROWS)")
    parser.add_argument("--window", choices=WINDOWS, default="exact",
                        help="backward window convention (module docstring)")
    parser.add_argument("--chunks", choices=CHUNK_HALOS, default="separate",
                        help="zigzag: each chunk's halo (poslsh.distributed) or their union")
    parser.add_argument("--backward-payload", choices=BACKWARD_PAYLOADS, default="out_lse",
                        help="what a halo backward row carries (module docstring)")
    parser.add_argument("--backward-pairs", choices=BACKWARD_PAIRS, default="window",
                        help="halo backward compute: every pair of the window (default) or only "
                             "the pairs with an own query or key")
    parser.add_argument("--plot", default="docs/images/context_parallel_model.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--full", action="store_true", help="print the table of every row")
    parser.add_argument("--check", metavar="JSON", nargs="+",
                        help="compare measured bytes with the model (one or more files)")
    parser.add_argument("--tolerance", type=float, default=0.0)
    parser.add_argument("--halos", action="store_true",
                        help="print the halo ranges of one problem (--n, --model, --method)")
    parser.add_argument("--n", type=lambda t: _sizes(t)[0], default=65536)
    parser.add_argument("--model", choices=tuple(MODELS), default="bloom-7b1")
    parser.add_argument("--method", default="lsh_fused")
    args = parser.parse_args(argv)

    if args.check:
        records = []
        for name in args.check:
            with open(name) as f:
                records += measured_records(json.load(f))
        ok, table = check(records, args.tolerance)
        print(table)
        print(f"\n{'OK' if ok else 'MISMATCH'}: tolerance {args.tolerance:g}")
        return 0 if ok else 1

    if args.halos:
        problem = model_problem(args.model, args.n, args.ranks[0], ALIASES.get(args.method,
                                args.method), args.layout or "contiguous", args.samples,
                                args.seed, args.itemsize, args.masking, args.window,
                                chunks=args.chunks, backward_payload=args.backward_payload)
        halos = halo_ranges(problem)
        print("| rank | kv head | chunk | a | b | forward halo | backward window halo |")
        print("|---|---|---|---|---|---|---|")
        for r in range(problem.ranks):
            for g in range(problem.kv_heads):
                for c in range(halos.starts.shape[1]):
                    print(f"| {r} | {g} | [{halos.starts[r, c]}, {halos.ends[r, c]}) "
                          f"| {halos.a[r, c, g]} | {halos.b[r, c, g]} "
                          f"| {halos.rank_intervals(r, g)} "
                          f"| {halos.rank_intervals(r, g, 'window')} |")
        print()
        for r in range(problem.ranks):
            print(f"rank {r}: forward {halos.forward_recv[r]} B in / {halos.forward_sent[r]} B "
                  f"out, backward {halos.backward_recv[r]} B in / {halos.backward_sent[r]} B "
                  f"out, peers {halos.forward_peers_in[r]} / {halos.backward_peers_in[r]}")
        return 0

    machine = Machine(args.latency, args.bandwidth, args.flops_rate * args.cores_per_rank)
    models = tuple(m.strip() for m in args.models.split(","))
    started = time.perf_counter()
    records = projection(models, args.ranks, args.lengths, PROJECTION_ROWS, machine,
                         args.samples, args.seed, args.itemsize, args.masking, args.passes,
                         args.layout, args.window, args.backward_pairs, chunks=args.chunks,
                         backward_payload=args.backward_payload)
    elapsed = time.perf_counter() - started
    print(f"<!-- bench/context_parallel_model.py: latency {machine.latency:g} s, bandwidth "
          f"{machine.bandwidth:g} B/s, {machine.flops_rate:g} FLOP/s per rank, s = "
          f"{args.samples}, seed {args.seed}, itemsize {args.itemsize}, {args.masking}, passes "
          f"{args.passes}, window {args.window}, chunks {args.chunks}, backward payload "
          f"{args.backward_payload}, backward pairs {args.backward_pairs}; "
          f"{len(records)} rows in {elapsed:.1f} s -->")
    for model in models:
        print(f"\n### {MODELS[model]['label']}\n")
        print(summary_table(records, model))
    for model in models:
        print(f"\nWidest key/value head of {MODELS[model]['label']}, contiguous shards:\n")
        print(widest_halo_table(model, (args.lengths[0], args.lengths[-1]),
                                (args.ranks[0], args.ranks[-1]), args.samples, args.seed))
    if args.full:
        print("\n" + full_table(records))
    if not args.no_plot:
        directory = os.path.dirname(args.plot)
        if directory:
            os.makedirs(directory, exist_ok=True)
        if plot(records, args.plot, machine):
            print(f"\n<!-- plot: {args.plot} -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
