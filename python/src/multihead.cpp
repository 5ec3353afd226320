// poslsh Python bindings: multihead_attention on [n, H, d] or [H, n, d] arrays.
#include "poslsh/multihead.hpp"

#include "common.hpp"

namespace poslsh_python {

namespace {

/// Which axes of a 3-D array are the tokens and the heads.
struct Layout {
  int token_axis = 0;
  int head_axis = 1;
};

Layout layout_of(const std::string& name) {
  if (name == "nhd") return {0, 1};
  if (name == "hnd") return {1, 0};
  throw py::value_error(argument("multihead_attention", "layout") + " = '" + name +
                        "': must be 'nhd' ([n, H, d], KV-cache order) or 'hnd' ([H, n, d])");
}

poslsh::Method method_of(const std::string& name) {
  if (name == "lsh_fused") return poslsh::Method::lsh_fused;
  if (name == "lsh_per_sample") return poslsh::Method::lsh_per_sample;
  if (name == "fixed_blocks") return poslsh::Method::fixed_blocks;
  if (name == "exact_tiled") return poslsh::Method::exact_tiled;
  if (name == "exact_banded") return poslsh::Method::exact_banded;
  if (name == "exact_reference") return poslsh::Method::exact_reference;
  throw py::value_error(argument("multihead_attention", "method") + " = '" + name +
                        "': must be one of lsh_fused, lsh_per_sample, fixed_blocks, "
                        "exact_tiled, exact_banded, exact_reference");
}

poslsh::Masking masking_of_name(const std::string& name) {
  if (name == "causal") return poslsh::Masking::causal;
  if (name == "bidirectional") return poslsh::Masking::bidirectional;
  throw py::value_error(argument("multihead_attention", "masking") + " = '" + name +
                        "': must be 'causal' or 'bidirectional'");
}

/// Stride in elements of `axis`, checked: a positive multiple of the item size when the axis
/// has more than one entry; `fallback` otherwise (the stride is then never used).
template <typename T>
Index axis_stride(const py::array& array, int axis, Index fallback, const char* name) {
  if (array.shape(axis) <= 1 || array.size() == 0) return fallback;
  const py::ssize_t stride = array.strides(axis);
  const auto item = static_cast<py::ssize_t>(sizeof(T));
  if (stride <= 0 || stride % item != 0) {
    throw py::value_error(argument("multihead_attention", name) + " has stride " +
                          std::to_string(stride) + " bytes on axis " + std::to_string(axis) +
                          ": must be a positive multiple of " + std::to_string(item) + " bytes");
  }
  return static_cast<Index>(stride / item);
}

/// HeadsView of a 3-D array in the given layout; the last axis must be contiguous.
template <typename Element>
poslsh::HeadsView<Element> heads_view(const py::array& array, const Layout& layout,
                                      const char* name) {
  using T = std::remove_const_t<Element>;
  constexpr const char* function = "multihead_attention";
  if (array.ndim() != 3) {
    throw py::value_error(argument(function, name) + " has " + std::to_string(array.ndim()) +
                          " dimensions: must be 3-D ([n, H, d] or [H, n, d], see layout)");
  }
  if (array.size() > 0 && array.shape(2) > 1 &&
      array.strides(2) != static_cast<py::ssize_t>(sizeof(T))) {
    throw py::value_error(
        argument(function, name) + " has stride " + std::to_string(array.strides(2)) +
        " bytes on its last axis: must be contiguous (" + std::to_string(sizeof(T)) + " bytes)");
  }
  if (reinterpret_cast<std::uintptr_t>(array.data()) % sizeof(T) != 0) {
    throw py::value_error(argument(function, name) + " is not aligned to its item size");
  }
  poslsh::HeadsView<Element> view;
  view.tokens = static_cast<Index>(array.shape(layout.token_axis));
  view.heads = static_cast<Index>(array.shape(layout.head_axis));
  view.dim = static_cast<Index>(array.shape(2));
  view.row_stride = axis_stride<T>(array, layout.token_axis, view.dim * view.heads, name);
  view.head_stride = axis_stride<T>(array, layout.head_axis, view.dim, name);
  if (view.heads <= 1) view.head_stride = view.tokens * view.row_stride;
  if (view.tokens <= 1) view.row_stride = std::max(view.dim, view.heads * view.head_stride);
  if constexpr (std::is_const_v<Element>) {
    view.data = static_cast<Element*>(array.data());
  } else {
    view.data = static_cast<Element*>(py::array(array).mutable_data());
  }
  return view;
}

}  // namespace

void bind_multihead(py::module_& module) {
  module.def(
      "multihead_attention",
      [](py::handle q, py::handle k, py::handle v, const std::string& layout_name,
         const std::string& method, const std::string& masking, std::optional<double> scale,
         std::optional<std::vector<double>> sigmas, Index samples, std::uint64_t seed,
         double band_error, py::handle out, std::optional<int> threads) -> py::array {
        constexpr const char* function = "multihead_attention";
        threads = thread_count(threads, function);
        const Layout layout = layout_of(layout_name);
        poslsh::MultiHeadOptions options;
        options.method = method_of(method);
        options.masking = masking_of_name(masking);
        options.scale = scale;
        if (sigmas) options.sigmas = *sigmas;
        options.samples = samples;
        options.seed = seed;
        options.band_error = band_error;
        const py::array q_array = require_array(q, function, "q");
        return dispatch(q_array, function, "q", [&](auto tag) -> py::array {
          using T = typename decltype(tag)::type;
          const py::array k_array = require_array(k, function, "k");
          const py::array v_array = require_array(v, function, "v");
          require_dtype<T>(k_array, function, "k", "q");
          require_dtype<T>(v_array, function, "v", "q");
          const auto q_view = heads_view<const T>(q_array, layout, "q");
          const auto k_view = heads_view<const T>(k_array, layout, "k");
          const auto v_view = heads_view<const T>(v_array, layout, "v");
          py::array result;
          if (out.is_none()) {
            std::vector<py::ssize_t> shape(3);
            shape[static_cast<std::size_t>(layout.token_axis)] = q_view.tokens;
            shape[static_cast<std::size_t>(layout.head_axis)] = q_view.heads;
            shape[2] = v_view.dim;
            result = py::array_t<T>(shape);
          } else {
            result = require_array(out, function, "out");
            require_dtype<T>(result, function, "out", "q");
            if (!result.writeable()) {
              throw py::value_error(argument(function, "out") + " is read-only");
            }
            require_no_overlap(result, function, {{q, "q"}, {k, "k"}, {v, "v"}});
          }
          const auto out_view = heads_view<T>(result, layout, "out");
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
      py::arg("band_error") = 1e-3, py::arg("out") = py::none(),
      py::arg("num_threads") = py::none(), R"doc(
Multi-head (and grouped-query) ALiBi attention, exact or by Positional LSH. For each query head
h (group G = H_q / H_kv, K/V head h // G):

    out_h = method(Q_h, K_{h//G}, V_{h//G}; sigma_h)

layout: 'nhd' (default): q is [n, H_q, d], k [n, H_kv, d], v [n, H_kv, d_v], out
[n, H_q, d_v] (KV-cache order); 'hnd': the same with the first two axes swapped ([H, n, d]).
The layout is never guessed from the shapes. Any strides on the first two axes (e.g. slices of
a packed qkv buffer), last axis contiguous; no copies.
method: 'lsh_fused' (default), 'lsh_per_sample', 'fixed_blocks', 'exact_tiled',
'exact_banded' (band_for_bias_error(sigma_h, band_error)), 'exact_reference'.
masking: 'causal' (default) or 'bidirectional'. scale: tau, None means 1/sqrt(d).
sigmas: one per query head, None means alibi_sigmas(H_q) (sigma_h = 1 / m_h).
samples, seed: LSH head h uses rbf_hashes(sigma_h, samples, seed, stream=h).
out: optional output written in place and returned. num_threads: OpenMP threads for this call.
float32 or float64 (all arrays alike); the GIL is released during the computation.
)doc");
}

}  // namespace poslsh_python
