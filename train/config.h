// RunConfig: the YAML run configuration (sections model / data / train / optim / parallel /
// memory), `--set key=value` overrides, and validation. Unknown keys and bad values are
// ConfigErrors naming the file, line and key, with a suggestion for a misspelt key.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/units.h"  // parse_bytes for memory.bytes

namespace replica::train {

struct ModelConfig {
  std::string arch = "resnet20";
  int64_t width = 0;  // 0: the architecture's default
  bool zero_init_residual = false;
  bool freeze_bn = false;  // batch norm uses (and keeps) its running statistics while training
  int checkpoint_every = 0;  // model.checkpoint: none (0) | blocks (1) | every:N
  std::string init_from;     // safetensors with PyTorch's names (train/weights_interop.h); empty: random
};

struct DataConfig {
  std::string dataset = "fashion-mnist";  // fashion-mnist | mnist | cifar10 | folder | packed | synthetic
  std::string path = "/usr/share/datasets/fashion-mnist";
  int64_t pad_crop = 0;
  bool hflip = false;
  std::vector<float> mean{0.2860f}, std{0.3530f};
  std::vector<int64_t> synthetic_shape{28, 28, 1};  // H, W, C
  int64_t synthetic_classes = 10;
  int64_t synthetic_size = 60000;
  int prefetch = 2;
  int64_t limit_train = 0;  // use only the first N training samples (0 = all)
  int64_t limit_test = 0;
  // folder / packed (data/image_folder.h): train and val class folders, or their pack files
  std::string train_dir, val_dir;  // empty: data.path/train and data.path/val (.pack for packed)
  int64_t image_size = 224;
  int64_t eval_resize = 0;         // shorter side before the centre crop; 0: image_size / 0.875
  std::vector<double> crop_scale{0.08, 1.0}, crop_ratio{0.75, 4.0 / 3.0};
  int64_t workers = 0;             // decode threads per replica; 0: the cores no CPU replica runs on
  bool skip_bad_files = false;
  // mixup / cutmix in pairs of a micro-batch (data/mixing.h; timm's pair mode)
  double mixup_alpha = 0, cutmix_alpha = 0;  // Beta(a, a); 0: off
  double mix_prob = 1;                       // the chance a pair is mixed
  double mix_switch_prob = 0.5;              // with both on, the chance of cutmix
  int64_t mix_off_epoch = 0;                 // no mixing from this epoch on (0: never stops)
  // automatic augmentation (data/augment_policies.h)
  std::string augment = "none";              // none | randaugment | trivialaugment | autoaugment
  int64_t randaugment_ops = 2, randaugment_magnitude = 9;
  double random_erase = 0;                   // probability (torchvision's RandomErasing)
};

struct TrainConfig {
  double epochs = 3;
  int64_t global_batch = 128;
  int64_t micro_batch = 0;  // 0: global_batch / replicas (no accumulation); -1: auto (the planner picks)
  std::string precision = "fp32";    // fp32 | fp16 | bf16 (16-bit activations, f32 master weights)
  std::string loss_scale = "auto";   // auto (dynamic for fp16, off otherwise) | dynamic | off | a number (static)
  double loss_scale_init = 65536;
  int64_t loss_scale_growth_interval = 2000;
  double loss_scale_min = 1;
  int64_t loss_scale_hysteresis = 1;
  int64_t loss_scale_max_floor_overflows = 50;
  uint64_t seed = 0;
  int64_t log_every = 50;
  int64_t max_steps = 0;  // stop after this many steps (0 = no limit)
  double label_smoothing = 0;  // the target: (1 - e) onehot + e / K (PyTorch's label_smoothing)
  double ema_decay = 0;        // the weights' moving average (train/ema.h); 0: none
  int64_t ema_every = 1;       // applied steps between its updates
  double ema_warmup_epochs = 0;  // the average is the model itself until then
  std::string run_dir = "runs/default";
  bool eval = true;
  int64_t eval_batch = 500;
  bool tensorboard = true;  // event files in the run directory
  // Bit-identical GPU runs: only cuDNN algorithms whose numerics are deterministic, chosen by
  // cuDNN's fixed ranking instead of timing. Unset: REPLICA_DETERMINISTIC, else
  // kDeterministicByDefault (CPU runs are deterministic either way).
  std::optional<bool> deterministic;
  // One GPU: the whole step (the micro-steps' forward, loss and backward, the step's scalars and
  // the update) captured once as a CUDA graph and replayed (train/step_graph.h). off (default
  // until a GPU run has measured it) | on | auto (the first replay is checked against an eager
  // step from the same state; a difference turns graphs off, saying why).
  std::string cuda_graph = "off";
};

// train.deterministic when neither the config nor REPLICA_DETERMINISTIC says (docs/gpu-check.md, what it costs: why).
inline constexpr bool kDeterministicByDefault = false;
// The setting in force: train.deterministic, else REPLICA_DETERMINISTIC, else the default.
bool resolve_deterministic(const TrainConfig& t);

struct OptimConfig {
  std::string name = "sgd";  // sgd | adamw | lars
  double lr = 0.1;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adamw
  double trust_coefficient = 1e-3;                // lars
  double clip_grad_norm = 0;                      // 0: off
  double momentum = 0.9;
  bool nesterov = true;
  double weight_decay = 5e-4;
  bool decoupled_weight_decay = false;
  bool no_decay_bn_bias = false;
  std::string schedule = "cosine";  // constant | step | cosine | poly
  double poly_power = 2;            // poly: (1 - t)^power from the warm-up's end to the last step
  double warmup_epochs = 0;
  double warmup_start_factor = 0.04;
  std::vector<double> milestones;   // epochs, for schedule: step
  double gamma = 0.1;
  double min_lr = 0;
  bool scale_lr = false;  // linear scaling rule: lr * global_batch / 256
};

struct ParallelConfig {
  std::string devices = "auto";  // every GPU, else 2 CPU replicas
  bool sync_bn = false;
  std::string grad_dtype = "fp32";  // all-reduce dtype: fp32 | fp16 | bf16
  std::string shard = "none";       // none | optimizer (ZeRO-1) | gradients (ZeRO-2): parallel/shard_plan.h
  double bucket_mb = 25;
  double first_bucket_mb = 1;
  int64_t check_every = 100;
  double timeout_s = 300;
  bool pin_threads = true;
  int intra_op_threads = 1;  // threads each CPU replica's kernels may use
  // A lost replica (train/recovery.h): stop (the run ends with the error) or shrink (in one
  // process: continue on the survivors from the last completed step, keeping the global batch).
  std::string on_replica_failure = "stop";
  int64_t min_replicas = 1;  // shrink: fewer survivors than this checkpoint and stop
  std::string preempt_file;  // polled every step; when it appears: checkpoint, exit 0 (spot notices)
};

struct CheckpointConfig {
  int64_t every_steps = 0;   // 0: off
  int64_t every_epochs = 1;  // 0: off
  int keep_last = 3;         // 0: keep all
  std::string dir;           // empty: RUN_DIR/checkpoints
};

struct MemoryConfig {
  std::optional<std::string> mode;   // unset: the device kind's default, then REPLICA_* env
  std::optional<double> fraction;
  std::optional<uint64_t> bytes;
  bool step_plan = false;  // record step 2's allocations, serve later steps from a packed plan
};

// What the run report adds (train/run_report.h).
struct RunSection {
  double cost_per_device_hour = 0;  // in any currency; 0: the report shows device-hours only
};

struct RunConfig {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  OptimConfig optim;
  ParallelConfig parallel;
  MemoryConfig memory;
  CheckpointConfig checkpoint;
  RunSection run;
  std::string source;    // file name, or "built-in default"
  std::string resolved;  // the effective configuration as YAML (written to the run directory)
};

// The built-in default configuration (configs/default.yaml, compiled in).
const std::string& default_config_text();
// Parses `text` (named `source` in errors), applies `sets` ("section.key=value"), validates.
RunConfig parse_config(const std::string& text, const std::string& source,
                       const std::vector<std::string>& sets = {});
// Reads `path` (or the built-in default when empty) and parses it.
RunConfig load_config(const std::string& path, const std::vector<std::string>& sets = {});

// "; did you mean 'x'?" for the name of `known` within two edits of `name`, or "".
std::string did_you_mean(const std::string& name, const std::vector<std::string>& known);

// One key of the schema as `replica config` and docs/configuration.md show it.
struct ConfigKeyDoc {
  std::string key;           // section.key
  std::string default_value; // what an omitted key means, as YAML ("(unset)" for an optional one)
  std::string allowed;       // the values it takes
  std::string doc;           // one line
  std::string more;          // a docs/ page (and #section) with the long explanation, or empty
};
// Every key, in the order of a config file's sections (train/config.cpp's schema).
std::vector<ConfigKeyDoc> config_reference();
// train/config_reference.cpp: the reference as text for a terminal (every key, or those of one
// section), one key in full, and the Markdown page docs/configuration.md. An unknown key or
// section is a ConfigError with the nearest name.
std::string config_reference_text(const std::string& section = "");
std::string config_key_text(const std::string& key);
std::string config_reference_markdown();

}  // namespace replica::train
