// poslsh internals: silences GCC's false warnings inside its own SIMD intrinsics, for the code
// between this include and `#include "poslsh/detail/restore_warnings.hpp"` (no include guard:
// each use pushes once). What is silenced, and why:
//  - "'__Y' is (maybe) used uninitialized" inside GCC 12's AVX-512 intrinsics
//    (_mm512_undefined_ps/_pd) once Eigen's pmax, pexp, floor or shuffles are inlined: a known
//    false positive (avoiding pmax by a compare and select halved the score kernel's speed);
//  - "ignoring attributes on template argument": Eigen's PacketBlock takes the packet type (an
//    attributed vector type) as a template argument, harmless, as in Eigen's own kernels.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
