// CaptureHolds: releases before a group's abort and destruction.
#include "parallel/capture_holds.h"

#include <exception>

#include "core/log.h"

namespace replica::parallel {

int CaptureHolds::hold(Release release) {
  std::unique_lock<std::mutex> lock(m_);
  if (!released_) {
    holds_.emplace(next_, std::move(release));
    return next_++;
  }
  lock.unlock();
  release();
  return -1;
}

void CaptureHolds::drop(int id) {
  std::lock_guard<std::mutex> lock(m_);
  holds_.erase(id);
}

void CaptureHolds::release_all() {
  std::lock_guard<std::mutex> lock(m_);  // held while releasing: drop() waits for a release in progress
  released_ = true;
  for (auto& [id, release] : holds_) {
    try {
      release();
    } catch (const std::exception& e) {  // one holder's failure must not keep the others' work alive
      log_warn("releasing captured work ", id, " failed: ", e.what());
    }
  }
  holds_.clear();
}

bool CaptureHolds::released() const {
  std::lock_guard<std::mutex> lock(m_);
  return released_;
}

}  // namespace replica::parallel
