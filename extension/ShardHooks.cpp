// dcplan._C.ShardHooks: what dcplan.shard()'s hooks do per parameter, in C++.
//
// A training step issues about eight dc ops per parameter (gather and wait in forward and
// again in backward, two releases, a reduction). From Python each costs an op lookup, boxing
// and an autograd.Function; on the communication-heavy GPU shape that host time was the
// step time. Here a module hook is one call: the ops go through the dispatcher from C++ (the
// op set, its observer and the plan cursor see exactly what the Python hooks issued), and the
// gathered parameter's gradient reaches reduce_grad through a C++ autograd node, so backward
// needs the GIL once per step (to begin the backward in Python), not once per gradient.
#include "Bindings.h"

#include "dcplan/replayer/Runtime.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace dcplan::replayer {
namespace {

/// The dc ops, called through the dispatcher with the kernels' own signatures.
struct DcOps {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t, std::optional<at::ScalarType>)>
      allgather;
  c10::OperatorHandle prefetchFused;  // boxed: the dispatcher finds no dispatch key in a std::vector
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t)> wait;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)> release;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t)> reduce;

  static const DcOps& get() {
    static const DcOps ops = [] {
      auto& d = c10::Dispatcher::singleton();
      return DcOps{
          d.findSchemaOrThrow("dc::allgather_param", "")
              .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, std::optional<at::ScalarType>)>(),
          d.findSchemaOrThrow("dc::prefetch_params_fused", ""),
          d.findSchemaOrThrow("dc::wait_allgather", "")
              .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>(),
          d.findSchemaOrThrow("dc::release_param", "")
              .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)>(),
          d.findSchemaOrThrow("dc::reduce_grad", "").typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>(),
      };
    }();
    return ops;
  }
};

class ShardHooks : public std::enable_shared_from_this<ShardHooks> {
 public:
  ShardHooks(int64_t stage, int64_t forwardGraph, int64_t backwardGraph,
             std::optional<at::ScalarType> paramDtype, py::function beginBackward)
      : stage_(stage),
        forwardGraph_(forwardGraph),
        backwardGraph_(backwardGraph),
        paramDtype_(paramDtype),
        beginBackward_(std::move(beginBackward)) {}

  ~ShardHooks() {
    py::gil_scoped_acquire gil;  // the last reference may go on an autograd thread
    beginBackward_ = py::function();
  }

  /// shard: the parameter the optimizer sees (trainable while it requires grad).
  void addParam(int64_t dsId, const at::Tensor& shard) {
    TORCH_CHECK(params_.count(dsId) == 0, "ShardHooks.add_param: ds_id ", dsId, " is already added");
    params_.emplace(dsId, Param{dsId, shard, shard.detach()});
  }

  void setKeep(const std::vector<int64_t>& dsIds) {
    for (auto& [id, p] : params_) p.keep = false;
    for (int64_t id : dsIds) param("set_keep", id).keep = true;
  }

  bool requiresSync = true;
  bool inBackward = false;

  /// Forward pre-hook of a module: its parameters gathered (several: one fused prefetch first).
  /// recompute: the forward runs again inside backward (activation checkpointing): its gathers
  /// are the backward graph's, as the saved-tensor re-gathers are, and checkpointing keeps what
  /// it saves, so nothing is tracked for packing. (The recomputed parameters still require
  /// grad: autograd must save the same tensors as the first time. Gradients flow through the
  /// first forward's nodes; the recomputed reduction nodes never run.)
  std::vector<at::Tensor> forwardGather(const std::vector<int64_t>& dsIds, bool recompute) {
    if (recompute) beginBackwardOnce();
    const int64_t graph = recompute ? backwardGraph_ : forwardGraph_;
    const bool grad = at::GradMode::is_enabled();
    std::vector<Param*> ps;
    ps.reserve(dsIds.size());
    for (int64_t id : dsIds) ps.push_back(&param("forward_gather", id));
    for (Param* p : ps) refresh(*p);
    if (ps.size() > 1) {
      // Issued whatever is held (the runtime skips held copies): the op sequence, which plan
      // positions count, must not depend on the schedule.
      std::vector<at::Tensor> shards;
      c10::List<at::ScalarType> dtypes;
      for (Param* p : ps) {
        shards.push_back(p->data);
        dtypes.push_back(paramDtype_.value_or(at::kFloat));
      }
      torch::jit::Stack stack{c10::IValue(graph), c10::IValue(shards), c10::IValue(dsIds),
                              c10::IValue(dtypes)};
      at::AutoDispatchBelowADInplaceOrView below;
      DcOps::get().prefetchFused.callBoxed(&stack);
    }
    const bool track = stage_ == 3 && grad && !recompute;
    std::vector<at::Tensor> out;
    out.reserve(ps.size());
    try {
      for (size_t i = 0; i < ps.size(); ++i) {
        Param& p = *ps[i];
        at::Tensor full = gather(p, graph);
        if (grad && p.shard.requires_grad()) full = withReduction(full, p);
        if (track) {
          p.livePtr = storagePtr(full);
          if (p.livePtr != nullptr) live_[p.livePtr] = &p;
        }
        out.push_back(std::move(full));
      }
    } catch (...) {
      // The module gets none of them, and its forward hook releases only what it got: release
      // what was gathered before the failure here, and report the failure itself.
      for (size_t j = 0; j < out.size(); ++j) {
        forgetLive(*ps[j]);
        try {
          releaseOp(*ps[j], graph);
        } catch (...) {  // the first failure is the one to report
        }
      }
      throw;
    }
    return out;
  }

  /// Forward hook of a module: its parameters released (recompute: as forwardGather's).
  void forwardRelease(const std::vector<int64_t>& dsIds, bool recompute) {
    for (int64_t id : dsIds) {
      Param& p = param("forward_release", id);
      if (!recompute) forgetLive(p);
      releaseOp(p, recompute ? backwardGraph_ : forwardGraph_);
    }
  }

  /// Drops the gathered copies of these parameters (all: empty) whose shard changed since
  /// they were gathered (an optimizer step).
  void refreshAll(const std::vector<int64_t>& dsIds) {
    if (dsIds.empty()) {
      for (auto& [id, p] : params_) refresh(p);
    }
    for (int64_t id : dsIds) refresh(param("refresh", id));
  }

  /// Saved-tensor pack hook: the id of the gathered parameter t aliases (one more unpack to
  /// come), or -1.
  int64_t pack(const at::Tensor& t) {
    if (live_.empty() || t.layout() != at::kStrided) return -1;
    const void* ptr = storagePtr(t);
    auto it = ptr == nullptr ? live_.end() : live_.find(ptr);
    if (it == live_.end()) return -1;
    ++it->second->pendingUnpacks;
    return it->second->id;
  }

  /// Saved-tensor unpack hook: the parameter gathered again (ZeRO-3) and viewed as it was saved;
  /// the last pending unpack releases it, and before an optimizer step also ends a persistent
  /// copy (the step makes it stale; its memory then holds this parameter's gradient instead).
  at::Tensor unpack(int64_t dsId, const std::vector<int64_t>& size, const std::vector<int64_t>& stride,
                    int64_t offset) {
    Param& p = param("unpack", dsId);
    beginBackwardOnce();
    at::Tensor out = gather(p, backwardGraph_).as_strided(size, stride, offset);
    if (--p.pendingUnpacks <= 0) {
      p.pendingUnpacks = 0;
      releaseOp(p, backwardGraph_);
      if (requiresSync && p.shard.requires_grad() && p.keep) invalidateGatheredParam(dsId);
    }
    return out;
  }

  /// After end_backward (ZeRO-3): drops copies gathered for saved tensors backward never
  /// unpacked, and, before an optimizer step, the persistent copies of trainable parameters
  /// (the step makes them stale; without them its peak memory is that of the shards alone).
  void afterBackward() {
    std::vector<int64_t> held = gatheredParamIds();
    for (int64_t id : held) {
      auto it = params_.find(id);
      if (it == params_.end()) continue;  // another model's
      const Param& p = it->second;
      if ((requiresSync && p.shard.requires_grad()) || !p.keep) invalidateGatheredParam(id);
    }
    for (auto& [id, p] : params_) {
      p.pendingUnpacks = 0;
      p.livePtr = nullptr;
    }
    live_.clear();
  }

  /// The gradient of a gathered parameter, from its autograd node.
  void reduce(int64_t dsId, const at::Tensor& grad) {
    beginBackwardOnce();
    at::AutoDispatchBelowADInplaceOrView below;
    DcOps::get().reduce.call(grad.contiguous(), backwardGraph_, dsId);
  }

 private:
  struct Param {
    int64_t id;
    at::Tensor shard;  // the optimizer's parameter
    at::Tensor data;   // its detached alias, what the ops take
    int64_t version = -1;
    int pendingUnpacks = 0;
    const void* livePtr = nullptr;
    bool keep = false;  // persistent by the plan
  };

  Param& param(const char* what, int64_t dsId) {
    auto it = params_.find(dsId);
    TORCH_CHECK(it != params_.end(), "ShardHooks.", what, ": ds_id ", dsId,
                " is not a parameter of this model");
    return it->second;
  }

  static const void* storagePtr(const at::Tensor& t) {
    try {
      return t.has_storage() ? t.storage().data() : nullptr;
    } catch (const c10::Error&) {
      return nullptr;  // a wrapper tensor without a storage of its own
    }
  }

  void refresh(Param& p) {
    const int64_t v = static_cast<int64_t>(p.shard._version());
    if (v != p.version) {
      invalidateGatheredParam(p.id);
      p.version = v;
    }
  }

  /// p's gathered copy is no longer one a saved tensor may alias.
  void forgetLive(Param& p) {
    if (p.livePtr != nullptr) live_.erase(p.livePtr);
    p.livePtr = nullptr;
  }

  at::Tensor gather(Param& p, int64_t graphId) {
    at::AutoDispatchBelowADInplaceOrView below;
    const DcOps& ops = DcOps::get();
    at::Tensor full = ops.allgather.call(p.data, graphId, p.id, paramDtype_);
    return ops.wait.call(full, graphId, p.id);
  }

  void releaseOp(Param& p, int64_t graphId) {
    at::AutoDispatchBelowADInplaceOrView below;
    DcOps::get().release.call(p.data, graphId, p.id, 1);
  }

  at::Tensor withReduction(const at::Tensor& full, Param& p);

  void beginBackwardOnce() {
    if (inBackward) return;
    inBackward = true;
    py::gil_scoped_acquire gil;
    try {
      beginBackward_();  // set_grads, start_backward, the end-of-backward callback
    } catch (...) {
      inBackward = false;  // not begun: the next backward tries again
      throw;
    }
  }

  int64_t stage_;
  int64_t forwardGraph_;
  int64_t backwardGraph_;
  std::optional<at::ScalarType> paramDtype_;
  py::function beginBackward_;
  std::unordered_map<int64_t, Param> params_;
  // Storage of a gathered parameter (ZeRO-3) -> the parameter (unordered_map nodes stay put).
  std::unordered_map<const void*, Param*> live_;
};

/// The gathered parameter's gradient goes to reduce_grad; the shard gets none through
/// autograd (end_backward hands the reduced shard gradient over).
class ReduceGradNode final : public torch::autograd::Node {
 public:
  ReduceGradNode(std::weak_ptr<ShardHooks> hooks, int64_t dsId) : hooks_(std::move(hooks)), dsId_(dsId) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::shared_ptr<ShardHooks> hooks = hooks_.lock();
    TORCH_CHECK(hooks, "dcplan: backward reached parameter ds_id ", dsId_,
                " of a sharded model that has been deleted (its autograd graph outlived it)");
    // An output that got no gradient still reduces (zeros): every rank issues the same ops.
    at::Tensor grad = grads[0].defined() ? grads[0] : input_metadata(0).zeros_like();
    hooks->reduce(dsId_, grad);
    return {at::Tensor()};
  }

  std::string name() const override { return "dcplan::ReduceGradBackward"; }

 private:
  std::weak_ptr<ShardHooks> hooks_;
  int64_t dsId_;
};

// torch holds autograd nodes in a std::shared_ptr up to 2.12 and in a c10::intrusive_ptr since.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename Ptr>
struct NodeMaker;
template <>
struct NodeMaker<std::shared_ptr<torch::autograd::Node>> {
  template <typename N, typename... Args>
  static NodePtr make(Args&&... args) {
    return std::make_shared<N>(std::forward<Args>(args)...);
  }
};
template <>
struct NodeMaker<c10::intrusive_ptr<torch::autograd::Node>> {
  template <typename N, typename... Args>
  static NodePtr make(Args&&... args) {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  }
};

at::Tensor ShardHooks::withReduction(const at::Tensor& full, Param& p) {
  // An alias of the runtime's buffer (it frees the buffer at release_param), with the node
  // as its history: the node's edge to the shard makes autograd.grad(shard) reach it.
  at::Tensor out = full.detach();
  NodePtr node = NodeMaker<NodePtr>::make<ReduceGradNode>(weak_from_this(), p.id);
  node->set_next_edges(torch::autograd::collect_next_edges(p.shard));
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace
}  // namespace dcplan::replayer

namespace dcplan::extension {

void bindShardHooks(py::module_& m) {
  using replayer::ShardHooks;
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<ShardHooks, std::shared_ptr<ShardHooks>>(
      m, "ShardHooks",
      "The per-parameter work of dcplan.shard()'s hooks for one model: the dc ops in natural order "
      "(through the dispatcher), the gathered parameters' autograd nodes, the saved-tensor bookkeeping.")
      .def(py::init([](int64_t stage, int64_t forwardGraph, int64_t backwardGraph,
                       const py::object& paramDtype, py::function beginBackward) {
             return std::make_shared<ShardHooks>(stage, forwardGraph, backwardGraph,
                                                 optionalDtype(paramDtype, "ShardHooks: param_dtype"),
                                                 std::move(beginBackward));
           }),
           py::arg("stage"), py::arg("forward_graph"), py::arg("backward_graph"), py::arg("param_dtype"),
           py::arg("begin_backward"),
           "begin_backward: called (with no arguments) before the first op of each backward.")
      .def("add_param", &ShardHooks::addParam, py::arg("ds_id"), py::arg("shard"))
      .def("set_keep", &ShardHooks::setKeep, py::arg("ds_ids"), "The plan's persistent parameters.")
      .def_readwrite("requires_sync", &ShardHooks::requiresSync)
      .def_readwrite("in_backward", &ShardHooks::inBackward)
      .def("forward_gather", &ShardHooks::forwardGather, py::arg("ds_ids"), py::arg("recompute") = false,
           Release(),
           "A module's forward pre-hook: its parameters, gathered (in the gather dtype); recompute: the "
           "forward runs again in backward (activation checkpointing), on the backward graph.")
      .def("forward_release", &ShardHooks::forwardRelease, py::arg("ds_ids"), py::arg("recompute") = false,
           Release(), "A module's forward hook: releases its parameters.")
      .def("refresh", &ShardHooks::refreshAll, py::arg("ds_ids") = std::vector<int64_t>{}, Release(),
           "Drops gathered copies whose shard changed since their gather (empty: every parameter).")
      // A lookup, for every tensor autograd saves: not worth releasing the GIL for.
      .def("pack", &ShardHooks::pack, py::arg("tensor"),
           "Saved-tensor pack: the ds_id of the gathered parameter tensor aliases, or -1.")
      .def("unpack", &ShardHooks::unpack, py::arg("ds_id"), py::arg("size"), py::arg("stride"),
           py::arg("offset"), Release(),
           "Saved-tensor unpack: the parameter gathered again, viewed as it was saved.")
      .def("after_backward", &ShardHooks::afterBackward, Release(),
           "After end_backward (ZeRO-3): drops the copies the next forward must gather again.");
}

}  // namespace dcplan::extension
