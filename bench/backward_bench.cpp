// poslsh benchmarks: multi-head backward passes, <method>_backward/<n> on the default problem
// (float, H = 8, d = 64, causal, sigma = alibi_sigmas(8), s = 16), n = 1024, 4096, 16384.
// One multihead_attention_backward call per iteration from the out and lse of one forward with
// lse (computed before the timed loop); dout is the shared v tensor. Counters as the forward
// rows (pairs of the forward, 4 d FLOPs per pair), so GFLOP/s compare with the forward rows.
#include <poslsh/multihead/training.hpp>
#include <poslsh/training/backward.hpp>
#include <string>
#include <vector>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

void run_backward(benchmark::State& state, Index n, Method method) {
  MultiHeadOptions options;
  options.method = method;
  options.samples = default_samples;
  options.seed = seed;
  const auto q = input_view(Which::q, n);
  const auto k = input_view(Which::k, n);
  const auto v = input_view(Which::v, n);
  const std::size_t size = static_cast<std::size_t>(n * heads * dim);
  std::vector<float> out(size), dq(size), dk(size), dv(size);
  RowMatrix<float> lse(heads, n);
  multihead_attention<float>(q, k, v, interleaved_heads<float>(out.data(), n, heads, dim), lse,
                             options);
  const auto out_view = interleaved_heads<const float>(out.data(), n, heads, dim);
  for (auto _ : state) {
    multihead_attention_backward<float>(q, k, v, out_view, lse, v, /*dq=*/
                                        interleaved_heads<float>(dq.data(), n, heads, dim),
                                        interleaved_heads<float>(dk.data(), n, heads, dim),
                                        interleaved_heads<float>(dv.data(), n, heads, dim),
                                        options);
    benchmark::DoNotOptimize(dq.data());
    benchmark::ClobberMemory();
  }
  const long long pairs =
      method == Method::exact_tiled
          ? heads * causal_pairs(n)
          : lsh_pairs(alibi_sigmas(static_cast<int>(heads)), default_samples, n);
  set_kernel_counters(state, pairs, n * heads);
}

/// Registered at start-up (before the families of poslsh_bench.cpp), ordered by n so that the
/// two methods at one n run close together in time.
const bool registered = [] {
  for (Index n : {Index{1024}, Index{4096}, Index{16384}}) {
    for (const auto& [name, method] : {std::pair{"exact_tiled_backward/", Method::exact_tiled},
                                       std::pair{"lsh_fused_backward/", Method::lsh_fused}}) {
      with_min_statistic(
          benchmark::RegisterBenchmark((name + std::to_string(n)).c_str(), run_backward, n, method))
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MinTime(0.5);
    }
  }
  return true;
}();

}  // namespace

}  // namespace poslsh::bench
