// torchani_fast's CPU parallel loop: work sharing that a busy machine cannot stall.
//
// at::parallel_for (OpenMP here) ends every parallel region in a barrier that
// waits for all of its threads. On a machine that runs other jobs, one of them
// is often descheduled, and the region then lasts until the scheduler runs it
// again, up to a time slice (milliseconds) per region: the 46-atom ligand went
// from 2.4 ms to 30-50 ms per energy + forces call beside two busy processes.
//
// parallel_for below runs a loop on OpenMP's team (at::parallel_for) while
// the machine is quiet: those threads are still awake after other torch work.
// When one of them starts its share late (descheduled), the next loops (100 at
// first, more while the machine stays busy: parallel.cpp) go to torchani_fast's
// own pool instead, which
// splits [begin, end) into chunks that the calling thread
// and torchani_fast's worker threads claim one at a time from a shared counter.
// The caller waits only for chunks that a worker has already claimed (spinning
// 20 us, then yielding its core to them), never for a worker that has not
// started: when a worker is late, the caller (and
// any other worker) runs its chunks, and a region of a few microseconds simply
// runs on the caller. Workers that find no work spin for a short while (the
// next region of the same call is usually tens of microseconds away), then
// sleep on a condition variable; they never hold a core for longer.
//
// Contract, as for at::parallel_for: fn(b, e) is called on disjoint ranges
// that cover [begin, end), each of at least `grain` indices (but the last), on
// any thread; its results must not depend on the chunking or the thread (so
// results are bitwise the same for any thread count). The first exception
// thrown by fn is rethrown on the caller once every claimed chunk finished.
// Calls from inside a region, from a second thread while one region runs, or
// with one thread (torch.set_num_threads(1)) run fn(begin, end) serially. The
// number of threads is at::get_num_threads(). An fn that calls BLAS keeps it
// to one thread (ensemble/gemm.h, OneThreadBlas): an OpenMP-threaded BLAS does
// not know it runs inside a pool loop.
#pragma once

#include <cstdint>
#include <functional>

namespace torchani_fast {

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

// While in scope, the calling thread and every thread of OpenMP's team flush
// denormal float results to zero and read denormal inputs as zero (MXCSR FTZ
// and DAZ: a simd::FlushDenormals held on each thread); each thread's own
// mode comes back at the end of the scope (a scope nested in another on the
// same thread does nothing). For ops whose float32 work runs in ATen's
// operators (ensemble/train.cpp): their matrix products run on OpenMP's team
// (MKL), where products whose partial sums fall below 1.2e-38 (weight gradients
// of small AEV terms, CELU derivatives) cost a microcode assist each on Intel
// CPUs: the layer-1 weight gradient of 256 CH4 conformers (ANI-1x, 8 members)
// took 10.5 ms instead of 1.7. Two parallel regions per scope; `enable` false
// does nothing. A team thread that the end of the scope does not reach
// (OMP_DYNAMIC giving a smaller team) keeps the mode.
class TeamFlushDenormals {
 public:
  explicit TeamFlushDenormals(bool enable);
  ~TeamFlushDenormals();
  TeamFlushDenormals(const TeamFlushDenormals&) = delete;
  TeamFlushDenormals& operator=(const TeamFlushDenormals&) = delete;

 private:
  bool active_ = false;
};

// Loops run so far (process-wide) by OpenMP's team and by the pool, the
// pool's loops left before OpenMP's team is tried again, and the length of the
// pool's last stretch. For the tests and profiles (_C.parallel_counts): a
// benchmark that is slower in some rounds can see whether the pool ran them.
struct ParallelCounts {
  int64_t team, pool, pool_regions_left, pool_period;
};
ParallelCounts parallel_counts();
// Sets the pool's loops left, as a late thread does (tests: the pool without a
// busy machine; 0 ends it and forgets the earlier stretches).
void set_pool_regions(int regions);
// Sets how late (ns) a team thread may start before the pool takes the next
// loops (tests: 0 makes every team loop late, as a busy machine does; < 0
// restores 2 ms).
void set_late_start(int64_t ns);

}  // namespace torchani_fast
