// ALiBi slopes against the official formula (Press et al.) computed independently here.
#include <cmath>
#include <poslsh/core/slopes.hpp>
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

// MPT's gen_slopes(n_heads, alibi_bias_max), transcribed: _n = 2^ceil(log2 n);
// m = arange(1, _n + 1) * (alibi_bias_max / _n); slopes = 1 / 2^m; if _n != n:
// slopes = concat(slopes[1::2], slopes[::2])[:n].
std::vector<double> mpt_gen_slopes(int n_heads, double alibi_bias_max) {
  const int padded = 1 << static_cast<int>(std::ceil(std::log2(n_heads)));
  std::vector<double> slopes;
  for (int i = 1; i <= padded; ++i) {
    slopes.push_back(1.0 / std::pow(2.0, i * (alibi_bias_max / padded)));
  }
  if (padded == n_heads) return slopes;
  std::vector<double> reordered;
  for (int i = 1; i < padded; i += 2) reordered.push_back(slopes[static_cast<std::size_t>(i)]);
  for (int i = 0; i < padded; i += 2) reordered.push_back(slopes[static_cast<std::size_t>(i)]);
  reordered.resize(static_cast<std::size_t>(n_heads));
  return reordered;
}

// ggml's ALiBi slopes (soft_max / flash_attn_ext with max_bias), transcribed:
// n_head_log2 = 2^floor(log2 n_head); m0 = 2^(-max_bias / n_head_log2);
// m1 = 2^(-(max_bias / 2) / n_head_log2); slope_h = h < n_head_log2 ? m0^(h + 1)
// : m1^(2 (h - n_head_log2) + 1).
std::vector<double> ggml_slopes(int n_head, double max_bias) {
  const int n_head_log2 = 1 << static_cast<int>(std::floor(std::log2(n_head)));
  const double m0 = std::pow(2.0, -max_bias / n_head_log2);
  const double m1 = std::pow(2.0, -(max_bias / 2.0) / n_head_log2);
  std::vector<double> slopes;
  for (int h = 0; h < n_head; ++h) {
    slopes.push_back(h < n_head_log2 ? std::pow(m0, h + 1)
                                     : std::pow(m1, 2 * (h - n_head_log2) + 1));
  }
  return slopes;
}

void check_slopes(const std::vector<double>& slopes, const std::vector<double>& expected,
                  const char* source, int heads, double max_bias) {
  REQUIRE(slopes.size() == expected.size());
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    INFO(source << ": heads " << heads << ", max_bias " << max_bias << ", head " << h);
    CHECK(slopes[h] == Approx(expected[h]).epsilon(1e-13));
  }
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

TEST_CASE("alibi_slopes matches Press et al., MPT and ggml for H = 1 .. 128", "[slopes]") {
  for (int heads = 1; heads <= 128; ++heads) {
    const std::vector<double> slopes = poslsh::alibi_slopes(heads);
    check_slopes(slopes, official_slopes(heads), "Press et al.", heads, 8.0);
    check_slopes(slopes, mpt_gen_slopes(heads, 8.0), "MPT gen_slopes", heads, 8.0);
    check_slopes(slopes, ggml_slopes(heads, 8.0), "ggml m0/m1", heads, 8.0);
    // Other maximum biases: MPT and ggml define them (Press et al.'s formula is for 8 only).
    for (double max_bias : {1.0, 16.0}) {
      const std::vector<double> scaled = poslsh::alibi_slopes(heads, max_bias);
      check_slopes(scaled, mpt_gen_slopes(heads, max_bias), "MPT gen_slopes", heads, max_bias);
      check_slopes(scaled, ggml_slopes(heads, max_bias), "ggml m0/m1", heads, max_bias);
    }
  }
}

TEST_CASE("alibi_slopes keeps its former bits for max_bias = 8", "[slopes]") {
  // m_h = 2^(-8 (h+1) / H) for H a power of two, computed by the same expression as exp2.
  for (int heads : {1, 2, 4, 8, 16, 32, 64}) {
    const std::vector<double> slopes = poslsh::alibi_slopes(heads);
    for (int h = 0; h < heads; ++h) {
      INFO("heads " << heads << ", head " << h);
      CHECK(slopes[static_cast<std::size_t>(h)] == std::exp2(-8.0 * (h + 1) / heads));
    }
  }
}

TEST_CASE("MPT-StoryWriter's max_bias = 16 for 32 heads starts at 2^-0.5", "[slopes]") {
  const std::vector<double> slopes = poslsh::alibi_slopes(32, 16.0);
  REQUIRE(slopes.size() == 32);
  CHECK(slopes.front() == Approx(std::exp2(-0.5)).epsilon(1e-15));
  CHECK(slopes.back() == Approx(std::exp2(-16.0)).epsilon(1e-15));
  const std::vector<double> sigmas = poslsh::alibi_sigmas(32, 16.0);
  CHECK(sigmas.front() == Approx(std::exp2(0.5)).epsilon(1e-15));
}

TEST_CASE("a tensor-parallel shard holds its own heads' slopes of the whole model", "[slopes]") {
  for (double max_bias : {8.0, 16.0}) {
    const std::vector<double> all = poslsh::alibi_slopes(24, max_bias);
    for (int first = 0; first < 24; first += 6) {
      const std::vector<double> shard = poslsh::alibi_slopes_shard(24, first, 6, max_bias);
      REQUIRE(shard.size() == 6);
      for (int h = 0; h < 6; ++h) {
        INFO("max_bias " << max_bias << ", shard from " << first << ", head " << h);
        CHECK(shard[static_cast<std::size_t>(h)] == all[static_cast<std::size_t>(first + h)]);
      }
    }
  }
  // Not the slopes of a model with the shard's head count.
  CHECK(poslsh::alibi_slopes_shard(16, 8, 8)[0] != poslsh::alibi_slopes(8)[0]);
}

TEST_CASE("sigmas_from_slopes inverts given per-head slopes", "[slopes]") {
  const std::vector<double> sigmas = poslsh::sigmas_from_slopes({0.5, 0.25, 1.0 / 3.0});
  REQUIRE(sigmas.size() == 3);
  CHECK(sigmas[0] == 2.0);
  CHECK(sigmas[1] == 4.0);
  CHECK(sigmas[2] == Approx(3.0).epsilon(1e-15));
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
  poslsh_test::require_invalid_argument([] { poslsh::alibi_slopes(8, 0.0); }, "max_bias");
  poslsh_test::require_invalid_argument([] { poslsh::alibi_slopes(8, std::nan("")); }, "max_bias");
  poslsh_test::require_invalid_argument([] { poslsh::alibi_slopes_shard(8, 8, 1); }, "first_head");
  poslsh_test::require_invalid_argument([] { poslsh::alibi_slopes_shard(8, -1, 1); }, "first_head");
  poslsh_test::require_invalid_argument([] { poslsh::alibi_slopes_shard(8, 4, 5); }, "local_heads");
  poslsh_test::require_invalid_argument([] { poslsh::alibi_slopes_shard(8, 4, 0); }, "local_heads");
}
