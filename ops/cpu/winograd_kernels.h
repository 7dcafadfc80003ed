// Winograd F(2x2, 3x3) convolution kernels of one CPU kernel copy (ops/cpu/cpu_backend.h): 3x3,
// stride 1, padding 1, channels a multiple of 8, NHWC. Each 2x2 output tile costs 16 products per
// (input, output) channel pair instead of the direct kernel's 36 (2.25x fewer FMAs), paid for by
// cheap input and output transforms (adds over 8-channel vectors). direct_conv.h says when a layer
// takes this path and transforms the filters (host code: small); these are the per-image loops.
// Compiled with the copy's flags; the baseline copy's entry points throw (conv.cpp never calls
// them there).
#pragma once
#include <cstdint>

#ifndef REPLICA_CPU_ISA_NS
#error "included only by the per-level CPU kernels (ops/cpu/cpu_backend.h)"
#endif

namespace replica::ops::REPLICA_CPU_ISA_NS::winograd {

// Floats of scratch one thread needs for C input and K output channels (the transformed input
// and products of one block of tiles).
int64_t scratch_floats(int64_t C, int64_t K);

// y (N x H x W x K) = x (N x H x W x C, read with an implicit zero border of 1) convolved with
// the transformed filter u (16 x C x K: direct::winograd_filter_*), overwritten. The same pass
// serves backward data (dy in, the flipped filter's transform).
void forward(const float* x, int64_t N, int64_t H, int64_t W, int64_t C, const float* u, int64_t K, float* y,
             float* scratch);

// The weight gradient in the transformed domain: du (16 x C x K) += over every tile of every
// image, the input's transform times the transposed output transform of dy (N x H x W x K).
// direct::winograd_filter_gradient turns du into a KRSC gradient.
void backward_filter(const float* x, const float* dy, int64_t N, int64_t H, int64_t W, int64_t C, int64_t K,
                     float* du, float* scratch);

}  // namespace replica::ops::REPLICA_CPU_ISA_NS::winograd
