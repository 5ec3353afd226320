/// \file
/// \brief The single-head kernels of each method, one row per Method next to the forward table
/// (MethodKernels, poslsh/multihead/methods.hpp) and the backward table (MethodBackward,
/// poslsh/multihead/training.hpp): the name of the method's single-head function, the
/// parameters it takes after q, k, v, and its forward, forward with lse and backward.
///
/// A row SingleHeadKernels<M> holds
///   method            M;
///   function          the single-head forward's name ("alibi_attention_tiled"); the forward
///                     with lse and the backward are function + "_with_lse" and "_backward";
///   parameters        KernelParameters<P...>: the kernel's arguments after q, k, v, each P a
///                     SigmaParameter, BandParameter or HashesParameter (a C++ type and a name);
///   forward<S...>(q, k, v, parameters..., out, options), the forward (S: the scalar types the
///                     function takes as template arguments);
/// and, for a method with a log-sum-exp (method_has_lse),
///   forward_with_lse<S>(q, k, v, parameters..., out, lse, options),
///   backward<S>(q, k, v, parameters..., out, lse, dout, dq, dk, dv, options);
/// without one (mean_of_outputs),
///   backward<S>(q, k, v, parameters..., dout, dq, dk, dv, options).
/// Each member calls the method's public single-head function with its arguments unchanged, so
/// a caller reaching a kernel through its row (visit_single_head_kernels,
/// for_each_single_head_kernels: the Python bindings) gets bitwise the function's results.
#pragma once

#include <utility>

#include "poslsh/attention/banded.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/attention/per_sample.hpp"
#include "poslsh/attention/tiled.hpp"
#include "poslsh/core/types.hpp"
#include "poslsh/lsh/hash.hpp"
#include "poslsh/multihead/methods.hpp"
#include "poslsh/training/backward.hpp"
#include "poslsh/training/mean_of_outputs.hpp"

namespace poslsh {

/// sigma: the length scale of the ALiBi bias (exact methods) or of the fixed blocks.
struct SigmaParameter {
  using type = double;
  static constexpr const char* name = "sigma";
};

/// band: the half-width W of the banded kernels' band |i - j| <= W.
struct BandParameter {
  using type = Index;
  static constexpr const char* name = "band";
};

/// hashes: the samples of the LSH estimators.
struct HashesParameter {
  using type = HashSet;
  static constexpr const char* name = "hashes";
};

/// The parameters of a single-head kernel after q, k, v, in order.
template <typename... Parameters>
struct KernelParameters {};

template <Method M>
struct SingleHeadKernels;

template <>
struct SingleHeadKernels<Method::exact_tiled> {
  static constexpr Method method = Method::exact_tiled;
  static constexpr const char* function = "alibi_attention_tiled";
  using parameters = KernelParameters<SigmaParameter>;

  template <typename... S, typename... Arguments>
  static void forward(Arguments&&... arguments) {
    alibi_attention_tiled<S...>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void forward_with_lse(Arguments&&... arguments) {
    alibi_attention_tiled_with_lse<S>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void backward(Arguments&&... arguments) {
    alibi_attention_tiled_backward<S>(std::forward<Arguments>(arguments)...);
  }
};

template <>
struct SingleHeadKernels<Method::exact_banded> {
  static constexpr Method method = Method::exact_banded;
  static constexpr const char* function = "alibi_attention_banded";
  using parameters = KernelParameters<SigmaParameter, BandParameter>;

  template <typename... S, typename... Arguments>
  static void forward(Arguments&&... arguments) {
    alibi_attention_banded<S...>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void forward_with_lse(Arguments&&... arguments) {
    alibi_attention_banded_with_lse<S>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void backward(Arguments&&... arguments) {
    alibi_attention_banded_backward<S>(std::forward<Arguments>(arguments)...);
  }
};

template <>
struct SingleHeadKernels<Method::lsh_fused> {
  static constexpr Method method = Method::lsh_fused;
  static constexpr const char* function = "lsh_attention_fused";
  using parameters = KernelParameters<HashesParameter>;

  template <typename... S, typename... Arguments>
  static void forward(Arguments&&... arguments) {
    lsh_attention_fused<S...>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void forward_with_lse(Arguments&&... arguments) {
    lsh_attention_fused_with_lse<S>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void backward(Arguments&&... arguments) {
    lsh_attention_fused_backward<S>(std::forward<Arguments>(arguments)...);
  }
};

template <>
struct SingleHeadKernels<Method::lsh_per_sample> {
  static constexpr Method method = Method::lsh_per_sample;
  static constexpr const char* function = "lsh_attention_per_sample";
  using parameters = KernelParameters<HashesParameter>;

  template <typename... S, typename... Arguments>
  static void forward(Arguments&&... arguments) {
    lsh_attention_per_sample<S...>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void forward_with_lse(Arguments&&... arguments) {
    lsh_attention_per_sample_with_lse<S>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void backward(Arguments&&... arguments) {
    lsh_attention_per_sample_backward<S>(std::forward<Arguments>(arguments)...);
  }
};

template <>
struct SingleHeadKernels<Method::fixed_blocks> {
  static constexpr Method method = Method::fixed_blocks;
  static constexpr const char* function = "fixed_blocks_attention";
  using parameters = KernelParameters<SigmaParameter>;

  template <typename... S, typename... Arguments>
  static void forward(Arguments&&... arguments) {
    fixed_blocks_attention<S...>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void forward_with_lse(Arguments&&... arguments) {
    fixed_blocks_attention_with_lse<S>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void backward(Arguments&&... arguments) {
    fixed_blocks_attention_backward<S>(std::forward<Arguments>(arguments)...);
  }
};

/// mean_of_outputs: no log-sum-exp, so no forward with lse, and a backward from dout alone
/// (it recomputes each sample's attention); float and double only, self-attention.
template <>
struct SingleHeadKernels<Method::mean_of_outputs> {
  static constexpr Method method = Method::mean_of_outputs;
  static constexpr const char* function = "lsh_attention_mean_of_outputs";
  using parameters = KernelParameters<HashesParameter>;

  template <typename S, typename... Arguments>
  static void forward(Arguments&&... arguments) {
    lsh_attention_mean_of_outputs<S>(std::forward<Arguments>(arguments)...);
  }
  template <typename S, typename... Arguments>
  static void backward(Arguments&&... arguments) {
    lsh_attention_mean_of_outputs_backward<S>(std::forward<Arguments>(arguments)...);
  }
};

/// visitor(SingleHeadKernels<method>{}): the single-head row of a run-time Method.
template <typename Visitor>
constexpr decltype(auto) visit_single_head_kernels(Method method, Visitor&& visitor) {
  return detail::visit_method_row<SingleHeadKernels>(method, std::forward<Visitor>(visitor));
}

/// visitor(SingleHeadKernels<method>{}) for every method of the table, in declaration order.
template <typename Visitor>
void for_each_single_head_kernels(Visitor&& visitor) {
  for (const Method method : enum_values<Method>()) visit_single_head_kernels(method, visitor);
}

}  // namespace poslsh
