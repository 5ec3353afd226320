// poslsh internals: ends the region opened by detail/disable_intrinsic_warnings.hpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
