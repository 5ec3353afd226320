// The retention rule (first_live_key, kv_head_first_live_key) against a brute-force scan of
// every method's weights: key j is live at t iff some query i >= t gives it a nonzero weight,
// the live keys form a suffix, the first live key never decreases, it is the head's key
// range at t (head_key_range), and a K/V head keeps the union of its query heads; bad input is
// named.
#include <algorithm>
#include <cmath>
#include <limits>
#include <poslsh/cache/retention.hpp>
#include <poslsh/lsh/hash.hpp>
#include <poslsh/parallel/plan.hpp>
#include <string>
#include <vector>

#include "test_support.hpp"

using poslsh::HeadMethod;

namespace {

// Whether the query at i gives key j <= i a nonzero weight under `head` (causal or not: the
// same for j <= i), from the weights' definitions: a shared bin in some sample, or a distance
// inside the band and the window.
bool retention_weight(const HeadMethod& head, Index i, Index j) {
  if (poslsh::method_draws_hashes(head.method) || head.method == Method::fixed_blocks) {
    for (const BinHash& hash : head.hashes)
      if (hash.bin(i) == hash.bin(j)) return true;
    return false;
  }
  if (head.method == Method::exact_banded && i - j > head.band) return false;
  return head.window_left < 0 || i - j <= head.window_left;
}

// The last query position (>= j) that reads key j, by a scan over the queries up to `horizon`
// past j (beyond the widest bin, band or window); `retention_never` when the head reads it forever.
constexpr Index retention_never = std::numeric_limits<Index>::max();
Index last_reader(const HeadMethod& head, Index j, Index horizon) {
  if (head.method == Method::exact_tiled && head.window_left < 0) return retention_never;
  Index last = j;
  for (Index i = j; i <= j + horizon; ++i)
    if (retention_weight(head, i, j)) last = i;
  return last;
}

Index widest_reach(const HeadMethod& head) {
  double reach = static_cast<double>(std::max<Index>(head.band, head.window_left));
  for (const BinHash& hash : head.hashes) reach = std::max(reach, hash.width);
  return static_cast<Index>(std::ceil(reach)) + 2;
}

std::vector<HeadMethod> retention_heads() {
  std::vector<HeadMethod> heads;
  for (double sigma : {2.5, 7.0, 30.0}) {
    HeadMethod lsh;
    lsh.method = Method::lsh_fused;
    lsh.sigma = sigma;
    lsh.hashes = poslsh::rbf_hashes(sigma, 8, 11, heads.size());
    heads.push_back(lsh);
  }
  HeadMethod one_sample;
  one_sample.method = Method::lsh_per_sample;
  one_sample.sigma = 12.0;
  one_sample.hashes = poslsh::rbf_hashes(12.0, 1, 3, 0);
  heads.push_back(one_sample);
  HeadMethod fixed;
  fixed.method = Method::fixed_blocks;
  fixed.sigma = 9.0;
  fixed.hashes = {poslsh::fixed_blocks_hash(9.0)};
  heads.push_back(fixed);
  HeadMethod banded;
  banded.method = Method::exact_banded;
  banded.sigma = 10.0;
  banded.band = 37;
  heads.push_back(banded);
  HeadMethod banded_window = banded;
  banded_window.window_left = 20;
  heads.push_back(banded_window);
  HeadMethod window;
  window.method = Method::exact_tiled;
  window.sigma = 50.0;
  window.window_left = 64;
  heads.push_back(window);
  HeadMethod exact;
  exact.method = Method::exact_tiled;
  exact.sigma = 50.0;
  heads.push_back(exact);
  return heads;
}

}  // namespace

TEST_CASE("first_live_key is the first key a later query reads, by a scan of the weights",
          "[cache][retention]") {
  const Index n = 1500;
  for (const HeadMethod& head : retention_heads()) {
    INFO(poslsh::enum_name(head.method)
         << " sigma " << head.sigma << " band " << head.band << " window " << head.window_left);
    const Index horizon = widest_reach(head);
    std::vector<Index> last(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j) last[static_cast<std::size_t>(j)] = last_reader(head, j, horizon);
    Index previous = 0;
    for (Index t = 0; t < n; ++t) {
      const Index first = poslsh::first_live_key(head, t);
      INFO("t = " << t << ", first live key " << first);
      REQUIRE(first >= 0);
      REQUIRE(first <= t);
      // Every key before it is read by no query >= t; it and every key after it up to t are
      // read by the query at t itself (the live keys are a suffix).
      for (Index j = 0; j < first; ++j) REQUIRE(last[static_cast<std::size_t>(j)] < t);
      for (Index j = first; j <= t; ++j) REQUIRE(retention_weight(head, t, j));
      CHECK(first >= previous);
      previous = first;
      const poslsh::PositionRange range =
          poslsh::head_key_range(head, {t, t + 1}, t + 1, Masking::causal);
      CHECK(range.begin == first);
    }
  }
}

TEST_CASE("a K/V head keeps the union of its query heads' keys", "[cache][retention]") {
  const std::vector<HeadMethod> heads = retention_heads();
  const auto query_heads = static_cast<Index>(heads.size());
  const Index n = 800;
  for (Index kv_heads : {Index{1}, Index{3}, query_heads}) {
    const Index group = query_heads / kv_heads;
    for (Index g = 0; g < kv_heads; ++g)
      for (Index t = 0; t < n; t += 7) {
        Index union_first = t;
        for (Index h = g * group; h < (g + 1) * group; ++h)
          union_first =
              std::min(union_first, poslsh::first_live_key(heads[static_cast<std::size_t>(h)], t));
        CHECK(poslsh::kv_head_first_live_key(heads, kv_heads, g, t) == union_first);
      }
  }
}

TEST_CASE("the retention rule rejects bad input by name", "[cache][retention]") {
  const std::vector<HeadMethod> heads = retention_heads();
  require_invalid_argument([&] { poslsh::first_live_key(heads[0], -1); }, "t");
  HeadMethod no_hashes = heads[0];
  no_hashes.hashes.clear();
  require_invalid_argument([&] { poslsh::first_live_key(no_hashes, 5); }, "hashes");
  HeadMethod bad_band = heads[5];
  bad_band.band = -2;
  require_invalid_argument([&] { poslsh::first_live_key(bad_band, 5); }, "head");
  HeadMethod bad_sigma = heads[5];
  bad_sigma.sigma = -1.0;
  require_invalid_argument([&] { poslsh::first_live_key(bad_sigma, 5); }, "head");
  require_invalid_argument([&] { poslsh::kv_head_first_live_key({}, 1, 0, 3); }, "heads");
  require_invalid_argument([&] { poslsh::kv_head_first_live_key(heads, 4, 0, 3); }, "kv_heads");
  require_invalid_argument([&] { poslsh::kv_head_first_live_key(heads, 3, 3, 3); }, "kv_head");
  require_invalid_argument([&] { poslsh::kv_head_first_live_key(heads, 3, 0, -4); }, "t");
}
