// The text summary of a trace, shared by `inspect` and `record`.
#include "trace_report.h"

#include <cstdio>

#include "dcplan/schemas/trace_summary.h"
#include "dcplan/schemas/units.h"

namespace dcplan::cli {
namespace {

using namespace dcplan::schemas;

std::string percent(double part, double whole) {
  char out[16];
  std::snprintf(out, sizeof out, "%.1f%%", whole > 0 ? 100.0 * part / whole : 0.0);
  return out;
}

std::string padded(const std::string& s, size_t width, bool right = false) {
  if (s.size() >= width) return s;
  return right ? std::string(width - s.size(), ' ') + s : s + std::string(width - s.size(), ' ');
}

}  // namespace

void printTraceSummary(std::ostream& out, const std::string& file, const Trace& t, size_t top) {
  const TraceSummary s = summarizeTrace(t, top);
  out << "trace:    " << file << " (" << kTraceSchema << ", " << t.meta.createdBy << ")\n"
      << "cluster:  " << t.meta.worldSize << " x " << t.meta.device << ", " << t.meta.backend << ", ZeRO-"
      << t.meta.stage << ", grad accum " << t.meta.gradAccumSteps << ", gather " << t.meta.paramDtype
      << ", reduce " << t.meta.reduceDtype << (t.meta.replay == "compiled" ? ", compiled" : "")
      << (t.meta.graphed ? ", step in dcplan.graphed_step (planned for one CUDA graph per step)" : "") << "\n"
      << "model:    " << s.params << " parameters (" << s.trainableParams << " trainable), " << s.elements
      << " elements, " << formatBytes(s.masterBytes) << " master\n"
      << "memory:   capacity " << formatBytes(t.memory.capacityBytes) << ", baseline "
      << formatBytes(t.memory.baselineBytes) << ", peak recorded " << formatBytes(s.peakMemoryBytes)
      << "\n\n";

  out << "per step (mean of " << s.steps << " recorded):\n"
      << "  graph  kind       ops  gathers  releases  reduces    gathered     reduced     compute     "
         "exposed\n";
  uint64_t gathered = 0, reduced = 0;
  for (const auto& g : s.graphs) {
    gathered += g.gatheredBytes;
    reduced += g.reducedBytes;
    out << "  " << padded(std::to_string(g.id), 5, true) << "  " << padded(graphKindName(g.kind), 8) << " "
        << padded(std::to_string(g.ops), 5, true) << padded(std::to_string(g.gathers), 9, true)
        << padded(std::to_string(g.releases), 10, true) << padded(std::to_string(g.reduces), 9, true)
        << padded(formatBytes(g.gatheredBytes), 12, true) << padded(formatBytes(g.reducedBytes), 12, true)
        << padded(formatMs(g.computeUs), 12, true) << padded(formatMs(g.exposedCommUs), 12, true) << "\n";
  }
  out << "  bytes per step: " << formatBytes(gathered) << " gathered, " << formatBytes(reduced)
      << " reduced\n\n";

  const double total = s.computeUs + s.exposedCommUs + s.optimizerUs;
  out << "time per step: " << formatMs(total) << " = compute " << formatMs(s.computeUs) << " ("
      << percent(s.computeUs, total) << ") + exposed communication " << formatMs(s.exposedCommUs) << " ("
      << percent(s.exposedCommUs, total) << ") + optimizer " << formatMs(s.optimizerUs) << " ("
      << percent(s.optimizerUs, total) << ")\n";
  if (s.hostTimes) {
    // The host's side of the same step: which of the two the step waited for.
    const double host = s.hostComputeUs + s.issueUs + s.optimizerHostUs;
    out << "host time per step: " << formatMs(host) << " = issuing compute " << formatMs(s.hostComputeUs)
        << " + inside dc ops " << formatMs(s.issueUs) << " + optimizer " << formatMs(s.optimizerHostUs)
        << "\n";
  }
  if (s.deviceTimes) {
    // The device-lead step's: what a step replayed as one CUDA graph runs (dcplan plan --cuda-graph).
    // The ops' own work (op_device_us) is shown where the trace has it (recorded since session 12).
    out << "device's own time per step: " << formatMs(s.deviceComputeUs + s.deviceOpUs + s.optimizerDeviceUs)
        << " = compute " << formatMs(s.deviceComputeUs);
    if (s.deviceOpUs > 0) out << " + dc ops " << formatMs(s.deviceOpUs);
    out << " + optimizer " << formatMs(s.optimizerDeviceUs)
        << " (with the step queued ahead: what a CUDA graph's replay runs)\n";
  }
  if (s.savedActivations) {
    char tensors[32];
    std::snprintf(tensors, sizeof tensors, "%.0f", s.savedTensors);
    out << "saved for backward per step: " << tensors << " storages, " << formatBytes(s.savedBytes);
    if (s.savedTried) {
      out << "; moved to the host as saved, " << formatBytes(s.savedFreedBytes)
          << " of them leave the device by the forward's end (the recorder's trial)\n";
    } else {
      out << " (no trial: recorded without a warm-up step)\n";
    }
  }
  if (!s.slowest.empty()) {
    out << "\nslowest communication ops:\n"
        << "  step  graph    seq  op                     time       bytes  parameter\n";
    for (const auto& op : s.slowest) {
      out << "  " << padded(std::to_string(op.step), 4, true) << padded(std::to_string(op.graph), 7, true)
          << padded(std::to_string(op.seq), 7, true) << "  " << padded(op.op, 16)
          << padded(formatMs(op.us), 12, true) << padded(formatBytes(op.bytes), 12, true) << "  " << op.param
          << "\n";
    }
  }
}

}  // namespace dcplan::cli
