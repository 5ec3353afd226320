// Instantiates every kernel of the umbrella header for float and double, and the tile-engine
// kernels for Eigen::bfloat16 and Eigen::half. Built (by the test
// portable_build) with the compiler's default instruction set, without -march=native, as a
// user's program is: the kernels must compile for every packet size Eigen may pick (SSE2 and
// NEON have 2 doubles per packet, AVX 4, AVX-512 8). The function is never called.
#include <poslsh/poslsh.hpp>

namespace poslsh_portable {

using namespace poslsh;

template <typename Scalar>
void every_kernel() {
  const RowMatrix<Scalar> q(4, 3), k(4, 3), v(4, 2);
  RowMatrix<Scalar> out(4, 2), row(1, 2);
  const HashSet hashes = rbf_hashes(2.0, 2, 1);
  const AttentionOptions options;
  lsh_attention_fused<Scalar>(q, k, v, hashes, out, options);
  out = lsh_attention_fused<Scalar>(q, k, v, hashes, options);
  lsh_attention_per_sample<Scalar>(q, k, v, hashes, out, options);
  out = lsh_attention_per_sample<Scalar>(q, k, v, hashes, options);
  out = fixed_blocks_attention<Scalar>(q, k, v, 2.0, options);
  lsh_attention_by_blocks<Scalar>(q, k, v, hashes, out, options);
  alibi_attention_tiled<Scalar>(q, k, v, 2.0, out, options);
  out = alibi_attention_tiled<Scalar>(q, k, v, 2.0, options);
  alibi_attention_tiled_rows<Scalar>(q, k, v, 2.0, 0, 4, out, options);
  alibi_attention_banded<Scalar>(q, k, v, 2.0, 3, out, options);
  out = alibi_attention_banded<Scalar>(q, k, v, 2.0, 3, options);
  alibi_attention_banded_rows<Scalar>(q, k, v, 2.0, 3, 0, 4, out, options);
  alibi_attention_reference<Scalar>(q, k, v, 2.0, out, options);
  out = alibi_attention_reference<Scalar>(q, k, v, 2.0, options);
  lsh_attention_decode<Scalar>(q.row(3), k, v, 3, hashes, row, options);
  alibi_attention_decode_exact<Scalar>(q.row(3), k, v, 3, 2.0, row, options);
  multihead_attention<Scalar>(interleaved_heads<const Scalar>(q.data(), 4, 1, 3),
                              interleaved_heads<const Scalar>(k.data(), 4, 1, 3),
                              interleaved_heads<const Scalar>(v.data(), 4, 1, 2),
                              interleaved_heads<Scalar>(out.data(), 4, 1, 2), MultiHeadOptions{});
  LseMerger<Scalar> merger(4, 2);
  merger.add(out, Eigen::Matrix<Scalar, Eigen::Dynamic, 1>::Zero(4));
  merger.result(out);
  const RowMatrix<Scalar> kernel = alibi_kernel_dense<Scalar>(4, 2.0, Masking::causal);
  const RowMatrix<Scalar> mask = bin_mask_dense<Scalar>(hashes.front(), 4, Masking::causal);
  const RowMatrix<Scalar> mean = mean_mask_dense<Scalar>(hashes, 4, Masking::causal);
  static_cast<void>(kernel);
  static_cast<void>(mask);
  static_cast<void>(mean);
}

/// The tile-engine kernels on half-precision storage: Q, K, V and the output in Half, float
/// queries over a Half KV cache into a float output.
template <typename Half>
void every_half_kernel() {
  const RowMatrix<Half> q(4, 3), k(4, 3), v(4, 2);
  const RowMatrix<float> qf(4, 3);
  RowMatrix<Half> out(4, 2);
  RowMatrix<float> outf(4, 2);
  const HashSet hashes = rbf_hashes(2.0, 2, 1);
  const AttentionOptions options;
  lsh_attention_fused<Half>(q, k, v, hashes, out, options);
  lsh_attention_fused<float, Half, float>(qf, k, v, hashes, outf, options);
  out = lsh_attention_fused<Half>(q, k, v, hashes, options);
  alibi_attention_tiled<Half, Half, float>(q, k, v, 2.0, outf, options);
  alibi_attention_tiled<float, Half, float>(qf, k, v, 2.0, outf, options);
  out = alibi_attention_tiled<Half>(q, k, v, 2.0, options);
  alibi_attention_tiled_rows<Half>(q, k, v, 2.0, 0, 4, out, options);
  alibi_attention_banded<Half, Half, float>(q, k, v, 2.0, 3, outf, options);
  alibi_attention_banded_rows<Half>(q, k, v, 2.0, 3, 0, 4, out, options);
  for (Method method : {Method::lsh_fused, Method::exact_tiled}) {
    MultiHeadOptions multihead_options;
    multihead_options.method = method;
    multihead_attention(interleaved_heads<const float>(qf.data(), 4, 1, 3),
                        interleaved_heads<const Half>(k.data(), 4, 1, 3),
                        interleaved_heads<const Half>(v.data(), 4, 1, 2),
                        interleaved_heads<float>(outf.data(), 4, 1, 2), multihead_options);
  }
}

template void every_kernel<float>();
template void every_kernel<double>();
template void every_half_kernel<Eigen::bfloat16>();
template void every_half_kernel<Eigen::half>();

}  // namespace poslsh_portable
