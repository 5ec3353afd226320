// poslsh: fused, count-weighted LSH ALiBi attention: the per-sample estimator with every
// (query, key) pair evaluated once.
#pragma once

#include <algorithm>
#include <utility>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/detail/tile/count_bias.hpp"
#include "poslsh/detail/tile/count_tile.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"

namespace poslsh {

namespace detail {

/// Rows at positions [i0, i0 + rows) of the fused estimator over the k.rows() positions,
/// written to out.middleRows(i0 - query_offset, rows); row r of q (and of out) is the query at
/// position query_offset + r. Computed in Scalar; Q (QScalar) and K, V (KVScalar) may be
/// stored in a half-precision type, out in any scalar type, their products on the unit
/// `precision` selects (engine_rows); with lse (not null), lse[r] for out row
/// i0 - query_offset + r (TileEngine::run). The counts come from
/// `hashes`: a HashSet, or stored partitions (PartitionSet) on the k.rows() positions.
template <typename Scalar, typename QScalar = Scalar, typename KVScalar = QScalar, typename Counts,
          typename OutType>
void fused_tile(const ConstMatrixRef<nondeduced_t<QScalar>>& q, const KeyValueRef<KVScalar>& k,
                const KeyValueRef<KVScalar>& v, const Counts& hashes, Scalar tau, bool causal,
                Index i0, Index rows, OutType& out, TileWorkspace<Scalar>& work, Index query_offset,
                Precision precision, Scalar* lse = nullptr) {
  CountBias<Scalar> bias(hashes, k.rows(), causal, work.counts, work.count_tile);
  engine_rows<Scalar, QScalar, KVScalar>(q, k, v, static_cast<double>(tau), bias, work.buffers,
                                         query_offset, precision, i0, i0 + rows,
                                         out.middleRows(i0 - query_offset, rows), lse);
}

/// The body of lsh_attention_fused after its checks: the q.rows() queries at positions p0 ..,
/// query tiles in parallel, the counts from `counts` (a HashSet or stored partitions).
template <typename Scalar, typename KVScalar, typename OutScalar, typename Counts>
void fused_attention(const char* function, ConstMatrixRef<Scalar> q, ConstMatrixRef<KVScalar> k,
                     ConstMatrixRef<KVScalar> v, const Counts& counts, MatrixRef<OutScalar> out,
                     const AttentionOptions& options, Index p0) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  const Index m = q.rows();
  if (m == 0) return;
  const auto tau = static_cast<Compute>(resolve_scale(function, options, q.cols()));
  const bool causal = options.masking == Masking::causal;
  parallel_query_tiles<Compute>(1, p0, p0 + m, JobOrder::head_runs, output_bytes(out),
                                [&](Index, Index i0, Index rows, TileWorkspace<Compute>& work) {
                                  fused_tile<Compute, Scalar, KVScalar>(q, k, v, counts, tau,
                                                                        causal, i0, rows, out, work,
                                                                        p0, options.precision);
                                });
}

/// sum_i |[lo_i, hi_i)| over positions 0 .. n - 1, the key intervals of `counts` (a HashSet or
/// stored partitions, already checked) built query tile by query tile as the kernel builds them.
template <typename Counts>
long long fused_pair_count(const Counts& counts_source, Index n, Masking masking) {
  long long pairs = 0;
  TileCounts counts;
  for (Index i0 = 0; i0 < n; i0 += tile_query_rows) {
    const Index rows = std::min(tile_query_rows, n - i0);
    counts.build(counts_source, i0, rows, n, masking == Masking::causal);
    for (Index r = 0; r < rows; ++r) {
      const auto index = static_cast<std::size_t>(r);
      pairs += counts.hi[index] - counts.lo[index];
    }
  }
  return pairs;
}

}  // namespace detail

/// Fused, count-weighted LSH ALiBi attention: the same estimator as lsh_attention_per_sample,
///   out_i = sum_j c_ij e^{tau q_i.k_j - M_i} v_j / sum_j c_ij e^{tau q_i.k_j - M_i},
///   c_ij = #{k : bin_k(i) = bin_k(j)} (causal: j <= i),
/// with each pair of c_ij > 0 evaluated once. `samples` is a HashSet, or stored partitions
/// (PartitionSet, attention/partition.hpp: any blocks, including Sampler::poisson's cuts) with
/// c_ij = #{k : i and j share a block of partition k}. The keys with c_ij > 0 form one interval
/// per query; queries are taken in tiles of 64 whose key band is cut in tiles of 64, scored by
/// register-blocked packet kernels only where some query's interval reaches, weighted by the
/// count tile (built from the blocks by difference arrays; for partitions each query tile finds
/// its blocks by binary search on every sample's edges, O(s log(n / sigma)) per tile) inside an
/// online softmax whose running maximum is over entries of non-zero weight. Extra memory
/// O(tile) per thread. Tiles run in parallel (OpenMP) and write disjoint rows: bitwise the same
/// output for any thread count; partitions = partition_set(hashes, k.rows()) give bitwise the
/// output of the hash set. Queries at an offset (options.query_offset = p0; unset: L - m): Q is
/// m x d at positions p0 .. p0 + m - 1 over K, V of L rows, c_{p0+r, j} read at the absolute
/// positions (causal: j <= p0 + r), and row r is bitwise row p0 + r of the kernel on all L
/// positions (chunked prefill, multi-token decode). Throws std::invalid_argument naming a bad
/// argument (for partitions also as validate_partition_set, and 'partitions.n' unless it
/// equals k.rows()).
/// Scalar types: Q is Scalar, K and V KVScalar, out OutScalar (each float, double,
/// Eigen::half or Eigen::bfloat16; KVScalar and OutScalar default to Scalar and are not
/// deduced); computed in compute_scalar_t<Scalar, KVScalar, OutScalar>: half-precision inputs
/// widened exactly to float as they are loaded, scores, counts, softmax and sums in float, a
/// half-precision output the float result rounded once. Bitwise the float kernel's output on
/// the widened inputs, rounded once to OutScalar, except on a CPU matrix unit (bfloat16 Q, K, V
/// with options.precision = Precision::matrix_units, the default: core/matrix_units.hpp), where
/// the products are bfloat16 and the probabilities rounded to bfloat16 before they weight V.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar,
          typename Samples = HashSet, typename = detail::lsh_samples_t<Samples>>
void lsh_attention_fused(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k, KeyValueRef<KVScalar> v,
                         const Samples& samples, OutputRef<OutScalar> out,
                         const AttentionOptions& options = {}) {
  constexpr const char* function = "lsh_attention_fused";
  const Index p0 = detail::require_lsh_arguments(function, q, k, v, samples, out, options);
  detail::fused_attention<Scalar, KVScalar, OutScalar>(function, q, k, v, samples, out, options,
                                                       p0);
}

/// Returning form of lsh_attention_fused (the output in Q's scalar type).
template <typename Scalar, typename KVScalar = Scalar, typename Samples = HashSet,
          typename = detail::lsh_samples_t<Samples>>
RowMatrix<Scalar> lsh_attention_fused(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                                      KeyValueRef<KVScalar> v, const Samples& samples,
                                      const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  lsh_attention_fused<Scalar, KVScalar, Scalar>(q, k, v, samples, out, options);
  return out;
}

/// Number of (query, key) pairs with c_ij > 0 (causal: j <= i), i.e. the pairs the fused
/// kernel weights: sum_i |[lo_i, hi_i)|. O(n s) time. For cost models and benchmarks.
inline long long lsh_fused_pair_count(const HashSet& hashes, Index n, Masking masking) {
  detail::require_size(n, "lsh_fused_pair_count", "n");
  validate_hashes(hashes, "lsh_fused_pair_count");
  return detail::fused_pair_count(hashes, n, masking);
}

}  // namespace poslsh
