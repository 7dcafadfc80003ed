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

bool Trainer::shrink_to_survivors(const parallel::ReplicaError& e, FitLoop& loop) {
  // From the fault when it was injected (REPLICA_FAULT), else from seeing the failure here.
  using Clock = std::chrono::steady_clock;
  const auto seen = Clock::now();
  const auto t0 = fault_ && fault_->fired_at() ? *fault_->fired_at() : seen;
  auto since = [](Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); };
  // 1. Is it a lost replica we can go on without? One process, one replica failing on its own
  //    (a diverged loss or a bad label fails every replica alike; a hang fails none).
  if (cfg_.parallel.on_replica_failure != "shrink" || group_->processes() > 1) return false;
  if (group_->last_failures().size() != 1) return false;
  const int lost = group_->last_failures().front();
  const int old_world = group_->world();
  std::vector<int> survivors;
  for (int i = 0; i < group_->size(); ++i)
    if (group_->replica(i).rank() != lost) survivors.push_back(i);
  if (survivors.empty()) return false;

  // 2. The last step every survivor completed: their parameters, optimizer state and scaler are
  //    that step's (the update comes after every collective of a step, so a step no survivor
  //    finished changed none of them).
  const State& keep = states_[survivors.front()];
  const int64_t step = keep.memory.step;
  for (int i : survivors)
    if (states_[i].memory.step != step)
      throw TrainingError(std::string(e.what()) + "; the survivors stopped at different steps (" +
                          std::to_string(step) + " and " + std::to_string(states_[i].memory.step) +
                          "), so no consistent state is left to shrink to");

  // 3. That step as a checkpoint, with every replica's statistics (the lost one's own when it
  //    finished the step too, else a survivor's), so resuming on the survivors is the ordinary
  //    resume on another replica count.
  std::vector<std::string> buffers;
  for (int i = 0; i < group_->size(); ++i) {
    const State& st = states_[i].memory.step == step ? states_[i] : keep;
    buffers.push_back(tensor_to_bytes(st.memory.buffers));
  }
  std::string opt_state;
  for (Tensor* t : keep.opt->state()) opt_state += tensor_to_bytes(*t);
  const int64_t spe = sharding_->steps_per_epoch();
  const std::string path = checkpoint_path(checkpoint_dir(), step);
  const Checkpoint ck = compose_checkpoint(keep, buffers, opt_state, step, step / spe, step % spe);
  // Written on a thread while the new group is built and resumes from the same bytes in memory;
  // training goes on only once it is on disk (joined below, and on every way out of here).
  const auto t_write = Clock::now();
  double write_s = 0;
  std::exception_ptr write_error;
  std::thread writer([&] {
    try {
      write_checkpoint(ck, path);
      rotate_checkpoints(checkpoint_dir(), cfg_.checkpoint.keep_last);
    } catch (...) {
      write_error = std::current_exception();
    }
    write_s = since(t_write);
  });
  struct Join {
    std::thread& t;
    ~Join() {
      if (t.joinable()) t.join();
    }
  } join{writer};
  auto written = [&] {
    if (writer.joinable()) writer.join();
    if (write_error) std::rethrow_exception(write_error);
  };
  loop.result.last_checkpoint = path;
  while (!loop.result.history.empty() && loop.result.history.back().step > step) loop.result.history.pop_back();

  std::vector<Device> devices;
  std::string layout;
  for (int i : survivors) {
    devices.push_back(group_->replica(i).device());
    layout += (layout.empty() ? "" : ",") + devices.back().str();
  }
  const std::string lost_device = group_->replica(lost).device().str();
  const int old_accumulation = accumulation_;
  if (static_cast<int64_t>(survivors.size()) < cfg_.parallel.min_replicas) {
    written();
    throw TrainingError(std::string(e.what()) + "; " + std::to_string(survivors.size()) +
                        " replica(s) left, fewer than parallel.min_replicas " +
                        std::to_string(cfg_.parallel.min_replicas) + ": stopped. Step " + std::to_string(step) +
                        " is checkpointed at " + path + "; resume with --resume " + cfg_.train.run_dir +
                        " on the devices that are left");
  }

  // 4. The group again, on the survivors, resumed from that checkpoint. The old group goes first
  //    (its loaders before its pools), then the new one takes the devices.
  const auto t_rebuild = Clock::now();
  states_.clear();
  group_.reset();
  try {
    build(devices);
  } catch (const ConfigError& ce) {  // e.g. a fixed micro-batch that cannot keep the global batch
    written();
    throw TrainingError(std::string(e.what()) + "; cannot continue on " + std::to_string(survivors.size()) +
                        " replica(s): " + ce.what() + ". Step " + std::to_string(step) + " is checkpointed at " + path +
                        "; resume with --resume " + cfg_.train.run_dir + " and a configuration that fits");
  }
  const double rebuild_s = since(t_rebuild);
  const auto t_resume = Clock::now();
  opts_.resume = path;
  const bool print = opts_.print;
  opts_.print = false;  // the lines below say what happened instead of the resume's
  load_resume_point(&ck);
  opts_.print = print;
  const double resume_s = since(t_resume);
  written();
  const double seconds = since(t0);
  const double detect_s = std::chrono::duration<double>(seen - t0).count();

  // 5. Say so: on the terminal, in metrics.jsonl and in the run report.
  char line[1024];
  std::snprintf(line, sizeof line,
                "replica %d (%s) lost at step %ld: continuing on %d replica(s) (%s) from step %ld, accumulation "
                "%d -> %d steps of %ld (global batch %ld kept), checkpoint %s, training again %.2f s after the fault "
                "(survivors stopped %.2f s; checkpoint written in %.2f s while the new group took %.2f s and the "
                "resume %.2f s)",
                lost, lost_device.c_str(), static_cast<long>(step + 1), static_cast<int>(survivors.size()),
                layout.c_str(), static_cast<long>(step), old_accumulation, accumulation_, static_cast<long>(micro_),
                static_cast<long>(cfg_.train.global_batch), path.c_str(), seconds, detect_s, write_s, rebuild_s,
                resume_s);
  events_.push_back(line);
  log_warn(std::string(e.what()));
  if (opts_.print) std::printf("replica: %s\n", line);
  JsonWriter j;
  j.begin_object()
      .field("kind", "event")
      .field("event", "replica_lost")
      .field("step", step)
      .field("lost_rank", static_cast<int64_t>(lost))
      .field("lost_device", lost_device)
      .field("cause", std::string(e.what()))
      .field("world_before", static_cast<int64_t>(old_world))
      .field("world_after", static_cast<int64_t>(survivors.size()))
      .field("devices", layout)
      .field("accumulation", static_cast<int64_t>(accumulation_))
      .field("checkpoint", path)
      .field("recovery_s", seconds)
      .field("detect_s", detect_s)
      .field("checkpoint_s", write_s)
      .field("rebuild_s", rebuild_s)
      .field("resume_s", resume_s)
      .end_object();
  loop.sinks.event(j.str());
  return true;
}

}  // namespace replica::train
