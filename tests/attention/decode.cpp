// Decode against the last prefill row (LSH) and against the reference (exact).
#include <poslsh/attention/decode.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/reference/attention.hpp>
#include <poslsh/reference/masks.hpp>

#include "test_support.hpp"

TEMPLATE_TEST_CASE("lsh_attention_decode equals row t of the prefill", "[decode]", float, double) {
  const Index n = 400, d = 16, dv = 8;
  const auto [q, k, v] = random_qkv<TestType>(n, d, dv, 51);
  for (double sigma : {0.5, 4.0, 64.0, 1e6}) {
    const HashSet hashes = poslsh::rbf_hashes(sigma, 16, 8, 2);
    const RowMatrix<TestType> prefill = poslsh::lsh_attention_per_sample<TestType>(q, k, v, hashes);
    for (Index t : {0, 1, 63, 64, 200, 399}) {
      // The cache holds rows 0..t; rows past t must not matter (pass the whole buffer).
      RowMatrix<TestType> out(1, dv);
      poslsh::lsh_attention_decode<TestType>(q.row(t), k, v, t, hashes, out);
      const RowMatrix<TestType> fused_prefix = poslsh::lsh_attention_fused<TestType>(
          q.topRows(t + 1), k.topRows(t + 1), v.topRows(t + 1), hashes);
      INFO("sigma " << sigma << ", t " << t);
      CHECK(poslsh_test::relative_max_error(out, RowMatrix<TestType>(prefill.row(t))) <
            poslsh_test::tolerance<TestType>());
      CHECK(poslsh_test::relative_max_error(out, RowMatrix<TestType>(fused_prefix.row(t))) <
            poslsh_test::tolerance<TestType>());
    }
  }
}

TEMPLATE_TEST_CASE("alibi_attention_decode_exact equals the reference's row t", "[decode]", float,
                   double) {
  const Index n = 300, d = 8;
  const auto [q, k, v] = random_qkv<TestType>(n, d, d, 61);
  for (double sigma : {1.0, 30.0}) {
    const RowMatrix<TestType> reference =
        poslsh::alibi_attention_reference<TestType>(q, k, v, sigma);
    for (Index t : {0, 5, 299}) {
      RowMatrix<TestType> out(1, d);
      poslsh::alibi_attention_decode_exact<TestType>(q.row(t), k, v, t, sigma, out);
      INFO("sigma " << sigma << ", t " << t);
      CHECK(poslsh_test::relative_max_error(out, RowMatrix<TestType>(reference.row(t))) <
            poslsh_test::tolerance<TestType>());
    }
  }
}

TEST_CASE("decode rejects bad arguments", "[decode][invalid]") {
  const auto k = random_matrix<float>(10, 4, 1);
  const auto q = random_matrix<float>(1, 4, 2);
  const auto q2 = random_matrix<float>(2, 4, 2);
  const HashSet hashes = poslsh::rbf_hashes(3.0, 4, 1);
  RowMatrix<float> out(1, 4);
  require_invalid_argument([&] { poslsh::lsh_attention_decode<float>(q, k, k, 10, hashes, out); },
                           "t");
  require_invalid_argument([&] { poslsh::lsh_attention_decode<float>(q, k, k, -1, hashes, out); },
                           "t");
  // Two query rows end at t = 0: more rows than positions 0 .. t.
  require_invalid_argument([&] { poslsh::lsh_attention_decode<float>(q2, k, k, 0, hashes, out); },
                           "query");
  require_invalid_argument([&] { poslsh::lsh_attention_decode<float>(q, k, k, 3, HashSet{}, out); },
                           "hashes");
  poslsh::AttentionOptions bidirectional;
  bidirectional.masking = poslsh::Masking::bidirectional;
  require_invalid_argument(
      [&] { poslsh::lsh_attention_decode<float>(q, k, k, 3, hashes, out, bidirectional); },
      "options.masking");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_decode_exact<float>(q, k, k, 3, 0.0, out); }, "sigma");
  RowMatrix<float> wide(1, 5);
  require_invalid_argument(
      [&] { poslsh::alibi_attention_decode_exact<float>(q, k, k, 3, 1.0, wide); }, "out");
}

TEST_CASE("lsh_decode_first_key is the first key of row t's window in the mean mask", "[decode]") {
  const Index n = 300;
  for (double sigma : {0.5, 4.0, 64.0, 1e6}) {
    const HashSet hashes = poslsh::rbf_hashes(sigma, 16, 3, 1);
    const auto mean = poslsh::mean_mask_dense<double>(hashes, n, poslsh::Masking::causal);
    for (Index t : {0, 1, 63, 64, 200, 299}) {
      Index first = 0;
      while (mean(t, first) == 0.0) ++first;  // the diagonal is always in: first <= t
      INFO("sigma " << sigma << ", t " << t);
      CHECK(poslsh::lsh_decode_first_key(hashes, t) == first);
    }
  }
  poslsh_test::require_invalid_argument(
      [] { poslsh::lsh_decode_first_key(poslsh::rbf_hashes(2.0, 2, 1), -1); }, "t");
  poslsh_test::require_invalid_argument([] { poslsh::lsh_decode_first_key(HashSet{}, 3); },
                                        "hashes");
}
