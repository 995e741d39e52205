// Hooks through which a recorder sees every dc op the executor runs.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace dcplan::replayer {

/// One dc op as the executor sees it. bytes is the size of the data the op
/// moves: for allgather_param / prefetch_params_fused what is received
/// (padded; 0 when a held copy serves the op), for reduce_grad the gradient,
/// for the offload ops the tensor; 0 when none.
struct OpEvent {
  /// The op's name: a string literal, which observers and schedules may keep and key on.
  const char* op = "";
  int64_t graphId = -1;
  int64_t dsId = -1;
  int64_t bytes = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  /// prefetch_params_fused: the ids as issued (dsId is -1 then); valid only
  /// during the callback.
  c10::ArrayRef<int64_t> dsIds = {};
  /// release_param: the n_users argument; 0 for other ops.
  int64_t nUsers = 0;
};

/// Called by the executor around every op; the default does nothing.
/// The recorder (trace capture) implements this.
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  virtual void onOpBegin(const OpEvent& event) {}
  virtual void onOpEnd(const OpEvent& event) {}
  /// start_forward() was called.
  virtual void onStartForward() {}
  /// start_backward() was called; sync marks the micro-step that ends an
  /// optimizer step (the gradient-accumulation boundary).
  virtual void onStartBackward(bool update, bool sync) {}
};

}  // namespace dcplan::replayer
