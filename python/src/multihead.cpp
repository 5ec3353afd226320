// poslsh Python bindings: the method table's names and traits, multihead_attention on
// [n, H, d] or [H, n, d] arrays (each head's method from the keywords or from a plan), and its
// variable-length form on packed batches (cu_seqlens).
#include "multihead.hpp"

#include <algorithm>
#include <iterator>

#include "arrays.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/planner.hpp"
#include "poslsh/multihead/training.hpp"

namespace poslsh_python {

namespace {

/// Maps q, k, v as HeadsViews (dispatch<P>), prepares the output (m x H_q x d_v in the
/// layout), then runs kernel(types, q, k, v, out) without the GIL. Returns the output.
template <DtypeSet P, typename Kernel>
py::object heads_call(const char* function, py::handle q, py::handle k, py::handle v,
                      const Layout& layout, py::handle out, std::optional<int> threads,
                      Kernel&& kernel) {
  threads = thread_count(threads, function);
  const auto run = [&](auto types) -> py::object {
    using Call = decltype(types);
    const HeadsInputs<Call> in = heads_inputs<Call>(function, q, k, v, layout);
    auto output =
        heads_output<typename Call::out>(out, layout, in.q.tokens, in.q.heads, in.v.dim, function,
                                         "out", "q", {{q, "q"}, {k, "k"}, {v, "v"}});
    run_kernel(threads, [&] { kernel(types, in.q, in.k, in.v, output.view); });
    return output.result;
  };
  return dispatch<P>(function, {q, k, v, out}, run);
}

/// A plan sets each head's method, sigma and parameters: the keywords that would set them must
/// keep their defaults alongside plans=.
void require_plan_keywords(const char* function, const poslsh::MultiHeadOptions& options) {
  const poslsh::MultiHeadOptions defaults;
  const std::pair<bool, const char*> keywords[] = {
      {options.method == defaults.method, "method"},
      {options.sigmas.empty(), "sigmas"},
      {options.samples == defaults.samples, "samples"},
      {options.seed == defaults.seed, "seed"},
      {options.band_error == defaults.band_error, "band_error"},
      {options.window_left == -1 && options.window_right == -1, "window"}};
  for (const auto& [is_default, name] : keywords) {
    if (!is_default) {
      throw py::value_error(argument(function, name) +
                            " is set together with 'plans': a plan sets each head's method, "
                            "sigma and parameters (leave method, sigmas, samples, seed, "
                            "band_error and window at their defaults)");
    }
  }
}

/// A trait of the method table's rows (poslsh/multihead/methods.hpp, training.hpp), by its
/// Python name.
struct MethodTrait {
  const char* name;
  bool (*of)(poslsh::Method);
  const char* meaning;
};

const MethodTrait method_traits[] = {
    {"draws_hashes", poslsh::method_draws_hashes,
     "draws random hashes (the keywords samples and seed)"},
    {"takes_window", poslsh::method_takes_window, "takes a local window (the keyword window)"},
    {"has_slope_gradients", poslsh::method_has_slope_gradients,
     "has gradients in the ALiBi slopes (multihead_attention_backward's dslopes)"},
    {"has_slice_backward", poslsh::method_has_slice_backward,
     "has the gradients of a slice of queries over a slice of keys (multihead_attention_backward's "
     "query_offset=, key_offset= and cu_seqlens_k=)"},
    {"has_lse", poslsh::method_has_lse,
     "has a log-sum-exp (the calls with lse; every method but 'mean_of_outputs', the mean of s "
     "softmaxes each with its own normalizer)"},
};

/// The method named `name` (ValueError listing the names otherwise).
poslsh::Method method_of(const std::string& name, const char* function) {
  return poslsh::enum_from_name<poslsh::Method>(name, function, "method");
}

/// The methods' names and traits: method_names(**traits), method_traits(method) and
/// method_has_lse(method).
void def_method_table(py::module_& module) {
  std::string names_doc =
      "The names of the all-heads methods (poslsh::Method, the method table), in declaration "
      "order: the values of the `method` keyword. Keywords (bool) keep the methods whose trait "
      "has that value:";
  std::string traits_doc =
      "The traits of a method (a method_names() entry), a dict of bools from the method "
      "table:";
  for (const MethodTrait& trait : method_traits) {
    names_doc += std::string("\n  ") + trait.name + ": the method " + trait.meaning;
    traits_doc += std::string("\n  ") + trait.name + ": whether the method " + trait.meaning;
  }
  module.def(
      "method_names",
      [](const py::kwargs& traits) {
        constexpr const char* function = "method_names";
        std::vector<std::pair<const MethodTrait*, bool>> wanted;
        for (const auto& [key, value] : traits) {
          const std::string name = py::str(key);
          const auto* trait = std::find_if(std::begin(method_traits), std::end(method_traits),
                                           [&](const MethodTrait& t) { return name == t.name; });
          if (trait == std::end(method_traits)) {
            std::string known;
            for (const MethodTrait& t : method_traits) known += std::string(" ") + t.name;
            throw py::type_error(argument(function, name.c_str()) +
                                 " is not a method trait (the traits:" + known + ")");
          }
          if (!py::isinstance<py::bool_>(value))
            throw py::type_error(argument(function, name.c_str()) + " must be a bool, got " +
                                 type_name(value));
          wanted.emplace_back(trait, value.cast<bool>());
        }
        std::vector<std::string> names;
        for (const poslsh::Method method : poslsh::enum_values<poslsh::Method>()) {
          if (std::all_of(wanted.begin(), wanted.end(),
                          [&](const auto& w) { return w.first->of(method) == w.second; }))
            names.emplace_back(poslsh::enum_name(method));
        }
        return names;
      },
      names_doc.c_str());
  module.def(
      "method_traits",
      [](const std::string& name) {
        const poslsh::Method method = method_of(name, "method_traits");
        py::dict traits;
        for (const MethodTrait& trait : method_traits) traits[trait.name] = trait.of(method);
        return traits;
      },
      py::arg("method"), traits_doc.c_str());
  module.def(
      "method_has_lse",
      [](const std::string& name) {
        return poslsh::method_has_lse(method_of(name, "method_has_lse"));
      },
      py::arg("method"),
      "Whether the method (a method_names() entry) has a log-sum-exp: every method but "
      "'mean_of_outputs', the mean of s softmaxes each with its own normalizer. The calls with "
      "lse (multihead_attention_with_lse, multihead_attention_paged_with_lse) take the methods "
      "that have one.");
}

const char* const multihead_doc = R"doc(
Multi-head (and grouped-query) ALiBi attention, exact or by Positional LSH. For each query head
h (group G = H_q / H_kv, K/V head h // G):

    out_h = method(Q_h, K_{h//G}, V_{h//G}; sigma_h)

layout: 'nhd' (default): q is [m, H_q, d], k [L, H_kv, d], v [L, H_kv, d_v], out
[m, H_q, d_v] (KV-cache order); 'hnd': the same with the first two axes swapped ([H, n, d]).
The layout is never guessed from the shapes. Any strides on the first two axes (e.g. slices of
a packed qkv buffer), last axis contiguous; no copies.
method: a method_names() entry: 'lsh_fused' (default), 'lsh_per_sample', 'fixed_blocks',
'exact_tiled', 'exact_banded' (band_for_bias_error(sigma_h, band_error)), 'mean_of_outputs'
(the mean over samples of plain attention on each sample's blocks; no lse).
masking: 'causal' (default) or 'bidirectional'. scale: tau, None means 1/sqrt(d).
window: (left, right), FlashAttention's window_size: key j is kept for the query at position i
iff i - left <= j <= i + right (-1: unbounded on that side), together with the masking and the
band; methods 'exact_tiled' and 'exact_banded' only (ValueError otherwise). Default (-1, -1).
sigmas: one per query head, None means alibi_sigmas(H_q) (sigma_h = 1 / m_h).
samples, seed: LSH head h uses rbf_hashes(sigma_h, samples, seed, stream=h).
query_offset: position p0 of q's first token: the m queries are the tokens p0 .. p0 + m - 1
over the L keys (causal: key j kept for query row r iff j <= p0 + r; bias -|p0 + r - j| /
sigma_h). None (default) means p0 = L - m (bottom-right: the queries are the last tokens; 0
for self-attention). Row r is bitwise row p0 + r of the call on all L tokens (chunked prefill,
multi-token decode).
plans: a list of HeadPlan (plan_heads), one per query head: head h runs plans[h]'s method
(exact_tiled: alibi_attention_tiled; exact_banded: alibi_attention_banded with its band;
lsh_fused: lsh_attention_fused with sample_hashes(sigma_h, s_h, seed_h, stream_h, sampler_h)),
each head bitwise its single-head kernel; method, sigmas, samples, seed and band_error then
keep their defaults (ValueError otherwise); float32 or float64 arrays.
out: optional output written in place and returned. num_threads: OpenMP threads for this call.
float32 or float64 (all arrays alike); the GIL is released during the computation.
Half precision (read in place, float32 accumulation and softmax): q, k, v all float16 ->
float16 out (or a float32 out= array), all poslsh.BFloat16Bits -> BFloat16Bits out (or float32
out=), float32 q over float16 or BFloat16Bits k, v -> float32; a half-precision output is the
float32 result rounded once. float64 never mixes with half precision (TypeError).
precision: 'matrix_units' (default) or 'float_products' (ValueError otherwise). Under
'matrix_units', q, k, v all bfloat16 use the CPU's matrix unit where it has one
(matrix_unit('bfloat16', 'bfloat16') names it; 'avx512_bf16': bfloat16 products summed in
float, the probabilities rounded to bfloat16 before P V); every other call, and every call
under 'float_products', widens each value to float32 (bitwise the float32 call on the widened
inputs, rounded once). float32 and float64 inputs (and plans=) ignore it.
)doc";

const char* const varlen_doc = R"doc(
multihead_attention on a packed batch of B sequences of different lengths (FlashAttention's
variable-length convention). Sequence b owns the query tokens [cu_seqlens_q[b],
cu_seqlens_q[b+1]) of q and out and the key tokens [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k
and v (q [total_q, H_q, d], k [total_k, H_kv, d], v [total_k, H_kv, d_v] in layout 'nhd';
[H, total, d] in 'hnd'). cu_seqlens_q, cu_seqlens_k: int32 numpy arrays of B + 1 entries from
0 (non-decreasing, last = the token count). Each sequence has its own positions from 0: its
m_b queries are the tokens p_b .. p_b + m_b - 1 over its L_b keys, with

    out_{b,h} = method(Q_{b,h}, K_{b,h//G}, V_{b,h//G}; sigma_h)  at query offset p_b,

p_b = query_offsets[b] when given (0 <= p_b <= L_b - m_b), else L_b - m_b (bottom-right).
Without query_offsets a sequence may hold more queries than keys (m_b > L_b, FlashAttention's
alignment: row i at key position i - (m_b - L_b)): causal rows before the first key see no key
(out 0); bidirectional rows see every key at distance |i - (m_b - L_b) - j|, the LSH bins at
positions counted from the first query.
Bitwise equal to multihead_attention on each sequence's slices with query_offset=p_b (the same
sigmas and hashes for every sequence). Empty sequences are allowed. The other keywords as
multihead_attention (half precision included); the GIL is released during the computation.
)doc";

}  // namespace

void register_multihead(py::module_& module) {
  def_method_table(module);
  def_multihead(
      module, "multihead_attention",
      [](py::handle q, py::handle k, py::handle v, const std::string& layout_name,
         const std::string& method, const std::string& masking, std::optional<double> scale,
         std::optional<std::vector<double>> sigmas, Index samples, std::uint64_t seed,
         double band_error, std::pair<Index, Index> window, std::optional<Index> query_offset,
         std::optional<std::vector<poslsh::HeadPlan>> plans, py::handle out,
         std::optional<int> threads, const std::string& precision) -> py::object {
        constexpr const char* function = "multihead_attention";
        HeadsKeywords keywords = heads_keywords(function, layout_name, method, masking, scale,
                                                sigmas, samples, seed, band_error, window);
        const Layout layout = keywords.layout;
        poslsh::MultiHeadOptions& options = keywords.options;
        options.query_offset = query_offset;
        options.precision = precision_of(precision, function);
        if (plans) {
          require_plan_keywords(function, options);
          return heads_call<DtypeSet::full_precision>(
              function, q, k, v, layout, out, threads,
              [&](auto types, const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
                using T = typename decltype(types)::q;
                poslsh::multihead_attention<T>(qv, kv, vv, ov, *plans, options);
              });
        }
        return heads_call<DtypeSet::with_half>(
            function, q, k, v, layout, out, threads,
            [&](auto types, const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
              using Call = decltype(types);
              poslsh::multihead_attention<typename Call::q, typename Call::kv, typename Call::out>(
                  qv, kv, vv, ov, options);
            });
      },
      std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v")),
      std::make_tuple(py::arg("query_offset") = py::none(), py::arg("plans") = py::none(),
                      py::arg("out") = py::none(), py::arg("num_threads") = py::none(),
                      py::arg("precision") = default_precision()),
      multihead_doc);

  def_multihead(
      module, "multihead_attention_varlen",
      [](py::handle q, py::handle k, py::handle v, py::handle cu_seqlens_q, py::handle cu_seqlens_k,
         const std::string& layout_name, const std::string& method, const std::string& masking,
         std::optional<double> scale, std::optional<std::vector<double>> sigmas, Index samples,
         std::uint64_t seed, double band_error, std::pair<Index, Index> window,
         std::optional<std::vector<Index>> query_offsets, py::handle out,
         std::optional<int> threads, const std::string& precision) {
        constexpr const char* function = "multihead_attention_varlen";
        HeadsKeywords keywords = heads_keywords(function, layout_name, method, masking, scale,
                                                sigmas, samples, seed, band_error, window);
        keywords.options.precision = precision_of(precision, function);
        const std::vector<std::int32_t> cu_q = int32_vector(cu_seqlens_q, function, "cu_seqlens_q");
        const std::vector<std::int32_t> cu_k = int32_vector(cu_seqlens_k, function, "cu_seqlens_k");
        const std::vector<Index> offsets = query_offsets.value_or(std::vector<Index>{});
        return heads_call<DtypeSet::with_half>(
            function, q, k, v, keywords.layout, out, threads,
            [&](auto types, const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
              using Call = decltype(types);
              poslsh::multihead_attention_varlen<typename Call::q, typename Call::kv,
                                                 typename Call::out>(qv, kv, vv, ov, cu_q, cu_k,
                                                                     keywords.options, offsets);
            });
      },
      std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"),
                      py::arg("cu_seqlens_k")),
      std::make_tuple(py::arg("query_offsets") = py::none(), py::arg("out") = py::none(),
                      py::arg("num_threads") = py::none(),
                      py::arg("precision") = default_precision()),
      varlen_doc);
}

}  // namespace poslsh_python
