// Dense masks, and the identity that makes the method work: E[M(h)] = L*.
#include <cmath>
#include <poslsh/reference/alibi_kernel.hpp>
#include <poslsh/reference/masks.hpp>

#include "test_support.hpp"

TEMPLATE_TEST_CASE("bin_mask_dense is the indicator of bin(i) = bin(j)", "[masks]", float, double) {
  const poslsh::BinHash hash{5.5, 2.0};
  const Index n = 23;
  const RowMatrix<TestType> bidirectional =
      poslsh::bin_mask_dense<TestType>(hash, n, Masking::bidirectional);
  const RowMatrix<TestType> causal = poslsh::bin_mask_dense<TestType>(hash, n, Masking::causal);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < n; ++j) {
      const TestType same = hash.bin(i) == hash.bin(j) ? TestType(1) : TestType(0);
      INFO("i " << i << ", j " << j);
      REQUIRE(bidirectional(i, j) == same);
      REQUIRE(causal(i, j) == (j <= i ? same : TestType(0)));
    }
  }
}

TEST_CASE("mean of many masks matches exp(-|i-j|/sigma) within the standard error",
          "[masks][unbiased]") {
  const int samples = 20000;
  const Index n = 48;
  for (double sigma : {1.5, 4.0, 16.0}) {
    const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, samples, 7, 0);
    const RowMatrix<double> mean =
        poslsh::mean_mask_dense<double>(hashes, n, Masking::bidirectional);
    const RowMatrix<double> kernel =
        poslsh::alibi_kernel_dense<double>(n, sigma, Masking::bidirectional);
    double worst_z = 0.0;
    double worst_abs = 0.0;
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < n; ++j) {
        const double p = kernel(i, j);
        // Binomial hit count: |hits - N p| <= z sqrt(N p (1 - p)) + 3; the +3 covers the
        // Poisson regime of far entries (N p << 1) where one stray hit is not a bias.
        const double hits = mean(i, j) * samples;
        const double deviation = std::max(0.0, std::abs(hits - samples * p) - 3.0);
        worst_z = std::max(worst_z, deviation / std::sqrt(samples * p * (1 - p) + 1e-300));
        worst_abs = std::max(worst_abs, std::abs(mean(i, j) - p));
      }
    }
    INFO("sigma " << sigma << ": max |M~ - L*| = " << worst_abs << ", max z-score beyond 3 hits "
                  << worst_z);
    CHECK(worst_z < 5.0);
    CHECK(worst_abs < 0.02);
  }
}

TEST_CASE("causal mean mask is the lower triangle of the bidirectional one", "[masks]") {
  const poslsh::HashSet hashes = poslsh::rbf_hashes(3.0, 10, 1, 0);
  const RowMatrix<double> full =
      poslsh::mean_mask_dense<double>(hashes, 30, Masking::bidirectional);
  const RowMatrix<double> causal = poslsh::mean_mask_dense<double>(hashes, 30, Masking::causal);
  const RowMatrix<double> lower = full.triangularView<Eigen::Lower>();
  CHECK(causal == lower);
  CHECK(full.diagonal().minCoeff() == 1.0);
}

TEST_CASE("masks reject an empty hash set and negative n", "[masks][invalid]") {
  require_invalid_argument(
      [] { poslsh::mean_mask_dense<double>(poslsh::HashSet{}, 4, Masking::causal); },
      "hashes.size()");
  require_invalid_argument(
      [] { poslsh::mean_mask_dense<double>(poslsh::rbf_hashes(2.0, 2, 0), -1, Masking::causal); },
      "n");
}
