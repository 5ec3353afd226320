// poslsh internals: row i of the sample counts c_ij = #{k : bin_k(i) = bin_k(j)} over its union
// band [lo_i, hi_i), built from stored block edges by walking rows in increasing order.
#pragma once

#include <algorithm>
#include <vector>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/partitions.hpp"

namespace poslsh::detail {

/// Walks rows i = first, first + 1, ... of one partition table. After row(i): keys j with
/// c_ij > 0 are [lo, hi) (contiguous: every block holds i; causal: cut at j <= i) and
/// counts[j - lo] = c_ij. O(s log m) to start (m edges per sample), O(s + hi - lo) per row
/// after that.
class AnalysisRowBands {
 public:
  AnalysisRowBands(const PartitionSet& partitions, Index first_row)
      : partitions_(partitions), cursor_(static_cast<std::size_t>(partitions.samples())) {
    for (Index k = 0; k < partitions.samples(); ++k) {
      // The block holding first_row: the last edge <= first_row.
      const Index* edge = std::upper_bound(partitions.begin(k), partitions.end(k), first_row) - 1;
      cursor_[static_cast<std::size_t>(k)] = edge;
    }
  }

  /// Moves to row i (i at or after the previous row) and fills lo, hi and counts.
  void row(Index i, bool causal) {
    lo = partitions_.n;
    hi = 0;
    for (const Index*& edge : cursor_) {
      while (edge[1] <= i) ++edge;
      lo = std::min(lo, edge[0]);
      hi = std::max(hi, edge[1]);
    }
    const Index width = hi - lo;
    counts.assign(static_cast<std::size_t>(width) + 1, 0);
    for (const Index* edge : cursor_) {
      ++counts[static_cast<std::size_t>(edge[0] - lo)];
      --counts[static_cast<std::size_t>(edge[1] - lo)];
    }
    for (Index j = 1; j < width; ++j) {
      counts[static_cast<std::size_t>(j)] += counts[static_cast<std::size_t>(j - 1)];
    }
    if (causal) hi = std::min(hi, i + 1);
  }

  Index lo = 0;
  Index hi = 0;
  std::vector<Index> counts;

 private:
  const PartitionSet& partitions_;
  std::vector<const Index*> cursor_;
};

}  // namespace poslsh::detail
