// Intra-op thread setting: a thread-local choice that the CPU kernels read (parallel_for.h).
#include "ops/cpu/threads.h"

#include <string>

#include "core/errors.h"

#ifdef REPLICA_WITH_OPENMP
#include <omp.h>
#endif

namespace replica::ops {

namespace {
thread_local int tl_threads = 0;  // 0: this thread has not chosen
}

bool intra_op_threads_supported() {
#ifdef REPLICA_WITH_OPENMP
  return true;
#else
  return false;
#endif
}

void set_intra_op_threads(int n) {
  if (n < 1) throw ConfigError("intra-op threads must be >= 1, got " + std::to_string(n));
  if (n > 1 && !intra_op_threads_supported())
    throw ConfigError("intra-op threads > 1 need a build with OpenMP (-DREPLICA_OPENMP=ON)");
  tl_threads = n;
#ifdef REPLICA_WITH_OPENMP
  // Eigen itself stays single-threaded (it reads this per-thread setting): its own splitting of
  // the small per-chunk GEMMs was measured slower than one thread. The kernels spread whole
  // chunks over the n threads instead.
  omp_set_num_threads(1);
#endif
}

int intra_op_threads() { return tl_threads ? tl_threads : 1; }

void apply_thread_default() {
  if (tl_threads == 0) set_intra_op_threads(1);
}

}  // namespace replica::ops
