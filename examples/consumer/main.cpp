// Uses the installed poslsh package: fused LSH attention against the exact tiled kernel.
#include <cstdio>
#include <poslsh/poslsh.hpp>

int main() {
  using Matrix = poslsh::RowMatrix<float>;
  const Matrix q = Matrix::Random(512, 32), k = Matrix::Random(512, 32),
               v = Matrix::Random(512, 32);
  const Matrix exact = poslsh::alibi_attention_tiled<float>(q, k, v, 8.0);
  const Matrix approx =
      poslsh::lsh_attention_fused<float>(q, k, v, poslsh::rbf_hashes(8.0, 64, /*seed=*/7));
  const double error = (approx - exact).norm() / exact.norm();
  std::printf("poslsh %s: relative error %.4f with s = 64\n", poslsh::version_string, error);
  return error < 0.5 ? 0 : 1;
}
