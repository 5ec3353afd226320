// poslsh internals: exact ALiBi attention of a range of query rows, FlashAttention-style.
// Queries are taken in tiles of exact_query_tile rows, keys in tiles of exact_key_tile; for
// each key tile the scores x_ij = tau q_i.k_j - |i-j| / sigma (bias computed on the fly from
// the integer distance) feed an online softmax per query row:
//   M_i <- max(M_i, max_j x_ij),  alpha_i = e^{M_i,old - M_i},
//   l_i <- alpha_i l_i + sum_j e^{x_ij - M_i},  acc_i <- alpha_i acc_i + sum_j e^{x_ij - M_i} v_j,
// and out_i = acc_i / l_i. Keys are restricted to a window lo <= i - j <= hi (causal: lo = 0,
// banded: |i - j| <= band); key tiles outside a query tile's window are skipped, tiles cut by
// it are masked entry by entry (masked entries are -inf and never enter the maximum, and
// their probability is set to exactly 0). Key tiles are visited nearest first, so the running
// maximum is usually set by the first tile and later rescalings are by exactly 1.
// Every query row's arithmetic depends only on the row and its tile (tiles are aligned to
// multiples of exact_query_tile from row 0), never on the other rows computed: any split of
// the rows into ranges gives bitwise the same output.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <limits>
#include <utility>

#include "poslsh/detail/exact_kernels.hpp"
#include "poslsh/types.hpp"

// GCC 12 reports "'__Y' is (maybe) used uninitialized" inside its own AVX-512 intrinsics
// (_mm512_undefined_ps) once pmax and pexp are inlined here: a known false positive. Avoiding
// pmax (a compare and select instead) halved the speed of the score kernel.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace poslsh::detail {

/// Query rows per tile (aligned to multiples of it from row 0) and keys per tile.
inline constexpr Index exact_query_tile = 64;
inline constexpr Index exact_key_tile = 64;

/// Keys j kept for query i: lo <= i - j <= hi.
struct ExactWindow {
  Index lo;
  Index hi;
};

/// One head's exact ALiBi attention; holds the tile buffers (O(tile (d + d_v)) memory).
template <typename Scalar>
class ExactTileEngine {
  using Packet = ExactPacket<Scalar>;
  using Buffer = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
  static constexpr Index P = exact_packet_size<Scalar>;
  static constexpr Index Bq = exact_query_tile;
  static constexpr Index Bk = exact_key_tile;
  // Register blocks: score_keys keys x query_packets packets of queries, value_rows rows x
  // value_packets packets of values (16 accumulators each; 4 x 4 measured best on AVX-512).
  static constexpr int score_keys = 4;
  static constexpr int query_packets = static_cast<int>(std::min<Index>(4, Bq / P));
  static constexpr int value_rows = 4;
  static constexpr int value_packets = 4;
  static_assert(Bq % P == 0 && Bq % (query_packets * P) == 0 && Bq % value_rows == 0,
                "the query tile must be a whole number of packets and blocks");

 public:
  /// q (n x d) is used unscaled; tau and 1/sigma are applied here. window.lo <= 0 <= window.hi.
  ExactTileEngine(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
                  const ConstMatrixRef<Scalar>& v, double sigma, double tau, ExactWindow window)
      : q_(q),
        k_(k),
        v_(v),
        n_(q.rows()),
        d_(q.cols()),
        dv_(v.cols()),
        dvp_((v.cols() + P - 1) / P * P),
        tau_(static_cast<Scalar>(tau)),
        neg_inv_sigma_(negative_slope(sigma, q.rows())),
        window_(window),
        pack_values_(v.cols() % P != 0) {
    qt_.setZero(d_ * Bq);
    scores_.resize(Bk * Bq);
    running_max_.resize(Bq);
    running_sum_.resize(Bq);
    alpha_.resize(Bq);
    tile_max_.resize(Bq);
    offsets_.resize(Bq);
    for (Index a = 0; a < Bq; ++a) offsets_(a) = static_cast<Scalar>(a);
    acc_.resize(Bq * dvp_);
    if (pack_values_) values_.setZero(Bk * dvp_);
  }

  /// Rows [row_begin, row_end) of the output, written to out rows 0 .. row_end - row_begin.
  template <typename OutType>
  void run(Index row_begin, Index row_end, OutType& out) {
    if (row_begin >= row_end || dv_ == 0) return;
    for (Index i0 = row_begin / Bq * Bq; i0 < row_end; i0 += Bq) {
      const Index r0 = std::max(i0, row_begin);
      const Index r1 = std::min(i0 + Bq, row_end);
      query_tile(i0, r0, r1);
      for (Index i = r0; i < r1; ++i) {
        const Index a = i - i0;
        out.row(i - row_begin) = acc_.segment(a * dvp_, dv_).matrix().transpose() / running_sum_(a);
      }
    }
  }

 private:
  static constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();

  // -1/sigma in Scalar, kept above lowest / n so that every bias |i-j| * slope (|i-j| < n) is
  // finite, 0 on the diagonal: the scores stay finite however small sigma is.
  static Scalar negative_slope(double sigma, Index n) {
    const auto lowest = static_cast<double>(std::numeric_limits<Scalar>::lowest());
    return static_cast<Scalar>(
        std::max(-1.0 / sigma, lowest / static_cast<double>(std::max<Index>(n, 1))));
  }

  // Rows [r0, r1) of the query tile starting at i0: fills running_sum_ and acc_.
  void query_tile(Index i0, Index r0, Index r1) {
    if (r1 - r0 < Bq) qt_.setZero();  // rows outside [r0, r1) are computed as zero queries
    Eigen::Map<RowMatrix<Scalar>> qt(qt_.data(), d_, Bq);
    qt.middleCols(r0 - i0, r1 - r0) = tau_ * q_.middleRows(r0, r1 - r0).transpose();
    running_max_.setConstant(minus_infinity);
    running_sum_.setZero();
    acc_.setZero();
    rows_ = {r0 - i0, r1 - i0};
    // Keys the tile's window reaches, in key tiles aligned to multiples of Bk (the first and
    // the last cut to [key_lo, key_hi]), visited from the tile holding the diagonal outwards.
    const Index key_lo = std::max<Index>(0, i0 - window_.hi);
    const Index key_hi = std::min<Index>(n_ - 1, i0 + Bq - 1 - window_.lo);
    if (key_lo > key_hi) return;
    const Index first = key_lo / Bk, last = key_hi / Bk;
    const Index centre = std::clamp(i0 / Bk, first, last);
    for (Index step = 0; centre - step >= first || centre + step <= last; ++step) {
      if (centre - step >= first) key_tile(i0, centre - step, key_lo, key_hi);
      if (step > 0 && centre + step <= last) key_tile(i0, centre + step, key_lo, key_hi);
    }
  }

  void key_tile(Index i0, Index tile, Index key_lo, Index key_hi) {
    const Index j0 = std::max(tile * Bk, key_lo);
    const Index keys = std::min((tile + 1) * Bk, key_hi + 1) - j0;
    const Index min_diff = i0 - (j0 + keys - 1), max_diff = i0 + Bq - 1 - j0;
    if (max_diff < window_.lo || min_diff > window_.hi) return;
    const bool masked = min_diff < window_.lo || max_diff > window_.hi;
    if (masked)
      score_tile<true>(i0, j0, keys);
    else
      score_tile<false>(i0, j0, keys);
    update_max();
    if (masked)
      exp_tile<true>(keys);
    else
      exp_tile<false>(keys);
    value_tile(i0, j0, keys);
  }

  // scores_[b][a] = x_{i0+a, j0+b} (or -inf if masked); tile_max_ = max over b.
  template <bool Masked>
  void score_tile(Index i0, Index j0, Index keys) {
    tile_max_.setConstant(minus_infinity);
    Index b = 0;
    for (; b + score_keys <= keys; b += score_keys) score_keys_block<score_keys, Masked>(i0, j0, b);
    score_remainder<score_keys - 1, Masked>(i0, j0, b, keys - b);
  }

  // The last keys - b < score_keys keys of the tile.
  template <int Keys, bool Masked>
  void score_remainder(Index i0, Index j0, Index b, Index remaining) {
    if constexpr (Keys > 0) {
      if (remaining == Keys)
        score_keys_block<Keys, Masked>(i0, j0, b);
      else
        score_remainder<Keys - 1, Masked>(i0, j0, b, remaining);
    }
  }

  template <int Keys, bool Masked>
  void score_keys_block(Index i0, Index j0, Index b0) {
    namespace ei = Eigen::internal;
    const Scalar* keys = k_.data() + (j0 + b0) * k_.outerStride();
    const Packet neg_inv_sigma = ei::pset1<Packet>(neg_inv_sigma_);
    const Packet lo = ei::pset1<Packet>(static_cast<Scalar>(window_.lo));
    const Packet hi = ei::pset1<Packet>(static_cast<Scalar>(window_.hi));
    for (Index a0 = 0; a0 < Bq; a0 += query_packets * P) {
      Packet acc[Keys][query_packets];
      exact_score_block<Scalar, Keys, query_packets>(qt_.data() + a0, Bq, keys, k_.outerStride(),
                                                     d_, acc);
      POSLSH_EXACT_UNROLL
      for (int p = 0; p < query_packets; ++p) {
        const Packet offset = ei::pload<Packet>(offsets_.data() + a0 + p * P);
        Packet best = ei::pload<Packet>(tile_max_.data() + a0 + p * P);
        POSLSH_EXACT_UNROLL
        for (int kk = 0; kk < Keys; ++kk) {
          // i - j = (i0 - j) + a, exact in Scalar for distances below 2^24 (float).
          const Packet diff =
              ei::padd(ei::pset1<Packet>(static_cast<Scalar>(i0 - (j0 + b0 + kk))), offset);
          Packet x = ei::pmadd(ei::pabs(diff), neg_inv_sigma, acc[kk][p]);
          if constexpr (Masked) {
            const Packet keep = ei::pand(ei::pcmp_le(lo, diff), ei::pcmp_le(diff, hi));
            x = ei::pselect(keep, x, ei::pset1<Packet>(minus_infinity));
          }
          best = ei::pmax(best, x);
          ei::pstore(scores_.data() + (b0 + kk) * Bq + a0 + p * P, x);
        }
        ei::pstore(tile_max_.data() + a0 + p * P, best);
      }
    }
  }

  // M <- max(M, tile max); alpha = e^{M_old - M} (1 while a row has seen no kept key).
  void update_max() {
    namespace ei = Eigen::internal;
    const Packet none = ei::pset1<Packet>(minus_infinity);
    const Packet one = ei::pset1<Packet>(Scalar(1));
    for (Index a = 0; a < Bq; a += P) {
      const Packet old_max = ei::pload<Packet>(running_max_.data() + a);
      const Packet new_max = ei::pmax(old_max, ei::pload<Packet>(tile_max_.data() + a));
      const Packet alpha = ei::pexp(ei::psub(old_max, new_max));
      ei::pstore(alpha_.data() + a, ei::pselect(ei::pcmp_eq(new_max, none), one, alpha));
      ei::pstore(running_max_.data() + a, new_max);
    }
  }

  // scores_ <- e^{x - M} (exactly 0 where masked); l <- alpha l + sum over the tile's keys.
  template <bool Masked>
  void exp_tile(Index keys) {
    namespace ei = Eigen::internal;
    const Packet none = ei::pset1<Packet>(minus_infinity);
    const Packet zero = ei::pset1<Packet>(Scalar(0));
    for (Index a = 0; a < Bq; a += P) {
      const Packet row_max = ei::pload<Packet>(running_max_.data() + a);
      Packet sum = zero;
      for (Index b = 0; b < keys; ++b) {
        Scalar* entry = scores_.data() + b * Bq + a;
        const Packet x = ei::pload<Packet>(entry);
        Packet prob = ei::pexp(ei::psub(x, row_max));
        if constexpr (Masked) prob = ei::pselect(ei::pcmp_eq(x, none), zero, prob);
        ei::pstore(entry, prob);
        sum = ei::padd(sum, prob);
      }
      const Packet old_sum = ei::pload<Packet>(running_sum_.data() + a);
      ei::pstore(running_sum_.data() + a,
                 ei::pmadd(old_sum, ei::pload<Packet>(alpha_.data() + a), sum));
    }
  }

  // acc <- alpha acc + P V over the tile's keys, for the value blocks holding computed rows.
  // A block of rows only visits the keys its window reaches: the others have probability 0,
  // and a block that reaches none has alpha = 1 (its maximum did not move), so nothing to do.
  void value_tile(Index i0, Index j0, Index keys) {
    const Scalar* values = v_.data() + j0 * v_.outerStride();
    Index stride = v_.outerStride();
    if (pack_values_) {
      for (Index b = 0; b < keys; ++b)
        for (Index c = 0; c < dv_; ++c) values_(b * dvp_ + c) = v_(j0 + b, c);
      values = values_.data();
      stride = dvp_;
    }
    const Index a_end = rows_.second;
    for (Index a = rows_.first / value_rows * value_rows; a < a_end; a += value_rows) {
      const Index b_begin = std::max<Index>(0, i0 + a - window_.hi - j0);
      const Index b_end = std::min<Index>(keys, i0 + a + value_rows - window_.lo - j0);
      if (b_begin >= b_end) continue;
      for (Index c = 0; c < dvp_; c += value_packets * P) {
        value_block<value_packets>((dvp_ - c) / P, a, values + b_begin * stride + c, stride,
                                   b_begin, b_end - b_begin, c);
      }
    }
  }

  // acc <- alpha acc + P V for rows [a, a + value_rows), keys [b, b + keys) of the tile and
  // min(packets, Packets) packets of value columns from column c.
  template <int Packets>
  void value_block(Index packets, Index a, const Scalar* values, Index stride, Index b, Index keys,
                   Index c) {
    if constexpr (Packets > 1) {
      if (packets < Packets)
        return value_block<Packets - 1>(packets, a, values, stride, b, keys, c);
    }
    exact_value_block<Scalar, value_rows, Packets>(scores_.data() + b * Bq + a, Bq, values, stride,
                                                   keys, alpha_.data() + a,
                                                   acc_.data() + a * dvp_ + c, dvp_);
  }

  const ConstMatrixRef<Scalar>& q_;
  const ConstMatrixRef<Scalar>& k_;
  const ConstMatrixRef<Scalar>& v_;
  Index n_, d_, dv_, dvp_;
  Scalar tau_, neg_inv_sigma_;
  ExactWindow window_;
  bool pack_values_;
  std::pair<Index, Index> rows_{0, 0};
  Buffer qt_, scores_, running_max_, running_sum_, alpha_, tile_max_, offsets_, acc_, values_;
};

}  // namespace poslsh::detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
