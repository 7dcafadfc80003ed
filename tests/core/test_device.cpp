// Device lists and discovery on a machine that may have no GPU.
#include <gtest/gtest.h>

#include "core/device.h"
#include "core/errors.h"
#include "core/stream.h"

using namespace replica;

// GPU lists, without a GPU: ranges, repeats (ranks sharing a GPU) and NxK, each a named error when
// it names a GPU that is not there or asks for no replica.
TEST(Devices, ParseGpuLists) {
  auto same = [](const std::vector<Device>& d, std::vector<int> want) {
    std::vector<int> got;
    for (const Device& x : d) {
      EXPECT_EQ(x.kind, DeviceKind::cuda);
      got.push_back(x.index);
    }
    return got == want;
  };
  EXPECT_TRUE(same(parse_cuda_list("cuda:0,1", 2), {0, 1}));
  EXPECT_TRUE(same(parse_cuda_list("cuda:0-3", 4), {0, 1, 2, 3}));
  EXPECT_TRUE(same(parse_cuda_list("cuda:0,0", 1), {0, 0}));
  EXPECT_TRUE(same(parse_cuda_list("cuda:0x4", 1), {0, 0, 0, 0}));
  EXPECT_TRUE(same(parse_cuda_list("cuda:0x2,1x2", 2), {0, 0, 1, 1}));
  EXPECT_EQ(devices_str(parse_cuda_list("cuda:0x2", 1)), "cuda:0,0");
  for (const char* bad : {"cuda:2x2", "cuda:0x0", "cuda:0x65", "cuda:0xq", "cuda:2", "cuda:0-2"}) {
    try {
      parse_cuda_list(bad, 2);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << "names the value: " << e.what();
    }
  }
}

TEST(Devices, ParseCpuLists) {
  auto d = parse_devices("cpu:3");
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[2].str(), "cpu:2");
  EXPECT_EQ(parse_devices("cpu").size(), 1u);
  EXPECT_THROW(parse_devices("cpu:0"), ConfigError);
  EXPECT_THROW(parse_devices("cpu:x"), ConfigError);
  EXPECT_THROW(parse_devices("tpu:1"), ConfigError);
  // A misspelt kind is refused with the spellings that work.
  EXPECT_THROW(
      {
        try {
          parse_devices("gpu:1");
        } catch (const ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find("cpu:N"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("gpu:1"), std::string::npos) << "names the value: " << e.what();
          throw;
        }
      },
      ConfigError);
}

TEST(Devices, AutoFallsBackToCpuWithoutGpu) {
  auto gpus = cuda_devices();
  auto d = parse_devices("auto");
  if (gpus.empty()) {
    ASSERT_EQ(d.size(), 2u) << "the default configuration's two CPU replicas";
    EXPECT_EQ(d[0].kind, DeviceKind::cpu);
    EXPECT_EQ(d[1].index, 1);
    EXPECT_EQ(devices_str(d), "cpu:2");
    std::string why;
    cuda_devices(&why);
    EXPECT_FALSE(why.empty()) << "no GPU must come with a reason";
    EXPECT_THROW(parse_devices("cuda:0"), ConfigError);
  } else {
    EXPECT_EQ(d.size(), gpus.size());
  }
}

TEST(Devices, HostInfo) {
  auto info = cpu_device_info(0);
  EXPECT_GT(info.total_memory, 0u);
  EXPECT_GE(host_core_count(), 1);
  auto s = make_stream({DeviceKind::cpu, 0});
  auto e = s->record();
  EXPECT_TRUE(e->done());
  s->wait(*e);
}

TEST(Devices, LauncherLocalRankFromTheEnvironment) {
  const char* vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "LOCAL_RANK"};
  for (const char* v : vars) unsetenv(v);
  EXPECT_EQ(launcher_local_rank(), 0) << "started plainly";
  setenv("SLURM_LOCALID", "3", 1);
  EXPECT_EQ(launcher_local_rank(), 3);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  EXPECT_EQ(launcher_local_rank(), 1) << "OpenMPI's variable first";
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "x", 1);
  EXPECT_THROW(launcher_local_rank(), ConfigError);
  for (const char* v : vars) unsetenv(v);
}
