// Each layer of the memory stack alone, on a simulated upstream or a recording test double: the
// limit, the best-fit pool under both region policies, no-pool (platform), the statistics, trace
// and out-of-memory adaptors, the step plan, and stream ordering at the pool itself.
#include <gtest/gtest.h>

#include <map>
#include <thread>
#include <vector>

#include "core/alloc_trace.h"
#include "core/errors.h"
#include "core/memory/adaptors.h"
#include "core/memory/best_fit_pool.h"
#include "core/memory/direct_resource.h"
#include "core/memory/shared_host_memory.h"
#include "core/memory/step_plan_resource.h"
#include "support/queue_stream.h"

using namespace replica;
using replica::testing_support::QueueStream;

namespace {
constexpr size_t MiB = size_t(1) << 20;

AllocRequest req(size_t bytes, MemTag tag = MemTag::other, Stream* s = nullptr) {
  return {std::max<size_t>(256, (bytes + 255) & ~size_t(255)), bytes, tag, s};
}

// A resource that hands out fake addresses and remembers every call: the layer above is tested
// against exactly what reaches it.
class RecordingResource : public MemoryResource {
 public:
  Allocation allocate(const AllocRequest& r) override {
    calls.push_back("alloc " + std::to_string(r.size));
    if (fail_next) {
      fail_next = false;
      return {};
    }
    void* p = reinterpret_cast<void*>(next);
    next += r.size + 4096;
    live[p] = r.size;
    return {p, reinterpret_cast<void*>(++handles)};
  }
  void deallocate(const Allocation& a, const AllocRequest& r) override {
    calls.push_back("free " + std::to_string(r.size));
    EXPECT_EQ(live.at(a.ptr), r.size) << "the free carries the allocation's size";
    live.erase(a.ptr);
  }
  void record_stream(const Allocation&, Stream*) override { calls.push_back("record_stream"); }
  MemoryInfo info() const override {
    MemoryInfo m;
    m.capacity = 100 * MiB;
    m.headroom = 7 * MiB;
    m.largest_free = 3 * MiB;
    return m;
  }
  size_t release_unused() override { return 0; }
  void reset_peaks() override { calls.push_back("reset_peaks"); }
  std::vector<std::string> calls;
  std::map<void*, size_t> live;
  uintptr_t next = 1 << 20, handles = 0;
  bool fail_next = false;
};
}  // namespace

TEST(LimitedUpstream, RefusesPastItsLimitAndCountsEveryCall) {
  LimitedUpstream up(std::make_unique<SimulatedUpstream>(size_t(1) << 40), 10 * MiB);
  void* a = up.allocate(6 * MiB);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(up.available(), 4 * MiB);
  EXPECT_EQ(up.allocate(5 * MiB), nullptr) << "past the limit";
  void* b = up.allocate(4 * MiB);
  ASSERT_NE(b, nullptr);
  up.deallocate(a, 6 * MiB);
  EXPECT_EQ(up.outstanding(), 4 * MiB);
  EXPECT_EQ(up.peak_outstanding(), 10 * MiB);
  EXPECT_EQ(up.calls(), 3u);
  up.deallocate(b, 4 * MiB);
}

// What another process of an MPI job does with a shared region, done here with this process's own
// pid: it finds the region that holds a buffer, maps it through /proc, and sees the same memory.
TEST(SharedHostUpstream, ARegionIsFoundMappedElsewhereAndForgottenWhenGivenBack) {
  SharedHostUpstream up;
  const size_t bytes = (size_t(1) << 20) + 100;  // not a whole number of pages
  auto* p = static_cast<float*>(up.allocate(bytes));
  ASSERT_NE(p, nullptr);
  SharedRegion r;
  ASSERT_TRUE(find_shared_region(p + 1000, 4096, &r)) << "memfd_create is missing";
  EXPECT_EQ(r.base, reinterpret_cast<const char*>(p));
  EXPECT_EQ(r.bytes, (bytes + 4095) / 4096 * 4096);
  EXPECT_NE(r.id, 0u);
  EXPECT_FALSE(find_shared_region(p + r.bytes / 4 - 1, 8, nullptr)) << "runs past the region's end";
  float local = 0;
  EXPECT_FALSE(find_shared_region(&local, sizeof local, &r)) << "stack memory is not shared";
  auto* q = static_cast<float*>(map_peer_region(r.pid, r.fd, r.bytes));
  ASSERT_NE(q, nullptr);
  ASSERT_NE(q, p);
  p[12345] = 3.5f;
  EXPECT_EQ(q[12345], 3.5f) << "the second mapping sees the first one's writes";
  q[7] = -1.f;
  EXPECT_EQ(p[7], -1.f);
  unmap_peer_region(q, r.bytes);
  const uint64_t before = shared_regions_released();
  up.deallocate(p, bytes);
  EXPECT_EQ(shared_regions_released(), before + 1);
  EXPECT_FALSE(find_shared_region(p, 4, &r));
  EXPECT_EQ(map_peer_region(r.pid, 1 << 20, 4096), nullptr) << "no such descriptor: null, not a throw";
}

TEST(BestFitPool, PreallocateTakesEverythingOnceAndNeverAsksAgain) {
  LimitedUpstream up(std::make_unique<SimulatedUpstream>(size_t(1) << 40), 64 * MiB);
  BestFitPool pool(&up, std::make_unique<PreallocatePolicy>());
  EXPECT_FALSE(pool.first_region_failed());
  EXPECT_EQ(up.calls(), 1u);
  EXPECT_EQ(pool.info().reserved, 64 * MiB);
  std::vector<std::pair<Allocation, AllocRequest>> live;
  for (int i = 0; i < 8; ++i) {
    auto r = req(8 * MiB);
    live.push_back({pool.allocate(r), r});
    ASSERT_NE(live.back().first.ptr, nullptr);
  }
  EXPECT_EQ(pool.allocate(req(256)).ptr, nullptr) << "full, and preallocate does not grow";
  EXPECT_EQ(up.calls(), 1u);
  // free every other one: 32 MiB free in 8 MiB holes, largest 8 MiB, no growth possible
  for (size_t i = 0; i < live.size(); i += 2) pool.deallocate(live[i].first, live[i].second);
  MemoryInfo m = pool.info();
  EXPECT_EQ(m.free, 32 * MiB);
  EXPECT_EQ(m.headroom, 32 * MiB);
  EXPECT_EQ(m.largest_free, 8 * MiB);
  for (size_t i = 1; i < live.size(); i += 2) pool.deallocate(live[i].first, live[i].second);
  EXPECT_EQ(pool.info().largest_free, 64 * MiB) << "coalesced back to one block";
  EXPECT_EQ(pool.release_unused(), 0u) << "preallocate gives nothing back";
}

TEST(BestFitPool, APreallocationTheUpstreamRefusesIsReported) {
  LimitedUpstream up(std::make_unique<SimulatedUpstream>(size_t(1) << 30, 10 * MiB), 64 * MiB);
  BestFitPool pool(&up, std::make_unique<PreallocatePolicy>());
  EXPECT_TRUE(pool.first_region_failed());
  EXPECT_EQ(pool.first_region_size(), 64 * MiB);
}

TEST(BestFitPool, GrowthDoublesRegionsUpToTheLimitAndReleasesWholeOnes) {
  LimitedUpstream up(std::make_unique<SimulatedUpstream>(size_t(1) << 40), 100 * MiB);
  BestFitPool pool(&up, std::make_unique<GrowthPolicy>(2 * MiB));
  EXPECT_EQ(pool.info().reserved, 0u);
  auto r1 = req(MiB), r2 = req(3 * MiB), r3 = req(95 * MiB);
  Allocation a = pool.allocate(r1);  // region 1: 2 MiB
  EXPECT_EQ(pool.info().reserved, 2 * MiB);
  Allocation b = pool.allocate(r2);  // region 2: max(4 MiB, 3 MiB)
  EXPECT_EQ(pool.info().reserved, 6 * MiB);
  EXPECT_EQ(pool.info().headroom, 96 * MiB) << "the limit less what is in use";
  EXPECT_EQ(pool.allocate(r3).ptr, nullptr) << "a 95 MiB region would pass the 100 MiB limit";
  pool.deallocate(a, r1);
  EXPECT_EQ(pool.release_unused(), 2 * MiB) << "the first region is whole again";
  pool.deallocate(b, r2);
  EXPECT_EQ(pool.release_unused(), 4 * MiB);
  EXPECT_EQ(up.outstanding(), 0u);
}

// Size classes split each power of two of 256 B units into 16 steps, so 256..271 units are one
// class. Holes of 270 and 260 units share it with requests of 258 and 271: the 258 must take the
// 260 (the smallest that fits, not the first listed), and nothing may refuse a fit that only its
// own class holds.
TEST(BestFitPool, TheSmallestFitInTheRequestsOwnSizeClassIsFound) {
  constexpr size_t U = 256;
  const size_t sizes[] = {270 * U, 8 * U, 260 * U, 8 * U, 300 * U, 8 * U};
  size_t total = 0;
  for (size_t n : sizes) total += n;
  LimitedUpstream up(std::make_unique<SimulatedUpstream>(size_t(1) << 40), total);
  BestFitPool pool(&up, std::make_unique<PreallocatePolicy>());
  std::vector<std::pair<Allocation, AllocRequest>> blocks;
  for (size_t n : sizes) {
    blocks.push_back({pool.allocate(req(n)), req(n)});
    ASSERT_NE(blocks.back().first.ptr, nullptr);
  }
  ASSERT_EQ(pool.allocate(req(U)).ptr, nullptr) << "full";
  pool.deallocate(blocks[2].first, blocks[2].second);  // the 260 is freed first,
  pool.deallocate(blocks[0].first, blocks[0].second);  // so the 270 heads the class's list
  EXPECT_EQ(pool.info().largest_free, 270 * U);
  auto r258 = req(258 * U);
  Allocation a = pool.allocate(r258);
  EXPECT_EQ(a.ptr, blocks[2].first.ptr) << "best fit: the 260-unit hole, not the 270";
  auto r271 = req(271 * U);
  EXPECT_EQ(pool.allocate(r271).ptr, nullptr) << "the 270 hole is 1 unit short";
  auto r270 = req(270 * U);
  Allocation b = pool.allocate(r270);
  EXPECT_EQ(b.ptr, blocks[0].first.ptr) << "a fit only its own class holds";
  // A hole of a larger class fits whatever its size: the 300 takes 271 units, 29 stay free.
  pool.deallocate(blocks[4].first, blocks[4].second);
  Allocation c = pool.allocate(r271);
  EXPECT_EQ(c.ptr, blocks[4].first.ptr);
  EXPECT_EQ(pool.info().largest_free, 29 * U);
  for (auto* x : {&a, &b, &c}) pool.deallocate(*x, x == &a ? r258 : x == &b ? r270 : r271);
  for (int i : {1, 3, 5}) pool.deallocate(blocks[i].first, blocks[i].second);
  EXPECT_EQ(pool.info().largest_free, total) << "coalesced back to one block";
}

TEST(BestFitPool, AFreedBlockGoesToAnotherStreamOnlyAfterItsEvent) {
  LimitedUpstream up(std::make_unique<SimulatedUpstream>(size_t(1) << 40), 8 * MiB);
  BestFitPool pool(&up, std::make_unique<PreallocatePolicy>());
  QueueStream s1, s2;
  auto ra = req(6 * MiB, MemTag::activations, &s1);
  Allocation a = pool.allocate(ra);
  s1.launch();             // a kernel on s1 reads it
  pool.deallocate(a, ra);  // s1's queued work may still read it
  auto rb = req(MiB, MemTag::activations, &s2);
  Allocation b = pool.allocate(rb);
  // Only one 8 MiB block exists: taking it before s1's event would be a race, so the pool waits.
  EXPECT_EQ(s1.host_waits(), 1) << "handed to s2 without waiting for s1's event";
  pool.deallocate(b, rb);
  s2.run_all();
  EXPECT_EQ(pool.info().largest_free, 8 * MiB);
}

TEST(DirectResource, EveryAllocationIsAnUpstreamCall) {
  LimitedUpstream up(std::make_unique<SimulatedUpstream>(size_t(1) << 40), 4 * MiB);
  DirectResource d(&up);
  auto r = req(MiB);
  Allocation a = d.allocate(r), b = d.allocate(r);
  EXPECT_EQ(up.calls(), 2u);
  EXPECT_EQ(d.info().reserved, 2 * MiB);
  EXPECT_EQ(d.info().headroom, 2 * MiB);
  d.deallocate(a, r);
  EXPECT_EQ(up.outstanding(), MiB) << "returned at once, nothing cached";
  EXPECT_EQ(d.allocate(req(4 * MiB)).ptr, nullptr);
  d.deallocate(b, r);
}

TEST(StatisticsAdaptor, CountsByTagPeaksAndScopesButNotFailures) {
  RecordingResource below;
  StatisticsAdaptor stats(&below);
  auto rp = req(1000, MemTag::params), ra = req(5000, MemTag::activations);
  Allocation p = stats.allocate(rp);
  stats.push_scope();
  Allocation a = stats.allocate(ra);
  stats.deallocate(a, ra);
  const ScopeStats sc = stats.pop_scope();
  EXPECT_EQ(sc.peak_delta(), ra.size);
  EXPECT_EQ(sc.allocs, 1u);
  below.fail_next = true;
  EXPECT_EQ(stats.allocate(req(77)).ptr, nullptr);
  const UsageStats& u = stats.usage();
  EXPECT_EQ(u.in_use, rp.size);
  EXPECT_EQ(u.requested, 1000u);
  EXPECT_EQ(u.peak_in_use, rp.size + ra.size);
  EXPECT_EQ(u.allocs, 2u) << "a failed allocation is not counted";
  EXPECT_EQ(u.tags[int(MemTag::activations)].peak_in_use, ra.size);
  EXPECT_EQ(u.tags[int(MemTag::activations)].in_use, 0u);
  stats.reset_peaks();
  EXPECT_EQ(stats.usage().peak_in_use, rp.size);
  EXPECT_EQ(below.calls.back(), "reset_peaks") << "peaks below are reset too";
  stats.deallocate(p, rp);
  EXPECT_THROW(stats.pop_scope(), Error);
}

TEST(TraceAdaptor, RecordsRequestedBytesTagAndStep) {
  RecordingResource below;
  TraceAdaptor tr(&below);
  AllocTrace trace;
  tr.set_trace(&trace);
  tr.set_step(4);
  auto r = req(1000, MemTag::grads);
  Allocation a = tr.allocate(r);
  tr.deallocate(a, r);
  const auto ev = trace.events();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_TRUE(ev[0].alloc);
  EXPECT_EQ(ev[0].bytes, 1000u);
  EXPECT_EQ(ev[0].tag, MemTag::grads);
  EXPECT_EQ(ev[1].step, 4);
  EXPECT_EQ(ev[0].id, ev[1].id);
}

TEST(OomAdaptor, AFailureBelowBecomesAnErrorWithTheFactsAndTheAdvice) {
  RecordingResource below;
  StatisticsAdaptor stats(&below);
  PoolOptions o;
  o.bytes = 100 * MiB;
  OomAdaptor oom(&stats, &stats, Device{DeviceKind::cpu, 0}, o);
  auto rp = req(2 * MiB, MemTag::params);
  Allocation p = oom.allocate(rp);
  OomReport seen;
  oom.set_advice([&](const OomReport& r) {
    seen = r;
    return std::string("CHANGE X");
  });
  below.fail_next = true;
  try {
    oom.allocate(req(5 * MiB, MemTag::workspace));
    FAIL();
  } catch (const OutOfMemoryError& e) {
    const std::string m = e.what();
    for (const char* needle : {"5.00 MiB", "for workspace", "free 7.00 MiB", "largest free block 3.00 MiB",
                               "params 2.00 MiB", "not in one piece", "CHANGE X"})
      EXPECT_NE(m.find(needle), std::string::npos) << needle << " in " << m;
  }
  EXPECT_TRUE(seen.fragmented);
  EXPECT_EQ(seen.in_use, 2 * MiB);
  EXPECT_EQ(oom.ooms(), 1u);
  oom.deallocate(p, rp);
}

TEST(StepPlanResource, ServesTheRecordedStepFromOneArenaAndLeavesOtherThreadsBelow) {
  RecordingResource below;
  StepPlanResource plan(&below);
  auto r1 = req(MiB), r2 = req(2 * MiB), r3 = req(MiB);
  auto step = [&] {  // 1 and 2 overlap; 3 starts after 1 ends and can reuse its bytes
    Allocation a = plan.allocate(r1), b = plan.allocate(r2);
    plan.deallocate(a, r1);
    Allocation c = plan.allocate(r3);
    plan.deallocate(b, r2);
    plan.deallocate(c, r3);
    return std::vector<void*>{a.ptr, b.ptr, c.ptr};
  };
  plan.record_begin();
  step();
  AllocRequest failed;
  ASSERT_TRUE(plan.record_end(&failed));
  EXPECT_EQ(plan.stats().arena_bytes, 3 * MiB) << "packed to the peak of live bytes";
  EXPECT_EQ(plan.stats().recorded_peak, 3 * MiB);
  const size_t calls_before = below.calls.size();
  plan.step_begin();
  std::thread other([&] {  // another thread's allocation goes below, untouched by the plan
    auto r = req(12345);
    Allocation x = plan.allocate(r);
    plan.deallocate(x, r);
  });
  other.join();
  auto ptrs = step();
  plan.step_end();
  EXPECT_EQ(plan.stats().steps_served, 1);
  EXPECT_EQ(below.calls.size(), calls_before + 2) << "only the other thread's alloc and free reached below";
  EXPECT_EQ(ptrs[0], ptrs[2]) << "allocation 3 reuses allocation 1's bytes";
  plan.clear();
  EXPECT_TRUE(below.live.empty()) << "the arena went back";
}
