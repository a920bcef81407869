// Checks on gradients shared by the optimizers, the gradient norms and the loss scaler (private to nn).
#pragma once

#include <ruda/nn/module.h>

namespace ruda::nn {

/// ShardingError naming `op` for a hybrid-sharded gradient that sums one node's ranks only (every
/// backward since the last step ran with set_requires_all_reduce(false)): stepped on, measured or
/// checked for infinities, each node would act on its own partial sum and the replicas part.
void require_complete_gradient(const Param& p, const char* op);

}  // namespace ruda::nn
