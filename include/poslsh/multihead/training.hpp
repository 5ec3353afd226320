/// \file
/// \brief The all-heads training calls: multihead_attention with the log-sum-exp of every
/// head, its backward pass, and both for packed batches of self-attention sequences.
///
/// Conventions (lse, P, the gradients) as the single-head calls of
/// poslsh/training/backward.hpp: lse_i = log sum_j w_ij e^{x_ij}, P_ij = w_ij e^{x_ij - lse_i},
/// dV = P^T dO, dS_ij = P_ij (dO_i . v_j - D_i), dQ = tau dS K, dK = tau dS^T Q. These calls
/// are self-attention: q, k and v hold the same tokens at positions 0 .. n - 1 of each
/// sequence (options.query_offset unset or 0). Arguments are checked before any parallel work;
/// an exception inside the parallel loops (std::bad_alloc) reaches the caller with its type,
/// the outputs then partly written.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/parallel.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/methods.hpp"
#include "poslsh/training/backward.hpp"
#include "poslsh/training/mean_of_outputs.hpp"

namespace poslsh {

namespace detail {

/// A thread's scratch for backward jobs that run one head on one thread.
template <typename Scalar>
struct BackwardScratch {
  BackwardWork<Scalar> work;
  CountWindows windows;
};

/// The backward table, one row per Method (the forward table: MethodKernels,
/// poslsh/multihead/methods.hpp; the switch: visit_method_row): backward(head, b, parallel,
/// scratch) writes the gradients of one head (its single-head backward; `parallel`: whether its
/// passes may run in parallel inside, `scratch` a thread's scratch when not), serial_backward
/// says whether a head may run on one thread inside a parallel loop over heads, and
/// has_slope_gradients whether backward writes the gradient in the head's slope (b.dslope).
/// The rows with has_slice_backward also have slice_backward(head, b, shift, extent, parallel,
/// work): the gradients of the queries of b.q at the key positions shift .. over the keys of
/// b.k (positions [0, extent) in all), ADDED to b.dq, b.dk, b.dv (and to *b.dslope).
template <Method M>
struct MethodBackward;

/// The flags of a backward row: serial_backward, has_slope_gradients and has_slice_backward.
template <bool SerialBackward, bool HasSlopeGradients, bool HasSliceBackward = false>
struct BackwardFlags {
  static constexpr bool serial_backward = SerialBackward;
  static constexpr bool has_slope_gradients = HasSlopeGradients;
  static constexpr bool has_slice_backward = HasSliceBackward;
};

/// exact_tiled and exact_banded: exact_backward over the head's window (a slice:
/// exact_slice_backward, any shift).
struct ExactMethodBackward : BackwardFlags<true, true, true> {
  template <typename Scalar, typename Input>
  static void slice_backward(const HeadMethod& head, HeadBackward<Scalar, Input>& b, Index shift,
                             Index extent, bool parallel, BackwardWork<Scalar>* work) {
    exact_slice_backward<Scalar, Input>(b.q, b.k, b.v, head.sigma, static_cast<double>(b.tau),
                                        head_window(head, extent, b.masking), shift, extent, b.out,
                                        b.lse, b.dout, b.dq, b.dk, b.dv, b.precision, parallel,
                                        work, b.dslope);
  }
  template <typename Scalar, typename Input>
  static void backward(const HeadMethod& head, HeadBackward<Scalar, Input>& b, bool parallel,
                       BackwardScratch<Scalar>* scratch) {
    // Shift-invariant (the bias and the masks depend on i - j only): b.origin plays no part.
    exact_backward<Scalar, Input>(b, head.sigma, head_window(head, b.q.rows(), b.masking), parallel,
                                  scratch == nullptr ? nullptr : &scratch->work);
  }
};

template <>
struct MethodBackward<Method::exact_tiled> : ExactMethodBackward {};
template <>
struct MethodBackward<Method::exact_banded> : ExactMethodBackward {};

/// lsh_fused: count_backward (the count-weighted estimator, each pair once); a slice:
/// count_rectangle_backward, the queries among the keys (0 <= shift, shift + m <= L; the bins of
/// the positions b.origin + ..).
template <>
struct MethodBackward<Method::lsh_fused> : BackwardFlags<true, false, true> {
  template <typename Scalar, typename Input>
  static void slice_backward(const HeadMethod& head, HeadBackward<Scalar, Input>& b, Index shift,
                             Index, bool parallel, BackwardWork<Scalar>* work) {
    count_rectangle_backward<Scalar, Input>(b, head.hashes, shift, true, parallel, work, nullptr);
  }
  template <typename Scalar, typename Input>
  static void backward(const HeadMethod& head, HeadBackward<Scalar, Input>& b, bool parallel,
                       BackwardScratch<Scalar>* scratch) {
    count_backward<Scalar, Input>(b, head.hashes, parallel,
                                  scratch == nullptr ? nullptr : &scratch->work,
                                  scratch == nullptr ? nullptr : &scratch->windows);
  }
};

/// lsh_per_sample and fixed_blocks: per_sample_backward (block by block, in parallel inside).
/// Their estimator is lsh_fused's on the same hashes (sum_k P^(k) = P), so a slice takes
/// lsh_fused's: count_rectangle_backward, each pair once at the cost of the slice's m query
/// rows (the same gradients to rounding as the per-sample evaluation; the queries among the
/// keys).
struct PerSampleMethodBackward : BackwardFlags<false, false, true> {
  template <typename Scalar, typename Input>
  static void slice_backward(const HeadMethod& head, HeadBackward<Scalar, Input>& b, Index shift,
                             Index extent, bool parallel, BackwardWork<Scalar>* work) {
    MethodBackward<Method::lsh_fused>::slice_backward<Scalar, Input>(head, b, shift, extent,
                                                                     parallel, work);
  }
  template <typename Scalar, typename Input>
  static void backward(const HeadMethod& head, HeadBackward<Scalar, Input>& b, bool,
                       BackwardScratch<Scalar>*) {
    per_sample_backward<Scalar, Input>(b, head.hashes);
  }
};

template <>
struct MethodBackward<Method::lsh_per_sample> : PerSampleMethodBackward {};
template <>
struct MethodBackward<Method::fixed_blocks> : PerSampleMethodBackward {};

/// mean_of_outputs: mean_of_outputs_backward_rows, which recomputes each sample's attention and
/// lse (out and lse are not read). Half-precision inputs are widened to float copies of the head
/// (O(n (2 d + 2 d_v)) scratch) and take the float backward, so their gradients are bitwise
/// those of the float call on the widened inputs.
template <>
struct MethodBackward<Method::mean_of_outputs> : BackwardFlags<false, false> {
  template <typename Scalar, typename Input>
  static void backward(const HeadMethod& head, HeadBackward<Scalar, Input>& b, bool,
                       BackwardScratch<Scalar>*) {
    const bool causal = b.masking == Masking::causal;
    if constexpr (std::is_same_v<Input, Scalar>) {
      mean_of_outputs_backward_rows<Scalar>(b.q, b.k, b.v, head.hashes, b.dout, b.dq, b.dk, b.dv,
                                            b.tau, causal, b.origin);
    } else {
      const RowMatrix<Scalar> q = b.q.template cast<Scalar>(), k = b.k.template cast<Scalar>(),
                              v = b.v.template cast<Scalar>(),
                              dout = b.dout.template cast<Scalar>();
      mean_of_outputs_backward_rows<Scalar>(q, k, v, head.hashes, dout, b.dq, b.dk, b.dv, b.tau,
                                            causal, b.origin);
    }
  }
};

}  // namespace detail

/// Whether a method has gradients in its ALiBi slopes (the dslopes of the all-heads backward:
/// exact_tiled, exact_banded); the bins of the LSH methods are sampled from the slope, not
/// differentiable in it.
constexpr bool method_has_slope_gradients(Method method) {
  return detail::visit_method_row<detail::MethodBackward>(
      method, [](auto row) { return decltype(row)::has_slope_gradients; });
}

/// Whether a method has the gradients of a slice of queries over a slice of keys
/// (multihead_attention_slice_backward, and the packed batches with fewer queries than keys:
/// exact_tiled, exact_banded, lsh_fused).
constexpr bool method_has_slice_backward(Method method) {
  return detail::visit_method_row<detail::MethodBackward>(
      method, [](auto row) { return decltype(row)::has_slice_backward; });
}

namespace detail {

/// The slope gradients dslopes (`size` entries) of a backward: a method that has them
/// (method_has_slope_gradients), and `entries` entries, one per query head or (`per_sequence`)
/// one per sequence and query head.
inline void require_slope_gradients(const char* function, const MultiHeadOptions& options,
                                    Index size, Index entries, bool per_sequence) {
  require(method_has_slope_gradients(options.method), function, "dslopes",
          enum_name(options.method), [&] {
            return "slope gradients need method " +
                   enum_name_list<Method>(method_has_slope_gradients) +
                   " (the bins of the LSH methods are not differentiable in the slope)";
          });
  require(size == entries, function, "dslopes", size, [&] {
    return "must hold one entry per " + std::string(per_sequence ? "sequence and " : "") +
           "query head (" + std::to_string(entries) + ")";
  });
}

/// The lse matrix of an all-heads call: q.heads x q.tokens (one row per query head).
template <typename LseType, typename QElement>
void require_lse_shape(const char* function, const LseType& lse, const HeadsView<QElement>& q) {
  require(
      lse.rows() == q.heads && lse.cols() == q.tokens, function, "lse",
      [&] { return std::to_string(lse.rows()) + "x" + std::to_string(lse.cols()); },
      [&] {
        return "shape must be q.heads x q.tokens = " + std::to_string(q.heads) + "x" +
               std::to_string(q.tokens);
      });
}

/// The checked arguments of an all-heads training call on the sequences [cu[b], cu[b + 1]) of
/// q, k and v (self-attention): the inputs (k and v with q's tokens), the lse matrix
/// (q.heads x q.tokens), out (q.tokens x q.heads x v.dim), the query offset (unset or 0) and
/// the methods of the heads (resolve_heads: per sequence when options.sigmas holds B H_q).
template <typename Scalar, typename LseType, typename OutElement>
HeadsCall training_call(const char* function, const HeadsView<const Scalar>& q,
                        const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                        const LseType& lse, const std::vector<std::int32_t>& cu_seqlens,
                        const HeadsView<OutElement>& out, const MultiHeadOptions& options) {
  require_self_positions(function, options);
  require_heads_inputs(function, q, k, v);
  require(k.tokens == q.tokens, function, "k.tokens", k.tokens, [&] {
    return "must equal q.tokens = " + std::to_string(q.tokens) + " (self-attention)";
  });
  require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  require_lse_shape(function, lse, q);
  require_cu_seqlens(function, "cu_seqlens", cu_seqlens, q.tokens);
  HeadsCall call;
  resolve_heads(call, function, q.heads, options, static_cast<Index>(cu_seqlens.size()) - 1);
  for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    call.sequences.push_back(
        {cu_seqlens[b], cu_seqlens[b + 1], cu_seqlens[b], cu_seqlens[b + 1], 0});
  }
  resolve_call_options(call, function, options, q.dim);
  return call;
}

/// The forward with lse of a training call: the methods checked (require_methods_with_lse),
/// then run_heads_forward into out and lse (q, k, v and out stored as Input, computed and lse
/// written in backward_scalar_t<Input>); a sequence whose values have no columns gets its lse
/// from a column of zeros (the probabilities do not depend on V).
template <typename Input>
void heads_forward_with_lse(const char* function, const HeadsCall& call,
                            const HeadsView<const Input>& q, const HeadsView<const Input>& k,
                            const HeadsView<const Input>& v, const HeadsView<Input>& out,
                            MatrixRef<backward_scalar_t<Input>>& lse) {
  using Compute = backward_scalar_t<Input>;
  require_methods_with_lse(function, call);
  if (v.dim == 0 && q.tokens > 0) {
    const std::vector<Input> zeros(static_cast<std::size_t>(k.tokens * k.heads), Input(0));
    std::vector<Input> sink(static_cast<std::size_t>(q.tokens * q.heads));
    const auto zero_values = interleaved_heads(zeros.data(), k.tokens, k.heads, 1);
    run_heads_forward<Compute>(call, q, ViewHeadsKeys<Input>{k, zero_values},
                               interleaved_heads(sink.data(), q.tokens, q.heads, 1), lse.data(),
                               lse.outerStride());
    return;
  }
  run_heads_forward<Compute>(call, q, ViewHeadsKeys<Input>{k, v}, out, lse.data(),
                             lse.outerStride());
}

/// The backward of a training call. Without grouping (H_q = H_kv) and for methods whose passes
/// run on one thread (lsh_fused, exact_tiled, exact_banded) every (sequence, head) is one job
/// of one parallel loop, heads in decreasing order (the LSH heads of large sigma cost the
/// most); otherwise sequences and heads run in order, each head's passes parallel inside, and
/// with groups each head's dK, dV go to scratch first, then are summed over the group in
/// increasing head order. Either way every gradient row is the single-head kernel's sum in
/// its fixed order: bitwise the same for any thread count.
/// q, k, v, out and dout are stored as Input, lse and the gradients in Scalar =
/// backward_scalar_t<Input> (half-precision rows widened as the passes pack them). With
/// dslopes: one entry per query head summed over the sequences, or (call.per_sequence) one per
/// sequence and query head, dslopes[b H_q + h].
template <typename Input, typename Scalar = backward_scalar_t<Input>>
void heads_backward(const HeadsCall& call, const HeadsView<const Input>& q,
                    const HeadsView<const Input>& k, const HeadsView<const Input>& v,
                    const HeadsView<const Input>& out, const ConstMatrixRef<Scalar>& lse,
                    const HeadsView<const Input>& dout, const HeadsView<Scalar>& dq,
                    const HeadsView<Scalar>& dk, const HeadsView<Scalar>& dv,
                    double* dslopes = nullptr) {
  const FlushSubnormals flush;  // as every thread of the passes (the group sums)
  const Index heads = q.heads, group = q.heads / k.heads;
  const auto tau = static_cast<Scalar>(call.tau);
  // dL/dslope of every (sequence, head), summed over the sequences in order at the end.
  std::vector<double> sequence_dslopes(
      dslopes == nullptr ? 0 : call.sequences.size() * static_cast<std::size_t>(heads), 0.0);
  // The gradients of head h of sequence s, into dk_h and dv_h.
  const auto head_job = [&](const HeadsSequence& s, Index h, MatrixRef<Scalar> dk_h,
                            MatrixRef<Scalar> dv_h, bool parallel,
                            BackwardScratch<Scalar>* scratch) {
    const Index begin = s.q_begin, end = s.q_end, g = h / group;
    HeadBackward<Scalar, Input> b{
        token_range(q, begin, end).head(h),
        token_range(k, begin, end).head(g),
        token_range(v, begin, end).head(g),
        token_range(out, begin, end).head(h),
        lse.row(h).segment(begin, end - begin).transpose(),
        token_range(dout, begin, end).head(h),
        token_range(dq, begin, end).head(h),
        dk_h,
        dv_h,
        tau,
        call.masking,
        dslopes == nullptr
            ? nullptr
            : &sequence_dslopes[static_cast<std::size_t>(&s - call.sequences.data()) *
                                    static_cast<std::size_t>(heads) +
                                static_cast<std::size_t>(h)],
        s.p0,
        call.precision};
    const HeadMethod& head = call.method(static_cast<std::size_t>(&s - call.sequences.data()), h);
    visit_method_row<MethodBackward>(head.method, [&](auto row) {
      decltype(row)::template backward<Scalar, Input>(head, b, parallel, scratch);
    });
  };
  bool one_thread_per_head = group == 1;
  for (const HeadMethod& head : call.heads) {
    one_thread_per_head = one_thread_per_head &&
                          visit_method_row<MethodBackward>(
                              head.method, [](auto row) { return decltype(row)::serial_backward; });
  }
  std::vector<std::size_t> sequences;
  for (std::size_t b = 0; b < call.sequences.size(); ++b) {
    if (call.sequences[b].q_end > call.sequences[b].q_begin) sequences.push_back(b);
  }
  const auto sum_dslopes = [&] {
    if (dslopes == nullptr) return;
    if (call.per_sequence) {
      std::copy(sequence_dslopes.begin(), sequence_dslopes.end(), dslopes);
      return;
    }
    for (Index h = 0; h < heads; ++h) {
      dslopes[h] = 0.0;
      for (std::size_t b = 0; b < call.sequences.size(); ++b)
        dslopes[h] +=
            sequence_dslopes[b * static_cast<std::size_t>(heads) + static_cast<std::size_t>(h)];
    }
  };
  if (one_thread_per_head) {
    const auto jobs = static_cast<long>(sequences.size()) * static_cast<long>(heads);
    // Each thread's scratch sized for the head widths before the loop; what depends on a head's
    // rule (the key tiles of a step, the packed steps, the count windows) grows on the thread's
    // first head of each size.
    PerThread<BackwardScratch<Scalar>> scratches(jobs);
    scratches.each([&](BackwardScratch<Scalar>& scratch) { scratch.work.prepare(q.dim, v.dim); });
    parallel_loop(
        jobs, LoopSchedule::dynamic(), scratches, [&](long j, BackwardScratch<Scalar>& scratch) {
          const HeadsSequence& s = call.sequences[sequences[static_cast<std::size_t>(j / heads)]];
          const Index h = heads - 1 - static_cast<Index>(j % heads);
          head_job(s, h, token_range(dk, s.q_begin, s.q_end).head(h),
                   token_range(dv, s.q_begin, s.q_end).head(h), false, &scratch);
        });
    sum_dslopes();
    return;
  }
  RowMatrix<Scalar> dk_head, dv_head;
  for (const std::size_t b : sequences) {
    const HeadsSequence& s = call.sequences[b];
    const Index n = s.q_end - s.q_begin;
    if (group > 1) {
      dk_head.resize(n, k.dim);
      dv_head.resize(n, v.dim);
    }
    for (Index h = 0; h < heads; ++h) {
      auto dk_g = token_range(dk, s.q_begin, s.q_end).head(h / group);
      auto dv_g = token_range(dv, s.q_begin, s.q_end).head(h / group);
      if (group == 1) {
        head_job(s, h, dk_g, dv_g, true, nullptr);
        continue;
      }
      head_job(s, h, dk_head, dv_head, true, nullptr);
      if (h % group == 0) {
        dk_g = dk_head;
        dv_g = dv_head;
      } else {
        dk_g += dk_head;
        dv_g += dv_head;
      }
    }
  }
  sum_dslopes();
}

/// The gradient views of a backward call: dout as out (q.tokens x q.heads x v.dim), dq as q,
/// dk as k and dv as v (k.tokens x k.heads x v.dim).
template <typename Input, typename Scalar>
void require_gradient_views(const char* function, const HeadsView<const Input>& q,
                            const HeadsView<const Input>& k, const HeadsView<const Input>& v,
                            const HeadsView<const Input>& dout, const HeadsView<Scalar>& dq,
                            const HeadsView<Scalar>& dk, const HeadsView<Scalar>& dv) {
  require_view_shape(function, "dout", dout, q.tokens, q.heads, v.dim);
  require_view_shape(function, "dq", dq, q.tokens, q.heads, q.dim);
  require_view_shape(function, "dk", dk, k.tokens, k.heads, k.dim);
  require_view_shape(function, "dv", dv, k.tokens, k.heads, v.dim);
}

/// The backward of a training call on the sequences [cu[b], cu[b + 1]) (every public
/// multihead_attention_backward and multihead_attention_varlen_backward): the arguments checked
/// (training_call, then the gradient views; with dslopes, the method exact_tiled or
/// exact_banded and one entry per method of call.heads: per query head, or per sequence and
/// query head), then heads_backward, which writes the slope gradients into *dslopes when it is
/// given.
template <typename Input, typename Scalar = backward_scalar_t<Input>>
void training_backward(const char* function, const HeadsView<const Input>& q,
                       const HeadsView<const Input>& k, const HeadsView<const Input>& v,
                       const HeadsView<const Input>& out, const ConstMatrixRef<Scalar>& lse,
                       const HeadsView<const Input>& dout,
                       const std::vector<std::int32_t>& cu_seqlens, const HeadsView<Scalar>& dq,
                       const HeadsView<Scalar>& dk, const HeadsView<Scalar>& dv,
                       const MultiHeadOptions& options,
                       Eigen::Ref<Eigen::VectorXd>* dslopes = nullptr) {
  const HeadsCall call = training_call(function, q, k, v, lse, cu_seqlens, out, options);
  require_gradient_views(function, q, k, v, dout, dq, dk, dv);
  if (dslopes != nullptr)
    require_slope_gradients(function, options, dslopes->size(),
                            static_cast<Index>(call.heads.size()), call.per_sequence);
  heads_backward<Input>(call, q, k, v, out, lse, dout, dq, dk, dv,
                        dslopes == nullptr ? nullptr : dslopes->data());
}

}  // namespace detail

/// multihead_attention with the log-sum-exp of every query head: lse (H_q x n, row h = head
/// h, FlashAttention's softmax_lse layout of one sequence) as in the single-head kernels with
/// lse; out bitwise that of multihead_attention. Self-attention (options.query_offset unset or
/// 0). One parallel loop over (query tile, head) jobs: bitwise the same for any thread count.
/// q, k, v and out are views of Scalar (float, double, Eigen::bfloat16 or Eigen::half, deduced
/// from them), lse of backward_scalar_t<Scalar> (float for the half-precision types: the
/// forwards with lse of poslsh/training/backward.hpp; out bitwise multihead_attention's with
/// OutScalar = Scalar under the same options.precision).
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_with_lse(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                  HeadsView<const Scalar> v, HeadsView<Scalar> out,
                                  HeadsLseRef<Scalar> lse, const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_with_lse";
  const detail::HeadsCall call = detail::training_call(
      function, q, k, v, lse, {0, static_cast<std::int32_t>(q.tokens)}, out, options);
  detail::heads_forward_with_lse<Scalar>(function, call, q, k, v, out, lse);
}

/// Gradients of multihead_attention for dO = dout, from its out and lse (H_q x n, the forward
/// with lse): for each query head h (K/V head g = h / G, G = H_q / H_kv), the single-head
/// backward of its method (alibi_attention_tiled_backward, alibi_attention_banded_backward
/// with W_h = band_for_bias_error(sigma_h, band_error), lsh_attention_fused_backward,
/// lsh_attention_per_sample_backward, fixed_blocks_attention_backward) gives dq_h, and
///   dk_g = sum_{h : h / G = g} dK_h,  dv_g = sum_{h : h / G = g} dV_h,
/// summed in increasing h. Bitwise the same for any thread count and as the single-head calls.
/// Extra memory O(n d) for grouped-query attention (one head's dK, dV). q, k, v, out and dout
/// are views of Scalar (float, double, Eigen::bfloat16 or Eigen::half, deduced from them), lse
/// and the gradients of backward_scalar_t<Scalar> (float for the half-precision types, whose
/// gradients are bitwise the float call's on the widened inputs, or from bfloat16 products on
/// the CPU's matrix unit under options.precision: poslsh/training/backward.hpp).
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                  HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                  ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
                                  GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk,
                                  GradientHeadsView<Scalar> dv,
                                  const MultiHeadOptions& options = {}) {
  detail::training_backward<Scalar>("multihead_attention_backward", q, k, v, out, lse, dout,
                                    {0, static_cast<std::int32_t>(q.tokens)}, dq, dk, dv, options);
}

/// multihead_attention_backward with the gradients in the ALiBi slopes too: dslopes (H_q
/// entries) gets, for each query head h with slope_h = 1/sigma_h,
///   dL/dslope_h = -sum_ij dS_ij |i - j|,   dS_ij = P_ij (dO_i . v_j - D_i) = dL/dx_ij,
/// over the pairs of the head's window, from the same tiles as dQ, dK, dV (which are bitwise
/// those of the call without dslopes). Each key tile's terms are summed in double in a fixed
/// order, so dslopes too is bitwise the same for any thread count. Methods exact_tiled and
/// exact_banded only: the bins of the LSH methods are not differentiable in the slope.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                  HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                  ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
                                  GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk,
                                  GradientHeadsView<Scalar> dv, Eigen::Ref<Eigen::VectorXd> dslopes,
                                  const MultiHeadOptions& options = {}) {
  detail::training_backward<Scalar>("multihead_attention_backward", q, k, v, out, lse, dout,
                                    {0, static_cast<std::int32_t>(q.tokens)}, dq, dk, dv, options,
                                    &dslopes);
}

/// multihead_attention on a packed batch of self-attention sequences, with the log-sum-exp:
/// sequence b is tokens [cu_seqlens[b], cu_seqlens[b + 1]) of q, k, v and out (positions
/// 0 .. m_b - 1 in each), and column t of lse (H_q x total tokens, FlashAttention's varlen
/// softmax_lse layout) is token t's. Each sequence's rows are bitwise those of
/// multihead_attention with lse on its views, and out is bitwise that of
/// multihead_attention_varlen(q, k, v, out, cu_seqlens, cu_seqlens, options). One parallel
/// loop over the (sequence, query tile, head) jobs: bitwise the same for any thread count.
/// \throws std::invalid_argument naming a bad argument (options.query_offset must be unset or
///   0), before any head runs.
template <typename Scalar>
void multihead_attention_varlen(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                HeadsView<const Scalar> v, HeadsView<Scalar> out,
                                HeadsLseRef<Scalar> lse,
                                const std::vector<std::int32_t>& cu_seqlens,
                                const MultiHeadOptions& options = {}) {
  constexpr const char* function = "multihead_attention_varlen";
  const detail::HeadsCall call =
      detail::training_call(function, q, k, v, lse, cu_seqlens, out, options);
  detail::heads_forward_with_lse<Scalar>(function, call, q, k, v, out, lse);
}

/// The forward of FlashAttention's variable-length call with its softmax_lse: the packed
/// batch of multihead_attention_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, options,
/// query_offsets) (queries at offsets over their own keys, bottom-right by default, a sequence
/// with more queries than keys as that call places it; out bitwise that call's), and column t
/// of lse (H_q x total query tokens) the log-sum-exp of query token t (-inf for a row that sees
/// no key). Its gradients, for the methods with method_has_slice_backward:
/// multihead_attention_varlen_slice_backward
/// (poslsh/parallel/slice.hpp). (A name of its own:
/// with braces for its last arguments a call would be ambiguous with the self-attention form.)
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_varlen_with_lse(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                         HeadsView<const Scalar> v, HeadsView<Scalar> out,
                                         HeadsLseRef<Scalar> lse,
                                         const std::vector<std::int32_t>& cu_seqlens_q,
                                         const std::vector<std::int32_t>& cu_seqlens_k,
                                         const MultiHeadOptions& options = {},
                                         const std::vector<Index>& query_offsets = {}) {
  constexpr const char* function = "multihead_attention_varlen_with_lse";
  const detail::HeadsCall call = detail::varlen_call(function, q, k, v, out, cu_seqlens_q,
                                                     cu_seqlens_k, options, query_offsets);
  detail::require_lse_shape(function, lse, q);
  detail::heads_forward_with_lse<Scalar>(function, call, q, k, v, out, lse);
}

/// Gradients of the packed-batch multihead_attention_varlen for dO = dout, from its out and
/// lse: for each sequence b, multihead_attention_backward on the sequence's views (tokens
/// [cu_seqlens[b], cu_seqlens[b + 1]) of every tensor, lse's columns of those tokens). No
/// gradient crosses sequences; bitwise the same for any thread count and as the per-sequence
/// calls.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_varlen_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                         HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                         ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
                                         const std::vector<std::int32_t>& cu_seqlens,
                                         GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk,
                                         GradientHeadsView<Scalar> dv,
                                         const MultiHeadOptions& options = {}) {
  detail::training_backward<Scalar>("multihead_attention_varlen_backward", q, k, v, out, lse, dout,
                                    cu_seqlens, dq, dk, dv, options);
}

/// multihead_attention_varlen_backward with the gradients in the ALiBi slopes (dslopes, H_q
/// entries, summed over the sequences in increasing order) as multihead_attention_backward
/// with dslopes. Methods exact_tiled and exact_banded only.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void multihead_attention_varlen_backward(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                         HeadsView<const Scalar> v, HeadsView<const Scalar> out,
                                         ConstHeadsLseRef<Scalar> lse, HeadsView<const Scalar> dout,
                                         const std::vector<std::int32_t>& cu_seqlens,
                                         GradientHeadsView<Scalar> dq, GradientHeadsView<Scalar> dk,
                                         GradientHeadsView<Scalar> dv,
                                         Eigen::Ref<Eigen::VectorXd> dslopes,
                                         const MultiHeadOptions& options = {}) {
  detail::training_backward<Scalar>("multihead_attention_varlen_backward", q, k, v, out, lse, dout,
                                    cu_seqlens, dq, dk, dv, options, &dslopes);
}

}  // namespace poslsh
