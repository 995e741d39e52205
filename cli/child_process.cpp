// Running a user's command as a child process group.
#include "child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace dcplan::cli {

std::string ChildStatus::describe() const {
  if (exited) return "exit code " + std::to_string(exitCode);
  return "killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
}

namespace {

ChildStatus statusFrom(int raw) {
  ChildStatus s;
  if (WIFEXITED(raw)) {
    s.exited = true;
    s.exitCode = WEXITSTATUS(raw);
  } else if (WIFSIGNALED(raw)) {
    s.signal = WTERMSIG(raw);
  }
  return s;
}

std::atomic<int> gReceived{0};

extern "C" void recordSignal(int signal) { gReceived.store(signal); }

const int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};
struct sigaction gPrevious[3];

}  // namespace

ChildProcess::ChildProcess(const std::vector<std::string>& argv,
                           const std::map<std::string, std::string>& env) {
  if (argv.empty()) throw std::runtime_error("no command to run");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("cannot create a pipe: ") + std::strerror(errno));
  // Built before fork: the child may only call async-signal-safe functions.
  std::vector<std::string> envStrings;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    if (!env.count(entry.substr(0, entry.find('=')))) envStrings.push_back(entry);
  }
  for (const auto& [k, v] : env) envStrings.push_back(k + "=" + v);
  std::vector<char*> envp, args;
  for (auto& s : envStrings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argvCopy = argv;
  for (auto& s : argvCopy) args.push_back(s.data());
  args.push_back(nullptr);
  // exec failure is reported through a second close-on-exec pipe.
  int errFds[2];
  if (::pipe2(errFds, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("cannot create a pipe: ") + std::strerror(errno));

  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error(std::string("cannot fork: ") + std::strerror(errno));
  if (pid_ == 0) {
    ::setpgid(0, 0);
    // Our handlers (or an inherited SIG_IGN) must not leak into the command.
    for (int s : kForwarded) ::signal(s, SIG_DFL);
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::execvpe(args[0], args.data(), envp.data());
    int err = errno;
    (void)!::write(errFds[1], &err, sizeof err);
    ::_exit(127);
  }
  ::setpgid(pid_, pid_);  // also here, so that signalGroup works before the child ran
  ::close(fds[1]);
  ::close(errFds[1]);
  outFd_ = fds[0];
  int childErr = 0;
  ssize_t n = ::read(errFds[0], &childErr, sizeof childErr);
  ::close(errFds[0]);
  if (n == sizeof childErr) {
    int raw = 0;
    ::waitpid(pid_, &raw, 0);
    pid_ = -1;
    throw std::runtime_error("cannot run '" + argv[0] + "': " + std::strerror(childErr));
  }
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !status_) {
    ::kill(-pid_, SIGKILL);
    int raw = 0;
    ::waitpid(pid_, &raw, 0);
  }
  if (outFd_ >= 0) ::close(outFd_);
}

std::optional<ChildStatus> ChildProcess::poll(std::chrono::milliseconds timeout,
                                              const std::function<void(const std::string&)>& onLine) {
  if (outFd_ >= 0) {
    pollfd pfd{outFd_, POLLIN, 0};
    int ready = ::poll(&pfd, 1, static_cast<int>(timeout.count()));
    if (ready > 0) {
      char buffer[8192];
      ssize_t n = ::read(outFd_, buffer, sizeof buffer);
      if (n > 0) {
        partialLine_.append(buffer, static_cast<size_t>(n));
        size_t newline;
        while ((newline = partialLine_.find('\n')) != std::string::npos) {
          onLine(partialLine_.substr(0, newline));
          partialLine_.erase(0, newline + 1);
        }
      } else if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        if (!partialLine_.empty()) onLine(partialLine_);
        partialLine_.clear();
        ::close(outFd_);
        outFd_ = -1;
      }
    }
  } else {
    std::this_thread::sleep_for(std::min(timeout, std::chrono::milliseconds(50)));
  }
  if (!status_) {
    int raw = 0;
    pid_t done = ::waitpid(pid_, &raw, WNOHANG);
    if (done == pid_) status_ = statusFrom(raw);
  }
  // Exited, and its output drained (or held open by a grandchild: do not wait for that).
  if (status_ && (outFd_ < 0 || timeout.count() == 0)) return status_;
  return std::nullopt;
}

void ChildProcess::signalGroup(int signal) {
  if (pid_ > 0) ::kill(-pid_, signal);
}

ChildStatus ChildProcess::stop(std::chrono::milliseconds grace) {
  auto ignoreLine = [](const std::string&) {};
  for (int signal : {SIGINT, SIGTERM, SIGKILL}) {
    signalGroup(signal);
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (std::chrono::steady_clock::now() < deadline) {
      poll(std::chrono::milliseconds(50), ignoreLine);
      if (status_) {
        signalGroup(SIGKILL);  // leave no stray member of the group behind
        return *status_;
      }
    }
  }
  int raw = 0;
  ::waitpid(pid_, &raw, 0);
  status_ = statusFrom(raw);
  return *status_;
}

InterruptGuard::InterruptGuard() {
  gReceived.store(0);
  for (size_t i = 0; i < std::size(kForwarded); ++i) {
    struct sigaction action {};
    action.sa_handler = recordSignal;
    sigemptyset(&action.sa_mask);
    ::sigaction(kForwarded[i], &action, &gPrevious[i]);
  }
}

InterruptGuard::~InterruptGuard() {
  for (size_t i = 0; i < std::size(kForwarded); ++i) ::sigaction(kForwarded[i], &gPrevious[i], nullptr);
}

int InterruptGuard::received() const { return gReceived.load(); }

}  // namespace dcplan::cli
