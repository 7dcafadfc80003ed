// CaptureHolds: the work captured with a group's collectives (a CUDA graph holding NCCL's
// persistent plans; a CPU replica's recorded step), registered by whoever holds it, so that the
// group's abort and its destruction release that work first. From NCCL 2.26 on, ncclCommAbort and
// ncclCommDestroy wait until every graph that uses the communicator has been destroyed (NVIDIA's
// CUDA-graph guide, "Process Hang"): a graph still alive when a failure aborts the clique would
// hang the abort, on whichever thread found the failure.
#pragma once
#include <functional>
#include <map>
#include <mutex>

namespace replica::parallel {

class CaptureHolds {
 public:
  using Release = std::function<void()>;
  // Registers `release` and returns its id. After release_all() it runs at once instead (the
  // group is going: nothing may hold its collectives again) and the id is -1.
  int hold(Release release);
  // Unregisters (a holder that releases its work itself, or goes); waits for a release_all() that
  // is running its release, so a holder may destroy itself after drop() returns.
  void drop(int id);
  // Runs every registered release once, in registration order, on the calling thread. A release
  // must not call hold() or drop().
  void release_all();
  bool released() const;

 private:
  mutable std::mutex m_;
  std::map<int, Release> holds_;
  int next_ = 0;
  bool released_ = false;
};

}  // namespace replica::parallel
