// Record mode: raw op events and collective spans in memory, assembled into a trace after the last step.
#include "dcplan/recorder/Recorder.h"

#include "dcplan/replayer/HostClock.h"
#include "dcplan/schemas/io.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <tuple>
#include <utility>

#ifndef DCPLAN_VERSION
#define DCPLAN_VERSION "0.0.0"
#endif

namespace dcplan::recorder {

namespace fs = std::filesystem;

std::string dtypeName(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return "float32";
    case c10::ScalarType::Half:
      return "float16";
    case c10::ScalarType::BFloat16:
      return "bfloat16";
    case c10::ScalarType::Double:
      return "float64";
    case c10::ScalarType::Float8_e4m3fn:
      return "float8_e4m3fn";
    case c10::ScalarType::Float8_e5m2:
      return "float8_e5m2";
    case c10::ScalarType::Long:
      return "int64";
    case c10::ScalarType::Int:
      return "int32";
    case c10::ScalarType::Char:
      return "int8";
    case c10::ScalarType::Byte:
      return "uint8";
    case c10::ScalarType::Bool:
      return "bool";
    case c10::ScalarType::Undefined:
      return "";
    default:
      TORCH_CHECK(false, "record: dtype ", c10::toString(dtype), " has no name in the trace format");
  }
}

namespace {

Stream streamOf(const std::string& op) {
  switch (schemas::opRole(op).value_or(schemas::OpRole::Free)) {
    case schemas::OpRole::Gather:
    case schemas::OpRole::Prefetch:
      return Stream::AllGather;
    case schemas::OpRole::ReduceGrad:
      return Stream::Reduce;
    case schemas::OpRole::Offload:
      return Stream::Offload;
    case schemas::OpRole::Reload:
      return Stream::Reload;
    default:
      return Stream::Compute;  // waits, releases, end_backward, free_tensors
  }
}

HostTime hostClock() { return hostClockNs(); }

/// Microseconds between two host readings; none when either is missing (an op whose end was
/// never seen), so that the field is left out and the planner does without a host lane.
std::optional<double> hostUs(HostTime from, HostTime to) {
  if (from == 0 || to == 0) return std::nullopt;
  return std::max(0.0, static_cast<double>(to - from) / 1000.0);
}

/// The device-lead step's busy work: twice the host's time for the micro-step before, plus 5 ms,
/// so that the device stays behind a host that runs a little slower; at most 2 s (a first warm-up
/// step that compiled took the host far longer than a step).
double leadUsFor(double hostSpanUs) { return std::min(2.0 * hostSpanUs + 5000.0, 2e6); }

/// Busy work before each op of the device-lead step: more than the host takes for an op and the
/// compute after it, so that the device stays behind wherever the host is the slower.
constexpr double kOpLeadUs = 1000.0;

/// Where the device caught up with the host in the device-lead step (a model that synchronises,
/// as transformers' check for packed sequences does without an attention mask), the step's lead
/// is queued again so that the device is behind for the ops after it; past this many catch-ups in
/// one micro-step the step is taken as paced by its host, and gives no device times.
constexpr size_t kMaxCatchUps = 3;

int64_t elementSize(const std::string& dtype) {
  if (dtype == "float64" || dtype == "int64") return 8;
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "float16" || dtype == "bfloat16") return 2;
  return 1;
}

}  // namespace

Recorder::Recorder(RecorderConfig config, std::unique_ptr<DeviceTimer> timer,
                   std::unique_ptr<MemoryProbe> memory)
    : config_(std::move(config)), timer_(std::move(timer)), memory_(std::move(memory)) {
  TORCH_CHECK(config_.steps >= 1, "record: steps should be >= 1, got ", config_.steps);
  TORCH_CHECK(config_.warmup >= 0, "record: warmup should be >= 0, got ", config_.warmup);
  TORCH_CHECK(timer_ && memory_, "record: a timer and a memory probe are needed");
}

void Recorder::attachTransport(std::shared_ptr<replayer::Transport> transport) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  TORCH_CHECK(transport != nullptr, "record: transport should not be null");
  transport_ = std::move(transport);
}

void Recorder::addModel(const ModelInfo& model) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  models_.push_back(model);
}

void Recorder::setPaused(bool paused) {
  const HostTime hostNow = hostClock();
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  // The first paused forward after the backward ends the optimizer's span there.
  if (paused && !paused_ && haveMicro_ && current_.sawEndBackward && !current_.hostOptimizerEnd &&
      observing()) {
    current_.optimizerEnd = timer_->mark(Stream::Compute);
    current_.hostOptimizerEnd = hostNow;
  }
  paused_ = paused;
}

void Recorder::setInputShapes(int64_t forwardGraph, schemas::InputShapes shapes) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!inRecordedMicroStep()) return;
  current_.inputShapes[forwardGraph] = std::move(shapes);
}

void Recorder::setSavedActivations(int64_t forwardGraph, std::vector<schemas::SavedActivation> saved) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!inRecordedMicroStep()) return;
  current_.savedActivations[forwardGraph] = std::move(saved);
}

int64_t Recorder::position(int64_t graphId) const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!inRecordedMicroStep()) return -1;
  const auto it = current_.opsOfGraph.find(graphId);
  return it == current_.opsOfGraph.end() ? 0 : it->second;
}

int64_t Recorder::warmupStep() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (finished_ || done_ || recording_ || !haveMicro_) return -1;
  return optimizerStepsSeen_;
}

void Recorder::markGraphed() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  graphed_ = true;
}

void Recorder::setGraphStepUs(double us) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  TORCH_CHECK(done_ && !finished_ && graphed_, "record: a captured step's time is taken after every step of a "
              "recording through dcplan.graphed_step is recorded and before its trace is written");
  TORCH_CHECK(us > 0, "record: a captured step's device time should be > 0 us, got ", us);
  graphStepUs_ = us;
}

void Recorder::markChecksCollectives() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  checksCollectives_ = true;
}

void Recorder::setOptimizerState(const std::map<int64_t, uint64_t>& bytesById,
                                 const std::map<int64_t, std::string>& implById,
                                 const std::map<int64_t, int64_t>& groupById) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  const std::vector<std::string>& impls = schemas::optimizerImpls();
  for (const auto& [id, bytes] : bytesById) optimizer_[id].stateBytes = bytes;
  for (const auto& [id, impl] : implById) {
    TORCH_CHECK(std::find(impls.begin(), impls.end(), impl) != impls.end(),
                "record_optimizer_state: impl_by_id[", id, "] should be one of ", c10::Join(", ", impls),
                ", got '", impl, "'");
    optimizer_[id].impl = impl;
  }
  for (const auto& [id, group] : groupById) {
    TORCH_CHECK(group >= 0, "record_optimizer_state: group_by_id[", id, "] should be >= 0, got ", group);
    optimizer_[id].group = group;
  }
}

fs::path Recorder::tracePath() const {
  return config_.directory / ("rank" + std::to_string(transport_ ? transport_->rank() : 0) + ".trace.json");
}

fs::path Recorder::progressPath() const {
  return config_.directory / ("rank" + std::to_string(transport_ ? transport_->rank() : 0) + ".progress");
}

void Recorder::writeProgress() {
  // Once per recorded step, never per op; a failure only costs the progress display.
  try {
    schemas::writeFileAtomically(progressPath(),
                                 std::to_string(recordedSteps_) + " " + std::to_string(config_.steps) + " " +
                                     std::to_string(transport_ ? transport_->worldSize() : 1) + "\n");
  } catch (const std::exception& e) {
    TORCH_WARN_ONCE("record: cannot write the progress file: ", e.what());
  }
}

void Recorder::onStartForward() {
  const HostTime hostNow = hostClock();  // the optimizer's host time ends here, the step's starts below
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (finished_ || done_ || paused_) return;
  const TimePoint now = timer_->mark(Stream::Compute);
  const double lastSpanUs = haveMicro_ ? hostUs(current_.hostStart, hostNow).value_or(0) : 0;
  bool drain = false;
  if (haveMicro_) {
    ++microInStep_;
    const bool endsStep = current_.sync && current_.sawEndBackward;
    if (observing() && endsStep) {
      current_.optimizerUs =
          std::max(timer_->elapsedUs(current_.endBackward, current_.optimizerEnd.value_or(now)), 1e-3);
      current_.optimizerHostUs =
          hostUs(current_.hostEndBackward, current_.hostOptimizerEnd.value_or(hostNow));
    }
    if (recording_) {
      recorded_.push_back(std::move(current_));
    } else if (current_.led) {
      led_.push_back(std::move(current_));
      drain = endsStep;  // the recorded steps start with the device caught up, as the script runs them
    }
    if (endsStep) {
      ++optimizerStepsSeen_;
      if (recording_) {
        ++recordedSteps_;
        gradAccumSteps_ = std::max(gradAccumSteps_, microInStep_);
        writeProgress();
      }
      microInStep_ = 0;
    }
  }
  current_ = MicroStep{};
  current_.micro = microInStep_;
  haveMicro_ = true;
  const int64_t recordUntil = config_.warmup + config_.steps;
  if (optimizerStepsSeen_ >= recordUntil) {
    recording_ = false;
    done_ = true;
    return;
  }
  const bool wasRecording = recording_;
  recording_ = optimizerStepsSeen_ >= config_.warmup;
  if (recording_ && !wasRecording && recorded_.empty()) {
    baselineBytes_ = memory_->bytesInUse();
    // The first op's peak window starts at the last op's end; without a step before it (no
    // warm-up), it starts here, not with whatever the script did before training.
    if (optimizerStepsSeen_ == 0) memory_->takePeakBytes();
    writeProgress();  // "0 N ws": recording has started on this rank
  }
  if (drain) timer_->drain();
  if (!recording_ && config_.warmup >= 2 && optimizerStepsSeen_ == config_.warmup - 1) {
    // The last warm-up step is the device-lead step (a first one may still compile). Every rank
    // queues the same lead, the slowest host's: with each its own, a device waited in the first
    // collective after the lead queued at end_backward (a script's loss all-reduce) for another's
    // longer one, and optimizer_device_us held that wait (docs/recording.md). Agreed once, at the
    // step's first micro-step, which every rank reaches after the same optimizer steps; on CPU
    // ranks too (one small all-reduce per recording), whose host timer cannot lead.
    if (microInStep_ == 0)
      agreedSpanUs_ = transport_ ? agreeOnMax(*transport_, config_.calibration, lastSpanUs) : lastSpanUs;
    current_.leadUs = leadUsFor(agreedSpanUs_);
    current_.led = timer_->queueLead(current_.leadUs);
  }
  // The step starts after the recorder's work at its boundary, on both clocks.
  current_.start = timer_->mark(Stream::Compute);
  current_.lastMark = current_.start;
  current_.hostStart = hostClock();
}

void Recorder::onStartBackward(bool update, bool sync) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (haveMicro_) current_.sync = sync;
}

void Recorder::onOptimizerStepIssued() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!current_.led || !current_.sawEndBackward || current_.optimizerCaughtUp) return;
  // endBackward is the mark after the busy work queued at end_backward.
  if (timer_->reached(current_.endBackward)) current_.optimizerCaughtUp = true;
}

void Recorder::onOpBegin(const replayer::OpEvent& event) {
  const HostTime called = hostClock();
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!observing() || finished_ || paused_ || event.graphId < 0) return;
  // The op starts now: what the recorder does below lies inside the op's span, not in the
  // compute before it (a host-bound GPU would idle through it, and the planner would count
  // the recorder's bookkeeping as model compute).
  std::optional<TimePoint> stretchEnd;
  bool caughtUp = false;
  if (current_.led) {
    double leadUs = kOpLeadUs;
    caughtUp = timer_->reached(current_.lastMark);
    // Found caught up: the step's lead again, to be behind the host once more.
    if (caughtUp && current_.catchUps.size() < kMaxCatchUps) leadUs = current_.leadUs;
    stretchEnd = timer_->mark(Stream::Compute);
    timer_->queueLead(leadUs);  // between the stretch's end and the op's begin: in neither span
  }
  const TimePoint begin = timer_->mark(Stream::Compute);
  // Collectives that finished since the last op: their end is now at the latest.
  if (!inFlight_.empty()) {
    auto polled = inFlight_;
    for (auto& [token, weak] : polled) {
      if (auto handle = weak.lock()) handle->isCompleted();  // reports through onCollectiveDone
    }
    inFlight_.erase(
        std::remove_if(inFlight_.begin(), inFlight_.end(),
                       [&](const auto& f) { return f.second.expired() || collectives_[f.first].completed; }),
        inFlight_.end());
  }
  RawEvent raw;
  raw.op = event.op;
  raw.graphId = event.graphId;
  raw.dsId = event.dsId;
  raw.dsIds.assign(event.dsIds.begin(), event.dsIds.end());
  raw.nUsers = event.nUsers;
  raw.bytes = event.bytes;
  raw.dtype = event.dtype;
  raw.peak = memory_->takePeakBytes();
  raw.memory = memory_->bytesInUse();
  raw.peak = std::max(raw.peak, raw.memory);
  raw.begin = begin;
  raw.stretchEnd = stretchEnd;
  raw.hostCall = called;
  ++current_.opsOfGraph[raw.graphId];
  current_.events.push_back(std::move(raw));
  currentEvent_ = static_cast<int64_t>(current_.events.size()) - 1;
  if (caughtUp) current_.catchUps.push_back(current_.events.size() - 1);
  current_.events.back().hostBegin = hostClock();
}

void Recorder::onOpEnd(const replayer::OpEvent& event) {
  const HostTime returning = hostClock();
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (finished_ || done_ || paused_ || event.graphId < 0) return;
  const std::string_view op(event.op);
  // A mark may cost a device event: only for what is recorded, and step boundaries.
  if (op != "end_backward" && (!observing() || currentEvent_ < 0)) return;
  // The next op's peak is that of the compute after this op (what the runtime allocated for a
  // while inside an op, a bucket's packed gradients, the planner models itself); taken before
  // the end mark, so that its own time stays inside the op.
  memory_->takePeakBytes();
  const TimePoint now = timer_->mark(Stream::Compute);
  const HostTime resumed = hostClock();
  if (op == "end_backward") {
    // Step boundaries count in the warm-up too.
    current_.sawEndBackward = true;
    current_.endBackward = now;
    current_.hostEndBackward = resumed;
    if (current_.led && timer_->queueLead(current_.leadUs)) {
      // The optimizer's device time starts after this busy work, more than the host took for a whole
      // step. (Whether the device caught up cannot be asked at the next step's start: scripts that
      // read the loss have waited for the device there.)
      current_.endBackward = timer_->mark(Stream::Compute);
    }
  }
  if (!observing() || currentEvent_ < 0) return;
  RawEvent& raw = current_.events[static_cast<size_t>(currentEvent_)];
  raw.end = now;
  current_.lastMark = now;
  raw.hostEnd = returning;
  raw.hostResume = resumed;
  if (op == "reduce_grad") {
    // Added after its own op ran: a bucket flushed by this op carried the earlier gradients only.
    current_.pendingReduce.push_back(static_cast<size_t>(currentEvent_));
  }
  currentEvent_ = -1;
}

int64_t Recorder::onCollectiveLaunch(CollectiveKind kind) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!recording_ || finished_ || currentEvent_ < 0) return -1;
  Collective c;
  c.kind = kind;
  c.launch = timer_->mark(kind == CollectiveKind::Gather   ? Stream::AllGather
                          : kind == CollectiveKind::Reduce ? Stream::Reduce
                                                           : Stream::Copy);
  const int64_t token = static_cast<int64_t>(collectives_.size());
  RawEvent& raw = current_.events[static_cast<size_t>(currentEvent_)];
  if (kind == CollectiveKind::Reduce) {
    // A bucket's reduction carries every gradient handed over since the last one.
    c.events = std::move(current_.pendingReduce);
    current_.pendingReduce.clear();
    for (size_t e : c.events) current_.events[e].collective = token;
  } else if (raw.collective < 0) {
    raw.collective = token;
    c.events.push_back(static_cast<size_t>(currentEvent_));
  }
  collectives_.push_back(std::move(c));
  return token;
}

void Recorder::onCollectiveHandle(int64_t token, const std::shared_ptr<replayer::CommHandle>& handle) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (token >= 0 && !collectives_[static_cast<size_t>(token)].completed)
    inFlight_.emplace_back(token, handle);
}

void Recorder::onCollectiveDone(int64_t token) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (token < 0 || static_cast<size_t>(token) >= collectives_.size()) return;
  Collective& c = collectives_[static_cast<size_t>(token)];
  if (c.completed) return;
  c.done = timer_->mark(c.kind == CollectiveKind::Gather   ? Stream::AllGather
                        : c.kind == CollectiveKind::Reduce ? Stream::Reduce
                                                           : Stream::Copy);
  c.completed = true;
}

bool Recorder::done() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  return done_;
}

int64_t Recorder::recordedSteps() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  return recordedSteps_;
}

Recorder::GraphOrder Recorder::graphOrder(const MicroStep& step, const std::set<int64_t>& registered) {
  GraphOrder o;
  for (size_t i = 0; i < step.events.size(); ++i) {
    const int64_t g = step.events[i].graphId;
    if (!registered.count(g)) continue;  // a graph no dcplan.shard() registered with the recorder
    if (!o.byGraph.count(g)) o.order.push_back(g);
    o.byGraph[g].push_back(i);
  }
  return o;
}

const Recorder::MicroStep* Recorder::pairedLead(const MicroStep& step, size_t ledCount) const {
  if (static_cast<size_t>(step.micro) >= ledCount) return nullptr;
  const MicroStep& led = led_[static_cast<size_t>(step.micro)];
  if (led.events.size() != step.events.size()) return nullptr;
  for (size_t i = 0; i < step.events.size(); ++i) {
    const RawEvent& a = step.events[i];
    const RawEvent& b = led.events[i];
    if (std::string_view(a.op) != b.op || a.graphId != b.graphId || a.dsId != b.dsId || a.dsIds != b.dsIds)
      return nullptr;
  }
  // The lead step's optimizer step must end at the same micro-step.
  if (step.optimizerUs > 0 && !(led.optimizerUs > 0)) return nullptr;
  return &led;
}

std::vector<double> Recorder::computeBeforeUs(const MicroStep& step, const GraphOrder& graphs) {
  std::vector<double> before(step.events.size(), 0.0);
  TimePoint prevEnd = step.start;
  for (int64_t g : graphs.order) {
    for (size_t i : graphs.byGraph.at(g)) {
      const RawEvent& e = step.events[i];
      before[i] = std::max(0.0, timer_->elapsedUs(prevEnd, e.stretchEnd.value_or(e.begin)));
      prevEnd = step.events[i].end;
    }
  }
  return before;
}

std::vector<Recorder::LedTimes> Recorder::deviceTimes(const std::set<int64_t>& registered) {
  // The ops where the device had caught up, as the trace numbers them (graph and seq).
  auto where = [](const MicroStep& l) {
    std::ostringstream out;
    for (size_t i = 0; i < l.catchUps.size() && i <= kMaxCatchUps; ++i) {
      const size_t at = l.catchUps[i];
      const int64_t graph = l.events[at].graphId;
      const auto seq = std::count_if(l.events.begin(), l.events.begin() + static_cast<std::ptrdiff_t>(at),
                                     [&](const RawEvent& e) { return e.graphId == graph; });
      out << (i ? ", " : "") << l.events[at].op << " (graph " << graph << " seq " << seq << ")";
    }
    return out.str();
  };
  for (const MicroStep& l : led_) {
    if (l.catchUps.size() > kMaxCatchUps) {
      TORCH_WARN("record: rank ", transport_->rank(),
                 ": in the device-lead step the device caught up with the host more than ", kMaxCatchUps,
                 " times in micro-step ", l.micro, " (at ", where(l),
                 "): the host paces it (busy work that ran out, or a model that synchronises often), so "
                 "the trace has no device_us (plan --cuda-graph needs them)");
      return {};
    }
  }
  std::vector<LedTimes> led;
  for (const MicroStep& l : led_) {
    if (l.optimizerCaughtUp) {  // the ops' times hold; the optimizer's does not
      TORCH_WARN(
          "record: rank ", transport_->rank(),
          ": in the device-lead step the device caught up with the host "
          "while the host issued the optimizer step after micro-step ",
          l.micro,
          " (the busy work queued at "
          "end_backward ran out): its time holds waits for the host, so the trace has no optimizer_device_us "
          "(plan --cuda-graph needs it)");
    }
    LedTimes times;
    times.computeBeforeUs = computeBeforeUs(l, graphOrder(l, registered));
    times.opUs.resize(l.events.size());
    for (size_t i = 0; i < l.events.size(); ++i) {
      const RawEvent& e = l.events[i];
      // Busy work is queued before an op's begin mark, none inside it: its span is its own work.
      if (!schemas::waitsForAnotherStream(e.op))
        times.opUs[i] = std::max(0.0, timer_->elapsedUs(e.begin, e.end));
    }
    if (!l.catchUps.empty()) {
      // The device waited for the host after the check at the op before: inside that op's span or
      // in the compute before the op that found it caught up, no earlier (all before was queued).
      double mayWaitUs = 0;
      for (size_t op : l.catchUps)
        mayWaitUs += times.computeBeforeUs[op] + (op > 0 ? times.opUs[op - 1].value_or(0) : 0);
      TORCH_WARN("record: rank ", transport_->rank(),
                 ": in the device-lead step the device caught up with the host at ", where(l),
                 " of micro-step ", l.micro,
                 " (a host synchronisation in the model, or busy work that ran out; transformers' "
                 "check for packed sequences synchronises where no attention mask is given); the lead was "
                 "queued again there, and the device times just before (",
                 std::lround(mayWaitUs), " us) may hold waiting for the host");
    }
    led.push_back(std::move(times));
  }
  return led;
}

schemas::Trace Recorder::traceHeader(const schemas::Calibration& calibration, TraceModel& model) const {
  schemas::Trace t;
  const ModelInfo& first = models_.front();
  t.meta.createdBy = std::string("dcplan-recorder ") + DCPLAN_VERSION;
  t.meta.worldSize = transport_->worldSize();
  t.meta.backend = transport_->backendName();
  t.meta.device = config_.deviceName;
  t.meta.stage = first.stage;
  t.meta.gradAccumSteps = gradAccumSteps_;
  t.meta.paramDtype = first.paramDtype;
  t.meta.reduceDtype = first.reduceDtype;
  t.meta.replay = first.compiled ? "compiled" : "eager";
  t.meta.graphed = graphed_;
  t.meta.checksCollectives = checksCollectives_;
  t.meta.versions = config_.versions;
  t.meta.versions["dcplan"] = DCPLAN_VERSION;
  t.memory.capacityBytes = memory_->capacityBytes();
  t.memory.baselineBytes = baselineBytes_;
  for (const ModelInfo& m : models_) {
    model.graphs[m.forwardGraph] = {schemas::GraphKind::Forward, &m};
    model.graphs[m.backwardGraph] = {schemas::GraphKind::Backward, &m};
    model.registered.insert(m.forwardGraph);
    model.registered.insert(m.backwardGraph);
    for (const auto& p : m.params) {
      t.params.push_back(p);
      if (auto it = optimizer_.find(p.id); it != optimizer_.end()) {
        t.params.back().optimizerStateBytes = it->second.stateBytes;
        t.params.back().optimizerImpl = it->second.impl;
        t.params.back().optimizerGroup = it->second.group;
      }
      model.shardNumel[p.id] = p.shardNumel;
    }
  }
  t.calibration = calibration;
  return t;
}

std::pair<double, double> Recorder::collectiveSpanUs(const MicroStep& step, size_t i, const ModelInfo& model,
                                                     const TraceModel& tm, TimePoint origin,
                                                     TimePoint graphEnd, schemas::OpEvent& e) const {
  const RawEvent& raw = step.events[i];
  if (raw.collective < 0) {
    // An op that launched none (served from a held copy, or a ZeRO-1 micro-step that only
    // accumulates) takes no time at its issue.
    const double at = timer_->elapsedUs(origin, raw.begin);
    if (streamOf(e.op) == Stream::Reduce) {
      e.bytes = 0;  // nothing reduced: ZeRO-1 accumulating before the boundary
      e.dtype = model.reduceDtype;
    }
    return {at, at};
  }
  const Collective& c = collectives_[static_cast<size_t>(raw.collective)];
  const double cStart = timer_->elapsedUs(origin, c.launch);
  const double cEnd = timer_->elapsedUs(origin, c.completed ? c.done : graphEnd);
  if (c.kind != CollectiveKind::Reduce) return {cStart, cEnd};
  // One bucket's span, divided among its gradients by their bytes.
  const int64_t ws = transport_->worldSize();
  auto gradBytes = [&](const RawEvent& r) {
    auto it = tm.shardNumel.find(r.dsId);
    return it == tm.shardNumel.end() ? 0 : ws * it->second * elementSize(model.reduceDtype);
  };
  int64_t total = 0, before = 0;
  for (size_t k : c.events) {
    total += gradBytes(step.events[k]);
    if (k < i) before += gradBytes(step.events[k]);
  }
  const int64_t mine = gradBytes(raw);
  e.bytes = static_cast<uint64_t>(mine);
  e.dtype = model.reduceDtype;
  const double share = total > 0 ? (cEnd - cStart) / static_cast<double>(total) : 0.0;
  const double start = cStart + share * static_cast<double>(before);
  return {start, start + share * static_cast<double>(mine)};
}

schemas::OpEvent Recorder::opEvent(const RawEvent& raw, int64_t seq, double computeUs, const LedTimes* led,
                                   size_t i, HostTime hostPrevEnd) const {
  schemas::OpEvent e;
  e.seq = seq;
  e.op = raw.op;
  if (raw.dsId >= 0) e.dsIds = {raw.dsId};
  if (e.op == "prefetch_params_fused") e.dsIds = raw.dsIds;
  if (e.op == "release_param") e.nUsers = std::max<int64_t>(1, raw.nUsers);
  e.bytes = static_cast<uint64_t>(std::max<int64_t>(0, raw.bytes));
  e.dtype = dtypeName(raw.dtype);
  e.stream = streamName(streamOf(e.op));
  e.memoryBytes = raw.memory;
  e.peakBytes = raw.peak;
  e.computeUs = computeUs;
  if (led) {
    e.deviceUs = led->computeBeforeUs[i];
    e.opDeviceUs = led->opUs[i];
  }
  e.hostUs = hostUs(hostPrevEnd, raw.hostCall);
  e.issueUs = hostUs(raw.hostBegin, raw.hostEnd);
  return e;
}

schemas::TraceGraph Recorder::traceGraph(const MicroStep& step, int64_t g, const std::vector<size_t>& events,
                                         const TraceModel& tm, const std::vector<double>& before,
                                         const LedTimes* led, TimePoint& origin, HostTime& hostOrigin) const {
  const auto& [kind, model] = tm.graphs.at(g);
  schemas::TraceGraph graph;
  graph.id = g;
  graph.kind = kind;
  if (kind == schemas::GraphKind::Forward) {
    if (auto it = step.inputShapes.find(g); it != step.inputShapes.end()) graph.inputShapes = it->second;
    if (auto it = step.savedActivations.find(g); it != step.savedActivations.end()) {
      graph.savedActivations = it->second;
    }
  }
  TimePoint prevEnd = origin;
  HostTime hostPrevEnd = hostOrigin;
  // Every collective of a graph is complete by its last op (end_backward
  // drains the buckets); one never seen complete ends there at the latest.
  TimePoint graphEnd = origin;
  for (size_t i : events) graphEnd = std::max(graphEnd, step.events[i].end);
  std::map<std::string, double> streamEnd;  // the end of each stream's last event
  for (size_t i : events) {
    const RawEvent& raw = step.events[i];
    schemas::OpEvent e =
        opEvent(raw, static_cast<int64_t>(graph.events.size()), before[i], led, i, hostPrevEnd);
    double start = timer_->elapsedUs(origin, raw.begin);
    double end = timer_->elapsedUs(origin, raw.end);
    if (streamOf(e.op) != Stream::Compute) {
      // Off the compute stream an op's time is its collective's span.
      std::tie(start, end) = collectiveSpanUs(step, i, *model, tm, origin, graphEnd, e);
      // A stream runs one collective at a time: nothing starts before the previous one ended.
      auto last = streamEnd.find(e.stream);
      if (last != streamEnd.end()) start = std::max(start, last->second);
    }
    start = std::max(0.0, start);
    end = std::max(start, end);
    double& last = streamEnd[e.stream];
    last = std::max(last, end);
    e.startUs = start;
    e.endUs = end;
    prevEnd = raw.end;
    hostPrevEnd = raw.hostResume;
    graph.events.push_back(std::move(e));
  }
  origin = prevEnd;
  hostOrigin = hostPrevEnd;
  return graph;
}

schemas::TraceStep Recorder::traceStep(const MicroStep& step, int64_t index, const TraceModel& tm,
                                       const std::vector<LedTimes>& ledTimes) {
  schemas::TraceStep out;
  out.index = index;
  out.optimizerUs = step.optimizerUs;
  if (step.optimizerUs > 0) out.optimizerHostUs = step.optimizerHostUs;
  const GraphOrder issued = graphOrder(step, tm.registered);
  const std::vector<double> before = computeBeforeUs(step, issued);
  const MicroStep* lead = pairedLead(step, ledTimes.size());
  if (lead && step.optimizerUs > 0 && !lead->optimizerCaughtUp) out.optimizerDeviceUs = lead->optimizerUs;
  if (!lead && !ledTimes.empty()) {
    TORCH_WARN("record: rank ", transport_->rank(), ": recorded step ", index, " (micro-step ", step.micro,
               ") issued other ops than the device-lead step at that position, so it has no device_us (plan "
               "--cuda-graph needs them)");
  }
  const LedTimes* led = lead ? &ledTimes[static_cast<size_t>(step.micro)] : nullptr;
  // The first graph starts at start_forward; a later one (the backward) where
  // the one before it ended, so its first compute_us holds the loss and the
  // backward compute before its first op.
  TimePoint origin = step.start;
  HostTime hostOrigin = step.hostStart;
  for (int64_t g : issued.order) {
    out.graphs.push_back(traceGraph(step, g, issued.byGraph.at(g), tm, before, led, origin, hostOrigin));
  }
  return out;
}

schemas::Trace Recorder::buildTrace(const schemas::Calibration& calibration) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  TORCH_CHECK(!models_.empty(), "record: no model was registered (dcplan.shard() registers one)");
  TORCH_CHECK(transport_ != nullptr, "record: no transport attached");
  TraceModel tm;
  schemas::Trace t = traceHeader(calibration, tm);
  const std::vector<LedTimes> ledTimes = deviceTimes(tm.registered);
  int64_t index = 0;
  for (const MicroStep& step : recorded_) {
    schemas::TraceStep out = traceStep(step, index, tm, ledTimes);
    if (out.graphs.empty()) continue;
    t.steps.push_back(std::move(out));
    ++index;
  }
  return t;
}

void Recorder::calibrateNow() {
  {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    TORCH_CHECK(done_ && !finished_ && !calibrated_, "record: calibrateNow() once, after every step is "
                "recorded and before the trace is written");
    recording_ = false;  // the calibration's collectives are not the step's
  }
  // Collective: every rank reaches this at the same step.
  schemas::Calibration calibration = calibrate(*transport_, config_.calibration);
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  calibrated_ = std::move(calibration);
}

fs::path Recorder::finish() {
  std::optional<schemas::Calibration> calibrated;
  std::optional<double> graphStepUs;
  {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    TORCH_CHECK(done_, "record: finish() before all ", config_.steps, " steps were recorded (",
                recordedSteps_, " so far)");
    TORCH_CHECK(!finished_, "record: the trace was already written to ", tracePath().string());
    finished_ = true;
    recording_ = false;
    calibrated = calibrated_;
    graphStepUs = graphStepUs_;
  }
  // Collective unless calibrated already: every rank reaches this at the same step.
  schemas::Calibration calibration = calibrated ? *calibrated : calibrate(*transport_, config_.calibration);
  calibration.graphStepUs = graphStepUs;
  schemas::Trace trace = buildTrace(calibration);
  const std::string text = schemas::writeTrace(trace);
  // A recorder bug must show here, naming the field, not later in dcplan record.
  schemas::Trace check;
  auto problems = schemas::validateTrace(schemas::parseJson(text, tracePath().string()), check);
  TORCH_CHECK(problems.empty(), "record: the trace of this rank is not valid: ", tracePath().string(), ": ",
              problems.empty() ? "" : problems.front().str());
  schemas::writeFileAtomically(tracePath(), text);
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  recorded_.clear();
  led_.clear();
  collectives_.clear();
  inFlight_.clear();
  return tracePath();
}

}  // namespace dcplan::recorder
