// poslsh: the index type, the scalar types the kernels take and compute in, the matrix views,
// masking and the attention options shared by every kernel, and the argument-checking contract
// they all follow (below).
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "poslsh/core/names.hpp"

namespace poslsh {

// Argument checking, common to every kernel: shapes (q n x d with d >= 1 when n >= 1, k and v
// with the rows and columns q implies, out n x d_v with rows that do not overlap), the options
// (scale finite, masking one of the two enumerators, query_offset in [0, L - m]), sigma
// (finite, > 0), s >= 1 and valid hashes, row ranges, decode position t; a bad argument
// throws std::invalid_argument whose message names it in single quotes with its value. Not
// checked, by design (it would cost a pass over the data): the values of q, k and v. Their
// effect:
//  - a NaN in row i of q gives a NaN in every entry of row i of the output; the other rows are
//    bitwise what they are without it (each row is computed on its own);
//  - a NaN or inf in row j of k or v gives NaN in every output row that attends to key j, and
//    possibly in other rows sharing a tile with them (masked entries are computed, then
//    dropped): a KV buffer must hold finite values in every row passed to a prefill kernel;
//  - finite inputs give finite outputs as long as the scores tau q_i.k_j are finite in Scalar
//    (any magnitude up to the Scalar range: each row's maximum is subtracted before exp).
// Also not checked: that out does not overlap q, k or v (it must not), and that input rows do
// not overlap (they may: they are only read).

/// The index type of every size and position (Eigen::Index).
using Index = Eigen::Index;

/// True for the half-precision storage types the kernels accept, Eigen::half (IEEE binary16,
/// llama.cpp's default KV cache) and Eigen::bfloat16 (most models' weights and caches): values
/// of these types are only stored; the kernels widen them to float as they load them and
/// round to them only when writing an output of that type.
template <typename T>
inline constexpr bool is_half_precision_v =
    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;

/// True for the scalar types of the kernels' Q, K, V and output views: float, double,
/// Eigen::half and Eigen::bfloat16.
template <typename T>
inline constexpr bool is_storage_scalar_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || is_half_precision_v<T>;

/// The scalar the kernels compute in for views of the given storage types: double when every
/// one is double, float otherwise (float and the half-precision types mix freely, e.g. float
/// queries over a bfloat16 KV cache). Double does not mix with the other types (a compile
/// error): the double kernels are the reference path and stay all-double.
template <typename... Storage>
struct compute_scalar {
  static_assert((is_storage_scalar_v<Storage> && ...),
                "poslsh kernels take float, double, Eigen::half or Eigen::bfloat16 views");
  static constexpr bool all_double = (std::is_same_v<Storage, double> && ...);
  static_assert(all_double || !(std::is_same_v<Storage, double> || ...),
                "double views cannot be mixed with float or half-precision views");
  using type = std::conditional_t<all_double, double, float>;
};

/// compute_scalar<Storage...>::type.
template <typename... Storage>
using compute_scalar_t = typename compute_scalar<Storage...>::type;

namespace detail {

/// T itself, in a context where a function template argument is not deduced: a kernel's
/// parameter KeyValueRef<KVScalar> takes any argument convertible to the view
/// of the given (or defaulted) KVScalar, as a non-template parameter would.
template <typename T>
struct nondeduced {
  using type = T;
};
template <typename T>
using nondeduced_t = typename nondeduced<T>::type;

}  // namespace detail

/// Row-major dynamic matrix: row i is token i.
template <typename Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Read-only (n x d) view with unit inner stride and any row stride, so the rows of an
/// [n, H, d] or [H, n, d] buffer are used without copies (Eigen::Map with OuterStride<>).
template <typename Scalar>
using ConstMatrixRef = Eigen::Ref<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

/// Writable (n x d) view with unit inner stride and any row stride.
template <typename Scalar>
using MatrixRef = Eigen::Ref<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

/// A kernel's K or V view of storage type KVScalar (ConstMatrixRef): the call does not deduce
/// KVScalar from the argument but takes it from its template arguments (by default Q's scalar
/// type), so any argument convertible to this view is accepted, as by a non-template parameter.
template <typename KVScalar>
using KeyValueRef = ConstMatrixRef<detail::nondeduced_t<KVScalar>>;

/// A kernel's output view of storage type OutScalar (MatrixRef), not deduced from the argument
/// (as KeyValueRef).
template <typename OutScalar>
using OutputRef = MatrixRef<detail::nondeduced_t<OutScalar>>;

/// Writable view of a vector (one entry per query row), e.g. the lse output.
template <typename Scalar>
using VectorRef = Eigen::Ref<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>;

/// Read-only view of a vector, e.g. the lse input of a backward pass.
template <typename Scalar>
using ConstVectorRef = Eigen::Ref<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>;

/// The scalar of the lse input and the gradient outputs of a backward pass whose q, k, v, out
/// and dout are stored as Scalar: its compute scalar, double for double, float for float,
/// Eigen::bfloat16 and Eigen::half (compute_scalar_t).
template <typename Scalar>
using backward_scalar_t = compute_scalar_t<Scalar>;

/// The views of backward_scalar_t<Scalar> that a forward with lse or a backward pass on q, k,
/// v, out and dout stored as Scalar takes: its lse output (LseRef) or input (ConstLseRef), one
/// entry per query row, and its gradient outputs dq, dk, dv (GradientRef); the all-heads
/// views are in core/heads_view.hpp.
template <typename Scalar>
using LseRef = VectorRef<backward_scalar_t<Scalar>>;
template <typename Scalar>
using ConstLseRef = ConstVectorRef<backward_scalar_t<Scalar>>;
template <typename Scalar>
using GradientRef = MatrixRef<backward_scalar_t<Scalar>>;

/// Which keys a query sees: `causal` keeps j <= i, `bidirectional` keeps every j.
enum class Masking { causal, bidirectional };

/// The names "causal" and "bidirectional" (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(Masking, causal, bidirectional);

/// How the kernels multiply half-precision inputs (scores tau q.k and the probability-weighted
/// sums of values). `matrix_units`: when Q, K and V are all Eigen::bfloat16 and the CPU has a
/// bfloat16 matrix unit (MatrixUnit, core/matrix_units.hpp), the two products of every tile run
/// on it: bfloat16 operands, products and sums in float, the probabilities rounded to bfloat16
/// before they weight the values; the bias, the count weights, the running softmax and the
/// sums stay float. Elsewhere it is `float_products`. `float_products`: every value is widened
/// exactly to float and every product and sum is float (the result is the float kernel's on
/// the widened inputs, rounded once).
enum class Precision { matrix_units, float_products };

/// The names "matrix_units" and "float_products" (enum_name, enum_from_name).
POSLSH_ENUM_NAMES(Precision, matrix_units, float_products);

/// Options common to the attention kernels.
struct AttentionOptions {
  /// Causal or bidirectional.
  Masking masking = Masking::causal;
  /// Score scale tau in A_ij = exp(tau q_i . k_j); unset means 1/sqrt(d).
  std::optional<double> scale{};
  /// Position p0 of the first query row: the m rows of q are the queries at positions
  /// p0 .. p0 + m - 1 over the L rows of k and v at positions 0 .. L - 1 (causal: key j is
  /// kept for query row r iff j <= p0 + r; the bias is -|p0 + r - j| / sigma). Requires
  /// 0 <= p0 and p0 + m <= L. Unset means bottom-right alignment, p0 = L - m (FlashAttention's
  /// convention: the queries are the last m positions; p0 = 0 for self-attention, m = L).
  /// Row r's result is bitwise the row at position p0 + r of the same kernel on all L
  /// positions, so a prompt prefilled in chunks of any size (each chunk with the keys so far,
  /// or all L keys when bidirectional) gives bitwise the rows of one prefill, and a few new
  /// tokens at the end of a cache (multi-token decode) are the same call with small m.
  std::optional<Index> query_offset{};
  /// Products of half-precision inputs: on the CPU's matrix units (the default) or in float.
  Precision precision = Precision::matrix_units;
};

}  // namespace poslsh
