// The RBF positional hash: generator known answers, determinism, and the distribution of the
// width and offset (Gamma(2, sigma) and uniform on [0, w)).
#include <cmath>
#include <cstring>
#include <poslsh/detail/random/philox.hpp>
#include <poslsh/lsh/hash.hpp>

#include "test_support.hpp"

using poslsh::HashKey;

TEST_CASE("Philox4x32-10 reproduces the published known-answer vectors", "[hash]") {
  using poslsh::detail::philox4x32_10;
  // Known-answer vectors of the Random123 distribution (kat_vectors, philox4x32 10 rounds).
  CHECK(philox4x32_10({0, 0, 0, 0}, {0, 0}) ==
        poslsh::detail::PhiloxCounter{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  CHECK(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                      {0xffffffffu, 0xffffffffu}) ==
        poslsh::detail::PhiloxCounter{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  CHECK(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                      {0xa4093822u, 0x299f31d0u}) ==
        poslsh::detail::PhiloxCounter{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
}

TEST_CASE("uniform_open_closed maps words onto 0 < u <= 1", "[hash]") {
  using poslsh::detail::uniform_open_closed;
  CHECK(uniform_open_closed(0, 0) == 0x1.0p-53);
  CHECK(uniform_open_closed(0xffffffffu, 0xffffffffu) == 1.0);
}

TEST_CASE("rbf_hash is a pure function of (sigma, seed, stream, sample)", "[hash]") {
  const BinHash a = poslsh::rbf_hash(16.0, HashKey{42, 3, 7});
  const BinHash b = poslsh::rbf_hash(16.0, HashKey{42, 3, 7});
  CHECK(std::memcmp(&a, &b, sizeof(BinHash)) == 0);
  // Sample k does not depend on how many samples were drawn.
  const poslsh::HashSet few = poslsh::rbf_hashes(16.0, 3, 42, 3);
  const poslsh::HashSet many = poslsh::rbf_hashes(16.0, 100, 42, 3);
  for (std::size_t k = 0; k < few.size(); ++k) {
    INFO("sample " << k);
    CHECK(few[k].width == many[k].width);
    CHECK(few[k].offset == many[k].offset);
  }
  CHECK(few[2].width == poslsh::rbf_hash(16.0, HashKey{42, 3, 2}).width);
  // Different streams, seeds and samples give different hashes.
  CHECK(poslsh::rbf_hash(16.0, HashKey{42, 4, 7}).width != a.width);
  CHECK(poslsh::rbf_hash(16.0, HashKey{43, 3, 7}).width != a.width);
  CHECK(poslsh::rbf_hash(16.0, HashKey{42, 3, 8}).width != a.width);
  // The width scales with sigma for the same key (same uniforms).
  CHECK(poslsh::rbf_hash(32.0, HashKey{42, 3, 7}).width == Approx(2.0 * a.width).epsilon(1e-15));
}

TEST_CASE("rbf_hash draws w ~ Gamma(2, sigma) and xi uniform on 0 <= xi < w", "[hash]") {
  const double sigma = 8.0;
  const int count = 200000;
  double sum_w = 0, sum_w2 = 0, sum_ratio = 0, below_sigma = 0;
  for (int k = 0; k < count; ++k) {
    const BinHash h = poslsh::rbf_hash(sigma, HashKey{2024, 0, static_cast<std::uint64_t>(k)});
    REQUIRE(h.width > 0.0);
    REQUIRE(h.offset >= 0.0);
    REQUIRE(h.offset < h.width);
    sum_w += h.width;
    sum_w2 += h.width * h.width;
    sum_ratio += h.offset / h.width;
    below_sigma += h.width < sigma ? 1.0 : 0.0;
  }
  const double mean = sum_w / count;
  const double variance = sum_w2 / count - mean * mean;
  // Gamma(2, sigma): mean 2 sigma, variance 2 sigma^2 (standard error of the mean
  // sqrt(2/count) sigma = 0.025); CDF at sigma is 1 - 2/e.
  INFO("mean width " << mean << ", variance " << variance);
  CHECK(std::abs(mean - 2 * sigma) < 5 * sigma * std::sqrt(2.0 / count));
  CHECK(std::abs(variance / (2 * sigma * sigma) - 1.0) < 0.03);
  CHECK(std::abs(below_sigma / count - (1.0 - 2.0 / std::exp(1.0))) < 5 * 0.5 / std::sqrt(count));
  CHECK(std::abs(sum_ratio / count - 0.5) < 5 * std::sqrt(1.0 / 12.0 / count));
}

TEST_CASE("bin(i) = floor((i - xi) / w)", "[hash]") {
  const BinHash h{3.5, 1.25};
  CHECK(h.bin(0) == -1);
  CHECK(h.bin(1) == -1);
  CHECK(h.bin(2) == 0);
  CHECK(h.bin(4) == 0);
  CHECK(h.bin(5) == 1);
  CHECK(h.bin(2147483647) == static_cast<std::int64_t>(std::floor((2147483647.0 - 1.25) / 3.5)));
}

TEST_CASE("fixed_blocks_hash has width 2 sigma and offset 0", "[hash]") {
  const BinHash h = poslsh::fixed_blocks_hash(16.0);
  CHECK(h.width == 32.0);
  CHECK(h.offset == 0.0);
}

TEST_CASE("hash functions reject bad sigma and s", "[hash][invalid]") {
  require_invalid_argument([] { poslsh::rbf_hash(0.0, HashKey{}); }, "sigma");
  require_invalid_argument([] { poslsh::rbf_hash(-1.0, HashKey{}); }, "sigma");
  require_invalid_argument([] { poslsh::rbf_hash(std::nan(""), HashKey{}); }, "sigma");
  require_invalid_argument([] { poslsh::rbf_hash(INFINITY, HashKey{}); }, "sigma");
  require_invalid_argument([] { poslsh::rbf_hashes(4.0, 0, 1); }, "samples");
  require_invalid_argument([] { poslsh::fixed_blocks_hash(0.0); }, "sigma");
  require_invalid_argument([] { poslsh::validate_hash(BinHash{0.0, 0.0}, "test"); }, "hash.width");
  require_invalid_argument([] { poslsh::validate_hash(BinHash{2.0, 2.0}, "test"); }, "hash.offset");
}
