// poslsh internals: argument checks shared by the LSH kernels.
#pragma once

#include <string>

#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/lsh/hash.hpp"

namespace poslsh::detail {

/// Self-attention shapes (K, V have n rows), output n x d_v, and a non-empty valid hash set.
template <typename QType, typename KType, typename VType, typename OutType>
void require_lsh_arguments(const char* function, const QType& q, const KType& k, const VType& v,
                           const HashSet& hashes, const OutType& out) {
  require_qkv_shapes(function, q, k, v);
  require_self_attention(function, q, k);
  require_output_shape(function, out, q.rows(), v.cols());
  validate_hashes(hashes, function);
}

/// The same for queries at an offset: Q (m x d) at positions p0 .. p0 + m - 1 over K, V of
/// L rows (resolve_query_offset), output m x d_v; returns p0.
template <typename QType, typename KType, typename VType, typename OutType>
Index require_lsh_arguments(const char* function, const QType& q, const KType& k, const VType& v,
                            const HashSet& hashes, const OutType& out,
                            const AttentionOptions& options) {
  require_qkv_shapes(function, q, k, v);
  const Index p0 = resolve_query_offset(function, options, q, k);
  require_output_shape(function, out, q.rows(), v.cols());
  validate_hashes(hashes, function);
  return p0;
}

}  // namespace poslsh::detail
