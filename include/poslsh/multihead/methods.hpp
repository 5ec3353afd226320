/// \file
/// \brief The method table: every method an all-heads call can run, described once (its name,
/// whether it draws hashes, whether it takes a local window, how it is scheduled, whether it
/// has a log-sum-exp, its forward and forward with lse); the backward passes have a table of
/// their own (MethodBackward, poslsh/multihead/training.hpp), and so do the single-head kernels
/// of each method (SingleHeadKernels, poslsh/multihead/single_head.hpp).
///
/// Every all-heads entry point (multihead_attention with or without lse, its backward, packed
/// batches, paged KV caches and plans) resolves its arguments into one HeadMethod per query
/// head and reaches the kernels through visit_method_row, the one switch over Method in the
/// library (visit_method: the forward table): adding a method is one enumerator, one row of its
/// name table, one MethodKernels, one MethodBackward and one SingleHeadKernels specialization
/// (the Python bindings bind each method's single-head kernels and traits from these rows). A
/// head's forward reads its keys through a row source (HeadForward::keys: two row-strided
/// matrices, StridedRows, or a head of a paged cache, PagedRows), so every method runs on either.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "poslsh/attention/banded.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/attention/per_sample.hpp"
#include "poslsh/core/names.hpp"
#include "poslsh/core/slopes.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/tile/alibi_bias.hpp"
#include "poslsh/detail/tile/count_bias.hpp"
#include "poslsh/detail/tile/per_sample.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"
#include "poslsh/lsh/hash.hpp"

namespace poslsh {

/// How each head of an all-heads call is computed.
enum class Method {
  lsh_fused,       ///< lsh_attention_fused: the count-weighted LSH estimator, each pair once
  lsh_per_sample,  ///< lsh_attention_per_sample: the same estimator, sample by sample
  fixed_blocks,    ///< fixed_blocks_attention: one deterministic hash of blocks 2 sigma long
  exact_tiled,     ///< alibi_attention_tiled: exact ALiBi, every pair a row can still read
  exact_banded,    ///< alibi_attention_banded: exact ALiBi on |i - j| <= W
  /// lsh_attention_mean_of_outputs: the mean over samples of plain attention on each sample's
  /// blocks (a different estimator, without a log-sum-exp)
  mean_of_outputs,
};

/// The methods' names, as the enumerators (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(Method, lsh_fused, lsh_per_sample, fixed_blocks, exact_tiled, exact_banded,
                  mean_of_outputs);

/// Options of the all-heads calls: the attention options of every head (masking, scale, query
/// offset) and how the heads are computed.
struct MultiHeadOptions : AttentionOptions {
  Method method = Method::lsh_fused;
  /// sigma of each query head; empty means alibi_sigmas(query heads).
  std::vector<double> sigmas{};
  /// Samples s per head (lsh_fused, lsh_per_sample, mean_of_outputs).
  Index samples = 16;
  /// Seed of the hashes: head h uses rbf_hashes(sigma_h, s, seed, stream = h).
  std::uint64_t seed = 0;
  /// exact_banded: W = band_for_bias_error(sigma_h, band_error), so every dropped ALiBi entry
  /// exp(-|i-j|/sigma_h) is below band_error; in (0, 1).
  double band_error = 1e-3;
  /// exact_tiled and exact_banded: a local window of keys, FlashAttention's window_size =
  /// (left, right): key j is kept for the query at position i iff
  /// i - window_left <= j <= i + window_right, as well as by the causal mask and the band;
  /// -1 leaves that side unbounded. Other methods: both -1.
  Index window_left = -1;
  Index window_right = -1;
};

/// One query head's method with its parameters, resolved from MultiHeadOptions or a plan.
struct HeadMethod {
  Method method = Method::lsh_fused;
  double sigma = 1.0;
  /// exact_banded: the band W.
  Index band = 0;
  /// exact_tiled, exact_banded: MultiHeadOptions::window_left and window_right (-1 unbounded).
  Index window_left = -1;
  Index window_right = -1;
  /// lsh_fused, lsh_per_sample, mean_of_outputs: the samples; fixed_blocks:
  /// {fixed_blocks_hash(sigma)}.
  HashSet hashes{};
};

/// The hash set of every query head: rbf_hashes(sigma_h, s, seed, h).
inline std::vector<HashSet> multihead_hashes(const std::vector<double>& sigmas, Index samples,
                                             std::uint64_t seed) {
  std::vector<HashSet> hashes;
  hashes.reserve(sigmas.size());
  for (std::size_t h = 0; h < sigmas.size(); ++h) {
    hashes.push_back(rbf_hashes(sigmas[h], samples, seed, h));
  }
  return hashes;
}

namespace detail {

/// One head's views and scalars for a forward job: Q rows at positions p0 .. over the keys of
/// the row source `keys` (Rows: StridedRows over K and V matrices, or PagedRows over a head of
/// a paged cache; keys stored as Rows::storage) at positions k0 .., scale tau, masking, the
/// precision of half-precision products.
template <typename QType, typename Rows, typename OutType>
struct HeadForward {
  const QType& q;
  const Rows& keys;
  OutType& out;
  double tau;
  Masking masking;
  Index p0;
  Precision precision;
  Index k0 = 0;

  /// One past the last position of a query or a key.
  Index extent() const { return std::max(p0 + q.rows(), k0 + keys.rows()); }
};

/// The kernels of the methods evaluated by the tile engine query tile by query tile, under the
/// policy Kernels::tile_bias(head, extent, masking, workspace) (exact ALiBi or LSH counts, over
/// the positions [0, extent) of the queries and keys):
/// forward_tile computes rows [r0, r0 + rows) (positions) of one head into out rows r0 - p0 ..,
/// and their lse (lse[r] for row r0 + r) when lse is not null, AMX products on the tile layer
/// AmxTiles (with_row_source_engine).
template <typename Kernels>
struct QueryTileMethod {
  static constexpr bool runs_by_query_tiles = true;
  static constexpr bool has_lse = true;

  template <typename Compute, typename QScalar, template <typename> class AmxTiles = AmxNativeTiles,
            typename QType, typename Rows, typename OutType>
  static void forward_tile(const HeadMethod& head, const HeadForward<QType, Rows, OutType>& f,
                           Index r0, Index rows, Compute* lse, TileWorkspace<Compute>& work) {
    auto bias = Kernels::template tile_bias<Compute>(head, f.extent(), f.masking, work);
    const ConstMatrixRef<QScalar> q(f.q);
    with_row_source_engine<Compute, QScalar, AmxTiles>(
        q, f.keys, f.tau, bias, work.buffers, TilePositions(f.p0, f.k0), f.precision,
        [&](auto& engine) { engine.run(r0, r0 + rows, f.out.middleRows(r0 - f.p0, rows), lse); });
  }
};

/// The kernels of the methods that run a whole head at once (sample by sample).
struct WholeHeadMethod {
  static constexpr bool runs_by_query_tiles = false;
  static constexpr bool reads_every_key = false;
};

template <Method M>
struct MethodKernels;

/// The exact window lo <= i - j <= hi of a head: every key (tiled) or the band (banded),
/// narrowed to the head's local window (hi <= window_left, lo >= -window_right).
inline ExactWindow head_window(const HeadMethod& head, Index keys, Masking masking) {
  ExactWindow window = head.method == Method::exact_banded ? banded_window(keys, head.band, masking)
                                                           : full_window(keys, masking);
  if (head.window_left >= 0) window.hi = std::min(window.hi, head.window_left);
  if (head.window_right >= 0) window.lo = std::max(window.lo, -head.window_right);
  return window;
}

/// exact_tiled and exact_banded: the ALiBi bias on the tile engine over the head's window.
template <Method M>
struct ExactMethodKernels : QueryTileMethod<ExactMethodKernels<M>> {
  static constexpr bool draws_hashes = false;
  static constexpr bool takes_window = true;
  static constexpr bool reads_every_key = M == Method::exact_tiled;

  template <typename Compute>
  static AlibiBias<Compute> tile_bias(const HeadMethod& head, Index keys, Masking masking,
                                      TileWorkspace<Compute>&) {
    return AlibiBias<Compute>(keys, head.sigma, head_window(head, keys, masking));
  }
};

template <>
struct MethodKernels<Method::exact_tiled> : ExactMethodKernels<Method::exact_tiled> {};
template <>
struct MethodKernels<Method::exact_banded> : ExactMethodKernels<Method::exact_banded> {};

/// lsh_fused: the count tiles of the head's hashes on the tile engine.
template <>
struct MethodKernels<Method::lsh_fused> : QueryTileMethod<MethodKernels<Method::lsh_fused>> {
  static constexpr bool draws_hashes = true;
  static constexpr bool takes_window = false;
  static constexpr bool reads_every_key = false;

  template <typename Compute>
  static CountBias<Compute> tile_bias(const HeadMethod& head, Index keys, Masking masking,
                                      TileWorkspace<Compute>& work) {
    return CountBias<Compute>(head.hashes, keys, masking == Masking::causal, work.counts,
                              work.count_tile);
  }
};

/// The methods that run a whole head per job on the samples of its hashes: lsh_per_sample and
/// fixed_blocks (per_sample_rows; fixed_blocks on the single hash of fixed blocks), and
/// mean_of_outputs, the mean of the s per-sample attentions (mean_of_outputs_rows). The latter
/// has no log-sum-exp (poslsh/training/mean_of_outputs.hpp): the calls with lse reject it
/// (require_methods_with_lse).
template <Method M>
struct WholeHeadMethodKernels : WholeHeadMethod {
  static constexpr bool draws_hashes = M != Method::fixed_blocks;
  static constexpr bool takes_window = false;
  static constexpr bool has_lse = M != Method::mean_of_outputs;

  /// The head's rows at positions p0 .. p0 + q.rows() - 1, and their lse when lse is not null.
  template <typename Compute, typename QScalar, template <typename> class AmxTiles = AmxNativeTiles,
            typename QType, typename Rows, typename OutType>
  static void forward_head(const HeadMethod& head, const HeadForward<QType, Rows, OutType>& f,
                           Compute* lse) {
    using OutScalar = typename OutType::Scalar;
    const ConstMatrixRef<QScalar> q(f.q);
    MatrixRef<OutScalar> out = f.out;
    const auto tau = static_cast<Compute>(f.tau);
    const bool causal = f.masking == Masking::causal;
    if constexpr (has_lse) {
      per_sample_rows<QScalar, OutScalar, Compute, AmxTiles>(
          q, f.keys, head.hashes, tau, causal, TilePositions(f.p0, f.k0), f.precision, out, lse);
    } else {
      // Reached only past a caller that skipped require_methods_with_lse: the parallel loop
      // hands the exception to the caller.
      if (lse != nullptr)
        throw_invalid("multihead_attention", "options.method", enum_name(Method::mean_of_outputs),
                      "has no log-sum-exp");
      mean_of_outputs_rows<QScalar, OutScalar, Compute, AmxTiles>(
          q, f.keys, head.hashes, tau, causal, TilePositions(f.p0, f.k0), f.precision, out);
    }
  }
};

template <>
struct MethodKernels<Method::lsh_per_sample> : WholeHeadMethodKernels<Method::lsh_per_sample> {};
template <>
struct MethodKernels<Method::fixed_blocks> : WholeHeadMethodKernels<Method::fixed_blocks> {};
template <>
struct MethodKernels<Method::mean_of_outputs> : WholeHeadMethodKernels<Method::mean_of_outputs> {};

/// visitor(Table<method>{}): the one switch from a run-time Method to its row of a table
/// (MethodKernels, the forward table; MethodBackward, the backward table).
template <template <Method> class Table, typename Visitor>
constexpr decltype(auto) visit_method_row(Method method, Visitor&& visitor) {
  switch (method) {
    case Method::lsh_per_sample:
      return visitor(Table<Method::lsh_per_sample>{});
    case Method::fixed_blocks:
      return visitor(Table<Method::fixed_blocks>{});
    case Method::exact_tiled:
      return visitor(Table<Method::exact_tiled>{});
    case Method::exact_banded:
      return visitor(Table<Method::exact_banded>{});
    case Method::mean_of_outputs:
      return visitor(Table<Method::mean_of_outputs>{});
    case Method::lsh_fused:
      break;
  }
  return visitor(Table<Method::lsh_fused>{});
}

/// visitor(MethodKernels<method>{}): the forward table's row of a run-time Method.
template <typename Visitor>
constexpr decltype(auto) visit_method(Method method, Visitor&& visitor) {
  return visit_method_row<MethodKernels>(method, std::forward<Visitor>(visitor));
}

}  // namespace detail

/// Whether a method draws random hashes (lsh_fused, lsh_per_sample, mean_of_outputs).
constexpr bool method_draws_hashes(Method method) {
  return detail::visit_method(method, [](auto kernels) { return decltype(kernels)::draws_hashes; });
}

/// Whether a method takes a local window of keys (MultiHeadOptions::window_left and
/// window_right: exact_tiled, exact_banded); the others weight the keys of their estimator.
constexpr bool method_takes_window(Method method) {
  return detail::visit_method(method, [](auto kernels) { return decltype(kernels)::takes_window; });
}

/// Whether a method weights its keys by the blocks of its hashes (lsh_fused, lsh_per_sample,
/// fixed_blocks, mean_of_outputs: the bins of positions, so a key's weight for a query depends
/// on where both sit in the sequence) rather than by a window of distances: the methods that do
/// not take a window.
constexpr bool method_weights_from_hashes(Method method) { return !method_takes_window(method); }

/// Whether a method's query tiles read every key before them (exact_tiled), rather than a
/// short key range near their rows (the job order of the all-heads calls follows it).
constexpr bool method_reads_every_key(Method method) {
  return detail::visit_method(method,
                              [](auto kernels) { return decltype(kernels)::reads_every_key; });
}

/// Whether a method runs by query tiles on the tile engine (lsh_fused, exact_tiled,
/// exact_banded); the others run whole heads.
constexpr bool method_runs_by_query_tiles(Method method) {
  return detail::visit_method(method,
                              [](auto kernels) { return decltype(kernels)::runs_by_query_tiles; });
}

/// Whether a method has a log-sum-exp (every method but mean_of_outputs): the forwards with lse
/// and the merges of partial results over key slices need one.
constexpr bool method_has_lse(Method method) {
  return detail::visit_method(method, [](auto kernels) { return decltype(kernels)::has_lse; });
}

}  // namespace poslsh
