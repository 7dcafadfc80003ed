// Devices: `cpu:N` virtual CPU devices (one replica thread each) and `cuda:N` GPUs; discovery.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace replica {

enum class DeviceKind { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  std::string str() const { return (kind == DeviceKind::cpu ? "cpu:" : "cuda:") + std::to_string(index); }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
};

// What we know of a physical or virtual device.
struct DeviceInfo {
  Device device;
  std::string name;
  std::string uuid;           // GPU-... or MIG-... for CUDA devices
  size_t total_memory = 0;    // bytes
  size_t free_memory = 0;     // bytes, at the time of discovery
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
};

// Parses a device list: "auto", "cpu", "cpu:N" (N virtual CPU devices), "cuda", "cuda:0,1",
// "cuda:0-3", "cuda:0x2" (parse_cuda_list), "cuda:local". "auto" means every visible GPU, or 2 CPU devices when there is none.
// Throws ConfigError naming the text on anything else, and when a GPU index is not visible.
std::vector<Device> parse_devices(const std::string& spec);
// The GPUs of "cuda:LIST" with `visible` GPUs present: LIST is comma-separated items N (GPU N),
// N-M (GPUs N to M) and NxK (K replicas on GPU N, ranks sharing it); a GPU may be named more than
// once (cuda:0,0 is cuda:0x2). A GPU past the visible ones is a ConfigError.
std::vector<Device> parse_cuda_list(const std::string& spec, int visible);
// The canonical spelling of a device list: "cpu:2", "cuda:0,1" (what "auto" resolved to).
std::string devices_str(const std::vector<Device>& devices);

// CPU: the host's physical memory and core count. Virtual CPU devices share it.
DeviceInfo cpu_device_info(int index);
size_t host_physical_memory();
int host_core_count();
// This process's index among the job's processes on its node, as the launcher says
// (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID, LOCAL_RANK); 0 when started plainly.
int launcher_local_rank();

// CUDA devices visible to this process (honours CUDA_VISIBLE_DEVICES, including MIG UUIDs,
// because the CUDA runtime applies it). Empty when no device is present or CUDA is not built;
// `why` (if given) receives the reason.
std::vector<DeviceInfo> cuda_devices(std::string* why = nullptr);
bool cuda_compiled();

}  // namespace replica
