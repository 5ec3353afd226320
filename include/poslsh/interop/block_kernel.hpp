// poslsh: bring-your-own block kernel. The per-sample LSH estimator computed by any plain
// attention kernel that returns the block outputs and their log-sum-exp, merged by LseMerger.
#pragma once

#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "poslsh/attention/per_sample.hpp"
#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/interop/lse_merge.hpp"
#include "poslsh/lsh/partition.hpp"

namespace poslsh {

/// The library's block kernel: plain softmax attention on one block (no positional bias;
/// causal inside the block when `causal`), out_i = sum_j e^{tau q_i.k_j} v_j / sum_j e^{tau
/// q_i.k_j}, and lse_i = log sum_j e^{tau q_i.k_j} (natural log of the scaled scores, as
/// FlashAttention's softmax_lse). Q in Scalar, K and V in KVScalar (half-precision products on
/// the unit `precision` selects, core/matrix_units.hpp); out, lse and tau in C =
/// compute_scalar_t<Scalar, KVScalar>. Any callable with this call signature can replace it in
/// lsh_attention_by_blocks.
template <typename Scalar, typename KVScalar = Scalar>
struct PlainBlockAttention {
  using C = compute_scalar_t<Scalar, KVScalar>;
  /// The products of half-precision inputs (AttentionOptions::precision); unset: the call's
  /// options.precision in lsh_attention_by_blocks, Precision::matrix_units when called directly.
  std::optional<Precision> precision{};
  void operator()(ConstMatrixRef<Scalar> q, ConstMatrixRef<KVScalar> k, ConstMatrixRef<KVScalar> v,
                  bool causal, C tau, MatrixRef<C> out,
                  Eigen::Ref<Eigen::Matrix<C, Eigen::Dynamic, 1>> lse) const {
    const Index n = q.rows();
    detail::SoftmaxPartials<C> state;
    detail::TileBuffers<C> buffers;
    state.resize(n, v.cols());
    state.clear(0, n);
    detail::fold_block<Scalar, KVScalar>(q, k, v, tau, causal, 0, n, state.engine_state(0), buffers,
                                         precision.value_or(Precision::matrix_units));
    for (Index r = 0; r < n; ++r) state.finish(r, out.row(r));
    lse = (state.max + state.sum.log()).matrix();
  }
};

namespace detail {

/// Enables the lsh_attention_by_blocks overloads whose KVScalar and OutScalar are view scalars
/// (so that a block kernel type in their place picks the form that names it second).
template <typename KVScalar, typename OutScalar>
using storage_scalars_t =
    std::enable_if_t<is_storage_scalar_v<KVScalar> && is_storage_scalar_v<OutScalar>>;

/// The block kernel a call runs: `kernel` itself, or for the library's PlainBlockAttention
/// without a precision, a copy with the call's options.precision.
template <typename BlockKernel>
BlockKernel& block_kernel_for(BlockKernel& kernel, const AttentionOptions&) {
  return kernel;
}
template <typename Scalar, typename KVScalar>
PlainBlockAttention<Scalar, KVScalar> block_kernel_for(
    PlainBlockAttention<Scalar, KVScalar>& kernel, const AttentionOptions& options) {
  PlainBlockAttention<Scalar, KVScalar> copy = kernel;
  if (!copy.precision) copy.precision = options.precision;
  return copy;
}

/// Calls each_sample(first, last) once per sample of `hashes`, in order, with the block edges
/// [first, last) of its hash on [0, n) (block_boundaries: blocks [first[r], first[r + 1])).
template <typename EachSample>
void for_each_sample_edges(const HashSet& hashes, Index n, EachSample&& each_sample) {
  for (const BinHash& hash : hashes) {
    const std::vector<Index> boundaries = block_boundaries(hash, n);
    each_sample(boundaries.data(), boundaries.data() + boundaries.size());
  }
}

/// The same for stored partitions (on their partitions.n positions): the stored edges.
template <typename EachSample>
void for_each_sample_edges(const PartitionSet& partitions, Index, EachSample&& each_sample) {
  for (Index sample = 0; sample < partitions.samples(); ++sample)
    each_sample(partitions.begin(sample), partitions.end(sample));
}

/// lsh_attention_by_blocks after the checks of its shapes and samples: options.query_offset
/// unset or 0 (self-attention at positions 0 .. n - 1), tau = options.scale or 1/sqrt(d).
/// Every block B of every sample (for_each_sample_edges: blocks [first[r], first[r + 1])
/// covering 0 .. n) goes to block_kernel(Q_B, K_B, V_B, causal, tau, O_B, lse_B) in order on
/// the calling thread, and the samples' outputs are merged by LseMerger into out (a
/// half-precision out: the merged result rounded once). Nothing is computed for n = 0.
template <typename Scalar, typename KVScalar, typename OutScalar, typename BlockKernel,
          typename Samples>
void merge_block_attentions(const char* function, ConstMatrixRef<Scalar> q,
                            ConstMatrixRef<KVScalar> k, ConstMatrixRef<KVScalar> v,
                            MatrixRef<OutScalar> out, const AttentionOptions& options,
                            BlockKernel& block_kernel, const Samples& samples) {
  using C = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  resolve_query_offset(function, options, q, k);  // self-attention: unset or 0
  const Index n = q.rows();
  if (n == 0) return;
  const auto tau = static_cast<C>(resolve_scale(function, options, q.cols()));
  const bool causal = options.masking == Masking::causal;
  LseMerger<C> merger(n, v.cols());
  RowMatrix<C> sample_output(n, v.cols());
  Eigen::Matrix<C, Eigen::Dynamic, 1> sample_lse(n);
  auto&& kernel = block_kernel_for(block_kernel, options);
  for_each_sample_edges(samples, n, [&](const Index* first, const Index* last) {
    for (; first + 1 < last; ++first) {
      const Index begin = first[0];
      const Index size = first[1] - begin;
      kernel(q.middleRows(begin, size), k.middleRows(begin, size), v.middleRows(begin, size),
             causal, tau, sample_output.middleRows(begin, size), sample_lse.segment(begin, size));
    }
    merger.add(sample_output, sample_lse);
  });
  if constexpr (std::is_same_v<OutScalar, C>) {
    merger.result(out);
  } else {
    merger.result(sample_output);
    out = sample_output.template cast<OutScalar>();
  }
}

}  // namespace detail

/// The per-sample LSH estimator T~ = D~^-1 (A o M~) V (same as lsh_attention_per_sample) with
/// the block attentions done by `block_kernel`: for each sample k (a hash h_k of a HashSet, or
/// partition k of stored partitions, PartitionSet: attention/partition.hpp), each block B of
/// sample k is passed as (Q_B, K_B, V_B, causal, tau, O_B, lse_B) and the per-sample output O_k
/// and lse_k are merged by LseMerger (O(n d_v) extra memory):
///   T~_i = sum_k e^{lse_ki - M_i} O_ki / sum_k e^{lse_ki - M_i},  M_i = max_k lse_ki,
/// i.e. T~_i = sum_j c_ij e^{tau q_i.k_j} v_j / sum_j c_ij e^{tau q_i.k_j}, c_ij the number of
/// samples with i and j in one block. Partitions = partition_set(hashes, n) give bitwise the
/// output of the hash set; the result does not depend on the thread count.
/// Q_B is a view of Q (Scalar), K_B and V_B views of K and V (KVScalar), unconverted, so a
/// kernel can read a half-precision cache as it is; tau, O_B, lse_B and the merge are in
/// C = compute_scalar_t<Scalar, KVScalar, OutScalar>, and a half-precision out is the merged
/// result rounded once. Blocks are processed one after the other on the calling thread, so the
/// callable need not be thread-safe. Self-attention only (options.query_offset unset or 0).
/// Throws std::invalid_argument naming a bad argument (for partitions also as
/// validate_partition_set, and 'partitions.n' unless it equals k.rows()); exceptions from the
/// callable propagate.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar,
          typename BlockKernel = PlainBlockAttention<Scalar, KVScalar>,
          typename = detail::storage_scalars_t<KVScalar, OutScalar>, typename Samples = HashSet,
          typename = detail::lsh_samples_t<Samples>>
void lsh_attention_by_blocks(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                             KeyValueRef<KVScalar> v, const Samples& samples,
                             OutputRef<OutScalar> out, const AttentionOptions& options = {},
                             BlockKernel&& block_kernel = BlockKernel{}) {
  constexpr const char* function = "lsh_attention_by_blocks";
  detail::require_lsh_arguments(function, q, k, v, samples, out);
  detail::merge_block_attentions<Scalar, KVScalar, OutScalar>(function, q, k, v, out, options,
                                                              block_kernel, samples);
}

/// lsh_attention_by_blocks<Scalar, Scalar, Scalar, BlockKernel>: the form that names the block
/// kernel type second, for views that all hold Scalar.
template <typename Scalar, typename BlockKernel,
          typename = std::enable_if_t<!is_storage_scalar_v<std::decay_t<BlockKernel>>>,
          typename Samples = HashSet, typename = detail::lsh_samples_t<Samples>>
void lsh_attention_by_blocks(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                             ConstMatrixRef<Scalar> v, const Samples& samples,
                             MatrixRef<Scalar> out, const AttentionOptions& options,
                             detail::nondeduced_t<BlockKernel>&& block_kernel) {
  lsh_attention_by_blocks<Scalar, Scalar, Scalar, BlockKernel>(
      q, k, v, samples, out, options, std::forward<BlockKernel>(block_kernel));
}

}  // namespace poslsh
