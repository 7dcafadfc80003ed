// SharedHostUpstream and the registry of this process's shared regions (see the header).
#include "core/memory/shared_host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>

namespace replica {

namespace {
struct Registry {
  std::mutex m;
  std::map<uintptr_t, SharedRegion> regions;  // by base address
  uint64_t next_id = 1;
  std::atomic<uint64_t> released{0};
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: pools may outlive static destructors
  return *r;
}
constexpr size_t kPage = 4096;
}  // namespace

void* SharedHostUpstream::allocate(size_t bytes) {
  const size_t rounded = (bytes + kPage - 1) & ~(kPage - 1);
  const int fd = memfd_create("replica-pool", MFD_CLOEXEC);
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(rounded)) == 0) {
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      auto& r = registry();
      std::lock_guard<std::mutex> lock(r.m);
      r.regions[reinterpret_cast<uintptr_t>(p)] = {static_cast<int>(getpid()), fd, r.next_id++, rounded,
                                                   static_cast<const char*>(p)};
      return p;
    }
  }
  if (fd >= 0) close(fd);
  return plain_.allocate(bytes);  // not shared: the all-reduce copies for this one
}

void SharedHostUpstream::deallocate(void* p, size_t bytes) {
  auto& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.m);
    auto it = r.regions.find(reinterpret_cast<uintptr_t>(p));
    if (it != r.regions.end()) {
      munmap(p, it->second.bytes);
      close(it->second.fd);
      r.regions.erase(it);
      r.released.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  plain_.deallocate(p, bytes);
}

bool find_shared_region(const void* p, size_t bytes, SharedRegion* out) {
  auto& r = registry();
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(r.m);
  auto it = r.regions.upper_bound(a);
  if (it == r.regions.begin()) return false;
  --it;
  if (a + bytes > it->first + it->second.bytes) return false;
  if (out) *out = it->second;
  return true;
}

uint64_t shared_regions_released() { return registry().released.load(std::memory_order_relaxed); }

void* map_peer_region(int pid, int fd, size_t bytes) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int mine = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
  close(mine);  // the mapping keeps the memory
  return p == MAP_FAILED ? nullptr : p;
}

void unmap_peer_region(void* p, size_t bytes) { munmap(p, bytes); }

}  // namespace replica
