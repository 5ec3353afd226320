// poslsh: the contiguous blocks that one hash cuts [0, n) into (block_containing,
// block_boundaries), for any n an Index holds (positions are exact doubles up to 2^53).
#pragma once

#include <cmath>
#include <vector>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/lsh/hash.hpp"

namespace poslsh {

/// A block [begin, end) of positions that share one bin.
struct Block {
  Index begin = 0;
  Index end = 0;
  Index size() const { return end - begin; }
};

/// The block of `hash` that holds position i, cut to [0, n): the largest [b, e) with
/// bin(b) = ... = bin(e-1) = bin(i). O(1): the edges are estimated from the width and offset,
/// then corrected against bin() so they agree with it exactly. Requires 0 <= i < n (unchecked:
/// an internal building block of the kernels; use block_boundaries for a checked call).
inline Block block_containing(const BinHash& hash, Index i, Index n) {
  const std::int64_t b = hash.bin(i);
  Block block;
  if (hash.width < 1.0) return Block{i, i + 1};  // no two integer positions share a bin
  const double first = std::ceil(static_cast<double>(b) * hash.width + hash.offset);
  block.begin =
      first <= 0.0 ? 0 : (first >= static_cast<double>(i) ? i : static_cast<Index>(first));
  while (block.begin > 0 && hash.bin(block.begin - 1) == b) --block.begin;
  while (hash.bin(block.begin) < b) ++block.begin;
  const double next = std::ceil(static_cast<double>(b + 1) * hash.width + hash.offset);
  block.end = next >= static_cast<double>(n)
                  ? n
                  : (next <= static_cast<double>(i + 1) ? i + 1 : static_cast<Index>(next));
  while (block.end < n && hash.bin(block.end) == b) ++block.end;
  while (hash.bin(block.end - 1) > b) --block.end;
  return block;
}

namespace detail {

/// Block boundaries lo = t_0 < t_1 < ... < t_m = hi of `hash` on the positions [lo, hi) (its
/// blocks cut to the range; hi = lo gives {lo}). Unchecked: 0 <= lo <= hi.
inline std::vector<Index> block_boundaries_between(const BinHash& hash, Index lo, Index hi) {
  std::vector<Index> boundaries{lo};
  for (Index begin = lo; begin < hi;) {
    begin = block_containing(hash, begin, hi).end;
    boundaries.push_back(begin);
  }
  return boundaries;
}

}  // namespace detail

/// Block boundaries 0 = t_0 < t_1 < ... < t_m = n of `hash` on [0, n): block r is
/// [t_r, t_{r+1}); n = 0 gives {0}. Throws std::invalid_argument if n < 0 or the hash is
/// invalid. O(m) = O(n / w + 1) time.
inline std::vector<Index> block_boundaries(const BinHash& hash, Index n) {
  detail::require_size(n, "block_boundaries", "n");
  validate_hash(hash, "block_boundaries");
  return detail::block_boundaries_between(hash, 0, n);
}

}  // namespace poslsh
