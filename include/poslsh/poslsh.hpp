// poslsh: Positional LSH for ALiBi attention. Includes every public header (spectral_error.hpp
// and metrics.hpp only when Spectra is on the include path).
#pragma once

#include "poslsh/alibi_kernel.hpp"
#include "poslsh/banded_attention.hpp"
#include "poslsh/block_kernel.hpp"
#include "poslsh/block_plan.hpp"
#include "poslsh/block_stats.hpp"
#include "poslsh/decode.hpp"
#include "poslsh/fused_attention.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/heads_view.hpp"
#include "poslsh/lse_merge.hpp"
#include "poslsh/masks.hpp"
#include "poslsh/max_error.hpp"
#include "poslsh/multihead.hpp"
#include "poslsh/operators.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/per_sample_attention.hpp"
#include "poslsh/reference_attention.hpp"
#include "poslsh/slopes.hpp"
#include "poslsh/tiled_attention.hpp"
#include "poslsh/types.hpp"
#include "poslsh/version.hpp"

// The spectral norms (Lanczos) need Spectra (Debian: libspectra-dev; CMake: poslsh::analysis).
#if __has_include(<Spectra/SymEigsSolver.h>)
#include "poslsh/metrics.hpp"
#include "poslsh/spectral_error.hpp"
#endif
