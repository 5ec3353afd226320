// poslsh: strided views of the H heads of an attention tensor, without copies (HeadsView, with
// the [n, H, d] and [H, n, d] layouts as interleaved_heads and planar_heads).
#pragma once

#include <string>
#include <type_traits>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// H heads of n tokens of width d in one buffer: element (head h, token i, column c) is
/// data[h * head_stride + i * row_stride + c]. `Element` is `const Scalar` for inputs and
/// `Scalar` for outputs. [n, H, d] (KV-cache order) is row_stride = H d, head_stride = d;
/// [H, n, d] is row_stride = d, head_stride = n d.
template <typename Element>
struct HeadsView {
  using Scalar = std::remove_const_t<Element>;
  using HeadMap = Eigen::Map<
      std::conditional_t<std::is_const_v<Element>, const RowMatrix<Scalar>, RowMatrix<Scalar>>, 0,
      Eigen::OuterStride<>>;

  Element* data = nullptr;
  Index tokens = 0;
  Index heads = 0;
  Index dim = 0;
  Index row_stride = 0;
  Index head_stride = 0;

  /// Head h as an (n x d) row-major map.
  HeadMap head(Index h) const {
    return HeadMap(data + h * head_stride, tokens, dim, Eigen::OuterStride<>(row_stride));
  }

  /// Checks the view: sizes >= 0 (heads >= 1), a non-null buffer when non-empty,
  /// row_stride >= d, and heads that do not overlap rows (head_stride >= d). An output view
  /// (Element not const) must also address each element once: head_stride >= tokens *
  /// row_stride (heads one after the other, as [H, n, d]) or row_stride >= heads * head_stride
  /// (heads interleaved in each row, as [n, H, d]); otherwise heads written in parallel would
  /// overwrite each other. Throws std::invalid_argument from `function` naming the bad field
  /// as `name`.field (e.g. 'out.head_stride'). It cannot check that the buffer holds every
  /// element the view addresses, nor the values in it (NaN entries are not scanned).
  void validate(const char* function, const char* name) const {
    // The field's name and the rule are written out only for a failing check.
    const auto check = [&](bool condition, const char* field, const auto& value, const auto& rule) {
      if (!condition)
        detail::throw_invalid(function, (std::string(name) + "." + field).c_str(),
                              detail::when_failing(value), detail::when_failing(rule));
    };
    check(tokens >= 0, "tokens", tokens, "must be >= 0");
    check(heads >= 1, "heads", heads, "must be >= 1");
    check(dim >= 0, "dim", dim, "must be >= 0");
    check(tokens == 0 || dim == 0 || data != nullptr, "data", "null", "must point at the buffer");
    check(row_stride >= dim, "row_stride", row_stride,
          [&] { return "must be >= dim = " + std::to_string(dim); });
    check(heads == 1 || head_stride >= dim, "head_stride", head_stride,
          [&] { return "must be >= dim = " + std::to_string(dim); });
    if constexpr (!std::is_const_v<Element>) {
      const bool disjoint = heads == 1 || tokens <= 1 || dim == 0 ||
                            head_stride >= tokens * row_stride || row_stride >= heads * head_stride;
      check(disjoint, "head_stride", head_stride, [&] {
        return "output heads overlap: need head_stride >= tokens * row_stride = " +
               std::to_string(tokens * row_stride) +
               " or row_stride >= heads * head_stride = " + std::to_string(heads * head_stride);
      });
    }
  }
};

/// View of an [n, H, d] buffer (token-major, as in KV caches).
template <typename Element>
HeadsView<Element> interleaved_heads(Element* data, Index tokens, Index heads, Index dim) {
  return HeadsView<Element>{data, tokens, heads, dim, heads * dim, dim};
}

/// View of an [H, n, d] buffer (head-major).
template <typename Element>
HeadsView<Element> planar_heads(Element* data, Index tokens, Index heads, Index dim) {
  return HeadsView<Element>{data, tokens, heads, dim, dim, tokens * dim};
}

namespace detail {

/// Checks a view `name` (validate) and its sizes: tokens x heads x dim. Throws
/// std::invalid_argument naming the view or its bad field.
template <typename Element>
void require_view_shape(const char* function, const char* name, const HeadsView<Element>& view,
                        Index tokens, Index heads, Index dim) {
  view.validate(function, name);
  require(
      view.tokens == tokens && view.heads == heads && view.dim == dim, function, name,
      [&] {
        return std::to_string(view.tokens) + "x" + std::to_string(view.heads) + "x" +
               std::to_string(view.dim);
      },
      [&] {
        return "must be " + std::to_string(tokens) + "x" + std::to_string(heads) + "x" +
               std::to_string(dim) + " (tokens x heads x dim)";
      });
}

}  // namespace detail

/// The all-heads views of backward_scalar_t<Scalar> (core/types.hpp) that a forward with lse or
/// a backward pass on [n, H, d] views of Scalar takes: the lse as H_q x n (FlashAttention's
/// softmax_lse layout: HeadsLseRef, ConstHeadsLseRef) and the gradients as [n, H, d] views
/// (GradientHeadsView).
template <typename Scalar>
using HeadsLseRef = MatrixRef<backward_scalar_t<Scalar>>;
template <typename Scalar>
using ConstHeadsLseRef = ConstMatrixRef<backward_scalar_t<Scalar>>;
template <typename Scalar>
using GradientHeadsView = HeadsView<backward_scalar_t<Scalar>>;

}  // namespace poslsh
