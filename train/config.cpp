// Config parsing: a table of known keys per section, each with a typed setter and its checks.
#include "train/config.h"

#include <charconv>
#include <type_traits>

#include <filesystem>

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "core/env.h"
#include "core/errors.h"
#include "ops/models/resnet.h"

namespace replica::train {

namespace {
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
}  // namespace

std::string did_you_mean(const std::string& key, const std::vector<std::string>& known) {
  std::string best;
  size_t bd = 3;
  for (auto& k : known) {
    size_t d = edit_distance(key, k);
    if (d < bd) bd = d, best = k;
  }
  return best.empty() ? "" : "; did you mean '" + best + "'?";
}

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
  const std::string s = scalar(n, l);
  if (const auto b = parse_bool_text(s)) return *b;  // the one boolean syntax (core/env.h)
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

using Setter = std::function<void(const YAML::Node&, const Loc&)>;
// Writes the key's current value (after its name); false: the key is unset and is left out.
using Getter = std::function<bool(YAML::Emitter&)>;
// One key, written once: how it is read (with its checks), how it is written back, and what
// `replica config` and docs/configuration.md say of it (ripgrep's flag definitions are the model:
// the documentation lives beside the code that parses the value).
struct Key {
  std::string name;
  Setter set;
  Getter get;
  std::string doc;      // one line: what the key does
  std::string allowed;  // the values it takes, as a person writes them
  std::string more;     // the docs/ page (and section) that explains it at length, or empty
};
using Section = std::vector<Key>;

// Builders for the common kinds; a key with its own syntax spells both directions out.
// A number as a person writes it: the shortest text that reads back as the same value (0.1, not
// yaml-cpp's 0.10000000000000001), so config.yaml and `replica config` read naturally and still
// round-trip exactly.
template <typename T>
void emit(YAML::Emitter& e, const T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    e << std::string(buf, r.ptr);
  } else {
    e << v;
  }
}
template <typename T>
Getter value_of(const T& v) {
  return [&v](YAML::Emitter& e) {
    emit(e, v);
    return true;
  };
}
template <typename T>
Getter list_of(const std::vector<T>& v) {
  return [&v](YAML::Emitter& e) {
    e << YAML::Flow << YAML::BeginSeq;
    for (const T& x : v) emit(e, x);
    e << YAML::EndSeq;
    return true;
  };
}
template <typename T>
Getter optional_of(const std::optional<T>& v) {
  return [&v](YAML::Emitter& e) {
    if (v) e << *v;
    return v.has_value();
  };
}
// A range as a person reads it: "[lo, hi]", or ">= lo" when hi is only a guard against overflow.
std::string range_text(double lo, double hi, const char* kind) {
  std::ostringstream os;
  os << kind << ' ';
  if (hi >= double(int64_t(1) << 40)) os << ">= " << lo;
  else os << "in [" << lo << ", " << hi << "]";
  return os.str();
}
template <typename I>
Key int_key(const std::string& name, I& v, int64_t lo, int64_t hi, std::string doc, std::string more = "") {
  return {name, [&v, lo, hi](auto& n, auto& l) { v = static_cast<I>(as_int(n, l, lo, hi)); }, value_of(v),
          std::move(doc), range_text(static_cast<double>(lo), static_cast<double>(hi), "an integer"), std::move(more)};
}
Key double_key(const std::string& name, double& v, double lo, double hi, std::string doc, std::string more = "") {
  return {name, [&v, lo, hi](auto& n, auto& l) { v = as_double(n, l, lo, hi); }, value_of(v), std::move(doc),
          range_text(lo, hi, "a number"), std::move(more)};
}
Key bool_key(const std::string& name, bool& v, std::string doc, std::string more = "") {
  return {name, [&v](auto& n, auto& l) { v = as_bool(n, l); }, value_of(v), std::move(doc), "true or false",
          std::move(more)};
}
Key text_key(const std::string& name, std::string& v, std::string allowed, std::string doc, std::string more = "") {
  return {name, [&v](auto& n, auto& l) { v = scalar(n, l); }, value_of(v), std::move(doc), std::move(allowed),
          std::move(more)};
}
Key choice_key(const std::string& name, std::string& v, std::vector<std::string> allowed, std::string doc,
               std::string more = "") {
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : " | ") + a;
  return {name, [&v, allowed](auto& n, auto& l) { v = one_of(n, l, allowed); }, value_of(v), std::move(doc), list,
          std::move(more)};
}

// Every key of every section, bound to `c`, with its documentation. Long because it is a table
// (one entry per key, ~85 keys), not logic: adding a key is adding one entry here, and
// docs/configuration.md is regenerated from it (`replica config --markdown`).
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
       {choice_key("arch", m.arch, models::resnet_archs(),
                   "the network: CIFAR-style resnet20..110 (3 stages), ImageNet-style resnet18/34/50/101/152 (v1.5), wide_resnet50_2/101_2, resnext50_32x4d, resnext101_32x8d", "training.md#models"),
        int_key("width", m.width, 0, 4096, "base width; 0: 16 for CIFAR-style, 64 for ImageNet-style"),
        bool_key("zero_init_residual", m.zero_init_residual, "start the last batch-norm gamma of each residual block at 0"),
        bool_key("freeze_bn", m.freeze_bn,
                 "batch norm normalises with its running statistics while training and never updates them (fine-tuning)"),
        text_key("init_from", m.init_from, "a .safetensors path",
                 "start from weights with PyTorch's names (torchvision, `replica export`); another class count re-initialises the classifier",
                 "weights.md"),
        {"checkpoint",
         [&](auto& n, auto& l) {
           std::string v = scalar(n, l);
           if (v == "none") m.checkpoint_every = 0;
           else if (v == "blocks") m.checkpoint_every = 1;
           else if (v.rfind("every:", 0) == 0) {
             YAML::Node num(v.substr(6));
             m.checkpoint_every = static_cast<int>(as_int(num, l, 1, 1000000));
           } else {
             fail(l, "'" + v + "' is not a checkpointing choice; use none, blocks or every:N");
           }
         },
         [&](YAML::Emitter& e) {
           e << (m.checkpoint_every == 0   ? std::string("none")
                 : m.checkpoint_every == 1 ? std::string("blocks")
                                           : "every:" + std::to_string(m.checkpoint_every));
           return true;
         },
         "gradient checkpointing: recompute activations in backward instead of keeping them",
         "none | blocks | every:N", "memory.md#memory-will-it-fit-and-where-did-it-go"}}},
      {"data",
       {choice_key("dataset", d.dataset, {"fashion-mnist", "mnist", "cifar10", "folder", "packed", "synthetic"},
                   "IDX (fashion-mnist, mnist), CIFAR-10 binary, class folders of JPEG/PNG, a `replica pack` file, or synthetic",
                   "data.md"),
        text_key("path", d.path, "a directory", "the directory holding the data set's files"),
        int_key("pad_crop", d.pad_crop, 0, 64, "augmentation: pad by N pixels and crop back at a random offset (in-memory data sets)"),
        bool_key("hflip", d.hflip, "augmentation: random horizontal flip"),
        {"mean",
         [&](auto& n, auto& l) {
           auto v = as_list(n, l, -inf, inf);
           d.mean.assign(v.begin(), v.end());
         },
         list_of(d.mean), "per-channel mean subtracted after scaling pixels to [0, 1]", "a list of numbers, one per channel", ""},
        {"std",
         [&](auto& n, auto& l) {
           auto v = as_list(n, l, 1e-12, inf);
           d.std.assign(v.begin(), v.end());
         },
         list_of(d.std), "per-channel standard deviation divided by after the mean", "a list of positive numbers, one per channel", ""},
        {"synthetic_shape",
         [&](auto& n, auto& l) {
           auto v = as_list(n, l, 1, 4096);
           if (v.size() != 3) fail(l, "expected [H, W, C]");
           d.synthetic_shape.assign(v.begin(), v.end());
         },
         list_of(d.synthetic_shape), "the synthetic data set's image shape", "[H, W, C], each in [1, 4096]", ""},
        int_key("synthetic_classes", d.synthetic_classes, 2, 1000000, "the synthetic data set's number of classes"),
        int_key("synthetic_size", d.synthetic_size, 1, int64_t(1) << 40, "the synthetic data set's number of samples"),
        int_key("prefetch", d.prefetch, 1, 64, "micro-batches prepared ahead per replica"),
        int_key("limit_train", d.limit_train, 0, int64_t(1) << 40, "use only the first N training samples (0: all)"),
        int_key("limit_test", d.limit_test, 0, int64_t(1) << 40, "use only the first N test samples (0: all)"),
        text_key("train_dir", d.train_dir, "a directory or .pack file",
                 "folder / packed: the training class folders or pack (empty: data.path/train, .pack for packed)", "data.md"),
        text_key("val_dir", d.val_dir, "a directory or .pack file",
                 "folder / packed: the validation class folders or pack (empty: data.path/val, .pack for packed)", "data.md"),
        int_key("image_size", d.image_size, 8, 4096, "folder / packed: training crops are resized to this side"),
        int_key("eval_resize", d.eval_resize, 0, 8192,
                "folder / packed: evaluation resizes the shorter side to this, then centre-crops (0: image_size / 0.875)"),
        {"crop_scale",
         [&](auto& n, auto& l) {
           auto v = as_list(n, l, 1e-6, 1);
           if (v.size() != 2 || v[0] > v[1]) fail(l, "expected [min, max] of the image's area, e.g. [0.08, 1]");
           d.crop_scale = v;
         },
         list_of(d.crop_scale), "RandomResizedCrop's range of the image's area (torchvision's default)", "[min, max] in (0, 1]", ""},
        {"crop_ratio",
         [&](auto& n, auto& l) {
           auto v = as_list(n, l, 1e-3, 1e3);
           if (v.size() != 2 || v[0] > v[1]) fail(l, "expected [min, max] width/height, e.g. [0.75, 1.3333]");
           d.crop_ratio = v;
         },
         list_of(d.crop_ratio), "RandomResizedCrop's range of aspect ratios, width / height", "[min, max] in [0.001, 1000]", ""},
        int_key("workers", d.workers, 0, 256,
                "decode threads per replica; 0: a GPU replica's share of the cores, or for image files the cores no CPU replica runs on"),
        bool_key("skip_bad_files", d.skip_bad_files,
                 "an unreadable image is a warning, replaced by the next readable one of its class; off: an error naming the file"),
        double_key("mixup_alpha", d.mixup_alpha, 0, 1e6,
                   "mixup: samples 2k and 2k+1 of a micro-batch blend with lambda ~ Beta(a, a), targets too (0: off)",
                   "training.md#mixup-and-cutmix"),
        double_key("cutmix_alpha", d.cutmix_alpha, 0, 1e6,
                   "cutmix: a box of sample 2k+1 pasted into 2k and back, area 1 - lambda, lambda ~ Beta(a, a) (0: off)",
                   "training.md#mixup-and-cutmix"),
        double_key("mix_prob", d.mix_prob, 0, 1, "the chance that a pair is mixed when mixup or cutmix is on"),
        double_key("mix_switch_prob", d.mix_switch_prob, 0, 1, "with both mixup and cutmix on, the chance a pair takes cutmix"),
        int_key("mix_off_epoch", d.mix_off_epoch, 0, int64_t(1) << 40,
                "epochs from this one on (counting from 0) train unmixed (0: mixing never stops)"),
        choice_key("augment", d.augment, {"none", "randaugment", "trivialaugment", "autoaugment"},
                   "torchvision's automatic augmentation of each training image: RandAugment, TrivialAugmentWide or "
                   "AutoAugment's ImageNet policy",
                   "data.md#augmentation-policies"),
        int_key("randaugment_ops", d.randaugment_ops, 1, 16, "RandAugment's N: ops applied to each image"),
        int_key("randaugment_magnitude", d.randaugment_magnitude, 0, 30, "RandAugment's M: the magnitude bin of 31"),
        double_key("random_erase", d.random_erase, 0, 1,
                   "the chance of erasing one random box of a normalised training image (torchvision's RandomErasing)",
                   "data.md#augmentation-policies")}},
      {"train",
       {double_key("epochs", t.epochs, 1e-6, 1e6, "passes over the training set (may be fractional)"),
        int_key("global_batch", t.global_batch, 1, int64_t(1) << 30, "samples per optimizer step over all replicas"),
        {"micro_batch",
         [&](auto& n, auto& l) { t.micro_batch = scalar(n, l) == "auto" ? -1 : as_int(n, l, 0, int64_t(1) << 30); },
         [&](YAML::Emitter& e) {
           e << (t.micro_batch < 0 ? std::string("auto") : std::to_string(t.micro_batch));
           return true;
         },
         "samples per replica and micro-step; global = micro x accumulation x replicas (0: no accumulation)",
         "0 | auto (the largest the pool holds) | an integer", "precision.md#gradient-accumulation"},
        choice_key("precision", t.precision, {"fp32", "fp16", "bf16"},
                   "16-bit activations and compute copies with f32 master weights, or fp32 throughout", "precision.md"),
        {"loss_scale",
         [&](auto& n, auto& l) {
           std::string v = scalar(n, l);
           if (v != "auto" && v != "dynamic" && v != "off") as_double(n, l, 1e-30, 1e30);  // a static scale
           t.loss_scale = v;
         },
         value_of(t.loss_scale), "the loss scale: auto is dynamic for fp16 and off for fp32 / bf16",
         "auto | dynamic | off | a number (a static scale)", "precision.md"},
        double_key("loss_scale_init", t.loss_scale_init, 1e-30, 1e30, "dynamic scaling: the first scale"),
        int_key("loss_scale_growth_interval", t.loss_scale_growth_interval, 1, int64_t(1) << 40,
                "dynamic scaling: x2 after this many good steps (x0.5 on an overflow)"),
        double_key("loss_scale_min", t.loss_scale_min, 1e-30, 1e30, "dynamic scaling: never below this scale"),
        int_key("loss_scale_hysteresis", t.loss_scale_hysteresis, 1, 1000,
                "overflows tolerated before backing off (DeepSpeed uses 2)"),
        int_key("loss_scale_max_floor_overflows", t.loss_scale_max_floor_overflows, 1, int64_t(1) << 40,
                "consecutive overflows at the minimum scale before the run stops with an error"),
        int_key("seed", t.seed, 0, INT64_MAX, "initialisation, shuffling and augmentation are pure functions of it"),
        int_key("log_every", t.log_every, 1, int64_t(1) << 40, "a step line (and a metrics record) every N steps"),
        int_key("max_steps", t.max_steps, 0, int64_t(1) << 40, "stop after this many steps (0: no limit)"),
        {"label_smoothing",
         [&](auto& n, auto& l) {
           const double e = as_double(n, l, -inf, inf);
           if (!(e >= 0 && e < 1)) fail(l, scalar(n, l) + " is not a label smoothing; use a number in [0, 1), e.g. 0.1");
           t.label_smoothing = e;
         },
         value_of(t.label_smoothing),
         "training loss against (1 - e) onehot + e / K (PyTorch's label_smoothing); evaluation's loss stays plain",
         "a number in [0, 1)", ""},
        {"ema_decay",
         [&](auto& n, auto& l) {
           const double d = as_double(n, l, -inf, inf);
           if (!(d == 0 || (d > 0 && d < 1)))
             fail(l, scalar(n, l) + " is not a moving-average decay; use a number in (0, 1), e.g. 0.9998, or 0 for none");
           t.ema_decay = d;
         },
         value_of(t.ema_decay),
         "keep a moving average of the weights (ema = decay ema + (1 - decay) w), evaluated beside them and saved as "
         "model_ema.bin; 0: none",
         "0, or a number in (0, 1)", "training.md#the-weights-moving-average-trainema_decay"},
        int_key("ema_every", t.ema_every, 1, int64_t(1) << 30, "applied steps between the moving average's updates",
                "training.md#the-weights-moving-average-trainema_decay"),
        double_key("ema_warmup_epochs", t.ema_warmup_epochs, 0, 1e6,
                   "the moving average is the model itself until then (torchvision: the lr warm-up)",
                   "training.md#the-weights-moving-average-trainema_decay"),
        text_key("run_dir", t.run_dir, "a directory", "where config.yaml, metrics, checkpoints and the model go",
                 "training.md"),
        bool_key("eval", t.eval, "evaluate on the test split after every epoch"),
        int_key("eval_batch", t.eval_batch, 1, int64_t(1) << 20, "samples per evaluation batch"),
        bool_key("tensorboard", t.tensorboard, "write TensorBoard event files to the run directory"),
        {"deterministic", [&](auto& n, auto& l) { t.deterministic = as_bool(n, l); }, optional_of(t.deterministic),
         "GPU runs repeat bit for bit (deterministic cuDNN algorithms); CPU runs always do",
         "true or false (unset: REPLICA_DETERMINISTIC, else false)", "gpu.md#deterministic-runs"},
        choice_key("cuda_graph", t.cuda_graph, {"off", "on", "auto"},
                   "GPU replicas: capture the whole step as one CUDA graph and replay it (auto: checked against an eager step first)",
                   "gpu.md#the-whole-step-as-one-cuda-graph-traincuda_graph")}},
      {"checkpoint",
       {int_key("every_steps", ck.every_steps, 0, int64_t(1) << 40, "a checkpoint every N steps (0: off)", "elastic.md"),
        int_key("every_epochs", ck.every_epochs, 0, int64_t(1) << 40, "a checkpoint every N epochs (0: off); always one at the end",
                "elastic.md"),
        int_key("keep_last", ck.keep_last, 0, 1000000, "the newest N checkpoints are kept (0: all)", "elastic.md"),
        text_key("dir", ck.dir, "a directory", "where checkpoints go (empty: RUN_DIR/checkpoints)", "elastic.md")}},
      {"optim",
       {choice_key("name", o.name, {"sgd", "adamw", "lars"},
                   "SGD (PyTorch's update), AdamW (torch.optim.AdamW's order) or LARS (large batches)"),
        double_key("beta1", o.beta1, 0, 0.999999, "AdamW's first-moment decay"),
        double_key("beta2", o.beta2, 0, 0.999999999, "AdamW's second-moment decay"),
        double_key("eps", o.eps, 0, 1, "AdamW's epsilon"),
        double_key("trust_coefficient", o.trust_coefficient, 1e-9, 1e3,
                   "LARS eta: each weight's step scaled by eta |w| / (|g| + wd |w|); BN parameters and biases get plain momentum"),
        double_key("clip_grad_norm", o.clip_grad_norm, 0, 1e12,
                   "clip by the global L2 norm of the averaged, unscaled gradients (0: off; skipped steps are not clipped)"),
        double_key("lr", o.lr, 1e-12, 1e6, "the peak learning rate"),
        double_key("momentum", o.momentum, 0, 0.999999, "SGD and LARS momentum"),
        bool_key("nesterov", o.nesterov, "SGD: Nesterov momentum"),
        double_key("weight_decay", o.weight_decay, 0, 1, "weight decay"),
        bool_key("decoupled_weight_decay", o.decoupled_weight_decay,
                 "SGDW (p -= lr wd p) instead of PyTorch SGD's decay added to the gradient"),
        bool_key("no_decay_bn_bias", o.no_decay_bn_bias, "no weight decay on batch-norm parameters and biases"),
        choice_key("schedule", o.schedule, {"constant", "step", "cosine", "poly"},
                   "the learning-rate schedule: step multiplies by gamma at each milestone, cosine and poly decay to min_lr"),
        double_key("poly_power", o.poly_power, 1e-6, 100,
                   "schedule poly: lr = min_lr + (lr - min_lr) (1 - t)^power, t from the warm-up's end to the last step"),
        double_key("warmup_epochs", o.warmup_epochs, 0, 1e6, "linear warm-up over this many epochs"),
        double_key("warmup_start_factor", o.warmup_start_factor, 0, 1, "the warm-up starts at this factor x lr"),
        {"milestones", [&](auto& n, auto& l) { o.milestones = as_list(n, l, 0, 1e6); }, list_of(o.milestones),
         "schedule step: the epochs at which the learning rate drops", "an increasing list of epochs", ""},
        double_key("gamma", o.gamma, 0, 1, "schedule step: the factor at each milestone"),
        double_key("min_lr", o.min_lr, 0, 1e6, "schedule cosine or poly: the learning rate at the end"),
        bool_key("scale_lr", o.scale_lr, "the linear scaling rule: lr x global_batch / 256")}},
      {"parallel",
       {text_key("devices", p.devices, "auto | cpu:N | cuda | cuda:0,1 | cuda:0-3 | cuda:0x2 | cuda:local",
                 "one replica per device (a GPU named twice: replicas sharing it); auto is every GPU, else 2 CPU replicas",
                 "parallel.md#choosing-devices"),
        bool_key("sync_bn", p.sync_bn, "batch statistics summed across replicas in forward and backward"),
        choice_key("grad_dtype", p.grad_dtype, {"fp32", "fp16", "bf16"},
                   "the gradient all-reduce's dtype (16-bit halves the bytes; 16-bit arithmetic at every addition, as NCCL)"),
        choice_key("shard", p.shard, {"none", "optimizer", "gradients"},
                   "ZeRO-1 (optimizer state and f32 masters) or ZeRO-2 (also gradients) split over the replicas; bit-identical to none",
                   "memory.md#sharded-optimizer-state-and-gradients-zero"),
        double_key("bucket_mb", p.bucket_mb, 0.001, 1e6, "gradient bucket size in MiB (PyTorch DDP's default)"),
        double_key("first_bucket_mb", p.first_bucket_mb, 0.001, 1e6, "the first (last layers') bucket in MiB"),
        int_key("check_every", p.check_every, 0, int64_t(1) << 40,
                "compare a parameter checksum across replicas every N steps; divergence is an error (0: off)"),
        double_key("timeout_s", p.timeout_s, 0.01, 1e6, "a collective waiting longer fails with an error naming the missing rank"),
        bool_key("pin_threads", p.pin_threads, "pin CPU replica i to core i"),
        int_key("intra_op_threads", p.intra_op_threads, 1, 1024,
                "threads each CPU replica's kernels may use (the same bits for any count)", "cpu.md#threads-and-kernels"),
        choice_key("on_replica_failure", p.on_replica_failure, {"stop", "shrink"},
                   "a lost replica stops the run with a checkpoint, or the survivors continue", "elastic.md"),
        int_key("min_replicas", p.min_replicas, 1, 1 << 20, "shrink: fewer survivors than this checkpoint and stop (exit 75)",
                "elastic.md"),
        text_key("preempt_file", p.preempt_file, "a path",
                 "polled every step; when it appears, checkpoint and exit 0 (spot notices)", "elastic.md")}},
      {"memory",
       {{"mode", [&](auto& n, auto& l) { mem.mode = one_of(n, l, {"preallocate", "growth", "platform"}); },
         optional_of(mem.mode), "each replica's pool: taken once, grown on demand, or exact on-demand allocation",
         "preallocate | growth | platform (unset: preallocate on GPUs, growth on CPU)", "memory.md#memory-pools"},
        {"fraction",
         [&](auto& n, auto& l) {
           double f = as_double(n, l, -inf, inf);
           if (!(f > 0 && f <= 1)) fail(l, scalar(n, l) + " is not a memory fraction; use a number in (0, 1], e.g. 0.75");
           mem.fraction = f;
         },
         optional_of(mem.fraction), "of the device's total memory: preallocated, or the growth limit",
         "a number in (0, 1] (unset: 0.75, or REPLICA_MEM_FRACTION)", "memory.md#memory-pools"},
        {"bytes", [&](auto& n, auto& l) { mem.bytes = parse_bytes(scalar(n, l), l.where()); }, optional_of(mem.bytes),
         "an absolute capacity, overriding the fraction", "a size such as 2GiB or 512MiB", "memory.md#memory-pools"},
        bool_key("step_plan", mem.step_plan,
                 "serve repeated steps from a packed plan of the second step's allocations (O(1); best-fit when a step differs)",
                 "memory.md#memory-pools")}},
      {"run",
       {double_key("cost_per_device_hour", c.run.cost_per_device_hour, 0, 1e9,
                   "the run report adds the run's cost (device-hours x this, any currency)", "run-report.md")}},
  };
}

// The order sections are written in (and shown in help): the order of a config file.
const char* const kSectionOrder[] = {"model", "data", "train", "checkpoint", "optim", "parallel", "memory", "run"};

std::vector<std::string> keys_of(const Section& s) {
  std::vector<std::string> k;
  for (auto& e : s) k.push_back(e.name);
  return k;
}

// The resolved configuration as YAML, every key from the schema (so a key added there is written
// back without a second edit).
std::string emit(const RunConfig& config) {
  RunConfig c = config;  // the schema binds to a mutable config; this copy is only read
  const auto sections = schema(c);
  YAML::Emitter e;
  e << YAML::BeginMap;
  for (const char* name : kSectionOrder) {
    e << YAML::Key << name << YAML::Value << YAML::BeginMap;
    for (const Key& k : sections.at(name)) {
      YAML::Emitter probe;  // an unset optional key is left out, name and all
      if (!k.get(probe)) continue;
      e << YAML::Key << k.name << YAML::Value;
      k.get(e);
    }
    e << YAML::EndMap;
  }
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace

std::vector<ConfigKeyDoc> config_reference() {
  RunConfig defaults;
  const auto sections = schema(defaults);
  std::vector<ConfigKeyDoc> out;
  for (const char* name : kSectionOrder)
    for (const Key& k : sections.at(name)) {
      YAML::Emitter e;
      std::string value = k.get(e) ? e.c_str() : "(unset)";
      if (value.empty() || value == "\"\"" || value == "~") value = "(empty)";
      out.push_back({std::string(name) + "." + k.name, value, k.allowed, k.doc, k.more});
    }
  return out;
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
  if (!root.IsMap()) throw ConfigError(source + ": expected sections (model, data, train, optim, parallel, memory, checkpoint, run)");
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
    if (!sch.count(sec)) throw ConfigError("--set " + s + ": unknown section '" + sec + "'" + did_you_mean(sec, sections));
    auto known = keys_of(sch[sec]);
    if (std::find(known.begin(), known.end(), key) == known.end())
      throw ConfigError("--set " + s + ": unknown key '" + sec + "." + key + "'" + did_you_mean(key, known));
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
      throw ConfigError(source + ":" + std::to_string(line) + ": unknown section '" + sec + "'" + did_you_mean(sec, sections) +
                        " (sections: model, data, train, optim, parallel, memory, checkpoint, run)");
    if (it->second.IsNull()) continue;
    if (!it->second.IsMap()) throw ConfigError(source + ":" + std::to_string(line) + ": " + sec + ": expected key: value pairs");
    auto& section = sch[sec];
    auto known = keys_of(section);
    for (auto kv = it->second.begin(); kv != it->second.end(); ++kv) {
      std::string key = key_text(kv->first, sec + ": ");
      Loc l{source, sec + "." + key, kv->first.Mark().line >= 0 ? kv->first.Mark().line + 1 : -1};
      auto f = std::find_if(section.begin(), section.end(), [&](auto& e) { return e.name == key; });
      if (f == section.end()) fail(l, "unknown key" + did_you_mean(key, known));
      f->set(kv->second, l);
    }
  }
  // cross-field checks
  if (c.optim.schedule == "step" && c.optim.milestones.empty())
    throw ConfigError(source + ": optim.schedule: step needs optim.milestones (epochs), e.g. [100, 150]");
  if (!std::is_sorted(c.optim.milestones.begin(), c.optim.milestones.end()))
    throw ConfigError(source + ": optim.milestones must be increasing");
  if ((c.data.dataset == "folder" || c.data.dataset == "packed") && c.data.pad_crop)
    throw ConfigError(source + ": data.pad_crop is for the in-memory data sets; a " + c.data.dataset +
                      " data set crops with data.crop_scale and data.crop_ratio (RandomResizedCrop)");
  if (!c.parallel.preempt_file.empty()) {
    // error_code forms: a name too long or otherwise unusable is this ConfigError, not a
    // filesystem_error from deep inside (the config fuzz target feeds arbitrary names here).
    std::error_code ec;
    const auto dir = std::filesystem::absolute(c.parallel.preempt_file, ec).parent_path();
    if (ec || !std::filesystem::is_directory(dir, ec))
      throw ConfigError(source + ": parallel.preempt_file: " + c.parallel.preempt_file + " is in " + dir.string() +
                        ", which is not a directory; the notice file must be able to appear there (create it, or "
                        "name a file in an existing directory)");
  }
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

bool resolve_deterministic(const TrainConfig& t) {
  if (t.deterministic) return *t.deterministic;
  return env_flag("REPLICA_DETERMINISTIC", kDeterministicByDefault);
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
