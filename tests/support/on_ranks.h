// Runs a function on every rank of a set of in-process communicators, one thread each, and
// rethrows the first failure: the harness of the collective tests.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "parallel/communicator.h"

namespace replica::testing {

inline void on_ranks(std::vector<std::unique_ptr<parallel::Communicator>>& comms,
                     const std::function<void(int, parallel::Communicator&)>& fn) {
  std::vector<std::thread> ts;
  std::vector<std::exception_ptr> errs(comms.size());
  for (size_t r = 0; r < comms.size(); ++r)
    ts.emplace_back([&, r] {
      try {
        fn(static_cast<int>(r), *comms[r]);
      } catch (...) {
        errs[r] = std::current_exception();
      }
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

}  // namespace replica::testing
