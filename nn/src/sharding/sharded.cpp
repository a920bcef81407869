// Sharded parameters: slicing, validation, the differentiable gather and fully_shard.
#include <algorithm>
#include <limits>
#include <map>
#include <unordered_map>

#include <ruda/autograd.h>
#include <ruda/nn/layers.h>
#include <ruda/nn/sharded.h>

#include "model/layer_inputs.h"
#include "model/param_state.h"
#include "sharding/gather_scope.h"
#include "sharding/param_value.h"
#include "sharding/shard_group.h"

namespace ruda::nn {

std::mutex& shards_mutex() {
  static std::mutex m;
  return m;
}

const Shape& sharded_logical_shape(const ShardInfo& info) { return info.logical_shape; }

Tensor sharded_value(const Param& param, const ShardInfo& info) {
  if (!info.comm) {
    fail<ShardingError>("Param::value", info.describe(),
                        " is sharded but bound to no communicator (use fully_shard, or gather it with a communicator)");
  }
  if (info.comm_alive.expired()) {
    fail<ShardingError>("Param::value", info.describe(),
                        " is bound to a communicator that was destroyed (keep it alive while the model is used)");
  }
  if (info.group) return info.group->value(info.group_index);
  return gather_param(param, *info.comm);
}

std::string ShardInfo::describe() const {
  return (name.empty() ? std::string("an unnamed parameter ") : "parameter '" + name + "' ") + to_string(logical_shape);
}

void ShardInfo::require_communicator(const char* op, const Communicator& comm) const {
  if (comm.rank() != rank || comm.world_size() != world_size) {
    fail<ShardingError>(op, "communicator is rank ", comm.rank(), " of ", comm.world_size(), " but ", describe(),
                        " is shard ", rank, " of ", world_size);
  }
}

ShardInfo ShardInfo::layout(const Shape& logical_shape, int rank, int world_size) {
  // Public, and every sharding path's arithmetic: a world of 0 divided by zero here.
  if (world_size <= 0) fail<ShardingError>("ShardInfo::layout", "world size must be positive, got ", world_size);
  if (rank < 0 || rank >= world_size) {
    fail<ShardingError>("ShardInfo::layout", "rank ", rank, " is outside world size ", world_size);
  }
  ShardInfo info;
  info.logical_shape = logical_shape;
  info.numel = shape_numel(logical_shape, "ShardInfo::layout");
  // Rounded up without numel + world - 1, which overflows for a numel near INT64_MAX.
  info.shard_size = info.numel / world_size + (info.numel % world_size != 0 ? 1 : 0);
  info.rank = rank;
  info.world_size = world_size;
  return info;
}

std::int64_t ShardInfo::real_elements() const {
  const std::int64_t start = offset();
  return std::max<std::int64_t>(0, std::min(numel, start + shard_size) - start);
}

namespace {

void check_topology(const char* op, int rank, int world_size) {
  if (world_size <= 0) fail<ShardingError>(op, "world size must be positive, got ", world_size);
  if (rank < 0 || rank >= world_size) fail<ShardingError>(op, "rank ", rank, " is outside world size ", world_size);
}

std::int64_t checked_numel(const char* op, const Shape& shape, const std::string& name = {}) {
  const std::string of = name.empty() ? std::string() : "parameter '" + name + "': ";
  if (shape.empty()) fail<ShardingError>(op, of, "logical shape must have at least one dimension, got []");
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (d <= 0) fail<ShardingError>(op, of, "every logical extent must be positive, got ", shape);
    if (n > std::numeric_limits<std::int64_t>::max() / d)
      fail<ShardingError>(op, of, "logical shape ", shape, " overflows");
    n *= d;
  }
  return n;
}

void check_storage_dtype(const char* op, const Tensor& t) {
  if (!is_floating(t.dtype())) {
    fail<DTypeError>(op, "floating parameter storage required (f32, f64, f16 or bf16), got ", dtype_name(t.dtype()),
                     " ", t.shape());
  }
}

std::shared_ptr<ShardInfo> make_info(const Shape& shape, int rank, int world_size) {
  return std::make_shared<ShardInfo>(ShardInfo::layout(shape, rank, world_size));
}

// This rank's zero-padded slice of a parameter, as a fresh tensor with no graph. A deferred
// parameter produces only this rank's elements from its initializer: no full tensor is made.
Tensor local_slice(const Param& param, const ShardInfo& info) {
  autograd::NoGradGuard guard;
  const std::int64_t real = info.real_elements(), begin = info.offset();
  if (param.is_deferred()) {
    const Initializer& init = param.initializer();
    const DType dtype = param.dtype();
    if (real == info.shard_size) return init.range(info.logical_shape, begin, begin + real, dtype);
    Tensor local = zeros({info.shard_size}, dtype);
    if (real > 0) local.slice(0, 0, real).copy_(init.range(info.logical_shape, begin, begin + real, dtype));
    return local;
  }
  const Tensor& full = param.data();
  Tensor local = zeros({info.shard_size}, Options(full.dtype(), &full.backend()));
  if (real > 0) local.slice(0, 0, real).copy_(full.reshape({-1}).slice(0, begin, begin + real));
  return local;
}

void check_param_dtype(const char* op, const Param& p) {
  if (!is_floating(p.dtype())) {
    fail<DTypeError>(op, "floating parameter storage required (f32, f64, f16 or bf16), got ", dtype_name(p.dtype()),
                     " ", p.shape());
  }
}

}  // namespace

ShardedParameter ShardedParameter::from_local(const Param& local, const Shape& logical_shape, int rank,
                                              int world_size) {
  const char* op = "ShardedParameter::from_local";
  if (!local.defined()) fail<ShardingError>(op, "local parameter is undefined");
  check_topology(op, rank, world_size);
  checked_numel(op, logical_shape);  // throws on a shape whose element count overflows
  const std::int64_t expected = ShardInfo::layout(logical_shape, rank, world_size).shard_size;
  const Tensor& data = local.data();
  if (data.shape() != Shape{expected}) {
    fail<ShardingError>(op, "local slice ", data.shape(), " differs from the [", expected, "] that ", logical_shape,
                        " needs at world size ", world_size);
  }
  check_storage_dtype(op, data);
  auto info = make_info(logical_shape, rank, world_size);
  if (local.is_sharded()) info->name = local.shard()->name;
  local.set_shard(std::move(info));
  return ShardedParameter(local);
}

ShardedParameter ShardedParameter::from_full(const Param& full, int rank, int world_size, const std::string& name) {
  const char* op = "ShardedParameter::from_full";
  if (!full.defined()) fail<ShardingError>(op, "parameter is undefined");
  check_topology(op, rank, world_size);
  if (full.is_sharded()) fail<ShardingError>(op, full.shard()->describe(), " is sharded already");
  Param::State& source = *full.state_;
  std::lock_guard lock(shards_mutex());
  for (const auto& d : source.shards_of_this) {
    if (d.rank != rank || d.world_size != world_size) continue;
    if (auto existing = d.shard.lock())
      return ShardedParameter(Param(existing));  // a tied weight again: the same shard
  }
  check_param_dtype(op, full);
  checked_numel(op, full.shape(), name);
  auto info = make_info(full.shape(), rank, world_size);
  // The slice is a new leaf with the same id; requires_grad as the source (a Param always has it).
  Param local(local_slice(full, *info), full.id());
  local.data().set_requires_grad(full.is_deferred() || full.data().requires_grad());
  info->name = name;
  local.set_shard(std::move(info));
  std::erase_if(source.shards_of_this,
                [&](const auto& d) { return d.shard.expired() || (d.rank == rank && d.world_size == world_size); });
  source.shards_of_this.push_back({rank, world_size, local.state_});
  return ShardedParameter(local);
}

namespace {

// The per-parameter path's answer to which parameters no rank's loss reached (a shard group's is
// ShardSchedule::drop_unreached_gradients): each gather node of a parameter registers it, and at
// the backward's end take_back_unreached runs once per communicator. A flag column in each
// reduce-scatter would have copied every full gradient (a weight's size of memory and traffic).
// Weak references: a backward that failed leaves its entries (its callback is dropped) without
// keeping a destroyed model's slices alive.
struct ReachedFlags {
  Communicator* comm = nullptr;
  std::weak_ptr<const void> alive;
  std::vector<ReachCandidate> params;  // one per parameter, in the order first gathered: alike on every rank
  std::unordered_map<const Param::State*, std::size_t> index;
};
thread_local std::vector<ReachedFlags> t_reached_flags;
thread_local std::uint64_t t_reached_serial = 0;

void settle_reached_flags() {
  autograd::NoGradGuard no_grad;
  std::vector<ReachedFlags> all;
  all.swap(t_reached_flags);
  for (const ReachedFlags& f : all) {
    if (f.alive.expired()) continue;  // destroyed alike on every rank
    take_back_unreached(f.params, *f.comm, nullptr, "sharded parameters: which ones the loss reached");
  }
}

// Called by a gather node's backward, before the engine adds its result to the parameter's gradient.
void register_reached(Communicator& comm, const std::weak_ptr<Param::State>& param) {
  const std::uint64_t now = autograd::backward_serial();
  if (t_reached_serial != now) {  // the first of this backward (a failed one dropped its callback)
    t_reached_serial = now;
    t_reached_flags.clear();
    autograd::at_backward_end(settle_reached_flags);
  }
  const std::shared_ptr<Param::State> state = param.lock();
  if (!state) return;  // destroyed alike on every rank
  auto f = std::find_if(t_reached_flags.begin(), t_reached_flags.end(),
                        [&](const ReachedFlags& flags) { return flags.comm == &comm; });
  if (f == t_reached_flags.end()) f = t_reached_flags.insert(f, ReachedFlags{&comm, comm.liveness(), {}, {}});
  // A tied weight's gathers are one parameter: reached by any of them; made by this backward when
  // it had no gradient before the first of them.
  const auto [at, fresh] = f->index.emplace(state.get(), f->params.size());
  if (fresh) f->params.push_back({param, false, !ParamAccess::lock(param).data().grad().defined()});
  if (autograd::reached()) f->params[at->second].reached = true;
}

// differentiable_all_gather, and with `param` (whose slice `local` is, or was cast from) the
// reached flags above.
Tensor gather_node(const Tensor& local, Communicator& comm, const CollectiveOptions& options,
                   std::weak_ptr<const void> owner, std::weak_ptr<Param::State> param) {
  Tensor full = comm.all_gather(local, options);
  if (autograd::needs_grad(local)) {
    // Held with its liveness: a communicator destroyed between forward and backward is a
    // ShardingError, not a call into freed memory (a segfault on the per-parameter path).
    const CommRef c(&comm);
    // Always-run: every rank reduce-scatters this gradient in every backward, with zeros where
    // its loss did not reach the gathered value, so no rank waits for a collective another skips.
    // A collective: its slice holds the other ranks' gradients, so it passes on even where this
    // rank's loss did not reach the node.
    autograd::record("all_gather", full, {local}, {},
                     [c, options, param](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
                       Communicator& live = c.get("backward", "the gather of '" + options.tag + "'");
                       if (!param.expired()) register_reached(live, param);
                       return std::vector<Tensor>{live.reduce_scatter(g, options)};
                     },
                     {.always_run = true, .collective = true, .owner = std::move(owner)});
  }
  return full;
}

}  // namespace

Tensor differentiable_all_gather(const Tensor& local, Communicator& comm, const CollectiveOptions& options,
                                 std::weak_ptr<const void> owner) {
  return gather_node(local, comm, options, std::move(owner), {});
}

// A compute dtype from outside (a policy, a gather's own): a float, or the weights would be truncated.
static void check_compute_dtype(DType dtype, const char* op) {
  check_enum<DTypeError>(dtype, op, "compute dtype");
  if (!is_floating(dtype)) fail<DTypeError>(op, "the compute dtype must be a float, got ", dtype_name(dtype));
}

Tensor gather_param(const Param& param, Communicator& comm, std::optional<DType> compute_dtype) {
  const char* op = "gather";
  if (compute_dtype) check_compute_dtype(*compute_dtype, op);
  if (!param.defined()) fail<ArgumentError>(op, "the parameter is undefined (a default-constructed Param)");
  if (!param.is_sharded()) fail<ShardingError>(op, "parameter is not sharded");
  const ShardInfo& info = *param.shard();
  info.require_communicator(op, comm);
  if (info.policy.gather_quantization != GatherQuantization::none) {
    // (A grouped one was told to group, which it was: say where its int8 gathers happen.)
    if (info.group) {
      fail<ShardingError>(op, info.describe(),
                          " is gathered in int8 by its shard group (Param::value(), as its module's forward does); "
                          "gather_param gathers one parameter alone, which int8 gathers do not");
    }
    fail<ShardingError>(op, info.describe(), ": an int8 gather needs grouped parameters (fully_shard with group)");
  }
  const Tensor& local = param.data();
  const DType dtype = compute_dtype.value_or(info.policy.compute_dtype.value_or(local.dtype()));
  const CollectiveOptions options{.tag = info.name, .accumulate = info.policy.reduce};
  const Tensor source = cast(local, dtype);
  // The parameter's shard info owns the nodes below: a model destroyed with some pending (a
  // forward that no backward followed) leaves none to run in a later, unrelated backward.
  const std::weak_ptr<const void> owner = param.shard();
  Tensor value = reshape(slice(gather_node(source, comm, options, owner, ParamAccess::weak(param)), 0, 0, info.numel),
                         info.logical_shape);
  if (info.policy.strategy == CheckpointStrategy::recompute && !RetainGathered::active() &&
      autograd::is_grad_enabled() && local.requires_grad()) {
    // Ops that save this value keep this recipe instead, and gather again in their backward.
    // A slice changed in place since (an optimizer step between forward and backward) would be
    // gathered as it is now: refused, as the dense backward refuses its saved weight's change.
    autograd::set_recompute(
        value,
        [shard = local.detach(), version = local.version(), name = info.describe(), c = CommRef(&comm), options, dtype,
         numel = info.numel, shape = info.logical_shape] {
          // Only where the loss reached the reading node (as ShardGroup::use's recompute checks).
          if (autograd::reached() && shard.version() != version) {
            fail<AutogradError>("backward", name, " was modified in place after the forward that used it (version ",
                                version, ", now ", shard.version(), "); its recomputed value would not be the ",
                                "forward's (backward first, or CheckpointStrategy::retain)");
          }
          return reshape(slice(c.get("backward", name).all_gather(cast(shard, dtype), options), 0, 0, numel), shape);
        },
        owner);
  }
  return value;
}

Tensor ShardedParameter::gather(Communicator& comm) const { return gather_param(param_, comm, param_.data().dtype()); }

Tensor ShardedParameter::gather_with_compute_dtype(Communicator& comm, DType dtype) const {
  check_compute_dtype(dtype, "gather_with_compute_dtype");
  return gather_param(param_, comm, dtype);
}

static void check_policy(const ShardPolicy& policy, const char* op) {
  check_enum(policy.strategy, op, "CheckpointStrategy");
  check_enum(policy.gather_quantization, op, "GatherQuantization");
  check_enum(policy.reduce, op, "Accumulate");
  if (policy.compute_dtype) check_compute_dtype(*policy.compute_dtype, op);
}

// The first setting in which `held` (an earlier call's) differs from `wanted`, as "what held, what
// wanted"; empty when they are the same. Not the strategy, which set_checkpoint_strategy (and
// fit_schedule) change after fully_shard: the same call again would then be refused.
static std::string policy_difference(const ShardPolicy& held, const ShardPolicy& wanted) {
  const auto dtype = [](const std::optional<DType>& d) {
    return d ? std::string(dtype_name(*d)) : std::string("none");
  };
  if (held.compute_dtype != wanted.compute_dtype) {
    return "compute dtype " + dtype(held.compute_dtype) + ", this call's " + dtype(wanted.compute_dtype);
  }
  const auto accumulate = [](Accumulate a) { return a == Accumulate::f32 ? "f32" : "native"; };
  if (held.reduce != wanted.reduce) {
    return std::string("reduce accumulation ") + accumulate(held.reduce) + ", this call's " + accumulate(wanted.reduce);
  }
  const auto quantization = [](GatherQuantization q) { return q == GatherQuantization::int8 ? "int8" : "none"; };
  if (held.gather_quantization != wanted.gather_quantization) {
    return std::string("gather quantization ") + quantization(held.gather_quantization) + ", this call's " +
           quantization(wanted.gather_quantization);
  }
  return {};
}

std::size_t fully_shard(Module& module, Communicator& comm, ShardPolicy policy) {
  return fully_shard(module, comm, FullyShardOptions{.policy = std::move(policy)});
}

static std::size_t shard_module(Module& module, Communicator& comm, const FullyShardOptions& options);

// The module's Dropouts draw rank `rank`'s part of their streams (Dropout::set_data_parallel).
static void split_dropout_streams(Module& module, int rank, int world) {
  for (const auto& [path, m] : module.named_modules()) {
    if (auto* dropout = dynamic_cast<Dropout*>(m)) dropout->set_data_parallel(rank, world);
  }
}

std::size_t fully_shard(Module& module, const ShardMesh& mesh, FullyShardOptions options) {
  if (options.replicate && options.replicate != &mesh.replicate()) {
    fail<ShardingError>("fully_shard", "the options name a replicate communicator other than the mesh's own");
  }
  options.replicate = &mesh.replicate();
  const std::size_t sharded = shard_module(module, mesh.shard(), options);
  split_dropout_streams(module, mesh.world().rank(), mesh.world().world_size());  // every rank has its own samples
  return sharded;
}

std::size_t fully_shard(Module& module, Communicator& comm, const FullyShardOptions& options) {
  // Only a ShardMesh has checked that its two communicators tile the world. Any other pair (the
  // world as the replicate communicator of a node's shards, or the reverse) summed each gradient
  // over ranks that hold other shards of it, and trained on wrong gradients without an error.
  if (options.replicate) {
    fail<ShardingError>("fully_shard", "a replicate communicator is given through fully_shard(module, mesh, ",
                        "options), whose ShardMesh checks that it and the shard communicator tile the world ", "(rank ",
                        comm.rank(), " of ", comm.world_size(), " here)");
  }
  const std::size_t sharded = shard_module(module, comm, options);
  split_dropout_streams(module, comm.rank(), comm.world_size());
  return sharded;
}

static std::size_t shard_module(Module& module, Communicator& comm, const FullyShardOptions& options) {
  const char* op = "fully_shard";
  check_policy(options.policy, op);
  if (options.policy.gather_quantization != GatherQuantization::none && !options.group) {
    fail<ShardingError>(op, "an int8 gather needs grouped parameters (group = true)");
  }
  if (options.replicate && !options.group) {
    fail<ShardingError>(op, "hybrid sharding (a replicate communicator) needs grouped parameters (group = true)");
  }
  check_enum(options.overlap, op, "Overlap");
  if (options.max_unsharded_groups < 1)
    fail<ArgumentError>(op, "max_unsharded_groups must be at least 1, got ", options.max_unsharded_groups);
  // Everything that can fail (the checks, each slice's allocation) runs before any parameter
  // changes: a refused call leaves the module as it was, not half sliced and unrecoverable.
  struct Planned {
    Param param;
    std::shared_ptr<ShardInfo> info;
    Tensor slice;
    bool requires_grad = false;
  };
  std::vector<Planned> planned;
  std::vector<std::pair<Param, std::string>> renamed;  // sharded by an earlier call on a submodule
  std::vector<std::shared_ptr<ShardGroup>> inner;      // groups of earlier calls on submodules
  // A parameter an earlier call on this same module sharded with another policy (first found).
  std::string resharded, difference;
  for (auto& [name, param] : module.named_parameters()) {
    if (param.is_sharded()) {
      const auto& held = param.shard()->group;
      if (difference.empty() && param.shard()->sharded_by == &module) {
        difference = policy_difference(param.shard()->policy, options.policy);
        if (!difference.empty()) resharded = name;
      }
      if (!options.group) {
        // Per parameter, bottom-up as with groups: what an earlier call on a submodule sharded
        // stays as it is, renamed relative to this module (once every check has passed).
        if (held) {
          fail<ShardingError>(op, "parameter '", name, "' is sharded in a group already; shard a model's modules ",
                              "all in groups or all per parameter");
        }
        if (param.shard()->comm != &comm)
          fail<ShardingError>(op, "parameter '", name, "' is sharded over another communicator already");
        renamed.emplace_back(param, name);
        continue;
      }
      if (!held) {
        fail<ShardingError>(op, "parameter '", name, "' is sharded per parameter already; shard a model's modules ",
                            "all in groups or all per parameter");
      }
      if (held->comm() != &comm)
        fail<ShardingError>(op, "parameter '", name, "' is sharded over another communicator already");
      if (held->replicate() != options.replicate) {
        fail<ShardingError>(op, "parameter '", name, "' is ",
                            held->replicate() ? "replicated over another communicator" : "fully sharded",
                            " already; shard a model's modules all hybrid or all full");
      }
      renamed.emplace_back(param, name);
      if (std::find(inner.begin(), inner.end(), held) == inner.end()) inner.push_back(held);
      continue;
    }
    check_param_dtype(op, param);
    checked_numel(op, param.shape(), name);
    auto info = make_info(param.shape(), comm.rank(), comm.world_size());
    info->policy = options.policy;
    info->comm = &comm;
    info->comm_alive = comm.liveness();
    info->replicate = options.replicate;
    info->name = name;
    info->sharded_by = &module;
    Tensor slice = local_slice(param, *info);
    // A frozen parameter stays frozen.
    const bool requires_grad = param.is_deferred() || param.data().requires_grad();
    planned.push_back({param, std::move(info), std::move(slice), requires_grad});
  }
  // Called again on a sharded module with another policy, a call shards nothing and changed
  // nothing, silently (a bf16 compute dtype given to a model sharded in f32 kept computing in f32).
  if (planned.empty() && !difference.empty()) {
    fail<ShardingError>(op, "shards no parameter: '", resharded,
                        "' and the module's others are sharded already, by an earlier call with another policy (",
                        difference, "); a policy applies to the parameters its call shards. Shard a fresh model ",
                        "with it");
  }
  for (auto& [param, name] : renamed) param.shard()->name = name;  // named from the enclosing module from now on
  std::vector<Param> fresh;
  for (Planned& p : planned) {
    // In place: the module's members (and every tied use) see the same Param, now a slice.
    ParamAccess::replace_data(p.param, std::move(p.slice),
                              detail::concat("fully_shard sharded parameter '", p.info->name, "' (",
                                             dtype_name(p.param.dtype()), " ", p.param.shape(),
                                             ") after the forward that recorded this graph used it whole: its "
                                             "gradient would go to the whole tensor, which the parameter no "
                                             "longer holds. Run the forward again after fully_shard"));
    p.param.data().set_requires_grad(p.requires_grad);
    p.param.set_shard(std::move(p.info));
    fresh.push_back(p.param);
  }
  if (!options.group) return fresh.size();

  // One schedule for this module's group and every group under it.
  std::shared_ptr<ShardSchedule> schedule =
      inner.empty() ? std::make_shared<ShardSchedule>(comm, options) : inner.front()->schedule();
  schedule->set_options(options);
  for (const auto& g : inner) {
    g->rename();
    if (g->schedule() == schedule) continue;
    const std::shared_ptr<ShardSchedule> other = g->schedule();
    for (ShardGroup* moved : std::vector<ShardGroup*>(other->groups())) {
      other->remove(moved);
      moved->join(schedule);
      schedule->add(moved);
    }
  }
  if (fresh.empty()) return 0;
  auto group = std::make_shared<ShardGroup>(&module, fresh, comm, options.replicate, schedule);
  for (std::size_t i = 0; i < fresh.size(); ++i) {
    fresh[i].shard()->group = group;
    fresh[i].shard()->group_index = i;
  }
  for (const auto& g : inner) {
    std::shared_ptr<ShardGroup> top = g;
    while (std::shared_ptr<ShardGroup> up = top->parent()) top = std::move(up);
    if (top != group) top->set_parent(group);
  }
  return fresh.size();
}

void reshard(const Module& module) {
  for (const auto& [name, p] : module.named_parameters()) {
    if (p.is_sharded() && p.shard()->group) {
      p.shard()->group->schedule()->reshard_all();
      return;
    }
  }
}

OverlapReport overlap_report(const Module& module) {
  for (const auto& [name, p] : module.named_parameters()) {
    if (p.is_sharded() && p.shard()->group) return p.shard()->group->schedule()->overlap();
  }
  return {};
}

bool any_sharded(const Module& module, bool in_groups) {
  for (const auto& [name, p] : module.named_parameters()) {
    if (p.is_sharded() && (!in_groups || p.shard()->group)) return true;
  }
  return false;
}

namespace {
// The setters below change what fully_shard set up. On a module it never sharded (or, for the
// group settings, never sharded in groups) they had nothing to change and said nothing, so a
// setting meant for the model went nowhere; PyTorch's are methods of FSDPModule alone.
// (set_requires_all_reduce is documented as no effect without hybrid sharding, dense included.)
void require_sharded(const Module& module, const char* op, bool in_groups) {
  if (any_sharded(module, in_groups)) return;
  fail<ShardingError>(op, "the module has no ", in_groups ? "parameter sharded in a group" : "sharded parameter",
                      ", so there is nothing to set: call it after fully_shard",
                      in_groups ? " (in groups, its default; per-parameter sharding has no schedule)" : "");
}
}  // namespace

void set_max_unsharded_groups(const Module& module, int groups) {
  if (groups < 1) fail<ArgumentError>("set_max_unsharded_groups", "must be at least 1, got ", groups);
  require_sharded(module, "set_max_unsharded_groups", true);
  for (const auto& [name, p] : module.named_parameters()) {
    if (p.is_sharded() && p.shard()->group) {
      const auto& schedule = p.shard()->group->schedule();
      schedule->reshard_all();
      schedule->set_max_unsharded(groups);
      return;
    }
  }
}

void set_checkpoint_strategy(const Module& module, CheckpointStrategy strategy) {
  check_enum(strategy, "set_checkpoint_strategy", "CheckpointStrategy");
  require_sharded(module, "set_checkpoint_strategy", false);
  for (const auto& [name, p] : module.named_parameters()) {
    if (p.is_sharded()) p.shard()->policy.strategy = strategy;
  }
}

void set_requires_all_reduce(const Module& module, bool required) {
  // Every schedule the module's parameters are in (a module may hold several roots).
  for (const auto& [name, p] : module.named_parameters()) {
    if (p.is_sharded() && p.shard()->group) p.shard()->group->schedule()->set_requires_all_reduce(required);
  }
}

void set_forward_order(const std::vector<const Module*>& modules) {
  const char* op = "set_forward_order";
  std::vector<ShardGroup*> order;
  std::shared_ptr<ShardSchedule> schedule;
  for (const Module* m : modules) {
    if (!m) fail<ArgumentError>(op, "a module is null");
    ShardGroup* found = nullptr;
    for (const auto& [name, p] : m->named_parameters()) {
      if (p.is_sharded() && p.shard()->group && p.shard()->group->module() == m) found = p.shard()->group.get();
    }
    if (!found)
      fail<ShardingError>(op, "module ", order.size(),
                          " of the order has no group of its own: give it to fully_shard first");
    if (schedule && found->schedule() != schedule)
      fail<ShardingError>(op, found->tag(), " is in another schedule: shard the modules under one root");
    schedule = found->schedule();
    order.push_back(found);
  }
  if (schedule) schedule->set_forward_order(std::move(order));
}

// --- seed-style layers ---

namespace {
Param shard_member(const Param& full, int rank, int world_size, const ShardPolicy& policy, const std::string& layer,
                   const char* member) {
  check_policy(policy, "from_full");
  Param local =
      ShardedParameter::from_full(full, rank, world_size, layer.empty() ? member : layer + "." + member).param();
  local.shard()->policy = policy;
  return local;
}
}  // namespace

std::shared_ptr<FullyShardedLinear> FullyShardedLinear::from_full(const Linear& layer, int rank, int world_size,
                                                                  ShardPolicy policy, const std::string& name) {
  auto out = std::make_shared<FullyShardedLinear>();
  out->weight_ = shard_member(layer.weight, rank, world_size, policy, name, "weight");
  out->register_parameter("weight", &out->weight_);
  if (layer.bias.defined()) {
    out->bias_ = shard_member(layer.bias, rank, world_size, policy, name, "bias");
    out->register_parameter("bias", &out->bias_);
  }
  return out;
}

Tensor FullyShardedLinear::forward(const Tensor& x, Communicator& comm) const {
  layer_inputs::require_float_input("FullyShardedLinear", x);  // as Linear's, before any gather
  const Tensor w = gather_param(weight_, comm);
  const Tensor b = bias_.defined() ? gather_param(bias_, comm) : Tensor();
  return linear(x.dtype() == w.dtype() ? x : cast(x, w.dtype()), w, b);
}

std::shared_ptr<FullyShardedEmbedding> FullyShardedEmbedding::from_full(const Embedding& layer, int rank,
                                                                        int world_size, ShardPolicy policy,
                                                                        const std::string& name) {
  auto out = std::make_shared<FullyShardedEmbedding>();
  out->weight_ = shard_member(layer.weight, rank, world_size, policy, name, "weight");
  out->register_parameter("weight", &out->weight_);
  return out;
}

Tensor FullyShardedEmbedding::forward(const Tensor& indices, Communicator& comm) const {
  layer_inputs::require_input("FullyShardedEmbedding", indices);
  return embedding(gather_param(weight_, comm), indices);
}

std::size_t broadcast_replicated(const Module& module, Communicator& comm, int root) {
  // Checked here too: a module with no replicated parameter makes no broadcast that would.
  if (root < 0 || root >= comm.world_size()) {
    fail<ArgumentError>("broadcast_replicated", "rank ", comm.rank(), ": root ", root, " is outside a world of ",
                        comm.world_size());
  }
  autograd::NoGradGuard guard;
  std::size_t count = 0;
  for (const auto& [name, p] : module.named_parameters()) {
    if (p.is_sharded()) continue;
    p.data().copy_(comm.broadcast(p.data(), root, {.tag = name}));
    ++count;
  }
  return count;
}

std::size_t all_reduce_replicated_gradients(const Module& module, Communicator& comm) {
  autograd::NoGradGuard guard;
  // One all-reduce per dtype over the concatenated gradients: a model's many small replicated
  // parameters (norms, biases) would otherwise pay a collective's latency each.
  std::map<DType, std::vector<std::pair<std::string, Param>>> by_dtype;
  std::size_t count = 0;
  for (auto& [name, p] : module.named_parameters()) {
    if (p.is_sharded() || !p.data().requires_grad()) continue;  // frozen ones must stay without a gradient
    by_dtype[p.data().dtype()].emplace_back(name, p);
    ++count;
  }
  for (auto& [dtype, params] : by_dtype) {
    // After the gradients, a flag per parameter: 1 where this rank has a gradient. Their sums say
    // which parameters no rank's loss reached; those keep none.
    std::vector<Tensor> flat;
    std::vector<double> has;
    for (const auto& [name, p] : params) {
      const Tensor g = p.grad();
      flat.push_back(g.defined() ? g.reshape({-1}) : zeros({p.data().numel()}, Options(dtype, &p.data().backend())));
      has.push_back(g.defined() ? 1 : 0);
    }
    const auto flag_count = static_cast<std::int64_t>(params.size());
    flat.push_back(from_values(has, {flag_count}, Options(dtype, &params.front().second.data().backend())));
    const Tensor summed = comm.all_reduce(concat(flat, 0), Reduction::sum,
                                          {.tag = "replicated gradients (" + params.front().first + ", ...)"});
    const std::vector<double> anywhere =
        summed.slice(0, summed.numel() - flag_count, summed.numel()).to_vector<double>();
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i].second;
      const std::int64_t n = p.data().numel();
      Tensor g = summed.slice(0, offset, offset + n).reshape(p.data().shape());
      offset += n;
      if (anywhere[i] == 0) continue;
      Tensor leaf = p.data();
      leaf.set_grad(g);
    }
  }
  return count;
}

}  // namespace ruda::nn
