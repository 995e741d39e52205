// Record mode of the runtime: captures every dc op of the recorded steps and writes the rank's trace.
#pragma once

#include "dcplan/recorder/Comm.h"
#include "dcplan/recorder/Probes.h"
#include "dcplan/replayer/OpObserver.h"
#include "dcplan/schemas/trace.h"

#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace dcplan::recorder {

struct RecorderConfig {
  /// Where rank<R>.progress and rank<R>.trace.json go ($DCPLAN_RECORD).
  std::filesystem::path directory;
  /// Optimizer steps to record, after `warmup` unrecorded ones.
  int64_t steps = 3;
  int64_t warmup = 2;
  /// meta.device ("cpu", "NVIDIA H200") and meta.versions.
  std::string deviceName = "cpu";
  std::map<std::string, std::string> versions;
  CalibrationOptions calibration;
};

/// The host's steady clock in nanoseconds: beside each device mark, so that a trace tells the
/// host's time from the device's (a host-bound step is one whose host time is the longer).
using HostTime = int64_t;

/// One sharded model: its graphs and parameter table (one per dcplan.shard()).
struct ModelInfo {
  int64_t stage = 3;
  int64_t forwardGraph = 0;
  int64_t backwardGraph = 1;
  std::string paramDtype = "float32";   ///< gather dtype, torch name
  std::string reduceDtype = "float32";  ///< dtype of the reduce buckets
  bool compiled = false;                ///< replayed in torch.compile graphs (trace meta.replay)
  std::vector<schemas::TraceParam> params;
};

/// Observes the runtime (OpObserver) and its transport (CollectiveListener).
///
/// Steps: a micro-step starts at start_forward; an optimizer step ends with the
/// micro-step whose backward was started with sync. The first `warmup`
/// optimizer steps are not recorded, the next `steps` are, each micro-step as
/// one trace step. Events are kept in memory as raw time points and turned
/// into the trace only by buildTrace(), after the last step.
///
/// Device-lead step: with a warm-up of at least 2 on a device whose timer can lead
/// (DeviceTimer::queueLead), the micro-steps of the last warm-up step start behind busy work
/// longer than the host's time for a step, and more is queued before each op and after the
/// backward, between two marks that take it out of the times (the launch queue holds only so
/// many kernels: one lead at the start runs out where the host issues slower than the device
/// runs), so that the device runs the step without ever waiting for the host. Their compute
/// between ops, paired with the recorded micro-steps by position,
/// is the trace's device_us and optimizer_device_us: the device's own time, which a step
/// replayed as one CUDA graph runs. Where the device caught up with the host anyway (a mark it
/// had reached when the host issued the next op), there is none.
///
/// Sequence: an event's seq is its index among the ops of its graph id within
/// the micro-step, counting only the ops the runtime's entry points report
/// (what the Python hooks issue); ops of no graph (graph_id -1) are not part of
/// any sequence.
class Recorder final : public replayer::OpObserver, public CollectiveListener {
 public:
  Recorder(RecorderConfig config, std::unique_ptr<DeviceTimer> timer, std::unique_ptr<MemoryProbe> memory);

  /// The transport the runtime runs on (unwrapped): rank, world size, backend,
  /// and the calibration's collectives.
  void attachTransport(std::shared_ptr<replayer::Transport> transport);
  void addModel(const ModelInfo& model);
  /// The script runs its step through dcplan.graphed_step (recorded uncaptured): trace meta.graphed.
  void markGraphed();
  /// Once done(), before finish(): the device time of one replay of the recorded step captured in
  /// one CUDA graph (dcplan.graphed_step times a few after the recorded steps), us: the trace's
  /// calibration.graph_step_us.
  void setGraphStepUs(double us);
  /// A replay of this job checks each collective with the ranks first (DCPLAN_CHECK_COLLECTIVES), which
  /// the recording does not: the trace says so (meta.checks_collectives), and the planner charges them.
  void markChecksCollectives();
  /// After an optimizer step: the optimizer's per-element state of each shard it steps, bytes by
  /// ds_id (trace params' optimizer_state_bytes; the planner offloads it under a tight budget),
  /// how it runs over each where known (optimizer_impl: for_loop, foreach or fused) and the
  /// number of each one's param group (optimizer_group).
  void setOptimizerState(const std::map<int64_t, uint64_t>& bytesById,
                         const std::map<int64_t, std::string>& implById = {},
                         const std::map<int64_t, int64_t>& groupById = {});
  /// A forward that is not a training micro-step (an eval forward, without grad) runs while
  /// paused: its start and ops are not recorded and it counts as no step.
  void setPaused(bool paused);
  /// In a recorded micro-step, after its start_forward: the shapes of the tensor arguments of the
  /// forward of the model whose forward graph is `forwardGraph` (the trace graph's input_shapes).
  void setInputShapes(int64_t forwardGraph, schemas::InputShapes shapes);
  /// In a recorded micro-step, by its backward's end: what the forward whose graph is
  /// `forwardGraph` saved for the backward (the trace graph's saved_activations).
  void setSavedActivations(int64_t forwardGraph, std::vector<schemas::SavedActivation> saved);
  /// In a recorded micro-step: how many ops of graph `graphId` it has run so far (the seq of
  /// the next one); -1 outside one.
  int64_t position(int64_t graphId) const;
  /// In a warm-up step (not recorded): how many optimizer steps came before it; -1 otherwise.
  int64_t warmupStep() const;

  void onOpBegin(const replayer::OpEvent& event) override;
  void onOpEnd(const replayer::OpEvent& event) override;
  void onStartForward() override;
  void onStartBackward(bool update, bool sync) override;
  /// An optimizer's step() returned on the host (torch's global optimizer post-hook, armed
  /// while recording). In the device-lead step the device should still be running the busy
  /// work queued after end_backward: if it already passed it, it ran the optimizer step as the
  /// host issued it, and its optimizer time holds waits for the host (no optimizer_device_us).
  void onOptimizerStepIssued();

  int64_t onCollectiveLaunch(CollectiveKind kind) override;
  void onCollectiveHandle(int64_t token, const std::shared_ptr<replayer::CommHandle>& handle) override;
  void onCollectiveDone(int64_t token) override;

  /// All steps are recorded (known at the start_forward after the last one).
  bool done() const;
  int64_t recordedSteps() const;
  /// What the memory probe reports now.
  uint64_t memoryInUse() const { return memory_->bytesInUse(); }
  /// The rank's trace from what was recorded, with the given calibration.
  schemas::Trace buildTrace(const schemas::Calibration& calibration);
  /// Once done(), before finish(): calibrates now (collective: every rank at once), so that a
  /// finish() later (a graphed step's, after its captured replays are timed, or at shutdown or exit)
  /// runs no collective and holds no calibration buffer beside the captured graph's memory.
  void calibrateNow();
  /// Once done(): calibrates (collective; unless calibrateNow() did), builds and checks the trace,
  /// writes rank<R>.trace.json atomically, stops recording; returns the file.
  std::filesystem::path finish();
  std::filesystem::path tracePath() const;
  std::filesystem::path progressPath() const;

 private:
  struct RawEvent {
    const char* op = "";  // the runtime's op names are string literals
    int64_t graphId = -1;
    int64_t dsId = -1;
    std::vector<int64_t> dsIds;  // prefetch_params_fused
    int64_t nUsers = 0;
    int64_t bytes = 0;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    TimePoint begin = 0;
    TimePoint end = 0;
    // led: the mark before the busy work queued at the op, where the compute before it ends
    std::optional<TimePoint> stretchEnd;
    // The host's clock around the recorder's own work, which lies in neither host time:
    // host_us runs from the previous op's hostResume to hostCall, issue_us from hostBegin
    // to hostEnd (a replay runs without that work).
    HostTime hostCall = 0;    // onOpBegin entered
    HostTime hostBegin = 0;   // onOpBegin returns: the op's own work starts
    HostTime hostEnd = 0;     // onOpEnd entered: the op's own work is done
    HostTime hostResume = 0;  // onOpEnd returns
    uint64_t memory = 0;
    uint64_t peak = 0;        // the most in use since the previous op
    int64_t collective = -1;  // index into collectives_
  };
  struct Collective {
    CollectiveKind kind;
    TimePoint launch = 0;
    TimePoint done = 0;
    bool completed = false;
    std::vector<size_t> events;  // indices into the micro-step's events, in issue order
  };
  struct MicroStep {
    int64_t micro = 0;       // position within its optimizer step
    bool led = false;        // a device-lead micro-step (its events give device_us)
    double leadUs = 0;       // led: the busy work queued at its start
    TimePoint lastMark = 0;  // led: the latest mark, start or an op's end
    // led: the ops (indices into events) at which the device had run all it was given (a host
    // synchronisation in the model, or busy work that ran out); it may have waited for the host
    // since the op before began.
    std::vector<size_t> catchUps;
    // led: the device passed end_backward's busy work before the optimizer was issued
    bool optimizerCaughtUp = false;
    TimePoint start = 0;
    HostTime hostStart = 0;
    bool sync = false;
    bool sawEndBackward = false;
    TimePoint endBackward = 0;
    HostTime hostEndBackward = 0;
    // Where the optimizer's span ended when a paused forward (an eval) came before the next
    // training one: its time is not the optimizer's.
    std::optional<TimePoint> optimizerEnd;
    std::optional<HostTime> hostOptimizerEnd;
    double optimizerUs = 0;
    std::optional<double> optimizerHostUs;  // none when a host reading is missing
    std::vector<RawEvent> events;
    std::map<int64_t, schemas::InputShapes> inputShapes;  // by forward graph id
    std::map<int64_t, std::vector<schemas::SavedActivation>> savedActivations;  // by forward graph id
    std::map<int64_t, int64_t> opsOfGraph;  // events so far, by graph id (the next one's seq)
    std::vector<size_t> pendingReduce;  // reduce_grad events not yet carried by a collective
  };

  void writeProgress();
  /// Ops are observed: a recorded or a device-lead micro-step.
  bool observing() const { return recording_ || current_.led; }
  /// In a recorded training micro-step (not paused, not past the last): what Python hands in belongs to it.
  bool inRecordedMicroStep() const { return !finished_ && !done_ && !paused_ && recording_ && haveMicro_; }
  /// The registered graphs of a micro-step in the order their first op came, and each graph's
  /// events (indices into MicroStep::events) in issue order.
  struct GraphOrder {
    std::vector<int64_t> order;
    std::map<int64_t, std::vector<size_t>> byGraph;
  };
  static GraphOrder graphOrder(const MicroStep& step, const std::set<int64_t>& registered);
  /// The device-lead micro-step that pairs with the recorded `step` (same position, same ops,
  /// and an optimizer time where `step` has one); nullptr where none does.
  const MicroStep* pairedLead(const MicroStep& step, size_t ledCount) const;
  /// The compute before each event of `step` (by index; 0 for events of unregistered graphs):
  /// from the previous op of its graph, the first graph's first op from the step's start, a
  /// later graph's from where the graph before it ended.
  std::vector<double> computeBeforeUs(const MicroStep& step, const GraphOrder& graphs);
  /// A device-lead micro-step's times, by event index: the compute before each event, and the
  /// op's own span on the compute stream (none for an op that makes it wait for another stream).
  struct LedTimes {
    std::vector<double> computeBeforeUs;
    std::vector<std::optional<double>> opUs;
  };
  /// The device-lead step's times for every micro-step position (empty when there is none);
  /// warns where the lead did not hold.
  std::vector<LedTimes> deviceTimes(const std::set<int64_t>& registered);

  /// What the trace needs of the registered models: each graph's kind and model, each
  /// parameter's shard size.
  struct TraceModel {
    std::map<int64_t, std::pair<schemas::GraphKind, const ModelInfo*>> graphs;
    std::set<int64_t> registered;
    std::map<int64_t, int64_t> shardNumel;
  };
  /// The trace's meta, memory, params and calibration; fills `model`.
  schemas::Trace traceHeader(const schemas::Calibration& calibration, TraceModel& model) const;
  /// One recorded micro-step as the trace's step (no graphs: it issued no op of a registered graph).
  schemas::TraceStep traceStep(const MicroStep& step, int64_t index, const TraceModel& model,
                               const std::vector<LedTimes>& ledTimes);
  /// One graph's events of `step`, timed from `origin` (moved on to where the graph ended).
  schemas::TraceGraph traceGraph(const MicroStep& step, int64_t graph, const std::vector<size_t>& events,
                                 const TraceModel& model, const std::vector<double>& before,
                                 const LedTimes* led, TimePoint& origin, HostTime& hostOrigin) const;
  /// The trace event of raw event i: what it is, memory, and the host's and (led) device's times.
  schemas::OpEvent opEvent(const RawEvent& raw, int64_t seq, double computeUs, const LedTimes* led, size_t i,
                           HostTime hostPrevEnd) const;
  /// The span of op i off the compute stream: its collective's (a bucket's divided among its
  /// gradients by bytes, which become e's bytes in the reduce dtype); none where it launched none.
  std::pair<double, double> collectiveSpanUs(const MicroStep& step, size_t i, const ModelInfo& model,
                                             const TraceModel& tm, TimePoint origin, TimePoint graphEnd,
                                             schemas::OpEvent& e) const;

  RecorderConfig config_;
  std::unique_ptr<DeviceTimer> timer_;
  std::unique_ptr<MemoryProbe> memory_;
  std::shared_ptr<replayer::Transport> transport_;
  std::vector<ModelInfo> models_;

  mutable std::recursive_mutex mutex_;
  bool recording_ = false;  // the current micro-step is recorded
  bool done_ = false;
  bool graphed_ = false;                        ///< markGraphed()
  std::optional<double> graphStepUs_;           ///< setGraphStepUs()
  std::optional<schemas::Calibration> calibrated_;  ///< calibrateNow()
  bool checksCollectives_ = false;  ///< markChecksCollectives()
  /// setOptimizerState(), by ds_id: the trace param's optimizer fields.
  struct OptimizerFields {
    std::optional<uint64_t> stateBytes;
    std::optional<std::string> impl;
    std::optional<int64_t> group;
  };
  std::map<int64_t, OptimizerFields> optimizer_;
  bool paused_ = false;  ///< setPaused()
  bool finished_ = false;
  int64_t optimizerStepsSeen_ = 0;  // completed optimizer steps, warm-up included
  int64_t recordedSteps_ = 0;
  int64_t microInStep_ = 0;  // micro-steps of the optimizer step in progress
  double agreedSpanUs_ = 0;  // the device-lead step's host span, agreed over the ranks at its start
  int64_t gradAccumSteps_ = 1;
  bool haveMicro_ = false;
  MicroStep current_;  // the micro-step in progress (events only when recording_)
  std::deque<MicroStep> recorded_;
  std::vector<MicroStep> led_;  // the device-lead step's micro-steps, in order
  std::vector<Collective> collectives_;
  std::vector<std::pair<int64_t, std::weak_ptr<replayer::CommHandle>>> inFlight_;
  int64_t currentEvent_ = -1;  // the op between onOpBegin and onOpEnd, index into current_.events
  uint64_t baselineBytes_ = 0;
};

/// The torch name of a dtype ("float32", "bfloat16"), as traces name dtypes.
std::string dtypeName(c10::ScalarType dtype);

}  // namespace dcplan::recorder
