// poslsh internals: the streaming softmax written with Eigen expressions, used by the per-sample,
// decode and bring-your-own block paths (the tile engine of detail/tile/ has its own
// register-blocked one). The state of a set of query rows is fed block by block with logits
// X = S + log W (scores S, non-negative weights W, log 0 = -inf):
//   M_r <- max(M_r, max_c X_rc),   P_rc = exp(X_rc - M_r) = W_rc e^{S_rc - M_r},
//   l_r <- e^{M_r,old - M_r} l_r + sum_c P_rc,  acc_r <- e^{M_r,old - M_r} acc_r + P_r V.
// Entries of weight 0 are -inf: they never set the maximum (so a masked large score cannot
// underflow the real entries of a row) and get probability e^-inf, which Eigen's vectorized
// exp returns as its smallest result (about 1e-38 in float, 1e-308 in double) relative to the
// row's largest weight 1: far below rounding. The final output is acc_r / l_r.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>

#include "poslsh/types.hpp"

namespace poslsh::detail {

/// Logit tiles are column-major (rows x keys): every step below is a loop over key columns of
/// vector operations across query rows, and difference arrays over keys become vector adds.
template <typename Scalar>
using LogitMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

template <typename Scalar>
using LogitMap = Eigen::Map<LogitMatrix<Scalar>>;

/// Scratch of one tile: the logits X (overwritten by P) as a map over a buffer that only
/// grows, so tiles of changing shape never reallocate; per-row temporaries.
template <typename Scalar>
struct LogitScratch {
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> logit_buffer;
  Index rows = 0;
  Index cols = 0;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> tile_max;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> shift;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> rescale;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> tile_sum;

  /// Sets the tile shape (contents unspecified).
  void shape(Index tile_rows, Index tile_cols) {
    if (tile_rows * tile_cols > logit_buffer.size()) logit_buffer.resize(tile_rows * tile_cols);
    rows = tile_rows;
    cols = tile_cols;
  }
  LogitMap<Scalar> logits() { return LogitMap<Scalar>(logit_buffer.data(), rows, cols); }
};

/// log of a column of counts c >= 0 in place: log c, and -inf where c = 0.
template <typename Column>
void log_counts(Column&& column) {
  column = column.array().log();
}

/// Online softmax state of R query rows with value width d_v.
template <typename Scalar>
struct StreamingSoftmax {
  Eigen::Array<Scalar, Eigen::Dynamic, 1> running_max;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> running_sum;
  RowMatrix<Scalar> accumulator;

  void reset(Index rows, Index value_cols) {
    running_max.setConstant(rows, -std::numeric_limits<Scalar>::infinity());
    running_sum.setZero(rows);
    accumulator.setZero(rows, value_cols);
  }

  /// Folds in the tile (rows [row0, row0 + X.rows()) of this state): scratch.logits() holds
  /// X = S + log W, `values` the V rows of the tile's keys. Overwrites X with P.
  template <typename ValuesType>
  void update(Index row0, LogitScratch<Scalar>& scratch, const ValuesType& values) {
    const Index rows = scratch.rows;
    const Index cols = scratch.cols;
    LogitMap<Scalar> logits = scratch.logits();
    constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
    auto& tile_max = scratch.tile_max;
    tile_max.setConstant(rows, minus_infinity);
    for (Index c = 0; c < cols; ++c) tile_max = tile_max.max(logits.col(c).array());
    auto old_max = running_max.segment(row0, rows);
    scratch.shift.resize(rows);
    scratch.rescale.resize(rows);
    for (Index r = 0; r < rows; ++r) {
      const Scalar updated = std::max(old_max(r), tile_max(r));
      scratch.rescale(r) = updated == minus_infinity ? Scalar(1) : std::exp(old_max(r) - updated);
      // A row without entries so far keeps -inf; shift it by 0 (its logits are all -inf).
      scratch.shift(r) = updated == minus_infinity ? Scalar(0) : updated;
      old_max(r) = updated;
    }
    scratch.tile_sum.setZero(rows);
    for (Index c = 0; c < cols; ++c) {
      auto p = logits.col(c).array();
      p = (p - scratch.shift).exp();
      scratch.tile_sum += p;
    }
    auto sum = running_sum.segment(row0, rows);
    sum = sum * scratch.rescale + scratch.tile_sum;
    auto acc = accumulator.middleRows(row0, rows);
    if ((scratch.rescale != Scalar(1)).any()) acc = scratch.rescale.matrix().asDiagonal() * acc;
    acc.noalias() += logits * values;
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
