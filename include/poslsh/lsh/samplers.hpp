// poslsh: variance-reduced samplers of the positional hash set (sample_hashes) and Poisson-cut
// partitions (sample_partition_set, sample_nested_poisson_partitions), with the Gamma(2, 1)
// quantiles they draw widths through. Every sampler draws each sample from rbf_hash's law, so
// M~ stays an unbiased estimate of L*; they differ only in how the samples of one set are
// coupled. Everything is counter-based (Philox4x32-10 keyed by seed, counter by stream, index
// and a per-sampler tag), so a set depends only on its arguments, bit for bit on every platform.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "poslsh/core/names.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/random/philox.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/lsh/partition.hpp"

namespace poslsh {

/// How the s samples of one hash set are drawn (see sample_hashes). Every sampler draws each
/// sample from the same law as rbf_hash (w ~ Gamma(2, sigma), xi | w ~ U[0, w)), so each mask
/// M(h_k) has E[M(h_k)_ij] = exp(-|i-j| / sigma) and M~ = (1/s) sum_k M(h_k) is unbiased. The
/// variance of M~_ij is (1/s^2) (sum_k Var X_k + sum_{k != l} Cov(X_k, X_l)),
/// X_k = [bin_k(i) = bin_k(j)], and negative covariances lower it.
enum class Sampler {
  independent,         ///< rbf_hashes: s independent samples (bit for bit)
  antithetic,          ///< widths in antithetic pairs F^-1(u), F^-1(1 - u)
  stratified,          ///< widths F^-1((pi(k) + V_k) / s), one per stratum, random order pi
  lattice_offsets,     ///< groups of g samples share a width; offsets w frac(U + j / g)
  coupled_offsets,     ///< independent widths; offsets w_k frac(U + pi(k) / s) (one shared U)
  rqmc,                ///< randomly shifted rank-1 lattice over (u_w, u_xi), w = F^-1(u_w)
  stratified_lattice,  ///< s/g groups: stratified widths, lattice offsets w frac(U + j / g)
  poisson              ///< Poisson-process cuts of rate 1/sigma (partitions only, no BinHash)
};

/// The samplers' names: "independent", "antithetic", ... (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(Sampler, independent, antithetic, stratified, lattice_offsets, coupled_offsets,
                  rqmc, stratified_lattice, poisson);

/// All samplers, in declaration order (for sweeps): the enumerators of the name table.
inline constexpr auto all_samplers = enum_values<Sampler>();

/// Options of the samplers.
struct SamplerOptions {
  /// Samples per shared width of Sampler::lattice_offsets (g >= 1; the last group of a set may
  /// be shorter). g = 1 is the independent law drawn through F^-1.
  Index group = 4;
  /// Samples per group of Sampler::stratified_lattice: g >= 1, or 0 for
  /// default_lattice_group(s). The s samples form G = ceil(s / g) groups of floor(s / G) or
  /// ceil(s / G) samples (at most g each).
  Index lattice_group = 0;
};

/// The default group size of Sampler::stratified_lattice for s samples: round(sqrt(s)), at
/// least 1. It balances the two parts of the per-pair variance (see sample_hashes): the width
/// part ~ g^3 / s^3 (G = s / g strata of a function of u with a bounded derivative) and the
/// offset part ~ 1 / (g s) (the lattice rounding of each group) are equal at g^2 = s.
inline Index default_lattice_group(Index s) {
  return std::max<Index>(1, std::llround(std::sqrt(static_cast<double>(s))));
}

/// The G + 1 start indices (0, ..., s) of the groups of Sampler::stratified_lattice:
/// G = ceil(s / g) groups, the first s mod G of ceil(s / G) samples, the others of
/// floor(s / G); g = options.lattice_group, or default_lattice_group(s) when it is 0. Throws
/// std::invalid_argument naming 's' (< 1) or 'options.lattice_group' (< 0).
inline std::vector<Index> lattice_group_starts(Index samples, const SamplerOptions& options = {}) {
  constexpr const char* function = "lattice_group_starts";
  detail::require_positive(samples, function, "samples");
  detail::require(options.lattice_group >= 0, function, "options.lattice_group",
                  options.lattice_group, "must be >= 0 (0: the default)");
  const Index g = options.lattice_group > 0 ? std::min(options.lattice_group, samples)
                                            : default_lattice_group(samples);
  const Index groups = (samples + g - 1) / g;
  std::vector<Index> starts{0};
  for (Index m = 0; m < groups; ++m)
    starts.push_back(starts.back() + samples / groups + (m < samples % groups ? 1 : 0));
  return starts;
}

namespace detail {

/// log1p(x) - x without cancellation: the series -x^2/2 + x^3/3 - ... for |x| < 1/64 (14
/// terms, truncation below 1e-25 relative), log1p(x) - x otherwise.
inline double log1p_minus_x(double x) {
  if (std::abs(x) >= 1.0 / 64.0) return std::log1p(x) - x;
  double sum = 0.0;
  for (int k = 15; k >= 2; --k) sum = x * (((k % 2 == 0) ? -1.0 : 1.0) / k + sum);
  return x * sum;
}

}  // namespace detail

/// The Gamma(2, 1) distribution function F(x) = 1 - (1 + x) e^{-x}, x >= 0.
inline double gamma2_cdf(double x) {
  if (!(x > 0.0)) return 0.0;
  // 1 - (1 + x) e^{-x} = -expm1(log1p(x) - x), accurate for small x too.
  return -std::expm1(detail::log1p_minus_x(x));
}

/// The Gamma(2, 1) quantile from the upper tail: the x >= 0 with 1 - F(x) = (1 + x) e^{-x} = q,
/// q in (0, 1] (q = 1 - u gives F^-1(u); passing q directly keeps small tails exact). Newton on
/// h(x) = log1p(x) - x - ln q, which is concave and decreasing on x >= 0: started at
/// x_0 = L + 2 ln(1 + L) + 1 (L = -ln q), right of the root, the iterates decrease
/// monotonically to it; one more step after the first below 1e-8 x. Relative accuracy about 1e-15
/// in x, so |F(x) - u| is about 1e-16.
inline double gamma2_upper_quantile(double q) {
  if (!(q < 1.0)) return 0.0;
  const double log_q = std::log(q);
  const double tail = -log_q;
  double x = tail + 2.0 * std::log1p(tail) + 1.0;
  bool done = false;
  for (int iteration = 0; iteration < 400; ++iteration) {
    const double h = detail::log1p_minus_x(x) - log_q;
    const double slope = -x / (1.0 + x);
    const double step = h / slope;
    x -= step;
    if (!(x > 0.0)) x = 0.0;
    // Quadratic convergence: once a step is below 1e-8 x the next is at rounding level.
    if (std::abs(step) <= 1e-8 * x || x == 0.0) {
      if (done || x == 0.0) break;
      done = true;
    }
  }
  return x;
}

/// The Gamma(2, 1) quantile F^-1(u), u in [0, 1). For u > 1/2 through
/// gamma2_upper_quantile(1 - u) (1 - u is exact there). For u <= 1/2 safeguarded Newton on
/// phi(x) = ln F(x) - ln u (phi' = x e^{-x} / F(x)) from x_0 = t + t^2/3 + t^3/36, t = sqrt(2 u)
/// (the series inverse of F(x) = x^2/2 - x^3/3 + ...),
/// bisecting whenever a step leaves the bracket [0, 1.7] (F(1.7) > 1/2); relative accuracy
/// about 1e-15 in x for every u down to the smallest doubles.
inline double gamma2_quantile(double u) {
  if (!(u > 0.0)) return 0.0;
  if (u > 0.5) return gamma2_upper_quantile(1.0 - u);
  const double log_u = std::log(u);
  double lo = 0.0, hi = 1.7;
  const double root = std::sqrt(2.0 * u);
  double x = std::min(root * (1.0 + root / 3.0 + root * root / 36.0), 1.6);
  bool done = false;
  for (int iteration = 0; iteration < 400; ++iteration) {
    const double f = gamma2_cdf(x);
    const double phi = std::log(f) - log_u;
    if (phi == 0.0) break;
    if (phi > 0.0) {
      hi = x;
    } else {
      lo = x;
    }
    double next = x - phi * f / (x * std::exp(-x));
    if (!(next >= lo && next <= hi)) next = 0.5 * (lo + hi);
    const double step = next - x;
    x = next;
    if (std::abs(step) <= 1e-8 * x) {
      if (done) break;
      done = true;
    }
  }
  return x;
}

namespace detail {

/// Philox tags of the samplers (the top 4 bits of the counter's last word; rbf_hash uses 0, 1).
enum SamplerTag : std::uint32_t {
  tag_width = 2,
  tag_offset = 3,
  tag_shuffle = 4,
  tag_shift = 5,
  tag_cuts = 6,
  tag_cut_marks = 7
};

/// Two open uniforms for (seed, stream, index, tag).
inline std::array<double, 2> sampler_uniforms(std::uint64_t seed, std::uint64_t stream,
                                              std::uint64_t index, std::uint32_t tag) {
  const PhiloxCounter words = philox_words(seed, stream, index, tag);
  return {uniform_open(words[0], words[1]), uniform_open(words[2], words[3])};
}

/// A uniformly random permutation of 0..s-1 (Fisher-Yates, counter-based draws).
inline std::vector<Index> sampler_permutation(Index s, std::uint64_t seed, std::uint64_t stream) {
  std::vector<Index> order(static_cast<std::size_t>(s));
  std::iota(order.begin(), order.end(), Index{0});
  for (Index k = s - 1; k > 0; --k) {
    const double u = sampler_uniforms(seed, stream, static_cast<std::uint64_t>(k), tag_shuffle)[0];
    const auto j = std::min(static_cast<Index>(u * static_cast<double>(k + 1)), k);
    std::swap(order[static_cast<std::size_t>(k)], order[static_cast<std::size_t>(j)]);
  }
  return order;
}

/// The hash of width sigma x (x an F^-1 value; at least BinHash::min_width) and offset
/// fraction * width (fraction in [0, 1)), kept below the width.
inline BinHash sampler_hash(double sigma, double x, double fraction) {
  BinHash hash;
  hash.width = std::max(sigma * x, BinHash::min_width);
  hash.offset = std::min(fraction, 1.0 - 0x1.0p-53) * hash.width;
  if (!(hash.offset < hash.width)) hash.offset = 0.0;
  return hash;
}

/// frac(x) in [0, 1).
inline double fractional(double x) {
  const double f = x - std::floor(x);
  return f < 1.0 ? f : 0.0;
}

/// The generator a of the rank-1 lattice {(k / s, frac(k a / s))}: the integer nearest
/// s (sqrt(5) - 1) / 2 that is coprime to s (the Fibonacci lattice when s is a Fibonacci
/// number), or 1 for s <= 2.
inline Index rank1_generator(Index s) {
  if (s <= 2) return 1;
  const double golden = 0.5 * (std::sqrt(5.0) - 1.0);
  const auto start = static_cast<Index>(std::llround(golden * static_cast<double>(s)));
  for (Index delta = 0; delta < s; ++delta) {
    for (Index a : {start - delta, start + delta}) {
      if (a >= 1 && a < s && std::gcd(a, s) == 1) return a;
    }
  }
  return 1;
}

}  // namespace detail

/// Hash set of s samples for length scale sigma under `sampler`, keyed by (seed, stream) like
/// rbf_hashes. Each sample's marginal law is exactly that of rbf_hash (w ~ Gamma(2, sigma),
/// xi | w ~ U[0, w)); hence P[bin_k(i) = bin_k(j)] = E_w[(1 - r/w)_+] = e^{-r/sigma} for every
/// k and E[M~] = L* for every sampler. Writing F(x) = 1 - (1 + x) e^{-x} (the Gamma(2, 1) law)
/// and p_w(r) = (1 - r/w)_+ (the collision probability given w):
///   independent      rbf_hashes(sigma, s, seed, stream), bit for bit.
///   antithetic       sample 2m uses w = sigma F^-1(u_m), sample 2m+1 w = sigma F^-1(1 - u_m),
///                    u_m ~ U(0, 1); offsets independent. u and 1 - u are both U(0, 1), so each
///                    width is Gamma(2, sigma). p_w(r) is non-decreasing in w and F^-1 is
///                    increasing, so p(F^-1(u)) and p(F^-1(1 - u)) are oppositely monotone in u
///                    and their covariance is <= 0 (Chebyshev's sum inequality): the variance
///                    per pair never exceeds the independent sampler's.
///   stratified       w_k = sigma F^-1((pi(k) + V_k) / s), V_k ~ U(0, 1) independent, pi a
///                    uniformly random permutation: pi(k) is uniform on {0..s-1}, so
///                    (pi(k) + V_k) / s ~ U(0, 1) for each k. Proportional stratification:
///                    the width part of the variance, Var_w p_w(r) / s, becomes the mean
///                    within-stratum variance of p_w(r), never larger.
///   lattice_offsets  groups of g = options.group samples share w = sigma F^-1(u) and take the
///                    offsets w frac(U + j / g), j = 0..g-1, U ~ U(0, 1): frac(U + j / g) is
///                    U(0, 1) for each j. Given w the g offsets are a shifted lattice, so the
///                    number of them whose cut falls between i and j is floor(g r / w) or
///                    ceil(g r / w): the offset part of the variance, E_w[p_w (1 - p_w)], falls
///                    to E_w[f (1 - f)] / g^2 (f = frac(g r / w) for r < w), while the width part
///                    is multiplied by g (g samples share one width).
///   coupled_offsets  independent widths w_k = sigma F^-1(u_k); offsets w_k frac(U + pi(k) / s)
///                    with one U ~ U(0, 1) and a random permutation pi: each fraction is U(0, 1)
///                    and independent of w_k, so each sample has the rbf_hash law.
///   rqmc             the randomly shifted rank-1 lattice (u_w, u_xi)_k = (frac((pi(k) + D_1)
///                    / s), frac(pi(k) a / s + D_2)), a = detail::rank1_generator(s), one shift
///                    (D_1, D_2) ~ U(0, 1)^2: each point is U(0, 1)^2, so w = sigma F^-1(u_w)
///                    and xi = u_xi w have the rbf_hash law; the lattice spreads the s points
///                    evenly over the unit square (the widths are stratified as above).
///   stratified_lattice  G = ceil(s / g) groups (g = options.lattice_group, default
///                    default_lattice_group(s) = round(sqrt(s)); sizes g_m from
///                    lattice_group_starts). Group m shares the width w_m = sigma F^-1((pi(m) +
///                    V_m) / G), V_m ~ U(0, 1), pi a uniformly random permutation of the G
///                    strata, and its sample j takes the offset w_m frac(U_m + j / g_m), U_m ~
///                    U(0, 1). pi(m) is uniform on {0..G-1}, so (pi(m) + V_m) / G ~ U(0, 1) and
///                    w_m ~ Gamma(2, sigma); frac(U_m + j / g_m) ~ U(0, 1) independently of w_m:
///                    each sample has the rbf_hash law, whatever the group sizes. Given w_m the
///                    group's cuts are one grid of spacing w_m / g_m, so at distance r < w_m the
///                    number of its samples that separate i and j is floor(g_m r / w_m) or
///                    ceil(g_m r / w_m), with variance f (1 - f), f = frac(g_m r / w_m), at every
///                    position i (0 for r >= w_m). For equal groups (g | s) the variance per pair
///                    is (1 / s^2) sum_k (g^2 Var_k p_w(r) + E_k[f (1 - f)]), E_k and Var_k over
///                    stratum k of u: the width part of the variance is stratified over G strata
///                    (~ g^3 / s^3 for a p that is Lipschitz in u) and the offset part is the
///                    lattice rounding (<= 1 / (4 g s)), against p0 (1 - p0) / s independent.
///   poisson          no BinHash form (unequal block lengths): use sample_partition_set.
/// Widths go through the quantile gamma2_quantile (Newton, accurate to about 1e-15) instead of
/// rbf_hash's -sigma (ln U1 + ln U2). Only independent and coupled_offsets give each prefix of
/// the set the same law as a set of that size; the others depend on s as a whole.
/// Throws std::invalid_argument naming 'sigma', 's', 'options.group', 'options.lattice_group'
/// or 'sampler' (poisson).
inline HashSet sample_hashes(double sigma, Index samples, std::uint64_t seed, std::uint64_t stream,
                             Sampler sampler, const SamplerOptions& options = {}) {
  constexpr const char* function = "sample_hashes";
  detail::require_positive(samples, function, "samples");
  detail::require_hash_sigma(sigma, function);
  detail::require_positive(options.group, function, "options.group");
  detail::require(options.lattice_group >= 0, function, "options.lattice_group",
                  options.lattice_group, "must be >= 0 (0: the default)");
  detail::require(sampler != Sampler::poisson, function, "sampler", "poisson",
                  "has no BinHash form (unequal block lengths); use sample_partition_set");
  if (sampler == Sampler::independent) return rbf_hashes(sigma, samples, seed, stream);
  HashSet hashes(static_cast<std::size_t>(samples));
  const auto width_uniform = [&](Index index) {
    return detail::sampler_uniforms(seed, stream, static_cast<std::uint64_t>(index),
                                    detail::tag_width);
  };
  const auto offset_uniform = [&](Index index) {
    return detail::sampler_uniforms(seed, stream, static_cast<std::uint64_t>(index),
                                    detail::tag_offset)[0];
  };
  const double s_double = static_cast<double>(samples);
  switch (sampler) {
    case Sampler::antithetic:
      for (Index k = 0; k < samples; ++k) {
        const double u = width_uniform(k / 2)[0];
        // F^-1(1 - u) = upper quantile at q = u: no rounding of 1 - u on the small side.
        const double x = (k % 2 == 0) ? gamma2_quantile(u) : gamma2_upper_quantile(u);
        hashes[static_cast<std::size_t>(k)] = detail::sampler_hash(sigma, x, offset_uniform(k));
      }
      break;
    case Sampler::stratified: {
      const std::vector<Index> order = detail::sampler_permutation(samples, seed, stream);
      for (Index k = 0; k < samples; ++k) {
        const double u =
            (static_cast<double>(order[static_cast<std::size_t>(k)]) + width_uniform(k)[0]) /
            s_double;
        hashes[static_cast<std::size_t>(k)] = detail::sampler_hash(
            sigma, gamma2_quantile(std::min(u, 1.0 - 0x1.0p-53)), offset_uniform(k));
      }
      break;
    }
    case Sampler::lattice_offsets: {
      const Index g = options.group;
      for (Index k = 0; k < samples; ++k) {
        const std::array<double, 2> u = width_uniform(k / g);
        const double fraction =
            detail::fractional(u[1] + static_cast<double>(k % g) / static_cast<double>(g));
        hashes[static_cast<std::size_t>(k)] =
            detail::sampler_hash(sigma, gamma2_quantile(u[0]), fraction);
      }
      break;
    }
    case Sampler::coupled_offsets: {
      const std::vector<Index> order = detail::sampler_permutation(samples, seed, stream);
      const double shift = detail::sampler_uniforms(seed, stream, 0, detail::tag_shift)[0];
      for (Index k = 0; k < samples; ++k) {
        const double fraction = detail::fractional(
            shift + static_cast<double>(order[static_cast<std::size_t>(k)]) / s_double);
        hashes[static_cast<std::size_t>(k)] =
            detail::sampler_hash(sigma, gamma2_quantile(width_uniform(k)[0]), fraction);
      }
      break;
    }
    case Sampler::rqmc: {
      const std::vector<Index> order = detail::sampler_permutation(samples, seed, stream);
      const std::array<double, 2> shift =
          detail::sampler_uniforms(seed, stream, 0, detail::tag_shift);
      const Index a = detail::rank1_generator(samples);
      for (Index k = 0; k < samples; ++k) {
        const Index point = order[static_cast<std::size_t>(k)];
        const double u_width =
            detail::fractional((static_cast<double>(point) + shift[0]) / s_double);
        const double u_offset =
            detail::fractional(static_cast<double>((point * a) % samples) / s_double + shift[1]);
        hashes[static_cast<std::size_t>(k)] =
            detail::sampler_hash(sigma, gamma2_quantile(u_width), u_offset);
      }
      break;
    }
    case Sampler::stratified_lattice: {
      const std::vector<Index> starts = lattice_group_starts(samples, options);
      const auto groups = static_cast<Index>(starts.size()) - 1;
      const std::vector<Index> order = detail::sampler_permutation(groups, seed, stream);
      for (Index m = 0; m < groups; ++m) {
        const std::array<double, 2> u = width_uniform(m);
        const double u_width = (static_cast<double>(order[static_cast<std::size_t>(m)]) + u[0]) /
                               static_cast<double>(groups);
        const double x = gamma2_quantile(std::min(u_width, 1.0 - 0x1.0p-53));
        const Index first = starts[static_cast<std::size_t>(m)];
        const Index size = starts[static_cast<std::size_t>(m) + 1] - first;
        for (Index j = 0; j < size; ++j) {
          const double fraction =
              detail::fractional(u[1] + static_cast<double>(j) / static_cast<double>(size));
          hashes[static_cast<std::size_t>(first + j)] = detail::sampler_hash(sigma, x, fraction);
        }
      }
      break;
    }
    default:
      break;
  }
  return hashes;
}

/// The partitions of a hash set on [0, n) (block_boundaries of each hash). Throws
/// std::invalid_argument if the set is empty, a hash is invalid or n < 0.
inline PartitionSet partition_set(const HashSet& hashes, Index n) {
  return detail::analysis_partitions(hashes, n, "partition_set");
}

namespace detail {

/// The edges after 0 of the Poisson-cut partition of sample `sample` (see poisson_cut_edges),
/// in increasing order: visit(edge) for every cut in (0, n), then visit(n). n >= 1.
template <typename Visit>
void poisson_cut_walk(double sigma, Index n, std::uint64_t seed, std::uint64_t stream,
                      std::uint64_t sample, Visit&& visit) {
  std::uint64_t draw = 0;  // counter index (sample << 32) + draw: s and n / sigma below 2^32
  Index position = 0;
  const double limit = static_cast<double>(n);
  while (position < n) {
    // Two lengths per Philox call.
    const PhiloxCounter words = philox_words(seed, stream, (sample << 32) + draw++, tag_cuts);
    for (std::size_t half = 0; half < 2 && position < n; ++half) {
      const double u = uniform_open(words[2 * half], words[2 * half + 1]);
      const double gap = 1.0 + std::floor(-sigma * std::log(u));
      position =
          gap >= limit - static_cast<double>(position) ? n : position + static_cast<Index>(gap);
      visit(position);
    }
  }
}

}  // namespace detail

/// The Poisson-cut partition of sample k of (seed, stream) on [0, n): cuts of a Poisson process
/// of rate 1/sigma on the real line, one cut between positions i and i+1 (the integers' unit
/// gaps) when the process has a point in that gap. The gaps are independent, each free of
/// points with probability e^{-1/sigma}, so positions i < j share a block with probability
/// P[no point in (i, j]] = e^{-(j - i)/sigma} exactly: E[M(partition)] = L*. The block lengths
/// are then i.i.d. 1 + floor(-sigma ln U) (geometric, mean 1 / (1 - e^{-1/sigma})), the last
/// one cut at n. Does not check its arguments. O(n / sigma + 1) draws.
inline std::vector<Index> poisson_cut_edges(double sigma, Index n, std::uint64_t seed,
                                            std::uint64_t stream, std::uint64_t sample) {
  std::vector<Index> edges{0};
  if (n == 0) return edges;
  detail::poisson_cut_walk(sigma, n, seed, stream, sample,
                           [&](Index edge) { edges.push_back(edge); });
  return edges;
}

/// The partitions of s samples on [0, n) under `sampler`: partition_set(sample_hashes(...))
/// for the BinHash samplers, poisson_cut_edges(sigma, n, seed, stream, k) for Sampler::poisson.
/// Throws std::invalid_argument naming 'sigma', 's', 'n', 'options.group' or
/// 'options.lattice_group'.
inline PartitionSet sample_partition_set(double sigma, Index samples, Index n, std::uint64_t seed,
                                         std::uint64_t stream, Sampler sampler,
                                         const SamplerOptions& options = {}) {
  constexpr const char* function = "sample_partition_set";
  detail::require_size(n, function, "n");
  if (sampler != Sampler::poisson) {
    return partition_set(sample_hashes(sigma, samples, seed, stream, sampler, options), n);
  }
  detail::require_positive(samples, function, "samples");
  detail::require_hash_sigma(sigma, function);
  PartitionSet set;
  set.n = n;
  for (Index k = 0; k < samples; ++k) {
    const std::vector<Index> edges =
        poisson_cut_edges(sigma, n, seed, stream, static_cast<std::uint64_t>(k));
    set.edges.insert(set.edges.end(), edges.begin(), edges.end());
    set.offsets.push_back(set.edges.size());
  }
  return set;
}

/// Nested Poisson-cut partitions of s samples on [0, n) for heads with length scales sigmas[h],
/// all thinned from ONE Poisson process per sample. Sample k takes the cuts of
/// poisson_cut_edges(sigma_min, n, seed, stream, k), sigma_min = min_h sigmas[h] (a gap between
/// positions i and i+1 is cut when the rate-1/sigma_min process has a point in it), and gives
/// each cut c a mark U_c ~ U(0, 1), independent of everything else; head h keeps the cuts with
///   U_c < t_h = (1 - e^{-1/sigma_h}) / (1 - e^{-1/sigma_min}).
/// Thinning: each unit gap is cut by the rate-1/sigma_min process independently with
/// probability 1 - e^{-1/sigma_min}, and kept with probability t_h given that, so head h's gaps
/// are cut independently with probability 1 - e^{-1/sigma_h}: positions i < j share a block
/// with probability e^{-(j - i)/sigma_h} exactly, the law of poisson_cut_edges(sigma_h, ...)
/// (E[M~] = L* for every head). This is the continuous thinning of the process (each point
/// marked V ~ U(0, 1), head h keeping the points with V < sigma_min / sigma_h, a Poisson process
/// of rate 1/sigma_h) seen on the unit gaps: t_h = P[a gap's smallest mark < sigma_min /
/// sigma_h | the gap has a point]. t_h does not increase with sigma_h (enforced after
/// rounding), so a head with a larger sigma keeps a subset of the cuts of a head with a smaller
/// one: its partition coarsens the finer head's (nested). t = 1 for sigma_min: those heads
/// get sample_partition_set(sigma_min, s, n, seed, stream, Sampler::poisson) bit for bit.
/// Counter-based: the marks are Philox draws keyed by (seed, stream, k, cut index), so the
/// result depends only on the arguments (not on the order of sigmas beyond the output order).
/// Returns one PartitionSet per head, in the order of sigmas. O(s (n / sigma_min + 1) H) work.
/// Throws std::invalid_argument naming 'sigmas' (empty, or an entry not finite, <= 0 or
/// > max_hash_sigma), 's' (< 1) or 'n' (< 0).
inline std::vector<PartitionSet> sample_nested_poisson_partitions(const std::vector<double>& sigmas,
                                                                  Index samples, Index n,
                                                                  std::uint64_t seed,
                                                                  std::uint64_t stream) {
  constexpr const char* function = "sample_nested_poisson_partitions";
  detail::require(!sigmas.empty(), function, "sigmas", sigmas.size(), "must not be empty");
  for (double sigma : sigmas) {
    detail::require(std::isfinite(sigma) && sigma > 0.0 && sigma <= max_hash_sigma, function,
                    "sigmas", sigma, "every entry must be finite, > 0 and <= 1e300");
  }
  detail::require_positive(samples, function, "samples");
  detail::require_size(n, function, "n");
  const std::size_t heads = sigmas.size();
  const double sigma_min = *std::min_element(sigmas.begin(), sigmas.end());
  // Keep thresholds t_h, made non-increasing in sigma after rounding (heads by sigma).
  const double finest = -std::expm1(-1.0 / sigma_min);
  std::vector<std::size_t> by_sigma(heads);
  std::iota(by_sigma.begin(), by_sigma.end(), std::size_t{0});
  std::stable_sort(by_sigma.begin(), by_sigma.end(),
                   [&](std::size_t a, std::size_t b) { return sigmas[a] < sigmas[b]; });
  std::vector<double> keep(heads);
  double previous = 1.0;
  for (std::size_t h : by_sigma) {
    const double t = sigmas[h] == sigma_min ? 1.0 : -std::expm1(-1.0 / sigmas[h]) / finest;
    previous = std::min(previous, t);
    keep[h] = previous;
  }
  std::vector<PartitionSet> sets(heads);
  for (PartitionSet& set : sets) set.n = n;
  for (Index k = 0; k < samples; ++k) {
    const auto sample = static_cast<std::uint64_t>(k);
    for (PartitionSet& set : sets) set.edges.push_back(0);
    if (n > 0) {
      std::uint64_t cut = 0;  // marks: two per Philox call, counter (sample << 32) + cut / 2
      detail::PhiloxCounter words{};
      detail::poisson_cut_walk(sigma_min, n, seed, stream, sample, [&](Index edge) {
        if (edge == n) {
          for (PartitionSet& set : sets) set.edges.push_back(n);
          return;
        }
        const std::size_t half = cut % 2;
        if (half == 0)
          words =
              detail::philox_words(seed, stream, (sample << 32) + cut / 2, detail::tag_cut_marks);
        ++cut;
        const double mark = detail::uniform_open(words[2 * half], words[2 * half + 1]);
        for (std::size_t h = 0; h < heads; ++h) {
          if (mark < keep[h]) sets[h].edges.push_back(edge);
        }
      });
    }
    for (PartitionSet& set : sets) set.offsets.push_back(set.edges.size());
  }
  return sets;
}

}  // namespace poslsh
