// The shared state behind Param handles (private to nn).
#pragma once

#include <memory>

#include <ruda/nn/module.h>

namespace ruda::nn {

struct Param::State {
  ParamId id = 0;
  Tensor data;
  std::shared_ptr<ShardInfo> shard;
  // The shard ShardedParameter::from_full made of this dense parameter, so that converting a
  // tied weight once per layer still yields one local storage (and one gradient).
  std::weak_ptr<State> shard_of_this;
  int shard_rank = -1, shard_world = 0;
};

}  // namespace ruda::nn
