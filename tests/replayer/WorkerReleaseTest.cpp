// The Gloo transport's wait for a finished work's other holder to let go (WorkerRelease.h).
#include "WorkerRelease.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

using namespace dcplan::replayer;
using namespace std::chrono_literals;

namespace {

c10::intrusive_ptr<c10d::Work> finishedWork() { return c10::make_intrusive<c10d::Work>(); }

/// Holds a reference to w, as Gloo's worker does after completing it, and lets go after `after`.
std::thread workerLettingGo(c10::intrusive_ptr<c10d::Work> w, std::chrono::milliseconds after) {
  return std::thread([held = std::move(w), after]() mutable {
    std::this_thread::sleep_for(after);
    held.reset();
  });
}

}  // namespace

TEST(WorkerRelease, WaitsUntilTheWorkersReferenceIsGone) {
  WorkerRelease release(10s);
  auto w = finishedWork();
  std::thread worker = workerLettingGo(w, 20ms);
  release.await(w);
  EXPECT_EQ(w.use_count(), 1);  // the caller's is the last: the work's scratch goes with it
  worker.join();
}

// The bound here is 1 s against the worker's 20 ms to let go: fifty times over, so that only a
// machine stalling a thread for a second could make the resumed wait give up.
TEST(WorkerRelease, AWorkHeldPastTheBoundStopsTheWaitingOnlyWhileItLives) {
  WorkerRelease release(1s);
  auto w = finishedWork();
  auto elsewhere = w;  // a reference torch keeps past the bound
  release.await(w);    // gives up after the bound (and warns)
  EXPECT_EQ(w.use_count(), 2);
  EXPECT_FALSE(release.awaits());
  auto other = finishedWork();
  auto otherHeld = other;
  const auto start = std::chrono::steady_clock::now();
  release.await(other);  // not waited for: it would hold the caller for the bound each time
  EXPECT_LT(std::chrono::steady_clock::now() - start, 500ms);

  // Once the late reference goes (and the caller's), later works are waited for again.
  elsewhere.reset();
  w.reset();
  EXPECT_TRUE(release.awaits());
  auto next = finishedWork();
  std::thread worker = workerLettingGo(next, 20ms);
  release.await(next);
  EXPECT_EQ(next.use_count(), 1);  // before the join: 2 had the wait returned at once
  worker.join();
}

TEST(WorkerRelease, StopsForGoodAfterSoManyWorksHeldPastTheBound) {
  WorkerRelease release(5ms);
  for (int k = 0; k < WorkerRelease::kGiveUps; ++k) {
    EXPECT_TRUE(release.awaits()) << k;
    auto w = finishedWork();
    auto elsewhere = w;
    release.await(w);  // gives up; then the late reference goes
  }
  EXPECT_FALSE(release.awaits());  // every work that held it up is gone, and still it does not wait
}
