// poslsh internals: the Philox4x32-10 counter-based generator (Salmon et al., SC'11), the
// counter layout of the hashes and samplers, and the conversion of its words to uniforms. Pure
// integer arithmetic: the same key and counter give the same bits on every compiler and platform.
#pragma once

#include <array>
#include <cstdint>

namespace poslsh::detail {

using PhiloxCounter = std::array<std::uint32_t, 4>;
using PhiloxKey = std::array<std::uint32_t, 2>;

/// Ten rounds of Philox4x32 on `counter` under `key`.
inline PhiloxCounter philox4x32_10(PhiloxCounter counter, PhiloxKey key) {
  constexpr std::uint32_t multiplier0 = 0xD2511F53u;
  constexpr std::uint32_t multiplier1 = 0xCD9E8D57u;
  constexpr std::uint32_t weyl0 = 0x9E3779B9u;
  constexpr std::uint32_t weyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t product0 = std::uint64_t{multiplier0} * counter[0];
    const std::uint64_t product1 = std::uint64_t{multiplier1} * counter[2];
    const auto hi0 = static_cast<std::uint32_t>(product0 >> 32);
    const auto lo0 = static_cast<std::uint32_t>(product0);
    const auto hi1 = static_cast<std::uint32_t>(product1 >> 32);
    const auto lo1 = static_cast<std::uint32_t>(product1);
    counter = {hi1 ^ counter[1] ^ key[0], lo1, hi0 ^ counter[3] ^ key[1], lo0};
    key[0] += weyl0;
    key[1] += weyl1;
  }
  return counter;
}

/// Philox4x32-10 of the counter (index, stream, tag) under the key `seed`: the counter words are
/// the low and high halves of index, then of stream, the last one xor (tag << 28), so each tag
/// (top 4 bits) draws from its own counters. The layout of every hash and sampler draw.
inline PhiloxCounter philox_words(std::uint64_t seed, std::uint64_t stream, std::uint64_t index,
                                  std::uint32_t tag) {
  const PhiloxKey key = {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
  const PhiloxCounter counter = {
      static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
      static_cast<std::uint32_t>(stream), static_cast<std::uint32_t>(stream >> 32) ^ (tag << 28)};
  return philox4x32_10(counter, key);
}

/// 53-bit uniform on (0, 1] from two 32-bit words: (top 53 bits + 1) * 2^-53.
inline double uniform_open_closed(std::uint32_t high, std::uint32_t low) {
  const std::uint64_t bits = (std::uint64_t{high} << 32) | low;
  return static_cast<double>((bits >> 11) + 1) * 0x1.0p-53;
}

/// 53-bit uniform on the open interval (0, 1): (top 53 bits + 1/2) 2^-53.
inline double uniform_open(std::uint32_t high, std::uint32_t low) {
  const std::uint64_t bits = (std::uint64_t{high} << 32) | low;
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
}

}  // namespace poslsh::detail
