// Typed errors of replica. Every message says what went wrong and what the user can change.
#pragma once
#include <stdexcept>
#include <string>

namespace replica {

// Base of every error replica throws; catch this to catch them all.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A setting (environment variable, YAML key, command-line flag) has a value we cannot accept.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Shapes or arguments of an op or layer do not fit together.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A file is missing, truncated or malformed.
class IoError : public Error {
 public:
  using Error::Error;
};

// A memory pool could not serve a request; the message carries the pool's state.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& msg, size_t requested) : Error(msg), requested_(requested) {}
  size_t requested() const { return requested_; }

 private:
  size_t requested_;
};

// A collective failed, timed out or was aborted because another replica failed.
class CommError : public Error {
 public:
  using Error::Error;
};

// The CUDA runtime, cuDNN, cuBLAS or NCCL reported an error.
class CudaError : public Error {
 public:
  using Error::Error;
};

// Training diverged (NaN loss, loss scale stuck at its floor, replicas disagreeing).
class TrainingError : public Error {
 public:
  using Error::Error;
};

// A stop that a restart gets past with other resources: fewer replicas left after a shrink than
// parallel.min_replicas (the lost device back, or a lower minimum, continues from the checkpoint
// written at the stop). The command exits 75 (EX_TEMPFAIL), as for a lost peer, so restart loops
// and schedulers try again instead of giving up on a configuration error.
class RestartableError : public TrainingError {
 public:
  using TrainingError::TrainingError;
};

}  // namespace replica
