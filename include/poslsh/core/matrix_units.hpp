// poslsh: the CPU units that can multiply the tiles of half-precision attention, found at run
// time. One build (with or without -march=native) carries the code of every unit; a call uses
// the best unit of the CPU it runs on (matrix_unit_for), so the same program or Python wheel
// uses AVX512-BF16 dot products where the CPU has them and float products elsewhere.
//
//   float_products  every half-precision value widened to float, float multiply-adds (any CPU);
//   avx512_bf16     vdpbf16ps: 32 bfloat16 products summed in pairs into 16 float lanes per
//                   instruction (AVX512-BF16: Intel Cooper Lake, Sapphire Rapids and later;
//                   AMD Zen 4 and later). Needs AVX-512 F and BW, and the OS saving the
//                   AVX-512 state (XCR0).
//   amx_bf16        tdpbf16ps: a 16 x 16 float tile += a 16 x 32 bfloat16 tile times a 32 x 16
//                   one (AMX-BF16: Intel Sapphire Rapids and later). Needs AMX-TILE and
//                   AMX-BF16, the OS saving the tile state (XCR0 bits 17 and 18) and, on
//                   Linux, the process's permission to use it (arch_prctl
//                   ARCH_REQ_XCOMP_PERM, asked once); the code around the tiles also needs
//                   avx512_bf16. Where the permission is refused the unit is not available.
//   amx_fp16        tdpfp16ps: the same tiles of float16 pairs (AMX-FP16: Intel Granite Rapids
//                   and later), with the same needs as amx_bf16 (AMX-TILE, the OS state, the
//                   permission, avx512_bf16 for the code around the tiles).
// With Q, K and V all in Eigen::bfloat16 and Precision::matrix_units, a call uses amx_bf16,
// else avx512_bf16, else float_products, the first the CPU has; with all three in Eigen::half,
// amx_fp16, else float_products. AVX512-FP16 has no float16 product summed in float (its
// multiply-adds round every sum to float16), so float16 inputs without AMX-FP16 are widened.
#pragma once

#include <cstdint>
#include <type_traits>

#include "poslsh/core/names.hpp"
#include "poslsh/core/types.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define POSLSH_X86_UNITS 1
#else
#define POSLSH_X86_UNITS 0
#endif

namespace poslsh {

/// The units that multiply half-precision tiles (see the file comment).
enum class MatrixUnit { float_products, avx512_bf16, amx_bf16, amx_fp16 };

/// The names "float_products", "avx512_bf16", "amx_bf16" and "amx_fp16" (enum_name,
/// enum_from_name).
POSLSH_ENUM_NAMES(MatrixUnit, float_products, avx512_bf16, amx_bf16, amx_fp16);

namespace detail {

#if POSLSH_X86_UNITS
/// CPUID leaf `leaf`, subleaf `subleaf`: {eax, ebx, ecx, edx}, all 0 when the leaf is absent.
struct CpuidRegisters {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};
inline CpuidRegisters cpuid(unsigned leaf, unsigned subleaf) {
  CpuidRegisters r;
  if (static_cast<unsigned>(__get_cpuid_max(0, nullptr)) < leaf) return r;
  __cpuid_count(leaf, subleaf, r.eax, r.ebx, r.ecx, r.edx);
  return r;
}

/// XCR0, the state components the OS saves (0 when the OS has not enabled XGETBV).
inline std::uint64_t os_saved_state() {
  if ((cpuid(1, 0).ecx & (1u << 27)) == 0) return 0;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

/// Whether the CPU has AVX-512 F, BW and BF16 and the OS saves the AVX-512 registers.
inline bool detect_avx512_bf16() {
  constexpr std::uint64_t avx512_state = 0xe6;  // SSE, AVX, opmask, ZMM0-15 high, ZMM16-31
  if ((os_saved_state() & avx512_state) != avx512_state) return false;
  const CpuidRegisters leaf7 = cpuid(7, 0);
  const bool f = (leaf7.ebx & (1u << 16)) != 0, bw = (leaf7.ebx & (1u << 30)) != 0;
  if (!f || !bw || leaf7.eax < 1) return false;
  return (cpuid(7, 1).eax & (1u << 5)) != 0;
}

/// Whether Linux grants this process the AMX tile data (arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)), asked once; other systems: no.
inline bool amx_permission_granted() {
#if defined(__linux__) && defined(SYS_arch_prctl) && defined(__x86_64__)
  static const bool granted = [] {
    constexpr long request_permission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long tile_data = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, request_permission, tile_data) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

/// Whether the CPU has AMX-TILE (CPUID leaf 7 EDX bit 24) and the tile products of `unit`
/// (amx_bf16: leaf 7 EDX bit 22; amx_fp16: leaf 7 subleaf 1 EAX bit 21), the OS saves the tile
/// configuration and data (XCR0 bits 17 and 18) and grants this process the tile data
/// (amx_permission_granted), and the CPU has avx512_bf16 (detect_avx512_bf16); in 64-bit code.
/// Asks for the permission when the rest holds; a refusal means false. Call once per unit
/// (matrix_unit_available keeps the answers).
inline bool detect_amx(MatrixUnit unit) {
#if !defined(__x86_64__)
  static_cast<void>(unit);
  return false;  // the tiles exist in 64-bit mode only
#else
  constexpr std::uint64_t tile_state = (std::uint64_t{1} << 17) | (std::uint64_t{1} << 18);
  const CpuidRegisters leaf7 = cpuid(7, 0);
  const bool tile = (leaf7.edx & (1u << 24)) != 0;
  const bool products = unit == MatrixUnit::amx_bf16
                            ? (leaf7.edx & (1u << 22)) != 0
                            : leaf7.eax >= 1 && (cpuid(7, 1).eax & (1u << 21)) != 0;
  if (!tile || !products || (os_saved_state() & tile_state) != tile_state) return false;
  if (!detect_avx512_bf16()) return false;
  return amx_permission_granted();
#endif
}
#endif

}  // namespace detail

/// Whether this CPU (and OS) can run `unit`. float_products: always. Detected once per unit
/// (for the AMX units, the first call asks Linux for the tile permission).
inline bool matrix_unit_available(MatrixUnit unit) {
#if POSLSH_X86_UNITS
  switch (unit) {
    case MatrixUnit::float_products:
      return true;
    case MatrixUnit::avx512_bf16: {
      static const bool available = detail::detect_avx512_bf16();
      return available;
    }
    case MatrixUnit::amx_bf16: {
      static const bool available = detail::detect_amx(MatrixUnit::amx_bf16);
      return available;
    }
    case MatrixUnit::amx_fp16: {
      static const bool available = detail::detect_amx(MatrixUnit::amx_fp16);
      return available;
    }
  }
  return false;
#else
  return unit == MatrixUnit::float_products;
#endif
}

namespace detail {

/// The unit of a call with Q stored as QScalar and K, V as KVScalar under `precision` (the rule
/// of matrix_unit_for), with the AMX units (amx_bf16, amx_fp16) counted as available where
/// amx_available(unit) says so; avx512_bf16 where matrix_unit_available says so.
template <typename QScalar, typename KVScalar, typename AmxAvailable>
MatrixUnit choose_matrix_unit(Precision precision, AmxAvailable&& amx_available) {
  if (precision == Precision::matrix_units) {
    if constexpr (std::is_same_v<QScalar, Eigen::bfloat16> &&
                  std::is_same_v<KVScalar, Eigen::bfloat16>) {
      if (amx_available(MatrixUnit::amx_bf16)) return MatrixUnit::amx_bf16;
      if (matrix_unit_available(MatrixUnit::avx512_bf16)) return MatrixUnit::avx512_bf16;
    }
    if constexpr (std::is_same_v<QScalar, Eigen::half> && std::is_same_v<KVScalar, Eigen::half>) {
      if (amx_available(MatrixUnit::amx_fp16)) return MatrixUnit::amx_fp16;
    }
  }
  static_cast<void>(amx_available);
  return MatrixUnit::float_products;
}

}  // namespace detail

/// The unit that multiplies the tiles of a call with Q stored as QScalar and K, V as KVScalar
/// under `precision`: under Precision::matrix_units, when all three are Eigen::bfloat16,
/// amx_bf16 if the CPU has it, else avx512_bf16 if it has that; when all three are
/// Eigen::half, amx_fp16 if the CPU has it; float_products otherwise (float and double inputs
/// are multiplied in their own type, other half-precision and mixed inputs widened).
template <typename QScalar, typename KVScalar>
MatrixUnit matrix_unit_for(Precision precision) {
  return detail::choose_matrix_unit<QScalar, KVScalar>(precision, matrix_unit_available);
}

/// matrix_unit_for<QScalar, KVScalar>(options.precision): the unit a kernel called with these
/// options on views of these types uses.
template <typename QScalar, typename KVScalar>
MatrixUnit matrix_unit_for(const AttentionOptions& options) {
  return matrix_unit_for<QScalar, KVScalar>(options.precision);
}

}  // namespace poslsh
