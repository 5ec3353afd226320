// poslsh internals: the exact ALiBi bias policy of the tile engine (detail/tile/engine.hpp):
// scores x_ij = tau q_i.k_j - |i-j| / sigma with the bias computed on the fly from the integer
// distance, weights 1, and keys restricted to a distance window lo <= i - j <= hi (causal:
// lo = 0, banded: |i - j| <= band).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <limits>
#include <utility>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/alibi_slope.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/kernels.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"
#include "poslsh/detail/tile/types.hpp"

namespace poslsh::detail {

/// Keys j kept for query i: lo <= i - j <= hi.
struct ExactWindow {
  Index lo;
  Index hi;
};

/// Tile engine policy of exact ALiBi attention over the window `window` (lo <= 0 <= hi).
template <typename Scalar>
class AlibiBias {
  using Packet = TilePacket<Scalar>;
  static constexpr Index Bq = tile_query_rows;

 public:
  AlibiBias(Index n, double sigma, ExactWindow window)
      : neg_inv_sigma_(-finite_alibi_slope<Scalar>(sigma, n)), window_(window) {
    for (Index a = 0; a < Bq; ++a) offsets_(a) = static_cast<Scalar>(a);
  }

  KeyRange query_tile(Index i0) {
    i0_ = i0;
    return {i0 - window_.hi, i0 + Bq - window_.lo};
  }

  KeyTileCut key_tile(Index j0, Index keys, KeyRange rows) {
    j0_ = j0;
    const Index min_diff = i0_ + rows.first - (j0 + keys - 1);
    const Index max_diff = i0_ + rows.last - 1 - j0;
    if (max_diff < window_.lo || min_diff > window_.hi) return KeyTileCut::skip;
    return min_diff < window_.lo || max_diff > window_.hi ? KeyTileCut::masked : KeyTileCut::full;
  }

  // Row i0 + a reaches key j0 + b iff lo <= i0 + a - j0 - b <= hi.
  KeyRange rows_reaching(Index b0, Index b1) const {
    return {j0_ - i0_ + b0 + window_.lo, j0_ - i0_ + b1 + window_.hi};
  }
  KeyRange keys_reached(Index a0, Index a1) const {
    return {i0_ - j0_ + a0 - window_.hi, i0_ - j0_ + a1 - window_.lo};
  }

  /// x = acc - |i - j| / sigma (-inf outside the window), p = e^{x - M} (0 outside it).
  class Scorer {
   public:
    explicit Scorer(const AlibiBias& bias)
        : neg_inv_sigma_(Eigen::internal::pset1<Packet>(bias.neg_inv_sigma_)),
          lo_(Eigen::internal::pset1<Packet>(static_cast<Scalar>(bias.window_.lo))),
          hi_(Eigen::internal::pset1<Packet>(static_cast<Scalar>(bias.window_.hi))),
          offsets_(bias.offsets_.data()),
          distance_(bias.i0_ - bias.j0_) {}

    template <bool Masked>
    EIGEN_ALWAYS_INLINE Packet score(const Packet& acc, Index b, Index a) const {
      namespace ei = Eigen::internal;
      // i - j = (i0 - j) + a, exact in Scalar for distances below 2^24 (float).
      const Packet diff = ei::padd(ei::pset1<Packet>(static_cast<Scalar>(distance_ - b)),
                                   ei::pload<Packet>(offsets_ + a));
      const Packet x = ei::pmadd(ei::pabs(diff), neg_inv_sigma_, acc);
      if constexpr (!Masked) return x;
      const Packet keep = ei::pand(ei::pcmp_le(lo_, diff), ei::pcmp_le(diff, hi_));
      return ei::pselect(keep, x, ei::pset1<Packet>(-std::numeric_limits<Scalar>::infinity()));
    }

    template <bool Masked>
    EIGEN_ALWAYS_INLINE Packet weight(const Packet& prob, const Packet& x, Index, Index) const {
      namespace ei = Eigen::internal;
      if constexpr (!Masked) return prob;
      const Packet none = ei::pset1<Packet>(-std::numeric_limits<Scalar>::infinity());
      return ei::pselect(ei::pcmp_eq(x, none), ei::pset1<Packet>(Scalar(0)), prob);
    }

   private:
    Packet neg_inv_sigma_, lo_, hi_;
    const Scalar* offsets_;
    Index distance_;
  };

  Scorer scorer() const { return Scorer(*this); }

 private:
  Scalar neg_inv_sigma_;
  ExactWindow window_;
  Eigen::Array<Scalar, Bq, 1> offsets_;
  Index i0_ = 0, j0_ = 0;
};

/// Rows at positions [row_begin, row_end) of exact ALiBi attention over `window`, written to
/// out rows 0 .. row_end - row_begin (lse[r] for out row r when lse is not null); q used
/// unscaled, tau applied here. Row r of q is the query at position query_offset + r, the keys
/// are at positions 0 .. k.rows() - 1. Computed in Scalar; Q (QScalar) and K, V (KVScalar) may
/// be stored in a half-precision type, out in any scalar type, their products on the unit
/// `precision` selects (engine_rows). The bias is formed
/// in Scalar from the integer distance. Query tiles run in parallel (parallel_query_tiles),
/// each row's arithmetic depending on its position alone: bitwise the same for any thread
/// count and any split of the rows.
template <typename Scalar, typename QScalar = Scalar, typename KVScalar = QScalar, typename OutType>
void exact_alibi_rows(const ConstMatrixRef<nondeduced_t<QScalar>>& q,
                      const KeyValueRef<KVScalar>& k, const KeyValueRef<KVScalar>& v, double sigma,
                      double tau, ExactWindow window, Index row_begin, Index row_end, OutType&& out,
                      Index query_offset, Precision precision, Scalar* lse = nullptr) {
  // A window reaching back to key 0 (window.hi >= k.rows()) reads every key before the row.
  const JobOrder order = window.hi >= k.rows() ? JobOrder::heads_outer : JobOrder::heads_inner;
  parallel_query_tiles<Scalar>(1, row_begin, row_end, order, output_bytes(out),
                               [&](Index, Index r0, Index rows, TileWorkspace<Scalar>& work) {
                                 AlibiBias<Scalar> bias(k.rows(), sigma, window);
                                 engine_rows<Scalar, QScalar, KVScalar>(
                                     q, k, v, tau, bias, work.buffers, query_offset, precision, r0,
                                     r0 + rows, out.middleRows(r0 - row_begin, rows),
                                     lse == nullptr ? nullptr : lse + (r0 - row_begin));
                               });
}

}  // namespace poslsh::detail
