// poslsh context parallelism over MPI, a thin driver of poslsh/parallel/context_parallel.hpp
// (the calls poslsh.distributed makes): one float32 sequence of n tokens sharded over the R
// ranks of MPI_COMM_WORLD (contiguous or zigzag), each rank's rows of Q, K, V from a
// counter-based generator, the library's buffers moved with MPI_Isend / MPI_Irecv: halo methods
// send one message to each peer (pack_halo_message) and run halo_forward, bitwise the
// single-process rows; exact_tiled without a window runs the K/V ring (ring_step, the next
// shard in flight while the current one is computed) merged by RingForward, equal to rounding.
// Rank 0 prints per rank the times, bytes and messages. --check compares the rows with
// multihead_attention on the whole sequence (small n; bitwise, or relative error <= 1e-5 for
// the ring) and the bytes with the library's count (halo_traffic, ring_traffic): exit status 1
// on a mismatch. The ranks check and agree on the arguments before any message, and each stage
// ends with an MPI_Allreduce of an error flag, so a failure on one rank stops every rank with a
// message, not a hang (exit status 2 for arguments, 1 otherwise). Options: --help.
#define OMPI_SKIP_MPICXX 1   // the C API only: the deprecated C++ bindings do not compile
#define MPICH_SKIP_MPICXX 1  // cleanly under -Wconversion
#include <mpi.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <poslsh/parallel/context_parallel.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using poslsh::HaloPass;
using poslsh::Index;
using Buffer = std::vector<float>;

constexpr const char* program = "mpi_context_parallel";
constexpr const char* usage =
    "usage: mpirun -np R mpi_context_parallel [--n N] [--heads H] [--kv-heads G] [--dim D]\n"
    "  [--method lsh_fused|lsh_per_sample|fixed_blocks|exact_banded|exact_tiled]\n"
    "  [--layout contiguous|zigzag] [--bidirectional] [--samples S] [--seed S] [--band-error E]\n"
    "  [--window-left L] [--window-right R] [--check]   (Open MPI as root: --allow-run-as-root)\n"
    "Defaults: n 16384, H 8, G = H, d 64, lsh_fused, contiguous, causal, 16 samples, seed 0,\n"
    "band error 1e-3, no window. --check compares with the whole sequence's rows (small n).\n";

// Every argument as a number, in the order the ranks compare them with rank 0's: the integers
// (with their bounds), the method, the layout, --band-error's bits and the switches.
// clang-format off
struct Flag { const char* name; long long low, high, value; };
enum Field { n, heads, kv, dim, samples, seed, left, right, method, layout, band, mask, check };
constexpr long long most = 1LL << 40;
constexpr int field_count = check + 1, integer_count = method;

struct Config {
  Flag flag[field_count] = {
      {"--n", 1, most, 16384}, {"--heads", 1, 4096, 8}, {"--kv-heads", 0, 4096, 0},
      {"--dim", 1, 4096, 64}, {"--samples", 1, 4096, 16}, {"--seed", 0, LLONG_MAX, 0},
      {"--window-left", -1, most, -1}, {"--window-right", -1, most, -1}, {"--method", 0, 0, 0},
      {"--layout", 0, 0, 0}, {"--band-error", 0, 0, 0}, {"--bidirectional", 0, 0, 0},
      {"--check", 0, 0, 0}};
  // clang-format on
  double band_error = 1e-3;
  bool help = false;

  long long operator[](Field f) const { return flag[f].value; }
  poslsh::MultiHeadOptions options() const {
    poslsh::MultiHeadOptions o;
    o.method = static_cast<poslsh::Method>(flag[method].value);
    o.masking = flag[mask].value ? poslsh::Masking::bidirectional : poslsh::Masking::causal;
    o.samples = flag[samples].value;
    o.seed = static_cast<std::uint64_t>(flag[seed].value);
    o.band_error = band_error;
    o.window_left = flag[left].value;
    o.window_right = flag[right].value;
    return o;
  }
  poslsh::ContextParallelShapes shapes() const {
    return {flag[heads].value, flag[kv].value, flag[dim].value, flag[dim].value};
  }
};

/// The arguments of every rank; throws std::invalid_argument naming the bad argument.
Config parse(int argc, char** argv) {
  Config c;
  const auto bad = [](const std::string& flag, const std::string& rule, const std::string& text) {
    return std::invalid_argument(flag + " " + rule + ", got '" + text + "'");
  };
  for (int a = 1; a < argc; ++a) {
    const std::string name = argv[a];
    const auto found =
        std::find_if(c.flag, c.flag + field_count, [&](const Flag& f) { return name == f.name; });
    const auto field = static_cast<Field>(found - c.flag);
    if (name == "--help" || name == "-h" || field == mask || field == check) {
      c.help = c.help || field == field_count;
      if (field != field_count) found->value = 1;
      continue;
    }
    if (field == field_count) throw std::invalid_argument("unknown option '" + name + "'");
    if (a + 1 >= argc) throw std::invalid_argument(name + " needs a value");
    const std::string text = argv[++a];
    char* end = nullptr;
    errno = 0;
    if (field < integer_count) {
      found->value = std::strtoll(text.c_str(), &end, 10);
      if (*end != '\0' || text.empty() || errno == ERANGE || found->value < found->low ||
          found->value > found->high)
        throw bad(
            name,
            "must be in [" + std::to_string(found->low) + ", " + std::to_string(found->high) + "]",
            text);
    } else if (field == band) {
      c.band_error = std::strtod(text.c_str(), &end);
      if (*end != '\0' || text.empty() || !(c.band_error > 0.0 && c.band_error < 1.0))
        throw bad(name, "must be in (0, 1)", text);
    } else if (field == method) {
      found->value = static_cast<long long>(
          poslsh::enum_from_name<poslsh::Method>(text, program, found->name));
    } else {
      found->value = static_cast<long long>(
          poslsh::enum_from_name<poslsh::ShardLayout>(text, program, found->name));
    }
  }
  if (c[kv] == 0) c.flag[kv].value = c[heads];
  if (c[heads] % c[kv] != 0)
    throw bad("--kv-heads", "must divide --heads " + std::to_string(c[heads]),
              std::to_string(c[kv]));
  std::memcpy(&c.flag[band].value, &c.band_error, sizeof(double));
  return c;
}

/// The rows of tensor t (1: Q, 2: K, 3: V) at `positions`, `width` columns each: element
/// (row, column) is uniform in [-1, 1), a function of (seed, t, row, column) alone (SplitMix64's
/// finalizer of a counter), so any rank can produce any row.
Buffer rows_of(const Config& c, std::uint64_t tensor, const std::vector<Index>& positions,
               Index width) {
  Buffer rows;
  const auto columns = static_cast<std::uint64_t>(width);
  for (const Index position : positions)
    for (std::uint64_t col = 0; col < columns; ++col) {
      std::uint64_t x = (static_cast<std::uint64_t>(c[seed]) * 4 + tensor) * 0x9e3779b97f4a7c15ULL +
                        static_cast<std::uint64_t>(position) * columns + col;
      x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
      x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
      rows.push_back(static_cast<float>((x ^ (x >> 31)) >> 40) * (2.0f / 16777216.0f) - 1.0f);
    }
  return rows;
}

/// Whether any rank failed (an MPI_Allreduce every rank reaches): the failed ranks print their
/// error, the others that they stop because of the first one.
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

/// The message of what `stage` throws (empty when it returns).
template <typename Stage>
std::string attempt(Stage&& stage) {
  try {
    stage();
  } catch (const std::exception& failure) {
    return failure.what();
  }
  return {};
}

// Per-rank statistics, gathered to rank 0.
enum Stat { exchange, attention, sent, received, messages, lib_sent, lib_received, stat_count };

/// Posts a nonblocking send or receive of `buffer` (none when it is empty), counted in stats.
void post(Buffer& buffer, bool sending, Index peer, int tag, std::vector<MPI_Request>& requests,
          double* stats) {
  if (buffer.empty()) return;
  if (buffer.size() > INT_MAX) throw std::length_error("a message exceeds INT_MAX floats");
  requests.emplace_back();
  const auto count = static_cast<int>(buffer.size());
  const int to = static_cast<int>(peer);
  if (sending)
    MPI_Isend(buffer.data(), count, MPI_FLOAT, to, tag, MPI_COMM_WORLD, &requests.back());
  else
    MPI_Irecv(buffer.data(), count, MPI_FLOAT, to, tag, MPI_COMM_WORLD, &requests.back());
  stats[sending ? sent : received] += static_cast<double>(count) * sizeof(float);
  stats[messages] += 1;
}

/// This rank's forward into out [m, H, d] and lse (H x m): the library's calls, MPI moving the
/// buffers.
void forward(const poslsh::ContextParallelRank& me, const Buffer& q, const Buffer& k,
             const Buffer& v, Buffer& out, poslsh::RowMatrix<float>& lse, double* stats) {
  const poslsh::ContextParallelShapes& s = me.shapes();
  const Index m = me.rows(), ranks = me.ranks(), rank = me.rank();
  const auto q_view =
      poslsh::interleaved_heads<const float>(q.data(), m, s.query_heads, s.head_dim);
  const auto k_view = poslsh::interleaved_heads<const float>(k.data(), m, s.kv_heads, s.head_dim);
  const auto v_view = poslsh::interleaved_heads<const float>(v.data(), m, s.kv_heads, s.value_dim);
  const auto out_view = poslsh::interleaved_heads<float>(out.data(), m, s.query_heads, s.value_dim);
  std::vector<MPI_Request> requests;
  double start = MPI_Wtime();
  if (!me.plan().ring) {
    const poslsh::RankTensors<float> t{q_view, k_view, v_view, {}, {}};
    std::vector<Buffer> in(static_cast<std::size_t>(ranks)), to(in.size());
    for (Index p = 0; p < ranks; ++p) {
      const auto at = static_cast<std::size_t>(p);
      if (p == rank) continue;
      in[at].resize(static_cast<std::size_t>(me.received_elements(p, HaloPass::forward)));
      to[at].resize(static_cast<std::size_t>(me.sent_elements(p, HaloPass::forward)));
      poslsh::pack_halo_message(me, p, HaloPass::forward, t, to[at].data());
      post(in[at], false, p, 0, requests, stats);
      post(to[at], true, p, 0, requests, stats);
    }
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    stats[exchange] = MPI_Wtime() - start;
    std::vector<poslsh::MessageView<float>> views;
    for (const Buffer& inbox : in)
      views.emplace_back(inbox.data(), static_cast<Index>(inbox.size()));
    start = MPI_Wtime();
    poslsh::halo_forward(me, t, views, out_view, lse);
    stats[attention] = MPI_Wtime() - start;
    return;
  }
  poslsh::RingForward<float> ring(me);
  Buffer shards[2];
  shards[0].resize(static_cast<std::size_t>(poslsh::ring_shard_elements(me, rank)));
  poslsh::pack_ring_shard(k_view, v_view, shards[0].data());
  for (Index step = 0; step < ranks; ++step) {
    // The shard held now moves on to rank + 1 while it is computed; the next one arrives.
    const poslsh::RingStep at = poslsh::ring_step(ranks, rank, step);
    Buffer& held = shards[step % 2];
    Buffer& next = shards[(step + 1) % 2];
    requests.clear();
    if (at.transfers) {
      next.resize(static_cast<std::size_t>(poslsh::ring_shard_elements(me, at.arriving)));
      post(next, false, at.receive_from, static_cast<int>(step), requests, stats);
      post(held, true, at.send_to, static_cast<int>(step), requests, stats);
    }
    start = MPI_Wtime();
    const auto [shard_k, shard_v] = poslsh::ring_shard_views(me, at.source, held.data());
    ring.add(q_view, at.source, shard_k, shard_v);
    stats[attention] += MPI_Wtime() - start;
    start = MPI_Wtime();
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    stats[exchange] += MPI_Wtime() - start;
  }
  start = MPI_Wtime();
  ring.result(out_view, lse);
  stats[attention] += MPI_Wtime() - start;
}

/// (the largest |got - want| / max(1, max |want|), the elements not bitwise equal) of this
/// rank's rows of out and lse against multihead_attention on the whole sequence.
std::pair<double, double> check_rows(const Config& c, const poslsh::ContextParallelRank& me,
                                     const Buffer& out, const poslsh::RowMatrix<float>& lse) {
  const poslsh::ContextParallelShapes& s = c.shapes();
  const Index total = c[n], width = s.query_heads * s.value_dim;
  std::vector<Index> all(static_cast<std::size_t>(total));
  for (Index i = 0; i < total; ++i) all[static_cast<std::size_t>(i)] = i;
  const Buffer q = rows_of(c, 1, all, s.query_heads * s.head_dim);
  const Buffer k = rows_of(c, 2, all, s.kv_heads * s.head_dim);
  const Buffer v = rows_of(c, 3, all, s.kv_heads * s.value_dim);
  Buffer want(static_cast<std::size_t>(total * width));
  poslsh::RowMatrix<float> want_lse(s.query_heads, total);
  poslsh::multihead_attention_with_lse<float>(
      poslsh::interleaved_heads<const float>(q.data(), total, s.query_heads, s.head_dim),
      poslsh::interleaved_heads<const float>(k.data(), total, s.kv_heads, s.head_dim),
      poslsh::interleaved_heads<const float>(v.data(), total, s.kv_heads, s.value_dim),
      poslsh::interleaved_heads<float>(want.data(), total, s.query_heads, s.value_dim), want_lse,
      c.options());
  using Rows = Eigen::Map<const poslsh::RowMatrix<float>>;
  const double scale = std::max(1.0f, Rows(want.data(), total, width).cwiseAbs().maxCoeff());
  double worst = 0, mismatches = 0;
  const auto compare = [&](const auto& got, const auto& expected) {  // NaN counts as infinite
    mismatches += static_cast<double>((got.array() != expected.array()).count());
    worst = std::max(worst, static_cast<double>((got - expected).cwiseAbs().maxCoeff()));
    if (!got.allFinite()) worst = HUGE_VAL;
  };
  for (const poslsh::ContextParallelChunk& chunk : me.chunks()) {
    const Index m = chunk.queries.size(), first = chunk.queries.begin;
    compare(Rows(out.data() + chunk.row * width, m, width),
            Rows(want.data() + first * width, m, width));
    compare(lse.middleCols(chunk.row, m), want_lse.middleCols(first, m));
  }
  return {worst / scale, mismatches};
}

int run(int argc, char** argv) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  // 1. Arguments, checked on every rank before any message; the ranks agree on rank 0's.
  Config c;
  std::string error = attempt([&] { c = parse(argc, argv); });
  if (any_failed(error, rank, "arguments (see --help)")) return 2;
  int help = c.help ? 1 : 0, any_help = 0;
  MPI_Allreduce(&help, &any_help, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_help != 0 && rank == 0) std::fputs(usage, stdout);
  if (any_help != 0) return 0;
  long long root[field_count];
  for (int f = 0; f < field_count; ++f) root[f] = c.flag[f].value;
  MPI_Bcast(root, field_count, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  for (int f = 0; f < field_count && error.empty(); ++f)
    if (c.flag[f].value != root[f])
      error = std::string(c.flag[f].name) + " differs from rank 0's" +
              (f < integer_count ? " (" + std::to_string(c.flag[f].value) + " here, " +
                                       std::to_string(root[f]) + " on rank 0)"
                                 : std::string());
  if (any_failed(error, rank, "arguments")) return 2;

  // 2. Setup: this rank's plan, its rows of Q, K and V, room for its results, the library's
  //    count of the bytes it will send and receive.
  const poslsh::ContextParallelShapes s = c.shapes();
  std::unique_ptr<poslsh::ContextParallelRank> me;
  Buffer q, k, v, out;
  poslsh::RowMatrix<float> lse;
  double stats[stat_count] = {};
  error = attempt([&] {
    me = std::make_unique<poslsh::ContextParallelRank>(
        c[n], ranks, static_cast<poslsh::ShardLayout>(c[layout]), rank, s, c.options());
    std::vector<Index> own;
    for (const poslsh::ContextParallelChunk& chunk : me->chunks())
      for (Index p = chunk.queries.begin; p < chunk.queries.end; ++p) own.push_back(p);
    q = rows_of(c, 1, own, s.query_heads * s.head_dim);
    k = rows_of(c, 2, own, s.kv_heads * s.head_dim);
    v = rows_of(c, 3, own, s.kv_heads * s.value_dim);
    out.resize(own.size() * static_cast<std::size_t>(s.query_heads * s.value_dim));
    lse.resize(s.query_heads, me->rows());
    const auto traffic = me->plan().ring ? poslsh::ring_traffic : poslsh::halo_traffic;
    const poslsh::ContextParallelTraffic library = traffic(me->plan(), s, sizeof(float), {});
    const auto at = static_cast<std::size_t>(rank);
    stats[lib_sent] = static_cast<double>(library.forward_sent[at]);
    stats[lib_received] = static_cast<double>(library.forward_received[at]);
  });
  if (any_failed(error, rank, "setup")) return 1;

  // 3. Exchange and attention (the ring passes every shard on whatever happens: no hang).
  MPI_Barrier(MPI_COMM_WORLD);
  error = attempt([&] { forward(*me, q, k, v, out, lse, stats); });
  if (any_failed(error, rank, "exchange and attention")) return 1;
  std::vector<double> all(static_cast<std::size_t>(stat_count * ranks));
  MPI_Gather(stats, stat_count, MPI_DOUBLE, all.data(), stat_count, MPI_DOUBLE, 0, MPI_COMM_WORLD);

  // 4. Check against the single-process call.
  std::pair<double, double> outcome{0, 0}, total{0, 0};
  if (c[check]) {
    error = attempt([&] { outcome = check_rows(c, *me, out, lse); });
    if (any_failed(error, rank, "check")) return 1;
    MPI_Allreduce(&outcome.first, &total.first, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&outcome.second, &total.second, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  }
  const bool ring = me->plan().ring;
  const bool rows_ok = ring ? total.first <= 1e-5 : total.second == 0;
  if (rank != 0) return c[check] && !rows_ok ? 1 : 0;

  // 5. Report (rank 0), and the bytes against the library's count.
  std::printf(
      "%s: n %lld, R %d, %s %s, %s shards, H %lld, H_kv %lld, d %lld, s %lld, seed %lld, "
      "float32\ntransport: %s\n%4s %11s %11s %12s %12s %5s %12s %12s\n",
      program, c[n], ranks, poslsh::enum_name(static_cast<poslsh::Method>(c[method])),
      c[mask] ? "bidirectional" : "causal",
      poslsh::enum_name(static_cast<poslsh::ShardLayout>(c[layout])), c[heads], c[kv], c[dim],
      c[samples], c[seed],
      ring ? "K/V ring (slices merged by log-sum-exp)" : "halo (one message per peer)", "rank",
      "exchange s", "attention s", "sent B", "received B", "msgs", "library sent", "library recv");
  bool bytes_ok = true;
  for (int r = 0; r < ranks; ++r) {
    const double* x = &all[static_cast<std::size_t>(r * stat_count)];
    bytes_ok = bytes_ok && x[sent] == x[lib_sent] && x[received] == x[lib_received];
    std::printf("%4d %11.4f %11.4f %12.0f %12.0f %5.0f %12.0f %12.0f\n", r, x[exchange],
                x[attention], x[sent], x[received], x[messages], x[lib_sent], x[lib_received]);
  }
  const bool passed = rows_ok && bytes_ok;
  std::printf("bytes %s the library's count\n", bytes_ok ? "equal to" : "DIFFER FROM");
  if (c[check])
    std::printf(
        "check: %s: %.0f elements of out and lse differ from the whole sequence's (%s), "
        "max relative error %.3g\n",
        passed ? "PASS" : "FAIL", total.second, ring ? "tolerance 1e-5" : "bitwise expected",
        total.first);
  return c[check] && !passed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  const int result = run(argc, argv);
  MPI_Finalize();
  return result;
}
