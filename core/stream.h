// Stream and Event: ordering of work on a device. Synchronous on CPU; a cudaStream_t on CUDA
// (core/cuda/). Code that runs on both waits on events instead of assuming either.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>

#include "core/device.h"

namespace replica {

class Event {
 public:
  virtual ~Event() = default;
  virtual void synchronize() = 0;
  virtual bool done() = 0;
};

class Stream;

// What outlives a stream: an id that is never reused and, once the stream is gone, the event that
// marks the end of all its work. Whoever must order work against a stream it does not own (the
// memory pools: a block names the streams that used it) keeps this, never the Stream*: a block
// freed after its stream died is still waited for, and a new stream at the old one's address is
// another stream (RMM met this as a crash, rapidsai/rmm#510; PyTorch's allocator keys on ids too).
class StreamToken {
 public:
  StreamToken(Stream* s, uint64_t id) : stream_(s), id_(id) {}
  uint64_t id() const { return id_; }
  // An event marking the end of the stream's work so far: recorded now while the stream lives, its
  // last event once it is gone; null when there is nothing to wait for (a synchronous stream).
  std::shared_ptr<Event> record();
  // Called once by the dying stream (Stream::retire): `last` covers all of its work.
  void retire(std::shared_ptr<Event> last);

 private:
  std::mutex m_;  // record() on one thread while the stream dies on another
  Stream* stream_;
  std::shared_ptr<Event> last_;
  const uint64_t id_;
};

class Stream {
 public:
  Stream();
  virtual ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
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
  // This stream's identity for anyone who may outlive it (ids start at 1 and are never reused).
  uint64_t id() const { return token_->id(); }
  const std::shared_ptr<StreamToken>& token() const { return token_; }

 protected:
  // An asynchronous stream calls this first in its destructor, while it can still record: the
  // token keeps an event behind all of its work. (Stream's own destructor retires with none,
  // which is right only for a synchronous stream.)
  void retire();

 private:
  std::shared_ptr<StreamToken> token_;
  bool retired_ = false;
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
