// poslsh benchmarks: shared inputs (bench_inputs.hpp: the default problem and its tensors)
// and the counters of every kernel row.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <map>
#include <memory>
#include <poslsh/poslsh.hpp>
#include <string>
#include <utility>
#include <vector>

#include "bench_inputs.hpp"
#include "peak.hpp"

namespace poslsh::bench {

/// FLOPs per (query, key) pair: q.k (2d) and the weighted sum of v (2d).
inline constexpr double flops_per_pair = 4.0 * static_cast<double>(dim);

/// The tensors of the suite (bench_inputs.hpp). Tensor `which` of n tokens is created (and
/// filled) once, outside any timed loop, and shared by every benchmark that uses it.
const Tensor& tensor(Which which, Index n);
Tensor& output(Index n);

/// Views of the tensors of n tokens as HeadsView's ([n, H, d], interleaved heads).
inline HeadsView<const float> input_view(Which which, Index n) { return tensor(which, n).view(); }
inline HeadsView<float> output_view(Index n) { return output(n).view(); }

/// Tensor `which` of n tokens rounded to Half ([n, H, d]), made once outside the timed loops
/// (the tensors of one n at a time).
template <typename Half>
TypedTensor<Half>& half_tensor(Which which, Index n) {
  static std::map<std::pair<int, Index>, std::unique_ptr<TypedTensor<Half>>> cache;
  const std::pair<int, Index> key{static_cast<int>(which), n};
  auto found = cache.find(key);
  if (found == cache.end()) {
    for (auto it = cache.begin(); it != cache.end();)
      it = it->first.second != n ? cache.erase(it) : ++it;
    found = cache.emplace(key, std::make_unique<TypedTensor<Half>>(which, n)).first;
  }
  return *found->second;
}

/// half_tensor as H heads of (n x d) rows ([n, H, d], interleaved heads).
template <typename Half>
HeadsView<const Half> half_view(Which which, Index n) {
  return std::as_const(half_tensor<Half>(which, n)).view();
}
/// Causal exact pairs of one head: n (n + 1) / 2.
inline long long causal_pairs(Index n) { return static_cast<long long>(n) * (n + 1) / 2; }

/// Causal pairs inside the band i - j <= W: sum_i (min(i, W) + 1).
inline long long banded_pairs(Index n, Index band) {
  if (band >= n - 1) return causal_pairs(n);
  const auto w = static_cast<long long>(band);
  return (w + 1) * (w + 2) / 2 + (static_cast<long long>(n) - 1 - w) * (w + 1);
}

/// The peak a kernel row is compared with: the unit its products ran on, the FLOPs per pair
/// counted against that peak (4 d forward; the backward's 10 d: its five d-long products per
/// pair) and the threads it ran on (0: all_threads()).
struct PeakOf {
  PeakUnit unit = PeakUnit::fma_f32;
  double flops_per_pair = bench::flops_per_pair;
  int threads = 0;
};

/// The row's peak counters, its unit's peak measured right after its timed loop on its threads
/// (measure_peak, best of 5 runs), so that the row and its peak see the same machine state:
/// peak_GFLOPs (the peak over wall time, GFLOP/s; a plain value), peak_share (the row's FLOP
/// rate over that peak, `flops` FLOPs per iteration; computed by Google Benchmark as a rate over
/// the row's real time, reported as a plain number by ShortNameReporter), peak_cpu_GFLOPs (the
/// peak over the threads' own CPU time, which other processes on the cores do not lower) and
/// row_GFLOP (the FLOPs of one iteration counted against the peak, GFLOP; bench_report.py
/// divides them by the row's CPU time for its share of peak_cpu_GFLOPs), row_threads and
/// peak_unit (the PeakUnit measured: 0 fma_f32, 1 avx512_bf16, 2 amx_bf16).
inline void set_peak_counters(benchmark::State& state, double flops, const PeakOf& peak) {
  PeakUnit unit = peak_unit_available(peak.unit) ? peak.unit : PeakUnit::fma_f32;
  const int threads = peak.threads > 0 ? peak.threads : all_threads();
  const Peak measured = measure_peak(unit, threads);
  state.counters["peak_GFLOPs"] = benchmark::Counter(measured.rate * 1e-9);
  state.counters["peak_cpu_GFLOPs"] = benchmark::Counter(measured.cpu_rate * 1e-9);
  state.counters["peak_share"] =
      benchmark::Counter(flops / measured.rate, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["row_GFLOP"] = benchmark::Counter(flops * 1e-9);
  state.counters["row_threads"] = threads;
  state.counters["peak_unit"] = static_cast<double>(unit);
}

/// The counters of a kernel row, for `pairs` (query, key) pairs per iteration over `queries`
/// query rows (all heads): pairs/s, GFLOP/s at 4 d FLOPs per pair (both rates over real
/// time), the mean keys per query row, and the share of the peak `peak` (set_peak_counters,
/// at peak.flops_per_pair FLOPs a pair).
inline void set_kernel_counters(benchmark::State& state, long long pairs, long long queries,
                                const PeakOf& peak = {}) {
  const auto p = static_cast<double>(pairs);
  state.counters["pairs"] = benchmark::Counter(p, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP"] =
      benchmark::Counter(p * flops_per_pair * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["keys_per_query"] = benchmark::Counter(p / static_cast<double>(queries));
  set_peak_counters(state, p * peak.flops_per_pair, peak);
}

/// Adds the "min" aggregate to a benchmark (reported with --benchmark_repetitions=N > 1): on a
/// shared machine the fastest repetition is the one least disturbed by other processes. Its
/// rate counters are the smallest rates, not those of the fastest repetition;
/// bench_report.py recomputes them from the time. The row's CPU time is the whole process's
/// (all its threads), which bench_report.py compares with the peak over CPU time.
inline benchmark::internal::Benchmark* with_min_statistic(benchmark::internal::Benchmark* b) {
  return b
      ->ComputeStatistics("min",
                          [](const std::vector<double>& values) {
                            return values.empty() ? 0.0
                                                  : *std::min_element(values.begin(), values.end());
                          })
      ->MeasureProcessCPUTime();
}

/// Registers the row `name`, run(state, args...), timed over wall time (UseRealTime) in `unit`
/// with the "min" aggregate (with_min_statistic), repeated for at least `min_seconds` seconds.
/// Returns the benchmark for further settings.
template <typename Run, typename... Args>
benchmark::internal::Benchmark* register_timed(const std::string& name, benchmark::TimeUnit unit,
                                               double min_seconds, Run run, Args... args) {
  return with_min_statistic(benchmark::RegisterBenchmark(name.c_str(), run, args...))
      ->Unit(unit)
      ->UseRealTime()
      ->MinTime(min_seconds);
}

/// Registration of the families, in the order they run.
void register_peaks();
void register_sgemm();
void register_prefill(bool long_runs);
void register_sigma16();
void register_by_sigma();
void register_decode();

}  // namespace poslsh::bench
