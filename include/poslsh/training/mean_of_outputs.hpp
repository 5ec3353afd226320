// poslsh: the mean-of-outputs LSH estimator, forward and backward: the mean of the s per-sample
// plain attentions, each a softmax on the blocks of one hash. It differs from the count-weighted
// estimator of lsh_attention_fused / lsh_attention_per_sample, which normalizes once over all
// samples. All heads and packed batches: Method::mean_of_outputs of the method table
// (poslsh/multihead/methods.hpp), computed by the functions of this file.
//
// It has no log-sum-exp: each sample's softmax has its own normalizer, so no one lse_i gives
// out_i = sum_j e^{x_ij - lse_i} v_j (nor merges partial results over key slices). Its backward
// recomputes each sample's attention and lse from q, k, v.
//
// Checked (std::invalid_argument naming the argument): the shapes of q, k, v and out (dout, dq,
// dk, dv for the backward), a non-empty set of valid hashes, options.scale finite,
// options.masking valid. Not checked: the values, and that outputs overlap no input.
#pragma once

#include <Eigen/Core>
#include <type_traits>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/backward/blocks.hpp"
#include "poslsh/detail/backward/tiles.hpp"
#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/per_sample.hpp"
#include "poslsh/training/backward.hpp"

namespace poslsh {

namespace detail {

/// The gradients of mean_of_outputs_rows for self-attention on the n tokens of q, k, v at
/// positions origin .. origin + n - 1 (bins and masks at those positions), into dq, dk, dv (set,
/// not accumulated): see lsh_attention_mean_of_outputs_backward. Samples in order, each sample's
/// forward (per_sample_rows, query tiles in parallel) and its blocks' passes
/// (backward_hash_blocks, blocks in parallel) on disjoint rows: bitwise the same for any thread
/// count.
template <typename Scalar>
void mean_of_outputs_backward_rows(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
                                   const ConstMatrixRef<Scalar>& v, const HashSet& hashes,
                                   const ConstMatrixRef<Scalar>& dout, MatrixRef<Scalar> dq,
                                   MatrixRef<Scalar> dk, MatrixRef<Scalar> dv, Scalar tau,
                                   bool causal, Index origin) {
  dq.setZero();
  dk.setZero();
  dv.setZero();
  const Index n = q.rows();
  if (n == 0) return;
  const RowMatrix<Scalar> scaled = dout / static_cast<Scalar>(hashes.size());
  const ConstMatrixRef<Scalar> scaled_ref(scaled);
  RowMatrix<Scalar> sample(n, v.cols());
  MatrixRef<Scalar> sample_ref(sample);
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> lse(n);
  BackwardOutputs<Scalar> grads{dq, dk, dv};
  PerThread<BackwardWork<Scalar>> works;  // the samples' block passes share the threads' scratch
  for (const BinHash& hash : hashes) {
    per_sample_rows<Scalar, Scalar, Scalar, Scalar>(
        q, k, v, HashSet{hash}, tau, causal, TilePositions(origin, origin),
        Precision::float_products, sample_ref, lse.data());
    // D rounded as the passes round dP (subnormals flushed), the forward above as forwards do.
    const Eigen::Matrix<Scalar, Eigen::Dynamic, 1> delta = [&] {
      const FlushSubnormals flush;
      return backward_delta<Scalar>(ConstMatrixRef<Scalar>(sample), scaled_ref);
    }();
    const BackwardInputs<Scalar> in{q, k, v, scaled_ref, lse.data(), delta.data(), tau};
    backward_hash_blocks(in, hash, causal, grads, origin, &works);
  }
}

}  // namespace detail

/// Mean-of-outputs LSH ALiBi attention:
///   T_bar_i = (1/s) sum_k sum_{j in B_k(i)} e^{x_ij} v_j / sum_{j in B_k(i)} e^{x_ij},
///   x_ij = tau q_i.k_j,
/// B_k(i) the block of hash k holding i (causal: its keys j <= i), i.e. the mean of the s
/// plain attentions on each sample's blocks. Sample by sample (query tiles in parallel, OpenMP,
/// on disjoint rows), the sum in sample order, then divided by s: bitwise the same for
/// any thread count. Extra memory O(n d_v). Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void lsh_attention_mean_of_outputs(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                   ConstMatrixRef<Scalar> v, const HashSet& hashes,
                                   MatrixRef<Scalar> out, const AttentionOptions& options = {}) {
  constexpr const char* function = "lsh_attention_mean_of_outputs";
  detail::require_self_positions(function, options);
  detail::require_lsh_arguments(function, q, k, v, hashes, out);
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, options, q.cols()));
  detail::mean_of_outputs_rows<Scalar, Scalar, Scalar>(q, detail::StridedRows<Scalar>(k, v), hashes,
                                                       tau, options.masking == Masking::causal, 0,
                                                       Precision::float_products, out);
}

/// Returning form of lsh_attention_mean_of_outputs.
template <typename Scalar>
RowMatrix<Scalar> lsh_attention_mean_of_outputs(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                                ConstMatrixRef<Scalar> v, const HashSet& hashes,
                                                const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  lsh_attention_mean_of_outputs<Scalar>(q, k, v, hashes, out, options);
  return out;
}

/// Gradients of lsh_attention_mean_of_outputs for dO = dout: the sum over samples k of the
/// plain-attention backward on sample k's blocks with dO / s,
///   P^(k)_ij = e^{x_ij - lse^(k)_i} [j in B_k(i)],  D^(k)_i = (dO_i / s) . O^(k)_i,
///   dv += P^(k)T dO / s,  dS^(k)_ij = P^(k)_ij ((dO_i / s) . v_j - D^(k)_i),
///   dq += tau dS^(k) K,  dk += tau dS^(k)T Q,
/// where O^(k) and lse^(k) are sample k's attention and log-sum-exp, recomputed here (one
/// forward per sample; extra memory O(n d_v)). Samples in order, blocks of one sample in
/// parallel (OpenMP) on disjoint rows, tiles of a block in a fixed order: bitwise the same for
/// any thread count. Throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void lsh_attention_mean_of_outputs_backward(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                                            ConstMatrixRef<Scalar> v, const HashSet& hashes,
                                            ConstMatrixRef<Scalar> dout, MatrixRef<Scalar> dq,
                                            MatrixRef<Scalar> dk, MatrixRef<Scalar> dv,
                                            const AttentionOptions& options = {}) {
  constexpr const char* function = "lsh_attention_mean_of_outputs_backward";
  detail::require_self_positions(function, options);
  detail::require_qkv_shapes(function, q, k, v);
  detail::require_self_attention(function, q, k);
  validate_hashes(hashes, function);
  const Index n = q.rows();
  detail::require_matrix_shape(function, "dout", dout, n, v.cols(), false);
  detail::require_matrix_shape(function, "dq", dq, n, q.cols(), true);
  detail::require_matrix_shape(function, "dk", dk, n, q.cols(), true);
  detail::require_matrix_shape(function, "dv", dv, n, v.cols(), true);
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, options, q.cols()));
  detail::mean_of_outputs_backward_rows<Scalar>(q, k, v, hashes, dout, dq, dk, dv, tau,
                                                options.masking == Masking::causal, 0);
}

}  // namespace poslsh
