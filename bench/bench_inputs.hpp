// poslsh benchmarks and examples/long_context: the default problem and its [n, H, d] float
// tensors. Only the library and the C++ standard library (no Google Benchmark), so that
// examples/long_context.cpp includes it too.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <poslsh/poslsh.hpp>
#include <vector>

namespace poslsh::bench {

/// The default problem: float, H = 8 heads, d = 64, causal, ALiBi slopes 2^-1 .. 2^-8
/// (sigma = 2 .. 256), s = 16 samples, a fixed seed.
inline constexpr Index heads = 8;
inline constexpr Index dim = 64;
inline constexpr Index default_samples = 16;
inline constexpr std::uint64_t seed = 2024;

/// The tensors of a problem: inputs q, k, v and the output.
enum class Which { q, k, v, out };

/// Element `index` of input tensor `which`: splitmix64 of (which, index), its top 24 bits
/// mapped to [-1, 1). Counter-based: the same for any thread count, and a shorter tensor is a
/// prefix of a longer one.
inline float input_value(Which which, std::uint64_t index) {
  std::uint64_t z = (static_cast<std::uint64_t>(which) << 56) ^ index;
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1.0p-23f - 1.0f;
}

/// One [n, H, d] float tensor (token-major, as a KV cache), filled in parallel when created:
/// input_value for q, k, v; zeros for the output (touched, so that its page faults are not
/// timed with a kernel). On 2 MiB-aligned memory advised for transparent huge pages:
/// first-touch page faults are most of the cost of filling GiBs.
class Tensor {
 public:
  Tensor(Which which, Index tokens) : tokens_(tokens) {
    constexpr std::size_t huge_page = std::size_t{2} << 20;
    const auto size = static_cast<long>(tokens * heads * dim);
    const std::size_t bytes =
        (static_cast<std::size_t>(size) * sizeof(float) + huge_page - 1) / huge_page * huge_page;
    data_.reset(static_cast<float*>(std::aligned_alloc(huge_page, std::max(bytes, huge_page))));
    if (!data_) throw std::bad_alloc();
    madvise(data_.get(), bytes, MADV_HUGEPAGE);  // advice only: failure changes nothing
    float* values = data_.get();
#pragma omp parallel for schedule(static)
    for (long index = 0; index < size; ++index) {
      values[index] =
          which == Which::out ? 0.0f : input_value(which, static_cast<std::uint64_t>(index));
    }
  }

  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  Index tokens() const { return tokens_; }

  /// The tensor as H heads of (n x d) rows ([n, H, d], interleaved heads).
  HeadsView<const float> view() const {
    return interleaved_heads<const float>(data(), tokens_, heads, dim);
  }
  HeadsView<float> view() { return interleaved_heads<float>(data(), tokens_, heads, dim); }

 private:
  struct Free {
    void operator()(float* pointer) const { std::free(pointer); }
  };
  std::unique_ptr<float, Free> data_;
  Index tokens_;
};

/// Pairs with c_ij > 0 summed over heads, for the hash sets of multihead_attention (the pairs
/// the LSH estimator weights; the same count for the per-sample and the fused kernel).
inline long long lsh_pairs(const std::vector<double>& sigmas, Index samples, Index n) {
  long long pairs = 0;
  for (const HashSet& hashes : multihead_hashes(sigmas, samples, seed)) {
    pairs += lsh_fused_pair_count(hashes, n, Masking::causal);
  }
  return pairs;
}

}  // namespace poslsh::bench
