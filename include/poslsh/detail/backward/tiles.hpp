// poslsh internals: attention gradients tile by tile, FlashAttention-2 style, for any rule
// that gives each query row i one interval of keys (its window) and probabilities
//   P_ij = w_ij e^{x_ij - lse_i}   (0 outside the window),
// recomputed from the forward's log-sum-exp lse_i. With D_i = sum_c dO_ic O_ic:
//   dV = P^T dO,   dS_ij = P_ij (dO_i . v_j - D_i),   dQ = tau dS K,   dK = tau dS^T Q.
// One pass over key tiles of 64 keys; each key tile meets the query rows reaching it in steps
// of 192 rows (increasing). A step costs five GEMMs on Eigen maps of the strided inputs:
// S = Q K^T, dP = dO V^T, then dV += P^T dO, dK += tau dS^T Q and dQ += tau dS K. The thread
// holding a key tile owns its dK and dV rows and sums over its steps in increasing order; the
// dQ rows of a step are added in increasing key tile order (a per-step counter makes a thread
// wait for the key tiles before its own). Every gradient row is therefore the same sum in the
// same order for any thread count: bitwise reproducible, with no floating-point atomics and no
// n x n buffer.
//
// A rule (window policy) provides
//   KeyRange rows_reaching(Index j0, Index j1)  rows whose window meets keys [j0, j1);
//   KeyRange keys_reached(Index i0, Index i1)   the union of the windows of rows [i0, i1);
//   void probabilities(Index i0, Index j0, BackwardTileRef s, Scalar tau, const Scalar* lse,
//                      BackwardWork& work)      s = q_i.k_j (unscaled) in, P_ij out;
// windows are intervals whose two ends are non-decreasing in i.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "poslsh/detail/tile/count_tile.hpp"
#include "poslsh/detail/tile/types.hpp"
#include "poslsh/types.hpp"

namespace poslsh::detail {

/// Keys per tile of the backward pass (aligned from the first row of the rule's domain), and
/// query rows per step (a multiple of the forward's query tile, whose count structure the LSH
/// rule reuses; 192 = 4 register blocks of Eigen's AVX-512 float GEMM kernel).
inline constexpr Index backward_tile = 64;
inline constexpr Index backward_query_rows = 192;
static_assert(backward_query_rows % tile_query_rows == 0, "whole count tiles per step");

template <typename Scalar>
using BackwardTileMap = Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>>;

/// A column-major tile view (a map or rows of one).
template <typename Scalar>
using BackwardTileRef =
    Eigen::Ref<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>, 0, Eigen::OuterStride<>>;

/// Per-thread scratch of the backward pass: P and dS of a step, a count tile.
template <typename Scalar>
struct BackwardWork {
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> probabilities, gradients, counts;
  BackwardWork()
      : probabilities(backward_query_rows * backward_tile),
        gradients(backward_query_rows * backward_tile),
        counts(tile_query_rows * (backward_tile + 1)) {}
};

/// The inputs of the backward passes: row i of every per-row array is entry i.
template <typename Scalar>
struct BackwardInputs {
  const ConstMatrixRef<Scalar>& q;
  const ConstMatrixRef<Scalar>& k;
  const ConstMatrixRef<Scalar>& v;
  const ConstMatrixRef<Scalar>& dout;
  const Scalar* lse;
  const Scalar* delta;  ///< D_i = dO_i . O_i
  Scalar tau;
};

/// The gradient outputs (accumulated into: the caller zeroes them).
template <typename Scalar>
struct BackwardOutputs {
  MatrixRef<Scalar>& dq;
  MatrixRef<Scalar>& dk;
  MatrixRef<Scalar>& dv;
};

/// Keys j of row i with lo <= i - j <= hi inside the domain [begin, end) (rows and keys), and
/// x_ij = tau q_i.k_j - slope |i - j|, w = 1: exact ALiBi (causal lo = 0, banded |i-j| <= W) and
/// plain attention on one block (slope 0).
template <typename Scalar>
class WindowRule {
 public:
  WindowRule(Index begin, Index end, Index lo, Index hi, Scalar slope)
      : begin_(begin), end_(end), lo_(lo), hi_(hi), slope_(slope) {
    for (Index a = 0; a < backward_query_rows; ++a) offsets_(a) = static_cast<Scalar>(a);
  }
  Index begin() const { return begin_; }
  Index end() const { return end_; }

  KeyRange rows_reaching(Index j0, Index j1) const {
    return {std::max(begin_, j0 + lo_), std::min(end_, j1 + hi_)};
  }
  KeyRange keys_reached(Index i0, Index i1) const {
    return {std::max(begin_, i0 - hi_), std::min(end_, i1 - lo_)};
  }

  void probabilities(Index i0, Index j0, BackwardTileRef<Scalar> s, Scalar tau, const Scalar* lse,
                     BackwardWork<Scalar>&) const {
    const Index rows = s.rows();
    const auto row_lse = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(lse + i0, rows);
    for (Index c = 0; c < s.cols(); ++c) {
      const Index j = j0 + c;
      // Rows r with lo <= i0 + r - j <= hi.
      const Index first = std::clamp<Index>(j + lo_ - i0, 0, rows);
      const Index last = std::clamp<Index>(j + hi_ - i0 + 1, first, rows);
      Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> column(&s.coeffRef(0, c), rows);
      column.head(first).setZero();
      const Index count = last - first;
      if (slope_ == Scalar(0)) {
        column.segment(first, count) =
            (tau * column.segment(first, count) - row_lse.segment(first, count)).exp();
      } else {
        column.segment(first, count) =
            (tau * column.segment(first, count) -
             slope_ * (offsets_.segment(first, count) + static_cast<Scalar>(i0 - j)).abs() -
             row_lse.segment(first, count))
                .exp();
      }
      column.tail(rows - last).setZero();
    }
  }

 private:
  Index begin_, end_, lo_, hi_;
  Scalar slope_;
  Eigen::Array<Scalar, backward_query_rows, 1> offsets_;
};

/// The count structure of every query tile of n rows (tiles of tile_query_rows from row 0) and
/// each row's window [lo_i, hi_i) of keys with c_ij > 0: what the fused forward builds tile by
/// tile, kept for both backward passes (O(n s) memory).
struct CountWindows {
  std::vector<TileCounts> tiles;
  std::vector<Index> lo, hi;

  void build(const HashSet& hashes, Index n, bool causal) {
    const Index count = (n + tile_query_rows - 1) / tile_query_rows;
    tiles.assign(static_cast<std::size_t>(count), TileCounts{});
    lo.resize(static_cast<std::size_t>(n));
    hi.resize(static_cast<std::size_t>(n));
    const auto tile_count = static_cast<long>(count);
#pragma omp parallel for schedule(dynamic, 4)
    for (long t = 0; t < tile_count; ++t) {
      const Index i0 = static_cast<Index>(t) * tile_query_rows;
      const Index rows = std::min(tile_query_rows, n - i0);
      TileCounts& counts = tiles[static_cast<std::size_t>(t)];
      counts.build(hashes, i0, rows, n, causal);
      std::copy(counts.lo.begin(), counts.lo.end(), lo.begin() + i0);
      std::copy(counts.hi.begin(), counts.hi.end(), hi.begin() + i0);
    }
  }
};

/// Windows [lo_i, hi_i) and weights c_ij = #{k : bin_k(i) = bin_k(j)} (causal: j <= i), scores
/// x_ij = tau q_i.k_j: the fused LSH estimator, with the forward's windows and counts.
template <typename Scalar>
class CountRule {
  static constexpr Scalar max_exponent = Scalar(64);

 public:
  CountRule(const CountWindows& windows, Index n, bool causal)
      : windows_(windows), n_(n), causal_(causal) {}
  Index begin() const { return 0; }
  Index end() const { return n_; }

  KeyRange rows_reaching(Index j0, Index j1) const {
    const auto& lo = windows_.lo;
    const auto& hi = windows_.hi;
    return {static_cast<Index>(std::upper_bound(hi.begin(), hi.end(), j0) - hi.begin()),
            static_cast<Index>(std::lower_bound(lo.begin(), lo.end(), j1) - lo.begin())};
  }
  KeyRange keys_reached(Index i0, Index i1) const {
    return {windows_.lo[static_cast<std::size_t>(i0)],
            windows_.hi[static_cast<std::size_t>(i1 - 1)]};
  }

  void probabilities(Index i0, Index j0, BackwardTileRef<Scalar> s, Scalar tau, const Scalar* lse,
                     BackwardWork<Scalar>& work) const {
    // Row by row of the forward's count tiles.
    for (Index r = 0; r < s.rows();) {
      const Index i = i0 + r;
      const Index rows = std::min(s.rows() - r, (i / tile_query_rows + 1) * tile_query_rows - i);
      tile_probabilities(i, j0, s.middleRows(r, rows), tau, lse, work);
      r += rows;
    }
  }

 private:
  // Rows [i0, i0 + s.rows()) inside one count tile.
  void tile_probabilities(Index i0, Index j0, BackwardTileRef<Scalar> s, Scalar tau,
                          const Scalar* lse, BackwardWork<Scalar>& work) const {
    const Index rows = s.rows(), keys = s.cols();
    const Index tile = i0 / tile_query_rows;
    const Index r0 = i0 - tile * tile_query_rows;
    const TileCounts& counts = windows_.tiles[static_cast<std::size_t>(tile)];
    // Difference array over keys (column keys holds the -1 past the last key), then running
    // sums: c for rows [i0, i0 + rows) and keys [j0, j0 + keys). Small integers: exact.
    BackwardTileMap<Scalar> c(work.counts.data(), rows, keys + 1);
    c.setZero();
    for (const CountRectangle& rect : counts.rectangles) {
      const Index first = std::max(rect.row_begin, r0) - r0;
      const Index last = std::min(rect.row_end, r0 + rows) - r0;
      if (first >= last || rect.key_end <= j0 || rect.key_begin >= j0 + keys) continue;
      c.col(std::max(rect.key_begin, j0) - j0).segment(first, last - first).array() += Scalar(1);
      if (rect.key_end < j0 + keys)
        c.col(rect.key_end - j0).segment(first, last - first).array() -= Scalar(1);
    }
    const auto row_lse = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(lse + i0, rows);
    for (Index b = 0; b < keys; ++b) {
      if (b > 0) c.col(b) += c.col(b - 1);
      Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> column(&s.coeffRef(0, b), rows);
      const auto weight = c.col(b).array();
      // Exponents capped at max_exponent: where c = 0 the score may be anything, and
      // 0 * e^{cap} is 0 where 0 * inf would be NaN; where c > 0 the exponent is <= 0 up to
      // rounding (P_ij <= 1), far below the cap.
      column = weight * (tau * column - row_lse).min(max_exponent).exp();
      // Causal: key j0 + b is hidden from rows i0 + r < j0 + b.
      if (causal_) column.head(std::clamp<Index>(j0 + b - i0, 0, rows)).setZero();
    }
  }

  const CountWindows& windows_;
  Index n_;
  bool causal_;
};

/// The gradients of one pair of tiles: rows [r0, r0 + rows), keys [k0, k0 + keys). Leaves P in
/// work.probabilities and tau dS in work.gradients (rows x keys, column-major).
template <typename Scalar, typename Rule>
void backward_pair(const BackwardInputs<Scalar>& in, const Rule& rule, Index r0, Index rows,
                   Index k0, Index keys, BackwardWork<Scalar>& work) {
  BackwardTileMap<Scalar> p(work.probabilities.data(), rows, keys);
  BackwardTileMap<Scalar> ds(work.gradients.data(), rows, keys);
  p.noalias() = in.q.middleRows(r0, rows) * in.k.middleRows(k0, keys).transpose();
  rule.probabilities(r0, k0, p, in.tau, in.lse, work);
  ds.noalias() = in.dout.middleRows(r0, rows) * in.v.middleRows(k0, keys).transpose();
  const auto delta = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(in.delta + r0, rows);
  for (Index b = 0; b < keys; ++b)
    ds.col(b).array() = in.tau * p.col(b).array() * (ds.col(b).array() - delta);
}

/// No ordering of the dQ additions: the caller visits the key tiles in increasing order on one
/// thread.
struct InOrder {
  template <typename Add>
  void add(Index, Index, Add&& add_to_dq) const {
    add_to_dq();
  }
};

/// The dQ additions of one query tile in increasing key tile order across threads: the key
/// tiles that reach query tile I are the consecutive tiles first(I) .. last(I) (windows are
/// intervals with non-decreasing ends), so next[I] counts them off. The thread holding key tile
/// J waits until next[I] = J, adds, and sets next[I] = J + 1. Key tiles are handed out in
/// increasing order and the thread holding the smallest unfinished one never waits, so every
/// thread makes progress.
class KeyTileOrder {
 public:
  template <typename Rule>
  KeyTileOrder(const Rule& rule, Index tiles)
      : next_(new std::atomic<Index>[static_cast<std::size_t>(std::max<Index>(tiles, 1))]) {
    const Index begin = rule.begin(), end = rule.end();
    for (Index t = 0; t < tiles; ++t) {
      const Index i0 = begin + t * backward_query_rows;
      const KeyRange reached = rule.keys_reached(i0, std::min(end, i0 + backward_query_rows));
      next_[static_cast<std::size_t>(t)].store(
          reached.first < reached.last ? (reached.first - begin) / backward_tile : 0,
          std::memory_order_relaxed);
    }
  }

  template <typename Add>
  void add(Index query_tile, Index key_tile, Add&& add_to_dq) const {
    std::atomic<Index>& next = next_[static_cast<std::size_t>(query_tile)];
    for (int spin = 0; next.load(std::memory_order_acquire) != key_tile; ++spin) {
      if (spin >= 64) std::this_thread::yield();
    }
    add_to_dq();
    next.store(key_tile + 1, std::memory_order_release);
  }

 private:
  std::unique_ptr<std::atomic<Index>[]> next_;
};

/// Key tile [j0, j1): for each query tile reaching it, in increasing order, P and dS of the
/// pair once, then dV_J += P^T dO_I, dK_J += tau dS^T Q_I (this thread owns the key tile) and
/// dQ_I += tau dS K_J (in increasing key tile order, as `order` enforces).
template <typename Scalar, typename Rule, typename Order>
void backward_key_tile(const BackwardInputs<Scalar>& in, const Rule& rule, Index j0, Index j1,
                       BackwardOutputs<Scalar>& out, BackwardWork<Scalar>& work,
                       const Order& order) {
  const KeyRange reaching = rule.rows_reaching(j0, j1);
  if (reaching.first >= reaching.last) return;
  const Index base = rule.begin();
  const Index key_tile = (j0 - base) / backward_tile;
  for (Index i0 = base + (reaching.first - base) / backward_query_rows * backward_query_rows;
       i0 < reaching.last; i0 += backward_query_rows) {
    const Index r0 = std::max(i0, reaching.first);
    const Index r1 = std::min(i0 + backward_query_rows, reaching.last);
    const KeyRange reached = rule.keys_reached(r0, r1);
    const Index k0 = std::max(j0, reached.first), k1 = std::min(j1, reached.last);
    if (k0 >= k1) continue;
    backward_pair(in, rule, r0, r1 - r0, k0, k1 - k0, work);
    const Index rows = r1 - r0, keys = k1 - k0;
    BackwardTileMap<Scalar> p(work.probabilities.data(), rows, keys);
    BackwardTileMap<Scalar> ds(work.gradients.data(), rows, keys);
    out.dv.middleRows(k0, keys).noalias() += p.transpose() * in.dout.middleRows(r0, rows);
    out.dk.middleRows(k0, keys).noalias() += ds.transpose() * in.q.middleRows(r0, rows);
    order.add((i0 - base) / backward_query_rows, key_tile,
              [&] { out.dq.middleRows(r0, rows).noalias() += ds * in.k.middleRows(k0, keys); });
  }
}

/// One pass over the key tiles of the rule's domain, in parallel (OpenMP; call it outside a
/// parallel region): dK, dV of a key tile by its thread summing over query tiles in increasing
/// order, dQ of a query tile summed over key tiles in increasing order (KeyTileOrder). Outputs
/// are accumulated into.
template <typename Scalar, typename Rule>
void backward_parallel(const BackwardInputs<Scalar>& in, const Rule& rule,
                       BackwardOutputs<Scalar>& out) {
  const Index begin = rule.begin(), end = rule.end();
  const KeyTileOrder order(rule, (end - begin + backward_query_rows - 1) / backward_query_rows);
  const auto tile_count = static_cast<long>((end - begin + backward_tile - 1) / backward_tile);
#pragma omp parallel
  {
    BackwardWork<Scalar> work;
#pragma omp for schedule(dynamic, 1)
    for (long t = 0; t < tile_count; ++t) {
      const Index j0 = begin + static_cast<Index>(t) * backward_tile;
      backward_key_tile(in, rule, j0, std::min(end, j0 + backward_tile), out, work, order);
    }
  }
}

/// The same pass on the calling thread (a block of a per-sample hash): key tiles in increasing
/// order.
template <typename Scalar, typename Rule>
void backward_serial(const BackwardInputs<Scalar>& in, const Rule& rule,
                     BackwardOutputs<Scalar>& out, BackwardWork<Scalar>& work) {
  for (Index j0 = rule.begin(); j0 < rule.end(); j0 += backward_tile)
    backward_key_tile(in, rule, j0, std::min(rule.end(), j0 + backward_tile), out, work, InOrder{});
}

/// D_i = dO_i . O_i for every row.
template <typename Scalar>
Eigen::Matrix<Scalar, Eigen::Dynamic, 1> backward_delta(const ConstMatrixRef<Scalar>& out,
                                                        const ConstMatrixRef<Scalar>& dout) {
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> delta(out.rows());
  for (Index i = 0; i < out.rows(); ++i) delta(i) = dout.row(i).dot(out.row(i));
  return delta;
}

}  // namespace poslsh::detail
