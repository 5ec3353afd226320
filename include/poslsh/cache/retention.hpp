/// \file
/// \brief Which keys a head can still read: the retention rule of bounded KV caches
/// (BoundedKVCache, poslsh/cache/bounded_kv_cache.hpp), from the same hashes, band and window
/// the kernels use (a HeadMethod).
///
/// A head whose newest query sits at position t (every later query at a position i >= t) reads
/// key j < t again only if some query i >= t gives it a nonzero weight. The keys it can still
/// read are the suffix [first_live_key(head, t), ...):
///   exact_banded with band W: t - j <= W (and t - j <= window_left when that is >= 0);
///   exact_tiled: t - j <= window_left when that is >= 0, else every key (0);
///   lsh_fused, lsh_per_sample, mean_of_outputs, fixed_blocks: j >= min_k begin_k(t), begin_k(t)
///     the first position of the block of hash k that holds t. Key j's block in sample k is an
///     interval [b, e) of positions; a query i >= t > j shares it iff i < e, so j is read again
///     iff some sample's block holding j reaches t, i.e. iff j >= begin_k(t) for some k: the
///     live keys are the union over the samples of the blocks holding t, exactly the keys the
///     LSH decoder reads at t (lsh_decode_first_key).
/// Causal and bidirectional masking have the same rule (a later query reaches no further back
/// under either). The first live key does not decrease as t grows (t - W and each begin_k(t)
/// do not), so a key once dead stays dead. Grouped-query attention: a K/V head keeps the union
/// of what its query heads read, from the smallest of their first live keys.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "poslsh/attention/decode.hpp"
#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/multihead/methods.hpp"

namespace poslsh {

namespace detail {

/// The largest distance t - j an exact head reads behind its query: min(band W for
/// exact_banded, window_left when >= 0), or -1 for an exact head without a bound (every key).
inline Index exact_reach_behind(const HeadMethod& head) {
  Index behind = head.method == Method::exact_banded ? head.band : -1;
  if (head.window_left >= 0)
    behind = behind < 0 ? head.window_left : std::min(behind, head.window_left);
  return behind;
}

/// first_live_key without the argument checks.
inline Index first_live_key_unchecked(const HeadMethod& head, Index t) {
  if (method_weights_from_hashes(head.method)) {
    Index first = t;
    for (const BinHash& hash : head.hashes)
      first = std::min(first, block_containing(hash, t, t + 1).begin);
    return first;
  }
  const Index behind = exact_reach_behind(head);
  return behind < 0 ? 0 : std::max<Index>(0, t - behind);
}

/// kv_heads K/V heads shared by query_heads query heads: kv_heads >= 1 divides query_heads.
inline void require_kv_heads(const char* function, Index query_heads, Index kv_heads) {
  require(kv_heads >= 1 && query_heads % kv_heads == 0, function, "kv_heads", kv_heads,
          [&] { return "must divide the query heads (" + std::to_string(query_heads) + ")"; });
}

/// kv_head, one of kv_heads K/V heads: in [0, kv_heads).
inline void require_kv_head(const char* function, Index kv_head, Index kv_heads) {
  require(kv_head >= 0 && kv_head < kv_heads, function, "kv_head", kv_head,
          [&] { return "must lie in [0, kv_heads) = [0, " + std::to_string(kv_heads) + ")"; });
}

/// Checks a head's method for retention: a valid method, sigma and hashes (the methods with
/// blocks), band >= 0 (exact_banded), window_left >= -1. Names `name`.
inline void require_retention_head(const HeadMethod& head, const char* function, const char* name) {
  require(enum_is_valid(head.method), function, name, static_cast<int>(head.method),
          [&] { return "method must be " + enum_name_list<Method>(); });
  require_sigma(head.sigma, function, name);
  if (method_weights_from_hashes(head.method)) validate_hashes(head.hashes, function);
  if (head.method == Method::exact_banded)
    require(head.band >= 0, function, name, head.band, "band must be >= 0");
  require(head.window_left >= -1, function, name, head.window_left,
          "window_left must be -1 (unbounded) or >= 0");
}

}  // namespace detail

/// The first key that a head can read from a query at a position >= t (see the file comment):
/// max(0, t - W) for a band or window W, 0 for exact attention without a window, the smallest
/// first position of the blocks holding t for the methods with hashes. Every key j >= the
/// result (up to t) has a nonzero weight for the query at t itself; no key before it has one
/// for any query at a position >= t. Non-decreasing in t.
/// \throws std::invalid_argument naming 't' (< 0) or 'head' (an invalid method, sigma, band or
///   window; invalid hashes by their own check).
inline Index first_live_key(const HeadMethod& head, Index t) {
  constexpr const char* function = "first_live_key";
  detail::require_size(t, function, "t");
  detail::require_retention_head(head, function, "head");
  return detail::first_live_key_unchecked(head, t);
}

/// The first key that K/V head g reads from a query at a position >= t: the smallest
/// first_live_key of its query heads h (h / G == g, G = heads.size() / kv_heads).
/// \throws std::invalid_argument naming 'heads' (empty, or an invalid head), 'kv_heads' (not
///   dividing the query heads), 'kv_head' (outside [0, kv_heads)) or 't' (< 0).
inline Index kv_head_first_live_key(const std::vector<HeadMethod>& heads, Index kv_heads,
                                    Index kv_head, Index t) {
  constexpr const char* function = "kv_head_first_live_key";
  const auto query_heads = static_cast<Index>(heads.size());
  detail::require(query_heads >= 1, function, "heads", query_heads, "must hold the query heads");
  detail::require_kv_heads(function, query_heads, kv_heads);
  detail::require_kv_head(function, kv_head, kv_heads);
  detail::require_size(t, function, "t");
  const Index group = query_heads / kv_heads;
  Index first = t;
  for (Index h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    const HeadMethod& head = heads[static_cast<std::size_t>(h)];
    detail::require_retention_head(head, function, "heads");
    first = std::min(first, detail::first_live_key_unchecked(head, t));
  }
  return first;
}

}  // namespace poslsh
