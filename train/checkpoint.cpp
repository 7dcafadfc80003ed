// Checkpoint file I/O: sectioned, checksummed, atomic.
#include "train/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/byte_reader.h"
#include "core/checksum.h"
#include "core/errors.h"
#include "core/file_io.h"

namespace replica::train {

namespace {
constexpr char kMagic[8] = {'R', 'P', 'L', 'C', 'K', 'P', 'T', '\0'};

template <typename T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
}  // namespace

std::map<std::string, std::string> Checkpoint::meta() const {
  std::map<std::string, std::string> kv;
  auto it = sections.find("meta");
  if (it == sections.end()) return kv;
  std::istringstream in(it->second);
  std::string line;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return kv;
}

std::string Checkpoint::meta_value(const std::string& key) const {
  auto kv = meta();
  auto it = kv.find(key);
  if (it == kv.end()) throw IoError("checkpoint: section 'meta' has no '" + key + "'");
  return it->second;
}

int64_t Checkpoint::meta_int(const std::string& key, int64_t lo, int64_t hi) const {
  const std::string v = meta_value(key);
  int64_t x = 0;
  size_t used = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (v.empty() || used != v.size() || x < lo || x > hi)
    throw IoError("checkpoint: section 'meta': " + key + " = '" + v + "' is not a whole number in [" +
                  std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

void Checkpoint::set_meta(const std::map<std::string, std::string>& kv) {
  std::string s;
  for (auto& [k, v] : kv) s += k + "=" + v + "\n";
  sections["meta"] = s;
}

void write_checkpoint(const Checkpoint& c, const std::string& path) {
  std::string out(kMagic, 8);
  put<uint32_t>(out, kCheckpointVersion);
  put<uint32_t>(out, static_cast<uint32_t>(c.sections.size()));
  for (auto& [name, payload] : c.sections) {
    put<uint32_t>(out, static_cast<uint32_t>(name.size()));
    out += name;
    put<uint64_t>(out, payload.size());
    put<uint64_t>(out, fnv1a(payload.data(), payload.size()));
    out += payload;
  }
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  write_file_atomic(path, out);
}

Checkpoint parse_checkpoint(std::string_view bytes, const std::string& source) {
  ByteReader in(bytes, source);
  if (in.size() < 8 || std::memcmp(bytes.data(), kMagic, 8) != 0) {
    if (in.size() < 8) in.need(16, "the header");
    throw IoError(source + ": not a replica checkpoint (bad magic)");
  }
  in.take(8, "the magic");
  const uint32_t version = in.get<uint32_t>("the header");
  const uint32_t count = in.get<uint32_t>("the header");
  if (version != kCheckpointVersion && version != 1)
    throw IoError(source + ": format version " + std::to_string(version) + ", this replica reads versions 1 and " +
                  std::to_string(kCheckpointVersion) + " (written by a newer replica?)");
  // Version 1 files were checksummed with the legacy FNV basis (core/checksum.h).
  const uint64_t basis = version == 1 ? kFnv1aLegacyBasis : kFnv1aBasis;
  // Each section takes at least 20 header bytes: a count beyond that is a lie, not a big file.
  if (count > in.remaining() / 20)
    throw IoError(source + ": the header promises " + std::to_string(count) + " sections but only " +
                  std::to_string(in.remaining()) + " bytes follow (truncated or damaged)");
  Checkpoint c;
  for (uint32_t i = 0; i < count; ++i) {
    const std::string which = "section " + std::to_string(i);
    const uint32_t nlen = in.get<uint32_t>(which + "'s name length");
    if (nlen == 0 || nlen > 256)
      throw IoError(source + ": " + which + " has a name of " + std::to_string(nlen) + " bytes (damaged header)");
    std::string name(in.take(nlen, which + "'s name"));
    const uint64_t size = in.get<uint64_t>(which + " ('" + name + "')'s size");
    const uint64_t sum = in.get<uint64_t>(which + " ('" + name + "')'s checksum");
    const std::string_view payload = in.take(size, "section '" + name + "'");
    if (fnv1a(payload.data(), payload.size(), basis) != sum)
      throw IoError(source + ": section '" + name + "' is corrupt (checksum mismatch)");
    if (!c.sections.emplace(name, std::string(payload)).second)
      throw IoError(source + ": section '" + name + "' appears twice (damaged file)");
  }
  if (in.remaining())
    throw IoError(source + ": " + std::to_string(in.remaining()) + " unexpected bytes after the last section");
  for (const char* s : {"meta", "params", "config"})
    if (!c.sections.count(s)) throw IoError(source + ": section '" + std::string(s) + "' is missing");
  return c;
}

Checkpoint read_checkpoint(const std::string& path) { return parse_checkpoint(read_file(path, "checkpoint"), path); }

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "step-%08lld.ckpt", static_cast<long long>(step));
  return dir + "/" + name;
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> out;
  if (!std::filesystem::exists(dir)) return out;
  for (auto& e : std::filesystem::directory_iterator(dir)) {
    auto name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0 && e.path().extension() == ".ckpt") out.push_back(e.path().string());
  }
  std::sort(out.rbegin(), out.rend());  // zero-padded step numbers: newest first
  return out;
}

void rotate_checkpoints(const std::string& dir, int keep) {
  remove_stale_temporaries(dir);  // a killed writer's step-N.ckpt.tmp.PID
  if (keep <= 0) return;
  auto all = list_checkpoints(dir);
  for (size_t i = static_cast<size_t>(keep); i < all.size(); ++i) std::filesystem::remove(all[i]);
}

}  // namespace replica::train
