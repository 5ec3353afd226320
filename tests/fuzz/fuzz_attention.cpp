// poslsh_fuzz: one attention problem per input. The bytes choose the scalar type, n, d, d_v, the
// row strides (padding filled with NaN, so a kernel that reads it produces NaN), sigma, s, the
// hash seed and stream or a hand-built hash, the masking, the scale, the data magnitude, thread
// counts and, for some inputs, one bad argument. For a valid problem it checks:
//  - no crash, no sanitizer report, no write outside the output view;
//  - finite inputs give finite outputs (every kernel);
//  - lsh_attention_fused equals lsh_attention_per_sample; the same bits for two thread counts;
//  - causal rows ignore the future: rows i < p unchanged when K and V rows >= p change
//    (fused, per-sample, tiled, banded);
//  - decode equals row t of the prefill (LSH and exact); the tiled kernel equals the reference;
//    row ranges give the full result's bits (tiled, banded); multi-head equals per-head calls;
//  - backward (fused or tiled, from the forward with lse): finite gradients, no write outside
//    the gradient views, the same bits for two thread counts, sum_j dV_j = sum_i dO_i;
// and for a bad argument, that std::invalid_argument (and nothing else) names an argument.
// Tolerances: the two sides of a comparison evaluate the same scores with a different
// summation order, so they differ by the rounding of a dot product, about
// eps d max_ij |tau| sum_c |q_ic k_jc| in a logit, which moves the output by that much
// relative to max |v|; plus a few eps for the exponentials and sums.
#include <poslsh/analysis/block_stats.hpp>
#include <poslsh/attention/paged.hpp>
#include <poslsh/poslsh.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using poslsh::AttentionOptions;
using poslsh::BinHash;
using poslsh::HashSet;
using poslsh::Index;
using poslsh::Masking;
using poslsh::RowMatrix;

/// The fuzzer's bytes read as numbers; past the end every read gives 0.
class ByteReader {
 public:
  ByteReader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  std::uint8_t byte() { return position_ < size_ ? data_[position_++] : std::uint8_t{0}; }

  std::uint64_t u64() {
    std::uint64_t value = 0;
    for (int b = 0; b < 8; ++b) value = (value << 8) | byte();
    return value;
  }

  /// An integer in [lo, hi] from two bytes.
  Index in_range(Index lo, Index hi) {
    const auto raw = static_cast<Index>((static_cast<unsigned>(byte()) << 8) | byte());
    return lo + raw % (hi - lo + 1);
  }

  /// A number in [0, 1] from two bytes.
  double unit() { return static_cast<double>(in_range(0, 65535)) / 65535.0; }

  bool flag() { return (byte() & 1u) != 0; }

  double raw_double() {
    const std::uint64_t bits = u64();
    double value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t position_ = 0;
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "poslsh_fuzz: property violated: %s\n", what.c_str());
  std::abort();
}

void set_threads(int threads) {
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  static_cast<void>(threads);
#endif
}

/// An n x cols matrix stored with `pad` extra columns per row that hold NaN: views of it have
/// row stride cols + pad, and a kernel that reads the padding turns its output into NaN.
template <typename Scalar>
struct Padded {
  using ConstMap = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
  using Map = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

  Index rows = 0;
  Index cols = 0;
  Index stride = 1;
  std::vector<Scalar> buffer;

  Padded(Index n, Index c, Index pad)
      : rows(n),
        cols(c),
        stride(c + pad),
        buffer(static_cast<std::size_t>(n * (c + pad) + 1),
               std::numeric_limits<Scalar>::quiet_NaN()) {}

  ConstMap view() const {
    return ConstMap(buffer.data(), rows, cols, Eigen::OuterStride<>(stride));
  }
  Map view() { return Map(buffer.data(), rows, cols, Eigen::OuterStride<>(stride)); }
  /// Sets the padding (and the spare element at the end) to `value`.
  void fill_padding(Scalar value) {
    for (Index i = 0; i < rows; ++i) {
      for (Index c = cols; c < stride; ++c)
        buffer[static_cast<std::size_t>(i * stride + c)] = value;
    }
    buffer.back() = value;
  }
  /// True if the padding still holds only `value` (an output view wrote nothing outside).
  bool padding_is(Scalar value) const {
    for (Index i = 0; i < rows; ++i) {
      for (Index c = cols; c < stride; ++c) {
        if (buffer[static_cast<std::size_t>(i * stride + c)] != value) return false;
      }
    }
    return buffer.back() == value;
  }
};

/// The sentinel of output padding (finite, so "unchanged" is a plain comparison).
template <typename Scalar>
constexpr Scalar out_sentinel = Scalar(-12345.5);

template <typename Scalar>
void fill_normal(Padded<Scalar>& m, std::mt19937_64& engine, double magnitude,
                 Index first_row = 0) {
  std::normal_distribution<double> normal(0.0, magnitude);
  for (Index i = first_row; i < m.rows; ++i) {
    for (Index c = 0; c < m.cols; ++c) {
      m.buffer[static_cast<std::size_t>(i * m.stride + c)] = static_cast<Scalar>(normal(engine));
    }
  }
}

template <typename Matrix>
bool all_finite(const Matrix& m) {
  return m.size() == 0 || m.array().isFinite().all();
}

/// max |a - b| / max(1, max |scale|) over rows [0, rows).
template <typename A, typename B, typename S>
double top_rows_error(const A& a, const B& b, Index rows, const S& scale) {
  if (rows == 0 || a.cols() == 0) return 0.0;
  const double norm = std::max(1.0, static_cast<double>(scale.cwiseAbs().maxCoeff()));
  return static_cast<double>((a.topRows(rows) - b.topRows(rows)).cwiseAbs().maxCoeff()) / norm;
}

template <typename Scalar>
struct Problem {
  Index n = 0, d = 1, dv = 1;
  Masking masking = Masking::causal;
  double sigma = 1.0;
  AttentionOptions options;
  HashSet hashes;
  bool hashes_valid = true;
  int threads_a = 1, threads_b = 2;
  double magnitude = 1.0;
  std::uint64_t data_seed = 0;
  Index pad_q = 0, pad_k = 0, pad_v = 0, pad_out = 0;
};

/// Runs `call`; any exception but std::invalid_argument naming an argument is a failure.
/// Returns true if it threw std::invalid_argument.
template <typename Call>
bool rejects(Call&& call, const char* what) {
  try {
    call();
  } catch (const std::invalid_argument& error) {
    if (std::string(error.what()).find("argument '") == std::string::npos) {
      fail(std::string(what) + ": message names no argument: " + error.what());
    }
    return true;
  } catch (const std::exception& error) {
    fail(std::string(what) + ": unexpected exception: " + error.what());
  }
  return false;
}

template <typename Scalar>
HashSet draw_hashes(ByteReader& input, Problem<Scalar>& problem, Index s) {
  const std::uint8_t kind = input.byte() % 8;
  if (kind == 0) return HashSet{poslsh::fixed_blocks_hash(problem.sigma)};
  if (kind == 1) {
    // Hand-built hashes from raw bytes: often invalid, which every kernel must reject.
    HashSet hashes;
    const Index count = input.in_range(0, 3);
    for (Index k = 0; k < count; ++k)
      hashes.push_back(BinHash{input.raw_double(), input.raw_double()});
    problem.hashes_valid = !hashes.empty();
    for (const BinHash& hash : hashes) {
      problem.hashes_valid = problem.hashes_valid && std::isfinite(hash.width) &&
                             hash.width >= BinHash::min_width && hash.offset >= 0.0 &&
                             hash.offset < hash.width;
    }
    return hashes;
  }
  if (kind == 2) {
    // Hand-built valid hashes of any width, offsets anywhere in [0, width).
    HashSet hashes;
    const Index count = input.in_range(1, 4);
    for (Index k = 0; k < count; ++k) {
      const double width = std::max(BinHash::min_width, std::pow(10.0, 12.0 * input.unit() - 3.0));
      hashes.push_back(BinHash{width, std::min(input.unit(), 0.999999) * width});
    }
    return hashes;
  }
  return poslsh::rbf_hashes(problem.sigma, s, input.u64(), input.u64());
}

/// Bad-argument mode: one argument made invalid; the kernel must throw std::invalid_argument.
template <typename Scalar>
void check_rejections(ByteReader& input, const Problem<Scalar>& problem, const Padded<Scalar>& q,
                      const Padded<Scalar>& k, const Padded<Scalar>& v) {
  const Index n = problem.n;
  RowMatrix<Scalar> out(n, problem.dv);
  RowMatrix<Scalar> wrong(n + 1, problem.dv);
  AttentionOptions options = problem.options;
  const HashSet& hashes = problem.hashes;
  bool thrown = false;
  switch (input.byte() % 14) {
    case 0:
      thrown = rejects(
          [&] {
            poslsh::lsh_attention_fused<Scalar>(q.view(), k.view(), v.view(), hashes, wrong,
                                                options);
          },
          "fused, out shape");
      break;
    case 1:
      thrown = rejects(
          [&] {
            poslsh::lsh_attention_per_sample<Scalar>(q.view(), k.view(), v.view(), HashSet{}, out,
                                                     options);
          },
          "per-sample, empty hashes");
      break;
    case 2: {
      const double sigma = input.flag() ? std::numeric_limits<double>::quiet_NaN() : -input.unit();
      thrown = rejects(
          [&] {
            poslsh::alibi_attention_tiled<Scalar>(q.view(), k.view(), v.view(), sigma, out,
                                                  options);
          },
          "tiled, sigma");
      break;
    }
    case 3:
      options.scale = input.flag() ? std::numeric_limits<double>::infinity()
                                   : std::numeric_limits<double>::quiet_NaN();
      thrown = rejects(
          [&] {
            poslsh::alibi_attention_reference<Scalar>(q.view(), k.view(), v.view(), problem.sigma,
                                                      out, options);
          },
          "reference, scale");
      break;
    case 4:
      thrown = rejects(
          [&] {
            poslsh::alibi_attention_banded<Scalar>(q.view(), k.view(), v.view(), problem.sigma,
                                                   -1 - input.in_range(0, 5), out, options);
          },
          "banded, band");
      break;
    case 5: {
      const Index row_end = n + 1 + input.in_range(0, 5);
      RowMatrix<Scalar> rows_out(row_end, problem.dv);
      thrown = rejects(
          [&] {
            poslsh::alibi_attention_tiled_rows<Scalar>(q.view(), k.view(), v.view(), problem.sigma,
                                                       0, row_end, rows_out, options);
          },
          "tiled rows, row_end");
      break;
    }
    case 6: {
      RowMatrix<Scalar> one(1, problem.dv);
      options.masking = Masking::causal;
      const Index t = input.flag() ? n + input.in_range(0, 3) : -1 - input.in_range(0, 3);
      thrown = rejects(
          [&] {
            poslsh::lsh_attention_decode<Scalar>(q.view().topRows(std::min<Index>(n, 1)), k.view(),
                                                 v.view(), t, poslsh::rbf_hashes(2.0, 2, 1), one,
                                                 options);
          },
          "decode, t");
      break;
    }
    case 7: {
      const HashSet bad{BinHash{input.raw_double(), input.raw_double()}};
      const BinHash& hash = bad.front();
      const bool valid = std::isfinite(hash.width) && hash.width >= BinHash::min_width &&
                         hash.offset >= 0.0 && hash.offset < hash.width;
      thrown = rejects(
          [&] {
            poslsh::lsh_attention_fused<Scalar>(q.view(), k.view(), v.view(), bad, out, options);
          },
          "fused, hand-built hash");
      if (valid) thrown = !thrown;  // a valid hand-built hash must be accepted
      break;
    }
    case 9:
    case 10: {
      // A hand-built hash (any bits) given to the entry points that take a hash set without
      // attention inputs: each must reject it exactly when validate_hash does.
      const HashSet bad{BinHash{input.raw_double(), input.raw_double()}};
      const BinHash& hash = bad.front();
      const bool valid = std::isfinite(hash.width) && hash.width >= BinHash::min_width &&
                         hash.offset >= 0.0 && hash.offset < hash.width;
      const Index length = std::min<Index>(n, 64);
      if (input.flag()) {
        thrown = rejects([&] { poslsh::lsh_fused_pair_count(bad, length, options.masking); },
                         "pair count, hand-built hash");
      } else if (input.flag()) {
        thrown = rejects([&] { poslsh::block_plans(bad, std::vector<Index>{length}); },
                         "block plans, hand-built hash");
      } else {
        thrown = rejects([&] { poslsh::block_stats(bad, length); }, "block stats, hand-built hash");
      }
      if (valid) thrown = !thrown;  // a valid hand-built hash must be accepted
      break;
    }
    case 8:
      options.masking = static_cast<Masking>(2 + input.in_range(0, 100));
      thrown = rejects(
          [&] {
            poslsh::alibi_attention_tiled<Scalar>(q.view(), k.view(), v.view(), problem.sigma, out,
                                                  options);
          },
          "tiled, masking");
      break;
    case 11: {
      // A query offset outside [0, L - m].
      options.query_offset =
          input.flag() ? -1 - input.in_range(0, 5) : n - q.view().rows() + 1 + input.in_range(0, 5);
      thrown = rejects(
          [&] {
            if (input.flag())
              poslsh::lsh_attention_fused<Scalar>(q.view(), k.view(), v.view(), hashes, out,
                                                  options);
            else
              poslsh::alibi_attention_tiled<Scalar>(q.view(), k.view(), v.view(), problem.sigma,
                                                    out, options);
          },
          "query offset");
      break;
    }
    case 12: {
      // A paged cache whose block table is too short or points outside the pool.
      const Index page_size = input.in_range(1, 40);
      const Index pages = (n + page_size - 1) / page_size;
      std::vector<Scalar> pool(static_cast<std::size_t>(std::max<Index>(1, pages) * page_size *
                                                        std::max<Index>(problem.d, 1)),
                               Scalar(0));
      std::vector<std::int32_t> table(static_cast<std::size_t>(std::max<Index>(pages, 1)), 0);
      for (Index p = 0; p < pages; ++p)
        table[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(p);
      std::int32_t length = static_cast<std::int32_t>(std::max<Index>(n, 1));
      poslsh::PagedKV<Scalar> cache{pool.data(), pool.data(),  pages, page_size, 1,      problem.d,
                                    problem.d,   table.data(), 1,     pages,     &length};
      if (input.flag() || pages == 0) {
        cache.max_pages = (length + page_size - 1) / page_size - 1;  // one page short
      } else {
        table[static_cast<std::size_t>(input.in_range(0, pages - 1))] =
            input.flag() ? -1 : static_cast<std::int32_t>(pages + input.in_range(0, 3));
      }
      RowMatrix<Scalar> one(1, problem.d);
      const RowMatrix<Scalar> query = RowMatrix<Scalar>::Zero(1, problem.d);
      thrown = rejects(
          [&] {
            poslsh::lsh_attention_fused_paged<Scalar>(query, cache, 0, 0,
                                                      poslsh::rbf_hashes(2.0, 2, 1), one, options);
          },
          "paged cache, block table");
      break;
    }
    default: {
      const Index cols = problem.d + 1;
      RowMatrix<Scalar> k_wide = RowMatrix<Scalar>::Zero(n, cols);
      thrown = rejects(
          [&] {
            poslsh::alibi_attention_reference<Scalar>(q.view(), k_wide, v.view(), problem.sigma,
                                                      out, options);
          },
          "reference, k columns");
      break;
    }
  }
  if (!thrown) fail("a bad argument was accepted (or a valid hand-built hash was rejected)");
}

template <typename Scalar>
void run(ByteReader& input) {
  constexpr double eps = std::numeric_limits<Scalar>::epsilon();
  Problem<Scalar> problem;
  problem.n = input.in_range(0, 160);
  problem.d = input.in_range(1, 24);
  problem.dv = input.in_range(0, 9) == 0 ? 0 : input.in_range(1, 12);
  problem.pad_q = input.in_range(0, 3);
  problem.pad_k = input.in_range(0, 3);
  problem.pad_v = input.in_range(0, 3);
  problem.pad_out = input.in_range(0, 3);
  problem.masking = input.flag() ? Masking::causal : Masking::bidirectional;
  problem.options.masking = problem.masking;
  const std::uint8_t sigma_kind = input.byte() % 16;
  problem.sigma = sigma_kind == 0   ? 1e-3
                  : sigma_kind == 1 ? 1e9
                                    : std::pow(10.0, 12.0 * input.unit() - 3.0);
  if (input.flag()) problem.options.scale = 6.0 * input.unit() - 3.0;
  problem.magnitude = std::pow(10.0, 3.0 * input.unit() - 1.5);
  problem.threads_a = static_cast<int>(input.in_range(1, 3));
  problem.threads_b = static_cast<int>(input.in_range(1, 3));
  problem.data_seed = input.u64();
  const Index n = problem.n, d = problem.d, dv = problem.dv;
  // s, capped so that the per-sample kernel's cost s n min(n, ~4 sigma) stays small.
  const double block = std::min(static_cast<double>(n), 4.0 * problem.sigma + 1.0);
  const auto s_cap =
      static_cast<Index>(std::max(1.0, 3e5 / (static_cast<double>(n) * block + 1.0)));
  const Index s = std::min(input.in_range(1, input.flag() ? 48 : 400), s_cap);
  problem.hashes = draw_hashes(input, problem, s);

  Padded<Scalar> q(n, d, problem.pad_q), k(n, d, problem.pad_k), v(n, dv, problem.pad_v);
  std::mt19937_64 engine(problem.data_seed);
  fill_normal(q, engine, problem.magnitude);
  fill_normal(k, engine, problem.magnitude);
  fill_normal(v, engine, 1.0);

  if (input.byte() % 8 == 0) {
    check_rejections(input, problem, q, k, v);
    return;
  }
  const AttentionOptions& options = problem.options;
  const bool causal = problem.masking == Masking::causal;
  if (!problem.hashes_valid) {
    RowMatrix<Scalar> out(n, dv);
    if (!rejects(
            [&] {
              poslsh::lsh_attention_fused<Scalar>(q.view(), k.view(), v.view(), problem.hashes, out,
                                                  options);
            },
            "fused, invalid hashes") ||
        !rejects(
            [&] {
              poslsh::lsh_attention_per_sample<Scalar>(q.view(), k.view(), v.view(), problem.hashes,
                                                       out, options);
            },
            "per-sample, invalid hashes")) {
      fail("an invalid hand-built hash set was accepted");
    }
    return;
  }

  // Tolerance (see the top of the file).
  const double tau = options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(d));
  double dot_bound = 0.0;
  if (n > 0) {
    const RowMatrix<double> qa = q.view().template cast<double>().cwiseAbs();
    const RowMatrix<double> ka = k.view().template cast<double>().cwiseAbs();
    dot_bound = std::abs(tau) * (qa * ka.transpose()).maxCoeff();
  }
  const double tol = 8.0 * eps * (static_cast<double>(d) * dot_bound + 64.0);
  const bool compare = tol < 0.05;  // else only finiteness and bitwise checks are meaningful

  // Fused (threads a, strided output with sentinel padding) and per-sample.
  Padded<Scalar> fused(n, dv, problem.pad_out);
  fused.fill_padding(out_sentinel<Scalar>);
  set_threads(problem.threads_a);
  poslsh::lsh_attention_fused<Scalar>(q.view(), k.view(), v.view(), problem.hashes, fused.view(),
                                      options);
  if (!fused.padding_is(out_sentinel<Scalar>)) fail("fused wrote outside its output view");
  const RowMatrix<Scalar> fused_a = fused.view();
  set_threads(problem.threads_b);
  const RowMatrix<Scalar> fused_b =
      poslsh::lsh_attention_fused<Scalar>(q.view(), k.view(), v.view(), problem.hashes, options);
  const RowMatrix<Scalar> per_sample = poslsh::lsh_attention_per_sample<Scalar>(
      q.view(), k.view(), v.view(), problem.hashes, options);
  if (!all_finite(fused_a) || !all_finite(per_sample))
    fail("LSH output not finite for finite inputs");
  if (!(fused_a == fused_b)) fail("fused output changed with the thread count");
  const RowMatrix<Scalar> v_dense = v.view();
  if (compare && top_rows_error(fused_a, per_sample, n, v_dense) > tol) fail("fused != per-sample");

  // Exact kernels.
  Padded<Scalar> tiled(n, dv, problem.pad_out);
  tiled.fill_padding(out_sentinel<Scalar>);
  poslsh::alibi_attention_tiled<Scalar>(q.view(), k.view(), v.view(), problem.sigma, tiled.view(),
                                        options);
  if (!tiled.padding_is(out_sentinel<Scalar>)) fail("tiled wrote outside its output view");
  const RowMatrix<Scalar> tiled_out = tiled.view();
  const Index band = input.in_range(0, n + 2);
  const RowMatrix<Scalar> banded = poslsh::alibi_attention_banded<Scalar>(
      q.view(), k.view(), v.view(), problem.sigma, band, options);
  const RowMatrix<Scalar> reference = poslsh::alibi_attention_reference<Scalar>(
      q.view(), k.view(), v.view(), problem.sigma, options);
  if (!all_finite(tiled_out) || !all_finite(banded) || !all_finite(reference)) {
    fail("exact output not finite for finite inputs");
  }
  if (compare && top_rows_error(tiled_out, reference, n, v_dense) > tol) fail("tiled != reference");
  if (band + 1 >= n && !(banded == tiled_out)) fail("banded with band >= n - 1 != tiled");
  // Row ranges [0, split) and [split, n) give the full result's bits.
  const Index split = input.in_range(0, n);
  RowMatrix<Scalar> pieces(n, dv), band_pieces(n, dv);
  auto head = pieces.topRows(split), tail = pieces.bottomRows(n - split);
  auto band_head = band_pieces.topRows(split), band_tail = band_pieces.bottomRows(n - split);
  poslsh::alibi_attention_tiled_rows<Scalar>(q.view(), k.view(), v.view(), problem.sigma, 0, split,
                                             head, options);
  poslsh::alibi_attention_tiled_rows<Scalar>(q.view(), k.view(), v.view(), problem.sigma, split, n,
                                             tail, options);
  poslsh::alibi_attention_banded_rows<Scalar>(q.view(), k.view(), v.view(), problem.sigma, band, 0,
                                              split, band_head, options);
  poslsh::alibi_attention_banded_rows<Scalar>(q.view(), k.view(), v.view(), problem.sigma, band,
                                              split, n, band_tail, options);
  if (!(pieces == tiled_out)) fail("tiled row ranges != tiled");
  if (!(band_pieces == banded)) fail("banded row ranges != banded");
  // Chunked prefill: the rows [split, chunk_end) as queries at offset split (causal: over the
  // keys so far) give the full results' bits (tiled, fused).
  if (split < n) {
    const Index chunk_end = split + input.in_range(1, n - split);
    const Index m = chunk_end - split, keys = causal ? chunk_end : n;
    AttentionOptions chunk_options = options;
    chunk_options.query_offset = split;
    RowMatrix<Scalar> chunk_tiled(m, dv), chunk_fused(m, dv);
    poslsh::alibi_attention_tiled<Scalar>(q.view().middleRows(split, m), k.view().topRows(keys),
                                          v.view().topRows(keys), problem.sigma, chunk_tiled,
                                          chunk_options);
    poslsh::lsh_attention_fused<Scalar>(q.view().middleRows(split, m), k.view().topRows(keys),
                                        v.view().topRows(keys), problem.hashes, chunk_fused,
                                        chunk_options);
    if (!(chunk_tiled == tiled_out.middleRows(split, m))) fail("tiled chunk != tiled rows");
    if (!(chunk_fused == fused_a.middleRows(split, m))) fail("fused chunk != fused rows");
  }

  if (causal && n > 0) {
    // Decode of row t equals row t of the prefills.
    const Index t = input.in_range(0, n - 1);
    RowMatrix<Scalar> row(1, dv), exact_row(1, dv);
    poslsh::lsh_attention_decode<Scalar>(q.view().row(t), k.view(), v.view(), t, problem.hashes,
                                         row, options);
    poslsh::alibi_attention_decode_exact<Scalar>(q.view().row(t), k.view(), v.view(), t,
                                                 problem.sigma, exact_row, options);
    if (!all_finite(row) || !all_finite(exact_row)) fail("decode output not finite");
    const RowMatrix<Scalar> fused_row = fused_a.row(t), tiled_row = tiled_out.row(t);
    if (compare && top_rows_error(row, fused_row, 1, v_dense) > tol)
      fail("LSH decode != fused row t");
    if (compare && top_rows_error(exact_row, tiled_row, 1, v_dense) > tol)
      fail("exact decode != tiled row t");

    // Rows before p ignore keys and values from p on.
    const Index p = input.in_range(0, n - 1);
    Padded<Scalar> k2 = k, v2 = v;
    std::mt19937_64 future(problem.data_seed ^ 0x9E3779B97F4A7C15ull);
    fill_normal(k2, future, problem.magnitude, p);
    fill_normal(v2, future, 1.0, p);
    const RowMatrix<Scalar> fused2 = poslsh::lsh_attention_fused<Scalar>(
        q.view(), k2.view(), v2.view(), problem.hashes, options);
    const RowMatrix<Scalar> per_sample2 = poslsh::lsh_attention_per_sample<Scalar>(
        q.view(), k2.view(), v2.view(), problem.hashes, options);
    const RowMatrix<Scalar> tiled2 = poslsh::alibi_attention_tiled<Scalar>(
        q.view(), k2.view(), v2.view(), problem.sigma, options);
    const RowMatrix<Scalar> banded2 = poslsh::alibi_attention_banded<Scalar>(
        q.view(), k2.view(), v2.view(), problem.sigma, band, options);
    // Masked entries weigh 0 (or Eigen's exp(-inf), below 1e-37 relative): compare to the
    // rounding of the output, 4 eps (not tol: these rows run the same arithmetic).
    const double future_tol = 4.0 * eps;
    if (top_rows_error(fused2, fused_a, p, v_dense) > future_tol)
      fail("fused: a causal row saw the future");
    if (top_rows_error(per_sample2, per_sample, p, v_dense) > future_tol)
      fail("per-sample: a causal row saw the future");
    if (top_rows_error(tiled2, tiled_out, p, v_dense) > future_tol)
      fail("tiled: a causal row saw the future");
    if (top_rows_error(banded2, banded, p, v_dense) > future_tol)
      fail("banded: a causal row saw the future");
  }

  // Backward from the forward with lse (fused, or tiled): finite gradients, nothing written
  // outside the gradient views, the same bits for both thread counts, and the identity
  // sum_j dV_j = sum_i dO_i (each row of P sums to 1: the recomputation matches lse).
  if (input.flag()) {
    const bool lsh = input.flag();
    Padded<Scalar> dout(n, dv, 0);
    std::mt19937_64 upstream(problem.data_seed ^ 0x5851F42D4C957F2Dull);
    fill_normal(dout, upstream, 1.0);
    RowMatrix<Scalar> out(n, dv);
    Eigen::Matrix<Scalar, Eigen::Dynamic, 1> lse(n);
    if (lsh) {
      poslsh::lsh_attention_fused_with_lse<Scalar>(q.view(), k.view(), v.view(), problem.hashes,
                                                   out, lse, options);
    } else {
      poslsh::alibi_attention_tiled_with_lse<Scalar>(q.view(), k.view(), v.view(), problem.sigma,
                                                     out, lse, options);
    }
    if (!(out == (lsh ? fused_a : tiled_out))) fail("forward with lse != forward");
    RowMatrix<Scalar> first[3];
    for (int run_index = 0; run_index < 2; ++run_index) {
      set_threads(run_index == 0 ? problem.threads_a : problem.threads_b);
      Padded<Scalar> dq(n, d, problem.pad_q), dk(n, d, problem.pad_k), dvg(n, dv, problem.pad_v);
      for (Padded<Scalar>* g : {&dq, &dk, &dvg}) g->fill_padding(out_sentinel<Scalar>);
      if (lsh) {
        poslsh::lsh_attention_fused_backward<Scalar>(q.view(), k.view(), v.view(), problem.hashes,
                                                     out, lse, dout.view(), dq.view(), dk.view(),
                                                     dvg.view(), options);
      } else {
        poslsh::alibi_attention_tiled_backward<Scalar>(q.view(), k.view(), v.view(), problem.sigma,
                                                       out, lse, dout.view(), dq.view(), dk.view(),
                                                       dvg.view(), options);
      }
      for (const Padded<Scalar>* g : {&dq, &dk, &dvg}) {
        if (!g->padding_is(out_sentinel<Scalar>)) fail("backward wrote outside a gradient view");
      }
      const RowMatrix<Scalar> grads[3] = {dq.view(), dk.view(), dvg.view()};
      if (!all_finite(grads[0]) || !all_finite(grads[1]) || !all_finite(grads[2]))
        fail("gradients not finite for finite inputs");
      if (run_index == 0) {
        for (int g = 0; g < 3; ++g) first[g] = grads[g];
      } else if (!(grads[0] == first[0]) || !(grads[1] == first[1]) || !(grads[2] == first[2])) {
        fail("gradients changed with the thread count");
      }
    }
    if (compare && n > 0 && dv > 0) {
      const RowMatrix<double> dout_d = dout.view().template cast<double>();
      const Eigen::RowVectorXd want = dout_d.colwise().sum();
      const Eigen::RowVectorXd got = first[2].template cast<double>().colwise().sum();
      const Eigen::RowVectorXd scale = dout_d.cwiseAbs().colwise().sum();
      const double allowed = tol + 4.0 * static_cast<double>(n) * eps;
      if (((got - want).cwiseAbs().array() > allowed * scale.array()).any())
        fail("sum of dV rows != sum of dO rows");
    }
  }

  // Multi-head: H query heads over H / G key-value heads, [n, H, d] layouts, against per-head
  // calls.
  if (n > 0 && dv > 0 && input.flag()) {
    const Index kv_heads = input.in_range(1, 2);
    const Index heads = kv_heads * input.in_range(1, 2);
    constexpr auto methods =
        static_cast<Index>(std::size(poslsh::EnumNames<poslsh::Method>::table));
    const auto method = static_cast<poslsh::Method>(input.in_range(0, methods - 1));
    poslsh::MultiHeadOptions multi;
    multi.method = method;
    multi.masking = problem.masking;
    multi.scale = options.scale;
    multi.samples = std::max<Index>(1, std::min<Index>(s, 16));
    multi.seed = problem.data_seed;
    multi.sigmas.assign(static_cast<std::size_t>(heads), problem.sigma);
    RowMatrix<Scalar> qh(n, heads * d), kh(n, kv_heads * d), vh(n, kv_heads * dv),
        outh(n, heads * dv);
    for (Index h = 0; h < heads; ++h) qh.middleCols(h * d, d) = q.view();
    for (Index h = 0; h < kv_heads; ++h) {
      kh.middleCols(h * d, d) = k.view();
      vh.middleCols(h * dv, dv) = v.view();
    }
    set_threads(problem.threads_a);
    poslsh::multihead_attention<Scalar>(
        poslsh::interleaved_heads<const Scalar>(qh.data(), n, heads, d),
        poslsh::interleaved_heads<const Scalar>(kh.data(), n, kv_heads, d),
        poslsh::interleaved_heads<const Scalar>(vh.data(), n, kv_heads, dv),
        poslsh::interleaved_heads<Scalar>(outh.data(), n, heads, dv), multi);
    if (!all_finite(outh)) fail("multi-head output not finite");
    for (Index h = 0; h < heads; ++h) {
      const HashSet head_hashes = poslsh::rbf_hashes(problem.sigma, multi.samples, multi.seed,
                                                     static_cast<std::uint64_t>(h));
      RowMatrix<Scalar> expected;
      switch (method) {
        case poslsh::Method::lsh_fused:
          expected = poslsh::lsh_attention_fused<Scalar>(q.view(), k.view(), v.view(), head_hashes,
                                                         options);
          break;
        case poslsh::Method::lsh_per_sample:
          expected = poslsh::lsh_attention_per_sample<Scalar>(q.view(), k.view(), v.view(),
                                                              head_hashes, options);
          break;
        case poslsh::Method::fixed_blocks:
          expected = poslsh::fixed_blocks_attention<Scalar>(q.view(), k.view(), v.view(),
                                                            problem.sigma, options);
          break;
        case poslsh::Method::exact_banded:
          expected = poslsh::alibi_attention_banded<Scalar>(
              q.view(), k.view(), v.view(), problem.sigma,
              poslsh::band_for_bias_error(problem.sigma, multi.band_error), options);
          break;
        case poslsh::Method::mean_of_outputs:
          expected = poslsh::lsh_attention_mean_of_outputs<Scalar>(q.view(), k.view(), v.view(),
                                                                   head_hashes, options);
          break;
        default:
          expected = tiled_out;
          break;
      }
      const RowMatrix<Scalar> got = outh.middleCols(h * dv, dv);
      if (compare && top_rows_error(got, expected, n, v_dense) > tol)
        fail("multi-head != per-head call");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ByteReader input(data, size);
  if (input.flag()) {
    run<float>(input);
  } else {
    run<double>(input);
  }
  return 0;
}
