// poslsh Python bindings: training support. The forwards with their log-sum-exp and the
// gradients dQ, dK, dV, for the single-head kernels and for all heads (one sequence or a
// packed batch), and the mean-of-outputs estimator; poslsh.torch builds its torch operators on
// them. Self-attention only. The forwards with lse and the backward passes take float32,
// float64, float16 or bfloat16 (poslsh.BFloat16Bits) q, k, v, out and dout of one dtype, with
// lse and the gradients float32 for the half-precision dtypes (poslsh::backward_scalar_t) and a
// `precision` keyword; the mean-of-outputs estimator float32 or float64 only.
#include "poslsh/multihead/training.hpp"

#include <cstring>

#include "arrays.hpp"
#include "multihead.hpp"
#include "poslsh/multihead/single_head.hpp"
#include "poslsh/parallel/context_parallel.hpp"

namespace poslsh_python {

namespace {

template <typename T>
using VectorMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>;

/// The data of the 1-D array `name` of n entries (one per `entry`), checked: shape and a
/// contiguous axis.
template <typename T>
T* vector_data(const py::array& array, Index n, const char* function, const char* name = "lse",
               const char* entry = "query row") {
  if (array.ndim() != 1 || array.shape(0) != n) {
    throw py::value_error(argument(function, name) + " has shape " + shape_text(array) +
                          ": must be a 1-D array of " + std::to_string(n) + " entries (one per " +
                          entry + ")");
  }
  if (n > 1 && array.strides(0) != static_cast<py::ssize_t>(sizeof(T))) {
    throw py::value_error(argument(function, name) + " must be contiguous");
  }
  return static_cast<T*>(const_cast<void*>(array.data()));
}

/// The gradients dq, dk, dv of a single-head backward (the shapes of q, k, v): new arrays or
/// the given ones, sharing no memory with `inputs` or each other.
template <typename T>
struct Gradients {
  MatrixOutput<T> dq, dk, dv;
};

/// The argument whose dtype the lse and gradient arrays of a call on q of storage T must have,
/// in messages: q for float32 and float64; for the half-precision dtypes they are float32
/// (poslsh::backward_scalar_t), the dtype of the lse.
template <typename T>
const char* lse_like() {
  return std::is_same_v<T, poslsh::backward_scalar_t<T>> ? "q" : "lse";
}

/// The gradient outputs (storage G) of a call on q, k, v of storage T.
template <typename T, typename G = poslsh::backward_scalar_t<T>>
Gradients<G> gradient_outputs(const char* function, const QkvMaps<Types<T>>& maps, py::handle dq,
                              py::handle dk, py::handle dv, Inputs inputs) {
  const char* const like = lse_like<T>();
  auto dq_out = output_matrix<G>(dq, maps.q.rows(), maps.q.cols(), function, "dq", like, inputs);
  inputs.emplace_back(dq_out.result, "dq");
  auto dk_out = output_matrix<G>(dk, maps.k.rows(), maps.k.cols(), function, "dk", like, inputs);
  inputs.emplace_back(dk_out.result, "dk");
  return {dq_out, dk_out,
          output_matrix<G>(dv, maps.v.rows(), maps.v.cols(), function, "dv", like, inputs)};
}

/// The dtypes of the training calls: q, k, v, out, dout of one storage T (float32, float64,
/// float16 or bfloat16), lse and gradients of poslsh::backward_scalar_t<T>.
const char* const training_dtypes_doc = R"doc(
dtypes: q, k, v, out and dout all float32, float64, float16 or poslsh.BFloat16Bits (one dtype;
out, like the inputs, in it); lse and the gradients float64 for float64 inputs, float32
otherwise. precision: 'matrix_units' (default) or 'float_products', as the forward kernels:
under 'matrix_units' bfloat16 inputs are multiplied on the CPU's matrix unit where it has one
(the forward's out bitwise that of the kernel without lse; the backward's five products take
bfloat16 operands with float32 sums, P and dS rounded to bfloat16); otherwise every value is
widened to float32 and the results are bitwise the float32 call's on the widened inputs (out
rounded once to the input dtype). float32 and float64 inputs ignore it.)doc";

const char* const backward_doc = R"doc(
With P the attention probabilities recomputed from lse (P_ij = w_ij e^{x_ij - lse_i}),
dO = dout and D_i = dO_i . out_i:

    dv = P^T dO,  dS_ij = P_ij (dO_i . v_j - D_i),  dq = tau dS K,  dk = tau dS^T Q

out and lse come from the forward *_with_lse of the same inputs. Returns (dq, dk, dv), new
arrays or the given dq=, dk=, dv= written in place. No n x n buffer. The array rules of the
forward kernels; the GIL is released.)doc";

/// The docstring of each method's single-head forward with lse (<function>_with_lse, before
/// training_dtypes_doc).
const std::pair<poslsh::Method, const char*> with_lse_docs[] = {
    {poslsh::Method::exact_tiled, R"doc(
alibi_attention_tiled and its per-row log-sum-exp, (out, lse):

    lse_i = log sum_j e^{x_ij},  x_ij = tau q_i.k_j - |i-j| / sigma   (causal: j <= i)
)doc"},
    {poslsh::Method::exact_banded, R"doc(
alibi_attention_banded and its per-row log-sum-exp, (out, lse):

    lse_i = log sum_{|i-j| <= band} e^{x_ij},  x_ij = tau q_i.k_j - |i-j| / sigma
)doc"},
    {poslsh::Method::lsh_fused, R"doc(
lsh_attention_fused and its per-row log-sum-exp, (out, lse):

    lse_i = log sum_j c_ij e^{tau q_i.k_j},  c_ij = #{k : bin_k(i) = bin_k(j)}
)doc"},
    {poslsh::Method::lsh_per_sample, R"doc(
lsh_attention_per_sample and its per-row log-sum-exp, (out, lse) (the estimator of
lsh_attention_fused_with_lse, computed sample by sample):

    lse_i = log sum_j c_ij e^{tau q_i.k_j}
)doc"},
    {poslsh::Method::fixed_blocks, R"doc(
fixed_blocks_attention and its per-row log-sum-exp, (out, lse): plain attention inside blocks
of width 2 sigma from position 0, lse_i = log sum_{j in B(i)} e^{tau q_i.k_j}.
)doc"},
};

/// The docstring of each method's single-head backward: its first part for a method with lse
/// (before backward_doc and training_dtypes_doc), the whole of it for one without.
const std::pair<poslsh::Method, const char*> backward_docs[] = {
    {poslsh::Method::exact_tiled, R"doc(
Gradients of exact ALiBi attention (alibi_attention_tiled), x_ij = tau q_i.k_j - |i-j| / sigma,
w = 1.)doc"},
    {poslsh::Method::exact_banded, R"doc(
Gradients of banded exact ALiBi attention (alibi_attention_banded), keys |i-j| <= band, w = 1.)doc"},
    {poslsh::Method::lsh_fused, R"doc(
Gradients of the LSH estimator (lsh_attention_fused), x_ij = tau q_i.k_j, w_ij = c_ij.)doc"},
    {poslsh::Method::lsh_per_sample, R"doc(
Gradients of the LSH estimator computed sample by sample (lsh_attention_per_sample),
w_ij = c_ij.)doc"},
    {poslsh::Method::fixed_blocks, R"doc(
Gradients of fixed-blocks attention (fixed_blocks_attention), plain attention inside blocks of
width 2 sigma.)doc"},
    {poslsh::Method::mean_of_outputs, R"doc(
Gradients of lsh_attention_mean_of_outputs: the plain attention backward of each sample's
blocks with dO / s, summed over samples. Returns (dq, dk, dv).
)doc"},
};

/// The docstring of the single-head forward of each method without lse (bound here with its
/// backward).
const std::pair<poslsh::Method, const char*> without_lse_docs[] = {
    {poslsh::Method::mean_of_outputs, R"doc(
The mean-of-outputs estimator: the mean of the s plain attentions on each sample's blocks,

    T_bar_i = (1/s) sum_k softmax_{j in B_k(i)}(tau q_i.k_j) V   (causal: j <= i inside blocks)

It is not the count-weighted estimator of lsh_attention_fused (which puts the mean mask
inside the softmax); a model trained with one should be run with the same one. float32 or
float64, self-attention.
)doc"},
};

/// A single-head training call of `function` (a forward with lse or a backward): the options
/// of the keywords and the thread count checked, the kernel parameters' values
/// (parameter_value), then run(types, options, threads, values...) for q's storage type (every
/// dtype of training_dtypes_doc).
template <typename Run, typename... Parameters>
py::object single_head_training(const char* function, py::handle q, const std::string& masking,
                                std::optional<double> scale, const std::string& precision,
                                std::optional<int> threads, Run&& run,
                                const Parameters&... parameters) {
  const poslsh::AttentionOptions options = attention_options(
      masking_of(masking, function), scale, std::nullopt, precision_of(precision, function));
  threads = thread_count(threads, function);
  const auto call = [&](const auto&... values) {
    return dispatch<DtypeSet::with_half>(function, {q}, [&](auto types) -> py::object {
      return run(types, options, threads, values...);
    });
  };
  return call(parameter_value(parameters, function)...);
}

/// Binds the training functions of a method with lse from its row (poslsh::SingleHeadKernels,
/// parameters P...):
///   <function>_with_lse(q, k, v, parameters..., *, masking="causal", scale=None, out=None,
///                       lse=None, num_threads=None, precision="matrix_units") -> (out, lse)
/// (its messages name `function`, the library's forward with lse), and
///   <function>_backward(q, k, v, parameters..., out, lse, dout, *, masking="causal", scale=None,
///                       dq=None, dk=None, dv=None, num_threads=None,
///                       precision="matrix_units") -> (dq, dk, dv),
/// on the dtypes of training_dtypes_doc.
template <typename Row, typename... P>
void def_training(py::module_& module, poslsh::KernelParameters<P...>) {
  module.def((std::string(Row::function) + "_with_lse").c_str(),
             [](py::handle q, py::handle k, py::handle v, python_parameter_t<P>... parameters,
                const std::string& masking, std::optional<double> scale, py::handle out,
                py::handle lse, std::optional<int> threads, const std::string& precision) {
               const char* const function = Row::function;
               const auto run = [&](auto types, const auto& options, auto threads,
                                    const auto&... values) -> py::object {
                 using T = typename decltype(types)::q;
                 using L = poslsh::backward_scalar_t<T>;
                 const QkvMaps<Types<T>> maps = qkv_maps<Types<T>>(function, q, k, v);
                 const Index n = maps.q.rows();
                 const Inputs inputs = {{q, "q"}, {k, "k"}, {v, "v"}};
                 auto output =
                     output_matrix<T>(out, n, maps.v.cols(), function, "out", "q", inputs);
                 const Output lse_out =
                     output_of<L>(lse, {n}, function, "lse", lse_like<T>(), inputs, false);
                 VectorMap<L> lse_map(vector_data<L>(lse_out.array, n, function), n);
                 run_kernel(threads, [&] {
                   Row::template forward_with_lse<T>(maps.q, maps.k, maps.v, values..., output.map,
                                                     lse_map, options);
                 });
                 return py::make_tuple(output.result, lse_out.result);
               };
               return single_head_training(function, q, masking, scale, precision, threads, run,
                                           parameters...);
             },
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg(P::name)..., py::kw_only(),
             py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
             py::arg("out") = py::none(), py::arg("lse") = py::none(),
             py::arg("num_threads") = py::none(), py::arg("precision") = default_precision(),
             (method_doc(with_lse_docs, Row::method, Row::function) + training_dtypes_doc).c_str());

  static const std::string backward = std::string(Row::function) + "_backward";
  module.def(
      backward.c_str(),
      [](py::handle q, py::handle k, py::handle v, python_parameter_t<P>... parameters,
         py::handle out, py::handle lse, py::handle dout, const std::string& masking,
         std::optional<double> scale, py::handle dq, py::handle dk, py::handle dv,
         std::optional<int> threads, const std::string& precision) {
        const char* const name = backward.c_str();
        const auto run = [&](auto types, const auto& options, auto threads,
                             const auto&... values) -> py::object {
          using T = typename decltype(types)::q;
          using L = poslsh::backward_scalar_t<T>;
          const QkvMaps<Types<T>> maps = qkv_maps<Types<T>>(name, q, k, v);
          const InputMap<T> out_map = input_matrix<T>(out, name, "out", "q");
          const InputMap<T> dout_map = input_matrix<T>(dout, name, "dout", "q");
          const Index n = maps.q.rows();
          const Eigen::Map<const Eigen::Matrix<L, Eigen::Dynamic, 1>> lse_map(
              vector_data<L>(storage_array<L>(lse, name, "lse", lse_like<T>()), n, name), n);
          auto grads = gradient_outputs<T>(
              name, maps, dq, dk, dv,
              {{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}, {dout, "dout"}});
          run_kernel(threads, [&] {
            Row::template backward<T>(maps.q, maps.k, maps.v, values..., out_map, lse_map, dout_map,
                                      grads.dq.map, grads.dk.map, grads.dv.map, options);
          });
          return py::make_tuple(grads.dq.result, grads.dk.result, grads.dv.result);
        };
        return single_head_training(name, q, masking, scale, precision, threads, run,
                                    parameters...);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg(P::name)..., py::arg("out"), py::arg("lse"),
      py::arg("dout"), py::kw_only(), py::arg("masking") = default_masking(),
      py::arg("scale") = py::none(), py::arg("dq") = py::none(), py::arg("dk") = py::none(),
      py::arg("dv") = py::none(), py::arg("num_threads") = py::none(),
      py::arg("precision") = default_precision(),
      (method_doc(backward_docs, Row::method, Row::function) + backward_doc + training_dtypes_doc)
          .c_str());
}

/// Binds the single-head functions of a method without lse from its row (parameters P...):
///   <function>(q, k, v, parameters..., *, masking="causal", scale=None, out=None,
///              num_threads=None) -> out
///   <function>_backward(q, k, v, parameters..., dout, *, masking="causal", scale=None, dq=None,
///                       dk=None, dv=None, num_threads=None) -> (dq, dk, dv)
/// (float32 or float64, self-attention: the backward recomputes the forward from q, k, v).
template <typename Row, typename... P>
void def_without_lse(py::module_& module, poslsh::KernelParameters<P...>) {
  module.def(
      Row::function,
      [](py::handle q, py::handle k, py::handle v, python_parameter_t<P>... parameters,
         const std::string& masking, std::optional<double> scale, py::handle out,
         std::optional<int> threads) {
        const char* const function = Row::function;
        const auto call = [&](const auto&... values) {
          const poslsh::AttentionOptions options{masking_of(masking, function), scale};
          return qkv_call<DtypeSet::full_precision>(
              function, q, k, v, out, threads,
              [&](auto types, const auto& qm, const auto& km, const auto& vm, auto& om) {
                using T = typename decltype(types)::q;
                Row::template forward<T>(qm, km, vm, values..., om, options);
              });
        };
        return call(parameter_value(parameters, function)...);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg(P::name)..., py::kw_only(),
      py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
      py::arg("out") = py::none(), py::arg("num_threads") = py::none(),
      method_doc(without_lse_docs, Row::method, Row::function).c_str());

  static const std::string backward = std::string(Row::function) + "_backward";
  module.def(
      backward.c_str(),
      [](py::handle q, py::handle k, py::handle v, python_parameter_t<P>... parameters,
         py::handle dout, const std::string& masking, std::optional<double> scale, py::handle dq,
         py::handle dk, py::handle dv, std::optional<int> threads) {
        const char* const function = backward.c_str();
        const auto call = [&](const auto&... values) {
          const poslsh::AttentionOptions options{masking_of(masking, function), scale};
          threads = thread_count(threads, function);
          return dispatch(function, {q}, [&](auto types) {
            using T = typename decltype(types)::q;
            const QkvMaps<Types<T>> maps = qkv_maps<Types<T>>(function, q, k, v);
            const InputMap<T> dout_map = input_matrix<T>(dout, function, "dout", "q");
            auto grads = gradient_outputs<T>(function, maps, dq, dk, dv,
                                             {{q, "q"}, {k, "k"}, {v, "v"}, {dout, "dout"}});
            run_kernel(threads, [&] {
              Row::template backward<T>(maps.q, maps.k, maps.v, values..., dout_map, grads.dq.map,
                                        grads.dk.map, grads.dv.map, options);
            });
            return py::make_tuple(grads.dq.result, grads.dk.result, grads.dv.result);
          });
        };
        return call(parameter_value(parameters, function)...);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg(P::name)..., py::arg("dout"), py::kw_only(),
      py::arg("masking") = default_masking(), py::arg("scale") = py::none(),
      py::arg("dq") = py::none(), py::arg("dk") = py::none(), py::arg("dv") = py::none(),
      py::arg("num_threads") = py::none(),
      method_doc(backward_docs, Row::method, Row::function).c_str());
}

/// The lse of all heads of a call on q of storage Q (H_q x n of storage backward_scalar_t<Q>,
/// last axis contiguous, any row stride): a new array, or `object` checked (dtype, shape;
/// writable and sharing no memory with `inputs` when `output`), and its map.
template <typename Q, typename T = poslsh::backward_scalar_t<Q>>
std::pair<py::object, OutputMap<T>> lse_matrix(py::handle object, Index heads, Index n,
                                               const char* function, bool output,
                                               const Inputs& inputs) {
  const char* const like = lse_like<Q>();
  const Output lse = output ? output_of<T>(object, {heads, n}, function, "lse", like, inputs, false)
                            : Output{py::reinterpret_borrow<py::object>(object),
                                     storage_array<T>(object, function, "lse", like)};
  if (lse.array.ndim() != 2 || lse.array.shape(0) != heads || lse.array.shape(1) != n) {
    throw py::value_error(argument(function, "lse") + " must be a 2-D array of shape (" +
                          std::to_string(heads) + ", " + std::to_string(n) +
                          "): one row per query head, one column per query token");
  }
  const Index stride = row_stride_of<T>(lse.array, function, "lse");
  return {lse.result, OutputMap<T>(static_cast<T*>(const_cast<void*>(lse.array.data())), heads, n,
                                   Eigen::OuterStride<>(stride))};
}

/// One sequence, or a packed batch when cu_seqlens is given (int32, B + 1 entries): the
/// library's function for it (its messages' name) and the batch's cu_seqlens.
struct Batch {
  const char* function;
  std::optional<std::vector<std::int32_t>> cu_seqlens;
};

Batch batch_of(py::handle cu_seqlens, const char* function, const char* packed_function) {
  if (cu_seqlens.is_none()) return {function, std::nullopt};
  return {packed_function, int32_vector(cu_seqlens, packed_function, "cu_seqlens")};
}

const char* const with_lse_doc = R"doc(
multihead_attention and the log-sum-exp of every query head, (out, lse):

    lse[h, i] = log sum_j w_ij e^{x_ij}   (head h, with the kernels' scores and weights:
    exact x_ij = tau q_i.k_j - |i-j| / sigma_h, w = 1 (banded: keys |i-j| <= band);
    LSH x_ij = tau q_i.k_j, w_ij = c_ij = #{k : bin_k(i) = bin_k(j)}; causal: j <= i)

lse is [H_q, n] (FlashAttention's softmax_lse of one sequence), a new array or the given lse=
([H_q, n], last axis contiguous) written in place; out is bitwise that of multihead_attention.
Self-attention (k, v have the n tokens of q) unless cu_seqlens_k is given. Keywords as multihead_attention (no
query_offset, no plans). The GIL is released.

cu_seqlens= (int32, B + 1 entries, 0 = cu_seqlens[0] <= ... <= cu_seqlens[B] = n): a packed
batch of B self-attention sequences, tokens cu_seqlens[b] .. cu_seqlens[b+1]-1 (positions 0 ..
m_b - 1 each); lse[:, t] is token t's. Each sequence is bitwise its own call, and out is bitwise
multihead_attention_varlen(q, k, v, cu_seqlens, cu_seqlens). cu_seqlens_k= (with cu_seqlens,
then the queries' offsets): sequence b's queries are tokens cu_seqlens[b] .. of q over its
keys cu_seqlens_k[b] .. of k and v, at the last positions (bottom-right), out bitwise that of
multihead_attention_varlen(q, k, v, cu_seqlens, cu_seqlens_k): FlashAttention's varlen forward
with softmax_lse; its gradients: multihead_attention_backward with the same cu_seqlens and
cu_seqlens_k (exact methods).

key_offset=, query_offset= (one sequence): a slice of a longer sequence, the queries at
positions query_offset .. query_offset + m - 1 (unset: the last m of the keys' positions) over
the keys at positions key_offset .. key_offset + L - 1 (unset: 0), every bias, mask and LSH bin
at those positions; a row with no key of nonzero weight in the slice gets out 0 and lse -inf.
Results over disjoint key slices merge exactly by lse; a slice holding every key the rows reach
gives bitwise the rows of the whole sequence (context parallelism: poslsh.distributed).
)doc";

const char* const slice_backward_doc = R"doc(
query_offset=, key_offset= (one sequence; methods 'exact_tiled' and 'exact_banded', any window,
and 'lsh_fused', 'lsh_per_sample' and 'fixed_blocks', their queries among their keys:
method_names(has_slice_backward=True)):
the gradients of a slice, poslsh::multihead_attention_slice_backward: the m queries of q at
positions query_offset .. query_offset + m - 1 (unset: the last m of the keys' positions)
against the L keys of k and v at positions key_offset .. key_offset + L - 1 (unset: 0), with
out and lse (H_q x m) the forward's rows over every key the rows see
(multihead_attention_with_lse with the same offsets, or slices merged by lse):

    P_ij = e^{x_ij - lse_i},  x_ij = tau q_i.k_j - |i - j| / sigma_h,  D_i = dout_i . out_i,
    dv_j += sum_i P_ij dout_i,  dS_ij = P_ij (dout_i . v_j - D_i),
    dq_i += tau sum_j dS_ij k_j,  dk_j += tau sum_i dS_ij q_i,  dslopes[h] += -sum_ij dS_ij |i - j|

(positions i, j; causal mask, band and window at those positions; the LSH methods: P_ij =
c_ij e^{tau q_i.k_j - lse_i}, c_ij the sample counts of the positions' bins, computed each pair
once as lsh_fused's backward does, equal to the per-sample backward to rounding): added to the
given dq=, dk=, dv= and dslopes= (H_q entries; exact methods), new gradient arrays starting at
zero.

cu_seqlens_k= (with cu_seqlens; methods with a slice backward, the LSH ones with no sequence of
more queries than keys): the gradients of a
packed batch whose sequences may have fewer or more queries than keys,
poslsh::multihead_attention_varlen_slice_backward: sequence b's queries are tokens
cu_seqlens[b] .. of q, out, dout and lse over its keys cu_seqlens_k[b] .. of k and v, placed as
multihead_attention_with_lse(..., cu_seqlens, cu_seqlens_k) places them (bottom-right), each
sequence the slice backward at its offsets. dq, dk, dv and dslopes= (H_q entries, or one per
sequence and query head with sigmas of each) are written.
)doc";

const char* const multihead_backward_doc = R"doc(
Gradients of multihead_attention, (dq, dk, dv), from the forward's out and lse
(multihead_attention_with_lse with the same inputs and keywords) and dout = dL/dout. For each
query head h (K/V head g = h // G), with P_h the probabilities recomputed from lse[h]
(P_ij = w_ij e^{x_ij - lse_i}, the method's scores and weights as in
multihead_attention_with_lse) and D_i = dout_i . out_i:

    dV_h = P_h^T dO_h,  dS_h = P_h o (dO_h V_g^T - D),  dq_h = tau dS_h K_g,  dK_h = tau dS_h^T Q_h
    dk_g = sum_{h : h // G = g} dK_h,  dv_g = sum_{h : h // G = g} dV_h   (in increasing h)

q, dq [n, H_q, d]; k, dk [n, H_kv, d]; v, dv [n, H_kv, d_v]; out, dout [n, H_q, d_v] in
layout 'nhd' ([H, n, d] in 'hnd'); lse [H_q, n]. dq=, dk=, dv=: optional outputs written in
place (any strides on the first two axes); new arrays otherwise. No n x n buffer. Bitwise the
single-head backward of each head (summed over a group in head order), for any thread count.
Self-attention only; the GIL is released. cu_seqlens=: a packed batch, as
in multihead_attention_with_lse (the forward's cu_seqlens); each sequence's gradients are
those of its own call, none crosses sequences. sigmas= may hold one sigma per sequence and
query head (B * H_q entries, sequence-major) with cu_seqlens. dslopes= (float64 array of H_q
entries, or one per sigma when they are per sequence; contiguous, written in place; methods
exact_tiled and exact_banded only): the gradients in the ALiBi slopes slope_h = 1 / sigma_h,

    dslopes[h] = dL/dslope_h = -sum_ij dS_h,ij |i - j|   (dS_h = P_h o (dO_h V_g^T - D))

over the pairs of the head's window (summed over the sequences of a packed batch), from the
same tiles as the other gradients (which are unchanged by it), bitwise the same for any thread
count. window=(left, right): the local window of the forward (exact methods).

method='mean_of_outputs' (the mean over the samples of plain attention on each sample's
blocks, which has no lse): out and lse are not read (any arrays of their shapes; each sample's
attention and lse are recomputed), the gradients are the single-head
lsh_attention_mean_of_outputs_backward of each head (half-precision inputs widened to float32
copies of the head: the float32 backward of the widened inputs).

position= (one sequence, no dslopes): the n tokens are a window of a longer sequence at
positions position .. position + n - 1, out and lse that sequence's forward rows; only the
pairs inside the window count, bias, masks and LSH bins at the absolute positions. A row (key)
whose pairs of nonzero weight all lie in the window gets the whole sequence's gradient, bitwise
when position is a multiple of 64.
)doc";

/// The dslopes= output of multihead_attention_backward: unset for None, otherwise a map of
/// a writable, contiguous float64 array of `heads` entries (one per sigma) (TypeError /
/// ValueError naming 'dslopes' otherwise).
std::optional<Eigen::Map<Eigen::VectorXd>> slope_gradients(py::handle dslopes, Index heads,
                                                           const char* function) {
  if (dslopes.is_none()) return std::nullopt;
  if (!py::isinstance<py::array>(dslopes) ||
      !py::reinterpret_borrow<py::array>(dslopes).dtype().is(py::dtype::of<double>()))
    throw py::type_error(argument(function, "dslopes") + " must be a float64 numpy array");
  const py::array array = py::reinterpret_borrow<py::array>(dslopes);
  if (!array.writeable()) throw py::value_error(argument(function, "dslopes") + " is read-only");
  return Eigen::Map<Eigen::VectorXd>(
      vector_data<double>(array, heads, function, "dslopes", "query head"), heads);
}

}  // namespace

void register_training(py::module_& module) {
  // The forward with lse and the backward of every method's single-head kernel, or its forward
  // and backward for a method without lse.
  poslsh::for_each_single_head_kernels([&](auto row) {
    using Row = decltype(row);
    if constexpr (poslsh::method_has_lse(Row::method))
      def_training<Row>(module, typename Row::parameters{});
    else
      def_without_lse<Row>(module, typename Row::parameters{});
  });

  def_multihead(
      module, "multihead_attention_with_lse",
      [](py::handle q, py::handle k, py::handle v, const std::string& layout_name,
         const std::string& method, const std::string& masking, std::optional<double> scale,
         std::optional<std::vector<double>> sigmas, Index samples, std::uint64_t seed,
         double band_error, std::pair<Index, Index> window, py::handle out, py::handle lse,
         py::handle cu_seqlens, py::handle cu_seqlens_k, std::optional<Index> query_offset,
         std::optional<Index> key_offset, std::optional<int> threads,
         const std::string& precision) {
        const bool slice = query_offset || key_offset;
        const Batch batch =
            batch_of(cu_seqlens, slice ? "multihead_attention_slice" : "multihead_attention",
                     "multihead_attention_varlen");
        if (slice && batch.cu_seqlens)
          throw py::value_error(argument(batch.function, "query_offset") +
                                "/key_offset take one sequence: give no cu_seqlens");
        std::optional<std::vector<std::int32_t>> cu_k;
        if (!cu_seqlens_k.is_none()) {
          if (!batch.cu_seqlens)
            throw py::value_error(argument(batch.function, "cu_seqlens_k") +
                                  " is given without cu_seqlens (the queries' offsets)");
          cu_k = int32_vector(cu_seqlens_k, batch.function, "cu_seqlens_k");
        }
        const char* const function = batch.function;
        HeadsKeywords keywords = heads_keywords(function, layout_name, method, masking, scale,
                                                sigmas, samples, seed, band_error, window);
        keywords.options.precision = precision_of(precision, function);
        threads = thread_count(threads, function);
        return dispatch<DtypeSet::with_half>(function, {q}, [&](auto types) -> py::object {
          using T = typename decltype(types)::q;
          const HeadsInputs<Types<T>> in =
              heads_inputs<Types<T>>(function, q, k, v, keywords.layout);
          const Inputs inputs = {{q, "q"}, {k, "k"}, {v, "v"}};
          auto output = heads_output<T>(out, keywords.layout, in.q.tokens, in.q.heads, in.v.dim,
                                        function, "out", "q", inputs);
          // A pair, not a structured binding: the lambda below captures the map (C++17).
          auto lse_pair = lse_matrix<T>(lse, in.q.heads, in.q.tokens, function, true,
                                        {{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}});
          py::object& lse_result = lse_pair.first;
          auto& lse_map = lse_pair.second;
          Index p0 = 0;
          if (slice) {
            // Unset query_offset: the last m positions of the keys (bottom-right).
            p0 = query_offset ? *query_offset : key_offset.value_or(0) + in.k.tokens - in.q.tokens;
          }
          run_kernel(threads, [&] {
            if (slice)
              poslsh::multihead_attention_slice<T>(in.q, in.k, in.v, output.view, lse_map, p0,
                                                   key_offset.value_or(0), keywords.options);
            else if (cu_k)
              poslsh::multihead_attention_varlen_with_lse<T>(in.q, in.k, in.v, output.view, lse_map,
                                                             *batch.cu_seqlens, *cu_k,
                                                             keywords.options);
            else if (batch.cu_seqlens)
              poslsh::multihead_attention_varlen<T>(in.q, in.k, in.v, output.view, lse_map,
                                                    *batch.cu_seqlens, keywords.options);
            else
              poslsh::multihead_attention_with_lse<T>(in.q, in.k, in.v, output.view, lse_map,
                                                      keywords.options);
          });
          return py::make_tuple(output.result, lse_result);
        });
      },
      std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v")),
      std::make_tuple(py::arg("out") = py::none(), py::arg("lse") = py::none(),
                      py::arg("cu_seqlens") = py::none(), py::arg("cu_seqlens_k") = py::none(),
                      py::arg("query_offset") = py::none(), py::arg("key_offset") = py::none(),
                      py::arg("num_threads") = py::none(),
                      py::arg("precision") = default_precision()),
      (std::string(with_lse_doc) + training_dtypes_doc).c_str());

  def_multihead(
      module, "multihead_attention_backward",
      [](py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse, py::handle dout,
         const std::string& layout_name, const std::string& method, const std::string& masking,
         std::optional<double> scale, std::optional<std::vector<double>> sigmas, Index samples,
         std::uint64_t seed, double band_error, std::pair<Index, Index> window, py::handle dq,
         py::handle dk, py::handle dv, py::handle cu_seqlens, py::handle cu_seqlens_k,
         py::handle dslopes, std::optional<Index> position, std::optional<Index> query_offset,
         std::optional<Index> key_offset, std::optional<int> threads,
         const std::string& precision) {
        const bool slice = query_offset || key_offset;
        const bool packed_slices = !cu_seqlens_k.is_none();
        const Batch batch = batch_of(cu_seqlens,
                                     position ? "multihead_attention_window_backward"
                                     : slice  ? "multihead_attention_slice_backward"
                                              : "multihead_attention_backward",
                                     packed_slices ? "multihead_attention_varlen_slice_backward"
                                                   : "multihead_attention_varlen_backward");
        const char* const function = batch.function;
        if (packed_slices && (!batch.cu_seqlens || position || slice))
          throw py::value_error(argument(function, "cu_seqlens_k") +
                                " needs cu_seqlens (the queries' sequences) and takes no "
                                "position, query_offset or key_offset");
        const std::optional<std::vector<std::int32_t>> cu_k =
            packed_slices ? std::optional(int32_vector(cu_seqlens_k, function, "cu_seqlens_k"))
                          : std::nullopt;
        if (position && (batch.cu_seqlens || !dslopes.is_none() || slice))
          throw py::value_error(argument(function, "position") +
                                " (a window of one sequence) takes no cu_seqlens, no dslopes and "
                                "no query_offset/key_offset");
        if (slice && batch.cu_seqlens)
          throw py::value_error(argument(function, "query_offset") +
                                "/key_offset take one sequence: give no cu_seqlens");
        threads = thread_count(threads, function);
        HeadsKeywords keywords = heads_keywords(function, layout_name, method, masking, scale,
                                                sigmas, samples, seed, band_error, window);
        keywords.options.precision = precision_of(precision, function);
        return dispatch<DtypeSet::with_half>(function, {q}, [&](auto types) -> py::object {
          using T = typename decltype(types)::q;
          using L = poslsh::backward_scalar_t<T>;
          const HeadsInputs<Types<T>> in =
              heads_inputs<Types<T>>(function, q, k, v, keywords.layout);
          const auto out_view = heads_input<T>(out, keywords.layout, function, "out", "q");
          const auto dout_view = heads_input<T>(dout, keywords.layout, function, "dout", "q");
          const auto lse_map =
              lse_matrix<T>(lse, in.q.heads, in.q.tokens, function, false, {}).second;
          Inputs inputs = {{q, "q"},     {k, "k"},     {v, "v"},
                           {out, "out"}, {lse, "lse"}, {dout, "dout"}};
          const char* const like = lse_like<T>();
          auto dq_out = heads_output<L>(dq, keywords.layout, in.q.tokens, in.q.heads, in.q.dim,
                                        function, "dq", like, inputs);
          inputs.emplace_back(dq_out.result, "dq");
          auto dk_out = heads_output<L>(dk, keywords.layout, in.k.tokens, in.k.heads, in.k.dim,
                                        function, "dk", like, inputs);
          inputs.emplace_back(dk_out.result, "dk");
          auto dv_out = heads_output<L>(dv, keywords.layout, in.v.tokens, in.v.heads, in.v.dim,
                                        function, "dv", like, inputs);
          // A slice's gradients are added to dq, dk, dv: new arrays start at zero (the packed
          // slices write theirs).
          const auto zero_new = [&](const py::object& result, py::handle given) {
            if (!slice || !given.is_none()) return;
            py::array array = py::reinterpret_borrow<py::array>(result);
            std::memset(array.mutable_data(), 0, static_cast<std::size_t>(array.nbytes()));
          };
          zero_new(dq_out.result, dq);
          zero_new(dk_out.result, dk);
          zero_new(dv_out.result, dv);
          const poslsh::ConstMatrixRef<L> lse_ref(lse_map);
          // One slope per query head, or per sequence and query head with sigmas of each (the
          // library checks which).
          const Index slopes = keywords.options.sigmas.empty()
                                   ? in.q.heads
                                   : static_cast<Index>(keywords.options.sigmas.size());
          const std::optional<Eigen::Map<Eigen::VectorXd>> dslopes_map =
              slope_gradients(dslopes, slopes, function);
          const std::vector<std::int32_t> whole = {0, static_cast<std::int32_t>(in.q.tokens)};
          const std::vector<std::int32_t>& cu = batch.cu_seqlens ? *batch.cu_seqlens : whole;
          // Unset query_offset: the last m positions of the keys (bottom-right).
          const Index p0 =
              query_offset.value_or(key_offset.value_or(0) + in.k.tokens - in.q.tokens);
          run_kernel(threads, [&] {
            if (cu_k) {
              std::optional<Eigen::Map<Eigen::VectorXd>> slopes_map = dslopes_map;
              std::optional<Eigen::Ref<Eigen::VectorXd>> slopes_ref;
              if (slopes_map) slopes_ref.emplace(*slopes_map);
              poslsh::multihead_attention_varlen_slice_backward<T>(
                  in.q, in.k, in.v, out_view, lse_ref, dout_view, cu, *cu_k, dq_out.view,
                  dk_out.view, dv_out.view, keywords.options, slopes_ref ? &*slopes_ref : nullptr);
            } else if (position)
              poslsh::multihead_attention_window_backward<T>(
                  in.q, in.k, in.v, out_view, lse_ref, dout_view, dq_out.view, dk_out.view,
                  dv_out.view, *position, keywords.options);
            else if (slice && dslopes_map)
              poslsh::multihead_attention_slice_backward<T>(
                  in.q, in.k, in.v, out_view, lse_ref, dout_view, dq_out.view, dk_out.view,
                  dv_out.view, *dslopes_map, p0, key_offset.value_or(0), keywords.options);
            else if (slice)
              poslsh::multihead_attention_slice_backward<T>(
                  in.q, in.k, in.v, out_view, lse_ref, dout_view, dq_out.view, dk_out.view,
                  dv_out.view, p0, key_offset.value_or(0), keywords.options);
            else if (dslopes_map)
              poslsh::multihead_attention_varlen_backward<T>(
                  in.q, in.k, in.v, out_view, lse_ref, dout_view, cu, dq_out.view, dk_out.view,
                  dv_out.view, *dslopes_map, keywords.options);
            else if (batch.cu_seqlens)
              poslsh::multihead_attention_varlen_backward<T>(
                  in.q, in.k, in.v, out_view, lse_ref, dout_view, cu, dq_out.view, dk_out.view,
                  dv_out.view, keywords.options);
            else
              poslsh::multihead_attention_backward<T>(in.q, in.k, in.v, out_view, lse_ref,
                                                      dout_view, dq_out.view, dk_out.view,
                                                      dv_out.view, keywords.options);
          });
          return py::make_tuple(dq_out.result, dk_out.result, dv_out.result);
        });
      },
      std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
                      py::arg("dout")),
      std::make_tuple(py::arg("dq") = py::none(), py::arg("dk") = py::none(),
                      py::arg("dv") = py::none(), py::arg("cu_seqlens") = py::none(),
                      py::arg("cu_seqlens_k") = py::none(), py::arg("dslopes") = py::none(),
                      py::arg("position") = py::none(), py::arg("query_offset") = py::none(),
                      py::arg("key_offset") = py::none(), py::arg("num_threads") = py::none(),
                      py::arg("precision") = default_precision()),
      (std::string(multihead_backward_doc) + slice_backward_doc + training_dtypes_doc).c_str());
}

}  // namespace poslsh_python
