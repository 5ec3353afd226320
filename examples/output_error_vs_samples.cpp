// poslsh output_error_vs_samples: attention output errors ||T* - T~|| against the number of
// samples s, for the per-sample and fused LSH kernels and the fixed-blocks and banded
// baselines at the same pair budget, on random and on structured Q, K, V.
//   output_error_vs_samples [--n N] [--d D] [--sigma SIGMA] [--samples LIST] [--data LIST]
//                           [--causal | --bidirectional] [--double] [--seed SEED]
//                           [--sampler NAME] [--group G] [--csv FILE]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <poslsh/analysis.hpp>
#include <poslsh/attention/banded.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/partition.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/lsh/hash.hpp>
#include <poslsh/lsh/samplers.hpp>
#include <random>
#include <string>
#include <vector>

#include "example_cli.hpp"
#include "log_log_fit.hpp"

namespace {

namespace cli = poslsh_examples;

const char* const program = "output_error_vs_samples";

const char* const usage =
    R"(output_error_vs_samples: attention output error of LSH ALiBi attention against s.

T* = softmax(tau Q K^T - |i-j| / sigma) V is the exact ALiBi attention (alibi_attention_tiled,
tau = 1/sqrt(d)). For each data set and s the program runs, against T*,
  per-sample  lsh_attention_per_sample with the hashes sample_hashes(sigma, s, seed, 0,
              sampler) (default rbf_hashes(sigma, s, seed)); with --sampler poisson
              lsh_attention_by_blocks on the partitions sample_partition_set(sigma, s, n,
              seed, 0, poisson)
  fused       lsh_attention_fused with the same hashes or partitions (the same estimator,
              each pair once)
  fixed       plain attention in blocks of width W from position 0 (the paper's baseline)
  banded      exact ALiBi attention on the keys with |i - j| <= B (alibi_attention_banded)
Budget: fixed and banded get the fused kernel's pairs P = lsh_fused_pair_count(hashes, n,
masking) (lsh_fused_pair_count(partitions, masking) for poisson), the (query, key) pairs with
c_ij > 0; W and B are the integers whose pair counts (causal: j <= i) come closest to P.
per-sample evaluates up to s times P pairs: the sum over samples and blocks b of
|b| (|b| + 1) / 2 (causal) or |b|^2 (bidirectional).
Printed per s: P/n, W, B, the relative error ||T* - T~||_F / ||T*||_F of each method and
max|T* - T~|; then fixed_blocks_attention (W = 2 sigma) and the fitted slope of log relative
error vs log s (s >= 4) of the fused kernel. The CSV adds ||T* - T~||_F, the row-wise relative
differences (median, p90, p99), the cosine of T* and T~ (output_error_metrics) and the time.

Data sets (V always i.i.d. N(0, 1)):
  random   Q, K i.i.d. N(0, 1)
  smooth   smooth low-rank Q and K: q_i = a sum_r sin(2 pi i / p_r + phi_r) u_r over 4 random
           directions u_r, periods p_r in [2 sigma, 64 sigma]; k_i = q_i + small noise
  heavy    heavy-tailed scores: Q i.i.d. N(0, 1), key j scaled by e^{g_j / 2}, g_j ~ N(0, 1)

Options:
  --n N             sequence length (default 2048)
  --d D             head dimension of Q, K and V (default 64)
  --sigma SIGMA     ALiBi length scale 1/slope (default 16)
  --samples LIST    comma-separated sample counts (default 1,2,4,...,64; per-sample's
                    cost grows like s, fused's like log s)
  --data LIST       comma-separated data sets (default random,smooth,heavy)
  --causal          causal attention (default)
  --bidirectional   bidirectional attention
  --double          compute in double (default float)
  --seed SEED       hash and data seed (default 1)
  --sampler NAME    how the s hashes are drawn (sample_hashes; all unbiased): independent
                    (default, rbf_hashes), antithetic, stratified, lattice_offsets,
                    coupled_offsets, rqmc, stratified_lattice, poisson (Poisson cuts of
                    rate 1/sigma, run through the kernels' PartitionSet overloads)
  --group G         samples per group of lattice_offsets and stratified_lattice
                    (default 0: 4 for lattice_offsets, round(sqrt(s)) for
                    stratified_lattice)
  --csv FILE        also write one row per (data, s, method) to FILE as CSV
  --help            this text

Progress goes to stderr once a run takes more than a second.
)";

struct Settings {
  poslsh::Index n = 2048;
  poslsh::Index d = 64;
  double sigma = 16.0;
  std::vector<poslsh::Index> samples{1, 2, 4, 8, 16, 32, 64};
  std::vector<std::string> data{"random", "smooth", "heavy"};
  poslsh::Masking masking = poslsh::Masking::causal;
  bool use_double = false;
  std::uint64_t seed = 1;
  poslsh::Sampler sampler = poslsh::Sampler::independent;
  poslsh::Index group = 0;
  std::string csv;
};

/// The comma-separated items of `text`, empty ones included.
std::vector<std::string> split(const char* text) {
  std::vector<std::string> items(1);
  for (const char* p = text; *p != '\0'; ++p) {
    if (*p == ',') {
      items.emplace_back();
    } else {
      items.back() += *p;
    }
  }
  return items;
}

Settings parse(int argc, char** argv) {
  Settings settings;
  for (cli::Args args(program, usage, argc, argv); args.next();) {
    if (args.flag() == "--data") {
      settings.data = split(args.value());
      for (const std::string& name : settings.data) {
        if (name != "random" && name != "smooth" && name != "heavy")
          cli::fail(program, "unknown data set '" + name + "'");
      }
    } else if (!(args.enumerator("--sampler", settings.sampler, "sampler") ||
                 args.number("--n", settings.n) || args.number("--d", settings.d) ||
                 args.number("--sigma", settings.sigma) ||
                 args.positive_list("--samples", settings.samples) ||
                 args.set("--causal", settings.masking, poslsh::Masking::causal) ||
                 args.set("--bidirectional", settings.masking, poslsh::Masking::bidirectional) ||
                 args.set("--double", settings.use_double, true) ||
                 args.number("--seed", settings.seed) || args.number("--group", settings.group) ||
                 args.text("--csv", settings.csv))) {
      args.unknown();
    }
  }
  if (settings.n < 2) cli::fail(program, "--n must be >= 2");
  if (settings.d < 1) cli::fail(program, "--d must be >= 1");
  if (settings.group < 0) cli::fail(program, "--group must be >= 0");
  if (!(settings.sigma > 0.0) || settings.sigma > poslsh::max_hash_sigma)
    cli::fail(program, "--sigma must be > 0 and <= 1e300");
  return settings;
}

struct Data {
  poslsh::RowMatrix<double> q, k, v;
};

/// Q, K, V of one data set (see --help), in double; the same for float and double runs.
Data make_data(const std::string& name, poslsh::Index n, poslsh::Index d, double sigma,
               std::uint64_t seed) {
  std::uint64_t key = seed;  // one stream per (seed, data set)
  for (const char c : name) key = key * 131 + static_cast<unsigned char>(c);
  std::mt19937_64 engine(key);
  std::normal_distribution<double> normal;
  const auto gaussian = [&](poslsh::Index rows, poslsh::Index cols) {
    poslsh::RowMatrix<double> m(rows, cols);
    for (poslsh::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(engine);
    return m;
  };
  Data data{gaussian(n, d), gaussian(n, d), gaussian(n, d)};
  if (name == "smooth") {
    constexpr int rank = 4;
    const double pi = std::acos(-1.0);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    const poslsh::RowMatrix<double> directions = gaussian(rank, d);
    // |u_r|^2 ~ d, so scores tau q_i.k_j ~ 2 sum_r s_r(i) s_r(j) (s_r the sines): |.| <~ 8.
    const double amplitude = std::sqrt(2.0 / std::sqrt(static_cast<double>(d)));
    data.q.setZero();
    for (int r = 0; r < rank; ++r) {
      const double period = 2.0 * sigma * std::pow(32.0, uniform(engine));
      const double phase = 2.0 * pi * uniform(engine);
      for (poslsh::Index i = 0; i < n; ++i) {
        data.q.row(i) += amplitude * std::sin(2.0 * pi * static_cast<double>(i) / period + phase) *
                         directions.row(r);
      }
    }
    data.k = data.q + 0.1 * amplitude * gaussian(n, d);
  } else if (name == "heavy") {
    for (poslsh::Index j = 0; j < n; ++j) data.k.row(j) *= std::exp(0.5 * normal(engine));
  }
  return data;
}

/// Pairs of fixed blocks of width W from position 0 (the pairs lsh_attention_per_sample and
/// lsh_attention_fused evaluate with the single hash {W, 0}).
long long fixed_pairs(double width, poslsh::Index n, poslsh::Masking masking) {
  return poslsh::lsh_fused_pair_count(poslsh::HashSet{poslsh::BinHash{width, 0.0}}, n, masking);
}

/// Pairs the per-sample kernel evaluates on the partitions: sum over samples and blocks b of
/// |b| (|b| + 1) / 2 (causal) or |b|^2 (bidirectional).
long long partition_block_pairs(const poslsh::PartitionSet& parts, poslsh::Masking masking) {
  long long pairs = 0;
  for (poslsh::Index sample = 0; sample < parts.samples(); ++sample) {
    const poslsh::Index* last = parts.end(sample);
    for (const poslsh::Index* edge = parts.begin(sample); edge + 1 < last; ++edge) {
      const long long size = edge[1] - edge[0];
      pairs += masking == poslsh::Masking::causal ? size * (size + 1) / 2 : size * size;
    }
  }
  return pairs;
}

/// Pairs with |i - j| <= band (causal: also j <= i) over n queries.
long long band_pairs(poslsh::Index band, poslsh::Index n, poslsh::Masking masking) {
  const long long b = std::min<long long>(band, n - 1), m = n;
  const long long below = b * (b + 1) / 2 + (m - 1 - b) * b;  // sum_i min(i, b)
  return masking == poslsh::Masking::causal ? m + below : m + 2 * below;
}

/// Smallest integer x in [lo, hi] with pairs(x) >= target (pairs non-decreasing up to edge
/// effects), or the neighbour below it when that one is closer to target.
template <typename Pairs>
poslsh::Index closest_budget(long long target, poslsh::Index lo, poslsh::Index hi, Pairs pairs) {
  poslsh::Index first = lo, last = hi;
  while (first < last) {
    const poslsh::Index middle = first + (last - first) / 2;
    if (pairs(middle) >= target) {
      last = middle;
    } else {
      first = middle + 1;
    }
  }
  if (first > lo && target - pairs(first - 1) < pairs(first) - target) return first - 1;
  return first;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Result {
  poslsh::OutputErrorMetrics metrics;
  double max = 0.0;
  double seconds = 0.0;
  long long pairs = 0;
};

/// Times run() and measures its output against exact (output_error_metrics and max |entry|).
template <typename Scalar, typename Run>
Result run_method(const poslsh::RowMatrix<Scalar>& exact, long long pairs, Run run) {
  const auto start = std::chrono::steady_clock::now();
  const poslsh::RowMatrix<Scalar> approx = run();
  Result result;
  result.seconds = seconds_since(start);
  result.pairs = pairs;
  result.metrics = poslsh::output_error_metrics<Scalar>(exact, approx);
  result.max = (exact - approx).template cast<double>().cwiseAbs().maxCoeff();
  return result;
}

const char* const method_names[] = {"per_sample", "fused", "fixed", "banded"};

/// The four methods at one s: the fused kernel's pair budget, the matched W and B, results
/// in the order of method_names.
struct Row {
  long long budget = 0;
  poslsh::Index width = 0, band = 0;
  Result results[4];
};

template <typename Scalar>
Row measure_row(const poslsh::RowMatrix<Scalar>& q, const poslsh::RowMatrix<Scalar>& k,
                const poslsh::RowMatrix<Scalar>& v, const poslsh::RowMatrix<Scalar>& exact,
                const Settings& settings, poslsh::Index s) {
  const poslsh::Index n = settings.n;
  const poslsh::Masking masking = settings.masking;
  const poslsh::AttentionOptions options{masking};
  poslsh::SamplerOptions sampler_options;
  if (settings.group > 0) sampler_options.group = settings.group;
  sampler_options.lattice_group = settings.group;
  const bool poisson = settings.sampler == poslsh::Sampler::poisson;
  // Poisson cuts have no BinHash form: the kernels' PartitionSet overloads run them.
  const poslsh::HashSet hashes = poisson
                                     ? poslsh::HashSet{}
                                     : poslsh::sample_hashes(settings.sigma, s, settings.seed, 0,
                                                             settings.sampler, sampler_options);
  const poslsh::PartitionSet parts =
      poisson ? poslsh::sample_partition_set(settings.sigma, s, n, settings.seed, 0,
                                             poslsh::Sampler::poisson)
              : poslsh::PartitionSet{};
  Row row;
  long long per_sample_pairs = 0;
  if (poisson) {
    row.budget = poslsh::lsh_fused_pair_count(parts, masking);
    per_sample_pairs = partition_block_pairs(parts, masking);
  } else {
    row.budget = poslsh::lsh_fused_pair_count(hashes, n, masking);
    for (const poslsh::BinHash& hash : hashes)
      per_sample_pairs += poslsh::lsh_fused_pair_count(poslsh::HashSet{hash}, n, masking);
  }
  row.width = closest_budget(row.budget, 1, n, [&](poslsh::Index w) {
    return fixed_pairs(static_cast<double>(w), n, masking);
  });
  row.band = closest_budget(row.budget, 0, n - 1,
                            [&](poslsh::Index b) { return band_pairs(b, n, masking); });
  const poslsh::HashSet fixed{poslsh::BinHash{static_cast<double>(row.width), 0.0}};
  row.results[0] = run_method<Scalar>(exact, per_sample_pairs, [&] {
    if (!poisson) return poslsh::lsh_attention_per_sample<Scalar>(q, k, v, hashes, options);
    poslsh::RowMatrix<Scalar> out(q.rows(), v.cols());
    poslsh::lsh_attention_by_blocks<Scalar>(q, k, v, parts, out, options);
    return out;
  });
  row.results[1] = run_method<Scalar>(exact, row.budget, [&] {
    return poisson ? poslsh::lsh_attention_fused<Scalar>(q, k, v, parts, options)
                   : poslsh::lsh_attention_fused<Scalar>(q, k, v, hashes, options);
  });
  row.results[2] = run_method<Scalar>(exact, fixed_pairs(fixed[0].width, n, masking), [&] {
    return poslsh::lsh_attention_per_sample<Scalar>(q, k, v, fixed, options);
  });
  row.results[3] = run_method<Scalar>(exact, band_pairs(row.band, n, masking), [&] {
    return poslsh::alibi_attention_banded<Scalar>(q, k, v, settings.sigma, row.band, options);
  });
  return row;
}

template <typename Scalar>
void run(const Settings& settings) {
  using Matrix = poslsh::RowMatrix<Scalar>;
  const poslsh::Index n = settings.n;
  const double per_query = 1.0 / static_cast<double>(n);
  const poslsh::AttentionOptions options{settings.masking};
  const bool causal = settings.masking == poslsh::Masking::causal;
  const char* const masking = causal ? "causal" : "bidirectional";

  std::FILE* const csv =
      cli::open_csv(program, settings.csv,
                    "data,n,d,sigma,masking,scalar,seed,s,method,pairs,pairs_per_query,width,band,"
                    "frobenius,relative_frobenius,max,row_relative_median,row_relative_p90,"
                    "row_relative_p99,cosine,seconds,sampler\n");
  const auto write_csv = [&](const std::string& data, poslsh::Index s, const char* method,
                             const Result& r, double width, poslsh::Index band) {
    if (csv == nullptr) return;
    std::fprintf(
        csv,
        "%s,%ld,%ld,%.17g,%s,%s,%llu,%ld,%s,%lld,%.6f,%g,%ld,%.9g,%.9g,%.9g,%.9g,%.9g,"
        "%.9g,%.12g,%.6f,%s\n",
        data.c_str(), static_cast<long>(n), static_cast<long>(settings.d), settings.sigma, masking,
        sizeof(Scalar) == 4 ? "float" : "double", static_cast<unsigned long long>(settings.seed),
        static_cast<long>(s), method, r.pairs, static_cast<double>(r.pairs) * per_query, width,
        static_cast<long>(band), r.metrics.frobenius, r.metrics.relative_frobenius, r.max,
        r.metrics.row_relative_median, r.metrics.row_relative_p90, r.metrics.row_relative_p99,
        r.metrics.cosine, r.seconds, poslsh::enum_name(settings.sampler));
  };

  const auto start = std::chrono::steady_clock::now();
  std::printf(
      "Attention output error of ALiBi approximations against the exact T* (alibi_attention_\n"
      "tiled); n = %ld, d = %ld, sigma = %g, %s, %s, seed %llu. fixed (block width W) and\n"
      "banded (|i-j| <= B) get the fused kernel's pairs per query. Columns: relative error\n"
      "||T*-T~||_F/||T*||_F per method, then the largest entry max|T*-T~|. Sampler: %s,\n"
      "group %ld (0: default).\n",
      static_cast<long>(n), static_cast<long>(settings.d), settings.sigma, masking,
      sizeof(Scalar) == 4 ? "float" : "double", static_cast<unsigned long long>(settings.seed),
      poslsh::enum_name(settings.sampler), static_cast<long>(settings.group));

  for (const std::string& name : settings.data) {
    const Data data = make_data(name, n, settings.d, settings.sigma, settings.seed);
    const Matrix q = data.q.cast<Scalar>(), k = data.k.cast<Scalar>(), v = data.v.cast<Scalar>();
    const Matrix exact = poslsh::alibi_attention_tiled<Scalar>(q, k, v, settings.sigma, options);
    std::printf("\ndata %s: ||T*||_F = %.5g\n", name.c_str(), exact.template cast<double>().norm());
    std::printf("%6s %8s %6s %5s | %10s %9s %9s %9s | %9s %9s %9s\n", "s", "pairs/q", "W", "B",
                "per-sample", "fused", "fixed", "banded", "fused", "fixed", "banded");
    std::vector<double> counts, fused_errors;
    for (poslsh::Index s : settings.samples) {
      const Row row = measure_row<Scalar>(q, k, v, exact, settings, s);
      const Result* r = row.results;
      std::printf("%6ld %8.1f %6ld %5ld | %10.4g %9.4g %9.4g %9.4g | %9.3g %9.3g %9.3g\n",
                  static_cast<long>(s), static_cast<double>(row.budget) * per_query,
                  static_cast<long>(row.width), static_cast<long>(row.band),
                  r[0].metrics.relative_frobenius, r[1].metrics.relative_frobenius,
                  r[2].metrics.relative_frobenius, r[3].metrics.relative_frobenius, r[1].max,
                  r[2].max, r[3].max);
      std::fflush(stdout);
      counts.push_back(static_cast<double>(s));
      fused_errors.push_back(r[1].metrics.relative_frobenius);
      for (int m = 0; m < 4; ++m) {
        write_csv(name, s, method_names[m], r[m], m == 2 ? static_cast<double>(row.width) : 0.0,
                  m == 3 ? row.band : 0);
      }
      if (seconds_since(start) > 1.0) {
        std::fprintf(stderr, "[output_error_vs_samples] %s, s = %ld done, %.1f s elapsed\n",
                     name.c_str(), static_cast<long>(s), seconds_since(start));
      }
    }
    // The paper's fixed-blocks baseline, blocks of 2 sigma whatever the budget.
    const double paper_width = poslsh::fixed_blocks_hash(settings.sigma).width;
    const Result paper = run_method<Scalar>(
        exact, fixed_pairs(paper_width, n, settings.masking),
        [&] { return poslsh::fixed_blocks_attention<Scalar>(q, k, v, settings.sigma, options); });
    std::printf(
        "fixed_blocks_attention (W = 2 sigma = %g): %.1f pairs/q, relative error %.4g, "
        "max %.3g\n",
        paper_width, static_cast<double>(paper.pairs) * per_query, paper.metrics.relative_frobenius,
        paper.max);
    write_csv(name, 0, "fixed_2sigma", paper, paper_width, 0);
    const double slope = cli::log_log_slope(counts, fused_errors, 4.0);  // over s >= 4
    if (std::isfinite(slope))
      std::printf("fused: slope of log relative error vs log s %.3f\n", slope);
  }
  if (csv != nullptr) std::fclose(csv);
  std::printf("\ntotal %.2f s\n", seconds_since(start));
}

}  // namespace

int main(int argc, char** argv) {
  const Settings settings = parse(argc, argv);
  if (settings.use_double) {
    run<double>(settings);
  } else {
    run<float>(settings);
  }
  return 0;
}
