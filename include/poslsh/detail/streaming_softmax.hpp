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
//
// Half-precision views (Eigen::half, Eigen::bfloat16) are never multiplied as such: their rows
// are widened to the compute scalar (float) tile by tile into the scratch's reusable buffers
// (widened_rows), and the float code runs on those; an output of a half type is the float
// result rounded once (finish).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/tile/exponential.hpp"
#include "poslsh/detail/tile/types.hpp"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace poslsh::detail {

/// Reusable buffer of widened rows: grows only, so tiles of changing shape never reallocate.
template <typename Compute>
struct WidenBuffer {
  Eigen::Matrix<Compute, Eigen::Dynamic, 1> storage;
};

/// dst[i] = float(src[i]) for i < count: exact (every bfloat16 is the float with the same
/// top 16 bits), written as a shift that compilers vectorize.
inline void widen_contiguous(const Eigen::bfloat16* src, float* dst, Index count) {
#pragma omp simd
  for (Index i = 0; i < count; ++i) {
    const std::uint32_t bits = static_cast<std::uint32_t>(src[i].value) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    dst[i] = value;
  }
}

/// dst[i] = float(src[i]) for i < count: exact (binary16 values are floats); 8 at a time with
/// F16C when the target has it.
inline void widen_contiguous(const Eigen::half* src, float* dst, Index count) {
  Index i = 0;
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(halves));
  }
#endif
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

/// Rows [first, first + count) of `view` as Compute: the view's own rows when it already holds
/// Compute (no copy), else widened into `buffer` (each value converted exactly: every half,
/// bfloat16 and float value is a float) and returned as a contiguous map of it.
template <typename Compute, typename Storage>
auto widened_rows(const ConstMatrixRef<Storage>& view, Index first, Index count,
                  WidenBuffer<Compute>& buffer) {
  if constexpr (std::is_same_v<Storage, Compute>) {
    (void)buffer;
    return view.middleRows(first, count);
  } else {
    const Index cols = view.cols();
    if (count * cols > buffer.storage.size()) buffer.storage.resize(count * cols);
    Compute* rows = buffer.storage.data();
    for (Index r = 0; r < count; ++r) {
      if constexpr (is_half_precision_v<Storage>) {
        widen_contiguous(view.row(first + r).data(), rows + r * cols, cols);
      } else {
        Eigen::Map<Eigen::Matrix<Compute, 1, Eigen::Dynamic>>(rows + r * cols, cols) =
            view.row(first + r).template cast<Compute>();
      }
    }
    return Eigen::Map<const RowMatrix<Compute>>(rows, count, cols);
  }
}

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
  /// Widened rows of half-precision Q, K and V tiles (unused for float and double views).
  WidenBuffer<Scalar> q_wide, k_wide, v_wide;

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
      p = (p - scratch.shift).unaryExpr(ExpOp<Scalar>());
      scratch.tile_sum += p;
    }
    auto sum = running_sum.segment(row0, rows);
    sum = sum * scratch.rescale + scratch.tile_sum;
    auto acc = accumulator.middleRows(row0, rows);
    if ((scratch.rescale != Scalar(1)).any()) acc = scratch.rescale.matrix().asDiagonal() * acc;
    acc.noalias() += logits * values;
  }

  /// out_r = acc_r / l_r for rows [row0, row0 + out.rows()); an output of another scalar type
  /// (a half type) gets each value computed in Scalar, then rounded once.
  template <typename OutType>
  void finish(Index row0, OutType&& out) const {
    using OutScalar = typename std::decay_t<OutType>::Scalar;
    const Index rows = out.rows();
    if constexpr (std::is_same_v<OutScalar, Scalar>) {
      out = running_sum.segment(row0, rows).inverse().matrix().asDiagonal() *
            accumulator.middleRows(row0, rows);
    } else {
      out = (running_sum.segment(row0, rows).inverse().matrix().asDiagonal() *
             accumulator.middleRows(row0, rows))
                .template cast<OutScalar>();
    }
  }
};

}  // namespace poslsh::detail
