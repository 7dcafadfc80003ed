// Replays every committed fuzz seed (tests/fuzz/corpus/<target>/) and every past finding
// (tests/fuzz/regressions/<target>/) through the fuzz targets' bodies in the normal suite, so a
// reader that regresses on a known input fails here without clang or libFuzzer.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "targets.h"

namespace {
const std::map<std::string, std::function<void(const uint8_t*, size_t)>> kTargets = {
    {"fuzz_checkpoint", replica::fuzz::checkpoint}, {"fuzz_model_file", replica::fuzz::model_file},
    {"fuzz_idx", replica::fuzz::idx},               {"fuzz_cifar", replica::fuzz::cifar},
    {"fuzz_config", replica::fuzz::config},         {"fuzz_safetensors", replica::fuzz::safetensors_file},
    {"fuzz_image", replica::fuzz::image},           {"fuzz_pack", replica::fuzz::pack}};
}  // namespace

TEST(FuzzRegressions, EveryCommittedInputIsReadOrRefusedByName) {
  int files = 0;
  for (const char* kind : {"corpus", "regressions"}) {
    for (auto& [target, body] : kTargets) {
      const std::filesystem::path dir = std::filesystem::path(REPLICA_SOURCE_DIR) / "tests/fuzz" / kind / target;
      if (!std::filesystem::exists(dir)) continue;
      for (auto& f : std::filesystem::directory_iterator(dir)) {
        std::ifstream in(f.path(), std::ios::binary);
        std::string bytes((std::istreambuf_iterator<char>(in)), {});
        SCOPED_TRACE(f.path().string());
        EXPECT_NO_THROW(body(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
        files++;
      }
    }
  }
  EXPECT_GT(files, 10) << "the seed corpora are committed";
}
