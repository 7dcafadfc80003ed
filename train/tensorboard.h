// TensorBoardWriter: scalar summaries in TensorBoard's event-file format (TFRecord framing with
// masked CRC32C, Event/Summary protobufs encoded by hand), so `tensorboard --logdir RUN_DIR`
// shows replica's curves without any TensorFlow or protobuf dependency.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>

namespace replica::train {

uint32_t crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  // Creates RUN_DIR/events.out.tfevents.<unix time>.replica
  explicit TensorBoardWriter(const std::string& dir);
  void scalar(const std::string& tag, float value, int64_t step);
  void flush() { out_.flush(); }
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  std::ofstream out_;
};

}  // namespace replica::train
