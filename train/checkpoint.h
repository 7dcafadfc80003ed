// Checkpoints: everything needed to resume a run exactly, in one file of named sections, each
// with its own checksum, written atomically (temporary file in the same directory, fsync,
// rename, fsync of the directory).
//
// Format (little-endian):  "RPLCKPT\0"  u32 version (2)  u32 section count
//   per section:  u32 name length (1..256), name,  u64 payload bytes,  u64 FNV-1a 64 of the
//   payload (standard offset basis 14695981039346656037, prime 1099511628211), payload
// Version 1 was the same layout with a mistyped FNV offset basis (1469598103934665603); such
// files are still read. Nothing follows the last section.
// Sections: "config" (resolved YAML), "meta" (key=value lines: step, epoch, step_in_epoch, world,
// arch, num_params, num_buffers, precision, seed ...), "params" (f32 master weights),
// "buffers.R" (batch-norm running statistics of replica R), "optimizer" (its state tensors,
// concatenated), "scaler" (loss-scaler state, when there is one).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace replica::train {

constexpr uint32_t kCheckpointVersion = 2;

struct Checkpoint {
  std::map<std::string, std::string> sections;  // name -> payload bytes
  std::map<std::string, std::string> meta() const;
  std::string meta_value(const std::string& key) const;  // throws IoError naming the key
  // A whole number in [lo, hi]; anything else (text, overflow, out of range) is an IoError.
  int64_t meta_int(const std::string& key, int64_t lo, int64_t hi) const;
  void set_meta(const std::map<std::string, std::string>& kv);
};

void write_checkpoint(const Checkpoint& c, const std::string& path);
// Throws IoError naming the file and, for a damaged section, the section.
Checkpoint read_checkpoint(const std::string& path);
// The same from bytes in memory (`source` names them in errors); every length in the header is
// checked against the bytes that remain, so no file can make it read out of bounds.
Checkpoint parse_checkpoint(std::string_view bytes, const std::string& source);

// RUN_DIR/checkpoints/step-00001234.ckpt; list_checkpoints returns them newest first.
std::string checkpoint_path(const std::string& dir, int64_t step);
std::vector<std::string> list_checkpoints(const std::string& dir);
// Deletes all but the newest `keep` checkpoints.
void rotate_checkpoints(const std::string& dir, int keep);

}  // namespace replica::train
