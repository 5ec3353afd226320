// poslsh: the LSH attention estimators on stored partitions (PartitionSet, lsh/samplers.hpp): any
// blocks, including the unequal Poisson cuts of Sampler::poisson that no BinHash describes.
// Sample k's blocks are [edges[offsets[k] + r], edges[offsets[k] + r + 1]) on [0, n), and
//   c_ij = #{k : i and j share a block of sample k}  (causal: j <= i).
// lsh_attention_fused (attention/fused.hpp) and lsh_attention_by_blocks
// (interop/block_kernel.hpp) take a PartitionSet wherever they take a HashSet; this header
// brings in both kernels with PartitionSet, and adds the pair count of partitions. For
// partition_set(hashes, n) the outputs are bitwise those of the hash set.
//
// Checked (std::invalid_argument naming the argument): the shapes of q, k, v and out, the
// partitions (validate_partition_set: 'partitions.n', 'partitions.offsets',
// 'partitions.edges'), partitions.n == k.rows() ('partitions.n'), options.scale finite,
// options.masking valid, options.query_offset.
#pragma once

#include "poslsh/attention/fused.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/interop/block_kernel.hpp"
#include "poslsh/lsh/samplers.hpp"

namespace poslsh {

/// Number of (query, key) pairs with c_ij > 0 (causal: j <= i) over the partitions.n
/// positions: sum_i |[lo_i, hi_i)|, the pairs lsh_attention_fused weights. Throws
/// std::invalid_argument naming a bad partition field.
inline long long lsh_fused_pair_count(const PartitionSet& partitions, Masking masking) {
  validate_partition_set(partitions, "lsh_fused_pair_count");
  return detail::fused_pair_count(partitions, partitions.n, masking);
}

}  // namespace poslsh
