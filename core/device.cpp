// Device-list parsing and host device information (CUDA discovery lives in core/cuda/).
#include "core/device.h"

#include <cstdlib>

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <thread>

#include "core/errors.h"

namespace replica {

size_t host_physical_memory() {
  long pages = sysconf(_SC_PHYS_PAGES);
  long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

int host_core_count() { return std::max(1u, std::thread::hardware_concurrency()); }

DeviceInfo cpu_device_info(int index) {
  DeviceInfo info;
  info.device = {DeviceKind::cpu, index};
  info.name = "host CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto pos = line.find(':');
      if (pos != std::string::npos) info.name = line.substr(pos + 2);
      break;
    }
  }
  info.total_memory = host_physical_memory();
  long avail = sysconf(_SC_AVPHYS_PAGES);
  info.free_memory = avail > 0 ? static_cast<size_t>(avail) * sysconf(_SC_PAGE_SIZE) : 0;
  return info;
}

namespace {
int parse_int(const std::string& s, const std::string& spec) {
  try {
    size_t pos = 0;
    int v = std::stoi(s, &pos);
    if (pos != s.size() || v < 0) throw std::invalid_argument(s);
    return v;
  } catch (const std::exception&) {
    throw ConfigError("devices: '" + spec + "' is not a device list; expected auto, cpu:N, " +
                      "cuda, cuda:0,1, cuda:0-3 or cuda:0x2");
  }
}
}  // namespace

int launcher_local_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "LOCAL_RANK"})
    if (const char* e = std::getenv(v)) {
      char* end = nullptr;
      const long r = std::strtol(e, &end, 10);
      if (*e && !*end && r >= 0) return static_cast<int>(r);
      throw ConfigError(std::string(v) + "=" + e + ": expected the process's local rank (a whole number >= 0)");
    }
  return 0;
}

std::string devices_str(const std::vector<Device>& devices) {
  if (devices.empty()) return "none";
  if (devices.front().kind == DeviceKind::cpu) return "cpu:" + std::to_string(devices.size());
  std::string s = "cuda:";
  for (size_t i = 0; i < devices.size(); ++i) s += (i ? "," : "") + std::to_string(devices[i].index);
  return s;
}

std::vector<Device> parse_cuda_list(const std::string& spec, int visible) {
  if (spec.rfind("cuda:", 0) != 0) throw ConfigError("devices: '" + spec + "' is not a list of GPUs (cuda:...)");
  std::vector<Device> out;
  const std::string list = spec.substr(5);
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    const std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const auto dash = item.find('-'), times = item.find('x');
    int lo, hi, copies = 1;
    if (times != std::string::npos) {  // NxK: K replicas on GPU N (ranks sharing it)
      lo = hi = parse_int(item.substr(0, times), spec);
      copies = parse_int(item.substr(times + 1), spec);
      if (copies < 1 || copies > 64)
        throw ConfigError("devices: '" + spec + "' puts " + std::to_string(copies) + " replicas on cuda:" +
                          std::to_string(lo) + "; use 1 to 64 (cuda:0x4 is 4 replicas on GPU 0)");
    } else if (dash != std::string::npos) {
      lo = parse_int(item.substr(0, dash), spec);
      hi = parse_int(item.substr(dash + 1), spec);
    } else {
      lo = hi = parse_int(item, spec);
    }
    for (int i = lo; i <= hi; ++i) {
      if (i >= visible)
        throw ConfigError("devices: '" + spec + "' names cuda:" + std::to_string(i) + " but only " +
                          std::to_string(visible) + " GPU(s) are visible");
      for (int c = 0; c < copies; ++c) out.push_back({DeviceKind::cuda, i});
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::vector<Device> parse_devices(const std::string& spec) {
  std::vector<Device> out;
  if (spec == "auto") {
    // Every visible GPU; without one, two CPU replicas on any machine (so a configuration gives
    // the same numbers on every CPU machine; cpu:N asks for more).
    auto gpus = cuda_devices();
    if (gpus.empty()) return {{DeviceKind::cpu, 0}, {DeviceKind::cpu, 1}};
    for (auto& g : gpus) out.push_back(g.device);
    return out;
  }
  if (spec == "cpu") return {{DeviceKind::cpu, 0}};
  if (spec.rfind("cpu:", 0) == 0) {
    int n = parse_int(spec.substr(4), spec);
    if (n < 1 || n > 1024)
      throw ConfigError("devices: '" + spec + "' asks for " + std::to_string(n) +
                        " CPU replicas; use 1 to 1024");
    for (int i = 0; i < n; ++i) out.push_back({DeviceKind::cpu, i});
    return out;
  }
  if (spec == "cuda" || spec.rfind("cuda:", 0) == 0) {
    std::string why;
    auto gpus = cuda_devices(&why);
    if (gpus.empty())
      throw ConfigError("devices: '" + spec + "' asks for GPUs but none is usable (" + why +
                        "); use --devices cpu:N to train on CPU replicas");
    if (spec == "cuda") {
      for (auto& g : gpus) out.push_back(g.device);
      return out;
    }
    if (spec == "cuda:local") {  // one process per GPU: the launcher's local rank picks it
      const int local = launcher_local_rank();
      if (local < 0 || local >= static_cast<int>(gpus.size()))
        throw ConfigError("devices: 'cuda:local' is GPU " + std::to_string(local) + " (this process's local rank) but " +
                          std::to_string(gpus.size()) + " GPU(s) are visible; start at most one process per GPU");
      return {{DeviceKind::cuda, local}};
    }
    return parse_cuda_list(spec, static_cast<int>(gpus.size()));
  }
  throw ConfigError("devices: '" + spec + "' is not a device list; expected auto, cpu:N, cuda, " +
                    "cuda:0,1, cuda:0-3 or cuda:0x2 (two replicas on GPU 0)");
}

}  // namespace replica
