// Backward passes on Q, K, V, out and dO stored in bfloat16 or binary16: with float products,
// bitwise the float backward on float copies of the widened inputs (every method, causal and
// bidirectional, n not a multiple of 64, rows with a stride, single-head and all-heads with
// grouped-query heads, packed batches, slope gradients and the window backward, 1 and 2
// threads); on the AVX512-BF16 unit, within twice the error of a plain bfloat16 backward
// against double and bitwise the same for 1 and 2 threads; and the named argument checks.
#include <poslsh/core/matrix_units.hpp>
#include <poslsh/multihead/training.hpp>
#include <poslsh/parallel/context_parallel.hpp>
#include <poslsh/reference/masks.hpp>
#include <poslsh/training/backward.hpp>

#include "backward_kernels.hpp"
#include "half_backward_support.hpp"
#include "half_support.hpp"
#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {
namespace half_backward {

using poslsh_test::BackwardKind, poslsh_test::Config, poslsh_test::FloatVector, poslsh_test::Grads;
using poslsh_test::check_bitwise, poslsh_test::check_threads, poslsh_test::same_bits;
using poslsh_test::for_each_config, poslsh_test::for_one_and_two_threads;
using poslsh_test::has_bf16_unit, poslsh_test::plain_bf16_backward;
using poslsh_test::heads_of, poslsh_test::heads_options, poslsh_test::HeadsProblem;
using poslsh_test::random_half, poslsh_test::widened;
using poslsh_test::setup_backward, poslsh_test::setup_forward;
using bf16 = Eigen::bfloat16;

/// A half-precision matrix stored with a row stride larger than its column count (`cols` of
/// `cols + 5` columns), and its float copy (contiguous, the widened values).
template <typename Half>
struct StridedInput {
  RowMatrix<Half> storage;
  RowMatrix<float> wide;

  StridedInput(const RowMatrix<Half>& values)
      : storage(RowMatrix<Half>::Zero(values.rows(), values.cols() + 5)), wide(widened(values)) {
    storage.leftCols(values.cols()) = values;
  }
  ConstMatrixRef<Half> view() const { return storage.leftCols(wide.cols()); }
};

/// Gradients of an all-heads call (float buffers [n, H, d]) that start as NaN.
Grads heads_grads(Index n, Index heads, Index kv_heads, Index d, Index dv) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return {RowMatrix<float>::Constant(n, heads * d, nan),
          RowMatrix<float>::Constant(n, kv_heads * d, nan),
          RowMatrix<float>::Constant(n, kv_heads * dv, nan)};
}

/// What an all-heads backward call computes besides dq, dk, dv.
enum class HeadsCall { whole, varlen, slopes, window };

constexpr poslsh::EnumName<HeadsCall> heads_call_names[] = {
    {HeadsCall::whole, "multihead_attention_backward"},
    {HeadsCall::varlen, "multihead_attention_varlen_backward"},
    {HeadsCall::slopes, "multihead_attention_backward with dslopes"},
    {HeadsCall::window, "multihead_attention_window_backward"}};

/// Tokens before the window of the window backward (a multiple of 64) and its length.
constexpr Index window_start = 64, window_tokens = 150;

/// The all-heads backward `call` on inputs stored as Scalar (q .. dout with the shapes of p),
/// the gradients and, for HeadsCall::slopes, the slope gradients (else empty).
template <typename Scalar, typename Half>
Grads heads_backward_of(HeadsCall call, const HeadsProblem<Half>& p, const Scalar* q,
                        const Scalar* k, const Scalar* v, const Scalar* out, const Scalar* dout,
                        const std::vector<std::int32_t>& cu,
                        const poslsh::MultiHeadOptions& options, Eigen::VectorXd& dslopes) {
  const bool window = call == HeadsCall::window;
  const Index first = window ? window_start : 0, n = window ? window_tokens : p.n;
  const Index row_q = p.heads * p.d, row_k = p.kv_heads * p.d, row_v = p.kv_heads * p.dv,
              row_o = p.heads * p.dv;
  Grads g = heads_grads(n, p.heads, p.kv_heads, p.d, p.dv);
  const auto qv = heads_of<const Scalar>(q + first * row_q, n, p.heads, p.d);
  const auto kv = heads_of<const Scalar>(k + first * row_k, n, p.kv_heads, p.d);
  const auto vv = heads_of<const Scalar>(v + first * row_v, n, p.kv_heads, p.dv);
  const auto ov = heads_of<const Scalar>(out + first * row_o, n, p.heads, p.dv);
  const auto gv = heads_of<const Scalar>(dout + first * row_o, n, p.heads, p.dv);
  const auto dq = heads_of<float>(g.dq.data(), n, p.heads, p.d);
  const auto dk = heads_of<float>(g.dk.data(), n, p.kv_heads, p.d);
  const auto dv = heads_of<float>(g.dv.data(), n, p.kv_heads, p.dv);
  const ConstMatrixRef<float> lse = p.lse.middleCols(first, n);
  switch (call) {
    case HeadsCall::whole:
      poslsh::multihead_attention_backward<Scalar>(qv, kv, vv, ov, lse, gv, dq, dk, dv, options);
      break;
    case HeadsCall::varlen:
      poslsh::multihead_attention_varlen_backward<Scalar>(qv, kv, vv, ov, lse, gv, cu, dq, dk, dv,
                                                          options);
      break;
    case HeadsCall::slopes:
      dslopes.resize(p.heads);
      poslsh::multihead_attention_backward<Scalar>(qv, kv, vv, ov, lse, gv, dq, dk, dv, dslopes,
                                                   options);
      break;
    case HeadsCall::window:
      poslsh::multihead_attention_window_backward<Scalar>(qv, kv, vv, ov, lse, gv, dq, dk, dv,
                                                          window_start, options);
      break;
  }
  return g;
}

TEMPLATE_TEST_CASE(
    "half-precision backward passes are bitwise the float passes on the widened "
    "inputs",
    "[half][backward]", Eigen::bfloat16, Eigen::half) {
  using Half = TestType;
  const Index d = 40, dv = 20;
  for (const Index n : {Index{77}, Index{300}}) {
    const auto seed = static_cast<std::uint64_t>(n) * 10;
    const StridedInput<Half> q(random_half<Half>(n, d, seed + 1));
    const StridedInput<Half> k(random_half<Half>(n, d, seed + 2));
    const StridedInput<Half> v(random_half<Half>(n, dv, seed + 3));
    const StridedInput<Half> dout(random_half<Half>(n, dv, seed + 4));
    for_each_config(n, poslsh::Precision::float_products, [&](const Config& c) {
      RowMatrix<float> out_float;
      FloatVector lse;
      setup_forward<float>(c, q.wide, k.wide, v.wide, out_float, lse);
      // out as a half-precision forward writes it: the float output rounded once.
      const StridedInput<Half> out(out_float.template cast<Half>());
      Grads first;
      for_one_and_two_threads([&](int threads) {
        const Grads half =
            setup_backward<Half>(c, q.view(), k.view(), v.view(), out.view(), lse, dout.view());
        const Grads wide =
            setup_backward<float>(c, q.wide, k.wide, v.wide, out.wide, lse, dout.wide);
        check_bitwise(half, wide);
        check_threads(threads, half, first);
      });
    });
  }
}

TEMPLATE_TEST_CASE(
    "half-precision all-heads backward passes are bitwise the float calls on the "
    "widened inputs",
    "[half][backward]", Eigen::bfloat16, Eigen::half) {
  using Half = TestType;
  // n = 300 tokens, 4 query heads over 2 K/V heads, d = 24, d_v = 16.
  HeadsProblem<Half> p(300, 4, 2, 24, 16, 500);
  for (const poslsh::Method method : poslsh_test::heads_methods) {
    for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
      const poslsh::MultiHeadOptions options =
          heads_options(method, masking, poslsh::Precision::float_products);
      const bool exact =
          method == poslsh::Method::exact_tiled || method == poslsh::Method::exact_banded;
      for (const HeadsCall call :
           {HeadsCall::whole, HeadsCall::varlen, HeadsCall::slopes, HeadsCall::window}) {
        if (call == HeadsCall::slopes && !exact) continue;
        INFO(poslsh::enum_name(method) << ", " << poslsh_test::masking_name(masking) << ", "
                                       << poslsh_test::name_in(heads_call_names, call));
        const std::vector<std::int32_t>& cu = call == HeadsCall::varlen ? p.packed : p.whole;
        p.forward(options, cu);
        Grads first;
        Eigen::VectorXd first_slopes;
        for_one_and_two_threads([&](int threads) {
          Eigen::VectorXd half_slopes, wide_slopes;
          const Grads half =
              heads_backward_of<Half>(call, p, p.q.data(), p.k.data(), p.v.data(), p.out.data(),
                                      p.dout.data(), cu, options, half_slopes);
          const Grads wide = heads_backward_of<float>(call, p, p.qf.data(), p.kf.data(),
                                                      p.vf.data(), widened(p.out).data(),
                                                      p.doutf.data(), cu, options, wide_slopes);
          check_bitwise(half, wide);
          CHECK(half_slopes.size() == wide_slopes.size());
          CHECK(half_slopes == wide_slopes);
          check_threads(threads, half, first);
          if (threads == 1) {
            first_slopes = half_slopes;
          } else {
            CHECK(half_slopes == first_slopes);
          }
        });
      }
    }
  }
}

TEST_CASE(
    "bfloat16 backward passes on the AVX512-BF16 unit: within twice a plain bfloat16 "
    "backward's error against double, the same bits for 1 and 2 threads, even and odd widths",
    "[half][backward][matrix_units]") {
  if (!has_bf16_unit()) return;
  const Index n = 300;
  for (const auto& [d, dv] : {std::pair<Index, Index>{40, 22}, std::pair<Index, Index>{33, 21}}) {
    INFO("d " << d << ", d_v " << dv);
    const poslsh_test::HalfInputs<bf16> in(n, d, dv, 71);
    for_each_config(n, poslsh::Precision::matrix_units, [&](const Config& c) {
      REQUIRE(poslsh::detail::backward_on_bf16_unit<bf16>(c.options.precision));
      RowMatrix<float> out_float;
      FloatVector lse;
      setup_forward<float>(c, in.qf, in.kf, in.vf, out_float, lse);
      const RowMatrix<bf16> out = out_float.cast<bf16>();
      // The double gradients of the same rounded inputs.
      const poslsh_test::BackwardGradients<double> exact = poslsh_test::double_gradients(c, in);
      const Grads plain = plain_bf16_backward(c, in.qf, in.kf, in.vf, widened(out), lse, in.doutf);
      Grads first;
      for_one_and_two_threads([&](int threads) {
        const Grads unit = setup_backward<bf16>(c, in.q, in.k, in.v, out, lse, in.dout);
        const Grads widening = [&] {
          Config float_products = c;
          float_products.options.precision = poslsh::Precision::float_products;
          return setup_backward<bf16>(float_products, in.q, in.k, in.v, out, lse, in.dout);
        }();
        // The unit is used: its roundings of P and dS change the bits.
        CHECK_FALSE(same_bits(unit, widening));
        poslsh_test::check_unit_accuracy(unit, plain, exact);
        check_threads(threads, unit, first);
      });
    });
  }
}

TEST_CASE(
    "all-heads bfloat16 backward passes on the AVX512-BF16 unit: the single-head passes "
    "of each head, the same bits for 1 and 2 threads",
    "[half][backward][matrix_units]") {
  if (!has_bf16_unit()) return;
  const Index n = 200, heads = 2, kv_heads = 1, d = 24, dv = 16;
  HeadsProblem<bf16> p(n, heads, kv_heads, d, dv, 900);
  for (const poslsh::Method method :
       {poslsh::Method::lsh_fused, poslsh::Method::lsh_per_sample, poslsh::Method::exact_tiled}) {
    INFO(poslsh::enum_name(method));
    poslsh::MultiHeadOptions options = multihead_options(method, Masking::causal, 3, 5);
    options.precision = poslsh::Precision::matrix_units;
    p.forward(options, p.whole);
    Eigen::VectorXd unused;
    Grads first;
    for_one_and_two_threads([&](int threads) {
      const Grads unit =
          heads_backward_of<bf16>(HeadsCall::whole, p, p.q.data(), p.k.data(), p.v.data(),
                                  p.out.data(), p.dout.data(), p.whole, options, unused);
      // Each query head is the single-head call on its views (dk, dv: the two heads' sum).
      const std::vector<double> sigmas = poslsh::alibi_sigmas(static_cast<int>(heads));
      const std::vector<HashSet> hashes = poslsh::multihead_hashes(sigmas, 3, 5);
      RowMatrix<float> dk_sum = RowMatrix<float>::Zero(n, d),
                       dv_sum = RowMatrix<float>::Zero(n, dv);
      for (Index h = 0; h < heads; ++h) {
        const auto index = static_cast<std::size_t>(h);
        const Config c{method == poslsh::Method::exact_tiled ? BackwardKind::tiled
                       : method == poslsh::Method::lsh_fused ? BackwardKind::fused
                                                             : BackwardKind::per_sample,
                       sigmas[index], 0, hashes[index], options};
        const auto head = [&](const RowMatrix<bf16>& m, Index count, Index width) {
          return ConstMatrixRef<bf16>(
              poslsh::interleaved_heads<const bf16>(m.data(), n, count, width)
                  .head(count == heads ? h : 0));
        };
        const FloatVector lse = p.lse.row(h).transpose();
        const Grads single = setup_backward<bf16>(c, head(p.q, heads, d), head(p.k, kv_heads, d),
                                                  head(p.v, kv_heads, dv), head(p.out, heads, dv),
                                                  lse, head(p.dout, heads, dv));
        CHECK(same_bits(RowMatrix<float>(unit.dq.middleCols(h * d, d)), single.dq));
        dk_sum += single.dk;
        dv_sum += single.dv;
      }
      CHECK(same_bits(unit.dk, dk_sum));
      CHECK(same_bits(unit.dv, dv_sum));
      check_threads(threads, unit, first);
    });
  }
}

TEMPLATE_TEST_CASE("half-precision backward passes name a bad argument", "[half][backward]",
                   Eigen::bfloat16, Eigen::half) {
  using Half = TestType;
  const Index n = 70, d = 8, dv = 6;
  const RowMatrix<Half> q = random_half<Half>(n, d, 1), k = random_half<Half>(n, d, 2),
                        v = random_half<Half>(n, dv, 3), out = random_half<Half>(n, dv, 4),
                        dout = random_half<Half>(n, dv, 5);
  const RowMatrix<Half> k_wide = random_half<Half>(n, d + 1, 6),
                        out_short = random_half<Half>(n - 1, dv, 7),
                        dout_wide = random_half<Half>(n, dv + 1, 8);
  const FloatVector lse = FloatVector::Zero(n), lse_short = FloatVector::Zero(n - 1);
  RowMatrix<float> dq(n, d), dk(n, d), dvg(n, dv), dq_bad(n, d + 1), dv_bad(n + 1, dv);
  const HashSet hashes = poslsh::rbf_hashes(8.0, 2, 3, 0);
  const auto tiled = [&](const RowMatrix<Half>& kk, const RowMatrix<Half>& oo,
                         const FloatVector& ll, const RowMatrix<Half>& gg, RowMatrix<float>& gq,
                         RowMatrix<float>& gv) {
    poslsh::alibi_attention_tiled_backward<Half>(q, kk, v, 8.0, oo, ll, gg, gq, dk, gv);
  };
  require_invalid_argument([&] { tiled(k, out, lse_short, dout, dq, dvg); }, "lse");
  require_invalid_argument([&] { tiled(k_wide, out, lse, dout, dq, dvg); }, "k");
  require_invalid_argument([&] { tiled(k, out_short, lse, dout, dq, dvg); }, "out");
  require_invalid_argument([&] { tiled(k, out, lse, dout_wide, dq, dvg); }, "dout");
  require_invalid_argument([&] { tiled(k, out, lse, dout, dq_bad, dvg); }, "dq");
  require_invalid_argument([&] { tiled(k, out, lse, dout, dq, dv_bad); }, "dv");
  require_invalid_argument(
      [&] {
        poslsh::alibi_attention_banded_backward<Half>(q, k, v, 8.0, -1, out, lse, dout, dq, dk,
                                                      dvg);
      },
      "band");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_fused_backward<Half>(q, k, v, hashes, out, lse_short, dout, dq, dk,
                                                   dvg);
      },
      "lse");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_per_sample_backward<Half>(q, k, v, hashes, out, lse, dout_wide, dq,
                                                        dk, dvg);
      },
      "dout");
  require_invalid_argument(
      [&] {
        poslsh::fixed_blocks_attention_backward<Half>(q, k, v, 8.0, out, lse, dout, dq_bad, dk,
                                                      dvg);
      },
      "dq");
  // All heads (two query heads over one K/V head): an lse of the wrong shape, a dout view of
  // the wrong width.
  const RowMatrix<Half> q2 = random_half<Half>(n, 2 * d, 9),
                        out2 = random_half<Half>(n, 2 * dv, 10),
                        dout2 = random_half<Half>(n, 2 * dv, 11);
  const auto qv = heads_of<const Half>(q2.data(), n, 2, d);
  const auto kv = heads_of<const Half>(k.data(), n, 1, d);
  const auto vv = heads_of<const Half>(v.data(), n, 1, dv);
  const auto ov = heads_of<const Half>(out2.data(), n, 2, dv);
  const auto gv = heads_of<const Half>(dout2.data(), n, 2, dv);
  const RowMatrix<float> heads_lse = RowMatrix<float>::Zero(2, n),
                         heads_lse_bad = RowMatrix<float>::Zero(3, n);
  RowMatrix<float> heads_dq(n, 2 * d), heads_dk(n, d), heads_dv(n, dv);
  const auto dqv = heads_of<float>(heads_dq.data(), n, 2, d);
  const auto dkv = heads_of<float>(heads_dk.data(), n, 1, d);
  const auto dvv = heads_of<float>(heads_dv.data(), n, 1, dv);
  poslsh::MultiHeadOptions options;
  options.method = poslsh::Method::exact_tiled;
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_backward<Half>(qv, kv, vv, ov, heads_lse_bad, gv, dqv, dkv, dvv,
                                                   options);
      },
      "lse");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_backward<Half>(qv, kv, vv, ov, heads_lse,
                                                   heads_of<const Half>(dout2.data(), n, 2, dv - 1),
                                                   dqv, dkv, dvv, options);
      },
      "dout");
}

}  // namespace half_backward
}  // namespace
