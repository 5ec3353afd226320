// The analysis module's heavy instantiations (Spectra's Lanczos on the error operators, the
// dense eigen-solvers), compiled once for the whole test executable, as kernel_instantiations.hpp
// does for the kernels: with POSLSH_TEST_EXTERN_KERNELS the test files that include this header
// see explicit instantiation declarations, and analysis_instantiations.cpp holds the one
// definition of each. Without the macro the functions are instantiated implicitly.
#pragma once

#include <poslsh/analysis.hpp>

#if defined(POSLSH_TEST_INSTANTIATE_ANALYSIS)
#define POSLSH_TEST_ANALYSIS template
#elif defined(POSLSH_TEST_EXTERN_KERNELS)
#define POSLSH_TEST_ANALYSIS extern template
#endif

#ifdef POSLSH_TEST_ANALYSIS
POSLSH_TEST_ANALYSIS poslsh::SpectralNorm
poslsh::operator_spectral_norm<poslsh::KernelErrorOperator>(const poslsh::KernelErrorOperator&,
                                                            const poslsh::SpectralOptions&);
POSLSH_TEST_ANALYSIS poslsh::SpectralNorm
poslsh::operator_spectral_norm<poslsh::BandKernelErrorOperator>(
    const poslsh::BandKernelErrorOperator&, const poslsh::SpectralOptions&);
POSLSH_TEST_ANALYSIS poslsh::SpectralNorm poslsh::spectral_error<poslsh::HashSet>(
    const poslsh::HashSet&, poslsh::Index, double, poslsh::Masking, const poslsh::SpectralOptions&);
POSLSH_TEST_ANALYSIS poslsh::KernelErrorMetrics
poslsh::detail::analysis_error_metrics<poslsh::PartitionSet>(const poslsh::PartitionSet&, double,
                                                             poslsh::Masking,
                                                             const poslsh::MetricOptions&,
                                                             const poslsh::HashSet*, const char*);
POSLSH_TEST_ANALYSIS poslsh::KernelErrorMetrics poslsh::kernel_error_metrics<poslsh::HashSet>(
    const poslsh::HashSet&, poslsh::Index, double, poslsh::Masking, const poslsh::MetricOptions&);
POSLSH_TEST_ANALYSIS poslsh::KernelErrorMetrics
poslsh::partition_error_metrics<poslsh::PartitionSet>(const poslsh::PartitionSet&, double,
                                                      poslsh::Masking,
                                                      const poslsh::MetricOptions&);
#undef POSLSH_TEST_ANALYSIS
#endif
