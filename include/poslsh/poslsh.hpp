// poslsh: Positional LSH for ALiBi attention. Includes every public header that needs only
// Eigen: the kernels, the hashes, the interop helpers and the Spectra-free part of the error
// analysis (operators.hpp, max_error.hpp, block_stats.hpp). The spectral norms and the paper's
// metric set (spectral_error.hpp, metrics.hpp) need Spectra and are in poslsh/analysis.hpp.
#pragma once

#include "poslsh/alibi_kernel.hpp"
#include "poslsh/attention_backward.hpp"
#include "poslsh/band_counts.hpp"
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
#include "poslsh/mean_estimator.hpp"
#include "poslsh/multihead.hpp"
#include "poslsh/operators.hpp"
#include "poslsh/paged_kv.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/partition_attention.hpp"
#include "poslsh/per_sample_attention.hpp"
#include "poslsh/planner.hpp"
#include "poslsh/reference_attention.hpp"
#include "poslsh/samplers.hpp"
#include "poslsh/slopes.hpp"
#include "poslsh/tiled_attention.hpp"
#include "poslsh/types.hpp"
#include "poslsh/version.hpp"
