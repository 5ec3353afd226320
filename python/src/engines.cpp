// The one definition of the tile work of every engine poslsh/tile_engines.hpp lists, for the whole
// module (the binding files see its explicit instantiation declarations: common.hpp).
#include "poslsh/tile_engines.hpp"

POSLSH_DEFINE_TILE_ENGINES()
