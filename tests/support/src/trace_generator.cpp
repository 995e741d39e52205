// Synthetic gather-on-use traces of Llama-style models: parameter table, op events
// with compute/communication times from a simple roofline, memory, calibration.
#include "dcplan/testing/trace_generator.h"

#include <algorithm>
#include <cmath>

#include "dcplan/schemas/dtype.h"

namespace dcplan::testing {

using schemas::GraphKind;
using schemas::OpEvent;
using schemas::Trace;
using schemas::TraceGraph;
using schemas::TraceParam;

namespace {

// splitmix64: small, fast, and the same on every platform.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  double uniform() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) / static_cast<double>(1ull << 53);
  }

 private:
  uint64_t state_;
};

// A leaf module of the model: the parameters it uses and its forward compute time.
struct Module {
  std::vector<int64_t> params;
  double forwardUs;
  uint64_t activationBytes;  // saved for backward
};

struct Model {
  std::vector<TraceParam> params;
  std::vector<Module> modules;  // forward order
};

int64_t roundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

Model buildModel(const GeneratorOptions& o) {
  const TransformerShape& s = o.model;
  const int64_t h = s.hidden;
  const int64_t ffn = s.ffn > 0 ? s.ffn : roundUp(8 * h / 3, 256);
  const int64_t kvHeads = s.kvHeads > 0 ? s.kvHeads : s.heads;
  const int64_t kv = h / s.heads * kvHeads;
  const double tokens = static_cast<double>(s.tokensPerRank);
  const double flopsPerUs = o.cluster.computeTflops * 1e6;
  const int actSize = schemas::dtypeSize(o.paramDtype).value_or(2);

  Model m;
  auto addParam = [&](const std::string& name, std::vector<int64_t> shape) {
    TraceParam p;
    p.id = static_cast<int64_t>(m.params.size());
    p.name = name;
    p.numel = 1;
    for (int64_t d : shape) p.numel *= d;
    p.shape = std::move(shape);
    p.dtype = "float32";
    p.shardNumel = (p.numel + o.worldSize - 1) / o.worldSize;
    m.params.push_back(p);
    return p.id;
  };
  auto matmulUs = [&](int64_t numel) { return 2.0 * tokens * static_cast<double>(numel) / flopsPerUs; };
  // Norms and element-wise work are memory bound: a few passes over the activations.
  const double normUs = 4.0 + tokens * static_cast<double>(h) * actSize * 3 / 2.5e6;
  const uint64_t hiddenBytes = static_cast<uint64_t>(tokens) * h * actSize;

  auto linear = [&](const std::string& name, int64_t out, int64_t in, double extraUs, uint64_t act) {
    int64_t id = addParam(name, {out, in});
    m.modules.push_back({{id}, matmulUs(out * in) + extraUs, act});
  };

  int64_t embed = addParam("embed.weight", {s.vocab, h});
  m.modules.push_back({{embed}, normUs, 0});
  const double attentionUs = 4.0 * tokens * tokens * static_cast<double>(h) / flopsPerUs;
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string prefix = "layers." + std::to_string(l) + ".";
    int64_t attnNorm = addParam(prefix + "attn_norm.weight", {h});
    m.modules.push_back({{attnNorm}, normUs, hiddenBytes});
    linear(prefix + "attn.wq.weight", h, h, 0, hiddenBytes);
    linear(prefix + "attn.wk.weight", kv, h, 0, hiddenBytes * kv / h);
    linear(prefix + "attn.wv.weight", kv, h, 0, hiddenBytes * kv / h);
    linear(prefix + "attn.wo.weight", h, h, attentionUs, 2 * hiddenBytes);
    int64_t mlpNorm = addParam(prefix + "mlp_norm.weight", {h});
    m.modules.push_back({{mlpNorm}, normUs, hiddenBytes});
    linear(prefix + "mlp.w_gate.weight", ffn, h, 0, hiddenBytes * ffn / h);
    linear(prefix + "mlp.w_up.weight", ffn, h, normUs, 2 * hiddenBytes * ffn / h);
    linear(prefix + "mlp.w_down.weight", h, ffn, 0, hiddenBytes);
  }
  int64_t finalNorm = addParam("norm.weight", {h});
  m.modules.push_back({{finalNorm}, normUs, hiddenBytes});
  int64_t head = s.tiedEmbedding ? embed : addParam("head.weight", {s.vocab, h});
  m.modules.push_back({{head}, matmulUs(s.vocab * h), static_cast<uint64_t>(tokens) * s.vocab * 4});
  return m;
}

class GraphWriter {
 public:
  GraphWriter(const GeneratorOptions& o, const Model& model, Random& random, uint64_t baseline)
      : o_(o), model_(model), random_(random), memory_(baseline) {}

  TraceGraph forward(int64_t id) {
    TraceGraph g{id, GraphKind::Forward, {}};
    for (const Module& m : model_.modules) {
      for (int64_t p : m.params) gather(g, p);
      compute_ += jitter(m.forwardUs);
      memory_ += m.activationBytes;
      for (int64_t p : m.params) release(g, p);
    }
    return g;
  }

  TraceGraph backward(int64_t id) {
    TraceGraph g{id, GraphKind::Backward, {}};
    // A tied parameter's gradient is complete only after its earliest forward use.
    std::vector<size_t> firstUse(model_.params.size(), model_.modules.size());
    for (size_t i = model_.modules.size(); i-- > 0;) {
      for (int64_t p : model_.modules[i].params) firstUse[p] = i;
    }
    for (size_t i = model_.modules.size(); i-- > 0;) {
      const Module& m = model_.modules[i];
      for (int64_t p : m.params) gather(g, p);
      compute_ += jitter(2.0 * m.forwardUs);
      memory_ -= std::min(memory_, m.activationBytes);
      for (int64_t p : m.params) {
        if (firstUse[p] == i && model_.params[p].requiresGrad) reduce(g, p);
      }
      for (int64_t p : m.params) release(g, p);
    }
    OpEvent end = event(g, "end_backward", {}, 0, "", "compute");
    end.endUs = std::max(end.startUs, reduceFree_);
    clock_ = end.endUs;
    g.events.push_back(end);
    // end_backward flushes the last bucket, drains every reduction and frees the buckets.
    memory_ -= std::min(memory_, deferredGrads_ + heldBucket_);
    deferredGrads_ = heldBucket_ = fillingBytes_ = 0;
    return g;
  }

 private:
  double jitter(double us) { return us * (1.0 + o_.jitter * (2.0 * random_.uniform() - 1.0)); }

  uint64_t paddedBytes(int64_t p, const std::string& dtype) const {
    return static_cast<uint64_t>(model_.params[p].shardNumel) * o_.worldSize *
           schemas::dtypeSize(dtype).value_or(4);
  }

  // Starts an event at the host clock after the compute accumulated since the last op.
  OpEvent event(TraceGraph& g, const std::string& op, std::vector<int64_t> ids, uint64_t bytes,
                const std::string& dtype, const std::string& stream) {
    clock_ += compute_;
    OpEvent e;
    e.seq = static_cast<int64_t>(g.events.size());
    e.op = op;
    e.dsIds = std::move(ids);
    e.bytes = bytes;
    e.dtype = dtype;
    e.stream = stream;
    e.startUs = clock_;
    e.endUs = clock_;
    e.computeUs = compute_;
    e.memoryBytes = memory_;
    compute_ = 0;
    return e;
  }

  void gather(TraceGraph& g, int64_t p) {
    const uint64_t bytes = paddedBytes(p, o_.paramDtype);
    OpEvent ag = event(g, "allgather_param", {p}, bytes, o_.paramDtype, "allgather");
    ag.startUs = std::max(clock_, gatherFree_);
    ag.endUs = ag.startUs + jitter(collectiveUs(o_.cluster, o_.worldSize, bytes));
    gatherFree_ = ag.endUs;
    g.events.push_back(ag);
    memory_ += bytes;
    OpEvent wait = event(g, "wait_allgather", {p}, bytes, o_.paramDtype, "compute");
    wait.endUs = std::max(wait.startUs, ag.endUs);
    clock_ = wait.endUs;
    g.events.push_back(wait);
  }

  void release(TraceGraph& g, int64_t p) {
    const uint64_t bytes = paddedBytes(p, o_.paramDtype);
    OpEvent e = event(g, "release_param", {p}, bytes, o_.paramDtype, "compute");
    e.nUsers = 1;
    g.events.push_back(e);
    memory_ -= std::min(memory_, bytes);
  }

  // What the runtime holds for its reductions, as a recording of its default schedule sees it
  // (ZeRO-2/3, the planner's memory model): each gradient from its reduce_grad until its bucket
  // (100 MB, flushed before a gradient that would pass that) is packed, then the packed bucket
  // and its reduce-scatter output (a shard) until the next bucket launches or end_backward.
  void reduce(TraceGraph& g, int64_t p) {
    const uint64_t bytes = paddedBytes(p, o_.reduceDtype);
    const uint64_t grad =
        static_cast<uint64_t>(model_.params[p].numel) * schemas::dtypeSize(o_.paramDtype).value_or(4);
    memory_ += grad;  // made by the compute before the op
    OpEvent e = event(g, "reduce_grad", {p}, bytes, o_.reduceDtype, "reduce");
    e.startUs = std::max(clock_, reduceFree_);
    e.endUs = e.startUs + jitter(collectiveUs(o_.cluster, o_.worldSize, bytes));
    reduceFree_ = e.endUs;
    g.events.push_back(e);
    if (o_.stage < 2) {  // ZeRO-1 copies it into its bucket; the bucket is not modelled here
      memory_ -= std::min(memory_, grad);
      return;
    }
    constexpr uint64_t kBucketBytes = 100'000'000;
    if (fillingBytes_ > 0 && fillingBytes_ + bytes > kBucketBytes) {
      memory_ -= std::min(memory_, heldBucket_ + deferredGrads_);
      heldBucket_ = fillingBytes_ + fillingBytes_ / static_cast<uint64_t>(o_.worldSize);
      memory_ += heldBucket_;
      deferredGrads_ = fillingBytes_ = 0;
    }
    fillingBytes_ += bytes;
    deferredGrads_ += grad;
  }

  const GeneratorOptions& o_;
  const Model& model_;
  Random& random_;
  uint64_t memory_;
  uint64_t fillingBytes_ = 0;   // reduce bytes of the bucket being filled
  uint64_t deferredGrads_ = 0;  // the gradients it holds
  uint64_t heldBucket_ = 0;     // the last launched bucket's input and output
  double clock_ = 0;            // host / compute-stream time within the graph
  double compute_ = 0;          // compute since the last op
  double gatherFree_ = 0;       // when the all-gather stream is next free
  double reduceFree_ = 0;       // when the reduce stream is next free
};

std::vector<schemas::CalibrationPoint> curve(const GeneratorOptions& o, double scale) {
  std::vector<schemas::CalibrationPoint> points;
  for (uint64_t bytes = 64 << 10; bytes <= (1ull << 30); bytes *= 4) {
    points.push_back({bytes, scale * collectiveUs(o.cluster, o.worldSize, bytes)});
  }
  return points;
}

}  // namespace

double collectiveUs(const ClusterProfile& cluster, int64_t worldSize, uint64_t bytes) {
  if (worldSize <= 1) return cluster.latencyUs;
  const double b = static_cast<double>(bytes);
  const double busGBps = cluster.peakBusGBps * b / (b + cluster.halfBusBytes);
  const double moved = b * static_cast<double>(worldSize - 1) / static_cast<double>(worldSize);
  return cluster.latencyUs + moved / (busGBps * 1e3);  // GB/s = 1e3 bytes/us
}

Trace generateTrace(const GeneratorOptions& o) {
  Trace t;
  t.meta.createdBy = "dcplan-gen-trace 0.1.0";
  t.meta.worldSize = o.worldSize;
  t.meta.backend = o.cluster.device == "cpu" ? "gloo" : "nccl";
  t.meta.device = o.cluster.device;
  t.meta.stage = o.stage;
  t.meta.gradAccumSteps = o.gradAccumSteps;
  t.meta.paramDtype = o.paramDtype;
  t.meta.reduceDtype = o.reduceDtype;
  t.meta.versions = {{"dcplan", "0.1.0"}, {"generator", "1"}};

  Model model = buildModel(o);
  t.params = model.params;

  // Master shard, gradient shard and two AdamW moments, all fp32.
  uint64_t baseline = 0;
  for (const auto& p : t.params) baseline += static_cast<uint64_t>(p.shardNumel) * 4 * 4;
  t.memory.capacityBytes = o.cluster.capacityBytes;
  t.memory.baselineBytes = baseline;

  t.calibration.allGather = curve(o, 1.0);
  t.calibration.reduceScatter = curve(o, 1.05);
  t.calibration.allReduce = curve(o, 2.0);
  if (o.cluster.device != "cpu") {
    t.calibration.h2dGBps = o.cluster.h2dGBps;
    t.calibration.d2hGBps = o.cluster.h2dGBps;
  }

  Random random(o.seed);
  // AdamW touches the fp32 shards a few times: memory bound.
  double shardBytes = 0;
  for (const auto& p : t.params) shardBytes += static_cast<double>(p.shardNumel) * 4;
  const double optimizerUs = 20.0 + shardBytes * 7 / 2.5e6;
  for (int64_t s = 0; s < o.steps * o.gradAccumSteps; ++s) {
    GraphWriter writer(o, model, random, baseline);
    schemas::TraceStep step;
    step.index = s;
    step.graphs.push_back(writer.forward(0));
    step.graphs.push_back(writer.backward(1));
    const bool boundary = (s + 1) % o.gradAccumSteps == 0;
    step.optimizerUs = boundary ? optimizerUs * (1.0 + o.jitter * (2.0 * random.uniform() - 1.0)) : 0.0;
    t.steps.push_back(std::move(step));
  }
  return t;
}

}  // namespace dcplan::testing
