// Logger implementation: a level and a mutex so lines from replica threads never interleave.
#include "core/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "core/errors.h"

namespace replica {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::info)};
std::mutex g_mutex;
}  // namespace

void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }

void log_message(LogLevel level, const std::string& msg) {
  static const char* names[] = {"debug", "info", "warn", "error", "off"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "[replica %s] %s\n", names[static_cast<int>(level)], msg.c_str());
}

LogLevel parse_log_level(const std::string& s, const std::string& what) {
  if (s == "debug") return LogLevel::debug;
  if (s == "info") return LogLevel::info;
  if (s == "warn") return LogLevel::warn;
  if (s == "error") return LogLevel::error;
  if (s == "off") return LogLevel::off;
  throw ConfigError(what + ": '" + s + "' is not a log level; use debug, info, warn, error or off");
}

}  // namespace replica
