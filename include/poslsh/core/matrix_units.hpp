// poslsh: the CPU units that can multiply the tiles of half-precision attention, found at run
// time. One build (with or without -march=native) carries the code of every unit; a call uses
// the best unit of the CPU it runs on (matrix_unit_for), so the same program or Python wheel
// uses AVX512-BF16 dot products where the CPU has them and float products elsewhere.
//
//   float_widening  every half-precision value widened to float, float multiply-adds (any CPU);
//   avx512_bf16     vdpbf16ps: 32 bfloat16 products summed in pairs into 16 float lanes per
//                   instruction (AVX512-BF16: Intel Cooper Lake, Sapphire Rapids and later;
//                   AMD Zen 4 and later). Needs AVX-512 F and BW, and the OS saving the
//                   AVX-512 state (XCR0).
#pragma once

#include <cstdint>
#include <type_traits>

#include "poslsh/core/names.hpp"
#include "poslsh/core/types.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define POSLSH_X86_UNITS 1
#else
#define POSLSH_X86_UNITS 0
#endif

namespace poslsh {

/// The units that multiply half-precision tiles (see the file comment).
enum class MatrixUnit { float_widening, avx512_bf16 };

/// The names "float_widening" and "avx512_bf16" (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(MatrixUnit, float_widening, avx512_bf16);

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
#endif

}  // namespace detail

/// Whether this CPU (and OS) can run `unit`. float_widening: always. Detected once.
inline bool matrix_unit_available(MatrixUnit unit) {
  switch (unit) {
    case MatrixUnit::float_widening:
      return true;
    case MatrixUnit::avx512_bf16: {
#if POSLSH_X86_UNITS
      static const bool available = detail::detect_avx512_bf16();
      return available;
#else
      return false;
#endif
    }
  }
  return false;
}

/// The unit that multiplies the tiles of a call with Q stored as QScalar and K, V as KVScalar
/// under `precision`: avx512_bf16 when all three are Eigen::bfloat16, the precision is
/// Precision::matrix_units and the CPU has the unit; float_widening otherwise (float and
/// double inputs are multiplied in their own type, Eigen::half and mixed inputs widened).
template <typename QScalar, typename KVScalar>
MatrixUnit matrix_unit_for(Precision precision) {
  if constexpr (std::is_same_v<QScalar, Eigen::bfloat16> &&
                std::is_same_v<KVScalar, Eigen::bfloat16>) {
    if (precision == Precision::matrix_units && matrix_unit_available(MatrixUnit::avx512_bf16))
      return MatrixUnit::avx512_bf16;
  }
  static_cast<void>(precision);
  return MatrixUnit::float_widening;
}

/// matrix_unit_for<QScalar, KVScalar>(options.precision): the unit a kernel called with these
/// options on views of these types uses.
template <typename QScalar, typename KVScalar>
MatrixUnit matrix_unit_for(const AttentionOptions& options) {
  return matrix_unit_for<QScalar, KVScalar>(options.precision);
}

}  // namespace poslsh
