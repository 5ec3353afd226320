// poslsh Python bindings: the compiled module poslsh._core (re-exported by the poslsh package),
// one register_* call per binding file.
#include "common.hpp"
#include "poslsh/version.hpp"

PYBIND11_MODULE(_core, module) {
  using namespace poslsh_python;
  module.doc() = R"doc(
Positional LSH for ALiBi attention (compiled part of the poslsh package).

Random binning of positions (width w ~ Gamma(2, sigma), offset xi ~ U[0, w),
bin floor((i - xi) / w)) gives E[M~] = L*, L*_ij = exp(-|i-j| / sigma); the LSH estimate of
ALiBi attention is T~ = D~^-1 (A o M~) V, M~ the mean of s block masks.
)doc";
  // Classes before the functions whose signatures name them (HashSet, HeadPlan).
  register_dtypes(module);
  register_lsh(module);
  register_planner(module);
  register_attention(module);
  register_multihead(module);
  register_training(module);
  register_paged(module);
  register_interop(module);
  register_parallel(module);
  register_kv_cache(module);
#ifdef POSLSH_PYTHON_WITH_SPECTRA
  register_analysis(module);
  module.attr("has_spectra") = true;
#else
  module.attr("has_spectra") = false;
#endif
  module.attr("__version__") = poslsh::version_string;
#ifdef _OPENMP
  module.attr("has_openmp") = true;
#else
  module.attr("has_openmp") = false;
#endif
  module.def(
      "max_threads",
      []() {
#ifdef _OPENMP
        return omp_get_max_threads();
#else
        return 1;
#endif
      },
      "OpenMP threads a kernel uses by default from the calling thread (1 without OpenMP).");
}
