// poslsh benchmarks: the CPU's peak arithmetic rates, measured (not computed from a clock and a
// port count) on the threads a benchmark uses, so that a kernel row can state its share of the
// peak measured next to it in time.
//
// Each unit runs independent accumulator chains on every thread for a fixed count, all threads
// started together, timed from the first thread's start to the last one's end; the peak is the
// best of several such runs (the least disturbed one on a shared machine):
//   fma_f32      float32 fused multiply-add, acc = acc * m + acc on 24 zmm accumulators
//                (AVX-512F) or 12 ymm ones (AVX2 + FMA: what fits in 16 registers beside m),
//                distinct starting values, m read at run time: 2 FLOPs per lane per
//                instruction. At least 1.5 x latency x ports chains on the x86-64 cores of
//                2017-2024 (latency 4, 2 ports).
//   avx512_bf16  vdpbf16ps on 28 zmm accumulators: 32 products of bfloat16 pairs added into 16
//                float lanes, 64 FLOPs per instruction (where the CPU has AVX512-BF16).
//   amx_bf16     tdpbf16ps into 4 accumulator tiles (16 x 16 floats) from 16 x 32 bfloat16
//                tiles: 16384 FLOPs per instruction (where the CPU has AMX-BF16 and Linux grants
//                the tile data).
// Every function carrying these instructions is compiled for its target by a function
// attribute, so the file builds on any x86-64 compiler; the instructions run only where the
// CPU (and, for AMX, the operating system) has them.
#pragma once

#include <poslsh/core/matrix_units.hpp>

namespace poslsh::bench {

/// The arithmetic units whose peak the suite measures.
enum class PeakUnit { fma_f32, avx512_bf16, amx_bf16 };

/// "fma_f32", "avx512_bf16" or "amx_bf16".
const char* peak_unit_name(PeakUnit unit);

/// Whether this CPU (and OS) can run the unit's peak loop.
bool peak_unit_available(PeakUnit unit);

/// The instruction set the fma_f32 loop runs on here: "avx512f", "avx2+fma" or "scalar".
const char* fma_peak_isa();

/// The peak of the unit a kernel's products ran on: float_products -> fma_f32; avx512_bf16 ->
/// avx512_bf16; amx_bf16 and amx_fp16 -> amx_bf16 (the same tile throughput).
PeakUnit peak_unit_for(MatrixUnit unit);

/// The threads a parallel kernel uses (omp_get_max_threads(), 1 without OpenMP).
int all_threads();

/// FLOPs of one run of the unit's loop on one thread (the fixed count).
double peak_flops_per_thread(PeakUnit unit);

/// One run of the unit's loop on `threads` threads started together: `seconds`, the wall time
/// from the common start to the last thread's end, and `cpu_rate`, the sum over the threads of
/// their FLOPs over their own CPU time (CLOCK_THREAD_CPUTIME_ID): the rate of the threads while
/// they ran, which other processes sharing the cores do not lower.
struct PeakRun {
  double seconds = 0.0;
  double cpu_rate = 0.0;
};
/// The unit must be available.
PeakRun time_peak_run(PeakUnit unit, int threads);

/// The unit's peak on `threads` threads: `rate`, FLOP/s over wall time, the best of `runs` runs
/// of time_peak_run, and `cpu_rate`, the best of their cpu_rate. Units that are not available
/// give 0.
struct Peak {
  double rate = 0.0;
  double cpu_rate = 0.0;
};
Peak measure_peak(PeakUnit unit, int threads, int runs = 5);

}  // namespace poslsh::bench
