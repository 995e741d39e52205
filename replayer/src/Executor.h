// Private runtime classes: parameter registry, reduce buckets and the ZeRO-1/2/3 executors.
#pragma once

#include "dcplan/replayer/Runtime.h"

#include <ATen/core/Tensor.h>

#include <array>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace dcplan::replayer {

/// "[2, 3]": a shape in error messages.
inline std::string shapeString(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

/// Elements of one rank's slice of a parameter of numel elements.
inline int64_t shardNumelOf(int64_t numel, int worldSize) { return (numel + worldSize - 1) / worldSize; }

/// One registered parameter: its shard, gradient buffer, gathered copy and offload state.
struct Param {
  int64_t id_ = -1;
  std::string name_;  // qualified name (model.named_parameters()); may be empty
  /// How messages name the parameter: "layers.0.w (ds_id 3)", or "ds_id 3" without a name.
  std::string label() const {
    return name_.empty() ? "ds_id " + std::to_string(id_) : name_ + " (ds_id " + std::to_string(id_) + ")";
  }
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  int64_t shardNumel_ = 0;
  at::Tensor shard_;  // [shardNumel_], zero padded past numel_
  bool trainable_ = false;
  // The gradient reductions land in: a registered buffer (fixedGrad_), or, for a parameter
  // registered without one, what setGrads gave or the first reduction of a backward created
  // (then handed over by takeGrads: the runtime keeps no gradient memory between steps).
  at::Tensor grad_;
  bool fixedGrad_ = false;
  bool accumulate_ = false;  // grad_ holds data this backward adds to
  bool persistent_ = false;

  // Gathered copy: gatheredBuffer_ is [worldSize * shardNumel_] (padded);
  // gathered_ is its first numel_ elements viewed as shape_.
  at::Tensor gatheredBuffer_;
  at::Tensor gathered_;
  CommHandlePtr gatherHandle_;  // set while the gather is in flight
  bool valid_ = false;          // gathered_ holds the current shard data
  int64_t uses_ = 0;            // releases seen since the last free

  // Offload: the shard's storage is freed and its data kept in host_ (allocated once, kept: a
  // reload leaves it equal to the shard until the shard is written).
  bool offloaded_ = false;
  at::Tensor host_;
  // A plan's master offload: the shard lives in host_ between uses; a gather brings it back and
  // its wait drops it again (unchanged: no copy out).
  bool masterOnHost_ = false;

  bool trainable() const { return trainable_; }
  bool hasGathered() const { return gathered_.defined(); }
  int64_t gatheredBytes() const {
    return gathered_.defined() ? gathered_.numel() * static_cast<int64_t>(gathered_.element_size()) : 0;
  }
};

/// All registered parameters of this rank, keyed by ds_id.
class ParamRegistry {
 public:
  ParamRegistry(int worldSize, Transport& transport, int64_t maxReleaseLagBytes)
      : worldSize_(worldSize), transport_(transport), maxReleaseLagBytes_(maxReleaseLagBytes) {}
  ParamRegistry(const ParamRegistry&) = delete;
  ParamRegistry& operator=(const ParamRegistry&) = delete;

  void registerParam(int64_t dsId, const std::vector<int64_t>& shape, const at::Tensor& shard,
                     const at::Tensor& gradBuffer, bool persistent, bool trainable = false,
                     const std::string& name = "");
  bool contains(int64_t dsId) const { return params_.count(dsId) != 0; }
  /// The parameter, or a TORCH_CHECK error naming op and id.
  Param& get(const char* op, int64_t dsId);
  std::map<int64_t, Param>& all() { return params_; }

  /// Launches the gather of p in dtype unless a copy in that dtype is held.
  void startGather(Param& p, at::ScalarType dtype, Transport& transport);
  /// Launches the gathers of ps that hold no copy as one coalesced call.
  void startGatherFused(const std::vector<Param*>& ps, const std::vector<at::ScalarType>& dtypes,
                        Transport& transport);
  void waitGather(Param& p);
  /// Drops the gathered copy (after its gather completes).
  void dropGathered(Param& p);
  /// dropGathered of every parameter.
  void dropAllGathered();
  /// Waits (on the host) until released copies not yet used up by the device hold at most
  /// maxReleaseLagBytes (before allocating another gathered copy). Not under CUDA graph
  /// capture: a replayed graph runs on the device alone, with no host running ahead of it.
  void boundReleaseLag();
  /// Forgets every gathered copy without waiting for it or tracking its release: the copies a
  /// captured step replays with. Returns them: the caller keeps them alive while the graph replays.
  std::vector<at::Tensor> forgetGatheredOfGraph();
  /// Forgets the releases tracked so far, which the caller saw completed (before a capture).
  void forgetReleases() {
    released_.clear();
    releasedBytes_ = 0;
  }
  /// Frees p's shard on the device, its data kept in host_: copied there unless `copyOut` is
  /// false, which only a shard equal to host_ may pass (brought back and not written since).
  void offload(Param& p, bool copyOut = true);
  /// Gives p's shard its memory back and copies host_ into it (on a GPU, on the caller's stream).
  void reload(Param& p);
  /// reload for a gather about to read p's shard: the copy by transport.reloadShard (on a GPU,
  /// on the reload stream, which the gathers wait for and the caller's stream does not).
  void reloadForGather(Param& p, Transport& transport);

 private:
  /// Forgets p's gathered copy (the tensors and their state), whatever still uses it.
  static void clearGathered(Param& p);
  /// Before the caller reads or copies out p's shard (reload, offload): where a gather brought it
  /// back and has not been waited for, the caller waits for that gather.
  static void awaitReloadForGather(Param& p);
  int worldSize_;
  Transport& transport_;
  int64_t maxReleaseLagBytes_;
  std::deque<std::pair<CommHandlePtr, int64_t>> released_;  // device use ends, oldest first; bytes
  int64_t releasedBytes_ = 0;
  std::map<int64_t, Param> params_;
};

/// Where one gradient sits in a bucket: columns [colOffset_, colOffset_ + cols_).
struct ReduceTask {
  int64_t dsId_;
  int64_t colOffset_;
  int64_t cols_;
};

/// A reduce bucket of one dtype. Its data is a [worldSize, cols] matrix per
/// gradient (the padded gradient, row r = rank r's slice). Rank-major layout
/// (reduce-scatter): the whole bucket is [worldSize, capacity] and a gradient
/// takes columns, so row r is rank r's contiguous input. Flat layout
/// (all-reduce): gradients are stored one after another.
class ReduceBucket {
 public:
  ReduceBucket(at::ScalarType dtype, c10::Device device, int worldSize, bool rankMajor,
               int64_t capacityBytes);
  ReduceBucket(const ReduceBucket&) = delete;
  ReduceBucket& operator=(const ReduceBucket&) = delete;

  /// Reserves cols columns for gradient dsId; returns its [worldSize, cols] region. An empty
  /// bucket allocates sizeCols columns (0: its configured capacity), at least cols.
  at::Tensor allocate(int64_t dsId, int64_t cols, int64_t sizeCols = 0);
  /// Rank-major: keeps gradient dsId (flat, cols per rank once padded) as it is until
  /// pack(), instead of copying it into the buffer now (one launch per bucket, not per
  /// gradient; no buffer while the bucket fills).
  void defer(int64_t dsId, int64_t cols, const at::Tensor& gradFlat);
  /// Lays the deferred gradients out as the [worldSize, usedCols] buffer: row r holds
  /// each gradient's r-th slice, zero padded.
  void pack();
  bool rankMajor() const { return rankMajor_; }
  /// Whether the buffer was allocated at a planned bucket's size (until releaseMemory()).
  bool plannedSize() const { return plannedSize_; }
  at::Tensor region(const ReduceTask& task) const;
  /// What the collective works on: [worldSize, usedCols] (rank-major) or the
  /// used prefix of the flat buffer.
  at::Tensor commInput() const;
  int64_t usedBytes() const;
  bool empty() const { return tasks_.empty(); }
  at::ScalarType dtype() const { return dtype_; }
  const std::vector<ReduceTask>& tasks() const { return tasks_; }
  void reset();
  /// Frees the buffer of an empty, completed bucket (between backwards: the optimizer step
  /// and the next forward get the memory); the next allocate() makes a new one.
  void releaseMemory();

  // The collective in flight on this bucket and where its result lands.
  CommHandlePtr pending_;
  at::Tensor output_;

 private:
  void reserveCols(int64_t cols, int64_t sizeCols);

  at::ScalarType dtype_;
  c10::Device device_;
  int worldSize_;
  bool rankMajor_;
  int64_t capacityCols_;
  int64_t configuredCols_;  ///< capacityCols_ before a large gradient grew it
  bool plannedSize_ = false;
  int64_t usedCols_ = 0;
  at::Tensor buffer_;
  std::vector<ReduceTask> tasks_;
  std::vector<at::Tensor> deferred_;  ///< gradients defer() keeps until pack()
};

/// Two buckets per dtype: one fills while the other's reduction is in flight.
class DoubleBufferedReduceBucket {
 public:
  DoubleBufferedReduceBucket(int worldSize, bool rankMajor, int64_t capacityBytes, bool doubleBuffer)
      : worldSize_(worldSize),
        rankMajor_(rankMajor),
        capacityBytes_(capacityBytes),
        doubleBuffer_(doubleBuffer) {}
  /// The bucket being filled; device is used when the dtype's buckets are created.
  ReduceBucket& current(at::ScalarType dtype, c10::Device device = c10::Device(c10::kCPU));
  /// Makes the other bucket current and returns it; the caller completes
  /// that bucket's pending reduction (queues its accumulation) before filling it.
  ReduceBucket& swap(at::ScalarType dtype);
  std::vector<ReduceBucket*> all();

 private:
  struct Pair {
    std::array<std::unique_ptr<ReduceBucket>, 2> buckets;
    int current = 0;
  };
  Pair& pair(at::ScalarType dtype, c10::Device device = c10::Device(c10::kCPU));

  int worldSize_;
  bool rankMajor_;
  int64_t capacityBytes_;
  bool doubleBuffer_;
  std::map<at::ScalarType, Pair> pairs_;
};

struct RuntimeState;

/// Runs the ops of one graph. Gathering and releasing are the same for every
/// stage; the stages differ in what stays gathered and how gradients are reduced.
class Executor {
 public:
  Executor(int64_t graphId, Stage stage, std::vector<int64_t> dsIds,
           std::optional<at::ScalarType> reduceDtype, RuntimeState& rt);
  virtual ~Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  Stage stage() const { return stage_; }
  int64_t graphId() const { return graphId_; }
  /// The parameter dsId of this graph, or a TORCH_CHECK error naming the op.
  Param& param(const char* op, int64_t dsId);

  at::Tensor allgatherParam(const at::Tensor& shard, int64_t dsId, std::optional<at::ScalarType> dtype);
  void prefetchParamsFused(const std::vector<int64_t>& dsIds, const std::vector<at::ScalarType>& dtypes);
  at::Tensor waitAllgather(const at::Tensor& gathered, int64_t dsId);
  void releaseParam(int64_t dsId, int64_t nUsers);
  void reduceGrad(const at::Tensor& grad, int64_t dsId);
  void startBackward(bool sync);
  void endBackward();
  /// Completes every reduction in flight; afterwards the caller sees every gradient buffer.
  void drain();

 protected:
  /// ZeRO-1/2 keep every parameter gathered between optimizer steps.
  virtual bool keepsAllGathered() const = 0;
  /// Stage-specific handling of one gradient (ZeRO-1 accumulates locally).
  virtual void addGrad(Param& p, const at::Tensor& gradFlat);
  virtual CommHandlePtr launchReduce(ReduceBucket& bucket) = 0;
  /// This rank's reduced slice of a task, after the reduction completed.
  virtual at::Tensor reducedSlice(ReduceBucket& bucket, const ReduceTask& task) = 0;
  /// Whether a reduced slice may become a parameter's gradient as it is (a view that keeps
  /// no more memory alive than the gradients of the bucket).
  virtual bool sliceIsGradient() const = 0;

  /// Copies a flat gradient (numel elements) into a bucket, flushing first if
  /// the schedule says so.
  void putInBucket(Param& p, const at::Tensor& gradFlat);
  void flush(at::ScalarType dtype);
  /// Queues the accumulation of a flushed bucket's reduced gradients after its reduction
  /// (and frees the buffer while the reduction may still read it).
  void complete(ReduceBucket& bucket);

  int64_t graphId_;
  Stage stage_;
  std::vector<int64_t> dsIds_;
  std::unordered_map<int64_t, bool> inGraph_;
  std::optional<at::ScalarType> reduceDtype_;
  RuntimeState& rt_;
  std::unique_ptr<DoubleBufferedReduceBucket> buckets_;
  std::vector<CommHandlePtr> accumulations_;  // queued by complete(), waited for by drain()
  bool sync_ = true;
};

/// ZeRO-1: every parameter stays gathered; gradients accumulate locally over
/// micro-steps and are all-reduced at the accumulation boundary.
class Zero1Executor final : public Executor {
 public:
  using Executor::Executor;

 protected:
  bool keepsAllGathered() const override { return true; }
  void addGrad(Param& p, const at::Tensor& gradFlat) override;
  CommHandlePtr launchReduce(ReduceBucket& bucket) override;
  at::Tensor reducedSlice(ReduceBucket& bucket, const ReduceTask& task) override;
  // A slice is a row of the whole all-reduced bucket: as a gradient it would keep all of it.
  bool sliceIsGradient() const override { return false; }

 private:
  std::unordered_map<int64_t, at::Tensor> localGrad_;  // fp32 [numel], between boundaries
};

/// ZeRO-2 and ZeRO-3: gradients are reduce-scattered every micro-step. ZeRO-2
/// keeps every parameter gathered; ZeRO-3 frees it after its last user.
class ShardedGradExecutor final : public Executor {
 public:
  using Executor::Executor;

 protected:
  bool keepsAllGathered() const override { return stage_ == Stage::Zero2; }
  CommHandlePtr launchReduce(ReduceBucket& bucket) override;
  at::Tensor reducedSlice(ReduceBucket& bucket, const ReduceTask& task) override;
  // The reduce-scatter output holds this rank's slices of the bucket's gradients, nothing else.
  bool sliceIsGradient() const override { return true; }
};

}  // namespace dcplan::replayer
