// Aggregate facts of a trace, for `dcplan inspect` and `dcplan record`.
#include "dcplan/schemas/trace_summary.h"

#include <algorithm>
#include <map>

#include "dcplan/schemas/dtype.h"

namespace dcplan::schemas {

TraceSummary summarizeTrace(const Trace& trace, size_t topOps) {
  TraceSummary s;
  std::map<int64_t, std::string> names;
  for (const auto& p : trace.params) {
    ++s.params;
    if (p.requiresGrad) ++s.trainableParams;
    s.elements += static_cast<uint64_t>(p.numel);
    s.masterBytes += static_cast<uint64_t>(p.numel) * dtypeSize(p.dtype).value_or(4);
    names[p.id] = p.name;
  }
  s.steps = static_cast<int64_t>(trace.steps.size());

  std::map<int64_t, GraphSummary> byGraph;
  std::vector<SlowOp> comm;
  int64_t optimizerSteps = 0;
  s.hostTimes = !trace.steps.empty();
  s.deviceTimes = !trace.steps.empty();
  for (const auto& step : trace.steps) {
    if (step.optimizerUs > 0) {
      s.optimizerUs += step.optimizerUs;
      ++optimizerSteps;
      s.hostTimes = s.hostTimes && step.optimizerHostUs;
      s.optimizerHostUs += step.optimizerHostUs.value_or(0);
      s.deviceTimes = s.deviceTimes && step.optimizerDeviceUs;
      s.optimizerDeviceUs += step.optimizerDeviceUs.value_or(0);
    }
    for (const auto& g : step.graphs) {
      for (const SavedActivation& a : g.savedActivations) {
        s.savedActivations = true;
        s.savedTensors += 1;
        s.savedBytes += a.bytes;
        if (a.freedAt) {
          s.savedTried = true;
          s.savedFreedBytes += a.bytes;
        }
      }
      GraphSummary& gs = byGraph[g.id];
      gs.id = g.id;
      gs.kind = g.kind;
      for (const auto& e : g.events) {
        const double us = e.endUs - e.startUs;
        ++gs.ops;
        gs.computeUs += e.computeUs;
        s.hostTimes = s.hostTimes && e.hostUs && e.issueUs;
        s.hostComputeUs += e.hostUs.value_or(0);
        s.issueUs += e.issueUs.value_or(0);
        s.deviceTimes = s.deviceTimes && e.deviceUs;
        s.deviceComputeUs += e.deviceUs.value_or(0);
        s.deviceOpUs += e.opDeviceUs.value_or(0);
        s.peakMemoryBytes = std::max({s.peakMemoryBytes, e.memoryBytes, e.peakBytes});
        if (e.op == "allgather_param" || e.op == "prefetch_params_fused") {
          gs.gathers += static_cast<int64_t>(e.dsIds.size());
          gs.gatheredBytes += e.bytes;
          gs.allgatherBusyUs += us;
        } else if (e.op == "release_param") {
          ++gs.releases;
        } else if (e.op == "reduce_grad") {
          ++gs.reduces;
          gs.reducedBytes += e.bytes;
          gs.reduceBusyUs += us;
        }
        if (e.stream == streamName(Stream::Compute)) gs.exposedCommUs += us;
        if (e.stream == streamName(Stream::AllGather) || e.stream == streamName(Stream::Reduce)) {
          comm.push_back(
              {step.index, g.id, e.seq, e.op, e.dsIds.empty() ? "" : names[e.dsIds.front()], e.bytes, us});
        }
      }
    }
  }
  const double steps = std::max<double>(1, static_cast<double>(s.steps));
  for (auto& [id, gs] : byGraph) {
    for (double* v : {&gs.computeUs, &gs.exposedCommUs, &gs.allgatherBusyUs, &gs.reduceBusyUs}) *v /= steps;
    gs.ops = static_cast<int64_t>(static_cast<double>(gs.ops) / steps + 0.5);
    gs.gathers = static_cast<int64_t>(static_cast<double>(gs.gathers) / steps + 0.5);
    gs.releases = static_cast<int64_t>(static_cast<double>(gs.releases) / steps + 0.5);
    gs.reduces = static_cast<int64_t>(static_cast<double>(gs.reduces) / steps + 0.5);
    gs.gatheredBytes = static_cast<uint64_t>(static_cast<double>(gs.gatheredBytes) / steps + 0.5);
    gs.reducedBytes = static_cast<uint64_t>(static_cast<double>(gs.reducedBytes) / steps + 0.5);
    s.computeUs += gs.computeUs;
    s.exposedCommUs += gs.exposedCommUs;
    s.graphs.push_back(gs);
  }
  s.savedTensors /= steps;
  s.savedBytes = static_cast<uint64_t>(static_cast<double>(s.savedBytes) / steps + 0.5);
  s.savedFreedBytes = static_cast<uint64_t>(static_cast<double>(s.savedFreedBytes) / steps + 0.5);
  s.hostComputeUs /= steps;
  s.issueUs /= steps;
  s.deviceComputeUs /= steps;
  s.deviceOpUs /= steps;
  if (optimizerSteps > 0) {
    s.optimizerUs /= static_cast<double>(optimizerSteps);
    s.optimizerHostUs /= static_cast<double>(optimizerSteps);
    s.optimizerDeviceUs /= static_cast<double>(optimizerSteps);
  }
  // Longest first; ties in trace order so the output is deterministic.
  std::stable_sort(comm.begin(), comm.end(), [](const SlowOp& a, const SlowOp& b) { return a.us > b.us; });
  if (comm.size() > topOps) comm.resize(topOps);
  s.slowest = std::move(comm);
  return s;
}

}  // namespace dcplan::schemas
