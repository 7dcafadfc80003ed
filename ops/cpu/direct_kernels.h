// The direct NHWC convolution kernels of one CPU kernel copy (ops/cpu/cpu_backend.h): a
// register-blocked kernel (6 output pixels x 16 output channels in 12 AVX2 accumulators) over a
// zero-padded input image and block-packed filters (direct_conv.h says when they serve and packs
// the filters), and the weight gradient the same way (6 filter taps x 16 output channels). The
// avx512 copy uses 512-bit registers: 12 pixels (or taps) x 32 or 16 channels, the same FMAs per
// output element in the same order (the same bits as the AVX2 kernels).
// Compiled with the copy's flags so the blocks inline into the image loops (out of line, behind a
// target attribute, GCC 12 stored all 12 accumulators to the stack on every step: 2.2x slower);
// the avx2 and avx512 copies have them, the baseline copy's throw (conv.cpp never calls them there).
#pragma once
#include <cstdint>

#ifndef REPLICA_CPU_ISA_NS
#error "included only by the per-level CPU kernels (ops/cpu/cpu_backend.h)"
#endif

namespace replica::ops::REPLICA_CPU_ISA_NS::direct_kernels {

// One image: xpad (Hp x Wp x C, zero border), w (packed by direct::pack_forward or
// pack_backward_data), y (P x Q x K), overwritten.
void forward_image(const float* xpad, int64_t Wp, int64_t C, const float* w_rsck, int64_t K, int64_t R,
                   int64_t S, int64_t stride, int64_t P, int64_t Q, float* y);

// One image's weight gradient: dw (R x S x C x K) += sum over the P x Q output pixels of the
// input taps (xpad as for forward_image) times dy (P x Q x K).
void backward_filter_image(const float* xpad, int64_t Wp, int64_t C, const float* dy, int64_t K, int64_t R,
                           int64_t S, int64_t stride, int64_t P, int64_t Q, float* dw_rsck);

}  // namespace replica::ops::REPLICA_CPU_ISA_NS::direct_kernels
