// The mean-of-outputs estimator: forward against the dense formula (the mean of the s
// per-sample softmaxes on the sample's blocks), backward against central finite differences in
// double, determinism across thread counts and the named shape checks.
#include <poslsh/reference/masks.hpp>
#include <poslsh/training/mean_of_outputs.hpp>

#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <limits>

using poslsh::AttentionOptions;
using poslsh::HashSet;
using poslsh::Index;
using poslsh::Masking;
using poslsh::RowMatrix;
using poslsh_test::random_matrix;
using poslsh_test::relative_max_error;
using poslsh_test::with_masking;

namespace {

/// (1/s) sum_k softmax over B_k(i) of tau q_i.k_j, times V: dense, O(n^2) memory.
RowMatrix<double> dense_mean_of_outputs(const RowMatrix<double>& q, const RowMatrix<double>& k,
                                        const RowMatrix<double>& v, const HashSet& hashes,
                                        Masking masking) {
  const Index n = q.rows();
  const double tau = 1.0 / std::sqrt(static_cast<double>(q.cols()));
  const RowMatrix<double> scores = tau * q * k.transpose();
  RowMatrix<double> out = RowMatrix<double>::Zero(n, v.cols());
  for (const poslsh::BinHash& hash : hashes) {
    const RowMatrix<double> mask = poslsh::bin_mask_dense<double>(hash, n, masking);
    for (Index i = 0; i < n; ++i) {
      double top = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j < n; ++j)
        if (mask(i, j) > 0) top = std::max(top, scores(i, j));
      Eigen::RowVectorXd weights = Eigen::RowVectorXd::Zero(n);
      for (Index j = 0; j < n; ++j)
        if (mask(i, j) > 0) weights(j) = std::exp(scores(i, j) - top);
      out.row(i) += weights * v / weights.sum();
    }
  }
  return out / static_cast<double>(hashes.size());
}

}  // namespace

TEST_CASE("mean of outputs matches the dense formula", "[mean_estimator]") {
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (Index n : {Index{1}, Index{70}, Index{130}}) {
      const RowMatrix<double> q = random_matrix<double>(n, 6, 1);
      const RowMatrix<double> k = random_matrix<double>(n, 6, 2);
      const RowMatrix<double> v = random_matrix<double>(n, 5, 3);
      for (double sigma : {0.5, 16.0, 1e4}) {
        for (Index s : {Index{1}, Index{3}, Index{16}}) {
          INFO("n " << n << ", sigma " << sigma << ", s " << s);
          const HashSet hashes = poslsh::rbf_hashes(sigma, s, 11, 0);
          const RowMatrix<double> out =
              poslsh::lsh_attention_mean_of_outputs<double>(q, k, v, hashes, with_masking(masking));
          CHECK(relative_max_error(out, dense_mean_of_outputs(q, k, v, hashes, masking)) <= 1e-12);
        }
      }
    }
  }
}

TEST_CASE("mean of outputs backward matches central finite differences in double",
          "[mean_estimator]") {
  const double h = 1e-5;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (Index n : {Index{1}, Index{70}, Index{130}}) {
      const RowMatrix<double> q = random_matrix<double>(n, 6, 4);
      const RowMatrix<double> k = random_matrix<double>(n, 6, 5);
      const RowMatrix<double> v = random_matrix<double>(n, 5, 6);
      const RowMatrix<double> dout = random_matrix<double>(n, 5, 7);
      for (double sigma : {0.5, 16.0, 1e4}) {
        for (Index s : {Index{1}, Index{3}, Index{16}}) {
          const HashSet hashes = poslsh::rbf_hashes(sigma, s, 13, 0);
          const AttentionOptions options = with_masking(masking);
          RowMatrix<double> grads[3] = {RowMatrix<double>(n, 6), RowMatrix<double>(n, 6),
                                        RowMatrix<double>(n, 5)};
          poslsh::lsh_attention_mean_of_outputs_backward<double>(q, k, v, hashes, dout, grads[0],
                                                                 grads[1], grads[2], options);
          const auto loss = [&](const RowMatrix<double>& a, const RowMatrix<double>& b,
                                const RowMatrix<double>& c) {
            return (poslsh::lsh_attention_mean_of_outputs<double>(a, b, c, hashes, options)
                        .array() *
                    dout.array())
                .sum();
          };
          for (int which = 0; which < 3; ++which) {
            INFO("n " << n << ", sigma " << sigma << ", s " << s << ", input " << which);
            const RowMatrix<double> direction = random_matrix<double>(
                grads[which].rows(), grads[which].cols(), static_cast<std::uint64_t>(20 + which));
            RowMatrix<double> plus[3] = {q, k, v}, minus[3] = {q, k, v};
            plus[which] += h * direction;
            minus[which] -= h * direction;
            const double numeric =
                (loss(plus[0], plus[1], plus[2]) - loss(minus[0], minus[1], minus[2])) / (2 * h);
            const double analytic = (grads[which].array() * direction.array()).sum();
            const double scale =
                std::max({std::abs(analytic), 1e-2 * grads[which].norm() * direction.norm(), 1e-9});
            CHECK(std::abs(numeric - analytic) / scale <= 1e-6);
          }
        }
      }
    }
  }
}

TEST_CASE("mean of outputs is bitwise the same for 1 and 2 threads", "[mean_estimator]") {
#ifdef _OPENMP
  const Index n = 500;
  const RowMatrix<float> q = random_matrix<float>(n, 16, 8);
  const RowMatrix<float> k = random_matrix<float>(n, 16, 9);
  const RowMatrix<float> v = random_matrix<float>(n, 8, 10);
  const RowMatrix<float> dout = random_matrix<float>(n, 8, 11);
  const HashSet hashes = poslsh::rbf_hashes(32.0, 4, 3, 0);
  const int restore = omp_get_max_threads();
  RowMatrix<float> out[2], dq[2], dk[2], dv[2];
  for (int t = 0; t < 2; ++t) {
    omp_set_num_threads(t + 1);
    out[t] = poslsh::lsh_attention_mean_of_outputs<float>(q, k, v, hashes);
    dq[t].resize(n, 16);
    dk[t].resize(n, 16);
    dv[t].resize(n, 8);
    poslsh::lsh_attention_mean_of_outputs_backward<float>(q, k, v, hashes, dout, dq[t], dk[t],
                                                          dv[t]);
  }
  omp_set_num_threads(restore);
  CHECK(out[0] == out[1]);
  CHECK(dq[0] == dq[1]);
  CHECK(dk[0] == dk[1]);
  CHECK(dv[0] == dv[1]);
#else
  WARN("built without OpenMP: nothing to compare");
#endif
}

TEST_CASE("mean of outputs: bad shapes throw naming the argument", "[mean_estimator]") {
  const Index n = 10;
  const RowMatrix<float> q = random_matrix<float>(n, 4, 1), k = random_matrix<float>(n, 4, 2),
                         v = random_matrix<float>(n, 3, 3), dout = random_matrix<float>(n, 3, 4);
  const HashSet hashes = poslsh::rbf_hashes(4.0, 2, 1);
  RowMatrix<float> dq(n, 4), dk(n, 4), dv(n, 3), bad_out(n, 4), bad_dout(n, 2), bad_dq(n + 1, 4),
      bad_dk(n, 5), bad_dv(n, 4);
  using poslsh_test::require_invalid_argument;
  require_invalid_argument(
      [&] { poslsh::lsh_attention_mean_of_outputs<float>(q, k, v, hashes, bad_out); }, "out");
  require_invalid_argument(
      [&] { poslsh::lsh_attention_mean_of_outputs<float>(q, k, v, HashSet{}, dv); }, "hashes");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_mean_of_outputs_backward<float>(q, k, v, hashes, bad_dout, dq, dk,
                                                              dv);
      },
      "dout");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_mean_of_outputs_backward<float>(q, k, v, hashes, dout, bad_dq, dk,
                                                              dv);
      },
      "dq");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_mean_of_outputs_backward<float>(q, k, v, hashes, dout, dq, bad_dk,
                                                              dv);
      },
      "dk");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_mean_of_outputs_backward<float>(q, k, v, hashes, dout, dq, dk,
                                                              bad_dv);
      },
      "dv");
}
