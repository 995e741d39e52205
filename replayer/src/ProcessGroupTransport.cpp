// Transport over a c10d ProcessGroup: the CPU (Gloo) path of the runtime.
#include "dcplan/replayer/Transport.h"

#include "WorkerRelease.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <exception>
#include <functional>
#include <map>
#include <string>

namespace dcplan::replayer {
namespace {

/// The process's one: every Gloo transport learns about the same backend.
WorkerRelease& workerRelease() {
  static WorkerRelease release;
  return release;
}

/// Waits on c10d works, then runs a completion step (copying a fused result
/// back into its destinations) exactly once. With `workerHolds`, a backend's
/// worker thread holds the works for a while after they complete
/// (WorkerRelease).
class WorkHandle final : public CommHandle {
 public:
  WorkHandle(bool workerHolds, std::vector<c10::intrusive_ptr<c10d::Work>> works,
             std::function<void()> then = {})
      : workerHolds_(workerHolds), works_(std::move(works)), then_(std::move(then)) {}

  void wait() override {
    if (done_) return;
    waitAll();
    if (then_) then_();
    if (workerHolds_)
      for (auto& w : works_) workerRelease().await(w);
    done_ = true;
    works_.clear();
    then_ = nullptr;
  }

  bool isCompleted() override {
    if (done_) return true;
    // Completed also means the backend's worker let go of the work (WorkerRelease); whether to
    // wait for that (a mutex) is asked only while the worker still holds it.
    for (auto& w : works_) {
      if (!w->isCompleted() || (workerHolds_ && w.use_count() > 1 && workerRelease().awaits())) return false;
    }
    return !then_;
  }

 private:
  /// Waits for every work, then throws what failed: one call's works share the ranks'
  /// connections, so a work that timed out closes them and the others fail with that closure,
  /// which alone would hide the timeout (a stuck rank's broadcast timed out while this rank's own,
  /// waited first, failed with "Application timeout caused pair closure"). Each wait is bounded by
  /// the group's timeout, so a failed call may take a few of them to report. The first failure is
  /// rethrown as it is (its type kept), the others added to its message.
  void waitAll() {
    std::exception_ptr first;
    std::string others;
    for (size_t i = 0; i < works_.size(); ++i) {
      try {
        works_[i]->wait();
      } catch (const std::exception& e) {
        if (!first) {
          first = std::current_exception();
          continue;
        }
        others += std::string(others.empty() ? "" : "; ") + "its " +
                  c10d::opTypeToString(works_[i]->retrieveOpType()) + " " + std::to_string(i + 1) + " of " +
                  std::to_string(works_.size()) + ": " + failureMessage(e);
      }
    }
    if (!first) return;
    if (others.empty()) std::rethrow_exception(first);
    try {
      std::rethrow_exception(first);
    } catch (c10::Error& e) {
      e.add_context("the call's other works failed too: " + others);
      throw;
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError, failureMessage(e) + "; the call's other works failed too: " + others);
    }
  }

  const bool workerHolds_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::function<void()> then_;
  bool done_ = false;
};

/// Whether the group's CPU tensors go through Gloo (a "gloo" group, or "cpu:gloo,cuda:nccl",
/// whose default backend is NCCL).
bool glooOnCpu(c10d::ProcessGroup& pg) {
  try {
    const auto backend = pg.getBackend(c10::DeviceType::CPU);
    return backend && backend->getBackendName() == "gloo";
  } catch (const std::exception&) {
    return false;  // no CPU backend
  }
}

// A C++-owned tensor over the same memory. Gloo's worker threads may drop the last
// reference to a work's tensors; if that tensor were the TensorImpl of a Python tensor
// (a registered shard), dropping it would need the GIL, which aborts the process while
// the interpreter finalizes. A tensor made here has no Python object.
at::Tensor cppOwned(const at::Tensor& t) {
  at::NoGradGuard noGrad;
  at::Tensor out = at::empty({0}, t.options());
  out.set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
  return out;
}

class ProcessGroupTransport final : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg)
      : pg_(std::move(pg)), workerHolds_(glooOnCpu(*pg_)) {}

  int rank() const override { return pg_->getRank(); }
  int worldSize() const override { return pg_->getSize(); }
  std::string backendName() const override { return pg_->getBackendName(); }

  CommHandlePtr allGather(const at::Tensor& output, const at::Tensor& input) override {
    const int ws = worldSize();
    TORCH_CHECK(output.is_contiguous() && input.is_contiguous(), "allGather: tensors should be contiguous");
    TORCH_CHECK(output.numel() == ws * input.numel(), "allGather: output should have world_size * ",
                input.numel(), " elements, got ", output.numel());
    TORCH_CHECK(output.scalar_type() == input.scalar_type() && output.device() == input.device(),
                "allGather: output should be ", input.scalar_type(), " on ", input.device(), " as the input, got ",
                output.scalar_type(), " on ", output.device());
    if (input.numel() == 0) return handle({});
    if (workerHolds_) {
      const at::Tensor rows = output.view({ws, input.numel()});
      const at::Tensor own = rows.select(0, rank());
      // An input that is this rank's row already (a gather in place) needs no copy.
      if (own.data_ptr() != input.data_ptr()) own.copy_(input.view({-1}));
      return handle(broadcastRows(rows));
    }
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int r = 0; r < ws; ++r)
      outs[0].push_back(cppOwned(output.narrow(0, r * input.numel(), input.numel())));
    std::vector<at::Tensor> ins{cppOwned(input)};
    return handle({pg_->allgather(outs, ins)});
  }

  CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                   const std::vector<at::Tensor>& inputs) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "allGatherCoalesced: ", outputs.size(), " outputs for ",
                inputs.size(), " inputs");
    const int ws = worldSize();
    // One flat [ws, total] buffer per dtype, gathered by one call (on Gloo one broadcast per
    // rank); the completion step scatters it into the per-parameter outputs.
    std::map<at::ScalarType, std::vector<size_t>> byType;
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(outputs[i].numel() == ws * inputs[i].numel() && outputs[i].is_contiguous(),
                  "allGatherCoalesced: output ", i, " should be contiguous with world_size * ",
                  inputs[i].numel(), " elements, got ", outputs[i].numel());
      byType[inputs[i].scalar_type()].push_back(i);
    }
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<std::function<void()>> steps;
    for (auto& [type, idx] : byType) {
      std::vector<at::Tensor> flatIns;
      int64_t total = 0;
      for (size_t i : idx) {
        flatIns.push_back(inputs[i].reshape({-1}));
        total += inputs[i].numel();
      }
      if (total == 0) continue;
      at::Tensor flatOut = at::empty({ws, total}, inputs[idx[0]].options());
      if (workerHolds_) {
        // This rank's row is the concatenated shards: no separate input buffer.
        at::Tensor own = flatOut.select(0, rank());
        at::cat_out(own, flatIns);
        for (auto& w : broadcastRows(flatOut)) works.push_back(std::move(w));
      } else {
        at::Tensor flatIn = at::cat(flatIns);
        std::vector<std::vector<at::Tensor>> outs(1);
        for (int r = 0; r < ws; ++r) outs[0].push_back(flatOut.select(0, r));
        std::vector<at::Tensor> ins{flatIn};
        works.push_back(pg_->allgather(outs, ins));
      }
      std::vector<at::Tensor> dests;
      for (size_t i : idx) dests.push_back(outputs[i].view({ws, inputs[i].numel()}));
      steps.push_back([flatOut, dests]() {
        int64_t off = 0;
        for (const at::Tensor& d : dests) {
          d.copy_(flatOut.narrow(1, off, d.size(1)));
          off += d.size(1);
        }
      });
    }
    return handle(std::move(works), [steps]() {
      for (auto& s : steps) s();
    });
  }

  CommHandlePtr reduceScatter(const at::Tensor& output, const at::Tensor& input) override {
    const int ws = worldSize();
    TORCH_CHECK(input.dim() == 2 && input.size(0) == ws && input.size(1) == output.numel(),
                "reduceScatter: input should be [world_size, ", output.numel(), "], got ", input.sizes());
    TORCH_CHECK(output.is_contiguous() && output.scalar_type() == input.scalar_type(),
                "reduceScatter: output should be contiguous and of the input's dtype ", input.scalar_type(),
                ", got ", output.scalar_type(), output.is_contiguous() ? "" : " (not contiguous)");
    if (output.numel() == 0) return handle({});
    if (reducesAloneInPlace(output, input)) return doneHandle();
    std::vector<at::Tensor> rows;
    for (int r = 0; r < ws; ++r) {
      rows.push_back(input.select(0, r));
      TORCH_INTERNAL_ASSERT(rows.back().is_contiguous(), "reduceScatter: rows should be contiguous");
    }
    if (workerHolds_) return reduceScatterByReduces(output, rows);
    std::vector<std::vector<at::Tensor>> ins{rows};
    std::vector<at::Tensor> outs{cppOwned(output)};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return handle({pg_->reduce_scatter(outs, ins, opts)});
  }

  CommHandlePtr allReduce(const at::Tensor& tensor) override {
    TORCH_CHECK(tensor.is_contiguous(), "allReduce: tensor should be contiguous");
    if (tensor.numel() == 0) return handle({});
    std::vector<at::Tensor> ts{cppOwned(tensor)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return handle({pg_->allreduce(ts, opts)});
  }

 private:
  CommHandlePtr handle(std::vector<c10::intrusive_ptr<c10d::Work>> works,
                       std::function<void()> then = {}) const {
    return std::make_shared<WorkHandle>(workerHolds_, std::move(works), std::move(then));
  }

  /// Gloo's all-gather, made here: one broadcast per rank, rooted there, of its row of `rows` (this
  /// rank's row already holds its input). Gloo's own allgather gathers into a flat buffer of the
  /// output's size that its worker thread allocates when it runs the call and frees when the call
  /// ends: memory that exists or not at an op as the scheduler ran the worker (a prefetch's buffer,
  /// in use in the recording and gone in the replay, left a 2-rank replay's peak 3.2% under its
  /// prediction on CI). A broadcast works in its tensor: the gather needs nothing but its output.
  std::vector<c10::intrusive_ptr<c10d::Work>> broadcastRows(const at::Tensor& rows) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int r = 0; r < worldSize(); ++r) {
      std::vector<at::Tensor> tensor{cppOwned(rows.select(0, r))};
      c10d::BroadcastOptions opts;
      opts.rootRank = r;
      works.push_back(pg_->broadcast(tensor, opts));
    }
    return works;
  }

  /// Gloo's reduce_scatter, made here: one reduce per rank, rooted there, of a copy of that rank's
  /// row (a reduce leaves a non-root's tensor undefined), and into the output from this rank's row.
  /// Gloo's own does the same but returns a work wrapping the reduces, which its worker threads
  /// still hold after the wrapper completes: the copies (a bucket's (N-1)/N) were then freed
  /// whenever a worker next ran, into the optimizer step on a loaded machine (a 2-rank replay
  /// 1.4 MiB over its prediction in 1 of 3 runs). Holding each reduce here, the wait frees them
  /// (WorkerRelease) where the planner's memory model does (RuntimeMemory::reduceScatterScratch).
  CommHandlePtr reduceScatterByReduces(const at::Tensor& output, const std::vector<at::Tensor>& rows) {
    const int self = rank();
    // The other rows are copied before output, which may overlap one of them, is written.
    std::vector<at::Tensor> tensors;
    for (int r = 0; r < static_cast<int>(rows.size()); ++r)
      tensors.push_back(r == self ? cppOwned(output) : rows[static_cast<size_t>(r)].clone());
    tensors[static_cast<size_t>(self)].copy_(rows[static_cast<size_t>(self)]);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int r = 0; r < static_cast<int>(rows.size()); ++r) {
      std::vector<at::Tensor> tensor{tensors[static_cast<size_t>(r)]};
      c10d::ReduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      opts.rootRank = r;
      works.push_back(pg_->reduce(tensor, opts));
    }
    return handle(std::move(works));
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  const bool workerHolds_;  // Gloo: see WorkerRelease
};

}  // namespace

std::shared_ptr<Transport> makeProcessGroupTransport(const std::string& groupName) {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(groupName);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "init: no process group is registered under the name '", groupName,
                "' (pass group.group_name of an initialized torch.distributed group): ", e.what());
  }
  TORCH_CHECK(pg, "init: process group '", groupName, "' resolved to null");
  return std::make_shared<ProcessGroupTransport>(std::move(pg));
}

}  // namespace dcplan::replayer
