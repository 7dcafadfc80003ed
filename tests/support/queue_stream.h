// QueueStream: a simulated asynchronous stream for CPU tests of stream ordering.
#pragma once
#include <algorithm>
#include <memory>

#include "core/stream.h"

namespace replica::testing_support {

// A simulated asynchronous stream: a host work queue whose work "runs" only when the test says.
// launch() queues a unit of work (a kernel reading a block); an event recorded on the stream is
// pending until the work queued before it has run, like a CUDA event behind queued kernels. The
// queue's state is shared with its events and outlives the stream: work queued on a stream that is
// gone still runs when the test says (state()->run_all()), as a GPU finishes a destroyed stream's
// kernels.
class QueueStream : public Stream {
 public:
  struct State {
    int64_t queued = 0, completed = 0, recorded = 0, host_waits = 0;
    void run_all() { completed = queued; }
  };
  struct QueueEvent : Event {
    std::shared_ptr<State> s;
    int64_t n;
    QueueEvent(std::shared_ptr<State> st, int64_t k) : s(std::move(st)), n(k) {}
    bool done() override { return s->completed >= n; }
    void synchronize() override {  // the host waits: the queue runs up to here
      s->host_waits++;
      s->completed = std::max(s->completed, n);
    }
  };
  ~QueueStream() override { retire(); }
  const Device& device() const override { return d_; }
  void synchronize() override { st_->run_all(); }
  std::shared_ptr<Event> record() override {
    st_->recorded++;
    return std::make_shared<QueueEvent>(st_, st_->queued);
  }
  void wait(Event& e) override { e.synchronize(); }
  void launch() { st_->queued++; }
  void run_all() { st_->run_all(); }
  const std::shared_ptr<State>& state() const { return st_; }
  int64_t queued() const { return st_->queued; }
  int64_t completed() const { return st_->completed; }
  int64_t recorded() const { return st_->recorded; }
  int64_t host_waits() const { return st_->host_waits; }

 private:
  Device d_{DeviceKind::cpu, 0};
  std::shared_ptr<State> st_ = std::make_shared<State>();
};

}  // namespace replica::testing_support
