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

/// One [n, H, d] tensor of Element (float, or a half-precision type holding the float values
/// rounded once), token-major as a KV cache, filled in parallel when created: input_value for
/// q, k, v; zeros for the output (touched, so that its page faults are not timed with a
/// kernel). Every tensor lives on 2 MiB-aligned memory advised for transparent huge pages, so
/// rows that compare two storage types compare kernels, not page sizes; first-touch page
/// faults are also most of the cost of filling GiBs.
template <typename Element>
class TypedTensor {
 public:
  TypedTensor(Which which, Index tokens) : tokens_(tokens) {
    constexpr std::size_t huge_page = std::size_t{2} << 20;
    const auto size = static_cast<long>(tokens * heads * dim);
    const std::size_t bytes =
        (static_cast<std::size_t>(size) * sizeof(Element) + huge_page - 1) / huge_page * huge_page;
    data_.reset(static_cast<Element*>(std::aligned_alloc(huge_page, std::max(bytes, huge_page))));
    if (!data_) throw std::bad_alloc();
    madvise(data_.get(), bytes, MADV_HUGEPAGE);  // advice only: failure changes nothing
    Element* values = data_.get();
#pragma omp parallel for schedule(static)
    for (long index = 0; index < size; ++index) {
      values[index] = static_cast<Element>(
          which == Which::out ? 0.0f : input_value(which, static_cast<std::uint64_t>(index)));
    }
  }

  Element* data() { return data_.get(); }
  const Element* data() const { return data_.get(); }
  Index tokens() const { return tokens_; }

  /// The tensor as H heads of (n x d) rows ([n, H, d], interleaved heads).
  HeadsView<const Element> view() const {
    return interleaved_heads<const Element>(data(), tokens_, heads, dim);
  }
  HeadsView<Element> view() { return interleaved_heads<Element>(data(), tokens_, heads, dim); }

 private:
  struct Free {
    void operator()(Element* pointer) const { std::free(pointer); }
  };
  std::unique_ptr<Element, Free> data_;
  Index tokens_;
};

/// The float tensors of the suite.
using Tensor = TypedTensor<float>;

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
