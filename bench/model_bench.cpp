// poslsh benchmarks: real ALiBi model shapes, model/<name>/<method>/<n>, float, [n, H, d]
// inputs, the model's slopes (alibi_slopes(H, max_bias), sigma_h = 1 / m_h), causal unless
// stated, one multihead_attention call per iteration (all threads):
//   bloom-7b1            H = 32, d = 128                      n = 4096
//   bloom-3b             H = 32, d = 80                       n = 4096
//   mpt-30b              H = 64, d = 112                      n = 4096
//   replit-code-v1.5     H = 24 query heads, 8 KV heads, d = 128   n = 4096
//   refact-1.6b          H = 32 query heads, 1 KV head, d = 64     n = 4096
//   jinabert-v2-base     H = 12, d = 64, bidirectional        n = 8192
//   mpt-7b-storywriter   H = 32, d = 128, max_bias = 16       n = 4096
// method: exact_tiled, exact_banded (band_error 1e-3) or lsh_fused (s = 16); lsh_fused_bf16kv
// is lsh_fused with K and V in Eigen::bfloat16 (a bfloat16 KV cache) and float Q and output.
// Counters: pairs (evaluated pairs per second), GFLOP (4 d FLOPs per evaluated pair per
// second), exact_GFLOP (exact-equivalent throughput: the FLOPs of exact attention, 4 d per
// causal or bidirectional pair of every head, over the time), and the share of the time spent
// on the widest heads (largest sigma): widest_head_share (the widest head alone) and
// widest_quarter_share (the quarter of the heads with the largest sigmas), from one call of the
// single-head kernel per head after the timed loop (heads alone, each with all threads for the
// fused kernel, one thread for the exact ones).
//   poslsh_bench --benchmark_filter='^model/'
#include <algorithm>
#include <chrono>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

struct ModelShape {
  const char* name;
  Index query_heads;
  Index kv_heads;
  Index head_dim;
  double max_bias;
  Masking masking;
  Index tokens;
};

const std::vector<ModelShape>& model_shapes() {
  static const std::vector<ModelShape> shapes = {
      {"bloom-7b1", 32, 32, 128, 8.0, Masking::causal, 4096},
      {"bloom-3b", 32, 32, 80, 8.0, Masking::causal, 4096},
      {"mpt-30b", 64, 64, 112, 8.0, Masking::causal, 4096},
      {"replit-code-v1.5", 24, 8, 128, 8.0, Masking::causal, 4096},
      {"refact-1.6b", 32, 1, 64, 8.0, Masking::causal, 4096},
      {"jinabert-v2-base", 12, 12, 64, 8.0, Masking::bidirectional, 8192},
      {"mpt-7b-storywriter", 32, 32, 128, 16.0, Masking::causal, 4096},
  };
  return shapes;
}

/// The q, k, v and out buffers of a model shape ([n, H, d]), filled by input_value.
struct ModelTensors {
  std::vector<float> q, k, v, out;
  std::vector<Eigen::bfloat16> k_bf16, v_bf16;  // k and v rounded, made on first use
  ModelTensors(const ModelShape& shape) {
    const Index n = shape.tokens, d = shape.head_dim;
    q.resize(static_cast<std::size_t>(n * shape.query_heads * d));
    k.resize(static_cast<std::size_t>(n * shape.kv_heads * d));
    v.resize(k.size());
    out.assign(q.size(), 0.0f);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = input_value(Which::q, i);
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = input_value(Which::k, i);
      v[i] = input_value(Which::v, i);
    }
  }
};

ModelTensors& tensors_of(const ModelShape& shape) {
  static std::map<std::string, ModelTensors> cache;
  auto found = cache.find(shape.name);
  // One model's tensors at a time (mpt-30b's are 0.5 GiB).
  if (found == cache.end()) {
    cache.clear();
    found = cache.emplace(shape.name, ModelTensors(shape)).first;
  }
  return found->second;
}

void run_model(benchmark::State& state, ModelShape shape, Method method, bool bf16_kv) {
  const Index n = shape.tokens, d = shape.head_dim, H = shape.query_heads;
  ModelTensors& t = tensors_of(shape);
  if (bf16_kv && t.k_bf16.empty()) {
    for (const float value : t.k) t.k_bf16.push_back(static_cast<Eigen::bfloat16>(value));
    for (const float value : t.v) t.v_bf16.push_back(static_cast<Eigen::bfloat16>(value));
  }
  using Eigen::bfloat16;
  const auto k_bf16 = interleaved_heads<const bfloat16>(t.k_bf16.data(), n, shape.kv_heads, d);
  const auto v_bf16 = interleaved_heads<const bfloat16>(t.v_bf16.data(), n, shape.kv_heads, d);
  const auto q = interleaved_heads<const float>(t.q.data(), n, H, d);
  const auto k = interleaved_heads<const float>(t.k.data(), n, shape.kv_heads, d);
  const auto v = interleaved_heads<const float>(t.v.data(), n, shape.kv_heads, d);
  const auto out = interleaved_heads<float>(t.out.data(), n, H, d);
  MultiHeadOptions options;
  options.method = method;
  options.masking = shape.masking;
  options.samples = default_samples;
  options.seed = seed;
  options.sigmas = sigmas_from_slopes(alibi_slopes(static_cast<int>(H), shape.max_bias));
  for (auto _ : state) {
    if (bf16_kv)
      multihead_attention<float, bfloat16, float>(q, k_bf16, v_bf16, out, options);
    else
      multihead_attention<float>(q, k, v, out, options);
    benchmark::ClobberMemory();
  }
  const bool causal = shape.masking == Masking::causal;
  const long long exact_pairs =
      causal ? causal_pairs(n) : static_cast<long long>(n) * static_cast<long long>(n);
  long long pairs = 0;
  std::vector<HashSet> hashes;
  if (method == Method::lsh_fused)
    hashes = multihead_hashes(options.sigmas, options.samples, options.seed);
  for (Index h = 0; h < H; ++h) {
    const double sigma = options.sigmas[static_cast<std::size_t>(h)];
    if (method == Method::exact_tiled) {
      pairs += exact_pairs;
    } else if (method == Method::exact_banded) {
      const Index band = band_for_bias_error(sigma, options.band_error);
      // Bidirectional: n pairs at distance 0, 2 (n - k) at each distance k = 1 .. min(W, n-1).
      const auto w = static_cast<long long>(std::min<Index>(band, n - 1));
      const auto tokens = static_cast<long long>(n);
      pairs += causal ? banded_pairs(n, band) : tokens + w * (2 * tokens - w - 1);
    } else {
      pairs += lsh_fused_pair_count(hashes[static_cast<std::size_t>(h)], n, shape.masking);
    }
  }
  const double flops = 4.0 * static_cast<double>(d);
  set_kernel_counters(state, pairs, n * H, PeakOf{PeakUnit::fma_f32, flops});
  state.counters["GFLOP"] = benchmark::Counter(static_cast<double>(pairs) * flops * 1e-9,
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["exact_GFLOP"] =
      benchmark::Counter(static_cast<double>(exact_pairs * H) * flops * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate);
  // Time per head: each head alone through the single-head kernel.
  std::vector<double> seconds(static_cast<std::size_t>(H));
  const Index group = H / shape.kv_heads;
  for (Index h = 0; h < H; ++h) {
    const auto index = static_cast<std::size_t>(h);
    const double sigma = options.sigmas[index];
    AttentionOptions head_options;
    head_options.masking = shape.masking;
    const auto begin = std::chrono::steady_clock::now();
    if (method == Method::lsh_fused && bf16_kv)
      lsh_attention_fused<float, bfloat16, float>(q.head(h), k_bf16.head(h / group),
                                                  v_bf16.head(h / group), hashes[index],
                                                  out.head(h), head_options);
    else if (method == Method::lsh_fused)
      lsh_attention_fused<float>(q.head(h), k.head(h / group), v.head(h / group), hashes[index],
                                 out.head(h), head_options);
    else if (method == Method::exact_banded)
      alibi_attention_banded<float>(q.head(h), k.head(h / group), v.head(h / group), sigma,
                                    band_for_bias_error(sigma, options.band_error), out.head(h),
                                    head_options);
    else
      alibi_attention_tiled<float>(q.head(h), k.head(h / group), v.head(h / group), sigma,
                                   out.head(h), head_options);
    seconds[index] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  }
  // Heads in decreasing sigma.
  std::vector<std::size_t> order(seconds.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return options.sigmas[a] > options.sigmas[b];
  });
  const double total = std::accumulate(seconds.begin(), seconds.end(), 0.0);
  double quarter = 0.0;
  const std::size_t quarter_heads = std::max<std::size_t>(1, order.size() / 4);
  for (std::size_t r = 0; r < quarter_heads; ++r) quarter += seconds[order[r]];
  state.counters["widest_head_share"] = seconds[order[0]] / total;
  state.counters["widest_quarter_share"] = quarter / total;
}

const bool model_rows_registered = [] {
  for (const ModelShape& shape : model_shapes()) {
    struct Row {
      const char* name;
      Method method;
      bool bf16_kv;
    };
    for (const Row& row : {Row{"exact_tiled", Method::exact_tiled, false},
                           Row{"exact_banded", Method::exact_banded, false},
                           Row{"lsh_fused", Method::lsh_fused, false},
                           Row{"lsh_fused_bf16kv", Method::lsh_fused, true}}) {
      const Method method = row.method;
      const std::string name =
          std::string("model/") + shape.name + "/" + row.name + "/" + std::to_string(shape.tokens);
      benchmark::RegisterBenchmark(name.c_str(), run_model, shape, method, row.bf16_kv)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Iterations(method == Method::exact_tiled ? 1 : 3);
    }
  }
  return true;
}();

}  // namespace

}  // namespace poslsh::bench
