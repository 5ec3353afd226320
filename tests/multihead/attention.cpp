// Multi-head entry point: strided [n, H, d] and [H, n, d] layouts and grouped-query attention
// equal the contiguous per-head computation; thread counts do not change a bit.
#include <poslsh/detail/tile/query_tiles.hpp>
#include <poslsh/multihead/attention.hpp>
#include <poslsh/training/mean_of_outputs.hpp>

#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

namespace {

// A buffer of H heads: as [n, H*d] (interleaved) it is an [n, H, d] tensor.
template <typename Scalar>
RowMatrix<Scalar> head_of(const RowMatrix<Scalar>& interleaved, Index h, Index d) {
  return interleaved.middleCols(h * d, d);
}

}  // namespace

TEMPLATE_TEST_CASE("multihead_attention equals per-head calls, both layouts, with GQA",
                   "[multihead]", float, double) {
  const Index n = 130, d = 8, heads = 4, kv_heads = 2;
  const auto q = random_matrix<TestType>(n, heads * d, 71);
  const auto k = random_matrix<TestType>(n, kv_heads * d, 72);
  const auto v = random_matrix<TestType>(n, kv_heads * d, 73);
  for (Method method : {Method::lsh_fused, Method::lsh_per_sample, Method::fixed_blocks,
                        Method::exact_tiled, Method::exact_banded, Method::mean_of_outputs}) {
    const MultiHeadOptions options = multihead_options(method, Masking::causal, 5, 17);
    const RowMatrix<TestType> out = multihead_of(q, k, v, heads, kv_heads, options);
    // The same through [H, n, d] copies of the inputs and output.
    std::vector<TestType> q_planar(static_cast<std::size_t>(n * heads * d)),
        k_planar(static_cast<std::size_t>(n * kv_heads * d)), v_planar(k_planar.size()),
        out_planar(q_planar.size());
    for (Index h = 0; h < heads; ++h)
      Eigen::Map<RowMatrix<TestType>>(q_planar.data() + h * n * d, n, d) = head_of(q, h, d);
    for (Index h = 0; h < kv_heads; ++h) {
      Eigen::Map<RowMatrix<TestType>>(k_planar.data() + h * n * d, n, d) = head_of(k, h, d);
      Eigen::Map<RowMatrix<TestType>>(v_planar.data() + h * n * d, n, d) = head_of(v, h, d);
    }
    poslsh::multihead_attention<TestType>(
        poslsh::planar_heads<const TestType>(q_planar.data(), n, heads, d),
        poslsh::planar_heads<const TestType>(k_planar.data(), n, kv_heads, d),
        poslsh::planar_heads<const TestType>(v_planar.data(), n, kv_heads, d),
        poslsh::planar_heads<TestType>(out_planar.data(), n, heads, d), options);
    const std::vector<double> sigmas = poslsh::alibi_sigmas(static_cast<int>(heads));
    for (Index h = 0; h < heads; ++h) {
      const Index g = h / (heads / kv_heads);
      const RowMatrix<TestType> qh = head_of(q, h, d), kh = head_of(k, g, d), vh = head_of(v, g, d);
      const double sigma = sigmas[static_cast<std::size_t>(h)];
      const HashSet hashes = poslsh::rbf_hashes(sigma, 5, 17, static_cast<std::uint64_t>(h));
      RowMatrix<TestType> expected;
      switch (method) {
        case Method::lsh_fused:
          expected = poslsh::lsh_attention_fused<TestType>(qh, kh, vh, hashes);
          break;
        case Method::lsh_per_sample:
          expected = poslsh::lsh_attention_per_sample<TestType>(qh, kh, vh, hashes);
          break;
        case Method::fixed_blocks:
          expected = poslsh::fixed_blocks_attention<TestType>(qh, kh, vh, sigma);
          break;
        case Method::exact_tiled:
          expected = poslsh::alibi_attention_tiled<TestType>(qh, kh, vh, sigma);
          break;
        case Method::exact_banded:
          expected = poslsh::alibi_attention_banded<TestType>(
              qh, kh, vh, sigma, poslsh::band_for_bias_error(sigma, 1e-3));
          break;
        case Method::mean_of_outputs:
          expected = poslsh::lsh_attention_mean_of_outputs<TestType>(qh, kh, vh, hashes);
          break;
      }
      INFO("method " << static_cast<int>(method) << ", head " << h);
      // Same kernel on the same numbers: identical bits.
      CHECK(head_of(out, h, d) == expected);
      CHECK(Eigen::Map<RowMatrix<TestType>>(out_planar.data() + h * n * d, n, d) == expected);
    }
  }
}

namespace {

// The bits of rows [row0, row0 + rows) of an [n, H, d] output whose rows lie row_stride
// elements apart, as one row-major [rows, H d] bit pattern per element.
template <typename Element>
std::vector<Element> gather_rows(const Element* data, Index row0, Index rows, Index width,
                                 Index row_stride) {
  std::vector<Element> bits(static_cast<std::size_t>(rows * width));
  for (Index r = 0; r < rows; ++r)
    std::memcpy(bits.data() + r * width, data + (row0 + r) * row_stride,
                static_cast<std::size_t>(width) * sizeof(Element));
  return bits;
}

template <typename Element>
bool same_bits(const std::vector<Element>& a, const std::vector<Element>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(Element)) == 0;
}

// A call whose output is too large to stay cached stores it non-temporally; the same rows
// computed in chunks small enough to be stored as usual must have the same bits. Row strides
// of H d, H d + 8 (every other row off a 64-byte line for float, a 32-byte one for bfloat16)
// and a buffer one element off alignment cover the aligned and the fallback stores. Wide rows
// (16 heads of 128) reach the streaming size at few tokens, so the calls stay short.
template <typename Element>
void check_streamed_output(Index n) {
  const Index heads = 16, d = 128, width = heads * d, chunk = 256;
  const auto q = random_matrix<float>(n, width, 91).cast<Element>().eval();
  const auto k = random_matrix<float>(n, width, 92).cast<Element>().eval();
  const auto v = random_matrix<float>(n, width, 93).cast<Element>().eval();
  const auto bytes = [&](Index rows) {
    return static_cast<std::size_t>(rows * width) * sizeof(Element);
  };
  // The whole call streams; a chunk does not.
  REQUIRE(poslsh::detail::streams_output(bytes(n)));
  REQUIRE_FALSE(poslsh::detail::streams_output(bytes(chunk)));
  const auto view = [&](const RowMatrix<Element>& m, Index row0, Index rows) {
    return poslsh::interleaved_heads<const Element>(m.data() + row0 * width, rows, heads, d);
  };
  for (Method method : {Method::lsh_fused, Method::exact_banded}) {
    const MultiHeadOptions options = multihead_options(method, Masking::causal, 4, 5);
    std::vector<Element> chunked;
    for (Index row_stride : {width, width + 8}) {
      for (Index shift : {Index{0}, Index{1}}) {
        INFO("method " << static_cast<int>(method) << ", row stride " << row_stride << ", shift "
                       << shift);
        // Aligned to the largest packet the build vectorizes with (the streamed stores' unit).
        std::vector<Element, Eigen::aligned_allocator<Element>> buffer(
            static_cast<std::size_t>(n * row_stride + shift));
        Element* const out = buffer.data() + shift;
        const auto out_view = [&](Index row0, Index rows) {
          poslsh::HeadsView<Element> o =
              poslsh::interleaved_heads<Element>(out + row0 * row_stride, rows, heads, d);
          o.row_stride = row_stride;
          return o;
        };
        poslsh::multihead_attention<Element, Element, Element>(
            view(q, 0, n), view(k, 0, n), view(v, 0, n), out_view(0, n), options);
        const std::vector<Element> whole = gather_rows(out, 0, n, width, row_stride);
        if (chunked.empty()) {
          for (Index row0 = 0; row0 < n; row0 += chunk) {
            MultiHeadOptions part = options;
            part.query_offset = row0;
            poslsh::multihead_attention<Element, Element, Element>(
                view(q, row0, chunk), view(k, 0, row0 + chunk), view(v, 0, row0 + chunk),
                out_view(row0, chunk), part);
          }
          chunked = gather_rows(out, 0, n, width, row_stride);
        }
        CHECK(same_bits(whole, chunked));
      }
    }
  }
}

}  // namespace

TEST_CASE("outputs too large to stay cached are stored non-temporally, with the same bits",
          "[multihead][long]") {
  SECTION("float") { check_streamed_output<float>(1024); }
  SECTION("bfloat16") { check_streamed_output<Eigen::bfloat16>(2048); }
}

TEST_CASE("one and two threads give identical bits", "[multihead]") {
#ifdef _OPENMP
  const Index n = 700, d = 16, heads = 4;
  const auto [q, k, v] = random_qkv<float>(n, heads * d, heads * d, 81);
  for (Method method : {Method::lsh_fused, Method::lsh_per_sample, Method::mean_of_outputs}) {
    MultiHeadOptions options;
    options.method = method;
    std::vector<RowMatrix<float>> results;
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      RowMatrix<float> out(n, heads * d);
      poslsh::multihead_attention<float>(
          poslsh::interleaved_heads<const float>(q.data(), n, heads, d),
          poslsh::interleaved_heads<const float>(k.data(), n, heads, d),
          poslsh::interleaved_heads<const float>(v.data(), n, heads, d),
          poslsh::interleaved_heads<float>(out.data(), n, heads, d), options);
      results.push_back(out);
      // Single-head kernels parallelize inside: check them too.
      const RowMatrix<float> q0 = head_of(q, 0, d), k0 = head_of(k, 0, d), v0 = head_of(v, 0, d);
      const HashSet hashes = poslsh::rbf_hashes(64.0, 16, 3, 0);
      results.push_back(poslsh::lsh_attention_fused<float>(q0, k0, v0, hashes));
      results.push_back(poslsh::lsh_attention_per_sample<float>(q0, k0, v0, hashes));
    }
    omp_set_num_threads(omp_get_num_procs());
    INFO("method " << static_cast<int>(method));
    CHECK(results[0] == results[3]);
    CHECK(results[1] == results[4]);
    CHECK(results[2] == results[5]);
  }
#else
  WARN("built without OpenMP: the kernels run serially");
  CHECK(true);
#endif
}

TEST_CASE("multihead_attention rejects bad arguments", "[multihead][invalid]") {
  const Index n = 10, d = 4;
  const auto q = random_matrix<float>(n, 3 * d, 1);
  RowMatrix<float> out(n, 3 * d);
  const auto q3 = poslsh::interleaved_heads<const float>(q.data(), n, 3, d);
  const auto kv2 = poslsh::interleaved_heads<const float>(q.data(), n, 2, d);
  const auto out3 = poslsh::interleaved_heads<float>(out.data(), n, 3, d);
  require_invalid_argument([&] { poslsh::multihead_attention<float>(q3, kv2, kv2, out3); },
                           "k.heads");
  MultiHeadOptions options;
  options.samples = 0;
  require_invalid_argument([&] { poslsh::multihead_attention<float>(q3, q3, q3, out3, options); },
                           "options.samples");
  options = MultiHeadOptions{};
  options.method = Method::exact_banded;
  options.band_error = 1.5;
  require_invalid_argument([&] { poslsh::multihead_attention<float>(q3, q3, q3, out3, options); },
                           "options.band_error");
  options = MultiHeadOptions{};
  options.sigmas = {1.0, 2.0};
  require_invalid_argument([&] { poslsh::multihead_attention<float>(q3, q3, q3, out3, options); },
                           "options.sigmas");
  options.sigmas = {1.0, -2.0, 3.0};
  require_invalid_argument([&] { poslsh::multihead_attention<float>(q3, q3, q3, out3, options); },
                           "options.sigmas");
  auto short_k = poslsh::interleaved_heads<const float>(q.data(), n - 1, 3, d);
  require_invalid_argument([&] { poslsh::multihead_attention<float>(q3, short_k, q3, out3); },
                           "k.tokens");
  auto bad_stride = q3;
  bad_stride.row_stride = d - 1;
  require_invalid_argument([&] { poslsh::multihead_attention<float>(bad_stride, q3, q3, out3); },
                           "q.row_stride");
  auto out2 = poslsh::interleaved_heads<float>(out.data(), n, 2, d);
  require_invalid_argument([&] { poslsh::multihead_attention<float>(q3, q3, q3, out2); }, "out");
  // A value outside the method table is a named error before the heads run.
  options = MultiHeadOptions{};
  options.method = static_cast<Method>(99);
  require_invalid_argument([&] { poslsh::multihead_attention<float>(q3, q3, q3, out3, options); },
                           "options.method");
  const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(n)};
  require_invalid_argument(
      [&] { poslsh::multihead_attention_varlen<float>(q3, q3, q3, out3, cu, cu, options); },
      "options.method");
  options = MultiHeadOptions{};
  options.query_offset = 0;
  poslsh::multihead_attention<float>(q3, q3, q3, out3, options);  // self-attention: accepted
}

namespace {

// Every (query tile, head) job of parallel_query_tiles<float, Input> run once (21 query tiles,
// not a multiple of a run, of rows [5, 1300); 3 heads), and on one thread in its order:
// head_runs takes groups of `run` tiles (the last one shorter), each group head by head;
// heads_outer head by head.
template <typename Input>
void check_job_orders(Index run_length) {
  using poslsh::detail::JobOrder;
  constexpr Index heads = 3, tile = poslsh::detail::tile_query_rows;
  std::vector<poslsh::detail::QueryTile> tiles;
  poslsh::detail::append_query_tiles(tiles, 0, 5, 1300);
  REQUIRE(tiles.size() == 21);
  const auto tile_index = [](Index row_begin) { return row_begin / tile; };
  for (const JobOrder order : {JobOrder::head_runs, JobOrder::heads_outer}) {
    INFO("order " << static_cast<int>(order) << ", runs of " << run_length);
    std::vector<int> runs(tiles.size() * heads, 0);
    poslsh::detail::parallel_query_tiles<float, Input>(
        tiles, heads, order, 0,
        [&](const poslsh::detail::QueryTile& t, Index h, poslsh::detail::TileWorkspace<float>& w) {
          CHECK(w.buffers.keep_packed_tiles);
          CHECK(w.buffers.keep_key_rows == (order == JobOrder::heads_outer));
#ifdef _OPENMP
#pragma omp atomic
#endif
          ++runs[static_cast<std::size_t>(tile_index(t.row_begin) * heads + h)];
        });
    CHECK(std::count(runs.begin(), runs.end(), 1) == static_cast<long>(runs.size()));
#ifdef _OPENMP
    omp_set_num_threads(1);
    std::vector<std::pair<Index, Index>> seen;
    poslsh::detail::parallel_query_tiles<float, Input>(
        tiles, heads, order, 0,
        [&](const poslsh::detail::QueryTile& t, Index h, poslsh::detail::TileWorkspace<float>&) {
          seen.emplace_back(tile_index(t.row_begin), h);
        });
    omp_set_num_threads(omp_get_num_procs());
    std::vector<std::pair<Index, Index>> expected;
    const auto count = static_cast<Index>(tiles.size());
    const Index run = order == JobOrder::head_runs ? run_length : count;
    for (Index first = 0; first < count; first += run)
      for (Index h = 0; h < heads; ++h)
        for (Index t = first; t < std::min(first + run, count); ++t) expected.emplace_back(t, h);
    CHECK(seen == expected);
#endif
  }
}

}  // namespace

TEST_CASE("both job orders run every (query tile, head) job once, in their order", "[multihead]") {
  // Head runs of 4 tiles for float inputs, 8 for half-precision ones.
  check_job_orders<float>(4);
  check_job_orders<Eigen::bfloat16>(8);
}

TEST_CASE("the parallel job loop carries a job's exception out with its type", "[multihead]") {
  // An error inside the loop (here std::bad_alloc, as a failed allocation would throw) reaches
  // the caller with its type; jobs after it may be skipped, jobs before it have run.
  struct Workspace {};
  std::vector<int> ran(64, 0);
  const auto run = [&](long failing) {
    poslsh::detail::parallel_jobs<Workspace>(64, [&](long j, Workspace&) {
      if (j == failing) throw std::bad_alloc();
      ran[static_cast<std::size_t>(j)] = 1;
    });
  };
  CHECK_THROWS_AS(run(5), std::bad_alloc);
  std::fill(ran.begin(), ran.end(), 0);
  run(-1);
  CHECK(std::count(ran.begin(), ran.end(), 1) == 64);
  // A std::invalid_argument stays one too (not wrapped, not turned into another type).
  CHECK_THROWS_AS(poslsh::detail::parallel_jobs<Workspace>(8,
                                                           [](long j, Workspace&) {
                                                             if (j == 7)
                                                               throw std::invalid_argument("job 7");
                                                           }),
                  std::invalid_argument);
}
