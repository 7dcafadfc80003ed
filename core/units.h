// Byte sizes as people write and read them: "2GiB", "512MiB", "1G", "1e9" in, "1.50 GiB" out.
// The one parser and the one printer every config key, command-line flag and report uses.
#pragma once
#include <cstdint>
#include <string>

namespace replica {

std::string format_bytes(size_t bytes);
// Binary (K/KiB, M/MiB, G/GiB, T/TiB) and decimal (KB, MB, GB, TB) units, or none (bytes);
// throws ConfigError naming `what` and the value.
uint64_t parse_bytes(const std::string& s, const std::string& what);

}  // namespace replica
