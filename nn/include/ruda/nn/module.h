// Modules and parameters.
//
// A Param is a shared handle to one trainable tensor with a stable ParamId: copying the handle
// ties weights (one id, one storage, one gradient). A Module exposes its parameters by dotted name
// ("blocks.2.mlp.fc1.weight"), recursively; a parameter reachable twice is listed once, under the
// first name. A parameter may be sharded (<ruda/nn/sharded.h>): then its data is this rank's 1-D
// slice and value() gathers the full tensor.
//
// A parameter made from an Initializer while a DeferredInit is alive on the thread is deferred:
// it knows its shape, dtype and initializer but holds no values, so a model of any size can be
// built without allocating it. fully_shard then materializes only each rank's slice; materialize()
// makes a module dense.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ruda/nn/init.h>
#include <ruda/tensor.h>
#include <ruda/thread_flag.h>

namespace ruda {
class Communicator;  // <ruda/collectives.h>
}

namespace ruda::nn {

using ParamId = std::uint64_t;

struct ShardInfo;    // <ruda/nn/sharded.h>
struct ShardPolicy;  // <ruda/nn/sharded.h>
class Module;

class Param {
 public:
  Param() = default;
  /// A new parameter (a new id) holding `value`'s storage as a leaf of its own that requires
  /// grad (floats only); `value` itself is left as it was. A non-contiguous view is copied: a
  /// parameter's values are contiguous (optimizers, collectives and checkpoints read its bytes).
  explicit Param(const Tensor& value);
  /// A parameter with a given id: how a checkpoint or a shard keeps an identity.
  Param(const Tensor& value, ParamId id);
  /// A new parameter of `shape` and floating `dtype` initialized by `init`: deferred (no values
  /// yet) while a DeferredInit is alive on this thread, materialized at once otherwise.
  Param(const Shape& shape, Initializer init, DType dtype = DType::f32);

  bool defined() const noexcept { return state_ != nullptr; }
  ParamId id() const;
  /// The stored leaf: the full tensor, or this rank's local slice when sharded. Optimizers update it in place.
  Tensor& data() const;
  Tensor grad() const;
  void zero_grad() const;
  /// The full logical value to compute with (differentiable): the leaf itself, or the gathered
  /// tensor when sharded (through the bound communicator and the shard policy).
  Tensor value() const;
  /// The logical shape (of the full tensor even when sharded or deferred).
  const Shape& shape() const;
  DType dtype() const;
  /// Built under DeferredInit and not materialized yet: no data, only shape, dtype and initializer.
  bool is_deferred() const;
  /// The initializer of a deferred parameter (ArgumentError otherwise).
  const Initializer& initializer() const;
  /// Gives a deferred parameter its full dense value (same id); does nothing otherwise.
  void materialize() const;
  bool is_sharded() const;
  /// Sharding metadata, or null for a dense parameter.
  const std::shared_ptr<ShardInfo>& shard() const;
  void set_shard(std::shared_ptr<ShardInfo> info) const;
  /// Replaces the stored values (same id), e.g. with loaded ones or another floating dtype: a new
  /// leaf sharing `value`'s storage. The shape must stay what it is (the local slice's for a
  /// sharded parameter, the declared one for a deferred one): ShapeError otherwise, since the
  /// module that owns the parameter was built for that shape. A graph recorded on the old values
  /// and differentiated afterwards raises AutogradError in backward (its gradient would go to the
  /// old tensor, which the parameter no longer holds): run the forward again after set_data. A
  /// frozen parameter (its data's requires_grad off) stays frozen.
  void set_data(const Tensor& value) const;
  /// Whether two handles are the same parameter.
  bool same(const Param& other) const noexcept { return state_ == other.state_; }

  struct State;

 private:
  friend class ShardedParameter;
  friend struct ParamAccess;  // nn's internals (param_state.h)
  // set_data without the shape check, for sharding (full -> slice) and materialization. The old
  // data is retired (autograd::retire_leaf) with `why_old_retired`: a graph recorded on it before
  // the swap fails in backward instead of losing the parameter's gradient.
  void replace_data(const Tensor& value, std::string_view why_old_retired) const;
  explicit Param(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

/// A fresh process-unique parameter id.
ParamId next_param_id();

/// While alive, parameters made from initializers on this thread are deferred: a model built in
/// this scope allocates none of its parameters (construct it, then fully_shard or materialize).
/// Param(const Tensor&) in this scope is an ArgumentError, since its tensor is already whole.
/// DeferredInit::active() tells whether one is alive on this thread.
class DeferredInit : public ThreadFlagScope<DeferredInit> {};

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// Parameters by dotted name, depth first in registration order; each parameter once.
  std::vector<std::pair<std::string, Param>> named_parameters() const;
  std::vector<Param> parameters() const;
  /// Submodules by dotted name (this module first, as ""), depth first in registration order; a
  /// submodule reachable twice (shared by two parents) is listed once, under its first name, as
  /// PyTorch's named_modules(). ArgumentError when a module contains itself (a member assigned
  /// one of its ancestors after registration).
  std::vector<std::pair<std::string, Module*>> named_modules();
  std::vector<std::pair<std::string, const Module*>> named_modules() const;
  /// Training mode (dropout active) for this module and its children.
  void train(bool on = true);
  void eval() { train(false); }
  /// (Inside nn::checkpoint's recompute, on that thread: the flag the checkpointed forward saw.)
  bool is_training() const noexcept;
  void zero_grad() const;
  /// Total elements of the logical parameters (each tied parameter once).
  std::int64_t parameter_count() const;
  /// Gives every deferred parameter its full dense value (for a model that is not sharded).
  void materialize() const;
  /// Expires when this module is destroyed: recorded work that calls back into the module later
  /// (checkpoint's recompute) checks it instead of reaching a freed module.
  std::weak_ptr<const void> lifetime() const noexcept { return alive_; }

 protected:
  /// Registers a Param member under `name`. The member is read at traversal time, so assigning
  /// another Param to it later (tying) is seen. The module keeps the pointer: the Param must stay
  /// at its address for the module's lifetime (a member, or an element of a std::deque or
  /// std::list that only grows at its ends; not a std::vector that may reallocate as it grows,
  /// whose earlier elements' pointers then dangle).
  void register_parameter(std::string name, Param* param);
  /// Registers a child module under `name`; the module keeps this child as it is (a child it
  /// does not expose to be replaced).
  void register_module(std::string name, std::shared_ptr<Module> child);
  /// Registers a shared_ptr member under `name`, read at traversal time as register_parameter's
  /// members are: assigning another module to it later (replacing a layer, `model.fc1 = ...` in
  /// PyTorch) is what parameters(), optimizers built afterwards, fully_shard, checkpoints and
  /// train() see, as forward does; a member that is null is skipped. The member must stay at its
  /// address for the module's lifetime (a data member).
  template <class M>
  void register_module(std::string name, std::shared_ptr<M>* member) {
    static_assert(std::is_base_of_v<Module, M>, "register_module: the member must point to a Module");
    register_slot(std::move(name), member ? ChildList([member](const std::string& as, ChildModules& out) {
                    if (*member) out.emplace_back(as, member->get());
                  })
                                          : ChildList());
  }
  /// Registers a vector member of modules as `name`.0, `name`.1, ..., read at traversal time:
  /// elements pushed, popped or replaced later are seen (null elements are skipped).
  template <class M>
  void register_modules(std::string name, std::vector<std::shared_ptr<M>>* members) {
    static_assert(std::is_base_of_v<Module, M>, "register_modules: the elements must point to Modules");
    register_slot(std::move(name), members ? ChildList([members](const std::string& as, ChildModules& out) {
                    for (std::size_t i = 0; i < members->size(); ++i) {
                      if ((*members)[i]) out.emplace_back(as + "." + std::to_string(i), (*members)[i].get());
                    }
                  })
                                           : ChildList());
  }

 private:
  using ChildModules = std::vector<std::pair<std::string, Module*>>;
  // Appends what a registered slot holds now, named from the slot's name.
  using ChildList = std::function<void(const std::string& name, ChildModules& out)>;
  void register_slot(std::string name, ChildList list);
  // The children as the slots hold them now.
  ChildModules children() const;
  // Appends this module and the ones below it not `listed` yet; `stack` holds the path's modules.
  void list_modules(const std::string& path, std::vector<const Module*>& stack,
                    std::unordered_set<const Module*>& listed,
                    std::vector<std::pair<std::string, const Module*>>& out) const;
  std::vector<std::pair<std::string, Param*>> params_;
  std::vector<std::pair<std::string, ChildList>> children_;
  bool training_ = true;
  std::shared_ptr<const void> alive_ = std::make_shared<char>();
};

/// A module mapping one tensor to one tensor: what Sequential chains.
class UnaryModule : public Module {
 public:
  virtual Tensor forward(const Tensor& input) = 0;
  Tensor operator()(const Tensor& input) { return forward(input); }
};

class Sequential : public UnaryModule {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<UnaryModule>> layers);
  /// Appends a layer, registered as its index ("0", "1", ...).
  void push_back(std::shared_ptr<UnaryModule> layer);
  Tensor forward(const Tensor& input) override;
  std::size_t size() const noexcept { return layers_.size(); }
  /// Layer i; IndexError past the last.
  const std::shared_ptr<UnaryModule>& operator[](std::size_t i) const;

 private:
  std::vector<std::shared_ptr<UnaryModule>> layers_;
};

}  // namespace ruda::nn

namespace ruda {
RUDA_DECLARE_THREAD_FLAG(nn::DeferredInit)
}  // namespace ruda
