// poslsh Python bindings: 3-D [n, H, d] / [H, n, d] arrays as poslsh::HeadsView (no copies),
// the keyword arguments of the multi-head functions, and int32 index arrays (cu_seqlens, block
// tables), shared by the multi-head, varlen, backward and paged bindings.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common.hpp"
#include "poslsh/core/heads_view.hpp"
#include "poslsh/multihead/attention.hpp"

namespace poslsh_python {

/// Which axes of a 3-D array are the tokens and the heads.
struct Layout {
  int token_axis = 0;
  int head_axis = 1;
};

inline Layout layout_of(const std::string& name, const char* function) {
  if (name == "nhd") return {0, 1};
  if (name == "hnd") return {1, 0};
  throw py::value_error(argument(function, "layout") + " = '" + name +
                        "': must be 'nhd' ([n, H, d], KV-cache order) or 'hnd' ([H, n, d])");
}

inline poslsh::Method method_of(const std::string& name, const char* function) {
  if (name == "lsh_fused") return poslsh::Method::lsh_fused;
  if (name == "lsh_per_sample") return poslsh::Method::lsh_per_sample;
  if (name == "fixed_blocks") return poslsh::Method::fixed_blocks;
  if (name == "exact_tiled") return poslsh::Method::exact_tiled;
  if (name == "exact_banded") return poslsh::Method::exact_banded;
  if (name == "exact_reference") return poslsh::Method::exact_reference;
  throw py::value_error(argument(function, "method") + " = '" + name +
                        "': must be one of lsh_fused, lsh_per_sample, fixed_blocks, "
                        "exact_tiled, exact_banded, exact_reference");
}

inline poslsh::Masking masking_of_name(const std::string& name, const char* function) {
  if (name == "causal") return poslsh::Masking::causal;
  if (name == "bidirectional") return poslsh::Masking::bidirectional;
  throw py::value_error(argument(function, "masking") + " = '" + name +
                        "': must be 'causal' or 'bidirectional'");
}

/// The keyword arguments every multi-head function shares, as MultiHeadOptions.
inline poslsh::MultiHeadOptions multihead_options(const char* function, const std::string& method,
                                                  const std::string& masking,
                                                  std::optional<double> scale,
                                                  const std::optional<std::vector<double>>& sigmas,
                                                  Index samples, std::uint64_t seed,
                                                  double band_error) {
  poslsh::MultiHeadOptions options;
  options.method = method_of(method, function);
  options.masking = masking_of_name(masking, function);
  options.scale = scale;
  if (sigmas) options.sigmas = *sigmas;
  options.samples = samples;
  options.seed = seed;
  options.band_error = band_error;
  return options;
}

/// Stride in elements of `axis`, checked: a positive multiple of the item size when the axis
/// has more than one entry; `fallback` otherwise (the stride is then never used).
template <typename T>
Index axis_stride(const py::array& array, int axis, Index fallback, const char* function,
                  const char* name) {
  if (array.shape(axis) <= 1 || array.size() == 0) return fallback;
  const py::ssize_t stride = array.strides(axis);
  const auto item = static_cast<py::ssize_t>(sizeof(T));
  if (stride <= 0 || stride % item != 0) {
    throw py::value_error(argument(function, name) + " has stride " + std::to_string(stride) +
                          " bytes on axis " + std::to_string(axis) +
                          ": must be a positive multiple of " + std::to_string(item) + " bytes");
  }
  return static_cast<Index>(stride / item);
}

/// HeadsView of a 3-D array in the given layout; the last axis must be contiguous, the other
/// two may have any positive strides.
template <typename Element>
poslsh::HeadsView<Element> heads_view(const py::array& array, const Layout& layout,
                                      const char* function, const char* name) {
  using T = std::remove_const_t<Element>;
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
  view.row_stride = axis_stride<T>(array, layout.token_axis, view.dim * view.heads, function, name);
  view.head_stride = axis_stride<T>(array, layout.head_axis, view.dim, function, name);
  if (view.heads <= 1) view.head_stride = view.tokens * view.row_stride;
  if (view.tokens <= 1) view.row_stride = std::max(view.dim, view.heads * view.head_stride);
  if constexpr (std::is_const_v<Element>) {
    view.data = static_cast<Element*>(array.data());
  } else {
    view.data = static_cast<Element*>(py::array(array).mutable_data());
  }
  return view;
}

/// A 3-D input array of dtype T (named `name`, dtype checked against `reference`).
template <typename T>
py::array heads_input(py::handle object, const char* function, const char* name,
                      const char* reference) {
  py::array array = require_array(object, function, name);
  require_dtype<T>(array, function, name, reference);
  return array;
}

/// The q, k, v views of a multi-head call in the layout: k and v must have q's dtype T. The
/// views borrow the callers' arrays.
template <typename T>
struct HeadsInputs {
  poslsh::HeadsView<const T> q, k, v;
};

template <typename T>
HeadsInputs<T> heads_inputs(const py::array& q, py::handle k, py::handle v, const Layout& layout,
                            const char* function) {
  const py::array k_array = heads_input<T>(k, function, "k", "q");
  const py::array v_array = heads_input<T>(v, function, "v", "q");
  return {heads_view<const T>(q, layout, function, "q"),
          heads_view<const T>(k_array, layout, function, "k"),
          heads_view<const T>(v_array, layout, function, "v")};
}

/// A 3-D output array (named `name`): a new C-contiguous array of `tokens` x `heads` x `dim` in
/// the layout, or `out` checked (ndarray of T, writable, sharing no memory with `inputs`). Its
/// shape is checked by the library (the view's sizes).
template <typename T>
py::array heads_output(py::handle out, const Layout& layout, Index tokens, Index heads, Index dim,
                       const char* function, const char* name,
                       std::initializer_list<std::pair<py::handle, const char*>> inputs) {
  if (out.is_none()) {
    std::vector<py::ssize_t> shape(3);
    shape[static_cast<std::size_t>(layout.token_axis)] = tokens;
    shape[static_cast<std::size_t>(layout.head_axis)] = heads;
    shape[2] = dim;
    return py::array_t<T>(shape);
  }
  py::array result = require_array(out, function, name);
  require_dtype<T>(result, function, name, "q");
  if (!result.writeable()) {
    throw py::value_error(argument(function, name) + " is read-only");
  }
  require_no_overlap(result, function, inputs, name);
  return result;
}

/// A 1-D int32 array (named `name`) copied into a vector: cu_seqlens, seq_lens. Any other dtype
/// is a TypeError (no conversion), as for the float arrays.
inline std::vector<std::int32_t> int32_vector(py::handle object, const char* function,
                                              const char* name) {
  const py::array array = require_array(object, function, name);
  if (!py::isinstance<py::array_t<std::int32_t>>(array)) {
    throw py::type_error(argument(function, name) + " has dtype " + dtype_name(array) +
                         ": must be int32 (arrays are never converted; use .astype(np.int32))");
  }
  if (array.ndim() != 1) {
    throw py::value_error(argument(function, name) + " has " + std::to_string(array.ndim()) +
                          " dimensions: must be 1-D");
  }
  std::vector<std::int32_t> values(static_cast<std::size_t>(array.shape(0)));
  const auto* bytes = static_cast<const char*>(array.data());
  for (py::ssize_t i = 0; i < array.shape(0); ++i) {
    std::memcpy(&values[static_cast<std::size_t>(i)], bytes + i * array.strides(0),
                sizeof(std::int32_t));
  }
  return values;
}

}  // namespace poslsh_python
