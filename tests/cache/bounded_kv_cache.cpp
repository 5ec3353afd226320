// BoundedKVCache: chunked prefill then thousands of decode steps for every method and masking
// (grouped-query heads of different sigmas, float, bfloat16 and float16 storage), each output row
// bitwise that of multihead_attention over every key; at each step a brute-force scan of the
// weights (shared bins, band, window) checks that no released key is read by any later query and
// that the cache holds no page whose keys are all dead (the memory bound: the live keys' pages
// plus at most one); sequences sharing a pool reuse each other's pages; bad input is named and
// changes nothing; a plan's heads (planned_heads) give the planned rows.
#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <poslsh/cache/bounded_kv_cache.hpp>
#include <poslsh/cache/retention.hpp>
#include <poslsh/multihead/attention.hpp>
#include <poslsh/multihead/planner.hpp>
#include <poslsh/parallel/plan.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "retention_oracle.hpp"
#include "test_support.hpp"

using poslsh::BoundedKVCache;
using poslsh::HeadMethod;

namespace {

constexpr Index cache_heads = 4, cache_kv_heads = 2, cache_dim = 16, cache_dim_v = 24;
// For each key j < n, the last query position that K/V head g's query heads read it from
// (poslsh_test::last_reader of each head, the latest), read_forever for never-ending.
std::vector<std::vector<Index>> last_readers(const std::vector<HeadMethod>& heads, Index kv_heads,
                                             Index n) {
  const auto group = static_cast<Index>(heads.size()) / kv_heads;
  std::vector<std::vector<Index>> last(static_cast<std::size_t>(kv_heads),
                                       std::vector<Index>(static_cast<std::size_t>(n), 0));
  for (Index h = 0; h < static_cast<Index>(heads.size()); ++h) {
    const HeadMethod& head = heads[static_cast<std::size_t>(h)];
    auto& mine = last[static_cast<std::size_t>(h / group)];
    const Index horizon = poslsh_test::widest_reach(head);
    for (Index j = 0; j < n; ++j) {
      Index& entry = mine[static_cast<std::size_t>(j)];
      entry = std::max(entry, poslsh_test::last_reader(head, j, horizon));
    }
  }
  return last;
}

template <typename Storage>
RowMatrix<Storage> random_rows(Index rows, Index cols, std::uint64_t seed) {
  return random_matrix<float>(rows, cols, seed).template cast<Storage>();
}

template <typename Storage>
poslsh::HeadsView<const Storage> rows_view(const RowMatrix<Storage>& m, Index begin, Index end,
                                           Index heads) {
  return poslsh::interleaved_heads<const Storage>(m.data() + begin * m.cols(), end - begin, heads,
                                                  m.cols() / heads);
}

template <typename A, typename B>
bool cache_same_bits(const A& a, const B& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(),
                     static_cast<std::size_t>(a.size()) * sizeof(typename A::Scalar)) == 0;
}

// The retention checks of K/V head g after the release at `frontier`: every key before the
// head's first held key is read by no query >= frontier (its last reader is before it), the first
// held page holds a key still read (so no page of dead keys is kept), and the head holds exactly
// the pages from there to the last written one, at most one more than its live keys need.
template <typename Storage>
void check_retention(const BoundedKVCache<Storage>& cache, Index sequence, Index g,
                     const std::vector<Index>& last, Index frontier, Index& checked_to) {
  const Index page = cache.page_size(), length = cache.length(sequence);
  const Index first = cache.first_key(sequence, g);
  INFO("frontier " << frontier << ", K/V head " << g << ", first held key " << first);
  REQUIRE(first % page == 0);
  REQUIRE(first >= checked_to);  // released keys stay released
  for (Index j = checked_to; j < first; ++j) REQUIRE(last[static_cast<std::size_t>(j)] < frontier);
  checked_to = first;
  Index first_live = frontier;  // by the scan: the first key some query >= frontier reads
  for (Index j = first; j < frontier; ++j)
    if (last[static_cast<std::size_t>(j)] >= frontier) {
      first_live = j;
      break;
    }
  const auto held = static_cast<Index>(cache.held_pages(sequence, g).size());
  REQUIRE(first == first_live / page * page);
  REQUIRE(held == (length + page - 1) / page - first / page);
  REQUIRE(held <= (length - first_live + page - 1) / page + 1);
}

// Chunked prefill (chunks of 250, 147 and the rest up to `prefill`) then decode steps up to n:
// after each append the bounded cache's output rows equal multihead_attention's over every key
// bitwise, and the retention checks hold for every K/V head.
template <typename Storage>
void check_generation(const MultiHeadOptions& options, Index n, Index prefill, Index page,
                      std::uint64_t seed) {
  INFO(poslsh::enum_name(options.method)
       << " " << poslsh_test::masking_name(options.masking) << " window " << options.window_left
       << " storage bytes " << sizeof(Storage) << " page " << page);
  poslsh_test::Threads one(1);  // bitwise for any thread count; one is fastest for single rows
  const std::vector<HeadMethod> heads = poslsh::resolve_head_methods(cache_heads, options);
  const RowMatrix<Storage> q = random_rows<Storage>(n, cache_heads * cache_dim, seed);
  const RowMatrix<Storage> k = random_rows<Storage>(n, cache_kv_heads * cache_dim, seed + 1);
  const RowMatrix<Storage> v = random_rows<Storage>(n, cache_kv_heads * cache_dim_v, seed + 2);
  const auto last = last_readers(heads, cache_kv_heads, n);
  BoundedKVCache<Storage> cache(heads, cache_kv_heads, cache_dim, cache_dim_v, page,
                                cache_kv_heads * ((n + page - 1) / page));
  cache.poison_released_pages(true);
  const Index sequence = cache.open();
  std::vector<Index> boundaries = {0, 250, 397, prefill};
  for (Index t = prefill + 1; t <= n; ++t) boundaries.push_back(t);
  std::vector<Index> checked(cache_kv_heads, 0);
  for (std::size_t c = 0; c + 1 < boundaries.size(); ++c) {
    const Index a = boundaries[c], b = boundaries[c + 1];
    INFO("positions [" << a << ", " << b << ")");
    cache.append(sequence, a, rows_view(k, a, b, cache_kv_heads),
                 rows_view(v, a, b, cache_kv_heads));
    RowMatrix<Storage> bounded(b - a, cache_heads * cache_dim_v), full(b - a, bounded.cols());
    poslsh::multihead_attention_bounded<Storage, Storage, Storage>(
        rows_view(q, a, b, cache_heads), cache, sequence, interleaved_view(bounded, cache_heads),
        options);
    MultiHeadOptions at = options;
    at.query_offset = a;
    poslsh::multihead_attention<Storage, Storage, Storage>(
        rows_view(q, a, b, cache_heads), rows_view(k, 0, b, cache_kv_heads),
        rows_view(v, 0, b, cache_kv_heads), interleaved_view(full, cache_heads), at);
    REQUIRE(cache_same_bits(bounded, full));
    Index in_use = 0;
    for (Index g = 0; g < cache_kv_heads; ++g) {
      check_retention(cache, sequence, g, last[static_cast<std::size_t>(g)], a,
                      checked[static_cast<std::size_t>(g)]);
      in_use += static_cast<Index>(cache.held_pages(sequence, g).size());
    }
    REQUIRE(cache.pages_in_use() == in_use);
  }
  // Keys are released by every method but exact attention without a window.
  const bool keeps_all = options.method == Method::exact_tiled && options.window_left < 0;
  for (Index g = 0; g < cache_kv_heads; ++g)
    CHECK((cache.first_key(sequence, g) == 0) == keeps_all);
}

MultiHeadOptions generation_options(Method method, Masking masking, Index window_left = -1) {
  MultiHeadOptions options = multihead_options(method, masking, 6, 17);
  options.sigmas = {2.0, 9.0, 24.0, 60.0};  // K/V head 0: sigmas 2 and 9, head 1: 24 and 60
  if (method == Method::mean_of_outputs || method == Method::lsh_per_sample) options.samples = 3;
  options.window_left = window_left;
  return options;
}

}  // namespace

namespace {

// Every method (exact attention with and without a local window, banded with and without one)
// under `masking`, float storage.
void check_every_method(Masking masking) {
  const Index n = 3000, prefill = 600;
  for (Method method : {Method::lsh_fused, Method::lsh_per_sample, Method::mean_of_outputs,
                        Method::fixed_blocks, Method::exact_banded, Method::exact_tiled})
    check_generation<float>(generation_options(method, masking), n, prefill, 64, 1);
  check_generation<float>(generation_options(Method::exact_tiled, masking, 100), n, prefill, 128,
                          2);
  check_generation<float>(generation_options(Method::exact_banded, masking, 70), n, prefill, 64, 3);
}

}  // namespace

TEST_CASE("a bounded cache gives every method's causal rows bitwise over thousands of steps",
          "[cache][bounded][long]") {
  check_every_method(Masking::causal);
}

TEST_CASE("a bounded cache gives every method's bidirectional rows bitwise",
          "[cache][bounded][slow]") {
  check_every_method(Masking::bidirectional);
}

TEST_CASE("a bounded cache of bfloat16 or float16 gives the rows of a full cache bitwise",
          "[cache][bounded][long]") {
  const Index n = 2500, prefill = 500;
  for (Method method : {Method::lsh_fused, Method::exact_banded, Method::lsh_per_sample}) {
    check_generation<Eigen::bfloat16>(generation_options(method, Masking::causal), n, prefill, 128,
                                      4);
  }
  check_generation<Eigen::half>(generation_options(Method::lsh_fused, Masking::causal), n, prefill,
                                64, 5);
  check_generation<Eigen::half>(generation_options(Method::exact_tiled, Masking::causal, 90), n,
                                prefill, 64, 6);
}

TEST_CASE("sequences sharing a pool reuse each other's pages and keep their rows bitwise",
          "[cache][bounded]") {
  poslsh_test::Threads one(1);
  MultiHeadOptions options = generation_options(Method::lsh_fused, Masking::causal);
  options.sigmas = {2.0, 5.0, 10.0, 30.0};
  const std::vector<HeadMethod> heads = poslsh::resolve_head_methods(cache_heads, options);
  const Index n = 1500, page = 64, pool = 48, sequences = 3;
  BoundedKVCache<float> cache(heads, cache_kv_heads, cache_dim, cache_dim_v, page, pool);
  cache.poison_released_pages(true);
  std::vector<RowMatrix<float>> q, k, v;
  std::vector<Index> ids;
  for (Index s = 0; s < sequences; ++s) {
    q.push_back(
        random_rows<float>(n, cache_heads * cache_dim, static_cast<std::uint64_t>(40 + 3 * s)));
    k.push_back(
        random_rows<float>(n, cache_kv_heads * cache_dim, static_cast<std::uint64_t>(41 + 3 * s)));
    v.push_back(random_rows<float>(n, cache_kv_heads * cache_dim_v,
                                   static_cast<std::uint64_t>(42 + 3 * s)));
    ids.push_back(cache.open());
  }
  // Prefills of different lengths, then one decode step of every sequence per call.
  const std::vector<Index> prefills = {100, 257, 31};
  std::vector<std::set<Index>> holders(static_cast<std::size_t>(pool));
  const auto note_holders = [&] {
    for (Index s = 0; s < sequences; ++s)
      for (Index g = 0; g < cache_kv_heads; ++g)
        for (std::int32_t p : cache.held_pages(ids[static_cast<std::size_t>(s)], g))
          holders[static_cast<std::size_t>(p)].insert(s);
  };
  for (Index s = 0; s < sequences; ++s) {
    const auto& ks = k[static_cast<std::size_t>(s)];
    const auto& vs = v[static_cast<std::size_t>(s)];
    const Index length = prefills[static_cast<std::size_t>(s)];
    cache.append(ids[static_cast<std::size_t>(s)], 0, rows_view(ks, 0, length, cache_kv_heads),
                 rows_view(vs, 0, length, cache_kv_heads));
  }
  Index most_in_use = 0;
  for (Index step = 0; step < n - 257; ++step) {
    RowMatrix<float> queries(sequences, cache_heads * cache_dim);
    std::vector<std::int32_t> cu = {0};
    for (Index s = 0; s < sequences; ++s) {
      const auto id = ids[static_cast<std::size_t>(s)];
      const Index t = cache.length(id);
      cache.append(id, t, rows_view(k[static_cast<std::size_t>(s)], t, t + 1, cache_kv_heads),
                   rows_view(v[static_cast<std::size_t>(s)], t, t + 1, cache_kv_heads));
      queries.row(s) = q[static_cast<std::size_t>(s)].row(t);
      cu.push_back(static_cast<std::int32_t>(s + 1));
    }
    note_holders();
    most_in_use = std::max(most_in_use, cache.pages_in_use());
    RowMatrix<float> out(sequences, cache_heads * cache_dim_v);
    poslsh::multihead_attention_bounded<float>(
        interleaved_view(std::as_const(queries), cache_heads), cache, ids,
        interleaved_view(out, cache_heads), cu);
    for (Index s = 0; s < sequences; ++s) {
      const auto id = ids[static_cast<std::size_t>(s)];
      const Index t = cache.length(id) - 1;
      RowMatrix<float> full(1, out.cols());
      MultiHeadOptions at = options;
      at.query_offset = t;
      poslsh::multihead_attention<float>(
          rows_view(q[static_cast<std::size_t>(s)], t, t + 1, cache_heads),
          rows_view(k[static_cast<std::size_t>(s)], 0, t + 1, cache_kv_heads),
          rows_view(v[static_cast<std::size_t>(s)], 0, t + 1, cache_kv_heads),
          interleaved_view(full, cache_heads), at);
      INFO("step " << step << " sequence " << s << " position " << t);
      REQUIRE(cache_same_bits(RowMatrix<float>(out.row(s)), full));
    }
  }
  // The same batched call on two threads: bitwise the one-thread rows.
  {
    RowMatrix<float> queries(sequences, cache_heads * cache_dim);
    for (Index s = 0; s < sequences; ++s)
      queries.row(s) =
          q[static_cast<std::size_t>(s)].row(cache.length(ids[static_cast<std::size_t>(s)]) - 1);
    const std::vector<std::int32_t> cu = {0, 1, 2, 3};
    RowMatrix<float> one_thread(sequences, cache_heads * cache_dim_v),
        two(one_thread.rows(), one_thread.cols());
    poslsh::multihead_attention_bounded<float>(
        interleaved_view(std::as_const(queries), cache_heads), cache, ids,
        interleaved_view(one_thread, cache_heads), cu);
    poslsh_test::Threads both(2);
    poslsh::multihead_attention_bounded<float>(
        interleaved_view(std::as_const(queries), cache_heads), cache, ids,
        interleaved_view(two, cache_heads), cu);
    CHECK(cache_same_bits(one_thread, two));
  }
  // The full caches would need sequences x K/V heads x positions / page pages.
  INFO("most pages in use " << most_in_use);
  CHECK(most_in_use <= pool);
  CHECK(sequences * cache_kv_heads * (n - 257 + 100) / page > 2 * pool);
  bool shared = false;
  for (const auto& seen : holders) shared = shared || seen.size() >= 2;
  CHECK(shared);
  // Closing a sequence returns its pages; a new sequence takes them.
  const Index free_before = cache.free_pages();
  Index held = 0;
  for (Index g = 0; g < cache_kv_heads; ++g)
    held += static_cast<Index>(cache.held_pages(ids[0], g).size());
  cache.close(ids[0]);
  CHECK(cache.free_pages() == free_before + held);
  CHECK_FALSE(cache.is_open(ids[0]));
  const Index fresh = cache.open();
  cache.append(fresh, 0, rows_view(k[0], 0, 200, cache_kv_heads),
               rows_view(v[0], 0, 200, cache_kv_heads));
  CHECK(cache.free_pages() == free_before + held - cache_kv_heads * 4);
}

TEST_CASE("bad input to a bounded cache is named and changes nothing", "[cache][bounded]") {
  const MultiHeadOptions options = generation_options(Method::exact_tiled, Masking::causal);
  const std::vector<HeadMethod> heads = poslsh::resolve_head_methods(cache_heads, options);
  const auto make = [&](Index pages) {
    return BoundedKVCache<float>(heads, cache_kv_heads, cache_dim, cache_dim_v, 64, pages);
  };
  require_invalid_argument([&] { BoundedKVCache<float>({}, 1, 4, 4, 64, 4); }, "heads");
  require_invalid_argument([&] { BoundedKVCache<float>(heads, 3, 4, 4, 64, 4); }, "kv_heads");
  require_invalid_argument([&] { BoundedKVCache<float>(heads, 2, 0, 4, 64, 4); }, "dim");
  require_invalid_argument([&] { BoundedKVCache<float>(heads, 2, 4, 0, 64, 4); }, "dim_v");
  require_invalid_argument([&] { BoundedKVCache<float>(heads, 2, 4, 4, 48, 4); }, "page_size");
  require_invalid_argument([&] { BoundedKVCache<float>(heads, 2, 4, 4, 64, 0); }, "num_pages");
  std::vector<HeadMethod> bad = heads;
  bad[1].band = -3;
  bad[1].method = Method::exact_banded;
  require_invalid_argument([&] { BoundedKVCache<float>(bad, 2, 4, 4, 64, 4); }, "heads");

  const Index n = 200;
  const RowMatrix<float> k = random_rows<float>(n, cache_kv_heads * cache_dim, 7);
  const RowMatrix<float> v = random_rows<float>(n, cache_kv_heads * cache_dim_v, 8);
  const RowMatrix<float> q = random_rows<float>(n, cache_heads * cache_dim, 9);
  BoundedKVCache<float> cache = make(4);  // 64 positions of both heads, and two pages more
  const Index id = cache.open();
  // Appends the rows [begin, end) of k and v at `position`.
  const auto append = [&](Index position, Index begin, Index end) {
    cache.append(id, position, rows_view(k, begin, end, cache_kv_heads),
                 rows_view(v, begin, end, cache_kv_heads));
  };
  append(0, 0, 64);
  const auto snapshot = [&] {
    std::vector<float> state = {static_cast<float>(cache.length(id)),
                                static_cast<float>(cache.frontier(id)),
                                static_cast<float>(cache.free_pages())};
    for (Index g = 0; g < cache_kv_heads; ++g) {
      for (std::int32_t p : cache.held_pages(id, g)) state.push_back(static_cast<float>(p));
      for (Index j = cache.first_key(id, g); j < cache.length(id); ++j) {
        const float* row = cache.key_row(id, g, j);
        state.insert(state.end(), row, row + cache_dim);
        const float* value = cache.value_row(id, g, j);
        state.insert(state.end(), value, value + cache_dim_v);
      }
    }
    return state;
  };
  const std::vector<float> before = snapshot();
  const auto unchanged = [&] { CHECK(snapshot() == before); };
  // A position out of order (behind, or ahead of, the sequence's length).
  require_invalid_argument([&] { append(10, 10, 11); }, "position");
  require_invalid_argument([&] { append(65, 65, 66); }, "position");
  unchanged();
  // A pool too small: 2 more pages per head for 65 positions, 2 free.
  require_invalid_argument([&] { append(64, 64, 129); }, "keys");
  unchanged();
  // Shapes: keys of the wrong head count, values of another token count.
  require_invalid_argument(
      [&] { cache.append(id, 64, rows_view(k, 64, 65, 1), rows_view(v, 64, 65, cache_kv_heads)); },
      "keys");
  require_invalid_argument(
      [&] {
        cache.append(id, 64, rows_view(k, 64, 65, cache_kv_heads),
                     rows_view(v, 64, 66, cache_kv_heads));
      },
      "values");
  unchanged();
  // Queries before the frontier (the first position of the last append), and advance behind it.
  RowMatrix<float> out(2, cache_heads * cache_dim_v);
  append(64, 64, 65);
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_bounded<float>(rows_view(q, 63, 65, cache_heads), cache,
                                                   std::vector<Index>{id},
                                                   interleaved_view(out, cache_heads), {0, 2});
      },
      "cu_seqlens_q");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_bounded<float>(
            rows_view(q, 63, 64, cache_heads), cache, std::vector<Index>{id},
            poslsh::interleaved_heads<float>(out.data(), 1, cache_heads, cache_dim_v), {0, 1}, {},
            {63});
      },
      "query_offsets");
  require_invalid_argument([&] { cache.advance(id, 10); }, "t");
  require_invalid_argument([&] { cache.key_row(id, 0, 70); }, "position");
  // A closed sequence, and one never opened.
  cache.close(id);
  require_invalid_argument([&] { append(65, 65, 66); }, "sequence");
  require_invalid_argument([&] { cache.length(5); }, "sequence");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_bounded<float>(
            rows_view(q, 64, 65, cache_heads), cache, std::vector<Index>{id},
            poslsh::interleaved_heads<float>(out.data(), 1, cache_heads, cache_dim_v), {0, 1});
      },
      "sequences");
  CHECK(cache.free_pages() == 4);
}

TEST_CASE("a bounded cache of a plan's heads gives the planned rows bitwise", "[cache][bounded]") {
  poslsh_test::Threads one(1);
  const Index n = 1400, page = 64;
  const std::vector<double> sigmas = {2.0, 9.0, 24.0, 60.0};
  for (double target : {0.05, 0.01}) {
    poslsh::PlannerOptions planner;
    planner.head_dim = cache_dim;
    const std::vector<poslsh::HeadPlan> plans =
        poslsh::plan_heads(4096, sigmas, Masking::causal, target, planner);
    INFO("target " << target << "\n" << poslsh::format_plan(plans, 4096));
    const RowMatrix<float> q = random_rows<float>(n, cache_heads * cache_dim, 60);
    const RowMatrix<float> k = random_rows<float>(n, cache_kv_heads * cache_dim, 61);
    const RowMatrix<float> v = random_rows<float>(n, cache_kv_heads * cache_dim_v, 62);
    BoundedKVCache<float> cache(poslsh::planned_heads(plans), cache_kv_heads, cache_dim,
                                cache_dim_v, page, cache_kv_heads * (n / page + 1));
    const Index sequence = cache.open();
    for (Index a = 0, b = 300; a < n; a = b, ++b) {
      cache.append(sequence, a, rows_view(k, a, b, cache_kv_heads),
                   rows_view(v, a, b, cache_kv_heads));
      RowMatrix<float> bounded(b - a, cache_heads * cache_dim_v), full(b - a, bounded.cols());
      poslsh::multihead_attention_bounded<float>(rows_view(q, a, b, cache_heads), cache, sequence,
                                                 interleaved_view(bounded, cache_heads));
      AttentionOptions at;
      at.query_offset = a;
      poslsh::multihead_attention<float>(
          rows_view(q, a, b, cache_heads), rows_view(k, 0, b, cache_kv_heads),
          rows_view(v, 0, b, cache_kv_heads), interleaved_view(full, cache_heads), plans, at);
      INFO("positions [" << a << ", " << b << ")");
      REQUIRE(cache_same_bits(bounded, full));
    }
  }
  require_invalid_argument([] { poslsh::planned_heads({}); }, "plans");
}
