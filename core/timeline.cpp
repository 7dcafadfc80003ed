// Timeline recording and the Chrome trace-event JSON writer (one event per line).
#include "core/timeline.h"

#include <cmath>
#include <sstream>

#include "core/file_io.h"
#include "core/json.h"

namespace replica {

namespace {
// Trace times are microseconds; a nanosecond is the clock's resolution, so three decimals.
double micros(int64_t ns) { return std::round(static_cast<double>(ns)) / 1000.0; }
}  // namespace

Timeline::Timeline() : t0_(std::chrono::steady_clock::now()) {}

int64_t Timeline::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
}

int64_t Timeline::from_steady(int64_t steady_ns) const {
  return steady_ns - std::chrono::duration_cast<std::chrono::nanoseconds>(t0_.time_since_epoch()).count();
}

void Timeline::slice(int track, const std::string& name, int64_t b, int64_t e, const char* cat) {
  std::lock_guard<std::mutex> lock(m_);
  events_.push_back({'X', track, name, cat, b, e - b, {}});
}

void Timeline::counter(int track, const std::string& name, int64_t t, std::vector<std::pair<std::string, double>> v) {
  std::lock_guard<std::mutex> lock(m_);
  events_.push_back({'C', track, name, "memory", t, 0, std::move(v)});
}

void Timeline::instant(int track, const std::string& name, int64_t t, std::vector<std::pair<std::string, double>> v,
                       const char* category) {
  std::lock_guard<std::mutex> lock(m_);
  events_.push_back({'i', track, name, category, t, 0, std::move(v)});
}

void Timeline::name_track(int track, const std::string& name) {
  std::lock_guard<std::mutex> lock(m_);
  names_.emplace_back(track, name);
}

size_t Timeline::size() const {
  std::lock_guard<std::mutex> lock(m_);
  return events_.size();
}

void Timeline::write_chrome_json(const std::string& path) const {
  std::lock_guard<std::mutex> lock(m_);
  // One event per line inside the document's two fixed lines: a long run's trace is written
  // event by event, never held as one JSON tree.
  std::ostringstream os;
  os << "{\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) os << ",\n";
    first = false;
  };
  for (auto& [track, name] : names_) {
    sep();
    os << json_line({{"ph", "M"}, {"name", "thread_name"}, {"pid", 0}, {"tid", track}, {"args", {{"name", name}}}});
  }
  for (const auto& e : events_) {
    sep();
    Json j = {{"ph", std::string(1, e.ph)}, {"name", e.name}, {"cat", e.cat}, {"pid", 0}, {"tid", e.track},
              {"ts", micros(e.ts)}};
    if (e.ph == 'X') {
      j["dur"] = micros(e.dur);
    } else {
      if (e.ph == 'i') j["s"] = "t";  // an instant on its thread's track
      Json args = Json::object();
      for (const auto& [k, v] : e.values) args[k] = v;
      j["args"] = std::move(args);
    }
    os << json_line(j);
  }
  os << "\n],\"displayTimeUnit\":\"ms\"}\n";
  write_file_atomic(path, os.str());
}

}  // namespace replica
