// poslsh: block-size statistics of a hash set (block_stats, largest_block), against the
// sigma ln ln n scale of Theorem 2.1 (block_size_scale). Part of the analysis module
// (poslsh/analysis.hpp); needs only Eigen, so poslsh.hpp includes it too.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/lsh/partition.hpp"

namespace poslsh {

/// Sizes of the blocks the s hashes cut [0, n) into (blocks cut by the sequence ends count with
/// their cut size).
struct BlockStats {
  /// b_max: the largest block over all samples.
  Index largest = 0;
  /// Total number of blocks over all samples.
  Index blocks = 0;
  /// Mean block size, s n / blocks.
  double mean = 0.0;
  /// Mean size of the block that holds a position, sum_k sum_B |B|^2 / (s n): the keys each
  /// query meets per sample in the per-sample kernel. With n >> w every block of a sample has
  /// its width w, so this is about E[w] = 2 sigma, and a query costs about 2 sigma s key
  /// evaluations over the s samples.
  double mean_at_position = 0.0;
};

/// Block statistics of `hashes` (a HashSet or any container of BinHash) on [0, n).
/// Throws std::invalid_argument if the set is empty, a hash is invalid or n < 0.
/// O(sum_k (n / w_k + 1)) time.
template <typename Hashes = HashSet>
BlockStats block_stats(const Hashes& hash_set, Index n) {
  const HashSet& hashes = detail::analysis_hash_set(hash_set);
  validate_hashes(hashes, "block_stats");
  detail::require_size(n, "block_stats", "n");
  BlockStats stats;
  double square_sum = 0.0;
  for (const BinHash& hash : hashes) {
    const std::vector<Index> boundaries = block_boundaries(hash, n);  // validates the hash
    for (std::size_t r = 0; r + 1 < boundaries.size(); ++r) {
      const Index size = boundaries[r + 1] - boundaries[r];
      stats.largest = std::max(stats.largest, size);
      square_sum += static_cast<double>(size) * static_cast<double>(size);
    }
    stats.blocks += static_cast<Index>(boundaries.size()) - 1;
  }
  const double positions = static_cast<double>(hashes.size()) * static_cast<double>(n);
  if (n > 0) {
    stats.mean = positions / static_cast<double>(stats.blocks);
    stats.mean_at_position = square_sum / positions;
  }
  return stats;
}

/// Largest block b_max over all samples (block_stats(hashes, n).largest; throws as it does).
template <typename Hashes = HashSet>
Index largest_block(const Hashes& hashes, Index n) {
  return block_stats(hashes, n).largest;
}

/// The scale sigma ln ln n that Theorem 2.1 gives for the largest block over s = O(log n)
/// samples: each sample's blocks all have its width w ~ Gamma(2, sigma), and the largest of
/// s such widths is about sigma (ln s + ln ln s). Throws std::invalid_argument if n < 3 (where
/// ln ln n <= 0) or sigma is not finite and > 0.
inline double block_size_scale(double sigma, Index n) {
  detail::require_sigma(sigma, "block_size_scale");
  detail::require(n >= 3, "block_size_scale", "n", n, "must be >= 3 (ln ln n > 0)");
  return sigma * std::log(std::log(static_cast<double>(n)));
}

}  // namespace poslsh
