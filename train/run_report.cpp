// Run report: the summary, the memory-pressure rule, and `replica report` (metrics.jsonl -> text
// and an SVG of loss, accuracy and learning rate).
#include "train/run_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "core/errors.h"
#include "core/file_io.h"
#include "core/json.h"

namespace replica::train {

double RunReport::other_s() const {
  return std::max(0.0, wall_s - data_wait_s - compute_s - allreduce_wait_s - optimizer_s - eval_s - checkpoint_s);
}

const char* RunReport::step_end_wait_name() const {
  // The host's wait at the end of each step (ReplicaStep::apply: the gradient buckets, then the
  // step's one read): all-reduce with several replicas, and on a GPU the queued device work too;
  // a single GPU replica has no all-reduce, so its wait is the device finishing the step.
  const bool gpu = devices.rfind("cuda", 0) == 0;
  if (replicas > 1) return gpu ? "all-reduce + device wait" : "all-reduce wait";
  return gpu ? "device wait" : "step-end wait";
}

std::string RunReport::text() const {
  std::ostringstream o;
  char b[256];
  auto pct = [&](double s) { return wall_s > 0 ? 100.0 * s / wall_s : 0.0; };
  std::snprintf(b, sizeof b, "run report: %ld steps, %ld images in %.1f s (%.0f img/s) on %d replica(s) (%s)\n",
                static_cast<long>(steps), static_cast<long>(images), wall_s, images_per_s, replicas, devices.c_str());
  o << b;
  const std::pair<const char*, double> phases[] = {{"data wait", data_wait_s},       {"compute", compute_s},
                                                   {step_end_wait_name(), allreduce_wait_s}, {"optimizer", optimizer_s},
                                                   {"evaluation", eval_s},          {"checkpointing", checkpoint_s},
                                                   {"other", other_s()}};
  o << "  wall time (replica 0):";
  for (const auto& [name, s] : phases) {
    std::snprintf(b, sizeof b, " %s %.1f s (%.0f%%)%s", name, s, pct(s), name == std::string("other") ? "" : ",");
    o << b;
  }
  o << "\n  memory:";
  for (size_t i = 0; i < peak_mib.size(); ++i) {
    const double cap = i < capacity_mib.size() ? capacity_mib[i] : 0;
    std::snprintf(b, sizeof b, " replica %zu peak %.0f of %.0f MiB (headroom %.0f%%)%s", i, peak_mib[i], cap,
                  cap > 0 ? 100.0 * (1 - peak_mib[i] / cap) : 0.0, i + 1 < peak_mib.size() ? "," : "");
    o << b;
  }
  if (pressure_steps) o << "; above 85% of capacity for " << pressure_steps << " steps";
  std::snprintf(b, sizeof b, "\n  training state (replica 0): parameters %.1f MiB, gradients %.1f MiB, optimizer state %.1f MiB",
                params_mib, grads_mib, optimizer_mib);
  o << b;
  // Sharded, what a step keeps is less than the peaks (a summary from before these fields has 0).
  if (shard != "none" && (params_kept_mib > 0 || grads_kept_mib > 0) &&
      (params_kept_mib < 0.99 * params_mib || grads_kept_mib < 0.99 * grads_mib)) {
    std::snprintf(b, sizeof b, " at peak; kept between steps: parameters %.1f MiB, gradients %.1f MiB", params_kept_mib,
                  grads_kept_mib);
    o << b;
  }
  if (shard != "none") o << " (parallel.shard " << shard << ": its 1/" << replicas << " of the optimizer state)";
  for (const auto& e : events) o << "\n  event: " << e;
  std::snprintf(b, sizeof b, "\n  %.4f device-hours", device_hours());
  o << b;
  if (cost_per_device_hour > 0) {
    std::snprintf(b, sizeof b, ", cost %.4f at %.4g per device-hour", device_hours() * cost_per_device_hour,
                  cost_per_device_hour);
    o << b;
  } else {
    o << " (set run.cost_per_device_hour to see the cost)";
  }
  o << "\n";
  return o.str();
}

std::string RunReport::json() const {
  std::string all_events;
  for (const auto& e : events) all_events += (all_events.empty() ? "" : "\n") + e;
  return json_line({{"kind", "summary"},
                    {"steps", steps},
                    {"images", images},
                    {"wall_s", json_number(wall_s)},
                    {"images_per_s", json_number(images_per_s)},
                    {"replicas", replicas},
                    {"devices", devices},
                    {"data_wait_s", json_number(data_wait_s)},
                    {"compute_s", json_number(compute_s)},
                    {"allreduce_wait_s", json_number(allreduce_wait_s)},
                    {"optimizer_s", json_number(optimizer_s)},
                    {"eval_s", json_number(eval_s)},
                    {"checkpoint_s", json_number(checkpoint_s)},
                    {"peak_mib", json_numbers(peak_mib)},
                    {"capacity_mib", json_numbers(capacity_mib)},
                    {"pressure_steps", pressure_steps},
                    {"device_hours", json_number(device_hours())},
                    {"cost_per_device_hour", json_number(cost_per_device_hour)},
                    {"shard", shard},
                    {"params_mib", json_number(params_mib)},
                    {"grads_mib", json_number(grads_mib)},
                    {"optimizer_mib", json_number(optimizer_mib)},
                    {"params_kept_mib", json_number(params_kept_mib)},
                    {"grads_kept_mib", json_number(grads_kept_mib)},
                    {"events", all_events}});
}

RunReport RunReport::from_json(const std::string& line) {
  const JsonObject o = parse_json_object(line, "metrics.jsonl summary");
  RunReport r;
  r.steps = static_cast<int64_t>(o.number("steps"));
  r.images = static_cast<int64_t>(o.number("images"));
  r.wall_s = o.number("wall_s");
  r.images_per_s = o.number("images_per_s");
  r.replicas = static_cast<int>(o.number("replicas"));
  r.devices = o.text("devices");
  r.data_wait_s = o.number("data_wait_s");
  r.compute_s = o.number("compute_s");
  r.allreduce_wait_s = o.number("allreduce_wait_s");
  r.optimizer_s = o.number("optimizer_s");
  r.eval_s = o.number("eval_s");
  r.checkpoint_s = o.number("checkpoint_s");
  r.peak_mib = o.numbers("peak_mib");
  r.capacity_mib = o.numbers("capacity_mib");
  r.pressure_steps = static_cast<int64_t>(o.number("pressure_steps"));
  r.cost_per_device_hour = o.number("cost_per_device_hour");
  if (o.texts_.count("shard")) {  // written since parallel.shard; older summaries lack them
    r.shard = o.text("shard");
    r.params_mib = o.number("params_mib");
    r.grads_mib = o.number("grads_mib");
    r.optimizer_mib = o.number("optimizer_mib");
  }
  if (o.numbers_.count("grads_kept_mib")) {  // since ZeRO-2's release and the sharded masters
    r.params_kept_mib = o.number("params_kept_mib");
    r.grads_kept_mib = o.number("grads_kept_mib");
  }
  if (o.texts_.count("events") && !o.text("events").empty()) {
    std::stringstream ss(o.text("events"));
    for (std::string e; std::getline(ss, e);) r.events.push_back(e);
  }
  return r;
}

std::string MemoryPressure::observe(const std::string& device, double in_use_mib, double capacity_mib,
                                    const std::string& capacity_key) {
  const bool above = capacity_mib > 0 && in_use_mib > 0.85 * capacity_mib;
  run_ = above ? run_ + 1 : 0;
  above_total_ += above;
  if (warned_ || run_ < threshold_) return "";
  warned_ = true;
  char b[512];
  std::snprintf(b, sizeof b,
                "%s's pool has been above 85%% of its capacity (%.0f of %.0f MiB) for %ld steps: an out-of-memory "
                "is near. Lower train.micro_batch (accumulation keeps the global batch), set model.checkpoint: "
                "blocks, or raise %s.",
                device.c_str(), in_use_mib, capacity_mib, static_cast<long>(run_), capacity_key.c_str());
  return b;
}

namespace {

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;  // (step, value)
};

// One panel: the series over a shared step axis, with the value range and the last step labelled.
void panel(std::ostringstream& svg, double y0, const char* title, const std::vector<Series>& series, double max_step) {
  const double W = 720, H = 170, left = 70, right = 20, top = 24, bottom = 26;
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& s : series)
    for (auto [x, v] : s.points)
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  if (hi - lo < 1e-12) hi = lo + 1;
  const double pw = W - left - right, ph = H - top - bottom;
  auto px = [&](double x) { return left + pw * (max_step > 0 ? x / max_step : 0); };
  auto py = [&](double v) { return y0 + top + ph * (1 - (v - lo) / (hi - lo)); };
  char b[256];
  std::snprintf(b, sizeof b, "<text x='%g' y='%g' font-size='13' font-weight='bold'>%s</text>\n", left, y0 + 16, title);
  svg << b;
  std::snprintf(b, sizeof b, "<rect x='%g' y='%g' width='%g' height='%g' fill='none' stroke='#999'/>\n", left, y0 + top, pw, ph);
  svg << b;
  std::snprintf(b, sizeof b,
                "<text x='%g' y='%g' font-size='11' text-anchor='end'>%.4g</text>"
                "<text x='%g' y='%g' font-size='11' text-anchor='end'>%.4g</text>\n",
                left - 6, y0 + top + 10, hi, left - 6, y0 + top + ph, lo);
  svg << b;
  std::snprintf(b, sizeof b, "<text x='%g' y='%g' font-size='11'>0</text><text x='%g' y='%g' font-size='11' text-anchor='end'>step %.0f</text>\n",
                left, y0 + H - 8, left + pw, y0 + H - 8, max_step);
  svg << b;
  double legend_x = left + 160;
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    svg << "<polyline fill='none' stroke='" << s.color << "' stroke-width='1.5' points='";
    for (auto [x, v] : s.points)
      if (std::isfinite(v)) {
        std::snprintf(b, sizeof b, "%.1f,%.1f ", px(x), py(v));
        svg << b;
      }
    svg << "'/>\n";
    std::snprintf(b, sizeof b, "<text x='%g' y='%g' font-size='11' fill='%s'>%s</text>\n", legend_x, y0 + 16,
                  s.color.c_str(), s.name.c_str());
    svg << b;
    legend_x += 110;
  }
}

}  // namespace

std::string report_run_directory(const std::string& run_dir) {
  const std::string path = run_dir + "/metrics.jsonl";
  std::ifstream in(path);
  if (!in) throw IoError(path + ": cannot read it; give the run directory of a `replica train` run");
  Series loss{"train loss", "#1f77b4", {}}, test_loss{"test loss", "#d62728", {}};
  double last_top5 = std::nan("");
  Series acc{"train accuracy", "#1f77b4", {}}, test_acc{"test accuracy", "#d62728", {}}, lr{"learning rate", "#2ca02c", {}};
  std::string summary, line;
  int64_t lineno = 0;
  double max_step = 0, img_s_sum = 0;
  int64_t img_s_n = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    JsonObject o;
    try {
      o = parse_json_object(line, path + ":" + std::to_string(lineno));
    } catch (const IoError&) {
      if (in.peek() == EOF) break;  // a last line cut by a crash: the rest still reports
      throw;
    }
    const std::string kind = o.text("kind");
    const double step = o.number("step");
    max_step = std::max(max_step, step);
    if (kind == "step") {
      loss.points.push_back({step, o.number("loss")});
      acc.points.push_back({step, o.number("accuracy")});
      lr.points.push_back({step, o.number("lr")});
      if (o.number("img_per_s") > 0) img_s_sum += o.number("img_per_s"), img_s_n++;
    } else if (kind == "eval") {
      test_loss.points.push_back({step, o.number("loss")});
      test_acc.points.push_back({step, o.number("accuracy")});
      last_top5 = o.number("top5");  // NaN in a run written before top-5 was recorded
    } else if (kind == "summary") {
      summary = line;
    }
  }
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='720' height='540' font-family='sans-serif'>\n"
      << "<rect width='100%' height='100%' fill='white'/>\n";
  panel(svg, 0, "loss", {loss, test_loss}, max_step);
  panel(svg, 180, "accuracy", {acc, test_acc}, max_step);
  panel(svg, 360, "learning rate", {lr}, max_step);
  svg << "</svg>\n";
  write_file_atomic(run_dir + "/report.svg", svg.str());

  std::ostringstream out;
  if (!summary.empty()) {
    out << RunReport::from_json(summary).text();
  } else {
    char b[400];
    std::snprintf(b, sizeof b, "run report: no summary record (the run did not finish, or an older replica wrote it); %zu logged steps up to step %.0f, %.0f img/s on average\n",
                  loss.points.size(), max_step, img_s_n ? img_s_sum / img_s_n : 0.0);
    out << b;
  }
  if (!test_acc.points.empty()) {
    char b[160];
    std::snprintf(b, sizeof b, "  last evaluation: step %.0f, test accuracy %.2f%%, test loss %.4f",
                  test_acc.points.back().first, 100 * test_acc.points.back().second, test_loss.points.back().second);
    out << b;
    if (!std::isnan(last_top5)) {
      std::snprintf(b, sizeof b, ", top-5 %.2f%%", 100 * last_top5);
      out << b;
    }
    out << "\n";
  }
  out << "  plot: " << run_dir << "/report.svg (loss, accuracy and learning rate against steps)\n";
  return out.str();
}

}  // namespace replica::train
