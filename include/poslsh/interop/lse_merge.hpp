// poslsh: merging per-sample block attentions by their log-sum-exp into the LSH estimator
// (LseMerger).
#pragma once

#include <cmath>
#include <limits>
#include <string>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// Streaming merge of s per-sample outputs into the LSH estimate T~ = D~^-1 (A o M~) V. Sample
/// k gives, for each row i, the block-wise plain attention output O_ki and the natural
/// log-sum-exp of its scaled scores lse_ki = log sum_{j in B_k(i)} e^{tau q_i.k_j}
/// (FlashAttention's softmax_lse). Then
///   T~_i = sum_k e^{lse_ki - M_i} O_ki / sum_k e^{lse_ki - M_i},   M_i = max_k lse_ki,
/// because e^{lse_ki} O_ki = sum_{j in B_k(i)} e^{tau q_i.k_j} v_j. Samples are added one at a
/// time with O(n d_v) state (the running maximum rescales earlier sums), so the s outputs never
/// need to be held at once. A row with lse = -inf in a sample (no keys there) takes nothing from
/// that sample, whatever its O row holds (even NaN); a row with -inf in every sample is 0.
template <typename Scalar>
class LseMerger {
 public:
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

  /// A merger for n rows of width d_v. Throws std::invalid_argument if n or d_v < 0.
  LseMerger(Index n, Index value_cols) {
    detail::require_size(n, "LseMerger", "n");
    detail::require_size(value_cols, "LseMerger", "value_cols");
    running_max_.setConstant(n, -std::numeric_limits<Scalar>::infinity());
    denominator_.setZero(n);
    accumulator_.setZero(n, value_cols);
  }

  /// Adds one sample: `output` (n x d_v) and `lse` (n). Throws std::invalid_argument naming
  /// 'output' or 'lse' on a shape mismatch, or 'lse' for a NaN or +inf entry.
  void add(ConstMatrixRef<Scalar> output, const Eigen::Ref<const Vector>& lse) {
    constexpr const char* function = "LseMerger::add";
    const Index n = accumulator_.rows();
    detail::require_matrix_shape(function, "output", output, n, accumulator_.cols(), false);
    detail::require(lse.size() == n, function, "lse", lse.size(),
                    [&] { return "size must be n = " + std::to_string(n); });
    for (Index i = 0; i < n; ++i) {
      const Scalar value = lse(i);
      detail::require(!std::isnan(value) && value != std::numeric_limits<Scalar>::infinity(),
                      function, "lse", value, "entries must be finite or -inf");
    }
    ++samples_;
    for (Index i = 0; i < n; ++i) {
      const Scalar value = lse(i);
      if (value == -std::numeric_limits<Scalar>::infinity()) continue;
      if (value > running_max_(i)) {
        const Scalar rescale = std::exp(running_max_(i) - value);  // 0 for the first entry
        denominator_(i) *= rescale;
        accumulator_.row(i) *= rescale;
        running_max_(i) = value;
      }
      const Scalar weight = std::exp(value - running_max_(i));
      denominator_(i) += weight;
      accumulator_.row(i) += weight * output.row(i);
    }
  }

  /// Number of samples added so far.
  Index samples() const { return samples_; }

  /// Writes T~ (n x d_v). Throws std::invalid_argument naming 'out' on a shape mismatch.
  void result(MatrixRef<Scalar> out) const {
    detail::require(
        out.rows() == accumulator_.rows() && out.cols() == accumulator_.cols(), "LseMerger::result",
        "out", [&] { return std::to_string(out.rows()) + "x" + std::to_string(out.cols()); },
        "shape must be n x d_v");
    for (Index i = 0; i < accumulator_.rows(); ++i) {
      if (denominator_(i) > Scalar(0)) {
        out.row(i) = accumulator_.row(i) / denominator_(i);
      } else {
        out.row(i).setZero();
      }
    }
  }

  /// The merged log-sum-exp of every row, log sum_k e^{lse_ki} (-inf for rows without keys).
  Vector lse() const { return (running_max_.array() + denominator_.array().log()).matrix(); }

 private:
  Vector running_max_;
  Vector denominator_;
  RowMatrix<Scalar> accumulator_;
  Index samples_ = 0;
};

}  // namespace poslsh
