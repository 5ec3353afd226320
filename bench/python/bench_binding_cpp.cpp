// The C++ side of bench/python/bench_binding.py: the same multihead_attention call (fused LSH,
// float, [n, H, d] buffers, ALiBi sigmas, s = 16, seed 2024, causal), timed as the minimum of
// `repeats` calls on buffers allocated once. Prints "cpp_ms <min> <median>".
// Usage: poslsh_bench_binding_cpp [n=4096] [heads=8] [d=64] [repeats=30]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <poslsh/multihead/attention.hpp>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  const auto arg = [&](int index, long fallback) {
    return argc > index ? std::strtol(argv[index], nullptr, 10) : fallback;
  };
  const poslsh::Index n = arg(1, 4096), heads = arg(2, 8), d = arg(3, 64);
  const long repeats = arg(4, 30);
  std::mt19937_64 generator(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const auto size = static_cast<std::size_t>(n * heads * d);
  std::vector<float> q(size), k(size), v(size), out(size);
  for (auto* buffer : {&q, &k, &v}) {
    for (float& x : *buffer) x = uniform(generator);
  }
  poslsh::MultiHeadOptions options;
  options.samples = 16;
  options.seed = 2024;
  const auto q_view = poslsh::interleaved_heads<const float>(q.data(), n, heads, d);
  const auto k_view = poslsh::interleaved_heads<const float>(k.data(), n, heads, d);
  const auto v_view = poslsh::interleaved_heads<const float>(v.data(), n, heads, d);
  const auto out_view = poslsh::interleaved_heads<float>(out.data(), n, heads, d);
  std::vector<double> times;
  for (long r = 0; r <= repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    poslsh::multihead_attention<float>(q_view, k_view, v_view, out_view, options);
    const std::chrono::duration<double, std::milli> elapsed =
        std::chrono::steady_clock::now() - start;
    if (r > 0) times.push_back(elapsed.count());  // the first call warms up
  }
  std::sort(times.begin(), times.end());
  std::printf("cpp_ms %.4f %.4f (checksum %g)\n", times.front(), times[times.size() / 2],
              static_cast<double>(out[static_cast<std::size_t>(n / 2)]));
  return 0;
}
