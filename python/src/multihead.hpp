// poslsh Python bindings: the keyword arguments shared by the all-heads functions
// (multihead.cpp, training.cpp), with the library's names and defaults.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "poslsh/multihead/methods.hpp"

namespace poslsh_python {

/// The keywords every all-heads function takes: the layout, and MultiHeadOptions with method
/// and masking by their names in the library's tables (ValueError listing the names otherwise).
/// options.precision keeps its default; the functions with a `precision` keyword set it.
struct HeadsKeywords {
  Layout layout;
  poslsh::MultiHeadOptions options;
};

inline HeadsKeywords heads_keywords(const char* function, const std::string& layout,
                                    const std::string& method, const std::string& masking,
                                    std::optional<double> scale,
                                    const std::optional<std::vector<double>>& sigmas, Index samples,
                                    std::uint64_t seed, double band_error,
                                    const std::pair<Index, Index>& window) {
  poslsh::MultiHeadOptions options;
  options.method = poslsh::enum_from_name<poslsh::Method>(method, function, "method");
  options.masking = poslsh::enum_from_name<poslsh::Masking>(masking, function, "masking");
  options.scale = scale;
  if (sigmas) options.sigmas = *sigmas;
  options.samples = samples;
  options.seed = seed;
  options.band_error = band_error;
  // The library checks the window (options.window_left, window_right), as every other option.
  options.window_left = window.first;
  options.window_right = window.second;
  return {layout_of(layout, function), options};
}

/// The keywords of heads_keywords with MultiHeadOptions' defaults, after `layout`:
/// layout="nhd", method, masking, scale=None, sigmas=None, samples, seed, band_error,
/// window=(-1, -1) (FlashAttention's window_size: left, right).
inline auto multihead_keywords() {
  const poslsh::MultiHeadOptions defaults;
  return std::make_tuple(
      py::arg("layout") = "nhd", py::arg("method") = poslsh::enum_name(defaults.method),
      py::arg("masking") = poslsh::enum_name(defaults.masking), py::arg("scale") = py::none(),
      py::arg("sigmas") = py::none(), py::arg("samples") = defaults.samples,
      py::arg("seed") = defaults.seed, py::arg("band_error") = defaults.band_error,
      py::arg("window") = std::make_pair(defaults.window_left, defaults.window_right));
}

/// module.def(name, function, positional..., kw_only, the multihead_keywords, trailing...,
/// doc): `positional` and `trailing` are tuples of py::arg.
template <typename Function, typename Positional, typename Trailing>
void def_multihead(py::module_& module, const char* name, Function&& function,
                   const Positional& positional, const Trailing& trailing, const char* doc) {
  std::apply(
      [&](const auto&... arguments) {
        module.def(name, std::forward<Function>(function), arguments..., doc);
      },
      std::tuple_cat(positional, std::make_tuple(py::kw_only()), multihead_keywords(), trailing));
}

}  // namespace poslsh_python
