// poslsh Python bindings: multihead_attention and multihead_attention_varlen on half-precision
// arrays (float16 ndarrays, poslsh.BFloat16Bits), [n, H, d] or [H, n, d], no copies.
#include "half.hpp"

namespace poslsh_python {

namespace {

/// Maps q, k, v as HeadsViews of their storage, prepares the output (m x H_q x d_v in the
/// layout, storage chosen by dispatch_half), then runs kernel(q, k, v, out), which checks what
/// the library checks inside its parallel loops, then releases the GIL (KernelScope).
template <typename Kernel>
py::object half_heads_call(const char* function, py::handle q, py::handle k, py::handle v,
                           const Layout& layout, py::handle out, Kernel&& kernel) {
  return dispatch_half(
      function, q, k, v, out, HalfNames{}, [&](auto q_tag, auto kv_tag, auto out_tag) {
        using Q = typename decltype(q_tag)::type;
        using KV = typename decltype(kv_tag)::type;
        using Out = typename decltype(out_tag)::type;
        const py::array q_array = storage_array<Q>(q), k_array = storage_array<KV>(k),
                        v_array = storage_array<KV>(v);
        const auto q_view = heads_view<const Q>(q_array, layout, function, "q");
        const auto k_view = heads_view<const KV>(k_array, layout, function, "k");
        const auto v_view = heads_view<const KV>(v_array, layout, function, "v");
        py::object result;
        py::array array;
        if (out.is_none()) {
          std::vector<py::ssize_t> shape(3);
          shape[static_cast<std::size_t>(layout.token_axis)] = q_view.tokens;
          shape[static_cast<std::size_t>(layout.head_axis)] = q_view.heads;
          shape[2] = v_view.dim;
          std::tie(result, array) = new_storage<Out>(shape);
        } else {
          array = checked_out<Out>(out, function, "out",
                                   {{q_array, "q"}, {k_array, "k"}, {v_array, "v"}});
          result = py::reinterpret_borrow<py::object>(out);
        }
        const auto out_view = heads_view<Out>(array, layout, function, "out");
        kernel(q_tag, kv_tag, out_tag, q_view, k_view, v_view, out_view);  // releases the GIL
        return result;
      });
}

}  // namespace

py::object half_multihead_attention(py::handle q, py::handle k, py::handle v, const Layout& layout,
                                    const poslsh::MultiHeadOptions& options, py::handle out,
                                    std::optional<int> threads) {
  constexpr const char* function = "multihead_attention";
  return half_heads_call(function, q, k, v, layout, out,
                         [&](auto q_tag, auto kv_tag, auto out_tag, const auto& q_view,
                             const auto& k_view, const auto& v_view, const auto& out_view) {
                           using Q = typename decltype(q_tag)::type;
                           using KV = typename decltype(kv_tag)::type;
                           using Out = typename decltype(out_tag)::type;
                           require_reference_self_attention(
                               function, options, q_view.tokens, k_view.tokens,
                               options.query_offset.value_or(k_view.tokens - q_view.tokens));
                           KernelScope scope(threads);
                           poslsh::multihead_attention<Q, KV, Out>(q_view, k_view, v_view, out_view,
                                                                   options);
                         });
}

py::object half_multihead_attention_varlen(py::handle q, py::handle k, py::handle v,
                                           const Layout& layout,
                                           const poslsh::MultiHeadOptions& options,
                                           const std::vector<std::int32_t>& cu_seqlens_q,
                                           const std::vector<std::int32_t>& cu_seqlens_k,
                                           const std::vector<Index>& query_offsets, py::handle out,
                                           std::optional<int> threads) {
  constexpr const char* function = "multihead_attention_varlen";
  return half_heads_call(function, q, k, v, layout, out,
                         [&](auto q_tag, auto kv_tag, auto out_tag, const auto& q_view,
                             const auto& k_view, const auto& v_view, const auto& out_view) {
                           using Q = typename decltype(q_tag)::type;
                           using KV = typename decltype(kv_tag)::type;
                           using Out = typename decltype(out_tag)::type;
                           if (cu_seqlens_q.size() == cu_seqlens_k.size()) {
                             for (std::size_t b = 0; b + 1 < cu_seqlens_q.size(); ++b) {
                               const Index m = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
                               const Index L = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
                               const Index p0 = b < query_offsets.size() ? query_offsets[b] : L - m;
                               if (m > 0)
                                 require_reference_self_attention(function, options, m, L, p0);
                             }
                           }
                           KernelScope scope(threads);
                           poslsh::multihead_attention_varlen<Q, KV, Out>(
                               q_view, k_view, v_view, out_view, cu_seqlens_q, cu_seqlens_k,
                               options, query_offsets);
                         });
}

}  // namespace poslsh_python
