// poslsh plan_heads: the per-head method planner (planner.hpp) on model shapes, its predicted
// time against the best single method for all heads, and optionally measured.
//   plan_heads [--n N] [--heads H] [--d D] [--causal | --bidirectional] [--targets LIST]
//              [--measure] [--seed SEED]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <poslsh/multihead.hpp>
#include <poslsh/planner.hpp>
#include <poslsh/slopes.hpp>
#include <poslsh/tiled_attention.hpp>
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
  --measure         also run the plan and exact attention on random Q, K, V (float) and
                    report the measured time and each head's relative error
  --seed SEED       hash and data seed (default 1)
  --help            this text
)";

struct Settings {
  poslsh::Index n = 16384;
  int heads = 8;
  poslsh::Index d = 64;
  poslsh::Masking masking = poslsh::Masking::causal;
  std::vector<double> targets{0.1, 0.01, 0.001};
  bool measure = false;
  std::uint64_t seed = 1;
};

Settings parse(int argc, char** argv) {
  Settings settings;
  for (cli::Args args(program, usage, argc, argv); args.next();) {
    if (!(args.number("--n", settings.n) || args.number("--heads", settings.heads) ||
          args.number("--d", settings.d) ||
          args.set("--causal", settings.masking, poslsh::Masking::causal) ||
          args.set("--bidirectional", settings.masking, poslsh::Masking::bidirectional) ||
          args.positive_list("--targets", settings.targets) ||
          args.set("--measure", settings.measure, true) || args.number("--seed", settings.seed))) {
      args.unknown();
    }
  }
  if (settings.n < 2) cli::fail(program, "--n must be >= 2");
  if (settings.heads < 1) cli::fail(program, "--heads must be >= 1");
  if (settings.d < 1) cli::fail(program, "--d must be >= 1");
  return settings;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const Settings settings = parse(argc, argv);
  const std::vector<double> sigmas = poslsh::alibi_sigmas(settings.heads);
  const poslsh::Index n = settings.n, d = settings.d, heads = settings.heads;
  std::printf("Planner: n = %ld, %d heads, d = %ld, %s, sigmas alibi_sigmas(%d)\n",
              static_cast<long>(n), settings.heads, static_cast<long>(d),
              settings.masking == poslsh::Masking::causal ? "causal" : "bidirectional",
              settings.heads);
  poslsh::PlannerOptions options;
  options.head_dim = d;
  options.seed = settings.seed;
  const double scale = 64.0 / static_cast<double>(d);

  poslsh::RowMatrix<float> q, k, v, exact;
  double exact_seconds = 0.0;
  poslsh::AttentionOptions attention;
  attention.masking = settings.masking;
  if (settings.measure) {
    std::mt19937_64 engine(settings.seed);
    std::normal_distribution<float> normal;
    q.resize(n, heads * d);
    k.resize(n, heads * d);
    v.resize(n, heads * d);
    for (poslsh::RowMatrix<float>* m : {&q, &k, &v})
      for (poslsh::Index i = 0; i < m->size(); ++i) m->data()[i] = normal(engine);
    exact.resize(n, heads * d);
    std::vector<poslsh::HeadPlan> all_exact(static_cast<std::size_t>(heads));
    for (poslsh::Index h = 0; h < heads; ++h)
      all_exact[static_cast<std::size_t>(h)].sigma = sigmas[static_cast<std::size_t>(h)];
    const auto start = std::chrono::steady_clock::now();
    poslsh::multihead_attention_planned<float>(
        poslsh::interleaved_heads<const float>(q.data(), n, heads, d),
        poslsh::interleaved_heads<const float>(k.data(), n, heads, d),
        poslsh::interleaved_heads<const float>(v.data(), n, heads, d),
        poslsh::interleaved_heads(exact.data(), n, heads, d), all_exact, attention);
    exact_seconds = seconds_since(start);
    std::printf("measured exact tiled, all heads, OpenMP over heads: %.3f s\n", exact_seconds);
  }

  for (double target : settings.targets) {
    const std::vector<poslsh::HeadPlan> plans =
        poslsh::plan_heads(n, sigmas, settings.masking, target, options);
    std::printf("\ntarget relative output error %g\n%s", target,
                poslsh::format_plan(plans, n).c_str());
    // The best single method for all heads.
    double all_exact = 0.0, all_banded = 0.0;
    for (double sigma : sigmas) {
      all_exact +=
          poslsh::exact_pair_count(n, settings.masking) / (options.throughput.exact_tiled * scale);
      const poslsh::Index band = poslsh::planner_band(sigma, target, options.banded_factor);
      all_banded += poslsh::banded_pair_count(n, band, settings.masking) /
                    (options.throughput.banded * scale);
    }
    std::printf("single methods, predicted: exact tiled %.2f ms, banded %.2f ms", 1e3 * all_exact,
                1e3 * all_banded);
    double best = std::min(all_exact, all_banded);
    const char* best_name = all_exact <= all_banded ? "exact tiled" : "banded";
    for (const poslsh::LshErrorModel& model : options.lsh_models) {
      const double needed = std::ceil(std::pow(model.coefficient / target, 1.0 / model.exponent));
      if (!(needed <= static_cast<double>(options.max_samples))) {
        std::printf(", lsh %s needs s = %.0f (> %ld)", poslsh::sampler_name(model.sampler), needed,
                    static_cast<long>(options.max_samples));
        continue;
      }
      double total = 0.0;
      for (std::size_t h = 0; h < sigmas.size(); ++h) {
        total += static_cast<double>(poslsh::lsh_fused_pair_count(
                     poslsh::sample_hashes(sigmas[h], static_cast<poslsh::Index>(needed),
                                           settings.seed, h, model.sampler),
                     n, settings.masking)) /
                     (options.throughput.lsh * scale) +
                 static_cast<double>(n) * needed / options.throughput.lsh_query_samples;
      }
      std::printf(", lsh %s (s = %.0f) %.2f ms", poslsh::sampler_name(model.sampler), needed,
                  1e3 * total);
      if (total < best) {
        best = total;
        best_name = poslsh::sampler_name(model.sampler);
      }
    }
    const double planned = poslsh::plan_seconds(plans);
    std::printf("\nplan %.2f ms vs best single method (%s) %.2f ms: %.2fx\n", 1e3 * planned,
                best_name, 1e3 * best, best / planned);
    if (settings.measure) {
      poslsh::RowMatrix<float> out(n, heads * d);
      const auto start = std::chrono::steady_clock::now();
      poslsh::multihead_attention_planned<float>(
          poslsh::interleaved_heads<const float>(q.data(), n, heads, d),
          poslsh::interleaved_heads<const float>(k.data(), n, heads, d),
          poslsh::interleaved_heads<const float>(v.data(), n, heads, d),
          poslsh::interleaved_heads(out.data(), n, heads, d), plans, attention);
      const double seconds = seconds_since(start);
      int meeting = 0;
      std::printf("measured: plan %.3f s (exact %.3f s); relative error per head:", seconds,
                  exact_seconds);
      for (poslsh::Index h = 0; h < heads; ++h) {
        const double error =
            (exact.middleCols(h * d, d) - out.middleCols(h * d, d)).cast<double>().norm() /
            exact.middleCols(h * d, d).cast<double>().norm();
        std::printf(" %.2e", error);
        meeting += error <= target ? 1 : 0;
      }
      std::printf("\nheads meeting the target: %d of %ld\n", meeting, static_cast<long>(heads));
    }
  }
  return 0;
}
