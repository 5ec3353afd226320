// poslsh: the LSH attention estimators on stored partitions (PartitionSet, lsh/samplers.hpp): any
// blocks, including the unequal Poisson cuts of Sampler::poisson that no BinHash describes.
// Sample k's blocks are [edges[offsets[k] + r], edges[offsets[k] + r + 1]) on [0, n), and
//   c_ij = #{k : i and j share a block of sample k}  (causal: j <= i).
// For partition_set(hashes, n) the outputs are bitwise those of the hash-set kernels.
//
// Checked (std::invalid_argument naming the argument): the shapes of q, k, v and out, the
// partitions (validate_partition_set: 'partitions.n', 'partitions.offsets',
// 'partitions.edges'), partitions.n == k.rows() ('partitions.n'), options.scale finite,
// options.masking valid, options.query_offset.
#pragma once

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "poslsh/attention/fused.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/interop/block_kernel.hpp"
#include "poslsh/interop/lse_merge.hpp"
#include "poslsh/lsh/samplers.hpp"

namespace poslsh {

namespace detail {

/// Valid partitions (validate_partition_set) of the k.rows() key positions.
template <typename KType>
void require_key_partitions(const char* function, const PartitionSet& partitions, const KType& k) {
  validate_partition_set(partitions, function);
  require(partitions.n == k.rows(), function, "partitions.n", partitions.n,
          "must equal k.rows() (the partitions cut the key positions)");
}

/// Self-attention shapes (K, V have n rows), output n x d_v, valid partitions on the n
/// positions.
template <typename QType, typename KType, typename VType, typename OutType>
void require_partition_arguments(const char* function, const QType& q, const KType& k,
                                 const VType& v, const PartitionSet& partitions,
                                 const OutType& out) {
  require_qkv_shapes(function, q, k, v);
  require_self_attention(function, q, k);
  require_output_shape(function, out, q.rows(), v.cols());
  require_key_partitions(function, partitions, k);
}

/// Shapes (Q of m rows at positions p0 .. p0 + m - 1 over K, V of L rows), output m x d_v,
/// valid partitions on the L key positions; returns p0.
template <typename QType, typename KType, typename VType, typename OutType>
Index require_partition_arguments(const char* function, const QType& q, const KType& k,
                                  const VType& v, const PartitionSet& partitions,
                                  const OutType& out, const AttentionOptions& options) {
  require_qkv_shapes(function, q, k, v);
  const Index p0 = resolve_query_offset(function, options, q, k);
  require_output_shape(function, out, q.rows(), v.cols());
  require_key_partitions(function, partitions, k);
  return p0;
}

}  // namespace detail

/// Fused, count-weighted LSH ALiBi attention on stored partitions: the estimator of
/// lsh_attention_fused with the counts of the partitions,
///   out_i = sum_j c_ij e^{tau q_i.k_j - M_i} v_j / sum_j c_ij e^{tau q_i.k_j - M_i},
///   c_ij = #{k : i and j share a block of partition k}  (causal: j <= i),
/// i.e. softmax(S + log C) V, each pair of c_ij > 0 evaluated once. Each query tile finds its
/// blocks by binary search on every sample's edges (O(s log(n / sigma)) per tile). Same tiles,
/// arithmetic, threads, offsets (options.query_offset) and scalar types as lsh_attention_fused
/// with a HashSet: bitwise the same for any thread count, and bitwise lsh_attention_fused(q, k,
/// v, hashes) when partitions = partition_set(hashes, k.rows()). Throws std::invalid_argument
/// naming a bad argument (see the top of this header).
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void lsh_attention_fused(ConstMatrixRef<Scalar> q, ConstMatrixRef<detail::nondeduced_t<KVScalar>> k,
                         ConstMatrixRef<detail::nondeduced_t<KVScalar>> v,
                         const PartitionSet& partitions,
                         MatrixRef<detail::nondeduced_t<OutScalar>> out,
                         const AttentionOptions& options = {}) {
  constexpr const char* function = "lsh_attention_fused";
  const Index p0 = detail::require_partition_arguments(function, q, k, v, partitions, out, options);
  detail::fused_attention<Scalar, KVScalar, OutScalar>(function, q, k, v, partitions, out, options,
                                                       p0);
}

/// Returning form of lsh_attention_fused on partitions (the output in Q's scalar type).
template <typename Scalar, typename KVScalar = Scalar>
RowMatrix<Scalar> lsh_attention_fused(ConstMatrixRef<Scalar> q,
                                      ConstMatrixRef<detail::nondeduced_t<KVScalar>> k,
                                      ConstMatrixRef<detail::nondeduced_t<KVScalar>> v,
                                      const PartitionSet& partitions,
                                      const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  lsh_attention_fused<Scalar, KVScalar, Scalar>(q, k, v, partitions, out, options);
  return out;
}

/// Number of (query, key) pairs with c_ij > 0 (causal: j <= i) over the partitions.n
/// positions: sum_i |[lo_i, hi_i)|, the pairs lsh_attention_fused weights. Throws
/// std::invalid_argument naming a bad partition field.
inline long long lsh_fused_pair_count(const PartitionSet& partitions, Masking masking) {
  validate_partition_set(partitions, "lsh_fused_pair_count");
  return detail::fused_pair_count(partitions, partitions.n, masking);
}

/// The per-sample LSH estimator on stored partitions with a bring-your-own block kernel: as
/// lsh_attention_by_blocks with a hash set, T~ = D~^-1 (A o M~) V with M~ = (1/s) sum_k
/// M(partition k), i.e.
///   T~_i = sum_j c_ij e^{tau q_i.k_j} v_j / sum_j c_ij e^{tau q_i.k_j},
/// computed as plain attention on every block B of every partition (block_kernel(Q_B, K_B,
/// V_B, causal, tau, O_B, lse_B), blocks in order on the calling thread) and the per-sample
/// outputs merged by LseMerger. Bitwise lsh_attention_by_blocks(q, k, v, hashes, ...) when
/// partitions = partition_set(hashes, n), and independent of the thread count.
/// Self-attention only (options.query_offset unset or 0). Throws std::invalid_argument naming a
/// bad argument; exceptions from the callable propagate.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar,
          typename BlockKernel = PlainBlockAttention<Scalar, KVScalar>,
          typename = detail::storage_scalars_t<KVScalar, OutScalar>>
void lsh_attention_by_blocks(ConstMatrixRef<Scalar> q,
                             ConstMatrixRef<detail::nondeduced_t<KVScalar>> k,
                             ConstMatrixRef<detail::nondeduced_t<KVScalar>> v,
                             const PartitionSet& partitions,
                             MatrixRef<detail::nondeduced_t<OutScalar>> out,
                             const AttentionOptions& options = {},
                             BlockKernel&& block_kernel = BlockKernel{}) {
  constexpr const char* function = "lsh_attention_by_blocks";
  detail::require_partition_arguments(function, q, k, v, partitions, out);
  detail::merge_block_attentions<Scalar, KVScalar, OutScalar>(
      function, q, k, v, out, options, block_kernel, [&](auto&& each_sample) {
        for (Index sample = 0; sample < partitions.samples(); ++sample)
          each_sample(partitions.begin(sample), partitions.end(sample));
      });
}

}  // namespace poslsh
