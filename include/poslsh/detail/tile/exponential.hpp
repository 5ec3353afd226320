// poslsh internals: e^x on a packet, the exponential of every softmax weight the library computes
// (the tile engines, the backward passes, and the streaming softmax of the per-sample, decode and
// user block paths). Bitwise Eigen::internal::pexp(x) for every input, with a cheaper scaling by
// 2^m on the SSE and AVX float packets.
#pragma once

#include <Eigen/Core>
#include <type_traits>

#include "poslsh/detail/disable_intrinsic_warnings.hpp"

namespace poslsh::detail {

/// Whether exp_packet has its own form for Packet (the SSE and AVX float packets, whose Eigen
/// exponential is pexp_float); other packets call Eigen's pexp.
template <typename Packet>
inline constexpr bool exp_packet_own_form =
#if defined(EIGEN_VECTORIZE_SSE2)
    std::is_same_v<Packet, Eigen::internal::Packet4f> ||
#endif
#if defined(EIGEN_VECTORIZE_AVX)
    std::is_same_v<Packet, Eigen::internal::Packet8f> ||
#endif
    false;

/// e^x lane by lane: bitwise Eigen::internal::pexp(x) for every input (NaN, infinities and
/// subnormal results included, with or without flush-to-zero).
///
/// Eigen's float exponential on SSE and AVX (pexp_float) clamps x to [-88.723, 88.723], writes
/// x = m ln 2 + r with m = floor(x log2(e) + 1/2) in [-128, 128], approximates e^r by a
/// polynomial y in [0.7, 1.42] and returns max(y 2^m, x), scaling by 2^m with a general ldexp:
/// four products by powers of two, built for any exponent, of which only the last can round.
/// The form here takes the same steps up to y, then
///   y 2^m = (y 2^h) 2^(m - h),  h = floor(m / 2),
/// both factors normal floats (|h|, |m - h| <= 64): the first product is exact and the second
/// rounds the same exact value y 2^m once, so the result has the same bits as Eigen's (nine
/// instructions for the scaling instead of fifteen). On other packets (AVX-512's pexp already
/// scales in one product; double) this is Eigen's pexp.
template <typename Packet>
inline Packet exp_packet(const Packet& x_in) {
  namespace ei = Eigen::internal;
  if constexpr (!exp_packet_own_form<Packet>) {
    return ei::pexp(x_in);
  } else {
    // Eigen 3.4's pexp_float, step by step.
    const Packet one = ei::pset1<Packet>(1.0f);
    const Packet half = ei::pset1<Packet>(0.5f);
    const Packet exp_hi = ei::pset1<Packet>(88.723f);
    const Packet exp_lo = ei::pset1<Packet>(-88.723f);
    const Packet log2e = ei::pset1<Packet>(1.44269504088896341f);
    const Packet p0 = ei::pset1<Packet>(1.9875691500E-4f);
    const Packet p1 = ei::pset1<Packet>(1.3981999507E-3f);
    const Packet p2 = ei::pset1<Packet>(8.3334519073E-3f);
    const Packet p3 = ei::pset1<Packet>(4.1665795894E-2f);
    const Packet p4 = ei::pset1<Packet>(1.6666665459E-1f);
    const Packet p5 = ei::pset1<Packet>(5.0000001201E-1f);
    const Packet x = ei::pmax(ei::pmin(x_in, exp_hi), exp_lo);
    const Packet m = ei::pfloor(ei::pmadd(x, log2e, half));
    // r = x - m ln 2, ln 2 in two parts.
    Packet r = ei::pmadd(m, ei::pset1<Packet>(-0.693359375f), x);
    r = ei::pmadd(m, ei::pset1<Packet>(2.12194440e-4f), r);
    const Packet r2 = ei::pmul(r, r);
    const Packet r3 = ei::pmul(r2, r);
    Packet y = ei::pmadd(p0, r, p1);
    Packet y1 = ei::pmadd(p3, r, p4);
    const Packet y2 = ei::padd(r, one);
    y = ei::pmadd(y, r, p2);
    y1 = ei::pmadd(y1, r, p5);
    y = ei::pmadd(y, r3, y1);
    y = ei::pmadd(y, r2, y2);
    // y 2^m as (y 2^h) 2^(m - h), each power of two built in its exponent bits.
    using PacketI = typename ei::unpacket_traits<Packet>::integer_packet;
    const PacketI bias = ei::pset1<PacketI>(127);
    const PacketI mi = ei::pcast<Packet, PacketI>(m);
    const PacketI h = ei::parithmetic_shift_right<1>(mi);
    const Packet first = ei::preinterpret<Packet>(ei::plogical_shift_left<23>(ei::padd(h, bias)));
    const Packet second =
        ei::preinterpret<Packet>(ei::plogical_shift_left<23>(ei::padd(ei::psub(mi, h), bias)));
    return ei::pmax(ei::pmul(ei::pmul(y, first), second), x_in);
  }
}

/// Eigen's exponential functor (Eigen::internal::scalar_exp_op) with exp_packet on its packets:
/// array.unaryExpr(ExpOp<Scalar>()) is bitwise array.exp(), the same elements evaluated on
/// packets and the rest by numext::exp (std::exp) as Eigen's.
template <typename Scalar>
struct ExpOp {
  Scalar operator()(const Scalar& x) const { return Eigen::numext::exp(x); }
  template <typename Packet>
  Packet packetOp(const Packet& x) const {
    return exp_packet(x);
  }
};

}  // namespace poslsh::detail

namespace Eigen::internal {
/// ExpOp vectorizes and costs as Eigen's exponential, so that expressions with it are evaluated
/// in the same packets and scalars.
template <typename Scalar>
struct functor_traits<poslsh::detail::ExpOp<Scalar>> : functor_traits<scalar_exp_op<Scalar>> {};
}  // namespace Eigen::internal

#include "poslsh/detail/restore_warnings.hpp"
