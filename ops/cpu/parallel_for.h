// parallel_for: the CPU kernels' one way to use a replica's intra-op threads (ops/cpu/threads.h).
// Internal to replica_ops (the only target built with REPLICA_WITH_OPENMP); without OpenMP, or
// with one thread, the loop simply runs on the calling thread.
#pragma once
#include <cstdint>

#ifdef REPLICA_WITH_OPENMP
#include <omp.h>
#endif

#ifndef REPLICA_CPU_ISA_NS
#error "included only by the per-level CPU kernels (ops/cpu/cpu_backend.h)"
#endif

// In the level's namespace: inline code compiled with one level's flags must not be linked in
// place of another's (ops/cpu/cpu_backend.h).
namespace replica::ops::REPLICA_CPU_ISA_NS {

// fn(i, thread) for i in [0, n): on `threads` OpenMP threads with a static schedule (thread t
// takes one contiguous range) when threads > 1 and n > 1, else in order on the calling thread
// as thread 0. Callers keep results independent of the split: each i writes its own output, and
// sums are folded in index order afterwards, so the bits do not depend on the thread count.
template <typename F>
void parallel_for(int64_t n, int threads, F&& fn) {
#ifdef REPLICA_WITH_OPENMP
  if (threads > 1 && n > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) fn(i, omp_get_thread_num());
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) fn(i, 0);
}

}  // namespace replica::ops::REPLICA_CPU_ISA_NS
