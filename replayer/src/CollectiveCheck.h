// A Transport decorator that makes the ranks agree on each collective before it is launched.
#pragma once

#include "dcplan/replayer/Transport.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

namespace dcplan::replayer {

/// Where the runtime is when it launches a collective: the dc op and its place in the step.
struct OpPlace {
  const char* op = "";  // a dc op's name (static), "" outside an op: set on every op, so no copy
  int64_t id = -1;
  int64_t graphId = -1;
  int64_t step = -1;
  int64_t position = -1;
  bool backward = false;
};

/// Thrown on every rank when the ranks would launch different collectives.
class CollectiveMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Before each collective of inner, the ranks all-gather a fixed-size description of it (what
/// it is, its element counts and dtypes, and the op and place that launch it) and compare: ranks
/// that would launch different collectives (rank-dependent control flow, a rank that took
/// another branch) fail there, every one of them, with an error naming its own op and the first
/// other rank's, instead of a collective of mismatched sizes (which aborts Gloo's I/O thread) or
/// of equal sizes and wrong data. The check is fixed-size, so it never mismatches itself; it
/// costs one small all-gather per collective. where() is called under the runtime's lock.
std::shared_ptr<Transport> makeCheckedTransport(std::shared_ptr<Transport> inner,
                                                std::function<OpPlace()> where);

}  // namespace dcplan::replayer
