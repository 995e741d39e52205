// The plan cursor, loading and checking a plan against the live model, and the replay log.
#include "PlanCursor.h"

#include "dcplan/replayer/HostClock.h"
#include "dcplan/replayer/Runtime.h"
#include "dcplan/schemas/io.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace dcplan::replayer {

namespace {

std::string idList(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out;
}

}  // namespace

// ---------------------------------------------------------------- PlanCursor

PlanCursor::PlanCursor(std::string file, std::vector<CursorGraph> graphs, std::vector<int64_t> persistent,
                       OnMismatch onMismatch, c10::ScalarType gatherDtype,
                       std::unordered_map<int64_t, std::string> names)
    : file_(std::move(file)),
      names_(std::move(names)),
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
  if (log_) logJson({{"ev", "start_forward"}});
}

void PlanCursor::onStartBackward(bool update, bool sync) {
  resetPositions();
  stepFollows_ = sync;
  if (log_) logJson({{"ev", "start_backward"}, {"update", update}, {"sync", sync}});
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
  for (auto it = heldAt_.begin(); it != heldAt_.end();)
    it = it->first.first == g.plan.id ? heldAt_.erase(it) : ++it;
}

std::optional<schemas::OpRole> PlanCursor::roleOf(const char* name) {
  auto it = roles_.find(name);
  if (it == roles_.end()) it = roles_.emplace(name, schemas::opRole(name)).first;
  return it->second;
}

std::string PlanCursor::describe(const char* op, int64_t dsId, const std::string& note) const {
  if (dsId < 0) return op;
  const std::string id = "ds_id " + std::to_string(dsId);
  auto it = names_.find(dsId);
  if (it == names_.end() || it->second.empty()) {
    return std::string(op) + " of " + id + (note.empty() ? "" : " (" + note + ")");
  }
  return std::string(op) + " of " + it->second + " (" + id + (note.empty() ? "" : ", " + note) + ")";
}

std::string PlanCursor::expectedGradient(const Planned& g) const {
  const int64_t id = g.readyOrder[g.run.ready];
  return describe("reduce_grad", id, "bucket " + std::to_string(g.bucketOf.at(id)) + " of the plan");
}

std::optional<PlanCursor::Departure> PlanCursor::check(Planned& g, int64_t pos, const Op& op) {
  Run& r = g.run;
  // Described only on a departure: this runs for every op.
  auto actual = [&] { return describe(op.name, op.dsId); };
  // Every execution of a graph issues the same ops (the planner refuses traces
  // where they differ), so the first one fixes the rest exactly.
  if (r.learned) {
    const std::vector<Op>& want = *r.learned;
    if (pos >= static_cast<int64_t>(want.size())) {
      return Departure{"the end of the graph (" + std::to_string(want.size()) + " ops)", actual()};
    }
    const Op& expected = want[static_cast<size_t>(pos)];
    if (!(expected == op)) return Departure{describe(expected.name, expected.dsId), actual()};
  }
  // What the plan itself implies: gradients arrive in the order of its buckets.
  if (op.role == schemas::OpRole::ReduceGrad && g.plan.backward && !g.readyOrder.empty() &&
      !r.reduced.count(op.dsId)) {
    if (r.ready >= g.readyOrder.size()) {
      return Departure{"no further gradient (every bucket of the plan is complete)", actual()};
    }
    if (g.readyOrder[r.ready] != op.dsId) return Departure{expectedGradient(g), actual()};
    r.reduced.insert(op.dsId);
    ++r.ready;
  }
  if (op.role == schemas::OpRole::EndBackward && r.ready < g.readyOrder.size())
    return Departure{expectedGradient(g), actual()};
  return std::nullopt;
}

std::vector<SchedulePolicy::Prefetch> PlanCursor::beforeOp(const OpEvent& event) {
  const int64_t pos = positions_[event.graphId]++;
  curGraph_ = event.graphId;
  curPos_ = pos;
  launching_.clear();
  if (log_) {
    const int64_t enteredNs = monotonicNs();  // before the memory gauge, which may take a while
    nlohmann::ordered_json line{
        {"ev", "op"}, {"graph", event.graphId}, {"pos", pos}, {"op", event.op}, {"ds_id", event.dsId}};
    if (gauge_) {
      const OpMemory m = gauge_();
      line["mem"] = m.inUse;
      if (m.peakBefore >= 0) line["peak"] = m.peakBefore;
    }
    line["t_us"] = logClockUs(enteredNs);
    logJson(line, enteredNs);
  }
  Planned* g = planned(event.graphId);
  if (g == nullptr) return {};
  if (!g->run.running) startRun(*g);
  const Op op{event.op, roleOf(event.op), event.dsId};
  if (auto departure = check(*g, pos, op)) {
    depart(event.graphId, pos, *departure);
    return {};
  }
  g->run.ops.push_back(op);
  std::vector<Prefetch> out;
  auto it = g->plan.groups.find(pos);
  if (it != g->plan.groups.end()) {
    for (const CursorGroup& group : it->second) {
      out.push_back(Prefetch{group.dsIds, gatherDtype_, group.peakBytes});
      launching_.push_back(group.dsIds);
      for (int64_t id : group.dsIds) g->run.prefetched[id].push_back(pos);
    }
  }
  // A parameter prefetched at or before this position is gathered by the op it was prefetched for.
  if (op.role == schemas::OpRole::Gather) g->run.prefetched.erase(op.dsId);
  return out;
}

void PlanCursor::onGatherLaunched(int64_t graphId, const std::vector<int64_t>& dsIds, int64_t bytes,
                                  bool planned) {
  if (!log_) return;
  nlohmann::ordered_json line{{"ev", planned ? "prefetch" : "gather"}, {"graph", graphId}, {"pos", curPos_}};
  if (planned) {
    // A planned group is logged as the plan lists it, with what it really gathered. The
    // executor reports the groups beforeOp returned, in order.
    line["ds_ids"] = launching_.empty() ? std::vector<int64_t>{} : launching_.front();
    if (!launching_.empty()) launching_.erase(launching_.begin());
    line["launched"] = dsIds;
  } else {
    line["ds_ids"] = dsIds;
    // A member of a group the budget guard held back, gathered by its own op.
    for (int64_t id : dsIds) {
      const auto held = heldAt_.find({graphId, id});
      if (held == heldAt_.end()) continue;
      line["held_at"] = held->second;
      heldAt_.erase(held);
    }
  }
  line["bytes"] = bytes;
  logJson(line);
}

void PlanCursor::onGuardHold(int64_t graphId, const GuardHold& hold) {
  std::vector<int64_t> planned = hold.held;
  const bool prefetch = std::strcmp(hold.kind, "prefetch") == 0;
  if (prefetch && !launching_.empty()) {  // the group as the plan lists it (beforeOp returned it)
    planned = launching_.front();
    launching_.erase(launching_.begin());
  }
  if (!log_) return;
  logJson({{"ev", "hold"},
           {"kind", hold.kind},
           {"graph", graphId},
           {"pos", curPos_},
           {"ds_ids", planned},
           {"held", hold.held},
           {"bytes", hold.bytes},
           {"peak", hold.peakBytes},
           {"excess", hold.excessBytes},
           {"budget", hold.budgetBytes}});
  if (prefetch) {
    for (int64_t id : hold.held) heldAt_[{graphId, id}] = curPos_;
  }
}

bool PlanCursor::keepGathered(int64_t dsId, bool registeredPersistent, bool stageKeepsAll, bool trainable) {
  bool keep = SchedulePolicy::keepGathered(dsId, registeredPersistent, stageKeepsAll, trainable);
  if (active() && persistent_.count(dsId) && !stageKeepsAll && !registeredPersistent) {
    // A planned copy of a trainable parameter ends in the backward before an optimizer step,
    // which makes it stale, at the release the plan names (its last in the graph: the planner's
    // memory model drops it there, endsPersistentCopy); the backward's end drops the others.
    const Planned* g = planned(curGraph_);
    keep = !(trainable && stepFollows_ && g != nullptr && g->plan.persistentEnds.count({curPos_, dsId}));
  }
  if (log_)
    logJson({{"ev", "release"}, {"graph", curGraph_}, {"pos", curPos_}, {"ds_id", dsId}, {"kept", keep}});
  return keep;
}

int64_t PlanCursor::keptPeak(int64_t dsId) {
  if (!active()) return -1;
  const auto it = keptPeaks_.find(dsId);
  return it == keptPeaks_.end() ? -1 : it->second;
}

void PlanCursor::setKeptPeaks(const std::vector<int64_t>& persistent, const std::vector<uint64_t>& peaks) {
  keptPeaks_.clear();
  for (size_t i = 0; i < persistent.size() && i < peaks.size(); ++i) {
    if (peaks[i] > 0) keptPeaks_[persistent[i]] = static_cast<int64_t>(peaks[i]);  // 0: nothing to guard
  }
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
  if (log_)
    logJson({{"ev", "flush"}, {"graph", graphId}, {"pos", curPos_}, {"ds_ids", dsIds}, {"bytes", bytes}});
}

void PlanCursor::endRun(Planned& g, int64_t pos) {
  Run& r = g.run;
  r.running = false;
  std::optional<Departure> departure;
  const std::string actual = "the end of the graph after " + std::to_string(pos) + " ops";
  if (r.learned && static_cast<int64_t>(r.learned->size()) > pos) {
    const Op& next = (*r.learned)[static_cast<size_t>(pos)];
    departure = Departure{describe(next.name, next.dsId), actual};
  } else if (g.lastPosition >= pos) {
    departure =
        Departure{"an op at position " + std::to_string(g.lastPosition) + " (the plan prefetches ds_ids " +
                      idList(g.plan.groups.rbegin()->second.front().dsIds) + " there)",
                  actual};
  } else {
    for (const auto& [id, positions] : r.prefetched) {
      if (positions.empty()) continue;
      departure = Departure{
          describe("allgather_param", id, "prefetched at position " + std::to_string(positions.front())),
          actual};
      break;
    }
  }
  if (departure) {
    depart(g.plan.id, pos, *departure);
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
    logJson({{"ev", "end"}, {"graph", graphId}});
    flushLog();
  }
}

void PlanCursor::depart(int64_t graphId, int64_t pos, const Departure& d) {
  const std::string& expected = d.expected;
  const std::string& actual = d.actual;
  departed_ = true;
  const auto it = graphs_.find(graphId);
  const std::string kind = it != graphs_.end() && it->second.plan.backward ? "backward" : "forward";
  // Plain concatenation: cheaper than a stream, and independent of std::locale.
  const std::string msg = file_ + ": the run departs from the plan in graph " + std::to_string(graphId) +
                          " (" + kind + ") at position " + std::to_string(pos) + ": expected " + expected +
                          ", got " + actual;
  if (log_) {
    logJson({{"ev", "departure"},
             {"graph", graphId},
             {"pos", pos},
             {"expected", expected},
             {"actual", actual},
             {"action", onMismatch_ == OnMismatch::Error ? "error" : "fallback"}});
    flushLog();
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

void PlanCursor::openLog(const std::string& path, MemoryGauge gauge, bool leaveOutOwnTime, LogRank who) {
  flushLog();
  log_.reset();
  logPath_ = path;
  gauge_ = path.empty() ? MemoryGauge{} : std::move(gauge);
  logNs_ = 0;
  leaveOutOwnTime_ = leaveOutOwnTime;
  logRank_ = who;
  if (path.empty()) return;
  auto f = std::make_unique<std::ofstream>(path, std::ios::out | std::ios::trunc);
  TORCH_CHECK(f->good(), "replay log: cannot open ", path, " for writing");
  log_ = std::move(f);
  logPlan();
}

void PlanCursor::logPlan() {
  nlohmann::ordered_json line{
      {"ev", "plan"},
      {"file", hasPlan() ? nlohmann::ordered_json(file_) : nlohmann::ordered_json(nullptr)},
      {"persistent", persistentSorted_}};
  if (logRank_.rank >= 0) {
    line["rank"] = logRank_.rank;
    line["world_size"] = logRank_.worldSize;
  }
  if (!names_.empty()) {
    // The checks name parameters as the messages here do (ds_id -> qualified name, by ds_id).
    const std::map<int64_t, std::string> sorted(names_.begin(), names_.end());
    nlohmann::ordered_json names = nlohmann::ordered_json::object();
    for (const auto& [id, name] : sorted) names[std::to_string(id)] = name;
    line["names"] = std::move(names);
  }
  logJson(line);
}

void PlanCursor::flushLog() {
  if (!log_) return;
  const int64_t start = monotonicNs();
  log_->flush();
  logNs_ += monotonicNs() - start;
}

void PlanCursor::takeLogFrom(PlanCursor& other) {
  other.flushLog();
  const std::string path = other.logPath_;
  other.log_.reset();
  other.logPath_.clear();
  gauge_ = std::move(other.gauge_);
  other.gauge_ = {};
  logNs_ = other.logNs_;  // one log, one clock
  leaveOutOwnTime_ = other.leaveOutOwnTime_;
  logRank_ = other.logRank_;
  if (!path.empty()) {
    // Reopen for appending: what the other cursor wrote stays.
    log_ = std::make_unique<std::ofstream>(path, std::ios::out | std::ios::app);
    TORCH_CHECK(log_->good(), "replay log: cannot open ", path, " for writing");
    logPath_ = path;
  }
}

void PlanCursor::logLine(const std::string& json) {
  if (!log_) return;
  const int64_t start = monotonicNs();
  *log_ << json << '\n';
  logNs_ += monotonicNs() - start;
}

void PlanCursor::logJson(const nlohmann::ordered_json& line, int64_t sinceNs) {
  if (!log_) return;
  const int64_t start = sinceNs > 0 ? sinceNs : monotonicNs();
  // Invalid UTF-8 (a file name) replaced, never an exception from the log.
  *log_ << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  logNs_ += monotonicNs() - start;
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

std::vector<CursorGraph> followedGraphs(const schemas::Plan& plan, const std::set<int64_t>& frozen) {
  std::vector<CursorGraph> graphs;
  for (const schemas::PlanGraph& pg : plan.graphs) {
    CursorGraph cg;
    cg.id = pg.id;
    cg.backward = pg.kind == schemas::GraphKind::Backward;
    for (const schemas::PrefetchGroup& grp : pg.prefetch) {
      cg.groups[grp.position].push_back(
          CursorGroup{grp.dsIds, grp.peakBytes ? static_cast<int64_t>(*grp.peakBytes) : -1});
    }
    for (const schemas::PlanBucket& bk : pg.buckets) {
      std::vector<int64_t> ids;
      for (int64_t id : bk.dsIds) {
        if (!frozen.count(id)) ids.push_back(id);
      }
      if (!ids.empty()) cg.buckets.push_back(std::move(ids));
    }
    for (const schemas::PersistentEnd& e : pg.persistentEnds) {
      if (!frozen.count(e.dsId)) cg.persistentEnds.emplace(e.position, e.dsId);
    }
    graphs.push_back(std::move(cg));
  }
  return graphs;
}

namespace {

schemas::Plan readPlanFile(const std::string& path) {
  try {
    return schemas::readPlan(path);
  } catch (const schemas::InputError& e) {
    throw PlanError(e.what());
  } catch (const std::exception& e) {
    throw PlanError(path + ": " + e.what());
  }
}

/// Refuses a plan made for another run: world size, stage, replay mode, parameters.
void checkSource(const std::string& path, const schemas::Plan& plan, const LiveModel& model,
                 const std::set<int64_t>& live, const std::string& signature) {
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
}

/// Refuses graphs that are not this model's, and buckets in another reduce dtype.
void checkGraphs(const std::string& path, const schemas::Plan& plan, const LiveModel& model) {
  for (size_t gi = 0; gi < plan.graphs.size(); ++gi) {
    const schemas::PlanGraph& pg = plan.graphs[gi];
    const std::string gp = "/graphs/" + std::to_string(gi);
    if (pg.id != model.forwardGraph && pg.id != model.backwardGraph) {
      refuse(path, gp + "/id",
             "graph " + std::to_string(pg.id) + " is not a graph of this model (its forward is graph " +
                 std::to_string(model.forwardGraph) + ", its backward graph " +
                 std::to_string(model.backwardGraph) + ")");
    }
    const bool liveBackward = pg.id == model.backwardGraph;
    if ((pg.kind == schemas::GraphKind::Backward) != liveBackward) {
      refuse(path, gp + "/kind",
             "graph " + std::to_string(pg.id) + " is this model's " +
                 (liveBackward ? "backward" : "forward") + ", the plan says " +
                 schemas::graphKindName(pg.kind));
    }
    for (size_t b = 0; b < pg.buckets.size(); ++b) {
      if (pg.buckets[b].dtype != model.reduceDtype) {
        refuse(path, gp + "/buckets/" + std::to_string(b) + "/dtype",
               "the plan reduces in " + pg.buckets[b].dtype + ", this run reduces in " + model.reduceDtype);
      }
    }
  }
}

}  // namespace

PlanSummary loadPlan(const std::string& path, const LiveModel& model, OnMismatch onMismatch) {
  const schemas::Plan plan = readPlanFile(path);
  std::set<int64_t> live;
  std::set<int64_t> frozen;
  std::unordered_map<int64_t, std::string> names;
  for (const LiveParam& p : model.params) {
    live.insert(p.dsId);
    names[p.dsId] = p.name;
    if (!p.trainable) frozen.insert(p.dsId);
  }
  PlanSummary summary;
  summary.signature = liveSignature(model);
  checkSource(path, plan, model, live, summary.signature);
  checkGraphs(path, plan, model);
  summary.persistent = plan.persistent;
  summary.cudaGraph = plan.options.cudaGraph;
  summary.memoryBudgetBytes = plan.options.memoryBudgetBytes;
  if (plan.guard) summary.guardStartBytes = static_cast<int64_t>(plan.guard->startBytes);
  for (size_t gi = 0; gi < plan.graphs.size(); ++gi) {
    const schemas::PlanGraph& g = plan.graphs[gi];
    if (g.id != model.forwardGraph) continue;
    summary.inputShapes = g.inputShapes;
    summary.offloadSaves = g.offloadSaves;
    if (!g.offloadSaves.empty())
      summary.offloadSavesPointer = "/graphs/" + std::to_string(gi) + "/offload_saves";
    // Saved activations move in the eager hooks' saved-tensor hooks, which ZeRO-3 alone installs.
    if (!g.offloadSaves.empty() && (model.stage != 3 || model.compiled)) {
      refuse(path, "/graphs/" + std::to_string(gi) + "/offload_saves",
             model.compiled
                 ? std::string("saved activations kept on the host are not supported with "
                               "dcplan.shard(compile=True) yet: plan from an eager recording")
                 : "saved activations are offloaded under ZeRO-3 only; this model is sharded with ZeRO-" +
                       std::to_string(model.stage));
    }
  }
  for (size_t g = 0; g < plan.optimizerOffload.size(); ++g) {
    const auto& ids = plan.optimizerOffload[g].dsIds;
    for (size_t k = 0; k < ids.size(); ++k) {
      if (!live.count(ids[k]) || frozen.count(ids[k])) {
        refuse(path, "/offload/optimizer_state/" + std::to_string(g) + "/ds_ids/" + std::to_string(k),
               "ds_id " + std::to_string(ids[k]) +
                   (live.count(ids[k]) ? " is frozen in this run: it has no "
                                         "optimizer state to offload"
                                       : " is not a parameter of this model"));
      }
    }
    summary.optimizerOffload.push_back(ids);
    summary.optimizerOffloadBytes.push_back(plan.optimizerOffload[g].bytes);
    summary.offloadStateBytes += plan.optimizerOffload[g].bytes;
    summary.offloadMasterBytes += plan.optimizerOffload[g].masterBytes;
    if (plan.optimizerOffload[g].masterBytes > 0) {
      if (model.stage != 3) {
        refuse(path, "/offload/optimizer_state/" + std::to_string(g) + "/master_bytes",
               "master shards are offloaded under ZeRO-3 only; this model is sharded with ZeRO-" +
                   std::to_string(model.stage));
      }
      if (model.compiled) {
        refuse(path, "/offload/optimizer_state/" + std::to_string(g) + "/master_bytes",
               "master shards kept on the host are not supported with dcplan.shard(compile=True) yet: "
               "plan with a budget the optimizer state's offload alone meets, or shard without compile");
      }
      summary.masterOffload.insert(summary.masterOffload.end(), ids.begin(), ids.end());
    }
  }
  for (const schemas::PlanGraph& pg : plan.graphs) {
    summary.prefetchGroups += static_cast<int64_t>(pg.prefetch.size());
    summary.buckets += static_cast<int64_t>(pg.buckets.size());
  }
  auto cursor =
      std::make_unique<PlanCursor>(path, followedGraphs(plan, frozen), plan.persistent, onMismatch,
                                   model.gatherDtype.value_or(c10::ScalarType::Undefined), std::move(names));
  if (plan.guard) cursor->setKeptPeaks(plan.persistent, plan.guard->persistentPeakBytes);
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

void setReplayLog(const std::string& path, MemoryGauge gauge, bool leaveOutOwnTime, LogRank who) {
  bool haveCursor = false;
  withSchedule([&](SchedulePolicy& s) {
    if (PlanCursor* c = installedCursor(s)) {
      c->openLog(path, std::move(gauge), leaveOutOwnTime, who);
      haveCursor = true;
    }
  });
  if (haveCursor || path.empty()) return;
  auto cursor = std::make_unique<PlanCursor>();
  cursor->openLog(path, std::move(gauge), leaveOutOwnTime, who);
  setSchedule(std::move(cursor));
}

void flushReplayLog() {
  withSchedule([](SchedulePolicy& s) {
    if (PlanCursor* c = installedCursor(s)) c->flushLog();
  });
}

ReplayLogClock replayLogClock() {
  ReplayLogClock clock;
  withSchedule([&](SchedulePolicy& s) {
    const int64_t now = monotonicNs();
    clock.tUs = now / 1000;
    if (PlanCursor* c = installedCursor(s)) {
      clock.tUs = c->logClockUs(now);
      clock.costUs = c->logCostUs();
      clock.ownTimeLeftOut = c->leavesOutOwnTime();
    }
  });
  return clock;
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
