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
#include <map>

#include "core/errors.h"
#include "support/compare.h"
#include "core/checksum.h"
#include "train/checkpoint.h"
#include "train/model_io.h"
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

namespace {
void put32(std::string& b, size_t at, uint32_t v) { std::memcpy(&b[at], &v, 4); }
void put64(std::string& b, size_t at, uint64_t v) { std::memcpy(&b[at], &v, 8); }
}  // namespace

TEST(Checksum, IsTheStandardFnv1a64) {
  // The published FNV-1a 64 test vectors (offset basis 14695981039346656037).
  EXPECT_EQ(fnv1a("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a("foobar", 6), 0x85944171f73967e8ull);
}

TEST(Checkpoint, CraftedHeaderFieldsAreNamedErrorsNeverOutOfBoundsReads) {
  // The header fields carry no checksum: each one set to a huge or wrapping value must give an
  // IoError naming the file, never a read past the buffer (these crashed the reader before).
  std::string d = dir_for("crafted");
  std::string path = d + "/a.ckpt";
  write_checkpoint(sample(), path);
  std::ifstream in(path, std::ios::binary);
  const std::string good((std::istreambuf_iterator<char>(in)), {});
  // Section 0 starts at 16: u32 name length, name ("config", 6 bytes), u64 size, u64 checksum.
  const size_t name_len_at = 16, size_at = 16 + 4 + 6;
  struct Case {
    const char* what;
    std::string bytes;
  };
  std::vector<Case> cases;
  auto with = [&](auto f) {
    std::string b = good;
    f(b);
    return b;
  };
  cases.push_back({"name length 0xFFFFFFF0 (wraps a 32-bit need(len + 16))", with([&](std::string& b) { put32(b, name_len_at, 0xFFFFFFF0u); })});
  cases.push_back({"name length 0xFFFFFFFF", with([&](std::string& b) { put32(b, name_len_at, 0xFFFFFFFFu); })});
  cases.push_back({"section size 2^64 - 8 (wraps off + n)", with([&](std::string& b) { put64(b, size_at, ~uint64_t(7)); })});
  cases.push_back({"section size 2^63", with([&](std::string& b) { put64(b, size_at, uint64_t(1) << 63); })});
  cases.push_back({"section count 2^32 - 1", with([&](std::string& b) { put32(b, 12, 0xFFFFFFFFu); })});
  cases.push_back({"section count 0", with([&](std::string& b) { put32(b, 12, 0); })});
  cases.push_back({"header only", good.substr(0, 16)});
  cases.push_back({"cut inside a name", good.substr(0, 22)});
  for (auto& c : cases) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << c.bytes;
    std::string m = error_of(path);
    EXPECT_FALSE(m.empty()) << c.what << ": accepted";
    EXPECT_NE(m.find(path), std::string::npos) << c.what << ": names the file: " << m;
  }
}

TEST(Checkpoint, VersionOneFilesWithTheLegacyChecksumStillLoad) {
  // Checkpoints written before the checksum fix (format 1, FNV basis 1469598103934665603).
  Checkpoint c = sample();
  std::string out("RPLCKPT\0", 8);
  auto put = [&](auto v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(uint32_t(1));
  put(static_cast<uint32_t>(c.sections.size()));
  for (auto& [name, payload] : c.sections) {
    put(static_cast<uint32_t>(name.size()));
    out += name;
    put(static_cast<uint64_t>(payload.size()));
    put(fnv1a(payload.data(), payload.size(), kFnv1aLegacyBasis));
    out += payload;
  }
  Checkpoint back = parse_checkpoint(out, "v1.ckpt");
  EXPECT_EQ(back.sections, c.sections);
  // ...and a version-1 header over standard checksums is corrupt: each version has one basis.
  std::string v2 = out;
  put32(v2, 8, kCheckpointVersion);
  EXPECT_THROW(parse_checkpoint(v2, "v2.ckpt"), IoError);
}

TEST(ModelFile, APayloadShorterThanTheHeaderPromisesIsAnError) {
  // A valid header, counts and checksum, but no weights: it used to load, reading past the end.
  auto craft = [](int64_t np, int64_t nb, size_t payload_floats) {
    std::string s = "RPLM0002";
    auto put = [&](auto v) { s.append(reinterpret_cast<const char*>(&v), sizeof v); };
    put(uint32_t(8));
    s += "resnet20";
    put(np);
    put(nb);
    s += std::string(payload_floats * 4, '\0');
    put(fnv1a(s.data(), s.size()));
    return s;
  };
  auto error = [](const std::string& bytes) {
    try {
      parse_model_file(bytes, "crafted/model.bin");
    } catch (const IoError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error(craft(10, 4, 14)), "") << "a consistent file parses";
  EXPECT_NE(error(craft(272186, 1568, 0)).find("crafted/model.bin"), std::string::npos) << "no payload";
  EXPECT_NE(error(craft(10, 4, 13)).find("truncated"), std::string::npos) << "one float short";
  EXPECT_NE(error(craft(10, 4, 15)).find("more than the header promises"), std::string::npos) << "one float long";
  EXPECT_NE(error(craft(int64_t(1) << 62, 0, 2)).find("do not fit"), std::string::npos) << "a count whose bytes overflow";
  EXPECT_NE(error(craft(-1, 4, 3)).find("negative"), std::string::npos);
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
  // The killed writer's temporary (step-00000001.ckpt.tmp.PID) goes at the next rotation.
  const std::string tmp = path + ".tmp." + std::to_string(child);
  if (std::filesystem::exists(tmp)) {
    rotate_checkpoints(d, 3);
    EXPECT_FALSE(std::filesystem::exists(tmp)) << "the dead writer's temporary is removed";
  }
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

namespace {
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Everything a run leaves: its steps, the model file, and its last checkpoint's sections.
struct RunRecord {
  FitResult fit;
  std::string model_bin;
  std::map<std::string, std::string> checkpoint;  // every section but the config (it names run_dir)
};

RunRecord record(const std::vector<std::string>& sets, const std::string& resume = "") {
  TrainerOptions o{.print = false, .on_step = nullptr, .resume = resume};
  Trainer t(parse_config("", "test", sets), o);
  RunRecord r;
  r.fit = t.fit();
  r.model_bin = file_bytes(t.config().train.run_dir + "/model.bin");
  r.checkpoint = read_checkpoint(r.fit.last_checkpoint).sections;
  r.checkpoint.erase("config");
  return r;
}
}  // namespace

TEST(Resume, HalfAndHalfIsBitIdenticalToStraight) {
  // fp16 with a high initial scale and a growth interval of 2 makes the scaler skip, back off and
  // grow on both sides of the split (measured: skips at steps 1, 2, 5 and 12, growth at 4, 7, 9,
  // 11), so its state in the checkpoint is exercised, not just carried at 65536.
  for (std::string precision : {"fp32", "fp16"}) {
    std::string d1 = dir_for("straight_" + precision), d2 = dir_for("halves_" + precision);
    std::vector<std::string> extra = {"train.precision=" + precision};
    if (precision == "fp16") {
      extra.push_back("train.loss_scale_init=1048576");
      extra.push_back("train.loss_scale_growth_interval=2");
    }
    auto sets = [&](const std::string& d, int64_t steps) {
      auto s = sets_for(d, 2, steps);
      s.insert(s.end(), extra.begin(), extra.end());
      return s;
    };
    const RunRecord straight = record(sets(d1, 12));
    const RunRecord first = record(sets(d2, 6));
    ASSERT_EQ(list_checkpoints(d2 + "/checkpoints").size(), 1u) << "the final state is checkpointed";
    const RunRecord resumed = record(sets(d2, 12), d2);

    // The resumed run starts where the first half stopped: it runs steps 7..12 only, and each of
    // its steps is the straight run's step (same loss, verdict, scale, optimizer step count).
    ASSERT_EQ(straight.fit.history.size(), 12u);
    ASSERT_EQ(resumed.fit.history.size(), 6u) << precision << ": the resumed run re-ran or skipped steps";
    EXPECT_EQ(resumed.fit.steps, 12);
    for (size_t i = 0; i < 6; ++i) {
      const StepStatus &a = resumed.fit.history[i], &b = straight.fit.history[6 + i];
      EXPECT_EQ(a.step, b.step) << precision << " step " << 7 + i;
      EXPECT_EQ(a.loss, b.loss) << precision << " step " << 7 + i;
      EXPECT_EQ(a.applied, b.applied) << precision << " step " << 7 + i;
      EXPECT_EQ(a.scale, b.scale) << precision << " step " << 7 + i;
    }
    if (precision == "fp16") {  // the scaler really moved, on both sides of the split
      // (a change of scale between consecutive steps: a skip can undo a growth, so the values
      // at the start, the split and the end may coincide on some CPU kernel copy)
      auto moved = [&](size_t from, size_t to) {
        for (size_t i = from; i + 1 < to; ++i)
          if (straight.fit.history[i].scale != straight.fit.history[i + 1].scale) return true;
        return false;
      };
      EXPECT_TRUE(moved(0, 7)) << "the scale changed before the split";
      EXPECT_TRUE(moved(6, 12)) << "and after it";
      EXPECT_GT(straight.fit.skipped, 0) << "some steps were skipped";
      EXPECT_EQ(resumed.fit.skipped, straight.fit.skipped) << "the skip count is carried across the resume";
    }
    // The whole model file (parameters and batch-norm buffers) and every checkpoint section
    // (parameters, every replica's statistics, optimizer state, loss scaler, data position).
    EXPECT_EQ(resumed.model_bin.size(), straight.model_bin.size());
    EXPECT_TRUE(resumed.model_bin == straight.model_bin) << precision << ": model.bin is not byte-identical";
    ASSERT_EQ(resumed.checkpoint.size(), straight.checkpoint.size());
    for (auto& [name, bytes] : straight.checkpoint) {
      ASSERT_TRUE(resumed.checkpoint.count(name)) << name;
      EXPECT_TRUE(resumed.checkpoint.at(name) == bytes) << precision << ": checkpoint section '" << name << "' differs";
    }
    EXPECT_TRUE(straight.checkpoint.count("buffers.1")) << "both replicas' statistics are kept";
    if (precision == "fp16") {
      EXPECT_TRUE(straight.checkpoint.count("scaler"));
    }
  }
}

TEST(Resume, WithEvaluationOnTheModelFileIsByteIdenticalAtEveryStopPosition) {
  // Default settings: evaluation after every epoch and a checkpoint at every epoch end. A stop
  // in mid-epoch (5), at an epoch's last step (8) and just after one (9), then a resume, must
  // leave the model file a straight run leaves: evaluation works on an averaged copy of the
  // batch-norm statistics and never changes what training carries on with.
  auto sets = [&](const std::string& d, int64_t steps) {
    auto s = sets_for(d, 2, steps, "train.eval=true");
    s.push_back("checkpoint.every_epochs=1");
    return s;
  };
  const std::string d1 = dir_for("eval_straight");
  const RunRecord straight = record(sets(d1, 16));
  for (int64_t split : {5, 8, 9}) {
    const std::string d2 = dir_for("eval_split_" + std::to_string(split));
    record(sets(d2, split));
    const RunRecord resumed = record(sets(d2, 16), d2);
    EXPECT_EQ(resumed.fit.history.size(), static_cast<size_t>(16 - split));
    EXPECT_TRUE(resumed.model_bin == straight.model_bin) << "stopped at step " << split << ": model.bin differs";
    for (auto& [name, bytes] : straight.checkpoint)
      EXPECT_TRUE(resumed.checkpoint.count(name) && resumed.checkpoint.at(name) == bytes)
          << "stopped at step " << split << ": checkpoint section '" << name << "' differs";
    EXPECT_EQ(resumed.fit.test.accuracy, straight.fit.test.accuracy) << "the same final evaluation";
  }
}

// The recipes' state across a resume (#52): with the moving average (warm-up 3 steps, an update
// every 2), label smoothing and the poly schedule on, evaluation after every epoch and sharded
// 16-bit masters, N steps straight and N/2 + resume + N/2 leave byte-identical model.bin,
// model_ema.bin and checkpoints (the average's weights and every replica's statistics in them),
// and the same evaluation of the average.
TEST(Resume, WithTheMovingAverageAndTheRecipesIsByteIdentical) {
  for (const std::string shard : {"none", "optimizer"}) {
    auto sets = [&](const std::string& d, int64_t steps) {
      auto s = sets_for(d, 2, steps, "train.eval=true");
      for (const char* k : {"checkpoint.every_epochs=1", "train.ema_decay=0.9", "train.ema_every=2",
                            "train.ema_warmup_epochs=0.375", "train.label_smoothing=0.1", "optim.schedule=poly",
                            "optim.warmup_epochs=0.5", "train.precision=bf16", "data.mixup_alpha=0.4",
                            "data.cutmix_alpha=1", "data.mix_prob=0.8", "data.augment=trivialaugment",
                            "data.random_erase=0.25"})
        s.push_back(k);
      s.push_back("parallel.shard=" + shard);
      return s;
    };
    const std::string d1 = dir_for("ema_straight_" + shard), d2 = dir_for("ema_split_" + shard);
    const RunRecord straight = record(sets(d1, 14));
    record(sets(d2, 7));
    const RunRecord resumed = record(sets(d2, 14), d2);
    EXPECT_TRUE(resumed.model_bin == straight.model_bin) << shard << ": model.bin differs";
    EXPECT_TRUE(file_bytes(d2 + "/model_ema.bin") == file_bytes(d1 + "/model_ema.bin")) << shard << ": model_ema.bin differs";
    EXPECT_FALSE(file_bytes(d1 + "/model_ema.bin") == straight.model_bin) << "the average is not the model";
    ASSERT_TRUE(straight.checkpoint.count("ema") && straight.checkpoint.count("ema_buffers.1")) << shard;
    for (auto& [name, bytes] : straight.checkpoint)
      EXPECT_TRUE(resumed.checkpoint.count(name) && resumed.checkpoint.at(name) == bytes)
          << shard << ": checkpoint section '" << name << "' differs";
    EXPECT_GT(straight.fit.test_ema.count, 0) << "the average is evaluated beside the live weights";
    EXPECT_EQ(resumed.fit.test_ema.accuracy, straight.fit.test_ema.accuracy);
    EXPECT_EQ(resumed.fit.test_ema.loss, straight.fit.test_ema.loss);
  }
}

TEST(Resume, OnAnotherReplicaCountKeepsTheGlobalBatch) {
  // 2 replicas with sync-BN normalise like 1 replica on the whole batch, so 4 steps on 2 replicas
  // then 4 on 1 replica match 8 steps on 2 up to float summation order (the equivalence test
  // measures ~1e-7 for this model).
  std::string d1 = dir_for("world_straight"), d2 = dir_for("world_switch");
  auto straight = run(sets_for(d1, 2, 8, "parallel.sync_bn=true"));
  run(sets_for(d2, 2, 4, "parallel.sync_bn=true"));
  // A resume that ignored the checkpoint would run 8 steps from scratch and match just as well:
  // the resumed run must run steps 5..8 only.
  TrainerOptions ro{.print = false, .on_step = nullptr, .resume = d2};
  Trainer resumed(parse_config("", "test", sets_for(d2, 1, 8, "parallel.sync_bn=true")), ro);
  const FitResult fr = resumed.fit();
  ASSERT_EQ(fr.history.size(), 4u) << "resumed at step 4";
  EXPECT_EQ(fr.history.front().step, 5);
  const Tensor& rp = resumed.model(0).params();
  const std::vector<float> switched(rp.data<float>(), rp.data<float>() + rp.numel());
  EXPECT_LT(replica::testing::max_rel_diff(switched, straight), 1e-5);
  // with micro_batch fixed at 16, 1 replica needs 2 accumulation steps for the same global batch
  auto acc = sets_for(d2, 1, 8, "parallel.sync_bn=true");
  acc.push_back("train.micro_batch=16");
  TrainerOptions o{.print = false, .on_step = nullptr, .resume = d2};
  Trainer t(parse_config("", "test", acc), o);
  EXPECT_EQ(t.accumulation(), 2);
}

// A checkpoint whose moving average does not fit the model (a crafted or mixed-up file) is named
// and skipped before anything is applied, as its parameters would be: never a read past a section.
TEST(Resume, AMovingAverageOfTheWrongSizeIsANamedErrorNotARead) {
  const std::string d = dir_for("ema_crafted");
  auto sets = sets_for(d, 2, 4, "train.ema_decay=0.9");
  run(sets);
  auto all = list_checkpoints(d + "/checkpoints");
  ASSERT_EQ(all.size(), 1u);
  for (const char* section : {"ema", "ema_buffers.1"}) {
    Checkpoint ck = read_checkpoint(all[0]);
    ck.sections.at(section).resize(ck.sections.at(section).size() / 2);
    const std::string crafted = d + "/crafted.ckpt";
    write_checkpoint(ck, crafted);
    TrainerOptions o{.print = false, .on_step = nullptr, .resume = crafted};
    try {
      Trainer t(parse_config("", "test", sets), o);
      ADD_FAILURE() << section << ": a half-size section was accepted";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("section '") + section + "'"), std::string::npos) << e.what();
    }
  }
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
