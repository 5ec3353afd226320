// Block statistics against a direct scan of bin(), and b_max against the law of the widths.
#include <array>
#include <cmath>
#include <poslsh/analysis/block_stats.hpp>
#include <vector>

#include "test_support.hpp"

TEST_CASE("block_stats equals a direct scan of the bins", "[analysis]") {
  for (double sigma : {0.4, 3.0, 20.0, 5000.0}) {
    const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, 9, 12, 3);
    const Index n = 1000;
    // Blocks are the maximal runs of equal bin(i).
    Index largest = 0, blocks = 0;
    double square_sum = 0.0;
    for (const poslsh::BinHash& hash : hashes) {
      Index run = 1;
      for (Index i = 1; i <= n; ++i) {
        if (i < n && hash.bin(i) == hash.bin(i - 1)) {
          ++run;
          continue;
        }
        largest = std::max(largest, run);
        square_sum += double(run) * double(run);
        ++blocks;
        run = 1;
      }
    }
    const poslsh::BlockStats stats = poslsh::block_stats(hashes, n);
    INFO("sigma " << sigma << ": largest " << stats.largest << ", blocks " << stats.blocks);
    CHECK(stats.largest == largest);
    CHECK(stats.blocks == blocks);
    CHECK(stats.mean == Approx(9.0 * n / double(blocks)).epsilon(1e-14));
    CHECK(stats.mean_at_position == Approx(square_sum / (9.0 * n)).epsilon(1e-14));
    CHECK(poslsh::largest_block(hashes, n) == largest);
  }
}

TEST_CASE("fixed blocks of width 2 sigma have every statistic equal to 2 sigma", "[analysis]") {
  const poslsh::HashSet hashes{poslsh::fixed_blocks_hash(8.0)};
  const poslsh::BlockStats stats = poslsh::block_stats(hashes, 160);
  CHECK(stats.largest == 16);
  CHECK(stats.blocks == 10);
  CHECK(stats.mean == 16.0);
  CHECK(stats.mean_at_position == 16.0);
}

TEST_CASE("b_max over s samples follows the largest of s Gamma(2, sigma) widths",
          "[analysis][slow]") {
  // Every block of one sample has the sample's width w (integer count floor(w) or ceil(w));
  // with n >> w both counts occur, so b_max = ceil(max_k w_k). Its mean lies in
  // [E max w, E max w + 1], E max w = sigma * int_0^inf 1 - (1 - e^-t (1 + t))^s dt.
  const double sigma = 16.0;
  const Index n = 8192;
  const int trials = 400;
  for (Index s : {2, 9, 30}) {
    double expected = 0.0;
    const double step = 1e-3;
    for (double t = step / 2; t < 80.0; t += step) {
      expected += step * (1.0 - std::pow(1.0 - std::exp(-t) * (1.0 + t), double(s)));
    }
    expected *= sigma;
    double sum = 0.0, square_sum = 0.0;
    for (int trial = 0; trial < trials; ++trial) {
      const double largest = double(
          poslsh::largest_block(poslsh::rbf_hashes(sigma, s, 1000u + unsigned(trial), 7), n));
      sum += largest;
      square_sum += largest * largest;
    }
    const double mean = sum / trials;
    const double standard_error = std::sqrt((square_sum / trials - mean * mean) / trials);
    INFO("s " << s << ": mean b_max " << mean << " +- " << standard_error << ", E max w "
              << expected);
    CHECK(mean > expected - 4 * standard_error);
    CHECK(mean < expected + 1.0 + 4 * standard_error);
  }
}

TEST_CASE("b_max over s = ceil(ln n) samples stays within a constant of sigma ln ln n",
          "[analysis][slow]") {
  // Theorem 2.1's shape: b_max / (sigma ln ln n) stays O(1) as n grows. The mean largest of
  // s = ceil(ln n) Gamma(2, sigma) widths is 4.0, 4.5, 4.8 sigma at n = 2^8, 2^12, 2^16 (the
  // integral of the previous test), so the ratio falls slowly from about 2.4 to 2.1.
  const double sigma = 4.0;
  for (Index n : {1 << 8, 1 << 12, 1 << 16}) {
    const auto s = static_cast<Index>(std::ceil(std::log(double(n))));
    double sum = 0.0;
    const int trials = 40;
    for (int trial = 0; trial < trials; ++trial) {
      sum += double(poslsh::largest_block(poslsh::rbf_hashes(sigma, s, 50u + unsigned(trial)), n));
    }
    const double ratio = sum / trials / poslsh::block_size_scale(sigma, n);
    INFO("n " << n << ", s " << s << ": mean b_max / (sigma ln ln n) = " << ratio);
    CHECK(ratio > 1.5);
    CHECK(ratio < 3.0);
  }
}

TEST_CASE("block_stats takes any container of BinHash", "[analysis]") {
  const poslsh::HashSet hashes = poslsh::rbf_hashes(3.0, 4, 6);
  const std::array<poslsh::BinHash, 4> array{hashes[0], hashes[1], hashes[2], hashes[3]};
  const poslsh::BlockStats from_set = poslsh::block_stats(hashes, 500);
  const poslsh::BlockStats from_array = poslsh::block_stats(array, 500);
  CHECK(from_array.largest == from_set.largest);
  CHECK(from_array.blocks == from_set.blocks);
  CHECK(from_array.mean == from_set.mean);
  CHECK(from_array.mean_at_position == from_set.mean_at_position);
}

TEST_CASE("block statistics reject bad arguments naming them", "[analysis][invalid]") {
  require_invalid_argument([] { poslsh::block_stats({}, 10); }, "hashes");
  require_invalid_argument([] { poslsh::block_stats(poslsh::rbf_hashes(2.0, 2, 1), -3); }, "n");
  require_invalid_argument(
      [] {
        poslsh::block_stats({poslsh::BinHash{-1.0, 0.0}}, 10);
      },
      "hash.width");
  require_invalid_argument(
      [] {
        poslsh::block_stats({poslsh::BinHash{0.0, 0.0}}, 10);
      },
      "hash.width");
  require_invalid_argument(
      [] {
        poslsh::block_stats({poslsh::BinHash{std::nan(""), 0.0}}, 10);
      },
      "hash.width");
  require_invalid_argument(
      [] {
        poslsh::block_stats({poslsh::BinHash{4.0, std::nan("")}}, 10);
      },
      "hash.offset");
  // A bad hash after good ones is found too, and largest_block checks as block_stats does.
  poslsh::HashSet mixed = poslsh::rbf_hashes(2.0, 3, 1);
  mixed.push_back(poslsh::BinHash{4.0, std::nan("")});
  require_invalid_argument([&] { poslsh::block_stats(mixed, 10); }, "hash.offset");
  require_invalid_argument([&] { poslsh::largest_block(mixed, 10); }, "hash.offset");
  require_invalid_argument([] { poslsh::largest_block({}, 10); }, "hashes");
  require_invalid_argument([] { poslsh::largest_block(poslsh::rbf_hashes(2.0, 2, 1), -1); }, "n");
  // The same checks for any container of BinHash.
  const std::array<poslsh::BinHash, 1> zero_width{poslsh::BinHash{0.0, 0.0}};
  require_invalid_argument([&] { poslsh::block_stats(zero_width, 10); }, "hash.width");
  const std::array<poslsh::BinHash, 0> empty{};
  require_invalid_argument([&] { poslsh::block_stats(empty, 10); }, "hashes");
  require_invalid_argument([] { poslsh::block_size_scale(2.0, 2); }, "n");
  require_invalid_argument([] { poslsh::block_size_scale(0.0, 100); }, "sigma");
}
