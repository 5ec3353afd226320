// poslsh bounded decode: one attention layer of an ALiBi model (BLOOM-7b1: 32 heads, d = 128,
// the ALiBi slopes; or MPT-7B-StoryWriter: 32 heads, d = 128, alibi_bias_max = 16, so sigmas up
// to 65536) generating far past the memory a full KV cache would need. The planner picks each
// head's method at a relative output error target (plan_heads, default 1%); a BoundedKVCache
// keeps, per head, only the keys that head can still read. Tokens arrive in chunks (appended as
// a prefill would; --attend-chunks also computes their queries); at each checkpoint t the last
// --decode-steps tokens before it are decoded one by one (append, then attention of the new
// query), timed. A progress line per power of two (after the release at the cache's length) and
// per checkpoint shows the cache's bytes against the full cache's and the time per decoded
// token; --csv writes the same rows.
// --compare-full T also times the same decode steps at T on a full contiguous cache
// (multihead_attention with the plan), the decoders' speed on the bounded cache against it.
// Inputs are random (a pool of 4096 random tokens, token t takes row t mod 4096).
//   bounded_decode [--model bloom|mpt] [--tokens N] [--target E] [--page P] [--dtype bf16|float]
//                  [--chunk C] [--decode-steps D] [--checkpoints 4096,65536,...] [--threads T]
//                  [--attend-chunks] [--compare-full T] [--csv FILE]
#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <poslsh/cache/bounded_kv_cache.hpp>
#include <poslsh/multihead/planner.hpp>
#include <random>
#include <string>
#include <vector>

#include "example_cli.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using poslsh::Index;
using poslsh::RowMatrix;

constexpr const char* program = "bounded_decode";
constexpr const char* usage =
    "usage: bounded_decode [--model bloom|mpt] [--tokens N] [--target E] [--page P]\n"
    "                      [--dtype bf16|float] [--chunk C] [--decode-steps D]\n"
    "                      [--checkpoints T1,T2,...] [--threads T] [--attend-chunks]\n"
    "                      [--compare-full T] [--csv FILE]\n"
    "One BLOOM-7b1- or MPT-7B-StoryWriter-shaped attention layer (32 heads, d = 128) decoding\n"
    "to N tokens (default 1048576) on a bounded KV cache, heads planned at output error E\n"
    "(default 0.01); see the comment at the top of examples/bounded_decode.cpp.\n";

constexpr Index heads = 32, dim = 128, pool_tokens = 4096;
constexpr double mib = 1024.0 * 1024.0;

struct Settings {
  std::string model = "bloom";
  Index tokens = 1048576;
  double target = 0.01;
  Index page = 256;
  std::string dtype = "bf16";
  Index chunk = 4096;
  Index decode_steps = 32;
  std::vector<Index> checkpoints = {4096, 65536, 1048576};
  int threads = 1;
  bool attend_chunks = false;
  Index compare_full = 0;
  std::string csv;
};

/// The sigmas of the model's 32 heads: BLOOM's ALiBi slopes (Press et al.), or MPT's
/// 2^(-alibi_bias_max h / H), h = 1 .. H, with alibi_bias_max = 16 (MPT-7B-StoryWriter).
std::vector<double> model_sigmas(const std::string& model) {
  if (model == "bloom") return poslsh::alibi_sigmas(static_cast<int>(heads));
  std::vector<double> sigmas;
  for (Index h = 1; h <= heads; ++h)
    sigmas.push_back(std::pow(2.0, 16.0 * static_cast<double>(h) / static_cast<double>(heads)));
  return sigmas;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// The layer on a bounded cache of Storage.
template <typename Storage>
class Layer {
 public:
  Layer(const Settings& settings, const std::vector<poslsh::HeadPlan>& plans, Index pages)
      : plans_(plans), cache_(poslsh::planned_heads(plans), heads, dim, dim, settings.page, pages) {
    std::mt19937_64 engine(7);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (RowMatrix<Storage>* m : {&q_, &k_, &v_}) {
      m->resize(pool_tokens, heads * dim);
      for (Index i = 0; i < m->size(); ++i) m->data()[i] = static_cast<Storage>(normal(engine));
    }
    sequence_ = cache_.open();
  }

  Index length() const { return cache_.length(sequence_); }
  /// No query before the current length from now on: releases the pages dead there.
  void advance() { cache_.advance(sequence_, length()); }
  const poslsh::BoundedKVCache<Storage>& cache() const { return cache_; }
  Index sequence() const { return sequence_; }

  /// Appends positions [t, t + m) (m <= pool_tokens), computing their queries when `attend`.
  void append(Index m, bool attend) {
    const Index t = length();
    for (Index a = 0; a < m;) {
      const Index row = (t + a) % pool_tokens, count = std::min(m - a, pool_tokens - row);
      cache_.append(sequence_, t + a, rows(k_, row, count), rows(v_, row, count));
      if (attend) {
        out_.resize(count, heads * dim);
        poslsh::multihead_attention_bounded<Storage, Storage, Storage>(
            rows(q_, row, count), cache_, sequence_,
            poslsh::interleaved_heads<Storage>(out_.data(), count, heads, dim));
      }
      a += count;
    }
  }

  /// One decode step (append the next token, attend its query); returns its seconds.
  double decode_step() {
    const auto start = std::chrono::steady_clock::now();
    append(1, true);
    return seconds_since(start);
  }

  /// The same decode step at position t on a full cache holding every key 0 .. t contiguously
  /// (full_k, full_v: at least t + 1 tokens); returns its seconds.
  double full_step(const RowMatrix<Storage>& full_k, const RowMatrix<Storage>& full_v, Index t) {
    const Index row = t % pool_tokens;
    out_.resize(1, heads * dim);
    poslsh::AttentionOptions options;
    options.query_offset = t;
    const auto start = std::chrono::steady_clock::now();
    poslsh::multihead_attention<Storage>(
        rows(q_, row, 1),
        poslsh::interleaved_heads<const Storage>(full_k.data(), t + 1, heads, dim),
        poslsh::interleaved_heads<const Storage>(full_v.data(), t + 1, heads, dim),
        poslsh::interleaved_heads<Storage>(out_.data(), 1, heads, dim), plans_, options);
    return seconds_since(start);
  }

  const RowMatrix<Storage>& pool(int which) const { return which == 0 ? k_ : v_; }

 private:
  static poslsh::HeadsView<const Storage> rows(const RowMatrix<Storage>& m, Index row,
                                               Index count) {
    return poslsh::interleaved_heads<const Storage>(m.data() + row * m.cols(), count, heads, dim);
  }

  std::vector<poslsh::HeadPlan> plans_;
  poslsh::BoundedKVCache<Storage> cache_;
  Index sequence_ = 0;
  RowMatrix<Storage> q_, k_, v_, out_;
};

/// Median of a sample (copied).
double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

template <typename Storage>
int run(const Settings& settings) {
#ifdef _OPENMP
  omp_set_num_threads(settings.threads);
#endif
  const std::vector<double> sigmas = model_sigmas(settings.model);
  poslsh::PlannerOptions planner;
  planner.head_dim = dim;
  const std::vector<poslsh::HeadPlan> plans = poslsh::plan_heads(
      settings.tokens, sigmas, poslsh::Masking::causal, settings.target, planner);
  std::printf("%s-shaped layer: %ld heads, d = %ld, %s storage, pages of %ld positions\n",
              settings.model.c_str(), static_cast<long>(heads), static_cast<long>(dim),
              settings.dtype.c_str(), static_cast<long>(settings.page));
  std::printf("plan at output error %.3g for n = %ld:\n%s", settings.target,
              static_cast<long>(settings.tokens),
              poslsh::format_plan(plans, settings.tokens).c_str());
  // The pool: each head's live keys at the last position (the retention rule), plus a page per
  // head for the partly filled one and a page of slack, or the full cache if that is smaller.
  const std::vector<poslsh::HeadMethod> methods = poslsh::planned_heads(plans);
  Index pages = 0;
  for (Index g = 0; g < heads; ++g) {
    Index widest = 0;
    for (Index t = std::max<Index>(0, settings.tokens - 8192); t < settings.tokens; t += 61)
      widest = std::max(widest, t - poslsh::kv_head_first_live_key(methods, heads, g, t));
    pages += (widest + settings.chunk) / settings.page + 3;
  }
  pages = std::min(pages, heads * ((settings.tokens + settings.page - 1) / settings.page));
  Layer<Storage> layer(settings, plans, pages);
  std::printf("pool: %ld pages of %.2f MiB (%.1f MiB)\n", static_cast<long>(pages),
              static_cast<double>(layer.cache().page_bytes()) / mib,
              static_cast<double>(pages) * static_cast<double>(layer.cache().page_bytes()) / mib);
  std::FILE* csv = poslsh_examples::open_csv(
      program, settings.csv,
      "t,cache_bytes,full_cache_bytes,decode_us_per_token,full_us_per_token\n");
  const auto report = [&](Index t, double decode_us, double full_us) {
    const double bytes = static_cast<double>(layer.cache().bytes_in_use());
    const double full = static_cast<double>(layer.cache().full_cache_bytes(layer.sequence()));
    std::printf("t = %8ld  cache %9.1f MiB  full cache %10.1f MiB  (%.3f%%)", static_cast<long>(t),
                bytes / mib, full / mib, 100.0 * bytes / full);
    if (decode_us > 0) std::printf("  decode %.0f us/token", decode_us);
    if (full_us > 0) std::printf("  full-cache decode %.0f us/token", full_us);
    std::printf("\n");
    std::fflush(stdout);
    if (csv != nullptr)
      std::fprintf(csv, "%ld,%.0f,%.0f,%.3f,%.3f\n", static_cast<long>(t), bytes, full, decode_us,
                   full_us);
  };
  const auto start = std::chrono::steady_clock::now();
  Index next_report = 1024;
  for (Index checkpoint : settings.checkpoints) {
    if (checkpoint > settings.tokens) break;
    const Index decode_from = std::max<Index>(layer.length(), checkpoint - settings.decode_steps);
    // The full cache's keys, for the comparison at this checkpoint.
    RowMatrix<Storage> full_k, full_v;
    const bool compare = settings.compare_full == checkpoint;
    if (compare) {
      full_k.resize(checkpoint, heads * dim);
      full_v.resize(checkpoint, heads * dim);
      for (Index t = 0; t < checkpoint; ++t) {
        full_k.row(t) = layer.pool(0).row(t % pool_tokens);
        full_v.row(t) = layer.pool(1).row(t % pool_tokens);
      }
    }
    while (layer.length() < decode_from) {
      const Index m = std::min(settings.chunk, decode_from - layer.length());
      layer.append(m, settings.attend_chunks);
      // The next query sits at the new length: the chunk's pages dead there go back now.
      layer.advance();
      if (layer.length() >= next_report) {
        report(layer.length(), 0, 0);
        while (next_report <= layer.length()) next_report *= 2;
      }
    }
    std::vector<double> decode, full;
    while (layer.length() < checkpoint) {
      const Index t = layer.length();
      decode.push_back(layer.decode_step());
      if (compare) full.push_back(layer.full_step(full_k, full_v, t));
    }
    report(layer.length(), decode.empty() ? 0 : 1e6 * median(decode),
           full.empty() ? 0 : 1e6 * median(full));
  }
  std::printf("done in %.1f s (%d thread%s)\n", seconds_since(start), settings.threads,
              settings.threads == 1 ? "" : "s");
  if (csv != nullptr) std::fclose(csv);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  for (poslsh_examples::Args args(program, usage, argc, argv); args.next();) {
    if (!(args.text("--model", settings.model) || args.number("--tokens", settings.tokens) ||
          args.number("--target", settings.target) || args.number("--page", settings.page) ||
          args.text("--dtype", settings.dtype) || args.number("--chunk", settings.chunk) ||
          args.number("--decode-steps", settings.decode_steps) ||
          args.positive_list("--checkpoints", settings.checkpoints) ||
          args.number("--threads", settings.threads) ||
          args.set("--attend-chunks", settings.attend_chunks, true) ||
          args.number("--compare-full", settings.compare_full) || args.text("--csv", settings.csv)))
      args.unknown();
  }
  if (settings.model != "bloom" && settings.model != "mpt")
    poslsh_examples::fail(program, "--model must be bloom or mpt");
  if (settings.tokens < 1 || settings.chunk < 1 || settings.decode_steps < 1 ||
      settings.threads < 1)
    poslsh_examples::fail(program, "--tokens, --chunk, --decode-steps and --threads must be >= 1");
  if (settings.dtype == "bf16") return run<Eigen::bfloat16>(settings);
  if (settings.dtype == "float") return run<float>(settings);
  poslsh_examples::fail(program, "--dtype must be bf16 or float");
}
