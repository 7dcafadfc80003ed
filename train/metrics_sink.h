// Metrics: what one logged step or one evaluation says, built once, and the sinks that show or
// store it: the progress printer (a live bar on a terminal, a line every train.log_every steps
// otherwise), metrics.jsonl (one JSON object per record, written with a real JSON writer) and
// TensorBoard event files. Rank 0 of the job feeds them; the trainer's loop only calls step()
// and eval().
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/replica_step.h"
#include "train/run_report.h"
#include "train/tensorboard.h"

namespace replica::train {

// The window of steps since the last logged one: averages of loss and accuracy, images/s.
struct StepRecord {
  int64_t step = 0, total_steps = 0, epoch = 0, epochs = 0;  // epoch is 1-based
  double loss = 0, accuracy = 0, lr = 0, scale = 1, grad_norm = 0, img_per_s = 0, data_wait_s = 0;
  bool applied = true, has_scaler = false;
  int64_t skipped = 0;                             // steps skipped for overflow so far
  std::vector<double> pool_in_use_mib, pool_peak_mib;  // this process's replicas
  double pool_in_use_replica0_mib = 0, pool_peak_replica0_mib = 0;
  std::string line() const;  // the human step line
  std::string json() const;  // the metrics.jsonl object
};

struct EvalRecord {
  int64_t step = 0, epoch = 0, count = 0;  // epoch is 1-based
  double loss = 0, accuracy = 0, top5 = 0, epoch_seconds = 0;
  int64_t ema_count = 0;  // the weights' moving average evaluated too (0: none)
  double ema_loss = 0, ema_accuracy = 0, ema_top5 = 0;
  std::string line() const;
  std::string json() const;
};

class MetricsSink {
 public:
  virtual ~MetricsSink() = default;
  // Every step; `logged` marks the steps that close a window (every log_every, and the last).
  virtual void step(const StepRecord& r, bool logged) = 0;
  virtual void eval(const EvalRecord& r) = 0;
  // Once, at the end of a run.
  virtual void summary(const RunReport& r) { (void)r; }
  // Something that happened to the run (a replica lost: train/recovery.h), as a JSON object.
  virtual void event(const std::string& json) { (void)json; }
};

// Fans out to several sinks.
class MetricsSinks : public MetricsSink {
 public:
  void add(std::unique_ptr<MetricsSink> s) { sinks_.push_back(std::move(s)); }
  void step(const StepRecord& r, bool logged) override {
    for (auto& s : sinks_) s->step(r, logged);
  }
  void eval(const EvalRecord& r) override {
    for (auto& s : sinks_) s->eval(r);
  }
  void summary(const RunReport& r) override {
    for (auto& s : sinks_) s->summary(r);
  }
  void event(const std::string& json) override {
    for (auto& s : sinks_) s->event(json);
  }

 private:
  std::vector<std::unique_ptr<MetricsSink>> sinks_;
};

// stdout: on a terminal a bar redrawn every step, otherwise a line per logged step.
class ProgressPrinter : public MetricsSink {
 public:
  explicit ProgressPrinter(bool tty) : tty_(tty) {}
  void step(const StepRecord& r, bool logged) override;
  void eval(const EvalRecord& r) override;
  void summary(const RunReport& r) override;

 private:
  bool tty_;
};

// RUN_DIR/metrics.jsonl, appended one line per logged step and per evaluation.
class JsonlSink : public MetricsSink {
 public:
  explicit JsonlSink(std::string path) : path_(std::move(path)) {}
  void step(const StepRecord& r, bool logged) override;
  void eval(const EvalRecord& r) override;
  void summary(const RunReport& r) override { append(r.json()); }
  void event(const std::string& json) override { append(json); }

 private:
  void append(const std::string& line) const;
  std::string path_;
};

class TensorBoardSink : public MetricsSink {
 public:
  explicit TensorBoardSink(const std::string& run_dir) : w_(run_dir) {}
  void step(const StepRecord& r, bool logged) override;
  void eval(const EvalRecord& r) override;

 private:
  TensorBoardWriter w_;
};

// Sums the steps of a window and turns them into a StepRecord when it closes.
class StepWindow {
 public:
  void add(const StepStatus& s);
  bool empty() const { return steps_ == 0; }
  // Averages since the last reset, images/s over the wall time since then.
  StepRecord record(const StepStatus& last) const;
  void reset();

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  int64_t images_ = 0;
  double loss_ = 0, acc_ = 0;
  int steps_ = 0;
};

}  // namespace replica::train
