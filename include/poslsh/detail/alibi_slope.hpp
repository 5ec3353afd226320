// poslsh internals: the ALiBi slope 1/sigma as a Scalar that keeps every bias finite.
#pragma once

#include <algorithm>
#include <cmath>
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

/// T of the dead-key rule of the exact kernels (detail/tile/alibi_bias.hpp, and the backward's
/// WindowRule): -ln of the smallest normal Scalar, rounded up, plus 1 (89 for float, 710 for
/// double). e^{-T} is below the smallest normal Scalar, where the exponentials of the softmax
/// and of the backward's probabilities return 0 (or a subnormal, flushed in the backward).
template <typename Scalar>
double dead_key_logit() {
  return std::ceil(-std::log(static_cast<double>(std::numeric_limits<Scalar>::min()))) + 1.0;
}

/// The dead-key rule's bounds and margins, one home for the forward and the backward.
/// dead_key_query_bound(tau, |q_i|) = (1 + 2^-8) |tau| |q_i|: with it, |tau q_i . k_j| <= bound
/// |k_j| for either sign of the score scale tau (Cauchy-Schwarz), the factor covering the
/// rounding of the norms and of the scores. A test of "dead" or "alive" on a block keeps
/// dead_key_slack(terms) between its two sides (1 plus 2^-16 of the magnitude of the terms
/// compared).
inline double dead_key_query_bound(double tau, double query_norm) {
  return (1.0 + 1.0 / 256.0) * std::abs(tau) * query_norm;
}
inline double dead_key_slack(double terms) { return 1.0 + 0x1p-16 * terms; }

}  // namespace poslsh::detail
