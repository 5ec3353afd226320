// The packed-batch slice backward (multihead_attention_varlen_slice_backward): sequences with
// fewer and more queries than keys, against the dense gradients of each sequence in double.
#include <cmath>
#include <cstdint>
#include <limits>
#include <poslsh/parallel/slice.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_support.hpp"

using poslsh::Index;
using poslsh::Masking;
using poslsh::Method;
using poslsh::MultiHeadOptions;
using poslsh::RowMatrix;

namespace {

constexpr Index varlen_heads = 4, varlen_d = 8, varlen_dv = 6;

/// Dense gradients of one sequence in double, every head (H query heads over kv K/V heads,
/// [tokens, heads * dim] matrices): query i at position i + L - m, key j at position j
/// (FlashAttention's bottom-right alignment), x_ij = tau q_i.k_j - |i + L - m - j| / sigma_h,
/// causal keeping j <= i + L - m; a row without keys has P = 0. Adds into dq, dk, dv and
/// dslopes (dL/dslope_h = -sum_ij dS_ij |i + L - m - j|).
void dense_sequence_gradients(const RowMatrix<double>& q, const RowMatrix<double>& k,
                              const RowMatrix<double>& v, const RowMatrix<double>& dout,
                              const std::vector<double>& sigmas, double tau, bool causal,
                              Index kv_heads, RowMatrix<double>& dq, RowMatrix<double>& dk,
                              RowMatrix<double>& dv, std::vector<double>& dslopes) {
  const Index m = q.rows(), L = k.rows(), group = varlen_heads / kv_heads;
  for (Index h = 0; h < varlen_heads; ++h) {
    const Index g = h / group;
    const auto qh = q.middleCols(h * varlen_d, varlen_d);
    const auto kh = k.middleCols(g * varlen_d, varlen_d);
    const auto vh = v.middleCols(g * varlen_dv, varlen_dv);
    const auto doh = dout.middleCols(h * varlen_dv, varlen_dv);
    RowMatrix<double> p = RowMatrix<double>::Zero(m, L), distance(m, L);
    for (Index i = 0; i < m; ++i) {
      double top = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j < L; ++j) {
        distance(i, j) = static_cast<double>(std::abs(i + L - m - j));
        const bool kept = !causal || j <= i + L - m;
        p(i, j) = kept ? tau * qh.row(i).dot(kh.row(j)) - distance(i, j) / sigmas[h]
                       : -std::numeric_limits<double>::infinity();
        top = std::max(top, p(i, j));
      }
      if (top == -std::numeric_limits<double>::infinity()) {
        p.row(i).setZero();
        continue;
      }
      p.row(i) = (p.row(i).array() - top).exp().matrix();
      p.row(i) /= p.row(i).sum();
    }
    const RowMatrix<double> out = p * vh;
    const Eigen::VectorXd delta = (doh.array() * out.array()).rowwise().sum().matrix();
    const RowMatrix<double> ds = p.array() * ((doh * vh.transpose()).colwise() - delta).array();
    dq.middleCols(h * varlen_d, varlen_d) += tau * ds * kh;
    dk.middleCols(g * varlen_d, varlen_d) += tau * ds.transpose() * qh;
    dv.middleCols(g * varlen_dv, varlen_dv) += p.transpose() * doh;
    dslopes[static_cast<std::size_t>(h)] -= (ds.array() * distance.array()).sum();
  }
}

}  // namespace

TEMPLATE_TEST_CASE("the packed-batch slice backward equals the dense gradients of each sequence",
                   "[context_parallel][varlen]", float, double) {
  using Scalar = TestType;
  // (queries, keys) per sequence: fewer, as many, none, more, and fewer again.
  const std::vector<std::pair<Index, Index>> shapes = {
      {40, 130}, {70, 70}, {0, 20}, {90, 50}, {3, 77}};
  std::vector<std::int32_t> cu_q = {0}, cu_k = {0};
  for (const auto& [m, L] : shapes) {
    cu_q.push_back(cu_q.back() + static_cast<std::int32_t>(m));
    cu_k.push_back(cu_k.back() + static_cast<std::int32_t>(L));
  }
  const Index total_q = cu_q.back(), total_k = cu_k.back();
  for (const Index kv_heads : {Index{2}, varlen_heads}) {
    for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
      {
        const Method method = Method::exact_tiled;  // exact_banded: the same pass on its band
        INFO("kv_heads " << kv_heads << ", " << poslsh_test::masking_name(masking) << ", "
                         << poslsh::enum_name(method));
        const RowMatrix<Scalar> q =
            poslsh_test::random_matrix<Scalar>(total_q, varlen_heads * varlen_d, 301);
        const RowMatrix<Scalar> k =
            poslsh_test::random_matrix<Scalar>(total_k, kv_heads * varlen_d, 302);
        const RowMatrix<Scalar> v =
            poslsh_test::random_matrix<Scalar>(total_k, kv_heads * varlen_dv, 303);
        const RowMatrix<Scalar> dout =
            poslsh_test::random_matrix<Scalar>(total_q, varlen_heads * varlen_dv, 304);
        MultiHeadOptions options;
        options.method = method;
        options.masking = masking;
        options.sigmas = {0.6, 4.0, 30.0, 1e4};
        const auto view = [](const RowMatrix<Scalar>& x, Index heads, Index dim) {
          return poslsh::interleaved_heads<const Scalar>(x.data(), x.rows(), heads, dim);
        };
        RowMatrix<Scalar> out(total_q, varlen_heads * varlen_dv);
        RowMatrix<Scalar> lse(varlen_heads, total_q);
        poslsh::multihead_attention_varlen_with_lse<Scalar>(
            view(q, varlen_heads, varlen_d), view(k, kv_heads, varlen_d),
            view(v, kv_heads, varlen_dv),
            poslsh::interleaved_heads<Scalar>(out.data(), total_q, varlen_heads, varlen_dv), lse,
            cu_q, cu_k, options);
        RowMatrix<Scalar> dq(total_q, varlen_heads * varlen_d), dk(total_k, kv_heads * varlen_d),
            dv(total_k, kv_heads * varlen_dv);
        dq.setConstant(Scalar(7));  // written, not added to
        Eigen::VectorXd dslopes_out = Eigen::VectorXd::Constant(varlen_heads, 5.0);
        Eigen::Ref<Eigen::VectorXd> dslopes(dslopes_out);
        poslsh::multihead_attention_varlen_slice_backward<Scalar>(
            view(q, varlen_heads, varlen_d), view(k, kv_heads, varlen_d),
            view(v, kv_heads, varlen_dv), view(out, varlen_heads, varlen_dv), lse,
            view(dout, varlen_heads, varlen_dv), cu_q, cu_k,
            poslsh::interleaved_heads<Scalar>(dq.data(), total_q, varlen_heads, varlen_d),
            poslsh::interleaved_heads<Scalar>(dk.data(), total_k, kv_heads, varlen_d),
            poslsh::interleaved_heads<Scalar>(dv.data(), total_k, kv_heads, varlen_dv), options,
            &dslopes);

        RowMatrix<double> dq_want = RowMatrix<double>::Zero(dq.rows(), dq.cols());
        RowMatrix<double> dk_want = RowMatrix<double>::Zero(dk.rows(), dk.cols());
        RowMatrix<double> dv_want = RowMatrix<double>::Zero(dv.rows(), dv.cols());
        std::vector<double> dslopes_want(varlen_heads, 0.0);
        const double tau = 1.0 / std::sqrt(static_cast<double>(varlen_d));
        for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
          const Index q0 = cu_q[b], m = cu_q[b + 1] - q0, k0 = cu_k[b], L = cu_k[b + 1] - k0;
          RowMatrix<double> dq_b = RowMatrix<double>::Zero(m, dq.cols());
          RowMatrix<double> dk_b = RowMatrix<double>::Zero(L, dk.cols());
          RowMatrix<double> dv_b = RowMatrix<double>::Zero(L, dv.cols());
          dense_sequence_gradients(q.middleRows(q0, m).template cast<double>(),
                                   k.middleRows(k0, L).template cast<double>(),
                                   v.middleRows(k0, L).template cast<double>(),
                                   dout.middleRows(q0, m).template cast<double>(), options.sigmas,
                                   tau, masking == Masking::causal, kv_heads, dq_b, dk_b, dv_b,
                                   dslopes_want);
          dq_want.middleRows(q0, m) = dq_b;
          dk_want.middleRows(k0, L) = dk_b;
          dv_want.middleRows(k0, L) = dv_b;
        }
        const double limit = 20 * poslsh_test::tolerance<Scalar>();
        CHECK(poslsh_test::relative_max_error(dq.template cast<double>(), dq_want) < limit);
        CHECK(poslsh_test::relative_max_error(dk.template cast<double>(), dk_want) < limit);
        CHECK(poslsh_test::relative_max_error(dv.template cast<double>(), dv_want) < limit);
        const Eigen::Map<const Eigen::VectorXd> want(dslopes_want.data(), varlen_heads);
        CHECK(poslsh_test::relative_max_error(dslopes_out, want) < limit);
        // Rows of a causal sequence with more queries than keys see no key: dq exactly 0.
        if (masking == Masking::causal)
          CHECK((dq.middleRows(cu_q[3], 40).array() == Scalar(0)).all());
      }
    }
  }
}

TEST_CASE("the packed-batch slice backward rejects the LSH methods, naming the method",
          "[context_parallel][varlen]") {
  const std::vector<std::int32_t> cu = {0, 4};
  const RowMatrix<float> x = poslsh_test::random_matrix<float>(4, varlen_d, 305);
  RowMatrix<float> g(4, varlen_d), lse(1, 4);
  const auto in = poslsh::interleaved_heads<const float>(x.data(), 4, 1, varlen_d);
  const auto out = poslsh::interleaved_heads<float>(g.data(), 4, 1, varlen_d);
  MultiHeadOptions options;
  options.method = Method::lsh_fused;
  options.sigmas = {2.0};
  std::string message;
  try {
    poslsh::multihead_attention_varlen_slice_backward<float>(in, in, in, in, lse, in, cu, cu, out,
                                                             out, out, options);
  } catch (const std::invalid_argument& error) {
    message = error.what();
  }
  CHECK(message.find("multihead_attention_varlen_slice_backward") != std::string::npos);
  CHECK(message.find("options.method") != std::string::npos);
}
