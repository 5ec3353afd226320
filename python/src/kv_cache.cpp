// poslsh Python bindings: the bounded KV cache (BoundedKVCache: pages of a pool shared by
// sequences, each K/V head keeping only the keys its heads can still read) and the all-heads
// attention over it (multihead_attention_bounded).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "multihead.hpp"
#include "poslsh/cache/bounded_kv_cache.hpp"
#include "poslsh/multihead/planner.hpp"
#include "poslsh/parallel/plan.hpp"

namespace poslsh_python {

namespace {

/// One BoundedKVCache of the storage dtype chosen at construction.
class PyBoundedCache {
 public:
  using Caches = std::variant<std::unique_ptr<poslsh::BoundedKVCache<float>>,
                              std::unique_ptr<poslsh::BoundedKVCache<double>>,
                              std::unique_ptr<poslsh::BoundedKVCache<Eigen::half>>,
                              std::unique_ptr<poslsh::BoundedKVCache<Eigen::bfloat16>>>;

  PyBoundedCache(std::vector<poslsh::HeadMethod> heads, Index kv_heads, Index dim, Index dim_v,
                 Index page_size, Index num_pages, const std::string& dtype)
      : dtype_(dtype) {
    const auto make = [&](auto tag) {
      using S = decltype(tag);
      caches_ = std::make_unique<poslsh::BoundedKVCache<S>>(std::move(heads), kv_heads, dim, dim_v,
                                                            page_size, num_pages);
    };
    if (dtype == "float32")
      make(float{});
    else if (dtype == "float64")
      make(double{});
    else if (dtype == "float16")
      make(Eigen::half{});
    else if (dtype == "bfloat16")
      make(Eigen::bfloat16{});
    else
      throw py::value_error(argument("BoundedKVCache", "dtype") + " = '" + dtype +
                            "': must be 'float32', 'float64', 'float16' or 'bfloat16'");
  }

  template <typename Visit>
  decltype(auto) visit(Visit&& visit) {
    return std::visit([&](auto& cache) -> decltype(auto) { return visit(*cache); }, caches_);
  }
  template <typename Visit>
  decltype(auto) visit(Visit&& visit) const {
    return std::visit([&](const auto& cache) -> decltype(auto) { return visit(*cache); }, caches_);
  }
  const std::string& dtype() const { return dtype_; }

 private:
  Caches caches_;
  std::string dtype_;
};

template <typename Cache>
using BoundedStorageOf = typename std::decay_t<Cache>::storage;

/// Appends k, v ([m, H_kv, d] and [m, H_kv, d_v] in the cache's dtype, last axis contiguous).
void append_bounded_tokens(PyBoundedCache& self, Index sequence, Index position, py::handle k,
                           py::handle v) {
  constexpr const char* function = "BoundedKVCache.append";
  self.visit([&](auto& cache) {
    using S = BoundedStorageOf<decltype(cache)>;
    const Layout layout = layout_of("nhd", function);
    const auto keys = heads_input<S>(k, layout, function, "k", "k");
    const auto values = heads_input<S>(v, layout, function, "v", "k");
    cache.append(sequence, position, keys, values);
  });
}

/// The attention call: q ([total_q, H_q, d]) of the cache's dtype (float32 over a float16 or
/// bfloat16 cache too); out of q's dtype. Returns out, or (out, lse).
py::object bounded_attend(const PyBoundedCache& self, py::handle q,
                          const std::vector<Index>& sequences, py::handle cu_seqlens_q,
                          const std::string& masking, std::optional<double> scale,
                          std::optional<std::vector<Index>> query_offsets, py::handle out,
                          py::handle lse, bool with_lse, std::optional<int> threads,
                          const std::string& precision, const char* function) {
  threads = thread_count(threads, function);
  poslsh::AttentionOptions options;
  options.masking = masking_of(masking, function);
  options.scale = scale;
  options.precision = precision_of(precision, function);
  const std::vector<Index> offsets = query_offsets.value_or(std::vector<Index>{});
  const Layout layout = layout_of("nhd", function);
  return self.visit([&](const auto& cache) -> py::object {
    using KV = BoundedStorageOf<decltype(cache)>;
    const auto run = [&](auto q_tag) -> py::object {
      using Q = decltype(q_tag);
      using C = poslsh::compute_scalar_t<Q, KV, Q>;
      const poslsh::HeadsView<const Q> q_view = heads_input<Q>(q, layout, function, "q", "q");
      std::vector<std::int32_t> cu;
      if (cu_seqlens_q.is_none()) {
        if (sequences.size() != 1)
          throw py::value_error(argument(function, "cu_seqlens_q") +
                                " is None: allowed for one sequence only (got " +
                                std::to_string(sequences.size()) + ")");
        cu = {0, static_cast<std::int32_t>(q_view.tokens)};
      } else {
        cu = int32_vector(cu_seqlens_q, function, "cu_seqlens_q");
      }
      Inputs inputs = {{q, "q"}};
      auto output = heads_output<Q>(out, layout, q_view.tokens, q_view.heads, cache.dim_v(),
                                    function, "out", "q", inputs);
      if (!with_lse) {
        run_kernel(threads, [&] {
          poslsh::multihead_attention_bounded<Q, KV, Q>(q_view, cache, sequences, output.view, cu,
                                                        options, offsets);
        });
        return output.result;
      }
      inputs.emplace_back(output.result, "out");
      MatrixOutput<C> lse_out = output_matrix<C>(lse, q_view.heads, q_view.tokens, function, "lse",
                                                 std::is_same_v<C, Q> ? "q" : "lse", inputs);
      poslsh::MatrixRef<C> lse_map(lse_out.map);
      run_kernel(threads, [&] {
        poslsh::multihead_attention_bounded_with_lse<Q, KV, Q>(
            q_view, cache, sequences, output.view, lse_map, cu, options, offsets);
      });
      return py::make_tuple(output.result, lse_out.result);
    };
    if (is_storage<KV>(q)) return run(KV{});
    if constexpr (!std::is_same_v<KV, float> && !std::is_same_v<KV, double>) {
      if (is_storage<float>(q)) return run(float{});
    }
    throw py::type_error(argument(function, "q") + " " + describe(q, function, "q") + ": must be " +
                         storage_name<KV>() + " like the cache" +
                         (std::is_same_v<KV, float> || std::is_same_v<KV, double>
                              ? std::string()
                              : std::string(" (or float32)")) +
                         " (arrays are never converted)");
  });
}

const char* const bounded_cache_doc = R"doc(
A KV cache for generation whose memory does not grow with the context: a pool of num_pages
pages (page_size positions of one K/V head each: keys page_size x dim, values page_size x
dim_v, in `dtype`: 'float32', 'float64', 'float16' or 'bfloat16') shared by sequences, each K/V
head of each sequence holding only the keys its query heads can still read:

    banded head (band W):              key j dead once t - j > W
    LSH head (fused, per-sample, mean of outputs, fixed blocks):
                                       dead once t is past the end of j's block in every sample
    exact head with window_left L:     dead once t - j > L;  exact without a window: never

(t the first position a query may still have; a K/V head keeps the union of its query heads).
append(sequence, position, k, v) first releases the pages whose keys are all dead at `position`
(returned to the pool, reused by any sequence), then writes the tokens. Held memory per K/V
head: at most ceil(live keys / page_size) + 1 pages. attention() reads the cache in place; each
output row is bitwise that of multihead_attention over every key of the sequence with the same
heads (for finite keys and values).

The heads: query_heads with the keywords of multihead_attention (method, sigmas, samples, seed,
band_error, window: the kernels' hashes, band and window, as resolve_head_methods), or plans=
(plan_heads: one HeadPlan per query head). page_size: a positive multiple of 64. Bad arguments
raise ValueError naming the argument (a closed sequence, a position out of order, a pool too
small: nothing changes) or TypeError (dtypes).
)doc";

const char* const bounded_attention_doc = R"doc(
All-heads ALiBi attention over the cache (multihead_attention_bounded): sequence b of the call is
the cache's sequences[b] with the query tokens cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 of q
([total_q, H_q, d], last axis contiguous; cu_seqlens_q int32, None for one sequence: all of q)
at positions p_b .. p_b + m_b - 1, p_b = query_offsets[b] when given, else length - m_b (the
tokens just appended); p_b must be >= the sequence's frontier (the first position of its last
append). q of the cache's dtype, or float32 over a float16 / bfloat16 cache; out of q's dtype
([total_q, H_q, d_v], new or the given out=). masking, scale, precision as multihead_attention.
The GIL is released while the kernels run.
)doc";

}  // namespace

void register_kv_cache(py::module_& module) {
  py::class_<PyBoundedCache>(module, "BoundedKVCache", bounded_cache_doc)
      .def(py::init([](Index kv_heads, Index dim, Index dim_v, Index page_size, Index num_pages,
                       const std::string& dtype, std::optional<Index> query_heads,
                       const std::string& method, std::optional<std::vector<double>> sigmas,
                       Index samples, std::uint64_t seed, double band_error,
                       std::pair<Index, Index> window,
                       std::optional<std::vector<poslsh::HeadPlan>> plans) {
             constexpr const char* function = "BoundedKVCache";
             std::vector<poslsh::HeadMethod> heads;
             if (plans) {
               heads = poslsh::detail::planned_head_methods(
                   function, static_cast<Index>(plans->size()), *plans);
               if (query_heads && *query_heads != static_cast<Index>(plans->size()))
                 throw py::value_error(
                     argument(function, "query_heads") + " = " + std::to_string(*query_heads) +
                     ": must equal len(plans) = " + std::to_string(plans->size()));
             } else {
               if (!query_heads)
                 throw py::value_error(argument(function, "query_heads") +
                                       " is None: give the query heads (or plans=)");
               const HeadsKeywords keywords =
                   heads_keywords(function, "nhd", method, "causal", std::nullopt, sigmas, samples,
                                  seed, band_error, window);
               heads = poslsh::resolve_head_methods(*query_heads, keywords.options);
             }
             return PyBoundedCache(std::move(heads), kv_heads, dim, dim_v, page_size, num_pages,
                                   dtype);
           }),
           py::arg("kv_heads"), py::arg("dim"), py::arg("dim_v"), py::arg("page_size"),
           py::arg("num_pages"), py::kw_only(), py::arg("dtype") = "float32",
           py::arg("query_heads") = py::none(),
           py::arg("method") = poslsh::enum_name(poslsh::MultiHeadOptions{}.method),
           py::arg("sigmas") = py::none(), py::arg("samples") = poslsh::MultiHeadOptions{}.samples,
           py::arg("seed") = poslsh::MultiHeadOptions{}.seed,
           py::arg("band_error") = poslsh::MultiHeadOptions{}.band_error,
           py::arg("window") = std::make_pair(Index{-1}, Index{-1}), py::arg("plans") = py::none())
      .def_property_readonly("dtype", &PyBoundedCache::dtype, "Storage dtype of the pages")
      .def_property_readonly("query_heads",
                             [](const PyBoundedCache& c) {
                               return c.visit([](const auto& x) { return x.query_heads(); });
                             })
      .def_property_readonly("kv_heads",
                             [](const PyBoundedCache& c) {
                               return c.visit([](const auto& x) { return x.kv_heads(); });
                             })
      .def_property_readonly(
          "dim",
          [](const PyBoundedCache& c) { return c.visit([](const auto& x) { return x.dim(); }); })
      .def_property_readonly(
          "dim_v",
          [](const PyBoundedCache& c) { return c.visit([](const auto& x) { return x.dim_v(); }); })
      .def_property_readonly("page_size",
                             [](const PyBoundedCache& c) {
                               return c.visit([](const auto& x) { return x.page_size(); });
                             })
      .def_property_readonly("num_pages",
                             [](const PyBoundedCache& c) {
                               return c.visit([](const auto& x) { return x.num_pages(); });
                             })
      .def_property_readonly(
          "free_pages",
          [](const PyBoundedCache& c) {
            return c.visit([](const auto& x) { return x.free_pages(); });
          },
          "Pages of the pool no sequence holds")
      .def_property_readonly("pages_in_use",
                             [](const PyBoundedCache& c) {
                               return c.visit([](const auto& x) { return x.pages_in_use(); });
                             })
      .def_property_readonly("page_bytes",
                             [](const PyBoundedCache& c) {
                               return c.visit([](const auto& x) { return x.page_bytes(); });
                             })
      .def_property_readonly(
          "bytes_in_use",
          [](const PyBoundedCache& c) {
            return c.visit([](const auto& x) { return x.bytes_in_use(); });
          },
          "Bytes of the pages the sequences hold")
      .def(
          "full_cache_bytes",
          [](const PyBoundedCache& c, Index s) {
            return c.visit([&](const auto& x) { return x.full_cache_bytes(s); });
          },
          py::arg("sequence"), "Bytes a cache keeping every key of the sequence would take")
      .def(
          "open", [](PyBoundedCache& c) { return c.visit([](auto& x) { return x.open(); }); },
          "Opens a new sequence (length 0) and returns its id")
      .def(
          "close", [](PyBoundedCache& c, Index s) { c.visit([&](auto& x) { x.close(s); }); },
          py::arg("sequence"), "Closes a sequence: its pages return to the pool")
      .def(
          "is_open",
          [](const PyBoundedCache& c, Index s) {
            return c.visit([&](const auto& x) { return x.is_open(s); });
          },
          py::arg("sequence"))
      .def(
          "length",
          [](const PyBoundedCache& c, Index s) {
            return c.visit([&](const auto& x) { return x.length(s); });
          },
          py::arg("sequence"), "Tokens appended to the sequence")
      .def(
          "frontier",
          [](const PyBoundedCache& c, Index s) {
            return c.visit([&](const auto& x) { return x.frontier(s); });
          },
          py::arg("sequence"), "The first position a query of the sequence may have")
      .def(
          "first_key",
          [](const PyBoundedCache& c, Index s, Index g) {
            return c.visit([&](const auto& x) { return x.first_key(s, g); });
          },
          py::arg("sequence"), py::arg("kv_head"),
          "Position of the first key K/V head kv_head holds (a multiple of page_size)")
      .def(
          "held_pages",
          [](const PyBoundedCache& c, Index s, Index g) {
            return c.visit([&](const auto& x) { return x.held_pages(s, g); });
          },
          py::arg("sequence"), py::arg("kv_head"), "The pool pages the head holds, in order")
      .def("append", &append_bounded_tokens, py::arg("sequence"), py::arg("position"), py::arg("k"),
           py::arg("v"),
           "Appends k [m, H_kv, d] and v [m, H_kv, d_v] (the cache's dtype; bfloat16 as "
           "BFloat16Bits) at positions position .. position + m - 1 (position = length), after "
           "releasing the pages dead at `position`")
      .def(
          "advance",
          [](PyBoundedCache& c, Index s, Index t) { c.visit([&](auto& x) { x.advance(s, t); }); },
          py::arg("sequence"), py::arg("t"),
          "Moves the frontier to t (no query before t from then on) and releases the pages "
          "dead at t")
      .def(
          "attention",
          [](const PyBoundedCache& c, py::handle q, std::vector<Index> sequences,
             py::handle cu_seqlens_q, const std::string& masking, std::optional<double> scale,
             std::optional<std::vector<Index>> query_offsets, py::handle out,
             std::optional<int> threads, const std::string& precision) {
            return bounded_attend(c, q, sequences, cu_seqlens_q, masking, scale, query_offsets, out,
                                  py::none(), false, threads, precision,
                                  "BoundedKVCache.attention");
          },
          py::arg("q"), py::arg("sequences"), py::arg("cu_seqlens_q") = py::none(), py::kw_only(),
          py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
          py::arg("query_offsets") = py::none(), py::arg("out") = py::none(),
          py::arg("num_threads") = py::none(), py::arg("precision") = default_precision(),
          bounded_attention_doc)
      .def(
          "attention_with_lse",
          [](const PyBoundedCache& c, py::handle q, std::vector<Index> sequences,
             py::handle cu_seqlens_q, const std::string& masking, std::optional<double> scale,
             std::optional<std::vector<Index>> query_offsets, py::handle out, py::handle lse,
             std::optional<int> threads, const std::string& precision) {
            return bounded_attend(c, q, sequences, cu_seqlens_q, masking, scale, query_offsets, out,
                                  lse, true, threads, precision,
                                  "BoundedKVCache.attention_with_lse");
          },
          py::arg("q"), py::arg("sequences"), py::arg("cu_seqlens_q") = py::none(), py::kw_only(),
          py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
          py::arg("query_offsets") = py::none(), py::arg("out") = py::none(),
          py::arg("lse") = py::none(), py::arg("num_threads") = py::none(),
          py::arg("precision") = default_precision(),
          "attention() and the log-sum-exp, (out, lse [H_q, total_q] float32; float64 for "
          "float64)");
}

}  // namespace poslsh_python
