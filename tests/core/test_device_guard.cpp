// DeviceGuard on a fake device API: the previous device comes back on scope exit (also on an
// exception), nested guards unwind in order, and a guard for the current device touches nothing.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "core/cuda/device_guard.h"

using replica::cuda::DeviceApi;
using replica::cuda::DeviceGuard;

namespace {
thread_local int g_current = 0;
thread_local std::vector<int> g_sets;
const DeviceApi kFake{[] { return g_current; }, [](int d) {
                        g_sets.push_back(d);
                        g_current = d;
                      }};
}  // namespace

TEST(DeviceGuard, RestoresTheCallersDevice) {
  g_current = 2;
  g_sets.clear();
  {
    DeviceGuard g(5, kFake);
    EXPECT_EQ(g_current, 5);
    EXPECT_EQ(g.previous(), 2);
    {
      DeviceGuard inner(1, kFake);
      EXPECT_EQ(g_current, 1);
    }
    EXPECT_EQ(g_current, 5) << "the inner guard puts back the outer one's device";
  }
  EXPECT_EQ(g_current, 2) << "the caller's device is back";
  EXPECT_EQ(g_sets, (std::vector<int>{5, 1, 5, 2}));
}

TEST(DeviceGuard, TheCurrentDeviceCostsNothingAndExceptionsRestore) {
  g_current = 3;
  g_sets.clear();
  { DeviceGuard same(3, kFake); }
  EXPECT_TRUE(g_sets.empty()) << "no set call for the device that is already current";
  try {
    DeviceGuard g(0, kFake);
    throw std::runtime_error("work on device 0 failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(g_current, 3) << "restored during unwinding";
}
