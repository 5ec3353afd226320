// poslsh internals: the tile engine's products on AMX (core/matrix_units.hpp), for Q, K and V
// stored in Eigen::bfloat16 (MatrixUnit::amx_bf16, tdpbf16ps) or in Eigen::half
// (MatrixUnit::amx_fp16, tdpfp16ps). Each adds to a float tile C (16 rows, 16 columns) the
// product of a tile A (16 rows of 16 pairs of 16-bit values) and a tile B (16 rows of 16
// pairs, row k holding pair k of each column), the pairs along the summed index; the kernels
// below are the same for both, parameterised by the type of the values (`Half`). Every tile here is
// 16 rows of 64 bytes (one configuration, palette 1): C in tiles 0-3, A in tile 4, B in tiles 5
// and 6. The operands:
//   scores  C[key][query] over blocks of 16 keys: A = the key rows (K's rows copied, d padded
//           with zeros to a multiple of 32), B = the query pairs pair_q[c2 * tile + a]
//           (pair_pack_queries, padded with zero rows to a multiple of 16 pairs); C is the
//           transposed score tile, stored as the engine keeps it (scores[key * tile + query]);
//   values  C = acc (rows of 16 queries, 16 value columns), A = the probabilities of a query
//           row as pairs along keys (amx_pack_probs, rounded to Half), B = the value pairs
//           pair_v[b2 * cols + c] (pair_pack_values, padded with zero pairs to 32 a tile).
// The summed index runs in fixed blocks (32 columns of d from column 0; 32 keys from the key
// tile's first), each block one tdpbf16ps (tdpfp16ps), so an entry of C depends only on its A row,
// its B column and the blocks summed: a query's result depends only on its own row and the keys,
// never on the other rows of its tile. Blocks of zeros add exactly 0.
// The tile operations come from a tile layer `Tiles`, a template parameter of the kernels (the
// contract: AmxNativeTiles). The library's layer, AmxNativeTiles, issues the instructions
// (inline assembly rather than the _tile_* intrinsics, whose GCC forms tell the compiler of no
// memory read by tileloadd and of only 8 bytes read by ldtilecfg; tdpfp16ps as its bytes, which
// assemblers before 2023 do not know); the tile engine (detail/tile/engine.hpp) takes the layer
// as a template parameter too, with AmxNativeTiles as its default, and runs the kernels on it
// where the layer's available() says it can run.
// Every function carrying AMX or AVX-512 instructions is compiled for that target by a
// function attribute, so the code exists in any x86-64 build (with or without -march=native);
// the instructions run only where matrix_unit_available(MatrixUnit::amx_bf16 or amx_fp16) says
// they can (AmxNativeTiles::available).
#pragma once

#include "poslsh/core/matrix_units.hpp"

#if POSLSH_X86_UNITS

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/tile/pair_kernels.hpp"

#define POSLSH_AMX_BF16_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define POSLSH_AMX_BF16_INLINE POSLSH_AMX_BF16_TARGET inline __attribute__((always_inline))

#include "poslsh/detail/disable_intrinsic_warnings.hpp"

namespace poslsh::detail {

/// Whether AMX tiles multiply pairs of Half values: Eigen::bfloat16 (tdpbf16ps) and Eigen::half
/// (tdpfp16ps).
template <typename Half>
inline constexpr bool amx_half_v =
    std::is_same_v<Half, Eigen::bfloat16> || std::is_same_v<Half, Eigen::half>;

/// Rows, bytes a row, and the summed pairs of every tile (16 x 64 bytes: 16 pairs of 16-bit values
/// or 16 floats a row).
inline constexpr Index amx_rows = 16;
inline constexpr Index amx_row_bytes = 64;
inline constexpr Index amx_pairs = 16;

/// The tile configuration ldtilecfg reads (64 bytes): palette, start row, the bytes a row and
/// the rows of each of the 16 tile registers.
struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 0;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileConfig) == 64, "ldtilecfg reads 64 bytes");

/// Palette 1, tiles 0-6 of 16 rows of 64 bytes, the others unused.
inline AmxTileConfig amx_tile_config() {
  AmxTileConfig config;
  config.palette = 1;
  for (int t = 0; t < 7; ++t) {
    config.colsb[t] = static_cast<std::uint16_t>(amx_row_bytes);
    config.rows[t] = static_cast<std::uint8_t>(amx_rows);
  }
  return config;
}

// The tile instructions as inline assembly (both assembler syntaxes): loads and stores name
// the memory they read or write (a "memory" clobber, so stores before a load are done and
// reads after a store see it), ldtilecfg its whole 64-byte operand. Only x86-64 has the tiles.
#if defined(__x86_64__)
#define POSLSH_AMX_LOAD(t)                                                             \
  __asm__ volatile("{tileloadd (%0,%1,1), %%tmm" #t "|tileloadd tmm" #t ", [%0+%1*1]}" \
                   :                                                                   \
                   : "r"(base), "r"(s)                                                 \
                   : "memory")
#define POSLSH_AMX_STORE(t)                                                              \
  __asm__ volatile("{tilestored %%tmm" #t ", (%0,%1,1)|tilestored [%0+%1*1], tmm" #t "}" \
                   :                                                                     \
                   : "r"(base), "r"(s)                                                   \
                   : "memory")
#define POSLSH_AMX_BF16_DOT(c, b)                                                                  \
  __asm__ volatile("{tdpbf16ps %%tmm" #b ", %%tmm4, %%tmm" #c "|tdpbf16ps tmm" #c ", tmm4, tmm" #b \
                   "}" ::)
// tdpfp16ps as its bytes (assemblers before 2023 do not know it): VEX.128.F2.0F38.W0 5C with
// vvvv = B's tile, ModRM reg = C's tile, rm = A's (tile 4).
#define POSLSH_AMX_FP16_VVVV_5 "0x53"
#define POSLSH_AMX_FP16_VVVV_6 "0x4b"
#define POSLSH_AMX_FP16_MODRM_0 "0xc4"
#define POSLSH_AMX_FP16_MODRM_1 "0xcc"
#define POSLSH_AMX_FP16_MODRM_2 "0xd4"
#define POSLSH_AMX_FP16_MODRM_3 "0xdc"
#define POSLSH_AMX_FP16_DOT(c, b)                                \
  __asm__ volatile(".byte 0xc4, 0xe2, " POSLSH_AMX_FP16_VVVV_##b \
                   ", 0x5c, " POSLSH_AMX_FP16_MODRM_##c ::)
#define POSLSH_AMX_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#else
#define POSLSH_AMX_LOAD(t) static_cast<void>(s)
#define POSLSH_AMX_STORE(t) static_cast<void>(s)
#define POSLSH_AMX_BF16_DOT(c, b) static_cast<void>(0)
#define POSLSH_AMX_FP16_DOT(c, b) static_cast<void>(0)
#define POSLSH_AMX_ZERO(t) static_cast<void>(0)
#endif

// One switch case per tile register (register numbers are part of the instruction).
#define POSLSH_AMX_ACCUMULATORS(X) X(0) X(1) X(2) X(3)
#define POSLSH_AMX_TILES(X) POSLSH_AMX_ACCUMULATORS(X) X(4) X(5) X(6)
#define POSLSH_AMX_ZERO_CASE(t) \
  case t:                       \
    POSLSH_AMX_ZERO(t);         \
    break;
#define POSLSH_AMX_LOAD_CASE(t) \
  case t:                       \
    POSLSH_AMX_LOAD(t);         \
    break;
#define POSLSH_AMX_STORE_CASE(t) \
  case t:                        \
    POSLSH_AMX_STORE(t);         \
    break;
#define POSLSH_AMX_DOT_CASES(dot, c) \
  case 2 * c:                        \
    dot(c, 5);                       \
    break;                           \
  case 2 * c + 1:                    \
    dot(c, 6);                       \
    break;
#define POSLSH_AMX_BF16_DOT_CASES(c) POSLSH_AMX_DOT_CASES(POSLSH_AMX_BF16_DOT, c)
#define POSLSH_AMX_FP16_DOT_CASES(c) POSLSH_AMX_DOT_CASES(POSLSH_AMX_FP16_DOT, c)

/// The tile instructions of both units (ldtilecfg, tilezero, tileloadd, tilestored,
/// tilerelease). Tiles: C in 0-3, A in 4, B in 5 and 6.
struct AmxNativeTileOps {
  POSLSH_AMX_BF16_INLINE static void configure(const AmxTileConfig& config) {
#if defined(__x86_64__)
    __asm__ volatile("ldtilecfg %0" : : "m"(config));
#else
    static_cast<void>(config);
#endif
  }
  POSLSH_AMX_BF16_INLINE static void zero(int t) {
    switch (t) { POSLSH_AMX_ACCUMULATORS(POSLSH_AMX_ZERO_CASE) }
  }
  POSLSH_AMX_BF16_INLINE static void load(int t, const void* base, Index stride) {
    const auto s = static_cast<long>(stride);
    static_cast<void>(base);
    switch (t) { POSLSH_AMX_TILES(POSLSH_AMX_LOAD_CASE) }
  }
  POSLSH_AMX_BF16_INLINE static void store(int t, void* base, Index stride) {
    const auto s = static_cast<long>(stride);
    static_cast<void>(base);
    switch (t) { POSLSH_AMX_ACCUMULATORS(POSLSH_AMX_STORE_CASE) }
  }
  POSLSH_AMX_BF16_INLINE static void release() {
#if defined(__x86_64__)
    __asm__ volatile("tilerelease" ::);
#endif
  }
};

/// The CPU's tiles for values of type Half, the library's tile layer. A tile layer provides, as
/// static functions: configure(config) (ldtilecfg), zero(t) (tilezero, t in 0-3), load(t, base,
/// stride) (tileloadd: 16 rows of 64 bytes, row r at base + r stride, t in 0-6), store(t, base,
/// stride) (tilestored, t in 0-3), dot(c, b): C_c += A_4 B_b (c in 0-3, b in 5-6) by tdpbf16ps
/// (Eigen::bfloat16) or tdpfp16ps (Eigen::half), release() (tilerelease), and available():
/// whether it can run on this CPU (here matrix_unit_available of the unit, amx_bf16 or
/// amx_fp16).
template <typename Half>
struct AmxNativeTiles : AmxNativeTileOps {
  static_assert(amx_half_v<Half>, "AMX tiles multiply bfloat16 or float16 pairs");
  static bool available() {
    return matrix_unit_available(std::is_same_v<Half, Eigen::bfloat16> ? MatrixUnit::amx_bf16
                                                                       : MatrixUnit::amx_fp16);
  }
  POSLSH_AMX_BF16_INLINE static void dot(int c, int b) {
    const int pair = 2 * c + (b == 5 ? 0 : 1);
    if constexpr (std::is_same_v<Half, Eigen::bfloat16>) {
      switch (pair) { POSLSH_AMX_ACCUMULATORS(POSLSH_AMX_BF16_DOT_CASES) }
    } else {
      switch (pair) { POSLSH_AMX_ACCUMULATORS(POSLSH_AMX_FP16_DOT_CASES) }
    }
  }
};

#undef POSLSH_AMX_ACCUMULATORS
#undef POSLSH_AMX_TILES
#undef POSLSH_AMX_ZERO_CASE
#undef POSLSH_AMX_LOAD_CASE
#undef POSLSH_AMX_STORE_CASE
#undef POSLSH_AMX_DOT_CASES
#undef POSLSH_AMX_BF16_DOT_CASES
#undef POSLSH_AMX_FP16_DOT_CASES
#undef POSLSH_AMX_LOAD
#undef POSLSH_AMX_STORE
#undef POSLSH_AMX_BF16_DOT
#undef POSLSH_AMX_FP16_DOT
#undef POSLSH_AMX_FP16_VVVV_5
#undef POSLSH_AMX_FP16_VVVV_6
#undef POSLSH_AMX_FP16_MODRM_0
#undef POSLSH_AMX_FP16_MODRM_1
#undef POSLSH_AMX_FP16_MODRM_2
#undef POSLSH_AMX_FP16_MODRM_3
#undef POSLSH_AMX_ZERO

/// The bits of x rounded to bfloat16 as vcvtneps2bf16 rounds (nearest even; zeros and values
/// below the float normal range give a zero of their sign; NaN a quiet NaN).
inline std::uint16_t amx_round_bf16(float x) {
  const auto u = Eigen::numext::bit_cast<std::uint32_t>(x);
  if ((u & 0x7f800000u) == 0) return static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// The bits of x rounded to Half for the AMX products: bfloat16 as amx_round_bf16; float16
/// to nearest even, as vcvtps2ph rounds (IEEE conversion, float16 denormals kept).
template <typename Half>
std::uint16_t amx_round(float x) {
  if constexpr (std::is_same_v<Half, Eigen::bfloat16>)
    return amx_round_bf16(x);
  else
    return Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(x));
}

/// One step of the products of the kernels below: tile 4 <- the operand rows at `a` (rows
/// a_stride values of type A apart), then for each accumulator t < blocks, tile 5 + t % 2 <- the
/// pair rows at b + t * amx_rows (rows b_stride words apart) and accumulator t += tile 4 times
/// that tile (the two B tiles alternate, so a load need not wait for the previous product). On
/// the tile layer Tiles, its tiles configured.
template <typename Tiles, typename A>
POSLSH_AMX_BF16_INLINE void amx_dot_step(const A* a, Index a_stride, const std::uint32_t* b,
                                         Index b_stride, int blocks) {
  Tiles::load(4, a, a_stride * static_cast<Index>(sizeof(A)));
  for (int t = 0; t < blocks; ++t) {
    const int tile_b = 5 + t % 2;
    Tiles::load(tile_b, b + t * amx_rows, b_stride * static_cast<Index>(sizeof(std::uint32_t)));
    Tiles::dot(t, tile_b);
  }
}

/// scores[key * tile + a] = tau C[key][a], C = the key rows times the query pairs, for keys in
/// [b, end) of the tile and queries a in [lo, hi) (hi - lo <= 64, within one 64-row tile); the
/// other entries are not written. keys: the key rows (the bits of 16-bit values, key_stride a
/// multiple of 32, zero past column d - 1, at least up to the multiple of 16 past `end`); pair_q:
/// the query pairs (pair_q[c2 * tile + a], key_stride / 2 rows, zero past d). Keys in blocks of 16
/// from b rounded down to a multiple of 16, queries in blocks of 16 from lo rounded down. On the
/// tile layer Tiles (AmxNativeTiles<Half>: values of type Half), its tiles configured
/// (amx_configure_tiles<Tiles>).
template <typename Tiles>
POSLSH_AMX_BF16_TARGET __attribute__((noinline)) void amx_score_tiles(
    const std::uint32_t* pair_q, Index tile, const std::uint16_t* keys, Index key_stride, Index b,
    Index end, Index lo, Index hi, float tau, float* scores) {
  const Index start = lo / amx_rows * amx_rows;
  const int blocks = static_cast<int>((hi - start + amx_rows - 1) / amx_rows);
  const Index d_blocks = key_stride / (2 * amx_pairs);
  alignas(64) float c_tile[amx_rows * amx_rows];
  for (Index k0 = b / amx_rows * amx_rows; k0 < end; k0 += amx_rows) {
    for (int q = 0; q < blocks; ++q) Tiles::zero(q);
    for (Index c = 0; c < d_blocks; ++c)
      amx_dot_step<Tiles>(keys + k0 * key_stride + c * 2 * amx_pairs, key_stride,
                          pair_q + c * amx_pairs * tile + start, tile, blocks);
    const Index key_first = std::max(b, k0), key_last = std::min(end, k0 + amx_rows);
    const __m512 scale = _mm512_set1_ps(tau);
    for (int q = 0; q < blocks; ++q) {
      Tiles::store(q, c_tile, amx_row_bytes);
      const Index q0 = start + q * amx_rows;
      const __mmask16 mask = pair_row_mask(q0, lo, hi);
      for (Index key = key_first; key < key_last; ++key)
        _mm512_mask_storeu_ps(scores + key * tile + q0, mask,
                              _mm512_mul_ps(_mm512_load_ps(c_tile + (key - k0) * amx_rows), scale));
    }
  }
}

/// acc[r][c] <- alpha[r] acc[r][c] + sum over the key pairs of blocks [first, last] (16 pairs a
/// block) of probs[r] . pair_v, for the 16 rows r of a block of queries and the `cols` columns
/// (a multiple of 16; acc's rows acc_stride floats apart, at least cols). probs: row r's pairs
/// at probs + r * probs_stride (words, amx_pack_probs); pair_v: pair b2 at pair_v + b2 * cols
/// (zero past the tile's keys up to the last block). Columns in groups of up to 64. On the tile
/// layer Tiles, its tiles configured (amx_configure_tiles<Tiles>).
template <typename Tiles>
POSLSH_AMX_BF16_TARGET __attribute__((noinline)) void amx_value_tiles(
    const std::uint32_t* probs, Index probs_stride, const std::uint32_t* pair_v, Index cols,
    Index first, Index last, const float* alpha, float* acc, Index acc_stride) {
  for (Index r = 0; r < amx_rows; ++r) {
    const __m512 scale = _mm512_set1_ps(alpha[r]);
    for (Index c = 0; c < cols; c += amx_rows) {
      float* entry = acc + r * acc_stride + c;
      _mm512_storeu_ps(entry, _mm512_mul_ps(_mm512_loadu_ps(entry), scale));
    }
  }
  const Index acc_bytes = acc_stride * static_cast<Index>(sizeof(float));
  for (Index c0 = 0; c0 < cols; c0 += 4 * amx_rows) {
    const int blocks = static_cast<int>(std::min<Index>(4, (cols - c0) / amx_rows));
    for (int t = 0; t < blocks; ++t) Tiles::load(t, acc + c0 + t * amx_rows, acc_bytes);
    for (Index block = first; block <= last; ++block)
      amx_dot_step<Tiles>(probs + block * amx_pairs, probs_stride,
                          pair_v + block * amx_pairs * cols + c0, cols, blocks);
    for (int t = 0; t < blocks; ++t) Tiles::store(t, acc + c0 + t * amx_rows, acc_bytes);
  }
}

/// Loads the tile configuration of the kernels above (amx_tile_config) on this thread's tiles
/// of the layer Tiles; amx_score_tiles and amx_value_tiles on Tiles run between it and
/// amx_release_tiles on the same thread.
template <typename Tiles>
POSLSH_AMX_BF16_TARGET __attribute__((noinline)) void amx_configure_tiles() {
  const AmxTileConfig config = amx_tile_config();
  Tiles::configure(config);
}

/// Releases this thread's tiles of the layer Tiles (tilerelease), after amx_configure_tiles and
/// the kernels.
template <typename Tiles>
POSLSH_AMX_BF16_TARGET __attribute__((noinline)) void amx_release_tiles() {
  Tiles::release();
}

}  // namespace poslsh::detail

#include "poslsh/detail/restore_warnings.hpp"

#else

namespace poslsh::detail {

/// No AMX tiles off x86: the name of the library's tile layer (the tile engine's default
/// template argument), never defined.
template <typename Half>
struct AmxNativeTiles;

}  // namespace poslsh::detail

#endif  // POSLSH_X86_UNITS
