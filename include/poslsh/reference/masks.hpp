// poslsh: dense bin masks M(h) and their mean M~ (for analysis and tests at small n).
#pragma once

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/lsh/partition.hpp"

namespace poslsh {

/// Dense 0/1 mask M(h)_ij = [bin(i) = bin(j)] (causal: also j <= i). Throws
/// std::invalid_argument if n < 0 or the hash is invalid (std::bad_alloc if the n x n entries
/// do not fit). O(n^2) memory.
template <typename Scalar>
RowMatrix<Scalar> bin_mask_dense(const BinHash& hash, Index n, Masking masking) {
  const std::vector<Index> boundaries = block_boundaries(hash, n);
  RowMatrix<Scalar> mask = RowMatrix<Scalar>::Zero(n, n);
  for (std::size_t r = 0; r + 1 < boundaries.size(); ++r) {
    const Index begin = boundaries[r];
    const Index size = boundaries[r + 1] - begin;
    mask.block(begin, begin, size, size).setOnes();
  }
  if (masking == Masking::causal) mask.template triangularView<Eigen::StrictlyUpper>().setZero();
  return mask;
}

/// Dense mean mask M~ = (1/s) sum_k M(h_k) (causal: times the lower triangle); its
/// expectation is the ALiBi kernel L*. Throws std::invalid_argument if the set is empty,
/// n < 0 or a hash is invalid. O(n^2) memory.
template <typename Scalar>
RowMatrix<Scalar> mean_mask_dense(const HashSet& hashes, Index n, Masking masking) {
  detail::require_positive(static_cast<Index>(hashes.size()), "mean_mask_dense", "hashes.size()");
  detail::require_size(n, "mean_mask_dense", "n");
  RowMatrix<Scalar> mean = RowMatrix<Scalar>::Zero(n, n);
  for (const BinHash& hash : hashes) mean += bin_mask_dense<Scalar>(hash, n, masking);
  mean /= static_cast<Scalar>(hashes.size());
  return mean;
}

}  // namespace poslsh
