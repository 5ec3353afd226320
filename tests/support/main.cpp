// Catch2 2.x needs one translation unit that defines main; Catch2 3 links Catch2WithMain.
#ifdef POSLSH_CATCH2_OWN_MAIN
#define CATCH_CONFIG_MAIN
#endif
#include "catch_compat.hpp"
