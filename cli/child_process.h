// Running a user's command as a child process group: captured output, polling,
// and signal forwarding, for `dcplan record`.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dcplan::cli {

/// How a child ended: exit code, or the signal that killed it.
struct ChildStatus {
  bool exited = false;
  int exitCode = 0;
  int signal = 0;
  bool ok() const { return exited && exitCode == 0; }
  std::string describe() const;  ///< "exit code 3", "killed by signal 9 (Killed)"
};

/// A command running in its own process group, its stdout and stderr merged into one
/// pipe. Non-copyable; the destructor kills a group still running.
class ChildProcess {
 public:
  /// Starts `argv` with `env` added to this process's environment. Throws
  /// std::runtime_error naming the command when it cannot be started.
  ChildProcess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  /// Waits up to `timeout` for output or exit; passes each complete output line to
  /// `onLine`. Returns the status once the child has exited and its output is drained.
  std::optional<ChildStatus> poll(std::chrono::milliseconds timeout,
                                  const std::function<void(const std::string&)>& onLine);

  /// Sends `signal` to the whole process group.
  void signalGroup(int signal);

  /// Interrupt, then terminate, then kill, waiting `grace` between them. Returns the status.
  ChildStatus stop(std::chrono::milliseconds grace);

 private:
  pid_t pid_ = -1;
  int outFd_ = -1;
  std::string partialLine_;
  std::optional<ChildStatus> status_;
};

/// Installs SIGINT/SIGTERM/SIGHUP handlers that only record the signal, and restores
/// the previous handlers when destroyed.
class InterruptGuard {
 public:
  InterruptGuard();
  ~InterruptGuard();
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;
  /// The signal received, or 0.
  int received() const;
};

}  // namespace dcplan::cli
