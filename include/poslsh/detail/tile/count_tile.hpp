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

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/disable_intrinsic_warnings.hpp"
#include "poslsh/detail/tile/row_bytes.hpp"

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
    set_positions(origin + i0, rows);
    block_ends_.resize(static_cast<std::size_t>(rows) + 1);
    for (const BinHash& hash : hashes) {
      if (hash.width >= walk_width) {
        walk_blocks(hash, i0, rows, n, origin, [this](const CountRectangle& rect) { add(rect); });
        continue;
      }
      // The bins of the tile's rows, all at once (exact_bins: BinHash::bin's rounding); a
      // block starts inside the tile where the bin changes (a branch-free scan lists those
      // rows). The first and the last block reach beyond the tile: block_begin and block_end
      // find their outer ends from the bins of the first and the last row.
      exact_bins(hash);
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

  /// Rows a build_by_bins tile holds: one byte each in a RowBytes.
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
  /// has no byte compares of RowBytes (AVX-512BW or AVX2). Requires 0 < rows <= compared_rows.
  bool build_by_bins(const HashSet& hashes, Index i0, Index rows, Index n, bool causal) {
#if defined(POSLSH_ROW_BYTES)
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

  // The double packets exact_bins reads, of bin_packet_size positions each.
  using BinPacket = Eigen::internal::packet_traits<double>::type;
  static constexpr Index bin_packet_size = Eigen::internal::unpacket_traits<BinPacket>::size;
  // positions_ <- first, first + 1, ..., first + count - 1, continued to a whole number of
  // BinPackets.
  void set_positions(Index first, Index count) {
    constexpr Index P = bin_packet_size;
    positions_.resize((count + P - 1) / P * P);
    for (Index t = 0; t < positions_.size(); ++t) positions_(t) = static_cast<double>(first + t);
  }

  // bins_ = floor((positions_ - offset) / width), BinHash::bin's rounding, by a product q
  // with 1 / width: q and the rounded quotient differ by at most 3 u |q| (u = 2^-53, two
  // roundings in q, one in the quotient), so their floors agree unless q lies that close to
  // an integer; a hash with a q within |q| 2^-48 (32 u |q|) of one has its bins divided
  // instead. bins_ has positions_'s size (set_positions: whole packets).
  void exact_bins(const BinHash& hash) {
    namespace ei = Eigen::internal;
    using Packet = BinPacket;
    constexpr Index P = bin_packet_size;
    const Index size = positions_.size();
    bins_.resize(size);
    const double* positions = positions_.data();
    double* bins = bins_.data();
    const Packet offset = ei::pset1<Packet>(hash.offset);
    const Packet reciprocal = ei::pset1<Packet>(1.0 / hash.width);
    const Packet ulps = ei::pset1<Packet>(0x1p-48), one = ei::pset1<Packet>(1.0);
    // The least distance to an integer beyond the margin, over the positions.
    Packet clearance = one;
    for (Index t = 0; t < size; t += P) {
      const Packet q = ei::pmul(ei::psub(ei::ploadu<Packet>(positions + t), offset), reciprocal);
      const Packet floor = ei::pfloor(q);
      const Packet fraction = ei::psub(q, floor);
      const Packet distance = ei::pmin(fraction, ei::psub(one, fraction));
      clearance = ei::pmin(clearance, ei::psub(distance, ei::pmul(ei::pabs(q), ulps)));
      ei::pstoreu(bins + t, floor);
    }
    if (ei::predux_min(clearance) > 0.0) return;
    for (Index t = 0; t < size; ++t)
      bins[t] = std::floor((positions[t] - hash.offset) / hash.width);
  }

#if defined(POSLSH_ROW_BYTES)
  // ids_[k * id_stride_ + t]: the k-th narrow hash's bin of position begin + t as a byte,
  // bin(begin + t) - bin(begin) (t for widths below 1), for the band's positions and the
  // rows' (t up to i0 - begin + 63: positions past the band only in rows past `rows`, whose
  // counts are dropped). Returns the number of narrow hashes.
  Index narrow_ids(const HashSet& hashes, Index begin, Index end, Index i0) {
    const Index stride = std::max(end - begin, i0 - begin + compared_rows);
    id_stride_ = stride;
    set_positions(begin, stride);
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

  // key_counts <- +1 at each wide hash's blocks' first key of the band and -1 past their
  // last, on the block's rows (byte arithmetic: the running sums over keys are the counts).
  void wide_edges(const HashSet& hashes, Index begin, Index end, Index i0, Index rows, Index n) {
    const Index band = end - begin;
    std::fill(key_counts.data(), key_counts.data() + band * compared_rows, std::uint8_t{0});
    for (const BinHash& hash : hashes) {
      if (hash.width < walk_width) continue;
      walk_blocks(hash, i0, rows, n, 0, [&](const CountRectangle& rect) {
        const RowBytes on_rows = RowBytes::row_range(rect.row_begin, rect.row_end);
        std::uint8_t* opening =
            key_counts.data() + (std::max(rect.key_begin, begin) - begin) * compared_rows;
        RowBytes::load(opening).plus_on(on_rows).store(opening);
        if (rect.key_end >= end) return;
        std::uint8_t* closing = key_counts.data() + (rect.key_end - begin) * compared_rows;
        RowBytes::load(closing).minus_on(on_rows).store(closing);
      });
    }
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
    const RowBytes live = RowBytes::row_range(0, rows);
    RowBytes first = RowBytes::zero(), last = RowBytes::zero(), seen = RowBytes::zero();
    for (Index b = 0; b < band; ++b) {
      std::uint8_t* entry = key_counts.data() + b * compared_rows;
      // Causal: the rows before position begin + b do not see key b.
      const RowBytes shown = causal ? RowBytes::row_range(begin + b - i0, rows) : live;
      const RowBytes count = RowBytes::load(entry) & shown;
      count.store(entry);
      const RowBytes reached = count.nonzero();
      first = first.select(reached.and_not(seen), RowBytes::splat(static_cast<std::uint8_t>(b)));
      last = last.select(reached, RowBytes::splat(static_cast<std::uint8_t>(b + 1)));
      seen = seen | reached;
    }
    std::uint8_t firsts[compared_rows], lasts[compared_rows];
    first.store(firsts);
    last.store(lasts);
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
    RowBytes row_ids[H > 0 ? H : 1] = {};
    for (int h = 0; h < H; ++h) row_ids[h] = RowBytes::load(ids + h * id_stride_ + row_offset);
    RowBytes sum = RowBytes::zero();
    for (Index b = 0; b < band; ++b) {
      std::uint8_t* entry = key_counts.data() + b * compared_rows;
      RowBytes count = RowBytes::load(entry);
      if constexpr (RunningSum) count = sum = sum + count;
      for (int h = 0; h < H; ++h)
        count = count.plus_where_equal(row_ids[h], RowBytes::splat(ids[h * id_stride_ + b]));
      count.store(entry);
    }
  }

  Eigen::Array<std::uint8_t, Eigen::Dynamic, 1> ids_;
  Index id_stride_ = 0;
#endif  // POSLSH_ROW_BYTES

  Eigen::ArrayXd positions_, bins_;
  std::vector<Index> block_ends_;
};

}  // namespace poslsh::detail

#include "poslsh/detail/restore_warnings.hpp"
