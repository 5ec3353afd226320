// The per-head planner: its choice against a brute-force search over every method and
// parameter, its banded and LSH error models against measured output errors (and the LSH
// model against the paper's bound), and multihead_attention with a plan against the single-head
// kernels.
#include <cmath>
#include <poslsh/analysis.hpp>
#include <poslsh/attention/banded.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/multihead/planner.hpp>

#include "test_support.hpp"

using poslsh::HeadPlan;

namespace {

double relative_error(const RowMatrix<float>& exact, const RowMatrix<float>& approx) {
  return (exact - approx).cast<double>().norm() / exact.cast<double>().norm();
}

// The ALiBi kernel's row mass beyond the band W, for W = 0 .. max_band, summed term by term for
// a row far from the sequence ends: sum_{t > W} e^{-t/sigma} over sum_{t >= 0} e^{-t/sigma}
// (causal), both tails over both sides (bidirectional).
std::vector<double> planner_shares(double sigma, Index max_band, Masking masking) {
  std::vector<double> terms;
  double total = 0.0;
  for (Index t = 0; t < 200000; ++t) {
    const double sides = masking == Masking::causal || t == 0 ? 1.0 : 2.0;
    terms.push_back(sides * std::exp(-static_cast<double>(t) / sigma));
    total += terms.back();
  }
  // Dropped mass summed from the smallest terms up (no cancellation for tiny shares).
  std::vector<double> shares(static_cast<std::size_t>(max_band) + 1);
  double dropped = 0.0;
  for (auto t = static_cast<Index>(terms.size()) - 1; t >= 1; --t) {
    dropped += terms[static_cast<std::size_t>(t)];
    if (t - 1 <= max_band) shares[static_cast<std::size_t>(t - 1)] = dropped / total;
  }
  return shares;
}

double planner_share(double sigma, Index band, Masking masking) {
  return planner_shares(sigma, band, masking).back();
}

}  // namespace

TEST_CASE("plan_heads picks the cheapest method that meets the target", "[planner]") {
  poslsh::PlannerOptions options;
  options.max_samples = 64;
  options.lsh_models = {{poslsh::Sampler::independent, 0.9, 0.5, 1.3},
                        {poslsh::Sampler::antithetic, 0.8, 0.6, 1.1},
                        {poslsh::Sampler::stratified_lattice, 0.7, 0.73, 1.2}};
  // stratified_lattice draws a new set for every s (its pairs are not monotone in s): the
  // planner prices every s up to max_samples, as the brute force does.
  options.lsh_sample_window = options.max_samples;
  int lattice_plans = 0;  // heads planned with stratified_lattice (the search covers it)
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (Index n : {Index{64}, Index{400}}) {
      const std::vector<double> sigmas{0.5, 4.0, 30.0, 1000.0};
      for (double target : {0.3, 0.12, 0.05, 1e-3}) {
        const std::vector<HeadPlan> plans = poslsh::plan_heads(n, sigmas, masking, target, options);
        REQUIRE(plans.size() == sigmas.size());
        for (std::size_t h = 0; h < sigmas.size(); ++h) {
          const double sigma = sigmas[h];
          // Brute force: every method and parameter, keeping the cheapest that meets the target.
          double best = poslsh::exact_pair_count(n, masking) / options.throughput.exact_tiled;
          Method method = Method::exact_tiled;
          Index parameter = 0;
          const std::vector<double> shares = planner_shares(sigma, n, masking);
          for (Index w = 0; w + 1 < n; ++w) {
            const double error = options.banded_factor *
                                 (1.0 + options.banded_small_sigma / (sigma * sigma)) *
                                 shares[static_cast<std::size_t>(w)];
            const double cost =
                poslsh::banded_pair_count(n, w, masking) / options.throughput.banded;
            if (error <= target && cost < best) {
              best = cost;
              method = Method::exact_banded;
              parameter = w;
            }
          }
          poslsh::Sampler sampler = poslsh::Sampler::independent;
          for (const poslsh::LshErrorModel& model : options.lsh_models) {
            for (Index s = 1; s <= options.max_samples; ++s) {
              const double error =
                  model.upper_factor * model.coefficient * std::pow(double(s), -model.exponent);
              if (error > target) continue;
              const double pairs = static_cast<double>(poslsh::lsh_fused_pair_count(
                  poslsh::sample_hashes(sigma, s, 0, h, model.sampler), n, masking));
              const double cost = pairs / options.throughput.lsh +
                                  double(n) * double(s) / options.throughput.lsh_query_samples;
              if (cost < best) {
                best = cost;
                method = Method::lsh_fused;
                parameter = s;
                sampler = model.sampler;
              }
            }
          }
          INFO("n " << n << ", sigma " << sigma << ", target " << target << ": planned "
                    << poslsh::enum_name(plans[h].method) << " " << plans[h].seconds
                    << " s, brute force " << poslsh::enum_name(method) << " " << parameter << " "
                    << best << " s");
          CHECK(plans[h].method == method);
          CHECK(plans[h].seconds == Approx(best).epsilon(1e-12));
          CHECK(plans[h].predicted_error <= target);
          if (method == Method::exact_banded) CHECK(plans[h].band == parameter);
          if (method == Method::lsh_fused) {
            CHECK(plans[h].samples == parameter);
            CHECK(plans[h].sampler == sampler);
          }
          lattice_plans += plans[h].method == Method::lsh_fused &&
                                   plans[h].sampler == poslsh::Sampler::stratified_lattice
                               ? 1
                               : 0;
        }
        // Every head's banded candidate: the smallest W meeting the target.
        const std::vector<HeadPlan> banded = poslsh::plan_single_method(
            n, sigmas, masking, target, Method::exact_banded, {}, options);
        bool all_banded = true;
        for (std::size_t h = 0; h < sigmas.size(); ++h) {
          const std::vector<double> shares = planner_shares(sigmas[h], n, masking);
          Index w = 0;
          while (w < n && options.banded_factor *
                                  (1.0 + options.banded_small_sigma / (sigmas[h] * sigmas[h])) *
                                  shares[static_cast<std::size_t>(w)] >
                              target)
            ++w;
          all_banded = all_banded && w + 1 < n;
          if (h < banded.size()) {
            CHECK(banded[h].method == Method::exact_banded);
            CHECK(banded[h].band == w);
          }
        }
        CHECK(banded.size() == (all_banded ? sigmas.size() : 0));
      }
    }
  }
  CHECK(lattice_plans > 0);
}

TEST_CASE("the LSH candidate: the smallest s, or the cheapest s in the window", "[planner]") {
  const Index n = 400;
  const double sigma = 16.0, target = 0.15;
  poslsh::PlannerOptions options;
  options.lsh_models = {{poslsh::Sampler::stratified_lattice, 1.537, 0.730, 2.980}};
  const auto s_min = static_cast<Index>(poslsh::lsh_planner_samples(options.lsh_models[0], target));
  REQUIRE(s_min < options.max_samples);
  const auto price = [&](Index s) {
    const double pairs = static_cast<double>(poslsh::lsh_fused_pair_count(
        poslsh::sample_hashes(sigma, s, 0, 1, poslsh::Sampler::stratified_lattice), n,
        Masking::causal));
    return pairs / options.throughput.lsh +
           double(n) * double(s) / options.throughput.lsh_query_samples;
  };
  const HeadPlan smallest =
      poslsh::plan_head_candidates(n, sigma, 1, Masking::causal, target, options).back();
  CHECK(smallest.samples == s_min);
  CHECK(smallest.seconds == Approx(price(s_min)).epsilon(1e-12));
  for (Index window : {Index{1}, Index{7}, Index{40}, Index{1000}}) {
    options.lsh_sample_window = window;
    const HeadPlan searched =
        poslsh::plan_head_candidates(n, sigma, 1, Masking::causal, target, options).back();
    double best = price(s_min);
    Index best_s = s_min;
    for (Index s = s_min + 1; s <= std::min(s_min + window, options.max_samples); ++s) {
      if (price(s) < best) {
        best = price(s);
        best_s = s;
      }
    }
    INFO("window " << window << ": planned s " << searched.samples << ", search " << best_s);
    CHECK(searched.samples == best_s);
    CHECK(searched.seconds == Approx(best).epsilon(1e-12));
    CHECK(searched.predicted_error <= target);
  }
}

TEST_CASE("lsh_planner_samples is the smallest s whose upper estimate meets the target",
          "[planner]") {
  for (const poslsh::LshErrorModel& model : poslsh::default_lsh_error_models()) {
    for (double target : {0.5, 0.2, 0.1, 0.05, 0.01}) {
      const double s = poslsh::lsh_planner_samples(model, target);
      REQUIRE(s >= 1.0);
      const auto samples = static_cast<Index>(s);
      const double at = model.upper_factor * model.coefficient * std::pow(s, -model.exponent);
      CHECK(at <= target);
      CHECK(poslsh::lsh_predicted_error(model, samples) == Approx(at).epsilon(1e-12));
      if (samples > 1) {
        CHECK(model.upper_factor * model.coefficient * std::pow(s - 1.0, -model.exponent) > target);
      }
    }
  }
}

TEST_CASE("the banded error model bounds the measured output error", "[planner]") {
  const poslsh::PlannerOptions options;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {1.19, 2.0, 4.0, 16.0}) {
      for (Index band : {Index{0}, Index{3}, Index{40}}) {
        INFO(poslsh_test::masking_name(masking) << ", sigma " << sigma << ", W " << band);
        CHECK(poslsh::banded_dropped_share(sigma, band, masking) ==
              Approx(planner_share(sigma, band, masking)).epsilon(1e-9));
      }
    }
  }
  const Index n = 600, d = 16;
  for (std::uint64_t seed = 1; seed < 4; ++seed) {
    const RowMatrix<float> q = random_matrix<float>(n, d, 3 * seed);
    const RowMatrix<float> k = random_matrix<float>(n, d, 3 * seed + 1);
    const RowMatrix<float> v = random_matrix<float>(n, d, 3 * seed + 2);
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (double sigma : {1.19, 2.0, 4.0, 16.0}) {
        const RowMatrix<float> exact = poslsh::alibi_attention_tiled<float>(
            q, k, v, sigma, poslsh_test::with_masking(masking));
        for (double target : {0.1, 0.01, 0.001}) {
          const Index band = poslsh::planner_band(sigma, target, options.banded_factor, masking,
                                                  options.banded_small_sigma);
          const double predicted = poslsh::banded_predicted_error(
              sigma, band, masking, options.banded_factor, options.banded_small_sigma);
          const double measured =
              relative_error(exact, poslsh::alibi_attention_banded<float>(
                                        q, k, v, sigma, band, poslsh_test::with_masking(masking)));
          INFO(poslsh_test::masking_name(masking)
               << ", seed " << seed << ", sigma " << sigma << ", W " << band << ": predicted "
               << predicted << ", measured " << measured);
          CHECK(predicted <= target);
          if (band > 0) {
            CHECK(poslsh::banded_predicted_error(sigma, band - 1, masking, options.banded_factor,
                                                 options.banded_small_sigma) > target);
          }
          CHECK(measured <= predicted);
          CHECK(measured >= predicted / 20.0);  // the model is not vacuous
        }
      }
    }
  }
}

TEST_CASE("the LSH mean fit against measured errors and the paper's bound", "[planner]") {
  const Index n = 512, d = 16;
  const double sigma = 8.0;
  const auto [q, k, v] = random_qkv<float>(n, d, d, 4);
  const RowMatrix<float> exact = poslsh::alibi_attention_tiled<float>(q, k, v, sigma);
  for (const poslsh::LshErrorModel& model : poslsh::default_lsh_error_models()) {
    for (Index s : {Index{4}, Index{32}}) {
      const double mean_fit = model.coefficient * std::pow(double(s), -model.exponent);
      // The mean over 3 seeds of the measured relative error.
      double measured = 0.0;
      for (std::uint64_t seed = 0; seed < 3; ++seed) {
        const poslsh::HashSet hashes = poslsh::sample_hashes(sigma, s, seed, 0, model.sampler);
        measured += relative_error(exact, poslsh::lsh_attention_fused<float>(q, k, v, hashes)) / 3;
      }
      // The paper's bound on E||L* - M~||_2 relative to ||L*||_2: the upper estimate must be
      // below it (the bound is loose) and the measured mean must match the mean fit within 2x.
      const double bound = poslsh::expectation_bound(n, sigma, s) /
                           poslsh::alibi_kernel_norm(n, sigma, Masking::causal);
      const double upper = poslsh::lsh_predicted_error(model, s);
      INFO(poslsh::enum_name(model.sampler)
           << ", s " << s << ": mean fit " << mean_fit << ", upper " << upper << ", measured "
           << measured << ", paper bound " << bound);
      CHECK(measured <= 2.0 * mean_fit);
      CHECK(measured >= 0.5 * mean_fit);
      CHECK(upper == Approx(model.upper_factor * mean_fit).epsilon(1e-12));
      CHECK(upper <= bound);
    }
  }
}

TEST_CASE("the LSH upper estimate bounds every measured error at the planned s", "[planner]") {
  // Each seed separately (data and hashes), not their mean: the estimate is an upper one.
  const Index n = 512, d = 16;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (std::uint64_t seed = 10; seed < 14; ++seed) {
      const RowMatrix<float> q = random_matrix<float>(n, d, 3 * seed);
      const RowMatrix<float> k = random_matrix<float>(n, d, 3 * seed + 1);
      const RowMatrix<float> v = random_matrix<float>(n, d, 3 * seed + 2);
      for (double sigma : {4.0, 16.0, 64.0}) {
        const RowMatrix<float> exact = poslsh::alibi_attention_tiled<float>(
            q, k, v, sigma, poslsh_test::with_masking(masking));
        for (const poslsh::LshErrorModel& model : poslsh::default_lsh_error_models()) {
          for (double target : {0.2, 0.1}) {
            const auto s = static_cast<Index>(poslsh::lsh_planner_samples(model, target));
            const double predicted = poslsh::lsh_predicted_error(model, s);
            const double measured = relative_error(
                exact, poslsh::lsh_attention_fused<float>(
                           q, k, v, poslsh::sample_hashes(sigma, s, seed, 0, model.sampler),
                           poslsh_test::with_masking(masking)));
            INFO(poslsh_test::masking_name(masking)
                 << ", seed " << seed << ", sigma " << sigma << ", "
                 << poslsh::enum_name(model.sampler) << ", s " << s << ": predicted " << predicted
                 << ", measured " << measured);
            CHECK(predicted <= target);
            CHECK(measured <= predicted);
            CHECK(measured >= predicted / 10.0);  // the estimate is not vacuous
          }
        }
      }
    }
  }
}

TEST_CASE("every head of a plan meets its predicted error", "[planner]") {
  // Planned heads run against exact attention per head, for the default cost model and for
  // one where exact and banded are made slow so that the LSH candidates are chosen.
  const Index n = 512, d = 16, heads = 8;
  const std::vector<double> sigmas = poslsh::alibi_sigmas(static_cast<int>(heads));
  poslsh::PlannerOptions slow_exact;
  slow_exact.throughput.exact_tiled = 1e3;
  slow_exact.throughput.banded = 1e3;
  for (const poslsh::PlannerOptions& options : {poslsh::PlannerOptions{}, slow_exact}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (std::uint64_t seed = 20; seed < 23; ++seed) {
        const RowMatrix<float> q = random_matrix<float>(n, heads * d, 3 * seed);
        const RowMatrix<float> k = random_matrix<float>(n, heads * d, 3 * seed + 1);
        const RowMatrix<float> v = random_matrix<float>(n, heads * d, 3 * seed + 2);
        poslsh::PlannerOptions seeded = options;
        seeded.seed = seed;
        seeded.head_dim = d;
        for (double target : {0.1, 0.01}) {
          const std::vector<HeadPlan> plans =
              poslsh::plan_heads(n, sigmas, masking, target, seeded);
          RowMatrix<float> out(n, heads * d);
          poslsh::multihead_attention<float>(
              poslsh::interleaved_heads<const float>(q.data(), n, heads, d),
              poslsh::interleaved_heads<const float>(k.data(), n, heads, d),
              poslsh::interleaved_heads<const float>(v.data(), n, heads, d),
              poslsh::interleaved_heads(out.data(), n, heads, d), plans,
              poslsh_test::with_masking(masking));
          int lsh_heads = 0;
          for (Index h = 0; h < heads; ++h) {
            const HeadPlan& p = plans[static_cast<std::size_t>(h)];
            lsh_heads += p.method == Method::lsh_fused ? 1 : 0;
            const RowMatrix<float> exact = poslsh::alibi_attention_tiled<float>(
                q.middleCols(h * d, d), k.middleCols(h * d, d), v.middleCols(h * d, d), p.sigma,
                poslsh_test::with_masking(masking));
            const double measured = relative_error(exact, out.middleCols(h * d, d));
            INFO(poslsh_test::masking_name(masking)
                 << ", seed " << seed << ", target " << target << ", head " << h << " (sigma "
                 << p.sigma << ") " << poslsh::enum_name(p.method) << ": predicted "
                 << p.predicted_error << ", measured " << measured);
            CHECK(p.predicted_error <= target);
            CHECK(measured <= p.predicted_error);
          }
          // The slow cost model plans LSH wherever an s <= 256 meets the target (1e-1).
          if (&options == &slow_exact && target == 0.1) CHECK(lsh_heads > 0);
        }
      }
    }
  }
}

TEST_CASE("the planner names bad arguments", "[planner]") {
  const std::vector<double> sigmas{4.0, 16.0};
  require_invalid_argument([&] { poslsh::plan_heads(0, sigmas, Masking::causal, 0.1); }, "n");
  require_invalid_argument([&] { poslsh::plan_heads(100, {}, Masking::causal, 0.1); }, "sigmas");
  require_invalid_argument(
      [&] {
        poslsh::plan_heads(100, {4.0, 0.0}, Masking::causal, 0.1);
      },
      "sigma");
  for (double target : {0.0, -0.1, 1.0, 1.5, std::nan("")}) {
    require_invalid_argument([&] { poslsh::plan_heads(100, sigmas, Masking::causal, target); },
                             "target");
    require_invalid_argument(
        [&] {
          poslsh::plan_single_method(100, sigmas, Masking::causal, target, Method::exact_banded);
        },
        "target");
    require_invalid_argument(
        [&] { poslsh::plan_head_candidates(100, 4.0, 0, Masking::causal, target); }, "target");
  }
  // plan_heads with the default options changed by `set` (one bad field) names `argument`.
  const auto rejects_options = [&](const auto& set, const std::string& argument) {
    poslsh::PlannerOptions options;
    set(options);
    require_invalid_argument(
        [&] { poslsh::plan_heads(100, sigmas, Masking::causal, 0.1, options); }, argument);
  };
  rejects_options([](auto& options) { options.head_dim = 0; }, "options.head_dim");
  rejects_options([](auto& options) { options.banded_small_sigma = -1.0; },
                  "options.banded_small_sigma");
  rejects_options([](auto& options) { options.max_samples = 0; }, "options.max_samples");
  rejects_options([](auto& options) { options.lsh_sample_window = -1; },
                  "options.lsh_sample_window");
  rejects_options([](auto& options) { options.banded_factor = std::nan(""); },
                  "options.banded_factor");
  for (double bad : {0.0, -1.0, std::nan("")}) {
    rejects_options([&](auto& options) { options.lsh_models[1].upper_factor = bad; },
                    "options.lsh_models");
    rejects_options([&](auto& options) { options.lsh_models[0].exponent = bad; },
                    "options.lsh_models");
  }
}

TEST_CASE("multihead_attention with a plan runs each head's planned kernel", "[planner]") {
  const Index n = 300, d = 8, heads = 4;
  const RowMatrix<float> q = random_matrix<float>(n, heads * d, 7);
  const RowMatrix<float> k = random_matrix<float>(n, 2 * d, 8);
  const RowMatrix<float> v = random_matrix<float>(n, 2 * d, 9);
  std::vector<HeadPlan> plans(4);
  plans[0].method = Method::exact_tiled;
  plans[0].sigma = 3.0;
  plans[1].method = Method::exact_banded;
  plans[1].sigma = 5.0;
  plans[1].band = 20;
  plans[2].method = Method::lsh_fused;
  plans[2].sigma = 8.0;
  plans[2].samples = 6;
  plans[2].sampler = poslsh::Sampler::antithetic;
  plans[2].seed = 3;
  plans[2].stream = 2;
  plans[3] = plans[2];
  plans[3].sampler = poslsh::Sampler::independent;
  // plans run on q, k, v with kv_heads K/V heads (the buffers of k, v or, for a bad count, of q)
  // into out_heads heads of `target`.
  const auto run = [&](RowMatrix<float>& target, const std::vector<HeadPlan>& head_plans,
                       Index kv_heads, Index out_heads) {
    const float* kv_k = kv_heads == 2 ? k.data() : q.data();
    const float* kv_v = kv_heads == 2 ? v.data() : q.data();
    poslsh::multihead_attention<float>(
        poslsh::interleaved_heads<const float>(q.data(), n, heads, d),
        poslsh::interleaved_heads<const float>(kv_k, n, kv_heads, d),
        poslsh::interleaved_heads<const float>(kv_v, n, kv_heads, d),
        poslsh::interleaved_heads(target.data(), n, out_heads, d), head_plans);
  };
  RowMatrix<float> out(n, heads * d);
  run(out, plans, 2, heads);
  for (Index h = 0; h < heads; ++h) {
    const RowMatrix<float> qh = q.middleCols(h * d, d);
    const RowMatrix<float> kh = k.middleCols((h / 2) * d, d);
    const RowMatrix<float> vh = v.middleCols((h / 2) * d, d);
    const HeadPlan& p = plans[static_cast<std::size_t>(h)];
    RowMatrix<float> expected;
    if (p.method == Method::exact_tiled) {
      expected = poslsh::alibi_attention_tiled<float>(qh, kh, vh, p.sigma);
    } else if (p.method == Method::exact_banded) {
      expected = poslsh::alibi_attention_banded<float>(qh, kh, vh, p.sigma, p.band);
    } else {
      expected = poslsh::lsh_attention_fused<float>(
          qh, kh, vh, poslsh::sample_hashes(p.sigma, p.samples, p.seed, p.stream, p.sampler));
    }
    INFO("head " << h);
    CHECK(RowMatrix<float>(out.middleCols(h * d, d)) == expected);
  }
  poslsh_test::require_invalid_argument([&] { run(out, std::vector<HeadPlan>(3), 2, heads); },
                                        "plans");
  // out with fewer heads than q: named, never written past its last head.
  poslsh_test::require_invalid_argument([&] { run(out, plans, 2, 2); }, "out");
  poslsh_test::require_invalid_argument([&] { run(out, plans, 3, heads); }, "k.heads");
  poslsh_test::require_invalid_argument(
      [] { poslsh::plan_heads(100, {4.0}, Masking::causal, 1.5); }, "target");
  // The planner plans the tile methods only.
  for (Method method : {Method::lsh_per_sample, Method::fixed_blocks}) {
    poslsh_test::require_invalid_argument(
        [&] { poslsh::plan_single_method(100, {4.0}, Masking::causal, 0.1, method); }, "method");
  }
  const std::string text = poslsh::format_plan(plans, n);
  CHECK(text.find("banded") != std::string::npos);
  CHECK(text.find("s = 6 antithetic") != std::string::npos);
}
