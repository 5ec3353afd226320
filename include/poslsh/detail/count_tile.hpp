// poslsh internals: the sample counts c_ij = #{k : bin_k(i) = bin_k(j)} of a query tile, kept as
// rectangles (one per block of each sample that meets the tile; detail/count_bias.hpp expands
// them key tile by key tile).
#pragma once

#include "poslsh/hash.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/types.hpp"

#include <Eigen/Core>

#include <algorithm>
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
    positions_.resize(rows);
    for (Index r = 0; r < rows; ++r) positions_(r) = static_cast<double>(i0 + r);
    for (const BinHash& hash : hashes) {
      // The bins of the tile's rows, all at once (the same rounding as BinHash::bin); a block
      // boundary inside the tile is where the bin changes. The first and the last block
      // reach beyond the tile: block_containing finds their other ends.
      bins_ = ((positions_ - hash.offset) / hash.width).floor();
      const Index first_begin = block_containing(hash, i0, n).begin;
      Index run = 0;
      for (Index r = 1; r <= rows; ++r) {
        if (r < rows && bins_(r) == bins_(r - 1)) continue;
        add_block(run, r, run == 0 ? first_begin : i0 + run,
                  r == rows ? block_containing(hash, i1 - 1, n).end : i0 + r);
        run = r;
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

 private:
  // The block [key_begin, key_end) holding tile rows [row_begin, row_end).
  void add_block(Index row_begin, Index row_end, Index key_begin, Index key_end) {
    rectangles.push_back({row_begin, row_end, key_begin, key_end});
    for (auto r = static_cast<std::size_t>(row_begin); r < static_cast<std::size_t>(row_end); ++r) {
      lo[r] = std::min(lo[r], key_begin);
      hi[r] = std::max(hi[r], key_end);
    }
  }

  Eigen::ArrayXd positions_, bins_;
};

}  // namespace poslsh::detail
