// Step simulation: compute, all-gather, reduce and copy streams plus the memory curve.
#include "dcplan/planner/simulator.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dcplan::planner {

namespace {

void compilePersistent(const Workload& w, const Schedule& s, CompiledSchedule& c) {
  c.persistent.assign(w.params.size(), 0);
  for (size_t k = 0; k < s.persistent.size(); ++k) {
    int32_t p = w.paramIndex(s.persistent[k]);
    if (p < 0) {
      throw std::invalid_argument("/persistent/" + std::to_string(k) + ": ds_id " +
                                  std::to_string(s.persistent[k]) + " is not a parameter of the trace");
    }
    if (!c.persistent[static_cast<size_t>(p)])
      c.persistentBytes += w.params[static_cast<size_t>(p)].mem.gathered;
    c.persistent[static_cast<size_t>(p)] = 1;
  }
}

/// The plan's prefetch groups of graph `pg` (at JSON pointer `ptr`) placed at their op indices.
void compilePrefetch(const Workload& w, const WorkGraph& wg, const schemas::PlanGraph& pg,
                     const std::string& ptr, CompiledSchedule::Graph& cg) {
  const size_t n = wg.ops.size();
  // Groups sorted by op index, keeping the plan's order within a position.
  std::vector<std::pair<int32_t, size_t>> byOp;
  for (size_t k = 0; k < pg.prefetch.size(); ++k) {
    const schemas::PrefetchGroup& grp = pg.prefetch[k];
    auto it = std::lower_bound(wg.ops.begin(), wg.ops.end(), grp.position,
                               [](const WorkOp& op, int64_t pos) { return op.seq < pos; });
    if (it == wg.ops.end() || it->seq != grp.position) {
      throw std::invalid_argument(
          ptr + "/prefetch/" + std::to_string(k) + "/position: " + std::to_string(grp.position) +
          " is not a position of graph " + std::to_string(pg.id) + " (" + std::to_string(n) + " ops)");
    }
    byOp.emplace_back(static_cast<int32_t>(it - wg.ops.begin()), k);
  }
  std::stable_sort(byOp.begin(), byOp.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  cg.groupBegin.assign(n + 1, 0);
  for (const auto& [op, k] : byOp) {
    const schemas::PrefetchGroup& grp = pg.prefetch[k];
    std::vector<int32_t> members;
    for (size_t m = 0; m < grp.dsIds.size(); ++m) {
      int32_t p = w.paramIndex(grp.dsIds[m]);
      if (p < 0) {
        throw std::invalid_argument(ptr + "/prefetch/" + std::to_string(k) + "/ds_ids/" + std::to_string(m) +
                                    ": ds_id " + std::to_string(grp.dsIds[m]) +
                                    " is not a parameter of the trace");
      }
      members.push_back(p);
    }
    cg.groups.push_back(std::move(members));
    cg.groupBegin[static_cast<size_t>(op) + 1]++;
  }
  for (size_t i = 0; i < n; ++i) cg.groupBegin[i + 1] += cg.groupBegin[i];
}

/// The plan's buckets of graph `pg`, each op's bucket; they must cover the graph's gradients
/// exactly once each.
void compileBuckets(const Workload& w, const WorkGraph& wg, const schemas::PlanGraph& pg,
                    const std::string& ptr, CompiledSchedule::Graph& cg) {
  const size_t n = wg.ops.size();
  std::vector<int32_t> bucketOfParam(w.params.size(), -1);
  for (size_t b = 0; b < pg.buckets.size(); ++b) {
    const schemas::PlanBucket& bk = pg.buckets[b];
    uint64_t bytes = 0;
    for (size_t m = 0; m < bk.dsIds.size(); ++m) {
      std::string mptr = ptr + "/buckets/" + std::to_string(b) + "/ds_ids/" + std::to_string(m);
      int32_t p = w.paramIndex(bk.dsIds[m]);
      if (p < 0) {
        throw std::invalid_argument(mptr + ": ds_id " + std::to_string(bk.dsIds[m]) +
                                    " is not a parameter of the trace");
      }
      if (bucketOfParam[static_cast<size_t>(p)] >= 0) {
        throw std::invalid_argument(mptr + ": ds_id " + std::to_string(bk.dsIds[m]) + " is in two buckets");
      }
      bucketOfParam[static_cast<size_t>(p)] = static_cast<int32_t>(b);
      bytes += w.params[static_cast<size_t>(p)].gradBytes;
    }
    cg.bucketParams.emplace_back();
    for (int64_t id : bk.dsIds) cg.bucketParams.back().push_back(w.paramIndex(id));
    cg.bucketBytes.push_back(bytes);
    cg.bucketSize.push_back(0);
  }
  cg.bucketOfOp.assign(n, -1);
  std::vector<char> reduced(w.params.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    const WorkOp& op = wg.ops[i];
    if (op.role != OpRole::ReduceGrad) continue;
    int32_t b = bucketOfParam[static_cast<size_t>(op.param)];
    if (b < 0) {
      throw std::invalid_argument(ptr + "/buckets: ds_id " +
                                  std::to_string(w.params[static_cast<size_t>(op.param)].id) +
                                  " is reduced in graph " + std::to_string(pg.id) + " but is in no bucket");
    }
    cg.bucketOfOp[i] = b;
    cg.bucketSize[static_cast<size_t>(b)]++;
    reduced[static_cast<size_t>(op.param)] = 1;
  }
  for (size_t b = 0; b < pg.buckets.size(); ++b) {
    for (size_t m = 0; m < pg.buckets[b].dsIds.size(); ++m) {
      int32_t p = w.paramIndex(pg.buckets[b].dsIds[m]);
      if (!reduced[static_cast<size_t>(p)]) {
        throw std::invalid_argument(ptr + "/buckets/" + std::to_string(b) + "/ds_ids/" + std::to_string(m) +
                                    ": ds_id " + std::to_string(pg.buckets[b].dsIds[m]) +
                                    " has no reduce_grad in graph " + std::to_string(pg.id));
      }
    }
  }
}

/// Where graph wg's persistent copies end: the plan's persistent_ends (pg's; none for a graph the
/// plan leaves out), each the release of a trainable parameter (refused, named, otherwise), or,
/// where the schedule names none at all, the releases the planner names them by (persistentEnds).
void compilePersistentEnds(const Workload& w, const WorkGraph& wg, const schemas::PlanGraph* pg, bool named,
                           const std::vector<char>& persistent, const std::string& ptr,
                           CompiledSchedule::Graph& cg) {
  cg.endsPersistent.assign(wg.ops.size(), 0);
  const std::vector<schemas::PersistentEnd> ends =
      named ? (pg != nullptr ? pg->persistentEnds : std::vector<schemas::PersistentEnd>{})
            : persistentEnds(w, wg, persistent);
  for (size_t k = 0; k < ends.size(); ++k) {
    const schemas::PersistentEnd& e = ends[k];
    const std::string at = ptr + "/persistent_ends/" + std::to_string(k);
    const int32_t p = w.paramIndex(e.dsId);
    const bool fits = e.position >= 0 && static_cast<size_t>(e.position) < wg.ops.size();
    const WorkOp* op = fits ? &wg.ops[static_cast<size_t>(e.position)] : nullptr;
    if (p < 0 || op == nullptr || op->role != OpRole::Release || op->param != p) {
      throw std::invalid_argument(at + ": expected the position of a release_param of ds_id " +
                                  std::to_string(e.dsId) + " in graph " + std::to_string(wg.id) +
                                  " of the trace");
    }
    // A frozen copy stays valid through the optimizer step: the runtime keeps it (PlanCursor).
    if (!w.params[static_cast<size_t>(p)].requiresGrad) {
      throw std::invalid_argument(at + ": ds_id " + std::to_string(e.dsId) +
                                  " is frozen in the trace; only a trainable parameter's copy ends before "
                                  "the step");
    }
    cg.endsPersistent[static_cast<size_t>(e.position)] = 1;
  }
}

/// A graph of the trace the plan leaves out: gather on use, and no gradients to reduce.
void compileUnplanned(const WorkGraph& wg, CompiledSchedule::Graph& cg) {
  for (const WorkOp& op : wg.ops) {
    if (op.role == OpRole::ReduceGrad) {
      throw std::invalid_argument("/graphs: graph " + std::to_string(wg.id) +
                                  " of the trace reduces gradients but the plan has no buckets for it");
    }
  }
  cg.groupBegin.assign(wg.ops.size() + 1, 0);
  cg.bucketOfOp.assign(wg.ops.size(), -1);
}

}  // namespace

CompiledSchedule compileSchedule(const Workload& w, const Schedule& s) {
  CompiledSchedule c;
  compilePersistent(w, s, c);
  c.graphs.resize(w.graphs.size());
  std::vector<char> planned(w.graphs.size(), 0);
  const bool namesEnds = std::any_of(s.graphs.begin(), s.graphs.end(),
                                     [](const schemas::PlanGraph& pg) { return !pg.persistentEnds.empty(); });
  for (size_t gi = 0; gi < s.graphs.size(); ++gi) {
    const schemas::PlanGraph& pg = s.graphs[gi];
    const std::string ptr = "/graphs/" + std::to_string(gi);
    const int32_t g = w.graphIndex(pg.id);
    if (g < 0)
      throw std::invalid_argument(ptr + "/id: graph " + std::to_string(pg.id) + " is not in the trace");
    if (planned[static_cast<size_t>(g)]) {
      throw std::invalid_argument(ptr + "/id: graph " + std::to_string(pg.id) + " is planned twice");
    }
    planned[static_cast<size_t>(g)] = 1;
    const WorkGraph& wg = w.graphs[static_cast<size_t>(g)];
    if (pg.kind != wg.kind) {
      throw std::invalid_argument(ptr + "/kind: graph " + std::to_string(pg.id) + " is " +
                                  schemas::graphKindName(wg.kind) + " in the trace");
    }
    compilePrefetch(w, wg, pg, ptr, c.graphs[static_cast<size_t>(g)]);
    compileBuckets(w, wg, pg, ptr, c.graphs[static_cast<size_t>(g)]);
    compilePersistentEnds(w, wg, &pg, namesEnds, c.persistent, ptr, c.graphs[static_cast<size_t>(g)]);
  }
  for (size_t g = 0; g < w.graphs.size(); ++g) {
    if (planned[g]) continue;
    compileUnplanned(w.graphs[g], c.graphs[g]);
    compilePersistentEnds(w, w.graphs[g], nullptr, namesEnds, c.persistent, "", c.graphs[g]);
  }
  c.offload = compileOffload(w, s.optimizerOffload);
  c.activations = compileActivationOffload(w, s.graphs);
  return c;
}

namespace {

class Simulation {
 public:
  Simulation(const Workload& w, const CostModel& cost, const CompiledSchedule& s, const SimOptions& o)
      : w_(w),
        cost_(cost),
        s_(s),
        record_(o.record),
        referenceCalls_(o.referenceCalls),
        reference_(w.hostLane ? o.reference : nullptr) {
    allocated_.assign(w.params.size(), 0);
    callOf_.assign(w.params.size(), -1);
    hasShardGrad_.assign(w.params.size(), 0);
    masterLive_.assign(w.params.size(), 0);
    readyAt_.assign(w.params.size(), 0.0);
    gatherCount_.assign(w.params.size(), 0);
    res_.repeatStallUs.assign(w.params.size(), 0.0);
    size_t ops = 0;  // callsAtOp gets one entry per op: sized once, for the search's many runs
    for (const GraphRun& r : w.runs) ops += w.graphs[static_cast<size_t>(r.graph)].ops.size();
    res_.callsAtOp.reserve(ops);
    lastMicroStep_.assign(w.graphs.size(), 0);
    for (const GraphRun& r : w.runs) {
      lastMicroStep_[static_cast<size_t>(r.graph)] =
          std::max(lastMicroStep_[static_cast<size_t>(r.graph)], r.microStep);
    }
  }

  SimResult run() {
    for (size_t r = 0; r < w_.runs.size(); ++r) runGraph(static_cast<int32_t>(r));
    double start = std::max({computeNow_, reduceFree_, copyFree_, gatherFree_});
    const double behind =
        w_.hostLane ? std::max(0.0, start - hostNow_) : 0.0;  // the device, at the backward's end
    if (w_.hostLane) start = waitForHost(start, 0.0);  // the optimizer's kernels come after the backward's
    // Offloaded state comes back a group or two at a time (CompiledOffload::stepBytes), beside the
    // optimizer's temporaries: the recorded step's, less the gradient shards it held, as much of
    // them as the grouped step's largest call holds (CompiledOffload::scratchShare; a per-tensor
    // loop's are its largest parameter's whatever a call steps: 1xH100, 0.49 GiB for the 0.95B
    // model's embedding; a foreach step's, one fp32 copy of what it steps: 3.5 GiB there).
    const uint64_t scratch = optimizerExcess_ - std::min(optimizerExcess_, shardGrads_);
    momentary_ +=
        s_.offload.stepBytes + static_cast<uint64_t>(static_cast<double>(scratch) * s_.offload.scratchShare);
    sample(start, 0, -1, -1, false);
    const OptimizerPhase phase = optimizerPhase(start);
    double stepUs = phase.endUs;
    if (w_.hostLane) {
      double after = w_.optimizerHostUs + (w_.waitsBlockHost ? phase.exposedUs : 0.0);
      if (w_.waitsBlockHost) {
        hostNow_ = start;  // the host runs the optimizer itself, once the reductions are done
      } else if (reference_) {
        after = std::max(0.0, after - reference_->optimizerWaitUs);  // its own time, not the wait
      }
      // The most of the host's time after the backward that can have been waiting for the
      // device: how far the device was behind, less however long the host ran on after the
      // device's end (a recording ends each step on the device no earlier than on the host).
      res_.optimizerWaitUs = std::max(0.0, behind - std::max(0.0, hostNow_ + w_.optimizerHostUs - stepUs));
      hostNow_ += after;
      res_.hostUs = hostNow_;
      workEnd_ = stepUs;
      stepUs = waitForHost(stepUs, 0.0);
    }
    if (reference_) {
      res_.launchDeltaUs = launchChargedUs_;  // on the host lane already
    } else if (referenceCalls_ >= 0) {
      // Only calls beyond the recorded run's cost: where the step is device-bound, fewer
      // launches save no time, and the trace does not say which it is.
      const int64_t extra = res_.calls() - referenceCalls_;
      res_.launchDeltaUs = cost_.launchUs() * static_cast<double>(std::max<int64_t>(0, extra));
    }
    if (record_ && w_.optimizerUs > 0) {
      event(Stream::Compute, "optimizer", static_cast<int32_t>(w_.runs.size()) - 1, -1, {}, 0, start, stepUs);
    }
    res_.computeUs = w_.computeUs();
    res_.optimizerUs = w_.optimizerUs;
    res_.prediction.stepUs = stepUs + (reference_ ? 0.0 : res_.launchDeltaUs);
    const double copiesExposedUs = phase.exposedUs + res_.masterReloadExposedUs;
    res_.prediction.exposedCommUs = std::max(0.0, stepUs - res_.computeUs - res_.optimizerUs - copiesExposedUs -
                                                      res_.prediction.activationCopyUs - res_.hostBoundUs);
    res_.prediction.peakMemoryBytes = peak_;
    res_.prediction.offloadBytes = s_.offload.bytes + s_.offload.masterBytes;
    res_.prediction.activationOffloadBytes = s_.activations.bytes;
    res_.prediction.reloadUs = phase.reloadUs + res_.masterReloadUs;
    res_.prediction.offloadUs = phase.offloadUs;
    res_.prediction.exposedCopyUs = copiesExposedUs;
    res_.prediction.copyInUs = res_.prediction.reloadUs + res_.activationInUs;
    res_.prediction.copyOutUs = res_.prediction.offloadUs + res_.activationOutUs;
    if (w_.hostLane && !reference_) finishQuiet();
    return std::move(res_);
  }

 private:
  OptimizerPhase optimizerPhase(double start) {
    if (s_.offload.groups.empty()) {
      OptimizerPhase alone;
      alone.endUs = start + w_.optimizerUs;
      return alone;
    }
    OptimizerPhase ph = simulateOptimizerPhase(w_, cost_, s_.offload, start, w_.waitsBlockHost);
    if (record_) {
      const int32_t last = static_cast<int32_t>(w_.runs.size()) - 1;
      for (const OptimizerPhase::Copy& c : ph.copies) {
        const auto& group = s_.offload.groups[c.group];
        std::vector<int64_t> ids;
        for (int32_t p : group.params) ids.push_back(w_.params[static_cast<size_t>(p)].id);
        event(c.toDevice ? Stream::Reload : Stream::Offload,
              std::string(c.toDevice ? "reload" : "offload") + " optimizer state, group " +
                  std::to_string(c.group),
              last, -1, std::move(ids), group.bytes, c.startUs, c.endUs);
      }
    }
    return ph;
  }

  void runGraph(int32_t r) {
    const GraphRun& run = w_.runs[static_cast<size_t>(r)];
    const WorkGraph& g = w_.graphs[static_cast<size_t>(run.graph)];
    const CompiledSchedule::Graph& cg = s_.graphs[static_cast<size_t>(run.graph)];
    bool reduces = w_.stage >= 2 || run.microStep == lastMicroStep_[static_cast<size_t>(run.graph)];
    // ZeRO-3's backward before the optimizer step ends persistent copies of trainable
    // parameters at their last use (the step makes them stale), the rest at its end.
    const bool dropsPersistent = w_.stage == 3 && g.kind == schemas::GraphKind::Backward &&
                                 run.microStep == lastMicroStep_[static_cast<size_t>(run.graph)];
    Collective reduceOp = w_.stage >= 2 ? Collective::ReduceScatter : Collective::AllReduce;
    arrived_.assign(cg.bucketSize.size(), 0);
    launched_.assign(cg.bucketSize.size(), 0);
    deferred_.assign(cg.bucketSize.size(), 0);
    const CompiledActivations::Run* moved = s_.activations.of(static_cast<size_t>(r));
    for (size_t i = 0; i < g.ops.size(); ++i) {
      const WorkOp& op = g.ops[i];
      // Offloaded saves: copied on the compute stream (by the host on CPU ranks) in their stretch.
      const double out = moved ? cost_.copyUs(moved->outBytes[i], false) : 0.0;
      const double in = moved ? cost_.copyUs(moved->inBytes[i], true) : 0.0;
      const double copy = out + in;
      res_.prediction.activationCopyUs += copy;
      res_.activationInUs += in;
      res_.activationOutUs += out;
      const double c = run.computeUs[i] + copy;
      const uint64_t activation =
          run.activationBytes[i] - (moved ? std::min(run.activationBytes[i], moved->less[i]) : 0);
      double end = computeNow_ + c;
      if (w_.hostLane) {  // the device runs the stretch once the host has issued it
        hostNow_ += run.hostUs[i] + (w_.waitsBlockHost ? copy : 0.0);
        end = waitForHost(end, c);
      }
      if (c > 0 && record_) {
        event(Stream::Compute, "compute", r, op.seq, {}, 0, end - c, end - copy);
        if (copy > 0) {  // the timeline (dcplan check --chrome-trace) shows the copies apart
          event(Stream::Compute, "saved activation copies", r, op.seq, {},
                moved->outBytes[i] + moved->inBytes[i], end - copy, end);
        }
      }
      computeNow_ = end;
      workEnd_ = end;
      const int64_t callsBefore = res_.calls();
      // The compute's own peak, before this op changes what is held. Before the step's first
      // op that holds the recorded optimizer step's; a grouped step (offload) is modelled at the
      // optimizer instead, from what it left above the op's own activations.
      uint64_t computePeak =
          run.computePeakBytes[i] - (moved ? std::min(run.computePeakBytes[i], moved->lessPeak[i]) : 0);
      if (r == 0 && i == 0 && s_.offload.bytes > 0) {
        optimizerExcess_ =
            std::min(computePeak - std::min(computePeak, activation), w_.leastOptimizerExcessBytes);
        computePeak = activation;
      }
      sample(computeNow_, computePeak, r, op.seq, false);
      if (!run.opDeviceUs.empty() && run.opDeviceUs[i] > 0) {
        // The device's own times (ownDeviceTimes): the op's own kernels run in the stream's order,
        // before its collective.
        if (record_)
          event(Stream::Compute, "dc op", r, op.seq, {}, 0, computeNow_, computeNow_ + run.opDeviceUs[i]);
        computeNow_ += run.opDeviceUs[i];
        workEnd_ = computeNow_;
      }
      if (record_) res_.entryBytes.push_back(inUse(activation));
      for (int32_t k = cg.groupBegin[i]; k < cg.groupBegin[i + 1]; ++k) {
        gather(cg.groups[static_cast<size_t>(k)], r, op.seq, true);
      }
      switch (op.role) {
        case OpRole::Gather:
          if (!allocated_[static_cast<size_t>(op.param)]) gatherOne(op.param, r, op.seq);
          break;
        case OpRole::GatherWait: {
          size_t p = static_cast<size_t>(op.param);
          if (!allocated_[p]) gatherOne(op.param, r, op.seq);
          endCallScratch(p);
          liveMasters_ -= masterLive_[p];  // an offloaded master shard is dropped once its gather is done
          masterLive_[p] = 0;
          if (readyAt_[p] > computeNow_ && gatherCount_[p] > 1)
            res_.repeatStallUs[p] += readyAt_[p] - computeNow_;
          computeNow_ = std::max(computeNow_, readyAt_[p]);
          if (w_.waitsBlockHost) hostNow_ = std::max(hostNow_, computeNow_);
          break;
        }
        case OpRole::Release: {
          size_t p = static_cast<size_t>(op.param);
          if (allocated_[p] && !s_.persistent[p]) {
            allocated_[p] = 0;
            liveGathered_ -= w_.params[p].mem.gathered;
          } else if (allocated_[p] && dropsPersistent && cg.endsPersistent[i]) {
            dropPersistent(p);
          }
          break;
        }
        case OpRole::ReduceGrad: {
          if (!reduces) break;
          int32_t b = cg.bucketOfOp[i];
          if (b < 0) break;
          size_t bi = static_cast<size_t>(b);
          // ZeRO-1's flat bucket is filled as gradients arrive; ZeRO-2/3 hold the gradients
          // until the bucket's launch lays it out (packs it).
          if (arrived_[bi]++ == 0 && w_.stage < 2) filling_ += w_.memory.allocation(cg.bucketBytes[bi]);
          if (w_.stage >= 2) {
            const uint64_t g = w_.params[static_cast<size_t>(op.param)].mem.gradient;
            deferred_[bi] += g;
            pendingBytes_ += g;
          }
          if (arrived_[bi] == cg.bucketSize[bi]) {
            reduce(cg, bi, reduceOp, r, op.seq, w_.params[static_cast<size_t>(op.param)].mem.gradient);
          }
          break;
        }
        case OpRole::EndBackward:
          if (reduces) flush(cg, reduceOp, r, op.seq);
          if (w_.waitsBlockHost)
            hostNow_ = std::max(hostNow_, reduceFree_);  // Gloo: it drains them on the host
          break;
        case OpRole::Offload:
        case OpRole::Reload: {
          double start = std::max(computeNow_, copyFree_);
          double dur =
              run.copyUs[i] > 0 ? run.copyUs[i] : cost_.copyUs(op.copyBytes, op.role == OpRole::Reload);
          copyFree_ = start + dur;
          if (record_) event(Stream::Copy, "copy", r, op.seq, {}, op.copyBytes, start, copyFree_);
          break;
        }
        case OpRole::CopyWait:
          computeNow_ = std::max(computeNow_, copyFree_);
          if (w_.waitsBlockHost) hostNow_ = std::max(hostNow_, computeNow_);
          break;
        case OpRole::Prefetch:  // a recorded prefetch: the plan places its own
        case OpRole::Free:
          break;
      }
      const int32_t calls = static_cast<int32_t>(res_.calls() - callsBefore);
      res_.callsAtOp.push_back(calls);
      if (w_.hostLane) {
        hostNow_ += issueUs(op, run.issueUs[i], calls);
        if (!reference_ && calls == 0) noteQuiet(op.role, run.issueUs[i]);
      }
      ++opIndex_;
      sample(computeNow_, activation, r, op.seq, true);
      if (op.role == OpRole::EndBackward) {  // every reduction drained: no packed input is left
        releaseAfterSample_ += heldInput_;
        heldInput_ = 0;
      }
      pendingBytes_ -= releaseAfterSample_;
      releaseAfterSample_ = 0;
    }
    if (reduces) flush(cg, reduceOp, r, g.ops.empty() ? 0 : g.ops.back().seq);
    if (dropsPersistent) {
      for (size_t p = 0; p < w_.params.size(); ++p) {
        if (allocated_[p] && s_.persistent[p] && w_.params[p].requiresGrad) dropPersistent(p);
      }
      sample(computeNow_, 0, r, -1, false);
    }
  }

  /// Host time of an op: as recorded, plus the launch cost of each collective it issues beyond
  /// those the recorded run issued there (less for each fewer). An op that blocks the host (on
  /// Gloo: a wait, end_backward) was recorded with its stall, which the simulation makes again:
  /// only the simulated stall counts.
  double issueUs(const WorkOp& op, double recorded, int32_t calls) {
    if (w_.waitsBlockHost &&
        (op.role == OpRole::GatherWait || op.role == OpRole::CopyWait || op.role == OpRole::EndBackward))
      recorded = 0;
    if (!reference_ || opIndex_ >= reference_->callsAtOp.size()) return recorded;
    const int32_t extra = calls - reference_->callsAtOp[opIndex_];
    double charged = std::max(-recorded, cost_.launchUs() * extra);  // an op takes no less than 0
    if (calls == 0 && extra < 0) {
      // It launches nothing where the recorded run launched: it costs no more than the recorded
      // ops that launched nothing. What its recorded time held beyond the median launch (the
      // host's stalls beside the launch: a gather's up to 20x its median on 2 CPU ranks) went
      // with the launch; replayed, such an op took 1 us on the host (docs/planning.md).
      if (const std::optional<double> quiet = reference_->quietIssueUs(op.role))
        charged = std::min(charged, std::max(0.0, *quiet) - recorded);
    }
    launchChargedUs_ += charged;
    return recorded + charged;
  }

  /// The recorded run's simulation: op `role` issued no collective and took `us` on the host.
  void noteQuiet(OpRole role, double us) {
    if (role != OpRole::Gather && role != OpRole::Release && role != OpRole::ReduceGrad) return;
    quiet_[static_cast<size_t>(role)].push_back(us);
  }

  /// SimResult::quietIssueByRole from the samples noteQuiet took.
  void finishQuiet() {
    res_.quietIssueByRole.assign(quiet_.size(), -1.0);
    for (size_t role = 0; role < quiet_.size(); ++role) {
      if (!quiet_[role].empty()) res_.quietIssueByRole[role] = upperMedian(quiet_[role]);
    }
  }

  /// The wait on a member completes its gather call: the call's scratch is freed.
  void endCallScratch(size_t p) {
    const int32_t call = callOf_[p];
    if (call < 0) return;
    callOf_[p] = -1;
    liveScratch_ -= callScratch_[static_cast<size_t>(call)];
    callScratch_[static_cast<size_t>(call)] = 0;
  }

  void dropPersistent(size_t p) {
    allocated_[p] = 0;
    livePersistent_ -= w_.params[p].mem.gathered;
  }

  void gatherOne(int32_t p, int32_t r, int64_t seq) {
    one_[0] = p;
    gather(one_, r, seq, false);
  }

  void gather(const std::vector<int32_t>& params, int32_t r, int64_t seq, bool prefetch) {
    uint64_t bytes = 0;
    members_.clear();
    for (int32_t p : params) {
      size_t pi = static_cast<size_t>(p);
      if (allocated_[pi]) continue;  // resident or already in flight
      allocated_[pi] = 1;
      gatherCount_[pi]++;
      bytes += w_.params[pi].gatherBytes;
      (s_.persistent[pi] ? livePersistent_ : liveGathered_) += w_.params[pi].mem.gathered;
      members_.push_back(p);
    }
    if (members_.empty()) return;
    const double reloaded = reloadMasters(r, seq);
    // The call's transient buffers: while it is issued, and until a member is waited on.
    const bool coalesced = members_.size() > 1;
    momentary_ += w_.memory.gatherScratchIssued(bytes);
    if (const uint64_t held = w_.memory.gatherScratchUntilWait(bytes, coalesced)) {
      for (int32_t p : members_) callOf_[static_cast<size_t>(p)] = static_cast<int32_t>(callScratch_.size());
      callScratch_.push_back(held);
      liveScratch_ += held;
    }
    agreementCheck(!prefetch, r, seq);
    const double issued = std::max(computeNow_, gatherFree_);
    const double start = std::max(issued, reloaded);
    res_.masterReloadExposedUs += start - issued;  // the most the copies in can hold the compute up
    double dur = cost_.us(Collective::AllGather, bytes);
    gatherFree_ = start + dur;
    for (int32_t p : members_) readyAt_[static_cast<size_t>(p)] = gatherFree_;
    res_.gatherBusyUs += dur;
    res_.gatherCalls++;
    if (record_) {
      std::vector<int64_t> ids;
      for (int32_t p : members_) ids.push_back(w_.params[static_cast<size_t>(p)].id);
      event(Stream::AllGather, prefetch ? "prefetch_params_fused" : "allgather_param", r, seq, ids, bytes,
            start, gatherFree_);
      res_.gathers.push_back(GatherRecord{r, seq, computeNow_, gatherFree_, members_});
    }
  }

  /// The device's clock at the end of `workUs` of its work that would end at `deviceUs`, once the
  /// host has issued it (host lane). Of a GPU's idle time since its last work, what the host alone
  /// would have left idle is the host's (SimResult::hostBoundUs): until the host issued the work
  /// (a collective's wait inside that stretch is hidden behind the host); only what the collective
  /// kept it idle beyond that is communication's.
  double waitForHost(double deviceUs, double workUs) {
    if (!w_.waitsBlockHost) res_.hostBoundUs += std::max(0.0, hostNow_ - workUs - workEnd_);
    return std::max(deviceUs, hostNow_);
  }

  /// A call's agreement check (CostModel::checkUs), before its launch: the host blocks in it (on CPU
  /// ranks the host is the compute). Not in the recorded run's simulation: the recording ran without.
  /// Workload::checksCollectives implies a host lane (chooseTimes), hence a reference here.
  void agreementCheck(bool onUse, int32_t r, int64_t seq) {
    const double c = cost_.checkUs(onUse);
    if (!reference_ || c == 0) return;
    res_.checkUs += c;
    const double start = w_.waitsBlockHost ? std::max(computeNow_, hostNow_) : hostNow_;
    if (record_) event(Stream::Compute, "agreement check", r, seq, {}, 0, start, start + c);
    hostNow_ = start + c;
    // On a GPU the runtime's check also waits for the device (its all-gather is synchronised):
    // not modelled, as auto leaves the checks off there.
    if (w_.waitsBlockHost) computeNow_ = hostNow_;
  }

  /// Master shards on the host come back before their gather reads them, held until the member's
  /// wait. On a GPU the copy runs on the reload stream once the compute has reached the call (the
  /// shard's block was last used there) and the gather waits for it; on CPU ranks the host copies,
  /// once it is there. Returns when the shards are in (the gather's earliest start).
  double reloadMasters(int32_t r, int64_t seq) {
    if (s_.offload.masterBytes == 0) return 0.0;
    uint64_t bytes = 0;
    for (int32_t p : members_) {
      const size_t pi = static_cast<size_t>(p);
      if (!s_.offload.masterOnHost[pi] || masterLive_[pi]) continue;
      masterLive_[pi] = w_.params[pi].mem.master;
      bytes += masterLive_[pi];
    }
    if (bytes == 0) return 0.0;
    liveMasters_ += bytes;
    const double copy = cost_.copyUs(bytes, true);
    res_.masterReloadUs += copy;
    if (w_.waitsBlockHost) {
      const double start = w_.hostLane ? std::max(computeNow_, hostNow_) : computeNow_;
      if (record_) event(Stream::Compute, "reload master shards", r, seq, {}, bytes, start, start + copy);
      computeNow_ = start + copy;
      if (w_.hostLane) hostNow_ = computeNow_;
      res_.masterReloadExposedUs += copy;
      return computeNow_;
    }
    const double start = std::max(computeNow_, reloadFree_);
    reloadFree_ = start + copy;
    if (record_) event(Stream::Reload, "reload master shards", r, seq, {}, bytes, start, reloadFree_);
    return reloadFree_;
  }

  /// callerGrad: the bytes of the gradient a reduce_grad launching the bucket was called with.
  void reduce(const CompiledSchedule::Graph& cg, size_t b, Collective op, int32_t r, int64_t seq,
              uint64_t callerGrad = 0) {
    launched_[b] = 1;
    uint64_t bytes = cg.bucketBytes[b];
    agreementCheck(false, r, seq);
    double start = std::max(computeNow_, reduceFree_);
    double dur = cost_.us(op, bytes);
    reduceFree_ = start + dur;
    const uint64_t buffer = w_.memory.allocation(bytes);
    // What each reduction leaves (RuntimeMemory::reduced): output slices held with the bucket,
    // and at a parameter's first reduction of the optimizer step its shard's gradient, kept.
    uint64_t outputs = 0, newShards = 0;
    for (int32_t p : cg.bucketParams[b]) {
      const size_t pi = static_cast<size_t>(p);
      const ReducedMemory left = w_.memory.reduced(w_.params[pi].mem, !hasShardGrad_[pi]);
      hasShardGrad_[pi] = 1;
      outputs += left.held;
      newShards += left.kept;
    }
    shardGrads_ += newShards;
    // The bucket lives from its launch until the next launch (the runtime frees the previous
    // bucket there, on the host) or the end of the backward: ZeRO-1's flat buffer, which it
    // filled since its first gradient and all-reduces in place; ZeRO-2/3's packed input (none
    // apart from the output at one rank), the reduce-scatter's scratch and its output.
    uint64_t held = buffer;
    if (w_.stage < 2) {
      filling_ -= buffer;
    } else {
      held = w_.memory.packedInput(bytes) + w_.memory.reduceScatterScratch(bytes) + outputs;
      // The gradients it packs are freed once it is laid out: while it is, both are held; the
      // gradient of the reduce_grad that launches it stays until that op returns (its caller
      // holds it).
      const uint64_t packed = deferred_[b];
      const uint64_t added = held + newShards;
      momentary_ += std::max(packed + buffer, added + callerGrad) - added;
      pendingBytes_ -= packed;
      deferred_[b] = 0;
    }
    pendingBytes_ += held;
    releaseAfterSample_ += heldInput_;
    heldInput_ = held;
    res_.reduceBusyUs += dur;
    res_.reduceCalls++;
    if (record_) {
      event(Stream::Reduce, std::string(collectiveName(op)) + " bucket " + std::to_string(b), r, seq, {},
            bytes, start, reduceFree_);
    }
  }

  void flush(const CompiledSchedule::Graph& cg, Collective op, int32_t r, int64_t seq) {
    for (size_t b = 0; b < arrived_.size(); ++b) {
      if (arrived_[b] > 0 && !launched_[b]) reduce(cg, b, op, r, seq);
    }
  }

  /// The memory in use now, with `activation` bytes of activations.
  uint64_t inUse(uint64_t activation) const {
    // Offloaded optimizer state is on the host outside the optimizer step, offloaded master shards
    // outside their gathers and their group's update.
    const uint64_t offloaded = s_.offload.bytes + s_.offload.masterBytes;
    return w_.baselineBytes - std::min(w_.baselineBytes, offloaded) + livePersistent_ + activation +
           liveGathered_ + filling_ + pendingBytes_ + liveScratch_ + momentary_ + shardGrads_ + liveMasters_;
  }

  void sample(double now, uint64_t activation, int32_t r, int64_t seq, bool atOp) {
    const uint64_t m = inUse(activation);
    momentary_ = 0;  // scratch of a call while it is issued: in the sample right after it only
    peak_ = std::max(peak_, m);
    if (record_) res_.memory.push_back(MemorySample{now, m, r, seq, atOp, w_.hostLane ? hostNow_ : now});
  }

  void event(Stream s, std::string name, int32_t r, int64_t seq, std::vector<int64_t> ids, uint64_t bytes,
             double start, double end) {
    res_.timeline.push_back(TimelineEvent{s, std::move(name), r, seq, std::move(ids), bytes, start, end});
  }

  const Workload& w_;
  const CostModel& cost_;
  const CompiledSchedule& s_;
  bool record_;
  int64_t referenceCalls_;
  const SimResult* reference_;  ///< the recorded run's simulation (host lane only)
  size_t opIndex_ = 0;          ///< the op in progress, counted over the step's runs
  /// The recorded run's simulation: recorded issue times of ops that issued no collective, by role.
  std::vector<std::vector<double>> quiet_ = std::vector<std::vector<double>>(schemas::kOpRoleCount);
  double launchChargedUs_ = 0;  ///< host lane: launch time charged beyond the recorded run's
  SimResult res_;
  std::vector<char> allocated_;
  std::vector<double> readyAt_;
  std::vector<int32_t> gatherCount_;
  std::vector<int32_t> lastMicroStep_;
  std::vector<int32_t> arrived_;
  std::vector<char> launched_;
  std::vector<uint64_t> deferred_;  ///< ZeRO-2/3, per bucket: gradients held until its launch
  std::vector<int32_t> callOf_;     ///< per param: its gather call whose scratch is live, -1: none
  std::vector<uint64_t> callScratch_;
  std::vector<char> hasShardGrad_;  ///< ZeRO-2/3, per param: its gradient shard exists this step
  uint64_t optimizerExcess_ = 0;    ///< offload: the recorded optimizer step above the first op's activations
  uint64_t shardGrads_ = 0;         ///< ZeRO-2/3: the gradient shards this step's reductions made
  uint64_t liveScratch_ = 0;        ///< scratch of gather calls not waited on yet
  std::vector<uint64_t> masterLive_;  ///< per param: its offloaded master shard's bytes while reloaded
  uint64_t liveMasters_ = 0;          ///< offloaded master shards reloaded for a gather, not waited on
  uint64_t momentary_ = 0;          ///< scratch of calls issued since the last sample
  std::vector<int32_t> members_;
  std::vector<int32_t> one_ = std::vector<int32_t>(1, 0);
  uint64_t heldInput_ = 0;           ///< the last bucket launched (and, ZeRO-2/3, its output)
  uint64_t releaseAfterSample_ = 0;  ///< bytes freed once this op's memory is sampled
  uint64_t pendingBytes_ = 0;
  uint64_t filling_ = 0;
  uint64_t liveGathered_ = 0;
  uint64_t livePersistent_ = 0;  ///< persistent copies gathered and not yet dropped
  uint64_t peak_ = 0;
  double computeNow_ = 0;  ///< the compute stream's clock, microseconds into the step
  double workEnd_ = 0;     ///< where the compute stream's last work ended (its waits since are idle)
  double hostNow_ = 0;     ///< the host's clock (Workload::hostLane), microseconds into the step
  double gatherFree_ = 0;
  double reduceFree_ = 0;
  double copyFree_ = 0;
  double reloadFree_ = 0;  ///< the reload stream's clock: master shards copied in for gathers
};

}  // namespace

SimResult simulate(const Workload& workload, const CostModel& cost, const CompiledSchedule& schedule,
                   const SimOptions& options) {
  return Simulation(workload, cost, schedule, options).run();
}

std::optional<double> SimResult::quietIssueUs(OpRole role) const {
  auto of = [&](OpRole r) -> std::optional<double> {
    const size_t k = static_cast<size_t>(r);
    if (k >= quietIssueByRole.size() || quietIssueByRole[k] < 0) return std::nullopt;
    return quietIssueByRole[k];
  };
  if (std::optional<double> own = of(role)) return own;
  return role == OpRole::Gather ? of(OpRole::Release) : std::nullopt;
}

}  // namespace dcplan::planner
