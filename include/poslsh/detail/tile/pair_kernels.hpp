// poslsh internals: the tile engine's products on AVX512-BF16 (MatrixUnit::avx512_bf16,
// core/matrix_units.hpp), for Q, K and V stored in Eigen::bfloat16. vdpbf16ps multiplies 16
// pairs of bfloat16 values by 16 other pairs and adds each pair's two products (exact in
// float) to a float lane, one rounding per product; both operands hold adjacent pairs along
// the summed index, so the tile engine packs:
//   queries  pair_q[c2 * tile + a] = (q_a[2 c2], q_a[2 c2 + 1])    (d summed, 16 queries a vector)
//   keys     rows copied as they are: key b's word c2 is (k_b[2 c2], k_b[2 c2 + 1]), broadcast
//   probs    pair_p[b2 * tile + a] = (p_a,2b2, p_a,2b2+1) rounded to bfloat16, broadcast
//   values   pair_v[b2 * cols + c] = (v_2b2[c], v_2b2+1[c])     (keys summed, 16 columns)
// with a zero for the missing half of the last pair of an odd d or an odd key count (words
// are two bfloat16 bit patterns, the first in the low 16 bits). Scores and value sums are
// float; each lane's sum runs over the pairs in order, so a query's result depends only on its
// own row and the keys, never on the other queries in its tile.
// Every function carrying AVX-512 instructions is compiled for that target by a function
// attribute, so the code exists in any x86-64 build (with or without -march=native) and runs
// only where matrix_unit_available(MatrixUnit::avx512_bf16) says the CPU has it.
#pragma once

#include "poslsh/core/matrix_units.hpp"

#if POSLSH_X86_UNITS

#include <immintrin.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/tile/kernels.hpp"
#include "poslsh/detail/tile/types.hpp"

#define POSLSH_AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define POSLSH_AVX512_BF16_INLINE POSLSH_AVX512_BF16_TARGET inline __attribute__((always_inline))

#include "poslsh/detail/disable_intrinsic_warnings.hpp"

namespace poslsh::detail {

/// The bit pattern of a bfloat16 value.
inline std::uint16_t bf16_bits(Eigen::bfloat16 value) {
  return Eigen::numext::bit_cast<std::uint16_t>(value);
}

/// The bit patterns of bfloat16 values, as the pair kernels read them.
inline const std::uint16_t* bf16_words(const Eigen::bfloat16* values) {
  return reinterpret_cast<const std::uint16_t*>(values);
}

/// The distance of rows of `cols` bfloat16 values copied for the score products, which read
/// a row's values two by two: an even count (a zero appended to an odd row).
inline Index pair_row_stride(Index cols) { return cols + cols % 2; }

/// Rows [0, count) of `rows` (bfloat16 bits, `stride` apart) copied to `out`, out_stride
/// (>= cols) apart, with zeros from column `cols` to out_stride - 1. Plain loops: rows of a
/// head (tens of values) are too short for a library call per row.
inline void pair_copy_rows(const std::uint16_t* rows, Index stride, Index count, Index cols,
                           std::uint16_t* out, Index out_stride) {
  for (Index b = 0; b < count; ++b) {
    const std::uint16_t* row = rows + b * stride;
    std::uint16_t* copy = out + b * out_stride;
    for (Index c = 0; c < cols; ++c) copy[c] = row[c];
    for (Index c = cols; c < out_stride; ++c) copy[c] = 0;
  }
}

/// The 16 x 16 words of r transposed in place: word j of r[i] becomes word i of r[j].
POSLSH_AVX512_BF16_INLINE void pair_transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

/// pair_q[c2 * tile + a] = (q[i0 + a][2 c2], q[i0 + a][2 c2 + 1]) for rows a in [a0, a1) and
/// c2 < half_d = ceil(d / 2) (0 past column d - 1), 0 for the other rows a < tile (a multiple
/// of 16). A pair of adjacent 16-bit values (Half: Eigen::bfloat16, or Eigen::half for the AMX
/// float16 tiles) is one word as stored (the first in the low 16 bits): blocks of 16 rows x 16
/// words are loaded and transposed in registers.
template <typename Half>
POSLSH_AVX512_BF16_TARGET __attribute__((noinline)) void pair_pack_queries(
    const ConstMatrixRef<Half>& q, Index i0, Index a0, Index a1, std::uint32_t* pair_q,
    Index tile) {
  static_assert(sizeof(Half) == 2, "pairs of 16-bit values");
  const Index d = q.cols(), half_d = (d + 1) / 2;
  for (Index a = 0; a < tile; a += 16) {
    if (a + 16 <= a0 || a >= a1) {
      for (Index c2 = 0; c2 < half_d; ++c2)
        _mm512_storeu_si512(pair_q + c2 * tile + a, _mm512_setzero_si512());
      continue;
    }
    for (Index c2 = 0; c2 < half_d; c2 += 16) {
      const Index left = std::min<Index>(32, d - 2 * c2);
      const __mmask32 mask = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
      __m512i block[16];
      for (Index r = 0; r < 16; ++r) {
        block[r] =
            a + r >= a0 && a + r < a1
                ? _mm512_maskz_loadu_epi16(mask, q.data() + (i0 + a + r) * q.outerStride() + 2 * c2)
                : _mm512_setzero_si512();
      }
      pair_transpose16(block);
      for (Index w = 0; w < std::min<Index>(16, half_d - c2); ++w)
        _mm512_storeu_si512(pair_q + (c2 + w) * tile + a, block[w]);
    }
  }
}

/// The lanes of the 16 rows from `start` that lie in [lo, hi).
inline __mmask16 pair_row_mask(Index start, Index lo, Index hi) {
  const Index first = std::clamp<Index>(lo - start, 0, 16),
              last = std::clamp<Index>(hi - start, 0, 16);
  const unsigned below_last = last >= 16 ? 0xffffu : (1u << last) - 1u;
  const unsigned below_first = first >= 16 ? 0xffffu : (1u << first) - 1u;
  return static_cast<__mmask16>(below_last & ~below_first);
}

/// `vector`, held in a register: stops the compiler from folding its load or broadcast into
/// each instruction that uses it (loaded once). No code is emitted. It takes and returns a
/// value: applied in place to an element of an array, the same barrier makes the compiler
/// also store the array to the stack on every iteration.
template <typename Vector>
POSLSH_AVX512_BF16_INLINE Vector pair_in_register(Vector vector) {
  __asm__("" : "+v"(vector));
  return vector;
}

/// The finish of pair_score_span that stores the scores: scores[b * tile + a] = tau acc for
/// the lanes of `mask`.
struct PairScoreStore {
  float tau;
  float* scores;
  Index tile;
  template <int Keys>
  POSLSH_AVX512_BF16_INLINE void operator()(const __m512 (&acc)[Keys], Index b0, Index a,
                                            __mmask16 mask) const {
    const __m512 scale = _mm512_set1_ps(tau);
    POSLSH_TILE_UNROLL
    for (int kk = 0; kk < Keys; ++kk)
      _mm512_mask_storeu_ps(scores + (b0 + kk) * tile + a, mask, _mm512_mul_ps(acc[kk], scale));
  }
};

/// finish(acc, b0, a, mask) with acc[kk] = sum_c2 pair_q[c2][a'] . key (b0 + kk)'s pair c2 for
/// kk < Keys and the 16 rows a' from a (a = start, start + 16, ... for the Vectors vectors of
/// 16 from `start`; mask: those of its rows inside [lo, hi)).
template <int Keys, int Vectors, typename Finish>
POSLSH_AVX512_BF16_INLINE void pair_score_block(const std::uint32_t* pair_q, Index tile,
                                                const std::uint16_t* keys, Index key_stride,
                                                Index half_d, Index b0, Index start, Index lo,
                                                Index hi, const Finish& finish) {
  __m512 acc[Keys][Vectors];
  POSLSH_TILE_UNROLL
  for (int kk = 0; kk < Keys; ++kk) {
    POSLSH_TILE_UNROLL
    for (int w = 0; w < Vectors; ++w) acc[kk][w] = _mm512_setzero_ps();
  }
  const std::uint16_t* key_rows = keys + b0 * key_stride;
  for (Index c2 = 0; c2 < half_d; ++c2) {
    __m512bh queries[Vectors];
    POSLSH_TILE_UNROLL
    for (int w = 0; w < Vectors; ++w) {
      queries[w] =
          pair_in_register((__m512bh)_mm512_loadu_si512(pair_q + c2 * tile + start + 16 * w));
    }
    POSLSH_TILE_UNROLL
    for (int kk = 0; kk < Keys; ++kk) {
      std::uint32_t word;
      std::memcpy(&word, key_rows + kk * key_stride + 2 * c2, sizeof(word));
      const __m512bh key = pair_in_register((__m512bh)_mm512_set1_epi32(static_cast<int>(word)));
      POSLSH_TILE_UNROLL
      for (int w = 0; w < Vectors; ++w) acc[kk][w] = _mm512_dpbf16_ps(acc[kk][w], queries[w], key);
    }
  }
  POSLSH_TILE_UNROLL
  for (int w = 0; w < Vectors; ++w) {
    __m512 column[Keys];
    POSLSH_TILE_UNROLL
    for (int kk = 0; kk < Keys; ++kk) column[kk] = acc[kk][w];
    finish(column, b0, start + 16 * w, pair_row_mask(start + 16 * w, lo, hi));
  }
}

template <int Keys, int Vectors, typename Finish>
POSLSH_AVX512_BF16_INLINE void pair_score_keys(const std::uint32_t* pair_q, Index tile,
                                               const std::uint16_t* keys, Index key_stride,
                                               Index half_d, Index b, Index end, Index start,
                                               Index lo, Index hi, const Finish& finish) {
  for (; b + Keys <= end; b += Keys)
    pair_score_block<Keys, Vectors>(pair_q, tile, keys, key_stride, half_d, b, start, lo, hi,
                                    finish);
  if constexpr (Keys > 1)
    pair_score_keys<Keys / 2, Vectors>(pair_q, tile, keys, key_stride, half_d, b, end, start, lo,
                                       hi, finish);
}

/// finish(acc, b0, a, mask) (a functor as PairScoreStore; inlined, so it may be any code the
/// AVX512-BF16 target runs) for blocks of keys [b0, b0 + Keys) covering [b, end) of the tile
/// (key b's row at keys + b key_stride, bfloat16 bits) and the vectors of 16 query rows a
/// covering [lo, hi) (hi - lo <= 64; mask: the rows inside): acc[kk] = q_a'.k_(b0 + kk)
/// (bfloat16 products summed in float) for the 16 rows a' from a, from the query pairs pair_q
/// (pair_pack_queries).
template <typename Finish>
POSLSH_AVX512_BF16_TARGET __attribute__((noinline)) void pair_score_span(
    const std::uint32_t* pair_q, Index tile, const std::uint16_t* keys, Index key_stride,
    Index half_d, Index b, Index end, Index lo, Index hi, const Finish& finish) {
  const Index start = lo / 16 * 16;
  // The register blocks of the float scores on 32 registers (this target's zmm0-zmm31).
  switch ((hi - start + 15) / 16) {
    case 1:
      return pair_score_keys<tile_score_keys(32, 1), 1>(pair_q, tile, keys, key_stride, half_d, b,
                                                        end, start, lo, hi, finish);
    case 2:
      return pair_score_keys<tile_score_keys(32, 2), 2>(pair_q, tile, keys, key_stride, half_d, b,
                                                        end, start, lo, hi, finish);
    case 3:
      return pair_score_keys<tile_score_keys(32, 3), 3>(pair_q, tile, keys, key_stride, half_d, b,
                                                        end, start, lo, hi, finish);
    default:
      return pair_score_keys<tile_score_keys(32, 4), 4>(pair_q, tile, keys, key_stride, half_d, b,
                                                        end, start, lo, hi, finish);
  }
}

/// scores[b * tile + a] = tau q_a.k_b (bfloat16 products summed in float) for keys b in
/// [b, end) of the tile and query rows a in [lo, hi) (pair_score_span with PairScoreStore).
inline void pair_score_span(const std::uint32_t* pair_q, Index tile, const std::uint16_t* keys,
                            Index key_stride, Index half_d, Index b, Index end, Index lo, Index hi,
                            float tau, float* scores) {
  pair_score_span(pair_q, tile, keys, key_stride, half_d, b, end, lo, hi,
                  PairScoreStore{tau, scores, tile});
}

/// e^x for 16 floats, as Eigen's exponential computes it (Cephes' polynomial of degree 5 on
/// r = x - m ln 2, m = round(x / ln 2), one fused multiply-add for r), with 2^m applied by
/// vscalefps instead of built from exponent bits: within 1.5 ulp of e^x for -20 <= x <= 0
/// and 4.5 ulp for -87.3 <= x < -20 (-87.3: about the least normal float's logarithm; below
/// it, and for x = -inf, e^-87.3), NaN for NaN.
POSLSH_AVX512_BF16_INLINE __m512 pair_exp(__m512 x) {
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // NaN stays NaN
  const __m512 m =
      _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(m, _mm512_set1_ps(-0.6931471805599453f), clamped);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500E-4f), r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, m);
}

/// The pair of 16 probabilities (even[a], odd[a]) rounded to bfloat16, as pair_pack_probs
/// stores them: out[a] = bits(even[a]) | bits(odd[a]) << 16.
POSLSH_AVX512_BF16_INLINE void pair_store_probs(__m512 even, __m512 odd, std::uint32_t* out) {
  const __m512i low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
  const __m512i high =
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd)), 16);
  _mm512_storeu_si512(out, _mm512_or_si512(low, high));
}

/// The online-softmax step of the tile engine on the AVX512-BF16 unit for the packets of 16
/// rows a in [first, last), fused with the packing of the probabilities: with [b_lo, b_hi) =
/// reach(a) the keys the packet reaches and the packet's shift and alpha,
///   p_b = weight(e^{x_b - shift}) (scorer.weight<Masked>, x_b at scores + b tile + a, the
///         exponential of pair_exp),
///   sums[a] <- alpha sums[a] + sum_{b in [b_lo, b_hi)} p_b (in order of b),
///   pair_p[b2 * tile + a] = (p_2b2, p_2b2+1) rounded to bfloat16, for the pairs that meet
///                           [b_lo, b_hi) (p = 0 for the other key of a pair at either end).
/// Packet is the engine's packet of 16 floats (__m512); pairs outside the reach are not written.
template <bool Masked, typename Packet, typename Scorer, typename Reach>
POSLSH_AVX512_BF16_TARGET __attribute__((noinline)) void pair_exp_pack(
    const Scorer& scorer, const Reach& reach, const float* scores, Index tile, Index first,
    Index last, const float* shift, const float* alpha, float* sums, std::uint32_t* pair_p) {
  namespace ei = Eigen::internal;
  const Packet zero = ei::pset1<Packet>(0.0f);
  for (Index a = first; a < last; a += 16) {
    const KeyRange keys = reach(a);
    const Packet minus = ei::pload<Packet>(shift + a);
    Packet sum = zero;
    for (Index b2 = keys.first / 2; 2 * b2 < keys.last; ++b2) {
      Packet prob[2] = {zero, zero};
      POSLSH_TILE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const Index b = 2 * b2 + h;
        if (b < keys.first || b >= keys.last) continue;
        const Packet x = ei::pload<Packet>(scores + b * tile + a);
        prob[h] = scorer.template weight<Masked>(pair_exp(ei::psub(x, minus)), x, b, a);
        sum = ei::padd(sum, prob[h]);
      }
      pair_store_probs(prob[0], prob[1], pair_p + b2 * tile + a);
    }
    ei::pstore(sums + a, ei::pmadd(ei::pload<Packet>(sums + a), ei::pload<Packet>(alpha + a), sum));
  }
}

/// pair_p[b2 * tile + a] = (probs[2 b2][a], probs[2 b2 + 1][a]) rounded to bfloat16 (round to
/// nearest even; vcvtneps2bf16 takes values below the float normal range as 0) for b2 < pairs
/// and rows a in [lo, hi) rounded out to multiples of 16 (probs[b][a] at probs + b tile + a).
POSLSH_AVX512_BF16_TARGET __attribute__((noinline)) inline void pair_pack_probs(
    const float* probs, Index tile, Index pairs, Index lo, Index hi, std::uint32_t* pair_p) {
  for (Index b2 = 0; b2 < pairs; ++b2) {
    for (Index a = lo / 16 * 16; a < hi; a += 16)
      pair_store_probs(_mm512_loadu_ps(probs + 2 * b2 * tile + a),
                       _mm512_loadu_ps(probs + (2 * b2 + 1) * tile + a), pair_p + b2 * tile + a);
  }
}

/// pair_v[b2 * cols + c] = (v_2b2[c], v_2b2+1[c]) for b2 < ceil(keys / 2), c < cols (cols a
/// multiple of 16 >= dv), 0 past column dv - 1 and for the missing key of an odd count; key b's
/// dv values (bfloat16 bits) at values + b stride. 32 columns at a time: the two rows' words
/// interleaved by two permutes.
POSLSH_AVX512_BF16_TARGET __attribute__((noinline)) inline void pair_pack_values(
    const std::uint16_t* values, Index stride, Index keys, Index dv, Index cols,
    std::uint32_t* pair_v) {
  alignas(64) std::uint16_t low_index[32], high_index[32];
  for (int i = 0; i < 32; ++i) {
    low_index[i] = static_cast<std::uint16_t>((i % 2 == 0 ? 0 : 32) + i / 2);
    high_index[i] = static_cast<std::uint16_t>((i % 2 == 0 ? 0 : 32) + 16 + i / 2);
  }
  const __m512i low = _mm512_load_si512(low_index), high = _mm512_load_si512(high_index);
  for (Index b2 = 0; 2 * b2 < keys; ++b2) {
    const std::uint16_t* even = values + 2 * b2 * stride;
    const std::uint16_t* odd = even + stride;
    const bool has_odd = 2 * b2 + 1 < keys;
    std::uint32_t* out = pair_v + b2 * cols;
    for (Index c = 0; c < cols; c += 32) {
      const Index left = std::min<Index>(32, std::max<Index>(0, dv - c));
      const __mmask32 mask = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
      const __m512i a = _mm512_maskz_loadu_epi16(mask, even + c);
      const __m512i b = has_odd ? _mm512_maskz_loadu_epi16(mask, odd + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(a, low, b));
      if (c + 16 < cols) _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

/// acc[r][c] <- alpha[r] acc[r][c] + sum_b2 pair_p[b2 * tile + r row_step] . pair_v[b2 * cols +
/// c] for Rows rows r, b2 < pairs, Vectors vectors of 16 columns from c (the last one masked by
/// last_mask).
template <int Rows, int Vectors>
POSLSH_AVX512_BF16_INLINE void pair_value_block(const std::uint32_t* pair_p, Index tile,
                                                const std::uint32_t* pair_v, Index cols,
                                                Index pairs, const float* alpha, float* acc,
                                                Index acc_stride, __mmask16 last_mask,
                                                Index row_step) {
  __m512 sum[Rows][Vectors];
  POSLSH_TILE_UNROLL
  for (int r = 0; r < Rows; ++r) {
    const __m512 scale = _mm512_set1_ps(alpha[r]);
    POSLSH_TILE_UNROLL
    for (int w = 0; w < Vectors; ++w) {
      const __mmask16 mask = w + 1 == Vectors ? last_mask : __mmask16(0xffff);
      sum[r][w] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, acc + r * acc_stride + 16 * w), scale);
    }
  }
  for (Index b2 = 0; b2 < pairs; ++b2) {
    __m512bh row[Vectors];
    POSLSH_TILE_UNROLL
    for (int w = 0; w < Vectors; ++w) {
      row[w] = pair_in_register((__m512bh)_mm512_loadu_si512(pair_v + b2 * cols + 16 * w));
    }
    POSLSH_TILE_UNROLL
    for (int r = 0; r < Rows; ++r) {
      const __m512bh prob = pair_in_register(
          (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_p[b2 * tile + r * row_step])));
      POSLSH_TILE_UNROLL
      for (int w = 0; w < Vectors; ++w) sum[r][w] = _mm512_dpbf16_ps(sum[r][w], prob, row[w]);
    }
  }
  POSLSH_TILE_UNROLL
  for (int r = 0; r < Rows; ++r) {
    POSLSH_TILE_UNROLL
    for (int w = 0; w < Vectors; ++w) {
      const __mmask16 mask = w + 1 == Vectors ? last_mask : __mmask16(0xffff);
      _mm512_mask_storeu_ps(acc + r * acc_stride + 16 * w, mask, sum[r][w]);
    }
  }
}

/// acc[r][c] <- alpha[r] acc[r][c] + sum_{b2 < pairs} sum_t p_r,2b2+t v_2b2+t[c] for Rows rows
/// r and the dv columns c, from pair_p (row r's pair b2 at pair_p + b2 tile + r row_step:
/// pair_pack_probs with row_step 1) and pair_v (pair_pack_values, cols words a pair).
template <int Rows>
POSLSH_AVX512_BF16_TARGET __attribute__((noinline)) void pair_value_rows(
    const std::uint32_t* pair_p, Index tile, const std::uint32_t* pair_v, Index cols, Index pairs,
    const float* alpha, float* acc, Index acc_stride, Index dv, Index row_step = 1) {
  for (Index c = 0; c < dv; c += 64) {
    const Index vectors = std::min<Index>(4, (dv - c + 15) / 16);
    const __mmask16 last = pair_row_mask(c + 16 * (vectors - 1), 0, dv);
    switch (vectors) {
      case 1:
        pair_value_block<Rows, 1>(pair_p, tile, pair_v + c, cols, pairs, alpha, acc + c, acc_stride,
                                  last, row_step);
        break;
      case 2:
        pair_value_block<Rows, 2>(pair_p, tile, pair_v + c, cols, pairs, alpha, acc + c, acc_stride,
                                  last, row_step);
        break;
      case 3:
        pair_value_block<Rows, 3>(pair_p, tile, pair_v + c, cols, pairs, alpha, acc + c, acc_stride,
                                  last, row_step);
        break;
      default:
        pair_value_block<Rows, 4>(pair_p, tile, pair_v + c, cols, pairs, alpha, acc + c, acc_stride,
                                  last, row_step);
        break;
    }
  }
}

}  // namespace poslsh::detail

#include "poslsh/detail/restore_warnings.hpp"

#endif  // POSLSH_X86_UNITS
