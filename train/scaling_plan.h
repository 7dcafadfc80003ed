// `replica plan`: a model of one training step on N devices, from a step profile (what one
// replica's forward, backward and optimizer take, and when each gradient is final) and a link
// model (parallel/link_model.h). A discrete-event walk over one step's gradient buckets:
//   - the buckets are cut as GradientSync's rebuild cuts them: slots in the order they became
//     ready, first_bucket_mb then bucket_mb;
//   - a bucket is ready when its last slot is; the all-reduces run one at a time in bucket order
//     on one communication lane, each starting when its bucket is ready and the previous one is done;
//   - the step is accumulation x (forward + backward), plus what of the all-reduces outlasts the
//     last backward (exposed communication), plus the optimizer; with accumulation only the last
//     micro-step's backward overlaps the all-reduce (no_sync before it);
//   - CPU replicas that share a node's cores: when replicas x threads exceed the cores, compute
//     stretches by that ratio (time-sharing; MPI processes pinned round-robin: by the most crowded
//     core's count),
//     and the host communicator's work, done by the same cores, is not hidden behind backward;
//   - a profile read from a run's trace adds that run's per-step host work (data wait, checks);
//   - the all-reduce waits for the slowest replica: the profile's spread of step times gives the
//     expected slowest of N (independent, normal);
//   - the input pipeline caps images/s at the given rate per node.
// Everything it assumes is listed in docs/planning.md.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/link_model.h"
#include "train/step_profile.h"

namespace replica::train {

struct PlanTarget {
  int nodes = 1, per_node = 1;
  parallel::Link intra, inter;  // inter is used only when nodes > 1
  int nics = 1;                 // network ports per node (DGX-class nodes: one per GPU)
  int devices() const { return nodes * per_node; }
  std::string label() const;    // "4x8 nvlink4 + ib-ndr x8"
};

struct PlanOptions {
  int64_t global_batch = 0;
  int64_t max_micro_batch = 0;  // the largest that fits (memplan); 0: no limit
  double wire_bytes = 4;        // bytes per gradient element on the wire (parallel.grad_dtype)
  double bucket_mb = 25, first_bucket_mb = 1;
  bool choose_bucket = false;   // also walk 1..200 MB buckets and keep the fastest (replica plan does)
  int cpu_cores_per_node = 0;   // CPU replicas: the node's cores they share (0: dedicated devices)
  int threads_per_replica = 1;
  bool pinned = true;               // parallel.pin_threads (with one intra-op thread)
  bool process_per_replica = false;  // MPI: one process per replica (the link was fitted under mpirun)
  double data_images_per_s = 0;  // per node, from `replica bench data`; 0: not a limit
  int64_t dataset_images = 0;
  double epochs = 0;
  double cost_per_device_hour = 0;
};

struct BucketTime {
  double bytes = 0, ready_s = 0, start_s = 0, end_s = 0;  // times from the last backward's start
  std::string algorithm;
};

struct PlanResult {
  PlanTarget target;
  int64_t micro_batch = 0;
  int accumulation = 1;
  double bucket_mb = 25;  // the bucket size the step was walked with (the chosen one)
  double forward_s = 0, backward_s = 0, optimizer_s = 0;  // one micro-step's, on this target
  double comm_s = 0;     // the all-reduces' total
  double exposed_s = 0;  // what of it backward does not hide
  double straggler_s = 0;  // waiting for the slowest replica (the profile's spread)
  double host_s = 0;       // the profile's per-step host work (from a run's trace)
  double step_s = 0, images_per_s = 0;
  double efficiency = 1;  // images/s per device against one device at the same micro-batch
  bool data_bound = false;
  double hours = 0, cost = 0;  // to opts.epochs over opts.dataset_images
  std::vector<BucketTime> buckets;
  std::string algorithm;  // of the largest bucket
};

// E[max of n standard normals] (numerical integral): 0 for 1, 0.5642 for 2, 1.0294 for 4, 1.4236 for 8.
double expected_max_of_normals(int n);
// With opts.choose_bucket, the bucket size whose step is fastest (PlanResult::bucket_mb).
// Errors (ConfigError): a global batch the device count does not divide.
PlanResult plan_step(const StepProfile& profile, const PlanTarget& target, const PlanOptions& opts);

// The command's output: a header naming the profile, then one line per alternative.
std::string plan_table(const StepProfile& profile, const PlanOptions& opts, const std::vector<PlanResult>& results,
                       const std::vector<std::string>& memory);
std::string plan_json(const StepProfile& profile, const PlanOptions& opts, const std::vector<PlanResult>& results,
                      const std::vector<std::string>& memory);

// "8", "4x8", and lists of them "1,2,4,8" / "2x8,4x8": nodes x devices per node.
std::vector<std::pair<int, int>> parse_device_counts(const std::string& spec);
// FILE: `replica bench allreduce` output (fitted), or YAML {name, alpha_us, bandwidth_gbs}.
parallel::Link read_link_file(const std::string& path);

}  // namespace replica::train
