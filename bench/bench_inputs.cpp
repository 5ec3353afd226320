// poslsh benchmarks: the shared input tensors, created once per (tensor, n).
#include <sys/mman.h>

#include <algorithm>
#include <map>
#include <new>
#include <utility>

#include "bench_support.hpp"

namespace poslsh::bench {

Tensor::Tensor(std::size_t size) : size_(size) {
  constexpr std::size_t huge_page = std::size_t{2} << 20;
  const std::size_t bytes = (size * sizeof(float) + huge_page - 1) / huge_page * huge_page;
  data_.reset(static_cast<float*>(std::aligned_alloc(huge_page, std::max(bytes, huge_page))));
  if (!data_) throw std::bad_alloc();
  madvise(data_.get(), bytes, MADV_HUGEPAGE);  // advice only: failure changes nothing
}

namespace {

/// Element `index` of tensor `which`: splitmix64 of (which, index), its top 24 bits mapped to
/// [-1, 1). Counter-based, so the parallel fill is deterministic.
float input_value(Which which, std::uint64_t index) {
  std::uint64_t z = (static_cast<std::uint64_t>(which) << 56) ^ index;
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1.0p-23f - 1.0f;
}

Tensor make_tensor(Which which, Index n) {
  const auto size = static_cast<long>(n * heads * dim);
  Tensor tensor(static_cast<std::size_t>(size));
  float* data = tensor.data();
#pragma omp parallel for schedule(static)
  for (long index = 0; index < size; ++index) {
    data[index] =
        which == Which::out ? 0.0f : input_value(which, static_cast<std::uint64_t>(index));
  }
  return tensor;
}

Tensor& stored(Which which, Index n) {
  static std::map<std::pair<Which, Index>, std::unique_ptr<Tensor>> store;
  std::unique_ptr<Tensor>& slot = store[{which, n}];
  if (!slot) slot = std::make_unique<Tensor>(make_tensor(which, n));
  return *slot;
}

}  // namespace

const Tensor& tensor(Which which, Index n) { return stored(which, n); }

Tensor& output(Index n) { return stored(Which::out, n); }

}  // namespace poslsh::bench
