// poslsh: decode, new queries ending at position t over a KV cache of rows 0..t (causal): one
// query (m = 1), or m >= 1 queries at positions t - m + 1 .. t (multi-token decode), each row
// computed as the one-query decode at its position. The prefill kernels with
// AttentionOptions::query_offset are the other multi-token decode: their rows are bitwise
// those of the full prefill.
//
// Scalars: the query in Scalar, the cache in KVScalar, out in OutScalar (float, double,
// Eigen::half or Eigen::bfloat16; double only with double). All-float and all-double calls run
// the one-pass path below; any half-precision view runs the streamed path in float: chunks of
// decode_chunk_rows cache rows are widened to float into reusable buffers as they are read, folded
// into an online softmax, and the float result is rounded once into a half-precision out. The
// bias -(t - j) / sigma is formed in float from the integer distance t - j (exact below 2^24),
// never in a half type.
//
// Checked (std::invalid_argument naming the argument): query has 1 .. t + 1 rows, shapes of keys,
// values and out, 0 <= t < keys.rows(), causal masking, a finite scale; the LSH decoder: a
// non-empty set of valid hashes; the exact decoder: sigma finite and > 0. Not checked: the values
// (a NaN in the query gives a NaN output; see core/types.hpp) and cache rows past t, which are
// never read.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/alibi_slope.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/streaming_softmax.hpp"
#include "poslsh/detail/tile/exponential.hpp"

namespace poslsh {

namespace detail {

template <typename QType, typename KType, typename VType, typename OutType>
void require_decode_arguments(const char* function, const QType& query, const KType& keys,
                              const VType& values, Index t, const OutType& out,
                              const AttentionOptions& options) {
  require(query.rows() >= 1, function, "query", query.rows(), "must have at least 1 row");
  require_qkv_shapes(function, query, keys, values, QkvNames{"query", "keys", "values"});
  require(t >= 0 && t < keys.rows(), function, "t", t, [&] {
    return "must lie in [0, keys.rows()) = [0, " + std::to_string(keys.rows()) + ")";
  });
  require(query.rows() <= t + 1, function, "query", query.rows(), [&] {
    return "row count m must be <= t + 1 = " + std::to_string(t + 1) +
           " (rows at positions t - m + 1 .. t)";
  });
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

/// Cache rows per chunk of the streamed decode: 2048 / max(d, d_v), clamped to [16, 256], so
/// that the widened K and V chunks (8 KiB each) stay in L1 between the widening and the
/// products (32 rows at d = 64 decode 1.3-1.9x faster than 256 rows, whose 64 KiB chunks spill
/// to L2).
inline Index decode_chunk_rows(Index d, Index d_v) {
  return std::clamp<Index>(2048 / std::max<Index>({d, d_v, 1}), 16, 256);
}

/// Reusable buffers of the streamed decode (one per call, reused across rows and chunks).
template <typename C>
struct DecodeScratch {
  WidenBuffer<C> keys, values;
  Eigen::Matrix<C, 1, Eigen::Dynamic> query;
  Eigen::Matrix<C, Eigen::Dynamic, 1> logits;
  Eigen::Matrix<C, Eigen::Dynamic, 1> log_weights;
  Eigen::Matrix<C, 1, Eigen::Dynamic> accumulator;
};

/// Streamed decode of one query row in C over cache rows [first, position]: logits
/// X_j = L_j + tau q.k_j with L_j = log_weight(j) (computed in C from integers), online
/// softmax over chunks of decode_chunk_rows rows widened from KVScalar,
///   M <- max(M, max_j X_j),  l <- e^{M_old - M} l + sum_j e^{X_j - M},
///   acc <- e^{M_old - M} acc + sum_j e^{X_j - M} v_j,   out = acc / l (rounded once to out's
/// scalar). The widened values are exact, so this is the float formula on the cache's values.
template <typename C, typename QRow, typename KVScalar, typename LogWeights, typename OutRow>
void streamed_decode_row(const QRow& query_row, const ConstMatrixRef<KVScalar>& keys,
                         const ConstMatrixRef<KVScalar>& values, Index first, Index position, C tau,
                         const LogWeights& log_weight, DecodeScratch<C>& scratch, OutRow&& out) {
  using OutScalar = typename std::decay_t<OutRow>::Scalar;
  constexpr C minus_infinity = -std::numeric_limits<C>::infinity();
  scratch.query = tau * query_row.template cast<C>();
  scratch.accumulator.setZero(values.cols());
  C running_max = minus_infinity;
  C running_sum = 0;
  const Index chunk = decode_chunk_rows(keys.cols(), values.cols());
  for (Index j0 = first; j0 <= position; j0 += chunk) {
    const Index count = std::min(chunk, position + 1 - j0);
    scratch.logits.resize(count);
    for (Index c = 0; c < count; ++c) scratch.logits(c) = log_weight(j0 + c);
    const auto k_rows = widened_rows<C>(keys, j0, count, scratch.keys);
    scratch.logits.noalias() += k_rows * scratch.query.transpose();
    const C chunk_max = scratch.logits.maxCoeff();
    const C updated = std::max(running_max, chunk_max);
    if (updated == minus_infinity) continue;            // no key of weight > 0 so far
    const C rescale = std::exp(running_max - updated);  // 0 for the first chunk
    scratch.logits = (scratch.logits.array() - updated).unaryExpr(detail::ExpOp<C>()).matrix();
    running_sum = running_sum * rescale + scratch.logits.sum();
    const auto v_rows = widened_rows<C>(values, j0, count, scratch.values);
    if (rescale != C(1)) scratch.accumulator *= rescale;
    scratch.accumulator.noalias() += scratch.logits.transpose() * v_rows;
    running_max = updated;
  }
  const Eigen::Matrix<C, 1, Eigen::Dynamic> result = scratch.accumulator / running_sum;
  if constexpr (std::is_same_v<OutScalar, C>) {
    out = result;
  } else {
    out = result.template cast<OutScalar>();
  }
}

/// begin_k(t) for every hash: the start of t's block in sample k.
inline std::vector<Index> decode_block_begins(const HashSet& hashes, Index t) {
  std::vector<Index> begins;
  begins.reserve(hashes.size());
  for (const BinHash& hash : hashes) begins.push_back(block_containing(hash, t, t + 1).begin);
  return begins;
}

/// Log weights of the LSH decoder at position p: log c_pj over the keys [min_k begin_k(p), p],
/// where c_pj = #{k : begin_k(p) <= j} (the counts of block starts, summed over the keys).
class LshDecodeWeights {
 public:
  explicit LshDecodeWeights(const HashSet& hashes) : hashes_(hashes) {}

  /// The first key read at `position` (keeps the block starts for log_weights).
  Index first_key(Index position) {
    begins_ = decode_block_begins(hashes_, position);
    return *std::min_element(begins_.begin(), begins_.end());
  }

  /// dst(c) = log c_pj, j = first + c, for the position of the last first_key call.
  template <typename Row>
  void log_weights(Index, Index first, Row&& dst) const {
    using C = typename std::decay_t<Row>::Scalar;
    dst.setZero();
    for (Index begin : begins_) dst(begin - first) += C(1);
    for (Index c = 1; c < dst.size(); ++c) dst(c) += dst(c - 1);
    log_counts(dst);
  }

 private:
  const HashSet& hashes_;
  std::vector<Index> begins_;
};

/// Log weights of the exact decoder at position p: the ALiBi bias (j - p) * slope over the
/// keys [0, p], formed in C from the exact integer j - p.
template <typename C>
class AlibiDecodeWeights {
 public:
  explicit AlibiDecodeWeights(C slope) : slope_(slope) {}
  Index first_key(Index) const { return 0; }

  template <typename Row>
  void log_weights(Index position, Index first, Row&& dst) const {
    for (Index c = 0; c < dst.size(); ++c) dst(c) = static_cast<C>(first + c - position) * slope_;
  }

 private:
  C slope_;
};

/// The rows of a decoder after its argument checks: row r of out is the query at position
/// p = t - m + 1 + r over the cache rows [first, p], first = weights.first_key(p), with the
/// log weights L_j of weights.log_weights(p, first, row) (row(c) = L_{first + c}):
///   out_r = sum_j e^{X_j - M} v_j / sum_j e^{X_j - M},  X_j = L_j + tau q.k_j,  M = max_j X_j.
/// All-float and all-double views take the one-pass path (weighted_decode); any half-precision
/// view the streamed path in float (streamed_decode_row). Throws std::invalid_argument naming
/// options.scale if it is not finite.
template <typename Scalar, typename KVScalar, typename OutScalar, typename Weights>
void decode_rows(const char* function, const ConstMatrixRef<Scalar>& query,
                 const ConstMatrixRef<KVScalar>& keys, const ConstMatrixRef<KVScalar>& values,
                 Index t, const AttentionOptions& options, MatrixRef<OutScalar>& out,
                 Weights& weights) {
  using C = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  constexpr bool one_pass =
      std::is_same_v<Scalar, C> && std::is_same_v<KVScalar, C> && std::is_same_v<OutScalar, C>;
  const auto tau = static_cast<C>(resolve_scale(function, options, query.cols()));
  const Index m = query.rows();
  if constexpr (one_pass) {
    LogitScratch<C> scratch;
    for (Index r = 0; r < m; ++r) {
      const Index position = t - m + 1 + r;
      const Index first = weights.first_key(position);
      scratch.shape(1, position + 1 - first);
      weights.log_weights(position, first, scratch.logits().row(0));
      auto out_row = out.middleRows(r, 1);
      weighted_decode<C>(query.middleRows(r, 1), keys, values, first, position, tau, scratch,
                         out_row);
    }
  } else {
    DecodeScratch<C> scratch;
    auto& window = scratch.log_weights;
    for (Index r = 0; r < m; ++r) {
      const Index position = t - m + 1 + r;
      const Index first = weights.first_key(position);
      window.resize(position + 1 - first);
      weights.log_weights(position, first, window);
      streamed_decode_row<C>(
          query.row(r), keys, values, first, position, tau,
          [&](Index j) { return window(j - first); }, scratch, out.row(r));
    }
  }
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
/// Query in Scalar, cache in KVScalar, out in OutScalar (see the top of this header: a
/// half-precision view streams the cache window in float chunks; the all-float and all-double
/// results are those of the one-pass path). Throws std::invalid_argument naming a bad argument
/// (shapes, t, hashes, masking).
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void lsh_attention_decode(ConstMatrixRef<Scalar> query, KeyValueRef<KVScalar> keys,
                          KeyValueRef<KVScalar> values, Index t, const HashSet& hashes,
                          OutputRef<OutScalar> out, const AttentionOptions& options = {}) {
  constexpr const char* function = "lsh_attention_decode";
  detail::require_decode_arguments(function, query, keys, values, t, out, options);
  validate_hashes(hashes, function);
  detail::LshDecodeWeights weights(hashes);
  detail::decode_rows<Scalar, KVScalar, OutScalar>(function, query, keys, values, t, options, out,
                                                   weights);
}

/// Exact ALiBi decode: out = softmax_j(tau q_t.k_j - (t - j) / sigma) v_j over j = 0..t.
/// O(t d): the cost a KV cache pays without LSH. With m query rows, row r is this at position
/// p = t - m + 1 + r (keys 0 .. p). Scalars as lsh_attention_decode. Throws
/// std::invalid_argument as above.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void alibi_attention_decode_exact(ConstMatrixRef<Scalar> query, KeyValueRef<KVScalar> keys,
                                  KeyValueRef<KVScalar> values, Index t, double sigma,
                                  OutputRef<OutScalar> out, const AttentionOptions& options = {}) {
  using C = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  constexpr const char* function = "alibi_attention_decode_exact";
  detail::require_decode_arguments(function, query, keys, values, t, out, options);
  detail::require_sigma(sigma, function);
  // The slope kept finite for distances up to t.
  detail::AlibiDecodeWeights<C> weights(detail::finite_alibi_slope<C>(sigma, t));
  detail::decode_rows<Scalar, KVScalar, OutScalar>(function, query, keys, values, t, options, out,
                                                   weights);
}

}  // namespace poslsh
