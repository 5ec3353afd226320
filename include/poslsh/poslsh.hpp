/// \file
/// \brief poslsh: ALiBi attention, exact (tiled, banded) or by Positional LSH. Includes every
/// public header that needs only Eigen; the spectral error analysis, which needs Spectra, is in
/// poslsh/analysis.hpp.
///
/// The headers by area:
///   core/       views, options, ALiBi slopes, the hash and partition types, matrix units
///   lsh/        the positional hashes, partitions and variance-reduced samplers
///   attention/  single-head forward kernels: tiled, banded, fused, per-sample, partitions,
///               decode, paged
///   multihead/  every all-heads entry point: the method table, forward, forward with lse,
///               backward, packed batches, the per-head planner
///   training/   single-head forward with lse and backward, the mean-of-outputs estimator
///   interop/    block plans, the log-sum-exp merge, bring-your-own block kernel
///   cache/      bounded KV caches for generation: the retention rule per head, the page pool
///               and the all-heads attention over it
///   parallel/   context parallelism: the plan, halos, the K/V ring with its lse merge, the slice
///               backward, traffic
///   analysis/   error measurements of M~ against L* (operators, max error, block statistics)
///   reference/  dense O(n^2) references, for checks only
#pragma once

#include "poslsh/analysis/band_counts.hpp"
#include "poslsh/analysis/block_stats.hpp"
#include "poslsh/analysis/max_error.hpp"
#include "poslsh/analysis/operators.hpp"
#include "poslsh/attention/banded.hpp"
#include "poslsh/attention/decode.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/attention/paged.hpp"
#include "poslsh/attention/partition.hpp"
#include "poslsh/attention/per_sample.hpp"
#include "poslsh/attention/tiled.hpp"
#include "poslsh/cache/bounded_kv_cache.hpp"
#include "poslsh/cache/retention.hpp"
#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/matrix_units.hpp"
#include "poslsh/core/slopes.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/interop/block_kernel.hpp"
#include "poslsh/interop/block_plan.hpp"
#include "poslsh/interop/lse_merge.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/lsh/partition.hpp"
#include "poslsh/lsh/samplers.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/paged.hpp"
#include "poslsh/multihead/planner.hpp"
#include "poslsh/multihead/single_head.hpp"
#include "poslsh/multihead/training.hpp"
#include "poslsh/parallel/context_parallel.hpp"
#include "poslsh/reference/alibi_kernel.hpp"
#include "poslsh/reference/attention.hpp"
#include "poslsh/reference/masks.hpp"
#include "poslsh/training/backward.hpp"
#include "poslsh/training/mean_of_outputs.hpp"
#include "poslsh/version.hpp"
