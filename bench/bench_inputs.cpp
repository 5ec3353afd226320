// poslsh benchmarks: the shared input tensors, created once per (tensor, n).
#include <map>
#include <memory>
#include <utility>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

Tensor& stored(Which which, Index n) {
  static std::map<std::pair<Which, Index>, std::unique_ptr<Tensor>> store;
  std::unique_ptr<Tensor>& slot = store[{which, n}];
  if (!slot) slot = std::make_unique<Tensor>(which, n);
  return *slot;
}

}  // namespace

const Tensor& tensor(Which which, Index n) { return stored(which, n); }

Tensor& output(Index n) { return stored(Which::out, n); }

}  // namespace poslsh::bench
