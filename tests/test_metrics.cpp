// The paper's metric set: bounds against their formulas, the observed spectral error under the
// expectation bound, output metrics and the unnormalized error against dense computations.
#include <cmath>
#include <limits>
#include <poslsh/alibi_kernel.hpp>
#include <poslsh/masks.hpp>
#include <poslsh/metrics.hpp>
#include <poslsh/reference_attention.hpp>

#include "test_support.hpp"

using poslsh::AttentionOptions;
using poslsh::Index;
using poslsh::Masking;
using poslsh::RowMatrix;
using poslsh_test::random_matrix;

namespace {

const char* name(Masking masking) {
  return masking == Masking::causal ? "causal" : "bidirectional";
}

// T~ = D~^-1 (A o M~) V from the dense mean mask (DESIGN.md section 4), in double.
template <typename Scalar>
RowMatrix<double> dense_estimate(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                                 const RowMatrix<Scalar>& v, const poslsh::HashSet& hashes,
                                 Masking masking) {
  const double tau = 1.0 / std::sqrt(double(q.cols()));
  const RowMatrix<double> scores =
      tau * q.template cast<double>() * k.template cast<double>().transpose();
  const RowMatrix<double> weighted =
      scores.array().exp() * poslsh::mean_mask_dense<double>(hashes, q.rows(), masking).array();
  return weighted.rowwise().sum().cwiseInverse().asDiagonal() * weighted *
         v.template cast<double>();
}

}  // namespace

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

TEST_CASE("observed spectral error stays below the paper's expectation bound", "[analysis]") {
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
          INFO(name(masking) << ", sigma " << sigma << ", n " << n << ", s " << s << ": error "
                             << error << ", bound " << bound);
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
    INFO(name(masking) << ": spectral " << metrics.spectral << ", max " << metrics.max << ", eps "
                       << metrics.relative_spectral);
    CHECK(metrics.spectral == poslsh::spectral_error(hashes, n, sigma, masking).value);
    CHECK(metrics.spectral_details.method == poslsh::SpectralMethod::lanczos);
    CHECK(metrics.max == poslsh::max_error(hashes, n, sigma, masking).value);
    CHECK(metrics.kernel_norm == poslsh::alibi_kernel_norm(n, sigma, masking));
    CHECK(metrics.relative_spectral == metrics.spectral / metrics.kernel_norm);
    CHECK(metrics.epsilon == metrics.relative_spectral);
    CHECK(metrics.good_samples == poslsh::good_sample_count(n, sigma, metrics.relative_spectral));
    CHECK(metrics.expectation_bound == poslsh::expectation_bound(n, sigma, 24));
    CHECK(metrics.tail_bound == poslsh::tail_bound(n, sigma, 24, metrics.relative_spectral));
    poslsh::MetricOptions options;
    options.epsilon = 0.05;
    const poslsh::KernelErrorMetrics targeted =
        poslsh::kernel_error_metrics(hashes, n, sigma, masking, options);
    CHECK(targeted.epsilon == 0.05);
    CHECK(targeted.good_samples == poslsh::good_sample_count(n, sigma, 0.05));
  }
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

  // Orthogonal outputs: cosine 0; a zero exact row with a non-zero estimate is an infinite
  // relative row error (the p99 of two rows interpolates towards it).
  RowMatrix<TestType> a(2, 2), b(2, 2);
  a << 1, 0, 0, 0;
  b << 0, 1, 0, 0;
  CHECK(poslsh::output_error_metrics<TestType>(a, b).cosine == 0.0);
  b << 1, 0, 1, 0;
  CHECK(std::isinf(poslsh::output_error_metrics<TestType>(a, b).row_relative_p99));
  CHECK(poslsh::output_error_metrics<TestType>(a, a).row_relative_p99 == 0.0);
}

TEMPLATE_TEST_CASE("unnormalized_output_error_dense equals the dense (A o L*) V - (A o M~) V",
                   "[analysis]", float, double) {
  const Index n = 150, d = 8, dv = 5;
  const auto q = random_matrix<TestType>(n, d, 1);
  const auto k = random_matrix<TestType>(n, d, 2);
  const auto v = random_matrix<TestType>(n, dv, 3);
  const double sigma = 6.0;
  const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, 11, 2, 0);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions options;
    options.masking = masking;
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
    INFO(name(masking) << ": F " << error.frobenius << " vs " << difference.norm() << ", max "
                       << error.max << " vs " << difference.cwiseAbs().maxCoeff());
    // Both in double from the same inputs; the dense side cancels two sums of size
    // |(A o L*) V|, so compare at 1e-12 of that scale.
    const double scale = exact.cwiseAbs().maxCoeff();
    CHECK(std::abs(error.frobenius - difference.norm()) <= 1e-12 * scale * n);
    CHECK(std::abs(error.max - difference.cwiseAbs().maxCoeff()) <= 1e-12 * scale);
  }
}

TEST_CASE("paper_metrics is the three metric groups in one call", "[analysis]") {
  const Index n = 256, d = 16;
  const auto q = random_matrix<double>(n, d, 4);
  const auto k = random_matrix<double>(n, d, 5);
  const auto v = random_matrix<double>(n, d, 6);
  const double sigma = 8.0;
  const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, 32, 8, 0);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions attention;
    attention.masking = masking;
    const RowMatrix<double> exact =
        poslsh::alibi_attention_reference<double>(q, k, v, sigma, attention);
    const RowMatrix<double> estimate = dense_estimate(q, k, v, hashes, masking);
    const poslsh::PaperMetrics metrics =
        poslsh::paper_metrics<double>(q, k, v, hashes, sigma, exact, estimate, attention);
    const poslsh::OutputErrorMetrics output = poslsh::output_error_metrics<double>(exact, estimate);
    INFO(name(masking) << ": relative F " << metrics.output.relative_frobenius << ", cosine "
                       << metrics.output.cosine);
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
  using poslsh_test::require_invalid_argument;
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
  require_invalid_argument([] { poslsh::expectation_bound(10, 2.0, 0); }, "s");
  require_invalid_argument([] { poslsh::good_sample_count(0, 2.0, 0.1); }, "n");
  require_invalid_argument([] { poslsh::bound_constant(-1.0); }, "sigma");
}
