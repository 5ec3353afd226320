// Local windows (FlashAttention's window_size) and the gradients in the ALiBi slopes of the
// all-heads exact calls: against a dense computation of the same attention and its gradient,
// central differences of the loss in the slope, determinism across thread counts, gradients in
// q, k, v unchanged by asking for the slopes', packed batches, and the named errors; the varlen
// forward with lse at query offsets (FlashAttention's varlen call with softmax_lse).
#include <poslsh/multihead/training.hpp>

#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

/// The dense attention of one head and its gradient in the slope, from the definition:
/// x_ij = tau q_i.k_j - slope |i - j| over the keys j kept for row i (causal j <= i, the band
/// |i - j| <= band when band >= 0, the window i - left <= j <= i + right), P = softmax_j x,
/// out = P V, and for a loss with dL/dout = G: dP_ij = G_i.v_j, D_i = sum_j P_ij dP_ij,
/// dL/dslope = -sum_ij P_ij (dP_ij - D_i) |i - j|.
struct DenseHead {
  RowMatrix<double> out;
  double dslope = 0.0;
};

DenseHead dense_head(const RowMatrix<double>& q, const RowMatrix<double>& k,
                     const RowMatrix<double>& v, const RowMatrix<double>& g, double slope,
                     double tau, Masking masking, Index band, Index left, Index right) {
  const Index n = q.rows();
  DenseHead result{RowMatrix<double>::Zero(n, v.cols()), 0.0};
  for (Index i = 0; i < n; ++i) {
    std::vector<double> x(static_cast<std::size_t>(n), -INFINITY);
    double top = -INFINITY;
    for (Index j = 0; j < n; ++j) {
      const bool kept = (masking == Masking::bidirectional || j <= i) &&
                        (band < 0 || std::abs(i - j) <= band) && (left < 0 || j >= i - left) &&
                        (right < 0 || j <= i + right);
      if (!kept) continue;
      x[static_cast<std::size_t>(j)] =
          tau * q.row(i).dot(k.row(j)) - slope * static_cast<double>(std::abs(i - j));
      top = std::max(top, x[static_cast<std::size_t>(j)]);
    }
    double total = 0.0;
    std::vector<double> p(static_cast<std::size_t>(n), 0.0);
    for (Index j = 0; j < n; ++j) {
      const auto u = static_cast<std::size_t>(j);
      if (x[u] == -INFINITY) continue;
      p[u] = std::exp(x[u] - top);
      total += p[u];
    }
    double delta = 0.0;
    for (Index j = 0; j < n; ++j) {
      const auto u = static_cast<std::size_t>(j);
      p[u] /= total;
      result.out.row(i) += p[u] * v.row(j);
      delta += p[u] * g.row(i).dot(v.row(j));
    }
    for (Index j = 0; j < n; ++j) {
      const auto u = static_cast<std::size_t>(j);
      result.dslope -=
          p[u] * (g.row(i).dot(v.row(j)) - delta) * static_cast<double>(std::abs(i - j));
    }
  }
  return result;
}

/// The columns of head h of an [n, H, d] buffer.
RowMatrix<double> head_of(const RowMatrix<double>& buffer, Index h, Index d) {
  return buffer.middleCols(h * d, d);
}

/// One all-heads exact call in Scalar: forward with lse, then the backward with dslopes.
template <typename Scalar>
struct ExactCall {
  RowMatrix<Scalar> out, lse, dq, dk, dv;
  Eigen::VectorXd dslopes;
};

template <typename Scalar>
ExactCall<Scalar> exact_call(const RowMatrix<Scalar>& qb, const RowMatrix<Scalar>& kb,
                             const RowMatrix<Scalar>& vb, const RowMatrix<Scalar>& gb, Index heads,
                             Index kv_heads, Index d, const poslsh::MultiHeadOptions& options,
                             bool with_slopes = true) {
  const Index n = qb.rows();
  const auto q = poslsh::interleaved_heads<const Scalar>(qb.data(), n, heads, d);
  const auto k = poslsh::interleaved_heads<const Scalar>(kb.data(), n, kv_heads, d);
  const auto v = poslsh::interleaved_heads<const Scalar>(vb.data(), n, kv_heads, d);
  const auto g = poslsh::interleaved_heads<const Scalar>(gb.data(), n, heads, d);
  ExactCall<Scalar> c{RowMatrix<Scalar>(n, heads * d),    RowMatrix<Scalar>(heads, n),
                      RowMatrix<Scalar>(n, heads * d),    RowMatrix<Scalar>(n, kv_heads * d),
                      RowMatrix<Scalar>(n, kv_heads * d), Eigen::VectorXd::Zero(heads)};
  poslsh::multihead_attention_with_lse<Scalar>(
      q, k, v, poslsh::interleaved_heads<Scalar>(c.out.data(), n, heads, d), c.lse, options);
  const auto o = poslsh::interleaved_heads<const Scalar>(c.out.data(), n, heads, d);
  const auto dq = poslsh::interleaved_heads<Scalar>(c.dq.data(), n, heads, d);
  const auto dk = poslsh::interleaved_heads<Scalar>(c.dk.data(), n, kv_heads, d);
  const auto dv = poslsh::interleaved_heads<Scalar>(c.dv.data(), n, kv_heads, d);
  if (with_slopes) {
    poslsh::multihead_attention_backward<Scalar>(q, k, v, o, c.lse, g, dq, dk, dv, c.dslopes,
                                                 options);
  } else {
    poslsh::multihead_attention_backward<Scalar>(q, k, v, o, c.lse, g, dq, dk, dv, options);
  }
  return c;
}

/// sum(out o G) of the exact call in double with slopes `slopes` (sigma = 1 / slope).
double exact_loss(const RowMatrix<double>& qb, const RowMatrix<double>& kb,
                  const RowMatrix<double>& vb, const RowMatrix<double>& gb, Index heads,
                  Index kv_heads, poslsh::MultiHeadOptions options,
                  const std::vector<double>& slopes) {
  options.sigmas.clear();
  for (double slope : slopes) options.sigmas.push_back(1.0 / slope);
  return multihead_of(qb, kb, vb, heads, kv_heads, options).cwiseProduct(gb).sum();
}

}  // namespace

TEST_CASE("exact windows and slope gradients match the dense attention",
          "[backward][slopes][window]") {
  const Index n = 150, heads = 4, kv_heads = 2, d = 8;
  const RowMatrix<double> qb = random_matrix<double>(n, heads * d, 301);
  const RowMatrix<double> kb = random_matrix<double>(n, kv_heads * d, 302);
  const RowMatrix<double> vb = random_matrix<double>(n, kv_heads * d, 303);
  const RowMatrix<double> gb = random_matrix<double>(n, heads * d, 304);
  const std::vector<double> slopes = {0.5, 0.0625, 0.01, 0.0};
  struct Case {
    Method method;
    Masking masking;
    Index left, right;
  };
  const Case cases[] = {{Method::exact_tiled, Masking::causal, -1, -1},
                        {Method::exact_tiled, Masking::bidirectional, -1, -1},
                        {Method::exact_tiled, Masking::causal, 37, -1},
                        {Method::exact_tiled, Masking::bidirectional, 70, 5},
                        {Method::exact_tiled, Masking::bidirectional, -1, 0},
                        {Method::exact_banded, Masking::bidirectional, -1, -1},
                        {Method::exact_banded, Masking::causal, 20, -1},
                        {Method::exact_banded, Masking::bidirectional, 3, 90}};
  for (const Case& c : cases) {
    INFO(poslsh::enum_name(c.method)
         << " " << poslsh::enum_name(c.masking) << " window " << c.left << ", " << c.right);
    poslsh::MultiHeadOptions options;
    options.method = c.method;
    options.masking = c.masking;
    options.band_error = 0.2;  // bands of a few to 160 keys
    options.window_left = c.left;
    options.window_right = c.right;
    for (double slope : slopes)
      options.sigmas.push_back(slope == 0.0 ? 1e300 : 1.0 / slope);  // slope 0: no bias
    const ExactCall<double> call = exact_call<double>(qb, kb, vb, gb, heads, kv_heads, d, options);
    const double tau = 1.0 / std::sqrt(static_cast<double>(d));
    for (Index h = 0; h < heads; ++h) {
      const double sigma = options.sigmas[static_cast<std::size_t>(h)];
      const Index band =
          c.method == Method::exact_banded ? poslsh::band_for_bias_error(sigma, 0.2) : -1;
      const DenseHead dense = dense_head(
          head_of(qb, h, d), head_of(kb, h / 2, d), head_of(vb, h / 2, d), head_of(gb, h, d),
          slopes[static_cast<std::size_t>(h)], tau, c.masking, band, c.left, c.right);
      CHECK(poslsh_test::relative_max_error(head_of(call.out, h, d), dense.out) < 1e-12);
      CHECK(std::abs(call.dslopes(h) - dense.dslope) <= 1e-10 * (1.0 + std::abs(dense.dslope)));
    }
    // Central differences of the loss in each slope (the window and band held fixed).
    if (c.method == Method::exact_tiled) {
      for (Index h = 0; h + 1 < heads; ++h) {
        const double eps = 1e-6 * slopes[static_cast<std::size_t>(h)];
        std::vector<double> up = slopes, down = slopes;
        up[static_cast<std::size_t>(h)] += eps;
        down[static_cast<std::size_t>(h)] -= eps;
        up.back() = down.back() = 1e-300;  // the slope-0 head: sigma finite for the loss calls
        const double difference = (exact_loss(qb, kb, vb, gb, heads, kv_heads, options, up) -
                                   exact_loss(qb, kb, vb, gb, heads, kv_heads, options, down)) /
                                  (2.0 * eps);
        CHECK(std::abs(difference - call.dslopes(h)) <= 1e-5 * (1.0 + std::abs(call.dslopes(h))));
      }
    }
  }
}

TEST_CASE(
    "slope gradients leave dq, dk, dv unchanged and are bitwise the same for any thread "
    "count",
    "[backward][slopes][determinism]") {
  const Index n = 700, heads = 2, d = 16;
  const RowMatrix<float> qb = random_matrix<float>(n, heads * d, 311);
  const RowMatrix<float> kb = random_matrix<float>(n, heads * d, 312);
  const RowMatrix<float> vb = random_matrix<float>(n, heads * d, 313);
  const RowMatrix<float> gb = random_matrix<float>(n, heads * d, 314);
  for (Method method : {Method::exact_tiled, Method::exact_banded}) {
    INFO(poslsh::enum_name(method));
    poslsh::MultiHeadOptions options;
    options.method = method;
    options.sigmas = {8.0, 300.0};
    options.masking = Masking::bidirectional;
    options.window_left = 500;
    const ExactCall<float> plain =
        exact_call<float>(qb, kb, vb, gb, heads, heads, d, options, false);
    const ExactCall<float> with = exact_call<float>(qb, kb, vb, gb, heads, heads, d, options);
    CHECK(plain.dq == with.dq);
    CHECK(plain.dk == with.dk);
    CHECK(plain.dv == with.dv);
#ifdef _OPENMP
    const int restore = omp_get_max_threads();
    omp_set_num_threads(1);
    const ExactCall<float> one = exact_call<float>(qb, kb, vb, gb, heads, heads, d, options);
    omp_set_num_threads(2);
    const ExactCall<float> two = exact_call<float>(qb, kb, vb, gb, heads, heads, d, options);
    omp_set_num_threads(restore);
    CHECK(one.dslopes == two.dslopes);
    CHECK(one.dq == two.dq);
#endif
    // float against double: the same sums to float rounding.
    const ExactCall<double> wide =
        exact_call<double>(qb.cast<double>(), kb.cast<double>(), vb.cast<double>(),
                           gb.cast<double>(), heads, heads, d, options);
    for (Index h = 0; h < heads; ++h)
      CHECK(std::abs(with.dslopes(h) - wide.dslopes(h)) <=
            1e-3 * (1.0 + std::abs(wide.dslopes(h))));
  }
}

TEST_CASE("packed batches sum the slope gradients of their sequences",
          "[backward][slopes][varlen]") {
  const Index heads = 2, d = 8;
  const std::vector<std::int32_t> cu = {0, 37, 37, 38, 130};
  const Index n = cu.back();
  const RowMatrix<double> qb = random_matrix<double>(n, heads * d, 321);
  const RowMatrix<double> kb = random_matrix<double>(n, heads * d, 322);
  const RowMatrix<double> vb = random_matrix<double>(n, heads * d, 323);
  const RowMatrix<double> gb = random_matrix<double>(n, heads * d, 324);
  poslsh::MultiHeadOptions options;
  options.method = Method::exact_tiled;
  options.sigmas = {3.0, 40.0};
  const auto view = [&](const RowMatrix<double>& m) {
    return poslsh::interleaved_heads<const double>(m.data(), n, heads, d);
  };
  RowMatrix<double> out(n, heads * d), lse(heads, n), dq(n, heads * d), dk(n, heads * d),
      dv(n, heads * d);
  poslsh::multihead_attention_varlen<double>(
      view(qb), view(kb), view(vb), poslsh::interleaved_heads<double>(out.data(), n, heads, d), lse,
      cu, options);
  Eigen::VectorXd dslopes(heads);
  poslsh::multihead_attention_varlen_backward<double>(
      view(qb), view(kb), view(vb), view(out), lse, view(gb), cu,
      poslsh::interleaved_heads<double>(dq.data(), n, heads, d),
      poslsh::interleaved_heads<double>(dk.data(), n, heads, d),
      poslsh::interleaved_heads<double>(dv.data(), n, heads, d), dslopes, options);
  Eigen::VectorXd expected = Eigen::VectorXd::Zero(heads);
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
    const Index begin = cu[b], length = cu[b + 1] - cu[b];
    if (length == 0) continue;
    const ExactCall<double> one = exact_call<double>(
        qb.middleRows(begin, length), kb.middleRows(begin, length), vb.middleRows(begin, length),
        gb.middleRows(begin, length), heads, heads, d, options);
    expected += one.dslopes;
  }
  CHECK(dslopes == expected);
}

TEST_CASE("windows and slope gradients reject what they cannot do, by name", "[slopes][errors]") {
  const Index n = 20, d = 4;
  const RowMatrix<float> x = random_matrix<float>(n, d, 331);
  const auto view = poslsh::interleaved_heads<const float>(x.data(), n, 1, d);
  RowMatrix<float> out(n, d), lse(1, n), dq(n, d), dk(n, d), dv(n, d);
  const auto out_view = poslsh::interleaved_heads<float>(out.data(), n, 1, d);
  poslsh::MultiHeadOptions options;
  options.sigmas = {4.0};
  options.method = Method::lsh_fused;
  options.window_left = 3;
  poslsh_test::require_invalid_argument(
      [&] { poslsh::multihead_attention<float>(view, view, view, out_view, options); },
      "options.window_left");
  options.method = Method::exact_tiled;
  options.window_left = -2;
  poslsh_test::require_invalid_argument(
      [&] { poslsh::multihead_attention<float>(view, view, view, out_view, options); },
      "options.window_left");
  options.window_left = -1;
  options.window_right = -5;
  poslsh_test::require_invalid_argument(
      [&] { poslsh::multihead_attention<float>(view, view, view, out_view, options); },
      "options.window_right");
  options.window_right = -1;
  Eigen::VectorXd dslopes(1), wrong(2);
  const auto gradients = [&](Eigen::VectorXd& target) {
    poslsh::multihead_attention_backward<float>(
        view, view, view, poslsh::interleaved_heads<const float>(out.data(), n, 1, d), lse, view,
        poslsh::interleaved_heads<float>(dq.data(), n, 1, d),
        poslsh::interleaved_heads<float>(dk.data(), n, 1, d),
        poslsh::interleaved_heads<float>(dv.data(), n, 1, d), target, options);
  };
  poslsh::multihead_attention_with_lse<float>(view, view, view, out_view, lse, options);
  poslsh_test::require_invalid_argument([&] { gradients(wrong); }, "dslopes");
  options.method = Method::lsh_fused;
  poslsh::multihead_attention_with_lse<float>(view, view, view, out_view, lse, options);
  poslsh_test::require_invalid_argument([&] { gradients(dslopes); }, "dslopes");
}

TEST_CASE("the varlen forward with lse at query offsets equals the rows of self-attention",
          "[varlen][lse]") {
  // Sequence b: L_b keys, its last m_b tokens as queries (bottom-right), against the
  // self-attention call with lse on all L_b tokens (row p0 + r is bitwise the same row).
  const Index heads = 4, kv_heads = 2, d = 8;
  const std::vector<std::int32_t> cu_k = {0, 90, 90, 91, 200};
  const std::vector<std::int32_t> cu_q = {0, 3, 3, 4, 74};
  const RowMatrix<float> kb = random_matrix<float>(cu_k.back(), kv_heads * d, 341);
  const RowMatrix<float> vb = random_matrix<float>(cu_k.back(), kv_heads * d, 342);
  const RowMatrix<float> full_q = random_matrix<float>(cu_k.back(), heads * d, 343);
  RowMatrix<float> qb(cu_q.back(), heads * d);
  for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const Index m = cu_q[b + 1] - cu_q[b];
    qb.middleRows(cu_q[b], m) = full_q.middleRows(cu_k[b + 1] - m, m);
  }
  for (Method method : {Method::exact_tiled, Method::lsh_fused, Method::lsh_per_sample}) {
    INFO(poslsh::enum_name(method));
    poslsh::MultiHeadOptions options;
    options.method = method;
    options.samples = 4;
    const Index total_q = cu_q.back(), total_k = cu_k.back();
    const auto q = poslsh::interleaved_heads<const float>(qb.data(), total_q, heads, d);
    const auto k = poslsh::interleaved_heads<const float>(kb.data(), total_k, kv_heads, d);
    const auto v = poslsh::interleaved_heads<const float>(vb.data(), total_k, kv_heads, d);
    RowMatrix<float> out(total_q, heads * d), plain(total_q, heads * d), lse(heads, total_q);
    poslsh::multihead_attention_varlen_with_lse<float>(
        q, k, v, poslsh::interleaved_heads<float>(out.data(), total_q, heads, d), lse, cu_q, cu_k,
        options);
    poslsh::multihead_attention_varlen<float>(
        q, k, v, poslsh::interleaved_heads<float>(plain.data(), total_q, heads, d), cu_q, cu_k,
        options);
    CHECK(out == plain);
    for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
      const Index m = cu_q[b + 1] - cu_q[b], L = cu_k[b + 1] - cu_k[b];
      if (L == 0) continue;
      RowMatrix<float> self_out(L, heads * d), self_lse(heads, L);
      poslsh::multihead_attention_with_lse<float>(
          poslsh::interleaved_heads<const float>(full_q.data() + cu_k[b] * heads * d, L, heads, d),
          poslsh::interleaved_heads<const float>(kb.data() + cu_k[b] * kv_heads * d, L, kv_heads,
                                                 d),
          poslsh::interleaved_heads<const float>(vb.data() + cu_k[b] * kv_heads * d, L, kv_heads,
                                                 d),
          poslsh::interleaved_heads<float>(self_out.data(), L, heads, d), self_lse, options);
      CHECK(lse.middleCols(cu_q[b], m) == self_lse.rightCols(m));
      CHECK(out.middleRows(cu_q[b], m) == self_out.bottomRows(m));
    }
  }
  RowMatrix<float> small_lse(heads, 3);
  RowMatrix<float> out(cu_q.back(), heads * d);
  poslsh_test::require_invalid_argument(
      [&] {
        poslsh::multihead_attention_varlen_with_lse<float>(
            poslsh::interleaved_heads<const float>(qb.data(), cu_q.back(), heads, d),
            poslsh::interleaved_heads<const float>(kb.data(), cu_k.back(), kv_heads, d),
            poslsh::interleaved_heads<const float>(vb.data(), cu_k.back(), kv_heads, d),
            poslsh::interleaved_heads<float>(out.data(), cu_q.back(), heads, d), small_lse, cu_q,
            cu_k);
      },
      "lse");
}
