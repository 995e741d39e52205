// dcplan._C.ShardHooks: the per-parameter work of dcplan.shard()'s module and saved-tensor hooks, in C++.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace dcplan::replayer {

/// Adds the ShardHooks class to module m.
void bindShardHooks(pybind11::module& m);

}  // namespace dcplan::replayer
