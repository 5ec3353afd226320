// poslsh: the mean mask M~ = (1/s) sum_k M(h_k) stored as its union-band counts
// (BandCountOperator, BandKernelErrorOperator), for products and max-norm errors whose cost does
// not grow with s; the cost model that chooses between it and MeanMaskOperator's block sums;
// partition_pair_count. Part of the analysis module; needs only Eigen.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "poslsh/analysis/max_error.hpp"
#include "poslsh/analysis/operators.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// Number of pairs (i, j) with M~_ij > 0 (causal: j <= i), sum_i |[lo_i, hi_i)| over the rows'
/// union bands: the pairs the fused LSH kernel evaluates (lsh_fused_pair_count for a hash set).
/// lo_i = min{a : [a, e) a block with a <= i < e} is the suffix minimum over t >= i of the
/// smallest start of the blocks that end at t + 1 (a block ending at or after i + 1 that starts
/// after i never undercuts the block holding i), hi_i likewise by a prefix maximum.
/// Throws std::invalid_argument naming 'partitions.*' if the partitions are invalid.
/// O(blocks + n).
inline long long partition_pair_count(const PartitionSet& set, Masking masking) {
  validate_partition_set(set, "partition_pair_count");
  const Index n = set.n;
  std::vector<Index> lo(static_cast<std::size_t>(n), n);
  std::vector<Index> hi(static_cast<std::size_t>(n), 0);
  // Samples split over threads into private tables (made before the loop), merged by min / max
  // (order-free).
  const bool parallel = set.edges.size() > detail::analysis_parallel_edges;
  struct Table {
    std::vector<Index> lo, hi;
  };
  const auto samples = static_cast<long>(set.samples());
  detail::PerThread<Table> tables(samples, parallel);
  tables.each([&](Table& table) {
    table.lo.assign(static_cast<std::size_t>(n), n);
    table.hi.assign(static_cast<std::size_t>(n), 0);
  });
  detail::parallel_loop(samples, detail::LoopSchedule::blocks(), tables, [&](long k, Table& table) {
    for (const Index* edge = set.begin(k); edge + 1 < set.end(k); ++edge) {
      Index& start = table.lo[static_cast<std::size_t>(edge[1] - 1)];
      start = std::min(start, edge[0]);
      Index& end = table.hi[static_cast<std::size_t>(edge[0])];
      end = std::max(end, edge[1]);
    }
  });
  tables.each([&](const Table& table) {
    for (std::size_t i = 0; i < lo.size(); ++i) {
      lo[i] = std::min(lo[i], table.lo[i]);
      hi[i] = std::max(hi[i], table.hi[i]);
    }
  });
  for (Index i = n - 2; i >= 0; --i) {
    lo[static_cast<std::size_t>(i)] =
        std::min(lo[static_cast<std::size_t>(i)], lo[static_cast<std::size_t>(i) + 1]);
  }
  long long pairs = 0;
  Index reach = 0;
  for (Index i = 0; i < n; ++i) {
    reach = std::max(reach, hi[static_cast<std::size_t>(i)]);
    const Index end = masking == Masking::causal ? i + 1 : reach;
    pairs += end - lo[static_cast<std::size_t>(i)];
  }
  return pairs;
}

/// How the analysis functions represent M~. The block sums cost O(n + s n / sigma) per product;
/// the band counts O(sum_i |band_i|) = O(n * band) per product after an O(s n / sigma + n * band)
/// build, so they win once s is large (s n / sigma >> n * band: the band grows only like
/// sigma ln s).
enum class MaskRepresentation {
  automatic,    ///< choose_mask_representation: the cheaper of the two by mask_representation_costs
  block_sums,   ///< MeanMaskOperator: prefix sums over the stored blocks, O(n + s n / sigma)
  band_counts,  ///< BandCountOperator: the stored counts c_ij / s on each row's union band
};

/// The names "automatic", "block_sums" and "band_counts" (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(MaskRepresentation, automatic, block_sums, band_counts);

/// Predicted cost (memory words touched) of one product with M~ in each representation, and the
/// band-count table's size.
struct MaskRepresentationCosts {
  double block_sums = 0.0;     ///< 4 (n + number of blocks): a prefix sum and random-access spreads
  double band_counts = 0.0;    ///< n (2 b_max + 1): the stored table, b_max the largest block
  double build = 0.0;          ///< 3 (number of blocks) + 2 n (2 b_max + 1): the band table's build
  double table_entries = 0.0;  ///< n (2 b_max + 1) doubles of the band table
};

/// Both representations' costs for stored partitions (PartitionSet, a
/// PartitionSet). O(blocks).
inline MaskRepresentationCosts mask_representation_costs(const PartitionSet& set) {
  const double n = static_cast<double>(set.n);
  const double blocks = static_cast<double>(set.edges.size()) - static_cast<double>(set.samples());
  const double width = 2.0 * static_cast<double>(detail::analysis_largest_block(set)) + 1.0;
  MaskRepresentationCosts costs;
  costs.block_sums = 4.0 * (n + blocks);
  costs.band_counts = n * width;
  costs.build = 3.0 * blocks + 2.0 * n * width;
  costs.table_entries = n * width;
  return costs;
}

/// Largest band table (doubles) choose_mask_representation allows: 2^26 (512 MiB).
inline constexpr double max_band_table_entries = 67108864.0;

/// The cheaper representation for `products` products with M~ (a Lanczos run takes tens to
/// hundreds): band_counts when its table fits max_band_table_entries and
/// build + products * band_counts < products * block_sums, else block_sums. O(blocks).
inline MaskRepresentation choose_mask_representation(const PartitionSet& set,
                                                     double products = 100.0) {
  const MaskRepresentationCosts costs = mask_representation_costs(set);
  const bool fits = costs.table_entries <= max_band_table_entries;
  return fits && costs.build + products * costs.band_counts < products * costs.block_sums
             ? MaskRepresentation::band_counts
             : MaskRepresentation::block_sums;
}

/// The mean mask M~ = (1/s) C, C_ij = #{k : i and j share a block of sample k}, stored row by
/// row on the union band: row i holds C_ij / s for j in [i - b, i + b] (b the largest block),
/// with its non-zero range [lo_i, hi_i). Built without touching the entries one by one: each
/// block [a, e) adds 1 on the square [a, e)^2, whose 2-D difference array has the four corners
/// +1 (a, a), -1 (a, e), -1 (e, a), +1 (e, e); in band coordinates (i, m = j - i + b) every
/// corner has 0 <= m <= 2b, a prefix sum along each row and then along the diagonals
/// C(i, m) += C(i - 1, m + 1) give the counts. Integer counts, so the table does not depend on
/// the order of the corners. Products y_i = sum_j (C_ij / s) x_j over the row's band (causal:
/// j <= i; transposed causal: j >= i, as C is symmetric), each row's dot product in a fixed
/// order on one thread: the result does not depend on the number of threads (OpenMP over rows).
/// Build O(blocks + n b), memory n (2b + 1) doubles, products O(sum_i |band_i|).
class BandCountOperator {
 public:
  /// From stored partitions. Throws std::invalid_argument naming 'partitions.*' if they are
  /// invalid (validate_partition_set).
  BandCountOperator(const PartitionSet& set, Masking masking) : masking_(masking) {
    validate_partition_set(set, "BandCountOperator");
    build(set);
  }

  /// From a hash set (a HashSet or any container of BinHash). Throws std::invalid_argument if
  /// the set is empty, a hash is invalid or n < 0.
  template <typename Hashes = HashSet>
  BandCountOperator(const Hashes& hashes, Index n, Masking masking)
      : BandCountOperator(detail::analysis_partitions(hashes, n, "BandCountOperator"), masking) {}

  Index size() const { return n_; }
  Index samples() const { return samples_; }
  Masking masking() const { return masking_; }
  bool symmetric() const { return masking_ == Masking::bidirectional; }
  /// Half-width b of the stored band (the largest block).
  Index band() const { return band_; }
  /// Entries in the stored union bands, sum_i (hi_i - lo_i) (the product's cost).
  long long band_entries() const { return entries_; }
  /// M~_ij = C_ij / s (0 outside the band; causal: 0 for j > i).
  double entry(Index i, Index j) const {
    if (masking_ == Masking::causal && j > i) return 0.0;
    const Index m = j - i + band_;
    if (m < 0 || m > 2 * band_) return 0.0;
    return table_[static_cast<std::size_t>(i * stride_ + m)];
  }
  /// Row i's non-zero keys [lo_i, hi_i) (bidirectional; causal cuts at i + 1).
  Index row_begin(Index i) const { return lo_[static_cast<std::size_t>(i)]; }
  Index row_end(Index i) const { return hi_[static_cast<std::size_t>(i)]; }

  /// y = M~ x. Throws std::invalid_argument naming 'x' or 'y' if a size differs from n.
  template <typename Scalar>
  void apply(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    detail::analysis_require_vector_sizes("BandCountOperator::apply", x.size(), y.size(), n_);
    product(x, y, false);
  }

  /// y = M~^T x (equal to M~ x when bidirectional).
  template <typename Scalar>
  void apply_transpose(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    detail::analysis_require_vector_sizes("BandCountOperator::apply_transpose", x.size(), y.size(),
                                          n_);
    product(x, y, masking_ == Masking::causal);
  }

  /// ||L* - M~||_max exactly, as max_error computes it (same entries, same scan order, so the
  /// same value and position bit for bit). Throws std::invalid_argument if sigma is not finite
  /// and > 0. O(n b), rows in parallel (OpenMP).
  MaxError max_error(double sigma) const {
    detail::require_sigma(sigma, "BandCountOperator::max_error");
    if (n_ == 0) return MaxError{};
    const std::vector<double> kernel =
        detail::analysis_kernel_table(static_cast<std::size_t>(band_) + 2, sigma);
    const bool causal = masking_ == Masking::causal;
    constexpr Index rows_per_task = 512;
    const Index tasks = (n_ + rows_per_task - 1) / rows_per_task;
    std::vector<MaxError> results(static_cast<std::size_t>(tasks));
    const auto scan = [&](long job) {
      const auto task = static_cast<Index>(job);
      MaxError best;
      const auto consider = [&best](double value, Index i, Index j) {
        if (best.row < 0 || value > best.value) best = MaxError{value, i, j};
      };
      const Index last = std::min(n_, (task + 1) * rows_per_task);
      for (Index i = task * rows_per_task; i < last; ++i) {
        const Index lo = lo_[static_cast<std::size_t>(i)];
        const Index hi = causal ? std::min(hi_[static_cast<std::size_t>(i)], i + 1)
                                : hi_[static_cast<std::size_t>(i)];
        if (lo > 0) consider(kernel[static_cast<std::size_t>(i - lo + 1)], i, lo - 1);
        const double* row = table_.data() + static_cast<std::size_t>(i * stride_ - i + band_);
        for (Index j = lo; j < hi; ++j) {
          const double exact = kernel[static_cast<std::size_t>(i > j ? i - j : j - i)];
          consider(std::abs(row[j] - exact), i, j);
        }
        if (!causal && hi < n_) consider(kernel[static_cast<std::size_t>(hi - i)], i, hi);
      }
      results[static_cast<std::size_t>(task)] = best;
    };
    detail::parallel_loop(static_cast<long>(tasks), detail::LoopSchedule::dynamic(),
                          entries_ > parallel_product_entries, scan);
    return detail::analysis_largest_error(results);
  }

 private:
  void build(const PartitionSet& set) {
    n_ = set.n;
    samples_ = set.samples();
    band_ = detail::analysis_largest_block(set);
    stride_ = 2 * band_ + 1;
    table_.assign(static_cast<std::size_t>(n_ * stride_), 0.0);
    lo_.assign(static_cast<std::size_t>(n_), 0);
    hi_.assign(static_cast<std::size_t>(n_), 0);
    if (n_ == 0) return;
    // Corners by rows: each thread owns a contiguous range of rows and adds the corners of
    // every block edge in them, 64 rows (a cache-resident slice of the table) at a time with
    // one cursor per sample. Integer sums in double are exact, so the table does not depend
    // on the thread count or the order.
    constexpr Index rows_per_chunk = 64;
    const Index chunks = (n_ + rows_per_chunk - 1) / rows_per_chunk;
    const Index b = band_;
    const bool parallel = set.edges.size() > detail::analysis_parallel_edges;
    // One part of the rows per thread, with its cursors (made before the loop).
    detail::PerThread<std::vector<const Index*>> cursors(static_cast<long>(chunks), parallel);
    cursors.each([&](std::vector<const Index*>& cursor) {
      cursor.resize(static_cast<std::size_t>(samples_));
    });
    const Index parts = cursors.threads();
    const auto corners = [&](long part, std::vector<const Index*>& cursor) {
      const Index chunk_begin = chunks * static_cast<Index>(part) / parts;
      const Index chunk_end = chunks * (static_cast<Index>(part) + 1) / parts;
      if (chunk_begin < chunk_end) {
        for (Index k = 0; k < samples_; ++k) {
          cursor[static_cast<std::size_t>(k)] =
              std::lower_bound(set.begin(k), set.end(k) - 1, chunk_begin * rows_per_chunk);
        }
        for (Index chunk = chunk_begin; chunk < chunk_end; ++chunk) {
          const Index r1 = std::min(n_, (chunk + 1) * rows_per_chunk);
          for (Index k = 0; k < samples_; ++k) {
            const Index* first = set.begin(k);
            const Index* last = set.end(k) - 1;  // the edge n starts no block
            const Index*& edge = cursor[static_cast<std::size_t>(k)];
            for (; edge != last && *edge < r1; ++edge) {
              double* row = table_.data() + static_cast<std::size_t>(*edge * stride_);
              // Block [edge[0], edge[1]) starts here: +1 at (a, a), -1 at (a, e).
              row[b] += 1.0;
              row[edge[1] - edge[0] + b] -= 1.0;
              // Block [edge[-1], edge[0]) ends here: -1 at (e, a), +1 at (e, e).
              if (edge != first) {
                row[edge[-1] - edge[0] + b] -= 1.0;
                row[b] += 1.0;
              }
            }
          }
        }
      }
    };
    detail::parallel_loop(static_cast<long>(parts), detail::LoopSchedule::blocks(), cursors,
                          corners);
    detail::parallel_loop(static_cast<long>(n_), detail::LoopSchedule::blocks(),
                          n_ * stride_ > parallel_product_entries, [&](Index i) {
                            double* row = table_.data() + static_cast<std::size_t>(i * stride_);
                            for (Index m = 1; m < stride_; ++m) row[m] += row[m - 1];
                          });
    for (Index i = 1; i < n_; ++i) {
      double* row = table_.data() + static_cast<std::size_t>(i * stride_);
      const double* above = row - stride_;
      for (Index m = 0; m + 1 < stride_; ++m) row[m] += above[m + 1];
    }
    const double s = static_cast<double>(samples_);
    detail::parallel_loop(static_cast<long>(n_), detail::LoopSchedule::blocks(),
                          n_ * stride_ > parallel_product_entries, [&](Index i) {
                            double* row = table_.data() + static_cast<std::size_t>(i * stride_);
                            Index lo = b, hi = b + 1;  // C_ii = s > 0
                            while (lo > 0 && row[lo - 1] > 0.0) --lo;
                            while (hi < stride_ && row[hi] > 0.0) ++hi;
                            // As mean_mask_dense: c / s.
                            for (Index m = 0; m < stride_; ++m) row[m] = row[m] / s;
                            lo_[static_cast<std::size_t>(i)] = std::max<Index>(0, i - b + lo);
                            hi_[static_cast<std::size_t>(i)] = std::min(n_, i - b + hi);
                          });
    long long entries = 0;
    for (Index i = 0; i < n_; ++i)
      entries += hi_[static_cast<std::size_t>(i)] - lo_[static_cast<std::size_t>(i)];
    entries_ = entries;
  }

  /// y_i = sum over j in the row's range of (C_ij / s) x_j, in double: four running sums over
  /// j in a fixed pattern, so each row's result is the same whichever thread computes it.
  template <typename Scalar>
  void product(ConstVectorRef<Scalar> x, VectorRef<Scalar> y, bool causal_transpose) const {
    const bool causal = masking_ == Masking::causal;
    input_.resize(static_cast<std::size_t>(n_));
    for (Index i = 0; i < n_; ++i) input_[static_cast<std::size_t>(i)] = static_cast<double>(x[i]);
    output_.resize(static_cast<std::size_t>(n_));
    const double* in = input_.data();
    double* out = output_.data();
    // Threads only for tables of more than parallel_product_entries entries.
    detail::parallel_loop(static_cast<long>(n_), detail::LoopSchedule::blocks(),
                          entries_ > parallel_product_entries, [&](Index i) {
                            Index lo = lo_[static_cast<std::size_t>(i)];
                            Index hi = hi_[static_cast<std::size_t>(i)];
                            if (causal) {
                              if (causal_transpose) {
                                lo = i;
                              } else {
                                hi = i + 1;
                              }
                            }
                            const double* row =
                                table_.data() + static_cast<std::size_t>(i * stride_ - i + band_);
                            double sum[4] = {0.0, 0.0, 0.0, 0.0};
                            Index j = lo;
                            for (; j + 4 <= hi; j += 4) {
                              sum[0] += row[j] * in[j];
                              sum[1] += row[j + 1] * in[j + 1];
                              sum[2] += row[j + 2] * in[j + 2];
                              sum[3] += row[j + 3] * in[j + 3];
                            }
                            for (int r = 0; j < hi; ++j, ++r) sum[r] += row[j] * in[j];
                            out[i] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
                          });
    for (Index i = 0; i < n_; ++i) y[i] = static_cast<Scalar>(out[static_cast<std::size_t>(i)]);
  }

  static constexpr long long parallel_product_entries = 1LL << 22;

  Index n_ = 0;
  Index samples_ = 0;
  Index band_ = 0;
  Index stride_ = 1;
  Masking masking_;
  long long entries_ = 0;
  std::vector<double> table_;
  std::vector<Index> lo_;
  std::vector<Index> hi_;
  mutable std::vector<double> input_;
  mutable std::vector<double> output_;
};

/// The error operator E = L* - M~ with M~ as a BandCountOperator: O(n + sum_i |band_i|) per
/// product. The same members as KernelErrorOperator (size, symmetric, kernel, mean_mask, apply,
/// apply_transpose).
class BandKernelErrorOperator : public detail::AnalysisKernelMinusMask<BandCountOperator> {
 public:
  /// Throws std::invalid_argument naming a bad argument (partitions, sigma).
  BandKernelErrorOperator(const PartitionSet& set, double sigma, Masking masking)
      : AnalysisKernelMinusMask("BandKernelErrorOperator::apply",
                                "BandKernelErrorOperator::apply_transpose", set.n, sigma, masking,
                                set, masking) {}
};

}  // namespace poslsh
