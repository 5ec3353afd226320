// poslsh: multi-head (and grouped-query) ALiBi attention, exact or by Positional LSH.
#pragma once

#include <cstdint>
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

template <typename Scalar>
void require_multihead_arguments(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                                 const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                                 const std::vector<double>& sigmas,
                                 const MultiHeadOptions& options) {
  constexpr const char* function = "multihead_attention";
  q.validate(function, "q");
  k.validate(function, "k");
  v.validate(function, "v");
  out.validate(function, "out");
  require(k.tokens == q.tokens, function, "k.tokens", k.tokens,
          "must equal q.tokens = " + std::to_string(q.tokens));
  require(v.tokens == q.tokens, function, "v.tokens", v.tokens,
          "must equal q.tokens = " + std::to_string(q.tokens));
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
}

}  // namespace detail

/// Multi-head ALiBi attention: for each query head h (group size G = H_q / H_kv, K/V head
/// h / G), out_h = method(Q_h, K_{h/G}, V_{h/G}) with sigma_h = options.sigmas[h] (default: the
/// ALiBi slopes, sigma_h = 1/m_h) and, for LSH methods, hashes rbf_hashes(sigma_h, s, seed, h).
/// Inputs and output are strided HeadsView's ([n, H, d] or [H, n, d], no copies). The fused
/// method runs all (head, query tile) pairs in one parallel loop; the others run heads in
/// parallel. Each output row is computed by one thread in a fixed order: bitwise the same
/// result for any thread count. Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void multihead_attention(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                         HeadsView<const Scalar> v, HeadsView<Scalar> out,
                         const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention";
  detail::require(q.heads >= 1, function, "q.heads", q.heads, "must be >= 1");
  const std::vector<double> sigmas =
      options.sigmas.empty() ? alibi_sigmas(static_cast<int>(q.heads)) : options.sigmas;
  detail::require_multihead_arguments(q, k, v, out, sigmas, options);
  const Index n = q.tokens;
  if (n == 0) return;
  const Index group = q.heads / k.heads;
  const AttentionOptions& head_options = options;
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, head_options, q.dim));
  const std::vector<HashSet> hashes =
      options.method == Method::lsh_fused || options.method == Method::lsh_per_sample
          ? multihead_hashes(sigmas, options.samples, options.seed)
          : std::vector<HashSet>{};
  if (options.method == Method::lsh_fused) {
    const bool causal = options.masking == Masking::causal;
    detail::run_fused_tiles<Scalar>(
        q.heads, n, [&](Index h, Index i0, Index rows, detail::FusedWorkspace<Scalar>& work) {
          auto out_head = out.head(h);
          detail::fused_tile<Scalar>(q.head(h), k.head(h / group), v.head(h / group),
                                     hashes[static_cast<std::size_t>(h)], tau, causal, i0, rows,
                                     out_head, work);
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
