// The run report: where a run's wall time went (data wait, compute, the step-end wait, optimizer,
// evaluation, checkpointing), its throughput, each replica's peak memory against its pool, the
// device-hours and, with run.cost_per_device_hour, what it cost. Printed at the end of a run,
// appended to metrics.jsonl ({"kind":"summary"}), and rebuilt from the files by `replica report`,
// which also draws loss, accuracy and learning rate against steps as an SVG.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace replica::train {

struct RunReport {
  double wall_s = 0, data_wait_s = 0, compute_s = 0, allreduce_wait_s = 0, optimizer_s = 0, eval_s = 0,
         checkpoint_s = 0;
  int64_t steps = 0, images = 0;
  double images_per_s = 0;
  int replicas = 0;                        // in the whole job
  std::string devices;                     // parallel.devices as resolved ("cpu:2", "cuda:0,1")
  std::vector<double> peak_mib, capacity_mib;  // this process's replicas
  double cost_per_device_hour = 0;         // run.cost_per_device_hour; 0: not set
  int64_t pressure_steps = 0;              // steps some replica's pool was above 85% of capacity
  // Replica 0's training state: the pool's peaks of its params, grads and optimizer tags, and the
  // parallel.shard mode that sized the optimizer's share.
  std::string shard = "none";
  double params_mib = 0, grads_mib = 0, optimizer_mib = 0;
  // What is held between steps (in use at the end): the gradients' whole buffer, or under
  // parallel.shard gradients (ZeRO-2) the shard alone; the parameters, with sharded fp32 masters
  // the shard's masters and the 16-bit copy (the *_mib peaks include start-up's whole master and,
  // for gradients, the buckets in flight within a step).
  double params_kept_mib = 0, grads_kept_mib = 0;
  std::vector<std::string> events;  // replicas lost and how the run went on (train/recovery.h)

  // What allreduce_wait_s measured, named for this run: "all-reduce wait" (CPU replicas),
  // "all-reduce + device wait" (GPUs), "device wait" (one GPU: no all-reduce, the host waits for
  // the step's queued kernels), "step-end wait" (one CPU replica).
  const char* step_end_wait_name() const;
  double device_hours() const { return wall_s * replicas / 3600.0; }
  double other_s() const;  // wall time none of the phases explains (start-up, logging, ...)
  std::string text() const;
  std::string json() const;
  static RunReport from_json(const std::string& line);
};

// The memory-pressure rule: a replica's pool above 85% of its capacity for `threshold` steps in a
// row earns one warning, naming what to change.
class MemoryPressure {
 public:
  explicit MemoryPressure(int64_t threshold) : threshold_(threshold) {}
  // Returns the warning the first time the rule fires, else "".
  // `capacity_key` is the setting that sized the pool (memory.fraction or memory.bytes).
  std::string observe(const std::string& device, double in_use_mib, double capacity_mib,
                      const std::string& capacity_key = "memory.fraction");
  int64_t steps_above() const { return above_total_; }

 private:
  int64_t threshold_, run_ = 0, above_total_ = 0;
  bool warned_ = false;
};

// `replica report RUN_DIR`: the summary of RUN_DIR/metrics.jsonl (the run's own, or what the
// records say when the run did not finish) and RUN_DIR/report.svg. Returns the text printed.
std::string report_run_directory(const std::string& run_dir);

}  // namespace replica::train
