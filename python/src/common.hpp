// poslsh Python bindings: numpy arrays as Eigen maps without copies, dtype dispatch, the
// GIL and the OpenMP thread count around a kernel call.
//
// Rules shared by every binding:
//  - arrays are never converted: the first floating argument fixes the dtype (float32 or
//    float64) and every other array must have it (TypeError otherwise);
//  - a matrix argument is a 2-D array whose last axis has unit stride; its row stride is any
//    positive multiple of the item size (ValueError naming the argument otherwise);
//  - outputs (`out=`) are written in place and must not share memory with the inputs.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "poslsh/lsh/hash.hpp"
#include "poslsh/core/types.hpp"

PYBIND11_MAKE_OPAQUE(poslsh::HashSet)

namespace poslsh_python {

namespace py = pybind11;
using poslsh::Index;
using poslsh::RowMatrix;

template <typename T>
using InputMap = Eigen::Map<const RowMatrix<T>, 0, Eigen::OuterStride<>>;
template <typename T>
using OutputMap = Eigen::Map<RowMatrix<T>, 0, Eigen::OuterStride<>>;

/// "poslsh: <function>: argument '<name>'", the prefix of the binding's own messages (the
/// library's messages start the same way).
inline std::string argument(const char* function, const char* name) {
  return std::string("poslsh: ") + function + ": argument '" + name + "'";
}

/// "float32", "int64", ... of an array.
inline std::string dtype_name(const py::array& array) {
  return py::str(array.dtype()).cast<std::string>();
}

/// `object` as a numpy array; TypeError naming the argument otherwise (lists are not converted).
inline py::array require_array(py::handle object, const char* function, const char* name) {
  if (!py::isinstance<py::array>(object)) {
    throw py::type_error(argument(function, name) + " must be a numpy.ndarray, got " +
                         py::str(py::type::handle_of(object).attr("__name__")).cast<std::string>() +
                         " (no conversion is made)");
  }
  return py::reinterpret_borrow<py::array>(object);
}

template <typename T>
const char* scalar_name() {
  return sizeof(T) == 4 ? "float32" : "float64";
}

/// Checks that `array` holds T (native byte order); TypeError naming it otherwise.
template <typename T>
void require_dtype(const py::array& array, const char* function, const char* name,
                   const char* reference) {
  if (!py::isinstance<py::array_t<T>>(array)) {
    throw py::type_error(argument(function, name) + " has dtype " + dtype_name(array) +
                         ": must be " + scalar_name<T>() + " like '" + reference +
                         "' (arrays are never converted; use .astype() to convert)");
  }
}

template <typename T>
struct Tag {
  using type = T;
};

/// Calls run(Tag<float>{}) or run(Tag<double>{}) after the dtype of `first` (TypeError for any
/// other dtype).
template <typename Run>
decltype(auto) dispatch(const py::array& first, const char* function, const char* name, Run&& run) {
  if (py::isinstance<py::array_t<float>>(first)) return run(Tag<float>{});
  if (py::isinstance<py::array_t<double>>(first)) return run(Tag<double>{});
  throw py::type_error(argument(function, name) + " has dtype " + dtype_name(first) +
                       ": must be float32 or float64 (arrays are never converted)");
}

/// Row stride in elements of a 2-D array, after checking the layout: unit stride on the last
/// axis (or at most one column), a positive row stride that is a multiple of the item size
/// (or at most one row), and an element-aligned buffer.
template <typename T>
Index row_stride_of(const py::array& array, const char* function, const char* name) {
  const auto rows = static_cast<Index>(array.shape(0));
  const auto cols = static_cast<Index>(array.shape(1));
  const auto item = static_cast<py::ssize_t>(sizeof(T));
  const std::string strides =
      "(" + std::to_string(array.strides(0)) + ", " + std::to_string(array.strides(1)) + ")";
  if (rows == 0 || cols == 0) return cols;  // nothing is addressed
  if (cols > 1 && array.strides(1) != item) {
    throw py::value_error(argument(function, name) + " has strides " + strides +
                          " bytes: its last axis must be contiguous (stride " +
                          std::to_string(item) +
                          " bytes); rows may have any stride. np.ascontiguousarray() copies it");
  }
  if (reinterpret_cast<std::uintptr_t>(array.data()) % sizeof(T) != 0) {
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

/// Read-only (n x d) view of a 2-D T array, no copy.
template <typename T>
InputMap<T> input_matrix(py::handle object, const char* function, const char* name,
                         const char* reference) {
  const py::array array = require_array(object, function, name);
  require_dtype<T>(array, function, name, reference);
  if (array.ndim() != 2) {
    throw py::value_error(argument(function, name) + " has " + std::to_string(array.ndim()) +
                          " dimensions: must be a 2-D array (rows, columns)");
  }
  const Index stride = row_stride_of<T>(array, function, name);
  return InputMap<T>(static_cast<const T*>(array.data()), static_cast<Index>(array.shape(0)),
                     static_cast<Index>(array.shape(1)), Eigen::OuterStride<>(stride));
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

/// ValueError if `out` (the argument `out_name`) shares memory with one of `inputs` (bounds
/// first, numpy.shares_memory when the bounds overlap).
inline void require_no_overlap(const py::array& out, const char* function,
                               std::initializer_list<std::pair<py::handle, const char*>> inputs,
                               const char* out_name = "out") {
  const auto out_extent = byte_extent(out);
  if (out_extent.first == out_extent.second) return;
  for (const auto& [input, name] : inputs) {
    if (!py::isinstance<py::array>(input)) continue;
    const py::array array = py::reinterpret_borrow<py::array>(input);
    const auto extent = byte_extent(array);
    if (extent.first >= out_extent.second || out_extent.first >= extent.second) continue;
    const bool shared = py::module_::import("numpy").attr("shares_memory")(out, array).cast<bool>();
    if (shared) {
      throw py::value_error(argument(function, out_name) + " shares memory with '" + name +
                            "': an output must overlap neither an input nor another output");
    }
  }
}

/// The output array: `out` checked (writable ndarray of T, shape rows x cols, unit last-axis
/// stride, no overlap with the inputs) or a new C-contiguous array.
template <typename T>
py::array output_array(py::handle out, Index rows, Index cols, const char* function,
                       const char* reference,
                       std::initializer_list<std::pair<py::handle, const char*>> inputs) {
  if (out.is_none()) {
    return py::array_t<T>(
        std::vector<py::ssize_t>{static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(cols)});
  }
  py::array array = require_array(out, function, "out");
  require_dtype<T>(array, function, "out", reference);
  if (array.ndim() != 2 || array.shape(0) != rows || array.shape(1) != cols) {
    std::string shape;
    for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
      shape += (axis ? ", " : "") + std::to_string(array.shape(axis));
    }
    throw py::value_error(argument(function, "out") + " has shape (" + shape + "): must be (" +
                          std::to_string(rows) + ", " + std::to_string(cols) + ")");
  }
  if (!array.writeable()) {
    throw py::value_error(argument(function, "out") + " is read-only");
  }
  row_stride_of<T>(array, function, "out");
  require_no_overlap(array, function, inputs);
  return array;
}

/// Writable (rows x cols) map of an array returned by output_array.
template <typename T>
OutputMap<T> output_matrix(py::array& array, const char* function) {
  const Index stride = row_stride_of<T>(array, function, "out");
  return OutputMap<T>(static_cast<T*>(array.mutable_data()), static_cast<Index>(array.shape(0)),
                      static_cast<Index>(array.shape(1)), Eigen::OuterStride<>(stride));
}

/// Checks a `num_threads` keyword (None or >= 1).
inline std::optional<int> thread_count(std::optional<int> threads, const char* function) {
  if (threads && *threads < 1) {
    throw py::value_error(argument(function, "num_threads") + " = " + std::to_string(*threads) +
                          ": must be >= 1 (or None for the OpenMP default)");
  }
  return threads;
}

/// Releases the GIL and, when a thread count is given, sets the OpenMP thread count of the
/// calling thread for the kernel (restored afterwards). OpenMP's count is per calling thread,
/// so Python threads calling kernels concurrently do not affect each other.
class KernelScope {
 public:
  explicit KernelScope(std::optional<int> threads) {
#ifdef _OPENMP
    if (threads) {
      previous_ = omp_get_max_threads();
      omp_set_num_threads(*threads);
    }
#else
    (void)threads;
#endif
  }
  ~KernelScope() {
#ifdef _OPENMP
    if (previous_ > 0) omp_set_num_threads(previous_);
#endif
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  py::gil_scoped_release release_;
  int previous_ = 0;
};

/// Masking from the `causal` keyword.
inline poslsh::Masking masking_of(bool causal) {
  return causal ? poslsh::Masking::causal : poslsh::Masking::bidirectional;
}

/// A HashSet argument (TypeError if it is not one).
inline const poslsh::HashSet& hash_set(py::handle object, const char* function) {
  if (!py::isinstance<poslsh::HashSet>(object)) {
    throw py::type_error(argument(function, "hashes") + " must be a poslsh.HashSet, got " +
                         py::str(py::type::handle_of(object).attr("__name__")).cast<std::string>());
  }
  return object.cast<const poslsh::HashSet&>();
}

void bind_hashes(py::module_& module);
void bind_kernels(py::module_& module);
void bind_multihead(py::module_& module);
void bind_interop(py::module_& module);
void bind_analysis(py::module_& module);
void bind_backward(py::module_& module);
void bind_multihead_backward(py::module_& module);
void bind_paged(py::module_& module);
void bind_half(py::module_& module);
void bind_samplers(py::module_& module);

}  // namespace poslsh_python
