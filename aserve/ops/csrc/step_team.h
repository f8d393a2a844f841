// The threads of one small step kept together across its kernels (DecoderStack::forward runs a step of a few rows
// as one StepTeam::run), and the parallel_for every kernel file splits its work with.
//
// Why: at batch 1 a decode step is ~150 short parallel kernels (four projections and attention a layer, 5-30 us
// each), and every at::parallel_for is an OpenMP region: its start waits on the pool's dock barrier and its end on
// the team barrier, each a round trip between the cores. Timed inside the bench model's GPTQ step (Intel Xeon,
// avx512_bf16 avx512_vnni, 2 threads), a 576-output int4_linear spent ~2,500 TSC cycles a call (up to ~12,000 when
// the VM was slow) between the call and the threads starting their shares and after the last one finished,
// against ~17,000 of work. Here the step is one region: thread 0 runs the layers, and the other threads spin
// between kernels until it posts a range; posting and collecting it is one handoff each way.
//
// parallel_for splits a range as at::parallel_for does (the same chunks to the same thread numbers), so a
// kernel's output does not depend on whether a team runs it. Outside a team it is at::parallel_for.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

#include <sched.h>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace aserve_kernels {

// One turn of a wait on another thread of the team: a pause, and after ~16k of them (a millisecond or more, far
// longer than any step's serial stretch) a yield too, so that a team on a busier machine than it expected gives
// the core back to whoever else needs it.
inline void spin_pause(uint32_t& spins) {
#if defined(__x86_64__)
  _mm_pause();
#endif
  if (++spins > (1u << 14)) std::this_thread::yield();
}

// The CPUs this process may run on: a team spins, so it only runs where each of its threads has a CPU of its own.
inline int64_t usable_cpus() {
  static const int64_t count = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof set, &set) == 0 ? int64_t{CPU_COUNT(&set)} : int64_t{1};
  }();
  return count;
}

class StepTeam {
 public:
  // body() on this thread with the other threads of at::get_num_threads() serving its parallel_for ranges; body()
  // alone where there is one thread or more threads than CPUs, or where this thread is already inside a parallel
  // region or a team. Whether a team ran it.
  template <class Body> static bool run(const Body& body) {
#if defined(_OPENMP)
    const int64_t threads = at::get_num_threads();
    if (threads > 1 && threads <= usable_cpus() && !at::in_parallel_region() && active() == nullptr) {
      StepTeam team;
      std::exception_ptr error;
#pragma omp parallel
      {
        const int64_t tid = omp_get_thread_num();
        at::internal::ThreadIdGuard tid_guard(tid);
        c10::ParallelGuard guard(true);
        if (tid == 0) {
          team.threads_ = omp_get_num_threads();
          active() = &team;
          try {
            body();
          } catch (...) {
            error = std::current_exception();
          }
          active() = nullptr;
          team.post(nullptr, nullptr, 0, 0, 0);  // stop
        } else {
          team.serve(tid);
        }
      }
      if (error) std::rethrow_exception(error);
      return true;
    }
#endif
    body();
    return false;
  }

  // The threads parallel_for runs on: the team's, or at::get_num_threads().
  static int64_t threads() {
    const StepTeam* team = active();
    return team != nullptr ? team->threads_ : at::get_num_threads();
  }

  // f over [begin, end) in at::parallel_for's chunks: on the team's threads where this thread runs a team.
  template <class F> static void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    StepTeam* team = active();
    if (team == nullptr) return at::parallel_for(begin, end, grain, f);
    if (begin >= end) return;
    const int64_t count = end - begin;
    if (count <= grain || count <= 1 || team->busy_) return f(begin, end);  // busy: a loop inside a share, inline
    team->busy_ = true;
    int64_t parts = team->threads_;
    if (grain > 0) parts = std::min(parts, (count + grain - 1) / grain);
    const int64_t chunk = (count + parts - 1) / parts;
    team->post(&f, [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); }, begin, end,
               chunk);
    std::exception_ptr error;
    try {
      f(begin, std::min(end, begin + chunk));
    } catch (...) {
      error = std::current_exception();
    }
    team->wait();  // the helpers may still read f, on this stack
    team->busy_ = false;
    if (!error) error = team->error_;
    team->error_ = nullptr;
    team->failed_.store(false, std::memory_order_relaxed);
    if (error) std::rethrow_exception(error);
  }

 private:
  using Invoke = void (*)(const void* f, int64_t begin, int64_t end);

  static StepTeam*& active() {
    static thread_local StepTeam* team = nullptr;
    return team;
  }

  // Thread 0: the next range (f null: stop) to every helper, which each acknowledge.
  void post(const void* f, Invoke invoke, int64_t begin, int64_t end, int64_t chunk) {
    f_ = f, invoke_ = invoke, begin_ = begin, end_ = end, chunk_ = chunk;
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    posted_.fetch_add(1, std::memory_order_release);
  }

  void wait() const {
    for (uint32_t spins = 0; pending_.load(std::memory_order_acquire) != 0;) spin_pause(spins);
  }

  // A helper: each posted range's chunk `tid`, until the stop.
  void serve(int64_t tid) {
    for (uint64_t seen = 0;;) {
      uint64_t now;
      for (uint32_t spins = 0; (now = posted_.load(std::memory_order_acquire)) == seen;) spin_pause(spins);
      seen = now;
      if (f_ == nullptr) return;
      const int64_t b = begin_ + tid * chunk_;
      if (b < end_) {
        try {
          invoke_(f_, b, std::min(end_, b + chunk_));
        } catch (...) {
          bool expected = false;
          if (failed_.compare_exchange_strong(expected, true)) error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  int64_t threads_ = 1;
  bool busy_ = false;  // thread 0 is running a range's share
  const void* f_ = nullptr;
  Invoke invoke_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
  alignas(64) std::atomic<uint64_t> posted_{0};   // bumped once a range (and for the stop)
  alignas(64) std::atomic<int64_t> pending_{0};   // helpers yet to finish the posted range
};

// Every kernel's parallel loop (see StepTeam).
template <class F> inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  StepTeam::parallel_for(begin, end, grain, f);
}

// The threads of the running parallel_for: the team's where one is running, else at::get_num_threads().
inline int64_t parallel_threads() { return StepTeam::threads(); }

// Parts of [0, count) handed to threads as they ask for them, in `rows` runs of `width` (a part never crosses a
// run's end): the first parts large, then smaller as fewer are left (guided scheduling). A static split ends each
// region with a wait on the slower core, and on a shared VM either core may be the slower one from one region to
// the next.
class Claims {
 public:
  Claims(int64_t rows, int64_t width, int64_t threads)
      : count_(rows * width), width_(width), divisor_(2 * std::max<int64_t>(1, threads)) {}
  // The next part, [begin, end) within run begin / width; false when none is left.
  bool claim(int64_t& begin, int64_t& end) {
    int64_t at = next_.load(std::memory_order_relaxed);
    for (;;) {
      if (at >= count_) return false;
      const int64_t run_end = (at / width_ + 1) * width_;
      const int64_t size = std::max<int64_t>(1, (count_ - at) / divisor_);
      const int64_t stop = std::min(run_end, at + size);
      if (next_.compare_exchange_weak(at, stop, std::memory_order_relaxed)) {
        begin = at, end = stop;
        return true;
      }
    }
  }

 private:
  alignas(64) std::atomic<int64_t> next_{0};
  int64_t count_, width_, divisor_;
};

// f(claims) on each thread of one parallel_for, every thread claiming parts of [0, rows x width) until none is left.
template <class F> inline void parallel_claims(int64_t rows, int64_t width, const F& f) {
  const int64_t threads = std::max<int64_t>(1, std::min(parallel_threads(), rows * width));
  Claims claims(rows, width, threads);
  parallel_for(0, threads, 1, [&](int64_t, int64_t) { f(claims); });
}

}  // namespace aserve_kernels
