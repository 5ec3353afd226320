// Bad input across the public entry points: each case must throw std::invalid_argument whose
// message names the argument in single quotes and shows its value ("'name' = value").
#include <limits>
#include <poslsh/analysis/block_stats.hpp>
#include <poslsh/analysis/max_error.hpp>
#include <poslsh/poslsh.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "test_support.hpp"

using poslsh_test::infinity;

namespace {

constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();

/// The value as the checks print it (17 significant digits).
template <typename Value>
std::string printed(const Value& value) {
  std::ostringstream text;
  text.precision(17);
  text << value;
  return text.str();
}

/// require_invalid_argument, and the message also shows the offending value.
template <typename Call, typename Value>
void require_rejected(Call&& call, const std::string& argument, const Value& value) {
  poslsh_test::require_invalid_argument(call, argument);
  const std::string expected = "'" + argument + "' = " + printed(value);
  INFO("expected the message to contain: " << expected);
  try {
    call();
  } catch (const std::invalid_argument& error) {
    INFO("message: " << error.what());
    CHECK(std::string(error.what()).find(expected) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("hash functions reject a bad sigma, s or hash", "[bad_input]") {
  require_rejected([] { poslsh::rbf_hash(0.0, {}); }, "sigma", 0.0);
  require_rejected([] { poslsh::rbf_hash(-2.0, {}); }, "sigma", -2.0);
  require_rejected([] { poslsh::rbf_hash(not_a_number, {}); }, "sigma", not_a_number);
  require_rejected([] { poslsh::rbf_hash(infinity, {}); }, "sigma", infinity);
  // Widths up to 73.5 sigma must stay finite (1e308 used to give width = infinity for some keys).
  require_rejected([] { poslsh::rbf_hash(1e308, {}); }, "sigma", 1e308);
  require_rejected([] { poslsh::rbf_hashes(2.0, 0, 1); }, "samples", 0);
  require_rejected([] { poslsh::rbf_hashes(2.0, -3, 1); }, "samples", -3);
  require_rejected([] { poslsh::rbf_hashes(-infinity, 4, 1); }, "sigma", -infinity);
  require_rejected([] { poslsh::fixed_blocks_hash(-1.0); }, "sigma", -1.0);
  require_rejected([] { poslsh::fixed_blocks_hash(1e308); }, "sigma", 1e308);
}

TEST_CASE("partitions and masks reject bad hashes and sizes", "[bad_input]") {
  require_rejected([] { poslsh::block_boundaries(BinHash{0.0, 0.0}, 10); }, "hash.width", 0.0);
  require_rejected(
      [] {
        poslsh::block_boundaries(BinHash{not_a_number, 0.0}, 10);
      },
      "hash.width", not_a_number);
  require_rejected(
      [] {
        poslsh::block_boundaries(BinHash{infinity, 0.0}, 10);
      },
      "hash.width", infinity);
  require_rejected(
      [] {
        poslsh::block_boundaries(BinHash{0x1.0p-21, 0.0}, 10);
      },
      "hash.width", 0x1.0p-21);
  require_rejected([] { poslsh::block_boundaries(BinHash{1.0, -0.5}, 10); }, "hash.offset", -0.5);
  require_rejected([] { poslsh::block_boundaries(BinHash{2.0, 2.0}, 10); }, "hash.offset", 2.0);
  require_rejected(
      [] {
        poslsh::block_boundaries(BinHash{2.0, not_a_number}, 10);
      },
      "hash.offset", not_a_number);
  require_rejected([] { poslsh::block_boundaries(BinHash{2.0, 0.0}, -1); }, "n", -1);
  require_rejected(
      [] {
        poslsh::bin_mask_dense<double>(BinHash{2.0, 0.0}, -2, Masking::causal);
      },
      "n", -2);
  require_rejected([] { poslsh::mean_mask_dense<float>(HashSet{}, 4, Masking::causal); },
                   "hashes.size()", 0);
  require_rejected([] { poslsh::alibi_kernel_dense<double>(-1, 2.0, Masking::causal); }, "n", -1);
  require_rejected([] { poslsh::alibi_kernel_dense<double>(3, infinity, Masking::causal); },
                   "sigma", infinity);
  require_rejected([] { poslsh::alibi_slopes(0); }, "heads", 0);
  require_rejected([] { poslsh::alibi_sigmas(-4); }, "heads", -4);
}

TEMPLATE_TEST_CASE("the reference kernel rejects bad shapes, sigma and options", "[bad_input]",
                   float, double) {
  const auto q = random_matrix<TestType>(4, 3, 1);
  const auto k_narrow = random_matrix<TestType>(4, 2, 2);
  const auto k_short = random_matrix<TestType>(3, 3, 3);
  const auto v_short = random_matrix<TestType>(3, 3, 4);
  RowMatrix<TestType> out(4, 3), out_tall(5, 3);
  const RowMatrix<TestType> empty_d(4, 0);
  const auto call = [&](auto&&... args) { poslsh::alibi_attention_reference<TestType>(args...); };
  require_rejected([&] { call(q, k_narrow, q, 1.0, out, AttentionOptions{}); }, "k", 2);
  require_rejected([&] { call(q, q, v_short, 1.0, out, AttentionOptions{}); }, "v", 3);
  require_rejected([&] { call(q, k_short, v_short, 1.0, out, AttentionOptions{}); }, "k", 3);
  require_rejected([&] { call(empty_d, empty_d, empty_d, 1.0, out, AttentionOptions{}); }, "q", 0);
  require_rejected([&] { call(q, q, q, 1.0, out_tall, AttentionOptions{}); }, "out", "5x3");
  require_rejected([&] { call(q, q, q, 0.0, out, AttentionOptions{}); }, "sigma", 0.0);
  require_rejected([&] { call(q, q, q, not_a_number, out, AttentionOptions{}); }, "sigma",
                   not_a_number);
  // Output rows that overlap (row stride 2 < 3 columns) would be written over each other.
  std::vector<TestType> buffer(16);
  Eigen::Map<RowMatrix<TestType>, 0, Eigen::OuterStride<>> overlapping(buffer.data(), 4, 3,
                                                                       Eigen::OuterStride<>(2));
  require_rejected([&] { call(q, q, q, 1.0, overlapping, AttentionOptions{}); }, "out", 2);
  AttentionOptions options;
  options.scale = not_a_number;
  require_rejected([&] { call(q, q, q, 1.0, out, options); }, "options.scale", not_a_number);
  options.scale = -infinity;
  require_rejected([&] { call(q, q, q, 1.0, out, options); }, "options.scale", -infinity);
  // Checked even when there is nothing to compute.
  const RowMatrix<TestType> none(0, 3);
  RowMatrix<TestType> out_none(0, 3);
  require_rejected([&] { call(none, none, none, 1.0, out_none, options); }, "options.scale",
                   -infinity);
  AttentionOptions masking;
  masking.masking = static_cast<Masking>(7);
  require_rejected([&] { call(q, q, q, 1.0, out, masking); }, "options.masking", 7);
}

TEMPLATE_TEST_CASE("the LSH kernels reject bad hash sets, shapes and options", "[bad_input]", float,
                   double) {
  const auto q = random_matrix<TestType>(6, 4, 5);
  const auto v = random_matrix<TestType>(6, 2, 6);
  RowMatrix<TestType> out(6, 2), out_wide(6, 4);
  const HashSet hashes = poslsh::rbf_hashes(2.0, 3, 7);
  HashSet with_bad = hashes;
  with_bad.push_back(BinHash{-1.0, 0.0});
  HashSet with_bad_offset = hashes;
  with_bad_offset.push_back(BinHash{3.0, 3.5});
  AttentionOptions options;
  options.scale = infinity;
  require_rejected([&] { poslsh::lsh_attention_per_sample<TestType>(q, q, v, HashSet{}, out); },
                   "hashes", "{}");
  require_rejected([&] { poslsh::lsh_attention_per_sample<TestType>(q, q, v, with_bad, out); },
                   "hash.width", -1.0);
  require_rejected([&] { poslsh::lsh_attention_per_sample<TestType>(q, q, v, hashes, out_wide); },
                   "out", "6x4");
  require_rejected(
      [&] { poslsh::lsh_attention_per_sample<TestType>(q, q, v, hashes, out, options); },
      "options.scale", infinity);
  require_rejected([&] { poslsh::lsh_attention_fused<TestType>(q, q, v, HashSet{}, out); },
                   "hashes", "{}");
  require_rejected([&] { poslsh::lsh_attention_fused<TestType>(q, q, v, with_bad_offset, out); },
                   "hash.offset", 3.5);
  require_rejected([&] { poslsh::lsh_attention_fused<TestType>(q, v, v, hashes, out); }, "k", 2);
  require_rejected([&] { poslsh::lsh_attention_fused<TestType>(q, q, v, hashes, out, options); },
                   "options.scale", infinity);
  require_rejected([&] { poslsh::fixed_blocks_attention<TestType>(q, q, v, not_a_number, out); },
                   "sigma", not_a_number);
  require_rejected(
      [] { poslsh::lsh_fused_pair_count(poslsh::rbf_hashes(2.0, 3, 7), -1, Masking::causal); }, "n",
      -1);
  require_rejected([] { poslsh::lsh_fused_pair_count(HashSet{}, 5, Masking::causal); }, "hashes",
                   "{}");
}

TEST_CASE("every entry point that takes a hash set rejects width 0, a NaN width or offset",
          "[bad_input]") {
  // Hand-built hashes that would turn a bin into a cast of inf or NaN to an integer.
  struct BadHash {
    BinHash hash;
    const char* argument;
    double value;
  };
  const BadHash bad_hashes[] = {{BinHash{0.0, 0.0}, "hash.width", 0.0},
                                {BinHash{not_a_number, 0.0}, "hash.width", not_a_number},
                                {BinHash{2.0, not_a_number}, "hash.offset", not_a_number}};
  const auto q = random_matrix<double>(5, 3, 21);
  RowMatrix<double> out(5, 3), row(1, 3);
  for (const BadHash& bad : bad_hashes) {
    const HashSet set{poslsh::rbf_hash(2.0, {1, 0, 0}), bad.hash};
    INFO("width " << bad.hash.width << ", offset " << bad.hash.offset);
    require_rejected([&] { poslsh::lsh_fused_pair_count(set, 5, Masking::causal); }, bad.argument,
                     bad.value);
    require_rejected([&] { poslsh::block_plans(set, std::vector<Index>{5}); }, bad.argument,
                     bad.value);
    require_rejected([&] { poslsh::block_stats(set, 5); }, bad.argument, bad.value);
    require_rejected([&] { poslsh::lsh_attention_fused<double>(q, q, q, set, out); }, bad.argument,
                     bad.value);
    require_rejected([&] { poslsh::lsh_attention_per_sample<double>(q, q, q, set, out); },
                     bad.argument, bad.value);
    require_rejected([&] { poslsh::lsh_attention_decode<double>(q.row(4), q, q, 4, set, row); },
                     bad.argument, bad.value);
  }
}

TEMPLATE_TEST_CASE("the exact tiled and banded kernels reject bad ranges, bands and sigma",
                   "[bad_input]", float, double) {
  const auto q = random_matrix<TestType>(8, 4, 8);
  RowMatrix<TestType> out(8, 4), rows(3, 4);
  require_rejected([&] { poslsh::alibi_attention_tiled<TestType>(q, q, q, -1.0, out); }, "sigma",
                   -1.0);
  require_rejected([&] { poslsh::alibi_attention_tiled_rows<TestType>(q, q, q, 1.0, -1, 2, rows); },
                   "row_begin", -1);
  require_rejected([&] { poslsh::alibi_attention_tiled_rows<TestType>(q, q, q, 1.0, 9, 9, rows); },
                   "row_begin", 9);
  require_rejected([&] { poslsh::alibi_attention_tiled_rows<TestType>(q, q, q, 1.0, 5, 9, rows); },
                   "row_end", 9);
  require_rejected([&] { poslsh::alibi_attention_tiled_rows<TestType>(q, q, q, 1.0, 5, 4, rows); },
                   "row_end", 4);
  require_rejected([&] { poslsh::alibi_attention_tiled_rows<TestType>(q, q, q, 1.0, 0, 2, rows); },
                   "out", "3x4");
  require_rejected([&] { poslsh::alibi_attention_banded<TestType>(q, q, q, 1.0, -1, out); }, "band",
                   -1);
  require_rejected([&] { poslsh::alibi_attention_banded<TestType>(q, q, q, not_a_number, 4, out); },
                   "sigma", not_a_number);
  require_rejected(
      [&] { poslsh::alibi_attention_banded_rows<TestType>(q, q, q, 1.0, 4, 2, 20, rows); },
      "row_end", 20);
  require_rejected([] { poslsh::band_for_bias_error(4.0, 0.0); }, "eps", 0.0);
  require_rejected([] { poslsh::band_for_bias_error(4.0, 1.0); }, "eps", 1.0);
  require_rejected([] { poslsh::band_for_bias_error(4.0, not_a_number); }, "eps", not_a_number);
  require_rejected([] { poslsh::band_for_bias_error(-4.0, 0.1); }, "sigma", -4.0);
}

TEMPLATE_TEST_CASE("the decoders reject a bad position, query, cache and masking", "[bad_input]",
                   float, double) {
  const auto keys = random_matrix<TestType>(10, 4, 9);
  const auto values = random_matrix<TestType>(10, 3, 10);
  const auto values_short = random_matrix<TestType>(9, 3, 10);
  const auto keys_narrow = random_matrix<TestType>(10, 5, 9);
  const auto query = random_matrix<TestType>(1, 4, 11);
  const auto two_queries = random_matrix<TestType>(2, 4, 11);
  const HashSet hashes = poslsh::rbf_hashes(3.0, 4, 1);
  RowMatrix<TestType> out(1, 3), out_wide(1, 4);
  const auto lsh = [&](auto&&... args) { poslsh::lsh_attention_decode<TestType>(args...); };
  const auto exact = [&](auto&&... args) {
    poslsh::alibi_attention_decode_exact<TestType>(args...);
  };
  require_rejected([&] { lsh(query, keys, values, Index{-1}, hashes, out, AttentionOptions{}); },
                   "t", -1);
  require_rejected([&] { lsh(query, keys, values, Index{10}, hashes, out, AttentionOptions{}); },
                   "t", 10);
  require_rejected(
      // Two query rows end at t = 0: more rows than positions 0 .. t.
      [&] { lsh(two_queries, keys, values, Index{0}, hashes, out, AttentionOptions{}); }, "query",
      2);
  require_rejected(
      [&] { lsh(query, keys_narrow, values, Index{3}, hashes, out, AttentionOptions{}); }, "keys",
      5);
  require_rejected(
      [&] { lsh(query, keys, values_short, Index{3}, hashes, out, AttentionOptions{}); }, "values",
      9);
  require_rejected([&] { lsh(query, keys, values, Index{3}, HashSet{}, out, AttentionOptions{}); },
                   "hashes", "{}");
  require_rejected(
      [&] {
        lsh(query, keys, values, Index{3}, HashSet{BinHash{1.0, 1.0}}, out, AttentionOptions{});
      },
      "hash.offset", 1.0);
  require_rejected(
      [&] { lsh(query, keys, values, Index{3}, hashes, out_wide, AttentionOptions{}); }, "out",
      "1x4");
  AttentionOptions bidirectional;
  bidirectional.masking = Masking::bidirectional;
  require_rejected([&] { lsh(query, keys, values, Index{3}, hashes, out, bidirectional); },
                   "options.masking", "bidirectional");
  require_rejected(
      [&] { exact(query, keys, values, Index{3}, not_a_number, out, AttentionOptions{}); }, "sigma",
      not_a_number);
  require_rejected([&] { exact(query, keys, values, Index{11}, 2.0, out, AttentionOptions{}); },
                   "t", 11);
  AttentionOptions scale;
  scale.scale = not_a_number;
  require_rejected([&] { exact(query, keys, values, Index{3}, 2.0, out, scale); }, "options.scale",
                   not_a_number);
}

TEST_CASE("multihead_attention rejects bad views, head counts and options", "[bad_input]") {
  using poslsh::interleaved_heads;
  const Index n = 5, heads = 4, d = 3;
  const auto q = random_matrix<double>(n, heads * d, 12);
  const auto kv = random_matrix<double>(n, 2 * d, 13);
  RowMatrix<double> out(n, heads * d);
  auto qv = interleaved_heads<const double>(q.data(), n, heads, d);
  auto kvv = interleaved_heads<const double>(kv.data(), n, 2, d);
  auto outv = interleaved_heads<double>(out.data(), n, heads, d);
  const auto call = [&](auto qx, auto kx, auto vx, auto ox, const MultiHeadOptions& options) {
    poslsh::multihead_attention<double>(qx, kx, vx, ox, options);
  };
  const MultiHeadOptions defaults;
  CHECK_NOTHROW(call(qv, kvv, kvv, outv, defaults));

  auto no_heads = qv;
  no_heads.heads = 0;
  require_rejected([&] { call(no_heads, kvv, kvv, outv, defaults); }, "q.heads", 0);
  auto three_kv = interleaved_heads<const double>(q.data(), n, 3, d);
  require_rejected([&] { call(qv, three_kv, three_kv, outv, defaults); }, "k.heads", 3);
  auto one_kv = interleaved_heads<const double>(kv.data(), n, 1, d);
  require_rejected([&] { call(qv, kvv, one_kv, outv, defaults); }, "v.heads", 1);
  auto short_k = interleaved_heads<const double>(kv.data(), n - 1, 2, d);
  require_rejected([&] { call(qv, short_k, kvv, outv, defaults); }, "k.tokens", n - 1);
  require_rejected([&] { call(qv, kvv, short_k, outv, defaults); }, "v.tokens", n - 1);
  auto narrow_k = interleaved_heads<const double>(kv.data(), n, 2, d - 1);
  require_rejected([&] { call(qv, narrow_k, kvv, outv, defaults); }, "k.dim", d - 1);
  auto few_out = interleaved_heads<double>(out.data(), n, 2, d);
  require_rejected([&] { call(qv, kvv, kvv, few_out, defaults); }, "out", "5x2x3");
  auto tight_rows = qv;
  tight_rows.row_stride = d - 1;
  require_rejected([&] { call(tight_rows, kvv, kvv, outv, defaults); }, "q.row_stride", d - 1);
  auto tight_heads = qv;
  tight_heads.head_stride = 1;
  require_rejected([&] { call(tight_heads, kvv, kvv, outv, defaults); }, "q.head_stride", 1);
  auto null_k = kvv;
  null_k.data = nullptr;
  require_rejected([&] { call(qv, null_k, kvv, outv, defaults); }, "k.data", "null");
  // Output heads that share elements (4 heads of 3 columns in rows of 6) would overwrite each
  // other.
  auto overlapping_out = interleaved_heads<double>(out.data(), n, heads, d);
  overlapping_out.row_stride = 2 * d;
  require_rejected([&] { call(qv, kvv, kvv, overlapping_out, defaults); }, "out.head_stride", d);

  MultiHeadOptions options;
  options.sigmas = {1.0, 2.0};
  require_rejected([&] { call(qv, kvv, kvv, outv, options); }, "options.sigmas", 2);
  options.sigmas = {1.0, 2.0, not_a_number, 4.0};
  require_rejected([&] { call(qv, kvv, kvv, outv, options); }, "options.sigmas", not_a_number);
  options = MultiHeadOptions{};
  options.samples = 0;
  require_rejected([&] { call(qv, kvv, kvv, outv, options); }, "options.samples", 0);
  options = MultiHeadOptions{};
  options.method = poslsh::Method::exact_banded;
  options.band_error = 1.5;
  require_rejected([&] { call(qv, kvv, kvv, outv, options); }, "options.band_error", 1.5);
  options = MultiHeadOptions{};
  options.scale = infinity;
  require_rejected([&] { call(qv, kvv, kvv, outv, options); }, "options.scale", infinity);
}

TEST_CASE("block statistics and the max-norm error reject bad sets, n and sigma", "[bad_input]") {
  const HashSet hashes = poslsh::rbf_hashes(4.0, 3, 2);
  require_rejected([] { poslsh::block_stats(HashSet{}, 10); }, "hashes", "{}");
  require_rejected([&] { poslsh::block_stats(hashes, -5); }, "n", -5);
  require_rejected(
      [] {
        poslsh::block_stats(HashSet{BinHash{0.5, 0.75}}, 10);
      },
      "hash.offset", 0.75);
  require_rejected([] { poslsh::block_size_scale(4.0, 2); }, "n", 2);
  require_rejected([] { poslsh::block_size_scale(0.0, 100); }, "sigma", 0.0);
  require_rejected([&] { poslsh::max_error(hashes, 10, 0.0, Masking::causal); }, "sigma", 0.0);
  require_rejected([] { poslsh::max_error(HashSet{}, 10, 1.0, Masking::causal); }, "hashes", "{}");
  require_rejected([&] { poslsh::max_error(hashes, -1, 1.0, Masking::causal); }, "n", -1);
}

TEMPLATE_TEST_CASE("block plans, the block kernel entry point and LseMerger reject bad input",
                   "[bad_input]", float, double) {
  using Vector = Eigen::Matrix<TestType, Eigen::Dynamic, 1>;
  const BinHash hash{3.0, 1.0};
  require_rejected([&] { poslsh::block_plan(hash, Index{-1}); }, "n", -1);
  require_rejected(
      [&] {
        poslsh::block_plan(hash, std::vector<Index>{4, -2});
      },
      "sequence_lengths", -2);
  require_rejected([&] { poslsh::block_plan(hash, std::vector<Index>{Index{1} << 31}); },
                   "sequence_lengths", "0 + 2147483648");
  require_rejected([] { poslsh::block_plan(BinHash{1.0, -1.0}, Index{5}); }, "hash.offset", -1.0);
  require_rejected([] { poslsh::block_plans(HashSet{}, std::vector<Index>{5}); }, "hashes", "{}");
  require_rejected([] { poslsh::fixed_blocks_plan(0.0, std::vector<Index>{5}); }, "sigma", 0.0);

  const auto q = random_matrix<TestType>(6, 4, 14);
  RowMatrix<TestType> out(6, 4), out_short(5, 4);
  require_rejected([&] { poslsh::lsh_attention_by_blocks<TestType>(q, q, q, HashSet{}, out); },
                   "hashes", "{}");
  require_rejected(
      [&] { poslsh::lsh_attention_by_blocks<TestType>(q, q, q, HashSet{hash}, out_short); }, "out",
      "5x4");

  require_rejected([] { poslsh::LseMerger<TestType>(-1, 2); }, "n", -1);
  require_rejected([] { poslsh::LseMerger<TestType>(3, -2); }, "value_cols", -2);
  poslsh::LseMerger<TestType> merger(3, 2);
  const RowMatrix<TestType> output = RowMatrix<TestType>::Zero(3, 2),
                            output_wide = RowMatrix<TestType>::Zero(3, 3);
  require_rejected([&] { merger.add(output_wide, Vector::Zero(3)); }, "output", "3x3");
  require_rejected([&] { merger.add(output, Vector::Zero(4)); }, "lse", 4);
  Vector lse_nan = Vector::Zero(3);
  lse_nan(1) = std::numeric_limits<TestType>::quiet_NaN();
  require_rejected([&] { merger.add(output, lse_nan); }, "lse",
                   std::numeric_limits<TestType>::quiet_NaN());
  RowMatrix<TestType> result_short(2, 2);
  require_rejected([&] { merger.result(result_short); }, "out", "2x2");
}
