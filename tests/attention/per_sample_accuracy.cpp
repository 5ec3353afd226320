// Float accuracy of the per-sample LSH kernel and of its gradients summed over the samples,
// against the count-weighted formula evaluated in double on the float inputs widened:
//   out_i = sum_j c_ij e^{x_ij} v_j / sum_j c_ij e^{x_ij},  x_ij = tau q_i.k_j,
//   c_ij = #{k : bin_k(i) = bin_k(j)}  (causal: j <= i),
// and the gradients of that formula for given out and lse. The float per-sample results must
// be within a small multiple of the float fused kernel's error on the same inputs, at many
// samples (s = 200) and long blocks (sigma = 1e4, up to 1000 keys), where the error of a
// running sum over the samples would grow like s. Also: 2^k copies of one hash give bitwise
// the one-hash output (the pairwise merge of equal partial results is exact), two copies
// twice the one-hash gradients, and the gradients summed over the samples are bitwise the
// same for any thread count.
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/training/backward.hpp>

#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace per_sample_accuracy {

constexpr double float_eps = std::numeric_limits<float>::epsilon();

/// c_ij = #{k : bin_k(i) = bin_k(j)} over n positions (causal: 0 for j > i).
RowMatrix<double> dense_counts(const HashSet& hashes, Index n, Masking masking) {
  RowMatrix<double> counts = RowMatrix<double>::Zero(n, n);
  std::vector<std::int64_t> bins(static_cast<std::size_t>(n));
  for (const poslsh::BinHash& hash : hashes) {
    for (Index i = 0; i < n; ++i) bins[static_cast<std::size_t>(i)] = hash.bin(i);
    for (Index i = 0; i < n; ++i)
      for (Index j = 0; j < n; ++j)
        if (bins[static_cast<std::size_t>(i)] == bins[static_cast<std::size_t>(j)])
          counts(i, j) += 1.0;
  }
  if (masking == Masking::causal) counts.triangularView<Eigen::StrictlyUpper>().setZero();
  return counts;
}

/// The count-weighted attention of the query rows `rows` of the scores x (n x n) in double.
RowMatrix<double> dense_forward(const RowMatrix<double>& x, const RowMatrix<double>& counts,
                                const RowMatrix<double>& v, Index first_row, Index rows) {
  RowMatrix<double> weights(rows, x.cols());
  for (Index r = 0; r < rows; ++r) {
    const Index i = first_row + r;
    double row_max = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < x.cols(); ++j)
      if (counts(i, j) > 0) row_max = std::max(row_max, x(i, j));
    for (Index j = 0; j < x.cols(); ++j)
      weights(r, j) = counts(i, j) > 0 ? counts(i, j) * std::exp(x(i, j) - row_max) : 0.0;
  }
  const Eigen::VectorXd sums = weights.rowwise().sum();
  return sums.cwiseInverse().asDiagonal() * weights * v;
}

/// max_i max_c |a_ic - b_ic| / max_c |b_ic|, in units of float epsilon.
double row_error(const RowMatrix<float>& a, const RowMatrix<double>& b) {
  double error = 0;
  for (Index i = 0; i < b.rows(); ++i) {
    const double scale = b.row(i).cwiseAbs().maxCoeff();
    error = std::max(error, (a.row(i).cast<double>() - b.row(i)).cwiseAbs().maxCoeff() / scale);
  }
  return error / float_eps;
}

/// max |a - b| / max |b|, in units of float epsilon.
double matrix_error(const RowMatrix<float>& a, const RowMatrix<double>& b) {
  return (a.cast<double>() - b).cwiseAbs().maxCoeff() / b.cwiseAbs().maxCoeff() / float_eps;
}

struct Gradients {
  RowMatrix<float> dq, dk, dv;
};

struct ExactGradients {
  RowMatrix<double> dq, dk, dv;
};

/// The gradients of the count-weighted formula in double for the float forward's out and lse:
/// P_ij = c_ij e^{x_ij - lse_i}, D_i = dO_i . out_i, dv = P^T dO,
/// dS_ij = P_ij (dO_i . v_j - D_i), dq = tau dS K, dk = tau dS^T Q.
ExactGradients dense_gradients(const RowMatrix<double>& x, const RowMatrix<double>& counts,
                               double tau, const RowMatrix<double>& q, const RowMatrix<double>& k,
                               const RowMatrix<double>& v, const RowMatrix<double>& out,
                               const Eigen::VectorXd& lse, const RowMatrix<double>& dout) {
  const Index n = x.rows();
  RowMatrix<double> p(n, n);
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < n; ++j)
      p(i, j) = counts(i, j) > 0 ? counts(i, j) * std::exp(x(i, j) - lse(i)) : 0.0;
  const Eigen::VectorXd delta = (dout.array() * out.array()).rowwise().sum();
  const RowMatrix<double> ds = p.array() * ((dout * v.transpose()).colwise() - delta).array();
  return {tau * ds * k, tau * ds.transpose() * q, p.transpose() * dout};
}

/// The per-sample gradients (lsh_attention_per_sample_backward) of the samples `hashes` (a
/// HashSet, or one BinHash) at the scale tau.
template <typename Samples>
Gradients per_sample_gradients(const RowMatrix<float>& q, const RowMatrix<float>& k,
                               const RowMatrix<float>& v, const Samples& hashes, float tau,
                               Masking masking, const RowMatrix<float>& out,
                               const Eigen::VectorXf& lse, const RowMatrix<float>& dout) {
  Gradients g{RowMatrix<float>(q.rows(), q.cols()), RowMatrix<float>(k.rows(), k.cols()),
              RowMatrix<float>(v.rows(), v.cols())};
  AttentionOptions options = with_masking(masking);
  options.scale = tau;
  HashSet set;
  if constexpr (std::is_same_v<Samples, HashSet>) {
    set = hashes;
  } else {
    set = {hashes};
  }
  poslsh::lsh_attention_per_sample_backward<float>(q, k, v, set, out, lse, dout, g.dq, g.dk, g.dv,
                                                   options);
  return g;
}

/// Forward (all L rows and the last row alone) and backward of the per-sample and fused float
/// kernels against the double formula, at d = d_v = 80, sigma = 1e4, s = 200 and L keys.
void check_accuracy(Index length) {
  const Index d = 80, dv = 80, s = 200;
  const HashSet hashes = poslsh::rbf_hashes(1e4, s, 7, 3);
  const auto [q, k, v] = random_qkv<float>(length, d, dv, 1);
  const RowMatrix<float> dout = random_matrix<float>(length, dv, 4);
  // A scale that float holds exactly, so that the float kernels and the double formula
  // share it.
  const auto tau = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const RowMatrix<double> qd = q.cast<double>(), kd = k.cast<double>(), vd = v.cast<double>();
  const RowMatrix<double> x = static_cast<double>(tau) * qd * kd.transpose();
  for (Masking masking : {Masking::bidirectional, Masking::causal}) {
    AttentionOptions options = with_masking(masking);
    options.scale = static_cast<double>(tau);
    const RowMatrix<double> counts = dense_counts(hashes, length, masking);
    const RowMatrix<double> expected = dense_forward(x, counts, vd, 0, length);
    INFO("L " << length << ", causal " << (masking == Masking::causal));
    {
      const double per_sample =
          row_error(poslsh::lsh_attention_per_sample<float>(q, k, v, hashes, options), expected);
      const double fused =
          row_error(poslsh::lsh_attention_fused<float>(q, k, v, hashes, options), expected);
      INFO("all rows: per-sample " << per_sample << " eps, fused " << fused << " eps");
      CHECK(per_sample <= 4 * fused + 8);
    }
    {
      const RowMatrix<float> last = q.bottomRows(1);  // at position L - 1 (the default offset)
      const RowMatrix<double> expected_last = expected.bottomRows(1);
      const double per_sample = row_error(
          poslsh::lsh_attention_per_sample<float>(last, k, v, hashes, options), expected_last);
      const double fused =
          row_error(poslsh::lsh_attention_fused<float>(last, k, v, hashes, options), expected_last);
      INFO("one query: per-sample " << per_sample << " eps, fused " << fused << " eps");
      CHECK(per_sample <= 4 * fused + 8);
    }
    RowMatrix<float> out(length, dv);
    Eigen::VectorXf lse(length);
    poslsh::lsh_attention_per_sample_with_lse<float>(q, k, v, hashes, out, lse, options);
    const ExactGradients exact =
        dense_gradients(x, counts, static_cast<double>(tau), qd, kd, vd, out.cast<double>(),
                        lse.cast<double>(), dout.cast<double>());
    const Gradients a = per_sample_gradients(q, k, v, hashes, tau, masking, out, lse, dout);
    Gradients b{RowMatrix<float>(length, d), RowMatrix<float>(length, d),
                RowMatrix<float>(length, dv)};
    poslsh::lsh_attention_fused_backward<float>(q, k, v, hashes, out, lse, dout, b.dq, b.dk, b.dv,
                                                options);
    const double errors[3][2] = {{matrix_error(a.dq, exact.dq), matrix_error(b.dq, exact.dq)},
                                 {matrix_error(a.dk, exact.dk), matrix_error(b.dk, exact.dk)},
                                 {matrix_error(a.dv, exact.dv), matrix_error(b.dv, exact.dv)}};
    const char* names[3] = {"dq", "dk", "dv"};
    for (int g = 0; g < 3; ++g) {
      INFO(names[g] << ": per-sample " << errors[g][0] << " eps, fused " << errors[g][1] << " eps");
      CHECK(errors[g][0] <= 2 * errors[g][1] + 4);
    }
  }
}

}  // namespace per_sample_accuracy

TEST_CASE("per-sample float error stays within the fused kernel's at s = 200, L <= 256",
          "[per_sample][accuracy][slow]") {
  for (Index length : {Index{64}, Index{256}}) per_sample_accuracy::check_accuracy(length);
}

TEST_CASE("per-sample float error stays within the fused kernel's at s = 200, L = 640, 1000",
          "[per_sample][accuracy][slow][long]") {
  for (Index length : {Index{640}, Index{1000}}) per_sample_accuracy::check_accuracy(length);
}

TEST_CASE("2^k copies of one hash give bitwise the one-hash per-sample output", "[per_sample]") {
  const Index n = 300, d = 16, dv = 12;
  const auto [q, k, v] = random_qkv<float>(n, d, dv, 21);
  const poslsh::BinHash hash = poslsh::rbf_hashes(40.0, 1, 5, 0).front();
  for (Masking masking : {Masking::bidirectional, Masking::causal}) {
    const AttentionOptions options = with_masking(masking);
    const RowMatrix<float> one =
        poslsh::lsh_attention_per_sample<float>(q, k, v, HashSet{hash}, options);
    for (std::size_t copies : {std::size_t{2}, std::size_t{64}, std::size_t{256}}) {
      INFO("causal " << (masking == Masking::causal) << ", copies " << copies);
      const HashSet same(copies, hash);
      CHECK(poslsh::lsh_attention_per_sample<float>(q, k, v, same, options) == one);
    }
  }
}

TEST_CASE("two copies of one hash give twice the one-hash gradients", "[per_sample]") {
  const Index n = 300, d = 16, dv = 12;
  const auto [q, k, v] = random_qkv<float>(n, d, dv, 41);
  const RowMatrix<float> dout = random_matrix<float>(n, dv, 44);
  const auto tau = static_cast<float>(0.25);
  for (double sigma : {3.0, 40.0, 1e4}) {
    const poslsh::BinHash hash = poslsh::rbf_hashes(sigma, 1, 6, 0).front();
    for (Masking masking : {Masking::bidirectional, Masking::causal}) {
      INFO("sigma " << sigma << ", causal " << (masking == Masking::causal));
      AttentionOptions options = with_masking(masking);
      options.scale = static_cast<double>(tau);
      RowMatrix<float> out(n, dv);
      Eigen::VectorXf lse(n);
      poslsh::lsh_attention_per_sample_with_lse<float>(q, k, v, HashSet{hash}, out, lse, options);
      // Each block's pass on its own rows gives the sums of the pass on the whole sequence;
      // the compensated sum of two equal terms is exact.
      const per_sample_accuracy::Gradients one =
          per_sample_accuracy::per_sample_gradients(q, k, v, hash, tau, masking, out, lse, dout);
      const per_sample_accuracy::Gradients two = per_sample_accuracy::per_sample_gradients(
          q, k, v, HashSet{hash, hash}, tau, masking, out, lse, dout);
      CHECK(two.dq == 2 * one.dq);
      CHECK(two.dk == 2 * one.dk);
      CHECK(two.dv == 2 * one.dv);
    }
  }
}

TEST_CASE("per-sample gradients summed over the samples are bitwise the same for 1 and 2 threads",
          "[per_sample][determinism]") {
#ifdef _OPENMP
  const Index n = 500, d = 16, dv = 8;
  const auto [q, k, v] = random_qkv<float>(n, d, dv, 31);
  const RowMatrix<float> dout = random_matrix<float>(n, dv, 34);
  const HashSet hashes = poslsh::rbf_hashes(24.0, 7, 9, 1);  // levels 0, 1 and 2 left
  const auto tau = static_cast<float>(0.25);
  const int restore = omp_get_max_threads();
  for (Masking masking : {Masking::bidirectional, Masking::causal}) {
    INFO("causal " << (masking == Masking::causal));
    AttentionOptions options = with_masking(masking);
    options.scale = static_cast<double>(tau);
    RowMatrix<float> out[2] = {RowMatrix<float>(n, dv), RowMatrix<float>(n, dv)};
    Eigen::VectorXf lse[2] = {Eigen::VectorXf(n), Eigen::VectorXf(n)};
    per_sample_accuracy::Gradients grads[2];
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      const auto t = static_cast<std::size_t>(threads - 1);
      poslsh::lsh_attention_per_sample_with_lse<float>(q, k, v, hashes, out[t], lse[t], options);
      grads[t] = per_sample_accuracy::per_sample_gradients(q, k, v, hashes, tau, masking, out[0],
                                                           lse[0], dout);
    }
    omp_set_num_threads(restore);
    CHECK(out[0] == out[1]);
    CHECK(lse[0] == lse[1]);
    CHECK(grads[0].dq == grads[1].dq);
    CHECK(grads[0].dk == grads[1].dk);
    CHECK(grads[0].dv == grads[1].dv);
  }
#else
  SUCCEED("built without OpenMP");
#endif
}
