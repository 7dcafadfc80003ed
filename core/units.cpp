// Byte-size parsing and printing.
#include "core/units.h"

#include <cstdio>
#include <map>
#include <stdexcept>

#include "core/errors.h"

namespace replica {

std::string format_bytes(size_t b) {
  char buf[64];
  const double v = static_cast<double>(b);
  if (b >= (size_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1 << 30));
  else if (b >= (size_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", v / (1 << 20));
  else if (b >= 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", v / 1024);
  else std::snprintf(buf, sizeof buf, "%zu B", b);
  return buf;
}

uint64_t parse_bytes(const std::string& s, const std::string& what) {
  const std::string usage = what + ": '" + s + "' is not a size; use e.g. 2GiB, 512MiB, 128M or 1000000";
  size_t pos = 0;
  double v;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw ConfigError(usage);
  }
  std::string unit = s.substr(pos);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  static const std::map<std::string, double> units = {
      {"", 1},           {"B", 1},          {"K", 1024.0},     {"KiB", 1024.0}, {"M", 1048576.0},
      {"MiB", 1048576.0}, {"G", 1073741824.0}, {"GiB", 1073741824.0}, {"T", 1099511627776.0},
      {"TiB", 1099511627776.0}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  const auto it = units.find(unit);
  if (it == units.end() || !(v >= 0)) throw ConfigError(usage);
  const double bytes = v * it->second;
  // Converting a double beyond 2^64 to an integer is undefined: refuse anything past 1 EiB.
  if (!(bytes <= 1152921504606846976.0))
    throw ConfigError(what + ": '" + s + "' is larger than any device (more than 1 EiB)");
  return static_cast<uint64_t>(bytes);
}

}  // namespace replica
