// CommClique (the state NCCL communicators of one process share), on a recording fake backend:
// abort reaches every member once, calls after it name the rank, and destruction of the members
// still active happens in one call, never one by one and never for aborted ones.
#include <gtest/gtest.h>

#include <thread>

#include "core/errors.h"
#include "parallel/comm_clique.h"

using namespace replica;
using namespace replica::parallel;

namespace {
struct Recorder {
  std::vector<int> aborted;
  std::vector<std::vector<int>> destroy_calls;
  CommClique::Backend backend() {
    return {[this](int m) { aborted.push_back(m); }, [this](const std::vector<int>& ms) { destroy_calls.push_back(ms); }};
  }
};
}  // namespace

TEST(CommClique, DestroysEveryMemberInOneCall) {
  Recorder rec;
  { CommClique c(3, rec.backend()); }
  ASSERT_EQ(rec.destroy_calls.size(), 1u) << "one grouped destroy, not one per member";
  EXPECT_EQ(rec.destroy_calls[0], (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(rec.aborted.empty());
}

TEST(CommClique, AbortReachesEveryMemberOnceAndLaterCallsNameTheRank) {
  Recorder rec;
  {
    CommClique c(4, rec.backend());
    EXPECT_NO_THROW(c.check(2, "all_reduce"));
    // Two replicas fail at once, from their own threads: still one abort of each member.
    std::thread a([&] { c.abort("replica 1 failed: planted"); });
    std::thread b([&] { c.abort("replica 3 failed: planted"); });
    a.join();
    b.join();
    c.abort("a third time");
    EXPECT_TRUE(c.aborted());
    ASSERT_EQ(rec.aborted.size(), 4u) << "every member aborted, each once";
    for (int m = 0; m < 4; ++m) EXPECT_EQ(std::count(rec.aborted.begin(), rec.aborted.end(), m), 1) << m;
    try {
      c.check(2, "NCCL all_reduce");
      FAIL() << "a call after the abort went through";
    } catch (const CommError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("rank 2"), std::string::npos) << m;
      EXPECT_NE(m.find("planted"), std::string::npos) << "the first reason is kept: " << m;
    }
  }
  EXPECT_TRUE(rec.destroy_calls.empty()) << "aborted communicators are freed by the abort, never destroyed";
}

// Work captured with the members' collectives (a CUDA graph holding NCCL's persistent plans) is
// released before the members are aborted, from the thread that aborts, and before they are
// destroyed: from NCCL 2.26 on both wait until every such graph is gone, so a graph still alive
// would hang them. A holder that went first is not called; one that comes after the abort is
// released at once.
TEST(CommClique, CapturedWorkIsReleasedBeforeAbortAndBeforeDestruction) {
  std::vector<std::string> order;
  CommClique::Backend b{[&](int m) { order.push_back("abort " + std::to_string(m)); },
                        [&](const std::vector<int>&) { order.push_back("destroy"); }};
  {
    CommClique c(2, b);
    EXPECT_GE(c.capture_holds().hold([&] { order.push_back("release graph A"); }), 0);
    const int gone = c.capture_holds().hold([&] { order.push_back("release graph B"); });
    c.capture_holds().drop(gone);
    std::thread t([&] { c.abort("replica 1 failed"); });
    t.join();
    EXPECT_TRUE(c.capture_holds().released());
    EXPECT_EQ(c.capture_holds().hold([&] { order.push_back("release graph C"); }), -1);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"release graph A", "abort 0", "abort 1", "release graph C"}));
  order.clear();
  {
    CommClique c(2, b);
    c.capture_holds().hold([&] { order.push_back("release graph D"); });
  }
  EXPECT_EQ(order, (std::vector<std::string>{"release graph D", "destroy"}));
}
