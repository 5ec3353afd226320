/// \file
/// \brief One rank of a context-parallel call: the plan, the rank's place in it, the shapes of
/// its tensors and the attention options, with the halo messages it sends and receives.
///
/// A rank's tensors hold the rows of its shard ranges concatenated in the order of its shard:
/// q [m, H_q, d], k [m, H_kv, d], v [m, H_kv, d_v], out and dout [m, H_q, d_v], lse H_q x m.
/// A halo message from rank s to rank r holds, for each segment of halo_segments(plan, r, s,
/// pass) in order, the rows of the segment's K/V head g (message_layout):
///   forward   K (rows x d), then V (rows x d_v);
///   backward  K (rows x d), V (rows x d_v), then of the G = H_q / H_kv query heads of g:
///             Q (rows x G x d), out (rows x G x d_v), dout (rows x G x d_v), lse (G x rows).
#pragma once

#include <array>
#include <string>
#include <vector>

#include "poslsh/multihead/methods.hpp"
#include "poslsh/parallel/plan.hpp"

namespace poslsh {

/// The sizes of a context-parallel call's tensors: H_q query heads (q, out, dout), H_kv K/V heads
/// (k, v), the head dimension d of q and k and d_v of v and out.
struct ContextParallelShapes {
  Index query_heads = 1;
  Index kv_heads = 1;
  Index head_dim = 1;
  Index value_dim = 1;

  /// G = H_q / H_kv, the query heads of one K/V head.
  Index group() const { return query_heads / kv_heads; }
};

/// Elements of one row of one K/V head in a halo message: d + d_v forward (K, V); backward
/// d + d_v + G (d + 2 d_v + 1) (K, V and the Q, out, dout, lse of its G query heads).
inline Index halo_row_elements(const ContextParallelShapes& shapes, HaloPass pass) {
  const Index kv = shapes.head_dim + shapes.value_dim;
  if (pass == HaloPass::forward) return kv;
  return kv + shapes.group() * (shapes.head_dim + 2 * shapes.value_dim + 1);
}

/// Elements of a halo message of `segments`: their rows times halo_row_elements.
inline Index halo_message_elements(const std::vector<HaloSegment>& segments,
                                   const ContextParallelShapes& shapes, HaloPass pass) {
  Index rows = 0;
  for (const HaloSegment& segment : segments) rows += segment.positions.size();
  return rows * halo_row_elements(shapes, pass);
}

/// One rank of a context-parallel call. Built from the shards of every rank (together they
/// cover [0, n) once; shard_ranges or layout_shards for a layout), the rank, the shapes and the
/// options of the all-heads calls (method, masking, sigmas, samples, seed, band, local window,
/// scale, precision; query_offset unset): the plan (context_parallel_plan of the options' head
/// methods) and, for both halo passes, the segments of every message to and from this rank.
class ContextParallelRank {
 public:
  /// \throws std::invalid_argument naming a bad argument (shards, n, rank, a shape, an option).
  ContextParallelRank(const std::vector<std::vector<PositionRange>>& shards, Index n, Index rank,
                      const ContextParallelShapes& shapes, const MultiHeadOptions& options)
      : rank_(rank), shapes_(shapes), options_(options) {
    constexpr const char* function = "ContextParallelRank";
    detail::require(!options.query_offset, function, "options.query_offset",
                    options.query_offset.value_or(0),
                    "must be unset: positions are those of the shards");
    detail::require(shapes.query_heads >= 1, function, "shapes.query_heads", shapes.query_heads,
                    "must be >= 1");
    detail::require(
        shapes.kv_heads >= 1 && shapes.query_heads % shapes.kv_heads == 0, function,
        "shapes.kv_heads", shapes.kv_heads,
        [&] { return "must divide shapes.query_heads = " + std::to_string(shapes.query_heads); });
    detail::require(shapes.head_dim >= 1, function, "shapes.head_dim", shapes.head_dim,
                    "must be >= 1");
    detail::require(shapes.value_dim >= 0, function, "shapes.value_dim", shapes.value_dim,
                    "must be >= 0");
    detail::require_shards(function, n, static_cast<Index>(shards.size()));
    detail::require_index(function, "rank", rank, "ranks", shards.size());
    plan_ = context_parallel_plan(shards, n,
                                  detail::head_methods(function, shapes.query_heads, options),
                                  shapes.kv_heads, options.masking);
    for (const HaloPass pass : {HaloPass::forward, HaloPass::backward}) {
      auto& incoming = incoming_[static_cast<std::size_t>(pass)];
      auto& outgoing = outgoing_[static_cast<std::size_t>(pass)];
      incoming.resize(static_cast<std::size_t>(plan_.ranks));
      outgoing.resize(static_cast<std::size_t>(plan_.ranks));
      if (plan_.ring) continue;
      for (Index r = 0; r < plan_.ranks; ++r) {
        for_each_halo_segment(plan_, r, pass, [&](const HaloSegment& segment) {
          if (r == rank) incoming[static_cast<std::size_t>(segment.source)].push_back(segment);
          if (segment.source == rank && r != rank)
            outgoing[static_cast<std::size_t>(r)].push_back(segment);
        });
      }
    }
  }

  /// The rank of layout_shards(n, ranks, layout).
  ContextParallelRank(Index n, Index ranks, ShardLayout layout, Index rank,
                      const ContextParallelShapes& shapes, const MultiHeadOptions& options)
      : ContextParallelRank(layout_shards(n, ranks, layout), n, rank, shapes, options) {}

  const ContextParallelPlan& plan() const { return plan_; }
  Index rank() const { return rank_; }
  Index ranks() const { return plan_.ranks; }
  const ContextParallelShapes& shapes() const { return shapes_; }
  const MultiHeadOptions& options() const { return options_; }
  /// This rank's chunks (its shard ranges and what each reads).
  const std::vector<ContextParallelChunk>& chunks() const {
    return plan_.chunks[static_cast<std::size_t>(rank_)];
  }
  /// The rows of this rank's tensors.
  Index rows() const { return plan_.shard_rows(rank_); }

  /// The segments this rank receives from `source` in `pass` (source = rank: the rows it holds
  /// itself), halo_segments(plan, rank, source, pass); none for a ring plan.
  const std::vector<HaloSegment>& incoming(Index source, HaloPass pass) const {
    return incoming_[static_cast<std::size_t>(pass)][checked_rank(source, "source")];
  }
  /// The segments this rank sends to `destination` in `pass` (none to itself, none for a ring).
  const std::vector<HaloSegment>& outgoing(Index destination, HaloPass pass) const {
    return outgoing_[static_cast<std::size_t>(pass)][checked_rank(destination, "destination")];
  }
  /// Elements of the message this rank receives from `source` (0 from itself).
  Index received_elements(Index source, HaloPass pass) const {
    return source == rank_ ? 0 : halo_message_elements(incoming(source, pass), shapes_, pass);
  }
  /// Elements of the message this rank sends to `destination`.
  Index sent_elements(Index destination, HaloPass pass) const {
    return halo_message_elements(outgoing(destination, pass), shapes_, pass);
  }

 private:
  std::size_t checked_rank(Index peer, const char* name) const {
    detail::require_index("ContextParallelRank", name, peer, "ranks", plan_.ranks);
    return static_cast<std::size_t>(peer);
  }

  ContextParallelPlan plan_;
  Index rank_;
  ContextParallelShapes shapes_;
  MultiHeadOptions options_;
  // [pass][peer]: the segments of the message from (incoming) or to (outgoing) the peer.
  std::array<std::vector<std::vector<HaloSegment>>, 2> incoming_, outgoing_;
};

}  // namespace poslsh
