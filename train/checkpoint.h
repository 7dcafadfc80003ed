// Checkpoints: everything needed to resume a run exactly, in one file of named sections, each
// with its own checksum, written atomically (temporary file in the same directory, fsync,
// rename, fsync of the directory).
//
// Format (little-endian):  "RPLCKPT\0"  u32 version (1)  u32 section count
//   per section:  u32 name length, name,  u64 payload bytes,  u64 FNV-1a of the payload, payload
// Sections: "config" (resolved YAML), "meta" (key=value lines: step, epoch, step_in_epoch, world,
// arch, num_params, num_buffers, precision, seed ...), "params" (f32 master weights),
// "buffers.R" (batch-norm running statistics of replica R), "optimizer" (its state tensors,
// concatenated), "scaler" (loss-scaler state, when there is one).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace replica::train {

constexpr uint32_t kCheckpointVersion = 1;

struct Checkpoint {
  std::map<std::string, std::string> sections;  // name -> payload bytes
  std::map<std::string, std::string> meta() const;
  std::string meta_value(const std::string& key) const;  // throws IoError naming the key
  void set_meta(const std::map<std::string, std::string>& kv);
};

void write_checkpoint(const Checkpoint& c, const std::string& path);
// Throws IoError naming the file and, for a damaged section, the section.
Checkpoint read_checkpoint(const std::string& path);

// RUN_DIR/checkpoints/step-00001234.ckpt; list_checkpoints returns them newest first.
std::string checkpoint_path(const std::string& dir, int64_t step);
std::vector<std::string> list_checkpoints(const std::string& dir);
// Deletes all but the newest `keep` checkpoints.
void rotate_checkpoints(const std::string& dir, int keep);

}  // namespace replica::train
