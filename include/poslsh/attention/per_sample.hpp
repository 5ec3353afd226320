// poslsh: LSH ALiBi attention, the paper's per-sample algorithm, and the fixed-blocks baseline.
//
// Checked (std::invalid_argument naming the argument): the shapes of q, k, v and out (rows of
// out must not overlap), a non-empty set of valid hashes (sigma for fixed_blocks_attention),
// options.scale finite, options.masking valid. Not checked: the values (see core/types.hpp) and
// that out does not overlap q, k or v.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/detail/streaming_softmax.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/kernels.hpp"
#include "poslsh/detail/tile/types.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/lsh/partition.hpp"
#include "poslsh/core/types.hpp"

namespace poslsh {

namespace detail {

/// Tile engine policy (detail/tile/engine.hpp) of plain attention inside the block
/// [begin, end) of positions: row i keeps the keys [begin, e_i), e_i = min(i + 1, end)
/// (causal) or end (bidirectional), with x_ij = tau q_i.k_j and weight 1 (no bias). Only the
/// rows of the block are ever stored (EngineState), so rows outside it may compute anything.
template <typename Scalar>
class BlockWindowBias {
  using Packet = TilePacket<Scalar>;
  static constexpr Index Bq = tile_query_rows;

 public:
  BlockWindowBias(Index begin, Index end, bool causal) : begin_(begin), end_(end), causal_(causal) {
    for (Index a = 0; a < Bq; ++a) offsets_(a) = static_cast<Scalar>(a);
  }

  KeyRange query_tile(Index i0) {
    i0_ = i0;
    return {begin_, causal_ ? std::min(end_, i0 + Bq) : end_};
  }

  // The engine only visits keys in [begin, end): a tile is cut only by the causal diagonal.
  KeyTileCut key_tile(Index j0, Index keys, KeyRange rows) {
    j0_ = j0;
    if (!causal_) return KeyTileCut::full;
    if (i0_ + rows.last - 1 < j0) return KeyTileCut::skip;
    return i0_ + rows.first >= j0 + keys - 1 ? KeyTileCut::full : KeyTileCut::masked;
  }

  // Row i0 + a reaches key j0 + b iff j0 + b <= i0 + a (causal); keys [begin, e_i).
  KeyRange rows_reaching(Index b0, Index) const { return {causal_ ? j0_ - i0_ + b0 : 0, Bq}; }
  KeyRange keys_reached(Index, Index a1) const {
    return {begin_ - j0_, (causal_ ? std::min(i0_ + a1, end_) : end_) - j0_};
  }

  /// x = acc (-inf for keys after the row, in cut tiles), p = e^{x - M} (exactly 0 there).
  class Scorer {
   public:
    explicit Scorer(const BlockWindowBias& bias)
        : offsets_(bias.offsets_.data()), first_(bias.j0_ - bias.i0_) {}

    template <bool Masked>
    EIGEN_ALWAYS_INLINE Packet score(const Packet& acc, Index b, Index a) const {
      namespace ei = Eigen::internal;
      if constexpr (!Masked) return acc;
      // Row i0 + a + lane keeps key j0 + b iff a + lane >= j0 - i0 + b (small in a cut tile).
      const Packet keep = ei::pcmp_le(ei::pset1<Packet>(static_cast<Scalar>(first_ + b)),
                                      ei::pload<Packet>(offsets_ + a));
      return ei::pselect(keep, acc, ei::pset1<Packet>(-std::numeric_limits<Scalar>::infinity()));
    }

    template <bool Masked>
    EIGEN_ALWAYS_INLINE Packet weight(const Packet& prob, const Packet& x, Index, Index) const {
      namespace ei = Eigen::internal;
      if constexpr (!Masked) return prob;
      const Packet none = ei::pset1<Packet>(-std::numeric_limits<Scalar>::infinity());
      return ei::pselect(ei::pcmp_eq(x, none), ei::pset1<Packet>(Scalar(0)), prob);
    }

   private:
    const Scalar* offsets_;
    Index first_;
  };

  Scorer scorer() const { return Scorer(*this); }

 private:
  Index begin_, end_;
  bool causal_;
  Eigen::Array<Scalar, Bq, 1> offsets_;
  Index i0_ = 0, j0_ = 0;
};

/// Plain attention of block [begin, end) (no positional bias; causal inside the block when
/// causal), folded into `state` with weight 1 per visible pair by the tile engine
/// (TileEngine::accumulate with BlockWindowBias):
///   M_i <- max(M_i, max_j x_ij),  l_i <- e^{M_i,old - M_i} l_i + sum_j e^{x_ij - M_i},
///   acc_i <- e^{M_i,old - M_i} acc_i + sum_j e^{x_ij - M_i} v_j,  x_ij = tau q_i.k_j,
/// j over the row's keys in the block. Query position i is row i - base of q and of the state,
/// keys are at positions 0 .. k.rows() - 1, and only the positions [rows_first, rows_last) of
/// the block are computed. The engine's tiles sit at absolute positions (multiples of 64), a
/// row's arithmetic depends only on the row, its tile and the keys it sees (in the engine's
/// fixed order), and keys it does not see get probability exactly 0: a row gets bitwise the
/// same update for any base, row range, and (causal) any block end past the row, so causal
/// chunked prefill over the keys so far gives the rows of one prefill. Half-precision Q, K
/// and V are widened to C tile by tile (the arithmetic of C views of the widened values).
template <typename Scalar, typename KVScalar = Scalar,
          typename C = compute_scalar_t<Scalar, KVScalar>>
void fold_block(ConstMatrixRef<Scalar> q, ConstMatrixRef<nondeduced_t<KVScalar>> k,
                ConstMatrixRef<nondeduced_t<KVScalar>> v, C tau, bool causal, Index begin,
                Index end, StreamingSoftmax<C>& state, TileBuffers<C>& buffers, Index base = 0,
                Index rows_first = 0, Index rows_last = std::numeric_limits<Index>::max()) {
  const Index first = std::max(begin, rows_first), last = std::min(end, rows_last);
  if (first >= last) return;
  BlockWindowBias<C> bias(begin, end, causal);
  const EngineState<C> rows{state.running_max.data(), state.running_sum.data(),
                            state.accumulator.data(), state.accumulator.outerStride(), base};
  if constexpr (std::is_same_v<KVScalar, C>) {
    TileEngine<C, BlockWindowBias<C>, ContiguousKV<C>, Scalar> engine(
        q, ContiguousKV<C>(k, v), static_cast<double>(tau), bias, buffers, base);
    engine.accumulate(first, last, rows);
  } else {
    TileEngine<C, BlockWindowBias<C>, WideningKV<C, KVScalar>, Scalar> engine(
        q, WideningKV<C, KVScalar>(k, v, buffers.wide_k, buffers.wide_v), static_cast<double>(tau),
        bias, buffers, base);
    engine.accumulate(first, last, rows);
  }
}

/// fold_block with the calling thread's own tile buffers (the form of the callers that hold
/// a LogitScratch; the scratch is not used).
template <typename Scalar, typename KVScalar = Scalar,
          typename C = compute_scalar_t<Scalar, KVScalar>>
void fold_block(ConstMatrixRef<Scalar> q, ConstMatrixRef<nondeduced_t<KVScalar>> k,
                ConstMatrixRef<nondeduced_t<KVScalar>> v, C tau, bool causal, Index begin,
                Index end, StreamingSoftmax<C>& state, LogitScratch<C>&, Index base = 0,
                Index rows_first = 0, Index rows_last = std::numeric_limits<Index>::max()) {
  thread_local TileBuffers<C> buffers;
  fold_block<Scalar, KVScalar, C>(q, k, v, tau, causal, begin, end, state, buffers, base,
                                  rows_first, rows_last);
}

/// Rows at positions [p0, p0 + q.rows()) of the per-sample estimator over the k.rows()
/// positions, into out: for each hash in turn, the blocks meeting those positions are folded
/// into one state of q.rows() rows (fold_block; the blocks of a hash in parallel, on disjoint
/// rows; the hashes one after the other), then out_r = acc_r / l_r.
template <typename Scalar, typename KVScalar, typename OutScalar, typename C>
void per_sample_rows(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<KVScalar>& k,
                     const ConstMatrixRef<KVScalar>& v, const HashSet& hashes, C tau, bool causal,
                     Index p0, MatrixRef<OutScalar>& out) {
  const Index m = q.rows(), n = k.rows();
  std::vector<std::vector<Index>> boundaries;
  boundaries.reserve(hashes.size());
  for (const BinHash& hash : hashes) boundaries.push_back(block_boundaries(hash, n));
  StreamingSoftmax<C> state;
  state.reset(m, v.cols());
#pragma omp parallel
  {
    TileBuffers<C> buffers;
    for (const std::vector<Index>& edges : boundaries) {
      // The blocks [t_r, t_{r+1}) with t_{r+1} > p0 and t_r < p0 + m.
      const auto first =
          static_cast<long>(std::upper_bound(edges.begin(), edges.end(), p0) - edges.begin() - 1);
      const auto last =
          static_cast<long>(std::lower_bound(edges.begin(), edges.end(), p0 + m) - edges.begin());
#pragma omp for schedule(dynamic, 1)
      for (long r = first; r < last; ++r) {
        const auto index = static_cast<std::size_t>(r);
        fold_block<Scalar, KVScalar, C>(q, k, v, tau, causal, edges[index], edges[index + 1], state,
                                        buffers, p0, p0, p0 + m);
      }
    }
  }
  state.finish(0, out);
}

}  // namespace detail

/// Per-sample LSH ALiBi attention (the paper's algorithm, Theorem 2.2). For each hash h_k and
/// each of its blocks B, plain attention on (Q_B, K_B, V_B), causal inside B when causal; the
/// numerators and denominators of each query are accumulated across samples with one running
/// maximum, giving
///   T~ = D~^-1 (A o M~) V,  M~ = (1/s) sum_k M(h_k),  A_ij = exp(tau q_i . k_j),
/// (not the mean of the s per-sample softmaxes). Each block runs on the tile engine (tiles of
/// 64 x 64 at absolute positions, register-blocked scores and values, fold_block). Cost
/// sum_k sum_B |B|^2 d; extra memory O(n d_v). Blocks of one sample run in parallel (OpenMP)
/// on disjoint rows, so the output is bitwise the same for any thread count. Queries at an
/// offset (options.query_offset = p0; unset: L - m): Q is m x d at positions p0 .. p0 + m - 1
/// over K, V of L rows, blocks and masks at the absolute positions, and only those rows are
/// computed. A row's arithmetic depends only on its position, the keys it sees and the
/// hashes, not on L or on the other rows: row r is bitwise row p0 + r of the kernel on all L
/// positions, and causal chunked prefill with the keys so far (K = the first p0 + m
/// positions, where the last block of a hash is cut at p0 + m) gives bitwise the rows of one
/// prefill of the whole prompt; bidirectional chunks see all L keys and are bitwise too.
/// Scalars: Q in Scalar, K and V in KVScalar, out in OutScalar (float, double, Eigen::half or
/// Eigen::bfloat16; double only with double). Computed in C = compute_scalar_t<Scalar,
/// KVScalar, OutScalar>: half-precision tiles of 64 rows are widened to float as they are
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
  if (q.rows() == 0) return;
  const bool causal = options.masking == Masking::causal;
  detail::per_sample_rows<Scalar, KVScalar, OutScalar, C>(q, k, v, hashes, tau, causal, p0, out);
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
