/// \file
/// \brief A KV cache for generation whose memory does not grow with the context: BoundedKVCache
/// keeps, for each sequence and each K/V head, only the keys that the head's queries can still
/// read (the retention rule, poslsh/cache/retention.hpp), in pages of a pool shared by many
/// sequences; multihead_attention_bounded runs every method of the method table on it in place
/// (prefill chunks, decode steps, many sequences at once).
///
/// Storage: a pool of num_pages pages, each holding page_size consecutive positions of one K/V
/// head of one sequence (keys page_size x dim, values page_size x dim_v, in Storage: float,
/// double, Eigen::bfloat16 or Eigen::half). Each (sequence, K/V head) holds a list of pages:
/// logical page p holds its positions [p P, (p + 1) P), P = page_size.
///
/// Appending (append): whole tokens, every K/V head at once, at the sequence's next position
/// (prefill chunks of any length and single decode tokens alike). An append of positions
/// [t, t + m) first moves the sequence's frontier to t: no query will sit before t from then on.
/// Every page whose keys all lie before the head's first live key at t (kv_head_first_live_key:
/// the union of its query heads' keys) is released to the pool, where any sequence's next page
/// may reuse it; then the new tokens are written, taking pages from the pool as needed. advance
/// moves the frontier without appending.
///
/// Memory bound: after a release at frontier t, K/V head g of a sequence of length L holds
/// exactly its logical pages floor(f_g / P) .. ceil(L / P) - 1, f_g its first live key at t,
/// i.e. at most ceil((L - f_g) / P) + 1 pages: the pages of its L - f_g live keys plus at most
/// one page (the dead keys before f_g in the first page and the unwritten rows of the last page
/// are each less than a page, together at most one page beyond the live keys' pages). The live
/// keys L - f_g are t - f_g + (L - t): a band W, a window, or a few sigma for the methods with
/// hashes, independent of t; only an exact head without a window keeps every key.
///
/// Reading: the kernels read each head's pages through a block table that starts at its first
/// held page, the head's keys sitting at positions from first_key (a multiple of P); a released
/// page is never read (it is not in any table, and no kernel reads before a head's first key).
/// Queries must sit at positions >= the sequence's frontier. The page size is a multiple of 64,
/// the kernels' key tile: the key tiles of a head's held pages are then exactly those of the
/// full cache, and every key tile it no longer holds has weight 0 for every query it can still
/// get, so each output row is bitwise that of the same call over a cache holding every key
/// (multihead_attention_varlen on the whole keys; for finite keys and values).
///
/// Errors: std::invalid_argument naming the argument (a closed or unknown sequence, a position
/// out of order, shapes, a pool too small for the append) is thrown before anything changes: a
/// failed call leaves the cache as it was. Not thread-safe for appends; concurrent reads are.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "poslsh/attention/paged.hpp"
#include "poslsh/cache/retention.hpp"
#include "poslsh/core/heads_view.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/require.hpp"
#include "poslsh/detail/tile/types.hpp"
#include "poslsh/multihead/attention.hpp"
#include "poslsh/multihead/methods.hpp"
#include "poslsh/multihead/planner.hpp"
#include "poslsh/multihead/training.hpp"

namespace poslsh {

template <typename Storage>
class BoundedKVCache;

/// The query heads' methods of a plan (plan_heads: one HeadPlan per query head), as
/// multihead_attention runs it: exact_tiled, exact_banded with its W, lsh_fused with the hashes
/// sample_hashes(sigma, s, seed, stream, sampler). For a BoundedKVCache serving the plan.
/// \throws std::invalid_argument naming 'plans' (empty, or a plan that is not valid).
inline std::vector<HeadMethod> planned_heads(const std::vector<HeadPlan>& plans) {
  detail::require(!plans.empty(), "planned_heads", "plans", 0, "must hold one plan per query head");
  return detail::planned_head_methods("planned_heads", static_cast<Index>(plans.size()), plans);
}

namespace detail {

/// The rows of one K/V head of one sequence of a bounded cache: PagedRows over the head's block
/// table (its held pages, from the first) with the position of its first held key, so the
/// kernels read keys from key_position() on (run_heads_forward: row_source_key_position).
template <typename Storage>
class BoundedRows : public PagedRows<Storage> {
 public:
  BoundedRows(const PagedKV<Storage>& pages, Index key_position)
      : PagedRows<Storage>(pages, 0, 0), key_position_(key_position) {}
  Index key_position() const { return key_position_; }

 private:
  Index key_position_;
};

/// Frees a pool buffer of aligned_pool_alloc.
struct PoolFree {
  void operator()(void* buffer) const { std::free(buffer); }
};

/// An uninitialised buffer of `count` Storage elements, 64-byte aligned (pages are written
/// before they are read; the operating system commits a page of memory when it is first
/// written). Throws std::bad_alloc if the memory is not available.
template <typename Storage>
std::unique_ptr<Storage, PoolFree> aligned_pool_alloc(std::size_t count) {
  constexpr std::size_t alignment = 64;
  const std::size_t bytes = std::max<std::size_t>(
      alignment, (count * sizeof(Storage) + alignment - 1) / alignment * alignment);
  void* buffer = std::aligned_alloc(alignment, bytes);
  if (buffer == nullptr) throw std::bad_alloc();
  return std::unique_ptr<Storage, PoolFree>(static_cast<Storage*>(buffer));
}

}  // namespace detail

/// A bounded KV cache (see the file comment): a page pool shared by sequences that hold, per
/// K/V head, the keys and values their heads can still read.
template <typename Storage>
class BoundedKVCache {
 public:
  using storage = Storage;
  /// The page size must be a multiple of this (the kernels' key tile).
  static constexpr Index page_multiple = detail::tile_key_cols;

  /// A pool of num_pages pages of page_size positions for the query heads `heads` (one
  /// HeadMethod per query head, as the kernels run them: resolve_head_methods(H_q, options), or
  /// a plan's heads) read by kv_heads K/V heads (query head h reads K/V head h / (H_q / kv_heads)),
  /// keys of dim columns and values of dim_v.
  /// \throws std::invalid_argument naming 'heads' (empty or an invalid head), 'kv_heads',
  ///   'dim', 'dim_v', 'page_size' (a positive multiple of 64) or 'num_pages' (>= 1, int32).
  BoundedKVCache(std::vector<HeadMethod> heads, Index kv_heads, Index dim, Index dim_v,
                 Index page_size, Index num_pages)
      : heads_(std::move(heads)),
        kv_heads_(kv_heads),
        dim_(dim),
        dim_v_(dim_v),
        page_size_(page_size),
        num_pages_(num_pages) {
    constexpr const char* function = "BoundedKVCache";
    const auto query_heads = static_cast<Index>(heads_.size());
    detail::require(query_heads >= 1, function, "heads", query_heads,
                    "must hold one method per query head");
    for (const HeadMethod& head : heads_) detail::require_retention_head(head, function, "heads");
    detail::require_kv_heads(function, query_heads, kv_heads);
    detail::require(dim >= 1, function, "dim", dim, "must be >= 1");
    detail::require(dim_v >= 1, function, "dim_v", dim_v, "must be >= 1");
    detail::require(page_size >= page_multiple && page_size % page_multiple == 0, function,
                    "page_size", page_size, [&] {
                      return "must be a positive multiple of " + std::to_string(page_multiple) +
                             " (the kernels' key tile)";
                    });
    detail::require(num_pages >= 1 && num_pages <= std::numeric_limits<std::int32_t>::max(),
                    function, "num_pages", num_pages, "must lie in [1, 2^31 - 1]");
    const auto pages = static_cast<std::size_t>(num_pages);
    k_pool_ =
        detail::aligned_pool_alloc<Storage>(pages * static_cast<std::size_t>(page_size * dim));
    v_pool_ =
        detail::aligned_pool_alloc<Storage>(pages * static_cast<std::size_t>(page_size * dim_v));
    free_.reserve(pages);
    // Popped from the back: page 0 first.
    for (Index p = num_pages - 1; p >= 0; --p) free_.push_back(static_cast<std::int32_t>(p));
  }

  /// The query heads' methods (the kernels run them; retention follows them).
  const std::vector<HeadMethod>& heads() const { return heads_; }
  Index query_heads() const { return static_cast<Index>(heads_.size()); }
  Index kv_heads() const { return kv_heads_; }
  Index dim() const { return dim_; }
  Index dim_v() const { return dim_v_; }
  Index page_size() const { return page_size_; }
  Index num_pages() const { return num_pages_; }
  /// Pages in the pool, not held by any sequence.
  Index free_pages() const { return static_cast<Index>(free_.size()); }
  Index pages_in_use() const { return num_pages_ - free_pages(); }
  /// Bytes of one page (keys and values).
  std::size_t page_bytes() const {
    return static_cast<std::size_t>(page_size_ * (dim_ + dim_v_)) * sizeof(Storage);
  }
  /// Bytes of the pages held by the sequences: pages_in_use() * page_bytes().
  std::size_t bytes_in_use() const {
    return static_cast<std::size_t>(pages_in_use()) * page_bytes();
  }
  /// Bytes a cache holding every key of `sequence` would take (length x kv_heads rows of keys
  /// and values in Storage), for comparison.
  std::size_t full_cache_bytes(Index sequence) const {
    return static_cast<std::size_t>(length(sequence) * kv_heads_ * (dim_ + dim_v_)) *
           sizeof(Storage);
  }

  /// Fills each page with NaN when it is released (a check for tests: a kernel that read a
  /// released key would return NaN). Storage must have a NaN (float types).
  void poison_released_pages(bool on) { poison_ = on; }

  /// Opens a new sequence (length 0) and returns its id (ids are not reused).
  Index open() {
    Sequence sequence;
    sequence.open = true;
    sequence.heads.resize(static_cast<std::size_t>(kv_heads_));
    sequences_.push_back(std::move(sequence));
    return static_cast<Index>(sequences_.size()) - 1;
  }

  /// Closes a sequence: its pages return to the pool. \throws std::invalid_argument naming
  /// 'sequence' if it is not open.
  void close(Index sequence) {
    Sequence& s = open_sequence("BoundedKVCache::close", sequence);
    for (HeadPages& head : s.heads) {
      release_front(head, static_cast<Index>(head.pages.size()));
      head.pages.shrink_to_fit();
    }
    s.open = false;
  }

  bool is_open(Index sequence) const {
    return sequence >= 0 && sequence < static_cast<Index>(sequences_.size()) &&
           sequences_[static_cast<std::size_t>(sequence)].open;
  }
  /// Tokens appended to the sequence (its next position).
  Index length(Index sequence) const { return get("BoundedKVCache::length", sequence).length; }
  /// The first position a query of the sequence may have (the first position of its last
  /// append, or advance's).
  Index frontier(Index sequence) const {
    return get("BoundedKVCache::frontier", sequence).frontier;
  }
  /// The position of the first key K/V head kv_head of the sequence holds (a multiple of the
  /// page size; the length when it holds none).
  Index first_key(Index sequence, Index kv_head) const {
    const HeadPages& head = head_pages("BoundedKVCache::first_key", sequence, kv_head);
    return head.first_page * page_size_;
  }
  /// The pages K/V head kv_head of the sequence holds, in position order (its block table).
  const std::vector<std::int32_t>& held_pages(Index sequence, Index kv_head) const {
    return head_pages("BoundedKVCache::held_pages", sequence, kv_head).pages;
  }
  /// The key and the value row of `position` of K/V head kv_head (dim and dim_v elements).
  /// \throws std::invalid_argument naming 'position' if the cache does not hold it.
  const Storage* key_row(Index sequence, Index kv_head, Index position) const {
    return k_pool_.get() + pool_row("BoundedKVCache::key_row", sequence, kv_head, position) * dim_;
  }
  const Storage* value_row(Index sequence, Index kv_head, Index position) const {
    return v_pool_.get() +
           pool_row("BoundedKVCache::value_row", sequence, kv_head, position) * dim_v_;
  }

  /// Appends the tokens of `keys` (tokens x kv_heads x dim) and `values` (tokens x kv_heads x
  /// dim_v) at positions position .. position + tokens - 1 of the sequence, after releasing the
  /// pages dead at frontier `position` (see the file comment).
  /// \throws std::invalid_argument naming 'sequence' (not open), 'position' (not the sequence's
  ///   length), 'keys' or 'values' (shapes; 'keys' also when the pool has too few free pages
  ///   for the new tokens, counting those the release frees), before anything changes.
  void append(Index sequence, Index position, HeadsView<const Storage> keys,
              HeadsView<const Storage> values) {
    constexpr const char* function = "BoundedKVCache::append";
    Sequence& s = open_sequence(function, sequence);
    detail::require(position == s.length, function, "position", position, [&] {
      return "must be the sequence's length " + std::to_string(s.length) +
             " (tokens are appended in position order)";
    });
    detail::require_view_shape(function, "keys", keys, keys.tokens, kv_heads_, dim_);
    detail::require_view_shape(function, "values", values, keys.tokens, kv_heads_, dim_v_);
    const Index tokens = keys.tokens;
    detail::require(position + tokens <= std::numeric_limits<std::int32_t>::max(), function, "keys",
                    tokens, "would take the sequence past 2^31 - 1 positions");
    const std::vector<Index> releases = release_counts(s, position);
    Index released = 0;
    for (Index r : releases) released += r;
    const Index needed = kv_heads_ * (pages_for(position + tokens) - pages_for(position));
    if (needed > free_pages() + released)
      detail::throw_invalid(
          function, "keys", tokens,
          "tokens need " + std::to_string(needed) + " new pages, the pool has " +
              std::to_string(free_pages()) + " free (+" + std::to_string(released) +
              " released by this append) of num_pages = " + std::to_string(num_pages_));
    // Nothing can fail from here on.
    for (Index g = 0; g < kv_heads_; ++g)
      release_front(s.heads[static_cast<std::size_t>(g)], releases[static_cast<std::size_t>(g)]);
    s.frontier = position;
    for (Index g = 0; g < kv_heads_; ++g) {
      HeadPages& head = s.heads[static_cast<std::size_t>(g)];
      const auto k_g = keys.head(g);
      const auto v_g = values.head(g);
      for (Index r = 0; r < tokens; ++r) {
        const Index j = position + r;
        if (j % page_size_ == 0) {
          if (head.pages.empty()) head.first_page = j / page_size_;
          head.pages.push_back(free_.back());
          free_.pop_back();
        }
        const Index row = physical_row(head, j);
        std::memcpy(k_pool_.get() + row * dim_, k_g.row(r).data(),
                    static_cast<std::size_t>(dim_) * sizeof(Storage));
        std::memcpy(v_pool_.get() + row * dim_v_, v_g.row(r).data(),
                    static_cast<std::size_t>(dim_v_) * sizeof(Storage));
      }
    }
    s.length = position + tokens;
  }

  /// Moves the sequence's frontier to t (frontier <= t <= length: no query will sit before t)
  /// and releases the pages dead at t. \throws std::invalid_argument naming 'sequence' or 't'.
  void advance(Index sequence, Index t) {
    constexpr const char* function = "BoundedKVCache::advance";
    Sequence& s = open_sequence(function, sequence);
    detail::require(t >= s.frontier && t <= s.length, function, "t", t, [&] {
      return "must lie in [frontier, length] = [" + std::to_string(s.frontier) + ", " +
             std::to_string(s.length) + "]";
    });
    const std::vector<Index> releases = release_counts(s, t);
    for (Index g = 0; g < kv_heads_; ++g)
      release_front(s.heads[static_cast<std::size_t>(g)], releases[static_cast<std::size_t>(g)]);
    s.frontier = t;
  }

  /// The block-table view of K/V head g of a sequence for the kernels (checked by the caller):
  /// calls use(BoundedRows) with the head's held pages.
  template <typename Use>
  void with_head_rows(Index sequence, Index g, Use&& use) const {
    const Sequence& s = sequences_[static_cast<std::size_t>(sequence)];
    const HeadPages& head = s.heads[static_cast<std::size_t>(g)];
    const Index k0 = head.first_page * page_size_;
    const auto rows = static_cast<std::int32_t>(std::max<Index>(0, s.length - k0));
    PagedKV<Storage> view;
    view.k_pages = k_pool_.get();
    view.v_pages = v_pool_.get();
    view.num_pages = num_pages_;
    view.page_size = page_size_;
    view.heads = 1;
    view.dim = dim_;
    view.dim_v = dim_v_;
    view.block_table = head.pages.data();
    view.batch = 1;
    view.max_pages = static_cast<Index>(head.pages.size());
    view.seq_lens = &rows;
    use(detail::BoundedRows<Storage>(view, k0));
  }

 private:
  struct HeadPages {
    std::vector<std::int32_t> pages;  // physical pages of logical pages first_page ..
    Index first_page = 0;
  };
  struct Sequence {
    bool open = false;
    Index length = 0;
    Index frontier = 0;
    std::vector<HeadPages> heads;
  };

  Index pages_for(Index positions) const { return (positions + page_size_ - 1) / page_size_; }

  Index physical_row(const HeadPages& head, Index j) const {
    const auto logical = static_cast<std::size_t>(j / page_size_ - head.first_page);
    return static_cast<Index>(head.pages[logical]) * page_size_ + j % page_size_;
  }

  // Pages to release from the front of each head at frontier t: those wholly before the head's
  // first live key.
  std::vector<Index> release_counts(const Sequence& s, Index t) const {
    std::vector<Index> counts(static_cast<std::size_t>(kv_heads_), 0);
    const Index group = query_heads() / kv_heads_;
    for (Index g = 0; g < kv_heads_; ++g) {
      Index first = t;
      for (Index h = g * group; h < (g + 1) * group; ++h)
        first = std::min(first,
                         detail::first_live_key_unchecked(heads_[static_cast<std::size_t>(h)], t));
      const HeadPages& head = s.heads[static_cast<std::size_t>(g)];
      const Index dead = first / page_size_ - head.first_page;
      counts[static_cast<std::size_t>(g)] =
          std::clamp<Index>(dead, 0, static_cast<Index>(head.pages.size()));
    }
    return counts;
  }

  void release_front(HeadPages& head, Index count) {
    if (count <= 0) return;
    for (Index p = 0; p < count; ++p) {
      const std::int32_t page = head.pages[static_cast<std::size_t>(p)];
      if (poison_) poison(page);
      free_.push_back(page);
    }
    head.pages.erase(head.pages.begin(), head.pages.begin() + count);
    head.first_page += count;
  }

  void poison(std::int32_t page) {
    const Storage nan = Storage(std::numeric_limits<float>::quiet_NaN());
    std::fill_n(k_pool_.get() + static_cast<Index>(page) * page_size_ * dim_, page_size_ * dim_,
                nan);
    std::fill_n(v_pool_.get() + static_cast<Index>(page) * page_size_ * dim_v_, page_size_ * dim_v_,
                nan);
  }

  Sequence& open_sequence(const char* function, Index sequence) {
    detail::require(is_open(sequence), function, "sequence", sequence, [&] {
      return "must be an open sequence of this cache (open() returns them; " +
             std::to_string(sequences_.size()) + " opened so far)";
    });
    return sequences_[static_cast<std::size_t>(sequence)];
  }
  const Sequence& get(const char* function, Index sequence) const {
    detail::require(is_open(sequence), function, "sequence", sequence,
                    "must be an open sequence of this cache");
    return sequences_[static_cast<std::size_t>(sequence)];
  }
  const HeadPages& head_pages(const char* function, Index sequence, Index kv_head) const {
    const Sequence& s = get(function, sequence);
    detail::require_kv_head(function, kv_head, kv_heads_);
    return s.heads[static_cast<std::size_t>(kv_head)];
  }
  Index pool_row(const char* function, Index sequence, Index kv_head, Index position) const {
    const HeadPages& head = head_pages(function, sequence, kv_head);
    const Index first = head.first_page * page_size_;
    const Index length = sequences_[static_cast<std::size_t>(sequence)].length;
    detail::require(position >= first && position < length, function, "position", position, [&] {
      return "must be a held position, in [" + std::to_string(first) + ", " +
             std::to_string(length) + ")";
    });
    return physical_row(head, position);
  }

  std::vector<HeadMethod> heads_;
  Index kv_heads_, dim_, dim_v_, page_size_, num_pages_;
  std::unique_ptr<Storage, detail::PoolFree> k_pool_, v_pool_;
  std::vector<std::int32_t> free_;
  std::vector<Sequence> sequences_;
  bool poison_ = false;
};

namespace detail {

/// The keys of a call on a bounded cache: sequence b of the call is the cache's sequence
/// sequences[b]; with_head(s, b, g, use) calls use(BoundedRows) of its K/V head g.
template <typename KVScalar>
struct BoundedHeadsKeys {
  const BoundedKVCache<KVScalar>& cache;
  const std::vector<Index>& sequences;

  Index heads() const { return cache.kv_heads(); }
  template <typename Use>
  void with_head(const HeadsSequence&, std::size_t b, Index g, Use&& use) const {
    cache.with_head_rows(sequences[b], g, std::forward<Use>(use));
  }
};

/// The checked arguments of a call on a bounded cache: q (H_q heads of cache.dim()), out
/// (q.tokens x H_q x cache.dim_v()), the sequences (open; one or more), cu_seqlens_q
/// (sequences + 1 entries from 0 to q.tokens), the query offsets (p_b = query_offsets[b] in
/// [frontier_b, L_b - m_b], else L_b - m_b, which must be >= frontier_b) and the options
/// (options.query_offset unset); the methods are the cache's.
template <typename QScalar, typename KVScalar, typename OutScalar>
HeadsCall bounded_call(const char* function, const HeadsView<const QScalar>& q,
                       const BoundedKVCache<KVScalar>& cache, const std::vector<Index>& sequences,
                       const HeadsView<OutScalar>& out,
                       const std::vector<std::int32_t>& cu_seqlens_q,
                       const AttentionOptions& options, const std::vector<Index>& query_offsets) {
  q.validate(function, "q");
  require(q.heads == cache.query_heads(), function, "q.heads", q.heads, [&] {
    return "must equal the cache's query heads " + std::to_string(cache.query_heads());
  });
  require(q.dim == cache.dim(), function, "q.dim", q.dim,
          [&] { return "must equal cache.dim() = " + std::to_string(cache.dim()); });
  require_view_shape(function, "out", out, q.tokens, q.heads, cache.dim_v());
  require_no_query_offset(function, options.query_offset);
  require(!sequences.empty(), function, "sequences", 0, "must name at least one sequence");
  for (Index id : sequences)
    require(cache.is_open(id), function, "sequences", id, "must be open sequences of the cache");
  HeadsCall call;
  call.heads = cache.heads();
  call.sequences =
      cache_sequences(function, cu_seqlens_q, q.tokens, sequences.size(), "sequences.size()",
                      [&](std::size_t b) { return cache.length(sequences[b]); });
  resolve_query_offsets(function, call.sequences, query_offsets, "cu_seqlens_q");
  for (std::size_t b = 0; b < sequences.size(); ++b) {
    const HeadsSequence& s = call.sequences[b];
    const Index frontier = cache.frontier(sequences[b]);
    if (s.q_end > s.q_begin)
      require(
          s.p0 >= frontier, function, query_offsets.empty() ? "cu_seqlens_q" : "query_offsets",
          s.p0, [&] {
            return "puts the first query of sequence " + std::to_string(sequences[b]) +
                   " before its frontier " + std::to_string(frontier) +
                   " (the cache no longer holds the keys it may read): queries sit at positions "
                   ">= the first position of the last append";
          });
  }
  resolve_call_options(call, function, options, q.dim);
  return call;
}

}  // namespace detail

/// Multi-head ALiBi attention over a bounded KV cache, for a batch of its sequences: sequence b
/// of the call is the cache's sequence sequences[b], with the query tokens [cu_seqlens_q[b],
/// cu_seqlens_q[b+1]) of q and out at positions p_b .. p_b + m_b - 1, p_b = query_offsets[b] when
/// given, else L_b - m_b (bottom-right: a prefill chunk or a decode step just appended); every
/// p_b must be >= the sequence's frontier. For each query head h (K/V head g = h / (H_q /
/// H_kv)), with the cache's method of head h (cache.heads()[h]):
///   out_{b,h} = method(Q_{b,h}, K_{b,g}, V_{b,g}; sigma_h)  at query offset p_b,
/// over the keys the cache holds for (sequences[b], g), read in place from the pool. Each
/// output row is bitwise that of multihead_attention_varlen over every key of the sequence
/// with the same methods (see the file comment); one parallel loop over the (sequence, query
/// tile, head) jobs: bitwise the same for any thread count. Scalars: q in Scalar, the cache in
/// KVScalar, out in OutScalar, computed as multihead_attention_paged.
/// options: masking, scale, precision (options.query_offset must be unset).
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention_bounded(HeadsView<const Scalar> q, const BoundedKVCache<KVScalar>& cache,
                                 const std::vector<Index>& sequences, HeadsView<OutScalar> out,
                                 const std::vector<std::int32_t>& cu_seqlens_q,
                                 const AttentionOptions& options = {},
                                 const std::vector<Index>& query_offsets = {}) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  const detail::HeadsCall call =
      detail::bounded_call("multihead_attention_bounded", q, cache, sequences, out, cu_seqlens_q,
                           options, query_offsets);
  detail::run_heads_forward<Compute>(call, q, detail::BoundedHeadsKeys<KVScalar>{cache, sequences},
                                     out);
}

/// multihead_attention_bounded with the log-sum-exp: column t of lse (H_q x q.tokens) is the
/// log-sum-exp of query token t (as multihead_attention_paged_with_lse); every method but
/// mean_of_outputs. \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention_bounded_with_lse(
    HeadsView<const Scalar> q, const BoundedKVCache<KVScalar>& cache,
    const std::vector<Index>& sequences, HeadsView<OutScalar> out,
    MatrixRef<compute_scalar_t<Scalar, KVScalar, OutScalar>> lse,
    const std::vector<std::int32_t>& cu_seqlens_q, const AttentionOptions& options = {},
    const std::vector<Index>& query_offsets = {}) {
  using Compute = compute_scalar_t<Scalar, KVScalar, OutScalar>;
  constexpr const char* function = "multihead_attention_bounded_with_lse";
  const detail::HeadsCall call = detail::bounded_call(function, q, cache, sequences, out,
                                                      cu_seqlens_q, options, query_offsets);
  detail::require_lse_shape(function, lse, q);
  detail::require_methods_with_lse(function, call);
  detail::run_heads_forward<Compute>(call, q, detail::BoundedHeadsKeys<KVScalar>{cache, sequences},
                                     out, lse.data(), lse.outerStride());
}

/// multihead_attention_bounded on one sequence: its queries at options.query_offset (unset:
/// the last q.tokens positions).
template <typename Scalar, typename KVScalar = Scalar, typename OutScalar = Scalar>
void multihead_attention_bounded(HeadsView<const Scalar> q, const BoundedKVCache<KVScalar>& cache,
                                 Index sequence, HeadsView<OutScalar> out,
                                 const AttentionOptions& options = {}) {
  AttentionOptions rest = options;
  std::vector<Index> offsets;
  if (options.query_offset) offsets.push_back(*options.query_offset);
  rest.query_offset.reset();
  multihead_attention_bounded<Scalar, KVScalar, OutScalar>(
      q, cache, std::vector<Index>{sequence}, out,
      std::vector<std::int32_t>{0, static_cast<std::int32_t>(q.tokens)}, rest, offsets);
}

}  // namespace poslsh
