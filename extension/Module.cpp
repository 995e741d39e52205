// dcplan._C: the Python binding of the dc runtime and its recorder (the ops are torch.ops.dc.*).
#include "Bindings.h"

#include "dcplan/schemas/plan.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "dcplan runtime: lifecycle and registration of the dc op set (torch.ops.dc.*)";
  // The runtime's bucket size when no plan sets one; the planner's default schedule assumes it.
  m.attr("DEFAULT_BUCKET_BYTES") = dcplan::schemas::kDefaultBucketBytes;
  dcplan::extension::bindRuntime(m);
  dcplan::extension::bindPlan(m);
  dcplan::extension::bindShardHooks(m);  // the per-parameter work of python/dcplan/_shard.py's hooks
  dcplan::extension::bindRecorder(m);    // record_*: python/dcplan/_record.py
}
