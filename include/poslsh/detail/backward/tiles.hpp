// poslsh internals: attention gradients tile by tile, FlashAttention-2 style, for any rule
// that gives each query row i one interval of keys (its window) and probabilities
//   P_ij = w_ij e^{x_ij - lse_i}   (0 outside the window),
// recomputed from the forward's log-sum-exp lse_i. With D_i = sum_c dO_ic O_ic:
//   dV = P^T dO,   dS_ij = P_ij (dO_i . v_j - D_i),   dQ = tau dS K,   dK = tau dS^T Q.
// One pass over key tiles of 64 keys; each key tile meets the query rows reaching it in steps
// of 64 rows (increasing, aligned from the domain's first row). A thread takes groups of
// backward_group_tiles consecutive key tiles and, for each step reaching the group, the
// group's tiles in increasing order (the step's operands are then read from memory once per
// group). A step costs five products in register-blocked packet kernels
// (detail/backward/kernels.hpp) on operands packed contiguous and aligned (Q^T, dO^T and the
// rows of Q and dO once per step and group, K and V once per key tile), with subnormals flushed
// to zero (FlushSubnormals):
// S^T = K Q^T and dP^T = V dO^T over the keys each packet of the step's rows reaches, P and
// dS = tau P o (dP - D) entry by entry, then dV_J += P^T dO and dK_J += dS^T Q (each key over
// the rows that reach it) and dQ_I += dS K_J (each row over the keys it reaches).
// Reduction order, the same for any thread count (bitwise reproducible, no floating-point
// atomics, no n x n buffer):
//   dV_j, dK_j  the thread holding key tile J sums, step by step in increasing order, the
//               step's terms (rows i in increasing order, in registers from zero) and adds
//               each step's sum to a running sum that starts at zero; the output row gets
//               output + running sum at the end (the output is zero, or a previous block's
//               sum in the per-sample pass);
//   dQ_i        each key tile's terms (keys j in increasing order, in registers) are added
//               to a partial sum of its key group (backward_group_tiles tiles aligned from
//               the domain's first row) that starts at zero; each group's partial sum is
//               added to the output row in increasing group order (a per-step counter makes
//               a thread wait for the groups before its own).
// Partial sums per step of 64 rows also make the rounding error of dK and dV grow with the
// number of steps plus 64 rather than with the number of rows.
// Inputs stored in a half-precision type are widened as they are packed (backward_rows), so
// the sums above are those of the float pass on the widened values. With bfloat16 inputs on
// the AVX512-BF16 unit (BackwardInputs::paired) the five products are vdpbf16ps sums of pairs
// (detail/tile/pair_kernels.hpp) in the same loops: S^T and dP^T from the bfloat16 rows, and
// P, dS rounded to bfloat16 before the products, whose sums over whole pairs (rows or keys
// outside the pair's weighted 0) are formed on the running sums dV_J, dK_J (and from zero for
// a key tile's dQ contribution) in increasing pair order: the same for any thread count.
//
// A rule (window policy) over the rows [begin(), end()) and the keys [begin(), key_end()) (the
// same index space: self-attention has key_end() = end()) provides
//   KeyRange rows_reaching(Index j0, Index j1)  rows whose window meets keys [j0, j1);
//   KeyRange rows_reaching(Index j0, Index j1, Index i0, Index i1)
//                                               the same clamped to the rows [i0, i1);
//   KeyRange keys_reached(Index i0, Index i1)   the union of the windows of rows [i0, i1);
//   void probabilities(Index i0, Index j0, BackwardTileRef s, Scalar tau, const Scalar* lse,
//                      BackwardWork& work)      s = q_i.k_j (unscaled) in, P_ij out;
// windows are intervals whose two ends are non-decreasing in i.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "poslsh/core/matrix_units.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/alibi_slope.hpp"
#include "poslsh/detail/backward/kernels.hpp"
#include "poslsh/detail/parallel.hpp"
#include "poslsh/detail/tile/count_bias.hpp"
#include "poslsh/detail/tile/count_tile.hpp"
#include "poslsh/detail/tile/exponential.hpp"
#include "poslsh/detail/tile/pair_kernels.hpp"
#include "poslsh/detail/tile/stream_stores.hpp"
#include "poslsh/detail/tile/types.hpp"

namespace poslsh::detail {

/// Keys per tile of the backward pass (aligned from the first row of the rule's domain), and
/// query rows per step (aligned the same way; the forward's query tile, whose count structure
/// the LSH rule reuses).
inline constexpr Index backward_tile = 64;
inline constexpr Index backward_query_rows = backward_step_rows;
static_assert(backward_query_rows % tile_query_rows == 0, "whole count tiles per step");

template <typename Scalar>
using BackwardTileMap = Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>>;

/// A column-major tile view (a map or rows of one).
template <typename Scalar>
using BackwardTileRef =
    Eigen::Ref<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>, 0, Eigen::OuterStride<>>;

/// Key tiles per group: a thread takes backward_group_tiles consecutive key tiles and visits
/// each query step once for all of them (the step's packed operands then come from memory
/// once per group rather than once per key tile; the sums and their order are those of one
/// key tile at a time).
inline constexpr Index backward_group_tiles = 8;

/// Words of a pair of rows of d columns packed by pair_pack_values: d rounded up to 16.
inline constexpr Index pair_row_words(Index d) { return (d + 15) / 16 * 16; }

/// The operands of one query step (64 rows from i0, zero past the domain's end): Q^T and dO^T
/// (d x 64, d_v x 64) and the rows of Q and dO (64 x d_p, 64 x d_vp: padded to whole packets
/// with zeros), contiguous and aligned, so that the kernels' loads neither split nor conflict in
/// the L1 cache as rows of a large stride (e.g. [n, H, d] buffers) do. For the AVX512-BF16
/// products (BackwardInputs::paired) the step's operands are instead Q and dO as pairs along
/// their columns (pair_qt, pair_ot: pair_pack_queries) and along the rows (pair_q_rows,
/// pair_o_rows: pair_pack_values, pair_row_words(d) and (d_v) words a pair of rows).
template <typename Scalar>
struct StepOperands {
  const Scalar* qt = nullptr;
  const Scalar* ot = nullptr;
  const Scalar* q_rows = nullptr;
  const Scalar* o_rows = nullptr;
  const std::uint32_t* pair_qt = nullptr;
  const std::uint32_t* pair_ot = nullptr;
  const std::uint32_t* pair_q_rows = nullptr;
  const std::uint32_t* pair_o_rows = nullptr;
};

template <typename Scalar>
class PackedSteps;

/// Per-thread scratch of the backward pass (O(64 (d + d_v)) scalars per key tile of a group,
/// aligned; they only grow): P^T and dS^T of a step (key b, row a at b * backward_query_rows +
/// a), a count tile, the K and V rows of each key tile of the group and their dK, dV sums, the
/// step's dQ contribution (rows padded to whole packets with zeros), D of the step, the
/// packed query steps (packed_steps) and the slots of backward_by_steps. Sized before a
/// parallel loop (prepare, BackwardSerialSize), a pass allocates nothing; its contents never
/// reach the gradients (each pass writes what it reads, the padding stays zero).
template <typename Scalar>
struct BackwardWork {
  using Buffer = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
  Buffer probabilities, gradients, counts;
  Buffer k_rows, v_rows, dk_sum, dv_sum, dq_part, dq_step, delta, lse;
  Index d = -1, dv = -1, dp = 0, dvp = 0;
  Index key_tiles = 0;  ///< key tiles that k_rows, v_rows, dk_sum, dv_sum hold
  /// Operands of the AVX512-BF16 products (BackwardInputs::paired; sized by prepare_pairs):
  /// each key tile's K as pairs along its keys (pair_k, a slot per key tile, pair_d words a
  /// pair), P^T and dS^T of a pair rounded to bfloat16 (key b's row at b *
  /// backward_query_rows), dS as pairs along the keys (PairGradients), and ones.
  std::vector<std::uint32_t> pair_k, pair_ds;
  /// Each key tile's K and V rows copied as they are (a slot of tile * pair_d and tile *
  /// pair_dv words per key tile, rows pair_row_stride(d) and (d_v) apart).
  std::vector<std::uint16_t> k_bits, v_bits;
  std::vector<Eigen::bfloat16> p_rounded, ds_rounded;
  Buffer ones;
  Index pair_d = 0, pair_dv = 0, pair_key_tiles = 0;
  /// The thread's packed query steps (packed_steps).
  std::unique_ptr<PackedSteps<Scalar>> steps;
  /// backward_by_steps: the key tile in each slot and whether a pair has run on it.
  std::vector<Index> slot_tile;
  std::vector<char> slot_touched;

  BackwardWork()
      : probabilities(Buffer::Zero(backward_query_rows * backward_tile)),
        gradients(Buffer::Zero(backward_query_rows * backward_tile)),
        counts(tile_query_rows * (backward_tile + 1)),
        delta(Buffer::Zero(backward_query_rows)),
        lse(Buffer::Zero(backward_query_rows)) {}

  /// The thread's packed query steps: every step of a pass (backward_serial by key groups,
  /// O(n (d + d_v)) scalars) or the current one (backward_by_steps); made on first use, reused
  /// by the thread's later passes.
  PackedSteps<Scalar>& packed_steps() {
    if (!steps) steps = std::make_unique<PackedSteps<Scalar>>();
    return *steps;
  }

  /// D and lse of the step's rows [i0, i0 + rows) in delta and lse (0 past them).
  void load_step(const Scalar* all_delta, const Scalar* all_lse, Index i0, Index rows) {
    using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
    delta.head(rows) = Eigen::Map<const Vector>(all_delta + i0, rows);
    delta.tail(backward_query_rows - rows).setZero();
    lse.head(rows) = Eigen::Map<const Vector>(all_lse + i0, rows);
    lse.tail(backward_query_rows - rows).setZero();
  }

  /// Sizes the packed buffers for d and d_v (zeroed when they change: the padding stays 0).
  void prepare(Index d_new, Index dv_new) {
    if (d_new == d && dv_new == dv) return;
    constexpr Index P = tile_packet_size<Scalar>;
    d = d_new;
    dv = dv_new;
    dp = (d + P - 1) / P * P;
    dvp = (dv + P - 1) / P * P;
    constexpr Index Bq = backward_query_rows, G = backward_group_tiles;
    key_tiles = 0;
    reserve_key_tiles(G);
    dq_part.setZero(std::max<Index>(Bq * dp, 1));
    dq_step.setZero(std::max<Index>(Bq * dp, 1));
  }

  /// Sizes the operands of the AVX512-BF16 products for d, d_v (after prepare) and `tiles`
  /// key tiles (they only grow; the packing writes every word the products read).
  void prepare_pairs(Index tiles) {
    constexpr Index Bq = backward_query_rows, Bk = backward_tile;
    const Index cols_d = pair_row_words(d), cols_dv = pair_row_words(dv);
    if (cols_d != pair_d || cols_dv != pair_dv) {
      pair_d = cols_d;
      pair_dv = cols_dv;
      pair_key_tiles = 0;
      const auto size = [](Index count) {
        return static_cast<std::size_t>(std::max<Index>(count, 1));
      };
      pair_ds.assign(size(Bk / 2 * Bq), 0);
      p_rounded.assign(size(Bk * Bq), Eigen::bfloat16(0.0f));
      ds_rounded.assign(size(Bk * Bq), Eigen::bfloat16(0.0f));
      ones = Buffer::Ones(Bq);
    }
    if (tiles > pair_key_tiles) {
      pair_key_tiles = tiles;
      pair_k.assign(static_cast<std::size_t>(std::max<Index>(tiles * Bk / 2 * pair_d, 1)), 0);
      k_bits.assign(static_cast<std::size_t>(std::max<Index>(tiles * Bk * pair_d, 1)), 0);
      v_bits.assign(static_cast<std::size_t>(std::max<Index>(tiles * Bk * pair_dv, 1)), 0);
    }
  }

  /// Room for the K, V rows and dK, dV sums of `tiles` key tiles (after prepare; zeroed when
  /// they grow: the padding stays 0).
  void reserve_key_tiles(Index tiles) {
    if (tiles <= key_tiles) return;
    constexpr Index Bk = backward_tile;
    key_tiles = tiles;
    k_rows.setZero(std::max<Index>(tiles * Bk * dp, 1));
    v_rows.setZero(std::max<Index>(tiles * Bk * dvp, 1));
    dk_sum.setZero(std::max<Index>(tiles * Bk * dp, 1));
    dv_sum.setZero(std::max<Index>(tiles * Bk * dvp, 1));
  }
};

/// The packed rows and the dK, dV sums of one key tile of a group (in BackwardWork).
template <typename Scalar>
struct BackwardKeyTile {
  const Scalar* k_rows;  ///< K rows of the tile, d_p columns (zero past d)
  const Scalar* v_rows;  ///< V rows of the tile, d_vp columns (zero past d_v)
  Scalar* dk_sum;
  Scalar* dv_sum;
  const std::uint32_t* pair_k = nullptr;  ///< K as pairs along the keys (paired passes)
  /// The tile's K and V rows as they are stored (bfloat16 bits, pair_row_stride(d) and
  /// (d_v) apart; paired passes): S^T and dP^T read them from one contiguous block.
  const std::uint16_t* k_bits = nullptr;
  const std::uint16_t* v_bits = nullptr;
};

/// Subnormal numbers flushed to zero on the calling thread while in scope (x86: the MXCSR
/// bits FTZ, results below the smallest normal number become 0, and DAZ, subnormal operands
/// read as 0), the previous mode restored at the end; no effect on other targets. The
/// backward passes hold one on every thread that computes (the caller's and each thread of
/// their parallel regions), so every thread rounds alike and the gradients stay the same for
/// any thread count. Far from a query, P_ij = e^{x_ij - lse_i} underflows (ALiBi: from
/// |i - j| > 87 sigma in float), and sums of such terms from zero (dK, dV of a step, dQ of a
/// key tile) would otherwise run on subnormals, which x86 cores compute in microcode at about
/// a hundred times the cost of an FMA; flushed, those terms are exactly 0 (they are below
/// 2^-126 |g| for every gradient entry g of order 1).
class FlushSubnormals {
 public:
  FlushSubnormals() noexcept {
#if defined(__SSE__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | flush_bits);
#endif
  }
  ~FlushSubnormals() {
#if defined(__SSE__) || defined(_M_X64)
    _mm_setcsr(saved_);
#endif
  }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  static constexpr unsigned flush_bits = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)
  unsigned saved_ = 0;
};

/// The inputs of the backward passes: row i of every per-row array is entry i. Q, K, V and dO
/// are stored as Input (Scalar, or a half-precision type with Scalar float: their rows are
/// widened to Scalar as the passes pack them, backward_rows); lse and D are in Scalar.
template <typename Scalar, typename Input = Scalar>
struct BackwardInputs {
  const ConstMatrixRef<Input>& q;
  const ConstMatrixRef<Input>& k;
  const ConstMatrixRef<Input>& v;
  const ConstMatrixRef<Input>& dout;
  const Scalar* lse;
  const Scalar* delta;  ///< D_i = dO_i . O_i
  Scalar tau;
  /// The five products of every pair on the AVX512-BF16 unit (backward_pairs_v inputs only,
  /// where matrix_unit_for says the unit multiplies): S^T and dP^T from bfloat16 operands, and
  /// P, dS rounded to bfloat16 before P^T dO, dS^T Q and dS K (backward_pair).
  bool paired = false;
};

/// Whether inputs stored as Input, computed in Scalar, can take the AVX512-BF16 products
/// (bfloat16 inputs, float compute; used in x86 builds, POSLSH_X86_UNITS).
template <typename Scalar, typename Input>
inline constexpr bool backward_pairs_v =
    std::conjunction_v<std::is_same<Scalar, float>, std::is_same<Input, Eigen::bfloat16>>;

/// The gradient outputs (accumulated into: the caller zeroes them).
template <typename Scalar>
struct BackwardOutputs {
  MatrixRef<Scalar>& dq;
  MatrixRef<Scalar>& dk;
  MatrixRef<Scalar>& dv;
  /// The outputs hold no values yet (not zeroed): each key tile's dK, dV rows get 0 + its sum
  /// (the bits of adding the sum to zeroed rows), rows of key tiles no row reaches get 0, and
  /// the dQ rows of a query step are zeroed just before its first key tile adds to them (the
  /// caller zeroes the steps that reach no key: backward_zero_unreached). The pass must then
  /// cover every row and key.
  bool fresh = false;
  /// Rows the pass assigns (fresh outputs) are written with non-temporal stores
  /// (backward_store_rows): set by fresh_backward_outputs for outputs too large to stay cached.
  bool stream = false;
  /// When not null, one entry per key tile of the domain (backward_tile keys from the rule's
  /// first row), to which each query step reaching the tile adds, in increasing step order,
  /// the tile's sum over its pairs (i, j) of G_ij |i - j + shift| (the distance of their
  /// positions, Rule::shift), G_ij = P_ij (dP_ij - D_i) = dL/dx_ij: the terms of the gradient
  /// in an ALiBi slope, dL/dslope = -sum_ij G_ij |i - j + shift|.
  double* distance_sums = nullptr;
};

/// Fresh outputs (BackwardOutputs::fresh), assigned with non-temporal stores when dQ's rows
/// span at least stream_store_bytes (from the first row to the end of the last, strides
/// included).
template <typename Scalar>
BackwardOutputs<Scalar> fresh_backward_outputs(MatrixRef<Scalar>& dq, MatrixRef<Scalar>& dk,
                                               MatrixRef<Scalar>& dv) {
  const auto span =
      static_cast<std::size_t>(dq.rows() == 0 ? 0 : (dq.rows() - 1) * dq.outerStride() + dq.cols());
  return {dq, dk, dv, true, streams_output(span * sizeof(Scalar))};
}

/// With fresh outputs (BackwardOutputs::fresh): the dQ rows of the query steps whose rows reach
/// no key, which no key tile visits, set to zero.
template <typename Scalar, typename Rule>
void backward_zero_unreached(const Rule& rule, MatrixRef<Scalar>& dq) {
  constexpr Index Bq = backward_query_rows;
  for (Index i0 = rule.begin(); i0 < rule.end(); i0 += Bq) {
    const Index i1 = std::min(rule.end(), i0 + Bq);
    const KeyRange reached = rule.keys_reached(i0, i1);
    if (reached.first >= reached.last) dq.middleRows(i0, i1 - i0).setZero();
  }
}

/// Rows ahead that the row copies between the passes' buffers and the caller's tensors
/// prefetch: rows of an [n, H, d] tensor lie H d scalars apart, further than the hardware
/// prefetchers follow, so each row would otherwise wait for memory.
inline constexpr Index backward_prefetch_rows = 8;

/// Prefetches the cache lines of `count` scalars from `row` (for writing when `Write`).
template <bool Write, typename Scalar>
void prefetch_row(const Scalar* row, Index count) {
  // One row of a few cache lines, in a loop of its own that inlines into the row copies.
  const auto* bytes = reinterpret_cast<const char*>(row);
  const auto size = static_cast<std::size_t>(count) * sizeof(Scalar);
#if defined(__GNUC__)
  for (std::size_t offset = 0; offset < size; offset += 64)
    __builtin_prefetch(bytes + offset, Write ? 1 : 0);
  if (size > 0) __builtin_prefetch(bytes + size - 1, Write ? 1 : 0);
#else
  for (std::size_t offset = 0; offset < size; offset += 64)
    Eigen::internal::prefetch(bytes + offset);
#endif
}

/// prefetch_row for rows [first, first + count) of m (the first `cols` columns).
template <bool Write, typename Matrix>
void prefetch_rows(const Matrix& m, Index first, Index count) {
  for (Index r = first; r < first + count; ++r)
    prefetch_row<Write>(m.data() + r * m.outerStride(), m.cols());
}

/// How backward_store_rows writes a row: dst + src, 0 + src (the bits of adding src to zeroed
/// rows), or src as it is.
enum class RowStore { add, assign_sum, copy };

/// dst[r * dst_stride + c] = dst[...] + src[r * src_stride + c] (RowStore::add), 0 + src[...]
/// (assign_sum) or src[...] (copy) for r < rows, c < cols: src aligned (rows of whole packets),
/// dst any row stride. With `stream` (not for add) and packets the build can stream, the rows
/// of dst aligned to a packet are written with non-temporal stores (a store fence at the end),
/// the others as usual.
template <typename Scalar, RowStore Store>
void backward_store_rows(Scalar* dst, Index dst_stride, const Scalar* src, Index src_stride,
                         Index rows, Index cols, bool stream = false) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  const Packet zero = ei::pset1<Packet>(Scalar(0));
  bool streamed = false;
  for (Index r = 0; r < rows; ++r) {
    Scalar* target = dst + r * dst_stride;
    const Scalar* term = src + r * src_stride;
    const bool row_streams = Store != RowStore::add && streams_row(target, stream);
    if (!row_streams && r + backward_prefetch_rows < rows)
      prefetch_row<true>(target + backward_prefetch_rows * dst_stride, cols);
    store_row(
        target, cols, row_streams,
        [&](Index c) {
          const Packet x = ei::pload<Packet>(term + c);
          if constexpr (Store == RowStore::add) return ei::padd(ei::ploadu<Packet>(target + c), x);
          if constexpr (Store == RowStore::assign_sum) return ei::padd(zero, x);
          if constexpr (Store == RowStore::copy) return x;
        },
        [&](Index c) {
          if constexpr (Store == RowStore::add) return target[c] + term[c];
          if constexpr (Store == RowStore::assign_sum) return Scalar(0) + term[c];
          if constexpr (Store == RowStore::copy) return term[c];
        });
    streamed = streamed || row_streams;
  }
  if (streamed) stream_store_fence();
}

/// Keys j of row i with lo <= i - j + shift <= hi, rows i in [begin, end) and keys j in
/// [begin, key_end), and x_ij = tau q_i.k_j - slope |i - j + shift|, w = 1: exact ALiBi (causal
/// lo = 0, banded |i-j| <= W) and plain attention on one block (slope 0). Row i and key j are
/// the positions i + p0 and j + k0 of a sequence, shift = p0 - k0 (self-attention: shift 0,
/// key_end = end).
template <typename Scalar>
class WindowRule {
 public:
  WindowRule(Index begin, Index end, Index lo, Index hi, Scalar slope)
      : WindowRule(begin, end, end, lo, hi, slope, 0) {}
  WindowRule(Index begin, Index end, Index key_end, Index lo, Index hi, Scalar slope, Index shift)
      : begin_(begin),
        end_(end),
        key_end_(key_end),
        lo_(lo - shift),
        hi_(hi - shift),
        shift_(shift),
        slope_(slope) {
    for (Index a = 0; a < backward_query_rows; ++a) offsets_(a) = static_cast<Scalar>(a);
  }
  Index begin() const { return begin_; }
  Index end() const { return end_; }
  Index key_end() const { return key_end_; }

  KeyRange rows_reaching(Index j0, Index j1) const {
    return {std::max(begin_, j0 + lo_), std::min(end_, j1 + hi_)};
  }
  KeyRange rows_reaching(Index j0, Index j1, Index i0, Index i1) const {
    const Index first = std::clamp(j0 + lo_, std::max(begin_, i0), i1);
    return {first, std::clamp(j1 + hi_, first, std::min(end_, i1))};
  }
  KeyRange keys_reached(Index i0, Index i1) const {
    return {std::max(begin_, i0 - hi_), std::min(key_end_, i1 - lo_)};
  }
  /// Dead pairs, the backward's form of the forward's dead keys: with score_bound[i] >=
  /// |tau| |q_i| and key_norm[j] = |k_j| (rows and keys of the rule; the callers keep both alive
  /// while the rule is used), P_ij = e^{x_ij - lse_i} <= e^{score_bound_i key_norm_j - slope
  /// |i - j + shift| - lse_i}. Without bounds no pair is dead.
  void bound_scores(const Scalar* score_bound, const Scalar* key_norm) {
    score_bound_ = score_bound;
    key_norm_ = key_norm;
    dead_limit_ = dead_key_logit<Scalar>() + 1.0;
  }

  /// Whether every pair of rows [r0, r1) and keys [k0, k1) has that exponent below
  /// -(T + 1) (T = dead_key_logit), with a margin of 1 plus 2^-16 of its terms: then every
  /// P_ij is exactly 0 (the exponential returns 0 there, subnormals flushed) and the pairs add
  /// nothing to any gradient.
  bool dead_block(Index r0, Index r1, Index k0, Index k1, const Scalar* lse) const {
    if (score_bound_ == nullptr || k0 >= k1) return false;
    double largest = 0.0;
    for (Index j = k0; j < k1; ++j) {
      const auto norm = static_cast<double>(key_norm_[j]);
      if (!(norm <= std::numeric_limits<double>::max())) return false;  // inf or NaN
      largest = std::max(largest, norm);
    }
    const auto slope = static_cast<double>(slope_);
    for (Index i = r0; i < r1; ++i) {
      const Index p = i + shift_;  // the distance to key j is |p - j|
      const Index near = p < k0 ? k0 - p : (p >= k1 ? p - (k1 - 1) : 0);
      const double score = static_cast<double>(score_bound_[i]) * largest;
      const double bias = slope * static_cast<double>(near);
      const auto row_lse = static_cast<double>(lse[i]);
      const double slack = dead_key_slack(score + bias + std::abs(row_lse));
      if (!(score - bias - row_lse + slack < -dead_limit_)) return false;  // NaN: not dead
    }
    return true;
  }

  /// The window's bounds on i - j + shift, the shift and the ALiBi slope.
  Index lo() const { return lo_ + shift_; }
  Index hi() const { return hi_ + shift_; }
  Index shift() const { return shift_; }
  Scalar slope() const { return slope_; }

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
            (tau * column.segment(first, count) - row_lse.segment(first, count))
                .unaryExpr(ExpOp<Scalar>());
      } else {
        column.segment(first, count) =
            (tau * column.segment(first, count) -
             slope_ *
                 (offsets_.segment(first, count) + static_cast<Scalar>(i0 - j + shift_)).abs() -
             row_lse.segment(first, count))
                .unaryExpr(ExpOp<Scalar>());
      }
      column.tail(rows - last).setZero();
    }
  }

 private:
  Index begin_, end_, key_end_, lo_, hi_, shift_;  // lo_, hi_: bounds on i - j
  Scalar slope_;
  Eigen::Array<Scalar, backward_query_rows, 1> offsets_;
  const Scalar* score_bound_ = nullptr;  // bound_scores
  const Scalar* key_norm_ = nullptr;
  double dead_limit_ = 0.0;  // T + 1
};

/// The count structure of every query tile (tiles of tile_query_rows from query row 0) and
/// each query row's window [lo_i, hi_i) of keys with c_ij > 0: what the fused forward builds
/// tile by tile, kept for both backward passes (O(m s) memory). The n keys are the positions
/// origin .. origin + n - 1 of the hashes' sequence and the m query rows the positions
/// origin + shift .. origin + shift + m - 1 among them (0 <= shift, shift + m <= n;
/// self-attention: m = n, shift = 0); windows are in key indices (TileCounts::build).
struct CountWindows {
  std::vector<TileCounts> tiles;
  std::vector<Index> lo, hi;

  /// The tiles in parallel (parallel_loop), each tile's counts growing their own buffers (the
  /// tile's output: they only grow, so a CountWindows reused for heads of the same length
  /// allocates on its first head only).
  void build(const HashSet& hashes, Index m, Index n, Index shift, bool causal, Index origin) {
    const Index count = (m + tile_query_rows - 1) / tile_query_rows;
    tiles.resize(static_cast<std::size_t>(count));  // build() resets each (buffers reused)
    lo.resize(static_cast<std::size_t>(m));
    hi.resize(static_cast<std::size_t>(m));
    // Each tile's rectangles allocated once, not grown block by block.
    const std::size_t rectangles = TileCounts::max_rectangles(hashes, tile_query_rows);
    parallel_loop(static_cast<long>(count), LoopSchedule::dynamic(4), true, [&](long t) {
      const Index i0 = static_cast<Index>(t) * tile_query_rows;
      const Index rows = std::min(tile_query_rows, m - i0);
      TileCounts& counts = tiles[static_cast<std::size_t>(t)];
      counts.rectangles.reserve(rectangles);
      counts.build(hashes, shift + i0, rows, n, causal, origin);
      std::copy(counts.lo.begin(), counts.lo.end(), lo.begin() + i0);
      std::copy(counts.hi.begin(), counts.hi.end(), hi.begin() + i0);
    });
  }
};

/// Windows [lo_i, hi_i) and weights c_ij = #{k : bin_k(i) = bin_k(j)} (causal: j <= i), scores
/// x_ij = tau q_i.k_j: the fused LSH estimator, with the forward's windows and counts.
template <typename Scalar>
class CountRule {
  static constexpr Scalar max_exponent = Scalar(64);

 public:
  /// The m query rows and n keys of `windows` (CountWindows::build), query row i at key
  /// position i + shift.
  CountRule(const CountWindows& windows, Index m, Index n, Index shift, bool causal)
      : windows_(windows), m_(m), n_(n), shift_(shift), causal_(causal) {}
  Index begin() const { return 0; }
  Index end() const { return m_; }
  Index key_end() const { return n_; }
  Index shift() const { return shift_; }

  KeyRange rows_reaching(Index j0, Index j1) const {
    const auto& lo = windows_.lo;
    const auto& hi = windows_.hi;
    return {static_cast<Index>(std::upper_bound(hi.begin(), hi.end(), j0) - hi.begin()),
            static_cast<Index>(std::lower_bound(lo.begin(), lo.end(), j1) - lo.begin())};
  }
  // The ends are non-decreasing: the searches over rows [i0, i1) give the clamped results.
  KeyRange rows_reaching(Index j0, Index j1, Index i0, Index i1) const {
    const auto& lo = windows_.lo;
    const auto& hi = windows_.hi;
    const Index first =
        static_cast<Index>(std::upper_bound(hi.begin() + i0, hi.begin() + i1, j0) - hi.begin());
    const Index last =
        static_cast<Index>(std::lower_bound(lo.begin() + first, lo.begin() + i1, j1) - lo.begin());
    return {first, last};
  }
  KeyRange keys_reached(Index i0, Index i1) const {
    return {windows_.lo[static_cast<std::size_t>(i0)],
            windows_.hi[static_cast<std::size_t>(i1 - 1)]};
  }

  /// P_ij = c_ij e^{min(tau s_ij - lse_i, 64)} for the rows [i0, i0 + s.rows()) and keys
  /// [j0, j0 + s.cols()) of s (a block of the step's transposed tile, key stride
  /// backward_query_rows), packet by packet of the step's rows, at the keys each packet
  /// reaches (the others hold 0 already); the packets' other rows get 0 (their count is 0),
  /// with lse_i from work.lse (the step's, 0 past the domain).
  void probabilities(Index i0, Index j0, BackwardTileRef<Scalar> s, Scalar tau, const Scalar*,
                     BackwardWork<Scalar>& work) const {
    namespace ei = Eigen::internal;
    using Packet = TilePacket<Scalar>;
    constexpr Index P = tile_packet_size<Scalar>;
    constexpr Index Bq = backward_query_rows;
    static_assert(Bq == tile_query_rows, "one count tile per step");
    const Index keys = s.cols();
    const Index step0 = i0 / Bq * Bq;
    const Index a0 = i0 - step0, a1 = a0 + s.rows();
    const Index first_packet = a0 / P * P;
    Scalar* p = s.data() - a0;       // row step0, key j0
    Scalar* c = work.counts.data();  // c_{step0 + a, j0 + b} at b * Bq + a
    const TileCounts& counts = windows_.tiles[static_cast<std::size_t>(step0 / Bq)];
    const auto packet_keys = [&](Index a) {
      const KeyRange reach = keys_reached(step0 + std::max(a, a0), step0 + std::min(a + P, a1));
      const Index first = std::clamp<Index>(reach.first - j0, 0, keys);
      return KeyRange{first, std::clamp<Index>(reach.last - j0, first, keys)};
    };
    // Difference array over keys: +1 at each rectangle's first key, -1 past its last (not
    // needed causally: a block's keys past its end are hidden from all its rows), then a
    // running sum per packet. Small integers: exact.
    const Packet zero = ei::pset1<Packet>(Scalar(0));
    for (Index a = first_packet; a < a1; a += P) {
      const KeyRange reach = packet_keys(a);
      for (Index b = reach.first; b < reach.last; ++b) ei::pstore(c + b * Bq + a, zero);
    }
    for (const CountRectangle& rect : counts.rectangles) {
      if (rect.key_end <= j0 || rect.key_begin >= j0 + keys) continue;
      const Index first = std::max(rect.row_begin, a0), last = std::min(rect.row_end, a1);
      if (first >= last) continue;
      count_column_add(c + (std::max(rect.key_begin, j0) - j0) * Bq, first, last, Scalar(1));
      if (!causal_ && rect.key_end < j0 + keys)
        count_column_add(c + (rect.key_end - j0) * Bq, first, last, Scalar(-1));
    }
    const Packet scale = ei::pset1<Packet>(tau), cap = ei::pset1<Packet>(max_exponent);
    const Packet lanes = ei::plset<Packet>(Scalar(0));
    for (Index a = first_packet; a < a1; a += P) {
      const KeyRange reach = packet_keys(a);
      const Packet row_lse = ei::pload<Packet>(work.lse.data() + a);
      Packet count = zero;
      for (Index b = reach.first; b < reach.last; ++b) {
        count = ei::padd(count, ei::pload<Packet>(c + b * Bq + a));
        Scalar* entry = p + b * Bq + a;
        // Exponents capped at max_exponent: where c = 0 the score may be anything, and
        // 0 * e^{cap} is 0 where 0 * inf would be NaN; where c > 0 the exponent is <= 0 up
        // to rounding (P_ij <= 1), far below the cap.
        Packet prob = ei::pmul(
            count, exp_packet(ei::pmin(ei::psub(ei::pmul(scale, ei::pload<Packet>(entry)), row_lse),
                                       cap)));
        if (causal_) {
          // Row step0 + a + r (key position step0 + a + r + shift) sees key j0 + b iff
          // r >= j0 + b - step0 - a - shift (clamped to [-1, P], exact in Scalar).
          const auto hidden =
              static_cast<Scalar>(std::clamp<Index>(j0 + b - step0 - a - shift_, -1, P));
          prob = ei::pand(ei::pcmp_le(ei::pset1<Packet>(hidden), lanes), prob);
        }
        ei::pstore(entry, prob);
      }
    }
  }

 private:
  const CountWindows& windows_;
  Index m_, n_, shift_;
  bool causal_;
};

/// Writes the dK, dV sums of the key tile [j0, j0 + keys) (`rows`; null when no query row
/// reached it) to the outputs: added to them, or with fresh outputs assigned 0 + sum (0 where
/// no row reached the tile), with non-temporal stores when out.stream.
template <typename Scalar>
void backward_write_key_tile(BackwardOutputs<Scalar>& out, Index j0, Index keys,
                             const BackwardKeyTile<Scalar>* rows, Index dp, Index dvp) {
  if (rows == nullptr) {
    if (out.fresh) {
      out.dk.middleRows(j0, keys).setZero();
      out.dv.middleRows(j0, keys).setZero();
    }
    return;
  }
  for (const auto& [m, sum, stride] :
       {std::tuple{&out.dk, rows->dk_sum, dp}, std::tuple{&out.dv, rows->dv_sum, dvp}}) {
    Scalar* target = m->data() + j0 * m->outerStride();
    if (out.fresh) {
      backward_store_rows<Scalar, RowStore::assign_sum>(target, m->outerStride(), sum, stride, keys,
                                                        m->cols(), out.stream);
    } else {
      backward_store_rows<Scalar, RowStore::add>(target, m->outerStride(), sum, stride, keys,
                                                 m->cols());
    }
  }
}

/// Key groups: backward_group_tiles consecutive key tiles, aligned from the rule's first row.
/// The dQ terms of a query step and a key group make one partial sum (work.dq_part), which is
/// added to the step's dQ rows in increasing group order.
inline constexpr Index backward_group_keys = backward_group_tiles * backward_tile;

/// Whether the block of rows [r0, r1) and keys [k0, k1) has every P_ij exactly 0 under `rule`
/// (WindowRule::dead_block; the count rule has none): the passes then skip its products and
/// leave every sum as it is, which is what adding its zero terms gives (up to the sign of a zero).
template <typename Rule, typename Scalar>
bool backward_dead_block(const Rule& rule, Index r0, Index r1, Index k0, Index k1,
                         const Scalar* lse) {
  if constexpr (std::is_same_v<Rule, WindowRule<Scalar>>)
    return rule.dead_block(r0, r1, k0, k1, lse);
  else
    return false;
}

/// No ordering of the dQ additions: the caller visits the key groups in increasing order on one
/// thread.
struct InOrder {
  template <typename Add>
  void add(Index, Index, Add&& add_to_dq) const {
    add_to_dq();
  }
};

/// The dQ additions of one query step in increasing key group order across threads: the key
/// groups that step I reaches are the consecutive groups first(I) .. last(I) (windows are
/// intervals with non-decreasing ends), so next[I] counts them off. The thread holding key
/// group G waits until next[I] = G, adds, and sets next[I] = G + 1. Key groups are handed out
/// in increasing order and the thread holding the smallest unfinished one never waits, so
/// every thread makes progress. When a key group's job fails, abandon() makes every waiting
/// thread (and every later add) throw LoopStopped, since the group's additions will not come.
class KeyGroupOrder {
 public:
  template <typename Rule>
  KeyGroupOrder(const Rule& rule, Index tiles)
      : next_(new std::atomic<Index>[static_cast<std::size_t>(std::max<Index>(tiles, 1))]) {
    const Index begin = rule.begin(), end = rule.end();
    for (Index t = 0; t < tiles; ++t) {
      const Index i0 = begin + t * backward_query_rows;
      const KeyRange reached = rule.keys_reached(i0, std::min(end, i0 + backward_query_rows));
      next_[static_cast<std::size_t>(t)].store(
          reached.first < reached.last ? (reached.first - begin) / backward_group_keys : 0,
          std::memory_order_relaxed);
    }
  }

  template <typename Add>
  void add(Index query_tile, Index key_group, Add&& add_to_dq) const {
    std::atomic<Index>& next = next_[static_cast<std::size_t>(query_tile)];
    for (int spin = 0; next.load(std::memory_order_acquire) != key_group; ++spin) {
      if (abandoned_.load(std::memory_order_relaxed)) throw LoopStopped{};
      if (spin >= 64) std::this_thread::yield();
    }
    add_to_dq();
    next.store(key_group + 1, std::memory_order_release);
  }

  /// A key group's job failed: the waits end (add throws LoopStopped).
  void abandon() const { abandoned_.store(true, std::memory_order_relaxed); }

 private:
  std::unique_ptr<std::atomic<Index>[]> next_;
  mutable std::atomic<bool> abandoned_{false};
};

#if POSLSH_X86_UNITS

/// acc[r * acc_stride + c] += sum_{t < pairs} pair_p[r row_step + t pair_step] . pair_v[t cols +
/// c] (AVX512-BF16, in registers from acc) for r < rows, c < count: pair_value_rows in blocks of
/// 4 rows, then single rows.
inline void backward_pair_rows(const std::uint32_t* pair_p, Index row_step, Index pair_step,
                               const std::uint32_t* pair_v, Index cols, Index pairs, Index rows,
                               Index count, const float* ones, float* acc, Index acc_stride) {
  Index r = 0;
  for (; r + 4 <= rows; r += 4)
    pair_value_rows<4>(pair_p + r * row_step, pair_step, pair_v, cols, pairs, ones,
                       acc + r * acc_stride, acc_stride, count, row_step);
  for (; r < rows; ++r)
    pair_value_rows<1>(pair_p + r * row_step, pair_step, pair_v, cols, pairs, ones,
                       acc + r * acc_stride, acc_stride, count, row_step);
}

/// The finish of pair_score_span that turns S^T into P^T for a WindowRule on the AVX512-BF16
/// unit: for key b of the tile and the 16 rows a' from a of the step (row i = i0 + a', key
/// j = j0 + b, t = i - j + shift = row_minus_key + a' - b, the distance of their positions),
///   P^T[b][a'] = e^{tau s_ij - lse_i - slope |t|}  where lo <= t <= hi, a0 <= a' < a1,
///                0                                 elsewhere,
/// at probs + b * backward_query_rows + a' for the rows a' of the finish's mask (the
/// exponential of pair_exp; tau s - lse in one rounding, lse_i at lse + a': the step's). The
/// distances are int: |t| < 2^30.
struct PairWindowProbabilities {
  float tau, slope;
  const float* lse;
  float* probs;
  int row_minus_key, lo, hi;
  Index a0, a1;

  template <int Keys>
  POSLSH_AVX512_BF16_INLINE void operator()(const __m512 (&acc)[Keys], Index b0, Index a,
                                            __mmask16 mask) const {
    constexpr Index Bq = backward_query_rows;
    const __mmask16 rows = mask & pair_row_mask(a, a0, a1);
    const __m512 row_lse = _mm512_loadu_ps(lse + a);
    const __m512 scale = _mm512_set1_ps(tau), minus_slope = _mm512_set1_ps(-slope);
    const __m512i first =
        _mm512_add_epi32(_mm512_set1_epi32(row_minus_key + static_cast<int>(a - b0)),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    POSLSH_TILE_UNROLL
    for (int kk = 0; kk < Keys; ++kk) {
      const __m512i distance = _mm512_sub_epi32(first, _mm512_set1_epi32(kk));
      const __mmask16 inside = _mm512_mask_cmple_epi32_mask(
          _mm512_mask_cmpge_epi32_mask(rows, distance, _mm512_set1_epi32(lo)), distance,
          _mm512_set1_epi32(hi));
      const __m512 x = _mm512_fmadd_ps(minus_slope, _mm512_abs_ps(_mm512_cvtepi32_ps(distance)),
                                       _mm512_fmsub_ps(scale, acc[kk], row_lse));
      _mm512_mask_storeu_ps(probs + (b0 + kk) * Bq + a, mask,
                            _mm512_maskz_mov_ps(inside, pair_exp(x)));
    }
  }
};

/// The finish of the S^T products that forms a rule's P^T in registers, where the rule has one
/// (PairWindowProbabilities for the query rows [a0, a1) of the step at i0 and the key tile at
/// j0, lse and P^T as there); none for the other rules, whose P^T is formed from the stored
/// scores by Rule::probabilities (the fused LSH counts: a running sum along the keys).
template <typename Rule>
std::optional<PairWindowProbabilities> pair_probabilities(const Rule&, float, const float*, float*,
                                                          Index, Index, Index, Index) {
  return std::nullopt;
}

/// The window rule's (exact and banded ALiBi, plain attention on a block): in registers when
/// its distances fit the finish's int (a domain shorter than 2^30).
inline std::optional<PairWindowProbabilities> pair_probabilities(const WindowRule<float>& rule,
                                                                 float tau, const float* lse,
                                                                 float* probs, Index i0, Index j0,
                                                                 Index a0, Index a1) {
  constexpr Index int_range = Index{1} << 30;
  if (std::max(rule.end(), rule.key_end()) - rule.begin() + std::abs(rule.shift()) >= int_range)
    return std::nullopt;
  const auto bound = [&](Index x) {
    return static_cast<int>(std::clamp<Index>(x, -int_range, int_range));
  };
  return PairWindowProbabilities{tau,
                                 rule.slope(),
                                 lse,
                                 probs,
                                 static_cast<int>(i0 - j0 + rule.shift()),
                                 bound(rule.lo()),
                                 bound(rule.hi()),
                                 a0,
                                 a1};
}

/// The finish of pair_score_span that turns dP^T into dS^T on the AVX512-BF16 unit: for key b
/// of the tile and the rows a' of the finish's mask (of the 16 from a) of the step, with P^T at
/// probs + b * backward_query_rows + a' and D of the step at delta + a',
///   dS^T[b][a'] = tau P (dP - D)  (P = dS = 0 at the rows outside [a0, a1)),
/// P and dS rounded to bfloat16 (vcvtneps2bf16: round to nearest even; subnormals are flushed
/// before it) into p_rounded and ds_rounded (bfloat16 bits, key b's row at b *
/// backward_query_rows), and dS into its half of the pair along the keys in pair_ds
/// (pair_pack_probs' layout from pair first_pair: the low half of word (b / 2 - first_pair) *
/// backward_query_rows + a' for even b, the high half for odd b). With `dp` not null, dP^T is
/// also stored there (key b's row at b * backward_query_rows).
struct PairGradients {
  float tau;
  const float* probs;
  const float* delta;
  Eigen::bfloat16* p_rounded;
  Eigen::bfloat16* ds_rounded;
  std::uint32_t* pair_ds;
  Index first_pair;
  float* dp;
  Index a0, a1;

  template <int Keys>
  POSLSH_AVX512_BF16_INLINE void operator()(const __m512 (&acc)[Keys], Index b0, Index a,
                                            __mmask16 mask) const {
    const __m512 scale = _mm512_set1_ps(tau), row_delta = _mm512_loadu_ps(delta + a);
    const __mmask16 rows = mask & pair_row_mask(a, a0, a1);
    constexpr Index Bq = backward_query_rows;
    // The low halves of the words of the mask's rows (bit 2 r for row r).
    std::uint32_t low_halves = mask;
    low_halves = (low_halves | low_halves << 8) & 0x00FF00FFu;
    low_halves = (low_halves | low_halves << 4) & 0x0F0F0F0Fu;
    low_halves = (low_halves | low_halves << 2) & 0x33333333u;
    low_halves = (low_halves | low_halves << 1) & 0x55555555u;
    POSLSH_TILE_UNROLL
    for (int kk = 0; kk < Keys; ++kk) {
      const Index b = b0 + kk, at = b * Bq + a;
      const __m512 prob = _mm512_maskz_loadu_ps(rows, probs + at);
      const __m512 grad =
          _mm512_maskz_mul_ps(rows, _mm512_mul_ps(scale, prob), _mm512_sub_ps(acc[kk], row_delta));
      const auto grad_bits = (__m256i)_mm512_cvtneps_pbh(grad);
      _mm256_mask_storeu_epi16(p_rounded + at, mask, (__m256i)_mm512_cvtneps_pbh(prob));
      _mm256_mask_storeu_epi16(ds_rounded + at, mask, grad_bits);
      const __m512i word = _mm512_cvtepu16_epi32(grad_bits);
      std::uint32_t* pair = pair_ds + (b / 2 - first_pair) * Bq + a;
      if (b % 2 == 0) {
        _mm512_mask_storeu_epi16(pair, low_halves, word);
      } else {
        _mm512_mask_storeu_epi16(pair, low_halves << 1, _mm512_slli_epi32(word, 16));
      }
      if (dp != nullptr) _mm512_mask_storeu_ps(dp + at, mask, acc[kk]);
    }
  }

  /// What the finish stores for key b and the `rows` rows from a where none of them reaches b
  /// (P = dS = 0).
  void unreached(Index b, Index a, Index rows) const {
    constexpr Index Bq = backward_query_rows;
    const Index at = b * Bq + a;
    std::fill_n(p_rounded + at, rows, Eigen::bfloat16(0.0f));
    std::fill_n(ds_rounded + at, rows, Eigen::bfloat16(0.0f));
    clear_half(b, a, a + rows);
    if (dp != nullptr) std::fill_n(dp + at, rows, 0.0f);
  }

  /// Key b's half of the pairs of rows [first, last) set to 0 (the key of a pair outside the
  /// tile's keys).
  void clear_half(Index b, Index first, Index last) const {
    constexpr Index Bq = backward_query_rows;
    std::uint32_t* words = pair_ds + (b / 2 - first_pair) * Bq;
    const std::uint32_t keep = b % 2 == 0 ? 0xFFFF0000u : 0x0000FFFFu;
    for (Index r = first; r < last; ++r) words[r] &= keep;
  }
};

/// The three products of backward_pair on the AVX512-BF16 unit, from P and dS rounded to
/// bfloat16 (rows [a0, a1) and keys [b0, b1) of the pair, by PairGradients) and the
/// pairs of the step and the key tile (0 at the rows and keys outside the pair that whole pairs
/// take in):
///   dV_J += P^T dO and dK_J += dS^T Q  (each key over the step's rows, pairs along the rows),
///   work.dq_part += dS K_J             (each row over the tile's keys, pairs along the keys;
///                                       row a at a d_p),
/// each sum formed on the running sum (dk_sum, dv_sum, dq_part), pairs in order.
inline void backward_pair_products(Index a0, Index a1, Index b0, Index b1,
                                   const StepOperands<float>& step,
                                   const BackwardKeyTile<float>& tile_rows,
                                   BackwardWork<float>& work) {
  constexpr Index Bq = backward_query_rows;
  const Index a_lo = a0 / 2 * 2, a_hi = (a1 + 1) / 2 * 2;
  const float* ones = work.ones.data();
  const auto words = [](const std::vector<Eigen::bfloat16>& rounded, Index b, Index a) {
    return reinterpret_cast<const std::uint32_t*>(rounded.data() + b * Bq + a);
  };
  const Index row_pairs = (a_hi - a_lo) / 2;
  backward_pair_rows(words(work.p_rounded, b0, a_lo), Bq / 2, 1,
                     step.pair_o_rows + a_lo / 2 * work.pair_dv, work.pair_dv, row_pairs, b1 - b0,
                     work.dv, ones, tile_rows.dv_sum + b0 * work.dvp, work.dvp);
  backward_pair_rows(words(work.ds_rounded, b0, a_lo), Bq / 2, 1,
                     step.pair_q_rows + a_lo / 2 * work.pair_d, work.pair_d, row_pairs, b1 - b0,
                     work.d, ones, tile_rows.dk_sum + b0 * work.dp, work.dp);
  // dS K: keys in whole pairs from b0 / 2 (the key outside [b0, b1) of a pair gets dS = 0).
  const Index b_lo = b0 / 2 * 2, b_hi = (b1 + 1) / 2 * 2;
  const Index key_pairs = (b_hi - b_lo) / 2;
  backward_pair_rows(work.pair_ds.data() + a0, 1, Bq, tile_rows.pair_k + b_lo / 2 * work.pair_d,
                     work.pair_d, key_pairs, a1 - a0, work.d, ones,
                     work.dq_part.data() + a0 * work.dp, work.dp);
}

/// backward_pair on the AVX512-BF16 unit (in.paired) for rows [a0, a1) of the step at i0 and
/// keys [b0, b1) of the tile at j0, `visit` the pair's walk (backward_pair: visit(block,
/// unreached) calls block(first, last, a, count) for keys [first, last) and `count` packets
/// of rows from a, unreached(b, a, rows) for each key b of [b0, b1) that the packet of `rows`
/// rows from a does not reach; a packet is 16 rows or, in builds without AVX-512, fewer):
/// S^T by pair_score_span, turned into P^T as it leaves the registers for a WindowRule
/// (PairWindowProbabilities), or stored and turned by rule.probabilities; dP^T by
/// pair_score_span, turned into dS^T with P and dS rounded as it leaves the registers
/// (PairGradients, which also stores dP^T at `dp` when it is not null); then the three
/// products (backward_pair_products). P^T stays in work.probabilities.
template <typename Rule, typename Visit>
void backward_pair_units(const BackwardInputs<float, Eigen::bfloat16>& in, const Rule& rule,
                         Index j0, Index i0, Index a0, Index a1, Index b0, Index b1,
                         const Visit& visit, const StepOperands<float>& step,
                         const BackwardKeyTile<float>& tile_rows, BackwardWork<float>& work,
                         float* dp) {
  constexpr Index Bq = backward_query_rows;
  const Index d = work.d, dv = work.dv;
  float* p = work.probabilities.data();
  // pair_score_span of the step's query (or dO) pairs against the tile's K (or V) rows.
  constexpr Index P = tile_packet_size<float>;
  const auto span = [&](bool values, const auto& finish) {
    return [&, values](Index first, Index last, Index a, Index count) {
      pair_score_span(values ? step.pair_ot : step.pair_qt, Bq,
                      values ? tile_rows.v_bits : tile_rows.k_bits,
                      pair_row_stride(values ? dv : d), ((values ? dv : d) + 1) / 2, first, last, a,
                      a + count * P, finish);
    };
  };
  const auto zero_probabilities = [&](Index b, Index a, Index rows) {
    std::fill_n(p + b * Bq + a, rows, 0.0f);
  };
  if (const auto in_registers =
          pair_probabilities(rule, in.tau, work.lse.data(), p, i0, j0, a0, a1)) {
    visit(span(false, *in_registers), zero_probabilities);
  } else {
    visit(span(false, PairScoreStore{1.0f, p, Bq}), zero_probabilities);
    Eigen::Map<Eigen::MatrixXf, 0, Eigen::OuterStride<>> tile(p + b0 * Bq + a0, a1 - a0, b1 - b0,
                                                              Eigen::OuterStride<>(Bq));
    rule.probabilities(i0 + a0, j0 + b0, tile, in.tau, in.lse, work);
  }
  const PairGradients gradients{in.tau,
                                p,
                                work.delta.data(),
                                work.p_rounded.data(),
                                work.ds_rounded.data(),
                                work.pair_ds.data(),
                                b0 / 2,
                                dp,
                                a0,
                                a1};
  visit(span(true, gradients),
        [&](Index b, Index a, Index rows) { gradients.unreached(b, a, rows); });
  // The key outside [b0, b1) of the pairs at either end.
  if (b0 % 2 == 1) gradients.clear_half(b0 - 1, a0, a1);
  if (b1 % 2 == 1) gradients.clear_half(b1, a0, a1);
  backward_pair_products(a0, a1, b0, b1, step, tile_rows, work);
}

#endif  // POSLSH_X86_UNITS

/// Rows [first, first + count) of m copied to `buffer` (`padded` columns; the columns past
/// m's stay as they are): contiguous, aligned rows for the kernels. Rows stored in a
/// half-precision type are widened to Scalar as they are copied (tile_widen, exact), so the
/// buffer holds what the copy of a Scalar matrix of the widened values holds.
template <typename Scalar, typename Input>
void backward_rows(const ConstMatrixRef<Input>& m, Index first, Index count, Index padded,
                   Scalar* buffer) {
  if constexpr (std::is_same_v<Input, Scalar>) {
    Eigen::Map<RowMatrix<Scalar>>(buffer, count, padded).leftCols(m.cols()) =
        m.middleRows(first, count);
  } else {
    for (Index r = 0; r < count; ++r)
      tile_widen<Scalar>(m.data() + (first + r) * m.outerStride(), buffer + r * padded, m.cols());
  }
}

/// Packs the step at i0 (`rows` rows of q and dout) into qt, ot, q_rows, o_rows (padded
/// columns d_p, d_vp, zero past the inputs' columns and rows). Half-precision rows are
/// widened into q_rows and o_rows (backward_rows) and Q^T, dO^T packed from there; Scalar
/// rows are packed from the inputs. Either way the same values.
template <typename Scalar, typename Input>
void pack_step(const ConstMatrixRef<Input>& q, const ConstMatrixRef<Input>& dout, Index i0,
               Index rows, Index dp, Index dvp, Scalar* qt, Scalar* ot, Scalar* q_rows,
               Scalar* o_rows) {
  constexpr Index Bq = backward_query_rows;
  Eigen::Map<RowMatrix<Scalar>> qr(q_rows, Bq, dp), orows(o_rows, Bq, dvp);
  backward_rows<Scalar>(q, i0, rows, dp, q_rows);
  qr.topRightCorner(rows, dp - q.cols()).setZero();
  qr.bottomRows(Bq - rows).setZero();
  backward_rows<Scalar>(dout, i0, rows, dvp, o_rows);
  orows.topRightCorner(rows, dvp - dout.cols()).setZero();
  orows.bottomRows(Bq - rows).setZero();
  if constexpr (std::is_same_v<Input, Scalar>) {
    tile_pack_queries<Scalar>(q, i0, 0, rows, Scalar(1), qt, Bq);
    tile_pack_queries<Scalar>(dout, i0, 0, rows, Scalar(1), ot, Bq);
  } else {
    tile_pack_queries<Scalar>(ConstMatrixRef<Scalar>(qr.leftCols(q.cols())), 0, 0, rows, Scalar(1),
                              qt, Bq);
    tile_pack_queries<Scalar>(ConstMatrixRef<Scalar>(orows.leftCols(dout.cols())), 0, 0, rows,
                              Scalar(1), ot, Bq);
  }
}

#if POSLSH_X86_UNITS
/// For the AVX512-BF16 products (in.paired): the step at i0 (`rows` rows of q and dout) as
/// pairs along their columns into pair_qt, pair_ot ((d + 1) / 2 and (d_v + 1) / 2 rows of 64
/// words) and along the rows into pair_q_rows, pair_o_rows (32 pairs of pair_row_words(d) and
/// (d_v) words), the only operands of the step the paired products read (StepOperands).
inline void pack_pair_step(const BackwardInputs<float, Eigen::bfloat16>& in, Index i0, Index rows,
                           std::uint32_t* pair_qt, std::uint32_t* pair_ot,
                           std::uint32_t* pair_q_rows, std::uint32_t* pair_o_rows) {
  constexpr Index Bq = backward_query_rows;
  pair_pack_queries(in.q, i0, 0, rows, pair_qt, Bq);
  pair_pack_queries(in.dout, i0, 0, rows, pair_ot, Bq);
  pair_pack_values(bf16_words(in.q.data() + i0 * in.q.outerStride()), in.q.outerStride(), rows,
                   in.q.cols(), pair_row_words(in.q.cols()), pair_q_rows);
  pair_pack_values(bf16_words(in.dout.data() + i0 * in.dout.outerStride()), in.dout.outerStride(),
                   rows, in.dout.cols(), pair_row_words(in.dout.cols()), pair_o_rows);
}
#endif

/// Key tile [j0, j0 + keys) into slot `slot` of work (after work.prepare and reserve_key_tiles):
/// its K and V rows widened to Scalar (k_rows, v_rows: backward_rows), or for the AVX512-BF16
/// products (in.paired; after work.prepare_pairs) K as pairs along the keys (pair_k) and the K
/// and V rows copied as they are (k_bits, v_bits), the only operands of the tile the paired
/// products read.
template <typename Scalar, typename Input>
void backward_load_key_tile(const BackwardInputs<Scalar, Input>& in, Index j0, Index keys,
                            Index slot, BackwardWork<Scalar>& work) {
  constexpr Index Bk = backward_tile;
#if POSLSH_X86_UNITS
  if constexpr (backward_pairs_v<Scalar, Input>) {
    if (in.paired) {
      pair_pack_values(bf16_words(in.k.data() + j0 * in.k.outerStride()), in.k.outerStride(), keys,
                       in.k.cols(), work.pair_d,
                       work.pair_k.data() + slot * (Bk / 2) * work.pair_d);
      for (const auto& [m, bits] :
           {std::pair{&in.k, work.k_bits.data() + slot * Bk * work.pair_d},
            std::pair{&in.v, work.v_bits.data() + slot * Bk * work.pair_dv}}) {
        pair_copy_rows(bf16_words(m->data() + j0 * m->outerStride()), m->outerStride(), keys,
                       m->cols(), bits, pair_row_stride(m->cols()));
      }
      return;
    }
  }
#endif
  backward_rows<Scalar>(in.k, j0, keys, work.dp, work.k_rows.data() + slot * Bk * work.dp);
  backward_rows<Scalar>(in.v, j0, keys, work.dvp, work.v_rows.data() + slot * Bk * work.dvp);
}

/// The rows and the dK, dV sums of the key tile in slot `slot` of work (backward_load_key_tile).
template <typename Scalar, typename Input>
BackwardKeyTile<Scalar> backward_key_tile(const BackwardInputs<Scalar, Input>& in, Index slot,
                                          BackwardWork<Scalar>& work) {
  constexpr Index Bk = backward_tile;
  BackwardKeyTile<Scalar> tile{
      work.k_rows.data() + slot * Bk * work.dp, work.v_rows.data() + slot * Bk * work.dvp,
      work.dk_sum.data() + slot * Bk * work.dp, work.dv_sum.data() + slot * Bk * work.dvp};
  if (in.paired) {
    tile.pair_k = work.pair_k.data() + slot * (Bk / 2) * work.pair_d;
    tile.k_bits = work.k_bits.data() + slot * Bk * work.pair_d;
    tile.v_bits = work.v_bits.data() + slot * Bk * work.pair_dv;
  }
  return tile;
}

/// The operands (StepOperands) of every query step of a domain (rows [begin, end) in steps of
/// backward_query_rows from begin), packed once per pass: O(n (d + d_v)) scalars (or words of
/// bfloat16 pairs for the AVX512-BF16 products), reusable.
template <typename Scalar>
class PackedSteps {
 public:
  /// Packs every step of the rows [begin_row, end_row) of in.q and in.dout, in parallel
  /// (parallel_loop) when `parallel`: for the float products (pack_step: rows of Input widened
  /// to Scalar) or, with in.paired, for the AVX512-BF16 ones (pack_pair_step). The buffers
  /// grow (the only allocation) before the loop.
  template <typename Input>
  void pack(const BackwardInputs<Scalar, Input>& in, Index begin_row, Index end_row,
            bool parallel) {
    constexpr Index Bq = backward_query_rows;
    const auto count = static_cast<long>(layout(in, begin_row, end_row));
    // The packing multiplies by 1: its threads flush subnormals, rounding as the passes round.
    parallel_loop<FlushSubnormals>(count, LoopSchedule::blocks(), parallel, [&](long t) {
      const Index i0 = begin_ + static_cast<Index>(t) * Bq;
      pack_one(in, static_cast<Index>(t), i0, std::min(Bq, end_row - i0));
    });
  }

  /// Grows the buffers to hold the steps of the rows [begin_row, end_row) (what pack() of them
  /// would allocate).
  template <typename Input>
  void reserve(const BackwardInputs<Scalar, Input>& in, Index begin_row, Index end_row) {
    layout(in, begin_row, end_row);
  }

  /// Packs the one step of the rows [i0, i0 + rows) (rows <= backward_query_rows) in place of
  /// what was packed, on the calling thread (which flushes subnormals, as the passes' threads
  /// do).
  template <typename Input>
  void pack_single(const BackwardInputs<Scalar, Input>& in, Index i0, Index rows) {
    layout(in, i0, i0 + rows);
    pack_one(in, 0, i0, rows);
  }

  /// The operands of the step at i0.
  StepOperands<Scalar> step(Index i0) const {
    const Index t = (i0 - begin_) / backward_query_rows;
    StepOperands<Scalar> operands;
    if (paired_) {
      operands.pair_qt = pairs_[0].data() + t * step_size_[0];
      operands.pair_ot = pairs_[1].data() + t * step_size_[1];
      operands.pair_q_rows = pairs_[2].data() + t * step_size_[2];
      operands.pair_o_rows = pairs_[3].data() + t * step_size_[3];
    } else {
      operands.qt = values_[0].data() + t * step_size_[0];
      operands.ot = values_[1].data() + t * step_size_[1];
      operands.q_rows = values_[2].data() + t * step_size_[2];
      operands.o_rows = values_[3].data() + t * step_size_[3];
    }
    return operands;
  }

 private:
  /// Sets the layout for the steps of the rows [begin_row, end_row) and grows the buffers to
  /// hold them; returns the number of steps.
  template <typename Input>
  Index layout(const BackwardInputs<Scalar, Input>& in, Index begin_row, Index end_row) {
    constexpr Index Bq = backward_query_rows;
    constexpr Index P = tile_packet_size<Scalar>;
    begin_ = begin_row;
    paired_ = in.paired;
    const Index d = in.q.cols(), dv = in.dout.cols();
    dp_ = (d + P - 1) / P * P;
    dvp_ = (dv + P - 1) / P * P;
    // Per step: Q^T, dO^T, the Q rows and the dO rows.
    step_size_ = paired_
                     ? std::array<Index, 4>{(d + 1) / 2 * Bq, (dv + 1) / 2 * Bq,
                                            Bq / 2 * pair_row_words(d), Bq / 2 * pair_row_words(dv)}
                     : std::array<Index, 4>{d * Bq, dv * Bq, dp_ * Bq, dvp_ * Bq};
    const Index steps = (end_row - begin_ + Bq - 1) / Bq;
    for (std::size_t k = 0; k < 4; ++k) {
      if (paired_) {
        grow(pairs_[k], steps * step_size_[k]);
      } else {
        grow(values_[k], steps * step_size_[k]);
      }
    }
    return steps;
  }

  /// Packs step t (rows [i0, i0 + rows)) into its place.
  template <typename Input>
  void pack_one(const BackwardInputs<Scalar, Input>& in, Index t, Index i0, Index rows) {
    const auto place = [&](auto& buffers, std::size_t k) {
      return buffers[k].data() + t * step_size_[k];
    };
#if POSLSH_X86_UNITS
    if constexpr (backward_pairs_v<Scalar, Input>) {
      if (paired_) {
        pack_pair_step(in, i0, rows, place(pairs_, 0), place(pairs_, 1), place(pairs_, 2),
                       place(pairs_, 3));
        return;
      }
    }
#endif
    pack_step<Scalar>(in.q, in.dout, i0, rows, dp_, dvp_, place(values_, 0), place(values_, 1),
                      place(values_, 2), place(values_, 3));
  }

  /// Every entry of the buffers in use is written by pack(): they only grow, so that one
  /// PackedSteps serves many passes (heads) without new memory.
  static void grow(Eigen::Matrix<Scalar, Eigen::Dynamic, 1>& buffer, Index size) {
    if (buffer.size() < std::max<Index>(size, 1)) buffer.resize(std::max<Index>(size, 1));
  }
  static void grow(std::vector<std::uint32_t>& buffer, Index size) {
    const auto words = static_cast<std::size_t>(std::max<Index>(size, 1));
    if (buffer.size() < words) buffer.resize(words);
  }

  std::array<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>, 4> values_;  // float products
  std::array<std::vector<std::uint32_t>, 4> pairs_;                 // AVX512-BF16 products
  std::array<Index, 4> step_size_{};
  Index begin_ = 0, dp_ = 0, dvp_ = 0;
  bool paired_ = false;
};

/// The key tile [j0, j1) against rows [r0, r1) of the query step at i0 (r1 - i0 <= 64), keys
/// [k0, k1) of the tile (every key those rows reach), Q^T and dO^T of the step in qt, ot, the
/// tile's K and V rows and dK, dV sums in `tile`: with P recomputed by the rule and D of the
/// step in work.delta (indexed from i0),
///   S^T = K Q^T, P^T (rule), dP^T = V dO^T, dS^T = tau P^T o (dP^T - D),
///   dV_J += P^T dO,  dK_J += dS^T Q  (tile.dv_sum, tile.dk_sum: each key j over the rows that
///   reach it),  work.dq_part += dS K_J  (each row over the keys it reaches; row a of the step
///   at a d_p: the key group's partial sum, backward_key_group).
/// Every sum is in increasing order of its terms, in registers (detail/backward/kernels.hpp).
/// With `distance_sum` not null, also *distance_sum += sum over the pair's entries of
/// G_ij |i - j + shift| (G = dS / tau, summed in double key by key:
/// BackwardOutputs::distance_sums).
template <typename Scalar, typename Input, typename Rule>
void backward_pair(const BackwardInputs<Scalar, Input>& in, const Rule& rule, Index j0, Index i0,
                   Index r0, Index r1, Index k0, Index k1, const StepOperands<Scalar>& step,
                   const BackwardKeyTile<Scalar>& tile_rows, BackwardWork<Scalar>& work,
                   double* distance_sum = nullptr) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  constexpr Index P = tile_packet_size<Scalar>;
  constexpr Index Bq = backward_query_rows;
  const Index d = work.d, dv = work.dv, dp = work.dp, dvp = work.dvp;
  const Index a0 = r0 - i0, a1 = r1 - i0;
  const Index first_packet = a0 / P, packets = (a1 + P - 1) / P - first_packet;
  const Index b0 = k0 - j0, b1 = k1 - j0;
  Scalar* p = work.probabilities.data();
  Scalar* ds = work.gradients.data();
  // The keys of [b0, b1) that the rows of each packet (within [a0, a1)) reach: one interval
  // per packet (windows are intervals with non-decreasing ends). S^T and dP^T are computed
  // there only, 0 at the packet's other keys of [b0, b1), where P_ij = 0 (so dS_ij = +-0,
  // which leaves every sum of the products as it is: they start from +0).
  KeyRange packet_keys[Bq];
  bool whole = true;
  for (Index k = 0; k < packets; ++k) {
    const Index a = (first_packet + k) * P;
    const KeyRange reached = rule.keys_reached(i0 + std::max(a0, a), i0 + std::min(a1, a + P));
    const Index c0 = std::clamp<Index>(reached.first - j0, b0, b1);
    packet_keys[k] = {c0, std::clamp<Index>(reached.last - j0, c0, b1)};
    whole = whole && packet_keys[k].first == b0 && packet_keys[k].last == b1;
  }
  // visit(block, unreached): block(first, last, a, count) for the keys [first, last) and the
  // `count` packets of rows from a that reach them, unreached(b, a, P) for each key b of
  // [b0, b1) that the packet of P rows from a does not reach.
  const auto visit = [&](const auto& block, const auto& unreached) {
    if (whole) {
      block(b0, b1, first_packet * P, packets);
      return;
    }
    for (Index k = 0; k < packets; ++k) {
      const Index a = (first_packet + k) * P;
      const KeyRange keys = packet_keys[k];
      block(keys.first, keys.last, a, 1);
      for (Index b = b0; b < keys.first; ++b) unreached(b, a, P);
      for (Index b = keys.last; b < b1; ++b) unreached(b, a, P);
    }
  };
  // With `distance_sum`: *distance_sum += sum over the pair of P (dP - D) |i - j| (P^T in p,
  // dP^T in ds).
  const auto add_distance_sum = [&] {
    using Column = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
    const Index rows = a1 - a0;
    const auto row_offsets = Column::LinSpaced(rows, Scalar(0), static_cast<Scalar>(rows - 1));
    const Eigen::Map<const Column> delta(work.delta.data() + a0, rows);
    double sum = 0.0;
    for (Index b = b0; b < b1; ++b) {
      const Eigen::Map<const Column> prob(p + b * Bq + a0, rows), dprob(ds + b * Bq + a0, rows);
      const Scalar first_distance = static_cast<Scalar>(i0 + a0 - j0 - b + rule.shift());
      sum += static_cast<double>(
          (prob * (dprob - delta) * (row_offsets + first_distance).abs()).sum());
    }
    *distance_sum += sum;
  };
#if POSLSH_X86_UNITS
  if constexpr (backward_pairs_v<Scalar, Input>) {
    if (in.paired) {
      backward_pair_units(in, rule, j0, i0, a0, a1, b0, b1, visit, step, tile_rows, work,
                          distance_sum != nullptr ? ds : nullptr);
      if (distance_sum != nullptr) add_distance_sum();
      return;
    }
  }
#endif
  // S^T or dP^T (`values`) into target, 0 at the keys of [b0, b1) a packet does not reach.
  const auto scores = [&](bool values, Scalar* target) {
    const Packet zero = ei::pset1<Packet>(Scalar(0));
    visit(
        [&](Index first, Index last, Index a, Index count) {
          if (values) {
            backward_scores<Scalar>(step.ot + a, tile_rows.v_rows, dvp, dv, first, last, count,
                                    target + a);
          } else {
            backward_scores<Scalar>(step.qt + a, tile_rows.k_rows, dp, d, first, last, count,
                                    target + a);
          }
        },
        [&](Index b, Index a, Index) { ei::pstore(target + b * Bq + a, zero); });
  };
  // P^T from S^T (rows of the packets holding [a0, a1)).
  scores(false, p);
  Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>, 0, Eigen::OuterStride<>> tile(
      p + b0 * Bq + a0, a1 - a0, b1 - b0, Eigen::OuterStride<>(Bq));
  rule.probabilities(r0, k0, tile, in.tau, in.lse, work);
  // dS^T = tau P^T o (dP^T - D).
  scores(true, ds);
  if (distance_sum != nullptr) add_distance_sum();
  const Packet tau = ei::pset1<Packet>(in.tau);
  for (Index b = b0; b < b1; ++b) {
    for (Index a = first_packet * P; a < a1; a += P) {
      const Packet prob = ei::pload<Packet>(p + b * Bq + a);
      const Packet dprob = ei::pload<Packet>(ds + b * Bq + a);
      ei::pstore(
          ds + b * Bq + a,
          ei::pmul(ei::pmul(tau, prob), ei::psub(dprob, ei::pload<Packet>(work.delta.data() + a))));
    }
  }
  // dV_J += P^T dO and dK_J += dS^T Q: keys [c0, c1) over the step's rows reaching them.
  const auto rows_of = [&](Index c0, Index c1) {
    const KeyRange reaching = rule.rows_reaching(k0 + c0, k0 + c1, r0, r1);
    return KeyRange{reaching.first - i0, reaching.last - i0};
  };
  backward_products<Scalar>(p + b0 * Bq, Bq, 1, step.o_rows, dvp, b1 - b0, dvp / P,
                            tile_rows.dv_sum + b0 * dvp, dvp, rows_of);
  backward_products<Scalar>(ds + b0 * Bq, Bq, 1, step.q_rows, dp, b1 - b0, dp / P,
                            tile_rows.dk_sum + b0 * dp, dp, rows_of);
  // dQ contribution: rows [e0, e1) over the keys of [k0, k1) they reach.
  const auto keys_of = [&](Index e0, Index e1) {
    const KeyRange reached = rule.keys_reached(r0 + e0, r0 + e1);
    const Index first = std::clamp<Index>(reached.first - j0, b0, b1);
    return KeyRange{first, std::clamp<Index>(reached.last - j0, first, b1)};
  };
  backward_products<Scalar>(ds + a0, 1, Bq, tile_rows.k_rows, dp, a1 - a0, dp / P,
                            work.dq_part.data() + a0 * dp, dp, keys_of);
}

/// Key tiles [j_begin, j_end) (up to backward_group_tiles tiles of backward_tile keys, aligned
/// from the rule's first row): the query steps reaching any of them in increasing order, and
/// for each step the tiles it reaches in increasing order, the pair's gradients
/// (backward_pair). Each key tile's dK, dV rows are summed in its own buffers of `work` over
/// its steps in increasing order and added to the outputs at the end (this thread owns the key
/// tiles), and dQ_I += sum_J (dS K_J) (the group's partial sum: the tiles in increasing
/// order from zero, in work.dq_part) in increasing key group order, as `order` enforces. The
/// operands of the steps from `packed` (every step of the rule's domain).
template <typename Scalar, typename Input, typename Rule, typename Order>
void backward_key_group(const BackwardInputs<Scalar, Input>& in, const Rule& rule, Index j_begin,
                        Index j_end, BackwardOutputs<Scalar>& out, BackwardWork<Scalar>& work,
                        const Order& order, const PackedSteps<Scalar>& packed) {
  constexpr Index Bq = backward_query_rows, Bk = backward_tile;
  work.prepare(in.q.cols(), in.v.cols());
  if (in.paired) work.prepare_pairs(backward_group_tiles);
  const Index d = work.d, dp = work.dp, dvp = work.dvp;
  const Index base = rule.begin(), end = rule.end();
  const Index tiles = (j_end - j_begin + Bk - 1) / Bk;
  KeyRange reaching[backward_group_tiles];
  BackwardKeyTile<Scalar> rows[backward_group_tiles];
  Index first_row = end, last_row = base;
  for (Index g = 0; g < tiles; ++g) {
    const Index j0 = j_begin + g * Bk, keys = std::min(j_end, j0 + Bk) - j0;
    reaching[g] = rule.rows_reaching(j0, j0 + keys);
    rows[g] = backward_key_tile(in, g, work);
    if (reaching[g].first >= reaching[g].last) continue;
    first_row = std::min(first_row, reaching[g].first);
    last_row = std::max(last_row, reaching[g].last);
    backward_load_key_tile(in, j0, keys, g, work);
    Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>(rows[g].dk_sum, keys * dp).setZero();
    Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>(rows[g].dv_sum, keys * dvp).setZero();
  }
  if (first_row >= last_row) return;
  const Index group = (j_begin - base) / backward_group_keys;
  for (Index i0 = base + (first_row - base) / Bq * Bq; i0 < last_row; i0 += Bq) {
    bool prepared = false;
    Index part_first = i0 + Bq, part_last = i0;  // the rows of work.dq_part with terms
    const StepOperands<Scalar> step = packed.step(i0);
    for (Index g = 0; g < tiles; ++g) {
      const Index j0 = j_begin + g * Bk, j1 = std::min(j_end, j0 + Bk);
      const Index r0 = std::max(i0, reaching[g].first);
      const Index r1 = std::min(i0 + Bq, reaching[g].last);
      if (r0 >= r1) continue;
      const KeyRange reached = rule.keys_reached(r0, r1);
      const Index k0 = std::max(j0, reached.first), k1 = std::min(j1, reached.last);
      if (k0 >= k1) continue;
      if (!prepared) {
        work.load_step(in.delta, in.lse, i0, std::min(Bq, end - i0));
        work.dq_part.setZero();
        prepared = true;
      }
      if (!backward_dead_block(rule, r0, r1, k0, k1, in.lse))
        backward_pair(
            in, rule, j0, i0, r0, r1, k0, k1, step, rows[g], work,
            out.distance_sums == nullptr ? nullptr : out.distance_sums + (j0 - base) / Bk);
      part_first = std::min(part_first, r0);
      part_last = std::max(part_last, r1);
    }
    if (part_first >= part_last) continue;
    order.add((i0 - base) / Bq, group, [&] {
      // The step's first key group (the first that any of its rows reaches) comes first.
      const Index first_key = rule.keys_reached(i0, std::min(end, i0 + Bq)).first;
      if (out.fresh && group == (first_key - base) / backward_group_keys)
        out.dq.middleRows(i0, std::min(end, i0 + Bq) - i0).setZero();
      backward_store_rows<Scalar, RowStore::add>(
          out.dq.data() + part_first * out.dq.outerStride(), out.dq.outerStride(),
          work.dq_part.data() + (part_first - i0) * dp, dp, part_last - part_first, d);
    });
  }
  for (Index g = 0; g < tiles; ++g) {
    const Index j0 = j_begin + g * Bk, keys = std::min(j_end, j0 + Bk) - j0;
    backward_write_key_tile(out, j0, keys,
                            reaching[g].first < reaching[g].last ? &rows[g] : nullptr, dp, dvp);
  }
}

/// One pass over the key tiles of the rule's domain, in parallel (parallel_loop) by groups of
/// backward_group_tiles key tiles: dK, dV of a key tile by its thread summing over query steps
/// in increasing order, dQ of a query step summed over key groups in increasing order
/// (KeyGroupOrder). Q^T and dO^T of every step are packed first (O(n (d + d_v)) memory), and
/// each thread's BackwardWork is sized before the loop, so the loop allocates nothing. A
/// failed key group abandons the order (the threads waiting on it leave) and its exception
/// reaches the caller; the outputs are then partly written. Outputs are accumulated into.
template <typename Scalar, typename Input, typename Rule>
void backward_parallel(const BackwardInputs<Scalar, Input>& in, const Rule& rule,
                       BackwardOutputs<Scalar>& out) {
  constexpr Index group = backward_group_keys;
  // The key tiles of [begin, end) over the query steps of the rows [begin, rule.end()).
  const Index begin = rule.begin(), end = rule.key_end();
  const KeyGroupOrder order(rule,
                            (rule.end() - begin + backward_query_rows - 1) / backward_query_rows);
  PackedSteps<Scalar> packed;
  packed.pack(in, begin, rule.end(), true);
  const auto group_count = static_cast<long>((end - begin + group - 1) / group);
  PerThread<BackwardWork<Scalar>> works(group_count);
  works.each([&](BackwardWork<Scalar>& work) {
    work.prepare(in.q.cols(), in.v.cols());
    if (in.paired) work.prepare_pairs(backward_group_tiles);
  });
  parallel_loop<FlushSubnormals>(
      group_count, LoopSchedule::dynamic(), works, [&](long t, BackwardWork<Scalar>& work) {
        const Index j0 = begin + static_cast<Index>(t) * group;
        try {
          backward_key_group(in, rule, j0, std::min(end, j0 + group), out, work, order, packed);
        } catch (...) {
          order.abandon();
          throw;
        }
      });
}

/// The most key tiles (backward_tile keys, aligned from the rule's first row) that the rows of
/// one query step reach, from the first to the last (0 when no row reaches a key).
template <typename Rule>
Index backward_step_span(const Rule& rule) {
  constexpr Index Bq = backward_query_rows, Bk = backward_tile;
  const Index base = rule.begin(), end = rule.end();
  Index span = 0;
  for (Index i0 = base; i0 < end; i0 += Bq) {
    const KeyRange reached = rule.keys_reached(i0, std::min(end, i0 + Bq));
    if (reached.first >= reached.last) continue;
    span = std::max(span, (reached.last - 1 - base) / Bk - (reached.first - base) / Bk + 1);
  }
  return span;
}

/// The largest working set (K, V rows and dK, dV sums of the key tiles one step reaches) of
/// backward_by_steps; wider rules (a long causal window) go by groups of key tiles.
inline constexpr std::size_t backward_step_window_bytes = std::size_t{4} << 20;

/// The pass of backward_key_group on the calling thread in the other loop order: query steps
/// in increasing order, each packed once, against the key tiles its rows reach in increasing
/// order. The key tiles live in `span` slots of `work` (tile J in slot J mod span, loaded when
/// a step first reaches it, written to the outputs when the steps have passed it: windows are
/// intervals with non-decreasing ends), so the step's dQ rows are summed in work.dq_step and
/// written once. Every sum has the terms and the order of backward_key_group's (dK_j, dV_j:
/// a running sum from zero over the steps in increasing order, output + sum at the end;
/// dQ_i: output (or 0 with fresh outputs) + each key group's partial sum in increasing group
/// order), so the gradients are bitwise the same. span >= backward_step_span(rule).
template <typename Scalar, typename Input, typename Rule>
void backward_by_steps(const BackwardInputs<Scalar, Input>& in, const Rule& rule, Index span,
                       BackwardOutputs<Scalar>& out, BackwardWork<Scalar>& work) {
  constexpr Index Bq = backward_query_rows, Bk = backward_tile;
  work.prepare(in.q.cols(), in.v.cols());
  work.reserve_key_tiles(span);
  if (in.paired) work.prepare_pairs(span);
  const Index d = work.d, dp = work.dp, dvp = work.dvp;
  const Index base = rule.begin(), end = rule.end(), key_end = rule.key_end();
  const Index tiles = (key_end - base + Bk - 1) / Bk;
  std::vector<Index>& owner = work.slot_tile;      // the tile in each slot
  std::vector<char>& touched = work.slot_touched;  // a pair has run on it
  owner.assign(static_cast<std::size_t>(span), -1);
  touched.assign(static_cast<std::size_t>(span), 0);
  const auto slot_rows = [&](Index tile) { return backward_key_tile(in, tile % span, work); };
  // Writes key tile `tile` to the outputs (0 with fresh outputs if no pair ran on it).
  const auto finish = [&](Index tile) {
    const Index j0 = base + tile * Bk, keys = std::min(key_end, j0 + Bk) - j0;
    const auto slot = static_cast<std::size_t>(tile % span);
    const BackwardKeyTile<Scalar> rows = slot_rows(tile);
    backward_write_key_tile(out, j0, keys,
                            owner[slot] == tile && touched[slot] != 0 ? &rows : nullptr, dp, dvp);
  };
  const auto load = [&](Index tile) {
    const Index j0 = base + tile * Bk, keys = std::min(key_end, j0 + Bk) - j0;
    const Index slot = tile % span;
    owner[static_cast<std::size_t>(slot)] = tile;
    touched[static_cast<std::size_t>(slot)] = 0;
    backward_load_key_tile(in, j0, keys, slot, work);
    work.dk_sum.segment(slot * Bk * dp, keys * dp).setZero();
    work.dv_sum.segment(slot * Bk * dvp, keys * dvp).setZero();
  };
  Index loaded = 0, finished = 0;  // tiles [0, loaded) loaded or passed, [0, finished) written
  PackedSteps<Scalar>& packed = work.packed_steps();
  Eigen::Map<RowMatrix<Scalar>> dq_step(work.dq_step.data(), Bq, dp);
  for (Index i0 = base; i0 < end; i0 += Bq) {
    const Index i1 = std::min(end, i0 + Bq), step_rows = i1 - i0;
    const KeyRange reached = rule.keys_reached(i0, i1);
    if (reached.first >= reached.last) continue;  // fresh: backward_zero_unreached's rows
    const Index first = (reached.first - base) / Bk, last = (reached.last - 1 - base) / Bk + 1;
    if (i1 < end) {
      // What the next step reads and writes first: its Q, dO and dQ rows, the K and V rows of
      // the next key tile, the dK and dV rows of this step's first key tile.
      const Index next_rows = std::min(end, i1 + Bq) - i1;
      prefetch_rows<false>(in.q, i1, next_rows);
      prefetch_rows<false>(in.dout, i1, next_rows);
      if (!out.stream) prefetch_rows<true>(out.dq, i1, next_rows);
      if (last < tiles) {
        const Index j0 = base + last * Bk, keys = std::min(key_end, j0 + Bk) - j0;
        prefetch_rows<false>(in.k, j0, keys);
        prefetch_rows<false>(in.v, j0, keys);
      }
      const Index j0 = base + first * Bk, keys = std::min(key_end, j0 + Bk) - j0;
      if (!out.stream) {
        prefetch_rows<true>(out.dk, j0, keys);
        prefetch_rows<true>(out.dv, j0, keys);
      }
    }
    for (; finished < first; ++finished) finish(finished);
    for (loaded = std::max(loaded, first); loaded < last; ++loaded) load(loaded);
    work.load_step(in.delta, in.lse, i0, step_rows);
    packed.pack_single(in, i0, step_rows);
    const StepOperands<Scalar> step = packed.step(i0);
    if (out.fresh)
      dq_step.topRows(step_rows).setZero();
    else
      dq_step.topLeftCorner(step_rows, d) = out.dq.middleRows(i0, step_rows);
    // The key group of work.dq_part and its rows with terms, added to dq_step when it ends.
    Index group = -1, part_first = i1, part_last = i0;
    const auto add_part = [&] {
      if (part_first < part_last)
        backward_store_rows<Scalar, RowStore::add>(work.dq_step.data() + (part_first - i0) * dp, dp,
                                                   work.dq_part.data() + (part_first - i0) * dp, dp,
                                                   part_last - part_first, d);
    };
    for (Index tile = first; tile < last; ++tile) {
      const Index j0 = base + tile * Bk, j1 = std::min(key_end, j0 + Bk);
      const KeyRange rows = rule.rows_reaching(j0, j1, i0, i1);
      if (rows.first >= rows.last) continue;
      const KeyRange keys = rule.keys_reached(rows.first, rows.last);
      const Index k0 = std::max(j0, keys.first), k1 = std::min(j1, keys.last);
      if (k0 >= k1) continue;
      if (tile / backward_group_tiles != group) {
        add_part();
        group = tile / backward_group_tiles;
        part_first = i1;
        part_last = i0;
        work.dq_part.setZero();
      }
      touched[static_cast<std::size_t>(tile % span)] = 1;
      if (!backward_dead_block(rule, rows.first, rows.last, k0, k1, in.lse))
        backward_pair(in, rule, j0, i0, rows.first, rows.last, k0, k1, step, slot_rows(tile), work,
                      out.distance_sums == nullptr ? nullptr : out.distance_sums + tile);
      part_first = std::min(part_first, rows.first);
      part_last = std::max(part_last, rows.last);
    }
    add_part();
    backward_store_rows<Scalar, RowStore::copy>(out.dq.data() + i0 * out.dq.outerStride(),
                                                out.dq.outerStride(), work.dq_step.data(), dp,
                                                step_rows, d, out.stream);
  }
  for (; finished < tiles; ++finished) finish(finished);
}

/// The key tiles one step of backward_serial's pass on `rule` keeps (backward_step_span) when
/// it goes by steps (their K, V rows and dK, dV sums fit in `window_bytes`), or 0 when it goes
/// by groups of key tiles.
template <typename Scalar, typename Input, typename Rule>
Index backward_serial_span(const BackwardInputs<Scalar, Input>& in, const Rule& rule,
                           std::size_t window_bytes = backward_step_window_bytes) {
  constexpr Index P = tile_packet_size<Scalar>;
  const Index span = backward_step_span(rule);
  const Index dp = (in.q.cols() + P - 1) / P * P, dvp = (in.v.cols() + P - 1) / P * P;
  const auto span_bytes =
      static_cast<std::size_t>(span * backward_tile * 2 * (dp + dvp)) * sizeof(Scalar);
  return span > 0 && span_bytes <= window_bytes ? span : 0;
}

/// The same pass on the calling thread (a block of a per-sample hash, or one head of a
/// parallel loop over heads), bitwise the same: backward_by_steps when the key tiles of one
/// step fit in `window_bytes` (backward_serial_span), otherwise groups of key tiles in
/// increasing order, the operands of the steps from `packed` (every step of the rule's domain)
/// or, when it is null, packed first into work.packed_steps(). Allocates nothing when `work`
/// was sized for the rule (BackwardSerialSize).
template <typename Scalar, typename Input, typename Rule>
void backward_serial(const BackwardInputs<Scalar, Input>& in, const Rule& rule,
                     BackwardOutputs<Scalar>& out, BackwardWork<Scalar>& work,
                     const PackedSteps<Scalar>* packed = nullptr,
                     std::size_t window_bytes = backward_step_window_bytes) {
  constexpr Index group = backward_group_keys;
  const Index span = backward_serial_span(in, rule, window_bytes);
  if (span > 0) {
    backward_by_steps(in, rule, span, out, work);
    return;
  }
  // Each step is met by every key group that reaches it: packed once, not once per group.
  if (packed == nullptr) {
    work.packed_steps().pack(in, rule.begin(), rule.end(), false);
    packed = &work.packed_steps();
  }
  for (Index j0 = rule.begin(); j0 < rule.key_end(); j0 += group)
    backward_key_group(in, rule, j0, std::min(rule.key_end(), j0 + group), out, work, InOrder{},
                       *packed);
}

/// The scratch that backward_serial (the steps packed by the pass itself) needs for a set of
/// rules on inputs shaped as `in`: add() each rule, then reserve() sizes a thread's
/// BackwardWork (before a parallel loop whose jobs run these passes: they then allocate
/// nothing). The sizes only grow, and the contents of the scratch never reach the gradients.
template <typename Scalar, typename Input>
class BackwardSerialSize {
 public:
  explicit BackwardSerialSize(const BackwardInputs<Scalar, Input>& in,
                              std::size_t window_bytes = backward_step_window_bytes)
      : in_(in), window_bytes_(window_bytes) {}

  template <typename Rule>
  void add(const Rule& rule) {
    const Index span = backward_serial_span(in_, rule, window_bytes_);
    if (span > 0) {
      span_ = std::max(span, span_);
    } else {
      group_rows_ = std::max(group_rows_, rule.end() - rule.begin());
    }
  }

  void reserve(BackwardWork<Scalar>& work) const {
    constexpr Index Bq = backward_query_rows;
    work.prepare(in_.q.cols(), in_.v.cols());
    work.reserve_key_tiles(span_);
    if (in_.paired) work.prepare_pairs(std::max(span_, backward_group_tiles));
    work.slot_tile.reserve(static_cast<std::size_t>(span_));
    work.slot_touched.reserve(static_cast<std::size_t>(span_));
    // By steps: one step packed at a time; by groups: every step of the widest domain.
    work.packed_steps().reserve(in_, 0, std::max(group_rows_, span_ > 0 ? Bq : Index{0}));
  }

 private:
  const BackwardInputs<Scalar, Input>& in_;
  std::size_t window_bytes_;
  Index span_ = 0;        // the most key tiles a pass by steps keeps
  Index group_rows_ = 0;  // the most rows a pass by groups packs
};

/// D_i = dO_i . O_i for every row, accumulated exactly as the score kernel accumulates
/// dP_ij = dO_i . v_j (tile_score_block: from zero, one multiply-add per column in increasing
/// column order), one row per packet lane: blocks of P rows transposed in registers so that a
/// packet holds column c of P rows (the rows left over: a broadcast packet per row, the same
/// arithmetic in every lane). Where O_i = v_j exactly (a row whose only key is j, as in blocks
/// of one token) D_i and dP_ij are then the same number, so dS_ij = P_ij (dP_ij - D_i) is
/// exactly 0, as in exact arithmetic. O and dO stored in a half-precision type (Input; Scalar
/// float) are widened P rows at a time (backward_rows) and summed as above: the bits of D for
/// float matrices of the widened values.
template <typename Scalar, typename Input = Scalar>
Eigen::Matrix<Scalar, Eigen::Dynamic, 1> backward_delta(
    const ConstMatrixRef<nondeduced_t<Input>>& out,
    const ConstMatrixRef<nondeduced_t<Input>>& dout) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  constexpr Index P = tile_packet_size<Scalar>;
  constexpr bool widen = !std::is_same_v<Input, Scalar>;
  const Index n = out.rows(), cols = out.cols();
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> delta(n);
  Index i = 0;
  if constexpr (P > 1) {
    // Column c of the block's rows at c * P (dO^T and O^T of P rows, P columns at a time).
    Eigen::Matrix<Scalar, P * P, 1> dout_t, out_t;
    // The block's rows widened (half-precision inputs only).
    RowMatrix<Scalar> dout_wide(widen ? P : 0, widen ? cols : 0),
        out_wide(widen ? P : 0, widen ? cols : 0);
    const Index whole = cols / P * P;
    for (; i + P <= n; i += P) {
      if (i + 2 * P <= n) {
        prefetch_rows<false>(dout, i + P, P);
        prefetch_rows<false>(out, i + P, P);
      }
      // The block's rows: row r of dO at dout_rows + r * dout_stride (of O likewise).
      const Scalar* dout_rows = nullptr;
      const Scalar* out_rows = nullptr;
      Index dout_stride = cols, out_stride = cols;
      if constexpr (widen) {
        backward_rows<Scalar>(dout, i, P, cols, dout_wide.data());
        backward_rows<Scalar>(out, i, P, cols, out_wide.data());
        dout_rows = dout_wide.data();
        out_rows = out_wide.data();
      } else {
        dout_rows = dout.data() + i * dout.outerStride();
        out_rows = out.data() + i * out.outerStride();
        dout_stride = dout.outerStride();
        out_stride = out.outerStride();
      }
      Packet sum = ei::pset1<Packet>(Scalar(0));
      for (Index c0 = 0; c0 < cols; c0 += P) {
        const Index width = std::min(P, cols - c0);
        if (c0 < whole) {
          tile_transpose_block<Scalar>(dout_rows + c0, dout_stride, dout_t.data(), P, Scalar(1));
          tile_transpose_block<Scalar>(out_rows + c0, out_stride, out_t.data(), P, Scalar(1));
        } else {
          for (Index c = 0; c < width; ++c) {
            for (Index r = 0; r < P; ++r) {
              dout_t(c * P + r) = dout_rows[r * dout_stride + c0 + c];
              out_t(c * P + r) = out_rows[r * out_stride + c0 + c];
            }
          }
        }
        for (Index c = 0; c < width; ++c)
          sum = ei::pmadd(ei::pload<Packet>(dout_t.data() + c * P),
                          ei::pload<Packet>(out_t.data() + c * P), sum);
      }
      ei::pstoreu(delta.data() + i, sum);
    }
  }
  for (; i < n; ++i) {
    Packet sum = ei::pset1<Packet>(Scalar(0));
    for (Index c = 0; c < cols; ++c)
      sum = ei::pmadd(ei::pset1<Packet>(static_cast<Scalar>(dout(i, c))),
                      ei::pset1<Packet>(static_cast<Scalar>(out(i, c))), sum);
    delta(i) = ei::pfirst(sum);
  }
  return delta;
}

}  // namespace poslsh::detail
