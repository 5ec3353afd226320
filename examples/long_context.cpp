// poslsh long context: multi-head fused LSH ALiBi attention over n = 1048576 tokens
// (H = 8 heads, d = 64, s = 16 samples, float, causal, ALiBi slopes), with its wall time and
// peak resident memory against the bytes of Q, K, V and the output.
//   long_context [--n N] [--samples S]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <poslsh/poslsh.hpp>
#include <utility>
#include <vector>

// The benchmark suite's problem and input tensors (the same values as poslsh_bench's rows).
#include "../bench/bench_inputs.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

namespace pb = poslsh::bench;

constexpr double mib = 1024.0 * 1024.0;

/// Peak resident set size of this process (getrusage reports KiB on Linux).
double peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Reads `--name value` at argv[a]; false if argv[a] is not that flag.
bool read_flag(int argc, char** argv, int& a, const char* name, long long& value) {
  if (std::strcmp(argv[a], name) != 0) return false;
  if (a + 1 >= argc) {
    std::fprintf(stderr, "%s needs a value\n", name);
    std::exit(2);
  }
  char* end = nullptr;
  value = std::strtoll(argv[++a], &end, 10);
  if (*end != '\0' || value < 1) {
    std::fprintf(stderr, "%s must be a positive integer, got '%s'\n", name, argv[a]);
    std::exit(2);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  long long n_arg = 1048576;
  long long samples_arg = pb::default_samples;
  for (int a = 1; a < argc; ++a) {
    if (read_flag(argc, argv, a, "--n", n_arg) ||
        read_flag(argc, argv, a, "--samples", samples_arg)) {
      continue;
    }
    std::fprintf(stderr, "usage: long_context [--n N] [--samples S]\n");
    return std::strcmp(argv[a], "--help") == 0 ? 0 : 2;
  }
  const auto n = static_cast<poslsh::Index>(n_arg);
  const auto samples = static_cast<poslsh::Index>(samples_arg);
  const double tensor_bytes = static_cast<double>(n * pb::heads * pb::dim) * sizeof(float);
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
#else
  const int threads = 1;
#endif
  std::printf(
      "fused LSH ALiBi attention: n = %lld, H = %ld, d = %ld, s = %lld, float, causal, "
      "%d threads\n",
      n_arg, static_cast<long>(pb::heads), static_cast<long>(pb::dim), samples_arg, threads);

  auto start = std::chrono::steady_clock::now();
  const pb::Tensor q(pb::Which::q, n);
  const pb::Tensor k(pb::Which::k, n);
  const pb::Tensor v(pb::Which::v, n);
  pb::Tensor out(pb::Which::out, n);
  std::printf("Q, K, V filled and the output zeroed in %.2f s\n", seconds_since(start));

  poslsh::MultiHeadOptions options;
  options.samples = samples;
  options.seed = pb::seed;
  start = std::chrono::steady_clock::now();
  poslsh::multihead_attention<float>(q.view(), k.view(), v.view(), out.view(), options);
  const double wall = seconds_since(start);
  const double peak = peak_rss_bytes();

  // Work done: the pairs with c_ij > 0 of every head, 4 d FLOPs each.
  const std::vector<double> sigmas = poslsh::alibi_sigmas(static_cast<int>(pb::heads));
  const std::vector<poslsh::HashSet> hashes = poslsh::multihead_hashes(sigmas, samples, pb::seed);
  const long long pairs = pb::lsh_pairs(sigmas, samples, n);
  // Check: the last row of each head equals LSH decode of that token (the same estimator).
  const auto out_view = std::as_const(out).view();
  double deviation = 0.0;
  for (poslsh::Index h = 0; h < pb::heads; ++h) {
    poslsh::RowMatrix<float> decoded(1, pb::dim);
    poslsh::lsh_attention_decode<float>(q.view().head(h).bottomRows(1), k.view().head(h),
                                        v.view().head(h), n - 1,
                                        hashes[static_cast<std::size_t>(h)], decoded);
    const auto last = out_view.head(h).bottomRows(1);
    deviation = std::max(deviation, static_cast<double>((last - decoded).cwiseAbs().maxCoeff()));
  }

  const double budget = 1.1 * 4.0 * tensor_bytes + 256.0 * mib;
  const double flops = static_cast<double>(pairs) * 4.0 * static_cast<double>(pb::dim);
  std::printf("wall time          %.3f s (%.3f us per token, %.1f GFLOP/s at 4d FLOPs per pair)\n",
              wall, wall / static_cast<double>(n) * 1e6, flops / wall * 1e-9);
  std::printf("keys per query     %.1f (mean over heads; exact causal: %.1f)\n",
              static_cast<double>(pairs) / static_cast<double>(n * pb::heads),
              static_cast<double>(n + 1) / 2.0);
  std::printf("peak RSS           %.1f MiB\n", peak / mib);
  std::printf("Q, K, V, out       %.1f MiB (4 x %.1f MiB)\n", 4.0 * tensor_bytes / mib,
              tensor_bytes / mib);
  std::printf("peak RSS / bytes   %.4f\n", peak / (4.0 * tensor_bytes));
  std::printf("budget             %.1f MiB = 1.1 x bytes + 256 MiB: %s\n", budget / mib,
              peak <= budget ? "within" : "EXCEEDED");
  std::printf("last rows vs decode: max |difference| = %.3g\n", deviation);
  return peak <= budget ? 0 : 1;
}
