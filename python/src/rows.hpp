// poslsh Python bindings: the exact kernels' query rows split across OpenMP threads.
#pragma once

#include <algorithm>
#include <exception>

#include "common.hpp"
#include "poslsh/attention/tiled.hpp"

namespace poslsh_python {

/// Runs rows(begin, end) over the rows [0, n) of queries at positions p0 .. p0 + n - 1, in
/// chunks cut at the positions that are multiples of tiled_query_tile (the kernels' tiles, so
/// no chunk costs extra work), in parallel (OpenMP). The exact kernels give each row bitwise
/// the same result for any split.
template <typename Rows>
void parallel_rows(Index n, Index p0, Rows&& rows) {
  const Index tile = poslsh::tiled_query_tile;
  const Index first = p0 / tile;
  const auto chunks = n == 0 ? 0L : static_cast<long>((p0 + n + tile - 1) / tile - first);
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1)
  for (long chunk = 0; chunk < chunks; ++chunk) {
    const Index begin = std::max<Index>(0, (first + static_cast<Index>(chunk)) * tile - p0);
    try {
      rows(begin, std::min(n, (first + static_cast<Index>(chunk) + 1) * tile - p0));
    } catch (...) {
#pragma omp critical(poslsh_python_rows)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace poslsh_python
