// Integration: the `replica` binary trains a small model for a few steps (the loss falls), writes
// its run directory, evaluates the saved model, reports bad input with exit code 2, and survives
// kill -9 at random moments with resume giving the straight run's model file.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <sstream>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <random>
#include <regex>
#include <thread>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/file_io.h"
#include "core/json.h"

namespace {

const std::string kBin = std::string(REPLICA_BINARY_DIR) + "/apps/replica";
// A cross build's tests run the binary behind the emulator its tests run under (qemu-user, from
// CMAKE_CROSSCOMPILING_EMULATOR): a host without binfmt_misc cannot exec it directly.
#ifdef REPLICA_TEST_EMULATOR
const std::vector<std::string> kEmulator = [] {
  std::vector<std::string> words;
  std::istringstream in(REPLICA_TEST_EMULATOR);
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}();
#else
const std::vector<std::string> kEmulator;
#endif

struct Result {
  int code;
  std::string out;
};

Result run(const std::string& args) {
  std::string cmd;
  for (const auto& w : kEmulator) cmd += w + " ";
  cmd += kBin + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

bool have_fashion_mnist() {
  return std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

// Starts the replica binary with `args`, stdout and stderr into `log`; returns its pid.
pid_t spawn(const std::vector<std::string>& args, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "w");
    dup2(fileno(f), 1);
    dup2(fileno(f), 2);
    std::vector<char*> argv;
    for (auto& w : kEmulator) argv.push_back(const_cast<char*>(w.c_str()));
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Waits for it; returns the exit status and what it printed.
std::pair<int, std::string> reap(pid_t pid, const std::string& log) {
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(log);
  return {status, std::string((std::istreambuf_iterator<char>(in)), {})};
}

}  // namespace

TEST(Cli, TrainsAndTheLossFallsThenEvaluates) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  const std::string dir = ::testing::TempDir() + "/cli_run";
  std::filesystem::remove_all(dir);
  auto r = run("train --devices cpu:2 --run-dir " + dir +
               " --set model.width=8 --set data.limit_train=4096 --set data.limit_test=1000"
               " --set train.global_batch=64 --set train.max_steps=40 --set train.log_every=10"
               " --set optim.schedule=constant --set optim.lr=0.05");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("2 replicas"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("test loss"), std::string::npos) << r.out;
  // metrics.jsonl: one line per logged step and per evaluation, then the run's summary
  std::ifstream m(dir + "/metrics.jsonl");
  std::vector<double> losses;
  std::string line, last;
  int evals = 0, summaries = 0;
  std::regex loss_re("\"kind\":\"step\".*\"loss\":([0-9.eE+-]+)");
  while (std::getline(m, line)) {
    last = line;
    std::smatch sm;
    if (std::regex_search(line, sm, loss_re)) losses.push_back(std::stod(sm[1]));
    if (line.find("\"kind\":\"eval\"") != std::string::npos) evals++;
    if (line.find("\"kind\":\"summary\"") != std::string::npos) {
      summaries++;
      for (const char* field : {"\"steps\":40", "\"compute_s\":", "\"allreduce_wait_s\":", "\"peak_mib\":"})
        EXPECT_NE(line.find(field), std::string::npos) << line;
      continue;
    }
    for (const char* field : {"\"step\":", "\"epoch\":", "\"loss\":", "\"accuracy\":"})
      EXPECT_NE(line.find(field), std::string::npos) << line;
  }
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_EQ(evals, 1);
  EXPECT_EQ(summaries, 1);
  EXPECT_NE(last.find("\"kind\":\"summary\""), std::string::npos) << "the summary is the last record";
  EXPECT_NE(r.out.find("run report: 40 steps"), std::string::npos) << r.out;
  EXPECT_LT(losses.back(), losses.front() * 0.8) << "the loss falls: " << losses.front() << " -> " << losses.back();
  EXPECT_TRUE(std::filesystem::exists(dir + "/config.yaml"));
  ASSERT_TRUE(std::filesystem::exists(dir + "/model.bin"));

  // The saved model, loaded by another process on another replica count, scores what the run
  // reported for its last evaluation: the same accuracy (a count of 1000 images) and loss.
  auto e = run("eval --devices cpu:1 --set model.width=8 --set data.limit_test=1000 --model " + dir + "/model.bin");
  ASSERT_EQ(e.code, 0) << e.out;
  std::regex eval_re("test loss ([0-9.]+) accuracy ([0-9.]+)%");
  std::smatch trained_m, loaded_m;
  std::string last_eval;
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), eval_re); it != std::sregex_iterator(); ++it)
    last_eval = it->str();
  ASSERT_TRUE(std::regex_search(last_eval, trained_m, eval_re)) << r.out;
  ASSERT_TRUE(std::regex_search(e.out, loaded_m, eval_re)) << e.out;
  EXPECT_EQ(loaded_m[2].str(), trained_m[2].str()) << "accuracy of the loaded model vs the run's last evaluation";
  EXPECT_NEAR(std::stod(loaded_m[1].str()), std::stod(trained_m[1].str()), 2e-4) << "test loss";
  // the wrong architecture for that file is a clear error
  auto w = run("eval --devices cpu:1 --set model.width=16 --set data.limit_test=100 --model " + dir + "/model.bin");
  EXPECT_EQ(w.code, 1);
  EXPECT_NE(w.out.find("does not match"), std::string::npos) << w.out;
}

TEST(Cli, BadInputIsAClearErrorWithExitCode2) {
  const std::string cfg = ::testing::TempDir() + "/bad.yaml";
  std::ofstream(cfg) << "train:\n  epcohs: 2\n";
  auto r = run("train " + cfg);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("bad.yaml:2: train.epcohs: unknown key; did you mean 'epochs'?"), std::string::npos) << r.out;
  r = run("train --devices cpu:0");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("cpu:0"), std::string::npos) << r.out;
  r = run("train --set data.path=/nonexistent --devices cpu:1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("/nonexistent/train-images-idx3-ubyte: cannot open"), std::string::npos) << r.out;
}

// train.cuda_graph: a value it does not take is a configuration error listing the values; on asked
// of a CPU replica says it needs a GPU; auto on a CPU replica trains eagerly, without a word.
TEST(Cli, CudaGraphSettingsAreCheckedAndAutoStaysEagerOnCpu) {
  const std::string common = " --devices cpu:1 --set model.width=4 --set data.dataset=synthetic --set data.synthetic_size=64"
                             " --set data.mean=[0.5] --set data.std=[0.25] --set train.global_batch=16 --set train.max_steps=2"
                             " --set train.eval=false --run-dir " + ::testing::TempDir() + "/cli_graph";
  auto r = run("train" + common + " --set train.cuda_graph=always");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("train.cuda_graph"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("auto"), std::string::npos) << r.out;
  r = run("train" + common + " --set train.cuda_graph=on");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("train.cuda_graph: on: CUDA graphs need GPU replicas, and cpu:0 is not one"), std::string::npos)
      << r.out;
  r = run("train" + common + " --set train.cuda_graph=auto");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("cuda_graph"), std::string::npos) << r.out;
}

// Fewer replicas left after a shrink than parallel.min_replicas: the run checkpoints and stops
// with exit 75, the restartable status (the lost device back, or a lower minimum, continues), not 1.
TEST(Cli, TooFewReplicasAfterAShrinkExitsRestartable) {
  const std::string dir = ::testing::TempDir() + "/cli_min_replicas";
  std::filesystem::remove_all(dir);
  const std::string args = " --devices cpu:2 --set model.width=4 --set data.dataset=synthetic --set data.synthetic_size=256"
                           " --set data.synthetic_shape=[8,8,1] --set data.mean=[0.5] --set data.std=[0.25]"
                           " --set train.global_batch=32 --set train.max_steps=6 --set train.eval=false"
                           " --set parallel.on_replica_failure=shrink --set parallel.min_replicas=2 --run-dir " + dir;
  setenv("REPLICA_FAULT", "replica:1:step:3", 1);
  const Result r = run("train" + args);
  unsetenv("REPLICA_FAULT");
  EXPECT_EQ(r.code, 75) << r.out;
  EXPECT_NE(r.out.find("parallel.min_replicas 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("exit 75: restartable"), std::string::npos) << r.out;
}

// A command line that does not parse is a usage error like a bad configuration: exit 2 with a line
// naming the option (CLI11's own codes, 105 and up, are not what scripts expect); --help exits 0.
TEST(Cli, UsageErrorsExitWith2AndNameTheOption) {
  struct Case {
    const char* args;
    int code;
    const char* says;
  };
  for (const Case& c : {Case{"train --no-such-option", 2, "--no-such-option"},
                        Case{"", 2, "subcommand"},
                        Case{"bench allreduce -d int8", 2, "--dtype: int8 not in"},
                        Case{"bench allreduce --devices cpu:1 -b 12Q", 2, "--minbytes"},
                        Case{"export", 2, "out is required"},
                        Case{"--help", 0, "train"},
                        Case{"bench allreduce --help", 0, "--dtype"}}) {
    auto r = run(c.args);
    EXPECT_EQ(r.code, c.code) << "replica " << c.args << ":\n" << r.out;
    EXPECT_NE(r.out.find(c.says), std::string::npos) << "replica " << c.args << ":\n" << r.out;
  }
}

// Every dtype the all-reduce benchmark takes reduces correctly (its #wrong column counts the
// elements that differ from the exact sum) at sizes across the unit and block boundaries.
TEST(Cli, BenchAllreduceIsRightInEveryDtype) {
  for (const char* dt : {"f32", "f16", "bf16"}) {
    auto r = run(std::string("bench allreduce --devices cpu:3 -b 4 -e 300K -f 9 -n 2 -d ") + dt);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(std::string(dt) + " sum"), std::string::npos) << r.out;
    std::istringstream lines(r.out);
    int rows = 0;
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] == '#') continue;
      std::istringstream f(line);
      double bytes, count, us, alg, bus;
      long wrong = -1;
      f >> bytes >> count >> us >> alg >> bus >> wrong;
      EXPECT_EQ(wrong, 0) << dt << ": " << line;
      ++rows;
    }
    EXPECT_EQ(rows, 6) << r.out;
  }
  // a dtype it does not take: Cli.UsageErrorsExitWith2AndNameTheOption
}

TEST(Cli, DevicesListsCpuAndSaysWhyNoGpu) {
  auto r = run("devices");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("CPU:"), std::string::npos);
  EXPECT_NE(r.out.find("cpu:1: pool growth"), std::string::npos) << r.out;
}

TEST(Cli, SigtermCheckpointsExitsCleanlyAndResumes) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const std::string dir = ::testing::TempDir() + "/cli_sigterm";
  const std::string log = ::testing::TempDir() + "/cli_sigterm.log";
  std::filesystem::remove_all(dir);
  const std::vector<std::string> args = {kBin, "train", "--devices", "cpu:2", "--run-dir", dir,
                                         "--set", "model.width=8", "--set", "data.limit_train=8192",
                                         "--set", "data.limit_test=500", "--set", "train.global_batch=64",
                                         "--set", "train.log_every=1", "--set", "train.epochs=2"};
  pid_t pid = spawn(args, log);
  ASSERT_GT(pid, 0);
  // wait until it has trained a few steps
  for (int i = 0; i < 600; ++i) {
    std::ifstream m(dir + "/metrics.jsonl");
    int lines = 0;
    std::string line;
    while (std::getline(m, line)) lines++;
    if (lines >= 3) break;
    usleep(50 * 1000);
  }
  kill(pid, SIGTERM);
  auto [status, out] = reap(pid, log);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("stopped (signal 15)"), std::string::npos) << out;
  EXPECT_NE(out.find("resume with: replica train --resume " + dir), std::string::npos) << out;
  ASSERT_FALSE(std::filesystem::is_empty(dir + "/checkpoints"));

  auto r = run("train --devices cpu:2 --resume " + dir +
               " --set model.width=8 --set data.limit_train=8192 --set data.limit_test=500"
               " --set train.global_batch=64 --set train.log_every=1 --set train.epochs=2 --set train.max_steps=12");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from " + dir + "/checkpoints/step-"), std::string::npos) << r.out;
  // a checkpoint evaluates with the configuration it carries
  auto e = run("eval --devices cpu:1 --checkpoint " + dir);
  EXPECT_EQ(e.code, 0) << e.out;
  EXPECT_NE(e.out.find("accuracy"), std::string::npos) << e.out;
  EXPECT_NE(e.out.find("(500 images)"), std::string::npos) << e.out;
}

TEST(Cli, AllocationTraceReplaysAgainstEveryPolicy) {
  const std::string dir = ::testing::TempDir() + "/cli_alloc", csv = ::testing::TempDir() + "/alloc.csv";
  auto r = run("train --devices cpu:1 --run-dir " + dir + " --alloc-trace " + csv +
               " --set model.width=4 --set data.dataset=synthetic --set data.synthetic_size=256"
               " --set data.mean=[0.5] --set data.std=[0.25] --set train.global_batch=16 --set train.max_steps=2"
               " --set train.eval=false");
  ASSERT_EQ(r.code, 0) << r.out;
  auto b = run("bench alloc --replay " + csv);
  ASSERT_EQ(b.code, 0) << b.out;
  for (const char* p : {"best-fit preallocate", "growth", "platform", "lifetime-aware packing"})
    EXPECT_NE(b.out.find(p), std::string::npos) << b.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(b.out, m, std::regex("best-fit preallocate \\(at min cap\\.\\)\\s+\\S+ \\S+\\s+([0-9.]+)x")));
  EXPECT_GE(std::stod(m[1]), 1.0);
  EXPECT_LT(std::stod(m[1]), 2.0);
  EXPECT_EQ(run("bench alloc --replay /nonexistent.csv").code, 1);
}

// `bench host` runs a pass through a backend that counts ops and computes nothing; its op counts
// are the model's: ResNet-20 with each block's join fused (batch norm + add + ReLU one op, no
// relu_backward or add-backward), and 9 + 18 more without (REPLICA_FUSED_JOIN=0). No timing is judged.
TEST(Cli, BenchHostCountsTheOpsOfAPassWithAndWithoutTheFusedJoinAndOfAnOptimizerStep) {
  auto counts = [](const std::string& out) {
    std::smatch f, b;
    EXPECT_TRUE(std::regex_search(out, f, std::regex("\\nforward +([0-9]+) ")) && std::regex_search(out, b, std::regex("\\nbackward +([0-9]+) ")))
        << out;
    return f.size() > 1 && b.size() > 1 ? std::make_pair(std::stoi(f[1]), std::stoi(b[1])) : std::make_pair(0, 0);
  };
  auto fused = run("bench host --arch resnet20 --batch 4 --passes 2");
  ASSERT_EQ(fused.code, 0) << fused.out;
  setenv("REPLICA_FUSED_JOIN", "0", 1);
  auto plain = run("bench host --arch resnet20 --batch 4 --passes 2");
  unsetenv("REPLICA_FUSED_JOIN");
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_EQ(counts(fused.out), std::make_pair(47, 64));
  EXPECT_EQ(counts(plain.out), std::make_pair(47 + 9, 64 + 18));  // add_relu; relu_backward and axpy
  // The optimizer's step is one backend call over every parameter group (LARS: and its ratios).
  std::smatch sgd, lars;
  ASSERT_TRUE(std::regex_search(fused.out, sgd, std::regex("\nsgd, no_decay_bn_bias +([0-9]+) +([0-9]+) ")) &&
              std::regex_search(fused.out, lars, std::regex("\nlars +([0-9]+) +([0-9]+) ")))
      << fused.out;
  EXPECT_EQ(std::make_pair(std::stoi(sgd[1]), std::stoi(sgd[2])), std::make_pair(44, 1)) << "groups, calls";
  EXPECT_EQ(std::make_pair(std::stoi(lars[1]), std::stoi(lars[2])), std::make_pair(65, 2)) << "tensors, calls";
  EXPECT_EQ(run("bench host --arch resnet7").code, 2);
}

TEST(Cli, ASecondSignalExitsAtOnce) {
  const std::string dir = ::testing::TempDir() + "/cli_twice", log = ::testing::TempDir() + "/cli_twice.log";
  std::filesystem::remove_all(dir);
  const std::vector<std::string> args = {kBin, "train", "--devices", "cpu:1", "--run-dir", dir,
                                         "--set", "data.dataset=synthetic",
                                         "--set", "data.mean=[0.5]", "--set", "data.std=[0.25]",
                                         "--set", "data.synthetic_size=20000", "--set", "train.log_every=1"};
  pid_t pid = spawn(args, log);
  ASSERT_GT(pid, 0);
  for (int i = 0; i < 600 && !std::filesystem::exists(dir + "/metrics.jsonl"); ++i) usleep(50 * 1000);
  usleep(300 * 1000);
  // Signals of one kind do not queue: the second must come after the first was handled, and
  // before the step in progress (about 0.3 s for this model on one core) ends.
  kill(pid, SIGINT);
  usleep(30 * 1000);
  kill(pid, SIGINT);
  auto [status, out] = reap(pid, log);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGINT) << out;
  EXPECT_NE(out.find("second signal, exiting now"), std::string::npos) << out;
}

// kill -9 at seeded random moments (mid-step, mid-evaluation, mid-checkpoint write), resuming
// after each, must end with the model file a straight run writes, byte for byte: with default
// settings (evaluation and a checkpoint after every epoch), nothing lost and nothing changed.
TEST(Cli, KilledAtRandomMomentsAndResumedEqualsAStraightRun) {
  const std::string base = ::testing::TempDir() + "/cli_kill9";
  std::filesystem::remove_all(base);
  std::vector<std::string> common = {"train", "--devices", "cpu:2"};
  for (const char* s : {"model.width=4", "data.dataset=synthetic", "data.synthetic_shape=[8,8,1]",
                        "data.synthetic_size=512", "data.mean=[0.5]", "data.std=[0.25]", "train.global_batch=32",
                        "train.epochs=12", "train.log_every=1000"}) {
    common.push_back("--set");
    common.push_back(s);
  }
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {kBin};
    a.insert(a.end(), common.begin(), common.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto [st, out] = reap(spawn(with({"--run-dir", base + "/straight"}), base + ".straight.log"), base + ".straight.log");
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << out;
  const double straight_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const std::string dir = base + "/killed";
  constexpr int64_t kTotalSteps = 12 * 512 / 32;  // epochs x steps per epoch
  std::mt19937 rng(20261201);
  int kills = 0, attempts = 0;
  for (;; ++attempts) {
    ASSERT_LT(attempts, 40) << "no progress after 40 attempts";
    // The newest checkpoint's step (file names are zero-padded, so the largest name is newest).
    int64_t done = 0;
    if (std::filesystem::exists(dir + "/checkpoints"))
      for (auto& e : std::filesystem::directory_iterator(dir + "/checkpoints")) {
        const std::string n = e.path().filename().string();
        if (n.rfind("step-", 0) == 0 && n.size() == 18 && n.substr(13) == ".ckpt") done = std::max<int64_t>(done, std::stoll(n.substr(5, 8)));
      }
    const bool have = done > 0;
    std::vector<std::string> extra = {"--run-dir", dir};
    if (have) extra.insert(extra.end(), {"--resume", dir});
    const std::string log = base + ".attempt" + std::to_string(attempts) + ".log";
    pid_t pid = spawn(with(extra), log);
    // Until 10 kills have landed, each attempt is killed at a random moment within what a straight
    // run would take for the steps left (start-up, steps, evaluations, checkpoint writes); then
    // one attempt runs to the end. An attempt may still finish first: the test then ends there.
    if (kills < 10) {
      // Half of that: a sanitizer build's start-up is a larger share of its run.
      const double left = 0.5 * straight_ms * (1.0 - static_cast<double>(done) / kTotalSteps);
      const int ms = std::uniform_int_distribution<int>(10, std::max(60, static_cast<int>(left)))(rng);
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      kill(pid, SIGKILL);
    }
    auto [s, o] = reap(pid, log);
    if (WIFEXITED(s)) {
      ASSERT_EQ(WEXITSTATUS(s), 0) << o;
      break;  // finished before the kill landed
    }
    ASSERT_TRUE(WIFSIGNALED(s) && WTERMSIG(s) == SIGKILL) << o;
    kills++;
  }
  std::printf("%d kills over %d attempts (straight run %.0f ms)\n", kills, attempts + 1, straight_ms);
  EXPECT_GE(kills, 3) << "the kills must land, or the test shows nothing";
  auto bytes = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  const std::string want = bytes(base + "/straight/model.bin");
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(bytes(dir + "/model.bin") == want) << "the killed-and-resumed run's model.bin differs from the straight run's";
  for (auto& e : std::filesystem::directory_iterator(dir + "/checkpoints"))
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << "a killed writer's temporary was left: " << e.path();
}

// export writes PyTorch-named safetensors beside the run; import reads them back into a model
// file identical to the run's; --version says what the build has.
TEST(Cli, ExportThenImportGivesTheModelBack) {
  const std::string dir = ::testing::TempDir() + "/cli_export";
  auto r = run("train --devices cpu:1 --run-dir " + dir +
               " --set model.width=4 --set data.dataset=synthetic --set data.synthetic_size=256"
               " --set data.mean=[0.5] --set data.std=[0.25] --set train.global_batch=16 --set train.max_steps=2"
               " --set train.eval=false");
  ASSERT_EQ(r.code, 0) << r.out;
  auto e = run("export --model " + dir + "/model.bin " + dir + "/model.safetensors --dtype fp32");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_NE(e.out.find("with PyTorch's names"), std::string::npos) << e.out;
  auto i = run("import " + dir + "/model.safetensors --out " + dir + "/back.bin --config " + dir + "/config.yaml");
  ASSERT_EQ(i.code, 0) << i.out;
  std::ifstream a(dir + "/model.bin", std::ios::binary), b(dir + "/back.bin", std::ios::binary);
  const std::string ab((std::istreambuf_iterator<char>(a)), {}), bb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(ab.empty());
  EXPECT_TRUE(ab == bb) << "the imported model file differs from the exported run's";
  // Into a model of another shape: an error that names the file and the mismatch, exit code 1.
  auto bad = run("import " + dir + "/model.safetensors --out " + dir + "/bad.bin --config " + dir +
                 "/config.yaml --set model.width=8");
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("model.safetensors: does not fit"), std::string::npos) << bad.out;
  EXPECT_EQ(run("export --model " + dir + "/model.bin " + dir + "/x.safetensors --dtype fp8").code, 2);
  auto v = run("--version");
  EXPECT_EQ(v.code, 0) << v.out;
  EXPECT_NE(v.out.find("replica 0."), std::string::npos) << v.out;
  EXPECT_NE(v.out.find("MPI:"), std::string::npos) << v.out;
}

// --version names the commit the binary was built from, not the one its build directory was
// configured at (an incremental build after a commit used to print the old one).
TEST(Cli, VersionNamesTheCommitItWasBuiltFrom) {
  FILE* p = popen("git -C " REPLICA_SOURCE_DIR " rev-parse --short=12 HEAD 2>/dev/null", "r");
  char buf[64] = {};
  const bool got = p && std::fgets(buf, sizeof buf, p);
  if (p) pclose(p);
  std::string head = got ? std::string(buf) : "";
  while (!head.empty() && (head.back() == '\n' || head.back() == '\r')) head.pop_back();
  if (head.size() != 12) GTEST_SKIP() << "the sources are not a git checkout";
  auto v = run("--version");
  EXPECT_NE(v.out.find("(git " + head), std::string::npos) << "HEAD is " << head << ":\n" << v.out;
}

// Each CPU kernel copy this CPU runs (REPLICA_CPU_ISA, ops/cpu/isa.h) trains deterministically:
// the same seed on the same level gives the same model.bin, bit for bit; --version names the
// level in use; a level the value does not name, or one this CPU lacks, is a configuration
// error (exit 2) naming REPLICA_CPU_ISA and what to set.
TEST(Cli, EveryCpuLevelIsDeterministicAndForcingOneIsChecked) {
  const std::string dir = ::testing::TempDir() + "/isa_levels";
  const std::string common =
      " --set model.arch=resnet20 --set data.dataset=synthetic --set data.synthetic_shape=[12,12,3]"
      " --set data.mean=[0.5,0.5,0.5] --set data.std=[0.25,0.25,0.25] --set data.synthetic_size=256 --set train.global_batch=32 --set train.max_steps=3 --set train.eval=false"
      " --devices cpu:1 --set train.run_dir=";
  auto model_bytes = [&](const std::string& level, int run_no) {
    const std::string rd = dir + "/" + level + std::to_string(run_no);
    std::filesystem::remove_all(rd);
    auto r = run("train" + common + rd + " --set train.precision=bf16");
    EXPECT_EQ(r.code, 0) << r.out;
    std::ifstream in(rd + "/model.bin", std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  std::vector<std::string> models;  // one per level that ran
  for (const char* level : {"baseline", "avx2", "avx512"}) {
    ::setenv("REPLICA_CPU_ISA", level, 1);
    auto v = run("--version");
    if (v.out.find("CPU kernels: unusable") != std::string::npos) {  // a level above this CPU, or not built
      EXPECT_NE(v.out.find("CPU kernels: unusable: REPLICA_CPU_ISA=" + std::string(level)), std::string::npos) << v.out;
      auto r = run("train" + common + dir + "/refused");
      EXPECT_EQ(r.code, 2) << r.out;
      EXPECT_NE(r.out.find("REPLICA_CPU_ISA=" + std::string(level)), std::string::npos) << r.out;
      continue;
    }
    EXPECT_NE(v.out.find("CPU kernels: " + std::string(level) + " ("), std::string::npos) << v.out;
    const std::string a = model_bytes(level, 1), b = model_bytes(level, 2);
    EXPECT_GT(a.size(), 1000u) << level;
    EXPECT_TRUE(a == b) << "two runs on the " << level << " kernels differ";
    models.push_back(a);
  }
  // The variable really changes the path: the levels round differently (FMA, wider sums).
  if (models.size() >= 2) {
    EXPECT_TRUE(models.front() != models.back()) << "every level gave the same bits";
  }
  ::setenv("REPLICA_CPU_ISA", "avx3", 1);
  auto r = run("train" + common + dir + "/bogus");
  ::unsetenv("REPLICA_CPU_ISA");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("REPLICA_CPU_ISA='avx3' is not a level: use baseline, avx2 or avx512"), std::string::npos)
      << r.out;
}

// `replica plan`: a line per alternative from a profile measured here and a fitted or table link;
// its JSON parses; a saved profile plans elsewhere and is refused for another model; bad input
// exits 2 naming what to pass.
TEST(Cli, PlanPredictsEachAlternativeAndNamesBadInput) {
  const std::string dir = ::testing::TempDir() + "replica_plan";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string tiny =
      " --set model.width=4 --set data.dataset=synthetic --set data.synthetic_shape=[8,8,1] --set data.synthetic_size=64"
      " --set data.mean=[0.5] --set data.std=[0.25] --set train.global_batch=16 --set parallel.devices=cpu:1";
  // A link file in bench allreduce's format with known times (a measured one is noisy when the
  // tests run side by side; the fit itself is LinkModel.FitRecoversAlphaAndBandwidthFromBenchOutput).
  std::string bench = "# replica bench allreduce: 2 ranks (cpu:2 per process), host communicator (shared memory), f32 sum\n";
  for (double bytes = 1024; bytes <= 64 << 20; bytes *= 4)
    bench += " " + std::to_string(static_cast<long>(bytes)) + " " + std::to_string(static_cast<long>(bytes / 4)) + " " +
             std::to_string(2.0 + bytes / 8e3) + " 1 1 0 10\n";  // 1 us per hop, 8 GB/s
  replica::write_file_atomic(dir + "/link.txt", bench);
  auto r = run("plan" + tiny + " --devices 1,2,4 --link-file " + dir + "/link.txt --profile-steps 2 --save-profile " +
               dir + "/profile.json");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* want : {"global batch 16", "\n1 host", "\n2 host", "\n4 host", "link host: fitted to"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  // The saved profile plans GPUs on a table link, as JSON; the same numbers every time.
  auto j = run("plan" + tiny + " --devices 2,2x2 --link nvlink4 --inter-link ib-ndr --no-memory --json --device-profile " +
               dir + "/profile.json");
  ASSERT_EQ(j.code, 0) << j.out;
  const std::string line = j.out.substr(j.out.find("{\"kind\":\"plan\""));
  const replica::Json plan = replica::Json::parse(line);
  ASSERT_EQ(plan["alternatives"].size(), 2u);
  EXPECT_EQ(plan["alternatives"][1]["nodes"], 2);
  EXPECT_EQ(plan["alternatives"][1]["inter_link"], "ib-ndr");
  EXPECT_GT(plan["alternatives"][0]["images_per_s"].get<double>(), 0);
  EXPECT_EQ(run("plan" + tiny + " --devices 2,2x2 --link nvlink4 --inter-link ib-ndr --no-memory --json --device-profile " +
                dir + "/profile.json").out,
            j.out);
  // A run's trace is a profile too (its own steps, as that run ran them).
  auto train = run("train" + tiny + " --set parallel.devices=cpu:2 --set train.max_steps=6 --set train.eval=false"
                   " --set checkpoint.every_epochs=0 --set train.tensorboard=false --run-dir " + dir + "/run --trace " +
                   dir + "/trace.json");
  ASSERT_EQ(train.code, 0) << train.out;
  auto traced = run("plan" + tiny + " --devices 2,4 --link-file " + dir + "/link.txt --no-memory --trace-profile " + dir +
                    "/trace.json");
  ASSERT_EQ(traced.code, 0) << traced.out;
  EXPECT_NE(traced.out.find("replica 0 of 2, in a run"), std::string::npos) << traced.out;
  struct Bad {
    std::string args, needle;
  };
  for (const Bad& b : std::vector<Bad>{
           {tiny + " --devices 2 --link nvlink9", "--link 'nvlink9' is not a known link"},
           {tiny + " --devices 2", "--link-file FILE is needed for CPU replicas"},
           {tiny + " --devices 3 --link pcie4", "does not divide train.global_batch 16"},
           {tiny + " --devices 2x2 --link pcie4", "--inter-link"},
           {tiny + " --devices two --link pcie4", "'two' is not a positive count"},
           {" --set model.arch=resnet32" + tiny + " --devices 2 --link pcie4 --device-profile " + dir + "/profile.json",
            "is a profile of 'resnet20"},
           {tiny + " --devices 2 --link pcie4 --device-profile " + dir + "/link.txt", "not a step profile"},
           {tiny + " --devices 2 --link pcie4 --trace-profile " + dir + "/link.txt", "not a trace"},
           {tiny + " --devices 2 --link pcie4 --profile --trace-profile " + dir + "/trace.json", "give one of"},
       }) {
    auto e = run("plan" + b.args + " --no-memory");
    EXPECT_EQ(e.code, 2) << b.args << "\n" << e.out;
    EXPECT_NE(e.out.find(b.needle), std::string::npos) << b.needle << "\n" << e.out;
  }
}

// The CPU kernels' per-CPU choice (ops/cpu/tuning.h): where the avx512 copy runs, the first run
// measures 256- against 512-bit direct kernels on its model's layers and keeps the result per CPU
// model; the next run and --version read it; REPLICA_DIRECT_ZMM forces either width, and the
// trained bits are the same whichever width runs.
TEST(Cli, TheDirectKernelsWidthIsCalibratedOnceCachedAndForcible) {
  const std::string dir = ::testing::TempDir() + "/cpu_tuning";
  std::filesystem::remove_all(dir);
  ::setenv("REPLICA_CACHE_DIR", (dir + "/cache").c_str(), 1);
  const std::string common =
      " --set model.arch=resnet20 --set data.dataset=synthetic --set data.synthetic_shape=[16,16,3]"
      " --set data.mean=[0.5,0.5,0.5] --set data.std=[0.25,0.25,0.25] --set data.synthetic_size=256"
      " --set train.global_batch=32 --set train.max_steps=2 --set train.eval=false --devices cpu:1 --set train.run_dir=";
  auto model = [&](const std::string& rd) {
    std::ifstream in(rd + "/model.bin", std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  auto first = run("train" + common + dir + "/a");
  EXPECT_EQ(first.code, 0) << first.out;
  const bool avx512 = first.out.find("replica: cpu kernels avx512;") != std::string::npos;
  if (avx512) {
    EXPECT_NE(first.out.find("(calibrated now: 512-bit "), std::string::npos) << first.out;
    EXPECT_TRUE(std::filesystem::exists(dir + "/cache/cpu-tuning.json"));
    auto second = run("train" + common + dir + "/b");
    EXPECT_NE(second.out.find("(cached: 512-bit "), std::string::npos) << second.out;
    auto v = run("--version");
    EXPECT_NE(v.out.find("CPU tuning: direct convolutions in "), std::string::npos) << v.out;
    EXPECT_NE(v.out.find("cpu-tuning.json"), std::string::npos) << v.out;
  } else {
    EXPECT_NE(first.out.find("the only width of the"), std::string::npos) << first.out;
  }
  for (const char* zmm : {"0", "1"}) {
    ::setenv("REPLICA_DIRECT_ZMM", zmm, 1);
    auto r = run("train" + common + dir + "/zmm" + zmm);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(std::string("REPLICA_DIRECT_ZMM=") + zmm), std::string::npos) << r.out;
    EXPECT_TRUE(model(dir + "/zmm" + zmm) == model(dir + "/a")) << "REPLICA_DIRECT_ZMM=" << zmm << " changed the bits";
  }
  ::unsetenv("REPLICA_DIRECT_ZMM");
  ::unsetenv("REPLICA_CACHE_DIR");
}

// The CPU calibration's cache is outside bytes (a user's file): damaged, hand-edited or crafted
// contents are skipped or replaced, never a crash, and a run still starts.
TEST(Cli, ADamagedOrCraftedCpuTuningCacheIsReplacedNotACrash) {
  const std::string dir = ::testing::TempDir() + "/cpu_tuning_bad";
  const std::string common =
      " --set model.arch=resnet20 --set data.dataset=synthetic --set data.synthetic_shape=[8,8,1]"
      " --set data.mean=[0.5] --set data.std=[0.25] --set data.synthetic_size=64 --set model.width=4"
      " --set train.global_batch=16 --set train.max_steps=1 --set train.eval=false --devices cpu:1 --set train.run_dir=";
  const char* contents[] = {
      "{not json",
      "[1, 2, 3]",
      "{\"kind\": 7, \"entries\": []}",
      "{\"kind\": \"replica cpu tuning\", \"entries\": {\"a\": 1}}",
      "{\"kind\": \"replica cpu tuning\", \"version\": 1, \"entries\": [1, \"x\", null, "
      "{\"cpu\": 5, \"kernels\": [], \"zmm\": \"yes\", \"ratio\": \"fast\"}, {\"zmm\": true}]}",
  };
  int i = 0;
  for (const char* text : contents) {
    const std::string cache = dir + "/cache" + std::to_string(i++);
    std::filesystem::remove_all(cache);
    std::filesystem::create_directories(cache);
    std::ofstream(cache + "/cpu-tuning.json") << text;
    ::setenv("REPLICA_CACHE_DIR", cache.c_str(), 1);
    auto v = run("--version");
    EXPECT_EQ(v.code, 0) << text << "\n" << v.out;
    EXPECT_NE(v.out.find("CPU tuning: "), std::string::npos) << v.out;
    auto r = run("train" + common + dir + "/run");
    EXPECT_EQ(r.code, 0) << text << "\n" << r.out;
    EXPECT_NE(r.out.find("replica: cpu kernels "), std::string::npos) << r.out;
  }
  ::unsetenv("REPLICA_CACHE_DIR");
}

// The configuration reference is generated from the schema (train/config.cpp): the checked-in
// page is what the binary prints, so a key cannot be documented one way and behave another.
TEST(Cli, ConfigurationPageIsWhatReplicaConfigPrints) {
  const Result r = run("config --markdown");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(std::string(REPLICA_SOURCE_DIR) + "/docs/configuration.md");
  std::stringstream page;
  page << in.rdbuf();
  EXPECT_EQ(r.out, page.str()) << "docs/configuration.md differs from `replica config --markdown`; regenerate it: "
                                  "build/apps/replica config --markdown > docs/configuration.md";
}

TEST(Cli, ConfigListsEveryKeyAndExplainsOne) {
  const Result all = run("config");
  ASSERT_EQ(all.code, 0) << all.out;
  for (const char* key : {"model.arch", "train.cuda_graph", "parallel.shard", "memory.fraction", "run.cost_per_device_hour"})
    EXPECT_NE(all.out.find(key), std::string::npos) << key;
  const Result one = run("config train.precision");
  ASSERT_EQ(one.code, 0) << one.out;
  EXPECT_NE(one.out.find("values:  fp32 | fp16 | bf16"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("default: fp32"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("docs/precision.md"), std::string::npos) << one.out;
  const Result section = run("config optim");
  ASSERT_EQ(section.code, 0) << section.out;
  EXPECT_NE(section.out.find("optim.lr"), std::string::npos);
  EXPECT_EQ(section.out.find("train.epochs"), std::string::npos) << "a section lists only its own keys";
  const Result typo = run("config train.epoch");
  EXPECT_EQ(typo.code, 2) << typo.out;
  EXPECT_NE(typo.out.find("did you mean 'train.epochs'"), std::string::npos) << typo.out;
}

// `replica predict` on Fashion-MNIST's own test images written as PNG files agrees with `replica
// eval` on the same 200 images image by image: the same correct count and the same mean loss
// (-log of each image's probability of its label, summed over every image); a file that is not an
// image is named and skipped, or with --strict an error; a model of another width is the clear
// error eval gives.
TEST(Cli, PredictAgreesWithEvalImageByImage) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  const std::string dir = ::testing::TempDir() + "/cli_predict", images = dir + "/png";
  std::filesystem::remove_all(dir);
  auto r = run("train --devices cpu:1 --run-dir " + dir +
               " --set model.width=8 --set data.limit_train=2048 --set train.global_batch=64 --set train.max_steps=20"
               " --set train.eval=false");
  ASSERT_EQ(r.code, 0) << r.out;
  auto e = run("eval --devices cpu:1 --set model.width=8 --set data.limit_test=200 --model " + dir + "/model.bin");
  ASSERT_EQ(e.code, 0) << e.out;
  std::smatch em;
  ASSERT_TRUE(std::regex_search(e.out, em, std::regex("test loss ([0-9.]+) accuracy ([0-9.]+)%"))) << e.out;
  auto p = run("pack --idx /usr/share/datasets/fashion-mnist " + images + " --png --limit 200");
  ASSERT_EQ(p.code, 0) << p.out;
  auto pr = run("predict " + dir + "/model.bin " + images + "/val --json --top 10");
  ASSERT_EQ(pr.code, 0) << pr.out;
  int n = 0, correct = 0;
  double loss = 0;
  std::istringstream lines(pr.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    const auto j = replica::Json::parse(line);
    const std::string file = j["file"];
    const int label = std::stoi(std::filesystem::path(file).parent_path().filename().string());  // val/<label>/<i>.png
    ASSERT_EQ(j["top"].size(), 10u) << line;
    correct += j["top"][0]["index"].get<int>() == label;
    for (const auto& t : j["top"])
      if (t["index"].get<int>() == label) loss -= std::log(t["probability"].get<double>());
    ++n;
  }
  ASSERT_EQ(n, 200) << pr.out;
  char acc[32];
  std::snprintf(acc, sizeof acc, "%.2f", 100.0 * correct / n);
  EXPECT_EQ(std::string(acc), em[2].str()) << "predict's top-1 on the PNG files vs eval's accuracy";
  EXPECT_NEAR(loss / n, std::stod(em[1].str()), 2e-3) << "the mean of -log p(label) vs eval's test loss";
  // The table names the classes; a file that is not an image is skipped and named.
  std::ofstream(images + "/val/notes.txt") << "not an image";
  const std::string one = std::filesystem::directory_iterator(images + "/val/0")->path().string();
  auto t = run("predict " + dir + "/model.bin " + one + " " + images + "/val/notes.txt --top 3");
  EXPECT_EQ(t.code, 0) << t.out;
  EXPECT_NE(t.out.find(one + "  "), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("skipping " + images + "/val/notes.txt"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("1 image(s) predicted, 1 skipped"), std::string::npos) << t.out;
  auto s = run("predict --strict " + dir + "/model.bin " + images + "/val/notes.txt");
  EXPECT_EQ(s.code, 1) << s.out;
  EXPECT_NE(s.out.find("notes.txt: not a JPEG or PNG image"), std::string::npos) << s.out;
  auto w = run("predict --set model.width=16 " + dir + "/model.bin " + one);
  EXPECT_EQ(w.code, 1) << w.out;
  EXPECT_NE(w.out.find("does not match"), std::string::npos) << w.out;
}
