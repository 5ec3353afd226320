// poslsh Python bindings: poslsh.BFloat16Bits, bfloat16 values as their bit patterns, and the
// CPU's matrix units (which unit multiplies the tiles of a half-precision call).
#include "dtypes.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "poslsh/core/matrix_units.hpp"

namespace poslsh_python {

namespace {

/// The dtype name ("float32", "float64", "float16", "bfloat16") of a `matrix_unit` argument: a
/// str, a torch dtype ("torch.bfloat16") or anything numpy.dtype() takes.
std::string unit_dtype_name(py::handle object) {
  if (py::isinstance<py::str>(object)) return object.cast<std::string>();
  const std::string text = py::str(object).cast<std::string>();
  const std::string torch_prefix = "torch.";
  if (text.rfind(torch_prefix, 0) == 0) return text.substr(torch_prefix.size());
  return py::str(py::module_::import("numpy").attr("dtype")(object).attr("name"))
      .cast<std::string>();
}

/// Calls run(Types<S>{}) with the storage type S named `name` (ValueError naming `argument_name`
/// of matrix_unit otherwise).
template <typename Run>
poslsh::MatrixUnit with_storage(const std::string& name, const char* argument_name, Run&& run) {
  if (name == "float32") return run(Types<float>{});
  if (name == "float64") return run(Types<double>{});
  if (name == "float16") return run(Types<Eigen::half>{});
  if (name == "bfloat16") return run(Types<Eigen::bfloat16>{});
  throw py::value_error(argument("matrix_unit", argument_name) + " = '" + name +
                        "': must be float32, float64, float16 or bfloat16");
}

/// The unit a kernel call with q of dtype `q_name` over k, v of dtype `kv_name` uses under
/// `precision` (matrix_unit_for); ValueError for a combination no kernel takes.
poslsh::MatrixUnit unit_of_call(const std::string& q_name, const std::string& kv_name,
                                poslsh::Precision precision) {
  const bool takes =
      q_name == kv_name || (q_name == "float32" && (kv_name == "float16" || kv_name == "bfloat16"));
  const poslsh::MatrixUnit unit = with_storage(q_name, "q_dtype", [&](auto q_types) {
    return with_storage(kv_name, "kv_dtype", [&](auto kv_types) {
      using Q = typename decltype(q_types)::q;
      using KV = typename decltype(kv_types)::q;
      return poslsh::matrix_unit_for<Q, KV>(precision);
    });
  });
  if (!takes) {
    throw py::value_error(argument("matrix_unit", "kv_dtype") + " = '" + kv_name + "' under '" +
                          q_name +
                          "' q: the kernels take q, k, v of one dtype, or float32 q over "
                          "float16 or bfloat16 k, v");
  }
  return unit;
}

}  // namespace

void register_dtypes(py::module_& module) {
  py::class_<BFloat16Bits>(module, "BFloat16Bits", R"doc(
bfloat16 values given as their bit patterns: an int16 or uint16 numpy array (native byte
order) whose entries are the upper 16 bits of float32 values,

    value = float32 with bits (b << 16)    (sign 1, exponent 8, mantissa 7 bits)

e.g. torch_tensor.view(torch.int16).numpy() of a bfloat16 tensor. The array is shared, never
copied or converted: alibi_attention_tiled, alibi_attention_banded, lsh_attention_fused,
lsh_attention_per_sample, fixed_blocks_attention, the decoders, multihead_attention and
multihead_attention_varlen read q, k, v given as BFloat16Bits as bfloat16 (float32 sums and
softmax; the products on the CPU's matrix unit under precision='matrix_units') and write an `out=` BFloat16Bits (or return a new one over a uint16 array). Integer
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

  module.def(
      "precision_names", []() { return enum_names<poslsh::Precision>(); },
      "Names of the `precision` keyword's values in declaration order (the first is the "
      "default).");

  module.def(
      "matrix_unit_names", []() { return enum_names<poslsh::MatrixUnit>(); },
      R"doc(Names of the units that can multiply half-precision tiles, in declaration order:
'float_products' (every value widened to float32, any CPU), 'avx512_bf16' (AVX512-BF16 dot
products of bfloat16 pairs summed in float32), 'amx_bf16' and 'amx_fp16' (AMX tiles of bfloat16
or float16 pairs, summed in float32).)doc");

  module.def(
      "matrix_unit_available",
      [](const std::string& name) {
        return poslsh::matrix_unit_available(
            poslsh::enum_from_name<poslsh::MatrixUnit>(name, "matrix_unit_available", "name"));
      },
      py::arg("name"),
      "Whether this CPU (and OS) can run the unit `name` (a matrix_unit_names() entry; "
      "ValueError otherwise). 'float_products': always.");

  module.def(
      "matrix_units",
      []() {
        std::vector<std::string> names;
        for (const auto& entry : poslsh::EnumNames<poslsh::MatrixUnit>::table) {
          if (poslsh::matrix_unit_available(entry.value)) names.emplace_back(entry.name);
        }
        return names;
      },
      "Names of the units this CPU can run, in matrix_unit_names() order (detected at run time).");

  module.def(
      "matrix_unit",
      [](py::handle q_dtype, py::handle kv_dtype, const std::string& precision) {
        const std::string q_name = unit_dtype_name(q_dtype);
        const std::string kv_name = kv_dtype.is_none() ? q_name : unit_dtype_name(kv_dtype);
        return std::string(poslsh::enum_name(
            unit_of_call(q_name, kv_name, precision_of(precision, "matrix_unit"))));
      },
      py::arg("q_dtype"), py::arg("kv_dtype") = py::none(), py::kw_only(),
      py::arg("precision") = default_precision(), R"doc(
The name of the unit that multiplies the tiles of a kernel call with q of dtype q_dtype over k, v
of dtype kv_dtype (None: q_dtype) under `precision` on this CPU: 'avx512_bf16' for bfloat16 q,
k, v under precision='matrix_units' when the CPU has AVX512-BF16, 'float_products' otherwise
(float32 and float64 are multiplied in their own type; float16 and float32 q over a half-precision
cache are widened). Dtypes by name ('bfloat16', 'float32', ...), as numpy dtypes or torch dtypes.
ValueError for an unknown dtype, a combination no kernel takes or a bad precision.
)doc");
}

}  // namespace poslsh_python
