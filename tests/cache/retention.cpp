// The retention rule (first_live_key, kv_head_first_live_key) against a brute-force scan of
// every method's weights: key j is live at t iff some query i >= t gives it a nonzero weight,
// the live keys form a suffix, the first live key never decreases, it is the head's key
// range at t (head_key_range), and a K/V head keeps the union of its query heads; bad input is
// named.
#include <algorithm>
#include <poslsh/cache/retention.hpp>
#include <poslsh/lsh/hash.hpp>
#include <poslsh/parallel/plan.hpp>
#include <string>
#include <vector>

#include "retention_oracle.hpp"
#include "test_support.hpp"

using poslsh::HeadMethod;

namespace {

// One head of each kind: its method, sigma, band, window_left, window_right and samples.
std::vector<HeadMethod> retention_heads() {
  std::vector<HeadMethod> heads;
  for (double sigma : {2.5, 7.0, 30.0})
    heads.push_back(
        {Method::lsh_fused, sigma, 0, -1, -1, poslsh::rbf_hashes(sigma, 8, 11, heads.size())});
  heads.push_back({Method::lsh_per_sample, 12.0, 0, -1, -1, poslsh::rbf_hashes(12.0, 1, 3, 0)});
  heads.push_back({Method::fixed_blocks, 9.0, 0, -1, -1, {poslsh::fixed_blocks_hash(9.0)}});
  heads.push_back({Method::exact_banded, 10.0, 37});
  heads.push_back({Method::exact_banded, 10.0, 37, 20});
  heads.push_back({Method::exact_tiled, 50.0, 0, 64});
  heads.push_back({Method::exact_tiled, 50.0});
  return heads;
}

}  // namespace

TEST_CASE("first_live_key is the first key a later query reads, by a scan of the weights",
          "[cache][retention]") {
  const Index n = 1500;
  for (const HeadMethod& head : retention_heads()) {
    INFO(poslsh::enum_name(head.method)
         << " sigma " << head.sigma << " band " << head.band << " window " << head.window_left);
    const Index horizon = poslsh_test::widest_reach(head);
    std::vector<Index> last(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j)
      last[static_cast<std::size_t>(j)] = poslsh_test::last_reader(head, j, horizon);
    Index previous = 0;
    for (Index t = 0; t < n; ++t) {
      const Index first = poslsh::first_live_key(head, t);
      INFO("t = " << t << ", first live key " << first);
      REQUIRE(first >= 0);
      REQUIRE(first <= t);
      // Every key before it is read by no query >= t; it and every key after it up to t are
      // read by the query at t itself (the live keys are a suffix).
      for (Index j = 0; j < first; ++j) REQUIRE(last[static_cast<std::size_t>(j)] < t);
      for (Index j = first; j <= t; ++j) REQUIRE(poslsh_test::reads_key(head, t, j));
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
