// poslsh internals: argument checks that throw std::invalid_argument naming the argument.
#pragma once

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace poslsh::detail {

/// Throws std::invalid_argument("poslsh: <function>: argument '<name>' = <value>: <rule>").
template <typename Value>
[[noreturn]] void throw_invalid(const char* function, const char* name, const Value& value,
                                std::string_view rule) {
  std::ostringstream message;
  message.precision(17);
  message << "poslsh: " << function << ": argument '" << name << "' = " << value << ": " << rule;
  throw std::invalid_argument(message.str());
}

/// x, or x() when x is a callable: a value or rule computed only when a check fails.
template <typename T>
decltype(auto) when_failing(const T& x) {
  if constexpr (std::is_invocable_v<const T&>)
    return x();
  else
    return (x);
}

/// Throws when `condition` is false. `value` and `rule` may be callables (returning what to
/// print, e.g. a rule with numbers in it): they run only then, so a passing check allocates
/// nothing.
template <typename Value, typename Rule>
void require(bool condition, const char* function, const char* name, const Value& value,
             const Rule& rule) {
  if (!condition) throw_invalid(function, name, when_failing(value), when_failing(rule));
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

/// An index among `count` things named `count_name` (ranks, heads): must lie in [0, count).
template <typename Int, typename Count>
void require_index(const char* function, const char* name, Int index, const char* count_name,
                   Count count) {
  require(index >= 0 && static_cast<long long>(index) < static_cast<long long>(count), function,
          name, index, [&] {
            return "must be in [0, " + std::string(count_name) + ") = [0, " +
                   std::to_string(count) + ")";
          });
}

/// Positive count such as s or the number of heads.
template <typename Int>
void require_positive(Int value, const char* function, const char* name) {
  require(value >= 1, function, name, value, "must be >= 1");
}

}  // namespace poslsh::detail
