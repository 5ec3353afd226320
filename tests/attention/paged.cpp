// Paged KV caches: the fused LSH and exact tiled kernels through a block table equal the
// contiguous kernels bitwise (prefill, chunked prefill across page boundaries, decode); the
// all-heads multihead_attention_paged of every method and cache dtype equals the same call on
// the gathered cache bitwise for any page size; bad caches are rejected by name.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/paged.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/multihead/paged.hpp>
#include <poslsh/reference/attention.hpp>
#include <random>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "amx_emulation.hpp"
#include "test_support.hpp"

using poslsh::PagedKV;

namespace {

constexpr Index paged_kv_heads = 2, paged_dim = 16, paged_value_dim = 24;

// A page pool holding the [n, heads, d] keys and [n, heads, d_v] values of one sequence (k and
// v are n x heads d and n x heads d_v) in shuffled pages, with spare pages of NaN (never read).
template <typename Scalar>
struct PagedPool {
  std::vector<Scalar> k_pool, v_pool;
  std::vector<std::int32_t> table, lengths;
  PagedKV<Scalar> view;

  PagedPool(const RowMatrix<Scalar>& k, const RowMatrix<Scalar>& v, Index heads, Index page_size,
            std::uint64_t seed) {
    const Index n = k.rows(), k_row = k.cols(), v_row = v.cols();
    const Index pages = (n + page_size - 1) / page_size;
    const Index pool = pages + 3;
    std::vector<std::int32_t> order(static_cast<std::size_t>(pool));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
    k_pool.assign(static_cast<std::size_t>(pool * page_size * k_row), nan);
    v_pool.assign(static_cast<std::size_t>(pool * page_size * v_row), nan);
    table.assign(static_cast<std::size_t>(pages + 1), -1);  // one spare entry past the end
    for (Index p = 0; p < pages; ++p)
      table[static_cast<std::size_t>(p)] = order[static_cast<std::size_t>(p)];
    for (Index j = 0; j < n; ++j) {
      const Index row = table[static_cast<std::size_t>(j / page_size)] * page_size + j % page_size;
      std::copy_n(k.row(j).data(), k_row, k_pool.data() + row * k_row);
      std::copy_n(v.row(j).data(), v_row, v_pool.data() + row * v_row);
    }
    lengths = {static_cast<std::int32_t>(n)};
    view.k_pages = k_pool.data();
    view.v_pages = v_pool.data();
    view.num_pages = pool;
    view.page_size = page_size;
    view.heads = heads;
    view.dim = k_row / heads;
    view.dim_v = v_row / heads;
    view.block_table = table.data();
    view.batch = 1;
    view.max_pages = pages + 1;
    view.seq_lens = lengths.data();
  }
};

// The pool of the tests' float caches: paged_kv_heads heads of paged_dim and paged_value_dim.
struct PagedCache : PagedPool<float> {
  PagedCache(const RowMatrix<float>& k, const RowMatrix<float>& v, Index page_size,
             std::uint64_t seed)
      : PagedPool<float>(k, v, paged_kv_heads, page_size, seed) {}
};

template <typename Block>
poslsh::ConstMatrixRef<float> head_of(const Block& rows, Index h, Index width) {
  return rows.middleCols(h * width, width);
}

/// The queries (n x dim) and the keys and values of `heads` heads (n x heads dim and
/// n x heads value_dim) of a paged test: random_matrix of seeds seed, seed + 1 and seed + 2.
template <typename Scalar>
poslsh_test::Qkv<Scalar> paged_inputs(Index n, Index heads, Index dim, Index value_dim,
                                      std::uint64_t seed) {
  return {random_matrix<Scalar>(n, dim, seed), random_matrix<Scalar>(n, heads * dim, seed + 1),
          random_matrix<Scalar>(n, heads * value_dim, seed + 2)};
}

bool same(const RowMatrix<float>& a, const RowMatrix<float>& b) {
  return (a.array() == b.array()).all();
}

}  // namespace

TEST_CASE("paged caches equal the contiguous kernels bitwise", "[paged]") {
  const Index n = 700;
  const auto [q, k, v] = paged_inputs<float>(n, paged_kv_heads, paged_dim, paged_value_dim, 501);
  const HashSet hashes = poslsh::rbf_hashes(20.0, 8, 5, 1);
  for (Index page_size : {16, 64, 100, 256}) {
    const PagedCache cache(k, v, page_size, 7 + static_cast<std::uint64_t>(page_size));
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (Index h = 0; h < paged_kv_heads; ++h) {
        INFO("page size " << page_size << ", head " << h << ", causal "
                          << (masking == Masking::causal));
        AttentionOptions options = with_masking(masking);
        const RowMatrix<float> fused = poslsh::lsh_attention_fused<float>(
            q, head_of(k, h, paged_dim), head_of(v, h, paged_value_dim), hashes, options);
        const RowMatrix<float> exact = poslsh::alibi_attention_tiled<float>(
            q, head_of(k, h, paged_dim), head_of(v, h, paged_value_dim), 11.0, options);
        RowMatrix<float> out(n, paged_value_dim);
        poslsh::lsh_attention_fused_paged<float>(q, cache.view, 0, h, hashes, out, options);
        CHECK(same(out, fused));
        poslsh::alibi_attention_tiled_paged<float>(q, cache.view, 0, h, 11.0, out, options);
        CHECK(same(out, exact));
      }
    }
  }
}

// d_v a multiple of the packet size: the values are read in place page by page (the key rows
// always are); pages of any size, including pages shorter than a register block of keys.
template <typename Scalar>
void paged_check_in_place(Index dim, Index value_dim) {
  const Index n = 300, heads = 2;
  const auto [q, k, v] = paged_inputs<Scalar>(n, heads, dim, value_dim, 521);
  const HashSet hashes = poslsh::rbf_hashes(30.0, 6, 7, 1);
  for (Index page_size : {1, 3, 16, 40, 64, 128}) {
    const PagedPool<Scalar> cache(k, v, heads, page_size,
                                  31 + static_cast<std::uint64_t>(page_size));
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (Index h = 0; h < heads; ++h) {
        INFO("page size " << page_size << ", head " << h << ", causal "
                          << (masking == Masking::causal) << ", d " << dim << ", d_v "
                          << value_dim);
        AttentionOptions options = with_masking(masking);
        const auto k_h = k.middleCols(h * dim, dim);
        const auto v_h = v.middleCols(h * value_dim, value_dim);
        const RowMatrix<Scalar> fused =
            poslsh::lsh_attention_fused<Scalar>(q, k_h, v_h, hashes, options);
        const RowMatrix<Scalar> exact =
            poslsh::alibi_attention_tiled<Scalar>(q, k_h, v_h, 13.0, options);
        RowMatrix<Scalar> out(n, value_dim);
        poslsh::lsh_attention_fused_paged<Scalar>(q, cache.view, 0, h, hashes, out, options);
        CHECK((out.array() == fused.array()).all());
        poslsh::alibi_attention_tiled_paged<Scalar>(q, cache.view, 0, h, 13.0, out, options);
        CHECK((out.array() == exact.array()).all());
        // The last 64 queries (a prefill chunk at the cache's end).
        RowMatrix<Scalar> tail(64, value_dim);
        poslsh::lsh_attention_fused_paged<Scalar>(q.bottomRows(64), cache.view, 0, h, hashes, tail,
                                                  options);
        CHECK((tail.array() == fused.bottomRows(64).array()).all());
      }
    }
  }
}

TEST_CASE("paged caches read in place page by page, any page size", "[paged]") {
  paged_check_in_place<float>(16, 32);
  paged_check_in_place<float>(7, 64);
  paged_check_in_place<double>(12, 16);
}

TEST_CASE("chunked prefill and decode through a growing paged cache", "[paged][offsets]") {
  const Index n = 330;
  const auto [q, k, v] = paged_inputs<float>(n, paged_kv_heads, paged_dim, paged_value_dim, 511);
  const HashSet hashes = poslsh::rbf_hashes(20.0, 8, 6, 0);
  const Index h = 1;
  const RowMatrix<float> fused = poslsh::lsh_attention_fused<float>(
      q, head_of(k, h, paged_dim), head_of(v, h, paged_value_dim), hashes);
  const RowMatrix<float> exact = poslsh::alibi_attention_tiled<float>(
      q, head_of(k, h, paged_dim), head_of(v, h, paged_value_dim), 11.0);
  for (Index page_size : {16, 256}) {
    PagedCache cache(k, v, page_size, 21);
    for (Index chunk : {1, 7, 64, 1000}) {
      INFO("page size " << page_size << ", chunk " << chunk);
      RowMatrix<float> lsh(n, paged_value_dim), alibi(n, paged_value_dim);
      for (Index p0 = 0; p0 < n; p0 += chunk) {
        const Index m = std::min(chunk, n - p0);
        cache.lengths[0] = static_cast<std::int32_t>(p0 + m);  // the cache so far
        RowMatrix<float> out(m, paged_value_dim);
        poslsh::lsh_attention_fused_paged<float>(q.middleRows(p0, m), cache.view, 0, h, hashes,
                                                 out);
        lsh.middleRows(p0, m) = out;
        poslsh::alibi_attention_tiled_paged<float>(q.middleRows(p0, m), cache.view, 0, h, 11.0,
                                                   out);
        alibi.middleRows(p0, m) = out;
      }
      CHECK(same(lsh, fused));
      CHECK(same(alibi, exact));
    }
  }
  // Bidirectional chunks see the whole cache (explicit offsets).
  PagedCache cache(k, v, 16, 22);
  AttentionOptions options;
  options.masking = Masking::bidirectional;
  const RowMatrix<float> full = poslsh::lsh_attention_fused<float>(
      q, head_of(k, h, paged_dim), head_of(v, h, paged_value_dim), hashes, options);
  for (Index p0 : {0, 5, 250, 320}) {
    options.query_offset = p0;
    RowMatrix<float> out(10, paged_value_dim);
    poslsh::lsh_attention_fused_paged<float>(q.middleRows(p0, 10), cache.view, 0, h, hashes, out,
                                             options);
    CHECK(same(out, full.middleRows(p0, 10)));
  }
}

TEST_CASE("bad paged caches throw naming the argument", "[paged][bad_input]") {
  const Index n = 100;
  const auto q = random_matrix<float>(4, paged_dim, 521);
  const auto k = random_matrix<float>(n, paged_kv_heads * paged_dim, 522);
  const auto v = random_matrix<float>(n, paged_kv_heads * paged_value_dim, 523);
  const HashSet hashes = poslsh::rbf_hashes(20.0, 2, 6, 0);
  RowMatrix<float> out(4, paged_value_dim);
  const auto fused = [&](const PagedKV<float>& view, Index sequence = 0, Index head = 0) {
    return [&, view, sequence, head] {
      poslsh::lsh_attention_fused_paged<float>(q, view, sequence, head, hashes, out);
    };
  };
  PagedCache cache(k, v, 16, 3);
  fused(cache.view)();  // valid
  {
    PagedCache bad(k, v, 16, 3);
    bad.table[2] = static_cast<std::int32_t>(bad.view.num_pages);
    poslsh_test::require_invalid_argument(fused(bad.view), "cache.block_table");
    bad.table[2] = -1;
    poslsh_test::require_invalid_argument(fused(bad.view), "cache.block_table");
  }
  {
    PagedKV<float> short_table = cache.view;
    short_table.max_pages = 6;  // 100 tokens need 7 pages of 16
    poslsh_test::require_invalid_argument(fused(short_table), "cache.block_table");
    PagedKV<float> long_sequence = cache.view;
    std::int32_t length = 200;
    long_sequence.seq_lens = &length;
    poslsh_test::require_invalid_argument(fused(long_sequence), "cache.block_table");
    length = -1;
    poslsh_test::require_invalid_argument(fused(long_sequence), "cache.seq_lens");
    length = 3;  // fewer keys than the 4 queries
    poslsh_test::require_invalid_argument(fused(long_sequence), "cache.seq_lens");
    PagedKV<float> zero_page = cache.view;
    zero_page.page_size = 0;
    poslsh_test::require_invalid_argument(fused(zero_page), "cache.page_size");
  }
  poslsh_test::require_invalid_argument(fused(cache.view, 1), "sequence");
  poslsh_test::require_invalid_argument(fused(cache.view, 0, 2), "kv_head");
  AttentionOptions options;
  options.query_offset = 97;
  poslsh_test::require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_paged<float>(q, cache.view, 0, 0, 4.0, out, options); },
      "options.query_offset");
  RowMatrix<float> wide = random_matrix<float>(4, paged_dim + 1, 524);
  poslsh_test::require_invalid_argument(
      [&] { poslsh::alibi_attention_tiled_paged<float>(wide, cache.view, 0, 0, 4.0, out); }, "q");
}

// The all-heads entry point: multihead_attention_paged over several sequences, every method,
// every cache dtype, against the same call on the cache gathered into contiguous views.
namespace {

// A paged cache of several sequences: sequence b's [L_b, H_kv, d] keys and [L_b, H_kv, d_v]
// values, packed one sequence after the other in k and v (the gathered cache: cu_k), scattered
// over the shuffled pages of one pool, with spare pages of NaN (never read) and table entries
// -1 past each sequence's pages.
template <typename KV>
struct PagedBatch {
  RowMatrix<KV> k, v;
  std::vector<std::int32_t> cu_k;
  std::vector<KV> k_pool, v_pool;
  std::vector<std::int32_t> table, lengths;
  PagedKV<KV> view;

  PagedBatch(const std::vector<Index>& sequence_lengths, Index heads, Index d, Index d_v,
             Index page_size, std::uint64_t seed) {
    const auto batch = static_cast<Index>(sequence_lengths.size());
    cu_k = {0};
    Index max_pages = 1, pages = 0;
    for (Index length : sequence_lengths) {
      cu_k.push_back(cu_k.back() + static_cast<std::int32_t>(length));
      max_pages = std::max(max_pages, (length + page_size - 1) / page_size + 1);
      pages += (length + page_size - 1) / page_size;
    }
    k = random_matrix<float>(cu_k.back(), heads * d, seed).cast<KV>();
    v = random_matrix<float>(cu_k.back(), heads * d_v, seed + 1).cast<KV>();
    const Index pool = pages + 3;
    std::vector<std::int32_t> order(static_cast<std::size_t>(pool));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed + 2));
    const KV nan = KV(std::numeric_limits<float>::quiet_NaN());
    k_pool.assign(static_cast<std::size_t>(pool * page_size * heads * d), nan);
    v_pool.assign(static_cast<std::size_t>(pool * page_size * heads * d_v), nan);
    table.assign(static_cast<std::size_t>(batch * max_pages), -1);
    std::size_t used = 0;
    for (Index b = 0; b < batch; ++b) {
      const Index length = sequence_lengths[static_cast<std::size_t>(b)];
      for (Index p = 0; p * page_size < length; ++p)
        table[static_cast<std::size_t>(b * max_pages + p)] = order[used++];
      for (Index j = 0; j < length; ++j) {
        const Index page = table[static_cast<std::size_t>(b * max_pages + j / page_size)];
        const Index row = page * page_size + j % page_size, token = cu_k[b] + j;
        std::copy_n(k.row(token).data(), heads * d, k_pool.data() + row * heads * d);
        std::copy_n(v.row(token).data(), heads * d_v, v_pool.data() + row * heads * d_v);
      }
      lengths.push_back(static_cast<std::int32_t>(length));
    }
    view = PagedKV<KV>{k_pool.data(), v_pool.data(), pool,  page_size, heads,         d,
                       d_v,           table.data(),  batch, max_pages, lengths.data()};
  }
};

template <typename Matrix>
bool same_bits(const Matrix& a, const Matrix& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(),
                     static_cast<std::size_t>(a.size()) * sizeof(typename Matrix::Scalar)) == 0;
}

constexpr Index batch_q_heads = 4, batch_kv_heads = 2, batch_dim = 16, batch_value_dim = 24;

// multihead_attention_paged (and _with_lse) of packed queries over `cache`, and
// multihead_attention_varlen (_with_lse) on the gathered cache, each with its lse when the
// method has one: out and lse must be bitwise equal. A float query over a half-precision cache
// is compared with the call on the cache widened to float. On a tile layer Tiles other than the
// CPU's, both calls are their bodies (detail::run_heads_forward) on that layer, without lse.
template <typename Q, typename KV, typename Out,
          template <typename> class Tiles = poslsh::detail::AmxNativeTiles>
void check_paged_batch(const PagedBatch<KV>& cache, const std::vector<std::int32_t>& cu_q,
                       const std::vector<Index>& offsets, const MultiHeadOptions& options) {
  using Compute = poslsh::compute_scalar_t<Q, KV, Out>;
  constexpr bool native =
      std::is_same_v<Tiles<Eigen::bfloat16>, poslsh::detail::AmxNativeTiles<Eigen::bfloat16>>;
  constexpr Index H = batch_q_heads, d = batch_dim, dv = batch_value_dim;
  const Index tokens = cu_q.back();
  const RowMatrix<Q> q = random_matrix<float>(tokens, H * d, 601).cast<Q>();
  const auto q_view = poslsh::interleaved_heads<const Q>(q.data(), tokens, H, d);
  RowMatrix<Out> paged(tokens, H * dv), gathered(tokens, H * dv);
  const auto paged_view = poslsh::interleaved_heads<Out>(paged.data(), tokens, H, dv);
  // The gathered cache, widened to float when the queries are float and the cache is not.
  using Dense = std::conditional_t<std::is_same_v<Q, float>, float, KV>;
  const RowMatrix<Dense> k = cache.k.template cast<Dense>(), v = cache.v.template cast<Dense>();
  const Index keys = cache.cu_k.back();
  const auto k_view = poslsh::interleaved_heads<const Dense>(k.data(), keys, batch_kv_heads, d);
  const auto v_view = poslsh::interleaved_heads<const Dense>(v.data(), keys, batch_kv_heads, dv);
  const auto gathered_view = poslsh::interleaved_heads<Out>(gathered.data(), tokens, H, dv);
  if constexpr (native) {
    poslsh::multihead_attention_paged<Q, KV, Out>(q_view, cache.view, paged_view, cu_q, options,
                                                  offsets);
    poslsh::multihead_attention_varlen<Q, Dense, Out>(q_view, k_view, v_view, gathered_view, cu_q,
                                                      cache.cu_k, options, offsets);
  } else {
    namespace detail = poslsh::detail;
    detail::run_heads_forward<Compute, Tiles>(
        detail::paged_call("multihead_attention_paged", q_view, cache.view, paged_view, cu_q,
                           options, offsets),
        q_view, detail::PagedHeadsKeys<KV>{cache.view}, paged_view);
    detail::run_heads_forward<Compute, Tiles>(
        detail::varlen_call("multihead_attention_varlen", q_view, k_view, v_view, gathered_view,
                            cu_q, cache.cu_k, options, offsets),
        q_view, detail::ViewHeadsKeys<Dense>{k_view, v_view}, gathered_view);
  }
  CHECK(same_bits(paged, gathered));
  if (!native || !poslsh::method_has_lse(options.method)) return;
  RowMatrix<Compute> lse(H, tokens), lse_gathered(H, tokens);
  poslsh::multihead_attention_paged_with_lse<Q, KV, Out>(
      q_view, cache.view, poslsh::interleaved_heads<Out>(paged.data(), tokens, H, dv), lse, cu_q,
      options, offsets);
  CHECK(same_bits(paged, gathered));
  if constexpr (std::is_same_v<Q, Dense> && std::is_same_v<Q, Out>) {
    poslsh::multihead_attention_varlen_with_lse<Q>(
        q_view, k_view, v_view, poslsh::interleaved_heads<Out>(gathered.data(), tokens, H, dv),
        lse_gathered, cu_q, cache.cu_k, options, offsets);
    CHECK(same_bits(paged, gathered));
    CHECK(same_bits(lse, lse_gathered));
  }
}

// Every method (exact_tiled also with a local window) for one combination of types, AMX on the
// tile layer Tiles.
template <typename Q, typename KV, typename Out,
          template <typename> class Tiles = poslsh::detail::AmxNativeTiles>
void check_paged_methods(Index page_size, poslsh::Precision precision) {
  // Sequences longer than a tile, shorter than a page, empty, one token.
  const std::vector<Index> lengths = {150, 37, 0, 70, 1};
  const PagedBatch<KV> cache(lengths, batch_kv_heads, batch_dim, batch_value_dim, page_size,
                             700 + static_cast<std::uint64_t>(page_size));
  // A prefill chunk, a whole prefill, nothing, a decode step of 3 tokens, one token; then more
  // queries than cached tokens (45 over 37, 2 over none, 3 over 1), bottom-right aligned.
  const std::vector<std::int32_t> cu_q = {0, 70, 107, 107, 110, 111};
  const std::vector<std::int32_t> cu_q_longer = {0, 70, 115, 117, 120, 123};
  const std::vector<Index> offsets = {40, 0, 0, 60, 0};
  for (Method method : {Method::exact_tiled, Method::exact_banded, Method::lsh_fused,
                        Method::lsh_per_sample, Method::fixed_blocks, Method::mean_of_outputs}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (bool window : {false, true}) {
        const bool exact = method == Method::exact_tiled || method == Method::exact_banded;
        if (window && !exact) continue;
        for (bool explicit_offsets : {false, true}) {
          INFO("page size " << page_size << ", method " << poslsh::enum_name(method) << ", "
                            << poslsh_test::masking_name(masking) << ", window " << window
                            << ", offsets " << explicit_offsets);
          MultiHeadOptions options = multihead_options(method, masking, 3, 11);
          options.precision = precision;
          options.sigmas = {3.0, 9.0, 40.0, 1e300};
          if (window) {
            options.window_left = 5;
            options.window_right = masking == Masking::causal ? -1 : 2;
          }
          check_paged_batch<Q, KV, Out, Tiles>(
              cache, cu_q, explicit_offsets ? offsets : std::vector<Index>{}, options);
          if (!explicit_offsets)
            check_paged_batch<Q, KV, Out, Tiles>(cache, cu_q_longer, {}, options);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("multihead_attention_paged equals the gathered cache's call bitwise, every method",
          "[paged][multihead][long]") {
  // Pages of one row, fewer rows than a register block, not dividing a key tile, a tile, more.
  for (Index page_size : {1, 5, 16, 64, 100}) {
    check_paged_methods<float, float, float>(page_size, Precision::float_products);
    check_paged_methods<double, double, double>(page_size, Precision::float_products);
  }
  for (Index page_size : {1, 5, 64}) {
    for (Precision precision : {Precision::matrix_units, Precision::float_products}) {
      check_paged_methods<Eigen::bfloat16, Eigen::bfloat16, Eigen::bfloat16>(page_size, precision);
      check_paged_methods<Eigen::half, Eigen::half, Eigen::half>(page_size, precision);
    }
    check_paged_methods<float, Eigen::bfloat16, float>(page_size, Precision::matrix_units);
    check_paged_methods<float, Eigen::half, float>(page_size, Precision::matrix_units);
    check_paged_methods<Eigen::bfloat16, Eigen::bfloat16, float>(page_size,
                                                                 Precision::float_products);
  }
}

TEST_CASE("multihead_attention_paged: the exact method against the dense formula",
          "[paged][multihead]") {
  // Decode steps of 5 tokens at the end of two sequences, grouped-query heads, page size 16.
  const std::vector<Index> lengths = {90, 33};
  const PagedBatch<double> cache(lengths, batch_kv_heads, batch_dim, batch_value_dim, 16, 801);
  constexpr Index H = batch_q_heads, d = batch_dim, dv = batch_value_dim, m = 5;
  const std::vector<double> sigmas = {2.0, 5.0, 17.0, 60.0};
  const RowMatrix<double> full = random_matrix<double>(cache.cu_k.back(), H * d, 802);
  RowMatrix<double> q(2 * m, H * d);
  for (Index b = 0; b < 2; ++b) q.middleRows(b * m, m) = full.middleRows(cache.cu_k[b + 1] - m, m);
  MultiHeadOptions options;
  options.method = Method::exact_tiled;
  options.sigmas = sigmas;
  RowMatrix<double> out(2 * m, H * dv);
  poslsh::multihead_attention_paged<double>(
      poslsh::interleaved_heads<const double>(q.data(), 2 * m, H, d), cache.view,
      poslsh::interleaved_heads<double>(out.data(), 2 * m, H, dv), {0, m, 2 * m}, options);
  for (Index b = 0; b < 2; ++b) {
    const Index first = cache.cu_k[b], L = lengths[static_cast<std::size_t>(b)];
    for (Index h = 0; h < H; ++h) {
      const Index g = h / (H / batch_kv_heads);
      const RowMatrix<double> expected = poslsh::alibi_attention_reference<double>(
          full.block(first, h * d, L, d), cache.k.block(first, g * d, L, d),
          cache.v.block(first, g * dv, L, dv), sigmas[static_cast<std::size_t>(h)]);
      INFO("sequence " << b << ", head " << h);
      CHECK(poslsh_test::relative_max_error(out.block(b * m, h * dv, m, dv),
                                            expected.bottomRows(m)) <= 1e-12);
    }
  }
}

TEST_CASE("multihead_attention_paged: one sigma per sequence and head, and thread counts",
          "[paged][multihead]") {
  const std::vector<Index> lengths = {120, 64};
  const PagedBatch<float> cache(lengths, batch_kv_heads, batch_dim, batch_value_dim, 16, 811);
  constexpr Index H = batch_q_heads, d = batch_dim, dv = batch_value_dim;
  const std::vector<std::int32_t> cu_q = {0, 70, 71};
  const RowMatrix<float> q = random_matrix<float>(71, H * d, 812);
  const std::vector<double> first = {2.0, 5.0, 17.0, 60.0}, second = {3.0, 7.0, 11.0, 1e300};
  for (Method method : {Method::lsh_fused, Method::exact_banded, Method::mean_of_outputs}) {
    MultiHeadOptions options;
    options.method = method;
    options.samples = 4;
    options.sigmas = first;
    options.sigmas.insert(options.sigmas.end(), second.begin(), second.end());
    RowMatrix<float> out(71, H * dv);
    const auto call = [&](RowMatrix<float>& result) {
      poslsh::multihead_attention_paged<float>(
          poslsh::interleaved_heads<const float>(q.data(), 71, H, d), cache.view,
          poslsh::interleaved_heads<float>(result.data(), 71, H, dv), cu_q, options);
    };
    call(out);
    // Each sequence alone with its own sigmas (a batch of one: the sequence's table row).
    for (Index b = 0; b < 2; ++b) {
      PagedKV<float> one = cache.view;
      one.batch = 1;
      one.block_table = cache.view.block_table + b * cache.view.max_pages;
      one.seq_lens = cache.view.seq_lens + b;
      MultiHeadOptions alone = options;
      alone.sigmas = b == 0 ? first : second;
      const Index m = cu_q[b + 1] - cu_q[b];
      RowMatrix<float> expected(m, H * dv);
      poslsh::multihead_attention_paged<float>(
          poslsh::interleaved_heads<const float>(q.data() + cu_q[b] * H * d, m, H, d), one,
          poslsh::interleaved_heads<float>(expected.data(), m, H, dv), {0, static_cast<int>(m)},
          alone);
      INFO("method " << poslsh::enum_name(method) << ", sequence " << b);
      CHECK(same_bits(RowMatrix<float>(out.middleRows(cu_q[b], m)), expected));
    }
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    RowMatrix<float> serial(71, H * dv);
    call(serial);
    omp_set_num_threads(threads);
    CHECK(same_bits(serial, out));
#endif
  }
}

TEST_CASE("multihead_attention_paged: bad arguments throw naming them", "[paged][bad_input]") {
  const std::vector<Index> lengths = {40, 20};
  PagedBatch<float> cache(lengths, batch_kv_heads, batch_dim, batch_value_dim, 16, 821);
  constexpr Index H = batch_q_heads, d = batch_dim, dv = batch_value_dim;
  const RowMatrix<float> q = random_matrix<float>(3, H * d, 822);
  RowMatrix<float> out(3, H * dv);
  RowMatrix<float> lse(H, 3);
  std::vector<std::int32_t> cu_q = {0, 2, 3};
  MultiHeadOptions options;
  std::vector<Index> offsets;
  auto q_view = poslsh::interleaved_heads<const float>(q.data(), 3, H, d);
  auto out_view = poslsh::interleaved_heads<float>(out.data(), 3, H, dv);
  const auto call = [&](const PagedKV<float>& view) {
    return [&, view] {
      poslsh::multihead_attention_paged<float>(q_view, view, out_view, cu_q, options, offsets);
    };
  };
  call(cache.view)();  // valid
  {
    PagedKV<float> bad = cache.view;
    std::vector<std::int32_t> table = cache.table;
    table[static_cast<std::size_t>(bad.max_pages + 1)] = static_cast<std::int32_t>(bad.num_pages);
    bad.block_table = table.data();  // the second page of sequence 1
    require_invalid_argument(call(bad), "cache.block_table");
    std::vector<std::int32_t> long_lengths = {40, 100};  // more than max_pages pages
    bad = cache.view;
    bad.seq_lens = long_lengths.data();
    require_invalid_argument(call(bad), "cache.block_table");
    long_lengths[1] = -2;
    require_invalid_argument(call(bad), "cache.seq_lens");
    long_lengths[1] = 0;  // one query over no key: valid, it sees no key (out 0)
    out.setConstant(-7.0f);
    call(bad)();
    CHECK((out.row(2).array() == 0.0f).all());
    CHECK(std::isfinite(out(0, 0)));
    bad = cache.view;
    bad.heads = 3;
    require_invalid_argument(call(bad), "cache.heads");
    bad = cache.view;
    bad.dim = d + 1;
    require_invalid_argument(call(bad), "q.dim");
    bad = cache.view;
    bad.page_size = 0;
    require_invalid_argument(call(bad), "cache.page_size");
  }
  cu_q = {0, 3};
  require_invalid_argument(call(cache.view), "cu_seqlens_q");
  cu_q = {0, 2, 2};
  require_invalid_argument(call(cache.view), "cu_seqlens_q");
  cu_q = {0, 2, 3};
  offsets = {39, 0};
  require_invalid_argument(call(cache.view), "query_offsets");
  offsets = {0};
  require_invalid_argument(call(cache.view), "query_offsets");
  offsets = {};
  options.query_offset = 1;
  require_invalid_argument(call(cache.view), "options.query_offset");
  options = MultiHeadOptions{};
  options.sigmas = {1.0, 2.0, 3.0};
  require_invalid_argument(call(cache.view), "options.sigmas");
  options = MultiHeadOptions{};
  out_view.dim = dv - 1;
  require_invalid_argument(call(cache.view), "out");
  out_view.dim = dv;
  options.method = Method::mean_of_outputs;
  call(cache.view)();  // valid without lse
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_paged_with_lse<float>(q_view, cache.view, out_view, lse, cu_q,
                                                          options);
      },
      "options.method");
  options = MultiHeadOptions{};
  RowMatrix<float> short_lse(H, 2);
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_paged_with_lse<float>(q_view, cache.view, out_view, short_lse,
                                                          cu_q, options);
      },
      "lse");
}

TEST_CASE("multihead_attention_paged on the AMX tiles (emulated): bitwise the gathered cache's",
          "[paged][multihead][amx]") {
#if POSLSH_X86_UNITS
  using poslsh_test::AmxEmulatedTiles;
  // The emulated tiles need avx512_bf16 (the code around them uses it).
  if (!AmxEmulatedTiles<Eigen::bfloat16>::available()) {
    WARN("no avx512_bf16: the AMX emulation cannot run");
    return;
  }
  REQUIRE(poslsh::detail::tile_engine_unit<Eigen::bfloat16, Eigen::bfloat16, AmxEmulatedTiles>(
              poslsh::Precision::matrix_units) == poslsh::MatrixUnit::amx_bf16);
  const long long before = poslsh_test::AmxEmulatedTileOps::products();
  for (Index page_size : {5, 64}) {
    check_paged_methods<Eigen::bfloat16, Eigen::bfloat16, Eigen::bfloat16, AmxEmulatedTiles>(
        page_size, poslsh::Precision::matrix_units);
    check_paged_methods<Eigen::half, Eigen::half, Eigen::half, AmxEmulatedTiles>(
        page_size, poslsh::Precision::matrix_units);
  }
  CHECK(poslsh_test::AmxEmulatedTileOps::products() > before);  // the calls ran on the tiles
#else
  WARN("not an x86 build: no AMX tiles");
#endif
}
