// poslsh Python bindings: multihead_attention with the log-sum-exp of every head, and its
// gradients (multihead_attention_backward), on [n, H, d] or [H, n, d] arrays, for one sequence
// or a packed batch (cu_seqlens).
#include "heads.hpp"

#if __has_include("poslsh/multihead/training.hpp")
#include "poslsh/multihead/training.hpp"
#define POSLSH_PYTHON_HAS_MULTIHEAD_BACKWARD 1
#endif

namespace poslsh_python {

#ifdef POSLSH_PYTHON_HAS_MULTIHEAD_BACKWARD

namespace {

/// The lse matrix (H_q x n, last axis contiguous, any row stride): a new array, or `object`
/// checked (dtype, 2-D, shape, writable when `output`).
template <typename T>
py::array lse_matrix(py::handle object, Index heads, Index n, const char* function, bool output,
                     std::initializer_list<std::pair<py::handle, const char*>> inputs) {
  if (output && object.is_none()) {
    return py::array_t<T>(
        std::vector<py::ssize_t>{static_cast<py::ssize_t>(heads), static_cast<py::ssize_t>(n)});
  }
  py::array array = require_array(object, function, "lse");
  require_dtype<T>(array, function, "lse", "q");
  if (array.ndim() != 2 || array.shape(0) != heads || array.shape(1) != n) {
    throw py::value_error(argument(function, "lse") + " must be a 2-D array of shape (" +
                          std::to_string(heads) + ", " + std::to_string(n) +
                          "): one row per query head, one column per query token");
  }
  row_stride_of<T>(array, function, "lse");
  if (output) {
    if (!array.writeable()) throw py::value_error(argument(function, "lse") + " is read-only");
    require_no_overlap(array, function, inputs, "lse");
  }
  return array;
}

/// cu_seqlens of a packed batch (int32, B + 1 entries), or empty when None (one sequence).
std::vector<std::int32_t> packed_sequences(py::handle cu_seqlens, const char* function) {
  if (cu_seqlens.is_none()) return {};
  return int32_vector(cu_seqlens, function, "cu_seqlens");
}

template <typename T>
OutputMap<T> lse_map(py::array& array, const char* function) {
  const Index stride = row_stride_of<T>(array, function, "lse");
  return {static_cast<T*>(array.mutable_data()), static_cast<Index>(array.shape(0)),
          static_cast<Index>(array.shape(1)), Eigen::OuterStride<>(stride)};
}

template <typename T>
InputMap<T> lse_input(const py::array& array, const char* function) {
  const Index stride = row_stride_of<T>(array, function, "lse");
  return {static_cast<const T*>(array.data()), static_cast<Index>(array.shape(0)),
          static_cast<Index>(array.shape(1)), Eigen::OuterStride<>(stride)};
}

const char* const with_lse_doc = R"doc(
multihead_attention and the log-sum-exp of every query head, (out, lse):

    lse[h, i] = log sum_j w_ij e^{x_ij}   (head h, with the kernels' scores and weights:
    exact x_ij = tau q_i.k_j - |i-j| / sigma_h, w = 1 (banded: keys |i-j| <= band);
    LSH x_ij = tau q_i.k_j, w_ij = c_ij = #{k : bin_k(i) = bin_k(j)}; causal: j <= i)

lse is [H_q, n] (FlashAttention's softmax_lse of one sequence), a new array or the given lse=
([H_q, n], last axis contiguous) written in place; out is bitwise that of multihead_attention
(exact_reference is computed by the tiled kernel: bitwise method='exact_tiled'). Self-attention
only (k, v have the n tokens of q). Keywords as multihead_attention (no query_offset). The GIL
is released.

cu_seqlens= (int32, B + 1 entries, 0 = cu_seqlens[0] <= ... <= cu_seqlens[B] = n): a packed
batch of B self-attention sequences, tokens cu_seqlens[b] .. cu_seqlens[b+1]-1 (positions 0 ..
m_b - 1 each); lse[:, t] is token t's. Each sequence is bitwise its own call, and out is bitwise
multihead_attention_varlen(q, k, v, cu_seqlens, cu_seqlens).
)doc";

const char* const multihead_backward_doc = R"doc(
Gradients of multihead_attention, (dq, dk, dv), from the forward's out and lse
(multihead_attention_with_lse with the same inputs and keywords) and dout = dL/dout. For each
query head h (K/V head g = h // G), with P_h the probabilities recomputed from lse[h]
(P_ij = w_ij e^{x_ij - lse_i}, the method's scores and weights as in
multihead_attention_with_lse) and D_i = dout_i . out_i:

    dV_h = P_h^T dO_h,  dS_h = P_h o (dO_h V_g^T - D),  dq_h = tau dS_h K_g,  dK_h = tau dS_h^T Q_h
    dk_g = sum_{h : h // G = g} dK_h,  dv_g = sum_{h : h // G = g} dV_h   (in increasing h)

q, dq [n, H_q, d]; k, dk [n, H_kv, d]; v, dv [n, H_kv, d_v]; out, dout [n, H_q, d_v] in
layout 'nhd' ([H, n, d] in 'hnd'); lse [H_q, n]. dq=, dk=, dv=: optional outputs written in
place (any strides on the first two axes); new arrays otherwise. No n x n buffer. Bitwise the
single-head backward of each head (summed over a group in head order), for any thread count.
Self-attention only; the GIL is released. cu_seqlens=: a packed batch, as in
multihead_attention_with_lse (the forward's cu_seqlens); each sequence's gradients are those of
its own call, none crosses sequences.
)doc";

}  // namespace

void bind_multihead_backward(py::module_& module) {
  module.def(
      "multihead_attention_with_lse",
      [](py::handle q, py::handle k, py::handle v, const std::string& layout_name,
         const std::string& method, const std::string& masking, std::optional<double> scale,
         std::optional<std::vector<double>> sigmas, Index samples, std::uint64_t seed,
         double band_error, py::handle out, py::handle lse, py::handle cu_seqlens,
         std::optional<int> threads) {
        const char* const function =  // the library's names
            cu_seqlens.is_none() ? "multihead_attention" : "multihead_attention_varlen";
        threads = thread_count(threads, function);
        const std::vector<std::int32_t> cu = packed_sequences(cu_seqlens, function);
        const Layout layout = layout_of(layout_name, function);
        const poslsh::MultiHeadOptions options =
            multihead_options(function, method, masking, scale, sigmas, samples, seed, band_error);
        const py::array q_array = require_array(q, function, "q");
        return dispatch(q_array, function, "q", [&](auto tag) -> py::tuple {
          using T = typename decltype(tag)::type;
          const auto [q_view, k_view, v_view] = heads_inputs<T>(q_array, k, v, layout, function);
          py::array result = heads_output<T>(out, layout, q_view.tokens, q_view.heads, v_view.dim,
                                             function, "out", {{q, "q"}, {k, "k"}, {v, "v"}});
          py::array lse_array = lse_matrix<T>(lse, q_view.heads, q_view.tokens, function, true,
                                              {{q, "q"}, {k, "k"}, {v, "v"}, {result, "out"}});
          const auto out_view = heads_view<T>(result, layout, function, "out");
          auto lse_out = lse_map<T>(lse_array, function);
          {
            KernelScope scope(threads);
            if (cu_seqlens.is_none())
              poslsh::multihead_attention<T>(q_view, k_view, v_view, out_view,
                                             poslsh::MatrixRef<T>(lse_out), options);
            else
              poslsh::multihead_attention_varlen<T>(q_view, k_view, v_view, out_view,
                                                    poslsh::MatrixRef<T>(lse_out), cu, options);
          }
          return py::make_tuple(result, lse_array);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(), py::arg("layout") = "nhd",
      py::arg("method") = "lsh_fused", py::arg("masking") = "causal", py::arg("scale") = py::none(),
      py::arg("sigmas") = py::none(), py::arg("samples") = 16, py::arg("seed") = 0,
      py::arg("band_error") = 1e-3, py::arg("out") = py::none(), py::arg("lse") = py::none(),
      py::arg("cu_seqlens") = py::none(), py::arg("num_threads") = py::none(), with_lse_doc);

  module.def(
      "multihead_attention_backward",
      [](py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse, py::handle dout,
         const std::string& layout_name, const std::string& method, const std::string& masking,
         std::optional<double> scale, std::optional<std::vector<double>> sigmas, Index samples,
         std::uint64_t seed, double band_error, py::handle dq, py::handle dk, py::handle dv,
         py::handle cu_seqlens, std::optional<int> threads) {
        const char* const function = cu_seqlens.is_none() ? "multihead_attention_backward"
                                                          : "multihead_attention_varlen_backward";
        threads = thread_count(threads, function);
        const std::vector<std::int32_t> cu = packed_sequences(cu_seqlens, function);
        const Layout layout = layout_of(layout_name, function);
        const poslsh::MultiHeadOptions options =
            multihead_options(function, method, masking, scale, sigmas, samples, seed, band_error);
        const py::array q_array = require_array(q, function, "q");
        return dispatch(q_array, function, "q", [&](auto tag) -> py::tuple {
          using T = typename decltype(tag)::type;
          const auto [q_view, k_view, v_view] = heads_inputs<T>(q_array, k, v, layout, function);
          const py::array out_array = heads_input<T>(out, function, "out", "q");
          const py::array dout_array = heads_input<T>(dout, function, "dout", "q");
          const auto out_view = heads_view<const T>(out_array, layout, function, "out");
          const auto dout_view = heads_view<const T>(dout_array, layout, function, "dout");
          const py::array lse_array =
              lse_matrix<T>(lse, q_view.heads, q_view.tokens, function, false, {});
          const InputMap<T> lse_in = lse_input<T>(lse_array, function);
          py::array dq_array = heads_output<T>(
              dq, layout, q_view.tokens, q_view.heads, q_view.dim, function, "dq",
              {{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}, {dout, "dout"}});
          py::array dk_array =
              heads_output<T>(dk, layout, k_view.tokens, k_view.heads, k_view.dim, function, "dk",
                              {{q, "q"},
                               {k, "k"},
                               {v, "v"},
                               {out, "out"},
                               {lse, "lse"},
                               {dout, "dout"},
                               {dq_array, "dq"}});
          py::array dv_array =
              heads_output<T>(dv, layout, v_view.tokens, v_view.heads, v_view.dim, function, "dv",
                              {{q, "q"},
                               {k, "k"},
                               {v, "v"},
                               {out, "out"},
                               {lse, "lse"},
                               {dout, "dout"},
                               {dq_array, "dq"},
                               {dk_array, "dk"}});
          const auto dq_view = heads_view<T>(dq_array, layout, function, "dq");
          const auto dk_view = heads_view<T>(dk_array, layout, function, "dk");
          const auto dv_view = heads_view<T>(dv_array, layout, function, "dv");
          {
            KernelScope scope(threads);
            if (cu_seqlens.is_none())
              poslsh::multihead_attention_backward<T>(q_view, k_view, v_view, out_view,
                                                      poslsh::ConstMatrixRef<T>(lse_in), dout_view,
                                                      dq_view, dk_view, dv_view, options);
            else
              poslsh::multihead_attention_varlen_backward<T>(
                  q_view, k_view, v_view, out_view, poslsh::ConstMatrixRef<T>(lse_in), dout_view,
                  cu, dq_view, dk_view, dv_view, options);
          }
          return py::make_tuple(dq_array, dk_array, dv_array);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dout"),
      py::kw_only(), py::arg("layout") = "nhd", py::arg("method") = "lsh_fused",
      py::arg("masking") = "causal", py::arg("scale") = py::none(), py::arg("sigmas") = py::none(),
      py::arg("samples") = 16, py::arg("seed") = 0, py::arg("band_error") = 1e-3,
      py::arg("dq") = py::none(), py::arg("dk") = py::none(), py::arg("dv") = py::none(),
      py::arg("cu_seqlens") = py::none(), py::arg("num_threads") = py::none(),
      multihead_backward_doc);
}

#else

void bind_multihead_backward(py::module_&) {}

#endif

}  // namespace poslsh_python
