// poslsh: the paper's metric set in one call: kernel errors of M~ against L* with the paper's
// bounds, and attention output errors. Part of the analysis module (poslsh/analysis.hpp): needs
// Spectra through analysis/spectral_error.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "poslsh/analysis/band_counts.hpp"
#include "poslsh/analysis/max_error.hpp"
#include "poslsh/analysis/spectral_error.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/detail/analysis/output.hpp"
#include "poslsh/detail/analysis/partitions.hpp"
#include "poslsh/detail/checks/attention.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

namespace detail {
inline constexpr double analysis_infinity = std::numeric_limits<double>::infinity();
}  // namespace detail

/// Psi = 1 + sigma + (e^{1/sigma} + 1) / (e^{1/sigma} - 1) = 1 + sigma + coth(1 / (2 sigma)),
/// the constant of the paper's bounds. Throws std::invalid_argument on a bad sigma.
inline double bound_constant(double sigma) {
  detail::require_sigma(sigma, "bound_constant");
  return 1.0 + sigma + 1.0 / std::tanh(0.5 / sigma);
}

/// The paper's expectation bound E||L* - M~||_2 <= Psi (sqrt(ln n / s) + ln n / s).
/// Throws std::invalid_argument if n < 1, s < 1 or sigma is bad.
inline double expectation_bound(Index n, double sigma, Index samples) {
  detail::require_positive(n, "expectation_bound", "n");
  detail::require_positive(samples, "expectation_bound", "samples");
  const double ratio = std::log(static_cast<double>(n)) / static_cast<double>(samples);
  return bound_constant(sigma) * (std::sqrt(ratio) + ratio);
}

/// The paper's tail bound P[||L* - M~||_2 >= epsilon] <= n exp(-s eps^2 / (4 Psi (4 Psi + eps))).
/// Throws std::invalid_argument if n < 1, s < 1, sigma is bad or epsilon is not finite and > 0.
inline double tail_bound(Index n, double sigma, Index samples, double epsilon) {
  detail::require_positive(n, "tail_bound", "n");
  detail::require_positive(samples, "tail_bound", "samples");
  detail::require(std::isfinite(epsilon) && epsilon > 0.0, "tail_bound", "epsilon", epsilon,
                  "must be finite and > 0");
  const double psi = bound_constant(sigma);
  return static_cast<double>(n) * std::exp(-static_cast<double>(samples) * epsilon * epsilon /
                                           (4.0 * psi * (4.0 * psi + epsilon)));
}

/// The paper's sample count s_good = ceil(sigma^2 ln n / epsilon^2) (a double: it can exceed
/// any integer type). Throws std::invalid_argument if n < 1, sigma is bad or epsilon is not
/// finite and > 0.
inline double good_sample_count(Index n, double sigma, double epsilon) {
  detail::require_positive(n, "good_sample_count", "n");
  detail::require_sigma(sigma, "good_sample_count");
  detail::require(std::isfinite(epsilon) && epsilon > 0.0, "good_sample_count", "epsilon", epsilon,
                  "must be finite and > 0");
  return std::ceil(sigma * sigma * std::log(static_cast<double>(n)) / (epsilon * epsilon));
}

/// Which observed error kernel_error_metrics takes as the epsilon of s_good and of the tail
/// bound when MetricOptions::epsilon is unset (E = L* - M~):
///   absolute  eps = ||E||_2, as the paper's validation code sets it (epsilon = ||L' - L||_2);
///             s_good = ceil(sigma^2 ln n / ||E||_2^2),
///             tail = n exp(-s ||E||_2^2 / (4 Psi (4 Psi + ||E||_2)));
///   relative  eps = ||E||_2 / ||L*||_2, the error as a fraction of the kernel's norm;
///             s_good = ceil(sigma^2 ln n ||L*||_2^2 / ||E||_2^2), the tail bound likewise.
/// As n grows ||L*||_2 tends to (1 + r) / (1 - r), about 2 sigma, when bidirectional and to
/// 1 / (1 - r), about sigma, when causal (r = e^{-1/sigma}), so the relative s_good is about
/// 4 sigma^2 (causal: sigma^2) times the absolute one.
enum class EpsilonDefinition { absolute, relative };

/// The names "absolute" and "relative" (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(EpsilonDefinition, absolute, relative);

/// Options of the metric functions.
struct MetricOptions {
  /// The epsilon of s_good and of the tail bound; unset means the observed spectral error
  /// chosen by epsilon_definition.
  std::optional<double> epsilon{};
  /// The observed epsilon used when `epsilon` is unset (default: absolute, ||L* - M~||_2).
  EpsilonDefinition epsilon_definition = EpsilonDefinition::absolute;
  /// How ||L* - M~||_2 is computed (dense at small n, Lanczos otherwise).
  SpectralOptions spectral{};
  /// How M~ is represented for the Lanczos products and the max-norm scan
  /// (analysis/band_counts.hpp): automatic takes the cheaper by choose_mask_representation
  /// (block sums for small s, the union-band counts when s n / sigma dwarfs n times the band).
  /// Both give the same values to rounding (the max-norm error bit for bit).
  MaskRepresentation representation = MaskRepresentation::automatic;
  /// paper_metrics computes the unnormalized output errors, O(n^2 d) time, only when
  /// n <= dense_limit; above it they are left unset.
  Index dense_limit = 8192;
};

/// Errors of M~ = (1/s) sum_k M(h_k) against the ALiBi kernel L*, with the paper's bounds.
struct KernelErrorMetrics {
  double spectral = 0.0;           ///< ||L* - M~||_2
  double max = 0.0;                ///< ||L* - M~||_max
  double kernel_norm = 0.0;        ///< ||L*||_2
  double relative_spectral = 0.0;  ///< ||L* - M~||_2 / ||L*||_2
  /// The epsilon used below: options.epsilon if set, else `spectral` (absolute, the default)
  /// or `relative_spectral` (EpsilonDefinition::relative).
  double epsilon = 0.0;
  double good_samples = 0.0;        ///< s_good = ceil(sigma^2 ln n / epsilon^2)
  double expectation_bound = 0.0;   ///< Psi (sqrt(ln n / s) + ln n / s)
  double tail_bound = 0.0;          ///< n exp(-s eps^2 / (4 Psi (4 Psi + eps)))
  SpectralNorm spectral_details{};  ///< method, convergence and cost of `spectral`
};

/// Attention output errors between the exact T* and an approximation T~ (n x d_v each).
struct OutputErrorMetrics {
  double frobenius = 0.0;  ///< ||T* - T~||_F
  /// ||T* - T~||_F / ||T*||_F (0 if both are 0, +inf if only T* is).
  double relative_frobenius = 0.0;
  /// Row-wise relative differences r_i = ||t*_i - t~_i||_2 / ||t*_i||_2 over the rows with
  /// ||t*_i||_2 > 0 (a zero exact row has no relative error and is only counted in zero_rows):
  /// median, 90th and 99th percentiles, linear between order statistics (position p (m - 1) of
  /// the m sorted values, as numpy's default). NaN when every exact row is 0.
  double row_relative_median = 0.0;
  double row_relative_p90 = 0.0;
  double row_relative_p99 = 0.0;
  /// Rows with ||t*_i||_2 = 0, left out of the row-wise statistics.
  Index zero_rows = 0;
  /// <T*, T~> / (||T*||_F ||T~||_F) of the flattened outputs (1 if both are 0, 0 if one is).
  double cosine = 1.0;
};

/// The unnormalized error (A o L*) V - (A o M~) V = (A o E) V, A_ij = exp(tau q_i . k_j).
struct UnnormalizedOutputError {
  double frobenius = 0.0;  ///< ||(A o L*) V - (A o M~) V||_F
  double max = 0.0;        ///< its largest |entry|
};

/// Everything of the paper in one record.
struct PaperMetrics {
  KernelErrorMetrics kernel{};
  /// Unset when n > MetricOptions::dense_limit (its cost is O(n^2 d)).
  std::optional<UnnormalizedOutputError> unnormalized{};
  OutputErrorMetrics output{};
};

namespace detail {

/// kernel_error_metrics and partition_error_metrics: the spectral and max-norm errors of the
/// stored partitions in the representation chosen by options.representation, then the norm
/// and the bounds. `hashes` (may be null) gives the dense spectral path its dense formula.
/// (A template only so that its Lanczos and eigen-solver code is compiled where it is called.)
template <typename Partitions = PartitionSet>
KernelErrorMetrics analysis_error_metrics(const Partitions& set, double sigma, Masking masking,
                                          const MetricOptions& options, const HashSet* hashes,
                                          const char* function) {
  const Index n = set.n;
  require_positive(n, function, "n");
  require_sigma(sigma, function);
  analysis_require_spectral_options(options.spectral, function);
  if (options.epsilon) {
    require(std::isfinite(*options.epsilon) && *options.epsilon > 0.0, function, "options.epsilon",
            *options.epsilon, "must be finite and > 0");
  }
  KernelErrorMetrics metrics;
  const bool dense =
      options.spectral.method == SpectralMethod::dense ||
      (options.spectral.method == SpectralMethod::automatic && n <= options.spectral.dense_limit);
  const MaskRepresentation representation = options.representation == MaskRepresentation::automatic
                                                ? choose_mask_representation(set)
                                                : options.representation;
  if (representation == MaskRepresentation::band_counts) {
    const BandKernelErrorOperator error(set, sigma, masking);
    metrics.spectral_details = hashes != nullptr && dense
                                   ? spectral_error(*hashes, n, sigma, masking, options.spectral)
                                   : operator_spectral_norm(error, options.spectral);
    metrics.max = error.mean_mask().max_error(sigma).value;
  } else {
    if (hashes != nullptr) {
      metrics.spectral_details = spectral_error(*hashes, n, sigma, masking, options.spectral);
      metrics.max = max_error(*hashes, n, sigma, masking).value;
    } else {
      const KernelErrorOperator error(set, sigma, masking);
      metrics.spectral_details = operator_spectral_norm(error, options.spectral);
      metrics.max = analysis_max_error_partitions(set, sigma, masking).value;
    }
  }
  metrics.spectral = metrics.spectral_details.value;
  metrics.kernel_norm = alibi_kernel_norm(n, sigma, masking);
  metrics.relative_spectral = metrics.spectral / metrics.kernel_norm;
  const double observed = options.epsilon_definition == EpsilonDefinition::relative
                              ? metrics.relative_spectral
                              : metrics.spectral;
  metrics.epsilon = options.epsilon.value_or(observed);
  const Index s = set.samples();
  metrics.expectation_bound = expectation_bound(n, sigma, s);
  const bool usable = metrics.epsilon > 0.0;  // an exact M~ (epsilon 0) has no finite s_good
  metrics.good_samples = usable ? good_sample_count(n, sigma, metrics.epsilon) : analysis_infinity;
  metrics.tail_bound = usable ? tail_bound(n, sigma, s, metrics.epsilon) : static_cast<double>(n);
  return metrics;
}

}  // namespace detail

/// Kernel errors and bounds of the hash set (a HashSet or any container of BinHash):
/// spectral_error, max_error, alibi_kernel_norm, expectation_bound, and good_sample_count and
/// tail_bound at epsilon = options.epsilon if set, else at the observed error chosen by
/// options.epsilon_definition (default ||L* - M~||_2; see EpsilonDefinition). An exact M~
/// (epsilon 0) gives s_good = +inf and the tail bound n. The Lanczos products and the max-norm
/// scan use M~ as options.representation says (automatic: block sums or the union-band counts,
/// whichever choose_mask_representation predicts cheaper; both use OpenMP and give results
/// that do not depend on the thread count). Throws std::invalid_argument naming a bad argument
/// (empty or invalid hashes, n < 1, sigma, options).
template <typename Hashes = HashSet>
KernelErrorMetrics kernel_error_metrics(const Hashes& hash_set, Index n, double sigma,
                                        Masking masking, const MetricOptions& options = {}) {
  constexpr const char* function = "kernel_error_metrics";
  const HashSet& hashes = detail::analysis_hash_set(hash_set);
  detail::require_positive(n, function, "n");
  const PartitionSet set = detail::analysis_partitions(hashes, n, function);
  return detail::analysis_error_metrics(set, sigma, masking, options, &hashes, function);
}

/// kernel_error_metrics of stored partitions (a PartitionSet, e.g. from sample_partition_set,
/// whose Poisson cuts have no BinHash form): the same errors, norm and bounds, s = the number
/// of partitions. Dense spectral norms (n <= options.spectral.dense_limit) are formed from the
/// operator's columns. Throws std::invalid_argument naming a bad argument (partitions, n < 1,
/// sigma, options).
template <typename Partitions = PartitionSet>
KernelErrorMetrics partition_error_metrics(const Partitions& partitions, double sigma,
                                           Masking masking, const MetricOptions& options = {}) {
  validate_partition_set(partitions, "partition_error_metrics");
  return detail::analysis_error_metrics(partitions, sigma, masking, options, nullptr,
                                        "partition_error_metrics");
}

/// Output errors of an approximation T~ against the exact T* (see OutputErrorMetrics, also for
/// zero rows), in double. Throws std::invalid_argument naming 'exact' (no rows) or 'approximate'
/// (shape). O(n (d_v + log n)) time.
template <typename Scalar>
OutputErrorMetrics output_error_metrics(ConstMatrixRef<Scalar> exact,
                                        ConstMatrixRef<Scalar> approximate) {
  constexpr const char* function = "output_error_metrics";
  detail::require(exact.rows() >= 1, function, "exact", exact.rows(), "must have at least one row");
  detail::require(
      approximate.rows() == exact.rows() && approximate.cols() == exact.cols(), function,
      "approximate",
      [&] { return std::to_string(approximate.rows()) + "x" + std::to_string(approximate.cols()); },
      [&] {
        return "shape must equal exact's " + std::to_string(exact.rows()) + "x" +
               std::to_string(exact.cols());
      });
  const RowMatrix<double> t_exact = exact.template cast<double>();
  const RowMatrix<double> t_approximate = approximate.template cast<double>();
  const RowMatrix<double> difference = t_exact - t_approximate;
  OutputErrorMetrics metrics;
  const double exact_norm = t_exact.norm();
  const double approximate_norm = t_approximate.norm();
  metrics.frobenius = difference.norm();
  metrics.relative_frobenius = exact_norm > 0.0
                                   ? metrics.frobenius / exact_norm
                                   : (metrics.frobenius > 0.0 ? detail::analysis_infinity : 0.0);
  std::vector<double> rows;
  rows.reserve(static_cast<std::size_t>(exact.rows()));
  for (Index i = 0; i < exact.rows(); ++i) {
    const double denominator = t_exact.row(i).norm();
    if (denominator > 0.0) {
      rows.push_back(difference.row(i).norm() / denominator);
    } else {
      ++metrics.zero_rows;
    }
  }
  if (rows.empty()) {
    metrics.row_relative_median = metrics.row_relative_p90 = metrics.row_relative_p99 =
        std::numeric_limits<double>::quiet_NaN();
  } else {
    std::sort(rows.begin(), rows.end());
    metrics.row_relative_median = detail::analysis_percentile(rows, 0.5);
    metrics.row_relative_p90 = detail::analysis_percentile(rows, 0.9);
    metrics.row_relative_p99 = detail::analysis_percentile(rows, 0.99);
  }
  if (exact_norm > 0.0 && approximate_norm > 0.0) {
    metrics.cosine = t_exact.cwiseProduct(t_approximate).sum() / (exact_norm * approximate_norm);
  } else {
    metrics.cosine = exact_norm == approximate_norm ? 1.0 : 0.0;
  }
  return metrics;
}

/// The unnormalized output error ||(A o L*) V - (A o M~) V|| (Frobenius and max), formed as
/// (A o E) V row by row in double, E = L* - M~. A is not normalised, so large scores overflow
/// to inf as they would in the paper's code. `hashes`: a HashSet or any container of BinHash.
/// Throws std::invalid_argument naming a bad argument (shapes, hashes, sigma, scale).
/// Dense: O(n^2 (d + d_v)) time (meant for n up to a few thousand, as in the paper),
/// O(n (d + d_v) + n s / sigma) memory, rows in parallel (OpenMP).
template <typename Scalar, typename Hashes = HashSet>
UnnormalizedOutputError unnormalized_output_error_dense(ConstMatrixRef<Scalar> q,
                                                        ConstMatrixRef<Scalar> k,
                                                        ConstMatrixRef<Scalar> v,
                                                        const Hashes& hashes, double sigma,
                                                        const AttentionOptions& options = {}) {
  constexpr const char* function = "unnormalized_output_error_dense";
  detail::require_qkv_shapes(function, q, k, v);
  detail::require_self_attention(function, q, k);
  detail::require_sigma(sigma, function);
  const PartitionSet partitions = detail::analysis_partitions(hashes, q.rows(), function);
  const double tau = detail::resolve_scale(function, options, q.cols());
  const Index n = q.rows();
  if (n == 0) return {};
  const std::vector<double> kernel =
      detail::analysis_kernel_table(static_cast<std::size_t>(n), sigma);
  const RowMatrix<double> q_double = q.template cast<double>();
  const RowMatrix<double> k_double = k.template cast<double>();
  const RowMatrix<double> v_double = v.template cast<double>();
  constexpr Index rows_per_task = 64;
  const Index tasks = (n + rows_per_task - 1) / rows_per_task;
  std::vector<detail::AnalysisErrorSums> sums(static_cast<std::size_t>(tasks));
  const bool causal = options.masking == Masking::causal;
  detail::parallel_loop(static_cast<long>(tasks), detail::LoopSchedule::dynamic(), true,
                        [&](long task) {
                          const Index first = static_cast<Index>(task) * rows_per_task;
                          sums[static_cast<std::size_t>(task)] = detail::analysis_unnormalized_rows(
                              q_double, k_double, v_double, tau, causal, partitions, kernel, first,
                              std::min(n, first + rows_per_task));
                        });
  UnnormalizedOutputError error;
  double square_sum = 0.0;
  for (const detail::AnalysisErrorSums& part : sums) {
    square_sum += part.square_sum;
    error.max = std::max(error.max, part.max);
  }
  error.frobenius = std::sqrt(square_sum);
  return error;
}

/// The paper's full metric set in one call, for one head: kernel_error_metrics (n = q.rows(),
/// masking from `attention`), unnormalized_output_error_dense when n <= options.dense_limit,
/// and output_error_metrics(exact, approximate) of the given outputs T* and T~ (e.g. from
/// alibi_attention_reference and an LSH kernel run with the same hashes). Throws
/// std::invalid_argument naming a bad argument.
template <typename Scalar, typename Hashes = HashSet>
PaperMetrics paper_metrics(ConstMatrixRef<Scalar> q, ConstMatrixRef<Scalar> k,
                           ConstMatrixRef<Scalar> v, const Hashes& hashes, double sigma,
                           ConstMatrixRef<Scalar> exact, ConstMatrixRef<Scalar> approximate,
                           const AttentionOptions& attention = {},
                           const MetricOptions& options = {}) {
  constexpr const char* function = "paper_metrics";
  detail::require_qkv_shapes(function, q, k, v);
  detail::require(
      exact.rows() == q.rows() && exact.cols() == v.cols(), function, "exact",
      [&] { return std::to_string(exact.rows()) + "x" + std::to_string(exact.cols()); },
      [&] {
        return "shape must be q.rows() x v.cols() = " + std::to_string(q.rows()) + "x" +
               std::to_string(v.cols());
      });
  detail::require_self_attention(function, q, k);
  detail::require(options.dense_limit >= 0, function, "options.dense_limit", options.dense_limit,
                  "must be >= 0");
  PaperMetrics metrics;
  metrics.output = output_error_metrics<Scalar>(exact, approximate);
  if (q.rows() <= options.dense_limit) {
    metrics.unnormalized =
        unnormalized_output_error_dense<Scalar, Hashes>(q, k, v, hashes, sigma, attention);
  }
  metrics.kernel = kernel_error_metrics(hashes, q.rows(), sigma, attention.masking, options);
  return metrics;
}

}  // namespace poslsh
