// poslsh: the naive exact ALiBi attention, O(n^2) memory; the reference every kernel is
// checked against.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"

namespace poslsh {

/// Exact ALiBi attention T* = softmax(tau Q K^T - |i-j| / sigma) V (row-wise softmax; the
/// causal form keeps j <= i), i.e. D^-1 (A o L*) V with A_ij = exp(tau q_i . k_j). The row
/// maximum is subtracted before exp, so scores of any finite magnitude give finite output.
/// Q is n x d, K and V are n x d and n x d_v, `out` is n x d_v. Self-attention only
/// (options.query_offset unset or 0). Throws std::invalid_argument naming a bad argument: the
/// shapes of q, k, v and out (rows of out must not overlap), sigma (finite, > 0),
/// options.scale (finite), options.masking, options.query_offset. Not checked: the values (a
/// NaN in row i of Q gives a NaN row i of the output, the other rows unchanged; see
/// core/types.hpp) and that out does not overlap q, k or v. Builds the n x n score matrix:
/// for checks and small n only.
template <typename Scalar>
void alibi_attention_reference(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                               ConstMatrixRef<Scalar> v, double sigma, MatrixRef<Scalar> out,
                               const AttentionOptions& options = {}) {
  constexpr const char* function = "alibi_attention_reference";
  detail::require_qkv_shapes(function, q, k, v);
  detail::require_self_attention(function, q, k);
  detail::resolve_query_offset(function, options, q, k);  // self-attention: unset or 0
  detail::require_sigma(sigma, function);
  detail::require_output_shape(function, out, q.rows(), v.cols());
  const double tau = detail::resolve_scale(function, options, q.cols());  // checks the options
  const Index n = q.rows();
  if (n == 0) return;
  const RowMatrix<Scalar> scores = (static_cast<Scalar>(tau) * q) * k.transpose();
  Eigen::Matrix<Scalar, 1, Eigen::Dynamic> weights(n);
  for (Index i = 0; i < n; ++i) {
    const Index last = options.masking == Masking::causal ? i : n - 1;
    Scalar row_max = -std::numeric_limits<Scalar>::infinity();
    for (Index j = 0; j <= last; ++j) {
      const double distance = static_cast<double>(i > j ? i - j : j - i);
      weights(j) = scores(i, j) - static_cast<Scalar>(distance / sigma);
      row_max = std::max(row_max, weights(j));
    }
    Scalar total = 0;
    for (Index j = 0; j <= last; ++j) {
      weights(j) = std::exp(weights(j) - row_max);
      total += weights(j);
    }
    out.row(i).noalias() = (weights.head(last + 1) / total) * v.topRows(last + 1);
  }
}

/// Returning form of alibi_attention_reference (the same checks).
template <typename Scalar>
RowMatrix<Scalar> alibi_attention_reference(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                            ConstMatrixRef<Scalar> v, double sigma,
                                            const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  alibi_attention_reference<Scalar>(q, k, v, sigma, out, options);
  return out;
}

}  // namespace poslsh
