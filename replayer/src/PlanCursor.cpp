// The plan cursor, loading and checking a plan against the live model, and the replay log.
#include "PlanCursor.h"

#include "dcplan/replayer/Runtime.h"
#include "dcplan/schemas/io.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

namespace dcplan::replayer {

namespace {

/// The host's monotonic clock in microseconds (CLOCK_MONOTONIC, as Python's time.monotonic_ns(),
/// which the log's step marks read): an op line's time, comparable with the marks'.
int64_t monotonicUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string jsonIds(const std::vector<int64_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out + "]";
}

std::string describe(const std::string& op, int64_t dsId) {
  return dsId >= 0 ? op + " of ds_id " + std::to_string(dsId) : op;
}

std::string idList(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out;
}

}  // namespace

// ---------------------------------------------------------------- PlanCursor

PlanCursor::PlanCursor(std::string file, std::vector<CursorGraph> graphs, std::vector<int64_t> persistent,
                       OnMismatch onMismatch, c10::ScalarType gatherDtype)
    : file_(std::move(file)),
      persistent_(persistent.begin(), persistent.end()),
      onMismatch_(onMismatch),
      gatherDtype_(gatherDtype) {
  const std::set<int64_t> sorted(persistent.begin(), persistent.end());
  persistentSorted_.assign(sorted.begin(), sorted.end());
  for (CursorGraph& cg : graphs) {
    Planned g;
    g.plan = std::move(cg);
    for (size_t b = 0; b < g.plan.buckets.size(); ++b) {
      for (int64_t id : g.plan.buckets[b]) {
        g.bucketOf[id] = b;
        g.readyOrder.push_back(id);
      }
    }
    if (!g.plan.groups.empty()) g.lastPosition = g.plan.groups.rbegin()->first;
    const int64_t id = g.plan.id;
    graphs_.emplace(id, std::move(g));
  }
}

PlanCursor::~PlanCursor() {
  try {
    flushLog();
  } catch (...) {
    // A destructor never throws; the log is best effort at this point.
  }
}

PlanCursor::Planned* PlanCursor::planned(int64_t graphId) {
  if (!active()) return nullptr;
  auto it = graphs_.find(graphId);
  return it == graphs_.end() ? nullptr : &it->second;
}

void PlanCursor::resetPositions() {
  positions_.clear();
  // An execution cut short (an exception) is not checked at its end.
  for (auto& [id, g] : graphs_) g.run.running = false;
}

void PlanCursor::onStartForward() {
  resetPositions();
  logLine("{\"ev\":\"start_forward\"}");
}

void PlanCursor::onStartBackward(bool update, bool sync) {
  resetPositions();
  logLine(std::string("{\"ev\":\"start_backward\",\"update\":") + (update ? "true" : "false") +
          ",\"sync\":" + (sync ? "true" : "false") + "}");
}

void PlanCursor::startRun(Planned& g) {
  Run& r = g.run;
  r.running = true;
  r.ops.clear();
  r.prefetched.clear();
  r.ready = 0;
  r.reduced.clear();
  r.bucketed.clear();
  r.arrived.assign(g.plan.buckets.size(), 0);
}

std::optional<std::pair<std::string, std::string>> PlanCursor::check(Planned& g, int64_t pos, const Op& op) {
  Run& r = g.run;
  // Described only on a departure: this runs for every op.
  auto actual = [&op] { return describe(op.first, op.second); };
  // Every execution of a graph issues the same ops (the planner refuses traces
  // where they differ), so the first one fixes the rest exactly.
  if (r.learned) {
    const auto& want = *r.learned;
    if (pos >= static_cast<int64_t>(want.size())) {
      return std::make_pair("the end of the graph (" + std::to_string(want.size()) + " ops)", actual());
    }
    if (want[static_cast<size_t>(pos)] != op) {
      return std::make_pair(
          describe(want[static_cast<size_t>(pos)].first, want[static_cast<size_t>(pos)].second), actual());
    }
  }
  // What the plan itself implies: gradients arrive in the order of its buckets.
  if (op.first == "reduce_grad" && g.plan.backward && !g.readyOrder.empty()) {
    if (!r.reduced.count(op.second)) {
      if (r.ready >= g.readyOrder.size() || g.readyOrder[r.ready] != op.second) {
        std::string expected = r.ready < g.readyOrder.size()
                                   ? "reduce_grad of ds_id " + std::to_string(g.readyOrder[r.ready]) +
                                         " (bucket " + std::to_string(g.bucketOf[g.readyOrder[r.ready]]) +
                                         " of the plan)"
                                   : "no further gradient (every bucket of the plan is complete)";
        return std::make_pair(expected, actual());
      }
      r.reduced.insert(op.second);
      ++r.ready;
    }
  }
  if (op.first == "end_backward" && r.ready < g.readyOrder.size()) {
    return std::make_pair("reduce_grad of ds_id " + std::to_string(g.readyOrder[r.ready]) + " (bucket " +
                              std::to_string(g.bucketOf[g.readyOrder[r.ready]]) + " of the plan)",
                          actual());
  }
  return std::nullopt;
}

std::vector<SchedulePolicy::Prefetch> PlanCursor::beforeOp(const OpEvent& event) {
  const int64_t pos = positions_[event.graphId]++;
  curGraph_ = event.graphId;
  curPos_ = pos;
  launching_.clear();
  if (log_) {
    const int64_t enteredUs = monotonicUs();  // before the memory gauge, which may take a while
    std::string memory;
    if (gauge_) {
      const OpMemory m = gauge_();
      memory = ",\"mem\":" + std::to_string(m.inUse);
      if (m.peakBefore >= 0) memory += ",\"peak\":" + std::to_string(m.peakBefore);
    }
    logLine("{\"ev\":\"op\",\"graph\":" + std::to_string(event.graphId) + ",\"pos\":" + std::to_string(pos) +
            ",\"op\":" + jsonString(event.op) + ",\"ds_id\":" + std::to_string(event.dsId) + memory +
            ",\"t_us\":" + std::to_string(enteredUs) + "}");
  }
  Planned* g = planned(event.graphId);
  if (g == nullptr) return {};
  if (!g->run.running) startRun(*g);
  const Op op{event.op, event.dsId};
  if (auto departure = check(*g, pos, op)) {
    depart(event.graphId, pos, departure->first, departure->second);
    return {};
  }
  g->run.ops.push_back(op);
  std::vector<Prefetch> out;
  auto it = g->plan.groups.find(pos);
  if (it != g->plan.groups.end()) {
    for (const auto& ids : it->second) {
      out.push_back(Prefetch{ids, gatherDtype_});
      launching_.push_back(ids);
      for (int64_t id : ids) g->run.prefetched[id].push_back(pos);
    }
  }
  // A parameter prefetched at or before this position is gathered by the op it was prefetched for.
  if (op.first == "allgather_param") g->run.prefetched.erase(op.second);
  return out;
}

void PlanCursor::onGatherLaunched(int64_t graphId, const std::vector<int64_t>& dsIds, int64_t bytes,
                                  bool planned) {
  if (!log_) return;
  // A planned group is logged as the plan lists it, with what it really gathered.
  std::string ids = jsonIds(dsIds);
  std::string group = "[]";
  if (planned && !launching_.empty()) {
    // The executor reports the groups beforeOp returned, in order.
    group = jsonIds(launching_.front());
    launching_.erase(launching_.begin());
  }
  logLine(std::string("{\"ev\":\"") + (planned ? "prefetch" : "gather") +
          "\",\"graph\":" + std::to_string(graphId) + ",\"pos\":" + std::to_string(curPos_) +
          (planned ? ",\"ds_ids\":" + group + ",\"launched\":" + ids : ",\"ds_ids\":" + ids) +
          ",\"bytes\":" + std::to_string(bytes) + "}");
}

bool PlanCursor::keepGathered(int64_t dsId, bool registeredPersistent, bool stageKeepsAll) {
  bool keep = SchedulePolicy::keepGathered(dsId, registeredPersistent, stageKeepsAll);
  if (active() && persistent_.count(dsId)) keep = true;
  if (log_) {
    logLine("{\"ev\":\"release\",\"graph\":" + std::to_string(curGraph_) +
            ",\"pos\":" + std::to_string(curPos_) + ",\"ds_id\":" + std::to_string(dsId) +
            ",\"kept\":" + (keep ? "true" : "false") + "}");
  }
  return keep;
}

bool PlanCursor::flushBefore(int64_t graphId, int64_t pendingBytes, int64_t nextBytes, int64_t bucketBytes) {
  Planned* g = planned(graphId);
  if (g != nullptr && !g->plan.buckets.empty()) return false;  // the plan's boundaries, not a size
  return SchedulePolicy::flushBefore(graphId, pendingBytes, nextBytes, bucketBytes);
}

bool PlanCursor::flushAfter(int64_t graphId, int64_t dsId) {
  Planned* g = planned(graphId);
  if (g == nullptr) return false;
  auto it = g->bucketOf.find(dsId);
  if (it == g->bucketOf.end()) return false;
  Run& r = g->run;
  if (r.arrived.size() != g->plan.buckets.size()) r.arrived.assign(g->plan.buckets.size(), 0);
  // A gradient that arrives again (a parameter used twice) joins whatever bucket fills now.
  if (!r.bucketed.insert(dsId).second) return false;
  const size_t b = it->second;
  return ++r.arrived[b] == static_cast<int64_t>(g->plan.buckets[b].size());
}

const std::vector<int64_t>* PlanCursor::plannedBucket(int64_t graphId, int64_t dsId) {
  if (!active()) return nullptr;
  Planned* g = planned(graphId);
  if (g == nullptr) return nullptr;
  auto it = g->bucketOf.find(dsId);
  return it == g->bucketOf.end() ? nullptr : &g->plan.buckets[it->second];
}

void PlanCursor::onFlush(int64_t graphId, const std::vector<int64_t>& dsIds, int64_t bytes) {
  if (!log_) return;
  logLine("{\"ev\":\"flush\",\"graph\":" + std::to_string(graphId) + ",\"pos\":" + std::to_string(curPos_) +
          ",\"ds_ids\":" + jsonIds(dsIds) + ",\"bytes\":" + std::to_string(bytes) + "}");
}

void PlanCursor::endRun(Planned& g, int64_t pos) {
  Run& r = g.run;
  r.running = false;
  std::optional<std::pair<std::string, std::string>> departure;
  const std::string actual = "the end of the graph after " + std::to_string(pos) + " ops";
  if (r.learned && static_cast<int64_t>(r.learned->size()) > pos) {
    const Op& next = (*r.learned)[static_cast<size_t>(pos)];
    departure = std::make_pair(describe(next.first, next.second), actual);
  } else if (g.lastPosition >= pos) {
    departure = std::make_pair("an op at position " + std::to_string(g.lastPosition) +
                                   " (the plan prefetches ds_ids " +
                                   idList(g.plan.groups.rbegin()->second.front()) + " there)",
                               actual);
  } else {
    for (const auto& [id, positions] : r.prefetched) {
      if (positions.empty()) continue;
      departure = std::make_pair("allgather_param of ds_id " + std::to_string(id) +
                                     " (prefetched at position " + std::to_string(positions.front()) + ")",
                                 actual);
      break;
    }
  }
  if (departure) {
    depart(g.plan.id, pos, departure->first, departure->second);
    return;
  }
  if (!r.learned) r.learned = r.ops;
}

void PlanCursor::onGraphEnd(int64_t graphId) {
  // end_forward reports -1: every forward graph that ran ends there.
  for (auto& [id, g] : graphs_) {
    if (!active()) break;
    if (!g.run.running) continue;
    if (graphId == -1 ? g.plan.backward : id != graphId) continue;
    endRun(g, positions_[id]);
  }
  if (log_) {
    logLine("{\"ev\":\"end\",\"graph\":" + std::to_string(graphId) + "}");
    log_->flush();
  }
}

void PlanCursor::depart(int64_t graphId, int64_t pos, const std::string& expected,
                        const std::string& actual) {
  departed_ = true;
  const auto it = graphs_.find(graphId);
  const std::string kind = it != graphs_.end() && it->second.plan.backward ? "backward" : "forward";
  // Plain concatenation: cheaper than a stream, and independent of std::locale.
  const std::string msg = file_ + ": the run departs from the plan in graph " + std::to_string(graphId) +
                          " (" + kind + ") at position " + std::to_string(pos) + ": expected " + expected +
                          ", got " + actual;
  if (log_) {
    logLine("{\"ev\":\"departure\",\"graph\":" + std::to_string(graphId) + ",\"pos\":" + std::to_string(pos) +
            ",\"expected\":" + jsonString(expected) + ",\"actual\":" + jsonString(actual) +
            ",\"action\":" + (onMismatch_ == OnMismatch::Error ? "\"error\"" : "\"fallback\"") + "}");
    log_->flush();
  }
  if (onMismatch_ == OnMismatch::Error) {
    TORCH_CHECK(false, msg, "; on_mismatch=\"fallback\" continues without the plan (gather on use)");
  }
  // Python warns (once) at the next hook boundary: a warning raised here would
  // not reach Python from every caller (end_forward runs outside the dispatcher).
  departure_ = msg + "; continuing without the plan (gather on use, default buckets)";
}

std::string PlanCursor::takeDeparture() {
  if (departureTaken_) return {};
  departureTaken_ = !departure_.empty();
  return departure_;
}

void PlanCursor::openLog(const std::string& path, MemoryGauge gauge) {
  flushLog();
  log_.reset();
  logPath_ = path;
  gauge_ = path.empty() ? MemoryGauge{} : std::move(gauge);
  if (path.empty()) return;
  auto f = std::make_unique<std::ofstream>(path, std::ios::out | std::ios::trunc);
  TORCH_CHECK(f->good(), "replay log: cannot open ", path, " for writing");
  log_ = std::move(f);
  logPlan();
}

void PlanCursor::logPlan() {
  if (hasPlan()) {
    logLine("{\"ev\":\"plan\",\"file\":" + jsonString(file_) +
            ",\"persistent\":" + jsonIds(persistentSorted_) + "}");
  } else {
    logLine("{\"ev\":\"plan\",\"file\":null,\"persistent\":[]}");
  }
}

void PlanCursor::flushLog() {
  if (log_) log_->flush();
}

void PlanCursor::takeLogFrom(PlanCursor& other) {
  other.flushLog();
  const std::string path = other.logPath_;
  other.log_.reset();
  other.logPath_.clear();
  gauge_ = std::move(other.gauge_);
  other.gauge_ = {};
  if (!path.empty()) {
    // Reopen for appending: what the other cursor wrote stays.
    log_ = std::make_unique<std::ofstream>(path, std::ios::out | std::ios::app);
    TORCH_CHECK(log_->good(), "replay log: cannot open ", path, " for writing");
    logPath_ = path;
  }
}

void PlanCursor::logLine(const std::string& json) {
  if (log_) *log_ << json << '\n';
}

// ---------------------------------------------------------------- loading

std::string liveSignature(const LiveModel& model) {
  std::vector<schemas::TraceParam> params;
  for (const LiveParam& lp : model.params) {
    schemas::TraceParam tp;
    tp.id = lp.dsId;
    tp.name = lp.name;
    tp.shape = lp.shape;
    tp.dtype = lp.dtype;
    params.push_back(std::move(tp));
  }
  return schemas::paramSignature(params, model.worldSize);
}

namespace {

[[noreturn]] void refuse(const std::string& file, const std::string& pointer, const std::string& what) {
  throw PlanError(file + ": " + pointer + ": " + what);
}

/// The first id the plan names that the live model lacks, as "<pointer>: ds_id N".
std::optional<std::string> unknownId(const schemas::Plan& plan, const std::set<int64_t>& live) {
  auto at = [&](const std::vector<int64_t>& ids, const std::string& base) -> std::optional<std::string> {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!live.count(ids[i])) return base + "/" + std::to_string(i) + ": ds_id " + std::to_string(ids[i]);
    }
    return std::nullopt;
  };
  if (auto u = at(plan.persistent, "/persistent")) return u;
  for (size_t g = 0; g < plan.graphs.size(); ++g) {
    const std::string gp = "/graphs/" + std::to_string(g);
    for (size_t k = 0; k < plan.graphs[g].prefetch.size(); ++k) {
      if (auto u = at(plan.graphs[g].prefetch[k].dsIds, gp + "/prefetch/" + std::to_string(k) + "/ds_ids"))
        return u;
    }
    for (size_t b = 0; b < plan.graphs[g].buckets.size(); ++b) {
      if (auto u = at(plan.graphs[g].buckets[b].dsIds, gp + "/buckets/" + std::to_string(b) + "/ds_ids"))
        return u;
    }
  }
  return std::nullopt;
}

/// The cursor installed as the schedule, if any.
PlanCursor* installedCursor(SchedulePolicy& s) { return dynamic_cast<PlanCursor*>(&s); }

}  // namespace

PlanSummary loadPlan(const std::string& path, const LiveModel& model, OnMismatch onMismatch) {
  schemas::Plan plan;
  try {
    plan = schemas::readPlan(path);
  } catch (const schemas::InputError& e) {
    throw PlanError(e.what());
  } catch (const std::exception& e) {
    throw PlanError(path + ": " + e.what());
  }
  const schemas::PlanSource& src = plan.source;
  if (src.worldSize != model.worldSize) {
    refuse(path, "/source/world_size",
           "the plan is for " + std::to_string(src.worldSize) + " ranks, this run has " +
               std::to_string(model.worldSize));
  }
  if (src.stage != model.stage) {
    refuse(path, "/source/stage",
           "the plan is for ZeRO stage " + std::to_string(src.stage) + ", this run uses stage " +
               std::to_string(model.stage));
  }
  const std::string replay = model.compiled ? "compiled" : "eager";
  if (src.replay != replay) {
    refuse(path, "/source/replay",
           "the plan was made from a trace of the " + src.replay + " model, this run is " + replay +
               " (dcplan.shard(compile=" + (model.compiled ? "True" : "False") +
               ")): their op sequences differ; record the model as it runs here and plan again");
  }
  std::set<int64_t> live;
  std::set<int64_t> frozen;
  for (const LiveParam& p : model.params) {
    live.insert(p.dsId);
    if (!p.trainable) frozen.insert(p.dsId);
  }
  const std::string signature = liveSignature(model);
  if (signature != src.paramSignature) {
    std::string what = "the plan is for another model: its parameter signature is " + src.paramSignature +
                       ", this model's (" + std::to_string(model.params.size()) +
                       " parameters: names, shapes, dtypes) is " + signature;
    if (auto u = unknownId(plan, live)) what += "; " + *u + " is not a parameter of this model";
    refuse(path, "/source/param_signature", what);
  }
  if (auto u = unknownId(plan, live))
    refuse(path, u->substr(0, u->find(':')),
           u->substr(u->find(':') + 2) + " is not a parameter of this model");
  std::vector<CursorGraph> graphs;
  PlanSummary summary;
  summary.signature = signature;
  summary.persistent = plan.persistent;
  for (size_t gi = 0; gi < plan.graphs.size(); ++gi) {
    const schemas::PlanGraph& pg = plan.graphs[gi];
    const std::string gp = "/graphs/" + std::to_string(gi);
    const bool backward = pg.kind == schemas::GraphKind::Backward;
    if (pg.id != model.forwardGraph && pg.id != model.backwardGraph) {
      refuse(path, gp + "/id",
             "graph " + std::to_string(pg.id) + " is not a graph of this model (its forward is graph " +
                 std::to_string(model.forwardGraph) + ", its backward graph " +
                 std::to_string(model.backwardGraph) + ")");
    }
    const bool liveBackward = pg.id == model.backwardGraph;
    if (backward != liveBackward) {
      refuse(path, gp + "/kind",
             "graph " + std::to_string(pg.id) + " is this model's " +
                 (liveBackward ? "backward" : "forward") + ", the plan says " +
                 schemas::graphKindName(pg.kind));
    }
    CursorGraph cg;
    cg.id = pg.id;
    cg.backward = backward;
    for (const schemas::PrefetchGroup& grp : pg.prefetch) {
      cg.groups[grp.position].push_back(grp.dsIds);
      ++summary.prefetchGroups;
    }
    for (size_t b = 0; b < pg.buckets.size(); ++b) {
      const schemas::PlanBucket& bk = pg.buckets[b];
      if (bk.dtype != model.reduceDtype) {
        refuse(path, gp + "/buckets/" + std::to_string(b) + "/dtype",
               "the plan reduces in " + bk.dtype + ", this run reduces in " + model.reduceDtype);
      }
      // Freezing a parameter keeps the plan: its gradient never arrives.
      std::vector<int64_t> ids;
      for (int64_t id : bk.dsIds) {
        if (!frozen.count(id)) ids.push_back(id);
      }
      if (!ids.empty()) cg.buckets.push_back(std::move(ids));
      ++summary.buckets;
    }
    graphs.push_back(std::move(cg));
  }
  auto cursor = std::make_unique<PlanCursor>(path, std::move(graphs), plan.persistent, onMismatch,
                                             model.gatherDtype.value_or(c10::ScalarType::Undefined));
  std::string loaded;
  withSchedule([&](SchedulePolicy& s) {
    if (PlanCursor* old = installedCursor(s)) {
      if (old->hasPlan()) {
        loaded = old->file();
        return;
      }
      cursor->takeLogFrom(*old);
    }
  });
  if (!loaded.empty()) {
    throw PlanError(path + ": a plan (" + loaded +
                    ") already drives this runtime; one plan per process (call dcplan.shutdown() first)");
  }
  cursor->logPlan();
  setSchedule(std::move(cursor));
  return summary;
}

void setReplayLog(const std::string& path, MemoryGauge gauge) {
  bool haveCursor = false;
  withSchedule([&](SchedulePolicy& s) {
    if (PlanCursor* c = installedCursor(s)) {
      c->openLog(path, std::move(gauge));
      haveCursor = true;
    }
  });
  if (haveCursor || path.empty()) return;
  auto cursor = std::make_unique<PlanCursor>();
  cursor->openLog(path, std::move(gauge));
  setSchedule(std::move(cursor));
}

void flushReplayLog() {
  withSchedule([](SchedulePolicy& s) {
    if (PlanCursor* c = installedCursor(s)) c->flushLog();
  });
}

void logReplayEvent(const std::string& json) {
  withSchedule([&](SchedulePolicy& s) {
    if (PlanCursor* c = installedCursor(s)) c->logLine(json);
  });
}

std::string takePlanDeparture() {
  std::string out;
  withSchedule([&](SchedulePolicy& s) {
    if (PlanCursor* c = installedCursor(s)) out = c->takeDeparture();
  });
  return out;
}

bool planActive() {
  bool active = false;
  withSchedule([&](SchedulePolicy& s) {
    if (PlanCursor* c = installedCursor(s)) active = c->active();
  });
  return active;
}

}  // namespace dcplan::replayer
