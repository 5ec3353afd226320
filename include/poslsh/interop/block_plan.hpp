// poslsh: block plans, the blocks of a hash as a variable-length batch (cumulative offsets in
// the cu_seqlens convention of variable-length attention kernels).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/lsh/partition.hpp"

namespace poslsh {

/// The blocks of one hash as a variable-length batch: block r is positions
/// [cu_seqlens[r], cu_seqlens[r+1]) of the (concatenated) sequence, cu_seqlens[0] = 0 and
/// cu_seqlens.back() = total length; max_seqlen is the longest block. Pass cu_seqlens as both
/// cu_seqlens_q and cu_seqlens_k of a variable-length attention kernel.
struct BlockPlan {
  std::vector<std::int32_t> cu_seqlens{0};
  std::int32_t max_seqlen = 0;

  /// Number of blocks.
  Index blocks() const { return static_cast<Index>(cu_seqlens.size()) - 1; }
};

/// The plan of `hash` on a batch of sequences of the given lengths, concatenated: each
/// sequence is cut by the hash on its own positions 0..length-1, so no block crosses two
/// sequences. Throws std::invalid_argument if a length is negative ('sequence_lengths'), the
/// total length does not fit in int32 ('sequence_lengths', total named), or the hash is invalid.
inline BlockPlan block_plan(const BinHash& hash, const std::vector<Index>& sequence_lengths) {
  constexpr const char* function = "block_plan";
  validate_hash(hash, function);
  Index total = 0;
  for (Index length : sequence_lengths) {
    detail::require(length >= 0, function, "sequence_lengths", length, "lengths must be >= 0");
    detail::require(
        length <= std::numeric_limits<std::int32_t>::max() - total, function, "sequence_lengths",
        [&] { return std::to_string(total) + " + " + std::to_string(length); },
        "total length must fit in int32 (<= 2147483647)");
    total += length;
  }
  BlockPlan plan;
  Index offset = 0;
  for (Index length : sequence_lengths) {
    const std::vector<Index> boundaries = block_boundaries(hash, length);
    for (std::size_t r = 1; r < boundaries.size(); ++r) {
      plan.cu_seqlens.push_back(static_cast<std::int32_t>(offset + boundaries[r]));
      plan.max_seqlen =
          std::max(plan.max_seqlen, static_cast<std::int32_t>(boundaries[r] - boundaries[r - 1]));
    }
    offset += length;
  }
  return plan;
}

/// The plan of `hash` on one sequence of n positions. Throws std::invalid_argument if n < 0 or
/// the hash is invalid.
inline BlockPlan block_plan(const BinHash& hash, Index n) {
  detail::require_size(n, "block_plan", "n");
  return block_plan(hash, std::vector<Index>{n});
}

/// One plan per sample: block_plan(h_k, sequence_lengths) for k = 0..s-1.
/// Throws std::invalid_argument if the hash set is empty ('hashes') or invalid, or as
/// block_plan for the lengths.
inline std::vector<BlockPlan> block_plans(const HashSet& hashes,
                                          const std::vector<Index>& sequence_lengths) {
  validate_hashes(hashes, "block_plans");
  std::vector<BlockPlan> plans;
  plans.reserve(hashes.size());
  for (const BinHash& hash : hashes) plans.push_back(block_plan(hash, sequence_lengths));
  return plans;
}

/// The paper's fixed-blocks baseline as one plan: blocks of 2 sigma tokens from position 0
/// (block_plan of fixed_blocks_hash(sigma); throws as they do).
inline BlockPlan fixed_blocks_plan(double sigma, const std::vector<Index>& sequence_lengths) {
  return block_plan(fixed_blocks_hash(sigma), sequence_lengths);
}

}  // namespace poslsh
