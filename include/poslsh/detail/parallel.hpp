// poslsh internals: the one parallel loop of the library. Every OpenMP parallel region of the
// attention kernels, the backward passes and the analysis module is a parallel_loop (or
// parallel_jobs, its form for the forward's jobs): no other file opens a region.
//
// parallel_loop(count, schedule, ..., job) runs job(j, ...) once for every j in [0, count) on
// the threads of one OpenMP team (or on the calling thread: parallel off, a single thread or
// job, inside a parallel region that cannot nest, or a build without OpenMP):
//   schedule     LoopSchedule::blocks(): contiguous blocks of jobs, one per thread (OpenMP
//                schedule(static)); LoopSchedule::dynamic(chunk): `chunk` jobs at a time in
//                increasing order to the next free thread (schedule(dynamic, chunk));
//   scratch      PerThread<Scratch>: one Scratch per thread, made (and sized by the caller)
//                before the region, passed to the jobs of thread t as scratch[t];
//   ThreadGuard  a type each thread of the loop holds while it runs its jobs (e.g. the
//                backward's FlushSubnormals), constructed before its first job, noexcept.
// Errors: an exception thrown by a job is caught on its thread; from then on no job starts
// (each thread leaves the loop after the job it is running), and after the region the first
// exception caught is rethrown with its type (std::bad_alloc stays std::bad_alloc); the others
// are dropped. No exception leaves the OpenMP region. A job that waits for another job (the
// backward's KeyGroupOrder) must stop waiting once a job has failed: it throws LoopStopped,
// which the loop drops.
// Determinism: which thread runs a job and in which order the jobs run vary; a job that writes
// its own outputs with arithmetic depending on the job alone (not on the thread, nor on what
// its scratch held before) gives the same bits for any thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace poslsh::detail {

/// How parallel_loop hands out its jobs.
struct LoopSchedule {
  bool is_dynamic = true;
  long chunk = 1;

  /// Contiguous blocks of jobs, one per thread (OpenMP schedule(static)): jobs of equal cost.
  static constexpr LoopSchedule blocks() { return {false, 0}; }
  /// `chunk` jobs at a time, in increasing order, to the next free thread (OpenMP
  /// schedule(dynamic, chunk)): jobs of unequal cost.
  static constexpr LoopSchedule dynamic(long chunk = 1) { return {true, chunk}; }
};

/// Thrown by a job to leave a parallel_loop because another job has failed (a job waiting for
/// one that will not come); the loop drops it. Thrown only once a job has failed, so the loop
/// always has the failed job's exception to report.
struct LoopStopped {};

/// The ThreadGuard of loops whose threads need no state.
struct NoThreadGuard {};

/// The threads a parallel_loop of `jobs` jobs started here would run on: 1 when `parallel` is
/// false, jobs <= 1, without OpenMP, or where a new region would get one thread (inside active
/// regions as deep as OpenMP nests); otherwise min(omp_get_max_threads(), jobs).
inline int loop_threads(long jobs = std::numeric_limits<long>::max(), bool parallel = true) {
#ifdef _OPENMP
  if (!parallel || jobs <= 1 || omp_get_active_level() >= omp_get_max_active_levels()) return 1;
  return static_cast<int>(std::min<long>(std::max(omp_get_max_threads(), 1), jobs));
#else
  static_cast<void>(jobs);
  static_cast<void>(parallel);
  return 1;
#endif
}

/// One Scratch for each thread of a parallel_loop, default-constructed here (before the
/// region: size them here too, each()), scratch[t] for thread t. Each sits on cache lines
/// of its own.
template <typename Scratch>
class PerThread {
 public:
  /// Scratch for the threads of a loop of `jobs` jobs started here (loop_threads).
  explicit PerThread(long jobs = std::numeric_limits<long>::max(), bool parallel = true)
      : slots_(static_cast<std::size_t>(loop_threads(jobs, parallel))) {}

  int threads() const { return static_cast<int>(slots_.size()); }
  Scratch& operator[](int thread) { return slots_[static_cast<std::size_t>(thread)].scratch; }

  /// f(scratch) for every thread's scratch in thread order, on the calling thread: to size
  /// them before a loop, or to combine them after it.
  template <typename F>
  void each(F&& f) {
    for (Slot& slot : slots_) f(slot.scratch);
  }

 private:
  struct alignas(128) Slot {
    Scratch scratch;
  };
  std::vector<Slot> slots_;
};

/// The first exception of a parallel_loop's jobs and whether one has failed.
class LoopFailure {
 public:
  bool stopped() const { return stopped_.load(std::memory_order_relaxed); }

  /// job() unless a job has failed; catches what it throws (the first exception is kept).
  template <typename Job>
  void run(Job&& job) noexcept {
    if (stopped()) return;
    try {
      job();
    } catch (const LoopStopped&) {
      stopped_.store(true, std::memory_order_relaxed);
    } catch (...) {
      std::exception_ptr caught = std::current_exception();
#pragma omp critical(poslsh_parallel_loop_failure)
      if (!failure_) failure_ = std::move(caught);
      stopped_.store(true, std::memory_order_relaxed);
    }
  }

  /// Rethrows the first exception caught, if any (after the region).
  void rethrow() const {
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  std::atomic<bool> stopped_{false};
  std::exception_ptr failure_;
};

/// job(j, thread) for j = 0 .. count - 1 on at most `threads` threads (thread < threads), each
/// holding a ThreadGuard; the first exception a job throws is rethrown after the loop.
template <typename ThreadGuard = NoThreadGuard, typename Job>
void parallel_loop_threads(long count, LoopSchedule schedule, int threads, Job&& job) {
  static_assert(std::is_nothrow_default_constructible_v<ThreadGuard>,
                "a thread's guard is made inside the region: it must not throw");
  if (count <= 0) return;
  LoopFailure failure;
#ifdef _OPENMP
  const int team = static_cast<int>(std::min<long>(std::max(threads, 1), count));
  if (team > 1) {
    const long chunk = std::max(schedule.chunk, 1L);
#pragma omp parallel num_threads(team)
    {
      [[maybe_unused]] const ThreadGuard guard{};
      const int thread = omp_get_thread_num();
      if (schedule.is_dynamic) {
#pragma omp for schedule(dynamic, chunk)
        for (long j = 0; j < count; ++j) failure.run([&] { job(j, thread); });
      } else {
#pragma omp for schedule(static)
        for (long j = 0; j < count; ++j) failure.run([&] { job(j, thread); });
      }
    }
    failure.rethrow();
    return;
  }
#else
  static_cast<void>(schedule);
  static_cast<void>(threads);
#endif
  [[maybe_unused]] const ThreadGuard guard{};
  for (long j = 0; j < count && !failure.stopped(); ++j) failure.run([&] { job(j, 0); });
  failure.rethrow();
}

/// job(j, scratch[thread]) for j = 0 .. count - 1 (the threads: those of `scratch`).
template <typename ThreadGuard = NoThreadGuard, typename Scratch, typename Job>
void parallel_loop(long count, LoopSchedule schedule, PerThread<Scratch>& scratch, Job&& job) {
  parallel_loop_threads<ThreadGuard>(count, schedule, scratch.threads(),
                                     [&](long j, int thread) { job(j, scratch[thread]); });
}

/// job(j) for j = 0 .. count - 1, in parallel when `parallel` (loop_threads).
template <typename ThreadGuard = NoThreadGuard, typename Job>
void parallel_loop(long count, LoopSchedule schedule, bool parallel, Job&& job) {
  parallel_loop_threads<ThreadGuard>(count, schedule, loop_threads(count, parallel),
                                     [&](long j, int) { job(j); });
}

/// The forward's loop: job(j, workspace) for j = 0 .. count - 1, one job at a time to the next
/// free thread (LoopSchedule::dynamic()), each thread with its own default-constructed
/// Workspace (made before the region; the jobs size it).
template <typename Workspace, typename Job>
void parallel_jobs(long count, Job&& job) {
  PerThread<Workspace> workspaces(count);
  parallel_loop(count, LoopSchedule::dynamic(), workspaces, std::forward<Job>(job));
}

}  // namespace poslsh::detail
