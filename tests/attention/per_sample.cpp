// The per-sample LSH kernel (the paper's algorithm) and the fixed-blocks baseline against the
// dense formula D~^-1 (A o M~) V and against plain softmax attention.
#include <cmath>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/reference/attention.hpp>

#include "lsh_oracle.hpp"
#include "test_support.hpp"

TEMPLATE_TEST_CASE("lsh_attention_per_sample equals the dense formula", "[per_sample]", float,
                   double) {
  const Index n = 300, d = 16, dv = 12;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 11);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {0.7, 5.0, 60.0, 400.0}) {
      const HashSet hashes = poslsh::rbf_hashes(sigma, 9, 5, 1);
      AttentionOptions options = with_masking(masking);
      const RowMatrix<TestType> out =
          poslsh::lsh_attention_per_sample<TestType>(q, k, v, hashes, options);
      const RowMatrix<double> expected =
          poslsh_test::lsh_dense_oracle(q, k, v, hashes, masking, 1.0 / std::sqrt(double(d)));
      INFO("sigma " << sigma << ", causal " << (masking == Masking::causal));
      CHECK(poslsh_test::relative_max_error(out.template cast<double>(), expected) <
            poslsh_test::tolerance<TestType>());
    }
  }
}

TEMPLATE_TEST_CASE("one hash whose block covers the sequence gives plain softmax attention",
                   "[per_sample]", float, double) {
  const Index n = 200, d = 8;
  const auto [q, k, v] = random_qkv<TestType>(n, d, d, 1);
  const HashSet one_block{poslsh::BinHash{1e9, 0.5e9}};
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions options = with_masking(masking);
    // Plain softmax attention is ALiBi attention with a vanishing slope: sigma = 1e30 makes
    // every bias |i-j|/sigma < 1e-27, far below rounding.
    const RowMatrix<TestType> plain =
        poslsh::alibi_attention_reference<TestType>(q, k, v, 1e30, options);
    const RowMatrix<TestType> out =
        poslsh::lsh_attention_per_sample<TestType>(q, k, v, one_block, options);
    INFO("causal " << (masking == Masking::causal));
    CHECK(poslsh_test::relative_max_error(out, plain) < poslsh_test::tolerance<TestType>());
  }
}

TEST_CASE("fixed_blocks_attention is plain attention inside blocks of 2 sigma", "[per_sample]") {
  const Index n = 50, d = 4;
  const auto [q, k, v] = random_qkv<double>(n, d, d, 4);
  const RowMatrix<double> out = poslsh::fixed_blocks_attention<double>(q, k, v, 4.0);
  // Blocks [0, 8), [8, 16), ...: each block is its own causal softmax attention.
  for (Index begin = 0; begin < n; begin += 8) {
    const Index size = std::min<Index>(8, n - begin);
    const RowMatrix<double> qb = q.middleRows(begin, size), kb = k.middleRows(begin, size),
                            vb = v.middleRows(begin, size);
    const RowMatrix<double> expected = poslsh::alibi_attention_reference<double>(qb, kb, vb, 1e30);
    INFO("block at " << begin);
    CHECK(poslsh_test::relative_max_error(RowMatrix<double>(out.middleRows(begin, size)),
                                          expected) < 1e-12);
  }
}

TEST_CASE("lsh_attention_per_sample rejects bad arguments", "[per_sample][invalid]") {
  const auto q = random_matrix<float>(6, 4, 1);
  const auto short_k = random_matrix<float>(5, 4, 1);
  const HashSet hashes = poslsh::rbf_hashes(2.0, 3, 1);
  require_invalid_argument([&] { poslsh::lsh_attention_per_sample<float>(q, q, q, HashSet{}); },
                           "hashes");
  require_invalid_argument(
      [&] { poslsh::lsh_attention_per_sample<float>(q, short_k, short_k, hashes); }, "k");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_per_sample<float>(q, q, q, HashSet{poslsh::BinHash{-1, 0}});
      },
      "hash.width");
  require_invalid_argument([&] { poslsh::fixed_blocks_attention<float>(q, q, q, 0.0); }, "sigma");
  const RowMatrix<float> no_columns(6, 0);
  require_invalid_argument(
      [&] { poslsh::lsh_attention_per_sample<float>(no_columns, no_columns, q, hashes); }, "q");
}
