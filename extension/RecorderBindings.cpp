// dcplan._C record_* functions: one recorder per process, armed before the runtime starts.
#include "Bindings.h"

#include "dcplan/recorder/Probes.h"
#include "dcplan/recorder/Recorder.h"
#include "dcplan/replayer/Runtime.h"
#include "dcplan/schemas/io.h"
#include "dcplan/schemas/network.h"

#include <nlohmann/json.hpp>

#include <mutex>

namespace py = pybind11;

namespace dcplan::extension {
namespace {

using namespace dcplan::recorder;
using Release = py::call_guard<py::gil_scoped_release>;

std::mutex gMutex;
std::shared_ptr<Recorder> gRecorder;  // armed by record_begin, dropped by record_stop
bool gAttached = false;               // wrapped the runtime's transport

/// The armed recorder, or null.
std::shared_ptr<Recorder> armed() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gRecorder;
}

std::shared_ptr<Recorder> current(const char* fn) {
  std::shared_ptr<Recorder> rec = armed();
  TORCH_CHECK(rec != nullptr, fn, ": recording is not on; call record_begin() first");
  return rec;
}

/// record_begin and record_attach: arming the recorder, and observing the runtime with it.
void bindArming(py::module_& m) {
  m.def(
      "record_begin",
      [](const std::string& directory, int64_t steps, int64_t warmup, const std::string& device,
         const std::string& deviceName, const std::map<std::string, std::string>& versions,
         double calibrationSeconds) {
        std::lock_guard<std::mutex> lock(gMutex);
        TORCH_CHECK(gRecorder == nullptr, "record_begin: recording is already on in this process");
        TORCH_CHECK(!replayer::isInitialized(),
                    "record_begin: the dc runtime is already running; recording must be switched on before "
                    "the first dcplan.shard() of the process starts it");
        RecorderConfig config;
        config.directory = directory;
        config.steps = steps;
        config.warmup = warmup;
        config.deviceName = deviceName;
        config.versions = versions;
        config.calibration.budgetSeconds = calibrationSeconds;
        config.calibration.device = c10::Device(device);
        DeviceProbes probes = makeProbes(config.calibration.device);
        config.calibration.synchronize = probes.synchronize;
        config.calibration.queuedTimer = probes.queuedTimer;
        gRecorder =
            std::make_shared<Recorder>(std::move(config), std::move(probes.timer), std::move(probes.memory));
        gAttached = false;
      },
      py::arg("directory"), py::arg("steps"), py::arg("warmup"), py::arg("device"), py::arg("device_name"),
      py::arg("versions"), py::arg("calibration_seconds"),
      "Arms the recorder; the next init() runs the runtime on a timed transport.");
  m.def(
      "record_attach",
      [] {
        auto rec = current("record_attach");
        {
          std::lock_guard<std::mutex> lock(gMutex);
          TORCH_CHECK(gAttached, "record_attach: the runtime was not started after record_begin()");
        }
        replayer::setObserver(rec);
      },
      Release(), "Makes the recorder the runtime's op observer (after init()).");
}

ModelInfo modelInfo(int64_t stage, int64_t forwardGraph, int64_t backwardGraph, const std::string& paramDtype,
                    const std::string& reduceDtype, const std::vector<py::tuple>& params, bool compiled) {
  ModelInfo info;
  info.compiled = compiled;
  info.stage = stage;
  info.forwardGraph = forwardGraph;
  info.backwardGraph = backwardGraph;
  info.paramDtype = paramDtype;
  info.reduceDtype = reduceDtype;
  for (const py::tuple& p : params) {
    TORCH_CHECK(p.size() == 7,
                "record_add_model: params entries should be (id, name, shape, dtype, numel, "
                "shard_numel, requires_grad), got ",
                p.size(), " fields");
    schemas::TraceParam tp;
    tp.id = p[0].cast<int64_t>();
    tp.name = p[1].cast<std::string>();
    tp.shape = p[2].cast<std::vector<int64_t>>();
    tp.dtype = p[3].cast<std::string>();
    tp.numel = p[4].cast<int64_t>();
    tp.shardNumel = p[5].cast<int64_t>();
    tp.requiresGrad = p[6].cast<bool>();
    info.params.push_back(std::move(tp));
  }
  return info;
}

/// measure_network: the collectives alone, over the runtime's transport (python -m dcplan.measure_network).
void bindNetwork(py::module_& m) {
  m.def(
      "measure_network",
      [](double seconds, const std::string& device, const std::string& deviceName,
         const std::string& output) {
        CalibrationOptions options;
        options.budgetSeconds = seconds;
        options.device = c10::Device(device);
        DeviceProbes probes = makeProbes(options.device);
        options.synchronize = probes.synchronize;
        options.queuedTimer = probes.queuedTimer;
        schemas::Network network;
        replayer::withTransport("measure_network", [&](replayer::Transport& transport) {
          network = measureNetwork(transport, options, deviceName);
        });
        const std::string text = schemas::writeNetwork(network);
        // A measurement dcplan plan --network would refuse must show here, naming the field.
        schemas::Network check;
        const auto problems = schemas::validateNetwork(schemas::parseJson(text, "measure_network"), check);
        TORCH_CHECK(problems.empty(),
                    "measure_network: the measurement is not a valid dcplan.network/v1 document: ",
                    problems.empty() ? "" : problems.front().str());
        if (!output.empty()) schemas::writeFileAtomically(output, text);
        return text;
      },
      py::arg("seconds"), py::arg("device"), py::arg("device_name"), py::arg("output") = "", Release(),
      "Times all-gather, reduce-scatter and all-reduce over the runtime's transport (collective: every rank "
      "calls it) and returns the dcplan.network/v1 document; writes it to output (atomically) where given.");
}

/// record_done, record_steps, record_finish and the rest of a recording's course.
void bindRecordingState(py::module_& m) {
  m.def(
      "record_done", [] { return current("record_done")->done(); },
      "Whether every step is recorded (known at the start_forward after the last one).");
  m.def(
      "record_steps", [] { return current("record_steps")->recordedSteps(); },
      "Optimizer steps recorded so far.");
  m.def(
      "record_finish",
      [] {
        auto rec = current("record_finish");
        const std::string path = rec->finish().string();
        if (replayer::isInitialized()) replayer::setObserver(nullptr);
        return path;
      },
      Release(),
      "Calibrates (collective), writes rank<R>.trace.json, stops observing; returns the file written.");
  m.def(
      "record_calibrate", [] { current("record_calibrate")->calibrateNow(); }, Release(),
      "Every step is recorded: calibrates now (collective), so that record_finish later runs none.");
  m.def(
      "record_stop_observing",
      [] {
        if (replayer::isInitialized()) replayer::setObserver(nullptr);
      },
      Release(),
      "Every step is recorded, the trace not yet written (a graphed step's capture is timed first): the "
      "runtime's ops are no longer observed, which a CUDA graph's capture requires.");
  m.def(
      "record_optimizer_step_issued",
      [] {
        // A hook left behind by a stopped recording does nothing.
        if (auto rec = armed()) rec->onOptimizerStepIssued();
      },
      "An optimizer's step() returned (torch's global optimizer post-hook while recording).");
  m.def(
      "record_memory_in_use", [] { return current("record_memory_in_use")->memoryInUse(); },
      "Bytes in use as the recorder's memory probe counts them (memory_bytes of an op issued now).");
  m.def(
      "record_active",
      [] {
        std::lock_guard<std::mutex> lock(gMutex);
        return gRecorder != nullptr;
      },
      "Whether a recorder is armed in this process.");
  m.def(
      "record_stop",
      [] {
        std::shared_ptr<Recorder> rec;
        {
          std::lock_guard<std::mutex> lock(gMutex);
          rec = std::move(gRecorder);
          gAttached = false;
        }
        if (rec && replayer::isInitialized()) replayer::setObserver(nullptr);
      },
      Release(), "Drops the recorder (what it recorded and did not write is lost).");
}

/// The replay log's memory measurement (python/dcplan/_plan.py, dcplan.check_replay).
void bindProbes(py::module_& m) {
  py::class_<MemoryProbe>(m, "MemoryProbe", "Memory in use on one device, as a trace counts it.")
      .def("peak", &MemoryProbe::takePeakBytes,
           "CPU: the most bytes of live tensors since the previous call; a GPU: the allocator's peak.")
      .def("in_use", &MemoryProbe::bytesInUse)
      .def("describe", &MemoryProbe::describe);
  m.def(
      "run_peak_probe", [](const std::string& device) { return makeRunPeakProbe(c10::Device(device)); },
      py::arg("device"),
      "A MemoryProbe for a run's peak on device ('cpu': counts CPU tensors allocated from now on, as "
      "recording does; 'cuda:N': the caching allocator's peak statistic, never reset).");
}

}  // namespace

std::shared_ptr<replayer::Transport> transportForRuntime(std::shared_ptr<replayer::Transport> transport) {
  std::lock_guard<std::mutex> lock(gMutex);
  if (!gRecorder || gAttached) return transport;
  gRecorder->attachTransport(transport);
  gAttached = true;
  return makeTimedTransport(std::move(transport), gRecorder);
}

void bindRecorder(py::module_& m) {
  bindArming(m);
  m.def(
      "record_add_model",
      [](int64_t stage, int64_t forwardGraph, int64_t backwardGraph, const std::string& paramDtype,
         const std::string& reduceDtype, const std::vector<py::tuple>& params, bool compiled) {
        current("record_add_model")
            ->addModel(
                modelInfo(stage, forwardGraph, backwardGraph, paramDtype, reduceDtype, params, compiled));
      },
      py::arg("stage"), py::arg("forward_graph"), py::arg("backward_graph"), py::arg("param_dtype"),
      py::arg("reduce_dtype"), py::arg("params"), py::arg("compiled") = false);
  m.def(
      "record_pause", [](bool paused) { current("record_pause")->setPaused(paused); }, py::arg("paused"),
      "Pauses (True) or resumes recording around a forward that is not a training micro-step.");
  m.def(
      "record_input_shapes",
      [](int64_t forwardGraph, const std::vector<std::vector<int64_t>>& shapes) {
        current("record_input_shapes")->setInputShapes(forwardGraph, shapes);
      },
      py::arg("forward_graph"), py::arg("shapes"),
      "In a recorded micro-step: the shapes of the tensor arguments of the model's forward (input_shapes).");
  m.def(
      "record_saved_activations",
      [](int64_t forwardGraph, const std::vector<py::tuple>& saved) {
        std::vector<schemas::SavedActivation> out;
        for (const py::tuple& t : saved) {
          TORCH_CHECK(t.size() == 5,
                      "record_saved_activations: expected (packs, bytes, seq, freed_at, used_at), got ",
                      t.size(), " fields");
          schemas::SavedActivation a;
          a.packs = t[0].cast<std::vector<int64_t>>();
          a.bytes = t[1].cast<uint64_t>();
          a.seq = t[2].cast<int64_t>();
          if (!t[3].is_none()) a.freedAt = t[3].cast<int64_t>();
          if (!t[4].is_none()) a.usedAt = t[4].cast<int64_t>();
          out.push_back(std::move(a));
        }
        current("record_saved_activations")->setSavedActivations(forwardGraph, std::move(out));
      },
      py::arg("forward_graph"), py::arg("saved"),
      "In a recorded micro-step, by its backward's end: what the forward saved for the backward, each "
      "(packs, bytes, seq, freed_at or None, used_at or None) (the trace graph's saved_activations).");
  m.def(
      "record_position", [](int64_t graphId) { return current("record_position")->position(graphId); },
      py::arg("graph_id"),
      "In a recorded micro-step: the ops of graph_id it has run so far (the next op's seq); -1 outside one.");
  m.def(
      "record_own_host_work", [](int64_t ns) { addOwnHostWorkNs(ns); }, py::arg("ns"),
      "The recorder's own host work outside the runtime's ops just took ns nanoseconds: left out of "
      "the trace's host times from now on (recorder::addOwnHostWorkNs).");
  m.def(
      "record_warmup_step", [] { return current("record_warmup_step")->warmupStep(); },
      "In a warm-up step: the optimizer steps before it; -1 otherwise.");
  m.def(
      "record_graphed", [] { current("record_graphed")->markGraphed(); },
      "The recorded script runs its step through dcplan.graphed_step: the trace says so (meta.graphed).");
  m.def(
      "record_graph_step_us", [](double us) { current("record_graph_step_us")->setGraphStepUs(us); },
      py::arg("us"),
      "After the recorded steps of a graphed step: the device time of one replay of it captured in a CUDA "
      "graph (the trace's calibration.graph_step_us).");
  m.def(
      "record_checks_collectives", [] { current("record_checks_collectives")->markChecksCollectives(); },
      "A replay of this job checks each collective with the ranks first (DCPLAN_CHECK_COLLECTIVES): the "
      "trace says so (meta.checks_collectives).");
  m.def(
      "record_optimizer_state",
      [](const std::map<int64_t, uint64_t>& bytesById, const std::map<int64_t, std::string>& implById,
         const std::map<int64_t, int64_t>& groupById) {
        current("record_optimizer_state")->setOptimizerState(bytesById, implById, groupById);
      },
      py::arg("bytes_by_id"), py::arg("impl_by_id") = std::map<int64_t, std::string>{},
      py::arg("group_by_id") = std::map<int64_t, int64_t>{},
      "After an optimizer step: the per-element optimizer state of each shard it stepped, bytes by ds_id, "
      "how the optimizer ran over each where known (for_loop, foreach or fused), and the number of each "
      "one's param group.");
  bindRecordingState(m);
  bindNetwork(m);
  bindProbes(m);
}

}  // namespace dcplan::extension
