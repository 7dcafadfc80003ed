// The run report: its record survives metrics.jsonl, the memory-pressure rule fires once and
// names what to change, `replica report` rebuilds the summary and draws the plot, and a real
// run's phases add up to its wall time.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/errors.h"
#include "core/file_io.h"
#include "train/config.h"
#include "train/run_report.h"
#include "train/trainer.h"

using namespace replica;
using namespace replica::train;

TEST(RunReport, TheSummaryRecordReadsBack) {
  RunReport r;
  r.wall_s = 100;
  r.data_wait_s = 5;
  r.compute_s = 70;
  r.allreduce_wait_s = 10;
  r.optimizer_s = 4;
  r.eval_s = 6;
  r.checkpoint_s = 2;
  r.steps = 50;
  r.images = 6400;
  r.images_per_s = 64;
  r.replicas = 4;
  r.devices = "cuda:0,1,2,3";
  r.peak_mib = {900, 950};
  r.capacity_mib = {1000, 1000};
  r.cost_per_device_hour = 2.0;
  r.pressure_steps = 12;
  r.shard = "gradients";  // ZeRO-2 in bf16: peaks above what a step keeps
  r.params_mib = 146.5;
  r.grads_mib = 146.2;
  r.optimizer_mib = 97.5;
  r.params_kept_mib = 97.7;
  r.grads_kept_mib = 48.8;
  const RunReport back = RunReport::from_json(r.json());
  EXPECT_EQ(back.text(), r.text());
  EXPECT_DOUBLE_EQ(back.other_s(), 3);
  const std::string t = r.text();
  for (const char* needle : {"compute 70.0 s (70%)", "all-reduce + device wait 10.0 s", "checkpointing 2.0 s",
                             "other 3.0 s", "replica 1 peak 950 of 1000 MiB (headroom 5%)", "for 12 steps",
                             "0.1111 device-hours", "cost 0.2222",
                             "gradients 146.2 MiB, optimizer state 97.5 MiB at peak; kept between steps: parameters "
                             "97.7 MiB, gradients 48.8 MiB"})
    EXPECT_NE(t.find(needle), std::string::npos) << needle << " in\n" << t;
}

// The step-end wait is named for what it is: a one-GPU run has no all-reduce to wait for.
TEST(RunReport, TheStepEndWaitIsNamedForTheRun) {
  RunReport r;
  r.wall_s = 10;
  r.allreduce_wait_s = 1.2;
  const std::pair<std::string, int> runs[] = {{"cuda:0", 1}, {"cuda:0,1", 2}, {"cpu:2", 2}, {"cpu:1", 1}};
  const char* names[] = {"device wait 1.2 s", "all-reduce + device wait 1.2 s", "all-reduce wait 1.2 s",
                         "step-end wait 1.2 s"};
  for (int i = 0; i < 4; ++i) {
    r.devices = runs[i].first;
    r.replicas = runs[i].second;
    const std::string t = r.text();
    EXPECT_NE(t.find(std::string(" ") + names[i]), std::string::npos) << r.devices << ":\n" << t;
    if (r.replicas == 1) {
      EXPECT_EQ(t.find("all-reduce"), std::string::npos) << t;
    }
  }
}

TEST(RunReport, MemoryPressureWarnsOnceAfterManyStepsAndNamesTheKeys) {
  MemoryPressure p(3);
  EXPECT_EQ(p.observe("cuda:0", 900, 1000), "");
  EXPECT_EQ(p.observe("cuda:0", 900, 1000), "");
  EXPECT_EQ(p.observe("cuda:0", 800, 1000), "") << "a step below 85% starts the count again";
  EXPECT_EQ(p.observe("cuda:0", 900, 1000), "");
  EXPECT_EQ(p.observe("cuda:0", 900, 1000), "");
  const std::string w = p.observe("cuda:0", 900, 1000, "memory.bytes");
  for (const char* needle : {"cuda:0", "85%", "train.micro_batch", "model.checkpoint", "memory.bytes"})
    EXPECT_NE(w.find(needle), std::string::npos) << w;
  EXPECT_EQ(p.observe("cuda:0", 900, 1000), "") << "one warning per run";
  EXPECT_EQ(p.steps_above(), 6);
}

TEST(RunReport, ReportCommandRebuildsTheSummaryAndDrawsThePlot) {
  const std::string dir = ::testing::TempDir() + "replica_report";
  std::filesystem::create_directories(dir);
  RunReport r;
  r.wall_s = 10;
  r.steps = 2;
  r.replicas = 1;
  r.devices = "cpu:1";
  std::ofstream(dir + "/metrics.jsonl")
      << R"({"kind":"step","step":1,"epoch":1,"loss":2.5,"accuracy":0.1,"lr":0.1,"img_per_s":100})" << "\n"
      << R"({"kind":"step","step":2,"epoch":1,"loss":2.0,"accuracy":0.3,"lr":0.05,"img_per_s":110})" << "\n"
      << R"({"kind":"eval","step":2,"epoch":1,"loss":1.9,"accuracy":0.35,"count":100})" << "\n"
      << r.json() << "\n";
  const std::string out = report_run_directory(dir);
  EXPECT_NE(out.find("run report: 2 steps"), std::string::npos) << out;
  EXPECT_NE(out.find("test accuracy 35.00%"), std::string::npos) << out;
  const std::string svg = read_file(dir + "/report.svg", "plot");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  for (const char* needle : {"loss", "accuracy", "learning rate", "<polyline", "test accuracy"})
    EXPECT_NE(svg.find(needle), std::string::npos) << needle;
  // A run that stopped mid-write: the cut last line is left out, the rest reports.
  std::ofstream(dir + "/metrics.jsonl")
      << R"({"kind":"step","step":1,"epoch":1,"loss":2.5,"accuracy":0.1,"lr":0.1,"img_per_s":100})" << "\n"
      << R"({"kind":"step","step":2,"ep)";
  EXPECT_NE(report_run_directory(dir).find("no summary record"), std::string::npos);
  EXPECT_THROW(report_run_directory(dir + "/missing"), IoError);
}

TEST(RunReport, ARunsPhasesAddUpToItsWallTime) {
  const std::string dir = ::testing::TempDir() + "replica_report_run";
  auto cfg = parse_config("", "test",
                          {"model.width=4", "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]",
                           "data.synthetic_size=256", "data.mean=[0.5]", "data.std=[0.25]", "train.global_batch=32",
                           "train.epochs=1", "train.tensorboard=false", "parallel.devices=cpu:2",
                           "run.cost_per_device_hour=3", "train.run_dir=" + dir});
  Trainer t(cfg, {.print = false});
  t.fit();
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line, last;
  while (std::getline(in, line)) last = line;
  ASSERT_NE(last.find("\"kind\":\"summary\""), std::string::npos) << last;
  const RunReport r = RunReport::from_json(last);
  EXPECT_EQ(r.steps, 8);
  EXPECT_EQ(r.images, 256);
  EXPECT_EQ(r.replicas, 2);
  EXPECT_GT(r.compute_s, 0);
  EXPECT_GT(r.eval_s, 0);
  EXPECT_GT(r.checkpoint_s, 0);
  const double phases = r.data_wait_s + r.compute_s + r.allreduce_wait_s + r.optimizer_s + r.eval_s + r.checkpoint_s;
  EXPECT_LE(phases, r.wall_s * 1.001) << "the phases are parts of the wall time";
  EXPECT_EQ(r.cost_per_device_hour, 3);
  ASSERT_EQ(r.peak_mib.size(), 2u);
  EXPECT_GT(r.peak_mib[0], 0);
  EXPECT_GT(r.capacity_mib[0], r.peak_mib[0]);
}
