// poslsh benchmarks: shared inputs (bench_inputs.hpp: the default problem and its tensors)
// and the counters of every kernel row.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <map>
#include <memory>
#include <poslsh/poslsh.hpp>
#include <utility>
#include <vector>

#include "bench_inputs.hpp"

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

/// The counters of a kernel row, for `pairs` (query, key) pairs per iteration over `queries`
/// query rows (all heads): pairs/s, GFLOP/s at 4 d FLOPs per pair (both rates over real
/// time) and the mean keys per query row.
inline void set_kernel_counters(benchmark::State& state, long long pairs, long long queries) {
  const auto p = static_cast<double>(pairs);
  state.counters["pairs"] = benchmark::Counter(p, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP"] =
      benchmark::Counter(p * flops_per_pair * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["keys_per_query"] = benchmark::Counter(p / static_cast<double>(queries));
}

/// Adds the "min" aggregate to a benchmark (reported with --benchmark_repetitions=N > 1): on a
/// shared machine the fastest repetition is the one least disturbed by other processes. Its
/// rate counters are the smallest rates, not those of the fastest repetition;
/// bench_report.py recomputes them from the time.
inline benchmark::internal::Benchmark* with_min_statistic(benchmark::internal::Benchmark* b) {
  return b->ComputeStatistics("min", [](const std::vector<double>& values) {
    return values.empty() ? 0.0 : *std::min_element(values.begin(), values.end());
  });
}

/// Registration of the families, in the order they run.
void register_sgemm();
void register_prefill(bool long_runs);
void register_sigma16();
void register_by_sigma();
void register_decode();

}  // namespace poslsh::bench
