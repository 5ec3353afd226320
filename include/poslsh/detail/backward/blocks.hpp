// poslsh internals: the per-sample block structure for the backward passes and the mean-of-
// outputs estimator: plain attention (no positional bias; causal inside a block when causal) on
// the blocks of one hash, forward with its log-sum-exp, and its gradients block by block.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <vector>

#include "poslsh/detail/backward/tiles.hpp"
#include "poslsh/detail/streaming_softmax.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/lsh/partition.hpp"
#include "poslsh/attention/per_sample.hpp"
#include "poslsh/core/types.hpp"

namespace poslsh::detail {

/// The rule of plain attention on block [begin, end): every key of the block (causal: j <= i),
/// weight 1, no bias.
template <typename Scalar>
WindowRule<Scalar> block_rule(Index begin, Index end, bool causal) {
  const Index width = end - begin;
  return WindowRule<Scalar>(begin, end, causal ? 0 : -width, width, Scalar(0));
}

/// Adds the gradients of plain attention on every block of `hash` to `out`, with the
/// probabilities P_ij = e^{x_ij - lse_i} of in.lse (the caller's normalization: the combined
/// lse of all samples for the count-weighted estimator, the sample's own for the mean of
/// outputs). Blocks run in parallel (OpenMP) on disjoint rows and keys; each block's pass runs
/// on one thread in a fixed order.
template <typename Scalar>
void backward_hash_blocks(const BackwardInputs<Scalar>& in, const BinHash& hash, bool causal,
                          BackwardOutputs<Scalar>& out) {
  const std::vector<Index> boundaries = block_boundaries(hash, in.q.rows());
  const auto blocks = static_cast<long>(boundaries.size() - 1);
#pragma omp parallel
  {
    const FlushSubnormals flush;
    BackwardWork<Scalar> work;
#pragma omp for schedule(dynamic, 1)
    for (long b = 0; b < blocks; ++b) {
      const auto index = static_cast<std::size_t>(b);
      backward_serial(in, block_rule<Scalar>(boundaries[index], boundaries[index + 1], causal), out,
                      work);
    }
  }
}

/// lse_i = M_i + log l_i of a streaming softmax state (-inf for a row without keys).
template <typename Scalar>
void state_lse(const StreamingSoftmax<Scalar>& state, Scalar* lse, Index rows) {
  for (Index i = 0; i < rows; ++i) lse[i] = state.running_max(i) + std::log(state.running_sum(i));
}

/// Plain attention on the blocks of `hashes` folded into one streaming softmax (the per-sample
/// kernel's loop): out and, if not null, lse.
template <typename Scalar>
void per_sample_forward(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
                        const ConstMatrixRef<Scalar>& v, const HashSet& hashes, Scalar tau,
                        bool causal, MatrixRef<Scalar> out, Scalar* lse) {
  const Index n = q.rows();
  StreamingSoftmax<Scalar> state;
  state.reset(n, v.cols());
  for (const BinHash& hash : hashes) {
    const std::vector<Index> boundaries = block_boundaries(hash, n);
    const auto blocks = static_cast<long>(boundaries.size() - 1);
#pragma omp parallel
    {
      LogitScratch<Scalar> scratch;
#pragma omp for schedule(dynamic, 1)
      for (long r = 0; r < blocks; ++r) {
        const auto index = static_cast<std::size_t>(r);
        fold_block<Scalar>(q, k, v, tau, causal, boundaries[index], boundaries[index + 1], state,
                           scratch);
      }
    }
  }
  state.finish(0, out);
  if (lse != nullptr) state_lse(state, lse, n);
}

}  // namespace poslsh::detail
