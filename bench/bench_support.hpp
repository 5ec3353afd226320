// poslsh benchmarks: the default problem, shared inputs and the counters of every kernel row.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <poslsh/poslsh.hpp>
#include <vector>

namespace poslsh::bench {

/// The default problem of the suite: float, H = 8 heads, d = 64, causal, ALiBi slopes
/// 2^-1 .. 2^-8 (sigma = 2 .. 256), s = 16 samples, a fixed seed.
inline constexpr Index heads = 8;
inline constexpr Index dim = 64;
inline constexpr Index default_samples = 16;
inline constexpr std::uint64_t seed = 2024;

/// FLOPs per (query, key) pair: q.k (2d) and the weighted sum of v (2d).
inline constexpr double flops_per_pair = 4.0 * static_cast<double>(dim);

/// One [n, H, d] float tensor (token-major, as a KV cache), on 2 MiB-aligned memory advised
/// for transparent huge pages: first-touch page faults are most of the cost of filling GiBs.
class Tensor {
 public:
  explicit Tensor(std::size_t size);
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  std::size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(float* pointer) const { std::free(pointer); }
  };
  std::unique_ptr<float, Free> data_;
  std::size_t size_;
};

/// The tensors of the suite. Tensor `which` of n tokens is created (and filled) once, outside
/// any timed loop, and shared by every benchmark that uses it; element (i, h, c) depends only on
/// (which, i, h, c), so a shorter tensor is a prefix of a longer one.
enum class Which { q, k, v, out };

/// The tensor `which` of n tokens: q, k, v uniform in [-1, 1) from a counter hash; out zeros
/// (touched, so no page faults inside timed loops).
const Tensor& tensor(Which which, Index n);
Tensor& output(Index n);

/// Views of the tensors of n tokens as HeadsView's ([n, H, d], interleaved heads).
inline HeadsView<const float> input_view(Which which, Index n) {
  return interleaved_heads<const float>(tensor(which, n).data(), n, heads, dim);
}
inline HeadsView<float> output_view(Index n) {
  return interleaved_heads<float>(output(n).data(), n, heads, dim);
}

/// Causal exact pairs of one head: n (n + 1) / 2.
inline long long causal_pairs(Index n) { return static_cast<long long>(n) * (n + 1) / 2; }

/// Causal pairs inside the band i - j <= W: sum_i (min(i, W) + 1).
inline long long banded_pairs(Index n, Index band) {
  if (band >= n - 1) return causal_pairs(n);
  const auto w = static_cast<long long>(band);
  return (w + 1) * (w + 2) / 2 + (static_cast<long long>(n) - 1 - w) * (w + 1);
}

/// Pairs with c_ij > 0 summed over heads, for the hash sets of multihead_attention (the pairs
/// the LSH estimator weights; the same count for the per-sample and the fused kernel).
inline long long lsh_pairs(const std::vector<double>& sigmas, Index samples, Index n) {
  long long pairs = 0;
  for (const HashSet& hashes : multihead_hashes(sigmas, samples, seed)) {
    pairs += lsh_fused_pair_count(hashes, n, Masking::causal);
  }
  return pairs;
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
/// bench_report.awk recomputes them from the time.
inline benchmark::internal::Benchmark* with_min_statistic(benchmark::internal::Benchmark* b) {
  return b->ComputeStatistics("min", [](const std::vector<double>& values) {
    return values.empty() ? 0.0 : *std::min_element(values.begin(), values.end());
  });
}

/// Registration of the families, in the order they run.
void register_sgemm();
void register_prefill(bool long_runs);
void register_sigma16();
void register_decode();

}  // namespace poslsh::bench
