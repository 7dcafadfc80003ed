// CapturedWork: a stream's work recorded once and replayed with the same arguments and addresses
// (train.cuda_graph). On a GPU it is a CUDA graph (core/cuda/runtime.h); on a CPU replica it is the
// list of the backend calls and copies the thread made while recording, each replayed as it was
// called. The CPU form keeps the graph's contract (nothing runs while recording; a replay reads
// and writes the memory the recorded work named, in the recorded order; anything that hands a
// value to the host fails the recording), so the CPU suite runs train/step_graph.cpp end to end.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "core/device.h"

namespace replica {

class MemoryPool;
class Stream;

class CapturedWork {
 public:
  virtual ~CapturedWork() = default;
  // Records what this thread queues on `stream` until end(); nothing of it runs.
  virtual void begin(Stream& stream) = 0;
  // Ends the recording; throws (the recording dropped) when the work did something a replay
  // cannot hold.
  virtual void end() = 0;
  // After a failure between begin() and end(): ends the recording if one is open and drops it.
  virtual void abandon() noexcept = 0;
  // Queues the recorded work on `stream` (a CPU replica's stream: runs it now).
  virtual void launch(Stream& stream) = 0;
  virtual bool ready() const = 0;
  virtual size_t nodes() const = 0;  // kernels, copies and memsets (a CPU recording: calls)
};

// The recorder for `d`'s work: a CUDA graph, or a CPU call recording whose replays give the
// calls that take a workspace pool `replay_workspace` (the recorded calls' own workspace was
// returned to its pool when the recording ended; a CUDA graph keeps cuDNN's in its nodes).
std::unique_ptr<CapturedWork> capture_work(const Device& d, MemoryPool& replay_workspace);

// The CPU recording open on this thread, or null: CPU work that would change memory (the op
// backend's calls, copy_tensor, Tensor::zeros) goes into it instead of running, and a call that
// hands a device value to the host throws (recording_refuses).
class CallRecording {
 public:
  virtual ~CallRecording() = default;
  virtual void add(std::function<void()> call) = 0;
};
CallRecording* call_recording();
// The pool a call being replayed on this thread takes its workspace from (null outside a replay):
// the pool it was recorded with handed that workspace back when the recording ended, and its
// bytes may be the recorded work's other blocks now.
MemoryPool* replaying_workspace();
// Throws Error naming `what` when a CPU recording is open on this thread: a host read of device
// memory cannot be part of recorded work (a CUDA capture fails on it too).
void recording_refuses(const char* what);

}  // namespace replica
