// The tiled streaming exact ALiBi attention against the dense reference, and its row ranges
// against the full call.
#include <cmath>
#include <limits>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/reference/attention.hpp>
#include <type_traits>
#include <vector>

#include "test_support.hpp"

using poslsh_test::tolerance;

namespace {

template <typename Scalar>
bool bitwise_equal(const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() && (a.array() == b.array()).all();
}

}  // namespace

TEMPLATE_TEST_CASE("alibi_attention_tiled equals the dense reference", "[tiled]", float, double) {
  // n around and across the 64-row tiles (partial last tiles, diagonal tiles, n = 1); d_v
  // both a whole number of packets (values read in place) and not (values packed per tile).
  const Index d = 8;
  for (Index n : {1, 2, 7, 63, 64, 65, 130, 200}) {
    for (Index dv : {5, 16}) {
      const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 11, 2.0);
      for (Masking masking : {Masking::causal, Masking::bidirectional}) {
        for (double sigma : {0.01, 0.7, 6.0, 50.0, 1e6}) {
          const auto options = with_masking(masking);
          const RowMatrix<TestType> expected =
              poslsh::alibi_attention_reference<TestType>(q, k, v, sigma, options);
          const RowMatrix<TestType> out =
              poslsh::alibi_attention_tiled<TestType>(q, k, v, sigma, options);
          INFO("n " << n << ", d_v " << dv << ", sigma " << sigma << ", causal "
                    << (masking == Masking::causal));
          REQUIRE(out.rows() == n);
          REQUIRE(out.cols() == dv);
          // Two roundings of the same sums in a different order: Scalar-level agreement.
          CHECK(relative_max_error(out, expected) < tolerance<TestType>());
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("alibi_attention_tiled handles d and d_v of any size", "[tiled]", float,
                   double) {
  const Index n = 97;
  for (Index d : {1, 3, 64, 70}) {
    for (Index dv : {1, 33, 64, 80}) {
      const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 21);
      const RowMatrix<TestType> expected =
          poslsh::alibi_attention_reference<TestType>(q, k, v, 3.0);
      const RowMatrix<TestType> out = poslsh::alibi_attention_tiled<TestType>(q, k, v, 3.0);
      INFO("d " << d << ", d_v " << dv);
      CHECK(relative_max_error(out, expected) < tolerance<TestType>());
    }
  }
}

TEST_CASE("alibi_attention_tiled reads and writes strided head views", "[tiled]") {
  // [n, H, d] buffers: head h of token i is at row i, columns h*d .. h*d+d-1; d_v = 6.
  const Index n = 150, d = 8, dv = 6, heads = 3;
  const auto queries = random_matrix<float>(n, heads * d, 31);
  const auto keys = random_matrix<float>(n, heads * d, 32);
  const auto values = random_matrix<float>(n, heads * dv, 33);
  RowMatrix<float> out_buffer = RowMatrix<float>::Constant(n, heads * dv, 7.0f);
  using ConstMap = Eigen::Map<const RowMatrix<float>, 0, Eigen::OuterStride<>>;
  using Map = Eigen::Map<RowMatrix<float>, 0, Eigen::OuterStride<>>;
  AttentionOptions options;
  options.scale = 0.3;
  for (Index h = 0; h < heads; ++h) {
    const ConstMap q(queries.data() + h * d, n, d, Eigen::OuterStride<>(heads * d));
    const ConstMap k(keys.data() + h * d, n, d, Eigen::OuterStride<>(heads * d));
    const ConstMap v(values.data() + h * dv, n, dv, Eigen::OuterStride<>(heads * dv));
    Map out(out_buffer.data() + h * dv, n, dv, Eigen::OuterStride<>(heads * dv));
    poslsh::alibi_attention_tiled<float>(q, k, v, 4.0 * double(h + 1), out, options);
  }
  for (Index h = 0; h < heads; ++h) {
    const RowMatrix<float> q = queries.middleCols(h * d, d);
    const RowMatrix<float> k = keys.middleCols(h * d, d);
    const RowMatrix<float> v = values.middleCols(h * dv, dv);
    const RowMatrix<float> expected =
        poslsh::alibi_attention_reference<float>(q, k, v, 4.0 * double(h + 1), options);
    INFO("head " << h);
    CHECK(relative_max_error(RowMatrix<float>(out_buffer.middleCols(h * dv, dv)), expected) <
          tolerance<float>());
  }
}

TEMPLATE_TEST_CASE("alibi_attention_tiled_rows equals the full call bit for bit", "[tiled]", float,
                   double) {
  const Index n = 300, d = 16, dv = 12;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 41, 1.5);
  const Index tile = poslsh::tiled_query_tile;
  // Splits on multiples of the tile, and splits anywhere (each row depends on itself alone).
  const std::vector<std::vector<Index>> splits = {
      {0, tile, 2 * tile, 4 * tile, n}, {0, n}, {0, 1, 37, 64, 65, 150, 299, n}, {0, 200, 201, n}};
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const auto options = with_masking(masking);
    const RowMatrix<TestType> full = poslsh::alibi_attention_tiled<TestType>(q, k, v, 5.0, options);
    for (const auto& split : splits) {
      RowMatrix<TestType> pieces = RowMatrix<TestType>::Constant(n, dv, TestType(-3));
      for (std::size_t s = 0; s + 1 < split.size(); ++s) {
        const Index begin = split[s], end = split[s + 1];
        RowMatrix<TestType> rows(end - begin, dv);
        poslsh::alibi_attention_tiled_rows<TestType>(q, k, v, 5.0, begin, end, rows, options);
        pieces.middleRows(begin, end - begin) = rows;
      }
      INFO("split with " << split.size() - 1 << " ranges, causal " << (masking == Masking::causal));
      CHECK(bitwise_equal(pieces, full));
    }
  }
  // An empty range is allowed and writes nothing.
  RowMatrix<TestType> none(0, dv);
  poslsh::alibi_attention_tiled_rows<TestType>(q, k, v, 5.0, 100, 100, none);
}

TEMPLATE_TEST_CASE("alibi_attention_tiled keeps scores of magnitude 1e4 finite and correct",
                   "[tiled]", float, double) {
  // Scores tau q_i.k_j = 1e4 (j % 3) over 200 keys (several tiles): only keys with j % 3 == 2
  // survive (the others trail by 1e4 and get weight exactly 0), weighted by ALiBi alone:
  //   out_i = sum_{j%3=2} e^{-|i-j|} v_j / sum_{j%3=2} e^{-|i-j|}  (causal: j <= i).
  const Index n = 200, d = 2, dv = 3;
  RowMatrix<TestType> q = RowMatrix<TestType>::Zero(n, d);
  RowMatrix<TestType> k = RowMatrix<TestType>::Zero(n, d);
  const auto v = random_matrix<TestType>(n, dv, 51);
  q.col(0).setConstant(TestType(100));
  for (Index j = 0; j < n; ++j) k(j, 0) = TestType(100) * static_cast<TestType>(j % 3);
  AttentionOptions options;
  options.scale = 1.0;
  for (Masking masking : {Masking::bidirectional, Masking::causal}) {
    options.masking = masking;
    const RowMatrix<TestType> out = poslsh::alibi_attention_tiled<TestType>(q, k, v, 1.0, options);
    REQUIRE(out.allFinite());
    for (Index i = 2; i < n; ++i) {
      Eigen::RowVectorXd numerator = Eigen::RowVectorXd::Zero(dv);
      double denominator = 0;
      const Index last = masking == Masking::causal ? i : n - 1;
      for (Index j = 2; j <= last; j += 3) {
        const double weight = std::exp(-std::abs(static_cast<double>(i - j)));
        numerator += weight * v.row(j).template cast<double>();
        denominator += weight;
      }
      INFO("row " << i << ", causal " << (masking == Masking::causal));
      // Scores and distances are integers, exact in Scalar: only exp and the sums round.
      CHECK((out.row(i).template cast<double>() - numerator / denominator).cwiseAbs().maxCoeff() <
            10 * tolerance<TestType>());
    }
  }
}

TEMPLATE_TEST_CASE("alibi_attention_tiled skips the keys a row can no longer read",
                   "[tiled][dead_keys]", float, double) {
  // sigma = 1: key j trails row i's own score by about |i - j| - |tau q_i| (|k_i| + |k_j|), so
  // for |i - j| beyond T = 89 (float; 710 in double) plus a few norms its weight is below the
  // smallest normal Scalar and the kernel drops it: a key tile dead for all the rows of a query
  // tile is never read. A NaN value at key 0 shows it: the far rows stay finite and equal the
  // call with a zero there, bit for bit, while the near rows (which read key 0) are NaN.
  const Index n = 1100, d = 16, dv = 4;
  const Index far = std::is_same_v<TestType, float> ? 300 : 850;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 61);
  RowMatrix<TestType> v_nan = v, v_zero = v;
  v_nan.row(0).setConstant(std::numeric_limits<TestType>::quiet_NaN());
  v_zero.row(0).setZero();
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const auto options = with_masking(masking);
    INFO("causal " << (masking == Masking::causal));
    const RowMatrix<TestType> with_nan =
        poslsh::alibi_attention_tiled<TestType>(q, k, v_nan, 1.0, options);
    const RowMatrix<TestType> with_zero =
        poslsh::alibi_attention_tiled<TestType>(q, k, v_zero, 1.0, options);
    CHECK(std::isnan(with_nan(0, 0)));
    CHECK(bitwise_equal<TestType>(with_nan.bottomRows(n - far), with_zero.bottomRows(n - far)));
    // And the far rows are the dense formula's.
    const RowMatrix<double> expected = poslsh::alibi_attention_reference<double>(
        q.template cast<double>(), k.template cast<double>(), v_zero.template cast<double>(), 1.0,
        options);
    CHECK(relative_max_error(with_zero.bottomRows(n - far).template cast<double>(),
                             expected.bottomRows(n - far)) < tolerance<TestType>());
  }
}

TEMPLATE_TEST_CASE("alibi_attention_tiled keeps a far key whose score carries it",
                   "[tiled][dead_keys]", float, double) {
  // Key 1 is row 1000's query scaled by 400: its score 0.25 * 400 |q|^2 (about 1600) beats the
  // distance of 999, so the bound keeps it alive and it carries the row (out ~ v_1); the rows
  // agree with the dense formula in double, and any split of the rows is the whole call bit
  // for bit (the rule reads the row, its own key and the key alone).
  const Index n = 1100, d = 16, dv = 4;
  auto [q, k, v] = random_qkv<TestType>(n, d, dv, 62);
  k.row(1) = TestType(400) * q.row(1000);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const auto options = with_masking(masking);
    INFO("causal " << (masking == Masking::causal));
    const RowMatrix<TestType> out = poslsh::alibi_attention_tiled<TestType>(q, k, v, 1.0, options);
    const RowMatrix<double> expected = poslsh::alibi_attention_reference<double>(
        q.template cast<double>(), k.template cast<double>(), v.template cast<double>(), 1.0,
        options);
    CHECK(relative_max_error(out.template cast<double>(), expected) < 10 * tolerance<TestType>());
    CHECK((out.row(1000) - v.row(1)).cwiseAbs().maxCoeff() < TestType(1e-3));
    RowMatrix<TestType> pieces(n, dv);
    const std::vector<Index> split = {0, 1, 300, 333, 700, 1000, n};
    for (std::size_t s = 0; s + 1 < split.size(); ++s) {
      RowMatrix<TestType> rows(split[s + 1] - split[s], dv);
      poslsh::alibi_attention_tiled_rows<TestType>(q, k, v, 1.0, split[s], split[s + 1], rows,
                                                   options);
      pieces.middleRows(split[s], rows.rows()) = rows;
    }
    CHECK(bitwise_equal(pieces, out));
  }
}

TEMPLATE_TEST_CASE("the dead-key bound holds for a negative score scale", "[tiled][dead_keys]",
                   float, double) {
  // With tau < 0 the bound on |tau q_i . k_j| is |tau| |q_i| |k_j|; a bound built from tau
  // itself is negative and marks even a row's own key dead (the row then returns 0). Large
  // scores (|q|, |k| about 30 sqrt(d)) and steep slopes (sigma 1e-3: every other key is dead)
  // make the rule decide every tile; the exact and banded kernels must equal the dense formula.
  // |tau| |q_i| |k_i| is about 0.5 * 600 here, above T + 1 (90 in float, 711 in double) for the
  // larger scales.
  const Index n = 150, d = 24, dv = 4;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 63, 5.0);
  const RowMatrix<double> qd = q.template cast<double>(), kd = k.template cast<double>(),
                          vd = v.template cast<double>();
  for (const double scale : {-2.0, -0.5, -0.2, 0.2, 0.5, 2.0}) {
    for (const double sigma : {1e-3, 0.05, 2.0}) {
      for (Masking masking : {Masking::causal, Masking::bidirectional}) {
        auto options = with_masking(masking);
        options.scale = scale;
        INFO("scale " << scale << ", sigma " << sigma << ", causal "
                      << (masking == Masking::causal));
        const RowMatrix<double> expected =
            poslsh::alibi_attention_reference<double>(qd, kd, vd, sigma, options);
        const RowMatrix<TestType> tiled =
            poslsh::alibi_attention_tiled<TestType>(q, k, v, sigma, options);
        const RowMatrix<TestType> banded =
            poslsh::alibi_attention_banded<TestType>(q, k, v, sigma, n, options);
        // The logits reach a few hundred: their rounding in float (about d eps |tau| |q| |k|,
        // up to 4e-3 at |tau| = 2) moves the output by that much relative to |v| <= 4.
        const double limit = std::is_same_v<TestType, float> ? 0.05 : 1e-9;
        CHECK((tiled.template cast<double>() - expected).cwiseAbs().maxCoeff() < limit);
        CHECK((banded.template cast<double>() - expected).cwiseAbs().maxCoeff() < limit);
        // Row 0 of a causal call reads key 0 alone: out_0 = v_0 exactly.
        if (masking == Masking::causal) CHECK(bitwise_equal<TestType>(tiled.row(0), v.row(0)));
      }
    }
  }
}

TEMPLATE_TEST_CASE("alibi_attention_tiled with a vanishing sigma returns V", "[tiled]", float,
                   double) {
  // sigma -> 0 (1/sigma overflows Scalar): every key but j = i gets weight 0, so out = V.
  const Index n = 140, d = 4, dv = 3;
  const auto q = random_matrix<TestType>(n, d, 55);
  const auto v = random_matrix<TestType>(n, dv, 56);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {1e-30, 1e-300, 5e-324}) {
      const RowMatrix<TestType> out =
          poslsh::alibi_attention_tiled<TestType>(q, q, v, sigma, with_masking(masking));
      INFO("sigma " << sigma << ", causal " << (masking == Masking::causal));
      CHECK(relative_max_error(out, v) < tolerance<TestType>());
    }
  }
}

TEST_CASE("alibi_attention_tiled: n = 0 gives an empty result", "[tiled]") {
  const RowMatrix<float> empty(0, 4);
  CHECK(poslsh::alibi_attention_tiled<float>(empty, empty, empty, 1.0).rows() == 0);
  const RowMatrix<double> none(0, 0);
  CHECK(poslsh::alibi_attention_tiled<double>(none, none, none, 1.0).size() == 0);
}

TEST_CASE("alibi_attention_tiled rejects bad arguments", "[tiled][invalid]") {
  require_shape_checks([](const auto& q, const auto& k, const auto& v) {
    poslsh::alibi_attention_tiled<float>(q, k, v, 1.0);
  });
  const auto q = random_matrix<float>(5, 4, 1);
  const auto q6 = random_matrix<float>(6, 4, 1);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Fewer keys than queries: the queries cannot be the last positions of the keys.
  require_invalid_argument([&] { poslsh::alibi_attention_tiled<float>(q6, q, q, 1.0); }, "k");
  require_invalid_argument([&] { poslsh::alibi_attention_tiled<float>(q, q, q, 0.0); }, "sigma");
  require_invalid_argument([&] { poslsh::alibi_attention_tiled<float>(q, q, q, -2.0); }, "sigma");
  require_invalid_argument([&] { poslsh::alibi_attention_tiled<float>(q, q, q, nan); }, "sigma");
  RowMatrix<float> wrong(4, 4);
  require_invalid_argument([&] { poslsh::alibi_attention_tiled<float>(q, q, q, 1.0, wrong); },
                           "out");
  AttentionOptions options;
  options.scale = nan;
  require_invalid_argument([&] { poslsh::alibi_attention_tiled<float>(q, q, q, 1.0, options); },
                           "options.scale");
  RowMatrix<float> rows(2, 4);
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_rows<float>(q, q, q, 1.0, -1, 1, rows); }, "row_begin");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_rows<float>(q, q, q, 1.0, 6, 8, rows); }, "row_begin");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_rows<float>(q, q, q, 1.0, 4, 6, rows); }, "row_end");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_rows<float>(q, q, q, 1.0, 3, 2, rows); }, "row_end");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_rows<float>(q, q, q, 1.0, 1, 4, rows); }, "out");
}
