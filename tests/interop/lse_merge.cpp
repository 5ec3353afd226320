// Log-sum-exp merging: per-sample block outputs merged by their lse equal the LSH kernels.
#include <cmath>
#include <limits>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/interop/block_kernel.hpp>
#include <poslsh/interop/lse_merge.hpp>

#include "test_support.hpp"

namespace {

// Sample k of the estimator by dense loops: for each row, plain softmax over its block (causal)
// and the natural log of the normalizer; independent of the library's kernels.
template <typename Scalar>
void dense_sample(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                  const RowMatrix<Scalar>& v, const poslsh::BinHash& hash, double tau,
                  RowMatrix<Scalar>& out, Eigen::Matrix<Scalar, Eigen::Dynamic, 1>& lse) {
  const Index n = q.rows();
  out.setZero(n, v.cols());
  lse.resize(n);
  for (Index i = 0; i < n; ++i) {
    double row_max = -INFINITY;
    for (Index j = 0; j <= i; ++j)
      if (hash.bin(j) == hash.bin(i))
        row_max = std::max(
            row_max, tau * q.row(i).template cast<double>().dot(k.row(j).template cast<double>()));
    double total = 0;
    Eigen::RowVectorXd acc = Eigen::RowVectorXd::Zero(v.cols());
    for (Index j = 0; j <= i; ++j) {
      if (hash.bin(j) != hash.bin(i)) continue;
      const double w = std::exp(
          tau * q.row(i).template cast<double>().dot(k.row(j).template cast<double>()) - row_max);
      total += w;
      acc += w * v.row(j).template cast<double>();
    }
    out.row(i) = (acc / total).cast<Scalar>();
    lse(i) = static_cast<Scalar>(row_max + std::log(total));
  }
}

}  // namespace

TEMPLATE_TEST_CASE("merging per-sample (O_k, lse_k) gives the per-sample and fused kernels",
                   "[merge]", float, double) {
  const Index n = 150, d = 8;
  const auto [q, k, v] = random_qkv<TestType>(n, d, d, 91);
  const HashSet hashes = poslsh::rbf_hashes(6.0, 12, 4, 0);
  const double tau = 1.0 / std::sqrt(double(d));
  poslsh::LseMerger<TestType> merger(n, d);
  for (const poslsh::BinHash& hash : hashes) {
    RowMatrix<TestType> sample_out;
    Eigen::Matrix<TestType, Eigen::Dynamic, 1> sample_lse;
    dense_sample(q, k, v, hash, tau, sample_out, sample_lse);
    merger.add(sample_out, sample_lse);
  }
  CHECK(merger.samples() == 12);
  RowMatrix<TestType> merged(n, d);
  merger.result(merged);
  const RowMatrix<TestType> per_sample =
      poslsh::lsh_attention_per_sample<TestType>(q, k, v, hashes);
  const RowMatrix<TestType> fused = poslsh::lsh_attention_fused<TestType>(q, k, v, hashes);
  CHECK(poslsh_test::relative_max_error(merged, per_sample) < poslsh_test::tolerance<TestType>());
  CHECK(poslsh_test::relative_max_error(merged, fused) < poslsh_test::tolerance<TestType>());
}

TEST_CASE("rows with lse = -inf take nothing from that sample, even a NaN output", "[merge]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  poslsh::LseMerger<double> merger(3, 2);
  RowMatrix<double> first(3, 2), second(3, 2);
  first << 1, 2, nan, nan, 5, 6;
  second << 3, 4, 7, 8, nan, nan;
  Eigen::Vector3d lse_first(0.0, -inf, 1e4), lse_second(std::log(3.0), 2.0, -inf);
  merger.add(first, lse_first);
  merger.add(second, lse_second);
  RowMatrix<double> out(3, 2);
  merger.result(out);
  // Row 0: weights 1 and 3; row 1: only the second sample; row 2: only the first (lse 1e4
  // stays finite through the running maximum).
  CHECK(out(0, 0) == Approx((1 * 1 + 3 * 3) / 4.0).epsilon(1e-15));
  CHECK(out(0, 1) == Approx((1 * 2 + 3 * 4) / 4.0).epsilon(1e-15));
  CHECK(out(1, 0) == 7.0);
  CHECK(out(2, 1) == 6.0);
  CHECK(merger.lse()(0) == Approx(std::log(4.0)).epsilon(1e-15));
  // A row that never had keys is 0, with lse -inf.
  poslsh::LseMerger<double> empty(1, 2);
  RowMatrix<double> nan_row(1, 2);
  nan_row << nan, nan;
  empty.add(nan_row, Eigen::VectorXd::Constant(1, -inf));
  RowMatrix<double> zero(1, 2);
  empty.result(zero);
  CHECK(zero(0, 0) == 0.0);
  CHECK(empty.lse()(0) == -inf);
}

TEST_CASE("LseMerger rejects bad shapes and lse values", "[merge][invalid]") {
  poslsh::LseMerger<float> merger(4, 3);
  const RowMatrix<float> good = RowMatrix<float>::Zero(4, 3);
  const RowMatrix<float> bad = RowMatrix<float>::Zero(4, 2);
  const Eigen::VectorXf lse = Eigen::VectorXf::Zero(4);
  require_invalid_argument([&] { merger.add(bad, lse); }, "output");
  require_invalid_argument([&] { merger.add(good, Eigen::VectorXf::Zero(3)); }, "lse");
  require_invalid_argument([&] { merger.add(good, Eigen::VectorXf::Constant(4, NAN)); }, "lse");
  require_invalid_argument([&] { merger.add(good, Eigen::VectorXf::Constant(4, INFINITY)); },
                           "lse");
  RowMatrix<float> wrong(3, 3);
  require_invalid_argument([&] { merger.result(wrong); }, "out");
  require_invalid_argument([] { poslsh::LseMerger<float>(-1, 2); }, "n");
}
