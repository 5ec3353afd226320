// Helpers of the half-precision training tests (tests/training/half_precision_backward.cpp,
// tests/training/half_precision_lse.cpp): bit equality of float results, the thread count in a
// scope, the single-head configurations, the inputs and their double gradients, the all-heads
// problem, and a plain bfloat16 backward (dense) to compare the AVX512-BF16 unit's gradients
// with.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <poslsh/core/matrix_units.hpp>
#include <poslsh/multihead/training.hpp>
#include <poslsh/reference/masks.hpp>
#include <vector>

#include "backward_kernels.hpp"
#include "half_support.hpp"
#include "test_support.hpp"

namespace poslsh_test {

using Config = BackwardSetup;
using Grads = BackwardGradients<float>;
using FloatVector = ColumnVector<float>;
using poslsh::Masking;

/// True when a and b have the same shape and the same bits in every entry.
inline bool same_bits(const RowMatrix<float>& a, const RowMatrix<float>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
}

inline bool same_bits(const Grads& a, const Grads& b) {
  return same_bits(a.dq, b.dq) && same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv);
}

/// Checks that the gradients of a half-precision call are finite and have the bits of `wide`.
inline void check_bitwise(const Grads& half, const Grads& wide) {
  CHECK(half.dq.allFinite());
  CHECK(half.dk.allFinite());
  CHECK(half.dv.allFinite());
  CHECK(same_bits(half.dq, wide.dq));
  CHECK(same_bits(half.dk, wide.dk));
  CHECK(same_bits(half.dv, wide.dv));
}

/// Whether the CPU has the AVX512-BF16 unit (a warning when not: nothing to check).
inline bool has_bf16_unit() {
  const bool available = poslsh::matrix_unit_available(poslsh::MatrixUnit::avx512_bf16);
  if (!available) WARN("this CPU has no AVX512-BF16: nothing to check");
  return available;
}

/// The run with `threads` threads: the first run's gradients are kept in `first`, the second's
/// must have their bits.
inline void check_threads(int threads, const Grads& result, Grads& first) {
  if (threads == 1) {
    first = result;
  } else {
    CHECK(same_bits(result, first));
  }
}

/// Runs body(threads) with 1, then 2 OpenMP threads (a Threads scope each), the count in the
/// test messages.
template <typename Body>
void for_one_and_two_threads(Body&& body) {
  for (const int threads : {1, 2}) {
    INFO(threads << " threads");
    const Threads scope(threads);
    body(threads);
  }
}

/// The configurations of the single-head tests at n rows, with float products or the CPU's
/// matrix unit (`precision`).
inline std::vector<Config> configs(
    Masking masking, Index n, poslsh::Precision precision = poslsh::Precision::float_products) {
  std::vector<Config> result;
  poslsh::AttentionOptions options = poslsh_test::with_masking(masking);
  options.precision = precision;
  for (const BackwardKind kind : all_backward_kinds) {
    for (const double sigma : {2.0, 48.0}) {
      result.push_back({kind, sigma, 37,
                        poslsh::rbf_hashes(sigma, 3, 11 + static_cast<std::uint64_t>(n), 1),
                        options});
    }
  }
  return result;
}

/// Runs body(c) on every configuration of configs(masking, n, precision), causal and
/// bidirectional, c's kind, n, sigma and masking in the test messages.
template <typename Body>
void for_each_config(Index n, poslsh::Precision precision, Body&& body) {
  for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (const Config& c : configs(masking, n, precision)) {
      INFO(backward_kind_name(c.kind)
           << ", n " << n << ", sigma " << c.sigma << ", " << masking_name(masking));
      body(c);
    }
  }
}

/// The weights w_ij of c's probabilities P_ij = w_ij e^{x_ij - lse_i} (dense, n x n) and the
/// ALiBi slope of its scores x_ij = tau q_i.k_j - slope |i - j| (0 for the LSH methods).
inline RowMatrix<float> dense_weights(const Config& c, Index n, float& slope) {
  const Masking masking = c.options.masking;
  RowMatrix<float> w = RowMatrix<float>::Zero(n, n);
  slope = 0.0f;
  switch (c.kind) {
    case BackwardKind::tiled:
    case BackwardKind::banded:
      slope = static_cast<float>(1.0 / c.sigma);
      for (Index i = 0; i < n; ++i)
        for (Index j = 0; j < n; ++j)
          w(i, j) = (masking == Masking::bidirectional || j <= i) &&
                            (c.kind == BackwardKind::tiled || std::abs(i - j) <= c.band)
                        ? 1.0f
                        : 0.0f;
      break;
    case BackwardKind::fused:
    case BackwardKind::per_sample:
      for (const poslsh::BinHash& hash : c.hashes)
        w += poslsh::bin_mask_dense<float>(hash, n, masking);
      break;
    case BackwardKind::fixed_blocks:
      w = poslsh::bin_mask_dense<float>(poslsh::fixed_blocks_hash(c.sigma), n, masking);
      break;
  }
  return w;
}

/// x rounded to bfloat16 and widened back.
inline RowMatrix<float> rounded(const RowMatrix<float>& x) {
  return x.cast<Eigen::bfloat16>().cast<float>();
}

/// A plain bfloat16 backward, dense, as FlashAttention's Triton backward rounds: Q K^T and
/// dO V^T from the bfloat16 inputs with float sums, P and D = rowsum(dO o out) in float,
/// dS = tau P o (dP - D) (the softmax scale folded in), P and dS rounded to bfloat16 before
/// dV = P^T dO, dQ = dS K and dK = dS^T Q (float sums). The per-sample pass is the sum of one
/// such backward per sample (P_s = [same bin in sample s] e^{x - lse}, each rounded), as a
/// plain per-sample implementation rounds.
inline Grads plain_bf16_backward(const Config& c, const RowMatrix<float>& q,
                                 const RowMatrix<float>& k, const RowMatrix<float>& v,
                                 const RowMatrix<float>& out, const FloatVector& lse,
                                 const RowMatrix<float>& dout) {
  const Index n = q.rows();
  const auto tau = static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.cols())));
  float slope = 0.0f;
  std::vector<RowMatrix<float>> weights;
  if (c.kind == BackwardKind::per_sample) {
    for (const poslsh::BinHash& hash : c.hashes)
      weights.push_back(poslsh::bin_mask_dense<float>(hash, n, c.options.masking));
  } else {
    weights.push_back(dense_weights(c, n, slope));
  }
  const RowMatrix<float> scores = q * k.transpose(), dp = dout * v.transpose();
  const FloatVector delta = (dout.array() * out.array()).rowwise().sum();
  Grads sum{RowMatrix<float>::Zero(n, q.cols()), RowMatrix<float>::Zero(n, k.cols()),
            RowMatrix<float>::Zero(n, v.cols())};
  for (const RowMatrix<float>& w : weights) {
    RowMatrix<float> p = RowMatrix<float>::Zero(n, n), ds = RowMatrix<float>::Zero(n, n);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < n; ++j) {
        if (w(i, j) == 0.0f) continue;
        const float x = tau * scores(i, j) - slope * static_cast<float>(std::abs(i - j));
        p(i, j) = w(i, j) * std::exp(x - lse(i));
        ds(i, j) = tau * p(i, j) * (dp(i, j) - delta(i));
      }
    }
    const RowMatrix<float> p16 = rounded(p), ds16 = rounded(ds);
    sum.dq += ds16 * k;
    sum.dk += ds16.transpose() * q;
    sum.dv += p16.transpose() * dout;
  }
  return sum;
}

/// Views [n, H, d] of a buffer's rows (interleaved heads).
template <typename Element>
poslsh::HeadsView<Element> heads_of(Element* data, Index tokens, Index heads, Index dim) {
  return poslsh::interleaved_heads<Element>(data, tokens, heads, dim);
}

/// The inputs of a half-precision test, n rows each: Q, K, V and dO stored as Half (random_half
/// of seeds seed, seed + 1, seed + 2 and seed + 3) and their float copies (widened: exact).
template <typename Half>
struct HalfInputs {
  RowMatrix<Half> q, k, v, dout;
  RowMatrix<float> qf, kf, vf, doutf;

  /// Q and K of `q_cols` and `k_cols` columns, V of `v_cols`, dO of `dout_cols`.
  HalfInputs(Index n, Index q_cols, Index k_cols, Index v_cols, Index dout_cols, std::uint64_t seed)
      : q(random_half<Half>(n, q_cols, seed)),
        k(random_half<Half>(n, k_cols, seed + 1)),
        v(random_half<Half>(n, v_cols, seed + 2)),
        dout(random_half<Half>(n, dout_cols, seed + 3)),
        qf(widened(q)),
        kf(widened(k)),
        vf(widened(v)),
        doutf(widened(dout)) {}
  /// One head: Q and K n x d, V and dO n x d_v.
  HalfInputs(Index n, Index d, Index dv, std::uint64_t seed) : HalfInputs(n, d, d, dv, dv, seed) {}
};

/// The double gradients of configuration c on `in` widened to double (exact): the double
/// backward on the double forward's out and lse.
template <typename Half>
BackwardGradients<double> double_gradients(const Config& c, const HalfInputs<Half>& in) {
  const RowMatrix<double> q = in.qf.template cast<double>(), k = in.kf.template cast<double>(),
                          v = in.vf.template cast<double>(),
                          dout = in.doutf.template cast<double>();
  RowMatrix<double> out;
  ColumnVector<double> lse;
  setup_forward<double>(c, q, k, v, out, lse);
  return setup_backward<double>(c, q, k, v, out, lse, dout);
}

/// The tensors of an all-heads test: the inputs Q (H_q heads of d), K (H_kv heads of d), V (H_kv
/// of d_v), dO (H_q of d_v) and their float copies, and out (H_q of d_v) and lse (H_q x n) of the
/// float forward with lse on the copies, out also rounded to Half.
template <typename Half>
struct HeadsProblem : HalfInputs<Half> {
  Index n, heads, kv_heads, d, dv;
  RowMatrix<Half> out;
  RowMatrix<float> outf, lse;
  /// cu_seqlens of the n tokens as one sequence and as two packed ones (130 tokens, the rest).
  std::vector<std::int32_t> whole, packed;

  HeadsProblem(Index tokens, Index query_heads, Index key_heads, Index dim, Index value_dim,
               std::uint64_t seed)
      : HalfInputs<Half>(tokens, query_heads * dim, key_heads * dim, key_heads * value_dim,
                         query_heads * value_dim, seed),
        n(tokens),
        heads(query_heads),
        kv_heads(key_heads),
        d(dim),
        dv(value_dim),
        whole{0, static_cast<std::int32_t>(tokens)},
        packed{0, 130, static_cast<std::int32_t>(tokens)} {}

  /// out, lse of multihead_attention_varlen with lse (one sequence: multihead_attention's).
  void forward(const poslsh::MultiHeadOptions& options, const std::vector<std::int32_t>& cu) {
    outf.resize(n, heads * dv);
    lse.resize(heads, n);
    poslsh::multihead_attention_varlen<float>(
        heads_of<const float>(this->qf.data(), n, heads, d),
        heads_of<const float>(this->kf.data(), n, kv_heads, d),
        heads_of<const float>(this->vf.data(), n, kv_heads, dv),
        heads_of<float>(outf.data(), n, heads, dv), lse, cu, options);
    out = outf.template cast<Half>();
  }
};

/// The methods of the all-heads half-precision tests: every Method but mean_of_outputs.
inline constexpr poslsh::Method heads_methods[] = {
    poslsh::Method::lsh_fused, poslsh::Method::lsh_per_sample, poslsh::Method::fixed_blocks,
    poslsh::Method::exact_tiled, poslsh::Method::exact_banded};

/// The options of the all-heads tests: `method`, `masking` and `precision`, 3 samples of seed
/// 5, band error 1e-2.
inline poslsh::MultiHeadOptions heads_options(poslsh::Method method, Masking masking,
                                              poslsh::Precision precision) {
  poslsh::MultiHeadOptions options = multihead_options(method, masking, 3, 5);
  options.band_error = 1e-2;
  options.precision = precision;
  return options;
}

/// The accuracy rule of the AVX512-BF16 unit's gradients `unit`: each within twice the error of
/// the plain bfloat16 backward's `plain` against the double gradients `exact` (relative max
/// error).
inline void check_unit_accuracy(const Grads& unit, const Grads& plain,
                                const BackwardGradients<double>& exact) {
  const auto error = [](const RowMatrix<float>& a, const RowMatrix<double>& b) {
    return relative_max_error(a.cast<double>(), b);
  };
  INFO("dq error " << error(unit.dq, exact.dq) << ", plain " << error(plain.dq, exact.dq));
  INFO("dk error " << error(unit.dk, exact.dk) << ", plain " << error(plain.dk, exact.dk));
  INFO("dv error " << error(unit.dv, exact.dv) << ", plain " << error(plain.dv, exact.dv));
  CHECK(error(unit.dq, exact.dq) <= 2.0 * error(plain.dq, exact.dq));
  CHECK(error(unit.dk, exact.dk) <= 2.0 * error(plain.dk, exact.dk));
  CHECK(error(unit.dv, exact.dv) <= 2.0 * error(plain.dv, exact.dv));
}

}  // namespace poslsh_test
