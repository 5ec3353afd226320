/// \file
/// \brief The positional hash as every kernel reads it: BinHash (bin(i) = floor((i - xi) / w)),
/// a head's HashSet of s samples, the contiguous Block of a hash that holds a position, and a
/// head's samples as stored block partitions (PartitionSet), with their checks. The draws of random
/// hashes (rbf_hashes, the samplers) are in lsh/.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// One positional hash: bin(i) = floor((i - offset) / width). All blocks have the same width
/// (the first and last are cut by the sequence ends) and are contiguous.
struct BinHash {
  /// Widths below this are raised to it: any width < 1 already puts every integer position in
  /// a bin of its own, so this changes no mask while keeping bin() in range.
  static constexpr double min_width = 0x1.0p-20;

  double width = 1.0;   ///< w > 0
  double offset = 0.0;  ///< xi in [0, w)

  /// Bin of position i: floor((i - xi) / w). Unchecked (a hot path): requires
  /// |position| / width < 2^63 (always so for |position| < 2^43, since width >= 2^-20).
  std::int64_t bin(Index position) const {
    return static_cast<std::int64_t>(std::floor((static_cast<double>(position) - offset) / width));
  }
};

/// A set of s hashes (one per sample) for one head.
using HashSet = std::vector<BinHash>;

/// Checks a user-built hash: width finite and >= BinHash::min_width, offset in [0, width).
/// Throws std::invalid_argument naming 'hash.width' or 'hash.offset'. Every kernel and
/// partition function runs it.
inline void validate_hash(const BinHash& hash, const char* function) {
  detail::require(std::isfinite(hash.width) && hash.width >= BinHash::min_width, function,
                  "hash.width", hash.width, "must be finite and >= 2^-20");
  detail::require(hash.offset >= 0.0 && hash.offset < hash.width, function, "hash.offset",
                  hash.offset, "must lie in [0, width)");
}

/// Checks a hash set: at least one hash (s >= 1), each valid (validate_hash). Throws
/// std::invalid_argument naming 'hashes' or the bad hash's field. Every function that takes a
/// HashSet runs it.
inline void validate_hashes(const HashSet& hashes, const char* function) {
  detail::require(!hashes.empty(), function, "hashes", "{}",
                  "must hold at least one hash (s >= 1)");
  for (const BinHash& hash : hashes) validate_hash(hash, function);
}

/// A block [begin, end) of positions that share one bin.
struct Block {
  Index begin = 0;
  Index end = 0;
  Index size() const { return end - begin; }
};

namespace detail {

/// The first position of the block of `hash` holding position i, whose bin is b = bin(i):
/// block_containing's begin, estimated from the width and offset, then corrected against
/// bin().
inline Index block_begin(const BinHash& hash, std::int64_t b, Index i) {
  if (hash.width < 1.0) return i;  // no two integer positions share a bin
  const double first = std::ceil(static_cast<double>(b) * hash.width + hash.offset);
  Index begin =
      first <= 0.0 ? 0 : (first >= static_cast<double>(i) ? i : static_cast<Index>(first));
  while (begin > 0 && hash.bin(begin - 1) == b) --begin;
  while (hash.bin(begin) < b) ++begin;
  return begin;
}

/// The end, cut to n, of the block of `hash` holding position i < n, whose bin is b = bin(i):
/// block_containing's end, estimated, then corrected against bin().
inline Index block_end(const BinHash& hash, std::int64_t b, Index i, Index n) {
  if (hash.width < 1.0) return i + 1;
  const double next = std::ceil(static_cast<double>(b + 1) * hash.width + hash.offset);
  Index end = next >= static_cast<double>(n)
                  ? n
                  : (next <= static_cast<double>(i + 1) ? i + 1 : static_cast<Index>(next));
  while (end < n && hash.bin(end) == b) ++end;
  while (hash.bin(end - 1) > b) --end;
  return end;
}

}  // namespace detail

/// The block of `hash` that holds position i, cut to [0, n): the largest [b, e) with
/// bin(b) = ... = bin(e-1) = bin(i). O(1): the edges are estimated from the width and offset,
/// then corrected against bin() so they agree with it exactly. Requires 0 <= i < n (unchecked:
/// an internal building block of the kernels; use block_boundaries for a checked call).
inline Block block_containing(const BinHash& hash, Index i, Index n) {
  const std::int64_t b = hash.bin(i);
  return {detail::block_begin(hash, b, i), detail::block_end(hash, b, i, n)};
}

namespace detail {

/// Block boundaries lo = t_0 < t_1 < ... < t_m = hi of `hash` on the positions [lo, hi) (its
/// blocks cut to the range; hi = lo gives {lo}). Unchecked: 0 <= lo <= hi.
inline std::vector<Index> block_boundaries_between(const BinHash& hash, Index lo, Index hi) {
  std::vector<Index> boundaries;
  // One block per bin from lo's to (hi - 1)'s (at most one per position): one allocation.
  const std::int64_t blocks =
      hi > lo ? std::min<std::int64_t>(hash.bin(hi - 1) - hash.bin(lo) + 1, hi - lo) : 0;
  boundaries.reserve(static_cast<std::size_t>(blocks) + 1);
  boundaries.push_back(lo);
  for (Index begin = lo; begin < hi;) {
    begin = block_containing(hash, begin, hi).end;
    boundaries.push_back(begin);
  }
  return boundaries;
}

}  // namespace detail

/// The block partitions of a set of s samples on [0, n): sample k's blocks are
/// [edges[offsets[k] + r], edges[offsets[k] + r + 1]), from 0 to n (for a hash, its
/// block_boundaries on [0, n); memory sum_k (n / w_k + 2) indices, about n s / sigma). The
/// kernels and the analysis functions that take one accept any partition, including the unequal
/// blocks of Sampler::poisson that a BinHash cannot describe.
struct PartitionSet {
  Index n = 0;
  std::vector<Index> edges;
  std::vector<std::size_t> offsets{0};

  Index samples() const { return static_cast<Index>(offsets.size()) - 1; }
  const Index* begin(Index k) const { return edges.data() + offsets[static_cast<std::size_t>(k)]; }
  const Index* end(Index k) const {
    return edges.data() + offsets[static_cast<std::size_t>(k) + 1];
  }
};

/// Checks a partition set: n >= 0, s >= 1 samples, each with edges 0 = t_0 < t_1 < ... < t_m = n
/// (n = 0: the single edge 0) and offsets running from 0 to edges.size(). Throws
/// std::invalid_argument naming 'partitions.n', 'partitions.offsets' or 'partitions.edges'.
inline void validate_partition_set(const PartitionSet& set, const char* function) {
  detail::require_size(set.n, function, "partitions.n");
  detail::require(!set.offsets.empty() && set.offsets.front() == 0 &&
                      set.offsets.back() == set.edges.size() && set.offsets.size() >= 2,
                  function, "partitions.offsets", set.offsets.size(),
                  "must run from 0 to edges.size() and hold at least one sample");
  for (Index k = 0; k < set.samples(); ++k) {
    detail::require(
        set.offsets[static_cast<std::size_t>(k)] < set.offsets[static_cast<std::size_t>(k) + 1],
        function, "partitions.offsets", k, "every sample needs at least one edge");
    const Index* first = set.begin(k);
    const Index* last = set.end(k);
    bool ok = first[0] == 0 && last[-1] == set.n;
    for (const Index* edge = first; ok && edge + 1 < last; ++edge) ok = edge[0] < edge[1];
    detail::require(ok, function, "partitions.edges", k,
                    "(sample) edges must run 0 = t_0 < t_1 < ... < t_m = n");
  }
}

}  // namespace poslsh
