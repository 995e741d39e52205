// Merging the per-rank traces of one recorded run into one trace.
#pragma once

#include <string>
#include <vector>

#include "dcplan/schemas/trace.h"

namespace dcplan::schemas {

struct RankTrace {
  int64_t rank = 0;
  std::string file;  ///< where it was read from, for errors
  Trace trace;
};

/// Checks that the ranks of one run agree — the same ranks 0..world_size-1, meta,
/// parameter table, steps, graphs and op sequences — and merges them: rank 0's
/// structure with every time (start, end, compute, optimizer, calibration) and memory
/// figure taken as the maximum over ranks, and of the saved activations those every rank saved alike,
/// gone by the latest op and read by the earliest. Throws InputError naming the file of the
/// first rank that disagrees, the JSON pointer and both ranks' values.
Trace mergeRankTraces(const std::vector<RankTrace>& ranks);

/// "allgather_param(ds_id 3)", "prefetch_params_fused(ds_ids 1,2)", "end_backward()".
std::string describeOp(const OpEvent& event);

}  // namespace dcplan::schemas
