// poslsh quickstart: ALiBi attention approximated by Positional LSH, against the exact result.
#include <cstdio>
#include <poslsh/poslsh.hpp>

int main() {
  const poslsh::Index n = 4096, d = 64;
  const double sigma = 16.0;  // ALiBi slope m = 1/16
  using Matrix = poslsh::RowMatrix<float>;
  const Matrix q = Matrix::Random(n, d), k = Matrix::Random(n, d), v = Matrix::Random(n, d);

  // Exact causal ALiBi attention softmax(QK^T/sqrt(d) - |i-j|/sigma) V, streamed in tiles.
  const Matrix exact = poslsh::alibi_attention_tiled<float>(q, k, v, sigma);

  std::printf("n = %ld, d = %ld, sigma = %g, causal\n%8s %14s %16s\n", static_cast<long>(n),
              static_cast<long>(d), sigma, "samples", "rel. error", "pairs per query");
  for (poslsh::Index s : {1, 4, 16, 64, 256}) {
    // s random block partitions of the positions; head 0 of seed 2026.
    const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, s, /*seed=*/2026, /*stream=*/0);
    const Matrix approx = poslsh::lsh_attention_fused<float>(q, k, v, hashes);
    const double pairs =
        static_cast<double>(poslsh::lsh_fused_pair_count(hashes, n, poslsh::Masking::causal));
    std::printf("%8ld %14.4f %16.1f\n", static_cast<long>(s),
                (approx - exact).norm() / exact.norm(), pairs / static_cast<double>(n));
  }
  std::printf("exact attention evaluates %.1f pairs per query\n", static_cast<double>(n + 1) / 2.0);
}
