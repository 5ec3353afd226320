// poslsh analysis module: the matrix-free error measurements of the LSH estimate M~ against the
// ALiBi kernel L* (the paper's metric set). Needs Spectra for the Lanczos spectral norms
// (Debian: libspectra-dev; CMake: link poslsh::analysis, which is poslsh plus Spectra).
//
//   operators.hpp       L* x, M~ x and (L* - M~) x without n x n storage
//   max_error.hpp       ||L* - M~||_max, exactly
//   block_stats.hpp     block sizes, b_max against sigma ln ln n
//   band_counts.hpp     M~ as union-band counts (products in O(n * band), for large s),
//                       partition_pair_count
//   samplers.hpp        variance-reduced hash samplers and Poisson-cut partitions
//   spectral_error.hpp  ||L* - M~||_2 (dense or Lanczos), ||L*||_2 (needs Spectra)
//   metrics.hpp         the paper's bounds, kernel and attention output errors in one call
//                       (needs Spectra)
//
// poslsh.hpp includes all but the last two (they need only Eigen), so a program
// that does not measure spectral errors neither needs Spectra nor compiles it.
#pragma once

#include "poslsh/band_counts.hpp"
#include "poslsh/block_stats.hpp"
#include "poslsh/max_error.hpp"
#include "poslsh/metrics.hpp"
#include "poslsh/operators.hpp"
#include "poslsh/samplers.hpp"
#include "poslsh/spectral_error.hpp"
