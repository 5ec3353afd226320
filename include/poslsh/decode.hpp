// poslsh: decode, new queries ending at position t over a KV cache of rows 0..t (causal): one
// query (m = 1), or m >= 1 queries at positions t - m + 1 .. t (multi-token decode), each row
// computed as the one-query decode at its position. The prefill kernels with
// AttentionOptions::query_offset are the other multi-token decode: their rows are bitwise
// those of the full prefill.
//
// Checked (std::invalid_argument naming the argument): query has 1 .. t + 1 rows, shapes of keys,
// values and out, 0 <= t < keys.rows(), causal masking, a finite scale; the LSH decoder: a
// non-empty set of valid hashes; the exact decoder: sigma finite and > 0. Not checked: the values
// (a NaN in the query gives a NaN output; see types.hpp) and cache rows past t, which are never
// read.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "poslsh/detail/alibi_slope.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/streaming_softmax.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/types.hpp"

namespace poslsh {

namespace detail {

template <typename QType, typename KType, typename VType, typename OutType>
void require_decode_arguments(const char* function, const QType& query, const KType& keys,
                              const VType& values, Index t, const OutType& out,
                              const AttentionOptions& options) {
  require(query.rows() >= 1, function, "query", query.rows(), "must have at least 1 row");
  require_qkv_shapes(function, query, keys, values, QkvNames{"query", "keys", "values"});
  require(t >= 0 && t < keys.rows(), function, "t", t,
          "must lie in [0, keys.rows()) = [0, " + std::to_string(keys.rows()) + ")");
  require(query.rows() <= t + 1, function, "query", query.rows(),
          "row count m must be <= t + 1 = " + std::to_string(t + 1) +
              " (rows at positions t - m + 1 .. t)");
  require_output_shape(function, out, query.rows(), values.cols());
  require(options.masking == Masking::causal, function, "options.masking", "bidirectional",
          "decode attends to the cache 0..t only: must be causal");
}

/// out = softmax_j(X_j) V over keys [first, t] given X = log w in scratch, adding
/// s = tau K q (the shared last step of both decoders).
template <typename Scalar, typename QType, typename KType, typename VType, typename OutType>
void weighted_decode(const QType& query, const KType& keys, const VType& values, Index first,
                     Index t, Scalar tau, LogitScratch<Scalar>& scratch, OutType& out) {
  StreamingSoftmax<Scalar> state;
  state.reset(1, values.cols());
  const Index count = t + 1 - first;
  scratch.logits().noalias() += (tau * query) * keys.middleRows(first, count).transpose();
  state.update(0, scratch, values.middleRows(first, count));
  state.finish(0, out);
}

/// begin_k(t) for every hash: the start of t's block in sample k.
inline std::vector<Index> decode_block_begins(const HashSet& hashes, Index t) {
  std::vector<Index> begins;
  begins.reserve(hashes.size());
  for (const BinHash& hash : hashes) begins.push_back(block_containing(hash, t, t + 1).begin);
  return begins;
}

}  // namespace detail

/// First key the LSH decoder reads at position t: min_k begin_k(t), the smallest start of the
/// blocks that contain t, so that the keys with c_tj > 0 are [lsh_decode_first_key, t] (the
/// decoder's cost is t + 1 - lsh_decode_first_key key rows). Throws std::invalid_argument if
/// the hash set is empty or holds an invalid hash, or t < 0.
inline Index lsh_decode_first_key(const HashSet& hashes, Index t) {
  validate_hashes(hashes, "lsh_decode_first_key");
  detail::require_size(t, "lsh_decode_first_key", "t");
  const std::vector<Index> begins = detail::decode_block_begins(hashes, t);
  return *std::min_element(begins.begin(), begins.end());
}

/// LSH decode: row t of lsh_attention_fused / lsh_attention_per_sample (causal) computed from
/// the query q_t alone, out = sum_{j<=t} c_tj e^{tau q_t.k_j} v_j / sum_{j<=t} c_tj e^{tau
/// q_t.k_j}, c_tj = #{k : bin_k(t) = bin_k(j)}. Only keys [min_k begin_k(t), t] are read, where
/// begin_k(t) is the start of t's block in sample k: O(s + band d), independent of t.
/// `keys` and `values` hold at least t + 1 rows (the cache); rows after t are not read.
/// With m query rows, row r is this at position p = t - m + 1 + r (keys 0 .. p).
/// Throws std::invalid_argument naming a bad argument (shapes, t, hashes, masking).
template <typename Scalar>
void lsh_attention_decode(ConstMatrixRef<Scalar> query, ConstMatrixRef<Scalar> keys,
                          ConstMatrixRef<Scalar> values, Index t, const HashSet& hashes,
                          MatrixRef<Scalar> out, const AttentionOptions& options = {}) {
  constexpr const char* function = "lsh_attention_decode";
  detail::require_decode_arguments(function, query, keys, values, t, out, options);
  validate_hashes(hashes, function);
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, options, query.cols()));
  const Index m = query.rows();
  detail::LogitScratch<Scalar> scratch;
  for (Index r = 0; r < m; ++r) {
    const Index position = t - m + 1 + r;
    // c_pj = #{k : begin_k(p) <= j}: counts of block starts, then a running sum over keys.
    const std::vector<Index> begins = detail::decode_block_begins(hashes, position);
    const Index first = *std::min_element(begins.begin(), begins.end());
    scratch.shape(1, position + 1 - first);
    auto logits = scratch.logits();
    logits.setZero();
    for (Index begin : begins) logits(0, begin - first) += Scalar(1);
    for (Index c = 1; c < logits.cols(); ++c) logits(0, c) += logits(0, c - 1);
    detail::log_counts(logits.row(0));
    auto out_row = out.middleRows(r, 1);
    detail::weighted_decode<Scalar>(query.middleRows(r, 1), keys, values, first, position, tau,
                                    scratch, out_row);
  }
}

/// Exact ALiBi decode: out = softmax_j(tau q_t.k_j - (t - j) / sigma) v_j over j = 0..t.
/// O(t d): the cost a KV cache pays without LSH. With m query rows, row r is this at position
/// p = t - m + 1 + r (keys 0 .. p). Throws std::invalid_argument as above.
template <typename Scalar>
void alibi_attention_decode_exact(ConstMatrixRef<Scalar> query, ConstMatrixRef<Scalar> keys,
                                  ConstMatrixRef<Scalar> values, Index t, double sigma,
                                  MatrixRef<Scalar> out, const AttentionOptions& options = {}) {
  constexpr const char* function = "alibi_attention_decode_exact";
  detail::require_decode_arguments(function, query, keys, values, t, out, options);
  detail::require_sigma(sigma, function);
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, options, query.cols()));
  // Bias -(t - j) / sigma from the exact integers j - t (exact in float up to 2^24), with the
  // slope kept finite for distances up to t.
  const Scalar slope = detail::finite_alibi_slope<Scalar>(sigma, t);
  const Index m = query.rows();
  detail::LogitScratch<Scalar> scratch;
  for (Index r = 0; r < m; ++r) {
    const Index position = t - m + 1 + r;
    scratch.shape(1, position + 1);
    scratch.logits() = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>::LinSpaced(
                           position + 1, -static_cast<Scalar>(position), Scalar(0)) *
                       slope;
    auto out_row = out.middleRows(r, 1);
    detail::weighted_decode<Scalar>(query.middleRows(r, 1), keys, values, 0, position, tau, scratch,
                                    out_row);
  }
}

}  // namespace poslsh
