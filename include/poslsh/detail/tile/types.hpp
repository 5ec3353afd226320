// poslsh internals: the vocabulary of the tile engine (detail/tile/engine.hpp): tile sizes,
// key and row ranges, how a key tile meets the windows, the engine's buffers, and the bias
// policy concept.
//
// A bias policy `Bias` gives each query row i a window of keys, an interval whose two ends are
// non-decreasing in i. With state the current query tile and key tile, it provides:
//   KeyRange query_tile(Index i0)          keys [first, last) reached by the query tile at i0;
//   KeyTileCut key_tile(Index j0, Index keys, KeyRange rows)
//                                          the key tile [j0, j0 + keys) for the tile-relative
//                                          rows `rows` (whole packets): skip, full or masked;
//   KeyRange rows_reaching(Index b0, Index b1)  tile-relative rows whose window meets keys
//                                          [b0, b1) of the key tile (unclamped);
//   KeyRange keys_reached(Index a0, Index a1)   keys of the key tile (relative, unclamped)
//                                          that rows [a0, a1) reach; both exactly (a key one
//                                          says is reached must be scored for the row);
//   Scorer scorer()                        a small value type with
//     template <bool Masked> Packet score(Packet acc, Index b, Index a): x of key b, queries
//                                          [a, a + P) from acc = tau q.k (-inf where masked);
//     template <bool Masked> Packet weight(Packet prob, Packet x, Index b, Index a): p from
//                                          e^{x - M} (exactly 0 where masked).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "poslsh/core/types.hpp"

namespace poslsh::detail {

/// Query rows per tile (aligned to multiples of it from row 0) and keys per tile.
inline constexpr Index tile_query_rows = 64;
inline constexpr Index tile_key_cols = 64;

/// The Euclidean norm of a row of d values stored as Storage, summed in float (in double for
/// double rows; half precision widened) by Eigen's vectorized sum, which fixes the order: the
/// same value for the same row wherever it is read.
template <typename Storage>
double tile_row_norm(const Storage* row, Index d) {
  using Wide = std::conditional_t<std::is_same_v<Storage, double>, double, float>;
  const Eigen::Map<const Eigen::Array<Storage, Eigen::Dynamic, 1>> x(row, d);
  if constexpr (std::is_same_v<Storage, Wide>)
    return std::sqrt(static_cast<double>(x.square().sum()));
  else
    return std::sqrt(static_cast<double>(x.template cast<Wide>().square().sum()));
}

/// Half-open range [first, last) of rows or keys.
struct KeyRange {
  Index first;
  Index last;
};

/// The positions of the rows an engine reads: query row r is the query at position query + r,
/// key (and value) row j the key at position key + j. Positions, not rows, decide the bias, the
/// causal mask, the LSH bins and the tiles (aligned to multiples of the tile size from
/// position 0), so a slice of keys at its positions gives bitwise the terms of the whole
/// sequence for the pairs it holds. Converts from the query offset alone (keys from 0).
struct TilePositions {
  Index query = 0;
  Index key = 0;
  TilePositions(Index query_offset = 0, Index key_offset = 0)  // NOLINT: converts from Index
      : query(query_offset), key(key_offset) {}
};

/// How a key tile meets the windows of the rows computed: not at all, every entry kept, or cut.
enum class KeyTileCut { skip, full, masked };

/// Key tiles copied or packed once and kept for the rest of a parallel loop, so that a thread
/// whose jobs read the same keys (one head's query tiles, one after the other) reads each key
/// tile from one contiguous block, prepared once instead of once per query tile (ContiguousKV
/// and PairedHalfKV, detail/tile/engine.hpp). Tile t of the source holds the keys at positions
/// [t Bk, (t + 1) Bk) present in it; its slot spans k_words KWords and v_words VWords. A new
/// source (other K and V, or another layout) starts a new epoch: nothing is cleared, and
/// memory is only touched where tiles are prepared.
template <typename KWord, typename VWord>
class KeyTileStore {
 public:
  /// The most memory a store takes (its tiles, per thread): longer sources are not held.
  static constexpr Index max_bytes = Index{64} << 20;
  /// What the tiles are read from (K row 0 is the key at position key_position) and how they
  /// are laid out (`layout`: 0, or which packing): equal sources give equal tiles.
  struct Source {
    const void* k = nullptr;
    const void* v = nullptr;
    Index rows = 0, k_stride = 0, v_stride = 0, d = 0, dv = 0, key_position = 0, layout = 0;
    bool operator==(const Source& o) const {
      return k == o.k && v == o.v && rows == o.rows && k_stride == o.k_stride &&
             v_stride == o.v_stride && d == o.d && dv == o.dv && key_position == o.key_position &&
             layout == o.layout;
    }
  };
  /// Where a whole tile's K and V words go, and whether they are there already.
  struct Slot {
    KWord* k;
    VWord* v;
    bool ready;
  };

  /// Holds the tiles of `from`, k_tile and v_tile words each (keeping those already prepared
  /// when `from` is the source held); false, holding nothing, when they would take more than
  /// max_bytes.
  bool hold(const Source& from, Index k_tile, Index v_tile) {
    const Index first = from.key_position / tile_key_cols;
    const Index tiles =
        from.rows > 0 ? (from.key_position + from.rows - 1) / tile_key_cols - first + 1 : 0;
    const Index bytes = tiles * (k_tile * Index{sizeof(KWord)} + v_tile * Index{sizeof(VWord)});
    if (tiles == 0 || bytes > max_bytes) return false;
    if (from == source_ && k_tile == k_words_ && v_tile == v_words_) return true;
    source_ = from;
    first_tile_ = first;
    k_words_ = k_tile;
    v_words_ = v_tile;
    if (capacity_k_ < tiles * k_tile) {
      k_.reset(new KWord[static_cast<std::size_t>(tiles * k_tile)]);
      capacity_k_ = tiles * k_tile;
    }
    if (capacity_v_ < tiles * v_tile) {
      v_.reset(new VWord[static_cast<std::size_t>(tiles * v_tile)]);
      capacity_v_ = tiles * v_tile;
    }
    if (++epoch_ == 0) {  // after 2^32 sources: every slot unprepared again
      std::fill(ready_.begin(), ready_.end(), std::uint32_t{0});
      epoch_ = 1;
    }
    if (static_cast<Index>(ready_.size()) < tiles) ready_.resize(static_cast<std::size_t>(tiles));
    return true;
  }

  /// The slot of the source's rows [j0, j0 + keys) when they are a whole tile (all the keys of
  /// its tile the source holds), counted as ready from now on (the caller prepares a slot that
  /// is not); none otherwise.
  std::optional<Slot> whole_tile(Index j0, Index keys) {
    const Index p0 = source_.key_position, tile = (p0 + j0) / tile_key_cols;
    const Index begin = std::max(tile * tile_key_cols, p0) - p0;
    const Index end = std::min((tile + 1) * tile_key_cols - p0, source_.rows);
    if (j0 != begin || j0 + keys != end) return std::nullopt;
    const Index slot = tile - first_tile_;
    std::uint32_t& mark = ready_[static_cast<std::size_t>(slot)];
    const bool ready = mark == epoch_;
    mark = epoch_;
    return Slot{k_.get() + slot * k_words_, v_.get() + slot * v_words_, ready};
  }

 private:
  Source source_;
  Index first_tile_ = 0, k_words_ = 0, v_words_ = 0, capacity_k_ = 0, capacity_v_ = 0;
  std::unique_ptr<KWord[]> k_;
  std::unique_ptr<VWord[]> v_;
  std::vector<std::uint32_t> ready_;
  std::uint32_t epoch_ = 0;
};

/// The buffers of a TileEngine (O(tile (d + d_v)) scalars, and up to KeyTileStore::max_bytes
/// of key tiles kept for the next query tiles), reusable across heads and calls:
/// they only grow. `wide_q`, `wide_k` and `wide_v` hold the query tile and the key tile
/// widened to Scalar when Q or K, V are stored in a half-precision type (WideningKV), `wide_out`
/// an output row before it is rounded to a half-precision output. On the AVX512-BF16 unit
/// (PairedHalfKV, detail/tile/pair_kernels.hpp), `pair_q`, `pair_p` and `pair_v` hold the query
/// tile, the probabilities and the key tile's values as pairs of bfloat16 values, `pair_k` the
/// key tile's rows padded to an even length when d is odd. On the AMX units (PairedHalfKV<Half,
/// Tiles>, detail/tile/amx_kernels.hpp) the same buffers hold the operands of the
/// tiles: `pair_q` and `pair_k` padded with zeros to multiples of 32 columns of d, `pair_p` the
/// probabilities of each query row as pairs along the keys (tile_key_cols / 2 words a row).
template <typename Scalar>
struct TileBuffers {
  using Buffer = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
  using Words = Eigen::Array<std::uint32_t, Eigen::Dynamic, 1>;
  Buffer qt, scores, running_max, running_sum, alpha, shift, tile_max, acc, values;
  Buffer wide_q, wide_k, wide_v, wide_out;
  Words pair_q, pair_p, pair_v;
  Eigen::Array<std::uint16_t, Eigen::Dynamic, 1> pair_k;
  /// Whether the engines keep the whole key tiles they prepare for the thread's next jobs
  /// (parallel_query_tiles sets them from its JobOrder): `keep_key_rows`, copies of K and V
  /// rows in the compute type in `key_rows` (ContiguousKV; for jobs that read every key before
  /// them, JobOrder::heads_outer), and `keep_packed_tiles`, key tiles packed for a unit in
  /// `key_pairs` (PairedHalfKV). A kept tile is known by the address and shape of its K and V,
  /// not by their values: set only for buffers that live within one call (whose inputs do not
  /// change).
  bool keep_key_rows = false;
  bool keep_packed_tiles = false;
  /// Whether TileEngine::run stores output rows non-temporally: set by parallel_query_tiles
  /// for a loop whose outputs are too large to stay cached (streams_output).
  bool stream_output = false;
  KeyTileStore<Scalar, Scalar> key_rows;
  KeyTileStore<std::uint16_t, std::uint32_t> key_pairs;

  void prepare(Index d, Index dv_padded, bool pack_values) {
    constexpr Index Bq = tile_query_rows, Bk = tile_key_cols;
    grow(qt, d * Bq);
    grow(scores, Bk * Bq);
    for (Buffer* row_buffer : {&running_max, &running_sum, &alpha, &shift, &tile_max})
      grow(*row_buffer, Bq);
    grow(acc, Bq * dv_padded);
    if (pack_values && values.size() < Bk * dv_padded) values.setZero(Bk * dv_padded);
  }

 private:
  static void grow(Buffer& buffer, Index size) {
    if (buffer.size() < size) buffer.resize(size);
  }
};

}  // namespace poslsh::detail
