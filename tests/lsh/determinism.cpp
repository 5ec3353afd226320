// Determinism: the hash generator is the published Philox4x32-10 (Random123's known answers),
// the hashes of fixed keys are pinned, and every kernel gives the same bits on every run and for
// every thread count.
#include <poslsh/poslsh.hpp>

#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <array>
#include <cstdint>
#include <vector>

using poslsh::HashKey;

TEST_CASE("philox4x32_10 gives the Random123 known answers", "[determinism]") {
  // Random123 1.09, tests/kat_vectors: philox4x32 10 (counter, key) -> output.
  struct Known {
    poslsh::detail::PhiloxCounter counter;
    poslsh::detail::PhiloxKey key;
    poslsh::detail::PhiloxCounter output;
  };
  const std::array<Known, 3> known = {{
      {{0u, 0u, 0u, 0u}, {0u, 0u}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  }};
  for (const Known& entry : known) {
    INFO("counter word 0 " << entry.counter[0]);
    CHECK(poslsh::detail::philox4x32_10(entry.counter, entry.key) == entry.output);
  }
}

TEST_CASE("uniform_open_closed maps the extreme words to 2^-53 and 1", "[determinism]") {
  CHECK(poslsh::detail::uniform_open_closed(0u, 0u) == 0x1.0p-53);
  CHECK(poslsh::detail::uniform_open_closed(0u, 0x7ffu) ==
        0x1.0p-53);  // the low 11 bits are dropped
  CHECK(poslsh::detail::uniform_open_closed(0xffffffffu, 0xffffffffu) == 1.0);
  CHECK(poslsh::detail::uniform_open_closed(0x80000000u, 0u) == 0.5 + 0x1.0p-53);
}

TEST_CASE("rbf_hash values of fixed keys are pinned", "[determinism]") {
  // These numbers pin the Philox stream: they were computed once from rbf_hash and are
  // hard-coded so that any change of the generator, of the counter and key layout of
  // (seed, stream, sample), or of the width and offset transforms is caught. Users rely on the
  // same (seed, head, sample) giving the same hash on every platform and release; if this test
  // fails, that promise was broken (bump the major version and say so), not the test.
  struct Pinned {
    double sigma;
    HashKey key;
    double width;
    double offset;
  };
  const std::array<Pinned, 6> pinned = {{
      {1.0, {0, 0, 0}, 0x1.39c074665b7ccp+0, 0x1.9a9cf3dfc5e3ap-1},
      {1.0, {0, 0, 1}, 0x1.92faa266b80e2p-2, 0x1.6c604277e2a67p-4},
      {16.0, {1234, 3, 0}, 0x1.a0d47ad7c8ff6p+3, 0x1.33de67fea1daep+3},
      {16.0, {1234, 3, 15}, 0x1.d2e47cf037cbp+4, 0x1.a990edad8d7eep+4},
      {256.0,
       {0xFFFFFFFFFFFFFFFFull, 0x0123456789ABCDEFull, 0xFEDCBA9876543210ull},
       0x1.5e1da09f9373bp+9,
       0x1.2accf92e03d96p+9},
      {0.5, {42, 7, 1000000}, 0x1.222f8dc8c4bbep-1, 0x1.085e9b7c366ep-1},
  }};
  for (const Pinned& entry : pinned) {
    const BinHash hash = poslsh::rbf_hash(entry.sigma, entry.key);
    INFO("sigma " << entry.sigma << ", seed " << entry.key.seed << ", stream " << entry.key.stream
                  << ", sample " << entry.key.sample);
    CHECK(hash.width == entry.width);
    CHECK(hash.offset == entry.offset);
  }
  // The width scales with sigma exactly (w = -sigma (ln U1 + ln U2)), the offset with it.
  const BinHash unit = poslsh::rbf_hash(1.0, HashKey{0, 0, 0});
  const BinHash scaled = poslsh::rbf_hash(8.0, HashKey{0, 0, 0});
  CHECK(scaled.width == 8.0 * unit.width);
  CHECK(scaled.offset == 8.0 * unit.offset);
}

TEST_CASE("rbf_hashes depends only on (sigma, seed, stream, sample)", "[determinism]") {
  const HashSet long_set = poslsh::rbf_hashes(12.0, 40, 77, 5);
  const HashSet short_set = poslsh::rbf_hashes(12.0, 3, 77, 5);
  REQUIRE(short_set.size() == 3);
  for (std::size_t k = 0; k < long_set.size(); ++k) {
    const BinHash single = poslsh::rbf_hash(12.0, HashKey{77, 5, k});
    INFO("sample " << k);
    CHECK(long_set[k].width == single.width);
    CHECK(long_set[k].offset == single.offset);
    if (k < short_set.size()) {
      CHECK(short_set[k].width == single.width);
      CHECK(short_set[k].offset == single.offset);
    }
  }
  const HashSet again = poslsh::rbf_hashes(12.0, 40, 77, 5);
  for (std::size_t k = 0; k < again.size(); ++k) {
    CHECK(again[k].width == long_set[k].width);
    CHECK(again[k].offset == long_set[k].offset);
  }
  // Other streams and seeds draw other hashes.
  CHECK(poslsh::rbf_hash(12.0, HashKey{77, 6, 0}).width != long_set[0].width);
  CHECK(poslsh::rbf_hash(12.0, HashKey{78, 5, 0}).width != long_set[0].width);
}

namespace {

/// Every kernel's output for one problem, in a fixed order.
std::vector<RowMatrix<float>> all_outputs(const RowMatrix<float>& q, const RowMatrix<float>& k,
                                          const RowMatrix<float>& v, Masking masking) {
  const double sigma = 24.0;
  const HashSet hashes = poslsh::rbf_hashes(sigma, 12, 2024, 1);
  AttentionOptions options = with_masking(masking);
  std::vector<RowMatrix<float>> outputs;
  outputs.push_back(poslsh::lsh_attention_fused<float>(q, k, v, hashes, options));
  outputs.push_back(poslsh::lsh_attention_per_sample<float>(q, k, v, hashes, options));
  outputs.push_back(poslsh::fixed_blocks_attention<float>(q, k, v, sigma, options));
  outputs.push_back(poslsh::alibi_attention_tiled<float>(q, k, v, sigma, options));
  outputs.push_back(poslsh::alibi_attention_banded<float>(q, k, v, sigma, 50, options));
  outputs.push_back(poslsh::alibi_attention_reference<float>(q, k, v, sigma, options));
  // The forwards with lse (query tiles in parallel): the output and the lse.
  for (const bool banded : {false, true}) {
    RowMatrix<float> out(q.rows(), v.cols());
    Eigen::VectorXf lse(q.rows());
    if (banded) {
      poslsh::alibi_attention_banded_with_lse<float>(q, k, v, sigma, 50, out, lse, options);
    } else {
      poslsh::alibi_attention_tiled_with_lse<float>(q, k, v, sigma, out, lse, options);
    }
    outputs.push_back(out);
    outputs.push_back(lse);
  }
  if (masking == Masking::causal) {
    const Index t = q.rows() - 1;
    RowMatrix<float> lsh_row(1, v.cols()), exact_row(1, v.cols());
    poslsh::lsh_attention_decode<float>(q.row(t), k, v, t, hashes, lsh_row);
    poslsh::alibi_attention_decode_exact<float>(q.row(t), k, v, t, sigma, exact_row);
    outputs.push_back(lsh_row);
    outputs.push_back(exact_row);
  }
  // Every multi-head method on 4 query heads over 2 key-value heads ([n, H, d]).
  const Index heads = 4, kv_heads = 2, d = q.cols();
  RowMatrix<float> qh(q.rows(), heads * d), kh(k.rows(), kv_heads * d), vh(v.rows(), kv_heads * d);
  for (Index h = 0; h < heads; ++h) qh.middleCols(h * d, d) = q * static_cast<float>(1 + h);
  for (Index h = 0; h < kv_heads; ++h) {
    kh.middleCols(h * d, d) = k;
    vh.middleCols(h * d, d) = v * static_cast<float>(1 - h);
  }
  for (poslsh::Method method :
       {poslsh::Method::lsh_fused, poslsh::Method::lsh_per_sample, poslsh::Method::fixed_blocks,
        poslsh::Method::exact_tiled, poslsh::Method::exact_banded}) {
    outputs.push_back(
        multihead_of(qh, kh, vh, heads, kv_heads, multihead_options(method, masking, 6, 9)));
  }
  return outputs;
}

}  // namespace

TEST_CASE("every kernel gives the same bits on every run and thread count", "[determinism]") {
  // n = 300 spans several query tiles of every kernel, so the tiles are spread over threads.
  const Index n = 300, d = 16;
  const auto [q, k, v] = random_qkv<float>(n, d, d, 301);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    INFO("causal " << (masking == Masking::causal));
#ifdef _OPENMP
    const int restore = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
    const std::vector<RowMatrix<float>> first = all_outputs(q, k, v, masking);
    const std::vector<RowMatrix<float>> second = all_outputs(q, k, v, masking);
    REQUIRE(first.size() == second.size());
    for (std::size_t r = 0; r < first.size(); ++r) {
      INFO("output " << r << ", same thread count, second run");
      CHECK(first[r] == second[r]);
    }
#ifdef _OPENMP
    for (int threads : {2, 3, 5}) {
      omp_set_num_threads(threads);
      const std::vector<RowMatrix<float>> other = all_outputs(q, k, v, masking);
      for (std::size_t r = 0; r < first.size(); ++r) {
        INFO("output " << r << ", " << threads << " threads against 1");
        CHECK(first[r] == other[r]);
      }
    }
    omp_set_num_threads(restore);
#else
    WARN("built without OpenMP: only repeated runs are compared");
#endif
  }
}
