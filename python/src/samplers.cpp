// poslsh Python bindings: the variance-reduced hash samplers (sample_hashes) and the per-head
// method planner (plan_heads, multihead_attention_planned).
#include "poslsh/lsh/samplers.hpp"

#include "common.hpp"
#include "heads.hpp"
#include "poslsh/multihead/planner.hpp"

namespace poslsh_python {

namespace {

/// The sampler called `name`; ValueError naming the argument `name_of_argument` otherwise.
poslsh::Sampler sampler_of_name(const std::string& name, const char* function,
                                const char* name_of_argument) {
  for (poslsh::Sampler sampler : poslsh::all_samplers) {
    if (name == poslsh::enum_name(sampler)) return sampler;
  }
  throw py::value_error(argument(function, name_of_argument) + " = '" + name +
                        "': must be independent, antithetic, stratified, lattice_offsets, "
                        "coupled_offsets, rqmc, stratified_lattice or poisson");
}

poslsh::PlannedMethod planned_method_of_name(const std::string& name, const char* function) {
  for (poslsh::PlannedMethod method : {poslsh::PlannedMethod::exact_tiled,
                                       poslsh::PlannedMethod::banded, poslsh::PlannedMethod::lsh}) {
    if (name == poslsh::planned_method_name(method)) return method;
  }
  throw py::value_error(argument(function, "method") + " = '" + name +
                        "': must be exact_tiled, banded or lsh");
}

/// PlannerOptions from the keywords of the planner functions. `lsh_samplers`: the default error
/// models of these samplers only (None: all of them).
poslsh::PlannerOptions sampler_planner_options(
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
      const poslsh::Sampler sampler = sampler_of_name(name, function, "lsh_samplers");
      const auto model =
          std::find_if(defaults.begin(), defaults.end(),
                       [&](const poslsh::LshErrorModel& m) { return m.sampler == sampler; });
      if (model == defaults.end()) {
        throw py::value_error(argument(function, "lsh_samplers") + " holds '" + name +
                              "': it has no default error model (those of independent, "
                              "antithetic, stratified, rqmc and stratified_lattice exist)");
      }
      options.lsh_models.push_back(*model);
    }
  }
  return options;
}

const char* const sampler_hashes_doc = R"doc(
Hash set of s samples for length scale sigma under a variance-reduced sampler, keyed by
(seed, stream) like rbf_hashes. Every sample has rbf_hash's law (w ~ Gamma(2, sigma),
xi | w ~ U[0, w)), so P[bin_k(i) = bin_k(j)] = exp(-|i-j| / sigma) and E[M~] = L* for every
sampler; they differ in how the s samples are coupled (negative covariances lower Var M~_ij).
With F(x) = 1 - (1 + x) e^{-x} (the Gamma(2, 1) distribution function):
  independent         rbf_hashes(sigma, s, seed, stream), bit for bit;
  antithetic          widths in pairs sigma F^-1(u), sigma F^-1(1 - u);
  stratified          w_k = sigma F^-1((pi(k) + V_k) / s): one width per stratum of u;
  lattice_offsets     groups of `group` samples share w; offsets w frac(U + j / group);
  coupled_offsets     independent widths; offsets w_k frac(U + pi(k) / s), one shared U;
  rqmc                randomly shifted rank-1 lattice over (u_w, u_xi), w = sigma F^-1(u_w);
  stratified_lattice  ceil(s / g) groups (g = lattice_group, 0: round(sqrt(s))) with
                      stratified widths and lattice offsets.
"poisson" has no hash form (ValueError). Returns a HashSet (for every kernel taking hashes).
ValueError if sigma is not finite and > 0, s < 1, group < 1, lattice_group < 0 or the sampler
is unknown.
)doc";

const char* const sampler_plan_heads_doc = R"doc(
Per head (sigmas[h]), the cheapest method whose predicted relative output error
||T* - T~||_F / ||T*||_F is <= target, among
  exact_tiled  error 0, pairs n (n + 1) / 2 causal (n^2 bidirectional);
  banded       the smallest band W with 3 (1 + 1.6 / sigma^2) e^{-(W+1)/sigma} <= target
               (causal; the kernel's dropped row mass times a factor);
  lsh          the smallest s with upper_factor c s^-a <= target (a fitted error model per
               sampler, s <= max_samples), hashes sample_hashes(sigma, s, seed, stream=h).
Cost: predicted single-thread seconds = pairs / (throughput * 64 / head_dim) (+ n s /
1.4e8 for LSH). lsh_samplers: names of the samplers LSH may use (None: independent,
antithetic, stratified, rqmc, stratified_lattice; [] leaves LSH out). lsh_sample_window > 0
also prices s_min + 1 .. s_min + window and keeps the cheapest. Returns a list of HeadPlan.
ValueError if n < 1, sigmas is empty or holds an invalid sigma, target is not in (0, 1), or an
option is out of range.
)doc";

const char* const sampler_plan_single_method_doc = R"doc(
The plan that gives every head the same method ('exact_tiled', 'banded' or 'lsh' with
`sampler`): each head's candidate of that method as plan_heads prices it. An empty list if some
head has none (banded with W >= n - 1, LSH needing s > max_samples). For comparing plan_heads
with the best single method. Keywords and errors as plan_heads.
)doc";

const char* const sampler_planned_doc = R"doc(
Runs a plan (a list of HeadPlan, one per query head): query head h (K/V head h // G,
G = H_q / H_kv) with plans[h]'s method,

    exact_tiled: alibi_attention_tiled(Q_h, K, V, sigma_h)
    banded:      alibi_attention_banded(Q_h, K, V, sigma_h, W_h)
    lsh:         lsh_attention_fused(Q_h, K, V, sample_hashes(sigma_h, s_h, seed_h, stream_h,
                 sampler_h)),

heads in parallel. Arrays as multihead_attention: layout 'nhd' (q [m, H_q, d], k [L, H_kv, d],
v [L, H_kv, d_v], out [m, H_q, d_v]) or 'hnd' (first two axes swapped), any strides on the
first two axes, last axis contiguous, float32 or float64 (all alike), no copies.
masking: 'causal' (default) or 'bidirectional' (plan with the same masking). scale: tau, None
means 1/sqrt(d). query_offset: position of q's first token (None: L - m). out: optional output
written in place and returned. num_threads: OpenMP threads for this call. The GIL is released
during the computation. ValueError if len(plans) != H_q or as the single-head kernels.
)doc";

}  // namespace

void bind_samplers(py::module_& module) {
  module.def(
      "sampler_names",
      []() {
        std::vector<std::string> names;
        for (poslsh::Sampler sampler : poslsh::all_samplers) {
          names.emplace_back(poslsh::enum_name(sampler));
        }
        return names;
      },
      "Names of the hash samplers in declaration order (sample_hashes takes all but 'poisson').");

  module.def(
      "sample_hashes",
      [](double sigma, Index s, std::uint64_t seed, std::uint64_t stream, const std::string& name,
         Index group, Index lattice_group) {
        const poslsh::Sampler sampler = sampler_of_name(name, "sample_hashes", "sampler");
        poslsh::SamplerOptions options;
        options.group = group;
        options.lattice_group = lattice_group;
        return poslsh::sample_hashes(sigma, s, seed, stream, sampler, options);
      },
      py::arg("sigma"), py::arg("s"), py::arg("seed"), py::arg("stream") = 0,
      py::arg("sampler") = "independent", py::kw_only(), py::arg("group") = 4,
      py::arg("lattice_group") = 0, sampler_hashes_doc);

  module.def(
      "lattice_group_starts",
      [](Index s, Index lattice_group) {
        poslsh::SamplerOptions options;
        options.lattice_group = lattice_group;
        return poslsh::lattice_group_starts(s, options);
      },
      py::arg("s"), py::arg("lattice_group") = 0, R"doc(
Start indices (0, ..., s) of the G = ceil(s / g) groups of the stratified_lattice sampler
(g = lattice_group, 0: round(sqrt(s)), at least 1): the first s mod G groups hold ceil(s / G)
samples, the others floor(s / G).
)doc");

  py::class_<poslsh::HeadPlan>(module, "HeadPlan", R"doc(
The plan of one head (from plan_heads): the method, its parameter, and the predicted pairs,
single-thread seconds and relative output error. Read-only.
)doc")
      .def_property_readonly(
          "method", [](const poslsh::HeadPlan& p) { return poslsh::planned_method_name(p.method); },
          "'exact_tiled', 'banded' or 'lsh'")
      .def_readonly("sigma", &poslsh::HeadPlan::sigma, "Length scale of the head")
      .def_property_readonly(
          "band",
          [](const poslsh::HeadPlan& p) -> std::optional<Index> {
            if (p.method != poslsh::PlannedMethod::banded) return std::nullopt;
            return p.band;
          },
          "banded: the band W (|i - j| <= W kept); None otherwise")
      .def_property_readonly(
          "samples",
          [](const poslsh::HeadPlan& p) -> std::optional<Index> {
            if (p.method != poslsh::PlannedMethod::lsh) return std::nullopt;
            return p.samples;
          },
          "lsh: the number of samples s; None otherwise")
      .def_property_readonly(
          "sampler",
          [](const poslsh::HeadPlan& p) -> std::optional<std::string> {
            if (p.method != poslsh::PlannedMethod::lsh) return std::nullopt;
            return std::string(poslsh::enum_name(p.sampler));
          },
          "lsh: the sampler's name; None otherwise")
      .def_readonly("seed", &poslsh::HeadPlan::seed,
                    "lsh: hashes sample_hashes(sigma, samples, seed, stream, sampler)")
      .def_readonly("stream", &poslsh::HeadPlan::stream, "lsh: the stream of the hashes (the head)")
      .def_readonly("pairs", &poslsh::HeadPlan::pairs, "Predicted (query, key) pairs")
      .def_readonly("seconds", &poslsh::HeadPlan::seconds,
                    "Predicted single-thread seconds, pairs / throughput")
      .def_readonly("predicted_error", &poslsh::HeadPlan::predicted_error,
                    "Predicted relative output error ||T* - T~||_F / ||T*||_F")
      .def(
          "hashes",
          [](const poslsh::HeadPlan& p) -> std::optional<poslsh::HashSet> {
            if (p.method != poslsh::PlannedMethod::lsh) return std::nullopt;
            return poslsh::sample_hashes(p.sigma, p.samples, p.seed, p.stream, p.sampler);
          },
          "lsh: the HashSet the plan runs with; None otherwise")
      .def("__repr__", [](const poslsh::HeadPlan& p) {
        std::string text = std::string("poslsh.HeadPlan(method='") +
                           poslsh::planned_method_name(p.method) +
                           "', sigma=" + py::repr(py::float_(p.sigma)).cast<std::string>();
        if (p.method == poslsh::PlannedMethod::banded) text += ", band=" + std::to_string(p.band);
        if (p.method == poslsh::PlannedMethod::lsh) {
          text += ", samples=" + std::to_string(p.samples) + ", sampler='" +
                  poslsh::enum_name(p.sampler) + "'";
        }
        return text +
               ", predicted_error=" + py::repr(py::float_(p.predicted_error)).cast<std::string>() +
               ")";
      });

  module.def(
      "plan_heads",
      [](Index n, const std::vector<double>& sigmas, double target, const std::string& masking,
         Index head_dim, Index max_samples, std::uint64_t seed, Index lsh_sample_window,
         const std::optional<std::vector<std::string>>& lsh_samplers) {
        constexpr const char* function = "plan_heads";
        const poslsh::PlannerOptions options = sampler_planner_options(
            function, head_dim, max_samples, seed, lsh_sample_window, lsh_samplers);
        const poslsh::Masking mask = masking_of_name(masking, function);
        py::gil_scoped_release release;
        return poslsh::plan_heads(n, sigmas, mask, target, options);
      },
      py::arg("n"), py::arg("sigmas"), py::arg("target"), py::kw_only(),
      py::arg("masking") = "causal", py::arg("head_dim") = 64, py::arg("max_samples") = 256,
      py::arg("seed") = 0, py::arg("lsh_sample_window") = 0, py::arg("lsh_samplers") = py::none(),
      sampler_plan_heads_doc);

  module.def(
      "plan_single_method",
      [](Index n, const std::vector<double>& sigmas, double target, const std::string& method_name,
         const std::string& sampler_name, const std::string& masking, Index head_dim,
         Index max_samples, std::uint64_t seed, Index lsh_sample_window,
         const std::optional<std::vector<std::string>>& lsh_samplers) {
        constexpr const char* function = "plan_single_method";
        const poslsh::PlannedMethod method = planned_method_of_name(method_name, function);
        const poslsh::Sampler sampler = sampler_of_name(sampler_name, function, "sampler");
        const poslsh::PlannerOptions options = sampler_planner_options(
            function, head_dim, max_samples, seed, lsh_sample_window, lsh_samplers);
        const poslsh::Masking mask = masking_of_name(masking, function);
        py::gil_scoped_release release;
        return poslsh::plan_single_method(n, sigmas, mask, target, method, sampler, options);
      },
      py::arg("n"), py::arg("sigmas"), py::arg("target"), py::arg("method"), py::kw_only(),
      py::arg("sampler") = "independent", py::arg("masking") = "causal", py::arg("head_dim") = 64,
      py::arg("max_samples") = 256, py::arg("seed") = 0, py::arg("lsh_sample_window") = 0,
      py::arg("lsh_samplers") = py::none(), sampler_plan_single_method_doc);

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

  module.def(
      "multihead_attention_planned",
      [](py::handle q, py::handle k, py::handle v, const std::vector<poslsh::HeadPlan>& plans,
         const std::string& layout_name, const std::string& masking, std::optional<double> scale,
         std::optional<Index> query_offset, py::handle out,
         std::optional<int> threads) -> py::object {
        constexpr const char* function = "multihead_attention_planned";
        threads = thread_count(threads, function);
        const Layout layout = layout_of(layout_name, function);
        poslsh::AttentionOptions options;
        options.masking = masking_of_name(masking, function);
        options.scale = scale;
        options.query_offset = query_offset;
        const py::array q_array = require_array(q, function, "q");
        return dispatch(q_array, function, "q", [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const auto [q_view, k_view, v_view] = heads_inputs<T>(q_array, k, v, layout, function);
          py::array result = heads_output<T>(out, layout, q_view.tokens, q_view.heads, v_view.dim,
                                             function, "out", {{q, "q"}, {k, "k"}, {v, "v"}});
          const auto out_view = heads_view<T>(result, layout, function, "out");
          {
            KernelScope scope(threads);
            poslsh::multihead_attention_planned<T>(q_view, k_view, v_view, out_view, plans,
                                                   options);
          }
          return result;
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("plans"), py::kw_only(),
      py::arg("layout") = "nhd", py::arg("masking") = "causal", py::arg("scale") = py::none(),
      py::arg("query_offset") = py::none(), py::arg("out") = py::none(),
      py::arg("num_threads") = py::none(), sampler_planned_doc);
}

}  // namespace poslsh_python
