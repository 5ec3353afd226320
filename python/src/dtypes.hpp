// poslsh Python bindings: the storage types of array arguments and the one dispatch from the
// arguments' dtypes to the scalar types of a kernel call.
//
// Storage types: numpy float32, float64 and float16 arrays (float, double, Eigen::half, read in
// place), and bfloat16, which numpy has no dtype for, as poslsh.BFloat16Bits: an explicit
// wrapper of an int16 or uint16 array holding the bit patterns (the upper 16 bits of the
// float32 values; e.g. torch's bfloat16 tensor viewed as int16). Integer arrays are read as
// bfloat16 only through that wrapper. Arrays are never converted: a dtype outside the rules is
// a TypeError naming the argument.
//
// Every binding takes float32 or float64 arrays, all of q's dtype. The bindings of kernels with
// half-precision forms (dispatch<DtypeSet::with_half>) also take, with float sums and softmax (the
// products of bfloat16 q, k, v on the CPU's matrix unit under the `precision` keyword's
// "matrix_units", widened to float otherwise):
//   float16  q, k, v -> float16 out (default) or float32 out (an `out=` float32 array);
//   bfloat16 q, k, v -> bfloat16 out (default) or float32 out;
//   float32 q over float16 or bfloat16 k, v -> float32 out.
// float64 never mixes with half precision.
#pragma once

#include <Eigen/Core>
#include <string>
#include <type_traits>

#include "common.hpp"

namespace poslsh_python {

/// bfloat16 values as their bit patterns: a native int16 or uint16 ndarray, shared (no copy).
struct BFloat16Bits {
  py::array bits;
};

/// The scalar types of a call: Q of q, KV of k and v, Out of the output.
template <typename Q, typename KV = Q, typename Out = Q>
struct Types {
  using q = Q;
  using kv = KV;
  using out = Out;
};

/// Which dtypes a binding takes: float32 and float64 only, or half precision too.
enum class DtypeSet { full_precision, with_half };

/// Names of q, k and v in messages (the decoders call them query, keys, values).
struct Names {
  const char* q = "q";
  const char* k = "k";
  const char* v = "v";
};

/// The arguments whose dtypes decide a call's types (k, v and out are read by
/// dispatch<DtypeSet::with_half> only).
struct Operands {
  py::handle q;
  py::handle k{Py_None};
  py::handle v{Py_None};
  py::handle out{Py_None};
};

/// numpy's dtype name of a storage type (uint16 holds bfloat16 bit patterns).
template <typename S>
const char* numpy_dtype() {
  if constexpr (std::is_same_v<S, float>) {
    return "float32";
  } else if constexpr (std::is_same_v<S, double>) {
    return "float64";
  } else if constexpr (std::is_same_v<S, Eigen::half>) {
    return "float16";
  } else {
    static_assert(std::is_same_v<S, Eigen::bfloat16>, "float, double, Eigen::half or bfloat16");
    return "uint16";
  }
}

/// The name of a storage type in messages.
template <typename S>
std::string storage_name() {
  if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
    return "bfloat16 (poslsh.BFloat16Bits)";
  } else {
    return numpy_dtype<S>();
  }
}

/// True when the dtype of `array` has the type code `code` in native byte order.
inline bool has_native_dtype(const py::array& array, char code) {
  const py::dtype dtype = array.dtype();
  return dtype.char_() == code && dtype.attr("isnative").cast<bool>();
}

/// True when `object` is an argument of storage type S: a BFloat16Bits for bfloat16, else an
/// ndarray of S's dtype in native byte order.
template <typename S>
bool is_storage(py::handle object) {
  if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
    return py::isinstance<BFloat16Bits>(object);
  } else {
    constexpr char code = std::is_same_v<S, float> ? 'f' : (std::is_same_v<S, double> ? 'd' : 'e');
    return py::isinstance<py::array>(object) &&
           has_native_dtype(py::reinterpret_borrow<py::array>(object), code);
  }
}

/// "has dtype float64", "is bfloat16 (poslsh.BFloat16Bits)" of an argument, for messages;
/// TypeError naming it when it is neither an ndarray nor BFloat16Bits.
inline std::string describe(py::handle object, const char* function, const char* name) {
  if (py::isinstance<BFloat16Bits>(object)) return "is " + storage_name<Eigen::bfloat16>();
  return "has dtype " + dtype_name(require_array(object, function, name));
}

/// The ndarray of an argument of storage S (the bit array of a BFloat16Bits); TypeError naming
/// the argument, and the argument `like` whose type it must have, otherwise.
template <typename S>
py::array storage_array(py::handle object, const char* function, const char* name,
                        const char* like) {
  if (!is_storage<S>(object)) {
    throw py::type_error(argument(function, name) + " " + describe(object, function, name) +
                         ": must be " + storage_name<S>() + " like '" + like +
                         "' (arrays are never converted)");
  }
  if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
    return object.cast<const BFloat16Bits&>().bits;
  } else {
    return py::reinterpret_borrow<py::array>(object);
  }
}

/// Calls run(Types<...>{}) with the scalar types of a call. DtypeSet::full_precision: q (named
/// names.q) is float32 or float64 T, run(Types<T>{}); the other arrays are checked against T
/// where they are read. DtypeSet::with_half also takes the half-precision combinations of the
/// file comment: Q from q, KV from k, Out from out (None: Q's type), out's dtype checked here;
/// k and v are checked where they are read. TypeError naming the argument otherwise.
template <DtypeSet P = DtypeSet::full_precision, typename Run>
decltype(auto) dispatch(const char* function, const Operands& operands, Run&& run,
                        const Names& names = {}) {
  if constexpr (P == DtypeSet::with_half) {
    const py::handle out = operands.out;
    const auto out_error = [&](const std::string& rule) {
      return py::type_error(argument(function, "out") + " " + describe(out, function, "out") +
                            ": " + rule + " (arrays are never converted)");
    };
    // q, k, v of half type H: an H output, or float32.
    const auto half_q = [&](auto types) -> py::object {
      using H = typename decltype(types)::q;
      if (out.is_none() || is_storage<H>(out)) return run(Types<H>{});
      if (is_storage<float>(out)) return run(Types<H, H, float>{});
      throw out_error("must be " + storage_name<H>() + " or float32 for " + storage_name<H>() +
                      " '" + names.q + "'");
    };
    // float32 q over k, v of half type H: a float32 output.
    const auto half_kv = [&](auto types) -> py::object {
      using H = typename decltype(types)::q;
      if (out.is_none() || is_storage<float>(out)) return run(Types<float, H, float>{});
      throw out_error(std::string("must be float32: float32 '") + names.q + "' over " +
                      storage_name<H>() + " '" + names.k + "', '" + names.v + "' gives float32");
    };
    if (is_storage<Eigen::bfloat16>(operands.q)) return half_q(Types<Eigen::bfloat16>{});
    if (is_storage<Eigen::half>(operands.q)) return half_q(Types<Eigen::half>{});
    if (is_storage<float>(operands.q)) {
      if (is_storage<Eigen::bfloat16>(operands.k)) return half_kv(Types<Eigen::bfloat16>{});
      if (is_storage<Eigen::half>(operands.k)) return half_kv(Types<Eigen::half>{});
    }
  }
  if (is_storage<float>(operands.q)) return run(Types<float>{});
  if (is_storage<double>(operands.q)) return run(Types<double>{});
  throw py::type_error(argument(function, names.q) + " " + describe(operands.q, function, names.q) +
                       ": must be float32 or float64 (arrays are never converted)");
}

/// The argument whose type k and v must have: q when they share its type, else k (float q
/// over a half-precision KV cache).
template <typename Call>
const char* kv_like(const Names& names) {
  return std::is_same_v<typename Call::q, typename Call::kv> ? names.q : names.k;
}

}  // namespace poslsh_python
