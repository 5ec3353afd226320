// poslsh: the exact max-norm error ||L* - M~||_max of a hash set, without n x n storage. Part
// of the analysis module (poslsh/analysis.hpp); needs only Eigen, so poslsh.hpp includes it too.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/band.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// The largest entry of |L* - M~| and one position (row, col) where it is attained
/// (-1, -1 when n = 0).
struct MaxError {
  double value = 0.0;
  Index row = -1;
  Index col = -1;
};

namespace detail {

/// Rows per task of the row-parallel scan.
inline constexpr Index analysis_rows_per_task = 16384;

/// Largest block (edge difference) over all samples.
inline Index analysis_largest_block(const PartitionSet& partitions) {
  Index largest = 0;
  for (Index k = 0; k < partitions.samples(); ++k) {
    for (const Index* edge = partitions.begin(k); edge + 1 != partitions.end(k); ++edge) {
      largest = std::max(largest, edge[1] - edge[0]);
    }
  }
  return largest;
}

/// kernel[d] = exp(-d / sigma) for d < size, each formed as alibi_kernel_dense forms it.
inline std::vector<double> analysis_kernel_table(std::size_t size, double sigma) {
  std::vector<double> kernel(size);
  for (std::size_t d = 0; d < kernel.size(); ++d) {
    kernel[d] = std::exp(-static_cast<double>(d) / sigma);
  }
  return kernel;
}

/// The largest of per-task results (the first of equal values: the scan order's first).
inline MaxError analysis_largest_error(const std::vector<MaxError>& results) {
  MaxError best = results.front();
  for (const MaxError& result : results) {
    if (result.value > best.value) best = result;
  }
  return best;
}

/// Rows [first, last) of the max-norm scan; `kernel[d]` = exp(-d / sigma), `mean[c]` = c / s.
inline MaxError analysis_max_error_rows(const PartitionSet& partitions, Index first, Index last,
                                        bool causal, const std::vector<double>& kernel,
                                        const std::vector<double>& mean) {
  MaxError best;
  const auto consider = [&best](double value, Index i, Index j) {
    if (best.row < 0 || value > best.value) best = MaxError{value, i, j};
  };
  AnalysisRowBands bands(partitions, first);
  for (Index i = first; i < last; ++i) {
    bands.row(i, causal);
    // Left of the band M~ = 0, so |L* - M~| = L*, largest at the nearest key j = lo - 1.
    if (bands.lo > 0) consider(kernel[static_cast<std::size_t>(i - bands.lo + 1)], i, bands.lo - 1);
    for (Index j = bands.lo; j < bands.hi; ++j) {
      const double estimate =
          mean[static_cast<std::size_t>(bands.counts[static_cast<std::size_t>(j - bands.lo)])];
      const double exact = kernel[static_cast<std::size_t>(i > j ? i - j : j - i)];
      consider(std::abs(estimate - exact), i, j);
    }
    // Right of the band: j = hi (bidirectional; causal keys j > i are 0 in both).
    if (!causal && bands.hi < partitions.n) {
      consider(kernel[static_cast<std::size_t>(bands.hi - i)], i, bands.hi);
    }
  }
  return best;
}

/// max_error of stored partitions: the same rows, entries and scan order, so the same value
/// and position bit for bit. Throws std::invalid_argument naming 'sigma' (as max_error).
inline MaxError analysis_max_error_partitions(const PartitionSet& partitions, double sigma,
                                              Masking masking) {
  require_sigma(sigma, "max_error");
  const Index n = partitions.n;
  if (n == 0) return MaxError{};
  const std::vector<double> kernel = analysis_kernel_table(
      static_cast<std::size_t>(analysis_largest_block(partitions)) + 1, sigma);
  const auto samples = static_cast<std::size_t>(partitions.samples());
  std::vector<double> mean(samples + 1);
  for (std::size_t c = 0; c <= samples; ++c) {
    mean[c] = static_cast<double>(c) / static_cast<double>(samples);  // as mean_mask_dense
  }
  const Index tasks = (n + analysis_rows_per_task - 1) / analysis_rows_per_task;
  std::vector<MaxError> results(static_cast<std::size_t>(tasks));
  const bool causal = masking == Masking::causal;
  parallel_loop(static_cast<long>(tasks), LoopSchedule::dynamic(), true, [&](long task) {
    const Index first = static_cast<Index>(task) * analysis_rows_per_task;
    const Index last = std::min(n, first + analysis_rows_per_task);
    results[static_cast<std::size_t>(task)] =
        analysis_max_error_rows(partitions, first, last, causal, kernel, mean);
  });
  return analysis_largest_error(results);
}

}  // namespace detail

/// Max-norm error ||L* - M~||_max = max_ij |L*_ij - c_ij / s| of the hash set, exactly, and one
/// position where it is attained; c_ij = #{k : bin_k(i) = bin_k(j)}, L*_ij = exp(-|i-j| / sigma)
/// (causal: j <= i only). Every entry is formed as alibi_kernel_dense and mean_mask_dense form
/// it, so the result equals the dense max bit for bit. Row i: inside its union band [lo_i, hi_i)
/// (the keys sharing a block with i in some sample) each c_ij / s is compared with L*_ij;
/// outside it c_ij = 0 and the largest |L*_ij| is at the band edge. `hashes`: a HashSet or any
/// container of BinHash. Throws std::invalid_argument naming a bad argument (empty or invalid
/// hashes, n < 0, sigma). O(n (s + band)) time, O(s n / sigma) memory, rows in parallel
/// (OpenMP).
template <typename Hashes = HashSet>
MaxError max_error(const Hashes& hashes, Index n, double sigma, Masking masking) {
  constexpr const char* function = "max_error";
  detail::require_sigma(sigma, function);
  const PartitionSet partitions = detail::analysis_partitions(hashes, n, function);
  return detail::analysis_max_error_partitions(partitions, sigma, masking);
}

}  // namespace poslsh
