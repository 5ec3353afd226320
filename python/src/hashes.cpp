// poslsh Python bindings: hash sets, ALiBi slopes, band widths and pair counts.
#include "common.hpp"
#include "poslsh/attention/banded.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/core/slopes.hpp"

namespace poslsh_python {

namespace {

/// A read-only numpy view of one double field of every hash (no copy; keeps `owner` alive).
py::array hash_field(const poslsh::HashSet& hashes, const double* first, py::handle owner) {
  py::array_t<double> view(std::vector<py::ssize_t>{static_cast<py::ssize_t>(hashes.size())},
                           std::vector<py::ssize_t>{sizeof(poslsh::BinHash)}, first, owner);
  view.attr("setflags")(py::arg("write") = false);
  return std::move(view);
}

py::array double_array(const std::vector<double>& values) {
  return py::array_t<double>(static_cast<py::ssize_t>(values.size()), values.data());
}

}  // namespace

void bind_hashes(py::module_& module) {
  py::class_<poslsh::HashSet>(module, "HashSet", R"doc(
The s positional hashes of one head: hash k puts position i in bin
floor((i - offsets[k]) / widths[k]), so two positions share a block of sample k when their bins
are equal. For rbf_hashes, P[bin(i) = bin(j)] = exp(-|i-j| / sigma).

HashSet(widths, offsets) builds a set from given values (sequences of floats of equal length
s >= 1; each width finite and >= 2^-20, each offset in [0, width)); ValueError otherwise.
)doc")
      .def(py::init([](const std::vector<double>& widths, const std::vector<double>& offsets) {
             if (widths.size() != offsets.size()) {
               throw py::value_error(
                   argument("HashSet", "offsets") + " has " + std::to_string(offsets.size()) +
                   " entries: must have as many as widths (" + std::to_string(widths.size()) + ")");
             }
             poslsh::HashSet hashes(widths.size());
             for (std::size_t k = 0; k < widths.size(); ++k) {
               hashes[k] = poslsh::BinHash{widths[k], offsets[k]};
             }
             poslsh::validate_hashes(hashes, "HashSet");
             return hashes;
           }),
           py::arg("widths"), py::arg("offsets"))
      .def("__len__", [](const poslsh::HashSet& hashes) { return hashes.size(); })
      .def(
          "__getitem__",
          [](const poslsh::HashSet& hashes, py::ssize_t index) {
            const auto size = static_cast<py::ssize_t>(hashes.size());
            if (index < 0) index += size;
            if (index < 0 || index >= size) throw py::index_error("HashSet index out of range");
            const poslsh::BinHash& hash = hashes[static_cast<std::size_t>(index)];
            return py::make_tuple(hash.width, hash.offset);
          },
          "(width, offset) of sample k")
      .def_property_readonly(
          "widths",
          [](py::object self) {
            const auto& hashes = self.cast<const poslsh::HashSet&>();
            return hash_field(hashes, &hashes.front().width, self);
          },
          "Block widths w_k, a read-only float64 view (no copy)")
      .def_property_readonly(
          "offsets",
          [](py::object self) {
            const auto& hashes = self.cast<const poslsh::HashSet&>();
            return hash_field(hashes, &hashes.front().offset, self);
          },
          "Offsets xi_k in [0, w_k), a read-only float64 view (no copy)")
      .def("__repr__", [](const poslsh::HashSet& hashes) {
        return "poslsh.HashSet(s=" + std::to_string(hashes.size()) + ")";
      });

  module.def(
      "rbf_hashes",
      [](double sigma, Index s, std::uint64_t seed, std::uint64_t stream) {
        return poslsh::rbf_hashes(sigma, s, seed, stream);
      },
      py::arg("sigma"), py::arg("s"), py::arg("seed"), py::arg("stream") = 0,
      R"doc(
Samples 0..s-1 of the RBF positional hash for length scale sigma: w ~ Gamma(2, sigma),
offset xi ~ U[0, w), bin(i) = floor((i - xi) / w), so E[M~] = L*, L*_ij = exp(-|i-j| / sigma).
Deterministic in (sigma, seed, stream, sample) (Philox4x32-10). A stream is typically a head.
ValueError if sigma is not finite and > 0 or s < 1.
)doc");

  module.def(
      "fixed_blocks_hash",
      [](double sigma) { return poslsh::HashSet{poslsh::fixed_blocks_hash(sigma)}; },
      py::arg("sigma"), R"doc(
The fixed-blocks baseline as a HashSet of one hash: width 2 sigma (= E[w]), offset 0.
)doc");

  module.def(
      "alibi_slopes", [](int heads) { return double_array(poslsh::alibi_slopes(heads)); },
      py::arg("heads"), R"doc(
ALiBi slopes m_h, h = 0..H-1 (float64 array). For H a power of two m_h = 2^(-8 (h+1) / H);
otherwise Press et al.'s interleaving with the slopes of 2p heads, p = 2^floor(log2 H).
)doc");

  module.def(
      "alibi_sigmas", [](int heads) { return double_array(poslsh::alibi_sigmas(heads)); },
      py::arg("heads"), "ALiBi length scales sigma_h = 1 / m_h (float64 array).");

  module.def("band_for_bias_error", &poslsh::band_for_bias_error, py::arg("sigma"), py::arg("eps"),
             R"doc(
Band half-width W = ceil(sigma ln(1/eps)): |i-j| > W implies exp(-|i-j| / sigma) < eps.
)doc");

  module.def(
      "lsh_fused_pair_count",
      [](py::handle hashes, Index n, bool causal) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_fused_pair_count");
        return poslsh::lsh_fused_pair_count(set, n, masking_of(causal));
      },
      py::arg("hashes"), py::arg("n"), py::kw_only(), py::arg("causal") = true, R"doc(
Number of (query, key) pairs with c_ij > 0 (causal: j <= i), c_ij = #{k : bin_k(i) = bin_k(j)}:
the pairs lsh_attention_fused evaluates. O(n s).
)doc");
}

}  // namespace poslsh_python
