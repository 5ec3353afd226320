// poslsh Python bindings: array arguments as Eigen maps and HeadsViews of their storage (no
// copies), and output arrays, for every storage type of dtypes.hpp.
//
// Rules shared by every binding:
//  - a matrix argument is a 2-D array whose last axis has unit stride; its row stride is any
//    positive multiple of the item size (ValueError naming the argument otherwise);
//  - a heads argument is a 3-D array ([n, H, d] or [H, n, d], see Layout) whose last axis has
//    unit stride; its other two axes may have any positive strides;
//  - outputs (`out=`) are written in place and must not share memory with the inputs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtypes.hpp"
#include "poslsh/core/heads_view.hpp"

namespace poslsh_python {

template <typename S>
using InputMap = Eigen::Map<const poslsh::RowMatrix<S>, 0, Eigen::OuterStride<>>;
template <typename S>
using OutputMap = Eigen::Map<poslsh::RowMatrix<S>, 0, Eigen::OuterStride<>>;

/// The inputs an output must not overlap, with their names.
using Inputs = std::vector<std::pair<py::handle, const char*>>;

/// "(2, 3)" of a shape.
inline std::string shape_text(const py::ssize_t* shape, std::size_t ndim) {
  std::string text;
  for (std::size_t axis = 0; axis < ndim; ++axis) {
    text += (axis ? ", " : "") + std::to_string(shape[axis]);
  }
  return "(" + text + ")";
}

inline std::string shape_text(const py::array& array) {
  return shape_text(array.shape(), static_cast<std::size_t>(array.ndim()));
}

/// Row stride in elements of a 2-D array of storage S, after checking the layout: unit stride
/// on the last axis (or at most one column), a positive row stride that is a multiple of the
/// item size (or at most one row), and an element-aligned buffer.
template <typename S>
Index row_stride_of(const py::array& array, const char* function, const char* name) {
  const auto rows = static_cast<Index>(array.shape(0));
  const auto cols = static_cast<Index>(array.shape(1));
  const auto item = static_cast<py::ssize_t>(sizeof(S));
  const std::string strides =
      "(" + std::to_string(array.strides(0)) + ", " + std::to_string(array.strides(1)) + ")";
  if (rows == 0 || cols == 0) return cols;  // nothing is addressed
  if (cols > 1 && array.strides(1) != item) {
    throw py::value_error(argument(function, name) + " has strides " + strides +
                          " bytes: its last axis must be contiguous (stride " +
                          std::to_string(item) +
                          " bytes); rows may have any stride. np.ascontiguousarray() copies it");
  }
  if (reinterpret_cast<std::uintptr_t>(array.data()) % sizeof(S) != 0) {
    throw py::value_error(argument(function, name) + " is not aligned to its item size");
  }
  if (rows <= 1) return cols;
  if (array.strides(0) <= 0 || array.strides(0) % item != 0) {
    throw py::value_error(argument(function, name) + " has strides " + strides +
                          " bytes: the row stride must be a positive multiple of " +
                          std::to_string(item) + " bytes");
  }
  return static_cast<Index>(array.strides(0) / item);
}

/// Read-only (rows x cols) view of a 2-D array of storage S, no copy.
template <typename S>
InputMap<S> input_matrix(py::handle object, const char* function, const char* name,
                         const char* like) {
  const py::array array = storage_array<S>(object, function, name, like);
  if (array.ndim() != 2) {
    throw py::value_error(argument(function, name) + " has " + std::to_string(array.ndim()) +
                          " dimensions: must be a 2-D array (rows, columns)");
  }
  const Index stride = row_stride_of<S>(array, function, name);
  return InputMap<S>(static_cast<const S*>(array.data()), static_cast<Index>(array.shape(0)),
                     static_cast<Index>(array.shape(1)), Eigen::OuterStride<>(stride));
}

/// The q, k, v maps of a single-head call of types Call (k, v like q, or like k when Call
/// reads float q over a half-precision K, V).
template <typename Call>
struct QkvMaps {
  InputMap<typename Call::q> q;
  InputMap<typename Call::kv> k, v;
};

template <typename Call>
QkvMaps<Call> qkv_maps(const char* function, py::handle q, py::handle k, py::handle v,
                       const Names& names = {}) {
  const char* like = kv_like<Call>(names);
  return {input_matrix<typename Call::q>(q, function, names.q, names.q),
          input_matrix<typename Call::kv>(k, function, names.k, like),
          input_matrix<typename Call::kv>(v, function, names.v, like)};
}

/// Byte range [first, last) an array addresses (empty for an empty array).
inline std::pair<std::uintptr_t, std::uintptr_t> byte_extent(const py::array& array) {
  auto first = reinterpret_cast<std::uintptr_t>(array.data());
  auto last = first;
  if (array.size() == 0) return {first, first};
  for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
    const py::ssize_t span = (array.shape(axis) - 1) * array.strides(axis);
    if (span >= 0) {
      last += static_cast<std::uintptr_t>(span);
    } else {
      first -= static_cast<std::uintptr_t>(-span);
    }
  }
  return {first, last + static_cast<std::uintptr_t>(array.itemsize())};
}

/// ValueError if the output `out` (the argument `name`) shares memory with one of `inputs`
/// (ndarrays or BFloat16Bits; bounds first, numpy.shares_memory when the bounds overlap).
inline void require_no_overlap(const py::array& out, const char* function, const Inputs& inputs,
                               const char* name) {
  const auto out_extent = byte_extent(out);
  if (out_extent.first == out_extent.second) return;
  for (const auto& [input, input_name] : inputs) {
    py::array array;
    if (py::isinstance<BFloat16Bits>(input)) {
      array = input.cast<const BFloat16Bits&>().bits;
    } else if (py::isinstance<py::array>(input)) {
      array = py::reinterpret_borrow<py::array>(input);
    } else {
      continue;
    }
    const auto extent = byte_extent(array);
    if (extent.first >= out_extent.second || out_extent.first >= extent.second) continue;
    if (py::module_::import("numpy").attr("shares_memory")(out, array).cast<bool>()) {
      throw py::value_error(argument(function, name) + " shares memory with '" + input_name +
                            "': an output must overlap neither an input nor another output");
    }
  }
}

/// An output argument: what the binding returns (the array, or a BFloat16Bits over it) and the
/// array the kernel writes.
struct Output {
  py::object result;
  py::array array;
};

/// The output of storage S named `name`: a new C-contiguous array of `shape` when `out` is
/// None; else `out` checked: storage S (like the argument `like`), `shape` when `check_shape`
/// (else the library checks it), writable, sharing no memory with `inputs`.
template <typename S>
Output output_of(py::handle out, const std::vector<py::ssize_t>& shape, const char* function,
                 const char* name, const char* like, const Inputs& inputs,
                 bool check_shape = true) {
  if (out.is_none()) {
    py::array array(py::dtype(numpy_dtype<S>()), shape);
    if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
      return {py::cast(BFloat16Bits{array}), array};
    } else {
      return {array, array};
    }
  }
  py::array array = storage_array<S>(out, function, name, like);
  if (check_shape &&
      !std::equal(shape.begin(), shape.end(), array.shape(), array.shape() + array.ndim())) {
    throw py::value_error(argument(function, name) + " has shape " + shape_text(array) +
                          ": must be " + shape_text(shape.data(), shape.size()));
  }
  if (!array.writeable()) throw py::value_error(argument(function, name) + " is read-only");
  require_no_overlap(array, function, inputs, name);
  return {py::reinterpret_borrow<py::object>(out), array};
}

/// A (rows x cols) output matrix of storage S (see output_of) and its writable map.
template <typename S>
struct MatrixOutput {
  py::object result;
  OutputMap<S> map;
};

template <typename S>
MatrixOutput<S> output_matrix(py::handle out, Index rows, Index cols, const char* function,
                              const char* name, const char* like, const Inputs& inputs) {
  Output output = output_of<S>(out, {rows, cols}, function, name, like, inputs);
  const Index stride = row_stride_of<S>(output.array, function, name);
  return {output.result, OutputMap<S>(static_cast<S*>(output.array.mutable_data()), rows, cols,
                                      Eigen::OuterStride<>(stride))};
}

/// Maps q, k, v (dispatch<P>), prepares the output (q.rows() x v.cols()), then runs
/// kernel(types, q, k, v, out) without the GIL. Returns the output.
template <DtypeSet P, typename Kernel>
py::object qkv_call(const char* function, py::handle q, py::handle k, py::handle v, py::handle out,
                    std::optional<int> threads, Kernel&& kernel, const Names& names = {}) {
  threads = thread_count(threads, function);
  const auto run = [&](auto types) -> py::object {
    using Call = decltype(types);
    const QkvMaps<Call> maps = qkv_maps<Call>(function, q, k, v, names);
    auto output =
        output_matrix<typename Call::out>(out, maps.q.rows(), maps.v.cols(), function, "out",
                                          names.q, {{q, names.q}, {k, names.k}, {v, names.v}});
    run_kernel(threads, [&] { kernel(types, maps.q, maps.k, maps.v, output.map); });
    return output.result;
  };
  return dispatch<P>(function, {q, k, v, out}, run, names);
}

/// Which axes of a 3-D array are the tokens and the heads: "nhd" ([n, H, d], KV-cache order)
/// or "hnd" ([H, n, d]).
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

/// Stride in elements of `axis`, checked: a positive multiple of the item size when the axis
/// has more than one entry; `fallback` otherwise (the stride is then never used).
template <typename S>
Index axis_stride(const py::array& array, int axis, Index fallback, const char* function,
                  const char* name) {
  if (array.shape(axis) <= 1 || array.size() == 0) return fallback;
  const py::ssize_t stride = array.strides(axis);
  const auto item = static_cast<py::ssize_t>(sizeof(S));
  if (stride <= 0 || stride % item != 0) {
    throw py::value_error(argument(function, name) + " has stride " + std::to_string(stride) +
                          " bytes on axis " + std::to_string(axis) +
                          ": must be a positive multiple of " + std::to_string(item) + " bytes");
  }
  return static_cast<Index>(stride / item);
}

/// HeadsView of a 3-D array in the layout; the last axis must be contiguous, the other two may
/// have any positive strides. The view borrows the array's buffer.
template <typename Element>
poslsh::HeadsView<Element> heads_view(const py::array& array, const Layout& layout,
                                      const char* function, const char* name) {
  using S = std::remove_const_t<Element>;
  if (array.ndim() != 3) {
    throw py::value_error(argument(function, name) + " has " + std::to_string(array.ndim()) +
                          " dimensions: must be 3-D ([n, H, d] or [H, n, d], see layout)");
  }
  if (array.size() > 0 && array.shape(2) > 1 &&
      array.strides(2) != static_cast<py::ssize_t>(sizeof(S))) {
    throw py::value_error(
        argument(function, name) + " has stride " + std::to_string(array.strides(2)) +
        " bytes on its last axis: must be contiguous (" + std::to_string(sizeof(S)) + " bytes)");
  }
  if (reinterpret_cast<std::uintptr_t>(array.data()) % sizeof(S) != 0) {
    throw py::value_error(argument(function, name) + " is not aligned to its item size");
  }
  poslsh::HeadsView<Element> view;
  view.tokens = static_cast<Index>(array.shape(layout.token_axis));
  view.heads = static_cast<Index>(array.shape(layout.head_axis));
  view.dim = static_cast<Index>(array.shape(2));
  view.row_stride = axis_stride<S>(array, layout.token_axis, view.dim * view.heads, function, name);
  view.head_stride = axis_stride<S>(array, layout.head_axis, view.dim, function, name);
  if (view.heads <= 1) view.head_stride = view.tokens * view.row_stride;
  if (view.tokens <= 1) view.row_stride = std::max(view.dim, view.heads * view.head_stride);
  if constexpr (std::is_const_v<Element>) {
    view.data = static_cast<Element*>(array.data());
  } else {
    view.data = static_cast<Element*>(py::array(array).mutable_data());
  }
  return view;
}

/// Read-only HeadsView of a 3-D argument of storage S (like the argument `like`).
template <typename S>
poslsh::HeadsView<const S> heads_input(py::handle object, const Layout& layout,
                                       const char* function, const char* name, const char* like) {
  return heads_view<const S>(storage_array<S>(object, function, name, like), layout, function,
                             name);
}

/// The q, k, v views of a multi-head call of types Call (see qkv_maps).
template <typename Call>
struct HeadsInputs {
  poslsh::HeadsView<const typename Call::q> q;
  poslsh::HeadsView<const typename Call::kv> k, v;
};

template <typename Call>
HeadsInputs<Call> heads_inputs(const char* function, py::handle q, py::handle k, py::handle v,
                               const Layout& layout) {
  const char* like = kv_like<Call>({});
  return {heads_input<typename Call::q>(q, layout, function, "q", "q"),
          heads_input<typename Call::kv>(k, layout, function, "k", like),
          heads_input<typename Call::kv>(v, layout, function, "v", like)};
}

/// A 3-D output of storage S (tokens x heads x dim in the layout; see output_of, its shape is
/// checked by the library) and its writable view.
template <typename S>
struct HeadsOutput {
  py::object result;
  poslsh::HeadsView<S> view;
};

template <typename S>
HeadsOutput<S> heads_output(py::handle out, const Layout& layout, Index tokens, Index heads,
                            Index dim, const char* function, const char* name, const char* like,
                            const Inputs& inputs) {
  std::vector<py::ssize_t> shape(3);
  shape[static_cast<std::size_t>(layout.token_axis)] = tokens;
  shape[static_cast<std::size_t>(layout.head_axis)] = heads;
  shape[2] = dim;
  Output output = output_of<S>(out, shape, function, name, like, inputs, false);
  return {output.result, heads_view<S>(output.array, layout, function, name)};
}

/// A 1-D int32 array (named `name`) copied into a vector: cu_seqlens. Any other dtype is a
/// TypeError (no conversion), as for the float arrays.
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
