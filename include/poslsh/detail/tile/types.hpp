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
#include <cstdint>

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

/// The buffers of a TileEngine (O(tile (d + d_v)) scalars), reusable across heads and calls:
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
