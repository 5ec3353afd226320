// Helpers of the half-precision tests (half_precision*.cpp): random matrices rounded to a
// half-precision type (one, or the q, k, v of a test), exact widening to float and double, the
// max-norm error against a double reference and value equality.
#pragma once

#include <cstdint>
#include <poslsh/core/types.hpp>

#include "test_support.hpp"

namespace poslsh_test {

/// A random matrix rounded to Half (round to nearest even).
template <typename Half>
poslsh::RowMatrix<Half> random_half(poslsh::Index rows, poslsh::Index cols, std::uint64_t seed) {
  return random_matrix<float>(rows, cols, seed).template cast<Half>();
}

/// q, k (n x d) and v (n x dv) of random_half, seeds `seed`, `seed + 1` and `seed + 2`.
template <typename Half>
Qkv<Half> random_half_qkv(poslsh::Index n, poslsh::Index d, poslsh::Index dv, std::uint64_t seed) {
  return {random_half<Half>(n, d, seed), random_half<Half>(n, d, seed + 1),
          random_half<Half>(n, dv, seed + 2)};
}

/// m widened to float (exact for float, bfloat16 and half).
template <typename Matrix>
poslsh::RowMatrix<float> widened(const Matrix& m) {
  return m.template cast<float>();
}

/// m widened to double through float (exact).
template <typename Matrix>
poslsh::RowMatrix<double> to_double(const Matrix& m) {
  return m.template cast<float>().template cast<double>();
}

/// max_ij |a_ij - b_ij|, a widened exactly to double.
template <typename A>
double max_error(const A& a, const poslsh::RowMatrix<double>& b) {
  return (to_double(a) - b).cwiseAbs().maxCoeff();
}

/// True when a and b hold the same values (compared widened to float, which is exact).
template <typename A, typename B>
bool same_values(const A& a, const B& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() && widened(a) == widened(b);
}

}  // namespace poslsh_test
