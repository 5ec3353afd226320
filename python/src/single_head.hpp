// poslsh Python bindings: the single-head kernels of each method (poslsh::Method), the one
// switch from a method to its forward and backward kernels for attention.cpp (the kernels)
// and training.cpp (their forwards with lse and their backward passes).
#pragma once

#include "poslsh/attention/banded.hpp"
#include "poslsh/attention/fused.hpp"
#include "poslsh/attention/per_sample.hpp"
#include "poslsh/attention/tiled.hpp"
#include "poslsh/multihead/methods.hpp"
#include "poslsh/training/backward.hpp"

namespace poslsh_python {

/// Which kernel of a method: the forward, the forward with lse or the backward.
enum class Pass { forward, forward_with_lse, backward };

/// Runs the single-head kernel of method M for pass P with the scalar types S (Q, KV, Out; or
/// one type) on the arguments:
///   exact_tiled   alibi_attention_tiled, alibi_attention_tiled_backward
///   exact_banded  alibi_attention_banded, alibi_attention_banded_backward
///   lsh_fused     lsh_attention_fused, lsh_attention_fused_backward
///   lsh_per_sample lsh_attention_per_sample, lsh_attention_per_sample_backward
///   fixed_blocks  fixed_blocks_attention, fixed_blocks_attention_backward
template <poslsh::Method M, Pass P, typename... S, typename... Arguments>
void single_head(const Arguments&... arguments) {
  using poslsh::Method;
  constexpr bool forward = P == Pass::forward;
  constexpr bool with_lse = P == Pass::forward_with_lse;
  if constexpr (M == Method::exact_tiled && forward) {
    poslsh::alibi_attention_tiled<S...>(arguments...);
  } else if constexpr (M == Method::exact_tiled && with_lse) {
    poslsh::alibi_attention_tiled_with_lse<S...>(arguments...);
  } else if constexpr (M == Method::exact_tiled) {
    poslsh::alibi_attention_tiled_backward<S...>(arguments...);
  } else if constexpr (M == Method::exact_banded && forward) {
    poslsh::alibi_attention_banded<S...>(arguments...);
  } else if constexpr (M == Method::exact_banded && with_lse) {
    poslsh::alibi_attention_banded_with_lse<S...>(arguments...);
  } else if constexpr (M == Method::exact_banded) {
    poslsh::alibi_attention_banded_backward<S...>(arguments...);
  } else if constexpr (M == Method::lsh_fused && forward) {
    poslsh::lsh_attention_fused<S...>(arguments...);
  } else if constexpr (M == Method::lsh_fused && with_lse) {
    poslsh::lsh_attention_fused_with_lse<S...>(arguments...);
  } else if constexpr (M == Method::lsh_fused) {
    poslsh::lsh_attention_fused_backward<S...>(arguments...);
  } else if constexpr (M == Method::lsh_per_sample && forward) {
    poslsh::lsh_attention_per_sample<S...>(arguments...);
  } else if constexpr (M == Method::lsh_per_sample && with_lse) {
    poslsh::lsh_attention_per_sample_with_lse<S...>(arguments...);
  } else if constexpr (M == Method::lsh_per_sample) {
    poslsh::lsh_attention_per_sample_backward<S...>(arguments...);
  } else if constexpr (M == Method::fixed_blocks && forward) {
    poslsh::fixed_blocks_attention<S...>(arguments...);
  } else if constexpr (M == Method::fixed_blocks && with_lse) {
    poslsh::fixed_blocks_attention_with_lse<S...>(arguments...);
  } else {
    static_assert(M == Method::fixed_blocks, "a method of poslsh::Method");
    poslsh::fixed_blocks_attention_backward<S...>(arguments...);
  }
}

}  // namespace poslsh_python
