/// \file
/// \brief Context parallelism: one sequence sharded over R ranks, everything but the transport.
///
/// Each rank holds the rows of its shard (plan.hpp: shard_ranges, context_parallel_plan) and
/// gets its rows of the single-process multihead_attention on the whole sequence, and of its
/// backward:
///  - halo methods (lsh_fused, lsh_per_sample, fixed_blocks, exact_banded, and exact_tiled with
///    a local window): the rank receives the K/V rows of the keys its queries reach (the plan's
///    keys[g]) from their owners and computes its rows, BITWISE the single-process rows; the
///    backward receives the rows of the plan's window[g] and runs the window backward, bitwise
///    the single-process gradients, nothing sent back (halo.hpp, messages of rank.hpp);
///  - exact ALiBi over every key (exact_tiled without a local window): K and V go around a
///    ring, each slice's attention merged by log-sum-exp; the backward passes K and V around
///    again with the merged lse and returns the dK/dV partials to their owners (ring.hpp);
///    equal to the single-process call to rounding.
/// ContextParallelRank (rank.hpp) is one rank's view of a call; a transport moves the buffers
/// the calls pack and reads. The bytes and messages per rank: traffic.hpp. The kernels on
/// slices and windows of a sequence: slice.hpp.
///
/// One rank's forward and backward with any transport (`send`, `receive` of float buffers):
/// \code
///   poslsh::ContextParallelRank me(n, R, poslsh::ShardLayout::zigzag, rank, shapes, options);
///   poslsh::RankTensors<float> t{q, k, v};                       // this rank's rows
///   std::vector<std::vector<float>> in(R);
///   for (Index p = 0; p < R; ++p) if (p != rank) {
///     std::vector<float> out(me.sent_elements(p, poslsh::HaloPass::forward));
///     poslsh::pack_halo_message(me, p, poslsh::HaloPass::forward, t, out.data());
///     send(p, out);
///     in[p] = receive(p, me.received_elements(p, poslsh::HaloPass::forward));
///   }
///   std::vector<poslsh::MessageView<float>> views;
///   for (auto& m : in) views.emplace_back(m.data(), static_cast<Index>(m.size()));
///   poslsh::halo_forward(me, t, views, out_view, lse);
/// \endcode
#pragma once

#include "poslsh/parallel/halo.hpp"
#include "poslsh/parallel/plan.hpp"
#include "poslsh/parallel/rank.hpp"
#include "poslsh/parallel/ring.hpp"
#include "poslsh/parallel/slice.hpp"
#include "poslsh/parallel/traffic.hpp"
