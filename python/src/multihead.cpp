// poslsh Python bindings: multihead_attention on [n, H, d] or [H, n, d] arrays, and its
// variable-length form on packed batches (cu_seqlens).
#include "half.hpp"
#include "heads.hpp"

namespace poslsh_python {

namespace {

const char* const multihead_doc = R"doc(
Multi-head (and grouped-query) ALiBi attention, exact or by Positional LSH. For each query head
h (group G = H_q / H_kv, K/V head h // G):

    out_h = method(Q_h, K_{h//G}, V_{h//G}; sigma_h)

layout: 'nhd' (default): q is [m, H_q, d], k [L, H_kv, d], v [L, H_kv, d_v], out
[m, H_q, d_v] (KV-cache order); 'hnd': the same with the first two axes swapped ([H, n, d]).
The layout is never guessed from the shapes. Any strides on the first two axes (e.g. slices of
a packed qkv buffer), last axis contiguous; no copies.
method: 'lsh_fused' (default), 'lsh_per_sample', 'fixed_blocks', 'exact_tiled',
'exact_banded' (band_for_bias_error(sigma_h, band_error)), 'exact_reference'.
masking: 'causal' (default) or 'bidirectional'. scale: tau, None means 1/sqrt(d).
sigmas: one per query head, None means alibi_sigmas(H_q) (sigma_h = 1 / m_h).
samples, seed: LSH head h uses rbf_hashes(sigma_h, samples, seed, stream=h).
query_offset: position p0 of q's first token: the m queries are the tokens p0 .. p0 + m - 1
over the L keys (causal: key j kept for query row r iff j <= p0 + r; bias -|p0 + r - j| /
sigma_h). None (default) means p0 = L - m (bottom-right: the queries are the last tokens; 0
for self-attention). Row r is bitwise row p0 + r of the call on all L tokens (chunked prefill,
multi-token decode); exact_reference takes self-attention only.
out: optional output written in place and returned. num_threads: OpenMP threads for this call.
float32 or float64 (all arrays alike); the GIL is released during the computation.
Half precision (computed in float32, read in place): q, k, v all float16 -> float16 out (or a
float32 out= array), all poslsh.BFloat16Bits -> BFloat16Bits out (or float32 out=), float32 q
over float16 or BFloat16Bits k, v -> float32; a half-precision output is the float32 result
rounded once. float64 never mixes with half precision (TypeError).
)doc";

const char* const varlen_doc = R"doc(
multihead_attention on a packed batch of B sequences of different lengths (FlashAttention's
variable-length convention). Sequence b owns the query tokens [cu_seqlens_q[b],
cu_seqlens_q[b+1]) of q and out and the key tokens [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k
and v (q [total_q, H_q, d], k [total_k, H_kv, d], v [total_k, H_kv, d_v] in layout 'nhd';
[H, total, d] in 'hnd'). cu_seqlens_q, cu_seqlens_k: int32 numpy arrays of B + 1 entries from
0 (non-decreasing, last = the token count). Each sequence has its own positions from 0: its
m_b queries are the tokens p_b .. p_b + m_b - 1 over its L_b keys, with

    out_{b,h} = method(Q_{b,h}, K_{b,h//G}, V_{b,h//G}; sigma_h)  at query offset p_b,

p_b = query_offsets[b] when given (0 <= p_b <= L_b - m_b), else L_b - m_b (bottom-right).
Bitwise equal to multihead_attention on each sequence's slices with query_offset=p_b (the same
sigmas and hashes for every sequence). Empty sequences are allowed. The other keywords as
multihead_attention (half precision included); the GIL is released during the computation.
)doc";

}  // namespace

void bind_multihead(py::module_& module) {
  module.def(
      "multihead_attention",
      [](py::handle q, py::handle k, py::handle v, const std::string& layout_name,
         const std::string& method, const std::string& masking, std::optional<double> scale,
         std::optional<std::vector<double>> sigmas, Index samples, std::uint64_t seed,
         double band_error, std::optional<Index> query_offset, py::handle out,
         std::optional<int> threads) -> py::object {
        constexpr const char* function = "multihead_attention";
        threads = thread_count(threads, function);
        const Layout layout = layout_of(layout_name, function);
        poslsh::MultiHeadOptions options =
            multihead_options(function, method, masking, scale, sigmas, samples, seed, band_error);
        options.query_offset = query_offset;
        if (half_call(q, k)) {
          return half_multihead_attention(q, k, v, layout, options, out, threads);
        }
        const py::array q_array = require_array(q, function, "q");
        return dispatch(q_array, function, "q", [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const auto [q_view, k_view, v_view] = heads_inputs<T>(q_array, k, v, layout, function);
          require_reference_self_attention(function, options, q_view.tokens, k_view.tokens,
                                           query_offset.value_or(k_view.tokens - q_view.tokens));
          py::array result = heads_output<T>(out, layout, q_view.tokens, q_view.heads, v_view.dim,
                                             function, "out", {{q, "q"}, {k, "k"}, {v, "v"}});
          const auto out_view = heads_view<T>(result, layout, function, "out");
          {
            KernelScope scope(threads);
            poslsh::multihead_attention<T>(q_view, k_view, v_view, out_view, options);
          }
          return result;
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(), py::arg("layout") = "nhd",
      py::arg("method") = "lsh_fused", py::arg("masking") = "causal", py::arg("scale") = py::none(),
      py::arg("sigmas") = py::none(), py::arg("samples") = 16, py::arg("seed") = 0,
      py::arg("band_error") = 1e-3, py::arg("query_offset") = py::none(),
      py::arg("out") = py::none(), py::arg("num_threads") = py::none(), multihead_doc);

  module.def(
      "multihead_attention_varlen",
      [](py::handle q, py::handle k, py::handle v, py::handle cu_seqlens_q, py::handle cu_seqlens_k,
         std::optional<std::vector<Index>> query_offsets, const std::string& layout_name,
         const std::string& method, const std::string& masking, std::optional<double> scale,
         std::optional<std::vector<double>> sigmas, Index samples, std::uint64_t seed,
         double band_error, py::handle out, std::optional<int> threads) -> py::object {
        constexpr const char* function = "multihead_attention_varlen";
        threads = thread_count(threads, function);
        const Layout layout = layout_of(layout_name, function);
        const poslsh::MultiHeadOptions options =
            multihead_options(function, method, masking, scale, sigmas, samples, seed, band_error);
        const std::vector<std::int32_t> cu_q = int32_vector(cu_seqlens_q, function, "cu_seqlens_q");
        const std::vector<std::int32_t> cu_k = int32_vector(cu_seqlens_k, function, "cu_seqlens_k");
        const std::vector<Index> offsets = query_offsets.value_or(std::vector<Index>{});
        if (half_call(q, k)) {
          return half_multihead_attention_varlen(q, k, v, layout, options, cu_q, cu_k, offsets, out,
                                                 threads);
        }
        const py::array q_array = require_array(q, function, "q");
        return dispatch(q_array, function, "q", [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const auto [q_view, k_view, v_view] = heads_inputs<T>(q_array, k, v, layout, function);
          py::array result = heads_output<T>(out, layout, q_view.tokens, q_view.heads, v_view.dim,
                                             function, "out", {{q, "q"}, {k, "k"}, {v, "v"}});
          const auto out_view = heads_view<T>(result, layout, function, "out");
          if (cu_q.size() == cu_k.size()) {
            for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
              const Index m = cu_q[b + 1] - cu_q[b], L = cu_k[b + 1] - cu_k[b];
              const Index p0 = b < offsets.size() ? offsets[b] : L - m;
              if (m > 0) require_reference_self_attention(function, options, m, L, p0);
            }
          }
          {
            KernelScope scope(threads);
            poslsh::multihead_attention_varlen<T>(q_view, k_view, v_view, out_view, cu_q, cu_k,
                                                  options, offsets);
          }
          return result;
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
      py::kw_only(), py::arg("query_offsets") = py::none(), py::arg("layout") = "nhd",
      py::arg("method") = "lsh_fused", py::arg("masking") = "causal", py::arg("scale") = py::none(),
      py::arg("sigmas") = py::none(), py::arg("samples") = 16, py::arg("seed") = 0,
      py::arg("band_error") = 1e-3, py::arg("out") = py::none(),
      py::arg("num_threads") = py::none(), varlen_doc);
}

}  // namespace poslsh_python
