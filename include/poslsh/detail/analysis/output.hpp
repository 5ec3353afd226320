// poslsh internals: pieces of the output-error metrics (percentiles, the unnormalized error
// (A o L*) V - (A o M~) V row by row).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/band.hpp"
#include "poslsh/detail/analysis/partitions.hpp"

namespace poslsh::detail {

/// Percentile p in [0, 1] of sorted values, linear between order statistics (position
/// p (m - 1), as numpy's default). Requires a non-empty vector.
inline double analysis_percentile(const std::vector<double>& sorted, double p) {
  const double position = p * static_cast<double>(sorted.size() - 1);
  const auto below = static_cast<std::size_t>(std::floor(position));
  const std::size_t above = std::min(below + 1, sorted.size() - 1);
  const double fraction = position - static_cast<double>(below);
  return sorted[below] + fraction * (sorted[above] - sorted[below]);
}

/// Squared Frobenius norm and max |entry| of a block of rows of the unnormalized error.
struct AnalysisErrorSums {
  double square_sum = 0.0;
  double max = 0.0;
};

/// Rows [first, last) of D = (A o L*) V - (A o M~) V = (A o E) V, E = L* - M~, accumulated in
/// Real: d_i = sum_j exp(tau q_i . k_j) (L*_ij - c_ij / s) v_j over the visible keys.
/// `kernel[d]` = exp(-d / sigma) for d < n. O((last - first) n (d + d_v)) time.
template <typename Real>
AnalysisErrorSums analysis_unnormalized_rows(const RowMatrix<Real>& q, const RowMatrix<Real>& k,
                                             const RowMatrix<Real>& v, Real tau, bool causal,
                                             const PartitionSet& partitions,
                                             const std::vector<Real>& kernel, Index first,
                                             Index last) {
  const Index n = q.rows();
  const Real inverse_s = Real(1) / static_cast<Real>(partitions.samples());
  AnalysisErrorSums sums;
  AnalysisRowBands bands(partitions, first);
  Eigen::Matrix<Real, Eigen::Dynamic, 1> weights(n);
  Eigen::Matrix<Real, 1, Eigen::Dynamic> difference(v.cols());
  for (Index i = first; i < last; ++i) {
    const Index keys = causal ? i + 1 : n;
    bands.row(i, causal);
    weights.head(keys).noalias() = k.topRows(keys) * q.row(i).transpose();
    for (Index j = 0; j < keys; ++j) {
      const Real estimate =
          j >= bands.lo && j < bands.hi
              ? static_cast<Real>(bands.counts[static_cast<std::size_t>(j - bands.lo)]) * inverse_s
              : Real(0);
      const Real exact = kernel[static_cast<std::size_t>(i > j ? i - j : j - i)];
      weights[j] = std::exp(tau * weights[j]) * (exact - estimate);
    }
    difference.noalias() = weights.head(keys).transpose() * v.topRows(keys);
    sums.square_sum += static_cast<double>(difference.squaredNorm());
    if (difference.size() > 0) {
      sums.max = std::max(sums.max, static_cast<double>(difference.cwiseAbs().maxCoeff()));
    }
  }
  return sums;
}

}  // namespace poslsh::detail
