// The planner's prediction against the measured peak of real training steps (within 5%), and
// micro_batch: auto picking a batch that fits a small pool.
#include <gtest/gtest.h>

#include "train/memplan.h"
#include "train/trainer.h"

using namespace replica;
using namespace replica::train;

namespace {
std::vector<std::string> sets(const std::string& precision, const std::string& micro, const std::string& extra = "") {
  std::vector<std::string> s = {"data.dataset=synthetic", "data.synthetic_size=512", "data.mean=[0.5]", "data.std=[0.25]",
                                "train.global_batch=64", "train.micro_batch=" + micro, "train.max_steps=3",
                                "train.eval=false", "train.tensorboard=false", "checkpoint.every_epochs=0",
                                // One run directory per test: ctest runs tests in parallel, and a run directory has one writer.
                                "train.run_dir=" + ::testing::TempDir() + "/memplan_" +
                                    ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                                "parallel.devices=cpu:1",
                                "train.precision=" + precision};
  if (!extra.empty()) s.push_back(extra);
  return s;
}
}  // namespace

TEST(MemPlan, PredictsTheMeasuredPeakWithinFivePercent) {
  for (std::string precision : {"fp32", "fp16"}) {
    auto cfg = parse_config("", "test", sets(precision, "64"));
    MemPlan plan = plan_memory(cfg);
    Trainer t(cfg, {.print = false, .on_step = nullptr});
    t.fit();
    const double measured = static_cast<double>(t.group().replica(0).pool().stats().peak_in_use);
    std::printf("%s ResNet-20 micro-batch 64: predicted %.2f MiB, measured %.2f MiB (%+.2f%%)\n", precision.c_str(),
                plan.peak_bytes / 1048576.0, measured / 1048576.0, 100.0 * (plan.peak_bytes - measured) / measured);
    EXPECT_NEAR(plan.peak_bytes, measured, 0.05 * measured) << precision;
    EXPECT_TRUE(plan.fits);
  }
}

TEST(MemPlan, ShardedOptimizerStateIsPredictedAndMeasured) {
  // 2 replicas with AdamW: the optimizer state is the largest shard's (about half), the prediction
  // of the whole peak and of the optimizer tag hold against the pool's measured peaks.
  double unsharded_state = 0, unsharded_grads = 0;
  for (std::string mode : {"none", "optimizer", "gradients"}) {
    auto s = sets("fp32", "32", "optim.name=adamw");
    s.push_back("parallel.devices=cpu:2");
    s.push_back("parallel.shard=" + mode);
    auto cfg = parse_config("", "test", s);
    MemPlan plan = plan_memory(cfg);
    Trainer t(cfg, {.print = false, .on_step = nullptr});
    t.fit();
    double measured = 0, state = 0, grads_peak = 0, grads_kept = 0;
    const int g = static_cast<int>(MemTag::grads);
    for (int r = 0; r < 2; ++r) {
      const auto st = t.group().replica(r).pool().stats();
      measured = std::max(measured, static_cast<double>(st.peak_in_use));
      state = std::max(state, static_cast<double>(st.tags[static_cast<int>(MemTag::optimizer)].peak_in_use));
      grads_peak = std::max(grads_peak, static_cast<double>(st.tags[g].peak_in_use));
      grads_kept = std::max(grads_kept, static_cast<double>(st.tags[g].in_use));
    }
    std::printf("parallel.shard %s: gradients predicted %.3f MiB, measured peak %.3f MiB, kept between steps %.3f MiB\n",
                mode.c_str(), plan.tag_bytes[g] / 1048576.0, grads_peak / 1048576.0, grads_kept / 1048576.0);
    EXPECT_NEAR(plan.tag_bytes[g], grads_peak, 0.05 * grads_peak) << mode;
    if (mode == "none") unsharded_grads = grads_kept;
    // ZeRO-2 gives the whole gradient buffer up: between steps only the shard (about half) stays.
    if (mode == "gradients") EXPECT_LT(grads_kept, 0.55 * unsharded_grads);
    else EXPECT_EQ(grads_kept, unsharded_grads) << mode;
    const double predicted_state = plan.tag_bytes[static_cast<int>(MemTag::optimizer)];
    std::printf("parallel.shard %s, 2 replicas, AdamW: peak predicted %.2f MiB, measured %.2f MiB (%+.2f%%); "
                "optimizer state predicted %.3f MiB, measured %.3f MiB\n",
                mode.c_str(), plan.peak_bytes / 1048576.0, measured / 1048576.0,
                100.0 * (plan.peak_bytes - measured) / measured, predicted_state / 1048576.0, state / 1048576.0);
    EXPECT_NEAR(plan.peak_bytes, measured, 0.05 * measured) << mode;
    EXPECT_NEAR(predicted_state, state, 0.01 * state) << mode;
    if (mode == "none") unsharded_state = state;
    else EXPECT_LT(state, 0.55 * unsharded_state) << mode << ": the largest of two shards is about half";
    EXPECT_NE(plan.report().find(mode == "none" ? "micro-batch 32:" : "parallel.shard " + mode), std::string::npos)
        << plan.report();
  }
}

TEST(MemPlan, AutoMicroBatchFitsASmallPool) {
  // 40 MiB holds ResNet-20 with micro-batch 32 but not 64 (about 78 MiB)
  auto cfg = parse_config("", "test", sets("fp32", "auto", "memory.bytes=40MiB"));
  MemPlan plan = plan_memory(cfg, 64);
  EXPECT_FALSE(plan.fits);
  EXPECT_GE(plan.max_micro_batch, 16);
  EXPECT_LT(plan.max_micro_batch, 64);
  EXPECT_NE(plan.report().find("does NOT fit"), std::string::npos);
  Trainer t(cfg, {.print = false, .on_step = nullptr});
  EXPECT_EQ(t.micro_batch() * t.accumulation(), 64);
  EXPECT_LT(t.micro_batch(), 64);
  auto r = t.fit();  // and it trains in that pool
  EXPECT_EQ(r.steps, 3);
  EXPECT_LE(t.group().replica(0).pool().stats().peak_reserved, size_t(40) << 20);
}

TEST(MemPlan, OutOfMemoryCarriesThePlannersSuggestion) {
  auto cfg = parse_config("", "test", sets("fp32", "64", "memory.mode=preallocate"));
  cfg.memory.bytes = size_t(40) << 20;
  Trainer t(cfg, {.print = false, .on_step = nullptr});
  try {
    t.fit();
    FAIL() << "expected out of memory";
  } catch (const parallel::ReplicaError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
    EXPECT_NE(m.find("memory.bytes (now 40.00 MiB)"), std::string::npos) << m;
    EXPECT_NE(m.find("The planner (replica memplan) says micro_batch"), std::string::npos) << m;
  }
}

TEST(StepPlan, TrainingFromThePlanIsBitIdenticalAndServesEveryStep) {
  std::vector<std::vector<float>> params;
  for (bool plan : {false, true}) {
    auto s = sets("fp32", "16", plan ? "memory.step_plan=true" : "memory.step_plan=false");
    s.push_back("train.max_steps=6");
    s.push_back("model.width=8");
    auto cfg = parse_config("", "test", s);
    Trainer t(cfg, {.print = false, .on_step = nullptr});
    t.fit();
    auto& p = t.model(0).params();
    params.emplace_back(p.data<float>(), p.data<float>() + p.numel());
    auto ps = t.group().replica(0).pool().plan_stats();
    if (plan) {
      EXPECT_TRUE(ps.active);
      EXPECT_EQ(ps.steps_served, 4) << ps.last_divergence;  // steps 3..6 (step 2 was recorded)
      EXPECT_EQ(ps.steps_diverged, 0);
      EXPECT_LE(ps.arena_bytes, ps.recorded_peak * 102 / 100) << "within 2% of the step's peak live bytes";
    }
  }
  EXPECT_EQ(params[0], params[1]) << "the plan changes addresses, never results";
}
