// Checks and walks over gradients shared by the optimizers, the gradient norms and the loss scaler
// (private to nn).
#pragma once

#include <functional>

#include <ruda/collectives.h>
#include <ruda/nn/module.h>

namespace ruda::nn {

/// ShardingError naming `op` for a hybrid-sharded gradient that sums one node's ranks only (every
/// backward since the last step ran with set_requires_all_reduce(false)): stepped on, measured or
/// checked for infinities, each node would act on its own partial sum and the replicas part.
void require_complete_gradient(const Param& p, const char* op);

/// The communicator the ranks combine sharded parameter `p`'s gradient figures over (its norm's
/// squares, whether it holds an inf): its own (fully_shard's; under hybrid sharding the node's,
/// whose shards make one replica), else the caller's `comm`, which must be the one it is sharded
/// over. ShardingError naming `op` when it has neither (`what`: what the communicator is for, "to
/// sum their norms over") or its own was destroyed.
Communicator& gradient_communicator(const Param& p, Communicator* comm, const char* op, const char* what);

/// Calls `visit` on consecutive 1-D blocks of `values` (at most 2^16 elements each) until it
/// returns false, and returns whether it never did. Work on a block's copy (a cast, a product)
/// then needs 1 MiB at most beside the step, not a whole gradient's worth, which the memory plan
/// does not count.
bool for_each_block(const Tensor& values, const std::function<bool(const Tensor&)>& visit);

}  // namespace ruda::nn
