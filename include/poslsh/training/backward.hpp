// poslsh: training support. Every attention kernel with its per-row log-sum-exp (forward), and
// the gradients dQ, dK, dV of every kernel from dO, O and lse (backward), FlashAttention-2
// style: probabilities recomputed tile by tile from lse, no n x n buffer, O(n d) extra memory.
// Single heads (all heads and packed batches: poslsh/multihead/training.hpp). Reduction order and
// kernels: detail/backward/tiles.hpp; float accuracy: docs/backward.md.
//
// Conventions (FlashAttention's softmax_lse): for scores x_ij and weights w_ij of a kernel,
//   lse_i = M_i + log sum_j w_ij e^{x_ij - M_i}   (natural log, of the scaled scores),
//   P_ij = w_ij e^{x_ij - lse_i},  out_i = sum_j P_ij v_j,
// with x_ij = tau q_i.k_j - |i-j| / sigma, w = 1 for the exact kernels (tiled, banded: keys in
// the band) and x_ij = tau q_i.k_j, w_ij = c_ij (samples putting i and j in one block) for the
// LSH estimator (fused, per-sample, fixed blocks). A row without keys has lse = -inf. For a loss
// L with dO = dL/dout and D_i = dO_i . out_i:
//   dV = P^T dO,  dS_ij = P_ij (dO_i . v_j - D_i),  dQ = tau dS K,  dK = tau dS^T Q.
//
// Checked (std::invalid_argument naming the argument): the kernel's own arguments, lse of size
// n, out and dout n x d_v, dq and dk n x d, dv n x d_v (output rows must not overlap). Not
// checked: the values, that lse and out come from the forward of the same inputs, and that the
// gradient outputs overlap neither each other nor the inputs. An allocation that fails, on the
// calling thread or inside the passes' parallel loops (detail/parallel.hpp), reaches the caller
// as std::bad_alloc; the gradient outputs are then partly written.
//
// Scalar types of the backward passes: q, k, v, out and dout stored in one type Scalar (float,
// double, Eigen::bfloat16 or Eigen::half); lse and the gradients dq, dk, dv in
// backward_scalar_t<Scalar> (double for double, float otherwise). Half-precision rows are widened
// exactly to float where the float passes copy their operands anyway (each query step's Q and dO
// rows, each key tile's K and V rows, O and dO a few rows at a time for D): no extra memory, and
// the same sums in the same order, so the gradients are bitwise those of the float backward on
// float matrices holding the widened inputs. The gradients stay float because they are sums that
// training accumulates in float (over the heads of a group, over samples, into an optimizer's
// float master gradients); rounding them to the input type is one step for the caller.
// Except on a CPU matrix unit: with bfloat16 inputs, options.precision = Precision::matrix_units
// (the default) on a CPU with a bfloat16 unit (avx512_bf16, or amx_bf16, whose CPUs also have
// avx512_bf16: the backward multiplies on AVX512-BF16 dot products on both), the five
// products of every tile pair take bfloat16 operands with float sums (S = Q K^T and dP = dO V^T
// from the inputs; P and dS rounded to bfloat16 before P^T dO, dS K and dS^T Q), as
// FlashAttention's bfloat16 backward does; still bitwise the same for any thread count, within
// twice the error of such a plain bfloat16 backward (docs/half_precision.md).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "poslsh/attention/banded.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/attention/per_sample.hpp"
#include "poslsh/attention/tiled.hpp"
#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/matrix_units.hpp"
#include "poslsh/core/slopes.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/backward/blocks.hpp"
#include "poslsh/detail/backward/tiles.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/exact.hpp"
#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/tile/alibi_bias.hpp"
#include "poslsh/detail/tile/count_bias.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"
#include "poslsh/lsh/hash.hpp"

namespace poslsh {

namespace detail {

/// The forwards with lse and the backward passes are for self-attention at positions 0 .. n-1:
/// options.query_offset unset or 0.
inline void require_self_positions(const char* function, const AttentionOptions& options) {
  require(!options.query_offset || *options.query_offset == 0, function, "options.query_offset",
          options.query_offset ? *options.query_offset : 0,
          "must be unset or 0 (queries at positions 0 .. n-1)");
}

/// The lse vector: one entry per query row.
template <typename VectorType>
void require_lse_size(const char* function, const VectorType& lse, Index n) {
  require(lse.size() == n, function, "lse", lse.size(),
          [&] { return "size must be q.rows() = " + std::to_string(n); });
}

/// out, lse, dout, dq, dk, dv of a backward pass on Q (n x d), V (n x d_v).
template <typename Scalar, typename Input>
void require_backward_arguments(const char* function, const ConstMatrixRef<Input>& q,
                                const ConstMatrixRef<Input>& v, const ConstMatrixRef<Input>& out,
                                const ConstVectorRef<Scalar>& lse,
                                const ConstMatrixRef<Input>& dout, const MatrixRef<Scalar>& dq,
                                const MatrixRef<Scalar>& dk, const MatrixRef<Scalar>& dv) {
  const Index n = q.rows(), d = q.cols(), dv_cols = v.cols();
  require_matrix_shape(function, "out", out, n, dv_cols, false);
  require_lse_size(function, lse, n);
  require_matrix_shape(function, "dout", dout, n, dv_cols, false);
  require_matrix_shape(function, "dq", dq, n, d, true);
  require_matrix_shape(function, "dk", dk, n, d, true);
  require_matrix_shape(function, "dv", dv, n, dv_cols, true);
}

/// run(v, out) when V has columns; otherwise run(zero, sink) with a column of zeros for V and
/// a scratch output: the probabilities, and so the lse, do not depend on V.
template <typename Input, typename Run>
void with_value_columns(const ConstMatrixRef<Input>& v, MatrixRef<Input>& out, Run&& run) {
  if (v.cols() > 0) {
    run(v, out);
    return;
  }
  const RowMatrix<Input> zero = RowMatrix<Input>::Zero(v.rows(), 1);
  RowMatrix<Input> sink(out.rows(), 1);
  run(ConstMatrixRef<Input>(zero), MatrixRef<Input>(sink));
}

/// Exact ALiBi attention over `window` with lse, query tiles in parallel (exact_alibi_rows):
/// q, k, v and out stored as Input, computed (and lse written) in backward_scalar_t<Input>,
/// the products on the unit `precision` selects, as the forward without lse.
template <typename Input>
void exact_with_lse(const ConstMatrixRef<Input>& q, const ConstMatrixRef<Input>& k,
                    const ConstMatrixRef<Input>& v, double sigma, double tau, ExactWindow window,
                    MatrixRef<Input> out, backward_scalar_t<Input>* lse, Precision precision) {
  with_value_columns<Input>(v, out, [&](const ConstMatrixRef<Input>& values, MatrixRef<Input> o) {
    exact_alibi_rows<backward_scalar_t<Input>, Input, Input>(q, k, values, sigma, tau, window, 0,
                                                             q.rows(), o, 0, precision, lse);
  });
}

/// The fused estimator with lse, query tiles in parallel as lsh_attention_fused (types and
/// products as exact_with_lse).
template <typename Input, typename Scalar = backward_scalar_t<Input>>
void fused_with_lse(const ConstMatrixRef<Input>& q, const ConstMatrixRef<Input>& k,
                    const ConstMatrixRef<Input>& v, const HashSet& hashes, Scalar tau, bool causal,
                    MatrixRef<Input> out, Scalar* lse, Precision precision) {
  with_value_columns<Input>(v, out, [&](const ConstMatrixRef<Input>& values, MatrixRef<Input> o) {
    parallel_query_tiles<Scalar>(1, 0, q.rows(), JobOrder::head_runs, output_bytes(o),
                                 [&](Index, Index i0, Index rows, TileWorkspace<Scalar>& work) {
                                   fused_tile<Scalar, Input, Input>(q, k, values, hashes, tau,
                                                                    causal, i0, rows, o, work, 0,
                                                                    precision, lse + i0);
                                 });
  });
}

/// Whether a backward pass on inputs stored as Input multiplies on AVX512-BF16 dot products:
/// when Input is Eigen::bfloat16 and the forward would use a bfloat16 unit
/// (matrix_unit_for<Input, Input>(precision) is not float_products). A CPU with amx_bf16 also
/// has avx512_bf16, on which its backward runs; float16 inputs (amx_fp16 in the forward) are
/// widened. Any head widths: the pair kernels read rows padded to an even length.
template <typename Input>
bool backward_on_bf16_unit(Precision precision) {
  if constexpr (std::is_same_v<Input, Eigen::bfloat16>) {
    return matrix_unit_for<Input, Input>(precision) != MatrixUnit::float_products &&
           matrix_unit_available(MatrixUnit::avx512_bf16);
  } else {
    static_cast<void>(precision);
    return false;
  }
}

/// The inputs of one backward pass and what it derives from them: D = rowsum(dO o out) and a
/// contiguous copy of lse, owned here (`in` points into them, so a PassInputs stays where it
/// is built), and whether the products run on the AVX512-BF16 unit (backward_on_bf16_unit).
template <typename Scalar, typename Input>
struct PassInputs {
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> delta, lse;
  BackwardInputs<Scalar, Input> in;

  PassInputs(const ConstMatrixRef<Input>& q, const ConstMatrixRef<Input>& k,
             const ConstMatrixRef<Input>& v, const ConstMatrixRef<Input>& out,
             const ConstVectorRef<Scalar>& lse_in, const ConstMatrixRef<Input>& dout, Scalar tau,
             Precision precision)
      : delta(backward_delta<Scalar, Input>(out, dout)),
        lse(lse_in),
        in{q, k, v, dout, lse.data(), delta.data(), tau, backward_on_bf16_unit<Input>(precision)} {}
  PassInputs(const PassInputs&) = delete;
  PassInputs& operator=(const PassInputs&) = delete;
};

/// The pass of windowed_backward on its inputs (`pass`) under `rule`.
template <typename Scalar, typename Input, typename Rule>
void windowed_pass(const PassInputs<Scalar, Input>& pass, const Rule& rule, MatrixRef<Scalar>& dq,
                   MatrixRef<Scalar>& dk, MatrixRef<Scalar>& dv, bool parallel,
                   BackwardWork<Scalar>* work, double* dslope, bool accumulate) {
  BackwardOutputs<Scalar> grads =
      accumulate ? BackwardOutputs<Scalar>{dq, dk, dv} : fresh_backward_outputs(dq, dk, dv);
  std::vector<double> tile_sums;
  if (dslope != nullptr) {
    tile_sums.assign(static_cast<std::size_t>((rule.key_end() - rule.begin() + backward_tile - 1) /
                                              backward_tile),
                     0.0);
    grads.distance_sums = tile_sums.data();
  }
  if (parallel) {
    backward_parallel(pass.in, rule, grads);
  } else {
    BackwardWork<Scalar> own;
    backward_serial(pass.in, rule, grads, work != nullptr ? *work : own);
  }
  if (dslope != nullptr) {
    double distance_sum = 0.0;
    for (const double tile_sum : tile_sums) distance_sum += tile_sum;  // in key tile order
    if (accumulate)
      *dslope += -distance_sum;
    else
      *dslope = -distance_sum;
  }
}

/// Computes D and runs the pass of `rule` on fresh outputs (BackwardOutputs::fresh: it writes
/// every gradient row; with `accumulate`, it adds to them instead): in parallel, or on the
/// calling thread (`parallel` false: one head of a parallel loop over heads, with the thread's
/// scratch `work` when not null; the steps are packed as the groups of key tiles reach them;
/// the same sums in the same order, so the same bits).
/// The backward passes below compute in Scalar on q, k, v, out and dout stored as Input
/// (Scalar, or a half-precision type with Scalar float: rows widened as they are packed), with
/// the products on the AVX512-BF16 unit where backward_on_bf16_unit<Input>(precision)
/// (BackwardInputs::paired). When dslope is not null, the gradient in the ALiBi slope
/// (x_ij = tau q_i.k_j - slope |i - j|), -sum_ij dS_ij |i - j| from the key tiles' sums added in
/// key tile order, is written to *dslope (added to it with `accumulate`).
template <typename Scalar, typename Input, typename Rule>
void windowed_backward(const ConstMatrixRef<Input>& q, const ConstMatrixRef<Input>& k,
                       const ConstMatrixRef<Input>& v, const ConstMatrixRef<Input>& out,
                       const ConstVectorRef<Scalar>& lse, const ConstMatrixRef<Input>& dout,
                       Scalar tau, const Rule& rule, MatrixRef<Scalar>& dq, MatrixRef<Scalar>& dk,
                       MatrixRef<Scalar>& dv, Precision precision, bool parallel = true,
                       BackwardWork<Scalar>* work = nullptr, double* dslope = nullptr,
                       bool accumulate = false) {
  const FlushSubnormals flush;
  if (!accumulate) backward_zero_unreached<Scalar>(rule, dq);  // the pass writes the others
  const PassInputs<Scalar, Input> pass(q, k, v, out, lse, dout, tau, precision);
  if constexpr (std::is_same_v<Rule, WindowRule<Scalar>>) {
    // Dead pairs (WindowRule::dead_block) where some |i - j + shift| can exceed T / slope: the
    // bounds (1 + 2^-8) |tau| |q_i| and |k_j|, read once here.
    const Index reach = std::max(std::abs(rule.end() - 1 + rule.shift() - rule.begin()),
                                 std::abs(rule.begin() + rule.shift() - (rule.key_end() - 1)));
    if (static_cast<double>(rule.slope()) * static_cast<double>(reach) > dead_key_logit<Scalar>()) {
      std::vector<Scalar> score_bound(static_cast<std::size_t>(q.rows()));
      std::vector<Scalar> key_norm(static_cast<std::size_t>(k.rows()));
      for (Index i = 0; i < q.rows(); ++i)
        score_bound[static_cast<std::size_t>(i)] = static_cast<Scalar>(dead_key_query_bound(
            static_cast<double>(tau), tile_row_norm(q.data() + i * q.outerStride(), q.cols())));
      for (Index j = 0; j < k.rows(); ++j)
        key_norm[static_cast<std::size_t>(j)] =
            static_cast<Scalar>(tile_row_norm(k.data() + j * k.outerStride(), k.cols()));
      Rule bounded = rule;
      bounded.bound_scores(score_bound.data(), key_norm.data());
      return windowed_pass<Scalar, Input>(pass, bounded, dq, dk, dv, parallel, work, dslope,
                                          accumulate);
    }
  }
  windowed_pass<Scalar, Input>(pass, rule, dq, dk, dv, parallel, work, dslope, accumulate);
}

/// One head's tensors for a backward job (self-attention: q, k, v of the same n tokens): q, k,
/// v, out and dout stored as Input, lse and the gradients in the compute scalar Scalar.
template <typename Scalar, typename Input = Scalar>
struct HeadBackward {
  ConstMatrixRef<Input> q, k, v, out;
  ConstVectorRef<Scalar> lse;
  ConstMatrixRef<Input> dout;
  MatrixRef<Scalar> dq, dk, dv;
  Scalar tau;
  Masking masking;
  /// When not null (exact methods only): dL/dslope of the head, slope = 1/sigma.
  double* dslope = nullptr;
  /// The position of the first token (the LSH bins are those of the positions origin ..).
  Index origin = 0;
  /// Where bfloat16 inputs are multiplied (BackwardInputs::paired).
  Precision precision = Precision::float_products;
};

/// Exact ALiBi backward of one head over `window` (tiled: the whole causal or bidirectional
/// window); dL/dslope into *b.dslope when it is not null.
template <typename Scalar, typename Input = Scalar>
void exact_backward(HeadBackward<Scalar, Input>& b, double sigma, ExactWindow window,
                    bool parallel = true, BackwardWork<Scalar>* work = nullptr) {
  const Index n = b.q.rows();
  // The tile engine's window is lo <= i - j <= hi; the rule's the same.
  const WindowRule<Scalar> rule(0, n, window.lo, window.hi, finite_alibi_slope<Scalar>(sigma, n));
  windowed_backward<Scalar, Input>(b.q, b.k, b.v, b.out, b.lse, b.dout, b.tau, rule, b.dq, b.dk,
                                   b.dv, b.precision, parallel, work, b.dslope);
}

/// Exact ALiBi backward of the m queries of q at positions p0 .. p0 + m - 1 over the L keys of k
/// and v at positions k0 .. k0 + L - 1 (shift = p0 - k0), `window` in positions (lo <= i - j <=
/// hi), the slope of sigma kept finite up to `extent` (the positions' end): the gradients of
/// the pairs of the slice with P_ij = e^{x_ij - lse_i}, lse the rows' log-sum-exp over every
/// key of their sequence, ADDED to dq (m rows), dk and dv (L rows), and -sum_ij dS_ij |i - j|
/// added to *dslope when it is not null. The pass of exact_backward on the rectangle, bitwise
/// the same for any thread count.
template <typename Scalar, typename Input = Scalar>
void exact_slice_backward(const ConstMatrixRef<Input>& q, const ConstMatrixRef<Input>& k,
                          const ConstMatrixRef<Input>& v, double sigma, double tau,
                          ExactWindow window, Index shift, Index extent,
                          const ConstMatrixRef<Input>& out, const ConstVectorRef<Scalar>& lse,
                          const ConstMatrixRef<Input>& dout, MatrixRef<Scalar>& dq,
                          MatrixRef<Scalar>& dk, MatrixRef<Scalar>& dv, Precision precision,
                          bool parallel = true, BackwardWork<Scalar>* work = nullptr,
                          double* dslope = nullptr) {
  if (q.rows() == 0 || k.rows() == 0) return;
  const WindowRule<Scalar> rule(0, q.rows(), k.rows(), window.lo, window.hi,
                                finite_alibi_slope<Scalar>(sigma, extent), shift);
  windowed_backward<Scalar, Input>(q, k, v, out, lse, dout, static_cast<Scalar>(tau), rule, dq, dk,
                                   dv, precision, parallel, work, dslope, true);
}

/// The count-weighted estimator's backward (the fused evaluation, each pair once) of the m
/// queries of b.q at the positions b.origin + shift .. b.origin + shift + m - 1 of the hashes'
/// sequence over the L keys of b.k and b.v at b.origin .. b.origin + L - 1 (0 <= shift,
/// shift + m <= L), with b.out and b.lse the rows' over every key of the sequence: the
/// gradients of these pairs (c_ij of the absolute positions; causal: key position <= query
/// position), written to b.dq, b.dk, b.dv, or ADDED to them with `accumulate`. One pass on the
/// rectangle (query steps of 64 from the first query): the same bits for any thread count.
/// `work` and `windows` (when not null) are a thread's scratch, reused across heads.
template <typename Scalar, typename Input = Scalar>
void count_rectangle_backward(HeadBackward<Scalar, Input>& b, const HashSet& hashes, Index shift,
                              bool accumulate, bool parallel, BackwardWork<Scalar>* work,
                              CountWindows* windows) {
  const Index m = b.q.rows(), n = b.k.rows();
  const bool causal = b.masking == Masking::causal;
  CountWindows own;
  CountWindows& counts = windows != nullptr ? *windows : own;
  counts.build(hashes, m, n, shift, causal, b.origin);
  const CountRule<Scalar> rule(counts, m, n, shift, causal);
  windowed_backward<Scalar, Input>(b.q, b.k, b.v, b.out, b.lse, b.dout, b.tau, rule, b.dq, b.dk,
                                   b.dv, b.precision, parallel, work, nullptr, accumulate);
}

/// The count-weighted estimator's backward of one head (fused and per-sample give the same
/// gradients; this is the fused evaluation): count_rectangle_backward on the whole head
/// (self-attention, shift 0), its gradients written. Rows are the positions b.origin ..
/// b.origin + n - 1 of the hashes' sequence.
template <typename Scalar, typename Input = Scalar>
void count_backward(HeadBackward<Scalar, Input>& b, const HashSet& hashes, bool parallel = true,
                    BackwardWork<Scalar>* work = nullptr, CountWindows* windows = nullptr) {
  count_rectangle_backward<Scalar, Input>(b, hashes, 0, false, parallel, work, windows);
}

/// The count-weighted estimator's backward of one head sample by sample, block by block (the
/// per-sample kernel's structure): the compensated sum over samples of plain-attention gradients
/// with the combined lse. Rows are the positions b.origin .. b.origin + n - 1 of the hashes'
/// sequence.
template <typename Scalar, typename Input = Scalar>
void per_sample_backward(HeadBackward<Scalar, Input>& b, const HashSet& hashes) {
  const detail::FlushSubnormals flush;
  b.dq.setZero();
  b.dk.setZero();
  b.dv.setZero();
  const PassInputs<Scalar, Input> pass(b.q, b.k, b.v, b.out, b.lse, b.dout, b.tau, b.precision);
  BackwardOutputs<Scalar> grads{b.dq, b.dk, b.dv};
  backward_hash_blocks(pass.in, hashes, b.masking == Masking::causal, grads, b.origin);
}

/// The checks every backward entry point makes (self-attention from position 0, the shapes of
/// q, k, v, out, lse, dout and the gradients); returns tau (options.scale or 1/sqrt(d)).
template <typename Scalar, typename Input>
double backward_scale(const char* function, const ConstMatrixRef<Input>& q,
                      const ConstMatrixRef<Input>& k, const ConstMatrixRef<Input>& v,
                      const ConstMatrixRef<Input>& out, const ConstVectorRef<Scalar>& lse,
                      const ConstMatrixRef<Input>& dout, const MatrixRef<Scalar>& dq,
                      const MatrixRef<Scalar>& dk, const MatrixRef<Scalar>& dv,
                      const AttentionOptions& options) {
  require_self_positions(function, options);
  require_qkv_shapes(function, q, k, v);
  require_self_attention(function, q, k);
  require_backward_arguments<Scalar, Input>(function, q, v, out, lse, dout, dq, dk, dv);
  return resolve_scale(function, options, q.cols());
}

/// The two evaluations of the LSH estimator in the forwards with lse and the backward entry
/// points: the fused kernel's count tiles (fused_with_lse, count_backward) and the per-sample
/// blocks (per_sample_forward, per_sample_backward).
enum class LshPass { counts, per_sample };

/// The body of an LSH forward with lse (fused, per-sample): the checks (self-attention from
/// position 0, the views and hashes, lse of size n, the options), then the pass over the rows,
/// if any.
template <typename Input>
void lsh_lse_call(const char* function, const ConstMatrixRef<Input>& q,
                  const ConstMatrixRef<Input>& k, const ConstMatrixRef<Input>& v,
                  const HashSet& hashes, MatrixRef<Input> out,
                  VectorRef<backward_scalar_t<Input>>& lse, const AttentionOptions& options,
                  LshPass pass) {
  require_self_positions(function, options);
  require_lsh_arguments(function, q, k, v, hashes, out);
  require_lse_size(function, lse, q.rows());
  const auto tau =
      static_cast<backward_scalar_t<Input>>(resolve_scale(function, options, q.cols()));
  if (q.rows() == 0) return;
  const bool causal = options.masking == Masking::causal;
  if (pass == LshPass::counts) {
    fused_with_lse<Input>(q, k, v, hashes, tau, causal, out, lse.data(), options.precision);
  } else {
    per_sample_forward<Input>(q, k, v, hashes, tau, causal, out, lse.data(), options.precision);
  }
}

/// The body of an LSH backward entry point: the checks (the hashes and backward_scale's), then
/// the pass over the rows, if any.
template <typename Scalar, typename Input>
void lsh_backward_call(const char* function, const ConstMatrixRef<Input>& q,
                       const ConstMatrixRef<Input>& k, const ConstMatrixRef<Input>& v,
                       const HashSet& hashes, const ConstMatrixRef<Input>& out,
                       const ConstVectorRef<Scalar>& lse, const ConstMatrixRef<Input>& dout,
                       MatrixRef<Scalar> dq, MatrixRef<Scalar> dk, MatrixRef<Scalar> dv,
                       const AttentionOptions& options, LshPass pass) {
  validate_hashes(hashes, function);
  const auto tau = static_cast<Scalar>(
      backward_scale<Scalar, Input>(function, q, k, v, out, lse, dout, dq, dk, dv, options));
  if (q.rows() == 0) return;
  HeadBackward<Scalar, Input> b{
      q, k, v, out, lse, dout, dq, dk, dv, tau, options.masking, nullptr, 0, options.precision};
  if (pass == LshPass::counts) {
    count_backward<Scalar, Input>(b, hashes);
  } else {
    per_sample_backward<Scalar, Input>(b, hashes);
  }
}

/// The body of the exact forwards with lse (tiled, banded): the checks (self-attention from
/// position 0, the views, sigma, lse of size n), then exact_with_lse over window(n) when there
/// are rows.
template <typename Input, typename Window>
void exact_lse_call(const char* function, const ConstMatrixRef<Input>& q,
                    const ConstMatrixRef<Input>& k, const ConstMatrixRef<Input>& v, double sigma,
                    MatrixRef<Input> out, VectorRef<backward_scalar_t<Input>>& lse,
                    const AttentionOptions& options, Window window) {
  require_self_positions(function, options);
  require_exact_arguments<Input>(function, q, k, v, sigma, 0, q.rows(), out);
  require_lse_size(function, lse, q.rows());
  const double tau = resolve_scale(function, options, q.cols());
  const Index n = q.rows();
  if (n == 0) return;
  exact_with_lse<Input>(q, k, v, sigma, tau, window(n), out, lse.data(), options.precision);
}

/// The body of the exact backward passes (tiled, banded): the checks (sigma and
/// backward_scale's), then exact_backward over window(n) when there are rows.
template <typename Scalar, typename Input, typename Window>
void exact_backward_call(const char* function, const ConstMatrixRef<Input>& q,
                         const ConstMatrixRef<Input>& k, const ConstMatrixRef<Input>& v,
                         double sigma, const ConstMatrixRef<Input>& out,
                         const ConstVectorRef<Scalar>& lse, const ConstMatrixRef<Input>& dout,
                         MatrixRef<Scalar>& dq, MatrixRef<Scalar>& dk, MatrixRef<Scalar>& dv,
                         const AttentionOptions& options, Window window) {
  require_sigma(sigma, function);
  const auto tau = static_cast<Scalar>(
      backward_scale<Scalar, Input>(function, q, k, v, out, lse, dout, dq, dk, dv, options));
  const Index n = q.rows();
  if (n == 0) return;
  HeadBackward<Scalar, Input> b{
      q, k, v, out, lse, dout, dq, dk, dv, tau, options.masking, nullptr, 0, options.precision};
  exact_backward<Scalar, Input>(b, sigma, window(n));
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Forward with log-sum-exp.
//
// Scalar types of the forwards with lse: q, k, v and out stored in one type Scalar (float,
// double, Eigen::bfloat16 or Eigen::half, as the backward passes read them), lse in
// backward_scalar_t<Scalar> (float for the half-precision types). Computed as the forward
// without lse with OutScalar = Scalar, on the unit options.precision selects: out bitwise that
// forward's (half-precision inputs: the float result rounded once, or from bfloat16 products on
// the CPU's matrix unit), lse the log-sum-exp of the same scores and weights in float (under
// Precision::float_products out and lse are bitwise the float call's on the widened inputs,
// out rounded once to Scalar).

/// alibi_attention_tiled_with_lse: alibi_attention_tiled with the log-sum-exp: out_i = sum_j
/// e^{x_ij - lse_i} v_j and
///   lse_i = M_i + log sum_j e^{x_ij - M_i},  x_ij = tau q_i.k_j - |i-j| / sigma
/// (causal: j <= i), from the same tiles and online softmax (the running maximum M_i and sum);
/// out is bitwise that of the overload without lse. Query tiles in parallel (OpenMP), bitwise
/// the same for any thread count. Throws
/// std::invalid_argument naming a bad argument (lse: size n).
template <typename Scalar>
void alibi_attention_tiled_with_lse(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                    ConstMatrixRef<Scalar> v, double sigma, MatrixRef<Scalar> out,
                                    LseRef<Scalar> lse, const AttentionOptions& options = {}) {
  detail::exact_lse_call<Scalar>(
      "alibi_attention_tiled_with_lse", q, k, v, sigma, out, lse, options,
      [&](Index keys) { return detail::full_window(keys, options.masking); });
}

/// alibi_attention_banded_with_lse: alibi_attention_banded with the log-sum-exp: lse_i = log
/// sum_{|i-j| <= band} e^{x_ij} (stably, as M_i + log sum e^{x_ij - M_i}), x_ij = tau q_i.k_j -
/// |i-j| / sigma (causal: j <= i); out bitwise that of the overload without lse. Query tiles in
/// parallel (OpenMP).
template <typename Scalar>
void alibi_attention_banded_with_lse(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                     ConstMatrixRef<Scalar> v, double sigma, Index band,
                                     MatrixRef<Scalar> out, LseRef<Scalar> lse,
                                     const AttentionOptions& options = {}) {
  detail::require_size(band, "alibi_attention_banded_with_lse", "band");
  detail::exact_lse_call<Scalar>(
      "alibi_attention_banded_with_lse", q, k, v, sigma, out, lse, options,
      [&](Index keys) { return detail::banded_window(keys, band, options.masking); });
}

/// lsh_attention_fused_with_lse: lsh_attention_fused with the log-sum-exp: lse_i = M_i + log sum_j
/// c_ij e^{tau q_i.k_j - M_i}, c_ij = #{k : bin_k(i) = bin_k(j)} (causal: j <= i), from the same
/// tiles; out bitwise that of the overload without lse. Query tiles in parallel (OpenMP), bitwise
/// the same for any thread count.
template <typename Scalar>
void lsh_attention_fused_with_lse(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                  ConstMatrixRef<Scalar> v, const HashSet& hashes,
                                  MatrixRef<Scalar> out, LseRef<Scalar> lse,
                                  const AttentionOptions& options = {}) {
  detail::lsh_lse_call<Scalar>("lsh_attention_fused_with_lse", q, k, v, hashes, out, lse, options,
                               detail::LshPass::counts);
}

/// lsh_attention_per_sample_with_lse: lsh_attention_per_sample with the log-sum-exp: the same
/// estimator, lse_i = M_i + log sum_j c_ij e^{tau q_i.k_j - M_i} from the samples' partial results
/// merged pairwise (equal to the fused kernel's lse to rounding); out bitwise that of the overload
/// without lse.
template <typename Scalar>
void lsh_attention_per_sample_with_lse(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                       ConstMatrixRef<Scalar> v, const HashSet& hashes,
                                       MatrixRef<Scalar> out, LseRef<Scalar> lse,
                                       const AttentionOptions& options = {}) {
  detail::lsh_lse_call<Scalar>("lsh_attention_per_sample_with_lse", q, k, v, hashes, out, lse,
                               options, detail::LshPass::per_sample);
}

/// fixed_blocks_attention_with_lse: fixed_blocks_attention with the log-sum-exp:
/// lsh_attention_per_sample with lse for the single hash fixed_blocks_hash(sigma), so lse_i = log
/// sum_{j in B(i)} e^{tau q_i.k_j}.
template <typename Scalar>
void fixed_blocks_attention_with_lse(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                     ConstMatrixRef<Scalar> v, double sigma, MatrixRef<Scalar> out,
                                     LseRef<Scalar> lse, const AttentionOptions& options = {}) {
  lsh_attention_per_sample_with_lse<Scalar>(q, k, v, HashSet{fixed_blocks_hash(sigma)}, out, lse,
                                            options);
}

// ---------------------------------------------------------------------------------------------
// Backward.

/// Gradients of exact ALiBi attention (alibi_attention_tiled): with
/// P_ij = e^{x_ij - lse_i}, x_ij = tau q_i.k_j - |i-j| / sigma (causal: j <= i), dO = dout,
/// D_i = dO_i . out_i:
///   dv = P^T dO,  dS_ij = P_ij (dO_i . v_j - D_i),  dq = tau dS K,  dk = tau dS^T Q.
/// `out` and `lse` come from the forward with lse. One parallel pass (OpenMP) over key tiles of
/// 64, each meeting its query rows in steps of 64 with P recomputed from lse (nothing n x n
/// stored; extra memory O(n (d + d_v)): Q and dO packed per step): the thread of a key tile
/// writes its dk and dv rows, summing each step's rows in increasing order and the steps' sums
/// in increasing order; each key tile's contribution to a dq row is summed over its keys in
/// increasing order and added in increasing key tile order (a thread waits for the key tiles
/// before its own). Bitwise the same for any thread count. q, k, v, out and dout in Scalar
/// (float, double, Eigen::bfloat16, Eigen::half), lse and the gradients in
/// backward_scalar_t<Scalar> (half-precision inputs: bitwise the float call on the widened
/// inputs, or bfloat16 products on the CPU's matrix unit under options.precision; file
/// comment). Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void alibi_attention_tiled_backward(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                    ConstMatrixRef<Scalar> v, double sigma,
                                    ConstMatrixRef<Scalar> out, ConstLseRef<Scalar> lse,
                                    ConstMatrixRef<Scalar> dout, GradientRef<Scalar> dq,
                                    GradientRef<Scalar> dk, GradientRef<Scalar> dv,
                                    const AttentionOptions& options = {}) {
  detail::exact_backward_call<backward_scalar_t<Scalar>, Scalar>(
      "alibi_attention_tiled_backward", q, k, v, sigma, out, lse, dout, dq, dk, dv, options,
      [&](Index keys) { return detail::full_window(keys, options.masking); });
}

/// Gradients of banded exact ALiBi attention (alibi_attention_banded): the formulas of
/// alibi_attention_tiled_backward with P_ij = 0 for |i - j| > band; only the tiles meeting the
/// band are visited (cost O(n (band + tile) d)). Same passes, ordering and scalar types, bitwise
/// the same for any thread count. Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void alibi_attention_banded_backward(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                     ConstMatrixRef<Scalar> v, double sigma, Index band,
                                     ConstMatrixRef<Scalar> out, ConstLseRef<Scalar> lse,
                                     ConstMatrixRef<Scalar> dout, GradientRef<Scalar> dq,
                                     GradientRef<Scalar> dk, GradientRef<Scalar> dv,
                                     const AttentionOptions& options = {}) {
  detail::require_size(band, "alibi_attention_banded_backward", "band");
  detail::exact_backward_call<backward_scalar_t<Scalar>, Scalar>(
      "alibi_attention_banded_backward", q, k, v, sigma, out, lse, dout, dq, dk, dv, options,
      [&](Index keys) { return detail::banded_window(keys, band, options.masking); });
}

/// Gradients of the count-weighted LSH estimator (lsh_attention_fused): with
/// P_ij = c_ij e^{tau q_i.k_j - lse_i}, c_ij = #{k : bin_k(i) = bin_k(j)} (causal: j <= i),
/// D_i = dO_i . out_i:
///   dv = P^T dO,  dS_ij = P_ij (dO_i . v_j - D_i),  dq = tau dS K,  dk = tau dS^T Q.
/// Each pair with c_ij > 0 is evaluated once, on the forward's windows [lo_i, hi_i) and count
/// tiles (the rectangles of the forward's TileCounts, kept for the n / 64 query tiles: O(n s)
/// memory, and O(n (d + d_v)) for Q and dO packed per step). One parallel pass (OpenMP) over
/// key tiles of 64, each meeting the query rows whose windows reach it in steps of 64, in the
/// reduction order and with the scalar types of alibi_attention_tiled_backward. Bitwise the same
/// for any thread count. Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void lsh_attention_fused_backward(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                  ConstMatrixRef<Scalar> v, const HashSet& hashes,
                                  ConstMatrixRef<Scalar> out, ConstLseRef<Scalar> lse,
                                  ConstMatrixRef<Scalar> dout, GradientRef<Scalar> dq,
                                  GradientRef<Scalar> dk, GradientRef<Scalar> dv,
                                  const AttentionOptions& options = {}) {
  detail::lsh_backward_call<backward_scalar_t<Scalar>, Scalar>(
      "lsh_attention_fused_backward", q, k, v, hashes, out, lse, dout, dq, dk, dv, options,
      detail::LshPass::counts);
}

/// Gradients of lsh_attention_per_sample, the same estimator as lsh_attention_fused, computed
/// the per-sample way: for each hash in order, plain-attention gradients on each of its blocks B
/// (causal inside B) with the combined lse and D, summed over the samples:
///   P^(k)_ij = e^{tau q_i.k_j - lse_i} [bin_k(i) = bin_k(j)],  sum_k P^(k) = P,
/// so the result equals lsh_attention_fused_backward to rounding. Cost sum_k sum_B |B|^2 d.
/// Blocks of one sample run in parallel (OpenMP) on disjoint rows, samples in order, the
/// samples' gradients added with a compensated (Neumaier) sum so that the rounding error does
/// not grow with s: bitwise the same for any thread count. Scalar types as
/// alibi_attention_tiled_backward's. Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void lsh_attention_per_sample_backward(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                       ConstMatrixRef<Scalar> v, const HashSet& hashes,
                                       ConstMatrixRef<Scalar> out, ConstLseRef<Scalar> lse,
                                       ConstMatrixRef<Scalar> dout, GradientRef<Scalar> dq,
                                       GradientRef<Scalar> dk, GradientRef<Scalar> dv,
                                       const AttentionOptions& options = {}) {
  detail::lsh_backward_call<backward_scalar_t<Scalar>, Scalar>(
      "lsh_attention_per_sample_backward", q, k, v, hashes, out, lse, dout, dq, dk, dv, options,
      detail::LshPass::per_sample);
}

/// Gradients of fixed_blocks_attention: lsh_attention_per_sample_backward with the single hash
/// fixed_blocks_hash(sigma), i.e. plain-attention gradients inside consecutive blocks of
/// 2 sigma tokens.
template <typename Scalar>
void fixed_blocks_attention_backward(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                     ConstMatrixRef<Scalar> v, double sigma,
                                     ConstMatrixRef<Scalar> out, ConstLseRef<Scalar> lse,
                                     ConstMatrixRef<Scalar> dout, GradientRef<Scalar> dq,
                                     GradientRef<Scalar> dk, GradientRef<Scalar> dv,
                                     const AttentionOptions& options = {}) {
  lsh_attention_per_sample_backward<Scalar>(q, k, v, HashSet{fixed_blocks_hash(sigma)}, out, lse,
                                            dout, dq, dk, dv, options);
}

}  // namespace poslsh
