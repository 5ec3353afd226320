// The dense ALiBi kernel against its defining formula and its structure.
#include <cmath>
#include <poslsh/reference/alibi_kernel.hpp>

#include "test_support.hpp"

TEMPLATE_TEST_CASE("alibi_kernel_dense is exp(-|i-j|/sigma), Toeplitz, causal lower",
                   "[alibi_kernel]", float, double) {
  const double sigma = 3.0;
  const auto full = poslsh::alibi_kernel_dense<TestType>(12, sigma, Masking::bidirectional);
  const auto causal = poslsh::alibi_kernel_dense<TestType>(12, sigma, Masking::causal);
  const double r = std::exp(-1.0 / sigma);
  for (Index i = 0; i < 12; ++i) {
    for (Index j = 0; j < 12; ++j) {
      INFO("i " << i << ", j " << j);
      // exp(-|i-j|/sigma) = r^|i-j|: a second way to the same number.
      const double expected = std::pow(r, static_cast<double>(std::abs(i - j)));
      CHECK(static_cast<double>(full(i, j)) ==
            Approx(expected).epsilon(poslsh_test::tolerance<TestType>()));
      CHECK(causal(i, j) == (j <= i ? full(i, j) : TestType(0)));
    }
  }
  CHECK(poslsh::alibi_kernel_dense<TestType>(0, 1.0, Masking::causal).size() == 0);
}

TEST_CASE("alibi_kernel_dense rejects bad n and sigma", "[alibi_kernel][invalid]") {
  require_invalid_argument([] { poslsh::alibi_kernel_dense<float>(-2, 1.0, Masking::causal); },
                           "n");
  require_invalid_argument([] { poslsh::alibi_kernel_dense<float>(4, 0.0, Masking::causal); },
                           "sigma");
  require_invalid_argument([] { poslsh::alibi_kernel_dense<float>(4, NAN, Masking::causal); },
                           "sigma");
}
