// Memory per replica by precision, and what gradient accumulation buys in a fixed-size pool.
//  1. One training step (forward, backward, SGD update) of ResNet-20 (28x28x1, batch 128) and
//     ResNet-50 (224x224x3, batch 16) at fp32, fp16 and bf16: peak pool in use, peak activations
//     (tag activations: saved tensors and activation gradients), and the 16-bit/fp32 ratio.
//  2. A preallocated pool sized for micro-batch 32: global batch 128 in one go runs out of memory,
//     and the same global batch trains as 4 accumulation steps of 32.
//   replica_bench_memory
#include <chrono>
#include <cstdio>
#include <map>

#include "core/errors.h"
#include "core/pools.h"
#include "ops/models/resnet.h"
#include "ops/nn/training_pass.h"
#include "optim/optimizer.h"
#include "train/memplan.h"
#include "train/trainer.h"

using namespace replica;

namespace {

struct Peak {
  size_t total = 0, activations = 0;
  double seconds = 0;  // of the last of `reps` steps' forward + backward + update
};

Peak one_step(const models::ResNetConfig& mc, int64_t batch, DType dt, int reps = 1) {
  PoolOptions po;
  po.mode = AllocatorMode::growth;
  auto pool = make_pool({DeviceKind::cpu, 0}, po);
  auto model = models::make_resnet(mc);
  model->materialize(*pool, 1, dt);
  optim::Sgd sgd(model->registry(), model->num_params(), *pool, {});
  Tensor x = Tensor::zeros(*pool, {batch, mc.height, mc.width, mc.in_channels}, DType::f32, MemTag::activations);
  Tensor y = Tensor::zeros(*pool, {batch}, DType::i32, MemTag::activations);
  auto& be = ops::backend_for(pool->device());
  Peak out;
  for (int rep = 0; rep < reps; ++rep) {
  pool->reset_peaks();
  auto t0 = std::chrono::steady_clock::now();
  {
    nn::Context ctx(*pool, be, true);
    ctx.act_dtype = dt;
    Tensor d;
    nn::forward_and_loss(ctx, *model, x, y, 1.f / batch, d);
    model->backward(ctx, d);
  }
  sgd.step(model->params(), model->grads(), 0.1f);
  model->refresh_compute_copy();
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto s = pool->stats();
  out.total = s.peak_in_use;
  out.activations = s.tags[static_cast<int>(MemTag::activations)].peak_in_use;
  }
  return out;
}

}  // namespace

int main() {
  std::printf("# one training step on one replica: peak pool in use and peak activations (MiB)\n");
  std::printf("# %-30s %-6s %12s %12s %14s\n", "model", "prec", "peak total", "activations", "act vs fp32");
  struct Case {
    const char* name;
    models::ResNetConfig mc;
    int64_t batch;
  };
  Case cases[] = {{"resnet20 28x28x1 batch 128", {.arch = "resnet20"}, 128},
                  {"resnet50 224x224x3 batch 16",
                   {.arch = "resnet50", .in_channels = 3, .num_classes = 1000, .height = 224, .width = 224}, 16}};
  for (auto& c : cases) {
    double base = 0;
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      Peak p = one_step(c.mc, c.batch, dt);
      if (dt == DType::f32) base = static_cast<double>(p.activations);
      std::printf("  %-30s %-6s %12.1f %12.1f %13.2fx\n", c.name, dtype_name(dt), p.total / 1048576.0,
                  p.activations / 1048576.0, p.activations / base);
      std::fflush(stdout);
    }
  }

  std::printf("\n# gradient checkpointing (model.checkpoint: blocks), ResNet-50 224x224x3 batch 8, fp32, 1 thread\n");
  {
    models::ResNetConfig mc{.arch = "resnet50", .in_channels = 3, .num_classes = 1000, .height = 224, .width = 224};
    Peak none = one_step(mc, 8, DType::f32, 3);
    mc.checkpoint_every = 1;
    Peak blocks = one_step(mc, 8, DType::f32, 3);
    std::printf("  none:   activations %8.1f MiB, step %.2f s\n", none.activations / 1048576.0, none.seconds);
    std::printf("  blocks: activations %8.1f MiB, step %.2f s  ->  %.2fx the memory at %.2fx the time\n",
                blocks.activations / 1048576.0, blocks.seconds, double(blocks.activations) / none.activations,
                blocks.seconds / none.seconds);
  }

  std::printf("\n# planner (replica memplan) against the measured peak of 3 real training steps, one replica\n");
  struct PlanCase {
    const char* name;
    std::vector<std::string> sets;
  };
  std::vector<std::string> r50 = {"model.arch=resnet50", "data.dataset=synthetic", "data.synthetic_shape=[224,224,3]",
                                  "data.synthetic_classes=1000", "data.synthetic_size=64", "data.mean=[0.5,0.5,0.5]",
                                  "data.std=[0.25,0.25,0.25]", "train.global_batch=24", "train.micro_batch=24"};
  std::vector<std::string> r20 = {"data.dataset=synthetic", "data.synthetic_size=512", "data.mean=[0.5]",
                                  "data.std=[0.25]", "train.global_batch=128", "train.micro_batch=128"};
  for (auto& [name, base] : std::vector<std::pair<std::string, std::vector<std::string>>>{{"resnet20 28x28 micro 128", r20},
                                                                                          {"resnet50 224x224 micro 24", r50}})
    for (const char* prec : {"fp32", "fp16"}) {
      auto sets = base;
      for (const char* x : {"train.max_steps=3", "train.eval=false", "train.tensorboard=false", "checkpoint.every_epochs=0",
                            "train.run_dir=runs/bench-memplan", "parallel.devices=cpu:1", "memory.mode=growth"})
        sets.push_back(x);
      sets.push_back(std::string("train.precision=") + prec);
      auto cfg = train::parse_config("", "bench", sets);
      auto plan = train::plan_memory(cfg);
      train::Trainer t(cfg, {.print = false, .on_step = nullptr});
      t.fit();
      double measured = static_cast<double>(t.group().replica(0).pool().stats().peak_in_use);
      std::printf("  %-28s %-5s predicted %8.1f MiB, measured %8.1f MiB  (%+.2f%%)\n", name.c_str(), prec,
                  plan.peak_bytes / 1048576.0, measured / 1048576.0, 100.0 * (plan.peak_bytes - measured) / measured);
      std::fflush(stdout);
    }

  std::printf("\n# fixed pool: global batch 128 of ResNet-20 on one replica, synthetic 28x28x1 data\n");
  // Size the pool from a micro-batch-32 run, with 25% headroom.
  Peak p32 = one_step({.arch = "resnet20"}, 32, DType::f32);
  const size_t cap = p32.total + p32.total / 4 + (8 << 20);  // + the loader's prefetched batches
  std::printf("  pool: preallocate %.1f MiB (peak of one micro-batch-32 step + 25%% + 8 MiB)\n", cap / 1048576.0);
  for (int64_t micro : {128, 32}) {
    std::vector<std::string> sets = {"data.dataset=synthetic", "data.synthetic_size=1024", "data.mean=[0.5]",
                                     "data.std=[0.25]", "train.global_batch=128",
                                     "train.micro_batch=" + std::to_string(micro), "train.max_steps=3",
                                     "train.eval=false", "train.run_dir=runs/bench-memory", "parallel.devices=cpu:1",
                                     "memory.mode=preallocate", "memory.bytes=" + std::to_string(cap)};
    try {
      train::Trainer t(train::parse_config("", "bench", sets), {.print = false, .on_step = nullptr});
      auto r = t.fit();
      std::printf("  micro-batch %3ld x %ld accumulation steps: trained %ld steps, loss %.3f, peak in use %.1f MiB\n",
                  (long)micro, (long)(128 / micro), (long)r.steps, r.last_loss,
                  t.group().replica(0).pool().stats().peak_in_use / 1048576.0);
    } catch (const std::exception& e) {
      std::string m = e.what();
      std::printf("  micro-batch %3ld x %ld accumulation steps: out of memory: %s\n", (long)micro,
                  (long)(128 / micro), m.substr(0, 160).c_str());
    }
  }
  return 0;
}
