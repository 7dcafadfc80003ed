// Test helpers for runs that write files: a fresh directory under the test temp dir, and a whole
// file's bytes.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace replica::testing {

// TempDir()/<prefix><name>, emptied and created.
inline std::string fresh_dir(const std::string& prefix, const std::string& name) {
  std::string d = ::testing::TempDir() + "/" + prefix + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

}  // namespace replica::testing
