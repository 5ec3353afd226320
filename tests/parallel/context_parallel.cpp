// Context parallelism without a transport: every rank of a plan computed in turn from the rows
// the plan says it reads. Halo methods give bitwise the single-process rows (forward, lse and
// gradients), the exact ring merged by lse equals it to rounding, the halos equal a brute-force
// scan of the weights, and the shards tile the sequence.
#include <algorithm>
#include <cmath>
#include <limits>
#include <poslsh/parallel/context_parallel.hpp>
#include <string>
#include <vector>

#include "test_support.hpp"

using poslsh::ContextParallelChunk;
using poslsh::ContextParallelPlan;
using poslsh::HeadMethod;
using poslsh::Index;
using poslsh::Masking;
using poslsh::Method;
using poslsh::MultiHeadOptions;
using poslsh::PositionRange;
using poslsh::RowMatrix;
using poslsh::ShardLayout;
using poslsh_test::random_matrix;

namespace {

constexpr Index cp_heads = 4, cp_kv_heads = 2, cp_d = 8;

// The options of one case: sigmas from below one token to beyond a shard.
MultiHeadOptions cp_options(Method method, Masking masking) {
  MultiHeadOptions options;
  options.method = method;
  options.masking = masking;
  options.sigmas = {0.7, 3.0, 17.0, 400.0};
  options.samples = 5;
  options.seed = 23;
  options.band_error = 1e-2;
  if (method == Method::exact_tiled) {
    options.window_left = 37;
    options.window_right = 11;
  }
  return options;
}

// Whether query i and key j have a nonzero weight under `head`, from the definitions: a hash
// holding both in one bin (LSH methods), or the band and the local window (exact methods).
bool weight_nonzero(const HeadMethod& head, Index i, Index j, Masking masking) {
  if (masking == Masking::causal && j > i) return false;
  if (head.method == Method::exact_tiled || head.method == Method::exact_banded) {
    if (head.method == Method::exact_banded && std::abs(i - j) > head.band) return false;
    if (head.window_left >= 0 && i - j > head.window_left) return false;
    if (head.window_right >= 0 && j - i > head.window_right) return false;
    return true;
  }
  for (const poslsh::BinHash& hash : head.hashes)
    if (hash.bin(i) == hash.bin(j)) return true;
  return false;
}

// Rows `range` of a [n, H, d] buffer copied into a buffer at positions `span` (H heads of
// `dim`), only the heads' own rows (rows[head]) filled; the rest stays zero.
template <typename Scalar>
RowMatrix<Scalar> gather_rows(const RowMatrix<Scalar>& full, PositionRange span,
                              const std::vector<PositionRange>& rows, Index dim) {
  RowMatrix<Scalar> buffer = RowMatrix<Scalar>::Zero(span.size(), full.cols());
  for (std::size_t h = 0; h < rows.size(); ++h) {
    const PositionRange part = poslsh::range_intersection(rows[h], span);
    buffer.block(part.begin - span.begin, static_cast<Index>(h) * dim, part.size(), dim) =
        full.block(part.begin, static_cast<Index>(h) * dim, part.size(), dim);
  }
  return buffer;
}

// The rows of K/V head g for each query head h (h / G = g).
std::vector<PositionRange> per_query_head(const std::vector<PositionRange>& kv_rows) {
  std::vector<PositionRange> rows;
  const Index group = cp_heads / cp_kv_heads;
  for (Index h = 0; h < cp_heads; ++h) rows.push_back(kv_rows[static_cast<std::size_t>(h / group)]);
  return rows;
}

template <typename Scalar>
struct SingleProcess {
  RowMatrix<Scalar> q, k, v, out, dout, dq, dk, dv;
  RowMatrix<Scalar> lse;  // H_q x n
};

template <typename Scalar>
SingleProcess<Scalar> single_process(Index n, const MultiHeadOptions& options) {
  SingleProcess<Scalar> s;
  s.q = random_matrix<Scalar>(n, cp_heads * cp_d, 301);
  s.k = random_matrix<Scalar>(n, cp_kv_heads * cp_d, 302);
  s.v = random_matrix<Scalar>(n, cp_kv_heads * cp_d, 303);
  s.dout = random_matrix<Scalar>(n, cp_heads * cp_d, 304);
  s.out.resize(n, cp_heads * cp_d);
  s.lse.resize(cp_heads, n);
  s.dq.resize(n, cp_heads * cp_d);
  s.dk.resize(n, cp_kv_heads * cp_d);
  s.dv.resize(n, cp_kv_heads * cp_d);
  const auto q = poslsh::interleaved_heads<const Scalar>(s.q.data(), n, cp_heads, cp_d);
  const auto k = poslsh::interleaved_heads<const Scalar>(s.k.data(), n, cp_kv_heads, cp_d);
  const auto v = poslsh::interleaved_heads<const Scalar>(s.v.data(), n, cp_kv_heads, cp_d);
  poslsh::multihead_attention_with_lse<Scalar>(
      q, k, v, poslsh::interleaved_heads<Scalar>(s.out.data(), n, cp_heads, cp_d), s.lse, options);
  poslsh::multihead_attention_backward<Scalar>(
      q, k, v, poslsh::interleaved_heads<const Scalar>(s.out.data(), n, cp_heads, cp_d), s.lse,
      poslsh::interleaved_heads<const Scalar>(s.dout.data(), n, cp_heads, cp_d),
      poslsh::interleaved_heads<Scalar>(s.dq.data(), n, cp_heads, cp_d),
      poslsh::interleaved_heads<Scalar>(s.dk.data(), n, cp_kv_heads, cp_d),
      poslsh::interleaved_heads<Scalar>(s.dv.data(), n, cp_kv_heads, cp_d), options);
  return s;
}

// Bitwise equality of two blocks, reporting the first difference.
template <typename A, typename B>
void require_bitwise(const A& got, const B& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.rows() == want.rows());
  REQUIRE(got.cols() == want.cols());
  for (Index r = 0; r < got.rows(); ++r)
    for (Index c = 0; c < got.cols(); ++c) {
      if (got(r, c) == want(r, c)) continue;
      INFO("row " << r << " col " << c << ": " << got(r, c) << " != " << want(r, c));
      REQUIRE(got(r, c) == want(r, c));
    }
}

// Forward and backward of one chunk from the rows the plan reads, against the single process.
template <typename Scalar>
void check_halo_chunk(const SingleProcess<Scalar>& s, const ContextParallelChunk& chunk,
                      const MultiHeadOptions& options, const std::string& where) {
  const PositionRange own = chunk.queries;
  if (own.empty()) return;
  const Index m = own.size();
  // Forward: the own queries over the key buffer.
  const RowMatrix<Scalar> kb = gather_rows(s.k, chunk.key_span, chunk.keys, cp_d);
  const RowMatrix<Scalar> vb = gather_rows(s.v, chunk.key_span, chunk.keys, cp_d);
  const RowMatrix<Scalar> qb = s.q.middleRows(own.begin, m);
  RowMatrix<Scalar> out(m, cp_heads * cp_d), lse(cp_heads, m);
  const Index L = chunk.key_span.size();
  poslsh::multihead_attention_slice<Scalar>(
      poslsh::interleaved_heads<const Scalar>(qb.data(), m, cp_heads, cp_d),
      poslsh::interleaved_heads<const Scalar>(kb.data(), L, cp_kv_heads, cp_d),
      poslsh::interleaved_heads<const Scalar>(vb.data(), L, cp_kv_heads, cp_d),
      poslsh::interleaved_heads<Scalar>(out.data(), m, cp_heads, cp_d), lse, own.begin,
      chunk.key_span.begin, options);
  require_bitwise(out, s.out.middleRows(own.begin, m), where + ": forward rows");
  require_bitwise(lse, s.lse.middleCols(own.begin, m), where + ": lse");
  // Backward on the window.
  const PositionRange w = chunk.window_span;
  const Index wn = w.size();
  const std::vector<PositionRange> query_rows = per_query_head(chunk.window);
  const RowMatrix<Scalar> wq = gather_rows(s.q, w, query_rows, cp_d);
  const RowMatrix<Scalar> wk = gather_rows(s.k, w, chunk.window, cp_d);
  const RowMatrix<Scalar> wv = gather_rows(s.v, w, chunk.window, cp_d);
  const RowMatrix<Scalar> wo = gather_rows(s.out, w, query_rows, cp_d);
  const RowMatrix<Scalar> wg = gather_rows(s.dout, w, query_rows, cp_d);
  RowMatrix<Scalar> wl = RowMatrix<Scalar>::Zero(cp_heads, wn);
  for (Index h = 0; h < cp_heads; ++h) {
    const PositionRange part =
        poslsh::range_intersection(query_rows[static_cast<std::size_t>(h)], w);
    wl.row(h).segment(part.begin - w.begin, part.size()) =
        s.lse.row(h).segment(part.begin, part.size());
  }
  RowMatrix<Scalar> dq(wn, cp_heads * cp_d), dk(wn, cp_kv_heads * cp_d), dv(wn, cp_kv_heads * cp_d);
  poslsh::multihead_attention_window_backward<Scalar>(
      poslsh::interleaved_heads<const Scalar>(wq.data(), wn, cp_heads, cp_d),
      poslsh::interleaved_heads<const Scalar>(wk.data(), wn, cp_kv_heads, cp_d),
      poslsh::interleaved_heads<const Scalar>(wv.data(), wn, cp_kv_heads, cp_d),
      poslsh::interleaved_heads<const Scalar>(wo.data(), wn, cp_heads, cp_d), wl,
      poslsh::interleaved_heads<const Scalar>(wg.data(), wn, cp_heads, cp_d),
      poslsh::interleaved_heads<Scalar>(dq.data(), wn, cp_heads, cp_d),
      poslsh::interleaved_heads<Scalar>(dk.data(), wn, cp_kv_heads, cp_d),
      poslsh::interleaved_heads<Scalar>(dv.data(), wn, cp_kv_heads, cp_d), w.begin, options);
  const Index first = own.begin - w.begin;
  require_bitwise(dq.middleRows(first, m), s.dq.middleRows(own.begin, m), where + ": dq");
  require_bitwise(dk.middleRows(first, m), s.dk.middleRows(own.begin, m), where + ": dk");
  require_bitwise(dv.middleRows(first, m), s.dv.middleRows(own.begin, m), where + ": dv");
}

}  // namespace

TEST_CASE("shard_ranges tile the sequence, contiguous and zigzag", "[context_parallel]") {
  for (Index n : {0, 1, 5, 203, 1000}) {
    for (Index ranks : {1, 2, 3, 4, 7}) {
      for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
        std::vector<PositionRange> all;
        for (Index r = 0; r < ranks; ++r) {
          const auto ranges = poslsh::shard_ranges(n, ranks, r, layout);
          REQUIRE(ranges.size() == (layout == ShardLayout::zigzag ? 2U : 1U));
          for (const PositionRange& range : ranges) {
            // n c / parts rounded down: sizes differ by at most one.
            const Index parts = layout == ShardLayout::zigzag ? 2 * ranks : ranks;
            CHECK(range.size() >= n / parts);
            CHECK(range.size() <= n / parts + 1);
            all.push_back(range);
          }
        }
        std::sort(all.begin(), all.end(), [](const PositionRange& a, const PositionRange& b) {
          return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
        });
        Index next = 0;
        for (const PositionRange& range : all) {
          CHECK(range.begin == next);
          next = range.end;
        }
        CHECK(next == n);
      }
    }
  }
  // Zigzag: rank r holds chunks r and 2R - 1 - r.
  const auto ranges = poslsh::shard_ranges(80, 4, 1, ShardLayout::zigzag);
  CHECK(ranges[0] == PositionRange{10, 20});
  CHECK(ranges[1] == PositionRange{60, 70});
}

TEST_CASE("head_key_range and head_query_range equal a brute-force scan of the weights",
          "[context_parallel]") {
  const Index n = 157;
  for (Method method : {Method::lsh_fused, Method::lsh_per_sample, Method::fixed_blocks,
                        Method::exact_banded, Method::exact_tiled}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      const auto heads = poslsh::resolve_head_methods(cp_heads, cp_options(method, masking));
      for (const HeadMethod& head : heads) {
        for (const PositionRange own : {PositionRange{0, 13}, PositionRange{40, 41},
                                        PositionRange{60, 120}, PositionRange{150, 157}}) {
          INFO(poslsh::enum_name(method)
               << " " << poslsh_test::masking_name(masking) << " sigma " << head.sigma << " own ["
               << own.begin << ", " << own.end << ")");
          Index key_lo = n, key_hi = -1, query_lo = n, query_hi = -1;
          for (Index i = own.begin; i < own.end; ++i)
            for (Index j = 0; j < n; ++j) {
              if (weight_nonzero(head, i, j, masking)) {
                key_lo = std::min(key_lo, j);
                key_hi = std::max(key_hi, j);
              }
              // Queries j reaching the own key i.
              if (weight_nonzero(head, j, i, masking)) {
                query_lo = std::min(query_lo, j);
                query_hi = std::max(query_hi, j);
              }
            }
          CHECK(poslsh::head_key_range(head, own, n, masking) == PositionRange{key_lo, key_hi + 1});
          CHECK(poslsh::head_query_range(head, own, n, masking) ==
                PositionRange{query_lo, query_hi + 1});
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("context parallel halos give bitwise the single-process rows and gradients",
                   "[context_parallel]", float, double) {
  const Index n = 203;  // not a multiple of R = 2, 3, 4 or of the tile
  for (Method method : {Method::lsh_fused, Method::lsh_per_sample, Method::fixed_blocks,
                        Method::exact_banded, Method::exact_tiled}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      const MultiHeadOptions options = cp_options(method, masking);
      const SingleProcess<TestType> s = single_process<TestType>(n, options);
      const auto heads = poslsh::resolve_head_methods(cp_heads, options);
      for (Index ranks : {1, 2, 3, 4}) {
        for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
          const ContextParallelPlan plan =
              poslsh::context_parallel_plan(n, ranks, layout, heads, cp_kv_heads, masking);
          REQUIRE_FALSE(plan.ring);
          for (Index r = 0; r < ranks; ++r)
            for (const ContextParallelChunk& chunk : plan.chunks[static_cast<std::size_t>(r)])
              check_halo_chunk(s, chunk, options,
                               std::string(poslsh::enum_name(method)) + " " +
                                   poslsh_test::masking_name(masking) +
                                   " R=" + std::to_string(ranks) + " " + poslsh::enum_name(layout) +
                                   " rank " + std::to_string(r));
        }
      }
    }
  }
}

TEST_CASE("a shard shorter than a block reads keys of several ranks", "[context_parallel]") {
  const Index n = 203;
  const MultiHeadOptions options = cp_options(Method::lsh_fused, Masking::bidirectional);
  const auto heads = poslsh::resolve_head_methods(cp_heads, options);
  const ContextParallelPlan plan = poslsh::context_parallel_plan(
      n, 8, ShardLayout::contiguous, heads, cp_kv_heads, Masking::bidirectional);
  // sigma 400 (the last head, K/V head 1): its blocks are far longer than a shard of ~25.
  bool spans_several = false;
  for (const auto& chunks : plan.chunks) {
    const PositionRange keys = chunks.front().keys[1];
    spans_several = spans_several || plan.owner(keys.begin) + 1 < plan.owner(keys.end - 1);
    CHECK(plan.owner(keys.begin) >= 0);
  }
  CHECK(spans_several);
  CHECK(plan.owner(-1) == -1);
  CHECK(plan.owner(n) == -1);
}

TEMPLATE_TEST_CASE("the exact ring merged by lse equals the single-process call",
                   "[context_parallel]", float, double) {
  const Index n = 150;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    MultiHeadOptions options;
    options.method = Method::exact_tiled;
    options.masking = masking;
    options.sigmas = {0.5, 4.0, 60.0, 1e6};
    const SingleProcess<TestType> s = single_process<TestType>(n, options);
    const auto heads = poslsh::resolve_head_methods(cp_heads, options);
    for (Index ranks : {2, 3, 4}) {
      const ContextParallelPlan plan =
          poslsh::context_parallel_plan(n, ranks, ShardLayout::zigzag, heads, cp_kv_heads, masking);
      REQUIRE(plan.ring);
      for (Index r = 0; r < ranks; ++r) {
        for (const ContextParallelChunk& chunk : plan.chunks[static_cast<std::size_t>(r)]) {
          const PositionRange own = chunk.queries;
          const Index m = own.size();
          const RowMatrix<TestType> qb = s.q.middleRows(own.begin, m);
          std::vector<poslsh::LseMerger<TestType>> merged(cp_heads,
                                                          poslsh::LseMerger<TestType>(m, cp_d));
          // Every shard range of every rank is one slice of keys.
          for (Index source = 0; source < ranks; ++source) {
            for (const PositionRange& keys :
                 poslsh::shard_ranges(n, ranks, source, ShardLayout::zigzag)) {
              const Index L = keys.size();
              const RowMatrix<TestType> kb = s.k.middleRows(keys.begin, L);
              const RowMatrix<TestType> vb = s.v.middleRows(keys.begin, L);
              RowMatrix<TestType> out(m, cp_heads * cp_d), lse(cp_heads, m);
              poslsh::multihead_attention_slice<TestType>(
                  poslsh::interleaved_heads<const TestType>(qb.data(), m, cp_heads, cp_d),
                  poslsh::interleaved_heads<const TestType>(kb.data(), L, cp_kv_heads, cp_d),
                  poslsh::interleaved_heads<const TestType>(vb.data(), L, cp_kv_heads, cp_d),
                  poslsh::interleaved_heads<TestType>(out.data(), m, cp_heads, cp_d), lse,
                  own.begin, keys.begin, options);
              // A causal row with every key of the slice after it: 0 and -inf.
              if (masking == Masking::causal && keys.begin > own.end - 1) {
                CHECK(out.cwiseAbs().maxCoeff() == 0);
                CHECK(lse.maxCoeff() == -std::numeric_limits<TestType>::infinity());
              }
              for (Index h = 0; h < cp_heads; ++h) {
                const RowMatrix<TestType> head_out = out.middleCols(h * cp_d, cp_d);
                merged[static_cast<std::size_t>(h)].add(head_out, lse.row(h).transpose());
              }
            }
          }
          for (Index h = 0; h < cp_heads; ++h) {
            RowMatrix<TestType> got(m, cp_d);
            merged[static_cast<std::size_t>(h)].result(got);
            const RowMatrix<TestType> want = s.out.block(own.begin, h * cp_d, m, cp_d);
            CHECK(poslsh_test::relative_max_error(got, want) <
                  20 * poslsh_test::tolerance<TestType>());
          }
        }
      }
    }
  }
}

TEST_CASE("context parallel calls name their bad arguments", "[context_parallel][bad_input]") {
  using poslsh_test::require_invalid_argument;
  require_invalid_argument([] { poslsh::shard_ranges(10, 0, 0); }, "ranks");
  require_invalid_argument([] { poslsh::shard_ranges(10, 2, 2); }, "rank");
  require_invalid_argument([] { poslsh::shard_ranges(-1, 2, 0); }, "n");
  const auto heads = poslsh::resolve_head_methods(4, MultiHeadOptions{});
  require_invalid_argument(
      [&] {
        poslsh::context_parallel_plan(10, 2, ShardLayout::contiguous, heads, 3, Masking::causal);
      },
      "kv_heads");
  require_invalid_argument(
      [&] {
        poslsh::context_parallel_plan({{{0, 4}}, {{5, 10}}}, 10, heads, 2, Masking::causal);
      },
      "shards");
  require_invalid_argument(
      [&] {
        poslsh::context_parallel_plan({{{0, 4}}, {{4, 9}}}, 10, heads, 2, Masking::causal);
      },
      "shards");
  require_invalid_argument([] { poslsh::resolve_head_methods(0, MultiHeadOptions{}); },
                           "query_heads");
  const Index n = 8;
  const RowMatrix<double> x = random_matrix<double>(n, 4, 1);
  RowMatrix<double> out(n, 4), lse(1, n);
  const auto view = poslsh::interleaved_heads<const double>(x.data(), n, 1, 4);
  const auto out_view = poslsh::interleaved_heads<double>(out.data(), n, 1, 4);
  MultiHeadOptions options;
  options.sigmas = {2.0};
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_slice<double>(view, view, view, out_view, lse, -1, 0, options);
      },
      "query_offset");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_slice<double>(view, view, view, out_view, lse, 0, -3, options);
      },
      "key_offset");
  RowMatrix<double> bad_lse(1, n + 1);
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_slice<double>(view, view, view, out_view, bad_lse, 0, 0,
                                                  options);
      },
      "lse");
  MultiHeadOptions offset = options;
  offset.query_offset = 0;
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_slice<double>(view, view, view, out_view, lse, 0, 0, offset);
      },
      "options.query_offset");
  RowMatrix<double> grads(n, 4);
  const auto grad_view = poslsh::interleaved_heads<double>(grads.data(), n, 1, 4);
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_window_backward<double>(
            view, view, view, view, lse, view, grad_view, grad_view, grad_view, -64, options);
      },
      "position");
}
