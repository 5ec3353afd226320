// poslsh internals: the register-blocked packet kernels of the tile engine (exact ALiBi and
// fused LSH attention, detail/tile/engine.hpp), written with Eigen's packet primitives
// (AVX-512, AVX, SSE, NEON or scalar, whatever Eigen vectorizes for). Two shapes, both "a few
// rows times a few packets, accumulated in registers":
//   scores (transposed):  S^T[b][a] = sum_c Q^T[c][a] K[b][c]    (Keys x QueryPackets packets)
//   values:               acc[a][:] = alpha_a acc[a][:] + sum_b P^T[b][a] V[b][:]
// The query tile is stored transposed (Q^T, d x tile) so that scores come out one packet per
// group of queries: the softmax reductions over keys are then packet-wise (no horizontal
// reductions) and every query's arithmetic is independent of the other queries in its tile.
// Both are one register block, tile_accumulate_block, with the operands in different roles.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "poslsh/core/types.hpp"
#include "poslsh/detail/tile/stream_stores.hpp"

// Loops over a register block (small compile-time trip counts) must be unrolled completely,
// or the block's accumulator array is kept in memory; GCC does not always do it unasked.
#if defined(__clang__)
#define POSLSH_TILE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define POSLSH_TILE_UNROLL _Pragma("GCC unroll 32")
#else
#define POSLSH_TILE_UNROLL
#endif

namespace poslsh::detail {

template <typename Scalar>
using TilePacket = typename Eigen::internal::packet_traits<Scalar>::type;

/// Scalars per packet.
template <typename Scalar>
inline constexpr Index tile_packet_size =
    Eigen::internal::unpacket_traits<TilePacket<Scalar>>::size;

/// Vector registers of the instruction set the packet kernels are compiled for: 32 with AVX-512
/// (zmm0-zmm31) and on AArch64 (v0-v31), 16 elsewhere (x86's ymm0-ymm15 or xmm0-xmm15). The
/// register blocks below are shaped to fit in them: a block that does not fit keeps some of its
/// accumulators in memory, each multiply-add of those then a load and a store.
inline constexpr int tile_vector_registers =
#if defined(__AVX512F__) || defined(__aarch64__)
    32;
#else
    16;
#endif

/// Keys per register block of the transposed scores (tile_score_block) with `packets` packets of
/// queries (1 to 4) on a register file of `registers` vectors (16 or 32). The block's loop keeps
/// Keys x packets accumulators, one row of `packets` packets and a broadcast key element live:
///   32 registers: 16 accumulators, 16 keys x 1 packet, 8 x 2, 5 x 3, 4 x 4;
///   16 registers: 12 x 1, 6 x 2, 4 x 3, 2 x 4 (at most 16 live).
constexpr int tile_score_keys(int registers, int packets) {
  constexpr int on_16[] = {12, 6, 4, 2};
  constexpr int on_32[] = {16, 8, 5, 4};
  return (registers == 32 ? on_32 : on_16)[packets - 1];
}

/// f(std::integral_constant<int, Keys>{}, std::integral_constant<int, Packets>{}) for the
/// register block of the transposed scores of `packets` packets of queries (1 to 4; more count
/// as 4) on a register file of `Registers` vectors: Keys = tile_score_keys(Registers, Packets).
/// Every score is the same sum, in the same order, whatever the block's shape.
template <int Registers = tile_vector_registers, typename F>
EIGEN_ALWAYS_INLINE void tile_score_shape(Index packets, F&& f) {
  static_assert(Registers == 16 || Registers == 32, "register files of 16 or 32 vectors");
  const auto block = [&](auto group) {
    constexpr int keys = tile_score_keys(Registers, decltype(group)::value);
    static_assert((keys + 1) * decltype(group)::value + 1 <= Registers, "the block fits");
    f(std::integral_constant<int, keys>{}, group);
  };
  switch (packets) {
    case 1:
      return block(std::integral_constant<int, 1>{});
    case 2:
      return block(std::integral_constant<int, 2>{});
    case 3:
      return block(std::integral_constant<int, 3>{});
    default:
      return block(std::integral_constant<int, 4>{});
  }
}

/// Rows per register block of the row products (the forward's values, the backward's
/// products; the forward's value blocks take fewer where a packet holds fewer scalars).
inline constexpr int tile_row_block_rows = 4;

/// Packets of columns per register block of the row products: 4 x 4 accumulators with 32
/// registers, 4 x 2 with 16 (beside the row's packets and a broadcast weight; 4 x 3 fits too but
/// measured slower).
inline constexpr int tile_row_block_packets = tile_vector_registers == 32 ? 4 : 2;
static_assert((tile_row_block_rows + 1) * tile_row_block_packets + 1 <= tile_vector_registers,
              "the row block fits");

/// Stops the compiler from folding a packet's load into each of the FMAs that use it (which
/// would load it once per use and make the kernels load-bound): the packet is loaded once
/// into a register. No code is emitted.
template <typename Packet>
EIGEN_ALWAYS_INLINE void tile_keep_in_register(Packet& packet) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+v"(packet));
#else
  static_cast<void>(packet);
#endif
}

/// Asks the caches for rows [first, last) (`cols` scalars each, row stride `stride`) of a
/// row-major matrix, to be read (or, ForWriting, written) soon: a hint, no effect on results.
template <bool ForWriting = false, typename Scalar>
inline void tile_prefetch_rows(const Scalar* data, Index stride, Index first, Index last,
                               Index cols) {
  constexpr std::uintptr_t line = 64;
  for (Index r = first; r < last; ++r) {
    const auto begin = reinterpret_cast<std::uintptr_t>(data + r * stride) / line * line;
    const auto end = reinterpret_cast<std::uintptr_t>(data + r * stride + cols);
    for (std::uintptr_t address = begin; address < end; address += line) {
#if defined(__GNUC__)
      __builtin_prefetch(reinterpret_cast<const void*>(address), ForWriting ? 1 : 0);
#else
      Eigen::internal::prefetch(reinterpret_cast<const Scalar*>(address));
#endif
    }
  }
}

#include "poslsh/detail/disable_intrinsic_warnings.hpp"

/// dst[c * dst_stride + r] = scale * src[r * src_stride + c] for r, c < P (one packet per
/// column of dst, aligned): a P x P block transposed in registers.
template <typename Scalar>
EIGEN_ALWAYS_INLINE void tile_transpose_block(const Scalar* src, Index src_stride, Scalar* dst,
                                              Index dst_stride, Scalar scale) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  constexpr int P = static_cast<int>(tile_packet_size<Scalar>);
  ei::PacketBlock<Packet, P> block;
  POSLSH_TILE_UNROLL
  for (int r = 0; r < P; ++r) block.packet[r] = ei::ploadu<Packet>(src + r * src_stride);
  ei::ptranspose(block);
  const Packet factor = ei::pset1<Packet>(scale);
  POSLSH_TILE_UNROLL
  for (int c = 0; c < P; ++c) ei::pstore(dst + c * dst_stride, ei::pmul(block.packet[c], factor));
}

#include "poslsh/detail/restore_warnings.hpp"

/// qt (d x tile, row-major) = scale Q^T for rows [i0 + a0, i0 + a1) of q (columns a0 .. a1 of
/// qt), zero in the other columns: packet-block transposes when the tile is whole.
template <typename Scalar>
void tile_pack_queries(const ConstMatrixRef<Scalar>& q, Index i0, Index a0, Index a1, Scalar scale,
                       Scalar* qt_data, Index tile) {
  constexpr Index P = tile_packet_size<Scalar>;
  const Index d = q.cols();
  Eigen::Map<RowMatrix<Scalar>> qt(qt_data, d, tile);
  if (a0 > 0 || a1 < tile || tile % P != 0) {
    qt.setZero();
    qt.middleCols(a0, a1 - a0) = scale * q.middleRows(i0 + a0, a1 - a0).transpose();
    return;
  }
  const Index d_blocks = d / P * P;
  for (Index a = 0; a < tile; a += P) {
    const Scalar* rows = q.data() + (i0 + a) * q.outerStride();
    for (Index c = 0; c < d_blocks; c += P)
      tile_transpose_block<Scalar>(rows + c, q.outerStride(), qt_data + c * tile + a, tile, scale);
  }
  if (d_blocks < d)
    qt.bottomRows(d - d_blocks) =
        scale * q.middleRows(i0, tile).rightCols(d - d_blocks).transpose();
}

/// dst[c] = src[c] widened to Scalar (exactly: every Eigen::half and Eigen::bfloat16 value is a
/// float) for c < count; with AVX-512 or AVX2 (and F16C for Eigen::half) 16 or 8 values at a
/// time (bfloat16: the 16 bits shifted into the top of a float; half: vcvtph2ps).
template <typename Scalar, typename Storage>
inline void tile_widen(const Storage* src, Scalar* dst, Index count) {
  Index c = 0;
  if constexpr (std::is_same_v<Scalar, float>) {
    static_assert(sizeof(Storage) == 2, "a half-precision storage type");
    const auto* bits = reinterpret_cast<const std::uint16_t*>(src);
    static_cast<void>(bits);
    if constexpr (std::is_same_v<Storage, Eigen::bfloat16>) {
#if defined(__AVX512F__)
      for (; c + 16 <= count; c += 16) {
        const __m512i wide =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + c)));
        _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
      }
#elif defined(__AVX2__)
      for (; c + 8 <= count; c += 8) {
        const __m256i wide =
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + c)));
        _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
      }
#endif
    } else {
#if defined(__AVX512F__)
      for (; c + 16 <= count; c += 16)
        _mm512_storeu_ps(
            dst + c,
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + c))));
#elif defined(__F16C__) && defined(__AVX__)
      for (; c + 8 <= count; c += 8)
        _mm256_storeu_ps(
            dst + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + c))));
#endif
    }
  }
  for (; c < count; ++c) dst[c] = static_cast<Scalar>(src[c]);
}

/// dst[c] = src[c] / divisor for c < count (src and dst of any alignment). A
/// division is correctly rounded, so these are the bits of any other way of dividing. With
/// `stream` and dst aligned to a packet the packets are stored non-temporally
/// (stream_stores.hpp; the caller fences).
template <typename Scalar>
inline void tile_divide_row(const Scalar* src, Scalar divisor, Scalar* dst, Index count,
                            bool stream) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  const Packet d = ei::pset1<Packet>(divisor);
  store_row(
      dst, count, streams_row(dst, stream),
      [&](Index c) { return ei::pdiv(ei::ploadu<Packet>(src + c), d); },
      [&](Index c) { return src[c] / divisor; });
}

/// dst[c] = src[c] rounded to the half-precision type Storage (round to nearest even, as
/// Eigen's conversions: a NaN becomes Eigen's quiet NaN of its sign for bfloat16) for
/// c < count; with AVX-512 (and F16C for Eigen::half) 16 values at a time, and with `stream`
/// those 16 stored non-temporally where dst + c is 32-byte aligned (stream_stores.hpp; the
/// caller fences).
template <typename Storage, typename Scalar>
inline void tile_narrow(const Scalar* src, Storage* dst, Index count, bool stream = false) {
  Index c = 0;
  if constexpr (std::is_same_v<Scalar, float>) {
    static_assert(sizeof(Storage) == 2, "a half-precision storage type");
    auto* bits = reinterpret_cast<std::uint16_t*>(dst);
    static_cast<void>(bits);
    static_cast<void>(stream);
#if defined(__AVX512F__)
    const auto store = [&](Index at, __m256i packed) {
      auto* target = bits + at;
      if (stream && reinterpret_cast<std::uintptr_t>(target) % 32 == 0) {
        stream_packet(target, packed);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(target), packed);
      }
    };
    if constexpr (std::is_same_v<Storage, Eigen::bfloat16>) {
      const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
      const __m512i positive_nan = _mm512_set1_epi32(0x7fc0),
                    negative_nan = _mm512_set1_epi32(0xffc0);
      for (; c + 16 <= count; c += 16) {
        const __m512 value = _mm512_loadu_ps(src + c);
        const __m512i x = _mm512_castps_si512(value);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), one);
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(bias, lsb)), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
        const __mmask16 negative = _mm512_cmplt_epi32_mask(x, _mm512_setzero_si512());
        rounded = _mm512_mask_mov_epi32(rounded, nan, positive_nan);
        rounded = _mm512_mask_mov_epi32(rounded, nan & negative, negative_nan);
        store(c, _mm512_cvtepi32_epi16(rounded));
      }
    } else {
      for (; c + 16 <= count; c += 16)
        store(c, _mm512_cvtps_ph(_mm512_loadu_ps(src + c), _MM_FROUND_TO_NEAREST_INT));
    }
#endif
  }
  for (; c < count; ++c) dst[c] = static_cast<Storage>(src[c]);
}

/// tile_pack_queries of a Q stored in a half-precision type: rows [i0 + a0, i0 + a1) of q are
/// widened to Scalar into `wide` (tile x d, row-major, row a for query i0 + a), then packed
/// as tile_pack_queries packs them from a Scalar matrix (the same bits as for a Q that held
/// the widened values).
template <typename Scalar, typename Storage>
void tile_pack_queries_widened(const ConstMatrixRef<Storage>& q, Index i0, Index a0, Index a1,
                               Scalar scale, Scalar* qt_data, Index tile, Scalar* wide) {
  const Index d = q.cols();
  for (Index a = a0; a < a1; ++a)
    tile_widen<Scalar>(q.data() + (i0 + a) * q.outerStride(), wide + a * d, d);
  const Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> widened(
      wide, tile, d, Eigen::OuterStride<>(d));
  tile_pack_queries<Scalar>(ConstMatrixRef<Scalar>(widened), 0, a0, a1, scale, qt_data, tile);
}

/// The register block of every packet kernel (the scores, the values and the backward's
/// products), a sum of weighted rows:
///   acc[r][p] += sum_{t < count} weights[r * row_step + t * term_step] x_t[p]
/// for r < Rows, p < Packets, x_t[p] the packet at rows + t * row_stride + p * P. The terms are
/// added in increasing t, one multiply-add acc[r][p] = pmadd(w, x, acc[r][p]) each; every row
/// x_t is loaded once (aligned when AlignedRows) and kept in registers while the Rows weights
/// are broadcast against it.
template <typename Scalar, int Rows, int Packets, bool AlignedRows>
EIGEN_ALWAYS_INLINE void tile_accumulate_block(const Scalar* weights, Index row_step,
                                               Index term_step, const Scalar* rows,
                                               Index row_stride, Index count,
                                               TilePacket<Scalar> (&acc)[Rows][Packets]) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  constexpr Index P = tile_packet_size<Scalar>;
  for (Index t = 0; t < count; ++t) {
    Packet row[Packets];
    POSLSH_TILE_UNROLL
    for (int p = 0; p < Packets; ++p) {
      const Scalar* x = rows + t * row_stride + p * P;
      row[p] = AlignedRows ? ei::pload<Packet>(x) : ei::ploadu<Packet>(x);
      tile_keep_in_register(row[p]);
    }
    POSLSH_TILE_UNROLL
    for (int r = 0; r < Rows; ++r) {
      const Packet weight = ei::pset1<Packet>(weights[r * row_step + t * term_step]);
      POSLSH_TILE_UNROLL
      for (int p = 0; p < Packets; ++p) acc[r][p] = ei::pmadd(weight, row[p], acc[r][p]);
    }
  }
}

/// acc[r][p] = 0 for r < Rows, p < Packets.
template <typename Scalar, int Rows, int Packets>
EIGEN_ALWAYS_INLINE void tile_clear_block(TilePacket<Scalar> (&acc)[Rows][Packets]) {
  POSLSH_TILE_UNROLL
  for (int r = 0; r < Rows; ++r) {
    POSLSH_TILE_UNROLL
    for (int p = 0; p < Packets; ++p)
      acc[r][p] = Eigen::internal::pset1<TilePacket<Scalar>>(Scalar(0));
  }
}

/// acc[kk][p] = sum_c qt[c * qt_stride + p * P ...] * keys[kk * key_stride + c], c < d:
/// the scores of `Keys` keys (rows of K) against `QueryPackets` packets of queries (qt
/// aligned), summed from zero in increasing c (tile_accumulate_block).
template <typename Scalar, int Keys, int QueryPackets>
EIGEN_ALWAYS_INLINE void tile_score_block(const Scalar* qt, Index qt_stride, const Scalar* keys,
                                          Index key_stride, Index d,
                                          TilePacket<Scalar> (&acc)[Keys][QueryPackets]) {
  tile_clear_block<Scalar>(acc);
  tile_accumulate_block<Scalar, Keys, QueryPackets, true>(keys, key_stride, 1, qt, qt_stride, d,
                                                          acc);
}

/// acc[r][:] <- alpha[r] acc[r][:] + sum_{b < keys} probs[b * prob_stride + r] values[b][:]
/// for `Rows` rows and `ValuePackets` packets of value columns; acc is aligned, values are
/// read unaligned. The rescaled row, then the terms in increasing b (tile_accumulate_block).
template <typename Scalar, int Rows, int ValuePackets>
EIGEN_ALWAYS_INLINE void tile_value_block(const Scalar* probs, Index prob_stride,
                                          const Scalar* values, Index value_stride, Index keys,
                                          const Scalar* alpha, Scalar* acc, Index acc_stride) {
  namespace ei = Eigen::internal;
  using Packet = TilePacket<Scalar>;
  constexpr Index P = tile_packet_size<Scalar>;
  Packet sum[Rows][ValuePackets];
  POSLSH_TILE_UNROLL
  for (int r = 0; r < Rows; ++r) {
    const Packet scale = ei::pset1<Packet>(alpha[r]);
    POSLSH_TILE_UNROLL
    for (int p = 0; p < ValuePackets; ++p)
      sum[r][p] = ei::pmul(ei::pload<Packet>(acc + r * acc_stride + p * P), scale);
  }
  tile_accumulate_block<Scalar, Rows, ValuePackets, false>(probs, 1, prob_stride, values,
                                                           value_stride, keys, sum);
  POSLSH_TILE_UNROLL
  for (int r = 0; r < Rows; ++r) {
    POSLSH_TILE_UNROLL
    for (int p = 0; p < ValuePackets; ++p) ei::pstore(acc + r * acc_stride + p * P, sum[r][p]);
  }
}

}  // namespace poslsh::detail
