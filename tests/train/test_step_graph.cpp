// train.cuda_graph's mechanism on a CPU replica (train/step_graph.h): the training step recorded
// once as the backend calls it makes and replayed (core/captured_work.h), with the contract of a
// CUDA graph: nothing runs while recording, a replay touches the memory the recording named, and
// what changes from step to step must be read from device memory. Held here, on every machine:
//  - a replayed run is the eager run bit for bit: every step's status, parameters, the 16-bit
//    copy, optimizer state, gradients and batch-norm statistics, under a learning rate that changes
//    every step, in fp32 (two micro-steps a step), fp16 with a dynamic scaler that skips and grows,
//    bf16 with AdamW (its bias corrections change every step), LARS, and batch norm on running
//    statistics; a step with a micro-batch of another shape runs eagerly and the replays go on;
//  - auto's check catches a value baked into the capture, and turns the graph off saying so;
//  - a capture that reads the device on the host, or takes memory from the replica's pool instead
//    of its own, fails, and the step runs eagerly instead;
//  - through the trainer (data, evaluation and checkpoints between graphed steps, and a resume),
//    graphed runs are eager runs byte for byte: model.bin, every checkpoint section, every step.
// tests/ops/test_backend_conformance.cpp holds the same runs on a GPU
// (CudaTraining.GraphedSteps...).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/errors.h"
#include "ops/backend.h"
#include "ops/models/resnet.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "parallel/replica_group.h"
#include "support/bit_identical.h"
#include "support/scratch.h"
#include "support/tiny_model.h"
#include "train/checkpoint.h"
#include "train/replica_step.h"
#include "train/step_graph.h"
#include "train/trainer.h"

using namespace replica;

namespace {

using replica::testing::random_batch;
using replica::testing::tiny_resnet;

// Equal, or both NaN (a skipped fp16 step's gradient norm).
bool same(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

std::string bytes_of(const Tensor& t) {
  return t.defined() ? std::string(static_cast<const char*>(t.raw()), t.nbytes()) : std::string();
}

struct Case {
  const char* name;
  const char* optimizer;  // sgd, adamw, lars
  DType activations;
  int accumulation;
  bool dynamic_scale;
  int odd_step;  // the step (1-based) whose last micro-batch has another shape; 0: none
  bool bn_frozen = false;
};

// Everything a run leaves, as bytes.
struct RunOut {
  std::vector<train::StepStatus> steps;
  std::vector<std::string>
      state;  // parameters, 16-bit copy, gradients, statistics, optimizer state
  int64_t replays = 0;
  bool off = false;
  std::string summary;
};

RunOut run_steps(const Case& c, const std::string& graph, int steps = 9) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  RunOut out;
  group.run([&](parallel::Replica& rep) {
    auto model = tiny_resnet();
    model->materialize(rep.pool(), 7, c.activations);
    std::unique_ptr<optim::Optimizer> opt;
    const std::string o = c.optimizer;
    if (o == "adamw") {
      opt = std::make_unique<optim::AdamW>(model->registry(), model->num_params(), rep.pool(),
                                           optim::AdamWOptions{});
    } else if (o == "lars") {
      opt = std::make_unique<optim::Lars>(model->registry(), model->num_params(), rep.pool(),
                                          optim::LarsOptions{});
    } else {
      opt = std::make_unique<optim::Sgd>(model->registry(), model->num_params(), rep.pool(),
                                         optim::SgdOptions{});
    }
    // A high first scale with growth every 2 steps: fp16 skips and backs off, then grows.
    optim::DynamicLossScaler scaler({.init_scale = 1048576.f, .growth_interval = 2});
    train::StepOptions so{.accumulation = c.accumulation,
                          .micro_batch = 8,
                          .activations = c.activations,
                          .scaler = c.dynamic_scale ? &scaler : nullptr};
    so.clip_grad_norm = 5;
    so.bn_frozen = c.bn_frozen;
    so.deterministic = true;
    so.cuda_graph = graph;
    train::ReplicaStep rs(rep, *model, *opt, so);
    for (int s = 1; s <= steps; ++s) {
      rs.zero_grad();
      for (int k = 0; k < c.accumulation; ++k) {
        Tensor x, y;
        const bool odd = s == c.odd_step && k == c.accumulation - 1;
        random_batch(rep.pool(), odd ? 6 : 8, static_cast<uint32_t>(100 * s + k), x, y);
        rs.micro_step(x, y, k == c.accumulation - 1);
      }
      const float lr =
          (o == "adamw" ? 0.002f : 0.1f) * 0.5f * (1 + std::cos(3.14159f * s / (steps + 1)));
      out.steps.push_back(rs.apply(lr));
    }
    for (const Tensor& t :
         {model->params(), model->compute_copy(), model->grads(), model->buffers()})
      out.state.push_back(bytes_of(t));
    for (Tensor* t : opt->state()) out.state.push_back(bytes_of(*t));
    if (const train::StepGraph* g = rs.graph()) {
      out.replays = g->replays();
      out.off = g->off();
      out.summary = g->summary();
    }
  });
  return out;
}

// Every step's status and the state after the run, `g` against `eager`.
void expect_same_run(const RunOut& eager, const RunOut& g, const std::string& what) {
  ASSERT_EQ(g.steps.size(), eager.steps.size()) << what;
  for (size_t i = 0; i < eager.steps.size(); ++i) {
    const auto &a = eager.steps[i], &b = g.steps[i];
    EXPECT_EQ(a.applied, b.applied) << what << " step " << i + 1;
    EXPECT_EQ(a.step, b.step) << what << " step " << i + 1;
    EXPECT_TRUE(same(a.loss, b.loss)) << what << " step " << i + 1 << ": loss " << a.loss << " " << b.loss;
    EXPECT_TRUE(same(a.accuracy, b.accuracy)) << what << " step " << i + 1;
    EXPECT_TRUE(same(a.grad_norm, b.grad_norm))
        << what << " step " << i + 1 << ": norm " << a.grad_norm << " " << b.grad_norm;
    EXPECT_EQ(a.scale, b.scale) << what << " step " << i + 1;
    EXPECT_EQ(a.samples, b.samples) << what << " step " << i + 1;
  }
  static const char* const kState[] = {"parameters", "16-bit copy", "gradients", "statistics"};
  ASSERT_EQ(g.state.size(), eager.state.size()) << what;
  for (size_t i = 0; i < eager.state.size(); ++i)
    EXPECT_TRUE(g.state[i] == eager.state[i])
        << what << ": " << (i < 4 ? kState[i] : ("optimizer state " + std::to_string(i - 4)).c_str()) << " differ";
}

}  // namespace

TEST(StepGraph, AReplayedRunIsTheEagerRunBitForBit) {
  const Case cases[] = {
      {"fp32 SGD, 2 micro-steps, an odd micro-batch at step 6", "sgd", DType::f32, 2, false, 6},
      {"fp16 SGD, dynamic scale", "sgd", DType::f16, 1, true, 0},
      {"bf16 AdamW", "adamw", DType::bf16, 1, false, 0},
      {"fp32 LARS, an odd micro-batch at step 5", "lars", DType::f32, 1, false, 5},
      {"bf16 SGD, batch norm on running statistics", "sgd", DType::bf16, 1, false, 0, true},
  };
  for (const Case& c : cases) {
    const RunOut eager = run_steps(c, "off");
    int skipped = 0;
    for (const auto& s : eager.steps) skipped += !s.applied;
    if (c.dynamic_scale) {
      EXPECT_GT(skipped, 0) << c.name << ": the scaler skipped steps, so its values changed";
    }
    for (const char* mode : {"on", "auto"}) {
      const RunOut g = run_steps(c, mode);
      const std::string what = std::string(c.name) + ", cuda_graph " + mode;
      EXPECT_FALSE(g.off) << what << ": " << g.summary;
      // 9 steps: 2 eager warm-up steps, the odd one eager, auto's first replay beside its check.
      EXPECT_EQ(g.replays, 7 - (c.odd_step ? 1 : 0)) << what << ": " << g.summary;
      expect_same_run(eager, g, what);
      std::printf("  %s: %s\n", what.c_str(), g.summary.c_str());
    }
  }
}

namespace {

struct PeerCase {
  const char* name;
  DType activations;
  int accumulation;
  DType wire;    // parallel.grad_dtype: a 16-bit wire rounds into staging buffers and back
  bool sync_bn;  // batch norm's statistics summed across replicas inside its forward and backward
  bool dynamic_scale;
  int odd_step_rank1 = 0;  // the step (1-based) whose last micro-batch on replica 1 only has another shape
};

// Two CPU replicas training on different data, as the trainer drives them: every step's status and
// each replica's state after 9 steps (the buckets are small, so a step reduces several).
std::vector<RunOut> run_peers(const PeerCase& c, const std::string& graph, int steps = 9) {
  parallel::ReplicaGroup group(parse_devices("cpu:2"), {});
  std::vector<RunOut> out(2);
  group.run([&](parallel::Replica& rep) {
    auto model = tiny_resnet();
    model->materialize(rep.pool(), 7, c.activations);
    optim::Sgd opt(model->registry(), model->num_params(), rep.pool(), optim::SgdOptions{});
    optim::DynamicLossScaler scaler({.init_scale = 1048576.f, .growth_interval = 2});
    train::StepOptions so{.accumulation = c.accumulation,
                          .micro_batch = 8,
                          .activations = c.activations,
                          .scaler = c.dynamic_scale ? &scaler : nullptr};
    so.sync_bn = c.sync_bn;
    so.buckets.bucket_mb = 0.004;  // ~1000 floats: the tiny ResNet's ~4700 gradients in several buckets
    so.buckets.first_bucket_mb = 0.001;
    so.buckets.wire = c.wire;
    so.clip_grad_norm = 5;
    so.deterministic = true;
    so.cuda_graph = graph;
    train::ReplicaStep rs(rep, *model, opt, so);
    RunOut& o = out[static_cast<size_t>(rep.rank())];
    for (int s = 1; s <= steps; ++s) {
      rs.zero_grad();
      for (int k = 0; k < c.accumulation; ++k) {
        Tensor x, y;
        const bool odd = rep.rank() == 1 && s == c.odd_step_rank1 && k == c.accumulation - 1;
        random_batch(rep.pool(), odd ? 6 : 8, static_cast<uint32_t>(1000 * rep.rank() + 100 * s + k), x, y);
        rs.micro_step(x, y, k == c.accumulation - 1);
      }
      o.steps.push_back(rs.apply(0.1f * 0.5f * (1 + std::cos(3.14159f * s / (steps + 1)))));
    }
    for (const Tensor& t : {model->params(), model->compute_copy(), model->grads(), model->buffers()})
      o.state.push_back(bytes_of(t));
    for (Tensor* t : opt.state()) o.state.push_back(bytes_of(*t));
    if (const train::StepGraph* g = rs.graph()) {
      o.replays = g->replays();
      o.off = g->off();
      o.summary = g->summary();
    }
  });
  return out;
}

}  // namespace

// With peers the collectives are part of the captured step (NCCL's are nodes of a GPU's graph; a
// CPU replica's are recorded with its calls): two replicas replaying their steps, whose buckets
// all-reduce between the recorded calls, are two eager replicas bit for bit, each of them, in
// fp32 with two micro-steps, with a 16-bit wire, with sync-BN (its all-reduces inside the
// recorded batch-norm calls) and in fp16 with a dynamic scale. The update follows the host's read
// of the step's scalars, as eagerly (a failed collective is then seen before anything changes).
TEST(StepGraph, PeersReplayTheirCollectivesAndAreEagerPeersBitForBit) {
  const PeerCase cases[] = {
      {"fp32, 2 micro-steps", DType::f32, 2, DType::f32, false, false},
      {"bf16, a bf16 wire", DType::bf16, 1, DType::bf16, false, false},
      {"fp32, sync-BN", DType::f32, 1, DType::f32, true, false},
      {"fp16, dynamic scale, an fp16 wire", DType::f16, 1, DType::f16, false, true},
      // One replica's micro-batch does not fit the captured step's slots: it cannot run that step
      // eagerly alone (its collectives would meet the peer's replayed ones); every replica does.
      {"fp32, 2 micro-steps, step 6's last micro-batch another shape on replica 1", DType::f32, 2, DType::f32, false,
       false, 6},
  };
  for (const PeerCase& c : cases) {
    const std::vector<RunOut> eager = run_peers(c, "off");
    EXPECT_TRUE(eager[0].state[0] == eager[1].state[0]) << c.name << ": eager replicas agree";
    for (const char* mode : {"on", "auto"}) {
      const std::vector<RunOut> g = run_peers(c, mode);
      const std::string what = std::string(c.name) + ", cuda_graph " + mode;
      for (size_t r = 0; r < 2; ++r) {
        EXPECT_FALSE(g[r].off) << what << " replica " << r << ": " << g[r].summary;
        EXPECT_EQ(g[r].replays, c.odd_step_rank1 ? 6 : 7) << what << " replica " << r << ": " << g[r].summary;
        for (size_t s = 0; s < g[r].steps.size(); ++s)
          EXPECT_EQ(g[r].steps[s].samples, 16 * c.accumulation - (static_cast<int>(s) + 1 == c.odd_step_rank1 ? 2 : 0))
              << what << ": both replicas' samples";
        expect_same_run(eager[r], g[r], what + " replica " + std::to_string(r));
      }
      std::printf("  %s: %s\n", what.c_str(), g[0].summary.c_str());
    }
  }
}

namespace {

// StepGraph over a hand-written step body: the model and optimizer are only the state compared.
struct Harness {
  parallel::Replica& rep;
  std::unique_ptr<nn::Model> model = tiny_resnet();
  std::unique_ptr<optim::Sgd> opt;
  Tensor stats;
  explicit Harness(parallel::Replica& r, DType compute = DType::f32) : rep(r) {
    model->materialize(rep.pool(), 1, compute);
    opt = std::make_unique<optim::Sgd>(model->registry(), model->num_params(), rep.pool(),
                                       optim::SgdOptions{});
    stats = Tensor::zeros(rep.pool(), {4}, DType::f32, MemTag::other);
  }
  // Runs `steps` steps of `body` through a StepGraph as ReplicaStep does; returns the graph's
  // state.
  std::unique_ptr<train::StepGraph> steps(const train::StepGraph::Body& body, bool verify,
                                          int steps, bool deterministic = true) {
    auto g = std::make_unique<train::StepGraph>(rep, *model, *opt, stats, 1, verify, deterministic);
    for (int s = 0; s < steps; ++s) {
      if (g->begin_step()) {
        g->run(body);
      } else {
        body(rep.pool(), {});
        g->end_eager();
      }
    }
    return g;
  }
};

}  // namespace

// A value the host bakes into the step (here the step's number, written by fill) is what a
// replay must never hold: auto compares its first replay with an eager step from the same state,
// finds the step's scalars differ, keeps the eager step's results and turns the graph off, saying
// why; steps run eagerly after. `on` trusts the graph and replays the baked value.
TEST(StepGraph, AutoCatchesAValueBakedIntoTheCapture) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  group.run([&](parallel::Replica& rep) {
    Harness h(rep);
    auto& be = ops::backend_for(rep.device());
    int n = 0;
    const train::StepGraph::Body body = [&](MemoryPool&, const train::StepGraph::Inputs&) {
      be.fill(h.stats, static_cast<float>(++n));
    };
    auto g = h.steps(body, true, 5);
    EXPECT_TRUE(g->off());
    EXPECT_NE(g->off_reason().find("the step's scalars"), std::string::npos) << g->off_reason();
    EXPECT_EQ(h.stats.data<float>()[0], static_cast<float>(n)) << "the last step ran eagerly";
    EXPECT_NE(g->summary().find("off"), std::string::npos) << g->summary();

    n = 0;
    g = h.steps(body, false, 5);
    EXPECT_FALSE(g->off()) << g->off_reason();
    EXPECT_EQ(g->replays(), 3);
    EXPECT_EQ(h.stats.data<float>()[0], 3.f) << "the capture's value, replayed";
  });
}

// Outside deterministic mode auto accepts what rounding moves: an element of the bf16 compute copy
// one step apart (1 and 1 + 2^-7; a GPU's non-deterministic algorithms move the parameters' last
// bits, and their rounding to 16 bits flips now and then), though that is 0.8% of the largest
// value. Deterministic mode wants every bit; two steps apart is a difference either way.
TEST(StepGraph, AutoAcceptsOneRoundingStepOfTheComputeCopyOnlyWhenNotDeterministic) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  group.run([&](parallel::Replica& rep) {
    for (const auto& c : std::vector<std::tuple<float, bool, bool>>{
             {0x1p-7f, false, true}, {0x1p-7f, true, false}, {0x1p-6f, false, false}}) {
      // Named copies, not a structured binding: the step's lambda captures `apart`.
      const float apart = std::get<0>(c);
      const bool deterministic = std::get<1>(c), stays_on = std::get<2>(c);
      Harness h(rep, DType::bf16);
      auto& be = ops::backend_for(rep.device());
      int n = 0;
      const train::StepGraph::Body body = [&](MemoryPool&, const train::StepGraph::Inputs&) {
        be.fill(h.model->compute_copy(),
                ++n % 2 ? 1.f : 1.f + apart);  // the capture's value is baked
      };
      auto g = h.steps(body, true, 4, deterministic);
      EXPECT_EQ(!g->off(), stays_on)
          << "apart " << apart << ", deterministic " << deterministic << ": " << g->off_reason();
      if (!stays_on) {
        EXPECT_NE(g->off_reason().find("the 16-bit compute copy"), std::string::npos)
            << g->off_reason();
      }
    }
  });
}

// auto's eager step runs in the graph's own pool; when it fails (out of memory, say), the state is
// put back as it was, graphs turn off saying why, and the step runs eagerly in the replica's pool.
TEST(StepGraph, AutoWhoseCheckFailsPutsTheStateBackAndRunsTheStepEagerly) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  group.run([&](parallel::Replica& rep) {
    Harness h(rep);
    auto& be = ops::backend_for(rep.device());
    int n = 0;
    std::vector<MemoryPool*> pools;
    const train::StepGraph::Body body = [&](MemoryPool& pool, const train::StepGraph::Inputs&) {
      pools.push_back(&pool);
      be.axpy(1.f, h.stats, h.stats);  // doubles what it finds: a lost restore shows
      if (++n == 4) throw OutOfMemoryError("a pretended shortage", 1 << 20);
      be.fill(h.stats.view(1, {1}), static_cast<float>(n));
    };
    be.fill(h.stats, 1.f);
    auto g = h.steps(body, true, 4);
    EXPECT_TRUE(g->off());
    EXPECT_NE(g->off_reason().find("the first replay could not be checked: a pretended shortage"),
              std::string::npos)
        << g->off_reason();
    ASSERT_EQ(n, 6)
        << "2 warm-up steps, the capture, the failed check, the step eagerly, the last step";
    EXPECT_NE(pools[3], &rep.pool()) << "the check's eager step runs in the graph's pool";
    EXPECT_EQ(pools[4], &rep.pool());
    // stats[0] doubled by each step that ran to its end or was put back: 1 -> 2, 4, (capture: no
    // run), (check: put back), 8, 16.
    EXPECT_EQ(h.stats.data<float>()[0], 16.f);
    EXPECT_EQ(h.stats.data<float>()[1], 6.f);
  });
}

// A step that hands a device value to the host inside the capture cannot be replayed: the
// capture fails, the graph turns off naming the call, and that step and the ones after run eagerly.
TEST(StepGraph, ACaptureThatReadsOnTheHostFailsAndTheStepRunsEagerly) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  group.run([&](parallel::Replica& rep) {
    Harness h(rep);
    auto& be = ops::backend_for(rep.device());
    int ran = 0;
    const train::StepGraph::Body body = [&](MemoryPool&, const train::StepGraph::Inputs&) {
      ++ran;
      be.fill(h.stats, static_cast<float>(be.sum_squares(h.model->params()) > 0));
    };
    auto g = h.steps(body, true, 4);
    EXPECT_TRUE(g->off());
    EXPECT_NE(g->off_reason().find("Backend::sum_squares hands device memory to the host"),
              std::string::npos)
        << g->off_reason();
    EXPECT_EQ(ran, 5)
        << "2 warm-up steps, the failed capture, then its step and the last one eagerly";
    EXPECT_EQ(g->replays(), 0);
    EXPECT_EQ(h.stats.data<float>()[0], 1.f);
  });
}

// Everything a captured step allocates must come from its private pool: a block taken from the
// replica's pool is handed on once the capture ends, and every replay would write into it. Such a
// capture fails, naming the count, and the steps run eagerly (from the replica's pool, as before).
TEST(StepGraph, ACaptureThatAllocatesFromTheReplicaPoolFails) {
  parallel::ReplicaGroup group(parse_devices("cpu:1"), {});
  group.run([&](parallel::Replica& rep) {
    Harness h(rep);
    auto& be = ops::backend_for(rep.device());
    const train::StepGraph::Body body = [&](MemoryPool& pool, const train::StepGraph::Inputs&) {
      const Tensor mine =
          Tensor::empty(pool, {4}, DType::f32, MemTag::other);  // the step's own: fine
      const Tensor other = Tensor::empty(rep.pool(), {4}, DType::f32, MemTag::other);
      be.fill(other, 2.f);
      copy_tensor(other, mine);
      copy_tensor(mine, h.stats);
    };
    auto g = h.steps(body, false, 4);
    EXPECT_TRUE(g->off());
    EXPECT_NE(g->off_reason().find("took 1 block(s) from the replica's pool"), std::string::npos)
        << g->off_reason();
    EXPECT_EQ(g->replays(), 0);
    EXPECT_EQ(h.stats.data<float>()[0], 2.f);
  });
}

// With peers, what decides how often a step runs is agreed, or their collectives would not pair:
// a first capture that fails on one replica (rank 1 reads on the host) turns graphs off on both,
// and both run the step eagerly; auto's check that finds one replica's replay differs (rank 1
// bakes a value) turns graphs off on both, naming that replica, and both keep their eager steps.
// Every step all-reduces, so an unpaired collective would end the test in a time-out.
TEST(StepGraph, PeersAgreeOnCapturesAndOnAutosCheck) {
  for (const bool reads_on_host : {true, false}) {
    parallel::ReplicaGroup group(parse_devices("cpu:2"), {});
    std::vector<std::string> reasons(2);
    std::vector<float> reduced(2), runs(2);
    group.run([&](parallel::Replica& rep) {
      Harness h(rep);
      auto& be = ops::backend_for(rep.device());
      int n = 0;
      const train::StepGraph::Body body = [&](MemoryPool&, const train::StepGraph::Inputs&) {
        ++n;
        be.axpy(1.f, h.stats.view(0, {1}), h.stats.view(0, {1}));  // doubles stats[0]
        if (rep.rank() == 1 && reads_on_host) be.fill(h.stats.view(2, {1}), static_cast<float>(be.sum_squares(h.stats)));
        if (rep.rank() == 1 && !reads_on_host) be.fill(h.stats.view(1, {1}), static_cast<float>(n));  // baked
        rep.comm().all_reduce_async(h.stats.raw(), 1, DType::f32, parallel::ReduceOp::avg)->order_before(rep.stream());
      };
      be.fill(h.stats, 1.f);
      auto g = h.steps(body, !reads_on_host, 5);
      reasons[static_cast<size_t>(rep.rank())] = g->off() ? g->off_reason() : "";
      reduced[static_cast<size_t>(rep.rank())] = h.stats.data<float>()[0];
      runs[static_cast<size_t>(rep.rank())] = static_cast<float>(n);
    });
    const std::string what = reads_on_host ? "a failed capture on replica 1" : "auto, replica 1's replay differs";
    for (size_t r = 0; r < 2; ++r) EXPECT_FALSE(reasons[r].empty()) << what << ": replica " << r << " turned off";
    if (reads_on_host) {
      EXPECT_NE(reasons[1].find("Backend::sum_squares hands device memory to the host"), std::string::npos) << reasons[1];
      EXPECT_NE(reasons[0].find("replica 1 could not capture its step"), std::string::npos) << reasons[0];
      // 2 warm-up steps, the capture's step eagerly, 2 more: 5 doublings.
      EXPECT_EQ(reduced[0], 32.f) << what;
    } else {
      EXPECT_NE(reasons[1].find("the step's scalars"), std::string::npos) << reasons[1];
      EXPECT_NE(reasons[0].find("replica 1 found that its first replay differs"), std::string::npos) << reasons[0];
      // 2 warm-up steps, the check's eager step (kept), 2 more: 5 doublings.
      EXPECT_EQ(reduced[0], 32.f) << what;
      EXPECT_EQ(runs[0], 6.f) << "the capture records the body once without running it";
    }
    EXPECT_EQ(reduced[0], reduced[1]) << what << ": the replicas agree";
  }
}

// A failure that aborts the group releases every replica's captured step first, from the thread
// that aborts (a GPU's graph holds NCCL's plans, and from NCCL 2.26 on ncclCommAbort waits until
// such graphs are gone): here the test's own thread aborts after 5 steps (3 replays), both graphs
// are released at once, and the next step on either replica is a CommError, not a replay.
TEST(StepGraph, AnAbortReleasesEveryReplicasGraphFirstAndTheNextStepFails) {
  parallel::ReplicaGroup group(parse_devices("cpu:2"), {});
  std::vector<std::unique_ptr<Harness>> hs(2);
  std::vector<std::unique_ptr<train::StepGraph>> gs(2);
  std::vector<train::StepGraph::Body> bodies(2);
  group.run([&](parallel::Replica& rep) {
    const size_t r = static_cast<size_t>(rep.rank());
    hs[r] = std::make_unique<Harness>(rep);
    Harness& h = *hs[r];
    auto& be = ops::backend_for(rep.device());
    bodies[r] = [&h, &be, &rep](MemoryPool&, const train::StepGraph::Inputs&) {
      be.axpy(1.f, h.stats.view(0, {1}), h.stats.view(0, {1}));
      rep.comm().all_reduce_async(h.stats.raw(), 1, DType::f32, parallel::ReduceOp::avg)->order_before(rep.stream());
    };
    be.fill(h.stats, 1.f);
    gs[r] = h.steps(bodies[r], false, 5);
  });
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(gs[r]->replays(), 3) << gs[r]->summary();
    EXPECT_FALSE(gs[r]->released());
  }
  group.replica(1).abort("planted: replica 1 lost its peer");
  for (size_t r = 0; r < 2; ++r) EXPECT_TRUE(gs[r]->released()) << "replica " << r << "'s graph outlived the abort";
  std::vector<std::string> errors(2);
  group.run([&](parallel::Replica& rep) {
    const size_t r = static_cast<size_t>(rep.rank());
    try {
      ASSERT_TRUE(gs[r]->begin_step());
      gs[r]->run(bodies[r]);
    } catch (const CommError& e) {
      errors[r] = e.what();
    }
    gs[r].reset();
    hs[r].reset();
  });
  for (size_t r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("planted"), std::string::npos) << "replica " << r << ": '" << errors[r] << "'";
}

namespace {

// Everything a trainer run leaves (expect_bit_identical compares two).
struct TrainerRun {
  train::FitResult fit;
  std::string model_bin;
  std::map<std::string, std::string> checkpoint;
  int64_t replays = -1;  // -1: no graph, or turned off
  std::string summary;
};

TrainerRun train_run(const std::string& precision, const std::string& graph, int64_t steps,
                     const std::string& dir, const std::string& resume = "",
                     const std::string& devices = "cpu:1", const std::vector<std::string>& extra = {}) {
  // ResNet-20 on synthetic 8x8x3 images, 4 steps an epoch: evaluation and a checkpoint after
  // each epoch run between graphed steps.
  std::vector<std::string> sets = {"model.arch=resnet20",
                                   "model.width=4",
                                   "data.dataset=synthetic",
                                   "data.synthetic_shape=[8,8,3]",
                                   "data.mean=[0.5,0.5,0.5]",
                                   "data.std=[0.25,0.25,0.25]",
                                   "data.synthetic_size=256",
                                   "train.global_batch=64",
                                   "train.max_steps=" + std::to_string(steps),
                                   "train.tensorboard=false",
                                   "train.precision=" + precision,
                                   "train.run_dir=" + ::testing::TempDir() + "/step_graph_" + dir,
                                   "checkpoint.every_epochs=1",
                                   "optim.schedule=cosine",
                                   "optim.lr=0.05",
                                   "parallel.devices=" + devices,
                                   "train.cuda_graph=" + graph};
  if (precision == "fp32") sets.push_back("train.micro_batch=32");  // two micro-steps a step
  if (precision == "bf16")
    for (const char* k : {"optim.name=adamw", "optim.lr=0.002"}) sets.push_back(k);
  if (precision == "fp16")
    for (const char* k : {"train.loss_scale=dynamic", "train.loss_scale_init=1048576",
                          "train.loss_scale_growth_interval=2"})
      sets.push_back(k);
  sets.insert(sets.end(), extra.begin(), extra.end());
  auto cfg = train::parse_config("", "test", sets);
  if (resume.empty()) std::filesystem::remove_all(cfg.train.run_dir);
  train::Trainer t(
      cfg, {.print = false, .on_step = nullptr, .resume = resume, .record_cpu_steps = true});
  TrainerRun r;
  r.fit = t.fit();
  r.model_bin = replica::testing::file_bytes(cfg.train.run_dir + "/model.bin");
  r.checkpoint = train::read_checkpoint(r.fit.last_checkpoint).sections;
  r.checkpoint.erase("config");  // names the run directory
  if (const train::StepGraph* g = t.replica_step(0).graph()) {
    r.replays = g->off() ? -1 : g->replays();
    r.summary = g->summary();
  }
  return r;
}

}  // namespace

// The trainer's graphed path on a CPU replica (TrainerOptions::record_cpu_steps), as
// CudaTraining.GraphedStepsAreBitIdenticalToEagerOnes holds it on a GPU: 8 steps over two epochs
// with evaluation and checkpoints between them, fp32 with two micro-steps a step, fp16 with a
// dynamic scale that skips, bf16 AdamW, under a cosine schedule; 4 graphed steps + resume +
// 4 graphed steps against 8 eager ones; and inputs staged ahead as on a GPU (REPLICA_STAGE_AHEAD).
TEST(StepGraph, TrainerRunsWithGraphsAreEagerRunsByteForByte) {
  for (const std::string p : {"fp32", "fp16", "bf16"}) {
    const TrainerRun eager = train_run(p, "off", 8, p + "_off");
    EXPECT_EQ(eager.replays, -1);
    for (const std::string mode : {"on", "auto"}) {
      const TrainerRun g = train_run(p, mode, 8, p + "_" + mode);
      EXPECT_EQ(g.replays, 6) << p << " " << mode << ": " << g.summary;  // 2 eager warm-up steps
      replica::testing::expect_bit_identical(eager, g,
                                             p + " train.cuda_graph=" + mode + " against off");
      std::printf("  %s train.cuda_graph=%s: %s\n", p.c_str(), mode.c_str(), g.summary.c_str());
    }
    train_run(p, "on", 4, p + "_resumed");
    const TrainerRun resumed = train_run(p, "on", 8, p + "_resumed",
                                         ::testing::TempDir() + "/step_graph_" + p + "_resumed");
    ASSERT_EQ(resumed.fit.history.size(), 4u) << p;
    for (size_t i = 0; i < 4; ++i)
      EXPECT_EQ(resumed.fit.history[i].loss, eager.fit.history[4 + i].loss)
          << p << " step " << 5 + i;
    EXPECT_TRUE(resumed.model_bin == eager.model_bin)
        << p << ": 4 graphed + resume + 4 graphed differ from 8 eager";
    for (const auto& [name, bytes] : eager.checkpoint)
      EXPECT_TRUE(resumed.checkpoint.count(name) && resumed.checkpoint.at(name) == bytes)
          << p << ": checkpoint section '" << name << "' differs after a resume";
    if (p == "fp32") {  // the GPU's input order: batches copied ahead into two device slots
      setenv("REPLICA_STAGE_AHEAD", "1", 1);
      const TrainerRun staged = train_run(p, "on", 8, p + "_staged");
      unsetenv("REPLICA_STAGE_AHEAD");
      EXPECT_EQ(staged.replays, 6) << staged.summary;
      replica::testing::expect_bit_identical(eager, staged,
                                             p + " on, inputs staged ahead, against off");
    }
  }
}

// The trainer's graphed path with two replicas (their buckets, the stop vote and the metrics
// all-reduced inside the recorded step; each replica's update after the step's read): 8 steps
// with evaluation and checkpoints between them, fp32 with two micro-steps and fp16 with a dynamic
// scale, byte-identical to the eager two-replica run.
TEST(StepGraph, TrainerRunsOnTwoReplicasWithGraphsAreEagerRunsByteForByte) {
  for (const std::string p : {"fp32", "fp16"})
    for (const std::string shard : {"none", "optimizer"}) {
      // ZeRO-1: the optimizer's state and (fp16) the f32 masters sharded, the parameters gathered
      // after the update, which follows the step's read.
      const std::string tag = p + " on 2 replicas, parallel.shard=" + shard;
      const std::vector<std::string> extra = {"parallel.shard=" + shard};
      const TrainerRun eager = train_run(p, "off", 8, p + "_peers_" + shard + "_off", "", "cpu:2", extra);
      for (const std::string mode : {"on", "auto"}) {
        const TrainerRun g = train_run(p, mode, 8, p + "_peers_" + shard + "_" + mode, "", "cpu:2", extra);
        EXPECT_EQ(g.replays, 6) << tag << " " << mode << ": " << g.summary;
        replica::testing::expect_bit_identical(eager, g, tag + ", train.cuda_graph=" + mode + " against off");
        std::printf("  %s, train.cuda_graph=%s: %s\n", tag.c_str(), mode.c_str(), g.summary.c_str());
      }
    }
}
