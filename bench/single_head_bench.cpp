// poslsh benchmarks: the single-head exact kernels, single_exact_tiled/<n> and
// single_exact_banded/<n> (head 0 of the shared [n, H, d] inputs, float, d = 64, causal,
// sigma = 256, the largest ALiBi sigma of 8 heads; banded W = band_for_bias_error(sigma, 1e-3)),
// n = 4096 and 16384. One call per iteration; their query tiles run in parallel, so running the
// rows with OMP_NUM_THREADS=1 and =2 measures the kernels' scaling.
#include <string>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

constexpr double single_head_sigma = 256.0;

void run_single_head(benchmark::State& state, Index n, bool banded) {
  const auto q = input_view(Which::q, n).head(0);
  const auto k = input_view(Which::k, n).head(0);
  const auto v = input_view(Which::v, n).head(0);
  auto out = output_view(n).head(0);
  const Index band = band_for_bias_error(single_head_sigma, 1e-3);
  for (auto _ : state) {
    if (banded) {
      alibi_attention_banded<float>(q, k, v, single_head_sigma, band, out);
    } else {
      alibi_attention_tiled<float>(q, k, v, single_head_sigma, out);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, banded ? banded_pairs(n, band) : causal_pairs(n), n);
}

/// Registered at start-up (before the families of poslsh_bench.cpp).
const bool registered = [] {
  for (Index n : {Index{4096}, Index{16384}}) {
    for (const auto& [name, banded] :
         {std::pair{"single_exact_tiled/", false}, std::pair{"single_exact_banded/", true}}) {
      with_min_statistic(benchmark::RegisterBenchmark((name + std::to_string(n)).c_str(),
                                                      run_single_head, n, banded))
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MinTime(0.5);
    }
  }
  return true;
}();

}  // namespace

}  // namespace poslsh::bench
