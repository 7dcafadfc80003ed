// File I/O: atomic replacement, reads that name the file, clean-up of a killed writer's
// temporaries (a live writer's are kept), and the run-directory lock that refuses a second writer.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/errors.h"
#include "core/file_io.h"

using namespace replica;

namespace {
std::string fresh_dir(const std::string& name) {
  std::string d = ::testing::TempDir() + "/file_io_" + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}
pid_t dead_pid() {  // a process that has exited and been reaped
  pid_t p = fork();
  if (p == 0) _exit(0);
  int st;
  waitpid(p, &st, 0);
  return p;
}
}  // namespace

TEST(FileIo, AtomicWriteReplacesAndReadNamesTheFile) {
  const std::string d = fresh_dir("atomic");
  write_file_atomic(d + "/a.txt", "one");
  write_file_atomic(d + "/a.txt", "two");
  EXPECT_EQ(read_file(d + "/a.txt", "test file"), "two");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(d), {}), 1) << "no temporary left behind";
  try {
    read_file(d + "/missing.bin", "model file");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.bin"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(write_file_atomic(d + "/no/such/dir/a.txt", "x"), IoError);
}

TEST(FileIo, StaleTemporariesOfDeadWritersAreRemovedLiveOnesKept) {
  const std::string d = fresh_dir("stale");
  const std::string dead = d + "/step-00000004.ckpt.tmp." + std::to_string(dead_pid());
  const std::string live = d + "/step-00000008.ckpt.tmp." + std::to_string(getppid());
  const std::string mine = d + "/model.bin.tmp." + std::to_string(getpid());
  for (const auto& f : {dead, live, mine, d + "/notes.tmp.txt", d + "/step-00000002.ckpt"}) std::ofstream(f) << "x";
  auto removed = remove_stale_temporaries(d);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0], dead);
  EXPECT_FALSE(std::filesystem::exists(dead));
  for (const auto& f : {live, mine, d + "/notes.tmp.txt", d + "/step-00000002.ckpt"})
    EXPECT_TRUE(std::filesystem::exists(f)) << f;
  EXPECT_TRUE(remove_stale_temporaries(d + "/absent").empty());
}

TEST(FileIo, ASecondWriterOfADirectoryIsRefusedNamingTheHolder) {
  const std::string d = fresh_dir("lock");
  {
    DirectoryLock first(d, "test run");
    try {
      DirectoryLock second(d, "test run");
      FAIL() << "two holders";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("process " + std::to_string(getpid())), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(d), std::string::npos) << e.what();
    }
    // another process is refused too
    pid_t child = fork();
    if (child == 0) {
      try {
        DirectoryLock other(d, "child");
        _exit(1);
      } catch (const IoError&) {
        _exit(0);
      }
    }
    int st;
    waitpid(child, &st, 0);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "the other process got the lock";
  }
  DirectoryLock again(d, "test run");  // released with its holder
}
