// Per-CPU kernel choices by measurement (see the header): the calibration, its cache and its report.
#include "ops/cpu/tuning.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "core/cpu_features.h"
#include "core/env.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "core/json.h"
#include "core/log.h"
#include "core/pools.h"
#include "ops/cpu/direct_conv.h"
#include "ops/cpu/isa.h"

namespace replica::ops {
namespace {

// Bump when the direct kernels change in a way that could move the measurement: old cache
// entries then no longer match and the next run measures again.
constexpr int kTuningVersion = 1;

std::string kernels_key() {
  return std::string(cpu_kernel_variant().name) + " direct kernels v" + std::to_string(kTuningVersion);
}

std::string today() {
  const std::time_t t = std::time(nullptr);
  char b[16];
  std::strftime(b, sizeof b, "%Y-%m-%d", std::gmtime(&t));
  return b;
}

// A field of a cache entry when it has the type expected, else `fallback` (the file is outside
// bytes: a hand-edited or damaged entry is skipped or read with defaults, never an exception).
std::string text_of(const Json& e, const char* key, const std::string& fallback = "") {
  const auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : fallback;
}

// The cache: {"kind": "replica cpu tuning", "version": 1, "entries": [{cpu, kernels, zmm, ratio,
// measured_on, date}, ...]}. A file that does not parse is reported and replaced.
Json read_cache(const std::string& path) {
  Json empty = {{"kind", "replica cpu tuning"}, {"version", 1}, {"entries", Json::array()}};
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return empty;
  try {
    Json j = Json::parse(read_file(path, "the CPU tuning cache"));
    if (!j.is_object() || text_of(j, "kind") != "replica cpu tuning" || !j.contains("entries") || !j["entries"].is_array())
      throw Error("not a replica CPU tuning cache");
    return j;
  } catch (const std::exception& e) {
    log_warn(path, ": ", e.what(), "; measuring again and replacing it");
    return empty;
  }
}

// The entry of this CPU model and kernel version; entries that are not objects, name another CPU
// or carry no boolean "zmm" are skipped.
std::optional<CpuTuning> cached(const Json& cache) {
  const std::string cpu = cpu_model_key(), kernels = kernels_key();
  for (const Json& e : cache["entries"]) {
    if (!e.is_object() || text_of(e, "cpu") != cpu || text_of(e, "kernels") != kernels) continue;
    const auto zmm = e.find("zmm");
    if (zmm == e.end() || !zmm->is_boolean()) continue;
    CpuTuning t;
    t.zmm = zmm->get<bool>();
    const auto ratio = e.find("ratio");
    t.ratio = ratio != e.end() && ratio->is_number() ? ratio->get<double>() : 0.0;
    t.how = "cached";
    char b[200];
    std::snprintf(b, sizeof b, "512-bit %.2fx the 256-bit kernels, measured on %s, %s", t.ratio,
                  text_of(e, "measured_on", "?").c_str(), text_of(e, "date", "?").c_str());
    t.why = b;
    return t;
  }
  return std::nullopt;
}

void write_cache(Json cache, const CpuTuning& t, const std::string& what, const std::string& path) {
  const std::string cpu = cpu_model_key(), kernels = kernels_key();
  Json& entries = cache["entries"];
  Json kept = Json::array();
  for (const Json& e : entries)
    if (!(e.is_object() && text_of(e, "cpu") == cpu && text_of(e, "kernels") == kernels)) kept.push_back(e);
  kept.push_back({{"cpu", cpu},
                  {"kernels", kernels},
                  {"zmm", t.zmm},
                  {"ratio", json_number(t.ratio)},
                  {"seconds", json_number(t.seconds)},
                  {"measured_on", what},
                  {"date", today()}});
  entries = kept;
  try {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    write_file_atomic(path, cache.dump(2) + "\n");
  } catch (const std::exception& e) {  // a read-only home: measured again next time, nothing lost
    log_warn("could not keep the CPU calibration in ", path, ": ", e.what());
  }
}

// One pass over the distinct layers the direct kernels serve (batch 1): forward and weight
// gradient, the passes whose kernels have a 512-bit form. Seconds on the host clock.
struct Layers {
  std::vector<ConvGeom> geoms;
  std::unique_ptr<MemoryPool> pool;
  std::vector<std::tuple<Tensor, Tensor, Tensor, Tensor>> t;  // x, w, y, dw
};

Layers prepare(const std::vector<ConvGeom>& layers) {
  Layers L;
  std::map<std::vector<int64_t>, bool> seen;
  for (const ConvGeom& g0 : layers) {
    if (g0.groups > 1) continue;  // grouped layers have their own kernel (grouped_conv.h), not the direct ones
    const ConvGeom g = ConvGeom::make({1, g0.H, g0.W, g0.C}, g0.K, g0.R, g0.S, g0.stride, g0.pad, "calibration");
    if (direct::serves_winograd(g) || !(direct::serves_forward(g) || direct::serves_backward_filter(g))) continue;
    if (!seen.emplace(std::vector<int64_t>{g.H, g.W, g.C, g.K, g.R, g.S, g.stride, g.pad}, true).second) continue;
    L.geoms.push_back(g);
  }
  PoolOptions po;
  po.mode = AllocatorMode::growth;
  L.pool = make_pool(Device{DeviceKind::cpu, 0}, po);
  for (const ConvGeom& g : L.geoms) {
    Tensor x = Tensor::empty(*L.pool, {1, g.H, g.W, g.C}, DType::f32, MemTag::activations);
    Tensor w = Tensor::empty(*L.pool, {g.K, g.R, g.S, g.C}, DType::f32, MemTag::params);
    Tensor y = Tensor::empty(*L.pool, {1, g.P, g.Q, g.K}, DType::f32, MemTag::activations);
    Tensor dw = Tensor::empty(*L.pool, {g.K, g.R, g.S, g.C}, DType::f32, MemTag::grads);
    for (Tensor* e : {&x, &w, &y, &dw}) std::fill_n(e->data<float>(), e->numel(), 0.01f);
    L.t.emplace_back(x, w, y, dw);
  }
  return L;
}

double run_pass(Layers& L) {
  Backend& be = cpu_kernel_variant().backend();
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < L.geoms.size(); ++i) {
    auto& [x, w, y, dw] = L.t[i];
    be.conv2d_forward(x, w, y, L.geoms[i], *L.pool);
    be.conv2d_backward_filter(x, y, dw, L.geoms[i], *L.pool);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::string CpuTuning::line() const {
  std::string s = std::string("direct convolutions in ") + (zmm ? "512" : "256") + "-bit registers (" + how;
  if (!why.empty()) s += ": " + why;
  return s + ")";
}

std::string cpu_tuning_cache_path() {
  namespace fs = std::filesystem;
  if (const char* d = std::getenv("REPLICA_CACHE_DIR"); d && *d) return (fs::path(d) / "cpu-tuning.json").string();
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d)
    return (fs::path(d) / "replica" / "cpu-tuning.json").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home && *home ? home : "/tmp") / ".cache" / "replica" / "cpu-tuning.json").string();
}

CpuTuning choose_direct_width(const std::function<double(bool zmm)>& time_pass, int rounds, double margin) {
  double best[2] = {1e300, 1e300};
  for (int r = 0; r < rounds; ++r)
    for (int k = 0; k < 2; ++k) {
      const bool zmm = (r + k) % 2 == 1;  // ymm first in even rounds, zmm first in odd ones
      best[zmm] = std::min(best[zmm], time_pass(zmm));
    }
  CpuTuning t;
  t.ratio = best[1] > 0 ? best[0] / best[1] : 0;
  t.zmm = t.ratio >= margin;
  t.how = "calibrated now";
  return t;
}

namespace {
std::string forced_zmm() {
  const char* v = std::getenv("REPLICA_DIRECT_ZMM");
  return v && *v ? v : "";
}
}  // namespace

CpuTuning tune_cpu_kernels(const std::vector<ConvGeom>& layers, const std::string& what) {
  static std::mutex m;
  static std::optional<CpuTuning> done;
  std::lock_guard<std::mutex> lock(m);
  if (done) return *done;
  CpuTuning t;
  if (!forced_zmm().empty()) {
    t.zmm = env_flag("REPLICA_DIRECT_ZMM");
    t.how = "REPLICA_DIRECT_ZMM=" + forced_zmm();
  } else if (cpu_kernel_variant().isa < CpuIsa::avx512 || !direct::available()) {
    t.how = "the only width of the " + std::string(cpu_kernel_variant().name) + " kernel copy";
  } else {
    const std::string path = cpu_tuning_cache_path();
    Json cache = read_cache(path);
    if (auto c = cached(cache)) {
      t = *c;
      t.why += "; " + path;
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      Layers L = prepare(layers);
      if (L.geoms.empty()) {
        t.how = "no layer of " + what + " runs the direct kernels";
      } else {
        const bool before = direct::set_zmm(false);
        // One measurement: passes repeated for at least 20 ms (a small model's layers at batch 1
        // take microseconds: one pass alone would time the clock), seconds per pass.
        auto pass = [&](bool zmm) {
          direct::set_zmm(zmm);
          double spent = 0;
          int n = 0;
          do spent += run_pass(L), ++n;
          while (spent < 0.02);
          return spent / n;
        };
        const double first = pass(false) + pass(true);  // warm-up (packing buffers, pages), both widths
        // As many alternated rounds as fit in about 1.5 s (best of each: a shared machine's slow
        // phases fall on both widths), at least 1, at most 9.
        const int rounds = static_cast<int>(std::clamp(1.5 / std::max(first, 1e-6), 1.0, 9.0));
        t = choose_direct_width(pass, rounds);
        direct::set_zmm(before);
        t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        char b[240];
        std::snprintf(b, sizeof b, "512-bit %.2fx the 256-bit kernels on %zu layers of %s, %.1f s; kept in %s", t.ratio,
                      L.geoms.size(), what.c_str(), t.seconds, path.c_str());
        t.why = b;
        write_cache(cache, t, what, path);
      }
    }
  }
  direct::set_zmm(t.zmm);
  done = t;
  return t;
}

namespace {
std::string tuning_report_or_throw() {
  if (!forced_zmm().empty())
    return std::string("direct convolutions in ") + (env_flag("REPLICA_DIRECT_ZMM") ? "512" : "256") +
           "-bit registers (REPLICA_DIRECT_ZMM=" + forced_zmm() + ")";
  if (cpu_kernel_variant().isa < CpuIsa::avx512 || !direct::available())
    return "direct convolutions in 256-bit registers (the only width of the " + std::string(cpu_kernel_variant().name) +
           " kernel copy)";
  const std::string path = cpu_tuning_cache_path();
  if (auto c = cached(read_cache(path))) return c->line() + " for " + cpu_model_key() + ", from " + path;
  return "direct convolutions: not calibrated yet for " + cpu_model_key() +
         " (the first CPU run measures 256- against 512-bit on its model's layers, ~1 s, and keeps the result in " +
         path + ")";
}
}  // namespace

std::string cpu_tuning_report() {
  try {
    return tuning_report_or_throw();
  } catch (const ConfigError& e) {  // an unusable REPLICA_CPU_ISA: --version still prints, naming it
    return std::string("none: ") + e.what();
  }
}

}  // namespace replica::ops
