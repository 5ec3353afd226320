// poslsh Python bindings: half-precision arrays. numpy float16 arrays are Eigen::half (both IEEE
// binary16, read in place); bfloat16 values, which numpy has no dtype for, come as
// poslsh.BFloat16Bits, an explicit wrapper of an int16 or uint16 array holding the bit
// patterns (the upper 16 bits of the float32 values; e.g. torch's bfloat16 tensor viewed as
// int16). Integer arrays are never read as floats anywhere else.
//
// Combinations (q, k and v, out), each computed in float by the library's kernels:
//   float16  q, k, v -> float16 out (default) or float32 out (an `out=` float32 array);
//   bfloat16 q, k, v -> bfloat16 out (default) or float32 out;
//   float32 q over float16 or bfloat16 k, v -> float32 out.
// float64 never mixes with half precision (TypeError, as any other dtype mismatch).
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.hpp"
#include "heads.hpp"

namespace poslsh_python {

/// bfloat16 values as their bit patterns: a native int16 or uint16 ndarray, shared (no copy).
struct BFloat16Bits {
  py::array bits;
};

/// The storage type of a kernel argument as the half-precision bindings see it.
enum class Storage { none, other, float32, float16, bfloat16 };

inline bool has_native_dtype(const py::array& array, char code) {
  const py::dtype dtype = array.dtype();
  return dtype.char_() == code && dtype.attr("isnative").cast<bool>();
}

inline Storage storage_of(py::handle object) {
  if (object.is_none()) return Storage::none;
  if (py::isinstance<BFloat16Bits>(object)) return Storage::bfloat16;
  if (!py::isinstance<py::array>(object)) return Storage::other;
  if (py::isinstance<py::array_t<float>>(object)) return Storage::float32;
  const auto array = py::reinterpret_borrow<py::array>(object);
  if (has_native_dtype(array, 'e')) return Storage::float16;
  return Storage::other;
}

/// True when a call takes the half-precision path: q is float16 or BFloat16Bits, or q is float32
/// and k float16 or BFloat16Bits. Every other call keeps the float32/float64 rules.
inline bool half_call(py::handle q, py::handle k) {
  const Storage sq = storage_of(q);
  if (sq == Storage::float16 || sq == Storage::bfloat16) return true;
  const Storage sk = storage_of(k);
  return sq == Storage::float32 && (sk == Storage::float16 || sk == Storage::bfloat16);
}

inline const char* storage_name(Storage storage) {
  switch (storage) {
    case Storage::float32:
      return "float32";
    case Storage::float16:
      return "float16";
    case Storage::bfloat16:
      return "bfloat16 (poslsh.BFloat16Bits)";
    default:
      return "?";
  }
}

/// "dtype float64", "bfloat16 (poslsh.BFloat16Bits)", ... of an argument, for messages;
/// TypeError naming it when it is neither an ndarray nor BFloat16Bits.
inline std::string describe(py::handle object, const char* function, const char* name) {
  if (py::isinstance<BFloat16Bits>(object)) return "is bfloat16 (poslsh.BFloat16Bits)";
  return "has dtype " + dtype_name(require_array(object, function, name));
}

/// The ndarray holding an argument of storage S (the bit array of BFloat16Bits).
template <typename S>
py::array storage_array(py::handle object) {
  if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
    return object.cast<const BFloat16Bits&>().bits;
  } else {
    return py::reinterpret_borrow<py::array>(object);
  }
}

/// The ndarray of an argument: the bit array of a BFloat16Bits, or the argument itself
/// (TypeError naming it if it is not an ndarray).
inline py::array array_or_bits(py::handle object, const char* function, const char* name) {
  if (py::isinstance<BFloat16Bits>(object)) return object.cast<const BFloat16Bits&>().bits;
  return require_array(object, function, name);
}

/// `array` (a view of the ndarray of `like`) wrapped as `like` is: BFloat16Bits or plain.
inline py::object wrapped_like(py::handle like, const py::object& array) {
  if (py::isinstance<BFloat16Bits>(like)) return py::cast(BFloat16Bits{array});
  return array;
}

/// A new C-contiguous output of storage S and the given shape (BFloat16Bits over uint16).
template <typename S>
std::pair<py::object, py::array> new_storage(const std::vector<py::ssize_t>& shape) {
  if constexpr (std::is_same_v<S, float>) {
    py::array array = py::array_t<float>(shape);
    return {array, array};
  } else if constexpr (std::is_same_v<S, Eigen::half>) {
    py::array array(py::dtype("float16"), shape);
    return {array, array};
  } else {
    py::array array(py::dtype("uint16"), shape);
    return {py::cast(BFloat16Bits{array}), array};
  }
}

/// Calls run(Tag<Q>{}, Tag<KV>{}, Tag<Out>{}) for the storage of q, k, v and out (None: the
/// default output) after the rules in the file comment; TypeError naming the first argument
/// that breaks them.
/// Argument names of q, k, v in messages (the decoders call them query, keys, values).
struct HalfNames {
  const char* q = "q";
  const char* k = "k";
  const char* v = "v";
};

template <typename Run>
py::object dispatch_half(const char* function, py::handle q, py::handle k, py::handle v,
                         py::handle out, const HalfNames& names, Run&& run) {
  const Storage sq = storage_of(q), sk = storage_of(k), sv = storage_of(v), so = storage_of(out);
  const auto wrong = [&](py::handle object, const char* name, const std::string& rule) {
    return py::type_error(argument(function, name) + " " + describe(object, function, name) + ": " +
                          rule + " (arrays are never converted)");
  };
  const auto same_half = [&](auto tag) -> py::object {
    using H = typename decltype(tag)::type;
    const std::string like = std::string("must be ") + storage_name(sq) + " like '" + names.q + "'";
    if (sk != sq) throw wrong(k, names.k, like);
    if (sv != sq) throw wrong(v, names.v, like);
    if (so == Storage::none || so == sq) return run(Tag<H>{}, Tag<H>{}, Tag<H>{});
    if (so == Storage::float32) return run(Tag<H>{}, Tag<H>{}, Tag<float>{});
    throw wrong(out, "out",
                std::string("must be ") + storage_name(sq) + " or float32 for " + storage_name(sq) +
                    " 'q'");
  };
  const auto mixed = [&](auto tag) -> py::object {
    using H = typename decltype(tag)::type;
    if (sv != sk) {
      throw wrong(v, names.v,
                  std::string("must be ") + storage_name(sk) + " like '" + names.k + "'");
    }
    if (so == Storage::none || so == Storage::float32) {
      return run(Tag<float>{}, Tag<H>{}, Tag<float>{});
    }
    throw wrong(out, "out",
                std::string("must be float32: float32 '") + names.q + "' over " + storage_name(sk) +
                    " '" + names.k + "', '" + names.v + "' gives float32");
  };
  if (sq == Storage::float16) return same_half(Tag<Eigen::half>{});
  if (sq == Storage::bfloat16) return same_half(Tag<Eigen::bfloat16>{});
  if (sk == Storage::float16) return mixed(Tag<Eigen::half>{});
  return mixed(Tag<Eigen::bfloat16>{});
}

/// Checks an `out` argument of storage S (already matched by dispatch_half): writable and
/// sharing no memory with the input arrays; returns its ndarray.
template <typename S>
py::array checked_out(py::handle out, const char* function, const char* name,
                      std::initializer_list<std::pair<py::handle, const char*>> inputs) {
  py::array array = storage_array<S>(out);
  if (!array.writeable()) throw py::value_error(argument(function, name) + " is read-only");
  require_no_overlap(array, function, inputs, name);
  return array;
}

/// exact_reference is self-attention only, and the library checks that inside its parallel
/// loop over heads, where an exception cannot leave the loop: checked here first.
inline void require_reference_self_attention(const char* function,
                                             const poslsh::MultiHeadOptions& options, Index queries,
                                             Index keys, Index offset) {
  if (options.method != poslsh::Method::exact_reference) return;
  if (queries != keys || offset != 0) {
    throw py::value_error(argument(function, "method") +
                          " = 'exact_reference': self-attention only (every sequence with as "
                          "many query as key tokens, query offset 0); got " +
                          std::to_string(queries) + " queries over " + std::to_string(keys) +
                          " keys at offset " + std::to_string(offset));
  }
}

/// Read-only (rows x cols) view of an argument of storage S, no copy.
template <typename S>
InputMap<S> half_input(py::handle object, const char* function, const char* name) {
  const py::array array = storage_array<S>(object);
  if (array.ndim() != 2) {
    throw py::value_error(argument(function, name) + " has " + std::to_string(array.ndim()) +
                          " dimensions: must be a 2-D array (rows, columns)");
  }
  const Index stride = row_stride_of<S>(array, function, name);
  return InputMap<S>(static_cast<const S*>(array.data()), static_cast<Index>(array.shape(0)),
                     static_cast<Index>(array.shape(1)), Eigen::OuterStride<>(stride));
}

/// Maps q, k, v, prepares the output (q.rows() x v.cols(), storage chosen by dispatch_half),
/// then runs kernel(q, k, v, out) on typed maps without the GIL; returns the output.
template <typename Kernel>
py::object half_qkv_call(const char* function, py::handle q, py::handle k, py::handle v,
                         py::handle out, std::optional<int> threads, Kernel&& kernel,
                         HalfNames names = {}) {
  threads = thread_count(threads, function);
  return dispatch_half(function, q, k, v, out, names, [&](auto q_tag, auto kv_tag, auto out_tag) {
    using Q = typename decltype(q_tag)::type;
    using KV = typename decltype(kv_tag)::type;
    using Out = typename decltype(out_tag)::type;
    const InputMap<Q> q_map = half_input<Q>(q, function, names.q);
    const InputMap<KV> k_map = half_input<KV>(k, function, names.k);
    const InputMap<KV> v_map = half_input<KV>(v, function, names.v);
    const py::array q_array = storage_array<Q>(q), k_array = storage_array<KV>(k),
                    v_array = storage_array<KV>(v);
    py::object result;
    py::array array;
    if (out.is_none()) {
      std::tie(result, array) = new_storage<Out>(
          {static_cast<py::ssize_t>(q_map.rows()), static_cast<py::ssize_t>(v_map.cols())});
    } else {
      array = storage_array<Out>(out);
      if (array.ndim() != 2 || array.shape(0) != q_map.rows() || array.shape(1) != v_map.cols()) {
        std::string shape;
        for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
          shape += (axis ? ", " : "") + std::to_string(array.shape(axis));
        }
        throw py::value_error(argument(function, "out") + " has shape (" + shape + "): must be (" +
                              std::to_string(q_map.rows()) + ", " + std::to_string(v_map.cols()) +
                              ")");
      }
      checked_out<Out>(out, function, "out",
                       {{q_array, names.q}, {k_array, names.k}, {v_array, names.v}});
      result = py::reinterpret_borrow<py::object>(out);
    }
    const Index stride = row_stride_of<Out>(array, function, "out");
    OutputMap<Out> out_map(static_cast<Out*>(array.mutable_data()),
                           static_cast<Index>(array.shape(0)), static_cast<Index>(array.shape(1)),
                           Eigen::OuterStride<>(stride));
    {
      KernelScope scope(threads);
      kernel(q_tag, kv_tag, out_tag, q_map, k_map, v_map, out_map);
    }
    return result;
  });
}

// The half-precision forms of the kernels that take half-precision views; called by the
// ordinary bindings when half_call(q, k) holds (half.cpp, half_multihead.cpp).
py::object half_alibi_attention_tiled(py::handle q, py::handle k, py::handle v, double sigma,
                                      const poslsh::AttentionOptions& options, py::handle out,
                                      std::optional<int> threads);
py::object half_alibi_attention_banded(py::handle q, py::handle k, py::handle v, double sigma,
                                       Index band, const poslsh::AttentionOptions& options,
                                       py::handle out, std::optional<int> threads);
py::object half_lsh_attention_fused(py::handle q, py::handle k, py::handle v,
                                    const poslsh::HashSet& hashes,
                                    const poslsh::AttentionOptions& options, py::handle out,
                                    std::optional<int> threads);
py::object half_lsh_attention_per_sample(py::handle q, py::handle k, py::handle v,
                                         const poslsh::HashSet& hashes,
                                         const poslsh::AttentionOptions& options, py::handle out,
                                         std::optional<int> threads);
py::object half_fixed_blocks_attention(py::handle q, py::handle k, py::handle v, double sigma,
                                       const poslsh::AttentionOptions& options, py::handle out,
                                       std::optional<int> threads);
py::object half_lsh_attention_decode(py::handle query, py::handle keys, py::handle values, Index t,
                                     const poslsh::HashSet& hashes,
                                     const poslsh::AttentionOptions& options, py::handle out);
py::object half_alibi_attention_decode_exact(py::handle query, py::handle keys, py::handle values,
                                             Index t, double sigma,
                                             const poslsh::AttentionOptions& options,
                                             py::handle out);
py::object half_multihead_attention(py::handle q, py::handle k, py::handle v, const Layout& layout,
                                    const poslsh::MultiHeadOptions& options, py::handle out,
                                    std::optional<int> threads);
py::object half_multihead_attention_varlen(py::handle q, py::handle k, py::handle v,
                                           const Layout& layout,
                                           const poslsh::MultiHeadOptions& options,
                                           const std::vector<std::int32_t>& cu_seqlens_q,
                                           const std::vector<std::int32_t>& cu_seqlens_k,
                                           const std::vector<Index>& query_offsets, py::handle out,
                                           std::optional<int> threads);

}  // namespace poslsh_python
