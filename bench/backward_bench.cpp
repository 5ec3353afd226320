// poslsh benchmarks: multi-head backward passes, <method>_backward/<n> on the default problem
// (float, H = 8, d = 64, causal, sigma = alibi_sigmas(8), s = 16), n = 1024, 4096, 16384, and
// <method>_bf16_backward/16384 with q, k, v, out and dout in Eigen::bfloat16 (the float tensors
// rounded; lse and the gradients in float), next to the forward rows <method>_bf16/<n>, and
// exact_tiled_every_key_backward/16384 (every head at sigma 1e6: the exact backward on every
// causal pair, as exact_tiled_every_key/<n> for the forward; with the default slopes the exact
// backward skips the pairs whose probability is exactly 0).
// One multihead_attention_backward call per iteration from the out and lse of one float forward
// with lse on the float tensors (computed before the timed loop; out rounded for the bfloat16
// rows); dout is the shared v tensor. Counters as the forward rows (pairs of the forward, 4 d
// FLOPs per pair), so GFLOP/s compare with the forward rows; peak_share counts the backward's
// own 10 d FLOPs per pair (five d-long products) against the peak of its products' unit.
#include <poslsh/multihead/training.hpp>
#include <poslsh/training/backward.hpp>
#include <string>
#include <type_traits>
#include <utility>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

/// Input tensor `which` of n tokens stored as Input: the float tensor, or its rounding.
template <typename Input>
HeadsView<const Input> stored_view(Which which, Index n) {
  if constexpr (std::is_same_v<Input, float>) {
    return input_view(which, n);
  } else {
    return half_view<Input>(which, n);
  }
}

template <typename Input>
void run_backward(benchmark::State& state, Index n, Method method, bool every_key) {
  MultiHeadOptions options;
  options.method = method;
  options.samples = default_samples;
  options.seed = seed;
  if (every_key) options.sigmas.assign(static_cast<std::size_t>(heads), 1e6);
  // The output and the gradients on the suite's memory (TypedTensor, zeros when made).
  Tensor out(Which::out, n), dq(Which::out, n), dk(Which::out, n), dv(Which::out, n);
  RowMatrix<float> lse(heads, n);
  multihead_attention_with_lse<float>(input_view(Which::q, n), input_view(Which::k, n),
                                      input_view(Which::v, n), out.view(), lse, options);
  TypedTensor<Input> stored_out(Which::out, n);
  const long size = static_cast<long>(n * heads * dim);
  for (long i = 0; i < size; ++i) stored_out.data()[i] = static_cast<Input>(out.data()[i]);
  const auto q = stored_view<Input>(Which::q, n);
  const auto k = stored_view<Input>(Which::k, n);
  const auto v = stored_view<Input>(Which::v, n);
  const auto out_view = std::as_const(stored_out).view();
  for (auto _ : state) {
    multihead_attention_backward<Input>(q, k, v, out_view, lse, v, /*dq=*/dq.view(), dk.view(),
                                        dv.view(), options);
    benchmark::DoNotOptimize(dq.data());
    benchmark::ClobberMemory();
  }
  const long long pairs =
      method == Method::exact_tiled
          ? heads * causal_pairs(n)
          : lsh_pairs(alibi_sigmas(static_cast<int>(heads)), default_samples, n);
  // The share of the peak at the backward's 10 d FLOPs a pair (five d-long products), on the
  // peak of the unit the products ran on (AVX512-BF16 for bfloat16 inputs where the CPU has
  // it, also where it has AMX).
  const PeakUnit unit = detail::backward_on_bf16_unit<Input>(options.precision)
                            ? PeakUnit::avx512_bf16
                            : PeakUnit::fma_f32;
  set_kernel_counters(state, pairs, n * heads, PeakOf{unit, 10.0 * static_cast<double>(dim)});
}

/// Registered at start-up (before the families of poslsh_bench.cpp), ordered by n so that the
/// two methods at one n run close together in time.
const bool backward_rows_registered = [] {
  for (Index n : {Index{1024}, Index{4096}, Index{16384}}) {
    for (const auto& [name, method] : {std::pair{"exact_tiled", Method::exact_tiled},
                                       std::pair{"lsh_fused", Method::lsh_fused}}) {
      const auto add = [n, method = method](const std::string& row, auto run,
                                            bool every_key = false) {
        register_timed(row + std::to_string(n), benchmark::kMillisecond, 0.5, run, n, method,
                       every_key);
      };
      add(std::string(name) + "_backward/", run_backward<float>);
      if (n == 16384) add(std::string(name) + "_bf16_backward/", run_backward<Eigen::bfloat16>);
      if (n == 16384 && method == Method::exact_tiled)
        add("exact_tiled_every_key_backward/", run_backward<float>, true);
    }
  }
  return true;
}();

}  // namespace

}  // namespace poslsh::bench
