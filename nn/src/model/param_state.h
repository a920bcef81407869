// The shared state behind Param handles (private to nn).
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include <ruda/nn/module.h>

namespace ruda::nn {

struct Param::State {
  ParamId id = 0;
  Tensor data;
  // A deferred parameter (no data yet): its initializer, logical shape and dtype.
  std::shared_ptr<const Initializer> deferred;
  Shape deferred_shape;
  DType deferred_dtype = DType::f32;
  std::shared_ptr<ShardInfo> shard;
  // The shards ShardedParameter::from_full made of this dense parameter, one per (rank, world
  // size), so that converting a tied weight once per layer still yields one local storage (and
  // one gradient). Emulated ranks convert one shared model from several threads: guarded by
  // shards_mutex().
  struct Derived {
    int rank, world_size;
    std::weak_ptr<State> shard;
  };
  std::vector<Derived> shards_of_this;
};

std::mutex& shards_mutex();

/// What nn's internals may do with a Param handle beyond its public interface.
struct ParamAccess {
  static std::weak_ptr<Param::State> weak(const Param& p) { return p.state_; }
  /// The parameter behind a weak reference, or an undefined Param if it is gone.
  static Param lock(const std::weak_ptr<Param::State>& state) { return Param(state.lock()); }
  /// Param::set_data without its shape check: sharding (full -> slice).
  static void replace_data(const Param& p, const Tensor& value, std::string_view why_old_retired) {
    p.replace_data(value, why_old_retired);
  }
};

}  // namespace ruda::nn
