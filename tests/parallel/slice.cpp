// The packed-batch slice backward (multihead_attention_varlen_slice_backward): sequences with
// fewer and more queries than keys, against the dense gradients of each sequence in double.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <poslsh/lsh/hash.hpp>
#include <poslsh/parallel/slice.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

using poslsh::Index;
using poslsh::Masking;
using poslsh::Method;
using poslsh::MultiHeadOptions;
using poslsh::RowMatrix;

namespace {

constexpr Index varlen_heads = 4, varlen_d = 8, varlen_dv = 6;

/// Random inputs of the slice tests: q and dout of `queries` tokens (varlen_heads heads), k and
/// v of `keys` tokens (kv_heads heads), from the seeds seed .. seed + 3.
template <typename Scalar>
struct SliceInputs {
  RowMatrix<Scalar> q, k, v, dout;
  SliceInputs(Index queries, Index keys, Index kv_heads, std::uint64_t seed)
      : q(poslsh_test::random_matrix<Scalar>(queries, varlen_heads * varlen_d, seed)),
        k(poslsh_test::random_matrix<Scalar>(keys, kv_heads * varlen_d, seed + 1)),
        v(poslsh_test::random_matrix<Scalar>(keys, kv_heads * varlen_dv, seed + 2)),
        dout(poslsh_test::random_matrix<Scalar>(queries, varlen_heads * varlen_dv, seed + 3)) {}
};

/// The dense gradients in double of every head (H query heads over kv_heads K/V heads,
/// [tokens, heads * dim] matrices) from the logits x = logits(h, q_h, k_g) of each head (m x L;
/// -inf where a pair has no weight, and a row without a finite logit has P = 0): P the rows'
/// softmax, out = P V, D_i = dO_i . out_i, dS = P o (dO V^T - D), added into dq += tau dS K,
/// dk += tau dS^T Q, dv += P^T dO; returns each head's dS.
template <typename Logits>
std::vector<RowMatrix<double>> add_dense_gradients(
    const RowMatrix<double>& q, const RowMatrix<double>& k, const RowMatrix<double>& v,
    const RowMatrix<double>& dout, Index kv_heads, double tau, Logits&& logits,
    RowMatrix<double>& dq, RowMatrix<double>& dk, RowMatrix<double>& dv) {
  const Index group = varlen_heads / kv_heads;
  std::vector<RowMatrix<double>> ds;
  for (Index h = 0; h < varlen_heads; ++h) {
    const Index g = h / group;
    const auto qh = q.middleCols(h * varlen_d, varlen_d);
    const auto kh = k.middleCols(g * varlen_d, varlen_d);
    const auto vh = v.middleCols(g * varlen_dv, varlen_dv);
    const auto doh = dout.middleCols(h * varlen_dv, varlen_dv);
    RowMatrix<double> p = logits(h, qh, kh);
    for (Index i = 0; i < p.rows(); ++i) {
      const double top = p.row(i).maxCoeff();
      if (top == -std::numeric_limits<double>::infinity()) {
        p.row(i).setZero();
        continue;
      }
      p.row(i) = (p.row(i).array() - top).exp().matrix();
      p.row(i) /= p.row(i).sum();
    }
    const RowMatrix<double> out = p * vh;
    const Eigen::VectorXd delta = (doh.array() * out.array()).rowwise().sum().matrix();
    ds.emplace_back(p.array() * ((doh * vh.transpose()).colwise() - delta).array());
    dq.middleCols(h * varlen_d, varlen_d) += tau * ds.back() * kh;
    dk.middleCols(g * varlen_d, varlen_d) += tau * ds.back().transpose() * qh;
    dv.middleCols(g * varlen_dv, varlen_dv) += p.transpose() * doh;
  }
  return ds;
}

/// Dense gradients of one sequence in double, every head: query i at position i + L - m, key j
/// at position j (FlashAttention's bottom-right alignment), x_ij = tau q_i.k_j -
/// |i + L - m - j| / sigma_h, causal keeping j <= i + L - m; a row without keys has P = 0.
/// Adds into dq, dk, dv and dslopes (dL/dslope_h = -sum_ij dS_ij |i + L - m - j|).
void dense_sequence_gradients(const RowMatrix<double>& q, const RowMatrix<double>& k,
                              const RowMatrix<double>& v, const RowMatrix<double>& dout,
                              const std::vector<double>& sigmas, double tau, bool causal,
                              Index kv_heads, RowMatrix<double>& dq, RowMatrix<double>& dk,
                              RowMatrix<double>& dv, std::vector<double>& dslopes) {
  const Index m = q.rows(), L = k.rows();
  RowMatrix<double> distance(m, L);
  for (Index i = 0; i < m; ++i)
    for (Index j = 0; j < L; ++j) distance(i, j) = static_cast<double>(std::abs(i + L - m - j));
  const auto logits = [&](Index h, const auto& qh, const auto& kh) {
    RowMatrix<double> x =
        tau * qh * kh.transpose() - distance / sigmas[static_cast<std::size_t>(h)];
    for (Index i = 0; causal && i < m; ++i)
      for (Index j = std::max<Index>(0, i + L - m + 1); j < L; ++j)
        x(i, j) = -std::numeric_limits<double>::infinity();
    return x;
  };
  const std::vector<RowMatrix<double>> ds =
      add_dense_gradients(q, k, v, dout, kv_heads, tau, logits, dq, dk, dv);
  for (Index h = 0; h < varlen_heads; ++h)
    dslopes[static_cast<std::size_t>(h)] -=
        (ds[static_cast<std::size_t>(h)].array() * distance.array()).sum();
}

/// Dense gradients in double of the count-weighted LSH estimator (lsh_fused) on one slice,
/// every head: query i at position query_offset + i, key j at key_offset + j, weights
/// c_ij = #{k : bin_k(query) = bin_k(key)} of head h's hashes rbf_hashes(sigma_h, s, seed, h)
/// (causal: key position <= query position), x_ij = tau q_i.k_j + log c_ij. Adds into dq, dk,
/// dv.
void dense_count_gradients(const RowMatrix<double>& q, const RowMatrix<double>& k,
                           const RowMatrix<double>& v, const RowMatrix<double>& dout,
                           const MultiHeadOptions& options, Index query_offset, Index key_offset,
                           Index kv_heads, RowMatrix<double>& dq, RowMatrix<double>& dk,
                           RowMatrix<double>& dv) {
  const double tau = 1.0 / std::sqrt(static_cast<double>(varlen_d));
  const auto logits = [&](Index h, const auto& qh, const auto& kh) {
    const double sigma = options.sigmas[static_cast<std::size_t>(h)];
    const poslsh::HashSet hashes = options.method == Method::fixed_blocks
                                       ? poslsh::HashSet{poslsh::fixed_blocks_hash(sigma)}
                                       : poslsh::rbf_hashes(sigma, options.samples, options.seed,
                                                            static_cast<std::uint64_t>(h));
    RowMatrix<double> x = tau * qh * kh.transpose();
    for (Index i = 0; i < x.rows(); ++i) {
      for (Index j = 0; j < x.cols(); ++j) {
        const Index query = query_offset + i, key = key_offset + j;
        int count = 0;
        for (const poslsh::BinHash& hash : hashes) count += hash.bin(query) == hash.bin(key);
        if (options.masking == Masking::causal && key > query) count = 0;
        x(i, j) = count > 0 ? x(i, j) + std::log(count) : -std::numeric_limits<double>::infinity();
      }
    }
    return x;
  };
  add_dense_gradients(q, k, v, dout, kv_heads, tau, logits, dq, dk, dv);
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
        const SliceInputs<Scalar> inputs(total_q, total_k, kv_heads, 301);
        const RowMatrix<Scalar>&q = inputs.q, &k = inputs.k, &v = inputs.v, &dout = inputs.dout;
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

namespace {

/// The view of every head of a [tokens, heads * dim] matrix.
template <typename Scalar>
poslsh::HeadsView<const Scalar> heads_view(const RowMatrix<Scalar>& x, Index heads, Index dim) {
  return poslsh::interleaved_heads<const Scalar>(x.data(), x.rows(), heads, dim);
}
template <typename Scalar>
poslsh::HeadsView<Scalar> heads_view(RowMatrix<Scalar>& x, Index heads, Index dim) {
  return poslsh::interleaved_heads<Scalar>(x.data(), x.rows(), heads, dim);
}

/// The options of the LSH cases: sigmas from below one token to beyond the keys.
MultiHeadOptions lsh_options(Method method, Masking masking, Index samples,
                             std::uint64_t seed = MultiHeadOptions{}.seed) {
  MultiHeadOptions options;
  options.method = method;
  options.masking = masking;
  options.sigmas = {0.6, 4.0, 30.0, 300.0};
  options.samples = samples;
  options.seed = seed;
  return options;
}

}  // namespace

TEMPLATE_TEST_CASE("the LSH slice backward equals the dense count-weighted gradients",
                   "[context_parallel][lsh]", float, double) {
  using Scalar = TestType;
  // 150 keys at positions 37 .. 186, and 50 queries among them: the last ones (FlashAttention's
  // bottom-right rows), from the middle, and from the first key.
  constexpr Index m = 50, L = 150, key_offset = 37;
  for (const Method method : {Method::lsh_fused, Method::lsh_per_sample, Method::fixed_blocks}) {
    for (const Index shift : {L - m, Index{30}, Index{0}}) {
      for (const Index kv_heads : {Index{2}, varlen_heads}) {
        for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
          INFO(poslsh::enum_name(method) << ", shift " << shift << ", kv_heads " << kv_heads << ", "
                                         << poslsh_test::masking_name(masking));
          const SliceInputs<Scalar> inputs(m, L, kv_heads, 311);
          const RowMatrix<Scalar>&q = inputs.q, &k = inputs.k, &v = inputs.v, &dout = inputs.dout;
          const MultiHeadOptions options = lsh_options(method, masking, 6, 17);
          const Index query_offset = key_offset + shift;
          RowMatrix<Scalar> out(m, varlen_heads * varlen_dv), lse(varlen_heads, m);
          poslsh::multihead_attention_slice<Scalar>(
              heads_view(q, varlen_heads, varlen_d), heads_view(k, kv_heads, varlen_d),
              heads_view(v, kv_heads, varlen_dv), heads_view(out, varlen_heads, varlen_dv), lse,
              query_offset, key_offset, options);
          // Added to what the gradients hold.
          RowMatrix<Scalar> dq = RowMatrix<Scalar>::Constant(m, varlen_heads * varlen_d, Scalar(1));
          RowMatrix<Scalar> dk = RowMatrix<Scalar>::Constant(L, kv_heads * varlen_d, Scalar(2));
          RowMatrix<Scalar> dv = RowMatrix<Scalar>::Constant(L, kv_heads * varlen_dv, Scalar(3));
          poslsh::multihead_attention_slice_backward<Scalar>(
              heads_view(q, varlen_heads, varlen_d), heads_view(k, kv_heads, varlen_d),
              heads_view(v, kv_heads, varlen_dv),
              heads_view(static_cast<const RowMatrix<Scalar>&>(out), varlen_heads, varlen_dv), lse,
              heads_view(dout, varlen_heads, varlen_dv), heads_view(dq, varlen_heads, varlen_d),
              heads_view(dk, kv_heads, varlen_d), heads_view(dv, kv_heads, varlen_dv), query_offset,
              key_offset, options);
          RowMatrix<double> dq_want = RowMatrix<double>::Constant(dq.rows(), dq.cols(), 1.0);
          RowMatrix<double> dk_want = RowMatrix<double>::Constant(dk.rows(), dk.cols(), 2.0);
          RowMatrix<double> dv_want = RowMatrix<double>::Constant(dv.rows(), dv.cols(), 3.0);
          dense_count_gradients(q.template cast<double>(), k.template cast<double>(),
                                v.template cast<double>(), dout.template cast<double>(), options,
                                query_offset, key_offset, kv_heads, dq_want, dk_want, dv_want);
          const double limit = 20 * poslsh_test::tolerance<Scalar>();
          CHECK(poslsh_test::relative_max_error(dq.template cast<double>(), dq_want) < limit);
          CHECK(poslsh_test::relative_max_error(dk.template cast<double>(), dk_want) < limit);
          CHECK(poslsh_test::relative_max_error(dv.template cast<double>(), dv_want) < limit);
        }
      }
    }
  }
}

TEST_CASE("the LSH slice backward of the last queries is the backward's rows",
          "[context_parallel][lsh]") {
  // Self-attention on n tokens, then the slice of its last m queries (a multiple of 64 after
  // the first) over every key, dout 0 on the other rows. lsh_fused: the same pass on the same
  // query steps, so dq of those rows, dk and dv are the same bits. lsh_per_sample and
  // fixed_blocks: the whole sequence's backward sums the samples' blocks (per_sample_backward),
  // a slice takes lsh_fused's pass on the same hashes: the same gradients to rounding, and
  // bitwise lsh_fused's slice.
  constexpr Index n = 200, m = 72, heads = 2, d = 16;
  const RowMatrix<float> q = poslsh_test::random_matrix<float>(n, heads * d, 321);
  const RowMatrix<float> k = poslsh_test::random_matrix<float>(n, heads * d, 322);
  const RowMatrix<float> v = poslsh_test::random_matrix<float>(n, heads * d, 323);
  RowMatrix<float> dout_rows_set = poslsh_test::random_matrix<float>(n, heads * d, 324);
  dout_rows_set.topRows(n - m).setZero();
  const RowMatrix<float>& dout = dout_rows_set;
  const RowMatrix<float> q_rows = q.bottomRows(m), dout_rows = dout.bottomRows(m);
  for (const Method method : {Method::lsh_fused, Method::lsh_per_sample, Method::fixed_blocks}) {
    for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
      INFO(poslsh::enum_name(method) << ", " << poslsh_test::masking_name(masking));
      MultiHeadOptions options;
      options.method = method;
      options.masking = masking;
      options.sigmas = {3.0, 40.0};
      options.samples = 8;
      RowMatrix<float> out(n, heads * d), lse(heads, n);
      poslsh::multihead_attention_with_lse<float>(heads_view(q, heads, d), heads_view(k, heads, d),
                                                  heads_view(v, heads, d),
                                                  heads_view(out, heads, d), lse, options);
      RowMatrix<float> dq(n, heads * d), dk(n, heads * d), dv(n, heads * d);
      poslsh::multihead_attention_backward<float>(
          heads_view(q, heads, d), heads_view(k, heads, d), heads_view(v, heads, d),
          heads_view(static_cast<const RowMatrix<float>&>(out), heads, d), lse,
          heads_view(dout, heads, d), heads_view(dq, heads, d), heads_view(dk, heads, d),
          heads_view(dv, heads, d), options);
      const RowMatrix<float> out_rows = out.bottomRows(m), lse_rows = lse.rightCols(m);
      const auto slice = [&](const MultiHeadOptions& call, RowMatrix<float>(&g)[3]) {
        g[0].setZero(m, heads * d);
        g[1].setZero(n, heads * d);
        g[2].setZero(n, heads * d);
        poslsh::multihead_attention_slice_backward<float>(
            heads_view(q_rows, heads, d), heads_view(k, heads, d), heads_view(v, heads, d),
            heads_view(out_rows, heads, d), lse_rows, heads_view(dout_rows, heads, d),
            heads_view(g[0], heads, d), heads_view(g[1], heads, d), heads_view(g[2], heads, d),
            n - m, 0, call);
      };
      RowMatrix<float> grads[3];
      slice(options, grads);
      const RowMatrix<float> dq_rows = dq.bottomRows(m);
      if (method == Method::lsh_fused) {
        CHECK((grads[0].array() == dq_rows.array()).all());
        CHECK((grads[1].array() == dk.array()).all());
        CHECK((grads[2].array() == dv.array()).all());
        continue;
      }
      const double limit = 20 * poslsh_test::tolerance<float>();
      CHECK(poslsh_test::relative_max_error(grads[0], dq_rows) < limit);
      CHECK(poslsh_test::relative_max_error(grads[1], dk) < limit);
      CHECK(poslsh_test::relative_max_error(grads[2], dv) < limit);
      if (method == Method::lsh_per_sample) {
        MultiHeadOptions as_fused = options;
        as_fused.method = Method::lsh_fused;
        RowMatrix<float> fused[3];
        slice(as_fused, fused);
        for (int g = 0; g < 3; ++g) CHECK((grads[g].array() == fused[g].array()).all());
      }
    }
  }
}

TEST_CASE(
    "the packed-batch slice backward of the LSH methods equals the dense gradients of each "
    "sequence",
    "[context_parallel][varlen][lsh]") {
  // (queries, keys) per sequence, at most as many queries as keys.
  const std::vector<std::pair<Index, Index>> shapes = {{40, 130}, {70, 70}, {0, 20}, {3, 77}};
  std::vector<std::int32_t> cu_q = {0}, cu_k = {0};
  for (const auto& [m, L] : shapes) {
    cu_q.push_back(cu_q.back() + static_cast<std::int32_t>(m));
    cu_k.push_back(cu_k.back() + static_cast<std::int32_t>(L));
  }
  const Index total_q = cu_q.back(), total_k = cu_k.back(), kv_heads = 2;
  const SliceInputs<double> inputs(total_q, total_k, kv_heads, 331);
  const RowMatrix<double>&q = inputs.q, &k = inputs.k, &v = inputs.v, &dout = inputs.dout;
  for (const auto& [method, masking] : {std::pair{Method::lsh_fused, Masking::causal},
                                        std::pair{Method::lsh_fused, Masking::bidirectional},
                                        std::pair{Method::lsh_per_sample, Masking::causal},
                                        std::pair{Method::fixed_blocks, Masking::bidirectional}}) {
    INFO(poslsh::enum_name(method) << ", " << poslsh_test::masking_name(masking));
    const MultiHeadOptions options = lsh_options(method, masking, 5);
    RowMatrix<double> out(total_q, varlen_heads * varlen_dv), lse(varlen_heads, total_q);
    poslsh::multihead_attention_varlen_with_lse<double>(
        heads_view(q, varlen_heads, varlen_d), heads_view(k, kv_heads, varlen_d),
        heads_view(v, kv_heads, varlen_dv), heads_view(out, varlen_heads, varlen_dv), lse, cu_q,
        cu_k, options);
    RowMatrix<double> dq = RowMatrix<double>::Constant(total_q, varlen_heads * varlen_d, 7.0);
    RowMatrix<double> dk(total_k, kv_heads * varlen_d), dv(total_k, kv_heads * varlen_dv);
    poslsh::multihead_attention_varlen_slice_backward<double>(
        heads_view(q, varlen_heads, varlen_d), heads_view(k, kv_heads, varlen_d),
        heads_view(v, kv_heads, varlen_dv),
        heads_view(static_cast<const RowMatrix<double>&>(out), varlen_heads, varlen_dv), lse,
        heads_view(dout, varlen_heads, varlen_dv), cu_q, cu_k,
        heads_view(dq, varlen_heads, varlen_d), heads_view(dk, kv_heads, varlen_d),
        heads_view(dv, kv_heads, varlen_dv), options);
    RowMatrix<double> dq_want = RowMatrix<double>::Zero(dq.rows(), dq.cols());
    RowMatrix<double> dk_want = RowMatrix<double>::Zero(dk.rows(), dk.cols());
    RowMatrix<double> dv_want = RowMatrix<double>::Zero(dv.rows(), dv.cols());
    for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
      const Index q0 = cu_q[b], m = cu_q[b + 1] - q0, k0 = cu_k[b], L = cu_k[b + 1] - k0;
      RowMatrix<double> dq_b = RowMatrix<double>::Zero(m, dq.cols());
      RowMatrix<double> dk_b = RowMatrix<double>::Zero(L, dk.cols());
      RowMatrix<double> dv_b = RowMatrix<double>::Zero(L, dv.cols());
      // Bottom-right: the m queries at the positions of the last m keys.
      dense_count_gradients(q.middleRows(q0, m), k.middleRows(k0, L), v.middleRows(k0, L),
                            dout.middleRows(q0, m), options, L - m, 0, kv_heads, dq_b, dk_b, dv_b);
      dq_want.middleRows(q0, m) = dq_b;
      dk_want.middleRows(k0, L) = dk_b;
      dv_want.middleRows(k0, L) = dv_b;
    }
    const double limit = 20 * poslsh_test::tolerance<double>();
    CHECK(poslsh_test::relative_max_error(dq, dq_want) < limit);
    CHECK(poslsh_test::relative_max_error(dk, dk_want) < limit);
    CHECK(poslsh_test::relative_max_error(dv, dv_want) < limit);
  }
}

TEST_CASE("the packed-batch slice backward names the methods and shapes it does not take",
          "[context_parallel][varlen]") {
  const std::vector<std::int32_t> cu = {0, 4}, cu_more_queries = {0, 5}, cu_fewer_keys = {0, 3};
  const RowMatrix<float> x = poslsh_test::random_matrix<float>(5, varlen_d, 305);
  RowMatrix<float> g(5, varlen_d), lse(1, 4), lse_more(1, 5);
  const auto in = poslsh::interleaved_heads<const float>(x.data(), 4, 1, varlen_d);
  const auto in_more = poslsh::interleaved_heads<const float>(x.data(), 5, 1, varlen_d);
  const auto keys = poslsh::interleaved_heads<const float>(x.data(), 3, 1, varlen_d);
  const auto out = poslsh::interleaved_heads<float>(g.data(), 4, 1, varlen_d);
  const auto out_more = poslsh::interleaved_heads<float>(g.data(), 5, 1, varlen_d);
  const auto key_grads = poslsh::interleaved_heads<float>(g.data(), 3, 1, varlen_d);
  MultiHeadOptions options;
  options.sigmas = {2.0};
  const auto message = [](auto&& call) {
    try {
      call();
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  // A method without a slice backward.
  options.method = Method::mean_of_outputs;
  std::string error = message([&] {
    poslsh::multihead_attention_varlen_slice_backward<float>(in, in, in, in, lse, in, cu, cu, out,
                                                             out, out, options);
  });
  CHECK(error.find("multihead_attention_varlen_slice_backward") != std::string::npos);
  CHECK(error.find("'options.method'") != std::string::npos);
  CHECK(
      error.find("must be lsh_fused, lsh_per_sample, fixed_blocks, exact_tiled or exact_banded") !=
      std::string::npos);
  // The LSH methods with more queries than keys (not causal: the queries start before the
  // keys); fixed_blocks draws no hashes but bins positions too.
  options.masking = Masking::bidirectional;
  for (const Method method : {Method::lsh_per_sample, Method::fixed_blocks, Method::lsh_fused}) {
    INFO(poslsh::enum_name(method));
    options.method = method;
    error = message([&] {
      poslsh::multihead_attention_varlen_slice_backward<float>(
          in_more, keys, keys, in_more, lse_more, in_more, cu_more_queries, cu_fewer_keys, out_more,
          key_grads, key_grads, options);
    });
    CHECK(error.find("'cu_seqlens_q'") != std::string::npos);
    CHECK(error.find("among the keys") != std::string::npos);
  }
  // lsh_fused has no slope gradients: named before any gradient is written.
  g.setConstant(5.0f);
  Eigen::VectorXd slopes = Eigen::VectorXd::Constant(1, 5.0);
  Eigen::Ref<Eigen::VectorXd> dslopes(slopes);
  error = message([&] {
    poslsh::multihead_attention_varlen_slice_backward<float>(in, in, in, in, lse, in, cu, cu, out,
                                                             out, out, options, &dslopes);
  });
  CHECK(error.find("'dslopes'") != std::string::npos);
  CHECK((g.array() == 5.0f).all());
  CHECK(slopes(0) == 5.0);
}
