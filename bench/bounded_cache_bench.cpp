// poslsh benchmarks: decode on a bounded KV cache (BoundedKVCache) of one model-shaped layer,
// 32 heads, d = 128, bfloat16 pages of 256 positions, heads planned at a 1% output error for
// n = 1048576 (plan_heads):
//   bounded/<model>/decode/<t>
// one iteration is one decode step at position ~t (append the token, then the attention of its
// query: multihead_attention_bounded); the cache is filled to t by appending chunks first (no
// attention), and grows by one position per iteration. Counters: cache_MiB (the pages held),
// full_MiB (a cache of every key), share = cache / full.
// (MPT: t = 4096 and 65536 only.)
//   bounded/<model>/full_decode/<t>
// the same decode step on a full contiguous cache of t + 1 tokens (multihead_attention with the
// plan): the decoders' speed on the bounded cache against the full cache's (t = 4096, 65536).
// model: bloom (BLOOM-7b1: ALiBi slopes, sigma up to 256) or mpt (MPT-7B-StoryWriter:
// alibi_bias_max = 16, sigma up to 65536). Random inputs: a pool of 4096 random tokens.
//   poslsh_bench --benchmark_filter='^bounded/'
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <memory>
#include <poslsh/cache/bounded_kv_cache.hpp>
#include <poslsh/multihead/planner.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

using bf16 = Eigen::bfloat16;
constexpr Index layer_heads = 32, layer_dim = 128, layer_page = 256, token_pool = 4096;
constexpr Index planned_tokens = 1048576;

std::vector<double> layer_sigmas(bool mpt) {
  if (!mpt) return alibi_sigmas(static_cast<int>(layer_heads));
  std::vector<double> sigmas;
  for (Index h = 1; h <= layer_heads; ++h)
    sigmas.push_back(std::pow(2.0, 16.0 * static_cast<double>(h) / 32.0));
  return sigmas;
}

std::vector<HeadPlan> layer_plans(bool mpt) {
  PlannerOptions options;
  options.head_dim = layer_dim;
  return plan_heads(planned_tokens, layer_sigmas(mpt), Masking::causal, 0.01, options);
}

/// The random token pool (q, k, v rows of 32 x 128 values in bfloat16).
const RowMatrix<bf16>& token_rows(int which) {
  static const std::vector<RowMatrix<bf16>> pools = [] {
    std::mt19937_64 engine(7);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    std::vector<RowMatrix<bf16>> made(3, RowMatrix<bf16>(token_pool, layer_heads * layer_dim));
    for (auto& m : made)
      for (Index i = 0; i < m.size(); ++i) m.data()[i] = bf16(normal(engine));
    return made;
  }();
  return pools[static_cast<std::size_t>(which)];
}

HeadsView<const bf16> pool_rows(int which, Index first, Index count) {
  const RowMatrix<bf16>& m = token_rows(which);
  return interleaved_heads<const bf16>(m.data() + first * m.cols(), count, layer_heads, layer_dim);
}

/// Appends positions up to `end` to the sequence in chunks of at most 4096 (no attention).
void fill(BoundedKVCache<bf16>& cache, Index sequence, Index end) {
  while (cache.length(sequence) < end) {
    const Index t = cache.length(sequence), row = t % token_pool;
    const Index count = std::min({end - t, token_pool - row, Index{4096}});
    cache.append(sequence, t, pool_rows(1, row, count), pool_rows(2, row, count));
  }
}

void run_bounded(benchmark::State& state, bool mpt, Index t) {
  const std::vector<HeadPlan> plans = layer_plans(mpt);
  const std::vector<HeadMethod> heads = planned_heads(plans);
  Index pages = 0;
  for (Index g = 0; g < layer_heads; ++g) {
    const Index last = std::max<Index>(t, 8192);
    pages += (last - kv_head_first_live_key(heads, layer_heads, g, last) + 4096) / layer_page + 4;
  }
  BoundedKVCache<bf16> cache(heads, layer_heads, layer_dim, layer_dim, layer_page, pages);
  const Index sequence = cache.open();
  fill(cache, sequence, t);
  RowMatrix<bf16> out(1, layer_heads * layer_dim);
  for (auto _ : state) {
    const Index p = cache.length(sequence), row = p % token_pool;
    cache.append(sequence, p, pool_rows(1, row, 1), pool_rows(2, row, 1));
    multihead_attention_bounded<bf16, bf16, bf16>(
        pool_rows(0, row, 1), cache, sequence,
        interleaved_heads<bf16>(out.data(), 1, layer_heads, layer_dim));
    benchmark::ClobberMemory();
  }
  const double held = static_cast<double>(cache.bytes_in_use());
  const double full = static_cast<double>(cache.full_cache_bytes(sequence));
  state.counters["cache_MiB"] = held / (1024.0 * 1024.0);
  state.counters["full_MiB"] = full / (1024.0 * 1024.0);
  state.counters["share"] = held / full;
}

void run_full(benchmark::State& state, bool mpt, Index t) {
  const std::vector<HeadPlan> plans = layer_plans(mpt);
  RowMatrix<bf16> k(t + 1, layer_heads * layer_dim), v(t + 1, layer_heads * layer_dim);
  for (Index j = 0; j <= t; ++j) {
    k.row(j) = token_rows(1).row(j % token_pool);
    v.row(j) = token_rows(2).row(j % token_pool);
  }
  RowMatrix<bf16> out(1, layer_heads * layer_dim);
  AttentionOptions options;
  options.query_offset = t;
  for (auto _ : state) {
    multihead_attention<bf16>(
        pool_rows(0, t % token_pool, 1),
        interleaved_heads<const bf16>(k.data(), t + 1, layer_heads, layer_dim),
        interleaved_heads<const bf16>(v.data(), t + 1, layer_heads, layer_dim),
        interleaved_heads<bf16>(out.data(), 1, layer_heads, layer_dim), plans, options);
    benchmark::ClobberMemory();
  }
}

const bool bounded_cache_rows_registered = [] {
  for (const auto& [model, mpt] : {std::pair{"bloom", false}, std::pair{"mpt", true}}) {
    // MPT at t = 1M: 0.4 s a step and 600 MiB (examples/bounded_decode --model mpt).
    for (Index t : {Index{4096}, Index{65536}, planned_tokens}) {
      if (mpt && t == planned_tokens) continue;
      const std::string row = std::string("bounded/") + model + "/decode/" + std::to_string(t);
      register_timed(row, benchmark::kMicrosecond, 0.5, run_bounded, mpt, t);
    }
    for (Index t : {Index{4096}, Index{65536}}) {
      const std::string row = std::string("bounded/") + model + "/full_decode/" + std::to_string(t);
      register_timed(row, benchmark::kMicrosecond, 0.5, run_full, mpt, t);
    }
  }
  return true;
}();

}  // namespace

}  // namespace poslsh::bench
