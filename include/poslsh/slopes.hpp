// poslsh: ALiBi slopes (Press et al., official formula) and the length scales sigma = 1/m.
// Checked: heads >= 1 (std::invalid_argument naming 'heads'). Not checked: that H doubles
// fit in memory (std::bad_alloc).
#pragma once

#include <cmath>
#include <vector>

#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// ALiBi slopes m_h, h = 0..H-1. For H a power of two, m_h = 2^(-8 (h+1) / H). Otherwise,
/// with p = 2^floor(log2 H): the p slopes of p heads, then the first H - p of the even-indexed
/// slopes of 2p heads, i.e. 2^(-4 (2k+1) / p). Throws std::invalid_argument if heads < 1.
inline std::vector<double> alibi_slopes(int heads) {
  detail::require_positive(heads, "alibi_slopes", "heads");
  // Counts in long long: 2 p overflows int for H > 2^30.
  const auto power_of_two_slopes = [](long long count) {
    std::vector<double> slopes(static_cast<std::size_t>(count));
    for (long long h = 0; h < count; ++h) {
      slopes[static_cast<std::size_t>(h)] =
          std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(count));
    }
    return slopes;
  };
  long long p = 1;
  while (2 * p <= heads) p *= 2;
  std::vector<double> slopes = power_of_two_slopes(p);
  if (p < heads) {
    const std::vector<double> doubled = power_of_two_slopes(2 * p);
    for (long long k = 0; k < heads - p; ++k) {
      slopes.push_back(doubled[static_cast<std::size_t>(2 * k)]);
    }
  }
  return slopes;
}

/// ALiBi length scales sigma_h = 1 / m_h for H heads (see alibi_slopes).
inline std::vector<double> alibi_sigmas(int heads) {
  std::vector<double> sigmas = alibi_slopes(heads);
  for (double& value : sigmas) value = 1.0 / value;
  return sigmas;
}

}  // namespace poslsh
