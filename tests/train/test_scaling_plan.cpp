// `replica plan`'s model: the step walk on synthetic profiles whose answers are worked out by
// hand (fully hidden, fully exposed, one bucket late, accumulation, shared CPU cores), the
// collective formulas, the link fit, the profile file, a measured profile, and the named errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "core/errors.h"
#include "core/file_io.h"
#include "parallel/link_model.h"
#include "train/config.h"
#include "train/scaling_plan.h"
#include "train/step_profile.h"
#include "train/trainer.h"

using namespace replica;
using namespace replica::train;

namespace {
constexpr double kMiB = 1048576.0;

// micro-batch 10: forward 1 s, backward 2 s, optimizer 0.5 s; slots of 1 MiB in f32 (262,144
// elements), ready at the given seconds into backward; `tiny` adds a last 1-element slot ready at
// the end of backward.
StepProfile profile(const std::vector<double>& ready, bool tiny = false) {
  StepProfile p;
  p.model = "synthetic";
  p.device = "by hand";
  p.micro_batch = 10;
  p.forward_s = 1;
  p.backward_s = 2;
  p.optimizer_s = 0.5;
  for (double t : ready) p.slot_elements.push_back(262144), p.slot_ready_s.push_back(t);
  if (tiny) p.slot_elements.push_back(1), p.slot_ready_s.push_back(2.0);
  p.steps = 1;
  return p;
}

// A link on which one 1 MiB bucket between 2 ranks takes `bucket_s` (ring: bytes / bandwidth).
PlanTarget two_devices(double bucket_s) {
  PlanTarget t;
  t.per_node = 2;
  t.intra = {"test", 0.0, kMiB / bucket_s, "by hand"};
  return t;
}

PlanOptions options(int64_t global_batch = 20) {
  PlanOptions o;
  o.global_batch = global_batch;
  o.bucket_mb = 1;
  o.first_bucket_mb = 1;
  return o;
}
}  // namespace

TEST(ScalingPlan, OneDeviceIsTheProfile) {
  PlanTarget t = two_devices(1);
  t.per_node = 1;
  const PlanResult r = plan_step(profile({0.5, 1.0, 1.5, 2.0}), t, options(10));
  EXPECT_DOUBLE_EQ(r.step_s, 3.5);
  EXPECT_DOUBLE_EQ(r.comm_s, 0);
  EXPECT_DOUBLE_EQ(r.images_per_s, 10 / 3.5);
  EXPECT_DOUBLE_EQ(r.efficiency, 1);
  EXPECT_EQ(r.buckets.size(), 4u);
}

TEST(ScalingPlan, AllReducesHiddenBehindBackward) {
  // Buckets ready at 0.5, 1.0, 1.5 s take 0.25 s each and end before the next is ready; the
  // last bucket holds one element.
  const PlanResult r = plan_step(profile({0.5, 1.0, 1.5}, true), two_devices(0.25), options());
  ASSERT_EQ(r.buckets.size(), 4u);
  EXPECT_DOUBLE_EQ(r.buckets[1].start_s, 1.0);
  EXPECT_DOUBLE_EQ(r.buckets[1].end_s, 1.25);
  EXPECT_NEAR(r.comm_s, 0.75, 1e-6);
  EXPECT_NEAR(r.exposed_s, 0.0, 1e-6);
  EXPECT_NEAR(r.step_s, 3.5, 1e-6);
  EXPECT_NEAR(r.efficiency, 1.0, 1e-6);
  EXPECT_EQ(r.algorithm, "ring");
}

TEST(ScalingPlan, AllReducesFullyExposedWhenEveryGradientIsReadyAtTheEnd) {
  const PlanResult r = plan_step(profile({2.0, 2.0, 2.0, 2.0}), two_devices(0.25), options());
  EXPECT_NEAR(r.comm_s, 1.0, 1e-12);
  EXPECT_NEAR(r.exposed_s, 1.0, 1e-12);
  EXPECT_NEAR(r.step_s, 4.5, 1e-12);
  EXPECT_NEAR(r.efficiency, 3.5 / 4.5, 1e-12);
}

TEST(ScalingPlan, OneBucketLateIsExposedAndAQueueBuildsBehindASlowLink) {
  // Evenly ready: only the last bucket's 0.25 s outlasts backward.
  const PlanResult late = plan_step(profile({0.5, 1.0, 1.5, 2.0}), two_devices(0.25), options());
  EXPECT_NEAR(late.exposed_s, 0.25, 1e-12);
  EXPECT_NEAR(late.step_s, 3.75, 1e-12);
  // 1 s per bucket: they queue (0.5-1.5, 1.5-2.5, 2.5-3.5, 3.5-4.5): 2.5 s after backward.
  const PlanResult slow = plan_step(profile({0.5, 1.0, 1.5, 2.0}), two_devices(1.0), options());
  EXPECT_NEAR(slow.buckets[3].start_s, 3.5, 1e-12);
  EXPECT_NEAR(slow.exposed_s, 2.5, 1e-12);
  EXPECT_NEAR(slow.step_s, 6.0, 1e-12);
}

TEST(ScalingPlan, BucketsAreCutInReadinessOrderAndWireBytesCount) {
  // Registered 0..3 but ready 3, 2, 1, 0 (and 1 MiB each): with 2 MiB buckets two buckets of two
  // slots; a 16-bit wire halves the bytes, so 2 MiB holds all four.
  PlanOptions o = options();
  o.bucket_mb = 2;
  o.first_bucket_mb = 2;
  const PlanResult f32 = plan_step(profile({2.0, 1.5, 1.0, 0.5}), two_devices(0.25), o);
  ASSERT_EQ(f32.buckets.size(), 2u);
  EXPECT_DOUBLE_EQ(f32.buckets[0].ready_s, 1.0);
  EXPECT_DOUBLE_EQ(f32.buckets[0].bytes, 2 * kMiB);
  o.wire_bytes = 2;
  const PlanResult f16 = plan_step(profile({2.0, 1.5, 1.0, 0.5}), two_devices(0.25), o);
  ASSERT_EQ(f16.buckets.size(), 1u);
  EXPECT_DOUBLE_EQ(f16.buckets[0].bytes, 2 * kMiB);
}

TEST(ScalingPlan, AccumulationWhenTheShareDoesNotFit) {
  // Global 40 on 2 devices is 20 each; at most 10 fit: 2 micro-steps, only the last overlapped.
  PlanOptions o = options(40);
  o.max_micro_batch = 10;
  const PlanResult r = plan_step(profile({0.5, 1.0, 1.5, 2.0}), two_devices(0.25), o);
  EXPECT_EQ(r.micro_batch, 10);
  EXPECT_EQ(r.accumulation, 2);
  EXPECT_NEAR(r.step_s, 2 * 3.0 + 0.25 + 0.5, 1e-12);
  // A micro-batch of 7 would not divide 20: 5 is the largest that fits and divides.
  o.max_micro_batch = 7;
  EXPECT_EQ(plan_step(profile({2.0}), two_devices(0.25), o).micro_batch, 5);
}

TEST(ScalingPlan, CpuReplicasSharingCoresStretchComputeAndExposeTheirAllReduce) {
  PlanOptions o = options(30);
  o.cpu_cores_per_node = 2;
  o.process_per_replica = true;  // MPI: pinned by node slot, round-robin
  PlanTarget t = two_devices(0.25);
  t.per_node = 3;  // three pinned replicas on two cores: one core runs two
  const PlanResult r = plan_step(profile({0.5, 1.0, 1.5, 2.0}), t, o);
  EXPECT_DOUBLE_EQ(r.forward_s, 2.0);
  EXPECT_DOUBLE_EQ(r.backward_s, 4.0);
  // Ring over 3: 2 (2/3) bytes / bandwidth = 4/3 x 0.25 s per bucket, none of it hidden.
  EXPECT_NEAR(r.comm_s, 4 * 0.25 * 4.0 / 3.0, 1e-12);
  EXPECT_NEAR(r.exposed_s, r.comm_s, 1e-12);
  EXPECT_NEAR(r.step_s, 2 + 4 + r.comm_s + 1.0, 1e-12);
  o.process_per_replica = false;  // one process's threads, unpinned beyond the cores: 1.5x
  EXPECT_DOUBLE_EQ(plan_step(profile({2.0}), t, o).forward_s, 1.5);
}

TEST(ScalingPlan, TheSlowestReplicaSetsThePace) {
  // E[max of n standard normals]: 1/sqrt(pi) for 2; 1.0294 for 4 and 1.4236 for 8 (tables).
  EXPECT_EQ(expected_max_of_normals(1), 0);
  EXPECT_NEAR(expected_max_of_normals(2), 1 / std::sqrt(M_PI), 1e-6);
  EXPECT_NEAR(expected_max_of_normals(4), 1.0294, 1e-4);
  EXPECT_NEAR(expected_max_of_normals(8), 1.4236, 1e-4);
  StepProfile p = profile({0.5, 1.0}, true);
  p.compute_sd_s = 0.1;
  const PlanResult r = plan_step(p, two_devices(0.001), options());
  EXPECT_NEAR(r.straggler_s, 0.1 * expected_max_of_normals(2), 1e-12);
  EXPECT_NEAR(r.step_s, 3.5 + r.straggler_s + r.exposed_s, 1e-12);
  PlanTarget one = two_devices(0.001);
  one.per_node = 1;
  EXPECT_EQ(plan_step(p, one, options()).straggler_s, 0) << "one replica waits for nobody";
}

TEST(ScalingPlan, HostWorkIsAddedOncePerStepAndStretchedOnSharedCores) {
  StepProfile p = profile({0.5, 1.0}, true);
  p.host_s = 0.2;
  PlanTarget one = two_devices(0.001);
  one.per_node = 1;
  PlanOptions o = options(10);
  EXPECT_NEAR(plan_step(p, one, o).step_s, 3.5 + 0.2, 1e-12);
  o.global_batch = 20;
  o.max_micro_batch = 5;  // 4 micro-steps of 5: the host work is still once per step
  EXPECT_NEAR(plan_step(p, one, o).step_s, 4 * 1.5 + 0.5 + 0.2, 1e-12);
  PlanTarget three = two_devices(1e-9);
  three.per_node = 3;
  PlanOptions shared = options(30);
  shared.cpu_cores_per_node = 1;  // three replicas on one core: everything 3x
  EXPECT_NEAR(plan_step(p, three, shared).host_s, 0.6, 1e-12);
}

TEST(ScalingPlan, ChoosesTheBucketSize) {
  // 16 slots of 1 MiB ready evenly over backward. With no latency, small buckets follow backward
  // closely (exposed: the last bucket only); at 1 s per collective 16 buckets queue for 16 s, and
  // two (the first 1 MiB, then the rest) are best.
  std::vector<double> ready;
  for (int i = 1; i <= 16; ++i) ready.push_back(2.0 * i / 16);
  PlanOptions o = options();
  o.choose_bucket = true;
  o.bucket_mb = 25;
  PlanTarget fast = two_devices(0.02);
  const PlanResult small = plan_step(profile(ready), fast, o);
  EXPECT_EQ(small.bucket_mb, 1) << "no latency: the smallest buckets";
  EXPECT_LE(small.step_s, plan_step(profile(ready), fast, options()).step_s + 1e-12);
  PlanTarget slow = fast;
  slow.intra.alpha_s = 0.5;  // 2 hops for 2 ranks: 1 s per collective
  const PlanResult big = plan_step(profile(ready), slow, o);
  EXPECT_GE(big.bucket_mb, 25) << "high latency: few buckets";
  EXPECT_LT(big.buckets.size(), 4u);
  PlanTarget one = fast;
  one.per_node = 1;
  EXPECT_EQ(plan_step(profile(ready), one, o).bucket_mb, 25) << "one device: nothing to choose";
}

TEST(ScalingPlan, TimeAndCostToTheEpochs) {
  PlanOptions o = options();
  o.epochs = 2;
  o.dataset_images = 3600 * 20;
  o.cost_per_device_hour = 3;
  const PlanResult r = plan_step(profile({2.0, 2.0, 2.0, 2.0}), two_devices(0.25), o);  // 4.5 s per 20 images
  EXPECT_NEAR(r.hours, 2 * 4.5, 1e-9);
  EXPECT_NEAR(r.cost, 2 * 4.5 * 2 * 3, 1e-9);
}

TEST(LinkModel, RingTreeAndHierarchicalByHand) {
  const parallel::Link l{"x", 1e-6, 1e9, ""};
  // Ring over 4: 6 alpha + 1.5 bytes / bandwidth; tree: 2 log2(4) alpha + 2 bytes / bandwidth.
  EXPECT_NEAR(parallel::ring_all_reduce(1e6, 4, l).seconds, 6e-6 + 1.5e-3, 1e-15);
  EXPECT_NEAR(parallel::tree_all_reduce(1e6, 4, l).seconds, 4e-6 + 2e-3, 1e-15);
  EXPECT_EQ(parallel::all_reduce(1e6, 1, 4, l, l).algorithm, "ring");  // large: ring's bandwidth
  EXPECT_EQ(parallel::all_reduce(8, 1, 1024, l, l).algorithm, "tree");  // small, many ranks: tree's latency
  // 2 nodes x 4: inside 2 (3 alpha + 3/4 n / B_intra); across, n/4 over 2 nodes, the NIC shared
  // by 4 (B_inter / 4): ring 2 alpha + (n/4) / (B_inter / 4).
  const parallel::Link fast{"in", 1e-6, 100e9, ""}, nic{"out", 5e-6, 10e9, ""};
  const double n = 1e8;
  const double inside = 2 * (3e-6 + 0.75 * n / 100e9);
  const double across = std::min(2 * 5e-6 + (n / 4) / (10e9 / 4), 2 * 5e-6 + 2 * (n / 4) / (10e9 / 4));
  const parallel::Collective h = parallel::all_reduce(n, 2, 4, fast, nic);
  EXPECT_NEAR(h.seconds, inside + across, 1e-12);
  EXPECT_EQ(h.algorithm, "hierarchical(ring)");
  // One NIC per device: the share is the whole port.
  EXPECT_NEAR(parallel::all_reduce(n, 2, 4, fast, nic, 4).seconds, inside + 2 * 5e-6 + (n / 4) / 10e9, 1e-12);
}

TEST(LinkModel, FitRecoversAlphaAndBandwidthFromBenchOutput) {
  const double alpha = 3e-6, bw = 5e9;
  std::string text = "# replica bench allreduce: 2 ranks (cpu:2 per process), host communicator, f32 sum\n"
                     "#     size(B)        count   time(us)  algbw(GB/s)  busbw(GB/s)   #wrong   memcpy(GB/s)\n";
  for (double bytes = 1024; bytes <= 64 * kMiB; bytes *= 4) {
    double t = 2 * alpha + bytes / bw;  // ring over 2
    if (bytes == 4096) t *= 20;         // a stall: dropped by the refit
    char line[200];
    std::snprintf(line, sizeof line, " %12.0f %12.0f %10.3f %12.2f %12.2f %8d %14.2f\n", bytes, bytes / 4, t * 1e6, 1.0, 1.0, 0, 10.0);
    text += line;
  }
  const parallel::Link l = parallel::fit_link(text, "bench.txt");
  EXPECT_NEAR(l.bandwidth / bw, 1.0, 0.01);
  EXPECT_NEAR(l.alpha_s / alpha, 1.0, 0.05);
  EXPECT_NE(l.about.find("8 of 9 sizes"), std::string::npos) << l.about;
  EXPECT_EQ(l.name, "host");
  EXPECT_THROW(parallel::fit_link("# replica bench allreduce: 1 ranks\n 1024 256 1.0\n", "one.txt"), ConfigError);
  EXPECT_THROW(parallel::fit_link("hello", "junk.txt"), ConfigError);
}

TEST(ScalingPlan, BadInputIsNamed) {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message([] { parallel::find_link("nvlink9"); }).find("nvlink4"), std::string::npos) << "lists the kinds";
  EXPECT_NE(message([] { parallel::find_link("host"); }).find("replica bench allreduce"), std::string::npos);
  PlanTarget three = two_devices(1);
  three.per_node = 3;
  EXPECT_NE(message([&] { plan_step(profile({2.0}), three, options(20)); }).find("do not divide train.global_batch 20"),
            std::string::npos);
  EXPECT_NE(message([] { parse_device_counts("4,x8"); }).find("'x8'"), std::string::npos);
  EXPECT_NE(message([] { parse_device_counts("0"); }).find("positive"), std::string::npos);
  const auto counts = parse_device_counts("1,2x8");
  ASSERT_EQ(counts.size(), 2u);
  EXPECT_EQ(counts[1], std::make_pair(2, 8));
}

TEST(StepProfile, FileRoundTripAndDamageIsNamed) {
  const StepProfile p = profile({0.5, 1.0}, true);
  const StepProfile back = StepProfile::from_json(p.json(), "p.json");
  EXPECT_EQ(back.model, p.model);
  EXPECT_EQ(back.slot_elements, p.slot_elements);
  EXPECT_EQ(back.slot_ready_s, p.slot_ready_s);
  EXPECT_EQ(back.forward_s, p.forward_s);
  EXPECT_THROW(StepProfile::from_json("{}", "p.json"), ConfigError);
  EXPECT_THROW(StepProfile::from_json("{\"kind\":", "p.json"), ConfigError);
  EXPECT_THROW(StepProfile::from_json(R"({"kind":"replica step profile","version":2})", "p.json"), ConfigError);
  // Halving the micro-batch halves compute and the ready times, not the optimizer.
  const StepProfile half = p.at_micro_batch(5);
  EXPECT_DOUBLE_EQ(half.backward_s, 1.0);
  EXPECT_DOUBLE_EQ(half.slot_ready_s[1], 0.5);
  EXPECT_DOUBLE_EQ(half.optimizer_s, 0.5);
  // Rescaled to 5 img/s at micro-batch 10: 2 s per step instead of 3.5, in the same proportions.
  StepProfile noisy = p;
  noisy.compute_sd_s = 0.3;
  const StepProfile fast = noisy.scaled_to(5);
  EXPECT_NEAR(fast.forward_s + fast.backward_s + fast.optimizer_s, 2.0, 1e-12);
  EXPECT_NEAR(fast.slot_ready_s[1], 1.0 * 2.0 / 3.5, 1e-12);
  EXPECT_EQ(fast.compute_sd_s, 0) << "the measured machine's spread is not carried to another device";
  EXPECT_NE(fast.device.find("scaled to 5 img/s"), std::string::npos) << fast.device;
}

TEST(StepProfile, MeasuredProfileHasEverySlotReadyWithinBackward) {
  const RunConfig cfg = parse_config("", "test",
                                     {"model.width=4", "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]",
                                      "data.synthetic_size=64", "data.mean=[0.5]", "data.std=[0.25]",
                                      "parallel.devices=cpu:1"});
  const StepProfile p = measure_step_profile(cfg, 8, 2);
  EXPECT_EQ(p.model, profile_model_key(cfg));
  EXPECT_EQ(p.micro_batch, 8);
  EXPECT_GT(p.forward_s, 0);
  EXPECT_GT(p.backward_s, 0);
  EXPECT_GE(p.host_s, 0) << "the finite check and norm pass";
  EXPECT_LT(p.host_s, p.backward_s) << "one pass over the gradients, not a backward";
  ASSERT_FALSE(p.slot_elements.empty());
  double last = 0;
  for (size_t s = 0; s < p.slot_elements.size(); ++s) {
    EXPECT_GT(p.slot_elements[s], 0);
    EXPECT_GT(p.slot_ready_s[s], 0) << "slot " << s << " never reported ready";
    EXPECT_LE(p.slot_ready_s[s], p.backward_s);
    last = std::max(last, p.slot_ready_s[s]);
  }
  // The classifier (registered last) is final before the stem (registered first).
  EXPECT_LT(p.slot_ready_s.back(), p.slot_ready_s.front());
  EXPECT_GT(last, 0.5 * p.backward_s);
}

// A run's trace is a profile: every slot's ready time from its "gradients ready" marks, the
// step's host work from its period; the trace of another model is refused by name.
TEST(StepProfile, ReadFromARunsTrace) {
  const std::string dir = ::testing::TempDir() + "replica_trace_profile";
  std::vector<std::string> sets = {"model.width=4",      "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]",
                                   "data.synthetic_size=256", "data.mean=[0.5]",   "data.std=[0.25]",
                                   "train.global_batch=16",   "train.max_steps=8", "train.eval=false",
                                   "train.tensorboard=false", "checkpoint.every_epochs=0",
                                   "parallel.devices=cpu:2",  "train.run_dir=" + dir};
  const RunConfig cfg = parse_config("", "test", sets);
  Trainer(cfg, {.print = false, .trace = dir + "/trace.json"}).fit();
  const std::string trace = read_file(dir + "/trace.json", "trace");
  const StepProfile p = profile_from_trace(trace, "trace.json", cfg);
  EXPECT_EQ(p.model, profile_model_key(cfg));
  EXPECT_EQ(p.micro_batch, 8);
  EXPECT_EQ(p.steps, 6) << "8 steps, the first two left out";
  EXPECT_NE(p.device.find("replica 0 of 2"), std::string::npos) << p.device;
  EXPECT_GT(p.forward_s, 0);
  EXPECT_GE(p.host_s, 0);
  for (size_t s = 0; s < p.slot_elements.size(); ++s) EXPECT_LE(p.slot_ready_s[s], p.backward_s + 1e-6) << s;
  EXPECT_LT(p.slot_ready_s.back(), p.slot_ready_s.front()) << "the classifier is final before the stem";
  // The same trace read as another model's: refused, naming the model.
  sets[0] = "model.arch=resnet32";
  try {
    profile_from_trace(trace, "trace.json", parse_config("", "test", sets));
    ADD_FAILURE() << "a trace of resnet20 accepted for resnet32";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("another model"), std::string::npos) << e.what();
  }
  EXPECT_THROW(profile_from_trace("{\"traceEvents\":[]}", "empty.json", cfg), ConfigError);
  EXPECT_THROW(profile_from_trace("not json", "junk.json", cfg), ConfigError);
  // Events without args, or not objects at all: skipped, then a named error (no crash).
  EXPECT_THROW(profile_from_trace(R"({"traceEvents":[1,{"ph":"i","name":"gradients ready","tid":0,"ts":1},)"
                                  R"({"ph":"M","name":"thread_name","tid":0}]})",
                                  "bare.json", cfg),
               ConfigError);
}
