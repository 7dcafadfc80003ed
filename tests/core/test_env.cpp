// Pool settings from REPLICA_PREALLOCATE / REPLICA_MEM_FRACTION / REPLICA_ALLOCATOR.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>

#include "core/env.h"
#include "core/errors.h"
#include "core/memory_pool.h"

using namespace replica;

namespace {
std::map<std::string, std::string> g_env;
const char* fake_getenv(const char* name) {
  auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}
PoolOptions parse(std::map<std::string, std::string> env) {
  g_env = std::move(env);
  return pool_options_from_env(PoolOptions{}, fake_getenv);
}
std::string error_of(std::map<std::string, std::string> env) {
  try {
    parse(std::move(env));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(PoolEnv, DefaultsUntouched) {
  auto o = parse({});
  EXPECT_EQ(o.mode, AllocatorMode::growth);
  EXPECT_DOUBLE_EQ(o.fraction, 0.75);
}

TEST(PoolEnv, ValidValues) {
  auto o = parse({{"REPLICA_PREALLOCATE", "true"}, {"REPLICA_MEM_FRACTION", "0.5"}});
  EXPECT_EQ(o.mode, AllocatorMode::preallocate);
  EXPECT_DOUBLE_EQ(o.fraction, 0.5);
  EXPECT_EQ(o.fraction_source, "REPLICA_MEM_FRACTION");
  EXPECT_EQ(parse({{"REPLICA_PREALLOCATE", "false"}}).mode, AllocatorMode::growth);
  EXPECT_EQ(parse({{"REPLICA_ALLOCATOR", "platform"}}).mode, AllocatorMode::platform);
  EXPECT_EQ(parse({{"REPLICA_PREALLOCATE", "1"}, {"REPLICA_ALLOCATOR", "default"}}).mode,
            AllocatorMode::preallocate);
  EXPECT_DOUBLE_EQ(parse({{"REPLICA_MEM_FRACTION", "1"}}).fraction, 1.0);
}

TEST(PoolEnv, InvalidValuesNameTheVariable) {
  for (auto [k, v] : std::vector<std::pair<std::string, std::string>>{
           {"REPLICA_MEM_FRACTION", "0"}, {"REPLICA_MEM_FRACTION", "1.5"},
           {"REPLICA_MEM_FRACTION", "abc"}, {"REPLICA_MEM_FRACTION", "0.5x"},
           {"REPLICA_MEM_FRACTION", "-0.1"}, {"REPLICA_PREALLOCATE", "maybe"},
           {"REPLICA_ALLOCATOR", "cuda_malloc_async"}}) {
    std::string m = error_of({{k, v}});
    EXPECT_NE(m.find(k), std::string::npos) << k << "=" << v << " gave: " << m;
    EXPECT_FALSE(m.empty()) << k << "=" << v << " was accepted";
  }
  EXPECT_NE(error_of({{"REPLICA_MEM_FRACTION", "1.5"}}).find("(0, 1]"), std::string::npos);
  EXPECT_NE(error_of({{"REPLICA_ALLOCATOR", "x"}}).find("platform"), std::string::npos);
}

TEST(EnvFlag, OnOffAndMisspellingsNameTheVariable) {
  const char* name = "REPLICA_TEST_FLAG";
  unsetenv(name);
  EXPECT_FALSE(env_flag(name)) << "unset is off";
  for (const char* on : {"1", "true", "YES", "on"}) {
    setenv(name, on, 1);
    EXPECT_TRUE(env_flag(name)) << on;
  }
  for (const char* off : {"", "0", "False", "no", "off"}) {
    setenv(name, off, 1);
    EXPECT_FALSE(env_flag(name)) << off;
  }
  setenv(name, "flase", 1);
  try {
    env_flag(name);
    ADD_FAILURE() << "a misspelt value was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("REPLICA_TEST_FLAG='flase'"), std::string::npos) << e.what();
  }
  // A switch that is on unless turned off (REPLICA_DIRECT_CONV, REPLICA_MPI_SHM).
  EXPECT_THROW(env_flag(name, true), ConfigError) << "a misspelling is an error whatever the fallback";
  unsetenv(name);
  EXPECT_TRUE(env_flag(name, true)) << "unset gives the fallback";
  setenv(name, "", 1);
  EXPECT_TRUE(env_flag(name, true)) << "empty gives the fallback";
  setenv(name, "0", 1);
  EXPECT_FALSE(env_flag(name, true));
  unsetenv(name);
}
