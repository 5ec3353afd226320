// The per-sample, fixed-blocks and bring-your-own-block kernels and the decoders on
// Eigen::bfloat16 and Eigen::half inputs: against dense double formulas on the rounded inputs
// (at most 2x the error of the float kernel on the same inputs), the prefill kernels with float
// products (Precision::float_products) bitwise the float kernel on the widened inputs, a
// half-precision output bitwise the float output rounded once, decode past position 65536 with an
// exact bias, and bad input named as for float.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <poslsh/attention/decode.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/interop/block_kernel.hpp>
#include <poslsh/lsh/hash.hpp>
#include <vector>

#include "half_support.hpp"
#include "test_support.hpp"

using poslsh_test::max_error;
using poslsh_test::same_values;
using poslsh_test::to_double;
using poslsh_test::widened;

namespace {

using bf16 = Eigen::bfloat16;

/// Dense attention rows in double from log-weights: query row r of q is at position
/// positions[r], and
///   out_r = sum_j e^{x_rj} v_j / sum_j e^{x_rj},  x_rj = tau q_r.k_j + log_weight(position, j),
/// over the keys j with log_weight > -inf (a formula of its own, not the library's code).
template <typename LogWeight>
RowMatrix<double> dense_rows(const RowMatrix<double>& q, const RowMatrix<double>& k,
                             const RowMatrix<double>& v, double tau,
                             const std::vector<Index>& positions, const LogWeight& log_weight) {
  const RowMatrix<double> scores = tau * q * k.transpose();
  RowMatrix<double> out(q.rows(), v.cols());
  Eigen::RowVectorXd x(k.rows());
  for (Index r = 0; r < q.rows(); ++r) {
    const Index i = positions[static_cast<std::size_t>(r)];
    for (Index j = 0; j < k.rows(); ++j) {
      const double w = log_weight(i, j);
      x(j) = w == -std::numeric_limits<double>::infinity() ? w : scores(r, j) + w;
    }
    const double top = x.maxCoeff();
    double sum = 0.0;
    Eigen::RowVectorXd acc = Eigen::RowVectorXd::Zero(v.cols());
    for (Index j = 0; j < k.rows(); ++j) {
      if (x(j) == -std::numeric_limits<double>::infinity()) continue;
      const double p = std::exp(x(j) - top);
      sum += p;
      acc += p * v.row(j);
    }
    out.row(r) = acc / sum;
  }
  return out;
}

/// Positions first, first + step, ... (count of them).
std::vector<Index> positions_from(Index first, Index count, Index step = 1) {
  std::vector<Index> positions;
  for (Index r = 0; r < count; ++r) positions.push_back(first + r * step);
  return positions;
}

/// log c_ij of the count-weighted LSH estimator, c_ij = #{hashes h : h.bin(i) = h.bin(j)}
/// (causal: only j <= i), from bins tabulated once per hash.
struct LogCounts {
  std::vector<std::vector<std::int64_t>> bins;
  bool causal;
  LogCounts(const HashSet& hashes, Index n, Masking masking) : causal(masking == Masking::causal) {
    for (const poslsh::BinHash& hash : hashes) {
      std::vector<std::int64_t> b(static_cast<std::size_t>(n));
      for (Index i = 0; i < n; ++i) b[static_cast<std::size_t>(i)] = hash.bin(i);
      bins.push_back(std::move(b));
    }
  }
  double operator()(Index i, Index j) const {
    if (causal && j > i) return -std::numeric_limits<double>::infinity();
    int count = 0;
    for (const auto& b : bins)
      count += b[static_cast<std::size_t>(i)] == b[static_cast<std::size_t>(j)] ? 1 : 0;
    return std::log(static_cast<double>(count));
  }
};

/// The kernels of attention/per_sample.hpp and interop/block_kernel.hpp, by name.
enum class Kernel { per_sample, fixed_blocks, by_blocks };

constexpr poslsh::EnumName<Kernel> kernel_names[] = {
    {Kernel::per_sample, "lsh_attention_per_sample"},
    {Kernel::fixed_blocks, "fixed_blocks_attention"},
    {Kernel::by_blocks, "lsh_attention_by_blocks"}};

template <typename Scalar, typename KVScalar, typename OutScalar>
RowMatrix<OutScalar> run(Kernel kernel, const RowMatrix<Scalar>& q, const RowMatrix<KVScalar>& k,
                         const RowMatrix<KVScalar>& v, const HashSet& hashes, double sigma,
                         const AttentionOptions& options) {
  RowMatrix<OutScalar> out(q.rows(), v.cols());
  if (kernel == Kernel::per_sample) {
    poslsh::lsh_attention_per_sample<Scalar, KVScalar, OutScalar>(q, k, v, hashes, out, options);
  } else if (kernel == Kernel::fixed_blocks) {
    poslsh::fixed_blocks_attention<Scalar, KVScalar, OutScalar>(q, k, v, sigma, out, options);
  } else {
    poslsh::lsh_attention_by_blocks<Scalar, KVScalar, OutScalar>(q, k, v, hashes, out, options);
  }
  return out;
}

struct Shape {
  Index n, d;
  double sigma;
};

/// The three views' scalars of one check: Q in Scalar, K and V in KVScalar.
/// Rows 0, row_step, 2 row_step, ... are compared with the dense formula.
template <typename Scalar, typename KVScalar>
void check_prefill(Kernel kernel, const Shape& shape, Masking masking, std::uint64_t seed,
                   Index row_step = 1) {
  const Index n = shape.n, d = shape.d;
  const RowMatrix<Scalar> q = random_matrix<float>(n, d, seed).template cast<Scalar>();
  const RowMatrix<KVScalar> k = random_matrix<float>(n, d, seed + 1).template cast<KVScalar>();
  const RowMatrix<KVScalar> v = random_matrix<float>(n, d, seed + 2).template cast<KVScalar>();
  const HashSet hashes = kernel == Kernel::fixed_blocks
                             ? HashSet{poslsh::fixed_blocks_hash(shape.sigma)}
                             : poslsh::rbf_hashes(shape.sigma, 4, seed, 1);
  AttentionOptions options = poslsh_test::with_masking(masking);
  options.precision = poslsh::Precision::float_products;
  const double tau = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<Index> rows = positions_from(0, (n + row_step - 1) / row_step, row_step);
  const RowMatrix<double> q_rows = to_double(q)(rows, Eigen::all);
  const RowMatrix<double> reference =
      dense_rows(q_rows, to_double(k), to_double(v), tau, rows, LogCounts(hashes, n, masking));
  INFO(poslsh_test::name_in(kernel_names, kernel)
       << ", n " << n << ", d " << d << ", sigma " << shape.sigma << ", "
       << poslsh_test::masking_name(masking));
  const RowMatrix<float> float_out = run<float, float, float>(
      kernel, widened(q), widened(k), widened(v), hashes, shape.sigma, options);
  const RowMatrix<float> half_out =
      run<Scalar, KVScalar, float>(kernel, q, k, v, hashes, shape.sigma, options);
  const double float_error = max_error(RowMatrix<float>(float_out(rows, Eigen::all)), reference);
  const double half_error = max_error(RowMatrix<float>(half_out(rows, Eigen::all)), reference);
  INFO("float kernel error " << float_error << ", half-precision inputs " << half_error);
  CHECK(float_error < 1e-5);
  CHECK(half_error <= 2.0 * float_error);
  // Tiles are widened exactly, then computed as by the float kernel.
  CHECK(same_values(half_out, float_out));
  // A half-precision output is the float result rounded once.
  const RowMatrix<KVScalar> rounded_out =
      run<Scalar, KVScalar, KVScalar>(kernel, q, k, v, hashes, shape.sigma, options);
  CHECK(same_values(rounded_out, RowMatrix<KVScalar>(half_out.cast<KVScalar>())));
}

const Shape prefill_shapes[] = {{1000, 64, 0.5}, {600, 80, 16.0}, {300, 128, 1e4}};

}  // namespace

TEMPLATE_TEST_CASE("per-sample, fixed-blocks and by-blocks kernels on half-precision inputs",
                   "[half][per_sample][block_kernel]", bf16, Eigen::half) {
  std::uint64_t seed = 100;
  for (const Shape& shape : prefill_shapes)
    for (Kernel kernel : {Kernel::per_sample, Kernel::fixed_blocks, Kernel::by_blocks})
      for (Masking masking : {Masking::causal, Masking::bidirectional})
        check_prefill<TestType, TestType>(kernel, shape, masking, seed += 3);
}

TEST_CASE("per-sample and by-blocks kernels: float queries over a bfloat16 cache",
          "[half][per_sample][block_kernel]") {
  std::uint64_t seed = 200;
  for (const Shape& shape : prefill_shapes)
    for (Kernel kernel : {Kernel::per_sample, Kernel::fixed_blocks, Kernel::by_blocks})
      check_prefill<float, bf16>(kernel, shape, Masking::causal, seed += 3);
}

TEST_CASE("per-sample kernel on bfloat16 at n = 4096", "[half][per_sample][slow]") {
  check_prefill<bf16, bf16>(Kernel::per_sample, {4096, 64, 16.0}, Masking::causal, 300, 7);
}

TEMPLATE_TEST_CASE("per-sample rows at an offset and the returning forms on half precision",
                   "[half][per_sample][offsets]", bf16, Eigen::half) {
  const Index n = 500, d = 64, p0 = 150, m = 70;
  const RowMatrix<TestType> q = random_matrix<float>(n, d, 11).template cast<TestType>();
  const RowMatrix<TestType> k = random_matrix<float>(n, d, 12).template cast<TestType>();
  const RowMatrix<TestType> v = random_matrix<float>(n, d, 13).template cast<TestType>();
  const HashSet hashes = poslsh::rbf_hashes(16.0, 4, 5, 1);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions options = poslsh_test::with_masking(masking);
    options.precision = poslsh::Precision::float_products;
    RowMatrix<float> full(n, d);
    poslsh::lsh_attention_per_sample<TestType, TestType, float>(q, k, v, hashes, full, options);
    AttentionOptions at = options;
    at.query_offset = p0;
    RowMatrix<float> rows(m, d);
    poslsh::lsh_attention_per_sample<TestType, TestType, float>(q.middleRows(p0, m), k, v, hashes,
                                                                rows, at);
    CHECK(same_values(rows, RowMatrix<float>(full.middleRows(p0, m))));
    const RowMatrix<TestType> returned =
        poslsh::lsh_attention_per_sample<TestType>(q, k, v, hashes, options);
    CHECK(same_values(returned, RowMatrix<TestType>(full.cast<TestType>())));
    const RowMatrix<TestType> fixed =
        poslsh::fixed_blocks_attention<TestType>(q, k, v, 8.0, options);
    RowMatrix<float> fixed_float(n, d);
    poslsh::fixed_blocks_attention<float>(widened(q), widened(k), widened(v), 8.0, fixed_float,
                                          options);
    CHECK(same_values(fixed, RowMatrix<TestType>(fixed_float.cast<TestType>())));
  }
}

TEST_CASE("lsh_attention_by_blocks passes the bfloat16 cache blocks to a user kernel unconverted",
          "[half][block_kernel]") {
  const Index n = 400, d = 64;
  const RowMatrix<bf16> q = random_matrix<float>(n, d, 21).cast<bf16>();
  const RowMatrix<bf16> k = random_matrix<float>(n, d, 22).cast<bf16>();
  const RowMatrix<bf16> v = random_matrix<float>(n, d, 23).cast<bf16>();
  const HashSet hashes = poslsh::rbf_hashes(16.0, 4, 9, 1);
  // A dense kernel in double that reads the bfloat16 blocks itself.
  int calls = 0;
  auto naive = [&calls](ConstMatrixRef<bf16> qb, ConstMatrixRef<bf16> kb, ConstMatrixRef<bf16> vb,
                        bool causal, float tau, MatrixRef<float> out,
                        Eigen::Ref<Eigen::VectorXf> lse) {
    ++calls;
    const RowMatrix<double> s =
        static_cast<double>(tau) * to_double(qb) * to_double(kb).transpose();
    for (Index i = 0; i < qb.rows(); ++i) {
      const Index keys = causal ? i + 1 : kb.rows();
      const double top = s.row(i).head(keys).maxCoeff();
      const Eigen::RowVectorXd p = (s.row(i).head(keys).array() - top).exp();
      out.row(i) = (p * to_double(vb).topRows(keys) / p.sum()).cast<float>();
      lse(i) = static_cast<float>(top + std::log(p.sum()));
    }
  };
  RowMatrix<float> out(n, d);
  poslsh::lsh_attention_by_blocks<bf16, bf16, float>(q, k, v, hashes, out, {}, naive);
  CHECK(calls > 0);
  const RowMatrix<double> reference =
      dense_rows(to_double(q), to_double(k), to_double(v), 1.0 / 8.0, positions_from(0, n),
                 LogCounts(hashes, n, Masking::causal));
  CHECK(max_error(out, reference) < 1e-5);
}

namespace {

/// Decode of the last m positions of a cache of n rows, LSH or exact (sigma), in the given
/// scalars.
template <typename Scalar, typename KVScalar, typename OutScalar>
RowMatrix<OutScalar> decode(bool lsh, const RowMatrix<Scalar>& q, const RowMatrix<KVScalar>& k,
                            const RowMatrix<KVScalar>& v, Index t, const HashSet& hashes,
                            double sigma) {
  RowMatrix<OutScalar> out(q.rows(), v.cols());
  if (lsh) {
    poslsh::lsh_attention_decode<Scalar, KVScalar, OutScalar>(q, k, v, t, hashes, out);
  } else {
    poslsh::alibi_attention_decode_exact<Scalar, KVScalar, OutScalar>(q, k, v, t, sigma, out);
  }
  return out;
}

/// log-weights of exact ALiBi decode: -(i - j) / sigma for j <= i.
struct LogBias {
  double sigma;
  double operator()(Index i, Index j) const {
    return j > i ? -std::numeric_limits<double>::infinity() : -static_cast<double>(i - j) / sigma;
  }
};

template <typename Scalar, typename KVScalar>
void check_decode(bool lsh, const Shape& shape, Index m, std::uint64_t seed) {
  const Index n = shape.n, d = shape.d, t = n - 1;
  const RowMatrix<Scalar> q = random_matrix<float>(m, d, seed).template cast<Scalar>();
  const RowMatrix<KVScalar> k = random_matrix<float>(n, d, seed + 1).template cast<KVScalar>();
  const RowMatrix<KVScalar> v = random_matrix<float>(n, d, seed + 2).template cast<KVScalar>();
  const HashSet hashes = poslsh::rbf_hashes(shape.sigma, 16, seed, 2);
  const double tau = 1.0 / std::sqrt(static_cast<double>(d));
  const RowMatrix<double> reference =
      lsh ? dense_rows(to_double(q), to_double(k), to_double(v), tau, positions_from(t - m + 1, m),
                       LogCounts(hashes, n, Masking::causal))
          : dense_rows(to_double(q), to_double(k), to_double(v), tau, positions_from(t - m + 1, m),
                       LogBias{shape.sigma});
  INFO((lsh ? "lsh_attention_decode" : "alibi_attention_decode_exact")
       << ", t " << t << ", m " << m << ", d " << d << ", sigma " << shape.sigma);
  const RowMatrix<float> float_out =
      decode<float, float, float>(lsh, widened(q), widened(k), widened(v), t, hashes, shape.sigma);
  const RowMatrix<float> half_out =
      decode<Scalar, KVScalar, float>(lsh, q, k, v, t, hashes, shape.sigma);
  const double float_error = max_error(float_out, reference);
  const double half_error = max_error(half_out, reference);
  INFO("float decoder error " << float_error << ", half-precision cache " << half_error);
  CHECK(float_error < 1e-5);
  CHECK(half_error <= 2.0 * float_error);
  const RowMatrix<KVScalar> rounded_out =
      decode<Scalar, KVScalar, KVScalar>(lsh, q, k, v, t, hashes, shape.sigma);
  CHECK(same_values(rounded_out, RowMatrix<KVScalar>(half_out.cast<KVScalar>())));
}

const Shape decode_shapes[] = {{1000, 64, 0.5}, {900, 80, 16.0}, {700, 128, 1e4}};

}  // namespace

TEMPLATE_TEST_CASE("decoders on a half-precision cache", "[half][decode]", bf16, Eigen::half) {
  std::uint64_t seed = 400;
  for (const Shape& shape : decode_shapes)
    for (bool lsh : {true, false}) check_decode<TestType, TestType>(lsh, shape, 48, seed += 3);
}

TEST_CASE("decoders: float queries over a bfloat16 cache", "[half][decode]") {
  std::uint64_t seed = 500;
  for (const Shape& shape : decode_shapes)
    for (bool lsh : {true, false}) check_decode<float, bf16>(lsh, shape, 48, seed += 3);
}

TEMPLATE_TEST_CASE("half-precision decode at t = 100000: the bias is exact", "[half][decode]", bf16,
                   Eigen::half) {
  // Past float16's largest value 65504 and bfloat16's largest exact integer 256: positions and
  // distances must never be held in the half type.
  const Index t = 100000, n = t + 1, d = 64, m = 3;
  const RowMatrix<TestType> q = random_matrix<float>(m, d, 61).template cast<TestType>();
  const RowMatrix<TestType> k = random_matrix<float>(n, d, 62).template cast<TestType>();
  const RowMatrix<TestType> v = random_matrix<float>(n, d, 63).template cast<TestType>();
  const RowMatrix<float> qf = widened(q), kf = widened(k), vf = widened(v);
  const RowMatrix<double> qd = to_double(q), kd = to_double(k), vd = to_double(v);
  const double tau = 1.0 / 8.0;
  for (double sigma : {16.0, 1e4}) {
    INFO("sigma " << sigma);
    const HashSet hashes = poslsh::rbf_hashes(sigma, 16, 7, 3);
    for (bool lsh : {true, false}) {
      INFO((lsh ? "lsh_attention_decode" : "alibi_attention_decode_exact"));
      const RowMatrix<float> float_out =
          decode<float, float, float>(lsh, qf, kf, vf, t, hashes, sigma);
      const RowMatrix<float> half_out =
          decode<TestType, TestType, float>(lsh, q, k, v, t, hashes, sigma);
      // The float decoder takes its whole key window in one pass; the half-precision one
      // streams it in widened chunks (online softmax), so the two sum in another order: equal
      // to float rounding, not bitwise.
      CHECK(poslsh_test::relative_max_error(half_out, float_out) < 1e-5);
      // Against the dense formula in double: a bias rounded to the half type would be off by
      // up to 2^8 / sigma (bfloat16) or overflow (float16).
      const RowMatrix<double> reference =
          lsh ? dense_rows(qd, kd, vd, tau, positions_from(t - m + 1, m),
                           LogCounts(hashes, n, Masking::causal))
              : dense_rows(qd, kd, vd, tau, positions_from(t - m + 1, m), LogBias{sigma});
      CHECK(max_error(half_out, reference) <= 2.0 * max_error(float_out, reference));
      // The prefill row at position t (queries at an offset) on the same half-precision views,
      // with float products as the decoders.
      AttentionOptions at;
      at.query_offset = t;
      at.precision = poslsh::Precision::float_products;
      RowMatrix<float> prefill_row(1, d);
      if (lsh) {
        poslsh::lsh_attention_per_sample<TestType, TestType, float>(q.bottomRows(1), k, v, hashes,
                                                                    prefill_row, at);
      } else {
        poslsh::alibi_attention_tiled<TestType, TestType, float>(q.bottomRows(1), k, v, sigma,
                                                                 prefill_row, at);
      }
      CHECK(poslsh_test::relative_max_error(RowMatrix<float>(half_out.bottomRows(1)), prefill_row) <
            1e-5);
    }
  }
}

TEST_CASE("half-precision kernels reject bad arguments by name", "[half][invalid]") {
  const RowMatrix<bf16> k = random_matrix<float>(10, 4, 1).cast<bf16>();
  const RowMatrix<bf16> q = random_matrix<float>(1, 4, 2).cast<bf16>();
  const RowMatrix<bf16> wide_q = random_matrix<float>(10, 5, 2).cast<bf16>();
  const HashSet hashes = poslsh::rbf_hashes(3.0, 4, 1);
  RowMatrix<float> out(1, 4);
  RowMatrix<bf16> out_bf(1, 4);
  require_invalid_argument(
      [&] { poslsh::lsh_attention_decode<bf16, bf16, float>(q, k, k, 10, hashes, out); }, "t");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_decode<float, bf16, bf16>(widened(q), k, k, 3, HashSet{}, out_bf);
      },
      "hashes");
  require_invalid_argument(
      [&] {
        poslsh::lsh_attention_decode<bf16, bf16, float>(wide_q.topRows(1), k, k, 3, hashes, out);
      },
      "keys");
  require_invalid_argument(
      [&] { poslsh::alibi_attention_decode_exact<bf16, bf16, bf16>(q, k, k, 3, 0.0, out_bf); },
      "sigma");
  require_invalid_argument(
      [&] {
        poslsh::alibi_attention_decode_exact<bf16, bf16, float>(
            q, k, k, 3, 4.0, out, poslsh_test::with_masking(Masking::bidirectional));
      },
      "options.masking");
  RowMatrix<float> short_out(9, 4);
  require_invalid_argument(
      [&] { poslsh::lsh_attention_per_sample<bf16, bf16, float>(k, k, k, hashes, short_out); },
      "out");
  require_invalid_argument([&] { poslsh::lsh_attention_per_sample<bf16>(wide_q, k, k, hashes); },
                           "k");
  require_invalid_argument(
      [&] {
        poslsh::fixed_blocks_attention<Eigen::half>(k.cast<Eigen::half>(), k.cast<Eigen::half>(),
                                                    k.cast<Eigen::half>(), -1.0);
      },
      "sigma");
  RowMatrix<bf16> out_n(10, 4);
  require_invalid_argument(
      [&] { poslsh::lsh_attention_by_blocks<bf16, bf16, bf16>(k, k, k, HashSet{}, out_n); },
      "hashes");
}
