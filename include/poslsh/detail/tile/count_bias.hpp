// poslsh internals: the count-weighted LSH policy of the tile engine (detail/tile/engine.hpp):
// scores x_ij = tau q_i.k_j without bias, weights w_ij = c_ij = #{k : bin_k(i) = bin_k(j)}
// (causal: 0 for j > i; from a hash set or from stored partitions), so the engine computes
//   out_i = sum_j c_ij e^{x_ij - M_i} v_j / sum_j c_ij e^{x_ij - M_i}.
// Row i's window is the interval [lo_i, hi_i) of keys with c_ij > 0 (TileCounts); inside a
// key tile cut by the windows, entries of count 0 are masked (-inf, never in the maximum).
// A query tile's counts come from comparing the bins of every row and key of its band where
// the band is short (TileCounts::build_by_bins), else from its rectangles: the same small
// integers either way.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/tile/count_tile.hpp"
#include "poslsh/detail/tile/kernels.hpp"
#include "poslsh/detail/tile/types.hpp"

namespace poslsh::detail {

/// column[r] += value for the rows r in [first, last) of a count tile's column (whole packets
/// read and written, the packets' other rows unchanged).
template <typename Scalar>
void count_column_add(Scalar* column, Index first, Index last, Scalar value) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  constexpr Index P = tile_packet_size<Scalar>;
  const Packet offsets = ei::plset<Packet>(Scalar(0));
  const Packet lower = ei::pset1<Packet>(static_cast<Scalar>(first));
  const Packet upper = ei::pset1<Packet>(static_cast<Scalar>(last));
  const Packet increment = ei::pset1<Packet>(value);
  for (Index a = first / P * P; a < last; a += P) {
    const Packet row = ei::padd(offsets, ei::pset1<Packet>(static_cast<Scalar>(a)));
    const Packet inside = ei::pand(ei::pcmp_le(lower, row), ei::pcmp_lt(row, upper));
    ei::pstore(column + a, ei::padd(ei::pload<Packet>(column + a), ei::pand(inside, increment)));
  }
}

/// Tile engine policy of the fused LSH estimator with hashes `hashes` on n positions. The
/// rectangles and the count tile live in caller-owned buffers (reused across calls).
template <typename Scalar>
class CountBias {
  using Packet = TilePacket<Scalar>;
  static constexpr Index P = tile_packet_size<Scalar>;
  static constexpr Index Bq = tile_query_rows;
  static constexpr Index Bk = tile_key_cols;

 public:
  CountBias(const HashSet& hashes, Index n, bool causal, TileCounts& counts,
            Eigen::Array<Scalar, Eigen::Dynamic, 1>& count_tile)
      : hashes_(&hashes), n_(n), causal_(causal), counts_(counts), count_tile_(count_tile) {
    if (count_tile_.size() < Bq * Bk) count_tile_.setZero(Bq * Bk);
  }

  /// The counts of stored partitions on [0, n) (partitions.n == n) instead of hashes.
  CountBias(const PartitionSet& partitions, Index n, bool causal, TileCounts& counts,
            Eigen::Array<Scalar, Eigen::Dynamic, 1>& count_tile)
      : partitions_(&partitions), n_(n), causal_(causal), counts_(counts), count_tile_(count_tile) {
    if (count_tile_.size() < Bq * Bk) count_tile_.setZero(Bq * Bk);
  }

  KeyRange query_tile(Index i0) {
    i0_ = i0;
    const Index rows = std::min(Bq, n_ - i0);
    compared_ = false;
    if (partitions_ != nullptr)
      counts_.build(*partitions_, i0, rows, n_, causal_);
    else if (counts_.build_by_bins(*hashes_, i0, rows, n_, causal_))
      compared_ = true;
    else
      counts_.build(*hashes_, i0, rows, n_, causal_);
    for (Index r = 0; r < rows; ++r) {
      lo_[index(r)] = counts_.lo[index(r)];
      hi_[index(r)] = counts_.hi[index(r)];
    }
    // Rows past n get an empty window at the last row's end: lo and hi stay non-decreasing.
    for (Index r = rows; r < Bq; ++r) lo_[index(r)] = hi_[index(r)] = hi_[index(rows - 1)];
    return {counts_.band_begin(), counts_.band_end()};
  }

  KeyTileCut key_tile(Index j0, Index keys, KeyRange rows) {
    j0_ = j0;
    const KeyRange reaching = rows_reaching(0, keys);
    const Index first = std::max(reaching.first, rows.first);
    const Index last = std::min(reaching.last, rows.last);
    if (first >= last) return KeyTileCut::skip;
    const Index r0 = first / P * P, r1 = (last + P - 1) / P * P;
    if (compared_)
      copy_counts(j0, keys, r0, r1);
    else if (causal_ && j0 + keys - 1 > i0_ + r0)
      expand_counts<true>(j0, keys, r0, r1);
    else
      expand_counts<false>(j0, keys, r0, r1);
    const bool full = lo_[index(r1 - 1)] <= j0 && hi_[index(r0)] >= j0 + keys;
    return full ? KeyTileCut::full : KeyTileCut::masked;
  }

  // Rows reaching keys [j0 + b0, j0 + b1): from the first with hi_r > j0 + b0 to the last with
  // lo_r < j0 + b1 (lo and hi are non-decreasing).
  KeyRange rows_reaching(Index b0, Index b1) const {
    const auto first = std::upper_bound(hi_.begin(), hi_.end(), j0_ + b0) - hi_.begin();
    const auto last = std::lower_bound(lo_.begin(), lo_.end(), j0_ + b1) - lo_.begin();
    return {static_cast<Index>(first), static_cast<Index>(last)};
  }
  KeyRange keys_reached(Index a0, Index a1) const {
    return {lo_[index(a0)] - j0_, hi_[index(a1 - 1)] - j0_};
  }

  /// x = acc (-inf where c = 0), p = c e^{x - M}.
  class Scorer {
   public:
    explicit Scorer(const Scalar* counts) : counts_(counts) {}

    template <bool Masked>
    EIGEN_ALWAYS_INLINE Packet score(const Packet& acc, Index b, Index a) const {
      namespace ei = Eigen::internal;
      if constexpr (!Masked) return acc;
      const Packet kept = ei::pcmp_lt(ei::pset1<Packet>(Scalar(0)), count(b, a));
      return ei::pselect(kept, acc, ei::pset1<Packet>(-std::numeric_limits<Scalar>::infinity()));
    }

    template <bool Masked>
    EIGEN_ALWAYS_INLINE Packet weight(const Packet& prob, const Packet&, Index b, Index a) const {
      return Eigen::internal::pmul(prob, count(b, a));
    }

   private:
    EIGEN_ALWAYS_INLINE Packet count(Index b, Index a) const {
      return Eigen::internal::pload<Packet>(counts_ + b * Bq + a);
    }
    const Scalar* counts_;
  };

  Scorer scorer() const { return Scorer(count_tile_.data()); }

 private:
  static std::size_t index(Index i) { return static_cast<std::size_t>(i); }
  // count_tile[b][a] = c_{i0+a, j0+b} for the packets of rows in [r0, r1) and the keys b
  // each reaches (nothing else is read): +1/-1 at each rectangle's key edges (the -1 dropped
  // past the last key), then a running sum over keys per packet; Hidden: 0 where j > i.
  template <bool Hidden>
  void expand_counts(Index j0, Index keys, Index r0, Index r1) {
    namespace ei = Eigen::internal;
    Scalar* counts = count_tile_.data();
    const Packet zero = ei::pset1<Packet>(Scalar(0));
    for (Index a = r0; a < r1; a += P) {
      const KeyRange reach = packet_keys(a, keys);
      for (Index b = reach.first; b < reach.last; ++b) ei::pstore(counts + b * Bq + a, zero);
    }
    // Causal: a block ends after each of its rows, so its -1 falls where every one of its
    // rows is hidden; it is not needed.
    for (const CountRectangle& rect : counts_.rectangles) {
      if (rect.key_end <= j0 || rect.key_begin >= j0 + keys) continue;
      const Index first = std::max(rect.row_begin, r0), last = std::min(rect.row_end, r1);
      count_column_add(counts + (std::max(rect.key_begin, j0) - j0) * Bq, first, last, Scalar(1));
      if (!causal_ && rect.key_end < j0 + keys)
        count_column_add(counts + (rect.key_end - j0) * Bq, first, last, Scalar(-1));
    }
    if constexpr (!Hidden) {
      // Every row of the tile, all reaching the same keys (windows are non-decreasing, so the
      // first and the last packet's tell): the packets' running sums side by side, each in
      // increasing b as below.
      const KeyRange reach = packet_keys(0, keys), last = packet_keys(Bq - P, keys);
      if (r0 == 0 && r1 == Bq && reach.first == last.first && reach.last == last.last)
        return running_counts(counts, reach);
    }
    for (Index a = r0; a < r1; a += P) {
      // Row i0 + a + r sees key j0 + b iff r >= j0 + b - i0 - a (distances clamped to
      // [-1, P], exact in Scalar).
      const Packet row = ei::plset<Packet>(Scalar(0));
      const KeyRange reach = packet_keys(a, keys);
      Packet count = zero;
      for (Index b = reach.first; b < reach.last; ++b) {
        Scalar* entry = counts + b * Bq + a;
        count = ei::padd(count, ei::pload<Packet>(entry));
        if constexpr (Hidden) {
          const auto hidden = static_cast<Scalar>(std::clamp<Index>(j0 + b - i0_ - a, -1, P));
          ei::pstore(entry, ei::pand(ei::pcmp_le(ei::pset1<Packet>(hidden), row), count));
        } else {
          ei::pstore(entry, count);
        }
      }
    }
  }

  // count_tile[b][a] = c_{i0+a, j0+b} for the packets of rows in [r0, r1) and the keys b each
  // reaches, from the compared counts of the band.
  void copy_counts(Index j0, Index keys, Index r0, Index r1) {
    Scalar* counts = count_tile_.data();
    const Index R = TileCounts::compared_rows;
    const std::uint8_t* band = counts_.key_counts.data() + (j0 - counts_.band_begin()) * R;
    for (Index a = r0; a < r1; a += P) {
      const KeyRange reach = packet_keys(a, keys);
      for (Index b = reach.first; b < reach.last; ++b)
        Eigen::internal::pstore(counts + b * Bq + a, count_packet(band + b * R + a));
    }
  }
  // P byte counts as a packet of Scalar.
  static Packet count_packet(const std::uint8_t* bytes) {
#if defined(__AVX512BW__)
    if constexpr (std::is_same_v<Scalar, float> && P == 16) {
      return _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
    } else if constexpr (std::is_same_v<Scalar, double> && P == 8) {
      return _mm512_cvtepi32_pd(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
    }
#elif defined(__AVX2__)
    if constexpr (std::is_same_v<Scalar, float> && P == 8) {
      return _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
    }
#endif
    alignas(64) Scalar values[P];
    for (Index p = 0; p < P; ++p) values[p] = static_cast<Scalar>(bytes[p]);
    return Eigen::internal::pload<Packet>(values);
  }

  // counts[b][a] <- the sum of its entries of keys reach.first .. b, for every row a and the
  // keys b of `reach` (the packets' chains interleaved).
  void running_counts(Scalar* counts, KeyRange reach) {
    namespace ei = Eigen::internal;
    constexpr int Packets = static_cast<int>(Bq / P);
    Packet count[Packets];
    for (int p = 0; p < Packets; ++p) count[p] = ei::pset1<Packet>(Scalar(0));
    for (Index b = reach.first; b < reach.last; ++b) {
      Scalar* entry = counts + b * Bq;
      POSLSH_TILE_UNROLL
      for (int p = 0; p < Packets; ++p) {
        count[p] = ei::padd(count[p], ei::pload<Packet>(entry + p * P));
        ei::pstore(entry + p * P, count[p]);
      }
    }
  }

  // Keys of the key tile that the packet of rows at a reaches, clamped to [0, keys).
  KeyRange packet_keys(Index a, Index keys) const {
    const KeyRange reach = keys_reached(a, a + P);
    const Index first = std::clamp<Index>(reach.first, 0, keys);
    return {first, std::clamp<Index>(reach.last, first, keys)};
  }

  const HashSet* hashes_ = nullptr;
  const PartitionSet* partitions_ = nullptr;
  Index n_;
  bool causal_;
  TileCounts& counts_;
  Eigen::Array<Scalar, Eigen::Dynamic, 1>& count_tile_;
  Index i0_ = 0, j0_ = 0;
  bool compared_ = false;  // this query tile's counts from TileCounts::build_by_bins
  std::array<Index, Bq> lo_{}, hi_{};
};

}  // namespace poslsh::detail
