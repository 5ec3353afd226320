// The mean-of-outputs estimator: forward against the dense formula (the mean of the s
// per-sample softmaxes on the sample's blocks), backward against central finite differences in
// double, determinism across thread counts and the named shape checks; as Method::mean_of_outputs
// of the method table (all heads, grouped-query heads, packed batches, queries at offsets,
// half precision), bitwise the single-head calls, and rejected by the calls with lse.
#include <poslsh/multihead/attention.hpp>
#include <poslsh/multihead/training.hpp>
#include <poslsh/reference/masks.hpp>
#include <poslsh/training/mean_of_outputs.hpp>

#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <limits>
#include <type_traits>

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
      const auto [q, k, v] = random_qkv<double>(n, 6, 5, 1);
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
      const auto [q, k, v] = random_qkv<double>(n, 6, 5, 4);
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
  const auto [q, k, v] = random_qkv<float>(n, 16, 8, 8);
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
  require_invalid_argument(
      [&] { poslsh::lsh_attention_mean_of_outputs<float>(q, k, v, hashes, bad_out); }, "out");
  require_invalid_argument(
      [&] { poslsh::lsh_attention_mean_of_outputs<float>(q, k, v, HashSet{}, dv); }, "hashes");
  // The backward on q, k, v and `hashes` with the given dout and gradients.
  const auto backward = [&](const RowMatrix<float>& g, RowMatrix<float>& gq, RowMatrix<float>& gk,
                            RowMatrix<float>& gv) {
    poslsh::lsh_attention_mean_of_outputs_backward<float>(q, k, v, hashes, g, gq, gk, gv);
  };
  require_invalid_argument([&] { backward(bad_dout, dq, dk, dv); }, "dout");
  require_invalid_argument([&] { backward(dout, bad_dq, dk, dv); }, "dq");
  require_invalid_argument([&] { backward(dout, dq, bad_dk, dv); }, "dk");
  require_invalid_argument([&] { backward(dout, dq, dk, bad_dv); }, "dv");
}

namespace {

constexpr Index mean_heads = 4, mean_kv_heads = 2, mean_dim = 8, mean_value_dim = 6;

}  // namespace

TEST_CASE("mean of outputs in the method table: every head and sequence is the single-head call",
          "[mean_estimator][multihead]") {
  // Sequences: several tiles, one token, shorter than a tile; queries: all of them, or the last
  // ones (a prefill chunk and a decode step at the end of each sequence's keys).
  const std::vector<std::int32_t> cu_k = {0, 130, 131, 200};
  const std::vector<std::int32_t> self = cu_k, tail = {0, 64, 65, 68};
  const RowMatrix<double> k = random_matrix<double>(cu_k.back(), mean_kv_heads * mean_dim, 31);
  const RowMatrix<double> v =
      random_matrix<double>(cu_k.back(), mean_kv_heads * mean_value_dim, 32);
  const RowMatrix<double> q_all = random_matrix<double>(cu_k.back(), mean_heads * mean_dim, 33);
  const std::vector<double> sigmas = {1.5, 6.0, 20.0, 300.0};
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    MultiHeadOptions options = multihead_options(Method::mean_of_outputs, masking, 5, 9);
    options.sigmas = sigmas;
    for (const auto* cu_q : {&self, &tail}) {
      // The last queries of each sequence.
      const RowMatrix<double> q = [&] {
        RowMatrix<double> rows(cu_q->back(), mean_heads * mean_dim);
        for (std::size_t b = 0; b + 1 < cu_q->size(); ++b) {
          const Index m = (*cu_q)[b + 1] - (*cu_q)[b];
          rows.middleRows((*cu_q)[b], m) = q_all.middleRows(cu_k[b + 1] - m, m);
        }
        return rows;
      }();
      RowMatrix<double> out(q.rows(), mean_heads * mean_value_dim);
      poslsh::multihead_attention_varlen<double>(
          interleaved_view(q, mean_heads), interleaved_view(k, mean_kv_heads),
          interleaved_view(v, mean_kv_heads), interleaved_view(out, mean_heads), *cu_q, cu_k,
          options);
      for (std::size_t b = 0; b + 1 < cu_q->size(); ++b) {
        const Index first = cu_k[b], n = cu_k[b + 1] - first, m = (*cu_q)[b + 1] - (*cu_q)[b];
        for (Index h = 0; h < mean_heads; ++h) {
          const Index g = h / (mean_heads / mean_kv_heads);
          const HashSet hashes = poslsh::rbf_hashes(sigmas[static_cast<std::size_t>(h)], 5, 9,
                                                    static_cast<std::uint64_t>(h));
          const RowMatrix<double> expected = poslsh::lsh_attention_mean_of_outputs<double>(
              q_all.block(first, h * mean_dim, n, mean_dim),
              k.block(first, g * mean_dim, n, mean_dim),
              v.block(first, g * mean_value_dim, n, mean_value_dim), hashes, with_masking(masking));
          INFO(poslsh_test::masking_name(masking)
               << ", sequence " << b << ", head " << h << ", queries " << m);
          CHECK(RowMatrix<double>(out.block((*cu_q)[b], h * mean_value_dim, m, mean_value_dim)) ==
                expected.bottomRows(m));
          if (n == m)  // and the dense formula
            CHECK(relative_max_error(
                      expected,
                      dense_mean_of_outputs(q_all.block(first, h * mean_dim, n, mean_dim),
                                            k.block(first, g * mean_dim, n, mean_dim),
                                            v.block(first, g * mean_value_dim, n, mean_value_dim),
                                            hashes, masking)) <= 1e-12);
        }
      }
    }
  }
}

TEST_CASE("mean of outputs in the method table: the backward of every head, half precision",
          "[mean_estimator][multihead]") {
  const std::vector<std::int32_t> cu = {0, 90, 91, 150};
  const Index n = cu.back();
  const RowMatrix<float> q = random_matrix<float>(n, mean_heads * mean_dim, 41);
  const RowMatrix<float> k = random_matrix<float>(n, mean_kv_heads * mean_dim, 42);
  const RowMatrix<float> v = random_matrix<float>(n, mean_kv_heads * mean_value_dim, 43);
  const RowMatrix<float> dout = random_matrix<float>(n, mean_heads * mean_value_dim, 44);
  // out and lse are not read: NaN.
  const RowMatrix<float> out =
      RowMatrix<float>::Constant(n, mean_heads * mean_value_dim, std::nanf(""));
  const RowMatrix<float> lse = RowMatrix<float>::Constant(mean_heads, n, std::nanf(""));
  const std::vector<double> sigmas = {2.0, 8.0, 30.0, 100.0};
  MultiHeadOptions options = multihead_options(Method::mean_of_outputs, Masking::causal, 3, 4);
  options.sigmas = sigmas;
  // The all-heads backward on inputs stored as any one type, the gradients in float.
  const auto backward = [&](const auto& qx, const auto& kx, const auto& vx, const auto& outx,
                            const auto& doutx, RowMatrix<float>& gq, RowMatrix<float>& gk,
                            RowMatrix<float>& gv) {
    using Input = typename std::decay_t<decltype(qx)>::Scalar;
    poslsh::multihead_attention_varlen_backward<Input>(
        interleaved_view(qx, mean_heads), interleaved_view(kx, mean_kv_heads),
        interleaved_view(vx, mean_kv_heads), interleaved_view(outx, mean_heads), lse,
        interleaved_view(doutx, mean_heads), cu, interleaved_view(gq, mean_heads),
        interleaved_view(gk, mean_kv_heads), interleaved_view(gv, mean_kv_heads), options);
  };
  RowMatrix<float> dq(n, mean_heads * mean_dim), dk(n, mean_kv_heads * mean_dim),
      dv(n, mean_kv_heads * mean_value_dim);
  backward(q, k, v, out, dout, dq, dk, dv);
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
    const Index first = cu[b], m = cu[b + 1] - first;
    RowMatrix<float> dk_sum(m, mean_kv_heads * mean_dim), dv_sum(m, mean_kv_heads * mean_value_dim);
    for (Index h = 0; h < mean_heads; ++h) {
      const Index g = h / (mean_heads / mean_kv_heads);
      const HashSet hashes = poslsh::rbf_hashes(sigmas[static_cast<std::size_t>(h)], 3, 4,
                                                static_cast<std::uint64_t>(h));
      RowMatrix<float> gq(m, mean_dim), gk(m, mean_dim), gv(m, mean_value_dim);
      poslsh::lsh_attention_mean_of_outputs_backward<float>(
          q.block(first, h * mean_dim, m, mean_dim), k.block(first, g * mean_dim, m, mean_dim),
          v.block(first, g * mean_value_dim, m, mean_value_dim), hashes,
          dout.block(first, h * mean_value_dim, m, mean_value_dim), gq, gk, gv);
      INFO("sequence " << b << ", head " << h);
      CHECK(RowMatrix<float>(dq.block(first, h * mean_dim, m, mean_dim)) == gq);
      // dK and dV of a group summed in increasing head order.
      if (h % 2 == 0) {
        dk_sum.middleCols(g * mean_dim, mean_dim) = gk;
        dv_sum.middleCols(g * mean_value_dim, mean_value_dim) = gv;
      } else {
        dk_sum.middleCols(g * mean_dim, mean_dim) += gk;
        dv_sum.middleCols(g * mean_value_dim, mean_value_dim) += gv;
      }
    }
    CHECK(RowMatrix<float>(dk.middleRows(first, m)) == dk_sum);
    CHECK(RowMatrix<float>(dv.middleRows(first, m)) == dv_sum);
  }
  // bfloat16 inputs: the forward rounded once from the float computation on the widened
  // inputs, the gradients the float backward's on them.
  using Half = Eigen::bfloat16;
  const RowMatrix<Half> qh = q.cast<Half>(), kh = k.cast<Half>(), vh = v.cast<Half>(),
                        douth = dout.cast<Half>(), outh = out.cast<Half>();
  const RowMatrix<float> qw = qh.cast<float>(), kw = kh.cast<float>(), vw = vh.cast<float>(),
                         doutw = douth.cast<float>();
  options.precision = poslsh::Precision::float_products;
  RowMatrix<Half> forward_half(n, mean_heads * mean_value_dim);
  RowMatrix<float> forward_wide(n, mean_heads * mean_value_dim);
  poslsh::multihead_attention_varlen<Half>(
      interleaved_view(qh, mean_heads), interleaved_view(kh, mean_kv_heads),
      interleaved_view(vh, mean_kv_heads), interleaved_view(forward_half, mean_heads), cu, cu,
      options);
  poslsh::multihead_attention_varlen<float>(
      interleaved_view(qw, mean_heads), interleaved_view(kw, mean_kv_heads),
      interleaved_view(vw, mean_kv_heads), interleaved_view(forward_wide, mean_heads), cu, cu,
      options);
  CHECK(RowMatrix<Half>(forward_wide.cast<Half>()) == forward_half);
  RowMatrix<float> dq_half(n, mean_heads * mean_dim), dk_half(n, mean_kv_heads * mean_dim),
      dv_half(n, mean_kv_heads * mean_value_dim);
  backward(qh, kh, vh, outh, douth, dq_half, dk_half, dv_half);
  backward(qw, kw, vw, out, doutw, dq, dk, dv);
  CHECK(dq_half == dq);
  CHECK(dk_half == dk);
  CHECK(dv_half == dv);
}

TEST_CASE("mean of outputs has no log-sum-exp: the calls with lse reject it by name",
          "[mean_estimator][multihead]") {
  const Index n = 20;
  const RowMatrix<float> q = random_matrix<float>(n, mean_heads * mean_dim, 51);
  RowMatrix<float> out(n, mean_heads * mean_dim), lse(mean_heads, n);
  const auto view = interleaved_view(q, mean_heads);
  const auto out_view = interleaved_view(out, mean_heads);
  MultiHeadOptions options;
  options.method = Method::mean_of_outputs;
  CHECK_FALSE(poslsh::method_has_lse(Method::mean_of_outputs));
  CHECK(poslsh::method_draws_hashes(Method::mean_of_outputs));
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_with_lse<float>(view, view, view, out_view, lse, options);
      },
      "options.method");
  const std::vector<std::int32_t> cu = {0, 5, n};
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_varlen<float>(view, view, view, out_view, lse, cu, options);
      },
      "options.method");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_varlen_with_lse<float>(view, view, view, out_view, lse, cu, cu,
                                                           options);
      },
      "options.method");
  options.samples = 0;
  require_invalid_argument(
      [&] { poslsh::multihead_attention<float>(view, view, view, out_view, options); },
      "options.samples");
  options.samples = 2;
  options.window_left = 3;
  require_invalid_argument(
      [&] { poslsh::multihead_attention<float>(view, view, view, out_view, options); },
      "options.window_left");
}
