// poslsh: attention over a paged KV cache (keys and values read through a block table, as in
// vLLM's and FlashAttention's paged attention), for the exact tiled and the fused LSH kernels:
// prefill with queries at an offset, chunked prefill and decode.
//
// Layout: FlashAttention's paged KV cache, k_pages [num_pages, page_size, H_kv, d] and
// v_pages [num_pages, page_size, H_kv, d_v] (row-major, or any strides on the first three axes
// with the last contiguous: PagedKV::k_strides, v_strides), block_table int32 [batch, max_pages]
// (row b lists the physical pages of sequence b in order: its token j is row j % page_size of
// page block_table[b][j / page_size]), seq_lens int32 [batch].
//
// Checked (std::invalid_argument naming the argument): the cache's sizes and pointers, the
// sequence and head indices, seq_lens[b] >= 0, a block table row long enough for the sequence
// (max_pages >= ceil(seq_lens[b] / page_size)), every page index the sequence uses in
// [0, num_pages), plus the checks of the contiguous kernels (shapes, offset, hashes, sigma).
// Only the pages a sequence's tokens use are read (nothing outside the cache). Not checked:
// that the buffers hold num_pages pages, and the values.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "poslsh/attention/fused.hpp"
#include "poslsh/attention/tiled.hpp"
#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/tile/alibi_bias.hpp"
#include "poslsh/detail/tile/count_bias.hpp"
#include "poslsh/detail/tile/engine.hpp"

namespace poslsh {

/// Element strides of a paged cache's pages, rows and heads (PagedKV::k_strides, v_strides;
/// 0: the row-major layout's).
struct PagedStrides {
  Index page = 0;
  Index row = 0;
  Index head = 0;
};

/// A paged KV cache (FlashAttention's layout, see the file comment). Views only: the caller
/// owns the buffers.
template <typename Scalar>
struct PagedKV {
  const Scalar* k_pages = nullptr;  ///< [num_pages, page_size, heads, dim]
  const Scalar* v_pages = nullptr;  ///< [num_pages, page_size, heads, dim_v]
  Index num_pages = 0;
  Index page_size =
      0;            ///< tokens per page P (a key tile of 64 reads ceil(64 / P) + 1 runs at most)
  Index heads = 0;  ///< H_kv
  Index dim = 0;    ///< d
  Index dim_v = 0;  ///< d_v
  const std::int32_t* block_table = nullptr;  ///< [batch, max_pages], row-major
  Index batch = 0;
  Index max_pages = 0;
  const std::int32_t* seq_lens = nullptr;  ///< [batch]: tokens of each sequence
  /// Element strides of k_pages and v_pages between pages, between the rows of a page and
  /// between heads (the last axis is contiguous); a stride of 0 means the row-major layout's
  /// (page: page_size H_kv d, row: H_kv d, head: d; d_v for v_pages). E.g. k_cache[:, :, 0] of
  /// a packed [num_pages, page_size, 2, H_kv, d] cache: {page_size 2 H_kv d, 2 H_kv d, d}.
  PagedStrides k_strides{};
  PagedStrides v_strides{};

  /// Tokens of sequence b.
  Index length(Index b) const { return seq_lens[b]; }
  /// The strides of k_pages (values: false) or v_pages (values: true), 0s resolved.
  PagedStrides strides(bool values) const {
    const PagedStrides& given = values ? v_strides : k_strides;
    const Index width = values ? dim_v : dim;
    return {given.page != 0 ? given.page : page_size * heads * width,
            given.row != 0 ? given.row : heads * width, given.head != 0 ? given.head : width};
  }

  /// Checks the cache and sequence b's pages (see the file comment), naming the argument.
  void validate(const char* function, Index b) const {
    detail::require(page_size >= 1, function, "cache.page_size", page_size, "must be >= 1");
    detail::require(num_pages >= 0, function, "cache.num_pages", num_pages, "must be >= 0");
    detail::require(heads >= 1, function, "cache.heads", heads, "must be >= 1");
    detail::require(dim >= 1, function, "cache.dim", dim, "must be >= 1");
    detail::require(dim_v >= 1, function, "cache.dim_v", dim_v, "must be >= 1");
    for (const auto& [name, stride] : {std::pair{"cache.k_strides.page", k_strides.page},
                                       {"cache.k_strides.row", k_strides.row},
                                       {"cache.k_strides.head", k_strides.head},
                                       {"cache.v_strides.page", v_strides.page},
                                       {"cache.v_strides.row", v_strides.row},
                                       {"cache.v_strides.head", v_strides.head}})
      detail::require(stride >= 0, function, name, stride, "must be >= 0 (0: row-major)");
    detail::require(batch >= 1, function, "cache.batch", batch, "must be >= 1");
    detail::require(max_pages >= 0, function, "cache.max_pages", max_pages, "must be >= 0");
    detail::require(seq_lens != nullptr, function, "cache.seq_lens", "null",
                    "must point at batch lengths");
    if (b < 0 || b >= batch)
      detail::throw_invalid(function, "sequence", b,
                            "must lie in [0, cache.batch) = [0, " + std::to_string(batch) + ")");
    const Index n = seq_lens[b];
    detail::require(n >= 0, function, "cache.seq_lens", n, "lengths must be >= 0");
    const Index pages = (n + page_size - 1) / page_size;
    if (pages > max_pages)
      detail::throw_invalid(function, "cache.block_table", max_pages,
                            "holds max_pages pages per sequence, fewer than the " +
                                std::to_string(pages) + " pages of sequence " + std::to_string(b) +
                                " (" + std::to_string(n) + " tokens)");
    if (n == 0) return;
    detail::require(block_table != nullptr && k_pages != nullptr && v_pages != nullptr, function,
                    "cache", "null", "block_table, k_pages and v_pages must point at buffers");
    for (Index p = 0; p < pages; ++p) {
      const std::int32_t page = block_table[b * max_pages + p];
      if (page < 0 || page >= num_pages)
        detail::throw_invalid(
            function, "cache.block_table",
            "[" + std::to_string(b) + "][" + std::to_string(p) + "] = " + std::to_string(page),
            "page indices must lie in [0, num_pages) = [0, " + std::to_string(num_pages) + ")");
    }
  }
};

namespace detail {

/// The rows of head `head` of sequence `sequence` of a paged cache (stored as Storage), a row
/// source of the tile engine (detail/tile/engine.hpp): key j is row j % P of page
/// block_table[j / P], so the keys come in runs of P rows (the cache's row strides: H_kv d for
/// K, H_kv d_v for V when row-major). Stored in the engine's compute type, the rows are also its
/// key source, read in place run by run (run_end_t: tile, key_row, value_row, run_end); stored in
/// a half-precision type, the engine's widening or paired key source reads them row by row
/// (with_key_source). Nothing is copied beyond a key tile.
template <typename Storage>
class PagedRows {
 public:
  using storage = Storage;
  PagedRows(const PagedKV<Storage>& cache, Index sequence, Index head)
      : k_(cache.k_pages + head * cache.strides(false).head),
        v_(cache.v_pages + head * cache.strides(true).head),
        table_(cache.block_table + sequence * cache.max_pages),
        page_size_(cache.page_size),
        k_stride_(cache.strides(false).row),
        v_stride_(cache.strides(true).row),
        k_page_stride_(cache.strides(false).page),
        v_page_stride_(cache.strides(true).page),
        d_(cache.dim),
        dv_(cache.dim_v),
        rows_(cache.length(sequence)) {}

  Index rows() const { return rows_; }
  Index key_cols() const { return d_; }
  Index value_cols() const { return dv_; }
  Index k_stride() const { return k_stride_; }
  Index v_stride() const { return v_stride_; }

  /// The rows of the run holding j0 (the engine reads the others through key_row).
  KeyTileRows<Storage> tile(Index j0, Index) const {
    return {key_row(j0), k_stride_, value_row(j0), v_stride_};
  }

  /// First key after the run (page) holding key j.
  Index run_end(Index j) const { return (j / page_size_ + 1) * page_size_; }
  const Storage* key_row(Index j) const {
    return k_ + page_of(j) * k_page_stride_ + (j % page_size_) * k_stride_;
  }
  const Storage* value_row(Index j) const {
    return v_ + page_of(j) * v_page_stride_ + (j % page_size_) * v_stride_;
  }

  void prefetch(Index first, Index last, Index d, Index dv) const {
    for (Index j = first; j < last; ++j) {
      tile_prefetch_rows(key_row(j), 0, 0, 1, d);
      tile_prefetch_rows(value_row(j), 0, 0, 1, dv);
    }
  }

  /// The head's K rows and the sequence's block table row: no other head or sequence of the
  /// cache has both.
  RowsIdentity identity() const { return {k_, table_}; }
  /// The rows as the engine's key source, read in place (Storage the compute type).
  PagedRows in_place(TileBuffers<Storage>&, Index) const { return *this; }

 private:
  Index page_of(Index j) const { return static_cast<Index>(table_[j / page_size_]); }

  const Storage* k_;
  const Storage* v_;
  const std::int32_t* table_;
  Index page_size_, k_stride_, v_stride_, k_page_stride_, v_page_stride_, d_, dv_, rows_;
};

/// Checks of the paged kernels: the cache, sequence b's pages, the KV head, q (m x d) against
/// the cache (offset rule over seq_lens[b] keys) and out (m x d_v); returns p0.
template <typename Scalar, typename OutType>
Index require_paged_arguments(const char* function, const ConstMatrixRef<Scalar>& q,
                              const PagedKV<Scalar>& cache, Index sequence, Index head,
                              const OutType& out, const AttentionOptions& options) {
  cache.validate(function, sequence);
  if (head < 0 || head >= cache.heads)
    throw_invalid(function, "kv_head", head,
                  "must lie in [0, cache.heads) = [0, " + std::to_string(cache.heads) + ")");
  if (q.cols() != cache.dim)
    throw_invalid(function, "q", q.cols(),
                  "column count (d) must equal cache.dim = " + std::to_string(cache.dim));
  const Index p0 = resolve_query_offset(function, options.query_offset, q.rows(),
                                        cache.length(sequence), "cache.seq_lens");
  require_output_shape(function, out, q.rows(), cache.dim_v);
  return p0;
}

}  // namespace detail

/// Fused LSH ALiBi attention (lsh_attention_fused) of the m queries q (m x d) at positions
/// p0 .. p0 + m - 1 over the L = seq_lens[sequence] tokens of KV head `kv_head` of a paged
/// cache:
///   out_r = sum_j c_{p0+r,j} e^{tau q_r.k_j} v_j / sum_j c_{p0+r,j} e^{tau q_r.k_j},
///   c_ij = #{k : bin_k(i) = bin_k(j)} (causal: j <= i), j over the cache's tokens 0 .. L - 1,
/// with p0 = options.query_offset (unset: L - m, bottom-right: prefill chunks and decode
/// append their queries at the cache's end). Bitwise lsh_attention_fused on the same keys and
/// values in contiguous matrices, for any page size; keys are read in place, page by page. Query
/// tiles run in parallel (OpenMP), bitwise the same for any thread count. Throws
/// std::invalid_argument naming a bad argument.
template <typename Scalar>
void lsh_attention_fused_paged(ConstMatrixRef<Scalar> q, const PagedKV<Scalar>& cache,
                               Index sequence, Index kv_head, const HashSet& hashes,
                               MatrixRef<Scalar> out, const AttentionOptions& options = {}) {
  constexpr const char* function = "lsh_attention_fused_paged";
  const Index p0 =
      detail::require_paged_arguments<Scalar>(function, q, cache, sequence, kv_head, out, options);
  validate_hashes(hashes, function);
  const auto tau = static_cast<Scalar>(detail::resolve_scale(function, options, q.cols()));
  const Index m = q.rows();
  if (m == 0) return;
  const bool causal = options.masking == Masking::causal;
  const Index n = cache.length(sequence);
  detail::parallel_query_tiles<Scalar>(
      1, p0, p0 + m, detail::JobOrder::head_runs, detail::output_bytes(out),
      [&](Index, Index i0, Index rows, detail::TileWorkspace<Scalar>& work) {
        detail::CountBias<Scalar> bias(hashes, n, causal, work.counts, work.count_tile);
        detail::TileEngine<Scalar, detail::CountBias<Scalar>, detail::PagedRows<Scalar>> engine(
            q, detail::PagedRows<Scalar>(cache, sequence, kv_head), static_cast<double>(tau), bias,
            work.buffers, p0);
        engine.run(i0, i0 + rows, out.middleRows(i0 - p0, rows));
      });
}

/// Exact ALiBi attention (alibi_attention_tiled) of the m queries q (m x d) at positions
/// p0 .. p0 + m - 1 over the L = seq_lens[sequence] tokens of KV head `kv_head` of a paged
/// cache:
///   out_r = softmax_j(tau q_r.k_j - |p0 + r - j| / sigma) V   (causal: j <= p0 + r),
/// p0 = options.query_offset (unset: L - m). Bitwise alibi_attention_tiled on the same keys
/// and values in contiguous matrices, for any page size. Query tiles in parallel
/// (OpenMP), bitwise the same for any thread count. Throws std::invalid_argument naming a bad
/// argument.
template <typename Scalar>
void alibi_attention_tiled_paged(ConstMatrixRef<Scalar> q, const PagedKV<Scalar>& cache,
                                 Index sequence, Index kv_head, double sigma, MatrixRef<Scalar> out,
                                 const AttentionOptions& options = {}) {
  constexpr const char* function = "alibi_attention_tiled_paged";
  const Index p0 =
      detail::require_paged_arguments<Scalar>(function, q, cache, sequence, kv_head, out, options);
  detail::require_sigma(sigma, function);
  const double tau = detail::resolve_scale(function, options, q.cols());
  const Index m = q.rows();
  if (m == 0) return;
  const Index n = cache.length(sequence);
  const detail::ExactWindow window = detail::full_window(n, options.masking);
  detail::parallel_query_tiles<Scalar>(
      1, p0, p0 + m, detail::JobOrder::heads_outer, detail::output_bytes(out),
      [&](Index, Index i0, Index rows, detail::TileWorkspace<Scalar>& work) {
        detail::AlibiBias<Scalar> bias(n, sigma, window);
        detail::TileEngine<Scalar, detail::AlibiBias<Scalar>, detail::PagedRows<Scalar>> engine(
            q, detail::PagedRows<Scalar>(cache, sequence, kv_head), tau, bias, work.buffers, p0);
        engine.run(i0, i0 + rows, out.middleRows(i0 - p0, rows));
      });
}

}  // namespace poslsh
