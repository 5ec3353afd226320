// poslsh internals: Spectra adaptors that turn an analysis operator (size(), symmetric(),
// apply<double>, apply_transpose<double>) into the products Spectra's Lanczos solver calls.
#pragma once

#include <Spectra/SymEigsSolver.h>

#include <Eigen/Core>
#include <cmath>

#include "poslsh/types.hpp"

namespace poslsh::detail {

/// y = A x for a symmetric operator A (Spectra's operator concept).
template <typename Operator>
class AnalysisSymmetricProduct {
 public:
  using Scalar = double;
  explicit AnalysisSymmetricProduct(const Operator& op) : op_(op) {}
  Index rows() const { return op_.size(); }
  Index cols() const { return op_.size(); }
  void perform_op(const double* x_in, double* y_out) const {
    const Eigen::Map<const Eigen::VectorXd> x(x_in, op_.size());
    Eigen::Map<Eigen::VectorXd> y(y_out, op_.size());
    op_.template apply<double>(x, y);
  }

 private:
  const Operator& op_;
};

/// y = A^T A x, whose largest eigenvalue is ||A||_2^2.
template <typename Operator>
class AnalysisNormalProduct {
 public:
  using Scalar = double;
  explicit AnalysisNormalProduct(const Operator& op) : op_(op), middle_(op.size()) {}
  Index rows() const { return op_.size(); }
  Index cols() const { return op_.size(); }
  void perform_op(const double* x_in, double* y_out) const {
    const Eigen::Map<const Eigen::VectorXd> x(x_in, op_.size());
    Eigen::Map<Eigen::VectorXd> y(y_out, op_.size());
    op_.template apply<double>(x, middle_);
    op_.template apply_transpose<double>(middle_, y);
  }

 private:
  const Operator& op_;
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
