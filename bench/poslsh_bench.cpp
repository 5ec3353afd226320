// poslsh_bench: the benchmark suite (Google Benchmark). Rows, in the order they run (the
// families registered at start-up by the other files first):
//   peak/<unit>                 the CPU's measured peaks (peak.hpp): fma_f32, and avx512_bf16,
//                               amx_bf16 where the CPU has them; every kernel row also measures
//                               its unit's peak right after its timed loop and reports its share
//                               of it (set_peak_counters, bench_support.hpp)
//   sgemm                       Eigen SGEMM 2048^3, the machine's practical GFLOP/s
//   <method>/<n>                multi-head prefill, n = 1024 .. 65536 (exact_naive n <= 4096,
//                               exact_tiled n <= 32768); with --long also exact_tiled/65536,
//                               lsh_fused/262144 and lsh_fused/1048576
//   sigma16_<kernel>/<s>        n = 16384, every head sigma = 16, s = 1, 4, 16, 64, 100
//   lsh_fused_sigma/<sigma>     n = 16384, every head at sigma = 2, 4, .., 256 (one head of the
//                               default problem each: 1/8 of a row's time is that head's share)
//   lsh_fused_bf16_sigma/<sigma>  the same in bfloat16 (Q, K, V and out), on the CPU's best unit
//   decode_<kernel>/<t>         one token (8 heads) over a KV cache of t = 4096 .. 1048576
// Default problem: float, H = 8, d = 64, causal, ALiBi slopes, s = 16, all threads.
//   poslsh_bench [--long] [--benchmark_...]   (or POSLSH_BENCH_LONG=1 for --long)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bench_support.hpp"
#include "short_names.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace poslsh::bench {

namespace {

constexpr Index gemm_size = 2048;

void run_sgemm(benchmark::State& state) {
  RowMatrix<float> a(gemm_size, gemm_size);
  RowMatrix<float> b(gemm_size, gemm_size);
  RowMatrix<float> c(gemm_size, gemm_size);
  a.setRandom();
  b.setRandom();
  c.setZero();
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * std::pow(static_cast<double>(gemm_size), 3.0);
  state.counters["GFLOP"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["eigen_threads"] = Eigen::nbThreads();
  set_peak_counters(state, flops, PeakOf{PeakUnit::fma_f32, 0.0, Eigen::nbThreads()});
}

}  // namespace

void register_sgemm() { register_timed("sgemm", benchmark::kMillisecond, 1.0, run_sgemm); }

}  // namespace poslsh::bench

namespace {

void print_help() {
  std::printf(
      "poslsh_bench [--long] [benchmark flags]\n"
      "  --long  also run exact_tiled/65536, lsh_fused/262144 and lsh_fused/1048576 (8 GiB\n"
      "          of inputs);\n"
      "          the same as POSLSH_BENCH_LONG=1\n"
      "  Rows are named <method>/<n>; --benchmark_filter matches the full names, which end in\n"
      "  /min_time:...|/iterations:... and /real_time.\n\n");
  benchmark::PrintDefaultHelp();
}

/// The value of `--name=value` in argv, or an empty string.
std::string flag_value(int argc, char** argv, const char* name) {
  const std::string prefix = std::string("--") + name + "=";
  std::string value;
  for (int a = 1; a < argc; ++a) {
    if (std::strncmp(argv[a], prefix.c_str(), prefix.size()) == 0) value = argv[a] + prefix.size();
  }
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  namespace pb = poslsh::bench;
  const char* long_env = std::getenv("POSLSH_BENCH_LONG");
  bool long_runs = long_env != nullptr && *long_env != '\0' && std::strcmp(long_env, "0") != 0;
  // Drop --long before Google Benchmark sees the arguments.
  int count = 1;
  for (int a = 1; a < argc; ++a) {
    if (std::strcmp(argv[a], "--long") == 0) {
      long_runs = true;
    } else {
      argv[count++] = argv[a];
    }
  }
  argv[count] = nullptr;
  // Read before Initialize, which removes the flags it knows.
  const bool file_output = !flag_value(count, argv, "benchmark_out").empty();
  const std::string file_format = flag_value(count, argv, "benchmark_out_format");
  benchmark::Initialize(&count, argv, print_help);
  if (benchmark::ReportUnrecognizedArguments(count, argv)) return 1;

  benchmark::AddCustomContext("poslsh_version", std::to_string(POSLSH_VERSION_MAJOR) + "." +
                                                    std::to_string(POSLSH_VERSION_MINOR) + "." +
                                                    std::to_string(POSLSH_VERSION_PATCH));
  benchmark::AddCustomContext("poslsh_fma_peak_isa", pb::fma_peak_isa());
  benchmark::AddCustomContext(
      "poslsh_problem",
      "float, H = 8, d = 64, causal, ALiBi sigma 2..256, s = 16, seed " + std::to_string(pb::seed));
#ifdef _OPENMP
  benchmark::AddCustomContext("omp_threads", std::to_string(omp_get_max_threads()));
#else
  benchmark::AddCustomContext("omp_threads", "1 (built without OpenMP)");
#endif
  pb::register_peaks();
  pb::register_sgemm();
  pb::register_prefill(long_runs);
  pb::register_sigma16();
  pb::register_by_sigma();
  pb::register_decode();

  pb::ShortNameReporter display(benchmark::CreateDefaultDisplayReporter());
  // The JSON file gets the short names too; other file formats keep the library's names.
  std::unique_ptr<pb::ShortNameReporter> file;
  if (file_output && (file_format.empty() || file_format == "json")) {
    file = std::make_unique<pb::ShortNameReporter>(std::make_unique<benchmark::JSONReporter>());
  }
  benchmark::RunSpecifiedBenchmarks(&display, file.get());
  benchmark::Shutdown();
  return 0;
}
