// Block plans: cumulative offsets that cover [0, total) without gaps, agree with the partition,
// keep sequences apart, and refuse totals beyond int32.
#include <algorithm>
#include <poslsh/interop/block_plan.hpp>
#include <vector>

#include "test_support.hpp"

using poslsh::BlockPlan;

TEST_CASE("block_plan of one sequence equals the block boundaries", "[plan]") {
  for (double sigma : {0.4, 3.0, 50.0}) {
    for (const poslsh::BinHash& hash : poslsh::rbf_hashes(sigma, 20, 5, 1)) {
      const BlockPlan plan = poslsh::block_plan(hash, 777);
      const std::vector<Index> boundaries = poslsh::block_boundaries(hash, 777);
      REQUIRE(plan.cu_seqlens.size() == boundaries.size());
      std::int32_t longest = 0;
      for (std::size_t r = 0; r < boundaries.size(); ++r) {
        INFO("sigma " << sigma << ", boundary " << r);
        CHECK(plan.cu_seqlens[r] == boundaries[r]);
        if (r > 0) longest = std::max(longest, plan.cu_seqlens[r] - plan.cu_seqlens[r - 1]);
      }
      CHECK(plan.cu_seqlens.front() == 0);
      CHECK(plan.cu_seqlens.back() == 777);
      CHECK(plan.max_seqlen == longest);
      CHECK(plan.blocks() == static_cast<Index>(boundaries.size()) - 1);
    }
  }
}

TEST_CASE("block_plan of a batch is each sequence's plan, offset and concatenated", "[plan]") {
  const std::vector<Index> lengths{100, 0, 1, 257, 33};
  for (const poslsh::BinHash& hash : poslsh::rbf_hashes(7.0, 10, 9, 0)) {
    const BlockPlan batch = poslsh::block_plan(hash, lengths);
    std::vector<std::int32_t> expected{0};
    std::int32_t longest = 0;
    Index offset = 0;
    for (Index length : lengths) {
      const BlockPlan alone = poslsh::block_plan(hash, length);
      for (std::size_t r = 1; r < alone.cu_seqlens.size(); ++r)
        expected.push_back(static_cast<std::int32_t>(offset + alone.cu_seqlens[r]));
      longest = std::max(longest, alone.max_seqlen);
      offset += length;
    }
    CHECK(batch.cu_seqlens == expected);
    CHECK(batch.max_seqlen == longest);
    CHECK(batch.cu_seqlens.back() == 391);
    CHECK(std::is_sorted(batch.cu_seqlens.begin(), batch.cu_seqlens.end()));
    CHECK(std::adjacent_find(batch.cu_seqlens.begin(), batch.cu_seqlens.end()) ==
          batch.cu_seqlens.end());
  }
}

TEST_CASE("fixed_blocks_plan cuts blocks of 2 sigma", "[plan]") {
  const BlockPlan plan = poslsh::fixed_blocks_plan(2.0, {10, 5});
  CHECK(plan.cu_seqlens == std::vector<std::int32_t>{0, 4, 8, 10, 14, 15});
  CHECK(plan.max_seqlen == 4);
}

TEST_CASE("block plans check lengths, int32 overflow and hashes", "[plan][invalid]") {
  const poslsh::BinHash hash{4.0, 1.0};
  require_invalid_argument(
      [&] {
        poslsh::block_plan(hash, std::vector<Index>{5, -1});
      },
      "sequence_lengths");
  // 2^31 positions in total do not fit in int32; the check happens before any allocation.
  require_invalid_argument(
      [&] {
        poslsh::block_plan(hash, std::vector<Index>{Index{1} << 30, Index{1} << 30});
      },
      "sequence_lengths");
  require_invalid_argument([&] { poslsh::block_plan(hash, Index{-3}); }, "n");
  require_invalid_argument([&] { poslsh::block_plans(poslsh::HashSet{}, {4}); }, "hashes");
  require_invalid_argument(
      [&] {
        poslsh::block_plan(poslsh::BinHash{0.0, 0.0}, Index{4});
      },
      "hash.width");
}
