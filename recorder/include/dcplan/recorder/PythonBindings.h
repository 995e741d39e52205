// The recorder's part of dcplan._C: bound from replayer/python/Module.cpp.
#pragma once

#include "dcplan/replayer/Transport.h"

#include <memory>

namespace pybind11 {
class module_;
}

namespace dcplan::recorder {

/// Adds the record_* functions to the module (see python/dcplan/_record.py).
void bindRecorder(pybind11::module_& m);

/// The transport the runtime should run on: `transport` itself, or, when
/// record_begin() armed a recorder, a timing wrapper that reports to it.
std::shared_ptr<replayer::Transport> transportForRuntime(std::shared_ptr<replayer::Transport> transport);

}  // namespace dcplan::recorder
