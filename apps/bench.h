// `replica bench ...`: benchmarks run from the command line (allreduce, train).
#pragma once
#include <string>
#include <vector>

#include "core/dtype.h"

namespace replica::apps {

struct AllreduceBenchOptions {
  std::string devices = "cpu:2";
  size_t min_bytes = 8, max_bytes = size_t(128) << 20;
  double factor = 2;
  int iters = 20, warmup = 5;
  bool check = true;
  DType dtype = DType::f32;  // f32, f16 or bf16 (the check's sums are small integers: exact in all)
};
// nccl-tests-style table: size, count, time, algbw, busbw, errors; plus memcpy bandwidth.
int bench_allreduce(const AllreduceBenchOptions& o);

struct TrainBenchOptions {
  std::string config;               // empty: built-in default
  std::vector<std::string> sets;
  std::vector<int> replicas{1, 2};  // runs cpu:N (or cuda:0..N-1) for each
  std::string kind = "cpu";         // cpu or cuda
  int64_t steps = 30, warmup = 5;
};
// Training throughput for each replica count, and the scaling efficiency against 1 replica.
int bench_train(const TrainBenchOptions& o);

// Replays an allocation trace (CSV from `replica train --alloc-trace`) against each policy:
// best-fit preallocate (smallest capacity that completes it), growth, platform, and an offline
// lifetime-aware packing of the whole trace (what a step-planned allocator could reach);
// reports peak reserved / peak live and fragmentation over time.
int bench_alloc(const std::string& csv);

// The input pipeline alone: decode + augment images/s of the configuration's training set (a
// folder or packed data set), per worker count, no training.
struct DataBenchOptions {
  std::string config;
  std::vector<std::string> sets;
  std::vector<int> workers{1, 2};
  int64_t images = 2048;
};
int bench_data(const DataBenchOptions& o);

// The augmentation policies alone (data/augment_policies.h): images per second on one core for
// each policy and random erasing, on the configured data set's training crops. `dump` writes those
// images as a NumPy .npy (uint8 [N, H, W, C]) for bench/anchors/torch_augment.py to time
// torchvision's transforms on the same pixels.
struct AugmentBenchOptions {
  std::string config;
  std::vector<std::string> sets;
  int64_t images = 256;
  std::string dump;
};
int bench_augment(const AugmentBenchOptions& o);

// The memory-bound ops (batch norm, ReLU, add, casts, axpy) on ResNet-50's activation shapes: GB/s
// of the bytes each must move, beside a device copy of the same tensor (apps/bench_kernels.cpp).
struct KernelBenchOptions {
  std::string kind = "cpu";  // cpu | cuda
  std::string dtype = "bf16";
  int64_t batch = 0;  // 0: 256 on a GPU, 4 on CPU
};
int bench_kernels(const KernelBenchOptions& o);

// The host's time per op of a model's training pass, by kind of op (apps/bench_host.cpp): through a
// backend that computes nothing (replica's own share), the CUDA one (what issuing each op costs) or
// the CPU one.
struct HostBenchOptions {
  std::string kind = "null";  // null | cpu | cuda
  std::string dtype = "fp32";
  std::string arch = "resnet50";
  int64_t batch = 32;
  int passes = 50;
};
int bench_host(const HostBenchOptions& o);


}  // namespace replica::apps
