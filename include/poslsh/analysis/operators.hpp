// poslsh: matrix-free products with the ALiBi kernel L*, the mean mask M~ and their difference
// E = L* - M~, so errors can be measured at sizes where n x n matrices do not fit. Part of the
// analysis module (poslsh/analysis.hpp); needs only Eigen, so poslsh.hpp includes it too.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "poslsh/core/hash.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// Column vector of Scalar.
template <typename Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
/// Read-only view of a contiguous vector.
template <typename Scalar>
using ConstVectorRef = Eigen::Ref<const Vector<Scalar>>;
/// Writable view of a contiguous vector.
template <typename Scalar>
using VectorRef = Eigen::Ref<Vector<Scalar>>;

namespace detail {

/// Throws std::invalid_argument naming 'x' or 'y' (of `function`) if its size is not n.
inline void analysis_require_vector_sizes(const char* function, Index x_size, Index y_size,
                                          Index n) {
  require(x_size == n, function, "x", x_size,
          [&] { return "size must equal the operator size " + std::to_string(n); });
  require(y_size == n, function, "y", y_size,
          [&] { return "size must equal the operator size " + std::to_string(n); });
}

}  // namespace detail

// Every operator below accumulates in double whatever Scalar is, reads all of x before it
// writes y (so x and y may be the same vector), and keeps a scratch buffer: one object must not
// be applied from two threads at once.

/// The ALiBi kernel L*_ij = exp(-|i-j| / sigma) (causal: 0 for j > i) as an operator, O(n)
/// per product by the decay recurrence, r = exp(-1/sigma):
///   causal         (L* x)_i = x_i + r (L* x)_{i-1};
///   bidirectional  L* x = f + g - x, f_i = x_i + r f_{i-1}, g_i = x_i + r g_{i+1}.
/// The transpose of the causal kernel is the backward recurrence g.
class AlibiKernelOperator {
 public:
  /// Throws std::invalid_argument if n < 0 or sigma is not finite and > 0.
  AlibiKernelOperator(Index n, double sigma, Masking masking)
      : n_(n), sigma_(sigma), masking_(masking) {
    detail::require_size(n, "AlibiKernelOperator", "n");
    detail::require_sigma(sigma, "AlibiKernelOperator");
    decay_ = std::exp(-1.0 / sigma);
  }

  Index size() const { return n_; }
  double sigma() const { return sigma_; }
  Masking masking() const { return masking_; }
  bool symmetric() const { return masking_ == Masking::bidirectional; }

  /// y = L* x. Throws std::invalid_argument naming 'x' or 'y' if a size differs from n.
  template <typename Scalar>
  void apply(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    detail::analysis_require_vector_sizes("AlibiKernelOperator::apply", x.size(), y.size(), n_);
    if (masking_ == Masking::causal) {
      forward(x, y);
    } else {
      backward_to_scratch(x);
      double f = 0.0;
      for (Index i = 0; i < n_; ++i) {
        const double xi = static_cast<double>(x[i]);
        f = xi + decay_ * f;
        y[i] = static_cast<Scalar>(f + scratch_[static_cast<std::size_t>(i)] - xi);
      }
    }
  }

  /// y = L*^T x (equal to L* x when bidirectional).
  template <typename Scalar>
  void apply_transpose(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    if (masking_ == Masking::bidirectional) return apply<Scalar>(x, y);
    detail::analysis_require_vector_sizes("AlibiKernelOperator::apply_transpose", x.size(),
                                          y.size(), n_);
    double g = 0.0;
    for (Index i = n_ - 1; i >= 0; --i) {
      g = static_cast<double>(x[i]) + decay_ * g;
      y[i] = static_cast<Scalar>(g);
    }
  }

 private:
  template <typename Scalar>
  void forward(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    double f = 0.0;
    for (Index i = 0; i < n_; ++i) {
      f = static_cast<double>(x[i]) + decay_ * f;
      y[i] = static_cast<Scalar>(f);
    }
  }

  template <typename Scalar>
  void backward_to_scratch(ConstVectorRef<Scalar> x) const {
    scratch_.resize(static_cast<std::size_t>(n_));
    double g = 0.0;
    for (Index i = n_ - 1; i >= 0; --i) {
      g = static_cast<double>(x[i]) + decay_ * g;
      scratch_[static_cast<std::size_t>(i)] = g;
    }
  }

  Index n_;
  double sigma_;
  Masking masking_;
  double decay_ = 0.0;
  mutable std::vector<double> scratch_;
};

/// The mean mask M~ = (1/s) sum_k M(h_k) (causal: times the lower triangle) as an operator.
/// With prefix sums P_i = x_0 + ... + x_{i-1} and B_k(i) = [b, e) the block of sample k that
/// holds i:
///   bidirectional  (M~ x)_i = (1/s) sum_k (P_e - P_b);
///   causal         (M~ x)_i = P_{i+1} - (1/s) sum_k P_b,   (M~^T x)_i = (1/s) sum_k P_e - P_i.
/// Each sum over k is spread by a difference array, so a product costs O(n + number of blocks)
/// = O(n + s n / sigma) time after an O(s n / sigma)-memory table of block edges.
class MeanMaskOperator {
 public:
  /// `hashes`: a HashSet or any container of BinHash. Throws std::invalid_argument if the set
  /// is empty, a hash is invalid or n < 0.
  template <typename Hashes = HashSet>
  MeanMaskOperator(const Hashes& hashes, Index n, Masking masking)
      : partitions_(detail::analysis_partitions(hashes, n, "MeanMaskOperator")),
        masking_(masking) {}

  /// From stored partitions (any blocks, e.g. sample_partition_set's Poisson cuts). Throws
  /// std::invalid_argument naming 'partitions.*' if they are invalid.
  MeanMaskOperator(PartitionSet partitions, Masking masking)
      : partitions_(std::move(partitions)), masking_(masking) {
    validate_partition_set(partitions_, "MeanMaskOperator");
  }

  Index size() const { return partitions_.n; }
  Index samples() const { return partitions_.samples(); }
  Masking masking() const { return masking_; }
  bool symmetric() const { return masking_ == Masking::bidirectional; }
  /// The stored block edges (see PartitionSet).
  const PartitionSet& partitions() const { return partitions_; }

  /// y = M~ x. Throws std::invalid_argument naming 'x' or 'y' if a size differs from n.
  template <typename Scalar>
  void apply(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    detail::analysis_require_vector_sizes("MeanMaskOperator::apply", x.size(), y.size(), size());
    product(x, y, false);
  }

  /// y = M~^T x (equal to M~ x when bidirectional).
  template <typename Scalar>
  void apply_transpose(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    detail::analysis_require_vector_sizes("MeanMaskOperator::apply_transpose", x.size(), y.size(),
                                          size());
    product(x, y, masking_ == Masking::causal);
  }

 private:
  /// Positions per cache-resident chunk of the sweep.
  static constexpr Index chunk = 4096;

  template <typename Scalar>
  void product(ConstVectorRef<Scalar> x, VectorRef<Scalar> y, bool causal_transpose) const {
    const Index n = size();
    const auto samples_count = static_cast<std::size_t>(samples());
    prefix_.resize(static_cast<std::size_t>(n) + 1);
    prefix_[0] = 0.0;
    for (Index i = 0; i < n; ++i) {
      prefix_[static_cast<std::size_t>(i) + 1] =
          prefix_[static_cast<std::size_t>(i)] + static_cast<double>(x[i]);
    }
    cursor_.resize(samples_count);
    previous_.assign(samples_count, 0.0);
    for (Index k = 0; k < samples(); ++k)
      cursor_[static_cast<std::size_t>(k)] = partitions_.begin(k);
    const bool causal = masking_ == Masking::causal;
    const double inverse_s = 1.0 / static_cast<double>(samples());
    double running = 0.0;
    // Chunk [c0, c1): spread the blocks of every sample that start in it, after which the
    // chunk's difference array is final and its outputs are written.
    for (Index c0 = 0; c0 < n; c0 += chunk) {
      const Index c1 = std::min(n, c0 + chunk);
      spread_.assign(static_cast<std::size_t>(chunk), 0.0);
      for (std::size_t k = 0; k < samples_count; ++k) {
        const Index* last = partitions_.end(static_cast<Index>(k)) - 1;
        if (!causal) {
          spread(k, last, c0, c1, [](double begin, double end) { return end - begin; });
        } else if (causal_transpose) {
          spread(k, last, c0, c1, [](double, double end) { return end; });
        } else {
          spread(k, last, c0, c1, [](double begin, double) { return begin; });
        }
      }
      for (Index i = c0; i < c1; ++i) {
        const auto ui = static_cast<std::size_t>(i);
        running += spread_[static_cast<std::size_t>(i - c0)];
        const double mean = running * inverse_s;
        const double value = !causal            ? mean
                             : causal_transpose ? mean - prefix_[ui]
                                                : prefix_[ui + 1] - mean;
        y[i] = static_cast<Scalar>(value);
      }
    }
  }

  // Sample k's blocks [b, e) with c0 <= b < c1 add v = value(P_b, P_e) on [b, e). They tile
  // [0, n), so the difference array gets v - v_previous at each b: one write per block (the
  // final -v at n is never read).
  template <typename Value>
  void spread(std::size_t k, const Index* last, Index c0, Index c1, Value value) const {
    const Index*& edge = cursor_[k];
    double& previous = previous_[k];
    double* difference = spread_.data() - c0;
    const double* prefix = prefix_.data();
    for (; edge != last && edge[0] < c1; ++edge) {
      const double v = value(prefix[edge[0]], prefix[edge[1]]);
      difference[edge[0]] += v - previous;
      previous = v;
    }
  }

  PartitionSet partitions_;
  Masking masking_;
  mutable std::vector<double> prefix_;
  mutable std::vector<double> spread_;
  mutable std::vector<const Index*> cursor_;
  mutable std::vector<double> previous_;
};

namespace detail {

/// E = L* - M~ for a mean-mask operator `Mask` (MeanMaskOperator, BandCountOperator): the body
/// of KernelErrorOperator and BandKernelErrorOperator. A product forms M~ x into a scratch
/// first, then L* x into y, so x and y may be the same vector.
template <typename Mask>
class AnalysisKernelMinusMask {
 public:
  Index size() const { return kernel_.size(); }
  bool symmetric() const { return kernel_.symmetric(); }
  const AlibiKernelOperator& kernel() const { return kernel_; }
  const Mask& mean_mask() const { return mask_; }

  /// y = (L* - M~) x. Throws std::invalid_argument naming 'x' or 'y' if a size differs from n.
  template <typename Scalar>
  void apply(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    analysis_require_vector_sizes(apply_name_, x.size(), y.size(), size());
    product<Scalar>(x, y, false);
  }

  /// y = (L* - M~)^T x. Throws std::invalid_argument naming 'x' or 'y' if a size differs from n.
  template <typename Scalar>
  void apply_transpose(ConstVectorRef<Scalar> x, VectorRef<Scalar> y) const {
    analysis_require_vector_sizes(transpose_name_, x.size(), y.size(), size());
    product<Scalar>(x, y, true);
  }

 protected:
  /// L* from (n, sigma, masking), then M~ from `mask_arguments` (so L*'s checks come first);
  /// the two names head the messages of apply and apply_transpose.
  template <typename... MaskArguments>
  AnalysisKernelMinusMask(const char* apply_name, const char* transpose_name, Index n, double sigma,
                          Masking masking, MaskArguments&&... mask_arguments)
      : apply_name_(apply_name),
        transpose_name_(transpose_name),
        kernel_(n, sigma, masking),
        mask_(std::forward<MaskArguments>(mask_arguments)...) {}

 private:
  template <typename Scalar>
  void product(ConstVectorRef<Scalar> x, VectorRef<Scalar> y, bool transpose) const {
    if constexpr (std::is_same_v<Scalar, double>) {
      product_double(x, y, transpose);
    } else {
      const Vector<double> x_double = x.template cast<double>();
      Vector<double> y_double(size());
      product_double(x_double, y_double, transpose);
      y = y_double.template cast<Scalar>();
    }
  }

  void product_double(ConstVectorRef<double> x, VectorRef<double> y, bool transpose) const {
    masked_.resize(size());
    if (transpose) {
      mask_.template apply_transpose<double>(x, masked_);
      kernel_.apply_transpose<double>(x, y);
    } else {
      mask_.template apply<double>(x, masked_);
      kernel_.apply<double>(x, y);
    }
    y -= masked_;
  }

  const char* apply_name_;
  const char* transpose_name_;
  AlibiKernelOperator kernel_;
  Mask mask_;
  mutable Vector<double> masked_;
};

}  // namespace detail

/// The error operator E = L* - M~ (and E^T = L*^T - M~^T) with M~ as a MeanMaskOperator: two
/// O(n + s n / sigma) products. Members size(), symmetric(), kernel(), mean_mask(), apply and
/// apply_transpose (y = E x, y = E^T x; they throw std::invalid_argument naming 'x' or 'y' if a
/// size differs from n).
class KernelErrorOperator : public detail::AnalysisKernelMinusMask<MeanMaskOperator> {
 public:
  /// `hashes`: a HashSet or any container of BinHash. Throws std::invalid_argument if the set
  /// is empty, a hash is invalid, n < 0 or sigma is not finite and > 0.
  template <typename Hashes = HashSet>
  KernelErrorOperator(const Hashes& hashes, Index n, double sigma, Masking masking)
      : AnalysisKernelMinusMask("KernelErrorOperator::apply",
                                "KernelErrorOperator::apply_transpose", n, sigma, masking, hashes,
                                n, masking) {}

  /// From stored partitions (see MeanMaskOperator). Throws std::invalid_argument naming a bad
  /// argument (partitions, sigma).
  KernelErrorOperator(PartitionSet partitions, double sigma, Masking masking)
      : AnalysisKernelMinusMask("KernelErrorOperator::apply",
                                "KernelErrorOperator::apply_transpose", partitions.n, sigma,
                                masking, std::move(partitions), masking) {}
};

}  // namespace poslsh
