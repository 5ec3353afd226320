// poslsh Python bindings: forward passes with their log-sum-exp and the gradients dQ, dK, dV
// (training support; poslsh.torch builds autograd Functions on them).
#include "common.hpp"

#if __has_include("poslsh/training/backward.hpp")
#include "poslsh/training/backward.hpp"
#include "poslsh/training/mean_of_outputs.hpp"
#define POSLSH_PYTHON_HAS_BACKWARD 1
#endif

namespace poslsh_python {

#ifdef POSLSH_PYTHON_HAS_BACKWARD

namespace {

template <typename T>
using VectorMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstVectorMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>;

/// A contiguous 1-D T array of n entries (the lse), checked.
template <typename T>
py::array lse_array(py::handle object, Index n, const char* function, bool output) {
  if (output && object.is_none()) {
    return py::array_t<T>(static_cast<py::ssize_t>(n));
  }
  py::array array = require_array(object, function, "lse");
  require_dtype<T>(array, function, "lse", "q");
  if (array.ndim() != 1 || array.shape(0) != n) {
    throw py::value_error(argument(function, "lse") + " must be a 1-D array of " +
                          std::to_string(n) + " entries (one per query row)");
  }
  if (n > 1 && array.strides(0) != static_cast<py::ssize_t>(sizeof(T))) {
    throw py::value_error(argument(function, "lse") + " must be contiguous");
  }
  if (output && !array.writeable()) {
    throw py::value_error(argument(function, "lse") + " is read-only");
  }
  return array;
}

/// forward(tag, q, k, v, out, lse) with lse: returns (out, lse).
template <typename Kernel>
py::tuple forward_with_lse(const char* function, py::handle q, py::handle k, py::handle v,
                           py::handle out, py::handle lse, std::optional<int> threads,
                           Kernel&& kernel) {
  threads = thread_count(threads, function);
  const py::array first = require_array(q, function, "q");
  return dispatch(first, function, "q", [&](auto tag) -> py::tuple {
    using T = typename decltype(tag)::type;
    const InputMap<T> q_map = input_matrix<T>(q, function, "q", "q");
    const InputMap<T> k_map = input_matrix<T>(k, function, "k", "q");
    const InputMap<T> v_map = input_matrix<T>(v, function, "v", "q");
    py::array out_array = output_array<T>(out, q_map.rows(), v_map.cols(), function, "q",
                                          {{q, "q"}, {k, "k"}, {v, "v"}});
    py::array lse_out = lse_array<T>(lse, q_map.rows(), function, true);
    OutputMap<T> out_map = output_matrix<T>(out_array, function);
    VectorMap<T> lse_map(static_cast<T*>(lse_out.mutable_data()), q_map.rows());
    {
      KernelScope scope(threads);
      kernel(tag, q_map, k_map, v_map, out_map, lse_map);
    }
    return py::make_tuple(out_array, lse_out);
  });
}

/// backward(tag, q, k, v, out, lse, dout, dq, dk, dv): returns (dq, dk, dv).
template <typename Kernel>
py::tuple backward(const char* function, py::handle q, py::handle k, py::handle v, py::handle out,
                   py::handle lse, py::handle dout, py::handle dq, py::handle dk, py::handle dv,
                   std::optional<int> threads, Kernel&& kernel) {
  threads = thread_count(threads, function);
  const py::array first = require_array(q, function, "q");
  return dispatch(first, function, "q", [&](auto tag) -> py::tuple {
    using T = typename decltype(tag)::type;
    const InputMap<T> q_map = input_matrix<T>(q, function, "q", "q");
    const InputMap<T> k_map = input_matrix<T>(k, function, "k", "q");
    const InputMap<T> v_map = input_matrix<T>(v, function, "v", "q");
    const InputMap<T> out_map = input_matrix<T>(out, function, "out", "q");
    const InputMap<T> dout_map = input_matrix<T>(dout, function, "dout", "q");
    const py::array lse_in = lse_array<T>(lse, q_map.rows(), function, false);
    const ConstVectorMap<T> lse_map(static_cast<const T*>(lse_in.data()), q_map.rows());
    const std::initializer_list<std::pair<py::handle, const char*>> inputs = {
        {q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}, {dout, "dout"}};
    py::array dq_array = output_array<T>(dq, q_map.rows(), q_map.cols(), function, "q", inputs);
    py::array dk_array = output_array<T>(dk, k_map.rows(), k_map.cols(), function, "q", inputs);
    py::array dv_array = output_array<T>(dv, v_map.rows(), v_map.cols(), function, "q", inputs);
    OutputMap<T> dq_map = output_matrix<T>(dq_array, function);
    OutputMap<T> dk_map = output_matrix<T>(dk_array, function);
    OutputMap<T> dv_map = output_matrix<T>(dv_array, function);
    {
      KernelScope scope(threads);
      kernel(tag, q_map, k_map, v_map, out_map, lse_map, dout_map, dq_map, dk_map, dv_map);
    }
    return py::make_tuple(dq_array, dk_array, dv_array);
  });
}

/// mean_backward(tag, q, k, v, dout, dq, dk, dv): returns (dq, dk, dv) (no out or lse: the
/// mean-of-outputs backward recomputes each sample's forward).
template <typename Kernel>
py::tuple mean_backward(const char* function, py::handle q, py::handle k, py::handle v,
                        py::handle dout, py::handle dq, py::handle dk, py::handle dv,
                        std::optional<int> threads, Kernel&& kernel) {
  threads = thread_count(threads, function);
  const py::array first = require_array(q, function, "q");
  return dispatch(first, function, "q", [&](auto tag) -> py::tuple {
    using T = typename decltype(tag)::type;
    const InputMap<T> q_map = input_matrix<T>(q, function, "q", "q");
    const InputMap<T> k_map = input_matrix<T>(k, function, "k", "q");
    const InputMap<T> v_map = input_matrix<T>(v, function, "v", "q");
    const InputMap<T> dout_map = input_matrix<T>(dout, function, "dout", "q");
    const std::initializer_list<std::pair<py::handle, const char*>> inputs = {
        {q, "q"}, {k, "k"}, {v, "v"}, {dout, "dout"}};
    py::array dq_array = output_array<T>(dq, q_map.rows(), q_map.cols(), function, "q", inputs);
    py::array dk_array = output_array<T>(dk, k_map.rows(), k_map.cols(), function, "q", inputs);
    py::array dv_array = output_array<T>(dv, v_map.rows(), v_map.cols(), function, "q", inputs);
    OutputMap<T> dq_map = output_matrix<T>(dq_array, function);
    OutputMap<T> dk_map = output_matrix<T>(dk_array, function);
    OutputMap<T> dv_map = output_matrix<T>(dv_array, function);
    {
      KernelScope scope(threads);
      kernel(tag, q_map, k_map, v_map, dout_map, dq_map, dk_map, dv_map);
    }
    return py::make_tuple(dq_array, dk_array, dv_array);
  });
}

const char* const backward_doc = R"doc(
With P the attention probabilities recomputed from lse (P_ij = w_ij e^{x_ij - lse_i}),
dO = dout and D_i = dO_i . out_i:

    dv = P^T dO,  dS_ij = P_ij (dO_i . v_j - D_i),  dq = tau dS K,  dk = tau dS^T Q

out and lse come from the forward *_with_lse of the same inputs. Returns (dq, dk, dv), new
arrays or the given dq=, dk=, dv= written in place. No n x n buffer. Same array rules as the
forward kernels; the GIL is released.)doc";

}  // namespace

void bind_backward(py::module_& module) {
  module.attr("has_backward") = true;

  module.def(
      "alibi_attention_tiled_with_lse",
      [](py::handle q, py::handle k, py::handle v, double sigma, bool causal,
         std::optional<double> scale, py::handle out, py::handle lse, std::optional<int> threads) {
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return forward_with_lse(
            "alibi_attention_tiled", q, k, v, out, lse, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om, auto& lm) {
              using T = typename decltype(tag)::type;
              poslsh::alibi_attention_tiled<T>(qm, km, vm, sigma, om, lm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("out") = py::none(),
      py::arg("lse") = py::none(), py::arg("num_threads") = py::none(), R"doc(
alibi_attention_tiled and its per-row log-sum-exp, (out, lse):

    lse_i = log sum_j e^{x_ij},  x_ij = tau q_i.k_j - |i-j| / sigma   (causal: j <= i)

(single-threaded).
)doc");

  module.def(
      "lsh_attention_fused_with_lse",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, bool causal,
         std::optional<double> scale, py::handle out, py::handle lse, std::optional<int> threads) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_fused");
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return forward_with_lse(
            "lsh_attention_fused", q, k, v, out, lse, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om, auto& lm) {
              using T = typename decltype(tag)::type;
              poslsh::lsh_attention_fused<T>(qm, km, vm, set, om, lm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("out") = py::none(),
      py::arg("lse") = py::none(), py::arg("num_threads") = py::none(), R"doc(
lsh_attention_fused and its per-row log-sum-exp, (out, lse):

    lse_i = log sum_j c_ij e^{tau q_i.k_j},  c_ij = #{k : bin_k(i) = bin_k(j)}
)doc");

  module.def(
      "alibi_attention_tiled_backward",
      [](py::handle q, py::handle k, py::handle v, double sigma, py::handle out, py::handle lse,
         py::handle dout, bool causal, std::optional<double> scale, py::handle dq, py::handle dk,
         py::handle dv, std::optional<int> threads) {
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return backward(
            "alibi_attention_tiled_backward", q, k, v, out, lse, dout, dq, dk, dv, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, const auto& om,
                const auto& lm, const auto& dom, auto& dqm, auto& dkm, auto& dvm) {
              using T = typename decltype(tag)::type;
              poslsh::alibi_attention_tiled_backward<T>(qm, km, vm, sigma, om, lm, dom, dqm, dkm,
                                                        dvm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::arg("out"), py::arg("lse"),
      py::arg("dout"), py::kw_only(), py::arg("causal") = true, py::arg("scale") = py::none(),
      py::arg("dq") = py::none(), py::arg("dk") = py::none(), py::arg("dv") = py::none(),
      py::arg("num_threads") = py::none(),
      (std::string("Gradients of exact ALiBi attention (alibi_attention_tiled), x_ij = tau "
                   "q_i.k_j - |i-j| / sigma, w = 1.") +
       backward_doc)
          .c_str());

  module.def(
      "lsh_attention_fused_backward",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, py::handle out,
         py::handle lse, py::handle dout, bool causal, std::optional<double> scale, py::handle dq,
         py::handle dk, py::handle dv, std::optional<int> threads) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_fused_backward");
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return backward(
            "lsh_attention_fused_backward", q, k, v, out, lse, dout, dq, dk, dv, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, const auto& om,
                const auto& lm, const auto& dom, auto& dqm, auto& dkm, auto& dvm) {
              using T = typename decltype(tag)::type;
              poslsh::lsh_attention_fused_backward<T>(qm, km, vm, set, om, lm, dom, dqm, dkm, dvm,
                                                      options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::arg("out"), py::arg("lse"),
      py::arg("dout"), py::kw_only(), py::arg("causal") = true, py::arg("scale") = py::none(),
      py::arg("dq") = py::none(), py::arg("dk") = py::none(), py::arg("dv") = py::none(),
      py::arg("num_threads") = py::none(),
      (std::string("Gradients of the LSH estimator (lsh_attention_fused), x_ij = tau q_i.k_j, "
                   "w_ij = c_ij.") +
       backward_doc)
          .c_str());

  // The other kernels with lse and their gradients: banded, per-sample, fixed blocks.
  module.def(
      "alibi_attention_banded_with_lse",
      [](py::handle q, py::handle k, py::handle v, double sigma, Index band, bool causal,
         std::optional<double> scale, py::handle out, py::handle lse, std::optional<int> threads) {
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return forward_with_lse(
            "alibi_attention_banded", q, k, v, out, lse, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om, auto& lm) {
              using T = typename decltype(tag)::type;
              poslsh::alibi_attention_banded<T>(qm, km, vm, sigma, band, om, lm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::arg("band"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("out") = py::none(),
      py::arg("lse") = py::none(), py::arg("num_threads") = py::none(), R"doc(
alibi_attention_banded and its per-row log-sum-exp, (out, lse):

    lse_i = log sum_{|i-j| <= band} e^{x_ij},  x_ij = tau q_i.k_j - |i-j| / sigma
)doc");

  module.def(
      "lsh_attention_per_sample_with_lse",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, bool causal,
         std::optional<double> scale, py::handle out, py::handle lse, std::optional<int> threads) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_per_sample");
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return forward_with_lse(
            "lsh_attention_per_sample", q, k, v, out, lse, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om, auto& lm) {
              using T = typename decltype(tag)::type;
              poslsh::lsh_attention_per_sample<T>(qm, km, vm, set, om, lm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("out") = py::none(),
      py::arg("lse") = py::none(), py::arg("num_threads") = py::none(), R"doc(
lsh_attention_per_sample and its per-row log-sum-exp, (out, lse) (the estimator of
lsh_attention_fused_with_lse, computed sample by sample):

    lse_i = log sum_j c_ij e^{tau q_i.k_j}
)doc");

  module.def(
      "fixed_blocks_attention_with_lse",
      [](py::handle q, py::handle k, py::handle v, double sigma, bool causal,
         std::optional<double> scale, py::handle out, py::handle lse, std::optional<int> threads) {
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return forward_with_lse(
            "fixed_blocks_attention", q, k, v, out, lse, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om, auto& lm) {
              using T = typename decltype(tag)::type;
              poslsh::fixed_blocks_attention<T>(qm, km, vm, sigma, om, lm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("out") = py::none(),
      py::arg("lse") = py::none(), py::arg("num_threads") = py::none(), R"doc(
fixed_blocks_attention and its per-row log-sum-exp, (out, lse): plain attention inside blocks
of width 2 sigma from position 0, lse_i = log sum_{j in B(i)} e^{tau q_i.k_j}.
)doc");

  module.def(
      "alibi_attention_banded_backward",
      [](py::handle q, py::handle k, py::handle v, double sigma, Index band, py::handle out,
         py::handle lse, py::handle dout, bool causal, std::optional<double> scale, py::handle dq,
         py::handle dk, py::handle dv, std::optional<int> threads) {
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return backward(
            "alibi_attention_banded_backward", q, k, v, out, lse, dout, dq, dk, dv, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, const auto& om,
                const auto& lm, const auto& dom, auto& dqm, auto& dkm, auto& dvm) {
              using T = typename decltype(tag)::type;
              poslsh::alibi_attention_banded_backward<T>(qm, km, vm, sigma, band, om, lm, dom, dqm,
                                                         dkm, dvm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::arg("band"), py::arg("out"),
      py::arg("lse"), py::arg("dout"), py::kw_only(), py::arg("causal") = true,
      py::arg("scale") = py::none(), py::arg("dq") = py::none(), py::arg("dk") = py::none(),
      py::arg("dv") = py::none(), py::arg("num_threads") = py::none(),
      (std::string("Gradients of banded exact ALiBi attention (alibi_attention_banded), keys "
                   "|i-j| <= band, w = 1.") +
       backward_doc)
          .c_str());

  module.def(
      "lsh_attention_per_sample_backward",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, py::handle out,
         py::handle lse, py::handle dout, bool causal, std::optional<double> scale, py::handle dq,
         py::handle dk, py::handle dv, std::optional<int> threads) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_per_sample_backward");
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return backward(
            "lsh_attention_per_sample_backward", q, k, v, out, lse, dout, dq, dk, dv, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, const auto& om,
                const auto& lm, const auto& dom, auto& dqm, auto& dkm, auto& dvm) {
              using T = typename decltype(tag)::type;
              poslsh::lsh_attention_per_sample_backward<T>(qm, km, vm, set, om, lm, dom, dqm, dkm,
                                                           dvm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::arg("out"), py::arg("lse"),
      py::arg("dout"), py::kw_only(), py::arg("causal") = true, py::arg("scale") = py::none(),
      py::arg("dq") = py::none(), py::arg("dk") = py::none(), py::arg("dv") = py::none(),
      py::arg("num_threads") = py::none(),
      (std::string("Gradients of the LSH estimator computed sample by sample "
                   "(lsh_attention_per_sample), w_ij = c_ij.") +
       backward_doc)
          .c_str());

  module.def(
      "fixed_blocks_attention_backward",
      [](py::handle q, py::handle k, py::handle v, double sigma, py::handle out, py::handle lse,
         py::handle dout, bool causal, std::optional<double> scale, py::handle dq, py::handle dk,
         py::handle dv, std::optional<int> threads) {
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return backward(
            "fixed_blocks_attention_backward", q, k, v, out, lse, dout, dq, dk, dv, threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, const auto& om,
                const auto& lm, const auto& dom, auto& dqm, auto& dkm, auto& dvm) {
              using T = typename decltype(tag)::type;
              poslsh::fixed_blocks_attention_backward<T>(qm, km, vm, sigma, om, lm, dom, dqm, dkm,
                                                         dvm, options);
            });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sigma"), py::arg("out"), py::arg("lse"),
      py::arg("dout"), py::kw_only(), py::arg("causal") = true, py::arg("scale") = py::none(),
      py::arg("dq") = py::none(), py::arg("dk") = py::none(), py::arg("dv") = py::none(),
      py::arg("num_threads") = py::none(),
      (std::string("Gradients of fixed-blocks attention (fixed_blocks_attention), plain attention "
                   "inside blocks of width 2 sigma.") +
       backward_doc)
          .c_str());

  module.def(
      "lsh_attention_mean_of_outputs",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, bool causal,
         std::optional<double> scale, py::handle out, std::optional<int> threads) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_mean_of_outputs");
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        // The forward with lse machinery, its lse left unused.
        py::tuple result = forward_with_lse(
            "lsh_attention_mean_of_outputs", q, k, v, out, py::none(), threads,
            [&](auto tag, const auto& qm, const auto& km, const auto& vm, auto& om, auto&) {
              using T = typename decltype(tag)::type;
              poslsh::lsh_attention_mean_of_outputs<T>(qm, km, vm, set, om, options);
            });
        return py::object(result[0]);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("out") = py::none(),
      py::arg("num_threads") = py::none(), R"doc(
The mean-of-outputs estimator: the mean of the s plain attentions on each sample's blocks,

    T_bar_i = (1/s) sum_k softmax_{j in B_k(i)}(tau q_i.k_j) V   (causal: j <= i inside blocks)

It is not the count-weighted estimator of lsh_attention_fused (which puts the mean mask
inside the softmax); a model trained with one should be run with the same one.
)doc");

  module.def(
      "lsh_attention_mean_of_outputs_backward",
      [](py::handle q, py::handle k, py::handle v, py::handle hashes, py::handle dout, bool causal,
         std::optional<double> scale, py::handle dq, py::handle dk, py::handle dv,
         std::optional<int> threads) {
        const poslsh::HashSet& set = hash_set(hashes, "lsh_attention_mean_of_outputs_backward");
        const poslsh::AttentionOptions options{masking_of(causal), scale};
        return mean_backward("lsh_attention_mean_of_outputs_backward", q, k, v, dout, dq, dk, dv,
                             threads,
                             [&](auto tag, const auto& qm, const auto& km, const auto& vm,
                                 const auto& dom, auto& dqm, auto& dkm, auto& dvm) {
                               using T = typename decltype(tag)::type;
                               poslsh::lsh_attention_mean_of_outputs_backward<T>(
                                   qm, km, vm, set, dom, dqm, dkm, dvm, options);
                             });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("hashes"), py::arg("dout"), py::kw_only(),
      py::arg("causal") = true, py::arg("scale") = py::none(), py::arg("dq") = py::none(),
      py::arg("dk") = py::none(), py::arg("dv") = py::none(), py::arg("num_threads") = py::none(),
      R"doc(
Gradients of lsh_attention_mean_of_outputs: the plain attention backward of each sample's
blocks with dO / s, summed over samples. Returns (dq, dk, dv).
)doc");
}

#else

void bind_backward(py::module_& module) { module.attr("has_backward") = false; }

#endif

}  // namespace poslsh_python
