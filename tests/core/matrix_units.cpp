// The matrix units of half-precision attention (core/matrix_units.hpp, Precision): the unit
// table and the run-time choice, and on every unit this CPU has (the others are skipped with a
// message) the kernels of the tile engine on bfloat16 Q, K and V:
//  - accuracy: against double formulas on the same rounded inputs, at most 2x the error of a
//    plain bfloat16 attention written here (bfloat16 operands, float sums, float softmax, the
//    probabilities rounded to bfloat16 before they weight the values), over random, smooth and
//    heavy-tailed inputs, causal and bidirectional, n not a multiple of the tile, sigma 0.5 to
//    1e6;
//  - bitwise the same for 1 and 2 threads, chunked prefill bitwise one prefill, every kernel
//    on the engine (banded, fused, partitions, per-sample, fixed blocks, multi-head, packed
//    batches, the block kernel with lse) on the chosen unit;
//  - Precision::float_products bitwise the float kernel on the widened inputs.
// amx_fp16 runs the same checks on float16 Q, K and V against a plain float16 attention.
// amx_bf16 and amx_fp16 run these checks twice: on the software emulation of the tile instructions
// (AmxEmulatedTiles, support/amx_emulation.hpp, on any CPU with avx512_bf16) and on the CPU's
// tiles where it has them; the emulation itself is checked against Intel's TDPBF16PS and TDPFP16PS
// on values where the order of its sums shows, and the emulated path against avx512_bf16 within the
// error bound (they sum the same products in another order). The checks reach a tile layer other
// than the library's through the engine's AmxTiles template argument: each single-head call is the
// all-heads entry (detail::one_sequence_forward, the body of multihead_attention) on that head
// alone, the block kernel its fold_block, the stored partitions the fused kernel's engine rows. On
// a CPU with AMX the avx512_bf16 checks run with the AMX tiles turned off (AmxTilesOff), so they
// test that unit there too.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <poslsh/attention/banded.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/partition.hpp>
#include <poslsh/attention/per_sample.hpp>
#include <poslsh/attention/tiled.hpp>
#include <poslsh/core/matrix_units.hpp>
#include <poslsh/detail/tile/amx_kernels.hpp>
#include <poslsh/interop/block_kernel.hpp>
#include <poslsh/lsh/partition.hpp>
#include <poslsh/lsh/samplers.hpp>
#include <poslsh/multihead/attention.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "amx_emulation.hpp"
#include "half_support.hpp"
#include "test_support.hpp"

using poslsh::MatrixUnit;
using poslsh::detail::AmxNativeTiles;
using poslsh_test::AmxEmulatedTiles;
using poslsh_test::AmxTilesOff;
using bf16 = Eigen::bfloat16;

namespace {

/// The inputs of the accuracy sweep.
enum class Inputs { random, smooth, heavy_tailed };

constexpr poslsh::EnumName<Inputs> inputs_names[] = {
    {Inputs::random, "random"}, {Inputs::smooth, "smooth"}, {Inputs::heavy_tailed, "heavy-tailed"}};

/// An n x d matrix of the given kind rounded to Half (bfloat16 or float16): standard normal
/// entries; smooth rows (sines of the position, a slowly turning direction); or Student-t entries
/// with 2 degrees of freedom (normal / sqrt(chi^2_2 / 2), a few entries in the tens).
template <typename Half = bf16>
RowMatrix<Half> make_input(Inputs inputs, Index n, Index d, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::exponential_distribution<double> exponential;
  RowMatrix<double> m(n, d);
  for (Index i = 0; i < n; ++i) {
    for (Index c = 0; c < d; ++c) {
      switch (inputs) {
        case Inputs::random:
          m(i, c) = normal(rng);
          break;
        case Inputs::smooth:
          m(i, c) =
              1.5 * std::sin(0.02 * static_cast<double>(i) * (1.0 + 0.1 * static_cast<double>(c)) +
                             static_cast<double>(seed % 7) + static_cast<double>(c));
          break;
        case Inputs::heavy_tailed:
          // chi^2 with 2 degrees of freedom is 2 Exp(1): t_2 = Z / sqrt(Exp(1)).
          m(i, c) = normal(rng) / std::sqrt(std::max(exponential(rng), 1e-3));
          break;
      }
    }
  }
  return m.cast<float>().cast<Half>();
}

/// The key weights of row i (position i): 1 (or the LSH count c_ij) where the row keeps key j,
/// 0 elsewhere, and the ALiBi bias -|i - j| / sigma (0 for the LSH kernels).
struct RowWeights {
  std::vector<double> weight, bias;
};

/// Exact ALiBi over keys lo <= i - j <= hi.
RowWeights alibi_weights(Index i, Index n, double sigma, Index lo, Index hi) {
  RowWeights w{std::vector<double>(static_cast<std::size_t>(n), 0.0),
               std::vector<double>(static_cast<std::size_t>(n), 0.0)};
  for (Index j = 0; j < n; ++j) {
    const auto u = static_cast<std::size_t>(j);
    if (i - j >= lo && i - j <= hi) w.weight[u] = 1.0;
    w.bias[u] = -static_cast<double>(std::abs(i - j)) / sigma;
  }
  return w;
}

/// The LSH counts c_ij of `hashes` (causal: j <= i), no bias.
RowWeights count_weights(Index i, Index n, const HashSet& hashes, Masking masking) {
  RowWeights w{std::vector<double>(static_cast<std::size_t>(n), 0.0),
               std::vector<double>(static_cast<std::size_t>(n), 0.0)};
  for (const poslsh::BinHash& hash : hashes) {
    const poslsh::Block block = poslsh::block_containing(hash, i, n);
    for (Index j = block.begin; j < block.end; ++j) w.weight[static_cast<std::size_t>(j)] += 1.0;
  }
  if (masking == Masking::causal)
    for (Index j = i + 1; j < n; ++j) w.weight[static_cast<std::size_t>(j)] = 0.0;
  return w;
}

/// The double formula out_i = sum_j w_ij e^{x_ij - M_i} v_j / sum_j w_ij e^{x_ij - M_i},
/// x_ij = tau q_i.k_j + bias_ij, on the (rounded) inputs; and the plain bfloat16 attention of
/// the same rows: q_i.k_j summed in float over the bfloat16 products (exact in float), x_ij =
/// tau (float) times it plus the bias (float), the softmax in float, each w_ij e^{x_ij - M_i}
/// rounded to bfloat16 before it weights v_j, the weighted values summed in float and divided
/// by the float sum of the unrounded probabilities.
template <typename Half, typename Weights>
void references(const RowMatrix<Half>& qh, const RowMatrix<Half>& kh, const RowMatrix<Half>& vh,
                double tau, Weights&& weights, RowMatrix<double>& exact, RowMatrix<float>& plain) {
  const Index n = qh.rows(), d = qh.cols(), dv = vh.cols();
  const RowMatrix<double> q = poslsh_test::to_double(qh), k = poslsh_test::to_double(kh),
                          v = poslsh_test::to_double(vh);
  const RowMatrix<float> qf = poslsh_test::widened(qh), kf = poslsh_test::widened(kh),
                         vf = poslsh_test::widened(vh);
  exact.resize(n, dv);
  plain.resize(n, dv);
  const auto tau_f = static_cast<float>(tau);
  for (Index i = 0; i < n; ++i) {
    const RowWeights w = weights(i);
    double max64 = -std::numeric_limits<double>::infinity();
    float max32 = -std::numeric_limits<float>::infinity();
    std::vector<double> x64(static_cast<std::size_t>(n));
    std::vector<float> x32(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j) {
      const auto u = static_cast<std::size_t>(j);
      if (w.weight[u] == 0.0) continue;
      x64[u] = tau * q.row(i).dot(k.row(j)) + w.bias[u];
      float dot = 0.0f;
      for (Index c = 0; c < d; ++c) dot += qf(i, c) * kf(j, c);
      x32[u] = tau_f * dot + static_cast<float>(w.bias[u]);
      max64 = std::max(max64, x64[u]);
      max32 = std::max(max32, x32[u]);
    }
    Eigen::RowVectorXd num64 = Eigen::RowVectorXd::Zero(dv);
    Eigen::RowVectorXf num32 = Eigen::RowVectorXf::Zero(dv);
    double sum64 = 0.0;
    float sum32 = 0.0f;
    for (Index j = 0; j < n; ++j) {
      const auto u = static_cast<std::size_t>(j);
      if (w.weight[u] == 0.0) continue;
      const double p64 = w.weight[u] * std::exp(x64[u] - max64);
      sum64 += p64;
      num64 += p64 * v.row(j);
      const float p32 = static_cast<float>(w.weight[u]) * std::exp(x32[u] - max32);
      sum32 += p32;
      num32 += static_cast<float>(Half(p32)) * vf.row(j);
    }
    exact.row(i) = num64 / sum64;
    plain.row(i) = num32 / sum32;
  }
}

/// max_ij |a_ij - b_ij|.
double max_error(const RowMatrix<float>& a, const RowMatrix<double>& b) {
  return (a.cast<double>() - b).cwiseAbs().maxCoeff();
}

/// Whether this CPU has `unit`; when not, says so (the caller skips the unit's checks).
bool have_unit(MatrixUnit unit) {
  if (poslsh::matrix_unit_available(unit)) return true;
  WARN("skipped: this CPU has no " << poslsh::enum_name(unit) << " unit");
  return false;
}

/// Options selecting the matrix unit (the default precision).
AttentionOptions unit_options(Masking masking) {
  AttentionOptions options = with_masking(masking);
  options.precision = Precision::matrix_units;
  return options;
}

/// Runs body() with OpenMP on `threads` threads (the count restored after).
template <typename Body>
void with_threads(int threads, Body&& body) {
#ifdef _OPENMP
  const int restore = omp_get_max_threads();
  omp_set_num_threads(threads);
  body();
  omp_set_num_threads(restore);
#else
  static_cast<void>(threads);
  body();
#endif
}

/// Whether Tiles is the library's tile layer (the one the public calls use).
template <template <typename> class Tiles>
constexpr bool native_tiles = std::is_same_v<Tiles<bf16>, AmxNativeTiles<bf16>>;

/// The tile layer Tiles as a value (a check deduces Tiles from it).
template <template <typename> class Tiles>
struct TileLayer {};

/// run(TileLayer<Tiles>{}) on the tile layer with which the tile engine takes the AVX512-BF16
/// unit: the CPU's tiles turned off (AmxTilesOff) on a CPU with AMX, else the CPU's own.
template <typename Run>
void on_avx512_bf16_layer(Run&& run) {
  if (poslsh::matrix_unit_available(MatrixUnit::amx_bf16))
    run(TileLayer<AmxTilesOff>{});
  else
    run(TileLayer<AmxNativeTiles>{});
}

/// The unit calls on Half Q, K and V with `options` multiply on, AMX on the tile layer Tiles.
template <template <typename> class Tiles, typename Half>
MatrixUnit unit_on(const AttentionOptions& options) {
  return poslsh::detail::tile_engine_unit<Half, Half, Tiles>(options.precision);
}

/// A one-head view of a row-major matrix.
template <typename Matrix>
auto one_head_view(Matrix& m) {
  using Element = std::remove_pointer_t<decltype(m.data())>;
  return poslsh::HeadsView<Element>{m.data(), m.rows(), 1, m.cols(), m.outerStride(), m.cols()};
}

/// The all-heads forward (detail::one_sequence_forward, the body of multihead_attention) of
/// `heads` on views of Half, AMX on the tile layer Tiles.
template <template <typename> class Tiles, typename Half>
void heads_on(const poslsh::HeadsView<const Half>& q, const poslsh::HeadsView<const Half>& k,
              const poslsh::HeadsView<const Half>& v, const poslsh::HeadsView<float>& out,
              const AttentionOptions& options, const std::vector<poslsh::HeadMethod>& heads) {
  poslsh::detail::one_sequence_forward<float, Tiles>("multihead_attention", q, k, v, out, options,
                                                     [&] { return heads; });
}

/// One head's attention by head.method (its sigma, band W or hashes) on Half Q, K, V into out:
/// the method's single-head call on the library's tile layer; on another layer Tiles, the
/// all-heads entry on that head alone (AMX on Tiles).
template <template <typename> class Tiles, typename Half>
void one_head(const poslsh::HeadMethod& head, const poslsh::ConstMatrixRef<Half>& q,
              const poslsh::ConstMatrixRef<Half>& k, const poslsh::ConstMatrixRef<Half>& v,
              RowMatrix<float>& out, const AttentionOptions& options) {
  if constexpr (native_tiles<Tiles>) {
    switch (head.method) {
      case poslsh::Method::exact_tiled:
        poslsh::alibi_attention_tiled<Half, Half, float>(q, k, v, head.sigma, out, options);
        break;
      case poslsh::Method::exact_banded:
        poslsh::alibi_attention_banded<Half, Half, float>(q, k, v, head.sigma, head.band, out,
                                                          options);
        break;
      case poslsh::Method::lsh_fused:
        poslsh::lsh_attention_fused<Half, Half, float>(q, k, v, head.hashes, out, options);
        break;
      case poslsh::Method::lsh_per_sample:
      case poslsh::Method::fixed_blocks:
        poslsh::lsh_attention_per_sample<Half, Half, float>(q, k, v, head.hashes, out, options);
        break;
      case poslsh::Method::mean_of_outputs: {
        // The mean over the samples of per-sample attention on each one's blocks, each on the
        // unit, in float.
        RowMatrix<float> sample(q.rows(), v.cols());
        out.setZero();
        for (const poslsh::BinHash& hash : head.hashes) {
          poslsh::lsh_attention_per_sample<Half, Half, float>(q, k, v, HashSet{hash}, sample,
                                                              options);
          out += sample;
        }
        out /= static_cast<float>(head.hashes.size());
        break;
      }
    }
  } else {
    heads_on<Tiles, Half>(one_head_view(q), one_head_view(k), one_head_view(v), one_head_view(out),
                          options, {head});
  }
}

/// The fused kernel's rows on the counts of `counts` (a HashSet or stored partitions) for Q, K, V
/// at positions 0 .. n - 1, query tile by query tile as lsh_attention_fused runs them
/// (detail::fused_tile: CountBias on the tile engine), AMX on the tile layer Tiles.
template <template <typename> class Tiles, typename Half, typename Counts>
void fused_rows_on(const poslsh::ConstMatrixRef<Half>& q, const poslsh::ConstMatrixRef<Half>& k,
                   const poslsh::ConstMatrixRef<Half>& v, const Counts& counts,
                   RowMatrix<float>& out, const AttentionOptions& options) {
  const Index n = q.rows();
  const auto tau = static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.cols())));
  poslsh::detail::TileWorkspace<float> work;
  for (Index i0 = 0; i0 < n; i0 += poslsh::detail::tile_query_rows) {
    const Index rows = std::min(poslsh::detail::tile_query_rows, n - i0);
    poslsh::detail::CountBias<float> bias(counts, n, options.masking == Masking::causal,
                                          work.counts, work.count_tile);
    poslsh::detail::engine_rows<float, Half, Half, Tiles>(q, k, v, tau, bias, work.buffers, 0,
                                                          options.precision, i0, i0 + rows,
                                                          out.middleRows(i0, rows));
  }
}

/// PlainBlockAttention's block (its body: detail::fold_block over the whole block), AMX on the
/// tile layer Tiles, under Precision::matrix_units.
template <template <typename> class Tiles, typename Half>
void block_on(const poslsh::ConstMatrixRef<Half>& q, const poslsh::ConstMatrixRef<Half>& k,
              const poslsh::ConstMatrixRef<Half>& v, bool causal, float tau, RowMatrix<float>& out,
              Eigen::VectorXf& lse) {
  const Index n = q.rows();
  poslsh::detail::SoftmaxPartials<float> state;
  poslsh::detail::TileBuffers<float> buffers;
  state.resize(n, v.cols());
  state.clear(0, n);
  poslsh::detail::fold_block<Half, Half, float, Tiles>(
      q, k, v, tau, causal, 0, n, state.engine_state(0), buffers, Precision::matrix_units);
  for (Index r = 0; r < n; ++r) state.finish(r, out.row(r));
  lse = (state.max + state.sum.log()).matrix();
}

/// The head of `method` with these parameters.
poslsh::HeadMethod head_method(poslsh::Method method, double sigma, Index band = 0,
                               HashSet hashes = {}) {
  poslsh::HeadMethod head;
  head.method = method;
  head.sigma = sigma;
  head.band = band;
  head.hashes = std::move(hashes);
  return head;
}

/// Whether the emulated tile instructions ran since the last call (or since construction).
class EmulationWatch {
 public:
  EmulationWatch() : last_(poslsh_test::emulated_products()) {}
  bool ran() {
    const long long now = poslsh_test::emulated_products();
    const bool any = now > last_;
    last_ = now;
    return any;
  }

 private:
  long long last_;
};

/// body(watch) with the AMX units on the emulated tiles (skipped, with a message, on a CPU
/// without avx512_bf16, which the emulation needs); the emulation must have run in it.
template <typename Body>
void on_emulated_tiles(Body&& body) {
  if (!poslsh::matrix_unit_available(MatrixUnit::avx512_bf16)) {
    WARN("skipped: the AMX emulation needs avx512_bf16, which this CPU does not have");
    return;
  }
  const long long before = poslsh_test::emulated_products();
  EmulationWatch watch;
  body(watch);
  CHECK(poslsh_test::emulated_products() > before);
}

/// The accuracy sweep on `unit` (the unit Half calls use here with AMX on the tile layer Tiles,
/// checked first).
template <template <typename> class Tiles, typename Half = bf16>
void accuracy_sweep(MatrixUnit unit, TileLayer<Tiles> = {}) {
  REQUIRE(unit_on<Tiles, Half>(unit_options(Masking::causal)) == unit);
  std::uint64_t seed = 100;
  for (const Inputs inputs : {Inputs::random, Inputs::smooth, Inputs::heavy_tailed}) {
    for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (const double sigma : {0.5, 16.0, 1e6}) {
        // n and d not multiples of the tiles (64 rows, 16 x 32 products), d over 64 columns,
        // d_v over 64 value columns.
        for (const auto& size : {std::pair<Index, Index>{200, 64}, {77, 37}, {130, 81}}) {
          const Index n = size.first, d = size.second;
          INFO(poslsh_test::name_in(inputs_names, inputs)
               << ", n " << n << ", d " << d << ", sigma " << sigma
               << (masking == Masking::causal ? ", causal" : ", bidir."));
          const RowMatrix<Half> q = make_input<Half>(inputs, n, d, ++seed),
                                k = make_input<Half>(inputs, n, d, ++seed),
                                v = make_input<Half>(inputs, n, d + 3, ++seed);
          const double tau = 1.0 / std::sqrt(static_cast<double>(d));
          const AttentionOptions options = unit_options(masking);
          const bool causal = masking == Masking::causal;
          RowMatrix<double> exact;
          RowMatrix<float> plain, out(n, d + 3);
          {
            INFO("alibi_attention_tiled");
            references(
                q, k, v, tau,
                [&](Index i) { return alibi_weights(i, n, sigma, causal ? 0 : -n, n); }, exact,
                plain);
            one_head<Tiles, Half>(head_method(poslsh::Method::exact_tiled, sigma), q, k, v, out,
                                  options);
            CHECK(max_error(out, exact) <= 2.0 * max_error(plain, exact));
          }
          {
            const Index band = 40;
            INFO("alibi_attention_banded");
            references(
                q, k, v, tau,
                [&](Index i) { return alibi_weights(i, n, sigma, causal ? 0 : -band, band); },
                exact, plain);
            one_head<Tiles, Half>(head_method(poslsh::Method::exact_banded, sigma, band), q, k, v,
                                  out, options);
            CHECK(max_error(out, exact) <= 2.0 * max_error(plain, exact));
          }
          {
            const HashSet hashes = poslsh::rbf_hashes(std::min(sigma, 64.0), 8, seed, 1);
            INFO("lsh_attention_fused and lsh_attention_per_sample");
            references(
                q, k, v, tau, [&](Index i) { return count_weights(i, n, hashes, masking); }, exact,
                plain);
            one_head<Tiles, Half>(head_method(poslsh::Method::lsh_fused, sigma, 0, hashes), q, k, v,
                                  out, options);
            CHECK(max_error(out, exact) <= 2.0 * max_error(plain, exact));
            one_head<Tiles, Half>(head_method(poslsh::Method::lsh_per_sample, sigma, 0, hashes), q,
                                  k, v, out, options);
            CHECK(max_error(out, exact) <= 2.0 * max_error(plain, exact));
          }
        }
      }
    }
  }
}

/// 1 and 2 threads bitwise the same, chunked prefill bitwise one prefill, on `unit` (AMX on the
/// tile layer Tiles).
template <typename Scalar, template <typename> class Tiles = AmxNativeTiles>
void kept_key_tile_checks();

template <template <typename> class Tiles, typename Half = bf16>
void thread_and_chunk_checks(MatrixUnit unit, TileLayer<Tiles> = {}) {
  REQUIRE(unit_on<Tiles, Half>(unit_options(Masking::causal)) == unit);
  const Index n = 333, d = 64;
  const RowMatrix<Half> q = make_input<Half>(Inputs::random, n, d, 1),
                        k = make_input<Half>(Inputs::random, n, d, 2),
                        v = make_input<Half>(Inputs::random, n, d, 3);
  const HashSet hashes = poslsh::rbf_hashes(32.0, 16, 5, 0);
  for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
    INFO((masking == Masking::causal ? "causal" : "bidirectional"));
    const AttentionOptions options = unit_options(masking);
    const poslsh::HeadMethod tiled_head = head_method(poslsh::Method::exact_tiled, 16.0),
                             fused_head = head_method(poslsh::Method::lsh_fused, 32.0, 0, hashes);
    const auto tiled = [&](RowMatrix<float>& out) {
      one_head<Tiles, Half>(tiled_head, q, k, v, out, options);
    };
    const auto fused = [&](RowMatrix<float>& out) {
      one_head<Tiles, Half>(fused_head, q, k, v, out, options);
    };
    const auto per_sample = [&](RowMatrix<float>& out) {
      one_head<Tiles, Half>(head_method(poslsh::Method::lsh_per_sample, 32.0, 0, hashes), q, k, v,
                            out, options);
    };
    for (const auto& named :
         {std::pair<const char*, std::function<void(RowMatrix<float>&)>>{"tiled", tiled},
          {"fused", fused},
          {"per_sample", per_sample}}) {
      const auto& kernel = named.second;
      INFO(named.first);
      RowMatrix<float> one(n, d), two(n, d);
      with_threads(1, [&] { kernel(one); });
      with_threads(2, [&] { kernel(two); });
      CHECK(one == two);
    }
    // Chunked prefill (causal: the keys so far; bidirectional: all keys) against one prefill.
    RowMatrix<float> whole_tiled(n, d), whole_fused(n, d), chunk(n, d);
    tiled(whole_tiled);
    fused(whole_fused);
    for (Index first = 0; first < n;) {
      const Index rows = std::min<Index>(n - first, first % 3 == 0 ? 50 : 101);
      const Index keys = masking == Masking::causal ? first + rows : n;
      AttentionOptions at = options;
      at.query_offset = first;
      RowMatrix<float> part(rows, d);
      one_head<Tiles, Half>(tiled_head, q.middleRows(first, rows), k.topRows(keys), v.topRows(keys),
                            part, at);
      CHECK(part == whole_tiled.middleRows(first, rows));
      if (masking == Masking::bidirectional) {
        one_head<Tiles, Half>(fused_head, q.middleRows(first, rows), k, v, part, at);
        CHECK(part == whole_fused.middleRows(first, rows));
      }
      first += rows;
    }
  }
  kept_key_tile_checks<Half, Tiles>();
}

/// Key tiles kept for the next query tiles (TileBuffers::keep_key_rows and keep_packed_tiles:
/// each key tile copied or packed once, read from the thread's store) against key tiles read in
/// place or packed at each visit: bitwise the same, for whole windows and bands (tiles cut by the
/// window), keys at an odd position, and odd and even widths. The store of one call serves both
/// heads' sources in turn. Scalar: bfloat16 or float16 inputs (on the chosen unit, AMX on the tile
/// layer Tiles), or float and double (read in place).
template <typename Scalar, template <typename> class Tiles>
void kept_key_tile_checks() {
  using poslsh::detail::AlibiBias;
  using poslsh::detail::ExactWindow;
  using poslsh::detail::TileBuffers;
  const Index n = 333;
  for (const Index d : {Index{64}, Index{33}}) {
    using Compute = poslsh::compute_scalar_t<Scalar, Scalar, Scalar>;
    const RowMatrix<Scalar> q = make_input(Inputs::random, n, d, 41).cast<Scalar>(),
                            k = make_input(Inputs::heavy_tailed, 2 * n, d, 42).cast<Scalar>(),
                            v = make_input(Inputs::random, 2 * n, d + 3, 43).cast<Scalar>();
    for (const ExactWindow window : {ExactWindow{0, 2 * n}, ExactWindow{-2 * n, 2 * n},
                                     ExactWindow{-50, 70}, ExactWindow{0, 90}}) {
      for (const Index key_position : {Index{0}, Index{37}}) {
        INFO("d " << d << ", window [" << window.lo << ", " << window.hi << "], keys from "
                  << key_position);
        RowMatrix<Compute> kept(2 * n, d + 3), visited(2 * n, d + 3);
        for (const bool keep : {true, false}) {
          TileBuffers<Compute> buffers;
          buffers.keep_key_rows = keep;
          buffers.keep_packed_tiles = keep;
          RowMatrix<Compute>& out = keep ? kept : visited;
          // Two heads' sources (the two halves of K and V) alternating query tile by query
          // tile, as two calls sharing one thread's buffers would meet them.
          for (Index r0 = 0; r0 < n; r0 += 64) {
            for (Index half = 0; half < 2; ++half) {
              const poslsh::ConstMatrixRef<Scalar> k_half = k.middleRows(half * n, n),
                                                   v_half = v.middleRows(half * n, n);
              AlibiBias<Compute> bias(key_position + n, 12.0, window);
              const Index rows = std::min<Index>(64, n - r0), p0 = key_position + 5;
              poslsh::detail::engine_rows<Compute, Scalar, Scalar, Tiles>(
                  poslsh::ConstMatrixRef<Scalar>(q), k_half, v_half, 0.125, bias, buffers,
                  {p0, key_position}, Precision::matrix_units, p0 + r0, p0 + r0 + rows,
                  out.middleRows(half * n + r0, rows));
            }
          }
        }
        CHECK(kept == visited);
        CHECK(kept.allFinite());
      }
    }
  }
}

/// Every kernel on the tile engine runs on `unit` (AMX on the tile layer Tiles): each one against
/// the single-head call on the unit (one_head) and not bitwise the float products; ran() says
/// whether the unit ran since it was last asked (checked after each call on the unit).
template <template <typename> class Tiles, typename Half = bf16, typename Ran>
void every_kernel_checks(MatrixUnit expected, Ran&& ran, TileLayer<Tiles> = {}) {
  REQUIRE(unit_on<Tiles, Half>(unit_options(Masking::causal)) == expected);
  const Index n = 150, heads = 2, d = 32;
  const RowMatrix<Half> q = make_input<Half>(Inputs::random, n, heads * d, 11),
                        k = make_input<Half>(Inputs::random, n, heads * d, 12),
                        v = make_input<Half>(Inputs::random, n, heads * d, 13);
  const auto head = [&](const RowMatrix<Half>& m, Index h) {
    return poslsh::ConstMatrixRef<Half>(m.middleCols(h * d, d));
  };
  AttentionOptions unit = unit_options(Masking::causal), widening = unit;
  widening.precision = Precision::float_products;
  // Each multi-head method, one head at a time against the single-head call on the unit (and
  // not the float products' bits: the call did use the unit).
  for (const poslsh::Method method :
       {poslsh::Method::exact_tiled, poslsh::Method::exact_banded, poslsh::Method::lsh_fused,
        poslsh::Method::lsh_per_sample, poslsh::Method::fixed_blocks,
        poslsh::Method::mean_of_outputs}) {
    INFO(poslsh::enum_name(method));
    poslsh::MultiHeadOptions options;
    options.method = method;
    options.samples = 4;
    options.sigmas = {8.0, 40.0};
    RowMatrix<float> out(n, heads * d);
    const auto view = [&](const RowMatrix<Half>& m) {
      return poslsh::HeadsView<const Half>{m.data(), n, heads, d, heads * d, d};
    };
    const poslsh::HeadsView<float> out_view{out.data(), n, heads, d, heads * d, d};
    if constexpr (native_tiles<Tiles>) {
      poslsh::multihead_attention<Half, Half, float>(view(q), view(k), view(v), out_view, options);
    } else {
      heads_on<Tiles, Half>(view(q), view(k), view(v), out_view, options,
                            poslsh::detail::head_methods("multihead_attention", heads, options));
    }
    CHECK(ran());
    for (Index h = 0; h < heads; ++h) {
      INFO("head " << h);
      const double sigma = options.sigmas[static_cast<std::size_t>(h)];
      // The head's parameters, as the options define them.
      poslsh::HeadMethod one = head_method(method, sigma);
      switch (method) {
        case poslsh::Method::exact_tiled:
          break;
        case poslsh::Method::exact_banded:
          one.band = poslsh::band_for_bias_error(sigma, options.band_error);
          break;
        case poslsh::Method::lsh_fused:
        case poslsh::Method::lsh_per_sample:
        case poslsh::Method::mean_of_outputs:
          one.hashes = poslsh::rbf_hashes(sigma, options.samples, options.seed,
                                          static_cast<std::uint64_t>(h));
          break;
        case poslsh::Method::fixed_blocks:
          one.hashes = HashSet{poslsh::fixed_blocks_hash(sigma)};
          break;
      }
      RowMatrix<float> single(n, d), floats(n, d);
      one_head<Tiles, Half>(one, head(q, h), head(k, h), head(v, h), single, unit);
      CHECK(ran());  // the call on the unit
      // The float products (never on a unit) by the single-head call.
      one_head<AmxNativeTiles, Half>(one, head(q, h), head(k, h), head(v, h), floats, widening);
      const RowMatrix<float> got = out.middleCols(h * d, d);
      CHECK(got == single);
      CHECK(got != floats);
    }
  }
  // Stored partitions through the fused kernel (on another tile layer: its engine rows).
  {
    const HashSet hashes = poslsh::rbf_hashes(20.0, 4, 3, 0);
    const poslsh::PartitionSet partitions = poslsh::partition_set(hashes, n);
    RowMatrix<float> from_partitions(n, d), from_hashes(n, d), floats(n, d);
    if constexpr (native_tiles<Tiles>) {
      poslsh::lsh_attention_fused<Half, Half, float>(head(q, 0), head(k, 0), head(v, 0), partitions,
                                                     from_partitions, unit);
    } else {
      fused_rows_on<Tiles, Half>(head(q, 0), head(k, 0), head(v, 0), partitions, from_partitions,
                                 unit);
    }
    CHECK(ran());
    one_head<Tiles, Half>(head_method(poslsh::Method::lsh_fused, 20.0, 0, hashes), head(q, 0),
                          head(k, 0), head(v, 0), from_hashes, unit);
    poslsh::lsh_attention_fused<Half, Half, float>(head(q, 0), head(k, 0), head(v, 0), partitions,
                                                   floats, widening);
    CHECK(from_partitions == from_hashes);
    CHECK(from_partitions != floats);
  }
  // The block kernel with lse: the unit's block outputs against the plain bfloat16 formula.
  {
    poslsh::PlainBlockAttention<Half, Half> block;
    RowMatrix<float> out(n, d);
    Eigen::VectorXf lse(n);
    if constexpr (native_tiles<Tiles>)
      block(head(q, 0), head(k, 0), head(v, 0), true, 0.2f, out, lse);
    else
      block_on<Tiles, Half>(head(q, 0), head(k, 0), head(v, 0), true, 0.2f, out, lse);
    CHECK(ran());
    RowMatrix<double> exact;
    RowMatrix<float> plain;
    references(
        RowMatrix<Half>(head(q, 0)), RowMatrix<Half>(head(k, 0)), RowMatrix<Half>(head(v, 0)), 0.2,
        [&](Index i) { return alibi_weights(i, n, std::numeric_limits<double>::infinity(), 0, n); },
        exact, plain);
    CHECK(max_error(out, exact) <= 2.0 * max_error(plain, exact));
    block.precision = Precision::float_products;
    RowMatrix<float> floats(n, d);
    block(head(q, 0), head(k, 0), head(v, 0), true, 0.2f, floats, lse);
    CHECK(out != floats);
  }
}

}  // namespace

TEST_CASE("matrix units: the table, availability and the unit a call uses", "[units]") {
  using poslsh::matrix_unit_for;
  CHECK(std::string(poslsh::enum_name(MatrixUnit::float_products)) == "float_products");
  CHECK(std::string(poslsh::enum_name(MatrixUnit::avx512_bf16)) == "avx512_bf16");
  CHECK(poslsh::enum_from_name<MatrixUnit>("avx512_bf16") == MatrixUnit::avx512_bf16);
  CHECK(std::string(poslsh::enum_name(MatrixUnit::amx_bf16)) == "amx_bf16");
  CHECK(poslsh::enum_from_name<MatrixUnit>("amx_bf16") == MatrixUnit::amx_bf16);
  CHECK(std::string(poslsh::enum_name(MatrixUnit::amx_fp16)) == "amx_fp16");
  CHECK(poslsh::enum_from_name<MatrixUnit>("amx_fp16") == MatrixUnit::amx_fp16);
  CHECK(poslsh::enum_from_name<Precision>("float_products") == Precision::float_products);
  CHECK(std::string(poslsh::enum_name(Precision::matrix_units)) == "matrix_units");
  CHECK(poslsh::matrix_unit_available(MatrixUnit::float_products));
  const bool bf16_unit = poslsh::matrix_unit_available(MatrixUnit::avx512_bf16);
  const bool amx_unit = poslsh::matrix_unit_available(MatrixUnit::amx_bf16);
  const bool amx_fp16_unit = poslsh::matrix_unit_available(MatrixUnit::amx_fp16);
  WARN("units on this CPU: float_products" << (bf16_unit ? ", avx512_bf16" : "")
                                           << (amx_unit ? ", amx_bf16" : "")
                                           << (amx_fp16_unit ? ", amx_fp16" : ""));
  // Float16 inputs: amx_fp16 where the CPU has it (and avx512_bf16, the code around the
  // tiles), else widened (no AVX-512 float16 product sums in float).
  CHECK((!amx_fp16_unit || bf16_unit));
  CHECK(matrix_unit_for<Eigen::half, Eigen::half>(AttentionOptions{}) ==
        (amx_fp16_unit ? MatrixUnit::amx_fp16 : MatrixUnit::float_products));
  // The first the CPU has of amx_bf16, avx512_bf16, float_products (and AMX only with
  // avx512_bf16, the code around its tiles).
  CHECK((!amx_unit || bf16_unit));
  AttentionOptions options;
  CHECK(options.precision == Precision::matrix_units);
  CHECK(matrix_unit_for<bf16, bf16>(options) == (amx_unit    ? MatrixUnit::amx_bf16
                                                 : bf16_unit ? MatrixUnit::avx512_bf16
                                                             : MatrixUnit::float_products));
  // The tile engine's unit on a tile layer: the library's (matrix_unit_for), the CPU's tiles
  // turned off (the next unit), the emulation (available with avx512_bf16, which it needs).
  {
    using poslsh::detail::tile_engine_unit;
    const Precision units = Precision::matrix_units;
    CHECK(tile_engine_unit<bf16, bf16, AmxNativeTiles>(units) ==
          matrix_unit_for<bf16, bf16>(options));
    CHECK(tile_engine_unit<Eigen::half, Eigen::half, AmxNativeTiles>(units) ==
          matrix_unit_for<Eigen::half, Eigen::half>(options));
    CHECK(tile_engine_unit<bf16, bf16, AmxTilesOff>(units) ==
          (bf16_unit ? MatrixUnit::avx512_bf16 : MatrixUnit::float_products));
    CHECK(tile_engine_unit<Eigen::half, Eigen::half, AmxTilesOff>(units) ==
          MatrixUnit::float_products);
    CHECK(tile_engine_unit<bf16, bf16, AmxEmulatedTiles>(units) ==
          (bf16_unit ? MatrixUnit::amx_bf16 : MatrixUnit::float_products));
    CHECK(tile_engine_unit<Eigen::half, Eigen::half, AmxEmulatedTiles>(units) ==
          (bf16_unit ? MatrixUnit::amx_fp16 : MatrixUnit::float_products));
    CHECK(tile_engine_unit<float, bf16, AmxEmulatedTiles>(units) == MatrixUnit::float_products);
    CHECK(tile_engine_unit<Eigen::half, bf16, AmxEmulatedTiles>(units) ==
          MatrixUnit::float_products);
    CHECK(tile_engine_unit<float, Eigen::half, AmxEmulatedTiles>(units) ==
          MatrixUnit::float_products);
    CHECK(tile_engine_unit<bf16, bf16, AmxEmulatedTiles>(Precision::float_products) ==
          MatrixUnit::float_products);
  }
  CHECK(poslsh::matrix_unit_available(MatrixUnit::amx_bf16) == amx_unit);
  CHECK(poslsh::matrix_unit_available(MatrixUnit::amx_fp16) == amx_fp16_unit);
  CHECK(matrix_unit_for<float, bf16>(options) == MatrixUnit::float_products);
  CHECK(matrix_unit_for<float, float>(options) == MatrixUnit::float_products);
  options.precision = Precision::float_products;
  CHECK(matrix_unit_for<bf16, bf16>(options) == MatrixUnit::float_products);
  CHECK(matrix_unit_for<Eigen::half, Eigen::half>(options) == MatrixUnit::float_products);
  // A precision outside the enumerators is named.
  options.precision = static_cast<Precision>(7);
  const RowMatrix<bf16> x = poslsh_test::random_half<bf16>(8, 4, 1);
  RowMatrix<float> out(8, 4);
  const auto call = [&] {
    poslsh::alibi_attention_tiled<bf16, bf16, float>(x, x, x, 4.0, out, options);
  };
  CHECK_THROWS_WITH(call(), Catch::Matchers::Contains("options.precision"));
  CHECK_THROWS_AS(call(), std::invalid_argument);
}

TEST_CASE("avx512_bf16: within 2x a plain bfloat16 attention's error against double",
          "[units][half]") {
  if (!have_unit(MatrixUnit::avx512_bf16)) return;
  on_avx512_bf16_layer([](auto layer) { accuracy_sweep(MatrixUnit::avx512_bf16, layer); });
}

TEST_CASE("avx512_bf16: bitwise the same on 1 and 2 threads, chunked prefill one prefill",
          "[units][half]") {
  if (!have_unit(MatrixUnit::avx512_bf16)) return;
  on_avx512_bf16_layer([](auto layer) { thread_and_chunk_checks(MatrixUnit::avx512_bf16, layer); });
}

TEST_CASE("avx512_bf16: every kernel on the tile engine uses the unit", "[units][half]") {
  if (!have_unit(MatrixUnit::avx512_bf16)) return;
  on_avx512_bf16_layer([](auto layer) {
    every_kernel_checks(
        MatrixUnit::avx512_bf16, [] { return true; }, layer);
  });
}

TEST_CASE("float and double: key tiles kept for the next query tiles, bitwise read in place",
          "[units]") {
  kept_key_tile_checks<float>();
  kept_key_tile_checks<double>();
}

TEST_CASE("float_products: bitwise the float kernel on the widened inputs", "[units][half]") {
  const Index n = 190, d = 48;
  const RowMatrix<bf16> q = make_input(Inputs::random, n, d, 21),
                        k = make_input(Inputs::random, n, d, 22),
                        v = make_input(Inputs::random, n, d, 23);
  const RowMatrix<float> qf = poslsh_test::widened(q), kf = poslsh_test::widened(k),
                         vf = poslsh_test::widened(v);
  const HashSet hashes = poslsh::rbf_hashes(24.0, 8, 9, 0);
  for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
    AttentionOptions options = with_masking(masking);
    options.precision = Precision::float_products;
    RowMatrix<float> half_in(n, d), float_in(n, d);
    poslsh::alibi_attention_tiled<bf16, bf16, float>(q, k, v, 16.0, half_in, options);
    poslsh::alibi_attention_tiled<float>(qf, kf, vf, 16.0, float_in, options);
    CHECK(half_in == float_in);
    poslsh::lsh_attention_fused<bf16, bf16, float>(q, k, v, hashes, half_in, options);
    poslsh::lsh_attention_fused<float>(qf, kf, vf, hashes, float_in, options);
    CHECK(half_in == float_in);
    poslsh::lsh_attention_per_sample<bf16, bf16, float>(q, k, v, hashes, half_in, options);
    poslsh::lsh_attention_per_sample<float>(qf, kf, vf, hashes, float_in, options);
    CHECK(half_in == float_in);
  }
}

#if POSLSH_X86_UNITS
namespace {

/// pair_exp of each value (16 at a time), on the unit's target.
POSLSH_AVX512_BF16_TARGET __attribute__((noinline)) std::vector<float> unit_exp(
    const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i + 16 <= x.size(); i += 16)
    _mm512_storeu_ps(y.data() + i, poslsh::detail::pair_exp(_mm512_loadu_ps(x.data() + i)));
  return y;
}

}  // namespace

TEST_CASE("avx512_bf16: the probabilities' exponential within its stated ulp of exp",
          "[units][half]") {
  if (!have_unit(MatrixUnit::avx512_bf16)) return;
  // Every 37th float of [-87.3, 0] (about 3 million values), against exp in double; ulp: the
  // distance between float(e^x) and the next float up.
  std::vector<float> x;
  for (float value = -87.3f; value <= 0.0f;) {
    x.push_back(value);
    for (int step = 0; step < 37; ++step) value = std::nextafter(value, 1.0f);
  }
  x.resize(x.size() / 16 * 16);
  const std::vector<float> y = unit_exp(x);
  double near_zero = 0.0, far = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double exact = std::exp(static_cast<double>(x[i]));
    const float rounded = static_cast<float>(exact);
    const double ulp = static_cast<double>(std::nextafter(rounded, 2.0f) - rounded);
    const double error = std::abs(static_cast<double>(y[i]) - exact) / ulp;
    (x[i] >= -20.0f ? near_zero : far) = std::max(x[i] >= -20.0f ? near_zero : far, error);
  }
  CHECK(near_zero <= 1.5);
  CHECK(far <= 4.5);
  // 0 gives 1 exactly; below -87.3 (and -inf) the value at -87.3; NaN stays NaN.
  std::vector<float> special(16, 0.0f);
  special[1] = -87.3f;
  special[2] = -1000.0f;
  special[3] = -std::numeric_limits<float>::infinity();
  special[4] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> z = unit_exp(special);
  CHECK(z[0] == 1.0f);
  CHECK(z[1] > 0.0f);
  CHECK(z[2] == z[1]);
  CHECK(z[3] == z[1]);
  CHECK(std::isnan(z[4]));
}

TEST_CASE("avx512_bf16: query pairs packed as their definition, word for word", "[units][half]") {
  if (!have_unit(MatrixUnit::avx512_bf16)) return;
  std::mt19937 gen(7);
  for (const Index d : {1, 2, 3, 15, 16, 31, 32, 33, 64, 65, 96, 130}) {
    for (int trial = 0; trial < 8; ++trial) {
      const Index rows = 160, stride = d + (trial % 3) * 7;
      std::vector<bf16> data(static_cast<std::size_t>(rows * stride));
      for (bf16& value : data) value = bf16(std::uniform_real_distribution<float>(-3, 3)(gen));
      const Eigen::Map<const RowMatrix<bf16>, 0, Eigen::OuterStride<>> map(
          data.data(), rows, d, Eigen::OuterStride<>(stride));
      const poslsh::ConstMatrixRef<bf16> q(map);
      const Index tile = 64, half_d = (d + 1) / 2, i0 = trial * 11;
      const Index a0 = trial % 2 == 0 ? 0 : 5 * trial, a1 = trial % 4 < 2 ? tile : a0 + 17;
      // The definition: word (c2, a) holds q[i0 + a][2 c2] in its low 16 bits and q[i0 + a][2 c2
      // + 1] (0 past column d - 1) in its high ones, for rows a in [a0, a1); 0 elsewhere.
      std::vector<std::uint32_t> expected(static_cast<std::size_t>(half_d * tile), 0);
      for (Index a = a0; a < a1; ++a) {
        for (Index c = 0; c < d; ++c) {
          const auto bits = Eigen::numext::bit_cast<std::uint16_t>(q(i0 + a, c));
          expected[static_cast<std::size_t>(c / 2 * tile + a)] |= std::uint32_t{bits}
                                                                  << (16 * (c % 2));
        }
      }
      std::vector<std::uint32_t> packed(expected.size(), 0xdeadbeefu);
      poslsh::detail::pair_pack_queries(q, i0, a0, a1, packed.data(), tile);
      INFO("d = " << d << ", rows [" << a0 << ", " << a1 << ")");
      CHECK(packed == expected);
    }
  }
}

namespace {

/// out = c + a b on the emulated tiles Tiles (C in tile 0, A in tile 4, B in tile 5, all
/// 16 rows of 64 bytes): one product, counted.
template <typename Tiles>
void emulated_dot(const std::uint16_t (&a)[16][32], const std::uint16_t (&b)[16][32],
                  const float (&c)[16][16], float (&out)[16][16]) {
  const long long before = Tiles::products().load();
  Tiles::configure(poslsh::detail::amx_tile_config());
  Tiles::load(0, c, 64);
  Tiles::load(4, a, 64);
  Tiles::load(5, b, 64);
  Tiles::dot(0, 5);
  Tiles::store(0, out, 64);
  Tiles::release();
  CHECK(Tiles::products().load() == before + 1);
}

/// Entries of A, B and C (as emulated_dot takes them, values of type Half) that both tile
/// products must give alike:
///  - row 0, column 0: the even products sum to x y + 1 = 2^24 + 1, the odd ones to -2^24 + 1
///    (x = a_big, y = b_big, x y = 2^24). Intel's pseudo-code sums each half in its own float
///    (2^24 + 1 rounds to 2^24 at the tie, -2^24 + 1 is exact), then adds the halves: 1. Sums of
///    the pairs in order (as vdpbf16ps) or exact sums give 2.
///  - row 3, column 3: small integers, exact: 3 + (2 * 5 + 4 * 7) = 41 onto a loaded C of 3.
template <typename Half>
void sum_order_entries(float a_big, float b_big, std::uint16_t (&a)[16][32],
                       std::uint16_t (&b)[16][32], float (&c)[16][16]) {
  REQUIRE(a_big * b_big == 16777216.0f);
  const auto bits = [](float x) { return Eigen::numext::bit_cast<std::uint16_t>(Half(x)); };
  a[0][0] = bits(a_big);
  a[0][1] = bits(a_big);
  a[0][2] = bits(1.0f);
  a[0][3] = bits(1.0f);
  b[0][0] = bits(b_big);
  b[0][1] = bits(-b_big);
  b[1][0] = bits(1.0f);
  b[1][1] = bits(1.0f);
  a[3][0] = bits(2.0f);
  a[3][1] = bits(4.0f);
  b[0][6] = bits(5.0f);
  b[0][7] = bits(7.0f);
  c[3][3] = 3.0f;
}

}  // namespace

TEST_CASE("amx_bf16 emulation: tdpbf16ps as the SDM's pseudo-code gives", "[units][amx]") {
  using Tiles = AmxEmulatedTiles<bf16>;
  const auto bits = [](float x) { return Eigen::numext::bit_cast<std::uint16_t>(bf16(x)); };
  // A (tile 4): row m's pairs along k; B (tile 5): row k's pairs along columns n; C (tile 0).
  std::uint16_t a[16][32] = {}, b[16][32] = {};
  float c[16][16] = {};
  // Rows 0 and 3 (sum_order_entries): 2^24 times 1.
  sum_order_entries<bf16>(16777216.0f, 1.0f, a, b, c);
  // Row 1, column 1: a denormal bfloat16 (bits 0x0001) times 2^100 is taken as 0 (DAZ); the
  // same product of normal values would be about 9e-41 * 1.3e30.
  a[1][0] = 0x0001;
  b[0][2] = bits(std::ldexp(1.0f, 100));
  // Row 2, column 2: 2^-70 2^-70 = 2^-140 is a float denormal, flushed to 0 (FTZ).
  a[2][0] = bits(std::ldexp(1.0f, -70));
  b[0][4] = bits(std::ldexp(1.0f, -70));
  CHECK(std::ldexp(1.0f, -70) * std::ldexp(1.0f, -70) > 0.0f);
  float out[16][16];
  emulated_dot<Tiles>(a, b, c, out);
  CHECK(out[0][0] == 1.0f);
  CHECK(out[1][1] == 0.0f);
  CHECK(out[2][2] == 0.0f);
  CHECK(out[3][3] == 41.0f);
  CHECK(out[0][1] == std::ldexp(1.0f, 124));  // 2^24 2^100, the other products 0
  CHECK(out[5][5] == 0.0f);
  // Shapes the instruction faults on, and tiles without a configuration.
  CHECK_THROWS_AS(Tiles::dot(0, 5), std::logic_error);
  poslsh::detail::AmxTileConfig config = poslsh::detail::amx_tile_config();
  config.rows[5] = 8;
  Tiles::configure(config);
  CHECK_THROWS_AS(Tiles::dot(0, 5), std::logic_error);
  Tiles::release();
}

TEST_CASE("amx_fp16 emulation: tdpfp16ps as Intel's pseudo-code gives", "[units][amx]") {
  using Tiles = AmxEmulatedTiles<Eigen::half>;
  const auto bits = [](float x) { return Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(x)); };
  std::uint16_t a[16][32] = {}, b[16][32] = {};
  float c[16][16] = {};
  // Rows 0 and 3 (sum_order_entries): 2^13 times 2^11 (2^24 is past float16's range).
  sum_order_entries<Eigen::half>(8192.0f, 2048.0f, a, b, c);
  // Row 1, column 1: a denormal float16 (bits 0x0001, 2^-24) is a value, not 0: times 2^10 it
  // gives 2^-14.
  a[1][0] = 0x0001;
  b[0][2] = bits(1024.0f);
  // Row 2, column 2: a float denormal loaded into C is flushed (FTZ/DAZ on the accumulation).
  c[2][2] = std::numeric_limits<float>::denorm_min() * 1000.0f;
  CHECK(c[2][2] > 0.0f);
  float out[16][16];
  emulated_dot<Tiles>(a, b, c, out);
  CHECK(out[0][0] == 1.0f);
  CHECK(out[1][1] == std::ldexp(1.0f, -14));
  CHECK(out[2][2] == 0.0f);
  CHECK(out[3][3] == 41.0f);
  CHECK(out[0][1] == 8192.0f * 1024.0f);  // row 0 times column 1's even value, the others 0
  CHECK(out[5][5] == 0.0f);
  // The same bits read as bfloat16 pairs give other numbers: the unit is the type's.
  {
    emulated_dot<AmxEmulatedTiles<bf16>>(a, b, c, out);
    CHECK(out[3][3] != 41.0f);
  }
  CHECK_THROWS_AS(Tiles::dot(0, 5), std::logic_error);
  // The probabilities' rounding: float16 to nearest even, its denormals kept.
  CHECK(poslsh::detail::amx_round<Eigen::half>(1.0f + std::ldexp(1.0f, -11)) == bits(1.0f));
  CHECK(poslsh::detail::amx_round<Eigen::half>(1.0f + 3 * std::ldexp(1.0f, -11)) ==
        bits(1.0f + std::ldexp(1.0f, -9)));
  CHECK(poslsh::detail::amx_round<Eigen::half>(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(poslsh::detail::amx_round<bf16>(std::ldexp(1.0f, -24)) ==
        Eigen::numext::bit_cast<std::uint16_t>(bf16(std::ldexp(1.0f, -24))));
}
#endif

TEST_CASE("amx_bf16 (emulated tiles): within 2x a plain bfloat16 attention's error",
          "[units][half][amx][slow]") {
  on_emulated_tiles(
      [&](EmulationWatch&) { accuracy_sweep<AmxEmulatedTiles>(MatrixUnit::amx_bf16); });
}

TEST_CASE("amx_bf16 (emulated tiles): bitwise on 1 and 2 threads, chunked prefill one prefill",
          "[units][half][amx]") {
  on_emulated_tiles([&](EmulationWatch&) {
    thread_and_chunk_checks<AmxEmulatedTiles>(MatrixUnit::amx_bf16);
    // One row at a time (a 16-row block of the tiles holding one computed row, the others
    // stale or zero) against all rows at once: each row's bits depend on its row alone.
    const Index n = 150, d = 40;
    const RowMatrix<bf16> q = make_input(Inputs::heavy_tailed, n, d, 31),
                          k = make_input(Inputs::heavy_tailed, n, d, 32),
                          v = make_input(Inputs::heavy_tailed, n, d + 1, 33);
    for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
      INFO((masking == Masking::causal ? "causal" : "bidirectional"));
      const AttentionOptions options = unit_options(masking);
      RowMatrix<float> whole(n, d + 1), row(1, d + 1);
      const poslsh::HeadMethod tiled = head_method(poslsh::Method::exact_tiled, 8.0);
      one_head<AmxEmulatedTiles, bf16>(tiled, q, k, v, whole, options);
      for (const Index i : {Index{0}, Index{1}, Index{15}, Index{16}, Index{63}, Index{64},
                            Index{77}, Index{128}, Index{149}}) {
        INFO("row " << i);
        AttentionOptions at = options;
        at.query_offset = i;
        const Index keys = masking == Masking::causal ? i + 1 : n;
        one_head<AmxEmulatedTiles, bf16>(tiled, q.middleRows(i, 1), k.topRows(keys),
                                         v.topRows(keys), row, at);
        CHECK(row == whole.row(i));
      }
    }
  });
}

TEST_CASE("amx_bf16 (emulated tiles): every kernel on the tile engine uses the unit",
          "[units][half][amx]") {
  on_emulated_tiles([&](EmulationWatch& watch) {
    every_kernel_checks<AmxEmulatedTiles>(MatrixUnit::amx_bf16, [&] { return watch.ran(); });
  });
}

TEST_CASE("amx_fp16 (emulated tiles): within 2x a plain float16 attention's error",
          "[units][half][amx][slow]") {
  on_emulated_tiles([&](EmulationWatch&) {
    accuracy_sweep<AmxEmulatedTiles, Eigen::half>(MatrixUnit::amx_fp16);
  });
}

TEST_CASE("amx_fp16 (emulated tiles): bitwise on 1 and 2 threads, chunked prefill one prefill",
          "[units][half][amx]") {
  on_emulated_tiles([&](EmulationWatch&) {
    thread_and_chunk_checks<AmxEmulatedTiles, Eigen::half>(MatrixUnit::amx_fp16);
  });
}

TEST_CASE("amx_fp16 (emulated tiles): every kernel on the tile engine uses the unit",
          "[units][half][amx]") {
  on_emulated_tiles([&](EmulationWatch& watch) {
    every_kernel_checks<AmxEmulatedTiles, Eigen::half>(MatrixUnit::amx_fp16,
                                                       [&] { return watch.ran(); });
  });
}

TEST_CASE("amx_fp16 (this CPU's tiles): the checks of the emulated tiles", "[units][half][amx]") {
  if (!have_unit(MatrixUnit::amx_fp16)) return;
  accuracy_sweep<AmxNativeTiles, Eigen::half>(MatrixUnit::amx_fp16);
  thread_and_chunk_checks<AmxNativeTiles, Eigen::half>(MatrixUnit::amx_fp16);
  every_kernel_checks<AmxNativeTiles, Eigen::half>(MatrixUnit::amx_fp16, [] { return true; });
}

TEST_CASE("amx_bf16 (emulated tiles) against avx512_bf16: within the rounding bound",
          "[units][half][amx]") {
  if (!have_unit(MatrixUnit::avx512_bf16)) return;
  // Both units multiply the same bfloat16 operands exactly and sum in float, but in another
  // order: vdpbf16ps adds each pair's two products to its lane in turn, tdpbf16ps sums the
  // even and the odd products of 16 pairs apart and adds the two sums. The scores then differ
  // in their last bits, so can the probabilities' rounding to bfloat16 and the value sums: the
  // outputs agree to the bfloat16 rounding error, not bitwise. Bound: the error of the plain
  // bfloat16 attention against double (each unit is within 2x of it, checked above).
  std::uint64_t seed = 500;
  for (const Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (const auto& size : {std::pair<Index, Index>{200, 64}, {77, 37}, {130, 81}}) {
      const Index n = size.first, d = size.second;
      INFO("n " << n << ", d " << d << (masking == Masking::causal ? ", causal" : ", bidir."));
      const RowMatrix<bf16> q = make_input(Inputs::random, n, d, ++seed),
                            k = make_input(Inputs::random, n, d, ++seed),
                            v = make_input(Inputs::random, n, d + 3, ++seed);
      const double tau = 1.0 / std::sqrt(static_cast<double>(d)), sigma = 16.0;
      const bool causal = masking == Masking::causal;
      RowMatrix<double> exact;
      RowMatrix<float> plain, amx(n, d + 3), avx(n, d + 3);
      references(
          q, k, v, tau, [&](Index i) { return alibi_weights(i, n, sigma, causal ? 0 : -n, n); },
          exact, plain);
      const poslsh::HeadMethod tiled = head_method(poslsh::Method::exact_tiled, sigma);
      REQUIRE(unit_on<AmxEmulatedTiles, bf16>(unit_options(masking)) == MatrixUnit::amx_bf16);
      REQUIRE(unit_on<AmxTilesOff, bf16>(unit_options(masking)) == MatrixUnit::avx512_bf16);
      one_head<AmxEmulatedTiles, bf16>(tiled, q, k, v, amx, unit_options(masking));
      one_head<AmxTilesOff, bf16>(tiled, q, k, v, avx, unit_options(masking));
      const double difference = (amx - avx).cwiseAbs().maxCoeff();
      CHECK(difference <= max_error(plain, exact));
    }
  }
}

TEST_CASE("amx_bf16 (this CPU's tiles): the checks of the emulated tiles, and against them",
          "[units][half][amx]") {
  if (!have_unit(MatrixUnit::amx_bf16)) return;
  accuracy_sweep<AmxNativeTiles>(MatrixUnit::amx_bf16);
  thread_and_chunk_checks<AmxNativeTiles>(MatrixUnit::amx_bf16);
  every_kernel_checks<AmxNativeTiles>(MatrixUnit::amx_bf16, [] { return true; });
  // The CPU's tiles against their emulation: the SDM gives the order of the sums, the
  // hardware may sum in another; within the plain bfloat16 attention's error.
  const Index n = 200, d = 64;
  const RowMatrix<bf16> q = make_input(Inputs::random, n, d, 71),
                        k = make_input(Inputs::random, n, d, 72),
                        v = make_input(Inputs::random, n, d, 73);
  RowMatrix<double> exact;
  RowMatrix<float> plain, tiles(n, d), emulation(n, d);
  references(
      q, k, v, 0.125, [&](Index i) { return alibi_weights(i, n, 16.0, 0, n); }, exact, plain);
  poslsh::alibi_attention_tiled<bf16, bf16, float>(q, k, v, 16.0, tiles,
                                                   unit_options(Masking::causal));
  one_head<AmxEmulatedTiles, bf16>(head_method(poslsh::Method::exact_tiled, 16.0), q, k, v,
                                   emulation, unit_options(Masking::causal));
  CHECK((tiles - emulation).cwiseAbs().maxCoeff() <= max_error(plain, exact));
}
