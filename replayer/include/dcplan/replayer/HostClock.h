// The host's monotonic clock: one reading for everything that times the host.
#pragma once

#include <chrono>
#include <cstdint>

namespace dcplan::replayer {

/// Nanoseconds of the host's monotonic clock (CLOCK_MONOTONIC, which Python's time.monotonic_ns()
/// reads too: the replay log's op lines and its step marks are comparable).
inline int64_t monotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace dcplan::replayer
