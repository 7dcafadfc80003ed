// Config parsing: a table of known keys per section, each with a typed setter and its checks.
#include "train/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "core/errors.h"

namespace replica::train {

namespace {

struct Loc {
  std::string source;
  std::string key;  // section.key
  int line = -1;    // 1-based; -1 when the value came from --set
  std::string where() const {
    return line > 0 ? source + ":" + std::to_string(line) + ": " + key : "--set " + key;
  }
};

[[noreturn]] void fail(const Loc& l, const std::string& what) { throw ConfigError(l.where() + ": " + what); }

std::string scalar(const YAML::Node& n, const Loc& l) {
  if (!n.IsScalar()) fail(l, "expected a single value");
  return n.Scalar();
}
int64_t as_int(const YAML::Node& n, const Loc& l, int64_t lo, int64_t hi) {
  std::string s = scalar(n, l);
  int64_t v;
  try {
    size_t pos;
    v = std::stoll(s, &pos);
    if (pos != s.size()) throw std::invalid_argument(s);
  } catch (const std::exception&) {
    fail(l, "'" + s + "' is not an integer");
  }
  if (v < lo || v > hi) fail(l, std::to_string(v) + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}
double as_double(const YAML::Node& n, const Loc& l, double lo, double hi) {
  std::string s = scalar(n, l);
  double v;
  try {
    size_t pos;
    v = std::stod(s, &pos);
    if (pos != s.size()) throw std::invalid_argument(s);
  } catch (const std::exception&) {
    fail(l, "'" + s + "' is not a number");
  }
  if (!(v >= lo && v <= hi)) {
    std::ostringstream os;
    os << s << " is out of range [" << lo << ", " << hi << "]";
    fail(l, os.str());
  }
  return v;
}
bool as_bool(const YAML::Node& n, const Loc& l) {
  std::string s = scalar(n, l);
  if (s == "true" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "no" || s == "off") return false;
  fail(l, "'" + s + "' is not a boolean; use true or false");
}
std::string one_of(const YAML::Node& n, const Loc& l, const std::vector<std::string>& allowed) {
  std::string s = scalar(n, l);
  if (std::find(allowed.begin(), allowed.end(), s) != allowed.end()) return s;
  std::string list;
  for (auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
  fail(l, "'" + s + "' is not one of: " + list);
}
std::vector<double> as_list(const YAML::Node& n, const Loc& l, double lo, double hi) {
  if (n.IsScalar()) return {as_double(n, l, lo, hi)};
  if (!n.IsSequence()) fail(l, "expected a list like [0.5, 0.5]");
  std::vector<double> v;
  for (const auto& e : n) v.push_back(as_double(e, l, lo, hi));
  return v;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
std::string suggest(const std::string& key, const std::vector<std::string>& known) {
  std::string best;
  size_t bd = 3;
  for (auto& k : known) {
    size_t d = edit_distance(key, k);
    if (d < bd) bd = d, best = k;
  }
  return best.empty() ? "" : "; did you mean '" + best + "'?";
}

using Setter = std::function<void(const YAML::Node&, const Loc&)>;
using Section = std::vector<std::pair<std::string, Setter>>;

std::map<std::string, Section> schema(RunConfig& c) {
  auto& m = c.model;
  auto& d = c.data;
  auto& t = c.train;
  auto& o = c.optim;
  auto& p = c.parallel;
  auto& mem = c.memory;
  auto& ck = c.checkpoint;
  static constexpr double inf = 1e300;
  return {
      {"model",
       {{"arch", [&](auto& n, auto& l) {
          m.arch = one_of(n, l, {"resnet20", "resnet32", "resnet56", "resnet110", "resnet18", "resnet34", "resnet50"});
        }},
        {"width", [&](auto& n, auto& l) { m.width = as_int(n, l, 0, 4096); }},
        {"zero_init_residual", [&](auto& n, auto& l) { m.zero_init_residual = as_bool(n, l); }},
        {"freeze_bn", [&](auto& n, auto& l) { m.freeze_bn = as_bool(n, l); }},
        {"checkpoint", [&](auto& n, auto& l) {
          std::string v = scalar(n, l);
          if (v == "none") m.checkpoint_every = 0;
          else if (v == "blocks") m.checkpoint_every = 1;
          else if (v.rfind("every:", 0) == 0) {
            YAML::Node num(v.substr(6));
            m.checkpoint_every = static_cast<int>(as_int(num, l, 1, 1000000));
          } else {
            fail(l, "'" + v + "' is not a checkpointing choice; use none, blocks or every:N");
          }
        }}}},
      {"data",
       {{"dataset", [&](auto& n, auto& l) { d.dataset = one_of(n, l, {"fashion-mnist", "mnist", "cifar10", "synthetic"}); }},
        {"path", [&](auto& n, auto& l) { d.path = scalar(n, l); }},
        {"pad_crop", [&](auto& n, auto& l) { d.pad_crop = as_int(n, l, 0, 64); }},
        {"hflip", [&](auto& n, auto& l) { d.hflip = as_bool(n, l); }},
        {"mean", [&](auto& n, auto& l) {
          auto v = as_list(n, l, -inf, inf);
          d.mean.assign(v.begin(), v.end());
        }},
        {"std", [&](auto& n, auto& l) {
          auto v = as_list(n, l, 1e-12, inf);
          d.std.assign(v.begin(), v.end());
        }},
        {"synthetic_shape", [&](auto& n, auto& l) {
          auto v = as_list(n, l, 1, 4096);
          if (v.size() != 3) fail(l, "expected [H, W, C]");
          d.synthetic_shape.assign(v.begin(), v.end());
        }},
        {"synthetic_classes", [&](auto& n, auto& l) { d.synthetic_classes = as_int(n, l, 2, 1000000); }},
        {"synthetic_size", [&](auto& n, auto& l) { d.synthetic_size = as_int(n, l, 1, int64_t(1) << 40); }},
        {"prefetch", [&](auto& n, auto& l) { d.prefetch = static_cast<int>(as_int(n, l, 1, 64)); }},
        {"limit_train", [&](auto& n, auto& l) { d.limit_train = as_int(n, l, 0, int64_t(1) << 40); }},
        {"limit_test", [&](auto& n, auto& l) { d.limit_test = as_int(n, l, 0, int64_t(1) << 40); }}}},
      {"train",
       {{"epochs", [&](auto& n, auto& l) { t.epochs = as_double(n, l, 1e-6, 1e6); }},
        {"global_batch", [&](auto& n, auto& l) { t.global_batch = as_int(n, l, 1, int64_t(1) << 30); }},
        {"micro_batch", [&](auto& n, auto& l) {
          t.micro_batch = scalar(n, l) == "auto" ? -1 : as_int(n, l, 0, int64_t(1) << 30);
        }},
        {"precision", [&](auto& n, auto& l) { t.precision = one_of(n, l, {"fp32", "fp16", "bf16"}); }},
        {"loss_scale", [&](auto& n, auto& l) {
          std::string v = scalar(n, l);
          if (v != "auto" && v != "dynamic" && v != "off") {
            as_double(n, l, 1e-30, 1e30);  // a static scale
          }
          t.loss_scale = v;
        }},
        {"loss_scale_init", [&](auto& n, auto& l) { t.loss_scale_init = as_double(n, l, 1e-30, 1e30); }},
        {"loss_scale_growth_interval", [&](auto& n, auto& l) { t.loss_scale_growth_interval = as_int(n, l, 1, int64_t(1) << 40); }},
        {"loss_scale_min", [&](auto& n, auto& l) { t.loss_scale_min = as_double(n, l, 1e-30, 1e30); }},
        {"loss_scale_hysteresis", [&](auto& n, auto& l) { t.loss_scale_hysteresis = as_int(n, l, 1, 1000); }},
        {"loss_scale_max_floor_overflows", [&](auto& n, auto& l) { t.loss_scale_max_floor_overflows = as_int(n, l, 1, int64_t(1) << 40); }},
        {"seed", [&](auto& n, auto& l) { t.seed = static_cast<uint64_t>(as_int(n, l, 0, INT64_MAX)); }},
        {"log_every", [&](auto& n, auto& l) { t.log_every = as_int(n, l, 1, int64_t(1) << 40); }},
        {"max_steps", [&](auto& n, auto& l) { t.max_steps = as_int(n, l, 0, int64_t(1) << 40); }},
        {"run_dir", [&](auto& n, auto& l) { t.run_dir = scalar(n, l); }},
        {"eval", [&](auto& n, auto& l) { t.eval = as_bool(n, l); }},
        {"eval_batch", [&](auto& n, auto& l) { t.eval_batch = as_int(n, l, 1, int64_t(1) << 20); }},
        {"tensorboard", [&](auto& n, auto& l) { t.tensorboard = as_bool(n, l); }}}},
      {"checkpoint",
       {{"every_steps", [&](auto& n, auto& l) { ck.every_steps = as_int(n, l, 0, int64_t(1) << 40); }},
        {"every_epochs", [&](auto& n, auto& l) { ck.every_epochs = as_int(n, l, 0, int64_t(1) << 40); }},
        {"keep_last", [&](auto& n, auto& l) { ck.keep_last = static_cast<int>(as_int(n, l, 0, 1000000)); }},
        {"dir", [&](auto& n, auto& l) { ck.dir = scalar(n, l); }}}},
      {"optim",
       {{"name", [&](auto& n, auto& l) { o.name = one_of(n, l, {"sgd", "adamw", "lars"}); }},
        {"beta1", [&](auto& n, auto& l) { o.beta1 = as_double(n, l, 0, 0.999999); }},
        {"beta2", [&](auto& n, auto& l) { o.beta2 = as_double(n, l, 0, 0.999999999); }},
        {"eps", [&](auto& n, auto& l) { o.eps = as_double(n, l, 0, 1); }},
        {"trust_coefficient", [&](auto& n, auto& l) { o.trust_coefficient = as_double(n, l, 1e-9, 1e3); }},
        {"clip_grad_norm", [&](auto& n, auto& l) { o.clip_grad_norm = as_double(n, l, 0, 1e12); }},
        {"lr", [&](auto& n, auto& l) { o.lr = as_double(n, l, 1e-12, 1e6); }},
        {"momentum", [&](auto& n, auto& l) { o.momentum = as_double(n, l, 0, 0.999999); }},
        {"nesterov", [&](auto& n, auto& l) { o.nesterov = as_bool(n, l); }},
        {"weight_decay", [&](auto& n, auto& l) { o.weight_decay = as_double(n, l, 0, 1); }},
        {"decoupled_weight_decay", [&](auto& n, auto& l) { o.decoupled_weight_decay = as_bool(n, l); }},
        {"no_decay_bn_bias", [&](auto& n, auto& l) { o.no_decay_bn_bias = as_bool(n, l); }},
        {"schedule", [&](auto& n, auto& l) { o.schedule = one_of(n, l, {"constant", "step", "cosine"}); }},
        {"warmup_epochs", [&](auto& n, auto& l) { o.warmup_epochs = as_double(n, l, 0, 1e6); }},
        {"warmup_start_factor", [&](auto& n, auto& l) { o.warmup_start_factor = as_double(n, l, 0, 1); }},
        {"milestones", [&](auto& n, auto& l) { o.milestones = as_list(n, l, 0, 1e6); }},
        {"gamma", [&](auto& n, auto& l) { o.gamma = as_double(n, l, 0, 1); }},
        {"min_lr", [&](auto& n, auto& l) { o.min_lr = as_double(n, l, 0, 1e6); }},
        {"scale_lr", [&](auto& n, auto& l) { o.scale_lr = as_bool(n, l); }}}},
      {"parallel",
       {{"devices", [&](auto& n, auto& l) { p.devices = scalar(n, l); }},
        {"sync_bn", [&](auto& n, auto& l) { p.sync_bn = as_bool(n, l); }},
        {"grad_dtype", [&](auto& n, auto& l) { p.grad_dtype = one_of(n, l, {"fp32", "fp16", "bf16"}); }},
        {"bucket_mb", [&](auto& n, auto& l) { p.bucket_mb = as_double(n, l, 0.001, 1e6); }},
        {"first_bucket_mb", [&](auto& n, auto& l) { p.first_bucket_mb = as_double(n, l, 0.001, 1e6); }},
        {"check_every", [&](auto& n, auto& l) { p.check_every = as_int(n, l, 0, int64_t(1) << 40); }},
        {"timeout_s", [&](auto& n, auto& l) { p.timeout_s = as_double(n, l, 0.01, 1e6); }},
        {"pin_threads", [&](auto& n, auto& l) { p.pin_threads = as_bool(n, l); }},
        {"intra_op_threads", [&](auto& n, auto& l) { p.intra_op_threads = static_cast<int>(as_int(n, l, 1, 1024)); }}}},
      {"memory",
       {{"mode", [&](auto& n, auto& l) { mem.mode = one_of(n, l, {"preallocate", "growth", "platform"}); }},
        {"fraction", [&](auto& n, auto& l) {
          double f = as_double(n, l, -inf, inf);
          if (!(f > 0 && f <= 1)) fail(l, scalar(n, l) + " is not a memory fraction; use a number in (0, 1], e.g. 0.75");
          mem.fraction = f;
        }},
        {"bytes", [&](auto& n, auto& l) { mem.bytes = parse_bytes(scalar(n, l), l.where()); }},
        {"step_plan", [&](auto& n, auto& l) { mem.step_plan = as_bool(n, l); }}}},
  };
}

std::vector<std::string> keys_of(const Section& s) {
  std::vector<std::string> k;
  for (auto& e : s) k.push_back(e.first);
  return k;
}

std::string emit(const RunConfig& c) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  e << YAML::Key << "model" << YAML::Value << YAML::BeginMap << YAML::Key << "arch" << YAML::Value << c.model.arch
    << YAML::Key << "width" << YAML::Value << c.model.width << YAML::Key << "zero_init_residual" << YAML::Value
    << c.model.zero_init_residual << YAML::Key << "freeze_bn" << YAML::Value << c.model.freeze_bn << YAML::Key << "checkpoint" << YAML::Value
    << (c.model.checkpoint_every == 0 ? std::string("none")
                                      : c.model.checkpoint_every == 1 ? std::string("blocks")
                                                                      : "every:" + std::to_string(c.model.checkpoint_every))
    << YAML::EndMap;
  e << YAML::Key << "data" << YAML::Value << YAML::BeginMap << YAML::Key << "dataset" << YAML::Value << c.data.dataset
    << YAML::Key << "path" << YAML::Value << c.data.path << YAML::Key << "pad_crop" << YAML::Value << c.data.pad_crop
    << YAML::Key << "hflip" << YAML::Value << c.data.hflip << YAML::Key << "mean" << YAML::Value << YAML::Flow
    << c.data.mean << YAML::Key << "std" << YAML::Value << YAML::Flow << c.data.std << YAML::Key << "synthetic_shape"
    << YAML::Value << YAML::Flow << c.data.synthetic_shape << YAML::Key << "synthetic_classes" << YAML::Value
    << c.data.synthetic_classes << YAML::Key << "synthetic_size" << YAML::Value << c.data.synthetic_size << YAML::Key
    << "prefetch" << YAML::Value << c.data.prefetch << YAML::Key << "limit_train" << YAML::Value << c.data.limit_train
    << YAML::Key << "limit_test" << YAML::Value << c.data.limit_test << YAML::EndMap;
  e << YAML::Key << "train" << YAML::Value << YAML::BeginMap << YAML::Key << "epochs" << YAML::Value << c.train.epochs
    << YAML::Key << "global_batch" << YAML::Value << c.train.global_batch << YAML::Key << "micro_batch" << YAML::Value
    << (c.train.micro_batch < 0 ? std::string("auto") : std::to_string(c.train.micro_batch)) << YAML::Key << "precision" << YAML::Value << c.train.precision << YAML::Key
    << "loss_scale" << YAML::Value << c.train.loss_scale << YAML::Key << "loss_scale_init" << YAML::Value
    << c.train.loss_scale_init << YAML::Key << "loss_scale_growth_interval" << YAML::Value
    << c.train.loss_scale_growth_interval << YAML::Key << "loss_scale_min" << YAML::Value << c.train.loss_scale_min
    << YAML::Key << "loss_scale_hysteresis" << YAML::Value << c.train.loss_scale_hysteresis << YAML::Key
    << "loss_scale_max_floor_overflows" << YAML::Value << c.train.loss_scale_max_floor_overflows << YAML::Key << "seed"
    << YAML::Value << c.train.seed << YAML::Key << "log_every" << YAML::Value << c.train.log_every << YAML::Key
    << "max_steps" << YAML::Value << c.train.max_steps << YAML::Key << "run_dir" << YAML::Value << c.train.run_dir
    << YAML::Key << "eval" << YAML::Value << c.train.eval << YAML::Key << "eval_batch" << YAML::Value
    << c.train.eval_batch << YAML::Key << "tensorboard" << YAML::Value << c.train.tensorboard << YAML::EndMap;
  e << YAML::Key << "checkpoint" << YAML::Value << YAML::BeginMap << YAML::Key << "every_steps" << YAML::Value
    << c.checkpoint.every_steps << YAML::Key << "every_epochs" << YAML::Value << c.checkpoint.every_epochs
    << YAML::Key << "keep_last" << YAML::Value << c.checkpoint.keep_last << YAML::Key << "dir" << YAML::Value
    << c.checkpoint.dir << YAML::EndMap;
  e << YAML::Key << "optim" << YAML::Value << YAML::BeginMap << YAML::Key << "name" << YAML::Value << c.optim.name
    << YAML::Key << "beta1" << YAML::Value << c.optim.beta1 << YAML::Key << "beta2" << YAML::Value << c.optim.beta2
    << YAML::Key << "eps" << YAML::Value << c.optim.eps << YAML::Key << "trust_coefficient" << YAML::Value
    << c.optim.trust_coefficient << YAML::Key << "clip_grad_norm" << YAML::Value << c.optim.clip_grad_norm
    << YAML::Key << "lr" << YAML::Value << c.optim.lr << YAML::Key << "momentum" << YAML::Value << c.optim.momentum
    << YAML::Key << "nesterov" << YAML::Value << c.optim.nesterov << YAML::Key << "weight_decay" << YAML::Value
    << c.optim.weight_decay << YAML::Key << "decoupled_weight_decay" << YAML::Value << c.optim.decoupled_weight_decay
    << YAML::Key << "no_decay_bn_bias" << YAML::Value << c.optim.no_decay_bn_bias << YAML::Key << "schedule"
    << YAML::Value << c.optim.schedule << YAML::Key << "warmup_epochs" << YAML::Value << c.optim.warmup_epochs
    << YAML::Key << "warmup_start_factor" << YAML::Value << c.optim.warmup_start_factor << YAML::Key << "milestones"
    << YAML::Value << YAML::Flow << c.optim.milestones << YAML::Key << "gamma" << YAML::Value << c.optim.gamma
    << YAML::Key << "min_lr" << YAML::Value << c.optim.min_lr << YAML::Key << "scale_lr" << YAML::Value
    << c.optim.scale_lr << YAML::EndMap;
  e << YAML::Key << "parallel" << YAML::Value << YAML::BeginMap << YAML::Key << "devices" << YAML::Value
    << c.parallel.devices << YAML::Key << "sync_bn" << YAML::Value << c.parallel.sync_bn << YAML::Key
    << "grad_dtype" << YAML::Value << c.parallel.grad_dtype << YAML::Key << "bucket_mb"
    << YAML::Value << c.parallel.bucket_mb << YAML::Key << "first_bucket_mb" << YAML::Value
    << c.parallel.first_bucket_mb << YAML::Key << "check_every" << YAML::Value << c.parallel.check_every << YAML::Key
    << "timeout_s" << YAML::Value << c.parallel.timeout_s << YAML::Key << "pin_threads" << YAML::Value
    << c.parallel.pin_threads << YAML::Key << "intra_op_threads" << YAML::Value << c.parallel.intra_op_threads
    << YAML::EndMap;
  e << YAML::Key << "memory" << YAML::Value << YAML::BeginMap;
  if (c.memory.mode) e << YAML::Key << "mode" << YAML::Value << *c.memory.mode;
  if (c.memory.fraction) e << YAML::Key << "fraction" << YAML::Value << *c.memory.fraction;
  if (c.memory.bytes) e << YAML::Key << "bytes" << YAML::Value << *c.memory.bytes;
  e << YAML::Key << "step_plan" << YAML::Value << c.memory.step_plan;
  e << YAML::EndMap << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace

uint64_t parse_bytes(const std::string& s, const std::string& what) {
  size_t pos = 0;
  double v;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw ConfigError(what + ": '" + s + "' is not a size; use e.g. 2GiB, 512MiB or 1000000");
  }
  std::string unit = s.substr(pos);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  static const std::map<std::string, double> units = {
      {"", 1}, {"B", 1}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  auto it = units.find(unit);
  if (it == units.end() || !(v >= 0))
    throw ConfigError(what + ": '" + s + "' is not a size; use e.g. 2GiB, 512MiB or 1000000");
  const double bytes = v * it->second;
  // Converting a double beyond 2^64 to an integer is undefined: refuse anything past 1 EiB.
  if (!(bytes <= 1152921504606846976.0))
    throw ConfigError(what + ": '" + s + "' is larger than any device (more than 1 EiB)");
  return static_cast<uint64_t>(bytes);
}

namespace {
RunConfig parse_config_nodes(const std::string& text, const std::string& source, const std::vector<std::string>& sets) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw ConfigError(source + ":" + std::to_string(e.mark.line + 1) + ": YAML syntax error: " + e.msg);
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) throw ConfigError(source + ": expected sections (model, data, train, optim, parallel, memory, checkpoint)");
  RunConfig c;
  c.source = source;
  auto sch = schema(c);
  std::vector<std::string> sections;
  for (auto& [name, _] : sch) sections.push_back(name);

  // --set overrides: section.key=value, the value parsed as YAML (so lists work: [0.5,0.5]).
  for (const auto& s : sets) {
    auto eq = s.find('=');
    auto dot = s.find('.');
    if (eq == std::string::npos || dot == std::string::npos || dot > eq)
      throw ConfigError("--set " + s + ": expected section.key=value, e.g. --set train.epochs=1");
    std::string sec = s.substr(0, dot), key = s.substr(dot + 1, eq - dot - 1), val = s.substr(eq + 1);
    if (!sch.count(sec)) throw ConfigError("--set " + s + ": unknown section '" + sec + "'" + suggest(sec, sections));
    auto known = keys_of(sch[sec]);
    if (std::find(known.begin(), known.end(), key) == known.end())
      throw ConfigError("--set " + s + ": unknown key '" + sec + "." + key + "'" + suggest(key, known));
    YAML::Node v;
    try {
      v = YAML::Load(val);
    } catch (const YAML::Exception&) {
      v = YAML::Node(val);
    }
    if (v.IsNull()) v = YAML::Node(val);
    root[sec][key] = YAML::Clone(v);
  }

  // A key must be a plain word: a mapping or list used as a key ("{a: 1}: 2", "? [x]") is named.
  auto key_text = [&](const YAML::Node& k, const std::string& inside) {
    if (!k.IsScalar())
      throw ConfigError(source + ":" + std::to_string(k.Mark().line + 1) + ": " + inside +
                        "a key must be a plain name, not a " + (k.IsMap() ? "mapping" : k.IsSequence() ? "list" : "null") +
                        " (check the indentation and the colons)");
    return k.Scalar();
  };
  for (auto it = root.begin(); it != root.end(); ++it) {
    std::string sec = key_text(it->first, "");
    int line = it->first.Mark().line + 1;
    if (!sch.count(sec))
      throw ConfigError(source + ":" + std::to_string(line) + ": unknown section '" + sec + "'" + suggest(sec, sections) +
                        " (sections: model, data, train, optim, parallel, memory, checkpoint)");
    if (it->second.IsNull()) continue;
    if (!it->second.IsMap()) throw ConfigError(source + ":" + std::to_string(line) + ": " + sec + ": expected key: value pairs");
    auto& section = sch[sec];
    auto known = keys_of(section);
    for (auto kv = it->second.begin(); kv != it->second.end(); ++kv) {
      std::string key = key_text(kv->first, sec + ": ");
      Loc l{source, sec + "." + key, kv->first.Mark().line >= 0 ? kv->first.Mark().line + 1 : -1};
      auto f = std::find_if(section.begin(), section.end(), [&](auto& e) { return e.first == key; });
      if (f == section.end()) fail(l, "unknown key" + suggest(key, known));
      f->second(kv->second, l);
    }
  }
  // cross-field checks
  if (c.data.dataset != "synthetic" && c.model.arch.rfind("resnet", 0) != 0)
    throw ConfigError(source + ": model.arch '" + c.model.arch + "' is not a model");
  if (c.optim.schedule == "step" && c.optim.milestones.empty())
    throw ConfigError(source + ": optim.schedule: step needs optim.milestones (epochs), e.g. [100, 150]");
  if (!std::is_sorted(c.optim.milestones.begin(), c.optim.milestones.end()))
    throw ConfigError(source + ": optim.milestones must be increasing");
  if (c.data.mean.size() != c.data.std.size())
    throw ConfigError(source + ": data.mean and data.std need the same number of values (one per channel)");
  c.resolved = emit(c);
  return c;
}
}  // namespace

RunConfig parse_config(const std::string& text, const std::string& source, const std::vector<std::string>& sets) {
  try {
    return parse_config_nodes(text, source, sets);
  } catch (const YAML::Exception& e) {  // anything yaml-cpp refuses that the checks above missed
    throw ConfigError(source + (e.mark.is_null() ? std::string() : ":" + std::to_string(e.mark.line + 1)) +
                      ": cannot read the configuration: " + e.msg);
  }
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& sets) {
  if (path.empty()) return parse_config(default_config_text(), "built-in default (configs/default.yaml)", sets);
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot open the config file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path, sets);
}

}  // namespace replica::train
