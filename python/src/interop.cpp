// poslsh Python bindings: block plans (cu_seqlens) and the log-sum-exp merger, for running the
// LSH estimator around another attention kernel.
#include <variant>

#include "arrays.hpp"
#include "poslsh/interop/block_plan.hpp"
#include "poslsh/interop/lse_merge.hpp"

namespace poslsh_python {

namespace {

using AnyMerger = std::variant<poslsh::LseMerger<float>, poslsh::LseMerger<double>>;

/// The scalar type of an LseMerger.
template <typename Merger>
struct MergerScalar;
template <typename T>
struct MergerScalar<poslsh::LseMerger<T>> {
  using type = T;
};
template <typename Merger>
using merger_scalar_t = typename MergerScalar<std::decay_t<Merger>>::type;

/// LseMerger of either scalar type, fixed at construction by a numpy dtype.
class Merger {
 public:
  Merger(Index n, Index value_cols, const py::object& dtype)
      : merger_(make(n, value_cols, py::dtype::from_args(dtype))), rows_(n), cols_(value_cols) {}

  /// Adds one sample; the GIL is kept: the merger is mutable state shared by the Python
  /// threads that see it.
  void add(py::handle output, py::handle lse) {
    std::visit(
        [&](auto& merger) {
          using T = merger_scalar_t<decltype(merger)>;
          constexpr const char* function = "LseMerger.add";
          const InputMap<T> output_map = input_matrix<T>(output, function, "output", "the merger");
          const py::array lse_array = storage_array<T>(lse, function, "lse", "the merger");
          if (lse_array.ndim() != 1) {
            throw py::value_error(argument(function, "lse") + " has " +
                                  std::to_string(lse_array.ndim()) +
                                  " dimensions: must be 1-D (n)");
          }
          if (lse_array.shape(0) > 1 &&
              lse_array.strides(0) != static_cast<py::ssize_t>(sizeof(T))) {
            throw py::value_error(argument(function, "lse") + " must be contiguous");
          }
          merger.add(output_map, Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>(
                                     static_cast<const T*>(lse_array.data()),
                                     static_cast<Index>(lse_array.shape(0))));
        },
        merger_);
  }

  py::object result(py::handle out) const {
    return std::visit(
        [&](const auto& merger) {
          using T = merger_scalar_t<decltype(merger)>;
          auto output =
              output_matrix<T>(out, rows_, cols_, "LseMerger.result", "out", "the merger", {});
          merger.result(output.map);
          return output.result;
        },
        merger_);
  }

  py::array lse() const {
    return std::visit(
        [](const auto& merger) -> py::array {
          using T = merger_scalar_t<decltype(merger)>;
          const auto values = merger.lse();
          return py::array_t<T>(static_cast<py::ssize_t>(values.size()), values.data());
        },
        merger_);
  }

  Index samples() const {
    return std::visit([](const auto& merger) { return merger.samples(); }, merger_);
  }
  py::dtype dtype() const {
    return std::holds_alternative<poslsh::LseMerger<float>>(merger_) ? py::dtype::of<float>()
                                                                     : py::dtype::of<double>();
  }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }

 private:
  static AnyMerger make(Index n, Index value_cols, const py::dtype& dtype) {
    if (dtype.equal(py::dtype::of<float>())) return poslsh::LseMerger<float>(n, value_cols);
    if (dtype.equal(py::dtype::of<double>())) return poslsh::LseMerger<double>(n, value_cols);
    throw py::type_error(argument("LseMerger", "dtype") + " = " +
                         py::str(py::object(dtype)).cast<std::string>() +
                         ": must be float32 or float64");
  }

  AnyMerger merger_;
  Index rows_ = 0;
  Index cols_ = 0;
};

std::vector<Index> lengths_of(py::handle lengths) {
  if (py::isinstance<py::int_>(lengths)) return {lengths.cast<Index>()};
  return lengths.cast<std::vector<Index>>();
}

}  // namespace

void register_interop(py::module_& module) {
  py::class_<poslsh::BlockPlan>(module, "BlockPlan", R"doc(
The blocks of one hash as a variable-length batch: block r is positions
[cu_seqlens[r], cu_seqlens[r+1]) of the concatenated sequences; max_seqlen is the longest block.
Pass cu_seqlens as cu_seqlens_q and cu_seqlens_k of a variable-length attention kernel.
)doc")
      .def_property_readonly(
          "cu_seqlens",
          [](const poslsh::BlockPlan& plan) {
            return py::array_t<std::int32_t>(static_cast<py::ssize_t>(plan.cu_seqlens.size()),
                                             plan.cu_seqlens.data());
          },
          "Cumulative block offsets, int32 numpy array from 0 to the total length (a copy)")
      .def_readonly("max_seqlen", &poslsh::BlockPlan::max_seqlen, "Longest block")
      .def_property_readonly("blocks", &poslsh::BlockPlan::blocks, "Number of blocks")
      .def("__repr__", [](const poslsh::BlockPlan& plan) {
        return "poslsh.BlockPlan(blocks=" + std::to_string(plan.blocks()) +
               ", max_seqlen=" + std::to_string(plan.max_seqlen) + ")";
      });

  module.def(
      "block_plans",
      [](py::handle hashes, py::handle sequence_lengths) {
        const poslsh::HashSet& set = hash_set(hashes, "block_plans");
        return poslsh::block_plans(set, lengths_of(sequence_lengths));
      },
      py::arg("hashes"), py::arg("sequence_lengths"), R"doc(
One BlockPlan per sample: the blocks of hash k on the sequences of the given lengths (an int n
or a list of lengths, concatenated; each sequence is cut on its own positions 0..length-1, so no
block crosses two sequences).
)doc");

  py::class_<Merger>(module, "LseMerger", R"doc(
Streaming merge of s per-sample block attentions into the LSH estimator. Sample k gives, per
row i, the block-wise plain attention output O_ki and lse_ki = log sum_{j in B_k(i)}
e^{tau q_i.k_j} (FlashAttention's softmax_lse); then

    T~_i = sum_k e^{lse_ki - M_i} O_ki / sum_k e^{lse_ki - M_i},   M_i = max_k lse_ki

with O(n d_v) state. Rows with lse = -inf in a sample take nothing from it.
LseMerger(n, value_cols, dtype=numpy.float32).
)doc")
      .def(py::init<Index, Index, const py::object&>(), py::arg("n"), py::arg("value_cols"),
           py::arg("dtype") = py::dtype::of<float>())
      .def("add", &Merger::add, py::arg("output"), py::arg("lse"),
           "Adds one sample: output [n, d_v] (any row stride) and lse [n], of the merger's dtype.")
      .def("result", &Merger::result, py::kw_only(), py::arg("out") = py::none(),
           "T~ as an [n, d_v] array (written into out when given).")
      .def("lse", &Merger::lse, "Merged log-sum-exp log sum_k e^{lse_ki} per row (-inf: no keys).")
      .def_property_readonly("samples", &Merger::samples, "Samples added so far")
      .def_property_readonly("dtype", &Merger::dtype)
      .def_property_readonly("n", &Merger::rows)
      .def_property_readonly("value_cols", &Merger::cols);
}

}  // namespace poslsh_python
