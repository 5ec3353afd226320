// The one definition of every kernel instantiation listed in kernel_instantiations.hpp.
#define POSLSH_TEST_INSTANTIATE_KERNELS
#include "kernel_instantiations.hpp"
