"""Cost model of context parallelism: halo exchange against a K/V ring, per rank and layer.

The geometry and the traffic are the library's: poslsh._core.ContextParallelPlan (the plan of
include/poslsh/parallel/plan.hpp that poslsh.distributed and examples/mpi_context_parallel run)
gives every rank's shard, the keys and backward windows of each of its chunks and K/V heads
(ranges()), and the bytes and messages of the halo exchange and of the ring (traffic(): the
messages the implementations send, byte for byte). This module adds what the plan does not
know: the expected number of pairs of nonzero weight of each method, and the time formulas.

Pairs: pairs(Q, K) = the pairs (i in Q, j in K) of nonzero weight, summed over query heads; for
the random methods its expectation over the hashes, exactly, from the distance law
  h(t) = P[key i - t is evaluated for query i], t >= 0:
    exact_tiled 1;  exact_banded [t <= W_h];  lsh_fused 1 - (1 - exp(-t/sigma))^s (the union of
    the s blocks holding i reaches back to the furthest block start; P[one block reaches t back]
    = exp(-t/sigma));  lsh_per_sample s exp(-t/sigma) (each sample's blocks separately);
    fixed_blocks max(0, 1 - t/(2 sigma)) (its block grid averaged over the offset).
  causal pairs([a,b), [c,d)) = K(b-c) - K(a-c) - K(b-d) + K(a-d),
  K(x) = sum_{t=0}^{x-1} (x - t) h(t) for x > 0, else 0 (closed forms in pair_kernel);
  bidirectional pairs(Q, K) = causal(Q, K) + causal(K, Q) - |Q n K|.
  Summed over the ranks: lsh_fused_pair_count's expectation. Local windows are not modeled.
FLOPs per pair: forward 2 (d + dv); backward 6 d + 4 dv (S recomputed, dV, dP, dQ, dK).
  halo forward   pairs(own queries, all keys);
  halo backward  every pair of each chunk's backward window (multihead_attention_window_backward
                 runs self-attention on it), per head the window of its K/V head; "own"
                 (backward_pairs) counts only the pairs with an own query or key instead,
                 6 d + 4 dv when both are own, 4 d + 2 dv (dQ) or 4 d + 4 dv (dK, dV) when one is;
  ring           pairs(own queries, the visiting shard's keys) per step, forward and backward.

Time, per pass (passes "both": forward and backward added), slowest rank:
  halo    max over ranks of  flops / rate + max(messages in, out) latency
                             + max(bytes in, out) / bandwidth   (exchange, then compute);
  ring    sum over steps k = 0 .. R-2 of max over ranks of
              [max(compute of step k, bytes of one shard / bandwidth) + latency]
          + max over ranks of the compute of the last step (transfer and compute overlap;
          the backward moves K, V and the dK/dV partials: twice the shard bytes);
  hybrid  halos for some K/V heads, a ring for the others, one after the other: a K/V head
          goes to the ring when, alone and without overlap, its ring time (pairs(own queries,
          all keys) (8 d + 6 dv) / rate + 3 (n - own rows) (d + dv) itemsize / bandwidth) is
          below its halo time (its FLOPs / rate + its halo bytes / bandwidth).
  compute = max over ranks of flops / rate; comm = total - compute (exposed communication).
Rate, latency and bandwidth are parameters (Machine): by default 90e9 FLOP/s per rank (one
AVX-512 core at exact_tiled's 180 GFLOP/s on 2 cores, docs/benchmarks.md), 5e-6 s per message,
25e9 B/s per rank and direction.

Measured bytes (check, --check FILE): JSON records (a list or one)
  {"n", "R", "layout", "method", "masking", "heads", "kv_heads", "d", "dv", "itemsize",
   "sigmas" (one per query head, or null: alibi_sigmas(heads)), "samples", "seed",
   optional "band_error", "window" ([left, right]), "transport" ("halo"; "ring" by default for
   exact_tiled), and any of "forward_bytes_per_rank", "backward_bytes_per_rank" (received),
   "forward_sent_bytes_per_rank", "backward_sent_bytes_per_rank", "forward_messages_per_rank",
   "backward_messages_per_rank" ([R ints])};
every *_per_rank field present is compared with the model, relative difference
|measured - model| / max(model, 1), which must not exceed the tolerance (default 0).

Command line: bench/context_parallel_model.py (main() here) prints the projection tables,
--full every row, --halos one problem's halos, --check measured records, and --update-docs
rewrites the generated table blocks of docs/context_parallel.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import _core

METHODS = ("lsh_fused", "lsh_per_sample", "fixed_blocks", "exact_tiled", "exact_banded")
ALIASES = {"banded": "exact_banded", "exact": "exact_tiled", "lsh": "lsh_fused"}
LAYOUTS = ("contiguous", "zigzag")
MASKINGS = ("causal", "bidirectional")
TRANSPORTS = ("halo", "ring", "hybrid")
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


def alibi_sigmas(heads, max_bias=8.0):
    """sigma_h = 1 / m_h, the library's ALiBi slopes of `heads` heads and max_bias."""
    return np.asarray(_core.alibi_sigmas(heads, max_bias=max_bias))


@dataclass(frozen=True)
class Problem:
    """One sharded attention layer: n tokens over R ranks, the heads of `sigmas` (one per query
    head) read by kv_heads K/V heads; heads_used (one flag per K/V head, None: all) restricts
    the modeled heads (a hybrid's halo or ring part) without changing the plan."""

    n: int
    ranks: int
    sigmas: tuple
    layout: str = "contiguous"
    method: str = "lsh_fused"
    masking: str = "causal"
    samples: int = 16
    seed: int = 0
    kv_heads: int | None = None  # None: one per query head
    d: int = 128
    dv: int | None = None  # None: d
    itemsize: int = 2
    band_error: float = 1e-3
    window: tuple = (-1, -1)
    heads_used: tuple | None = None

    def __post_init__(self):
        object.__setattr__(self, "sigmas", tuple(float(x) for x in self.sigmas))
        object.__setattr__(self, "method", ALIASES.get(self.method, self.method))
        object.__setattr__(self, "window", tuple(int(x) for x in self.window))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", len(self.sigmas))
        if self.dv is None:
            object.__setattr__(self, "dv", self.d)
        for name, value, allowed in (("method", self.method, METHODS),
                                     ("layout", self.layout, LAYOUTS),
                                     ("masking", self.masking, MASKINGS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: one of {allowed}")
        if self.ranks < 1 or self.n < 1:
            raise ValueError("need ranks >= 1 and n >= 1")
        if not self.sigmas or len(self.sigmas) % self.kv_heads:
            raise ValueError("kv_heads must divide the number of query heads (len(sigmas))")
        if self.heads_used is not None:
            used = tuple(bool(x) for x in self.heads_used)
            if len(used) != self.kv_heads or not any(used):
                raise ValueError("heads_used: one flag per K/V head, at least one set")
            object.__setattr__(self, "heads_used", used)

    @property
    def group(self):
        """Query heads per K/V head."""
        return len(self.sigmas) // self.kv_heads

    @property
    def used(self):
        """The flags of the modeled K/V heads (bool array)."""
        return np.ones(self.kv_heads, bool) if self.heads_used is None else np.array(self.heads_used)

    @property
    def active_sigmas(self):
        """The sigmas of the modeled query heads."""
        return tuple(np.array(self.sigmas)[np.repeat(self.used, self.group)])

    @property
    def heads(self):
        """The modeled query heads."""
        return len(self.active_sigmas)

    @property
    def kv_row_bytes(self):
        """Bytes of one K and one V row of one K/V head."""
        return (self.d + self.dv) * self.itemsize


@functools.lru_cache(maxsize=32)
def _plan(n, ranks, layout, method, masking, sigmas, samples, seed, band_error, window, kv_heads):
    return _core.ContextParallelPlan(n, ranks, query_heads=len(sigmas), kv_heads=kv_heads,
                                     layout=layout, method=method, masking=masking,
                                     sigmas=list(sigmas), samples=samples, seed=seed,
                                     band_error=band_error, window=window)


def plan(problem):
    """The library's plan of a problem (cached; every head, whatever heads_used says)."""
    return _plan(problem.n, problem.ranks, problem.layout, problem.method, problem.masking,
                 problem.sigmas, problem.samples, problem.seed, problem.band_error, problem.window,
                 problem.kv_heads)


def shards(problem):
    """(starts, ends) of every rank's chunks, each of shape (R, C): the plan's 'queries'."""
    queries = plan(problem).ranges("queries")
    return queries[..., 0], queries[..., 1]


def shard_rows(problem):
    """Rows of every rank's shard, (R,)."""
    starts, ends = shards(problem)
    return (ends - starts).sum(axis=1)


def traffic(problem, transport="halo"):
    """The library's bytes and messages per rank of a problem's modeled heads (a dict of
    arrays: ContextParallelPlan.traffic)."""
    used = None if problem.heads_used is None else list(problem.heads_used)
    return plan(problem).traffic(problem.d, problem.dv, problem.itemsize, transport=transport,
                                 kv_heads_used=used)


@dataclass
class Halos:
    """The halos of every rank r, chunk c and modeled K/V head g, from the plan: forward keys
    keys[r, c, g] and backward window window[r, c, g] ((begin, end) in the last axis; the chunk
    itself is [starts, ends), arrays (R, C)); the rows received per rank and K/V head
    (forward_rows, window_rows, (R, G)), the bytes received and sent, and the peers, per rank
    and pass (the plan's traffic)."""

    problem: Problem
    starts: np.ndarray
    ends: np.ndarray
    keys: np.ndarray
    window: np.ndarray
    forward_rows: np.ndarray
    window_rows: np.ndarray
    forward_bytes: np.ndarray  # (R, G) received
    backward_bytes: np.ndarray
    forward_recv: np.ndarray
    forward_sent: np.ndarray
    backward_recv: np.ndarray
    backward_sent: np.ndarray
    forward_peers_in: np.ndarray
    forward_peers_out: np.ndarray
    backward_peers_in: np.ndarray
    backward_peers_out: np.ndarray


def halo_ranges(problem):
    """The Halos of a problem (cached: treat the result as read-only)."""
    return _halo_ranges(problem)


@functools.lru_cache(maxsize=16)
def _halo_ranges(problem):
    p, t = plan(problem), traffic(problem, "halo")
    starts, ends = shards(problem)
    used = problem.used
    return Halos(problem, starts, ends, p.ranges("keys")[:, :, used], p.ranges("window")[:, :, used],
                 t["forward_rows"][:, used], t["backward_rows"][:, used],
                 t["forward_rows"][:, used] * t["forward_row_bytes"],
                 t["backward_rows"][:, used] * t["backward_row_bytes"],
                 t["forward_bytes_received"], t["forward_bytes_sent"], t["backward_bytes_received"],
                 t["backward_bytes_sent"], t["forward_peers_in"], t["forward_peers_out"],
                 t["backward_peers_in"], t["backward_peers_out"])


def chunk_bounds(problem):
    """(bounds, owner): the plan's non-empty chunks in position order, chunk c [bounds[c],
    bounds[c + 1]) held by rank owner[c]."""
    starts, ends = shards(problem)
    rank = np.broadcast_to(np.arange(problem.ranks)[:, None], starts.shape)
    keep = ends > starts
    order = np.argsort(starts[keep], kind="stable")
    return (np.append(starts[keep][order], problem.n).astype(np.int64),
            rank[keep][order].astype(np.int64))


def bands(problem):
    """W_h = band_for_bias_error(sigma_h, band_error) per modeled query head (int64)."""
    return np.array([_core.band_for_bias_error(s, problem.band_error)
                     for s in problem.active_sigmas], dtype=np.int64)


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
    if problem.window != (-1, -1):
        raise ValueError("the pair model does not model local windows")
    sigmas = np.array(problem.active_sigmas, np.float64)[:, None]
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


BACKWARD_PAIRS = ("window", "own")


def halo_compute(problem, backward_pairs="window"):
    """Pairs and FLOPs per rank of the halo scheme (cached per problem). Forward: the own
    queries over every key. Backward, backward_pairs = "window": every pair of nonzero weight
    inside each chunk's backward window, per head its K/V head's window (the window backward
    runs self-attention on it), 6 d + 4 dv FLOPs a pair; "own": only the pairs with an own query
    or key, 6 d + 4 dv when both are own, 4 d + 2 dv (dQ) or 4 d + 4 dv (dK, dV) when one is."""
    if backward_pairs not in BACKWARD_PAIRS:
        raise ValueError(f"backward_pairs {backward_pairs!r}: one of {BACKWARD_PAIRS}")
    return _halo_compute(problem, backward_pairs)


@functools.lru_cache(maxsize=16)
def _halo_compute(problem, backward_pairs):
    kernel = pair_kernel(problem)
    halos = halo_ranges(problem)
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
    lengths = halos.window[..., 1] - halos.window[..., 0]  # (R, C, G)
    lengths = np.where((ends > starts)[:, :, None], lengths, 0)  # empty chunks run nothing
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


def layout_chunks(problem):
    """(bounds, owner) of the layout's chunks in their order (contiguous: rank r's range;
    zigzag: chunks 0 .. 2R-1, chunk c held by rank min(c, 2R-1-c)), chunk c
    [bounds[c], bounds[c+1]), from the plan's shards."""
    starts, _ = shards(problem)
    R = problem.ranks
    if problem.layout == "contiguous":
        return np.append(starts[:, 0], problem.n), np.arange(R)
    c = np.arange(2 * R)
    return (np.append(np.concatenate([starts[:, 0], starts[::-1, 1]]), problem.n),
            np.where(c < R, c, 2 * R - 1 - c))


def ring_pairs(problem, kernel=None):
    """P[r, k]: pairs of rank r's queries against the K/V shard it holds at ring step k (the
    shard of rank (r - k) mod R), summed over heads; shape (R, R)."""
    kernel = kernel or pair_kernel(problem)
    bounds, _ = layout_chunks(problem)
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


def estimate_halo(problem, machine, passes="both", backward_pairs="window"):
    """Halo exchange, then compute, no overlap."""
    halos, comp = halo_ranges(problem), halo_compute(problem, backward_pairs)
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
    ring = traffic(problem, "ring")
    shard_bytes = shard_rows(problem) * ring["row_bytes"]  # (R,)
    R = problem.ranks
    r = np.arange(R)
    # Bytes rank r receives during step k: the shard of rank (r - k - 1) mod R.
    incoming = shard_bytes[(r[:, None] - np.arange(R)[None, :] - 1) % R][:, :R - 1]
    d, dv = problem.d, problem.dv
    total = compute = 0.0
    recv = np.zeros(R, np.int64)
    for name, per_pair, factor in (("forward", 2 * (d + dv), 1), ("backward", 6 * d + 4 * dv, 2)):
        if passes not in ("both", name):
            continue
        seconds = step_pairs * per_pair / machine.flops_rate  # (R, R)
        transfer = factor * incoming / machine.bandwidth
        steps = np.maximum(seconds[:, :R - 1], transfer) + machine.latency
        total += float(steps.max(axis=0).sum() + seconds[:, R - 1].max())
        compute += float(seconds.sum(axis=1).max())
        recv += ring[name + "_bytes_received"]
    return Estimate(problem.method, "ring", problem.layout, 0, int(recv.max()), compute, total,
                    (R - 1) * (2 if passes == "both" else 1), dict(step_pairs=step_pairs))


def head_subset(problem, kv_mask):
    """The problem restricted to the K/V heads where kv_mask holds (and their query heads): the
    same plan, those heads' halos and traffic."""
    used = problem.used & np.asarray(kv_mask, bool)
    return dataclasses.replace(problem, heads_used=tuple(bool(x) for x in used))


def ring_heads(problem, machine, backward_pairs="window"):
    """The K/V heads a hybrid sends around the ring: those whose time alone is lower on a ring,
    both without overlap (the slowest rank of each):
      halo  (forward + backward FLOPs of the head) / rate + (its halo bytes) / bandwidth,
      ring  (pairs(own queries, all keys) (8 d + 6 dv)) / rate + 3 (n - own rows) (d + dv)
            itemsize / bandwidth."""
    halos = halo_ranges(problem)
    compute = halo_compute(problem, backward_pairs)
    d, dv, G = problem.d, problem.dv, problem.group

    def by_kv(heads):  # (H, R) -> (G_kv, R): sum over each K/V head's query heads
        return heads.reshape(-1, G, heads.shape[-1]).sum(axis=1)

    own_all = by_kv(compute.own_all_heads)
    halo_flops = by_kv(compute.forward_flops_heads + compute.backward_flops_heads)
    halo_bytes = (halos.forward_bytes + halos.backward_bytes).T  # (G_kv, R)
    halo_time = (halo_flops.max(axis=1) / machine.flops_rate
                 + halo_bytes.max(axis=1) / machine.bandwidth)
    other = problem.n - shard_rows(problem)
    ring_time = (((8 * d + 6 * dv) * own_all).max(axis=1) / machine.flops_rate
                 + 3 * other.max() * problem.kv_row_bytes / machine.bandwidth)
    wide = np.zeros(problem.kv_heads, bool)
    wide[problem.used] = ring_time < halo_time
    return wide


def estimate_hybrid(problem, machine, passes="both", backward_pairs="window"):
    """Halos for the K/V heads that are cheaper with a halo, a ring for the others
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
                  masking="causal"):
    """The Problem of a model of MODELS."""
    shape = MODELS[model]
    return Problem(n=n, ranks=ranks, sigmas=tuple(alibi_sigmas(shape["heads"], shape["max_bias"])),
                   layout=layout, method=method, masking=masking, samples=samples, seed=seed,
                   kv_heads=shape["kv_heads"], d=shape["d"], itemsize=itemsize)


def projection(models=tuple(MODELS), ranks=DEFAULT_RANKS, lengths=DEFAULT_LENGTHS,
               rows=PROJECTION_ROWS, machine=None, samples=16, seed=0, itemsize=2,
               masking="causal", passes="both", layout=None, backward_pairs="window"):
    """One record per (model, n, R, row), a row (method, transport, layout) of PROJECTION_ROWS
    (layout None: every row's own): dicts with the Estimate's fields."""
    machine = machine or Machine()
    out = []
    for model in models:
        for n in lengths:
            for R in ranks:
                for method, transport, row_layout in rows:
                    chosen = layout or row_layout
                    problem = model_problem(model, n, R, method, chosen, samples, seed, itemsize,
                                            masking)
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
    """Halo rows of the widest K/V head for LSH and banded against the shard size, and the LSH
    halo's peers: where halos reach over many shards."""
    lines = ["| n | R | shard rows | widest sigma | LSH halo rows (max over ranks) "
             "| banded halo rows | LSH peers (max) |", "|---|---|---|---|---|---|---|"]
    for n in dict.fromkeys(lengths):
        for R in dict.fromkeys(ranks):
            lsh = halo_ranges(model_problem(model, n, R, "lsh_fused", "contiguous", samples, seed))
            band = halo_ranges(model_problem(model, n, R, "exact_banded", "contiguous", samples,
                                             seed))
            sigmas = lsh.problem.sigmas
            g = int(np.argmax(sigmas)) // lsh.problem.group
            lines.append(f"| {_tokens(n)} | {R} | {n // R} | {max(sigmas):.0f} "
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
                   band_error=float(record.get("band_error", 1e-3)),
                   window=tuple(record.get("window", (-1, -1))))


def model_bytes(problem, transport="halo"):
    """{field: per-rank array} of the bytes (received, sent) and messages the measured records
    carry: the library's traffic."""
    if transport not in ("halo", "ring"):
        raise ValueError(f"transport {transport!r}: 'halo' or 'ring'")
    t = traffic(problem, transport)
    return {"forward_bytes_per_rank": t["forward_bytes_received"],
            "backward_bytes_per_rank": t["backward_bytes_received"],
            "forward_sent_bytes_per_rank": t["forward_bytes_sent"],
            "backward_sent_bytes_per_rank": t["backward_bytes_sent"],
            "forward_messages_per_rank": t["forward_messages"],
            "backward_messages_per_rank": t["backward_messages"]}


def relative_difference(measured, model):
    measured = np.asarray(measured, np.float64)
    model = np.asarray(model, np.float64)
    if measured.shape != model.shape:
        raise ValueError(f"{len(measured)} values for {len(model)} ranks")
    return np.abs(measured - model) / np.maximum(model, 1.0)


def check(records, tolerance=0.0):
    """Compares measured records with the model: (ok, rows of a markdown table)."""
    lines = ["| # | n | R | layout | method | masking | transport | field | max rel. diff "
             "| measured (rank of max) | model |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for index, record in enumerate(records):
        problem = record_problem(record)
        transport = record.get("transport", "ring" if problem.method == "exact_tiled" else "halo")
        for name, model in model_bytes(problem, transport).items():
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
# Generated documentation: blocks between "<!-- context_parallel_model: NAME -->" and
# "<!-- end context_parallel_model -->" are rewritten in place.

DOC_BLOCK = re.compile(r"(<!-- context_parallel_model: (?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                       r"(<!-- end context_parallel_model -->)", re.S)


def _provenance(command, machine):
    """Where a generated table comes from: commit, host, command, modeled machine."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    host = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            host = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), host)
    except OSError:
        pass
    return (f"*Generated at commit {commit} on {host} ({os.cpu_count()} CPUs) by `{command}`; "
            f"modeled ranks: latency {machine.latency:g} s per message, bandwidth "
            f"{machine.bandwidth:g} B/s, {machine.flops_rate:g} FLOP/s.*")


def update_docs(path, tables, command, machine):
    """Rewrites the blocks of `path` named in `tables` ({name: markdown}) with the table and its
    provenance; returns the names rewritten. A name without a block in the file is an error."""
    with open(path) as f:
        text = f.read()
    found = set()

    def replace(match):
        name = match.group("name")
        if name not in tables:
            return match.group(0)
        found.add(name)
        return (match.group(1) + _provenance(command, machine) + "\n\n" + tables[name].rstrip()
                + "\n" + match.group(4))

    text = DOC_BLOCK.sub(replace, text)
    missing = sorted(set(tables) - found)
    if missing:
        raise ValueError(f"{path}: no generated block named {missing}")
    with open(path, "w") as f:
        f.write(text)
    return sorted(found)


# --------------------------------------------------------------------------------------------
# Command line


def _sizes(text):
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(item[-1:], 1)
        out.append(int(float(item[:-1] if scale > 1 else item) * scale))
    return tuple(out)


def main(argv=None, prog=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=5e-6, help="seconds per message (5e-6)")
    parser.add_argument("--bandwidth", type=float, default=25e9,
                        help="bytes/s per rank and direction (25e9)")
    parser.add_argument("--flops-rate", type=float, default=90e9,
                        help="attention FLOP/s of one core (90e9)")
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
    parser.add_argument("--backward-pairs", choices=BACKWARD_PAIRS, default="window",
                        help="halo backward compute: every pair of the window (default) or only "
                             "the pairs with an own query or key")
    parser.add_argument("--plot", default=None, help="write the projection plot (gnuplot) here")
    parser.add_argument("--full", action="store_true", help="print the table of every row")
    parser.add_argument("--check", metavar="JSON", nargs="+",
                        help="compare measured bytes with the model (one or more files)")
    parser.add_argument("--tolerance", type=float, default=0.0)
    parser.add_argument("--halos", action="store_true",
                        help="print the halo ranges of one problem (--n, --model, --method)")
    parser.add_argument("--n", type=lambda t: _sizes(t)[0], default=65536)
    parser.add_argument("--model", choices=tuple(MODELS), default="bloom-7b1")
    parser.add_argument("--method", default="lsh_fused")
    parser.add_argument("--update-docs", metavar="MARKDOWN",
                        help="rewrite the generated table blocks of this file (e.g. "
                             "docs/context_parallel.md) instead of printing")
    args = parser.parse_args(argv)

    if args.check:
        records = []
        for name in args.check:
            with open(name) as f:
                data = json.load(f)
            records += data if isinstance(data, list) else [data]
        ok, table = check(records, args.tolerance)
        print(table)
        print(f"\n{'OK' if ok else 'MISMATCH'}: tolerance {args.tolerance:g}")
        return 0 if ok else 1

    if args.halos:
        problem = model_problem(args.model, args.n, args.ranks[0], ALIASES.get(args.method,
                                args.method), args.layout or "contiguous", args.samples,
                                args.seed, args.itemsize, args.masking)
        halos = halo_ranges(problem)
        print("| rank | kv head | chunk | forward keys | backward window |")
        print("|---|---|---|---|---|")
        for r in range(problem.ranks):
            for g in range(problem.kv_heads):
                for c in range(halos.starts.shape[1]):
                    print(f"| {r} | {g} | [{halos.starts[r, c]}, {halos.ends[r, c]}) "
                          f"| {tuple(halos.keys[r, c, g])} | {tuple(halos.window[r, c, g])} |")
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
                         args.layout, args.backward_pairs)
    elapsed = time.perf_counter() - started
    tables = {}
    for model in models:
        tables[f"summary-{model}"] = summary_table(records, model)
        tables[f"widest-{model}"] = widest_halo_table(
            model, (args.lengths[0], args.lengths[-1]), (args.ranks[0], args.ranks[-1]),
            args.samples, args.seed)
    if args.full:
        tables["full"] = full_table(records)
    if args.plot:
        directory = os.path.dirname(args.plot)
        if directory:
            os.makedirs(directory, exist_ok=True)
        plot(records, args.plot, machine)
    if args.update_docs:
        command = " ".join(["python3", prog or "bench/context_parallel_model.py"]
                           + [shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])])
        names = update_docs(args.update_docs, tables, command, machine)
        print(f"{args.update_docs}: rewrote {', '.join(names)} ({len(records)} rows in "
              f"{elapsed:.1f} s)")
        return 0
    print(f"<!-- {len(records)} rows in {elapsed:.1f} s; latency {machine.latency:g} s, "
          f"bandwidth {machine.bandwidth:g} B/s, {machine.flops_rate:g} FLOP/s per rank -->")
    for name, table in tables.items():
        print(f"\n### {name}\n\n{table}")
    return 0
