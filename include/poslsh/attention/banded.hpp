// poslsh: exact ALiBi attention restricted to a band of keys |i - j| <= band, the
// deterministic competitor of the LSH kernels at a given bias error: O(n band d) time.
#pragma once

#include <algorithm>
#include <cmath>

#include "poslsh/attention/tiled.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/exact.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/tile/alibi_bias.hpp"

namespace poslsh {

/// Band half-width W = ceil(sigma ln(1/eps)) whose dropped ALiBi entries are all small:
/// |i - j| > W implies exp(-|i-j| / sigma) < eps. sigma finite and > 0, eps in (0, 1).
/// Results beyond 9e18 are clamped there (any band >= n keeps every key).
inline Index band_for_bias_error(double sigma, double eps) {
  constexpr const char* function = "band_for_bias_error";
  detail::require_sigma(sigma, function);
  detail::require(eps > 0.0 && eps < 1.0, function, "eps", eps, "must be in (0, 1)");
  const double width = std::ceil(sigma * -std::log(eps));
  return static_cast<Index>(std::min(width, 9.0e18));
}

namespace detail {

/// The window of banded attention over `keys` keys: full_window of the keys within the band,
/// lo <= i - j <= hi with hi = min(band, keys) (lo = 0 causal, -hi bidirectional).
inline ExactWindow banded_window(Index keys, Index band, Masking masking) {
  return full_window(std::min(band, keys), masking);
}

}  // namespace detail

/// Rows [row_begin, row_end) of q of alibi_attention_banded, written to `out_rows`
/// ((row_end - row_begin) x d_v); any split of the rows into ranges (and any chunk of queries
/// at an offset, options.query_offset) gives bitwise the full result. Query tiles in parallel
/// (OpenMP). Throws std::invalid_argument naming a bad argument. Half-precision Q, K, V or output
/// (KVScalar, OutScalar, computed in float): as alibi_attention_tiled (attention/tiled.hpp).
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void alibi_attention_banded_rows(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                                 KeyValueRef<KVScalar> v, double sigma, Index band, Index row_begin,
                                 Index row_end, OutputRef<OutScalar> out_rows,
                                 const AttentionOptions& options = {}) {
  detail::require_size(band, "alibi_attention_banded_rows", "band");
  detail::exact_attention_call<Scalar, KVScalar, OutScalar>(
      "alibi_attention_banded_rows", q, k, v, sigma, row_begin, row_end, out_rows, options,
      [&](Index keys) { return detail::banded_window(keys, band, options.masking); });
}

/// Banded exact ALiBi attention: the softmax of tau Q K^T - |i-j| / sigma over the keys with
/// |i - j| <= band only (causal: also j <= i), the others dropped:
///   out_i = sum_{|i-j| <= band} e^{x_ij} v_j / sum_{|i-j| <= band} e^{x_ij},
///   x_ij = tau q_i.k_j - |i-j| / sigma.
/// With band = band_for_bias_error(sigma, eps) every dropped entry of the ALiBi kernel
/// exp(-|i-j|/sigma) is below eps; band >= n - 1 gives the exact attention. Same tiles and
/// online softmax as alibi_attention_tiled; key tiles outside the band are never touched, so
/// the cost is O(n (band + tile) d). Q is n x d, K n x d, V n x d_v, `out` n x d_v, any row
/// strides; query tiles in parallel (OpenMP), bitwise the same for any thread count. Queries at an
/// offset (options.query_offset = p0; unset: L - m): Q m x d at positions p0 .. p0 + m - 1, K and V
/// L rows, |i - j| and j <= i read with i = p0 + r; row r is bitwise row p0 + r of the
/// self-attention over the L positions. Throws std::invalid_argument naming a bad argument.
/// Half-precision Q, K, V or output (KVScalar, OutScalar, computed in float): as
/// alibi_attention_tiled (attention/tiled.hpp).
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void alibi_attention_banded(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                            KeyValueRef<KVScalar> v, double sigma, Index band,
                            OutputRef<OutScalar> out, const AttentionOptions& options = {}) {
  detail::require_size(band, "alibi_attention_banded", "band");
  detail::exact_attention_call<Scalar, KVScalar, OutScalar>(
      "alibi_attention_banded", q, k, v, sigma, 0, q.rows(), out, options,
      [&](Index keys) { return detail::banded_window(keys, band, options.masking); });
}

/// Returning form of alibi_attention_banded (the output in Q's scalar type).
template <typename Scalar, typename KVScalar = Scalar>
RowMatrix<Scalar> alibi_attention_banded(ConstMatrixRef<Scalar> q, KeyValueRef<KVScalar> k,
                                         KeyValueRef<KVScalar> v, double sigma, Index band,
                                         const AttentionOptions& options = {}) {
  RowMatrix<Scalar> out(q.rows(), v.cols());
  alibi_attention_banded<Scalar, KVScalar, Scalar>(q, k, v, sigma, band, out, options);
  return out;
}

}  // namespace poslsh
