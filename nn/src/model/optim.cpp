#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <unordered_map>

#include <ruda/autograd.h>
#include <ruda/nn/optim.h>
#include <ruda/nn/sharded.h>

#include "model/gradients.h"

namespace ruda::nn {

namespace {
// A hyperparameter that must be a finite number at least `low` (NaN fails every comparison).
void require_at_least(const char* op, const char* what, double value, double low) {
  if (!(value >= low) || !std::isfinite(value))
    fail<ArgumentError>(op, what, " must be a finite number >= ", low, ", got ", value);
}

// A parameter's optimizer state made before Param::set_data gave it another dtype or size: the
// fused kernel read Adam's moments as the parameter's dtype and length (past their end: a heap
// corruption), and SGD's buffer was added into with a silent cast and saved in a dtype no fresh
// optimizer loads. PyTorch's optimizers refuse such a step too. `state` names it ("moments are");
// `dtype` is the one the state must have for the parameter's data now.
void require_state_fits(const char* op, const char* state, const Tensor& kept, const Tensor& data, DType dtype) {
  if (kept.dtype() != dtype || kept.numel() != data.numel()) {
    fail<DTypeError>(op, "a parameter is now ", dtype_name(data.dtype()), " ", data.shape(), " but its ", state, " ",
                     dtype_name(kept.dtype()), " ", kept.shape(),
                     ": its data changed dtype or size after the optimizer's first step (Param::set_data, or "
                     "fully_shard, which leaves each rank its slice); make a new optimizer for it");
  }
}

// The state a step's first pass makes for parameters that had none, dropped again when that pass
// throws (a gradient's dtype refused, or out of memory making a later parameter's state): a
// refused step changes nothing, has_state() and the memory held included (the earlier
// parameters' fresh state stayed, and a checkpoint then saved zeros for parameters that had not
// stepped).
template <class State>
class FirstPassState {
 public:
  FirstPassState(std::unordered_map<ParamId, State>& states, std::size_t params) : states_(states) {
    made_.reserve(params);  // so noting one never throws after its state exists
  }
  ~FirstPassState() {
    if (!kept_)
      for (const ParamId id : made_) states_.erase(id);
  }
  FirstPassState(const FirstPassState&) = delete;
  FirstPassState& operator=(const FirstPassState&) = delete;
  bool has(ParamId id) const { return states_.contains(id); }
  void made(ParamId id) { made_.push_back(id); }
  void keep() { kept_ = true; }

 private:
  std::unordered_map<ParamId, State>& states_;
  std::vector<ParamId> made_;
  bool kept_ = false;
};
}  // namespace

// Each node would update its replica of the shard with its own partial sum, and the replicas would
// part silently (and clip_grad_norm would give each node another norm). Every rank holds the same
// flags, so every rank raises alike.
void require_complete_gradient(const Param& p, const char* op) {
  if (p.is_sharded() && p.shard()->gradient_partial && p.grad().defined()) {
    fail<ShardingError>(op, p.shard()->describe(),
                        " holds a partial gradient (this node's ranks only): every backward since the last step ran "
                        "with set_requires_all_reduce(false); turn it back on for the last micro-batch's backward");
  }
}

Communicator& gradient_communicator(const Param& p, Communicator* comm, const char* op, const char* what) {
  Communicator* over = p.shard()->comm;
  if (over && p.shard()->comm_alive.expired()) {
    fail<ShardingError>(op, p.shard()->describe(), " is bound to a communicator that was destroyed");
  }
  if (!over) over = comm;
  if (!over) fail<ShardingError>(op, "sharded parameters need a communicator ", what);
  // Given (a parameter sharded without one): it must be the one the parameter is sharded over, as
  // gather's is. The world's, for a parameter sharded over one node, summed each shard's squares
  // once per node: a norm sqrt(nodes) too large, silently.
  p.shard()->require_communicator(op, *over);
  return *over;
}

bool for_each_block(const Tensor& values, const std::function<bool(const Tensor&)>& visit) {
  constexpr std::int64_t kBlock = std::int64_t{1} << 16;
  const Tensor flat = values.reshape({-1});
  const std::int64_t n = flat.numel();
  for (std::int64_t at = 0; at < n; at += kBlock) {
    if (!visit(flat.slice(0, at, std::min(n, at + kBlock)))) return false;
  }
  return true;
}

std::vector<ParamGroup> decay_2d_only(const Module& module) {
  ParamGroup decay{.name = "decay"}, no_decay{.name = "no_decay", .weight_decay = 0.0};
  for (const auto& [name, p] : module.named_parameters())
    (p.shape().size() >= 2 ? decay : no_decay).params.push_back(p);
  return {std::move(decay), std::move(no_decay)};
}

Optimizer::Optimizer(std::vector<Param> params, double lr)
    : Optimizer(std::vector<ParamGroup>{ParamGroup{.name = "default", .params = std::move(params)}}, lr) {}

Optimizer::Optimizer(std::vector<ParamGroup> groups, double lr) : groups_(std::move(groups)), lr_(lr) {
  std::unordered_map<std::string, std::size_t> names;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroup& group = groups_[g];
    if (group.name.empty()) fail<ArgumentError>("Optimizer", "parameter group ", g, " has no name");
    if (!names.try_emplace(group.name, g).second) {
      fail<ArgumentError>("Optimizer", "two parameter groups are named '", group.name, "'");
    }
    require_at_least("Optimizer", ("lr_scale of group '" + group.name + "'").c_str(), group.lr_scale, 0.0);
    if (group.weight_decay) {
      require_at_least("Optimizer", ("weight_decay of group '" + group.name + "'").c_str(), *group.weight_decay, 0.0);
    }
    for (const Param& p : group.params) {
      params_.push_back(p);
      group_of_.push_back(g);
    }
  }
  if (params_.empty()) fail<ArgumentError>("Optimizer", "got no parameters to optimize");
  // A parameter listed twice would be updated twice per step: refuse it (tied weights are one
  // Param, listed once by Module::parameters()).
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    const std::string& group = groups_[group_of_[i]].name;
    if (!p.defined())
      fail<ArgumentError>("Optimizer", "got an undefined parameter (position ", i, ", group '", group, "')");
    const auto [it, fresh] = position_.try_emplace(p.id(), i);
    if (!fresh) {
      const std::string& first = groups_[group_of_[it->second]].name;
      fail<ArgumentError>("Optimizer", "parameter ", p.shape(), " (id ", p.id(), ") is given twice, at positions ",
                          it->second, " and ", i,
                          first == group ? std::string() : " (in groups '" + first + "' and '" + group + "')");
    }
  }
  set_lr(lr);
}

void Optimizer::set_steps(std::int64_t steps) {
  if (steps < 0 || steps == std::numeric_limits<std::int64_t>::max()) {
    fail<ArgumentError>("Optimizer::set_steps", "the step count must be in [0, 2^63 - 1), got ", steps);
  }
  steps_ = steps;
  skipped_.clear();
}

void Optimizer::require_own(const char* op, const Param& param) const {
  if (!updates(param)) {
    fail<ArgumentError>(op, "the parameter ", param.defined() ? to_string(param.shape()) : std::string("(undefined)"),
                        " is not one this optimizer updates");
  }
}

void Optimizer::require_step_room(const char* op) const {
  if (steps_ >= std::numeric_limits<std::int64_t>::max() - 1) {
    fail<ArgumentError>(op, "the step count ", steps_, " cannot grow: another step would overflow it");
  }
}

bool Optimizer::has_state(const Param& param) const { return updates(param); }

std::int64_t Optimizer::steps_of(const Param& param) const {
  require_own("Optimizer::steps_of", param);
  return own_steps(param);
}

void Optimizer::finish_step(const std::vector<std::size_t>& without_gradient) {
  for (std::size_t i : without_gradient) ++skipped_[params_[i].id()];
  ++steps_;
}

std::int64_t Optimizer::own_steps(const Param& param) const {
  const auto skipped = skipped_.find(param.id());
  return steps_ - (skipped == skipped_.end() ? 0 : skipped->second);
}

void Optimizer::set_steps_of(const Param& param, std::int64_t steps) {
  require_own("Optimizer::set_steps_of", param);
  if (steps < 0 || steps > steps_) {
    fail<ArgumentError>("Optimizer::set_steps_of", "a parameter's step count must be in [0, ", steps_,
                        "] (the optimizer's), got ", steps, " for parameter ", param.shape());
  }
  if (steps == steps_) {
    skipped_.erase(param.id());
  } else {
    skipped_[param.id()] = steps_ - steps;
  }
}

void Optimizer::set_lr(double lr) {
  require_at_least("Optimizer", "learning rate", lr, 0.0);
  lr_ = lr;
}

void Optimizer::zero_grad() {
  for (const Param& p : params_) p.zero_grad();
}

SGD::SGD(std::vector<Param> params, SGDOptions options)
    : SGD(std::vector<ParamGroup>{ParamGroup{.name = "default", .params = std::move(params)}}, options) {}

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions options)
    : Optimizer(std::move(groups), options.lr), options_(options) {
  require_at_least("SGD", "momentum", options.momentum, 0.0);
  require_at_least("SGD", "dampening", options.dampening, 0.0);
  // Above 1 the gradient enters the momentum buffer with a negative weight: ascent, not descent.
  if (options.dampening > 1) fail<ArgumentError>("SGD", "dampening must be <= 1, got ", options.dampening);
  require_at_least("SGD", "weight_decay", options.weight_decay, 0.0);
  if (options.nesterov && (options.momentum <= 0 || options.dampening != 0)) {
    fail<ArgumentError>("SGD", "Nesterov momentum needs momentum > 0 and no dampening");
  }
}

// A step runs in two passes: the first checks every gradient and makes whatever state the update
// needs (a parameter's first momentum buffer, Adam's moments, a contiguous gradient), changing no
// value; the second updates. So a step refused for a dtype, or out of memory while making state,
// changes nothing. What fails in the second pass (SGD's temporaries for weight decay or Nesterov)
// leaves the parameters before it updated, and counts the step for those alone (finish_partial).
void Optimizer::finish_partial(const std::vector<std::size_t>& without_gradient, std::size_t updated) {
  std::vector<std::size_t> skipped = without_gradient;
  for (std::size_t i = updated; i < params_.size(); ++i) skipped.push_back(i);
  std::sort(skipped.begin(), skipped.end());
  skipped.erase(std::unique(skipped.begin(), skipped.end()), skipped.end());
  finish_step(skipped);
}

void SGD::step() {
  require_step_room("SGD::step");
  autograd::NoGradGuard guard;
  for (const Param& p : params_) require_complete_gradient(p, "SGD::step");
  std::vector<std::size_t> without_gradient;
  std::vector<Tensor*> buffers(params_.size());  // momentum's (a map's elements stay where they are)
  FirstPassState<Tensor> made(momentum_, params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    const Tensor g = p.grad();
    if (!g.defined()) {
      without_gradient.push_back(i);
      continue;
    }
    if (g.dtype() != p.data().dtype() || g.shape() != p.data().shape()) {
      fail<DTypeError>("SGD::step", "a parameter is ", dtype_name(p.data().dtype()), " ", p.data().shape(),
                       " but its gradient is ", dtype_name(g.dtype()), " ", g.shape());
    }
    if (options_.momentum != 0) {
      const bool had = made.has(p.id());
      buffers[i] = &momentum_of(p, "SGD::step");
      if (!had) made.made(p.id());
    }
  }
  made.keep();
  std::size_t i = 0;
  try {
    for (; i < params_.size(); ++i) {
      const Param& p = params_[i];
      Tensor g = p.grad();
      if (!g.defined()) continue;
      const double decay = weight_decay_of(i, options_.weight_decay);
      // One rounding, as PyTorch's grad.add(param, alpha=weight_decay) (g + p * decay rounded
      // twice: 1 ulp off in f32 on ~9% of the values, and momentum carried it on).
      if (decay != 0) g = g.detach().clone().add_(p.data(), decay);
      if (options_.momentum != 0) {
        Tensor& buffer = *buffers[i];
        // Nesterov's direction, g + momentum * buffer, gets its tensor before the buffer changes:
        // made after it (as g + buffer * momentum), running out of memory there left the buffer a
        // step ahead of its parameter. After the buffer's first write nothing allocates: add_
        // with an alpha is one pass (Backend::add_scaled), as PyTorch's grad.add(buf, alpha=m).
        Tensor direction = options_.nesterov ? g.detach().clone() : Tensor();
        // The buffer starts as the first gradient, as PyTorch's: one that state() made for a
        // checkpoint before this parameter's first step holds zeros, not a history to dampen.
        if (own_steps(p) == 0) {
          buffer.copy_(g);
        } else {
          buffer.mul_(options_.momentum).add_(g, 1.0 - options_.dampening);
        }
        if (options_.nesterov) {
          direction.add_(buffer, options_.momentum);
          g = direction;
        } else {
          g = buffer;
        }
      }
      p.data().add_(g, -lr_of(i));
    }
  } catch (...) {
    finish_partial(without_gradient, i);
    throw;
  }
  finish_step(without_gradient);
}

Tensor& SGD::momentum_of(const Param& param, const char* op) {
  const Tensor& data = param.data();
  // Made before it enters the map: a refused allocation leaves no entry behind.
  if (const auto found = momentum_.find(param.id()); found != momentum_.end()) {
    require_state_fits(op, "momentum buffer is", found->second, data, data.dtype());
    return found->second;
  }
  return momentum_.emplace(param.id(), zeros_like(data.detach())).first->second;
}

std::vector<std::pair<std::string, Tensor>> SGD::state(const Param& param) {
  require_own("SGD::state", param);
  if (options_.momentum == 0) return {};
  return {{"momentum_buffer", momentum_of(param, "SGD::state")}};
}

bool SGD::has_state(const Param& param) const {
  if (!updates(param)) return false;
  if (options_.momentum == 0) return true;  // none to make
  const auto found = momentum_.find(param.id());
  return found != momentum_.end() && found->second.defined();
}

Adam::Adam(std::vector<Param> params, AdamOptions options)
    : Adam(std::vector<ParamGroup>{ParamGroup{.name = "default", .params = std::move(params)}}, options) {}

Adam::Adam(std::vector<ParamGroup> groups, AdamOptions options)
    : Optimizer(std::move(groups), options.lr), options_(options) {
  if (!(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1)) {
    fail<ArgumentError>("Adam", "betas must be in [0, 1), got ", options.beta1, ", ", options.beta2);
  }
  if (!(options.eps > 0) || !std::isfinite(options.eps)) {
    fail<ArgumentError>("Adam", "eps must be a finite positive number, got ", options.eps);
  }
  require_at_least("Adam", "weight_decay", options.weight_decay, 0.0);
}

DType Adam::moment_dtype(DType parameter) noexcept { return AdamDesc::moment_dtype(parameter); }

Adam::Moments& Adam::moments(const Param& param) {
  const Tensor& data = param.data();
  const DType dtype = moment_dtype(data.dtype());
  if (const auto found = moments_.find(param.id()); found != moments_.end()) {
    require_state_fits("Adam", "moments are", found->second.exp_avg, data, dtype);  // the kernel reads both alike
    return found->second;
  }
  // Both made before either enters the map: out of memory between them left the first alone in
  // it, taken as whole from then on, and every later step failed on the missing second.
  Moments made{zeros(data.shape(), Options(dtype, &data.backend())),
               zeros(data.shape(), Options(dtype, &data.backend()))};
  return moments_.emplace(param.id(), std::move(made)).first->second;
}

void Adam::step() {
  require_step_room(options_.decoupled_weight_decay ? "AdamW::step" : "Adam::step");
  for (const Param& p : params_) require_complete_gradient(p, "Adam::step");
  // First pass: every check and allocation (see finish_partial); the kernel itself allocates nothing.
  std::vector<std::size_t> without_gradient;
  std::vector<Tensor> grads(params_.size());
  std::vector<const Moments*> state(params_.size());  // (a map's elements stay where they are)
  FirstPassState<Moments> made(moments_, params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    const Tensor g = p.grad();
    if (!g.defined()) {
      without_gradient.push_back(i);
      continue;
    }
    const bool had = made.has(p.id());
    state[i] = &moments(p);
    if (!had) made.made(p.id());
    const Tensor& data = p.data();
    if (g.dtype() != data.dtype() || g.numel() != data.numel()) {
      fail<DTypeError>("Adam::step", "a parameter is ", dtype_name(data.dtype()), " ", data.shape(),
                       " but its gradient is ", dtype_name(g.dtype()), " ", g.shape());
    }
    grads[i] = g.is_contiguous() ? g : g.contiguous();  // the kernel reads raw buffers
  }
  made.keep();
  std::size_t i = 0;
  try {
    for (; i < params_.size(); ++i) {
      if (!grads[i].defined()) continue;
      const Param& p = params_[i];
      const Moments& m = *state[i];
      const Tensor& data = p.data();
      AdamDesc d;
      d.param = data.view();
      d.grad = grads[i].view();
      d.exp_avg = m.exp_avg.view();
      d.exp_avg_sq = m.exp_avg_sq.view();
      d.lr = lr_of(i);
      d.beta1 = options_.beta1;
      d.beta2 = options_.beta2;
      d.eps = options_.eps;
      d.weight_decay = weight_decay_of(i, options_.weight_decay);
      d.step = own_steps(p) + 1;  // this parameter's own count, this step included
      d.decoupled = options_.decoupled_weight_decay;
      data.backend().adam_update(d);
      data.bump_version();
    }
  } catch (...) {
    finish_partial(without_gradient, i);
    throw;
  }
  finish_step(without_gradient);
}

std::vector<std::pair<std::string, Tensor>> Adam::state(const Param& param) {
  require_own("Adam::state", param);
  Moments& m = moments(param);
  return {{"exp_avg", m.exp_avg}, {"exp_avg_sq", m.exp_avg_sq}};
}

bool Adam::has_state(const Param& param) const {
  if (!updates(param)) return false;
  const auto found = moments_.find(param.id());
  return found != moments_.end() && found->second.exp_avg.defined();
}

AdamW::AdamW(std::vector<Param> params, AdamWOptions o)
    : AdamW(std::vector<ParamGroup>{ParamGroup{.name = "default", .params = std::move(params)}}, o) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions o)
    : Adam(std::move(groups), AdamOptions{.lr = o.lr,
                                          .beta1 = o.beta1,
                                          .beta2 = o.beta2,
                                          .eps = o.eps,
                                          .weight_decay = o.weight_decay,
                                          .decoupled_weight_decay = true}) {}

namespace schedules {
namespace {
// A schedule's rates are checked when it is made, as an optimizer checks its own: a bad one used to
// fail only at the step whose rate went wrong, in Optimizer::set_lr.
// Steps count from 0: a negative one gave a negative warm-up rate.
void check_step(const char* schedule, std::int64_t step) {
  if (step < 0) fail<ArgumentError>(schedule, "step must not be negative, got ", step);
}
void check_rate(const char* schedule, const char* what, double lr) {
  if (!(std::isfinite(lr) && lr >= 0)) fail<ArgumentError>(schedule, what, " must be finite and >= 0, got ", lr);
}
}  // namespace

Schedule constant(double lr) {
  check_rate("schedules::constant", "lr", lr);
  return [lr](std::int64_t step) {
    check_step("schedules::constant", step);  // as the others do: a negative step is a caller's bug
    return lr;
  };
}
Schedule linear_warmup(double lr, std::int64_t warmup_steps) {
  check_rate("schedules::linear_warmup", "lr", lr);
  if (warmup_steps < 0) {
    fail<ArgumentError>("schedules::linear_warmup", "warmup_steps must not be negative, got ", warmup_steps);
  }
  return [lr, warmup_steps](std::int64_t step) {
    check_step("schedules::linear_warmup", step);
    if (warmup_steps <= 0 || step >= warmup_steps) return lr;
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  };
}
Schedule cosine(double lr, std::int64_t total_steps, std::int64_t warmup_steps, double min_lr) {
  check_rate("schedules::cosine", "lr", lr);
  check_rate("schedules::cosine", "min_lr", min_lr);
  if (min_lr > lr) fail<ArgumentError>("schedules::cosine", "min_lr ", min_lr, " is above lr ", lr);
  if (total_steps <= 0) fail<ArgumentError>("schedules::cosine", "total_steps must be positive, got ", total_steps);
  if (warmup_steps < 0)
    fail<ArgumentError>("schedules::cosine", "warmup_steps must not be negative, got ", warmup_steps);
  return [=](std::int64_t step) {
    check_step("schedules::cosine", step);
    if (warmup_steps > 0 && step < warmup_steps)
      return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
    const std::int64_t span = std::max<std::int64_t>(1, total_steps - warmup_steps);
    const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(span));
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
  };
}
}  // namespace schedules

namespace {
// The sum of squares of `values` in f64, a block at a time: the f64 copy of a whole gradient and
// its square were 16 bytes an element beside the step, which the memory plan does not count
// (`ruda-train --clip` peaked at 1.41x its plan on the MLP, and a --memory-limit the plan had
// accepted ran out in the cast).
double sum_of_squares(const Tensor& values) {
  double total = 0;
  for_each_block(values, [&](const Tensor& block) {
    total += sum(square(cast(block, DType::f64))).item();
    return true;
  });
  return total;
}

// Sum of squares of the gradients: sharded ones over their real elements, all-reduced over the
// communicator each is sharded over, dense ones once. The parameters' own communicators win over
// the caller's: under hybrid sharding the world holds one copy of each shard per node, and summing
// over it would count each one that many times. Parameters sharded over different communicators
// (a module fully sharded beside a hybrid one) are summed per communicator, in the order the
// parameters first name them (the same on every rank): one sum all-reduced over whichever was
// named last counted the others' squares too few or too many times.
double squared_norm(const std::vector<Param>& params, Communicator* comm, const char* op) {
  autograd::NoGradGuard guard;
  double dense = 0;
  std::vector<std::pair<Communicator*, double>> sharded;  // per communicator, first named first
  // A parameter listed twice would count twice in the norm and be scaled twice (the optimizers
  // refuse such a list too).
  std::unordered_map<ParamId, std::size_t> position;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    if (!p.defined()) fail<ArgumentError>(op, "parameter ", i, " of ", params.size(), " is undefined");
    if (const auto [it, fresh] = position.try_emplace(p.id(), i); !fresh) {
      fail<ArgumentError>(op, "parameter ", p.shape(), " (id ", p.id(), ") is given twice, at positions ", it->second,
                          " and ", i);
    }
    require_complete_gradient(p, op);
    double* into = &dense;
    if (p.is_sharded()) {
      Communicator* over = &gradient_communicator(p, comm, op, "to sum their norms over");
      auto found = std::find_if(sharded.begin(), sharded.end(), [&](const auto& s) { return s.first == over; });
      if (found == sharded.end()) found = sharded.insert(sharded.end(), {over, 0.0});
      into = &found->second;
    }
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    Tensor values = g;
    if (p.is_sharded()) {
      const std::int64_t real = p.shard()->real_elements();
      if (real == 0) continue;
      values = g.slice(0, 0, real);  // padding excluded
    }
    *into += sum_of_squares(values);
  }
  double total = dense;
  for (const auto& [over, squares] : sharded) {
    total += over->all_reduce(scalar(squares, DType::f64), Reduction::sum, {.tag = "grad_norm"}).item();
  }
  return total;
}
}  // namespace

double grad_norm(const std::vector<Param>& params, Communicator* comm) {
  return std::sqrt(squared_norm(params, comm, "grad_norm"));
}

double clip_grad_norm(const std::vector<Param>& params, double max_norm, Communicator* comm) {
  // 0 is allowed, as in PyTorch: every gradient becomes 0 (the norm is still returned).
  if (!(max_norm >= 0)) fail<ArgumentError>("clip_grad_norm", "max_norm must be 0 or more, got ", max_norm);
  const double norm = std::sqrt(squared_norm(params, comm, "clip_grad_norm"));
  // PyTorch's factor, clamped at 1: it scales from max_norm - 1e-6 up (the norm equal to max_norm
  // included), and a NaN norm makes every gradient NaN (no comparison is true for NaN, so a
  // "norm > max_norm" test left such gradients as they were, for the optimizer to step on).
  const double factor = max_norm / (norm + 1e-6);
  if (!(factor >= 1.0)) {
    autograd::NoGradGuard guard;
    for (const Param& p : params) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      // A factor the gradients' dtype holds only as a subnormal or 0 is applied as exact steps
      // of 2^-64 first: one f32 scalar of it had zeroed f32 gradients of 3e38 that max_norm 1e-8
      // scales to 7e-9 (the f64 sum keeps such a norm finite), and cost max_norm 1e-3 5 digits.
      double rest = factor;
      if (g.dtype() != DType::f64) {
        for (; rest > 0 && rest < 0x1p-64; rest *= 0x1p64) g.mul_(0x1p-64);
      }
      g.mul_(rest);
    }
  }
  return norm;
}

}  // namespace ruda::nn
