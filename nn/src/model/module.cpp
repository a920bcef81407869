#include <algorithm>
#include <atomic>
#include <unordered_map>
#include <unordered_set>

#include <ruda/autograd.h>
#include <ruda/nn/module.h>
#include <ruda/nn/sharded.h>

#include "model/param_state.h"
#include "model/replay.h"
#include "sharding/param_value.h"

namespace ruda::nn {

ParamId next_param_id() {
  static std::atomic<ParamId> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

Param::Param(const Tensor& value) : Param(value, next_param_id()) {
  if (DeferredInit::active()) {
    fail<ArgumentError>("Param", "a ", dtype_name(value.dtype()), " ", value.shape(),
                        " tensor was allocated whole inside a DeferredInit scope; make the parameter with "
                        "Param(shape, initializer) so that it can be materialized slice by slice");
  }
}

Param::Param(const Shape& shape, Initializer init, DType dtype) : state_(std::make_shared<State>()) {
  check_enum<DTypeError>(dtype, "Param", "dtype");  // (named "?" below)
  if (!is_floating(dtype))
    fail<DTypeError>("Param", "parameters are floating-point, got ", dtype_name(dtype), " ", shape);
  shape_numel(shape, "Param");                          // a shape that overflows fails here, not at sharding time
  check_enum(init.kind, "Param", "Initializer::Kind");  // here, not when a deferred one materializes
  state_->id = next_param_id();
  if (DeferredInit::active()) {
    state_->deferred = std::make_shared<const Initializer>(std::move(init));
    state_->deferred_shape = shape;
    state_->deferred_dtype = dtype;
  } else {
    replace_data(init.make(shape, dtype), {});
  }
}

Param::Param(const Tensor& value, ParamId id) : state_(std::make_shared<State>()) {
  if (!value.defined()) fail<ArgumentError>("Param", "needs a defined tensor");
  if (!is_floating(value.dtype())) {
    fail<DTypeError>("Param", "parameters are floating-point, got ", dtype_name(value.dtype()), " ", value.shape());
  }
  state_->id = id;
  replace_data(value, {});
}

namespace {
// A Param is a handle: its const methods may change the shared state (as a const shared_ptr
// lets its pointee change), so this gives the state itself.
Param::State& checked(const std::shared_ptr<Param::State>& s, const char* what) {
  if (!s) fail<ArgumentError>(what, "called on an undefined Param");
  return *s;
}

[[noreturn]] void fail_deferred(const char* op, const Param::State& s) {
  fail<ArgumentError>(op, "the ", dtype_name(s.deferred_dtype), " ", s.deferred_shape,
                      " parameter is deferred (built under DeferredInit) and has no values yet: shard it with "
                      "fully_shard or call materialize() first");
}
}  // namespace

ParamId Param::id() const { return checked(state_, "Param::id").id; }
Tensor& Param::data() const {
  State& s = checked(state_, "Param::data");
  if (s.deferred) fail_deferred("Param::data", s);
  return s.data;
}
Tensor Param::grad() const { return checked(state_, "Param::grad").data.defined() ? state_->data.grad() : Tensor(); }
void Param::zero_grad() const {
  if (is_deferred()) return;
  data().zero_grad();
  if (const auto& info = shard(); info && info->complete_gradient.defined()) info->complete_gradient = Tensor();
}
bool Param::is_deferred() const { return checked(state_, "Param::is_deferred").deferred != nullptr; }
const Initializer& Param::initializer() const {
  const State& s = checked(state_, "Param::initializer");
  if (!s.deferred) fail<ArgumentError>("Param::initializer", "the parameter is not deferred");
  return *s.deferred;
}
void Param::materialize() const {
  const State& s = checked(state_, "Param::materialize");
  if (s.deferred) replace_data(s.deferred->make(s.deferred_shape, s.deferred_dtype), {});
}
DType Param::dtype() const {
  const State& s = checked(state_, "Param::dtype");
  return s.deferred ? s.deferred_dtype : s.data.dtype();
}
bool Param::is_sharded() const { return checked(state_, "Param::is_sharded").shard != nullptr; }
const std::shared_ptr<ShardInfo>& Param::shard() const { return checked(state_, "Param::shard").shard; }
void Param::set_shard(std::shared_ptr<ShardInfo> info) const {
  checked(state_, "Param::set_shard").shard = std::move(info);
}

const Shape& Param::shape() const {
  const State& s = checked(state_, "Param::shape");
  if (s.deferred) return s.deferred_shape;
  return s.shard ? sharded_logical_shape(*s.shard) : s.data.shape();
}

void Param::set_data(const Tensor& value) const {
  const State& s = checked(state_, "Param::set_data");
  if (!value.defined()) fail<ArgumentError>("Param::set_data", "needs a defined tensor");
  const Shape& now = s.deferred ? s.deferred_shape : s.data.shape();
  if (value.shape() != now) {
    fail<ShapeError>("Param::set_data", "a ", dtype_name(value.dtype()), " ", value.shape(), " value for a ",
                     s.shard ? "sharded parameter whose local slice is " : "parameter of shape ", now);
  }
  replace_data(value, detail::concat("Param::set_data replaced this ", now,
                                     " parameter's data after the forward that recorded this graph used it: its "
                                     "gradient would go to the old data, which the parameter no longer holds. Run "
                                     "the forward again after set_data"));
}

void Param::replace_data(const Tensor& value, std::string_view why_old_retired) const {
  State& s = checked(state_, "Param::set_data");
  if (!is_floating(value.dtype())) {
    fail<DTypeError>("Param::set_data", "parameters are floating-point, got ", dtype_name(value.dtype()), " ",
                     value.shape());
  }
  // A parameter is a leaf of its own: no graph to wherever the value came from, and the caller's
  // tensor keeps its own requires_grad. Its values are contiguous (a view is copied): the
  // optimizers' fused kernels, the collectives and checkpoints read a parameter's bytes.
  Tensor leaf = value.is_contiguous() ? value.detach() : value.detach().contiguous();
  // A frozen parameter stays frozen, as PyTorch's `p.data = ...` keeps requires_grad: new values
  // (loaded, cast to another dtype, sharded) do not unfreeze a backbone. A new parameter, or one
  // materialized from its deferred shape, takes gradients.
  leaf.set_requires_grad(!s.data.defined() || s.data.requires_grad());
  // Only a leaf takes gradients (a caller may have stored a non-leaf through data()).
  if (s.data.defined() && s.data.is_leaf() && !why_old_retired.empty())
    autograd::retire_leaf(s.data, std::string(why_old_retired));
  s.data = leaf;
  s.deferred = nullptr;
}

Tensor Param::value() const {
  const State& s = checked(state_, "Param::value");
  if (s.deferred) fail_deferred("Param::value", s);
  return s.shard ? sharded_value(*this, *s.shard) : s.data;
}

// --- Module ---

namespace {
// Whether dotted names a and b could name the same parameter: equal, or one a dotted prefix of the
// other (a parameter "lin.weight" beside a submodule "lin" holding "weight").
bool names_collide(const std::string& a, const std::string& b) {
  auto prefix = [](const std::string& shorter, const std::string& longer) {
    return longer.size() > shorter.size() && longer.compare(0, shorter.size(), shorter) == 0 &&
           longer[shorter.size()] == '.';
  };
  return a == b || prefix(a, b) || prefix(b, a);
}

// A name for a parameter or a submodule: not empty, and not one this module's parameters or
// submodules already use. Two children of one name (or a child named as a parameter) gave
// named_parameters() two parameters of one qualified name, refused only later, by a save.
template <class Params, class Children>
void require_free_name(const char* op, const std::string& name, const Params& params, const Children& children) {
  if (name.empty()) fail<ArgumentError>(op, "the name is empty");
  for (const auto& [existing, p] : params) {
    if (existing == name) fail<ArgumentError>(op, "a parameter named '", name, "' exists already");
  }
  for (const auto& [existing, c] : children) {
    if (existing == name) fail<ArgumentError>(op, "a submodule named '", name, "' exists already");
  }
  // Dots are allowed (GPT's submodules are "blocks.0"...), so a name may also collide through one.
  for (const auto& [existing, p] : params) {
    if (names_collide(existing, name)) {
      fail<ArgumentError>(op, "'", name, "' collides with the parameter '", existing,
                          "' through a dot (named_parameters() would list one name twice)");
    }
  }
  for (const auto& [existing, c] : children) {
    if (names_collide(existing, name)) {
      fail<ArgumentError>(op, "'", name, "' collides with the submodule '", existing,
                          "' through a dot (named_parameters() could list one name twice)");
    }
  }
}
}  // namespace

void Module::register_parameter(std::string name, Param* param) {
  if (!param) fail<ArgumentError>("register_parameter", "parameter '", name, "' is null");
  require_free_name("register_parameter", name, params_, children_);
  params_.emplace_back(std::move(name), param);
}

void Module::register_module(std::string name, std::shared_ptr<Module> child) {
  register_slot(std::move(name), child ? ChildList([child](const std::string& as, ChildModules& out) {
                  out.emplace_back(as, child.get());
                })
                                       : ChildList());
}

void Module::register_slot(std::string name, ChildList list) {
  if (!list) fail<ArgumentError>("register_module", "module '", name, "' is null");
  require_free_name("register_module", name, params_, children_);
  // Every walk over the tree (parameters, named_modules, train) recurses into the children: a
  // module that contains itself, directly or through its children, is refused here; one that a
  // member's later assignment makes so is refused by the walk (list_modules).
  ChildModules now;
  list(name, now);
  for (const auto& [as, child] : now) {
    for (const auto& [sub, m] : std::as_const(*child).named_modules()) {
      if (m == this) {
        fail<ArgumentError>("register_module", "module '", as,
                            "' is this module or contains it: a module cannot be its own submodule");
      }
    }
  }
  children_.emplace_back(std::move(name), std::move(list));
}

Module::ChildModules Module::children() const {
  ChildModules out;
  for (const auto& [name, list] : children_) list(name, out);
  return out;
}

void Module::list_modules(const std::string& path, std::vector<const Module*>& stack,
                          std::unordered_set<const Module*>& listed,
                          std::vector<std::pair<std::string, const Module*>>& out) const {
  out.emplace_back(path, this);
  listed.insert(this);
  stack.push_back(this);
  for (const auto& [name, child] : children()) {
    const std::string qualified = path.empty() ? name : path + "." + name;
    if (std::find(stack.begin(), stack.end(), child) != stack.end()) {
      fail<ArgumentError>("named_modules", "the submodule '", qualified,
                          "' is one of its own ancestors (a member assigned after registration?): the module "
                          "tree must not contain itself");
    }
    if (!listed.contains(child)) child->list_modules(qualified, stack, listed, out);
  }
  stack.pop_back();
}

std::vector<std::pair<std::string, Param>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Param>> all;
  for (const auto& [path, m] : named_modules()) {
    for (const auto& [name, p] : m->params_) {
      if (p->defined()) all.emplace_back(path.empty() ? name : path + "." + name, *p);
    }
  }
  // A tied parameter is reachable twice: keep its first name. Two different parameters with one
  // id (a Param built with an explicit id that was already in use) would mix up optimizer state
  // and checkpoints, so they are an error rather than being silently merged.
  std::vector<std::pair<std::string, Param>> unique;
  std::unordered_map<ParamId, std::size_t> by_id;
  for (auto& entry : all) {
    const auto [it, fresh] = by_id.try_emplace(entry.second.id(), unique.size());
    if (fresh) {
      unique.push_back(std::move(entry));
    } else if (!unique[it->second].second.same(entry.second)) {
      fail<ArgumentError>("named_parameters", "'", unique[it->second].first, "' and '", entry.first,
                          "' are different parameters with the same id ", entry.second.id());
    }
  }
  return unique;
}

std::vector<Param> Module::parameters() const {
  std::vector<Param> out;
  for (auto& [name, p] : named_parameters()) out.push_back(p);
  return out;
}

std::vector<std::pair<std::string, const Module*>> Module::named_modules() const {
  std::vector<std::pair<std::string, const Module*>> out;
  std::vector<const Module*> stack;
  std::unordered_set<const Module*> listed;
  list_modules("", stack, listed, out);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  // (This module is not const, and neither is any module it holds: they are held by shared_ptrs
  // to non-const modules.)
  for (const auto& [path, m] : std::as_const(*this).named_modules()) out.emplace_back(path, const_cast<Module*>(m));
  return out;
}

bool Module::is_training() const noexcept {
  if (const bool* replayed = CheckpointReplay::training_of(*this)) return *replayed;
  return training_;
}

void Module::train(bool on) {
  for (const auto& [path, m] : named_modules()) m->training_ = on;
}

void Module::zero_grad() const {
  for (const auto& [name, p] : named_parameters()) p.zero_grad();
}

std::int64_t Module::parameter_count() const {
  std::int64_t n = 0;
  for (const auto& [name, p] : named_parameters()) {
    if (__builtin_add_overflow(n, shape_numel(p.shape()), &n)) {
      fail<ShapeError>("parameter_count", "the parameters' element count overflows int64 at '", name, "'");
    }
  }
  return n;
}

void Module::materialize() const {
  for (const auto& [name, p] : named_parameters()) p.materialize();
}

// --- Sequential ---

Sequential::Sequential(std::vector<std::shared_ptr<UnaryModule>> layers) {
  for (auto& layer : layers) push_back(std::move(layer));
}

void Sequential::push_back(std::shared_ptr<UnaryModule> layer) {
  register_module(std::to_string(layers_.size()), layer);
  layers_.push_back(std::move(layer));
}

const std::shared_ptr<UnaryModule>& Sequential::operator[](std::size_t i) const {
  if (i >= layers_.size()) fail<IndexError>("Sequential", "layer ", i, " of ", layers_.size());
  return layers_[i];
}

Tensor Sequential::forward(const Tensor& input) {
  Tensor x = input;
  for (const auto& layer : layers_) x = layer->forward(x);
  return x;
}

}  // namespace ruda::nn

namespace ruda {
RUDA_DEFINE_THREAD_FLAG(nn::DeferredInit)
}  // namespace ruda
