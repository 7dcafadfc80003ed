// QueueStream: a simulated asynchronous stream for CPU tests of stream ordering.
#pragma once
#include <algorithm>
#include <memory>

#include "core/stream.h"

namespace replica::testing_support {

// A simulated asynchronous stream: a host work queue whose work "runs" only when the test says.
// An event recorded on it is pending until then, like a CUDA event behind queued kernels.
class QueueStream : public Stream {
 public:
  struct QueueEvent : Event {
    QueueStream* s;
    int64_t n;
    QueueEvent(QueueStream* st, int64_t k) : s(st), n(k) {}
    bool done() override { return s->completed >= n; }
    void synchronize() override {  // the host waits: the queue runs up to here
      s->host_waits++;
      s->completed = std::max(s->completed, n);
    }
  };
  const Device& device() const override { return d_; }
  void synchronize() override { completed = recorded; }
  std::shared_ptr<Event> record() override { return std::make_shared<QueueEvent>(this, ++recorded); }
  void wait(Event& e) override { e.synchronize(); }
  void run_all() { completed = recorded; }
  int64_t recorded = 0, completed = 0, host_waits = 0;

 private:
  Device d_{DeviceKind::cpu, 0};
};

}  // namespace replica::testing_support
