// The shared-memory all-reduce of the inference ops: set up over a transport's ranks when they share a
// machine.
#pragma once

#include "dcplan/replayer/Transport.h"

#include <chrono>
#include <string>

namespace dcplan::replayer {

struct LocalAllReduceSettings {
  /// false: the inference ops use the transport's all-reduce (DCPLAN_SHM=off).
  bool enabled = true;
  /// Where segments are made (DCPLAN_SHM_DIR); it must be one tmpfs shared by the ranks.
  std::string dir = "/dev/shm";
  /// How long a rank waits for the others (DCPLAN_SHM_TIMEOUT).
  std::chrono::milliseconds timeout{300'000};
};

/// Collective over every rank of transport (a host transport: the rendezvous uses its
/// allGather), after init(). The ranks compare what shared memory they see; when it is all the
/// same, rank 0 makes a segment, the others map it, rank 0 removes its name again (so that
/// nothing is left in the directory however a process ends), and the runtime's inference
/// all-reduce uses it until cleanup(). Returns why it does not ("" when it does): the ranks are
/// on different hosts or see different directories, or settings.enabled is false. Throws, on
/// every rank, naming the directory and the rank, when a rank cannot make or map the segment.
std::string startLocalAllReduce(Transport& transport, const LocalAllReduceSettings& settings);

}  // namespace dcplan::replayer
