// dcplan._C: runtime lifecycle, parameter and graph registration, the op log.
#include "Bindings.h"

#include "dcplan/replayer/LocalAllReduce.h"
#include "dcplan/replayer/Runtime.h"

#include <torch/csrc/Dtype.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace py = pybind11;
using namespace dcplan::replayer;

namespace dcplan::extension {
namespace {

using Release = py::call_guard<py::gil_scoped_release>;

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

void registerGraphOfStage(Stage stage, int64_t graphId, const std::vector<int64_t>& dsIds,
                          const py::object& reduceDtype) {
  auto dtype = optionalDtype(reduceDtype, "register_graph: reduce_dtype");
  py::gil_scoped_release noGil;
  registerGraph(graphId, stage, dsIds, dtype);
}

RuntimeConfig runtimeConfig(int64_t reduceBucketBytes, bool doubleBuffer,
                            int64_t freeActivationThresholdBytes, bool checkCollectives) {
  RuntimeConfig config;
  config.checkCollectives = checkCollectives;
  config.reduceBucketBytes = reduceBucketBytes;
  config.doubleBuffer = doubleBuffer;
  config.freeActivationThresholdBytes = freeActivationThresholdBytes;
  return config;
}

void bindLifecycle(py::module_& m) {
  m.def(
      "init",
      [](const std::string& groupName, int64_t reduceBucketBytes, bool doubleBuffer,
         int64_t freeActivationThresholdBytes, bool shm, const std::string& shmDir, double shmTimeoutS,
         bool checkCollectives) {
        const RuntimeConfig config =
            runtimeConfig(reduceBucketBytes, doubleBuffer, freeActivationThresholdBytes, checkCollectives);
        LocalAllReduceSettings local;
        local.enabled = shm;
        local.dir = shmDir;
        local.timeout = std::chrono::milliseconds(static_cast<int64_t>(shmTimeoutS * 1000.0));
        std::shared_ptr<Transport> transport = makeProcessGroupTransport(groupName);
        init(transportForRuntime(transport), config);
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
        const RuntimeConfig config =
            runtimeConfig(reduceBucketBytes, doubleBuffer, freeActivationThresholdBytes, checkCollectives);
        std::string id = uniqueId;
        py::gil_scoped_release noGil;
        const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000.0));
        init(transportForRuntime(makeNcclTransport(id, rank, worldSize, deviceIndex, timeout)), config);
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
}

void bindRegistration(py::module_& m) {
  auto regParam = [](int64_t dsId, const std::vector<int64_t>& shape, const at::Tensor& dsTensor,
                     const std::optional<at::Tensor>& gradBuffer, bool persistent, bool trainable,
                     const std::string& name) {
    registerParam(dsId, shape, dsTensor, gradBuffer.value_or(at::Tensor()), persistent, trainable, name);
  };
  m.def("register_param", regParam, py::arg("ds_id"), py::arg("ds_shape"), py::arg("ds_tensor"),
        py::arg("grad_buffer"), py::arg("persistent") = false, py::arg("trainable") = false,
        py::arg("name") = "", Release(),
        "Registers a parameter: its full shape, this rank's flat shard of ceil(numel/world_size) elements "
        "and the gradient buffer of the same size (None for a frozen parameter, or with trainable=True for "
        "gradients given and taken each backward: set_grads, take_grads). name: its qualified name, which "
        "error messages give beside the ds_id.");
  m.def("register_z3_param", regParam, py::arg("ds_id"), py::arg("ds_shape"), py::arg("ds_tensor"),
        py::arg("grad_buffer"), py::arg("persistent") = false, py::arg("trainable") = false,
        py::arg("name") = "", Release(), "Same as register_param.");
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
  m.def("start_forward", &startForward, py::arg("training") = true, Release());
  m.def("end_forward", &endForward, Release());
  m.def("start_backward", &startBackward, py::arg("update") = true, py::arg("sync") = true, Release(),
        "update: gradients start from zero; sync: this micro-step ends gradient accumulation.");
  m.def("enable_profiling", &enableProfiling, py::arg("enable"), Release());
  m.def("is_profiling", &isProfiling);
  m.def("reset", &reset, Release(), "Drops the graph executors (parameters stay registered).");
  m.def("invalidate_gathered_param", &invalidateGatheredParam, py::arg("ds_id"), Release());
  m.def("clear_all_gathered_params", &clearAllGatheredParams, Release());
  m.def("set_masters_on_host", &setMastersOnHost, py::arg("ds_ids"), Release(),
        "A plan's master offload: these shards live on the host from now on, back for each gather.");
  m.def("reload_masters", &reloadMasters, py::arg("ds_ids"), Release(),
        "Brings host-kept master shards back to the device (their update, a state dict).");
  m.def("offload_masters", &offloadMasters, py::arg("ds_ids"), Release(),
        "Copies host-kept master shards out again and frees them on the device.");
  m.def("master_host", &masterHost, py::arg("ds_id"), Release(),
        "The host copy of a master shard a plan keeps there (between steps; state dicts use it in place).");
  m.def("gathered_param_ids", &gatheredParamIds, Release(),
        "Ids holding a gathered copy (valid or in flight), ascending.");
  m.def("begin_capture", &beginCapture, Release(),
        "CUDA graph capture of a step (dcplan.graphed_step): the transport's streams join the capture.");
  m.def("end_capture", &endCapture, Release(),
        "Before the capture ends: the capture rejoins the transport's streams.");
  m.def("release_capture", &releaseCapture, Release(),
        "The captured graph no longer replays the steps: eager steps may run again.");
}

void bindOpLog(py::module_& m) {
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
}

}  // namespace

std::optional<at::ScalarType> optionalDtype(const py::object& obj, const char* what) {
  if (obj.is_none()) return std::nullopt;
  TORCH_CHECK(THPDtype_Check(obj.ptr()), what, " should be a torch.dtype or None, got ",
              std::string(py::str(py::type::of(obj))));
  return reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type;
}

void bindRuntime(py::module_& m) {
  bindLifecycle(m);
  bindRegistration(m);
  bindOpLog(m);
}

}  // namespace dcplan::extension
