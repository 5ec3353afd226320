// poslsh Python bindings: the per-sample, fixed-blocks and decode kernels on half-precision
// arrays (float16 ndarrays, poslsh.BFloat16Bits).
#include "half.hpp"
#include "poslsh/attention/decode.hpp"
#include "poslsh/attention/per_sample.hpp"

namespace poslsh_python {

namespace {

const HalfNames decode_names{"query", "keys", "values"};

}  // namespace

py::object half_lsh_attention_per_sample(py::handle q, py::handle k, py::handle v,
                                         const poslsh::HashSet& hashes,
                                         const poslsh::AttentionOptions& options, py::handle out,
                                         std::optional<int> threads) {
  return half_qkv_call("lsh_attention_per_sample", q, k, v, out, threads,
                       [&](auto q_tag, auto kv_tag, auto out_tag, const auto& qm, const auto& km,
                           const auto& vm, auto& om) {
                         using Q = typename decltype(q_tag)::type;
                         using KV = typename decltype(kv_tag)::type;
                         using Out = typename decltype(out_tag)::type;
                         poslsh::lsh_attention_per_sample<Q, KV, Out>(qm, km, vm, hashes, om,
                                                                      options);
                       });
}

py::object half_fixed_blocks_attention(py::handle q, py::handle k, py::handle v, double sigma,
                                       const poslsh::AttentionOptions& options, py::handle out,
                                       std::optional<int> threads) {
  return half_qkv_call("fixed_blocks_attention", q, k, v, out, threads,
                       [&](auto q_tag, auto kv_tag, auto out_tag, const auto& qm, const auto& km,
                           const auto& vm, auto& om) {
                         using Q = typename decltype(q_tag)::type;
                         using KV = typename decltype(kv_tag)::type;
                         using Out = typename decltype(out_tag)::type;
                         poslsh::fixed_blocks_attention<Q, KV, Out>(qm, km, vm, sigma, om, options);
                       });
}

py::object half_lsh_attention_decode(py::handle query, py::handle keys, py::handle values, Index t,
                                     const poslsh::HashSet& hashes,
                                     const poslsh::AttentionOptions& options, py::handle out) {
  return half_qkv_call(
      "lsh_attention_decode", query, keys, values, out, std::nullopt,
      [&](auto q_tag, auto kv_tag, auto out_tag, const auto& qm, const auto& km, const auto& vm,
          auto& om) {
        using Q = typename decltype(q_tag)::type;
        using KV = typename decltype(kv_tag)::type;
        using Out = typename decltype(out_tag)::type;
        poslsh::lsh_attention_decode<Q, KV, Out>(qm, km, vm, t, hashes, om, options);
      },
      decode_names);
}

py::object half_alibi_attention_decode_exact(py::handle query, py::handle keys, py::handle values,
                                             Index t, double sigma,
                                             const poslsh::AttentionOptions& options,
                                             py::handle out) {
  return half_qkv_call(
      "alibi_attention_decode_exact", query, keys, values, out, std::nullopt,
      [&](auto q_tag, auto kv_tag, auto out_tag, const auto& qm, const auto& km, const auto& vm,
          auto& om) {
        using Q = typename decltype(q_tag)::type;
        using KV = typename decltype(kv_tag)::type;
        using Out = typename decltype(out_tag)::type;
        poslsh::alibi_attention_decode_exact<Q, KV, Out>(qm, km, vm, t, sigma, om, options);
      },
      decode_names);
}

}  // namespace poslsh_python
