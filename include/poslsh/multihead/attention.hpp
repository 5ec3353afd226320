/// \file
/// \brief All-heads (and grouped-query) ALiBi attention, exact or by Positional LSH:
/// multihead_attention on one sequence and multihead_attention_varlen on a packed batch (over a
/// paged KV cache: poslsh/multihead/paged.hpp).
///
/// Every all-heads call runs the same way: its arguments are checked and resolved first (one
/// HeadMethod per query head, or per sequence and query head; one HeadsSequence per sequence),
/// before any parallel work; then one parallel loop runs the (query tile, head) jobs
/// (detail/tile/query_tiles.hpp), each job writing its own output rows: bitwise the same result
/// for any thread count.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/slopes.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/detected.hpp"
#include "poslsh/detail/tile/query_tiles.hpp"
#include "poslsh/multihead/methods.hpp"

namespace poslsh {

namespace detail {

/// One sequence of an all-heads call: the query tokens [q_begin, q_end) of q and out sit at
/// positions p0 .. p0 + (q_end - q_begin) - 1 over the key tokens [k_begin, k_end) of k and v
/// at positions k0 .. k0 + (k_end - k_begin) - 1 (positions from 0 in each sequence). The
/// keyless_rows query tokens just before q_begin see no key (causal rows before a packed
/// sequence's first key): out 0, lse -inf.
struct HeadsSequence {
  Index q_begin = 0, q_end = 0;
  Index k_begin = 0, k_end = 0;
  Index p0 = 0;
  Index k0 = 0;
  Index keyless_rows = 0;
};

/// Tokens [begin, end) of every head of a view (one sequence of a packed batch).
template <typename Element>
HeadsView<Element> token_range(const HeadsView<Element>& view, Index begin, Index end) {
  HeadsView<Element> range = view;
  range.data = view.data == nullptr ? nullptr : view.data + begin * view.row_stride;
  range.tokens = end - begin;
  return range;
}

/// Checks the inputs of an all-heads call: each view valid, q.heads >= 1, d >= 1 when there
/// are tokens, k and q of one head dimension, v with k's tokens and heads, and k.heads
/// dividing q.heads (grouped-query attention).
template <typename QElement, typename KVElement>
void require_heads_inputs(const char* function, const HeadsView<QElement>& q,
                          const HeadsView<KVElement>& k, const HeadsView<KVElement>& v) {
  require(q.heads >= 1, function, "q.heads", q.heads, "must be >= 1");
  q.validate(function, "q");
  k.validate(function, "k");
  v.validate(function, "v");
  require(q.tokens == 0 || q.dim > 0, function, "q.dim", q.dim,
          "head dimension d must be >= 1 when there are tokens");
  require(v.tokens == k.tokens, function, "v.tokens", v.tokens,
          [&] { return "must equal k.tokens = " + std::to_string(k.tokens); });
  require(k.dim == q.dim, function, "k.dim", k.dim,
          [&] { return "must equal q.dim = " + std::to_string(q.dim); });
  require(v.heads == k.heads, function, "v.heads", v.heads,
          [&] { return "must equal k.heads = " + std::to_string(k.heads); });
  require(q.heads % k.heads == 0, function, "k.heads", k.heads, [&] {
    return "must divide q.heads = " + std::to_string(q.heads) + " (grouped-query attention)";
  });
}

/// The method of every query head from the options: sigma_h = options.sigmas[h] (empty: the
/// ALiBi sigmas of q.heads heads), W_h = band_for_bias_error(sigma_h, band_error) for
/// exact_banded, hashes rbf_hashes(sigma_h, s, seed, h) for the LSH methods and
/// mean_of_outputs, {fixed_blocks_hash(sigma_h)} for fixed_blocks. A packed batch of `batch`
/// sequences may give one sigma per sequence and query head instead (options.sigmas[b H + h],
/// B H entries): then entry b H + h is the method of head h of sequence b (its hashes drawn
/// with stream h, as every sequence's). Checks one valid sigma per head (or per sequence and
/// head), samples >= 1 (methods with hashes) and band_error in (0, 1) (exact_banded).
inline std::vector<HeadMethod> head_methods(const char* function, Index heads,
                                            const MultiHeadOptions& options, Index batch = 1) {
  require(enum_is_valid(options.method), function, "options.method",
          static_cast<int>(options.method), [&] { return "must be " + enum_name_list<Method>(); });
  const std::vector<double> sigmas =
      options.sigmas.empty() ? alibi_sigmas(static_cast<int>(heads)) : options.sigmas;
  const auto count = static_cast<Index>(sigmas.size());
  require(count == heads || (batch > 1 && count == batch * heads), function, "options.sigmas",
          sigmas.size(), [&] {
            return "must hold one sigma per query head (" + std::to_string(heads) + ")" +
                   (batch > 1 ? " or one per sequence and query head (" + std::to_string(batch) +
                                    " x " + std::to_string(heads) + ")"
                              : std::string());
          });
  for (double sigma : sigmas) require_sigma(sigma, function, "options.sigmas");
  if (method_draws_hashes(options.method)) {
    require_positive(options.samples, function, "options.samples");
  }
  if (options.method == Method::exact_banded) {
    require(options.band_error > 0.0 && options.band_error < 1.0, function, "options.band_error",
            options.band_error, "must be in (0, 1)");
  }
  const bool windowed = method_takes_window(options.method);
  for (const auto& [name, side] : {std::pair{"options.window_left", options.window_left},
                                   std::pair{"options.window_right", options.window_right}}) {
    require(side >= -1, function, name, side, "must be -1 (unbounded) or >= 0");
    require(side == -1 || windowed, function, name, side, [&] {
      return "a local window needs method " + enum_name_list<Method>(method_takes_window) +
             " (got " + std::string(enum_name(options.method)) + ")";
    });
  }
  std::vector<HeadMethod> methods(sigmas.size());
  for (std::size_t h = 0; h < sigmas.size(); ++h) {
    HeadMethod& head = methods[h];
    head.method = options.method;
    head.sigma = sigmas[h];
    if (method_draws_hashes(options.method))
      head.hashes = rbf_hashes(head.sigma, options.samples, options.seed,
                               h % static_cast<std::size_t>(heads));
    if (options.method == Method::exact_banded)
      head.band = band_for_bias_error(head.sigma, options.band_error);
    head.window_left = options.window_left;
    head.window_right = options.window_right;
    if (options.method == Method::fixed_blocks) head.hashes = {fixed_blocks_hash(head.sigma)};
  }
  return methods;
}

/// Checks cu_seqlens (named `name`): B + 1 >= 1 entries, cu[0] = 0, non-decreasing, last =
/// `tokens` (the packed buffer's token count).
inline void require_cu_seqlens(const char* function, const char* name,
                               const std::vector<std::int32_t>& cu, Index tokens) {
  require(!cu.empty(), function, name, "{}", "must hold B + 1 >= 1 entries");
  require(cu.front() == 0, function, name, cu.front(), "first entry must be 0");
  for (std::size_t b = 1; b < cu.size(); ++b) {
    require(
        cu[b] >= cu[b - 1], function, name,
        [&] { return "[" + std::to_string(b) + "] = " + std::to_string(cu[b]); },
        [&] {
          return "must be non-decreasing (entry " + std::to_string(b - 1) + " = " +
                 std::to_string(cu[b - 1]) + ")";
        });
  }
  require(cu.back() == tokens, function, name, cu.back(),
          [&] { return "last entry must equal the packed token count " + std::to_string(tokens); });
}

/// options.query_offset of a packed batch's call: unset (the sequences' offsets are the
/// query_offsets argument).
inline void require_no_query_offset(const char* function,
                                    const std::optional<Index>& query_offset) {
  require(!query_offset, function, "options.query_offset", query_offset.value_or(0),
          "must be unset: per-sequence offsets are the query_offsets argument");
}

/// The query offsets of a packed batch's sequences, into sequences[b].p0: query_offsets[b]
/// (empty: each sequence bottom-right aligned, L_b - m_b), checked by resolve_query_offset on
/// the sequence's m_b queries over its L_b keys. Checks that query_offsets is empty or holds one
/// offset per sequence; `keys_name` names the argument that sets the key counts in messages.
inline void resolve_query_offsets(const char* function, std::vector<HeadsSequence>& sequences,
                                  const std::vector<Index>& query_offsets, const char* keys_name) {
  const std::size_t batch = sequences.size();
  require(query_offsets.empty() || query_offsets.size() == batch, function, "query_offsets",
          query_offsets.size(), [&] {
            return "must be empty or hold one offset per sequence (" + std::to_string(batch) + ")";
          });
  for (std::size_t b = 0; b < batch; ++b) {
    HeadsSequence& sequence = sequences[b];
    sequence.p0 = resolve_query_offset(
        function,
        query_offsets.empty() ? std::optional<Index>{} : std::optional<Index>{query_offsets[b]},
        sequence.q_end - sequence.q_begin, sequence.k_end - sequence.k_begin, keys_name,
        "query_offsets");
  }
}

/// A bottom-right aligned sequence with more queries than keys (m > L): query row i sits at key
/// position P_i = i - (m - L), so its first m - L rows sit before the first key. Causal: those
/// rows see no key (keyless_rows; out 0, lse -inf) and the others sit at positions
/// 0 .. L - 1 over the keys at 0 .. L - 1. Bidirectional: every row sees every key at distance
/// |P_i - j|, positions counted from the first query (query i at i, key j at m - L + j).
inline void place_rows_before_first_key(HeadsSequence& sequence, Masking masking) {
  const Index extra = (sequence.q_end - sequence.q_begin) - (sequence.k_end - sequence.k_begin);
  if (masking == Masking::causal) {
    sequence.keyless_rows = extra;
    sequence.q_begin += extra;
  } else {
    sequence.k0 = extra;
  }
}

/// The query offsets of a call's sequences: query_offsets[b] when given (resolve_query_offsets;
/// `keys_name` names the argument of the key counts), else each sequence bottom-right aligned,
/// p0 = L - m, a sequence with more queries than keys placed by place_rows_before_first_key.
inline void align_queries(const char* function, std::vector<HeadsSequence>& sequences,
                          const std::vector<Index>& query_offsets, const char* keys_name,
                          Masking masking) {
  if (!query_offsets.empty()) {
    resolve_query_offsets(function, sequences, query_offsets, keys_name);
    return;
  }
  for (HeadsSequence& sequence : sequences) {
    const Index m = sequence.q_end - sequence.q_begin, keys = sequence.k_end - sequence.k_begin;
    if (m > keys)
      place_rows_before_first_key(sequence, masking);
    else
      sequence.p0 = keys - m;
  }
}

/// The sequences of a packed batch: sequence b has the query tokens [cu_q[b], cu_q[b+1]) and
/// the key tokens [cu_k[b], cu_k[b+1]), its queries at offset query_offsets[b] (align_queries).
/// Checks cu_seqlens_q, cu_seqlens_k, query_offsets and that options.query_offset is unset.
inline std::vector<HeadsSequence> packed_sequences(const char* function,
                                                   const std::vector<std::int32_t>& cu_q,
                                                   const std::vector<std::int32_t>& cu_k,
                                                   Index q_tokens, Index k_tokens,
                                                   const AttentionOptions& options,
                                                   const std::vector<Index>& query_offsets) {
  require_no_query_offset(function, options.query_offset);
  require_cu_seqlens(function, "cu_seqlens_q", cu_q, q_tokens);
  require_cu_seqlens(function, "cu_seqlens_k", cu_k, k_tokens);
  require(cu_k.size() == cu_q.size(), function, "cu_seqlens_k", cu_k.size(), [&] {
    return "must have as many entries as cu_seqlens_q (" + std::to_string(cu_q.size()) + ")";
  });
  std::vector<HeadsSequence> sequences(cu_q.size() - 1);
  for (std::size_t b = 0; b < sequences.size(); ++b)
    sequences[b] = {cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1], 0};
  align_queries(function, sequences, query_offsets, "cu_seqlens_k", options.masking);
  return sequences;
}

/// The sequences of a call over a cache's `batch` sequences (paged, bounded), their query
/// offsets not yet set: sequence b has the query tokens [cu_q[b], cu_q[b+1]) and the keys
/// 0 .. keys_of(b) - 1 the cache holds for it. Checks cu_seqlens_q (batch + 1 entries,
/// `batch_name` naming what sets batch in the message; require_cu_seqlens against q_tokens).
template <typename KeysOf>
std::vector<HeadsSequence> cache_sequences(const char* function,
                                           const std::vector<std::int32_t>& cu_q, Index q_tokens,
                                           std::size_t batch, const char* batch_name,
                                           KeysOf keys_of) {
  require(cu_q.size() == batch + 1, function, "cu_seqlens_q", cu_q.size(), [&] {
    return "must hold " + std::string(batch_name) + " + 1 = " + std::to_string(batch + 1) +
           " entries";
  });
  require_cu_seqlens(function, "cu_seqlens_q", cu_q, q_tokens);
  std::vector<HeadsSequence> sequences(batch);
  for (std::size_t b = 0; b < batch; ++b)
    sequences[b] = {cu_q[b], cu_q[b + 1], 0, keys_of(b), 0, 0};
  return sequences;
}

/// The checked arguments of an all-heads call, resolved: what every job reads.
struct HeadsCall {
  /// The method of each query head (H_q entries), or, when per_sequence, of each sequence's
  /// query heads (B H_q entries, head h of sequence b at b H_q + h: head_methods with sigmas
  /// per sequence and head).
  std::vector<HeadMethod> heads;
  std::vector<HeadsSequence> sequences;
  double tau = 1.0;
  Masking masking = Masking::causal;
  Precision precision = Precision::matrix_units;
  bool per_sequence = false;

  /// The query heads H_q.
  Index query_heads() const {
    const std::size_t count = per_sequence ? heads.size() / sequences.size() : heads.size();
    return static_cast<Index>(count);
  }
  /// The method of query head h of sequence b.
  const HeadMethod& method(std::size_t b, Index h) const {
    const std::size_t row = per_sequence ? b * static_cast<std::size_t>(query_heads()) : 0;
    return heads[row + static_cast<std::size_t>(h)];
  }
};

/// The methods of a packed batch's heads (head_methods over `batch` sequences) into `call`:
/// call.per_sequence when options.sigmas holds one sigma per sequence and query head.
inline void resolve_heads(HeadsCall& call, const char* function, Index heads,
                          const MultiHeadOptions& options, Index batch) {
  call.heads = head_methods(function, heads, options, batch);
  call.per_sequence = static_cast<Index>(call.heads.size()) != heads;
}

/// The scale (resolve_scale: options.scale, else 1 / sqrt(dim) for queries of dim columns),
/// masking and precision of a call, from its options.
inline void resolve_call_options(HeadsCall& call, const char* function,
                                 const AttentionOptions& options, Index dim) {
  call.tau = resolve_scale(function, options, dim);
  call.masking = options.masking;
  call.precision = options.precision;
}

/// Checks that every head's method has a log-sum-exp (method_has_lse), for the calls with lse.
inline void require_methods_with_lse(const char* function, const HeadsCall& call) {
  for (const HeadMethod& head : call.heads)
    require(method_has_lse(head.method), function, "options.method", enum_name(head.method),
            "has no log-sum-exp (its output is the mean of s softmaxes, each with its own "
            "normalizer): call the form without lse");
}

/// The checked arguments of a packed-batch forward (multihead_attention_varlen and its form
/// with lse): the inputs, out (q.tokens x q.heads x v.dim), the sequences with their query
/// offsets (packed_sequences) and the methods of the heads.
template <typename QElement, typename KVElement, typename OutElement>
HeadsCall varlen_call(const char* function, const HeadsView<QElement>& q,
                      const HeadsView<KVElement>& k, const HeadsView<KVElement>& v,
                      const HeadsView<OutElement>& out, const std::vector<std::int32_t>& cu_q,
                      const std::vector<std::int32_t>& cu_k, const MultiHeadOptions& options,
                      const std::vector<Index>& query_offsets) {
  require_heads_inputs(function, q, k, v);
  require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  HeadsCall call;
  call.sequences =
      packed_sequences(function, cu_q, cu_k, q.tokens, k.tokens, options, query_offsets);
  resolve_heads(call, function, q.heads, options, static_cast<Index>(call.sequences.size()));
  resolve_call_options(call, function, options, q.dim);
  return call;
}

/// The keys of a call on K and V views (HeadsView, stored as KVScalar): sequence b's keys are
/// the tokens [k_begin, k_end) of its HeadsSequence. with_head(sequence, b, g, use) calls
/// use(rows) with the row source of K/V head g of the sequence (StridedRows over the views,
/// read in place). The paged form: PagedHeadsKeys, poslsh/multihead/paged.hpp.
template <typename KVScalar>
struct ViewHeadsKeys {
  const HeadsView<const KVScalar>& k;
  const HeadsView<const KVScalar>& v;

  Index heads() const { return k.heads; }
  template <typename Use>
  void with_head(const HeadsSequence& s, std::size_t, Index g, Use&& use) const {
    const ConstMatrixRef<KVScalar> k_g(token_range(k, s.k_begin, s.k_end).head(g));
    const ConstMatrixRef<KVScalar> v_g(token_range(v, s.k_begin, s.k_end).head(g));
    use(StridedRows<KVScalar>(k_g, v_g));
  }
};

/// The position of the first key of a row source: rows.key_position() for a source that carries
/// its own (one K/V head of a bounded cache: BoundedRows, poslsh/cache/bounded_kv_cache.hpp),
/// else the sequence's k0.
template <typename Rows>
using key_position_t = decltype(std::declval<const Rows&>().key_position());
template <typename Rows>
Index row_source_key_position(const Rows& rows, Index sequence_k0) {
  if constexpr (is_detected<key_position_t, Rows>::value)
    return rows.key_position();
  else
    return sequence_k0;
}

/// Writes the rows of `sequence` that see no key (HeadsSequence::keyless_rows) of every head:
/// out 0 and, when lse is not null, lse -inf.
template <typename OutScalar, typename Compute>
void write_keyless_rows(const HeadsSequence& sequence, const HeadsView<OutScalar>& out,
                        Compute* lse, Index lse_stride) {
  if (sequence.keyless_rows == 0) return;
  const Index first = sequence.q_begin - sequence.keyless_rows;
  const auto rows = token_range(out, first, sequence.q_begin);
  for (Index h = 0; h < out.heads; ++h) {
    rows.head(h).setZero();
    if (lse != nullptr)
      std::fill_n(lse + h * lse_stride + first, sequence.keyless_rows,
                  -std::numeric_limits<Compute>::infinity());
  }
}

/// Runs the forward of every (sequence, query head): one parallel loop over the (query tile,
/// head) jobs of all sequences, heads outermost when a method reads every key before its tiles
/// (exact_tiled: one head's keys stay in cache), else innermost; a head whose method runs whole
/// heads (lsh_per_sample, fixed_blocks, mean_of_outputs) is one job, on its sequence's first
/// tile. Query head h reads K/V head h / (q.heads / keys.heads()) through keys.with_head
/// (ViewHeadsKeys, PagedHeadsKeys). With lse (not null; one scalar type; every method with a
/// log-sum-exp), lse[h * lse_stride + t] is the log-sum-exp of query token t of head h. AMX
/// products on the tile layer AmxTiles (the CPU's by default; detail/tile/engine.hpp).
template <typename Compute, template <typename> class AmxTiles = AmxNativeTiles, typename QScalar,
          typename Keys, typename OutScalar>
void run_heads_forward(const HeadsCall& call, const HeadsView<const QScalar>& q, const Keys& keys,
                       const HeadsView<OutScalar>& out, Compute* lse = nullptr,
                       Index lse_stride = 0) {
  std::vector<QueryTile> tiles;
  for (std::size_t b = 0; b < call.sequences.size(); ++b) {
    const HeadsSequence& s = call.sequences[b];
    append_query_tiles(tiles, b, s.p0, s.p0 + (s.q_end - s.q_begin));
    write_keyless_rows(s, out, lse, lse_stride);
  }
  const Index group = q.heads / keys.heads();
  bool reads_every_key = false;
  for (const HeadMethod& head : call.heads)
    reads_every_key = reads_every_key || method_reads_every_key(head.method);
  const auto written_bytes = static_cast<std::size_t>(out.tokens) *
                             static_cast<std::size_t>(out.heads * out.dim) * sizeof(OutScalar);
  parallel_query_tiles<Compute, QScalar>(
      tiles, q.heads, reads_every_key ? JobOrder::heads_outer : JobOrder::head_runs, written_bytes,
      [&](const QueryTile& tile, Index h, TileWorkspace<Compute>& work) {
        const HeadsSequence& s = call.sequences[tile.range];
        const HeadMethod& head = call.method(tile.range, h);
        if (!method_runs_by_query_tiles(head.method) && tile.row_begin != s.p0) return;
        const auto q_h = token_range(q, s.q_begin, s.q_end).head(h);
        auto out_h = token_range(out, s.q_begin, s.q_end).head(h);
        Compute* const head_lse = lse == nullptr ? nullptr : lse + h * lse_stride + s.q_begin;
        keys.with_head(s, tile.range, h / group, [&](const auto& rows) {
          using Rows = std::decay_t<decltype(rows)>;
          const HeadForward<decltype(q_h), Rows, decltype(out_h)> f{
              q_h,          rows, out_h,          call.tau,
              call.masking, s.p0, call.precision, row_source_key_position(rows, s.k0)};
          visit_method(head.method, [&](auto kernels) {
            using Kernels = decltype(kernels);
            if constexpr (Kernels::runs_by_query_tiles) {
              Kernels::template forward_tile<Compute, QScalar, AmxTiles>(
                  head, f, tile.row_begin, tile.rows,
                  head_lse == nullptr ? nullptr : head_lse + (tile.row_begin - s.p0), work);
            } else {
              Kernels::template forward_head<Compute, QScalar, AmxTiles>(head, f, head_lse);
            }
          });
        });
      });
}

/// The forward of an all-heads call on one sequence: checks the query offset
/// (options.query_offset; unset: k.tokens - q.tokens) and the views, then resolves the methods
/// (head_methods()) and runs every head, AMX products on the tile layer AmxTiles
/// (run_heads_forward).
template <typename Compute, template <typename> class AmxTiles = AmxNativeTiles, typename QScalar,
          typename KVScalar, typename OutScalar, typename HeadMethods>
void one_sequence_forward(const char* function, const HeadsView<const QScalar>& q,
                          const HeadsView<const KVScalar>& k, const HeadsView<const KVScalar>& v,
                          const HeadsView<OutScalar>& out, const AttentionOptions& options,
                          HeadMethods&& head_methods) {
  const Index p0 =
      resolve_query_offset(function, options.query_offset, q.tokens, k.tokens, "k.tokens");
  require_heads_inputs(function, q, k, v);
  require_view_shape(function, "out", out, q.tokens, q.heads, v.dim);
  const HeadsCall call{head_methods(),
                       {{0, q.tokens, 0, k.tokens, p0}},
                       resolve_scale(function, options, q.dim),
                       options.masking,
                       options.precision};
  run_heads_forward<Compute, AmxTiles>(call, q, ViewHeadsKeys<KVScalar>{k, v}, out);
}

}  // namespace detail

/// Multi-head ALiBi attention: for each query head h (group size G = H_q / H_kv, K/V head
/// h / G), out_h = method(Q_h, K_{h/G}, V_{h/G}) with sigma_h = options.sigmas[h] (default: the
/// ALiBi slopes, sigma_h = 1/m_h), for exact_banded W_h = band_for_bias_error(sigma_h,
/// band_error), for the LSH methods the hashes rbf_hashes(sigma_h, s, seed, h).
///
/// \param q, k, v, out strided HeadsView's ([n, H, d] or [H, n, d], no copies): q holds the m
///   queries at positions p0 .. p0 + m - 1 (p0 = options.query_offset; unset: L - m,
///   bottom-right aligned) over the L tokens of k and v; out is m x H_q x d_v.
/// \param options masking, scale, query offset, method and its parameters.
/// Row r of each head is bitwise row p0 + r of the call on all L positions, and the result is
/// bitwise the same for any thread count: one parallel loop over (query tile, head) jobs (one
/// job per head for lsh_per_sample and fixed_blocks), each row computed by one thread.
/// Scalar types: q in Scalar, k and v in KVScalar, out in OutScalar (float, double,
/// Eigen::half or Eigen::bfloat16, deduced from the views; e.g. float queries over a bfloat16
/// KV cache), computed in compute_scalar_t<Scalar, KVScalar, OutScalar>: half-precision values
/// widened to float as they are loaded (or, for bfloat16 Q, K and V, multiplied on the CPU's
/// matrix unit under options.precision: core/matrix_units.hpp), the output rounded once.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention(HeadsView<const Scalar> q, HeadsView<const KVScalar> k,
                         HeadsView<const KVScalar> v, HeadsView<OutScalar> out,
                         const MultiHeadOptions& options = {}) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  constexpr const char* function = "multihead_attention";
  detail::one_sequence_forward<Compute>(function, q, k, v, out, options, [&] {
    return detail::head_methods(function, q.heads, options);
  });
}

/// Multi-head ALiBi attention on a packed batch of B sequences of different lengths
/// (FlashAttention's variable-length convention): sequence b owns the query tokens
/// [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q and out and the key tokens
/// [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k and v; cu_seqlens_* hold B + 1 int32 from 0 to
/// the token counts. Each sequence has its own positions from 0: its m_b queries sit at
/// positions p_b .. p_b + m_b - 1 over its L_b keys, p_b = query_offsets[b] when given
/// (0 <= p_b <= L_b - m_b), else L_b - m_b (bottom-right alignment). The output equals bitwise
/// multihead_attention on each sequence's views with options.query_offset = p_b (the same
/// sigmas and hashes for every sequence); one parallel loop over the (sequence, query tile,
/// head) jobs, bitwise the same for any thread count. options.query_offset must be unset.
/// Without query_offsets a sequence may hold more queries than keys (FlashAttention's
/// bottom-right alignment, query row i at key position i - (m_b - L_b)): causal rows before the
/// first key see no key and get out 0; bidirectional rows see every key at distance
/// |i - (m_b - L_b) - j|, the positions (and so the LSH bins) counted from the first query
/// (detail::place_rows_before_first_key). Empty sequences are allowed. Scalar types as
/// multihead_attention.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention_varlen(HeadsView<const Scalar> q, HeadsView<const KVScalar> k,
                                HeadsView<const KVScalar> v, HeadsView<OutScalar> out,
                                const std::vector<std::int32_t>& cu_seqlens_q,
                                const std::vector<std::int32_t>& cu_seqlens_k,
                                const MultiHeadOptions& options = {},
                                const std::vector<Index>& query_offsets = {}) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  const detail::HeadsCall call =
      detail::varlen_call("multihead_attention_varlen", q, k, v, out, cu_seqlens_q, cu_seqlens_k,
                          options, query_offsets);
  detail::run_heads_forward<Compute>(call, q, detail::ViewHeadsKeys<KVScalar>{k, v}, out);
}

}  // namespace poslsh
