// HostCommunicator: collectives between CPU replicas (threads) of one process through shared
// memory. Each rank reduces its own 1/R slice of every buffer over ranks 0..R-1 in that fixed
// order (reduce-scatter), then every rank copies all slices (all-gather): the result is the same
// bits on every rank and in every run, whatever the thread timing. Each rank has a worker thread
// that runs its collectives in issue order, so async collectives overlap the caller's compute.
#pragma once
#include <chrono>
#include <memory>
#include <vector>

#include "parallel/communicator.h"

namespace replica::parallel {

class HostCommState;

struct HostCommOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// Creates the R connected communicators of one group (rank i at index i).
std::vector<std::unique_ptr<Communicator>> make_host_communicators(int world,
                                                                   HostCommOptions opts = {});

}  // namespace replica::parallel
