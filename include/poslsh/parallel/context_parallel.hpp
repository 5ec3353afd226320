/// \file
/// \brief Context parallelism: one sequence sharded over R ranks. The transport-free plan (which
/// key rows each rank reads, from which ranks) and the per-rank calls: attention of a rank's
/// queries over any contiguous slice of the sequence's keys, with its log-sum-exp, and the
/// backward pass of a window of the sequence.
///
/// Positions are those of the whole sequence (0 .. n - 1), so the ALiBi bias, the causal mask
/// and the LSH bins of a slice are the sequence's. For the methods whose queries reach a
/// bounded key range (exact_banded, lsh_fused, lsh_per_sample, fixed_blocks, and exact_tiled
/// with a local window) a rank reads the keys of a halo around its shard: its output rows are
/// bitwise the single-process rows, and so are its gradient rows when the backward runs on
/// the window the plan gives. Exact ALiBi over every key (exact_tiled, no window) passes K and V
/// around a ring: each slice's result merged by log-sum-exp (LseMerger, or the same formula),
/// equal to the single-process call to rounding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/names.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/backward/tiles.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/lsh/partition.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/methods.hpp"
#include "poslsh/multihead/training.hpp"

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
  detail::require(rank >= 0 && rank < ranks, function, "rank", rank,
                  "must be in [0, ranks) = [0, " + std::to_string(ranks) + ")");
  detail::require(enum_is_valid(layout), function, "layout", static_cast<int>(layout),
                  "must be " + enum_name_list<ShardLayout>());
  // floor(n c / parts) without overflow (c <= parts <= 2^32 > n mod parts).
  const auto cut = [n](Index c, Index parts) { return n / parts * c + n % parts * c / parts; };
  if (layout == ShardLayout::contiguous) return {{cut(rank, ranks), cut(rank + 1, ranks)}};
  const Index parts = 2 * ranks, other = parts - 1 - rank;
  return {{cut(rank, parts), cut(rank + 1, parts)}, {cut(other, parts), cut(other + 1, parts)}};
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
  if (method_draws_hashes(head.method) || head.method == Method::fixed_blocks) {
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
  if (method_draws_hashes(head.method) || head.method == Method::fixed_blocks) {
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

/// The plan of a context-parallel call: for each rank, its chunks (one per shard range), and
/// whether the method needs a ring (exact_tiled without a local window: every key).
struct ContextParallelPlan {
  Index n = 0;
  Index ranks = 1;
  Masking masking = Masking::causal;
  bool ring = false;
  std::vector<std::vector<ContextParallelChunk>> chunks;

  /// The rank holding position p (-1 outside [0, n)).
  Index owner(Index position) const {
    for (std::size_t r = 0; r < chunks.size(); ++r)
      for (const ContextParallelChunk& chunk : chunks[r])
        if (position >= chunk.queries.begin && position < chunk.queries.end)
          return static_cast<Index>(r);
    return -1;
  }
};

/// The transport-free plan of one sequence of n positions whose rank r holds the position
/// ranges shards[r] (together they cover [0, n) once; empty ranges allowed), for the query
/// heads `heads` (resolved methods, e.g. resolve_head_methods) read by `kv_heads` K/V heads
/// (grouped-query attention: query head h reads K/V head h / (H_q / H_kv)). For each rank and
/// each of its ranges, the keys of every K/V head (head_key_range of its query heads) and the
/// backward window (the union of head_key_range and head_query_range of the own positions,
/// begin rounded down to a multiple of 64).
/// \throws std::invalid_argument naming a bad argument.
inline ContextParallelPlan context_parallel_plan(
    const std::vector<std::vector<PositionRange>>& shards, Index n,
    const std::vector<HeadMethod>& heads, Index kv_heads, Masking masking) {
  constexpr const char* function = "context_parallel_plan";
  detail::require_shards(function, n, static_cast<Index>(shards.size()));
  detail::require(enum_is_valid(masking), function, "masking", static_cast<int>(masking),
                  "must be " + enum_name_list<Masking>());
  const auto query_heads = static_cast<Index>(heads.size());
  detail::require(query_heads >= 1, function, "heads", query_heads, "must hold >= 1 head");
  detail::require(kv_heads >= 1 && query_heads % kv_heads == 0, function, "kv_heads", kv_heads,
                  "must divide the query heads " + std::to_string(query_heads));
  // The ranges tile [0, n): sorted by begin, each starts where the previous ended.
  std::vector<PositionRange> all;
  for (const auto& ranges : shards) all.insert(all.end(), ranges.begin(), ranges.end());
  std::sort(all.begin(), all.end(), [](const PositionRange& a, const PositionRange& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  Index next = 0;
  for (const PositionRange& range : all) {
    detail::require(range.begin == next && range.end >= range.begin, function, "shards",
                    "[" + std::to_string(range.begin) + ", " + std::to_string(range.end) + ")",
                    "must cover [0, n) = [0, " + std::to_string(n) +
                        ") once: a range starts where another ends (expected begin " +
                        std::to_string(next) + ")");
    next = range.end;
  }
  detail::require(next == n, function, "shards", next,
                  "must cover [0, n) = [0, " + std::to_string(n) + ") (they end at this)");
  ContextParallelPlan plan;
  plan.n = n;
  plan.ranks = static_cast<Index>(shards.size());
  plan.masking = masking;
  for (const HeadMethod& head : heads) {
    detail::require(enum_is_valid(head.method), function, "heads", static_cast<int>(head.method),
                    "methods must be " + enum_name_list<Method>());
    plan.ring =
        plan.ring ||
        (head.method == Method::exact_tiled &&
         (head.window_left < 0 || (masking == Masking::bidirectional && head.window_right < 0)));
  }
  const Index group = query_heads / kv_heads;
  constexpr Index tile = detail::backward_tile;
  for (const auto& ranges : shards) {
    std::vector<ContextParallelChunk> chunks;
    for (const PositionRange& own : ranges) {
      ContextParallelChunk chunk;
      chunk.queries = own;
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
  std::vector<std::vector<PositionRange>> shards;
  for (Index r = 0; r < ranks; ++r) shards.push_back(shard_ranges(n, ranks, r, layout));
  return context_parallel_plan(shards, n, heads, kv_heads, masking);
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

/// Attention of the queries at positions query_offset .. query_offset + m - 1 (the m tokens of
/// q) over the keys at positions key_offset .. key_offset + L - 1 (the L tokens of k and v) of
/// one sequence, every head by its method (as multihead_attention: sigmas, hashes, bands,
/// GQA), with the log-sum-exp lse (H_q x m) of each row:
///   out_i = sum_j w_ij e^{x_ij} v_j / sum_j w_ij e^{x_ij},  lse_i = log sum_j w_ij e^{x_ij},
/// j over the slice's keys, w and x the method's weights and scores at the absolute positions
/// (ALiBi bias -|i - j| / sigma, causal mask j <= i, LSH counts of the absolute bins). A row
/// with no key of nonzero weight in the slice gets out 0 and lse -inf. Results over disjoint
/// key slices merge exactly by their lse (LseMerger); a slice holding every key that the
/// rows reach (head_key_range) gives bitwise the rows of the call on the whole sequence. One
/// parallel loop over (query tile, head) jobs: bitwise the same for any thread count.
/// options.query_offset must be unset (the offsets are arguments). Scalar types as
/// multihead_attention with lse (q, k, v, out in Scalar, lse in backward_scalar_t<Scalar>).
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_slice(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                               HeadsView<const Scalar> v, HeadsView<Scalar> out,
                               HeadsLseRef<Scalar> lse, Index query_offset, Index key_offset,
                               const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_slice";
  detail::require(!options.query_offset, function, "options.query_offset",
                  options.query_offset.value_or(0),
                  "must be unset: the positions are the query_offset and key_offset arguments");
  detail::require(query_offset >= 0, function, "query_offset", query_offset, "must be >= 0");
  detail::require(key_offset >= 0, function, "key_offset", key_offset, "must be >= 0");
  detail::require_heads_inputs(function, q, k, v);
  detail::require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  detail::require_lse_shape(function, lse, q);
  detail::HeadsCall call;
  call.heads = detail::head_methods(function, q.heads, options);
  call.sequences.push_back({0, q.tokens, 0, k.tokens, query_offset, key_offset});
  call.tau = detail::resolve_scale(function, options, q.dim);
  call.masking = options.masking;
  call.precision = options.precision;
  detail::heads_forward_with_lse<Scalar>(call, q, k, v, out, lse);
}

/// Gradients of the attention restricted to a window of a sequence: the n tokens of q, k, v,
/// out, dout (and the n columns of lse) are the positions position .. position + n - 1, and
/// only the pairs (i, j) of the window count (self-attention inside it, bias, masks and LSH
/// bins at the absolute positions), with out and lse the forward's rows of the whole sequence
/// (P_ij = w_ij e^{x_ij - lse_i}). Conventions, sums and scalar types (half-precision inputs,
/// float lse and gradients) as multihead_attention_backward. A query row all of whose keys of
/// nonzero weight lie in the window gets its dq row, and a key all of whose queries do gets its
/// dk and dv rows, equal to the whole sequence's; bitwise equal when `position` is a multiple of
/// 64 (the tiles of the window are then the sequence's): ContextParallelChunk::window_span.
/// Bitwise the same for any thread count.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_window_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                         HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                         ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
                                         GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk,
                                         GradientHeadsView<Scalar> dv, Index position,
                                         const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_window_backward";
  detail::require(position >= 0, function, "position", position, "must be >= 0");
  detail::HeadsCall call = detail::training_call(
      function, q, k, v, lse, {0, static_cast<std::int32_t>(q.tokens)}, out, options);
  detail::require_gradient_views(function, q, k, v, dout, dq, dk, dv);
  call.sequences.front().p0 = position;
  call.sequences.front().k0 = position;
  detail::heads_backward<Scalar>(call, q, k, v, out, lse, dout, dq, dk, dv);
}

}  // namespace poslsh
