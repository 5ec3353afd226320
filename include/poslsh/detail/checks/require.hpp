// poslsh internals: argument checks that throw std::invalid_argument naming the argument.
#pragma once

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

namespace poslsh::detail {

/// Throws std::invalid_argument("poslsh: <function>: argument '<name>' = <value>: <rule>").
template <typename Value>
[[noreturn]] void throw_invalid(const char* function, const char* name, const Value& value,
                                const std::string& rule) {
  std::ostringstream message;
  message.precision(17);
  message << "poslsh: " << function << ": argument '" << name << "' = " << value << ": " << rule;
  throw std::invalid_argument(message.str());
}

/// Throws when `condition` is false.
template <typename Value>
void require(bool condition, const char* function, const char* name, const Value& value,
             const std::string& rule) {
  if (!condition) throw_invalid(function, name, value, rule);
}

/// sigma must be a finite positive length scale.
inline void require_sigma(double sigma, const char* function, const char* name = "sigma") {
  require(std::isfinite(sigma) && sigma > 0.0, function, name, sigma, "must be finite and > 0");
}

/// Non-negative size such as n.
template <typename Int>
void require_size(Int value, const char* function, const char* name) {
  require(value >= 0, function, name, value, "must be >= 0");
}

/// Positive count such as s or the number of heads.
template <typename Int>
void require_positive(Int value, const char* function, const char* name) {
  require(value >= 1, function, name, value, "must be >= 1");
}

}  // namespace poslsh::detail
