// The step walk of `replica plan`, its table and JSON, and the parsing of its arguments.
#include "train/scaling_plan.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "core/errors.h"
#include "core/file_io.h"
#include "core/json.h"

namespace replica::train {

std::string PlanTarget::label() const {
  std::string s = nodes > 1 ? std::to_string(nodes) + "x" + std::to_string(per_node) : std::to_string(per_node);
  s += " " + intra.name;
  if (nodes > 1) s += " + " + inter.name + (nics > 1 ? " x" + std::to_string(nics) : "");
  return s;
}

namespace {

// Buckets as GradientSync's rebuild cuts them: slots in readiness order, a first bucket of
// first_bucket_mb, then bucket_mb; a bucket is ready when its last slot is.
std::vector<BucketTime> cut_buckets(const StepProfile& p, const PlanOptions& o) {
  std::vector<size_t> order(p.slot_elements.size());
  std::iota(order.begin(), order.end(), 0);
  // Ties (slots reported together) in reverse registration order, as backward reports them.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return p.slot_ready_s[a] != p.slot_ready_s[b] ? p.slot_ready_s[a] < p.slot_ready_s[b] : a > b;
  });
  std::vector<BucketTime> out;
  double cap = o.first_bucket_mb * 1048576.0;
  for (size_t s : order) {
    if (out.empty() || out.back().bytes >= cap) {
      if (!out.empty()) cap = o.bucket_mb * 1048576.0;
      out.emplace_back();
    }
    out.back().bytes += static_cast<double>(p.slot_elements[s]) * o.wire_bytes;
    out.back().ready_s = std::max(out.back().ready_s, p.slot_ready_s[s]);
  }
  return out;
}

}  // namespace

double expected_max_of_normals(int n) {
  if (n <= 1) return 0;
  // E[max] = integral of x n phi(x) Phi(x)^(n-1) dx, by the midpoint rule over [-12, 12].
  const double step = 1e-3, k = 1.0 / std::sqrt(2.0 * M_PI);
  double sum = 0;
  for (double x = -12 + step / 2; x < 12; x += step) {
    const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    sum += x * n * k * std::exp(-0.5 * x * x) * std::pow(cdf, n - 1);
  }
  return sum * step;
}

namespace {
PlanResult walk(const StepProfile& profile, const PlanTarget& t, const PlanOptions& o);
}  // namespace

PlanResult plan_step(const StepProfile& profile, const PlanTarget& t, const PlanOptions& o) {
  PlanResult best = walk(profile, t, o);
  if (!o.choose_bucket || t.devices() == 1) return best;
  // The bucket size it would choose: each candidate walked, the fastest step kept (the
  // configuration's parallel.bucket_mb on a tie). Small buckets start sooner behind backward,
  // large ones pay the per-collective latency fewer times.
  for (double mb : {1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0}) {
    PlanOptions c = o;
    c.bucket_mb = mb;
    PlanResult r = walk(profile, t, c);
    if (r.step_s < best.step_s * (1 - 1e-9)) best = std::move(r);
  }
  return best;
}

namespace {
PlanResult walk(const StepProfile& profile, const PlanTarget& t, const PlanOptions& o) {
  const int n = t.devices();
  if (n < 1) throw ConfigError("plan: a device count must be at least 1");
  if (o.global_batch % n != 0)
    throw ConfigError("plan: " + std::to_string(n) + " devices do not divide train.global_batch " +
                      std::to_string(o.global_batch) + "; give device counts that divide it, or --set train.global_batch=" +
                      std::to_string((o.global_batch / n + 1) * n));
  PlanResult r;
  r.target = t;
  r.bucket_mb = o.bucket_mb;
  const int64_t per_device = o.global_batch / n;
  // The largest micro-batch that fits and divides the device's share: accumulate the rest.
  r.micro_batch = per_device;
  if (o.max_micro_batch > 0)
    while (r.micro_batch > o.max_micro_batch || per_device % r.micro_batch) --r.micro_batch;
  if (r.micro_batch < 1) r.micro_batch = 1;
  r.accumulation = static_cast<int>(per_device / r.micro_batch);
  StepProfile p = profile.at_micro_batch(r.micro_batch);
  // CPU replicas on shared cores: time-sharing stretches compute when they outnumber the cores.
  double stretch = 1;
  const bool shared_cores = o.cpu_cores_per_node > 0;
  if (shared_cores) {
    const double demand = static_cast<double>(t.per_node) * o.threads_per_replica / o.cpu_cores_per_node;
    // More replicas than cores: one process's replica threads are then left unpinned and the
    // scheduler spreads them (demand); MPI processes stay pinned by node slot, round-robin, and
    // the step waits for the most crowded core (ceil).
    stretch = std::max(1.0, o.pinned && o.process_per_replica ? std::ceil(demand) : demand);
  }
  r.forward_s = p.forward_s * stretch;
  r.backward_s = p.backward_s * stretch;
  r.optimizer_s = p.optimizer_s * stretch;
  // The walk over the last backward's buckets: one lane, in bucket order.
  double lane = 0;
  double largest = 0;
  for (BucketTime b : cut_buckets(p, o)) {
    b.ready_s *= stretch;
    const parallel::Collective c = parallel::all_reduce(b.bytes, t.nodes, t.per_node, t.intra, t.inter, t.nics);
    b.algorithm = c.algorithm;
    if (n > 1) {
      b.start_s = std::max(b.ready_s, lane);
      b.end_s = b.start_s + c.seconds;
      lane = b.end_s;
      r.comm_s += c.seconds;
    } else {
      b.start_s = b.end_s = b.ready_s;
    }
    if (b.bytes > largest) largest = b.bytes, r.algorithm = c.algorithm;
    r.buckets.push_back(b);
  }
  // On shared CPU cores the communicator's copies and sums take the cores backward runs on:
  // nothing is hidden. Elsewhere (NCCL's own SMs and copy engines, a NIC) only the tail is exposed.
  r.exposed_s = n == 1 ? 0 : shared_cores && stretch >= 1 && t.per_node * o.threads_per_replica >= o.cpu_cores_per_node
                                 ? r.comm_s
                                 : std::max(0.0, lane - r.backward_s);
  // The all-reduce waits for the slowest replica: with independent, normal step times of spread
  // sd, the expected slowest of n is mean + sd x E[max of n standard normals].
  r.straggler_s = n > 1 ? p.compute_sd_s * stretch * expected_max_of_normals(n) : 0.0;
  r.host_s = p.host_s * stretch;  // host work on shared cores time-shares like the compute
  r.step_s = r.accumulation * (r.forward_s + r.backward_s) + r.straggler_s + r.exposed_s + r.optimizer_s + r.host_s;
  r.images_per_s = static_cast<double>(o.global_batch) / r.step_s;
  if (o.data_images_per_s > 0 && r.images_per_s > o.data_images_per_s * t.nodes) {
    r.images_per_s = o.data_images_per_s * t.nodes;
    r.step_s = static_cast<double>(o.global_batch) / r.images_per_s;
    r.data_bound = true;
  }
  const double one_device =
      static_cast<double>(r.micro_batch) / (p.forward_s + p.backward_s + (p.optimizer_s + p.host_s) / r.accumulation);
  r.efficiency = r.images_per_s / n / one_device;
  if (o.epochs > 0 && o.dataset_images > 0) {
    r.hours = o.epochs * static_cast<double>(o.dataset_images) / r.images_per_s / 3600.0;
    r.cost = r.hours * n * o.cost_per_device_hour;
  }
  return r;
}
}  // namespace

std::string plan_table(const StepProfile& p, const PlanOptions& o, const std::vector<PlanResult>& results,
                       const std::vector<std::string>& memory) {
  std::ostringstream out;
  char b[400];
  out << "replica plan: " << p.model << ", global batch " << o.global_batch << "\n";
  std::snprintf(b, sizeof b,
                "profile: %s, micro-batch %ld: forward %.1f ms, backward %.1f ms, optimizer %.1f ms, %ld parameters "
                "(%zu slots)\n",
                p.device.c_str(), static_cast<long>(p.micro_batch), p.forward_s * 1e3, p.backward_s * 1e3,
                p.optimizer_s * 1e3, static_cast<long>(p.params()), p.slot_elements.size());
  out << b;
  std::snprintf(b, sizeof b, "%-26s %11s %10s %10s %7s %11s %11s %-18s %12s %10s", "devices / link", "micro x acc",
                "step (ms)", "img/s", "effic.", "comm (ms)", "exposed", "algorithm", "buckets (MB)", "memory");
  out << b;
  if (o.epochs > 0 && o.dataset_images > 0) out << "  hours / " << o.epochs << " ep" << (o.cost_per_device_hour > 0 ? "   cost" : "");
  out << "\n";
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    char buckets[32];
    std::snprintf(buckets, sizeof buckets, "%zu (%g)", r.buckets.size(), r.bucket_mb);
    std::snprintf(b, sizeof b, "%-26s %7ld x %-2d %10.1f %10.1f %6.1f%% %11.2f %11.2f %-18s %12s %10s",
                  r.target.label().c_str(), static_cast<long>(r.micro_batch), r.accumulation, r.step_s * 1e3,
                  r.images_per_s, 100 * r.efficiency, r.comm_s * 1e3, r.exposed_s * 1e3,
                  r.target.devices() > 1 ? r.algorithm.c_str() : "-", buckets, i < memory.size() ? memory[i].c_str() : "");
    out << b;
    if (o.epochs > 0 && o.dataset_images > 0) {
      std::snprintf(b, sizeof b, "  %10.2f", r.hours);
      out << b;
      if (o.cost_per_device_hour > 0) {
        std::snprintf(b, sizeof b, "  %8.2f", r.cost);
        out << b;
      }
    }
    out << (r.data_bound ? "  (input pipeline bound)" : "") << "\n";
  }
  return out.str();
}

std::string plan_json(const StepProfile& p, const PlanOptions& o, const std::vector<PlanResult>& results,
                      const std::vector<std::string>& memory) {
  Json rows = Json::array();
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    Json buckets = Json::array();
    for (const auto& bt : r.buckets)
      buckets.push_back({{"bytes", bt.bytes},
                         {"ready_ms", json_number(bt.ready_s * 1e3)},
                         {"start_ms", json_number(bt.start_s * 1e3)},
                         {"end_ms", json_number(bt.end_s * 1e3)}});
    rows.push_back({{"devices", r.target.devices()},
                    {"nodes", r.target.nodes},
                    {"per_node", r.target.per_node},
                    {"link", r.target.intra.name},
                    {"inter_link", r.target.nodes > 1 ? r.target.inter.name : ""},
                    {"micro_batch", r.micro_batch},
                    {"accumulation", r.accumulation},
                    {"step_ms", json_number(r.step_s * 1e3)},
                    {"images_per_s", json_number(r.images_per_s)},
                    {"efficiency", json_number(r.efficiency)},
                    {"comm_ms", json_number(r.comm_s * 1e3)},
                    {"exposed_comm_ms", json_number(r.exposed_s * 1e3)},
                    {"straggler_ms", json_number(r.straggler_s * 1e3)},
                    {"algorithm", r.target.devices() > 1 ? r.algorithm : ""},
                    {"bucket_mb", r.bucket_mb},
                    {"data_bound", r.data_bound},
                    {"memory", i < memory.size() ? memory[i] : ""},
                    {"hours", json_number(r.hours)},
                    {"cost", json_number(r.cost)},
                    {"buckets", std::move(buckets)}});
  }
  return json_line({{"kind", "plan"},
                    {"model", p.model},
                    {"profile_device", p.device},
                    {"profile_micro_batch", p.micro_batch},
                    {"global_batch", o.global_batch},
                    {"alternatives", std::move(rows)}}) +
         "\n";
}

std::vector<std::pair<int, int>> parse_device_counts(const std::string& spec) {
  std::vector<std::pair<int, int>> out;
  std::stringstream list(spec);
  std::string item;
  auto number = [&](const std::string& s) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != s.size() || v < 1 || v > 1 << 20)
      throw ConfigError("--devices '" + spec + "': '" + item + "' is not a positive count N or NODESxPER_NODE; e.g. 8 or 4x8, or a list 1,2,4");
    return v;
  };
  while (std::getline(list, item, ',')) {
    const size_t x = item.find('x');
    if (x == std::string::npos) out.push_back({1, number(item)});
    else out.push_back({number(item.substr(0, x)), number(item.substr(x + 1))});
  }
  if (out.empty()) throw ConfigError("--devices is empty; give N or NODESxPER_NODE, e.g. 8 or 4x8");
  return out;
}

parallel::Link read_link_file(const std::string& path) {
  const std::string text = read_file(path, "the --link-file");
  if (text.find("# replica bench allreduce:") != std::string::npos) return parallel::fit_link(text, path);
  YAML::Node n;
  try {
    n = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(path + ": not YAML (" + e.msg + "); give replica bench allreduce output or {name, alpha_us, bandwidth_gbs}");
  }
  if (!n.IsMap() || !n["alpha_us"] || !n["bandwidth_gbs"])
    throw ConfigError(path + ": needs the keys alpha_us and bandwidth_gbs (and optionally name), or replica bench allreduce output");
  parallel::Link l;
  try {
    l.name = n["name"] ? n["name"].as<std::string>() : "custom";
    l.alpha_s = n["alpha_us"].as<double>() * 1e-6;
    l.bandwidth = n["bandwidth_gbs"].as<double>() * 1e9;
  } catch (const YAML::Exception& e) {
    throw ConfigError(path + ": alpha_us and bandwidth_gbs must be numbers (" + e.msg + ")");
  }
  if (!(l.alpha_s >= 0) || !(l.bandwidth > 0))
    throw ConfigError(path + ": alpha_us must be >= 0 and bandwidth_gbs > 0");
  l.about = "from " + path;
  return l;
}

}  // namespace replica::train
