// poslsh: multi-head (and grouped-query) ALiBi attention, exact or by Positional LSH.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "poslsh/banded_attention.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/fused_attention.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/heads_view.hpp"
#include "poslsh/per_sample_attention.hpp"
#include "poslsh/reference_attention.hpp"
#include "poslsh/slopes.hpp"
#include "poslsh/tiled_attention.hpp"
#include "poslsh/types.hpp"

namespace poslsh {

/// How each head is computed.
enum class Method {
  lsh_fused,        ///< lsh_attention_fused (default)
  lsh_per_sample,   ///< lsh_attention_per_sample
  fixed_blocks,     ///< fixed_blocks_attention
  exact_tiled,      ///< alibi_attention_tiled (exact, streaming)
  exact_banded,     ///< alibi_attention_banded, band_for_bias_error(sigma_h, band_error)
  exact_reference,  ///< alibi_attention_reference (O(n^2) memory, checks only)
};

/// Options of multihead_attention: the attention options of every head (masking, scale)
/// and how the heads are computed.
struct MultiHeadOptions : AttentionOptions {
  Method method = Method::lsh_fused;
  /// sigma of each query head; empty means alibi_sigmas(query heads).
  std::vector<double> sigmas{};
  /// Samples s per head (LSH methods).
  Index samples = 16;
  /// Seed of the hashes: head h uses rbf_hashes(sigma_h, s, seed, stream = h).
  std::uint64_t seed = 0;
  /// exact_banded: every dropped ALiBi entry exp(-|i-j|/sigma_h) is below this, in (0, 1).
  double band_error = 1e-3;
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

/// Checks the views and options of multihead_attention (function `function`) and, when
/// `one_sequence`, q's tokens against k's (resolve_query_offset: returns p0; else 0).
template <typename Scalar>
Index require_multihead_arguments(const char* function, const HeadsView<const Scalar>& q,
                                  const HeadsView<const Scalar>& k,
                                  const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                                  const std::vector<double>& sigmas,
                                  const MultiHeadOptions& options, bool one_sequence) {
  q.validate(function, "q");
  k.validate(function, "k");
  v.validate(function, "v");
  out.validate(function, "out");
  const Index p0 = one_sequence ? resolve_query_offset(function, options.query_offset, q.tokens,
                                                       k.tokens, "k.tokens")
                                : 0;
  require(v.tokens == k.tokens, function, "v.tokens", v.tokens,
          "must equal k.tokens = " + std::to_string(k.tokens));
  require(k.dim == q.dim, function, "k.dim", k.dim, "must equal q.dim = " + std::to_string(q.dim));
  require(v.heads == k.heads, function, "v.heads", v.heads,
          "must equal k.heads = " + std::to_string(k.heads));
  require(q.heads % k.heads == 0, function, "k.heads", k.heads,
          "must divide q.heads = " + std::to_string(q.heads) + " (grouped-query attention)");
  require(
      out.tokens == q.tokens && out.heads == q.heads && out.dim == v.dim, function, "out",
      std::to_string(out.tokens) + "x" + std::to_string(out.heads) + "x" + std::to_string(out.dim),
      "must be q.tokens x q.heads x v.dim");
  require(static_cast<Index>(sigmas.size()) == q.heads, function, "options.sigmas", sigmas.size(),
          "must hold one sigma per query head");
  for (double sigma : sigmas) require_sigma(sigma, function, "options.sigmas");
  if (options.method == Method::lsh_fused || options.method == Method::lsh_per_sample) {
    require_positive(options.samples, function, "options.samples");
  }
  if (options.method == Method::exact_banded) {
    require(options.band_error > 0.0 && options.band_error < 1.0, function, "options.band_error",
            options.band_error, "must be in (0, 1)");
  }
  return p0;
}

/// Head h's output rows at positions [r0, r0 + rows) of a query tile, for the methods that
/// run query tile by query tile (fused, exact tiled, exact banded): q_h has its rows at
/// positions p0 .. p0 + q_h.rows() - 1 over the keys of k_h.
template <typename Scalar, typename QType, typename KType, typename OutType>
void multihead_tile(const MultiHeadOptions& options, const QType& q_h, const KType& k_h,
                    const KType& v_h, OutType& out_h, const HashSet* hashes, double sigma,
                    Scalar tau, Index p0, Index r0, Index rows, FusedWorkspace<Scalar>& work) {
  const bool causal = options.masking == Masking::causal;
  const ConstMatrixRef<Scalar> q_ref(q_h), k_ref(k_h), v_ref(v_h);
  if (options.method == Method::lsh_fused) {
    fused_tile<Scalar>(q_ref, k_ref, v_ref, *hashes, tau, causal, r0, rows, out_h, work, p0);
    return;
  }
  const Index n = k_ref.rows();
  const ExactWindow window =
      options.method == Method::exact_banded
          ? banded_window(n, band_for_bias_error(sigma, options.band_error), options.masking)
          : ExactWindow{causal ? 0 : -n, n};
  AlibiBias<Scalar> bias(n, sigma, window);
  TileEngine<Scalar, AlibiBias<Scalar>> engine(q_ref, k_ref, v_ref, static_cast<double>(tau), bias,
                                               work.buffers, p0);
  engine.run(r0, r0 + rows, out_h.middleRows(r0 - p0, rows));
}

inline bool runs_by_tiles(Method method) {
  return method == Method::lsh_fused || method == Method::exact_tiled ||
         method == Method::exact_banded;
}

}  // namespace detail

/// Multi-head ALiBi attention: for each query head h (group size G = H_q / H_kv, K/V head
/// h / G), out_h = method(Q_h, K_{h/G}, V_{h/G}) with sigma_h = options.sigmas[h] (default: the
/// ALiBi slopes, sigma_h = 1/m_h) and, for LSH methods, hashes rbf_hashes(sigma_h, s, seed, h).
/// Inputs and output are strided HeadsView's ([n, H, d] or [H, n, d], no copies). The fused
/// method runs all (head, query tile) pairs in one parallel loop; the others run heads in
/// parallel. Each output row is computed by one thread in a fixed order: bitwise the same
/// result for any thread count. Queries at an offset (options.query_offset = p0; unset:
/// k.tokens - q.tokens, bottom-right aligned): q holds the m tokens at positions
/// p0 .. p0 + m - 1 over the L tokens of k and v, each head as in the single-head kernels
/// (row r bitwise row p0 + r of the call on all L positions). Throws std::invalid_argument
/// naming a bad argument.
template <typename Scalar>
void multihead_attention(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                         HeadsView<const Scalar> v, HeadsView<Scalar> out,
                         const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention";
  detail::require(q.heads >= 1, function, "q.heads", q.heads, "must be >= 1");
  const std::vector<double> sigmas =
      options.sigmas.empty() ? alibi_sigmas(static_cast<int>(q.heads)) : options.sigmas;
  const Index p0 =
      detail::require_multihead_arguments(function, q, k, v, out, sigmas, options, true);
  const Index n = q.tokens;
  if (n == 0) return;
  const Index group = q.heads / k.heads;
  AttentionOptions head_options = options;
  head_options.query_offset = p0;
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, head_options, q.dim));
  const std::vector<HashSet> hashes =
      options.method == Method::lsh_fused || options.method == Method::lsh_per_sample
          ? multihead_hashes(sigmas, options.samples, options.seed)
          : std::vector<HashSet>{};
  if (options.method == Method::lsh_fused) {
    const bool causal = options.masking == Masking::causal;
    detail::run_fused_tiles<Scalar>(
        q.heads, p0, p0 + n,
        [&](Index h, Index i0, Index rows, detail::FusedWorkspace<Scalar>& work) {
          auto out_head = out.head(h);
          detail::fused_tile<Scalar>(q.head(h), k.head(h / group), v.head(h / group),
                                     hashes[static_cast<std::size_t>(h)], tau, causal, i0, rows,
                                     out_head, work, p0);
        });
    return;
  }
  const auto heads = static_cast<long>(q.heads);
#pragma omp parallel for schedule(dynamic, 1)
  for (long head = 0; head < heads; ++head) {
    const auto h = static_cast<Index>(head);
    const auto index = static_cast<std::size_t>(head);
    const auto q_h = q.head(h);
    const auto k_h = k.head(h / group);
    const auto v_h = v.head(h / group);
    auto out_h = out.head(h);
    switch (options.method) {
      case Method::lsh_per_sample:
        lsh_attention_per_sample<Scalar>(q_h, k_h, v_h, hashes[index], out_h, head_options);
        break;
      case Method::fixed_blocks:
        fixed_blocks_attention<Scalar>(q_h, k_h, v_h, sigmas[index], out_h, head_options);
        break;
      case Method::exact_tiled:
        alibi_attention_tiled<Scalar>(q_h, k_h, v_h, sigmas[index], out_h, head_options);
        break;
      case Method::exact_banded:
        alibi_attention_banded<Scalar>(q_h, k_h, v_h, sigmas[index],
                                       band_for_bias_error(sigmas[index], options.band_error),
                                       out_h, head_options);
        break;
      case Method::exact_reference:
        alibi_attention_reference<Scalar>(q_h, k_h, v_h, sigmas[index], out_h, head_options);
        break;
      case Method::lsh_fused:
        break;
    }
  }
}

}  // namespace poslsh

namespace poslsh {

namespace detail {

/// Checks cu_seqlens (named `name`): B + 1 >= 1 entries, cu[0] = 0, non-decreasing, last =
/// `tokens` (the packed buffer's token count).
inline void require_cu_seqlens(const char* function, const char* name,
                               const std::vector<std::int32_t>& cu, Index tokens) {
  require(!cu.empty(), function, name, "{}", "must hold B + 1 >= 1 entries");
  require(cu.front() == 0, function, name, cu.front(), "first entry must be 0");
  for (std::size_t b = 1; b < cu.size(); ++b) {
    require(cu[b] >= cu[b - 1], function, name,
            "[" + std::to_string(b) + "] = " + std::to_string(cu[b]),
            "must be non-decreasing (entry " + std::to_string(b - 1) + " = " +
                std::to_string(cu[b - 1]) + ")");
  }
  require(cu.back() == tokens, function, name, cu.back(),
          "last entry must equal the packed token count " + std::to_string(tokens));
}

/// Tokens [begin, end) of every head of a view (one sequence of a packed batch).
template <typename Element>
HeadsView<Element> token_range(const HeadsView<Element>& view, Index begin, Index end) {
  HeadsView<Element> range = view;
  range.data = view.data == nullptr ? nullptr : view.data + begin * view.row_stride;
  range.tokens = end - begin;
  return range;
}

}  // namespace detail

/// Multi-head ALiBi attention on a packed batch of B sequences of different lengths
/// (FlashAttention's variable-length convention): sequence b owns the query tokens
/// [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q and out and the key tokens
/// [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k and v (packed [total, H, d] or any HeadsView);
/// cu_seqlens_* are int32 of length B + 1 from 0 to the token counts. Each sequence has its own
/// positions from 0: its m_b queries sit at positions p_b .. p_b + m_b - 1 over its L_b keys,
/// p_b = query_offsets[b] when given (0 <= p_b <= L_b - m_b), else L_b - m_b (bottom-right
/// alignment). For each sequence b and query head h (K/V head h / G),
///   out_{b,h} = method(Q_{b,h}, K_{b,h/G}, V_{b,h/G}) with query offset p_b,
/// so the output equals bitwise multihead_attention on each sequence's views with
/// options.query_offset = p_b (the same sigmas and, for LSH methods, the same hashes
/// rbf_hashes(sigma_h, s, seed, h) for every sequence). The tile methods (lsh_fused,
/// exact_tiled, exact_banded) run all (sequence, query tile, head) jobs in one parallel loop,
/// the others all (sequence, head) pairs; bitwise the same for any thread count.
/// options.query_offset must be unset (per-sequence offsets are query_offsets). Empty
/// sequences are allowed. Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void multihead_attention_varlen(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                HeadsView<const Scalar> v, HeadsView<Scalar> out,
                                const std::vector<std::int32_t>& cu_seqlens_q,
                                const std::vector<std::int32_t>& cu_seqlens_k,
                                const MultiHeadOptions& options = {},
                                const std::vector<Index>& query_offsets = {}) {
  constexpr const char* function = "multihead_attention_varlen";
  detail::require(q.heads >= 1, function, "q.heads", q.heads, "must be >= 1");
  const std::vector<double> sigmas =
      options.sigmas.empty() ? alibi_sigmas(static_cast<int>(q.heads)) : options.sigmas;
  detail::require_multihead_arguments(function, q, k, v, out, sigmas, options, false);
  detail::require(!options.query_offset, function, "options.query_offset",
                  options.query_offset.value_or(0),
                  "must be unset: per-sequence offsets are the query_offsets argument");
  detail::require_cu_seqlens(function, "cu_seqlens_q", cu_seqlens_q, q.tokens);
  detail::require_cu_seqlens(function, "cu_seqlens_k", cu_seqlens_k, k.tokens);
  const std::size_t batch = cu_seqlens_q.size() - 1;
  detail::require(
      cu_seqlens_k.size() == cu_seqlens_q.size(), function, "cu_seqlens_k", cu_seqlens_k.size(),
      "must have as many entries as cu_seqlens_q (" + std::to_string(cu_seqlens_q.size()) + ")");
  detail::require(query_offsets.empty() || query_offsets.size() == batch, function, "query_offsets",
                  query_offsets.size(),
                  "must be empty or hold one offset per sequence (" + std::to_string(batch) + ")");
  std::vector<Index> offsets(batch);
  for (std::size_t b = 0; b < batch; ++b) {
    const Index m = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
    const Index L = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    offsets[b] = detail::resolve_query_offset(
        function,
        query_offsets.empty() ? std::optional<Index>{} : std::optional<Index>{query_offsets[b]}, m,
        L, "cu_seqlens_k", "query_offsets");
  }
  const Index group = q.heads / k.heads;
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, options, q.dim));
  const std::vector<HashSet> hashes =
      options.method == Method::lsh_fused || options.method == Method::lsh_per_sample
          ? multihead_hashes(sigmas, options.samples, options.seed)
          : std::vector<HashSet>{};
  const auto sequence_views = [&](std::size_t b) {
    struct Views {
      HeadsView<const Scalar> q, k, v;
      HeadsView<Scalar> out;
    };
    return Views{detail::token_range(q, cu_seqlens_q[b], cu_seqlens_q[b + 1]),
                 detail::token_range(k, cu_seqlens_k[b], cu_seqlens_k[b + 1]),
                 detail::token_range(v, cu_seqlens_k[b], cu_seqlens_k[b + 1]),
                 detail::token_range(out, cu_seqlens_q[b], cu_seqlens_q[b + 1])};
  };
  if (detail::runs_by_tiles(options.method)) {
    // Jobs: (sequence, query tile, head), heads innermost; tiles aligned in each sequence's
    // positions, as in the per-sequence call.
    struct Tile {
      std::size_t sequence;
      Index r0, rows;
    };
    std::vector<Tile> tiles;
    for (std::size_t b = 0; b < batch; ++b) {
      const Index p0 = offsets[b], end = p0 + cu_seqlens_q[b + 1] - cu_seqlens_q[b];
      for (Index i0 = p0 / detail::fused_query_tile * detail::fused_query_tile; i0 < end;
           i0 += detail::fused_query_tile) {
        const Index r0 = std::max(i0, p0);
        tiles.push_back({b, r0, std::min(i0 + detail::fused_query_tile, end) - r0});
      }
    }
    const auto jobs = static_cast<long>(tiles.size()) * static_cast<long>(q.heads);
#pragma omp parallel
    {
      detail::FusedWorkspace<Scalar> work;
#pragma omp for schedule(dynamic, 1)
      for (long job = 0; job < jobs; ++job) {
        const Tile& tile = tiles[static_cast<std::size_t>(job / q.heads)];
        const Index h = static_cast<Index>(job % q.heads);
        const auto views = sequence_views(tile.sequence);
        auto out_h = views.out.head(h);
        const auto index = static_cast<std::size_t>(h);
        detail::multihead_tile<Scalar>(options, views.q.head(h), views.k.head(h / group),
                                       views.v.head(h / group), out_h,
                                       hashes.empty() ? nullptr : &hashes[index], sigmas[index],
                                       tau, offsets[tile.sequence], tile.r0, tile.rows, work);
      }
    }
    return;
  }
  const auto jobs = static_cast<long>(batch) * static_cast<long>(q.heads);
#pragma omp parallel for schedule(dynamic, 1)
  for (long job = 0; job < jobs; ++job) {
    const auto b = static_cast<std::size_t>(job / q.heads);
    const Index h = static_cast<Index>(job % q.heads);
    const auto index = static_cast<std::size_t>(h);
    const auto views = sequence_views(b);
    if (views.q.tokens == 0) continue;
    AttentionOptions head_options = options;
    head_options.query_offset = offsets[b];
    const auto q_h = views.q.head(h);
    const auto k_h = views.k.head(h / group);
    const auto v_h = views.v.head(h / group);
    auto out_h = views.out.head(h);
    switch (options.method) {
      case Method::lsh_per_sample:
        lsh_attention_per_sample<Scalar>(q_h, k_h, v_h, hashes[index], out_h, head_options);
        break;
      case Method::fixed_blocks:
        fixed_blocks_attention<Scalar>(q_h, k_h, v_h, sigmas[index], out_h, head_options);
        break;
      case Method::exact_reference:
        alibi_attention_reference<Scalar>(q_h, k_h, v_h, sigmas[index], out_h, head_options);
        break;
      default:
        break;
    }
  }
}

}  // namespace poslsh
