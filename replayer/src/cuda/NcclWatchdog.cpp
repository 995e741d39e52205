// The NCCL watchdog's thread: completion polling, timeout, asynchronous errors, abort.
#include "cuda/NcclWatchdog.h"

#include <c10/cuda/CUDAGuard.h>

namespace dcplan::replayer::cuda {
namespace {

// How often the thread looks: a timeout is noticed at most this much late.
constexpr auto kPoll = std::chrono::milliseconds(100);

}  // namespace

NcclWatchdog::NcclWatchdog(NcclComm& comm, std::chrono::milliseconds timeout)
    : comm_(comm), timeout_(timeout), thread_([this] { run(); }) {}

NcclWatchdog::~NcclWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void NcclWatchdog::watch(const char* what, std::shared_ptr<CudaEvent> done) {
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.push_back(Pending{what, std::move(done), Clock::now()});
}

std::string NcclWatchdog::failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

void NcclWatchdog::abort(const std::string& reason) {
  if (!failure_.empty()) return;
  failure_ = reason + "; dcplan aborted its NCCL communicator";
  comm_.abort();
  pending_.clear();
}

void NcclWatchdog::run() {
  try {
    c10::cuda::CUDAGuard guard(comm_.device());
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, kPoll);
      if (stop_ || !failure_.empty()) continue;
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_.get(), &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        abort(std::string("NCCL reported an asynchronous error: ") + ncclGetErrorString(async) + " (" +
              ncclGetLastError(comm_.get()) + ")");
        continue;
      }
      // Completed collectives leave; the oldest one still running decides the timeout.
      for (auto it = pending_.begin(); it != pending_.end();)
        it = it->done->query() ? pending_.erase(it) : it + 1;
      if (pending_.empty()) continue;
      const auto age = Clock::now() - pending_.front().launched;
      if (age > timeout_) {
        const double seconds = std::chrono::duration<double>(timeout_).count();
        abort(std::string("an NCCL ") + pending_.front().what + " did not complete within " +
              std::to_string(static_cast<int64_t>(seconds)) +
              " s (DCPLAN_NCCL_TIMEOUT): a rank died, stopped, or launched other collectives");
      }
    }
  } catch (const std::exception& e) {
    // A CUDA error in the thread itself (the lock was released by the unwinding): record it
    // rather than end the process; the transport refuses launches from here.
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = std::string("the NCCL watchdog failed: ") + e.what();
  }
}

}  // namespace dcplan::replayer::cuda
