// Timeline: a Chrome-trace recorder ("traceEvents" JSON; opens in Perfetto and chrome://tracing)
// for `replica train --trace FILE.json`: complete slices per track (a track per replica for its
// compute, one per replica for its communication), counter tracks (pool in use by tag) and
// instants (gradients becoming final in backward: what `replica plan --trace-profile` reads).
// Thread safe; recording costs a lock and a vector push.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace replica {

class Timeline {
 public:
  Timeline();
  int64_t now_ns() const;
  // Converts a steady_clock time (ns since its epoch) to this timeline's clock.
  int64_t from_steady(int64_t steady_ns) const;
  void slice(int track, const std::string& name, int64_t begin_ns, int64_t end_ns, const char* category);
  void counter(int track, const std::string& name, int64_t t_ns, std::vector<std::pair<std::string, double>> values);
  // A moment on a track with values (e.g. which gradients became final): "ph":"i".
  void instant(int track, const std::string& name, int64_t t_ns, std::vector<std::pair<std::string, double>> values,
               const char* category);
  void name_track(int track, const std::string& name);
  void write_chrome_json(const std::string& path) const;
  size_t size() const;

  // Records a slice for its lifetime; does nothing when the timeline is null.
  class Scope {
   public:
    Scope(Timeline* t, int track, std::string name, const char* category)
        : t_(t), track_(track), name_(std::move(name)), cat_(category), begin_(t ? t->now_ns() : 0) {}
    ~Scope() {
      if (t_) t_->slice(track_, name_, begin_, t_->now_ns(), cat_);
    }

   private:
    Timeline* t_;
    int track_;
    std::string name_;
    const char* cat_;
    int64_t begin_;
  };

 private:
  struct Event {
    char ph;
    int track;
    std::string name, cat;
    int64_t ts, dur;
    std::vector<std::pair<std::string, double>> values;
  };
  mutable std::mutex m_;
  std::chrono::steady_clock::time_point t0_;
  std::vector<Event> events_;
  std::vector<std::pair<int, std::string>> names_;
};

}  // namespace replica
