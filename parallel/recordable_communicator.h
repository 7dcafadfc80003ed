// The collectives of a CPU replica as a recorded training step holds them (train.cuda_graph on a
// CPU replica; core/captured_work.h): a collective called while the thread records goes into the
// recording and runs, on the calling thread, when the recording is replayed, in its place among the
// recorded backend calls; NCCL's collectives are nodes of a CUDA graph the same way. Outside a
// recording every call goes straight to the wrapped communicator (host or MPI).
#pragma once
#include <memory>

#include "parallel/communicator.h"

namespace replica::parallel {

std::unique_ptr<Communicator> make_recordable_communicator(std::unique_ptr<Communicator> inner);

}  // namespace replica::parallel
