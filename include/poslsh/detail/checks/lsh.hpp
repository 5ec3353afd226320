// poslsh internals: argument checks shared by the LSH kernels.
#pragma once

#include <string>
#include <type_traits>

#include "poslsh/core/hash.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/checks/attention.hpp"

namespace poslsh::detail {

/// Enables an LSH kernel for its source of samples: a HashSet, or stored partitions
/// (PartitionSet).
template <typename Samples>
using lsh_samples_t =
    std::enable_if_t<std::is_same_v<Samples, HashSet> || std::is_same_v<Samples, PartitionSet>>;

/// The samples of an LSH kernel: a non-empty valid hash set (validate_hashes)...
inline void require_samples(const char* function, const HashSet& hashes, Index) {
  validate_hashes(hashes, function);
}

/// ...or valid partitions (validate_partition_set) of the `keys` key positions.
inline void require_samples(const char* function, const PartitionSet& partitions, Index keys) {
  validate_partition_set(partitions, function);
  require(partitions.n == keys, function, "partitions.n", partitions.n,
          "must equal k.rows() (the partitions cut the key positions)");
}

/// Self-attention shapes (K, V have n rows), output n x d_v, and valid samples
/// (require_samples) on the n positions.
template <typename QType, typename KType, typename VType, typename Samples, typename OutType>
void require_lsh_arguments(const char* function, const QType& q, const KType& k, const VType& v,
                           const Samples& samples, const OutType& out) {
  require_qkv_shapes(function, q, k, v);
  require_self_attention(function, q, k);
  require_output_shape(function, out, q.rows(), v.cols());
  require_samples(function, samples, k.rows());
}

/// The same for queries at an offset: Q (m x d) at positions p0 .. p0 + m - 1 over K, V of
/// L rows (resolve_query_offset), output m x d_v, samples on the L key positions; returns p0.
template <typename QType, typename KType, typename VType, typename Samples, typename OutType>
Index require_lsh_arguments(const char* function, const QType& q, const KType& k, const VType& v,
                            const Samples& samples, const OutType& out,
                            const AttentionOptions& options) {
  require_qkv_shapes(function, q, k, v);
  const Index p0 = resolve_query_offset(function, options, q, k);
  require_output_shape(function, out, q.rows(), v.cols());
  require_samples(function, samples, k.rows());
  return p0;
}

}  // namespace poslsh::detail
