// poslsh: a per-head method planner. For each head (its sigma) it predicts the pairs, the time
// and the relative output error of exact tiled attention, banded attention and the fused LSH
// kernel (each sampler), and keeps the cheapest method whose predicted error meets a target.
// multihead_attention_planned then runs the plan, heads in parallel.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "poslsh/banded_attention.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/fused_attention.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/heads_view.hpp"
#include "poslsh/samplers.hpp"
#include "poslsh/tiled_attention.hpp"
#include "poslsh/types.hpp"

namespace poslsh {

/// The methods the planner chooses between.
enum class PlannedMethod {
  exact_tiled,  ///< alibi_attention_tiled: no error, every pair
  banded,       ///< alibi_attention_banded with band W
  lsh,          ///< lsh_attention_fused with s samples of a sampler
};

/// Name of a planned method ("exact_tiled", "banded", "lsh").
inline const char* planned_method_name(PlannedMethod method) {
  switch (method) {
    case PlannedMethod::exact_tiled:
      return "exact_tiled";
    case PlannedMethod::banded:
      return "banded";
    case PlannedMethod::lsh:
      return "lsh";
  }
  return "unknown";
}

/// Throughput of each kernel in (query, key) pairs per second on one thread. The defaults were
/// measured with float, d = d_v = 64, n = 4096, causal, random Q, K, V, one thread
/// (OMP_NUM_THREADS=1), best of three runs, on the 2-core development machine while it was
/// shared with other jobs (so the absolute values are low; a plan depends only on their
/// ratios): alibi_attention_tiled 4.86e7 (n (n + 1) / 2 pairs in 0.173 s); alibi_attention_banded
/// 4.29e7 and 4.86e7 at W = 256 and 1024 (n (W + 1) pairs; 1.78e7 at W = 64, where the 64-key
/// tiles waste most of their pairs); lsh_attention_fused 1.4e8 to 2.8e8 at sigma 16 and 64,
/// s = 4 and 16, 2.6e7 to 4.9e7 at sigma 4 (lsh_fused_pair_count pairs). Throughput scales with
/// d like 64 / d (a pair costs two d-long dot products), which plan_heads applies.
/// The fused kernel also spends time per (query, sample) building each tile's counts: from the
/// same runs at sigma 4, s = 64 (15 pairs per query, 2.3 ms instead of the 0.4 ms its pairs
/// predict), about 7 ns, i.e. lsh_query_samples = 1.4e8 per second.
struct PlannerThroughput {
  double exact_tiled = 4.86e7;
  double banded = 4.5e7;
  double lsh = 1.5e8;
  double lsh_query_samples = 1.4e8;
};

/// Relative output error of the fused LSH kernel modelled as coefficient * s^-exponent
/// (||T* - T~||_F / ||T*||_F), for one sampler.
struct LshErrorModel {
  Sampler sampler = Sampler::independent;
  double coefficient = 1.0;
  double exponent = 0.5;
};

/// The default LSH error models: least-squares fits of log relative error against log s
/// (s = 4..64) of output_error_vs_samples --sampler NAME (n = 2048, d = 64, sigma = 16, causal,
/// float, seed 1) on its random Q, K, V: independent 1.227 s^-0.559, antithetic
/// 1.230 s^-0.621, stratified 1.189 s^-0.605, rqmc 0.852 s^-0.511. (Smooth low-rank data falls
/// 2x lower; heavy-tailed scores decay like s^-0.37 and are not covered by these models.)
inline std::vector<LshErrorModel> default_lsh_error_models() {
  return {{Sampler::independent, 1.227, 0.559},
          {Sampler::antithetic, 1.230, 0.621},
          {Sampler::stratified, 1.189, 0.605},
          {Sampler::rqmc, 0.852, 0.511}};
}

/// Options of plan_heads.
struct PlannerOptions {
  PlannerThroughput throughput{};
  /// Head dimension (scales the throughputs by 64 / d).
  Index head_dim = 64;
  /// LSH candidates (one per sampler); empty leaves LSH out.
  std::vector<LshErrorModel> lsh_models = default_lsh_error_models();
  /// Banded relative output error = banded_factor * exp(-(W + 1) / sigma): the dropped share
  /// of the ALiBi kernel's row mass (exact for uniform scores: the bias bound) times a factor
  /// for the score fluctuations and for the difference of the dropped and kept value averages.
  /// 3 covers the measured ratios of relative error to exp(-(W + 1) / sigma), 1.2 to 2.6 on
  /// random Q, K, V (tests/test_planner.cpp: n = 600, d = 16, sigma 4 and 16).
  double banded_factor = 3.0;
  /// Largest s the planner considers for LSH (the error models were fitted on s = 4..64).
  Index max_samples = 256;
  /// Seed of the LSH hashes (head h uses stream h), for the pair counts and the run.
  std::uint64_t seed = 0;
};

/// The plan of one head.
struct HeadPlan {
  PlannedMethod method = PlannedMethod::exact_tiled;
  double sigma = 1.0;
  Index band = 0;                          ///< banded: W
  Index samples = 0;                       ///< lsh: s
  Sampler sampler = Sampler::independent;  ///< lsh: the sampler
  std::uint64_t seed = 0;                  ///< lsh: hashes sample_hashes(sigma, s, seed, stream)
  std::uint64_t stream = 0;
  double pairs = 0.0;            ///< predicted (query, key) pairs
  double seconds = 0.0;          ///< predicted single-thread time, pairs / throughput
  double predicted_error = 0.0;  ///< predicted relative output error
};

/// Pairs of exact attention over n queries: n (n + 1) / 2 causal, n^2 bidirectional.
inline double exact_pair_count(Index n, Masking masking) {
  const auto m = static_cast<double>(n);
  return masking == Masking::causal ? m * (m + 1.0) / 2.0 : m * m;
}

/// Pairs with |i - j| <= W (causal: j <= i) over n queries (about n (W + 1) causal).
inline double banded_pair_count(Index n, Index band, Masking masking) {
  const auto m = static_cast<double>(n);
  const double b = static_cast<double>(std::min<Index>(band, std::max<Index>(n - 1, 0)));
  const double below = b * (b + 1.0) / 2.0 + (m - 1.0 - b) * b;  // sum_i min(i, b)
  return masking == Masking::causal ? m + below : m + 2.0 * below;
}

/// Smallest band W with banded_factor * exp(-(W + 1) / sigma) <= target (0 if already so).
inline Index planner_band(double sigma, double target, double factor) {
  const double width = std::ceil(sigma * std::log(factor / target)) - 1.0;
  return static_cast<Index>(std::clamp(width, 0.0, 9.0e18));
}

/// Per head, the cheapest of exact tiled, banded and LSH (each model in options.lsh_models)
/// whose predicted relative output error is <= target:
///   exact_tiled  error 0, pairs exact_pair_count;
///   banded       W = planner_band(sigma, target, banded_factor) (the bias bound
///                exp(-(W+1)/sigma) times the factor), pairs banded_pair_count; left out when
///                W >= n - 1 (it is the exact attention then);
///   lsh          s = ceil((coefficient / target)^(1 / exponent)) <= max_samples, pairs
///                lsh_fused_pair_count of the hashes it would use.
/// Cost = pairs / (throughput * 64 / head_dim), plus n s / lsh_query_samples for LSH. Throws
/// std::invalid_argument naming 'n', 'sigmas' or 'target' (in (0, 1)).
inline std::vector<HeadPlan> plan_heads(Index n, const std::vector<double>& sigmas, Masking masking,
                                        double target, const PlannerOptions& options = {}) {
  constexpr const char* function = "plan_heads";
  detail::require_positive(n, function, "n");
  detail::require(!sigmas.empty(), function, "sigmas", sigmas.size(), "must not be empty");
  for (double sigma : sigmas) detail::require_hash_sigma(sigma, function);
  detail::require(target > 0.0 && target < 1.0, function, "target", target, "must be in (0, 1)");
  detail::require_positive(options.head_dim, function, "options.head_dim");
  const double scale = 64.0 / static_cast<double>(options.head_dim);
  std::vector<HeadPlan> plans;
  for (std::size_t h = 0; h < sigmas.size(); ++h) {
    const double sigma = sigmas[h];
    HeadPlan best;
    best.sigma = sigma;
    best.method = PlannedMethod::exact_tiled;
    best.pairs = exact_pair_count(n, masking);
    best.seconds = best.pairs / (options.throughput.exact_tiled * scale);
    best.predicted_error = 0.0;
    const Index band = planner_band(sigma, target, options.banded_factor);
    if (band < n - 1) {
      HeadPlan banded = best;
      banded.method = PlannedMethod::banded;
      banded.band = band;
      banded.pairs = banded_pair_count(n, band, masking);
      banded.seconds = banded.pairs / (options.throughput.banded * scale);
      banded.predicted_error =
          options.banded_factor * std::exp(-static_cast<double>(band + 1) / sigma);
      if (banded.seconds < best.seconds) best = banded;
    }
    for (const LshErrorModel& model : options.lsh_models) {
      const double needed = std::ceil(std::pow(model.coefficient / target, 1.0 / model.exponent));
      if (!(needed <= static_cast<double>(options.max_samples))) continue;
      const auto s = std::max<Index>(1, static_cast<Index>(needed));
      if (model.sampler == Sampler::poisson) continue;  // no BinHash form for the kernels
      HeadPlan lsh = best;
      lsh.method = PlannedMethod::lsh;
      lsh.samples = s;
      lsh.sampler = model.sampler;
      lsh.seed = options.seed;
      lsh.stream = static_cast<std::uint64_t>(h);
      lsh.band = 0;
      lsh.pairs = static_cast<double>(lsh_fused_pair_count(
          sample_hashes(sigma, s, lsh.seed, lsh.stream, model.sampler), n, masking));
      lsh.seconds =
          lsh.pairs / (options.throughput.lsh * scale) +
          static_cast<double>(n) * static_cast<double>(s) / options.throughput.lsh_query_samples;
      lsh.predicted_error = model.coefficient * std::pow(static_cast<double>(s), -model.exponent);
      if (lsh.seconds < best.seconds) best = lsh;
    }
    plans.push_back(best);
  }
  return plans;
}

/// Predicted single-thread seconds of a plan (the sum over heads).
inline double plan_seconds(const std::vector<HeadPlan>& plans) {
  double total = 0.0;
  for (const HeadPlan& plan : plans) total += plan.seconds;
  return total;
}

/// One line per head: head, sigma, method, parameter (W, or s and the sampler), predicted pairs
/// per query, predicted error and time; then the total.
inline std::string format_plan(const std::vector<HeadPlan>& plans, Index n) {
  std::string text =
      "head      sigma  method       parameter                pairs/q    error  "
      "time [ms]\n";
  char line[256];
  for (std::size_t h = 0; h < plans.size(); ++h) {
    const HeadPlan& p = plans[h];
    std::string parameter = "-";
    if (p.method == PlannedMethod::banded) parameter = "W = " + std::to_string(p.band);
    if (p.method == PlannedMethod::lsh)
      parameter = "s = " + std::to_string(p.samples) + " " + sampler_name(p.sampler);
    std::snprintf(line, sizeof line, "%4zu %10.4g  %-11s  %-22s %10.1f %8.2e %10.2f\n", h, p.sigma,
                  planned_method_name(p.method), parameter.c_str(),
                  p.pairs / static_cast<double>(n), p.predicted_error, 1e3 * p.seconds);
    text += line;
  }
  std::snprintf(line, sizeof line, "total predicted %.2f ms (one thread)\n",
                1e3 * plan_seconds(plans));
  text += line;
  return text;
}

/// Runs a plan: head h of q (and head h / (q.heads / k.heads) of k, v) with plans[h]'s method,
/// heads in parallel (OpenMP, one head per thread), into head h of out. LSH heads use
/// sample_hashes(sigma, s, seed, stream, sampler). Throws std::invalid_argument naming 'plans'
/// (size differs from q.heads) or what the single-head kernels name.
template <typename Scalar>
void multihead_attention_planned(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                                 HeadsView<const Scalar> v, HeadsView<Scalar> out,
                                 const std::vector<HeadPlan>& plans,
                                 const AttentionOptions& options = {}) {
  constexpr const char* function = "multihead_attention_planned";
  detail::require(static_cast<Index>(plans.size()) == q.heads, function, "plans", plans.size(),
                  "must hold one plan per query head");
  detail::require(k.heads >= 1 && q.heads % k.heads == 0 && v.heads == k.heads, function, "k.heads",
                  k.heads, "must divide q.heads and equal v.heads");
  const Index group = q.heads / k.heads;
  const std::vector<HashSet> hashes = [&] {
    std::vector<HashSet> sets(plans.size());
    for (std::size_t h = 0; h < plans.size(); ++h) {
      const HeadPlan& p = plans[h];
      if (p.method == PlannedMethod::lsh)
        sets[h] = sample_hashes(p.sigma, p.samples, p.seed, p.stream, p.sampler);
    }
    return sets;
  }();
  const auto heads = static_cast<long>(q.heads);
  // Errors thrown on a worker thread are carried out of the parallel loop.
  std::string failure;
#pragma omp parallel for schedule(dynamic, 1)
  for (long head = 0; head < heads; ++head) {
    try {
      const auto h = static_cast<Index>(head);
      const HeadPlan& p = plans[static_cast<std::size_t>(head)];
      auto out_h = out.head(h);
      switch (p.method) {
        case PlannedMethod::exact_tiled:
          alibi_attention_tiled<Scalar>(q.head(h), k.head(h / group), v.head(h / group), p.sigma,
                                        out_h, options);
          break;
        case PlannedMethod::banded:
          alibi_attention_banded<Scalar>(q.head(h), k.head(h / group), v.head(h / group), p.sigma,
                                         p.band, out_h, options);
          break;
        case PlannedMethod::lsh:
          lsh_attention_fused<Scalar>(q.head(h), k.head(h / group), v.head(h / group),
                                      hashes[static_cast<std::size_t>(head)], out_h, options);
          break;
      }
    } catch (const std::exception& error) {
#pragma omp critical(poslsh_planned_failure)
      if (failure.empty()) failure = error.what();
    }
  }
  if (!failure.empty()) throw std::invalid_argument(failure);
}

}  // namespace poslsh
