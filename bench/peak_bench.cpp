// poslsh benchmarks: the CPU's measured peaks (peak.hpp), and the rows peak/<unit>, one run of
// the unit's loop on every thread per iteration (GFLOP: the unit's FLOP rate; the min
// aggregate of repetitions is the best run), for the units this CPU has, and
// peak/read_bandwidth (GB: the rate of reading 512 MiB of floats on every thread, the memory
// side of the kernels' roofline).
#include <benchmark/benchmark.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "peak.hpp"

#if POSLSH_X86_UNITS
#include <immintrin.h>

#include <poslsh/detail/tile/amx_kernels.hpp>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include <poslsh/detail/disable_intrinsic_warnings.hpp>

namespace poslsh::bench {

namespace {

// The fixed counts: about 5-10 ms a run on a core of 3-4 GHz.
constexpr long fma_steps = 1L << 18;   // each: fma_lanes_per_step lanes of FMAs
constexpr long bf16_steps = 1L << 18;  // each: 28 vdpbf16ps
constexpr long amx_steps = 1L << 14;   // each: 4 tdpbf16ps
// The float32 FMA loops' accumulator chains: 24 zmm, or 12 ymm run 4 times a step, so that a
// step is 384 lanes of FMAs whichever loop runs it (peak_flops_per_thread).
constexpr int fma_avx512_chains = 24;
constexpr int fma_avx2_chains = 12;
constexpr int fma_avx2_repeats = 4;
constexpr int fma_lanes_per_step = fma_avx512_chains * 16;
static_assert(fma_avx2_repeats * fma_avx2_chains * 8 == fma_lanes_per_step,
              "both loops do the same lanes a step");

/// Read at run time, so the compiler knows neither the multiplier nor the starting values.
volatile float peak_multiplier = 1e-7f;
volatile float peak_start = 0.5f;

#if POSLSH_X86_UNITS

/// fma_avx512_chains chains acc_c <- acc_c * m + acc_c of 16 lanes; returns their sum (kept by
/// the caller).
__attribute__((target("avx512f"), noinline)) float fma_loop_avx512(long steps) {
  const __m512 m = _mm512_set1_ps(peak_multiplier);
  const float s = peak_start;
  __m512 a[fma_avx512_chains];
  for (int c = 0; c < fma_avx512_chains; ++c) a[c] = _mm512_set1_ps(s + static_cast<float>(c));
  for (long i = 0; i < steps; ++i) {
    // Fully unrolled by the compiler (a fixed trip count), the accumulators in registers.
#pragma GCC unroll fma_avx512_chains
    for (int c = 0; c < fma_avx512_chains; ++c) a[c] = _mm512_fmadd_ps(a[c], m, a[c]);
  }
  __m512 sum = a[0];
  for (int c = 1; c < fma_avx512_chains; ++c) sum = _mm512_add_ps(sum, a[c]);
  return _mm512_reduce_add_ps(sum);
}

/// fma_avx2_chains (12) chains of 8 lanes, the step repeated fma_avx2_repeats (4) times: the
/// AVX-512 loop's lanes a step. 12 accumulators and the multiplier fit in the 16 ymm registers
/// (16 chains would not: the compiler keeps two of them in memory, and their stores and reloads
/// bound the loop), and 12 chains are more than latency x ports (4 x 2) on the x86-64 cores of
/// 2017-2024.
__attribute__((target("avx2,fma"), noinline)) float fma_loop_avx2(long steps) {
  const __m256 m = _mm256_set1_ps(peak_multiplier);
  const float s = peak_start;
  __m256 a[fma_avx2_chains];
  for (int c = 0; c < fma_avx2_chains; ++c) a[c] = _mm256_set1_ps(s + static_cast<float>(c));
  for (long i = 0; i < fma_avx2_repeats * steps; ++i) {
#pragma GCC unroll fma_avx2_chains
    for (int c = 0; c < fma_avx2_chains; ++c) a[c] = _mm256_fmadd_ps(a[c], m, a[c]);
  }
  alignas(32) float lanes[8];
  float total = 0.0f;
  for (int c = 0; c < fma_avx2_chains; ++c) {
    _mm256_store_ps(lanes, a[c]);
    for (float lane : lanes) total += lane;
  }
  return total;
}

/// 28 chains acc_i <- acc_i + sum of 32 products of bfloat16 pairs (16 float lanes).
__attribute__((target("avx512f,avx512bf16"), noinline)) float bf16_loop(long steps) {
  const float s = peak_start;
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(s * 1e-3f), _mm512_set1_ps(s * 2e-3f));
  const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(s * 3e-3f), _mm512_set1_ps(s * 4e-3f));
  __m512 a[28];
  for (int c = 0; c < 28; ++c) a[c] = _mm512_set1_ps(s + static_cast<float>(c));
  for (long i = 0; i < steps; ++i) {
    // Fully unrolled by the compiler (a fixed trip count), the accumulators in registers.
#pragma GCC unroll 28
    for (int c = 0; c < 28; ++c) a[c] = _mm512_dpbf16_ps(a[c], x, y);
  }
  __m512 sum = a[0];
  for (int c = 1; c < 28; ++c) sum = _mm512_add_ps(sum, a[c]);
  return _mm512_reduce_add_ps(sum);
}

/// 4 accumulator tiles C_c += A B_b (tdpbf16ps), A and B loaded once from bfloat16 values.
POSLSH_AMX_BF16_TARGET __attribute__((noinline)) float amx_loop(long steps) {
  using Tiles = detail::AmxNativeTiles<Eigen::bfloat16>;
  alignas(64) std::uint16_t operand[detail::amx_rows * 32];
  const std::uint16_t one = detail::amx_round_bf16(peak_start * 1e-3f);
  std::fill(std::begin(operand), std::end(operand), one);
  alignas(64) float c_tile[detail::amx_rows * detail::amx_rows];
  const detail::AmxTileConfig config = detail::amx_tile_config();
  Tiles::configure(config);
  for (int c = 0; c < 4; ++c) Tiles::zero(c);
  Tiles::load(4, operand, detail::amx_row_bytes);
  Tiles::load(5, operand, detail::amx_row_bytes);
  Tiles::load(6, operand, detail::amx_row_bytes);
  for (long i = 0; i < steps; ++i) {
    Tiles::dot(0, 5);
    Tiles::dot(1, 6);
    Tiles::dot(2, 5);
    Tiles::dot(3, 6);
  }
  float total = 0.0f;
  for (int c = 0; c < 4; ++c) {
    Tiles::store(c, c_tile, detail::amx_row_bytes);
    total += c_tile[0];
  }
  Tiles::release();
  return total;
}

#endif  // POSLSH_X86_UNITS

bool has_avx512f() {
#if POSLSH_X86_UNITS
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

bool has_avx2_fma() {
#if POSLSH_X86_UNITS
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

/// A scalar fallback (not a peak of anything vectorised: only so the suite runs everywhere).
__attribute__((noinline)) float fma_loop_scalar(long steps) {
  const float m = peak_multiplier;
  float a[16];
  for (int c = 0; c < 16; ++c) a[c] = peak_start + static_cast<float>(c);
  for (long i = 0; i < steps; ++i) {
    for (float& x : a) x = x * m + x;
  }
  float total = 0.0f;
  for (float x : a) total += x;
  return total;
}

/// One run of the unit's loop on this thread; returns its result (to be kept).
float run_loop(PeakUnit unit) {
#if POSLSH_X86_UNITS
  switch (unit) {
    case PeakUnit::fma_f32:
      if (has_avx512f()) return fma_loop_avx512(fma_steps);
      if (has_avx2_fma()) return fma_loop_avx2(fma_steps);
      return fma_loop_scalar(fma_steps);
    case PeakUnit::avx512_bf16:
      return bf16_loop(bf16_steps);
    case PeakUnit::amx_bf16:
      return amx_loop(amx_steps);
  }
  return 0.0f;
#else
  static_cast<void>(unit);
  return fma_loop_scalar(fma_steps);
#endif
}

volatile float peak_sink = 0.0f;

}  // namespace

const char* peak_unit_name(PeakUnit unit) {
  switch (unit) {
    case PeakUnit::fma_f32:
      return "fma_f32";
    case PeakUnit::avx512_bf16:
      return "avx512_bf16";
    case PeakUnit::amx_bf16:
      return "amx_bf16";
  }
  return "?";
}

bool peak_unit_available(PeakUnit unit) {
  switch (unit) {
    case PeakUnit::fma_f32:
      return true;
    case PeakUnit::avx512_bf16:
      return matrix_unit_available(MatrixUnit::avx512_bf16);
    case PeakUnit::amx_bf16:
      return matrix_unit_available(MatrixUnit::amx_bf16);
  }
  return false;
}

const char* fma_peak_isa() {
  return has_avx512f() ? "avx512f" : has_avx2_fma() ? "avx2+fma" : "scalar";
}

PeakUnit peak_unit_for(MatrixUnit unit) {
  switch (unit) {
    case MatrixUnit::float_products:
      return PeakUnit::fma_f32;
    case MatrixUnit::avx512_bf16:
      return PeakUnit::avx512_bf16;
    case MatrixUnit::amx_bf16:
    case MatrixUnit::amx_fp16:
      return PeakUnit::amx_bf16;
  }
  return PeakUnit::fma_f32;
}

int all_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

double peak_flops_per_thread(PeakUnit unit) {
  switch (unit) {
    case PeakUnit::fma_f32:
      // A vector loop's lanes, or 16 scalar lanes.
      return 2.0 * static_cast<double>(fma_steps) *
             (has_avx512f() || has_avx2_fma() ? fma_lanes_per_step : 16.0);
    case PeakUnit::avx512_bf16:
      return 64.0 * 28.0 * static_cast<double>(bf16_steps);
    case PeakUnit::amx_bf16:
      return 2.0 * 16.0 * 16.0 * 32.0 * 4.0 * static_cast<double>(amx_steps);
  }
  return 0.0;
}

namespace {

/// This thread's CPU time in seconds.
double thread_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

/// One thread's run: its result kept, its FLOPs over its CPU time returned.
double thread_run(PeakUnit unit) {
  const double cpu = thread_cpu_seconds();
  peak_sink = run_loop(unit);
  return peak_flops_per_thread(unit) / (thread_cpu_seconds() - cpu);
}

}  // namespace

PeakRun time_peak_run(PeakUnit unit, int threads) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point start;
  double cpu_rate = 0.0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : cpu_rate)
  {
#pragma omp barrier
#pragma omp master
    start = Clock::now();
#pragma omp barrier
    cpu_rate += thread_run(unit);
  }
#else
  static_cast<void>(threads);
  start = Clock::now();
  cpu_rate = thread_run(unit);
#endif
  return {std::chrono::duration<double>(Clock::now() - start).count(), cpu_rate};
}

Peak measure_peak(PeakUnit unit, int threads, int runs) {
  Peak peak;
  if (!peak_unit_available(unit)) return peak;
  for (int run = 0; run < runs; ++run) {
    const PeakRun one = time_peak_run(unit, threads);
    peak.rate = std::max(peak.rate, peak_flops_per_thread(unit) * threads / one.seconds);
    peak.cpu_rate = std::max(peak.cpu_rate, one.cpu_rate);
  }
  return peak;
}

namespace {

void run_peak(benchmark::State& state, PeakUnit unit) {
  const int threads = all_threads();
  time_peak_run(unit, threads);  // warm-up: clocks up, threads started
  double cpu_rate = 0.0;
  for (auto _ : state) {
    const PeakRun run = time_peak_run(unit, threads);
    state.SetIterationTime(run.seconds);
    cpu_rate = std::max(cpu_rate, run.cpu_rate);
  }
  state.counters["cpu_GFLOPs"] = cpu_rate * 1e-9;
  state.counters["GFLOP"] = benchmark::Counter(peak_flops_per_thread(unit) * threads * 1e-9,
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads_used"] = threads;
  state.SetLabel(std::string("unit=") + peak_unit_name(unit) +
                 (unit == PeakUnit::fma_f32 ? std::string(",isa=") + fma_peak_isa() : ""));
}

/// The memory read rate for the roofline of the kernels: every thread sums its contiguous
/// share of 512 MiB of floats (far larger than the caches; filled before the timed loop, freed
/// after it), GB per second over wall time.
void run_read_bandwidth(benchmark::State& state) {
  constexpr long count = 128L << 20;
  const std::vector<float> data(static_cast<std::size_t>(count), 1.0f);
  for (auto _ : state) {
    float total = 0.0f;
    // simd: the sum may be reordered into vector lanes, so that the loop waits on memory, not
    // on one chain of additions.
#pragma omp parallel for simd schedule(static) reduction(+ : total)
    for (long i = 0; i < count; ++i) total += data[static_cast<std::size_t>(i)];
    benchmark::DoNotOptimize(total);
  }
  state.counters["GB"] = benchmark::Counter(static_cast<double>(count) * sizeof(float) * 1e-9,
                                            benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads_used"] = all_threads();
}

}  // namespace

void register_peaks() {
  for (PeakUnit unit : {PeakUnit::fma_f32, PeakUnit::avx512_bf16, PeakUnit::amx_bf16}) {
    if (!peak_unit_available(unit)) continue;
    with_min_statistic(benchmark::RegisterBenchmark(
                           (std::string("peak/") + peak_unit_name(unit)).c_str(), run_peak, unit))
        ->Unit(benchmark::kMillisecond)
        ->UseManualTime()
        ->Iterations(20);
  }
  with_min_statistic(benchmark::RegisterBenchmark("peak/read_bandwidth", run_read_bandwidth))
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->Iterations(10);
}

}  // namespace poslsh::bench

#include <poslsh/detail/restore_warnings.hpp>
