// poslsh internals: the sample counts c_ij = #{k : bin_k(i) = bin_k(j)} of a query tile, kept as
// rectangles (one per block of each sample that meets the tile; detail/tile/count_bias.hpp expands
// them key tile by key tile), from a hash set or from stored partitions of any blocks; or, for a
// short band, as the counts of every key of the band found by comparing bins (build_by_bins).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/disable_intrinsic_warnings.hpp"

namespace poslsh::detail {

/// Rows [row_begin, row_end) of the tile (tile-relative) see keys [key_begin, key_end).
struct CountRectangle {
  Index row_begin;
  Index row_end;
  Index key_begin;
  Index key_end;
};

/// The count structure of query tile [i0, i0 + rows): its rectangles, and for each row r the
/// interval [lo[r], hi[r]) of keys with c > 0 (the union of the row's blocks, contiguous since
/// every block holds the query; causal: cut at the query). lo and hi are non-decreasing in r.
struct TileCounts {
  std::vector<CountRectangle> rectangles;
  std::vector<Index> lo;
  std::vector<Index> hi;

  /// From the hashes, on the n positions [0, n), or (`origin`) on the positions origin ..
  /// origin + n - 1 of a longer sequence numbered from 0 here: the bins are those of the
  /// absolute positions, the blocks cut to the window.
  void build(const HashSet& hashes, Index i0, Index rows, Index n, bool causal, Index origin = 0) {
    clear(rows, n);
    const Index i1 = i0 + rows;
    positions_.resize(rows);
    for (Index r = 0; r < rows; ++r) positions_(r) = static_cast<double>(origin + i0 + r);
    block_ends_.resize(static_cast<std::size_t>(rows) + 1);
    for (const BinHash& hash : hashes) {
      if (hash.width >= walk_width) {
        walk_blocks(hash, i0, rows, n, origin, [this](const CountRectangle& rect) { add(rect); });
        continue;
      }
      // The bins of the tile's rows, all at once (the same rounding as BinHash::bin); a block
      // starts inside the tile where the bin changes (a branch-free scan lists those rows).
      // The first and the last block reach beyond the tile: block_begin and block_end find
      // their outer ends from the bins of the first and the last row.
      bins_ = ((positions_ - hash.offset) / hash.width).floor();
      const double* bins = bins_.data();
      Index* block_ends = block_ends_.data();
      Index cuts = 0;
      for (Index r = 1; r < rows; ++r) {
        block_ends[cuts] = r;
        cuts += static_cast<Index>(bins[r] != bins[r - 1]);
      }
      block_ends[cuts] = rows;
      const Index first_begin =
          std::max(origin, block_begin(hash, static_cast<std::int64_t>(bins[0]), origin + i0)) -
          origin;
      const Index last_end =
          block_end(hash, static_cast<std::int64_t>(bins[rows - 1]), origin + i1 - 1, origin + n) -
          origin;
      Index row_begin = 0;
      for (Index block = 0; block <= cuts; ++block) {
        const Index row_end = block_ends[block];
        const Index key_begin = block == 0 ? first_begin : i0 + row_begin;
        const Index key_end = block == cuts ? last_end : i0 + row_end;
        add({row_begin, row_end, key_begin, key_end});
        row_begin = row_end;
      }
    }
    if (causal) cut_at_queries(i0);
  }

  /// Rows a build_by_bins tile holds: one byte lane each in a 64-byte vector.
  static constexpr Index compared_rows = 64;
  /// The longest band (in keys) build_by_bins takes: a key's place in the band fits a byte.
  static constexpr Index max_compared_band = 255;

  /// After build_by_bins: key_counts[b * compared_rows + r] = c_{i0 + r, band_begin() + b}
  /// for the band's keys b, 0 for rows past `rows` and (causal) for keys past the row.
  Eigen::Array<std::uint8_t, Eigen::Dynamic, 1> key_counts;

  /// build()'s windows, and in place of the rectangles the counts of every key of the band,
  /// c_ij = #{k : bin_k(i) = bin_k(j)}, as bytes. A hash narrower than walk_width has its bins
  /// of the band's positions numbered as bytes from the band's first (bin(p) - bin(first), or
  /// p - first below width 1, where every position is a bin of its own: distinct bins give
  /// distinct bytes since the band holds at most 255 positions), and the 64 rows' bytes are
  /// compared with each key's, up to sixteen hashes held in registers; a wider one adds +1 and
  /// -1 at the key edges of its few blocks, summed over keys. The windows are each row's first
  /// and last key with c > 0 (a row shares every bin with itself, so none is empty). Returns
  /// false, building nothing, where the band is longer than max_compared_band, s > 255 or the CPU
  /// has no 64-byte compares (AVX-512BW). Requires 0 < rows <= compared_rows.
  bool build_by_bins(const HashSet& hashes, Index i0, Index rows, Index n, bool causal) {
#if defined(__AVX512BW__)
    if (hashes.size() > max_compared_band) return false;  // counts up to s in a byte
    const Index i1 = i0 + rows;
    Index begin = i0, end = i1;
    for (const BinHash& hash : hashes) {
      begin = std::min(begin, block_begin(hash, hash.bin(i0), i0));
      if (end - begin > max_compared_band) return false;
    }
    if (!causal) {
      for (const BinHash& hash : hashes) {
        end = std::max(end, block_end(hash, hash.bin(i1 - 1), i1 - 1, n));
        if (end - begin > max_compared_band) return false;
      }
    }
    key_counts.resize((end - begin) * compared_rows);
    const Index narrow = narrow_ids(hashes, begin, end, i0);
    wide_edges(hashes, begin, end, i0, rows, n);
    compare_bins(narrow, begin, end, i0, rows, causal);
    rectangles.clear();
    return true;
#else
    static_cast<void>(hashes), static_cast<void>(i0), static_cast<void>(rows);
    static_cast<void>(n), static_cast<void>(causal);
    return false;
#endif
  }

  /// The same structure for stored partitions on [0, n) (PartitionSet, n == set.n): for
  /// each sample the blocks meeting the tile, found by binary search on its edges. For the
  /// partitions of a hash set (block_boundaries of each hash) it equals build(hashes, ...):
  /// the same rectangles in the same order and the same lo, hi.
  void build(const PartitionSet& set, Index i0, Index rows, Index n, bool causal) {
    clear(rows, n);
    const Index i1 = i0 + rows;
    for (Index k = 0; k < set.samples(); ++k) {
      const Index* first = set.begin(k);
      const Index* last = set.end(k);
      // The block holding i0: its begin is the last edge <= i0.
      const Index* edge = std::upper_bound(first, last, i0) - 1;
      for (; edge + 1 < last && *edge < i1; ++edge) {
        const Index begin = edge[0], end = edge[1];
        add({std::max(begin, i0) - i0, std::min(end, i1) - i0, begin, end});
      }
    }
    if (causal) cut_at_queries(i0);
  }

  /// Hashes at least this wide (in positions) have their blocks found one after the other
  /// (walk_blocks: a few bins each); narrower ones have the bins of every row of the
  /// tile computed at once. Both give the same blocks.
  static constexpr double walk_width = 32.0;

  /// The most rectangles build(hashes, i0, rows, ...) makes: a hash of width w meets rows
  /// consecutive positions in at most min(rows, floor((rows - 1) / w) + 2) blocks.
  static std::size_t max_rectangles(const HashSet& hashes, Index rows) {
    std::size_t bound = 0;
    for (const BinHash& hash : hashes)
      bound += static_cast<std::size_t>(std::min(
          static_cast<double>(rows), std::floor(static_cast<double>(rows - 1) / hash.width) + 2.0));
    return bound;
  }

  /// Keys of the tile's band: [min lo, max hi).
  Index band_begin() const { return lo.front(); }
  Index band_end() const { return *std::max_element(hi.begin(), hi.end()); }

 private:
  // No rectangles yet; each of the rows' windows empty (lo = n, hi = 0).
  void clear(Index rows, Index n) {
    rectangles.clear();
    lo.assign(static_cast<std::size_t>(rows), n);
    hi.assign(static_cast<std::size_t>(rows), 0);
  }
  // One more block: its rectangle, and the windows of its rows widened to its keys. The
  // samples' blocks come sample by sample, each sample's left to right, so lo and hi of the
  // samples done are non-decreasing in r (a minimum and a maximum of non-decreasing steps):
  // the rows whose lo exceeds key_begin end the block, those whose hi is below key_end begin
  // it, and only those are written.
  void add(const CountRectangle& rect) {
    rectangles.push_back(rect);
    Index* lows = lo.data();
    Index* highs = hi.data();
    for (Index r = rect.row_end; r > rect.row_begin && lows[r - 1] > rect.key_begin; --r)
      lows[r - 1] = rect.key_begin;
    for (Index r = rect.row_begin; r < rect.row_end && highs[r] < rect.key_end; ++r)
      highs[r] = rect.key_end;
  }
  // The rectangles of the blocks of `hash` meeting rows [i0, i0 + rows) passed to `add`, from
  // the first (block_containing), each next one from the last one's end (block_end): exact
  // against bin(), so they are those of the bins of every row.
  template <typename Add>
  static void walk_blocks(const BinHash& hash, Index i0, Index rows, Index n, Index origin,
                          Add&& add) {
    const Index i1 = i0 + rows;
    Block block = block_containing(hash, origin + i0, origin + n);
    Index row_begin = 0;
    Index key_begin = std::max(origin, block.begin) - origin;
    while (block.end - origin < i1) {
      const Index row_end = block.end - origin - i0;
      add(CountRectangle{row_begin, row_end, key_begin, i0 + row_end});
      row_begin = row_end;
      key_begin = i0 + row_end;
      block = {block.end, block_end(hash, hash.bin(block.end), block.end, origin + n)};
    }
    add(CountRectangle{row_begin, rows, key_begin, block.end - origin});
  }
  // Causal: row r (position i0 + r) sees no key past its own position.
  void cut_at_queries(Index i0) {
    for (std::size_t r = 0; r < hi.size(); ++r)
      hi[r] = std::min(hi[r], i0 + static_cast<Index>(r) + 1);
  }

#if defined(__AVX512BW__)
  // ids_[k * id_stride_ + t]: the k-th narrow hash's bin of position begin + t as a byte,
  // bin(begin + t) - bin(begin) (t for widths below 1), for the band's positions and the
  // rows' (t up to i0 - begin + 63: positions past the band only in rows past `rows`, whose
  // counts are dropped). Returns the number of narrow hashes.
  Index narrow_ids(const HashSet& hashes, Index begin, Index end, Index i0) {
    const Index stride = std::max(end - begin, i0 - begin + compared_rows);
    id_stride_ = stride;
    positions_.resize((stride + 7) / 8 * 8);
    for (Index t = 0; t < positions_.size(); ++t) positions_(t) = static_cast<double>(begin + t);
    ids_.resize(static_cast<Index>(hashes.size()) * stride);
    std::uint8_t* ids = ids_.data();
    Index narrow = 0;
    for (const BinHash& hash : hashes) {
      if (hash.width >= walk_width) continue;
      if (hash.width < 1.0) {
        for (Index t = 0; t < stride; ++t) ids[t] = static_cast<std::uint8_t>(t);
      } else {
        exact_bins(hash);
        const double* bins = bins_.data();
        const double first = bins[0];
        for (Index t = 0; t < stride; ++t)
          ids[t] = static_cast<std::uint8_t>(static_cast<std::int32_t>(bins[t] - first));
      }
      ids += stride;
      ++narrow;
    }
    return narrow;
  }

  // bins_ = floor((positions_ - offset) / width), BinHash::bin's rounding, by a product with
  // 1 / width: the product and the rounded quotient lie within 2 ulps of the quotient, so
  // their floors agree unless the product lies within 4 ulps (|q| 2^-50) of an integer; a hash
  // with such a position has its bins divided instead. positions_ padded to whole vectors.
  void exact_bins(const BinHash& hash) {
    const Index size = positions_.size();
    bins_.resize(size);
    const double* positions = positions_.data();
    double* bins = bins_.data();
    const __m512d offset = _mm512_set1_pd(hash.offset);
    const __m512d reciprocal = _mm512_set1_pd(1.0 / hash.width);
    const __m512d ulps = _mm512_set1_pd(0x1p-48), one = _mm512_set1_pd(1.0);
    // The least distance to an integer beyond the margin, over the positions.
    __m512d clearance = one;
    for (Index t = 0; t < size; t += 8) {
      const __m512d q =
          _mm512_mul_pd(_mm512_sub_pd(_mm512_loadu_pd(positions + t), offset), reciprocal);
      const __m512d floor = _mm512_roundscale_pd(q, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      const __m512d fraction = _mm512_sub_pd(q, floor);
      const __m512d distance = _mm512_min_pd(fraction, _mm512_sub_pd(one, fraction));
      clearance =
          _mm512_min_pd(clearance, _mm512_sub_pd(distance, _mm512_mul_pd(_mm512_abs_pd(q), ulps)));
      _mm512_storeu_pd(bins + t, floor);
    }
    if (_mm512_cmp_pd_mask(clearance, _mm512_setzero_pd(), _CMP_LE_OQ) == 0) return;
    for (Index t = 0; t < size; ++t)
      bins[t] = std::floor((positions[t] - hash.offset) / hash.width);
  }

  // key_counts <- +1 at each wide hash's blocks' first key of the band and -1 past their
  // last, on the block's rows (byte arithmetic: the running sums over keys are the counts).
  void wide_edges(const HashSet& hashes, Index begin, Index end, Index i0, Index rows, Index n) {
    const Index band = end - begin;
    std::fill(key_counts.data(), key_counts.data() + band * compared_rows, std::uint8_t{0});
    const __m512i one = _mm512_set1_epi8(1);
    const auto edge = [&](Index key, __mmask64 on_rows, bool opening) {
      std::uint8_t* entry = key_counts.data() + (key - begin) * compared_rows;
      const __m512i count = _mm512_loadu_si512(entry);
      _mm512_storeu_si512(entry, opening ? _mm512_mask_add_epi8(count, on_rows, count, one)
                                         : _mm512_mask_sub_epi8(count, on_rows, count, one));
    };
    for (const BinHash& hash : hashes) {
      if (hash.width < walk_width) continue;
      walk_blocks(hash, i0, rows, n, 0, [&](const CountRectangle& rect) {
        const __mmask64 on_rows = row_mask(rect.row_end) & ~row_mask(rect.row_begin);
        edge(std::max(rect.key_begin, begin), on_rows, true);
        if (rect.key_end < end) edge(rect.key_end, on_rows, false);
      });
    }
  }
  // Rows [0, rows) as bits.
  static __mmask64 row_mask(Index rows) {
    return rows >= compared_rows ? ~__mmask64{0} : (__mmask64{1} << rows) - 1;
  }

  // key_counts of the band [begin, end) and the rows' windows: the wide hashes' edges summed
  // over keys, the narrow hashes' matches added in groups of 16, 8, 4, 2, 1 (their rows' bytes
  // in registers), then the rows past `rows` and the hidden keys dropped.
  void compare_bins(Index narrow, Index begin, Index end, Index i0, Index rows, bool causal) {
    const Index band = end - begin, offset = i0 - begin;
    Index k = 0;
    bool summed = false;  // the edges' running sums taken (by the first group's pass)
    const auto group = [&](auto size) {
      constexpr int H = decltype(size)::value;
      if (summed)
        add_matches<H, false>(k, band, offset);
      else
        add_matches<H, true>(k, band, offset);
      summed = true;
      k += H;
    };
    while (narrow - k >= 16) group(std::integral_constant<int, 16>{});
    if (narrow - k >= 8) group(std::integral_constant<int, 8>{});
    if (narrow - k >= 4) group(std::integral_constant<int, 4>{});
    if (narrow - k >= 2) group(std::integral_constant<int, 2>{});
    if (narrow - k >= 1) group(std::integral_constant<int, 1>{});
    if (!summed) add_matches<0, true>(k, band, offset);
    const __mmask64 live = row_mask(rows);
    __m512i first = _mm512_setzero_si512(), last = _mm512_setzero_si512();
    __mmask64 seen = 0;
    for (Index b = 0; b < band; ++b) {
      std::uint8_t* entry = key_counts.data() + b * compared_rows;
      __mmask64 shown = live;
      const Index first_row = begin + b - i0;  // causal: rows before it do not see key b
      if (causal && first_row > 0) shown &= ~row_mask(first_row);
      const __m512i count = _mm512_maskz_mov_epi8(shown, _mm512_loadu_si512(entry));
      _mm512_storeu_si512(entry, count);
      const __mmask64 reached = _mm512_test_epi8_mask(count, count);
      first = _mm512_mask_mov_epi8(first, reached & ~seen, _mm512_set1_epi8(static_cast<char>(b)));
      last = _mm512_mask_mov_epi8(last, reached, _mm512_set1_epi8(static_cast<char>(b + 1)));
      seen |= reached;
    }
    alignas(64) std::uint8_t firsts[compared_rows], lasts[compared_rows];
    _mm512_store_si512(firsts, first);
    _mm512_store_si512(lasts, last);
    lo.resize(static_cast<std::size_t>(rows));
    hi.resize(static_cast<std::size_t>(rows));
    for (Index r = 0; r < rows; ++r) {
      lo[static_cast<std::size_t>(r)] = begin + firsts[r];
      hi[static_cast<std::size_t>(r)] = begin + lasts[r];
    }
  }

  // key_counts[b] (+)= the rows matching key b in narrow hashes k .. k + H - 1 (rows' bytes at
  // row_offset), for every key b of the band; RunningSum: key_counts[b] first replaced by the
  // sum of its entries over keys 0 .. b.
  template <int H, bool RunningSum>
  void add_matches(Index k, Index band, Index row_offset) {
    const std::uint8_t* ids = ids_.data() + k * id_stride_;
    __m512i row_ids[H > 0 ? H : 1];
    for (int h = 0; h < H; ++h) row_ids[h] = _mm512_loadu_si512(ids + h * id_stride_ + row_offset);
    const __m512i one = _mm512_set1_epi8(1);
    __m512i sum = _mm512_setzero_si512();
    for (Index b = 0; b < band; ++b) {
      std::uint8_t* entry = key_counts.data() + b * compared_rows;
      __m512i count = _mm512_loadu_si512(entry);
      if constexpr (RunningSum) count = sum = _mm512_add_epi8(sum, count);
      for (int h = 0; h < H; ++h) {
        const __m512i key = _mm512_set1_epi8(static_cast<char>(ids[h * id_stride_ + b]));
        count = _mm512_mask_add_epi8(count, _mm512_cmpeq_epi8_mask(row_ids[h], key), count, one);
      }
      _mm512_storeu_si512(entry, count);
    }
  }

  Eigen::Array<std::uint8_t, Eigen::Dynamic, 1> ids_;
  Index id_stride_ = 0;
#endif

  Eigen::ArrayXd positions_, bins_;
  std::vector<Index> block_ends_;
};

}  // namespace poslsh::detail

#include "poslsh/detail/restore_warnings.hpp"
