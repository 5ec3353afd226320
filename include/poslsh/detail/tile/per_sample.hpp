/// \file
/// \brief Internals of the per-sample LSH kernel (attention/per_sample.hpp) that the backward
/// passes and the mean-of-outputs estimator share: plain attention on the blocks of a hash on
/// the tile engine (BlockWindowBias), the samples' partial results merged in a fixed binary tree,
/// and per_sample_rows, the kernel's rows with their lse.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/tile/alibi_bias.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"
#include "poslsh/detail/tile/types.hpp"

namespace poslsh {

namespace detail {

/// Tile engine policy of plain attention inside the block [begin, end) of positions: row i
/// keeps the keys [begin, e_i), e_i = min(i + 1, end) (causal) or end (bidirectional), with
/// x_ij = tau q_i.k_j and weight 1. This is the exact ALiBi policy with slope 0 (AlibiBias
/// with sigma = inf, whose bias |i - j| * 0 adds exactly 0) over the distance window
/// 0 <= i - j (causal) or an unbounded one, with the keys cut to the block. Only the rows of
/// the block are ever stored (EngineState), so rows outside it may compute anything.
template <typename Scalar>
class BlockWindowBias : public AlibiBias<Scalar> {
  using Base = AlibiBias<Scalar>;
  static constexpr Index Bq = tile_query_rows;
  /// A distance bound beyond any two positions (a power of two: exact in every Scalar).
  static constexpr Index unbounded = Index{1} << 40;

 public:
  BlockWindowBias(Index begin, Index end, bool causal)
      : Base(end, std::numeric_limits<double>::infinity(),
             ExactWindow{causal ? 0 : -unbounded, unbounded}),
        begin_(begin),
        end_(end),
        causal_(causal) {}

  KeyRange query_tile(Index i0) {
    Base::query_tile(i0);
    i0_ = i0;
    return {begin_, causal_ ? std::min(end_, i0 + Bq) : end_};
  }

  // The engine only visits keys in [begin, end): the window cuts a tile only at the causal
  // diagonal.
  KeyTileCut key_tile(Index j0, Index keys, KeyRange rows) {
    j0_ = j0;
    return Base::key_tile(j0, keys, rows);
  }

  KeyRange keys_reached(Index, Index a1) const {
    return {begin_ - j0_, (causal_ ? std::min(i0_ + a1, end_) : end_) - j0_};
  }

  /// AlibiBias's scorer, whose bias step (adding exactly 0) is left out of the tiles the
  /// window does not cut: there x = acc.
  class Scorer : public Base::Scorer {
   public:
    explicit Scorer(const BlockWindowBias& bias) : Base::Scorer(bias) {}

    template <bool Masked>
    EIGEN_ALWAYS_INLINE TilePacket<Scalar> score(const TilePacket<Scalar>& acc, Index b,
                                                 Index a) const {
      if constexpr (Masked)
        return Base::Scorer::template score<true>(acc, b, a);
      else
        return acc;
    }
  };

  Scorer scorer() const { return Scorer(*this); }

 private:
  Index begin_, end_;
  bool causal_;
  Index i0_ = 0, j0_ = 0;
};

/// Online-softmax partial results of a range of query rows, for each row r the running
/// maximum M_r, the sum l_r = sum_j e^{x_rj - M_r} and the numerator acc_r = sum_j e^{x_rj -
/// M_r} v_j over the keys folded in so far ((-inf, 0, 0) without keys). The rows of acc are
/// padded to whole 64-byte lines, so every row starts at the same alignment and the row
/// operations below run the same instructions on every row.
template <typename C>
struct SoftmaxPartials {
  Eigen::Array<C, Eigen::Dynamic, 1> max, sum;
  RowMatrix<C> acc;
  Index cols = 0;

  /// Room for `rows` rows of width `value_cols` (contents unspecified).
  void resize(Index rows, Index value_cols) {
    constexpr auto line = static_cast<Index>(64 / sizeof(C));
    cols = value_cols;
    max.resize(rows);
    sum.resize(rows);
    acc.resize(rows, (value_cols + line - 1) / line * line);
  }

  /// Rows [r0, r1) set to (-inf, 0, 0).
  void clear(Index r0, Index r1) {
    max.segment(r0, r1 - r0).setConstant(-std::numeric_limits<C>::infinity());
    sum.segment(r0, r1 - r0).setZero();
    acc.middleRows(r0, r1 - r0).setZero();
  }

  /// The tile engine's view of the rows: row r is the query at position base + r.
  EngineState<C> engine_state(Index base) {
    return {max.data(), sum.data(), acc.data(), acc.outerStride(), base};
  }

  /// Row r of `other` merged into row r, for r in [r0, r1): with M = max(M_r, M'_r),
  ///   l_r <- e^{M_r - M} l_r + e^{M'_r - M} l'_r,
  ///   acc_r <- e^{M_r - M} acc_r + e^{M'_r - M} acc'_r,  M_r <- M
  /// (one of the two factors is 1 and is not applied). A row of `other` without keys
  /// (M'_r = -inf) leaves the row as it is.
  void merge(const SoftmaxPartials& other, Index r0, Index r1) {
    using Row = Eigen::Map<Eigen::Array<C, 1, Eigen::Dynamic>>;
    using ConstRow = Eigen::Map<const Eigen::Array<C, 1, Eigen::Dynamic>>;
    for (Index r = r0; r < r1; ++r) {
      const C theirs = other.max(r);
      if (theirs == -std::numeric_limits<C>::infinity()) continue;
      Row mine_acc(acc.data() + r * acc.outerStride(), cols);
      const ConstRow their_acc(other.acc.data() + r * other.acc.outerStride(), cols);
      if (theirs <= max(r)) {
        const C scale = std::exp(theirs - max(r));
        sum(r) += scale * other.sum(r);
        mine_acc += scale * their_acc;
      } else {
        const C scale = std::exp(max(r) - theirs);  // 0 for a row without keys
        sum(r) = scale * sum(r) + other.sum(r);
        mine_acc = scale * mine_acc + their_acc;
        max(r) = theirs;
      }
    }
  }

  /// out = acc_r / l_r, computed as acc_r * (1 / l_r) and rounded once to out's scalar.
  template <typename OutRow>
  void finish(Index r, OutRow&& out) const {
    using OutScalar = typename std::decay_t<OutRow>::Scalar;
    if (sum(r) == C(0)) {  // a row without keys (keys at an offset)
      out.setZero();
      return;
    }
    const C inverse = C(1) / sum(r);
    const auto row = acc.row(r).head(cols) * inverse;
    if constexpr (std::is_same_v<OutScalar, C>)
      out = row;
    else
      out = row.template cast<OutScalar>();
  }

  /// lse_r = M_r + log l_r (-inf for a row without keys).
  C lse(Index r) const { return max(r) + std::log(sum(r)); }
};

/// Levels of the pairwise merge of s samples: floor(log2 s) + 1.
inline std::size_t merge_levels(std::size_t samples) {
  std::size_t levels = 1;
  while ((samples >> levels) != 0) ++levels;
  return levels;
}

/// The level that sample k (counted from 0) of a pairwise merge ends at: the number of
/// trailing one bits of k. The samples before k hold the levels of the one bits of k (a
/// binary counter); sample k is merged with levels 0 .. t - 1 (of 1, 1, 2, .., 2^(t-1)
/// samples, in that order) into level t, of 2^t samples. After s samples the levels of the
/// one bits of s are left.
inline std::size_t merge_level(std::size_t sample) {
  std::size_t level = 0;
  while (((sample >> level) & 1U) != 0) ++level;
  return level;
}

/// The lowest one bit of s > 0: the level the others left after s samples are merged into.
inline std::size_t lowest_level(std::size_t samples) {
  std::size_t level = 0;
  while (((samples >> level) & 1U) == 0) ++level;
  return level;
}

/// Plain attention of block [begin, end) (no positional bias; causal inside the block when
/// causal), folded into the rows `state` by the tile engine (TileEngine::accumulate with
/// BlockWindowBias):
///   M_i <- max(M_i, max_j x_ij),  l_i <- e^{M_i,old - M_i} l_i + sum_j e^{x_ij - M_i},
///   acc_i <- e^{M_i,old - M_i} acc_i + sum_j e^{x_ij - M_i} v_j,  x_ij = tau q_i.k_j,
/// j over the row's keys in the block. Query position i is row i - state.base of q and of the
/// state, keys are at positions key_offset .., and only the positions [rows_first,
/// rows_last) of the block are computed. The engine's tiles sit at absolute positions
/// (multiples of 64), a row's arithmetic depends only on the row, its tile and the keys it
/// sees (in the engine's fixed order), and keys it does not see get probability exactly 0: a
/// row gets bitwise the same update for any base, row range, and (causal) any block end past
/// the row. Half-precision Q, K and V are multiplied on the unit `precision` selects
/// (with_row_source_engine, AMX on the tile layer AmxTiles): widened to C tile by tile (the
/// arithmetic of C views of the widened values), or bfloat16 products on AVX512-BF16. Out of
/// line: the engine's kernels compile in this function, not in the callers' loops. The keys are
/// those of the row source `rows` (K and V matrices: StridedRows; a head of a paged cache:
/// PagedRows).
template <typename Scalar, typename Rows,
          typename C = compute_scalar_t<Scalar, typename Rows::storage>,
          template <typename> class AmxTiles = AmxNativeTiles>
EIGEN_DONT_INLINE void fold_block(ConstMatrixRef<Scalar> q, const Rows& rows, C tau, bool causal,
                                  Index begin, Index end, const EngineState<C>& state,
                                  TileBuffers<C>& buffers, Precision precision,
                                  Index rows_first = 0,
                                  Index rows_last = std::numeric_limits<Index>::max(),
                                  Index key_offset = 0) {
  const Index first = std::max(begin, rows_first), last = std::min(end, rows_last);
  if (first >= last) return;
  BlockWindowBias<C> bias(begin, end, causal);
  with_row_source_engine<C, Scalar, AmxTiles>(
      q, rows, static_cast<double>(tau), bias, buffers, TilePositions(state.base, key_offset),
      precision, [&](auto& engine) { engine.accumulate(first, last, state); });
}

/// fold_block over K and V in two row-strided matrices.
template <typename Scalar, typename KVScalar = Scalar,
          typename C = compute_scalar_t<Scalar, KVScalar>,
          template <typename> class AmxTiles = AmxNativeTiles>
void fold_block(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k, KeyValueRef<KVScalar> v, C tau,
                bool causal, Index begin, Index end, const EngineState<C>& state,
                TileBuffers<C>& buffers, Precision precision, Index rows_first = 0,
                Index rows_last = std::numeric_limits<Index>::max(), Index key_offset = 0) {
  fold_block<Scalar, StridedRows<KVScalar>, C, AmxTiles>(
      q, StridedRows<KVScalar>(k, v), tau, causal, begin, end, state, buffers, precision,
      rows_first, rows_last, key_offset);
}

/// Per-thread scratch of per_sample_rows: the engine's buffers and one partial result per
/// merge level (sized on a thread's first tile).
template <typename C>
struct PerSampleWorkspace {
  TileBuffers<C> buffers;
  std::vector<SoftmaxPartials<C>> partials;
};

/// Rows at positions [p0, p0 + q.rows()) (p0 = positions.query) of the per-sample estimator
/// over the keys of the row source `rows` (StridedRows, PagedRows) at positions positions.key ..
/// positions.key + rows.rows() - 1, into out (and lse,
/// when not null: lse[r] = log sum_j c_ij e^{tau q_i.k_j} for row r, i = p0 + r). The rows go by
/// query tiles (tile_query_rows positions, aligned from position 0; the tiles in parallel by
/// parallel_jobs, which hands an exception to the caller). In a tile, each sample's blocks meeting
/// the tile's rows are folded into fresh partials (fold_block), which are merged with the earlier
/// samples' partials pairwise (merge_level: a binary tree over the samples in order, each
/// merge SoftmaxPartials::merge); the levels left at the end are merged lowest first, and
/// out_r = acc_r / l_r. Each row's arithmetic depends only on its position, the keys and the
/// hashes. Extra memory O(tile_query_rows d_v log2 s) per thread. AMX products on the tile layer
/// AmxTiles (fold_block).
template <typename Scalar, typename OutScalar, typename C,
          template <typename> class AmxTiles = AmxNativeTiles, typename Rows>
void per_sample_rows(const ConstMatrixRef<Scalar>& q, const Rows& rows, const HashSet& hashes,
                     C tau, bool causal, TilePositions positions, Precision precision,
                     MatrixRef<OutScalar>& out, C* lse = nullptr) {
  constexpr Index Bq = tile_query_rows;
  const Index m = q.rows(), p0 = positions.query, k0 = positions.key;
  if (m == 0) return;
  const std::size_t samples = hashes.size(), levels = merge_levels(samples);
  const std::size_t lowest = lowest_level(samples);
  // The blocks over the positions of the queries and the keys (cut to them: no row or key
  // lies outside).
  const Index lo = std::min(p0, k0), hi = std::max(p0 + m, k0 + rows.rows());
  std::vector<std::vector<Index>> boundaries;
  boundaries.reserve(samples);
  for (const BinHash& hash : hashes) boundaries.push_back(block_boundaries_between(hash, lo, hi));
  std::vector<QueryTile> tiles;
  append_query_tiles(tiles, 0, p0, p0 + m);
  parallel_jobs<PerSampleWorkspace<C>>(
      static_cast<long>(tiles.size()), [&](long t, PerSampleWorkspace<C>& work) {
        if (work.partials.size() != levels) {
          work.partials.resize(levels);
          for (SoftmaxPartials<C>& level : work.partials) level.resize(Bq, rows.value_cols());
        }
        std::vector<SoftmaxPartials<C>>& partials = work.partials;
        // The rows at positions [first, last), partial row i - first for position i.
        const QueryTile& tile = tiles[static_cast<std::size_t>(t)];
        const Index first = tile.row_begin, count = tile.rows, last = first + count;
        const ConstMatrixRef<Scalar> tile_q = q.middleRows(first - p0, count);
        for (std::size_t sample = 0; sample < samples; ++sample) {
          const std::size_t level = merge_level(sample);
          SoftmaxPartials<C>& fresh = partials[level];
          fresh.clear(0, count);
          // The blocks [t_r, t_{r+1}) with t_{r+1} > first and t_r < last.
          const std::vector<Index>& edges = boundaries[sample];
          for (auto edge = std::upper_bound(edges.begin(), edges.end(), first) - 1; *edge < last;
               ++edge)
            fold_block<Scalar, Rows, C, AmxTiles>(tile_q, rows, tau, causal, edge[0], edge[1],
                                                  fresh.engine_state(first), work.buffers,
                                                  precision, first, last, k0);
          for (std::size_t below = 0; below < level; ++below)
            fresh.merge(partials[below], 0, count);
        }
        SoftmaxPartials<C>& result = partials[lowest];
        for (std::size_t above = lowest + 1; above < levels; ++above)
          if (((samples >> above) & 1U) != 0) result.merge(partials[above], 0, count);
        for (Index r = 0; r < count; ++r) {
          result.finish(r, out.row(first - p0 + r));
          if (lse != nullptr) lse[first - p0 + r] = result.lse(r);
        }
      });
}

/// per_sample_rows over K and V in two row-strided matrices (KVScalar; StridedRows).
template <typename Scalar, typename KVScalar, typename OutScalar, typename C,
          template <typename> class AmxTiles = AmxNativeTiles>
void per_sample_rows(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<KVScalar>& k,
                     const ConstMatrixRef<KVScalar>& v, const HashSet& hashes, C tau, bool causal,
                     TilePositions positions, Precision precision, MatrixRef<OutScalar>& out,
                     C* lse = nullptr) {
  per_sample_rows<Scalar, OutScalar, C, AmxTiles>(q, StridedRows<KVScalar>(k, v), hashes, tau,
                                                  causal, positions, precision, out, lse);
}

/// Rows at positions p0 .. p0 + q.rows() - 1 (p0 = positions.query) of the mean-of-outputs
/// estimator over the keys of the row source `rows` (K and V matrices: StridedRows; a head of a
/// paged cache: PagedRows) at positions positions.key ..:
///   out_r = (sum_k T^(k)_r) / s,  T^(k) = per_sample_rows on the single hash k,
/// the sum in C in sample order from 0, divided by s, then rounded once to OutScalar. A row
/// depends only on its position, the keys and the hashes (per_sample_rows): row r is bitwise
/// row p0 + r of the call on all positions. Half-precision Q, K, V are multiplied on the unit
/// `precision` selects, as per_sample_rows (AMX on the tile layer AmxTiles). Extra memory
/// O(m d_v) in C.
template <typename QScalar, typename OutScalar, typename C,
          template <typename> class AmxTiles = AmxNativeTiles, typename Rows>
void mean_of_outputs_rows(const ConstMatrixRef<QScalar>& q, const Rows& rows, const HashSet& hashes,
                          C tau, bool causal, TilePositions positions, Precision precision,
                          MatrixRef<OutScalar> out) {
  const Index m = q.rows(), dv = rows.value_cols();
  if (m == 0 || dv == 0) return;
  RowMatrix<C> sum = RowMatrix<C>::Zero(m, dv), sample(m, dv);
  MatrixRef<C> sample_ref(sample);
  for (const BinHash& hash : hashes) {
    per_sample_rows<QScalar, C, C, AmxTiles>(q, rows, HashSet{hash}, tau, causal, positions,
                                             precision, sample_ref);
    sum += sample;
  }
  sum /= static_cast<C>(hashes.size());
  if constexpr (std::is_same_v<OutScalar, C>)
    out = sum;
  else
    out = sum.template cast<OutScalar>();
}

}  // namespace detail

}  // namespace poslsh
