// poslsh internals: the block edges of every sample of a hash set (PartitionSet), built once for
// the analysis operators (each product walks them instead of recomputing bins).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <type_traits>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/parallel.hpp"

namespace poslsh::detail {

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

/// Edge tables at most this large are built on one thread.
inline constexpr std::size_t analysis_parallel_edges = std::size_t{1} << 16;

/// Number of block edges of a valid hash on [0, n): n + 1 when w < 1 (every position is a
/// block), else bin(n-1) - bin(0) + 2 (a bin of width w >= 1 always holds an integer, so every
/// bin from bin(0) to bin(n-1) is a block); 1 when n = 0.
inline std::size_t analysis_edge_count(const BinHash& hash, Index n) {
  if (n == 0) return 1;
  if (hash.width < 1.0) return static_cast<std::size_t>(n) + 1;
  return static_cast<std::size_t>(hash.bin(n - 1) - hash.bin(0)) + 2;
}

/// Writes block_boundaries(hash, n) of a valid hash and n >= 0 to `out` (analysis_edge_count
/// entries), unchecked and faster: the first position of bin b is ceil(b w + xi) up to
/// rounding, corrected against bin() (so the edges are exactly where bin() changes).
inline void analysis_write_block_edges(const BinHash& hash, Index n, Index* out) {
  if (hash.width < 1.0 || n <= 1) {
    const std::vector<Index> edges = block_boundaries_between(hash, 0, n);
    std::copy(edges.begin(), edges.end(), out);
    return;
  }
  Index* edge = out;
  *edge = 0;
  std::int64_t bin = hash.bin(0);
  const std::int64_t last_bin = hash.bin(n - 1);
  while (bin < last_bin) {
    ++bin;
    const double guess = std::ceil(static_cast<double>(bin) * hash.width + hash.offset);
    auto p = static_cast<Index>(
        std::clamp(guess, static_cast<double>(*edge + 1), static_cast<double>(n - 1)));
    while (p > *edge + 1 && hash.bin(p - 1) >= bin) --p;
    while (p < n - 1 && hash.bin(p) < bin) ++p;
    *++edge = p;  // width >= 1: bin(p) == bin
  }
  *++edge = n;
}

/// The stored edges of a hash set (a HashSet or any container of BinHash) on [0, n). Throws
/// std::invalid_argument (messages from `function`) if the set is empty, a hash is invalid or
/// n < 0. Samples in parallel (parallel_loop); the same table whatever the thread count.
template <typename Hashes = HashSet>
PartitionSet analysis_partitions(const Hashes& hash_set, Index n, const char* function) {
  const HashSet& hashes = analysis_hash_set(hash_set);
  validate_hashes(hashes, function);
  require_size(n, function, "n");
  PartitionSet partitions;
  partitions.n = n;
  // Edge counts first (analysis_edge_count), then every sample's edges written in parallel
  // at its offset.
  const auto samples = static_cast<Index>(hashes.size());
  partitions.offsets.resize(static_cast<std::size_t>(samples) + 1);
  for (Index k = 0; k < samples; ++k) {
    const auto uk = static_cast<std::size_t>(k);
    partitions.offsets[uk + 1] = partitions.offsets[uk] + analysis_edge_count(hashes[uk], n);
  }
  partitions.edges.resize(partitions.offsets.back());
  const bool parallel = partitions.edges.size() > analysis_parallel_edges;
  parallel_loop(static_cast<long>(samples), LoopSchedule::dynamic(256), parallel, [&](long k) {
    const auto uk = static_cast<std::size_t>(k);
    analysis_write_block_edges(hashes[uk], n, partitions.edges.data() + partitions.offsets[uk]);
  });
  return partitions;
}

}  // namespace poslsh::detail
