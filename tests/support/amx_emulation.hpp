// The AMX tile layers of the tests (the tile layer contract: AmxNativeTiles,
// poslsh/detail/tile/amx_kernels.hpp), passed as the tile engine's AmxTiles template argument
// (with_tile_engine, engine_rows, fold_block, per_sample_rows, detail::one_sequence_forward):
//  - AmxEmulatedTiles: the tile instructions computed in software as Intel's pseudo-code gives,
//    so the AMX kernels and the engine's AMX paths are tested on CPUs without AMX (available on
//    any CPU with avx512_bf16, which the code around the tiles uses);
//  - AmxTilesOff: the CPU's tiles, never available, so the engine takes the next unit
//    (avx512_bf16, float16 widening) and those are tested on CPUs with AMX too.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <poslsh/core/matrix_units.hpp>
#include <poslsh/detail/tile/amx_kernels.hpp>
#include <stdexcept>
#include <type_traits>

namespace poslsh_test {

/// The CPU's tiles turned off: available() is false, so the tile engine uses the unit after the
/// AMX one (the other operations are the CPU's, never reached).
template <typename Half>
struct AmxTilesOff : poslsh::detail::AmxNativeTiles<Half> {
  static bool available() { return false; }
};

#if POSLSH_X86_UNITS

/// The tile instructions computed in software, one set of 8 tiles and a configuration per
/// thread, with the register assignment of AmxNativeTiles (the parts common to both units;
/// AmxEmulatedTiles adds the products). A configuration or tiles the instructions would fault
/// on (no configuration, a tile not configured) throw std::logic_error. products() counts the
/// dot() calls of all threads, of both units.
struct AmxEmulatedTileOps {
  using Config = poslsh::detail::AmxTileConfig;
  using Index = poslsh::Index;
  struct State {
    Config config;
    unsigned char data[8][16][64];
  };
  static State& state() {
    thread_local State tiles{};
    return tiles;
  }
  static std::atomic<long long>& products() {
    static std::atomic<long long> count{0};
    return count;
  }
  /// The kernels around the tiles use AVX-512 and AVX512-BF16 instructions.
  static bool available() { return poslsh::matrix_unit_available(poslsh::MatrixUnit::avx512_bf16); }
  static void configure(const Config& config) {
    State& s = state();
    s.config = config;
    std::memset(s.data, 0, sizeof(s.data));
  }
  static void zero(int t) {
    check(t);
    std::memset(state().data[t], 0, sizeof(state().data[t]));
  }
  static void load(int t, const void* base, Index stride) {
    check(t);
    State& s = state();
    std::memset(s.data[t], 0, sizeof(s.data[t]));
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(s.data[t][r], static_cast<const unsigned char*>(base) + r * stride,
                  s.config.colsb[t]);
  }
  static void store(int t, void* base, Index stride) {
    check(t);
    const State& s = state();
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(static_cast<unsigned char*>(base) + r * stride, s.data[t][r], s.config.colsb[t]);
  }
  static void release() { state().config = Config{}; }

 protected:
  static void check(int t) {
    const Config& f = state().config;
    if (f.palette != 1 || t < 0 || t >= 8 || f.rows[t] == 0 || f.colsb[t] == 0)
      throw std::logic_error("AMX tile used without a configuration");
  }
  // A denormal float as a zero of its sign.
  static float flush(float x) {
    return std::fabs(x) < std::numeric_limits<float>::min() ? std::copysign(0.0f, x) : x;
  }
};

/// The emulated tiles for values of type Half. dot(c, b) follows Intel's pseudo-code of
/// TDPBF16PS (Eigen::bfloat16; Intel SDM, Vol. 2B) and TDPFP16PS (Eigen::half; the ISA
/// extensions reference), which differ only in how a value becomes a float (C = tile c, A =
/// tile 4, B = tile b): for each row m of C, float sums t[0 .. 2 N) start at 0; for each pair k
/// of A's row and each column n < N,
///   t[2n]     <- fma(A[m][2k],     B[k][2n],     t[2n]),
///   t[2n + 1] <- fma(A[m][2k + 1], B[k][2n + 1], t[2n + 1]),
/// then C[m][n] <- C[m][n] + (t[2n] + t[2n + 1]); every operation in float, round to nearest
/// even, output denormals flushed to 0 (FTZ = 1) and float inputs denormal taken as 0 (DAZ =
/// 1). A bfloat16 value is the float of its bits (a denormal one taken as 0); a float16 value
/// is converted exactly, its denormals kept (every float16 is a normal float or 0). Shapes the
/// instruction faults on (A's pairs not B's rows, C's rows or columns not A's rows or B's
/// columns) throw std::logic_error.
template <typename Half>
struct AmxEmulatedTiles : AmxEmulatedTileOps {
  static_assert(poslsh::detail::amx_half_v<Half>, "AMX tiles multiply bfloat16 or float16 pairs");
  static void dot(int c, int b) {
    constexpr int a = 4;
    check(c);
    check(a);
    check(b);
    State& s = state();
    const Config& f = s.config;
    const int m_rows = f.rows[c], n_cols = f.colsb[c] / 4, k_pairs = f.colsb[a] / 4;
    if (f.rows[a] != m_rows || f.rows[b] != k_pairs || f.colsb[b] != f.colsb[c])
      throw std::logic_error("AMX tile product: tile shapes do not match");
    for (int m = 0; m < m_rows; ++m) {
      float t[32] = {};
      for (int k = 0; k < k_pairs; ++k) {
        for (int n = 0; n < n_cols; ++n) {
          for (int h = 0; h < 2; ++h) {
            const float x = value_at(s.data[a][m], 2 * k + h);
            const float y = value_at(s.data[b][k], 2 * n + h);
            t[2 * n + h] = flush(std::fma(x, y, t[2 * n + h]));
          }
        }
      }
      for (int n = 0; n < n_cols; ++n) {
        float acc;
        std::memcpy(&acc, s.data[c][m] + 4 * n, sizeof(acc));
        acc = flush(flush(acc) + flush(t[2 * n] + t[2 * n + 1]));
        std::memcpy(s.data[c][m] + 4 * n, &acc, sizeof(acc));
      }
    }
    products().fetch_add(1, std::memory_order_relaxed);
  }

 private:
  // Value `i` of a row as a float.
  static float value_at(const unsigned char* row, int i) {
    std::uint16_t bits;
    std::memcpy(&bits, row + 2 * i, sizeof(bits));
    if constexpr (std::is_same_v<Half, Eigen::bfloat16>)
      return flush(Eigen::numext::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16));
    else
      return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
  }
};

/// The emulated tdpbf16ps and tdpfp16ps instructions run so far (all threads).
inline long long emulated_products() {
  return AmxEmulatedTileOps::products().load(std::memory_order_relaxed);
}

#else

/// No tiles to emulate off x86 (the tile engine never reaches its AMX paths there).
template <typename Half>
struct AmxEmulatedTiles;

inline long long emulated_products() { return 0; }

#endif

}  // namespace poslsh_test
