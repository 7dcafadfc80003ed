// Losing a replica without losing the run (train/recovery.h): with parallel.on_replica_failure:
// shrink, a 3-replica run that loses replica 1 (REPLICA_FAULT) finishes on 2, with the bits of a
// 3-replica run to the last completed step followed by a 2-replica run resumed from that step's
// checkpoint (batch norm frozen, so it sees no batch statistics; the resume test covers sync-BN
// on another replica count); the fault at the start of a step, in
// a bucket, in the optimizer, in evaluation and in a checkpoint write. Every checkpoint left
// reads back; metrics.jsonl and the run report name the event. stop mode, min_replicas, the
// preemption notice file, and the configuration errors.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "core/errors.h"
#include "support/scratch.h"
#include "train/checkpoint.h"
#include "train/recovery.h"
#include "train/step_graph.h"
#include "train/trainer.h"

using namespace replica;
using namespace replica::train;

namespace {

std::string dir_for(const std::string& name) { return replica::testing::fresh_dir("recovery_", name); }


// 480 samples, global batch 48: 10 steps an epoch.
std::vector<std::string> sets_for(const std::string& d, int replicas, int64_t steps, std::vector<std::string> extra = {}) {
  std::vector<std::string> s = {"model.width=4", "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]",
                                "data.synthetic_size=480", "data.mean=[0.5]", "data.std=[0.25]",
                                "train.global_batch=48", "train.epochs=2", "train.max_steps=" + std::to_string(steps),
                                "train.eval=false", "train.tensorboard=false", "train.run_dir=" + d,
                                "parallel.devices=cpu:" + std::to_string(replicas), "checkpoint.every_epochs=0",
                                "model.freeze_bn=true", "parallel.on_replica_failure=shrink",
                                "parallel.bucket_mb=0.02", "parallel.first_bucket_mb=0.005"};
  s.insert(s.end(), extra.begin(), extra.end());
  return s;
}

struct Ran {
  FitResult fit;
  std::string model_bin;
  std::vector<float> params;
  int64_t replays = -1;  // train.cuda_graph on replica 0 of the group that finished (-1: none)
};

// record_cpu_steps: train.cuda_graph serves these CPU replicas (their steps recorded and replayed).
Ran run(const std::vector<std::string>& sets, const std::string& fault = "", const std::string& resume = "",
        bool record_cpu_steps = false) {
  if (fault.empty()) unsetenv("REPLICA_FAULT");
  else setenv("REPLICA_FAULT", fault.c_str(), 1);
  struct Unset {
    ~Unset() { unsetenv("REPLICA_FAULT"); }
  } unset;
  TrainerOptions o{.print = false, .on_step = nullptr, .resume = resume, .record_cpu_steps = record_cpu_steps};
  Trainer t(parse_config("", "test", sets), o);
  Ran r;
  r.fit = t.fit();
  r.model_bin = replica::testing::file_bytes(t.config().train.run_dir + "/model.bin");
  const Tensor& p = t.model(0).params();
  r.params.assign(p.data<float>(), p.data<float>() + p.numel());
  if (const StepGraph* g = t.replica_step(0).graph()) r.replays = g->off() ? -1 : g->replays();
  return r;
}

// The reference: 3 replicas to `at`, then 2 replicas resumed from that checkpoint to `steps`.
Ran reference(const std::string& name, int64_t at, int64_t steps, const std::vector<std::string>& extra = {}) {
  const std::string d = dir_for(name);
  run(sets_for(d, 3, at, extra));
  return run(sets_for(d, 2, steps, extra), "", d);
}

void expect_every_checkpoint_reads(const std::string& dir) {
  const auto files = list_checkpoints(dir + "/checkpoints");
  EXPECT_FALSE(files.empty());
  for (const auto& f : files) EXPECT_NO_THROW(read_checkpoint(f)) << f;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/checkpoints"))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << "a half-written file was left: " << e.path();
}

}  // namespace

TEST(Recovery, FaultSpecsParseAndBadOnesAreNamed) {
  FaultInjector f = FaultInjector::parse("replica:1:step:7");
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.step, 7);
  EXPECT_EQ(f.where, "start");
  EXPECT_EQ(FaultInjector::parse("replica:0:step:3:optimizer").where, "optimizer");
  for (std::string bad : {"replica:1", "rank:1:step:7", "replica:x:step:7", "replica:1:step:0", "replica:1:step:7:lunch"}) {
    try {
      FaultInjector::parse(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("REPLICA_FAULT"), std::string::npos) << e.what();
    }
  }
  // Once per process: a run that shrank and re-runs the step does not fail again.
  FaultInjector g = FaultInjector::parse("replica:2:step:5:bucket");
  EXPECT_NO_THROW(g.at("start", 2, 5));
  EXPECT_NO_THROW(g.at("bucket", 1, 5));
  EXPECT_THROW(g.at("bucket", 2, 5), InjectedFault);
  EXPECT_NO_THROW(g.at("bucket", 2, 5));
}

TEST(Recovery, ShrinkAfterALostReplicaMatchesTheResumeOnTheSurvivors) {
  // Where the fault strikes, and the last step the survivors completed (what they continue from).
  struct Case {
    std::string fault;
    int64_t completed;
    std::vector<std::string> extra;
  };
  const std::vector<Case> cases = {
      {"replica:1:step:7", 6, {}},
      {"replica:1:step:7:bucket", 6, {}},
      {"replica:1:step:7:optimizer", 7, {}},  // after the step's collectives: the survivors applied it
      {"replica:0:step:10:eval", 10, {"train.eval=true"}},  // rank 0 itself, at the epoch's evaluation
      {"replica:2:step:5:checkpoint", 5, {"checkpoint.every_steps=5"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.fault);
    const std::string d = dir_for("shrink_" + std::to_string(&c - cases.data()));
    const Ran shrunk = run(sets_for(d, 3, 14, c.extra), c.fault);
    EXPECT_EQ(shrunk.fit.steps, 14) << "the run finished";
    const Ran ref = reference("ref_" + std::to_string(&c - cases.data()), c.completed, 14, c.extra);
    EXPECT_TRUE(shrunk.model_bin == ref.model_bin) << "model.bin differs from 3 replicas to step " << c.completed
                                                   << " + 2 replicas resumed from it";
    EXPECT_EQ(shrunk.params, ref.params);
    expect_every_checkpoint_reads(d);
    const std::string metrics = replica::testing::file_bytes(d + "/metrics.jsonl");
    EXPECT_NE(metrics.find(checkpoint_path(d + "/checkpoints", c.completed)), std::string::npos)
        << "the step the survivors continued from was checkpointed";
    EXPECT_NE(metrics.find("\"event\":\"replica_lost\""), std::string::npos) << metrics.substr(0, 400);
    const RunReport rr = RunReport::from_json(metrics.substr(metrics.rfind("{\"kind\":\"summary\"")));
    ASSERT_EQ(rr.events.size(), 1u);
    EXPECT_NE(rr.events[0].find("lost at step"), std::string::npos) << rr.events[0];
    EXPECT_NE(rr.text().find("event: replica"), std::string::npos);
    EXPECT_EQ(rr.replicas, 2) << "the summary describes the group that finished";
  }
}

// The same with the step captured and replayed (train.cuda_graph: on; recorded CPU steps): with
// peers the update follows the step's read, outside the graph, so a replica lost at the start of
// a replayed step leaves the survivors at the step before, and one lost in its update after the
// collectives leaves them at that step, as eagerly; the rebuilt group captures again and the run
// is the eager reference's byte for byte. A fault planned in a bucket (inside the captured step,
// whose host hooks run only at the capture) keeps the graph from serving: `on` is an error.
TEST(Recovery, ShrinkWithReplayedStepsMatchesTheEagerReference) {
  const std::vector<std::pair<std::string, int64_t>> cases = {{"replica:1:step:7", 6},
                                                              {"replica:1:step:7:optimizer", 7}};
  for (const auto& [fault, completed] : cases) {
    SCOPED_TRACE(fault);
    const std::string d = dir_for("graph_shrink_" + std::to_string(completed));
    const Ran shrunk = run(sets_for(d, 3, 14, {"train.cuda_graph=on"}), fault, "", true);
    EXPECT_EQ(shrunk.fit.steps, 14) << "the run finished";
    EXPECT_GT(shrunk.replays, 0) << "the survivors' group replayed its steps";
    const Ran ref = reference("graph_ref_" + std::to_string(completed), completed, 14);
    EXPECT_TRUE(shrunk.model_bin == ref.model_bin) << "model.bin differs from the eager 3 replicas to step "
                                                   << completed << " + 2 replicas resumed from it";
    expect_every_checkpoint_reads(d);
  }
  try {
    run(sets_for(dir_for("graph_bucket"), 3, 14, {"train.cuda_graph=on"}), "replica:1:step:7:bucket", "", true);
    ADD_FAILURE() << "train.cuda_graph: on ran with a fault planned inside the captured step";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("REPLICA_FAULT at bucket"), std::string::npos) << e.what();
  }
}

TEST(Recovery, StopModeEndsTheRunNamingTheReplica) {
  const std::string d = dir_for("stop");
  try {
    run(sets_for(d, 3, 12, {"parallel.on_replica_failure=stop"}), "replica:1:step:4");
    FAIL() << "the run went on";
  } catch (const parallel::ReplicaError& e) {
    EXPECT_EQ(e.rank(), 1);
    EXPECT_NE(std::string(e.what()).find("injected fault"), std::string::npos) << e.what();
  }
}

TEST(Recovery, BelowMinReplicasItCheckpointsAndStops) {
  const std::string d = dir_for("min");
  try {
    run(sets_for(d, 2, 12, {"parallel.min_replicas=2"}), "replica:1:step:4");
    FAIL() << "the run went on with 1 replica";
  } catch (const RestartableError& e) {  // the command exits 75: a restart with the device back helps
    const std::string m = e.what();
    EXPECT_NE(m.find("parallel.min_replicas 2"), std::string::npos) << m;
    EXPECT_NE(m.find("--resume"), std::string::npos) << m;
  }
  EXPECT_TRUE(std::filesystem::exists(checkpoint_path(d + "/checkpoints", 3)));
  // and it resumes from there on what is left
  const Ran resumed = run(sets_for(d, 1, 12, {"parallel.min_replicas=1"}), "", d);
  EXPECT_EQ(resumed.fit.history.size(), 9u);
}

TEST(Recovery, APreemptionNoticeFileCheckpointsAndStopsThenResumeContinues) {
  const std::string d = dir_for("preempt");
  const std::string notice = d + "/preempt-notice";
  const std::vector<std::string> extra = {"parallel.preempt_file=" + notice};
  const Ran straight = run(sets_for(dir_for("preempt_straight"), 2, 12, extra));
  TrainerOptions o{.print = false, .on_step = [&](const StepStatus& s) {
                     if (s.step == 5) std::ofstream(notice) << "terminating in 2 minutes\n";
                   }};
  Trainer t(parse_config("", "test", sets_for(d, 2, 12, extra)), o);
  const FitResult stopped = t.fit();
  EXPECT_TRUE(stopped.stopped_by_signal);
  EXPECT_NE(stopped.stopped_by.find("preempt_file"), std::string::npos) << stopped.stopped_by;
  EXPECT_GE(stopped.steps, 5);
  EXPECT_LE(stopped.steps, 6) << "checkpointed at the step that saw it or the next";
  EXPECT_TRUE(std::filesystem::exists(checkpoint_path(d + "/checkpoints", stopped.steps)));
  std::filesystem::remove(notice);
  const Ran resumed = run(sets_for(d, 2, 12, extra), "", d);
  ASSERT_FALSE(resumed.fit.history.empty());
  EXPECT_EQ(resumed.fit.history.front().step, stopped.steps + 1);
  EXPECT_TRUE(resumed.model_bin == straight.model_bin) << "stop + resume is the straight run";
}

TEST(Recovery, ConfigurationErrorsAreNamed) {
  auto error_of = [](std::vector<std::string> sets) {
    try {
      Trainer t(parse_config("", "test", sets), {.print = false});
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string d = dir_for("config");
  EXPECT_NE(error_of(sets_for(d, 2, 4, {"parallel.min_replicas=3"})).find("parallel.min_replicas 3"),
            std::string::npos);
  EXPECT_NE(error_of(sets_for(d, 2, 4, {"parallel.shard=optimizer"})).find("parallel.shard"), std::string::npos);
  EXPECT_NE(error_of(sets_for(d, 2, 4, {"parallel.preempt_file=/no/such/dir/notice"})).find("parallel.preempt_file"),
            std::string::npos);
  setenv("REPLICA_FAULT", "replica:one:step:2", 1);
  EXPECT_NE(error_of(sets_for(d, 2, 4)).find("REPLICA_FAULT"), std::string::npos);
  unsetenv("REPLICA_FAULT");
}
