// The per-head planner: its choice against a brute-force search over every method and
// parameter, its banded and LSH error models against measured output errors (and the LSH
// model against the paper's bound), and multihead_attention_planned against the single-head
// kernels.
#include <cmath>
#include <poslsh/analysis.hpp>
#include <poslsh/banded_attention.hpp>
#include <poslsh/fused_attention.hpp>
#include <poslsh/planner.hpp>
#include <poslsh/tiled_attention.hpp>

#include "test_support.hpp"

using poslsh::HeadPlan;
using poslsh::Index;
using poslsh::Masking;
using poslsh::PlannedMethod;
using poslsh::RowMatrix;
using poslsh_test::random_matrix;

namespace {

double relative_error(const RowMatrix<float>& exact, const RowMatrix<float>& approx) {
  return (exact - approx).cast<double>().norm() / exact.cast<double>().norm();
}

}  // namespace

TEST_CASE("plan_heads picks the cheapest method that meets the target", "[planner]") {
  poslsh::PlannerOptions options;
  options.max_samples = 64;
  options.lsh_models = {{poslsh::Sampler::independent, 0.9, 0.5}};
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
          PlannedMethod method = PlannedMethod::exact_tiled;
          for (Index w = 0; w + 1 < n; ++w) {
            const double error =
                options.banded_factor * std::exp(-(static_cast<double>(w) + 1.0) / sigma);
            const double cost =
                poslsh::banded_pair_count(n, w, masking) / options.throughput.banded;
            if (error <= target && cost < best) {
              best = cost;
              method = PlannedMethod::banded;
            }
          }
          for (Index s = 1; s <= options.max_samples; ++s) {
            const double error = 0.9 / std::sqrt(static_cast<double>(s));
            if (error > target) continue;
            const double pairs = static_cast<double>(
                poslsh::lsh_fused_pair_count(poslsh::rbf_hashes(sigma, s, 0, h), n, masking));
            const double cost = pairs / options.throughput.lsh +
                                double(n) * double(s) / options.throughput.lsh_query_samples;
            if (cost < best) {
              best = cost;
              method = PlannedMethod::lsh;
            }
          }
          INFO("n " << n << ", sigma " << sigma << ", target " << target << ": planned "
                    << poslsh::planned_method_name(plans[h].method) << " " << plans[h].seconds
                    << " s, brute force " << poslsh::planned_method_name(method) << " " << best
                    << " s");
          CHECK(plans[h].method == method);
          CHECK(plans[h].seconds == Approx(best).epsilon(1e-12));
          CHECK(plans[h].predicted_error <= target);
        }
      }
    }
  }
}

TEST_CASE("the banded error model bounds the measured output error", "[planner]") {
  const Index n = 600, d = 16;
  const RowMatrix<float> q = random_matrix<float>(n, d, 1);
  const RowMatrix<float> k = random_matrix<float>(n, d, 2);
  const RowMatrix<float> v = random_matrix<float>(n, d, 3);
  const poslsh::PlannerOptions options;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {4.0, 16.0}) {
      const RowMatrix<float> exact =
          poslsh::alibi_attention_tiled<float>(q, k, v, sigma, poslsh_test::with_masking(masking));
      for (double target : {0.1, 0.01}) {
        const Index band = poslsh::planner_band(sigma, target, options.banded_factor);
        const double predicted =
            options.banded_factor * std::exp(-(static_cast<double>(band) + 1.0) / sigma);
        const double measured =
            relative_error(exact, poslsh::alibi_attention_banded<float>(
                                      q, k, v, sigma, band, poslsh_test::with_masking(masking)));
        INFO("sigma " << sigma << ", W " << band << ": predicted " << predicted << ", measured "
                      << measured);
        CHECK(predicted <= target);
        CHECK(measured <= predicted);
        CHECK(measured >= predicted / 20.0);  // the model is not vacuous
      }
    }
  }
}

TEST_CASE("the LSH error model against measured errors and the paper's bound", "[planner]") {
  const Index n = 512, d = 16;
  const double sigma = 8.0;
  const RowMatrix<float> q = random_matrix<float>(n, d, 4);
  const RowMatrix<float> k = random_matrix<float>(n, d, 5);
  const RowMatrix<float> v = random_matrix<float>(n, d, 6);
  const RowMatrix<float> exact = poslsh::alibi_attention_tiled<float>(q, k, v, sigma);
  for (const poslsh::LshErrorModel& model : poslsh::default_lsh_error_models()) {
    for (Index s : {Index{4}, Index{32}}) {
      const double predicted = model.coefficient * std::pow(double(s), -model.exponent);
      // The mean over 3 seeds of the measured relative error.
      double measured = 0.0;
      for (std::uint64_t seed = 0; seed < 3; ++seed) {
        const poslsh::HashSet hashes = poslsh::sample_hashes(sigma, s, seed, 0, model.sampler);
        measured += relative_error(exact, poslsh::lsh_attention_fused<float>(q, k, v, hashes)) / 3;
      }
      // The paper's bound on E||L* - M~||_2 relative to ||L*||_2: the model must predict
      // less than it (the bound is loose) and the measurement must match the model within 2x.
      const double bound = poslsh::expectation_bound(n, sigma, s) /
                           poslsh::alibi_kernel_norm(n, sigma, Masking::causal);
      INFO(poslsh::sampler_name(model.sampler)
           << ", s " << s << ": predicted " << predicted << ", measured " << measured
           << ", paper bound " << bound);
      CHECK(measured <= 2.0 * predicted);
      CHECK(measured >= 0.5 * predicted);
      CHECK(predicted <= bound);
    }
  }
}

TEST_CASE("multihead_attention_planned runs each head's planned kernel", "[planner]") {
  const Index n = 300, d = 8, heads = 4;
  const RowMatrix<float> q = random_matrix<float>(n, heads * d, 7);
  const RowMatrix<float> k = random_matrix<float>(n, 2 * d, 8);
  const RowMatrix<float> v = random_matrix<float>(n, 2 * d, 9);
  std::vector<HeadPlan> plans(4);
  plans[0].method = PlannedMethod::exact_tiled;
  plans[0].sigma = 3.0;
  plans[1].method = PlannedMethod::banded;
  plans[1].sigma = 5.0;
  plans[1].band = 20;
  plans[2].method = PlannedMethod::lsh;
  plans[2].sigma = 8.0;
  plans[2].samples = 6;
  plans[2].sampler = poslsh::Sampler::antithetic;
  plans[2].seed = 3;
  plans[2].stream = 2;
  plans[3] = plans[2];
  plans[3].sampler = poslsh::Sampler::independent;
  RowMatrix<float> out(n, heads * d);
  poslsh::multihead_attention_planned<float>(
      poslsh::interleaved_heads<const float>(q.data(), n, heads, d),
      poslsh::interleaved_heads<const float>(k.data(), n, 2, d),
      poslsh::interleaved_heads<const float>(v.data(), n, 2, d),
      poslsh::interleaved_heads(out.data(), n, heads, d), plans);
  for (Index h = 0; h < heads; ++h) {
    const RowMatrix<float> qh = q.middleCols(h * d, d);
    const RowMatrix<float> kh = k.middleCols((h / 2) * d, d);
    const RowMatrix<float> vh = v.middleCols((h / 2) * d, d);
    const HeadPlan& p = plans[static_cast<std::size_t>(h)];
    RowMatrix<float> expected;
    if (p.method == PlannedMethod::exact_tiled) {
      expected = poslsh::alibi_attention_tiled<float>(qh, kh, vh, p.sigma);
    } else if (p.method == PlannedMethod::banded) {
      expected = poslsh::alibi_attention_banded<float>(qh, kh, vh, p.sigma, p.band);
    } else {
      expected = poslsh::lsh_attention_fused<float>(
          qh, kh, vh, poslsh::sample_hashes(p.sigma, p.samples, p.seed, p.stream, p.sampler));
    }
    INFO("head " << h);
    CHECK(RowMatrix<float>(out.middleCols(h * d, d)) == expected);
  }
  poslsh_test::require_invalid_argument(
      [&] {
        poslsh::multihead_attention_planned<float>(
            poslsh::interleaved_heads<const float>(q.data(), n, heads, d),
            poslsh::interleaved_heads<const float>(k.data(), n, 2, d),
            poslsh::interleaved_heads<const float>(v.data(), n, 2, d),
            poslsh::interleaved_heads(out.data(), n, heads, d), std::vector<HeadPlan>(3));
      },
      "plans");
  poslsh_test::require_invalid_argument(
      [] { poslsh::plan_heads(100, {4.0}, Masking::causal, 1.5); }, "target");
  const std::string text = poslsh::format_plan(plans, n);
  CHECK(text.find("banded") != std::string::npos);
  CHECK(text.find("s = 6 antithetic") != std::string::npos);
}
