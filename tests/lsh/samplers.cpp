// The variance-reduced samplers: the independent one is rbf_hashes bit for bit, the Gamma(2)
// quantile inverts its distribution function, every sampler (Poisson cuts included) hits
// positions at distance r with probability exp(-r / sigma) (binomial z-scores over many seeds),
// the antithetic and stratified widths never raise the variance per pair (exact integrals
// over the Gamma law), and stratified_lattice has its group structure, each sample's law and
// the exact per-pair variance; nested Poisson partitions across heads nest, keep the
// finest head bit for bit and give every head the Poisson sampler's law.
#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <numeric>
#include <poslsh/lsh/samplers.hpp>

#include "test_support.hpp"

using poslsh::PartitionSet;
using poslsh::Sampler;

TEST_CASE("the independent sampler is rbf_hashes bit for bit", "[samplers]") {
  for (double sigma : {0.3, 16.0, 1e6}) {
    for (Index s : {Index{1}, Index{7}, Index{64}}) {
      const HashSet expected = poslsh::rbf_hashes(sigma, s, 42, 3);
      const HashSet got = poslsh::sample_hashes(sigma, s, 42, 3, Sampler::independent);
      REQUIRE(got.size() == expected.size());
      for (std::size_t k = 0; k < got.size(); ++k) {
        CHECK(got[k].width == expected[k].width);
        CHECK(got[k].offset == expected[k].offset);
      }
    }
  }
}

TEST_CASE("gamma2_quantile inverts F(x) = 1 - (1 + x) exp(-x)", "[samplers]") {
  double worst = 0.0;
  for (int i = 1; i < 1000; ++i) {
    const double u = i / 1000.0;
    worst = std::max(worst, std::abs(poslsh::gamma2_cdf(poslsh::gamma2_quantile(u)) - u));
  }
  CHECK(worst <= 1e-12);
  // Tails: small u (x ~ sqrt(2 u)) and small q = 1 - u (through the upper quantile).
  for (double tiny : {1e-3, 1e-8, 1e-14}) {
    const double x = poslsh::gamma2_quantile(tiny);
    CHECK(std::abs(poslsh::gamma2_cdf(x) - tiny) <= 1e-12 * tiny + 1e-300);
    const double y = poslsh::gamma2_upper_quantile(tiny);
    CHECK(std::abs((1.0 + y) * std::exp(-y) - tiny) <= 1e-12 * tiny);
  }
  CHECK(poslsh::gamma2_quantile(0.0) == 0.0);
}

TEST_CASE("every sampler hits distance r with probability exp(-r/sigma)", "[samplers][unbiased]") {
  const int seeds = 1000;
  const Index s = 16;
  const Index first = 37;  // positions (first, first + r)
  const Index distances = 48;
  for (double sigma : {1.5, 16.0}) {
    for (Sampler sampler : poslsh::all_samplers) {
      std::vector<double> hits(static_cast<std::size_t>(distances), 0.0);
      std::vector<double> squares(static_cast<std::size_t>(distances), 0.0);
      for (int seed = 0; seed < seeds; ++seed) {
        std::vector<double> set_hits(static_cast<std::size_t>(distances), 0.0);
        const PartitionSet set = poslsh::sample_partition_set(
            sigma, s, first + distances, static_cast<std::uint64_t>(seed) + 1000, 5, sampler);
        for (Index k = 0; k < s; ++k) {
          // Block of `first`: [edge[0], edge[1]).
          const Index* edge = set.begin(k);
          while (edge[1] <= first) ++edge;
          for (Index r = 0; r < distances; ++r) {
            if (first + r < edge[1]) set_hits[static_cast<std::size_t>(r)] += 1.0;
          }
        }
        for (Index r = 0; r < distances; ++r) {
          hits[static_cast<std::size_t>(r)] += set_hits[static_cast<std::size_t>(r)];
          squares[static_cast<std::size_t>(r)] +=
              set_hits[static_cast<std::size_t>(r)] * set_hits[static_cast<std::size_t>(r)];
        }
      }
      const double total = static_cast<double>(seeds) * static_cast<double>(s);
      double worst_z = 0.0;
      for (Index r = 0; r < distances; ++r) {
        const double p = std::exp(-static_cast<double>(r) / sigma);
        const auto ur = static_cast<std::size_t>(r);
        // Binomial standard deviation of the total hit count, or the observed one across the
        // (independent) seeds when samples within a set are positively correlated (shared
        // widths of lattice_offsets); the +3 hits cover the Poisson regime (total p << 1).
        const double binomial = total * p * (1.0 - p);
        const double set_mean = hits[ur] / seeds;
        const double observed = (squares[ur] / seeds - set_mean * set_mean) * seeds;
        const double deviation = std::max(0.0, std::abs(hits[ur] - total * p) - 3.0);
        worst_z = std::max(worst_z, deviation / std::sqrt(std::max(binomial, observed) + 1e-300));
      }
      INFO("sigma " << sigma << ", sampler " << poslsh::enum_name(sampler) << ": max z "
                    << worst_z);
      CHECK(worst_z < 5.0);
    }
  }
}

namespace {

/// Midpoint rule of f over (a, b) with m points.
double integrate(const std::function<double(double)>& f, double a, double b, int m) {
  double sum = 0.0;
  const double h = (b - a) / m;
  for (int i = 0; i < m; ++i) sum += f(a + (i + 0.5) * h);
  return sum * h;
}

/// P[same bin | w = sigma x] at distance r: (1 - r / w)_+.
double collision(double r, double sigma, double x) {
  const double w = sigma * x;
  return w > r ? 1.0 - r / w : 0.0;
}

}  // namespace

TEST_CASE("antithetic and stratified widths never raise the variance per pair",
          "[samplers][variance]") {
  const int m = 4000;
  for (double sigma : {2.0, 16.0}) {
    for (double r : {0.0, 1.0, 3.0, 8.0, 16.0, 40.0, 100.0}) {
      const double p0 = std::exp(-r / sigma);
      const auto p = [&](double u) { return collision(r, sigma, poslsh::gamma2_quantile(u)); };
      INFO("sigma " << sigma << ", r " << r);
      // The quantile integrates to the kernel: E_u p(F^-1(u)) = exp(-r / sigma).
      CHECK(std::abs(integrate(p, 0.0, 1.0, m) - p0) <= 2e-5);
      // Antithetic pair: Cov(X_1, X_2) = int p(F^-1(u)) p(F^-1(1 - u)) du - p0^2 <= 0, so the
      // pair's variance (2 p0 (1 - p0) + 2 Cov) / 4 is at most the independent p0 (1 - p0) / 2.
      const double cross = integrate(
          [&](double u) { return p(u) * collision(r, sigma, poslsh::gamma2_upper_quantile(u)); },
          0.0, 1.0, m);
      const double covariance = cross - p0 * p0;
      CHECK(covariance <= 1e-5);
      // Stratified over s strata: Var(mean) = (1/s^2) sum_k (E_k p - (E_k p)^2) with E_k the
      // mean over stratum [k/s, (k+1)/s), against p0 (1 - p0) / s.
      for (int s : {4, 16}) {
        double stratified = 0.0;
        for (int k = 0; k < s; ++k) {
          const double mean = integrate(p, double(k) / s, double(k + 1) / s, m / s) * s;
          stratified += mean - mean * mean;
        }
        stratified /= double(s) * s;
        CHECK(stratified <= p0 * (1.0 - p0) / s + 1e-6);
      }
    }
  }
}

namespace {

/// Exact Var M~_ij at distance r of Sampler::stratified_lattice with the group sizes of
/// lattice_group_starts(s, options): the strata are assigned to the groups by a uniformly random
/// permutation (enumerated; G <= 7), and given the permutation group m (size g_m, stratum
/// pi(m)) adds g_m p(u) - D with E[D | u] = 0 and Var[D | u] = f (1 - f), f = frac(g_m r / w)
/// for r < w (0 otherwise), w = sigma F^-1(u), u uniform on the stratum. So
/// Var M~ = E_pi[(1/s^2) sum_m (g_m^2 Var_pi(m) p + E_pi(m) f (1 - f))]
///        + Var_pi[(1/s) sum_m g_m E_pi(m) p], each stratum moment by the midpoint rule.
/// Also returns E M~ (the mean over the permutations of the conditional means).
std::array<double, 2> sampler_lattice_moments(double r, double sigma, Index s,
                                              const poslsh::SamplerOptions& options, int points) {
  const std::vector<Index> starts = poslsh::lattice_group_starts(s, options);
  const int groups = static_cast<int>(starts.size()) - 1;
  std::vector<int> sizes;
  for (std::size_t m = 0; m + 1 < starts.size(); ++m)
    sizes.push_back(static_cast<int>(starts[m + 1] - starts[m]));
  // Per stratum k and group m (its size): mean and variance of p (Welford), mean of f (1 - f).
  struct Moments {
    double p = 0.0, variance = 0.0, rounding = 0.0;
  };
  std::vector<std::vector<Moments>> table(static_cast<std::size_t>(groups),
                                          std::vector<Moments>(sizes.size()));
  for (int k = 0; k < groups; ++k) {
    for (std::size_t m = 0; m < sizes.size(); ++m) {
      const double g = sizes[m];
      Moments& moments = table[static_cast<std::size_t>(k)][m];
      for (int q = 0; q < points; ++q) {
        const double u = (k + (q + 0.5) / points) / groups;
        const double w = sigma * poslsh::gamma2_quantile(u);
        const double p = collision(r, sigma, w / sigma);
        const double f = r < w ? g * r / w - std::floor(g * r / w) : 0.0;
        const double delta = p - moments.p;
        moments.p += delta / (q + 1);
        moments.variance += delta * (p - moments.p);
        moments.rounding += f * (1.0 - f);
      }
      moments.variance /= points;
      moments.rounding /= points;
    }
  }
  std::vector<int> order(static_cast<std::size_t>(groups));
  std::iota(order.begin(), order.end(), 0);
  double conditional_variance = 0.0;
  std::vector<double> means;
  const double sd = static_cast<double>(s);
  do {
    double c_mean = 0.0, c_var = 0.0;
    for (int m = 0; m < groups; ++m) {
      const Moments& moments = table[static_cast<std::size_t>(order[static_cast<std::size_t>(m)])]
                                    [static_cast<std::size_t>(m)];
      const double g = sizes[static_cast<std::size_t>(m)];
      c_mean += g * moments.p / sd;
      c_var += (g * g * moments.variance + moments.rounding) / (sd * sd);
    }
    conditional_variance += c_var;
    means.push_back(c_mean);
  } while (std::next_permutation(order.begin(), order.end()));
  const double count = static_cast<double>(means.size());
  double mean = 0.0, spread = 0.0;
  for (double x : means) mean += x / count;
  for (double x : means) spread += (x - mean) * (x - mean) / count;
  return {mean, conditional_variance / count + spread};
}

}  // namespace

TEST_CASE("stratified_lattice: groups share a stratified width and take lattice offsets",
          "[samplers]") {
  const double sigma = 5.0;
  struct Case {
    Index s, g;
  };
  for (const Case c :
       {Case{64, 0}, Case{33, 6}, Case{10, 4}, Case{7, 1}, Case{5, 5}, Case{3, 9}, Case{256, 0}}) {
    poslsh::SamplerOptions options;
    options.lattice_group = c.g;
    const Index g = c.g > 0 ? std::min(c.g, c.s) : poslsh::default_lattice_group(c.s);
    const std::vector<Index> starts = poslsh::lattice_group_starts(c.s, options);
    const auto groups = static_cast<Index>(starts.size()) - 1;
    INFO("s " << c.s << ", g " << g);
    CHECK(groups == (c.s + g - 1) / g);
    CHECK(starts.front() == 0);
    CHECK(starts.back() == c.s);
    for (std::size_t m = 0; m + 1 < starts.size(); ++m) {
      const Index size = starts[m + 1] - starts[m];
      CHECK(size <= g);
      CHECK((size == c.s / groups || size == c.s / groups + 1));
    }
    for (std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{2}, std::uint64_t{3}}) {
      const HashSet hashes =
          poslsh::sample_hashes(sigma, c.s, seed, 4, Sampler::stratified_lattice, options);
      REQUIRE(static_cast<Index>(hashes.size()) == c.s);
      std::vector<int> strata(static_cast<std::size_t>(groups), 0);
      for (Index m = 0; m < groups; ++m) {
        const auto first = static_cast<std::size_t>(starts[static_cast<std::size_t>(m)]);
        const auto size = static_cast<std::size_t>(starts[static_cast<std::size_t>(m) + 1]) - first;
        const double width = hashes[first].width;
        // One stratum of F per group.
        const double u = poslsh::gamma2_cdf(width / sigma);
        ++strata[std::min(static_cast<std::size_t>(u * static_cast<double>(groups)),
                          static_cast<std::size_t>(groups - 1))];
        for (std::size_t j = 0; j < size; ++j) {
          const poslsh::BinHash& hash = hashes[first + j];
          poslsh::validate_hash(hash, "test");
          CHECK(hash.width == width);
          // Offsets w frac(U + j / g_m): the fraction steps by 1 / g_m mod 1.
          const double step = hash.offset / width - hashes[first].offset / width;
          const double expected = static_cast<double>(j) / static_cast<double>(size);
          CHECK(std::abs(step - std::floor(step) - expected) <= 1e-12);
        }
      }
      for (int n : strata) CHECK(n == 1);
    }
  }
}

TEST_CASE("stratified_lattice: each group separates i and j floor or ceil(g r / w) times",
          "[samplers]") {
  for (double sigma : {3.0, 16.0}) {
    const Index s = 30;
    poslsh::SamplerOptions options;
    options.lattice_group = 7;  // groups of 6 (5 groups)
    const std::vector<Index> starts = poslsh::lattice_group_starts(s, options);
    const HashSet hashes =
        poslsh::sample_hashes(sigma, s, 11, 0, Sampler::stratified_lattice, options);
    int checked = 0;
    for (std::size_t m = 0; m + 1 < starts.size(); ++m) {
      const double w = hashes[static_cast<std::size_t>(starts[m])].width;
      const double g = static_cast<double>(starts[m + 1] - starts[m]);
      for (Index i = 0; i < 300; ++i) {
        for (Index r = 0; r <= 80; ++r) {
          int separated = 0;
          for (Index k = starts[m]; k < starts[m + 1]; ++k) {
            const poslsh::BinHash& hash = hashes[static_cast<std::size_t>(k)];
            separated += hash.bin(i) != hash.bin(i + r) ? 1 : 0;
          }
          const double cuts = static_cast<double>(r) < w ? g * static_cast<double>(r) / w : g;
          const bool ok = separated == static_cast<int>(std::floor(cuts)) ||
                          separated == static_cast<int>(std::ceil(cuts));
          if (!ok) {
            INFO("sigma " << sigma << ", group " << m << ", i " << i << ", r " << r << ": "
                          << separated << " of " << g << " separate, g r / w = " << cuts);
            CHECK(ok);
          }
          ++checked;
        }
      }
    }
    CHECK(checked == 5 * 300 * 81);
  }
}

TEST_CASE("stratified_lattice: each sample has the rbf_hash law", "[samplers][unbiased]") {
  // Over independent seeds, u = F(w / sigma) and the offset fraction xi / w of a fixed sample
  // are U(0, 1), and frac(u + xi / w) is too (as it is when xi / w is uniform and independent
  // of u; f = 1 - u, say, would fail): Kolmogorov-Smirnov distances below the 0.1% critical
  // value 1.95 / sqrt(N).
  const int seeds = 4000;
  const double sigma = 7.0;
  for (Index s : {Index{16}, Index{33}}) {
    for (Index k : {Index{0}, s / 2, s - 1}) {
      std::vector<double> widths, fractions, sums;
      for (int seed = 0; seed < seeds; ++seed) {
        const HashSet hashes = poslsh::sample_hashes(
            sigma, s, static_cast<std::uint64_t>(seed) + 77, 1, Sampler::stratified_lattice);
        const poslsh::BinHash& hash = hashes[static_cast<std::size_t>(k)];
        const double u = poslsh::gamma2_cdf(hash.width / sigma);
        const double f = hash.offset / hash.width;
        widths.push_back(u);
        fractions.push_back(f);
        sums.push_back(u + f - std::floor(u + f));
      }
      for (std::vector<double>* values : {&widths, &fractions, &sums}) {
        std::sort(values->begin(), values->end());
        double distance = 0.0;
        for (int q = 0; q < seeds; ++q) {
          const double x = (*values)[static_cast<std::size_t>(q)];
          distance = std::max(
              {distance, std::abs(x - double(q) / seeds), std::abs(x - double(q + 1) / seeds)});
        }
        INFO("s " << s << ", sample " << k);
        CHECK(distance < 1.95 / std::sqrt(double(seeds)));
      }
    }
  }
}

TEST_CASE("stratified_lattice: per-pair mean and variance match the exact integrals",
          "[samplers][variance]") {
  // Empirical mean and variance of M~_ij over independent seeds against
  // sampler_lattice_moments, tolerances 5 standard errors (the variance's from the empirical
  // fourth central moment). Equal groups (s = 16, g = 4) and unequal ones (s = 10, g = 4:
  // sizes 4, 3, 3; s = 14, g = 5: 5, 5, 4).
  const int seeds = 6000;
  const Index first = 23;
  struct Case {
    double sigma;
    Index s, g;
  };
  for (const Case c : {Case{16.0, 16, 4}, Case{2.0, 16, 4}, Case{16.0, 10, 4}, Case{6.0, 14, 5}}) {
    poslsh::SamplerOptions options;
    options.lattice_group = c.g;
    const std::vector<double> distances{0.0, 1.0, 3.0, 8.0, 16.0, 40.0};
    std::vector<std::vector<double>> values(distances.size());
    for (int seed = 0; seed < seeds; ++seed) {
      const HashSet hashes =
          poslsh::sample_hashes(c.sigma, c.s, static_cast<std::uint64_t>(seed) + 500, 2,
                                Sampler::stratified_lattice, options);
      for (std::size_t d = 0; d < distances.size(); ++d) {
        const Index j = first + static_cast<Index>(distances[d]);
        double same = 0.0;
        for (const poslsh::BinHash& hash : hashes) same += hash.bin(first) == hash.bin(j) ? 1 : 0;
        values[d].push_back(same / static_cast<double>(c.s));
      }
    }
    for (std::size_t d = 0; d < distances.size(); ++d) {
      const double r = distances[d];
      if (r > 4.0 * c.sigma) continue;  // p0 < e^-4: the midpoint rule misses the far tail
      const std::array<double, 2> exact = sampler_lattice_moments(r, c.sigma, c.s, options, 4000);
      double mean = 0.0;
      for (double x : values[d]) mean += x / seeds;
      double m2 = 0.0, m4 = 0.0;
      for (double x : values[d]) {
        m2 += (x - mean) * (x - mean) / seeds;
        m4 += std::pow(x - mean, 4) / seeds;
      }
      const double p0 = std::exp(-r / c.sigma);
      INFO("sigma " << c.sigma << ", s " << c.s << ", g " << c.g << ", r " << r << ": mean " << mean
                    << " (exact " << exact[0] << "), variance " << m2 << " (exact " << exact[1]
                    << ", independent " << p0 * (1.0 - p0) / static_cast<double>(c.s) << ")");
      // The exact mean is the kernel (each sample has the rbf_hash law).
      CHECK(std::abs(exact[0] - p0) <= 1e-6);
      CHECK(std::abs(mean - p0) <= 5.0 * std::sqrt(exact[1] / seeds) + 1e-12);
      CHECK(std::abs(m2 - exact[1]) <=
            5.0 * std::sqrt(std::max(m4 - m2 * m2, 0.0) / seeds) + 1e-5 * exact[1] + 1e-20);
    }
  }
}

TEST_CASE("samplers are deterministic and keep valid hashes", "[samplers]") {
  for (Sampler sampler : poslsh::all_samplers) {
    if (sampler == Sampler::poisson) continue;
    const HashSet a = poslsh::sample_hashes(8.0, 33, 9, 2, sampler);
    const HashSet b = poslsh::sample_hashes(8.0, 33, 9, 2, sampler);
    const HashSet other = poslsh::sample_hashes(8.0, 33, 9, 3, sampler);
    REQUIRE(a.size() == 33);
    bool differs = false;
    for (std::size_t k = 0; k < a.size(); ++k) {
      poslsh::validate_hash(a[k], "test");
      CHECK(a[k].width == b[k].width);
      CHECK(a[k].offset == b[k].offset);
      differs = differs || a[k].width != other[k].width;
    }
    CHECK(differs);
  }
  const PartitionSet p = poslsh::sample_partition_set(4.0, 5, 300, 1, 0, Sampler::poisson);
  const PartitionSet q = poslsh::sample_partition_set(4.0, 5, 300, 1, 0, Sampler::poisson);
  CHECK(p.edges == q.edges);
  poslsh::validate_partition_set(p, "test");
}

TEST_CASE("antithetic widths pair u with 1 - u", "[samplers]") {
  const double sigma = 3.0;
  const HashSet hashes = poslsh::sample_hashes(sigma, 10, 4, 0, Sampler::antithetic);
  for (std::size_t k = 0; k + 1 < hashes.size(); k += 2) {
    const double u = poslsh::gamma2_cdf(hashes[k].width / sigma);
    const double v = poslsh::gamma2_cdf(hashes[k + 1].width / sigma);
    CHECK(std::abs(u + v - 1.0) <= 1e-12);
  }
  // Stratified widths: one per stratum of F.
  const HashSet strata = poslsh::sample_hashes(sigma, 16, 4, 0, Sampler::stratified);
  std::vector<int> seen(16, 0);
  for (const poslsh::BinHash& hash : strata)
    ++seen[static_cast<std::size_t>(poslsh::gamma2_cdf(hash.width / sigma) * 16)];
  for (int count : seen) CHECK(count == 1);
}

TEST_CASE("samplers reject bad arguments", "[samplers][invalid]") {
  require_invalid_argument([] { poslsh::sample_hashes(1.0, 4, 1, 0, Sampler::poisson); },
                           "sampler");
  require_invalid_argument([] { poslsh::sample_hashes(1.0, 0, 1, 0, Sampler::rqmc); }, "samples");
  require_invalid_argument([] { poslsh::sample_hashes(-1.0, 4, 1, 0, Sampler::rqmc); }, "sigma");
  poslsh::SamplerOptions options;
  options.group = 0;
  require_invalid_argument(
      [&] { poslsh::sample_hashes(1.0, 4, 1, 0, Sampler::lattice_offsets, options); },
      "options.group");
  options.group = 4;
  options.lattice_group = -1;
  require_invalid_argument(
      [&] { poslsh::sample_hashes(1.0, 4, 1, 0, Sampler::stratified_lattice, options); },
      "options.lattice_group");
  require_invalid_argument([&] { poslsh::lattice_group_starts(4, options); },
                           "options.lattice_group");
  require_invalid_argument([] { poslsh::lattice_group_starts(0); }, "samples");
  CHECK(poslsh::enum_from_name<poslsh::Sampler>("stratified_lattice") ==
        Sampler::stratified_lattice);
  require_invalid_argument([] { poslsh::sample_partition_set(1.0, 4, -1, 1, 0, Sampler::poisson); },
                           "n");
  require_invalid_argument([] { poslsh::enum_from_name<poslsh::Sampler>("bogus"); }, "name");
  CHECK(poslsh::enum_from_name<poslsh::Sampler>("rqmc") == Sampler::rqmc);
}

namespace {

/// Whether sample k of `set` has no edge strictly inside (a, b], i.e. a and b share a block.
bool sampler_same_block(const PartitionSet& set, Index k, Index a, Index b) {
  const Index* first = set.begin(k);
  const Index* last = set.end(k);
  // First edge > a: a's block ends there.
  const Index* edge = std::upper_bound(first, last, a);
  return edge == last || *edge > b;
}

/// Number of cuts in (0, n) of sample k (edges other than 0 and n).
Index sampler_cut_count(const PartitionSet& set, Index k) {
  return static_cast<Index>(set.end(k) - set.begin(k)) - (set.n > 0 ? 2 : 1);
}

/// |observed - expected| / sqrt(variance), with a floor on the variance for p near 0 or 1.
double sampler_z(double observed, double expected, double variance) {
  return std::abs(observed - expected) / std::sqrt(std::max(variance, 1.0));
}

}  // namespace

TEST_CASE("nested Poisson partitions: the finest head is the Poisson sampler, heads nest",
          "[samplers][nested]") {
  const std::vector<double> sigmas{4.0, 1.5, 16.0, 4.0, 300.0, 1.5};
  const Index s = 7;
  for (Index n : {Index{0}, Index{1}, Index{2}, Index{2000}}) {
    for (std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{77}, std::uint64_t{1} << 40}) {
      const std::vector<PartitionSet> sets =
          poslsh::sample_nested_poisson_partitions(sigmas, s, n, seed, 3);
      REQUIRE(sets.size() == sigmas.size());
      const PartitionSet single =
          poslsh::sample_partition_set(1.5, s, n, seed, 3, Sampler::poisson);
      for (std::size_t h = 0; h < sets.size(); ++h) {
        INFO("n " << n << ", seed " << seed << ", head " << h);
        poslsh::validate_partition_set(sets[h], "test");
        CHECK(sets[h].n == n);
        CHECK(sets[h].samples() == s);
        if (sigmas[h] == 1.5) {  // sigma_min: bit for bit the single-head sampler
          CHECK(sets[h].edges == single.edges);
          CHECK(sets[h].offsets == single.offsets);
        }
        for (std::size_t g = 0; g < sets.size(); ++g) {
          if (!(sigmas[g] <= sigmas[h])) continue;
          // Head h (larger sigma) keeps a subset of head g's cuts in every sample.
          for (Index k = 0; k < s; ++k) {
            CHECK(
                std::includes(sets[g].begin(k), sets[g].end(k), sets[h].begin(k), sets[h].end(k)));
          }
          if (sigmas[g] == sigmas[h]) CHECK(sets[g].edges == sets[h].edges);
        }
      }
      // Only the set of sigmas (through sigma_min) matters, not the other heads or the order.
      const std::vector<PartitionSet> pair =
          poslsh::sample_nested_poisson_partitions({300.0, 1.5}, s, n, seed, 3);
      CHECK(pair[0].edges == sets[4].edges);
      CHECK(pair[1].edges == sets[1].edges);
    }
  }
}

TEST_CASE("nested Poisson partitions: each head has the Poisson sampler's law",
          "[samplers][nested][unbiased]") {
  // Heads' gaps are cut independently with probability q = 1 - e^{-1/sigma}: positions a < b
  // share a block with probability e^{-(b - a)/sigma}, two disjoint ranges are both uncut with
  // the product, the cuts in (0, n) are Binomial(n - 1, q), and a cut of a finer head g is kept
  // by head h with probability q_h / q_g. Each statistic is checked for the nested heads and
  // for sample_partition_set(sigma_h, ..., poisson) on other seeds (binomial z-scores < 5).
  const std::vector<double> sigmas{1.5, 4.0, 16.0, 60.0};
  const Index s = 8, n = 200, first = 37;
  const int seeds = 500;
  const double trials = static_cast<double>(seeds) * static_cast<double>(s);
  const std::vector<Index> distances{1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144};
  for (std::size_t h = 0; h < sigmas.size(); ++h) {
    const double sigma = sigmas[h];
    const double q = -std::expm1(-1.0 / sigma);
    // Joint check: (first, first + a] and (first + a + 3, first + 2 a + 3] both uncut.
    const auto a = static_cast<Index>(std::ceil(sigma / 2.0));
    for (int source = 0; source < 2; ++source) {
      std::vector<double> together(distances.size(), 0.0);
      double joint = 0.0, cuts = 0.0, cut_squares = 0.0;
      double finer_cuts = 0.0, kept = 0.0;  // head 0's cuts, those head h keeps
      for (int seed = 0; seed < seeds; ++seed) {
        const auto key = static_cast<std::uint64_t>(seed) + 5000;
        const std::vector<PartitionSet> nested =
            poslsh::sample_nested_poisson_partitions(sigmas, s, n, key, 2);
        const PartitionSet set = source == 0 ? nested[h]
                                             : poslsh::sample_partition_set(
                                                   sigma, s, n, key + 100000, 2, Sampler::poisson);
        for (Index k = 0; k < s; ++k) {
          for (std::size_t r = 0; r < distances.size(); ++r) {
            together[r] += sampler_same_block(set, k, first, first + distances[r]) ? 1.0 : 0.0;
          }
          joint += sampler_same_block(set, k, first, first + a) &&
                           sampler_same_block(set, k, first + a + 3, first + 2 * a + 3)
                       ? 1.0
                       : 0.0;
          const auto count = static_cast<double>(sampler_cut_count(set, k));
          cuts += count;
          cut_squares += count * count;
          if (source == 0) {
            finer_cuts += static_cast<double>(sampler_cut_count(nested[0], k));
            kept += count;
          }
        }
      }
      INFO("sigma " << sigma << (source == 0 ? ", nested head" : ", single-head sampler"));
      for (std::size_t r = 0; r < distances.size(); ++r) {
        const double p = std::exp(-static_cast<double>(distances[r]) / sigma);
        INFO("r = " << distances[r] << ": " << together[r] / trials << " vs " << p);
        CHECK(sampler_z(together[r], trials * p, trials * p * (1.0 - p)) < 5.0);
      }
      const double p_joint = std::exp(-2.0 * static_cast<double>(a) / sigma);
      CHECK(sampler_z(joint, trials * p_joint, trials * p_joint * (1.0 - p_joint)) < 5.0);
      // Cuts per sample: Binomial(n - 1, q), mean m and variance v; the sample variance's
      // standard error from the binomial fourth central moment v (1 + 3 (n - 3) q (1 - q)).
      const double gaps = static_cast<double>(n - 1);
      const double mean = gaps * q, variance = gaps * q * (1.0 - q);
      INFO("cuts per sample " << cuts / trials << " vs " << mean);
      CHECK(sampler_z(cuts, trials * mean, trials * variance) < 5.0);
      const double sample_mean = cuts / trials;
      const double sample_variance =
          (cut_squares - trials * sample_mean * sample_mean) / (trials - 1.0);
      const double fourth = variance * (1.0 + 3.0 * (gaps - 2.0) * q * (1.0 - q));
      const double variance_error = std::sqrt((fourth - variance * variance) / trials);
      INFO("variance of the cuts " << sample_variance << " vs " << variance);
      CHECK(std::abs(sample_variance - variance) < 5.0 * variance_error);
      if (source == 0 && h > 0) {
        // Thinning: head h keeps each of head 0's cuts with probability q_h / q_0.
        const double keep = q / -std::expm1(-1.0 / sigmas[0]);
        INFO("kept " << kept / finer_cuts << " vs " << keep);
        CHECK(sampler_z(kept, finer_cuts * keep, finer_cuts * keep * (1.0 - keep)) < 5.0);
      }
    }
  }
}

TEST_CASE("nested Poisson partitions are deterministic and reject bad arguments",
          "[samplers][nested][invalid]") {
  const std::vector<double> sigmas{2.0, 9.0, 40.0};
  const std::vector<PartitionSet> a =
      poslsh::sample_nested_poisson_partitions(sigmas, 5, 400, 9, 1);
  const std::vector<PartitionSet> b =
      poslsh::sample_nested_poisson_partitions(sigmas, 5, 400, 9, 1);
  const std::vector<PartitionSet> other_stream =
      poslsh::sample_nested_poisson_partitions(sigmas, 5, 400, 9, 2);
  const std::vector<PartitionSet> other_seed =
      poslsh::sample_nested_poisson_partitions(sigmas, 5, 400, 10, 1);
  for (std::size_t h = 0; h < sigmas.size(); ++h) {
    CHECK(a[h].edges == b[h].edges);
    CHECK(a[h].offsets == b[h].offsets);
    CHECK(a[h].edges != other_stream[h].edges);
    CHECK(a[h].edges != other_seed[h].edges);
  }
  require_invalid_argument([] { poslsh::sample_nested_poisson_partitions({}, 4, 10, 1, 0); },
                           "sigmas");
  for (double bad : {0.0, -1.0, std::nan(""), poslsh_test::infinity, 1e301}) {
    require_invalid_argument(
        [&] {
          poslsh::sample_nested_poisson_partitions({4.0, bad}, 4, 10, 1, 0);
        },
        "sigmas");
  }
  require_invalid_argument([] { poslsh::sample_nested_poisson_partitions({4.0}, 0, 10, 1, 0); },
                           "samples");
  require_invalid_argument([] { poslsh::sample_nested_poisson_partitions({4.0}, 4, -1, 1, 0); },
                           "n");
}
