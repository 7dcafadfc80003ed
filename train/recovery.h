// Losing a replica without losing the run (parallel.on_replica_failure, parallel.preempt_file):
// the test hook that injects a failure (REPLICA_FAULT), what each replica remembers of its last
// completed step so the survivors can continue from it, and the exit status that tells a
// wrapper (Slurm, an MPIJob, tests/elastic) to restart on the machines that are left. The group's
// rebuild itself is Trainer::shrink_to_survivors (train/recovery.cpp).
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/tensor.h"
#include "parallel/communicator.h"

namespace replica::train {

// The process exit status of a run that lost a peer process or timed out in a collective:
// nothing it wrote is inconsistent and `replica train --resume RUN_DIR` on the machines that are
// left continues it (sysexits' EX_TEMPFAIL). 0 is success or a preemption stop, 2 a configuration
// to fix, 1 any other error (not worth a restart: a diverged loss, an out-of-memory).
constexpr int kExitRestartable = parallel::kExitRestartable;

// Thrown by an injected fault (REPLICA_FAULT), so tests can tell it from a real failure.
class InjectedFault : public Error {
 public:
  using Error::Error;
};

// REPLICA_FAULT=replica:R:step:N[:WHERE]: replica R (global rank) throws InjectedFault at
// optimizer step N (1-based) at WHERE: start (default; before its first micro-batch), bucket (in
// the last micro-step's backward, after a gradient bucket was sent), optimizer (after the
// step's collectives, before the update), eval (at the evaluation after that step's epoch) or
// checkpoint (while writing the checkpoint after that step). It fires once per process, so a run
// that shrank and re-runs step N goes on. A malformed value is a ConfigError naming the variable.
class FaultInjector {
 public:
  static std::optional<FaultInjector> from_env();
  static FaultInjector parse(const std::string& spec);  // the variable's value
  // Throws InjectedFault when (where, rank, step) is the planned fault and it has not fired yet.
  void at(const char* where, int rank, int64_t step);
  std::string describe() const;
  // When it fired (steady clock), or nullopt: the measured time from a fault to training again.
  std::optional<std::chrono::steady_clock::time_point> fired_at() const;

  int rank = -1;
  int64_t step = 0;
  std::string where = "start";

 private:
  std::shared_ptr<std::atomic<bool>> fired_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<int64_t>> fired_ns_ = std::make_shared<std::atomic<int64_t>>(0);
};

// What one replica keeps of its last completed optimizer step (parallel.on_replica_failure:
// shrink): the step count and its batch-norm statistics (they change in every forward, before a
// failure can stop the step). Parameters, optimizer state and the scaler change only in the
// update, after every collective of the step, so every survivor holds them for that step.
struct StepMemory {
  int64_t step = -1;  // the last completed optimizer step (global count), -1: none yet
  Tensor buffers;     // batch-norm running statistics after it (a device copy: no host wait)
};

}  // namespace replica::train
