// Timeline recording and the Chrome trace-event JSON writer (one event per line).
#include "core/timeline.h"

#include <cstdio>
#include <sstream>

#include "core/file_io.h"

namespace replica {

namespace {
std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}
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
  std::ostringstream os;
  os << "{\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) os << ",\n";
    first = false;
  };
  for (auto& [track, name] : names_) {
    sep();
    os << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":0,\"tid\":" << track << ",\"args\":{\"name\":\""
       << escape(name) << "\"}}";
  }
  char num[64];
  for (const auto& e : events_) {
    sep();
    std::snprintf(num, sizeof num, "%.3f", e.ts / 1000.0);
    os << "{\"ph\":\"" << e.ph << "\",\"name\":\"" << escape(e.name) << "\",\"cat\":\"" << e.cat
       << "\",\"pid\":0,\"tid\":" << e.track << ",\"ts\":" << num;
    if (e.ph == 'X') {
      std::snprintf(num, sizeof num, "%.3f", e.dur / 1000.0);
      os << ",\"dur\":" << num;
    } else {
      os << ",\"args\":{";
      for (size_t i = 0; i < e.values.size(); ++i)
        os << (i ? "," : "") << "\"" << escape(e.values[i].first) << "\":" << e.values[i].second;
      os << "}";
    }
    os << "}";
  }
  os << "\n],\"displayTimeUnit\":\"ms\"}\n";
  write_file_atomic(path, os.str());
}

}  // namespace replica
