// The one definition of every tile engine's tile work listed in kernel_instantiations.hpp.
#define POSLSH_TEST_INSTANTIATE_ENGINES
#include "kernel_instantiations.hpp"
