// poslsh internals: argument checks shared by the exact tiled and banded kernels.
#pragma once

#include <string>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh::detail {

template <typename QType, typename VType, typename OutType>
void require_exact_rows(const char* function, const QType& q, const VType& v, double sigma,
                        Index row_begin, Index row_end, const OutType& out);

/// Q (m x d) at positions p0 .. p0 + m - 1 over K (L x d), V (L x d_v) (resolve_query_offset),
/// sigma, and rows [row_begin, row_end) of the output in `out` ((row_end - row_begin) x d_v),
/// for views of any scalar types; returns p0. Names the offending argument.
template <typename QType, typename KType, typename VType, typename OutType>
Index require_exact_views(const char* function, const QType& q, const KType& k, const VType& v,
                          double sigma, Index row_begin, Index row_end, const OutType& out,
                          const AttentionOptions& options) {
  require_qkv_shapes(function, q, k, v);
  const Index p0 = resolve_query_offset(function, options, q, k);
  require_exact_rows(function, q, v, sigma, row_begin, row_end, out);
  return p0;
}

/// Q (n x d), K (n x d), V (n x d_v), sigma, and rows [row_begin, row_end) of the output in
/// `out` ((row_end - row_begin) x d_v). Names the offending argument.
template <typename Scalar, typename OutType>
void require_exact_arguments(const char* function, const ConstMatrixRef<Scalar>& q,
                             const ConstMatrixRef<Scalar>& k, const ConstMatrixRef<Scalar>& v,
                             double sigma, Index row_begin, Index row_end, const OutType& out) {
  require_qkv_shapes(function, q, k, v);
  require_self_attention(function, q, k);
  require_exact_rows(function, q, v, sigma, row_begin, row_end, out);
}

/// The same for queries at an offset: Q (m x d) at positions p0 .. p0 + m - 1 over K (L x d),
/// V (L x d_v) (resolve_query_offset); returns p0.
template <typename Scalar, typename OutType>
Index require_exact_arguments(const char* function, const ConstMatrixRef<Scalar>& q,
                              const ConstMatrixRef<Scalar>& k, const ConstMatrixRef<Scalar>& v,
                              double sigma, Index row_begin, Index row_end, const OutType& out,
                              const AttentionOptions& options) {
  return require_exact_views(function, q, k, v, sigma, row_begin, row_end, out, options);
}

/// sigma and the rows [row_begin, row_end) of q with their output (shared by the checks above).
template <typename QType, typename VType, typename OutType>
void require_exact_rows(const char* function, const QType& q, const VType& v, double sigma,
                        Index row_begin, Index row_end, const OutType& out) {
  require_sigma(sigma, function);
  require(row_begin >= 0 && row_begin <= q.rows(), function, "row_begin", row_begin,
          [&] { return "must be in [0, q.rows()] = [0, " + std::to_string(q.rows()) + "]"; });
  require(row_end >= row_begin && row_end <= q.rows(), function, "row_end", row_end, [&] {
    return "must be in [row_begin, q.rows()] = [" + std::to_string(row_begin) + ", " +
           std::to_string(q.rows()) + "]";
  });
  require_output_shape(function, out, row_end - row_begin, v.cols());
}

}  // namespace poslsh::detail
