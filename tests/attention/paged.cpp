// Paged KV caches: the fused LSH and exact tiled kernels through a block table equal the
// contiguous kernels bitwise (prefill, chunked prefill across page boundaries, decode), and
// bad caches are rejected by name.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/paged.hpp>
#include <poslsh/attention/tiled.hpp>
#include <random>

#include "test_support.hpp"

using poslsh::AttentionOptions;
using poslsh::HashSet;
using poslsh::Index;
using poslsh::Masking;
using poslsh::PagedKV;
using poslsh::RowMatrix;
using poslsh_test::random_matrix;

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

bool same(const RowMatrix<float>& a, const RowMatrix<float>& b) {
  return (a.array() == b.array()).all();
}

}  // namespace

TEST_CASE("paged caches equal the contiguous kernels bitwise", "[paged]") {
  const Index n = 700;
  const auto q = random_matrix<float>(n, paged_dim, 501);
  const auto k = random_matrix<float>(n, paged_kv_heads * paged_dim, 502);
  const auto v = random_matrix<float>(n, paged_kv_heads * paged_value_dim, 503);
  const HashSet hashes = poslsh::rbf_hashes(20.0, 8, 5, 1);
  for (Index page_size : {16, 64, 100, 256}) {
    const PagedCache cache(k, v, page_size, 7 + static_cast<std::uint64_t>(page_size));
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (Index h = 0; h < paged_kv_heads; ++h) {
        INFO("page size " << page_size << ", head " << h << ", causal "
                          << (masking == Masking::causal));
        AttentionOptions options;
        options.masking = masking;
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
  const auto q = random_matrix<Scalar>(n, dim, 521);
  const auto k = random_matrix<Scalar>(n, heads * dim, 522);
  const auto v = random_matrix<Scalar>(n, heads * value_dim, 523);
  const HashSet hashes = poslsh::rbf_hashes(30.0, 6, 7, 1);
  for (Index page_size : {1, 3, 16, 40, 64, 128}) {
    const PagedPool<Scalar> cache(k, v, heads, page_size,
                                  31 + static_cast<std::uint64_t>(page_size));
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (Index h = 0; h < heads; ++h) {
        INFO("page size " << page_size << ", head " << h << ", causal "
                          << (masking == Masking::causal) << ", d " << dim << ", d_v "
                          << value_dim);
        AttentionOptions options;
        options.masking = masking;
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
  const auto q = random_matrix<float>(n, paged_dim, 511);
  const auto k = random_matrix<float>(n, paged_kv_heads * paged_dim, 512);
  const auto v = random_matrix<float>(n, paged_kv_heads * paged_value_dim, 513);
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
