// poslsh Python bindings: the single-head attention kernels, the decoders, and the ALiBi
// parameters (slopes, length scales, band widths).
#include "poslsh/reference/attention.hpp"

#include <string>

#include "arrays.hpp"
#include "poslsh/attention/decode.hpp"
#include "poslsh/core/slopes.hpp"
#include "single_head.hpp"

namespace poslsh_python {

namespace {

const char* const qkv_doc = R"doc(
q: [m, d], k: [L, d], v: [L, d_v] numpy arrays of one dtype (float32 or float64), last axis
contiguous, any row stride (e.g. q[:, h, :] of an [n, H, d] buffer), never copied or converted.
masking: 'causal' (default, keys j <= i) or 'bidirectional' (all keys). scale: tau, None
means 1/sqrt(d).
query_offset: position p0 of q's first row. q may have m <= L rows over the L rows of k and
v: row r is the query at position p0 + r (causal: keys j <= p0 + r; the position terms use
i = p0 + r), and is bitwise row p0 + r of the call on all L positions, so a prompt prefilled
in chunks gives the rows of one prefill. None (default): p0 = L - m (bottom-right; 0 for
self-attention). Requires 0 <= p0 <= L - m.
out: optional [m, d_v] array of the same dtype written in place (any row stride) and returned;
a new array otherwise. num_threads: OpenMP threads for this call (None: the OpenMP default).
The GIL is released while the kernel runs. Bad arguments raise ValueError (the library's
message) or TypeError (dtype, non-array).
Half precision (read in place, float32 accumulation and softmax): q, k, v all float16 ->
float16 output, or float32 when out= is a float32 array; q, k, v all poslsh.BFloat16Bits
(bfloat16 bit patterns) -> BFloat16Bits output, or float32 with a float32 out=; float32 q over
float16 or BFloat16Bits k, v -> float32. A half-precision output is the float32 result rounded
once (to nearest even). float64 never mixes with half precision (TypeError).
precision: 'matrix_units' (default) or 'float_products' (ValueError otherwise). Under
'matrix_units', q, k, v all bfloat16 use the CPU's matrix unit where it has one
(matrix_unit('bfloat16', 'bfloat16') names it: 'avx512_bf16' multiplies bfloat16 pairs into
float sums, with the probabilities rounded to bfloat16 before P V); every other call, and every
call under 'float_products', widens each value to float32: the result is then bitwise the
float32 kernel on the widened inputs, rounded once. float32 and float64 inputs ignore it.)doc";

/// Binds function(q, k, v, parameters..., *, masking="causal", scale=None, query_offset=None,
/// out=None, num_threads=None, precision="matrix_units"), every dtype of dtypes.hpp, to the forward
/// of method M on (q, k, v, parameter values..., out, options); `head` is the docstring's first
/// part, `parameter_args` the py::arg of each parameter.
template <poslsh::Method M, typename... Parameters, typename... Args>
void def_prefill(py::module_& module, const char* function, const char* head,
                 const Args&... parameter_args) {
  module.def(
      function,
      [function](py::handle q, py::handle k, py::handle v, Parameters... parameters,
                 const std::string& masking, std::optional<double> scale,
                 std::optional<Index> query_offset, py::handle out, std::optional<int> threads,
                 const std::string& precision) {
        const auto options = attention_options(masking_of(masking, function), scale, query_offset,
                                               precision_of(precision, function));
        const auto call = [&](const auto&... values) {
          return qkv_call<Precision::half>(
              function, q, k, v, out, threads,
              [&](auto types, const auto& qm, const auto& km, const auto& vm, auto& om) {
                using Call = decltype(types);
                single_head<M, Pass::forward, typename Call::q, typename Call::kv,
                            typename Call::out>(qm, km, vm, values..., om, options);
              });
        };
        return call(parameter_value(parameters, function)...);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), parameter_args..., py::kw_only(),
      py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
      py::arg("query_offset") = py::none(), py::arg("out") = py::none(),
      py::arg("num_threads") = py::none(), py::arg("precision") = default_precision(),
      (std::string(head) + qkv_doc).c_str());
}

/// Binds a decoder function(query, keys, values, parameters..., *, scale=None, out=None):
/// query [d] (one query at the last position) or [m, d], computed as the [m, d] call
/// kernel(types, query, keys, values, parameter values..., out, options) (causal), every dtype
/// of dtypes.hpp; the result has the shape of query.
template <typename... Parameters, typename Kernel, typename... Args>
void def_decode(py::module_& module, const char* function, const char* doc, Kernel kernel,
                const Args&... parameter_args) {
  module.def(
      function,
      [function, kernel](py::handle query, py::handle keys, py::handle values,
                         Parameters... parameters, std::optional<double> scale,
                         py::handle out) -> py::object {
        const auto array_of = [&](py::handle object, const char* name) -> py::array {
          if (py::isinstance<BFloat16Bits>(object)) return object.cast<const BFloat16Bits&>().bits;
          return require_array(object, function, name);
        };
        const bool vector = array_of(query, "query").ndim() == 1;
        // A [d] argument as a [1, d] view (its axis is contiguous), wrapped as it came.
        const auto as_row = [&](py::handle object, const char* name) -> py::object {
          if (object.is_none()) return py::none();
          const py::array array = array_of(object, name);
          if (array.ndim() != 1) return py::reinterpret_borrow<py::object>(object);
          if (array.shape(0) > 1 && array.strides(0) != array.itemsize()) {
            throw py::value_error(argument(function, name) + " must be contiguous (stride " +
                                  std::to_string(array.itemsize()) + " bytes), has stride " +
                                  std::to_string(array.strides(0)));
          }
          py::object row = array.attr("reshape")(1, -1);
          if (py::isinstance<BFloat16Bits>(object)) return py::cast(BFloat16Bits{row});
          return row;
        };
        if (vector && !out.is_none() && array_of(out, "out").ndim() != 1) {
          throw py::value_error(argument(function, "out") + " must be 1-D like 'query'");
        }
        const poslsh::AttentionOptions options{poslsh::Masking::causal, scale};
        const auto call = [&](const auto&... arguments) {
          return qkv_call<Precision::half>(
              function, as_row(query, "query"), keys, values, as_row(out, "out"), std::nullopt,
              [&](auto types, const auto& qm, const auto& km, const auto& vm, auto& om) {
                kernel(types, qm, km, vm, arguments..., om, options);
              },
              Names{"query", "keys", "values"});
        };
        py::object result = call(parameter_value(parameters, function)...);
        if (!out.is_none()) return py::reinterpret_borrow<py::object>(out);
        if (!vector) return result;
        py::object flat = array_of(result, "out").attr("reshape")(-1);
        if (py::isinstance<BFloat16Bits>(result)) return py::cast(BFloat16Bits{flat});
        return flat;
      },
      py::arg("query"), py::arg("keys"), py::arg("values"), parameter_args..., py::kw_only(),
      py::arg("scale") = py::none(), py::arg("out") = py::none(), doc);
}

py::array double_array(const std::vector<double>& values) {
  return py::array_t<double>(static_cast<py::ssize_t>(values.size()), values.data());
}

}  // namespace

void register_attention(py::module_& module) {
  using poslsh::Method;
  def_prefill<Method::exact_tiled, double>(module, "alibi_attention_tiled", R"doc(
Exact ALiBi attention, streamed in tiles (O(n d) memory):

    T* = softmax(tau Q K^T - |i-j| / sigma) V   (row-wise; causal keeps j <= i)

Query tiles of 64 rows run in parallel.
)doc",
                                           py::arg("sigma"));
  def_prefill<Method::exact_banded, double, Index>(module, "alibi_attention_banded", R"doc(
Exact ALiBi attention on the keys with |i - j| <= band only:

    out_i = sum_{|i-j|<=band} e^{x_ij} v_j / sum_{|i-j|<=band} e^{x_ij},
    x_ij = tau q_i.k_j - |i-j| / sigma

band = band_for_bias_error(sigma, eps) drops only kernel entries exp(-|i-j|/sigma) < eps.
Query tiles of 64 rows run in parallel.
)doc",
                                                   py::arg("sigma"), py::arg("band"));
  def_prefill<Method::lsh_fused, py::handle>(module, "lsh_attention_fused", R"doc(
Fused, count-weighted LSH ALiBi attention (each pair evaluated once):

    T~ = D~^-1 (A o M~) V,  A_ij = exp(tau q_i.k_j),  M~ = C / s,
    c_ij = #{k : bin_k(i) = bin_k(j)}  (causal: j <= i),  D~ = diag((A o M~) 1)

i.e. softmax(tau Q K^T + log M~) V, with E[M~] = L* = exp(-|i-j| / sigma).
)doc",
                                             py::arg("hashes"));
  def_prefill<Method::lsh_per_sample, py::handle>(module, "lsh_attention_per_sample", R"doc(
The paper's per-sample LSH attention: plain attention inside every block of every sample,
numerators and denominators summed over samples. Same estimator as lsh_attention_fused:

    T~ = D~^-1 (A o M~) V,  M~ = (1/s) sum_k M(h_k)
)doc",
                                                  py::arg("hashes"));
  def_prefill<Method::fixed_blocks, double>(module, "fixed_blocks_attention", R"doc(
The fixed-blocks baseline: plain attention inside consecutive blocks of 2 sigma tokens from
position 0 (lsh_attention_per_sample with fixed_blocks_hash(sigma)).
)doc",
                                            py::arg("sigma"));

  module.def(
      "alibi_attention_reference",
      [](py::handle q, py::handle k, py::handle v, double sigma, const std::string& masking,
         std::optional<double> scale, py::handle out, std::optional<int> threads) {
        const poslsh::AttentionOptions options{masking_of(masking, "alibi_attention_reference"),
                                               scale};
        return qkv_call<Precision::full>(
            "alibi_attention_reference", q, k, v, out, threads,
            [&](auto types, const auto& qm, const auto& km, const auto& vm, auto& om) {
              using T = typename decltype(types)::q;
              poslsh::alibi_attention_reference<T>(qm, km, vm, sigma, om, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::kw_only(),
      py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
      py::arg("out") = py::none(), py::arg("num_threads") = py::none(),
      R"doc(Naive exact ALiBi attention (builds the n x n scores; for checks):

    T* = softmax(tau Q K^T - |i-j| / sigma) V

q, k: [n, d], v: [n, d_v], float32 or float64 (self-attention, no half precision); the other
arguments as alibi_attention_tiled.
)doc");

  def_decode<Index, py::handle>(
      module, "lsh_attention_decode", R"doc(
LSH decode: row t of the causal lsh_attention_fused, from the query q_t alone,

    out = sum_{j<=t} c_tj e^{tau q_t.k_j} v_j / sum_{j<=t} c_tj e^{tau q_t.k_j},
    c_tj = #{k : bin_k(t) = bin_k(j)}

reading only the keys of t's blocks: cost independent of t. query: [d] (one query at t) or
[m, d] (m <= t + 1 queries at positions t - m + 1 .. t, each row decoded at its position);
keys [N, d] and values [N, d_v] with N > t (the KV cache; rows after t are not read). The
result has the shape of query ([d_v] or [m, d_v]). Half precision as the prefill kernels:
float16 (or BFloat16Bits) query, keys, values -> the same type (or float32 out=); float32 query
over a float16 or BFloat16Bits cache -> float32; computed in float32.
)doc",
      [](auto types, const auto&... arguments) {
        using Call = decltype(types);
        poslsh::lsh_attention_decode<typename Call::q, typename Call::kv, typename Call::out>(
            arguments...);
      },
      py::arg("t"), py::arg("hashes"));

  def_decode<Index, double>(
      module, "alibi_attention_decode_exact", R"doc(
Exact ALiBi decode, O(t d):

    out = softmax_j(tau q_t.k_j - (t - j) / sigma) v_j  over j = 0..t

(row r of an [m, d] query: the same at position t - m + 1 + r). Shapes as lsh_attention_decode.
)doc",
      [](auto types, const auto&... arguments) {
        using Call = decltype(types);
        poslsh::alibi_attention_decode_exact<typename Call::q, typename Call::kv,
                                             typename Call::out>(arguments...);
      },
      py::arg("t"), py::arg("sigma"));

  module.def(
      "alibi_slopes",
      [](int heads, double max_bias) {
        return double_array(poslsh::alibi_slopes(heads, max_bias));
      },
      py::arg("heads"), py::kw_only(), py::arg("max_bias") = 8.0, R"doc(
ALiBi slopes m_h, h = 0..H-1 (float64 array). For H a power of two m_h = 2^(-b (h+1) / H),
b = max_bias (8: BLOOM; MPT's alibi_bias_max); otherwise Press et al.'s interleaving with the
slopes of 2p heads, p = 2^floor(log2 H).
)doc");

  module.def(
      "alibi_sigmas",
      [](int heads, double max_bias) {
        return double_array(poslsh::alibi_sigmas(heads, max_bias));
      },
      py::arg("heads"), py::kw_only(), py::arg("max_bias") = 8.0,
      "ALiBi length scales sigma_h = 1 / m_h (float64 array) of alibi_slopes(heads, max_bias=).");

  module.def("band_for_bias_error", &poslsh::band_for_bias_error, py::arg("sigma"), py::arg("eps"),
             R"doc(
Band half-width W = ceil(sigma ln(1/eps)): |i-j| > W implies exp(-|i-j| / sigma) < eps.
)doc");
}

}  // namespace poslsh_python
