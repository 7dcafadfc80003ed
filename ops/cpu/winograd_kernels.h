// Winograd F(m x m, 3x3) convolution kernels of one CPU kernel copy (ops/cpu/cpu_backend.h), m = 2
// or 4: 3x3, stride 1, padding 1, channels a multiple of 8, NHWC. Each m x m output tile costs
// (m + 2)^2 products per (input, output) channel pair instead of the direct kernel's 9 m^2 (2.25x
// fewer FMAs for m = 2, 4x for m = 4), paid for by input and output transforms (adds over
// 8-channel vectors) and, for m = 4, about ten times F(2x2)'s rounding error. direct_conv.h says when
// a layer takes this path and which m; these are the filter transforms and the loops over a chunk
// of images. Compiled with the copy's flags; the filter transforms are portable C++, while the
// baseline copy's forward and backward_filter throw (conv.cpp never calls them there).
#pragma once
#include <cstdint>

#ifndef REPLICA_CPU_ISA_NS
#error "included only by the per-level CPU kernels (ops/cpu/cpu_backend.h)"
#endif

namespace replica::ops::REPLICA_CPU_ISA_NS::winograd {

// Floats of a transformed filter: (m + 2)^2 x C_in x K_out.
int64_t transformed_floats(int64_t C, int64_t K, int m);

// The transformed filters, (m + 2)^2 x C_in x K_out floats (position p = (m + 2) i + j of the
// tile): G g G^T of each (input, output) channel pair, from a KRSC 3x3 filter of C input and K
// output channels. Forward: C_in = C, K_out = K. Backward data (the forward convolution of dy
// with the flipped filter): C_in = K, K_out = C. Small (once per call), but per call: written so
// the inner loops run over contiguous channels and vectorise with the copy's flags. tmp: 9 C K
// floats of scratch (a transposed copy; backward data needs none).
void filter_forward(const float* w_krsc, float* u, int64_t C, int64_t K, float* tmp, int m);
void filter_backward_data(const float* w_krsc, float* u, int64_t C, int64_t K, float* tmp, int m);
// dw (KRSC) += G^T du G, du the transformed-domain weight gradient ((m + 2)^2 x C x K); tmp: 9 C K floats.
void filter_gradient(const float* du, float* dw_krsc, int64_t C, int64_t K, float* tmp, int m);

// Floats of scratch one thread needs for C input and K output channels (the transformed input
// and products of one block of tiles).
int64_t scratch_floats(int64_t C, int64_t K, int m);

// y (N x H x W x K) = x (N x H x W x C, read with an implicit zero border of 1) convolved with
// the transformed filter u (filter_forward or filter_backward_data, the same m), overwritten. The
// same pass serves backward data (dy in, the flipped filter's transform).
void forward(const float* x, int64_t N, int64_t H, int64_t W, int64_t C, const float* u, int64_t K, float* y,
             float* scratch, int m);

// The weight gradient in the transformed domain: du ((m + 2)^2 x C x K) += over every tile of
// every image, the input's transform times the transposed output transform of dy (N x H x W x K).
// filter_gradient turns du into a KRSC gradient.
void backward_filter(const float* x, const float* dy, int64_t N, int64_t H, int64_t W, int64_t C, int64_t K,
                     float* du, float* scratch, int m);

}  // namespace replica::ops::REPLICA_CPU_ISA_NS::winograd
