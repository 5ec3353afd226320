/// \file
/// \brief The K/V ring of context parallelism (exact ALiBi over every key: exact_tiled without
/// a local window), without the transport: the schedule, the forward's slices merged by
/// log-sum-exp, and the backward's slice gradients from the merged lse.
///
/// Schedule (ring_step): at step t = 0 .. R - 1 rank r holds the K/V shard of rank
/// (r - t) mod R; while it computes with it, it sends that shard to rank r + 1 and receives the
/// shard of rank (r - t - 1) mod R from rank r - 1 (no transfer at the last step). A shard
/// travels as one buffer, K [rows, H_kv, d] then V [rows, H_kv, d_v] (ring_shard_elements,
/// pack_ring_shard, ring_shard_views). At each step the rank computes every pair (own chunk,
/// range of the held shard) that can have a weight (ring_pairs: causal skips the ranges that
/// start after the chunk's last query):
///   forward   RingForward::add: multihead_attention_slice of the pair, merged into the chunk's
///             rows by log-sum-exp (LseMerger, in double) in step order;
///   backward  RingBackward::add: multihead_attention_slice_backward of the pair with the
///             merged lse, dq added into the rank's dq, dK and dV into the partial of the held
///             shard's rank; after the ring every rank sends each other rank its partial
///             (RingBackward::partial) and sums those of its own shard in increasing rank
///             order (RingBackward::result).
/// Equal to the single-process call to rounding, and deterministic: the merges and sums run in
/// the fixed order of the schedule, each kernel bitwise the same for any thread count.
#pragma once

#include <Eigen/Core>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "poslsh/core/heads_view.hpp"
#include "poslsh/interop/lse_merge.hpp"
#include "poslsh/parallel/halo.hpp"
#include "poslsh/parallel/rank.hpp"
#include "poslsh/parallel/slice.hpp"

namespace poslsh {

/// One step of the ring for one rank.
struct RingStep {
  Index source = 0;        ///< the rank whose K/V shard this rank holds (and computes with)
  Index send_to = 0;       ///< where the held shard goes: rank + 1
  Index receive_from = 0;  ///< where the next shard comes from: rank - 1
  Index arriving = 0;      ///< whose shard arrives: (rank - step - 1) mod R
  bool transfers = false;  ///< step < R - 1: the held shard moves on
};

/// Step `step` of rank `rank` of `ranks` (the file comment's schedule).
/// \throws std::invalid_argument naming a bad argument.
inline RingStep ring_step(Index ranks, Index rank, Index step) {
  constexpr const char* function = "ring_step";
  detail::require(ranks >= 1, function, "ranks", ranks, "must be >= 1");
  detail::require_index(function, "rank", rank, "ranks", ranks);
  detail::require_index(function, "step", step, "ranks", ranks);
  const auto mod = [ranks](Index x) { return ((x % ranks) + ranks) % ranks; };
  return {mod(rank - step), mod(rank + 1), mod(rank - 1), mod(rank - step - 1), step + 1 < ranks};
}

/// Elements of the ring buffer of rank `source`'s shard: rows (H_kv d + H_kv d_v).
inline Index ring_shard_elements(const ContextParallelRank& me, Index source) {
  const ContextParallelShapes& s = me.shapes();
  return me.plan().shard_rows(source) * s.kv_heads * (s.head_dim + s.value_dim);
}

/// One pair of a ring step: an own chunk and a range of the held shard.
struct RingPair {
  Index chunk = 0;     ///< the own chunk (its queries)
  PositionRange keys;  ///< the positions of the range of the source's shard
  Index key_row = 0;   ///< the source's local row of keys.begin
};

/// The pairs rank `rank` computes with the shard of rank `source`: every (own chunk, source
/// range), both non-empty, in the order (chunk, range), except causal pairs whose keys all
/// follow the chunk's queries.
inline std::vector<RingPair> ring_pairs(const ContextParallelPlan& plan, Index rank, Index source) {
  std::vector<RingPair> pairs;
  const auto& mine = plan.chunks[static_cast<std::size_t>(rank)];
  const auto& theirs = plan.chunks[static_cast<std::size_t>(source)];
  for (std::size_t c = 0; c < mine.size(); ++c) {
    const PositionRange queries = mine[c].queries;
    if (queries.empty()) continue;
    for (const ContextParallelChunk& range : theirs) {
      if (range.queries.empty()) continue;
      if (plan.masking == Masking::causal && range.queries.begin >= queries.end) continue;
      pairs.push_back({static_cast<Index>(c), range.queries, range.row});
    }
  }
  return pairs;
}

/// Packs a rank's K and V rows ([m, H_kv, d] and [m, H_kv, d_v]) into a ring buffer: K rows
/// then V rows, each row's heads in order.
template <typename Scalar>
void pack_ring_shard(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                     Scalar* buffer) {
  detail::copy_head_rows(k, 0, 0, interleaved_heads(buffer, k.tokens, k.heads, k.dim), 0, 0,
                         k.tokens, k.heads);
  detail::copy_head_rows(
      v, 0, 0, interleaved_heads(buffer + k.tokens * k.heads * k.dim, v.tokens, v.heads, v.dim), 0,
      0, v.tokens, v.heads);
}

/// The K and V views of the ring buffer of rank `source`'s shard (ring_shard_elements(me,
/// source) elements at `buffer`).
template <typename Scalar>
std::pair<HeadsView<const Scalar>, HeadsView<const Scalar>> ring_shard_views(
    const ContextParallelRank& me, Index source, const Scalar* buffer) {
  const ContextParallelShapes& s = me.shapes();
  const Index rows = me.plan().shard_rows(source);
  return {
      interleaved_heads(buffer, rows, s.kv_heads, s.head_dim),
      interleaved_heads(buffer + rows * s.kv_heads * s.head_dim, rows, s.kv_heads, s.value_dim)};
}

namespace detail {

/// Checks a ring call's arguments: a ring plan, the rank's queries (q [m, H_q, d]), and the
/// source's K and V rows.
template <typename Scalar>
void require_ring_inputs(const char* function, const ContextParallelRank& me,
                         const HeadsView<const Scalar>& q, Index source,
                         const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v) {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "the ring carries float or double rows");
  const ContextParallelShapes& s = me.shapes();
  require_index(function, "source", source, "ranks", me.ranks());
  require_view_shape(function, "q", q, me.rows(), s.query_heads, s.head_dim);
  const Index rows = me.plan().shard_rows(source);
  require_view_shape(function, "k", k, rows, s.kv_heads, s.head_dim);
  require_view_shape(function, "v", v, rows, s.kv_heads, s.value_dim);
}

}  // namespace detail

/// The forward of the ring on one rank: add() the held shard at every step (in any order the
/// caller keeps fixed; the schedule's is step order), then result(). Each pair's
/// multihead_attention_slice is merged into its chunk's rows per query head by LseMerger in
/// double. The rank object must outlive it.
template <typename Scalar>
class RingForward {
 public:
  explicit RingForward(const ContextParallelRank& me) : me_(me) {
    const Index heads = me.shapes().query_heads, dv = me.shapes().value_dim;
    for (const ContextParallelChunk& chunk : me.chunks())
      mergers_.emplace_back(static_cast<std::size_t>(heads),
                            LseMerger<double>(chunk.queries.size(), dv));
  }

  /// Merges the attention of this rank's queries q ([m, H_q, d], its rows) over the shard of
  /// rank `source` (k [rows, H_kv, d], v [rows, H_kv, d_v]).
  /// \throws std::invalid_argument naming a bad argument.
  void add(const HeadsView<const Scalar>& q, Index source, const HeadsView<const Scalar>& k,
           const HeadsView<const Scalar>& v) {
    detail::require_ring_inputs("RingForward::add", me_, q, source, k, v);
    const Index heads = me_.shapes().query_heads, dv = me_.shapes().value_dim;
    for (const RingPair& pair : ring_pairs(me_.plan(), me_.rank(), source)) {
      const ContextParallelChunk& chunk = me_.chunks()[static_cast<std::size_t>(pair.chunk)];
      const Index m = chunk.queries.size(), keys = pair.keys.size();
      RowMatrix<Scalar> out(m, heads * dv), lse(heads, m);
      multihead_attention_slice<Scalar>(detail::token_range(q, chunk.row, chunk.row + m),
                                        detail::token_range(k, pair.key_row, pair.key_row + keys),
                                        detail::token_range(v, pair.key_row, pair.key_row + keys),
                                        interleaved_heads(out.data(), m, heads, dv), lse,
                                        chunk.queries.begin, pair.keys.begin, me_.options());
      auto& mergers = mergers_[static_cast<std::size_t>(pair.chunk)];
      for (Index h = 0; h < heads; ++h) {
        const RowMatrix<double> head_out = out.middleCols(h * dv, dv).template cast<double>();
        const Eigen::VectorXd head_lse = lse.row(h).transpose().template cast<double>();
        mergers[static_cast<std::size_t>(h)].add(head_out, head_lse);
      }
    }
  }

  /// The merged rows: out [m, H_q, d_v] and lse (H_q x m) of this rank, rounded to Scalar.
  /// \throws std::invalid_argument naming a bad argument.
  void result(HeadsView<Scalar> out, HeadsLseRef<Scalar> lse) const {
    constexpr const char* function = "RingForward::result";
    const ContextParallelShapes& s = me_.shapes();
    detail::require_view_shape(function, "out", out, me_.rows(), s.query_heads, s.value_dim);
    detail::require(
        lse.rows() == s.query_heads && lse.cols() == me_.rows(), function, "lse",
        [&] { return std::to_string(lse.rows()) + "x" + std::to_string(lse.cols()); },
        "shape must be H_q x m");
    for (std::size_t c = 0; c < mergers_.size(); ++c) {
      const ContextParallelChunk& chunk = me_.chunks()[c];
      const Index m = chunk.queries.size();
      RowMatrix<double> merged(m, s.value_dim);
      for (Index h = 0; h < s.query_heads; ++h) {
        const LseMerger<double>& merger = mergers_[c][static_cast<std::size_t>(h)];
        merger.result(merged);
        out.head(h).middleRows(chunk.row, m) = merged.template cast<Scalar>();
        lse.row(h).segment(chunk.row, m) = merger.lse().transpose().template cast<Scalar>();
      }
    }
  }

 private:
  const ContextParallelRank& me_;
  std::vector<std::vector<LseMerger<double>>> mergers_;  // [chunk][query head]
};

/// The backward of the ring on one rank: add() the held shard at every step, send
/// partial(source) to each other rank, then result() with the partials received. With
/// `slope_gradients`, also dL/dslope of this rank's rows (slope_gradients()). The rank object
/// must outlive it.
template <typename Scalar>
class RingBackward {
 public:
  explicit RingBackward(const ContextParallelRank& me, bool slope_gradients = false)
      : me_(me),
        with_slopes_(slope_gradients),
        dq_(static_cast<std::size_t>(me.rows() * me.shapes().query_heads * me.shapes().head_dim),
            Scalar(0)),
        dslopes_(Eigen::VectorXd::Zero(me.shapes().query_heads)) {
    for (Index s = 0; s < me.ranks(); ++s)
      partials_.emplace_back(static_cast<std::size_t>(ring_shard_elements(me, s)), Scalar(0));
  }

  /// Adds the gradients of the pairs of this rank's rows (q, out, dout: [m, H_q, *], lse H_q x m,
  /// the merged forward) with the shard of rank `source` (k, v): dq into this rank's dq, dK and
  /// dV into partial(source) and, when asked for, dL/dslope into slope_gradients()
  /// (multihead_attention_slice_backward of each pair, in ring_pairs order).
  /// \throws std::invalid_argument naming a bad argument.
  void add(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& out,
           ConstHeadsLseRef<Scalar> lse, const HeadsView<const Scalar>& dout, Index source,
           const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v) {
    constexpr const char* function = "RingBackward::add";
    detail::require_ring_inputs(function, me_, q, source, k, v);
    const ContextParallelShapes& s = me_.shapes();
    detail::require_view_shape(function, "out", out, me_.rows(), s.query_heads, s.value_dim);
    detail::require_view_shape(function, "dout", dout, me_.rows(), s.query_heads, s.value_dim);
    detail::require_lse_shape(function, lse, q);
    const auto dq = interleaved_heads(dq_.data(), me_.rows(), s.query_heads, s.head_dim);
    Scalar* partial = partials_[static_cast<std::size_t>(source)].data();
    const Index rows = me_.plan().shard_rows(source);
    const auto dk = interleaved_heads(partial, rows, s.kv_heads, s.head_dim);
    const auto dv =
        interleaved_heads(partial + rows * s.kv_heads * s.head_dim, rows, s.kv_heads, s.value_dim);
    for (const RingPair& pair : ring_pairs(me_.plan(), me_.rank(), source)) {
      const ContextParallelChunk& chunk = me_.chunks()[static_cast<std::size_t>(pair.chunk)];
      const Index r0 = chunk.row, r1 = chunk.row + chunk.queries.size();
      const Index k0 = pair.key_row, k1 = pair.key_row + pair.keys.size();
      const auto q_rows = detail::token_range(q, r0, r1);
      const auto k_rows = detail::token_range(k, k0, k1), v_rows = detail::token_range(v, k0, k1);
      const auto out_rows = detail::token_range(out, r0, r1);
      const auto dout_rows = detail::token_range(dout, r0, r1);
      const auto lse_rows = lse.middleCols(r0, r1 - r0);
      const auto dq_rows = detail::token_range(dq, r0, r1);
      const auto dk_rows = detail::token_range(dk, k0, k1),
                 dv_rows = detail::token_range(dv, k0, k1);
      if (with_slopes_) {
        multihead_attention_slice_backward<Scalar>(
            q_rows, k_rows, v_rows, out_rows, lse_rows, dout_rows, dq_rows, dk_rows, dv_rows,
            dslopes_, chunk.queries.begin, pair.keys.begin, me_.options());
      } else {
        multihead_attention_slice_backward<Scalar>(
            q_rows, k_rows, v_rows, out_rows, lse_rows, dout_rows, dq_rows, dk_rows, dv_rows,
            chunk.queries.begin, pair.keys.begin, me_.options());
      }
    }
  }

  /// The dK, dV partial of rank `source`'s shard from this rank's queries, in the ring buffer
  /// layout (ring_shard_elements(me, source) elements): what this rank sends to `source`.
  const std::vector<Scalar>& partial(Index source) const {
    detail::require_index("RingBackward::partial", "source", source, "ranks", me_.ranks());
    return partials_[static_cast<std::size_t>(source)];
  }

  /// This rank's share of dL/dslope_h (H_q entries; zero unless built with slope_gradients): the
  /// sum over its query rows and the held shards in step order; the sum over the ranks is the
  /// sequence's.
  const Eigen::VectorXd& slope_gradients() const { return dslopes_; }

  /// This rank's gradients: dq, and dk, dv of its shard, the partials of its shard summed in
  /// increasing rank order from zero: its own partial(rank) and received[s], the partial that
  /// rank s sent (ring_shard_elements(me, rank) elements; the own entry is not read).
  /// \throws std::invalid_argument naming a bad argument.
  void result(const std::vector<MessageView<Scalar>>& received, HeadsView<Scalar> dq,
              HeadsView<Scalar> dk, HeadsView<Scalar> dv) const {
    constexpr const char* function = "RingBackward::result";
    const ContextParallelShapes& s = me_.shapes();
    const Index m = me_.rows(), expected = ring_shard_elements(me_, me_.rank());
    detail::require(
        static_cast<Index>(received.size()) == me_.ranks(), function, "received", received.size(),
        [&] { return "must hold one buffer per rank (" + std::to_string(me_.ranks()) + ")"; });
    for (Index r = 0; r < me_.ranks(); ++r)
      detail::require(r == me_.rank() || received[static_cast<std::size_t>(r)].size() == expected,
                      function, "received", received[static_cast<std::size_t>(r)].size(), [&] {
                        return "must hold " + std::to_string(expected) + " elements from rank " +
                               std::to_string(r);
                      });
    detail::require_view_shape(function, "dq", dq, m, s.query_heads, s.head_dim);
    detail::require_view_shape(function, "dk", dk, m, s.kv_heads, s.head_dim);
    detail::require_view_shape(function, "dv", dv, m, s.kv_heads, s.value_dim);
    detail::copy_head_rows(interleaved_heads(dq_.data(), m, s.query_heads, s.head_dim), 0, 0, dq, 0,
                           0, m, s.query_heads);
    Eigen::Matrix<Scalar, Eigen::Dynamic, 1> sum =
        Eigen::Matrix<Scalar, Eigen::Dynamic, 1>::Zero(expected);
    for (Index r = 0; r < me_.ranks(); ++r) {
      const Scalar* part = r == me_.rank() ? partials_[static_cast<std::size_t>(r)].data()
                                           : received[static_cast<std::size_t>(r)].data();
      sum += MessageView<Scalar>(part, expected);
    }
    const auto [sum_k, sum_v] = ring_shard_views(me_, me_.rank(), sum.data());
    detail::copy_head_rows(sum_k, 0, 0, dk, 0, 0, m, s.kv_heads);
    detail::copy_head_rows(sum_v, 0, 0, dv, 0, 0, m, s.kv_heads);
  }

 private:
  const ContextParallelRank& me_;
  bool with_slopes_;
  std::vector<Scalar> dq_;                     // [m, H_q, d]
  std::vector<std::vector<Scalar>> partials_;  // per source rank: its shard's dK then dV
  Eigen::VectorXd dslopes_;
};

}  // namespace poslsh
