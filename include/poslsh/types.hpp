// poslsh: matrix views, masking and attention options shared by every kernel.
#pragma once

#include <Eigen/Core>

#include <cstdint>
#include <optional>

namespace poslsh {

using Index = Eigen::Index;

/// Row-major dynamic matrix: row i is token i.
template <typename Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Read-only (n x d) view with unit inner stride and any row stride, so the rows of an
/// [n, H, d] or [H, n, d] buffer are used without copies (Eigen::Map with OuterStride<>).
template <typename Scalar>
using ConstMatrixRef = Eigen::Ref<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

/// Writable (n x d) view with unit inner stride and any row stride.
template <typename Scalar>
using MatrixRef = Eigen::Ref<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

/// Which keys a query sees: `causal` keeps j <= i, `bidirectional` keeps every j.
enum class Masking { causal, bidirectional };

/// Options common to the attention kernels.
struct AttentionOptions {
  /// Causal or bidirectional.
  Masking masking = Masking::causal;
  /// Score scale tau in A_ij = exp(tau q_i . k_j); unset means 1/sqrt(d).
  std::optional<double> scale{};
};

}  // namespace poslsh
