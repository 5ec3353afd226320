// poslsh: multi-head (and grouped-query) ALiBi attention, exact or by Positional LSH.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "poslsh/attention/banded.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/core/heads_view.hpp"
#include "poslsh/attention/per_sample.hpp"
#include "poslsh/reference/attention.hpp"
#include "poslsh/core/slopes.hpp"
#include "poslsh/attention/tiled.hpp"
#include "poslsh/core/types.hpp"

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

/// Method::exact_reference is self-attention only (alibi_attention_reference): m queries at
/// offset p0 over L keys must be m = L, p0 = 0. Checked before the parallel loop over heads,
/// where a kernel's exception could not reach the caller.
inline void require_reference_self_attention(const char* function, Method method, Index m, Index L,
                                             Index p0) {
  require(method != Method::exact_reference || (m == L && p0 == 0), function, "options.method",
          "exact_reference",
          "is self-attention only: " + std::to_string(m) + " queries at offset " +
              std::to_string(p0) + " over " + std::to_string(L) +
              " keys need exact_tiled (queries at an offset)");
}

/// Checks the per-head parameters of a multi-head call: one sigma per query head, each valid;
/// samples >= 1 for the LSH methods; band_error in (0, 1) for exact_banded.
inline void require_multihead_method(const char* function, Index query_heads,
                                     const std::vector<double>& sigmas,
                                     const MultiHeadOptions& options) {
  require(static_cast<Index>(sigmas.size()) == query_heads, function, "options.sigmas",
          sigmas.size(), "must hold one sigma per query head");
  for (double sigma : sigmas) require_sigma(sigma, function, "options.sigmas");
  if (options.method == Method::lsh_fused || options.method == Method::lsh_per_sample) {
    require_positive(options.samples, function, "options.samples");
  }
  if (options.method == Method::exact_banded) {
    require(options.band_error > 0.0 && options.band_error < 1.0, function, "options.band_error",
            options.band_error, "must be in (0, 1)");
  }
}

/// Checks the views and options of multihead_attention (function `function`) and, when
/// `one_sequence`, q's tokens against k's (resolve_query_offset: returns p0; else 0).
template <typename Scalar, typename KVScalar, typename OutScalar>
Index require_multihead_arguments(const char* function, const HeadsView<const Scalar>& q,
                                  const HeadsView<const KVScalar>& k,
                                  const HeadsView<const KVScalar>& v,
                                  const HeadsView<OutScalar>& out,
                                  const std::vector<double>& sigmas,
                                  const MultiHeadOptions& options, bool one_sequence) {
  q.validate(function, "q");
  k.validate(function, "k");
  v.validate(function, "v");
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
  require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  require_multihead_method(function, q.heads, sigmas, options);
  if (one_sequence)
    require_reference_self_attention(function, options.method, q.tokens, k.tokens, p0);
  return p0;
}

/// Head h's output rows at positions [r0, r0 + rows) of a query tile, for the methods that
/// run query tile by query tile (fused, exact tiled, exact banded): q_h has its rows at
/// positions p0 .. p0 + q_h.rows() - 1 over the keys of k_h. Computed in Scalar; q_h stored
/// in QScalar, k_h and v_h in KVScalar (half-precision types are widened as they are loaded).
template <typename Scalar, typename QScalar = Scalar, typename KVScalar = QScalar, typename QType,
          typename KType, typename OutType>
void multihead_tile(const MultiHeadOptions& options, const QType& q_h, const KType& k_h,
                    const KType& v_h, OutType& out_h, const HashSet* hashes, double sigma,
                    Scalar tau, Index p0, Index r0, Index rows, FusedWorkspace<Scalar>& work) {
  const bool causal = options.masking == Masking::causal;
  const ConstMatrixRef<QScalar> q_ref(q_h);
  const ConstMatrixRef<KVScalar> k_ref(k_h), v_ref(v_h);
  if (options.method == Method::lsh_fused) {
    fused_tile<Scalar, QScalar, KVScalar>(q_ref, k_ref, v_ref, *hashes, tau, causal, r0, rows,
                                          out_h, work, p0);
    return;
  }
  const Index n = k_ref.rows();
  const ExactWindow window =
      options.method == Method::exact_banded
          ? banded_window(n, band_for_bias_error(sigma, options.band_error), options.masking)
          : ExactWindow{causal ? 0 : -n, n};
  AlibiBias<Scalar> bias(n, sigma, window);
  engine_rows<Scalar, QScalar, KVScalar>(q_ref, k_ref, v_ref, static_cast<double>(tau), bias,
                                         work.buffers, p0, r0, r0 + rows,
                                         out_h.middleRows(r0 - p0, rows));
}

inline bool runs_by_tiles(Method method) {
  return method == Method::lsh_fused || method == Method::exact_tiled ||
         method == Method::exact_banded;
}

/// Whether lsh_attention_per_sample, fixed_blocks_attention and alibi_attention_reference
/// take Q in Scalar, K and V in KVScalar and the output in OutScalar (the signature
/// kernel<Scalar, KVScalar, OutScalar>(q, k, v, ..., out, options)).
template <typename Scalar, typename KVScalar, typename OutScalar, typename = void>
struct mixed_per_sample : std::false_type {};
template <typename Scalar, typename KVScalar, typename OutScalar>
struct mixed_per_sample<
    Scalar, KVScalar, OutScalar,
    std::void_t<decltype(lsh_attention_per_sample<Scalar, KVScalar, OutScalar>(
        std::declval<ConstMatrixRef<Scalar>>(), std::declval<ConstMatrixRef<KVScalar>>(),
        std::declval<ConstMatrixRef<KVScalar>>(), std::declval<const HashSet&>(),
        std::declval<MatrixRef<OutScalar>>(), std::declval<const AttentionOptions&>()))>>
    : std::true_type {};
template <typename Scalar, typename KVScalar, typename OutScalar, typename = void>
struct mixed_fixed_blocks : std::false_type {};
template <typename Scalar, typename KVScalar, typename OutScalar>
struct mixed_fixed_blocks<
    Scalar, KVScalar, OutScalar,
    std::void_t<decltype(fixed_blocks_attention<Scalar, KVScalar, OutScalar>(
        std::declval<ConstMatrixRef<Scalar>>(), std::declval<ConstMatrixRef<KVScalar>>(),
        std::declval<ConstMatrixRef<KVScalar>>(), 1.0, std::declval<MatrixRef<OutScalar>>(),
        std::declval<const AttentionOptions&>()))>> : std::true_type {};
template <typename Scalar, typename KVScalar, typename OutScalar, typename = void>
struct mixed_reference : std::false_type {};
template <typename Scalar, typename KVScalar, typename OutScalar>
struct mixed_reference<
    Scalar, KVScalar, OutScalar,
    std::void_t<decltype(alibi_attention_reference<Scalar, KVScalar, OutScalar>(
        std::declval<ConstMatrixRef<Scalar>>(), std::declval<ConstMatrixRef<KVScalar>>(),
        std::declval<ConstMatrixRef<KVScalar>>(), 1.0, std::declval<MatrixRef<OutScalar>>(),
        std::declval<const AttentionOptions&>()))>> : std::true_type {};

/// kernel(q, k, v, out) on copies of one head's views widened to Compute, the result rounded
/// once into out_h: for a single-head kernel that takes one scalar type only.
template <typename Compute, typename QType, typename KType, typename OutType, typename Kernel>
void run_widened_head(const QType& q_h, const KType& k_h, const KType& v_h, OutType& out_h,
                      Kernel&& kernel) {
  using OutScalar = typename OutType::Scalar;
  const RowMatrix<Compute> q = q_h.template cast<Compute>();
  const RowMatrix<Compute> k = k_h.template cast<Compute>();
  const RowMatrix<Compute> v = v_h.template cast<Compute>();
  RowMatrix<Compute> out(out_h.rows(), out_h.cols());
  kernel(q, k, v, out);
  out_h = out.template cast<OutScalar>();
}

/// One head of multihead_attention (or of one sequence of the varlen form) by a method that
/// runs head by head: q_h (Scalar) over k_h, v_h (KVScalar) into out_h (OutScalar). Mixed types
/// go to the kernel's <Scalar, KVScalar, OutScalar> form, or, for a kernel without one, to its
/// compute-type form on widened copies of the head (run_widened_head).
template <typename Scalar, typename KVScalar, typename OutScalar, typename QType, typename KType,
          typename OutType>
void multihead_head(Method method, const QType& q_h, const KType& k_h, const KType& v_h,
                    OutType& out_h, const HashSet* hashes, double sigma, double band_error,
                    const AttentionOptions& head_options) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  constexpr bool plain = std::is_same_v<Scalar, Compute> && std::is_same_v<KVScalar, Compute> &&
                         std::is_same_v<OutScalar, Compute>;
  switch (method) {
    case Method::lsh_per_sample:
      if constexpr (plain) {
        lsh_attention_per_sample<Scalar>(q_h, k_h, v_h, *hashes, out_h, head_options);
      } else if constexpr (mixed_per_sample<Scalar, KVScalar, OutScalar>::value) {
        lsh_attention_per_sample<Scalar, KVScalar, OutScalar>(
            ConstMatrixRef<Scalar>(q_h), ConstMatrixRef<KVScalar>(k_h),
            ConstMatrixRef<KVScalar>(v_h), *hashes, MatrixRef<OutScalar>(out_h), head_options);
      } else {
        run_widened_head<Compute>(q_h, k_h, v_h, out_h, [&](auto& q, auto& k, auto& v, auto& out) {
          lsh_attention_per_sample<Compute>(q, k, v, *hashes, out, head_options);
        });
      }
      break;
    case Method::fixed_blocks:
      if constexpr (plain) {
        fixed_blocks_attention<Scalar>(q_h, k_h, v_h, sigma, out_h, head_options);
      } else if constexpr (mixed_fixed_blocks<Scalar, KVScalar, OutScalar>::value) {
        fixed_blocks_attention<Scalar, KVScalar, OutScalar>(
            ConstMatrixRef<Scalar>(q_h), ConstMatrixRef<KVScalar>(k_h),
            ConstMatrixRef<KVScalar>(v_h), sigma, MatrixRef<OutScalar>(out_h), head_options);
      } else {
        run_widened_head<Compute>(q_h, k_h, v_h, out_h, [&](auto& q, auto& k, auto& v, auto& out) {
          fixed_blocks_attention<Compute>(q, k, v, sigma, out, head_options);
        });
      }
      break;
    case Method::exact_tiled:
      alibi_attention_tiled<Scalar, KVScalar, OutScalar>(q_h, k_h, v_h, sigma, out_h, head_options);
      break;
    case Method::exact_banded:
      alibi_attention_banded<Scalar, KVScalar, OutScalar>(
          q_h, k_h, v_h, sigma, band_for_bias_error(sigma, band_error), out_h, head_options);
      break;
    case Method::exact_reference:
      if constexpr (plain) {
        alibi_attention_reference<Scalar>(q_h, k_h, v_h, sigma, out_h, head_options);
      } else if constexpr (mixed_reference<Scalar, KVScalar, OutScalar>::value) {
        alibi_attention_reference<Scalar, KVScalar, OutScalar>(
            ConstMatrixRef<Scalar>(q_h), ConstMatrixRef<KVScalar>(k_h),
            ConstMatrixRef<KVScalar>(v_h), sigma, MatrixRef<OutScalar>(out_h), head_options);
      } else {
        run_widened_head<Compute>(q_h, k_h, v_h, out_h, [&](auto& q, auto& k, auto& v, auto& out) {
          alibi_attention_reference<Compute>(q, k, v, sigma, out, head_options);
        });
      }
      break;
    case Method::lsh_fused:
      break;
  }
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
/// Scalar types: q in Scalar, k and v in KVScalar, out in OutScalar (float, double,
/// Eigen::half or Eigen::bfloat16, deduced from the views; e.g. float queries over a bfloat16
/// KV cache into a float output, ggml's layout), computed in compute_scalar_t<Scalar,
/// KVScalar, OutScalar>: the tile methods (lsh_fused, exact_tiled, exact_banded) widen
/// half-precision values to float as they load them and round the output once, bitwise the
/// float computation on the widened inputs rounded once; the other methods run their kernel's
/// mixed-type form, or their float form on widened copies of each head.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention(HeadsView<const Scalar> q, HeadsView<const KVScalar> k,
                         HeadsView<const KVScalar> v, HeadsView<OutScalar> out,
                         const MultiHeadOptions& options = {}) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
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
  const auto tau = static_cast<Compute>(detail::resolve_scale(function, head_options, q.dim));
  const std::vector<HashSet> hashes =
      options.method == Method::lsh_fused || options.method == Method::lsh_per_sample
          ? multihead_hashes(sigmas, options.samples, options.seed)
          : std::vector<HashSet>{};
  if (options.method == Method::lsh_fused) {
    const bool causal = options.masking == Masking::causal;
    detail::run_fused_tiles<Compute>(
        q.heads, p0, p0 + n,
        [&](Index h, Index i0, Index rows, detail::FusedWorkspace<Compute>& work) {
          auto out_head = out.head(h);
          detail::fused_tile<Compute, Scalar, KVScalar>(
              q.head(h), k.head(h / group), v.head(h / group), hashes[static_cast<std::size_t>(h)],
              tau, causal, i0, rows, out_head, work, p0);
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
    detail::multihead_head<Scalar, KVScalar, OutScalar>(
        options.method, q_h, k_h, v_h, out_h, hashes.empty() ? nullptr : &hashes[index],
        sigmas[index], options.band_error, head_options);
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
/// sequences are allowed. Throws std::invalid_argument naming a bad argument. Scalar types as
/// multihead_attention.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention_varlen(HeadsView<const Scalar> q, HeadsView<const KVScalar> k,
                                HeadsView<const KVScalar> v, HeadsView<OutScalar> out,
                                const std::vector<std::int32_t>& cu_seqlens_q,
                                const std::vector<std::int32_t>& cu_seqlens_k,
                                const MultiHeadOptions& options = {},
                                const std::vector<Index>& query_offsets = {}) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
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
    detail::require_reference_self_attention(function, options.method, m, L, offsets[b]);
  }
  const Index group = q.heads / k.heads;
  const auto tau = static_cast<Compute>(detail::resolve_scale(function, options, q.dim));
  const std::vector<HashSet> hashes =
      options.method == Method::lsh_fused || options.method == Method::lsh_per_sample
          ? multihead_hashes(sigmas, options.samples, options.seed)
          : std::vector<HashSet>{};
  const auto sequence_views = [&](std::size_t b) {
    struct Views {
      HeadsView<const Scalar> q;
      HeadsView<const KVScalar> k, v;
      HeadsView<OutScalar> out;
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
      detail::FusedWorkspace<Compute> work;
#pragma omp for schedule(dynamic, 1)
      for (long job = 0; job < jobs; ++job) {
        const Tile& tile = tiles[static_cast<std::size_t>(job / q.heads)];
        const Index h = static_cast<Index>(job % q.heads);
        const auto views = sequence_views(tile.sequence);
        auto out_h = views.out.head(h);
        const auto index = static_cast<std::size_t>(h);
        detail::multihead_tile<Compute, Scalar, KVScalar>(
            options, views.q.head(h), views.k.head(h / group), views.v.head(h / group), out_h,
            hashes.empty() ? nullptr : &hashes[index], sigmas[index], tau, offsets[tile.sequence],
            tile.r0, tile.rows, work);
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
    detail::multihead_head<Scalar, KVScalar, OutScalar>(
        options.method, q_h, k_h, v_h, out_h, hashes.empty() ? nullptr : &hashes[index],
        sigmas[index], options.band_error, head_options);
  }
}

}  // namespace poslsh
