// Failures inside the parallel loops: an exception thrown by a job of detail::parallel_loop
// reaches the caller with its type (the first one; the other threads leave the loop), a job
// waiting on KeyGroupOrder leaves when another fails, and an allocation failing anywhere in a
// backward call (single head, all heads with every method of the table, a slice of the context
// parallel backward) reaches the caller as std::bad_alloc, after which the library computes the
// same gradients as before. Argument checks that pass make no allocation (the rules with numbers
// in them are written only for a failing check).
//
// The allocation failures come from a replacement of the global operator new in this file
// (every form: plain, array, aligned, nothrow), active only while FailingAllocations is armed:
// it then counts the allocations of the program and throws std::bad_alloc at the k-th (the
// nothrow forms return null). Allocations by std::malloc (Eigen's matrices) are not counted.
// Under AddressSanitizer the replacement still applies (the sanitizer intercepts malloc, which
// it calls), so the sweeps run in the asan preset too.
#include <poslsh/detail/checks/attention.hpp>
#include <poslsh/detail/parallel.hpp>
#include <poslsh/multihead/training.hpp>
#include <poslsh/parallel/slice.hpp>
#include <poslsh/training/backward.hpp>

#include "backward_kernels.hpp"
#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace backward_failures {

/// The state of the replacement operator new: while `armed`, allocation number `fail_at`
/// (counting from 1) fails; `in_region` counts the failures inside an active OpenMP region.
struct FailingAllocations {
  static inline std::atomic<bool> armed{false};
  static inline std::atomic<long> count{0};
  static inline std::atomic<long> fail_at{0};
  static inline std::atomic<long> in_region{0};

  /// Whether this allocation is to fail (counted when armed).
  static bool fails() {
    if (!armed.load(std::memory_order_relaxed)) return false;
    const long number = count.fetch_add(1, std::memory_order_relaxed) + 1;
    if (number != fail_at.load(std::memory_order_relaxed)) return false;
#ifdef _OPENMP
    if (omp_in_parallel() != 0) in_region.fetch_add(1, std::memory_order_relaxed);
#endif
    return true;
  }
};

void* allocate(std::size_t size) {
  if (FailingAllocations::fails()) throw std::bad_alloc();
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}

void* allocate_aligned(std::size_t size, std::align_val_t alignment) {
  if (FailingAllocations::fails()) throw std::bad_alloc();
  const auto align = std::max(static_cast<std::size_t>(alignment), sizeof(void*));
  void* p = nullptr;
  if (posix_memalign(&p, align, size == 0 ? 1 : size) == 0) return p;
  throw std::bad_alloc();
}

}  // namespace backward_failures

// The replaced allocation functions of the whole test program (one definition each).
void* operator new(std::size_t size) { return backward_failures::allocate(size); }
void* operator new[](std::size_t size) { return backward_failures::allocate(size); }
void* operator new(std::size_t size, std::align_val_t alignment) {
  return backward_failures::allocate_aligned(size, alignment);
}
void* operator new[](std::size_t size, std::align_val_t alignment) {
  return backward_failures::allocate_aligned(size, alignment);
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return backward_failures::allocate(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return backward_failures::allocate(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t size, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  try {
    return backward_failures::allocate_aligned(size, alignment);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  try {
    return backward_failures::allocate_aligned(size, alignment);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace backward_failures {

using poslsh::HashSet;
using poslsh::Index;
using poslsh::RowMatrix;
using poslsh_test::random_matrix;
namespace pd = poslsh::detail;

/// What a sweep saw: the allocations of one call, the calls that threw std::bad_alloc, and the
/// failures inside an OpenMP region.
struct SweepResult {
  long allocations = 0;
  long failed = 0;
  long in_region = 0;
};

/// Runs call() with allocation k failing, for k = 1 .. (allocations of one call) + 8; each
/// call either succeeds, and then check() (the outputs equal the reference) must hold, or
/// throws std::bad_alloc (any other exception fails the test case; a crash ends it). After the
/// sweep, an unarmed call gives the reference again.
template <typename Call, typename Check>
SweepResult allocation_sweep(Call&& call, Check&& check) {
  SweepResult result;
  FailingAllocations::count = 0;
  FailingAllocations::fail_at = 0;
  FailingAllocations::armed = true;
  call();
  FailingAllocations::armed = false;
  result.allocations = FailingAllocations::count.load();
  REQUIRE(check());
  FailingAllocations::in_region = 0;
  for (long k = 1; k <= result.allocations + 8; ++k) {
    bool threw = false;
    FailingAllocations::count = 0;
    FailingAllocations::fail_at = k;
    FailingAllocations::armed = true;
    try {
      call();
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    FailingAllocations::armed = false;
    if (threw) {
      ++result.failed;
    } else {
      INFO("allocation " << k << " of " << result.allocations << " failed, the call succeeded");
      CHECK(check());
    }
  }
  result.in_region = FailingAllocations::in_region.load();
  call();
  CHECK(check());
  return result;
}

/// NaN in every entry, so that an entry a call leaves unwritten shows.
template <typename Matrix>
void poison(Matrix& m) {
  m.setConstant(std::numeric_limits<typename Matrix::Scalar>::quiet_NaN());
}

template <typename Matrix>
bool same_bits(const Matrix& a, const Matrix& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() && (a.array() == b.array()).all();
}

// The test cases: in this namespace, so that the names above stay this file's in a unity batch.

TEST_CASE("parallel_loop hands a job's exception to the caller with its type",
          "[parallel][failures]") {
  for (const int threads : {1, 2, 4}) {
    const poslsh_test::Threads scope(threads);
    for (const pd::LoopSchedule schedule :
         {pd::LoopSchedule::dynamic(), pd::LoopSchedule::dynamic(4), pd::LoopSchedule::blocks()}) {
      INFO(threads << " threads, dynamic " << schedule.is_dynamic << ", chunk " << schedule.chunk);
      // A std::runtime_error from one job, its message intact.
      std::vector<int> done(1000, 0);
      try {
        pd::parallel_loop(1000, schedule, true, [&](long j) {
          if (j == 337) throw std::runtime_error("job 337");
          done[static_cast<std::size_t>(j)] = 1;
        });
        FAIL("no exception");
      } catch (const std::runtime_error& error) {
        CHECK(std::string(error.what()) == "job 337");
      }
      CHECK(done[337] == 0);
      // std::bad_alloc stays std::bad_alloc, with per-thread scratch.
      pd::PerThread<std::vector<int>> scratch(1000);
      CHECK_THROWS_AS(pd::parallel_loop(1000, schedule, scratch,
                                        [](long j, std::vector<int>&) {
                                          if (j == 5) throw std::bad_alloc();
                                        }),
                      std::bad_alloc);
      // Every job failing: one of their exceptions arrives (the first caught), the others are
      // dropped.
      try {
        pd::parallel_loop(64, schedule, true,
                          [](long j) { throw std::out_of_range(std::to_string(j)); });
        FAIL("no exception");
      } catch (const std::out_of_range& error) {
        const long j = std::stol(error.what());
        CHECK(j >= 0);
        CHECK(j < 64);
      }
      // No exception: every job runs once.
      std::vector<std::atomic<int>> runs(777);
      pd::parallel_loop(777, schedule, true,
                        [&](long j) { runs[static_cast<std::size_t>(j)].fetch_add(1); });
      for (const auto& count : runs) CHECK(count.load() == 1);
    }
  }
}

TEST_CASE("after a job fails the threads leave the loop without starting jobs",
          "[parallel][failures]") {
  const poslsh_test::Threads scope(4);
  // Job 0 fails at once; the others take 1 ms each. The loop ends after the jobs already
  // running: a handful, not the 2000 (2 s) of the whole loop.
  std::atomic<long> started{0};
  const auto begin = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(pd::parallel_loop(2000, pd::LoopSchedule::dynamic(), true,
                                    [&](long j) {
                                      started.fetch_add(1);
                                      if (j == 0) throw std::logic_error("first");
                                      std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                    }),
                  std::logic_error);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  INFO(started.load() << " jobs started in " << seconds << " s");
  CHECK(started.load() < 100);
  CHECK(seconds < 1.0);
}

TEST_CASE("each thread of a loop has its own scratch, made before the loop",
          "[parallel][failures]") {
  const poslsh_test::Threads scope(4);
  struct Scratch {
    std::vector<long> jobs;
    std::atomic<int> users{0};
  };
  pd::PerThread<Scratch> scratch(1000);
  scratch.each([](Scratch& s) { s.jobs.reserve(1000); });
  const std::size_t threads = static_cast<std::size_t>(scratch.threads());
  std::atomic<long> shared{0};
  pd::parallel_loop(1000, pd::LoopSchedule::dynamic(), scratch, [&](long j, Scratch& s) {
    if (s.users.fetch_add(1) != 0) shared.fetch_add(1);  // another thread in this scratch
    s.jobs.push_back(j);
    s.users.fetch_sub(1);
  });
  CHECK(shared.load() == 0);
  std::vector<int> seen(1000, 0);
  std::size_t used = 0;
  scratch.each([&](Scratch& s) {
    used += s.jobs.empty() ? 0 : 1;
    for (const long j : s.jobs) ++seen[static_cast<std::size_t>(j)];
  });
  CHECK(used <= threads);
  for (const int count : seen) CHECK(count == 1);
}

TEST_CASE("an exception from a loop inside a loop's job reaches the caller",
          "[parallel][failures]") {
  const poslsh_test::Threads scope(4);
  CHECK_THROWS_AS(pd::parallel_loop(8, pd::LoopSchedule::dynamic(), true,
                                    [](long outer) {
                                      pd::parallel_loop(100, pd::LoopSchedule::blocks(), true,
                                                        [outer](long inner) {
                                                          if (outer == 3 && inner == 42)
                                                            throw std::domain_error("inner");
                                                        });
                                    }),
                  std::domain_error);
}

TEST_CASE("threads waiting on the key group order leave when a key group fails",
          "[parallel][failures]") {
  // Every row reaches every key: each step's dQ additions come from every key group in order.
  const Index n = 2100, groups = (n + pd::backward_group_keys - 1) / pd::backward_group_keys;
  const pd::WindowRule<float> rule(0, n, -n, n, 0.0f);
  const Index steps = (n + pd::backward_query_rows - 1) / pd::backward_query_rows;
  REQUIRE(groups >= 4);
  for (const int threads : {1, 2, 4}) {
    for (const Index failing : {Index{0}, groups - 1}) {
      INFO(threads << " threads, key group " << failing << " fails");
      const poslsh_test::Threads scope(threads);
      const pd::KeyGroupOrder order(rule, steps);
      std::vector<std::vector<Index>> added(static_cast<std::size_t>(steps));
      // As backward_parallel: a failed group abandons the order before its exception leaves.
      CHECK_THROWS_AS(
          pd::parallel_loop(static_cast<long>(groups), pd::LoopSchedule::dynamic(), true,
                            [&](long g) {
                              try {
                                for (Index step = 0; step < steps; ++step) {
                                  if (g == failing && step == steps / 2)
                                    throw std::runtime_error("group");
                                  order.add(step, g, [&] {
                                    added[static_cast<std::size_t>(step)].push_back(g);
                                  });
                                }
                              } catch (...) {
                                order.abandon();
                                throw;
                              }
                            }),
          std::runtime_error);
      // What was added came in increasing group order.
      for (const std::vector<Index>& step : added) {
        for (std::size_t i = 0; i < step.size(); ++i) CHECK(step[i] == static_cast<Index>(i));
      }
    }
  }
}

TEST_CASE("an allocation failing in a single-head backward reaches the caller as bad_alloc",
          "[backward][failures]") {
  using poslsh_test::BackwardKind;
  using Setup = poslsh_test::BackwardSetup;
  const poslsh_test::Threads scope(4);
  // n > 512: several key groups and count tiles; blocks of several widths.
  const Index n = 700, d = 16, dv = 8;
  const RowMatrix<float> q = random_matrix<float>(n, d, 11);
  const RowMatrix<float> k = random_matrix<float>(n, d, 12);
  const RowMatrix<float> v = random_matrix<float>(n, dv, 13);
  const RowMatrix<float> dout = random_matrix<float>(n, dv, 14);
  const HashSet hashes = poslsh::rbf_hashes(48.0, 4, 5, 0);
  for (const poslsh::Masking masking : {poslsh::Masking::causal, poslsh::Masking::bidirectional}) {
    const std::vector<Setup> all = {
        {BackwardKind::tiled, 32.0, 0, {}, poslsh_test::with_masking(masking)},
        {BackwardKind::banded, 32.0, 100, {}, poslsh_test::with_masking(masking)},
        {BackwardKind::fused, 48.0, 0, hashes, poslsh_test::with_masking(masking)},
        {BackwardKind::per_sample, 48.0, 0, hashes, poslsh_test::with_masking(masking)},
        {BackwardKind::fixed_blocks, 48.0, 0, {}, poslsh_test::with_masking(masking)},
    };
    for (const Setup& s : all) {
      INFO(poslsh_test::backward_kind_name(s.kind) << ", " << poslsh_test::masking_name(masking));
      RowMatrix<float> out;
      poslsh_test::ColumnVector<float> lse;
      poslsh_test::setup_forward<float>(s, q, k, v, out, lse);
      const auto reference = poslsh_test::setup_backward<float>(s, q, k, v, out, lse, dout);
      poslsh_test::BackwardGradients<float> grads;
      const SweepResult result = allocation_sweep(
          [&] { grads = poslsh_test::setup_backward<float>(s, q, k, v, out, lse, dout); },
          [&] {
            return same_bits(grads.dq, reference.dq) && same_bits(grads.dk, reference.dk) &&
                   same_bits(grads.dv, reference.dv);
          });
      INFO(result.allocations << " allocations, " << result.failed << " calls threw, "
                              << result.in_region << " failures inside a parallel region");
      CHECK(result.failed > 0);
#ifdef _OPENMP
      // The count windows of the fused pass are built in a parallel loop, tile by tile.
      if (s.kind == BackwardKind::fused) CHECK(result.in_region > 0);
#endif
    }
  }
}

TEST_CASE("an allocation failing in multihead_attention_backward reaches the caller as bad_alloc",
          "[backward][failures][long]") {
  const poslsh_test::Threads scope(4);
  // Two query heads: one job per head (H_q = H_kv) or one group of two heads (H_kv = 1).
  const Index n = 600, heads = 2, d = 16;
  for (const Index kv_heads : {Index{2}, Index{1}}) {
    const poslsh_test::HeadsBackwardInputs<float> in(n, heads, kv_heads, d, d, 21);
    for (const poslsh::Method method :
         {poslsh::Method::lsh_fused, poslsh::Method::exact_tiled, poslsh::Method::exact_banded,
          poslsh::Method::lsh_per_sample, poslsh::Method::fixed_blocks,
          poslsh::Method::mean_of_outputs}) {
      INFO("kv heads " << kv_heads << ", method " << poslsh::enum_name(method));
      poslsh::MultiHeadOptions options;
      options.method = method;
      options.samples = 4;
      RowMatrix<float> outb(n, heads * d), lse = RowMatrix<float>::Zero(heads, n);
      const auto out_view = poslsh::interleaved_heads<float>(outb.data(), n, heads, d);
      if (poslsh::method_has_lse(method)) {
        poslsh::multihead_attention_with_lse<float>(in.q, in.k, in.v, out_view, lse, options);
      } else {
        // mean_of_outputs: no lse (its backward recomputes each sample's and reads neither).
        poslsh::multihead_attention<float>(in.q, in.k, in.v, out_view, options);
      }
      RowMatrix<float> grads[2][3];
      const auto backward = [&](RowMatrix<float>(&g)[3]) {
        g[0].resize(n, heads * d);
        g[1].resize(n, kv_heads * d);
        g[2].resize(n, kv_heads * d);
        for (RowMatrix<float>& m : g) backward_failures::poison(m);
        poslsh::multihead_attention_backward<float>(
            in.q, in.k, in.v, poslsh::interleaved_heads<const float>(outb.data(), n, heads, d), lse,
            in.dout, poslsh::interleaved_heads<float>(g[0].data(), n, heads, d),
            poslsh::interleaved_heads<float>(g[1].data(), n, kv_heads, d),
            poslsh::interleaved_heads<float>(g[2].data(), n, kv_heads, d), options);
      };
      backward(grads[0]);
      const SweepResult result = allocation_sweep([&] { backward(grads[1]); },
                                                  [&] {
                                                    return same_bits(grads[0][0], grads[1][0]) &&
                                                           same_bits(grads[0][1], grads[1][1]) &&
                                                           same_bits(grads[0][2], grads[1][2]);
                                                  });
      INFO(result.allocations << " allocations, " << result.failed << " calls threw, "
                              << result.in_region << " failures inside a parallel region");
      CHECK(result.failed > 0);
#ifdef _OPENMP
      // One head per job of a parallel loop (H_q = H_kv), whose count windows allocate.
      if (kv_heads == heads && method == poslsh::Method::lsh_fused) CHECK(result.in_region > 0);
#endif
    }
  }
}

TEST_CASE("an allocation failing in multihead_attention_slice_backward reaches the caller",
          "[backward][failures][context_parallel][long]") {
  const poslsh_test::Threads scope(4);
  // The queries [256, 700) of a sequence of 900 tokens against the keys [128, 900).
  const Index n = 900, p0 = 256, m = 700 - p0, k0 = 128, L = n - k0, heads = 4, d = 16;
  for (const Index kv_heads : {Index{4}, Index{2}}) {
    const RowMatrix<float> qb = random_matrix<float>(m, heads * d, 31);
    const RowMatrix<float> kb = random_matrix<float>(L, kv_heads * d, 32);
    const RowMatrix<float> vb = random_matrix<float>(L, kv_heads * d, 33);
    const RowMatrix<float> outb = random_matrix<float>(m, heads * d, 34);
    const RowMatrix<float> doutb = random_matrix<float>(m, heads * d, 35);
    // Any lse will do: the sweep compares the gradients of one call with themselves.
    const RowMatrix<float> lse = RowMatrix<float>::Constant(heads, m, 4.0f);
    const auto q = poslsh::interleaved_heads<const float>(qb.data(), m, heads, d);
    const auto k = poslsh::interleaved_heads<const float>(kb.data(), L, kv_heads, d);
    const auto v = poslsh::interleaved_heads<const float>(vb.data(), L, kv_heads, d);
    const auto out = poslsh::interleaved_heads<const float>(outb.data(), m, heads, d);
    const auto dout = poslsh::interleaved_heads<const float>(doutb.data(), m, heads, d);
    for (const poslsh::Method method :
         {poslsh::Method::exact_tiled, poslsh::Method::exact_banded}) {
      INFO("kv heads " << kv_heads << ", method " << poslsh::enum_name(method));
      poslsh::MultiHeadOptions options;
      options.method = method;
      RowMatrix<float> grads[2][3];
      Eigen::VectorXd dslopes[2];
      // The slice's gradients are added to the outputs: zeroed before each call.
      const auto backward = [&](RowMatrix<float>(&g)[3], Eigen::VectorXd& slopes) {
        g[0].setZero(m, heads * d);
        g[1].setZero(L, kv_heads * d);
        g[2].setZero(L, kv_heads * d);
        slopes.setZero(heads);
        poslsh::multihead_attention_slice_backward<float>(
            q, k, v, out, lse, dout, poslsh::interleaved_heads<float>(g[0].data(), m, heads, d),
            poslsh::interleaved_heads<float>(g[1].data(), L, kv_heads, d),
            poslsh::interleaved_heads<float>(g[2].data(), L, kv_heads, d), slopes, p0, k0, options);
      };
      backward(grads[0], dslopes[0]);
      const SweepResult result = allocation_sweep([&] { backward(grads[1], dslopes[1]); },
                                                  [&] {
                                                    return same_bits(grads[0][0], grads[1][0]) &&
                                                           same_bits(grads[0][1], grads[1][1]) &&
                                                           same_bits(grads[0][2], grads[1][2]) &&
                                                           same_bits(dslopes[0], dslopes[1]);
                                                  });
      INFO(result.allocations << " allocations, " << result.failed << " calls threw, "
                              << result.in_region << " failures inside a parallel region");
      CHECK(result.failed > 0);
    }
  }
}

TEST_CASE("argument checks that pass allocate nothing, and a failing one names its numbers",
          "[failures][checks]") {
  const Index n = 100, heads = 2, d = 16;
  const RowMatrix<float> q = random_matrix<float>(n, heads * d, 41);
  const auto view = poslsh::interleaved_heads<const float>(q.data(), n, heads, d);
  const auto single = q.leftCols(d);
  poslsh::AttentionOptions options;
  options.scale = 0.25;
  // Counting (allocation 0 never fails) while the checks of a call run: views, shapes, the
  // scale and masking, the sigma of a hash.
  FailingAllocations::count = 0;
  FailingAllocations::fail_at = 0;
  FailingAllocations::armed = true;
  view.validate("f", "q");
  pd::require_view_shape("f", "q", view, n, heads, d);
  pd::require_qkv_shapes("f", single, single, single);
  pd::require_self_attention("f", single, single);
  const double tau = pd::resolve_scale("f", options, d);
  pd::require_hash_sigma(8.0, "f");
  FailingAllocations::armed = false;
  CHECK(FailingAllocations::count.load() == 0);
  CHECK(tau == 0.25);
  // The rule with the sizes in it is written when the check fails.
  try {
    pd::require_view_shape("f", "out", view, n, heads, 2 * d);
    FAIL("no exception");
  } catch (const std::invalid_argument& error) {
    CHECK(std::string(error.what()) ==
          "poslsh: f: argument 'out' = 100x2x16: must be 100x2x32 (tokens x heads x dim)");
  }
  try {
    std::vector<float> buffer(static_cast<std::size_t>(n * heads * d));
    auto bad = poslsh::HeadsView<float>{buffer.data(), n, heads, d, heads * d, 4};
    bad.validate("f", "out");
    FAIL("no exception");
  } catch (const std::invalid_argument& error) {
    CHECK(std::string(error.what()) ==
          "poslsh: f: argument 'out.head_stride' = 4: must be >= dim = 16");
  }
}

}  // namespace backward_failures
