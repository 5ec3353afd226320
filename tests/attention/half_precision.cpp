// The tile-engine kernels (exact tiled, banded, fused LSH, multi-head) on Eigen::bfloat16 and
// Eigen::half inputs with float products (Precision::float_products): against dense double
// formulas on the rounded inputs (at most 2x the error of the float kernel on the same inputs),
// bitwise against the float kernel on the widened inputs, a half-precision output bitwise the
// float output rounded once, the bias exact at positions past 256 and 65536, and bad input
// named as for float. The matrix units: tests/core/matrix_units.cpp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <poslsh/attention/banded.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/lsh/partition.hpp>
#include <poslsh/multihead/attention.hpp>
#include <poslsh/reference/attention.hpp>
#include <random>
#include <vector>

#include "half_support.hpp"
#include "test_support.hpp"

using poslsh_test::max_error;
using poslsh_test::random_half;
using poslsh_test::same_values;
using poslsh_test::to_double;
using poslsh_test::widened;

namespace {

/// The dense formula of exact ALiBi attention over keys lo <= i - j <= hi, in double, for
/// queries at positions p0 .. p0 + m - 1:
///   out_r = sum_j e^{x_rj} v_j / sum_j e^{x_rj},  x_rj = tau q_r.k_j - |p0 + r - j| / sigma.
RowMatrix<double> dense_alibi(const RowMatrix<double>& q, const RowMatrix<double>& k,
                              const RowMatrix<double>& v, double sigma, double tau, Index lo,
                              Index hi, Index p0 = 0) {
  RowMatrix<double> out(q.rows(), v.cols());
  for (Index r = 0; r < q.rows(); ++r) {
    const Index i = p0 + r;
    const Index first = std::max<Index>(0, i - hi), last = std::min<Index>(k.rows() - 1, i - lo);
    Eigen::VectorXd x(last - first + 1);
    for (Index j = first; j <= last; ++j)
      x(j - first) = tau * q.row(r).dot(k.row(j)) - static_cast<double>(std::abs(i - j)) / sigma;
    const Eigen::VectorXd w = (x.array() - x.maxCoeff()).exp();
    out.row(r) = w.transpose() * v.middleRows(first, last - first + 1) / w.sum();
  }
  return out;
}

/// The dense count-weighted formula of the fused LSH kernel in double, row by row:
///   out_i = sum_j c_ij e^{tau q_i.k_j - M_i} v_j / sum_j c_ij e^{tau q_i.k_j - M_i},
/// c_ij = #{hashes with j in the block of i} (causal: j <= i).
RowMatrix<double> dense_fused(const RowMatrix<double>& q, const RowMatrix<double>& k,
                              const RowMatrix<double>& v, const HashSet& hashes, Masking masking,
                              double tau) {
  const Index n = q.rows();
  RowMatrix<double> out(n, v.cols());
  Eigen::VectorXd counts(n), x(n);
  for (Index i = 0; i < n; ++i) {
    counts.setZero();
    for (const poslsh::BinHash& hash : hashes) {
      const poslsh::Block block = poslsh::block_containing(hash, i, n);
      counts.segment(block.begin, block.end - block.begin).array() += 1.0;
    }
    if (masking == Masking::causal) counts.tail(n - i - 1).setZero();
    x = tau * (k * q.row(i).transpose());
    double row_max = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < n; ++j)
      if (counts(j) > 0) row_max = std::max(row_max, x(j));
    const Eigen::VectorXd w = counts.array() * (x.array() - row_max).exp();
    out.row(i) = w.transpose() * v / w.sum();
  }
  return out;
}

/// One kernel (`kernel<Q, KV, Out>(q, k, v, out)`) checked on rounded inputs: the float-output
/// half kernel within 2x the float kernel's error against `expected` (and bitwise the float
/// kernel on the widened inputs), the half-output kernel bitwise the float output rounded once,
/// and float queries over half-precision K, V the same rule.
template <typename Half, typename Kernel>
void check_kernel(const RowMatrix<Half>& qh, const RowMatrix<Half>& kh, const RowMatrix<Half>& vh,
                  const RowMatrix<double>& expected, Kernel&& kernel) {
  const RowMatrix<float> q = widened(qh), k = widened(kh), v = widened(vh);
  RowMatrix<float> as_float(q.rows(), v.cols()), from_half(q.rows(), v.cols()),
      mixed(q.rows(), v.cols());
  RowMatrix<Half> half_out(q.rows(), v.cols());
  kernel(float{}, float{}, float{}, q, k, v, as_float);
  kernel(Half{}, Half{}, float{}, qh, kh, vh, from_half);
  kernel(Half{}, Half{}, Half{}, qh, kh, vh, half_out);
  kernel(float{}, Half{}, float{}, q, kh, vh, mixed);
  const double float_error = max_error(as_float, expected);
  INFO("float kernel error " << float_error);
  CHECK(float_error < 1e-4);
  CHECK(max_error(from_half, expected) <= 2.0 * float_error);
  CHECK(max_error(mixed, expected) <= 2.0 * float_error);
  CHECK(same_values(from_half, as_float));
  CHECK(same_values(mixed, as_float));
  CHECK(same_values(half_out, as_float.cast<Half>()));
}

/// The tiled, banded and fused kernels on one problem (n x d inputs rounded to Half, sigma,
/// masking): within 2x the float kernel's error against the dense double formulas, bitwise the
/// float kernel on the widened inputs, a half output the float output rounded once.
template <typename Half>
void check_tile_kernels(Index n, Index d, double sigma, Masking masking, std::uint64_t seed) {
  INFO("n " << n << ", d " << d << ", sigma " << sigma << ", causal "
            << (masking == Masking::causal));
  const bool causal = masking == Masking::causal;
  const auto qh = random_half<Half>(n, d, ++seed);
  const auto kh = random_half<Half>(n, d, ++seed);
  const auto vh = random_half<Half>(n, d, ++seed);
  const RowMatrix<double> q = to_double(qh), k = to_double(kh), v = to_double(vh);
  const double tau = 1.0 / std::sqrt(static_cast<double>(d));
  AttentionOptions options = with_masking(masking);
  options.precision = Precision::float_products;
  {
    INFO("alibi_attention_tiled");
    check_kernel<Half>(
        qh, kh, vh, dense_alibi(q, k, v, sigma, tau, causal ? 0 : -n, n),
        [&](auto s, auto kv, auto o, const auto& qx, const auto& kx, const auto& vx, auto& out) {
          poslsh::alibi_attention_tiled<decltype(s), decltype(kv), decltype(o)>(qx, kx, vx, sigma,
                                                                                out, options);
        });
  }
  {
    const Index band = 150;
    INFO("alibi_attention_banded");
    check_kernel<Half>(
        qh, kh, vh, dense_alibi(q, k, v, sigma, tau, causal ? 0 : -band, band),
        [&](auto s, auto kv, auto o, const auto& qx, const auto& kx, const auto& vx, auto& out) {
          poslsh::alibi_attention_banded<decltype(s), decltype(kv), decltype(o)>(
              qx, kx, vx, sigma, band, out, options);
        });
  }
  {
    const HashSet hashes = poslsh::rbf_hashes(sigma, 16, 7, 3);
    INFO("lsh_attention_fused");
    check_kernel<Half>(
        qh, kh, vh, dense_fused(q, k, v, hashes, masking, tau),
        [&](auto s, auto kv, auto o, const auto& qx, const auto& kx, const auto& vx, auto& out) {
          poslsh::lsh_attention_fused<decltype(s), decltype(kv), decltype(o)>(qx, kx, vx, hashes,
                                                                              out, options);
        });
  }
}

}  // namespace

// The sweep (sizes 300 to 777, d 64, 80, 128, three sigmas, both maskings) runs in the release
// stage; the sanitizer stage runs the small problem below through the same checks.
TEMPLATE_TEST_CASE(
    "tile kernels on half-precision inputs: within 2x the float error, output "
    "rounded once",
    "[half][slow]", Eigen::bfloat16, Eigen::half) {
  const Index dims[] = {64, 80, 128};
  const Index sizes[] = {300, 513, 777};
  std::uint64_t seed = 100;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {0.5, 16.0, 1e4}) {
      for (int c = 0; c < 3; ++c) {
        check_tile_kernels<TestType>(sizes[(c + (sigma > 1 ? 1 : 0)) % 3], dims[c], sigma, masking,
                                     seed);
        seed += 3;
      }
    }
  }
}

TEMPLATE_TEST_CASE("tile kernels on half-precision inputs, one small problem per masking", "[half]",
                   Eigen::bfloat16, Eigen::half) {
  for (Masking masking : {Masking::causal, Masking::bidirectional})
    check_tile_kernels<TestType>(130, 80, 16.0, masking, 900);
}

TEST_CASE("bfloat16 kernels at n = 4096 against the dense double formulas", "[half][slow]") {
  using Half = Eigen::bfloat16;
  const Index n = 4096, d = 64;
  const auto [qh, kh, vh] = poslsh_test::random_half_qkv<Half>(n, d, d, 1);
  const RowMatrix<double> q = to_double(qh), k = to_double(kh), v = to_double(vh);
  const double tau = 0.125, sigma = 16.0;
  const HashSet hashes = poslsh::rbf_hashes(sigma, 16, 5, 0);
  AttentionOptions options;
  options.scale = tau;
  options.precision = Precision::float_products;
  check_kernel<Half>(
      qh, kh, vh, dense_fused(q, k, v, hashes, Masking::causal, tau),
      [&](auto s, auto kv, auto o, const auto& qx, const auto& kx, const auto& vx, auto& out) {
        poslsh::lsh_attention_fused<decltype(s), decltype(kv), decltype(o)>(qx, kx, vx, hashes, out,
                                                                            options);
      });
  check_kernel<Half>(
      qh, kh, vh, dense_alibi(q, k, v, sigma, tau, 0, n),
      [&](auto s, auto kv, auto o, const auto& qx, const auto& kx, const auto& vx, auto& out) {
        poslsh::alibi_attention_tiled<decltype(s), decltype(kv), decltype(o)>(qx, kx, vx, sigma,
                                                                              out, options);
      });
}

TEMPLATE_TEST_CASE("half-precision row ranges and returning forms match the whole call", "[half]",
                   Eigen::bfloat16, Eigen::half) {
  using Half = TestType;
  const Index n = 300, d = 64;
  const auto [q, k, v] = poslsh_test::random_half_qkv<Half>(n, d, d, 31);
  const double sigma = 8.0;
  const Index band = 70;
  AttentionOptions options;
  options.precision = Precision::float_products;
  const RowMatrix<Half> tiled = poslsh::alibi_attention_tiled<Half>(q, k, v, sigma, options);
  const RowMatrix<Half> banded =
      poslsh::alibi_attention_banded<Half>(q, k, v, sigma, band, options);
  RowMatrix<float> tiled_float(n, d), banded_float(n, d);
  poslsh::alibi_attention_tiled<Half, Half, float>(q, k, v, sigma, tiled_float, options);
  poslsh::alibi_attention_banded<Half, Half, float>(q, k, v, sigma, band, banded_float, options);
  CHECK(same_values(tiled, tiled_float.cast<Half>()));
  CHECK(same_values(banded, banded_float.cast<Half>()));
  RowMatrix<float> rows_tiled(n, d), rows_banded(n, d);
  for (Index begin : {Index{0}, Index{37}, Index{200}}) {
    const Index end = begin == 0 ? 37 : begin == 37 ? 200 : n;
    poslsh::alibi_attention_tiled_rows<Half, Half, float>(
        q, k, v, sigma, begin, end, rows_tiled.middleRows(begin, end - begin), options);
    poslsh::alibi_attention_banded_rows<Half, Half, float>(
        q, k, v, sigma, band, begin, end, rows_banded.middleRows(begin, end - begin), options);
  }
  CHECK(same_values(rows_tiled, tiled_float));
  CHECK(same_values(rows_banded, banded_float));
  const HashSet hashes = poslsh::rbf_hashes(sigma, 8, 3, 1);
  const RowMatrix<Half> fused = poslsh::lsh_attention_fused<Half>(q, k, v, hashes, options);
  const RowMatrix<float> fused_float =
      poslsh::lsh_attention_fused<float>(widened(q), widened(k), widened(v), hashes);
  CHECK(same_values(fused, fused_float.cast<Half>()));
  // Float queries over a half-precision KV cache, returning form (output in float).
  const RowMatrix<float> mixed = poslsh::lsh_attention_fused<float, Half>(widened(q), k, v, hashes);
  CHECK(same_values(mixed, fused_float));
}

TEST_CASE("bfloat16 queries at positions past 256 and 65536: the bias is exact", "[half]") {
  using Half = Eigen::bfloat16;
  // Row r of a query chunk at offset p0 is the query at position p0 + r: p0 = 66000 and
  // 70000 put it past 65536, where bfloat16 cannot hold the position (nor past 256).
  const Index L = 70003, m = 3, d = 64;
  const auto kh = random_half<Half>(L, d, 41);
  const auto vh = random_half<Half>(L, d, 42);
  const auto all_q = random_half<Half>(L, d, 43);
  const RowMatrix<float> kw = widened(kh), vw = widened(vh);
  const RowMatrix<double> k = kw.cast<double>(), v = vw.cast<double>();
  for (Index p0 : {Index{300}, Index{66000}, Index{70000}}) {
    const RowMatrix<Half> qh = all_q.middleRows(p0, m);
    const RowMatrix<double> q = to_double(qh);
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (double sigma : {16.0, 1e5}) {
        INFO("p0 " << p0 << ", causal " << (masking == Masking::causal) << ", sigma " << sigma);
        AttentionOptions options = with_masking(masking);
        options.query_offset = p0;
        options.precision = Precision::float_products;
        RowMatrix<float> from_half(m, d), from_float(m, d);
        poslsh::alibi_attention_tiled<Half, Half, float>(qh, kh, vh, sigma, from_half, options);
        poslsh::alibi_attention_tiled<float>(widened(qh), kw, vw, sigma, from_float, options);
        CHECK(same_values(from_half, from_float));
        const RowMatrix<double> expected =
            dense_alibi(q, k, v, sigma, 0.125, masking == Masking::causal ? 0 : -L, L, p0);
        // A bias from positions rounded to bfloat16 (steps of 512 past 65536) would move the
        // scores by up to 256 / sigma; the float kernel's error is rounding only.
        CHECK(max_error(from_half, expected) < 1e-5);
      }
    }
    const HashSet hashes = poslsh::rbf_hashes(16.0, 4, 11, 2);
    AttentionOptions options;
    options.query_offset = p0;
    options.precision = Precision::float_products;
    RowMatrix<float> fused_half(m, d);
    poslsh::lsh_attention_fused<Half, Half, float>(qh, kh, vh, hashes, fused_half, options);
    const RowMatrix<float> fused_float =
        poslsh::lsh_attention_fused<float>(widened(qh), kw, vw, hashes, options);
    CHECK(same_values(fused_half, fused_float));
  }
}

TEST_CASE(
    "multihead_attention with bfloat16 K/V (GQA): every method, bitwise the widened float "
    "call",
    "[half]") {
  using Half = Eigen::bfloat16;
  const Index n = 200, heads = 4, kv_heads = 2, d = 64;
  const RowMatrix<float> q = random_matrix<float>(n, heads * d, 51);
  const RowMatrix<Half> kh = random_half<Half>(n, kv_heads * d, 52);
  const RowMatrix<Half> vh = random_half<Half>(n, kv_heads * d, 53);
  const RowMatrix<Half> qh = q.cast<Half>();
  const RowMatrix<float> k = widened(kh), v = widened(vh), q_rounded = widened(qh);
  using poslsh::interleaved_heads;
  for (Method method : {Method::lsh_fused, Method::exact_tiled, Method::exact_banded,
                        Method::lsh_per_sample, Method::fixed_blocks}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      INFO("method " << static_cast<int>(method) << ", causal " << (masking == Masking::causal));
      poslsh::MultiHeadOptions options = multihead_options(method, masking, 4, 3);
      options.precision = Precision::float_products;
      RowMatrix<float> mixed(n, heads * d), from_half(n, heads * d);
      RowMatrix<Half> half_out(n, heads * d);
      const RowMatrix<float> expected = multihead_of(q, k, v, heads, kv_heads, options);
      // Float queries over a bfloat16 KV cache into a float output (ggml's layout).
      poslsh::multihead_attention(interleaved_heads<const float>(q.data(), n, heads, d),
                                  interleaved_heads<const Half>(kh.data(), n, kv_heads, d),
                                  interleaved_heads<const Half>(vh.data(), n, kv_heads, d),
                                  interleaved_heads<float>(mixed.data(), n, heads, d), options);
      CHECK(same_values(mixed, expected));
      // All bfloat16 against the float call on the rounded queries.
      const RowMatrix<float> expected_rounded =
          multihead_of(q_rounded, k, v, heads, kv_heads, options);
      poslsh::multihead_attention<Half, Half, float>(
          interleaved_heads<const Half>(qh.data(), n, heads, d),
          interleaved_heads<const Half>(kh.data(), n, kv_heads, d),
          interleaved_heads<const Half>(vh.data(), n, kv_heads, d),
          interleaved_heads<float>(from_half.data(), n, heads, d), options);
      poslsh::multihead_attention<Half, Half, Half>(
          interleaved_heads<const Half>(qh.data(), n, heads, d),
          interleaved_heads<const Half>(kh.data(), n, kv_heads, d),
          interleaved_heads<const Half>(vh.data(), n, kv_heads, d),
          interleaved_heads<Half>(half_out.data(), n, heads, d), options);
      CHECK(same_values(from_half, expected_rounded));
      CHECK(same_values(half_out, expected_rounded.cast<Half>()));
    }
  }
}

TEST_CASE("multihead_attention_varlen with bfloat16 K/V equals the float call on widened K/V",
          "[half]") {
  using Half = Eigen::bfloat16;
  const Index total = 300, heads = 2, d = 64;
  const RowMatrix<float> q = random_matrix<float>(total, heads * d, 61);
  const RowMatrix<Half> kh = random_half<Half>(total, heads * d, 62);
  const RowMatrix<Half> vh = random_half<Half>(total, heads * d, 63);
  const RowMatrix<float> k = widened(kh), v = widened(vh);
  const std::vector<std::int32_t> cu = {0, 100, 130, 300};
  using poslsh::interleaved_heads;
  for (poslsh::Method method :
       {poslsh::Method::lsh_fused, poslsh::Method::exact_tiled, poslsh::Method::lsh_per_sample}) {
    INFO("method " << static_cast<int>(method));
    poslsh::MultiHeadOptions options;
    options.method = method;
    RowMatrix<float> expected(total, heads * d), mixed(total, heads * d);
    poslsh::multihead_attention_varlen<float>(
        interleaved_heads<const float>(q.data(), total, heads, d),
        interleaved_heads<const float>(k.data(), total, heads, d),
        interleaved_heads<const float>(v.data(), total, heads, d),
        interleaved_heads<float>(expected.data(), total, heads, d), cu, cu, options);
    poslsh::multihead_attention_varlen(interleaved_heads<const float>(q.data(), total, heads, d),
                                       interleaved_heads<const Half>(kh.data(), total, heads, d),
                                       interleaved_heads<const Half>(vh.data(), total, heads, d),
                                       interleaved_heads<float>(mixed.data(), total, heads, d), cu,
                                       cu, options);
    CHECK(same_values(mixed, expected));
  }
}

TEMPLATE_TEST_CASE("widening and rounding of rows: the bits of Eigen's conversions", "[half]",
                   Eigen::bfloat16, Eigen::half) {
  using Half = TestType;
  // Bit for bit, except that a NaN only has to stay a NaN (the packet conversions quiet
  // signalling NaNs, the scalar ones may not).
  const auto differ = [](auto expected, auto actual) {
    using Bits = std::conditional_t<sizeof(expected) == 4, std::uint32_t, std::uint16_t>;
    if (Eigen::numext::isnan(expected)) return !Eigen::numext::isnan(actual);
    return Eigen::numext::bit_cast<Bits>(expected) != Eigen::numext::bit_cast<Bits>(actual);
  };
  // Every 16-bit pattern widened, at every alignment of the packet loop's tail.
  std::vector<Half> all(65536 + 7);
  for (std::size_t i = 0; i < all.size(); ++i)
    all[i] = Eigen::numext::bit_cast<Half>(static_cast<std::uint16_t>(i % 65536));
  std::vector<float> wide(all.size());
  for (Index offset : {0, 1, 7}) {
    const Index count = static_cast<Index>(all.size()) - offset;
    poslsh::detail::tile_widen<float>(all.data() + offset, wide.data(), count);
    Index mismatches = 0;
    for (Index i = 0; i < count; ++i) {
      const float expected = static_cast<float>(all[static_cast<std::size_t>(i + offset)]);
      mismatches += differ(expected, wide[static_cast<std::size_t>(i)]);
    }
    CHECK(mismatches == 0);
  }
  // Floats rounded: random bit patterns (NaNs, infinities, subnormals, ties included) and
  // values halfway between two Half values.
  std::mt19937_64 random(5);
  std::vector<float> values;
  for (int i = 0; i < 100000; ++i)
    values.push_back(Eigen::numext::bit_cast<float>(static_cast<std::uint32_t>(random())));
  for (std::uint32_t bits = 0; bits < 65535; bits += 7) {
    const float low = static_cast<float>(Eigen::numext::bit_cast<Half>(std::uint16_t(bits)));
    const float high = static_cast<float>(Eigen::numext::bit_cast<Half>(std::uint16_t(bits + 1)));
    values.push_back(0.5f * (low + high));
  }
  for (float special :
       {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
        -std::numeric_limits<float>::quiet_NaN(), 65504.0f, 65520.0f, 1e-8f,
        std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()})
    values.push_back(special);
  std::vector<Half> narrow(values.size());
  poslsh::detail::tile_narrow<Half>(values.data(), narrow.data(),
                                    static_cast<Index>(values.size()));
  Index mismatches = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    mismatches += differ(static_cast<Half>(values[i]), narrow[i]);
  }
  CHECK(mismatches == 0);
}

TEST_CASE("half-precision kernels name a bad argument as for float", "[half]") {
  using Half = Eigen::bfloat16;
  const Index n = 70, d = 16;
  const auto q = random_half<Half>(n, d, 71);
  const auto k = random_half<Half>(n, d, 72);
  const auto v = random_half<Half>(n, d, 73);
  const auto narrow_k = random_half<Half>(n, d - 1, 74);
  const auto short_v = random_half<Half>(n - 1, d, 75);
  const HashSet hashes = poslsh::rbf_hashes(4.0, 2, 1);
  RowMatrix<float> out(n, d), wrong_out(n, d + 1);
  RowMatrix<Half> half_out(n - 1, d);
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled<Half, Half, float>(q, narrow_k, v, 4.0, out); }, "k");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled<Half, Half, float>(q, k, short_v, 4.0, out); }, "v");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled<Half, Half, float>(q, k, v, 4.0, wrong_out); }, "out");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled<Half, Half, Half>(q, k, v, 4.0, half_out); }, "out");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled<Half, Half, float>(q, k, v, -1.0, out); }, "sigma");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_rows<Half, Half, float>(q, k, v, 4.0, 5, 3, out); },
      "row_end");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_banded<Half, Half, float>(q, k, v, 4.0, -2, out); }, "band");
  require_invalid_argument(
      [&] {
        poslsh::alibi_attention_banded<float, Half, float>(widened(q), narrow_k, v, 4.0, 3, out);
      },
      "k");
  require_invalid_argument(
      [&] { poslsh::lsh_attention_fused<Half, Half, float>(q, k, v, HashSet{}, out); }, "hashes");
  require_invalid_argument(
      [&] { poslsh::lsh_attention_fused<Half, Half, float>(q, k, short_v, hashes, out); }, "v");
  AttentionOptions options;
  options.query_offset = 3;
  require_invalid_argument(
      [&] { poslsh::lsh_attention_fused<Half, Half, float>(q, k, v, hashes, out, options); },
      "options.query_offset");
  options = AttentionOptions{};
  options.scale = std::numeric_limits<double>::infinity();
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled<Half, Half, float>(q, k, v, 4.0, out, options); },
      "options.scale");
  // Multi-head: three query heads over two bfloat16 KV heads.
  const RowMatrix<float> q3(n, 3 * d);
  RowMatrix<float> out3(n, 3 * d);
  const RowMatrix<Half> kv2(n, 2 * d);
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention(poslsh::interleaved_heads<const float>(q3.data(), n, 3, d),
                                    poslsh::interleaved_heads<const Half>(kv2.data(), n, 2, d),
                                    poslsh::interleaved_heads<const Half>(kv2.data(), n, 2, d),
                                    poslsh::interleaved_heads<float>(out3.data(), n, 3, d));
      },
      "k.heads");
}
