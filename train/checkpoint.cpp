// Checkpoint file I/O: sectioned, checksummed, atomic.
#include "train/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/alloc_trace.h"
#include "core/checksum.h"
#include "core/errors.h"

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

Checkpoint read_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot open the checkpoint");
  std::string data((std::istreambuf_iterator<char>(in)), {});
  size_t off = 0;
  auto need = [&](size_t n, const std::string& what) {
    if (off + n > data.size())
      throw IoError(path + ": truncated in " + what + " (file has " + std::to_string(data.size()) + " bytes)");
  };
  need(16, "the header");
  if (std::memcmp(data.data(), kMagic, 8) != 0) throw IoError(path + ": not a replica checkpoint (bad magic)");
  uint32_t version, count;
  std::memcpy(&version, data.data() + 8, 4);
  std::memcpy(&count, data.data() + 12, 4);
  if (version != kCheckpointVersion)
    throw IoError(path + ": format version " + std::to_string(version) + ", this replica reads version " +
                  std::to_string(kCheckpointVersion));
  off = 16;
  Checkpoint c;
  for (uint32_t i = 0; i < count; ++i) {
    need(4, "section " + std::to_string(i) + "'s name");
    uint32_t nlen;
    std::memcpy(&nlen, data.data() + off, 4);
    off += 4;
    need(nlen + 16, "section " + std::to_string(i) + "'s header");
    std::string name = data.substr(off, nlen);
    off += nlen;
    uint64_t size, sum;
    std::memcpy(&size, data.data() + off, 8);
    std::memcpy(&sum, data.data() + off + 8, 8);
    off += 16;
    need(size, "section '" + name + "'");
    if (fnv1a(data.data() + off, size) != sum)
      throw IoError(path + ": section '" + name + "' is corrupt (checksum mismatch)");
    c.sections[name] = data.substr(off, size);
    off += size;
  }
  if (off != data.size()) throw IoError(path + ": " + std::to_string(data.size() - off) + " unexpected bytes after the last section");
  for (const char* s : {"meta", "params", "config"})
    if (!c.sections.count(s)) throw IoError(path + ": section '" + std::string(s) + "' is missing");
  return c;
}

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
  if (keep <= 0) return;
  auto all = list_checkpoints(dir);
  for (size_t i = static_cast<size_t>(keep); i < all.size(); ++i) std::filesystem::remove(all[i]);
}

}  // namespace replica::train
