// Intra-op threads for the CPU kernels. Data parallelism puts one replica on each core, so the
// default is 1 thread per replica; a replica that owns several cores (cpu:1 on a 16-core machine)
// can let its kernels use them (convolutions, GEMMs, batch norm and the elementwise ops, through
// ops/cpu/parallel_for.h). Per calling thread (OpenMP's per-thread setting), so replicas can
// differ. Without OpenMP in the build, only 1 is available.
#pragma once

namespace replica::ops {

// Threads the calling thread's CPU kernels may use from now on; throws ConfigError if n < 1 or
// n > 1 without OpenMP.
void set_intra_op_threads(int n);
int intra_op_threads();
bool intra_op_threads_supported();
// Called by kernels: applies the default (1) to threads that never chose.
void apply_thread_default();

}  // namespace replica::ops
