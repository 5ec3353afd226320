// The fused, count-weighted LSH kernel against the per-sample kernel (same hashes) and the
// dense formula; its pair count against the dense mean mask.
#include <cmath>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/reference/attention.hpp>

#include "lsh_oracle.hpp"
#include "test_support.hpp"

TEMPLATE_TEST_CASE("lsh_attention_fused equals per-sample and the dense formula", "[fused]", float,
                   double) {
  const Index n = 333, d = 16, dv = 8;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 21);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {0.3, 2.0, 16.0, 100.0, 1e6}) {
      for (Index s : {1, 7, 40}) {
        const HashSet hashes = poslsh::rbf_hashes(sigma, s, 99, 4);
        AttentionOptions options = with_masking(masking);
        const RowMatrix<TestType> fused =
            poslsh::lsh_attention_fused<TestType>(q, k, v, hashes, options);
        const RowMatrix<TestType> per_sample =
            poslsh::lsh_attention_per_sample<TestType>(q, k, v, hashes, options);
        const RowMatrix<double> expected =
            poslsh_test::lsh_dense_oracle(q, k, v, hashes, masking, 1.0 / std::sqrt(double(d)));
        INFO("sigma " << sigma << ", s " << s << ", causal " << (masking == Masking::causal));
        CHECK(poslsh_test::relative_max_error(fused, per_sample) <
              poslsh_test::tolerance<TestType>());
        CHECK(poslsh_test::relative_max_error(fused.template cast<double>(), expected) <
              poslsh_test::tolerance<TestType>());
      }
    }
  }
}

TEST_CASE("lsh_fused_pair_count counts the non-zeros of the mean mask", "[fused]") {
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {0.5, 3.0, 25.0}) {
      const HashSet hashes = poslsh::rbf_hashes(sigma, 12, 3, 0);
      const auto mean = poslsh::mean_mask_dense<double>(hashes, 200, masking);
      const long long nonzeros = static_cast<long long>((mean.array() > 0).count());
      INFO("sigma " << sigma);
      CHECK(poslsh::lsh_fused_pair_count(hashes, 200, masking) == nonzeros);
    }
  }
}

TEST_CASE("as s grows the fused output converges to exact ALiBi attention", "[fused]") {
  const Index n = 256, d = 16;
  const double sigma = 8.0;
  const auto [q, k, v] = random_qkv<double>(n, d, d, 31);
  const RowMatrix<double> exact = poslsh::alibi_attention_reference<double>(q, k, v, sigma);
  double previous = INFINITY;
  for (Index s : {4, 64, 1024}) {
    const RowMatrix<double> approx =
        poslsh::lsh_attention_fused<double>(q, k, v, poslsh::rbf_hashes(sigma, s, 77, 0));
    const double error = (approx - exact).norm() / exact.norm();
    INFO("s " << s << ": relative Frobenius error " << error);
    // The error falls like s^-1/2: 16x more samples must at least halve it.
    CHECK(error < 0.5 * previous);
    previous = error;
  }
  CHECK(previous < 0.05);
}

TEMPLATE_TEST_CASE("scores of magnitude 1e4 give finite, correct outputs", "[fused]", float,
                   double) {
  const Index n = 150, d = 4;
  RowMatrix<TestType> q = random_matrix<TestType>(n, d, 41, 100.0);
  RowMatrix<TestType> k = random_matrix<TestType>(n, d, 42, 100.0);
  const auto v = random_matrix<TestType>(n, d, 43);
  AttentionOptions options;
  options.scale = 1.0;  // scores of order 1e4
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    options.masking = masking;
    const HashSet hashes = poslsh::rbf_hashes(10.0, 5, 1, 0);
    const RowMatrix<TestType> fused =
        poslsh::lsh_attention_fused<TestType>(q, k, v, hashes, options);
    const RowMatrix<TestType> per_sample =
        poslsh::lsh_attention_per_sample<TestType>(q, k, v, hashes, options);
    REQUIRE(fused.allFinite());
    REQUIRE(per_sample.allFinite());
    const auto expected = poslsh_test::lsh_dense_oracle(q, k, v, hashes, masking, 1.0);
    CHECK(poslsh_test::relative_max_error(fused.template cast<double>(), expected) <
          poslsh_test::tolerance<TestType>());
    CHECK(poslsh_test::relative_max_error(per_sample.template cast<double>(), expected) <
          poslsh_test::tolerance<TestType>());
  }
}

TEST_CASE("a query whose every weight would underflow against a masked score stays correct",
          "[fused]") {
  // Query 0 sees only key 0 (causal), with score 0, while key 1 (hidden from it, in the same
  // key chunk) scores 1e5: a maximum over all entries would give exp(-1e5) = 0 and 0/0.
  const Index n = 4, d = 1;
  RowMatrix<float> q(n, d), k(n, d), v(n, d);
  q << 1, 1, 1, 1;
  k << 0, 1e5f, 0, 0;
  v << 3, 5, 7, 11;
  AttentionOptions options;
  options.scale = 1.0;
  const HashSet one_block{poslsh::BinHash{1e9, 0.5e9}};
  const RowMatrix<float> fused = poslsh::lsh_attention_fused<float>(q, k, v, one_block, options);
  const RowMatrix<float> per_sample =
      poslsh::lsh_attention_per_sample<float>(q, k, v, one_block, options);
  CHECK(fused(0, 0) == 3.0f);
  CHECK(per_sample(0, 0) == 3.0f);
  CHECK(fused(2, 0) == 5.0f);  // rows >= 1 put all weight on key 1
  CHECK(per_sample(3, 0) == 5.0f);
}

TEST_CASE("lsh_attention_fused rejects bad arguments", "[fused][invalid]") {
  const auto q = random_matrix<float>(6, 4, 1);
  const auto v5 = random_matrix<float>(5, 4, 1);
  const HashSet hashes = poslsh::rbf_hashes(2.0, 3, 1);
  require_invalid_argument([&] { poslsh::lsh_attention_fused<float>(q, q, q, HashSet{}); },
                           "hashes");
  require_invalid_argument([&] { poslsh::lsh_attention_fused<float>(q, q, v5, hashes); }, "v");
  RowMatrix<float> wrong(6, 3);
  require_invalid_argument([&] { poslsh::lsh_attention_fused<float>(q, q, q, hashes, wrong); },
                           "out");
  require_invalid_argument([&] { poslsh::lsh_fused_pair_count(hashes, -1, Masking::causal); }, "n");
}

// Hashes whose widths make i * (1 / width) round below the integer i / width at a bin's first
// position (i = 49, 98, 147, ...): the bins of those positions must be divided
// (TileCounts::exact_bins' fallback).
static HashSet fused_divided_bin_hashes() {
  return {{6.125, 0.0}, {12.25, 0.0}, {24.5, 0.0}, {3.0625, 0.0}, {1.53125, 0.0}};
}

TEST_CASE(
    "the count structure of a query tile: windows by brute force, rectangles as the partitions "
    "give them",
    "[fused][counts]") {
  // TileCounts::build from hashes against (1) each row's window [lo, hi) found by testing
  // every key with BinHash::bin (causal: cut at the query), (2) the build from the stored
  // partitions of the same hashes (the same rectangles in the same order), and (3) the
  // counts c_ij summed from the rectangles against #{k : bin_k(i) = bin_k(j)}.
  const Index n = 300;
  // sigma 16: widths on both sides of TileCounts::walk_width in one hash set.
  std::vector<HashSet> sets;
  for (const double sigma : {0.4, 2.0, 7.0, 16.0, 50.0, 1e4})
    sets.push_back(poslsh::rbf_hashes(sigma, 6, 11, 3));
  sets.push_back(fused_divided_bin_hashes());
  for (const HashSet& hashes : sets) {
    const auto partitions = poslsh::detail::analysis_partitions(hashes, n, "test");
    for (const bool causal : {true, false}) {
      for (const Index i0 : {Index{0}, Index{64}, Index{256}}) {
        const Index rows = std::min<Index>(64, n - i0);
        poslsh::detail::TileCounts from_hashes, from_partitions;
        from_hashes.build(hashes, i0, rows, n, causal);
        from_partitions.build(partitions, i0, rows, n, causal);
        REQUIRE(from_hashes.rectangles.size() == from_partitions.rectangles.size());
        for (std::size_t k = 0; k < from_hashes.rectangles.size(); ++k) {
          const auto& a = from_hashes.rectangles[k];
          const auto& b = from_partitions.rectangles[k];
          CHECK(a.row_begin == b.row_begin);
          CHECK(a.row_end == b.row_end);
          CHECK(a.key_begin == b.key_begin);
          CHECK(a.key_end == b.key_end);
        }
        for (Index r = 0; r < rows; ++r) {
          const Index i = i0 + r;
          Index lo = n, hi = 0;
          for (Index j = 0; j < n; ++j) {
            Index count = 0;
            for (const auto& hash : hashes) count += hash.bin(i) == hash.bin(j) ? 1 : 0;
            Index summed = 0;
            for (const auto& rect : from_hashes.rectangles) {
              summed +=
                  r >= rect.row_begin && r < rect.row_end && j >= rect.key_begin && j < rect.key_end
                      ? 1
                      : 0;
            }
            CHECK(summed == count);
            if (count > 0 && (!causal || j <= i)) {
              lo = std::min(lo, j);
              hi = j + 1;
            }
          }
          const auto index = static_cast<std::size_t>(r);
          CHECK(from_hashes.lo[index] == lo);
          CHECK(from_hashes.hi[index] == hi);
          CHECK(from_partitions.lo[index] == lo);
          CHECK(from_partitions.hi[index] == hi);
        }
        // Rows at an offset in a longer sequence (origin): the bins of the absolute positions,
        // the windows cut to the n positions held.
        const Index origin = 37;
        poslsh::detail::TileCounts shifted;
        shifted.build(hashes, i0, rows, n, causal, origin);
        for (Index r = 0; r < rows; ++r) {
          const Index i = i0 + r;
          Index lo = n, hi = 0;
          for (Index j = 0; j < n; ++j) {
            bool shared = false;
            for (const auto& hash : hashes)
              shared = shared || hash.bin(origin + i) == hash.bin(origin + j);
            if (shared && (!causal || j <= i)) {
              lo = std::min(lo, j);
              hi = j + 1;
            }
          }
          CHECK(shifted.lo[static_cast<std::size_t>(r)] == lo);
          CHECK(shifted.hi[static_cast<std::size_t>(r)] == hi);
        }
      }
    }
  }
}

TEST_CASE("the counts of a short band compared bin by bin equal the counts of the bins",
          "[fused][counts]") {
  // TileCounts::build_by_bins against c_ij = #{k : bin_k(i) = bin_k(j)} computed with
  // BinHash::bin for every row and key of the band, each row's window [lo, hi) against the
  // keys with c > 0 (causal: cut at the query), and zeros for rows past the tile's rows.
  // Sample counts reach every group size of the comparison (16, 8, 4, 2, 1 hashes at once);
  // widths below 1 number positions instead of bins.
  const Index n = 700;
  const Index R = poslsh::detail::TileCounts::compared_rows;
  std::vector<HashSet> sets;
  for (const double sigma : {0.3, 2.0, 8.0, 30.0})
    for (const Index s : {1, 7, 16, 31, 40}) sets.push_back(poslsh::rbf_hashes(sigma, s, 5, 2));
  // The divided bins, and a width below 1 (positions numbered instead of bins) in the same set.
  sets.push_back(fused_divided_bin_hashes());
  sets.back().push_back({0.1, 0.05});
  Index built = 0;
  for (const HashSet& hashes : sets) {
    const Index s = static_cast<Index>(hashes.size());
    for (const bool causal : {true, false}) {
      for (const Index i0 : {Index{0}, Index{64}, Index{320}, Index{670}}) {
        const Index rows = std::min<Index>(R, n - i0);
        poslsh::detail::TileCounts counts;
        if (!counts.build_by_bins(hashes, i0, rows, n, causal)) continue;
        ++built;
        const Index begin = counts.band_begin(), end = counts.band_end();
        INFO("hash set of width " << hashes.front().width << ", s " << s << ", causal " << causal
                                  << ", i0 " << i0);
        REQUIRE(end - begin <= poslsh::detail::TileCounts::max_compared_band);
        REQUIRE(counts.key_counts.size() == (end - begin) * R);
        for (Index r = 0; r < R; ++r) {
          const Index i = i0 + r;
          Index lo = n, hi = 0;
          for (Index j = begin; j < end; ++j) {
            Index count = 0;
            if (r < rows && (!causal || j <= i))
              for (const auto& hash : hashes) count += hash.bin(i) == hash.bin(j) ? 1 : 0;
            CHECK(Index{counts.key_counts((j - begin) * R + r)} == count);
            if (count > 0) lo = std::min(lo, j), hi = j + 1;
          }
          if (r >= rows) continue;
          // No key outside the band shares a bin with the row.
          for (Index j = 0; j < n; ++j) {
            if (j >= begin && j < end) continue;
            bool shared = false;
            for (const auto& hash : hashes) shared = shared || hash.bin(i) == hash.bin(j);
            CHECK_FALSE((shared && (!causal || j <= i)));
          }
          CHECK(counts.lo[static_cast<std::size_t>(r)] == lo);
          CHECK(counts.hi[static_cast<std::size_t>(r)] == hi);
        }
      }
    }
  }
  // A band longer than max_compared_band is not compared.
  poslsh::detail::TileCounts counts;
  CHECK_FALSE(counts.build_by_bins(poslsh::rbf_hashes(1e4, 8, 5, 2), 320, R, n, false));
#if defined(POSLSH_ROW_BYTES)
  CHECK(built > 100);
#else
  CHECK(built == 0);  // no byte compares (AVX-512BW or AVX2): the rectangles are always built
#endif
}
