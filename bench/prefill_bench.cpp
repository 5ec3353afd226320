// poslsh benchmarks: multi-head prefill, <method>/<n>, exact_tiled_every_key/<n> (every head at
// sigma 1e6, so that every causal pair is evaluated), sigma16_<kernel>/<s> and
// lsh_fused_sigma/<sigma> and lsh_fused_bf16_sigma/<sigma> (n = 16384, every head at one sigma of
// the default problem; float, and bfloat16 as <method>_bf16/<n>); the tile
// methods on half-precision tensors, <method>_bf16/<n> and <method>_f16/<n> (Q, K, V and out in
// Eigen::bfloat16 or Eigen::half) and lsh_fused_bf16kv/<n> (float Q and out, bfloat16 K, V).
// The half-precision rows run on the best unit of the CPU (the default precision) and name it
// in their label (unit=amx_bf16, unit=avx512_bf16, unit=amx_fp16, unit=float_products); where
// that is a matrix unit, <method>_bf16_float_products/<n> (<method>_f16_float_products/<n>)
// runs the same call with Precision::float_products, and where it is amx_bf16,
// <method>_bf16_avx512_bf16/<n> runs it with the AMX unit turned off (multihead_attention's body
// on a tile layer that is never available), so one run compares the units side by side.
#include <cmath>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_support.hpp"
#include "poslsh/core/matrix_units.hpp"

namespace poslsh::bench {

namespace {

/// Useful (query, key) pairs of one call, summed over heads: n (n + 1) / 2 per head for the
/// exact methods, the pairs inside the band for banded, the pairs with c_ij > 0 for the LSH
/// methods (one hash per head for fixed blocks).
long long method_pairs(const MultiHeadOptions& options, Index n) {
  const std::vector<double> sigmas =
      options.sigmas.empty() ? alibi_sigmas(static_cast<int>(heads)) : options.sigmas;
  long long pairs = 0;
  switch (options.method) {
    case Method::exact_tiled:
      return heads * causal_pairs(n);
    case Method::exact_banded:
      for (double sigma : sigmas) {
        pairs += banded_pairs(n, band_for_bias_error(sigma, options.band_error));
      }
      return pairs;
    case Method::fixed_blocks:
      for (double sigma : sigmas) {
        pairs += lsh_fused_pair_count(HashSet{fixed_blocks_hash(sigma)}, n, Masking::causal);
      }
      return pairs;
    case Method::lsh_per_sample:
    case Method::lsh_fused:
    case Method::mean_of_outputs:
      return lsh_pairs(sigmas, options.samples, n);
  }
  return pairs;
}

/// One multihead_attention call per iteration on the shared inputs of n tokens.
void run_multihead(benchmark::State& state, Index n, const MultiHeadOptions& options) {
  const auto q = input_view(Which::q, n);
  const auto k = input_view(Which::k, n);
  const auto v = input_view(Which::v, n);
  const auto out = output_view(n);
  const long long pairs = method_pairs(options, n);
  for (auto _ : state) {
    multihead_attention<float>(q, k, v, out, options);
    benchmark::DoNotOptimize(out.data);
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, pairs, n * heads);
}

/// The dense O(n^2) reference (alibi_attention_reference) of every head, heads in parallel:
/// the naive exact attention a user would otherwise write.
void run_naive(benchmark::State& state, Index n, const MultiHeadOptions& options) {
  const auto q = input_view(Which::q, n);
  const auto k = input_view(Which::k, n);
  const auto v = input_view(Which::v, n);
  const auto out = output_view(n);
  const std::vector<double> sigmas = alibi_sigmas(static_cast<int>(heads));
  for (auto _ : state) {
#pragma omp parallel for schedule(dynamic, 1)
    for (long head = 0; head < static_cast<long>(heads); ++head) {
      const auto h = static_cast<Index>(head);
      auto out_h = out.head(h);
      alibi_attention_reference<float>(q.head(h), k.head(h), v.head(h),
                                       sigmas[static_cast<std::size_t>(head)], out_h, options);
    }
    benchmark::DoNotOptimize(out.data);
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, heads * causal_pairs(n), n * heads);
}

/// The CPU's AMX tiles turned off: the tile engine on this layer uses the next unit.
template <typename Half>
struct AmxTilesOff : detail::AmxNativeTiles<Half> {
  static bool available() { return false; }
};

/// One multihead_attention call per iteration with Q, K, V and the output in Half; on a tile
/// layer AmxTiles other than the library's (AmxTilesOff: the AMX unit turned off, so the next
/// unit, avx512_bf16, on a CPU with both), multihead_attention's body on that layer.
template <typename Half, template <typename> class AmxTiles = detail::AmxNativeTiles>
void run_multihead_half(benchmark::State& state, Index n, const MultiHeadOptions& options) {
  constexpr const char* function = "multihead_attention";
  const auto q = half_view<Half>(Which::q, n);
  const auto k = half_view<Half>(Which::k, n);
  const auto v = half_view<Half>(Which::v, n);
  const auto out = half_tensor<Half>(Which::out, n).view();
  const long long pairs = method_pairs(options, n);
  for (auto _ : state) {
    if constexpr (std::is_same_v<AmxTiles<Half>, detail::AmxNativeTiles<Half>>) {
      multihead_attention<Half, Half, Half>(q, k, v, out, options);
    } else {
      detail::one_sequence_forward<float, AmxTiles>(function, q, k, v, out, options, [&] {
        return detail::head_methods(function, q.heads, options);
      });
    }
    benchmark::DoNotOptimize(out.data);
    benchmark::ClobberMemory();
  }
  const MatrixUnit unit = detail::tile_engine_unit<Half, Half, AmxTiles>(options.precision);
  set_kernel_counters(state, pairs, n * heads, PeakOf{peak_unit_for(unit)});
  state.SetLabel(std::string("unit=") + enum_name(unit));
}

/// The same with float queries and output over bfloat16 K and V (a bfloat16 KV cache).
void run_multihead_bf16_kv(benchmark::State& state, Index n, const MultiHeadOptions& options) {
  const auto q = input_view(Which::q, n);
  const auto k = half_view<Eigen::bfloat16>(Which::k, n);
  const auto v = half_view<Eigen::bfloat16>(Which::v, n);
  const auto out = output_view(n);
  const long long pairs = method_pairs(options, n);
  for (auto _ : state) {
    multihead_attention<float, Eigen::bfloat16, float>(q, k, v, out, options);
    benchmark::DoNotOptimize(out.data);
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, pairs, n * heads);
}

/// Rows of more than 0.5 s per call run once; shorter ones repeat for at least 0.5 s.
template <typename Run>
void register_row(const std::string& name, Index n, const MultiHeadOptions& options, Run run) {
  register_timed(name, benchmark::kMillisecond, 0.5, run, n, options);
}

void register_row(const std::string& name, Index n, const MultiHeadOptions& options) {
  register_row(name, n, options, run_multihead);
}

/// A benchmark body: run(state, n, options).
using Run = void (*)(benchmark::State&, Index, const MultiHeadOptions&);

struct MethodRow {
  const char* name;
  Method method;
  Index max_n;
  const char* label;  // for tables and plots
  Run run = run_multihead;
};

}  // namespace

void register_prefill(bool long_runs) {
  // The one list of the prefill methods: bench_report.py reads it from the JSON context
  // ("poslsh_methods": "name=label;..."), in this order.
  const MethodRow rows[] = {
      {"exact_naive", Method::exact_tiled, 4096, "exact naive", run_naive},
      {"exact_tiled", Method::exact_tiled, 32768, "exact tiled"},
      {"banded", Method::exact_banded, 65536, "banded (eps 1e-3)"},
      {"lsh_per_sample", Method::lsh_per_sample, 65536, "LSH per-sample"},
      {"lsh_fused", Method::lsh_fused, 65536, "LSH fused"},
      {"fixed_blocks", Method::fixed_blocks, 65536, "fixed blocks"},
  };
  std::string methods;
  for (const MethodRow& row : rows) {
    methods += std::string(methods.empty() ? "" : ";") + row.name + "=" + row.label;
  }
  benchmark::AddCustomContext("poslsh_methods", methods);
  // The units this CPU has for half-precision products (core/matrix_units.hpp).
  std::string units;
  for (const auto& unit : EnumNames<MatrixUnit>::table) {
    if (matrix_unit_available(unit.value))
      units += std::string(units.empty() ? "" : ",") + unit.name;
  }
  benchmark::AddCustomContext("poslsh_matrix_units", units);
  // Ordered by n, so the rows a target compares (e.g. exact_tiled/16384 and lsh_fused/16384)
  // run close together in time on a shared machine.
  for (Index n = 1024; n <= 65536; n *= 2) {
    for (const MethodRow& row : rows) {
      if (n > row.max_n) continue;
      MultiHeadOptions options;
      options.method = row.method;
      options.samples = default_samples;
      options.seed = seed;
      register_row(std::string(row.name) + "/" + std::to_string(n), n, options, row.run);
      if (row.run != run_multihead) continue;
      if (row.method == Method::exact_tiled && (n == 4096 || n == 16384)) {
        // The exact kernel on every causal pair: heads so flat (sigma 1e6) that no key is dead,
        // the kernel's own throughput (the default slopes drop the keys a head can no longer
        // read, so exact_tiled/<n> evaluates fewer pairs than its counter's n (n + 1) / 2).
        MultiHeadOptions every_key = options;
        every_key.sigmas.assign(static_cast<std::size_t>(heads), 1e6);
        register_row("exact_tiled_every_key/" + std::to_string(n), n, every_key);
      }
      // The half-precision rows of the tile methods right after their float row.
      const std::string suffix = "/" + std::to_string(n);
      if (row.method == Method::exact_tiled || row.method == Method::lsh_fused) {
        register_row(std::string(row.name) + "_bf16" + suffix, n, options,
                     run_multihead_half<Eigen::bfloat16>);
        const MatrixUnit unit = matrix_unit_for<Eigen::bfloat16, Eigen::bfloat16>(options);
        if (unit == MatrixUnit::amx_bf16 && matrix_unit_available(MatrixUnit::avx512_bf16)) {
          register_row(std::string(row.name) + "_bf16_avx512_bf16" + suffix, n, options,
                       run_multihead_half<Eigen::bfloat16, AmxTilesOff>);
        }
        if (unit != MatrixUnit::float_products) {
          MultiHeadOptions widening = options;
          widening.precision = Precision::float_products;
          register_row(std::string(row.name) + "_bf16_float_products" + suffix, n, widening,
                       run_multihead_half<Eigen::bfloat16>);
        }
      }
      if (row.method == Method::lsh_fused) {
        register_row(std::string(row.name) + "_f16" + suffix, n, options,
                     run_multihead_half<Eigen::half>);
        if (matrix_unit_for<Eigen::half, Eigen::half>(options) != MatrixUnit::float_products) {
          MultiHeadOptions widening = options;
          widening.precision = Precision::float_products;
          register_row(std::string(row.name) + "_f16_float_products" + suffix, n, widening,
                       run_multihead_half<Eigen::half>);
        }
        register_row(std::string(row.name) + "_bf16kv" + suffix, n, options, run_multihead_bf16_kv);
      }
    }
  }
  if (long_runs) {
    MultiHeadOptions options;
    options.samples = default_samples;
    options.seed = seed;
    // The exact kernel at 65536 (about 16 times its 16384 row), with the default slopes and on
    // every causal pair (for its ratio to sgemm there).
    MultiHeadOptions exact = options;
    exact.method = Method::exact_tiled;
    register_row("exact_tiled/65536", 65536, exact);
    exact.sigmas.assign(static_cast<std::size_t>(heads), 1e6);
    register_row("exact_tiled_every_key/65536", 65536, exact);
    for (Index n : {Index{262144}, Index{1048576}}) {
      register_row("lsh_fused/" + std::to_string(n), n, options);
    }
  }
}

void register_sigma16() {
  const Index n = 16384;
  // Per-sample and fused at the same s run one after the other.
  for (Index s : {1, 4, 16, 64, 100}) {
    for (const auto& [prefix, method] : {std::pair{"sigma16_per_sample/", Method::lsh_per_sample},
                                         std::pair{"sigma16_fused/", Method::lsh_fused}}) {
      MultiHeadOptions options;
      options.method = method;
      options.sigmas.assign(static_cast<std::size_t>(heads), 16.0);
      options.samples = s;
      options.seed = seed;
      register_row(prefix + std::to_string(s), n, options);
    }
  }
}

void register_by_sigma() {
  const Index n = 16384;
  // One head of the default problem at a time: every head at the sigma of head h, 2^(h + 1).
  for (int h = 0; h < 8; ++h) {
    const double sigma = std::ldexp(1.0, h + 1);
    MultiHeadOptions options;
    options.method = Method::lsh_fused;
    options.sigmas.assign(static_cast<std::size_t>(heads), sigma);
    options.samples = default_samples;
    options.seed = seed;
    register_row("lsh_fused_sigma/" + std::to_string(static_cast<int>(sigma)), n, options);
    register_row("lsh_fused_bf16_sigma/" + std::to_string(static_cast<int>(sigma)), n, options,
                 run_multihead_half<Eigen::bfloat16>);
  }
}

}  // namespace poslsh::bench
