// Shared helpers for the tests: seeded random inputs, scalar-aware tolerances and a check
// that a call throws std::invalid_argument naming a given argument.
#pragma once

#include <limits>
#include <poslsh/core/types.hpp>
#include <random>
#include <stdexcept>
#include <string>

#include "catch_compat.hpp"
#include "kernel_instantiations.hpp"

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

/// Default attention options with the given masking.
inline poslsh::AttentionOptions with_masking(poslsh::Masking masking) {
  poslsh::AttentionOptions options;
  options.masking = masking;
  return options;
}

/// +inf in double (sigma = infinity: no positional bias).
constexpr double infinity = std::numeric_limits<double>::infinity();

/// "causal" or "bidirectional", for test messages.
inline const char* masking_name(poslsh::Masking masking) {
  return masking == poslsh::Masking::causal ? "causal" : "bidirectional";
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

}  // namespace poslsh_test
