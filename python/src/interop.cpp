// poslsh Python bindings: block plans (cu_seqlens) and the log-sum-exp merger, for running the
// LSH estimator around another attention kernel.
#include <memory>

#include "common.hpp"
#include "poslsh/interop/block_plan.hpp"
#include "poslsh/interop/lse_merge.hpp"

namespace poslsh_python {

namespace {

/// LseMerger of either scalar type, fixed at construction.
class Merger {
 public:
  Merger(Index n, Index value_cols, const py::object& dtype) {
    const py::dtype requested = py::dtype::from_args(dtype);
    auto& api = py::detail::npy_api::get();
    if (api.PyArray_EquivTypes_(requested.ptr(), py::dtype::of<float>().ptr())) {
      single_ = std::make_unique<poslsh::LseMerger<float>>(n, value_cols);
    } else if (api.PyArray_EquivTypes_(requested.ptr(), py::dtype::of<double>().ptr())) {
      double_ = std::make_unique<poslsh::LseMerger<double>>(n, value_cols);
    } else {
      throw py::type_error(argument("LseMerger", "dtype") + " = " +
                           py::str(py::object(requested)).cast<std::string>() +
                           ": must be float32 or float64");
    }
    rows_ = n;
    cols_ = value_cols;
  }

  void add(py::handle output, py::handle lse) {
    if (single_) {
      add_typed<float>(*single_, output, lse);
    } else {
      add_typed<double>(*double_, output, lse);
    }
  }

  py::array result(py::handle out) const {
    return single_ ? result_typed<float>(*single_, out) : result_typed<double>(*double_, out);
  }

  py::array lse() const {
    return single_ ? vector_array<float>(single_->lse()) : vector_array<double>(double_->lse());
  }

  Index samples() const { return single_ ? single_->samples() : double_->samples(); }
  py::dtype dtype() const { return single_ ? py::dtype::of<float>() : py::dtype::of<double>(); }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }

 private:
  template <typename T>
  static void add_typed(poslsh::LseMerger<T>& merger, py::handle output, py::handle lse) {
    constexpr const char* function = "LseMerger.add";
    const InputMap<T> output_map = input_matrix<T>(output, function, "output", "the merger");
    const py::array lse_array = require_array(lse, function, "lse");
    require_dtype<T>(lse_array, function, "lse", "the merger");
    if (lse_array.ndim() != 1) {
      throw py::value_error(argument(function, "lse") + " has " + std::to_string(lse_array.ndim()) +
                            " dimensions: must be 1-D (n)");
    }
    if (lse_array.shape(0) > 1 && lse_array.strides(0) != static_cast<py::ssize_t>(sizeof(T))) {
      throw py::value_error(argument(function, "lse") + " must be contiguous");
    }
    const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> lse_map(
        static_cast<const T*>(lse_array.data()), static_cast<Index>(lse_array.shape(0)));
    // The GIL is kept: the merger is mutable state shared by the Python threads that see it.
    merger.add(output_map, lse_map);
  }

  template <typename T>
  py::array result_typed(const poslsh::LseMerger<T>& merger, py::handle out) const {
    py::array array = output_array<T>(out, rows_, cols_, "LseMerger.result", "the merger", {});
    OutputMap<T> out_map = output_matrix<T>(array, "LseMerger.result");
    merger.result(out_map);
    return array;
  }

  template <typename T>
  static py::array vector_array(const Eigen::Matrix<T, Eigen::Dynamic, 1>& values) {
    return py::array_t<T>(static_cast<py::ssize_t>(values.size()), values.data());
  }

  std::unique_ptr<poslsh::LseMerger<float>> single_;
  std::unique_ptr<poslsh::LseMerger<double>> double_;
  Index rows_ = 0;
  Index cols_ = 0;
};

std::vector<Index> lengths_of(py::handle lengths) {
  if (py::isinstance<py::int_>(lengths)) return {lengths.cast<Index>()};
  return lengths.cast<std::vector<Index>>();
}

}  // namespace

void bind_interop(py::module_& module) {
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
