// The naive exact ALiBi attention against D^-1 (A o L*) V computed from the dense kernel.
#include <cmath>
#include <poslsh/reference/alibi_kernel.hpp>
#include <poslsh/reference/attention.hpp>

#include "test_support.hpp"

namespace {

// T* = D^-1 (A o L*) V in long double, A = exp(tau Q K^T), straight from the definition.
template <typename Scalar>
RowMatrix<double> definition(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                             const RowMatrix<Scalar>& v, double sigma, Masking masking,
                             double tau) {
  const auto kernel = poslsh::alibi_kernel_dense<double>(q.rows(), sigma, masking);
  const RowMatrix<double> scores =
      tau * q.template cast<double>() * k.template cast<double>().transpose();
  const RowMatrix<double> weighted = scores.array().exp() * kernel.array();
  const Eigen::VectorXd row_sums = weighted.rowwise().sum();
  return row_sums.cwiseInverse().asDiagonal() * weighted * v.template cast<double>();
}

}  // namespace

TEMPLATE_TEST_CASE("alibi_attention_reference equals D^-1 (A o L*) V", "[reference]", float,
                   double) {
  const Index n = 40, d = 8, dv = 5;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 1);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {0.5, 4.0, 100.0}) {
      AttentionOptions options = with_masking(masking);
      const RowMatrix<TestType> out =
          poslsh::alibi_attention_reference<TestType>(q, k, v, sigma, options);
      const RowMatrix<double> expected =
          definition(q, k, v, sigma, masking, 1.0 / std::sqrt(double(d)));
      INFO("sigma " << sigma << ", causal " << (masking == Masking::causal));
      CHECK(poslsh_test::relative_max_error(out.template cast<double>(), expected) <
            10 * poslsh_test::tolerance<TestType>());
    }
  }
}

TEST_CASE("alibi_attention_reference honours an explicit scale and strided views", "[reference]") {
  const Index n = 16, d = 4, heads = 3;
  // An [n, H, d] buffer: head h of token i at row i, columns h*d .. h*d+d-1.
  const auto buffer = random_matrix<double>(n, heads * d, 9);
  const auto values = random_matrix<double>(n, heads * d, 10);
  AttentionOptions options;
  options.scale = 0.7;
  using Map = Eigen::Map<const RowMatrix<double>, 0, Eigen::OuterStride<>>;
  RowMatrix<double> out_buffer(n, heads * d);
  for (Index h = 0; h < heads; ++h) {
    Map q(buffer.data() + h * d, n, d, Eigen::OuterStride<>(heads * d));
    Map v(values.data() + h * d, n, d, Eigen::OuterStride<>(heads * d));
    Eigen::Map<RowMatrix<double>, 0, Eigen::OuterStride<>> out(out_buffer.data() + h * d, n, d,
                                                               Eigen::OuterStride<>(heads * d));
    poslsh::alibi_attention_reference<double>(q, q, v, 2.0, out, options);
  }
  for (Index h = 0; h < heads; ++h) {
    const RowMatrix<double> q = buffer.middleCols(h * d, d);
    const RowMatrix<double> v = values.middleCols(h * d, d);
    const RowMatrix<double> expected = definition(q, q, v, 2.0, Masking::causal, 0.7);
    INFO("head " << h);
    CHECK(poslsh_test::relative_max_error(RowMatrix<double>(out_buffer.middleCols(h * d, d)),
                                          expected) < 1e-12);
  }
}

TEST_CASE("causal rows ignore the future", "[reference]") {
  const Index n = 20, d = 6;
  auto q = random_matrix<double>(n, d, 4);
  auto k = random_matrix<double>(n, d, 5);
  auto v = random_matrix<double>(n, d, 6);
  const RowMatrix<double> before = poslsh::alibi_attention_reference<double>(q, k, v, 3.0);
  const Index i = 11;
  k.bottomRows(n - i - 1) = random_matrix<double>(n - i - 1, d, 7, 10.0);
  v.bottomRows(n - i - 1) = random_matrix<double>(n - i - 1, d, 8, 10.0);
  const RowMatrix<double> after = poslsh::alibi_attention_reference<double>(q, k, v, 3.0);
  CHECK(after.topRows(i + 1) == before.topRows(i + 1));
  CHECK(after.bottomRows(n - i - 1) != before.bottomRows(n - i - 1));
}

TEMPLATE_TEST_CASE("huge logits stay finite and keep only the top-scoring keys", "[reference]",
                   float, double) {
  const Index n = 8, d = 2;
  RowMatrix<TestType> q = RowMatrix<TestType>::Zero(n, d);
  RowMatrix<TestType> k = RowMatrix<TestType>::Zero(n, d);
  const auto v = random_matrix<TestType>(n, d, 3);
  q.col(0).setConstant(TestType(100));
  for (Index j = 0; j < n; ++j)
    k(j, 0) = TestType(100) * static_cast<TestType>(j % 3);  // scores up to 2e4
  AttentionOptions options;
  options.scale = 1.0;
  options.masking = Masking::bidirectional;
  const RowMatrix<TestType> out =
      poslsh::alibi_attention_reference<TestType>(q, k, v, 1.0, options);
  REQUIRE(out.allFinite());
  // Keys with j % 3 != 2 trail by 1e4 in score and get weight e^-1e4 = 0; the rest share the
  // row by their ALiBi weights alone: sum_j e^-|i-j| v_j / sum_j e^-|i-j| over j % 3 == 2.
  for (Index i = 0; i < n; ++i) {
    Eigen::RowVectorXd numerator = Eigen::RowVectorXd::Zero(d);
    double denominator = 0;
    for (Index j = 2; j < n; j += 3) {
      const double weight = std::exp(-std::abs(static_cast<double>(i - j)));
      numerator += weight * v.row(j).template cast<double>();
      denominator += weight;
    }
    INFO("row " << i);
    CHECK((out.row(i).template cast<double>() - numerator / denominator).cwiseAbs().maxCoeff() <
          1e-5);
  }
}

TEST_CASE("alibi_attention_reference: n = 0 gives an empty result", "[reference]") {
  const RowMatrix<float> empty(0, 4);
  CHECK(poslsh::alibi_attention_reference<float>(empty, empty, empty, 1.0).rows() == 0);
}

TEST_CASE("alibi_attention_reference rejects bad shapes and sigma", "[reference][invalid]") {
  require_shape_checks([](const auto& q, const auto& k, const auto& v) {
    poslsh::alibi_attention_reference<float>(q, k, v, 1.0);
  });
  const auto q = random_matrix<float>(5, 4, 1);
  require_invalid_argument([&] { poslsh::alibi_attention_reference<float>(q, q, q, -1.0); },
                           "sigma");
  RowMatrix<float> wrong(4, 4);
  require_invalid_argument([&] { poslsh::alibi_attention_reference<float>(q, q, q, 1.0, wrong); },
                           "out");
  AttentionOptions options;
  options.scale = INFINITY;
  require_invalid_argument([&] { poslsh::alibi_attention_reference<float>(q, q, q, 1.0, options); },
                           "options.scale");
}
