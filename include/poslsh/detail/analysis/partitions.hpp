// poslsh internals: the block edges of every sample of a hash set, stored once for the analysis
// operators (each product walks them instead of recomputing bins).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
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

/// Checks stored partitions: n >= 0, at least one sample, offsets from 0 to edges.size(), and
/// each sample's edges 0 = t_0 < t_1 < ... < t_m = n. Throws std::invalid_argument naming
/// 'partitions.n', 'partitions.offsets' or 'partitions.edges'.
inline void validate_analysis_partitions(const AnalysisPartitions& set, const char* function) {
  require_size(set.n, function, "partitions.n");
  require(!set.offsets.empty() && set.offsets.front() == 0 &&
              set.offsets.back() == set.edges.size() && set.offsets.size() >= 2,
          function, "partitions.offsets", set.offsets.size(),
          "must run from 0 to edges.size() and hold at least one sample");
  for (Index k = 0; k < set.samples(); ++k) {
    require(set.offsets[static_cast<std::size_t>(k)] < set.offsets[static_cast<std::size_t>(k) + 1],
            function, "partitions.offsets", k, "every sample needs at least one edge");
    const Index* first = set.begin(k);
    const Index* last = set.end(k);
    bool ok = first[0] == 0 && last[-1] == set.n;
    for (const Index* edge = first; ok && edge + 1 < last; ++edge) ok = edge[0] < edge[1];
    require(ok, function, "partitions.edges", k,
            "(sample) edges must run 0 = t_0 < t_1 < ... < t_m = n");
  }
}

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

/// block_boundaries(hash, n) of a valid hash and n >= 0, unchecked and faster: the first
/// position of bin b is ceil(b w + xi) up to rounding, corrected against bin() (so the edges
/// are exactly where bin() changes, as block_boundaries gives them).
inline std::vector<Index> analysis_block_edges(const BinHash& hash, Index n) {
  if (hash.width < 1.0 || n <= 1) return block_boundaries(hash, n);
  std::vector<Index> edges;
  edges.reserve(static_cast<std::size_t>(static_cast<double>(n) / hash.width) + 3);
  edges.push_back(0);
  std::int64_t bin = hash.bin(0);
  while (true) {
    ++bin;
    const double guess = std::ceil(static_cast<double>(bin) * hash.width + hash.offset);
    if (guess >= static_cast<double>(n) + 1.0) break;
    auto p = static_cast<Index>(std::max(guess, static_cast<double>(edges.back() + 1)));
    while (p > edges.back() + 1 && hash.bin(p - 1) >= bin) --p;
    while (p < n && hash.bin(p) < bin) ++p;
    if (p >= n) break;
    bin = hash.bin(p);  // width >= 1: one bin per step
    edges.push_back(p);
  }
  edges.push_back(n);
  return edges;
}

/// Checks the hash set (non-empty, every hash valid) and n >= 0, then stores the edges.
template <typename Hashes = HashSet>
AnalysisPartitions analysis_partitions(const Hashes& hash_set, Index n, const char* function) {
  const HashSet& hashes = analysis_hash_set(hash_set);
  validate_hashes(hashes, function);
  require_size(n, function, "n");
  AnalysisPartitions partitions;
  partitions.n = n;
  // Samples in parallel (OpenMP), each into its own vector, then concatenated in order: the
  // same table whatever the thread count.
  const auto samples = static_cast<Index>(hashes.size());
  std::vector<std::vector<Index>> per_sample(static_cast<std::size_t>(samples));
#pragma omp parallel for schedule(dynamic, 256)
  for (Index k = 0; k < samples; ++k) {
    per_sample[static_cast<std::size_t>(k)] =
        analysis_block_edges(hashes[static_cast<std::size_t>(k)], n);
  }
  std::size_t total = 0;
  for (const std::vector<Index>& edges : per_sample) {
    total += edges.size();
    partitions.offsets.push_back(total);
  }
  partitions.edges.resize(total);
#pragma omp parallel for schedule(dynamic, 256)
  for (Index k = 0; k < samples; ++k) {
    const std::vector<Index>& edges = per_sample[static_cast<std::size_t>(k)];
    std::copy(edges.begin(), edges.end(),
              partitions.edges.begin() +
                  static_cast<std::ptrdiff_t>(partitions.offsets[static_cast<std::size_t>(k)]));
  }
  return partitions;
}

}  // namespace poslsh::detail
