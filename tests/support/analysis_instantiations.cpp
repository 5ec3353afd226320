// The one definition of every analysis instantiation listed in analysis_instantiations.hpp.
#define POSLSH_TEST_INSTANTIATE_ANALYSIS
#include "analysis_instantiations.hpp"
