// poslsh internals: RowBytes, one byte per row of a 64-row query tile in SIMD registers, with
// the few operations the compared counts of detail/tile/count_tile.hpp need: one 64-byte
// register with AVX-512BW, two 32-byte ones with AVX2. POSLSH_ROW_BYTES is defined where one
// of them is available; elsewhere RowBytes does not exist and the counts use rectangles.
// Byte arithmetic wraps modulo 256; masks are bytes of 0xFF (row in) or 0 (row out).
#pragma once

#include <cstdint>
#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#define POSLSH_ROW_BYTES 1
#endif

#include "poslsh/core/types.hpp"

namespace poslsh::detail {

#if defined(POSLSH_ROW_BYTES)

/// 64 bytes, byte r for row r of a query tile.
class RowBytes {
 public:
  static constexpr Index rows = 64;
  RowBytes() = default;  // unspecified bytes; RowBytes{} is 0

#if defined(__AVX512BW__)
  static RowBytes load(const std::uint8_t* p) { return RowBytes(_mm512_loadu_si512(p)); }
  void store(std::uint8_t* p) const { _mm512_storeu_si512(p, v_); }
  static RowBytes splat(std::uint8_t x) { return RowBytes(_mm512_set1_epi8(static_cast<char>(x))); }
  /// Mask of the rows [first, last) (clamped to [0, 64)).
  static RowBytes row_range(Index first, Index last) {
    return RowBytes(_mm512_movm_epi8(bits(last) & ~bits(first)));
  }
  RowBytes operator+(RowBytes o) const { return RowBytes(_mm512_add_epi8(v_, o.v_)); }
  RowBytes operator-(RowBytes o) const { return RowBytes(_mm512_sub_epi8(v_, o.v_)); }
  /// This plus 1 in the rows where a and b are equal.
  RowBytes plus_where_equal(RowBytes a, RowBytes b) const {
    return RowBytes(
        _mm512_mask_add_epi8(v_, _mm512_cmpeq_epi8_mask(a.v_, b.v_), v_, _mm512_set1_epi8(1)));
  }
  /// Mask of the rows whose byte is not 0.
  RowBytes nonzero() const { return RowBytes(_mm512_movm_epi8(_mm512_test_epi8_mask(v_, v_))); }
  RowBytes operator&(RowBytes o) const { return RowBytes(_mm512_and_si512(v_, o.v_)); }
  RowBytes operator|(RowBytes o) const { return RowBytes(_mm512_or_si512(v_, o.v_)); }
  /// This where `mask` is not, 0 elsewhere.
  RowBytes and_not(RowBytes mask) const { return RowBytes(_mm512_andnot_si512(mask.v_, v_)); }
  /// `a` in the rows of `mask`, this elsewhere.
  RowBytes select(RowBytes mask, RowBytes a) const {
    return RowBytes(_mm512_ternarylogic_epi32(mask.v_, a.v_, v_, 0xCA));
  }

 private:
  explicit RowBytes(__m512i v) : v_(v) {}
  static __mmask64 bits(Index count) {
    return count <= 0 ? 0 : count >= rows ? ~__mmask64{0} : (__mmask64{1} << count) - 1;
  }
  __m512i v_;
#else
  static RowBytes load(const std::uint8_t* p) {
    return RowBytes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
  }
  void store(std::uint8_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), low_);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), high_);
  }
  static RowBytes splat(std::uint8_t x) {
    const __m256i v = _mm256_set1_epi8(static_cast<char>(x));
    return RowBytes(v, v);
  }
  static RowBytes row_range(Index first, Index last) {
    const auto clamp = [](Index r) { return static_cast<char>(r < 0 ? 0 : r > rows ? rows : r); };
    const __m256i below = _mm256_set1_epi8(static_cast<char>(clamp(first) - 1));
    const __m256i above = _mm256_set1_epi8(clamp(last));
    const __m256i low =
        _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                         21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m256i high = _mm256_add_epi8(low, _mm256_set1_epi8(32));
    const auto in = [&](__m256i r) {
      return _mm256_and_si256(_mm256_cmpgt_epi8(r, below), _mm256_cmpgt_epi8(above, r));
    };
    return RowBytes(in(low), in(high));
  }
  RowBytes operator+(RowBytes o) const {
    return RowBytes(_mm256_add_epi8(low_, o.low_), _mm256_add_epi8(high_, o.high_));
  }
  RowBytes operator-(RowBytes o) const {
    return RowBytes(_mm256_sub_epi8(low_, o.low_), _mm256_sub_epi8(high_, o.high_));
  }
  RowBytes plus_where_equal(RowBytes a, RowBytes b) const {  // equal bytes compare to -1
    return RowBytes(_mm256_sub_epi8(low_, _mm256_cmpeq_epi8(a.low_, b.low_)),
                    _mm256_sub_epi8(high_, _mm256_cmpeq_epi8(a.high_, b.high_)));
  }
  RowBytes nonzero() const {
    const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi8(-1);
    return RowBytes(_mm256_xor_si256(_mm256_cmpeq_epi8(low_, zero), ones),
                    _mm256_xor_si256(_mm256_cmpeq_epi8(high_, zero), ones));
  }
  RowBytes operator&(RowBytes o) const {
    return RowBytes(_mm256_and_si256(low_, o.low_), _mm256_and_si256(high_, o.high_));
  }
  RowBytes operator|(RowBytes o) const {
    return RowBytes(_mm256_or_si256(low_, o.low_), _mm256_or_si256(high_, o.high_));
  }
  RowBytes and_not(RowBytes mask) const {
    return RowBytes(_mm256_andnot_si256(mask.low_, low_), _mm256_andnot_si256(mask.high_, high_));
  }
  RowBytes select(RowBytes mask, RowBytes a) const {
    return RowBytes(_mm256_blendv_epi8(low_, a.low_, mask.low_),
                    _mm256_blendv_epi8(high_, a.high_, mask.high_));
  }

 private:
  RowBytes(__m256i low, __m256i high) : low_(low), high_(high) {}
  __m256i low_, high_;
#endif

 public:
  static RowBytes zero() { return splat(0); }
  /// This plus 1 (minus 1) in the rows of `mask`, whose bytes are -1 there.
  RowBytes plus_on(RowBytes mask) const { return *this - mask; }
  RowBytes minus_on(RowBytes mask) const { return *this + mask; }
};

#endif  // POSLSH_ROW_BYTES

}  // namespace poslsh::detail
