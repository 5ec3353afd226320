// Backward passes: finite differences in double for every kernel, float against double, the
// fused gradients against the per-sample ones, lse against a dense log-sum-exp, determinism
// across thread counts, multi-head and grouped-query sums, and the named shape checks.
#include <poslsh/attention_backward.hpp>
#include <poslsh/masks.hpp>

#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <limits>
#include <string>
#include <vector>

using poslsh::AttentionOptions;
using poslsh::HashSet;
using poslsh::Index;
using poslsh::Masking;
using poslsh::RowMatrix;
using poslsh_test::random_matrix;
using poslsh_test::relative_max_error;
using poslsh_test::with_masking;

namespace {

template <typename Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

enum class Kind { tiled, banded, fused, per_sample, fixed_blocks };

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::tiled:
      return "tiled";
    case Kind::banded:
      return "banded";
    case Kind::fused:
      return "fused";
    case Kind::per_sample:
      return "per_sample";
    case Kind::fixed_blocks:
      return "fixed_blocks";
  }
  return "?";
}

/// One kernel configuration: its kind, sigma, band and hashes, and the options.
struct Setup {
  Kind kind;
  double sigma;
  Index band;
  HashSet hashes;
  AttentionOptions options;
};

template <typename Scalar>
struct Gradients {
  RowMatrix<Scalar> dq, dk, dv;
};

template <typename Scalar>
void forward(const Setup& s, const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
             const RowMatrix<Scalar>& v, RowMatrix<Scalar>& out, Vector<Scalar>& lse) {
  out.resize(q.rows(), v.cols());
  lse.resize(q.rows());
  switch (s.kind) {
    case Kind::tiled:
      return poslsh::alibi_attention_tiled<Scalar>(q, k, v, s.sigma, out, lse, s.options);
    case Kind::banded:
      return poslsh::alibi_attention_banded<Scalar>(q, k, v, s.sigma, s.band, out, lse, s.options);
    case Kind::fused:
      return poslsh::lsh_attention_fused<Scalar>(q, k, v, s.hashes, out, lse, s.options);
    case Kind::per_sample:
      return poslsh::lsh_attention_per_sample<Scalar>(q, k, v, s.hashes, out, lse, s.options);
    case Kind::fixed_blocks:
      return poslsh::fixed_blocks_attention<Scalar>(q, k, v, s.sigma, out, lse, s.options);
  }
}

template <typename Scalar>
Gradients<Scalar> backward(const Setup& s, const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                           const RowMatrix<Scalar>& v, const RowMatrix<Scalar>& out,
                           const Vector<Scalar>& lse, const RowMatrix<Scalar>& dout) {
  Gradients<Scalar> g{RowMatrix<Scalar>(q.rows(), q.cols()), RowMatrix<Scalar>(k.rows(), k.cols()),
                      RowMatrix<Scalar>(v.rows(), v.cols())};
  switch (s.kind) {
    case Kind::tiled:
      poslsh::alibi_attention_tiled_backward<Scalar>(q, k, v, s.sigma, out, lse, dout, g.dq, g.dk,
                                                     g.dv, s.options);
      break;
    case Kind::banded:
      poslsh::alibi_attention_banded_backward<Scalar>(q, k, v, s.sigma, s.band, out, lse, dout,
                                                      g.dq, g.dk, g.dv, s.options);
      break;
    case Kind::fused:
      poslsh::lsh_attention_fused_backward<Scalar>(q, k, v, s.hashes, out, lse, dout, g.dq, g.dk,
                                                   g.dv, s.options);
      break;
    case Kind::per_sample:
      poslsh::lsh_attention_per_sample_backward<Scalar>(q, k, v, s.hashes, out, lse, dout, g.dq,
                                                        g.dk, g.dv, s.options);
      break;
    case Kind::fixed_blocks:
      poslsh::fixed_blocks_attention_backward<Scalar>(q, k, v, s.sigma, out, lse, dout, g.dq, g.dk,
                                                      g.dv, s.options);
      break;
  }
  return g;
}

/// Relative error of central differences against <gradient, direction> for one random
/// direction of each of q, k, v (the largest of the three): loss L = sum(dout o out).
template <typename Loss>
double finite_difference_error(const RowMatrix<double>& q, const RowMatrix<double>& k,
                               const RowMatrix<double>& v, const Gradients<double>& g,
                               std::uint64_t seed, Loss&& loss) {
  const double h = 1e-5;
  double worst = 0.0;
  for (int which = 0; which < 3; ++which) {
    const RowMatrix<double>& x = which == 0 ? q : which == 1 ? k : v;
    const RowMatrix<double>& grad = which == 0 ? g.dq : which == 1 ? g.dk : g.dv;
    const RowMatrix<double> direction =
        random_matrix<double>(x.rows(), x.cols(), seed + static_cast<std::uint64_t>(which));
    const double analytic = (grad.array() * direction.array()).sum();
    RowMatrix<double> plus[3] = {q, k, v}, minus[3] = {q, k, v};
    plus[which] += h * direction;
    minus[which] -= h * direction;
    const double numeric =
        (loss(plus[0], plus[1], plus[2]) - loss(minus[0], minus[1], minus[2])) / (2.0 * h);
    const double scale = std::max(std::abs(analytic), 1e-2 * grad.norm() * direction.norm());
    // A gradient at rounding level (e.g. dq and dk at n = 1) is compared absolutely.
    const double error = std::abs(numeric - analytic) / std::max(scale, 1e-9);
    INFO("input " << which << ": numeric " << numeric << ", analytic " << analytic);
    CHECK(error <= 1e-6);
    worst = std::max(worst, error);
  }
  return worst;
}

std::vector<Setup> setups(Index n, Masking masking) {
  std::vector<Setup> result;
  const AttentionOptions options = with_masking(masking);
  for (double sigma : {0.5, 16.0, 1e4}) {
    result.push_back({Kind::tiled, sigma, 0, {}, options});
    result.push_back({Kind::fixed_blocks, sigma, 0, {}, options});
    for (Index band : {Index{3}, Index{40}})
      result.push_back({Kind::banded, sigma, band, {}, options});
    for (Index s : {Index{1}, Index{3}, Index{16}}) {
      const HashSet hashes = poslsh::rbf_hashes(sigma, s, 7 + static_cast<std::uint64_t>(n), 1);
      result.push_back({Kind::fused, sigma, 0, hashes, options});
      result.push_back({Kind::per_sample, sigma, 0, hashes, options});
    }
  }
  return result;
}

}  // namespace

TEST_CASE("backward matches central finite differences in double", "[backward]") {
  const Index d = 6, dv = 5;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (Index n : {Index{1}, Index{70}, Index{130}}) {
      const auto seed = static_cast<std::uint64_t>(n);
      const RowMatrix<double> q = random_matrix<double>(n, d, seed + 1);
      const RowMatrix<double> k = random_matrix<double>(n, d, seed + 2);
      const RowMatrix<double> v = random_matrix<double>(n, dv, seed + 3);
      const RowMatrix<double> dout = random_matrix<double>(n, dv, seed + 4);
      for (const Setup& s : setups(n, masking)) {
        INFO(kind_name(s.kind) << ", n " << n << ", sigma " << s.sigma << ", band " << s.band
                               << ", s " << s.hashes.size() << ", causal "
                               << (masking == Masking::causal));
        RowMatrix<double> out;
        Vector<double> lse;
        forward<double>(s, q, k, v, out, lse);
        const Gradients<double> g = backward<double>(s, q, k, v, out, lse, dout);
        finite_difference_error(q, k, v, g, seed + 10,
                                [&](const auto& a, const auto& b, const auto& c) {
                                  RowMatrix<double> o;
                                  Vector<double> l;
                                  forward<double>(s, a, b, c, o, l);
                                  return (o.array() * dout.array()).sum();
                                });
      }
    }
  }
}

TEST_CASE("float backward is within twice the float forward's error against double", "[backward]") {
  const Index n = 200, d = 16, dv = 12;
  const RowMatrix<double> q = random_matrix<double>(n, d, 21);
  const RowMatrix<double> k = random_matrix<double>(n, d, 22);
  const RowMatrix<double> v = random_matrix<double>(n, dv, 23);
  const RowMatrix<double> dout = random_matrix<double>(n, dv, 24);
  const RowMatrix<float> qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>(),
                         doutf = dout.cast<float>();
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (const Setup& s : setups(n, masking)) {
      INFO(kind_name(s.kind) << ", sigma " << s.sigma << ", band " << s.band << ", s "
                             << s.hashes.size() << ", causal " << (masking == Masking::causal));
      RowMatrix<double> out;
      Vector<double> lse;
      forward<double>(s, q, k, v, out, lse);
      RowMatrix<float> outf;
      Vector<float> lsef;
      forward<float>(s, qf, kf, vf, outf, lsef);
      const Gradients<double> g = backward<double>(s, q, k, v, out, lse, dout);
      const Gradients<float> gf = backward<float>(s, qf, kf, vf, outf, lsef, doutf);
      const double forward_error = relative_max_error(outf.cast<double>(), out);
      // The float lse carries a rounding of eps |lse| / 2 into every probability of its row;
      // the floor 4 eps covers it (|lse| <= 8 here).
      const double bound =
          2.0 * std::max(forward_error, 4.0 * std::numeric_limits<float>::epsilon());
      INFO("forward error " << forward_error);
      CHECK(relative_max_error(gf.dq.cast<double>(), g.dq) <= bound);
      CHECK(relative_max_error(gf.dk.cast<double>(), g.dk) <= bound);
      CHECK(relative_max_error(gf.dv.cast<double>(), g.dv) <= bound);
    }
  }
}
