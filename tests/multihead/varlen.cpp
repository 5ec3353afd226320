// Packed variable-length batches (multihead_attention_varlen) against per-sequence
// multihead_attention calls, bitwise; empty and one-token sequences; sequences with more
// queries than keys against slices and the dense formula; bad cu_seqlens.
#include <cmath>
#include <limits>
#include <poslsh/multihead/attention.hpp>
#include <poslsh/multihead/training.hpp>
#include <poslsh/parallel/slice.hpp>

#include "test_support.hpp"

namespace {

constexpr Index varlen_q_heads = 4, varlen_kv_heads = 2, varlen_dim = 16;

// Each sequence on its own: views of its rows of the packed buffers, options.query_offset =
// the sequence's offset when given.
void per_sequence(const RowMatrix<float>& q, const RowMatrix<float>& k, const RowMatrix<float>& v,
                  RowMatrix<float>& out, const std::vector<std::int32_t>& cu_q,
                  const std::vector<std::int32_t>& cu_k, MultiHeadOptions options,
                  const std::vector<Index>& offsets) {
  for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const Index m = cu_q[b + 1] - cu_q[b], L = cu_k[b + 1] - cu_k[b];
    if (!offsets.empty()) options.query_offset = offsets[b];
    poslsh::multihead_attention<float>(
        poslsh::interleaved_heads<const float>(q.data() + cu_q[b] * q.cols(), m, varlen_q_heads,
                                               varlen_dim),
        poslsh::interleaved_heads<const float>(k.data() + cu_k[b] * k.cols(), L, varlen_kv_heads,
                                               varlen_dim),
        poslsh::interleaved_heads<const float>(v.data() + cu_k[b] * v.cols(), L, varlen_kv_heads,
                                               varlen_dim),
        poslsh::interleaved_heads<float>(out.data() + cu_q[b] * out.cols(), m, varlen_q_heads,
                                         varlen_dim),
        options);
  }
}

}  // namespace

TEST_CASE("packed batches equal per-sequence calls bitwise", "[varlen]") {
  // Lengths: empty, one token, shorter than a tile, several tiles, and q shorter than k
  // (a prefill chunk or decode at the end of each sequence).
  const std::vector<std::int32_t> cu_k = {0, 0, 1, 50, 250, 251, 600};
  const std::vector<std::int32_t> self = cu_k;
  const std::vector<std::int32_t> chunk = {0, 0, 1, 8, 108, 109, 209};
  const auto k = random_matrix<float>(cu_k.back(), varlen_kv_heads * varlen_dim, 401);
  const auto v = random_matrix<float>(cu_k.back(), varlen_kv_heads * varlen_dim, 402);
  for (const auto* cu_q : {&self, &chunk}) {
    const auto q = random_matrix<float>(cu_q->back(), varlen_q_heads * varlen_dim, 403);
    for (bool explicit_offsets : {false, true}) {
      std::vector<Index> offsets;
      if (explicit_offsets)
        for (std::size_t b = 0; b + 1 < cu_q->size(); ++b)
          offsets.push_back(((*cu_q)[b + 1] - (*cu_q)[b]) == (cu_k[b + 1] - cu_k[b]) ? 0 : 1);
      for (Masking masking : {Masking::causal, Masking::bidirectional}) {
        for (Method method : {Method::lsh_fused, Method::exact_tiled, Method::exact_banded,
                              Method::lsh_per_sample, Method::fixed_blocks}) {
          INFO("method " << static_cast<int>(method) << ", causal " << (masking == Masking::causal)
                         << ", chunk " << (cu_q == &chunk) << ", explicit offsets "
                         << explicit_offsets);
          const MultiHeadOptions options = multihead_options(method, masking, 4, 0);
          RowMatrix<float> packed =
              RowMatrix<float>::Constant(q.rows(), varlen_q_heads * varlen_dim, -7.0f);
          RowMatrix<float> expected = packed;
          poslsh::multihead_attention_varlen<float>(
              interleaved_view(q, varlen_q_heads), interleaved_view(k, varlen_kv_heads),
              interleaved_view(v, varlen_kv_heads), interleaved_view(packed, varlen_q_heads), *cu_q,
              cu_k, options, offsets);
          per_sequence(q, k, v, expected, *cu_q, cu_k, options, offsets);
          CHECK((packed.array() == expected.array()).all());
        }
      }
    }
  }
}

TEST_CASE("varlen: one sequence equals multihead_attention", "[varlen]") {
  const Index n = 130;
  const auto q = random_matrix<double>(n, varlen_q_heads * varlen_dim, 411);
  const auto k = random_matrix<double>(n, varlen_kv_heads * varlen_dim, 412);
  RowMatrix<double> a(n, varlen_q_heads * varlen_dim);
  MultiHeadOptions options;
  poslsh::multihead_attention_varlen<double>(
      interleaved_view(q, varlen_q_heads), interleaved_view(k, varlen_kv_heads),
      interleaved_view(k, varlen_kv_heads), interleaved_view(a, varlen_q_heads),
      {0, static_cast<std::int32_t>(n)}, {0, static_cast<std::int32_t>(n)}, options);
  const RowMatrix<double> b = multihead_of(q, k, k, varlen_q_heads, varlen_kv_heads, options);
  CHECK((a.array() == b.array()).all());
}

TEST_CASE("varlen: inconsistent cu_seqlens and offsets throw naming the argument",
          "[varlen][bad_input]") {
  const auto q = random_matrix<float>(20, varlen_q_heads * varlen_dim, 421);
  const auto k = random_matrix<float>(30, varlen_kv_heads * varlen_dim, 422);
  RowMatrix<float> out(20, varlen_q_heads * varlen_dim);
  const auto call = [&](std::vector<std::int32_t> cu_q, std::vector<std::int32_t> cu_k,
                        std::vector<Index> offsets = {}, MultiHeadOptions options = {}) {
    poslsh::multihead_attention_varlen<float>(
        poslsh::interleaved_heads<const float>(q.data(), 20, varlen_q_heads, varlen_dim),
        poslsh::interleaved_heads<const float>(k.data(), 30, varlen_kv_heads, varlen_dim),
        poslsh::interleaved_heads<const float>(k.data(), 30, varlen_kv_heads, varlen_dim),
        poslsh::interleaved_heads<float>(out.data(), 20, varlen_q_heads, varlen_dim), cu_q, cu_k,
        options, offsets);
  };
  call({0, 10, 20}, {0, 15, 30});  // valid
  poslsh_test::require_invalid_argument([&] { call({}, {0, 30}); }, "cu_seqlens_q");
  poslsh_test::require_invalid_argument([&] { call({1, 20}, {0, 30}); }, "cu_seqlens_q");
  poslsh_test::require_invalid_argument(
      [&] {
        call({0, 12, 10, 20}, {0, 1, 2, 30});
      },
      "cu_seqlens_q");
  poslsh_test::require_invalid_argument([&] { call({0, 10, 19}, {0, 15, 30}); }, "cu_seqlens_q");
  poslsh_test::require_invalid_argument([&] { call({0, 10, 20}, {0, 15, 31}); }, "cu_seqlens_k");
  poslsh_test::require_invalid_argument([&] { call({0, 10, 20}, {0, 30}); }, "cu_seqlens_k");
  // Sequence 0 has more queries than keys: valid bottom-right (rows before the first key), not
  // at an explicit offset.
  call({0, 10, 20}, {0, 5, 30});
  poslsh_test::require_invalid_argument(
      [&] {
        call({0, 10, 20}, {0, 5, 30}, {0, 0});
      },
      "query_offsets");
  poslsh_test::require_invalid_argument(
      [&] {
        call({0, 10, 20}, {0, 15, 30}, {0, 6});
      },
      "query_offsets");
  poslsh_test::require_invalid_argument(
      [&] {
        call({0, 10, 20}, {0, 15, 30}, {-1, 0});
      },
      "query_offsets");
  poslsh_test::require_invalid_argument(
      [&] {
        call({0, 10, 20}, {0, 15, 30}, {0});
      },
      "query_offsets");
  MultiHeadOptions with_offset;
  with_offset.query_offset = 0;
  poslsh_test::require_invalid_argument(
      [&] {
        call({0, 10, 20}, {0, 15, 30}, {}, with_offset);
      },
      "options.query_offset");
}

TEST_CASE("varlen: rows before a sequence's first key, FlashAttention's bottom-right alignment",
          "[varlen]") {
  // Sequence 0: 12 queries over 5 keys (rows 0..6 before the first key); 1: 40 over 65; 2: 3
  // queries, no key. Query row i of a sequence of m queries over L keys sits at key position
  // P_i = i - (m - L).
  const std::vector<std::int32_t> cu_q = {0, 12, 52, 55}, cu_k = {0, 5, 70, 70};
  const Index heads = varlen_q_heads, kv_heads = varlen_kv_heads, d = varlen_dim;
  const auto q = random_matrix<double>(cu_q.back(), heads * d, 431);
  const auto k = random_matrix<double>(cu_k.back(), kv_heads * d, 432);
  const auto v = random_matrix<double>(cu_k.back(), kv_heads * d, 433);
  const double inf = std::numeric_limits<double>::infinity();
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const bool causal = masking == Masking::causal;
    for (Method method : {Method::exact_tiled, Method::exact_banded, Method::lsh_fused,
                          Method::lsh_per_sample, Method::fixed_blocks}) {
      INFO("method " << enum_name(method) << ", causal " << causal);
      const MultiHeadOptions options = multihead_options(method, masking, 4, 0);
      RowMatrix<double> out = RowMatrix<double>::Constant(cu_q.back(), heads * d, -7.0);
      RowMatrix<double> lse = RowMatrix<double>::Constant(heads, cu_q.back(), -7.0);
      poslsh::multihead_attention_varlen_with_lse<double>(
          interleaved_view(q, heads), interleaved_view(k, kv_heads), interleaved_view(v, kv_heads),
          interleaved_view(out, heads), lse, cu_q, cu_k, options);
      RowMatrix<double> plain = RowMatrix<double>::Constant(cu_q.back(), heads * d, -7.0);
      poslsh::multihead_attention_varlen<double>(
          interleaved_view(q, heads), interleaved_view(k, kv_heads), interleaved_view(v, kv_heads),
          interleaved_view(plain, heads), cu_q, cu_k, options);
      CHECK((plain.array() == out.array()).all());
      for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
        const Index m = cu_q[b + 1] - cu_q[b], L = cu_k[b + 1] - cu_k[b];
        // The rows that see a key, as a slice at explicit positions: causal rows from their key
        // position (keys from 0), bidirectional rows from the first query (keys from m - L).
        const Index keyless = causal ? std::min(m, std::max<Index>(m - L, 0)) : (L == 0 ? m : 0);
        const Index first = cu_q[b] + keyless, rows = m - keyless;
        for (Index t = cu_q[b]; t < first; ++t) {
          CHECK((out.row(t).array() == 0.0).all());
          CHECK((lse.col(t).array() == -inf).all());
        }
        if (rows == 0) continue;
        RowMatrix<double> slice_out(rows, heads * d), slice_lse(heads, rows);
        const Index query_offset = std::max<Index>(L - m, 0);
        const Index key_offset = causal ? 0 : std::max<Index>(m - L, 0);
        poslsh::multihead_attention_slice<double>(
            poslsh::interleaved_heads<const double>(q.data() + first * q.cols(), rows, heads, d),
            poslsh::interleaved_heads<const double>(k.data() + cu_k[b] * k.cols(), L, kv_heads, d),
            poslsh::interleaved_heads<const double>(v.data() + cu_k[b] * v.cols(), L, kv_heads, d),
            interleaved_view(slice_out, heads), slice_lse, query_offset, key_offset, options);
        CHECK((out.middleRows(first, rows).array() == slice_out.array()).all());
        CHECK((lse.middleCols(first, rows).array() == slice_lse.array()).all());
        if (method != Method::exact_tiled) continue;
        // The dense formula: out_i = sum_j e^{x_ij} v_j / sum_j e^{x_ij}, x_ij = tau q_i . k_j -
        // |P_i - j| / sigma_h over the keys j <= P_i (causal) or every key.
        const std::vector<double> sigmas = poslsh::alibi_sigmas(static_cast<int>(heads));
        const double tau = 1.0 / std::sqrt(static_cast<double>(d));
        for (Index h = 0; h < heads; ++h) {
          const Index g = h / (heads / kv_heads);
          for (Index i = keyless; i < m; ++i) {
            const Index position = i - (m - L);
            Eigen::RowVectorXd sum = Eigen::RowVectorXd::Zero(d);
            double total = 0.0;
            for (Index j = 0; j < L && (!causal || j <= position); ++j) {
              const double x = tau * q.row(cu_q[b] + i)
                                         .segment(h * d, d)
                                         .dot(k.row(cu_k[b] + j).segment(g * d, d)) -
                               std::abs(static_cast<double>(position - j)) / sigmas[h];
              const double w = std::exp(x);
              sum += w * v.row(cu_k[b] + j).segment(g * d, d);
              total += w;
            }
            const Index t = cu_q[b] + i;
            CHECK((out.row(t).segment(h * d, d) - sum / total).cwiseAbs().maxCoeff() < 1e-12);
            CHECK(std::abs(lse(h, t) - std::log(total)) < 1e-12);
          }
        }
      }
    }
  }
}
