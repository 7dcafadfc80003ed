// The `replica` command: train, eval, devices, bench. Errors print one clear line and exit 2
// (configuration) or 1 (anything else).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include <unistd.h>

#include "apps/bench.h"
#include "apps/build_info.h"
#include "core/cuda/runtime.h"
#include "core/device.h"
#include "core/errors.h"
#include "core/file_io.h"
#include "data/image_pack.h"
#include "core/log.h"
#include "core/memory_pool.h"
#include "core/pools.h"
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
    std::printf("  loaded: %s; %s; %s\n", cuda::runtime_versions().c_str(), ops::cuda_library_versions().c_str(),
                parallel::nccl_version().c_str());
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
  std::printf("%s on %s: test loss %.4f accuracy %.2f%% (%ld images)\n",
              (model_path.empty() ? checkpoint : model_path).c_str(), cfg.data.dataset.c_str(),
              r.loss, 100 * r.accuracy, (long)r.count);
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

}  // namespace

// main: the command-line table (every subcommand and option, read top to bottom like --help),
// then one dispatch to the cmd_* functions above. Long because it is that table, not logic.
int main(int argc, char** argv) {
  CLI::App app{"replica: data-parallel training of ResNets on CPU replicas and GPUs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", apps::version_report());
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "debug, info, warn, error or off");

  std::string config, devices, run_dir, model_path, resume, checkpoint, trace, alloc_trace;
  std::vector<std::string> sets;
  auto add_common = [&](CLI::App* c) {
    c->add_option("config", config, "YAML run configuration (default: the built-in configs/default.yaml)");
    c->add_option("--set", sets, "override a key: --set train.epochs=1 (repeatable)")->allow_extra_args(false);
    c->add_option("--devices", devices, "auto, cpu:N, cuda:0,1 (overrides parallel.devices)");
  };
  auto* train_cmd = app.add_subcommand("train", "train a model");
  add_common(train_cmd);
  train_cmd->add_option("--run-dir", run_dir, "where to write config, metrics and the model (train.run_dir)");
  train_cmd->add_option("--resume", resume, "continue from the newest valid checkpoint of RUN_DIR (or a .ckpt file)");
  train_cmd->add_option("--trace", trace, "write a Chrome-trace timeline (Perfetto) to this JSON file");
  train_cmd->add_option("--alloc-trace", alloc_trace, "write replica 0's allocations as CSV (for bench alloc --replay)");
  auto* eval_cmd = app.add_subcommand("eval", "evaluate a saved model on the test split");
  add_common(eval_cmd);
  eval_cmd->add_option("--model", model_path, "model file written by train (RUN_DIR/model.bin)");
  eval_cmd->add_option("--checkpoint", checkpoint, "a checkpoint file, or RUN_DIR for its newest checkpoint");
  std::string format = "safetensors", dtype = "fp32", st_path, out_path;
  auto* export_cmd = app.add_subcommand("export", "write a model's weights as safetensors with PyTorch's names");
  export_cmd->add_option("out", out_path, "the .safetensors file to write")->required();
  export_cmd->add_option("--model", model_path, "model file written by train (RUN_DIR/model.bin)")->required();
  export_cmd->add_option("--config", config, "the run's configuration (default: config.yaml beside the model)");
  export_cmd->add_option("--set", sets, "override a key (repeatable)");
  export_cmd->add_option("--format", format, "safetensors");
  export_cmd->add_option("--dtype", dtype, "fp32 (default), fp16 or bf16");
  auto* import_cmd = app.add_subcommand("import", "read PyTorch-named safetensors weights into a replica model file");
  import_cmd->add_option("in", st_path, "the .safetensors file (e.g. a torchvision state_dict)")->required();
  import_cmd->add_option("--out", out_path, "the model file to write (MODEL.bin)")->required();
  import_cmd->add_option("--config", config, "configuration that builds the model (default: the built-in)");
  import_cmd->add_option("--set", sets, "override a key (repeatable)");
  std::string pack_src, pack_out;
  bool pack_idx = false;
  data::PackOptions pack_opts;
  int pack_size = 0;
  int64_t pack_limit = 0;
  bool pack_png = false;
  auto* pack_cmd = app.add_subcommand("pack", "pack a class-folder image set into one memory-mapped file (data.dataset: packed)");
  pack_cmd->add_option("src", pack_src, "a class-folder tree (SPLIT/<class>/<image>), or with --idx an MNIST-layout directory");
  pack_cmd->add_option("out", pack_out, "the .pack file to write (with --idx: the folder to write train/ and val/ into)")->required();
  pack_cmd->add_option("--max-side", pack_opts.max_side, "resize so the shorter side is at most this (default 256)");
  pack_cmd->add_option("--quality", pack_opts.quality, "JPEG quality of the re-encoded images (default 90)");
  pack_cmd->add_option("--threads", pack_opts.threads, "encoding threads (default: every core)");
  pack_cmd->add_flag("--idx", pack_idx, "read IDX files (Fashion-MNIST, MNIST) from src and write a class-folder JPEG set");
  pack_cmd->add_option("--size", pack_size, "with --idx: resize the images to size x size RGB (default: as they are)");
  pack_cmd->add_option("--limit", pack_limit, "with --idx: only the first N images of each split (default: all)");
  pack_cmd->add_flag("--png", pack_png, "with --idx: lossless PNG files instead of JPEG");
  std::string report_dir;
  auto* report_cmd = app.add_subcommand("report", "a run's summary and a plot of loss, accuracy and lr (RUN_DIR/report.svg)");
  report_cmd->add_option("run_dir", report_dir, "the run directory (train.run_dir)")->required();
  auto* dev_cmd = app.add_subcommand("devices", "list devices and the memory pool each would take");
  add_common(dev_cmd);
  auto* plan_cmd = app.add_subcommand("memplan", "memory per replica by tag, whether it fits, the largest micro-batch");
  add_common(plan_cmd);

  auto* bench_cmd = app.add_subcommand("bench", "benchmarks");
  bench_cmd->require_subcommand(1);
  apps::AllreduceBenchOptions ar;
  std::string min_s = "8", max_s = "128M";
  auto* ar_cmd = bench_cmd->add_subcommand("allreduce", "all-reduce bandwidth, nccl-tests style");
  ar_cmd->add_option("--devices", ar.devices, "ranks, e.g. cpu:2");
  ar_cmd->add_option("-b,--minbytes", min_s, "smallest size (8, 1K, 1M)");
  ar_cmd->add_option("-e,--maxbytes", max_s, "largest size");
  ar_cmd->add_option("-f,--stepfactor", ar.factor, "size multiplier");
  ar_cmd->add_option("-n,--iters", ar.iters, "timed iterations per size");
  std::string ar_dtype = "f32";
  ar_cmd->add_option("-d,--dtype", ar_dtype, "f32 (default), f16 or bf16")
      ->check(CLI::IsMember({"f32", "fp32", "f16", "fp16", "bf16"}));
  apps::TrainBenchOptions tb;
  auto* tb_cmd = bench_cmd->add_subcommand("train", "training throughput for 1..N CPU or GPU replicas");
  tb_cmd->add_option("--kind", tb.kind, "cpu (default) or cuda: the replicas are cpu:N or cuda:0..N-1")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  tb_cmd->add_option("config", tb.config, "YAML run configuration (default: built-in)");
  tb_cmd->add_option("--set", tb.sets, "override a key (repeatable)");
  tb_cmd->add_option("--replicas", tb.replicas, "replica counts to run, e.g. --replicas 1 2");
  tb_cmd->add_option("--steps", tb.steps, "timed steps per run");
  tb_cmd->add_option("--warmup", tb.warmup, "untimed steps first");
  std::string replay;
  auto* alloc_cmd = bench_cmd->add_subcommand("alloc", "replay an allocation trace against each pool policy");
  alloc_cmd->add_option("--replay", replay, "CSV written by replica train --alloc-trace")->required();
  apps::DataBenchOptions db;
  auto* data_cmd = bench_cmd->add_subcommand("data", "images/s of the input pipeline alone (folder or packed data sets)");
  data_cmd->add_option("config", db.config, "YAML run configuration");
  data_cmd->add_option("--set", db.sets, "override a key (repeatable)");
  data_cmd->add_option("--workers", db.workers, "worker counts to run, e.g. --workers 1 2");
  data_cmd->add_option("--images", db.images, "images per run (default 2048)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    set_log_level(parse_log_level(log_level, "--log-level"));
    if (!devices.empty()) sets.push_back("parallel.devices=" + devices);
    if (!run_dir.empty()) sets.push_back("train.run_dir=" + run_dir);
    if (*train_cmd) {
      if (!resume.empty() && run_dir.empty()) {
        // Resuming writes into the run being resumed unless told otherwise.
        std::string dir = std::filesystem::is_regular_file(resume)
                              ? std::filesystem::path(resume).parent_path().parent_path().string()
                              : resume;
        sets.push_back("train.run_dir=" + dir);
      }
      auto cfg = train::load_config(config, sets);
      train::install_stop_signals();
      train::Trainer trainer(cfg, {.print = true, .on_step = nullptr, .resume = resume, .trace = trace, .alloc_trace = alloc_trace});
      auto r = trainer.fit();
      if (r.stopped_by_signal && trainer.group().lead_process()) {
        std::printf("replica: stopped by signal %d after step %ld; checkpoint %s\n"
                    "replica: resume with: replica train%s%s --resume %s\n",
                    train::stop_signal(), (long)r.steps, r.last_checkpoint.c_str(), config.empty() ? "" : " ",
                    config.c_str(), cfg.train.run_dir.c_str());
      }
      return 0;
    }
    if (*eval_cmd) return cmd_eval(config, sets, model_path, checkpoint);
    if (*pack_cmd) return cmd_pack(pack_src, pack_out, pack_idx, pack_size, pack_limit, pack_png, pack_opts);
    if (*data_cmd) return apps::bench_data(db);
    if (*report_cmd) {
      std::printf("%s", train::report_run_directory(report_dir).c_str());
      return 0;
    }
    if (*export_cmd) return cmd_export(config, sets, model_path, format, dtype, out_path);
    if (*import_cmd) return cmd_import(config, sets, st_path, out_path);
    if (*dev_cmd) return cmd_devices(config, sets);
    if (*plan_cmd) {
      auto cfg = train::load_config(config, sets);
      std::printf("%s", train::plan_memory(cfg).report().c_str());
      return 0;
    }
    if (*ar_cmd) {
      ar.min_bytes = parse_bytes(min_s, "--min");
      ar.max_bytes = parse_bytes(max_s, "--max");
      ar.dtype = parse_dtype(ar_dtype);
      return apps::bench_allreduce(ar);
    }
    if (*tb_cmd) return apps::bench_train(tb);
    if (*alloc_cmd) return apps::bench_alloc(replay);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "replica: error: %s\n", e.what());
    parallel::abort_mpi_job("configuration error", 2);  // under mpirun: stop every process now
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replica: error: %s\n", e.what());
    parallel::abort_mpi_job(e.what(), 1);
    return 1;
  }
  return 0;
}
