// Matrix-free products with L*, M~ and E = L* - M~ against the dense matrices of
// reference/alibi_kernel.hpp and reference/masks.hpp.
#include <algorithm>
#include <array>
#include <cmath>
#include <poslsh/analysis/operators.hpp>
#include <poslsh/reference/alibi_kernel.hpp>
#include <poslsh/reference/masks.hpp>
#include <utility>
#include <vector>

#include "test_support.hpp"

using poslsh::Vector;

namespace {

template <typename Scalar>
Vector<Scalar> random_vector(Index n, std::uint64_t seed) {
  return poslsh_test::random_matrix<Scalar>(n, 1, seed).col(0);
}

/// The products of a matrix-free operator with x in Scalar: {op x, op^T x} (apply,
/// apply_transpose).
template <typename Scalar, typename Operator>
std::pair<Vector<Scalar>, Vector<Scalar>> operator_products(const Operator& op,
                                                            const Vector<Scalar>& x) {
  Vector<Scalar> y(x.size()), yt(x.size());
  op.template apply<Scalar>(x, y);
  op.template apply_transpose<Scalar>(x, yt);
  return {y, yt};
}

// max |a - b| / max(1, max |b|) for vectors.
template <typename A, typename B>
double vector_error(const A& a, const B& b) {
  return poslsh_test::relative_max_error(a.template cast<double>(), b.template cast<double>());
}

}  // namespace

TEMPLATE_TEST_CASE("AlibiKernelOperator products equal the dense kernel times x", "[analysis]",
                   float, double) {
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {0.3, 2.0, 16.0, 500.0}) {
      for (Index n : {1, 2, 7, 300}) {
        const poslsh::AlibiKernelOperator op(n, sigma, masking);
        const RowMatrix<double> dense = poslsh::alibi_kernel_dense<double>(n, sigma, masking);
        const Vector<TestType> x = random_vector<TestType>(n, 11);
        const auto [y, yt] = operator_products<TestType>(op, x);
        const Eigen::VectorXd expected = dense * x.template cast<double>();
        const Eigen::VectorXd expected_t = dense.transpose() * x.template cast<double>();
        INFO(poslsh_test::masking_name(masking) << ", sigma " << sigma << ", n " << n);
        // Both sides compute in double from the same x; they differ by the rounding of y to
        // Scalar and by r^d against exp(-d/sigma) (d roundoffs), far below tolerance * |L* x|.
        const double scale = std::max(1.0, expected.cwiseAbs().maxCoeff());
        CHECK(vector_error(y, expected) < poslsh_test::tolerance<TestType>() * scale);
        CHECK(vector_error(yt, expected_t) < poslsh_test::tolerance<TestType>() * scale);
      }
    }
  }
}

TEMPLATE_TEST_CASE("MeanMaskOperator products equal the dense mean mask times x", "[analysis]",
                   float, double) {
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {0.4, 3.0, 40.0}) {
      for (Index s : {1, 5, 64}) {
        const Index n = 257;
        const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, s, 3, 1);
        const poslsh::MeanMaskOperator op(hashes, n, masking);
        const RowMatrix<double> dense = poslsh::mean_mask_dense<double>(hashes, n, masking);
        const Vector<TestType> x = random_vector<TestType>(n, 5);
        const auto [y, yt] = operator_products<TestType>(op, x);
        INFO(poslsh_test::masking_name(masking) << ", sigma " << sigma << ", s " << s);
        CHECK(op.samples() == s);
        // Prefix sums in double cancel terms of size sum |x| ~ sqrt(n): 1e-14 absolute, so
        // the rounding of y to Scalar dominates.
        const double tolerance = poslsh_test::tolerance<TestType>();
        CHECK(vector_error(y, dense * x.template cast<double>()) < tolerance);
        CHECK(vector_error(yt, dense.transpose() * x.template cast<double>()) < tolerance);
      }
    }
  }
}

TEST_CASE("KernelErrorOperator is L* - M~ and its transpose, also in place", "[analysis]") {
  const Index n = 200;
  const double sigma = 6.0;
  const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, 9, 21, 0);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const poslsh::KernelErrorOperator op(hashes, n, sigma, masking);
    const RowMatrix<double> dense = poslsh::alibi_kernel_dense<double>(n, sigma, masking) -
                                    poslsh::mean_mask_dense<double>(hashes, n, masking);
    const Eigen::VectorXd x = random_vector<double>(n, 8);
    Eigen::VectorXd y(n);
    op.apply<double>(x, y);
    INFO(poslsh_test::masking_name(masking));
    CHECK(op.symmetric() == (masking == Masking::bidirectional));
    CHECK(vector_error(y, dense * x) < 1e-12);
    Eigen::VectorXd in_place = x;
    op.apply_transpose<double>(in_place, in_place);
    CHECK(vector_error(in_place, dense.transpose() * x) < 1e-12);
    // <E x, z> = <x, E^T z>: the transpose is the adjoint.
    const Eigen::VectorXd z = random_vector<double>(n, 9);
    Eigen::VectorXd ez(n);
    op.apply_transpose<double>(z, ez);
    CHECK(std::abs(y.dot(z) - x.dot(ez)) < 1e-12 * y.norm() * z.norm());
    // The same hashes as a std::array: the same operator, bit for bit.
    std::array<poslsh::BinHash, 9> array{};
    std::copy(hashes.begin(), hashes.end(), array.begin());
    const poslsh::KernelErrorOperator from_array(array, n, sigma, masking);
    Eigen::VectorXd y_array(n);
    from_array.apply<double>(x, y_array);
    CHECK(y_array == y);
  }
}

TEST_CASE("M~ times the ones vector counts block sizes, and one huge block is all ones",
          "[analysis]") {
  const Index n = 50;
  // One block covering [0, n): every entry of M~ is 1 (bidirectional).
  const poslsh::HashSet one_block{poslsh::BinHash{1e6, 0.0}};
  const poslsh::MeanMaskOperator op(one_block, n, Masking::bidirectional);
  Eigen::VectorXd y(n);
  op.apply<double>(Eigen::VectorXd::Ones(n), y);
  CHECK(y == Eigen::VectorXd::Constant(n, double(n)));
  // Causal: row i of the one-block mask has i + 1 ones.
  const poslsh::MeanMaskOperator causal(one_block, n, Masking::causal);
  causal.apply<double>(Eigen::VectorXd::Ones(n), y);
  for (Index i = 0; i < n; ++i) CHECK(y[i] == double(i + 1));
}

TEST_CASE("operators reject bad sizes and hash sets naming the argument", "[analysis][invalid]") {
  const poslsh::HashSet hashes = poslsh::rbf_hashes(4.0, 3, 1);
  require_invalid_argument([] { poslsh::AlibiKernelOperator(-1, 2.0, Masking::causal); }, "n");
  require_invalid_argument([] { poslsh::AlibiKernelOperator(4, 0.0, Masking::causal); }, "sigma");
  require_invalid_argument([] { poslsh::MeanMaskOperator({}, 4, Masking::causal); }, "hashes");
  require_invalid_argument(
      [] {
        poslsh::MeanMaskOperator({poslsh::BinHash{2.0, 3.0}}, 4, Masking::causal);
      },
      "hash.offset");
  const poslsh::KernelErrorOperator op(hashes, 10, 4.0, Masking::causal);
  Eigen::VectorXd right(10);
  Eigen::VectorXd wrong(9);
  require_invalid_argument([&] { op.apply<double>(wrong, right); }, "x");
  require_invalid_argument([&] { op.apply_transpose<double>(right, wrong); }, "y");
  const poslsh::AlibiKernelOperator kernel(10, 2.0, Masking::bidirectional);
  require_invalid_argument([&] { kernel.apply<double>(right, wrong); }, "y");
}
