// ALiBi slopes against the official formula (Press et al.) computed independently here.
#include <cmath>
#include <poslsh/slopes.hpp>
#include <vector>

#include "test_support.hpp"

namespace {

// The official get_slopes, transcribed from its recursive form:
// power of two: start = 2^(-2^-(log2(n) - 3)), slopes start^(i+1); otherwise
// get_slopes(p) + get_slopes(2p)[0::2][:n-p].
std::vector<double> official_slopes(int n) {
  const auto power_of_2 = [](int count) {
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(count) - 3.0)));
    std::vector<double> result;
    for (int i = 0; i < count; ++i) result.push_back(std::pow(start, i + 1));
    return result;
  };
  if (std::log2(n) == std::floor(std::log2(n))) return power_of_2(n);
  const int closest = 1 << static_cast<int>(std::floor(std::log2(n)));
  std::vector<double> result = power_of_2(closest);
  const std::vector<double> extra = official_slopes(2 * closest);
  for (int i = 0; i < n - closest; ++i) result.push_back(extra[static_cast<std::size_t>(2 * i)]);
  return result;
}

}  // namespace

TEST_CASE("alibi_slopes: H = 8 gives 2^-1 .. 2^-8", "[slopes]") {
  const std::vector<double> slopes = poslsh::alibi_slopes(8);
  REQUIRE(slopes.size() == 8);
  for (int h = 0; h < 8; ++h) {
    INFO("head " << h);
    CHECK(slopes[static_cast<std::size_t>(h)] == Approx(std::exp2(-(h + 1))).epsilon(1e-15));
  }
}

TEST_CASE("alibi_slopes: H = 12 appends 2^-0.5 .. 2^-3.5", "[slopes]") {
  const std::vector<double> slopes = poslsh::alibi_slopes(12);
  REQUIRE(slopes.size() == 12);
  for (int k = 0; k < 4; ++k) {
    INFO("extra head " << k);
    CHECK(slopes[static_cast<std::size_t>(8 + k)] == Approx(std::exp2(-0.5 - k)).epsilon(1e-15));
  }
}

TEST_CASE("alibi_slopes matches the official recursive formula", "[slopes]") {
  for (int heads : {1, 2, 3, 5, 6, 7, 8, 12, 16, 20, 24, 32, 40, 64, 96}) {
    const std::vector<double> expected = official_slopes(heads);
    const std::vector<double> slopes = poslsh::alibi_slopes(heads);
    REQUIRE(slopes.size() == expected.size());
    for (std::size_t h = 0; h < slopes.size(); ++h) {
      INFO("heads " << heads << ", head " << h);
      CHECK(slopes[h] == Approx(expected[h]).epsilon(1e-13));
    }
  }
}

TEST_CASE("alibi_sigmas are the reciprocal slopes", "[slopes]") {
  const std::vector<double> sigmas = poslsh::alibi_sigmas(8);
  for (int h = 0; h < 8; ++h) {
    INFO("head " << h);
    CHECK(sigmas[static_cast<std::size_t>(h)] == Approx(std::exp2(h + 1)).epsilon(1e-15));
  }
}

TEST_CASE("alibi_slopes rejects heads < 1", "[slopes][invalid]") {
  poslsh_test::require_invalid_argument([] { poslsh::alibi_slopes(0); }, "heads");
  poslsh_test::require_invalid_argument([] { poslsh::alibi_sigmas(-3); }, "heads");
}
