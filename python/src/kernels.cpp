// poslsh Python bindings: the single-head attention kernels and the decoders.
#include <exception>

#include "common.hpp"
#include "half.hpp"
#include "poslsh/attention/banded.hpp"
#include "poslsh/attention/decode.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/attention/per_sample.hpp"
#include "poslsh/reference/attention.hpp"
#include "poslsh/attention/tiled.hpp"
#include "rows.hpp"

namespace poslsh_python {

namespace {

using Inputs = std::initializer_list<std::pair<py::handle, const char*>>;

struct QkvNames {
  const char* q = "q";
  const char* k = "k";
  const char* v = "v";
};

/// Maps q, k, v (dtype of q), prepares the output (q.rows() x v.cols()), then runs
/// kernel(tag, q, k, v, out) without the GIL. Returns the output array.
template <typename Kernel>
py::array qkv_call(const char* function, py::handle q, py::handle k, py::handle v, py::handle out,
                   std::optional<int> threads, Kernel&& kernel, QkvNames names = {}) {
  threads = thread_count(threads, function);
  const py::array first = require_array(q, function, names.q);
  return dispatch(first, function, names.q, [&](auto tag) -> py::array {
    using T = typename decltype(tag)::type;
    const InputMap<T> q_map = input_matrix<T>(q, function, names.q, names.q);
    const InputMap<T> k_map = input_matrix<T>(k, function, names.k, names.q);
    const InputMap<T> v_map = input_matrix<T>(v, function, names.v, names.q);
    py::array result = output_array<T>(out, q_map.rows(), v_map.cols(), function, names.q,
                                       Inputs{{q, names.q}, {k, names.k}, {v, names.v}});
    OutputMap<T> out_map = output_matrix<T>(result, function);
    {
      KernelScope scope(threads);
      kernel(tag, q_map, k_map, v_map, out_map);
    }
    return result;
  });
}

poslsh::AttentionOptions attention_options(bool causal, std::optional<double> scale,
                                           std::optional<Index> query_offset = std::nullopt) {
  poslsh::AttentionOptions options{masking_of(causal), scale};
  options.query_offset = query_offset;
  return options;
}

const char* const qkv_doc_tail = R"doc(
q: [n, d], k: [n, d], v: [n, d_v] numpy arrays of one dtype (float32 or float64), last axis
contiguous, any row stride (e.g. q[:, h, :] of an [n, H, d] buffer), never copied or converted.
causal: keep keys j <= i (default) or all keys. scale: tau, None means 1/sqrt(d).
out: optional [n, d_v] array of the same dtype written in place (any row stride) and returned;
a new array otherwise. num_threads: OpenMP threads for this call (None: the OpenMP default).
The GIL is released while the kernel runs. Bad arguments raise ValueError (the library's
message) or TypeError (dtype, non-array).)doc";

const char* const half_doc = R"doc(
Half precision (computed in float32, read in place): q, k, v all float16 -> float16 output,
or float32 when out= is a float32 array; q, k, v all poslsh.BFloat16Bits (bfloat16 bit
patterns) -> BFloat16Bits output, or float32 with a float32 out=; float32 q over float16 or
BFloat16Bits k, v -> float32. A half-precision output is the float32 result rounded once (to
nearest even). float64 never mixes with half precision (TypeError).)doc";

std::string with_tail(const char* head) { return std::string(head) + qkv_doc_tail; }

const char* const offset_doc = R"doc(
query_offset: position p0 of q's first row. q may have m <= L rows over the L rows of k and
v: row r is the query at position p0 + r (causal: keys j <= p0 + r; the position terms use
i = p0 + r), and is bitwise row p0 + r of the call on all L positions, so a prompt prefilled
in chunks gives the rows of one prefill. None (default): p0 = L - m (bottom-right; 0 for
self-attention). Requires 0 <= p0 <= L - m.)doc";

std::string with_offset_tail(const char* head) {
  return std::string(head) + qkv_doc_tail + offset_doc;
}

std::string with_half_tail(const char* head) { return with_offset_tail(head) + half_doc; }

}  // namespace

void bind_kernels(py::module_& module) {
  using poslsh::Index;

  module.def(
      "alibi_attention_tiled",
      [](py::handle q, py::handle k, py::handle v, double sigma, bool causal,
         std::optional<double> scale, std::optional<Index> query_offset, py::handle out,
         std::optional<int> threads) {
        constexpr const char* function = "alibi_attention_tiled";
        const auto options = attention_options(causal, scale, query_offset);
        if (half_call(q, k)) {
          return half_alibi_attention_tiled(q, k, v, sigma, options, out, threads);
        }
        return py::object(qkv_call(
            function, q, k, v, out, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om) {
              using T = typename decltype(tag)::type;
              // Same checks and messages as alibi_attention_tiled, then row tiles
              // in parallel (bitwise the single-threaded result).
              const Index p0 = poslsh::detail::require_exact_arguments<T>(
                  function, qm, km, vm, sigma, 0, qm.rows(), om, options);
              poslsh::detail::resolve_scale(function, options, qm.cols());
              parallel_rows(qm.rows(), p0, [&](Index begin, Index end) {
                poslsh::alibi_attention_tiled_rows<T>(qm, km, vm, sigma, begin, end,
                                                      om.middleRows(begin, end - begin), options);
              });
            }));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("query_offset") = py::none(),
      py::arg("out") = py::none(), py::arg("num_threads") = py::none(),
      with_half_tail(R"doc(Exact ALiBi attention, streamed in tiles (O(n d) memory):

    T* = softmax(tau Q K^T - |i-j| / sigma) V   (row-wise; causal keeps j <= i)

Query tiles of 64 rows run in parallel.
)doc")
          .c_str());

  module.def(
      "alibi_attention_reference",
      [](py::handle q, py::handle k, py::handle v, double sigma, bool causal,
         std::optional<double> scale, py::handle out, std::optional<int> threads) {
        const auto options = attention_options(causal, scale);
        return qkv_call("alibi_attention_reference", q, k, v, out, threads,
                        [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om) {
                          using T = typename decltype(tag)::type;
                          poslsh::alibi_attention_reference<T>(qm, km, vm, sigma, om, options);
                        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("out") = py::none(),
      py::arg("num_threads") = py::none(),
      with_tail(R"doc(Naive exact ALiBi attention (builds the n x n scores; for checks):

    T* = softmax(tau Q K^T - |i-j| / sigma) V
)doc")
          .c_str());

  module.def(
      "alibi_attention_banded",
      [](py::handle q, py::handle k, py::handle v, double sigma, Index band, bool causal,
         std::optional<double> scale, std::optional<Index> query_offset, py::handle out,
         std::optional<int> threads) {
        constexpr const char* function = "alibi_attention_banded";
        const auto options = attention_options(causal, scale, query_offset);
        if (half_call(q, k)) {
          return half_alibi_attention_banded(q, k, v, sigma, band, options, out, threads);
        }
        return py::object(qkv_call(
            function, q, k, v, out, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om) {
              using T = typename decltype(tag)::type;
              const Index p0 = poslsh::detail::require_exact_arguments<T>(
                  function, qm, km, vm, sigma, 0, qm.rows(), om, options);
              poslsh::detail::require_size(band, function, "band");
              poslsh::detail::resolve_scale(function, options, qm.cols());
              parallel_rows(qm.rows(), p0, [&](Index begin, Index end) {
                poslsh::alibi_attention_banded_rows<T>(qm, km, vm, sigma, band, begin, end,
                                                       om.middleRows(begin, end - begin), options);
              });
            }));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::arg("band"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("query_offset") = py::none(),
      py::arg("out") = py::none(), py::arg("num_threads") = py::none(),
      with_half_tail(R"doc(Exact ALiBi attention on the keys with |i - j| <= band only:

    out_i = sum_{|i-j|<=band} e^{x_ij} v_j / sum_{|i-j|<=band} e^{x_ij},
    x_ij = tau q_i.k_j - |i-j| / sigma

band = band_for_bias_error(sigma, eps) drops only kernel entries exp(-|i-j|/sigma) < eps.
)doc")
          .c_str());

  module.def(
      "lsh_attention_fused",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, bool causal,
         std::optional<double> scale, std::optional<Index> query_offset, py::handle out,
         std::optional<int> threads) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_fused");
        const auto options = attention_options(causal, scale, query_offset);
        if (half_call(q, k)) return half_lsh_attention_fused(q, k, v, set, options, out, threads);
        return py::object(
            qkv_call("lsh_attention_fused", q, k, v, out, threads,
                     [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om) {
                       using T = typename decltype(tag)::type;
                       poslsh::lsh_attention_fused<T>(qm, km, vm, set, om, options);
                     }));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("query_offset") = py::none(),
      py::arg("out") = py::none(), py::arg("num_threads") = py::none(),
      with_half_tail(R"doc(Fused, count-weighted LSH ALiBi attention (each pair evaluated once):

    T~ = D~^-1 (A o M~) V,  A_ij = exp(tau q_i.k_j),  M~ = C / s,
    c_ij = #{k : bin_k(i) = bin_k(j)}  (causal: j <= i),  D~ = diag((A o M~) 1)

i.e. softmax(tau Q K^T + log M~) V, with E[M~] = L* = exp(-|i-j| / sigma).
)doc")
          .c_str());

  module.def(
      "lsh_attention_per_sample",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, bool causal,
         std::optional<double> scale, std::optional<Index> query_offset, py::handle out,
         std::optional<int> threads) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_per_sample");
        const auto options = attention_options(causal, scale, query_offset);
        if (half_call(q, k)) {
          return half_lsh_attention_per_sample(q, k, v, set, options, out, threads);
        }
        return py::object(
            qkv_call("lsh_attention_per_sample", q, k, v, out, threads,
                     [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om) {
                       using T = typename decltype(tag)::type;
                       poslsh::lsh_attention_per_sample<T>(qm, km, vm, set, om, options);
                     }));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("query_offset") = py::none(),
      py::arg("out") = py::none(), py::arg("num_threads") = py::none(),
      with_half_tail(
          R"doc(The paper's per-sample LSH attention: plain attention inside every block of
every sample, numerators and denominators summed over samples. Same estimator as
lsh_attention_fused:

    T~ = D~^-1 (A o M~) V,  M~ = (1/s) sum_k M(h_k)
)doc")
          .c_str());

  module.def(
      "fixed_blocks_attention",
      [](py::handle q, py::handle k, py::handle v, double sigma, bool causal,
         std::optional<double> scale, std::optional<Index> query_offset, py::handle out,
         std::optional<int> threads) {
        const auto options = attention_options(causal, scale, query_offset);
        if (half_call(q, k)) {
          return half_fixed_blocks_attention(q, k, v, sigma, options, out, threads);
        }
        return py::object(
            qkv_call("fixed_blocks_attention", q, k, v, out, threads,
                     [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om) {
                       using T = typename decltype(tag)::type;
                       poslsh::fixed_blocks_attention<T>(qm, km, vm, sigma, om, options);
                     }));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("query_offset") = py::none(),
      py::arg("out") = py::none(), py::arg("num_threads") = py::none(),
      with_half_tail(R"doc(The fixed-blocks baseline: plain attention inside consecutive blocks of
2 sigma tokens from position 0 (lsh_attention_per_sample with fixed_blocks_hash(sigma)).
)doc")
          .c_str());

  // Decoders: one query (a [d] array) at position t, or m queries ([m, d]) at t - m + 1 .. t,
  // over the cache rows.
  // half_kernel(query_row, keys, values, out_row, options) runs half-precision calls.
  const auto decode = [](const char* function, py::handle query, py::handle keys, py::handle values,
                         py::handle out, std::optional<double> scale, auto&& kernel,
                         auto&& half_kernel) -> py::object {
    const py::array query_array = array_or_bits(query, function, "query");
    const bool vector = query_array.ndim() == 1;
    const auto as_row = [&](py::handle object, const char* name) -> py::object {
      if (object.is_none()) return py::none();
      const py::array array = array_or_bits(object, function, name);
      if (array.ndim() != 1) return py::reinterpret_borrow<py::object>(object);
      if (array.shape(0) > 1 && array.strides(0) != array.itemsize()) {
        throw py::value_error(argument(function, name) + " must be contiguous (stride " +
                              std::to_string(array.itemsize()) + " bytes), has stride " +
                              std::to_string(array.strides(0)));
      }
      return wrapped_like(object, array.attr("reshape")(1, -1));  // a view: the axis is contiguous
    };
    if (vector && !out.is_none() && array_or_bits(out, function, "out").ndim() != 1) {
      throw py::value_error(argument(function, "out") + " must be 1-D like 'query'");
    }
    const py::object query_row = as_row(query, "query");
    const py::object out_row = as_row(out, "out");
    const poslsh::AttentionOptions options{poslsh::Masking::causal, scale};
    py::object result;
    if (half_call(query_row, keys)) {
      result = half_kernel(query_row, keys, values, out_row, options);
    } else {
      result = qkv_call(
          function, query_row, keys, values, out_row, std::nullopt,
          [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om) {
            kernel(tag, qm, km, vm, om, options);
          },
          QkvNames{"query", "keys", "values"});
    }
    if (!out.is_none()) return py::reinterpret_borrow<py::object>(out);
    if (vector) {
      return wrapped_like(result, array_or_bits(result, function, "out").attr("reshape")(-1));
    }
    return result;
  };

  module.def(
      "lsh_attention_decode",
      [decode](py::handle query, py::handle keys, py::handle values, Index t, py::handle hashes,
               std::optional<double> scale, py::handle out) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_decode");
        return decode(
            "lsh_attention_decode", query, keys, values, out, scale,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om,
                const poslsh::AttentionOptions& options) {
              using T = typename decltype(tag)::type;
              poslsh::lsh_attention_decode<T>(qm, km, vm, t, set, om, options);
            },
            [&](py::handle qr, py::handle kr, py::handle vr, py::handle outr,
                const poslsh::AttentionOptions& options) {
              return half_lsh_attention_decode(qr, kr, vr, t, set, options, outr);
            });
      },
      py::arg("query"), py::arg("keys"), py::arg("values"), py::arg("t"), py::arg("hashes"),
      py::kw_only(), py::arg("scale") = py::none(), py::arg("out") = py::none(), R"doc(
LSH decode: row t of the causal lsh_attention_fused, from the query q_t alone,

    out = sum_{j<=t} c_tj e^{tau q_t.k_j} v_j / sum_{j<=t} c_tj e^{tau q_t.k_j},
    c_tj = #{k : bin_k(t) = bin_k(j)}

reading only the keys of t's blocks: cost independent of t. query: [d] (one query at t) or
[m, d] (m <= t + 1 queries at positions t - m + 1 .. t, each row decoded at its position);
keys [N, d] and values [N, d_v] with N > t (the KV cache; rows after t are not read). The
result has the shape of query ([d_v] or [m, d_v]). Half precision as the prefill kernels:
float16 (or BFloat16Bits) query, keys, values -> the same type (or float32 out=); float32 query
over a float16 or BFloat16Bits cache -> float32; computed in float32.
)doc");

  module.def(
      "alibi_attention_decode_exact",
      [decode](py::handle query, py::handle keys, py::handle values, Index t, double sigma,
               std::optional<double> scale, py::handle out) {
        return decode(
            "alibi_attention_decode_exact", query, keys, values, out, scale,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om,
                const poslsh::AttentionOptions& options) {
              using T = typename decltype(tag)::type;
              poslsh::alibi_attention_decode_exact<T>(qm, km, vm, t, sigma, om, options);
            },
            [&](py::handle qr, py::handle kr, py::handle vr, py::handle outr,
                const poslsh::AttentionOptions& options) {
              return half_alibi_attention_decode_exact(qr, kr, vr, t, sigma, options, outr);
            });
      },
      py::arg("query"), py::arg("keys"), py::arg("values"), py::arg("t"), py::arg("sigma"),
      py::kw_only(), py::arg("scale") = py::none(), py::arg("out") = py::none(), R"doc(
Exact ALiBi decode, O(t d):

    out = softmax_j(tau q_t.k_j - (t - j) / sigma) v_j  over j = 0..t

(row r of an [m, d] query: the same at position t - m + 1 + r). Shapes as lsh_attention_decode.
)doc");
}

}  // namespace poslsh_python
