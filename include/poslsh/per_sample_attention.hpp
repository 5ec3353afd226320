// poslsh: LSH ALiBi attention, the paper's per-sample algorithm, and the fixed-blocks baseline.
//
// Checked (std::invalid_argument naming the argument): the shapes of q, k, v and out (rows of
// out must not overlap), a non-empty set of valid hashes (sigma for fixed_blocks_attention),
// options.scale finite, options.masking valid. Not checked: the values (see types.hpp) and
// that out does not overlap q, k or v.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/detail/streaming_softmax.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/types.hpp"

namespace poslsh {

namespace detail {

/// Query and key tile edge of the per-sample kernel's block attention.
inline constexpr Index per_sample_tile = 128;

/// Plain attention of block [begin, end) (no positional bias; causal inside the block when
/// causal), folded into `state` tile by tile with weight 1 per visible pair. Query position i
/// is row i - base of q and of the state; only the query tiles meeting positions
/// [rows_first, rows_last) are computed (each whole, as when all are). Half-precision tiles
/// are widened to the compute scalar C in the scratch's buffers first; the arithmetic is then
/// that of C views holding the widened values.
template <typename Scalar, typename KVScalar = Scalar,
          typename C = compute_scalar_t<Scalar, KVScalar>>
void fold_block(ConstMatrixRef<Scalar> q, ConstMatrixRef<nondeduced_t<KVScalar>> k,
                ConstMatrixRef<nondeduced_t<KVScalar>> v, C tau, bool causal, Index begin,
                Index end, StreamingSoftmax<C>& state, LogitScratch<C>& scratch, Index base = 0,
                Index rows_first = 0, Index rows_last = std::numeric_limits<Index>::max()) {
  for (Index i0 = begin; i0 < end; i0 += per_sample_tile) {
    const Index rows = std::min(per_sample_tile, end - i0);
    if (i0 + rows <= rows_first || i0 >= rows_last) continue;
    const auto q_tile = widened_rows<C>(q, i0 - base, rows, scratch.q_wide);
    const Index key_end = causal ? i0 + rows : end;
    for (Index j0 = begin; j0 < key_end; j0 += per_sample_tile) {
      const Index cols = std::min(per_sample_tile, key_end - j0);
      scratch.shape(rows, cols);
      auto logits = scratch.logits();
      logits.setZero();
      if (causal && j0 + cols > i0) {
        // Key j0 + c is hidden from rows r with i0 + r < j0 + c.
        for (Index c = 0; c < cols; ++c) {
          logits.col(c)
              .head(std::clamp<Index>(j0 + c - i0, 0, rows))
              .setConstant(-std::numeric_limits<C>::infinity());
        }
      }
      logits.noalias() += (tau * q_tile) * widened_rows<C>(k, j0, cols, scratch.k_wide).transpose();
      state.update(i0 - base, scratch, widened_rows<C>(v, j0, cols, scratch.v_wide));
    }
  }
}

/// Rows at positions [p0, p0 + q.rows()) of the per-sample estimator over the k.rows()
/// positions: the query tiles holding them are computed whole, on a copy of their rows (in the
/// compute scalar C) with zeros at the positions outside q, and a state whose first row is
/// 64-aligned like the state of all positions, so every row gets bitwise the arithmetic of the
/// full call.
template <typename Scalar, typename KVScalar, typename OutScalar, typename C>
void per_sample_offset_rows(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<KVScalar>& k,
                            const ConstMatrixRef<KVScalar>& v, const HashSet& hashes, C tau,
                            bool causal, Index p0, MatrixRef<OutScalar>& out) {
  constexpr Index align = 64;
  const Index m = q.rows(), n = k.rows();
  const Index base = std::max<Index>(0, p0 - per_sample_tile) / align * align;
  const Index end = std::min(n, p0 + m + per_sample_tile);
  RowMatrix<C> rows = RowMatrix<C>::Zero(end - base, q.cols());
  rows.middleRows(p0 - base, m) = q.template cast<C>();
  const ConstMatrixRef<C> q_rows(rows);
  StreamingSoftmax<C> state;
  state.reset(end - base, v.cols());
  for (const BinHash& hash : hashes) {
    const std::vector<Index> boundaries = block_boundaries(hash, n);
    const auto blocks = static_cast<long>(boundaries.size() - 1);
#pragma omp parallel
    {
      LogitScratch<C> scratch;
#pragma omp for schedule(dynamic, 1)
      for (long r = 0; r < blocks; ++r) {
        const auto index = static_cast<std::size_t>(r);
        const Index begin = boundaries[index], block_end = boundaries[index + 1];
        if (block_end <= p0 || begin >= p0 + m) continue;
        fold_block<C, KVScalar>(q_rows, k, v, tau, causal, begin, block_end, state, scratch, base,
                                p0, p0 + m);
      }
    }
  }
  state.finish(p0 - base, out);
}

}  // namespace detail

/// Per-sample LSH ALiBi attention (the paper's algorithm, Theorem 2.2). For each hash h_k and
/// each of its blocks B, plain attention on (Q_B, K_B, V_B), causal inside B when causal; the
/// numerators and denominators of each query are accumulated across samples with one running
/// maximum, giving
///   T~ = D~^-1 (A o M~) V,  M~ = (1/s) sum_k M(h_k),  A_ij = exp(tau q_i . k_j),
/// (not the mean of the s per-sample softmaxes). Cost sum_k sum_B |B|^2 d; extra memory
/// O(n d_v). Blocks of one sample run in parallel (OpenMP) on disjoint rows, so the output is
/// bitwise the same for any thread count. Queries at an offset (options.query_offset = p0;
/// unset: L - m): Q is m x d at positions p0 .. p0 + m - 1 over K, V of L rows, blocks and
/// masks at the absolute positions, and row r is bitwise row p0 + r of the kernel on all L
/// positions (the query tiles holding the rows are computed whole: extra cost up to two tiles
/// of 128 rows per block). Causal chunked prefill with the keys so far (K = the first p0 + m
/// positions) therefore gives the rows of this kernel on those p0 + m positions: equal to the
/// rows of a prefill of a longer prompt to rounding, not bitwise, since a causal row's tile
/// ends where its block is cut by the sequence end (bidirectional chunks see all L keys and
/// are bitwise the rows of one prefill).
/// Scalars: Q in Scalar, K and V in KVScalar, out in OutScalar (float, double, Eigen::half or
/// Eigen::bfloat16; double only with double). Computed in C = compute_scalar_t<Scalar,
/// KVScalar, OutScalar>: half-precision tiles of 128 rows are widened to float as they are
/// read, so the result is bitwise that of the float kernel on the widened inputs, and a
/// half-precision output is that float result rounded once. Throws std::invalid_argument
/// naming a bad argument (shapes, empty or invalid hashes, non-finite scale, offset).
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void lsh_attention_per_sample(ConstMatrixRef<Scalar> q,
                              ConstMatrixRef<detail::nondeduced_t<KVScalar>> k,
                              ConstMatrixRef<detail::nondeduced_t<KVScalar>> v,
                              const HashSet& hashes, MatrixRef<detail::nondeduced_t<OutScalar>> out,
                              const AttentionOptions& options = {}) {
  using C = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  constexpr const char* function = "lsh_attention_per_sample";
  const Index p0 = detail::require_lsh_arguments(function, q, k, v, hashes, out, options);
  const auto tau = static_cast<C>(detail::resolve_scale(function, options, q.cols()));
  const Index n = q.rows();
  if (n == 0) return;
  const bool causal = options.masking == Masking::causal;
  if (p0 != 0 || n != k.rows()) {
    detail::per_sample_offset_rows<Scalar, KVScalar, OutScalar, C>(q, k, v, hashes, tau, causal, p0,
                                                                   out);
    return;
  }
  detail::StreamingSoftmax<C> state;
  state.reset(n, v.cols());
  for (const BinHash& hash : hashes) {
    const std::vector<Index> boundaries = block_boundaries(hash, n);
    const auto blocks = static_cast<long>(boundaries.size() - 1);
#pragma omp parallel
    {
      detail::LogitScratch<C> scratch;
#pragma omp for schedule(dynamic, 1)
      for (long r = 0; r < blocks; ++r) {
        const auto index = static_cast<std::size_t>(r);
        detail::fold_block<Scalar, KVScalar>(q, k, v, tau, causal, boundaries[index],
                                             boundaries[index + 1], state, scratch);
      }
    }
  }
  state.finish(0, out);
}

/// Returning form of lsh_attention_per_sample (output in Scalar, the type of Q).
template <typename Scalar, typename KVScalar = Scalar>
RowMatrix<Scalar> lsh_attention_per_sample(ConstMatrixRef<Scalar> q,
                                           ConstMatrixRef<detail::nondeduced_t<KVScalar>> k,
                                           ConstMatrixRef<detail::nondeduced_t<KVScalar>> v,
                                           const HashSet& hashes,
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
void fixed_blocks_attention(ConstMatrixRef<Scalar> q,
                            ConstMatrixRef<detail::nondeduced_t<KVScalar>> k,
                            ConstMatrixRef<detail::nondeduced_t<KVScalar>> v, double sigma,
                            MatrixRef<detail::nondeduced_t<OutScalar>> out,
                            const AttentionOptions& options = {}) {
  lsh_attention_per_sample<Scalar, KVScalar, OutScalar>(q, k, v, HashSet{fixed_blocks_hash(sigma)},
                                                        out, options);
}

/// Returning form of fixed_blocks_attention (output in Scalar, the type of Q).
template <typename Scalar, typename KVScalar = Scalar>
RowMatrix<Scalar> fixed_blocks_attention(ConstMatrixRef<Scalar> q,
                                         ConstMatrixRef<detail::nondeduced_t<KVScalar>> k,
                                         ConstMatrixRef<detail::nondeduced_t<KVScalar>> v,
                                         double sigma, const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  fixed_blocks_attention<Scalar, KVScalar, Scalar>(q, k, v, sigma, out, options);
  return out;
}

}  // namespace poslsh
