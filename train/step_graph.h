// StepGraph: train.cuda_graph on a GPU replica. A training step's device work (zeroing, each
// micro-batch's forward, loss and backward, the step's scalars and verdict, the update) is several
// hundred kernel launches whose host cost bounds small batches and small models; here the first
// steps run eagerly (cuDNN settles its algorithms, the backend its scratch, and the step's memory
// peak is measured), the whole step is then captured once as a CUDA graph, and replayed: one
// launch a step, and the step's one host read after it.
//
// A graph replays the addresses and arguments it was captured with, so everything it touches stays
// put and everything that changes from step to step is read from device memory:
//  - the learning rate, what the step count decides (Optimizer::stage), the loss weight and the
//    loss scale's inverse, the sample count and the stop vote are written to device memory before
//    each replay (ops::StepScalar; the verdict and the clip factor are computed there already);
//  - the step allocates from a private pool carved out of the replica's pool (tag other), which
//    nothing else ever gets bytes of; every allocation of the captured step is freed within it;
//  - each micro-batch is copied into fixed input slots as micro_step() sees it;
//  - the graph is captured again when the backend's scratch moved (Backend::capture_epoch).
// A step whose micro-batches do not fit the slots (another shape) runs eagerly.
// verify (train.cuda_graph: auto): the first replay is compared with an eager step from the same
// state (parameters, the 16-bit copy, optimizer state, gradients, batch-norm statistics and the
// step's scalars): bit for bit in deterministic mode, else each element within 1e-3 of its
// buffer's largest magnitude (a 16-bit one also within one step of its own value). The check keeps
// the state on the host and runs its eager step in the graph's pool, so it needs no device memory
// beyond the graph's; an eager step that fails there turns graphs off and runs in the replica's pool. A difference, like any failure to capture, turns graphs off for the rest of the run,
// saying why, and steps go on eagerly.
// With peers (several replicas) the collectives are captured with the step: NCCL's calls are nodes
// of the graph, and a CPU replica's collectives are recorded with its calls
// (parallel/recordable_communicator.h). Every replica must issue the same collectives in the same
// order, and NCCL needs every rank to issue a collective captured or eagerly alike, so every step's
// way is agreed (one host all-gather a step): a replica whose micro-batch does not fit the slots
// keeps copies of its micro-batches and every replica runs that step eagerly; a replica whose
// scratch moved makes every replica capture again; a capture succeeds on every replica or graphs
// turn off on all of them, and auto's check turns them off everywhere when any replica's first
// replay differs (every replica then keeps its eager step). A check whose eager step fails
// rethrows (peers wait on its collectives), after putting the state back.
// A graph holds the collectives it captured (NCCL's persistent plans): it is registered with the
// group (Communicator::capture_holds), and the group's abort or destruction releases it first,
// from whichever thread found the failure (ncclCommAbort waits for such graphs from NCCL 2.26 on);
// a released graph is never launched again, and the next step fails as the collectives do.
// On a CPU replica (the C++ API; the trainer keeps CPU runs eager) the step is recorded as the
// backend calls it makes and replayed the same way (core/captured_work.h): no faster, since the
// host does the work either way, but the same contract, so the CPU suite runs all of the above.
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/captured_work.h"
#include "core/memory_pool.h"
#include "ops/nn/model.h"
#include "optim/optimizer.h"
#include "parallel/replica_group.h"

namespace replica::train {

class StepGraph {
 public:
  // The step's device work over the micro-batches in `inputs` (images, labels), allocating from
  // `pool`: what one replay runs.
  using Inputs = std::vector<std::pair<Tensor, Tensor>>;
  using Body = std::function<void(MemoryPool& pool, const Inputs& inputs)>;
  // stats: the step's device scalars; state the graph's step changes beside the model's and the
  // optimizer's is compared through them by verify.
  StepGraph(parallel::Replica& replica, nn::Model& model, optim::Optimizer& opt, Tensor stats, int micro_steps,
            bool verify, bool deterministic);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // At the step's start: true when its device work waits for run() (the warm-up is over, the
  // caller is `ready` and graphs are on); false: it runs eagerly, and a warm-up step's memory peak
  // is measured until end_eager(). Not ready: the step still does host work a capture cannot hold
  // (the gradient buckets' first re-cut), and counts as one more warm-up step.
  bool begin_step(bool ready = true);
  void end_eager();
  // Micro-batch k of a deferred step, copied into its fixed slot; false when it does not fit
  // (alone in the job: the caller runs the step eagerly from here, the micro-batches before it
  // from slots()). With peers it is always true: a micro-batch that does not fit is kept, with
  // the step's others, and run() agrees on an eager step with the peers.
  bool stage(int k, const Tensor& images, const Tensor& labels);
  const Inputs& slots() const { return slots_; }
  // The deferred step: captured the first time (and when the scratch moved), replayed; run
  // eagerly over the slots when capturing fails. Returns true when `body` ran on the host this step
  // (an eager run or a capture's check), false when only the graph was launched.
  bool run(const Body& body);

  bool off() const { return !off_.empty(); }
  // The group's abort (or end) released the captured work: no graph is launched again.
  bool released() const;
  const std::string& off_reason() const { return off_; }
  int64_t replays() const { return replays_; }
  // One line for the run's end: replays, captures, the graph's size and the private pool.
  std::string summary() const;

  static constexpr int kWarmupSteps = 2;

 private:
  void capture(const Body& body);
  bool check(const Body& body);
  // Queues one replay; a released graph is a CommError instead.
  void launch_graph();
  // The step's way on every replica: the largest of the replicas' own (replay 0, capture 1,
  // eager 2), through one host all-gather; alone, `mine`.
  int agree_plan(int mine);
  const Inputs& eager_inputs() const { return held_.empty() ? slots_ : held_; }
  void turn_off(const std::string& why);
  // With peers, one replica's failure is every replica's: `mine`, or where it is empty and another
  // replica failed, a reason naming that replica and `what` (a host all-gather: every replica
  // calls it at the same point of the same step).
  std::string agree(const std::string& mine, const char* what);
  std::vector<Tensor> state();  // what a step changes, for check()

  parallel::Replica& rep_;
  nn::Model& model_;
  optim::Optimizer& opt_;
  Tensor stats_;
  int micro_steps_;
  bool verify_, deterministic_, checked_ = false, said_eager_ = false;
  int eager_ = 0;
  bool measuring_ = false;
  size_t peak_ = 0;  // the eager steps' pool use above their start, at most
  void* block_ = nullptr;
  size_t block_bytes_ = 0;
  std::unique_ptr<MemoryPool> pool_;
  Inputs slots_;
  Inputs held_;  // with peers: copies of a step's micro-batches when one did not fit the slots
  // graph_ is launched by this replica's thread and released by whichever thread aborts the group:
  // both under graph_m_ (a CUDA graph's launch only queues it; a CPU replay runs outside the lock,
  // and its release only marks it, since a recording holds nothing of the group's).
  mutable std::mutex graph_m_;
  bool released_ = false;
  std::vector<std::pair<parallel::CaptureHolds*, int>> holds_;
  std::unique_ptr<CapturedWork> graph_;
  uint64_t epoch_ = 0;
  std::string off_;
  int64_t captures_ = 0, replays_ = 0;
  size_t nodes_ = 0;
};

}  // namespace replica::train
