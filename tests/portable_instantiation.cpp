// Instantiates every kernel of the umbrella header for float and double. Built (by the test
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

template void every_kernel<float>();
template void every_kernel<double>();

}  // namespace poslsh_portable
