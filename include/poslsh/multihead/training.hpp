// poslsh: every all-heads training call: multihead_attention with the log-sum-exp of every head,
// its backward pass, and both for packed batches of self-attention sequences. Conventions (lse,
// P, the gradients) as the single-head calls of poslsh/training/backward.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/slopes.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/training/backward.hpp"

namespace poslsh {


namespace detail {

/// The views and the lse matrix of a multi-head call (forward: out writable; backward: out read
/// and the gradient views written).
template <typename Scalar>
void require_multihead_views(const char* function, const HeadsView<const Scalar>& q,
                             const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                             const std::vector<double>& sigmas, const MultiHeadOptions& options) {
  q.validate(function, "q");
  k.validate(function, "k");
  v.validate(function, "v");
  require(k.tokens == q.tokens, function, "k.tokens", k.tokens,
          "must equal q.tokens = " + std::to_string(q.tokens));
  require(v.tokens == q.tokens, function, "v.tokens", v.tokens,
          "must equal q.tokens = " + std::to_string(q.tokens));
  require(k.dim == q.dim, function, "k.dim", k.dim, "must equal q.dim = " + std::to_string(q.dim));
  require(q.tokens == 0 || q.dim > 0, function, "q.dim", q.dim,
          "head dimension d must be >= 1 when n > 0");
  require(v.heads == k.heads, function, "v.heads", v.heads,
          "must equal k.heads = " + std::to_string(k.heads));
  require(q.heads % k.heads == 0, function, "k.heads", k.heads,
          "must divide q.heads = " + std::to_string(q.heads) + " (grouped-query attention)");
  require_multihead_method(function, q.heads, sigmas, options);
}

/// The lse matrix of a multi-head call: one row per query head, one column per token.
template <typename MatrixType>
void require_multihead_lse(const char* function, const MatrixType& lse, Index heads, Index n) {
  require(lse.rows() == heads && lse.cols() == n, function, "lse",
          std::to_string(lse.rows()) + "x" + std::to_string(lse.cols()),
          "shape must be q.heads x q.tokens = " + std::to_string(heads) + "x" + std::to_string(n));
}

}  // namespace detail

/// multihead_attention with the log-sum-exp of every query head: lse (H_q x n, row h = head h,
/// FlashAttention's softmax_lse layout of one sequence) as in the single-head kernels with lse;
/// out bitwise that of multihead_attention. The exact methods (exact_reference is computed by
/// the tiled kernel, with its rounding) run heads in parallel; the LSH methods run heads in
/// order, each parallel inside (OpenMP). Bitwise the same for any thread count. Throws
/// std::invalid_argument naming a bad argument.
template <typename Scalar>
void multihead_attention(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                         HeadsView<const Scalar> v, HeadsView<Scalar> out, MatrixRef<Scalar> lse,
                         const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention";
  detail::require_self_positions(function, options);
  detail::require(q.heads >= 1, function, "q.heads", q.heads, "must be >= 1");
  const std::vector<double> sigmas =
      options.sigmas.empty() ? alibi_sigmas(static_cast<int>(q.heads)) : options.sigmas;
  detail::require_multihead_views(function, q, k, v, sigmas, options);
  detail::require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  detail::require_multihead_lse(function, lse, q.heads, q.tokens);
  const Index n = q.tokens;
  if (n == 0) return;
  const Index group = q.heads / k.heads;
  const AttentionOptions& head_options = options;  // query_offset checked unset or 0 above
  detail::resolve_scale(function, head_options, q.dim);
  const auto head_lse = [&](Index h) { return VectorRef<Scalar>(lse.row(h).transpose()); };
  if (options.method == Method::lsh_fused || options.method == Method::lsh_per_sample ||
      options.method == Method::fixed_blocks) {
    const std::vector<HashSet> hashes =
        options.method == Method::fixed_blocks
            ? std::vector<HashSet>{}
            : multihead_hashes(sigmas, options.samples, options.seed);
    for (Index h = 0; h < q.heads; ++h) {
      const auto index = static_cast<std::size_t>(h);
      if (options.method == Method::lsh_fused)
        lsh_attention_fused<Scalar>(q.head(h), k.head(h / group), v.head(h / group), hashes[index],
                                    out.head(h), head_lse(h), head_options);
      else if (options.method == Method::lsh_per_sample)
        lsh_attention_per_sample<Scalar>(q.head(h), k.head(h / group), v.head(h / group),
                                         hashes[index], out.head(h), head_lse(h), head_options);
      else
        fixed_blocks_attention<Scalar>(q.head(h), k.head(h / group), v.head(h / group),
                                       sigmas[index], out.head(h), head_lse(h), head_options);
    }
    return;
  }
  const auto heads = static_cast<long>(q.heads);
#pragma omp parallel for schedule(dynamic, 1)
  for (long head = 0; head < heads; ++head) {
    const auto h = static_cast<Index>(head);
    const double sigma = sigmas[static_cast<std::size_t>(head)];
    if (options.method == Method::exact_banded)
      alibi_attention_banded<Scalar>(q.head(h), k.head(h / group), v.head(h / group), sigma,
                                     band_for_bias_error(sigma, options.band_error), out.head(h),
                                     head_lse(h), head_options);
    else
      alibi_attention_tiled<Scalar>(q.head(h), k.head(h / group), v.head(h / group), sigma,
                                    out.head(h), head_lse(h), head_options);
  }
}

/// Gradients of multihead_attention for dO = dout, from its out and lse (H_q x n, the forward
/// with lse): for each query head h (K/V head g = h / G, G = H_q / H_kv), the single-head
/// backward of the method (exact_tiled and exact_reference: alibi_attention_tiled_backward;
/// exact_banded: alibi_attention_banded_backward with band_for_bias_error(sigma_h, band_error);
/// lsh_fused: lsh_attention_fused_backward; lsh_per_sample: lsh_attention_per_sample_backward;
/// fixed_blocks: fixed_blocks_attention_backward) gives dq_h, and
///   dk_g = sum_{h : h / G = g} dK_h,  dv_g = sum_{h : h / G = g} dV_h,
/// summed in increasing h. Without grouping (H_q = H_kv), the fused and exact methods run one
/// head per thread (OpenMP), each head's pass on its thread; otherwise heads run in order, each
/// parallel inside. Either way every gradient row is the single-head kernel's sum in its fixed
/// order: bitwise the same for any thread count (and as the single-head calls). Extra memory
/// O(n d) for grouped-query attention (one head's dK, dV). Throws std::invalid_argument naming
/// a bad argument.
template <typename Scalar>
void multihead_attention_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                  HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                  ConstMatrixRef<Scalar> lse, HeadsView<const Scalar> dout,
                                  HeadsView<Scalar> dq, HeadsView<Scalar> dk, HeadsView<Scalar> dv,
                                  const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_backward";
  detail::require_self_positions(function, options);
  detail::require(q.heads >= 1, function, "q.heads", q.heads, "must be >= 1");
  const std::vector<double> sigmas =
      options.sigmas.empty() ? alibi_sigmas(static_cast<int>(q.heads)) : options.sigmas;
  detail::require_multihead_views(function, q, k, v, sigmas, options);
  detail::require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  detail::require_multihead_lse(function, lse, q.heads, q.tokens);
  detail::require_view_shape(function, "dout", dout, q.tokens, q.heads, v.dim);
  detail::require_view_shape(function, "dq", dq, q.tokens, q.heads, q.dim);
  detail::require_view_shape(function, "dk", dk, q.tokens, k.heads, k.dim);
  detail::require_view_shape(function, "dv", dv, q.tokens, k.heads, v.dim);
  const Index n = q.tokens;
  if (n == 0) return;
  const detail::FlushSubnormals flush;  // as every thread of the passes (the group sums)
  const Index group = q.heads / k.heads;
  const AttentionOptions& head_options = options;  // query_offset checked unset or 0 above
  detail::resolve_scale(function, head_options, q.dim);
  const std::vector<HashSet> hashes =
      options.method == Method::lsh_fused || options.method == Method::lsh_per_sample
          ? multihead_hashes(sigmas, options.samples, options.seed)
          : std::vector<HashSet>{};
  const bool head_parallel =
      group == 1 &&
      (options.method == Method::lsh_fused || options.method == Method::exact_tiled ||
       options.method == Method::exact_banded || options.method == Method::exact_reference);
  if (head_parallel) {
    // One head per thread, each head's pass on its thread (no K/V head is shared); a thread's
    // heads reuse its scratch. Heads in decreasing order: with the LSH methods the last heads
    // (largest sigma) cost the most, and taking them first balances the threads.
    const auto tau = static_cast<Scalar>(detail::resolve_scale(function, head_options, q.dim));
    const bool causal = options.masking == Masking::causal;
    const auto heads = static_cast<long>(q.heads);
#pragma omp parallel
    {
      detail::BackwardWork<Scalar> work;
      detail::CountWindows windows;
#pragma omp for schedule(dynamic, 1)
      for (long head = 0; head < heads; ++head) {
        const auto h = static_cast<Index>(heads - 1 - head);
        const auto index = static_cast<std::size_t>(h);
        MatrixRef<Scalar> dq_h(dq.head(h)), dk_h(dk.head(h)), dv_h(dv.head(h));
        const ConstVectorRef<Scalar> lse_h(lse.row(h).transpose());
        if (options.method == Method::lsh_fused) {
          detail::count_backward<Scalar>(q.head(h), k.head(h), v.head(h), hashes[index], tau,
                                         causal, out.head(h), lse_h, dout.head(h), dq_h, dk_h, dv_h,
                                         false, &work, &windows);
        } else {
          const detail::ExactWindow window =
              options.method == Method::exact_banded
                  ? detail::banded_window(n, band_for_bias_error(sigmas[index], options.band_error),
                                          options.masking)
                  : detail::ExactWindow{causal ? 0 : -n, n};
          detail::exact_backward<Scalar>(q.head(h), k.head(h), v.head(h), sigmas[index],
                                         static_cast<double>(tau), window, out.head(h), lse_h,
                                         dout.head(h), dq_h, dk_h, dv_h, false, &work);
        }
      }
    }
    return;
  }
  RowMatrix<Scalar> dk_head, dv_head;
  if (group > 1) {
    dk_head.resize(n, q.dim);
    dv_head.resize(n, v.dim);
  }
  for (Index h = 0; h < q.heads; ++h) {
    const auto index = static_cast<std::size_t>(h);
    const Index g = h / group;
    const bool first = h % group == 0;
    // With groups, every head's dK and dV go to contiguous scratch first, so each head's
    // gradient has the bits of a single-head call, then the group sums them in head order.
    MatrixRef<Scalar> dk_target =
        group == 1 ? MatrixRef<Scalar>(dk.head(g)) : MatrixRef<Scalar>(dk_head);
    MatrixRef<Scalar> dv_target =
        group == 1 ? MatrixRef<Scalar>(dv.head(g)) : MatrixRef<Scalar>(dv_head);
    const ConstVectorRef<Scalar> lse_h(lse.row(h).transpose());
    const auto q_h = q.head(h);
    const auto k_h = k.head(g);
    const auto v_h = v.head(g);
    const auto out_h = out.head(h);
    const auto dout_h = dout.head(h);
    switch (options.method) {
      case Method::lsh_fused:
        lsh_attention_fused_backward<Scalar>(q_h, k_h, v_h, hashes[index], out_h, lse_h, dout_h,
                                             dq.head(h), dk_target, dv_target, head_options);
        break;
      case Method::lsh_per_sample:
        lsh_attention_per_sample_backward<Scalar>(q_h, k_h, v_h, hashes[index], out_h, lse_h,
                                                  dout_h, dq.head(h), dk_target, dv_target,
                                                  head_options);
        break;
      case Method::fixed_blocks:
        fixed_blocks_attention_backward<Scalar>(q_h, k_h, v_h, sigmas[index], out_h, lse_h, dout_h,
                                                dq.head(h), dk_target, dv_target, head_options);
        break;
      case Method::exact_banded:
        alibi_attention_banded_backward<Scalar>(
            q_h, k_h, v_h, sigmas[index], band_for_bias_error(sigmas[index], options.band_error),
            out_h, lse_h, dout_h, dq.head(h), dk_target, dv_target, head_options);
        break;
      case Method::exact_tiled:
      case Method::exact_reference:
        alibi_attention_tiled_backward<Scalar>(q_h, k_h, v_h, sigmas[index], out_h, lse_h, dout_h,
                                               dq.head(h), dk_target, dv_target, head_options);
        break;
    }
    if (group > 1) {
      auto dk_g = dk.head(g);
      auto dv_g = dv.head(g);
      if (first) {
        dk_g = dk_head;
        dv_g = dv_head;
      } else {
        dk_g += dk_head;
        dv_g += dv_head;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Packed batches (training on sequences of different lengths in one buffer).

namespace detail {

/// The arguments shared by the varlen forward with lse and the varlen backward: self-attention
/// views (q, k, v of the same tokens), lse (H_q x total tokens), cu_seqlens, out (q.tokens x
/// q.heads x v.dim) and the scale. Returns the options each sequence's call runs with (the
/// sigmas resolved once).
template <typename Scalar, typename LseType, typename OutElement>
MultiHeadOptions require_varlen_training(const char* function, const HeadsView<const Scalar>& q,
                                         const HeadsView<const Scalar>& k,
                                         const HeadsView<const Scalar>& v, const LseType& lse,
                                         const std::vector<std::int32_t>& cu_seqlens,
                                         const HeadsView<OutElement>& out,
                                         const MultiHeadOptions& options) {
  require_self_positions(function, options);
  require(q.heads >= 1, function, "q.heads", q.heads, "must be >= 1");
  MultiHeadOptions sequence_options = options;
  if (sequence_options.sigmas.empty())
    sequence_options.sigmas = alibi_sigmas(static_cast<int>(q.heads));
  require_multihead_views(function, q, k, v, sequence_options.sigmas, options);
  require_multihead_lse(function, lse, q.heads, q.tokens);
  require_cu_seqlens(function, "cu_seqlens", cu_seqlens, q.tokens);
  require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  resolve_scale(function, options, q.dim);
  return sequence_options;
}

}  // namespace detail

/// multihead_attention on a packed batch of self-attention sequences, with the log-sum-exp:
/// sequence b is tokens [cu_seqlens[b], cu_seqlens[b + 1]) of q, k, v and out (positions
/// 0 .. m_b - 1 in each), and column t of lse (H_q x total tokens, FlashAttention's varlen
/// softmax_lse layout) is token t's. For each sequence the result is bitwise that of
/// multihead_attention with lse on the sequence's views, so out is bitwise that of
/// multihead_attention_varlen(q, k, v, out, cu_seqlens, cu_seqlens, options). Sequences run in
/// order, each call parallel inside; bitwise the same for any thread count. Throws
/// std::invalid_argument naming a bad argument (options.query_offset must be unset or 0).
template <typename Scalar>
void multihead_attention_varlen(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                HeadsView<const Scalar> v, HeadsView<Scalar> out,
                                MatrixRef<Scalar> lse, const std::vector<std::int32_t>& cu_seqlens,
                                const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_varlen";
  const MultiHeadOptions sequence_options =
      detail::require_varlen_training(function, q, k, v, lse, cu_seqlens, out, options);
  for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const Index begin = cu_seqlens[b], end = cu_seqlens[b + 1];
    if (end == begin) continue;
    multihead_attention<Scalar>(
        detail::token_range(q, begin, end), detail::token_range(k, begin, end),
        detail::token_range(v, begin, end), detail::token_range(out, begin, end),
        MatrixRef<Scalar>(lse.middleCols(begin, end - begin)), sequence_options);
  }
}

/// Gradients of the packed-batch multihead_attention_varlen for dO = dout, from its out and lse:
/// for each sequence b, multihead_attention_backward on the sequence's views (tokens
/// [cu_seqlens[b], cu_seqlens[b + 1]) of every tensor, lse's columns of those tokens). No
/// gradient crosses sequences. Sequences run in order, each call parallel inside: bitwise the
/// same for any thread count and as the per-sequence calls. Throws std::invalid_argument naming
/// a bad argument.
template <typename Scalar>
void multihead_attention_varlen_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                         HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                         ConstMatrixRef<Scalar> lse, HeadsView<const Scalar> dout,
                                         const std::vector<std::int32_t>& cu_seqlens,
                                         HeadsView<Scalar> dq, HeadsView<Scalar> dk,
                                         HeadsView<Scalar> dv,
                                         const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_varlen_backward";
  const MultiHeadOptions sequence_options =
      detail::require_varlen_training(function, q, k, v, lse, cu_seqlens, out, options);
  detail::require_view_shape(function, "dout", dout, q.tokens, q.heads, v.dim);
  detail::require_view_shape(function, "dq", dq, q.tokens, q.heads, q.dim);
  detail::require_view_shape(function, "dk", dk, q.tokens, k.heads, k.dim);
  detail::require_view_shape(function, "dv", dv, q.tokens, k.heads, v.dim);
  for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const Index begin = cu_seqlens[b], end = cu_seqlens[b + 1];
    if (end == begin) continue;
    multihead_attention_backward<Scalar>(
        detail::token_range(q, begin, end), detail::token_range(k, begin, end),
        detail::token_range(v, begin, end), detail::token_range(out, begin, end),
        ConstMatrixRef<Scalar>(lse.middleCols(begin, end - begin)),
        detail::token_range(dout, begin, end), detail::token_range(dq, begin, end),
        detail::token_range(dk, begin, end), detail::token_range(dv, begin, end), sequence_options);
  }
}

}  // namespace poslsh
