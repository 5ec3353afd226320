// poslsh Python bindings: the per-head method planner (plan_heads and its plans; a plan runs
// through multihead_attention(q, k, v, plans=...), multihead.cpp).
#include "poslsh/multihead/planner.hpp"

#include <algorithm>

#include "common.hpp"

namespace poslsh_python {

namespace {

/// A getter of HeadPlan: get(plan) for a plan of `method`, None for the others.
template <typename Get>
auto for_method(poslsh::Method method, Get get) {
  return [method, get](const poslsh::HeadPlan& p) -> std::optional<decltype(get(p))> {
    if (p.method != method) return std::nullopt;
    return get(p);
  };
}

/// PlannerOptions from the keywords of the planner functions. `lsh_samplers`: the default error
/// models of these samplers only (None: all of them).
poslsh::PlannerOptions planner_options(
    const char* function, Index head_dim, Index max_samples, std::uint64_t seed,
    Index lsh_sample_window, const std::optional<std::vector<std::string>>& lsh_samplers) {
  poslsh::PlannerOptions options;
  options.head_dim = head_dim;
  options.max_samples = max_samples;
  options.seed = seed;
  options.lsh_sample_window = lsh_sample_window;
  if (lsh_samplers) {
    const std::vector<poslsh::LshErrorModel> defaults = poslsh::default_lsh_error_models();
    options.lsh_models.clear();
    for (const std::string& name : *lsh_samplers) {
      const auto sampler = poslsh::enum_from_name<poslsh::Sampler>(name, function, "lsh_samplers");
      const auto model =
          std::find_if(defaults.begin(), defaults.end(),
                       [&](const poslsh::LshErrorModel& m) { return m.sampler == sampler; });
      if (model == defaults.end()) {
        std::string modelled;
        for (const poslsh::LshErrorModel& m : defaults) {
          modelled += (modelled.empty() ? "" : ", ") + std::string(poslsh::enum_name(m.sampler));
        }
        throw py::value_error(argument(function, "lsh_samplers") + " holds '" + name +
                              "': it has no default error model (those of " + modelled + " exist)");
      }
      options.lsh_models.push_back(*model);
    }
  }
  return options;
}

const char* const plan_heads_doc = R"doc(
Per head (sigmas[h]), the cheapest method whose predicted relative output error
||T* - T~||_F / ||T*||_F is <= target, among
  exact_tiled   error 0, pairs n (n + 1) / 2 causal (n^2 bidirectional);
  exact_banded  the smallest band W with 3 (1 + 1.6 / sigma^2) e^{-(W+1)/sigma} <= target
                (causal; the kernel's dropped row mass times a factor);
  lsh_fused     the smallest s with upper_factor c s^-a <= target (a fitted error model per
                sampler, s <= max_samples), hashes sample_hashes(sigma, s, seed, stream=h).
Cost: predicted single-thread seconds = pairs / (throughput * 64 / head_dim) (+ n s /
1.4e8 for LSH). lsh_samplers: names of the samplers LSH may use (None: every sampler with a
default error model; [] leaves LSH out). lsh_sample_window > 0 also prices s_min + 1 ..
s_min + window and keeps the cheapest. Returns a list of HeadPlan, one per head;
multihead_attention(q, k, v, plans=...) runs it. ValueError if n < 1, sigmas is empty or
holds an invalid sigma, target is not in (0, 1), or an option is out of range.
)doc";

const char* const plan_single_method_doc = R"doc(
The plan that gives every head the same method ('exact_tiled', 'exact_banded' or 'lsh_fused'
with `sampler`): each head's candidate of that method as plan_heads prices it. An empty list if
some head has none (exact_banded with W >= n - 1, lsh_fused needing s > max_samples). For
comparing plan_heads with the best single method. Keywords and errors as plan_heads.
)doc";

}  // namespace

void register_planner(py::module_& module) {
  py::class_<poslsh::HeadPlan>(module, "HeadPlan", R"doc(
The plan of one head (from plan_heads): the method, its parameter, and the predicted pairs,
single-thread seconds and relative output error. Read-only.
)doc")
      .def_property_readonly(
          "method", [](const poslsh::HeadPlan& p) { return poslsh::enum_name(p.method); },
          "'exact_tiled', 'exact_banded' or 'lsh_fused'")
      .def_readonly("sigma", &poslsh::HeadPlan::sigma, "Length scale of the head")
      .def_property_readonly(
          "band", for_method(poslsh::Method::exact_banded, [](const auto& p) { return p.band; }),
          "exact_banded: the band W (|i - j| <= W kept); None otherwise")
      .def_property_readonly(
          "samples", for_method(poslsh::Method::lsh_fused, [](const auto& p) { return p.samples; }),
          "lsh_fused: the number of samples s; None otherwise")
      .def_property_readonly(
          "sampler",
          for_method(poslsh::Method::lsh_fused,
                     [](const auto& p) { return std::string(poslsh::enum_name(p.sampler)); }),
          "lsh_fused: the sampler's name; None otherwise")
      .def_readonly("seed", &poslsh::HeadPlan::seed,
                    "lsh_fused: hashes sample_hashes(sigma, samples, seed, stream, sampler)")
      .def_readonly("stream", &poslsh::HeadPlan::stream,
                    "lsh_fused: the stream of the hashes (the head)")
      .def_readonly("pairs", &poslsh::HeadPlan::pairs, "Predicted (query, key) pairs")
      .def_readonly("seconds", &poslsh::HeadPlan::seconds,
                    "Predicted single-thread seconds, pairs / throughput")
      .def_readonly("predicted_error", &poslsh::HeadPlan::predicted_error,
                    "Predicted relative output error ||T* - T~||_F / ||T*||_F")
      .def("hashes",
           for_method(poslsh::Method::lsh_fused,
                      [](const auto& p) {
                        return poslsh::sample_hashes(p.sigma, p.samples, p.seed, p.stream,
                                                     p.sampler);
                      }),
           "lsh_fused: the HashSet the plan runs with; None otherwise")
      .def("__repr__", [](const poslsh::HeadPlan& p) {
        std::string text = std::string("poslsh.HeadPlan(method='") + poslsh::enum_name(p.method) +
                           "', sigma=" + py::repr(py::float_(p.sigma)).cast<std::string>();
        if (p.method == poslsh::Method::exact_banded) text += ", band=" + std::to_string(p.band);
        if (p.method == poslsh::Method::lsh_fused) {
          text += ", samples=" + std::to_string(p.samples) + ", sampler='" +
                  poslsh::enum_name(p.sampler) + "'";
        }
        return text +
               ", predicted_error=" + py::repr(py::float_(p.predicted_error)).cast<std::string>() +
               ")";
      });

  const poslsh::PlannerOptions defaults;
  module.def(
      "plan_heads",
      [](Index n, const std::vector<double>& sigmas, double target, const std::string& masking,
         Index head_dim, Index max_samples, std::uint64_t seed, Index lsh_sample_window,
         const std::optional<std::vector<std::string>>& lsh_samplers) {
        constexpr const char* function = "plan_heads";
        const poslsh::PlannerOptions options =
            planner_options(function, head_dim, max_samples, seed, lsh_sample_window, lsh_samplers);
        const auto mask = poslsh::enum_from_name<poslsh::Masking>(masking, function, "masking");
        py::gil_scoped_release release;
        return poslsh::plan_heads(n, sigmas, mask, target, options);
      },
      py::arg("n"), py::arg("sigmas"), py::arg("target"), py::kw_only(),
      py::arg("masking") = poslsh::enum_name(poslsh::Masking::causal),
      py::arg("head_dim") = defaults.head_dim, py::arg("max_samples") = defaults.max_samples,
      py::arg("seed") = defaults.seed, py::arg("lsh_sample_window") = defaults.lsh_sample_window,
      py::arg("lsh_samplers") = py::none(), plan_heads_doc);

  module.def(
      "plan_single_method",
      [](Index n, const std::vector<double>& sigmas, double target, const std::string& method_name,
         const std::string& sampler_name, const std::string& masking, Index head_dim,
         Index max_samples, std::uint64_t seed, Index lsh_sample_window,
         const std::optional<std::vector<std::string>>& lsh_samplers) {
        constexpr const char* function = "plan_single_method";
        const auto method = poslsh::enum_from_name<poslsh::Method>(method_name, function, "method");
        if (!poslsh::method_runs_by_query_tiles(method)) {
          std::string planned;  // the methods a plan runs (multihead_attention's plans=)
          for (const auto& entry : poslsh::EnumNames<poslsh::Method>::table) {
            if (!poslsh::method_runs_by_query_tiles(entry.value)) continue;
            planned += (planned.empty() ? "" : ", ") + std::string(entry.name);
          }
          throw py::value_error(argument(function, "method") + " = " + method_name +
                                ": the planner plans " + planned);
        }
        const auto sampler =
            poslsh::enum_from_name<poslsh::Sampler>(sampler_name, function, "sampler");
        const poslsh::PlannerOptions options =
            planner_options(function, head_dim, max_samples, seed, lsh_sample_window, lsh_samplers);
        const auto mask = poslsh::enum_from_name<poslsh::Masking>(masking, function, "masking");
        py::gil_scoped_release release;
        return poslsh::plan_single_method(n, sigmas, mask, target, method, sampler, options);
      },
      py::arg("n"), py::arg("sigmas"), py::arg("target"), py::arg("method"), py::kw_only(),
      py::arg("sampler") = poslsh::enum_name(poslsh::Sampler::independent),
      py::arg("masking") = poslsh::enum_name(poslsh::Masking::causal),
      py::arg("head_dim") = defaults.head_dim, py::arg("max_samples") = defaults.max_samples,
      py::arg("seed") = defaults.seed, py::arg("lsh_sample_window") = defaults.lsh_sample_window,
      py::arg("lsh_samplers") = py::none(), plan_single_method_doc);

  module.def("plan_seconds", &poslsh::plan_seconds, py::arg("plans"),
             "Predicted single-thread seconds of a plan: the sum of its heads' seconds.");

  module.def(
      "format_plan",
      [](const std::vector<poslsh::HeadPlan>& plans, Index n) {
        return poslsh::format_plan(plans, n);
      },
      py::arg("plans"), py::arg("n"), R"doc(
The plan as text: one line per head (head, sigma, method, W or s and sampler, predicted pairs
per query = pairs / n, predicted error, time in ms), then the total predicted time.
)doc");
}

}  // namespace poslsh_python
