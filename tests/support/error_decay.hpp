// The decay check of the analysis tests (tests/analysis/max_error.cpp,
// tests/analysis/spectral_error.cpp): an error of s random hashes falls like s^-1/2.
#pragma once

#include <cstdint>
#include <poslsh/lsh/hash.hpp>
#include <vector>

#include "../../examples/log_log_fit.hpp"
#include "test_support.hpp"

namespace poslsh_test {

/// Checks that error(hashes, masking), a double, falls like s^-1/2 in the sample count s: for
/// causal and bidirectional masking and each seed 1, 2, 3 on its own, the log-log slope
/// (poslsh_examples::log_log_slope) of the errors of hashes = rbf_hashes(sigma, s, seed) at
/// s = 4, 8, ..., 1024 lies in [-0.65, -0.35].
template <typename Error>
void check_inverse_sqrt_decay(double sigma, Error&& error) {
  for (poslsh::Masking masking : {poslsh::Masking::causal, poslsh::Masking::bidirectional}) {
    for (std::uint64_t seed : {1u, 2u, 3u}) {
      std::vector<double> samples, errors;
      for (Index s = 4; s <= 1024; s *= 2) {
        samples.push_back(double(s));
        errors.push_back(error(poslsh::rbf_hashes(sigma, s, seed), masking));
      }
      const double slope = poslsh_examples::log_log_slope(samples, errors);
      INFO(masking_name(masking) << ", seed " << seed << ": slope " << slope << ", error at s = 4 "
                                 << errors.front() << ", at s = 1024 " << errors.back());
      CHECK(slope >= -0.65);
      CHECK(slope <= -0.35);
    }
  }
}

}  // namespace poslsh_test
