// poslsh internals: the block edges of every sample of a hash set, stored once for the analysis
// operators (each product walks them instead of recomputing bins).
#pragma once

#include <cstddef>
#include <iterator>
#include <type_traits>
#include <vector>

#include "poslsh/detail/checks/require.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/types.hpp"

namespace poslsh::detail {

/// Sample k's blocks on [0, n) are [edges[offsets[k] + r], edges[offsets[k] + r + 1]), the
/// edges being block_boundaries(h_k, n). Memory sum_k (n / w_k + 2) indices, about n s / sigma.
struct AnalysisPartitions {
  Index n = 0;
  std::vector<Index> edges;
  std::vector<std::size_t> offsets{0};

  Index samples() const { return static_cast<Index>(offsets.size()) - 1; }
  const Index* begin(Index k) const { return edges.data() + offsets[static_cast<std::size_t>(k)]; }
  const Index* end(Index k) const {
    return edges.data() + offsets[static_cast<std::size_t>(k) + 1];
  }
};

/// The analysis functions take a hash set as any container of BinHash with begin() and end()
/// (HashSet = std::vector<BinHash>, std::array<BinHash, s>, ...). This gives it as a HashSet:
/// the object itself when it is one, else a copy of its s hashes.
template <typename Hashes>
decltype(auto) analysis_hash_set(const Hashes& hashes) {
  if constexpr (std::is_same_v<Hashes, HashSet>) {
    return (hashes);
  } else {
    static_assert(std::is_same_v<std::decay_t<decltype(*std::begin(hashes))>, BinHash>,
                  "poslsh: a hash set is a container of poslsh::BinHash");
    return HashSet(std::begin(hashes), std::end(hashes));
  }
}

/// Checks the hash set (non-empty, every hash valid) and n >= 0, then stores the edges.
template <typename Hashes = HashSet>
AnalysisPartitions analysis_partitions(const Hashes& hash_set, Index n, const char* function) {
  const HashSet& hashes = analysis_hash_set(hash_set);
  validate_hashes(hashes, function);
  require_size(n, function, "n");
  AnalysisPartitions partitions;
  partitions.n = n;
  for (const BinHash& hash : hashes) {
    const std::vector<Index> boundaries = block_boundaries(hash, n);
    partitions.edges.insert(partitions.edges.end(), boundaries.begin(), boundaries.end());
    partitions.offsets.push_back(partitions.edges.size());
  }
  return partitions;
}

}  // namespace poslsh::detail
