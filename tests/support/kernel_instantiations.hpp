// The heavy kernel instantiations of the test suite, compiled once for the whole test executable:
// in the test build (POSLSH_TEST_EXTERN_KERNELS defined) every test file sees these as explicit
// instantiation declarations (`extern template`); kernel_instantiations.cpp, which defines
// POSLSH_TEST_INSTANTIATE_KERNELS, holds the one definition of each public kernel below, and
// engine_instantiations.cpp, which defines POSLSH_TEST_INSTANTIATE_ENGINES, the one definition of
// the tile work of each engine poslsh/tile_engines.hpp lists (two units, compiled side by side).
// Without the macros (a test file compiled on its own) the declarations are left out and everything
// is instantiated implicitly as in any user program.
#pragma once

#include <poslsh/attention/banded.hpp>
#include <poslsh/attention/decode.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/interop/block_kernel.hpp>
#include <poslsh/multihead/attention.hpp>
#include <poslsh/reference/attention.hpp>
#include <poslsh/tile_engines.hpp>

#if defined(POSLSH_TEST_INSTANTIATE_KERNELS)
#define POSLSH_TEST_KERNEL template
#elif defined(POSLSH_TEST_EXTERN_KERNELS)
#define POSLSH_TEST_KERNEL extern template
#endif

#ifdef POSLSH_TEST_KERNEL
// The list, once per scalar type.
#define POSLSH_TEST_KERNELS_OF(S)                                                                  \
  POSLSH_TEST_KERNEL void poslsh::alibi_attention_tiled<S>(ConstMatrixRef<S>, ConstMatrixRef<S>,   \
                                                           ConstMatrixRef<S>, double,              \
                                                           MatrixRef<S>, const AttentionOptions&); \
  POSLSH_TEST_KERNEL poslsh::RowMatrix<S> poslsh::alibi_attention_tiled<S>(                        \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, const AttentionOptions&);   \
  POSLSH_TEST_KERNEL void poslsh::alibi_attention_tiled_rows<S>(                                   \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, Index, Index, MatrixRef<S>, \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL void poslsh::alibi_attention_banded<S>(                                       \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, Index, MatrixRef<S>,        \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL poslsh::RowMatrix<S> poslsh::alibi_attention_banded<S>(                       \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, Index,                      \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL void poslsh::alibi_attention_banded_rows<S>(                                  \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, Index, Index, Index,        \
      MatrixRef<S>, const AttentionOptions&);                                                      \
  POSLSH_TEST_KERNEL void poslsh::lsh_attention_fused<S>(ConstMatrixRef<S>, ConstMatrixRef<S>,     \
                                                         ConstMatrixRef<S>, const HashSet&,        \
                                                         MatrixRef<S>, const AttentionOptions&);   \
  POSLSH_TEST_KERNEL poslsh::RowMatrix<S> poslsh::lsh_attention_fused<S>(                          \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, const HashSet&,                     \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL void poslsh::lsh_attention_per_sample<S>(                                     \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, const HashSet&, MatrixRef<S>,       \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL poslsh::RowMatrix<S> poslsh::lsh_attention_per_sample<S>(                     \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, const HashSet&,                     \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL void poslsh::fixed_blocks_attention<S>(                                       \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, MatrixRef<S>,               \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL poslsh::RowMatrix<S> poslsh::fixed_blocks_attention<S>(                       \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, const AttentionOptions&);   \
  POSLSH_TEST_KERNEL void poslsh::alibi_attention_reference<S>(                                    \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, MatrixRef<S>,               \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL poslsh::RowMatrix<S> poslsh::alibi_attention_reference<S>(                    \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, double, const AttentionOptions&);   \
  POSLSH_TEST_KERNEL void poslsh::lsh_attention_decode<S>(                                         \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, Index, const HashSet&,              \
      MatrixRef<S>, const AttentionOptions&);                                                      \
  POSLSH_TEST_KERNEL void poslsh::alibi_attention_decode_exact<S>(                                 \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, Index, double, MatrixRef<S>,        \
      const AttentionOptions&);                                                                    \
  POSLSH_TEST_KERNEL void poslsh::multihead_attention<S>(HeadsView<const S>, HeadsView<const S>,   \
                                                         HeadsView<const S>, HeadsView<S>,         \
                                                         const MultiHeadOptions&);                 \
  POSLSH_TEST_KERNEL void poslsh::lsh_attention_by_blocks<S, poslsh::PlainBlockAttention<S>>(      \
      ConstMatrixRef<S>, ConstMatrixRef<S>, ConstMatrixRef<S>, const HashSet&, MatrixRef<S>,       \
      const AttentionOptions&, PlainBlockAttention<S>&&);

POSLSH_TEST_KERNELS_OF(float)
POSLSH_TEST_KERNELS_OF(double)

#undef POSLSH_TEST_KERNELS_OF
#undef POSLSH_TEST_KERNEL
#endif

// The tile engines every kernel runs, compiled once (poslsh/tile_engines.hpp).
#if defined(POSLSH_TEST_INSTANTIATE_ENGINES)
POSLSH_DEFINE_TILE_ENGINES()
#elif defined(POSLSH_TEST_INSTANTIATE_KERNELS) || defined(POSLSH_TEST_EXTERN_KERNELS)
POSLSH_EXTERN_TILE_ENGINES()
#endif
