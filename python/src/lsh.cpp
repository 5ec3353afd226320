// poslsh Python bindings: hash sets, the RBF and fixed-blocks hashes, the variance-reduced
// samplers and the pair counts of the fused kernel.
#include "common.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/lsh/samplers.hpp"

namespace poslsh_python {

namespace {

/// A read-only numpy view of one double field of every hash (no copy; keeps `owner` alive).
py::array hash_field(const poslsh::HashSet& hashes, const double* first, py::handle owner) {
  py::array_t<double> view(std::vector<py::ssize_t>{static_cast<py::ssize_t>(hashes.size())},
                           std::vector<py::ssize_t>{sizeof(poslsh::BinHash)}, first, owner);
  view.attr("setflags")(py::arg("write") = false);
  return std::move(view);
}

const char* const sample_hashes_doc = R"doc(
Hash set of s samples for length scale sigma under a variance-reduced sampler, keyed by
(seed, stream) like rbf_hashes. Every sample has rbf_hash's law (w ~ Gamma(2, sigma),
xi | w ~ U[0, w)), so P[bin_k(i) = bin_k(j)] = exp(-|i-j| / sigma) and E[M~] = L* for every
sampler; they differ in how the s samples are coupled (negative covariances lower Var M~_ij).
With F(x) = 1 - (1 + x) e^{-x} (the Gamma(2, 1) distribution function):
  independent         rbf_hashes(sigma, s, seed, stream), bit for bit;
  antithetic          widths in pairs sigma F^-1(u), sigma F^-1(1 - u);
  stratified          w_k = sigma F^-1((pi(k) + V_k) / s): one width per stratum of u;
  lattice_offsets     groups of `group` samples share w; offsets w frac(U + j / group);
  coupled_offsets     independent widths; offsets w_k frac(U + pi(k) / s), one shared U;
  rqmc                randomly shifted rank-1 lattice over (u_w, u_xi), w = sigma F^-1(u_w);
  stratified_lattice  ceil(s / g) groups (g = lattice_group, 0: round(sqrt(s))) with
                      stratified widths and lattice offsets.
"poisson" has no hash form (ValueError). Returns a HashSet (for every kernel taking hashes).
ValueError if sigma is not finite and > 0, s < 1, group < 1, lattice_group < 0 or the sampler
is unknown.
)doc";

}  // namespace

void register_lsh(py::module_& module) {
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
      [](double sigma, Index samples, std::uint64_t seed, std::uint64_t stream) {
        return poslsh::rbf_hashes(sigma, samples, seed, stream);
      },
      py::arg("sigma"), py::arg("samples"), py::arg("seed"), py::arg("stream") = 0,
      R"doc(
Samples 0 .. samples - 1 of the RBF positional hash for length scale sigma: w ~ Gamma(2, sigma),
offset xi ~ U[0, w), bin(i) = floor((i - xi) / w), so E[M~] = L*, L*_ij = exp(-|i-j| / sigma).
Deterministic in (sigma, seed, stream, sample) (Philox4x32-10). A stream is typically a head.
ValueError if sigma is not finite and > 0 or samples < 1.
)doc");

  module.def(
      "fixed_blocks_hash",
      [](double sigma) { return poslsh::HashSet{poslsh::fixed_blocks_hash(sigma)}; },
      py::arg("sigma"), R"doc(
The fixed-blocks baseline as a HashSet of one hash: width 2 sigma (= E[w]), offset 0.
)doc");

  module.def(
      "lsh_fused_pair_count",
      [](py::handle hashes, Index n, const std::string& masking) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_fused_pair_count");
        return poslsh::lsh_fused_pair_count(set, n, masking_of(masking, "lsh_fused_pair_count"));
      },
      py::arg("hashes"), py::arg("n"), py::kw_only(), py::arg("masking") = default_masking(), R"doc(
Number of (query, key) pairs with c_ij > 0 (causal: j <= i), c_ij = #{k : bin_k(i) = bin_k(j)}:
the pairs lsh_attention_fused evaluates. O(n s).
)doc");

  const poslsh::SamplerOptions defaults;
  module.def(
      "sampler_names", []() { return enum_names<poslsh::Sampler>(); },
      "Names of the hash samplers in declaration order (sample_hashes takes all but 'poisson').");

  module.def(
      "sample_hashes",
      [](double sigma, Index samples, std::uint64_t seed, std::uint64_t stream,
         const std::string& name, Index group, Index lattice_group) {
        const auto sampler =
            poslsh::enum_from_name<poslsh::Sampler>(name, "sample_hashes", "sampler");
        poslsh::SamplerOptions options;
        options.group = group;
        options.lattice_group = lattice_group;
        return poslsh::sample_hashes(sigma, samples, seed, stream, sampler, options);
      },
      py::arg("sigma"), py::arg("samples"), py::arg("seed"), py::arg("stream") = 0,
      py::arg("sampler") = poslsh::enum_name(poslsh::Sampler::independent), py::kw_only(),
      py::arg("group") = defaults.group, py::arg("lattice_group") = defaults.lattice_group,
      sample_hashes_doc);

  module.def(
      "lattice_group_starts",
      [](Index samples, Index lattice_group) {
        poslsh::SamplerOptions options;
        options.lattice_group = lattice_group;
        return poslsh::lattice_group_starts(samples, options);
      },
      py::arg("samples"), py::arg("lattice_group") = defaults.lattice_group, R"doc(
Start indices (0, ..., s) of the G = ceil(s / g) groups of the stratified_lattice sampler
(g = lattice_group, 0: round(sqrt(s)), at least 1): the first s mod G groups hold ceil(s / G)
samples, the others floor(s / G).
)doc");
}

}  // namespace poslsh_python
