// MPI between processes (mpirun / srun), hierarchical inside each process: the local replicas
// reduce through the shared-memory host communicator, one leader per process runs the MPI
// collective, and the result is broadcast back to the local replicas. Global rank = process rank
// x local replicas + local index. A failed replica, a failed peer or a collective that waits past
// its time-out aborts the whole MPI job with a message naming the rank: nothing hangs.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace replica::parallel {

// True when this process was started by an MPI launcher (OpenMPI's mpirun, PMI/PMIx: srun).
bool launched_by_mpi();
bool mpi_compiled();
// The MPI library's own version line ("Open MPI v4.1.4, ..."), or "not built in".
std::string mpi_version();
// Whether the MPI built against has ULFM's fault tolerance (MPIX_Comm_shrink, from mpi-ext.h). Not
// used yet: a lost process ends the job with exit 75 and the run resumes on the rest.
bool mpi_has_ulfm();

// This process's place in the MPI job (initialises MPI on first use; finalises at exit).
struct MpiProcess {
  int rank = 0, size = 1;
};
MpiProcess mpi_process();

// Aborts the MPI job (all processes) after printing `why`; returns only when not under MPI.
void abort_mpi_job(const std::string& why, int code = 1);

struct MpiCommOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// The communicators of this process's `local` replicas (index i = local replica i).
std::vector<std::unique_ptr<Communicator>> make_mpi_communicators(int local, MpiCommOptions opts = {});

}  // namespace replica::parallel
