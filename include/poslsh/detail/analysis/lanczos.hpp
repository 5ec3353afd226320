// poslsh internals: Spectra adaptors that turn an analysis operator (size(), symmetric(),
// apply<double>, apply_transpose<double>) into the products Spectra's Lanczos solver calls.
#pragma once

#include <Spectra/SymEigsSolver.h>

#include <Eigen/Core>
#include <cmath>

#include "poslsh/core/types.hpp"

namespace poslsh::detail {

/// The symmetric product Spectra's Lanczos solver runs on (its operator concept): y = A x for a
/// symmetric operator A, whose largest |eigenvalue| is ||A||_2, or y = A^T A x otherwise, whose
/// largest eigenvalue is ||A||_2^2. One type for both, so one solver is compiled per Operator.
template <typename Operator>
class AnalysisLanczosProduct {
 public:
  using Scalar = double;
  explicit AnalysisLanczosProduct(const Operator& op)
      : op_(op), normal_(!op.symmetric()), middle_(normal_ ? op.size() : 0) {}
  Index rows() const { return op_.size(); }
  Index cols() const { return op_.size(); }
  /// True for the product A^T A x (a non-symmetric A).
  bool normal() const { return normal_; }
  void perform_op(const double* x_in, double* y_out) const {
    const Eigen::Map<const Eigen::VectorXd> x(x_in, op_.size());
    Eigen::Map<Eigen::VectorXd> y(y_out, op_.size());
    if (normal_) {
      op_.template apply<double>(x, middle_);
      op_.template apply_transpose<double>(middle_, y);
    } else {
      op_.template apply<double>(x, y);
    }
  }

 private:
  const Operator& op_;
  bool normal_;
  mutable Eigen::VectorXd middle_;
};

/// Spectra's symmetric solver, also giving the largest Ritz value of a run that did not
/// converge (Spectra's eigenvalues() lists converged values only).
template <typename Product>
class AnalysisLanczosSolver : public Spectra::SymEigsSolver<Product> {
 public:
  using Spectra::SymEigsSolver<Product>::SymEigsSolver;
  /// |first Ritz value| after compute(..., sorting = LargestMagn): a Rayleigh quotient, so a
  /// lower bound on max |lambda| whether or not it converged.
  double top_ritz_value() const { return std::abs(this->m_ritz_val[0]); }
};

}  // namespace poslsh::detail
