// Context parallelism without a transport: every rank of a plan computed in turn from the rows
// the plan says it reads, the messages passed between simulated ranks by hand. Halo methods give
// bitwise the single-process rows (forward, lse and gradients), the exact ring (its schedule,
// lse merge and slice gradients) equals it to rounding, the slice backward summed over slices
// equals the whole sequence's backward (bitwise where the summation order is the same), the
// halos equal a brute-force scan of the weights, the traffic counts equal the messages packed,
// and the shards tile the sequence.
#include <algorithm>
#include <cmath>
#include <limits>
#include <poslsh/parallel/context_parallel.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "test_support.hpp"

using poslsh::ContextParallelChunk;
using poslsh::ContextParallelPlan;
using poslsh::HeadMethod;
using poslsh::PositionRange;
using poslsh::ShardLayout;

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
  RowMatrix<Scalar> lse;    // H_q x n
  Eigen::VectorXd dslopes;  // the exact methods' slope gradients
};

// multihead_attention and its backward on one sequence of random rows (with the slope
// gradients for the exact methods), cp_heads query heads of width cp_d over kv_heads.
template <typename Scalar>
SingleProcess<Scalar> single_process(Index n, const MultiHeadOptions& options,
                                     Index kv_heads = cp_kv_heads) {
  SingleProcess<Scalar> s;
  s.q = random_matrix<Scalar>(n, cp_heads * cp_d, 301);
  s.k = random_matrix<Scalar>(n, kv_heads * cp_d, 302);
  s.v = random_matrix<Scalar>(n, kv_heads * cp_d, 303);
  s.dout = random_matrix<Scalar>(n, cp_heads * cp_d, 304);
  s.out.resize(n, cp_heads * cp_d);
  s.lse.resize(cp_heads, n);
  s.dq.resize(n, cp_heads * cp_d);
  s.dk.resize(n, kv_heads * cp_d);
  s.dv.resize(n, kv_heads * cp_d);
  s.dslopes.setZero(cp_heads);
  const auto q = poslsh::interleaved_heads<const Scalar>(s.q.data(), n, cp_heads, cp_d);
  const auto k = poslsh::interleaved_heads<const Scalar>(s.k.data(), n, kv_heads, cp_d);
  const auto v = poslsh::interleaved_heads<const Scalar>(s.v.data(), n, kv_heads, cp_d);
  poslsh::multihead_attention_with_lse<Scalar>(
      q, k, v, poslsh::interleaved_heads<Scalar>(s.out.data(), n, cp_heads, cp_d), s.lse, options);
  const auto out = poslsh::interleaved_heads<const Scalar>(s.out.data(), n, cp_heads, cp_d);
  const auto dout = poslsh::interleaved_heads<const Scalar>(s.dout.data(), n, cp_heads, cp_d);
  const auto dq = poslsh::interleaved_heads<Scalar>(s.dq.data(), n, cp_heads, cp_d);
  const auto dk = poslsh::interleaved_heads<Scalar>(s.dk.data(), n, kv_heads, cp_d);
  const auto dv = poslsh::interleaved_heads<Scalar>(s.dv.data(), n, kv_heads, cp_d);
  if (options.method == Method::exact_tiled || options.method == Method::exact_banded)
    poslsh::multihead_attention_backward<Scalar>(q, k, v, out, s.lse, dout, dq, dk, dv, s.dslopes,
                                                 options);
  else
    poslsh::multihead_attention_backward<Scalar>(q, k, v, out, s.lse, dout, dq, dk, dv, options);
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
  // mean_of_outputs has no lse: rejected by name before any head runs, naming the slice call.
  MultiHeadOptions mean = options;
  mean.method = poslsh::Method::mean_of_outputs;
  mean.samples = 2;
  try {
    poslsh::multihead_attention_slice<double>(view, view, view, out_view, lse, 0, 0, mean);
    FAIL("no exception thrown");
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    INFO("message: " << message);
    CHECK(message.find("multihead_attention_slice") != std::string::npos);
    CHECK(message.find("'options.method'") != std::string::npos);
    CHECK(message.find("call the form without lse") != std::string::npos);
  }
  RowMatrix<double> grads(n, 4);
  const auto grad_view = poslsh::interleaved_heads<double>(grads.data(), n, 1, 4);
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_window_backward<double>(
            view, view, view, view, lse, view, grad_view, grad_view, grad_view, -64, options);
      },
      "position");
}

namespace {

using poslsh::ContextParallelRank;
using poslsh::ContextParallelShapes;
using poslsh::HaloPass;
using poslsh::MessageView;

// The rows of a rank's shard (its ranges in order) of a [n, cols] matrix, or of the columns of
// an H x n lse.
template <typename Scalar>
RowMatrix<Scalar> rank_rows(const RowMatrix<Scalar>& full, const ContextParallelRank& me,
                            bool columns = false) {
  RowMatrix<Scalar> rows(columns ? full.rows() : me.rows(), columns ? me.rows() : full.cols());
  for (const ContextParallelChunk& chunk : me.chunks()) {
    const Index m = chunk.queries.size();
    if (columns)
      rows.middleCols(chunk.row, m) = full.middleCols(chunk.queries.begin, m);
    else
      rows.middleRows(chunk.row, m) = full.middleRows(chunk.queries.begin, m);
  }
  return rows;
}

// One simulated rank: its rows of the single-process inputs and room for its results.
template <typename Scalar>
struct SimulatedRank {
  RowMatrix<Scalar> q, k, v, dout, out, lse, dq, dk, dv;

  SimulatedRank(const SingleProcess<Scalar>& s, const ContextParallelRank& me)
      : q(rank_rows(s.q, me)),
        k(rank_rows(s.k, me)),
        v(rank_rows(s.v, me)),
        dout(rank_rows(s.dout, me)) {
    const Index m = me.rows();
    const ContextParallelShapes& shapes = me.shapes();
    out.setZero(m, shapes.query_heads * shapes.value_dim);
    lse.setZero(shapes.query_heads, m);
    dq.setZero(m, shapes.query_heads * shapes.head_dim);
    dk.setZero(m, shapes.kv_heads * shapes.head_dim);
    dv.setZero(m, shapes.kv_heads * shapes.value_dim);
  }

  static poslsh::HeadsView<const Scalar> input(const RowMatrix<Scalar>& x, Index heads) {
    return poslsh::interleaved_heads<const Scalar>(x.data(), x.rows(), heads, x.cols() / heads);
  }
  static poslsh::HeadsView<Scalar> output(RowMatrix<Scalar>& x, Index heads) {
    return poslsh::interleaved_heads<Scalar>(x.data(), x.rows(), heads, x.cols() / heads);
  }
  poslsh::RankTensors<Scalar> tensors() const {
    return {input(q, cp_heads),
            input(k, cp_kv_heads),
            input(v, cp_kv_heads),
            input(out, cp_heads),
            input(dout, cp_heads),
            lse.data(),
            lse.cols()};
  }
};

// The ranks of a layout (reserved: ring objects hold references to them).
std::vector<ContextParallelRank> all_ranks(Index n, Index ranks, ShardLayout layout,
                                           const MultiHeadOptions& options) {
  std::vector<ContextParallelRank> all;
  all.reserve(static_cast<std::size_t>(ranks));
  for (Index r = 0; r < ranks; ++r)
    all.emplace_back(n, ranks, layout, r, ContextParallelShapes{cp_heads, cp_kv_heads, cp_d, cp_d},
                     options);
  return all;
}

// The messages of one halo pass, sent[r][p] from rank r to rank p, packed by the senders.
template <typename Scalar>
std::vector<std::vector<std::vector<Scalar>>> pack_all(
    const std::vector<ContextParallelRank>& all, const std::vector<SimulatedRank<Scalar>>& sim,
    HaloPass pass) {
  std::vector<std::vector<std::vector<Scalar>>> sent(all.size());
  for (std::size_t r = 0; r < all.size(); ++r)
    for (std::size_t p = 0; p < all.size(); ++p) {
      const auto peer = static_cast<Index>(p);
      sent[r].emplace_back(static_cast<std::size_t>(all[r].sent_elements(peer, pass)), Scalar(0));
      if (p == r) continue;
      REQUIRE(all[r].sent_elements(peer, pass) ==
              all[p].received_elements(static_cast<Index>(r), pass));
      poslsh::pack_halo_message(all[r], peer, pass, sim[r].tensors(), sent[r][p].data());
    }
  return sent;
}

// What rank r receives: the message each rank p packed for it.
template <typename Scalar>
std::vector<MessageView<Scalar>> received_by(
    std::size_t r, const std::vector<std::vector<std::vector<Scalar>>>& sent) {
  std::vector<MessageView<Scalar>> views;
  for (const auto& from : sent)
    views.emplace_back(from[r].data(), static_cast<Index>(from[r].size()));
  return views;
}

}  // namespace

TEMPLATE_TEST_CASE("halo messages between ranks give bitwise the single-process rows and gradients",
                   "[context_parallel]", float, double) {
  const Index n = 203;
  for (Method method : {Method::lsh_fused, Method::lsh_per_sample, Method::fixed_blocks,
                        Method::exact_banded, Method::exact_tiled}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      const MultiHeadOptions options = cp_options(method, masking);
      const SingleProcess<TestType> s = single_process<TestType>(n, options);
      for (Index ranks : {1, 2, 3, 4}) {
        for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
          INFO(poslsh::enum_name(method) << " " << poslsh_test::masking_name(masking)
                                         << " R=" << ranks << " " << poslsh::enum_name(layout));
          const std::vector<ContextParallelRank> all = all_ranks(n, ranks, layout, options);
          std::vector<SimulatedRank<TestType>> sim;
          for (const ContextParallelRank& me : all) sim.emplace_back(s, me);
          const auto forward = pack_all(all, sim, HaloPass::forward);
          for (std::size_t r = 0; r < all.size(); ++r) {
            SimulatedRank<TestType>& me = sim[r];
            poslsh::halo_forward(all[r], me.tensors(), received_by(r, forward),
                                 me.output(me.out, cp_heads), me.lse);
            require_bitwise(me.out, rank_rows(s.out, all[r]), "out");
            require_bitwise(me.lse, rank_rows(s.lse, all[r], true), "lse");
          }
          const auto backward = pack_all(all, sim, HaloPass::backward);
          for (std::size_t r = 0; r < all.size(); ++r) {
            SimulatedRank<TestType>& me = sim[r];
            poslsh::halo_backward(all[r], me.tensors(), received_by(r, backward),
                                  me.output(me.dq, cp_heads), me.output(me.dk, cp_kv_heads),
                                  me.output(me.dv, cp_kv_heads));
            require_bitwise(me.dq, rank_rows(s.dq, all[r]), "dq");
            require_bitwise(me.dk, rank_rows(s.dk, all[r]), "dk");
            require_bitwise(me.dv, rank_rows(s.dv, all[r]), "dv");
          }
        }
      }
    }
  }
}

TEST_CASE("ring_step: each rank receives what its predecessor held", "[context_parallel]") {
  for (Index ranks : {1, 2, 3, 5}) {
    for (Index r = 0; r < ranks; ++r) {
      for (Index step = 0; step < ranks; ++step) {
        const poslsh::RingStep at = poslsh::ring_step(ranks, r, step);
        CHECK(at.source == ((r - step) % ranks + ranks) % ranks);
        CHECK(at.transfers == (step + 1 < ranks));
        CHECK(poslsh::ring_step(ranks, at.send_to, step).receive_from == r);
        if (!at.transfers) continue;
        // What arrives is what the predecessor holds now, and what this rank holds next.
        CHECK(poslsh::ring_step(ranks, at.receive_from, step).source == at.arriving);
        CHECK(poslsh::ring_step(ranks, r, step + 1).source == at.arriving);
      }
    }
  }
}

TEMPLATE_TEST_CASE("the ring schedule over simulated ranks equals the single-process call",
                   "[context_parallel]", float, double) {
  const Index n = 150;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (Index window_left : {-1, 30}) {
      if (window_left >= 0 && masking == Masking::causal) continue;  // a halo, not a ring
      MultiHeadOptions options;
      options.method = Method::exact_tiled;
      options.masking = masking;
      options.sigmas = {0.5, 4.0, 60.0, 1e6};
      options.window_left = window_left;
      const SingleProcess<TestType> s = single_process<TestType>(n, options);
      for (Index ranks : {1, 2, 3, 4}) {
        for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
          INFO(poslsh_test::masking_name(masking) << " window_left " << window_left << " R="
                                                  << ranks << " " << poslsh::enum_name(layout));
          const std::vector<ContextParallelRank> all = all_ranks(n, ranks, layout, options);
          REQUIRE(all.front().plan().ring);
          std::vector<SimulatedRank<TestType>> sim;
          // The shard buffers as they travel: K rows then V rows.
          std::vector<std::vector<TestType>> shard(all.size());
          for (std::size_t r = 0; r < all.size(); ++r) {
            sim.emplace_back(s, all[r]);
            shard[r].resize(
                static_cast<std::size_t>(poslsh::ring_shard_elements(all[r], all[r].rank())));
            poslsh::pack_ring_shard(sim[r].input(sim[r].k, cp_kv_heads),
                                    sim[r].input(sim[r].v, cp_kv_heads), shard[r].data());
          }
          std::vector<poslsh::RingForward<TestType>> forward;
          std::vector<poslsh::RingBackward<TestType>> backward;
          for (const ContextParallelRank& me : all) {
            forward.emplace_back(me);
            backward.emplace_back(me, true);
          }
          // The held shard of every rank at every step, as the schedule passes it on.
          const auto run_steps = [&](const auto& visit) {
            for (Index step = 0; step < ranks; ++step)
              for (std::size_t r = 0; r < all.size(); ++r) {
                const Index source = poslsh::ring_step(ranks, all[r].rank(), step).source;
                const auto [k, v] = poslsh::ring_shard_views(
                    all[r], source, shard[static_cast<std::size_t>(source)].data());
                visit(r, source, k, v);
              }
          };
          run_steps([&](std::size_t r, Index source, const auto& k, const auto& v) {
            forward[r].add(sim[r].input(sim[r].q, cp_heads), source, k, v);
          });
          for (std::size_t r = 0; r < all.size(); ++r) {
            forward[r].result(sim[r].output(sim[r].out, cp_heads), sim[r].lse);
            CHECK(poslsh_test::relative_max_error(sim[r].out, rank_rows(s.out, all[r])) <
                  20 * poslsh_test::tolerance<TestType>());
            CHECK(poslsh_test::relative_max_error(sim[r].lse, rank_rows(s.lse, all[r], true)) <
                  20 * poslsh_test::tolerance<TestType>());
          }
          run_steps([&](std::size_t r, Index source, const auto& k, const auto& v) {
            const SimulatedRank<TestType>& me = sim[r];
            backward[r].add(me.input(me.q, cp_heads), me.input(me.out, cp_heads), me.lse,
                            me.input(me.dout, cp_heads), source, k, v);
          });
          Eigen::VectorXd dslopes = Eigen::VectorXd::Zero(cp_heads);
          for (std::size_t r = 0; r < all.size(); ++r) {
            std::vector<MessageView<TestType>> received;
            for (const auto& peer : backward) {
              const std::vector<TestType>& part = peer.partial(all[r].rank());
              received.emplace_back(part.data(), static_cast<Index>(part.size()));
            }
            SimulatedRank<TestType>& me = sim[r];
            backward[r].result(received, me.output(me.dq, cp_heads), me.output(me.dk, cp_kv_heads),
                               me.output(me.dv, cp_kv_heads));
            for (const auto& [got, want] :
                 {std::pair{&me.dq, &s.dq}, std::pair{&me.dk, &s.dk}, std::pair{&me.dv, &s.dv}})
              CHECK(poslsh_test::relative_max_error(*got, rank_rows(*want, all[r])) <
                    20 * poslsh_test::tolerance<TestType>());
            dslopes += backward[r].slope_gradients();
          }
          CHECK(poslsh_test::relative_max_error(dslopes, s.dslopes) <
                20 * poslsh_test::tolerance<TestType>());
        }
      }
    }
  }
}

namespace {

// The slice backward of every (query cut, key cut) pair, added into zeroed gradients, queries
// cut at query_cuts and keys at key_cuts (each from 0 to n), key slices in increasing order.
template <typename Scalar>
SingleProcess<Scalar> sliced_backward(const SingleProcess<Scalar>& w, Index kv_heads,
                                      const std::vector<Index>& query_cuts,
                                      const std::vector<Index>& key_cuts,
                                      const MultiHeadOptions& options) {
  const Index n = w.q.rows();
  SingleProcess<Scalar> g;
  g.dq.setZero(n, cp_heads * cp_d);
  g.dk.setZero(n, kv_heads * cp_d);
  g.dv.setZero(n, kv_heads * cp_d);
  g.dslopes.setZero(cp_heads);
  for (std::size_t a = 0; a + 1 < query_cuts.size(); ++a) {
    const Index p0 = query_cuts[a], m = query_cuts[a + 1] - p0;
    const auto rows = [&](const RowMatrix<Scalar>& x, Index heads) {
      return poslsh::interleaved_heads<const Scalar>(x.data() + p0 * x.cols(), m, heads, cp_d);
    };
    for (std::size_t b = 0; b + 1 < key_cuts.size(); ++b) {
      const Index k0 = key_cuts[b], L = key_cuts[b + 1] - k0;
      const auto keys = [&](const RowMatrix<Scalar>& x) {
        return poslsh::interleaved_heads<const Scalar>(x.data() + k0 * x.cols(), L, kv_heads, cp_d);
      };
      poslsh::multihead_attention_slice_backward<Scalar>(
          rows(w.q, cp_heads), keys(w.k), keys(w.v), rows(w.out, cp_heads), w.lse.middleCols(p0, m),
          rows(w.dout, cp_heads),
          poslsh::interleaved_heads<Scalar>(g.dq.data() + p0 * g.dq.cols(), m, cp_heads, cp_d),
          poslsh::interleaved_heads<Scalar>(g.dk.data() + k0 * g.dk.cols(), L, kv_heads, cp_d),
          poslsh::interleaved_heads<Scalar>(g.dv.data() + k0 * g.dv.cols(), L, kv_heads, cp_d),
          g.dslopes, p0, k0, options);
    }
  }
  return g;
}

}  // namespace

TEMPLATE_TEST_CASE("the slice backward summed over slices is the sequence's backward",
                   "[context_parallel][long]", float, double) {
  const Index n = 1300;
  for (Method method : {Method::exact_tiled, Method::exact_banded}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (Index window : {-1, 200}) {
        for (Index kv_heads : {cp_kv_heads, cp_heads}) {
          MultiHeadOptions options;
          options.method = method;
          options.masking = masking;
          options.sigmas = {0.7, 9.0, 150.0, 3e4};
          options.band_error = 1e-2;
          options.window_left = window;
          options.window_right = window < 0 ? -1 : 40;
          INFO(poslsh::enum_name(method) << " " << poslsh_test::masking_name(masking) << " window "
                                         << window << " kv_heads " << kv_heads);
          const SingleProcess<TestType> w = single_process<TestType>(n, options, kv_heads);
          // One slice holding the sequence: the same pass, bitwise (dslopes: 0 + the sum).
          const SingleProcess<TestType> one = sliced_backward(w, kv_heads, {0, n}, {0, n}, options);
          require_bitwise(one.dq, w.dq, "one slice: dq");
          require_bitwise(one.dk, w.dk, "one slice: dk");
          require_bitwise(one.dv, w.dv, "one slice: dv");
          require_bitwise(one.dslopes, w.dslopes, "one slice: dslopes");
          // Key slices on the key groups (512 keys) in increasing order, every query at once:
          // the same sums in the same order, bitwise (dslopes: the groups' sums added).
          const SingleProcess<TestType> keyed =
              sliced_backward(w, kv_heads, {0, n}, {0, 512, 1024, n}, options);
          require_bitwise(keyed.dq, w.dq, "key slices: dq");
          require_bitwise(keyed.dk, w.dk, "key slices: dk");
          require_bitwise(keyed.dv, w.dv, "key slices: dv");
          CHECK(poslsh_test::relative_max_error(keyed.dslopes, w.dslopes) <
                poslsh_test::tolerance<TestType>());
          // Any cut of queries and keys: to rounding.
          const SingleProcess<TestType> cut =
              sliced_backward(w, kv_heads, {0, 97, 300, 700, n}, {0, 130, 555, 1290, n}, options);
          for (const auto& [got, want, what] :
               {std::tuple{&cut.dq, &w.dq, "dq"}, std::tuple{&cut.dk, &w.dk, "dk"},
                std::tuple{&cut.dv, &w.dv, "dv"}}) {
            INFO(what);
            CHECK(poslsh_test::relative_max_error(*got, *want) <
                  4 * poslsh_test::tolerance<TestType>());
          }
          CHECK(poslsh_test::relative_max_error(cut.dslopes, w.dslopes) <
                4 * poslsh_test::tolerance<TestType>());
        }
      }
    }
  }
}

TEST_CASE("halo_traffic and ring_traffic count the messages the ranks pack", "[context_parallel]") {
  const Index n = 301, itemsize = 4;
  struct Case {
    Method method;
    Masking masking;
    ShardLayout layout;
    Index ranks;
  };
  for (const Case& c :
       {Case{Method::lsh_fused, Masking::causal, ShardLayout::zigzag, 3},
        Case{Method::exact_banded, Masking::bidirectional, ShardLayout::contiguous, 4},
        Case{Method::fixed_blocks, Masking::causal, ShardLayout::contiguous, 2},
        Case{Method::lsh_per_sample, Masking::bidirectional, ShardLayout::zigzag, 4}}) {
    INFO(poslsh::enum_name(c.method) << " R=" << c.ranks);
    const MultiHeadOptions options = cp_options(c.method, c.masking);
    const std::vector<ContextParallelRank> all = all_ranks(n, c.ranks, c.layout, options);
    const ContextParallelPlan& plan = all.front().plan();
    const ContextParallelShapes& shapes = all.front().shapes();
    const poslsh::ContextParallelTraffic t = poslsh::halo_traffic(plan, shapes, itemsize);
    for (const HaloPass pass : {HaloPass::forward, HaloPass::backward}) {
      const bool forward = pass == HaloPass::forward;
      for (Index r = 0; r < c.ranks; ++r) {
        const auto at = static_cast<std::size_t>(r);
        const ContextParallelRank& me = all[at];
        // The messages this rank packs and reads.
        Index sent = 0, received = 0, messages = 0;
        for (Index p = 0; p < c.ranks; ++p) {
          if (p == r) continue;
          sent += me.sent_elements(p, pass) * itemsize;
          received += me.received_elements(p, pass) * itemsize;
          messages += (me.sent_elements(p, pass) > 0) + (me.received_elements(p, pass) > 0);
        }
        CHECK((forward ? t.forward_sent : t.backward_sent)[at] == sent);
        CHECK((forward ? t.forward_received : t.backward_received)[at] == received);
        CHECK((forward ? t.forward_messages : t.backward_messages)[at] == messages);
        // The rows outside the own shard, position by position.
        for (Index g = 0; g < cp_kv_heads; ++g) {
          Index rows = 0;
          for (const ContextParallelChunk& chunk : me.chunks()) {
            if (chunk.queries.empty()) continue;
            const PositionRange read = poslsh::halo_rows(chunk, g, pass);
            for (Index p = read.begin; p < read.end; ++p) rows += plan.owner(p) != r;
          }
          CHECK((forward ? t.forward_rows : t.backward_rows)[at][static_cast<std::size_t>(g)] ==
                rows);
        }
      }
    }
    // Only K/V head 1: its rows alone.
    const poslsh::ContextParallelTraffic one =
        poslsh::halo_traffic(plan, shapes, itemsize, {false, true});
    for (Index r = 0; r < c.ranks; ++r) {
      const auto at = static_cast<std::size_t>(r);
      CHECK(one.forward_received[at] == t.forward_rows[at][1] *
                                            poslsh::halo_row_elements(shapes, HaloPass::forward) *
                                            itemsize);
      CHECK(one.forward_rows[at][0] == 0);
    }
    // The ring: every step's held and arriving shards, then the partials.
    const poslsh::ContextParallelTraffic ring = poslsh::ring_traffic(plan, shapes, itemsize);
    for (Index r = 0; r < c.ranks; ++r) {
      const auto at = static_cast<std::size_t>(r);
      Index sent = 0, received = 0;
      for (Index step = 0; step + 1 < c.ranks; ++step) {
        const poslsh::RingStep s = poslsh::ring_step(c.ranks, r, step);
        sent += poslsh::ring_shard_elements(all[at], s.source) * itemsize;
        received += poslsh::ring_shard_elements(all[at], s.arriving) * itemsize;
      }
      CHECK(ring.forward_sent[at] == sent);
      CHECK(ring.forward_received[at] == received);
      CHECK(ring.forward_messages[at] == 2 * (c.ranks - 1));
      CHECK(ring.backward_sent[at] ==
            sent + (n - plan.shard_rows(r)) * cp_kv_heads * 2 * cp_d * itemsize);
      CHECK(ring.backward_received[at] ==
            received + (c.ranks - 1) * plan.shard_rows(r) * cp_kv_heads * 2 * cp_d * itemsize);
      CHECK(ring.backward_messages[at] == 4 * (c.ranks - 1));
    }
  }
}

TEST_CASE("context parallel ranks, halos, rings and slices name their bad arguments",
          "[context_parallel][bad_input]") {
  MultiHeadOptions options;
  options.method = Method::exact_tiled;
  options.sigmas = {2.0, 4.0, 8.0, 16.0};
  const ContextParallelShapes shapes{cp_heads, cp_kv_heads, cp_d, cp_d};
  require_invalid_argument(
      [&] { ContextParallelRank(20, 2, ShardLayout::contiguous, 2, shapes, options); }, "rank");
  require_invalid_argument(
      [&] {
        ContextParallelRank(20, 2, ShardLayout::contiguous, 0,
                            ContextParallelShapes{cp_heads, 3, cp_d, cp_d}, options);
      },
      "shapes.kv_heads");
  require_invalid_argument([] { poslsh::ring_step(3, 0, 3); }, "step");
  require_invalid_argument([] { poslsh::ring_step(3, -1, 0); }, "rank");
  const ContextParallelRank ring(20, 2, ShardLayout::contiguous, 0, shapes, options);
  RowMatrix<double> q = random_matrix<double>(10, cp_heads * cp_d, 5);
  RowMatrix<double> kv = random_matrix<double>(10, cp_kv_heads * cp_d, 6);
  RowMatrix<double> out(10, cp_heads * cp_d), lse(cp_heads, 10);
  const auto qv = poslsh::interleaved_heads<const double>(q.data(), 10, cp_heads, cp_d);
  const auto kvv = poslsh::interleaved_heads<const double>(kv.data(), 10, cp_kv_heads, cp_d);
  const auto out_view = poslsh::interleaved_heads<double>(out.data(), 10, cp_heads, cp_d);
  const poslsh::RankTensors<double> tensors{qv, kvv, kvv, {}, {}};
  std::vector<MessageView<double>> none;
  require_invalid_argument([&] { poslsh::halo_forward(ring, tensors, none, out_view, lse); }, "me");
  MultiHeadOptions banded = options;
  banded.method = Method::exact_banded;
  const ContextParallelRank halo(20, 2, ShardLayout::contiguous, 0, shapes, banded);
  require_invalid_argument([&] { poslsh::halo_forward(halo, tensors, none, out_view, lse); },
                           "messages");
  const poslsh::RankTensors<double> short_q{
      poslsh::interleaved_heads<const double>(q.data(), 9, cp_heads, cp_d), kvv, kvv, {}, {}};
  require_invalid_argument([&] { poslsh::halo_forward(halo, short_q, none, out_view, lse); }, "q");
  poslsh::RingForward<double> forward(ring);
  require_invalid_argument([&] { forward.add(qv, 2, kvv, kvv); }, "source");
  require_invalid_argument(
      [&] {
        forward.add(qv, 1, poslsh::interleaved_heads<const double>(kv.data(), 9, cp_kv_heads, cp_d),
                    kvv);
      },
      "k");
  poslsh::RingBackward<double> backward(ring);
  require_invalid_argument([&] { backward.result(none, out_view, out_view, out_view); },
                           "received");
  // The slice backward: exact methods and lsh_fused (its queries among its keys), offsets >= 0,
  // shapes, dslopes (exact methods).
  RowMatrix<double> grads = RowMatrix<double>::Zero(10, cp_heads * cp_d);
  RowMatrix<double> kv_grads = RowMatrix<double>::Zero(10, cp_kv_heads * cp_d);
  const auto dq = poslsh::interleaved_heads<double>(grads.data(), 10, cp_heads, cp_d);
  const auto dkv = poslsh::interleaved_heads<double>(kv_grads.data(), 10, cp_kv_heads, cp_d);
  const auto outc = poslsh::interleaved_heads<const double>(out.data(), 10, cp_heads, cp_d);
  MultiHeadOptions lsh = options;
  // Queries before the keys: no slice backward for mean_of_outputs, and the other LSH methods'
  // queries must lie among their keys (fixed_blocks too, which draws no hashes).
  for (const auto& [method, name] : {std::pair{Method::mean_of_outputs, "options.method"},
                                     std::pair{Method::lsh_fused, "query_offset"},
                                     std::pair{Method::lsh_per_sample, "query_offset"},
                                     std::pair{Method::fixed_blocks, "query_offset"}}) {
    lsh.method = method;
    require_invalid_argument(
        [&] {
          poslsh::multihead_attention_slice_backward<double>(qv, kvv, kvv, outc, lse, outc, dq, dkv,
                                                             dkv, 0, 10, lsh);
        },
        name);
  }
  Eigen::VectorXd slopes(cp_heads);
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_slice_backward<double>(qv, kvv, kvv, outc, lse, outc, dq, dkv,
                                                           dkv, slopes, 0, 0, lsh);
      },
      "dslopes");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_slice_backward<double>(qv, kvv, kvv, outc, lse, outc, dq, dkv,
                                                           dkv, -1, 10, options);
      },
      "query_offset");
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_slice_backward<double>(qv, kvv, kvv, outc, lse, outc, dkv, dkv,
                                                           dkv, 0, 10, options);
      },
      "dq");
  Eigen::VectorXd few(2);
  require_invalid_argument(
      [&] {
        poslsh::multihead_attention_slice_backward<double>(qv, kvv, kvv, outc, lse, outc, dq, dkv,
                                                           dkv, few, 0, 10, options);
      },
      "dslopes");
  require_invalid_argument([&] { poslsh::halo_segments(halo.plan(), 0, 2, HaloPass::forward); },
                           "source");
  require_invalid_argument(
      [&] {
        poslsh::halo_traffic(halo.plan(), ContextParallelShapes{cp_heads, cp_heads, cp_d, cp_d}, 4);
      },
      "shapes");
}

TEST_CASE("the slice backward and the ring give the same bits for any thread count",
          "[context_parallel][determinism]") {
  const Index n = 700;
  MultiHeadOptions options;
  options.method = Method::exact_tiled;
  options.masking = Masking::bidirectional;
  options.sigmas = {0.7, 9.0, 150.0, 3e4};
  for (Index kv_heads : {cp_kv_heads, cp_heads}) {
    INFO("kv_heads " << kv_heads);
    const SingleProcess<float> w = single_process<float>(n, options, kv_heads);
    // Queries and keys at different offsets, cut across tiles and key groups.
    const std::vector<Index> query_cuts{0, 250, n}, key_cuts{0, 130, 600, n};
    const auto run = [&] {
      const SingleProcess<float> g = sliced_backward(w, kv_heads, query_cuts, key_cuts, options);
      return std::vector<RowMatrix<float>>{g.dq, g.dk, g.dv};
    };
#ifdef _OPENMP
    const int restore = omp_get_max_threads();
    omp_set_num_threads(1);
    const std::vector<RowMatrix<float>> first = run();
    for (int threads : {2, 3, 5}) {
      omp_set_num_threads(threads);
      const std::vector<RowMatrix<float>> other = run();
      for (std::size_t r = 0; r < first.size(); ++r)
        require_bitwise(other[r], first[r],
                        std::to_string(threads) + " threads: gradient " + std::to_string(r));
    }
    omp_set_num_threads(restore);
#else
    WARN("built without OpenMP: nothing to compare");
#endif
  }
  // The ring on three simulated ranks: forward and backward.
  const SingleProcess<float> s = single_process<float>(150, options);
  const auto ring_run = [&] {
    const std::vector<ContextParallelRank> all = all_ranks(150, 3, ShardLayout::zigzag, options);
    std::vector<SimulatedRank<float>> sim;
    std::vector<poslsh::RingForward<float>> forward;
    std::vector<poslsh::RingBackward<float>> backward;
    for (const ContextParallelRank& me : all) {
      sim.emplace_back(s, me);
      forward.emplace_back(me);
      backward.emplace_back(me);
    }
    for (std::size_t r = 0; r < all.size(); ++r)
      for (std::size_t source = 0; source < all.size(); ++source)
        forward[r].add(sim[r].input(sim[r].q, cp_heads), static_cast<Index>(source),
                       sim[source].input(sim[source].k, cp_kv_heads),
                       sim[source].input(sim[source].v, cp_kv_heads));
    std::vector<RowMatrix<float>> results;
    for (std::size_t r = 0; r < all.size(); ++r) {
      SimulatedRank<float>& me = sim[r];
      forward[r].result(me.output(me.out, cp_heads), me.lse);
      for (std::size_t source = 0; source < all.size(); ++source)
        backward[r].add(me.input(me.q, cp_heads), me.input(me.out, cp_heads), me.lse,
                        me.input(me.dout, cp_heads), static_cast<Index>(source),
                        sim[source].input(sim[source].k, cp_kv_heads),
                        sim[source].input(sim[source].v, cp_kv_heads));
      results.push_back(me.out);
    }
    for (std::size_t r = 0; r < all.size(); ++r) {
      std::vector<MessageView<float>> received;
      for (const auto& peer : backward) {
        const std::vector<float>& part = peer.partial(static_cast<Index>(r));
        received.emplace_back(part.data(), static_cast<Index>(part.size()));
      }
      SimulatedRank<float>& me = sim[r];
      backward[r].result(received, me.output(me.dq, cp_heads), me.output(me.dk, cp_kv_heads),
                         me.output(me.dv, cp_kv_heads));
      results.insert(results.end(), {me.dq, me.dk, me.dv});
    }
    return results;
  };
#ifdef _OPENMP
  const int restore = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<RowMatrix<float>> first = ring_run();
  omp_set_num_threads(3);
  const std::vector<RowMatrix<float>> other = ring_run();
  omp_set_num_threads(restore);
  for (std::size_t r = 0; r < first.size(); ++r)
    require_bitwise(other[r], first[r], "ring, 3 threads: result " + std::to_string(r));
#endif
}

TEST_CASE("the slice backward on bfloat16 inputs sums to the sequence's backward bitwise",
          "[context_parallel]") {
  // bfloat16 q, k, v, out, dout with float lse and gradients: on a CPU with a bfloat16 unit the
  // passes multiply pairs on it (the shift of the slice's positions in the pairs' finish).
  using Half = Eigen::bfloat16;
  const Index n = 1100;
  MultiHeadOptions options;
  options.method = Method::exact_tiled;
  options.masking = Masking::causal;
  options.sigmas = {0.7, 9.0, 150.0, 3e4};
  const auto rounded = [](const RowMatrix<float>& x) {
    return RowMatrix<Half>(x.template cast<Half>());
  };
  const RowMatrix<Half> q = rounded(random_matrix<float>(n, cp_heads * cp_d, 501));
  const RowMatrix<Half> k = rounded(random_matrix<float>(n, cp_kv_heads * cp_d, 502));
  const RowMatrix<Half> v = rounded(random_matrix<float>(n, cp_kv_heads * cp_d, 503));
  const RowMatrix<Half> dout = rounded(random_matrix<float>(n, cp_heads * cp_d, 504));
  RowMatrix<Half> out(n, cp_heads * cp_d);
  RowMatrix<float> lse(cp_heads, n), dq(n, cp_heads * cp_d), dk(n, cp_kv_heads * cp_d),
      dv(n, cp_kv_heads * cp_d);
  const auto view = [](const RowMatrix<Half>& x, Index first, Index rows, Index heads) {
    return poslsh::interleaved_heads<const Half>(x.data() + first * x.cols(), rows, heads, cp_d);
  };
  const auto grad = [](RowMatrix<float>& x, Index first, Index rows, Index heads) {
    return poslsh::interleaved_heads<float>(x.data() + first * x.cols(), rows, heads, cp_d);
  };
  poslsh::multihead_attention_with_lse<Half>(
      view(q, 0, n, cp_heads), view(k, 0, n, cp_kv_heads), view(v, 0, n, cp_kv_heads),
      poslsh::interleaved_heads<Half>(out.data(), n, cp_heads, cp_d), lse, options);
  poslsh::multihead_attention_backward<Half>(
      view(q, 0, n, cp_heads), view(k, 0, n, cp_kv_heads), view(v, 0, n, cp_kv_heads),
      view(out, 0, n, cp_heads), lse, view(dout, 0, n, cp_heads), grad(dq, 0, n, cp_heads),
      grad(dk, 0, n, cp_kv_heads), grad(dv, 0, n, cp_kv_heads), options);
  for (const std::vector<Index>& key_cuts : {std::vector<Index>{0, n}, {0, 512, 1024, n}}) {
    INFO(key_cuts.size() - 1 << " key slices");
    RowMatrix<float> sq = RowMatrix<float>::Zero(n, cp_heads * cp_d);
    RowMatrix<float> sk = RowMatrix<float>::Zero(n, cp_kv_heads * cp_d), sv = sk;
    for (std::size_t b = 0; b + 1 < key_cuts.size(); ++b) {
      const Index k0 = key_cuts[b], L = key_cuts[b + 1] - k0;
      poslsh::multihead_attention_slice_backward<Half>(
          view(q, 0, n, cp_heads), view(k, k0, L, cp_kv_heads), view(v, k0, L, cp_kv_heads),
          view(out, 0, n, cp_heads), lse, view(dout, 0, n, cp_heads), grad(sq, 0, n, cp_heads),
          grad(sk, k0, L, cp_kv_heads), grad(sv, k0, L, cp_kv_heads), 0, k0, options);
    }
    require_bitwise(sq, dq, "dq");
    require_bitwise(sk, dk, "dk");
    require_bitwise(sv, dv, "dv");
  }
}
