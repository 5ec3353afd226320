// poslsh Python bindings: context parallelism's plan (poslsh/parallel/context_parallel.hpp):
// the shards of a sequence over ranks and the rows each rank reads. poslsh.distributed moves
// the rows over torch.distributed and calls the kernels on them.
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "multihead.hpp"
#include "poslsh/parallel/context_parallel.hpp"

namespace poslsh_python {

namespace {

py::tuple range_tuple(const poslsh::PositionRange& range) {
  return py::make_tuple(range.begin, range.end);
}

py::list range_list(const std::vector<poslsh::PositionRange>& ranges) {
  py::list list;
  for (const poslsh::PositionRange& range : ranges) list.append(range_tuple(range));
  return list;
}

}  // namespace

void register_parallel(py::module_& module) {
  module.def(
      "shard_ranges",
      [](Index n, Index ranks, Index rank, const std::string& layout) {
        const auto shard_layout =
            poslsh::enum_from_name<poslsh::ShardLayout>(layout, "shard_ranges", "layout");
        return range_list(poslsh::shard_ranges(n, ranks, rank, shard_layout));
      },
      py::arg("n"), py::arg("ranks"), py::arg("rank"), py::kw_only(),
      py::arg("layout") = "contiguous", R"doc(
The positions rank `rank` of `ranks` holds of a sequence of n tokens, as a list of
(begin, end) ranges in increasing order: 'contiguous' gives [(n r // R, n (r + 1) // R)];
'zigzag' cuts the sequence in 2R chunks [n c // 2R, n (c + 1) // 2R) and gives chunks r and
2R - 1 - r (balanced causal work). Ranges may be empty when n < R.
)doc");

  module.def(
      "context_parallel_plan",
      [](Index n, Index ranks, Index query_heads, std::optional<Index> kv_heads,
         const std::string& layout, const std::string& method, const std::string& masking,
         std::optional<double> scale, std::optional<std::vector<double>> sigmas, Index samples,
         std::uint64_t seed, double band_error, std::pair<Index, Index> window,
         std::optional<std::vector<std::vector<std::pair<Index, Index>>>> shards) {
        constexpr const char* function = "context_parallel_plan";
        const HeadsKeywords keywords = heads_keywords(function, "nhd", method, masking, scale,
                                                      sigmas, samples, seed, band_error, window);
        const auto shard_layout =
            poslsh::enum_from_name<poslsh::ShardLayout>(layout, function, "layout");
        const std::vector<poslsh::HeadMethod> heads =
            poslsh::resolve_head_methods(query_heads, keywords.options);
        const Index kv = kv_heads.value_or(query_heads);
        poslsh::ContextParallelPlan plan;
        if (shards) {
          if (static_cast<Index>(shards->size()) != ranks)
            throw py::value_error(argument(function, "shards") + " holds " +
                                  std::to_string(shards->size()) +
                                  " ranks' ranges; must hold ranks = " + std::to_string(ranks));
          std::vector<std::vector<poslsh::PositionRange>> ranges;
          for (const auto& rank_ranges : *shards) {
            ranges.emplace_back();
            for (const auto& range : rank_ranges)
              ranges.back().push_back({range.first, range.second});
          }
          plan = poslsh::context_parallel_plan(ranges, n, heads, kv, keywords.options.masking);
        } else {
          plan = poslsh::context_parallel_plan(n, ranks, shard_layout, heads, kv,
                                               keywords.options.masking);
        }
        py::list ranks_list;
        for (const auto& chunks : plan.chunks) {
          py::list chunk_list;
          for (const poslsh::ContextParallelChunk& chunk : chunks) {
            py::dict entry;
            entry["queries"] = range_tuple(chunk.queries);
            entry["keys"] = range_list(chunk.keys);
            entry["key_span"] = range_tuple(chunk.key_span);
            entry["window"] = range_list(chunk.window);
            entry["window_span"] = range_tuple(chunk.window_span);
            chunk_list.append(entry);
          }
          ranks_list.append(chunk_list);
        }
        py::dict result;
        result["n"] = plan.n;
        result["ranks"] = plan.ranks;
        result["layout"] = layout;
        result["ring"] = plan.ring;
        result["chunks"] = ranks_list;
        return result;
      },
      py::arg("n"), py::arg("ranks"), py::kw_only(), py::arg("query_heads"),
      py::arg("kv_heads") = py::none(), py::arg("layout") = "contiguous",
      py::arg("method") = poslsh::enum_name(poslsh::MultiHeadOptions{}.method),
      py::arg("masking") = poslsh::enum_name(poslsh::MultiHeadOptions{}.masking),
      py::arg("scale") = py::none(), py::arg("sigmas") = py::none(),
      py::arg("samples") = poslsh::MultiHeadOptions{}.samples,
      py::arg("seed") = poslsh::MultiHeadOptions{}.seed,
      py::arg("band_error") = poslsh::MultiHeadOptions{}.band_error,
      py::arg("window") = std::make_pair(Index{-1}, Index{-1}), py::arg("shards") = py::none(),
      R"doc(
The transport-free plan of context parallelism for one sequence of n tokens over `ranks`
ranks (shards of `layout`, or shards=[[(begin, end), ...] per rank], ranges covering [0, n)
once), with the heads' methods resolved from the keywords as multihead_attention resolves them
(query_heads heads read by kv_heads K/V heads). A dict: 'ring' (True for exact_tiled without a
local window: every key is needed, K and V go around a ring), and 'chunks': for each rank a list
of its shard ranges (one, or two for 'zigzag'), each a dict with
  'queries'      (begin, end): the rank's own positions;
  'keys'         per K/V head, (begin, end): the keys its query heads reach (the halo with the
                 own rows; every key of nonzero weight for an own query lies inside);
  'key_span'     their union: the key buffer of multihead_attention_with_lse(key_offset=);
  'window'       per K/V head, (begin, end): the positions whose rows the gradients of the own
                 rows read (every pair of nonzero weight with an own query or key lies inside);
  'window_span'  their union, begin rounded down to a multiple of 64: the window of
                 multihead_attention_backward(position=), whose own rows are then bitwise the
                 single-process gradients.
)doc");
}

}  // namespace poslsh_python
