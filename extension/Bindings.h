// dcplan._C, the extension module that joins the replayer and the recorder: one bind* per area,
// called from Module.cpp (as PyTorch's init*Bindings are).
#pragma once

#include "dcplan/replayer/Transport.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>

namespace dcplan::extension {

/// Runtime lifecycle (init, init_nccl, cleanup), parameter and graph registration, the op log.
void bindRuntime(pybind11::module_& m);

/// Plan replay: loading a plan against the live model, the replay log.
void bindPlan(pybind11::module_& m);

/// The ShardHooks class: the per-parameter work of python/dcplan/_shard.py's hooks.
void bindShardHooks(pybind11::module_& m);

/// The record_* functions (python/dcplan/_record.py) and the memory probes of the replay log.
void bindRecorder(pybind11::module_& m);

/// The transport the runtime should run on: `transport` itself, or, when record_begin() armed a
/// recorder, a timing wrapper that reports to it.
std::shared_ptr<replayer::Transport> transportForRuntime(std::shared_ptr<replayer::Transport> transport);

/// A torch.dtype argument, or none for None; TypeError-like error naming `what` otherwise.
std::optional<at::ScalarType> optionalDtype(const pybind11::object& obj, const char* what);

}  // namespace dcplan::extension
