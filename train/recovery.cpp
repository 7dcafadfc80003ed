// Recovery from a lost replica: REPLICA_FAULT, the per-step memory a shrink continues from, and
// Trainer::shrink_to_survivors, the rebuild of the group on the replicas that are left.
#include "train/recovery.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "core/json.h"
#include "core/log.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace replica::train {

FaultInjector FaultInjector::parse(const std::string& spec) {
  auto bad = [&](const std::string& why) {
    return ConfigError("REPLICA_FAULT=" + spec + ": " + why +
                       "; the form is replica:R:step:N[:WHERE] with WHERE one of start, bucket, optimizer, eval, "
                       "checkpoint (e.g. replica:1:step:7)");
  };
  std::vector<std::string> f;
  std::stringstream ss(spec);
  for (std::string part; std::getline(ss, part, ':');) f.push_back(part);
  if (f.size() < 4 || f.size() > 5 || f[0] != "replica" || f[2] != "step") throw bad("not understood");
  FaultInjector fi;
  try {
    size_t used = 0;
    fi.rank = std::stoi(f[1], &used);
    if (used != f[1].size() || fi.rank < 0) throw bad("'" + f[1] + "' is not a replica number");
    fi.step = std::stoll(f[3], &used);
    if (used != f[3].size() || fi.step < 1) throw bad("'" + f[3] + "' is not a step number (1 is the first)");
  } catch (const std::logic_error&) {
    throw bad("'" + f[1] + "' / '" + f[3] + "' are not numbers");
  }
  if (f.size() == 5) {
    fi.where = f[4];
    if (fi.where != "start" && fi.where != "bucket" && fi.where != "optimizer" && fi.where != "eval" &&
        fi.where != "checkpoint")
      throw bad("'" + fi.where + "' is not a place a fault can be injected");
  }
  return fi;
}

std::optional<FaultInjector> FaultInjector::from_env() {
  const char* v = std::getenv("REPLICA_FAULT");
  if (!v || !*v) return std::nullopt;
  return parse(v);
}

void FaultInjector::at(const char* w, int r, int64_t s) {
  if (r != rank || s != step || where != w) return;
  if (fired_->exchange(true)) return;
  fired_ns_->store(std::chrono::steady_clock::now().time_since_epoch().count());
  throw InjectedFault("injected fault (REPLICA_FAULT): replica " + std::to_string(rank) + " at step " +
                      std::to_string(step) + " (" + where + ")");
}

std::optional<std::chrono::steady_clock::time_point> FaultInjector::fired_at() const {
  const int64_t ns = fired_ns_->load();
  if (!ns) return std::nullopt;
  return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(ns));
}

std::string FaultInjector::describe() const {
  return "replica " + std::to_string(rank) + " at step " + std::to_string(step) + " (" + where + ")";
}

void Trainer::fault_point(parallel::Replica& rep, const char* where) {
  if (fault_) fault_->at(where, rep.rank(), states_[rep.local_index()].running_step);
}

// A device copy of the statistics after each completed step (shrink only: a copy of the batch
// norm buffers, tens of KiB for a ResNet-50, queued on the replica's stream without a host wait).
void Trainer::remember_step(parallel::Replica& rep, int64_t step) {
  if (cfg_.parallel.on_replica_failure != "shrink") return;
  auto& st = states_[rep.local_index()];
  const Tensor& b = st.model->buffers();
  if (!st.memory.buffers.defined())
    st.memory.buffers = Tensor::empty(rep.pool(), b.shape(), b.dtype(), MemTag::other);
  copy_tensor(b, st.memory.buffers, &rep.stream());
  st.memory.step = step;
}

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

// A checkpoint written on its own thread; wait() rethrows its failure, and the destructor joins,
// so no way out of a shrink leaves the file half-written behind a running thread.
class CheckpointWriter {
 public:
  CheckpointWriter(const Checkpoint& ck, std::string path, std::string dir, int keep)
      : t0_(Clock::now()), thread_([this, &ck, path = std::move(path), dir = std::move(dir), keep] {
          try {
            write_checkpoint(ck, path);
            rotate_checkpoints(dir, keep);
          } catch (...) {
            error_ = std::current_exception();
          }
          seconds_ = since(t0_);
        }) {}
  ~CheckpointWriter() {
    if (thread_.joinable()) thread_.join();
  }
  double wait() {
    if (thread_.joinable()) thread_.join();
    if (error_) std::rethrow_exception(error_);
    return seconds_;
  }

 private:
  Clock::time_point t0_;
  std::exception_ptr error_;
  double seconds_ = 0;
  std::thread thread_;  // last: it starts once the members above exist
};

// What a shrink did, for the terminal, metrics.jsonl and the run report.
struct ShrinkRecord {
  int lost = -1, world_before = 0, world_after = 0, accumulation_before = 0, accumulation_after = 0;
  int64_t step = 0, micro = 0, global_batch = 0;
  std::string lost_device, layout, checkpoint, cause;
  double total_s = 0, detect_s = 0, write_s = 0, rebuild_s = 0, resume_s = 0;

  std::string line() const {
    char b[1024];
    std::snprintf(b, sizeof b,
                  "replica %d (%s) lost at step %ld: continuing on %d replica(s) (%s) from step %ld, accumulation "
                  "%d -> %d steps of %ld (global batch %ld kept), checkpoint %s, training again %.2f s after the "
                  "fault (survivors stopped %.2f s; checkpoint written in %.2f s while the new group took %.2f s and "
                  "the resume %.2f s)",
                  lost, lost_device.c_str(), static_cast<long>(step + 1), world_after, layout.c_str(),
                  static_cast<long>(step), accumulation_before, accumulation_after, static_cast<long>(micro),
                  static_cast<long>(global_batch), checkpoint.c_str(), total_s, detect_s, write_s, rebuild_s,
                  resume_s);
    return b;
  }
  std::string json() const {
    return json_line({{"kind", "event"},
                      {"event", "replica_lost"},
                      {"step", step},
                      {"lost_rank", lost},
                      {"lost_device", lost_device},
                      {"cause", cause},
                      {"world_before", world_before},
                      {"world_after", world_after},
                      {"devices", layout},
                      {"accumulation", accumulation_after},
                      {"checkpoint", checkpoint},
                      {"recovery_s", json_number(total_s)},
                      {"detect_s", json_number(detect_s)},
                      {"checkpoint_s", json_number(write_s)},
                      {"rebuild_s", json_number(rebuild_s)},
                      {"resume_s", json_number(resume_s)}});
  }
};
}  // namespace

// The last step every survivor completed, with every replica's statistics (the lost one's own
// when it finished that step too, else a survivor's), so resuming on the survivors is the
// ordinary resume on another replica count.
Checkpoint Trainer::last_step_checkpoint(const std::vector<int>& survivors, int64_t step) const {
  const State& keep = states_[survivors.front()];
  std::vector<std::string> buffers;
  for (const State& st : states_) buffers.push_back(tensor_to_bytes((st.memory.step == step ? st : keep).memory.buffers));
  std::string opt_state;
  for (Tensor* t : keep.opt->state()) opt_state += tensor_to_bytes(*t);
  const int64_t spe = sharding_->steps_per_epoch();
  // A shrinking run is never sharded (Trainer's constructor refuses it): keep's state is whole.
  const std::string params = tensor_to_bytes(keep.model->params());
  std::string ema;
  std::vector<std::string> ema_buffers;
  if (keep.ema) {  // the moving average after that step (updated right after each applied step)
    ema = tensor_to_bytes(keep.ema->params());
    for (const State& st : states_) ema_buffers.push_back(tensor_to_bytes((st.memory.step == step ? st : keep).ema->buffers()));
  }
  return compose_checkpoint(keep, params, buffers, opt_state, step, step / spe, step % spe, ema, ema_buffers);
}

namespace {
// Who was lost and who is left: the record's first half, and the survivors' local indices and
// devices (the new group's).
ShrinkRecord record_loss(parallel::ReplicaGroup& group, const std::string& cause, int accumulation,
                         std::vector<int>& survivors, std::vector<Device>& devices) {
  ShrinkRecord r;
  r.cause = cause;
  r.lost = group.last_failures().front();
  r.lost_device = group.replica(r.lost).device().str();
  r.world_before = group.world();
  r.accumulation_before = accumulation;
  for (int i = 0; i < group.size(); ++i) {
    if (group.replica(i).rank() == r.lost) continue;
    survivors.push_back(i);
    devices.push_back(group.replica(i).device());
    r.layout += (r.layout.empty() ? "" : ",") + devices.back().str();
  }
  r.world_after = static_cast<int>(survivors.size());
  return r;
}
}  // namespace

bool Trainer::shrink_to_survivors(const parallel::ReplicaError& e, FitLoop& loop) {
  // 1. Is it a lost replica we can go on without? One process, one replica failing on its own
  //    (a diverged loss or a bad label fails every replica alike; a hang fails none).
  if (cfg_.parallel.on_replica_failure != "shrink" || group_->processes() > 1) return false;
  if (group_->last_failures().size() != 1 || group_->size() < 2) return false;
  const auto seen = Clock::now();
  const auto t0 = fault_ && fault_->fired_at() ? *fault_->fired_at() : seen;  // REPLICA_FAULT's throw
  std::vector<int> survivors;
  std::vector<Device> devices;
  ShrinkRecord r = record_loss(*group_, e.what(), accumulation_, survivors, devices);

  // 2. The last step every survivor completed: their parameters, optimizer state and scaler are
  //    that step's (the update comes after every collective of a step, so a step no survivor
  //    finished changed none of them).
  r.step = states_[survivors.front()].memory.step;
  for (int i : survivors)
    if (states_[i].memory.step != r.step)
      throw TrainingError(r.cause + "; the survivors stopped at different steps (" + std::to_string(r.step) + " and " +
                          std::to_string(states_[i].memory.step) + "), so no consistent state is left to shrink to");

  // 3. That step as a checkpoint, written while the new group is built (4) and resumed from in
  //    memory; training goes on only once it is on disk.
  const Checkpoint ck = last_step_checkpoint(survivors, r.step);
  r.checkpoint = checkpoint_path(checkpoint_dir(), r.step);
  CheckpointWriter writer(ck, r.checkpoint, checkpoint_dir(), cfg_.checkpoint.keep_last);
  loop.result.last_checkpoint = r.checkpoint;
  while (!loop.result.history.empty() && loop.result.history.back().step > r.step) loop.result.history.pop_back();
  const std::string resume_hint = " Step " + std::to_string(r.step) + " is checkpointed at " + r.checkpoint +
                                  "; resume with --resume " + cfg_.train.run_dir;
  if (r.world_after < cfg_.parallel.min_replicas) {
    writer.wait();
    throw RestartableError(r.cause + "; " + std::to_string(r.world_after) + " replica(s) left, fewer than " +
                           "parallel.min_replicas " + std::to_string(cfg_.parallel.min_replicas) + ": stopped." +
                           resume_hint + " once the lost device is back, or on the devices that are left with a "
                           "lower parallel.min_replicas");
  }

  // 4. The group again, on the survivors, resumed from that checkpoint. The old group goes first
  //    (its loaders before its pools), then the new one takes the devices.
  const auto t_rebuild = Clock::now();
  for (auto& st : states_)  // no collective of the old group may still read a buffer freed below
    if (st.step) st.step->drain();
  states_.clear();
  group_.reset();
  try {
    build(devices);
  } catch (const ConfigError& ce) {  // e.g. a fixed micro-batch that cannot keep the global batch
    writer.wait();
    throw TrainingError(r.cause + "; cannot continue on " + std::to_string(r.world_after) + " replica(s): " +
                        ce.what() + "." + resume_hint + " and a configuration that fits");
  }
  r.rebuild_s = since(t_rebuild);
  const auto t_resume = Clock::now();
  opts_.resume = r.checkpoint;
  const bool print = opts_.print;
  opts_.print = false;  // the lines below say what happened instead of the resume's
  load_resume_point(&ck);
  opts_.print = print;
  r.resume_s = since(t_resume);
  r.write_s = writer.wait();
  r.total_s = since(t0);
  r.detect_s = std::chrono::duration<double>(seen - t0).count();
  r.accumulation_after = accumulation_;
  r.micro = micro_;
  r.global_batch = cfg_.train.global_batch;

  // 5. Say so: on the terminal, in metrics.jsonl and in the run report.
  events_.push_back(r.line());
  log_warn(r.cause);
  if (opts_.print) std::printf("replica: %s\n", events_.back().c_str());
  loop.sinks.event(r.json());
  return true;
}

}  // namespace replica::train
