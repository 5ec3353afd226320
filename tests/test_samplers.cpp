// The variance-reduced samplers: the independent one is rbf_hashes bit for bit, the Gamma(2)
// quantile inverts its distribution function, every sampler (Poisson cuts included) hits
// positions at distance r with probability exp(-r / sigma) (binomial z-scores over many seeds),
// and the antithetic and stratified widths never raise the variance per pair (exact
// integrals over the Gamma law).
#include <cmath>
#include <functional>
#include <poslsh/samplers.hpp>

#include "test_support.hpp"

using poslsh::HashSet;
using poslsh::Index;
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
      INFO("sigma " << sigma << ", sampler " << poslsh::sampler_name(sampler) << ": max z "
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
  using poslsh_test::require_invalid_argument;
  require_invalid_argument([] { poslsh::sample_hashes(1.0, 4, 1, 0, Sampler::poisson); },
                           "sampler");
  require_invalid_argument([] { poslsh::sample_hashes(1.0, 0, 1, 0, Sampler::rqmc); }, "s");
  require_invalid_argument([] { poslsh::sample_hashes(-1.0, 4, 1, 0, Sampler::rqmc); }, "sigma");
  poslsh::SamplerOptions options;
  options.group = 0;
  require_invalid_argument(
      [&] { poslsh::sample_hashes(1.0, 4, 1, 0, Sampler::lattice_offsets, options); },
      "options.group");
  require_invalid_argument([] { poslsh::sample_partition_set(1.0, 4, -1, 1, 0, Sampler::poisson); },
                           "n");
  require_invalid_argument([] { poslsh::sampler_from_name("bogus"); }, "name");
  CHECK(poslsh::sampler_from_name("rqmc") == Sampler::rqmc);
}
