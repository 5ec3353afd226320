// poslsh: the exact ALiBi kernel L*_ij = exp(-|i-j| / sigma) as a dense matrix (for checks).
#pragma once

#include <cmath>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// Dense n x n ALiBi kernel L*_ij = exp(-|i-j| / sigma); the causal form also sets
/// L*_ij = 0 for j > i (a masking value other than the two enumerators is taken as
/// bidirectional). Throws std::invalid_argument if n < 0 or sigma is not finite and > 0
/// (std::bad_alloc if the n x n entries do not fit). O(n^2) memory: for checks and small
/// analyses.
template <typename Scalar>
RowMatrix<Scalar> alibi_kernel_dense(Index n, double sigma, Masking masking) {
  detail::require_size(n, "alibi_kernel_dense", "n");
  detail::require_sigma(sigma, "alibi_kernel_dense");
  RowMatrix<Scalar> kernel(n, n);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < n; ++j) {
      const bool visible = masking == Masking::bidirectional || j <= i;
      const double distance = static_cast<double>(i > j ? i - j : j - i);
      kernel(i, j) = visible ? static_cast<Scalar>(std::exp(-distance / sigma)) : Scalar(0);
    }
  }
  return kernel;
}

}  // namespace poslsh
