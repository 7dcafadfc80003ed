// GradientSync: bucket layout in reverse order with DDP's sizes, launch during backward, no_sync.
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "core/pools.h"
#include "parallel/gradient_sync.h"
#include "parallel/host/host_communicator.h"

using namespace replica;
using namespace replica::parallel;

TEST(GradientSync, BucketsCoverTheBufferInReverseOrder) {
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  // 40 slots of 64 Ki floats (256 KiB) each: 10 MiB in all
  std::vector<int64_t> offs;
  for (int i = 0; i < 40; ++i) offs.push_back(i * 65536);
  Tensor g = Tensor::zeros(*pool, {40 * 65536}, DType::f32, MemTag::grads);
  auto comms = make_host_communicators(1);
  GradientSync gs(offs, g, *comms[0], {.bucket_mb = 2.0, .first_bucket_mb = 1.0});
  auto& b = gs.buckets();
  ASSERT_GE(b.size(), 2u);
  EXPECT_EQ(b.front().hi, 40 * 65536) << "the first bucket holds the last parameters";
  EXPECT_EQ(b.front().slots, 4) << "first bucket 1 MiB = 4 slots of 256 KiB";
  EXPECT_EQ(b[1].slots, 8) << "then 2 MiB buckets";
  EXPECT_EQ(b.back().lo, 0);
  int slots = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    slots += b[i].slots;
    if (i) {
      EXPECT_EQ(b[i].hi, b[i - 1].lo) << "contiguous";
    }
  }
  EXPECT_EQ(slots, 40);
}

TEST(GradientSync, AveragesAcrossReplicasAndLaunchesDuringBackward) {
  const int world = 2;
  auto comms = make_host_communicators(world);
  std::vector<std::thread> ts;
  std::vector<int> early(world);
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto pool = make_pool({DeviceKind::cpu, r}, PoolOptions{});
      std::vector<int64_t> offs;
      for (int i = 0; i < 10; ++i) offs.push_back(i * 1000);
      Tensor g = Tensor::zeros(*pool, {10000}, DType::f32, MemTag::grads);
      GradientSync gs(offs, g, *comms[r], {.bucket_mb = 0.01, .first_bucket_mb = 0.01});
      // Every element has its own value, so a bucket reduced twice, skipped or written to the
      // wrong place shows up: value(i) = i % 97 + r, whose mean over the ranks is i % 97 + 0.5.
      auto value = [](int64_t i, int rank) { return static_cast<float>(i % 97 + rank); };
      // step 1: an accumulation micro-step, no sync
      gs.begin(false);
      for (int s = 9; s >= 0; --s) {
        for (int64_t i = s * 1000; i < (s + 1) * 1000; ++i) g.data<float>()[i] = value(i, r);
        gs.ready(s, 1);
      }
      gs.finish();
      int64_t local_wrong = 0;
      for (int64_t i = 0; i < 10000; ++i) local_wrong += g.data<float>()[i] != value(i, r);
      EXPECT_EQ(local_wrong, 0) << "no_sync leaves gradients local";
      // step 2: synchronised
      gs.begin(true);
      for (int s = 9; s >= 0; --s) gs.ready(s, 1);  // backward reports slots last to first
      gs.finish();
      early[r] = gs.launched_during_backward();
      int64_t wrong = 0, first_wrong = -1;
      for (int64_t i = 0; i < 10000; ++i)
        if (g.data<float>()[i] != static_cast<float>(i % 97) + 0.5f) {
          if (first_wrong < 0) first_wrong = i;
          wrong++;
        }
      EXPECT_EQ(wrong, 0) << "rank " << r << ": " << wrong << " averaged elements wrong, the first at " << first_wrong;
    });
  for (auto& t : ts) t.join();
  EXPECT_GT(early[0], 1) << "buckets start during backward, not all at finish()";
}

TEST(GradientSync, TheReducersInvariantsAreChecked) {
  auto comms = make_host_communicators(2);
  std::vector<std::thread> ts;
  std::vector<std::string> twice(2), range(2);
  std::vector<std::vector<int64_t>> order(2);
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      auto pool = make_pool({DeviceKind::cpu, r}, PoolOptions{});
      std::vector<int64_t> offs;
      for (int i = 0; i < 6; ++i) offs.push_back(i * 1000);
      Tensor g = Tensor::zeros(*pool, {6000}, DType::f32, MemTag::grads);
      // 8 KB buckets: one per two slots, slots 5-4 in bucket 0, 3-2 in bucket 1, 1-0 in bucket 2.
      GradientSync gs(offs, g, *comms[r], {.bucket_mb = 0.0076, .first_bucket_mb = 0.0076});
      ASSERT_EQ(gs.buckets().size(), 3u);
      gs.begin(true);
      // Bucket 2 completes first (a shortcut's gradient ready early): it must wait for 0 and 1.
      gs.ready(0, 2);
      EXPECT_FALSE(gs.buckets()[2].work) << "bucket 2 launched before buckets 0 and 1";
      gs.ready(4, 2);
      gs.ready(2, 2);
      gs.finish();
      for (auto& b : gs.buckets()) order[r].push_back(b.launched_ns);
      gs.begin(true);
      gs.ready(3, 1);
      try {
        gs.ready(3, 1);
      } catch (const Error& e) {
        twice[r] = e.what();
      }
      try {
        gs.ready(5, 2);
      } catch (const Error& e) {
        range[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(std::is_sorted(order[r].begin(), order[r].end())) << "buckets launch in index order";
    EXPECT_NE(twice[r].find("slot 3 reported ready twice"), std::string::npos) << twice[r];
    EXPECT_NE(range[r].find("there are 6 slots"), std::string::npos) << range[r];
  }
}

TEST(GradientSync, BucketSizesCountTheWireBytes) {
  auto comms = make_host_communicators(1);
  auto pool = make_pool({DeviceKind::cpu, 0}, PoolOptions{});
  std::vector<int64_t> offs;
  for (int i = 0; i < 8; ++i) offs.push_back(i * 1024);
  Tensor g = Tensor::zeros(*pool, {8192}, DType::f32, MemTag::grads);
  // 8 KiB buckets: 2 slots of 1024 f32 elements each, or 4 slots on a 16-bit wire.
  GradientSync f32(offs, g, *comms[0], {.bucket_mb = 8.0 / 1024, .first_bucket_mb = 8.0 / 1024});
  GradientSync f16(offs, g, *comms[0],
                   {.bucket_mb = 8.0 / 1024, .first_bucket_mb = 8.0 / 1024, .wire = DType::f16, .staging_pool = pool.get()});
  EXPECT_EQ(f32.buckets().size(), 4u);
  EXPECT_EQ(f16.buckets().size(), 2u);
}

TEST(GradientSync, DivergedReplicasAreAnErrorNamingTheRank) {
  const int world = 3;
  auto comms = make_host_communicators(world);
  std::vector<std::thread> ts;
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto pool = make_pool({DeviceKind::cpu, r}, PoolOptions{});
      Tensor p = Tensor::zeros(*pool, {1000}, DType::f32, MemTag::params);
      check_replicas_agree(*comms[r], p, 7);  // identical: fine
      if (r == 2) p.data<float>()[500] = 1e-30f;  // one replica drifts by one value
      try {
        check_replicas_agree(*comms[r], p, 8);
      } catch (const TrainingError& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) {
    EXPECT_NE(errors[r].find("diverged at step 8"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("rank(s) 2"), std::string::npos) << errors[r];
  }
}

TEST(GradientSync, SixteenBitWireGoesThroughTheGivenCast) {
  // A GPU replica hands GradientSync its backend's cast; the host conversion is the default.
  const int world = 2;
  auto comms = make_host_communicators(world);
  std::vector<std::thread> ts;
  std::vector<int> casts(world);
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto pool = make_pool({DeviceKind::cpu, r}, PoolOptions{});
      std::vector<int64_t> offs{0, 500};
      Tensor g = Tensor::zeros(*pool, {1000}, DType::f32, MemTag::grads);
      // 0.0009 MiB (943 B) buckets: each 500-element slot is its own bucket on the 16-bit wire (1000 B).
      BucketOptions o{.bucket_mb = 0.0009, .first_bucket_mb = 0.0009, .wire = DType::bf16, .staging_pool = pool.get()};
      o.cast = [&, r](const Tensor& a, const Tensor& b) {
        casts[r]++;
        convert(a.raw(), a.dtype(), b.raw(), b.dtype(), static_cast<size_t>(a.numel()));
      };
      GradientSync gs(offs, g, *comms[r], o);
      std::fill_n(g.data<float>(), 1000, r == 0 ? 1.f : 2.f);
      gs.begin(true);
      gs.ready(1, 1);
      gs.ready(0, 1);
      gs.finish();
      EXPECT_EQ(g.data<float>()[0], 1.5f);
      EXPECT_EQ(g.data<float>()[999], 1.5f);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(casts[0], 4) << "2 buckets, one cast each way";
  EXPECT_EQ(casts[1], 4);
}

TEST(GradientSync, HostCollectivesPassStraightThroughAHostCommunicator) {
  const int world = 2;
  auto comms = make_host_communicators(world);
  std::vector<std::thread> ts;
  std::vector<std::vector<float>> gathered(world);
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      EXPECT_FALSE(comms[r]->device_buffers());
      float v[2] = {static_cast<float>(r), 10.f};
      all_reduce_host(*comms[r], nullptr, v, 2, ReduceOp::sum);  // no pool needed on the host
      EXPECT_EQ(v[0], 1.f);
      EXPECT_EQ(v[1], 20.f);
      gathered[r].resize(4);
      all_gather_host(*comms[r], nullptr, v, gathered[r].data(), 2);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(gathered[1], (std::vector<float>{1.f, 20.f, 1.f, 20.f}));
}

// After the first synchronised pass the buckets follow the order slots became ready (a shortcut
// whose gradient is ready after its main path's). Rank 0's order wins on every rank; buckets whose
// slots are not neighbours in memory travel packed, and the averages stay exact (f32 and f16).
TEST(GradientSync, BucketsAreRebuiltFromTheObservedReadinessOrder) {
  for (DType wire : {DType::f32, DType::f16}) {
    auto comms = make_host_communicators(2);
    std::vector<std::thread> ts;
    std::vector<std::vector<std::pair<int64_t, int64_t>>> first_ranges(2);
    std::vector<int> rebuilds(2), launched_after_two(2);
    std::vector<int64_t> wrong(2);
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        auto pool = make_pool({DeviceKind::cpu, r}, PoolOptions{});
        std::vector<int64_t> offs;
        for (int i = 0; i < 6; ++i) offs.push_back(i * 1000);
        Tensor g = Tensor::zeros(*pool, {6000}, DType::f32, MemTag::grads);
        const double mb = (wire == DType::f32 ? 8000.0 : 4000.0) / 1048576 * 0.95;  // two slots per bucket
        GradientSync gs(offs, g, *comms[r], {.bucket_mb = mb, .first_bucket_mb = mb, .wire = wire,
                                             .staging_pool = pool.get()});
        EXPECT_EQ(gs.buckets().size(), 3u);
        // Rank 0 sees 5, 3, 4, 2, 1, 0; rank 1 another order, which must not matter.
        const std::vector<int> seen = r == 0 ? std::vector<int>{5, 3, 4, 2, 1, 0} : std::vector<int>{4, 5, 2, 3, 0, 1};
        gs.begin(true);
        for (int s : seen) gs.ready(s, 1);
        gs.finish();
        EXPECT_EQ(gs.rebuilds(), 0) << "the step's own buckets stay until the next begin()";
        // Values exactly representable in f16: i % 61 + rank, mean i % 61 + 0.5.
        for (int64_t i = 0; i < 6000; ++i) g.data<float>()[i] = static_cast<float>(i % 61 + r);
        gs.begin(true);
        rebuilds[r] = gs.rebuilds();
        first_ranges[r] = gs.buckets()[0].ranges;
        gs.ready(5, 1);
        gs.ready(3, 1);
        launched_after_two[r] = gs.buckets()[0].work != nullptr;
        for (int s : {4, 2, 1, 0}) gs.ready(s, 1);
        gs.finish();
        for (int64_t i = 0; i < 6000; ++i) wrong[r] += g.data<float>()[i] != static_cast<float>(i % 61) + 0.5f;
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE(std::string(dtype_name(wire)) + " rank " + std::to_string(r));
      EXPECT_EQ(rebuilds[r], 1);
      const std::vector<std::pair<int64_t, int64_t>> want{{3000, 4000}, {5000, 6000}};
      EXPECT_EQ(first_ranges[r], want) << "bucket 0 holds slots 5 and 3, rank 0's order";
      EXPECT_TRUE(launched_after_two[r]) << "bucket 0 launches as soon as slots 5 and 3 are ready";
      EXPECT_EQ(wrong[r], 0) << "packed buckets average every element";
    }
  }
}

// train.cuda_graph captures a step only once the bucket layout is final (a re-cut broadcasts on
// the host): settled after the re-cut that follows the first full pass; where no pass reports
// every slot there is no order to re-cut by, and keep_layout() ends the watch with the buckets
// as they are (no re-cut, no broadcast), the averages unchanged.
TEST(GradientSync, TheLayoutSettlesAfterTheRecutOrWhenKeptAsItIs) {
  for (const bool every_slot : {true, false}) {
    auto comms = make_host_communicators(2);
    std::vector<std::thread> ts;
    std::vector<std::vector<int>> settled(2);
    std::vector<int> rebuilds(2, -1);
    std::vector<int64_t> wrong(2);
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        auto pool = make_pool({DeviceKind::cpu, r}, PoolOptions{});
        std::vector<int64_t> offs{0, 1000, 2000, 3000};
        Tensor g = Tensor::zeros(*pool, {4000}, DType::f32, MemTag::grads);
        GradientSync gs(offs, g, *comms[r], {.bucket_mb = 0.0076, .first_bucket_mb = 0.0076});
        for (int pass = 0; pass < 3; ++pass) {
          settled[r].push_back(gs.settled());
          for (int64_t i = 0; i < 4000; ++i) g.data<float>()[i] = static_cast<float>(i % 7 + r);
          gs.begin(true);
          for (int s : every_slot ? std::vector<int>{3, 1, 2, 0} : std::vector<int>{3, 2}) gs.ready(s, 1);
          gs.finish();
          if (!every_slot && pass == 1) gs.keep_layout();
        }
        settled[r].push_back(gs.settled());
        rebuilds[r] = gs.rebuilds();
        for (int64_t i = 0; i < 4000; ++i) wrong[r] += g.data<float>()[i] != static_cast<float>(i % 7) + 0.5f;
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE(std::string(every_slot ? "every slot reported" : "slots 0 and 1 never reported") + ", rank " +
                   std::to_string(r));
      // Before each of the 3 passes, and after them: settled from the third pass either way.
      EXPECT_EQ(settled[r], (std::vector<int>{0, 0, 1, 1}));
      EXPECT_EQ(rebuilds[r], every_slot ? 1 : 0) << "slots 3, 1 | 2, 0: a re-cut; kept: none";
      EXPECT_EQ(wrong[r], 0);
    }
  }
}

TEST(GradientSync, RebuildCanBeTurnedOff) {
  auto comms = make_host_communicators(2);
  std::vector<std::thread> ts;
  std::vector<int> rebuilds(2, -1);
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      auto pool = make_pool({DeviceKind::cpu, r}, PoolOptions{});
      std::vector<int64_t> offs{0, 1000, 2000, 3000};
      Tensor g = Tensor::zeros(*pool, {4000}, DType::f32, MemTag::grads);
      GradientSync gs(offs, g, *comms[r], {.bucket_mb = 0.0076, .first_bucket_mb = 0.0076, .rebuild = false});
      for (int pass = 0; pass < 2; ++pass) {
        gs.begin(true);
        for (int s : {2, 3, 0, 1}) gs.ready(s, 1);
        gs.finish();
      }
      rebuilds[r] = gs.rebuilds();
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(rebuilds[0], 0);
  EXPECT_EQ(rebuilds[1], 0);
}

TEST(GradientSync, ReleaseModeKeepsTheShardAloneAndGivesEveryBucketBack) {
  // ZeRO-2's release on 3 ranks with uneven shards cut inside slots: buckets take zeroed storage
  // as slots are prepared, keep it across an accumulation micro-step, and after the synchronised
  // one each rank holds its shard of the average and nothing else (the slots unbound).
  const int world = 3;
  const std::vector<int64_t> shard = {0, 3500, 7000, 10000};
  auto comms = make_host_communicators(world);
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto pool = make_pool({DeviceKind::cpu, r}, PoolOptions{});
      std::vector<int64_t> offs;
      for (int i = 0; i < 10; ++i) offs.push_back(i * 1000);
      const int64_t lo = shard[r], hi = shard[r + 1];
      Tensor mine = Tensor::zeros(*pool, {hi - lo}, DType::f32, MemTag::grads);
      std::vector<Tensor> bound(10);
      BucketOptions o{.bucket_mb = 0.01, .first_bucket_mb = 0.01, .rebuild = false};
      o.shard = shard;
      o.release = true;
      o.bind = [&](int slot, const Tensor& t) { bound[static_cast<size_t>(slot)] = t; };
      GradientSync gs(offs, mine, *comms[r], o);
      ASSERT_GT(gs.buckets().size(), 2u);
      EXPECT_EQ(gs.held_elements(), 0);
      auto value = [](int64_t i, int rank) { return static_cast<float>(i % 97 + rank); };
      auto backward = [&](bool sync) {
        gs.begin(sync);
        for (int s = 9; s >= 0; --s) {
          gs.prepare(s, 1);
          ASSERT_TRUE(bound[s].defined()) << "slot " << s << " bound before backward writes it";
          ASSERT_EQ(bound[s].numel(), 1000);
          for (int64_t i = 0; i < 1000; ++i) bound[s].data<float>()[i] += value(s * 1000 + i, r);
          gs.ready(s, 1);
        }
        gs.finish();
      };
      backward(false);
      EXPECT_EQ(gs.held_elements(), 10000) << "an accumulation micro-step keeps every bucket";
      backward(true);
      EXPECT_EQ(gs.held_elements(), 0) << "every bucket given back";
      for (int s = 0; s < 10; ++s) EXPECT_FALSE(bound[s].defined()) << "slot " << s << " still bound";
      int64_t wrong = 0;
      for (int64_t i = lo; i < hi; ++i)  // mean over ranks of two micro-steps: 2 (i % 97) + 2
        wrong += mine.data<float>()[i - lo] != static_cast<float>(2 * (i % 97) + 2);
      EXPECT_EQ(wrong, 0) << "rank " << r << ": shard elements wrong";
      const size_t kept = pool->stats().tags[static_cast<int>(MemTag::grads)].in_use;
      EXPECT_GE(kept, static_cast<size_t>(hi - lo) * 4);
      EXPECT_LE(kept, static_cast<size_t>(hi - lo) * 4 + 1024) << "only the shard (and its alignment) is left";
    });
  for (auto& t : ts) t.join();
}
