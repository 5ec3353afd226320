// poslsh quickstart: the mean of s random block masks approaches the ALiBi kernel L*.
// Prints max |M~ - L*| and ||M~ - L*||_2 for s = 1, 2, 4, ..., 256.
#include <poslsh/poslsh.hpp>

#include <Eigen/Eigenvalues>

#include <cstdio>

int main() {
  const poslsh::Index n = 512;
  const double sigma = 16.0;
  const auto kernel = poslsh::alibi_kernel_dense<double>(n, sigma, poslsh::Masking::bidirectional);
  std::printf("n = %ld, sigma = %g, bidirectional\n%6s %12s %12s\n", static_cast<long>(n), sigma,
              "s", "max_err", "spectral");
  for (poslsh::Index s = 1; s <= 256; s *= 2) {
    const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, s, /*seed=*/1);
    const auto mean = poslsh::mean_mask_dense<double>(hashes, n, poslsh::Masking::bidirectional);
    const poslsh::RowMatrix<double> error = mean - kernel;
    const Eigen::SelfAdjointEigenSolver<poslsh::RowMatrix<double>> solver(error, Eigen::EigenvaluesOnly);
    std::printf("%6ld %12.5f %12.5f\n", static_cast<long>(s), error.cwiseAbs().maxCoeff(),
                solver.eigenvalues().cwiseAbs().maxCoeff());
  }
}
