// poslsh: a per-head method planner. For each head (its sigma) it predicts the pairs, the time
// and the relative output error of exact tiled attention, banded attention and the fused LSH
// kernel (each sampler), and keeps the cheapest method whose predicted error meets a target.
// multihead_attention(q, k, v, out, plans, options) then runs the plan.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "poslsh/attention/banded.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/attention/tiled.hpp"
#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/lsh/samplers.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/methods.hpp"

namespace poslsh {

/// Throughput of each kernel in (query, key) pairs per second on one thread, at d = 64 (plan_heads
/// scales it by 64 / d: a pair costs two d-long dot products), and the fused kernel's cost per
/// (query, sample) of building its count tiles. A plan depends only on their ratios. How the
/// defaults were measured: docs/planner_calibration.md.
struct PlannerThroughput {
  double exact_tiled = 4.86e7;
  double banded = 4.5e7;
  double lsh = 1.5e8;
  double lsh_query_samples = 1.4e8;
};

/// Relative output error of the fused LSH kernel (||T* - T~||_F / ||T*||_F) for one sampler:
/// a mean fit coefficient * s^-exponent times upper_factor, the largest measured ratio of the
/// error to the mean fit (over seeds, data, sigma, d and masking), so that
///   predicted error = upper_factor * coefficient * s^-exponent
/// is an upper estimate of the measured error rather than its mean.
struct LshErrorModel {
  Sampler sampler = Sampler::independent;
  double coefficient = 1.0;
  double exponent = 0.5;
  double upper_factor = 1.0;
};

/// Predicted relative output error of the model at s samples: upper_factor * coefficient *
/// s^-exponent.
inline double lsh_predicted_error(const LshErrorModel& model, Index s) {
  return model.upper_factor * model.coefficient * std::pow(static_cast<double>(s), -model.exponent);
}

/// Smallest s >= 1 with lsh_predicted_error(model, s) <= target, as a double (it may exceed
/// any Index): ceil((upper_factor * coefficient / target)^(1 / exponent)).
inline double lsh_planner_samples(const LshErrorModel& model, double target) {
  double s = std::max(1.0, std::ceil(std::pow(model.upper_factor * model.coefficient / target,
                                              1.0 / model.exponent)));
  // The power rounds: step down while s - 1 still meets the target.
  while (s > 1.0 && s < 9.0e18 && lsh_predicted_error(model, static_cast<Index>(s) - 1) <= target)
    s -= 1.0;
  return s;
}

/// The default LSH error models, one per sampler: mean fits coefficient * s^-exponent of the
/// relative output error over s = 4..64 and upper factors that cover the largest measured
/// ratio of error to fit (docs/planner_calibration.md has the runs they come from).
inline std::vector<LshErrorModel> default_lsh_error_models() {
  return {{Sampler::independent, 1.227, 0.559, 1.542},
          {Sampler::antithetic, 1.230, 0.621, 1.824},
          {Sampler::stratified, 1.189, 0.605, 1.668},
          {Sampler::rqmc, 0.852, 0.511, 1.370},
          {Sampler::stratified_lattice, 1.537, 0.730, 2.980}};
}

/// Options of plan_heads.
struct PlannerOptions {
  PlannerThroughput throughput{};
  /// Head dimension (scales the throughputs by 64 / d).
  Index head_dim = 64;
  /// LSH candidates (one per sampler); empty leaves LSH out.
  std::vector<LshErrorModel> lsh_models = default_lsh_error_models();
  /// Banded relative output error = banded_factor * (1 + banded_small_sigma / sigma^2) *
  /// banded_dropped_share(sigma, W, masking): the dropped share of the ALiBi kernel's row mass
  /// (exact for uniform scores: the bias bound) times a factor for the score fluctuations and
  /// for the difference of the dropped and kept value averages (calibrated for sigma >= 1.1:
  /// docs/planner_calibration.md).
  double banded_factor = 3.0;
  double banded_small_sigma = 1.6;
  /// Largest s the planner considers for LSH (the error models were fitted on s = 4..64).
  Index max_samples = 256;
  /// Seed of the LSH hashes (head h uses stream h), for the pair counts and the run.
  std::uint64_t seed = 0;
  /// LSH sample search: besides the smallest s meeting the target, s_min + 1 .. s_min + window
  /// (<= max_samples) are priced too and the cheapest kept (each priced s costs one
  /// lsh_fused_pair_count). Pairs grow with s for samplers whose sets are nested in s
  /// (independent, antithetic, coupled_offsets), so 0 loses nothing for them; the others draw
  /// a new set for every s and their pairs are not monotone in s. The search stops once
  /// n s / lsh_query_samples + n / lsh throughput reaches the best time.
  Index lsh_sample_window = 0;
};

/// The plan of one head.
struct HeadPlan {
  Method method = Method::exact_tiled;
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

/// Share of the ALiBi kernel's row mass beyond the band |i - j| <= W, away from the sequence
/// ends: causal e^{-(W+1)/sigma}; bidirectional 2 e^{-(W+1)/sigma} / (1 + e^{-1/sigma}) (both
/// tails over the two-sided row mass; up to twice the causal share at small sigma).
inline double banded_dropped_share(double sigma, Index band, Masking masking) {
  const double tail = std::exp(-(static_cast<double>(band) + 1.0) / sigma);
  return masking == Masking::causal ? tail : 2.0 * tail / (1.0 + std::exp(-1.0 / sigma));
}

/// Predicted relative output error of banded attention with band W: the dropped row mass times
/// a factor for the score fluctuations that grows at small sigma, where a few dropped keys
/// carry the mass:
///   factor * (1 + small_sigma / sigma^2) * banded_dropped_share(sigma, W, masking).
inline double banded_predicted_error(double sigma, Index band, Masking masking, double factor = 3.0,
                                     double small_sigma = 1.6) {
  return factor * (1.0 + small_sigma / (sigma * sigma)) *
         banded_dropped_share(sigma, band, masking);
}

/// Smallest band W >= 0 with banded_predicted_error(sigma, W, masking, factor, small_sigma)
/// <= target.
inline Index planner_band(double sigma, double target, double factor,
                          Masking masking = Masking::causal, double small_sigma = 1.6) {
  const double scale = (masking == Masking::causal ? 1.0 : 2.0 / (1.0 + std::exp(-1.0 / sigma))) *
                       (1.0 + small_sigma / (sigma * sigma));
  const double width = std::ceil(sigma * std::log(factor * scale / target)) - 1.0;
  auto band = static_cast<Index>(std::clamp(width, 0.0, 9.0e18));
  // The logarithm rounds: settle on the smallest W that meets the target.
  while (band < Index{9000000000000000000} &&
         banded_predicted_error(sigma, band, masking, factor, small_sigma) > target)
    ++band;
  while (band > 0 &&
         banded_predicted_error(sigma, band - 1, masking, factor, small_sigma) <= target)
    --band;
  return band;
}

namespace detail {

inline void require_planner_arguments(const char* function, Index n,
                                      const std::vector<double>& sigmas, double target,
                                      const PlannerOptions& options) {
  require_positive(n, function, "n");
  require(!sigmas.empty(), function, "sigmas", sigmas.size(), "must not be empty");
  for (double sigma : sigmas) require_hash_sigma(sigma, function);
  require(target > 0.0 && target < 1.0, function, "target", target, "must be in (0, 1)");
  require_positive(options.head_dim, function, "options.head_dim");
  require_positive(options.max_samples, function, "options.max_samples");
  require(options.lsh_sample_window >= 0, function, "options.lsh_sample_window",
          options.lsh_sample_window, "must be >= 0");
  require(std::isfinite(options.banded_factor) && options.banded_factor > 0.0, function,
          "options.banded_factor", options.banded_factor, "must be finite and > 0");
  require(std::isfinite(options.banded_small_sigma) && options.banded_small_sigma >= 0.0, function,
          "options.banded_small_sigma", options.banded_small_sigma, "must be finite and >= 0");
  for (const LshErrorModel& model : options.lsh_models) {
    require(std::isfinite(model.coefficient) && model.coefficient > 0.0 &&
                std::isfinite(model.exponent) && model.exponent > 0.0 &&
                std::isfinite(model.upper_factor) && model.upper_factor > 0.0,
            function, "options.lsh_models", model.coefficient,
            "need finite coefficient, exponent and upper_factor > 0");
  }
}

}  // namespace detail

/// The candidate plans of head `head` (sigma) whose predicted relative output error is
/// <= target, in the order exact tiled, banded, then options.lsh_models:
///   exact_tiled  error 0, pairs exact_pair_count;
///   banded       W = planner_band(sigma, target, banded_factor, masking,
///                banded_small_sigma) (banded_predicted_error: the kernel's dropped row
///                mass times the factor), pairs
///                banded_pair_count; left out when
///                W >= n - 1 (it is the exact attention then);
///   lsh          s_min = lsh_planner_samples(model, target) <= max_samples (the smallest s
///                whose upper estimate upper_factor c s^-a meets the target), pairs
///                lsh_fused_pair_count of the hashes sample_hashes(sigma, s, seed, head,
///                sampler) it would use; with options.lsh_sample_window > 0 the cheapest of
///                s_min .. s_min + window (<= max_samples; the first on ties).
///                Sampler::poisson is left out (no BinHash form).
/// Seconds = pairs / (throughput * 64 / head_dim), plus n s / lsh_query_samples for LSH.
/// Throws std::invalid_argument naming 'n', 'sigmas', 'target' (in (0, 1)) or the option.
inline std::vector<HeadPlan> plan_head_candidates(Index n, double sigma, std::size_t head,
                                                  Masking masking, double target,
                                                  const PlannerOptions& options = {}) {
  detail::require_planner_arguments("plan_head_candidates", n, {sigma}, target, options);
  const double scale = 64.0 / static_cast<double>(options.head_dim);
  std::vector<HeadPlan> candidates;
  HeadPlan exact;
  exact.sigma = sigma;
  exact.method = Method::exact_tiled;
  exact.pairs = exact_pair_count(n, masking);
  exact.seconds = exact.pairs / (options.throughput.exact_tiled * scale);
  exact.predicted_error = 0.0;
  candidates.push_back(exact);
  const Index band =
      planner_band(sigma, target, options.banded_factor, masking, options.banded_small_sigma);
  if (band < n - 1) {
    HeadPlan banded = exact;
    banded.method = Method::exact_banded;
    banded.band = band;
    banded.pairs = banded_pair_count(n, band, masking);
    banded.seconds = banded.pairs / (options.throughput.banded * scale);
    banded.predicted_error = banded_predicted_error(sigma, band, masking, options.banded_factor,
                                                    options.banded_small_sigma);
    candidates.push_back(banded);
  }
  for (const LshErrorModel& model : options.lsh_models) {
    if (model.sampler == Sampler::poisson) continue;  // no BinHash form for the fused kernel
    const double needed = lsh_planner_samples(model, target);
    if (!(needed <= static_cast<double>(options.max_samples))) continue;
    const auto s_min = static_cast<Index>(needed);
    const auto price = [&](Index s) {
      HeadPlan lsh = exact;
      lsh.method = Method::lsh_fused;
      lsh.samples = s;
      lsh.sampler = model.sampler;
      lsh.seed = options.seed;
      lsh.stream = static_cast<std::uint64_t>(head);
      lsh.pairs = static_cast<double>(lsh_fused_pair_count(
          sample_hashes(sigma, s, lsh.seed, lsh.stream, model.sampler), n, masking));
      lsh.seconds =
          lsh.pairs / (options.throughput.lsh * scale) +
          static_cast<double>(n) * static_cast<double>(s) / options.throughput.lsh_query_samples;
      lsh.predicted_error = lsh_predicted_error(model, s);
      return lsh;
    };
    HeadPlan best = price(s_min);
    const Index last = s_min + std::min(options.lsh_sample_window, options.max_samples - s_min);
    for (Index s = s_min + 1; s <= last; ++s) {
      // At least n pairs (c_ii = s > 0): no larger s can be cheaper once this bound is reached.
      const double floor =
          static_cast<double>(n) / (options.throughput.lsh * scale) +
          static_cast<double>(n) * static_cast<double>(s) / options.throughput.lsh_query_samples;
      if (floor >= best.seconds) break;
      const HeadPlan priced = price(s);
      if (priced.seconds < best.seconds) best = priced;
    }
    candidates.push_back(best);
  }
  return candidates;
}

/// Per head, the cheapest (least predicted seconds; the first on ties) of its
/// plan_head_candidates: the cheapest method whose predicted relative output error is
/// <= target. Throws std::invalid_argument naming 'n', 'sigmas', 'target' (in (0, 1)) or the
/// option ('options.head_dim', 'options.max_samples', 'options.banded_factor',
/// 'options.lsh_models').
inline std::vector<HeadPlan> plan_heads(Index n, const std::vector<double>& sigmas, Masking masking,
                                        double target, const PlannerOptions& options = {}) {
  detail::require_planner_arguments("plan_heads", n, sigmas, target, options);
  std::vector<HeadPlan> plans;
  for (std::size_t h = 0; h < sigmas.size(); ++h) {
    const std::vector<HeadPlan> candidates =
        plan_head_candidates(n, sigmas[h], h, masking, target, options);
    const auto best = std::min_element(
        candidates.begin(), candidates.end(),
        [](const HeadPlan& a, const HeadPlan& b) { return a.seconds < b.seconds; });
    plans.push_back(*best);
  }
  return plans;
}

/// The plan that gives every head the same method (and, for LSH, the sampler `sampler`): each
/// head's candidate of that method from plan_head_candidates. Empty if some head has no such
/// candidate (banded with W >= n - 1, LSH needing s > max_samples). For comparing a plan with
/// the best single method. Throws as plan_heads, and names 'method' when it is not one the
/// planner plans (exact_tiled, exact_banded, lsh_fused).
inline std::vector<HeadPlan> plan_single_method(Index n, const std::vector<double>& sigmas,
                                                Masking masking, double target, Method method,
                                                Sampler sampler = Sampler::independent,
                                                const PlannerOptions& options = {}) {
  detail::require_planner_arguments("plan_single_method", n, sigmas, target, options);
  detail::require(method_runs_by_query_tiles(method), "plan_single_method", "method",
                  enum_name(method), "must be exact_tiled, exact_banded or lsh_fused");
  std::vector<HeadPlan> plans;
  for (std::size_t h = 0; h < sigmas.size(); ++h) {
    const std::vector<HeadPlan> candidates =
        plan_head_candidates(n, sigmas[h], h, masking, target, options);
    const auto match = std::find_if(candidates.begin(), candidates.end(), [&](const HeadPlan& p) {
      return p.method == method && (method != Method::lsh_fused || p.sampler == sampler);
    });
    if (match == candidates.end()) return {};
    plans.push_back(*match);
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
    if (p.method == Method::exact_banded) parameter = "W = " + std::to_string(p.band);
    if (p.method == Method::lsh_fused)
      parameter = "s = " + std::to_string(p.samples) + " " + enum_name(p.sampler);
    std::snprintf(line, sizeof line, "%4zu %10.4g  %-11s  %-22s %10.1f %8.2e %10.2f\n", h, p.sigma,
                  enum_name(p.method), parameter.c_str(), p.pairs / static_cast<double>(n),
                  p.predicted_error, 1e3 * p.seconds);
    text += line;
  }
  std::snprintf(line, sizeof line, "total predicted %.2f ms (one thread)\n",
                1e3 * plan_seconds(plans));
  text += line;
  return text;
}

namespace detail {

/// The method of every head of a plan (exact_tiled, exact_banded with its W, lsh_fused with
/// the hashes sample_hashes(sigma, s, seed, stream, sampler)). Checks one plan per query head,
/// each with a valid sigma, W >= 0 for exact_banded and s >= 1 for lsh_fused.
inline std::vector<HeadMethod> planned_head_methods(const char* function, Index heads,
                                                    const std::vector<HeadPlan>& plans) {
  require(static_cast<Index>(plans.size()) == heads, function, "plans", plans.size(),
          [&] { return "must hold one plan per query head (" + std::to_string(heads) + ")"; });
  std::vector<HeadMethod> methods(plans.size());
  for (std::size_t h = 0; h < plans.size(); ++h) {
    const HeadPlan& p = plans[h];
    require(method_runs_by_query_tiles(p.method), function, "plans", enum_name(p.method),
            "a plan's method must be exact_tiled, exact_banded or lsh_fused");
    require_sigma(p.sigma, function, "plans");
    methods[h].method = p.method;
    methods[h].sigma = p.sigma;
    if (p.method == Method::exact_banded) {
      require_size(p.band, function, "plans");
      methods[h].band = p.band;
    }
    if (p.method == Method::lsh_fused)
      methods[h].hashes = sample_hashes(p.sigma, p.samples, p.seed, p.stream, p.sampler);
  }
  return methods;
}

}  // namespace detail

/// multihead_attention with a plan as its method: query head h (K/V head h / (H_q / H_kv))
/// runs plans[h] (exact tiled, banded with its W, or fused LSH with the hashes
/// sample_hashes(sigma, s, seed, stream, sampler)), in the one parallel loop over (query tile,
/// head) jobs of multihead_attention: bitwise the same for any thread count, and each head
/// bitwise its single-head kernel. options: masking, scale, query offset as multihead_attention.
/// Half-precision views (Eigen::bfloat16, Eigen::half) are computed in float, as
/// multihead_attention's.
/// \throws std::invalid_argument naming 'plans' (one per query head, each valid), a bad view
///   or option, before any head runs.
template <typename Scalar>
void multihead_attention(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                         HeadsView<const Scalar> v, HeadsView<Scalar> out,
                         const std::vector<HeadPlan>& plans, const AttentionOptions& options = {}) {
  constexpr const char* function = "multihead_attention";
  detail::one_sequence_forward<compute_scalar_t<Scalar, Scalar, Scalar>>(
      function, q, k, v, out, options,
      [&] { return detail::planned_head_methods(function, q.heads, plans); });
}

}  // namespace poslsh
