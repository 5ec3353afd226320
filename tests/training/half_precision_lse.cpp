// Forwards with lse on Q, K, V stored in bfloat16 or binary16 (out in the input type, lse in
// float): with float products, out and lse bitwise the float forward with lse on the widened
// inputs (out rounded once); on the AVX512-BF16 unit, out bitwise the forward without lse and
// lse that of the same bfloat16 products; every method, causal and bidirectional, n not a
// multiple of 64, single-head and all-heads (grouped-query heads, packed batches, queries at
// offsets), 1 and 2 threads; the backward fed by them; and the named argument checks.
#include <cstdint>
#include <cstring>
#include <poslsh/attention/banded.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/multihead/training.hpp>
#include <poslsh/training/backward.hpp>
#include <utility>
#include <vector>

#include "backward_kernels.hpp"
#include "half_backward_support.hpp"
#include "half_support.hpp"
#include "test_support.hpp"

namespace {
namespace half_lse {

using poslsh_test::BackwardKind, poslsh_test::random_half, poslsh_test::widened;
using poslsh_test::for_each_config, poslsh_test::for_one_and_two_threads;
using LseConfig = poslsh_test::BackwardSetup;
using LseGrads = poslsh_test::BackwardGradients<float>;
using LseVector = poslsh_test::ColumnVector<float>;
using bf16 = Eigen::bfloat16;

/// True when two matrices of any scalar type have the same shape and the same bytes.
template <typename A, typename B>
bool same_bytes(const A& a, const B& b) {
  static_assert(sizeof(typename A::Scalar) == sizeof(typename B::Scalar), "one storage size");
  const RowMatrix<typename A::Scalar> x = a;
  const RowMatrix<typename B::Scalar> y = b;
  return x.rows() == y.rows() && x.cols() == y.cols() &&
         std::memcmp(x.data(), y.data(),
                     sizeof(typename A::Scalar) * static_cast<std::size_t>(x.size())) == 0;
}

/// The run with `threads` threads: the first run's result is kept in `first`, the second's must
/// have its bytes.
template <typename M>
void check_lse_threads(int threads, const M& result, M& first) {
  if (threads == 1) {
    first = result;
  } else {
    CHECK(same_bytes(result, first));
  }
}

/// out (in Half) and lse of the forward with lse of configuration c on in's Half inputs.
template <typename Half>
std::pair<RowMatrix<Half>, LseVector> forward_with_lse(const LseConfig& c,
                                                       const poslsh_test::HalfInputs<Half>& in) {
  std::pair<RowMatrix<Half>, LseVector> result;
  poslsh_test::setup_forward<Half>(c, in.q, in.k, in.v, result.first, result.second);
  return result;
}

/// The forward without lse of configuration c (out in Half): what the forward with lse must
/// reproduce bit for bit.
template <typename Half>
RowMatrix<Half> forward_without_lse(const LseConfig& c, const RowMatrix<Half>& q,
                                    const RowMatrix<Half>& k, const RowMatrix<Half>& v) {
  RowMatrix<Half> out(q.rows(), v.cols());
  switch (c.kind) {
    case BackwardKind::tiled:
      poslsh::alibi_attention_tiled<Half>(q, k, v, c.sigma, out, c.options);
      break;
    case BackwardKind::banded:
      poslsh::alibi_attention_banded<Half>(q, k, v, c.sigma, c.band, out, c.options);
      break;
    case BackwardKind::fused:
      poslsh::lsh_attention_fused<Half>(q, k, v, c.hashes, out, c.options);
      break;
    case BackwardKind::per_sample:
      poslsh::lsh_attention_per_sample<Half>(q, k, v, c.hashes, out, c.options);
      break;
    case BackwardKind::fixed_blocks:
      poslsh::fixed_blocks_attention<Half>(q, k, v, c.sigma, out, c.options);
      break;
  }
  return out;
}

/// lse of the dense probabilities of c on float Q, K (plain float products): log sum_j w_ij
/// e^{x_ij} in double from float scores, the reference of the bfloat16 unit's lse.
LseVector dense_lse(const LseConfig& c, const RowMatrix<float>& q, const RowMatrix<float>& k) {
  const Index n = q.rows();
  const double tau = 1.0 / std::sqrt(static_cast<double>(q.cols()));
  float slope = 0.0f;
  const RowMatrix<float> w = poslsh_test::dense_weights(c, n, slope);
  const RowMatrix<double> scores = (q.cast<double>() * k.cast<double>().transpose());
  LseVector lse(n);
  for (Index i = 0; i < n; ++i) {
    double sum = 0.0;
    for (Index j = 0; j < n; ++j)
      if (w(i, j) != 0.0f)
        sum +=
            w(i, j) * std::exp(tau * scores(i, j) - slope * static_cast<double>(std::abs(i - j)));
    lse(i) = static_cast<float>(std::log(sum));
  }
  return lse;
}

/// What an all-heads forward with lse is.
enum class LseCall { whole, varlen, varlen_with_lse };

constexpr poslsh::EnumName<LseCall> lse_call_names[] = {
    {LseCall::whole, "multihead_attention with lse"},
    {LseCall::varlen, "multihead_attention_varlen with lse"},
    {LseCall::varlen_with_lse, "multihead_attention_varlen_with_lse"}};

/// out (n x H_q d_v, in Scalar) and lse (H_q x n, in backward_scalar_t<Scalar>) of `call` on
/// q, k, v stored as Scalar with the shapes of p (packed batch cu; varlen_with_lse: the same
/// sequences with cu as both cu_seqlens).
template <typename Scalar, typename Half>
void heads_forward_of(LseCall call, const poslsh_test::HeadsProblem<Half>& p, const Scalar* q,
                      const Scalar* k, const Scalar* v, const std::vector<std::int32_t>& cu,
                      const poslsh::MultiHeadOptions& options, RowMatrix<Scalar>& out,
                      RowMatrix<poslsh::backward_scalar_t<Scalar>>& lse) {
  out.resize(p.n, p.heads * p.dv);
  lse.resize(p.heads, p.n);
  const auto qv = poslsh::interleaved_heads<const Scalar>(q, p.n, p.heads, p.d);
  const auto kv = poslsh::interleaved_heads<const Scalar>(k, p.n, p.kv_heads, p.d);
  const auto vv = poslsh::interleaved_heads<const Scalar>(v, p.n, p.kv_heads, p.dv);
  const auto ov = poslsh::interleaved_heads<Scalar>(out.data(), p.n, p.heads, p.dv);
  switch (call) {
    case LseCall::whole:
      poslsh::multihead_attention_with_lse<Scalar>(qv, kv, vv, ov, lse, options);
      break;
    case LseCall::varlen:
      poslsh::multihead_attention_varlen<Scalar>(qv, kv, vv, ov, lse, cu, options);
      break;
    case LseCall::varlen_with_lse:
      poslsh::multihead_attention_varlen_with_lse<Scalar>(qv, kv, vv, ov, lse, cu, cu, options);
      break;
  }
}

/// out of the all-heads forward without lse (Half output) on p's Half inputs.
template <typename Half>
RowMatrix<Half> heads_without_lse(LseCall call, const poslsh_test::HeadsProblem<Half>& p,
                                  const std::vector<std::int32_t>& cu,
                                  const poslsh::MultiHeadOptions& options) {
  RowMatrix<Half> out(p.n, p.heads * p.dv);
  const auto qv = poslsh::interleaved_heads<const Half>(p.q.data(), p.n, p.heads, p.d);
  const auto kv = poslsh::interleaved_heads<const Half>(p.k.data(), p.n, p.kv_heads, p.d);
  const auto vv = poslsh::interleaved_heads<const Half>(p.v.data(), p.n, p.kv_heads, p.dv);
  const auto ov = poslsh::interleaved_heads<Half>(out.data(), p.n, p.heads, p.dv);
  if (call == LseCall::whole) {
    poslsh::multihead_attention<Half>(qv, kv, vv, ov, options);
  } else {
    poslsh::multihead_attention_varlen<Half>(qv, kv, vv, ov, cu, cu, options);
  }
  return out;
}

TEMPLATE_TEST_CASE(
    "half-precision forwards with lse under float products are bitwise the float forwards "
    "on the widened inputs, out rounded once",
    "[half][lse]", Eigen::bfloat16, Eigen::half) {
  using Half = TestType;
  const Index d = 40, dv = 20;
  for (const Index n : {Index{77}, Index{300}}) {
    const auto seed = static_cast<std::uint64_t>(n) * 7;
    const poslsh_test::HalfInputs<Half> in(n, d, dv, seed + 1);
    for_each_config(n, Precision::float_products, [&](const LseConfig& c) {
      RowMatrix<float> out_float;
      LseVector lse_float;
      poslsh_test::setup_forward<float>(c, in.qf, in.kf, in.vf, out_float, lse_float);
      const RowMatrix<Half> out_rounded = out_float.template cast<Half>();
      RowMatrix<Half> first_out;
      LseVector first_lse;
      for_one_and_two_threads([&](int threads) {
        const auto [out, lse] = forward_with_lse(c, in);
        CHECK(lse.allFinite());
        CHECK(same_bytes(lse, lse_float));
        CHECK(same_bytes(out, out_rounded));
        CHECK(same_bytes(out, forward_without_lse<Half>(c, in.q, in.k, in.v)));
        // The backward fed by this forward: bitwise the float backward on the widened
        // inputs with the float forward's lse and the rounded out.
        const LseGrads half =
            poslsh_test::setup_backward<Half>(c, in.q, in.k, in.v, out, lse, in.dout);
        const LseGrads wide = poslsh_test::setup_backward<float>(
            c, in.qf, in.kf, in.vf, widened(out_rounded), lse_float, in.doutf);
        poslsh_test::check_bitwise(half, wide);
        check_lse_threads(threads, out, first_out);
        check_lse_threads(threads, lse, first_lse);
      });
    });
  }
}

TEST_CASE(
    "bfloat16 forwards with lse on the AVX512-BF16 unit: out bitwise the forward without "
    "lse, lse close to the dense log-sum-exp, the backward fed by them within twice a plain "
    "bfloat16 backward's error against double",
    "[half][lse][matrix_units]") {
  if (!poslsh_test::has_bf16_unit()) return;
  const Index n = 300, d = 40, dv = 22;
  const poslsh_test::HalfInputs<bf16> in(n, d, dv, 171);
  for_each_config(n, Precision::matrix_units, [&](const LseConfig& c) {
    const poslsh_test::BackwardGradients<double> exact = poslsh_test::double_gradients(c, in);
    const LseVector reference_lse = dense_lse(c, in.qf, in.kf);
    RowMatrix<bf16> first_out;
    LseVector first_lse;
    for_one_and_two_threads([&](int threads) {
      const auto [out, lse] = forward_with_lse(c, in);
      CHECK(same_bytes(out, forward_without_lse<bf16>(c, in.q, in.k, in.v)));
      // Scores from bfloat16 inputs with float sums: the lse of the same scores to float
      // rounding (a few ulp of its magnitude).
      const double lse_error =
          (lse.cast<double>() - reference_lse.cast<double>()).cwiseAbs().maxCoeff();
      INFO("lse error " << lse_error);
      CHECK(lse_error <= 1e-5 * (1.0 + reference_lse.cwiseAbs().maxCoeff()));
      const LseGrads unit =
          poslsh_test::setup_backward<bf16>(c, in.q, in.k, in.v, out, lse, in.dout);
      const LseGrads plain =
          poslsh_test::plain_bf16_backward(c, in.qf, in.kf, in.vf, widened(out), lse, in.doutf);
      poslsh_test::check_unit_accuracy(unit, plain, exact);
      check_lse_threads(threads, out, first_out);
      check_lse_threads(threads, lse, first_lse);
    });
  });
}

TEMPLATE_TEST_CASE(
    "half-precision all-heads forwards with lse: bitwise the float calls on the widened "
    "inputs under float products, out bitwise the forward without lse under either precision",
    "[half][lse]", Eigen::bfloat16, Eigen::half) {
  using Half = TestType;
  // n = 300 tokens, 4 query heads over 2 K/V heads, d = 24, d_v = 16.
  const poslsh_test::HeadsProblem<Half> p(300, 4, 2, 24, 16, 600);
  for (const Precision precision : {Precision::float_products, Precision::matrix_units}) {
    for (const poslsh::Method method : poslsh_test::heads_methods) {
      for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
        const poslsh::MultiHeadOptions options =
            poslsh_test::heads_options(method, masking, precision);
        for (const LseCall call : {LseCall::whole, LseCall::varlen, LseCall::varlen_with_lse}) {
          INFO(poslsh::enum_name(precision)
               << ", " << poslsh::enum_name(method) << ", " << poslsh_test::masking_name(masking)
               << ", " << poslsh_test::name_in(lse_call_names, call));
          const std::vector<std::int32_t>& cu = call == LseCall::whole ? p.whole : p.packed;
          RowMatrix<float> out_float, lse_float;
          heads_forward_of<float>(call, p, p.qf.data(), p.kf.data(), p.vf.data(), cu, options,
                                  out_float, lse_float);
          const RowMatrix<Half> without = heads_without_lse(call, p, cu, options);
          RowMatrix<Half> first_out;
          RowMatrix<float> first_lse;
          for_one_and_two_threads([&](int threads) {
            RowMatrix<Half> out;
            RowMatrix<float> lse;
            heads_forward_of<Half>(call, p, p.q.data(), p.k.data(), p.v.data(), cu, options, out,
                                   lse);
            CHECK(lse.allFinite());
            CHECK(same_bytes(out, without));
            if (precision == Precision::float_products) {
              CHECK(same_bytes(lse, lse_float));
              CHECK(same_bytes(out, RowMatrix<Half>(out_float.template cast<Half>())));
            }
            check_lse_threads(threads, out, first_out);
            check_lse_threads(threads, lse, first_lse);
          });
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("half-precision forwards with lse name a bad argument", "[half][lse]",
                   Eigen::bfloat16, Eigen::half) {
  using Half = TestType;
  const Index n = 70, d = 8, dv = 6;
  const RowMatrix<Half> q = random_half<Half>(n, d, 1), k = random_half<Half>(n, d, 2),
                        v = random_half<Half>(n, dv, 3), k_wide = random_half<Half>(n, d + 1, 4);
  RowMatrix<Half> out(n, dv), out_bad(n - 1, dv);
  LseVector lse(n), lse_short(n - 1);
  const poslsh::HashSet hashes = poslsh::rbf_hashes(8.0, 2, 3, 0);
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_with_lse<Half>(q, k, v, 8.0, out, lse_short); }, "lse");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_with_lse<Half>(q, k_wide, v, 8.0, out, lse); }, "k");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_banded_with_lse<Half>(q, k, v, 8.0, -1, out, lse); }, "band");
  require_invalid_argument(
      [&] { poslsh::lsh_attention_fused_with_lse<Half>(q, k, v, hashes, out_bad, lse); }, "out");
  require_invalid_argument(
      [&] { poslsh::lsh_attention_per_sample_with_lse<Half>(q, k, v, hashes, out, lse_short); },
      "lse");
  require_invalid_argument(
      [&] { poslsh::fixed_blocks_attention_with_lse<Half>(q, k, v, -1.0, out, lse); }, "sigma");
  // All heads (two query heads over one K/V head): an lse of the wrong shape, an out view of
  // the wrong width.
  const RowMatrix<Half> q2 = random_half<Half>(n, 2 * d, 9);
  RowMatrix<Half> out2(n, 2 * dv);
  RowMatrix<float> heads_lse(2, n), heads_lse_bad(3, n);
  const auto qv = poslsh::interleaved_heads<const Half>(q2.data(), n, 2, d);
  const auto kv = poslsh::interleaved_heads<const Half>(k.data(), n, 1, d);
  const auto vv = poslsh::interleaved_heads<const Half>(v.data(), n, 1, dv);
  const auto ov = poslsh::interleaved_heads<Half>(out2.data(), n, 2, dv);
  const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(n)};
  require_invalid_argument(
      [&] { poslsh::multihead_attention_with_lse<Half>(qv, kv, vv, ov, heads_lse_bad); }, "lse");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_varlen<Half>(
            qv, kv, vv, poslsh::interleaved_heads<Half>(out2.data(), n, 2, dv - 1), heads_lse, cu);
      },
      "out");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_varlen_with_lse<Half>(qv, kv, vv, ov, heads_lse_bad, cu, cu);
      },
      "lse");
}

}  // namespace half_lse
}  // namespace
