// Bring-your-own block kernel: the default and a user callable give the LSH estimator.
#include <cmath>
#include <poslsh/attention/fused.hpp>
#include <poslsh/interop/block_kernel.hpp>

#include "lsh_oracle.hpp"
#include "test_support.hpp"

TEMPLATE_TEST_CASE(
    "lsh_attention_by_blocks with the library's block kernel equals the fused kernel",
    "[block_kernel]", float, double) {
  const Index n = 260, d = 16;
  const auto [q, k, v] = random_qkv<TestType>(n, d, d, 101);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions options = with_masking(masking);
    const HashSet hashes = poslsh::rbf_hashes(20.0, 8, 6, 1);
    RowMatrix<TestType> out(n, d);
    poslsh::lsh_attention_by_blocks<TestType>(q, k, v, hashes, out, options);
    const RowMatrix<TestType> fused =
        poslsh::lsh_attention_fused<TestType>(q, k, v, hashes, options);
    const auto oracle =
        poslsh_test::lsh_dense_oracle(q, k, v, hashes, masking, 1.0 / std::sqrt(double(d)));
    INFO("causal " << (masking == Masking::causal));
    CHECK(poslsh_test::relative_max_error(out, fused) < poslsh_test::tolerance<TestType>());
    CHECK(poslsh_test::relative_max_error(out.template cast<double>(), oracle) <
          poslsh_test::tolerance<TestType>());
  }
}

TEST_CASE("a user block kernel is called once per block and its results are merged",
          "[block_kernel]") {
  const Index n = 90, d = 4;
  const auto [q, k, v] = random_qkv<double>(n, d, d, 111);
  const HashSet hashes = poslsh::rbf_hashes(5.0, 6, 2, 0);
  Index calls = 0, rows_seen = 0;
  // A deliberately plain kernel: dense softmax by loops, written independently here.
  auto naive = [&](poslsh::ConstMatrixRef<double> qb, poslsh::ConstMatrixRef<double> kb,
                   poslsh::ConstMatrixRef<double> vb, bool causal, double tau,
                   poslsh::MatrixRef<double> ob, Eigen::Ref<Eigen::VectorXd> lse) {
    ++calls;
    rows_seen += qb.rows();
    for (Index i = 0; i < qb.rows(); ++i) {
      const Index last = causal ? i : kb.rows() - 1;
      Eigen::VectorXd s = tau * (kb.topRows(last + 1) * qb.row(i).transpose());
      const double m = s.maxCoeff();
      const Eigen::VectorXd w = (s.array() - m).exp();
      ob.row(i) = (w.transpose() * vb.topRows(last + 1)) / w.sum();
      lse(i) = m + std::log(w.sum());
    }
  };
  RowMatrix<double> out(n, d);
  poslsh::lsh_attention_by_blocks<double>(q, k, v, hashes, out, {}, naive);
  Index expected_calls = 0;
  for (const poslsh::BinHash& h : hashes)
    expected_calls += static_cast<Index>(poslsh::block_boundaries(h, n).size()) - 1;
  CHECK(calls == expected_calls);
  CHECK(rows_seen == n * 6);
  const RowMatrix<double> fused = poslsh::lsh_attention_fused<double>(q, k, v, hashes);
  CHECK(poslsh_test::relative_max_error(out, fused) < 1e-12);
}

TEST_CASE("lsh_attention_by_blocks rejects bad arguments", "[block_kernel][invalid]") {
  const auto q = random_matrix<float>(6, 4, 1);
  RowMatrix<float> out(6, 4);
  require_invalid_argument([&] { poslsh::lsh_attention_by_blocks<float>(q, q, q, HashSet{}, out); },
                           "hashes");
  RowMatrix<float> wrong(5, 4);
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_by_blocks<float>(q, q, q, poslsh::rbf_hashes(2.0, 2, 1), wrong);
      },
      "out");
}
