// poslsh: LSH ALiBi attention, the paper's per-sample algorithm, and the fixed-blocks baseline.
//
// Checked (std::invalid_argument naming the argument): the shapes of q, k, v and out (rows of
// out must not overlap), a non-empty set of valid hashes (sigma for fixed_blocks_attention),
// options.scale finite, options.masking valid. Not checked: the values (see core/types.hpp) and
// that out does not overlap q, k or v.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/per_sample.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"
#include "poslsh/detail/tile/types.hpp"
#include "poslsh/lsh/hash.hpp"

namespace poslsh {

/// Per-sample LSH ALiBi attention (the paper's algorithm, Theorem 2.2):
///   T~ = D~^-1 (A o M~) V,  M~ = (1/s) sum_k M(h_k),  A_ij = exp(tau q_i . k_j),
/// i.e. out_i = sum_j c_ij e^{tau q_i.k_j} v_j / sum_j c_ij e^{tau q_i.k_j} with c_ij the
/// number of samples whose blocks hold both i and j (causal: j <= i); not the mean of the s
/// per-sample softmaxes. For each hash h_k and each of its blocks B, plain attention on
/// (Q_B, K_B, V_B), causal inside B when causal, on the tile engine (tiles of 64 x 64 at
/// absolute positions, register-blocked scores and values, fold_block); each sample gives
/// every query row a partial result (M, l, acc): the maximum of its scores, l = sum_j
/// e^{x_ij - M} and acc = sum_j e^{x_ij - M} v_j over its block. The s partial results of a
/// row are merged pairwise in a fixed binary tree over the samples (two partials: M'' =
/// max(M, M'), l'' = e^{M - M''} l + e^{M' - M''} l', acc'' likewise), and out = acc / l: the
/// rounding error is that of one sample's block attention plus log2 s merges, not growing
/// with s. Cost sum_k sum_B |B|^2 d; extra memory O(64 d_v log2 s) per thread. Query tiles of
/// 64 rows run in parallel (OpenMP), each row on one thread in a fixed order, so the output is
/// bitwise the same for any thread count. Queries at an offset (options.query_offset = p0;
/// unset: L - m): Q is m x d at positions p0 .. p0 + m - 1 over K, V of L rows, blocks and
/// masks at the absolute positions, and only those rows are computed. A row's arithmetic
/// depends only on its position, the keys it sees and the hashes, not on L or on the other
/// rows: row r is bitwise row p0 + r of the kernel on all L positions, and causal chunked
/// prefill with the keys so far (K = the first p0 + m positions, where the last block of a
/// hash is cut at p0 + m) gives bitwise the rows of one prefill of the whole prompt;
/// bidirectional chunks see all L keys and are bitwise too.
/// Scalars: Q in Scalar, K and V in KVScalar, out in OutScalar (float, double, Eigen::half or
/// Eigen::bfloat16; double only with double). Computed in C = compute_scalar_t<Scalar,
/// KVScalar, OutScalar>: half-precision tiles of 64 rows are widened to float as they are
/// read, so the result is bitwise that of the float kernel on the widened inputs (except on a
/// CPU matrix unit: bfloat16 Q, K, V with options.precision = Precision::matrix_units, the
/// default; core/matrix_units.hpp), and a half-precision output is that result rounded once. Throws
/// std::invalid_argument naming a bad argument (shapes, empty or invalid hashes, non-finite scale,
/// offset).
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void lsh_attention_per_sample(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                              KeyValueRef<KVScalar> v, const HashSet& hashes,
                              OutputRef<OutScalar> out, const AttentionOptions& options = {}) {
  using C = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  constexpr const char* function = "lsh_attention_per_sample";
  const Index p0 = detail::require_lsh_arguments(function, q, k, v, hashes, out, options);
  const auto tau = static_cast<C>(detail::resolve_scale(function, options, q.cols()));
  if (q.rows() == 0) return;
  const bool causal = options.masking == Masking::causal;
  detail::per_sample_rows<Scalar, KVScalar, OutScalar, C>(q, k, v, hashes, tau, causal, p0,
                                                          options.precision, out);
}

/// Returning form of lsh_attention_per_sample (output in Scalar, the type of Q).
template <typename Scalar, typename KVScalar = Scalar>
RowMatrix<Scalar> lsh_attention_per_sample(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                                           KeyValueRef<KVScalar> v, const HashSet& hashes,
                                           const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  lsh_attention_per_sample<Scalar, KVScalar, Scalar>(q, k, v, hashes, out, options);
  return out;
}

/// The paper's fixed-blocks baseline: per-sample attention with the single deterministic hash
/// fixed_blocks_hash(sigma) (blocks of width 2 sigma from position 0), i.e. plain attention
/// inside consecutive blocks of 2 sigma tokens: out_i = sum_{j in B(i)} e^{tau q_i.k_j} v_j /
/// sum_{j in B(i)} e^{tau q_i.k_j} (causal: j <= i). Scalars as lsh_attention_per_sample.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void fixed_blocks_attention(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                            KeyValueRef<KVScalar> v, double sigma, OutputRef<OutScalar> out,
                            const AttentionOptions& options = {}) {
  lsh_attention_per_sample<Scalar, KVScalar, OutScalar>(q, k, v, HashSet{fixed_blocks_hash(sigma)},
                                                        out, options);
}

/// Returning form of fixed_blocks_attention (output in Scalar, the type of Q).
template <typename Scalar, typename KVScalar = Scalar>
RowMatrix<Scalar> fixed_blocks_attention(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                                         KeyValueRef<KVScalar> v, double sigma,
                                         const AttentionOptions& options = {}) {
  return lsh_attention_per_sample<Scalar, KVScalar>(q, k, v, HashSet{fixed_blocks_hash(sigma)},
                                                    options);
}

}  // namespace poslsh
