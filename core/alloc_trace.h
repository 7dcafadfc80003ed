// AllocTrace: a record of a pool's alloc/free events, exported as Chrome-trace JSON (counter
// tracks per tag; opens in Perfetto) or CSV (which `replica bench alloc --replay` reads back).
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "core/memory/resource.h"

namespace replica {

struct AllocEvent {
  int64_t t_ns = 0;    // since the trace started
  bool alloc = true;
  uint64_t id = 0;     // address as an id: pairs a free with its alloc
  size_t bytes = 0;    // requested bytes
  MemTag tag = MemTag::other;
  int64_t step = 0;
};

class AllocTrace {
 public:
  AllocTrace();
  void record(bool alloc, const void* p, size_t bytes, MemTag tag, int64_t step);
  std::vector<AllocEvent> events() const;
  void write_csv(const std::string& path, int pid = 0) const;
  void write_chrome_json(const std::string& path, int pid = 0) const;
  static std::vector<AllocEvent> read_csv(const std::string& path);

 private:
  mutable std::mutex mu_;
  int64_t t0_;
  std::vector<AllocEvent> events_;
};

}  // namespace replica
