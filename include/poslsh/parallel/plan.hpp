/// \file
/// \brief The transport-free plan of context parallelism: how the n positions of one sequence
/// are dealt out to R ranks, and which key rows each rank reads, from which ranks.
///
/// Positions are those of the whole sequence (0 .. n - 1). A rank holds one or more position
/// ranges (its shard); its tensors hold the rows of its ranges concatenated in order (local rows
/// 0 .. m - 1). For the methods whose queries reach a bounded key range (exact_banded, lsh_fused,
/// lsh_per_sample, fixed_blocks, and exact_tiled with a local window) a rank reads the keys of a
/// halo around each of its ranges; exact ALiBi over every key (exact_tiled without a local
/// window) needs every key: the plan then says `ring` (poslsh/parallel/ring.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "poslsh/core/names.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/backward/tiles.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/lsh/partition.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/methods.hpp"

namespace poslsh {

/// How the n positions of a sequence are dealt out to R ranks. `contiguous`: rank r holds
/// [n r / R, n (r + 1) / R). `zigzag`: the sequence is cut in 2R chunks [n c / 2R, n (c + 1) /
/// 2R) and rank r holds chunks r and 2R - 1 - r, which balances causal work.
enum class ShardLayout { contiguous, zigzag };

/// The names "contiguous" and "zigzag" (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(ShardLayout, contiguous, zigzag);

/// The positions [begin, end) of a sequence.
struct PositionRange {
  Index begin = 0;
  Index end = 0;

  Index size() const { return std::max<Index>(0, end - begin); }
  bool empty() const { return end <= begin; }
  friend bool operator==(const PositionRange& a, const PositionRange& b) {
    return a.begin == b.begin && a.end == b.end;
  }
};

/// The smallest range holding both (an empty range holds nothing).
inline PositionRange range_union(const PositionRange& a, const PositionRange& b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  return {std::min(a.begin, b.begin), std::max(a.end, b.end)};
}

/// The positions both hold (empty, begin = end, when none).
inline PositionRange range_intersection(const PositionRange& a, const PositionRange& b) {
  const Index begin = std::max(a.begin, b.begin);
  return {begin, std::max(begin, std::min(a.end, b.end))};
}

namespace detail {

inline void require_shards(const char* function, Index n, Index ranks) {
  require_size(n, function, "n");
  require(ranks >= 1 && ranks <= (Index{1} << 30), function, "ranks", ranks,
          "must be in [1, 2^30]");
}

}  // namespace detail

/// The positions rank `rank` of `ranks` holds under `layout`, in increasing order: one range
/// (contiguous) or two (zigzag: chunks r and 2R - 1 - r). Ranges may be empty (n < R).
/// \throws std::invalid_argument naming a bad argument (n < 0, ranks < 1, rank outside [0, R)).
inline std::vector<PositionRange> shard_ranges(Index n, Index ranks, Index rank,
                                               ShardLayout layout = ShardLayout::contiguous) {
  constexpr const char* function = "shard_ranges";
  detail::require_shards(function, n, ranks);
  detail::require_index(function, "rank", rank, "ranks", ranks);
  detail::require(enum_is_valid(layout), function, "layout", static_cast<int>(layout),
                  [&] { return "must be " + enum_name_list<ShardLayout>(); });
  // floor(n c / parts) without overflow (c <= parts <= 2^32 > n mod parts).
  const auto cut = [n](Index c, Index parts) { return n / parts * c + n % parts * c / parts; };
  if (layout == ShardLayout::contiguous) return {{cut(rank, ranks), cut(rank + 1, ranks)}};
  const Index parts = 2 * ranks, other = parts - 1 - rank;
  return {{cut(rank, parts), cut(rank + 1, parts)}, {cut(other, parts), cut(other + 1, parts)}};
}

/// shard_ranges of every rank: the shards argument of context_parallel_plan for `layout`.
/// \throws std::invalid_argument naming a bad argument.
inline std::vector<std::vector<PositionRange>> layout_shards(Index n, Index ranks,
                                                             ShardLayout layout) {
  detail::require_shards("layout_shards", n, ranks);
  std::vector<std::vector<PositionRange>> shards;
  for (Index r = 0; r < ranks; ++r) shards.push_back(shard_ranges(n, ranks, r, layout));
  return shards;
}

namespace detail {

/// [min over the hashes of the begin of the block holding `first`, max of the end of the block
/// holding `last`), blocks cut to [0, n).
inline PositionRange hash_block_span(const HashSet& hashes, Index first, Index last, Index n) {
  PositionRange span{first, last + 1};
  for (const BinHash& hash : hashes) {
    span.begin = std::min(span.begin, block_containing(hash, first, n).begin);
    span.end = std::max(span.end, block_containing(hash, last, n).end);
  }
  return span;
}

/// The largest |i - j| an exact head keeps on the side of earlier keys (i - j <= behind) and
/// of later keys (j - i <= ahead), unbounded as n.
inline std::pair<Index, Index> exact_reach(const HeadMethod& head, Index n, Masking masking) {
  Index behind = n, ahead = masking == Masking::causal ? 0 : n;
  if (head.method == Method::exact_banded) {
    behind = std::min(behind, head.band);
    ahead = std::min(ahead, head.band);
  }
  if (head.window_left >= 0) behind = std::min(behind, head.window_left);
  if (head.window_right >= 0) ahead = std::min(ahead, head.window_right);
  return {behind, ahead};
}

}  // namespace detail

/// The keys that the queries at positions `queries` reach under `head` (a nonzero weight for at
/// least one of them) in a sequence of n positions, as one range (the queries' windows are
/// intervals whose ends do not decrease):
///   lsh_fused, lsh_per_sample, fixed_blocks: [min_k b_k, max_k e_k), b_k the begin of the block
///     of hash k holding the first query, e_k the end of the block holding the last (causal:
///     cut at the last query + 1);
///   exact_banded, exact_tiled: [first - behind, last + ahead + 1) cut to [0, n), behind and
///     ahead the band W and the local window (unbounded: every key; causal: ahead = 0).
/// Empty queries reach nothing. Requires 0 <= queries.begin, queries.end <= n (checked by
/// context_parallel_plan).
inline PositionRange head_key_range(const HeadMethod& head, PositionRange queries, Index n,
                                    Masking masking) {
  if (queries.empty()) return {queries.begin, queries.begin};
  const Index first = queries.begin, last = queries.end - 1;
  const bool causal = masking == Masking::causal;
  if (method_weights_from_hashes(head.method)) {
    PositionRange span = detail::hash_block_span(head.hashes, first, last, n);
    if (causal) span.end = queries.end;
    return span;
  }
  const auto [behind, ahead] = detail::exact_reach(head, n, masking);
  return {std::max<Index>(0, first - behind), std::min(n, last + ahead + 1)};
}

/// The queries that reach the keys at positions `keys` under `head` (the transpose of
/// head_key_range): for the LSH methods the same blocks (causal: from the first key on); for the
/// exact methods [first - ahead, last + behind + 1) cut to [0, n).
inline PositionRange head_query_range(const HeadMethod& head, PositionRange keys, Index n,
                                      Masking masking) {
  if (keys.empty()) return {keys.begin, keys.begin};
  const Index first = keys.begin, last = keys.end - 1;
  if (method_weights_from_hashes(head.method)) {
    PositionRange span = detail::hash_block_span(head.hashes, first, last, n);
    if (masking == Masking::causal) span.begin = keys.begin;
    return span;
  }
  const auto [behind, ahead] = detail::exact_reach(head, n, masking);
  return {std::max<Index>(0, first - ahead), std::min(n, last + behind + 1)};
}

/// One shard range of a rank and what it reads. Rows are read per K/V head g (the union over
/// its query heads h with h / G = g); the buffers span the union over the K/V heads, rows a
/// head does not read left at zero.
struct ContextParallelChunk {
  /// The rank's own positions: its queries, and the keys it owns.
  PositionRange queries;
  /// The local row of queries.begin: the rows of the rank's earlier ranges.
  Index row = 0;
  /// Forward: the keys of K/V head g (keys[g]) and their union (key_span): the positions of
  /// the K and V buffers of multihead_attention_slice.
  std::vector<PositionRange> keys;
  PositionRange key_span;
  /// Backward: for K/V head g the positions whose tokens the gradients of the own rows read
  /// (window[g]: every pair (i, j) with weight > 0 and i or j own lies inside), and the
  /// window of multihead_attention_window_backward (window_span: their union, begin rounded
  /// down to a multiple of the backward tile, 64, so its tiles are the sequence's).
  std::vector<PositionRange> window;
  PositionRange window_span;
};

/// A non-empty range of a rank's shard and the local row of its first position.
struct OwnedRange {
  PositionRange positions;
  Index rank = 0;
  Index row = 0;
};

/// The plan of a context-parallel call: for each rank, its chunks (one per shard range), and
/// whether the method needs a ring (exact_tiled without a local window: every key).
struct ContextParallelPlan {
  Index n = 0;
  Index ranks = 1;
  Index query_heads = 1;
  Index kv_heads = 1;
  Masking masking = Masking::causal;
  bool ring = false;
  std::vector<std::vector<ContextParallelChunk>> chunks;
  /// Every rank's non-empty ranges in increasing position order (they tile [0, n)).
  std::vector<OwnedRange> owned;

  /// The rank holding position p (-1 outside [0, n)).
  Index owner(Index position) const {
    const OwnedRange* range = owned_range(position);
    return range == nullptr ? -1 : range->rank;
  }

  /// The rows of rank r's shard.
  Index shard_rows(Index rank) const {
    Index rows = 0;
    for (const ContextParallelChunk& chunk : chunks[static_cast<std::size_t>(rank)])
      rows += chunk.queries.size();
    return rows;
  }

  /// The owned range holding position p (null outside [0, n)): a binary search.
  const OwnedRange* owned_range(Index position) const {
    const auto it =
        std::upper_bound(owned.begin(), owned.end(), position,
                         [](Index p, const OwnedRange& range) { return p < range.positions.end; });
    return it == owned.end() || position < it->positions.begin ? nullptr : &*it;
  }

  /// visit(piece, owner): the parts of `positions` (cut to [0, n)) by the ranges that hold
  /// them, in increasing position order; piece.row is the owner's local row of its first
  /// position.
  template <typename Visit>
  void for_each_owner(PositionRange positions, Visit&& visit) const {
    auto it =
        std::upper_bound(owned.begin(), owned.end(), positions.begin,
                         [](Index p, const OwnedRange& range) { return p < range.positions.end; });
    for (; it != owned.end() && it->positions.begin < positions.end; ++it) {
      const PositionRange part = range_intersection(it->positions, positions);
      if (!part.empty())
        visit(OwnedRange{part, it->rank, it->row + part.begin - it->positions.begin});
    }
  }
};

/// The transport-free plan of one sequence of n positions whose rank r holds the position
/// ranges shards[r] (together they cover [0, n) once; empty ranges allowed; the rank's
/// tensors hold them in the order given), for the query heads `heads` (resolved methods, e.g.
/// resolve_head_methods) read by `kv_heads` K/V heads (grouped-query attention: query head h
/// reads K/V head h / (H_q / H_kv)). For each rank and each of its ranges, the keys of every
/// K/V head (head_key_range of its query heads) and the backward window (the union of
/// head_key_range and head_query_range of the own positions, begin rounded down to a multiple
/// of 64).
/// \throws std::invalid_argument naming a bad argument.
inline ContextParallelPlan context_parallel_plan(
    const std::vector<std::vector<PositionRange>>& shards, Index n,
    const std::vector<HeadMethod>& heads, Index kv_heads, Masking masking) {
  constexpr const char* function = "context_parallel_plan";
  detail::require_shards(function, n, static_cast<Index>(shards.size()));
  detail::require(enum_is_valid(masking), function, "masking", static_cast<int>(masking),
                  [&] { return "must be " + enum_name_list<Masking>(); });
  const auto query_heads = static_cast<Index>(heads.size());
  detail::require(query_heads >= 1, function, "heads", query_heads, "must hold >= 1 head");
  detail::require(kv_heads >= 1 && query_heads % kv_heads == 0, function, "kv_heads", kv_heads,
                  [&] { return "must divide the query heads " + std::to_string(query_heads); });
  ContextParallelPlan plan;
  plan.n = n;
  plan.ranks = static_cast<Index>(shards.size());
  plan.query_heads = query_heads;
  plan.kv_heads = kv_heads;
  plan.masking = masking;
  // The ranges tile [0, n): sorted by begin, each starts where the previous ended.
  for (std::size_t r = 0; r < shards.size(); ++r) {
    Index row = 0;
    for (const PositionRange& range : shards[r]) {
      detail::require(
          0 <= range.begin && range.begin <= range.end && range.end <= n, function, "shards",
          [&] {
            return "[" + std::to_string(range.begin) + ", " + std::to_string(range.end) + ")";
          },
          [&] { return "ranges must have 0 <= begin <= end <= n = " + std::to_string(n); });
      if (!range.empty()) plan.owned.push_back({range, static_cast<Index>(r), row});
      row += range.size();
    }
  }
  std::sort(plan.owned.begin(), plan.owned.end(), [](const OwnedRange& a, const OwnedRange& b) {
    return a.positions.begin < b.positions.begin;
  });
  Index next = 0;
  for (const OwnedRange& range : plan.owned) {
    detail::require(
        range.positions.begin == next, function, "shards",
        [&] {
          return "[" + std::to_string(range.positions.begin) + ", " +
                 std::to_string(range.positions.end) + ")";
        },
        [&] {
          return "must cover [0, n) = [0, " + std::to_string(n) +
                 ") once: a range starts where another ends (expected begin " +
                 std::to_string(next) + ")";
        });
    next = range.positions.end;
  }
  detail::require(next == n, function, "shards", next, [&] {
    return "must cover [0, n) = [0, " + std::to_string(n) + ") (they end at this)";
  });
  for (const HeadMethod& head : heads) {
    detail::require(enum_is_valid(head.method), function, "heads", static_cast<int>(head.method),
                    [&] { return "methods must be " + enum_name_list<Method>(); });
    plan.ring =
        plan.ring ||
        (head.method == Method::exact_tiled &&
         (head.window_left < 0 || (masking == Masking::bidirectional && head.window_right < 0)));
  }
  const Index group = query_heads / kv_heads;
  constexpr Index tile = detail::backward_tile;
  for (const auto& ranges : shards) {
    std::vector<ContextParallelChunk> chunks;
    Index row = 0;
    for (const PositionRange& own : ranges) {
      ContextParallelChunk chunk;
      chunk.queries = own;
      chunk.row = row;
      row += own.size();
      chunk.key_span = own;
      chunk.window_span = own;
      for (Index g = 0; g < kv_heads; ++g) {
        PositionRange keys = own, window = own;
        for (Index h = g * group; h < (g + 1) * group; ++h) {
          const HeadMethod& head = heads[static_cast<std::size_t>(h)];
          const PositionRange reach = head_key_range(head, own, n, masking);
          keys = range_union(keys, reach);
          window = range_union(window, range_union(reach, head_query_range(head, own, n, masking)));
        }
        chunk.keys.push_back(keys);
        chunk.window.push_back(window);
        chunk.key_span = range_union(chunk.key_span, keys);
        chunk.window_span = range_union(chunk.window_span, window);
      }
      chunk.window_span.begin = chunk.window_span.begin / tile * tile;
      chunks.push_back(std::move(chunk));
    }
    plan.chunks.push_back(std::move(chunks));
  }
  return plan;
}

/// context_parallel_plan over the shards of `layout` (shard_ranges of every rank).
/// \throws std::invalid_argument naming a bad argument.
inline ContextParallelPlan context_parallel_plan(Index n, Index ranks, ShardLayout layout,
                                                 const std::vector<HeadMethod>& heads,
                                                 Index kv_heads, Masking masking) {
  detail::require_shards("context_parallel_plan", n, ranks);
  return context_parallel_plan(layout_shards(n, ranks, layout), n, heads, kv_heads, masking);
}

/// The two passes of a halo exchange: the forward reads the plan's keys[g], the backward its
/// window[g].
enum class HaloPass { forward, backward };

/// The names "forward" and "backward" (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(HaloPass, forward, backward);

/// The rows of K/V head g that a chunk reads in a pass: keys[g] (forward) or window[g].
inline PositionRange halo_rows(const ContextParallelChunk& chunk, Index g, HaloPass pass) {
  const auto at = static_cast<std::size_t>(g);
  return pass == HaloPass::forward ? chunk.keys[at] : chunk.window[at];
}

/// One piece of what a rank reads in a halo pass: the positions `positions` of K/V head
/// kv_head that its chunk `chunk` reads, held by rank `source` at its local rows source_row ..
struct HaloSegment {
  Index chunk = 0;
  Index kv_head = 0;
  PositionRange positions;
  Index source = 0;
  Index source_row = 0;
};

/// visit(segment) for every piece of the rows rank `destination` reads in `pass` (halo_rows of
/// each of its chunks and K/V heads, cut by the ranges that hold them, its own included), in the
/// order (chunk, K/V head, position).
template <typename Visit>
void for_each_halo_segment(const ContextParallelPlan& plan, Index destination, HaloPass pass,
                           Visit&& visit) {
  const auto& chunks = plan.chunks[static_cast<std::size_t>(destination)];
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    if (chunks[c].queries.empty()) continue;
    for (Index g = 0; g < plan.kv_heads; ++g) {
      plan.for_each_owner(halo_rows(chunks[c], g, pass), [&](const OwnedRange& piece) {
        visit(HaloSegment{static_cast<Index>(c), g, piece.positions, piece.rank, piece.row});
      });
    }
  }
}

/// The segments of the rows that rank `destination` reads from rank `source` in `pass`, in the
/// order (chunk, K/V head, position): the message from source to destination (source ==
/// destination: the rows the rank holds itself, never sent).
/// \throws std::invalid_argument naming a rank outside [0, ranks).
inline std::vector<HaloSegment> halo_segments(const ContextParallelPlan& plan, Index destination,
                                              Index source, HaloPass pass) {
  constexpr const char* function = "halo_segments";
  detail::require_index(function, "destination", destination, "ranks", plan.ranks);
  detail::require_index(function, "source", source, "ranks", plan.ranks);
  std::vector<HaloSegment> segments;
  for_each_halo_segment(plan, destination, pass, [&](const HaloSegment& segment) {
    if (segment.source == source) segments.push_back(segment);
  });
  return segments;
}

/// The method of every query head from the options, as the all-heads calls resolve them
/// (sigmas, hashes rbf_hashes(sigma_h, s, seed, h), bands, local windows).
/// \throws std::invalid_argument naming a bad option.
inline std::vector<HeadMethod> resolve_head_methods(Index query_heads,
                                                    const MultiHeadOptions& options) {
  detail::require(query_heads >= 1, "resolve_head_methods", "query_heads", query_heads,
                  "must be >= 1");
  return detail::head_methods("resolve_head_methods", query_heads, options);
}

}  // namespace poslsh
