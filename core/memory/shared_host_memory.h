// Host memory that the other processes of this machine can map: an MPI job's CPU pools take their
// regions from memfds, so the node all-reduce (parallel/mpi/node_shared_memory.h) reads and
// writes every process's gradient buffer where it lies, as the in-process communicator does
// between threads, instead of copying through a window. A peer maps a region through
// /proc/<pid>/fd/<fd>; the memfd goes away with the last process that holds it, so a crash leaves
// nothing behind in /dev/shm.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/memory/resource.h"

namespace replica {

// Regions backed by a memfd each (plain HostUpstream pages where memfd_create fails; those are
// simply not shared).
class SharedHostUpstream : public Upstream {
 public:
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  size_t total_memory() const override { return plain_.total_memory(); }
  std::string name() const override { return "host (shared)"; }

 private:
  HostUpstream plain_;
};

// Where a shared region of this process is, as another process needs it to map it.
struct SharedRegion {
  int pid = 0;
  int fd = -1;
  uint64_t id = 0;  // unique within the process for its lifetime (never 0)
  size_t bytes = 0;
  const char* base = nullptr;
};

// The shared region holding all of [p, p + bytes), if there is one (`out` may be null).
bool find_shared_region(const void* p, size_t bytes, SharedRegion* out);

// Counts the shared regions of this process that were given back: a peer seeing it change
// drops its mappings of this process's old regions.
uint64_t shared_regions_released();

// Maps another process's region; nullptr when it cannot be opened (another pid namespace, no
// /proc, a region already gone), and the caller falls back to copying.
void* map_peer_region(int pid, int fd, size_t bytes);
void unmap_peer_region(void* p, size_t bytes);

}  // namespace replica
