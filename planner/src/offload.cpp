// Planned offload of optimizer state and master shards: resolving a plan's groups, choosing them,
// and the optimizer step's time with them.
#include "dcplan/planner/offload.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <stdexcept>
#include <utility>

namespace dcplan::planner {

namespace {

/// The one rule of what can be offloaded: a trainable parameter whose optimizer state was recorded.
bool hasOptimizerState(const WorkParam& p) { return p.requiresGrad && p.optimizerStateBytes > 0; }

/// CompiledOffload::scratchShare of `c`. The grouped step's calls are the parameters kept on the
/// device, then each offload group, and a foreach optimizer splits each by param group (one call
/// per group); the recorded step's largest call was its largest param group.
double scratchShare(const Workload& w, const CompiledOffload& c) {
  std::vector<int64_t> callOf(w.params.size(), -1);  // offload group; -1: kept on the device
  for (size_t g = 0; g < c.groups.size(); ++g) {
    for (int32_t p : c.groups[g].params) callOf[static_cast<size_t>(p)] = static_cast<int64_t>(g);
  }
  std::map<int64_t, uint64_t> recorded;                   // param group -> its state
  std::map<std::pair<int64_t, int64_t>, uint64_t> calls;  // (call, param group) -> its state
  double perElement = 0;  // state bytes per master shard byte, the same for every parameter
  for (size_t p = 0; p < w.params.size(); ++p) {
    const WorkParam& wp = w.params[p];
    if (!wp.requiresGrad) continue;
    // Foreach only: a fused step works in place, and a loop's temporaries are one parameter's;
    // a trainable parameter without state, or a param group not recorded, is not known either.
    if (!hasOptimizerState(wp) || wp.optimizerImpl != "foreach" || wp.optimizerGroup < 0 ||
        wp.mem.master == 0) {
      return 1.0;
    }
    // The temporaries follow the elements a call steps; its state stands for them only where
    // every shard holds as much per element (AdamW without amsgrad: two fp32 moments).
    const double ratio = static_cast<double>(wp.optimizerStateBytes) / static_cast<double>(wp.mem.master);
    if (perElement == 0) perElement = ratio;
    if (std::abs(ratio - perElement) > 1e-9 * perElement) return 1.0;
    recorded[wp.optimizerGroup] += wp.optimizerStateBytes;
    calls[{callOf[p], wp.optimizerGroup}] += wp.optimizerStateBytes;
  }
  uint64_t most = 0, largest = 0;
  for (const auto& [group, bytes] : recorded) most = std::max(most, bytes);
  for (const auto& [call, bytes] : calls) largest = std::max(largest, bytes);
  return most == 0 ? 1.0 : static_cast<double>(largest) / static_cast<double>(most);
}

}  // namespace

CompiledOffload compileOffload(const Workload& w, const std::vector<schemas::OffloadGroup>& groups) {
  CompiledOffload c;
  uint64_t total = 0;
  for (const WorkParam& p : w.params) total += hasOptimizerState(p) ? p.optimizerStateBytes : 0;
  std::vector<char> seen(w.params.size(), 0);
  c.masterOnHost.assign(w.params.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    CompiledOffload::Group group;
    const bool master = groups[g].masterBytes > 0;
    if (master && w.stage != 3) {
      throw std::invalid_argument(
          "/offload/optimizer_state/" + std::to_string(g) +
          "/master_bytes: master shards are offloaded under ZeRO-3 only; the trace is "
          "ZeRO-" +
          std::to_string(w.stage));
    }
    for (size_t k = 0; k < groups[g].dsIds.size(); ++k) {
      const int64_t id = groups[g].dsIds[k];
      const std::string ptr =
          "/offload/optimizer_state/" + std::to_string(g) + "/ds_ids/" + std::to_string(k);
      const int32_t p = w.paramIndex(id);
      if (p < 0)
        throw std::invalid_argument(ptr + ": ds_id " + std::to_string(id) +
                                    " is not a parameter of the trace");
      const WorkParam& wp = w.params[static_cast<size_t>(p)];
      if (!hasOptimizerState(wp)) {
        throw std::invalid_argument(ptr + ": ds_id " + std::to_string(id) + " (" + wp.name +
                                    ") has no optimizer " +
                                    "state in the trace (frozen, or optimizer_state_bytes not recorded)");
      }
      if (seen[static_cast<size_t>(p)]++)
        throw std::invalid_argument(ptr + ": ds_id " + std::to_string(id) + " is offloaded twice");
      group.params.push_back(p);
      group.bytes += wp.optimizerStateBytes;
      if (master) {
        group.masterBytes += wp.mem.master;
        c.masterOnHost[static_cast<size_t>(p)] = 1;
      }
    }
    c.bytes += group.bytes;
    c.masterBytes += group.masterBytes;
    c.groups.push_back(std::move(group));
  }
  // While group g is updated: g-1 still copying out, g, and g+1 coming in.
  for (size_t g = 0; g < c.groups.size(); ++g) {
    const uint64_t before = g > 0 ? c.groups[g - 1].bytes : 0;
    const uint64_t next = g + 1 < c.groups.size() ? c.groups[g + 1].bytes : 0;
    c.stepBytes = std::max(c.stepBytes, before + c.groups[g].bytes + next + c.groups[g].masterBytes);
  }
  c.share = total > 0 ? static_cast<double>(c.bytes) / static_cast<double>(total) : 0.0;
  c.scratchShare = scratchShare(w, c);
  return c;
}

OptimizerPhase simulateOptimizerPhase(const Workload& w, const CostModel& cost,
                                      const CompiledOffload& offload, double startUs, bool copiesBlockHost) {
  OptimizerPhase ph;
  const double offloadedUs = w.optimizerUs * offload.share;
  double update = startUs + (w.optimizerUs - offloadedUs);  // the resident parameters' update
  double in = startUs;                                      // the copy-in stream
  double out = startUs;                                     // the copy-out stream
  std::vector<double> outEnd;                               // each group's copy out
  if (copiesBlockHost) in = update;                         // one thread does it all, in turn
  for (size_t g = 0; g < offload.groups.size(); ++g) {
    const uint64_t bytes = offload.groups[g].bytes;
    const double inUs = cost.copyUs(bytes, true);
    const double outUs = cost.copyUs(bytes, false);
    // The master shards' copies, in the update's turn: the update takes that much longer.
    const uint64_t master = offload.groups[g].masterBytes;
    const double masterInUs = master > 0 ? cost.copyUs(master, true) : 0.0;
    const double masterOutUs = master > 0 ? cost.copyUs(master, false) : 0.0;
    const double own = offloadedUs * static_cast<double>(bytes) / static_cast<double>(offload.bytes) +
                       masterInUs + masterOutUs;
    if (copiesBlockHost) {
      ph.copies.push_back({true, g, update, update + inUs});
      update += inUs + own;
      ph.copies.push_back({false, g, update, update + outUs});
      update += outUs;
      out = update;
    } else {
      // Group g is in before its update; its update also waits for group g-2's copy out (whose
      // device copy the runtime then drops); the next group's copy in is queued at that point.
      const double inStart = in;
      in += inUs;
      ph.copies.push_back({true, g, inStart, in});
      const double start = std::max({update, in, g >= 2 ? outEnd[g - 2] : startUs});
      in = std::max(in, start);  // the next copy in is issued after this wait, on the compute stream
      update = start + own;
      const double outStart = std::max(out, update);
      out = outStart + outUs;
      outEnd.push_back(out);
      ph.copies.push_back({false, g, outStart, out});
    }
    ph.reloadUs += inUs + masterInUs;
    ph.offloadUs += outUs + masterOutUs;
  }
  ph.endUs = std::max(update, out);
  ph.exposedUs = std::max(0.0, ph.endUs - (startUs + w.optimizerUs));
  return ph;
}

std::vector<int32_t> offloadOrder(const Workload& w) {
  std::vector<int32_t> order;
  for (size_t p = 0; p < w.params.size(); ++p) {
    if (hasOptimizerState(w.params[p])) order.push_back(static_cast<int32_t>(p));
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const WorkParam& pa = w.params[static_cast<size_t>(a)];
    const WorkParam& pb = w.params[static_cast<size_t>(b)];
    return pa.optimizerStateBytes != pb.optimizerStateBytes ? pa.optimizerStateBytes > pb.optimizerStateBytes
                                                            : pa.id < pb.id;
  });
  return order;
}

std::vector<schemas::OffloadGroup> offloadGroups(const Workload& w, const std::vector<int32_t>& order,
                                                 size_t count) {
  std::vector<int32_t> chosen(order.begin(),
                              order.begin() + static_cast<std::ptrdiff_t>(std::min(count, order.size())));
  std::sort(chosen.begin(), chosen.end(), [&](int32_t a, int32_t b) {
    return w.params[static_cast<size_t>(a)].id < w.params[static_cast<size_t>(b)].id;
  });
  uint64_t total = 0;
  for (int32_t p : chosen) total += w.params[static_cast<size_t>(p)].optimizerStateBytes;
  // A small model's groups stay a small share of what is offloaded: two are on the device at once.
  const uint64_t least = std::min(kOffloadGroupMinBytes, total / kOffloadGroupsAtLeast);
  std::vector<schemas::OffloadGroup> groups;
  for (int32_t p : chosen) {
    const WorkParam& wp = w.params[static_cast<size_t>(p)];
    if (groups.empty() || groups.back().bytes >= least) groups.emplace_back();
    groups.back().dsIds.push_back(wp.id);
    groups.back().bytes += wp.optimizerStateBytes;
  }
  return groups;
}

std::vector<schemas::OffloadGroup> offloadMasters(const Workload& w,
                                                  std::vector<schemas::OffloadGroup> groups, size_t count) {
  std::vector<uint64_t> master(groups.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int64_t id : groups[g].dsIds) {
      const int32_t p = w.paramIndex(id);
      if (p >= 0) master[g] += w.params[static_cast<size_t>(p)].mem.master;
    }
  }
  std::vector<size_t> order(groups.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return master[a] > master[b]; });
  for (size_t k = 0; k < order.size(); ++k) groups[order[k]].masterBytes = k < count ? master[order[k]] : 0;
  return groups;
}

std::string offloadUnavailable(const Workload& w, const CostModel& cost) {
  if (!w.optimizerStateRecorded) {
    return "the trace has no optimizer_state_bytes (recorded by an older dcplan, or no optimizer step was "
           "recorded): record again to plan an offload";
  }
  if (offloadOrder(w).empty())
    return "no trainable parameter has params[].optimizer_state_bytes > 0 in the trace";
  if (!cost.copyRated()) {
    return "the trace's calibration has no host link rate (h2d_gbps, d2h_gbps): record again to plan an "
           "offload";
  }
  return "";
}

}  // namespace dcplan::planner
