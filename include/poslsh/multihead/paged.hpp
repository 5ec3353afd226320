/// \file
/// \brief All-heads (and grouped-query) ALiBi attention over a paged KV cache, exact or by
/// Positional LSH: multihead_attention_paged and multihead_attention_paged_with_lse, the packed
/// batch of multihead_attention_varlen with its keys and values read in place through a block
/// table (FlashAttention's and vLLM's paged layout, PagedKV: poslsh/attention/paged.hpp).
///
/// Every method of the table (poslsh/multihead/methods.hpp) reads a head's keys through the row
/// source PagedRows: key tiles inside one page read the page's rows; a tile across pages is
/// read page by page (float caches: in place, run by run; half-precision caches: widened or
/// packed into the tile buffers row by row, as a contiguous cache's tiles are). The result is
/// bitwise that of multihead_attention_varlen on the same keys gathered into contiguous views,
/// for any page size. A contiguous cache (batch_cache, seqlen_cache, H_kv, d) is the paged cache
/// of page size seqlen_cache whose block table row b holds its cache row.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "poslsh/attention/paged.hpp"
#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/methods.hpp"
#include "poslsh/multihead/training.hpp"

namespace poslsh {

namespace detail {

/// The keys of a call on a paged cache: sequence b's keys are the cache's seq_lens[b] tokens.
/// with_head(sequence, b, g, use) calls use(PagedRows(cache, b, g)) (run_heads_forward).
template <typename KVScalar>
struct PagedHeadsKeys {
  const PagedKV<KVScalar>& cache;

  Index heads() const { return cache.heads; }
  template <typename Use>
  void with_head(const HeadsSequence&, std::size_t b, Index g, Use&& use) const {
    use(PagedRows<KVScalar>(cache, static_cast<Index>(b), g));
  }
};

/// The checked arguments of a paged call: q (q.heads >= 1, d = cache.dim), the cache (every
/// sequence: PagedKV::validate; H_kv dividing q.heads), out (q.tokens x q.heads x cache.dim_v),
/// cu_seqlens_q (cache.batch + 1 entries from 0 to q.tokens, non-decreasing), the query offsets
/// (p_b = query_offsets[b] in [0, L_b - m_b], else L_b - m_b; options.query_offset unset) and
/// the methods of the heads (resolve_heads: per sequence when options.sigmas holds B H_q).
template <typename QScalar, typename KVScalar, typename OutScalar>
HeadsCall paged_call(const char* function, const HeadsView<const QScalar>& q,
                     const PagedKV<KVScalar>& cache, const HeadsView<OutScalar>& out,
                     const std::vector<std::int32_t>& cu_seqlens_q, const MultiHeadOptions& options,
                     const std::vector<Index>& query_offsets) {
  require(q.heads >= 1, function, "q.heads", q.heads, "must be >= 1");
  q.validate(function, "q");
  require(cache.batch >= 1, function, "cache.batch", cache.batch, "must be >= 1");
  for (Index b = 0; b < cache.batch; ++b) cache.validate(function, b);
  require(q.dim == cache.dim, function, "q.dim", q.dim,
          [&] { return "must equal cache.dim = " + std::to_string(cache.dim); });
  require(q.heads % cache.heads == 0, function, "cache.heads", cache.heads, [&] {
    return "must divide q.heads = " + std::to_string(q.heads) + " (grouped-query attention)";
  });
  require_view_shape(function, "out", out, q.tokens, q.heads, cache.dim_v);
  require_no_query_offset(function, options.query_offset);
  HeadsCall call;
  call.sequences = cache_sequences(
      function, cu_seqlens_q, q.tokens, static_cast<std::size_t>(cache.batch), "cache.batch",
      [&](std::size_t b) { return cache.length(static_cast<Index>(b)); });
  align_queries(function, call.sequences, query_offsets, "cache.seq_lens", options.masking);
  resolve_heads(call, function, q.heads, options, cache.batch);
  resolve_call_options(call, function, options, q.dim);
  return call;
}

}  // namespace detail

/// Multi-head ALiBi attention of a packed batch of queries over a paged KV cache: sequence b
/// (b < cache.batch) owns the query tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q and out
/// and the L_b = cache.seq_lens[b] tokens of the cache (token j: row j % page_size of page
/// block_table[b][j / page_size]); its m_b queries sit at positions p_b .. p_b + m_b - 1,
/// p_b = query_offsets[b] when given (0 <= p_b <= L_b - m_b), else L_b - m_b (bottom-right:
/// prefill chunks and decode append their queries at the cache's end; a sequence with more
/// queries than cached tokens as multihead_attention_varlen places it). For each query head h
/// (K/V head h / G, G = H_q / H_kv):
///   out_{b,h} = method(Q_{b,h}, K_{b,h/G}, V_{b,h/G}; sigma_h)   at query offset p_b,
/// the method, sigmas (one per query head, or one per sequence and query head:
/// options.sigmas[b H_q + h]), hashes, band and window of options as multihead_attention.
/// Every method of the table runs (exact_tiled with a local window, exact_banded, lsh_fused,
/// lsh_per_sample, fixed_blocks, mean_of_outputs). The cache is read in place, never gathered:
/// a key tile inside one page reads the page's rows, one across pages reads them page by page,
/// and the output is bitwise multihead_attention_varlen's on the same keys and values gathered
/// into contiguous views, for any page size. One parallel loop over the (sequence, query tile,
/// head) jobs: bitwise the same for any thread count.
/// \param q, out strided HeadsViews (q.tokens x H_q x d, out q.tokens x H_q x cache.dim_v).
/// \param cache the paged cache (views only; every sequence is checked: PagedKV::validate).
/// Scalar types: q in Scalar, the cache in KVScalar, out in OutScalar (float, double,
/// Eigen::half or Eigen::bfloat16; e.g. float queries over a bfloat16 cache), computed in
/// compute_scalar_t<Scalar, KVScalar, OutScalar> as multihead_attention (half-precision Q, K, V of
/// one type on the CPU's matrix unit under options.precision, else widened to float).
/// \throws std::invalid_argument naming a bad argument (of the cache: 'cache.block_table',
///   'cache.seq_lens', ...), before any head runs.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention_paged(HeadsView<const Scalar> q, const PagedKV<KVScalar>& cache,
                               HeadsView<OutScalar> out,
                               const std::vector<std::int32_t>& cu_seqlens_q,
                               const MultiHeadOptions& options = {},
                               const std::vector<Index>& query_offsets = {}) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  const detail::HeadsCall call = detail::paged_call("multihead_attention_paged", q, cache, out,
                                                    cu_seqlens_q, options, query_offsets);
  detail::run_heads_forward<Compute>(call, q, detail::PagedHeadsKeys<KVScalar>{cache}, out);
}

/// multihead_attention_paged with the log-sum-exp: column t of lse (H_q x q.tokens, any row
/// stride; FlashAttention's varlen softmax_lse layout) is the log-sum-exp of query token t,
///   lse_i = log sum_j w_ij e^{x_ij}   (the method's scores and weights, as
///   multihead_attention_varlen_with_lse; -inf for a row without keys),
/// in compute_scalar_t<Scalar, KVScalar, OutScalar> (float for half-precision types and float
/// queries over them, double for double); out is bitwise that of multihead_attention_paged, and
/// both are bitwise multihead_attention_varlen_with_lse's on the gathered keys (for a float
/// query over a half-precision cache: its call on the keys widened to float). Every method
/// but mean_of_outputs (which has no lse: std::invalid_argument naming 'options.method').
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention_paged_with_lse(
    HeadsView<const Scalar> q, const PagedKV<KVScalar>& cache, HeadsView<OutScalar> out,
    MatrixRef<compute_scalar_t<Scalar, KVScalar, OutScalar>> lse,
    const std::vector<std::int32_t>& cu_seqlens_q, const MultiHeadOptions& options = {},
    const std::vector<Index>& query_offsets = {}) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  constexpr const char* function = "multihead_attention_paged_with_lse";
  const detail::HeadsCall call =
      detail::paged_call(function, q, cache, out, cu_seqlens_q, options, query_offsets);
  detail::require_lse_shape(function, lse, q);
  detail::require_methods_with_lse(function, call);
  detail::run_heads_forward<Compute>(call, q, detail::PagedHeadsKeys<KVScalar>{cache}, out,
                                     lse.data(), lse.outerStride());
}

}  // namespace poslsh
