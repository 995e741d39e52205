// The text summary of a trace, shared by `inspect` and `record`.
#pragma once

#include <cstddef>
#include <ostream>
#include <string>

#include "dcplan/schemas/trace.h"

namespace dcplan::cli {

void printTraceSummary(std::ostream& out, const std::string& file, const schemas::Trace& trace,
                       size_t topOps);

}  // namespace dcplan::cli
