// Numerical edge cases: n = 1 and n = 0, d = 1, sigma = 1e-3 (blocks of one position), sigma =
// 1e9 (one block), a vanishing sigma, s = 1 and s = 10000, scores of magnitude 1e4 (also behind
// the causal mask), NaN in Q and in K, and positions near 2^31 in the hash and partition code.
#include <poslsh/analysis/block_stats.hpp>
#include <poslsh/analysis/max_error.hpp>
#include <poslsh/poslsh.hpp>

#include "lsh_oracle.hpp"
#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

using poslsh::Block;
using poslsh_test::infinity;

namespace {

/// softmax_j(tau q_i.k_j - |i-j| / sigma) v_j in double, directly from the definition (causal:
/// j <= i); sigma = infinity gives plain attention without positional bias.
template <typename Scalar>
RowMatrix<double> dense_attention(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                                  const RowMatrix<Scalar>& v, double sigma, Masking masking,
                                  double tau) {
  const Index n = q.rows();
  const RowMatrix<double> scores =
      tau * q.template cast<double>() * k.template cast<double>().transpose();
  RowMatrix<double> out = RowMatrix<double>::Zero(n, v.cols());
  for (Index i = 0; i < n; ++i) {
    const Index last = masking == Masking::causal ? i : n - 1;
    std::vector<double> x(static_cast<std::size_t>(last + 1));
    double top = -infinity;
    for (Index j = 0; j <= last; ++j) {
      x[static_cast<std::size_t>(j)] = scores(i, j) - static_cast<double>(std::abs(i - j)) / sigma;
      top = std::max(top, x[static_cast<std::size_t>(j)]);
    }
    double total = 0.0;
    for (Index j = 0; j <= last; ++j) {
      const double weight = std::exp(x[static_cast<std::size_t>(j)] - top);
      total += weight;
      out.row(i) += weight * v.row(j).template cast<double>();
    }
    out.row(i) /= total;
  }
  return out;
}

/// Every single-head kernel's output on one problem, with its name.
template <typename Scalar>
std::vector<std::pair<std::string, RowMatrix<Scalar>>> every_kernel(
    const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k, const RowMatrix<Scalar>& v,
    double sigma, const HashSet& hashes, const AttentionOptions& options) {
  std::vector<std::pair<std::string, RowMatrix<Scalar>>> outputs;
  outputs.emplace_back("fused", poslsh::lsh_attention_fused<Scalar>(q, k, v, hashes, options));
  outputs.emplace_back("per-sample",
                       poslsh::lsh_attention_per_sample<Scalar>(q, k, v, hashes, options));
  outputs.emplace_back("tiled", poslsh::alibi_attention_tiled<Scalar>(q, k, v, sigma, options));
  outputs.emplace_back("banded, band n",
                       poslsh::alibi_attention_banded<Scalar>(q, k, v, sigma, q.rows(), options));
  outputs.emplace_back("reference",
                       poslsh::alibi_attention_reference<Scalar>(q, k, v, sigma, options));
  return outputs;
}

/// The LSH kernels only (same estimator): fused, per-sample.
template <typename Scalar>
std::vector<std::pair<std::string, RowMatrix<Scalar>>> lsh_kernels(
    const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k, const RowMatrix<Scalar>& v,
    const HashSet& hashes, const AttentionOptions& options) {
  std::vector<std::pair<std::string, RowMatrix<Scalar>>> outputs;
  outputs.emplace_back("fused", poslsh::lsh_attention_fused<Scalar>(q, k, v, hashes, options));
  outputs.emplace_back("per-sample",
                       poslsh::lsh_attention_per_sample<Scalar>(q, k, v, hashes, options));
  return outputs;
}

}  // namespace

TEMPLATE_TEST_CASE("n = 1: every kernel returns the one value row", "[edge]", float, double) {
  // One key: its softmax weight is e^0 / e^0 = 1 whatever the score and the bias.
  const auto [q, k, v] = random_qkv<TestType>(1, 5, 3, 1, 3.0);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {1e-3, 1.0, 1e9}) {
      const AttentionOptions options = with_masking(masking);
      auto outputs =
          every_kernel<TestType>(q, k, v, sigma, poslsh::rbf_hashes(sigma, 4, 5), options);
      outputs.emplace_back("banded, band 0",
                           poslsh::alibi_attention_banded<TestType>(q, k, v, sigma, 0, options));
      outputs.emplace_back("fixed blocks",
                           poslsh::fixed_blocks_attention<TestType>(q, k, v, sigma, options));
      if (masking == Masking::causal) {
        RowMatrix<TestType> lsh(1, 3), exact(1, 3);
        poslsh::lsh_attention_decode<TestType>(q, k, v, 0, poslsh::rbf_hashes(sigma, 4, 5), lsh);
        poslsh::alibi_attention_decode_exact<TestType>(q, k, v, 0, sigma, exact);
        outputs.emplace_back("LSH decode", lsh);
        outputs.emplace_back("exact decode", exact);
      }
      for (const auto& [name, out] : outputs) {
        INFO(name << ", sigma " << sigma << ", causal " << (masking == Masking::causal));
        CHECK(relative_max_error(out, v) < poslsh_test::tolerance<TestType>());
      }
    }
  }
}

TEMPLATE_TEST_CASE("n = 0: every kernel accepts the empty problem", "[edge]", float, double) {
  const RowMatrix<TestType> empty(0, 4), empty_v(0, 2);
  const HashSet hashes = poslsh::rbf_hashes(4.0, 3, 1);
  for (const auto& [name, out] : every_kernel<TestType>(empty, empty, empty_v, 4.0, hashes, {})) {
    INFO(name);
    CHECK(out.rows() == 0);
    CHECK(out.cols() == 2);
  }
  CHECK(poslsh::block_boundaries(hashes.front(), 0) == std::vector<Index>{0});
  CHECK(poslsh::lsh_fused_pair_count(hashes, 0, Masking::causal) == 0);
}

TEMPLATE_TEST_CASE("d = 1 and d_v = 1: kernels equal the dense formulas", "[edge]", float, double) {
  const Index n = 90;
  const auto [q, k, v] = random_qkv<TestType>(n, 1, 1, 11, 2.0);
  const double sigma = 6.0;
  const HashSet hashes = poslsh::rbf_hashes(sigma, 9, 14);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const AttentionOptions options = with_masking(masking);
    const RowMatrix<double> exact =
        dense_attention(q, k, v, sigma, masking, 1.0);  // tau = 1/sqrt(1)
    const RowMatrix<double> lsh = poslsh_test::lsh_dense_oracle(q, k, v, hashes, masking, 1.0);
    for (const auto& [name, out] : every_kernel<TestType>(q, k, v, sigma, hashes, options)) {
      const bool is_lsh = name == "fused" || name == "per-sample";
      INFO(name << ", causal " << (masking == Masking::causal));
      CHECK(relative_max_error(out.template cast<double>(), is_lsh ? lsh : exact) <
            poslsh_test::tolerance<TestType>());
    }
  }
}

TEMPLATE_TEST_CASE("sigma = 1e-3: every block holds one position and attention returns V", "[edge]",
                   float, double) {
  const Index n = 100;
  const double sigma = 1e-3;
  const auto [q, k, v] = random_qkv<TestType>(n, 8, 4, 21);
  const HashSet hashes = poslsh::rbf_hashes(sigma, 16, 24);
  // Widths are at most -2 ln(2^-53) sigma = 0.0735 < 1: no two integer positions share a bin.
  std::vector<Index> singletons(static_cast<std::size_t>(n + 1));
  for (Index i = 0; i <= n; ++i) singletons[static_cast<std::size_t>(i)] = i;
  for (const BinHash& hash : hashes) {
    CHECK(hash.width < 0.0735);
    CHECK(poslsh::block_boundaries(hash, n) == singletons);
  }
  CHECK(poslsh::block_boundaries(poslsh::fixed_blocks_hash(sigma), n) == singletons);
  CHECK(poslsh::block_stats(hashes, n).largest == 1);
  CHECK(poslsh::lsh_fused_pair_count(hashes, n, Masking::bidirectional) == n);
  // Each query sees only itself (LSH), or other keys at weight e^{-1000 |i-j| + O(10)}, which
  // is 0 in float and double (exact kernels): the output is V.
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const AttentionOptions options = with_masking(masking);
    auto outputs = every_kernel<TestType>(q, k, v, sigma, hashes, options);
    outputs.emplace_back("fixed blocks",
                         poslsh::fixed_blocks_attention<TestType>(q, k, v, sigma, options));
    for (const auto& [name, out] : outputs) {
      INFO(name << ", causal " << (masking == Masking::causal));
      CHECK(relative_max_error(out, v) < poslsh_test::tolerance<TestType>());
    }
  }
  RowMatrix<TestType> row(1, 4);
  poslsh::lsh_attention_decode<TestType>(q.row(57), k, v, 57, hashes, row);
  CHECK(relative_max_error(row, RowMatrix<TestType>(v.row(57))) <
        poslsh_test::tolerance<TestType>());
}

TEMPLATE_TEST_CASE("a vanishing sigma (1/sigma beyond the Scalar range) still gives V", "[edge]",
                   float, double) {
  // 1/sigma overflows Scalar: a bias computed as 0 * inf at j = i would be NaN.
  const double sigma = sizeof(TestType) == sizeof(float) ? 1e-40 : 1e-310;
  const Index n = 70;
  const auto q = random_matrix<TestType>(n, 4, 25);
  const auto v = random_matrix<TestType>(n, 3, 26);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const AttentionOptions options = with_masking(masking);
    std::vector<std::pair<std::string, RowMatrix<TestType>>> outputs;
    outputs.emplace_back("tiled", poslsh::alibi_attention_tiled<TestType>(q, q, v, sigma, options));
    outputs.emplace_back("banded",
                         poslsh::alibi_attention_banded<TestType>(q, q, v, sigma, 5, options));
    outputs.emplace_back("reference",
                         poslsh::alibi_attention_reference<TestType>(q, q, v, sigma, options));
    for (const auto& [name, out] : outputs) {
      INFO(name << ", causal " << (masking == Masking::causal));
      CHECK(relative_max_error(out, v) < poslsh_test::tolerance<TestType>());
    }
  }
  for (Index t : {0, 1, 69}) {
    RowMatrix<TestType> row(1, 3);
    poslsh::alibi_attention_decode_exact<TestType>(q.row(t), q, v, t, sigma, row);
    INFO("exact decode, t " << t);
    CHECK(relative_max_error(row, RowMatrix<TestType>(v.row(t))) <
          poslsh_test::tolerance<TestType>());
  }
}

TEMPLATE_TEST_CASE("sigma = 1e9: one block, so LSH attention is plain softmax attention", "[edge]",
                   float, double) {
  const Index n = 200;
  const double sigma = 1e9;
  const auto [q, k, v] = random_qkv<TestType>(n, 8, 4, 31);
  const HashSet hashes = poslsh::rbf_hashes(sigma, 8, 34);
  // A cut falls in [0, n) with probability about n / w, 1e-7 per hash: none for these keys.
  for (const BinHash& hash : hashes)
    CHECK(poslsh::block_boundaries(hash, n) == std::vector<Index>{0, n});
  CHECK(poslsh::block_stats(hashes, n).largest == n);
  const double tau = 1.0 / std::sqrt(8.0);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const AttentionOptions options = with_masking(masking);
    const RowMatrix<double> plain = dense_attention(q, k, v, infinity, masking, tau);
    const RowMatrix<double> exact = dense_attention(q, k, v, sigma, masking, tau);
    for (const auto& [name, out] : every_kernel<TestType>(q, k, v, sigma, hashes, options)) {
      const bool is_lsh = name == "fused" || name == "per-sample";
      INFO(name << ", causal " << (masking == Masking::causal));
      CHECK(relative_max_error(out.template cast<double>(), is_lsh ? plain : exact) <
            poslsh_test::tolerance<TestType>());
      // The exact kernels differ from plain attention by biases below n / sigma = 2e-7, which
      // move each weight by a factor within e^{+-2e-7}: at most 4e-7 relative in the output.
      CHECK(relative_max_error(out.template cast<double>(), plain) <
            std::max(4e-7, poslsh_test::tolerance<TestType>()));
    }
  }
}

TEMPLATE_TEST_CASE("s = 1: the LSH kernels are plain attention inside each block", "[edge]", float,
                   double) {
  const Index n = 150;
  const auto [q, k, v] = random_qkv<TestType>(n, 8, 5, 41);
  const double tau = 1.0 / std::sqrt(8.0);
  for (double sigma : {0.7, 5.0, 40.0}) {
    const HashSet hashes = poslsh::rbf_hashes(sigma, 1, 44);
    const std::vector<Index> edges = poslsh::block_boundaries(hashes.front(), n);
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      // The mask of one sample is block diagonal: each block is an attention problem of its own.
      RowMatrix<double> expected(n, 5);
      for (std::size_t r = 0; r + 1 < edges.size(); ++r) {
        const Index begin = edges[r], size = edges[r + 1] - edges[r];
        const RowMatrix<TestType> qb = q.middleRows(begin, size), kb = k.middleRows(begin, size),
                                  vb = v.middleRows(begin, size);
        expected.middleRows(begin, size) = dense_attention(qb, kb, vb, infinity, masking, tau);
      }
      for (const auto& [name, out] :
           lsh_kernels<TestType>(q, k, v, hashes, with_masking(masking))) {
        INFO(name << ", sigma " << sigma << ", causal " << (masking == Masking::causal));
        CHECK(relative_max_error(out.template cast<double>(), expected) <
              poslsh_test::tolerance<TestType>());
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "s = 10000: the kernels agree and M~ is within the Hoeffding bound of the kernel",
    "[edge][slow]", float, double) {
  const Index n = 48, s = 10000;
  const double sigma = 3.0;
  const auto [q, k, v] = random_qkv<TestType>(n, 8, 4, 51);
  const HashSet hashes = poslsh::rbf_hashes(sigma, s, 54);
#ifdef _OPENMP
  // One thread: the per-sample kernel opens one parallel region per sample, and 10000 of them
  // take seconds on a loaded machine. Thread counts are covered in tests/lsh/determinism.cpp.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
  // The per-sample kernel adds the s sample contributions of a query one after another: its
  // rounding grows to about s eps relative (the fused kernel adds c_ij once per pair).
  const double tolerance =
      std::max(poslsh_test::tolerance<TestType>(),
               static_cast<double>(s) * std::numeric_limits<TestType>::epsilon());
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const RowMatrix<double> expected =
        poslsh_test::lsh_dense_oracle(q, k, v, hashes, masking, 1.0 / std::sqrt(8.0));
    const auto outputs = lsh_kernels<TestType>(q, k, v, hashes, with_masking(masking));
    for (const auto& [name, out] : outputs) {
      INFO(name << ", causal " << (masking == Masking::causal));
      CHECK(out.array().isFinite().all());
      CHECK(relative_max_error(out.template cast<double>(), expected) < tolerance);
    }
    // Each entry of M~ is a mean of s Bernoulli(L*_ij): P[|M~_ij - L*_ij| > 0.03] <=
    // 2 exp(-2 s 0.03^2) = 3e-8, so over n^2 = 2304 entries the bound fails with p < 1e-4.
    const poslsh::MaxError error = poslsh::max_error(hashes, n, sigma, masking);
    INFO("max |M~ - L*| = " << error.value);
    CHECK(error.value < 0.03);
    if (masking == Masking::causal) {
      RowMatrix<TestType> row(1, 4);
      poslsh::lsh_attention_decode<TestType>(q.row(n - 1), k, v, n - 1, hashes, row);
      CHECK(relative_max_error(row.template cast<double>(),
                               RowMatrix<double>(expected.row(n - 1))) < tolerance);
    }
  }
#ifdef _OPENMP
  omp_set_num_threads(threads);
#endif
}

TEMPLATE_TEST_CASE("1e4 scores, seen or behind the causal mask, give the dense formula outputs",
                   "[edge]", float, double) {
  // Integer entries up to 50 in d = 4 with tau = 1: every score is an integer of magnitude up to
  // 1e4, exact in float and double, so only the logits' rounding differs between the kernels
  // and the double formula: a logit near 1e4 carries up to 1e4 eps absolute error (float: 6e-4),
  // which moves each weight by that much relative.
  const Index n = 100, d = 4;
  const double sigma = 5.0;
  const double tolerance = std::max(poslsh_test::tolerance<TestType>(),
                                    4.0 * 1e4 * std::numeric_limits<TestType>::epsilon());
  AttentionOptions options;
  options.scale = 1.0;
  const RowMatrix<TestType> noise = random_matrix<TestType>(n, d, 61, 25.0);
  RowMatrix<TestType> q = noise.array().round().max(TestType(-50)).min(TestType(50)).matrix();
  RowMatrix<TestType> k = random_matrix<TestType>(n, d, 62, 25.0)
                              .array()
                              .round()
                              .max(TestType(-50))
                              .min(TestType(50))
                              .matrix();
  q.row(3).setConstant(50);
  k.row(40).setConstant(50);  // q_3 . k_40 = 1e4
  const auto v = random_matrix<TestType>(n, 3, 63);
  // Second problem: every query is (50, 50, 50, 50); keys of the second half score +1e4 and of
  // the first half -1e4, so causal rows i < n/2 see only -1e4 scores while +1e4 ones hide
  // behind the mask (the running maximum must be over visible entries only).
  RowMatrix<TestType> q_flat = RowMatrix<TestType>::Constant(n, d, 50);
  RowMatrix<TestType> k_split(n, d);
  k_split.topRows(n / 2).setConstant(-50);
  k_split.bottomRows(n - n / 2).setConstant(50);
  const HashSet hashes = poslsh::rbf_hashes(sigma, 12, 64);
  for (const auto& [qq, kk] : {std::make_pair(q, k), std::make_pair(q_flat, k_split)}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      options.masking = masking;
      const RowMatrix<double> exact = dense_attention(qq, kk, v, sigma, masking, 1.0);
      const RowMatrix<double> lsh = poslsh_test::lsh_dense_oracle(qq, kk, v, hashes, masking, 1.0);
      for (const auto& [name, out] : every_kernel<TestType>(qq, kk, v, sigma, hashes, options)) {
        const bool is_lsh = name == "fused" || name == "per-sample";
        INFO(name << ", causal " << (masking == Masking::causal) << ", max |score| "
                  << (qq.template cast<double>() * kk.template cast<double>().transpose())
                         .cwiseAbs()
                         .maxCoeff());
        CHECK(out.array().isFinite().all());
        CHECK(relative_max_error(out.template cast<double>(), is_lsh ? lsh : exact) < tolerance);
      }
      if (masking == Masking::causal) {
        for (Index t : {Index{0}, n / 2 - 1, n - 1}) {
          RowMatrix<TestType> lsh_row(1, 3), exact_row(1, 3);
          poslsh::lsh_attention_decode<TestType>(qq.row(t), kk, v, t, hashes, lsh_row, options);
          poslsh::alibi_attention_decode_exact<TestType>(qq.row(t), kk, v, t, sigma, exact_row,
                                                         options);
          INFO("decode, t " << t);
          CHECK(relative_max_error(lsh_row.template cast<double>(), RowMatrix<double>(lsh.row(t))) <
                tolerance);
          CHECK(relative_max_error(exact_row.template cast<double>(),
                                   RowMatrix<double>(exact.row(t))) < tolerance);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("NaN in row r of Q: row r of the output is NaN, the other rows keep their bits",
                   "[edge]", float, double) {
  // Documented in core/types.hpp: values are not scanned; each output row is computed on its own.
  const Index n = 150;
  const double sigma = 10.0;
  const auto [q, k, v] = random_qkv<TestType>(n, 8, 4, 71);
  const HashSet hashes = poslsh::rbf_hashes(sigma, 8, 74);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const AttentionOptions options = with_masking(masking);
    const auto clean = every_kernel<TestType>(q, k, v, sigma, hashes, options);
    for (Index r : {Index{0}, Index{70}, n - 1}) {
      RowMatrix<TestType> q_nan = q;
      q_nan(r, 3) = std::numeric_limits<TestType>::quiet_NaN();
      const auto dirty = every_kernel<TestType>(q_nan, k, v, sigma, hashes, options);
      for (std::size_t m = 0; m < clean.size(); ++m) {
        INFO(clean[m].first << ", row " << r << ", causal " << (masking == Masking::causal));
        const RowMatrix<TestType>& out = dirty[m].second;
        CHECK(out.row(r).array().isNaN().all());
        for (Index i = 0; i < n; ++i) {
          if (i != r && !(out.row(i) == clean[m].second.row(i))) {
            FAIL_CHECK("row " << i << " changed");
            break;
          }
        }
      }
      if (masking == Masking::causal) {
        RowMatrix<TestType> lsh(1, 4), exact(1, 4);
        poslsh::lsh_attention_decode<TestType>(q_nan.row(r), k, v, r, hashes, lsh);
        poslsh::alibi_attention_decode_exact<TestType>(q_nan.row(r), k, v, r, sigma, exact);
        CHECK(lsh.array().isNaN().all());
        CHECK(exact.array().isNaN().all());
      }
    }
  }
}

TEMPLATE_TEST_CASE("NaN in row j of K: every output row that attends to key j is NaN", "[edge]",
                   float, double) {
  // Documented in core/types.hpp: rows that do not attend to key j may be NaN too (masked entries
  // of a tile are computed before being dropped), so only the attending rows are checked.
  const Index n = 130, j = 60, band = 9;
  const double sigma = 8.0;
  auto k = random_matrix<TestType>(n, 8, 81);
  const auto q = random_matrix<TestType>(n, 8, 82);
  const auto v = random_matrix<TestType>(n, 4, 83);
  k(j, 0) = std::numeric_limits<TestType>::quiet_NaN();
  const HashSet hashes = poslsh::rbf_hashes(sigma, 8, 84);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const AttentionOptions options = with_masking(masking);
    const RowMatrix<double> mean = poslsh::mean_mask_dense<double>(hashes, n, masking);
    auto outputs = every_kernel<TestType>(q, k, v, sigma, hashes, options);
    outputs.emplace_back("banded, band 9",
                         poslsh::alibi_attention_banded<TestType>(q, k, v, sigma, band, options));
    for (const auto& [name, out] : outputs) {
      const bool is_lsh = name == "fused" || name == "per-sample";
      for (Index i = 0; i < n; ++i) {
        const bool visible = masking == Masking::bidirectional || j <= i;
        const bool attends = is_lsh
                                 ? mean(i, j) > 0
                                 : visible && (name != "banded, band 9" || std::abs(i - j) <= band);
        if (attends && !out.row(i).array().isNaN().all()) {
          FAIL_CHECK(name << ": row " << i << " attends to key " << j << " but is not NaN");
          break;
        }
      }
    }
  }
}

TEST_CASE("bins and blocks near position 2^31 follow the integer formula", "[edge]") {
  // width 1.5, offset 0.25: bin(i) = floor((i - 1/4) / (3/2)) = floor((4i - 1) / 6), and the
  // block of bin b is the positions j with 6b + 1 <= 4j < 6b + 7, i.e. j in
  // [ceil((6b + 1) / 4), ceil((6b + 7) / 4)). (4i - 1) / 6 is never within 1/6 of an integer
  // from below, so the double division in bin() cannot round across one.
  const BinHash hash{1.5, 0.25};
  const auto floor_div = [](std::int64_t a, std::int64_t b) {
    return a / b - ((a % b != 0) && ((a < 0) != (b < 0)));
  };
  const auto ceil_div = [&](std::int64_t a, std::int64_t b) { return -floor_div(-a, b); };
  const std::int64_t two31 = std::int64_t{1} << 31;
  for (std::int64_t i : {two31 - 3, two31 - 2, two31 - 1, two31, two31 + 1, 2 * two31 + 5}) {
    const std::int64_t b = floor_div(4 * i - 1, 6);
    INFO("position " << i);
    CHECK(hash.bin(i) == b);
    for (std::int64_t n : {i + 1, i + 2, 2 * two31 + 100}) {
      const Block block = poslsh::block_containing(hash, i, n);
      CHECK(block.begin == ceil_div(6 * b + 1, 4));
      CHECK(block.end == std::min<std::int64_t>(n, ceil_div(6 * b + 7, 4)));
    }
  }
}

TEST_CASE("blocks near 2^31 agree with bin() for any width, without allocating", "[edge]") {
  const Index two31 = Index{1} << 31;
  std::vector<BinHash> hashes = {BinHash{0.75, 0.5},
                                 BinHash{1.0, 0.0},
                                 BinHash{1.0, 0.999},
                                 BinHash{3.7, 1.2},
                                 BinHash{64.0, 63.5},
                                 BinHash{1e6, 12345.678},
                                 BinHash{BinHash::min_width, 0.0}};
  for (double sigma : {1e3, 1e8, 1e9, 1e12}) hashes.push_back(poslsh::rbf_hash(sigma, {7, 7, 7}));
  for (const BinHash& hash : hashes) {
    for (Index i : {two31 - 2, two31 - 1, two31, two31 + 1}) {
      for (Index n : {i + 1, two31 + 10}) {
        INFO("width " << hash.width << ", offset " << hash.offset << ", position " << i << ", n "
                      << n);
        const Block block = poslsh::block_containing(hash, i, n);
        const std::int64_t b = hash.bin(i);
        REQUIRE(block.begin <= i);
        REQUIRE(i < block.end);
        REQUIRE(block.end <= n);
        CHECK(hash.bin(block.begin) == b);
        CHECK(hash.bin(block.end - 1) == b);
        CHECK((block.begin == 0 || hash.bin(block.begin - 1) != b));
        CHECK((block.end == n || hash.bin(block.end) != b));
        CHECK(static_cast<double>(block.size()) <= std::max(1.0, std::ceil(hash.width)));
      }
    }
  }
  // Wide blocks: the boundaries of [0, 2^31 + 10) are few, each consistent with bin().
  for (double sigma : {1e8, 1e9}) {
    const BinHash hash = poslsh::rbf_hash(sigma, {3, 1, 4});
    const Index n = two31 + 10;
    const std::vector<Index> edges = poslsh::block_boundaries(hash, n);
    INFO("sigma " << sigma << ", width " << hash.width << ", blocks " << edges.size() - 1);
    // At most ceil(n / w) + 1 blocks (both ends cut), so n / w + 3 edges.
    CHECK(static_cast<double>(edges.size()) <= static_cast<double>(n) / hash.width + 3.0);
    CHECK(edges.front() == 0);
    CHECK(edges.back() == n);
    for (std::size_t r = 0; r + 1 < edges.size(); ++r) {
      CHECK(hash.bin(edges[r]) == hash.bin(edges[r + 1] - 1));
      if (r > 0) CHECK(hash.bin(edges[r] - 1) != hash.bin(edges[r]));
    }
  }
}
