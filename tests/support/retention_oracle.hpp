// The brute-force retention oracle of the cache tests (tests/cache/retention.cpp,
// tests/cache/bounded_kv_cache.cpp): which keys a head's queries read, from the weights'
// definitions, and the last query that reads each key, by a scan over the queries.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <poslsh/lsh/hash.hpp>
#include <poslsh/multihead/methods.hpp>

#include "test_support.hpp"

namespace poslsh_test {

/// Whether the query at i gives key j <= i a nonzero weight under `head` (causal or not: the
/// same for j <= i), from the weights' definitions: a shared bin in some sample, or a distance
/// inside the band and the window.
inline bool reads_key(const poslsh::HeadMethod& head, Index i, Index j) {
  if (poslsh::method_draws_hashes(head.method) || head.method == poslsh::Method::fixed_blocks) {
    for (const poslsh::BinHash& hash : head.hashes)
      if (hash.bin(i) == hash.bin(j)) return true;
    return false;
  }
  if (head.method == poslsh::Method::exact_banded && i - j > head.band) return false;
  return head.window_left < 0 || i - j <= head.window_left;
}

/// last_reader of a key that the head reads forever (exact_tiled with no window).
inline constexpr Index read_forever = std::numeric_limits<Index>::max();

/// How far past key j a query may still read it: the widest bin, band or window, plus 2.
inline Index widest_reach(const poslsh::HeadMethod& head) {
  double reach = static_cast<double>(std::max<Index>(head.band, head.window_left));
  for (const poslsh::BinHash& hash : head.hashes) reach = std::max(reach, hash.width);
  return static_cast<Index>(std::ceil(reach)) + 2;
}

/// The last query position (>= j) that reads key j, by a scan over the queries j .. j + horizon
/// (horizon: widest_reach); read_forever when the head reads it forever.
inline Index last_reader(const poslsh::HeadMethod& head, Index j, Index horizon) {
  if (head.method == poslsh::Method::exact_tiled && head.window_left < 0) return read_forever;
  Index last = j;
  for (Index i = j; i <= j + horizon; ++i)
    if (reads_key(head, i, j)) last = i;
  return last;
}

}  // namespace poslsh_test
