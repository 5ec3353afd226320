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
#include <cstdint>
#include <memory>
#include <vector>

#include "poslsh/core/types.hpp"

namespace poslsh::detail {

/// Query rows per tile (aligned to multiples of it from row 0) and keys per tile.
inline constexpr Index tile_query_rows = 64;
inline constexpr Index tile_key_cols = 64;

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

/// Key tiles packed for the matrix units and kept for the rest of a parallel loop, so that a
/// thread whose jobs read the same keys (one head's query tiles, one after the other) packs
/// each key tile once instead of once per query tile (PairedBf16KV, detail/tile/engine.hpp).
/// Tile t of the source holds the keys at positions [t Bk, (t + 1) Bk) present in it; slot s
/// (tile first_tile + s) spans k_words 16-bit words at k + s k_words and v_words 32-bit words at
/// v + s v_words, and is packed when packed[s] == epoch. A new source (another K and V, or
/// another packing) starts a new epoch: nothing is cleared, and memory is only touched where
/// tiles are packed.
struct KeyTileStore {
  /// The most memory a store takes (its packed tiles, per thread): longer sources are packed
  /// at each visit instead.
  static constexpr Index max_bytes = Index{64} << 20;
  /// What the packed tiles were read from: equal sources give equal packings.
  struct Source {
    const void* k = nullptr;
    const void* v = nullptr;
    Index rows = 0, k_stride = 0, v_stride = 0, d = 0, dv = 0, key_position = 0;
    bool amx = false;
    bool operator==(const Source& o) const {
      return k == o.k && v == o.v && rows == o.rows && k_stride == o.k_stride &&
             v_stride == o.v_stride && d == o.d && dv == o.dv && key_position == o.key_position &&
             amx == o.amx;
    }
  };
  Source source;
  Index first_tile = 0, k_words = 0, v_words = 0;
  std::unique_ptr<std::uint16_t[]> k;
  std::unique_ptr<std::uint32_t[]> v;
  Index capacity_k = 0, capacity_v = 0;
  std::vector<std::uint32_t> packed;
  std::uint32_t epoch = 0;

  /// Makes the store hold `tiles` slots of k_tile and v_tile words for `from`, starting at tile
  /// `first`; keeps the packed tiles when `from` is the current source.
  void hold(const Source& from, Index first, Index tiles, Index k_tile, Index v_tile) {
    if (from == source && first == first_tile && k_tile == k_words && v_tile == v_words &&
        static_cast<Index>(packed.size()) >= tiles)
      return;
    source = from;
    first_tile = first;
    k_words = k_tile;
    v_words = v_tile;
    if (capacity_k < tiles * k_tile) {
      k.reset(new std::uint16_t[static_cast<std::size_t>(tiles * k_tile)]);
      capacity_k = tiles * k_tile;
    }
    if (capacity_v < tiles * v_tile) {
      v.reset(new std::uint32_t[static_cast<std::size_t>(tiles * v_tile)]);
      capacity_v = tiles * v_tile;
    }
    if (++epoch == 0) {  // after 2^32 sources: every slot unpacked again
      std::fill(packed.begin(), packed.end(), std::uint32_t{0});
      epoch = 1;
    }
    if (static_cast<Index>(packed.size()) < tiles) packed.resize(static_cast<std::size_t>(tiles));
  }
};

/// The buffers of a TileEngine (O(tile (d + d_v)) scalars, and on the bfloat16 units up to
/// KeyTileStore::max_bytes of packed key tiles), reusable across heads and calls:
/// they only grow. `wide_q`, `wide_k` and `wide_v` hold the query tile and the key tile
/// widened to Scalar when Q or K, V are stored in a half-precision type (WideningKV), `wide_out`
/// an output row before it is rounded to a half-precision output. On the AVX512-BF16 unit
/// (PairedBf16KV, detail/tile/pair_kernels.hpp), `pair_q`, `pair_p` and `pair_v` hold the query
/// tile, the probabilities and the key tile's values as pairs of bfloat16 values, `pair_k` the
/// key tile's rows padded to an even length when d is odd. On the AMX-BF16 unit
/// (PairedBf16KV<true>, detail/tile/amx_kernels.hpp) the same buffers hold the operands of the
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
  /// Whether the loop running this thread's jobs gives it one head's query tiles in a row
  /// (parallel_query_tiles), so that key tiles packed for the matrix units are kept in
  /// `key_tiles` for the next job.
  bool keep_key_tiles = false;
  KeyTileStore key_tiles;

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
