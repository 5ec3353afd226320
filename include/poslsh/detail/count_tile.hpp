// poslsh internals: the sample counts c_ij = #{k : bin_k(i) = bin_k(j)} of a query tile, kept as
// rectangles (one per block of each sample that meets the tile) and expanded chunk by chunk.
#pragma once

#include "poslsh/detail/online_softmax.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/types.hpp"

#include <algorithm>
#include <limits>
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

  /// Writes log c_ij for rows [r0, r1) and keys [c0, c1) into the column-major `logits`,
  /// already of shape (r1-r0) x (c1-c0): -inf where c_ij = 0 or, when causal, j > i. The
  /// counts come from +1/-1 at each rectangle's key edges (the -1 dropped past the chunk) and
  /// a running sum over key columns, each step one vector add across rows.
  template <typename Matrix>
  void expand_log_counts(Index i0, Index r0, Index r1, Index c0, Index c1, bool causal,
                         Matrix&& logits) const {
    using Scalar = typename std::decay_t<Matrix>::Scalar;
    const Index rows = r1 - r0;
    const Index cols = c1 - c0;
    logits.setZero();
    for (const CountRectangle& rect : rectangles) {
      if (rect.key_end <= c0 || rect.key_begin >= c1) continue;
      const Index first_row = std::max(rect.row_begin, r0);
      const Index last_row = std::min(rect.row_end, r1);
      if (first_row >= last_row) continue;
      const Index up = std::max(rect.key_begin, c0) - c0;
      const Index down = std::min(rect.key_end, c1) - c0;
      logits.col(up).segment(first_row - r0, last_row - first_row).array() += Scalar(1);
      if (down < cols) {
        logits.col(down).segment(first_row - r0, last_row - first_row).array() -= Scalar(1);
      }
    }
    for (Index c = 1; c < cols; ++c) logits.col(c) += logits.col(c - 1);
    for (Index c = 0; c < cols; ++c) {
      log_counts(logits.col(c));
      if (causal) {
        // Key c0 + c is hidden from rows r with i0 + r0 + r < c0 + c.
        const Index hidden = std::clamp<Index>(c0 + c - i0 - r0, 0, rows);
        logits.col(c).head(hidden).setConstant(-std::numeric_limits<Scalar>::infinity());
      }
    }
  }
};

}  // namespace poslsh::detail
