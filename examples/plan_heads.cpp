// poslsh plan_heads: the per-head method planner (multihead/planner.hpp) on model shapes, its
// predicted time against the best single method for all heads, and optionally measured.
//   plan_heads [--n N] [--heads H] [--d D] [--causal | --bidirectional] [--targets LIST]
//              [--measure] [--repeats R] [--seed SEED] [--window W]
//   plan_heads --calibrate [--n N] [--dims LIST] [--seeds N] [--samplers LIST]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <poslsh/attention/banded.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/core/slopes.hpp>
#include <poslsh/multihead/attention.hpp>
#include <poslsh/multihead/planner.hpp>
#include <random>
#include <string>
#include <vector>

#include "example_cli.hpp"

namespace {

namespace cli = poslsh_examples;

const char* const program = "plan_heads";

const char* const usage =
    R"(plan_heads: per-head choice of exact tiled, banded or LSH attention for a target error.

For each target relative output error, plan_heads prints the plan of every head (method,
band W or samples s and sampler, predicted pairs per query, error and single-thread time),
then the predicted time of the plan against the best single method used for every head
(exact tiled; banded with each head's W; LSH with each sampler's s), all from the
planner's cost model (pairs / measured pairs per second) and error models.

Options:
  --n N             sequence length (default 16384)
  --heads H         heads, sigma_h = 1 / ALiBi slope (default 8)
  --d D             head dimension (default 64)
  --causal          causal attention (default)
  --bidirectional   bidirectional attention
  --targets LIST    comma-separated relative errors (default 0.1,0.01,0.001)
  --measure         also run the plan, the best single method and exact attention on random
                    Q, K, V (float, normal): per head the measured against the predicted
                    relative error, the heads meeting the target, and the measured times
                    (best of --repeats runs, OpenMP over heads)
  --repeats R       timed runs of --measure (default 3)
  --seed SEED       hash and data seed (default 1)
  --window W        PlannerOptions::lsh_sample_window: also price s_min + 1 .. s_min + W
                    for each LSH sampler and keep the cheapest (default 0)
  --calibrate       instead of planning, measure the ratio of the fused LSH kernel's relative
                    error to each default model's mean fit c s^-a over sigma 1.1..256, s 16..256,
                    causal and bidirectional, the head dimensions --dims and --seeds data and
                    hash seeds (1000, 1001, ...) at length --n: the largest ratio is the
                    model's upper factor; and of banded attention's error to
                    banded_dropped_share at W = planner_band(sigma, target, 3, masking, 0)
                    (targets 1e-1..1e-3)
  --dims LIST       head dimensions of --calibrate (default 64,128)
  --seeds N         seeds of --calibrate (default 3)
  --samplers LIST   --calibrate only these samplers' models (comma-separated names; default
                    all of default_lsh_error_models)
  --banded-only     --calibrate banded attention only
  --help            this text
)";

struct Settings {
  poslsh::Index n = 16384;
  int heads = 8;
  poslsh::Index d = 64;
  poslsh::Masking masking = poslsh::Masking::causal;
  std::vector<double> targets{0.1, 0.01, 0.001};
  bool measure = false;
  int repeats = 3;
  std::uint64_t seed = 1;
  poslsh::Index window = 0;
  bool calibrate = false;
  std::vector<poslsh::Index> dims{64, 128};
  int seeds = 3;
  bool banded_only = false;
  std::string samplers;  // --samplers: empty for all default models
};

Settings parse(int argc, char** argv) {
  Settings settings;
  for (cli::Args args(program, usage, argc, argv); args.next();) {
    if (!(args.number("--n", settings.n) || args.number("--heads", settings.heads) ||
          args.number("--d", settings.d) ||
          args.set("--causal", settings.masking, poslsh::Masking::causal) ||
          args.set("--bidirectional", settings.masking, poslsh::Masking::bidirectional) ||
          args.positive_list("--targets", settings.targets) ||
          args.set("--measure", settings.measure, true) ||
          args.number("--repeats", settings.repeats) || args.number("--seed", settings.seed) ||
          args.number("--window", settings.window) ||
          args.set("--calibrate", settings.calibrate, true) ||
          args.positive_list("--dims", settings.dims) || args.number("--seeds", settings.seeds) ||
          args.set("--banded-only", settings.banded_only, true) ||
          args.text("--samplers", settings.samplers))) {
      args.unknown();
    }
  }
  if (settings.n < 2) cli::fail(program, "--n must be >= 2");
  if (settings.heads < 1) cli::fail(program, "--heads must be >= 1");
  if (settings.d < 1) cli::fail(program, "--d must be >= 1");
  if (settings.repeats < 1) cli::fail(program, "--repeats must be >= 1");
  if (settings.seeds < 1) cli::fail(program, "--seeds must be >= 1");
  if (settings.window < 0) cli::fail(program, "--window must be >= 0");
  return settings;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

using Matrix = poslsh::RowMatrix<float>;

// n x columns normal entries from seed.
Matrix normal_matrix(poslsh::Index n, poslsh::Index columns, std::uint64_t seed) {
  std::mt19937_64 engine(seed);
  std::normal_distribution<float> normal;
  Matrix m(n, columns);
  for (poslsh::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(engine);
  return m;
}

double relative_error(const Matrix& exact, const Matrix& approx) {
  return (exact - approx).cast<double>().norm() / exact.cast<double>().norm();
}

// --calibrate: measured / (c s^-a) of every default model over sigma, s, masking, d and seeds.
int calibrate(const Settings& settings) {
  const std::vector<double> sigmas{1.1, 2, 4, 8, 16, 32, 64, 128, 256};
  const std::vector<poslsh::Index> samples{16, 32, 64, 128, 256};
  std::vector<poslsh::LshErrorModel> models = poslsh::default_lsh_error_models();
  if (!settings.samplers.empty()) {
    std::vector<poslsh::LshErrorModel> chosen;
    std::string list = settings.samplers + ",";
    for (std::size_t start = 0, comma; (comma = list.find(',', start)) != std::string::npos;
         start = comma + 1) {
      const std::string name = list.substr(start, comma - start);
      const auto match =
          std::find_if(models.begin(), models.end(), [&](const poslsh::LshErrorModel& model) {
            return name == poslsh::enum_name(model.sampler);
          });
      if (match == models.end()) cli::fail(program, "--samplers: no default model '" + name + "'");
      chosen.push_back(*match);
    }
    models = chosen;
  }
  const poslsh::Index n = settings.n;
  std::printf(
      "Calibration of the LSH error models: n = %ld, float, normal Q, K, V, seeds %d..%d, ratio "
      "= measured relative error / (c s^-a)\n",
      static_cast<long>(n), 1000, 1000 + settings.seeds - 1);
  std::vector<std::vector<double>> ratios(models.size());
  std::vector<double> banded_ratios;  // measured / banded_dropped_share at planner_band W
  std::printf("%-13s %-5s %4s %6s", "masking", "d", "seed", "sigma");
  for (const poslsh::LshErrorModel& model : models)
    std::printf("  %11s", poslsh::enum_name(model.sampler));
  std::printf("  %8s   (largest ratio over s = 16..256; banded over targets 1e-1..1e-3)\n",
              "banded");
  for (poslsh::Masking masking : {poslsh::Masking::causal, poslsh::Masking::bidirectional}) {
    poslsh::AttentionOptions attention;
    attention.masking = masking;
    for (poslsh::Index d : settings.dims) {
      for (int run = 0; run < settings.seeds; ++run) {
        const std::uint64_t seed = 1000 + static_cast<std::uint64_t>(run);
        const Matrix q = normal_matrix(n, d, 3 * seed);
        const Matrix k = normal_matrix(n, d, 3 * seed + 1);
        const Matrix v = normal_matrix(n, d, 3 * seed + 2);
        for (double sigma : sigmas) {
          const Matrix exact = poslsh::alibi_attention_tiled<float>(q, k, v, sigma, attention);
          double banded_largest = 0.0;
          for (double target : {1e-1, 1e-2, 1e-3}) {
            const poslsh::Index band = poslsh::planner_band(sigma, target, 3.0, masking, 0.0);
            if (band >= n - 1) continue;
            const Matrix approx =
                poslsh::alibi_attention_banded<float>(q, k, v, sigma, band, attention);
            const double ratio =
                relative_error(exact, approx) / poslsh::banded_dropped_share(sigma, band, masking);
            banded_ratios.push_back(ratio);
            banded_largest = std::max(banded_largest, ratio);
          }
          std::printf("%-13s %-5ld %4llu %6g",
                      masking == poslsh::Masking::causal ? "causal" : "bidirectional",
                      static_cast<long>(d), static_cast<unsigned long long>(seed), sigma);
          for (std::size_t m = 0; m < models.size(); ++m) {
            poslsh::LshErrorModel mean = models[m];
            mean.upper_factor = 1.0;
            double largest = 0.0;
            for (poslsh::Index s : settings.banded_only ? std::vector<poslsh::Index>{} : samples) {
              const Matrix approx = poslsh::lsh_attention_fused<float>(
                  q, k, v, poslsh::sample_hashes(sigma, s, seed, 0, mean.sampler), attention);
              const double ratio =
                  relative_error(exact, approx) / poslsh::lsh_predicted_error(mean, s);
              ratios[m].push_back(ratio);
              largest = std::max(largest, ratio);
            }
            std::printf("  %11.3f", largest);
          }
          std::printf("  %8.3f\n", banded_largest);
          std::fflush(stdout);
        }
      }
    }
  }
  std::printf(
      "\nsampler       runs   mean ratio  std ratio  largest  upper factor (1.05 largest)\n");
  for (std::size_t m = 0; m < models.size(); ++m) {
    double sum = 0.0, squares = 0.0, largest = 0.0;
    for (double r : ratios[m]) {
      sum += r;
      squares += r * r;
      largest = std::max(largest, r);
    }
    const double count = static_cast<double>(ratios[m].size());
    const double mean = sum / count;
    std::printf("%-12s %5zu %12.3f %10.3f %8.3f %13.3f\n", poslsh::enum_name(models[m].sampler),
                ratios[m].size(), mean, std::sqrt(std::max(0.0, squares / count - mean * mean)),
                largest, 1.05 * largest);
  }
  double largest = 0.0, smallest = 1e300;
  for (double r : banded_ratios) {
    largest = std::max(largest, r);
    smallest = std::min(smallest, r);
  }
  std::printf(
      "banded at W = planner_band(sigma, 1e-1..1e-3, 3, masking, 0): %zu runs, measured / dropped "
      "share %.3f to "
      "%.3f\n",
      banded_ratios.size(), smallest, largest);
  return 0;
}

// Best of `repeats` timed runs of a plan on all heads.
double time_plan(const Matrix& q, const Matrix& k, const Matrix& v, Matrix& out,
                 const std::vector<poslsh::HeadPlan>& plans, poslsh::Index heads, poslsh::Index d,
                 const poslsh::AttentionOptions& attention, int repeats) {
  const poslsh::Index n = q.rows();
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    poslsh::multihead_attention<float>(
        poslsh::interleaved_heads<const float>(q.data(), n, heads, d),
        poslsh::interleaved_heads<const float>(k.data(), n, heads, d),
        poslsh::interleaved_heads<const float>(v.data(), n, heads, d),
        poslsh::interleaved_heads(out.data(), n, heads, d), plans, attention);
    best = std::min(best, seconds_since(start));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const Settings settings = parse(argc, argv);
  if (settings.calibrate) return calibrate(settings);
  const std::vector<double> sigmas = poslsh::alibi_sigmas(settings.heads);
  const poslsh::Index n = settings.n, d = settings.d, heads = settings.heads;
  std::printf("Planner: n = %ld, %d heads, d = %ld, %s, sigmas alibi_sigmas(%d)\n",
              static_cast<long>(n), settings.heads, static_cast<long>(d),
              settings.masking == poslsh::Masking::causal ? "causal" : "bidirectional",
              settings.heads);
  poslsh::PlannerOptions options;
  options.head_dim = d;
  options.seed = settings.seed;
  options.lsh_sample_window = settings.window;

  Matrix q, k, v, exact;
  double exact_seconds = 0.0;
  poslsh::AttentionOptions attention;
  attention.masking = settings.masking;
  if (settings.measure) {
    q = normal_matrix(n, heads * d, 3 * settings.seed);
    k = normal_matrix(n, heads * d, 3 * settings.seed + 1);
    v = normal_matrix(n, heads * d, 3 * settings.seed + 2);
    exact.resize(n, heads * d);
    std::vector<poslsh::HeadPlan> all_exact(static_cast<std::size_t>(heads));
    for (poslsh::Index h = 0; h < heads; ++h)
      all_exact[static_cast<std::size_t>(h)].sigma = sigmas[static_cast<std::size_t>(h)];
    exact_seconds = time_plan(q, k, v, exact, all_exact, heads, d, attention, 1);
    std::printf("measured exact tiled, all heads, OpenMP over heads: %.3f s\n", exact_seconds);
  }

  for (double target : settings.targets) {
    const std::vector<poslsh::HeadPlan> plans =
        poslsh::plan_heads(n, sigmas, settings.masking, target, options);
    std::printf("\ntarget relative output error %g\n%s", target,
                poslsh::format_plan(plans, n).c_str());
    // The best single method for all heads.
    struct Single {
      std::string name;
      std::vector<poslsh::HeadPlan> plans;
    };
    std::vector<Single> singles;
    singles.push_back(
        {"exact tiled", poslsh::plan_single_method(n, sigmas, settings.masking, target,
                                                   poslsh::Method::exact_tiled, {}, options)});
    singles.push_back(
        {"banded", poslsh::plan_single_method(n, sigmas, settings.masking, target,
                                              poslsh::Method::exact_banded, {}, options)});
    for (const poslsh::LshErrorModel& model : options.lsh_models) {
      singles.push_back(
          {std::string("lsh ") + poslsh::enum_name(model.sampler),
           poslsh::plan_single_method(n, sigmas, settings.masking, target,
                                      poslsh::Method::lsh_fused, model.sampler, options)});
    }
    std::printf("single methods, predicted:");
    const Single* best = nullptr;
    for (const Single& single : singles) {
      if (single.plans.empty()) {
        std::printf(" %s not possible;", single.name.c_str());
        continue;
      }
      const double seconds = poslsh::plan_seconds(single.plans);
      std::printf(" %s", single.name.c_str());
      if (single.plans.front().method == poslsh::Method::lsh_fused)
        std::printf(" (s = %ld)", static_cast<long>(single.plans.front().samples));
      std::printf(" %.2f ms;", 1e3 * seconds);
      if (best == nullptr || seconds < poslsh::plan_seconds(best->plans)) best = &single;
    }
    bool same_plan = best->plans.size() == plans.size();
    for (std::size_t h = 0; same_plan && h < plans.size(); ++h) {
      const poslsh::HeadPlan &a = plans[h], &b = best->plans[h];
      same_plan = a.method == b.method && a.band == b.band && a.samples == b.samples &&
                  (a.method != poslsh::Method::lsh_fused || a.sampler == b.sampler);
    }
    const double planned = poslsh::plan_seconds(plans);
    const double best_seconds = poslsh::plan_seconds(best->plans);
    std::printf("\nplan %.2f ms vs best single method (%s) %.2f ms: %.2fx%s\n", 1e3 * planned,
                best->name.c_str(), 1e3 * best_seconds, best_seconds / planned,
                same_plan ? " (the same plan)" : "");
    if (settings.measure) {
      Matrix out(n, heads * d), single_out(n, heads * d);
      const double seconds = time_plan(q, k, v, out, plans, heads, d, attention, settings.repeats);
      const double single_seconds =
          time_plan(q, k, v, single_out, best->plans, heads, d, attention, settings.repeats);
      std::printf("head  method        predicted   measured  meets  (single %s: measured)\n",
                  best->name.c_str());
      int meeting = 0, single_meeting = 0;
      double worst_ratio = 0.0;
      for (poslsh::Index h = 0; h < heads; ++h) {
        const Matrix exact_h = exact.middleCols(h * d, d);
        const double error = relative_error(exact_h, out.middleCols(h * d, d));
        const double single_error = relative_error(exact_h, single_out.middleCols(h * d, d));
        const poslsh::HeadPlan& p = plans[static_cast<std::size_t>(h)];
        meeting += error <= target ? 1 : 0;
        single_meeting += single_error <= target ? 1 : 0;
        if (p.predicted_error > 0.0) worst_ratio = std::max(worst_ratio, error / p.predicted_error);
        std::printf("%4ld  %-12s %10.2e %10.2e  %-5s  %.2e\n", static_cast<long>(h),
                    poslsh::enum_name(p.method), p.predicted_error, error,
                    error <= target ? "yes" : "NO", single_error);
      }
      std::printf(
          "measured: plan %.3f s, best single method %.3f s (%.2fx), exact %.3f s; heads meeting "
          "the target: plan %d of %ld, single method %d of %ld; largest measured / predicted "
          "%.3f\n",
          seconds, single_seconds, single_seconds / seconds, exact_seconds, meeting,
          static_cast<long>(heads), single_meeting, static_cast<long>(heads), worst_ratio);
    }
  }
  return 0;
}
