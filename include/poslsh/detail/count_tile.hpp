// poslsh internals: the sample counts c_ij = #{k : bin_k(i) = bin_k(j)} of a query tile, kept as
// rectangles (one per block of each sample that meets the tile) and expanded key tile by key
// tile.
#pragma once

#include "poslsh/hash.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/types.hpp"

#include <algorithm>
#include <type_traits>
#include <vector>

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

  void build(const HashSet& hashes, Index i0, Index rows, Index n, bool causal) {
    rectangles.clear();
    lo.assign(static_cast<std::size_t>(rows), n);
    hi.assign(static_cast<std::size_t>(rows), 0);
    const Index i1 = i0 + rows;
    for (const BinHash& hash : hashes) {
      for (Block block = block_containing(hash, i0, n);;
           block = block_containing(hash, block.end, n)) {
        const Index row_begin = std::max(block.begin, i0) - i0;
        const Index row_end = std::min(block.end, i1) - i0;
        rectangles.push_back({row_begin, row_end, block.begin, block.end});
        for (Index r = row_begin; r < row_end; ++r) {
          const auto index = static_cast<std::size_t>(r);
          lo[index] = std::min(lo[index], block.begin);
          hi[index] = std::max(hi[index], block.end);
        }
        if (block.end >= i1) break;
      }
    }
    if (causal) {
      for (Index r = 0; r < rows; ++r) {
        const auto index = static_cast<std::size_t>(r);
        hi[index] = std::min(hi[index], i0 + r + 1);
      }
    }
  }

  /// Keys of the tile's band: [min lo, max hi).
  Index band_begin() const { return lo.front(); }
  Index band_end() const { return *std::max_element(hi.begin(), hi.end()); }

  /// Rows [first, last) whose interval meets keys [c0, c1) (contiguous: lo, hi monotone).
  std::pair<Index, Index> active_rows(Index c0, Index c1) const {
    const auto first = std::upper_bound(hi.begin(), hi.end(), c0) - hi.begin();
    const auto last = std::lower_bound(lo.begin(), lo.end(), c1) - lo.begin();
    return {static_cast<Index>(first), static_cast<Index>(last)};
  }

  /// Writes c_ij for tile rows [r0, r1) and keys [j0, j0 + cols) into rows [r0, r1) of the
  /// column-major `counts` (column b holds key j0 + b): 0 where no block holds both or, when
  /// causal, j > i. The counts come from +1/-1 at each rectangle's key edges (the -1 dropped
  /// past the last key) and a running sum over key columns, each step one vector add across
  /// rows.
  template <typename Matrix>
  void expand_counts(Index i0, Index j0, Index r0, Index r1, bool causal, Matrix&& counts) const {
    using Scalar = typename std::decay_t<Matrix>::Scalar;
    const Index rows = r1 - r0;
    const Index cols = counts.cols();
    auto tile = counts.middleRows(r0, rows);
    tile.setZero();
    for (const CountRectangle& rect : rectangles) {
      if (rect.key_end <= j0 || rect.key_begin >= j0 + cols) continue;
      const Index first_row = std::max(rect.row_begin, r0);
      const Index last_row = std::min(rect.row_end, r1);
      if (first_row >= last_row) continue;
      const Index up = std::max(rect.key_begin, j0) - j0;
      const Index down = rect.key_end - j0;
      counts.col(up).segment(first_row, last_row - first_row).array() += Scalar(1);
      if (down < cols) counts.col(down).segment(first_row, last_row - first_row).array() -= Scalar(1);
    }
    for (Index c = 1; c < cols; ++c) tile.col(c) += tile.col(c - 1);
    if (!causal) return;
    for (Index c = 0; c < cols; ++c) {
      // Key j0 + c is hidden from the rows r with i0 + r < j0 + c.
      const Index hidden = std::clamp<Index>(j0 + c - i0, r0, r1) - r0;
      tile.col(c).head(hidden).setZero();
    }
  }
};

}  // namespace poslsh::detail
