// Test helpers for training steps driven by hand (train::ReplicaStep): a ResNet-20 small enough
// for a test (8x8 single-channel images, width 4) and a seeded random batch for it.
#pragma once
#include <cstdint>
#include <memory>
#include <random>

#include "core/memory_pool.h"
#include "core/tensor.h"
#include "ops/models/resnet.h"

namespace replica::testing {

inline std::unique_ptr<nn::Model> tiny_resnet() {
  return models::make_resnet({.arch = "resnet20", .height = 8, .width = 8, .base_width = 4});
}

// n images [n, 8, 8, 1] of normal noise and labels in [0, 10), the same for the same seed.
inline void random_batch(MemoryPool& pool, int64_t n, uint32_t seed, Tensor& x, Tensor& y) {
  x = Tensor::empty(pool, {n, 8, 8, 1}, DType::f32, MemTag::activations);
  y = Tensor::empty(pool, {n}, DType::i32, MemTag::activations);
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = d(rng);
  for (int64_t i = 0; i < n; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(rng() % 10);
}

}  // namespace replica::testing
