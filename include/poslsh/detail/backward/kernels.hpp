// poslsh internals: the register-blocked packet kernels of the backward passes
// (detail/backward/tiles.hpp), built on the forward's register block (tile_accumulate_block,
// detail/tile/kernels.hpp) and its transposed score kernel. Two shapes:
//   scores (transposed):  S^T[b][a] = sum_c X^T[c][a] Y[b][c]   (S = Q K^T and dP = dO V^T)
//   products:             acc[r][:] += sum_t W(r, t) values[t][:]
// where W(r, t) = weights[r * row_step + t * sum_step] is read from a tile stored either way
// (dV += P^T dO and dK += dS^T Q sum over queries, dQ += dS K over keys). A product sums its
// terms in increasing t in registers, starting from zero, and adds the sum to acc once.
#pragma once

#include <Eigen/Core>
#include <algorithm>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/tile/kernels.hpp"
#include "poslsh/detail/tile/types.hpp"

namespace poslsh::detail {

/// Query rows and keys of one tile pair of the backward pass; the transposed tiles (S^T, P^T,
/// dS^T) are stored key by key with a stride of backward_step_rows.
inline constexpr Index backward_step_rows = tile_query_rows;

/// out[kk * backward_step_rows + p P ...] = sum_{c < d} xt[c * backward_step_rows + p P ...]
/// y[kk * y_stride + c] for kk < Keys, p < Packets (xt and out aligned). Not inlined: one
/// register block per function keeps the register allocation clean.
template <typename Scalar, int Keys, int Packets>
EIGEN_DONT_INLINE void backward_score_block(const Scalar* xt, const Scalar* y, Index y_stride,
                                            Index d, Scalar* out) {
  namespace ei = Eigen::internal;
  constexpr Index P = tile_packet_size<Scalar>;
  TilePacket<Scalar> acc[Keys][Packets];
  tile_score_block<Scalar, Keys, Packets>(xt, backward_step_rows, y, y_stride, d, acc);
  POSLSH_TILE_UNROLL
  for (int kk = 0; kk < Keys; ++kk) {
    POSLSH_TILE_UNROLL
    for (int p = 0; p < Packets; ++p) ei::pstore(out + kk * backward_step_rows + p * P, acc[kk][p]);
  }
}

/// Keys [b, end) of y against `Packets` packets of xt from column a (register blocks of
/// Keys keys, then halved for the remainder).
template <typename Scalar, int Keys, int Packets>
void backward_score_keys(const Scalar* xt, const Scalar* y, Index y_stride, Index d, Index b,
                         Index end, Scalar* out) {
  for (; b + Keys <= end; b += Keys)
    backward_score_block<Scalar, Keys, Packets>(xt, y + b * y_stride, y_stride, d,
                                                out + b * backward_step_rows);
  if constexpr (Keys > 1)
    backward_score_keys<Scalar, Keys / 2, Packets>(xt, y, y_stride, d, b, end, out);
}

/// out[b * backward_step_rows + a] = sum_{c < d} xt[c * backward_step_rows + a] y[b * y_stride + c]
/// for keys b in [b0, b1) and the query packets [0, packets) (xt holds X^T, d x
/// backward_step_rows, aligned; out aligned): groups of up to 4 packets, in the register blocks
/// of tile_score_shape.
template <typename Scalar>
void backward_scores(const Scalar* xt, const Scalar* y, Index y_stride, Index d, Index b0, Index b1,
                     Index packets, Scalar* out) {
  constexpr Index P = tile_packet_size<Scalar>;
  for (Index p = 0; p < packets; p += 4) {
    const Scalar* x = xt + p * P;
    Scalar* o = out + p * P;
    tile_score_shape(packets - p, [&](auto keys, auto group) {
      backward_score_keys<Scalar, decltype(keys)::value, decltype(group)::value>(x, y, y_stride, d,
                                                                                 b0, b1, o);
    });
  }
}

/// acc[r * acc_stride + p P ...] += sum_{t < count} weights[r * row_step + t * sum_step]
/// values[t * value_stride + p P ...] for r < Rows, p < Packets: the sum is formed in registers
/// from zero in increasing t (one FMA per term), then added to acc. acc aligned; values read
/// unaligned (the backward packs them contiguous and aligned).
template <typename Scalar, int Rows, int Packets>
EIGEN_DONT_INLINE void backward_product_block(const Scalar* weights, Index row_step, Index sum_step,
                                              const Scalar* values, Index value_stride, Index count,
                                              Scalar* acc, Index acc_stride) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  constexpr Index P = tile_packet_size<Scalar>;
  Packet sum[Rows][Packets];
  tile_clear_block<Scalar>(sum);
  tile_accumulate_block<Scalar, Rows, Packets, false>(weights, row_step, sum_step, values,
                                                      value_stride, count, sum);
  POSLSH_TILE_UNROLL
  for (int r = 0; r < Rows; ++r) {
    POSLSH_TILE_UNROLL
    for (int p = 0; p < Packets; ++p) {
      Scalar* target = acc + r * acc_stride + p * P;
      ei::pstore(target, ei::padd(ei::pload<Packet>(target), sum[r][p]));
    }
  }
}

/// backward_product_block for `Rows` rows over all `packets` packets of columns, in blocks of
/// up to tile_row_block_packets packets (as the forward's value blocks), the last one narrower.
template <typename Scalar, int Rows, int Packets = tile_row_block_packets>
void backward_product_rows(const Scalar* weights, Index row_step, Index sum_step,
                           const Scalar* values, Index value_stride, Index count, Index packets,
                           Scalar* acc, Index acc_stride) {
  constexpr Index P = tile_packet_size<Scalar>;
  Index p = 0;
  for (; p + Packets <= packets; p += Packets)
    backward_product_block<Scalar, Rows, Packets>(weights, row_step, sum_step, values + p * P,
                                                  value_stride, count, acc + p * P, acc_stride);
  if constexpr (Packets > 1) {
    if (p < packets)
      backward_product_rows<Scalar, Rows, Packets - 1>(weights, row_step, sum_step, values + p * P,
                                                       value_stride, count, packets - p,
                                                       acc + p * P, acc_stride);
  }
}

/// acc[r][:] += sum_{t in terms(r0, r1)} weights[r * row_step + t * sum_step] values[t][:] for
/// rows r < rows, in blocks [r0, r1) of tile_row_block_rows rows (then single rows), each over the
/// terms `terms(r0, r1)` (a KeyRange: every term any row of the block needs; the others' weights
/// there must be 0). `packets` packets of columns; acc aligned.
template <typename Scalar, typename Terms>
void backward_products(const Scalar* weights, Index row_step, Index sum_step, const Scalar* values,
                       Index value_stride, Index rows, Index packets, Scalar* acc, Index acc_stride,
                       Terms&& terms) {
  constexpr Index R = tile_row_block_rows;
  Index r = 0;
  for (; r + R <= rows; r += R) {
    const KeyRange t = terms(r, r + R);
    if (t.first >= t.last) continue;
    backward_product_rows<Scalar, static_cast<int>(R)>(
        weights + r * row_step + t.first * sum_step, row_step, sum_step,
        values + t.first * value_stride, value_stride, t.last - t.first, packets,
        acc + r * acc_stride, acc_stride);
  }
  for (; r < rows; ++r) {
    const KeyRange t = terms(r, r + 1);
    if (t.first >= t.last) continue;
    backward_product_rows<Scalar, 1>(weights + r * row_step + t.first * sum_step, row_step,
                                     sum_step, values + t.first * value_stride, value_stride,
                                     t.last - t.first, packets, acc + r * acc_stride, acc_stride);
  }
}

}  // namespace poslsh::detail
