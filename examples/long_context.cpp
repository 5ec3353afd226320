// poslsh long context: multi-head fused LSH ALiBi attention over n = 1048576 tokens
// (H = 8 heads, d = 64, s = 16 samples, float, causal, ALiBi slopes), with its wall time and
// peak resident memory against the bytes of Q, K, V and the output.
//   long_context [--n N] [--samples S]
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <poslsh/poslsh.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr poslsh::Index heads = 8;
constexpr poslsh::Index dim = 64;
constexpr std::uint64_t seed = 2024;
constexpr double mib = 1024.0 * 1024.0;

/// Element `index` of input `stream`: splitmix64 of (stream, index), its top 24 bits mapped to
/// [-1, 1). Cheap, deterministic and the same for any thread count.
float input_value(std::uint64_t stream, std::uint64_t index) {
  std::uint64_t z = (stream << 56) ^ index;
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1.0p-23f - 1.0f;
}

struct Free {
  void operator()(float* pointer) const { std::free(pointer); }
};
using Buffer = std::unique_ptr<float, Free>;

/// An [n, H, d] tensor on 2 MiB-aligned memory advised for transparent huge pages (first-touch
/// page faults are most of the cost of filling GiBs), filled once: input `stream` (0, 1, 2) or
/// zeros (the output, touched here so that its page faults are not timed with the kernel).
Buffer make_tensor(std::uint64_t stream, bool zeros, long size) {
  constexpr std::size_t huge_page = std::size_t{2} << 20;
  const std::size_t bytes =
      (static_cast<std::size_t>(size) * sizeof(float) + huge_page - 1) / huge_page * huge_page;
  Buffer data(static_cast<float*>(std::aligned_alloc(huge_page, std::max(bytes, huge_page))));
  if (!data) throw std::bad_alloc();
  madvise(data.get(), bytes, MADV_HUGEPAGE);  // advice only: failure changes nothing
  float* values = data.get();
#pragma omp parallel for schedule(static)
  for (long index = 0; index < size; ++index) {
    values[index] = zeros ? 0.0f : input_value(stream, static_cast<std::uint64_t>(index));
  }
  return data;
}

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
  long long samples_arg = 16;
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
  const long size = static_cast<long>(n * heads * dim);
  const double tensor_bytes = static_cast<double>(size) * sizeof(float);
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
#else
  const int threads = 1;
#endif
  std::printf(
      "fused LSH ALiBi attention: n = %lld, H = %ld, d = %ld, s = %lld, float, causal, "
      "%d threads\n",
      n_arg, static_cast<long>(heads), static_cast<long>(dim), samples_arg, threads);

  auto start = std::chrono::steady_clock::now();
  const Buffer q = make_tensor(0, false, size);
  const Buffer k = make_tensor(1, false, size);
  const Buffer v = make_tensor(2, false, size);
  const Buffer out = make_tensor(3, true, size);
  std::printf("Q, K, V filled and the output zeroed in %.2f s\n", seconds_since(start));

  poslsh::MultiHeadOptions options;
  options.samples = samples;
  options.seed = seed;
  start = std::chrono::steady_clock::now();
  poslsh::multihead_attention<float>(poslsh::interleaved_heads<const float>(q.get(), n, heads, dim),
                                     poslsh::interleaved_heads<const float>(k.get(), n, heads, dim),
                                     poslsh::interleaved_heads<const float>(v.get(), n, heads, dim),
                                     poslsh::interleaved_heads<float>(out.get(), n, heads, dim),
                                     options);
  const double wall = seconds_since(start);
  const double peak = peak_rss_bytes();

  // Work done: the pairs with c_ij > 0 of every head, 4 d FLOPs each.
  const std::vector<double> sigmas = poslsh::alibi_sigmas(static_cast<int>(heads));
  const std::vector<poslsh::HashSet> hashes = poslsh::multihead_hashes(sigmas, samples, seed);
  long long pairs = 0;
  for (const poslsh::HashSet& head_hashes : hashes) {
    pairs += poslsh::lsh_fused_pair_count(head_hashes, n, poslsh::Masking::causal);
  }
  // Check: the last row of each head equals LSH decode of that token (the same estimator).
  const auto out_view = poslsh::interleaved_heads<const float>(out.get(), n, heads, dim);
  double deviation = 0.0;
  for (poslsh::Index h = 0; h < heads; ++h) {
    const auto q_h = poslsh::interleaved_heads<const float>(q.get(), n, heads, dim).head(h);
    const auto k_h = poslsh::interleaved_heads<const float>(k.get(), n, heads, dim).head(h);
    const auto v_h = poslsh::interleaved_heads<const float>(v.get(), n, heads, dim).head(h);
    poslsh::RowMatrix<float> decoded(1, dim);
    poslsh::lsh_attention_decode<float>(q_h.bottomRows(1), k_h, v_h, n - 1,
                                        hashes[static_cast<std::size_t>(h)], decoded);
    const auto last = out_view.head(h).bottomRows(1);
    deviation = std::max(deviation, static_cast<double>((last - decoded).cwiseAbs().maxCoeff()));
  }

  const double budget = 1.1 * 4.0 * tensor_bytes + 256.0 * mib;
  const double flops = static_cast<double>(pairs) * 4.0 * static_cast<double>(dim);
  std::printf("wall time          %.3f s (%.3f us per token, %.1f GFLOP/s at 4d FLOPs per pair)\n",
              wall, wall / static_cast<double>(n) * 1e6, flops / wall * 1e-9);
  std::printf("keys per query     %.1f (mean over heads; exact causal: %.1f)\n",
              static_cast<double>(pairs) / static_cast<double>(n * heads),
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
