// ResNet builders. Shortcuts are identity when shapes match, else 1x1 conv + BN ("option B",
// as torchvision and the PyTorch anchor in ../shared/anchors/torch_resnet.py). Every BN that a
// ReLU follows carries it fused (one pass fewer over those activations, forward and backward);
// a block's join (its last batch norm, the add and the ReLU) is one pass too (nn::Residual).
#include "ops/models/resnet.h"

#include "core/env.h"
#include "core/errors.h"

namespace replica::models {

using nn::BatchNorm2d;
using nn::Conv2d;
using nn::Sequential;

namespace {
// The one list of architectures: the config's accepted values and the builder read it.
struct ArchSpec {
  const char* name;
  int64_t cifar_blocks;         // blocks per stage of a CIFAR ResNet (6n+2 layers); 0: ImageNet
  std::vector<int64_t> blocks;  // ImageNet ResNet: blocks per stage
  bool bottleneck;
  // torchvision's Bottleneck: inner width = stage width x width_per_group / 64 x groups, the 3x3
  // in `groups` groups (Wide ResNet: 128 per group; ResNeXt 32x4d: 32 groups of 4 per 64).
  int64_t groups = 1, width_per_group = 64;
};
const std::vector<ArchSpec>& arch_specs() {
  static const std::vector<ArchSpec> specs = {
      {"resnet20", 3, {}, false},           {"resnet32", 5, {}, false},
      {"resnet56", 9, {}, false},           {"resnet110", 18, {}, false},
      {"resnet18", 0, {2, 2, 2, 2}, false}, {"resnet34", 0, {3, 4, 6, 3}, false},
      {"resnet50", 0, {3, 4, 6, 3}, true},  {"resnet101", 0, {3, 4, 23, 3}, true},
      {"resnet152", 0, {3, 8, 36, 3}, true}, {"wide_resnet50_2", 0, {3, 4, 6, 3}, true, 1, 128},
      {"wide_resnet101_2", 0, {3, 4, 23, 3}, true, 1, 128}, {"resnext50_32x4d", 0, {3, 4, 6, 3}, true, 32, 4},
      {"resnext101_32x8d", 0, {3, 4, 23, 3}, true, 32, 8}};
  return specs;
}
}  // namespace

bool imagenet_style(const std::string& arch) {
  for (const auto& a : arch_specs())
    if (arch == a.name) return a.cifar_blocks == 0;
  return false;
}

std::vector<std::string> resnet_archs() {
  std::vector<std::string> names;
  for (const auto& a : arch_specs()) names.push_back(a.name);
  return names;
}

namespace {

std::unique_ptr<Sequential> projection(const std::string& name, int64_t cin, int64_t cout, int64_t stride) {
  if (stride == 1 && cin == cout) return nullptr;
  auto sc = std::make_unique<Sequential>(name + ".shortcut");
  sc->emplace<Conv2d>(name + ".shortcut.0", cin, cout, 1, stride, 0);
  sc->emplace<BatchNorm2d>(name + ".shortcut.1", cout);
  return sc;
}

nn::LayerPtr basic_block(const std::string& name, int64_t cin, int64_t cout, int64_t stride, bool zero) {
  auto m = std::make_unique<Sequential>(name + ".main");
  m->emplace<Conv2d>(name + ".conv1", cin, cout, 3, stride, 1);
  m->emplace<BatchNorm2d>(name + ".bn1", cout, 0.1f, 1e-5f, false, /*relu=*/true);
  m->emplace<Conv2d>(name + ".conv2", cout, cout, 3, 1, 1);
  m->emplace<BatchNorm2d>(name + ".bn2", cout, 0.1f, 1e-5f, zero);
  return std::make_unique<nn::Residual>(name, std::move(m), projection(name, cin, cout, stride));
}

// torchvision's Bottleneck: 1x1 to `mid`, 3x3 (the stride, `groups` groups) at `mid`, 1x1 to `cout`.
nn::LayerPtr bottleneck(const std::string& name, int64_t cin, int64_t mid, int64_t cout, int64_t stride, int64_t groups,
                        bool zero) {
  auto m = std::make_unique<Sequential>(name + ".main");
  m->emplace<Conv2d>(name + ".conv1", cin, mid, 1, 1, 0);
  m->emplace<BatchNorm2d>(name + ".bn1", mid, 0.1f, 1e-5f, false, /*relu=*/true);
  m->emplace<Conv2d>(name + ".conv2", mid, mid, 3, stride, 1, groups);
  m->emplace<BatchNorm2d>(name + ".bn2", mid, 0.1f, 1e-5f, false, /*relu=*/true);
  m->emplace<Conv2d>(name + ".conv3", mid, cout, 1, 1, 0);
  m->emplace<BatchNorm2d>(name + ".bn3", cout, 0.1f, 1e-5f, zero);
  return std::make_unique<nn::Residual>(name, std::move(m), projection(name, cin, cout, stride));
}

}  // namespace

std::unique_ptr<nn::Model> make_resnet(const ResNetConfig& cfg) {
  auto root = std::make_unique<Sequential>("resnet");
  const bool zero = cfg.zero_init_residual;
  const ArchSpec* spec = nullptr;
  for (const auto& a : arch_specs())
    if (cfg.arch == a.name) spec = &a;
  if (!spec) {
    std::string list;
    for (auto& a : resnet_archs()) list += (list.empty() ? "" : ", ") + a;
    throw ConfigError("model.arch: '" + cfg.arch + "' is not a known model; use one of " + list);
  }
  const int64_t cifar_n = spec->cifar_blocks;
  if (cfg.in_channels < 1 || cfg.num_classes < 1)
    throw ConfigError("model: in_channels and num_classes must be >= 1");
  int64_t c;
  if (cifar_n) {
    const int64_t w = cfg.base_width ? cfg.base_width : 16;
    auto& stem = root->emplace<Conv2d>("stem.conv", cfg.in_channels, w, 3, 1, 1);
    stem.set_input_grad(false);
    root->emplace<BatchNorm2d>("stem.bn", w, 0.1f, 1e-5f, false, /*relu=*/true);
    c = w;
    int64_t widths[3] = {w, 2 * w, 4 * w};
    for (int s = 0; s < 3; ++s)
      for (int64_t b = 0; b < cifar_n; ++b) {
        int64_t stride = (b == 0 && s > 0) ? 2 : 1;
        root->add(basic_block("layer" + std::to_string(s + 1) + "." + std::to_string(b), c, widths[s], stride, zero));
        c = widths[s];
      }
  } else {
    const std::vector<int64_t>& blocks = spec->blocks;
    const bool bottle = spec->bottleneck;
    const int64_t w = cfg.base_width ? cfg.base_width : 64;
    auto& stem = root->emplace<Conv2d>("stem.conv", cfg.in_channels, w, 7, 2, 3);
    stem.set_input_grad(false);
    root->emplace<BatchNorm2d>("stem.bn", w, 0.1f, 1e-5f, false, /*relu=*/true);
    root->emplace<nn::MaxPool2d>("stem.pool", 3, 2, 1);
    c = w;
    for (int s = 0; s < 4; ++s) {
      const int64_t width = w << s;
      for (int64_t b = 0; b < blocks[s]; ++b) {
        int64_t stride = (b == 0 && s > 0) ? 2 : 1;
        std::string name = "layer" + std::to_string(s + 1) + "." + std::to_string(b);
        if (bottle) {
          const int64_t mid = width * spec->width_per_group / 64 * spec->groups;
          root->add(bottleneck(name, c, mid, width * 4, stride, spec->groups, zero));
          c = width * 4;
        } else {
          root->add(basic_block(name, c, width, stride, zero));
          c = width;
        }
      }
    }
  }
  const bool fused = cfg.fused_join && env_flag("REPLICA_FUSED_JOIN", true);
  for (size_t i = 0; i < root->size(); ++i)
    if (auto* block = dynamic_cast<nn::Residual*>(&root->at(i))) block->set_fused_join(fused);
  if (cfg.checkpoint_every > 0) {
    int index = 0;
    for (size_t i = 0; i < root->size(); ++i)
      if (auto* block = dynamic_cast<nn::Residual*>(&root->at(i)))
        block->set_recompute(index++ % cfg.checkpoint_every == 0);
  }
  root->emplace<nn::GlobalAvgPool>("pool");
  root->emplace<nn::Linear>("fc", c, cfg.num_classes);
  return std::make_unique<nn::Model>(cfg.arch, std::move(root),
                                     Shape{cfg.height, cfg.width, cfg.in_channels}, cfg.num_classes);
}

}  // namespace replica::models
