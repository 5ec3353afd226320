// poslsh context parallelism over MPI: one sequence of n tokens sharded over the R ranks of
// MPI_COMM_WORLD (contiguous or zigzag shards), H query heads and H_kv K/V heads of width d in
// float32, prefilled with multihead_attention_slice.
//
// Every rank generates the rows it owns of Q, K and V (a counter-based generator: any rank can
// produce any row without the rest of the sequence) and builds the same transport-free plan
// (resolve_head_methods, context_parallel_plan). Then:
//   halo methods (lsh_fused, lsh_per_sample, fixed_blocks, exact_banded, exact_tiled with a
//     local window): each rank receives, per K/V head g, the rows of the plan's keys[g] outside
//     its shard from their owners (one MPI_Isend / MPI_Irecv per peer, all heads packed, in rank
//     order), assembles zero-initialised K/V buffers at each own chunk's key_span and calls
//     multihead_attention_slice per own chunk: its rows are bitwise the single-process rows;
//   exact_tiled without a window: a ring of R - 1 steps passes the K/V shards to rank + 1 (the
//     next shard in flight while the current one is computed); each step's slices are merged
//     per head by LseMerger in step order: equal to the single-process rows to rounding.
// Prints per rank (gathered to rank 0) the times of the setup (buffers, own rows), of the
// exchange (halo: packing, messages, assembling the key buffers; ring: the time spent waiting
// for the shards) and of the attention (ring: with the merges), the payload bytes sent and
// received and the peak resident memory (getrusage, before the check), plus totals; --json FILE
// writes the same as JSON. --check compares every rank's rows with multihead_attention on the whole
// sequence (each rank regenerates it: use small n): bitwise for halo methods, relative error
// <= 1e-5 for the ring; exit status 1 on a mismatch.
//
// Errors: every rank parses and validates the same arguments before any message, the ranks
// agree on rank 0's arguments, and the setup, the exchange and the attention are each followed
// by an MPI_Allreduce of an error flag, so a failure on one rank stops every rank with a
// message instead of a hang (exit status 2 for arguments, 1 otherwise).
//
//   mpirun -np R mpi_context_parallel [--n N] [--heads H] [--kv-heads G] [--dim D]
//       [--method M] [--layout contiguous|zigzag] [--bidirectional] [--samples S] [--seed S]
//       [--band-error E] [--window-left L] [--window-right R] [--check] [--json FILE]
// (Open MPI as root: mpirun --allow-run-as-root; more ranks than cores: --oversubscribe.)
#define OMPI_SKIP_MPICXX 1   // the C API only: the deprecated C++ bindings do not compile
#define MPICH_SKIP_MPICXX 1  // cleanly under -Wconversion
#include <mpi.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <poslsh/interop/lse_merge.hpp>
#include <poslsh/parallel/context_parallel.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using poslsh::ContextParallelChunk;
using poslsh::ContextParallelPlan;
using poslsh::Index;
using poslsh::Masking;
using poslsh::Method;
using poslsh::PositionRange;
using poslsh::ShardLayout;
using Matrix = poslsh::RowMatrix<float>;
using Ranges = std::vector<PositionRange>;

constexpr const char* program = "mpi_context_parallel";

constexpr const char* usage_text =
    "usage: mpirun -np R mpi_context_parallel [options]\n"
    "Prefills one sequence sharded over the R ranks: halo exchange (bitwise the single-process\n"
    "rows) or, for exact_tiled without a window, a K/V ring merged by log-sum-exp.\n"
    "  --n N               tokens (default 16384)\n"
    "  --heads H           query heads (default 8)\n"
    "  --kv-heads G        K/V heads, dividing H (default: H)\n"
    "  --dim D             head dimension d (default 64)\n"
    "  --method M          lsh_fused (default), lsh_per_sample, fixed_blocks, exact_banded or\n"
    "                      exact_tiled\n"
    "  --layout L          contiguous (default) or zigzag\n"
    "  --bidirectional     no causal mask\n"
    "  --samples S         LSH samples per head (default 16)\n"
    "  --seed S            seed of the hashes and of the data (default 0)\n"
    "  --band-error E      exact_banded's dropped-bias bound, in (0, 1) (default 1e-3)\n"
    "  --window-left L     exact methods: local window, keys j >= i - L (default -1: none)\n"
    "  --window-right R    exact methods: local window, keys j <= i + R (default -1: none)\n"
    "  --check             compare the rows with multihead_attention on the whole sequence\n"
    "                      (every rank regenerates it: small n)\n"
    "  --json FILE         also write the report as JSON (rank 0)\n"
    "Open MPI as root needs mpirun --allow-run-as-root; more ranks than cores --oversubscribe.\n";

// ---------------------------------------------------------------------------------------------
// Arguments

struct Config {
  long long n = 16384;
  long long heads = 8;
  long long kv_heads = 0;  // 0: heads
  long long dim = 64;
  long long samples = 16;
  long long seed = 0;
  long long window_left = -1;
  long long window_right = -1;
  double band_error = 1e-3;
  Method method = Method::lsh_fused;
  Masking masking = Masking::causal;
  ShardLayout layout = ShardLayout::contiguous;
  bool check = false;
  bool help = false;
  std::string json;
};

[[noreturn]] void bad_argument(const std::string& flag, const std::string& rule,
                               const std::string& text) {
  throw std::invalid_argument(flag + " " + rule + ", got '" + text + "'");
}

long long parse_integer(const std::string& flag, const char* text, long long low, long long high) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || value < low || value > high)
    bad_argument(
        flag, "must be an integer in [" + std::to_string(low) + ", " + std::to_string(high) + "]",
        text);
  return value;
}

double parse_real(const std::string& flag, const char* text) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(value))
    bad_argument(flag, "must be a finite number", text);
  return value;
}

/// The arguments of every rank; throws std::invalid_argument naming the bad argument.
Config parse_arguments(int argc, char** argv) {
  Config config;
  constexpr long long max_size = 1LL << 40, max_heads = 4096;
  for (int a = 1; a < argc; ++a) {
    const std::string flag = argv[a];
    if (flag == "--help" || flag == "-h") {
      config.help = true;
      continue;
    }
    if (flag == "--check") {
      config.check = true;
      continue;
    }
    if (flag == "--bidirectional") {
      config.masking = Masking::bidirectional;
      continue;
    }
    if (a + 1 >= argc) {
      if (flag.rfind("--", 0) == 0 && flag.size() > 2) {
        static const char* const with_value[] = {
            "--n",       "--heads", "--kv-heads",   "--dim",         "--method",       "--layout",
            "--samples", "--seed",  "--band-error", "--window-left", "--window-right", "--json"};
        for (const char* name : with_value)
          if (flag == name) throw std::invalid_argument(flag + " needs a value");
      }
      throw std::invalid_argument("unknown option '" + flag + "'");
    }
    const char* value = argv[a + 1];
    if (flag == "--n") {
      config.n = parse_integer(flag, value, 1, max_size);
    } else if (flag == "--heads") {
      config.heads = parse_integer(flag, value, 1, max_heads);
    } else if (flag == "--kv-heads") {
      config.kv_heads = parse_integer(flag, value, 1, max_heads);
    } else if (flag == "--dim") {
      config.dim = parse_integer(flag, value, 1, 4096);
    } else if (flag == "--samples") {
      config.samples = parse_integer(flag, value, 1, 4096);
    } else if (flag == "--seed") {
      config.seed = parse_integer(flag, value, 0, LLONG_MAX);
    } else if (flag == "--window-left") {
      config.window_left = parse_integer(flag, value, -1, max_size);
    } else if (flag == "--window-right") {
      config.window_right = parse_integer(flag, value, -1, max_size);
    } else if (flag == "--band-error") {
      config.band_error = parse_real(flag, value);
      if (!(config.band_error > 0.0 && config.band_error < 1.0))
        bad_argument(flag, "must be in (0, 1)", value);
    } else if (flag == "--method") {
      try {
        config.method = poslsh::enum_from_name<Method>(value);
      } catch (const std::invalid_argument&) {
        bad_argument(flag, "must be " + poslsh::enum_name_list<Method>(), value);
      }
    } else if (flag == "--layout") {
      try {
        config.layout = poslsh::enum_from_name<ShardLayout>(value);
      } catch (const std::invalid_argument&) {
        bad_argument(flag, "must be " + poslsh::enum_name_list<ShardLayout>(), value);
      }
    } else if (flag == "--json") {
      config.json = value;
      if (config.json.empty()) bad_argument(flag, "must name a file", value);
    } else {
      throw std::invalid_argument("unknown option '" + flag + "'");
    }
    ++a;
  }
  if (config.kv_heads == 0) config.kv_heads = config.heads;
  if (config.heads % config.kv_heads != 0)
    bad_argument("--kv-heads", "must divide --heads " + std::to_string(config.heads),
                 std::to_string(config.kv_heads));
  const bool exact = config.method == Method::exact_tiled || config.method == Method::exact_banded;
  if (!exact && config.window_left >= 0)
    bad_argument("--window-left", "needs --method exact_tiled or exact_banded",
                 std::to_string(config.window_left));
  if (!exact && config.window_right >= 0)
    bad_argument("--window-right", "needs --method exact_tiled or exact_banded",
                 std::to_string(config.window_right));
  return config;
}

/// The numbers of a configuration, to compare the ranks' arguments with rank 0's.
struct ConfigRecord {
  long long values[13];
};

constexpr const char* record_names[13] = {
    "--n",           "--heads",        "--kv-heads",   "--dim",    "--samples",       "--seed",
    "--window-left", "--window-right", "--band-error", "--method", "--bidirectional", "--layout",
    "--check"};

ConfigRecord config_record(const Config& c) {
  long long band_bits = 0;
  static_assert(sizeof(band_bits) == sizeof(c.band_error), "double is 64 bits");
  std::memcpy(&band_bits, &c.band_error, sizeof(band_bits));
  return {{c.n, c.heads, c.kv_heads, c.dim, c.samples, c.seed, c.window_left, c.window_right,
           band_bits, static_cast<long long>(c.method), static_cast<long long>(c.masking),
           static_cast<long long>(c.layout), c.check ? 1LL : 0LL}};
}

poslsh::MultiHeadOptions head_options(const Config& config) {
  poslsh::MultiHeadOptions options;
  options.method = config.method;
  options.masking = config.masking;
  options.samples = static_cast<Index>(config.samples);
  options.seed = static_cast<std::uint64_t>(config.seed);
  options.band_error = config.band_error;
  options.window_left = static_cast<Index>(config.window_left);
  options.window_right = static_cast<Index>(config.window_right);
  return options;
}

// ---------------------------------------------------------------------------------------------
// Data: element (row, column) of tensor t is a function of (seed, t, row, column) only.

enum Tensor : std::uint64_t { tensor_q = 1, tensor_k = 2, tensor_v = 3 };

std::uint64_t mix64(std::uint64_t x) {  // SplitMix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Rows [first, first + rows) of tensor `tensor` (cols values per row, uniform in [-1, 1)) into
/// `out` (row stride cols).
void generate_rows(const Config& config, Tensor tensor, Index cols, Index first, Index rows,
                   float* out) {
  const std::uint64_t stream = mix64(static_cast<std::uint64_t>(config.seed) * 4 + tensor);
#pragma omp parallel for schedule(static)
  for (Index r = 0; r < rows; ++r) {
    const auto row = static_cast<std::uint64_t>(first + r) * static_cast<std::uint64_t>(cols);
    float* dst = out + r * cols;
    // One 64-bit hash per pair of columns: 24 bits for each value.
    for (Index c = 0; c < cols; c += 2) {
      const std::uint64_t bits =
          mix64(stream + (row + static_cast<std::uint64_t>(c)) * 0x9e3779b97f4a7c15ULL);
      dst[c] = static_cast<float>(bits >> 40) * (2.0f / 16777216.0f) - 1.0f;
      if (c + 1 < cols)
        dst[c + 1] = static_cast<float>(bits & 0xffffffULL) * (2.0f / 16777216.0f) - 1.0f;
    }
  }
}

/// A zero rows x cols matrix, advised for transparent huge pages before its first touch (the
/// page faults of 4 KiB pages can dominate the setup of large buffers).
Matrix zero_matrix(Index rows, Index cols) {
  Matrix matrix(rows, cols);
  constexpr std::uintptr_t huge_page = std::uintptr_t{2} << 20;
  const auto first = reinterpret_cast<std::uintptr_t>(matrix.data());
  const std::uintptr_t begin = (first + huge_page - 1) & ~(huge_page - 1);
  const std::uintptr_t end =
      (first + static_cast<std::uintptr_t>(matrix.size()) * sizeof(float)) & ~(huge_page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice
  matrix.setZero();
  return matrix;
}

// ---------------------------------------------------------------------------------------------
// Range sets: sorted, disjoint, non-empty ranges.

Ranges merge_ranges(Ranges ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const PositionRange& a, const PositionRange& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  Ranges merged;
  for (const PositionRange& range : ranges) {
    if (range.empty()) continue;
    if (!merged.empty() && range.begin <= merged.back().end)
      merged.back().end = std::max(merged.back().end, range.end);
    else
      merged.push_back(range);
  }
  return merged;
}

Ranges subtract_ranges(const Ranges& from, const Ranges& remove) {
  Ranges out;
  for (const PositionRange& range : from) {
    Index begin = range.begin;
    for (const PositionRange& hole : remove) {
      if (hole.end <= begin || hole.begin >= range.end) continue;
      if (hole.begin > begin) out.push_back({begin, hole.begin});
      begin = std::max(begin, hole.end);
    }
    if (begin < range.end) out.push_back({begin, range.end});
  }
  return out;
}

Ranges intersect_ranges(const Ranges& a, const Ranges& b) {
  Ranges out;
  for (const PositionRange& x : a)
    for (const PositionRange& y : b) {
      const PositionRange part = poslsh::range_intersection(x, y);
      if (!part.empty()) out.push_back(part);
    }
  return merge_ranges(out);
}

Index total_rows(const Ranges& ranges) {
  Index rows = 0;
  for (const PositionRange& range : ranges) rows += range.size();
  return rows;
}

/// The positions rank r owns.
Ranges own_ranges(const ContextParallelPlan& plan, Index r) {
  Ranges own;
  for (const ContextParallelChunk& chunk : plan.chunks[static_cast<std::size_t>(r)])
    own.push_back(chunk.queries);
  return merge_ranges(own);
}

/// The rows of K/V head g that rank r reads and does not own: the union over its chunks of
/// keys[g], minus its shard.
Ranges halo_ranges(const ContextParallelPlan& plan, Index r, Index g) {
  Ranges keys;
  for (const ContextParallelChunk& chunk : plan.chunks[static_cast<std::size_t>(r)])
    keys.push_back(chunk.keys[static_cast<std::size_t>(g)]);
  return subtract_ranges(merge_ranges(keys), own_ranges(plan, r));
}

// ---------------------------------------------------------------------------------------------
// Per-rank report

enum Stat : int {
  stat_rows,
  stat_key_rows,
  stat_setup,
  stat_exchange,
  stat_attention,
  stat_sent,
  stat_received,
  stat_messages_sent,
  stat_messages_received,
  stat_ring_sent,
  stat_peak_rss,
  stat_count
};

double peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;  // KiB on Linux
}

constexpr std::size_t at(Index i) { return static_cast<std::size_t>(i); }

int to_int(Index count, const char* what) {
  if (count < 0 || count > INT_MAX)
    throw std::length_error(std::string(what) + ": " + std::to_string(count) +
                            " floats exceed one MPI message (INT_MAX elements)");
  return static_cast<int>(count);
}

// ---------------------------------------------------------------------------------------------
// The context-parallel forward of one rank.

class Rank {
 public:
  Rank(const Config& config, int rank, int ranks)
      : config_(config),
        rank_(rank),
        ranks_(ranks),
        H_(static_cast<Index>(config.heads)),
        G_(static_cast<Index>(config.kv_heads)),
        d_(static_cast<Index>(config.dim)),
        options_(head_options(config)) {
    const auto n = static_cast<Index>(config.n);
    plan_ = poslsh::context_parallel_plan(
        n, ranks, config.layout, poslsh::resolve_head_methods(H_, options_), G_, config.masking);
    chunks_ = plan_.chunks[at(rank)];
  }

  bool ring() const { return plan_.ring; }
  const std::vector<ContextParallelChunk>& chunks() const { return chunks_; }
  const Matrix& out(std::size_t c) const { return out_[c]; }
  const Matrix& lse(std::size_t c) const { return lse_[c]; }
  const double* stats() const { return stats_; }

  /// Allocates the buffers, generates the own rows and prepares the messages (no MPI call).
  void setup() {
    const double start = MPI_Wtime();
    for (const ContextParallelChunk& chunk : chunks_) {
      const Index m = chunk.queries.size();
      q_.push_back(zero_matrix(m, H_ * d_));
      generate_rows(config_, tensor_q, H_ * d_, chunk.queries.begin, m, q_.back().data());
      out_.push_back(zero_matrix(m, H_ * d_));
      lse_.push_back(Matrix::Zero(H_, m));
      stats_[stat_rows] += static_cast<double>(m);
    }
    // What a K/V ring sends from this rank: at step t the shard of rank - t, t = 0 .. R - 2
    // (every shard but that of rank + 1), K and V.
    Index ring_rows = 0;
    for (int step = 0; step + 1 < ranks_; ++step)
      ring_rows += shard_rows((rank_ - step + ranks_) % ranks_);
    stats_[stat_ring_sent] =
        static_cast<double>(ring_rows) * static_cast<double>(2 * G_ * d_) * sizeof(float);
    if (plan_.ring)
      setup_ring();
    else
      setup_halo();
    stats_[stat_setup] = MPI_Wtime() - start;
  }

  /// The exchange and the attention. Throws only after the last message of this rank.
  void run() {
    if (plan_.ring)
      run_ring();
    else
      run_halo();
    stats_[stat_peak_rss] = peak_rss_bytes();
  }

 private:
  // --- halo ------------------------------------------------------------------------------------

  /// One message: per K/V head g the rows of pieces[g] (K section, then V section, d floats
  /// per row and head).
  struct Message {
    int peer = 0;
    std::vector<Ranges> pieces;
    std::vector<float> data;
    Index rows = 0;  // sum over g of the rows of pieces[g]
  };

  void setup_halo() {
    const Ranges own = own_ranges(plan_, rank_);
    for (const ContextParallelChunk& chunk : chunks_) {
      k_.push_back(zero_matrix(chunk.key_span.size(), G_ * d_));
      v_.push_back(zero_matrix(chunk.key_span.size(), G_ * d_));
      const Index offset = chunk.queries.begin - chunk.key_span.begin, m = chunk.queries.size();
      generate_rows(config_, tensor_k, G_ * d_, chunk.queries.begin, m,
                    k_.back().data() + offset * G_ * d_);
      generate_rows(config_, tensor_v, G_ * d_, chunk.queries.begin, m,
                    v_.back().data() + offset * G_ * d_);
      stats_[stat_key_rows] += static_cast<double>(chunk.key_span.size());
      filled_.push_back(std::vector<Index>(at(G_), m));
    }
    // Rows of another own chunk that a chunk reads (zigzag: chunks r and 2R - 1 - r).
    for (std::size_t c = 0; c < chunks_.size(); ++c)
      for (std::size_t o = 0; o < chunks_.size(); ++o) {
        if (o == c) continue;
        for (Index g = 0; g < G_; ++g) {
          const PositionRange part =
              poslsh::range_intersection(chunks_[c].keys[at(g)], chunks_[o].queries);
          copy_rows(k_[o], chunks_[o].key_span, k_[c], chunks_[c].key_span, part, g);
          copy_rows(v_[o], chunks_[o].key_span, v_[c], chunks_[c].key_span, part, g);
          filled_[c][at(g)] += part.size();
        }
      }
    // Messages in rank order: what this rank receives from each peer (its halo within the
    // peer's shard) and sends to each peer (the peer's halo within this shard).
    for (int peer = 0; peer < ranks_; ++peer) {
      if (peer == rank_) continue;
      const Ranges peer_own = own_ranges(plan_, peer);
      Message in, out;
      in.peer = out.peer = peer;
      for (Index g = 0; g < G_; ++g) {
        in.pieces.push_back(intersect_ranges(halo_ranges(plan_, rank_, g), peer_own));
        out.pieces.push_back(intersect_ranges(halo_ranges(plan_, peer, g), own));
        in.rows += total_rows(in.pieces.back());
        out.rows += total_rows(out.pieces.back());
      }
      if (in.rows > 0) {
        in.data.resize(at(2 * in.rows * d_));
        to_int(2 * in.rows * d_, "a halo message");
        receives_.push_back(std::move(in));
      }
      if (out.rows > 0) {
        out.data.resize(at(2 * out.rows * d_));  // packed by run_halo
        to_int(2 * out.rows * d_, "a halo message");
        sends_.push_back(std::move(out));
      }
    }
  }

  /// Rows `part` of K/V head g from buffer `from` (at positions from `from_span`) into `to`.
  void copy_rows(const Matrix& from, PositionRange from_span, Matrix& to, PositionRange to_span,
                 PositionRange part, Index g) const {
    if (part.empty()) return;
    to.block(part.begin - to_span.begin, g * d_, part.size(), d_) =
        from.block(part.begin - from_span.begin, g * d_, part.size(), d_);
  }

  /// Fills message.data from the own chunks' buffers: K then V, per K/V head g its pieces in
  /// position order (unpack reads them in the same order).
  void pack(Message& message) const {
    Index offset = 0;
    for (Index g = 0; g < G_; ++g)
      for (const PositionRange& piece : message.pieces[at(g)]) {
        for (std::size_t c = 0; c < chunks_.size(); ++c) {
          const PositionRange part = poslsh::range_intersection(piece, chunks_[c].queries);
          if (part.empty()) continue;
          const Index row = offset + part.begin - piece.begin;
          const Index from = part.begin - chunks_[c].key_span.begin;
          for (Index section = 0; section < 2; ++section) {
            float* dst = message.data.data() + (section * message.rows + row) * d_;
            const Matrix& source = section == 0 ? k_[c] : v_[c];
            Eigen::Map<Matrix>(dst, part.size(), d_) = source.block(from, g * d_, part.size(), d_);
          }
        }
        offset += piece.size();
      }
  }

  void run_halo() {
    std::vector<MPI_Request> requests;
    requests.reserve(receives_.size() + sends_.size());
    const double start = MPI_Wtime();
    for (Message& out : sends_) pack(out);
    for (Message& in : receives_) {
      requests.emplace_back();
      MPI_Irecv(in.data.data(), static_cast<int>(in.data.size()), MPI_FLOAT, in.peer, 0,
                MPI_COMM_WORLD, &requests.back());
    }
    for (Message& out : sends_) {
      requests.emplace_back();
      MPI_Isend(out.data.data(), static_cast<int>(out.data.size()), MPI_FLOAT, out.peer, 0,
                MPI_COMM_WORLD, &requests.back());
    }
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    for (const Message& in : receives_) unpack(in);
    stats_[stat_exchange] = MPI_Wtime() - start;
    for (const Message& m : receives_) {
      stats_[stat_received] += static_cast<double>(m.data.size() * sizeof(float));
      stats_[stat_messages_received] += 1;
    }
    for (const Message& m : sends_) {
      stats_[stat_sent] += static_cast<double>(m.data.size() * sizeof(float));
      stats_[stat_messages_sent] += 1;
    }
    for (std::size_t c = 0; c < chunks_.size(); ++c)
      for (Index g = 0; g < G_; ++g)
        if (filled_[c][at(g)] != chunks_[c].keys[at(g)].size())
          throw std::logic_error("K/V head " + std::to_string(g) + " of chunk " +
                                 std::to_string(c) + ": " + std::to_string(filled_[c][at(g)]) +
                                 " rows assembled, the plan's keys hold " +
                                 std::to_string(chunks_[c].keys[at(g)].size()));
    const double compute = MPI_Wtime();
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      const ContextParallelChunk& chunk = chunks_[c];
      const Index m = chunk.queries.size(), L = chunk.key_span.size();
      if (m == 0) continue;
      poslsh::multihead_attention_slice<float>(
          poslsh::interleaved_heads<const float>(q_[c].data(), m, H_, d_),
          poslsh::interleaved_heads<const float>(k_[c].data(), L, G_, d_),
          poslsh::interleaved_heads<const float>(v_[c].data(), L, G_, d_),
          poslsh::interleaved_heads<float>(out_[c].data(), m, H_, d_), lse_[c], chunk.queries.begin,
          chunk.key_span.begin, options_);
    }
    stats_[stat_attention] = MPI_Wtime() - compute;
  }

  void unpack(const Message& message) {
    Index offset = 0;
    for (Index g = 0; g < G_; ++g)
      for (const PositionRange& piece : message.pieces[at(g)]) {
        for (std::size_t c = 0; c < chunks_.size(); ++c) {
          const PositionRange part = poslsh::range_intersection(piece, chunks_[c].keys[at(g)]);
          if (part.empty()) continue;
          const Index row = offset + part.begin - piece.begin;
          const Index to = part.begin - chunks_[c].key_span.begin;
          for (Index section = 0; section < 2; ++section) {
            const float* src = message.data.data() + (section * message.rows + row) * d_;
            Matrix& dst = section == 0 ? k_[c] : v_[c];
            dst.block(to, g * d_, part.size(), d_) = Eigen::Map<const Matrix>(src, part.size(), d_);
          }
          filled_[c][at(g)] += part.size();
        }
        offset += piece.size();
      }
  }

  // --- ring ------------------------------------------------------------------------------------

  /// Rows of rank r's shard (its ranges in order); a shard buffer holds K (rows x G d) then V.
  Index shard_rows(int r) const { return total_rows(own_ranges(plan_, r)); }

  void setup_ring() {
    Index widest = 0;
    for (int r = 0; r < ranks_; ++r) widest = std::max(widest, shard_rows(r));
    const Index cols = G_ * d_, rows = shard_rows(rank_);
    to_int(2 * widest * cols, "a ring message");
    // The own shard, and (R > 1) the shard arriving while another is computed.
    for (int buffer = 0; buffer < std::min(2, ranks_); ++buffer)
      ring_[buffer] = zero_matrix(2 * widest, cols);
    Index row = 0;
    for (const PositionRange& range : own_ranges(plan_, rank_)) {
      generate_rows(config_, tensor_k, cols, range.begin, range.size(),
                    ring_[0].data() + row * cols);
      generate_rows(config_, tensor_v, cols, range.begin, range.size(),
                    ring_[0].data() + (rows + row) * cols);
      row += range.size();
    }
    stats_[stat_key_rows] = static_cast<double>(plan_.n);
  }

  void run_ring() {
    std::vector<std::vector<poslsh::LseMerger<float>>> mergers(chunks_.size());
    for (std::size_t c = 0; c < chunks_.size(); ++c)
      mergers[c].assign(at(H_), poslsh::LseMerger<float>(chunks_[c].queries.size(), d_));
    const Index cols = G_ * d_;
    const int next = (rank_ + 1) % ranks_, previous = (rank_ + ranks_ - 1) % ranks_;
    std::string failure;
    double exchange = 0, compute = 0;
    for (int step = 0; step < ranks_; ++step) {
      // The shard held at this step is that of rank (rank - step) mod R; the next one arrives
      // from rank - 1 while it is computed.
      const int source = (rank_ - step + ranks_) % ranks_;
      Matrix& current = ring_[step % 2];
      Matrix& incoming = ring_[(step + 1) % 2];
      MPI_Request requests[2];
      int pending = 0;
      double start = MPI_Wtime();
      if (step + 1 < ranks_) {
        const int arriving = (rank_ - step - 1 + ranks_) % ranks_;
        const int in_count = static_cast<int>(2 * shard_rows(arriving) * cols);
        const int out_count = static_cast<int>(2 * shard_rows(source) * cols);
        MPI_Irecv(incoming.data(), in_count, MPI_FLOAT, previous, step, MPI_COMM_WORLD,
                  &requests[pending++]);
        MPI_Isend(current.data(), out_count, MPI_FLOAT, next, step, MPI_COMM_WORLD,
                  &requests[pending++]);
        stats_[stat_received] += static_cast<double>(in_count) * sizeof(float);
        stats_[stat_sent] += static_cast<double>(out_count) * sizeof(float);
        stats_[stat_messages_received] += 1;
        stats_[stat_messages_sent] += 1;
      }
      exchange += MPI_Wtime() - start;
      start = MPI_Wtime();
      if (failure.empty()) {
        try {
          ring_step(source, current, mergers);
        } catch (const std::exception& error) {
          failure = error.what();  // keep passing the shards: the others wait for them
        }
      }
      compute += MPI_Wtime() - start;
      start = MPI_Wtime();
      MPI_Waitall(pending, requests, MPI_STATUSES_IGNORE);
      exchange += MPI_Wtime() - start;
    }
    if (!failure.empty()) throw std::runtime_error(failure);
    const double start = MPI_Wtime();
    for (std::size_t c = 0; c < chunks_.size(); ++c)
      for (Index h = 0; h < H_; ++h) {
        mergers[c][at(h)].result(out_[c].middleCols(h * d_, d_));
        lse_[c].row(h) = mergers[c][at(h)].lse().transpose();
      }
    stats_[stat_exchange] = exchange;
    stats_[stat_attention] = compute + MPI_Wtime() - start;
  }

  /// The own chunks against the shard of rank `source` (K then V in `shard`), merged.
  void ring_step(int source, const Matrix& shard,
                 std::vector<std::vector<poslsh::LseMerger<float>>>& mergers) const {
    const Index cols = G_ * d_, rows = shard_rows(source);
    Index row = 0;
    for (const PositionRange& keys : own_ranges(plan_, source)) {
      const Index L = keys.size();
      const float* k = shard.data() + row * cols;
      const float* v = shard.data() + (rows + row) * cols;
      row += L;
      for (std::size_t c = 0; c < chunks_.size(); ++c) {
        const PositionRange own = chunks_[c].queries;
        const Index m = own.size();
        // Causal rows with every key of the slice after them take nothing from it (lse -inf).
        if (m == 0 || (config_.masking == Masking::causal && keys.begin >= own.end)) continue;
        Matrix out(m, H_ * d_), lse(H_, m);
        poslsh::multihead_attention_slice<float>(
            poslsh::interleaved_heads<const float>(q_[c].data(), m, H_, d_),
            poslsh::interleaved_heads<const float>(k, L, G_, d_),
            poslsh::interleaved_heads<const float>(v, L, G_, d_),
            poslsh::interleaved_heads<float>(out.data(), m, H_, d_), lse, own.begin, keys.begin,
            options_);
        for (Index h = 0; h < H_; ++h)
          mergers[c][at(h)].add(out.middleCols(h * d_, d_), lse.row(h).transpose());
      }
    }
  }

  const Config& config_;
  int rank_, ranks_;
  Index H_, G_, d_;
  poslsh::MultiHeadOptions options_;
  ContextParallelPlan plan_;
  std::vector<ContextParallelChunk> chunks_;
  std::vector<Matrix> q_, k_, v_, out_, lse_;
  std::vector<std::vector<Index>> filled_;  // [chunk][g]: rows of keys[g] assembled
  std::vector<Message> receives_, sends_;
  Matrix ring_[2];
  double stats_[stat_count] = {};
};

// ---------------------------------------------------------------------------------------------
// Agreement, check and report

/// Whether any rank failed (an MPI_Allreduce: every rank must call it at the same point). A
/// failed rank prints its error; the others print that they stop because of the first one.
bool any_failed(const std::string& error, int rank, const char* stage) {
  int mine = error.empty() ? INT_MAX : rank, first = INT_MAX;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (first == INT_MAX) return false;
  if (!error.empty())
    std::fprintf(stderr, "%s: rank %d: %s: %s\n", program, rank, stage, error.c_str());
  else
    std::fprintf(stderr, "%s: rank %d: stopping (%s): rank %d failed\n", program, rank, stage,
                 first);
  return true;
}

struct CheckOutcome {
  double max_error = 0;   // max |got - want| / max(1, max |want|), out and lse
  double mismatches = 0;  // elements not bitwise equal
};

/// This rank's rows against multihead_attention on the whole sequence (regenerated here).
CheckOutcome check_rows(const Config& config, const Rank& me) {
  const auto n = static_cast<Index>(config.n), H = static_cast<Index>(config.heads),
             G = static_cast<Index>(config.kv_heads), d = static_cast<Index>(config.dim);
  Matrix q(n, H * d), k(n, G * d), v(n, G * d), out(n, H * d), lse(H, n);
  generate_rows(config, tensor_q, H * d, 0, n, q.data());
  generate_rows(config, tensor_k, G * d, 0, n, k.data());
  generate_rows(config, tensor_v, G * d, 0, n, v.data());
  poslsh::multihead_attention_with_lse<float>(
      poslsh::interleaved_heads<const float>(q.data(), n, H, d),
      poslsh::interleaved_heads<const float>(k.data(), n, G, d),
      poslsh::interleaved_heads<const float>(v.data(), n, G, d),
      poslsh::interleaved_heads<float>(out.data(), n, H, d), lse, head_options(config));
  CheckOutcome outcome;
  const auto compare = [&outcome](const auto& got, const auto& want) {
    double scale = 1, diff = 0;
    for (Index r = 0; r < got.rows(); ++r)
      for (Index c = 0; c < got.cols(); ++c) {
        const float a = got(r, c), b = want(r, c);
        if (a == b) continue;
        outcome.mismatches += 1;
        diff = std::max(diff, std::isfinite(a) && std::isfinite(b)
                                  ? std::abs(static_cast<double>(a) - static_cast<double>(b))
                                  : std::numeric_limits<double>::infinity());
      }
    for (Index r = 0; r < want.rows(); ++r)
      for (Index c = 0; c < want.cols(); ++c)
        if (std::isfinite(want(r, c))) scale = std::max(scale, std::abs(double{want(r, c)}));
    outcome.max_error = std::max(outcome.max_error, diff / scale);
  };
  for (std::size_t c = 0; c < me.chunks().size(); ++c) {
    const PositionRange own = me.chunks()[c].queries;
    if (own.empty()) continue;
    compare(me.out(c), out.middleRows(own.begin, own.size()));
    compare(me.lse(c), lse.middleCols(own.begin, own.size()));
  }
  return outcome;
}

std::string mib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", bytes / (1024.0 * 1024.0));
  return text;
}

int run(int argc, char** argv) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  // 1. Arguments: parsed and checked on every rank before any message; the ranks then agree on
  //    stopping (an error anywhere, or --help) and on rank 0's values.
  Config config;
  std::string error;
  try {
    config = parse_arguments(argc, argv);
  } catch (const std::exception& failure) {
    error = failure.what();
  }
  int stop = !error.empty() ? 2 : config.help ? 1 : 0, worst = 0;
  MPI_Allreduce(&stop, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int mine = error.empty() ? INT_MAX : rank, first = INT_MAX;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (worst == 2) {
    // One message (the lowest rank with a bad argument); every rank exits.
    if (rank == first) {
      const std::string where = ranks > 1 && rank > 0 ? "rank " + std::to_string(rank) + ": " : "";
      std::fprintf(stderr, "%s: %s%s (see --help)\n", program, where.c_str(), error.c_str());
    }
    return 2;
  }
  if (worst == 1) {
    if (rank == 0) std::fputs(usage_text, stdout);
    return 0;
  }
  const ConfigRecord own_record = config_record(config);
  ConfigRecord root_record = own_record;
  MPI_Bcast(root_record.values, 13, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  for (int field = 0; field < 13 && error.empty(); ++field)
    if (own_record.values[field] != root_record.values[field])
      error = std::string(record_names[field]) + " differs from rank 0's" +
              (field < 8 ? " (" + std::to_string(own_record.values[field]) + " here, " +
                               std::to_string(root_record.values[field]) + " on rank 0)"
                         : std::string());
  if (any_failed(error, rank, "arguments")) return 2;

  // 2. Setup: plan, buffers, own rows, packed messages; no message yet.
  std::unique_ptr<Rank> me;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> json(nullptr, &std::fclose);
  try {
    if (rank == 0 && !config.json.empty()) {
      json.reset(std::fopen(config.json.c_str(), "w"));
      if (!json) throw std::runtime_error("--json: cannot write '" + config.json + "'");
    }
    me = std::make_unique<Rank>(config, rank, ranks);
    me->setup();
  } catch (const std::exception& failure) {
    error = failure.what();
  }
  if (any_failed(error, rank, "setup, before the exchange")) return 1;

  // 3. Exchange and attention.
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  try {
    me->run();
  } catch (const std::exception& failure) {
    error = failure.what();
  }
  if (any_failed(error, rank, "exchange and attention")) return 1;
  const double wall = MPI_Wtime() - start;
  std::vector<double> stats(at(stat_count) * at(ranks));
  MPI_Gather(me->stats(), stat_count, MPI_DOUBLE, stats.data(), stat_count, MPI_DOUBLE, 0,
             MPI_COMM_WORLD);

  // 4. Check against the single-process call.
  CheckOutcome outcome;
  if (config.check) {
    try {
      outcome = check_rows(config, *me);
    } catch (const std::exception& failure) {
      error = failure.what();
    }
    if (any_failed(error, rank, "check")) return 1;
    CheckOutcome total;
    MPI_Allreduce(&outcome.max_error, &total.max_error, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&outcome.mismatches, &total.mismatches, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    outcome = total;
  }
  const bool bitwise = !me->ring();
  const double tolerance = 1e-5;
  const bool passed = bitwise ? outcome.mismatches == 0 : outcome.max_error <= tolerance;

  // 5. Report (rank 0).
  if (rank == 0) {
    const auto value = [&stats](int r, Stat s) { return stats[at(r) * at(stat_count) + at(s)]; };
    const auto sum = [&](Stat s) {
      double total = 0;
      for (int r = 0; r < ranks; ++r) total += value(r, s);
      return total;
    };
    const auto maximum = [&](Stat s) {
      double most = 0;
      for (int r = 0; r < ranks; ++r) most = std::max(most, value(r, s));
      return most;
    };
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const char* transport = me->ring() ? "ring" : "halo";
    std::printf(
        "%s: n %lld, R %d, %s %s, %s shards, H %lld, H_kv %lld, d %lld, s %lld, seed %lld, "
        "float32, %d OpenMP thread%s per rank\n",
        program, config.n, ranks, poslsh::enum_name(config.method),
        poslsh::enum_name(config.masking), poslsh::enum_name(config.layout), config.heads,
        config.kv_heads, config.dim, config.samples, config.seed, threads, threads == 1 ? "" : "s");
    std::printf("transport: %s\n",
                me->ring() ? "K/V ring (R - 1 steps, slices merged by log-sum-exp)"
                           : "halo (the plan's keys outside the shard, one message per peer)");
    std::printf("%4s %10s %10s %10s %10s %11s %14s %14s %6s %10s\n", "rank", "rows", "key rows",
                "setup s", "exchange s", "attention s", "sent B", "received B", "msgs", "peak MiB");
    for (int r = 0; r < ranks; ++r)
      std::printf("%4d %10.0f %10.0f %10.4f %10.4f %11.4f %14.0f %14.0f %6.0f %10s\n", r,
                  value(r, stat_rows), value(r, stat_key_rows), value(r, stat_setup),
                  value(r, stat_exchange), value(r, stat_attention), value(r, stat_sent),
                  value(r, stat_received),
                  value(r, stat_messages_sent) + value(r, stat_messages_received),
                  mib(value(r, stat_peak_rss)).c_str());
    std::printf(
        "total: wall %.4f s (barrier to agreement), max exchange %.4f s, max attention %.4f s, "
        "sent %.0f B, received %.0f B, peak %s MiB max / %s MiB sum\n",
        wall, maximum(stat_exchange), maximum(stat_attention), sum(stat_sent), sum(stat_received),
        mib(maximum(stat_peak_rss)).c_str(), mib(sum(stat_peak_rss)).c_str());
    if (!me->ring())
      std::printf("a K/V ring would send %.0f B (max per rank %.0f B)\n", sum(stat_ring_sent),
                  maximum(stat_ring_sent));
    if (config.check) {
      if (bitwise)
        std::printf(
            "check: %s: %.0f elements of out and lse differ from multihead_attention on "
            "the whole sequence (bitwise expected; max relative error %.3g)\n",
            passed ? "PASS" : "FAIL", outcome.mismatches, outcome.max_error);
      else
        std::printf(
            "check: %s: max relative error %.3g against multihead_attention on the "
            "whole sequence (tolerance %g)\n",
            passed ? "PASS" : "FAIL", outcome.max_error, tolerance);
    }
    if (json) {
      std::FILE* f = json.get();
      const auto list = [&](Stat s) {
        std::string text = "[";
        for (int r = 0; r < ranks; ++r) {
          char number[32];
          std::snprintf(number, sizeof number, "%s%.0f", r == 0 ? "" : ", ", value(r, s));
          text += number;
        }
        return text + "]";
      };
      std::fprintf(f, "{\n  \"program\": \"%s\",\n  \"n\": %lld,\n  \"ranks\": %d,\n", program,
                   config.n, ranks);
      std::fprintf(f,
                   "  \"method\": \"%s\",\n  \"masking\": \"%s\",\n  \"layout\": \"%s\",\n"
                   "  \"heads\": %lld,\n  \"kv_heads\": %lld,\n  \"dim\": %lld,\n"
                   "  \"samples\": %lld,\n  \"seed\": %lld,\n  \"band_error\": %.17g,\n"
                   "  \"window_left\": %lld,\n  \"window_right\": %lld,\n"
                   "  \"dtype\": \"float32\",\n  \"omp_threads_per_rank\": %d,\n"
                   "  \"transport\": \"%s\",\n  \"wall_seconds\": %.6f,\n  \"per_rank\": [\n",
                   poslsh::enum_name(config.method), poslsh::enum_name(config.masking),
                   poslsh::enum_name(config.layout), config.heads, config.kv_heads, config.dim,
                   config.samples, config.seed, config.band_error, config.window_left,
                   config.window_right, threads, transport, wall);
      for (int r = 0; r < ranks; ++r)
        std::fprintf(f,
                     "    {\"rank\": %d, \"rows\": %.0f, \"key_rows\": %.0f, "
                     "\"setup_seconds\": %.6f, \"exchange_seconds\": %.6f, "
                     "\"attention_seconds\": %.6f, \"bytes_sent\": %.0f, "
                     "\"bytes_received\": %.0f, \"messages_sent\": %.0f, "
                     "\"messages_received\": %.0f, \"ring_bytes_sent\": %.0f, "
                     "\"peak_rss_bytes\": %.0f}%s\n",
                     r, value(r, stat_rows), value(r, stat_key_rows), value(r, stat_setup),
                     value(r, stat_exchange), value(r, stat_attention), value(r, stat_sent),
                     value(r, stat_received), value(r, stat_messages_sent),
                     value(r, stat_messages_received), value(r, stat_ring_sent),
                     value(r, stat_peak_rss), r + 1 < ranks ? "," : "");
      std::fprintf(f,
                   "  ],\n  \"totals\": {\"bytes_sent\": %.0f, \"bytes_received\": %.0f, "
                   "\"ring_bytes_sent\": %.0f, \"max_exchange_seconds\": %.6f, "
                   "\"max_attention_seconds\": %.6f, \"max_peak_rss_bytes\": %.0f, "
                   "\"sum_peak_rss_bytes\": %.0f},\n",
                   sum(stat_sent), sum(stat_received), sum(stat_ring_sent), maximum(stat_exchange),
                   maximum(stat_attention), maximum(stat_peak_rss), sum(stat_peak_rss));
      if (config.check)
        std::fprintf(f,
                     "  \"check\": {\"passed\": %s, \"bitwise\": %s, \"mismatches\": %.0f, "
                     "\"max_relative_error\": %.6g},\n",
                     passed ? "true" : "false", bitwise ? "true" : "false", outcome.mismatches,
                     outcome.max_error);
      else
        std::fprintf(f, "  \"check\": null,\n");
      // A record of bench/context_parallel_model.py --check (forward bytes; no local window in
      // its model).
      if (config.window_left < 0 && config.window_right < 0)
        std::fprintf(f,
                     "  \"model_record\": {\"n\": %lld, \"R\": %d, \"layout\": \"%s\", "
                     "\"method\": \"%s\", \"masking\": \"%s\", \"heads\": %lld, "
                     "\"kv_heads\": %lld, \"d\": %lld, \"dv\": %lld, \"itemsize\": 4, "
                     "\"sigmas\": null, \"samples\": %lld, \"seed\": %lld, "
                     "\"band_error\": %.17g, \"transport\": \"%s\", "
                     "\"forward_bytes_per_rank\": %s, \"forward_sent_bytes_per_rank\": %s}\n",
                     config.n, ranks, poslsh::enum_name(config.layout),
                     poslsh::enum_name(config.method), poslsh::enum_name(config.masking),
                     config.heads, config.kv_heads, config.dim, config.dim, config.samples,
                     config.seed, config.band_error, transport, list(stat_received).c_str(),
                     list(stat_sent).c_str());
      else
        std::fprintf(f, "  \"model_record\": null\n");
      std::fprintf(f, "}\n");
      const bool written = std::ferror(f) == 0;
      if (std::fclose(json.release()) != 0 || !written) {
        std::fprintf(stderr, "%s: rank 0: error writing %s\n", program, config.json.c_str());
        return 1;
      }
    }
    std::fflush(stdout);
  }
  return config.check && !passed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int result = run(argc, argv);
  MPI_Finalize();
  return result;
}
