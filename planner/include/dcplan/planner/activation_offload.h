// Planned activation offload: which saved activations of a forward leave the device from the op by
// which their memory is gone until the backward reads them, and what that does to each op's memory
// and compute (docs/planning.md, "Offload", activations).
#pragma once

#include <cstdint>
#include <vector>

#include "dcplan/planner/workload.h"
#include "dcplan/schemas/plan.h"

namespace dcplan::planner {

/// A plan's offloaded saves resolved against a Workload: per graph run, by op, what the
/// activations hold less and what is copied. A run that moves nothing has empty vectors.
struct CompiledActivations {
  struct Run {
    std::vector<uint64_t> less;      ///< at the op: the offloaded saves off the device then
    std::vector<uint64_t> lessPeak;  ///< during the compute before the op
    std::vector<uint64_t> outBytes;  ///< copied to the host during the compute before the op
    std::vector<uint64_t> inBytes;   ///< copied back during the compute before the op
  };
  std::vector<Run> runs;  ///< by run index (Workload::runs)
  uint64_t bytes = 0;     ///< moved to the host per step

  const Run* of(size_t run) const {
    return run < runs.size() && !runs[run].less.empty() ? &runs[run] : nullptr;
  }
};

/// Resolves the forward graphs' offload_saves of `graphs` (a plan's, in the plan's order) against
/// `w`'s runs. Throws std::invalid_argument with a JSON pointer
/// ("/graphs/0/offload_saves/2/pack: ...") for a save no run of the graph can move (not recorded
/// with freed_at and used_at, or of another size) or on a graph whose runs pair with no backward.
CompiledActivations compileActivationOffload(const Workload& w,
                                             const std::vector<schemas::PlanGraph>& graphs);

/// The saves of forward graph `graph` (a Workload graph index) that offloading can move in every run
/// of it (the same first save, of the same size), in the order first saved: the planner offloads a
/// prefix. None where a run of it does not pair with one backward.
std::vector<schemas::OffloadedSave> offloadableSaves(const Workload& w, int32_t graph);

}  // namespace dcplan::planner
