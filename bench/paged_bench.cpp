// poslsh benchmarks: paged KV caches against contiguous ones, on the default problem (float,
// H = 8, d = 64, causal, sigma = alibi_sigmas(8), s = 16) with n = 4096 cached tokens.
//   paged/<method>/<layout>/<m>
// method: lsh_fused (lsh_attention_fused_paged vs lsh_attention_fused, heads in turn, each
// parallel over query tiles) or exact_tiled (alibi_attention_tiled_paged vs
// alibi_attention_tiled, heads in parallel); layout: contiguous (the [n, H, d] tensors) or
// page<P> (the same keys and values in a pool [pages, P, H, d] in shuffled page order,
// FlashAttention's layout); m: the queries, the last m of the n positions (m = n: prefill;
// m = 64: a prefill chunk or multi-token decode at the cache's end). Both layouts give
// bitwise the same output; pairs/s of a page<P> row over the contiguous row of the same
// method and m is the cost of the block table (keys and values are read in place page by page:
// a key tile of 64 is 4 runs of rows at P = 16, one at P = 64 and 256).
//   paged/multihead/<method>/<layout>/<m>
// the all-heads entry: multihead_attention_paged on the page pool (one call, every head) against
// multihead_attention_varlen on the contiguous tensors (contiguous), methods lsh_fused and
// exact_tiled, m = n (prefill) or 1 (one decode token); the same bitwise output.
//   poslsh_bench --benchmark_filter='^paged/'
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <poslsh/attention/paged.hpp>
#include <poslsh/multihead/paged.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

constexpr Index paged_tokens = 4096;

/// Floats in a pool of page size P holding n tokens.
std::size_t pool_size(Index n, Index page_size) {
  return static_cast<std::size_t>((n + page_size - 1) / page_size * page_size * heads * dim);
}

/// Floats on 2 MiB-aligned memory advised for transparent huge pages, as the contiguous
/// tensors (bench_inputs.hpp): with 4 KiB pages, key rows 2 KiB apart would cost a TLB entry
/// every two rows, which is the allocation's cost and not the block table's.
class HugeBuffer {
 public:
  explicit HugeBuffer(std::size_t size) {
    constexpr std::size_t huge_page = std::size_t{2} << 20;
    const std::size_t bytes = (size * sizeof(float) + huge_page - 1) / huge_page * huge_page;
    data_.reset(static_cast<float*>(std::aligned_alloc(huge_page, std::max(bytes, huge_page))));
    if (!data_) throw std::bad_alloc();
    madvise(data_.get(), bytes, MADV_HUGEPAGE);  // advice only
    std::fill_n(data_.get(), size, 0.0f);
  }
  float* data() { return data_.get(); }

 private:
  struct Free {
    void operator()(float* pointer) const { std::free(pointer); }
  };
  std::unique_ptr<float, Free> data_;
};

/// The k and v tensors of n tokens copied into a page pool of page size P (pages shuffled).
struct PagePool {
  HugeBuffer k, v;
  std::vector<std::int32_t> table, lengths;
  PagedKV<float> view;

  PagePool(Index n, Index page_size) : k(pool_size(n, page_size)), v(pool_size(n, page_size)) {
    const Index pages = (n + page_size - 1) / page_size;
    std::vector<std::int32_t> order(static_cast<std::size_t>(pages));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    const Index row = heads * dim;
    table = order;
    const float* k_data = tensor(Which::k, n).data();
    const float* v_data = tensor(Which::v, n).data();
    for (Index j = 0; j < n; ++j) {
      const Index slot = table[static_cast<std::size_t>(j / page_size)] * page_size + j % page_size;
      std::copy_n(k_data + j * row, row, k.data() + slot * row);
      std::copy_n(v_data + j * row, row, v.data() + slot * row);
    }
    lengths = {static_cast<std::int32_t>(n)};
    view = PagedKV<float>{k.data(), v.data(),     pages, page_size, heads,         dim,
                          dim,      table.data(), 1,     pages,     lengths.data()};
  }
};

const PagePool& pool(Index page_size) {
  static std::map<Index, PagePool> pools;
  auto found = pools.find(page_size);
  if (found == pools.end())
    found = pools.emplace(page_size, PagePool(paged_tokens, page_size)).first;
  return found->second;
}

/// Pairs of the last m queries of n: fused from the count structure, exact causal.
long long chunk_pairs(bool fused, Index n, Index m) {
  if (!fused) return heads * (causal_pairs(n) - causal_pairs(n - m));
  long long pairs = 0;
  for (const HashSet& hashes :
       multihead_hashes(alibi_sigmas(static_cast<int>(heads)), default_samples, seed)) {
    pairs += lsh_fused_pair_count(hashes, n, Masking::causal);
    if (n > m) pairs -= lsh_fused_pair_count(hashes, n - m, Masking::causal);
  }
  return pairs;
}

void run_paged(benchmark::State& state, bool fused, Index page_size, Index m) {
  const Index n = paged_tokens;
  const std::vector<double> sigmas = alibi_sigmas(static_cast<int>(heads));
  const std::vector<HashSet> hashes = multihead_hashes(sigmas, default_samples, seed);
  const auto q = input_view(Which::q, n);
  const auto k = input_view(Which::k, n);
  const auto v = input_view(Which::v, n);
  auto out = output_view(n);
  const PagedKV<float>* cache = page_size > 0 ? &pool(page_size).view : nullptr;
  const auto head = [&](Index h) {
    const auto q_h = q.head(h).bottomRows(m);
    auto out_h = out.head(h).bottomRows(m);
    const auto index = static_cast<std::size_t>(h);
    if (fused) {
      if (cache != nullptr)
        lsh_attention_fused_paged<float>(q_h, *cache, 0, h, hashes[index], out_h);
      else
        lsh_attention_fused<float>(q_h, k.head(h), v.head(h), hashes[index], out_h);
    } else {
      if (cache != nullptr)
        alibi_attention_tiled_paged<float>(q_h, *cache, 0, h, sigmas[index], out_h);
      else
        alibi_attention_tiled<float>(q_h, k.head(h), v.head(h), sigmas[index], out_h);
    }
  };
  for (auto _ : state) {
    if (fused) {
      for (Index h = 0; h < heads; ++h) head(h);
    } else {
#pragma omp parallel for schedule(dynamic, 1)
      for (long h = 0; h < static_cast<long>(heads); ++h) head(static_cast<Index>(h));
    }
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, chunk_pairs(fused, n, m), m * heads);
}

/// One all-heads call over the last m of the n cached tokens: multihead_attention_paged on the
/// pool of page size P, or (P = 0) multihead_attention_varlen on the contiguous tensors.
void run_multihead_paged(benchmark::State& state, Method method, Index page_size, Index m) {
  const Index n = paged_tokens;
  const auto q = input_view(Which::q, n);
  const auto k = input_view(Which::k, n);
  const auto v = input_view(Which::v, n);
  auto out = output_view(n);
  MultiHeadOptions options;
  options.method = method;
  options.samples = default_samples;
  options.seed = seed;
  HeadsView<const float> queries = q;
  queries.data += (n - m) * q.row_stride;
  queries.tokens = m;
  HeadsView<float> rows = out;
  rows.tokens = m;
  const std::vector<std::int32_t> cu_q = {0, static_cast<std::int32_t>(m)};
  const std::vector<std::int32_t> cu_k = {0, static_cast<std::int32_t>(n)};
  const PagedKV<float>* cache = page_size > 0 ? &pool(page_size).view : nullptr;
  for (auto _ : state) {
    if (cache != nullptr)
      multihead_attention_paged<float>(queries, *cache, rows, cu_q, options);
    else
      multihead_attention_varlen<float>(queries, k, v, rows, cu_q, cu_k, options);
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, chunk_pairs(method == Method::lsh_fused, n, m), m * heads);
}

/// Registers <prefix><method>/<layout>/<m> for each method, m and page size P, in this order:
/// run(state, method, P, m); layout contiguous for P = 0, page<P> otherwise.
template <typename MethodKey, typename Run>
void register_layouts(const std::string& prefix,
                      std::initializer_list<std::pair<const char*, MethodKey>> methods,
                      std::initializer_list<Index> query_counts,
                      std::initializer_list<Index> page_sizes, Run run) {
  for (const auto& [name, method] : methods) {
    for (Index m : query_counts) {
      for (Index page_size : page_sizes) {
        const std::string layout =
            page_size == 0 ? std::string("contiguous") : "page" + std::to_string(page_size);
        register_timed(prefix + name + "/" + layout + "/" + std::to_string(m),
                       benchmark::kMillisecond, 0.3, run, method, page_size, m);
      }
    }
  }
}

const bool paged_rows_registered = [] {
  register_layouts<Method>(
      "paged/multihead/",
      {std::pair{"lsh_fused", Method::lsh_fused}, std::pair{"exact_tiled", Method::exact_tiled}},
      {paged_tokens, Index{1}}, {Index{0}, Index{16}, Index{256}}, run_multihead_paged);
  register_layouts<bool>("paged/", {std::pair{"lsh_fused", true}, std::pair{"exact_tiled", false}},
                         {paged_tokens, Index{64}}, {Index{0}, Index{16}, Index{64}, Index{256}},
                         run_paged);
  return true;
}();

}  // namespace

}  // namespace poslsh::bench
