// poslsh Python bindings: attention over a paged KV cache (FlashAttention's layout: pages of
// [page_size, H_kv, d] rows, an int32 block table per sequence), read in place: the single-head
// kernels and the all-heads multihead_attention_paged (every method, packed queries).
#include "poslsh/attention/paged.hpp"

#include <cstdint>

#include "arrays.hpp"
#include "multihead.hpp"
#include "poslsh/multihead/paged.hpp"

namespace poslsh_python {

namespace {

/// Checks that `array` is C-contiguous (the library reads it with row-major strides).
void require_c_contiguous(const py::array& array, const char* function, const char* name) {
  if (!(array.flags() & py::array::c_style)) {
    throw py::value_error(argument(function, name) +
                          " must be C-contiguous (the cache is read with row-major strides); "
                          "np.ascontiguousarray() copies it");
  }
}

/// A C-contiguous int32 array of `ndim` dimensions (block_table, seq_lens), used in place.
py::array int32_array(py::handle object, int ndim, const char* function, const char* name) {
  py::array array = require_array(object, function, name);
  if (!py::isinstance<py::array_t<std::int32_t>>(array)) {
    throw py::type_error(argument(function, name) + " has dtype " + dtype_name(array) +
                         ": must be int32 (arrays are never converted; use .astype(np.int32))");
  }
  if (array.ndim() != ndim) {
    throw py::value_error(argument(function, name) + " has " + std::to_string(array.ndim()) +
                          " dimensions: must be " + std::to_string(ndim) + "-D");
  }
  require_c_contiguous(array, function, name);
  return array;
}

/// The element strides of a 4-D cache array [num_pages, page_size, H_kv, d] (read in place, any
/// layout with a contiguous last axis and positive strides on the other axes: e.g.
/// kv_cache[:, :, 0] of a packed cache); ValueError naming the argument otherwise. An axis of
/// extent 1 takes any stride (never stepped).
poslsh::PagedStrides page_strides(const py::array& array, const char* function, const char* name) {
  const auto item = static_cast<py::ssize_t>(array.itemsize());
  if (array.shape(3) > 1 && array.strides(3) != item) {
    throw py::value_error(argument(function, name) + " must have a contiguous last axis (stride " +
                          std::to_string(item) + " bytes, got " + std::to_string(array.strides(3)) +
                          ")");
  }
  Index steps[3] = {0, 0, 0};
  for (int axis = 0; axis < 3; ++axis) {
    if (array.shape(axis) <= 1) continue;
    const py::ssize_t stride = array.strides(axis);
    if (stride <= 0 || stride % item != 0) {
      throw py::value_error(argument(function, name) + " has stride " + std::to_string(stride) +
                            " bytes on axis " + std::to_string(axis) +
                            ": the first three axes must have positive strides, multiples of "
                            "the element size (np.ascontiguousarray() copies it)");
    }
    steps[axis] = static_cast<Index>(stride / item);
  }
  return {steps[0], steps[1], steps[2]};
}

/// The paged cache of the arrays (checked: storage T like the argument `like`, 4-D (page_strides)
/// pages whose page count, page size and heads agree, block table rows = seq_lens entries). The
/// arrays must outlive the view.
template <typename T>
poslsh::PagedKV<T> paged_cache(py::handle k_object, py::handle v_object,
                               const py::array& block_table, const py::array& seq_lens,
                               const char* function, const char* like = "q") {
  const py::array k_pages = storage_array<T>(k_object, function, "k_pages", like);
  const py::array v_pages = storage_array<T>(v_object, function, "v_pages", like);
  for (const auto& [array, name] :
       {std::pair<const py::array&, const char*>{k_pages, "k_pages"}, {v_pages, "v_pages"}}) {
    if (array.ndim() != 4) {
      throw py::value_error(argument(function, name) + " has " + std::to_string(array.ndim()) +
                            " dimensions: must be 4-D [num_pages, page_size, H_kv, d]");
    }
  }
  if (v_pages.shape(0) != k_pages.shape(0) || v_pages.shape(1) != k_pages.shape(1) ||
      v_pages.shape(2) != k_pages.shape(2)) {
    throw py::value_error(argument(function, "v_pages") + " has shape " + shape_text(v_pages) +
                          ": its first three axes must equal those of k_pages " +
                          shape_text(k_pages) + " (num_pages, page_size, H_kv)");
  }
  if (seq_lens.shape(0) != block_table.shape(0)) {
    throw py::value_error(argument(function, "seq_lens") + " has " +
                          std::to_string(seq_lens.shape(0)) +
                          " entries: must have one per block table row (" +
                          std::to_string(block_table.shape(0)) + ")");
  }
  poslsh::PagedKV<T> cache;
  cache.k_pages = static_cast<const T*>(k_pages.data());
  cache.v_pages = static_cast<const T*>(v_pages.data());
  cache.num_pages = static_cast<Index>(k_pages.shape(0));
  cache.page_size = static_cast<Index>(k_pages.shape(1));
  cache.heads = static_cast<Index>(k_pages.shape(2));
  cache.dim = static_cast<Index>(k_pages.shape(3));
  cache.dim_v = static_cast<Index>(v_pages.shape(3));
  cache.block_table = static_cast<const std::int32_t*>(block_table.data());
  cache.batch = static_cast<Index>(block_table.shape(0));
  cache.max_pages = static_cast<Index>(block_table.shape(1));
  cache.seq_lens = static_cast<const std::int32_t*>(seq_lens.data());
  cache.k_strides = page_strides(k_pages, function, "k_pages");
  cache.v_strides = page_strides(v_pages, function, "v_pages");
  return cache;
}

/// Maps q and the cache (dtype of q), prepares the output (q.rows() x d_v), then runs
/// kernel(types, q, cache, out) without the GIL. Returns the output array.
template <typename Kernel>
py::object paged_call(const char* function, py::handle q, py::handle k_pages, py::handle v_pages,
                      py::handle block_table, py::handle seq_lens, py::handle out,
                      std::optional<int> threads, Kernel&& kernel) {
  threads = thread_count(threads, function);
  const py::array table = int32_array(block_table, 2, function, "block_table");
  const py::array lengths = int32_array(seq_lens, 1, function, "seq_lens");
  return dispatch(function, {q}, [&](auto types) {
    using T = typename decltype(types)::q;
    const InputMap<T> q_map = input_matrix<T>(q, function, "q", "q");
    const poslsh::PagedKV<T> cache = paged_cache<T>(k_pages, v_pages, table, lengths, function);
    auto output = output_matrix<T>(out, q_map.rows(), cache.dim_v, function, "out", "q",
                                   {{q, "q"},
                                    {k_pages, "k_pages"},
                                    {v_pages, "v_pages"},
                                    {block_table, "block_table"},
                                    {seq_lens, "seq_lens"}});
    run_kernel(threads, [&] { kernel(types, q_map, cache, output.map); });
    return output.result;
  });
}

const char* const paged_doc_tail = R"doc(
The cache (FlashAttention's paged layout, read in place, never copied): k_pages
[num_pages, page_size, H_kv, d] and v_pages [num_pages, page_size, H_kv, d_v], any strides
on the first three axes (positive; e.g. kv_cache[:, :, 0] of a packed cache) with the last
axis contiguous, the dtype of q; block_table int32 [batch, max_pages] and seq_lens int32
[batch], C-contiguous:
token j of sequence b is row j % page_size of page block_table[b, j // page_size], and the
sequence has L = seq_lens[b] tokens. Only the pages of those tokens are read; their indices are
checked against num_pages. sequence: b; kv_head: the KV head read.
q: [m, d] (any row stride, last axis contiguous), the queries at positions p0 .. p0 + m - 1;
query_offset: p0, None (default) means L - m (bottom-right: prefill chunks and decode append
their queries at the cache's end). masking: 'causal' (default, keys j <= p0 + r) or
'bidirectional' (all L keys). scale: tau,
None means 1/sqrt(d). out: optional [m, d_v] array written in place and returned.
num_threads: OpenMP threads for this call. The GIL is released while the kernel runs. Bad
arguments raise ValueError (the library's message) or TypeError (dtype, non-array).)doc";

/// The keywords of the all-heads paged calls: those of every all-heads function (precision
/// included), the queries' cu_seqlens and offsets.
struct PagedKeywords {
  HeadsKeywords heads;
  std::vector<std::int32_t> cu_seqlens_q;
  std::vector<Index> query_offsets;
};

PagedKeywords paged_keywords(const char* function, py::handle cu_seqlens_q,
                             const std::string& layout, const std::string& method,
                             const std::string& masking, std::optional<double> scale,
                             const std::optional<std::vector<double>>& sigmas, Index samples,
                             std::uint64_t seed, double band_error,
                             const std::pair<Index, Index>& window,
                             const std::optional<std::vector<Index>>& query_offsets,
                             const std::string& precision) {
  PagedKeywords keywords{heads_keywords(function, layout, method, masking, scale, sigmas, samples,
                                        seed, band_error, window),
                         int32_vector(cu_seqlens_q, function, "cu_seqlens_q"),
                         query_offsets.value_or(std::vector<Index>{})};
  keywords.heads.options.precision = precision_of(precision, function);
  return keywords;
}

/// Maps q (a HeadsView in the layout) and the cache (dispatch<DtypeSet::with_half>: the cache's
/// dtype is q's, or bfloat16 / float16 under float32 q), prepares out (q.tokens x H_q x d_v in
/// the layout) and, with_lse, lse (H_q x q.tokens of the compute type: float32, float64 for
/// float64), then runs multihead_attention_paged (or _with_lse) without the GIL. Returns out,
/// or (out, lse).
py::object paged_heads_call(const char* function, py::handle q, py::handle k_pages,
                            py::handle v_pages, py::handle block_table, py::handle seq_lens,
                            const PagedKeywords& paged, py::handle out, py::handle lse,
                            bool with_lse, std::optional<int> threads) {
  const HeadsKeywords& keywords = paged.heads;
  threads = thread_count(threads, function);
  const py::array table = int32_array(block_table, 2, function, "block_table");
  const py::array lengths = int32_array(seq_lens, 1, function, "seq_lens");
  const Names names{"q", "k_pages", "v_pages"};
  return dispatch<DtypeSet::with_half>(
      function, {q, k_pages, v_pages, out},
      [&](auto types) -> py::object {
        using Call = decltype(types);
        using Q = typename Call::q;
        using KV = typename Call::kv;
        using Out = typename Call::out;
        using C = poslsh::compute_scalar_t<Q, KV, Out>;
        const poslsh::HeadsView<const Q> q_view =
            heads_input<Q>(q, keywords.layout, function, "q", "q");
        const poslsh::PagedKV<KV> cache =
            paged_cache<KV>(k_pages, v_pages, table, lengths, function, kv_like<Call>(names));
        Inputs inputs = {{q, "q"},
                         {k_pages, "k_pages"},
                         {v_pages, "v_pages"},
                         {block_table, "block_table"},
                         {seq_lens, "seq_lens"}};
        auto output = heads_output<Out>(out, keywords.layout, q_view.tokens, q_view.heads,
                                        cache.dim_v, function, "out", "q", inputs);
        if (!with_lse) {
          run_kernel(threads, [&] {
            poslsh::multihead_attention_paged<Q, KV, Out>(q_view, cache, output.view,
                                                          paged.cu_seqlens_q, keywords.options,
                                                          paged.query_offsets);
          });
          return output.result;
        }
        inputs.emplace_back(output.result, "out");
        MatrixOutput<C> lse_out =
            output_matrix<C>(lse, q_view.heads, q_view.tokens, function, "lse",
                             std::is_same_v<C, Q> ? "q" : "lse", inputs);
        poslsh::MatrixRef<C> lse_map(lse_out.map);
        run_kernel(threads, [&] {
          poslsh::multihead_attention_paged_with_lse<Q, KV, Out>(
              q_view, cache, output.view, lse_map, paged.cu_seqlens_q, keywords.options,
              paged.query_offsets);
        });
        return py::make_tuple(output.result, lse_out.result);
      },
      names);
}

const char* const multihead_paged_doc = R"doc(
All-heads (and grouped-query) ALiBi attention of a packed batch of queries over a paged KV
cache, every method of multihead_attention, the cache read in place (never gathered):

    out_{b,h} = method(Q_{b,h}, K_{b,h//G}, V_{b,h//G}; sigma_h)   at query offset p_b

Sequence b (one per block table row) owns the query tokens cu_seqlens_q[b] ..
cu_seqlens_q[b+1] - 1 of q and out and the L_b = seq_lens[b] tokens of the cache: token j is
row j % page_size of page block_table[b, j // page_size] of k_pages [num_pages, page_size,
H_kv, d] and v_pages [num_pages, page_size, H_kv, d_v] (any positive strides on the first
three axes, last axis contiguous: read in place). Its m_b queries sit at
positions p_b .. p_b + m_b - 1, p_b = query_offsets[b] when given (0 <= p_b <= L_b - m_b), else
L_b - m_b (bottom-right: decode and prefill chunks append their queries at the cache's end).
block_table: int32 [batch, max_pages], C-contiguous (entries past a sequence's pages are not
read; the used ones are checked against num_pages); seq_lens: int32 [batch]; cu_seqlens_q:
int32, batch + 1 entries from 0 to q's token count, non-decreasing. q: [total_q, H_q, d] in
layout 'nhd' ([H_q, total_q, d] in 'hnd'), any strides on the first two axes; out likewise
(d_v), a new array or the given out= written in place.
The keywords method, masking, scale, samples, seed, band_error and window as
multihead_attention; sigmas: one per query head, or one per sequence and query head (batch *
H_q entries, sequence-major: sigmas[b * H_q + h]). Bitwise equal to multihead_attention_varlen
on the same keys gathered into contiguous arrays (cu_seqlens_k of seq_lens), for any page size.
dtypes: q and the cache float32, float64, float16 or bfloat16 (poslsh.BFloat16Bits) of one
dtype, or float32 q over a float16 or bfloat16 cache (computed in float32); out of q's dtype
(or float32 for half-precision q); precision as multihead_attention. num_threads: OpenMP
threads for this call. The GIL is released while the kernel runs. Bad arguments raise
ValueError (the library's message names the argument, 'cache.block_table' for block_table
entries, 'cache.seq_lens' for seq_lens) or TypeError (dtypes, non-arrays).
)doc";

const char* const multihead_paged_lse_doc = R"doc(
multihead_attention_paged and the log-sum-exp of every query head, (out, lse): lse[h, t] =
log sum_j w_ij e^{x_ij} of query token t (the method's scores and weights, as
multihead_attention_with_lse; -inf for a row without keys), [H_q, total_q] float32 (float64 for
float64 q), a new array or the given lse= (last axis contiguous). out is bitwise that of
multihead_attention_paged. Every method but 'mean_of_outputs', which has no lse (ValueError).
)doc";

}  // namespace

void register_paged(py::module_& module) {
  const auto positional =
      std::make_tuple(py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("block_table"),
                      py::arg("seq_lens"), py::arg("cu_seqlens_q"));
  def_multihead(
      module, "multihead_attention_paged",
      [](py::handle q, py::handle k_pages, py::handle v_pages, py::handle block_table,
         py::handle seq_lens, py::handle cu_seqlens_q, const std::string& layout_name,
         const std::string& method, const std::string& masking, std::optional<double> scale,
         std::optional<std::vector<double>> sigmas, Index samples, std::uint64_t seed,
         double band_error, std::pair<Index, Index> window,
         std::optional<std::vector<Index>> query_offsets, py::handle out,
         std::optional<int> threads, const std::string& precision) {
        constexpr const char* function = "multihead_attention_paged";
        return paged_heads_call(
            function, q, k_pages, v_pages, block_table, seq_lens,
            paged_keywords(function, cu_seqlens_q, layout_name, method, masking, scale, sigmas,
                           samples, seed, band_error, window, query_offsets, precision),
            out, py::none(), false, threads);
      },
      positional,
      std::make_tuple(py::arg("query_offsets") = py::none(), py::arg("out") = py::none(),
                      py::arg("num_threads") = py::none(),
                      py::arg("precision") = default_precision()),
      multihead_paged_doc);

  def_multihead(
      module, "multihead_attention_paged_with_lse",
      [](py::handle q, py::handle k_pages, py::handle v_pages, py::handle block_table,
         py::handle seq_lens, py::handle cu_seqlens_q, const std::string& layout_name,
         const std::string& method, const std::string& masking, std::optional<double> scale,
         std::optional<std::vector<double>> sigmas, Index samples, std::uint64_t seed,
         double band_error, std::pair<Index, Index> window,
         std::optional<std::vector<Index>> query_offsets, py::handle out, py::handle lse,
         std::optional<int> threads, const std::string& precision) {
        constexpr const char* function = "multihead_attention_paged_with_lse";
        return paged_heads_call(
            function, q, k_pages, v_pages, block_table, seq_lens,
            paged_keywords(function, cu_seqlens_q, layout_name, method, masking, scale, sigmas,
                           samples, seed, band_error, window, query_offsets, precision),
            out, lse, true, threads);
      },
      positional,
      std::make_tuple(py::arg("query_offsets") = py::none(), py::arg("out") = py::none(),
                      py::arg("lse") = py::none(), py::arg("num_threads") = py::none(),
                      py::arg("precision") = default_precision()),
      (std::string(multihead_paged_doc) + multihead_paged_lse_doc).c_str());

  module.def(
      "lsh_attention_fused_paged",
      [](py::handle q, py::handle k_pages, py::handle v_pages, py::handle block_table,
         py::handle seq_lens, Index sequence, Index kv_head, py::handle hashes,
         const std::string& masking, std::optional<double> scale, std::optional<Index> query_offset,
         py::handle out, std::optional<int> threads) {
        constexpr const char* function = "lsh_attention_fused_paged";
        const poslsh::HashSet& set = hash_set(hashes, function);
        poslsh::AttentionOptions options{masking_of(masking, "lsh_attention_fused_paged"), scale};
        options.query_offset = query_offset;
        return paged_call(function, q, k_pages, v_pages, block_table, seq_lens, out, threads,
                          [&](auto types, const auto& qm, const auto& cache, auto& om) {
                            using T = typename decltype(types)::q;
                            poslsh::lsh_attention_fused_paged<T>(qm, cache, sequence, kv_head, set,
                                                                 om, options);
                          });
      },
      py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("block_table"),
      py::arg("seq_lens"), py::arg("sequence"), py::arg("kv_head"), py::arg("hashes"),
      py::kw_only(), py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
      py::arg("query_offset") = py::none(), py::arg("out") = py::none(),
      py::arg("num_threads") = py::none(),
      (std::string(R"doc(Fused LSH ALiBi attention (lsh_attention_fused) over a paged KV cache:

    out_r = sum_j c_{p0+r,j} e^{tau q_r.k_j} v_j / sum_j c_{p0+r,j} e^{tau q_r.k_j},
    c_ij = #{k : bin_k(i) = bin_k(j)}   (causal: j <= i),  j over the L cache tokens

bitwise lsh_attention_fused on the same keys and values in contiguous arrays, for any page
size. Query tiles run in parallel.
)doc") +
       paged_doc_tail)
          .c_str());

  module.def(
      "alibi_attention_tiled_paged",
      [](py::handle q, py::handle k_pages, py::handle v_pages, py::handle block_table,
         py::handle seq_lens, Index sequence, Index kv_head, double sigma,
         const std::string& masking, std::optional<double> scale, std::optional<Index> query_offset,
         py::handle out, std::optional<int> threads) {
        constexpr const char* function = "alibi_attention_tiled_paged";
        poslsh::AttentionOptions options{masking_of(masking, "alibi_attention_tiled_paged"), scale};
        options.query_offset = query_offset;
        return paged_call(function, q, k_pages, v_pages, block_table, seq_lens, out, threads,
                          [&](auto types, const auto& qm, const auto& cache, auto& om) {
                            using T = typename decltype(types)::q;
                            poslsh::alibi_attention_tiled_paged<T>(qm, cache, sequence, kv_head,
                                                                   sigma, om, options);
                          });
      },
      py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("block_table"),
      py::arg("seq_lens"), py::arg("sequence"), py::arg("kv_head"), py::arg("sigma"), py::kw_only(),
      py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
      py::arg("query_offset") = py::none(), py::arg("out") = py::none(),
      py::arg("num_threads") = py::none(),
      (std::string(R"doc(Exact ALiBi attention (alibi_attention_tiled) over a paged KV cache:

    out_r = softmax_j(tau q_r.k_j - |p0 + r - j| / sigma) V   (causal: j <= p0 + r)

bitwise alibi_attention_tiled on the same keys and values in contiguous arrays, for any page
size. Single-threaded (as the library's kernel).
)doc") +
       paged_doc_tail)
          .c_str());
}

}  // namespace poslsh_python
