// NCCL between GPU replicas: all local GPUs of a process (ncclCommInitAll), or every GPU of an
// MPI job (the unique id from global rank 0, broadcast over MPI, then ncclCommInitRank), one
// communicator spanning them all. Collectives run on a communication stream per replica that first
// waits for the replica's compute stream, so a bucket's all-reduce starts as soon as backward has
// produced it (llm.c's overlap). Waiting polls NCCL's asynchronous error state; a failure or a
// time-out aborts the communicator (ncclCommAbort) and raises CommError naming the rank.
// Declared without CUDA headers.
#pragma once
#include <chrono>
#include <memory>
#include <vector>

#include "core/device.h"
#include "core/stream.h"
#include "parallel/communicator.h"

namespace replica::parallel {

bool nccl_compiled();
// The NCCL version this process loaded ("NCCL 2.28.9"), or "NCCL: not built".
std::string nccl_version();
// The NCCL version this process loaded as NCCL_VERSION_CODE reads (2.30.7 = 23007), 0 when unknown.
int nccl_loaded_version();
// Whether the loaded NCCL lets several ranks of one communicator share a GPU (2.30 and later,
// with NCCL_MULTI_RANK_GPU_ENABLE=1, which ReplicaGroup sets for replicas sharing a GPU).
bool nccl_shares_gpus();
// One line for `replica devices` and `--version`: whether replicas sharing a GPU (cuda:0x2) run
// NCCL ranks on it or stage their collectives through host memory, and why.
std::string nccl_sharing_report();
// "" when the loaded NCCL's collectives can be captured in a CUDA graph (2.9.6 and later), else why not.
std::string nccl_graph_refusal();
// Whether the NCCL built against offers ncclCommShrink (2.27+): a communicator rebuilt without a
// lost rank in place. replica does not use it yet: across processes a lost rank is a restart
// from the checkpoint (train/recovery.h); `replica --version` says which is available.
bool nccl_has_comm_shrink();

struct NcclOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // The communication stream gets the device's greatest priority (the latency lane of sync-BN).
  bool high_priority = false;
};

// True when this NCCL orders the kernels of several communicators on a device by the host's
// issue order (NCCL_LAUNCH_ORDER_IMPLICIT, 2.26 and later), which a second communicator per GPU
// (the latency lane) needs to be deadlock-free.
bool nccl_orders_communicators();

// One communicator per local GPU replica; compute_streams[i] (may be null) orders collectives
// after replica i's compute work.
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(const std::vector<Device>& devices,
                                                                   const std::vector<Stream*>& compute_streams,
                                                                   NcclOptions o = {});

}  // namespace replica::parallel
