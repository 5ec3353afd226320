// poslsh internals: attention of a range of query rows, FlashAttention-style, for any bias
// policy (exact ALiBi: detail/tile/alibi_bias.hpp; fused LSH counts: detail/tile/count_bias.hpp).
// Queries are taken in tiles of tile_query_rows rows, keys in tiles of tile_key_cols; for each
// key tile the scores x_ij = tau q_i.k_j (+ the policy's bias) and weights w_ij (1, or the
// policy's) feed an online softmax per query row:
//   M_i <- max(M_i, max_j x_ij),  alpha_i = e^{M_i,old - M_i},  p_ij = w_ij e^{x_ij - M_i},
//   l_i <- alpha_i l_i + sum_j p_ij,  acc_i <- alpha_i acc_i + sum_j p_ij v_j,
// and out_i = acc_i / l_i. Each query row sees one interval of keys (its window, given by the
// policy); key tiles outside a query tile's windows are skipped, tiles cut by them are masked
// entry by entry (masked entries are -inf and never enter the maximum; their probability is
// exactly 0). Only the packets of query rows whose windows reach a tile are computed, and in
// a cut tile each packet only over the keys its windows reach. Key tiles are visited nearest
// the diagonal first. Every query row's arithmetic depends only on the row and its tile
// (tiles are aligned to multiples of tile_query_rows from row 0), never on the other rows
// computed: any split of the rows into ranges gives bitwise the same output.
// Query rows may sit at an offset p0 (chunked prefill, multi-token decode): row r of q is the
// query at absolute position p0 + r, over the keys at positions 0 .. k.rows() - 1. Rows,
// windows and query tiles are all in absolute positions (tiles aligned to multiples of
// tile_query_rows from position 0), so the row at position i gives bitwise the same result
// for any p0 and any chunk holding it, provided the keys and the policy are the same.
// Q, K and V may be stored in a half-precision type (Eigen::half, Eigen::bfloat16) while the
// engine computes in Scalar (float): the query tile is widened as it is packed, each key tile's
// K and V rows are widened into a buffer when the tile is first used (WideningKV), and each
// output row is rounded to the output's type once, as it is written. A row's result is then
// bitwise the engine's on Scalar matrices holding the widened values, rounded once.
// With Q, K and V all in Eigen::bfloat16 on a CPU with AVX512-BF16 (MatrixUnit::avx512_bf16,
// chosen at run time by Precision::matrix_units), the key source PairedHalfKV makes the engine
// multiply on that unit (detail/tile/pair_kernels.hpp): x_ij = tau (q_i.k_j in float from
// bfloat16 products), p_ij rounded to bfloat16 before acc_i += p_ij v_j (bfloat16 products
// summed in float); the maximum, the bias, the weights, l_i and acc_i stay float, l_i sums
// the unrounded p_ij, and the exponentials are pair_exp's (within 1.5 ulp of e^x on
// [-20, 0]). A row's result still depends only on its position, the keys and the policy. Where
// the CPU has AMX-BF16 (MatrixUnit::amx_bf16, preferred), PairedHalfKV<bfloat16, Tiles> makes
// the same two products run on AMX tiles (detail/tile/amx_kernels.hpp) of the tile layer Tiles
// (AmxNativeTiles<bfloat16>, the CPU's): the same operands, d summed in blocks of 32 columns and
// the keys in blocks of 32 from the key tile's first, each block one tdpbf16ps; the
// probabilities are rounded to bfloat16 row by row as the value products read them. With Q, K
// and V all in Eigen::half on a CPU with AMX-FP16 (MatrixUnit::amx_fp16), PairedHalfKV<half,
// Tiles> runs the same tiles on float16 pairs (tdpfp16ps), the probabilities rounded to
// float16. with_key_source picks the unit, and takes the AMX tile layer as a template
// parameter (AmxNativeTiles by default). The bias policy concept and the engine's buffers:
// detail/tile/types.hpp.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "poslsh/core/matrix_units.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/alibi_slope.hpp"
#include "poslsh/detail/detected.hpp"
#include "poslsh/detail/disable_intrinsic_warnings.hpp"
#include "poslsh/detail/tile/amx_kernels.hpp"
#include "poslsh/detail/tile/exponential.hpp"
#include "poslsh/detail/tile/kernels.hpp"
#include "poslsh/detail/tile/pair_kernels.hpp"
#include "poslsh/detail/tile/types.hpp"

namespace poslsh::detail {

/// The key and value rows of one key tile: key j0 + b at k + b k_stride, its value at
/// v + b v_stride.
template <typename Scalar>
struct KeyTileRows {
  const Scalar* k;
  Index k_stride;
  const Scalar* v;
  Index v_stride;
};

/// An online-softmax state kept outside the engine (TileEngine::accumulate): row i (a
/// position) has its running maximum M_i at max[i - base], its sum l_i at sum[i - base] and
/// its numerator acc_i (d_v values) at acc + (i - base) acc_stride.
template <typename Scalar>
struct EngineState {
  Scalar* max;
  Scalar* sum;
  Scalar* acc;
  Index acc_stride;
  Index base;
};

/// The part every key source over row-strided K and V matrices shares. A key source provides
/// rows() (the key count L), value_cols(), tile(j0, keys) (the KeyTileRows of keys
/// [j0, j0 + keys), a tile of at most tile_key_cols keys inside one aligned key tile),
/// key_row(j) (key j's row as stored: the policy's key norms read it) and prefetch(first,
/// last, d, d_v) (a hint for rows [first, last)); a source whose rows come in runs
/// (run_end_t, below) also value_row and run_end. Paged caches: PagedRows
/// in poslsh/attention/paged.hpp.
template <typename Storage>
class StridedKV {
 public:
  StridedKV(const ConstMatrixRef<Storage>& k, const ConstMatrixRef<Storage>& v) : k_(k), v_(v) {}
  Index rows() const { return k_.rows(); }
  Index value_cols() const { return v_.cols(); }
  const Storage* key_row(Index j) const { return k_.data() + j * k_.outerStride(); }
  void prefetch(Index first, Index last, Index d, Index dv) const {
    tile_prefetch_rows(k_.data(), k_.outerStride(), first, last, d);
    tile_prefetch_rows(v_.data(), v_.outerStride(), first, last, dv);
  }

 protected:
  const ConstMatrixRef<Storage>& k_;
  const ConstMatrixRef<Storage>& v_;
};

/// The engine's default key source: K and V in the compute type. tile(j0, keys) points into
/// them, or, when buffers.keep_key_rows is set, to a copy of a whole key tile's K and V rows
/// (d and d_v apart) in the thread's KeyTileStore, made at the first visit: the later query
/// tiles read the tile from one contiguous block instead of rows a whole token apart. The
/// values are the same either way, so the copy never changes a result.
template <typename Scalar>
class ContiguousKV : public StridedKV<Scalar> {
 public:
  /// Reads K and V in place.
  using StridedKV<Scalar>::StridedKV;
  /// K row 0 is the key at position key_position (the engine's positions.key).
  ContiguousKV(const ConstMatrixRef<Scalar>& k, const ConstMatrixRef<Scalar>& v,
               TileBuffers<Scalar>& buffers, Index key_position)
      : StridedKV<Scalar>(k, v) {
    if (buffers.keep_key_rows &&
        buffers.key_rows.hold({k.data(), v.data(), k.rows(), k.outerStride(), v.outerStride(),
                               k.cols(), v.cols(), key_position},
                              tile_key_cols * k.cols(), tile_key_cols * v.cols()))
      store_ = &buffers.key_rows;
  }
  KeyTileRows<Scalar> tile(Index j0, Index keys) const {
    const ConstMatrixRef<Scalar>& k = this->k_;
    const ConstMatrixRef<Scalar>& v = this->v_;
    if (store_ != nullptr) {
      if (const auto slot = store_->whole_tile(j0, keys)) {
        const Index d = k.cols(), dv = v.cols();
        if (!slot->ready) {
          for (Index b = 0; b < keys; ++b) {
            std::copy_n(k.data() + (j0 + b) * k.outerStride(), d, slot->k + b * d);
            std::copy_n(v.data() + (j0 + b) * v.outerStride(), dv, slot->v + b * dv);
          }
        }
        return {slot->k, d, slot->v, dv};
      }
    }
    return {k.data() + j0 * k.outerStride(), k.outerStride(), v.data() + j0 * v.outerStride(),
            v.outerStride()};
  }

 private:
  KeyTileStore<Scalar, Scalar>* store_ = nullptr;
};

/// What a KeyTileStore knows a row source's tiles by: two addresses that no other source of
/// the same call shares (a dense head's K and V; a paged head's K and its block table row).
struct RowsIdentity {
  const void* first;
  const void* second;
};

/// A row source: the K and V rows of one head's keys 0 .. rows() - 1 stored as `storage`, in
/// runs of rows a fixed stride apart. It provides rows(), key_cols() (d), value_cols() (d_v),
/// key_row(j) and value_row(j) (the rows of key j), k_stride() and v_stride() (the distance of
/// two rows of one run), run_end(j) (the first key after the run holding key j), prefetch(first,
/// last, d, d_v), identity() (RowsIdentity) and in_place(buffers, key_position) (the key source
/// reading the rows in place when `storage` is the compute type). The key sources below read
/// any row source; with_key_source picks one.
///
/// StridedRows: K and V as two row-strided matrices, one run of every row (the caller keeps the
/// matrices alive while the row source is used). Paged caches: PagedRows,
/// poslsh/attention/paged.hpp.
template <typename Storage>
class StridedRows {
 public:
  using storage = Storage;
  StridedRows(const ConstMatrixRef<Storage>& k, const ConstMatrixRef<Storage>& v) : k_(k), v_(v) {}
  Index rows() const { return k_.rows(); }
  Index key_cols() const { return k_.cols(); }
  Index value_cols() const { return v_.cols(); }
  const Storage* key_row(Index j) const { return k_.data() + j * k_.outerStride(); }
  const Storage* value_row(Index j) const { return v_.data() + j * v_.outerStride(); }
  Index k_stride() const { return k_.outerStride(); }
  Index v_stride() const { return v_.outerStride(); }
  Index run_end(Index) const { return k_.rows(); }
  void prefetch(Index first, Index last, Index d, Index dv) const {
    tile_prefetch_rows(k_.data(), k_.outerStride(), first, last, d);
    tile_prefetch_rows(v_.data(), v_.outerStride(), first, last, dv);
  }
  RowsIdentity identity() const { return {k_.data(), v_.data()}; }
  ContiguousKV<Storage> in_place(TileBuffers<Storage>& buffers, Index key_position) const {
    return ContiguousKV<Storage>(k_, v_, buffers, key_position);
  }

 private:
  const ConstMatrixRef<Storage>& k_;
  const ConstMatrixRef<Storage>& v_;
};

/// The key source of K and V stored in a half-precision type `Storage` (the rows of the row
/// source Rows): tile(j0, keys) widens the tile's K and V rows to Scalar into the buffers
/// `wide_k` and `wide_v` (rows d and d_v apart) and returns them. One conversion per key tile
/// visited, 1/64 of the tile's multiply-adds (a query tile of 64 rows uses each key row 64
/// times). The widened tile is the same whatever runs the rows come in.
template <typename Scalar, typename Storage, typename Rows = StridedRows<Storage>>
class WideningKV {
 public:
  using Buffer = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
  WideningKV(const Rows& rows, Buffer& wide_k, Buffer& wide_v)
      : rows_(rows), wide_k_(wide_k), wide_v_(wide_v) {
    if (wide_k_.size() < tile_key_cols * rows.key_cols())
      wide_k_.resize(tile_key_cols * rows.key_cols());
    if (wide_v_.size() < tile_key_cols * rows.value_cols())
      wide_v_.resize(tile_key_cols * rows.value_cols());
  }
  Index rows() const { return rows_.rows(); }
  Index value_cols() const { return rows_.value_cols(); }
  const Storage* key_row(Index j) const { return rows_.key_row(j); }
  void prefetch(Index first, Index last, Index d, Index dv) const {
    rows_.prefetch(first, last, d, dv);
  }
  KeyTileRows<Scalar> tile(Index j0, Index keys) {
    const Index d = rows_.key_cols(), dv = rows_.value_cols();
    for (Index b = 0; b < keys; ++b) {
      tile_widen<Scalar>(rows_.key_row(j0 + b), wide_k_.data() + b * d, d);
      tile_widen<Scalar>(rows_.value_row(j0 + b), wide_v_.data() + b * dv, dv);
    }
    return {wide_k_.data(), d, wide_v_.data(), dv};
  }

 private:
  Rows rows_;
  Buffer& wide_k_;
  Buffer& wide_v_;
};

/// The key tile of PairedHalfKV: key b's row (the values' bits, an even count) at k + b k_stride,
/// the values as pairs along keys, pair b2 at v + b2 v_stride (pair_pack_values).
struct PairTileRows {
  const std::uint16_t* k;
  Index k_stride;
  const std::uint32_t* v;
  Index v_stride;
};

#if POSLSH_X86_UNITS

/// The key source of K and V stored in Half (the rows of the row source Rows) for a unit
/// multiplying pairs of Half values: the AVX512-BF16 unit (Half = Eigen::bfloat16, Tiles void)
/// or the AMX tiles of the tile layer Tiles (detail/tile/amx_kernels.hpp, e.g.
/// AmxNativeTiles<Half>; Half = Eigen::bfloat16 for AMX-BF16, Eigen::half for AMX-FP16):
/// pair_tile(j0, keys) packs the tile's values into pairs along keys (rows of ceil(d_v / 16) 16
/// words) and copies its key rows d + (d mod 2) apart (a zero appended when d is odd), so that the
/// score products read them from one contiguous block whatever the row stride of K or the runs the
/// rows come in (a pair whose two keys lie in two runs is joined word by word: the same words). For
/// the AMX tiles the key rows are ceil(d / 32) 32 apart (zeros past column d - 1), the key rows
/// from `keys` to the next multiple of 16 are zeros, and so are the value pairs from ceil(keys / 2)
/// to tile_key_cols / 2. A request for a whole key tile (all the keys of [t Bk, (t + 1) Bk) the
/// source holds) is packed once into the thread's KeyTileStore when buffers.keep_packed_tiles is
/// set (and the source's packed tiles fit in KeyTileStore::max_bytes), and read from there by
/// the later query tiles; any other request (a tile cut by a
/// window) is packed into the buffers pair_k and pair_v. Both packings are the same function
/// of the same keys, so where a tile comes from never changes a result.
template <typename Half, typename Tiles = void, typename Rows = StridedRows<Half>>
class PairedHalfKV {
 public:
  using half_type = Half;
  /// The AMX tile layer (void: the AVX512-BF16 unit).
  using tiles = Tiles;
  static constexpr bool amx_tiles = !std::is_void_v<Tiles>;
  static_assert(amx_tiles ? amx_half_v<Half> : std::is_same_v<Half, Eigen::bfloat16>,
                "pairs of bfloat16 values, or of float16 values on the AMX tiles");
  /// Row 0 of `rows` is the key at position key_position (the engine's positions.key).
  PairedHalfKV(const Rows& rows, TileBuffers<float>& buffers, Index key_position)
      : rows_(rows),
        pair_k_(buffers.pair_k),
        pair_v_(buffers.pair_v),
        cols_((rows.value_cols() + 15) / 16 * 16) {
    if (pair_v_.size() < v_words()) pair_v_.resize(v_words());
    if (pair_k_.size() < k_words()) pair_k_.resize(k_words());
    const RowsIdentity identity = rows.identity();
    if (buffers.keep_packed_tiles &&
        buffers.key_pairs.hold(
            {identity.first, identity.second, rows.rows(), rows.k_stride(), rows.v_stride(),
             rows.key_cols(), rows.value_cols(), key_position, amx_tiles ? 2 : 1},
            k_words(), v_words()))
      store_ = &buffers.key_pairs;
  }
  Index rows() const { return rows_.rows(); }
  Index value_cols() const { return rows_.value_cols(); }
  const Half* key_row(Index j) const { return rows_.key_row(j); }
  void prefetch(Index first, Index last, Index d, Index dv) const {
    rows_.prefetch(first, last, d, dv);
  }
  /// The distance of the packed key rows for d columns.
  static Index key_stride(Index d) { return amx_tiles ? (d + 31) / 32 * 32 : pair_row_stride(d); }
  PairTileRows pair_tile(Index j0, Index keys) {
    const Index stride = key_stride(rows_.key_cols());
    if (store_ != nullptr) {
      if (const auto slot = store_->whole_tile(j0, keys)) {
        if (!slot->ready) pack(j0, keys, slot->k, slot->v);
        return {slot->k, stride, slot->v, cols_};
      }
    }
    pack(j0, keys, pair_k_.data(), pair_v_.data());
    return {pair_k_.data(), stride, pair_v_.data(), cols_};
  }

 private:
  static const std::uint16_t* bits(const Half* values) {
    return reinterpret_cast<const std::uint16_t*>(values);
  }
  // Words of one packed key tile: its key rows and its value pairs.
  Index k_words() const { return tile_key_cols * key_stride(rows_.key_cols()); }
  Index v_words() const { return tile_key_cols / 2 * cols_; }
  // The pair of value rows `even` and `odd` as pair_pack_values writes it: word c holds column
  // c of both (even in the low half), zeros from column d_v to cols_.
  void join_pair(const Half* even, const Half* odd, std::uint32_t* out) const {
    const Index dv = rows_.value_cols();
    const std::uint16_t *low = bits(even), *high = bits(odd);
    for (Index c = 0; c < dv; ++c)
      out[c] = static_cast<std::uint32_t>(low[c]) | (static_cast<std::uint32_t>(high[c]) << 16);
    std::fill(out + dv, out + cols_, std::uint32_t{0});
  }
  // Keys [j0, j0 + keys) packed into pair_k and pair_v (k_words() and v_words() words), run by
  // run of the row source: the pairs inside a run by pair_pack_values, a pair across two runs
  // by join_pair.
  void pack(Index j0, Index keys, std::uint16_t* pair_k, std::uint32_t* pair_v) const {
    const Index d = rows_.key_cols(), dv = rows_.value_cols(), stride = key_stride(d);
    for (Index b = 0; b < keys;) {
      const Index end = std::min(keys, rows_.run_end(j0 + b) - j0);
      // The key rows are fetched while the values are packed.
      tile_prefetch_rows(rows_.key_row(j0 + b), rows_.k_stride(), 0, end - b, d);
      Index first = b;
      if (b % 2 != 0) {  // the run's first key completes the pair of the previous run's last
        join_pair(rows_.value_row(j0 + b - 1), rows_.value_row(j0 + b), pair_v + b / 2 * cols_);
        ++first;
      }
      // Whole pairs of the run (and the tile's last key alone); a last key left over pairs
      // with the next run's first.
      const Index count = end < keys ? (end - first) / 2 * 2 : end - first;
      if (count > 0)
        pair_pack_values(bits(rows_.value_row(j0 + first)), rows_.v_stride(), count, dv, cols_,
                         pair_v + first / 2 * cols_);
      pair_copy_rows(bits(rows_.key_row(j0 + b)), rows_.k_stride(), end - b, d, pair_k + b * stride,
                     stride);
      b = end;
    }
    if constexpr (amx_tiles) {
      std::fill(pair_k + keys * stride, pair_k + (keys + 15) / 16 * 16 * stride, std::uint16_t{0});
      std::fill(pair_v + (keys + 1) / 2 * cols_, pair_v + v_words(), std::uint32_t{0});
    }
  }
  Rows rows_;
  Eigen::Array<std::uint16_t, Eigen::Dynamic, 1>& pair_k_;
  Eigen::Array<std::uint32_t, Eigen::Dynamic, 1>& pair_v_;
  KeyTileStore<std::uint16_t, std::uint32_t>* store_ = nullptr;
  Index cols_;
};
#endif

// What the engine asks of its key source and bias policy (is_detected, detected_or_t):
// - pair_tile_t: a key source that multiplies pairs of 16-bit values on a unit (AVX512-BF16, or
//   the AMX tiles) provides pair_tile(j0, keys), a PairTileRows, instead of tile();
// - amx_tiles_t: of those, a source with KV::amx_tiles true multiplies on the AMX tiles (the
//   tile layer is KV::tiles);
// - run_end_t: a key source that reads its rows in runs (a paged cache) provides key_row(j) and
//   value_row(j) (pointers to the K and V rows of key j; rows of one run are k_stride and
//   v_stride apart, as in tile()) and run_end(j) (the first key after j's run), and the engine
//   reads each run in place instead of the tile as one stretch of rows;
// - drops_dead_keys_t: a bias policy with Bias::drops_dead_keys true drops dead keys
//   (AlibiBias: bound_rows and drop_dead_keys, given the norms of the queries and keys).
template <typename KV>
using pair_tile_t = decltype(std::declval<KV&>().pair_tile(Index{0}, Index{0}));
template <typename KV>
using amx_tiles_t = std::bool_constant<KV::amx_tiles>;
template <typename KV>
using run_end_t = decltype(std::declval<const KV&>().run_end(Index{0}));
template <typename Bias>
using drops_dead_keys_t = std::bool_constant<Bias::drops_dead_keys>;

/// One head's attention under the bias policy `Bias` (see the file comment), keys and values
/// read through the key source `KV` (ContiguousKV: two row-strided matrices; WideningKV: two
/// half-precision ones), queries stored as QScalar (Scalar or a half-precision type, widened
/// to Scalar as each query tile is packed).
template <typename Scalar, typename Bias, typename KV = ContiguousKV<Scalar>,
          typename QScalar = Scalar>
class TileEngine {
  using Packet = TilePacket<Scalar>;
  static constexpr Index P = tile_packet_size<Scalar>;
  static constexpr Index Bq = tile_query_rows;
  static constexpr Index Bk = tile_key_cols;
  // Register blocks: up to query_packets packets of queries (score_span, tile_score_shape),
  // value_rows rows x value_packets packets of values (tile_row_block_packets).
  // A value block never spans two packets: rows of a packet outside the computed ones hold
  // stale scores, so value_rows divides P (2 rows for SSE2 doubles, 1 without vectorization).
  static constexpr int query_packets = static_cast<int>(std::min<Index>(4, Bq / P));
  static constexpr int value_rows = static_cast<int>(std::min<Index>(tile_row_block_rows, P));
  static constexpr int value_packets = tile_row_block_packets;
  static constexpr bool in_runs = is_detected<run_end_t, KV>::value;
  static constexpr bool pairs = is_detected<pair_tile_t, KV>::value;
  static constexpr bool amx = detected_or_t<std::false_type, amx_tiles_t, KV>::value;
  static constexpr bool drops_dead_keys =
      detected_or_t<std::false_type, drops_dead_keys_t, Bias>::value;
  static_assert(Bq % P == 0 && P % value_rows == 0,
                "the query tile must be whole packets, a packet whole value blocks");
  static_assert(!pairs || (std::is_same_v<Scalar, float> && sizeof(QScalar) == 2 && !in_runs),
                "products of pairs: float engine, half-precision queries, keys read by tiles");

 public:
  /// q (m x d, row r at position positions.query + r) is used unscaled; tau is applied here. K
  /// and V hold the keys at positions positions.key .. positions.key + k.rows() - 1; `bias`
  /// works in positions. A row that reaches no key gets 0 (and lse -inf). `bias` and `buffers`
  /// outlive the engine.
  TileEngine(const ConstMatrixRef<QScalar>& q, const ConstMatrixRef<Scalar>& k,
             const ConstMatrixRef<Scalar>& v, double tau, Bias& bias, TileBuffers<Scalar>& buffers,
             TilePositions positions = {})
      : TileEngine(q, KV(k, v), tau, bias, buffers, positions) {}

  /// The same with the keys and values of the key source `kv` (d_v = kv.value_cols()).
  TileEngine(const ConstMatrixRef<QScalar>& q, KV kv, double tau, Bias& bias,
             TileBuffers<Scalar>& buffers, TilePositions positions = {})
      : q_(q),
        kv_(std::move(kv)),
        k0_(positions.key),
        n_(positions.key + kv_.rows()),
        p0_(positions.query),
        d_(q.cols()),
        dv_(kv_.value_cols()),
        dvp_(amx ? (dv_ + 15) / 16 * 16 : (dv_ + P - 1) / P * P),
        tau_(static_cast<Scalar>(tau)),
        pack_values_(dv_ % P != 0),
        bias_(bias),
        b_(buffers) {
    std::fill_n(ones_, value_rows, Scalar(1));
    b_.prepare(d_, dvp_, pack_values_ || in_runs);
    if constexpr (pairs) {
      if (b_.pair_q.size() < Bq * query_pairs()) b_.pair_q.resize(Bq * query_pairs());
      if (b_.pair_p.size() < Bq * Bk / 2) b_.pair_p.resize(Bq * Bk / 2);
    } else if constexpr (!std::is_same_v<QScalar, Scalar>) {
      if (b_.wide_q.size() < Bq * d_) b_.wide_q.resize(Bq * d_);
    }
  }

  /// Rows at positions [row_begin, row_end) (within [p0, p0 + q.rows())), written to out rows
  /// 0 .. row_end - row_begin;
  /// with `lse`, also lse[i - row_begin] = M_i + log l_i (-inf for a row without keys).
  /// An output of another scalar type gets each row rounded once from Scalar. With the
  /// buffers' stream_output, rows are stored non-temporally where aligned (same bits).
  template <typename OutType>
  void run(Index row_begin, Index row_end, OutType&& out, Scalar* lse = nullptr) {
    using OutScalar = typename std::decay_t<OutType>::Scalar;
    if (row_begin >= row_end || dv_ == 0) return;
    const bool stream = b_.stream_output && out.innerStride() == 1;
    if constexpr (!std::is_same_v<OutScalar, Scalar>) {
      if (b_.wide_out.size() < dv_) b_.wide_out.resize(dv_);
    }
    for (Index i0 = row_begin / Bq * Bq; i0 < row_end; i0 += Bq) {
      const Index r0 = std::max(i0, row_begin);
      const Index r1 = std::min(i0 + Bq, row_end);
      if (!stream) {
        tile_prefetch_rows<true>(&out.coeffRef(0, 0), out.outerStride(), r0 - row_begin,
                                 r1 - row_begin, dv_);
      }
      query_tile(i0, r0, r1);
      for (Index i = r0; i < r1; ++i) {
        const Index a = i - i0;
        if (b_.running_sum(a) == Scalar(0)) {  // no key in reach (keys at an offset)
          out.row(i - row_begin).setZero();
          if (lse != nullptr) lse[i - row_begin] = minus_infinity;
          continue;
        }
        const Scalar* sums = b_.acc.data() + a * dvp_;
        if (out.innerStride() != 1) {
          out.row(i - row_begin) =
              (b_.acc.segment(a * dvp_, dv_).matrix().transpose() / b_.running_sum(a))
                  .template cast<OutScalar>();
        } else if constexpr (std::is_same_v<OutScalar, Scalar>) {
          tile_divide_row(sums, b_.running_sum(a), &out.coeffRef(i - row_begin, 0), dv_, stream);
        } else {
          // Divided in Scalar, rounded once as it is stored.
          Scalar* divided = b_.wide_out.data();
          tile_divide_row(sums, b_.running_sum(a), divided, dv_, false);
          tile_narrow<OutScalar>(divided, &out.coeffRef(i - row_begin, 0), dv_, stream);
        }
        if (lse != nullptr) lse[i - row_begin] = b_.running_max(a) + std::log(b_.running_sum(a));
      }
    }
    if (stream) stream_store_fence();
  }

  /// Rows at positions [row_begin, row_end) (within [p0, p0 + q.rows())) folded into `state`
  /// instead of written out: each row's M_i, l_i and acc_i are loaded, updated by this
  /// engine's key tiles with the steps of run() (starting from the loaded values instead of
  /// -inf, 0, 0) and stored back. Several passes over the same rows (other policies, e.g. the
  /// blocks of other hashes) continue one online softmax; out_i = acc_i / l_i at the end.
  void accumulate(Index row_begin, Index row_end, const EngineState<Scalar>& state) {
    if (row_begin >= row_end || dv_ == 0) return;
    for (Index i0 = row_begin / Bq * Bq; i0 < row_end; i0 += Bq) {
      const Index r0 = std::max(i0, row_begin);
      const Index r1 = std::min(i0 + Bq, row_end);
      external_ = &state;
      query_tile(i0, r0, r1);
      external_ = nullptr;
      for (Index i = r0; i < r1; ++i) {
        const Index a = i - i0, row = i - state.base;
        state.max[row] = b_.running_max(a);
        state.sum[row] = b_.running_sum(a);
        std::copy_n(b_.acc.data() + a * dvp_, dv_, state.acc + row * state.acc_stride);
      }
    }
  }

 private:
  static constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();

  // Rows [r0, r1) of the query tile starting at i0: fills running_sum and acc (from -inf, 0,
  // 0, or from the rows of external_ when set).
  // Defined after the class, not inline: an explicit instantiation declaration of it
  // (poslsh/tile_engines.hpp) then leaves the tile work, all of which is reached through here,
  // to the translation unit holding the explicit instantiation definition.
  void query_tile(Index i0, Index r0, Index r1);

  void key_tile(Index tile, Index key_lo, Index key_hi) {
    const Index j0 = std::max(tile * Bk, key_lo);
    const Index keys = std::min((tile + 1) * Bk, key_hi + 1) - j0;
    KeyTileCut cut = bias_.key_tile(j0, keys, packets_);
    if constexpr (drops_dead_keys) {
      cut = bias_.drop_dead_keys(j0, keys, cut, [&](Scalar* norms) {
        for (Index b = 0; b < keys; ++b)
          norms[b] = static_cast<Scalar>(tile_row_norm(kv_.key_row(j0 - k0_ + b), d_));
      });
    }
    if (cut == KeyTileCut::skip) return;
    j0_ = j0;
    if constexpr (pairs)
      pair_tile_ = kv_.pair_tile(j0 - k0_, keys);
    else
      rows_of_tile_ = kv_.tile(j0 - k0_, keys);
    if constexpr (in_runs) find_runs(keys);
    const bool masked = cut == KeyTileCut::masked;
    if (masked)
      score_tile<true>(keys);
    else
      score_tile<false>(keys);
    update_max();
    if (masked)
      exp_tile<true>(keys);
    else
      exp_tile<false>(keys);
    value_tile(j0, keys);
  }

  // The query pairs packed for the products: ceil(d / 2), rounded up to whole blocks of 16 for
  // the AMX tiles.
  Index query_pairs() const { return amx ? (d_ + 31) / 32 * 16 : (d_ + 1) / 2; }

  // Packets of rows (within packets_) whose windows reach keys [b0, b1) of the tile.
  KeyRange packets_reaching(Index b0, Index b1) const {
    const KeyRange rows = bias_.rows_reaching(b0, b1);
    const Index first = std::max(rows.first, packets_.first) / P * P;
    const Index last = (std::min(rows.last, packets_.last) + P - 1) / P * P;
    return {first, std::max(first, last)};
  }

  // Keys of the tile (clamped to [0, keys)) reached by rows [a0, a1).
  KeyRange keys_reached(Index a0, Index a1, Index keys) const {
    const KeyRange reach = bias_.keys_reached(a0, a1);
    const Index first = std::clamp<Index>(reach.first, 0, keys);
    return {first, std::clamp<Index>(reach.last, first, keys)};
  }

  // scores[b][a] = x_{i0+a, j0+b} (or -inf if masked) where packet a reaches key b;
  // tile_max = max over b. Groups of up to 4 packets: a whole tile over all its keys, a cut
  // one segment by segment between the ends of its packets' key ranges, each segment against
  // the packets that reach it (contiguous, as windows are non-decreasing).
  template <bool Masked>
  void score_tile(Index keys) {
    b_.tile_max.head(Bq).setConstant(minus_infinity);
    const KeyRange rows = Masked ? packets_ : packets_reaching(0, keys);
    for (Index a0 = rows.first; a0 < rows.last; a0 += query_packets * P) {
      const Index group = std::min<Index>(query_packets, (rows.last - a0) / P);
      if constexpr (!Masked) {
        score_span<false>(group, 0, keys, a0);
      } else {
        KeyRange reach[query_packets];
        Index edges[2 * query_packets];
        for (Index p = 0; p < group; ++p) {
          reach[p] = keys_reached(a0 + p * P, a0 + (p + 1) * P, keys);
          edges[2 * p] = reach[p].first;
          edges[2 * p + 1] = reach[p].last;
        }
        std::sort(edges, edges + 2 * group);
        for (Index e = 0; e + 1 < 2 * group; ++e) {
          if (edges[e] == edges[e + 1]) continue;
          Index p0 = 0;
          while (p0 < group && reach[p0].last <= edges[e]) ++p0;
          Index p1 = p0;
          while (p1 < group && reach[p1].first <= edges[e]) ++p1;
          if (p1 > p0) score_span<true>(p1 - p0, edges[e], edges[e + 1], a0 + p0 * P);
        }
      }
    }
  }

  // Keys [b, end) against `packets` packets of queries from a, in the register blocks of
  // tile_score_shape, then halved for the remainder.
  template <bool Masked>
  void score_span(Index packets, Index b, Index end, Index a) {
    if constexpr (in_runs) {
      // One run of contiguous key rows at a time (each entry's sum over d is the same for any
      // split of the keys into register blocks).
      for (Index r = run_of(b); b < end; ++r) {
        const Index stop = std::min(end, run_start_[r + 1]);
        run_k_ = run_keys_[r] + (b - run_start_[r]) * rows_of_tile_.k_stride;
        run_b_ = b;
        score_run<Masked>(packets, b, stop, a);
        b = stop;
      }
    } else {
      score_run<Masked>(packets, b, end, a);
    }
  }

  template <bool Masked>
  void score_run(Index packets, Index b, Index end, Index a) {
#if POSLSH_X86_UNITS
    if constexpr (pairs) return score_pairs<Masked>(packets, b, end, a);
#endif
    static_assert(query_packets == 4, "register blocks are written for groups of 4 packets");
    tile_score_shape(packets, [&](auto keys, auto group) {
      score_keys<decltype(keys)::value, decltype(group)::value, Masked>(b, end, a);
    });
  }

  template <int Keys, int Packets, bool Masked>
  void score_keys(Index b, Index end, Index a) {
    for (; b + Keys <= end; b += Keys) score_block<Keys, Packets, Masked>(b, a);
    if constexpr (Keys > 1) score_keys<Keys / 2, Packets, Masked>(b, end, a);
  }

  // Packets [a0, a0 + Packets P) of queries against keys [b0, b0 + Keys). Not inlined: one
  // register block per function keeps the compiler's register allocation clean.
  template <int Keys, int Packets, bool Masked>
  EIGEN_DONT_INLINE void score_block(Index b0, Index a0) {
    namespace ei = Eigen::internal;
    const auto scorer = bias_.scorer();
    Packet acc[Keys][Packets];
    tile_score_block<Scalar, Keys, Packets>(b_.qt.data() + a0, Bq, key_at(b0),
                                            rows_of_tile_.k_stride, d_, acc);
    POSLSH_TILE_UNROLL
    for (int p = 0; p < Packets; ++p) {
      const Index a = a0 + p * P;
      Packet best = ei::pload<Packet>(b_.tile_max.data() + a);
      POSLSH_TILE_UNROLL
      for (int kk = 0; kk < Keys; ++kk) {
        const Packet x = scorer.template score<Masked>(acc[kk][p], b0 + kk, a);
        best = ei::pmax(best, x);
        ei::pstore(b_.scores.data() + (b0 + kk) * Bq + a, x);
      }
      ei::pstore(b_.tile_max.data() + a, best);
    }
  }

#if POSLSH_X86_UNITS
  // score_keys on the AVX512-BF16 unit: the products of the span, then the policy's scores
  // and the tile maximum packet by packet; with 16-float packets in the products' registers
  // (ScoreMax), else from the stored products.
  template <bool Masked>
  void score_pairs(Index packets, Index b, Index end, Index a0) {
    namespace ei = Eigen::internal;
    if constexpr (!amx && P == 16) {
      pair_score_span(b_.pair_q.data(), Bq, pair_tile_.k, pair_tile_.k_stride, (d_ + 1) / 2, b, end,
                      a0, a0 + packets * P,
                      ScoreMax<Masked>{bias_.scorer(), tau_, b_.scores.data(), b_.tile_max.data()});
      return;
    }
    if constexpr (amx)
      amx_score_tiles<typename KV::tiles>(b_.pair_q.data(), Bq, pair_tile_.k, pair_tile_.k_stride,
                                          b, end, a0, a0 + packets * P, tau_, b_.scores.data());
    else
      pair_score_span(b_.pair_q.data(), Bq, pair_tile_.k, pair_tile_.k_stride, (d_ + 1) / 2, b, end,
                      a0, a0 + packets * P, tau_, b_.scores.data());
    const auto scorer = bias_.scorer();
    for (Index a = a0; a < a0 + packets * P; a += P) {
      Packet best = ei::pload<Packet>(b_.tile_max.data() + a);
      for (Index kk = b; kk < end; ++kk) {
        Scalar* entry = b_.scores.data() + kk * Bq + a;
        const Packet x = scorer.template score<Masked>(ei::pload<Packet>(entry), kk, a);
        best = ei::pmax(best, x);
        ei::pstore(entry, x);
      }
      ei::pstore(b_.tile_max.data() + a, best);
    }
  }

  // The finish of pair_score_span (whole packets of 16 floats) that does score_block's work on
  // the products in registers: x = scorer.score(tau acc) stored, tile_max <- max(tile_max, x).
  template <bool Masked>
  struct ScoreMax {
    typename Bias::Scorer scorer;
    Scalar tau;
    Scalar* scores;
    Scalar* tile_max;
    template <int Keys>
    EIGEN_ALWAYS_INLINE void operator()(const Packet (&acc)[Keys], Index b0, Index a,
                                        std::uint16_t /* lanes: all, whole packets */) const {
      namespace ei = Eigen::internal;
      const Packet scale = ei::pset1<Packet>(tau);
      Packet best = ei::pload<Packet>(tile_max + a);
      POSLSH_TILE_UNROLL
      for (int kk = 0; kk < Keys; ++kk) {
        const Packet x = scorer.template score<Masked>(ei::pmul(acc[kk], scale), b0 + kk, a);
        best = ei::pmax(best, x);
        ei::pstore(scores + (b0 + kk) * Bq + a, x);
      }
      ei::pstore(tile_max + a, best);
    }
  };
#endif

  // M <- max(M, tile max); alpha = e^{M_old - M} (1 while a row has seen no kept key); the
  // shift of the exponentials is M, or 0 while M = -inf (all the row's entries are masked).
  void update_max() {
    namespace ei = Eigen::internal;
    const Packet none = ei::pset1<Packet>(minus_infinity);
    const Packet one = ei::pset1<Packet>(Scalar(1));
    const Packet zero = ei::pset1<Packet>(Scalar(0));
    for (Index a = packets_.first; a < packets_.last; a += P) {
      const Packet old_max = ei::pload<Packet>(b_.running_max.data() + a);
      const Packet new_max = ei::pmax(old_max, ei::pload<Packet>(b_.tile_max.data() + a));
      const Packet alpha = exp_packet(ei::psub(old_max, new_max));
      const Packet empty = ei::pcmp_eq(new_max, none);
      ei::pstore(b_.alpha.data() + a, ei::pselect(empty, one, alpha));
      ei::pstore(b_.shift.data() + a, ei::pselect(empty, zero, new_max));
      ei::pstore(b_.running_max.data() + a, new_max);
    }
  }

  // scores <- p = w e^{x - M} over the keys each packet reaches; l <- alpha l + sum of p.
  template <bool Masked>
  void exp_tile(Index keys) {
    namespace ei = Eigen::internal;
    const auto scorer = bias_.scorer();
#if POSLSH_X86_UNITS
    if constexpr (pairs && !amx && P == 16) {
      // The same steps, each probability rounded into pair_p as it is computed.
      const auto reach = [&](Index a) { return keys_reached(a, a + P, keys); };
      pair_exp_pack<Masked, Packet>(scorer, reach, b_.scores.data(), Bq, packets_.first,
                                    packets_.last, b_.shift.data(), b_.alpha.data(),
                                    b_.running_sum.data(), b_.pair_p.data());
      return;
    }
#endif
    for (Index a = packets_.first; a < packets_.last; a += P) {
      const KeyRange reach = keys_reached(a, a + P, keys);
      const Packet shift = ei::pload<Packet>(b_.shift.data() + a);
      Packet sum = ei::pset1<Packet>(Scalar(0));
      for (Index b = reach.first; b < reach.last; ++b) {
        Scalar* entry = b_.scores.data() + b * Bq + a;
        const Packet x = ei::pload<Packet>(entry);
        const Packet prob = scorer.template weight<Masked>(exp_packet(ei::psub(x, shift)), x, b, a);
        ei::pstore(entry, prob);
        sum = ei::padd(sum, prob);
      }
      const Packet old_sum = ei::pload<Packet>(b_.running_sum.data() + a);
      ei::pstore(b_.running_sum.data() + a,
                 ei::pmadd(old_sum, ei::pload<Packet>(b_.alpha.data() + a), sum));
      if constexpr (pairs && !amx) {
        // The value products read whole pairs of keys: the other key of a pair at either end
        // of the packet's keys gets probability 0.
        const Packet zero = ei::pset1<Packet>(Scalar(0));
        if (reach.first % 2 != 0) ei::pstore(b_.scores.data() + (reach.first - 1) * Bq + a, zero);
        if (reach.last % 2 != 0) ei::pstore(b_.scores.data() + reach.last * Bq + a, zero);
      }
    }
#if POSLSH_X86_UNITS
    if constexpr (pairs && !amx)
      pair_pack_probs(b_.scores.data(), Bq, (keys + 1) / 2, packets_.first, packets_.last,
                      b_.pair_p.data());
#endif
  }

  // acc <- alpha acc + P V over the tile's keys, for the value blocks holding computed rows.
  // A block of rows only visits the keys its windows reach: the others have probability 0,
  // and a block that reaches none has alpha = 1 (its maximum did not move), so nothing to do.
  void value_tile(Index, Index keys) {
#if POSLSH_X86_UNITS
    if constexpr (amx) {
      // Blocks of 16 rows, each over the blocks of 16 key pairs its rows reach (the
      // probabilities of the other keys in those blocks are 0).
      constexpr Index rows = amx_rows, pairs_per_row = Bk / 2;
      for (Index a = rows_.first / rows * rows; a < rows_.last; a += rows) {
        const KeyRange reach = keys_reached(a, a + rows, keys);
        if (reach.first >= reach.last) continue;
        const Index first = reach.first / (2 * amx_pairs),
                    last = (reach.last - 1) / (2 * amx_pairs);
        amx_pack_probs(a, first * amx_pairs, (last + 1) * amx_pairs, keys);
        amx_value_tiles<typename KV::tiles>(b_.pair_p.data() + a * pairs_per_row, pairs_per_row,
                                            pair_tile_.v, pair_tile_.v_stride, first, last,
                                            b_.alpha.data() + a, b_.acc.data() + a * dvp_, dvp_);
      }
      return;
    }
    if constexpr (pairs) {
      // Whole pairs of keys from the pair holding the block's first key (pair_p is 0 for the
      // keys the block's rows do not reach).
      for (Index a = rows_.first / value_rows * value_rows; a < rows_.last; a += value_rows) {
        const KeyRange reach = keys_reached(a, a + value_rows, keys);
        if (reach.first >= reach.last) continue;
        const Index first = reach.first / 2, last = (reach.last + 1) / 2;
        pair_value_rows<value_rows>(b_.pair_p.data() + first * Bq + a, Bq,
                                    pair_tile_.v + first * pair_tile_.v_stride, pair_tile_.v_stride,
                                    last - first, b_.alpha.data() + a, b_.acc.data() + a * dvp_,
                                    dvp_, dv_);
      }
      return;
    }
#endif
    const Scalar* values = rows_of_tile_.v;
    Index stride = rows_of_tile_.v_stride;
    // Rows in more than two runs (pages shorter than a tile) are packed too: one value block
    // per row block instead of one per run.
    bool packed = pack_values_;
    if constexpr (in_runs) packed = packed || runs_ > 2;
    if (packed) {
      for (Index b = 0, r = 0; b < keys; ++b) {
        const Scalar* row = rows_of_tile_.v + b * rows_of_tile_.v_stride;
        if constexpr (in_runs) {
          if (run_start_[r + 1] <= b) ++r;
          row = run_values_[r] + (b - run_start_[r]) * rows_of_tile_.v_stride;
        }
        for (Index c = 0; c < dv_; ++c) b_.values(b * dvp_ + c) = row[c];
      }
      values = b_.values.data();
      stride = dvp_;
    }
    for (Index a = rows_.first / value_rows * value_rows; a < rows_.last; a += value_rows) {
      const KeyRange reach = keys_reached(a, a + value_rows, keys);
      if (reach.first >= reach.last) continue;
      for (Index c = 0; c < dvp_; c += value_packets * P) {
        if constexpr (in_runs) {
          if (!packed) {
            value_runs(a, c, reach, stride);
            continue;
          }
        }
        value_block<value_packets>((dvp_ - c) / P, a, values + reach.first * stride + c, stride,
                                   reach.first, reach.last - reach.first, c, b_.alpha.data() + a);
      }
    }
  }

#if POSLSH_X86_UNITS
  // For the AMX tiles: pair_p[a * Bk / 2 + b2] = (p_a,2b2, p_a,2b2+1) rounded to QScalar for
  // the 16 rows a from a0 and pairs b2 in [pair_first, pair_last); 0 for the keys outside the
  // row's packet's reach (its probabilities are only written there) and for rows outside the
  // packets computed.
  void amx_pack_probs(Index a0, Index pair_first, Index pair_last, Index keys) {
    constexpr Index pairs_per_row = Bk / 2;
    KeyRange reach{0, 0};
    for (Index a = a0; a < a0 + amx_rows; ++a) {
      if (a % P == 0 || a == a0) {
        const Index packet = a / P * P;
        reach = packet >= packets_.first && packet < packets_.last
                    ? keys_reached(packet, packet + P, keys)
                    : KeyRange{0, 0};
      }
      std::uint32_t* row = b_.pair_p.data() + a * pairs_per_row;
      for (Index b2 = pair_first; b2 < pair_last; ++b2) {
        std::uint32_t word = 0;
        for (Index h = 0; h < 2; ++h) {
          const Index b = 2 * b2 + h;
          if (b >= reach.first && b < reach.last)
            word |= static_cast<std::uint32_t>(amx_round<QScalar>(b_.scores(b * Bq + a)))
                    << (16 * h);
        }
        row[b2] = word;
      }
    }
  }
#endif

  // value_block over the keys `reach` read in place run by run: acc <- alpha acc + (run 1),
  // then acc <- 1 acc + (run 2), ...: the multiply-adds of one stretch of rows, in the same
  // order (1 acc is exact).
  void value_runs(Index a, Index c, KeyRange reach, Index stride) {
    const Scalar* alpha = b_.alpha.data() + a;
    for (Index b = reach.first, r = run_of(b); b < reach.last; ++r) {
      const Index stop = std::min(reach.last, run_start_[r + 1]);
      value_block<value_packets>((dvp_ - c) / P, a,
                                 run_values_[r] + (b - run_start_[r]) * stride + c, stride, b,
                                 stop - b, c, alpha);
      alpha = ones_;
      b = stop;
    }
  }

  // The runs of the current key tile (keys [0, keys) relative to j0): run r holds keys
  // [run_start_[r], run_start_[r + 1]), its first K and V rows at run_keys_[r], run_values_[r].
  void find_runs(Index keys) {
    runs_ = 0;
    for (Index b = 0; b < keys; ++runs_) {
      run_start_[runs_] = b;
      const Index row = j0_ - k0_ + b;
      run_keys_[runs_] = kv_.key_row(row);
      run_values_[runs_] = kv_.value_row(row);
      b = std::min(keys, kv_.run_end(row) - (j0_ - k0_));
    }
    run_start_[runs_] = keys;
  }

  // The run holding key b of the tile.
  Index run_of(Index b) const {
    Index r = 0;
    while (run_start_[r + 1] <= b) ++r;
    return r;
  }

  // acc <- alpha acc + P V for rows [a, a + value_rows), keys [b, b + keys) of the tile and
  // min(packets, Packets) packets of value columns from column c.
  template <int Packets>
  void value_block(Index packets, Index a, const Scalar* values, Index stride, Index b, Index keys,
                   Index c, const Scalar* alpha) {
    if constexpr (Packets > 1) {
      if (packets < Packets)
        return value_block<Packets - 1>(packets, a, values, stride, b, keys, c, alpha);
    }
    tile_value_block<Scalar, value_rows, Packets>(b_.scores.data() + b * Bq + a, Bq, values, stride,
                                                  keys, alpha, b_.acc.data() + a * dvp_ + c, dvp_);
  }

  // The key row of key j0 + b of the current tile (in runs: b inside the current run).
  const Scalar* key_at(Index b) const {
    if constexpr (in_runs)
      return run_k_ + (b - run_b_) * rows_of_tile_.k_stride;
    else
      return rows_of_tile_.k + b * rows_of_tile_.k_stride;
  }

  const ConstMatrixRef<QScalar>& q_;
  KV kv_;
  Index k0_, n_, p0_, d_, dv_, dvp_;
  Scalar tau_;
  bool pack_values_;
  Bias& bias_;
  TileBuffers<Scalar>& b_;
  Index j0_ = 0;
  const EngineState<Scalar>* external_ = nullptr;
  KeyTileRows<Scalar> rows_of_tile_{nullptr, 0, nullptr, 0};
  PairTileRows pair_tile_{nullptr, 0, nullptr, 0};  // the key tile of a paired key source
  const Scalar* run_k_ = nullptr;  // in runs: the key row of key j0 + run_b_ (score_span)
  Index run_b_ = 0;
  // In runs: the current key tile's runs (find_runs), at most one per key.
  Index runs_ = 0;
  Index run_start_[in_runs ? Bk + 1 : 1];
  const Scalar* run_keys_[in_runs ? Bk : 1];
  const Scalar* run_values_[in_runs ? Bk : 1];
  Scalar ones_[value_rows];
  KeyRange rows_{0, 0}, packets_{0, 0};
};

template <typename Scalar, typename Bias, typename KV, typename QScalar>
void TileEngine<Scalar, Bias, KV, QScalar>::query_tile(Index i0, Index r0, Index r1) {
#if POSLSH_X86_UNITS
  if constexpr (pairs) {
    pair_pack_queries(q_, i0 - p0_, r0 - i0, r1 - i0, b_.pair_q.data(), Bq);
    // The AMX tiles sum whole blocks of 16 pairs: zero pairs up to the last block.
    std::fill(b_.pair_q.data() + (d_ + 1) / 2 * Bq, b_.pair_q.data() + query_pairs() * Bq,
              std::uint32_t{0});
  } else
#endif
      if constexpr (std::is_same_v<QScalar, Scalar>)
    tile_pack_queries<Scalar>(q_, i0 - p0_, r0 - i0, r1 - i0, tau_, b_.qt.data(), Bq);
  else
    tile_pack_queries_widened<Scalar>(q_, i0 - p0_, r0 - i0, r1 - i0, tau_, b_.qt.data(), Bq,
                                      b_.wide_q.data());
  b_.running_max.head(Bq).setConstant(minus_infinity);
  b_.running_sum.head(Bq).setZero();
  b_.acc.head(Bq * dvp_).setZero();
  if (external_ != nullptr) {
    for (Index i = r0; i < r1; ++i) {
      const Index a = i - i0, row = i - external_->base;
      b_.running_max(a) = external_->max[row];
      b_.running_sum(a) = external_->sum[row];
      std::copy_n(external_->acc + row * external_->acc_stride, dv_, b_.acc.data() + a * dvp_);
    }
  }
  rows_ = {r0 - i0, r1 - i0};
  packets_ = {rows_.first / P * P, (rows_.last + P - 1) / P * P};
  // Key tiles aligned to multiples of Bk (the first and the last cut to the keys reached),
  // visited from the tile holding the diagonal outwards.
  const KeyRange reach = bias_.query_tile(i0);
  const Index key_lo = std::max(k0_, reach.first);
  const Index key_hi = std::min(n_, reach.last) - 1;
  if (key_lo > key_hi) return;
  if constexpr (drops_dead_keys) {
    bias_.bound_rows(
        rows_, key_lo, key_hi,
        [&](Index i) {
          return dead_key_query_bound(static_cast<double>(tau_),
                                      tile_row_norm(q_.data() + (i - p0_) * q_.outerStride(), d_));
        },
        [&](Index i) {
          return i >= k0_ && i < n_ ? tile_row_norm(kv_.key_row(i - k0_), d_)
                                    : std::numeric_limits<double>::infinity();
        });
  }
  // The next tile's queries, and the keys and values just past this tile's: their memory
  // latency then hides behind this tile's work (as this tile's output rows, prefetched by
  // run()).
  tile_prefetch_rows(q_.data(), q_.outerStride(), std::max<Index>(0, i0 + Bq - p0_),
                     std::min(q_.rows(), i0 + 2 * Bq - p0_), d_);
  kv_.prefetch(key_hi + 1 - k0_, std::min(n_, key_hi + 1 + Bq) - k0_, d_, dv_);
  const Index first = key_lo / Bk, last = key_hi / Bk;
  const Index centre = std::clamp(i0 / Bk, first, last);
#if POSLSH_X86_UNITS
  if constexpr (amx) amx_configure_tiles<typename KV::tiles>();  // once per query tile
#endif
  for (Index step = 0; centre - step >= first || centre + step <= last; ++step) {
    if (centre - step >= first) key_tile(centre - step, key_lo, key_hi);
    if (step > 0 && centre + step <= last) key_tile(centre + step, key_lo, key_hi);
  }
#if POSLSH_X86_UNITS
  if constexpr (amx) amx_release_tiles<typename KV::tiles>();
#endif
}

/// The unit with_key_source<Scalar, QScalar, AmxTiles> multiplies on under `precision` for
/// queries stored as QScalar and keys as KVScalar: the rule of matrix_unit_for, with amx_bf16
/// (amx_fp16) available where the tile layer's AmxTiles<Eigen::bfloat16>::available()
/// (AmxTiles<Eigen::half>::available()) says so. With the library's layer, AmxNativeTiles, it is
/// matrix_unit_for<QScalar, KVScalar>(precision).
template <typename QScalar, typename KVScalar, template <typename> class AmxTiles>
MatrixUnit tile_engine_unit(Precision precision) {
#if POSLSH_X86_UNITS
  return choose_matrix_unit<QScalar, KVScalar>(precision, [](MatrixUnit unit) {
    return unit == MatrixUnit::amx_bf16 ? AmxTiles<Eigen::bfloat16>::available()
                                        : AmxTiles<Eigen::half>::available();
  });
#else
  return matrix_unit_for<QScalar, KVScalar>(precision);  // float_products: no unit off x86
#endif
}

/// Calls use(source) with the key source reading the row source `rows` (keys stored as
/// Rows::storage, row 0 at position key_position) for an engine computing in Scalar on queries
/// stored as QScalar: the rows in place (Rows::in_place: ContiguousKV, or PagedRows) when they
/// are stored as Scalar; by the unit tile_engine_unit<QScalar, KVScalar, AmxTiles>(precision)
/// names (with the default tile layer, the CPU's: matrix_unit_for),
/// PairedHalfKV<bfloat16, AmxTiles<bfloat16>> on amx_bf16, PairedHalfKV<bfloat16> on
/// avx512_bf16, PairedHalfKV<half, AmxTiles<half>> on amx_fp16; WideningKV otherwise.
template <typename Scalar, typename QScalar, template <typename> class AmxTiles = AmxNativeTiles,
          typename Rows, typename Use>
void with_key_source(const Rows& rows, TileBuffers<Scalar>& buffers, Index key_position,
                     Precision precision, Use&& use) {
  using KVScalar = typename Rows::storage;
  static_cast<void>(precision);
  if constexpr (std::is_same_v<KVScalar, Scalar>) {
    use(rows.in_place(buffers, key_position));
  } else {
#if POSLSH_X86_UNITS
    if constexpr (std::is_same_v<Scalar, float> && std::is_same_v<QScalar, KVScalar>) {
      const MatrixUnit unit = tile_engine_unit<QScalar, KVScalar, AmxTiles>(precision);
      if constexpr (std::is_same_v<KVScalar, Eigen::bfloat16>) {
        if (unit == MatrixUnit::amx_bf16)
          return use(PairedHalfKV<KVScalar, AmxTiles<KVScalar>, Rows>(rows, buffers, key_position));
        if (unit == MatrixUnit::avx512_bf16)
          return use(PairedHalfKV<KVScalar, void, Rows>(rows, buffers, key_position));
      }
      if constexpr (std::is_same_v<KVScalar, Eigen::half>) {
        if (unit == MatrixUnit::amx_fp16)
          return use(PairedHalfKV<KVScalar, AmxTiles<KVScalar>, Rows>(rows, buffers, key_position));
      }
    }
#endif
    use(WideningKV<Scalar, KVScalar, Rows>(rows, buffers.wide_k, buffers.wide_v));
  }
}

/// Calls job(engine) with a TileEngine<Scalar, Bias, KV, QScalar> over Q (QScalar) and the keys
/// of the row source `rows` at `positions`, KV the key source with_key_source picks (AMX on the
/// tile layer AmxTiles).
template <typename Scalar, typename QScalar, template <typename> class AmxTiles = AmxNativeTiles,
          typename Rows, typename Bias, typename Job>
void with_row_source_engine(const ConstMatrixRef<QScalar>& q, const Rows& rows, double tau,
                            Bias& bias, TileBuffers<Scalar>& buffers, TilePositions positions,
                            Precision precision, Job&& job) {
  with_key_source<Scalar, QScalar, AmxTiles>(
      rows, buffers, positions.key, precision, [&](auto&& source) {
        using KV = std::decay_t<decltype(source)>;
        TileEngine<Scalar, Bias, KV, QScalar> engine(q, std::move(source), tau, bias, buffers,
                                                     positions);
        job(engine);
      });
}

/// with_row_source_engine over K and V in two row-strided matrices (KVScalar; StridedRows).
template <typename Scalar, typename QScalar, typename KVScalar,
          template <typename> class AmxTiles = AmxNativeTiles, typename Bias, typename Job>
void with_tile_engine(const ConstMatrixRef<QScalar>& q, const ConstMatrixRef<KVScalar>& k,
                      const ConstMatrixRef<KVScalar>& v, double tau, Bias& bias,
                      TileBuffers<Scalar>& buffers, TilePositions positions, Precision precision,
                      Job&& job) {
  with_row_source_engine<Scalar, QScalar, AmxTiles>(q, StridedRows<KVScalar>(k, v), tau, bias,
                                                    buffers, positions, precision,
                                                    std::forward<Job>(job));
}

/// Rows at positions [row_begin, row_end) of the engine's attention under `bias`, written to
/// out rows 0 .. row_end - row_begin (lse as TileEngine::run): Q (QScalar) over K and V
/// (KVScalar) at `positions`, read directly when KVScalar is Scalar, on the unit
/// `precision` selects for half-precision ones (with_tile_engine, AMX on the tile layer
/// AmxTiles); out of any scalar type.
template <typename Scalar, typename QScalar, typename KVScalar,
          template <typename> class AmxTiles = AmxNativeTiles, typename Bias, typename OutType>
void engine_rows(const ConstMatrixRef<QScalar>& q, const ConstMatrixRef<KVScalar>& k,
                 const ConstMatrixRef<KVScalar>& v, double tau, Bias& bias,
                 TileBuffers<Scalar>& buffers, TilePositions positions, Precision precision,
                 Index row_begin, Index row_end, OutType&& out, Scalar* lse = nullptr) {
  with_tile_engine<Scalar, QScalar, KVScalar, AmxTiles>(
      q, k, v, tau, bias, buffers, positions, precision,
      [&](auto& engine) { engine.run(row_begin, row_end, out, lse); });
}

}  // namespace poslsh::detail

#include "poslsh/detail/restore_warnings.hpp"
