// CommClique: abort all once, refuse after abort, destroy the rest together.
#include "parallel/comm_clique.h"

#include "core/errors.h"
#include "core/log.h"

namespace replica::parallel {

CommClique::CommClique(int members, Backend backend) : members_(members), backend_(std::move(backend)) {}

CommClique::~CommClique() {
  holds_.release_all();  // graphs holding the members' plans go before the members
  std::lock_guard<std::mutex> lock(m_);
  if (aborted_ || members_ == 0) return;  // aborted communicators are already freed
  std::vector<int> all;
  for (int i = 0; i < members_; ++i) all.push_back(i);
  try {
    backend_.destroy(all);
  } catch (const std::exception& e) {  // a destructor must not throw; say what went wrong
    log_warn("destroying the communicators failed: ", e.what());
  }
}

void CommClique::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(m_);
    if (aborted_) return;
    aborted_ = true;  // from here every call on a member is a CommError
    why_ = why;
  }
  // The graphs that hold the members' collectives go first: ncclCommAbort waits for them.
  holds_.release_all();
  std::lock_guard<std::mutex> lock(m_);
  for (int i = 0; i < members_; ++i) {
    try {
      backend_.abort(i);
    } catch (const std::exception& e) {
      log_warn("aborting communicator ", i, " failed: ", e.what());
    }
  }
}

bool CommClique::aborted() const {
  std::lock_guard<std::mutex> lock(m_);
  return aborted_;
}

std::string CommClique::why() const {
  std::lock_guard<std::mutex> lock(m_);
  return why_;
}

void CommClique::check(int rank, const std::string& what) const {
  std::lock_guard<std::mutex> lock(m_);
  if (aborted_)
    throw CommError(what + " on rank " + std::to_string(rank) + ": the communicator was aborted (" + why_ + ")");
}

}  // namespace replica::parallel
