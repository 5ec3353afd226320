// poslsh: Positional LSH for ALiBi attention. Includes every public header.
#pragma once

#include "poslsh/alibi_kernel.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/masks.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/reference_attention.hpp"
#include "poslsh/slopes.hpp"
#include "poslsh/types.hpp"
#include "poslsh/version.hpp"
