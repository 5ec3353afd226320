// The banded exact ALiBi attention against a dense masked softmax and the full reference, and
// band_for_bias_error against the ALiBi kernel it truncates.
#include <cmath>
#include <limits>
#include <poslsh/attention/banded.hpp>
#include <poslsh/reference/alibi_kernel.hpp>
#include <poslsh/reference/attention.hpp>
#include <vector>

#include "test_support.hpp"

using poslsh_test::tolerance;

namespace {

bool kept(Index i, Index j, Index band, Masking masking) {
  return std::abs(i - j) <= band && (masking == Masking::bidirectional || j <= i);
}

// Softmax over the kept keys of x_ij = tau q_i.k_j - |i-j|/sigma, in double, by definition.
template <typename Scalar>
RowMatrix<double> masked_softmax(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                                 const RowMatrix<Scalar>& v, double sigma, Index band,
                                 Masking masking) {
  const Index n = q.rows();
  const double tau = 1.0 / std::sqrt(static_cast<double>(q.cols()));
  RowMatrix<double> out = RowMatrix<double>::Zero(n, v.cols());
  for (Index i = 0; i < n; ++i) {
    double row_max = -std::numeric_limits<double>::infinity();
    std::vector<double> x(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j) {
      if (!kept(i, j, band, masking)) continue;
      x[std::size_t(j)] =
          tau * q.row(i).template cast<double>().dot(k.row(j).template cast<double>()) -
          std::abs(static_cast<double>(i - j)) / sigma;
      row_max = std::max(row_max, x[std::size_t(j)]);
    }
    double total = 0;
    for (Index j = 0; j < n; ++j) {
      if (!kept(i, j, band, masking)) continue;
      const double weight = std::exp(x[std::size_t(j)] - row_max);
      out.row(i) += weight * v.row(j).template cast<double>();
      total += weight;
    }
    out.row(i) /= total;
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("alibi_attention_banded with band >= n - 1 equals the exact reference",
                   "[banded]", float, double) {
  const Index d = 8, dv = 6;
  for (Index n : {1, 50, 130}) {
    const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 61, 2.0);
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (Index band : {n - 1, n, 10 * n, std::numeric_limits<Index>::max()}) {
        const auto options = with_masking(masking);
        const RowMatrix<TestType> expected =
            poslsh::alibi_attention_reference<TestType>(q, k, v, 9.0, options);
        const RowMatrix<TestType> out =
            poslsh::alibi_attention_banded<TestType>(q, k, v, 9.0, band, options);
        INFO("n " << n << ", band " << band << ", causal " << (masking == Masking::causal));
        CHECK(relative_max_error(out, expected) < tolerance<TestType>());
      }
    }
  }
}

TEMPLATE_TEST_CASE("alibi_attention_banded equals a dense masked softmax", "[banded]", float,
                   double) {
  // Bands narrower than, equal to and wider than a 64-key tile, over n = 230 (4 tiles).
  const Index n = 230, d = 8, dv = 5;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 71, 2.0);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (Index band : {0, 1, 3, 17, 64, 100}) {
      for (double sigma : {0.5, 20.0}) {
        const RowMatrix<TestType> out =
            poslsh::alibi_attention_banded<TestType>(q, k, v, sigma, band, with_masking(masking));
        const RowMatrix<double> expected = masked_softmax(q, k, v, sigma, band, masking);
        INFO("band " << band << ", sigma " << sigma << ", causal " << (masking == Masking::causal));
        // Scalar rounding of the scores and sums against a double computation.
        CHECK(relative_max_error(out.template cast<double>(), expected) <
              10 * tolerance<TestType>());
      }
    }
  }
  // band = 0 keeps only j = i: the output is V itself.
  const RowMatrix<TestType> diagonal = poslsh::alibi_attention_banded<TestType>(q, k, v, 3.0, 0);
  CHECK(relative_max_error(diagonal, v) < tolerance<TestType>());
}

TEST_CASE("band_for_bias_error drops only kernel entries below eps", "[banded]") {
  const Index n = 400;
  for (double sigma : {0.3, 2.0, 17.0, 64.0}) {
    for (double eps : {0.5, 1e-2, 1e-6, 1e-12}) {
      const Index band = poslsh::band_for_bias_error(sigma, eps);
      INFO("sigma " << sigma << ", eps " << eps << ", band " << band);
      CHECK(band == static_cast<Index>(std::ceil(sigma * std::log(1.0 / eps))));
      const auto kernel = poslsh::alibi_kernel_dense<double>(n, sigma, Masking::bidirectional);
      double dropped = 0, smallest_kept = 1;
      for (Index i = 0; i < n; ++i)
        for (Index j = 0; j < n; ++j) {
          if (std::abs(i - j) > band)
            dropped = std::max(dropped, kernel(i, j));
          else
            smallest_kept = std::min(smallest_kept, kernel(i, j));
        }
      CHECK(dropped <= eps);
      // At most one wider than needed: band - 1 < sigma ln(1/eps), so e^{-(band-1)/sigma} > eps.
      if (band >= 1 && band < n) CHECK(std::exp(-static_cast<double>(band - 1) / sigma) > eps);
    }
  }
  CHECK(poslsh::band_for_bias_error(1e300, 1e-3) > 0);
}

TEMPLATE_TEST_CASE("alibi_attention_banded differs from exact by at most the dropped weight",
                   "[banded]", float, double) {
  // out_exact = (N_k + N_d) / (D_k + D_d), out_band = N_k / D_k with D = sum of e^{x_ij} over
  // kept (k) and dropped (d) keys: |out_band - out_exact| <= 2 max|v| D_d / (D_k + D_d).
  const Index n = 180, d = 4, dv = 3;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 81);
  const double sigma = 6.0, eps = 1e-3, tau = 0.5;
  const Index band = poslsh::band_for_bias_error(sigma, eps);
  const RowMatrix<TestType> exact = poslsh::alibi_attention_reference<TestType>(q, k, v, sigma);
  const RowMatrix<TestType> banded = poslsh::alibi_attention_banded<TestType>(q, k, v, sigma, band);
  const double v_max = static_cast<double>(v.cwiseAbs().maxCoeff());
  double largest_gap = 0;
  for (Index i = 0; i < n; ++i) {
    double kept_mass = 0, dropped_mass = 0;
    for (Index j = 0; j <= i; ++j) {
      const double x =
          tau * q.row(i).template cast<double>().dot(k.row(j).template cast<double>()) -
          static_cast<double>(i - j) / sigma;
      (i - j <= band ? kept_mass : dropped_mass) += std::exp(x);
    }
    const double gap = static_cast<double>(
        (banded.row(i) - exact.row(i)).template cast<double>().cwiseAbs().maxCoeff());
    largest_gap = std::max(largest_gap, gap);
    INFO("row " << i);
    CHECK(gap <=
          2 * v_max * dropped_mass / (kept_mass + dropped_mass) + 10 * tolerance<TestType>());
  }
  CHECK(largest_gap > 0);  // rows beyond the band do lose something
}

TEMPLATE_TEST_CASE("alibi_attention_banded_rows equals the full call bit for bit", "[banded]",
                   float, double) {
  const Index n = 260, d = 8, dv = 16, band = 40;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 91);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const auto options = with_masking(masking);
    const RowMatrix<TestType> full =
        poslsh::alibi_attention_banded<TestType>(q, k, v, 7.0, band, options);
    RowMatrix<TestType> pieces(n, dv);
    const std::vector<Index> split = {0, 64, 100, 101, 192, n};
    for (std::size_t s = 0; s + 1 < split.size(); ++s) {
      RowMatrix<TestType> rows(split[s + 1] - split[s], dv);
      poslsh::alibi_attention_banded_rows<TestType>(q, k, v, 7.0, band, split[s], split[s + 1],
                                                    rows, options);
      pieces.middleRows(split[s], rows.rows()) = rows;
    }
    INFO("causal " << (masking == Masking::causal));
    CHECK((pieces.array() == full.array()).all());
  }
}

TEST_CASE("alibi_attention_banded: n = 0 gives an empty result", "[banded]") {
  const RowMatrix<float> empty(0, 4);
  CHECK(poslsh::alibi_attention_banded<float>(empty, empty, empty, 1.0, 3).rows() == 0);
}

TEST_CASE("alibi_attention_banded and band_for_bias_error reject bad arguments",
          "[banded][invalid]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double eps : {0.0, 1.0, -0.5, 2.0, nan})
    require_invalid_argument([&] { poslsh::band_for_bias_error(2.0, eps); }, "eps");
  for (double sigma : {0.0, -1.0, nan, std::numeric_limits<double>::infinity()})
    require_invalid_argument([&] { poslsh::band_for_bias_error(sigma, 0.1); }, "sigma");
  const auto q = random_matrix<double>(5, 4, 1);
  const auto k3 = random_matrix<double>(5, 3, 1);
  const auto v6 = random_matrix<double>(6, 4, 1);
  const RowMatrix<double> no_columns(5, 0);
  require_invalid_argument([&] { poslsh::alibi_attention_banded<double>(q, q, q, 1.0, -1); },
                           "band");
  require_invalid_argument([&] { poslsh::alibi_attention_banded<double>(q, k3, q, 1.0, 2); }, "k");
  require_invalid_argument([&] { poslsh::alibi_attention_banded<double>(q, q, v6, 1.0, 2); }, "v");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_banded<double>(no_columns, no_columns, q, 1.0, 2); }, "q");
  require_invalid_argument([&] { poslsh::alibi_attention_banded<double>(q, q, q, nan, 2); },
                           "sigma");
  RowMatrix<double> wrong(5, 3);
  require_invalid_argument([&] { poslsh::alibi_attention_banded<double>(q, q, q, 1.0, 2, wrong); },
                           "out");
  RowMatrix<double> rows(2, 4);
  require_invalid_argument(
      [&] { poslsh::alibi_attention_banded_rows<double>(q, q, q, 1.0, 2, 4, 7, rows); }, "row_end");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_banded_rows<double>(q, q, q, 1.0, -2, 0, 2, rows); }, "band");
}
