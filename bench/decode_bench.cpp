// poslsh benchmarks: decode, decode_lsh/<t> and decode_exact/<t>. One iteration is one new
// token: its query (all H = 8 heads, one after the other on one thread, as the decode functions
// are single-threaded) over a KV cache of t tokens ([t, H, d], the query at position t - 1), so
// the row time is the time per token. decode_lsh_bf16/<t> and decode_exact_bf16/<t>: the same
// problem with the query and the cache in Eigen::bfloat16 (the float inputs rounded), output in
// float.
#include <sys/mman.h>

#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <type_traits>

#include "bench_support.hpp"

namespace poslsh::bench {

namespace {

/// The longest cache; shorter caches are its prefixes.
constexpr Index max_cache = 1048576;

enum class Decoder { lsh, exact };

using bf16 = Eigen::bfloat16;

/// Input tensor `which` of n tokens ([n, H, d]) rounded to bfloat16, created once (on huge
/// pages, as the float tensors) and kept for the run.
HeadsView<const bf16> bf16_view(Which which, Index n) {
  struct Free {
    void operator()(bf16* pointer) const { std::free(pointer); }
  };
  static std::unique_ptr<bf16, Free> tensors[3];
  static Index tokens[3] = {0, 0, 0};
  const auto index = static_cast<std::size_t>(which);
  if (tokens[index] < n) {
    constexpr std::size_t huge_page = std::size_t{2} << 20;
    const auto size = static_cast<long>(n * heads * dim);
    const std::size_t bytes =
        (static_cast<std::size_t>(size) * sizeof(bf16) + huge_page - 1) / huge_page * huge_page;
    tensors[index].reset(static_cast<bf16*>(std::aligned_alloc(huge_page, bytes)));
    if (!tensors[index]) throw std::bad_alloc();
    madvise(tensors[index].get(), bytes, MADV_HUGEPAGE);  // advice only
    bf16* data = tensors[index].get();
#pragma omp parallel for schedule(static)
    for (long i = 0; i < size; ++i)
      data[i] = bf16(input_value(which, static_cast<std::uint64_t>(i)));
    tokens[index] = n;
  }
  return interleaved_heads<const bf16>(tensors[index].get(), tokens[index], heads, dim);
}

/// The decode problem's tensor `which` of n tokens in Storage: the shared float inputs, or
/// their bfloat16 rounding.
template <typename Storage>
auto storage_view(Which which, Index n) {
  if constexpr (std::is_same_v<Storage, float>)
    return input_view(which, n);
  else
    return bf16_view(which, n);
}

/// One token of the decoder over a cache of t tokens, query and cache in Storage, output in
/// float.
template <typename Storage>
void run_decode(benchmark::State& state, Index t, Decoder decoder) {
  const auto keys = storage_view<Storage>(Which::k, max_cache);
  const auto values = storage_view<Storage>(Which::v, max_cache);
  const auto query = storage_view<Storage>(Which::q, 1);
  const auto out = output_view(1);
  const std::vector<double> sigmas = alibi_sigmas(static_cast<int>(heads));
  const std::vector<HashSet> hashes = multihead_hashes(sigmas, default_samples, seed);
  const Index position = t - 1;
  // Keys read per token: t per head exactly; by LSH [lsh_decode_first_key, t - 1].
  long long pairs = 0;
  for (const HashSet& head_hashes : hashes) {
    pairs += decoder == Decoder::exact ? t : t - lsh_decode_first_key(head_hashes, position);
  }
  for (auto _ : state) {
    for (Index h = 0; h < heads; ++h) {
      auto out_h = out.head(h);
      const auto keys_h = keys.head(h).topRows(t);
      const auto values_h = values.head(h).topRows(t);
      if (decoder == Decoder::lsh) {
        lsh_attention_decode<Storage, Storage, float>(query.head(h), keys_h, values_h, position,
                                                      hashes[static_cast<std::size_t>(h)], out_h);
      } else {
        alibi_attention_decode_exact<Storage, Storage, float>(
            query.head(h), keys_h, values_h, position, sigmas[static_cast<std::size_t>(h)], out_h);
      }
    }
    benchmark::DoNotOptimize(out.data);
    benchmark::ClobberMemory();
  }
  set_kernel_counters(state, pairs, heads, PeakOf{PeakUnit::fma_f32, flops_per_pair, 1});
  state.counters["tokens"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

void register_decode() {
  struct DecoderRow {
    const char* name;
    Decoder decoder;
    bool bf16;          // query and cache in bfloat16
    const char* label;  // for tables and plots
  };
  // The one list of the decoders: bench_report.py reads it from the JSON context
  // ("poslsh_decoders": "name=label;..."), in this order.
  const DecoderRow rows[] = {{"decode_lsh", Decoder::lsh, false, "LSH (s = 16)"},
                             {"decode_exact", Decoder::exact, false, "exact"},
                             {"decode_lsh_bf16", Decoder::lsh, true, "LSH (s = 16), bfloat16"},
                             {"decode_exact_bf16", Decoder::exact, true, "exact, bfloat16"}};
  std::string decoders;
  for (const DecoderRow& row : rows) {
    decoders += std::string(decoders.empty() ? "" : ";") + row.name + "=" + row.label;
  }
  benchmark::AddCustomContext("poslsh_decoders", decoders);
  for (const DecoderRow& row : rows) {
    for (Index t = 4096; t <= max_cache; t *= 2) {
      register_timed(std::string(row.name) + "/" + std::to_string(t), benchmark::kMicrosecond, 0.3,
                     row.bf16 ? run_decode<bf16> : run_decode<float>, t, row.decoder);
    }
  }
}

}  // namespace poslsh::bench
