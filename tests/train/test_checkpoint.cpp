// Checkpoints: format round trip, every kind of damage named, atomic writes under kill -9,
// rotation, fallback to the previous valid checkpoint, exact resume (fp32 and fp16), resume on
// another replica count, and the TensorBoard event file's framing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/errors.h"
#include "support/compare.h"
#include "train/checkpoint.h"
#include "train/signals.h"
#include "train/tensorboard.h"
#include "train/trainer.h"

using namespace replica;
using namespace replica::train;

namespace {

std::string dir_for(const std::string& name) {
  std::string d = ::testing::TempDir() + "/ckpt_" + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

Checkpoint sample() {
  Checkpoint c;
  c.sections["config"] = "model:\n  arch: resnet20\n";
  c.set_meta({{"global_step", "12"}, {"arch", "resnet20"}});
  c.sections["params"] = std::string(1000, '\x01');
  c.sections["optimizer"] = std::string(1000, '\x02');
  return c;
}

std::string error_of(const std::string& path) {
  try {
    read_checkpoint(path);
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> sets_for(const std::string& run_dir, int replicas, int64_t steps, const std::string& extra = "") {
  std::vector<std::string> s = {"model.width=4", "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]",
                                "data.synthetic_size=256", "data.mean=[0.5]", "data.std=[0.25]",
                                "train.global_batch=32", "train.epochs=4", "train.max_steps=" + std::to_string(steps),
                                "train.eval=false", "train.tensorboard=false", "train.run_dir=" + run_dir,
                                "parallel.devices=cpu:" + std::to_string(replicas), "checkpoint.every_epochs=0"};
  if (!extra.empty()) s.push_back(extra);
  return s;
}

std::vector<float> run(const std::vector<std::string>& sets, const std::string& resume = "") {
  TrainerOptions o{.print = false, .on_step = nullptr, .resume = resume};
  Trainer t(parse_config("", "test", sets), o);
  t.fit();
  auto& p = t.model(0).params();
  return std::vector<float>(p.data<float>(), p.data<float>() + p.numel());
}

}  // namespace

TEST(Checkpoint, RoundTripAndEveryDamageIsNamed) {
  std::string d = dir_for("format");
  std::string path = d + "/a.ckpt";
  write_checkpoint(sample(), path);
  Checkpoint back = read_checkpoint(path);
  EXPECT_EQ(back.sections, sample().sections);
  EXPECT_EQ(back.meta_value("global_step"), "12");
  EXPECT_THROW(back.meta_value("nope"), IoError);

  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  auto write = [&](const std::string& b) { std::ofstream(path, std::ios::binary | std::ios::trunc) << b; };
  // flip one byte inside each section's payload
  for (const char* name : {"config", "meta", "optimizer", "params"}) {
    std::string b = bytes;
    const std::string payload = sample().sections.at(name);
    size_t pos = b.find(payload);
    ASSERT_NE(pos, std::string::npos);
    b[pos + payload.size() / 2] ^= 0x40;
    write(b);
    std::string m = error_of(path);
    EXPECT_NE(m.find("section '" + std::string(name) + "' is corrupt"), std::string::npos) << m;
    EXPECT_NE(m.find(path), std::string::npos) << "names the file: " << m;
  }
  write(bytes.substr(0, bytes.size() - 100));
  EXPECT_NE(error_of(path).find("truncated in section 'params'"), std::string::npos) << error_of(path);
  write(bytes.substr(0, 10));
  EXPECT_NE(error_of(path).find("truncated"), std::string::npos);
  std::string v = bytes;
  v[8] = 9;
  write(v);
  EXPECT_NE(error_of(path).find("format version 9"), std::string::npos) << error_of(path);
  write("garbage garbage garbage");
  EXPECT_NE(error_of(path).find("bad magic"), std::string::npos);
}

TEST(Checkpoint, KillDuringAWriteLeavesThePreviousOneValid) {
  std::string d = dir_for("atomic");
  std::string path = d + "/step-00000001.ckpt";
  Checkpoint c = sample();
  c.sections["params"] = std::string(size_t(64) << 20, '\x07');  // 64 MiB: the write takes a while
  write_checkpoint(sample(), path);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (;;) write_checkpoint(c, path);  // rewrites until killed
  }
  usleep(150 * 1000);
  kill(child, SIGKILL);
  int status;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  Checkpoint back = read_checkpoint(path);  // the old one or a complete new one, never a torn one
  EXPECT_TRUE(back.sections.at("params").size() == 1000 || back.sections.at("params").size() == (size_t(64) << 20));
  EXPECT_EQ(list_checkpoints(d).size(), 1u) << "leftover temporary files are not mistaken for checkpoints";
}

TEST(Checkpoint, RotationKeepsTheNewest) {
  std::string d = dir_for("rotate");
  for (int s : {5, 10, 15, 20}) write_checkpoint(sample(), checkpoint_path(d, s));
  rotate_checkpoints(d, 2);
  auto left = list_checkpoints(d);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_NE(left[0].find("step-00000020"), std::string::npos);
  EXPECT_NE(left[1].find("step-00000015"), std::string::npos);
}

TEST(Resume, HalfAndHalfIsBitIdenticalToStraight) {
  for (std::string precision : {"fp32", "fp16"}) {
    std::string d1 = dir_for("straight_" + precision), d2 = dir_for("halves_" + precision);
    auto straight = run(sets_for(d1, 2, 12, "train.precision=" + precision));
    run(sets_for(d2, 2, 6, "train.precision=" + precision));
    ASSERT_EQ(list_checkpoints(d2 + "/checkpoints").size(), 1u) << "the final state is checkpointed";
    auto resumed = run(sets_for(d2, 2, 12, "train.precision=" + precision), d2);
    ASSERT_EQ(resumed.size(), straight.size());
    EXPECT_EQ(0, std::memcmp(resumed.data(), straight.data(), straight.size() * 4)) << precision << ": not bit-identical";
  }
}

TEST(Resume, OnAnotherReplicaCountKeepsTheGlobalBatch) {
  // 2 replicas with sync-BN normalise like 1 replica on the whole batch, so 4 steps on 2 replicas
  // then 4 on 1 replica match 8 steps on 2 up to float summation order (the equivalence test
  // measures ~1e-7 for this model).
  std::string d1 = dir_for("world_straight"), d2 = dir_for("world_switch");
  auto straight = run(sets_for(d1, 2, 8, "parallel.sync_bn=true"));
  run(sets_for(d2, 2, 4, "parallel.sync_bn=true"));
  auto switched = run(sets_for(d2, 1, 8, "parallel.sync_bn=true"), d2);
  double diff = 0, m = 1e-12;
  for (size_t i = 0; i < straight.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(straight[i] - switched[i])));
    m = std::max(m, static_cast<double>(std::abs(straight[i])));
  }
  EXPECT_LT(diff / m, 1e-5);
  // with micro_batch fixed at 16, 1 replica needs 2 accumulation steps for the same global batch
  auto acc = sets_for(d2, 1, 8, "parallel.sync_bn=true");
  acc.push_back("train.micro_batch=16");
  TrainerOptions o{.print = false, .on_step = nullptr, .resume = d2};
  Trainer t(parse_config("", "test", acc), o);
  EXPECT_EQ(t.accumulation(), 2);
}

TEST(Resume, FallsBackPastADamagedCheckpointAndRejectsAnotherModel) {
  std::string d = dir_for("fallback");
  auto sets = sets_for(d, 1, 6, "checkpoint.every_steps=3");
  run(sets);
  auto all = list_checkpoints(d + "/checkpoints");
  ASSERT_EQ(all.size(), 2u);
  {
    std::fstream f(all[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-20, std::ios::end);
    f.put('\x55');
  }
  TrainerOptions o{.print = false, .on_step = nullptr, .resume = d};
  Trainer t(parse_config("", "test", sets_for(d, 1, 6)), o);
  auto r = t.fit();
  EXPECT_EQ(r.history.size(), 3u) << "resumed from step 3 (the newest valid), ran steps 4-6";
  auto other = sets_for(d, 1, 6, "model.width=8");
  try {
    Trainer bad(parse_config("", "test", other), o);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("no valid checkpoint"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("section 'meta'"), std::string::npos) << e.what();
  }
}

TEST(Signals, StopRequestCheckpointsAtTheCurrentStepOnEveryReplica) {
  std::string d = dir_for("stop");
  clear_stop();
  int steps = 0;
  TrainerOptions o{.print = false, .on_step = [&](const StepStatus&) {
                     if (++steps == 3) request_stop();
                   }};
  Trainer t(parse_config("", "test", sets_for(d, 2, 20)), o);
  auto r = t.fit();
  clear_stop();
  // The request lands after step 3's vote, while step 4 is due: step 4 finishes, then all stop.
  EXPECT_TRUE(r.stopped_by_signal);
  EXPECT_EQ(r.steps, 4);
  EXPECT_NE(r.last_checkpoint.find("step-00000004.ckpt"), std::string::npos) << r.last_checkpoint;
}

TEST(TensorBoard, EventFileFramingAndCrc) {
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);  // the CRC-32C check value
  std::string d = dir_for("tb");
  std::string path;
  {
    TensorBoardWriter w(d);
    w.scalar("train/loss", 0.5f, 7);
    path = w.path();
  }
  std::ifstream in(path, std::ios::binary);
  std::string b((std::istreambuf_iterator<char>(in)), {});
  size_t off = 0;
  int records = 0;
  auto unmask = [](uint32_t m) {
    uint32_t r = m - 0xa282ead8u;
    return (r >> 17) | (r << 15);
  };
  while (off < b.size()) {
    uint64_t len;
    uint32_t lcrc, dcrc;
    std::memcpy(&len, b.data() + off, 8);
    std::memcpy(&lcrc, b.data() + off + 8, 4);
    EXPECT_EQ(unmask(lcrc), crc32c(b.data() + off, 8));
    std::memcpy(&dcrc, b.data() + off + 12 + len, 4);
    EXPECT_EQ(unmask(dcrc), crc32c(b.data() + off + 12, len));
    off += 16 + len;
    records++;
  }
  EXPECT_EQ(records, 2);
  EXPECT_NE(b.find("brain.Event:2"), std::string::npos);
  EXPECT_NE(b.find("train/loss"), std::string::npos);
}
