// A small thread-safe logger: levels, one line per message, to stderr.
#pragma once
#include <sstream>
#include <string>

namespace replica {

enum class LogLevel { debug = 0, info = 1, warn = 2, error = 3, off = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
void log_message(LogLevel level, const std::string& msg);
// Parses "debug|info|warn|error|off"; throws ConfigError naming `what` otherwise.
LogLevel parse_log_level(const std::string& s, const std::string& what);

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

template <typename... Args>
void log_info(Args&&... args) {
  if (log_level() <= LogLevel::info) log_message(LogLevel::info, detail::concat(args...));
}
template <typename... Args>
void log_warn(Args&&... args) {
  if (log_level() <= LogLevel::warn) log_message(LogLevel::warn, detail::concat(args...));
}
template <typename... Args>
void log_debug(Args&&... args) {
  if (log_level() <= LogLevel::debug) log_message(LogLevel::debug, detail::concat(args...));
}

}  // namespace replica
