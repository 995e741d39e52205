// The watchdog of dcplan's NCCL communicator: a timeout and an abort, as ProcessGroupNCCL has.
#pragma once

#include "cuda/NcclComm.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace dcplan::replayer::cuda {

/// Watches the collectives of one communicator from a thread of its own. A collective that
/// does not complete within the timeout (a rank that died or stopped: on NVLink its peers'
/// kernels wait forever), or an asynchronous error of the communicator, aborts it
/// (ncclCommAbort: its kernels end, so no stream and no host wait hangs) and records why;
/// the transport then refuses every launch with that reason. Non-copyable.
class NcclWatchdog {
 public:
  NcclWatchdog(NcclComm& comm, std::chrono::milliseconds timeout);
  /// Stops the thread (the communicator is the owner's to destroy).
  ~NcclWatchdog();
  NcclWatchdog(const NcclWatchdog&) = delete;
  NcclWatchdog& operator=(const NcclWatchdog&) = delete;

  /// A collective was just queued; done is recorded after it on its stream.
  void watch(const char* what, std::shared_ptr<CudaEvent> done);
  /// Why the communicator was aborted; "" while it works.
  std::string failure();

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    const char* what;
    std::shared_ptr<CudaEvent> done;
    Clock::time_point launched;
  };

  void run();
  /// Under mutex_: aborts the communicator once, keeping the first reason.
  void abort(const std::string& reason);

  NcclComm& comm_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::deque<Pending> pending_;
  std::string failure_;
  std::thread thread_;  // last: started when everything above exists
};

}  // namespace dcplan::replayer::cuda
