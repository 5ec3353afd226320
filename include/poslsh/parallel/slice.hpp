/// \file
/// \brief The per-rank kernels of context parallelism: attention of a rank's queries over a
/// contiguous slice of a sequence's keys with its log-sum-exp, the gradients of such a slice
/// from the whole sequence's lse, and the backward pass of a window of the sequence.
///
/// Positions are those of the whole sequence, so the ALiBi bias, the causal mask and the LSH
/// bins of a slice are the sequence's. Results over disjoint key slices merge exactly by their
/// lse (LseMerger), and the gradients of the slices sum to the sequence's.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/parallel.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/methods.hpp"
#include "poslsh/multihead/training.hpp"
#include "poslsh/training/backward.hpp"

namespace poslsh {

namespace detail {

/// The arguments of a slice call (forward and backward): the offsets (query_offset,
/// key_offset >= 0, options.query_offset unset), the inputs, out (q.tokens x q.heads x v.dim)
/// and lse (q.heads x q.tokens).
template <typename Scalar, typename OutElement, typename LseType>
void require_slice_arguments(const char* function, const HeadsView<const Scalar>& q,
                             const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                             const HeadsView<OutElement>& out, const LseType& lse,
                             Index query_offset, Index key_offset,
                             const MultiHeadOptions& options) {
  require(!options.query_offset, function, "options.query_offset", options.query_offset.value_or(0),
          "must be unset: the positions are the query_offset and key_offset arguments");
  require(query_offset >= 0, function, "query_offset", query_offset, "must be >= 0");
  require(key_offset >= 0, function, "key_offset", key_offset, "must be >= 0");
  require_heads_inputs(function, q, k, v);
  require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  require_lse_shape(function, lse, q);
}

/// The methods a slice backward takes: those with method_has_slice_backward (options.method).
inline void require_slice_backward_method(const char* function, const MultiHeadOptions& options) {
  require(method_has_slice_backward(options.method), function, "options.method",
          enum_name(options.method), [] {
            return "must be " + enum_name_list<Method>(method_has_slice_backward) +
                   " (the other methods read a bounded halo: "
                   "multihead_attention_window_backward)";
          });
}

/// The LSH counts of a slice backward (options.method weights its keys by hashes: lsh_fused,
/// lsh_per_sample, fixed_blocks) need its m queries among its L keys: key_offset <=
/// query_offset and query_offset + m <= key_offset + L. `name` is the argument that placed the
/// queries.
inline void require_queries_among_keys(const char* function, const char* name,
                                       const MultiHeadOptions& options, Index query_offset,
                                       Index queries, Index key_offset, Index keys) {
  if (!method_weights_from_hashes(options.method)) return;
  require(key_offset <= query_offset && query_offset + queries <= key_offset + keys, function, name,
          query_offset, [&] {
            return "must place the " + std::to_string(queries) + " queries among the keys [" +
                   std::to_string(key_offset) + ", " + std::to_string(key_offset + keys) +
                   ") for method " + enum_name(options.method);
          });
}

/// The gradients of a slice (multihead_attention_slice_backward), added to dq, dk, dv and,
/// when not null, to dslopes (one entry per query head, checked by the caller:
/// require_slope_gradients).
template <typename Scalar>
void slice_backward(const char* function, const HeadsView<const Scalar>& q,
                    const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                    const HeadsView<const Scalar>& out, const ConstHeadsLseRef<Scalar>& lse,
                    const HeadsView<const Scalar>& dout, const GradientHeadsView<Scalar>& dq,
                    const GradientHeadsView<Scalar>& dk, const GradientHeadsView<Scalar>& dv,
                    Index query_offset, Index key_offset, const MultiHeadOptions& options,
                    double* dslopes) {
  using Compute = backward_scalar_t<Scalar>;
  require_slice_arguments(function, q, k, v, out, lse, query_offset, key_offset, options);
  require_gradient_views(function, q, k, v, dout, dq, dk, dv);
  require_slice_backward_method(function, options);
  require_queries_among_keys(function, "query_offset", options, query_offset, q.tokens, key_offset,
                             k.tokens);
  const std::vector<HeadMethod> heads = head_methods(function, q.heads, options);
  const double tau = resolve_scale(function, options, q.dim);
  if (q.tokens == 0 || k.tokens == 0) return;
  const Index extent = std::max(query_offset + q.tokens, key_offset + k.tokens);
  const Index group = q.heads / k.heads;
  const auto head_pass = [&](Index h, bool parallel, BackwardWork<Compute>* work) {
    const HeadMethod& head = heads[static_cast<std::size_t>(h)];
    const Index g = h / group;
    HeadBackward<Compute, Scalar> b{q.head(h),
                                    k.head(g),
                                    v.head(g),
                                    out.head(h),
                                    lse.row(h).transpose(),
                                    dout.head(h),
                                    dq.head(h),
                                    dk.head(g),
                                    dv.head(g),
                                    static_cast<Compute>(tau),
                                    options.masking,
                                    dslopes == nullptr ? nullptr : dslopes + h,
                                    key_offset,
                                    options.precision};
    visit_method_row<MethodBackward>(head.method, [&](auto row) {
      if constexpr (decltype(row)::has_slice_backward)
        row.template slice_backward<Compute, Scalar>(head, b, query_offset - key_offset, extent,
                                                     parallel, work);
    });
  };
  if (group == 1) {
    // Heads write disjoint rows: one job per head, each pass on its thread, with the thread's
    // scratch sized for the head widths before the loop (detail/parallel.hpp).
    const auto jobs = static_cast<long>(q.heads);
    PerThread<BackwardWork<Compute>> works(jobs);
    works.each([&](BackwardWork<Compute>& work) { work.prepare(q.dim, v.dim); });
    parallel_loop(jobs, LoopSchedule::dynamic(), works, [&](long j, BackwardWork<Compute>& work) {
      head_pass(q.heads - 1 - static_cast<Index>(j), false, &work);
    });
    return;
  }
  // The heads of a group add to one dk, dv: in increasing order, each pass parallel inside.
  for (Index h = 0; h < q.heads; ++h) head_pass(h, true, nullptr);
}

}  // namespace detail

/// Attention of the queries at positions query_offset .. query_offset + m - 1 (the m tokens of
/// q) over the keys at positions key_offset .. key_offset + L - 1 (the L tokens of k and v) of
/// one sequence, every head by its method (as multihead_attention: sigmas, hashes, bands,
/// GQA; every method but mean_of_outputs, which has no lse: std::invalid_argument naming
/// 'options.method'), with the log-sum-exp lse (H_q x m) of each row:
///   out_i = sum_j w_ij e^{x_ij} v_j / sum_j w_ij e^{x_ij},  lse_i = log sum_j w_ij e^{x_ij},
/// j over the slice's keys, w and x the method's weights and scores at the absolute positions
/// (ALiBi bias -|i - j| / sigma, causal mask j <= i, LSH counts of the absolute bins). A row
/// with no key of nonzero weight in the slice gets out 0 and lse -inf. Results over disjoint
/// key slices merge exactly by their lse (LseMerger); a slice holding every key that the
/// rows reach (head_key_range) gives bitwise the rows of the call on the whole sequence. One
/// parallel loop over (query tile, head) jobs: bitwise the same for any thread count.
/// options.query_offset must be unset (the offsets are arguments). Scalar types as
/// multihead_attention with lse (q, k, v, out in Scalar, lse in backward_scalar_t<Scalar>).
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_slice(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                               HeadsView<const Scalar> v, HeadsView<Scalar> out,
                               HeadsLseRef<Scalar> lse, Index query_offset, Index key_offset,
                               const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_slice";
  detail::require_slice_arguments(function, q, k, v, out, lse, query_offset, key_offset, options);
  detail::HeadsCall call;
  call.heads = detail::head_methods(function, q.heads, options);
  call.sequences.push_back({0, q.tokens, 0, k.tokens, query_offset, key_offset});
  detail::resolve_call_options(call, function, options, q.dim);
  detail::heads_forward_with_lse<Scalar>(function, call, q, k, v, out, lse);
}

/// The gradients of one slice of attention (the methods with method_has_slice_backward: exact
/// ALiBi, exact_tiled and exact_banded with any local window, and the count-weighted LSH
/// estimator, lsh_fused, lsh_per_sample and fixed_blocks, with its queries among its keys,
/// key_offset <= query_offset and query_offset + m <= key_offset + L): the m
/// queries of q at positions query_offset .. query_offset + m - 1
/// against the L keys of k and v at positions key_offset .. key_offset + L - 1, with out and lse
/// (H_q x m) the forward's rows over EVERY key of the sequence (e.g. the slices' results merged
/// by LseMerger), so that
///   P_ij = e^{x_ij - lse_i},  x_ij = tau q_i.k_j - |i - j| / sigma_h  (j in the slice, inside
///   the head's causal mask, band and window; 0 elsewhere; the LSH methods: P_ij =
///   c_ij e^{tau q_i.k_j - lse_i}, c_ij the sample counts of the positions' bins (fixed_blocks:
///   its one hash), causal j <= i),  D_i = dO_i . out_i,
///   dv_j += sum_i P_ij dO_i,  dS_ij = P_ij (dO_i . v_j - D_i),
///   dq_i += tau sum_j dS_ij k_j,  dk_j += tau sum_i dS_ij q_i
/// for each query head h and its K/V head g = h / (H_q / H_kv). The contributions are ADDED to
/// dq (m tokens), dk and dv (L tokens): summed over slices that cover the keys, dq is the
/// sequence's dq of these rows, and summed over the query rows too, dk and dv are the
/// sequence's (multihead_attention_backward). Each head's pass is the backward's tile pass on
/// the rectangle (key tiles of 64 from key_offset, query steps of 64 from query_offset), heads
/// of a group added in increasing order: bitwise the same for any thread count. Over one slice
/// holding the whole sequence (offsets 0) the gradients are bitwise those of
/// multihead_attention_backward (added to zeroed outputs); over key slices whose offsets are
/// multiples of 512 (the backward's key groups) visited in increasing order with every query
/// row at once, dq, dk and dv are bitwise too; lsh_fused over every key with the last queries
/// from a multiple of 64, and dO 0 on the other rows, gives bitwise the sequence's dq of those
/// rows and its dk, dv; otherwise equal to rounding. lsh_per_sample and fixed_blocks take
/// lsh_fused's pass on their hashes (their estimator is the same: each pair once, where their
/// own backward sums the samples' blocks), so their slices are bitwise lsh_fused's and equal
/// their multihead_attention_backward to rounding. Scalar types as
/// multihead_attention_backward.
/// \throws std::invalid_argument naming a bad argument (another method: 'options.method'; an
///   LSH method's queries outside its keys: 'query_offset'), before any head runs.
template <typename Scalar>
void multihead_attention_slice_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                        HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                        ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
                                        GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk,
                                        GradientHeadsView<Scalar> dv, Index query_offset,
                                        Index key_offset, const MultiHeadOptions& options = {}) {
  detail::slice_backward<Scalar>("multihead_attention_slice_backward", q, k, v, out, lse, dout, dq,
                                 dk, dv, query_offset, key_offset, options, nullptr);
}

/// multihead_attention_slice_backward with the gradients in the ALiBi slopes too: for each
/// query head h (slope_h = 1/sigma_h), dL/dslope_h = -sum_ij dS_ij |i - j| over the slice's
/// pairs is ADDED to dslopes[h] (H_q entries; summed in double in a fixed order). dq, dk, dv
/// are bitwise those of the call without dslopes.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_slice_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                        HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                        ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
                                        GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk,
                                        GradientHeadsView<Scalar> dv,
                                        Eigen::Ref<Eigen::VectorXd> dslopes, Index query_offset,
                                        Index key_offset, const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_slice_backward";
  detail::require_slope_gradients(function, options, dslopes.size(), q.heads, false);
  detail::slice_backward<Scalar>(function, q, k, v, out, lse, dout, dq, dk, dv, query_offset,
                                 key_offset, options, dslopes.data());
}

/// The gradients of a packed batch whose sequences may have fewer or more queries than keys
/// (FlashAttention's varlen backward with cu_seqlens_q and cu_seqlens_k; methods exact_tiled
/// and exact_banded, and lsh_fused, lsh_per_sample and fixed_blocks when no sequence has more
/// queries than keys, else 'cu_seqlens_q' is named): sequence b has the query tokens
/// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q, out, dout, lse and dq and the key tokens
/// [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k, v, dk and dv, placed as multihead_attention_varlen
/// places them (bottom-right: m queries over L keys sit at positions L - m .. L - 1; with m > L,
/// causal, the first m - L rows see no key and get dq 0; not causal, the keys sit at positions m -
/// L .. m - 1). Each sequence's gradients are those of multihead_attention_slice_backward at its
/// offsets, the sequences one after the other, each parallel inside: bitwise those calls on the
/// sequences' tokens, for any thread count. dq, dk and dv are WRITTEN (tokens of no sequence: 0).
/// options.sigmas holds one sigma per query head or one per sequence and query head (B H_q, head h
/// of sequence b at b H_q + h); *dslopes, when given (as many entries), receives dL/dslope of each
/// such entry (summed over the sequences in increasing order when per query head). Scalar types as
/// multihead_attention_backward. \throws std::invalid_argument naming a bad argument, before any
/// sequence runs.
template <typename Scalar>
void multihead_attention_varlen_slice_backward(
    HeadsView<const Scalar> q, HeadsView<const Scalar> k, HeadsView<const Scalar> v,
    HeadsView<const Scalar> out, ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
    const std::vector<std::int32_t>& cu_seqlens_q, const std::vector<std::int32_t>& cu_seqlens_k,
    GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk, GradientHeadsView<Scalar> dv,
    const MultiHeadOptions& options = {}, Eigen::Ref<Eigen::VectorXd>* dslopes = nullptr) {
  constexpr const char* function = "multihead_attention_varlen_slice_backward";
  detail::require_heads_inputs(function, q, k, v);
  detail::require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  detail::require_lse_shape(function, lse, q);
  detail::require_gradient_views(function, q, k, v, dout, dq, dk, dv);
  const std::vector<detail::HeadsSequence> sequences = detail::packed_sequences(
      function, cu_seqlens_q, cu_seqlens_k, q.tokens, k.tokens, options, {});
  const auto batch = static_cast<Index>(sequences.size());
  // The methods of every sequence and head, checked before any sequence runs (each sequence's
  // slice_backward checks its own again).
  const std::vector<HeadMethod> heads = detail::head_methods(function, q.heads, options, batch);
  const bool per_sequence = static_cast<Index>(heads.size()) != q.heads;
  detail::require_slice_backward_method(function, options);
  for (const detail::HeadsSequence& s : sequences) {
    const Index queries = s.q_end - s.q_begin, keys = s.k_end - s.k_begin;
    if (queries > 0 && keys > 0)
      detail::require_queries_among_keys(function, "cu_seqlens_q", options, s.p0, queries, s.k0,
                                         keys);
  }
  detail::resolve_scale(function, options, q.dim);
  if (dslopes != nullptr) {
    detail::require_slope_gradients(function, options, dslopes->size(),
                                    static_cast<Index>(heads.size()), per_sequence);
    dslopes->setZero();
  }
  for (const auto& view : {dq, dk, dv})
    for (Index h = 0; h < view.heads; ++h) view.head(h).setZero();
  MultiHeadOptions sequence_options = options;
  for (Index b = 0; b < batch; ++b) {
    const detail::HeadsSequence& s = sequences[static_cast<std::size_t>(b)];
    if (s.q_end == s.q_begin || s.k_end == s.k_begin) continue;
    if (per_sequence) {
      const auto first = options.sigmas.begin() + b * q.heads;
      sequence_options.sigmas.assign(first, first + q.heads);
    }
    const auto queries = [&](const auto& view) {
      return detail::token_range(view, s.q_begin, s.q_end);
    };
    const auto keys = [&](const auto& view) {
      return detail::token_range(view, s.k_begin, s.k_end);
    };
    detail::slice_backward<Scalar>(
        function, queries(q), keys(k), keys(v), queries(out),
        ConstHeadsLseRef<Scalar>(lse.middleCols(s.q_begin, s.q_end - s.q_begin)), queries(dout),
        queries(dq), keys(dk), keys(dv), s.p0, s.k0, sequence_options,
        dslopes == nullptr ? nullptr : dslopes->data() + (per_sequence ? b * q.heads : 0));
  }
}

/// Gradients of the attention restricted to a window of a sequence: the n tokens of q, k, v,
/// out, dout (and the n columns of lse) are the positions position .. position + n - 1, and
/// only the pairs (i, j) of the window count (self-attention inside it, bias, masks and LSH
/// bins at the absolute positions), with out and lse the forward's rows of the whole sequence
/// (P_ij = w_ij e^{x_ij - lse_i}). Conventions, sums and scalar types (half-precision inputs,
/// float lse and gradients) as multihead_attention_backward. A query row all of whose keys of
/// nonzero weight lie in the window gets its dq row, and a key all of whose queries do gets its
/// dk and dv rows, equal to the whole sequence's; bitwise equal when `position` is a multiple of
/// 64 (the tiles of the window are then the sequence's): ContextParallelChunk::window_span.
/// Bitwise the same for any thread count.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_window_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                         HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                         ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
                                         GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk,
                                         GradientHeadsView<Scalar> dv, Index position,
                                         const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_window_backward";
  detail::require(position >= 0, function, "position", position, "must be >= 0");
  detail::HeadsCall call = detail::training_call(
      function, q, k, v, lse, {0, static_cast<std::int32_t>(q.tokens)}, out, options);
  detail::require_gradient_views(function, q, k, v, dout, dq, dk, dv);
  call.sequences.front().p0 = position;
  call.sequences.front().k0 = position;
  detail::heads_backward<Scalar>(call, q, k, v, out, lse, dout, dq, dk, dv);
}

}  // namespace poslsh
