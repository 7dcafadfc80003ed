// CapturedWork on a CPU replica (a list of recorded calls) and the choice between it and a CUDA
// graph.
#include "core/captured_work.h"

#include <string>
#include <utility>

#include "core/cuda/runtime.h"
#include "core/errors.h"
#include "core/memory_pool.h"
#include "core/stream.h"

namespace replica {

namespace {

thread_local CallRecording* t_recording = nullptr;
thread_local MemoryPool* t_replay_workspace = nullptr;

class RecordedCalls final : public CapturedWork, public CallRecording {
 public:
  explicit RecordedCalls(MemoryPool& workspace) : workspace_(workspace) {}
  ~RecordedCalls() override { abandon(); }

  void begin(Stream& stream) override {
    if (!stream.synchronous())
      throw Error("CapturedWork: a CPU recording of " + stream.device().str() + "'s stream");
    if (t_recording) throw Error("CapturedWork: a recording is open on this thread already");
    calls_.clear();
    ready_ = false;
    t_recording = this;
  }
  void end() override {
    if (t_recording != this) throw Error("CapturedWork::end without begin");
    t_recording = nullptr;
    ready_ = true;
  }
  void abandon() noexcept override {
    if (t_recording == this) t_recording = nullptr;
    calls_.clear();
    ready_ = false;
  }
  void launch(Stream&) override {
    if (!ready_) throw Error("CapturedWork::launch before a finished recording");
    if (t_recording) throw Error("CapturedWork::launch inside a recording");
    struct Restore {
      MemoryPool* was;
      ~Restore() { t_replay_workspace = was; }
    } restore{t_replay_workspace};
    t_replay_workspace = &workspace_;
    for (const auto& call : calls_) call();
  }
  bool ready() const override { return ready_; }
  size_t nodes() const override { return calls_.size(); }

  void add(std::function<void()> call) override { calls_.push_back(std::move(call)); }

 private:
  MemoryPool& workspace_;
  std::vector<std::function<void()>> calls_;
  bool ready_ = false;
};

}  // namespace

std::unique_ptr<CapturedWork> capture_work(const Device& d, MemoryPool& replay_workspace) {
  if (d.kind == DeviceKind::cuda) return std::make_unique<cuda::CapturedGraph>();
  return std::make_unique<RecordedCalls>(replay_workspace);
}

CallRecording* call_recording() { return t_recording; }
MemoryPool* replaying_workspace() { return t_replay_workspace; }

void recording_refuses(const char* what) {
  if (t_recording)
    throw Error(std::string(what) +
                " hands device memory to the host: it cannot be part of recorded work (a CUDA "
                "graph capture fails "
                "on it the same way)");
}

}  // namespace replica
