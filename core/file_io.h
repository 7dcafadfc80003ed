// File I/O that loses nothing a user wrote: atomic replacement of a file, whole-file reads that
// name the file, clean-up of the temporaries a killed writer left behind, and an advisory lock
// that keeps two writers out of one directory.
#pragma once
#include <string>
#include <vector>

namespace replica {

// Writes `contents` to `path` atomically: a temporary `path.tmp.PID` in the same directory,
// fsync, rename over `path`, fsync of the directory. A crash at any point leaves either the old
// file or the new one, never a torn one; the temporary of a killed writer is removed by
// remove_stale_temporaries().
void write_file_atomic(const std::string& path, const std::string& contents);

// The whole file; IoError naming the file (and `what` it was meant to be) when it cannot be read.
std::string read_file(const std::string& path, const std::string& what);

// Deletes `NAME.tmp.PID` files in `dir` whose writer process PID is no longer alive (left by a
// kill -9 during write_file_atomic). Returns the paths removed; a live writer's are kept.
std::vector<std::string> remove_stale_temporaries(const std::string& dir);

// An exclusive advisory lock (flock) on `dir`/.lock, held for the object's lifetime. A second
// holder, in this process or another, is refused with an IoError naming the holder's PID.
class DirectoryLock {
 public:
  DirectoryLock(const std::string& dir, const std::string& purpose);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace replica
