// Blocks of a hash: contiguous, covering [0, n), and agreeing with bin() position by position.
#include <poslsh/lsh/partition.hpp>
#include <vector>

#include "test_support.hpp"

namespace {

// Checks the boundaries against bin() directly: a boundary exactly where bin changes.
void check_partition_against_bins(const BinHash& hash, Index n) {
  const std::vector<Index> t = poslsh::block_boundaries(hash, n);
  INFO("width " << hash.width << ", offset " << hash.offset << ", n " << n);
  REQUIRE(t.front() == 0);
  REQUIRE(t.back() == n);
  for (std::size_t r = 0; r + 1 < t.size(); ++r) {
    REQUIRE(t[r] < t[r + 1]);
    for (Index i = t[r]; i < t[r + 1]; ++i) REQUIRE(hash.bin(i) == hash.bin(t[r]));
    if (r > 0) REQUIRE(hash.bin(t[r] - 1) < hash.bin(t[r]));
  }
  for (Index i = 0; i < n; ++i) {
    const poslsh::Block block = poslsh::block_containing(hash, i, n);
    REQUIRE(block.begin <= i);
    REQUIRE(i < block.end);
    REQUIRE(hash.bin(block.begin) == hash.bin(i));
    REQUIRE(hash.bin(block.end - 1) == hash.bin(i));
    REQUIRE((block.begin == 0 || hash.bin(block.begin - 1) != hash.bin(i)));
    REQUIRE((block.end == n || hash.bin(block.end) != hash.bin(i)));
  }
}

}  // namespace

TEST_CASE("block_boundaries cover 0..n-1 with blocks that agree with bin()", "[partition]") {
  for (double sigma : {0.3, 1.0, 2.0, 7.5, 64.0}) {
    const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, 50, 11, 2);
    for (const BinHash& hash : hashes) check_partition_against_bins(hash, 300);
  }
  // Integer widths and offsets put boundaries exactly on bin edges.
  check_partition_against_bins(BinHash{4.0, 0.0}, 17);
  check_partition_against_bins(BinHash{4.0, 3.0}, 17);
  check_partition_against_bins(BinHash{1.0, 0.0}, 9);
  check_partition_against_bins(BinHash{0.1, 0.05}, 9);
}

TEST_CASE("block_boundaries of a known hash", "[partition]") {
  // w = 4, xi = 1: bins of 0..9 are -1,0,0,0,0,1,1,1,1,2.
  CHECK(poslsh::block_boundaries(BinHash{4.0, 1.0}, 10) == std::vector<Index>{0, 1, 5, 9, 10});
  // Inner blocks all have the hash's width, 2 sigma on average for the fixed baseline.
  CHECK(poslsh::block_boundaries(poslsh::fixed_blocks_hash(2.0), 10) ==
        std::vector<Index>{0, 4, 8, 10});
}

TEST_CASE("block_boundaries edge cases: w > n, n = 1, n = 0, w < 1", "[partition]") {
  CHECK(poslsh::block_boundaries(BinHash{1e9, 5e8}, 1000) == std::vector<Index>{0, 1000});
  CHECK(poslsh::block_boundaries(BinHash{3.0, 0.5}, 1) == std::vector<Index>{0, 1});
  CHECK(poslsh::block_boundaries(BinHash{3.0, 0.5}, 0) == std::vector<Index>{0});
  CHECK(poslsh::block_boundaries(BinHash{0.002, 0.001}, 4) == std::vector<Index>{0, 1, 2, 3, 4});
}

TEST_CASE("block_containing near the top of the 32-bit index range", "[partition]") {
  const Index n = Index{2147483647};
  const BinHash hash{37.25, 11.5};
  for (Index i : {n - 1, n - 2, n - 40, n - 1000}) {
    const poslsh::Block block = poslsh::block_containing(hash, i, n);
    INFO("i " << i);
    CHECK(block.begin <= i);
    CHECK(i < block.end);
    CHECK(block.end <= n);
    CHECK(block.size() <= 38);
    CHECK(hash.bin(block.begin) == hash.bin(i));
    CHECK(hash.bin(block.end - 1) == hash.bin(i));
    CHECK((block.end == n || hash.bin(block.end) == hash.bin(i) + 1));
    CHECK(hash.bin(block.begin - 1) == hash.bin(i) - 1);
  }
}

TEST_CASE("block_boundaries rejects bad arguments", "[partition][invalid]") {
  require_invalid_argument([] { poslsh::block_boundaries(BinHash{4.0, 0.0}, -1); }, "n");
  require_invalid_argument([] { poslsh::block_boundaries(BinHash{-4.0, 0.0}, 5); }, "hash.width");
}
