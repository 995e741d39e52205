// Planned offload of optimizer state and (ZeRO-3) master shards: which shards' state lives on the
// host between optimizer steps, which master shards live there between uses, and what the
// optimizer step then costs in time and memory (docs/planning.md, "Offload").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcplan/planner/cost_model.h"
#include "dcplan/planner/workload.h"
#include "dcplan/schemas/plan.h"

namespace dcplan::planner {

/// Offloaded parameters are stepped in groups of consecutive ds_ids of at least this much state
/// (unless one parameter is larger): one optimizer call and two copies per group, so that many
/// small shards (norm weights, biases) cost one launch, not one each.
inline constexpr uint64_t kOffloadGroupMinBytes = 16ull << 20;
/// ... or of 1/kOffloadGroupsAtLeast of all the offloaded state, where that is less.
inline constexpr uint64_t kOffloadGroupsAtLeast = 16;

/// A plan's offload groups resolved against a Workload.
struct CompiledOffload {
  struct Group {
    std::vector<int32_t> params;  ///< param indices
    uint64_t bytes = 0;           ///< their optimizer state at the planned world size
    uint64_t masterBytes = 0;     ///< their master shards (ParamMemory::master), where offloaded too
  };
  std::vector<Group> groups;  ///< in stepping order
  uint64_t bytes = 0;         ///< all of it: off the device outside the optimizer step
  /// The master shards on the host: off the device except from a gather's issue to its wait and
  /// during their group's update (ZeRO-3 only).
  uint64_t masterBytes = 0;
  std::vector<char> masterOnHost;  ///< per param index
  /// The most state on the device at once during the step: the group being updated, the next one
  /// coming in, and the one before, whose device copy the runtime drops once the compute stream
  /// has waited for its copy out (before the update after this one); and the master shards of
  /// the group being updated, which come and go with its update.
  uint64_t stepBytes = 0;
  double share = 0;  ///< of the optimizer's recorded time: the offloaded parameters' share
  /// Of the recorded step's temporaries, the most one call of the grouped step holds. A foreach
  /// optimizer's grow with the elements a call steps, and it calls once per param group: the
  /// grouped step's largest call (the parameters kept on the device, then each offload group, each
  /// split by param group) over the recorded step's (its largest param group), by state where
  /// every shard holds as much per element. Otherwise kept whole, 1: a loop's are its largest
  /// parameter's whatever a call steps, a fused step's are not the state's size, and an optimizer
  /// not known (or its param groups) errs high.
  double scratchShare = 1;
};

/// Resolves `groups` (a plan's offload.optimizer_state) against `w`. Throws std::invalid_argument
/// with a JSON pointer ("/offload/optimizer_state/2/ds_ids/0: ...") for an unknown or frozen
/// parameter, one without recorded optimizer state, or master shards offloaded under ZeRO-1/2.
CompiledOffload compileOffload(const Workload& w, const std::vector<schemas::OffloadGroup>& groups);

/// The optimizer step with offload, on the device's clock from `startUs` (when it may start).
struct OptimizerPhase {
  double endUs = 0;      ///< the last update done and the last copy out finished
  double reloadUs = 0;   ///< host-to-device copy time, summed
  double offloadUs = 0;  ///< device-to-host copy time, summed
  double exposedUs = 0;  ///< how much longer than the optimizer alone
  struct Copy {
    bool toDevice = false;
    size_t group = 0;
    double startUs = 0;
    double endUs = 0;
  };
  std::vector<Copy> copies;
};

/// The step of `w`'s optimizer (Workload::optimizerUs, split by state bytes) with `offload`:
/// the resident parameters first while the first group is copied in; then each group once it is
/// in and the group two before it is copied out, the next group's copy in beside its update, its
/// copy out after it (one copy stream each way, at the trace's host link rates). A group's master
/// shards are copied in just before its update and out just after it, in the update's turn (the
/// runtime copies them on the compute stream). `copiesBlockHost`: the host makes the copies
/// itself (CPU ranks), so nothing overlaps.
OptimizerPhase simulateOptimizerPhase(const Workload& w, const CostModel& cost,
                                      const CompiledOffload& offload, double startUs, bool copiesBlockHost);

/// The parameters whose state may be offloaded, the most state first (ties by ds_id): the planner
/// offloads a prefix of this list.
std::vector<int32_t> offloadOrder(const Workload& w);

/// Groups for offloading the first `count` parameters of `order` (offloadOrder): in ds_id order,
/// consecutive ones merged up to kOffloadGroupMinBytes (or the share kOffloadGroupsAtLeast).
std::vector<schemas::OffloadGroup> offloadGroups(const Workload& w, const std::vector<int32_t>& order,
                                                 size_t count);

/// `groups` with the master shards of `count` of them offloaded too: the groups with the most
/// master bytes first (ties: the earlier group), their masterBytes set. ZeRO-3 only.
std::vector<schemas::OffloadGroup> offloadMasters(const Workload& w,
                                                  std::vector<schemas::OffloadGroup> groups, size_t count);

/// Why `w` cannot have its optimizer state offloaded ("" where it can): no state recorded, or no
/// host link rate.
std::string offloadUnavailable(const Workload& w, const CostModel& cost);

}  // namespace dcplan::planner
