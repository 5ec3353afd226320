// poslsh benchmarks: where the fused LSH kernel's time goes, lsh_fused_phase/<phase>/<sigma>,
// on the problem of lsh_fused_sigma/<sigma> (n = 16384, float, 8 heads all at sigma, d = 64,
// causal, s = 16, the shared [n, H, d] tensors), sigma = 2, 4, .., 256:
//   counts   the count structure alone, exactly as the kernel builds it: for every (query
//            tile, head) job, in the kernel's job order on all threads, CountBias::query_tile
//            (TileCounts::build from the 16 hashes) and CountBias::key_tile (the count tile
//            expanded) for every key tile of the job's band; no products, no softmax;
//   build    CountBias::query_tile alone (the rectangles and windows of each query tile from
//            the hashes: the part of `counts` that does not depend on the band's length);
//   window   the same engine with no count structure: exact_banded with a causal window of
//            W + 1 keys, W + 1 = the fused kernel's mean keys per query rounded (the ALiBi bias
//            in place of the counts; products, softmax, tiles and job order as the fused
//            kernel's, on a regular band);
//   memory   the bytes of every job and nothing else: its 64 query rows and the K and V rows of
//            its key band read, its output rows written as the kernel writes them (a sum per
//            row, no products).
// Counters as the kernel rows, over the fused kernel's pairs (c_ij > 0) for counts and memory
// and over the window's pairs for window; evaluated_pairs (counts row) is the number of entries
// the fused kernel's score product computes: each 16-row packet of a query tile against the
// keys its rows reach, sum over packets of 16 (hi of its last row - lo of its first).
#include <cmath>
#include <poslsh/detail/tile/count_bias.hpp>
#include <poslsh/detail/tile/query_tiles.hpp>
#include <string>
#include <utility>
#include <vector>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

constexpr Index phase_n = 16384;
enum class Phase { counts, build, window, memory };

/// Evaluated score entries of the fused kernel (see the file comment), summed over heads.
long long evaluated_pairs(const std::vector<HashSet>& hashes, Index n) {
  constexpr Index Bq = detail::tile_query_rows;
  constexpr Index packet = 16;
  long long total = 0;
  detail::TileCounts counts;
  for (const HashSet& head : hashes) {
    for (Index i0 = 0; i0 < n; i0 += Bq) {
      const Index rows = std::min(Bq, n - i0);
      counts.build(head, i0, rows, n, true);
      for (Index a = 0; a < rows; a += packet) {
        const Index last = std::min(a + packet, rows) - 1;
        total += packet * (counts.hi[static_cast<std::size_t>(last)] -
                           counts.lo[static_cast<std::size_t>(a)]);
      }
    }
  }
  return total;
}

void run_phase(benchmark::State& state, Phase phase, double sigma) {
  const Index n = phase_n;
  const std::vector<double> sigmas(static_cast<std::size_t>(heads), sigma);
  const std::vector<HashSet> hashes = multihead_hashes(sigmas, default_samples, seed);
  const long long pairs = lsh_pairs(sigmas, default_samples, n);
  const auto q = input_view(Which::q, n);
  const auto k = input_view(Which::k, n);
  const auto v = input_view(Which::v, n);
  const auto out = output_view(n);
  std::vector<detail::QueryTile> tiles;
  detail::append_query_tiles(tiles, 0, 0, n);
  const auto jobs = [&](auto&& job) {
    detail::parallel_query_tiles<float>(
        tiles, heads, detail::JobOrder::head_runs, 0,
        [&](const detail::QueryTile& tile, Index h, detail::TileWorkspace<float>& work) {
          job(tile.row_begin, tile.rows, h, work);
        });
  };
  long long counted_pairs = pairs;
  MultiHeadOptions window;
  if (phase == Phase::window) {
    const auto keys = static_cast<Index>(
        std::llround(static_cast<double>(pairs) / static_cast<double>(n * heads)));
    window.method = Method::exact_banded;
    window.sigmas = sigmas;
    window.band_error = 1e-30;  // a band wider than the window
    window.window_left = std::max<Index>(keys - 1, 0);
    counted_pairs = heads * banded_pairs(n, window.window_left);
  }
  for (auto _ : state) {
    switch (phase) {
      case Phase::counts:
        jobs([&](Index i0, Index, Index h, detail::TileWorkspace<float>& work) {
          detail::CountBias<float> bias(hashes[static_cast<std::size_t>(h)], n, true, work.counts,
                                        work.count_tile);
          const detail::KeyRange reach = bias.query_tile(i0);
          const Index key_lo = reach.first, key_hi = std::min(n, reach.last) - 1;
          constexpr Index Bk = detail::tile_key_cols;
          for (Index t = key_lo / Bk; t <= key_hi / Bk; ++t) {
            const Index j0 = std::max(t * Bk, key_lo);
            const Index keys = std::min((t + 1) * Bk, key_hi + 1) - j0;
            benchmark::DoNotOptimize(bias.key_tile(j0, keys, {0, detail::tile_query_rows}));
          }
          benchmark::DoNotOptimize(work.count_tile.data());
        });
        break;
      case Phase::build:
        jobs([&](Index i0, Index, Index h, detail::TileWorkspace<float>& work) {
          detail::CountBias<float> bias(hashes[static_cast<std::size_t>(h)], n, true, work.counts,
                                        work.count_tile);
          benchmark::DoNotOptimize(bias.query_tile(i0));
        });
        break;
      case Phase::window:
        multihead_attention<float>(q, k, v, out, window);
        break;
      case Phase::memory:
        jobs([&](Index i0, Index rows, Index h, detail::TileWorkspace<float>& work) {
          work.counts.build(hashes[static_cast<std::size_t>(h)], i0, rows, n, true);
          const Index lo = work.counts.band_begin(), hi = work.counts.band_end();
          const auto k_h = k.head(h), v_h = v.head(h), q_h = q.head(h);
          auto out_h = out.head(h);
          Eigen::Matrix<float, 1, dim> sum = Eigen::Matrix<float, 1, dim>::Zero();
          for (Index j = lo; j < hi; ++j) sum += k_h.row(j) + v_h.row(j);
          // Stored as the kernel stores its rows (non-temporal where aligned: the output is
          // larger than 8 MiB).
          Eigen::Matrix<float, 1, dim> row;
          for (Index i = i0; i < i0 + rows; ++i) {
            row = q_h.row(i) + sum;
            detail::tile_divide_row(row.data(), 1.0f, &out_h.coeffRef(i, 0), dim, true);
          }
          detail::stream_store_fence();
        });
        break;
    }
    benchmark::DoNotOptimize(out.data);
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, counted_pairs, n * heads);
  if (phase == Phase::counts)
    state.counters["evaluated_pairs"] = static_cast<double>(evaluated_pairs(hashes, n));
}

const bool lsh_phases_rows_registered = [] {
  const std::pair<const char*, Phase> phases[] = {{"counts", Phase::counts},
                                                  {"build", Phase::build},
                                                  {"window", Phase::window},
                                                  {"memory", Phase::memory}};
  for (int h = 0; h < 8; ++h) {
    const double sigma = std::ldexp(1.0, h + 1);
    for (const auto& [name, phase] : phases) {
      const std::string row =
          std::string("lsh_fused_phase/") + name + "/" + std::to_string(static_cast<int>(sigma));
      register_timed(row, benchmark::kMillisecond, 0.5, run_phase, phase, sigma);
    }
  }
  return true;
}();

}  // namespace

}  // namespace poslsh::bench
