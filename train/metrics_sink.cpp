// The step and evaluation records, and the printer, JSONL and TensorBoard sinks.
#include "train/metrics_sink.h"

#include <cstdio>
#include <fstream>

#include "core/json.h"

namespace replica::train {

std::string StepRecord::line() const {
  char b[320];
  int n = std::snprintf(b, sizeof b, "epoch %ld/%ld step %ld/%ld loss %.4f acc %5.1f%% lr %.4g %.0f img/s pool %.0f/%.0f MiB",
                        (long)epoch, (long)epochs, (long)step, (long)total_steps, loss, 100 * accuracy, lr, img_per_s,
                        pool_in_use_replica0_mib, pool_peak_replica0_mib);
  if (has_scaler) std::snprintf(b + n, sizeof b - n, " scale %g skipped %ld", scale, (long)skipped);
  return b;
}

std::string StepRecord::json() const {
  return json_line({{"kind", "step"},
                    {"step", step},
                    {"epoch", epoch},
                    {"loss", json_number(loss)},
                    {"accuracy", json_number(accuracy)},
                    {"lr", json_number(lr)},
                    {"scale", json_number(scale)},
                    {"skipped", skipped},
                    {"applied", applied},
                    {"grad_norm", json_number(grad_norm)},
                    {"img_per_s", json_number(img_per_s)},
                    {"data_wait_s", json_number(data_wait_s)},
                    {"pool_in_use_mib", json_numbers(pool_in_use_mib)},
                    {"pool_peak_mib", json_numbers(pool_peak_mib)}});
}

std::string EvalRecord::line() const {
  char b[200];
  std::snprintf(b, sizeof b, "epoch %ld: test loss %.4f accuracy %.2f%% top-5 %.2f%% (%ld images), epoch took %.1f s",
                (long)epoch, loss, 100 * accuracy, 100 * top5, (long)count, epoch_seconds);
  std::string s = b;
  if (ema_count) {
    std::snprintf(b, sizeof b, "; moving average: loss %.4f accuracy %.2f%% top-5 %.2f%%", ema_loss, 100 * ema_accuracy,
                  100 * ema_top5);
    s += b;
  }
  return s;
}

std::string EvalRecord::json() const {
  Json j = {{"kind", "eval"},
            {"step", step},
            {"epoch", epoch},
            {"loss", json_number(loss)},
            {"accuracy", json_number(accuracy)},
            {"top5", json_number(top5)},
            {"count", count},
            {"epoch_seconds", json_number(epoch_seconds)}};
  if (ema_count) {
    j["ema_loss"] = json_number(ema_loss);
    j["ema_accuracy"] = json_number(ema_accuracy);
    j["ema_top5"] = json_number(ema_top5);
  }
  return json_line(j);
}

void ProgressPrinter::step(const StepRecord& r, bool logged) {
  if (tty_) std::printf("\r%s\033[K%s", r.line().c_str(), logged ? "\n" : "");
  else if (logged) std::printf("%s\n", r.line().c_str());
  std::fflush(stdout);
}

void ProgressPrinter::eval(const EvalRecord& r) {
  std::printf("%s\n", r.line().c_str());
  std::fflush(stdout);
}

void ProgressPrinter::summary(const RunReport& r) {
  std::printf("%s", r.text().c_str());
  std::fflush(stdout);
}

void JsonlSink::append(const std::string& line) const {
  std::ofstream out(path_, std::ios::app);
  out << line << '\n';
}

void JsonlSink::step(const StepRecord& r, bool logged) {
  if (logged) append(r.json());
}

void JsonlSink::eval(const EvalRecord& r) { append(r.json()); }

void TensorBoardSink::step(const StepRecord& r, bool logged) {
  if (!logged) return;
  w_.scalar("train/loss", static_cast<float>(r.loss), r.step);
  w_.scalar("train/accuracy", static_cast<float>(r.accuracy), r.step);
  w_.scalar("train/lr", static_cast<float>(r.lr), r.step);
  w_.scalar("train/loss_scale", static_cast<float>(r.scale), r.step);
  w_.scalar("train/images_per_second", static_cast<float>(r.img_per_s), r.step);
  w_.flush();
}

void TensorBoardSink::eval(const EvalRecord& r) {
  w_.scalar("test/loss", static_cast<float>(r.loss), r.step);
  w_.scalar("test/accuracy", static_cast<float>(r.accuracy), r.step);
  w_.scalar("test/top5", static_cast<float>(r.top5), r.step);
  if (r.ema_count) {
    w_.scalar("test_ema/loss", static_cast<float>(r.ema_loss), r.step);
    w_.scalar("test_ema/accuracy", static_cast<float>(r.ema_accuracy), r.step);
    w_.scalar("test_ema/top5", static_cast<float>(r.ema_top5), r.step);
  }
  w_.flush();
}

void StepWindow::add(const StepStatus& s) {
  images_ += s.samples;
  loss_ += s.loss;
  acc_ += s.accuracy;
  steps_++;
}

StepRecord StepWindow::record(const StepStatus& last) const {
  StepRecord r;
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  r.img_per_s = images_ / std::max(dt, 1e-9);
  r.loss = loss_ / std::max(steps_, 1);
  r.accuracy = acc_ / std::max(steps_, 1);
  r.lr = last.lr;
  r.scale = last.scale;
  r.grad_norm = last.grad_norm;
  r.applied = last.applied;
  return r;
}

void StepWindow::reset() {
  start_ = std::chrono::steady_clock::now();
  images_ = 0;
  loss_ = acc_ = 0;
  steps_ = 0;
}

}  // namespace replica::train
