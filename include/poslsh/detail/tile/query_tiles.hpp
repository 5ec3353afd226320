// poslsh internals: the query tiles of the forward kernels. Every kernel that runs on the tile
// engine (exact tiled, banded, fused LSH, paged, all heads, packed batches, plans) cuts its
// query rows into tiles aligned in absolute positions and runs the (tile, head) jobs in one
// parallel_jobs loop (detail/parallel.hpp), each thread with its TileWorkspace.
//
// Determinism: a job writes its own output rows with arithmetic that depends on the job alone,
// so the result is bitwise the same for any thread count and any job order.
// Errors: arguments are checked before the loop; an exception thrown by a job (std::bad_alloc
// from a workspace growing on a thread's first tiles) reaches the caller with its type, the
// first one of the loop (parallel_loop: no exception leaves the OpenMP region).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <vector>

#include "poslsh/core/types.hpp"
#include "poslsh/detail/parallel.hpp"
#include "poslsh/detail/tile/count_tile.hpp"
#include "poslsh/detail/tile/engine.hpp"
#include "poslsh/detail/tile/stream_stores.hpp"

namespace poslsh::detail {

/// Per-thread scratch of the tile kernels: the LSH estimator's count tiles and the engine's
/// buffers (the exact kernels use the buffers only).
template <typename Scalar>
struct TileWorkspace {
  TileCounts counts;
  Eigen::Array<Scalar, Eigen::Dynamic, 1> count_tile;
  TileBuffers<Scalar> buffers;
};

/// A query tile: rows at positions [row_begin, row_begin + rows) of row range `range`.
struct QueryTile {
  std::size_t range = 0;
  Index row_begin = 0;
  Index rows = 0;
};

/// Appends the query tiles of positions [row_begin, row_end) of range `range`: tiles aligned to
/// multiples of tile_query_rows in positions, the first and the last cut to the range, so a
/// row's tile (and with it its arithmetic) depends on its position alone.
inline void append_query_tiles(std::vector<QueryTile>& tiles, std::size_t range, Index row_begin,
                               Index row_end) {
  if (row_begin >= row_end) return;
  // Room for this range's tiles, growing geometrically across the ranges of a packed batch.
  const std::size_t needed =
      tiles.size() +
      static_cast<std::size_t>((row_end - 1) / tile_query_rows - row_begin / tile_query_rows + 1);
  if (tiles.capacity() < needed) tiles.reserve(std::max(needed, 2 * tiles.capacity()));
  for (Index i0 = row_begin / tile_query_rows * tile_query_rows; i0 < row_end;
       i0 += tile_query_rows) {
    const Index r0 = std::max(i0, row_begin);
    tiles.push_back({range, r0, std::min(i0 + tile_query_rows, row_end) - r0});
  }
}

/// The query tiles of one head that JobOrder::head_runs gives the threads one after the other,
/// for inputs of type Input: 8 for the half-precision types (the runs reuse the key tiles
/// packed for a matrix unit, as well as the band in cache), 4 for the others (K and V read in
/// place: a run reuses the band in cache, and shorter runs keep the heads' rows of a token
/// closer together in time).
template <typename Input>
inline constexpr long tiles_per_head_run = is_half_precision_v<Input> ? 8 : 4;

/// The order of the (query tile, head) jobs of parallel_query_tiles, and which key tiles the
/// engines keep for the thread's next jobs (TileBuffers::keep_key_rows, keep_packed_tiles).
enum class JobOrder {
  /// The query tiles in groups of R = tiles_per_head_run, each group's jobs head by head: job j
  /// is in group j / (R * heads), and within it the heads are outer, the tiles
  /// inner. For kernels whose tiles read a short key range near their rows (LSH, banded, a
  /// local window): the jobs in flight are a few neighbouring tiles of one head, whose key
  /// bands overlap and stay in cache from one job to the next (the bands of all heads at once
  /// may not: 32 heads of about 1000 keys at d = 128 are 32 MiB of K and V). Key tiles packed
  /// for a unit are kept for the next jobs; K and V in the compute type are read in place.
  head_runs,
  /// Job j is tile j % tiles of head j / tiles: the jobs in flight read one head's keys, which
  /// stay in cache from one tile to the next. For kernels whose tiles read every key before
  /// them (exact tiled), where the keys of all heads would not fit in cache; each key tile,
  /// read by every later query tile, is copied or packed once into the thread's KeyTileStore.
  heads_outer
};

/// The bytes of an output matrix (rows x cols of its scalar type), for parallel_query_tiles.
template <typename Matrix>
std::size_t output_bytes(const Matrix& out) {
  return static_cast<std::size_t>(out.rows()) * static_cast<std::size_t>(out.cols()) *
         sizeof(typename Matrix::Scalar);
}

/// Runs tile_job(tile, head, workspace) for every (query tile, head) pair in one parallel loop,
/// in the order `order` (head runs of tiles_per_head_run<Input> tiles, Input the type of the
/// inputs). `written_bytes` is the size of all the loop's outputs: from
/// stream_store_bytes on, the engines store their rows non-temporally (stream_stores.hpp).
template <typename Scalar, typename Input = Scalar, typename TileJob>
void parallel_query_tiles(const std::vector<QueryTile>& tiles, Index heads, JobOrder order,
                          std::size_t written_bytes, TileJob&& tile_job) {
  const auto count = static_cast<long>(tiles.size());
  const auto jobs = count * static_cast<long>(heads);
  const bool stream = streams_output(written_bytes);
  parallel_jobs<TileWorkspace<Scalar>>(jobs, [&](long j, TileWorkspace<Scalar>& workspace) {
    workspace.buffers.stream_output = stream;
    // Packed key tiles are kept in both orders; copies of the key rows only where each tile
    // reads every key before it.
    workspace.buffers.keep_packed_tiles = true;
    workspace.buffers.keep_key_rows = order == JobOrder::heads_outer;
    long tile = 0, head = 0;
    if (order == JobOrder::head_runs) {
      constexpr long length = tiles_per_head_run<Input>;
      const long group = j / (length * heads);
      const long first = group * length, job = j - first * heads;
      const long run = std::min(length, count - first);
      tile = first + job % run;
      head = job / run;
    } else {
      tile = j % count;
      head = j / count;
    }
    tile_job(tiles[static_cast<std::size_t>(tile)], static_cast<Index>(head), workspace);
  });
}

/// Rows at positions [row_begin, row_end) of `heads` heads of one sequence:
/// tile_job(head, r0, rows, workspace) computes rows [r0, r0 + rows) of one head, the jobs in
/// the order `order`; outputs of `written_bytes` in all.
template <typename Scalar, typename HeadTile>
void parallel_query_tiles(Index heads, Index row_begin, Index row_end, JobOrder order,
                          std::size_t written_bytes, HeadTile&& head_tile) {
  std::vector<QueryTile> tiles;
  append_query_tiles(tiles, 0, row_begin, row_end);
  parallel_query_tiles<Scalar>(tiles, heads, order, written_bytes,
                               [&](const QueryTile& tile, Index h, TileWorkspace<Scalar>& work) {
                                 head_tile(h, tile.row_begin, tile.rows, work);
                               });
}

}  // namespace poslsh::detail
