// poslsh Python bindings: context parallelism (poslsh/parallel/): the shards of a sequence over
// ranks, the plan (which rows each rank reads), its traffic, one rank's halo messages and K/V
// ring, and the slice backward. poslsh.distributed moves the buffers these pack over
// torch.distributed; every piece of attention arithmetic is here.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "arrays.hpp"
#include "common.hpp"
#include "dtypes.hpp"
#include "multihead.hpp"
#include "poslsh/parallel/context_parallel.hpp"

namespace poslsh_python {

namespace {

using poslsh::ContextParallelChunk;
using poslsh::ContextParallelPlan;
using poslsh::HaloPass;
using poslsh::PositionRange;
using Shards = std::vector<std::vector<std::pair<Index, Index>>>;

py::tuple range_tuple(const PositionRange& range) { return py::make_tuple(range.begin, range.end); }

py::list range_list(const std::vector<PositionRange>& ranges) {
  py::list list;
  for (const PositionRange& range : ranges) list.append(range_tuple(range));
  return list;
}

/// The arguments of a plan: the shards of every rank, the heads and the options.
struct PlanArguments {
  Index n = 0;
  std::string layout;
  std::vector<std::vector<PositionRange>> shards;
  Index query_heads = 1;
  Index kv_heads = 1;
  poslsh::MultiHeadOptions options;
};

PlanArguments plan_arguments(const char* function, Index n, Index ranks, Index query_heads,
                             std::optional<Index> kv_heads, const std::string& layout,
                             const std::string& method, const std::string& masking,
                             std::optional<double> scale, std::optional<std::vector<double>> sigmas,
                             Index samples, std::uint64_t seed, double band_error,
                             std::pair<Index, Index> window, const std::optional<Shards>& shards) {
  PlanArguments a;
  a.options = heads_keywords(function, "nhd", method, masking, scale, sigmas, samples, seed,
                             band_error, window)
                  .options;
  const auto shard_layout = poslsh::enum_from_name<poslsh::ShardLayout>(layout, function, "layout");
  a.n = n;
  a.layout = layout;
  a.query_heads = query_heads;
  a.kv_heads = kv_heads.value_or(query_heads);
  if (shards) {
    if (static_cast<Index>(shards->size()) != ranks)
      throw py::value_error(argument(function, "shards") + " holds " +
                            std::to_string(shards->size()) +
                            " ranks' ranges; must hold ranks = " + std::to_string(ranks));
    for (const auto& rank_ranges : *shards) {
      a.shards.emplace_back();
      for (const auto& range : rank_ranges) a.shards.back().push_back({range.first, range.second});
    }
  } else {
    a.shards = poslsh::layout_shards(n, ranks, shard_layout);
  }
  return a;
}

/// poslsh.ContextParallelPlan: the plan of one call and what it derives.
class PlanBinding {
 public:
  explicit PlanBinding(PlanArguments arguments) : arguments_(std::move(arguments)) {
    plan_ = poslsh::context_parallel_plan(
        arguments_.shards, arguments_.n,
        poslsh::resolve_head_methods(arguments_.query_heads, arguments_.options),
        arguments_.kv_heads, arguments_.options.masking);
  }

  const ContextParallelPlan& plan() const { return plan_; }
  const PlanArguments& arguments() const { return arguments_; }

  py::list chunks() const {
    py::list ranks;
    for (const auto& chunks : plan_.chunks) {
      py::list list;
      for (const ContextParallelChunk& chunk : chunks) {
        py::dict entry;
        entry["queries"] = range_tuple(chunk.queries);
        entry["keys"] = range_list(chunk.keys);
        entry["key_span"] = range_tuple(chunk.key_span);
        entry["window"] = range_list(chunk.window);
        entry["window_span"] = range_tuple(chunk.window_span);
        list.append(entry);
      }
      ranks.append(list);
    }
    return ranks;
  }

  py::dict as_dict() const {
    py::dict result;
    result["n"] = plan_.n;
    result["ranks"] = plan_.ranks;
    result["layout"] = arguments_.layout;
    result["ring"] = plan_.ring;
    result["chunks"] = chunks();
    return result;
  }

  /// One field of every chunk as an int64 array: (R, C, 2) or per K/V head (R, C, H_kv, 2).
  py::array_t<std::int64_t> ranges(const std::string& name) const {
    constexpr const char* function = "ContextParallelPlan.ranges";
    const bool per_head = name == "keys" || name == "window";
    if (!per_head && name != "queries" && name != "key_span" && name != "window_span")
      throw py::value_error(argument(function, "name") + " = '" + name +
                            "': must be 'queries', 'keys', 'key_span', 'window' or 'window_span'");
    const auto chunks = static_cast<py::ssize_t>(plan_.chunks.front().size());
    for (const auto& rank_chunks : plan_.chunks)
      if (static_cast<py::ssize_t>(rank_chunks.size()) != chunks)
        throw py::value_error(std::string("poslsh: ") + function +
                              ": the ranks hold different numbers of ranges: use .chunks");
    const auto R = static_cast<py::ssize_t>(plan_.ranks),
               G = static_cast<py::ssize_t>(plan_.kv_heads);
    std::vector<py::ssize_t> shape = {R, chunks};
    if (per_head) shape.push_back(G);
    shape.push_back(2);
    py::array_t<std::int64_t> out(shape);
    std::int64_t* data = out.mutable_data();
    for (const auto& rank_chunks : plan_.chunks)
      for (const ContextParallelChunk& chunk : rank_chunks) {
        if (per_head) {
          for (const PositionRange& range : name == "keys" ? chunk.keys : chunk.window) {
            *data++ = range.begin;
            *data++ = range.end;
          }
        } else {
          const PositionRange range = name == "queries"    ? chunk.queries
                                      : name == "key_span" ? chunk.key_span
                                                           : chunk.window_span;
          *data++ = range.begin;
          *data++ = range.end;
        }
      }
    return out;
  }

  py::dict traffic(Index head_dim, Index value_dim, Index itemsize, const std::string& transport,
                   std::optional<std::vector<bool>> kv_heads_used) const {
    constexpr const char* function = "ContextParallelPlan.traffic";
    if (transport != "halo" && transport != "ring")
      throw py::value_error(argument(function, "transport") + " = '" + transport +
                            "': must be 'halo' or 'ring'");
    const poslsh::ContextParallelShapes shapes{plan_.query_heads, plan_.kv_heads, head_dim,
                                               value_dim};
    const std::vector<bool> used = kv_heads_used.value_or(std::vector<bool>{});
    const poslsh::ContextParallelTraffic t =
        transport == "halo" ? poslsh::halo_traffic(plan_, shapes, itemsize, used)
                            : poslsh::ring_traffic(plan_, shapes, itemsize, used);
    py::dict result;
    const auto vector = [](const std::vector<Index>& values) {
      py::array_t<std::int64_t> array(static_cast<py::ssize_t>(values.size()));
      std::copy(values.begin(), values.end(), array.mutable_data());
      return array;
    };
    result["forward_bytes_received"] = vector(t.forward_received);
    result["forward_bytes_sent"] = vector(t.forward_sent);
    result["backward_bytes_received"] = vector(t.backward_received);
    result["backward_bytes_sent"] = vector(t.backward_sent);
    result["forward_messages"] = vector(t.forward_messages);
    result["backward_messages"] = vector(t.backward_messages);
    if (transport == "ring") {
      const Index heads = used.empty()
                              ? plan_.kv_heads
                              : static_cast<Index>(std::count(used.begin(), used.end(), true));
      result["row_bytes"] = heads * (head_dim + value_dim) * itemsize;
    } else {
      result["forward_row_bytes"] = poslsh::halo_row_elements(shapes, HaloPass::forward) * itemsize;
      result["backward_row_bytes"] =
          poslsh::halo_row_elements(shapes, HaloPass::backward) * itemsize;
      result["forward_peers_in"] = vector(t.forward_peers_in);
      result["forward_peers_out"] = vector(t.forward_peers_out);
      result["backward_peers_in"] = vector(t.backward_peers_in);
      result["backward_peers_out"] = vector(t.backward_peers_out);
      for (const auto& [key, rows] : {std::pair{"forward_rows", &t.forward_rows},
                                      std::pair{"backward_rows", &t.backward_rows}}) {
        py::array_t<std::int64_t> array(
            {static_cast<py::ssize_t>(plan_.ranks), static_cast<py::ssize_t>(plan_.kv_heads)});
        std::int64_t* data = array.mutable_data();
        for (const auto& per_rank : *rows) data = std::copy(per_rank.begin(), per_rank.end(), data);
        result[key] = array;
      }
    }
    return result;
  }

 private:
  PlanArguments arguments_;
  ContextParallelPlan plan_;
};

/// The keywords of plan_arguments as a callable for pybind11 (its parameters without the
/// function name, which messages use): PlanBinding(plan_arguments(function, ...)) and, with
/// `as_dict`, that plan's dict.
template <typename... Keywords>
auto plan_maker(const char* function, PlanArguments (*arguments)(const char*, Keywords...)) {
  return [function, arguments](Keywords... keywords) {
    return PlanBinding(arguments(function, std::forward<Keywords>(keywords)...));
  };
}

template <typename... Keywords>
auto plan_dict_maker(const char* function, PlanArguments (*arguments)(const char*, Keywords...)) {
  return [function, arguments](Keywords... keywords) {
    return PlanBinding(arguments(function, std::forward<Keywords>(keywords)...)).as_dict();
  };
}

HaloPass pass_of(const std::string& name, const char* function) {
  return poslsh::enum_from_name<HaloPass>(name, function, "phase");
}

/// A 1-D contiguous array of storage S (a message buffer).
template <typename S>
std::pair<const S*, Index> flat_buffer(py::handle object, const char* function, const char* name) {
  const py::array array = storage_array<S>(object, function, name, "q");
  if (array.ndim() != 1 ||
      (array.size() > 1 && array.strides(0) != static_cast<py::ssize_t>(sizeof(S))))
    throw py::value_error(argument(function, name) + " must be a contiguous 1-D array");
  return {static_cast<const S*>(array.data()), static_cast<Index>(array.size())};
}

/// The buffers received from every rank (None for the rank itself, or for no message).
template <typename S>
std::vector<poslsh::MessageView<S>> message_views(const py::list& messages, const char* function) {
  std::vector<poslsh::MessageView<S>> views;
  for (const py::handle message : messages) {
    if (message.is_none()) {
      views.emplace_back(nullptr, 0);
    } else {
      const auto [data, size] = flat_buffer<S>(message, function, "messages");
      views.emplace_back(data, size);
    }
  }
  return views;
}

/// A new 1-D array of S with `size` elements.
template <typename S>
py::array_t<S> new_buffer(Index size) {
  return py::array_t<S>(static_cast<py::ssize_t>(size));
}

/// A new [tokens, heads, dim] array of S and its view.
template <typename S>
struct NewHeads {
  py::array_t<S> array;
  poslsh::HeadsView<S> view;
};

template <typename S>
NewHeads<S> new_heads(Index tokens, Index heads, Index dim) {
  py::array_t<S> array({static_cast<py::ssize_t>(tokens), static_cast<py::ssize_t>(heads),
                        static_cast<py::ssize_t>(dim)});
  return {array, poslsh::interleaved_heads<S>(array.mutable_data(), tokens, heads, dim)};
}

class RankBinding;

/// poslsh.ContextParallelRank's ring objects: a RingForward or RingBackward of the dtype of the
/// first call (float32 or float64).
template <template <typename> class Ring>
class RingBinding {
 public:
  explicit RingBinding(const RankBinding& rank) : rank_(rank) {}

  /// The ring of scalar S, made on first use; TypeError naming q if another dtype was used.
  template <typename S>
  Ring<S>& ring(const char* function);

 protected:
  const RankBinding& rank_;
  std::variant<std::monostate, std::unique_ptr<Ring<float>>, std::unique_ptr<Ring<double>>> ring_;
};

/// poslsh.ContextParallelRank: one rank of a call (poslsh::ContextParallelRank).
class RankBinding {
 public:
  RankBinding(const PlanBinding& plan, Index rank, Index head_dim, Index value_dim,
              std::optional<int> threads)
      : threads_(thread_count(threads, "ContextParallelPlan.rank")) {
    const PlanArguments& a = plan.arguments();
    rank_ = std::make_unique<poslsh::ContextParallelRank>(
        a.shards, a.n, rank,
        poslsh::ContextParallelShapes{a.query_heads, a.kv_heads, head_dim, value_dim}, a.options);
  }

  const poslsh::ContextParallelRank& me() const { return *rank_; }
  std::optional<int> threads() const { return threads_; }

  /// q, k, v (and out, dout, lse for the backward) of this rank as RankTensors of S.
  template <typename S>
  poslsh::RankTensors<S> tensors(const char* function, py::handle q, py::handle k, py::handle v,
                                 py::handle out, py::handle dout, py::handle lse) const {
    const Layout layout = layout_of("nhd", function);
    poslsh::RankTensors<S> t;
    t.q = heads_input<S>(q, layout, function, "q", "q");
    t.k = heads_input<S>(k, layout, function, "k", "q");
    t.v = heads_input<S>(v, layout, function, "v", "q");
    if (!out.is_none()) t.out = heads_input<S>(out, layout, function, "out", "q");
    if (!dout.is_none()) t.dout = heads_input<S>(dout, layout, function, "dout", "q");
    if (!lse.is_none()) {
      const InputMap<S> map = input_matrix<S>(lse, function, "lse", "q");
      if (map.rows() != me().shapes().query_heads || map.cols() != me().rows())
        throw py::value_error(argument(function, "lse") + " must have shape (" +
                              std::to_string(me().shapes().query_heads) + ", " +
                              std::to_string(me().rows()) + ")");
      t.lse = map.data();
      t.lse_stride = map.outerStride();
    }
    return t;
  }

  py::object pack(Index peer, const std::string& phase, py::handle q, py::handle k, py::handle v,
                  py::handle out, py::handle dout, py::handle lse) const {
    constexpr const char* function = "ContextParallelRank.pack";
    const HaloPass pass = pass_of(phase, function);
    return dispatch(function, {q}, [&](auto types) -> py::object {
      using S = typename decltype(types)::q;
      const poslsh::RankTensors<S> t = tensors<S>(function, q, k, v, out, dout, lse);
      auto buffer = new_buffer<S>(me().sent_elements(peer, pass));
      S* data = buffer.mutable_data();
      run_kernel(threads_, [&] { poslsh::pack_halo_message(me(), peer, pass, t, data); });
      return buffer;
    });
  }

  py::tuple halo_forward(py::handle q, py::handle k, py::handle v, const py::list& messages) const {
    constexpr const char* function = "ContextParallelRank.halo_forward";
    return dispatch(function, {q}, [&](auto types) -> py::tuple {
      using S = typename decltype(types)::q;
      const poslsh::RankTensors<S> t =
          tensors<S>(function, q, k, v, py::none(), py::none(), py::none());
      const auto views = message_views<S>(messages, function);
      const poslsh::ContextParallelShapes& s = me().shapes();
      const NewHeads<S> out = new_heads<S>(me().rows(), s.query_heads, s.value_dim);
      py::array_t<S> lse(
          {static_cast<py::ssize_t>(s.query_heads), static_cast<py::ssize_t>(me().rows())});
      Eigen::Map<poslsh::RowMatrix<S>> lse_map(lse.mutable_data(), s.query_heads, me().rows());
      run_kernel(threads_, [&] { poslsh::halo_forward<S>(me(), t, views, out.view, lse_map); });
      return py::make_tuple(out.array, lse);
    });
  }

  py::tuple halo_backward(py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
                          py::handle dout, const py::list& messages) const {
    constexpr const char* function = "ContextParallelRank.halo_backward";
    return dispatch(function, {q}, [&](auto types) -> py::tuple {
      using S = typename decltype(types)::q;
      const poslsh::RankTensors<S> t = tensors<S>(function, q, k, v, out, dout, lse);
      const auto views = message_views<S>(messages, function);
      const poslsh::ContextParallelShapes& s = me().shapes();
      const NewHeads<S> dq = new_heads<S>(me().rows(), s.query_heads, s.head_dim);
      const NewHeads<S> dk = new_heads<S>(me().rows(), s.kv_heads, s.head_dim);
      const NewHeads<S> dv = new_heads<S>(me().rows(), s.kv_heads, s.value_dim);
      run_kernel(threads_,
                 [&] { poslsh::halo_backward<S>(me(), t, views, dq.view, dk.view, dv.view); });
      return py::make_tuple(dq.array, dk.array, dv.array);
    });
  }

  py::object pack_ring_shard(py::handle k, py::handle v) const {
    constexpr const char* function = "ContextParallelRank.pack_ring_shard";
    return dispatch(function, {k}, [&](auto types) -> py::object {
      using S = typename decltype(types)::q;
      const Layout layout = layout_of("nhd", function);
      const auto k_view = heads_input<S>(k, layout, function, "k", "k");
      const auto v_view = heads_input<S>(v, layout, function, "v", "k");
      const poslsh::ContextParallelShapes& s = me().shapes();
      poslsh::detail::require_view_shape(function, "k", k_view, me().rows(), s.kv_heads,
                                         s.head_dim);
      poslsh::detail::require_view_shape(function, "v", v_view, me().rows(), s.kv_heads,
                                         s.value_dim);
      auto buffer = new_buffer<S>(poslsh::ring_shard_elements(me(), me().rank()));
      poslsh::pack_ring_shard(k_view, v_view, buffer.mutable_data());
      return buffer;
    });
  }

 private:
  std::unique_ptr<poslsh::ContextParallelRank> rank_;  // a stable address for the rings
  std::optional<int> threads_;
};

template <template <typename> class Ring>
template <typename S>
Ring<S>& RingBinding<Ring>::ring(const char* function) {
  if (std::holds_alternative<std::monostate>(ring_)) ring_ = std::make_unique<Ring<S>>(rank_.me());
  auto* ring = std::get_if<std::unique_ptr<Ring<S>>>(&ring_);
  if (ring == nullptr)
    throw py::type_error(argument(function, "q") + " has dtype " + numpy_dtype<S>() +
                         ": the ring's earlier calls had another dtype");
  return **ring;
}

/// The K/V views of a ring buffer of `source`'s shard.
template <typename S>
std::pair<poslsh::HeadsView<const S>, poslsh::HeadsView<const S>> shard_views(
    const poslsh::ContextParallelRank& me, Index source, py::handle shard, const char* function) {
  poslsh::detail::require(source >= 0 && source < me.ranks(), function, "source", source,
                          "must be in [0, ranks)");
  const auto [data, size] = flat_buffer<S>(shard, function, "shard");
  if (size != poslsh::ring_shard_elements(me, source))
    throw py::value_error(argument(function, "shard") + " holds " + std::to_string(size) +
                          " elements: rank " + std::to_string(source) + "'s shard has " +
                          std::to_string(poslsh::ring_shard_elements(me, source)));
  return poslsh::ring_shard_views(me, source, data);
}

class RingForwardBinding : public RingBinding<poslsh::RingForward> {
 public:
  using RingBinding::RingBinding;

  void add(py::handle q, Index source, py::handle shard) {
    constexpr const char* function = "RingForward.add";
    dispatch(function, {q}, [&](auto types) -> py::object {
      using S = typename decltype(types)::q;
      const auto q_view = heads_input<S>(q, layout_of("nhd", function), function, "q", "q");
      const auto kv = shard_views<S>(rank_.me(), source, shard, function);
      poslsh::RingForward<S>& forward = ring<S>(function);
      run_kernel(rank_.threads(), [&] { forward.add(q_view, source, kv.first, kv.second); });
      return py::none();
    });
  }

  py::tuple result() {
    constexpr const char* function = "RingForward.result";
    const poslsh::ContextParallelShapes& s = rank_.me().shapes();
    const Index m = rank_.me().rows();
    const auto make = [&](auto& forward, auto tag) -> py::tuple {
      using S = decltype(tag);
      const NewHeads<S> out = new_heads<S>(m, s.query_heads, s.value_dim);
      py::array_t<S> lse({static_cast<py::ssize_t>(s.query_heads), static_cast<py::ssize_t>(m)});
      Eigen::Map<poslsh::RowMatrix<S>> lse_map(lse.mutable_data(), s.query_heads, m);
      forward.result(out.view, lse_map);
      return py::make_tuple(out.array, lse);
    };
    if (auto* ring = std::get_if<std::unique_ptr<poslsh::RingForward<float>>>(&ring_))
      return make(**ring, float{});
    if (auto* ring = std::get_if<std::unique_ptr<poslsh::RingForward<double>>>(&ring_))
      return make(**ring, double{});
    throw py::value_error(std::string("poslsh: ") + function + ": no shard was added");
  }
};

class RingBackwardBinding : public RingBinding<poslsh::RingBackward> {
 public:
  using RingBinding::RingBinding;

  void add(py::handle q, py::handle out, py::handle lse, py::handle dout, Index source,
           py::handle shard) {
    constexpr const char* function = "RingBackward.add";
    dispatch(function, {q}, [&](auto types) -> py::object {
      using S = typename decltype(types)::q;
      const Layout layout = layout_of("nhd", function);
      const auto q_view = heads_input<S>(q, layout, function, "q", "q");
      const auto out_view = heads_input<S>(out, layout, function, "out", "q");
      const auto dout_view = heads_input<S>(dout, layout, function, "dout", "q");
      const InputMap<S> lse_map = input_matrix<S>(lse, function, "lse", "q");
      const auto kv = shard_views<S>(rank_.me(), source, shard, function);
      poslsh::RingBackward<S>& backward = ring<S>(function);
      run_kernel(rank_.threads(), [&] {
        backward.add(q_view, out_view, lse_map, dout_view, source, kv.first, kv.second);
      });
      return py::none();
    });
  }

  py::object partial(Index source) const {
    const auto copy = [](const auto& values) {
      using S = typename std::decay_t<decltype(values)>::value_type;
      auto buffer = new_buffer<S>(static_cast<Index>(values.size()));
      std::copy(values.begin(), values.end(), buffer.mutable_data());
      return py::object(buffer);
    };
    if (auto* ring = std::get_if<std::unique_ptr<poslsh::RingBackward<float>>>(&ring_))
      return copy((*ring)->partial(source));
    if (auto* ring = std::get_if<std::unique_ptr<poslsh::RingBackward<double>>>(&ring_))
      return copy((*ring)->partial(source));
    throw py::value_error("poslsh: RingBackward.partial: no shard was added");
  }

  py::tuple result(const py::list& received) const {
    constexpr const char* function = "RingBackward.result";
    const poslsh::ContextParallelShapes& s = rank_.me().shapes();
    const Index m = rank_.me().rows();
    const auto make = [&](const auto& backward, auto tag) -> py::tuple {
      using S = decltype(tag);
      const auto views = message_views<S>(received, function);
      const NewHeads<S> dq = new_heads<S>(m, s.query_heads, s.head_dim);
      const NewHeads<S> dk = new_heads<S>(m, s.kv_heads, s.head_dim);
      const NewHeads<S> dv = new_heads<S>(m, s.kv_heads, s.value_dim);
      backward.result(views, dq.view, dk.view, dv.view);
      return py::make_tuple(dq.array, dk.array, dv.array);
    };
    if (auto* ring = std::get_if<std::unique_ptr<poslsh::RingBackward<float>>>(&ring_))
      return make(**ring, float{});
    if (auto* ring = std::get_if<std::unique_ptr<poslsh::RingBackward<double>>>(&ring_))
      return make(**ring, double{});
    throw py::value_error(std::string("poslsh: ") + function + ": no shard was added");
  }
};

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

  const poslsh::MultiHeadOptions defaults;
  const auto plan_keywords = [&](auto&&... trailing) {
    return std::make_tuple(py::arg("n"), py::arg("ranks"), py::kw_only(), py::arg("query_heads"),
                           py::arg("kv_heads") = py::none(), py::arg("layout") = "contiguous",
                           py::arg("method") = poslsh::enum_name(defaults.method),
                           py::arg("masking") = poslsh::enum_name(defaults.masking),
                           py::arg("scale") = py::none(), py::arg("sigmas") = py::none(),
                           py::arg("samples") = defaults.samples, py::arg("seed") = defaults.seed,
                           py::arg("band_error") = defaults.band_error,
                           py::arg("window") = std::make_pair(Index{-1}, Index{-1}),
                           py::arg("shards") = py::none(), trailing...);
  };

  const char* const plan_doc = R"doc(
The transport-free plan of context parallelism for one sequence of n tokens over `ranks`
ranks (shards of `layout`, or shards=[[(begin, end), ...] per rank], ranges covering [0, n)
once; a rank's tensors hold its ranges in that order), with the heads' methods resolved from
the keywords as multihead_attention resolves them (query_heads heads read by kv_heads K/V
heads). 'ring' is True for exact_tiled without a local window (every key is needed: K and V go
around a ring). Per rank, a list of its shard ranges (one, or two for 'zigzag'), each with
  'queries'      (begin, end): the rank's own positions;
  'keys'         per K/V head, (begin, end): the keys its query heads reach (the halo with the
                 own rows; every key of nonzero weight for an own query lies inside);
  'key_span'     their union: the key buffer of the forward on the halo;
  'window'       per K/V head, (begin, end): the positions whose rows the gradients of the own
                 rows read (every pair of nonzero weight with an own query or key lies inside);
  'window_span'  their union, begin rounded down to a multiple of 64: the window of
                 multihead_attention_backward(position=), whose own rows are then bitwise the
                 single-process gradients.
)doc";

  const std::string class_doc = std::string(plan_doc) + R"doc(
Attributes n, ranks, query_heads, kv_heads, ring, layout and chunks (the list above);
as_dict() gives the dict of context_parallel_plan; ranges(name) one field as an int64 array;
traffic(...) the bytes and messages per rank; rank(...) one rank's calls.
)doc";
  py::class_<PlanBinding> plan_class(module, "ContextParallelPlan", class_doc.c_str());
  std::apply(
      [&](const auto&... arguments) {
        plan_class.def(py::init(plan_maker("ContextParallelPlan", &plan_arguments)), arguments...);
      },
      plan_keywords());
  plan_class.def_property_readonly("n", [](const PlanBinding& p) { return p.plan().n; })
      .def_property_readonly("ranks", [](const PlanBinding& p) { return p.plan().ranks; })
      .def_property_readonly("query_heads",
                             [](const PlanBinding& p) { return p.plan().query_heads; })
      .def_property_readonly("kv_heads", [](const PlanBinding& p) { return p.plan().kv_heads; })
      .def_property_readonly("ring", [](const PlanBinding& p) { return p.plan().ring; })
      .def_property_readonly("layout", [](const PlanBinding& p) { return p.arguments().layout; })
      .def_property_readonly("chunks", &PlanBinding::chunks)
      .def("as_dict", &PlanBinding::as_dict)
      .def("ranges", &PlanBinding::ranges, py::arg("name"), R"doc(
One field of every chunk as an int64 array: 'queries', 'key_span', 'window_span' of shape
(ranks, chunks, 2), 'keys' and 'window' of shape (ranks, chunks, kv_heads, 2), (begin, end) in
the last axis. Every rank must hold the same number of ranges.
)doc")
      .def("traffic", &PlanBinding::traffic, py::arg("head_dim"), py::arg("value_dim"),
           py::arg("itemsize"), py::kw_only(), py::arg("transport") = "halo",
           py::arg("kv_heads_used") = py::none(), R"doc(
The bytes and messages per rank (int64 arrays of `ranks` entries) of the halo exchange
(transport='halo', ContextParallelRank's messages) or of the K/V ring (transport='ring', for any
plan), with head dimension head_dim (q, k), value_dim (v) and elements of itemsize bytes:
'forward_bytes_received', 'forward_bytes_sent', 'backward_bytes_received',
'backward_bytes_sent' (payload; rows a rank holds itself are never counted), 'forward_messages'
and 'backward_messages' (sent plus received; empty messages are not sent); for the halo also
the peers a rank receives from and sends to ('forward_peers_in', 'forward_peers_out',
'backward_peers_in', 'backward_peers_out') and the rows it receives per K/V head
('forward_rows', 'backward_rows', shape (ranks, kv_heads)). A halo row of one K/V head is
d + d_v elements forward and d + d_v + G (d + 2 d_v + 1) backward (K, V; Q, out, dout, lse of
its G query heads); a ring row is kv_heads (d + d_v) elements, and the backward ring returns the
dK/dV partials to their owners. kv_heads_used (a bool per K/V head): only those heads travel.
)doc")
      .def(
          "rank",
          [](const PlanBinding& plan, Index rank, Index head_dim, Index value_dim,
             std::optional<int> threads) {
            return RankBinding(plan, rank, head_dim, value_dim, threads);
          },
          py::arg("rank"), py::kw_only(), py::arg("head_dim"), py::arg("value_dim"),
          py::arg("num_threads") = py::none(),
          "ContextParallelRank of rank `rank` with q, k of head dimension head_dim and v of "
          "value_dim; num_threads: the kernels' OpenMP threads (None: the default).");

  py::class_<RankBinding>(module, "ContextParallelRank", R"doc(
One rank of a context-parallel call (ContextParallelPlan.rank): its tensors hold the rows of its
ranges in order, q [m, H, d], k [m, H_kv, d], v [m, H_kv, d_v], out and dout [m, H, d_v], lse
(H, m); float32 or float64 numpy arrays ([n, H, d] layout, contiguous last axis). Halo methods:
pack(peer, phase, ...) gives the message to a peer, sent_elements / received_elements their
sizes; halo_forward and halo_backward compute this rank's rows from the messages received
(messages: one 1-D array per rank, None for itself), bitwise the single-process rows. A halo
message holds, per segment (destination chunk, K/V head g, position range) of the rows of the
sender's shard the destination reads, K then V rows of g and, backward, the Q, out, dout rows and
lse of g's query heads. Ring (exact_tiled without a local window): ring_step(step) says which
shard the rank holds and where shards go, pack_ring_shard(k, v) gives this rank's shard buffer
(K rows then V rows), ring_forward() and ring_backward() the per-rank accumulators.
)doc")
      .def_property_readonly("rank", [](const RankBinding& r) { return r.me().rank(); })
      .def_property_readonly("ranks", [](const RankBinding& r) { return r.me().ranks(); })
      .def_property_readonly("rows", [](const RankBinding& r) { return r.me().rows(); })
      .def_property_readonly("ring", [](const RankBinding& r) { return r.me().plan().ring; })
      .def(
          "sent_elements",
          [](const RankBinding& r, Index peer, const std::string& phase) {
            return r.me().sent_elements(peer, pass_of(phase, "ContextParallelRank.sent_elements"));
          },
          py::arg("peer"), py::arg("phase"),
          "Elements of the halo message this rank sends to `peer` in phase 'forward' or "
          "'backward' (0: nothing is sent).")
      .def(
          "received_elements",
          [](const RankBinding& r, Index peer, const std::string& phase) {
            return r.me().received_elements(
                peer, pass_of(phase, "ContextParallelRank.received_elements"));
          },
          py::arg("peer"), py::arg("phase"),
          "Elements of the halo message this rank receives from `peer` (0: none).")
      .def("pack", &RankBinding::pack, py::arg("peer"), py::arg("phase"), py::kw_only(),
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out") = py::none(),
           py::arg("dout") = py::none(), py::arg("lse") = py::none(),
           "The halo message from this rank to `peer` (a new 1-D array); the backward phase "
           "needs out, dout and lse too.")
      .def("halo_forward", &RankBinding::halo_forward, py::arg("q"), py::arg("k"), py::arg("v"),
           py::arg("messages"),
           "(out, lse) of this rank's rows from its q, k, v and the forward messages received.")
      .def("halo_backward", &RankBinding::halo_backward, py::arg("q"), py::arg("k"), py::arg("v"),
           py::arg("out"), py::arg("lse"), py::arg("dout"), py::arg("messages"),
           "(dq, dk, dv) of this rank's rows from its tensors and the backward messages received.")
      .def(
          "ring_step",
          [](const RankBinding& r, Index step) {
            const poslsh::RingStep s = poslsh::ring_step(r.me().ranks(), r.me().rank(), step);
            py::dict d;
            d["source"] = s.source;
            d["send_to"] = s.send_to;
            d["receive_from"] = s.receive_from;
            d["arriving"] = s.arriving;
            d["transfers"] = s.transfers;
            return d;
          },
          py::arg("step"),
          "Step `step` of the ring: the rank whose shard this rank holds ('source'), where it "
          "goes ('send_to'), where the next comes from ('receive_from'), whose it is "
          "('arriving'), and whether shards move ('transfers': not at the last step).")
      .def(
          "ring_shard_elements",
          [](const RankBinding& r, Index source) {
            poslsh::detail::require(source >= 0 && source < r.me().ranks(),
                                    "ContextParallelRank.ring_shard_elements", "source", source,
                                    "must be in [0, ranks)");
            return poslsh::ring_shard_elements(r.me(), source);
          },
          py::arg("source"), "Elements of the ring buffer of rank `source`'s shard.")
      .def("pack_ring_shard", &RankBinding::pack_ring_shard, py::arg("k"), py::arg("v"),
           "This rank's ring buffer: its K rows then its V rows (a new 1-D array).")
      .def(
          "ring_forward", [](const RankBinding& r) { return RingForwardBinding(r); },
          py::keep_alive<0, 1>(), "A RingForward for this rank.")
      .def(
          "ring_backward", [](const RankBinding& r) { return RingBackwardBinding(r); },
          py::keep_alive<0, 1>(), "A RingBackward for this rank.");

  py::class_<RingForwardBinding>(module, "RingForward", R"doc(
The forward of the K/V ring on one rank: add(q, source, shard) at every step (shard: the ring
buffer of rank `source`), then result() -> (out, lse), the slices merged by log-sum-exp in the
order of the calls (in double). Equal to the single-process rows to rounding.
)doc")
      .def("add", &RingForwardBinding::add, py::arg("q"), py::arg("source"), py::arg("shard"))
      .def("result", &RingForwardBinding::result);

  py::class_<RingBackwardBinding>(module, "RingBackward", R"doc(
The backward of the K/V ring on one rank (exact methods): add(q, out, lse, dout, source, shard)
at every step with this rank's merged forward rows (the slice backward of each pair with the
merged lse: dq added here, dK and dV into the partial of the shard's rank); partial(source)
gives what to send to rank `source`; result(received) -> (dq, dk, dv), dk and dv the partials of
this rank's shard summed in increasing rank order (received: one 1-D array per rank, None for
itself).
)doc")
      .def("add", &RingBackwardBinding::add, py::arg("q"), py::arg("out"), py::arg("lse"),
           py::arg("dout"), py::arg("source"), py::arg("shard"))
      .def("partial", &RingBackwardBinding::partial, py::arg("source"))
      .def("result", &RingBackwardBinding::result, py::arg("received"));

  const std::string function_doc =
      std::string(plan_doc) + "\nA dict: 'n', 'ranks', 'layout', 'ring' and 'chunks'.\n";
  std::apply(
      [&](const auto&... arguments) {
        module.def("context_parallel_plan",
                   plan_dict_maker("context_parallel_plan", &plan_arguments), arguments...,
                   function_doc.c_str());
      },
      plan_keywords());
}

}  // namespace poslsh_python
