// Grouped convolution on the CPU (ConvGeom::groups > 1), called by the backend's conv2d_* entry
// points: a direct NHWC kernel per output pixel, groups side by side (grouped_conv.cpp).
#pragma once
#include "core/memory_pool.h"
#include "core/tensor.h"
#include "ops/backend.h"

#ifndef REPLICA_CPU_ISA_NS
#error "included only by the per-level CPU kernels (ops/cpu/cpu_backend.h)"
#endif

namespace replica::ops::REPLICA_CPU_ISA_NS::grouped {

// y = x * w; x [N,H,W,C], w [K,R,S,C/groups], y [N,P,Q,K] (f32 or 16-bit).
void forward(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g, MemoryPool& ws);
// dx = the input gradient (overwritten).
void backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx, const ConvGeom& g, MemoryPool& ws);
// dw += the weight gradient.
void backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw, const ConvGeom& g, MemoryPool& ws);

}  // namespace replica::ops::REPLICA_CPU_ISA_NS::grouped
