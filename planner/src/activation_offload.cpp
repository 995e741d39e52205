// Planned activation offload: the saves a plan moves to the host, as each op's memory and copies.
#include "dcplan/planner/activation_offload.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

namespace dcplan::planner {
namespace {

/// The offloaded save `s` of forward run `fwd` (paired with backward run `bwd`): off the device at
/// the forward's ops from freedAt on and the backward's before usedAt; during the compute before
/// them too, except where it may still have been there (the stretch before freedAt; the forward's
/// tail, in the backward's first stretch, where it was gone only by the forward's end; the
/// stretch before usedAt, which copies it back). Its copy out runs in the stretch of its save.
void place(const WorkSaved& s, CompiledActivations::Run& fwd, CompiledActivations::Run& bwd) {
  const auto fwdOps = static_cast<int32_t>(fwd.less.size());
  for (int32_t j = s.freedAt; j < fwdOps; ++j) {
    fwd.less[static_cast<size_t>(j)] += s.bytes;
    if (j > s.freedAt) fwd.lessPeak[static_cast<size_t>(j)] += s.bytes;
  }
  for (int32_t j = 0; j < s.usedAt; ++j) {
    bwd.less[static_cast<size_t>(j)] += s.bytes;
    if (j > 0 || s.freedAt < fwdOps) bwd.lessPeak[static_cast<size_t>(j)] += s.bytes;
  }
  // A save after the forward's last op falls in the backward's first stretch, as its compute does.
  (s.seq < fwdOps ? fwd.outBytes[static_cast<size_t>(s.seq)] : bwd.outBytes[0]) += s.bytes;
  bwd.inBytes[static_cast<size_t>(s.usedAt)] += s.bytes;
}

void size(CompiledActivations::Run& run, size_t ops) {
  if (!run.less.empty()) return;
  for (auto* v : {&run.less, &run.lessPeak, &run.outBytes, &run.inBytes}) v->assign(ops, 0);
}

}  // namespace

CompiledActivations compileActivationOffload(const Workload& w,
                                             const std::vector<schemas::PlanGraph>& graphs) {
  CompiledActivations c;
  for (size_t gi = 0; gi < graphs.size(); ++gi) {
    const schemas::PlanGraph& pg = graphs[gi];
    if (pg.offloadSaves.empty()) continue;
    const std::string ptr = "/graphs/" + std::to_string(gi) + "/offload_saves";
    const int32_t g = w.graphIndex(pg.id);
    for (size_t r = 0; r < w.runs.size(); ++r) {
      const GraphRun& run = w.runs[r];
      if (run.graph != g) continue;
      if (run.backwardRun < 0) {
        throw std::invalid_argument(
            ptr + ": graph " + std::to_string(pg.id) +
            " is not the one forward of a micro-step with one backward: its saves pair with no backward that "
            "reads them");
      }
      std::map<int64_t, const WorkSaved*> byPack;
      for (const WorkSaved& s : run.saved) byPack[s.pack] = &s;
      c.runs.resize(w.runs.size());
      const auto bwd = static_cast<size_t>(run.backwardRun);
      size(c.runs[r], w.graphs[static_cast<size_t>(g)].ops.size());
      size(c.runs[bwd], w.graphs[static_cast<size_t>(w.runs[bwd].graph)].ops.size());
      for (size_t k = 0; k < pg.offloadSaves.size(); ++k) {
        const schemas::OffloadedSave& o = pg.offloadSaves[k];
        const std::string at = ptr + "/" + std::to_string(k);
        auto it = byPack.find(o.pack);
        if (it == byPack.end()) {
          throw std::invalid_argument(at + "/pack: save " + std::to_string(o.pack) + " of graph " +
                                      std::to_string(pg.id) +
                                      " is no saved activation the trace recorded with freed_at and used_at");
        }
        if (it->second->bytes != o.bytes) {
          throw std::invalid_argument(at + "/bytes: expected " + std::to_string(it->second->bytes) +
                                      " (the trace's), got " + std::to_string(o.bytes));
        }
        place(*it->second, c.runs[r], c.runs[bwd]);
        c.bytes += o.bytes;
      }
    }
  }
  return c;
}

std::vector<schemas::OffloadedSave> offloadableSaves(const Workload& w, int32_t graph) {
  // What every run offers alike: a micro-step of other inputs (or one whose saves the trial did not
  // match) may save others, which no plan of the graph can name.
  std::map<std::pair<int64_t, uint64_t>, size_t> runsOffering;
  size_t runs = 0;
  for (const GraphRun& run : w.runs) {
    if (run.graph != graph) continue;
    if (run.backwardRun < 0) return {};
    ++runs;
    for (const WorkSaved& s : run.saved) ++runsOffering[{s.pack, s.bytes}];
  }
  std::vector<schemas::OffloadedSave> out;
  for (const auto& [save, n] : runsOffering) {
    if (n == runs) out.push_back({save.first, save.second});
  }
  return out;  // by first save: the order first saved
}

}  // namespace dcplan::planner
