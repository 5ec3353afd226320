/// \file
/// \brief The contiguous blocks that one hash cuts [0, n) into: block_boundaries, checked (the
/// unchecked block_containing the kernels use is in core/hash.hpp), for any n an Index holds
/// (positions are exact doubles up to 2^53).
#pragma once

#include <cmath>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// Block boundaries 0 = t_0 < t_1 < ... < t_m = n of `hash` on [0, n): block r is
/// [t_r, t_{r+1}); n = 0 gives {0}. Throws std::invalid_argument if n < 0 or the hash is
/// invalid. O(m) = O(n / w + 1) time.
inline std::vector<Index> block_boundaries(const BinHash& hash, Index n) {
  detail::require_size(n, "block_boundaries", "n");
  validate_hash(hash, "block_boundaries");
  return detail::block_boundaries_between(hash, 0, n);
}

}  // namespace poslsh
