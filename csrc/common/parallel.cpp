// The work-sharing loop of common/parallel.h: one job slot, a chunk counter,
// workers that join when they are awake.
#include "common/parallel.h"

#include <ATen/Parallel.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "common/simd_math.h"

namespace torchani_fast {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// How long an idle worker watches for the next job before it sleeps.
constexpr auto kSpin = std::chrono::microseconds(50);
// How long the caller spins for workers still inside a job before it yields.
constexpr auto kFinishSpin = std::chrono::microseconds(20);

thread_local bool in_region = false;
std::atomic<int64_t> team_regions{0}, pool_run_regions{0};

// A spin-wait's time limit: over() once `limit` has passed since construction,
// reading the clock on every 64th call only (it costs more than a pause).
class SpinLimit {
 public:
  explicit SpinLimit(std::chrono::nanoseconds limit) : until_(std::chrono::steady_clock::now() + limit) {}
  bool over() { return ++tries_ % 64 == 0 && std::chrono::steady_clock::now() > until_; }

 private:
  std::chrono::steady_clock::time_point until_;
  int tries_ = 0;
};

// Which threads run a loop. On a quiet machine OpenMP's team (at::parallel_for)
// is the better choice: its threads are the ones other torch work just used,
// still spinning, while the pool's sleep after kSpin and must be woken (the
// 973-atom 1hz5 ran 9% slower on the pool alone: its neighbour search, 0.84 ms
// on the team, took 1.72). A region whose thread starts more than late_start
// after the caller (a thread the system descheduled; waking a sleeping one
// takes well under a millisecond) sends the next loops to the pool, which does
// not wait for such threads; then OpenMP's team is tried again. How many loops:
// kFirstPoolRegions at first, so that a quiet machine's rare hiccup (a VM's
// host, a daemon) costs a short stretch on the slower pool; twice the last
// stretch (up to kMaxPoolRegions) when the team is late again within kSoon
// loops of its return, so that a machine that stays busy pays a team region's
// stall (up to a time slice) once per long stretch; kFirstPoolRegions again
// after kSoon punctual loops.
constexpr int64_t kLateStartNs = 2'000'000;
constexpr int kFirstPoolRegions = 100;
constexpr int kMaxPoolRegions = 12800;
constexpr int64_t kSoon = 1000;
std::atomic<int64_t> late_start{kLateStartNs};
std::atomic<int> pool_regions{0};
std::atomic<int> pool_period{kFirstPoolRegions};  // the last stretch's loops
std::atomic<int64_t> team_at_late{-kSoon};         // team_regions when the team was last late

// A team region started late: the pool's next stretch. (team_regions counts
// this region too: team - team_at_late - 1 team loops were punctual since.)
void send_to_pool() {
  const int64_t team = team_regions.load(std::memory_order_relaxed);
  const bool again = team - team_at_late.load(std::memory_order_relaxed) <= kSoon;
  const int period = again ? std::min(2 * pool_period.load(std::memory_order_relaxed), kMaxPoolRegions)
                           : kFirstPoolRegions;
  pool_period.store(period, std::memory_order_relaxed);
  team_at_late.store(team, std::memory_order_relaxed);
  pool_regions.store(period, std::memory_order_relaxed);
}

class Pool {
 public:
  static Pool*& instance() {
    static Pool* pool = [] {
      // A forked child (multiprocessing, Dask's nannies) has none of the
      // parent's workers: it starts a pool of its own (the old one is left,
      // its mutexes may be held by threads that no longer exist).
      pthread_atfork(nullptr, nullptr, [] { instance() = new Pool(); });
      return new Pool();
    }();
    return pool;
  }

  void run(int64_t begin, int64_t end, int64_t chunk, int threads,
           const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) {  // another thread's region is running: this one runs alone
      fn(begin, end);
      return;
    }
    start_workers(threads - 1);
    fn_ = &fn;
    end_ = end;
    chunk_ = chunk;
    error_ = nullptr;
    next_.store(begin, std::memory_order_relaxed);
    seats_.store(threads - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_.store(true, std::memory_order_seq_cst);
      generation_.fetch_add(1, std::memory_order_seq_cst);
    }
    wake_.notify_all();
    work();
    open_.store(false, std::memory_order_seq_cst);
    // Only workers inside this job are waited for; one that has not started
    // sees the job closed and leaves it.
    wait_for_workers();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  Pool() = default;

  void start_workers(int wanted) {
    while (started_ < wanted) {
      std::thread([this] { loop(); }).detach();
      ++started_;
    }
  }

  // Until no worker is inside the job. Briefly spinning (a worker's last chunk
  // is usually microseconds from its end), then yielding the core: a worker
  // the system descheduled mid-chunk needs a core to finish on, and on a busy
  // machine the caller's spinning would hold one that it could run on.
  void wait_for_workers() {
    SpinLimit spin(kFinishSpin);
    while (active_.load(std::memory_order_seq_cst) != 0) {
      if (spin.over()) {
        std::this_thread::yield();
      } else {
        cpu_relax();
      }
    }
  }

  // Claim chunks until none are left; the first exception stops every thread.
  void work() {
    in_region = true;
    for (;;) {
      const int64_t b = next_.fetch_add(chunk_, std::memory_order_relaxed);
      if (b >= end_) break;
      try {
        (*fn_)(b, std::min(b + chunk_, end_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(end_, std::memory_order_relaxed);
      }
    }
    in_region = false;
  }

  void loop() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      SpinLimit spin(kSpin);
      while (generation_.load(std::memory_order_acquire) == seen) {
        if (spin.over()) {
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          break;
        }
        cpu_relax();
      }
      const uint64_t job = generation_.load(std::memory_order_acquire);
      seen = job;
      active_.fetch_add(1, std::memory_order_seq_cst);
      // Still the job that woke us, still open, and a seat left (at most
      // threads - 1 workers join, as torch.set_num_threads asked).
      if (open_.load(std::memory_order_seq_cst) &&
          generation_.load(std::memory_order_seq_cst) == job &&
          seats_.fetch_sub(1, std::memory_order_seq_cst) > 0) {
        work();
      }
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex busy_;   // one job at a time
  std::mutex mutex_;  // with wake_: sleeping workers
  std::condition_variable wake_;
  std::mutex error_mutex_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> open_{false};
  std::atomic<int> active_{0};
  std::atomic<int> seats_{0};
  std::atomic<int64_t> next_{0};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t end_ = 0, chunk_ = 1;
  std::exception_ptr error_;
  int started_ = 0;  // worker threads (detached; they live as long as the process)
};

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t n = end - begin;
  const int threads = at::get_num_threads();
  if (n <= grain || threads <= 1 || in_region || at::in_parallel_region()) {
    fn(begin, end);
    return;
  }
  if (pool_regions.load(std::memory_order_relaxed) > 0) {
    pool_regions.fetch_sub(1, std::memory_order_relaxed);
    pool_run_regions.fetch_add(1, std::memory_order_relaxed);
    // A few chunks per thread, so that a late worker's share is small.
    const int64_t chunk = std::max<int64_t>(grain, (n + 4 * threads - 1) / (4 * threads));
    Pool::instance()->run(begin, end, chunk, threads, fn);
    return;
  }
  // OpenMP's team, whose threads are already awake after other torch work; a
  // thread that starts its share late (descheduled by other jobs) sends the
  // next regions to the pool.
  team_regions.fetch_add(1, std::memory_order_relaxed);
  const auto start = std::chrono::steady_clock::now();
  std::atomic<int64_t> latest{0};
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    const int64_t late = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - start).count();
    int64_t seen = latest.load(std::memory_order_relaxed);
    while (late > seen && !latest.compare_exchange_weak(seen, late, std::memory_order_relaxed)) {
    }
    fn(b, e);
  });
  if (latest.load(std::memory_order_relaxed) > late_start.load(std::memory_order_relaxed)) {
    send_to_pool();
  }
}

namespace {
thread_local bool in_flush_scope = false;  // this thread opened a TeamFlushDenormals
// This thread's flushing mode while a scope (its own or its team's caller's) is
// open: simd::FlushDenormals sets it and restores the mode it found.
thread_local std::optional<simd::FlushDenormals> team_mode;

void team_flush(bool on) {
#if defined(__x86_64__) && defined(__GNUC__)  // (elsewhere FlushDenormals does nothing)
  // One index per thread: ATen's OpenMP loop gives each team thread one chunk.
  at::parallel_for(0, at::get_num_threads(), 1, [on](int64_t, int64_t) {
    if (!on) {
      team_mode.reset();
    } else if (!team_mode) {
      team_mode.emplace();
    }
  });
#else
  (void)on;
#endif
}
}  // namespace

// A scope opened inside another on the same thread (InputGrad's forward inside
// TrainFunction's backward) finds the team flushing already: it does nothing.
TeamFlushDenormals::TeamFlushDenormals(bool enable) : active_(enable && !in_flush_scope) {
  if (!active_) return;
  team_flush(true);
  in_flush_scope = true;
}

TeamFlushDenormals::~TeamFlushDenormals() {
  if (!active_) return;
  team_flush(false);
  in_flush_scope = false;
}

ParallelCounts parallel_counts() {
  return {team_regions.load(), pool_run_regions.load(), pool_regions.load(), pool_period.load()};
}

void set_pool_regions(int regions) {
  pool_regions.store(std::max(regions, 0));
  if (regions == 0) {  // and forget the earlier stretches
    pool_period.store(kFirstPoolRegions);
    team_at_late.store(team_regions.load() - kSoon);
  }
}

void set_late_start(int64_t ns) { late_start.store(ns < 0 ? kLateStartNs : ns); }

}  // namespace torchani_fast
