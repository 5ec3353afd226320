// poslsh benchmarks: the single-head kernels, single_exact_tiled/<n>, single_exact_banded/<n>
// and single_lsh_fused/<n> (head 0 of the shared [n, H, d] inputs, float, d = 64, causal,
// sigma = 256, the largest ALiBi sigma of 8 heads; banded W = band_for_bias_error(sigma, 1e-3);
// fused: rbf_hashes(sigma, 16, seed)), and single_lsh_fused_sigma2/<n> (the fused kernel at the
// smallest sigma, 2), n = 4096 and 16384. One call per iteration; their query tiles run in
// parallel, so running the rows with OMP_NUM_THREADS=1 and =2 measures the kernels' scaling.
#include <string>
#include <tuple>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

constexpr double single_head_sigma = 256.0;

enum class Kernel { tiled, banded, fused };

void run_single_head(benchmark::State& state, Index n, Kernel kernel, double sigma) {
  const auto q = input_view(Which::q, n).head(0);
  const auto k = input_view(Which::k, n).head(0);
  const auto v = input_view(Which::v, n).head(0);
  auto out = output_view(n).head(0);
  const Index band = band_for_bias_error(sigma, 1e-3);
  const HashSet hashes = rbf_hashes(sigma, default_samples, seed);
  for (auto _ : state) {
    switch (kernel) {
      case Kernel::tiled:
        alibi_attention_tiled<float>(q, k, v, sigma, out);
        break;
      case Kernel::banded:
        alibi_attention_banded<float>(q, k, v, sigma, band, out);
        break;
      case Kernel::fused:
        lsh_attention_fused<float>(q, k, v, hashes, out);
        break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const long long pairs = kernel == Kernel::tiled ? causal_pairs(n)
                          : kernel == Kernel::banded
                              ? banded_pairs(n, band)
                              : lsh_fused_pair_count(hashes, n, Masking::causal);
  set_kernel_counters(state, pairs, n);
}

/// Registered at start-up (before the families of poslsh_bench.cpp).
const bool single_head_rows_registered = [] {
  for (Index n : {Index{4096}, Index{16384}}) {
    for (const auto& [name, kernel, sigma] :
         {std::tuple{"single_exact_tiled/", Kernel::tiled, single_head_sigma},
          std::tuple{"single_exact_banded/", Kernel::banded, single_head_sigma},
          std::tuple{"single_lsh_fused/", Kernel::fused, single_head_sigma},
          std::tuple{"single_lsh_fused_sigma2/", Kernel::fused, 2.0}}) {
      register_timed(name + std::to_string(n), benchmark::kMillisecond, 0.5, run_single_head, n,
                     kernel, sigma);
    }
  }
  return true;
}();

}  // namespace

}  // namespace poslsh::bench
