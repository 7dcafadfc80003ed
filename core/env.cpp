// Boolean environment switches.
#include "core/env.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "core/errors.h"

namespace replica {

std::optional<bool> parse_bool_text(const std::string& text) {
  std::string s = text;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  return std::nullopt;
}

bool env_flag(const char* name) { return env_flag(name, false); }

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  if (auto b = parse_bool_text(v)) return *b;
  throw ConfigError(std::string(name) + "='" + v + "' is not a boolean; use 1 or 0");
}

}  // namespace replica
