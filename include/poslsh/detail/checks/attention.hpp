// poslsh internals: shape checks shared by the attention kernels and the score scale.
#pragma once

#include <cmath>
#include <optional>
#include <string>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh::detail {

/// Names of the three inputs in messages (decode calls them query, keys and values).
struct QkvNames {
  const char* q = "q";
  const char* k = "k";
  const char* v = "v";
};

/// Checks Q (n x d), K (n_k x d) and V (n_k x d_v): shapes only, never the values (NaN or
/// inf entries are not scanned) nor the row strides of the inputs (overlapping input rows are
/// read as they are). Names the offending argument.
template <typename QType, typename KType, typename VType>
void require_qkv_shapes(const char* function, const QType& q, const KType& k, const VType& v,
                        const QkvNames& names = {}) {
  require(k.cols() == q.cols(), function, names.k, k.cols(), [&] {
    return "column count (d) must equal " + std::string(names.q) +
           ".cols() = " + std::to_string(q.cols());
  });
  require(v.rows() == k.rows(), function, names.v, v.rows(), [&] {
    return "row count must equal " + std::string(names.k) + ".rows() = " + std::to_string(k.rows());
  });
  require(q.rows() == 0 || q.cols() > 0, function, names.q, q.cols(),
          "head dimension d must be >= 1 when n > 0");
}

/// Self-attention: K has as many rows as Q (keys at the query positions 0 .. n-1).
template <typename QType, typename KType>
void require_self_attention(const char* function, const QType& q, const KType& k) {
  require(k.rows() == q.rows(), function, "k", k.rows(), [&] {
    return "row count must equal q.rows() = " + std::to_string(q.rows()) + " (self-attention)";
  });
}

/// The position p0 of q's first row (AttentionOptions::query_offset): the given offset, or
/// k.rows() - q.rows() when unset (bottom-right alignment). Requires 0 <= p0 and
/// p0 + q.rows() <= k.rows(): the one rule on query and key row counts of the prefill kernels.
/// The rule on counts: m queries over L keys, offset `offset` (unset: L - m); `keys_name` and
/// `offset_name` name the arguments in messages.
inline Index resolve_query_offset(const char* function, const std::optional<Index>& offset, Index m,
                                  Index L, const char* keys_name = "k",
                                  const char* offset_name = "options.query_offset") {
  if (!offset) {
    require(L >= m, function, keys_name, L, [&] {
      return "row count must be >= the query count " + std::to_string(m) +
             " (an unset offset means the queries are the last ones of the key positions)";
    });
    return L - m;
  }
  const Index p0 = *offset;
  require(p0 >= 0 && p0 <= L - m, function, offset_name, p0, [&] {
    return "must lie in [0, keys - queries] = [0, " + std::to_string(L - m) +
           "] (queries at positions p0 .. p0 + m - 1 over keys 0 .. L - 1)";
  });
  return p0;
}

template <typename QType, typename KType>
Index resolve_query_offset(const char* function, const AttentionOptions& options, const QType& q,
                           const KType& k) {
  return resolve_query_offset(function, options.query_offset, q.rows(), k.rows());
}

/// A matrix argument `name` of shape rows x cols (an output's rows must not overlap).
template <typename MatrixType>
void require_matrix_shape(const char* function, const char* name, const MatrixType& m, Index rows,
                          Index cols, bool output) {
  require(
      m.rows() == rows && m.cols() == cols, function, name,
      [&] { return std::to_string(m.rows()) + "x" + std::to_string(m.cols()); },
      [&] { return "shape must be " + std::to_string(rows) + "x" + std::to_string(cols); });
  require(!output || m.rows() <= 1 || m.outerStride() >= m.cols(), function, name, m.outerStride(),
          [&] {
            return "row stride must be >= its column count " + std::to_string(m.cols()) +
                   " (rows must not overlap)";
          });
}

/// Checks the output's shape (rows x cols) and that its rows do not overlap (row stride >= cols
/// when it has two rows or more): overlapping output rows would be written by several tiles.
template <typename OutType>
void require_output_shape(const char* function, const OutType& out, Index rows, Index cols) {
  require_matrix_shape(function, "out", out, rows, cols, true);
}

/// tau: the given scale, or 1/sqrt(d). Throws if the given scale is not finite or the masking
/// or the precision is not one of the enumerators.
inline double resolve_scale(const char* function, const AttentionOptions& options, Index d) {
  require(options.masking == Masking::causal || options.masking == Masking::bidirectional, function,
          "options.masking", static_cast<int>(options.masking),
          "must be Masking::causal or Masking::bidirectional");
  require(enum_is_valid(options.precision), function, "options.precision",
          static_cast<int>(options.precision),
          "must be Precision::matrix_units or Precision::float_products");
  if (options.scale) {
    require(std::isfinite(*options.scale), function, "options.scale", *options.scale,
            "must be finite");
    return *options.scale;
  }
  return d > 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : 1.0;
}

}  // namespace poslsh::detail
