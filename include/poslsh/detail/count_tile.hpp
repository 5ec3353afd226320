// poslsh internals: the sample counts c_ij = #{k : bin_k(i) = bin_k(j)} of a query tile, kept as
// rectangles (one per block of each sample that meets the tile; detail/count_bias.hpp expands
// them key tile by key tile).
#pragma once

#include "poslsh/hash.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/types.hpp"

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
};

}  // namespace poslsh::detail
