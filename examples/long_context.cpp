// poslsh long context: multi-head fused LSH ALiBi attention over n = 1048576 tokens
// (H = 8 heads, d = 64, s = 16 samples, causal, ALiBi slopes), with its wall time and peak
// resident memory against the bytes of Q, K, V and the output. --type bf16 holds Q, K, V and
// the output in Eigen::bfloat16 (the float inputs rounded; computed in float, the output
// rounded once): half the bytes, and a tighter budget (1.05x the bytes, no allowance).
//   long_context [--n N] [--samples S] [--type float|bf16]
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

/// Runs the problem with Q, K, V and the output in Storage; returns the exit code.
template <typename Storage>
int run(poslsh::Index n, poslsh::Index samples, const char* type_name, double budget_factor,
        double allowance) {
  const double tensor_bytes = static_cast<double>(n * pb::heads * pb::dim) * sizeof(Storage);
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
#else
  const int threads = 1;
#endif
  std::printf(
      "fused LSH ALiBi attention: n = %lld, H = %ld, d = %ld, s = %lld, %s, causal, "
      "%d threads\n",
      static_cast<long long>(n), static_cast<long>(pb::heads), static_cast<long>(pb::dim),
      static_cast<long long>(samples), type_name, threads);

  auto start = std::chrono::steady_clock::now();
  const pb::TypedTensor<Storage> q(pb::Which::q, n);
  const pb::TypedTensor<Storage> k(pb::Which::k, n);
  const pb::TypedTensor<Storage> v(pb::Which::v, n);
  pb::TypedTensor<Storage> out(pb::Which::out, n);
  std::printf("Q, K, V filled and the output zeroed in %.2f s\n", seconds_since(start));

  poslsh::MultiHeadOptions options;
  options.samples = samples;
  options.seed = pb::seed;
  start = std::chrono::steady_clock::now();
  poslsh::multihead_attention<Storage>(q.view(), k.view(), v.view(), out.view(), options);
  const double wall = seconds_since(start);
  const double peak = peak_rss_bytes();

  // Work done: the pairs with c_ij > 0 of every head, 4 d FLOPs each.
  const std::vector<double> sigmas = poslsh::alibi_sigmas(static_cast<int>(pb::heads));
  const std::vector<poslsh::HashSet> hashes = poslsh::multihead_hashes(sigmas, samples, pb::seed);
  const long long pairs = pb::lsh_pairs(sigmas, samples, n);
  // Check: the last row of each head equals LSH decode of that token (the same estimator;
  // decoded in float, so a bfloat16 output differs by its rounding).
  const auto out_view = std::as_const(out).view();
  double deviation = 0.0;
  for (poslsh::Index h = 0; h < pb::heads; ++h) {
    poslsh::RowMatrix<float> decoded(1, pb::dim);
    poslsh::lsh_attention_decode<Storage, Storage, float>(
        q.view().head(h).bottomRows(1), k.view().head(h), v.view().head(h), n - 1,
        hashes[static_cast<std::size_t>(h)], decoded);
    const poslsh::RowMatrix<float> last = out_view.head(h).bottomRows(1).template cast<float>();
    deviation = std::max(deviation, static_cast<double>((last - decoded).cwiseAbs().maxCoeff()));
  }

  const double budget = budget_factor * 4.0 * tensor_bytes + allowance;
  const double flops = static_cast<double>(pairs) * 4.0 * static_cast<double>(pb::dim);
  std::printf("wall time          %.3f s (%.3f us per token, %.1f GFLOP/s at 4d FLOPs per pair)\n",
              wall, wall / static_cast<double>(n) * 1e6, flops / wall * 1e-9);
  std::printf("keys per query     %.1f (mean over heads; exact causal: %.1f)\n",
              static_cast<double>(pairs) / static_cast<double>(n * pb::heads),
              static_cast<double>(n + 1) / 2.0);
  std::printf("peak RSS           %.1f MiB\n", peak / mib);
  std::printf("Q, K, V, out       %.1f MiB (4 x %.1f MiB, %s)\n", 4.0 * tensor_bytes / mib,
              tensor_bytes / mib, type_name);
  std::printf("peak RSS / bytes   %.4f\n", peak / (4.0 * tensor_bytes));
  std::printf("budget             %.1f MiB = %.2f x bytes + %.0f MiB: %s\n", budget / mib,
              budget_factor, allowance / mib, peak <= budget ? "within" : "EXCEEDED");
  std::printf("last rows vs decode: max |difference| = %.3g\n", deviation);
  return peak <= budget ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  long long n_arg = 1048576;
  long long samples_arg = pb::default_samples;
  bool bf16 = false;
  for (int a = 1; a < argc; ++a) {
    if (read_flag(argc, argv, a, "--n", n_arg) ||
        read_flag(argc, argv, a, "--samples", samples_arg)) {
      continue;
    }
    if (std::strcmp(argv[a], "--type") == 0 && a + 1 < argc &&
        (std::strcmp(argv[a + 1], "float") == 0 || std::strcmp(argv[a + 1], "bf16") == 0)) {
      bf16 = std::strcmp(argv[++a], "bf16") == 0;
      continue;
    }
    std::fprintf(stderr, "usage: long_context [--n N] [--samples S] [--type float|bf16]\n");
    return std::strcmp(argv[a], "--help") == 0 ? 0 : 2;
  }
  const auto n = static_cast<poslsh::Index>(n_arg);
  const auto samples = static_cast<poslsh::Index>(samples_arg);
  if (bf16) return run<Eigen::bfloat16>(n, samples, "bfloat16", 1.05, 0.0);
  return run<float>(n, samples, "float", 1.1, 256.0 * mib);
}
