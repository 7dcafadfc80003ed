// Measuring a step profile (timed forward, backward with each slot's ready time, optimizer) and
// its JSON file.
#include "train/step_profile.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>

#include "core/device.h"
#include "core/cuda/runtime.h"
#include "core/errors.h"
#include "core/json.h"
#include "core/pools.h"
#include "ops/cpu/threads.h"
#include "ops/nn/training_pass.h"
#include "parallel/shard_plan.h"
#include "train/factory.h"
#include "train/trainer.h"

namespace replica::train {

using Clock = std::chrono::steady_clock;

int64_t StepProfile::params() const {
  int64_t n = 0;
  for (int64_t e : slot_elements) n += e;
  return n;
}

StepProfile StepProfile::at_micro_batch(int64_t b) const {
  StepProfile p = *this;
  const double f = static_cast<double>(b) / static_cast<double>(micro_batch);
  p.micro_batch = b;
  p.forward_s *= f;
  p.backward_s *= f;
  p.compute_sd_s *= f;
  for (double& t : p.slot_ready_s) t *= f;
  return p;
}

StepProfile StepProfile::scaled_to(double images_per_s) const {
  StepProfile p = *this;
  const double f = static_cast<double>(micro_batch) / images_per_s / (forward_s + backward_s + optimizer_s);
  p.forward_s *= f;
  p.backward_s *= f;
  p.optimizer_s *= f;
  // The spread of step times belongs to the machine that was measured (a shared CPU's noise), not
  // to the model: another device's is unknown, and taken as none.
  p.compute_sd_s = 0;
  p.host_s = 0;  // the other machine's host work is not known either
  for (double& t : p.slot_ready_s) t *= f;
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", images_per_s);
  p.device = device + ", scaled to " + b + " img/s at micro-batch " + std::to_string(micro_batch);
  return p;
}

std::string StepProfile::json() const {
  // One field per line and one slot ([elements, ready_s]) per line: a file a person can read and
  // diff (nlohmann's indented dump would spread each slot over four lines).
  const Json head = {{"kind", "replica step profile"}, {"version", 1},       {"model", model},
                     {"device", device},              {"micro_batch", micro_batch},
                     {"steps", steps},                {"forward_s", forward_s}, {"backward_s", backward_s},
                     {"optimizer_s", optimizer_s},    {"compute_sd_s", compute_sd_s},
                     {"host_s", host_s}};
  std::string out = "{\n";
  for (const auto& [k, v] : head.items()) out += "  " + Json(k).dump() + ": " + v.dump() + ",\n";
  out += "  \"slots\": [\n";
  for (size_t i = 0; i < slot_elements.size(); ++i)
    out += "    " + Json({slot_elements[i], slot_ready_s[i]}).dump() + (i + 1 < slot_elements.size() ? ",\n" : "\n");
  return out + "  ]\n}\n";
}

StepProfile StepProfile::from_json(const std::string& text, const std::string& source) {
  const std::string hint = " (write one with: replica plan CONFIG --profile --save-profile FILE)";
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    throw ConfigError(source + ": not a step profile: " + e.what() + hint);
  }
  StepProfile p;
  try {
    if (j.at("kind") != "replica step profile") throw ConfigError(source + ": not a step profile" + hint);
    if (j.at("version") != 1) throw ConfigError(source + ": step profile version " + j.at("version").dump() + ", this replica reads 1");
    p.model = j.at("model").get<std::string>();
    p.device = j.at("device").get<std::string>();
    p.micro_batch = j.at("micro_batch").get<int64_t>();
    p.steps = j.at("steps").get<int>();
    p.forward_s = j.at("forward_s").get<double>();
    p.backward_s = j.at("backward_s").get<double>();
    p.optimizer_s = j.at("optimizer_s").get<double>();
    p.compute_sd_s = j.value("compute_sd_s", 0.0);
    p.host_s = j.value("host_s", 0.0);
    for (const auto& s : j.at("slots")) {
      p.slot_elements.push_back(s.at(0).get<int64_t>());
      p.slot_ready_s.push_back(s.at(1).get<double>());
    }
  } catch (const Json::exception& e) {
    throw ConfigError(source + ": a step profile without the fields this replica writes: " + e.what() + hint);
  }
  if (p.micro_batch <= 0 || p.slot_elements.empty() || !(p.forward_s > 0) || !(p.backward_s > 0))
    throw ConfigError(source + ": the step profile holds no measured step (micro_batch, slots, times)" + hint);
  return p;
}

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
// The sample standard deviation (0 for fewer than two values).
double sample_sd(const std::vector<double>& v) {
  if (v.size() < 2) return 0;
  double mean = 0, sq = 0;
  for (double x : v) mean += x;
  mean /= static_cast<double>(v.size());
  for (double x : v) sq += (x - mean) * (x - mean);
  return std::sqrt(sq / static_cast<double>(v.size() - 1));
}
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string model_key(const RunConfig& cfg, const data::Dataset& ds) {
  const Shape s = ds.sample_shape();
  return cfg.model.arch + (cfg.model.width > 0 ? " width " + std::to_string(cfg.model.width) : "") + " " +
         std::to_string(s[0]) + "x" + std::to_string(s[1]) + "x" + std::to_string(s[2]) + ", " +
         std::to_string(ds.classes()) + " classes, " + cfg.train.precision + ", " + cfg.optim.name;
}

// Per-step samples of a profile, and what both kinds of profile make of them: medians, the
// spread of forward + backward, each slot's size and median ready time.
struct StepSamples {
  std::vector<double> fwd, bwd, opt;
  std::vector<std::vector<double>> ready;  // per slot
};
void summarise(const StepSamples& s, const nn::Model& model, StepProfile& p) {
  p.steps = static_cast<int>(s.fwd.size());
  p.forward_s = median(s.fwd);
  p.backward_s = median(s.bwd);
  p.optimizer_s = median(s.opt);
  std::vector<double> sums;
  for (size_t i = 0; i < s.fwd.size(); ++i) sums.push_back(s.fwd[i] + s.bwd[i]);
  p.compute_sd_s = sample_sd(sums);
  const auto& slots = model.registry().params();
  for (size_t k = 0; k < slots.size(); ++k) {
    p.slot_elements.push_back(slots[k].shape.numel());
    p.slot_ready_s.push_back(median(s.ready[k]));
  }
}
}  // namespace

std::string profile_model_key(const RunConfig& cfg) { return model_key(cfg, *make_dataset(cfg.data, "test")); }


namespace {
const char* kTraceHint = "; write one with: replica train CONFIG --trace FILE (a few dozen steps)";

struct Slice {
  double ts, dur;  // seconds
};
// What a profile needs of a trace: replica 0's compute-track slices and gradients-ready marks.
struct TraceEvents {
  std::vector<Slice> fwd, bwd, opt, wait;  // bwd: the synchronised backward passes only
  std::vector<std::pair<double, std::pair<int, int>>> ready;  // time, (first slot, count)
  int replicas = 0;                                          // "replica N compute" tracks
};

TraceEvents read_trace_events(const std::string& text, const std::string& source) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    throw ConfigError(source + ": not a trace: " + e.what() + kTraceHint);
  }
  if (!j.is_object() || !j.contains("traceEvents") || !j["traceEvents"].is_array())
    throw ConfigError(source + ": not a Chrome trace (no traceEvents)" + kTraceHint);
  TraceEvents t;
  for (const auto& e : j["traceEvents"]) {
    if (!e.is_object()) continue;
    const std::string ph = e.value("ph", ""), name = e.value("name", "");
    const Json args = e.value("args", Json::object());
    if (ph == "M" && name == "thread_name" && args.value("name", "").find(" compute") != std::string::npos)
      ++t.replicas;
    if (e.value("tid", -1) != 0) continue;  // replica 0's compute track
    const double ts = e.value("ts", 0.0) * 1e-6;
    if (ph == "X") {
      const Slice sl{ts, e.value("dur", 0.0) * 1e-6};
      if (name == "forward") t.fwd.push_back(sl);
      else if (name.rfind("backward (buckets", 0) == 0) t.bwd.push_back(sl);
      else if (name == "optimizer") t.opt.push_back(sl);
      else if (name == "wait for gradient all-reduce") t.wait.push_back(sl);
    } else if (ph == "i" && name == "gradients ready") {
      t.ready.push_back({ts, {static_cast<int>(args.value("first", -1.0)), static_cast<int>(args.value("count", 0.0))}});
    }
  }
  if (t.bwd.size() < 3 || t.ready.empty())
    throw ConfigError(source + ": " + std::to_string(t.bwd.size()) + " synchronised backward passes and " +
                      std::to_string(t.ready.size()) +
                      " 'gradients ready' marks on replica 0; a profile needs at least 3 steps traced by this version" +
                      kTraceHint);
  return t;
}
}  // namespace

StepProfile profile_from_trace(const std::string& text, const std::string& source, const RunConfig& cfg) {
  const TraceEvents tr = read_trace_events(text, source);
  const auto &fwd = tr.fwd, &bwd = tr.bwd, &opt = tr.opt, &wait = tr.wait;  // not a structured binding:
  const auto& ready = tr.ready;                                             // clang 14 cannot capture one
  const int replicas = tr.replicas;
  auto ds = make_dataset(cfg.data, "test");
  auto model = make_model(cfg, ds->sample_shape(), ds->classes());
  const std::string key = model_key(cfg, *ds);
  const auto& slots = model->registry().params();
  const int accumulation = cfg.train.micro_batch > 0 && replicas > 0
                               ? static_cast<int>(cfg.train.global_batch / replicas / cfg.train.micro_batch)
                               : 1;
  StepSamples smp;
  smp.ready.resize(slots.size());
  std::vector<double> w, period;
  // Steps after the first two (allocations, the bucket re-cut): each synchronised backward with
  // the forward just before it, the optimizer and the wait after it.
  for (size_t k = 2; k < bwd.size(); ++k) {
    const Slice& bk = bwd[k];
    std::vector<double> slot_at(slots.size(), -1);
    for (const auto& [t, range] : ready) {
      if (t < bk.ts || t > bk.ts + bk.dur + 1e-6) continue;
      const auto [first, count] = range;
      if (first < 0 || first + count > static_cast<int>(slots.size()))
        throw ConfigError(source + ": gradients of parameter slot " + std::to_string(first + count - 1) + " in a model of " +
                          std::to_string(slots.size()) + " slots: a trace of another model than " + key);
      for (int s = first; s < first + count; ++s) slot_at[static_cast<size_t>(s)] = t - bk.ts;
    }
    for (size_t s = 0; s < slots.size(); ++s)
      if (slot_at[s] >= 0) smp.ready[s].push_back(slot_at[s]);
    auto before = [&](const std::vector<Slice>& v) {  // the last slice that starts before bk
      const Slice* best = nullptr;
      for (const auto& x : v)
        if (x.ts <= bk.ts) best = &x;
      return best;
    };
    auto after = [&](const std::vector<Slice>& v) {  // the first slice that starts after bk
      for (const auto& x : v)
        if (x.ts >= bk.ts) return &x;
      return static_cast<const Slice*>(nullptr);
    };
    const Slice *fk = before(fwd), *ok = after(opt), *wk = after(wait);
    if (!fk || !ok) continue;
    smp.fwd.push_back(fk->dur), smp.bwd.push_back(bk.dur), smp.opt.push_back(ok->dur), w.push_back(wk ? wk->dur : 0);
    if (k + 1 < bwd.size()) period.push_back(bwd[k + 1].ts - bk.ts);
  }
  if (smp.fwd.size() < 2)
    throw ConfigError(source + ": fewer than 2 complete steps on replica 0 after the first two" + kTraceHint);
  for (size_t s = 0; s < slots.size(); ++s)
    if (smp.ready[s].empty())
      throw ConfigError(source + ": parameter slot " + std::to_string(s) + " (" + slots[s].name +
                        ") never became ready in the trace: a trace of another model than " + key);
  StepProfile p;
  p.model = key;
  p.device = source + " (replica 0 of " + std::to_string(replicas) + ", in a run)";
  p.micro_batch = cfg.train.micro_batch > 0 ? cfg.train.micro_batch : cfg.train.global_batch / std::max(1, replicas);
  summarise(smp, *model, p);
  // The step period less what the plan models itself: the host's share of a step.
  if (!period.empty())
    p.host_s = std::max(0.0, median(period) - accumulation * (p.forward_s + p.backward_s) - median(w) - p.optimizer_s);
  return p;
}

namespace {
// One replica of a configuration in a scratch pool, with fixed inputs of one micro-batch: what
// measure_step_profile times. Members in the order they must be built (and torn down in reverse).
struct ScratchReplica {
  Device device;
  bool gpu = false;
  std::unique_ptr<MemoryPool> pool;
  std::unique_ptr<nn::Model> model;
  std::unique_ptr<optim::Optimizer> opt;
  ops::Backend* be = nullptr;
  DType act = DType::f32;
  Tensor x, y, tiny;
  // The step's checks between backward and the optimizer, as ReplicaStep makes them.
  std::vector<std::pair<int64_t, int64_t>> segments;
  Tensor stats, partials;

  // A GPU's kernels run behind the host: wait for them before a step starts, so each step is
  // timed alone (the marks within it are timing events, time_steps).
  void settle() {
    if (!gpu) return;
    float f;
    be->read_to_host(tiny, &f);
  }
  // The finite check and the squared norm over the norm's fixed blocks, then the one host read.
  void checks() {
    be->unscale_check_finite_into(model->grads(), 1.f, stats.view(0, {1}));
    be->segment_sum_squares_into(model->grads(), segments, partials);
    be->sum_in_order_into(partials, stats.view(1, {1}));
    float host[2];
    be->read_to_host(stats, host);
  }
};

ScratchReplica make_scratch(const RunConfig& cfg, const data::Dataset& ds, int64_t micro) {
  ScratchReplica r;
  r.device = parse_devices(cfg.parallel.devices).at(0);
  r.gpu = r.device.kind == DeviceKind::cuda;
  if (r.gpu) cuda::set_device(r.device.index);
  else ops::set_intra_op_threads(cfg.parallel.intra_op_threads);
  PoolOptions po;
  po.mode = AllocatorMode::growth;
  r.pool = make_pool(r.gpu ? r.device : Device{DeviceKind::cpu, 0}, po);
  r.act = parse_dtype(cfg.train.precision);
  const Shape sample = ds.sample_shape();
  r.model = make_model(cfg, sample, ds.classes());
  r.model->materialize(*r.pool, 0, r.act);
  r.opt = make_optimizer(cfg.optim, *r.model, *r.pool);
  r.be = &ops::backend_for(r.pool->device());
  // Inputs and labels like a data set's (not zeros: a step on zeros is not the same work, e.g.
  // batch norm of a constant, a loss at its symmetric point).
  r.x = Tensor::empty(*r.pool, {micro, sample[0], sample[1], sample[2]}, DType::f32, MemTag::other);
  r.y = Tensor::empty(*r.pool, {micro}, DType::i32, MemTag::other);
  std::vector<float> hx(static_cast<size_t>(r.x.numel()));
  std::vector<int32_t> hy(static_cast<size_t>(micro));
  uint32_t seed = 12345;
  for (float& v : hx) seed = seed * 1664525u + 1013904223u, v = static_cast<float>(seed >> 8) / 16777216.0f - 0.5f;
  for (size_t i = 0; i < hy.size(); ++i) hy[i] = static_cast<int32_t>(i % static_cast<size_t>(ds.classes()));
  const Device host{DeviceKind::cpu, 0};
  copy_tensor(Tensor::wrap(hx.data(), r.x.shape(), DType::f32, host), r.x, nullptr);
  copy_tensor(Tensor::wrap(hy.data(), r.y.shape(), DType::i32, host), r.y, nullptr);
  r.tiny = Tensor::zeros(*r.pool, {1}, DType::f32, MemTag::other);
  std::vector<int64_t> offsets;
  for (const auto& slot : r.model->registry().params()) offsets.push_back(slot.offset);
  const int64_t total = r.model->grads().numel();
  r.segments = parallel::norm_segments(parallel::norm_blocks(offsets, total), 0, total);
  r.stats = Tensor::zeros(*r.pool, {2}, DType::f32, MemTag::other);
  r.partials = Tensor::zeros(*r.pool, {std::max<int64_t>(1, static_cast<int64_t>(r.segments.size()))}, DType::f32,
                             MemTag::other);
  return r;
}

// `steps` timed steps after unmeasured ones that settle allocations and cuDNN's algorithm choice (2
// on CPU, 3 on a GPU, whose first step times every algorithm per shape); the checks' times go to
// `checks_s`. On CPU the host clock times each phase. On a GPU the device does: timing events on
// the compute stream at each mark, read once the step is done, so the host runs ahead of the
// kernels as it does in training (a host wait at every mark timed 2740 img/s for a ResNet-50 step
// that trains at 3568, 2026-12-04), and a host slower than the kernels shows as the device's idle
// gaps between marks, as it does in training.
StepSamples time_steps(ScratchReplica& r, const RunConfig& cfg, int64_t micro, int steps, std::vector<double>& checks_s) {
  const size_t slots = r.model->registry().params().size();
  const int warmup = r.gpu ? 3 : 2;
  StepSamples smp;
  smp.ready.resize(slots);
  std::unique_ptr<cuda::StreamTimer> timer;
  if (r.gpu) timer = std::make_unique<cuda::StreamTimer>();
  for (int i = 0; i < steps + warmup; ++i) {
    nn::Context ctx(*r.pool, *r.be, true);
    ctx.act_dtype = r.act;
    ctx.bn_frozen = cfg.model.freeze_bn;
    std::vector<double> at(slots, 0);
    std::vector<int> at_mark(slots, -1);
    Clock::time_point b0;
    if (timer) timer->clear();
    ctx.on_grads_ready = [&](int first, int count) {
      if (timer) {
        const int m = timer->mark();
        for (int s = first; s < first + count; ++s) at_mark[static_cast<size_t>(s)] = m;
        return;
      }
      const double t = since(b0);
      for (int s = first; s < first + count; ++s) at[static_cast<size_t>(s)] = t;
    };
    r.settle();
    const int m0 = timer ? timer->mark() : 0;
    const auto t0 = Clock::now();
    Tensor d;
    nn::forward_and_loss(ctx, *r.model, r.x, r.y, 1.f / static_cast<float>(micro), d);
    const int mf = timer ? timer->mark() : 0;
    double f = since(t0);
    b0 = Clock::now();
    r.model->backward(ctx, d);
    const int mb = timer ? timer->mark() : 0;
    double b = since(b0);
    const auto c0 = Clock::now();
    r.checks();
    const int mc = timer ? timer->mark() : 0;
    double c = since(c0);
    const auto o0 = Clock::now();
    r.opt->step(r.model->params(), r.model->grads(), 0.f, r.model->compute_copy());  // as the step does
    const int mo = timer ? timer->mark() : 0;
    double o = since(o0);
    if (timer) {
      timer->synchronize();
      f = timer->seconds(m0, mf);
      b = timer->seconds(mf, mb);
      c = timer->seconds(mb, mc);
      o = timer->seconds(mc, mo);
      for (size_t s = 0; s < slots; ++s) at[s] = at_mark[s] >= 0 ? timer->seconds(mf, at_mark[s]) : 0;
    }
    if (i < warmup) continue;
    smp.fwd.push_back(f), smp.bwd.push_back(b), smp.opt.push_back(o), checks_s.push_back(c);
    for (size_t s = 0; s < slots; ++s) smp.ready[s].push_back(at[s]);
  }
  return smp;
}
}  // namespace

StepProfile measure_step_profile(const RunConfig& cfg, int64_t micro, int steps) {
  auto ds = make_dataset(cfg.data, "test");
  ScratchReplica r = make_scratch(cfg, *ds, micro);
  std::vector<double> checks_s;
  const StepSamples smp = time_steps(r, cfg, micro, steps, checks_s);
  StepProfile p;
  p.model = model_key(cfg, *ds);
  p.device = r.gpu ? r.device.str() + " (" + cuda_devices().at(r.device.index).name + ")"
                   : "cpu (" + cpu_device_info(0).name + ", " + std::to_string(cfg.parallel.intra_op_threads) +
                         " thread(s) per replica)";
  p.micro_batch = micro;
  summarise(smp, *r.model, p);
  p.host_s = median(checks_s);
  return p;
}

}  // namespace replica::train
