// poslsh internals: the smallest eigenvalue of the symmetric tridiagonal matrices whose inverses
// are the ALiBi kernels, by Sturm-count bisection (O(n) per step, no n x n storage).
#pragma once

#include <cmath>
#include <limits>

#include "poslsh/core/types.hpp"

namespace poslsh::detail {

/// The symmetric tridiagonal matrix with diagonal (first, middle, ..., middle, last) and every
/// off-diagonal entry equal to `off` (n >= 2; n = 1 is the 1 x 1 matrix (first)).
struct AnalysisTridiagonal {
  Index n = 1;
  double first = 1.0, middle = 1.0, last = 1.0;  // the diagonal
  double off = 0.0;

  /// Number of eigenvalues < x: the negative pivots of the LDL^T factorisation of T - x I.
  Index count_below(double x) const {
    constexpr double pivot_floor =
        std::numeric_limits<double>::min() / std::numeric_limits<double>::epsilon();
    const double off2 = off * off;
    const auto step = [&](double pivot, double previous) {
      const double next = pivot - off2 / previous;
      return std::abs(next) < pivot_floor ? -pivot_floor : next;
    };
    double d = first - x;
    if (std::abs(d) < pivot_floor) d = -pivot_floor;
    if (n == 1) return d < 0.0 ? 1 : 0;
    Index count = d < 0.0 ? 1 : 0;
    const double shifted = middle - x;
    for (Index i = 1; i + 1 < n; ++i) {
      d = step(shifted, d);
      count += d < 0.0 ? 1 : 0;
    }
    d = step(last - x, d);
    return count + (d < 0.0 ? 1 : 0);
  }

  /// Smallest eigenvalue of a positive definite T, to a few units of roundoff in ||T||:
  /// bisection between 0 and the Rayleigh quotient of the all-ones vector.
  double smallest_eigenvalue() const {
    if (n == 1) return first;
    const double nd = static_cast<double>(n);
    const double rayleigh = (first + last + (nd - 2.0) * middle + 2.0 * (nd - 1.0) * off) / nd;
    double lo = 0.0;
    double hi = std::abs(rayleigh) * (1.0 + 1e-12) + std::numeric_limits<double>::min();
    while (count_below(hi) == 0) hi *= 2.0;
    for (int iteration = 0; iteration < 2100; ++iteration) {
      const double mid = 0.5 * (lo + hi);
      if (mid <= lo || mid >= hi) break;  // the bracket is two adjacent doubles
      (count_below(mid) == 0 ? lo : hi) = mid;
    }
    return 0.5 * (lo + hi);
  }
};

}  // namespace poslsh::detail
