// poslsh: spectral norms ||L* - M~||_2 and ||L*||_2, by dense decompositions for small n and
// matrix-free (Lanczos through Spectra, exact tridiagonal inverses) for any n. Part of the
// analysis module (poslsh/analysis.hpp): needs Spectra. The decompositions and the Lanczos
// solver sit in templates, so a program compiles only the ones it calls.
#pragma once

#include <Eigen/Eigenvalues>
#include <algorithm>
#include <cmath>

#include "poslsh/analysis/operators.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/lanczos.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/analysis/tridiagonal.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/reference/alibi_kernel.hpp"
#include "poslsh/reference/masks.hpp"

namespace poslsh {

/// How a spectral norm is computed.
enum class SpectralMethod {
  automatic,  ///< dense when n <= SpectralOptions::dense_limit, else lanczos
  dense,      ///< O(n^2) memory, O(n^3) time: eigenvalues of A (symmetric) or of A^T A
  lanczos     ///< matrix-free: Spectra's restarted Lanczos on A (symmetric) or on A^T A
};

/// The names "automatic", "dense" and "lanczos" (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(SpectralMethod, automatic, dense, lanczos);

/// Options of the spectral norm computations.
struct SpectralOptions {
  SpectralMethod method = SpectralMethod::automatic;
  /// Largest n that `automatic` treats densely.
  Index dense_limit = 128;
  /// Eigenvalues Lanczos converges together (Spectra's nev). The norm needs only the largest;
  /// asking for more makes a clustered top of the spectrum converge much more slowly.
  Index eigenvalues = 1;
  /// Lanczos basis size (Spectra's ncv), > eigenvalues; memory n * subspace doubles.
  Index subspace = 30;
  /// Restart limit; a run that hits it reports converged = false.
  Index max_restarts = 1000;
  /// Relative residual at which a Ritz value counts as converged.
  double tolerance = 1e-10;
};

/// A computed spectral norm and how it was obtained.
struct SpectralNorm {
  double value = 0.0;
  /// False only when Lanczos hit max_restarts. `value` is then its largest Ritz value, a lower
  /// bound that is usually close: this happens when the top of the spectrum is a tight cluster
  /// (E nearly periodic: few samples, n / sigma large), where Ritz values settle long before
  /// the residuals do.
  bool converged = true;
  /// Operator products used (A x, or A x then A^T x, each counted once per pair).
  Index products = 0;
  SpectralMethod method = SpectralMethod::dense;
};

namespace detail {

/// Throws std::invalid_argument naming the first bad field of `options`.
inline void analysis_require_spectral_options(const SpectralOptions& options,
                                              const char* function) {
  require(options.dense_limit >= 0, function, "options.dense_limit", options.dense_limit,
          "must be >= 0");
  require(options.eigenvalues >= 1, function, "options.eigenvalues", options.eigenvalues,
          "must be >= 1");
  require(options.subspace > options.eigenvalues, function, "options.subspace", options.subspace,
          "must exceed options.eigenvalues");
  require(options.max_restarts >= 1, function, "options.max_restarts", options.max_restarts,
          "must be >= 1");
  require(std::isfinite(options.tolerance) && options.tolerance > 0.0, function,
          "options.tolerance", options.tolerance, "must be finite and > 0");
}

/// ||A||_2 of a dense square matrix (any Eigen matrix type, computed in its scalar type):
/// max |lambda(A)| when A is symmetric, else the largest singular value sqrt(lambda_max(A^T A)).
/// lambda_max of A^T A is perfectly conditioned (forming and solving it errs by about
/// n eps ||A||_2^2), so the singular value is accurate to about n eps / 2 relative, and one
/// symmetric eigenvalue solver serves both cases (no SVD).
template <typename Derived>
double analysis_dense_spectral_norm(const Eigen::MatrixBase<Derived>& matrix, bool symmetric) {
  using Plain = typename Derived::PlainObject;
  if (matrix.rows() == 0) return 0.0;
  if (symmetric) {
    const Eigen::SelfAdjointEigenSolver<Plain> solver(matrix, Eigen::EigenvaluesOnly);
    return static_cast<double>(solver.eigenvalues().cwiseAbs().maxCoeff());
  }
  Plain normal(matrix.cols(), matrix.cols());
  normal.noalias() = matrix.transpose() * matrix;
  const Eigen::SelfAdjointEigenSolver<Plain> solver(normal, Eigen::EigenvaluesOnly);
  return std::sqrt(std::max(0.0, static_cast<double>(solver.eigenvalues().maxCoeff())));
}

}  // namespace detail

/// ||A||_2 of a matrix-free operator A (members size(), symmetric(), apply<double>(x, y),
/// apply_transpose<double>(x, y), as in analysis/operators.hpp). Lanczos: max |lambda(A)| when
/// symmetric, sqrt(lambda_max(A^T A)) otherwise. `dense` (and `automatic` at n <= dense_limit,
/// or when n is too small for the Lanczos basis) builds A from its n columns A e_j. Throws
/// std::invalid_argument naming a bad option.
template <typename Operator>
SpectralNorm operator_spectral_norm(const Operator& op, const SpectralOptions& options = {}) {
  detail::analysis_require_spectral_options(options, "operator_spectral_norm");
  const Index n = op.size();
  const Index eigenvalues = std::min(options.eigenvalues, n - 1);
  const Index subspace = std::min(std::max(options.subspace, 2 * eigenvalues + 1), n);
  const bool lanczos_fits = eigenvalues >= 1 && subspace > eigenvalues;
  if (options.method == SpectralMethod::dense || !lanczos_fits ||
      (options.method == SpectralMethod::automatic && n <= options.dense_limit)) {
    RowMatrix<double> matrix(n, n);
    Vector<double> unit = Vector<double>::Zero(n);
    Vector<double> column(n);
    for (Index j = 0; j < n; ++j) {
      unit[j] = 1.0;
      op.template apply<double>(unit, column);
      matrix.col(j) = column;
      unit[j] = 0.0;
    }
    return SpectralNorm{detail::analysis_dense_spectral_norm(matrix, op.symmetric()), true, n,
                        SpectralMethod::dense};
  }
  // Symmetric A: the largest |eigenvalue| of A. Otherwise the largest eigenvalue of A^T A,
  // whose square root is ||A||_2.
  detail::AnalysisLanczosProduct<Operator> product(op);
  detail::AnalysisLanczosSolver<detail::AnalysisLanczosProduct<Operator>> solver(
      product, eigenvalues, subspace);
  solver.init();
  solver.compute(product.normal() ? Spectra::SortRule::LargestAlge : Spectra::SortRule::LargestMagn,
                 options.max_restarts, options.tolerance, Spectra::SortRule::LargestMagn);
  SpectralNorm result;
  result.method = SpectralMethod::lanczos;
  result.converged = solver.info() == Spectra::CompInfo::Successful;
  result.products = solver.num_operations();
  result.value = product.normal() ? std::sqrt(solver.top_ritz_value()) : solver.top_ritz_value();
  return result;
}

/// Spectral error ||L* - M~||_2 of the mean mask M~ = (1/s) sum_k M(h_k) against the ALiBi
/// kernel L*_ij = exp(-|i-j| / sigma) (causal: both lower triangular). `hashes`: a HashSet or
/// any container of BinHash. Throws std::invalid_argument naming a bad argument (empty or
/// invalid hashes, n < 0, sigma, options). Dense: from alibi_kernel_dense and mean_mask_dense.
/// Lanczos: on KernelErrorOperator, O(n + s n / sigma) per product and
/// O(n s / sigma + n * subspace) memory.
template <typename Hashes = HashSet>
SpectralNorm spectral_error(const Hashes& hash_set, Index n, double sigma, Masking masking,
                            const SpectralOptions& options = {}) {
  constexpr const char* function = "spectral_error";
  detail::analysis_require_spectral_options(options, function);
  detail::require_sigma(sigma, function);
  const HashSet& hashes = detail::analysis_hash_set(hash_set);
  const KernelErrorOperator error(hashes, n, sigma, masking);  // checks hashes and n
  if (options.method == SpectralMethod::dense ||
      (options.method == SpectralMethod::automatic && n <= options.dense_limit)) {
    const RowMatrix<double> dense =
        alibi_kernel_dense<double>(n, sigma, masking) - mean_mask_dense<double>(hashes, n, masking);
    return SpectralNorm{
        detail::analysis_dense_spectral_norm(dense, masking == Masking::bidirectional), true, 0,
        SpectralMethod::dense};
  }
  return operator_spectral_norm(error, options);
}

/// ||L*||_2 of the ALiBi kernel, exactly and in O(n) memory, from its tridiagonal inverse
/// (r = exp(-1/sigma)):
///   bidirectional  L*^-1 = T / (1 - r^2), T = tridiag(-r; 1, 1+r^2, ..., 1+r^2, 1; -r),
///                  so ||L*||_2 = (1 - r^2) / lambda_min(T);
///   causal         L*^-1 = I - r Z (Z the down shift), so ||L*||_2 = 1 / sqrt(lambda_min(B)),
///                  B = (I - r Z)^T (I - r Z) = tridiag(-r; 1+r^2, ..., 1+r^2, 1; -r).
/// lambda_min by Sturm-count bisection, accurate to about 1e-16 / (1 - r)^2 relative (1e-11 at
/// sigma = 256). Throws std::invalid_argument if n < 0 or sigma is not finite and > 0.
inline double alibi_kernel_norm(Index n, double sigma, Masking masking) {
  detail::require_size(n, "alibi_kernel_norm", "n");
  detail::require_sigma(sigma, "alibi_kernel_norm");
  if (n <= 1) return static_cast<double>(n);
  const double r = std::exp(-1.0 / sigma);
  const double middle = 1.0 + r * r;
  if (masking == Masking::bidirectional) {
    const detail::AnalysisTridiagonal t{n, 1.0, middle, 1.0, -r};
    return -std::expm1(-2.0 / sigma) / t.smallest_eigenvalue();
  }
  const detail::AnalysisTridiagonal b{n, middle, middle, 1.0, -r};
  return 1.0 / std::sqrt(b.smallest_eigenvalue());
}

}  // namespace poslsh
