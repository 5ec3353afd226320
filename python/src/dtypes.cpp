// poslsh Python bindings: poslsh.BFloat16Bits, bfloat16 values as their bit patterns.
#include "dtypes.hpp"

#include <cstdint>
#include <cstring>
#include <vector>

namespace poslsh_python {

void register_dtypes(py::module_& module) {
  py::class_<BFloat16Bits>(module, "BFloat16Bits", R"doc(
bfloat16 values given as their bit patterns: an int16 or uint16 numpy array (native byte
order) whose entries are the upper 16 bits of float32 values,

    value = float32 with bits (b << 16)    (sign 1, exponent 8, mantissa 7 bits)

e.g. torch_tensor.view(torch.int16).numpy() of a bfloat16 tensor. The array is shared, never
copied or converted: alibi_attention_tiled, alibi_attention_banded, lsh_attention_fused,
lsh_attention_per_sample, fixed_blocks_attention, the decoders, multihead_attention and
multihead_attention_varlen read q, k, v given as BFloat16Bits as bfloat16 (computing in
float32) and write an `out=` BFloat16Bits (or return a new one over a uint16 array). Integer
arrays are read as bfloat16 only through this wrapper.
)doc")
      .def(py::init([](py::handle bits) {
             const py::array array = require_array(bits, "BFloat16Bits", "bits");
             if (!has_native_dtype(array, 'h') && !has_native_dtype(array, 'H')) {
               throw py::type_error(argument("BFloat16Bits", "bits") + " has dtype " +
                                    dtype_name(array) +
                                    ": must be int16 or uint16 (bfloat16 bit patterns; arrays are "
                                    "never converted)");
             }
             return BFloat16Bits{array};
           }),
           py::arg("bits"))
      .def_property_readonly(
          "bits", [](const BFloat16Bits& self) { return self.bits; },
          "The int16 or uint16 array of bit patterns (shared).")
      .def_property_readonly(
          "shape", [](const BFloat16Bits& self) { return self.bits.attr("shape"); },
          "Shape of the bit array.")
      .def(
          "to_float32",
          [](const BFloat16Bits& self) {
            // float32 with bits (b << 16): exact.
            py::object numpy = py::module_::import("numpy");
            py::object wide =
                self.bits.attr("view")(numpy.attr("uint16")).attr("astype")(numpy.attr("uint32"));
            return (wide.attr("__lshift__")(16)).attr("view")(numpy.attr("float32"));
          },
          "A new float32 array of the values (exact: float32 with bits b << 16).")
      .def_static(
          "from_float32",
          [](py::handle values) {
            constexpr const char* function = "BFloat16Bits.from_float32";
            if (!is_storage<float>(values)) {
              throw py::type_error(argument(function, "values") + " " +
                                   describe(values, function, "values") +
                                   ": must be float32 (arrays are never converted)");
            }
            const py::array contiguous =
                py::module_::import("numpy").attr("ascontiguousarray")(values);
            std::vector<py::ssize_t> shape(contiguous.shape(),
                                           contiguous.shape() + contiguous.ndim());
            py::array bits(py::dtype("uint16"), shape);
            const auto* source = static_cast<const float*>(contiguous.data());
            auto* target = static_cast<std::uint16_t*>(bits.mutable_data());
            for (py::ssize_t i = 0; i < contiguous.size(); ++i) {
              const Eigen::bfloat16 rounded(source[i]);
              std::memcpy(&target[i], &rounded, sizeof(std::uint16_t));
            }
            return BFloat16Bits{bits};
          },
          py::arg("values"),
          "float32 values rounded to bfloat16 (to nearest, ties to even; NaN stays NaN), in a "
          "new uint16 array.")
      .def("__repr__", [](const BFloat16Bits& self) {
        return "BFloat16Bits(shape=" + py::str(self.bits.attr("shape")).cast<std::string>() +
               ", bits dtype=" + dtype_name(self.bits) + ")";
      });
}

}  // namespace poslsh_python
