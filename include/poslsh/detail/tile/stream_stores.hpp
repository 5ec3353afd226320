// poslsh internals: non-temporal stores for outputs that outgrow the caches. A forward writes
// each output row once and a backward pass each gradient row once; when the whole output is
// larger than the caches, each of those cache lines would first be read from memory only to be
// overwritten, and pushed out again before anyone reads it. A non-temporal store writes the
// whole line without reading it. Stores change no value: the streamed and the cached outputs
// are bitwise the same.
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "poslsh/core/types.hpp"
#include "poslsh/detail/detected.hpp"

namespace poslsh::detail {

/// Outputs of at least this many bytes are written with non-temporal stores (an [n, H, d]
/// tensor of n = 4096, H = 8, d = 64 floats holds 8 MiB): larger than the caches a core can
/// keep them in until the caller reads them.
inline constexpr std::size_t stream_store_bytes = std::size_t{8} << 20;

/// Whether an output of `bytes` bytes is written with non-temporal stores.
inline bool streams_output(std::size_t bytes) { return bytes >= stream_store_bytes; }

#if defined(__SSE2__)
/// Stores packet x at p with a non-temporal store (p aligned to the packet).
inline void stream_packet(float* p, __m128 x) { _mm_stream_ps(p, x); }
inline void stream_packet(double* p, __m128d x) { _mm_stream_pd(p, x); }
#endif
#if defined(__AVX__)
inline void stream_packet(float* p, __m256 x) { _mm256_stream_ps(p, x); }
inline void stream_packet(double* p, __m256d x) { _mm256_stream_pd(p, x); }
/// 16 half-precision values (bfloat16 or float16 bits).
inline void stream_packet(std::uint16_t* p, __m256i x) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
}
#endif
#if defined(__AVX512F__)
inline void stream_packet(float* p, __m512 x) { _mm512_stream_ps(p, x); }
inline void stream_packet(double* p, __m512d x) { _mm512_stream_pd(p, x); }
#endif

/// Whether stream_packet takes Scalar's packets (Eigen's, as the tile kernels use) in this
/// build.
template <typename Scalar>
using stream_packet_t =
    decltype(stream_packet(std::declval<Scalar*>(),
                           std::declval<typename Eigen::internal::packet_traits<Scalar>::type>()));
template <typename Scalar>
using has_stream_packet = is_detected<stream_packet_t, Scalar>;

/// Whether a row at dst of an output written with non-temporal stores (`stream`) takes them:
/// when this build streams Scalar's packets and dst is aligned to one (other rows are stored
/// as usual).
template <typename Scalar>
inline bool streams_row(const Scalar* dst, bool stream) {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  if constexpr (has_stream_packet<Scalar>::value &&
                Eigen::internal::packet_traits<Scalar>::size > 1) {
    return stream && reinterpret_cast<std::uintptr_t>(dst) % sizeof(Packet) == 0;
  } else {
    static_cast<void>(dst);
    static_cast<void>(stream);
    return false;
  }
}

/// dst[c .. c + P) = packet(c) for the whole packets of a row of `count` scalars (Eigen's
/// packets of P scalars), then dst[c] = scalar(c) for the rest; with `streamed` (streams_row
/// of dst) the packets are stored non-temporally (the caller fences: stream_store_fence).
template <typename Scalar, typename PacketValue, typename ScalarValue>
inline void store_row(Scalar* dst, Index count, bool streamed, const PacketValue& packet,
                      const ScalarValue& scalar) {
  namespace ei = Eigen::internal;
  constexpr Index P = ei::packet_traits<Scalar>::size;
  const Index packets_end = count - count % P;
  Index c = 0;
  if constexpr (has_stream_packet<Scalar>::value && P > 1) {
    if (streamed)
      for (; c < packets_end; c += P) stream_packet(dst + c, packet(c));
  }
  static_cast<void>(streamed);
  for (; c < packets_end; c += P) ei::pstoreu(dst + c, packet(c));
  for (c = packets_end; c < count; ++c) dst[c] = scalar(c);
}

/// Orders the non-temporal stores before the thread's later stores, so every thread sees them
/// once the parallel loop ends. Call after a run of stream_packet.
inline void stream_store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace poslsh::detail
