// Unit tests of the recorder on a scripted clock and a one-rank in-memory transport.
#include "dcplan/recorder/Comm.h"
#include "dcplan/recorder/Probes.h"
#include "dcplan/recorder/Recorder.h"
#include "dcplan/replayer/HostClock.h"
#include "dcplan/schemas/io.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <utility>

namespace dcplan::recorder {
namespace {

using replayer::CommHandle;
using replayer::CommHandlePtr;
using replayer::OpEvent;
using replayer::Transport;

/// Time stands still until the test moves it; points are microseconds. A lead puts every later
/// mark that much behind the test's clock, as a device behind its host. Marks are whole
/// nanoseconds, and the lead is kept in them apart from the clock: the first lead comes from the
/// host's real time (a fraction of a microsecond), and truncating (now + lead) * 1000 as one
/// double put one mark a nanosecond off its neighbour in about 1 of 30,000 runs (CI, stop 26).
class ScriptedTimer final : public DeviceTimer {
 public:
  explicit ScriptedTimer(double* now) : now_(now) {}
  TimePoint mark(Stream) override { return std::llround(*now_ * 1000.0) + behindNs_; }
  double elapsedUs(TimePoint from, TimePoint to) override { return static_cast<double>(to - from) / 1000.0; }
  bool queueLead(double us) override {
    if (!canLead) return false;
    leads.push_back(us);
    behindNs_ += std::llround(us * 1000.0);
    return true;
  }
  void drain() override { ++drains; }
  bool reached(TimePoint) override {
    ++reachedCalls;
    return caughtUp || (caughtUpAtCall > 0 && reachedCalls >= caughtUpAtCall) ||
           caughtUpCalls.count(reachedCalls);
  }

  bool canLead = true;
  bool caughtUp = false;   // the device ran out of work: it has reached every mark
  int caughtUpAtCall = 0;  // > 0: it has from that call of reached() on
  // It has at these calls of reached() only (a lead queued again puts it behind).
  std::set<int> caughtUpCalls;
  int reachedCalls = 0;
  std::vector<double> leads;
  int drains = 0;

 private:
  double* now_;
  TimePoint behindNs_ = 0;
};

/// Bytes in use and the peak since the last take, as the test sets them; reading the bytes
/// in use costs readUs of scripted time (a slow probe).
class ScriptedMemory final : public MemoryProbe {
 public:
  ScriptedMemory(uint64_t* bytes, uint64_t* peak, double* now, const double* readUs)
      : bytes_(bytes), peak_(peak), now_(now), readUs_(readUs) {}
  uint64_t bytesInUse() override {
    *now_ += *readUs_;
    return *bytes_;
  }
  uint64_t takePeakBytes() override { return std::max(std::exchange(*peak_, 0), *bytes_); }
  uint64_t capacityBytes() override { return 1 << 30; }
  std::string describe() override { return "scripted"; }

 private:
  uint64_t* bytes_;
  uint64_t* peak_;
  double* now_;
  const double* readUs_;
};

/// Completes when the test says so (or on wait).
class ManualHandle final : public CommHandle {
 public:
  void wait() override { done = true; }
  bool isCompleted() override { return done; }
  bool done = false;
};

/// One rank: every collective is a copy (or nothing), handles complete at wait().
class LocalTransport final : public Transport {
 public:
  int rank() const override { return 0; }
  int worldSize() const override { return ws; }
  std::string backendName() const override { return "gloo"; }
  CommHandlePtr allGather(const at::Tensor& out, const at::Tensor& in) override {
    for (int r = 0; r < ws; ++r) out.narrow(0, r * in.numel(), in.numel()).copy_(in);
    return launched("allGather");
  }
  CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>& outs,
                                   const std::vector<at::Tensor>& ins) override {
    for (size_t i = 0; i < outs.size(); ++i) allGather(outs[i], ins[i]);
    calls.pop_back();
    return launched("allGatherCoalesced");
  }
  CommHandlePtr reduceScatter(const at::Tensor& out, const at::Tensor& in) override {
    out.copy_(in.select(0, 0));
    return launched("reduceScatter");
  }
  CommHandlePtr allReduce(const at::Tensor& t) override {
    // The other ranks' values of an agreement (agreeOnMax: one slot per rank, summed).
    for (size_t r = 0; r < peerSlots.size() && t.numel() == ws; ++r)
      t[static_cast<int64_t>(r) + 1].add_(peerSlots[r]);
    return launched("allReduce");
  }
  // A device transport's seams: what reaches them, and with which handle.
  CommHandlePtr markCaller() override {
    ++marks;
    return std::make_shared<ManualHandle>();
  }
  CommHandlePtr runAfter(const CommHandlePtr& done, const std::function<void()>& work) override {
    ranAfter = done;
    work();
    return std::make_shared<ManualHandle>();
  }
  bool capturing() const override { return capture; }

  CommHandlePtr launched(const char* name) {
    calls.push_back(name);
    last = std::make_shared<ManualHandle>();
    return last;
  }
  int ws = 1;
  std::vector<double> peerSlots;  // ranks 1..: what they add to an agreement's slots
  std::vector<std::string> calls;
  std::shared_ptr<ManualHandle> last;
  int marks = 0;
  CommHandlePtr ranAfter;
  bool capture = false;
};

class RecorderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = std::filesystem::temp_directory_path() / ("dcplan_recorder_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
  }
  void TearDown() override { std::filesystem::remove_all(dir); }

  std::shared_ptr<Recorder> make(int64_t steps, int64_t warmup, int ws = 2) {
    RecorderConfig c;
    c.directory = dir;
    c.steps = steps;
    c.warmup = warmup;
    c.calibration.budgetSeconds = 0.01;
    auto owned = std::make_unique<ScriptedTimer>(&now);
    timer = owned.get();
    auto rec = std::make_shared<Recorder>(c, std::move(owned),
                                          std::make_unique<ScriptedMemory>(&memory, &peak, &now, &readUs));
    local = std::make_shared<LocalTransport>();
    local->ws = ws;
    rec->attachTransport(local);
    timed = makeTimedTransport(local, rec);
    ModelInfo m;
    m.stage = 3;
    m.forwardGraph = 0;
    m.backwardGraph = 1;
    // Two parameters: 10 and 3 elements; shard 5 and 2 at world size 2.
    m.params = {{0, "w", {2, 5}, "float32", 10, (10 + ws - 1) / ws, true, std::nullopt},
                {1, "b", {3}, "float32", 3, (3 + ws - 1) / ws, true, std::nullopt}};
    rec->addModel(m);
    return rec;
  }

  /// One op from `at` to `at + dur`; `body` runs inside it (at the time it sets).
  void op(Recorder& rec, const char* name, int64_t graph, int64_t id, double at, double dur,
          const std::function<void()>& body = {}, int64_t bytes = 0) {
    now = at;
    OpEvent e{name, graph, id, bytes, at::kFloat};
    rec.onOpBegin(e);
    if (body) body();
    now = at + dur;
    rec.onOpEnd(e);
  }

  /// A ZeRO-3 micro-step starting at t0: forward gathers w (launched at +2, the
  /// host waits from +3 to +8), backward reduces w and b in one bucket that
  /// end_backward launches at +35 and waits for until +40; `scale` stretches every time.
  void microStep(Recorder& rec, double t0, bool sync, double scale = 1.0) {
    auto at = [&](double dt) { return t0 + scale * dt; };
    now = t0;
    rec.onStartForward();
    CommHandlePtr gather;
    op(
        rec, "allgather_param", 0, 0, at(1), 2 * scale,
        [&] {
          now = at(2);
          gather = timed->allGather(at::empty({10}), at::empty({10 / local->ws}));
        },
        40);
    op(rec, "wait_allgather", 0, 0, at(3), 5 * scale, [&] {
      now = at(8);
      gather->wait();
    });
    op(rec, "release_param", 0, 0, at(10), 1 * scale);
    now = at(20);
    rec.onStartBackward(true, sync);
    op(rec, "reduce_grad", 1, 0, at(20), 1 * scale);
    op(rec, "reduce_grad", 1, 1, at(22), 1 * scale);
    op(rec, "end_backward", 1, -1, at(30), 10 * scale, [&] {
      now = at(35);
      CommHandlePtr reduce = timed->reduceScatter(at::empty({7}), at::empty({local->ws, 7}));
      now = at(40);
      reduce->wait();
    });
  }

  /// A recording whose device-lead step caught up at chosen ops (defined beside its tests).
  std::shared_ptr<Recorder> ledStepCatchingUpAt(std::initializer_list<int> ops, double scale);

  /// The next step's start_forward at `at` ends the recording: the trace, on a one-point
  /// calibration.
  schemas::Trace finish(Recorder& rec, double at) {
    now = at;
    rec.onStartForward();
    EXPECT_TRUE(rec.done());
    schemas::Calibration cal;
    cal.allGather = cal.reduceScatter = cal.allReduce = {{65536, 10.0}};
    return rec.buildTrace(cal);
  }

  /// t written and read back, which must be a valid document.
  static schemas::Trace validRoundTrip(const schemas::Trace& t) {
    schemas::Trace check;
    auto problems = schemas::validateTrace(schemas::parseJson(schemas::writeTrace(t), "t"), check);
    EXPECT_TRUE(problems.empty()) << (problems.empty() ? "" : problems.front().str());
    return check;
  }

  std::filesystem::path dir;
  ScriptedTimer* timer = nullptr;
  double now = 0;
  uint64_t memory = 1000;
  uint64_t peak = 0;
  double readUs = 0;
  std::shared_ptr<LocalTransport> local;
  std::shared_ptr<Transport> timed;
};

TEST_F(RecorderTest, CountsWarmupAndRecordedStepsAndFinishesAtTheNextForward) {
  auto rec = make(/*steps=*/2, /*warmup=*/1);
  microStep(*rec, 0, true);  // warm-up
  EXPECT_FALSE(std::filesystem::exists(rec->progressPath()));
  microStep(*rec, 100, true);
  std::ifstream p0(rec->progressPath());
  std::string line;
  std::getline(p0, line);
  EXPECT_EQ(line, "0 2 2");
  microStep(*rec, 200, true);
  EXPECT_EQ(rec->recordedSteps(), 1);
  EXPECT_FALSE(rec->done());
  now = 340;
  rec->onStartForward();
  EXPECT_TRUE(rec->done());
  EXPECT_EQ(rec->recordedSteps(), 2);
  std::ifstream p1(rec->progressPath());
  std::getline(p1, line);
  EXPECT_EQ(line, "2 2 2");
}

TEST_F(RecorderTest, TheTimedTransportForwardsTheDeviceSeamsWithTheWrappedTransportsOwnHandle) {
  // Before session 12 the recorder's transport left runAfter and markCaller to the interface's
  // defaults: a recorded GPU run accumulated gradients on the compute stream after waiting for
  // each bucket's reduction, and the device-lead step's reduce_grad spans held that work.
  auto rec = make(/*steps=*/1, /*warmup=*/0);
  now = 0;
  rec->onStartForward();
  CommHandlePtr reduce;
  op(*rec, "reduce_grad", 1, 0, 1, 1, [&] {
    reduce = timed->reduceScatter(at::empty({7}), at::empty({2, 7}));
  });
  ASSERT_NE(reduce, local->last);  // the recorder's wrapper, timing the reduction
  bool ran = false;
  timed->runAfter(reduce, [&] { ran = true; });
  EXPECT_TRUE(ran);
  EXPECT_EQ(local->ranAfter, local->last);  // the wrapped transport got its own handle
  EXPECT_FALSE(local->last->done);          // and was left to order the work itself: no wait here
  timed->markCaller();
  EXPECT_EQ(local->marks, 1);
  local->capture = true;
  EXPECT_TRUE(timed->capturing());
}

TEST(TimedTransport, AReductionEndsWhereTheWorkQueuedAfterItStarts) {
  // The runtime queues a bucket's accumulation after its reduction (runAfter), then drops the
  // handle: the reduction's end is marked where the work starts, before it.
  struct Listener final : CollectiveListener {
    int64_t onCollectiveLaunch(CollectiveKind) override { return 7; }
    void onCollectiveDone(int64_t token) override { done.push_back(token); }
    std::vector<int64_t> done;
  };
  auto listener = std::make_shared<Listener>();
  auto local = std::make_shared<LocalTransport>();
  local->ws = 2;
  auto timed = makeTimedTransport(local, listener);
  CommHandlePtr reduce = timed->reduceScatter(at::empty({7}), at::empty({2, 7}));
  std::vector<int64_t> seenByWork;
  timed->runAfter(reduce, [&] { seenByWork = listener->done; });
  EXPECT_EQ(seenByWork, std::vector<int64_t>{7});
  reduce.reset();
  EXPECT_EQ(listener->done, std::vector<int64_t>{7});  // once
  EXPECT_FALSE(local->last->done);                     // and nothing waited for it
}

TEST_F(RecorderTest, BuildsEventsWithSeqStreamsSpansAndBytes) {
  auto rec = make(/*steps=*/1, /*warmup=*/0);
  memory = 5000;
  microStep(*rec, 0, true);
  schemas::Trace t = finish(*rec, 57);
  EXPECT_EQ(t.memory.baselineBytes, 5000u);
  EXPECT_EQ(t.meta.backend, "gloo");
  EXPECT_EQ(t.meta.worldSize, 2);
  ASSERT_EQ(t.steps.size(), 1u);
  EXPECT_DOUBLE_EQ(t.steps[0].optimizerUs, 57.0 - 40.0);  // end_backward ended at 40
  ASSERT_EQ(t.steps[0].graphs.size(), 2u);
  const auto& fwd = t.steps[0].graphs[0];
  const auto& bwd = t.steps[0].graphs[1];
  EXPECT_EQ(fwd.kind, schemas::GraphKind::Forward);
  EXPECT_EQ(bwd.kind, schemas::GraphKind::Backward);
  ASSERT_EQ(fwd.events.size(), 3u);
  ASSERT_EQ(bwd.events.size(), 3u);
  for (size_t i = 0; i < bwd.events.size(); ++i) EXPECT_EQ(bwd.events[i].seq, static_cast<int64_t>(i));
  // The gather's span is its collective: launched at 2, seen complete by the poll at 8.
  EXPECT_EQ(fwd.events[0].stream, "allgather");
  EXPECT_DOUBLE_EQ(fwd.events[0].startUs, 2.0);
  EXPECT_DOUBLE_EQ(fwd.events[0].endUs, 8.0);
  EXPECT_DOUBLE_EQ(fwd.events[0].computeUs, 1.0);  // start_forward at 0, issued at 1
  EXPECT_EQ(fwd.events[0].bytes, 40u);
  EXPECT_EQ(fwd.events[0].memoryBytes, 5000u);
  // The wait spans the time the host waited; compute since the gather's op ended.
  EXPECT_EQ(fwd.events[1].stream, "compute");
  EXPECT_DOUBLE_EQ(fwd.events[1].startUs, 3.0);
  EXPECT_DOUBLE_EQ(fwd.events[1].endUs, 8.0);
  EXPECT_EQ(fwd.events[2].nUsers.value_or(0), 1);  // release without n_users reported: at least 1
  // The backward starts where the forward ended (11): its first compute_us holds the loss.
  EXPECT_DOUBLE_EQ(bwd.events[0].computeUs, 20.0 - 11.0);
  // One bucket reduced at end_backward (launched at 35, waited for until 40), its
  // span split 5:2 by gradient bytes.
  const double span = 40.0 - 35.0;
  EXPECT_EQ(bwd.events[0].stream, "reduce");
  EXPECT_EQ(bwd.events[0].bytes, 2u * 5u * 4u);
  EXPECT_EQ(bwd.events[1].bytes, 2u * 2u * 4u);
  EXPECT_EQ(bwd.events[0].dtype, "float32");
  EXPECT_NEAR(bwd.events[0].startUs, 35.0 - 11.0, 1e-9);
  EXPECT_NEAR(bwd.events[0].endUs - bwd.events[0].startUs, span * 5.0 / 7.0, 1e-9);
  EXPECT_NEAR(bwd.events[1].startUs, bwd.events[0].endUs, 1e-9);
  EXPECT_NEAR(bwd.events[1].endUs, 40.0 - 11.0, 1e-9);
  EXPECT_TRUE(bwd.events[2].dsIds.empty());
  validRoundTrip(t);  // the whole trace is a valid document
}

TEST_F(RecorderTest, PeaksBetweenOpsAreKeptAndTheProbesTimeIsNotCompute) {
  auto rec = make(/*steps=*/1, /*warmup=*/0);
  memory = 5000;
  now = 0;
  rec->onStartForward();
  readUs = 100;  // the recorder's own work at an op lies inside the op, not in the compute before it
  peak = 9000;   // temporaries of the compute before the first op
  op(*rec, "allgather_param", 0, 0, 1, 2, {}, 40);
  op(*rec, "wait_allgather", 0, 0, 3, 1, [&] { peak = 8000; });  // within the op: the runtime's own
  op(*rec, "release_param", 0, 0, 10, 1);
  readUs = 0;
  now = 20;
  rec->onStartBackward(true, true);
  peak = 7000;
  op(*rec, "reduce_grad", 1, 0, 20, 1);
  op(*rec, "reduce_grad", 1, 1, 22, 1);
  op(*rec, "end_backward", 1, -1, 30, 1);
  schemas::Trace t = finish(*rec, 57);
  const auto& fwd = t.steps[0].graphs[0];
  ASSERT_EQ(fwd.events.size(), 3u);
  EXPECT_DOUBLE_EQ(fwd.events[0].computeUs, 1.0);
  EXPECT_DOUBLE_EQ(fwd.events[1].computeUs, 0.0);
  EXPECT_DOUBLE_EQ(fwd.events[2].computeUs, 10.0 - 4.0);
  EXPECT_EQ(fwd.events[0].peakBytes, 9000u);
  EXPECT_EQ(fwd.events[1].peakBytes, 5000u);  // no peak above what is in use
  EXPECT_EQ(fwd.events[2].peakBytes, 5000u);  // the wait's own peak is not the compute's after it
  EXPECT_EQ(fwd.events[2].memoryBytes, 5000u);
  EXPECT_EQ(t.steps[0].graphs[1].events[0].peakBytes, 7000u);
  schemas::Trace check = validRoundTrip(t);
  EXPECT_EQ(check.steps[0].graphs[0].events[0].peakBytes, 9000u);  // and it round-trips
}

TEST_F(RecorderTest, TheLastWarmupStepLeadsTheDeviceAndGivesTheDevicesOwnTimes) {
  auto rec = make(/*steps=*/2, /*warmup=*/2);
  microStep(*rec, 0, true);  // warm-up
  EXPECT_TRUE(timer->leads.empty());
  // The last warm-up step runs behind a lead; its device ran every stretch in half the time.
  microStep(*rec, 100, true, 0.5);
  // Busy work at the start, before each of the 6 ops, and after the backward (the start's again).
  ASSERT_EQ(timer->leads.size(), 8u);
  EXPECT_GE(timer->leads[0], 5000.0);  // twice the host's time for the step before, plus 5 ms
  for (size_t i = 1; i < 7; ++i) EXPECT_EQ(timer->leads[i], 1000.0);
  EXPECT_EQ(timer->leads[7], timer->leads[0]);
  EXPECT_EQ(timer->drains, 0);
  microStep(*rec, 200, true);  // recorded; the device caught up before it started
  EXPECT_EQ(timer->drains, 1);
  microStep(*rec, 300, true);
  EXPECT_EQ(timer->leads.size(), 8u);  // recorded steps never lead
  schemas::Trace t = validRoundTrip(finish(*rec, 357));
  ASSERT_EQ(t.steps.size(), 2u);
  for (const auto& step : t.steps) {
    // end_backward ended at 120 of the led step, whose optimizer ran until the next start (200).
    EXPECT_DOUBLE_EQ(step.optimizerDeviceUs.value_or(-1), 200.0 - 120.0);
    for (const auto& g : step.graphs) {
      for (const auto& e : g.events) {
        ASSERT_TRUE(e.deviceUs.has_value()) << e.op;
        EXPECT_DOUBLE_EQ(*e.deviceUs, 0.5 * e.computeUs) << e.op << " " << e.seq;
      }
    }
  }
  EXPECT_DOUBLE_EQ(t.steps[0].optimizerUs, 300.0 - 240.0);  // the recorded steps' own
  EXPECT_DOUBLE_EQ(*t.steps[0].graphs[0].events[2].deviceUs, 0.5 * (10.0 - 8.0));
  // Each op's own span in the led step (its busy work lies before its begin mark), but none for
  // the ops that make the compute stream wait for another: their span is that wait.
  const std::map<std::string, double> ownUs = {
      {"allgather_param", 0.5 * 2}, {"release_param", 0.5 * 1}, {"reduce_grad", 0.5 * 1}};
  for (const auto& step : t.steps) {
    for (const auto& g : step.graphs) {
      for (const auto& e : g.events) {
        if (e.op == "wait_allgather" || e.op == "end_backward") {
          EXPECT_FALSE(e.opDeviceUs) << e.op;
        } else {
          EXPECT_DOUBLE_EQ(e.opDeviceUs.value_or(-1), ownUs.at(e.op)) << e.op << " " << e.seq;
        }
      }
    }
  }
}

TEST_F(RecorderTest, EveryRankLeadsByTheSlowestHostsStep) {
  // Rank 1's host took 20 ms for the step before the led one, this rank's far less: both queue
  // twice the slower one's plus 5 ms, at the start and after end_backward, so that neither
  // device waits for the other's longer lead in a collective after the optimizer.
  auto rec = make(/*steps=*/1, /*warmup=*/2);
  local->peerSlots = {20000.0};
  microStep(*rec, 0, true);
  microStep(*rec, 100, true, 0.5);
  EXPECT_EQ(std::count(local->calls.begin(), local->calls.end(), "allReduce"), 1);
  ASSERT_EQ(timer->leads.size(), 8u);
  EXPECT_DOUBLE_EQ(timer->leads[0], 2 * 20000.0 + 5000.0);
  EXPECT_DOUBLE_EQ(timer->leads[7], timer->leads[0]);
}

TEST_F(RecorderTest, TheSlowestHostMayBeThisRanksOwn) {
  // The peer's slot stays 0: the lead is this rank's own host time (the host clock's, more than
  // nothing) twice plus 5 ms, so its own slot was filled.
  auto rec = make(/*steps=*/1, /*warmup=*/2);
  local->peerSlots = {0.0};
  microStep(*rec, 0, true);
  microStep(*rec, 100, true, 0.5);
  ASSERT_FALSE(timer->leads.empty());
  EXPECT_GT(timer->leads[0], 5000.0);
}

TEST_F(RecorderTest, TheLeadIsAgreedOncePerRecordingAndOnlyForALedStep) {
  // Two micro-steps in the led step: one agreement, at its first, and the same lead for both.
  auto rec = make(/*steps=*/1, /*warmup=*/2);
  local->peerSlots = {20000.0};
  microStep(*rec, 0, true);
  microStep(*rec, 100, false, 0.5);
  microStep(*rec, 200, true, 0.5);
  microStep(*rec, 300, true);  // recorded
  EXPECT_EQ(std::count(local->calls.begin(), local->calls.end(), "allReduce"), 1);
  // Each micro-step's start and end_backward (4 leads) the agreed one, every op's 1 ms.
  EXPECT_EQ(std::count(timer->leads.begin(), timer->leads.end(), 45000.0), 4);
  EXPECT_EQ(std::count(timer->leads.begin(), timer->leads.end(), 1000.0) + 4,
            static_cast<std::ptrdiff_t>(timer->leads.size()));
  // Without a led step (fewer than 2 warm-up steps), no agreement at all.
  auto plain = make(/*steps=*/1, /*warmup=*/1);
  microStep(*plain, 0, true);
  microStep(*plain, 100, true);
  EXPECT_EQ(std::count(local->calls.begin(), local->calls.end(), "allReduce"), 0);
}

TEST_F(RecorderTest, NoDeviceTimesWithoutALeadOrWhereTheHostOutranIt) {
  {  // one warm-up step: it may still compile, so none leads
    auto rec = make(/*steps=*/1, /*warmup=*/1);
    microStep(*rec, 0, true);
    microStep(*rec, 100, true);
    schemas::Trace t = finish(*rec, 157);
    EXPECT_TRUE(timer->leads.empty());
    EXPECT_FALSE(t.steps[0].optimizerDeviceUs);
    EXPECT_FALSE(t.steps[0].graphs[0].events[0].deviceUs);
    EXPECT_FALSE(t.steps[0].graphs[0].events[0].opDeviceUs);
  }
  {  // the host's clock cannot lead (CPU ranks)
    auto rec = make(/*steps=*/1, /*warmup=*/2);
    timer->canLead = false;
    for (double t0 : {0.0, 100.0, 200.0}) microStep(*rec, t0, true);
    schemas::Trace t = finish(*rec, 257);
    EXPECT_EQ(timer->drains, 0);
    EXPECT_FALSE(t.steps[0].graphs[0].events[0].deviceUs);
  }
  {  // the device caught up with the host during the led step: its times hold waits for the host
    auto rec = make(/*steps=*/1, /*warmup=*/2);
    microStep(*rec, 0.0, true);
    timer->caughtUp = true;
    microStep(*rec, 100.0, true);
    timer->caughtUp = false;
    microStep(*rec, 200.0, true);
    schemas::Trace t = finish(*rec, 257);
    EXPECT_EQ(timer->leads.size(), 8u);
    EXPECT_FALSE(t.steps[0].optimizerDeviceUs);
    EXPECT_FALSE(t.steps[0].graphs[1].events[0].deviceUs);
    EXPECT_FALSE(t.steps[0].graphs[1].events[0].opDeviceUs);
  }
}

/// Collects the warnings raised while it is alive.
class CollectedWarnings final : public c10::WarningHandler {
 public:
  CollectedWarnings() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

/// A recording whose device-lead step (the second, at half the host's pace) found the device
/// caught up at these of its 6 ops (1-based; the recorder asks at each op), then one recorded step.
std::shared_ptr<Recorder> RecorderTest::ledStepCatchingUpAt(std::initializer_list<int> ops, double scale) {
  auto rec = make(/*steps=*/1, /*warmup=*/2);
  microStep(*rec, 0, true);
  for (int op : ops) timer->caughtUpCalls.insert(timer->reachedCalls + op);
  microStep(*rec, 100, true, scale);
  timer->caughtUpCalls.clear();
  return rec;
}

TEST_F(RecorderTest, ADeviceThatCaughtUpOnceIsLedAgainThereAndKeepsItsTimes) {
  // A model that synchronises the host once in its forward (transformers' check for packed
  // sequences): the device has run all it was given when the next op is called.
  auto rec = ledStepCatchingUpAt({3}, 0.5);
  ASSERT_EQ(timer->leads.size(), 8u);
  EXPECT_EQ(timer->leads[3], timer->leads[0]) << "the step's lead again, before the third op";
  for (size_t i : {1, 2, 4, 5, 6}) EXPECT_EQ(timer->leads[i], 1000.0) << i;
  microStep(*rec, 200, true);
  CollectedWarnings warnings;
  schemas::Trace t = validRoundTrip(finish(*rec, 257));
  for (const auto& g : t.steps[0].graphs) {
    for (const auto& e : g.events)
      EXPECT_DOUBLE_EQ(e.deviceUs.value_or(-1), 0.5 * e.computeUs) << e.op << e.seq;
  }
  EXPECT_TRUE(t.steps[0].optimizerDeviceUs);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("at release_param (graph 0 seq 2) of micro-step 0"), std::string::npos)
      << warnings.messages[0];
  // What may hold waiting: the compute before that op (half of 10 - 8 at this device's speed); the
  // op before it is a wait, whose span is no device time of the trace.
  EXPECT_NE(warnings.messages[0].find("queued again there, and the device times just before (1 us)"),
            std::string::npos)
      << warnings.messages[0];
}

TEST_F(RecorderTest, UpToThreeCatchUpsKeepTheTimes) {
  auto rec = ledStepCatchingUpAt({1, 4, 6}, 0.5);  // the first op, and both of the backward's ends
  for (size_t i : {1, 4, 6}) EXPECT_EQ(timer->leads[i], timer->leads[0]) << i;
  microStep(*rec, 200, true);
  CollectedWarnings warnings;
  schemas::Trace t = validRoundTrip(finish(*rec, 257));
  EXPECT_DOUBLE_EQ(t.steps[0].graphs[0].events[0].deviceUs.value_or(-1),
                   0.5 * t.steps[0].graphs[0].events[0].computeUs);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find(
                "at allgather_param (graph 0 seq 0), reduce_grad (graph 1 seq 0), end_backward "
                "(graph 1 seq 2) of micro-step 0"),
            std::string::npos)
      << warnings.messages[0];
}

TEST_F(RecorderTest, MoreCatchUpsThanLeadingAgainMakesUpForLeaveDeviceTimesOut) {
  auto rec = ledStepCatchingUpAt({1, 2, 4, 6}, 1.0);  // four of the six ops
  // The step's lead again at the first three only.
  EXPECT_EQ(timer->leads[1], timer->leads[0]);
  EXPECT_EQ(timer->leads[2], timer->leads[0]);
  EXPECT_EQ(timer->leads[4], timer->leads[0]);
  EXPECT_EQ(timer->leads[6], 1000.0);
  microStep(*rec, 200, true);
  CollectedWarnings warnings;
  schemas::Trace t = finish(*rec, 257);
  EXPECT_FALSE(t.steps[0].graphs[0].events[0].deviceUs);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("more than 3 times"), std::string::npos) << warnings.messages[0];
}

TEST_F(RecorderTest, ACatchUpWhileTheOptimizerWasIssuedLeavesOnlyTheOptimizersTimeOut) {
  for (bool caughtUp : {false, true}) {
    auto rec = make(/*steps=*/1, /*warmup=*/2);
    microStep(*rec, 0, true);
    rec->onOptimizerStepIssued();  // not a led step: nothing to ask
    EXPECT_EQ(timer->reachedCalls, 0);
    microStep(*rec, 100, true, 0.5);              // led
    timer->caughtUpAtCall = caughtUp ? 1 : 1000;  // reached() is asked once, at the optimizer's hook
    const int before = timer->reachedCalls;
    rec->onOptimizerStepIssued();
    EXPECT_EQ(timer->reachedCalls, before + 1);
    timer->caughtUpAtCall = 0;
    microStep(*rec, 200, true);
    schemas::Trace t = validRoundTrip(finish(*rec, 257));
    EXPECT_EQ(t.steps[0].optimizerDeviceUs.has_value(), !caughtUp) << caughtUp;
    EXPECT_TRUE(t.steps[0].graphs[0].events[0].deviceUs) << "the ops' own times hold either way";
  }
}

TEST_F(RecorderTest, EachAccumulatedMicroStepPairsWithTheLedOneAtItsPosition) {
  auto rec = make(/*steps=*/1, /*warmup=*/2);
  microStep(*rec, 0, false);  // warm-up step 0, two micro-steps
  microStep(*rec, 100, true);
  microStep(*rec, 200, false, 0.5);  // the led step: its micro-steps at their own device speeds
  microStep(*rec, 300, true, 0.25);
  microStep(*rec, 400, false);  // recorded
  microStep(*rec, 500, true);
  schemas::Trace t = validRoundTrip(finish(*rec, 570));
  ASSERT_EQ(t.steps.size(), 2u);
  for (size_t m = 0; m < 2; ++m) {
    const double share = m == 0 ? 0.5 : 0.25;
    for (const auto& g : t.steps[m].graphs) {
      for (const auto& e : g.events)
        EXPECT_DOUBLE_EQ(e.deviceUs.value_or(-1), share * e.computeUs) << m << e.op;
    }
  }
  EXPECT_FALSE(t.steps[0].optimizerDeviceUs);  // the optimizer runs after the last micro-step only
  EXPECT_DOUBLE_EQ(t.steps[1].optimizerDeviceUs.value_or(-1), 400.0 - (300.0 + 0.25 * 40.0));
}

TEST_F(RecorderTest, CatchUpsFromTheThirdOpOnOrAStepOfOtherOpsLeaveDeviceTimesOut) {
  {  // the device reached every mark from the third op on: more catch-ups than leading again makes up for
    auto rec = make(/*steps=*/1, /*warmup=*/2);
    microStep(*rec, 0, true);
    timer->caughtUpAtCall = 3;
    microStep(*rec, 100, true);
    EXPECT_GE(timer->reachedCalls, 3);
    timer->caughtUpAtCall = 0;
    microStep(*rec, 200, true);
    schemas::Trace t = finish(*rec, 257);
    EXPECT_FALSE(t.steps[0].graphs[0].events[0].deviceUs);
  }
  {  // the recorded step issues an op the led step did not: that step has none, the others keep theirs
    auto rec = make(/*steps=*/2, /*warmup=*/2);
    for (double t0 : {0.0, 100.0, 200.0}) microStep(*rec, t0, true);
    now = 300;
    rec->onStartForward();
    op(*rec, "allgather_param", 0, 1, 301, 2, {}, 12);  // another parameter first
    now = 320;
    rec->onStartBackward(true, true);
    op(*rec, "end_backward", 1, -1, 330, 1);
    schemas::Trace t = finish(*rec, 357);
    ASSERT_EQ(t.steps.size(), 2u);
    EXPECT_TRUE(t.steps[0].graphs[0].events[0].deviceUs);
    EXPECT_TRUE(t.steps[0].optimizerDeviceUs);
    EXPECT_FALSE(t.steps[1].graphs[0].events[0].deviceUs);
    EXPECT_FALSE(t.steps[1].optimizerDeviceUs);
  }
}

TEST_F(RecorderTest, GradientAccumulationGivesMicroStepsAndOneOptimizerTime) {
  auto rec = make(/*steps=*/1, /*warmup=*/0);
  microStep(*rec, 0, false);
  microStep(*rec, 100, true);
  now = 170;
  rec->onStartForward();
  ASSERT_TRUE(rec->done());
  schemas::Trace t = rec->buildTrace({{{65536, 1.0}}, {{65536, 1.0}}, {{65536, 1.0}}, {}, {}});
  ASSERT_EQ(t.steps.size(), 2u);
  EXPECT_EQ(t.meta.gradAccumSteps, 2);
  EXPECT_EQ(t.steps[0].optimizerUs, 0.0);
  EXPECT_DOUBLE_EQ(t.steps[1].optimizerUs, 170.0 - 140.0);
  EXPECT_EQ(t.steps[1].index, 1);
}

TEST_F(RecorderTest, FusedPrefetchKeepsItsIdsAndOpsOfNoGraphAreSkipped) {
  auto rec = make(1, 0);
  now = 0;
  rec->onStartForward();
  std::vector<int64_t> ids{0, 1};
  OpEvent fused{"prefetch_params_fused", 0, -1, 56, at::kFloat, ids};
  rec->onOpBegin(fused);
  rec->onOpEnd(fused);
  OpEvent loose{"free_tensors", -1, -1, 0, at::ScalarType::Undefined};
  rec->onOpBegin(loose);
  rec->onOpEnd(loose);
  OpEvent release{"release_param", 0, 1, 0, at::kFloat, {}, 3};
  rec->onOpBegin(release);
  rec->onOpEnd(release);
  OpEvent end{"end_backward", 1, -1, 0, at::ScalarType::Undefined};
  rec->onStartBackward(true, true);
  rec->onOpBegin(end);
  rec->onOpEnd(end);
  now = 5;
  rec->onStartForward();
  schemas::Trace t = rec->buildTrace({{{65536, 1.0}}, {{65536, 1.0}}, {{65536, 1.0}}, {}, {}});
  ASSERT_EQ(t.steps.size(), 1u);
  const auto& fwd = t.steps[0].graphs[0].events;
  ASSERT_EQ(fwd.size(), 2u);
  EXPECT_EQ(fwd[0].dsIds, ids);
  EXPECT_EQ(fwd[0].bytes, 56u);
  EXPECT_EQ(fwd[0].endUs, fwd[0].startUs);  // no collective seen: no time on the stream
  EXPECT_EQ(fwd[1].nUsers.value_or(0), 3);
}

TEST_F(RecorderTest, FinishCalibratesValidatesAndWritesTheRankTrace) {
  auto rec = make(1, 0, /*ws=*/1);
  microStep(*rec, 0, true);
  EXPECT_THROW(rec->finish(), c10::Error);  // not done yet
  now = 60;
  rec->onStartForward();
  const auto path = rec->finish();
  EXPECT_EQ(path.filename(), "rank0.trace.json");
  schemas::Trace t = schemas::readTrace(path);
  EXPECT_EQ(t.steps.size(), 1u);
  EXPECT_GE(t.calibration.allGather.size(), 3u);
  EXPECT_FALSE(t.calibration.graphStepUs.has_value());  // not a graphed step's recording
  EXPECT_THROW(rec->finish(), c10::Error);  // once only
}

TEST_F(RecorderTest, AGraphedStepsCapturedTimeIsTakenAfterEveryStepIsRecorded) {
  auto rec = make(1, 0, /*ws=*/1);
  rec->markGraphed();
  microStep(*rec, 0, true);
  EXPECT_THROW(rec->setGraphStepUs(900.0), c10::Error);  // the step is still being recorded
  now = 60;
  rec->onStartForward();
  EXPECT_THROW(rec->setGraphStepUs(0.0), c10::Error);  // a device time is positive
  // Calibrated before the capture (collective); the trace is written after the timed replays.
  rec->calibrateNow();
  EXPECT_THROW(rec->calibrateNow(), c10::Error);  // once
  rec->setGraphStepUs(900.0);
  schemas::Trace t = schemas::readTrace(rec->finish());
  EXPECT_TRUE(t.meta.graphed);
  EXPECT_EQ(t.calibration.graphStepUs, 900.0);
  EXPECT_GE(t.calibration.allGather.size(), 3u);  // the calibration made before
  EXPECT_THROW(rec->setGraphStepUs(900.0), c10::Error);  // the trace is written
  // A recording that is not through dcplan.graphed_step has no captured step to time.
  auto plain = make(1, 0, /*ws=*/1);
  microStep(*plain, 0, true);
  now = 120;
  plain->onStartForward();
  EXPECT_THROW(plain->setGraphStepUs(900.0), c10::Error);
}

TEST(Calibration, ThreeSizesAtLeastGrowingByFourWithinTheBudget) {
  LocalTransport t;
  t.ws = 2;
  CalibrationOptions o;
  o.budgetSeconds = 1e-6;  // only the minimum number of points
  o.repetitions = 3;
  schemas::Calibration c = calibrate(t, o);
  ASSERT_EQ(c.allGather.size(), 3u);
  EXPECT_EQ(c.allGather[0].bytes, 65536u);
  EXPECT_EQ(c.allGather[1].bytes, 4u * 65536u);
  EXPECT_EQ(c.reduceScatter[2].bytes, 16u * 65536u);
  EXPECT_EQ(c.allReduce.size(), 3u);
  // CPU: the memcpy rate into a host pool of its own, each way (an offload's copies).
  ASSERT_TRUE(c.h2dGBps.has_value() && c.d2hGBps.has_value());
  EXPECT_GT(*c.h2dGBps, 0);
  EXPECT_GT(*c.d2hGBps, 0);
  // The ranks' compute, timed all at once: the slowest rank's.
  ASSERT_TRUE(c.computeProbeUs.has_value());
  EXPECT_GT(*c.computeProbeUs, 0);
  // Each point: one warm-up and 3 timed runs per collective, then one agreement all-reduce; the
  // probe: an all-reduce that lines the ranks up, and the one that agrees on the slowest.
  EXPECT_EQ(t.calls.size(), 3u * (3u * 4u + 1u) + 2u);
  o.budgetSeconds = 30;
  o.maxBytes = 1u << 20;
  EXPECT_EQ(calibrate(t, o).allGather.size(), 3u);  // stops at maxBytes
}

/// Times the queued calls at `times` in turn; the device has caught up at the reached() calls
/// in `caughtUpAt` (counted from 1). `order` says what it was asked, in turn, with the transport's
/// calls so far: "lead", "mark <point> <calls>", "reached <point>", "elapsed <from> <to>".
class QueuedTimer final : public DeviceTimer {
 public:
  explicit QueuedTimer(const std::vector<std::string>& calls) : calls_(calls) {}
  TimePoint mark(Stream) override {
    order.push_back("mark " + std::to_string(marks) + " " + std::to_string(calls_.size()));
    return marks++;
  }
  double elapsedUs(TimePoint from, TimePoint to) override {
    order.push_back("elapsed " + std::to_string(from) + " " + std::to_string(to));
    return times.at(elapsedCalls++ % times.size());
  }
  bool queueLead(double us) override {
    order.push_back("lead");
    leads.push_back(us);
    return canLead;
  }
  bool reached(TimePoint point) override {
    order.push_back("reached " + std::to_string(point));
    return caughtUpAt.count(++reachedCalls) > 0;
  }

  std::vector<double> times{5, 7, 6};
  std::set<int> caughtUpAt;
  bool canLead = true;
  std::vector<double> leads;
  std::vector<std::string> order;
  TimePoint marks = 0;
  size_t elapsedCalls = 0;
  int reachedCalls = 0;

 private:
  const std::vector<std::string>& calls_;
};

TEST(Calibration, AQueuedTimerTimesEachCallAgainOnTheDeviceAlone) {
  LocalTransport t;
  t.ws = 2;
  CalibrationOptions o;
  o.budgetSeconds = 1e-6;
  o.repetitions = 3;
  auto timer = std::make_shared<QueuedTimer>(t.calls);
  timer->caughtUpAt = {1};  // the first all-gather's first repetition: dropped, not repeated
  o.queuedTimer = timer;
  const schemas::Calibration c = calibrate(t, o);
  ASSERT_EQ(c.allGather.size(), 3u);
  for (const auto* curve : {&c.allGather, &c.reduceScatter, &c.allReduce}) {
    for (const auto& p : *curve) {
      ASSERT_TRUE(p.deviceUs.has_value()) << p.bytes;
      EXPECT_GT(p.us, 0);
    }
  }
  EXPECT_DOUBLE_EQ(*c.allGather[0].deviceUs, 6.5);  // 7 and 6: the 5 was caught up with
  EXPECT_DOUBLE_EQ(*c.reduceScatter[0].deviceUs, 6);
  // Every repetition is one more call on every rank, behind a lead far above a launch's host time.
  EXPECT_EQ(t.calls.size(), 3u * (3u * 7u + 1u) + 2u);
  ASSERT_EQ(timer->leads.size(), 27u);
  EXPECT_GE(timer->leads.front(), 500.0);
  // Each repetition: the lead, a mark, the call and its wait, a mark; then whether the device had
  // reached the first mark by then, and the time between the two (the first all-gather's 3 calls
  // come after its untimed and 3 host-timed ones).
  ASSERT_GE(timer->order.size(), 5u);
  EXPECT_EQ(std::vector<std::string>(timer->order.begin(), timer->order.begin() + 5),
            (std::vector<std::string>{"lead", "mark 0 4", "mark 1 5", "reached 0", "elapsed 0 1"}));

  // The device caught up every time, or cannot be led: no device times.
  timer->caughtUpAt = {};
  for (int i = 1; i <= 100; ++i) timer->caughtUpAt.insert(i);
  timer->reachedCalls = 0;
  EXPECT_FALSE(calibrate(t, o).allGather[0].deviceUs.has_value());
  // A timer that cannot lead still makes every call: the ranks' calls pair up whatever it does.
  timer->canLead = false;
  const size_t before = t.calls.size();
  EXPECT_FALSE(calibrate(t, o).allReduce[0].deviceUs.has_value());
  EXPECT_EQ(t.calls.size() - before, 3u * (3u * 7u + 1u) + 2u);
  o.queuedTimer = nullptr;
  EXPECT_FALSE(calibrate(t, o).allGather[0].deviceUs.has_value());
}

TEST(Calibration, TheBudgetCountsTheCallsTimedOnTheDeviceAndTheirLeads) {
  // 100 repetitions: each next size timed on the device queues 3 x 100 leads of a millisecond,
  // 0.3 s, beyond the budget of 0.2 s; on the host alone the small sizes take milliseconds.
  LocalTransport t;
  t.ws = 2;
  CalibrationOptions o;
  o.budgetSeconds = 0.2;
  o.repetitions = 100;
  o.minPoints = 1;
  o.maxBytes = 1u << 20;
  EXPECT_EQ(calibrate(t, o).allGather.size(), 3u);  // to maxBytes
  o.queuedTimer = std::make_shared<QueuedTimer>(t.calls);
  EXPECT_EQ(calibrate(t, o).allGather.size(), 1u);
}

TEST(Calibration, OddWorldSizeRecordsTheSizeActuallySent) {
  LocalTransport t;
  t.ws = 3;
  CalibrationOptions o;
  o.budgetSeconds = 1e-6;
  schemas::Calibration c = calibrate(t, o);
  EXPECT_EQ(c.allGather[0].bytes, (65536u / 4u / 3u) * 3u * 4u);
}

TEST(TimedTransport, ReportsLaunchAndFirstCompletionOnly) {
  struct Listener : CollectiveListener {
    int64_t onCollectiveLaunch(CollectiveKind kind) override {
      kinds.push_back(kind);
      return static_cast<int64_t>(kinds.size()) - 1;
    }
    void onCollectiveDone(int64_t token) override { done.push_back(token); }
    std::vector<CollectiveKind> kinds;
    std::vector<int64_t> done;
  };
  auto inner = std::make_shared<LocalTransport>();
  auto listener = std::make_shared<Listener>();
  auto t = makeTimedTransport(inner, listener);
  at::Tensor out = at::zeros({4}), in = at::ones({4});
  auto h = t->allReduce(out);
  EXPECT_FALSE(h->isCompleted());
  EXPECT_TRUE(listener->done.empty());
  h->wait();
  h->wait();
  EXPECT_TRUE(h->isCompleted());
  EXPECT_EQ(listener->done, std::vector<int64_t>{0});
  t->allGather(at::zeros({4}), in)->wait();
  EXPECT_EQ(listener->kinds, (std::vector<CollectiveKind>{CollectiveKind::Reduce, CollectiveKind::Gather}));
  EXPECT_EQ(inner->calls, (std::vector<std::string>{"allReduce", "allGather"}));
  // The shard gathers of the executor: timed once, through the inner transport's own path.
  t->gatherShards({at::zeros({4})}, {in})->wait();
  EXPECT_EQ(listener->kinds.back(), CollectiveKind::Gather);
  EXPECT_EQ(listener->kinds.size(), 3u);
  EXPECT_EQ(inner->calls.back(), "allGather");
  EXPECT_EQ(t->newGatherBuffer(6, at::kFloat).numel(), 6);
  listener.reset();  // a gone listener hears nothing and breaks nothing
  t->allReduce(out)->wait();
}

/// `ms` of the host's time, reported as the recorder's own work (recorder::addOwnHostWorkNs) or not.
void hostWork(int ms, bool own) {
  const int64_t start = replayer::monotonicNs();
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  if (own) addOwnHostWorkNs(replayer::monotonicNs() - start);
}

TEST_F(RecorderTest, TheRecordersOwnWorkBetweenOpsIsLeftOutOfTheHostsTimes) {
  auto rec = make(/*steps=*/1, /*warmup=*/0);
  now = 0;
  rec->onStartForward();
  op(*rec, "allgather_param", 0, 0, 1, 1, {}, 40);
  hostWork(30, /*own=*/true);  // the saved-activation bookkeeping, say
  op(*rec, "wait_allgather", 0, 0, 3, 1);
  hostWork(30, /*own=*/false);  // the model's compute
  op(*rec, "release_param", 0, 0, 10, 1);
  now = 20;
  rec->onStartBackward(true, true);
  op(*rec, "reduce_grad", 1, 0, 20, 1);
  op(*rec, "reduce_grad", 1, 1, 22, 1);
  op(*rec, "end_backward", 1, -1, 30, 1);
  hostWork(30, /*own=*/true);  // the optimizer post-hook's
  const schemas::Trace t = finish(*rec, 57);
  const auto& fwd = t.steps[0].graphs[0].events;
  ASSERT_EQ(fwd.size(), 3u);
  ASSERT_TRUE(fwd[1].hostUs && fwd[2].hostUs && t.steps[0].optimizerHostUs);
  // The host's own readings beside 30 ms of work: microseconds (bounded at half of it, so that a
  // preempted test thread does not fail it).
  EXPECT_LT(*fwd[1].hostUs, 15000.0);
  EXPECT_GE(*fwd[2].hostUs, 30000.0);
  EXPECT_LT(*t.steps[0].optimizerHostUs, 15000.0);
}

/// The CPU's timer reads the same clock: the compute between two marks leaves the recorder's work out.
TEST(HostClock, TheRecordersOwnWorkIsLeftOutOfTheHostTimer) {
  const auto timer = makeHostTimer();
  const TimePoint a = timer->mark(Stream::Compute);
  hostWork(30, /*own=*/true);
  // What the reading takes beside the work: microseconds, far under the 30 ms left out (half of
  // it, so that a preempted test thread does not fail it).
  EXPECT_LT(timer->elapsedUs(a, timer->mark(Stream::Compute)), 15000.0);
  const TimePoint b = timer->mark(Stream::Compute);
  hostWork(30, /*own=*/false);
  EXPECT_GE(timer->elapsedUs(b, timer->mark(Stream::Compute)), 30000.0);
}

TEST(CpuMemoryProbe, CountsLiveCpuTensors) {
  auto probe = makeCpuMemoryProbe();
  const uint64_t before = probe->bytesInUse();
  {
    at::Tensor t = at::empty({1 << 20}, at::kFloat);  // 4 MiB
    EXPECT_GE(probe->bytesInUse(), before + (4u << 20));
  }
  EXPECT_LT(probe->bytesInUse(), before + (4u << 20));
  EXPECT_GT(probe->capacityBytes(), 0u);
}

TEST(CpuMemoryProbe, RawAllocationsWork) {
  // oneDNN's bf16 kernels allocate through raw_allocate, which needs context == data.
  auto probe = makeCpuMemoryProbe();
  c10::Allocator* cpu = c10::GetCPUAllocator();
  const uint64_t before = probe->bytesInUse();
  void* p = cpu->raw_allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);  // as aligned as torch's own allocations
  EXPECT_EQ(probe->bytesInUse(), before + 1000);
  cpu->raw_deallocate(p);
  EXPECT_EQ(probe->bytesInUse(), before);
  // And the kernel that hit it: a bf16 linear on the CPU.
  at::Tensor x = at::randn({8, 64}).to(at::kBFloat16);
  at::Tensor w = at::randn({32, 64}).to(at::kBFloat16);
  EXPECT_EQ(at::linear(x, w).sizes(), (std::vector<int64_t>{8, 32}));
}

TEST(DtypeName, TorchNames) {
  EXPECT_EQ(dtypeName(at::kBFloat16), "bfloat16");
  EXPECT_EQ(dtypeName(at::kFloat), "float32");
  EXPECT_EQ(dtypeName(c10::ScalarType::Undefined), "");
  EXPECT_THROW(dtypeName(c10::ScalarType::ComplexFloat), c10::Error);
}

}  // namespace
}  // namespace dcplan::recorder
