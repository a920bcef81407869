#include <ruda/nn/grad_scaler.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <exception>
#include <vector>

#include <ruda/autograd.h>
#include <ruda/nn/sharded.h>

#include "model/gradients.h"

namespace ruda::nn {

namespace {

// Whether every value is finite: x * 0 is 0 for a finite x and NaN for an inf or NaN, and a sum
// of zeros cannot overflow in any dtype (a sum of the values themselves can: f64 gradients near
// 1e308).
bool all_finite(const Tensor& values) {
  return for_each_block(values, [](const Tensor& block) { return !std::isnan(sum(block * 0.0).item()); });
}

std::string exact(double value) {
  char buffer[64];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, value);  // shortest round trip
  return std::string(buffer, error == std::errc() ? end : buffer);
}
}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options), scale_(options.init_scale) {
  const char* op = "GradScaler";
  if (!(options.init_scale >= kMinScale && options.init_scale <= kMaxScale)) {
    fail<ArgumentError>(op, "init_scale must be in [", kMinScale, ", ", kMaxScale,
                        "] (f32's normal range, where the scale and its reciprocal are finite), got ",
                        options.init_scale);
  }
  if (!(options.growth_factor > 1) || !std::isfinite(options.growth_factor))
    fail<ArgumentError>(op, "growth_factor must be a finite number > 1, got ", options.growth_factor);
  if (!(options.backoff_factor > 0 && options.backoff_factor < 1))
    fail<ArgumentError>(op, "backoff_factor must be in (0, 1), got ", options.backoff_factor);
  if (options.growth_interval < 1)
    fail<ArgumentError>(op, "growth_interval must be 1 or more, got ", options.growth_interval);
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!loss.defined()) fail<ArgumentError>("GradScaler::scale", "the loss is undefined");
  if (!is_floating(loss.dtype())) {
    fail<DTypeError>("GradScaler::scale", "the loss must be a floating-point tensor, got ", dtype_name(loss.dtype()),
                     " ", loss.shape());
  }
  return options_.enabled ? loss * scale_ : loss;
}

namespace {
// The optimizer's parameters, by id (0 for an undefined one): what unscale_ saw, for step to check.
std::vector<ParamId> ids_of(const Optimizer& optimizer) {
  std::vector<ParamId> ids;
  for (const Param& p : optimizer.params()) ids.push_back(p.defined() ? p.id() : ParamId{});
  return ids;
}
}  // namespace

GradScaler::Seen& GradScaler::unscale_once(Optimizer& optimizer, Communicator* comm, const char* op) {
  const auto [it, fresh] =
      seen_.try_emplace(&optimizer, Seen{Stage::unscaled, false, autograd::backward_serial(), ids_of(optimizer)});
  if (!fresh) {
    fail<ArgumentError>(op, it->second.stage == Stage::stepped ? "step()" : "unscale_()",
                        " already ran for this optimizer since the last update(): its gradients were unscaled "
                        "once; call update() after each iteration's step()s");
  }
  const std::vector<Param>& params = optimizer.params();
  std::vector<Communicator*> comms;  // the ranks agree over each, in the order first named
  try {
    if (std::none_of(params.begin(), params.end(), [](const Param& p) { return p.grad().defined(); })) {
      fail<ArgumentError>(op, "no parameter of this optimizer has a gradient: run backward on the scaled loss first");
    }
    // The refusals, alike on every rank (the same parameters, dtypes and communicators), before
    // any collective or division.
    for (std::size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      require_complete_gradient(p, op);
      const Tensor g = p.grad();
      if (g.defined() && g.dtype() == DType::f16) {
        fail<DTypeError>(op, "parameter ", i, " ", p.shape(),
                         " has an f16 gradient: divided by the scale in f16, the small values it kept would vanish "
                         "again; keep the parameters in f32 and compute in f16 (ShardPolicy::compute_dtype, or "
                         "casting inputs), so that gradients arrive in f32");
      }
      if (!p.is_sharded()) continue;
      // As the gradient norms' (without one each rank would decide from its slices alone).
      Communicator* over = &gradient_communicator(p, comm, op, "to agree on infinities over");
      if (std::find(comms.begin(), comms.end(), over) == comms.end()) comms.push_back(over);
    }
  } catch (...) {
    seen_.erase(it);  // as if it had not been called
    throw;
  }
  if (comm && std::find(comms.begin(), comms.end(), comm) == comms.end()) comms.push_back(comm);

  // Divided, then checked: the divided values are what the optimizer steps on (a scale below 1
  // can overflow a finite gradient). A rank that fails here (out of memory in a check's block)
  // still joins the agreement, so that no rank waits for it and every rank raises.
  Seen& seen = it->second;
  seen.stage = Stage::failed;  // until agreed: some gradients may be divided, others not
  bool found_inf = false;
  std::exception_ptr failure;
  try {
    autograd::NoGradGuard guard;
    const double inverse = 1.0 / scale_;
    for (const Param& p : params) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      g.mul_(inverse);
      if (!found_inf) found_inf = !all_finite(p.is_sharded() ? g.slice(0, 0, p.shard()->real_elements()) : g);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  // One rank's inf is every rank's skipped step: each holds other slices of the gradients.
  std::vector<double> agreed = {found_inf ? 1.0 : 0.0, failure ? 1.0 : 0.0};
  for (Communicator* over : comms) agreed = agree_on_max(*over, agreed, "GradScaler::unscale_");
  if (failure) std::rethrow_exception(failure);
  if (agreed[1] != 0) {
    fail<RankFailedError>(op,
                          "another rank failed while unscaling its gradients (its own error names the cause): "
                          "no rank steps; call update() (it backs the scale off), zero the gradients and run "
                          "backward again");
  }
  seen.stage = Stage::unscaled;
  seen.found_inf = agreed[0] != 0;
  return seen;
}

void GradScaler::unscale_(Optimizer& optimizer, Communicator* comm) {
  if (options_.enabled) unscale_once(optimizer, comm, "GradScaler::unscale_");
}

bool GradScaler::step(Optimizer& optimizer, Communicator* comm) {
  const char* op = "GradScaler::step";
  if (!options_.enabled) {  // keeps no state: every iteration as the first
    optimizer.step();
    return true;
  }
  const auto found = seen_.find(&optimizer);
  if (found != seen_.end() && found->second.stage == Stage::unscaled) {
    const bool same_params = ids_of(optimizer) == found->second.params;
    if (!same_params || found->second.backward != autograd::backward_serial()) {
      fail<ArgumentError>(op,
                          same_params ? "a backward ran after unscale_() for this optimizer"
                                      : "this optimizer holds other parameters than at its unscale_()",
                          ": its gradients may be partly scaled. unscale_() comes after the iteration's last "
                          "backward; an iteration abandoned after unscale_() (an exception, say) ends with "
                          "update(), then zero the gradients and run backward again");
    }
  }
  Seen* seen = found == seen_.end() ? &unscale_once(optimizer, comm, op) : &found->second;
  if (seen->stage == Stage::stepped) {
    fail<ArgumentError>(op,
                        "step() already ran for this optimizer since the last update(); call update() after "
                        "each iteration's step()s");
  }
  if (seen->stage == Stage::failed) {
    fail<ArgumentError>(op,
                        "unscale_() failed for this optimizer on some rank, its gradients perhaps divided in "
                        "part: call update() (it backs the scale off), zero the gradients and run backward again");
  }
  if (seen->found_inf) {
    seen->stage = Stage::stepped;
    return false;
  }
  optimizer.step();  // a refused step leaves the stage as it was: a retry steps, not skips
  seen->stage = Stage::stepped;
  return true;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  if (seen_.empty()) {
    fail<ArgumentError>("GradScaler::update",
                        "no unscale_() or step() ran since the last update(): there is no "
                        "finding to grow or back off the scale by");
  }
  // (A failed unscale_ counts as an overflow: what it met is unknown.)
  const bool found_inf = std::any_of(
      seen_.begin(), seen_.end(), [](const auto& s) { return s.second.found_inf || s.second.stage == Stage::failed; });
  seen_.clear();
  if (found_inf) {
    scale_ = std::max(scale_ * options_.backoff_factor, kMinScale);
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (grown <= kMaxScale) scale_ = grown;
    growth_tracker_ = 0;
  }
}

std::map<std::string, std::string> GradScaler::state() const {
  return {{kScaleKey, exact(scale_)}, {kTrackerKey, std::to_string(growth_tracker_)}};
}

void GradScaler::load_state(const std::map<std::string, std::string>& extra) {
  const char* op = "GradScaler::load_state";
  if (!seen_.empty()) {
    fail<ArgumentError>(op, "an unscale_() or step() ran since the last update(): load between iterations");
  }
  const auto scale_it = extra.find(kScaleKey), tracker_it = extra.find(kTrackerKey);
  if (scale_it == extra.end() && tracker_it == extra.end()) return;  // saved without a scaler
  if (scale_it == extra.end() || tracker_it == extra.end()) {
    fail<IOError>(op, "the checkpoint holds ", scale_it == extra.end() ? kTrackerKey : kScaleKey, " without ",
                  scale_it == extra.end() ? kScaleKey : kTrackerKey);
  }
  double scale = 0;
  std::int64_t tracker = -1;
  const std::string& s = scale_it->second;
  const std::string& t = tracker_it->second;
  const auto parsed_scale = std::from_chars(s.data(), s.data() + s.size(), scale);
  const auto parsed_tracker = std::from_chars(t.data(), t.data() + t.size(), tracker);
  if (parsed_scale.ec != std::errc() || parsed_scale.ptr != s.data() + s.size() ||
      !(scale >= kMinScale && scale <= kMaxScale)) {
    fail<IOError>(op, kScaleKey, " must be a number in [", kMinScale, ", ", kMaxScale, "], got '", s, "'");
  }
  if (parsed_tracker.ec != std::errc() || parsed_tracker.ptr != t.data() + t.size() || tracker < 0 ||
      tracker >= options_.growth_interval) {
    fail<IOError>(op, kTrackerKey, " must be a whole number in [0, growth_interval ", options_.growth_interval,
                  "), got '", t, "'");
  }
  scale_ = scale;
  growth_tracker_ = tracker;
}

}  // namespace ruda::nn
