// poslsh error_vs_samples: how fast the mean of s random block masks M~ approaches the ALiBi
// kernel L*, measured matrix-free (no n x n matrix), against the paper's expectation bound.
//   error_vs_samples [--n N] [--sigma SIGMA | --heads H] [--samples LIST] [--causal |
//                     --bidirectional] [--seed SEED] [--sampler NAME] [--group G]
//                     [--csv FILE]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <poslsh/analysis.hpp>
#include <poslsh/analysis/band_counts.hpp>
#include <poslsh/core/slopes.hpp>
#include <poslsh/lsh/hash.hpp>
#include <poslsh/lsh/samplers.hpp>
#include <string>
#include <vector>

#include "example_cli.hpp"
#include "log_log_fit.hpp"

namespace {

namespace cli = poslsh_examples;

const char* const program = "error_vs_samples";

const char* const usage =
    R"(error_vs_samples: error of the LSH estimate M~ of the ALiBi kernel L* against s.

L*_ij = exp(-|i-j| / sigma) (sigma = 1 / ALiBi slope; causal: j <= i only) and
M~ = (1/s) sum_k M(h_k), the mean of s random block masks, with E[M~] = L*. For each s
the program prints, computed matrix-free (no n x n matrix is ever formed):
  ||E||_2      spectral error ||L* - M~||_2 (Lanczos; exact tridiagonal ||L*||_2)
  max|E|       max-norm error max_ij |L*_ij - M~_ij| (exact)
  rel          ||E||_2 / ||L*||_2
  bound        the paper's expectation bound Psi (sqrt(ln n / s) + ln n / s),
               Psi = 1 + sigma + coth(1 / (2 sigma)), on E ||E||_2
  pairs/q      pairs with M~_ij > 0 per query (the fused LSH kernel's cost)
then the least-squares slopes of log error against log s and against log pairs over s >= 4
(theory for independent samples: -1/2 against s).

Options:
  --n N             sequence length (default 16384)
  --sigma SIGMA     length scale (default 16, the 4th head of an 8-head ALiBi model)
  --heads H         instead of --sigma: one table per head of an H-head model,
                    sigma_h = 1 / m_h with the official ALiBi slopes m_h
  --samples LIST    comma-separated sample counts (default 1,2,4,...,1024)
  --causal          causal kernel (default)
  --bidirectional   bidirectional kernel
  --seed SEED       hash seed (default 1); head h uses stream h
  --sampler NAME    how the s samples are drawn (sample_partition_set; all unbiased):
                    independent (default, rbf_hashes), antithetic, stratified,
                    lattice_offsets, coupled_offsets, rqmc, stratified_lattice,
                    poisson
  --group G         samples per group of lattice_offsets and stratified_lattice
                    (default 0: 4 for lattice_offsets, round(sqrt(s)) for
                    stratified_lattice)
  --max-restarts N  Lanczos restart limit per spectral norm (default 100)
  --csv FILE        also write every row to FILE as CSV
  --help            this text

A '*' after ||E||_2 marks a Lanczos run that hit its restart limit; the value is then a lower
bound (this happens for very few samples on long sequences, where E is nearly periodic).
Progress goes to stderr once a run takes more than a second.
)";

struct Settings {
  poslsh::Index n = 16384;
  double sigma = 16.0;
  int heads = 0;
  std::vector<poslsh::Index> samples{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  poslsh::Masking masking = poslsh::Masking::causal;
  std::uint64_t seed = 1;
  poslsh::Sampler sampler = poslsh::Sampler::independent;
  poslsh::Index group = 0;
  poslsh::Index max_restarts = 100;
  std::string csv;
};

Settings parse(int argc, char** argv) {
  Settings settings;
  for (cli::Args args(program, usage, argc, argv); args.next();) {
    if (!(args.enumerator("--sampler", settings.sampler, "sampler") ||
          args.number("--n", settings.n) || args.number("--sigma", settings.sigma) ||
          args.number("--heads", settings.heads) ||
          args.positive_list("--samples", settings.samples) ||
          args.set("--causal", settings.masking, poslsh::Masking::causal) ||
          args.set("--bidirectional", settings.masking, poslsh::Masking::bidirectional) ||
          args.number("--seed", settings.seed) || args.number("--group", settings.group) ||
          args.number("--max-restarts", settings.max_restarts) ||
          args.text("--csv", settings.csv))) {
      args.unknown();
    }
  }
  if (settings.n < 2) cli::fail(program, "--n must be >= 2");
  if (!(settings.sigma > 0.0)) cli::fail(program, "--sigma must be > 0");
  if (settings.heads < 0) cli::fail(program, "--heads must be >= 1");
  if (settings.group < 0) cli::fail(program, "--group must be >= 0");
  if (settings.max_restarts < 1) cli::fail(program, "--max-restarts must be >= 1");
  return settings;
}

/// The fit of log y against log x over s >= 4 (where the s^-1/2 regime holds), or over every
/// point when fewer than two have s >= 4.
cli::LogLogFit fit_over_large_s(const std::vector<double>& counts, const std::vector<double>& y) {
  const cli::LogLogFit fit = cli::log_log_fit(counts, y, 4.0);
  return fit.points >= 2 ? fit : cli::log_log_fit(counts, y);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const Settings settings = parse(argc, argv);
  const bool causal = settings.masking == poslsh::Masking::causal;
  std::vector<double> sigmas{settings.sigma};
  if (settings.heads > 0) sigmas = poslsh::alibi_sigmas(settings.heads);

  std::FILE* const csv =
      cli::open_csv(program, settings.csv,
                    "head,sigma,n,masking,seed,s,spectral,max,relative,bound,kernel_norm,converged,"
                    "products,seconds,sampler,pairs\n");
  const auto start = std::chrono::steady_clock::now();
  std::printf(
      "Error E = L* - M~ of the mean M~ of s random block masks against the ALiBi kernel\n"
      "L*_ij = exp(-|i-j|/sigma); n = %ld, %s, seed %llu. Computed matrix-free (one dense\n"
      "n x n matrix would take %.3g GB). Columns: spectral error ||E||_2, largest entry\n"
      "max|E|, relative error rel = ||E||_2/||L*||_2, the paper's bound on E||E||_2,\n"
      "pairs per query with M~_ij > 0. Sampler: %s, group %ld (0: default).\n",
      static_cast<long>(settings.n), causal ? "causal" : "bidirectional",
      static_cast<unsigned long long>(settings.seed),
      8.0 * static_cast<double>(settings.n) * static_cast<double>(settings.n) / 1e9,
      poslsh::enum_name(settings.sampler), static_cast<long>(settings.group));
  bool any_unconverged = false;

  for (std::size_t head = 0; head < sigmas.size(); ++head) {
    const double sigma = sigmas[head];
    const double kernel_norm = poslsh::alibi_kernel_norm(settings.n, sigma, settings.masking);
    std::printf("\n");
    if (settings.heads > 0) std::printf("head %zu of %d: ", head, settings.heads);
    std::printf("sigma = %g, ||L*||_2 = %.6g\n", sigma, kernel_norm);
    std::printf("%7s %12s %10s %10s %12s %9s %10s\n", "s", "||E||_2", "max|E|", "rel", "bound",
                "pairs/q", "time [s]");
    std::vector<double> counts, spectral, maximum, pair_counts;
    for (poslsh::Index s : settings.samples) {
      const auto row_start = std::chrono::steady_clock::now();
      // The sample set's blocks (sample_partition_set; independent: rbf_hashes' blocks), then
      // the metric set with M~ in the cheaper representation (block sums or band counts).
      poslsh::SamplerOptions sampler_options;
      if (settings.group > 0) sampler_options.group = settings.group;
      sampler_options.lattice_group = settings.group;
      const poslsh::PartitionSet partitions = poslsh::sample_partition_set(
          sigma, s, settings.n, settings.seed, head, settings.sampler, sampler_options);
      poslsh::MetricOptions options;
      options.spectral.max_restarts = settings.max_restarts;
      const poslsh::KernelErrorMetrics metrics =
          poslsh::partition_error_metrics(partitions, sigma, settings.masking, options);
      const poslsh::SpectralNorm& norm = metrics.spectral_details;
      const double max_error = metrics.max;
      const double bound = poslsh::expectation_bound(settings.n, sigma, s);
      const long long pairs = poslsh::partition_pair_count(partitions, settings.masking);
      const double seconds = seconds_since(row_start);
      std::printf("%7ld %11.5g%c %10.5g %10.5g %12.5g %9.1f %10.3f\n", static_cast<long>(s),
                  norm.value, norm.converged ? ' ' : '*', max_error, norm.value / kernel_norm,
                  bound, static_cast<double>(pairs) / static_cast<double>(settings.n), seconds);
      std::fflush(stdout);
      if (csv != nullptr) {
        std::fprintf(
            csv, "%zu,%.17g,%ld,%s,%llu,%ld,%.17g,%.17g,%.17g,%.17g,%.17g,%d,%ld,%.6f,%s,%lld\n",
            head, sigma, static_cast<long>(settings.n), causal ? "causal" : "bidirectional",
            static_cast<unsigned long long>(settings.seed), static_cast<long>(s), norm.value,
            max_error, norm.value / kernel_norm, bound, kernel_norm, norm.converged ? 1 : 0,
            static_cast<long>(norm.products), seconds, poslsh::enum_name(settings.sampler), pairs);
      }
      if (seconds_since(start) > 1.0) {
        std::fprintf(stderr, "[error_vs_samples] sigma %g, s = %ld done, %.1f s elapsed\n", sigma,
                     static_cast<long>(s), seconds_since(start));
      }
      any_unconverged = any_unconverged || !norm.converged;
      counts.push_back(static_cast<double>(s));
      spectral.push_back(norm.value);
      maximum.push_back(max_error);
      pair_counts.push_back(static_cast<double>(pairs));
    }
    const cli::LogLogFit spectral_fit = fit_over_large_s(counts, spectral);
    const cli::LogLogFit max_fit = fit_over_large_s(counts, maximum);
    if (std::isfinite(spectral_fit.slope)) {
      std::printf(
          "slope of log error vs log s over s = %g..%g (theory -0.5): spectral %.3f, max %.3f\n",
          spectral_fit.first, spectral_fit.last, spectral_fit.slope, max_fit.slope);
      // Against the pairs of the s >= 4 rows (the cost of the fused kernel).
      std::vector<double> pairs_large, spectral_large, max_large;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        if (counts[r] < 4.0) continue;
        pairs_large.push_back(pair_counts[r]);
        spectral_large.push_back(spectral[r]);
        max_large.push_back(maximum[r]);
      }
      if (pairs_large.size() >= 2) {
        std::printf("slope of log error vs log pairs over the same s: spectral %.3f, max %.3f\n",
                    cli::log_log_fit(pairs_large, spectral_large).slope,
                    cli::log_log_fit(pairs_large, max_large).slope);
      }
    }
  }
  if (csv != nullptr) std::fclose(csv);
  if (any_unconverged)
    std::printf("\n* Lanczos restart limit reached: a lower bound (see --help)\n");
  std::printf("\ntotal %.2f s\n", seconds_since(start));
  return 0;
}
