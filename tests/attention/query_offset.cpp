// Queries at an offset (AttentionOptions::query_offset): chunked prefill and multi-token decode
// give bitwise the rows of one prefill, for every method, causal and bidirectional; bottom-right
// alignment when the offset is unset; bad offsets are rejected by name.
#include <poslsh/attention/banded.hpp>
#include <poslsh/attention/decode.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/interop/block_kernel.hpp>
#include <poslsh/reference/attention.hpp>

#include "test_support.hpp"

namespace {

/// The single-head kernels run at an offset (run_kind).
enum class OffsetKind { tiled, banded, fused, per_sample, fixed_blocks };

}  // namespace

namespace poslsh {
POSLSH_ENUM_NAMES(OffsetKind, tiled, banded, fused, per_sample, fixed_blocks);
}  // namespace poslsh

namespace {

template <typename Scalar>
void run_kind(OffsetKind kind, ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
              ConstMatrixRef<Scalar> v, const HashSet& hashes, MatrixRef<Scalar> out,
              const AttentionOptions& options) {
  switch (kind) {
    case OffsetKind::tiled:
      return poslsh::alibi_attention_tiled<Scalar>(q, k, v, 12.0, out, options);
    case OffsetKind::banded:
      return poslsh::alibi_attention_banded<Scalar>(q, k, v, 12.0, 90, out, options);
    case OffsetKind::fused:
      return poslsh::lsh_attention_fused<Scalar>(q, k, v, hashes, out, options);
    case OffsetKind::per_sample:
      return poslsh::lsh_attention_per_sample<Scalar>(q, k, v, hashes, out, options);
    case OffsetKind::fixed_blocks:
      return poslsh::fixed_blocks_attention<Scalar>(q, k, v, 20.0, out, options);
  }
}

bool offset_bitwise_equal(const RowMatrix<float>& a, const RowMatrix<float>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.array() == b.array() || (a.array() != a.array() && b.array() != b.array())).all();
}

}  // namespace

TEST_CASE("chunked prefill equals one prefill bitwise, every method", "[offsets]") {
  const Index n = 1030, d = 16, dv = 24;
  const auto [q, k, v] = random_qkv<float>(n, d, dv, 301);
  const HashSet hashes = poslsh::rbf_hashes(24.0, 4, 9, 1);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (OffsetKind kind : poslsh::enum_values<OffsetKind>()) {
      AttentionOptions options = with_masking(masking);
      RowMatrix<float> full(n, dv);
      run_kind<float>(kind, q, k, v, hashes, full, options);
      for (Index chunk : {1, 7, 64, 1000}) {
        INFO(poslsh::enum_name(kind)
             << (masking == Masking::causal ? " causal" : " bidirectional") << ", chunk " << chunk);
        RowMatrix<float> chunked = full;
        // Single-row chunks: every 5th (the others are the same computation at other rows).
        const Index step = chunk == 1 ? 5 : chunk;
        for (Index p0 = 0; p0 < n; p0 += step) {
          const Index m = std::min(chunk, n - p0);
          RowMatrix<float> out(m, dv);
          AttentionOptions chunk_options = options;
          if (masking == Masking::causal) {
            // The keys so far (bottom-right alignment: p0 = keys - m). For the per-sample
            // kernels the last block of each hash is cut at p0 + m here and at n in the full
            // prefill: the rows must not depend on where their block is cut.
            run_kind<float>(kind, q.middleRows(p0, m), k.topRows(p0 + m), v.topRows(p0 + m), hashes,
                            out, chunk_options);
          } else {
            chunk_options.query_offset = p0;
            run_kind<float>(kind, q.middleRows(p0, m), k, v, hashes, out, chunk_options);
          }
          chunked.middleRows(p0, m) = out;
          INFO("rows " << p0 << " .. " << p0 + m - 1);
          REQUIRE(offset_bitwise_equal(out, full.middleRows(p0, m)));
        }
        if (step == chunk) REQUIRE(offset_bitwise_equal(chunked, full));
      }
    }
  }
}

// Causal chunked prefill of the per-sample kernels with the keys so far, against one prefill of
// all n positions: bitwise equal rows (Q, K, V as given; out in OutScalar).
template <typename Scalar, typename KVScalar>
void offset_check_per_sample_chunks(const RowMatrix<Scalar>& q, const RowMatrix<KVScalar>& k,
                                    const RowMatrix<KVScalar>& v, const HashSet& hashes,
                                    Index chunk) {
  using Out = poslsh::compute_scalar_t<Scalar, KVScalar>;
  const Index n = q.rows(), dv = v.cols();
  RowMatrix<Out> full(n, dv), fixed(n, dv);
  poslsh::lsh_attention_per_sample<Scalar, KVScalar, Out>(q, k, v, hashes, full);
  poslsh::fixed_blocks_attention<Scalar, KVScalar, Out>(q, k, v, 6.0, fixed);
  for (Index p0 = 0; p0 < n; p0 += chunk) {
    const Index m = std::min(chunk, n - p0);
    INFO("chunk " << chunk << ", rows " << p0 << " .. " << p0 + m - 1);
    RowMatrix<Out> out(m, dv);
    poslsh::lsh_attention_per_sample<Scalar, KVScalar, Out>(q.middleRows(p0, m), k.topRows(p0 + m),
                                                            v.topRows(p0 + m), hashes, out);
    REQUIRE((out.array() == full.middleRows(p0, m).array()).all());
    poslsh::fixed_blocks_attention<Scalar, KVScalar, Out>(q.middleRows(p0, m), k.topRows(p0 + m),
                                                          v.topRows(p0 + m), 6.0, out);
    REQUIRE((out.array() == fixed.middleRows(p0, m).array()).all());
  }
}

TEST_CASE(
    "per-sample chunked prefill is bitwise in double, over a bfloat16 cache and on bfloat16 "
    "Q, K, V (the default matrix unit)",
    "[offsets][per_sample]") {
  const Index n = 300;
  const auto [q, k, v] = random_qkv<double>(n, 8, 16, 351);
  const HashSet hashes = poslsh::rbf_hashes(16.0, 3, 11, 2);
  const RowMatrix<float> q_float = q.cast<float>();
  const RowMatrix<Eigen::bfloat16> k_half = k.cast<Eigen::bfloat16>();
  const RowMatrix<Eigen::bfloat16> v_half = v.cast<Eigen::bfloat16>();
  const RowMatrix<Eigen::bfloat16> q_half = q.cast<Eigen::bfloat16>();
  for (Index chunk : {1, 7, 64, 1000}) {
    offset_check_per_sample_chunks<double, double>(q, k, v, hashes, chunk);
    offset_check_per_sample_chunks<float, Eigen::bfloat16>(q_float, k_half, v_half, hashes, chunk);
    offset_check_per_sample_chunks<Eigen::bfloat16, Eigen::bfloat16>(q_half, k_half, v_half, hashes,
                                                                     chunk);
  }
}

TEST_CASE("causal queries at an explicit offset ignore the later keys", "[offsets]") {
  const Index n = 300, d = 8;
  const auto [q, k, v] = random_qkv<float>(n, d, d, 311);
  const HashSet hashes = poslsh::rbf_hashes(10.0, 8, 3, 0);
  for (OffsetKind kind : poslsh::enum_values<OffsetKind>()) {
    INFO(poslsh::enum_name(kind));
    RowMatrix<float> full(n, d);
    run_kind<float>(kind, q, k, v, hashes, full, {});
    // An explicit offset with all n keys: the rows of the kernel on all n positions.
    for (Index p0 : {0, 1, 63, 100, 290}) {
      const Index m = std::min<Index>(10, n - p0);
      AttentionOptions options;
      options.query_offset = p0;
      RowMatrix<float> out(m, d);
      run_kind<float>(kind, q.middleRows(p0, m), k, v, hashes, out, options);
      CHECK(offset_bitwise_equal(out, full.middleRows(p0, m)));
    }
  }
}

TEST_CASE("tiled row ranges of queries at an offset", "[offsets]") {
  const Index n = 500, d = 8, p0 = 130, m = 200;
  const auto [q, k, v] = random_qkv<double>(n, d, d, 321);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions options = with_masking(masking);
    const RowMatrix<double> full = poslsh::alibi_attention_tiled<double>(q, k, v, 7.0, options);
    options.query_offset = p0;
    RowMatrix<double> rows(50, d);
    poslsh::alibi_attention_tiled_rows<double>(q.middleRows(p0, m), k, v, 7.0, 20, 70, rows,
                                               options);
    CHECK((rows.array() == full.middleRows(p0 + 20, 50).array()).all());
    poslsh::alibi_attention_banded_rows<double>(q.middleRows(p0, m), k, v, 7.0, 30, 20, 70, rows,
                                                options);
    const RowMatrix<double> banded =
        poslsh::alibi_attention_banded<double>(q, k, v, 7.0, 30, with_masking(masking));
    CHECK((rows.array() == banded.middleRows(p0 + 20, 50).array()).all());
  }
}

TEST_CASE("multi-token decode: m query rows ending at t", "[offsets][decode]") {
  const Index n = 400, d = 16;
  const auto [q, k, v] = random_qkv<float>(n, d, d, 331);
  const HashSet hashes = poslsh::rbf_hashes(16.0, 16, 4, 2);
  const RowMatrix<float> fused = poslsh::lsh_attention_fused<float>(q, k, v, hashes);
  const RowMatrix<float> exact = poslsh::alibi_attention_tiled<float>(q, k, v, 16.0);
  for (Index t : {3, 64, 399}) {
    for (Index m : {1, 4}) {
      INFO("t " << t << ", m " << m);
      RowMatrix<float> lsh(m, d), alibi(m, d), one(1, d);
      poslsh::lsh_attention_decode<float>(q.middleRows(t - m + 1, m), k, v, t, hashes, lsh);
      poslsh::alibi_attention_decode_exact<float>(q.middleRows(t - m + 1, m), k, v, t, 16.0, alibi);
      for (Index r = 0; r < m; ++r) {
        const Index position = t - m + 1 + r;
        poslsh::lsh_attention_decode<float>(q.row(position), k, v, position, hashes, one);
        CHECK((one.array() == lsh.row(r).array()).all());
        poslsh::alibi_attention_decode_exact<float>(q.row(position), k, v, position, 16.0, one);
        CHECK((one.array() == alibi.row(r).array()).all());
      }
      CHECK(poslsh_test::relative_max_error(lsh, fused.middleRows(t - m + 1, m)) < 2e-5);
      CHECK(poslsh_test::relative_max_error(alibi, exact.middleRows(t - m + 1, m)) < 2e-5);
      // The prefill kernels at the cache's end are the bitwise multi-token decode.
      RowMatrix<float> prefill(m, d);
      poslsh::lsh_attention_fused<float>(q.middleRows(t - m + 1, m), k.topRows(t + 1),
                                         v.topRows(t + 1), hashes, prefill);
      CHECK((prefill.array() == fused.middleRows(t - m + 1, m).array()).all());
    }
  }
}

TEST_CASE("bad query offsets throw naming the argument", "[offsets][bad_input]") {
  const auto q = random_matrix<float>(10, 4, 341);
  const auto k = random_matrix<float>(20, 4, 342);
  const HashSet hashes = poslsh::rbf_hashes(8.0, 2, 1, 0);
  RowMatrix<float> out(10, 4);
  for (Index p0 : {-1, 11, 1000}) {
    AttentionOptions options;
    options.query_offset = p0;
    for (OffsetKind kind : poslsh::enum_values<OffsetKind>()) {
      poslsh_test::require_invalid_argument(
          [&] { run_kind<float>(kind, q, k, k, hashes, out, options); }, "options.query_offset");
    }
  }
  RowMatrix<float> wide(20, 4);
  // Self-attention-only entry points accept no offset but 0.
  AttentionOptions shifted;
  shifted.query_offset = 1;
  poslsh_test::require_invalid_argument(
      [&] { poslsh::alibi_attention_reference<float>(k, k, k, 4.0, wide, shifted); },
      "options.query_offset");
  poslsh_test::require_invalid_argument(
      [&] { poslsh::lsh_attention_by_blocks<float>(k, k, k, hashes, wide, shifted); },
      "options.query_offset");
  // Unset offset: the queries are the last q.rows() keys, so k needs at least as many rows.
  for (OffsetKind kind : poslsh::enum_values<OffsetKind>()) {
    poslsh_test::require_invalid_argument([&] { run_kind<float>(kind, k, q, q, hashes, wide, {}); },
                                          "k");
  }
  RowMatrix<float> two(2, 4);
  poslsh_test::require_invalid_argument(
      [&] { poslsh::lsh_attention_decode<float>(k.topRows(2), q, q, 0, hashes, two); }, "query");
  poslsh_test::require_invalid_argument(
      [&] { poslsh::lsh_attention_decode<float>(k.topRows(2), q, q, 5, hashes, out); }, "out");
}
