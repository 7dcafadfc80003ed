// Stream and Event: ordering of work on a device. Synchronous on CPU; a cudaStream_t on CUDA
// (core/cuda/). Code that runs on both waits on events instead of assuming either.
#pragma once
#include <memory>

#include "core/device.h"

namespace replica {

class Event {
 public:
  virtual ~Event() = default;
  virtual void synchronize() = 0;
  virtual bool done() = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual const Device& device() const = 0;
  virtual void synchronize() = 0;
  // Marks the current end of the stream's work.
  virtual std::shared_ptr<Event> record() = 0;
  // Later work on this stream waits for `e`.
  virtual void wait(Event& e) = 0;
  // Native handle (cudaStream_t) or nullptr on CPU.
  virtual void* native() const { return nullptr; }
  // True when work is done by the time a call returns (CPU): nothing to order by events.
  virtual bool synchronous() const { return false; }
};

// CPU work runs inline on the calling replica thread, so a CPU stream is always finished.
class CpuStream : public Stream {
 public:
  explicit CpuStream(Device d) : device_(d) {}
  const Device& device() const override { return device_; }
  void synchronize() override {}
  std::shared_ptr<Event> record() override;
  void wait(Event& e) override { e.synchronize(); }
  bool synchronous() const override { return true; }

 private:
  Device device_;
};

// Creates the stream for a device (a new cudaStream_t for CUDA devices).
std::unique_ptr<Stream> make_stream(const Device& d);

// The stream this thread's kernels and copies go to. A replica thread sets its own compute stream
// once (ReplicaGroup does it), so the shared op backends need no stream argument; null means the
// device's default stream (tests and tools that run on the calling thread).
Stream* current_stream();
void set_current_stream(Stream* s);

}  // namespace replica
