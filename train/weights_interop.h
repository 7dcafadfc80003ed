// Weights in and out as safetensors with PyTorch's names and layouts, so a model trained here is
// read by PyTorch (and a torchvision checkpoint starts a run here).
//
// Names: torchvision's for resnet18/34/50/101/152, wide_resnet50_2/101_2, resnext50_32x4d/101_32x8d (conv1, bn1, layer1.0.conv1, ..., layerN.0.downsample.0,
// fc), and the conventional CIFAR ResNet names for resnet20/32/56/110 (the same, with the
// projection shortcut as layerN.0.shortcut.0 / .1, as in the widely used pytorch-cifar models).
// Every batch norm also has PyTorch's num_batches_tracked (int64). Layouts: convolution filters
// are KRSC here and OIHW in PyTorch; they are transposed on the way in and out.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "ops/nn/model.h"

namespace replica::train {

// The PyTorch name of one of the model's parameters or buffers.
std::string pytorch_name(const std::string& arch, const std::string& replica_name);

// The state_dict export_safetensors writes, name and PyTorch shape (OIHW filters; a scalar's is
// empty) per tensor, batch norms' num_batches_tracked included; the model need not be
// materialised.
std::vector<std::pair<std::string, std::vector<int64_t>>> pytorch_layout(nn::Model& model);

struct ExportOptions {
  std::string dtype = "F32";        // F32, F16 or BF16 for the floating-point tensors
  int64_t num_batches_tracked = 0;  // written for every batch norm
};
// The model's parameters and batch-norm statistics as safetensors bytes.
std::string export_safetensors(nn::Model& model, const ExportOptions& o = {});

struct ImportOptions {
  // A classifier (fc) of another shape is left as initialised instead of an error (fine-tuning on
  // another number of classes).
  bool allow_new_classifier = false;
};
struct ImportReport {
  int64_t tensors = 0;                // loaded
  std::vector<std::string> kept;      // left as initialised (the classifier, with allow_new_classifier)
  int64_t num_batches_tracked = 0;    // the file's (the first batch norm's)
  std::string dtype;                  // of the file's floating-point tensors (the first one's)
};
// Loads into a materialized model. A name the model lacks, a tensor the file lacks, a shape or
// dtype that does not fit: IoError naming `source` and the first few mismatches with both shapes.
ImportReport import_safetensors(nn::Model& model, std::string_view bytes, const std::string& source,
                                const ImportOptions& o = {});

}  // namespace replica::train
