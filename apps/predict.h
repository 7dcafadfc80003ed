// `replica predict MODEL IMAGE|FOLDER...`: a trained model on a person's own image files. Each
// image goes through evaluation's decode and resize (class-folder models: the shorter side to
// data.eval_resize, then the centre crop; models of 28x28 or 32x32 data sets: the shorter side to
// the model's size, then the centre crop, so an image of that size is read as it is), in batches,
// on the GPU when there is one; prints the top-k classes with their names and probabilities, as a
// table or as JSON lines. A file that is not an image, or does not decode, is named and skipped
// (an error with --strict).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace replica::apps {

struct PredictOptions {
  std::string model;                // RUN_DIR/model.bin (or model_ema.bin)
  std::vector<std::string> inputs;  // image files and folders (searched recursively)
  std::string config;               // empty: RUN_DIR/config.yaml beside the model
  std::vector<std::string> sets;
  std::string classes;              // a file of class names, one per line; empty: RUN_DIR/classes.txt or the data set's
  std::string device = "auto";      // auto (cuda:0 when there is a GPU) | cpu | cuda:N
  int top = 5;
  int64_t batch = 64;
  bool json = false;
  bool strict = false;
};
int predict(const PredictOptions& o);

// The class names a model trained on `dataset` predicts, in label order, when no file names them
// (Fashion-MNIST's, MNIST's digits, CIFAR-10's); empty for other data sets.
std::vector<std::string> builtin_class_names(const std::string& dataset);

}  // namespace replica::apps
