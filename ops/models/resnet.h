// The ResNet family: CIFAR-style resnet20/32/56/110 (3 stages of basic blocks, width 16) and
// ImageNet-style resnet18/34 (basic) and resnet50/101/152, wide_resnet50_2/101_2 and
// resnext50_32x4d / resnext101_32x8d (bottleneck, stride on the 3x3: "v1.5"; the wide ones with
// twice the inner width, ResNeXt's 3x3 grouped), torchvision's layouts.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "ops/nn/model.h"

namespace replica::models {

struct ResNetConfig {
  std::string arch = "resnet20";
  int64_t in_channels = 1;
  int64_t num_classes = 10;
  int64_t height = 28, width = 28;
  int64_t base_width = 0;          // 0: the architecture's default (16 CIFAR, 64 ImageNet)
  bool zero_init_residual = false; // last BN gamma of each block starts at 0
  int checkpoint_every = 0;        // gradient checkpointing: 0 none, 1 every block, N every N-th
  // Each block's batch norm + add + ReLU as one pass (nn::Residual); REPLICA_FUSED_JOIN=0 turns it
  // off for a side-by-side measurement (in f32 on the CPU both give the same bits).
  bool fused_join = true;
};

std::vector<std::string> resnet_archs();
// Whether `arch` is an ImageNet-style model (7x7 stem and max pooling, torchvision's names).
bool imagenet_style(const std::string& arch);
// Throws ConfigError naming the architecture and the accepted ones.
std::unique_ptr<nn::Model> make_resnet(const ResNetConfig& cfg);

}  // namespace replica::models
