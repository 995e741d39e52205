// The agreement check before each collective (CollectiveCheck.h).
#include "CollectiveCheck.h"

#include "dcplan/replayer/ForwardingTransport.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace dcplan::replayer {
namespace {

/// One rank's description of the collective it is about to launch.
struct Record {
  char kind[24];
  char op[40];
  int64_t id, graphId, step, position, backward;
  int64_t tensors;
  int64_t elements;  // all inputs together
  uint64_t layout;   // hash of each input's element count and dtype, in order
  int64_t firstDtype;
};
static_assert(sizeof(Record) % 8 == 0);
// What the planner charges a check for (planner kAgreementCheckBytes): change both together.
static_assert(sizeof(Record) == 136);

void copyName(char* dst, size_t size, const std::string& src) {
  std::memset(dst, 0, size);
  std::memcpy(dst, src.data(), std::min(src.size(), size - 1));
}

bool same(const Record& a, const Record& b) {
  return std::strncmp(a.kind, b.kind, sizeof a.kind) == 0 && std::strncmp(a.op, b.op, sizeof a.op) == 0 &&
         a.id == b.id && a.graphId == b.graphId && a.step == b.step && a.position == b.position &&
         a.backward == b.backward && a.tensors == b.tensors && a.elements == b.elements &&
         a.layout == b.layout;
}

std::string describe(int rank, const Record& r) {
  std::string s = "rank " + std::to_string(rank) + " launches " + r.kind + " of " +
                  std::to_string(r.elements) + " " +
                  c10::toString(static_cast<at::ScalarType>(r.firstDtype)) + " elements";
  if (r.tensors > 1) s += " in " + std::to_string(r.tensors) + " tensors";
  if (r.op[0] == '\0') return s + " outside any dc op";
  s += std::string(" for ") + r.op;
  if (r.id >= 0) s += " of id " + std::to_string(r.id);
  if (r.graphId >= 0) s += " in graph " + std::to_string(r.graphId);
  if (r.step >= 0)
    s += " (op " + std::to_string(r.position) + " of the " + (r.backward ? "backward" : "forward") +
         " of step " + std::to_string(r.step) + ")";
  return s;
}

class CheckedTransport final : public ForwardingTransport {
 public:
  CheckedTransport(std::shared_ptr<Transport> inner, std::function<OpPlace()> where)
      : ForwardingTransport(std::move(inner)), where_(std::move(where)) {}

  CommHandlePtr allGather(const at::Tensor& output, const at::Tensor& input) override {
    agree("allGather", {input});
    return inner().allGather(output, input);
  }
  CommHandlePtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                   const std::vector<at::Tensor>& inputs) override {
    agree("allGatherCoalesced", inputs);
    return inner().allGatherCoalesced(outputs, inputs);
  }
  CommHandlePtr reduceScatter(const at::Tensor& output, const at::Tensor& input) override {
    agree("reduceScatter", {input});
    return inner().reduceScatter(output, input);
  }
  CommHandlePtr allReduce(const at::Tensor& tensor) override {
    agree("allReduce", {tensor});
    return inner().allReduce(tensor);
  }
  CommHandlePtr gatherShards(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& shards) override {
    agree("gatherShards", outputs);  // the outputs carry the gather's dtype
    return inner().gatherShards(outputs, shards);
  }

 private:
  void agree(const char* kind, const std::vector<at::Tensor>& tensors) {
    const OpPlace place = where_();
    Record mine{};
    copyName(mine.kind, sizeof mine.kind, kind);
    copyName(mine.op, sizeof mine.op, place.op);
    mine.id = place.id;
    mine.graphId = place.graphId;
    mine.step = place.step;
    mine.position = place.position;
    mine.backward = place.backward;
    mine.tensors = static_cast<int64_t>(tensors.size());
    mine.layout = 1469598103934665603ull;  // FNV-1a over (numel, dtype) of each tensor
    for (const at::Tensor& t : tensors) {
      mine.elements += t.numel();
      for (uint64_t v : {static_cast<uint64_t>(t.numel()), static_cast<uint64_t>(t.scalar_type())})
        mine.layout = (mine.layout ^ v) * 1099511628211ull;
    }
    mine.firstDtype =
        tensors.empty() ? static_cast<int64_t>(at::kByte) : static_cast<int64_t>(tensors[0].scalar_type());

    const int ws = worldSize();
    const int64_t bytes = sizeof(Record);
    at::Tensor host = at::empty({bytes}, at::kByte);
    std::memcpy(host.data_ptr(), &mine, sizeof(Record));
    // On the collective's own device (a device transport gathers device memory only).
    const at::Device device = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
    at::Tensor in = host.to(device);
    at::Tensor out = at::empty({ws * bytes}, in.options());
    inner().allGather(out, in)->synchronize();
    const at::Tensor gathered = out.cpu();
    const auto* all = reinterpret_cast<const Record*>(gathered.data_ptr());
    for (int r = 0; r < ws; ++r) {
      if (same(all[r], mine)) continue;
      // Not a c10::Error: the runtime takes it as a failed collective and stops.
      throw CollectiveMismatch(
          "the ranks disagree on the next collective: " + describe(rank(), mine) + ", but " +
          describe(r, all[r]) +
          "; every rank must run the same modules in the same order (rank-dependent control "
          "flow diverges here)");
    }
  }

  std::function<OpPlace()> where_;
};

}  // namespace

std::shared_ptr<Transport> makeCheckedTransport(std::shared_ptr<Transport> inner,
                                                std::function<OpPlace()> where) {
  return std::make_shared<CheckedTransport>(std::move(inner), std::move(where));
}

}  // namespace dcplan::replayer
