// Benchmarks behind `replica bench`. Timings belong here, never in tests.
#include "apps/bench.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/errors.h"
#include "parallel/mpi/mpi_communicator.h"
#include "parallel/replica_group.h"
#include "train/trainer.h"

namespace replica::apps {

using Clock = std::chrono::steady_clock;

size_t parse_size(const std::string& s) {
  size_t pos = 0;
  double v = std::stod(s, &pos);
  std::string u = s.substr(pos);
  double m = u.empty() ? 1 : u == "K" ? 1024.0 : u == "M" ? 1048576.0 : u == "G" ? 1073741824.0 : -1;
  if (m < 0) throw ConfigError("size '" + s + "': use a number with an optional K, M or G suffix");
  return static_cast<size_t>(v * m);
}

int bench_allreduce(const AllreduceBenchOptions& o) {
  auto devices = parse_devices(o.devices);
  const int R = static_cast<int>(devices.size());
  parallel::GroupOptions go;
  go.cpu_pool.bytes = o.max_bytes * 2 + (64 << 20);
  parallel::ReplicaGroup group(devices, go);
  const int W = group.world();  // all ranks, over all processes under mpirun
  const bool lead = group.lead_process();
  const std::string kind = group.processes() > 1 ? "MPI between " + std::to_string(group.processes()) +
                                                       " processes, shared memory inside each"
                                                 : "host communicator (shared memory)";
  if (lead) {
    std::printf("# replica bench allreduce: %d ranks (%s per process), %s, f32 sum\n", W, o.devices.c_str(),
                kind.c_str());
    std::printf("# busbw = algbw * 2(n-1)/n, as nccl-tests reports it\n");
    std::printf("#%12s %12s %10s %12s %12s %8s %14s\n", "size(B)", "count", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)", "#wrong", "memcpy(GB/s)");
  }
  double bus_sum = 0;
  int rows = 0;
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes;
       bytes = std::max(bytes + 4, static_cast<size_t>(static_cast<double>(bytes) * o.factor))) {
    const size_t count = std::max<size_t>(1, bytes / 4);
    std::vector<double> times(R);
    std::vector<int64_t> wrong(R);
    group.run([&](parallel::Replica& rep) {
      std::vector<float> buf(count);
      auto fill = [&] {
        for (size_t i = 0; i < count; ++i) buf[i] = static_cast<float>((i % 7) + rep.rank());  // global rank
      };
      for (int i = 0; i < o.warmup; ++i) rep.comm().all_reduce(buf.data(), count, DType::f32, parallel::ReduceOp::sum);
      rep.comm().barrier();
      auto t0 = Clock::now();
      for (int i = 0; i < o.iters; ++i) rep.comm().all_reduce(buf.data(), count, DType::f32, parallel::ReduceOp::sum);
      times[rep.rank()] = std::chrono::duration<double>(Clock::now() - t0).count() / o.iters;
      if (o.check) {  // correctness on a fresh buffer: sum over ranks of (i % 7 + r)
        fill();
        rep.comm().all_reduce(buf.data(), count, DType::f32, parallel::ReduceOp::sum);
        int64_t bad = 0;
        for (size_t i = 0; i < count; ++i)
          bad += buf[i] != static_cast<float>(W * (i % 7) + W * (W - 1) / 2);
        wrong[rep.rank()] = bad;
      }
    });
    double t = 0;
    int64_t bad = 0;
    for (int r = 0; r < R; ++r) t = std::max(t, times[r]), bad += wrong[r];
    double algbw = count * 4.0 / t / 1e9, busbw = algbw * 2.0 * (W - 1) / W;
    // memcpy bandwidth of the same size on this machine, for scale
    std::vector<char> a(count * 4, 1), b(count * 4);
    auto m0 = Clock::now();
    int mreps = 0;
    while (std::chrono::duration<double>(Clock::now() - m0).count() < 0.02 || mreps < 3) {
      std::memcpy(b.data(), a.data(), a.size());
      a[mreps % a.size()] = b[(mreps * 7) % b.size()];
      mreps++;
    }
    double mbw = a.size() * static_cast<double>(mreps) / std::chrono::duration<double>(Clock::now() - m0).count() / 1e9;
    if (lead) std::printf(" %12zu %12zu %10.1f %12.2f %12.2f %8ld %14.2f\n", count * 4, count, t * 1e6, algbw, busbw, (long)bad, mbw);
    bus_sum += busbw;
    rows++;
    if (bytes >= o.max_bytes) break;
  }
  if (lead) std::printf("# Avg bus bandwidth    : %.3f GB/s\n", bus_sum / std::max(rows, 1));
  return 0;
}

int bench_train(const TrainBenchOptions& o) {
  const bool lead = !parallel::launched_by_mpi() || parallel::mpi_process().rank == 0;
  if (lead) {
    std::printf("# replica bench train: img/s over %ld steps after %ld warm-up steps%s\n", (long)o.steps,
                (long)o.warmup, parallel::launched_by_mpi() ? " (replica counts are per process)" : "");
    std::printf("#%9s %12s %12s %12s %10s\n", "replicas", "global batch", "img/s", "vs first row", "efficiency");
  }
  double base = 0;
  int base_world = 1;
  for (int r : o.replicas) {
    auto sets = o.sets;
    sets.push_back("parallel.devices=cpu:" + std::to_string(r));
    sets.push_back("train.max_steps=" + std::to_string(o.steps + o.warmup));
    sets.push_back("train.eval=false");
    sets.push_back("train.run_dir=runs/bench-train");
    auto cfg = train::load_config(o.config, sets);
    std::vector<Clock::time_point> stamps;
    train::Trainer trainer(cfg, {.print = false, .on_step = [&](const train::StepStatus&) { stamps.push_back(Clock::now()); }});
    auto res = trainer.fit();
    if (!lead) continue;  // steps are reported on global rank 0 only
    if (static_cast<int64_t>(stamps.size()) <= o.warmup) throw Error("bench train: too few steps ran");
    const double dt = std::chrono::duration<double>(stamps.back() - stamps[o.warmup]).count();
    const double ips = static_cast<double>(stamps.size() - 1 - o.warmup) * cfg.train.global_batch / dt;
    (void)res;
    const int world = trainer.replicas();
    if (base == 0) {  // the first row is the baseline (1 replica by default)
      base = ips;
      base_world = world;
    }
    if (lead)
      std::printf(" %9d %12ld %12.1f %12.2fx %9.0f%%\n", world, (long)cfg.train.global_batch, ips, ips / base,
                  100.0 * (ips / world) / (base / base_world));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace replica::apps
