// poslsh internals: the ALiBi slope 1/sigma as a Scalar that keeps every bias finite.
#pragma once

#include <algorithm>
#include <limits>

#include "poslsh/core/types.hpp"

namespace poslsh::detail {

/// min(1/sigma, max(Scalar) / max(distance, 1)): the slope of the bias -|i-j| / sigma, capped
/// so that |i-j| * slope stays finite for every |i-j| <= distance, and 0 (not 0 * inf = NaN) on
/// the diagonal, however small sigma is. sigma is finite and > 0 (checked by the caller).
template <typename Scalar>
Scalar finite_alibi_slope(double sigma, Index distance) {
  const auto largest = static_cast<double>(std::numeric_limits<Scalar>::max());
  return static_cast<Scalar>(
      std::min(1.0 / sigma, largest / static_cast<double>(std::max<Index>(distance, 1))));
}

}  // namespace poslsh::detail
