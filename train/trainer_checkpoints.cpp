// Trainer's checkpoints: writing one (every replica's statistics and the optimizer state gathered
// whole, so any replica count and sharding resumes from it), and resuming from the newest valid
// one, checked whole before anything is applied.
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/errors.h"
#include "core/log.h"
#include "parallel/gradient_sync.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace replica::train {

using Clock = std::chrono::steady_clock;

std::string Trainer::checkpoint_dir() const {
  return cfg_.checkpoint.dir.empty() ? cfg_.train.run_dir + "/checkpoints" : cfg_.checkpoint.dir;
}


void Trainer::save_checkpoint(parallel::Replica& rep, FitLoop& loop, CheckpointPolicy& checkpoints,
                              int64_t global_step, int64_t epoch, int64_t step_in_epoch) {
  const auto t0 = Clock::now();
  checkpoints.saved(global_step);
  const std::string path = write_checkpoint_file(rep, checkpoints, global_step, epoch, step_in_epoch);
  if (rep.rank() == 0) {
    loop.result.last_checkpoint = path;
    loop.checkpoint_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }
}

std::string Trainer::write_checkpoint_file(parallel::Replica& rep, const CheckpointPolicy& policy, int64_t global_step,
                                           int64_t epoch,
                                           int64_t step_in_epoch) {
  // Every replica's batch-norm statistics, gathered to all (they live in other processes under MPI).
  Tensor& mine = states_[rep.local_index()].model->buffers();
  const std::vector<float> all_buffers = rep.all_gather(mine.data<float>(), static_cast<size_t>(mine.numel()));
  // The optimizer state whole, as an unsharded run writes it (gathered from the shards), so any
  // replica count, sharded or not, resumes from it.
  const std::string opt_state = gather_optimizer_state(rep);
  const std::string masters = gather_masters(rep);
  // The moving average (train.ema_decay): its weights whole, every replica's statistics.
  const WeightEma* ema = states_[rep.local_index()].ema.get();
  const std::string ema_whole = ema ? whole_of(rep, ema->params()) : std::string();
  const std::vector<float> all_ema_buffers =
      ema ? rep.all_gather(ema->buffers().data<float>(), static_cast<size_t>(ema->buffers().numel()))
          : std::vector<float>();
  std::string path;
  fault_point(rep, "checkpoint");  // REPLICA_FAULT=...:checkpoint: after the gathers, before the file
  if (rep.rank() == 0) {
    const size_t nb = static_cast<size_t>(mine.numel());
    std::vector<std::string> buffers, ema_buffers;
    for (int r = 0; r < replicas(); ++r) {
      buffers.emplace_back(reinterpret_cast<const char*>(all_buffers.data() + r * nb), nb * sizeof(float));
      if (ema) ema_buffers.emplace_back(reinterpret_cast<const char*>(all_ema_buffers.data() + r * nb), nb * sizeof(float));
    }
    path = checkpoint_path(policy.dir(), global_step);
    write_checkpoint(compose_checkpoint(states_[0], masters, buffers, opt_state, global_step, epoch, step_in_epoch,
                                        ema_whole, ema_buffers),
                     path);
    rotate_checkpoints(policy.dir(), policy.keep_last());
  }
  rep.comm().barrier();
  return path;
}

Checkpoint Trainer::compose_checkpoint(const State& st, const std::string& params,
                                       const std::vector<std::string>& buffers, const std::string& opt_state,
                                       int64_t global_step, int64_t epoch, int64_t step_in_epoch,
                                       const std::string& ema, const std::vector<std::string>& ema_buffers) const {
  Checkpoint c;
  c.sections["config"] = cfg_.resolved;
  c.set_meta({{"global_step", std::to_string(global_step)},
              {"epoch", std::to_string(epoch)},
              {"step_in_epoch", std::to_string(step_in_epoch)},
              {"world", std::to_string(buffers.size())},
              {"global_batch", std::to_string(cfg_.train.global_batch)},
              {"arch", st.model->name()},
              {"num_params", std::to_string(st.model->num_params())},
              {"num_buffers", std::to_string(st.model->num_buffers())},
              {"precision", cfg_.train.precision},
              {"optimizer", st.opt->name()},
              {"optimizer_steps", std::to_string(st.opt->steps())},
              {"seed", std::to_string(cfg_.train.seed)}});
  c.sections["params"] = params;
  for (size_t r = 0; r < buffers.size(); ++r) c.sections["buffers." + std::to_string(r)] = buffers[r];
  c.sections["optimizer"] = opt_state;
  if (!ema.empty()) {
    c.sections["ema"] = ema;
    for (size_t r = 0; r < ema_buffers.size(); ++r) c.sections["ema_buffers." + std::to_string(r)] = ema_buffers[r];
  }
  if (st.scaler) {
    // Field by field into zeroed bytes of the struct's layout (what resume reads): a copy of the
    // struct would carry its padding, uninitialised, and two identical runs would write different
    // checkpoints (caught by the sharding test's byte comparison).
    const auto ss = st.scaler->state();
    using State = optim::DynamicLossScaler::State;
    std::string bytes(sizeof(State), '\0');
    auto put = [&](size_t at, const auto& v) { std::memcpy(bytes.data() + at, &v, sizeof v); };
    put(offsetof(State, scale), ss.scale);
    put(offsetof(State, good), ss.good);
    put(offsetof(State, skipped), ss.skipped);
    put(offsetof(State, floor_overflows), ss.floor_overflows);
    put(offsetof(State, hysteresis_left), ss.hysteresis_left);
    c.sections["scaler"] = bytes;
  }
  return c;
}

std::string Trainer::gather_optimizer_state(parallel::Replica& rep) {
  optim::Optimizer& opt = *states_[rep.local_index()].opt;
  const parallel::ShardPlan& plan = states_[rep.local_index()].step->shard_plan();
  const int64_t lo = opt.range_lo(), hi = opt.range_hi(), total = opt.total();
  std::string out;
  if (!plan.sharded() || plan.world() == 1) {  // every replica holds it all
    if (rep.rank() == 0)
      for (Tensor* t : opt.state()) out += tensor_to_bytes(*t);
    return out;
  }
  const std::vector<size_t> bounds(plan.bounds.begin(), plan.bounds.end());
  for (Tensor* t : opt.state()) {
    std::vector<float> full(static_cast<size_t>(total), 0.f);
    if (hi > lo) {
      const std::string m = tensor_to_bytes(t->view(0, {hi - lo}));
      std::memcpy(full.data() + lo, m.data(), m.size());
    }
    parallel::all_gather_v_host(rep.comm(), &rep.pool(), full.data(), full.size(), bounds);
    if (rep.rank() == 0) out.append(reinterpret_cast<const char*>(full.data()), full.size() * sizeof(float));
  }
  return out;
}

std::string Trainer::gather_masters(parallel::Replica& rep) {
  nn::Model& model = *states_[rep.local_index()].model;
  if (!model.masters_sharded()) return rep.rank() == 0 ? tensor_to_bytes(model.params()) : std::string();
  // Sharded: this replica's range copied straight into the whole buffer, the others gathered there.
  return whole_of(rep, model.params());
}

std::string Trainer::whole_of(parallel::Replica& rep, const Tensor& range) {
  nn::Model& model = *states_[rep.local_index()].model;
  if (!model.masters_sharded()) return tensor_to_bytes(range);
  const int64_t total = std::max<int64_t>(model.num_params(), 1), lo = model.masters_lo(), hi = model.masters_hi();
  std::string whole(static_cast<size_t>(total) * sizeof(float), '\0');
  float* w = reinterpret_cast<float*>(whole.data());
  if (hi > lo) copy_tensor(range.view(0, {hi - lo}), Tensor::wrap(w + lo, {hi - lo}, DType::f32, Device{}));
  if (rep.world() > 1) {
    const parallel::ShardPlan& plan = states_[rep.local_index()].step->shard_plan();
    parallel::all_gather_v_host(rep.comm(), &rep.pool(), w, static_cast<size_t>(total),
                                std::vector<size_t>(plan.bounds.begin(), plan.bounds.end()));
  }
  return whole;
}

namespace {
// What a resume needs from a checkpoint, checked whole before anything is applied: a checkpoint
// that fails any check is skipped (with the reason), never half-loaded.
struct ResumePoint {
  int64_t global_step = 0, epoch = 0, step_in_epoch = 0, optimizer_steps = 0, global_batch = 0;
  int world = 0;
};

ResumePoint check_resume_point(const Checkpoint& ck, const std::string& file, nn::Model& model,
                               optim::Optimizer& opt, const optim::DynamicLossScaler* scaler, int64_t steps_per_epoch) {
  constexpr int64_t kBig = int64_t(1) << 53;
  ResumePoint p;
  auto in = [&](const std::string& what) { return file + ": " + what; };
  try {
    const int64_t num_params = ck.meta_int("num_params", 0, kBig);
    if (ck.meta_value("arch") != model.name() || num_params != model.num_params())
      throw IoError("section 'meta': holds a " + ck.meta_value("arch") + " with " + std::to_string(num_params) +
                    " parameters but the configuration builds a " + model.name() + " with " +
                    std::to_string(model.num_params()));
    p.global_step = ck.meta_int("global_step", 0, kBig);
    p.epoch = ck.meta_int("epoch", 0, kBig);
    p.step_in_epoch = ck.meta_int("step_in_epoch", 0, std::max<int64_t>(0, steps_per_epoch - 1));
    p.optimizer_steps = ck.meta_int("optimizer_steps", 0, p.global_step);
    p.global_batch = ck.meta_int("global_batch", 1, kBig);
    p.world = static_cast<int>(ck.meta_int("world", 1, 1 << 20));
  } catch (const IoError& e) {
    std::string m = e.what();
    if (m.rfind("checkpoint: ", 0) == 0) m = m.substr(12);
    throw IoError(in(m));
  }
  const size_t pbytes = static_cast<size_t>(std::max<int64_t>(model.num_params(), 1)) * sizeof(float);
  const size_t bbytes = model.buffers().nbytes();
  if (ck.sections.at("params").size() != pbytes)
    throw IoError(in("section 'params' holds " + std::to_string(ck.sections.at("params").size()) +
                     " bytes, the model needs " + std::to_string(pbytes) + " (another model or width?)"));
  // The moving average (train.ema_decay), when the checkpoint has one: checked as the model's.
  const bool ema = ck.sections.count("ema") > 0;
  if (ema && ck.sections.at("ema").size() != pbytes)
    throw IoError(in("section 'ema' holds " + std::to_string(ck.sections.at("ema").size()) + " bytes, the model needs " +
                     std::to_string(pbytes)));
  for (const char* prefix : {"buffers.", "ema_buffers."}) {
    if (!ema && std::string(prefix) == "ema_buffers.") break;
    for (int r = 0; r < p.world; ++r) {
      const std::string name = prefix + std::to_string(r);
      auto it = ck.sections.find(name);
      if (it == ck.sections.end())
        throw IoError(in("section '" + name + "' is missing (the checkpoint ran on " + std::to_string(p.world) +
                         " replicas)"));
      if (it->second.size() != bbytes)
        throw IoError(in("section '" + name + "' holds " + std::to_string(it->second.size()) +
                         " bytes, the model needs " + std::to_string(bbytes)));
    }
  }
  const size_t need = opt.state().size() * static_cast<size_t>(opt.total()) * sizeof(float);  // whole, as written
  auto o = ck.sections.find("optimizer");
  const size_t have = o == ck.sections.end() ? 0 : o->second.size();
  if (ck.meta_value("optimizer") != opt.name() || have != need)
    throw ConfigError("--resume " + file + ": the checkpoint's optimizer is " + ck.meta_value("optimizer") + " (" +
                      std::to_string(have) + " bytes of state), the configuration's " + opt.name() + " (" +
                      std::to_string(need) + "); keep optim.name to resume");
  if (scaler) {
    auto sc = ck.sections.find("scaler");
    if (sc != ck.sections.end()) {
      optim::DynamicLossScaler::State ss;
      if (sc->second.size() != sizeof ss)
        throw IoError(in("section 'scaler' holds " + std::to_string(sc->second.size()) + " bytes, expected " +
                         std::to_string(sizeof ss)));
      std::memcpy(&ss, sc->second.data(), sizeof ss);
      if (!std::isfinite(ss.scale) || ss.scale <= 0 || ss.good < 0 || ss.skipped < 0)
        throw IoError(in("section 'scaler' holds an impossible state (scale " + std::to_string(ss.scale) + ")"));
    }
  }
  return p;
}
// Every replica's batch-norm statistics averaged, for a resume on another replica count (`prefix`:
// "buffers." for the model's, "ema_buffers." for the moving average's).
std::vector<float> average_statistics(const Checkpoint& ck, int old_world, size_t n, const std::string& prefix = "buffers.") {
  std::vector<double> acc(n, 0.0);
  std::vector<float> f(n);
  for (int r = 0; r < old_world; ++r) {
    std::memcpy(f.data(), ck.sections.at(prefix + std::to_string(r)).data(), n * sizeof(float));
    for (size_t i = 0; i < n; ++i) acc[i] += f[i];
  }
  for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>(acc[i] / old_world);
  return f;
}
}  // namespace

// The moving average from the checkpoint: this replica's range of its weights and its statistics
// (its own on the same replica count, else the average). A checkpoint written without one (the
// average turned on at the resume) starts it from the resumed weights, saying so.
void Trainer::restore_ema(parallel::Replica& rep, const Checkpoint& ck, int old_world) {
  auto& st = states_[rep.local_index()];
  WeightEma& ema = *st.ema;
  const auto it = ck.sections.find("ema");
  if (it == ck.sections.end()) {  // sizes were checked with the rest (check_resume_point)
    if (rep.rank() == 0) log_warn("train.ema_decay: the checkpoint holds no moving average; it starts from the resumed weights");
    copy_tensor(st.model->params(), ema.params(), &rep.stream());
    copy_tensor(st.model->buffers(), ema.buffers(), &rep.stream());
    return;
  }
  const int64_t lo = st.model->masters_lo(), n = ema.params().numel();
  tensor_from_bytes(ema.params(), it->second.data() + lo * sizeof(float), static_cast<size_t>(n) * sizeof(float));
  const size_t nb = static_cast<size_t>(ema.buffers().numel());
  if (old_world == replicas()) {
    const std::string& mine = ck.sections.at("ema_buffers." + std::to_string(rep.rank()));
    tensor_from_bytes(ema.buffers(), mine.data(), mine.size());
  } else {
    const std::vector<float> f = average_statistics(ck, old_world, nb, "ema_buffers.");
    tensor_from_bytes(ema.buffers(), f.data(), f.size() * sizeof(float));
  }
}

// One replica's part of a resume, from a checkpoint already checked whole: the masters (whole, or
// its shard and the 16-bit copy whole), its batch-norm statistics (its own on the same replica
// count, else the average), its range of the optimizer state, the step count and the scaler.
void Trainer::restore_replica(parallel::Replica& rep, const Checkpoint& ck, int old_world, int64_t optimizer_steps) {
  auto& st = states_[rep.local_index()];
  const std::string& params = ck.sections.at("params");
  std::vector<float> whole(params.size() / sizeof(float));
  std::memcpy(whole.data(), params.data(), whole.size() * sizeof(float));
  st.model->load_masters(whole.data());
  Tensor& b = st.model->buffers();
  if (old_world == replicas()) {
    const std::string& mine = ck.sections.at("buffers." + std::to_string(rep.rank()));
    tensor_from_bytes(b, mine.data(), mine.size());
  } else {
    const std::vector<float> f = average_statistics(ck, old_world, static_cast<size_t>(b.numel()));
    tensor_from_bytes(b, f.data(), f.size() * sizeof(float));
  }
  // load_masters rounded the 16-bit copy already (whole, sharded or not): nothing to refresh.
  // The whole state is in the checkpoint; a sharded replica takes its own range of it.
  const std::string& opt = ck.sections.at("optimizer");
  const int64_t lo = st.opt->range_lo(), hi = st.opt->range_hi();
  size_t off = 0;
  for (Tensor* t : st.opt->state()) {
    if (hi > lo) tensor_from_bytes(t->view(0, {hi - lo}), opt.data() + off + lo * sizeof(float), (hi - lo) * sizeof(float));
    off += static_cast<size_t>(st.opt->total()) * sizeof(float);
  }
  st.opt->set_steps(optimizer_steps);
  if (st.ema) restore_ema(rep, ck, old_world);
  if (st.scaler && ck.sections.count("scaler")) {
    optim::DynamicLossScaler::State ss;
    std::memcpy(&ss, ck.sections.at("scaler").data(), sizeof ss);
    st.scaler->restore(ss);
  }
}

void Trainer::load_resume_point(const Checkpoint* in_memory) {
  std::vector<std::string> candidates;
  const std::string& where = opts_.resume;
  if (in_memory || std::filesystem::is_regular_file(where)) {
    candidates.push_back(where);
  } else {
    candidates = list_checkpoints(where + "/checkpoints");
    if (candidates.empty()) candidates = list_checkpoints(where);
  }
  if (candidates.empty())
    throw ConfigError("--resume " + where + ": no checkpoints (step-*.ckpt) in " + where + "/checkpoints");
  Checkpoint read;
  const Checkpoint* ckp = in_memory;
  ResumePoint at;
  std::string used, reasons;
  for (auto& c : candidates) {
    try {
      if (!in_memory) {
        read = read_checkpoint(c);
        ckp = &read;
      }
      at = check_resume_point(*ckp, c, *states_[0].model, *states_[0].opt, states_[0].scaler.get(),
                              sharding_->steps_per_epoch());
      used = c;
      break;
    } catch (const IoError& e) {
      log_warn("skipping checkpoint ", c, ": ", e.what(), candidates.back() == c ? "" : "; trying the previous one");
      reasons += std::string("\n  ") + e.what();
    }
  }
  if (used.empty()) throw IoError("--resume " + where + ": no valid checkpoint:" + reasons);
  if (at.global_batch != cfg_.train.global_batch)
    throw ConfigError("--resume: the checkpoint was trained with global batch " + std::to_string(at.global_batch) +
                      " but the configuration says " + std::to_string(cfg_.train.global_batch) +
                      "; keep train.global_batch (the data position and the schedule depend on it)");
  group_->run([&](parallel::Replica& rep) { restore_replica(rep, *ckp, at.world, at.optimizer_steps); });
  start_global_step_ = at.global_step;
  start_epoch_ = at.epoch;
  start_step_in_epoch_ = at.step_in_epoch;
  resumed_from_ = used;
  if (opts_.print) {
    std::printf("replica: resumed from %s at step %ld (epoch %ld, step %ld of it)\n", used.c_str(),
                (long)start_global_step_, (long)start_epoch_ + 1, (long)start_step_in_epoch_);
    if (at.world != replicas())
      std::printf("replica: the checkpoint ran on %d replica(s), this run on %d: %d accumulation step(s) of %ld keep the "
                  "global batch of %ld\n",
                  at.world, replicas(), accumulation_, (long)micro_, (long)cfg_.train.global_batch);
  }
}

}  // namespace replica::train
