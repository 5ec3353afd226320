// poslsh internals: shape checks shared by the attention kernels and the score scale.
#pragma once

#include "poslsh/detail/check.hpp"
#include "poslsh/types.hpp"

#include <cmath>
#include <string>

namespace poslsh::detail {

/// Checks Q (n x d), K (n_k x d), V (n_k x d_v) and the output (n x d_v), with n_k = n unless
/// `keys` is given. Names the offending argument.
template <typename QType, typename KType, typename VType>
void require_qkv_shapes(const char* function, const QType& q, const KType& k, const VType& v) {
  require(k.cols() == q.cols(), function, "k", k.cols(),
          "column count (d) must equal q.cols() = " + std::to_string(q.cols()));
  require(v.rows() == k.rows(), function, "v", v.rows(),
          "row count must equal k.rows() = " + std::to_string(k.rows()));
  require(q.rows() == 0 || q.cols() > 0, function, "q", q.cols(),
          "head dimension d must be >= 1 when n > 0");
}

template <typename OutType>
void require_output_shape(const char* function, const OutType& out, Index rows, Index cols) {
  require(out.rows() == rows && out.cols() == cols, function, "out",
          std::to_string(out.rows()) + "x" + std::to_string(out.cols()),
          "shape must be " + std::to_string(rows) + "x" + std::to_string(cols));
}

/// tau: the given scale, or 1/sqrt(d). Throws if the given scale is not finite.
inline double resolve_scale(const char* function, const AttentionOptions& options, Index d) {
  if (options.scale) {
    require(std::isfinite(*options.scale), function, "options.scale", *options.scale,
            "must be finite");
    return *options.scale;
  }
  return d > 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : 1.0;
}

}  // namespace poslsh::detail
