// poslsh: the mean-of-outputs LSH estimator, forward and backward: the mean of the s per-sample
// plain attentions, each a softmax on the blocks of one hash. It differs from the count-weighted
// estimator of lsh_attention_fused / lsh_attention_per_sample, which normalizes once over all
// samples.
//
// Checked (std::invalid_argument naming the argument): the shapes of q, k, v and out (dout, dq,
// dk, dv for the backward), a non-empty set of valid hashes, options.scale finite,
// options.masking valid. Not checked: the values, and that outputs overlap no input.
#pragma once

#include <Eigen/Core>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/backward/blocks.hpp"
#include "poslsh/detail/backward/tiles.hpp"
#include "poslsh/detail/checks/lsh.hpp"
#include "poslsh/training/backward.hpp"

namespace poslsh {

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
  const Index n = q.rows();
  if (n == 0) return;
  const bool causal = options.masking == Masking::causal;
  RowMatrix<Scalar> sample(n, v.cols());
  out.setZero();
  for (const BinHash& hash : hashes) {
    detail::per_sample_forward<Scalar>(q, k, v, HashSet{hash}, tau, causal, sample, nullptr);
    out += sample;
  }
  out /= static_cast<Scalar>(hashes.size());
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
  if (n == 0) return;
  const bool causal = options.masking == Masking::causal;
  dq.setZero();
  dk.setZero();
  dv.setZero();
  const RowMatrix<Scalar> scaled = dout / static_cast<Scalar>(hashes.size());
  const ConstMatrixRef<Scalar> scaled_ref(scaled);
  RowMatrix<Scalar> sample(n, v.cols());
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> lse(n);
  detail::BackwardOutputs<Scalar> grads{dq, dk, dv};
  for (const BinHash& hash : hashes) {
    detail::per_sample_forward<Scalar>(q, k, v, HashSet{hash}, tau, causal, sample, lse.data());
    // D rounded as the passes round dP (subnormals flushed), the forward above as forwards do.
    const Eigen::Matrix<Scalar, Eigen::Dynamic, 1> delta = [&] {
      const detail::FlushSubnormals flush;
      return detail::backward_delta<Scalar>(ConstMatrixRef<Scalar>(sample), scaled_ref);
    }();
    const detail::BackwardInputs<Scalar> in{q, k, v, scaled_ref, lse.data(), delta.data(), tau};
    detail::backward_hash_blocks(in, hash, causal, grads);
  }
}

}  // namespace poslsh
