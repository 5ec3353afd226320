// poslsh internals: the exact ALiBi bias policy of the tile engine (detail/tile/engine.hpp):
// scores x_ij = tau q_i.k_j - |i-j| / sigma with the bias computed on the fly from the integer
// distance, weights 1, and keys restricted to a distance window lo <= i - j <= hi (causal:
// lo = 0, banded: |i - j| <= band), less the keys a row can no longer read (dead keys, below).
//
// Dead keys. The row at position i always sees its own position (0 is in every window), so
// its largest score is at least x_ii = tau q_i.k_i >= -|tau q_i| |k_i|, while key j scores at
// most tau q_i.k_j - |i - j| / sigma <= |tau q_i| |k_j| - |i - j| / sigma (Cauchy-Schwarz). Key
// j is dead for row i when
//   |i - j| / sigma > (1 + 2^-8) |tau q_i| (|k_j| + |k_i|) + T + 1,
// T = -ln(smallest normal Scalar) rounded up plus one (89 for float, 710 for double): its weight
// e^{x_ij - M_i} is then below e^-T, under the smallest normal Scalar, where the exponential
// of the streaming softmax already returns 0 or a subnormal (the factor 2^-8 and the 1 cover
// the rounding of the norms and of the score; key tiles are visited from the diagonal out, so
// M_i >= x_ii whenever a dead key is met). Dead entries are masked (weight exactly 0), and a
// key tile whose entries are all dead for the rows computed is skipped, which is the same:
// the result is the computation over every key, less terms below its resolution. The rule
// reads only the row's query, the key and the key at the row's own position (no dead keys for
// a row whose position holds no key of the call), so a row's result still depends on its
// position and the keys alone. Norms are read only when |i - j| / sigma can exceed T.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
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

/// Tile engine policy of exact ALiBi attention over the window `window` (lo <= 0 <= hi), less
/// the dead keys (file comment). The engine reports the norms of the rows of each query tile
/// (bound_rows) and, for a key tile where keys may be dead, the norms of its keys
/// (drop_dead_keys).
template <typename Scalar>
class AlibiBias {
  using Packet = TilePacket<Scalar>;
  static constexpr Index Bq = tile_query_rows;
  static constexpr Index Bk = tile_key_cols;

 public:
  /// The engine calls bound_rows and drop_dead_keys.
  static constexpr bool drops_dead_keys = true;

  AlibiBias(Index n, double sigma, ExactWindow window)
      : neg_inv_sigma_(-finite_alibi_slope<Scalar>(sigma, n)), window_(window) {
    for (Index a = 0; a < Bq; ++a) offsets_(a) = static_cast<Scalar>(a);
  }

  /// The rows [rows.first, rows.last) of the current query tile (tile-relative) reach the keys
  /// [key_lo, key_hi] (positions). When some of those keys can be dead, reads for each row i
  /// the bound dead_key_query_bound(tau, |q_i|) (query_bound(i)) and the norm of the key at
  /// position i (diagonal_norm(i), +inf when the call has no key there) and keeps the row's bound.
  template <typename QueryBound, typename DiagonalNorm>
  void bound_rows(KeyRange rows, Index key_lo, Index key_hi, QueryBound&& query_bound,
                  DiagonalNorm&& diagonal_norm) {
    const double slope = -static_cast<double>(neg_inv_sigma_);
    const Index reach = std::max(i0_ + rows.last - 1 - key_lo, key_hi - (i0_ + rows.first));
    drop_ = slope * static_cast<double>(reach) > logit_;
    if (!drop_) return;
    rows_ = rows;
    for (Index a = 0; a < Bq; ++a) {
      row_norm_(a) = Scalar(0);
      row_floor_(a) = std::numeric_limits<Scalar>::infinity();
    }
    for (Index a = rows.first; a < rows.last; ++a) {
      const double q_norm = query_bound(i0_ + a);
      const double floor = q_norm * diagonal_norm(i0_ + a) + logit_ + 1.0;
      if (!(std::isfinite(q_norm) && std::isfinite(floor))) continue;  // no dead keys
      row_norm_(a) = static_cast<Scalar>(q_norm);
      row_floor_(a) = static_cast<Scalar>(floor);
    }
  }

  /// The cut of the key tile [j0, j0 + keys) (cut: key_tile's) with the dead keys of the rows
  /// computed: skip when every entry of those rows is dead, masked when some are, else `cut`.
  /// key_norms(norms) writes |k_j| of the tile's keys to norms[0 .. keys).
  template <typename KeyNorms>
  KeyTileCut drop_dead_keys(Index j0, Index keys, KeyTileCut cut, KeyNorms&& key_norms) {
    masks_dead_ = false;
    if (!drop_ || cut == KeyTileCut::skip) return cut;
    const double slope = -static_cast<double>(neg_inv_sigma_);
    const Index last_key = j0 + keys - 1;
    const auto distance = [](Index i, Index j) { return static_cast<double>(std::abs(i - j)); };
    const Index first_row = i0_ + rows_.first, last_row = i0_ + rows_.last - 1;
    const double far = std::max({distance(first_row, j0), distance(first_row, last_key),
                                 distance(last_row, j0), distance(last_row, last_key)});
    if (slope * far <= logit_) return cut;  // no key can be dead (each row's floor > T + 1)
    key_norms(key_norm_.data());
    double largest = 0.0, smallest = std::numeric_limits<double>::infinity();
    for (Index b = 0; b < keys; ++b) {
      const double norm = static_cast<double>(key_norm_(b));
      if (!std::isfinite(norm)) return cut;  // no bound: no key of the tile is dropped
      largest = std::max(largest, norm);
      smallest = std::min(smallest, norm);
    }
    // Both tests with a margin of 1 plus 2^-16 of the terms over the per-entry test of the
    // scorer (whose rounding in Scalar is far below it): "all dead" implies every entry of the
    // rows dead, "none dead" that none is.
    bool all_dead = true, none_dead = true;
    for (Index a = rows_.first; a < rows_.last && (all_dead || none_dead); ++a) {
      const Index i = i0_ + a;
      const double near = i < j0 ? distance(i, j0) : (i > last_key ? distance(i, last_key) : 0.0);
      const double farthest = std::max(distance(i, j0), distance(i, last_key));
      const double norm = static_cast<double>(row_norm_(a));
      const double floor = static_cast<double>(row_floor_(a));
      const double slack = dead_key_slack(norm * largest + floor + slope * farthest);
      if (!(norm * largest + floor + slack < slope * near)) all_dead = false;
      if (!(norm * smallest + floor - slack >= slope * farthest)) none_dead = false;
    }
    if (all_dead) return KeyTileCut::skip;
    if (none_dead) return cut;
    masks_dead_ = true;
    return KeyTileCut::masked;
  }

  KeyRange query_tile(Index i0) {
    i0_ = i0;
    return {i0 - window_.hi, i0 + Bq - window_.lo};
  }

  KeyTileCut key_tile(Index j0, Index keys, KeyRange rows) {
    j0_ = j0;
    masks_dead_ = false;
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

  /// x = acc - |i - j| / sigma (-inf outside the window and for dead keys), p = e^{x - M} (0
  /// there).
  class Scorer {
   public:
    explicit Scorer(const AlibiBias& bias)
        : neg_inv_sigma_(Eigen::internal::pset1<Packet>(bias.neg_inv_sigma_)),
          lo_(Eigen::internal::pset1<Packet>(static_cast<Scalar>(bias.window_.lo))),
          hi_(Eigen::internal::pset1<Packet>(static_cast<Scalar>(bias.window_.hi))),
          offsets_(bias.offsets_.data()),
          row_norm_(bias.masks_dead_ ? bias.row_norm_.data() : nullptr),
          row_floor_(bias.row_floor_.data()),
          key_norm_(bias.key_norm_.data()),
          distance_(bias.i0_ - bias.j0_) {}

    template <bool Masked>
    EIGEN_ALWAYS_INLINE Packet score(const Packet& acc, Index b, Index a) const {
      namespace ei = Eigen::internal;
      // i - j = (i0 - j) + a, exact in Scalar for distances below 2^24 (float).
      const Packet diff = ei::padd(ei::pset1<Packet>(static_cast<Scalar>(distance_ - b)),
                                   ei::pload<Packet>(offsets_ + a));
      const Packet x = ei::pmadd(ei::pabs(diff), neg_inv_sigma_, acc);
      if constexpr (!Masked) return x;
      Packet keep = ei::pand(ei::pcmp_le(lo_, diff), ei::pcmp_le(diff, hi_));
      if (row_norm_ != nullptr) {  // dead: |tau q_i| |k_j| + floor_i - |i - j| / sigma < 0
        const Packet bound =
            ei::pmadd(ei::pload<Packet>(row_norm_ + a), ei::pset1<Packet>(key_norm_[b]),
                      ei::pload<Packet>(row_floor_ + a));
        const Packet live = ei::pcmp_le(ei::pset1<Packet>(Scalar(0)),
                                        ei::pmadd(ei::pabs(diff), neg_inv_sigma_, bound));
        keep = ei::pand(keep, live);
      }
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
    const Scalar* row_norm_;  // null: no dead keys in this tile
    const Scalar* row_floor_;
    const Scalar* key_norm_;
    Index distance_;
  };

  Scorer scorer() const { return Scorer(*this); }

 private:
  Scalar neg_inv_sigma_;
  ExactWindow window_;
  Eigen::Array<Scalar, Bq, 1> offsets_;
  Index i0_ = 0, j0_ = 0;
  // The dead-key rule: T, whether the query tile can drop keys, its computed rows, each row's
  // (1 + 2^-8) |tau q_i| and floor (1 + 2^-8) |tau q_i| |k_i| + T + 1 (+inf: no dead keys),
  // the key tile's norms, and whether the tile masks dead entries.
  double logit_ = dead_key_logit<Scalar>();
  bool drop_ = false, masks_dead_ = false;
  KeyRange rows_{0, 0};
  Eigen::Array<Scalar, Bq, 1> row_norm_, row_floor_;
  Eigen::Array<Scalar, Bk, 1> key_norm_;
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
  const JobOrder order = window.hi >= k.rows() ? JobOrder::heads_outer : JobOrder::head_runs;
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
