/// \file
/// \brief The RBF positional hash (Rahimi and Recht's random binning on token positions): the
/// counter-based draws rbf_hash and rbf_hashes of BinHash (core/hash.hpp), with the paper's
/// fixed-blocks baseline.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/random/philox.hpp"

namespace poslsh {

/// Largest sigma the hash functions accept: the widths they draw (at most -2 ln 2^-53 sigma,
/// about 73.5 sigma) then stay finite. Any sigma beyond 2^63 already gives one block.
inline constexpr double max_hash_sigma = 1e300;

namespace detail {

/// sigma of a hash: finite, > 0 and <= max_hash_sigma.
inline void require_hash_sigma(double sigma, const char* function) {
  require_sigma(sigma, function);
  require(sigma <= max_hash_sigma, function, "sigma", sigma,
          "must be <= 1e300 (max_hash_sigma) so that the block width stays finite");
}

}  // namespace detail

/// The key of one sample: (seed, stream, sample index). A stream is typically a head (or a
/// layer * heads + head); samples of one stream are independent of each other.
struct HashKey {
  std::uint64_t seed = 0;
  std::uint64_t stream = 0;
  std::uint64_t sample = 0;
};

/// Sample k of the RBF hash for length scale sigma: w ~ Gamma(2, sigma) drawn as
/// w = -sigma (ln U1 + ln U2), xi = U3 w, with U1, U2, U3 on (0, 1] from Philox4x32-10 keyed
/// by `key`, so P[bin(i) = bin(j)] = exp(-|i-j| / sigma). The result depends only on
/// (sigma, key): bit-identical on every platform, whatever else was drawn.
/// Throws std::invalid_argument if sigma is not finite, > 0 and <= max_hash_sigma.
inline BinHash rbf_hash(double sigma, const HashKey& key) {
  detail::require_hash_sigma(sigma, "rbf_hash");
  const detail::PhiloxCounter first = detail::philox_words(key.seed, key.stream, key.sample, 0);
  const detail::PhiloxCounter second = detail::philox_words(key.seed, key.stream, key.sample, 1);
  const double u1 = detail::uniform_open_closed(first[0], first[1]);
  const double u2 = detail::uniform_open_closed(first[2], first[3]);
  const double u3 = detail::uniform_open_closed(second[0], second[1]);
  BinHash hash;
  hash.width = std::max(-sigma * (std::log(u1) + std::log(u2)), BinHash::min_width);
  // u3 is in (0, 1]; 1 - u3 is in [0, 1) so the offset stays strictly below the width.
  hash.offset = (1.0 - u3) * hash.width;
  return hash;
}

/// Samples 0..s-1 of stream `stream` under `seed` (see rbf_hash): the hash set of one head.
/// Throws std::invalid_argument if s < 1 or sigma is not finite, > 0 and <= max_hash_sigma.
/// O(s).
inline HashSet rbf_hashes(double sigma, Index samples, std::uint64_t seed,
                          std::uint64_t stream = 0) {
  detail::require_positive(samples, "rbf_hashes", "samples");
  detail::require_hash_sigma(sigma, "rbf_hashes");
  HashSet hashes(static_cast<std::size_t>(samples));
  for (Index k = 0; k < samples; ++k) {
    hashes[static_cast<std::size_t>(k)] =
        rbf_hash(sigma, HashKey{seed, stream, static_cast<std::uint64_t>(k)});
  }
  return hashes;
}

/// The paper's fixed-blocks baseline: width 2 sigma (= E[w]), offset 0, no randomness.
/// Throws std::invalid_argument if sigma is not finite, > 0 and <= max_hash_sigma.
inline BinHash fixed_blocks_hash(double sigma) {
  detail::require_hash_sigma(sigma, "fixed_blocks_hash");
  return BinHash{std::max(2.0 * sigma, BinHash::min_width), 0.0};
}

}  // namespace poslsh
