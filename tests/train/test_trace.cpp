// `--trace`: the timeline is trace-event JSON with per-replica compute and communication tracks,
// slices that nest on each track, and pool counters.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <regex>

#include "train/trainer.h"

using namespace replica;

TEST(Trace, ChromeTraceWithNestedSlicesPerReplica) {
  const std::string dir = ::testing::TempDir() + "/trace_run", path = ::testing::TempDir() + "/trace.json";
  auto cfg = train::parse_config(
      "", "test",
      {"model.width=4", "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]", "data.synthetic_size=256",
       "data.mean=[0.5]", "data.std=[0.25]", "train.global_batch=32", "train.micro_batch=8", "train.max_steps=3",
       "train.epochs=1", "train.eval_batch=64", "train.run_dir=" + dir, "parallel.devices=cpu:2",
       "parallel.bucket_mb=0.01", "parallel.first_bucket_mb=0.01"});
  train::TrainerOptions o{.print = false, .on_step = nullptr, .resume = "", .trace = path};
  train::Trainer t(cfg, o);
  t.fit();
  std::ifstream in(path);
  std::string line, all;
  std::map<int, std::vector<std::pair<double, double>>> slices;
  std::map<std::string, int> names;
  int counters = 0;
  std::regex x_re("\"ph\":\"X\",\"name\":\"([^\"]*)\".*\"tid\":(\\d+),\"ts\":([0-9.]+),\"dur\":([0-9.]+)");
  while (std::getline(in, line)) {
    all += line + "\n";
    std::smatch m;
    if (std::regex_search(line, m, x_re)) {
      std::string name = m[1];
      names[name.substr(0, name.find(' ') == std::string::npos ? name.size() : name.find(" ("))]++;
      slices[std::stoi(m[2])].push_back({std::stod(m[3]), std::stod(m[3]) + std::stod(m[4])});
    }
    if (line.find("\"ph\":\"C\"") != std::string::npos) counters++;
  }
  ASSERT_EQ(all.rfind("{\"traceEvents\":[", 0), 0u);
  ASSERT_NE(all.find("],\"displayTimeUnit\":\"ms\"}"), std::string::npos);
  EXPECT_EQ(std::count(all.begin(), all.end(), '{'), std::count(all.begin(), all.end(), '}'));
  for (const char* n : {"data wait", "forward", "backward", "optimizer", "wait for gradient all-reduce", "evaluation"})
    EXPECT_GT(names[n], 0) << "no '" << n << "' slice";
  EXPECT_GT(names["all-reduce bucket 0"], 0) << "bucket all-reduces on the communication tracks";
  EXPECT_GT(counters, 0);
  EXPECT_EQ(slices.size(), 4u) << "compute and communication tracks for 2 replicas";
  for (auto& [tid, v] : slices) {
    if (tid % 2 == 1) continue;  // bucket all-reduces on the comm track may overlap each other
    std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.first < b.first || (a.first == b.first && a.second > b.second); });
    std::vector<double> open;  // ends of the enclosing slices
    for (auto& [b, e] : v) {
      while (!open.empty() && open.back() <= b + 1e-3) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(e, open.back() + 2e-3) << "track " << tid << ": slice at " << b << " straddles its parent";
      }
      open.push_back(e);
    }
  }
}
