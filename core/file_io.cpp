// File I/O: atomic writes, checked whole-file reads, stale temporaries, directory locks.
#include "core/file_io.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/errors.h"

namespace replica {

namespace {
constexpr const char* kTmpMarker = ".tmp.";

std::string errno_text() { return std::strerror(errno); }
}  // namespace

void write_file_atomic(const std::string& path, const std::string& contents) {
  auto slash = path.find_last_of('/');
  std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  std::string tmp = path + kTmpMarker + std::to_string(getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    throw IoError(path + ": cannot create '" + tmp + "': " + errno_text() +
                  " (does the directory exist and is it writable?)");
  auto fail = [&](const std::string& what) {
    const std::string why = errno_text();
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw IoError(path + ": " + what + ": " + why + "; the previous file, if any, is unchanged");
  };
  size_t off = 0;
  while (off < contents.size()) {
    ssize_t n = ::write(fd, contents.data() + off, contents.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("write failed (disk full?)");
    off += static_cast<size_t>(n);
  }
  // fsync and close separately: a failing fsync must still close the descriptor.
  if (::fsync(fd) != 0) fail("fsync failed");
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) fail("close failed");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename from '" + tmp + "' failed");
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot open the " + what + ": " + errno_text());
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw IoError(path + ": reading the " + what + " failed");
  return ss.str();
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return removed;
  for (auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const size_t at = name.rfind(kTmpMarker);
    if (at == std::string::npos || !e.is_regular_file(ec)) continue;
    const std::string pid_text = name.substr(at + std::strlen(kTmpMarker));
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9)
      continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid == getpid()) continue;  // our own write in progress (another thread)
    if (::kill(pid, 0) == 0 || errno == EPERM) continue;  // the writer is alive
    if (std::filesystem::remove(e.path(), ec)) removed.push_back(e.path().string());
  }
  return removed;
}

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& purpose) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError(path + ": cannot open the lock file: " + errno_text());
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {0};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    throw IoError(dir + ": already in use by process " + holder + " (" + purpose +
                  "); wait for it to finish, stop it, or use another directory");
  }
  const std::string me = std::to_string(getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] ssize_t w = ::pwrite(fd_, me.data(), me.size(), 0);
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
}

}  // namespace replica
