// The least-squares fit of log y against log x, the decay rate of a power law y ~ x^slope (for
// instance an error against the sample count s, where the theory gives slope -1/2).
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace poslsh_examples {

/// The least-squares line log y = a + slope * log x through the points used.
struct LogLogFit {
  /// sum (u_i - mean u)(v_i - mean v) / sum (u_i - mean u)^2, u = log x, v = log y; NaN with
  /// fewer than two points (or when every x used is the same).
  double slope = std::numeric_limits<double>::quiet_NaN();
  double first = std::numeric_limits<double>::quiet_NaN();  ///< x of the first point used
  double last = std::numeric_limits<double>::quiet_NaN();   ///< x of the last point used
  std::size_t points = 0;                                   ///< number of points used
};

/// Fits the points (x_i, y_i) with x_i >= min_x (all of them by default). x and y must have the
/// same length and positive entries.
inline LogLogFit log_log_fit(const std::vector<double>& x, const std::vector<double>& y,
                             double min_x = 0.0) {
  LogLogFit fit;
  double mean_u = 0.0, mean_v = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (x[i] < min_x) continue;
    if (fit.points == 0) fit.first = x[i];
    fit.last = x[i];
    ++fit.points;
    mean_u += std::log(x[i]);
    mean_v += std::log(y[i]);
  }
  if (fit.points < 2) return fit;
  mean_u /= static_cast<double>(fit.points);
  mean_v /= static_cast<double>(fit.points);
  double covariance = 0.0, variance = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (x[i] < min_x) continue;
    const double u = std::log(x[i]) - mean_u;
    covariance += u * (std::log(y[i]) - mean_v);
    variance += u * u;
  }
  fit.slope = variance > 0.0 ? covariance / variance : std::numeric_limits<double>::quiet_NaN();
  return fit;
}

/// The slope of log_log_fit(x, y, min_x).
inline double log_log_slope(const std::vector<double>& x, const std::vector<double>& y,
                            double min_x = 0.0) {
  return log_log_fit(x, y, min_x).slope;
}

}  // namespace poslsh_examples
