/// \file
/// \brief The bytes and messages of context parallelism per rank, from the plan: what the halo
/// exchange (halo_traffic) and the K/V ring (ring_traffic) move between ranks, message for
/// message as poslsh/parallel/halo.hpp and ring.hpp lay them out. Rows a rank holds itself are
/// never counted; a message without rows is never sent.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "poslsh/parallel/plan.hpp"
#include "poslsh/parallel/rank.hpp"

namespace poslsh {

/// Per-rank traffic of one context-parallel call (vectors of R entries, rank order).
struct ContextParallelTraffic {
  /// Payload bytes received and sent, forward and backward.
  std::vector<Index> forward_received, forward_sent, backward_received, backward_sent;
  /// Point-to-point messages, sent plus received, forward and backward.
  std::vector<Index> forward_messages, backward_messages;
  /// Halo only: the peers a rank receives from (in) and sends to (out), per pass.
  std::vector<Index> forward_peers_in, forward_peers_out, backward_peers_in, backward_peers_out;
  /// Halo only: [rank][K/V head] rows received (summed over the rank's chunks), per pass.
  std::vector<std::vector<Index>> forward_rows, backward_rows;
};

namespace detail {

/// The shapes of a traffic call: the plan's heads, d >= 1, d_v >= 0, itemsize >= 1, and a mask
/// of K/V heads (empty: every head) of the plan's size.
inline void require_traffic(const char* function, const ContextParallelPlan& plan,
                            const ContextParallelShapes& shapes, Index itemsize,
                            const std::vector<bool>& kv_heads_used) {
  require(
      shapes.query_heads == plan.query_heads && shapes.kv_heads == plan.kv_heads, function,
      "shapes",
      [&] {
        return std::to_string(shapes.query_heads) + " query / " + std::to_string(shapes.kv_heads) +
               " K/V heads";
      },
      [&] {
        return "must be the plan's " + std::to_string(plan.query_heads) + " / " +
               std::to_string(plan.kv_heads);
      });
  require(shapes.head_dim >= 1, function, "shapes.head_dim", shapes.head_dim, "must be >= 1");
  require(shapes.value_dim >= 0, function, "shapes.value_dim", shapes.value_dim, "must be >= 0");
  require(itemsize >= 1, function, "itemsize", itemsize, "must be >= 1");
  require(kv_heads_used.empty() || static_cast<Index>(kv_heads_used.size()) == plan.kv_heads,
          function, "kv_heads_used", kv_heads_used.size(), [&] {
            return "must be empty or hold one entry per K/V head (" +
                   std::to_string(plan.kv_heads) + ")";
          });
}

}  // namespace detail

/// The traffic of the halo exchange of `plan` (ContextParallelRank's messages): for each pass
/// and rank r, the rows of halo_rows(chunk, g, pass) of each of its chunks and K/V heads g that
/// other ranks hold, halo_row_elements(shapes, pass) * itemsize bytes each, received by r and
/// sent by their owners; a message per (sender, receiver) pair with rows. With kv_heads_used
/// (one flag per K/V head), only the flagged heads travel (a hybrid's halo part).
/// \throws std::invalid_argument naming a bad argument.
inline ContextParallelTraffic halo_traffic(const ContextParallelPlan& plan,
                                           const ContextParallelShapes& shapes, Index itemsize,
                                           const std::vector<bool>& kv_heads_used = {}) {
  detail::require_traffic("halo_traffic", plan, shapes, itemsize, kv_heads_used);
  const auto R = static_cast<std::size_t>(plan.ranks);
  ContextParallelTraffic t;
  for (auto* v : {&t.forward_received, &t.forward_sent, &t.backward_received, &t.backward_sent,
                  &t.forward_messages, &t.backward_messages, &t.forward_peers_in,
                  &t.forward_peers_out, &t.backward_peers_in, &t.backward_peers_out})
    v->assign(R, 0);
  for (auto* rows : {&t.forward_rows, &t.backward_rows})
    rows->assign(R, std::vector<Index>(static_cast<std::size_t>(plan.kv_heads), 0));
  for (const HaloPass pass : {HaloPass::forward, HaloPass::backward}) {
    const bool forward = pass == HaloPass::forward;
    auto& received = forward ? t.forward_received : t.backward_received;
    auto& sent = forward ? t.forward_sent : t.backward_sent;
    auto& messages = forward ? t.forward_messages : t.backward_messages;
    auto& peers_in = forward ? t.forward_peers_in : t.backward_peers_in;
    auto& peers_out = forward ? t.forward_peers_out : t.backward_peers_out;
    auto& rows = forward ? t.forward_rows : t.backward_rows;
    const Index row_bytes = halo_row_elements(shapes, pass) * itemsize;
    std::vector<Index> sources;
    for (Index r = 0; r < plan.ranks; ++r) {
      sources.clear();
      for_each_halo_segment(plan, r, pass, [&](const HaloSegment& segment) {
        if (segment.source == r) return;
        if (!kv_heads_used.empty() && !kv_heads_used[static_cast<std::size_t>(segment.kv_head)])
          return;
        const Index count = segment.positions.size();
        received[static_cast<std::size_t>(r)] += count * row_bytes;
        sent[static_cast<std::size_t>(segment.source)] += count * row_bytes;
        rows[static_cast<std::size_t>(r)][static_cast<std::size_t>(segment.kv_head)] += count;
        sources.push_back(segment.source);
      });
      std::sort(sources.begin(), sources.end());
      sources.erase(std::unique(sources.begin(), sources.end()), sources.end());
      peers_in[static_cast<std::size_t>(r)] = static_cast<Index>(sources.size());
      for (const Index s : sources) ++peers_out[static_cast<std::size_t>(s)];
    }
    for (std::size_t r = 0; r < R; ++r) messages[r] = peers_in[r] + peers_out[r];
  }
  return t;
}

/// The traffic of the K/V ring over the shards of `plan` (ring.hpp's schedule), for any plan:
/// forward, at each step t < R - 1 rank r sends the shard it holds (rank r - t's) and receives
/// rank r - t - 1's; backward, the same ring, then each rank sends every other rank the dK/dV
/// partial of that rank's shard and receives those of its own. A shard row is (flagged K/V
/// heads) (d + d_v) itemsize bytes; empty shards are not sent.
/// \throws std::invalid_argument naming a bad argument.
inline ContextParallelTraffic ring_traffic(const ContextParallelPlan& plan,
                                           const ContextParallelShapes& shapes, Index itemsize,
                                           const std::vector<bool>& kv_heads_used = {}) {
  detail::require_traffic("ring_traffic", plan, shapes, itemsize, kv_heads_used);
  const Index R = plan.ranks;
  const Index heads =
      kv_heads_used.empty()
          ? plan.kv_heads
          : static_cast<Index>(std::count(kv_heads_used.begin(), kv_heads_used.end(), true));
  const Index row_bytes = heads * (shapes.head_dim + shapes.value_dim) * itemsize;
  ContextParallelTraffic t;
  for (auto* v : {&t.forward_received, &t.forward_sent, &t.backward_received, &t.backward_sent,
                  &t.forward_messages, &t.backward_messages})
    v->assign(static_cast<std::size_t>(R), 0);
  const auto mod = [R](Index x) { return ((x % R) + R) % R; };
  const auto bytes = [&](Index rank) { return plan.shard_rows(rank) * row_bytes; };
  for (Index r = 0; r < R; ++r) {
    const auto at = static_cast<std::size_t>(r);
    for (Index step = 0; step + 1 < R; ++step) {
      const Index held = bytes(mod(r - step)), arriving = bytes(mod(r - step - 1));
      t.forward_sent[at] += held;
      t.forward_received[at] += arriving;
      t.forward_messages[at] += (held > 0 ? 1 : 0) + (arriving > 0 ? 1 : 0);
    }
    t.backward_sent[at] = t.forward_sent[at];
    t.backward_received[at] = t.forward_received[at];
    t.backward_messages[at] = t.forward_messages[at];
    for (Index p = 0; p < R; ++p) {
      if (p == r) continue;
      t.backward_sent[at] += bytes(p);
      t.backward_received[at] += bytes(r);
      t.backward_messages[at] += (bytes(p) > 0 ? 1 : 0) + (bytes(r) > 0 ? 1 : 0);
    }
  }
  return t;
}

}  // namespace poslsh
