// Shared helpers for the tests: seeded random inputs (one matrix, or the q, k, v of a test),
// single-head and all-heads options, views of interleaved heads and the all-heads call on them,
// scalar-aware tolerances, enum names from a table, a check that a call throws
// std::invalid_argument naming a given argument (and the shape checks of a single-head kernel), and
// the names the test files use unqualified.
#pragma once

#include <cstddef>
#include <limits>
#include <poslsh/core/names.hpp>
#include <poslsh/core/types.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "catch_compat.hpp"
#include "kernel_instantiations.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace poslsh_test {

using poslsh::Index;
using poslsh::RowMatrix;

/// Entries i.i.d. N(0, stddev^2) from a fixed seed (std::mt19937_64 is specified by the
/// standard bit for bit; the normal transform is only used for test data).
template <typename Scalar>
RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 engine(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = static_cast<Scalar>(normal(engine));
  return m;
}

/// The inputs of a single-head attention test: q, k (n x d) and v (n x d_v).
template <typename Scalar>
struct Qkv {
  RowMatrix<Scalar> q, k, v;
};

/// random_matrix q and k (n x d, entries N(0, stddev^2), seeds `seed` and `seed + 1`) and v
/// (n x dv, entries N(0, 1), seed `seed + 2`).
template <typename Scalar>
Qkv<Scalar> random_qkv(Index n, Index d, Index dv, std::uint64_t seed, double stddev = 1.0) {
  return {random_matrix<Scalar>(n, d, seed, stddev), random_matrix<Scalar>(n, d, seed + 1, stddev),
          random_matrix<Scalar>(n, dv, seed + 2)};
}

/// Default attention options with the given masking.
inline poslsh::AttentionOptions with_masking(poslsh::Masking masking) {
  poslsh::AttentionOptions options;
  options.masking = masking;
  return options;
}

/// All-heads options: `method`, `masking`, `samples` samples of seed `seed`, the other fields at
/// their defaults.
inline poslsh::MultiHeadOptions multihead_options(poslsh::Method method, poslsh::Masking masking,
                                                  Index samples, std::uint64_t seed) {
  poslsh::MultiHeadOptions options;
  options.method = method;
  options.masking = masking;
  options.samples = samples;
  options.seed = seed;
  return options;
}

/// The [rows, heads, cols / heads] view (interleaved_heads) of a row-major buffer whose rows
/// hold `heads` heads side by side; of const elements for a const buffer.
template <typename Matrix>
auto interleaved_view(Matrix& m, Index heads) {
  using Element = std::remove_pointer_t<decltype(m.data())>;
  return poslsh::interleaved_heads<Element>(m.data(), m.rows(), heads, m.cols() / heads);
}

/// multihead_attention on row-major buffers of interleaved heads: q of `heads` heads, k and v
/// of `kv_heads`; the output, q.rows() x heads (v.cols() / kv_heads).
template <typename Scalar>
RowMatrix<Scalar> multihead_of(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                               const RowMatrix<Scalar>& v, Index heads, Index kv_heads,
                               const poslsh::MultiHeadOptions& options) {
  RowMatrix<Scalar> out(q.rows(), heads * (v.cols() / kv_heads));
  poslsh::multihead_attention<Scalar>(interleaved_view(q, heads), interleaved_view(k, kv_heads),
                                      interleaved_view(v, kv_heads), interleaved_view(out, heads),
                                      options);
  return out;
}

/// +inf in double (sigma = infinity: no positional bias).
constexpr double infinity = std::numeric_limits<double>::infinity();

/// "causal" or "bidirectional", for test messages.
inline const char* masking_name(poslsh::Masking masking) {
  return masking == poslsh::Masking::causal ? "causal" : "bidirectional";
}

/// The name of `value` in `table` (each enumerator with its name, as in poslsh's own name tables
/// of poslsh/core/names.hpp), "?" for a value the table does not list.
template <typename Enum, std::size_t N>
constexpr const char* name_in(const poslsh::EnumName<Enum> (&table)[N], Enum value) {
  for (const poslsh::EnumName<Enum>& entry : table)
    if (entry.value == value) return entry.name;
  return "?";
}

/// Relative tolerance for comparing two computations of the same quantity in Scalar:
/// float about 1e-5, double about 1e-12.
template <typename Scalar>
constexpr double tolerance() {
  return sizeof(Scalar) == sizeof(float) ? 2e-5 : 1e-12;
}

/// max_ij |a_ij - b_ij| / max(1, max |b|): relative away from zero, absolute near it.
template <typename A, typename B>
double relative_max_error(const A& a, const B& b) {
  const double scale = std::max(1.0, static_cast<double>(b.cwiseAbs().maxCoeff()));
  return static_cast<double>((a - b).cwiseAbs().maxCoeff()) / scale;
}

/// Runs `call`; passes only if it throws std::invalid_argument whose message names
/// `argument` in quotes, as every poslsh check does.
template <typename Call>
void require_invalid_argument(Call&& call, const std::string& argument) {
  INFO("expected std::invalid_argument naming '" << argument << "'");
  try {
    call();
    FAIL("no exception thrown");
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    INFO("message: " << message);
    CHECK(message.find("'" + argument + "'") != std::string::npos);
  }
}

/// The shape checks of a single-head kernel, kernel(q, k, v) on float rows, q 5 x 4: keys of
/// 3 columns name "k", values of 6 rows name "v", queries and keys of no columns name "q".
template <typename Kernel>
void require_shape_checks(Kernel&& kernel) {
  const auto q = random_matrix<float>(5, 4, 1);
  const auto k3 = random_matrix<float>(5, 3, 1);
  const auto v6 = random_matrix<float>(6, 4, 1);
  const RowMatrix<float> no_columns(5, 0);
  require_invalid_argument([&] { kernel(q, k3, q); }, "k");
  require_invalid_argument([&] { kernel(q, q, v6); }, "v");
  require_invalid_argument([&] { kernel(no_columns, no_columns, q); }, "q");
}

/// Sets the OpenMP thread count while in scope (no effect without OpenMP).
class Threads {
 public:
  explicit Threads(int count) {
#ifdef _OPENMP
    omp_set_num_threads(count);
#else
    static_cast<void>(count);
#endif
  }
  ~Threads() {
#ifdef _OPENMP
    omp_set_num_threads(saved_);
#endif
  }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
#ifdef _OPENMP
  int saved_ = omp_get_max_threads();
#endif
};

}  // namespace poslsh_test

// The names most test files use unqualified, declared once at global scope for all of them
// (the test files are compiled in unity batches, which share file-scope declarations anyway);
// a name few files use is declared in those files.
using poslsh::AttentionOptions, poslsh::BinHash, poslsh::HashSet, poslsh::Index, poslsh::Masking;
using poslsh::ConstMatrixRef, poslsh::MatrixRef, poslsh::RowMatrix;
using poslsh::Method, poslsh::MultiHeadOptions, poslsh::Precision;
using poslsh_test::interleaved_view, poslsh_test::multihead_of, poslsh_test::multihead_options;
using poslsh_test::random_matrix, poslsh_test::random_qkv, poslsh_test::relative_max_error;
using poslsh_test::require_invalid_argument, poslsh_test::require_shape_checks;
using poslsh_test::with_masking;
