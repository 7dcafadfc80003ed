// Config: defaults, --set overrides, and every error path names the file, line and key.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/errors.h"
#include "train/config.h"
#include "train/memory_advice.h"

using namespace replica;
using namespace replica::train;

namespace {
std::string error_of(const std::string& text, std::vector<std::string> sets = {}) {
  try {
    parse_config(text, "run.yaml", sets);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
#define EXPECT_HAS(hay, needle) EXPECT_NE((hay).find(needle), std::string::npos) << (hay)
}  // namespace

TEST(Config, BuiltInDefault) {
  auto c = load_config("");
  EXPECT_EQ(c.model.arch, "resnet20");
  EXPECT_EQ(c.data.dataset, "fashion-mnist");
  EXPECT_EQ(c.parallel.devices, "auto");
  EXPECT_EQ(c.train.global_batch, 128);
  EXPECT_DOUBLE_EQ(c.train.epochs, 3);
  EXPECT_EQ(c.optim.schedule, "cosine");
  EXPECT_FALSE(c.memory.mode.has_value());
  // The resolved config parses back to the same values.
  auto back = parse_config(c.resolved, "resolved");
  EXPECT_EQ(back.resolved, c.resolved);
}

TEST(Config, SetOverridesAndLists) {
  auto c = parse_config("train:\n  epochs: 3\n", "run.yaml",
                        {"train.epochs=1", "data.mean=[0.1,0.2,0.3]", "data.std=[1,1,1]", "memory.bytes=2GiB",
                         "memory.mode=preallocate", "parallel.sync_bn=true"});
  EXPECT_DOUBLE_EQ(c.train.epochs, 1);
  EXPECT_EQ(c.data.mean.size(), 3u);
  EXPECT_EQ(*c.memory.bytes, uint64_t(2) << 30);
  EXPECT_EQ(*c.memory.mode, "preallocate");
  EXPECT_TRUE(c.parallel.sync_bn);
}

TEST(Config, ErrorsNameFileLineKeyAndSuggest) {
  auto m = error_of("model:\n  arch: resnet20\ntrain:\n  epoch: 3\n");
  EXPECT_HAS(m, "run.yaml:4: train.epoch: unknown key; did you mean 'epochs'?");
  EXPECT_HAS(error_of("trian:\n  epochs: 1\n"), "unknown section 'trian'; did you mean 'train'?");
  EXPECT_HAS(error_of("train:\n  epochs: three\n"), "run.yaml:2: train.epochs: 'three' is not a number");
  EXPECT_HAS(error_of("train:\n  global_batch: 0\n"), "train.global_batch: 0 is out of range");
  EXPECT_HAS(error_of("model:\n  arch: resnet21\n"), "model.arch: 'resnet21' is not one of: resnet20");
  EXPECT_HAS(error_of("memory:\n  fraction: 1.5\n"), "run.yaml:2: memory.fraction: 1.5 is not a memory fraction");
  EXPECT_HAS(error_of("memory:\n  mode: cuda_async\n"), "memory.mode: 'cuda_async' is not one of");
  EXPECT_HAS(error_of("memory:\n  bytes: lots\n"), "is not a size");
  EXPECT_HAS(error_of("memory:\n  bytes: 1e30\n"), "run.yaml:2: memory.bytes: '1e30' is larger than any device");
  EXPECT_HAS(error_of("", {"memory.bytes=1e30"}), "--set memory.bytes: '1e30' is larger than any device");
  EXPECT_HAS(error_of("memory:\n  bytes: nan\n"), "is not a size");
  // A mapping or list where a key belongs: named with file and line, not yaml-cpp's "bad conversion".
  EXPECT_HAS(error_of("train:\n  {a: 1}: 2\n"), "run.yaml:2: train: a key must be a plain name, not a mapping");
  EXPECT_HAS(error_of("? {a: 1}\n: 2\n"), "run.yaml:1: a key must be a plain name, not a mapping");
  EXPECT_HAS(error_of("? [a, b]\n: 2\n"), "a key must be a plain name, not a list");
  EXPECT_HAS(error_of("parallel:\n  sync_bn: maybe\n"), "'maybe' is not a boolean");
  EXPECT_HAS(error_of("train: [1, 2\n"), "run.yaml:");
  EXPECT_HAS(error_of("optim:\n  schedule: step\n"), "optim.schedule: step needs optim.milestones");
  EXPECT_HAS(error_of("train:\n  precision: fp8\n"), "train.precision: 'fp8' is not one of: fp32, fp16, bf16");
  EXPECT_HAS(error_of("train:\n  loss_scale: lots\n"), "train.loss_scale: 'lots' is not a number");
  EXPECT_HAS(error_of("parallel:\n  grad_dtype: int8\n"), "parallel.grad_dtype");
  EXPECT_HAS(error_of("", {"train.epochs"}), "expected section.key=value");
  EXPECT_HAS(error_of("", {"train.epocs=2"}), "--set train.epocs=2: unknown key 'train.epocs'; did you mean 'epochs'?");
  EXPECT_HAS(error_of("", {"train.epochs=-1"}), "--set train.epochs: -1 is out of range");
  EXPECT_HAS(error_of("data:\n  mean: [0.5, 0.5]\n  std: [0.5]\n"), "same number of values");
}

// The emitted configuration is read back to the same configuration (every schema key writes itself).
TEST(Config, EmitReadsBackToTheSameText) {
  auto c = parse_config("model:\n  checkpoint: every:3\ntrain:\n  micro_batch: auto\nmemory:\n  bytes: 2GiB\n"
                        "optim:\n  schedule: step\n  milestones: [1, 2.5]\n",
                        "run.yaml", {"data.mean=[0.1,0.2]", "data.std=[1,2]"});
  auto again = parse_config(c.resolved, "resolved", {});
  EXPECT_EQ(again.resolved, c.resolved);
  EXPECT_EQ(again.model.checkpoint_every, 3);
  EXPECT_EQ(again.train.micro_batch, -1);
  EXPECT_EQ(again.memory.bytes.value_or(0), uint64_t(2) << 30);
  EXPECT_FALSE(again.memory.fraction.has_value()) << "an unset optional key stays unset";
  EXPECT_EQ(c.resolved.find("fraction"), std::string::npos);
  EXPECT_EQ(again.optim.milestones, (std::vector<double>{1, 2.5}));
}

TEST(Config, EveryShippedConfigParses) {
  int n = 0;
  for (auto& e : std::filesystem::directory_iterator(std::string(REPLICA_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".yaml") continue;
    EXPECT_NO_THROW(load_config(e.path().string())) << e.path();
    n++;
  }
  EXPECT_GE(n, 3);
  // configs/default.yaml is what the binary has built in
  std::ifstream in(std::string(REPLICA_SOURCE_DIR) + "/configs/default.yaml");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), default_config_text());
}

TEST(MemoryAdvice, NamesTheSettingsToChange) {
  // What the trainer appends to an out-of-memory error (installed on every replica's pool).
  OomReport r;
  r.options.bytes = size_t(64) << 20;
  const std::string m = train::memory_advice(r);
  for (const char* needle : {"train.micro_batch", "fp16", "model.checkpoint: blocks", "memory.bytes (now 64.00 MiB)"})
    EXPECT_NE(m.find(needle), std::string::npos) << "missing '" << needle << "' in: " << m;
  r.options.bytes = 0;
  r.options.fraction = 0.5;
  r.options.fraction_source = "REPLICA_MEM_FRACTION";
  EXPECT_NE(train::memory_advice(r).find("memory.fraction (now 0.5, from REPLICA_MEM_FRACTION)"), std::string::npos);
}

// train.deterministic: the config, then REPLICA_DETERMINISTIC, then the built-in default; a value
// that is not a boolean is a named error in either place.
TEST(Config, DeterministicComesFromTheConfigThenTheEnvironment) {
  const char* old = std::getenv("REPLICA_DETERMINISTIC");
  const std::string saved = old ? old : "";
  unsetenv("REPLICA_DETERMINISTIC");
  EXPECT_EQ(resolve_deterministic(parse_config("", "run.yaml").train), kDeterministicByDefault);
  setenv("REPLICA_DETERMINISTIC", "1", 1);
  EXPECT_TRUE(resolve_deterministic(parse_config("", "run.yaml").train));
  EXPECT_FALSE(resolve_deterministic(parse_config("", "run.yaml", {"train.deterministic=false"}).train))
      << "the config wins over the environment";
  setenv("REPLICA_DETERMINISTIC", "maybe", 1);
  try {
    resolve_deterministic(parse_config("", "run.yaml").train);
    ADD_FAILURE() << "REPLICA_DETERMINISTIC=maybe was accepted";
  } catch (const ConfigError& e) {
    EXPECT_HAS(std::string(e.what()), "REPLICA_DETERMINISTIC");
  }
  EXPECT_TRUE(resolve_deterministic(parse_config("train:\n  deterministic: true\n", "run.yaml").train));
  EXPECT_HAS(error_of("train:\n  deterministic: maybe\n"), "train.deterministic");
  if (old) setenv("REPLICA_DETERMINISTIC", saved.c_str(), 1);
  else unsetenv("REPLICA_DETERMINISTIC");
}
