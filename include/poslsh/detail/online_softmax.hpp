// poslsh internals: the online (streaming) softmax state of a set of query rows, fed tile by
// tile with scores S and non-negative weights W:
//   M_r <- max(M_r, max_{c : W_rc > 0} S_rc),   P_rc = W_rc exp(S_rc - M_r),
//   l_r <- e^{M_r,old - M_r} l_r + sum_c P_rc,  acc_r <- e^{M_r,old - M_r} acc_r + P_r V.
// The maximum is taken over entries of non-zero weight only, so a masked large score cannot
// underflow the real entries of a row; the final output is acc_r / l_r.
#pragma once

#include "poslsh/types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>

namespace poslsh::detail {

/// Score and weight tiles are column-major (rows x keys): every step below is a loop over key
/// columns of vector operations across query rows, and difference arrays over keys become
/// vector adds.
template <typename Scalar>
using TileMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

template <typename Scalar>
using TileMap = Eigen::Map<TileMatrix<Scalar>>;

/// Scratch of one tile: scores S and weights W (overwritten by P) as maps over buffers that
/// only grow, so tiles of changing shape never reallocate; per-row temporaries.
template <typename Scalar>
struct TileScratch {
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> score_buffer;
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> weight_buffer;
  Index rows = 0;
  Index cols = 0;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> tile_max;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> new_max;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> rescale;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> tile_sum;

  /// Sets the tile shape (contents unspecified).
  void shape(Index tile_rows, Index tile_cols) {
    if (tile_rows * tile_cols > score_buffer.size()) {
      score_buffer.resize(tile_rows * tile_cols);
      weight_buffer.resize(tile_rows * tile_cols);
    }
    rows = tile_rows;
    cols = tile_cols;
  }
  TileMap<Scalar> scores() { return TileMap<Scalar>(score_buffer.data(), rows, cols); }
  TileMap<Scalar> weights() { return TileMap<Scalar>(weight_buffer.data(), rows, cols); }
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
  /// scratch.weights holds W >= 0 (same shape), `values` the V rows of the tile's keys.
  /// The masked maximum is the plain maximum of S - (1 - min(W, 1)) B with B = max/4 (real
  /// scores above -B/2 are never confused with masked ones); P = W exp(min(S - M, 0)) is
  /// exactly 0 where W = 0 and never inf, so no entry can turn a row into NaN.
  template <typename ValuesType>
  void update(Index row0, TileScratch<Scalar>& scratch, const ValuesType& values) {
    const Index rows = scratch.rows;
    const Index cols = scratch.cols;
    const TileMap<Scalar> scores = scratch.scores();
    TileMap<Scalar> weights = scratch.weights();
    constexpr Scalar big = std::numeric_limits<Scalar>::max() / 4;
    constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
    auto& tile_max = scratch.tile_max;
    tile_max.setConstant(rows, minus_infinity);
    for (Index c = 0; c < cols; ++c) {
      tile_max = tile_max.max(scores.col(c).array() -
                              (Scalar(1) - weights.col(c).array().min(Scalar(1))) * big);
    }
    auto old_max = running_max.segment(row0, rows);
    scratch.new_max.resize(rows);
    scratch.rescale.resize(rows);
    for (Index r = 0; r < rows; ++r) {
      const bool has_entries = tile_max(r) > -big / 2;
      const Scalar updated = has_entries ? std::max(old_max(r), tile_max(r)) : old_max(r);
      scratch.rescale(r) = updated == minus_infinity ? Scalar(1) : std::exp(old_max(r) - updated);
      // A row without entries so far keeps -inf; shift it by 0 (its weights are all 0).
      scratch.new_max(r) = updated == minus_infinity ? Scalar(0) : updated;
      old_max(r) = updated;
    }
    scratch.tile_sum.setZero(rows);
    for (Index c = 0; c < cols; ++c) {
      auto p = weights.col(c).array();
      p = p * (scores.col(c).array() - scratch.new_max).min(Scalar(0)).exp();
      scratch.tile_sum += p;
    }
    auto sum = running_sum.segment(row0, rows);
    sum = sum * scratch.rescale + scratch.tile_sum;
    auto acc = accumulator.middleRows(row0, rows);
    acc = scratch.rescale.matrix().asDiagonal() * acc;
    acc.noalias() += weights * values;
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
