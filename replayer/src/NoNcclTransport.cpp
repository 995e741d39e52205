// The NCCL transport's entry points in a build without CUDA: they say so.
#include "dcplan/replayer/Transport.h"

#include <c10/util/Exception.h>

namespace dcplan::replayer {

bool hasNcclTransport() { return false; }

std::string makeNcclUniqueId() {
  TORCH_CHECK(false,
              "nccl_unique_id: dcplan was built without CUDA (configure with -DDCPLAN_WITH_CUDA=ON, "
              "or the cuda preset)");
}

std::shared_ptr<Transport> makeNcclTransport(const std::string&, int, int, int, std::chrono::milliseconds) {
  TORCH_CHECK(false,
              "init_nccl: dcplan was built without CUDA (configure with -DDCPLAN_WITH_CUDA=ON, "
              "or the cuda preset)");
}

}  // namespace dcplan::replayer
