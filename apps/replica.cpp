// The `replica` command: train, eval, predict, export, import, report, pack, devices, memplan, bench, config. Errors
// print one clear line and exit 2 (a command line or configuration to fix) or 1 (anything else).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include <unistd.h>

#include "apps/bench.h"
#include "apps/predict.h"
#include "apps/build_info.h"
#include "apps/plan.h"
#include "core/cuda/runtime.h"
#include "core/device.h"
#include "core/errors.h"
#include "parallel/replica_group.h"
#include "core/file_io.h"
#include "data/image_pack.h"
#include "core/log.h"
#include "core/memory_pool.h"
#include "core/pools.h"
#include "ops/cpu/isa.h"
#include "ops/models/resnet.h"
#include "ops/cuda/cuda_backend.h"
#include "parallel/mpi/mpi_communicator.h"
#include "parallel/nccl/nccl_communicator.h"
#include "train/checkpoint.h"
#include "train/factory.h"
#include "train/memplan.h"
#include "train/model_io.h"
#include "train/run_report.h"
#include "train/signals.h"
#include "train/trainer.h"
#include "train/weights_interop.h"

using namespace replica;

namespace {

int cmd_devices(const std::string& config, const std::vector<std::string>& sets) {
  std::string why;
  auto gpus = cuda_devices(&why);
  std::printf("CUDA: %s\n", cuda_compiled() ? "built in" : "not built (-DREPLICA_CUDA=OFF or no nvcc)");
  if (cuda_compiled())
    std::printf("  loaded: %s; %s; %s\n  %s\n", cuda::runtime_versions().c_str(),
                ops::cuda_library_versions().c_str(), parallel::nccl_version().c_str(),
                parallel::nccl_sharing_report().c_str());
  if (gpus.empty()) std::printf("  no GPU: %s\n", why.c_str());
  for (auto& g : gpus) {
    PoolOptions o = default_pool_options(DeviceKind::cuda);
    const size_t take = pool_capacity(o, g.total_memory, g.device.str());
    std::printf("  %s  %s  cc %d.%d  %d SMs  memory %s total, %s free  %s  pool: %s %s%s\n", g.device.str().c_str(),
                g.name.c_str(), g.cc_major, g.cc_minor, g.multiprocessors, format_bytes(g.total_memory).c_str(),
                format_bytes(g.free_memory).c_str(), g.uuid.c_str(), allocator_mode_name(o.mode),
                format_bytes(take).c_str(), take > g.free_memory ? "  (more than is free now!)" : "");
  }
  auto cfg = train::load_config(config, sets);
  auto devices = parse_devices(cfg.parallel.devices);
  auto cpu = cpu_device_info(0);
  std::printf("CPU: %s, %d cores, %s memory (%s available)\n", cpu.name.c_str(), host_core_count(),
              format_bytes(cpu.total_memory).c_str(), format_bytes(cpu.free_memory).c_str());
  std::printf("  kernels: %s\n", ops::cpu_kernel_report().c_str());
  std::printf("This configuration (%s) uses %zu replica(s):\n", cfg.parallel.devices.c_str(), devices.size());
  for (auto& d : devices) {
    const PoolOptions o = train::pool_options(cfg.memory, d.kind);
    const size_t total = d.kind == DeviceKind::cpu ? host_physical_memory() : gpus.at(d.index).total_memory;
    const size_t cap = pool_capacity(o, total, d.str());
    std::printf("  %s: pool %s, %s %s\n", d.str().c_str(), allocator_mode_name(o.mode),
                o.mode == AllocatorMode::preallocate ? "takes" : "may grow to", format_bytes(cap).c_str());
  }
  return 0;
}

int cmd_eval(const std::string& config, const std::vector<std::string>& sets, const std::string& model_path,
             const std::string& checkpoint) {
  if (model_path.empty() == checkpoint.empty())
    throw ConfigError("eval: give exactly one of --model RUN_DIR/model.bin or --checkpoint FILE|RUN_DIR");
  std::string cfg_text_source = config;
  train::RunConfig cfg;
  if (!checkpoint.empty() && config.empty()) {
    // The checkpoint carries its own configuration.
    std::string file = checkpoint;
    if (!std::filesystem::is_regular_file(file)) {
      auto all = train::list_checkpoints(checkpoint + "/checkpoints");
      if (all.empty()) throw ConfigError("--checkpoint " + checkpoint + ": no checkpoints found");
      file = all.front();
    }
    cfg = train::parse_config(train::read_checkpoint(file).sections.at("config"), file + " (config section)", sets);
  } else {
    cfg = train::load_config(config, sets);
  }
  train::TrainerOptions to{.print = false, .on_step = nullptr, .resume = checkpoint};
  train::Trainer trainer(cfg, to);
  if (!model_path.empty())
    trainer.group().run([&](parallel::Replica& rep) { train::load_model(trainer.model(rep.local_index()), model_path); });
  auto r = trainer.evaluate();
  std::printf("%s on %s: test loss %.4f accuracy %.2f%% top-5 %.2f%% (%ld images)\n",
              (model_path.empty() ? checkpoint : model_path).c_str(), cfg.data.dataset.c_str(),
              r.loss, 100 * r.accuracy, 100 * r.top5, (long)r.count);
  return 0;
}

// A Trainer for `config` (or the run directory's config.yaml next to `model_path`) on one CPU
// replica, for the commands that only need the model it builds.
std::unique_ptr<train::Trainer> model_host(std::string config, std::vector<std::string> sets, const std::string& model_path) {
  if (config.empty() && !model_path.empty()) {
    const auto beside = std::filesystem::path(model_path).parent_path() / "config.yaml";
    if (std::filesystem::exists(beside)) config = beside.string();
  }
  sets.push_back("parallel.devices=cpu:1");  // one replica is enough to hold the weights
  auto cfg = train::load_config(config, sets);
  cfg.model.init_from.clear();
  return std::make_unique<train::Trainer>(cfg, train::TrainerOptions{.print = false, .on_step = nullptr});
}

std::string safetensors_dtype(const std::string& d) {
  if (d == "fp32") return "F32";
  if (d == "fp16") return "F16";
  if (d == "bf16") return "BF16";
  throw ConfigError("--dtype " + d + ": use fp32, fp16 or bf16");
}

int cmd_export(const std::string& config, const std::vector<std::string>& sets, const std::string& model_path,
               const std::string& format, const std::string& dtype, const std::string& out) {
  if (format != "safetensors") throw ConfigError("--format " + format + ": the format written is safetensors");
  if (model_path.empty()) throw ConfigError("export: give --model RUN_DIR/model.bin");
  const std::string st_dtype = safetensors_dtype(dtype);  // a bad --dtype is refused before any work
  auto t = model_host(config, sets, model_path);
  std::string bytes;
  t->group().run([&](parallel::Replica& rep) {
    auto& m = t->model(rep.local_index());
    train::load_model(m, model_path);
    bytes = train::export_safetensors(m, {.dtype = st_dtype});
  });
  write_file_atomic(out, bytes);
  std::printf("%s: %s with PyTorch's names (%s), %s\n", out.c_str(), t->model(0).name().c_str(), dtype.c_str(),
              format_bytes(bytes.size()).c_str());
  return 0;
}

int cmd_import(const std::string& config, const std::vector<std::string>& sets, const std::string& in,
               const std::string& out) {
  if (out.empty()) throw ConfigError("import: give --out MODEL.bin (where the replica model file goes)");
  auto t = model_host(config, sets, "");
  t->group().run([&](parallel::Replica& rep) {
    auto& m = t->model(rep.local_index());
    const auto r = train::import_safetensors(m, read_file(in, "safetensors file"), in);
    train::save_model(m, m.params(), m.buffers(), out);
    std::printf("%s: %ld tensors (%s) from %s into a %s\n", out.c_str(), static_cast<long>(r.tensors), r.dtype.c_str(),
                in.c_str(), m.name().c_str());
  });
  return 0;
}

// `replica pack`: a class-folder split into a .pack; or (--idx) an IDX data set into class folders.
int cmd_pack(const std::string& src, const std::string& out, bool from_idx, int size, int64_t limit, bool png,
             data::PackOptions o) {
  if (src.empty()) throw ConfigError("pack: give the source folder (or with --idx the MNIST-layout directory)");
  if (o.max_side < 8 || o.quality < 1 || o.quality > 100)
    throw ConfigError("pack: --max-side must be >= 8 and --quality in 1..100");
  if (o.threads <= 0) o.threads = host_core_count();
  if (from_idx) {
    for (const char* split : {"train", "test"}) {
      std::shared_ptr<const data::Dataset> ds = data::load_mnist_dir(src, split, "idx");
      if (limit > 0 && limit < ds->size()) ds = std::make_shared<data::SubsetDataset>(ds, limit);
      const std::string dir = out + (split == std::string("train") ? "/train" : "/val");
      data::write_image_folder(*ds, dir, size, o.quality, o.threads, png);
      std::printf("%s: %ld images in %ld class folders\n", dir.c_str(), (long)ds->size(), (long)ds->classes());
    }
    return 0;
  }
  data::ImageRecipe r;
  const data::FolderDataset ds(src, r, src);
  const bool tty = isatty(STDERR_FILENO);
  int last_pct = -1;
  o.progress = [&](int64_t done, int64_t total) {
    const int pct = static_cast<int>(100 * done / std::max<int64_t>(1, total));
    if (tty) std::fprintf(stderr, "\rpacking %ld/%ld images (%d%%)", (long)done, (long)total, pct);
    else if (pct / 10 != last_pct / 10) std::fprintf(stderr, "packing %ld/%ld images (%d%%)\n", (long)done, (long)total, pct);
    last_pct = pct;
  };
  const size_t bytes = data::pack_images(ds, out, o);
  if (tty) std::fprintf(stderr, "\n");
  std::printf("%s: %ld images of %ld classes, %s (shorter side <= %d, quality %d)\n", out.c_str(), (long)ds.size(),
              (long)ds.classes(), format_bytes(bytes).c_str(), o.max_side, o.quality);
  return 0;
}


// Every value the command line sets, and which subcommand it named.
struct Args {
  std::string log_level = "info";
  std::string config, devices, run_dir, model_path, resume, checkpoint, trace, alloc_trace;
  std::vector<std::string> sets;
  std::string format = "safetensors", dtype = "fp32", st_path, out_path;
  std::string pack_src, pack_out;
  bool pack_idx = false, pack_png = false;
  data::PackOptions pack_opts;
  int pack_size = 0;
  int64_t pack_limit = 0;
  std::string report_dir;
  std::string config_key;
  bool config_markdown = false;
  apps::AllreduceBenchOptions ar;
  std::string ar_min = "8", ar_max = "128M", ar_dtype = "f32";
  apps::TrainBenchOptions tb;
  std::string replay;
  apps::DataBenchOptions db;
  apps::AugmentBenchOptions ab;
  apps::KernelBenchOptions kb;
  apps::HostBenchOptions hb;
  apps::PlanArgs plan;
  apps::PredictOptions predict;
};

struct Commands {
  CLI::App *train, *eval, *predict, *devices, *memplan, *plan, *export_, *import, *report, *pack, *config;
  CLI::App *bench_allreduce, *bench_train, *bench_alloc, *bench_data, *bench_augment, *bench_kernels, *bench_host;
};

void add_config_options(CLI::App* c, Args& a) {
  c->add_option("config", a.config, "YAML run configuration (default: the built-in configs/default.yaml)");
  c->add_option("--set", a.sets, "override a key: --set train.epochs=1 (repeatable)")->allow_extra_args(false);
  c->add_option("--devices", a.devices, "auto, cpu:N, cuda:0,1 (overrides parallel.devices)");
}

// plan: the scaling and cost model (apps/plan.h). Its --devices are counts, not a device list.
void add_plan_command(CLI::App& app, Args& a, Commands& c) {
  auto& p = a.plan;
  c.plan = app.add_subcommand("plan", "predict step time, img/s, scaling, exposed all-reduce, memory and cost on N devices");
  c.plan->add_option("config", p.config, "YAML run configuration (default: the built-in configs/default.yaml)");
  c.plan->add_option("--set", p.sets, "override a key (repeatable)")->allow_extra_args(false);
  c.plan->add_option("--devices", p.devices, "device counts: N or NODESxPER_NODE, comma-separated (default 1,2,4,8)");
  c.plan->add_option("--link", p.links, "intra-node link, one line each: pcie3|pcie4|pcie5|nvlink1..4|ib-*|eth*")
      ->delimiter(',');
  c.plan->add_option("--inter-link", p.inter_link, "across nodes: ib-edr|ib-hdr|ib-ndr|eth10|eth25|eth50|eth100|eth400");
  c.plan->add_option("--nics", p.nics, "network ports per node (default 1; 8 on DGX-class nodes)");
  c.plan->add_option("--link-file", p.link_file, "replica bench allreduce output (fitted) or YAML {name, alpha_us, bandwidth_gbs}");
  c.plan->add_flag("--profile", p.profile, "measure the step profile on this configuration's device (the default)");
  c.plan->add_option("--device-profile", p.device_profile, "a profile saved elsewhere (--save-profile) instead of measuring");
  c.plan->add_option("--trace-profile", p.trace_profile, "the profile of a run: its replica train --trace FILE (same config)");
  c.plan->add_option("--save-profile", p.save_profile, "write the profile used (JSON) for planning on another machine");
  c.plan->add_option("--profile-steps", p.profile_steps, "measured steps per micro-batch (default 5)");
  c.plan->add_option("--device-images-per-s", p.device_images_per_s,
                     "rescale the profile: one device trains this many img/s at the profile's micro-batch");
  c.plan->add_option("--cores", p.cores, "CPU replicas: cores per node (default: this machine's)");
  c.plan->add_option("--data-images-per-s", p.data_images_per_s, "input pipeline rate per node (replica bench data)");
  c.plan->add_option("--epochs", p.epochs, "epochs for the time and cost columns (default train.epochs)");
  c.plan->add_option("--cost-per-device-hour", p.cost_per_device_hour, "price of one device for an hour");
  c.plan->add_flag("!--no-memory", p.memory, "skip memplan (faster)");
  c.plan->add_flag("--json", p.json, "one JSON object instead of the table");
}

// train, eval, devices, memplan: the commands that read a run configuration.
void add_run_commands(CLI::App& app, Args& a, Commands& c) {
  c.train = app.add_subcommand("train", "train a model");
  add_config_options(c.train, a);
  c.train->add_option("--run-dir", a.run_dir, "where to write config, metrics and the model (train.run_dir)");
  c.train->add_option("--resume", a.resume, "continue from the newest valid checkpoint of RUN_DIR (or a .ckpt file)");
  c.train->add_option("--trace", a.trace, "write a Chrome-trace timeline (Perfetto) to this JSON file");
  c.train->add_option("--alloc-trace", a.alloc_trace, "write replica 0's allocations as CSV (for bench alloc --replay)");
  c.eval = app.add_subcommand("eval", "evaluate a saved model on the test split");
  add_config_options(c.eval, a);
  c.eval->add_option("--model", a.model_path, "model file written by train (RUN_DIR/model.bin)");
  c.eval->add_option("--checkpoint", a.checkpoint, "a checkpoint file, or RUN_DIR for its newest checkpoint");
  c.predict = app.add_subcommand("predict", "top-k classes of a trained model on image files or folders");
  c.predict->add_option("model", a.predict.model, "model file written by train (RUN_DIR/model.bin or model_ema.bin)")->required();
  c.predict->add_option("images", a.predict.inputs, "JPEG or PNG files, or folders searched recursively")->required();
  c.predict->add_option("--config", a.predict.config, "the run's configuration (default: config.yaml beside the model)");
  c.predict->add_option("--set", a.predict.sets, "override a key (repeatable)");
  c.predict->add_option("--classes", a.predict.classes, "class names, one per line in label order (default: the run's classes.txt)");
  c.predict->add_option("--device", a.predict.device, "auto (a GPU when there is one), cpu or cuda:N");
  c.predict->add_option("--top", a.predict.top, "classes per image (default 5)");
  c.predict->add_option("--batch", a.predict.batch, "images per forward pass (default 64)");
  c.predict->add_flag("--json", a.predict.json, "one JSON line per image instead of the table");
  c.predict->add_flag("--strict", a.predict.strict, "a file that is not a readable image is an error, not skipped");
  c.devices = app.add_subcommand("devices", "list devices and the memory pool each would take");
  add_config_options(c.devices, a);
  c.memplan = app.add_subcommand("memplan", "memory per replica by tag, whether it fits, the largest micro-batch");
  add_config_options(c.memplan, a);
  add_plan_command(app, a, c);
}

// export, import, report, pack: weights, run directories and data sets in and out.
void add_file_commands(CLI::App& app, Args& a, Commands& c) {
  c.export_ = app.add_subcommand("export", "write a model's weights as safetensors with PyTorch's names");
  c.export_->add_option("out", a.out_path, "the .safetensors file to write")->required();
  c.export_->add_option("--model", a.model_path, "model file written by train (RUN_DIR/model.bin)")->required();
  c.export_->add_option("--config", a.config, "the run's configuration (default: config.yaml beside the model)");
  c.export_->add_option("--set", a.sets, "override a key (repeatable)");
  c.export_->add_option("--format", a.format, "safetensors");
  c.export_->add_option("--dtype", a.dtype, "fp32 (default), fp16 or bf16");
  c.import = app.add_subcommand("import", "read PyTorch-named safetensors weights into a replica model file");
  c.import->add_option("in", a.st_path, "the .safetensors file (e.g. a torchvision state_dict)")->required();
  c.import->add_option("--out", a.out_path, "the model file to write (MODEL.bin)")->required();
  c.import->add_option("--config", a.config, "configuration that builds the model (default: the built-in)");
  c.import->add_option("--set", a.sets, "override a key (repeatable)");
  c.config = app.add_subcommand("config", "the configuration keys: defaults, values, what each does (docs/configuration.md)");
  c.config->add_option("key", a.config_key, "one key (train.epochs) or section (train) to explain; none: every key");
  c.config->add_flag("--markdown", a.config_markdown, "print docs/configuration.md (generated from the schema)");
  c.report = app.add_subcommand("report", "a run's summary and a plot of loss, accuracy and lr (RUN_DIR/report.svg)");
  c.report->add_option("run_dir", a.report_dir, "the run directory (train.run_dir)")->required();
  c.pack = app.add_subcommand("pack", "pack a class-folder image set into one memory-mapped file (data.dataset: packed)");
  c.pack->add_option("src", a.pack_src, "a class-folder tree (SPLIT/<class>/<image>), or with --idx an MNIST-layout directory");
  c.pack->add_option("out", a.pack_out, "the .pack file to write (with --idx: the folder to write train/ and val/ into)")->required();
  c.pack->add_option("--max-side", a.pack_opts.max_side, "resize so the shorter side is at most this (default 256)");
  c.pack->add_option("--quality", a.pack_opts.quality, "JPEG quality of the re-encoded images (default 90)");
  c.pack->add_option("--threads", a.pack_opts.threads, "encoding threads (default: every core)");
  c.pack->add_flag("--idx", a.pack_idx, "read IDX files (Fashion-MNIST, MNIST) from src and write a class-folder JPEG set");
  c.pack->add_option("--size", a.pack_size, "with --idx: resize the images to size x size RGB (default: as they are)");
  c.pack->add_option("--limit", a.pack_limit, "with --idx: only the first N images of each split (default: all)");
  c.pack->add_flag("--png", a.pack_png, "with --idx: lossless PNG files instead of JPEG");
}

void add_bench_commands(CLI::App& app, Args& a, Commands& c) {
  auto* bench = app.add_subcommand("bench", "benchmarks");
  bench->require_subcommand(1);
  c.bench_allreduce = bench->add_subcommand("allreduce", "all-reduce bandwidth, nccl-tests style");
  c.bench_allreduce->add_option("--devices", a.ar.devices, "ranks, e.g. cpu:2");
  c.bench_allreduce->add_option("-b,--minbytes", a.ar_min, "smallest size (8, 1K, 1M)");
  c.bench_allreduce->add_option("-e,--maxbytes", a.ar_max, "largest size");
  c.bench_allreduce->add_option("-f,--stepfactor", a.ar.factor, "size multiplier");
  c.bench_allreduce->add_option("-n,--iters", a.ar.iters, "timed iterations per size");
  c.bench_allreduce->add_option("-d,--dtype", a.ar_dtype, "f32 (default), f16 or bf16")
      ->check(CLI::IsMember({"f32", "fp32", "f16", "fp16", "bf16"}));
  c.bench_train = bench->add_subcommand("train", "training throughput for 1..N CPU or GPU replicas");
  c.bench_train->add_option("--kind", a.tb.kind, "cpu (default) or cuda: the replicas are cpu:N or cuda:0..N-1")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  c.bench_train->add_option("config", a.tb.config, "YAML run configuration (default: built-in)");
  c.bench_train->add_option("--set", a.tb.sets, "override a key (repeatable)");
  c.bench_train->add_option("--replicas", a.tb.replicas, "replica counts to run, e.g. --replicas 1 2");
  c.bench_train->add_option("--steps", a.tb.steps, "timed steps per run");
  c.bench_train->add_option("--warmup", a.tb.warmup, "untimed steps first");
  c.bench_alloc = bench->add_subcommand("alloc", "replay an allocation trace against each pool policy");
  c.bench_alloc->add_option("--replay", a.replay, "CSV written by replica train --alloc-trace")->required();
  c.bench_data = bench->add_subcommand("data", "images/s of the input pipeline alone (folder or packed data sets)");
  c.bench_data->add_option("config", a.db.config, "YAML run configuration");
  c.bench_data->add_option("--set", a.db.sets, "override a key (repeatable)");
  c.bench_data->add_option("--workers", a.db.workers, "worker counts to run, e.g. --workers 1 2");
  c.bench_data->add_option("--images", a.db.images, "images per run (default 2048)");
  c.bench_augment = bench->add_subcommand("augment", "images/s of each augmentation policy alone, on one core");
  c.bench_augment->add_option("config", a.ab.config, "YAML run configuration (its data set's training crops)");
  c.bench_augment->add_option("--set", a.ab.sets, "override a key (repeatable)");
  c.bench_augment->add_option("--images", a.ab.images, "distinct images (default 256)");
  c.bench_augment->add_option("--dump", a.ab.dump, "write the images as .npy for bench/anchors/torch_augment.py");
  c.bench_kernels = bench->add_subcommand("kernels", "GB/s of the memory-bound ops beside a device copy of the same bytes");
  c.bench_kernels->add_option("--kind", a.kb.kind, "cpu (default) or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  c.bench_kernels->add_option("--dtype", a.kb.dtype, "storage dtype: bf16 (default), fp16 or fp32")
      ->check(CLI::IsMember({"f32", "fp32", "f16", "fp16", "bf16"}));
  c.bench_kernels->add_option("--batch", a.kb.batch, "images per tensor (default 256 on a GPU, 4 on CPU)");
  c.bench_host = bench->add_subcommand("host", "the host's time per op of a training pass, by kind of op");
  c.bench_host->add_option("--kind", a.hb.kind, "null (default: replica's own share; ops compute nothing), cuda or cpu")
      ->check(CLI::IsMember({"null", "cpu", "cuda"}));
  c.bench_host->add_option("--dtype", a.hb.dtype, "compute dtype: fp32 (default), fp16 or bf16")
      ->check(CLI::IsMember({"f32", "fp32", "f16", "fp16", "bf16"}));
  c.bench_host->add_option("--arch", a.hb.arch, "model (default resnet50)")->check(CLI::IsMember(models::resnet_archs()));
  c.bench_host->add_option("--batch", a.hb.batch, "images per pass (default 32)");
  c.bench_host->add_option("--passes", a.hb.passes, "timed passes (default 50)");
}

int cmd_train(Args& a) {
  if (!a.resume.empty() && a.run_dir.empty()) {
    // Resuming writes into the run being resumed unless told otherwise.
    std::string dir = std::filesystem::is_regular_file(a.resume)
                          ? std::filesystem::path(a.resume).parent_path().parent_path().string()
                          : a.resume;
    a.sets.push_back("train.run_dir=" + dir);
  }
  auto cfg = train::load_config(a.config, a.sets);
  train::install_stop_signals();
  train::Trainer trainer(cfg, {.print = true, .on_step = nullptr, .resume = a.resume, .trace = a.trace, .alloc_trace = a.alloc_trace});
  auto r = trainer.fit();
  if (r.stopped_by_signal && trainer.group().lead_process()) {
    std::printf("replica: stopped (%s) after step %ld; checkpoint %s\n"
                "replica: resume with: replica train%s%s --resume %s\n",
                r.stopped_by.c_str(), (long)r.steps, r.last_checkpoint.c_str(), a.config.empty() ? "" : " ",
                a.config.c_str(), cfg.train.run_dir.c_str());
  }
  return 0;
}

// Runs the subcommand the command line named.
int dispatch(const Commands& c, Args& a) {
  set_log_level(parse_log_level(a.log_level, "--log-level"));
  if (!a.devices.empty()) a.sets.push_back("parallel.devices=" + a.devices);
  if (!a.run_dir.empty()) a.sets.push_back("train.run_dir=" + a.run_dir);
  if (*c.train) return cmd_train(a);
  if (*c.eval) return cmd_eval(a.config, a.sets, a.model_path, a.checkpoint);
  if (*c.predict) return apps::predict(a.predict);
  if (*c.devices) return cmd_devices(a.config, a.sets);
  if (*c.memplan) {
    std::printf("%s", train::plan_memory(train::load_config(a.config, a.sets)).report().c_str());
    return 0;
  }
  if (*c.plan) return apps::run_plan(a.plan);
  if (*c.export_) return cmd_export(a.config, a.sets, a.model_path, a.format, a.dtype, a.out_path);
  if (*c.import) return cmd_import(a.config, a.sets, a.st_path, a.out_path);
  if (*c.config) {
    if (a.config_markdown) std::fputs(train::config_reference_markdown().c_str(), stdout);
    else if (a.config_key.empty()) std::fputs(train::config_reference_text().c_str(), stdout);
    else std::fputs(train::config_key_text(a.config_key).c_str(), stdout);
    return 0;
  }
  if (*c.report) {
    std::printf("%s", train::report_run_directory(a.report_dir).c_str());
    return 0;
  }
  if (*c.pack) return cmd_pack(a.pack_src, a.pack_out, a.pack_idx, a.pack_size, a.pack_limit, a.pack_png, a.pack_opts);
  if (*c.bench_allreduce) {
    a.ar.min_bytes = parse_bytes(a.ar_min, "--minbytes");
    a.ar.max_bytes = parse_bytes(a.ar_max, "--maxbytes");
    a.ar.dtype = parse_dtype(a.ar_dtype);
    return apps::bench_allreduce(a.ar);
  }
  if (*c.bench_train) return apps::bench_train(a.tb);
  if (*c.bench_alloc) return apps::bench_alloc(a.replay);
  if (*c.bench_data) return apps::bench_data(a.db);
  if (*c.bench_augment) return apps::bench_augment(a.ab);
  if (*c.bench_kernels) return apps::bench_kernels(a.kb);
  if (*c.bench_host) return apps::bench_host(a.hb);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"replica: data-parallel training of ResNets on CPU replicas and GPUs"};
  app.require_subcommand(1);
  // Built when asked for, not at every start (it reads the libraries' versions and the CPU cache).
  app.set_version_flag("--version", [] { return apps::version_report(); });
  Args a;
  Commands c{};
  app.add_option("--log-level", a.log_level, "debug, info, warn, error or off");
  add_run_commands(app, a, c);
  add_file_commands(app, a, c);
  add_bench_commands(app, a, c);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with code 0; a command line that does not parse is a
    // usage error, exit 2 like a bad configuration (CLI11's own codes start at 105).
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "replica: error: %s\nreplica: 'replica --help' lists the commands, 'replica COMMAND --help' their options\n",
                 e.what());
    return 2;
  }
  try {
    // The CPU kernel copy is chosen before any work, so an unusable REPLICA_CPU_ISA is reported
    // at once rather than after the data is read.
    if (!*c.devices) ops::cpu_kernel_variant();
    return dispatch(c, a);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "replica: error: %s\n", e.what());
    parallel::abort_mpi_job("configuration error", 2);  // under mpirun: stop every process now
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replica: error: %s\n", e.what());
    // A lost peer or a collective that timed out: restartable on the machines that are left.
    const auto* re = dynamic_cast<const parallel::ReplicaError*>(&e);
    const bool lost_peer = dynamic_cast<const CommError*>(&e) || (re && re->cause_as<CommError>());
    // Too few replicas left after a shrink: a restart with the device back (or a lower minimum) helps.
    const bool too_few = dynamic_cast<const RestartableError*>(&e) || (re && re->cause_as<RestartableError>());
    const int code = lost_peer || too_few ? parallel::kExitRestartable : 1;
    if (lost_peer) std::fprintf(stderr, "replica: exit %d: restartable (resume with --resume on the devices left)\n", code);
    if (too_few) std::fprintf(stderr, "replica: exit %d: restartable (resume with --resume as the error says)\n", code);
    parallel::abort_mpi_job(e.what(), code);
    return code;
  }
}
