// SoloCommunicator: the communicator of a world of one (a single GPU replica started without
// MPI). Every collective is the identity, or one copy for the gathers; it works on host and device
// memory alike, so training on one GPU needs neither NCCL nor its initialisation.
#pragma once
#include <memory>

#include "parallel/communicator.h"

namespace replica::parallel {

std::unique_ptr<Communicator> make_solo_communicator();

}  // namespace replica::parallel
