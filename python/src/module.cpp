// poslsh Python bindings: the compiled module poslsh._core (re-exported by the poslsh package).
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
  bind_hashes(module);
  bind_half(module);
  bind_kernels(module);
  bind_multihead(module);
  bind_interop(module);
  bind_analysis(module);
  bind_backward(module);
  bind_multihead_backward(module);
  bind_paged(module);
  bind_samplers(module);
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
