// poslsh: Positional LSH for ALiBi attention. Includes every public header.
#pragma once

#include "poslsh/alibi_kernel.hpp"
#include "poslsh/banded_attention.hpp"
#include "poslsh/decode.hpp"
#include "poslsh/fused_attention.hpp"
#include "poslsh/hash.hpp"
#include "poslsh/heads_view.hpp"
#include "poslsh/masks.hpp"
#include "poslsh/multihead.hpp"
#include "poslsh/partition.hpp"
#include "poslsh/per_sample_attention.hpp"
#include "poslsh/reference_attention.hpp"
#include "poslsh/slopes.hpp"
#include "poslsh/tiled_attention.hpp"
#include "poslsh/types.hpp"
#include "poslsh/version.hpp"
