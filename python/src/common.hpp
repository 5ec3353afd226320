// poslsh Python bindings: what every binding file shares: argument messages, the GIL and the
// OpenMP thread count around a kernel call, the arguments that are library objects or names,
// and the register_* function of each binding file (module.cpp calls them).
//
// Errors: the library's std::invalid_argument becomes ValueError with its message; the
// bindings' own messages start the same way, "poslsh: <function>: argument '<name>' ...".
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "poslsh/core/names.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/tile_engines.hpp"

// The tile work of the listed engines is compiled once for the module, in engines.cpp.
POSLSH_EXTERN_TILE_ENGINES()

PYBIND11_MAKE_OPAQUE(poslsh::HashSet)

namespace poslsh_python {

namespace py = pybind11;
using poslsh::Index;

/// "poslsh: <function>: argument '<name>'", the prefix of the bindings' own messages.
inline std::string argument(const char* function, const char* name) {
  return std::string("poslsh: ") + function + ": argument '" + name + "'";
}

/// The Python type name of an object ("list", "ndarray", ...).
inline std::string type_name(py::handle object) {
  return py::str(py::type::handle_of(object).attr("__name__")).cast<std::string>();
}

/// "float32", "int64", ... of an array.
inline std::string dtype_name(const py::array& array) {
  return py::str(array.dtype()).cast<std::string>();
}

/// `object` as a numpy array; TypeError naming the argument otherwise (lists are not converted).
inline py::array require_array(py::handle object, const char* function, const char* name) {
  if (!py::isinstance<py::array>(object)) {
    throw py::type_error(argument(function, name) + " must be a numpy.ndarray, got " +
                         type_name(object) + " (no conversion is made)");
  }
  return py::reinterpret_borrow<py::array>(object);
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

/// Runs kernel() in a KernelScope: without the GIL (kernel must not touch Python objects), with
/// `threads` OpenMP threads when given.
template <typename Kernel>
void run_kernel(std::optional<int> threads, Kernel&& kernel) {
  KernelScope scope(threads);
  kernel();
}

/// The Masking named by a `masking` keyword (EnumNames<Masking>: "causal", "bidirectional");
/// ValueError naming the argument 'masking' of `function` otherwise.
inline poslsh::Masking masking_of(const std::string& name, const char* function) {
  return poslsh::enum_from_name<poslsh::Masking>(name, function, "masking");
}

/// The default of the `masking` keyword: the name of AttentionOptions' default masking.
inline const char* default_masking() {
  return poslsh::enum_name(poslsh::AttentionOptions{}.masking);
}

/// The Precision named by a `precision` keyword (EnumNames<Precision>: "matrix_units",
/// "float_products"); ValueError naming the argument 'precision' of `function` otherwise.
inline poslsh::Precision precision_of(const std::string& name, const char* function) {
  return poslsh::enum_from_name<poslsh::Precision>(name, function, "precision");
}

/// The default of the `precision` keyword: the name of AttentionOptions' default precision.
inline const char* default_precision() {
  return poslsh::enum_name(poslsh::AttentionOptions{}.precision);
}

/// AttentionOptions from the keywords of the single-head kernels. `precision` selects how
/// bfloat16 tiles are multiplied (matrix_unit_for); float32 and float64 inputs ignore it.
inline poslsh::AttentionOptions attention_options(poslsh::Masking masking,
                                                  std::optional<double> scale,
                                                  std::optional<Index> query_offset,
                                                  poslsh::Precision precision) {
  poslsh::AttentionOptions options{masking, scale};
  options.query_offset = query_offset;
  options.precision = precision;
  return options;
}

/// A HashSet argument (TypeError if it is not one).
inline const poslsh::HashSet& hash_set(py::handle object, const char* function) {
  if (!py::isinstance<poslsh::HashSet>(object)) {
    throw py::type_error(argument(function, "hashes") + " must be a poslsh.HashSet, got " +
                         type_name(object));
  }
  return object.cast<const poslsh::HashSet&>();
}

/// The value a kernel takes for a positional parameter of its binding: the HashSet of a
/// `hashes` argument, the number itself otherwise. Called with the GIL held.
inline const poslsh::HashSet& parameter_value(py::handle hashes, const char* function) {
  return hash_set(hashes, function);
}
inline double parameter_value(double value, const char*) { return value; }
inline Index parameter_value(Index value, const char*) { return value; }

/// The Python type of a single-head kernel's parameter (poslsh::SigmaParameter, BandParameter,
/// HashesParameter): the number itself, or the handle of a poslsh.HashSet (parameter_value
/// gives the set).
template <typename Parameter>
using python_parameter_t =
    std::conditional_t<std::is_same_v<typename Parameter::type, poslsh::HashSet>, py::handle,
                       typename Parameter::type>;

/// The docstring part of `method` in a table of (method, text) pairs; a method the table does
/// not name (a new row of the method table) gets a line naming its function and method.
template <typename Method, std::size_t N>
std::string method_doc(const std::pair<Method, const char*> (&docs)[N], Method method,
                       const char* function) {
  for (const auto& [key, doc] : docs) {
    if (key == method) return doc;
  }
  return std::string("\n") + function + ": the single-head kernel of method '" +
         poslsh::enum_name(method) + "'.\n";
}

/// The names of an enum's table (EnumNames<Enum>::table), in declaration order.
template <typename Enum>
std::vector<std::string> enum_names() {
  std::vector<std::string> names;
  for (const auto& entry : poslsh::EnumNames<Enum>::table) names.emplace_back(entry.name);
  return names;
}

// One function per binding file, called by module.cpp.
void register_dtypes(py::module_& module);
void register_lsh(py::module_& module);
void register_attention(py::module_& module);
void register_multihead(py::module_& module);
void register_training(py::module_& module);
void register_paged(py::module_& module);
void register_interop(py::module_& module);
void register_planner(py::module_& module);
void register_parallel(py::module_& module);
void register_kv_cache(py::module_& module);
void register_analysis(py::module_& module);

}  // namespace poslsh_python
