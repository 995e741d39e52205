// The process-wide runtime: its state, the lock every entry point takes, and lookups that name the op.
#pragma once

#include "CollectiveCheck.h"
#include "Executor.h"
#include "dcplan/shm/ShmComm.h"

#include "BudgetGuard.h"

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dcplan::replayer {

/// Everything init() creates; one per process.
struct RuntimeState {
  std::shared_ptr<Transport> transport_;
  RuntimeConfig config_;
  std::unique_ptr<ParamRegistry> registry_;
  std::map<int64_t, std::unique_ptr<Executor>> executors_;
  std::shared_ptr<OpObserver> observer_;
  std::unique_ptr<SchedulePolicy> schedule_;
  std::optional<BudgetGuard> guard_;
  bool profiling_ = false;
  std::map<std::pair<int64_t, int64_t>, c10::Device> offloadedFrom_;  // offload_tensor -> reload_tensor
  // offload_tensor / reload_tensor copies in flight, until their wait_offload / wait_reload.
  std::map<std::pair<int64_t, int64_t>, CommHandlePtr> offloadCopies_;
  std::map<std::pair<int64_t, int64_t>, CommHandlePtr> reloadCopies_;
  std::unique_ptr<shm::ShmComm> localAllReduce_;  // the inference ops' shared memory, if any
  // Where the ops are, for error messages: the step (start_forward calls), its pass, the
  // index of the next op in that pass.
  int64_t step_ = -1;
  bool inBackward_ = false;
  int64_t opInPass_ = 0;
  OpPlace place_;  // the op running now (collectives launched now are its)
  // CUDA graph capture (begin_capture .. end_capture), and whether a captured graph replays the
  // steps (from begin_capture to release_capture): eager steps must not run meanwhile.
  bool capturing_ = false;
  bool captured_ = false;
  // While captured: the gathered copies the graph replays with, which an eval forward beside it
  // took out of the registry (some were gathered before the capture, in the default memory pool:
  // freed, an eval's allocations would reuse them under the graph). Dropped at release_capture.
  std::vector<at::Tensor> heldForGraph_;
  // The first collective that failed (the ranks are out of step from there): later ops refuse.
  std::string failure_;
};

/// Taken by every entry point of Runtime.h: hooks, autograd's engine and Gloo's callbacks call in.
extern std::mutex gMutex;
/// The runtime, or an error naming op when it is not initialized. Call under gMutex.
RuntimeState& state(const char* op);
/// The executor of graphId, or an error naming op and the graph. Call under gMutex.
Executor& executor(const char* op, int64_t graphId);

}  // namespace dcplan::replayer
