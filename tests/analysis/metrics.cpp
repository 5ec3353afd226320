// The paper's metric set: bounds against their formulas, the observed spectral error under the
// expectation bound, output metrics and the unnormalized error against dense computations.
#include <Eigen/Eigenvalues>
#include <Eigen/SVD>
#include <array>
#include <cmath>
#include <limits>
#include <poslsh/analysis.hpp>
#include <poslsh/reference/alibi_kernel.hpp>
#include <poslsh/reference/attention.hpp>
#include <poslsh/reference/masks.hpp>

#include "analysis_instantiations.hpp"
#include "lsh_oracle.hpp"
#include "test_support.hpp"

TEST_CASE("bounds equal the paper's formulas", "[analysis]") {
  for (double sigma : {0.5, 2.0, 16.0, 256.0}) {
    const double e = std::exp(1.0 / sigma);
    const double psi = 1.0 + sigma + (e + 1.0) / (e - 1.0);
    INFO("sigma " << sigma);
    CHECK(poslsh::bound_constant(sigma) == Approx(psi).epsilon(1e-12));
    const double ln_n = std::log(4096.0);
    CHECK(poslsh::expectation_bound(4096, sigma, 64) ==
          Approx(psi * (std::sqrt(ln_n / 64) + ln_n / 64)).epsilon(1e-12));
    CHECK(poslsh::tail_bound(4096, sigma, 64, 0.3) ==
          Approx(4096 * std::exp(-64 * 0.09 / (4 * psi * (4 * psi + 0.3)))).epsilon(1e-12));
    CHECK(poslsh::good_sample_count(4096, sigma, 0.1) == std::ceil(sigma * sigma * ln_n / 0.01));
  }
  // n = 1: ln n = 0, nothing to estimate.
  CHECK(poslsh::expectation_bound(1, 4.0, 3) == 0.0);
}

TEST_CASE("observed spectral error stays below the paper's expectation bound", "[analysis][slow]") {
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {2.0, 16.0, 128.0}) {
      for (Index n : {1024, 8192}) {
        for (Index s : {1, 8, 64, 512}) {
          // One sample at n = 8192 makes E nearly periodic (a clustered spectrum that costs
          // Lanczos thousands of products): s = 1 is covered at n = 1024.
          if (s == 1 && n > 1024) continue;
          const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, s, 99, 0);
          const double error = poslsh::spectral_error(hashes, n, sigma, masking).value;
          const double bound = poslsh::expectation_bound(n, sigma, s);
          INFO(poslsh_test::masking_name(masking)
               << ", sigma " << sigma << ", n " << n << ", s " << s << ": error " << error
               << ", bound " << bound);
          CHECK(error < bound);
        }
      }
    }
  }
}

TEST_CASE("kernel_error_metrics gathers the errors, the norm and the bounds", "[analysis]") {
  const Index n = 3000;
  const double sigma = 8.0;
  const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, 24, 5, 1);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const poslsh::KernelErrorMetrics metrics =
        poslsh::kernel_error_metrics(hashes, n, sigma, masking);
    INFO(poslsh_test::masking_name(masking)
         << ": spectral " << metrics.spectral << ", max " << metrics.max << ", eps "
         << metrics.relative_spectral);
    CHECK(metrics.spectral == poslsh::spectral_error(hashes, n, sigma, masking).value);
    CHECK(metrics.spectral_details.method == poslsh::SpectralMethod::lanczos);
    CHECK(metrics.max == poslsh::max_error(hashes, n, sigma, masking).value);
    CHECK(metrics.kernel_norm == poslsh::alibi_kernel_norm(n, sigma, masking));
    CHECK(metrics.relative_spectral == metrics.spectral / metrics.kernel_norm);
    CHECK(metrics.epsilon == metrics.spectral);  // absolute by default
    CHECK(metrics.good_samples == poslsh::good_sample_count(n, sigma, metrics.spectral));
    CHECK(metrics.expectation_bound == poslsh::expectation_bound(n, sigma, 24));
    CHECK(metrics.tail_bound == poslsh::tail_bound(n, sigma, 24, metrics.spectral));
    poslsh::MetricOptions relative;
    relative.epsilon_definition = poslsh::EpsilonDefinition::relative;
    const poslsh::KernelErrorMetrics by_relative =
        poslsh::kernel_error_metrics(hashes, n, sigma, masking, relative);
    CHECK(by_relative.epsilon == metrics.relative_spectral);
    CHECK(by_relative.good_samples ==
          poslsh::good_sample_count(n, sigma, metrics.relative_spectral));
    CHECK(by_relative.tail_bound == poslsh::tail_bound(n, sigma, 24, metrics.relative_spectral));
    // Any container of BinHash: the same hashes as a std::array give the same record.
    std::array<poslsh::BinHash, 24> array{};
    std::copy(hashes.begin(), hashes.end(), array.begin());
    const poslsh::KernelErrorMetrics from_array =
        poslsh::kernel_error_metrics(array, n, sigma, masking);
    CHECK(from_array.spectral == metrics.spectral);
    CHECK(from_array.max == metrics.max);
    CHECK(from_array.good_samples == metrics.good_samples);
    poslsh::MetricOptions options;
    options.epsilon = 0.05;
    const poslsh::KernelErrorMetrics targeted =
        poslsh::kernel_error_metrics(hashes, n, sigma, masking, options);
    CHECK(targeted.epsilon == 0.05);
    CHECK(targeted.good_samples == poslsh::good_sample_count(n, sigma, 0.05));
  }
}

TEST_CASE("s_good and the tail bound from the absolute and the relative spectral error",
          "[analysis][slow]") {
  // rbf_hashes(16, 100, 2) at n = 1000: ||L* - M~||_2 = 2.235 and ||L*||_2 = 31.86, so with
  // epsilon = ||E||_2 (absolute, the paper's validation code) s_good = ceil(256 ln 1000 /
  // 2.235^2) = 354, and with epsilon = ||E||_2 / ||L*||_2 (relative) s_good = 360952.
  // Both norms are recomputed here from the dense matrices by Eigen's decompositions.
  const Index n = 1000, s = 100;
  const double sigma = 16.0;
  const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, s, 2);
  const Masking masking = Masking::bidirectional;
  const RowMatrix<double> kernel = poslsh::alibi_kernel_dense<double>(n, sigma, masking);
  const RowMatrix<double> error = kernel - poslsh::mean_mask_dense<double>(hashes, n, masking);
  const Eigen::SelfAdjointEigenSolver<RowMatrix<double>> error_eigen(error, Eigen::EigenvaluesOnly);
  const Eigen::SelfAdjointEigenSolver<RowMatrix<double>> kernel_eigen(kernel,
                                                                      Eigen::EigenvaluesOnly);
  const double absolute = error_eigen.eigenvalues().cwiseAbs().maxCoeff();
  const double relative = absolute / kernel_eigen.eigenvalues().cwiseAbs().maxCoeff();
  const double e = std::exp(1.0 / sigma);
  const double psi = 1.0 + sigma + (e + 1.0) / (e - 1.0);
  const auto good = [&](double eps) { return sigma * sigma * std::log(double(n)) / (eps * eps); };
  const auto tail = [&](double eps) {
    return double(n) * std::exp(-double(s) * eps * eps / (4.0 * psi * (4.0 * psi + eps)));
  };
  INFO("dense ||E||_2 " << absolute << ", relative " << relative << ", s_good " << good(absolute)
                        << " / " << good(relative));
  // The hand-computed values above, from the dense norms.
  CHECK(std::ceil(good(absolute)) == Approx(354).margin(1.0));
  CHECK(std::ceil(good(relative)) == Approx(360952).epsilon(1e-4));

  const poslsh::KernelErrorMetrics metrics =
      poslsh::kernel_error_metrics(hashes, n, sigma, masking);
  CHECK(metrics.spectral_details.method == poslsh::SpectralMethod::lanczos);
  // Lanczos against the dense eigenvalues: 1e-8 relative, so s_good agrees to 1 (the ceiling).
  CHECK(metrics.epsilon == Approx(absolute).epsilon(1e-8));
  CHECK(std::abs(metrics.good_samples - std::ceil(good(absolute))) <= 1.0);
  CHECK(metrics.tail_bound == Approx(tail(absolute)).epsilon(1e-6));

  poslsh::MetricOptions options;
  options.epsilon_definition = poslsh::EpsilonDefinition::relative;
  const poslsh::KernelErrorMetrics by_relative =
      poslsh::kernel_error_metrics(hashes, n, sigma, masking, options);
  CHECK(by_relative.epsilon == Approx(relative).epsilon(1e-8));
  CHECK(by_relative.good_samples == Approx(std::ceil(good(relative))).epsilon(1e-7));
  CHECK(by_relative.tail_bound == Approx(tail(relative)).epsilon(1e-8));
  // An explicit epsilon overrides both definitions.
  options.epsilon = 0.5;
  CHECK(poslsh::kernel_error_metrics(hashes, n, sigma, masking, options).good_samples ==
        std::ceil(good(0.5)));
}

TEMPLATE_TEST_CASE("output_error_metrics equals its definitions", "[analysis]", float, double) {
  // 11 rows with relative row errors 0, 0.1, ..., 1.0: t*_i = (3, 4) (norm 5), t~_i = t*_i
  // scaled by 1 - i/10, so r_i = i/10; median 0.5, p90 0.9, p99 0.99.
  RowMatrix<TestType> exact(11, 2), approximate(11, 2);
  for (Index i = 0; i < 11; ++i) {
    exact.row(i) << TestType(3), TestType(4);
    approximate.row(i) = exact.row(i) * static_cast<TestType>(1.0 - double(i) / 10.0);
  }
  // Shuffle the rows: percentiles must not depend on row order.
  exact.row(0).swap(exact.row(7));
  approximate.row(0).swap(approximate.row(7));
  const poslsh::OutputErrorMetrics metrics =
      poslsh::output_error_metrics<TestType>(exact, approximate);
  const double tolerance =
      10 * poslsh_test::tolerance<TestType>();  // one rounding of 1 - i/10 in Scalar
  CHECK(metrics.row_relative_median == Approx(0.5).epsilon(tolerance));
  CHECK(metrics.row_relative_p90 == Approx(0.9).epsilon(tolerance));
  CHECK(metrics.row_relative_p99 == Approx(0.99).epsilon(tolerance));
  const RowMatrix<double> difference =
      exact.template cast<double>() - approximate.template cast<double>();
  CHECK(metrics.frobenius == Approx(difference.norm()).epsilon(1e-14));
  CHECK(metrics.relative_frobenius ==
        Approx(difference.norm() / exact.template cast<double>().norm()).epsilon(1e-14));
  // Flattened, <T*, T~> = 25 sum_j j/10 = 137.5, ||T*||^2 = 275, ||T~||^2 = 25 sum_j (j/10)^2
  // = 96.25 (j = 0..10), so cosine = 5.5 / sqrt(11 * 3.85).
  CHECK(metrics.cosine == Approx(5.5 / std::sqrt(11 * 3.85)).epsilon(tolerance));

  CHECK(metrics.zero_rows == 0);

  // Orthogonal outputs: cosine 0.
  RowMatrix<TestType> a(2, 2), b(2, 2);
  a << 1, 0, 0, 0;
  b << 0, 1, 0, 0;
  CHECK(poslsh::output_error_metrics<TestType>(a, b).cosine == 0.0);
  CHECK(poslsh::output_error_metrics<TestType>(a, a).row_relative_p99 == 0.0);
}

TEMPLATE_TEST_CASE("output_error_metrics leaves zero exact rows out of the row-wise statistics",
                   "[analysis]", float, double) {
  // 11 rows as above (r_i = i/10), but exact row 5 is 0 and its estimate is (1, 2). The row-wise
  // statistics are those of the other 10 values 0, .1, .2, .3, .4, .6, .7, .8, .9, 1 (positions
  // p * 9): median (0.4 + 0.6) / 2 = 0.5, p90 0.9 + 0.1 * 0.1 = 0.91, p99 0.9 + 0.91 * 0.1 =
  // 0.991. (With the zero row as an infinite relative error, p90 would sit at position 9 of 11
  // values, 0 * inf = NaN.)
  RowMatrix<TestType> exact(11, 2), approximate(11, 2);
  for (Index i = 0; i < 11; ++i) {
    exact.row(i) << TestType(3), TestType(4);
    approximate.row(i) = exact.row(i) * static_cast<TestType>(1.0 - double(i) / 10.0);
  }
  exact.row(5).setZero();
  approximate.row(5) << TestType(1), TestType(2);
  const poslsh::OutputErrorMetrics metrics =
      poslsh::output_error_metrics<TestType>(exact, approximate);
  const double tolerance = 10 * poslsh_test::tolerance<TestType>();
  CHECK(metrics.zero_rows == 1);
  CHECK(metrics.row_relative_median == Approx(0.5).epsilon(tolerance));
  CHECK(metrics.row_relative_p90 == Approx(0.91).epsilon(tolerance));
  CHECK(metrics.row_relative_p99 == Approx(0.991).epsilon(tolerance));
  // The matrix-wide errors keep the zero row: ||T* - T~||_F^2 = 25 sum_{i != 5} (i/10)^2 + 5
  // = 25 (3.85 - 0.25) + 5 = 95, ||T*||_F^2 = 250.
  CHECK(metrics.frobenius == Approx(std::sqrt(95.0)).epsilon(tolerance));
  CHECK(metrics.relative_frobenius == Approx(std::sqrt(95.0 / 250.0)).epsilon(tolerance));

  // Every exact row 0: no row-wise statistic (NaN), every row counted, F relative error +inf.
  const RowMatrix<TestType> zero = RowMatrix<TestType>::Zero(11, 2);
  const poslsh::OutputErrorMetrics all_zero =
      poslsh::output_error_metrics<TestType>(zero, approximate);
  CHECK(all_zero.zero_rows == 11);
  CHECK(std::isnan(all_zero.row_relative_median));
  CHECK(std::isnan(all_zero.row_relative_p90));
  CHECK(std::isnan(all_zero.row_relative_p99));
  CHECK(std::isinf(all_zero.relative_frobenius));
  CHECK(all_zero.cosine == 0.0);
}

TEMPLATE_TEST_CASE("unnormalized_output_error_dense equals the dense (A o L*) V - (A o M~) V",
                   "[analysis]", float, double) {
  const Index n = 150, d = 8, dv = 5;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 1);
  const double sigma = 6.0;
  const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, 11, 2, 0);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions options = with_masking(masking);
    options.scale = 0.7;
    const RowMatrix<double> a =
        (0.7 * q.template cast<double>() * k.template cast<double>().transpose()).array().exp();
    const RowMatrix<double> exact =
        a.cwiseProduct(poslsh::alibi_kernel_dense<double>(n, sigma, masking)) *
        v.template cast<double>();
    const RowMatrix<double> estimate =
        a.cwiseProduct(poslsh::mean_mask_dense<double>(hashes, n, masking)) *
        v.template cast<double>();
    const RowMatrix<double> difference = exact - estimate;
    const poslsh::UnnormalizedOutputError error =
        poslsh::unnormalized_output_error_dense<TestType>(q, k, v, hashes, sigma, options);
    INFO(poslsh_test::masking_name(masking)
         << ": F " << error.frobenius << " vs " << difference.norm() << ", max " << error.max
         << " vs " << difference.cwiseAbs().maxCoeff());
    // Both in double from the same inputs; the dense side cancels two sums of size
    // |(A o L*) V|, so compare at 1e-12 of that scale.
    const double scale = exact.cwiseAbs().maxCoeff();
    CHECK(std::abs(error.frobenius - difference.norm()) <= 1e-12 * scale * n);
    CHECK(std::abs(error.max - difference.cwiseAbs().maxCoeff()) <= 1e-12 * scale);
  }
}

TEST_CASE("paper_metrics is the three metric groups in one call", "[analysis]") {
  const Index n = 256, d = 16;
  const auto [q, k, v] = random_qkv<double>(n, d, d, 4);
  const double sigma = 8.0;
  const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, 32, 8, 0);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions attention = with_masking(masking);
    const RowMatrix<double> exact =
        poslsh::alibi_attention_reference<double>(q, k, v, sigma, attention);
    const RowMatrix<double> estimate =
        poslsh_test::lsh_dense_oracle(q, k, v, hashes, masking, 1.0 / std::sqrt(double(d)));
    const poslsh::PaperMetrics metrics =
        poslsh::paper_metrics<double>(q, k, v, hashes, sigma, exact, estimate, attention);
    const poslsh::OutputErrorMetrics output = poslsh::output_error_metrics<double>(exact, estimate);
    INFO(poslsh_test::masking_name(masking) << ": relative F " << metrics.output.relative_frobenius
                                            << ", cosine " << metrics.output.cosine);
    CHECK(metrics.output.frobenius == output.frobenius);
    CHECK(metrics.output.row_relative_p90 == output.row_relative_p90);
    REQUIRE(metrics.unnormalized.has_value());
    CHECK(metrics.unnormalized->frobenius ==
          poslsh::unnormalized_output_error_dense<double>(q, k, v, hashes, sigma, attention)
              .frobenius);
    CHECK(metrics.kernel.spectral == poslsh::spectral_error(hashes, n, sigma, masking).value);
    // s = 32 samples at sigma = 8 approximate attention well: a sanity range, not a bound.
    CHECK(metrics.output.relative_frobenius < 0.5);
    CHECK(metrics.output.cosine > 0.8);
    poslsh::MetricOptions options;
    options.dense_limit = n - 1;
    CHECK_FALSE(
        poslsh::paper_metrics<double>(q, k, v, hashes, sigma, exact, estimate, attention, options)
            .unnormalized.has_value());
  }
}

TEST_CASE("metric functions reject mismatched sizes and bad values naming the argument",
          "[analysis][invalid]") {
  const auto q = random_matrix<double>(10, 4, 1);
  const auto v = random_matrix<double>(10, 3, 2);
  const auto out = random_matrix<double>(10, 3, 3);
  const auto wrong = random_matrix<double>(9, 3, 4);
  const poslsh::HashSet hashes = poslsh::rbf_hashes(2.0, 4, 1);
  require_invalid_argument([&] { poslsh::output_error_metrics<double>(out, wrong); },
                           "approximate");
  require_invalid_argument(
      [&] { poslsh::output_error_metrics<double>(out.topRows(0), out.topRows(0)); }, "exact");
  require_invalid_argument(
      [&] { poslsh::paper_metrics<double>(q, q, v, hashes, 2.0, wrong, wrong); }, "exact");
  require_invalid_argument([&] { poslsh::paper_metrics<double>(q, q, v, hashes, 2.0, out, wrong); },
                           "approximate");
  require_invalid_argument(
      [&] { poslsh::paper_metrics<double>(q, q.topRows(9), v.topRows(9), hashes, 2.0, out, out); },
      "k");
  require_invalid_argument(
      [&] { poslsh::unnormalized_output_error_dense<double>(q, q, wrong, hashes, 2.0); }, "v");
  require_invalid_argument(
      [&] { poslsh::unnormalized_output_error_dense<double>(q, v, v, hashes, 2.0); }, "k");
  require_invalid_argument(
      [&] { poslsh::unnormalized_output_error_dense<double>(q, q, v, {}, 2.0); }, "hashes");
  poslsh::MetricOptions options;
  options.epsilon = -1.0;
  require_invalid_argument(
      [&] { poslsh::kernel_error_metrics(hashes, 10, 2.0, Masking::causal, options); },
      "options.epsilon");
  require_invalid_argument([&] { poslsh::kernel_error_metrics(hashes, 0, 2.0, Masking::causal); },
                           "n");
  require_invalid_argument([] { poslsh::tail_bound(10, 2.0, 4, 0.0); }, "epsilon");
  require_invalid_argument([] { poslsh::expectation_bound(10, 2.0, 0); }, "samples");
  require_invalid_argument([] { poslsh::good_sample_count(0, 2.0, 0.1); }, "n");
  require_invalid_argument([] { poslsh::bound_constant(-1.0); }, "sigma");
}
