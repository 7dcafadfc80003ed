// `replica plan`: reads the configuration, gets a step profile (measured here, or a file from
// another machine), a link (the table, or fitted to bench allreduce output), and prints one line
// per alternative device count and link.
#include "apps/plan.h"

#include <cstdio>
#include <map>

#include "core/device.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/units.h"
#include "train/config.h"
#include "train/memplan.h"
#include "train/scaling_plan.h"
#include "train/trainer.h"

namespace replica::apps {

namespace {

std::vector<parallel::Link> intra_links(const PlanArgs& a, bool cpu) {
  if (!a.link_file.empty()) {
    if (!a.links.empty()) throw ConfigError("give --link or --link-file, not both");
    return {train::read_link_file(a.link_file)};
  }
  if (a.links.empty())
    throw ConfigError(cpu ? "--link-file FILE is needed for CPU replicas: their all-reduce is this machine's memory; "
                            "measure it with: replica bench allreduce --devices cpu:2 -b 1K -e 64M -f 4 > FILE"
                          : "--link KIND is needed (pcie4, nvlink4, ...; see replica plan --help), or --link-file FILE");
  std::vector<parallel::Link> out;
  for (const auto& k : a.links) out.push_back(parallel::find_link(k));
  return out;
}

// The profile at micro-batch b: measured here for each micro-batch the plan needs (so small
// batches are not guessed from large ones), or a file's, scaled (StepProfile::at_micro_batch).
class Profiles {
 public:
  Profiles(const train::RunConfig& cfg, const PlanArgs& a) : cfg_(cfg), a_(a) {
    if (!a.trace_profile.empty()) {
      if (a.profile || !a.device_profile.empty())
        throw ConfigError("give one of --profile, --device-profile FILE and --trace-profile FILE");
      file_ = train::profile_from_trace(read_file(a.trace_profile, "the --trace-profile"), a.trace_profile, cfg);
    }
    if (!a.device_profile.empty()) {
      if (a.profile) throw ConfigError("give --profile (measure here) or --device-profile FILE, not both");
      file_ = train::StepProfile::from_json(read_file(a.device_profile, "the --device-profile"), a.device_profile);
      const std::string want = train::profile_model_key(cfg);
      if (file_.model != want)
        throw ConfigError(a.device_profile + " is a profile of '" + file_.model + "'; this configuration trains '" + want +
                          "': measure one with replica plan CONFIG --profile --save-profile FILE on that device");
    }
  }
  bool measured() const { return a_.device_profile.empty() && a_.trace_profile.empty(); }
  train::StepProfile at(int64_t micro) {
    if (a_.device_images_per_s > 0) {
      // The rate is the device's at the profile's own micro-batch; then scaled to `micro`.
      const train::StepProfile base = measured() ? measure(measured_micro()) : file_;
      return base.scaled_to(a_.device_images_per_s).at_micro_batch(micro);
    }
    if (!measured()) return file_.at_micro_batch(micro);
    return measure(micro);
  }

 private:
  // A scaled profile is measured once, at the configuration's micro-batch (or 8).
  int64_t measured_micro() const { return cfg_.train.micro_batch > 0 ? cfg_.train.micro_batch : 8; }
  train::StepProfile measure(int64_t micro) {
    auto it = measured_.find(micro);
    if (it == measured_.end()) {
      std::fprintf(stderr, "replica plan: measuring %d steps at micro-batch %ld on %s ...\n", a_.profile_steps,
                   static_cast<long>(micro), cfg_.parallel.devices.c_str());
      it = measured_.emplace(micro, train::measure_step_profile(cfg_, micro, a_.profile_steps)).first;
    }
    return it->second;
  }

  const train::RunConfig& cfg_;
  const PlanArgs& a_;
  train::StepProfile file_;
  std::map<int64_t, train::StepProfile> measured_;
};

// What the configuration and the command line say of every alternative.
train::PlanOptions plan_options(const train::RunConfig& cfg, const PlanArgs& a) {
  train::PlanOptions o;
  o.global_batch = cfg.train.global_batch;
  o.wire_bytes = static_cast<double>(dtype_size(parse_dtype(cfg.parallel.grad_dtype)));
  o.bucket_mb = cfg.parallel.bucket_mb;
  o.first_bucket_mb = cfg.parallel.first_bucket_mb;
  o.choose_bucket = true;
  o.threads_per_replica = cfg.parallel.intra_op_threads;
  o.pinned = cfg.parallel.pin_threads && cfg.parallel.intra_op_threads == 1;  // as the trainer pins
  o.data_images_per_s = a.data_images_per_s;
  o.epochs = a.epochs >= 0 ? a.epochs : cfg.train.epochs;
  o.cost_per_device_hour = a.cost_per_device_hour >= 0 ? a.cost_per_device_hour : cfg.run.cost_per_device_hour;
  o.dataset_images = train::make_dataset(cfg.data, "train")->size();
  return o;
}

}  // namespace

int run_plan(const PlanArgs& a) {
  train::RunConfig cfg = train::load_config(a.config, a.sets);
  const auto targets = train::parse_device_counts(a.devices);
  // CPU replicas when the configuration names them (only asked when no link was given, so a GPU
  // configuration plans from a saved profile on a machine without GPUs).
  const bool config_on_cpu = a.links.empty() && a.link_file.empty() &&
                             parse_devices(cfg.parallel.devices).at(0).kind == DeviceKind::cpu;
  const auto links = intra_links(a, config_on_cpu);
  parallel::Link inter;
  bool multi_node = false;
  for (const auto& [nodes, per] : targets) multi_node |= nodes > 1;
  if (multi_node) {
    if (a.inter_link.empty())
      throw ConfigError("--devices names several nodes: give --inter-link KIND (ib-hdr, ib-ndr, eth100, ...)");
    inter = parallel::find_link(a.inter_link);
  }
  train::PlanOptions o = plan_options(cfg, a);
  for (const auto& [nodes, per] : targets)
    if (o.global_batch % (nodes * per))
      throw ConfigError("--devices " + std::to_string(nodes * per) + " does not divide train.global_batch " +
                        std::to_string(o.global_batch) + ": give counts that divide it, or --set train.global_batch=N");
  // Memory per device (memplan, measured on this machine's device kind) and the largest
  // micro-batch that fits it: a device's share beyond that is accumulated.
  auto memplan_for = [&](int n, int64_t micro) -> train::MemPlan {
    train::RunConfig c = cfg;
    if (parse_devices(c.parallel.devices).at(0).kind == DeviceKind::cpu) c.parallel.devices = "cpu:" + std::to_string(n);
    return train::plan_memory(c, micro);
  };
  std::string memory_note;
  if (a.memory) {
    try {
      o.max_micro_batch = memplan_for(1, 0).max_micro_batch;
    } catch (const Error& e) {
      memory_note = std::string("memory not planned: ") + e.what();
    }
  }
  Profiles profiles(cfg, a);
  std::vector<train::PlanResult> results;
  std::vector<std::string> memory;
  train::StepProfile shown;
  for (const auto& link : links) {
    // A link fitted to CPU replicas' all-reduce (host threads or MPI processes) means replicas
    // sharing this kind of node's cores; table links are dedicated devices.
    if (link.name == "host" || link.name == "mpi") {
      o.cpu_cores_per_node = a.cores > 0 ? a.cores : host_core_count();
      o.process_per_replica = link.name == "mpi";
    } else {
      o.cpu_cores_per_node = 0;
    }
    for (const auto& [nodes, per] : targets) {
      train::PlanTarget t;
      t.nodes = nodes;
      t.per_node = per;
      t.intra = link;
      t.inter = inter;
      t.nics = a.nics;
      // First pass at the device's whole share, to learn the micro-batch; then the profile at it.
      train::PlanResult first = train::plan_step(profiles.at(o.global_batch / t.devices()), t, o);
      shown = profiles.at(first.micro_batch);
      results.push_back(train::plan_step(shown, t, o));
      memory.push_back(a.memory && memory_note.empty()
                           ? format_bytes(static_cast<size_t>(memplan_for(t.devices(), results.back().micro_batch).peak_bytes))
                           : "");
    }
  }
  if (!a.save_profile.empty()) write_file_atomic(a.save_profile, shown.json());
  std::printf("%s", a.json ? train::plan_json(shown, o, results, memory).c_str()
                           : train::plan_table(shown, o, results, memory).c_str());
  if (!a.json)
    for (const auto& l : links) std::printf("link %s: %s\n", l.name.c_str(), l.about.c_str());
  if (!a.json && !memory_note.empty()) std::printf("%s\n", memory_note.c_str());
  if (!a.json && multi_node) std::printf("link %s: %s\n", inter.name.c_str(), inter.about.c_str());
  return 0;
}

}  // namespace replica::apps
