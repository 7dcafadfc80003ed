// CPU stream and the factory that picks the CPU or CUDA stream at run time.
#include "core/stream.h"

#include <atomic>

#include "core/cuda/runtime.h"
#include "core/errors.h"

namespace replica {
namespace {
class DoneEvent : public Event {
 public:
  void synchronize() override {}
  bool done() override { return true; }
};
}  // namespace

std::shared_ptr<Event> CpuStream::record() { return std::make_shared<DoneEvent>(); }

std::shared_ptr<Event> StreamToken::record() {
  std::lock_guard<std::mutex> lock(m_);
  return stream_ ? stream_->record() : last_;
}

void StreamToken::retire(std::shared_ptr<Event> last) {
  std::lock_guard<std::mutex> lock(m_);
  stream_ = nullptr;
  last_ = std::move(last);
}

namespace {
std::atomic<uint64_t> g_next_stream_id{1};
}

Stream::Stream() : token_(std::make_shared<StreamToken>(this, g_next_stream_id.fetch_add(1))) {}

Stream::~Stream() {
  if (!retired_) token_->retire(nullptr);
}

void Stream::retire() {
  if (retired_) return;
  retired_ = true;
  std::shared_ptr<Event> last;
  if (!synchronous()) {
    try {
      last = record();
    } catch (const std::exception&) {  // a broken device context: nothing left to wait for
    }
  }
  token_->retire(std::move(last));
}

std::unique_ptr<Stream> make_stream(const Device& d) {
  if (d.kind == DeviceKind::cpu) return std::make_unique<CpuStream>(d);
  return cuda::make_cuda_stream(d);
}

namespace {
thread_local Stream* g_current = nullptr;
}
Stream* current_stream() { return g_current; }
void set_current_stream(Stream* s) { g_current = s; }

}  // namespace replica
