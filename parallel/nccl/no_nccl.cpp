// Built without CUDA: GPU replicas cannot communicate, and say so.
#include "core/errors.h"
#include "parallel/nccl/nccl_communicator.h"

namespace replica::parallel {

bool nccl_compiled() { return false; }
std::string nccl_version() { return "NCCL: not built"; }
int nccl_loaded_version() { return 0; }
bool nccl_shares_gpus() { return false; }
std::string nccl_sharing_report() { return "no NCCL in this build"; }
std::string nccl_graph_refusal() { return "NCCL: not built"; }
bool nccl_has_comm_shrink() { return false; }
bool nccl_orders_communicators() { return false; }

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<Device>&,
                                                                   const std::vector<Stream*>&, NcclOptions) {
  throw CommError("GPU replicas need NCCL, and this replica was built without CUDA; rebuild with -DREPLICA_CUDA=ON");
}

}  // namespace replica::parallel
