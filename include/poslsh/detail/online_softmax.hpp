// poslsh internals: the online (streaming) softmax state of a set of query rows, fed tile by
// tile with scores S and non-negative weights W:
//   M_r <- max(M_r, max_{c : W_rc > 0} S_rc),   P_rc = W_rc exp(S_rc - M_r),
//   l_r <- e^{M_r,old - M_r} l_r + sum_c P_rc,  acc_r <- e^{M_r,old - M_r} acc_r + P_r V.
// The maximum is taken over entries of non-zero weight only, so a masked large score cannot
// underflow the real entries of a row; the final output is acc_r / l_r.
#pragma once

#include "poslsh/types.hpp"

#include <Eigen/Core>

#include <limits>

namespace poslsh::detail {

/// Scratch of one tile: scores, weights and probabilities (reused across tiles).
template <typename Scalar>
struct TileScratch {
  RowMatrix<Scalar> scores;
  RowMatrix<Scalar> weights;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> tile_max;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> rescale;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> shift;
};

/// Online softmax state of R query rows with value width d_v.
template <typename Scalar>
struct OnlineSoftmax {
  Eigen::Array<Scalar, Eigen::Dynamic, 1> running_max;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> running_sum;
  RowMatrix<Scalar> accumulator;

  void reset(Index rows, Index value_cols) {
    running_max.setConstant(rows, -std::numeric_limits<Scalar>::infinity());
    running_sum.setZero(rows);
    accumulator.setZero(rows, value_cols);
  }

  /// Folds in the tile (rows [row0, row0 + S.rows()) of this state): scratch.scores holds S,
  /// scratch.weights holds W (same shape), `values` the V rows of the tile's keys.
  template <typename ValuesType>
  void update(Index row0, TileScratch<Scalar>& scratch, const ValuesType& values) {
    const Index rows = scratch.scores.rows();
    constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
    auto scores = scratch.scores.array();
    auto weights = scratch.weights.array();
    scratch.tile_max = (weights > Scalar(0)).select(scores, minus_infinity).rowwise().maxCoeff();
    auto old_max = running_max.segment(row0, rows);
    const auto new_max = old_max.max(scratch.tile_max);
    // Rows with no weighted entry so far keep max -inf: their rescale is 1 and P is 0.
    scratch.rescale = (new_max == minus_infinity).select(Scalar(1), (old_max - new_max).exp());
    scratch.shift = (new_max == minus_infinity).select(Scalar(0), new_max);
    // P = W exp(S - M), written over the weights; exactly 0 where W = 0.
    weights = (weights > Scalar(0))
                  .select(weights * (scores.colwise() - scratch.shift).exp(), Scalar(0));
    old_max = new_max;
    auto sum = running_sum.segment(row0, rows);
    sum = sum * scratch.rescale + weights.rowwise().sum();
    auto acc = accumulator.middleRows(row0, rows);
    acc = scratch.rescale.matrix().asDiagonal() * acc;
    acc.noalias() += scratch.weights * values;
  }

  /// out_r = acc_r / l_r for rows [row0, row0 + out.rows()).
  template <typename OutType>
  void finish(Index row0, OutType&& out) const {
    const Index rows = out.rows();
    out = running_sum.segment(row0, rows).inverse().matrix().asDiagonal() *
          accumulator.middleRows(row0, rows);
  }
};

}  // namespace poslsh::detail
