// poslsh Python bindings: the matrix-free error analysis of M~ against L* and the attention
// output errors (the paper's metric set).
// Built only with Spectra (CMake finds its package); without it the module has no analysis
// functions and poslsh.has_spectra is False.
#include "poslsh/analysis.hpp"

#include "arrays.hpp"

namespace poslsh_python {

namespace {

poslsh::SpectralOptions spectral_options(const char* function, const std::string& method,
                                         Index dense_limit, Index max_restarts, Index subspace,
                                         double tolerance) {
  poslsh::SpectralOptions options;
  options.method =
      poslsh::enum_from_name<poslsh::SpectralMethod>(method, function, "spectral_method");
  options.dense_limit = dense_limit;
  options.max_restarts = max_restarts;
  options.subspace = subspace;
  options.tolerance = tolerance;
  return options;
}

poslsh::MetricOptions metric_options(const char* function, std::optional<double> epsilon,
                                     const std::string& epsilon_definition,
                                     const poslsh::SpectralOptions& spectral) {
  poslsh::MetricOptions options;
  options.epsilon = epsilon;
  options.epsilon_definition = poslsh::enum_from_name<poslsh::EpsilonDefinition>(
      epsilon_definition, function, "epsilon_definition");
  options.spectral = spectral;
  return options;
}

template <typename Struct>
std::string fields_repr(const char* name, const py::object& self,
                        std::initializer_list<const char*> fields) {
  std::string text = std::string("poslsh.") + name + "(";
  bool first = true;
  for (const char* field : fields) {
    text += (first ? "" : ", ") + std::string(field) + "=" +
            py::repr(self.attr(field)).cast<std::string>();
    first = false;
  }
  return text + ")";
}

}  // namespace

void register_analysis(py::module_& module) {
  const poslsh::SpectralOptions spectral;  // the defaults of the keywords
  const poslsh::MetricOptions metric;
  py::class_<poslsh::SpectralNorm>(module, "SpectralNorm",
                                   "A spectral norm and how it was computed.")
      .def_readonly("value", &poslsh::SpectralNorm::value)
      .def_readonly("converged", &poslsh::SpectralNorm::converged,
                    "False only when Lanczos hit max_restarts (value is then a lower bound)")
      .def_readonly("products", &poslsh::SpectralNorm::products, "Operator products used")
      .def_property_readonly(
          "method", [](const poslsh::SpectralNorm& norm) { return poslsh::enum_name(norm.method); })
      .def("__repr__", [](const py::object& self) {
        return fields_repr<poslsh::SpectralNorm>("SpectralNorm", self,
                                                 {"value", "converged", "products", "method"});
      });

  py::class_<poslsh::KernelErrorMetrics>(module, "KernelErrorMetrics", R"doc(
Errors of M~ = (1/s) sum_k M(h_k) against L*_ij = exp(-|i-j| / sigma), with the paper's bounds:
spectral ||L* - M~||_2, max ||L* - M~||_max, kernel_norm ||L*||_2, relative_spectral,
epsilon, good_samples s_good = ceil(sigma^2 ln n / epsilon^2), expectation_bound
Psi (sqrt(ln n / s) + ln n / s), tail_bound n exp(-s eps^2 / (4 Psi (4 Psi + eps))),
spectral_details (a SpectralNorm).
)doc")
      .def_readonly("spectral", &poslsh::KernelErrorMetrics::spectral)
      .def_readonly("max", &poslsh::KernelErrorMetrics::max)
      .def_readonly("kernel_norm", &poslsh::KernelErrorMetrics::kernel_norm)
      .def_readonly("relative_spectral", &poslsh::KernelErrorMetrics::relative_spectral)
      .def_readonly("epsilon", &poslsh::KernelErrorMetrics::epsilon)
      .def_readonly("good_samples", &poslsh::KernelErrorMetrics::good_samples)
      .def_readonly("expectation_bound", &poslsh::KernelErrorMetrics::expectation_bound)
      .def_readonly("tail_bound", &poslsh::KernelErrorMetrics::tail_bound)
      .def_readonly("spectral_details", &poslsh::KernelErrorMetrics::spectral_details)
      .def("__repr__", [](const py::object& self) {
        return fields_repr<poslsh::KernelErrorMetrics>(
            "KernelErrorMetrics", self,
            {"spectral", "max", "kernel_norm", "relative_spectral", "epsilon", "good_samples",
             "expectation_bound", "tail_bound"});
      });

  py::class_<poslsh::OutputErrorMetrics>(module, "OutputErrorMetrics", R"doc(
Attention output errors of T~ against the exact T*: frobenius ||T* - T~||_F,
relative_frobenius, row_relative_median / _p90 / _p99 of ||t*_i - t~_i|| / ||t*_i|| (rows with
t*_i = 0 left out, counted in zero_rows), cosine <T*, T~> / (||T*||_F ||T~||_F).
)doc")
      .def_readonly("frobenius", &poslsh::OutputErrorMetrics::frobenius)
      .def_readonly("relative_frobenius", &poslsh::OutputErrorMetrics::relative_frobenius)
      .def_readonly("row_relative_median", &poslsh::OutputErrorMetrics::row_relative_median)
      .def_readonly("row_relative_p90", &poslsh::OutputErrorMetrics::row_relative_p90)
      .def_readonly("row_relative_p99", &poslsh::OutputErrorMetrics::row_relative_p99)
      .def_readonly("zero_rows", &poslsh::OutputErrorMetrics::zero_rows)
      .def_readonly("cosine", &poslsh::OutputErrorMetrics::cosine)
      .def("__repr__", [](const py::object& self) {
        return fields_repr<poslsh::OutputErrorMetrics>(
            "OutputErrorMetrics", self,
            {"frobenius", "relative_frobenius", "row_relative_median", "row_relative_p90",
             "row_relative_p99", "zero_rows", "cosine"});
      });

  py::class_<poslsh::UnnormalizedOutputError>(module, "UnnormalizedOutputError",
                                              "||(A o L*) V - (A o M~) V||: frobenius and max.")
      .def_readonly("frobenius", &poslsh::UnnormalizedOutputError::frobenius)
      .def_readonly("max", &poslsh::UnnormalizedOutputError::max)
      .def("__repr__", [](const py::object& self) {
        return fields_repr<poslsh::UnnormalizedOutputError>("UnnormalizedOutputError", self,
                                                            {"frobenius", "max"});
      });

  py::class_<poslsh::PaperMetrics>(module, "PaperMetrics",
                                   "kernel (KernelErrorMetrics), unnormalized "
                                   "(UnnormalizedOutputError or None), output "
                                   "(OutputErrorMetrics).")
      .def_readonly("kernel", &poslsh::PaperMetrics::kernel)
      .def_readonly("unnormalized", &poslsh::PaperMetrics::unnormalized)
      .def_readonly("output", &poslsh::PaperMetrics::output)
      .def("__repr__", [](const py::object& self) {
        return fields_repr<poslsh::PaperMetrics>("PaperMetrics", self,
                                                 {"kernel", "unnormalized", "output"});
      });

  module.def(
      "kernel_error_metrics",
      [](py::handle hashes, Index n, double sigma, const std::string& masking,
         std::optional<double> epsilon, const std::string& epsilon_definition,
         const std::string& spectral_method, Index spectral_dense_limit, Index max_restarts,
         Index subspace, double tolerance) {
        constexpr const char* function = "kernel_error_metrics";
        const poslsh::HashSet& set = hash_set(hashes, function);
        const poslsh::MetricOptions options =
            metric_options(function, epsilon, epsilon_definition,
                           spectral_options(function, spectral_method, spectral_dense_limit,
                                            max_restarts, subspace, tolerance));
        py::gil_scoped_release release;
        return poslsh::kernel_error_metrics(set, n, sigma,
                                            masking_of(masking, "kernel_error_metrics"), options);
      },
      py::arg("hashes"), py::arg("n"), py::arg("sigma"), py::kw_only(),
      py::arg("masking") = default_masking(), py::arg("epsilon") = py::none(),
      py::arg("epsilon_definition") = poslsh::enum_name(metric.epsilon_definition),
      py::arg("spectral_method") = poslsh::enum_name(spectral.method),
      py::arg("spectral_dense_limit") = spectral.dense_limit,
      py::arg("max_restarts") = spectral.max_restarts, py::arg("subspace") = spectral.subspace,
      py::arg("tolerance") = spectral.tolerance,
      R"doc(
Kernel errors of the hash set against the ALiBi kernel, matrix-free (no n x n matrix):
||L* - M~||_2 (dense for n <= spectral_dense_limit, else Lanczos), ||L* - M~||_max exactly,
||L*||_2, and the paper's bounds at epsilon (None: the observed ||L* - M~||_2, or the relative
error with epsilon_definition='relative'). Returns a KernelErrorMetrics.
)doc");

  module.def(
      "spectral_error",
      [](py::handle hashes, Index n, double sigma, const std::string& masking,
         const std::string& spectral_method, Index spectral_dense_limit, Index max_restarts,
         Index subspace, double tolerance) {
        constexpr const char* function = "spectral_error";
        const poslsh::HashSet& set = hash_set(hashes, function);
        const poslsh::SpectralOptions options = spectral_options(
            function, spectral_method, spectral_dense_limit, max_restarts, subspace, tolerance);
        py::gil_scoped_release release;
        return poslsh::spectral_error(set, n, sigma, masking_of(masking, "spectral_error"),
                                      options);
      },
      py::arg("hashes"), py::arg("n"), py::arg("sigma"), py::kw_only(),
      py::arg("masking") = default_masking(),
      py::arg("spectral_method") = poslsh::enum_name(spectral.method),
      py::arg("spectral_dense_limit") = spectral.dense_limit,
      py::arg("max_restarts") = spectral.max_restarts, py::arg("subspace") = spectral.subspace,
      py::arg("tolerance") = spectral.tolerance,
      "||L* - M~||_2 as a SpectralNorm (dense or Lanczos).");

  module.def(
      "max_error",
      [](py::handle hashes, Index n, double sigma, const std::string& masking) {
        const poslsh::HashSet& set = hash_set(hashes, "max_error");
        poslsh::MaxError error;
        {
          py::gil_scoped_release release;
          error = poslsh::max_error(set, n, sigma, masking_of(masking, "max_error"));
        }
        return py::make_tuple(error.value, error.row, error.col);
      },
      py::arg("hashes"), py::arg("n"), py::arg("sigma"), py::kw_only(),
      py::arg("masking") = default_masking(),
      "(||L* - M~||_max, row, col): the largest |L*_ij - M~_ij| and where it is attained.");

  module.def(
      "alibi_kernel_norm",
      [](Index n, double sigma, const std::string& masking) {
        return poslsh::alibi_kernel_norm(n, sigma, masking_of(masking, "alibi_kernel_norm"));
      },
      py::arg("n"), py::arg("sigma"), py::kw_only(), py::arg("masking") = default_masking(),
      "||L*||_2 of the ALiBi kernel exp(-|i-j| / sigma) (causal: lower triangle), exactly.");

  module.def(
      "output_error_metrics",
      [](py::handle exact, py::handle approximate) {
        constexpr const char* function = "output_error_metrics";
        const auto run = [&](auto types) {
          using T = typename decltype(types)::q;
          const InputMap<T> exact_map = input_matrix<T>(exact, function, "exact", "exact");
          const InputMap<T> approximate_map =
              input_matrix<T>(approximate, function, "approximate", "exact");
          py::gil_scoped_release release;
          return poslsh::output_error_metrics<T>(exact_map, approximate_map);
        };
        return dispatch(function, {exact}, run, {"exact"});
      },
      py::arg("exact"), py::arg("approximate"), R"doc(
Output errors of T~ (approximate) against T* (exact), [n, d_v] arrays of one dtype, computed in
double. Returns an OutputErrorMetrics.
)doc");

  module.def(
      "paper_metrics",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, double sigma,
         py::handle exact, py::handle approximate, const std::string& masking,
         std::optional<double> scale, std::optional<double> epsilon,
         const std::string& epsilon_definition, Index dense_limit,
         const std::string& spectral_method, Index spectral_dense_limit, Index max_restarts,
         Index subspace, double tolerance) {
        constexpr const char* function = "paper_metrics";
        const poslsh::HashSet& set = hash_set(hashes, function);
        poslsh::MetricOptions options =
            metric_options(function, epsilon, epsilon_definition,
                           spectral_options(function, spectral_method, spectral_dense_limit,
                                            max_restarts, subspace, tolerance));
        options.dense_limit = dense_limit;
        const poslsh::AttentionOptions attention{masking_of(masking, "paper_metrics"), scale};
        return dispatch(function, {q}, [&](auto types) {
          using T = typename decltype(types)::q;
          const InputMap<T> q_map = input_matrix<T>(q, function, "q", "q");
          const InputMap<T> k_map = input_matrix<T>(k, function, "k", "q");
          const InputMap<T> v_map = input_matrix<T>(v, function, "v", "q");
          const InputMap<T> exact_map = input_matrix<T>(exact, function, "exact", "q");
          const InputMap<T> approximate_map =
              input_matrix<T>(approximate, function, "approximate", "q");
          py::gil_scoped_release release;
          return poslsh::paper_metrics<T>(q_map, k_map, v_map, set, sigma, exact_map,
                                          approximate_map, attention, options);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::arg("sigma"),
      py::arg("exact"), py::arg("approximate"), py::kw_only(),
      py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
      py::arg("epsilon") = py::none(),
      py::arg("epsilon_definition") = poslsh::enum_name(metric.epsilon_definition),
      py::arg("dense_limit") = metric.dense_limit,
      py::arg("spectral_method") = poslsh::enum_name(spectral.method),
      py::arg("spectral_dense_limit") = spectral.dense_limit,
      py::arg("max_restarts") = spectral.max_restarts, py::arg("subspace") = spectral.subspace,
      py::arg("tolerance") = spectral.tolerance,
      R"doc(
The paper's metric set for one head in one call: kernel_error_metrics (n = len(q)), the
unnormalized output error ||(A o L*) V - (A o M~) V|| (F and max; dense, only when
n <= dense_limit, else None), and output_error_metrics(exact, approximate).
Returns a PaperMetrics.
)doc");
}

}  // namespace poslsh_python
