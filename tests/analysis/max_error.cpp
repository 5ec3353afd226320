// The band-and-edge max-norm error against the max over the dense |L* - M~|, and its s^-1/2
// decay.
#include <array>
#include <cmath>
#include <poslsh/analysis/max_error.hpp>
#include <poslsh/reference/alibi_kernel.hpp>
#include <poslsh/reference/masks.hpp>
#include <vector>

#include "error_decay.hpp"
#include "test_support.hpp"

namespace {

RowMatrix<double> dense_error(const poslsh::HashSet& hashes, Index n, double sigma,
                              Masking masking) {
  return poslsh::mean_mask_dense<double>(hashes, n, masking) -
         poslsh::alibi_kernel_dense<double>(n, sigma, masking);
}

}  // namespace

TEST_CASE("max_error equals the dense max of |L* - M~| exactly", "[analysis][slow]") {
  struct Case {
    Index n;
    double sigma;
    Index s;
  };
  // Small sigma (most blocks single positions), ALiBi-like sigmas, and sigma far above n (one
  // block per sample, so the error is only inside the band).
  for (const Case& c : {Case{1, 3.0, 2}, Case{2, 0.5, 1}, Case{200, 0.3, 5}, Case{333, 4.0, 1},
                        Case{500, 16.0, 37}, Case{400, 64.0, 200}, Case{150, 1e5, 3}}) {
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (std::uint64_t seed : {1u, 2u}) {
        const poslsh::HashSet hashes = poslsh::rbf_hashes(c.sigma, c.s, seed, 5);
        const poslsh::MaxError result = poslsh::max_error(hashes, c.n, c.sigma, masking);
        const RowMatrix<double> error = dense_error(hashes, c.n, c.sigma, masking);
        const double expected = error.cwiseAbs().maxCoeff();
        INFO(poslsh_test::masking_name(masking)
             << ", n " << c.n << ", sigma " << c.sigma << ", s " << c.s << ", seed " << seed << ": "
             << result.value << " at (" << result.row << ", " << result.col << "), dense "
             << expected);
        // Both form each entry as |c/s - exp(-d/sigma)| with the same operations: equal bits.
        CHECK(result.value == expected);
        REQUIRE(result.row >= 0);
        REQUIRE(result.col >= 0);
        CHECK(std::abs(error(result.row, result.col)) == result.value);
      }
    }
  }
}

TEST_CASE("max_error across the row-task seam and with hand-made hashes", "[analysis][slow]") {
  // n spans several row tasks, so the per-task walkers start mid-sequence.
  const Index n = 2 * poslsh::detail::analysis_rows_per_task + 77;
  const poslsh::HashSet hashes{poslsh::BinHash{3.5, 1.25}, poslsh::BinHash{10.0, 0.0},
                               poslsh::BinHash{0.25, 0.1}};
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    // Independent check straight from bin(), every row, keys within distance 200: no block is
    // wider than 10, so farther keys have c = 0 and |L*| < exp(-200/6) ~ 3e-15, far below the
    // max (which is at least |1/3 - exp(-1/6)| at a neighbour split by a block edge).
    double expected = 0.0;
    for (Index i = 0; i < n; ++i) {
      const Index last = masking == Masking::causal ? i : std::min(n - 1, i + 200);
      for (Index j = std::max<Index>(0, i - 200); j <= last; ++j) {
        int count = 0;
        for (const poslsh::BinHash& hash : hashes) count += hash.bin(i) == hash.bin(j) ? 1 : 0;
        const double exact = std::exp(-static_cast<double>(i > j ? i - j : j - i) / 6.0);
        expected = std::max(expected, std::abs(count / 3.0 - exact));
      }
    }
    const poslsh::MaxError result = poslsh::max_error(hashes, n, 6.0, masking);
    INFO(poslsh_test::masking_name(masking)
         << ": " << result.value << " at (" << result.row << ", " << result.col << ")");
    CHECK(result.value == expected);
  }
}

TEST_CASE("max_error of an empty sequence is zero", "[analysis]") {
  const poslsh::MaxError result =
      poslsh::max_error(poslsh::rbf_hashes(2.0, 3, 1), 0, 2.0, Masking::causal);
  CHECK(result.value == 0.0);
  CHECK(result.row == -1);
}

TEST_CASE("max error falls like s^-1/2: fitted log-log slope in -0.65 to -0.35",
          "[analysis][slow]") {
  // n = 4096, sigma = 16, s = 4 .. 1024; single realisations give -0.45 to -0.51 (seeds 1 to
  // 5), so each seed is checked on its own. The max is a binomial deviation
  // |c/s - p| ~ sqrt(p (1 - p) / s) maximised over the band, hence the s^-1/2 shape.
  poslsh_test::check_inverse_sqrt_decay(16.0, [](const poslsh::HashSet& hashes, Masking masking) {
    return poslsh::max_error(hashes, 4096, 16.0, masking).value;
  });
}

TEST_CASE("max_error takes any container of BinHash", "[analysis]") {
  const poslsh::HashSet hashes = poslsh::rbf_hashes(5.0, 3, 4, 2);
  const std::array<poslsh::BinHash, 3> array{hashes[0], hashes[1], hashes[2]};
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const poslsh::MaxError from_set = poslsh::max_error(hashes, 300, 5.0, masking);
    const poslsh::MaxError from_array = poslsh::max_error(array, 300, 5.0, masking);
    CHECK(from_array.value == from_set.value);
    CHECK(from_array.row == from_set.row);
    CHECK(from_array.col == from_set.col);
  }
}

TEST_CASE("max_error rejects bad arguments naming them", "[analysis][invalid]") {
  require_invalid_argument([] { poslsh::max_error({}, 10, 2.0, Masking::causal); }, "hashes");
  require_invalid_argument(
      [] { poslsh::max_error(poslsh::rbf_hashes(2.0, 3, 1), -1, 2.0, Masking::causal); }, "n");
  require_invalid_argument(
      [] { poslsh::max_error(poslsh::rbf_hashes(2.0, 3, 1), 10, 0.0, Masking::causal); }, "sigma");
  require_invalid_argument(
      [] {
        poslsh::max_error({poslsh::BinHash{0.0, 0.0}}, 10, 2.0, Masking::causal);
      },
      "hash.width");
}
