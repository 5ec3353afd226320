// poslsh as planner and merger around an external variable-length attention kernel:
//   plan (cu_seqlens per sample) -> varlen kernel (plain attention per block, with lse)
//   -> LseMerger -> the LSH estimate of ALiBi attention,
// checked against the built-in fused and per-sample kernels. The varlen kernel here is a
// deliberately simple stand-in with the calling convention of flash_attn_varlen_func:
// packed (total, d) Q/K/V, cu_seqlens_q = cu_seqlens_k = the plan, max_seqlen, causal,
// softmax_scale; it returns the output and softmax_lse (natural log, per row).
#include <cmath>
#include <cstdio>
#include <poslsh/poslsh.hpp>
#include <string>
#include <vector>

#include "example_cli.hpp"

namespace {

namespace cli = poslsh_examples;
using Matrix = poslsh::RowMatrix<float>;

// Stand-in varlen kernel: plain softmax attention inside each segment
// [cu_seqlens[b], cu_seqlens[b+1]), no positional bias.
void varlen_attention(const Matrix& q, const Matrix& k, const Matrix& v,
                      const std::vector<std::int32_t>& cu_seqlens, std::int32_t max_seqlen,
                      bool causal, float softmax_scale, Matrix& out, Eigen::VectorXf& softmax_lse) {
  Eigen::VectorXf scores(max_seqlen);
  for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const poslsh::Index begin = cu_seqlens[b], end = cu_seqlens[b + 1];
    for (poslsh::Index i = begin; i < end; ++i) {
      const poslsh::Index last = causal ? i : end - 1;
      const poslsh::Index count = last + 1 - begin;
      scores.head(count) = softmax_scale * (k.middleRows(begin, count) * q.row(i).transpose());
      const float row_max = scores.head(count).maxCoeff();
      scores.head(count) = (scores.head(count).array() - row_max).exp().matrix();
      const float total = scores.head(count).sum();
      out.row(i) = scores.head(count).transpose() * v.middleRows(begin, count) / total;
      softmax_lse(i) = row_max + std::log(total);
    }
  }
}

const char* const program = "varlen_pipeline";

const char* const usage =
    "usage: varlen_pipeline [--n N] [--d D] [--sigma S] [--samples K] [--seed X] "
    "[--bidirectional]\n"
    "Runs plan -> stand-in varlen kernel -> log-sum-exp merge and compares the result with\n"
    "lsh_attention_fused and lsh_attention_per_sample on the same hashes.\n"
    "defaults: --n 2048 --d 64 --sigma 32 --samples 16 --seed 1 (causal)\n";

}  // namespace

int main(int argc, char** argv) {
  poslsh::Index n = 2048, d = 64, samples = 16;
  double sigma = 32.0;
  std::uint64_t seed = 1;
  bool causal = true;
  for (cli::Args args(program, usage, argc, argv); args.next();) {
    if (!(args.number("--n", n) || args.number("--d", d) || args.number("--sigma", sigma) ||
          args.number("--samples", samples) || args.number("--seed", seed) ||
          args.set("--bidirectional", causal, false))) {
      args.unknown();
    }
  }
  if (n < 1) cli::fail(program, "--n must be >= 1");
  if (d < 1) cli::fail(program, "--d must be >= 1");
  try {
    const Matrix q = Matrix::Random(n, d), k = Matrix::Random(n, d), v = Matrix::Random(n, d);
    const auto tau = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    const poslsh::HashSet hashes = poslsh::rbf_hashes(sigma, samples, seed);

    // 1. Plan: one cu_seqlens per sample. 2. Varlen kernel. 3. Merge by lse, one sample at a time.
    poslsh::LseMerger<float> merger(n, d);
    Matrix sample_out(n, d);
    Eigen::VectorXf sample_lse(n);
    long long pairs = 0;
    for (const poslsh::BlockPlan& plan : poslsh::block_plans(hashes, {n})) {
      varlen_attention(q, k, v, plan.cu_seqlens, plan.max_seqlen, causal, tau, sample_out,
                       sample_lse);
      merger.add(sample_out, sample_lse);
      for (poslsh::Index b = 0; b < plan.blocks(); ++b) {
        const long long size = plan.cu_seqlens[static_cast<std::size_t>(b) + 1] -
                               plan.cu_seqlens[static_cast<std::size_t>(b)];
        pairs += causal ? size * (size + 1) / 2 : size * size;
      }
    }
    Matrix merged(n, d);
    merger.result(merged);

    poslsh::AttentionOptions options;
    options.masking = causal ? poslsh::Masking::causal : poslsh::Masking::bidirectional;
    const Matrix fused = poslsh::lsh_attention_fused<float>(q, k, v, hashes, options);
    const Matrix per_sample = poslsh::lsh_attention_per_sample<float>(q, k, v, hashes, options);
    const Matrix exact = poslsh::alibi_attention_tiled<float>(q, k, v, sigma, options);
    std::printf("n = %ld, d = %ld, sigma = %g, s = %ld, %s\n", static_cast<long>(n),
                static_cast<long>(d), sigma, static_cast<long>(samples),
                causal ? "causal" : "bidirectional");
    std::printf("varlen kernel evaluated %lld pairs over %ld samples\n", pairs,
                static_cast<long>(samples));
    std::printf("max |merged - fused|       = %.3g\n", (merged - fused).cwiseAbs().maxCoeff());
    std::printf("max |merged - per_sample|  = %.3g\n", (merged - per_sample).cwiseAbs().maxCoeff());
    std::printf("relative Frobenius error of the LSH estimate against exact ALiBi = %.4f\n",
                (merged - exact).norm() / exact.norm());
    return (merged - fused).cwiseAbs().maxCoeff() < 1e-4f ? 0 : 1;
  } catch (const std::invalid_argument& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 2;
  }
}
