// Host-staged collectives for GPU replicas that NCCL cannot serve: several replicas on one GPU
// (NCCL refuses a device twice in one communicator), which is how the GPU path's multi-replica
// behaviour (sync-BN, a 16-bit gradient wire, the stop vote) is checked on a single GPU. Each
// collective copies device data to a host buffer, runs on the wrapped host communicator (16-bit
// sums as NCCL's, communicator.h) and copies back, before it returns: a debugging and testing
// path, with host round trips NCCL does not make.
#pragma once
#include <functional>
#include <memory>

#include "parallel/communicator.h"

namespace replica::parallel {

// copy(dst, src, bytes): between device and host memory, finished when it returns. Empty: the
// CUDA copy on the calling thread's current stream (ordered after the replica's compute).
using StagingCopy = std::function<void(void* dst, const void* src, size_t bytes)>;

std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> host, StagingCopy copy = {});

}  // namespace replica::parallel
