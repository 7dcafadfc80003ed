// CommClique: the one owner of the state of the communicators that one process holds for one
// group (one per local replica, e.g. one NCCL communicator per GPU). NCCL's rules, kept here so a
// CPU test can hold them (tests/parallel/test_comm_clique.cpp):
//  - abort is collective: when one member fails, every member must be aborted, or the others
//    wait out their time-out; abort() aborts all, once (idempotent, any thread);
//  - after an abort, every call on any member is a CommError naming the rank and the reason,
//    and an aborted communicator is never destroyed again (abort frees it);
//  - work captured with the members' collectives (CUDA graphs) is released before any abort and
//    before destruction (capture_holds(); NCCL 2.26+ waits for such graphs in abort and destroy);
//  - destruction is collective too: with one thread owning several ranks, the members still
//    active are finalized and destroyed together in one call (inside one NCCL group), never one
//    by one (which hangs: each waits for the others).
#pragma once
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/capture_holds.h"

namespace replica::parallel {

class CommClique {
 public:
  struct Backend {
    std::function<void(int member)> abort;                        // abort one member's communicator
    std::function<void(const std::vector<int>& members)> destroy;  // destroy these members together
  };
  CommClique(int members, Backend backend);
  ~CommClique();  // destroys the members that were not aborted, in one call
  CommClique(const CommClique&) = delete;
  CommClique& operator=(const CommClique&) = delete;

  int members() const { return members_; }
  // Aborts every member (the first call does; later ones add nothing). `why` is kept for errors.
  void abort(const std::string& why);
  bool aborted() const;
  std::string why() const;
  // Throws CommError "... rank R: the communicator was aborted: <why>" when aborted.
  void check(int rank, const std::string& what) const;
  CaptureHolds& capture_holds() { return holds_; }

 private:
  mutable std::mutex m_;
  CaptureHolds holds_;  // released before the members are aborted or destroyed
  int members_;
  Backend backend_;
  bool aborted_ = false;
  std::string why_;
};

}  // namespace replica::parallel
