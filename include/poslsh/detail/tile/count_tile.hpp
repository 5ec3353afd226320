// poslsh internals: the sample counts c_ij = #{k : bin_k(i) = bin_k(j)} of a query tile, kept as
// rectangles (one per block of each sample that meets the tile; detail/tile/count_bias.hpp expands
// them key tile by key tile), from a hash set or from stored partitions of any blocks.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

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
        add_blocks_walked(hash, i0, rows, n, origin);
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
  /// (add_blocks_walked: a few bins each); narrower ones have the bins of every row of the
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
  // The blocks of `hash` meeting rows [i0, i0 + rows), from the first (block_containing),
  // each next one from the last one's end (block_end): exact against bin(), so the rectangles
  // are those of the bins of every row.
  void add_blocks_walked(const BinHash& hash, Index i0, Index rows, Index n, Index origin) {
    const Index i1 = i0 + rows;
    Block block = block_containing(hash, origin + i0, origin + n);
    Index row_begin = 0;
    Index key_begin = std::max(origin, block.begin) - origin;
    while (block.end - origin < i1) {
      const Index row_end = block.end - origin - i0;
      add({row_begin, row_end, key_begin, i0 + row_end});
      row_begin = row_end;
      key_begin = i0 + row_end;
      block = {block.end, block_end(hash, hash.bin(block.end), block.end, origin + n)};
    }
    add({row_begin, rows, key_begin, block.end - origin});
  }
  // Causal: row r (position i0 + r) sees no key past its own position.
  void cut_at_queries(Index i0) {
    for (std::size_t r = 0; r < hi.size(); ++r)
      hi[r] = std::min(hi[r], i0 + static_cast<Index>(r) + 1);
  }

  Eigen::ArrayXd positions_, bins_;
  std::vector<Index> block_ends_;
};

}  // namespace poslsh::detail

#include "poslsh/detail/restore_warnings.hpp"
