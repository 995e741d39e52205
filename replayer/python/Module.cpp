// dcplan._C: the Python binding of the dc runtime (lifecycle and registration; the ops are torch.ops.dc.*).
#include "ShardHooks.h"
#include "dcplan/recorder/Probes.h"
#include "dcplan/recorder/PythonBindings.h"
#include "dcplan/replayer/LocalAllReduce.h"
#include "dcplan/replayer/Plan.h"
#include "dcplan/replayer/Runtime.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

namespace py = pybind11;
using namespace dcplan::replayer;

namespace {

/// Keeps every op event in memory, for tests and quick inspection; the
/// recorder proper is a separate observer.
class OpLog final : public OpObserver {
 public:
  void onOpBegin(const OpEvent& event) override {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(event);
  }
  std::vector<OpEvent> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(events_, {});
  }

 private:
  std::mutex mutex_;
  std::vector<OpEvent> events_;
};

std::shared_ptr<OpLog> gOpLog;

std::optional<at::ScalarType> optionalDtype(const py::object& obj, const char* what) {
  if (obj.is_none()) return std::nullopt;
  TORCH_CHECK(THPDtype_Check(obj.ptr()), what, " should be a torch.dtype or None, got ",
              std::string(py::str(py::type::of(obj))));
  return reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type;
}

void registerGraphOfStage(Stage stage, int64_t graphId, const std::vector<int64_t>& dsIds,
                          const py::object& reduceDtype) {
  auto dtype = optionalDtype(reduceDtype, "register_graph: reduce_dtype");
  py::gil_scoped_release noGil;
  registerGraph(graphId, stage, dsIds, dtype);
}

/// Plan replay: loading a plan against the live model, the replay log.
void bindPlan(py::module& m) {
  // params: (ds_id, name, shape, dtype name, trainable) per parameter.
  using ParamTuple = std::tuple<int64_t, std::string, std::vector<int64_t>, std::string, bool>;
  auto liveModel = [](const std::vector<ParamTuple>& params, int64_t worldSize) {
    LiveModel model;
    for (const auto& [id, name, shape, dtype, trainable] : params) {
      model.params.push_back(LiveParam{id, name, shape, dtype, trainable});
    }
    model.worldSize = worldSize;
    return model;
  };
  m.def(
      "param_signature",
      [liveModel](const std::vector<ParamTuple>& params, int64_t worldSize) {
        return liveSignature(liveModel(params, worldSize));
      },
      py::arg("params"), py::arg("world_size"),
      "The parameter signature (docs/formats.md) of (ds_id, name, shape, dtype, trainable) tuples.");
  m.def(
      "load_plan",
      [liveModel](const std::string& path, const std::vector<ParamTuple>& params, int64_t worldSize,
                  int64_t stage, int64_t forwardGraph, int64_t backwardGraph, const std::string& reduceDtype,
                  const py::object& gatherDtype, const std::string& onMismatch, bool compiled) {
        LiveModel model = liveModel(params, worldSize);
        model.stage = stage;
        model.forwardGraph = forwardGraph;
        model.backwardGraph = backwardGraph;
        model.reduceDtype = reduceDtype;
        model.gatherDtype = optionalDtype(gatherDtype, "load_plan: gather_dtype");
        model.compiled = compiled;
        TORCH_CHECK(onMismatch == "error" || onMismatch == "fallback",
                    "load_plan: on_mismatch should be \"error\" or \"fallback\", got \"", onMismatch, "\"");
        PlanSummary summary;
        try {
          py::gil_scoped_release noGil;
          summary = loadPlan(path, model, onMismatch == "error" ? OnMismatch::Error : OnMismatch::Fallback);
        } catch (const PlanError& e) {
          throw py::value_error(e.what());
        }
        py::dict out;
        out["signature"] = summary.signature;
        out["persistent"] = summary.persistent;
        out["prefetch_groups"] = summary.prefetchGroups;
        out["buckets"] = summary.buckets;
        return out;
      },
      py::arg("path"), py::arg("params"), py::arg("world_size"), py::arg("stage"), py::arg("forward_graph"),
      py::arg("backward_graph"), py::arg("reduce_dtype"), py::arg("gather_dtype") = py::none(),
      py::arg("on_mismatch") = "error", py::arg("compiled") = false,
      "Reads plan file path, checks it against the live model (ValueError naming the file, the JSON "
      "pointer and what differs) and makes it the runtime's schedule.");
  m.def(
      "set_replay_log",
      [](const std::string& path, const std::optional<std::string>& device) {
        MemoryGauge gauge;
        if (device) {
          // DCPLAN_REPLAY_LOG_PEAKS=1 on a GPU: per-op peaks too, from the allocator's peak
          // statistic, reset at every op (torch.cuda.max_memory_allocated() then covers one op).
          const char* peaks = std::getenv("DCPLAN_REPLAY_LOG_PEAKS");
          const bool devicePeaks =
              !c10::Device(*device).is_cpu() && peaks != nullptr && std::string(peaks) == "1";
          std::shared_ptr<dcplan::recorder::MemoryProbe> probe =
              devicePeaks ? dcplan::recorder::makeDeviceAllocatorProbe(c10::Device(*device))
                          : dcplan::recorder::makeReplayOpProbe(c10::Device(*device));
          const bool windowPeak = c10::Device(*device).is_cpu() || devicePeaks;
          gauge = [probe, windowPeak] {
            OpMemory m;
            m.inUse = static_cast<int64_t>(probe->bytesInUse());
            if (windowPeak) m.peakBefore = static_cast<int64_t>(probe->takePeakBytes());
            return m;
          };
        }
        setReplayLog(path, std::move(gauge));
      },
      py::arg("path"), py::arg("device") = std::nullopt, py::call_guard<py::gil_scoped_release>(),
      "Writes this rank's replay log (JSON lines) to path from now on; '' stops. With device "
      "('cpu', 'cuda:N'), each op line carries the memory in use there (and on the CPU the peak "
      "since the op before).");
  m.def("flush_replay_log", &flushReplayLog, py::call_guard<py::gil_scoped_release>());
  m.def("log_replay_event", &logReplayEvent, py::arg("json"), py::call_guard<py::gil_scoped_release>(),
        "Appends one JSON object (one line) to this rank's replay log, if one is open.");
  m.def("plan_active", &planActive, "Whether a loaded plan drives the schedule (no departure so far).");
  m.def(
      "take_plan_departure",
      [] {
        std::string msg = takePlanDeparture();
        return msg.empty() ? py::object(py::none()) : py::object(py::str(msg));
      },
      "The message of a departure from the plan under on_mismatch='fallback', once; None otherwise.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dcplan runtime: lifecycle and registration of the dc op set (torch.ops.dc.*)";
  using Release = py::call_guard<py::gil_scoped_release>;

  m.def(
      "init",
      [](const std::string& groupName, int64_t reduceBucketBytes, bool doubleBuffer,
         int64_t freeActivationThresholdBytes, bool shm, const std::string& shmDir, double shmTimeoutS,
         bool checkCollectives) {
        RuntimeConfig config;
        config.checkCollectives = checkCollectives;
        config.reduceBucketBytes = reduceBucketBytes;
        config.doubleBuffer = doubleBuffer;
        config.freeActivationThresholdBytes = freeActivationThresholdBytes;
        LocalAllReduceSettings local;
        local.enabled = shm;
        local.dir = shmDir;
        local.timeout = std::chrono::milliseconds(static_cast<int64_t>(shmTimeoutS * 1000.0));
        std::shared_ptr<Transport> transport = makeProcessGroupTransport(groupName);
        init(dcplan::recorder::transportForRuntime(transport), config);
        try {
          // On the process group itself, not the recorder's view of it: the rendezvous is not the job's.
          return startLocalAllReduce(*transport, local);
        } catch (...) {
          cleanup();
          throw;
        }
      },
      py::arg("group_name"), py::arg("reduce_bucket_bytes") = RuntimeConfig{}.reduceBucketBytes,
      py::arg("double_buffer") = true,
      py::arg("free_activation_threshold_bytes") = RuntimeConfig{}.freeActivationThresholdBytes,
      py::arg("shm") = true, py::arg("shm_dir") = LocalAllReduceSettings{}.dir,
      py::arg("shm_timeout_s") = std::chrono::duration<double>(LocalAllReduceSettings{}.timeout).count(),
      py::arg("check_collectives") = false, Release(),
      "Starts the runtime on the torch.distributed group registered as group_name (group.group_name). "
      "Sizes in bytes. shm: the inference all-reduce goes through shared memory in shm_dir when every rank "
      "is "
      "on this machine (collective). Returns why it does not ('' when it does, or shm is False). "
      "check_collectives: the ranks agree on each collective before launching it.");
  m.def(
      "all_gather_flat", [](const at::Tensor& flat) { return allGatherFlat("all_gather_flat", flat); },
      py::arg("flat"), Release(),
      "Every rank's flat tensor, concatenated in rank order (collective over the runtime's transport).");
  m.def("local_all_reduce_path", &localAllReducePath,
        "The shared-memory segment the inference all-reduce uses ('' when it uses the process group).");
  m.def(
      "init_nccl",
      [](const py::bytes& uniqueId, int rank, int worldSize, int deviceIndex, int64_t reduceBucketBytes,
         bool doubleBuffer, int64_t freeActivationThresholdBytes, bool checkCollectives, double timeoutS) {
        RuntimeConfig config;
        config.checkCollectives = checkCollectives;
        config.reduceBucketBytes = reduceBucketBytes;
        config.doubleBuffer = doubleBuffer;
        config.freeActivationThresholdBytes = freeActivationThresholdBytes;
        std::string id = uniqueId;
        py::gil_scoped_release noGil;
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000.0));
        init(dcplan::recorder::transportForRuntime(
                 makeNcclTransport(id, rank, worldSize, deviceIndex, timeout)),
             config);
      },
      py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("device_index"),
      py::arg("reduce_bucket_bytes") = RuntimeConfig{}.reduceBucketBytes, py::arg("double_buffer") = true,
      py::arg("free_activation_threshold_bytes") = RuntimeConfig{}.freeActivationThresholdBytes,
      py::arg("check_collectives") = false, py::arg("timeout_s") = 600.0,
      "Starts the runtime on its own NCCL communicator on cuda:device_index (collective over the "
      "world_size ranks; unique_id from nccl_unique_id() on one rank). Sizes in bytes. A collective "
      "not done after timeout_s aborts the communicator.");
  m.def(
      "nccl_unique_id", [] { return py::bytes(makeNcclUniqueId()); },
      "A fresh NCCL unique id (bytes) for init_nccl.");
  m.def("has_nccl", &hasNcclTransport, "Whether this build has the CUDA kernels and the NCCL transport.");
  m.def("cleanup", &cleanup, Release(), "Waits for pending collectives and drops all runtime state.");
  m.def("is_initialized", &isInitialized);
  m.def("world_size", &worldSize);
  m.def("rank", &rank);

  auto regParam = [](int64_t dsId, const std::vector<int64_t>& shape, const at::Tensor& dsTensor,
                     const std::optional<at::Tensor>& gradBuffer, bool persistent, bool trainable) {
    registerParam(dsId, shape, dsTensor, gradBuffer.value_or(at::Tensor()), persistent, trainable);
  };
  m.def("register_param", regParam, py::arg("ds_id"), py::arg("ds_shape"), py::arg("ds_tensor"),
        py::arg("grad_buffer"), py::arg("persistent") = false, py::arg("trainable") = false, Release(),
        "Registers a parameter: its full shape, this rank's flat shard of ceil(numel/world_size) elements "
        "and the gradient buffer of the same size (None for a frozen parameter, or with trainable=True for "
        "gradients given and taken each backward: set_grads, take_grads).");
  m.def("register_z3_param", regParam, py::arg("ds_id"), py::arg("ds_shape"), py::arg("ds_tensor"),
        py::arg("grad_buffer"), py::arg("persistent") = false, py::arg("trainable") = false, Release(),
        "Same as register_param.");
  m.def(
      "set_grads",
      [](const std::vector<int64_t>& ids, const std::vector<std::optional<at::Tensor>>& grads) {
        std::vector<at::Tensor> gs;
        gs.reserve(grads.size());
        for (const auto& g : grads) gs.push_back(g.value_or(at::Tensor()));
        setGrads(ids, gs);
      },
      py::arg("ds_ids"), py::arg("grads"), Release(),
      "Before a backward: the gradients (None: none yet) its reductions add to, for parameters "
      "registered with trainable=True and no grad_buffer.");
  m.def(
      "take_grads",
      [](const std::vector<int64_t>& ids) {
        std::vector<std::optional<at::Tensor>> out;
        for (at::Tensor& g : takeGrads(ids))
          out.push_back(g.defined() ? std::optional<at::Tensor>(g) : std::nullopt);
        return out;
      },
      py::arg("ds_ids"), Release(),
      "After end_backward: those parameters' gradients (None: none); the runtime forgets them.");
  m.def(
      "register_graph_z1",
      [](int64_t g, const std::vector<int64_t>& ids, const py::object& rd) {
        registerGraphOfStage(Stage::Zero1, g, ids, rd);
      },
      py::arg("graph_id"), py::arg("ds_ids"), py::arg("reduce_dtype") = py::none());
  m.def(
      "register_graph_z2",
      [](int64_t g, const std::vector<int64_t>& ids, const py::object& rd) {
        registerGraphOfStage(Stage::Zero2, g, ids, rd);
      },
      py::arg("graph_id"), py::arg("ds_ids"), py::arg("reduce_dtype") = py::none());
  m.def(
      "register_graph_z3",
      [](int64_t g, const std::vector<int64_t>& ids, const py::object& rd) {
        registerGraphOfStage(Stage::Zero3, g, ids, rd);
      },
      py::arg("graph_id"), py::arg("ds_ids"), py::arg("reduce_dtype") = py::none());
  m.def("set_persistent", &setPersistent, py::arg("ds_id"), py::arg("persistent") = true, Release());
  m.def("start_forward", &startForward, Release());
  m.def("end_forward", &endForward, Release());
  m.def("start_backward", &startBackward, py::arg("update") = true, py::arg("sync") = true, Release(),
        "update: gradients start from zero; sync: this micro-step ends gradient accumulation.");
  m.def("enable_profiling", &enableProfiling, py::arg("enable"), Release());
  m.def("is_profiling", &isProfiling);
  m.def("reset", &reset, Release(), "Drops the graph executors (parameters stay registered).");
  m.def("invalidate_gathered_param", &invalidateGatheredParam, py::arg("ds_id"), Release());
  m.def("clear_all_gathered_params", &clearAllGatheredParams, Release());
  m.def("gathered_param_ids", &gatheredParamIds, Release(),
        "Ids holding a gathered copy (valid or in flight), ascending.");
  m.def("begin_capture", &beginCapture, Release(),
        "CUDA graph capture of a step (dcplan.graphed_step): the transport's streams join the capture.");
  m.def("end_capture", &endCapture, Release(),
        "Before the capture ends: the capture rejoins the transport's streams.");
  m.def("release_capture", &releaseCapture, Release(),
        "The captured graph no longer replays the steps: eager steps may run again.");
  m.def(
      "start_op_log",
      [] {
        auto log = std::make_shared<OpLog>();
        setObserver(log);
        gOpLog = log;
      },
      Release(), "Records every dc op (op, graph_id, ds_id, bytes, dtype) until stop_op_log().");
  m.def(
      "take_op_log",
      [] {
        py::list out;
        if (!gOpLog) return out;
        for (const OpEvent& e : gOpLog->take()) {
          out.append(py::make_tuple(
              std::string(e.op), e.graphId, e.dsId, e.bytes,
              e.dtype == at::ScalarType::Undefined ? std::string() : std::string(c10::toString(e.dtype))));
        }
        return out;
      },
      "The ops recorded since the last call, as (op, graph_id, ds_id, bytes, dtype) tuples.");
  m.def(
      "stop_op_log",
      [] {
        if (isInitialized()) setObserver(nullptr);
        gOpLog.reset();
      },
      Release());
  bindPlan(m);
  bindShardHooks(m);                  // the per-parameter work of python/dcplan/_shard.py's hooks
  dcplan::recorder::bindRecorder(m);  // record_*: python/dcplan/_record.py
}
