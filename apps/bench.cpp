// Benchmarks behind `replica bench`. Timings belong here, never in tests.
#include "apps/bench.h"

#include "data/loader.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/alloc_trace.h"
#include "core/lifetime_packing.h"
#include "core/errors.h"
#include "core/file_io.h"

#include <algorithm>
#include <unordered_map>
#include "parallel/mpi/mpi_communicator.h"
#include "parallel/replica_group.h"
#include "train/trainer.h"

namespace replica::apps {

using Clock = std::chrono::steady_clock;

namespace {

// memcpy bandwidth (GB/s) of a buffer of `bytes` on this machine, for scale: at least 20 ms.
double memcpy_gbps(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes);
  auto m0 = Clock::now();
  int mreps = 0;
  while (std::chrono::duration<double>(Clock::now() - m0).count() < 0.02 || mreps < 3) {
    std::memcpy(b.data(), a.data(), a.size());
    a[mreps % a.size()] = b[(mreps * 7) % b.size()];
    mreps++;
  }
  return a.size() * static_cast<double>(mreps) / std::chrono::duration<double>(Clock::now() - m0).count() / 1e9;
}

// One replica's share of one row: seconds per all-reduce of `count` elements, and (with
// o.check) how many elements of a fresh buffer's result differ from the sum over the W ranks.
void time_allreduce(parallel::Replica& rep, size_t count, int W, const AllreduceBenchOptions& o, double* seconds,
                    int64_t* wrong) {
  // The buffer lives on the replica's device (host memory or GPU memory alike).
  Tensor buf = Tensor::empty(rep.pool(), {static_cast<int64_t>(count)}, o.dtype, MemTag::comm);
  std::vector<float> host(count);
  std::vector<char> wire(count * dtype_size(o.dtype));  // host's values in the benchmark's dtype
  const Device cpu{DeviceKind::cpu, 0};
  auto fill = [&] {
    for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>((i % 7) + rep.rank());  // global rank
    convert(host.data(), DType::f32, wire.data(), o.dtype, count);
    copy_tensor(Tensor::wrap(wire.data(), buf.shape(), o.dtype, cpu), buf, &rep.stream());
    rep.stream().synchronize();
  };
  auto reduce = [&] { rep.comm().all_reduce(buf.raw(), count, o.dtype, parallel::ReduceOp::sum); };
  fill();
  for (int i = 0; i < o.warmup; ++i) reduce();
  rep.comm().barrier();
  auto t0 = Clock::now();
  for (int i = 0; i < o.iters; ++i) reduce();
  *seconds = std::chrono::duration<double>(Clock::now() - t0).count() / o.iters;
  if (!o.check) return;
  fill();  // correctness on a fresh buffer: sum over ranks of (i % 7 + r)
  reduce();
  copy_tensor(buf, Tensor::wrap(wire.data(), buf.shape(), o.dtype, cpu), &rep.stream());
  rep.stream().synchronize();
  convert(wire.data(), o.dtype, host.data(), DType::f32, count);
  int64_t bad = 0;
  for (size_t i = 0; i < count; ++i) bad += host[i] != static_cast<float>(W * (i % 7) + W * (W - 1) / 2);
  *wrong = bad;
}

}  // namespace

int bench_allreduce(const AllreduceBenchOptions& o) {
  auto devices = parse_devices(o.devices);
  const int R = static_cast<int>(devices.size());
  parallel::GroupOptions go;
  go.cpu_pool.bytes = o.max_bytes * 2 + (64 << 20);
  go.cuda_pool.mode = AllocatorMode::growth;  // take what the buffers need, not 75% of each GPU
  go.cuda_pool.bytes = o.max_bytes * 2 + (64 << 20);
  go.solo_single_gpu = false;  // measure NCCL itself, even with one GPU
  parallel::ReplicaGroup group(devices, go);
  const int W = group.world();  // all ranks, over all processes under mpirun
  const bool lead = group.lead_process();
  const std::string kind = group.replica(0).comm().name() == "nccl"
                               ? "NCCL"
                               : group.processes() > 1 ? "MPI between " + std::to_string(group.processes()) +
                                                             " processes, shared memory inside each"
                                                       : "host communicator (shared memory)";
  if (lead) {
    std::printf("# replica bench allreduce: %d ranks (%s per process), %s, %s sum\n", W, o.devices.c_str(),
                kind.c_str(), dtype_name(o.dtype));
    std::printf("# busbw = algbw * 2(n-1)/n, as nccl-tests reports it\n");
    std::printf("#%12s %12s %10s %12s %12s %8s %14s\n", "size(B)", "count", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)", "#wrong", "memcpy(GB/s)");
  }
  const size_t esize = dtype_size(o.dtype);
  double bus_sum = 0;
  int rows = 0;
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes;
       bytes = std::max(bytes + 4, static_cast<size_t>(static_cast<double>(bytes) * o.factor))) {
    const size_t count = std::max<size_t>(1, bytes / esize);
    std::vector<double> times(R);
    std::vector<int64_t> wrong(R);
    group.run([&](parallel::Replica& rep) {
      time_allreduce(rep, count, W, o, &times[rep.local_index()], &wrong[rep.local_index()]);
    });
    double t = 0;
    int64_t bad = 0;
    for (int r = 0; r < R; ++r) t = std::max(t, times[r]), bad += wrong[r];
    double algbw = count * static_cast<double>(esize) / t / 1e9, busbw = algbw * 2.0 * (W - 1) / W;
    const double mbw = memcpy_gbps(count * esize);
    if (lead) std::printf(" %12zu %12zu %10.1f %12.2f %12.2f %8ld %14.2f\n", count * esize, count, t * 1e6, algbw, busbw, (long)bad, mbw);
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
    std::printf("# replica bench train on %s: img/s over %ld steps after %ld warm-up steps%s\n", o.kind.c_str(),
                (long)o.steps, (long)o.warmup, parallel::launched_by_mpi() ? " (replica counts are per process)" : "");
    std::printf("#%9s %12s %12s %12s %10s\n", "replicas", "global batch", "img/s", "vs first row", "efficiency");
  }
  double base = 0;
  int base_world = 1;
  for (int r : o.replicas) {
    auto sets = o.sets;
    if (o.kind == "cuda") {
      std::string list = "cuda:";
      for (int i = 0; i < r; ++i) list += (i ? "," : "") + std::to_string(i);
      sets.push_back("parallel.devices=" + list);
    } else if (o.kind == "cpu") {
      sets.push_back("parallel.devices=cpu:" + std::to_string(r));
    } else {
      throw ConfigError("bench train --kind " + o.kind + ": expected cpu or cuda");
    }
    sets.push_back("train.max_steps=" + std::to_string(o.steps + o.warmup));
    sets.push_back("train.eval=false");
    sets.push_back("train.run_dir=runs/bench-train");
    sets.push_back("train.tensorboard=false");
    auto cfg = train::load_config(o.config, sets);
    std::vector<Clock::time_point> stamps;
    train::Trainer trainer(cfg, {.print = false, .on_step = [&](const train::StepStatus&) { stamps.push_back(Clock::now()); }});
    trainer.fit();
    if (!lead) continue;  // steps are reported on global rank 0 only
    if (static_cast<int64_t>(stamps.size()) <= o.warmup) throw Error("bench train: too few steps ran");
    const double dt = std::chrono::duration<double>(stamps.back() - stamps[o.warmup]).count();
    const double ips = static_cast<double>(stamps.size() - 1 - o.warmup) * cfg.train.global_batch / dt;
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

namespace replica::apps {

namespace {

struct Replay {
  bool ok = true;
  size_t peak_live = 0, peak_reserved = 0;
  double frag_mean = 0, frag_max = 0;
};

// Replays `ev` on a pool of the given mode and capacity over fake addresses.
Replay replay(const std::vector<AllocEvent>& ev, AllocatorMode mode, size_t capacity) {
  PoolOptions o;
  o.mode = mode;
  o.bytes = capacity;
  MemoryPool pool({DeviceKind::cpu, 0}, std::make_unique<SimulatedUpstream>(size_t(1) << 50), o);
  std::unordered_map<uint64_t, void*> live;
  Replay r;
  double frag_sum = 0;
  size_t samples = 0;
  for (size_t i = 0; i < ev.size(); ++i) {
    const auto& e = ev[i];
    if (e.alloc) {
      try {
        live[e.id] = pool.allocate(e.bytes, e.tag);
      } catch (const OutOfMemoryError&) {
        r.ok = false;
        return r;
      }
    } else {
      auto it = live.find(e.id);
      if (it == live.end()) continue;  // freed before the trace started
      pool.deallocate(it->second);
      live.erase(it);
    }
    if (i % 64 == 0) {
      auto s = pool.stats();
      frag_sum += s.fragmentation;
      r.frag_max = std::max(r.frag_max, s.fragmentation);
      samples++;
    }
  }
  auto s = pool.stats();
  r.peak_live = s.peak_in_use;
  r.peak_reserved = s.peak_reserved;
  r.frag_mean = samples ? frag_sum / samples : 0;
  return r;
}

// Offline lifetime-aware packing of the whole trace (core/lifetime_packing.h).
size_t pack_offline(const std::vector<AllocEvent>& ev, size_t& peak_live) {
  std::vector<LifetimeItem> items;
  std::unordered_map<uint64_t, size_t> open;
  size_t live = 0;
  peak_live = 0;
  for (size_t i = 0; i < ev.size(); ++i) {
    const size_t rounded = std::max<size_t>(256, (ev[i].bytes + 255) & ~size_t(255));
    if (ev[i].alloc) {
      open[ev[i].id] = items.size();
      items.push_back({rounded, i, ev.size()});
      live += rounded;
      peak_live = std::max(peak_live, live);
    } else if (auto it = open.find(ev[i].id); it != open.end()) {
      items[it->second].end = i;
      live -= items[it->second].size;
      open.erase(it);
    }
  }
  return pack_lifetimes(items);
}

}  // namespace

int bench_alloc(const std::string& csv) {
  auto ev = AllocTrace::read_csv(csv);
  size_t allocs = 0;
  for (auto& e : ev) allocs += e.alloc;
  Replay unlimited = replay(ev, AllocatorMode::growth, size_t(1) << 48);
  const size_t live = unlimited.peak_live;
  std::printf("# replica bench alloc --replay %s: %zu events, %zu allocations, peak live %s\n", csv.c_str(), ev.size(),
              allocs, format_bytes(live).c_str());
  std::printf("#%-34s %16s %22s %16s %14s\n", "policy", "min capacity", "peak reserved / live", "frag mean", "frag max");
  // best-fit preallocate: the smallest capacity (to 0.5%) that completes the trace
  size_t lo = live, hi = live * 4;
  while (!replay(ev, AllocatorMode::preallocate, hi).ok) hi *= 2;
  while (hi - lo > live / 200 + 256) {
    size_t mid = (lo + hi) / 2 & ~size_t(255);
    if (replay(ev, AllocatorMode::preallocate, mid).ok) hi = mid;
    else lo = mid;
  }
  Replay bf = replay(ev, AllocatorMode::preallocate, hi);
  std::printf(" %-34s %16s %21.3fx %16.3f %14.3f\n", "best-fit preallocate (at min cap.)", format_bytes(hi).c_str(),
              double(hi) / live, bf.frag_mean, bf.frag_max);
  std::printf(" %-34s %16s %21.3fx %16.3f %14.3f\n", "growth (regions doubling)", "-",
              double(unlimited.peak_reserved) / live, unlimited.frag_mean, unlimited.frag_max);
  Replay pf = replay(ev, AllocatorMode::platform, size_t(1) << 48);
  std::printf(" %-34s %16s %21.3fx %16s %14s\n", "platform (exact, slow)", format_bytes(pf.peak_reserved).c_str(),
              double(pf.peak_reserved) / live, "0", "0");
  size_t packed_live = 0;
  size_t arena = pack_offline(ev, packed_live);
  std::printf(" %-34s %16s %21.3fx %16s %14s\n", "lifetime-aware packing (offline)", format_bytes(arena).c_str(),
              double(arena) / live, "-", "-");
  return 0;
}

int bench_data(const DataBenchOptions& o) {
  const auto cfg = train::load_config(o.config, o.sets);
  const auto ds = train::make_dataset(cfg.data, "train");
  const Shape s = ds->sample_shape();
  const int64_t n = std::min<int64_t>(o.images, ds->size()), per = s.numel();
  std::printf("# replica bench data: %s, %ld images to %ldx%ldx%ld (decode + %s), %s\n", ds->name().c_str(), (long)n,
              (long)s[0], (long)s[1], (long)s[2], ds->own_augmentation() ? "random resized crop + flip" : "augment",
              cfg.data.dataset.c_str());
  std::printf("%8s %12s %14s\n", "workers", "images/s", "per worker");
  data::AugmentOptions aug{cfg.data.pad_crop, cfg.data.hflip, cfg.data.mean, cfg.data.std};
  aug.policy = {data::parse_augment_policy(cfg.data.augment), static_cast<int>(cfg.data.randaugment_ops),
                static_cast<int>(cfg.data.randaugment_magnitude), cfg.data.random_erase};
  double one = 0;
  for (int w : o.workers) {
    std::vector<std::thread> ts;
    const auto t0 = Clock::now();
    for (int t = 0; t < w; ++t)
      ts.emplace_back([&, t] {
        std::vector<float> out(static_cast<size_t>(per) * 32);
        std::vector<int32_t> labels(32);
        std::vector<int64_t> idx;
        for (int64_t i = t; i < n; i += w) {
          idx.push_back(i);
          if (idx.size() == 32 || i + w >= n) {
            data::load_samples(*ds, idx, aug, true, 1, 0, out.data(), labels.data());
            idx.clear();
          }
        }
      });
    for (auto& t : ts) t.join();
    const double ips = static_cast<double>(n) / std::chrono::duration<double>(Clock::now() - t0).count();
    if (w == o.workers.front()) one = ips / w;
    std::printf("%8d %12.1f %14.1f   (%.2fx the first row per worker)\n", w, ips, ips / w, ips / w / std::max(one, 1e-9));
  }
  return 0;
}

int bench_augment(const AugmentBenchOptions& o) {
  const auto cfg = train::load_config(o.config, o.sets);
  const auto ds = train::make_dataset(cfg.data, "train");
  const Shape s = ds->sample_shape();
  const int64_t H = s[0], W = s[1], C = s[2], per = s.numel();
  const int64_t n = std::min<int64_t>(o.images, ds->size());
  // The training crops (crop and flip, no policy, no normalising), as 8-bit pixels.
  data::AugmentOptions crop{cfg.data.pad_crop, cfg.data.hflip, {}, {}};
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = i;
  std::vector<float> images(static_cast<size_t>(n * per));
  std::vector<int32_t> labels(n);
  data::load_samples(*ds, idx, crop, true, 1, 0, images.data(), labels.data());
  for (auto& v : images) v = std::nearbyint(std::clamp(v, 0.f, 1.f) * 255.f) / 255.f;  // on the 8-bit grid
  if (!o.dump.empty()) {
    std::string header = "{'descr': '|u1', 'fortran_order': False, 'shape': (" + std::to_string(n) + ", " +
                         std::to_string(H) + ", " + std::to_string(W) + ", " + std::to_string(C) + "), }";
    header.resize(((header.size() + 11 + 63) / 64) * 64 - 11, ' ');
    header += '\n';
    std::string bytes = std::string("\x93NUMPY\x01\x00", 8);
    bytes += static_cast<char>(header.size() & 0xff);
    bytes += static_cast<char>(header.size() >> 8);
    bytes += header;
    for (float v : images) bytes += static_cast<char>(static_cast<uint8_t>(std::nearbyint(v * 255.f)));
    write_file_atomic(o.dump, bytes);
  }
  std::printf("# replica bench augment: %s, %ld training crops of %ldx%ldx%ld, one thread\n", ds->name().c_str(), (long)n,
              (long)H, (long)W, (long)C);
  std::printf("%-28s %12s\n", "policy", "images/s");
  struct Row {
    const char* name;
    data::PolicyOptions p;
  };
  const Row rows[] = {{"randaugment (2 ops, m 9)", {.policy = data::AugmentPolicy::randaugment}},
                      {"trivialaugment (wide)", {.policy = data::AugmentPolicy::trivialaugment}},
                      {"autoaugment (imagenet)", {.policy = data::AugmentPolicy::autoaugment}},
                      {"random_erase (p 1)", {.random_erase = 1.0}}};
  std::vector<float> x(static_cast<size_t>(per));
  for (const Row& r : rows) {
    const auto t0 = Clock::now();
    int64_t done = 0;
    while (done < n || std::chrono::duration<double>(Clock::now() - t0).count() < 1.0) {
      const int64_t i = done % n;
      std::copy_n(images.data() + i * per, per, x.data());
      if (r.p.random_erase > 0) data::random_erase(r.p, static_cast<uint64_t>(done), x.data(), H, W, C);
      else data::apply_policy(r.p, static_cast<uint64_t>(done), x.data(), H, W, C);
      ++done;
    }
    const double ips = static_cast<double>(done) / std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("%-28s %12.1f\n", r.name, ips);
  }
  return 0;
}

}  // namespace replica::apps
