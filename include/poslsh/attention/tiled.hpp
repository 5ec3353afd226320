// poslsh: exact ALiBi attention, tiled and streaming (FlashAttention-style): the honest exact
// competitor of the LSH kernels, O(n^2 d) time at most and O(tile (d + d_v)) extra memory (on a
// bfloat16 matrix unit, also one head's keys and values packed for the unit, at most 64 MiB a
// thread, each key tile packed once instead of once per query tile).
//
// Scalar types (every kernel here and in attention/banded.hpp, attention/fused.hpp): Q is
// ConstMatrixRef<Scalar>, K and V ConstMatrixRef<KVScalar>, the output MatrixRef<OutScalar>,
// each float, double, Eigen::half or Eigen::bfloat16; KVScalar and OutScalar default to Scalar
// and are never deduced (give them to mix types: kernel<float, Eigen::bfloat16, float>(...) for
// float queries over a bfloat16 KV cache). The kernels compute in
// compute_scalar_t<Scalar, KVScalar, OutScalar> (double only when all three are double):
// half-precision values are widened exactly to float as they are loaded, scores, the bias
// (formed from the integer distance, exact below 2^24), the online softmax and the value sums
// are float, and an output in a half-precision type is the float result rounded once (round to
// nearest even). The result is bitwise the float kernel's on float matrices holding the widened
// inputs, rounded once to OutScalar; except on a CPU matrix unit (bfloat16 Q, K and V with
// options.precision = Precision::matrix_units, the default; core/matrix_units.hpp), where the
// two products of each tile take bfloat16 operands (the probabilities rounded to bfloat16).
#pragma once

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/exact.hpp"
#include "poslsh/detail/tile/alibi_bias.hpp"

namespace poslsh {

/// Query rows per tile of the exact tiled and banded kernels. Tiles are aligned to multiples
/// of it from row 0; a row range that starts and ends on multiples of it costs no extra work.
inline constexpr Index tiled_query_tile = detail::tile_query_rows;

namespace detail {

/// The body of the exact kernels' calls (tiled, banded; whole or row ranges): checks the views,
/// sigma, the rows and the offset, then computes rows [row_begin, row_end) of q over the keys
/// in window(L) into out (L = k.rows()).
template <typename Scalar, typename KVScalar, typename OutScalar, typename Window>
void exact_attention_call(const char* function, const ConstMatrixRef<Scalar>& q,
                          const ConstMatrixRef<KVScalar>& k, const ConstMatrixRef<KVScalar>& v,
                          double sigma, Index row_begin, Index row_end, MatrixRef<OutScalar> out,
                          const AttentionOptions& options, Window window) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  const Index p0 = require_exact_views(function, q, k, v, sigma, row_begin, row_end, out, options);
  const double tau = resolve_scale(function, options, q.cols());
  if (row_begin == row_end) return;
  exact_alibi_rows<Compute, Scalar, KVScalar>(q, k, v, sigma, tau, window(k.rows()), p0 + row_begin,
                                              p0 + row_end, out, p0, options.precision);
}

/// The window of exact attention over every one of `keys` keys: lo <= i - j <= hi with
/// hi = keys and lo = 0 (causal) or -keys (bidirectional). The one rule of the exact windows
/// (banded_window narrows it to the band).
inline ExactWindow full_window(Index keys, Masking masking) {
  return {masking == Masking::causal ? 0 : -keys, keys};
}

}  // namespace detail

/// Rows [row_begin, row_end) of q of the exact ALiBi attention
///   T*_r = softmax_j(tau q_r.k_j - |p0 + r - j| / sigma) V   (causal: keys j <= p0 + r),
/// written to `out_rows` ((row_end - row_begin) x d_v). Q is m x d at positions p0 .. p0 + m - 1
/// (p0 = options.query_offset, unset: L - m), K is L x d, V is L x d_v; self-attention is
/// m = L, p0 = 0. Query tiles in parallel (OpenMP). Each row's result depends on its position
/// alone: any split of the rows into ranges, any chunk of queries holding the row and any
/// thread count give bitwise the output of alibi_attention_tiled.
/// Throws std::invalid_argument naming a bad argument. Scalar types: see the file comment.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void alibi_attention_tiled_rows(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                                KeyValueRef<KVScalar> v, double sigma, Index row_begin,
                                Index row_end, OutputRef<OutScalar> out_rows,
                                const AttentionOptions& options = {}) {
  detail::exact_attention_call<Scalar, KVScalar, OutScalar>(
      "alibi_attention_tiled_rows", q, k, v, sigma, row_begin, row_end, out_rows, options,
      [&](Index keys) { return detail::full_window(keys, options.masking); });
}

/// Exact ALiBi attention T* = softmax(tau Q K^T - |i-j| / sigma) V (row-wise softmax; the
/// causal form keeps j <= i), i.e. D^-1 (A o L*) V, computed without any n x n matrix.
/// With queries at an offset (options.query_offset = p0; unset: L - m, bottom-right aligned)
/// Q is m x d, K is L x d, and row r is T*_r = softmax_j(tau q_r.k_j - |p0 + r - j| / sigma) V
/// (causal: j <= p0 + r), bitwise row p0 + r of the self-attention over the L positions:
/// query tiles of tiled_query_tile rows times key tiles of 64, scores by register-blocked
/// packet kernels, the ALiBi bias from the integer distance on the fly, an online softmax
/// (running maximum over kept entries, running sum, accumulator) per query row, causal key
/// tiles above the diagonal skipped. Q is n x d (d >= 1 if n > 0), K n x d, V n x d_v, `out`
/// n x d_v; any row strides (e.g. heads of an [n, H, d] buffer). Query tiles run in parallel
/// (OpenMP), each row computed by one thread: bitwise the same for any thread count. Keys a row
/// can no longer read are skipped: key j is dropped for row i when the Cauchy-Schwarz bound on
/// its score, |tau q_i| (|k_i| + |k_j|) - |i - j| / sigma below the row's own score, puts its
/// weight under the smallest normal Scalar (detail/tile/alibi_bias.hpp), which steep heads
/// reach after a few hundred positions, so their cost grows as n sigma instead of n^2. Matches
/// alibi_attention_reference to rounding. Throws std::invalid_argument naming a bad argument.
/// Half-precision Q, K, V or output: see the file comment.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void alibi_attention_tiled(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                           KeyValueRef<KVScalar> v, double sigma, OutputRef<OutScalar> out,
                           const AttentionOptions& options = {}) {
  detail::exact_attention_call<Scalar, KVScalar, OutScalar>(
      "alibi_attention_tiled", q, k, v, sigma, 0, q.rows(), out, options,
      [&](Index keys) { return detail::full_window(keys, options.masking); });
}

/// Returning form of alibi_attention_tiled (the output in Q's scalar type).
template <typename Scalar, typename KVScalar = Scalar>
RowMatrix<Scalar> alibi_attention_tiled(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                                        KeyValueRef<KVScalar> v, double sigma,
                                        const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  alibi_attention_tiled<Scalar, KVScalar, Scalar>(q, k, v, sigma, out, options);
  return out;
}

}  // namespace poslsh
