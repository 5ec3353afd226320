// poslsh: bring-your-own block kernel. The per-sample LSH estimator computed by any plain
// attention kernel that returns the block outputs and their log-sum-exp, merged by LseMerger.
#pragma once

#include <vector>

#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/detail/streaming_softmax.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/lse_merge.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/per_sample_attention.hpp"
#include "poslsh/types.hpp"

namespace poslsh {

/// The library's block kernel: plain softmax attention on one block (no positional bias;
/// causal inside the block when `causal`), out_i = sum_j e^{tau q_i.k_j} v_j / sum_j e^{tau
/// q_i.k_j}, and lse_i = log sum_j e^{tau q_i.k_j} (natural log of the scaled scores, as
/// FlashAttention's softmax_lse). Any callable with this call signature can replace it in
/// lsh_attention_by_blocks.
template <typename Scalar>
struct PlainBlockAttention {
  void operator()(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k, ConstMatrixRef<Scalar> v,
                  bool causal, Scalar tau, MatrixRef<Scalar> out,
                  Eigen::Ref<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>> lse) const {
    detail::StreamingSoftmax<Scalar> state;
    detail::LogitScratch<Scalar> scratch;
    state.reset(q.rows(), v.cols());
    detail::fold_block<Scalar>(q, k, v, tau, causal, 0, q.rows(), state, scratch);
    state.finish(0, out);
    lse = (state.running_max + state.running_sum.log()).matrix();
  }
};

/// The per-sample LSH estimator T~ = D~^-1 (A o M~) V (same as lsh_attention_per_sample) with
/// the block attentions done by `block_kernel`: for each hash h_k, each block B of h_k is passed
/// as (Q_B, K_B, V_B, causal, tau, O_B, lse_B) and the per-sample output O_k and lse_k are
/// merged by LseMerger (O(n d_v) extra memory). Blocks are processed one after the other on the
/// calling thread, so the callable need not be thread-safe. Throws std::invalid_argument naming
/// a bad argument; exceptions from the callable propagate.
template <typename Scalar, typename BlockKernel = PlainBlockAttention<Scalar>>
void lsh_attention_by_blocks(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                             ConstMatrixRef<Scalar> v, const HashSet& hashes, MatrixRef<Scalar> out,
                             const AttentionOptions& options = {},
                             BlockKernel&& block_kernel = BlockKernel{}) {
  constexpr const char* function = "lsh_attention_by_blocks";
  detail::require_lsh_arguments(function, q, k, v, hashes, out);
  detail::resolve_query_offset(function, options, q, k);  // self-attention: unset or 0
  const Index n = q.rows();
  if (n == 0) return;
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, options, q.cols()));
  const bool causal = options.masking == Masking::causal;
  LseMerger<Scalar> merger(n, v.cols());
  RowMatrix<Scalar> sample_output(n, v.cols());
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> sample_lse(n);
  for (const BinHash& hash : hashes) {
    const std::vector<Index> boundaries = block_boundaries(hash, n);
    for (std::size_t r = 0; r + 1 < boundaries.size(); ++r) {
      const Index begin = boundaries[r];
      const Index size = boundaries[r + 1] - begin;
      block_kernel(q.middleRows(begin, size), k.middleRows(begin, size), v.middleRows(begin, size),
                   causal, tau, sample_output.middleRows(begin, size),
                   sample_lse.segment(begin, size));
    }
    merger.add(sample_output, sample_lse);
  }
  merger.result(out);
}

}  // namespace poslsh
