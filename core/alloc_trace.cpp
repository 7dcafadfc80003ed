// AllocTrace: recording, CSV round trip, Chrome-trace counters.
#include "core/alloc_trace.h"

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/errors.h"
#include "core/file_io.h"
#include "core/json.h"

namespace replica {

namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

AllocTrace::AllocTrace() : t0_(now_ns()) {}

void AllocTrace::record(bool alloc, const void* p, size_t bytes, MemTag tag, int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back({now_ns() - t0_, alloc, reinterpret_cast<uint64_t>(p), bytes, tag, step});
}

std::vector<AllocEvent> AllocTrace::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

void AllocTrace::write_csv(const std::string& path, int) const {
  std::ostringstream os;
  os << "t_ns,op,id,bytes,tag,step\n";
  for (const auto& e : events())
    os << e.t_ns << ',' << (e.alloc ? "alloc" : "free") << ',' << e.id << ',' << e.bytes << ','
       << mem_tag_name(e.tag) << ',' << e.step << '\n';
  write_file_atomic(path, os.str());
}

std::vector<AllocEvent> AllocTrace::read_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw IoError(path + ": cannot open allocation trace");
  std::string line;
  std::getline(in, line);
  if (line != "t_ns,op,id,bytes,tag,step")
    throw IoError(path + ": not an allocation trace (expected header 't_ns,op,id,bytes,tag,step')");
  std::vector<AllocEvent> out;
  int lineno = 1;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    std::array<std::string, 6> f;
    std::stringstream ss(line);
    for (auto& x : f)
      if (!std::getline(ss, x, ','))
        throw IoError(path + ":" + std::to_string(lineno) + ": expected 6 comma-separated fields");
    AllocEvent e;
    try {
      e.t_ns = std::stoll(f[0]);
      e.alloc = f[1] == "alloc";
      e.id = std::stoull(f[2]);
      e.bytes = std::stoull(f[3]);
      e.step = std::stoll(f[5]);
    } catch (const std::exception&) {
      throw IoError(path + ":" + std::to_string(lineno) + ": malformed number");
    }
    e.tag = MemTag::other;
    for (int t = 0; t < kNumTags; ++t)
      if (f[4] == mem_tag_name(static_cast<MemTag>(t))) e.tag = static_cast<MemTag>(t);
    out.push_back(e);
  }
  return out;
}

void AllocTrace::write_chrome_json(const std::string& path, int pid) const {
  // One counter track ("ph":"C") per tag holding bytes in use; ts in microseconds.
  std::ostringstream os;
  os << "{\"traceEvents\":[\n";
  std::array<int64_t, kNumTags> in_use{};
  std::vector<std::pair<uint64_t, size_t>> dummy;
  bool first = true;
  for (const auto& e : events()) {
    int t = static_cast<int>(e.tag);
    in_use[t] += e.alloc ? static_cast<int64_t>(e.bytes) : -static_cast<int64_t>(e.bytes);
    if (!first) os << ",\n";
    first = false;
    os << json_line({{"name", "pool in use"},
                     {"ph", "C"},
                     {"pid", pid},
                     {"ts", e.t_ns / 1000.0},
                     {"args", {{mem_tag_name(e.tag), in_use[t]}}}});
  }
  os << "\n],\"displayTimeUnit\":\"ms\"}\n";
  write_file_atomic(path, os.str());
}

}  // namespace replica
