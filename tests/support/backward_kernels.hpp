// Helpers of the backward tests (tests/training/backward.cpp, backward_failures.cpp,
// half_precision_backward.cpp): one single-head kernel configuration, its forward with lse, and
// its backward on inputs stored in any scalar type; the random inputs of an all-heads backward.
#pragma once

#include <cstdint>
#include <limits>
#include <poslsh/training/backward.hpp>
#include <utility>

#include "test_support.hpp"

namespace poslsh_test {

template <typename Scalar>
using ColumnVector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

/// The single-head kernels with a backward pass.
enum class BackwardKind { tiled, banded, fused, per_sample, fixed_blocks };

}  // namespace poslsh_test

namespace poslsh {
POSLSH_ENUM_NAMES(poslsh_test::BackwardKind, tiled, banded, fused, per_sample, fixed_blocks);
}  // namespace poslsh

namespace poslsh_test {

/// Every BackwardKind, in declaration order.
inline constexpr auto all_backward_kinds = poslsh::enum_values<BackwardKind>();

/// The kind's enumerator as it is spelled ("per_sample").
inline const char* backward_kind_name(BackwardKind kind) { return poslsh::enum_name(kind); }

/// One kernel configuration: its kind, sigma, band and hashes, and the options.
struct BackwardSetup {
  BackwardKind kind;
  double sigma;
  Index band;
  poslsh::HashSet hashes;
  poslsh::AttentionOptions options;
};

template <typename Scalar>
struct BackwardGradients {
  RowMatrix<Scalar> dq, dk, dv;
};

/// The inputs of an all-heads backward of n tokens: row-major buffers of interleaved heads qb
/// (heads heads of width d), kb (kv_heads of d), vb (kv_heads of dv) and doutb (heads of dv),
/// random_matrix of seeds seed, seed + 1, seed + 2 and seed + 3, and their views q, k, v and
/// dout. Not copied: the views point into the buffers.
template <typename Scalar>
struct HeadsBackwardInputs {
  RowMatrix<Scalar> qb, kb, vb, doutb;
  poslsh::HeadsView<const Scalar> q, k, v, dout;

  HeadsBackwardInputs(Index n, Index heads, Index kv_heads, Index d, Index dv, std::uint64_t seed)
      : qb(random_matrix<Scalar>(n, heads * d, seed)),
        kb(random_matrix<Scalar>(n, kv_heads * d, seed + 1)),
        vb(random_matrix<Scalar>(n, kv_heads * dv, seed + 2)),
        doutb(random_matrix<Scalar>(n, heads * dv, seed + 3)),
        q(interleaved_view(std::as_const(qb), heads)),
        k(interleaved_view(std::as_const(kb), kv_heads)),
        v(interleaved_view(std::as_const(vb), kv_heads)),
        dout(interleaved_view(std::as_const(doutb), heads)) {}
  HeadsBackwardInputs(const HeadsBackwardInputs&) = delete;
  HeadsBackwardInputs& operator=(const HeadsBackwardInputs&) = delete;
};

/// out and lse of the forward with lse of `s` on q, k, v stored as Input (out in Input, lse in
/// backward_scalar_t<Input>; resized to n x d_v and n unless `resize` is false).
template <typename Input, typename Scalar = poslsh::backward_scalar_t<Input>>
void setup_forward(const BackwardSetup& s, const poslsh::ConstMatrixRef<Input>& q,
                   const poslsh::ConstMatrixRef<Input>& k, const poslsh::ConstMatrixRef<Input>& v,
                   RowMatrix<Input>& out, ColumnVector<Scalar>& lse, bool resize = true) {
  if (resize) {
    out.resize(q.rows(), v.cols());
    lse.resize(q.rows());
  }
  switch (s.kind) {
    case BackwardKind::tiled:
      return poslsh::alibi_attention_tiled_with_lse<Input>(q, k, v, s.sigma, out, lse, s.options);
    case BackwardKind::banded:
      return poslsh::alibi_attention_banded_with_lse<Input>(q, k, v, s.sigma, s.band, out, lse,
                                                            s.options);
    case BackwardKind::fused:
      return poslsh::lsh_attention_fused_with_lse<Input>(q, k, v, s.hashes, out, lse, s.options);
    case BackwardKind::per_sample:
      return poslsh::lsh_attention_per_sample_with_lse<Input>(q, k, v, s.hashes, out, lse,
                                                              s.options);
    case BackwardKind::fixed_blocks:
      return poslsh::fixed_blocks_attention_with_lse<Input>(q, k, v, s.sigma, out, lse, s.options);
  }
}

/// The gradients of the backward of `s` on q, k, v, out and dout stored as Input (lse and the
/// gradients in backward_scalar_t<Input>); they start as NaN, so an entry the pass leaves
/// unwritten shows.
template <typename Input, typename Scalar = poslsh::backward_scalar_t<Input>>
BackwardGradients<Scalar> setup_backward(const BackwardSetup& s,
                                         const poslsh::ConstMatrixRef<Input>& q,
                                         const poslsh::ConstMatrixRef<Input>& k,
                                         const poslsh::ConstMatrixRef<Input>& v,
                                         const poslsh::ConstMatrixRef<Input>& out,
                                         const ColumnVector<Scalar>& lse,
                                         const poslsh::ConstMatrixRef<Input>& dout) {
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  BackwardGradients<Scalar> g{RowMatrix<Scalar>::Constant(q.rows(), q.cols(), nan),
                              RowMatrix<Scalar>::Constant(k.rows(), k.cols(), nan),
                              RowMatrix<Scalar>::Constant(v.rows(), v.cols(), nan)};
  switch (s.kind) {
    case BackwardKind::tiled:
      poslsh::alibi_attention_tiled_backward<Input>(q, k, v, s.sigma, out, lse, dout, g.dq, g.dk,
                                                    g.dv, s.options);
      break;
    case BackwardKind::banded:
      poslsh::alibi_attention_banded_backward<Input>(q, k, v, s.sigma, s.band, out, lse, dout, g.dq,
                                                     g.dk, g.dv, s.options);
      break;
    case BackwardKind::fused:
      poslsh::lsh_attention_fused_backward<Input>(q, k, v, s.hashes, out, lse, dout, g.dq, g.dk,
                                                  g.dv, s.options);
      break;
    case BackwardKind::per_sample:
      poslsh::lsh_attention_per_sample_backward<Input>(q, k, v, s.hashes, out, lse, dout, g.dq,
                                                       g.dk, g.dv, s.options);
      break;
    case BackwardKind::fixed_blocks:
      poslsh::fixed_blocks_attention_backward<Input>(q, k, v, s.sigma, out, lse, dout, g.dq, g.dk,
                                                     g.dv, s.options);
      break;
  }
  return g;
}

}  // namespace poslsh_test
