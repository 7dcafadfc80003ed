// Built when MPI is not found: plain runs work; a launch by mpirun is a clear error.
#include "core/errors.h"
#include "parallel/mpi/mpi_communicator.h"

#include <cstdlib>

namespace replica::parallel {

bool mpi_compiled() { return false; }
bool mpi_has_ulfm() { return false; }
std::string mpi_version() { return "not built in"; }
bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}
MpiProcess mpi_process() { return {}; }
void abort_mpi_job(const std::string&, int) {}
std::vector<std::unique_ptr<Communicator>> make_mpi_communicators(int, MpiCommOptions) {
  throw CommError("this process was started by an MPI launcher but replica was built without MPI; "
                  "install libopenmpi-dev and rebuild, or start it without mpirun");
}

}  // namespace replica::parallel
