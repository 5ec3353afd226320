// poslsh: exact ALiBi attention, tiled and streaming (FlashAttention-style): the honest exact
// competitor of the LSH kernels, O(n^2 d) time and O(tile (d + d_v)) extra memory.
#pragma once

#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/exact.hpp"
#include "poslsh/detail/tile/alibi_bias.hpp"
#include "poslsh/types.hpp"

namespace poslsh {

/// Query rows per tile of the exact tiled and banded kernels. Tiles are aligned to multiples
/// of it from row 0; a row range that starts and ends on multiples of it costs no extra work.
inline constexpr Index tiled_query_tile = detail::tile_query_rows;

/// Rows [row_begin, row_end) of the exact ALiBi attention
///   T* = softmax(tau Q K^T - |i-j| / sigma) V   (causal: keys j <= i),
/// written to `out_rows` ((row_end - row_begin) x d_v). Q and K are n x d, V is n x d_v; all
/// n keys are used. Single-threaded; meant for splitting one head's queries across threads.
/// Each row's result depends on the row alone: any split of [0, n) into ranges gives bitwise
/// the output of alibi_attention_tiled. Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void alibi_attention_tiled_rows(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                ConstMatrixRef<Scalar> v, double sigma, Index row_begin,
                                Index row_end, MatrixRef<Scalar> out_rows,
                                const AttentionOptions& options = {}) {
  constexpr const char* function = "alibi_attention_tiled_rows";
  detail::require_exact_arguments<Scalar>(function, q, k, v, sigma, row_begin, row_end, out_rows);
  const double tau = detail::resolve_scale(function, options, q.cols());
  if (row_begin == row_end) return;
  const Index n = q.rows();
  const detail::ExactWindow window{options.masking == Masking::causal ? 0 : -n, n};
  detail::exact_alibi_rows<Scalar>(q, k, v, sigma, tau, window, row_begin, row_end, out_rows);
}

/// Exact ALiBi attention T* = softmax(tau Q K^T - |i-j| / sigma) V (row-wise softmax; the
/// causal form keeps j <= i), i.e. D^-1 (A o L*) V, computed without any n x n matrix:
/// query tiles of tiled_query_tile rows times key tiles of 64, scores by register-blocked
/// packet kernels, the ALiBi bias from the integer distance on the fly, an online softmax
/// (running maximum over kept entries, running sum, accumulator) per query row, causal key
/// tiles above the diagonal skipped. Q is n x d (d >= 1 if n > 0), K n x d, V n x d_v, `out`
/// n x d_v; any row strides (e.g. heads of an [n, H, d] buffer). Single-threaded: run heads
/// (or row ranges, alibi_attention_tiled_rows) in parallel. Matches
/// alibi_attention_reference to rounding. Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void alibi_attention_tiled(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                           ConstMatrixRef<Scalar> v, double sigma, MatrixRef<Scalar> out,
                           const AttentionOptions& options = {}) {
  constexpr const char* function = "alibi_attention_tiled";
  detail::require_exact_arguments<Scalar>(function, q, k, v, sigma, 0, q.rows(), out);
  const double tau = detail::resolve_scale(function, options, q.cols());
  const Index n = q.rows();
  if (n == 0) return;
  const detail::ExactWindow window{options.masking == Masking::causal ? 0 : -n, n};
  detail::exact_alibi_rows<Scalar>(q, k, v, sigma, tau, window, 0, n, out);
}

/// Returning form of alibi_attention_tiled.
template <typename Scalar>
RowMatrix<Scalar> alibi_attention_tiled(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                        ConstMatrixRef<Scalar> v, double sigma,
                                        const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  alibi_attention_tiled<Scalar>(q, k, v, sigma, out, options);
  return out;
}

}  // namespace poslsh
