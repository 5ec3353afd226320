// poslsh: ALiBi slopes as models define them (Press et al., MPT's max_bias, ggml's m0/m1),
// slopes of a tensor-parallel shard, and the length scales sigma = 1/m.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// ALiBi slopes m_h, h = 0..H-1, for a maximum bias b (`max_bias`, 8 in the ALiBi paper and
/// most models; 16 in MPT-StoryWriter). With p = 2^floor(log2 H):
///   m_h = 2^(-b (h+1) / p)                 for h < p,
///   m_h = 2^(-b (2 (h-p) + 1) / (2 p))     for p <= h < H,
/// i.e. the p slopes of p heads, then the first H - p odd-indexed slopes of 2p heads. For b = 8
/// this is Press et al.'s get_slopes (m_h = 2^(-8 (h+1) / H) when H is a power of two); for any
/// b it is MPT's gen_slopes(H, alibi_bias_max = b) and ggml's m0^(h+1), m1^(2(h-p)+1) with
/// m0 = 2^(-b/p), m1 = 2^(-b/(2p)). Throws std::invalid_argument if heads < 1 or max_bias is
/// not finite and > 0 (std::bad_alloc if H doubles do not fit in memory). O(H).
inline std::vector<double> alibi_slopes(int heads, double max_bias = 8.0) {
  detail::require_positive(heads, "alibi_slopes", "heads");
  detail::require(std::isfinite(max_bias) && max_bias > 0.0, "alibi_slopes", "max_bias", max_bias,
                  "must be finite and > 0");
  // Counts in long long: 2 p overflows int for H > 2^30.
  long long p = 1;
  while (2 * p <= heads) p *= 2;
  const auto power = static_cast<double>(p);
  std::vector<double> slopes(static_cast<std::size_t>(heads));
  for (long long h = 0; h < heads; ++h) {
    const double exponent = h < p ? max_bias * static_cast<double>(h + 1) / power
                                  : max_bias * static_cast<double>(2 * (h - p) + 1) / (2.0 * power);
    slopes[static_cast<std::size_t>(h)] = std::exp2(-exponent);
  }
  return slopes;
}

/// The slopes of a tensor-parallel shard: heads first_head .. first_head + local_heads - 1 of
/// the H = `heads` slopes of alibi_slopes(heads, max_bias) (each rank of a model whose heads are
/// split across ranks uses the slopes of its own heads, not alibi_slopes(local_heads)). Throws
/// std::invalid_argument if the range is not inside [0, heads) or is empty.
inline std::vector<double> alibi_slopes_shard(int heads, int first_head, int local_heads,
                                              double max_bias = 8.0) {
  detail::require_positive(heads, "alibi_slopes_shard", "heads");
  detail::require_index("alibi_slopes_shard", "first_head", first_head, "heads", heads);
  detail::require(local_heads >= 1 && local_heads <= heads - first_head, "alibi_slopes_shard",
                  "local_heads", local_heads, [&] {
                    return "must be in [1, heads - first_head] = [1, " +
                           std::to_string(heads - first_head) + "]";
                  });
  const std::vector<double> slopes = alibi_slopes(heads, max_bias);
  return std::vector<double>(slopes.begin() + first_head,
                             slopes.begin() + first_head + local_heads);
}

/// Length scales sigma_h = 1 / m_h of given slopes (e.g. a model's own per-head slopes);
/// unchecked.
inline std::vector<double> sigmas_from_slopes(std::vector<double> slopes) {
  for (double& value : slopes) value = 1.0 / value;
  return slopes;
}

/// ALiBi length scales sigma_h = 1 / m_h for H heads (see alibi_slopes; throws as it does).
inline std::vector<double> alibi_sigmas(int heads, double max_bias = 8.0) {
  return sigmas_from_slopes(alibi_slopes(heads, max_bias));
}

}  // namespace poslsh
