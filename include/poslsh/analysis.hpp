// poslsh analysis module: the matrix-free error measurements of the LSH estimate M~ against the
// ALiBi kernel L* (the paper's metric set). Needs Spectra for the Lanczos spectral norms
// (Debian: libspectra-dev; CMake: link poslsh::analysis, which is poslsh plus Spectra).
//
//   analysis/operators.hpp       L* x, M~ x and (L* - M~) x without n x n storage
//   analysis/max_error.hpp       ||L* - M~||_max, exactly
//   analysis/block_stats.hpp     block sizes, b_max against sigma ln ln n
//   analysis/band_counts.hpp     M~ as union-band counts (products in O(n * band), for large s),
//                                partition_pair_count
//   lsh/samplers.hpp             variance-reduced hash samplers and Poisson-cut partitions
//   analysis/spectral_error.hpp  ||L* - M~||_2 (dense or Lanczos), ||L*||_2 (needs Spectra)
//   analysis/metrics.hpp         the paper's bounds, kernel and attention output errors in one
//                                call (needs Spectra)
//
// poslsh.hpp includes all but the last two (the others need only Eigen), so a program that
// does not measure spectral errors neither needs Spectra nor compiles it.
#pragma once

#include "poslsh/analysis/band_counts.hpp"
#include "poslsh/analysis/block_stats.hpp"
#include "poslsh/analysis/max_error.hpp"
#include "poslsh/analysis/metrics.hpp"
#include "poslsh/analysis/operators.hpp"
#include "poslsh/analysis/spectral_error.hpp"
#include "poslsh/lsh/samplers.hpp"
