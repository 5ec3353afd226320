// poslsh internals: the per-sample block structure for the backward passes and the mean-of-
// outputs estimator: plain attention (no positional bias; causal inside a block when causal) on
// the blocks of one hash or of every hash of a set, forward with its log-sum-exp, and its
// gradients block by block (over a set of hashes: the samples' gradients in a compensated sum).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/backward/tiles.hpp"
#include "poslsh/detail/parallel.hpp"
#include "poslsh/detail/tile/per_sample.hpp"

namespace poslsh::detail {

/// The rule of plain attention on block [begin, end): every key of the block (causal: j <= i),
/// weight 1, no bias.
template <typename Scalar>
WindowRule<Scalar> block_rule(Index begin, Index end, bool causal) {
  const Index width = end - begin;
  return WindowRule<Scalar>(begin, end, causal ? 0 : -width, width, Scalar(0));
}

/// The block boundaries 0 = t_0 < ... < t_m = n of `hash` on rows 0 .. n - 1 that are the
/// positions origin .. origin + n - 1 of its sequence (its blocks cut to them).
inline std::vector<Index> window_block_boundaries(const BinHash& hash, Index origin, Index n) {
  std::vector<Index> boundaries = block_boundaries_between(hash, origin, origin + n);
  for (Index& boundary : boundaries) boundary -= origin;
  return boundaries;
}

/// Adds the gradients of plain attention on every block of `hash` to `out`, with the
/// probabilities P_ij = e^{x_ij - lse_i} of in.lse (the caller's normalization: the combined
/// lse of all samples for the count-weighted estimator, the sample's own for the mean of
/// outputs); rows are the positions origin .. of the hash's sequence. Blocks run in parallel
/// (parallel_loop) on disjoint rows and keys; each block's pass runs on one thread in a fixed
/// order, with the thread's BackwardWork sized for every block before the loop: in `works` when
/// given (a caller's scratch, kept across calls: the passes do not depend on what it held), else
/// in scratch of this call.
template <typename Scalar, typename Input>
void backward_hash_blocks(const BackwardInputs<Scalar, Input>& in, const BinHash& hash, bool causal,
                          BackwardOutputs<Scalar>& out, Index origin = 0,
                          PerThread<BackwardWork<Scalar>>* works = nullptr) {
  const std::vector<Index> boundaries = window_block_boundaries(hash, origin, in.q.rows());
  const auto blocks = static_cast<long>(boundaries.size() - 1);
  const auto rule = [&](long b) {
    const auto index = static_cast<std::size_t>(b);
    return block_rule<Scalar>(boundaries[index], boundaries[index + 1], causal);
  };
  BackwardSerialSize<Scalar, Input> needs(in);
  for (long b = 0; b < blocks; ++b) needs.add(rule(b));
  std::optional<PerThread<BackwardWork<Scalar>>> own;
  if (works == nullptr) works = &own.emplace(blocks);
  works->each([&](BackwardWork<Scalar>& work) { needs.reserve(work); });
  parallel_loop<FlushSubnormals>(
      blocks, LoopSchedule::dynamic(), *works,
      [&](long b, BackwardWork<Scalar>& work) { backward_serial(in, rule(b), out, work); });
}

/// sum <- sum + x entry by entry, with Neumaier's compensation: the rounding error of each
/// addition t = a + b, exactly (a - t) + b when |a| >= |b| (else (b - t) + a), is added to
/// `compensation` (not where t is inf or NaN), and sum + compensation is the compensated sum:
/// its error stays within about 2 eps sum |x| however many terms are added.
template <typename Scalar>
void compensated_add(MatrixRef<Scalar> sum, MatrixRef<Scalar> compensation,
                     const MatrixRef<Scalar>& x) {
  for (Index r = 0; r < x.rows(); ++r) {
    Scalar* s = &sum.coeffRef(r, 0);
    Scalar* c = &compensation.coeffRef(r, 0);
    const Scalar* add = &x.coeffRef(r, 0);
    for (Index col = 0; col < x.cols(); ++col) {
      const Scalar a = s[col], b = add[col], t = a + b;
      const Scalar error = std::abs(a) >= std::abs(b) ? (a - t) + b : (b - t) + a;
      c[col] += t - t == Scalar(0) ? error : Scalar(0);
      s[col] = t;
    }
  }
}

/// dQ, dK and dV rows (one block's gradients, or the compensations of the sums).
template <typename Scalar>
struct GradientRows {
  RowMatrix<Scalar> dq, dk, dv;

  void resize(Index rows, Index d, Index d_v) {
    dq.resize(rows, d);
    dk.resize(rows, d);
    dv.resize(rows, d_v);
  }
};

/// Adds to `out` the sum over the samples of `hashes` of the plain-attention gradients on
/// their blocks (backward_hash_blocks for each hash), with the probabilities of in.lse; for
/// the count-weighted estimator (in.lse its combined lse) sum_k P^(k) = P, so this is its
/// gradient. Each block's gradients are computed on the block's own rows (block-local views
/// of the inputs, a per-thread buffer of |B| rows: the tiles, sums and order of the pass
/// on the whole sequence) and added to out with compensated_add, the compensations added at
/// the end, so the rounding of the sum over the samples does not grow with s. Extra memory
/// O(n (2 d + d_v)) and O(max |B| (2 d + d_v)) per thread, sized before the loops; one hash is
/// backward_hash_blocks itself. Blocks of one sample run in parallel (parallel_loop) on disjoint
/// rows, samples in order, each block's pass and each entry's sum in a fixed order: bitwise the
/// same for any thread count.
template <typename Scalar, typename Input>
void backward_hash_blocks(const BackwardInputs<Scalar, Input>& in, const HashSet& hashes,
                          bool causal, BackwardOutputs<Scalar>& out, Index origin = 0) {
  if (hashes.size() == 1) {
    backward_hash_blocks(in, hashes.front(), causal, out, origin);
    return;
  }
  const Index n = in.q.rows(), d = in.q.cols(), d_v = in.v.cols();
  std::vector<std::vector<Index>> boundaries;
  boundaries.reserve(hashes.size());
  BackwardSerialSize<Scalar, Input> needs(in);
  Index widest = 0;
  long most_blocks = 0;
  for (const BinHash& hash : hashes) {
    boundaries.push_back(window_block_boundaries(hash, origin, n));
    const std::vector<Index>& edges = boundaries.back();
    most_blocks = std::max(most_blocks, static_cast<long>(edges.size() - 1));
    for (std::size_t r = 0; r + 1 < edges.size(); ++r) {
      widest = std::max(widest, edges[r + 1] - edges[r]);
      needs.add(block_rule<Scalar>(0, edges[r + 1] - edges[r], causal));
    }
  }
  GradientRows<Scalar> compensation;
  compensation.resize(n, d, d_v);
  // A thread's pass scratch and its buffer of one block's gradients.
  struct BlockScratch {
    BackwardWork<Scalar> work;
    GradientRows<Scalar> block;
  };
  PerThread<BlockScratch> scratch(most_blocks);
  scratch.each([&](BlockScratch& thread) {
    needs.reserve(thread.work);
    thread.block.resize(widest, d, d_v);
  });
  constexpr Index chunk = backward_tile;
  const auto chunks = static_cast<long>((n + chunk - 1) / chunk);
  parallel_loop(chunks, LoopSchedule::blocks(), true, [&](long c) {
    const Index r0 = static_cast<Index>(c) * chunk, rows = std::min(chunk, n - r0);
    compensation.dq.middleRows(r0, rows).setZero();
    compensation.dk.middleRows(r0, rows).setZero();
    compensation.dv.middleRows(r0, rows).setZero();
  });
  for (const std::vector<Index>& edges : boundaries) {
    const auto blocks = static_cast<long>(edges.size() - 1);
    parallel_loop<FlushSubnormals>(
        blocks, LoopSchedule::dynamic(), scratch, [&](long b, BlockScratch& thread) {
          const auto index = static_cast<std::size_t>(b);
          const Index begin = edges[index], size = edges[index + 1] - begin;
          const ConstMatrixRef<Input> q = in.q.middleRows(begin, size);
          const ConstMatrixRef<Input> k = in.k.middleRows(begin, size);
          const ConstMatrixRef<Input> v = in.v.middleRows(begin, size);
          const ConstMatrixRef<Input> dout = in.dout.middleRows(begin, size);
          const BackwardInputs<Scalar, Input> local{
              q, k, v, dout, in.lse + begin, in.delta + begin, in.tau, in.paired};
          MatrixRef<Scalar> dq = thread.block.dq.topRows(size), dk = thread.block.dk.topRows(size),
                            dv = thread.block.dv.topRows(size);
          BackwardOutputs<Scalar> fresh{dq, dk, dv, true};
          const WindowRule<Scalar> rule = block_rule<Scalar>(0, size, causal);
          backward_zero_unreached<Scalar>(rule, dq);
          backward_serial(local, rule, fresh, thread.work);
          compensated_add<Scalar>(out.dq.middleRows(begin, size),
                                  compensation.dq.middleRows(begin, size), dq);
          compensated_add<Scalar>(out.dk.middleRows(begin, size),
                                  compensation.dk.middleRows(begin, size), dk);
          compensated_add<Scalar>(out.dv.middleRows(begin, size),
                                  compensation.dv.middleRows(begin, size), dv);
        });
  }
  parallel_loop<FlushSubnormals>(chunks, LoopSchedule::blocks(), true, [&](long c) {
    const Index r0 = static_cast<Index>(c) * chunk, rows = std::min(chunk, n - r0);
    out.dq.middleRows(r0, rows) += compensation.dq.middleRows(r0, rows);
    out.dk.middleRows(r0, rows) += compensation.dk.middleRows(r0, rows);
    out.dv.middleRows(r0, rows) += compensation.dv.middleRows(r0, rows);
  });
}

/// The per-sample kernel's rows for self-attention at positions 0 .. n - 1 (per_sample_rows):
/// out and, if not null, lse. q, k, v and out stored as Input, computed (and lse written) in
/// compute_scalar_t<Input>, the products on the unit `precision` selects.
template <typename Input>
void per_sample_forward(const ConstMatrixRef<Input>& q, const ConstMatrixRef<Input>& k,
                        const ConstMatrixRef<Input>& v, const HashSet& hashes,
                        compute_scalar_t<Input> tau, bool causal, MatrixRef<Input> out,
                        compute_scalar_t<Input>* lse,
                        Precision precision = Precision::float_products) {
  per_sample_rows<Input, Input, Input, compute_scalar_t<Input>>(q, k, v, hashes, tau, causal, 0,
                                                                precision, out, lse);
}

}  // namespace poslsh::detail
