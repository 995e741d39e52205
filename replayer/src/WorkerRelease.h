// When a finished c10d collective lets go of its memory: the Gloo transport's waits
// (ProcessGroupTransport.cpp, which holds the process's one). Header-only: one torch translation
// unit fewer to build, and its unit test uses it as it is.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <mutex>
#include <thread>

namespace dcplan::replayer {

/// Gloo's worker thread completes a work's future before it drops its own references to the
/// work (other backends differ: NCCL's watchdog holds a work until it polls it, so this is for
/// Gloo only), and the work holds the call's scratch (Gloo's flat buffers, our fused buffer).
/// Were the caller to drop its handle first, that memory would be freed whenever the worker next
/// runs: on a loaded machine several ops later, so the memory at an op would depend on the
/// scheduler, not on the plan. Waiting until the caller's reference is the last one frees the
/// scratch at the op the planner's memory model puts it at (docs/planning.md, memory model).
/// The worker lets go within microseconds once it runs; the bound guards against a torch that
/// keeps another reference for good, where waiting would never end. A work still held past the
/// bound stops the waiting only while it lives: once its other holder lets go, the next wait
/// waits again (one slow release on a loaded machine no longer leaves the rest of the run to the
/// scheduler). After kGiveUps such works it stops for good: a torch that held every work past the
/// bound would otherwise cost the bound at every wait.
class WorkerRelease {
 public:
  static constexpr int kGiveUps = 3;

  explicit WorkerRelease(std::chrono::milliseconds bound = std::chrono::seconds(2)) : bound_(bound) {}

  // The last work given up on may still be here at exit: left alone, not destroyed while the
  // process finalizes (its tensors, whose last holder may be Python's; docs/runtime.md, clean exits).
  ~WorkerRelease() { (void)heldElsewhere_.release(); }
  WorkerRelease(const WorkerRelease&) = delete;
  WorkerRelease& operator=(const WorkerRelease&) = delete;

  /// Whether a completed work counts as done only once the worker let go of it: not while a work
  /// held past the bound lives, nor where torch keeps works registered for functional collectives
  /// (allow_inflight_collective_as_graph_input: that registry holds them until a wait_tensor, which
  /// the runtime never calls).
  bool awaits() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (giveUps_ >= kGiveUps || !heldElsewhere_.expired()) return false;
      heldElsewhere_.reset();  // a work given up on and gone since: let its object go too
    }
    return !c10d::allow_inflight_collective_as_graph_input();
  }

  /// Waits until the caller's reference to w (completed) is its only one, for at most the bound;
  /// past it, warns and stops waiting while w lives (for good at the kGiveUps-th such work).
  void await(const c10::intrusive_ptr<c10d::Work>& w) {
    if (!awaits()) return;
    const auto deadline = std::chrono::steady_clock::now() + bound_;
    while (w.use_count() > 1) {
      if (std::chrono::steady_clock::now() > deadline) {
        bool forGood = false;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          forGood = ++giveUps_ >= kGiveUps;
          // Stopped for good, nothing needs watching: its object is not kept.
          if (!forGood) heldElsewhere_ = c10::weak_intrusive_ptr<c10d::Work>(w);
        }
        TORCH_WARN("dcplan: a completed c10d ", c10d::opTypeToString(w->retrieveOpType()),
                   " is still referenced elsewhere (", w.use_count() - 1, " time(s)) ", bound_.count(),
                   " ms after it finished; ", forGood ? "from now on" : "until that reference goes",
                   ", the transport frees a collective's scratch whenever the backend lets go of it, "
                   "which may be later than the plan's memory model assumes (docs/planning.md)");
        return;
      }
      std::this_thread::yield();
    }
  }

 private:
  const std::chrono::milliseconds bound_;
  std::mutex mutex_;
  // The work that outlasted the bound, while waiting is stopped for it (null, or expired, while it
  // is not). A weak reference keeps the whole object (its tensors, the call's scratch, too: c10d
  // works release nothing early) until reset at the next wait after its last holder let go: that
  // scratch is freed one wait late, once per give-up.
  c10::weak_intrusive_ptr<c10d::Work> heldElsewhere_{c10::intrusive_ptr<c10d::Work>()};
  int giveUps_ = 0;
};

}  // namespace dcplan::replayer
