// poslsh/tile_engines.hpp: the tile engines compiled once in a program of several translation
// units.
//
// Every kernel runs a tile engine (detail::TileEngine) per scalar type, bias policy (exact ALiBi,
// the per-sample block windows, the LSH counts) and key source (K and V read in place, half-
// precision keys widened or multiplied in pairs, a paged or a bounded cache). A translation unit
// that calls kernels compiles the engines it reaches, so a program whose units call kernels
// compiles each engine once per unit. With
//
//   POSLSH_EXTERN_TILE_ENGINES()   at global scope in every unit but one, after this header
//   POSLSH_DEFINE_TILE_ENGINES()   in that one
//
// the tile work of the engines listed below is compiled in that one unit only (an explicit
// instantiation of TileEngine::query_tile, from which all of it is reached; each unit keeps the
// engine's construction and the writing of its output rows). Engines outside the list are
// compiled where they are used, as without the macros. Every unit must be compiled with the same
// instruction set (e.g. -march) and the same Eigen configuration: the engines' register blocks
// follow them.
#pragma once

#include "poslsh/attention/paged.hpp"
#include "poslsh/cache/bounded_kv_cache.hpp"
#include "poslsh/core/matrix_units.hpp"
#include "poslsh/detail/tile/alibi_bias.hpp"
#include "poslsh/detail/tile/count_bias.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/per_sample.hpp"

namespace poslsh::detail::listed_engines {
// The key sources of the list: half-precision keys (H) widened to float, read from K and V
// matrices, a paged cache or a bounded one; multiplied in pairs on AVX512-BF16 or the AMX tiles.
template <typename H>
using Widened = WideningKV<float, H, StridedRows<H>>;
template <typename H>
using WidenedPaged = WideningKV<float, H, PagedRows<H>>;
template <typename H>
using WidenedBounded = WideningKV<float, H, BoundedRows<H>>;
#if POSLSH_X86_UNITS
template <typename H>
using Paired = PairedHalfKV<H, void, StridedRows<H>>;
template <typename H>
using PairedAmx = PairedHalfKV<H, AmxNativeTiles<H>, StridedRows<H>>;
#endif
}  // namespace poslsh::detail::listed_engines

/// X(Scalar, Bias, KV, QScalar) for the engines of one bias policy (a template of the scalar
/// type: detail::AlibiBias, detail::BlockWindowBias or detail::CountBias): float and double over
/// K and V in place or in a paged cache, and float over bfloat16 and float16 keys
/// (POSLSH_TILE_HALF_ENGINES_OF; in pairs on the x86 units).
#define POSLSH_TILE_ENGINES_OF(X, BIAS)                                   \
  X(float, BIAS<float>, ::poslsh::detail::ContiguousKV<float>, float)     \
  X(double, BIAS<double>, ::poslsh::detail::ContiguousKV<double>, double) \
  X(float, BIAS<float>, ::poslsh::detail::PagedRows<float>, float)        \
  X(double, BIAS<double>, ::poslsh::detail::PagedRows<double>, double)    \
  POSLSH_TILE_HALF_ENGINES_OF(X, BIAS, ::Eigen::bfloat16)                 \
  POSLSH_TILE_HALF_ENGINES_OF(X, BIAS, ::Eigen::half)                     \
  POSLSH_TILE_PAIRED_ENGINES_OF(X, BIAS)
/// The float engines over keys of the half-precision type H widened: from K and V matrices or a
/// paged cache (queries of type H or float), from a bounded cache (queries of type H).
#define POSLSH_TILE_HALF_ENGINES_OF(X, BIAS, H)                                   \
  X(float, BIAS<float>, ::poslsh::detail::listed_engines::Widened<H>, H)          \
  X(float, BIAS<float>, ::poslsh::detail::listed_engines::Widened<H>, float)      \
  X(float, BIAS<float>, ::poslsh::detail::listed_engines::WidenedPaged<H>, H)     \
  X(float, BIAS<float>, ::poslsh::detail::listed_engines::WidenedPaged<H>, float) \
  X(float, BIAS<float>, ::poslsh::detail::listed_engines::WidenedBounded<H>, H)
#if POSLSH_X86_UNITS
#define POSLSH_TILE_PAIRED_ENGINES_OF(X, BIAS)                                          \
  X(float, BIAS<float>, ::poslsh::detail::listed_engines::Paired<::Eigen::bfloat16>,    \
    ::Eigen::bfloat16)                                                                  \
  X(float, BIAS<float>, ::poslsh::detail::listed_engines::PairedAmx<::Eigen::bfloat16>, \
    ::Eigen::bfloat16)                                                                  \
  X(float, BIAS<float>, ::poslsh::detail::listed_engines::PairedAmx<::Eigen::half>, ::Eigen::half)
#else
#define POSLSH_TILE_PAIRED_ENGINES_OF(X, BIAS)
#endif

/// X(Scalar, Bias, KV, QScalar) for every engine of the list.
#define POSLSH_TILE_ENGINES(X)                                 \
  POSLSH_TILE_ENGINES_OF(X, ::poslsh::detail::AlibiBias)       \
  POSLSH_TILE_ENGINES_OF(X, ::poslsh::detail::BlockWindowBias) \
  POSLSH_TILE_ENGINES_OF(X, ::poslsh::detail::CountBias)

#define POSLSH_TILE_ENGINE_EXTERN(S, BIAS, KV, Q)                                             \
  extern template void ::poslsh::detail::TileEngine<S, BIAS, KV, Q>::query_tile(Index, Index, \
                                                                                Index);
#define POSLSH_TILE_ENGINE_DEFINE(S, BIAS, KV, Q) \
  template void ::poslsh::detail::TileEngine<S, BIAS, KV, Q>::query_tile(Index, Index, Index);

/// Explicit instantiation declarations of the listed engines' tile work (every unit but one).
#define POSLSH_EXTERN_TILE_ENGINES() POSLSH_TILE_ENGINES(POSLSH_TILE_ENGINE_EXTERN)
/// Their explicit instantiation definitions (one unit of the program).
#define POSLSH_DEFINE_TILE_ENGINES() POSLSH_TILE_ENGINES(POSLSH_TILE_ENGINE_DEFINE)
