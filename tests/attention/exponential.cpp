// The exponential of every softmax weight (detail::exp_packet, detail::ExpOp): bitwise
// Eigen's pexp on every packet type it has its own form for, over a stride through all 2^32
// float bit patterns, every float where e^x is subnormal or overflows, the neighbours of every
// step of the exponent m, and the special values; with and without flush-to-zero.
#include <cmath>
#include <cstdint>
#include <limits>
#include <poslsh/detail/backward/tiles.hpp>
#include <poslsh/detail/tile/exponential.hpp>
#include <string>
#include <vector>

#include "test_support.hpp"

// Eigen's packet types (attributed vector types) as template arguments, as in the kernels.
#include <poslsh/detail/disable_intrinsic_warnings.hpp>

namespace {

namespace ei = Eigen::internal;

std::uint32_t float_bits(float x) { return Eigen::numext::bit_cast<std::uint32_t>(x); }

float bits_float(std::uint32_t bits) { return Eigen::numext::bit_cast<float>(bits); }

/// The inputs: a stride of 4099 through every bit pattern (NaNs, infinities and subnormals
/// among them), every float in [-88.8, -86.5] (e^x subnormal or near it: m = -125 .. -128)
/// and in [86.5, 88.8] (m up to 128, e^x near the overflow), 32 floats on each side of every
/// x = (m - 1/2) ln 2 where m changes, and the special values.
std::vector<float> exponential_inputs() {
  std::vector<float> inputs;
  for (std::uint64_t bits = 0; bits < (std::uint64_t{1} << 32); bits += 4099) {
    inputs.push_back(bits_float(static_cast<std::uint32_t>(bits)));
  }
  for (const float lo : {-88.8f, 86.5f}) {
    const float hi = lo + 2.3f;
    for (float x = lo; x < hi; x = std::nextafter(x, hi)) inputs.push_back(x);
  }
  for (int m = -130; m <= 130; ++m) {
    float x = static_cast<float>((m - 0.5) * std::log(2.0));
    for (int step = 0; step < 32; ++step) x = std::nextafter(x, -1e9f);
    for (int step = 0; step < 64; ++step, x = std::nextafter(x, 1e9f)) inputs.push_back(x);
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (const float x :
       {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
        -std::numeric_limits<float>::quiet_NaN(), bits_float(0x7fc12345u), bits_float(0x7f812345u),
        std::numeric_limits<float>::min(), -std::numeric_limits<float>::min(),
        std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
        -std::numeric_limits<float>::max(), 88.723f, -88.723f, 88.7228f, -88.7228f, 88.3763f,
        -88.3763f}) {
    inputs.push_back(x);
  }
  return inputs;
}

/// The inputs whose exp_packet and pexp differ in their bits (NaN against NaN compared by bits
/// too), and the largest relative error against std::exp where e^x is a normal float.
struct Comparison {
  std::size_t differ = 0;
  std::string first;
  double largest_error = 0;
};

template <typename Packet>
Comparison compare_with_eigen(const std::vector<float>& inputs) {
  constexpr int P = ei::unpacket_traits<Packet>::size;
  Comparison result;
  alignas(64) float in[P], ours[P], eigen[P];
  for (std::size_t start = 0; start < inputs.size(); start += P) {
    for (int lane = 0; lane < P; ++lane) {
      in[lane] = inputs[std::min(start + static_cast<std::size_t>(lane), inputs.size() - 1)];
    }
    const Packet x = ei::pload<Packet>(in);
    ei::pstore(ours, poslsh::detail::exp_packet(x));
    ei::pstore(eigen, ei::pexp(x));
    for (int lane = 0; lane < P; ++lane) {
      if (float_bits(ours[lane]) != float_bits(eigen[lane])) {
        if (result.differ++ == 0) {
          result.first = "x = " + std::to_string(in[lane]) + " (bits " +
                         std::to_string(float_bits(in[lane])) + "): " + std::to_string(ours[lane]) +
                         " against " + std::to_string(eigen[lane]);
        }
      }
      const double exact = std::exp(static_cast<double>(in[lane]));
      if (std::isfinite(in[lane]) && exact >= std::numeric_limits<float>::min() &&
          exact <= std::numeric_limits<float>::max()) {
        result.largest_error = std::max(result.largest_error, std::abs(ours[lane] - exact) / exact);
      }
    }
  }
  return result;
}

template <typename Packet>
void require_eigen_bits(const std::vector<float>& inputs) {
  STATIC_REQUIRE(poslsh::detail::exp_packet_own_form<Packet>);
  {
    const Comparison plain = compare_with_eigen<Packet>(inputs);
    INFO("subnormals kept: " << plain.differ << " inputs differ; first " << plain.first);
    CHECK(plain.differ == 0);
    // Eigen's exponential is within a few float ulps of e^x (2^-24 = 6e-8).
    CHECK(plain.largest_error < 4e-7);
  }
  const poslsh::detail::FlushSubnormals flush;
  const Comparison flushed = compare_with_eigen<Packet>(inputs);
  INFO("flush-to-zero: " << flushed.differ << " inputs differ; first " << flushed.first);
  CHECK(flushed.differ == 0);
}

}  // namespace

TEST_CASE("the tile exponential has the bits of Eigen's pexp for every kind of float input",
          "[tile][exponential]") {
  const std::vector<float> inputs = exponential_inputs();
  REQUIRE(inputs.size() > 1000000);
#if defined(EIGEN_VECTORIZE_SSE2)
  SECTION("SSE packets of 4 floats") { require_eigen_bits<ei::Packet4f>(inputs); }
#endif
#if defined(EIGEN_VECTORIZE_AVX)
  SECTION("AVX packets of 8 floats") { require_eigen_bits<ei::Packet8f>(inputs); }
#endif
}

TEST_CASE("the tile exponential of other packets is Eigen's pexp", "[tile][exponential]") {
  using Packet = ei::packet_traits<double>::type;
  STATIC_REQUIRE(!poslsh::detail::exp_packet_own_form<Packet>);
  constexpr int P = ei::unpacket_traits<Packet>::size;
  alignas(64) double in[P], ours[P], eigen[P];
  for (int lane = 0; lane < P; ++lane) in[lane] = -0.37 * (lane + 1);
  const Packet x = ei::pload<Packet>(in);
  ei::pstore(ours, poslsh::detail::exp_packet(x));
  ei::pstore(eigen, ei::pexp(x));
  for (int lane = 0; lane < P; ++lane) {
    CHECK(ours[lane] == eigen[lane]);
    CHECK(ours[lane] == Approx(std::exp(in[lane])).epsilon(1e-15));
  }
}

TEMPLATE_TEST_CASE("an expression with the tile exponential has the bits of Eigen's exp()",
                   "[tile][exponential]", float, double) {
  using Array = Eigen::Array<TestType, Eigen::Dynamic, 1>;
  // Exponents in [-100, 5]: e^x subnormal or flushed below -87 (float) as in the backward's
  // probabilities of far keys, over segments of every length and start up to 70 and 8, so that
  // Eigen's evaluation puts different elements on packets and on std::exp.
  Array buffer(80);
  for (Index i = 0; i < buffer.size(); ++i) {
    buffer(i) = static_cast<TestType>(-100.0 +
                                      105.0 * std::fmod(0.6180339887 * double(i * i + 7 * i), 1.0));
  }
  std::size_t differ = 0;
  for (Index start = 0; start <= 8; ++start) {
    for (Index length = 0; length <= 70; ++length) {
      const auto segment = buffer.segment(start, length);
      Array ours(length), eigen(length);
      ours = (TestType(0.5) * segment - TestType(2)).unaryExpr(poslsh::detail::ExpOp<TestType>());
      eigen = (TestType(0.5) * segment - TestType(2)).exp();
      for (Index i = 0; i < length; ++i) {
        if (std::memcmp(&ours(i), &eigen(i), sizeof(TestType)) != 0) ++differ;
      }
    }
  }
  CHECK(differ == 0);
  // The values are e^x: at x = -2 + 0.5 * buffer(1), to Eigen's accuracy.
  const Array one = (TestType(0.5) * buffer.segment(1, 1) - TestType(2))
                        .unaryExpr(poslsh::detail::ExpOp<TestType>());
  CHECK(one(0) == Approx(std::exp(0.5 * double(buffer(1)) - 2.0)).epsilon(1e-6));
}

#include <poslsh/detail/restore_warnings.hpp>
