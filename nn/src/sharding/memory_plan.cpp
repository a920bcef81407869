#include <algorithm>
#include <cstdio>
#include <tuple>

#include <ruda/memory.h>
#include <ruda/nn/memory_plan.h>
#include <ruda/nn/optim.h>

#include "model/dropout_positions.h"
#include "sharding/shard_group.h"

namespace ruda::nn {

namespace {

// Every planner's arguments: a world of at least one rank and a step of at least one sample (a
// batch of 0 planned a local batch of 0 that "fit", and divided by 0 in fit_schedule).
void require_world_and_batch(const char* op, std::int64_t world_size, std::int64_t global_batch) {
  if (world_size <= 0) fail<ArgumentError>(op, "world size must be positive, got ", world_size);
  if (global_batch <= 0) fail<ArgumentError>(op, "the global batch must be positive, got ", global_batch);
}

// A memory limit in bytes per rank, 0 for none: a negative one read as none too, and so "fit".
void require_limit(const char* op, std::int64_t limit) {
  if (limit < 0) fail<ArgumentError>(op, "the memory limit must be bytes per rank (0: none), got ", limit);
}

// a * b bytes of parameter `name`; a ShapeError where the count overflows int64 (a model built
// under DeferredInit may have parameters whose bytes no machine holds, but plans still compare).
std::int64_t bytes_of(const std::string& name, std::int64_t a, std::int64_t b) {
  std::int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    fail<ShapeError>("plan_state", "parameter '", name, "': ", a, " x ", b, " bytes overflow int64");
  }
  return out;
}

std::int64_t add_bytes(const std::string& name, std::int64_t a, std::int64_t b) {
  std::int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out))
    fail<ShapeError>("plan_state", "the plan's bytes overflow int64 at '", name, "'");
  return out;
}

// A probe the caller made: the line it gives must not fall below 0 at one sample nor as samples
// grow (a negative one planned a step of -120 bytes, and the plan then read as unmeasured).
void require_probe(const char* op, const StepProbe& probe) {
  std::int64_t at_one = 0;
  if (probe.per_sample < 0 || __builtin_add_overflow(probe.fixed, probe.per_sample, &at_one) || at_one < 0) {
    fail<ArgumentError>(op, "a StepProbe of fixed ", probe.fixed, " and per_sample ", probe.per_sample,
                        " bytes: a step's bytes must be at least 0 at one sample and not fall as samples grow");
  }
}

// plan_state; `as_held`: the module runs as it is now (a measured plan), so a parameter neither
// sharded nor deferred is whole on every rank: its bytes, its gradient's and its state's, nothing
// gathered. (Otherwise, planning before fully_shard, every parameter is to be sharded.) A dense
// model measured over 2 ranks was planned at half its state.
MemoryPlan plan_state_of(const Module& module, int world_size, std::int64_t global_batch, const PlanOptions& options,
                         bool as_held) {
  require_world_and_batch("plan_state", world_size, global_batch);
  // (The local batch was global / world rounded down: a plan for a batch no rank runs.)
  if (global_batch % world_size != 0) {
    fail<ArgumentError>("plan_state", "a global batch of ", global_batch, " does not divide over ", world_size,
                        " ranks");
  }
  if (options.compute_dtype) {
    check_enum<DTypeError>(*options.compute_dtype, "plan_state", "compute dtype");
    // As fully_shard refuses it: layers compute in a floating-point dtype.
    if (!is_floating(*options.compute_dtype)) {
      fail<DTypeError>("plan_state", "compute dtype ", dtype_name(*options.compute_dtype),
                       " is not a floating-point dtype");
    }
  }
  if (options.optimizer_states < 0) {
    fail<ArgumentError>("plan_state", "optimizer_states must not be negative, got ", options.optimizer_states);
  }
  if (options.shard_ranks < 0) {
    fail<ArgumentError>("plan_state", "shard_ranks must be positive (or 0: the world size), got ", options.shard_ranks);
  }
  const int shard_ranks = options.shard_ranks > 0 ? options.shard_ranks : world_size;
  if (world_size % shard_ranks != 0) {
    fail<ArgumentError>("plan_state", "state sharded over ", shard_ranks, " ranks does not tile a world of ",
                        world_size);
  }
  MemoryPlan plan;
  plan.world_size = world_size;
  plan.shard_ranks = shard_ranks;
  plan.local_batch = global_batch / world_size;
  for (const auto& [name, p] : module.named_parameters()) {
    const std::int64_t numel = shape_numel(p.shape());
    const auto item = static_cast<std::int64_t>(dtype_size(p.dtype()));
    // As held: a replicated parameter whole, a sharded one by its own layout (its ranks: a node's
    // under hybrid sharding, whatever options.shard_ranks says).
    const bool whole = as_held && !p.is_deferred() && !p.is_sharded();
    const bool held_shard = as_held && p.is_sharded();
    const std::int64_t elements = whole        ? numel
                                  : held_shard ? p.shard()->shard_size
                                               : ShardInfo::layout(p.shape(), 0, shard_ranks).shard_size;
    const std::int64_t shard = bytes_of(name, elements, item);
    plan.parameters = add_bytes(name, plan.parameters, shard);
    if (whole) plan.replicated = add_bytes(name, plan.replicated, shard);
    // A frozen parameter (its data's requires_grad off) has no gradient and no optimizer state:
    // a frozen 1024 x 1024 layer's were planned, 2.4x the peak a fine-tuning run measured.
    const bool frozen = !p.is_deferred() && !p.data().requires_grad();
    if (!frozen) {
      plan.gradients = add_bytes(name, plan.gradients, shard);
      const DType state_dtype = options.f32_states_for_16bit ? Adam::moment_dtype(p.dtype()) : p.dtype();
      const std::int64_t state = bytes_of(name, elements, static_cast<std::int64_t>(dtype_size(state_dtype)));
      plan.optimizer = add_bytes(name, plan.optimizer, bytes_of(name, options.optimizer_states, state));
    }
    // (As held, a sharded parameter gathers in its own policy's compute dtype unless one is given.)
    const DType compute_dtype =
        options.compute_dtype.value_or(held_shard ? p.shard()->policy.compute_dtype.value_or(p.dtype()) : p.dtype());
    // Unsharded (one rank holds each parameter whole) and computing in its own dtype, a layer
    // uses the parameter itself: nothing is gathered (a 1-rank plan was refused for two copies of
    // the largest layer it never makes).
    const int ranks = held_shard ? p.shard()->world_size : shard_ranks;
    if ((ranks == 1 && compute_dtype == p.dtype()) || whole) continue;
    // One whole copy of the largest weight: a step gathers it to compute with it. Its full
    // gradient, which comes later, need not meet it (a first layer's backward reads no weight):
    // two copies were above what a 4-rank MLP step measured (15.8 against 15.4 MB), and a limit
    // between them was refused as below the least a step needs.
    const auto compute = static_cast<std::int64_t>(dtype_size(compute_dtype));
    plan.gathered = std::max(plan.gathered, bytes_of(name, numel, compute));
  }
  return plan;
}

MemoryPlan plan_memory_of(const Module& module, int world_size, std::int64_t global_batch, const StepProbe& probe,
                          const PlanOptions& options, bool as_held) {
  require_probe("plan_memory", probe);
  MemoryPlan plan = plan_state_of(module, world_size, global_batch, options, as_held);
  // Saturating, as StepProbe::at: a batch whose step overflows fits no limit.
  const std::int64_t unmeasured = options.accumulating && !probe.accumulating ? plan.gradients : 0;
  if (__builtin_add_overflow(probe.at(plan.local_batch), unmeasured, &plan.step)) plan.step = INT64_MAX;
  plan.probe = probe;
  return plan;
}
}  // namespace

MemoryPlan plan_state(const Module& module, int world_size, std::int64_t global_batch, const PlanOptions& options) {
  return plan_state_of(module, world_size, global_batch, options, false);
}

namespace {
// The module's Dropout streams' positions, put back on destruction: the probe's steps draw masks
// as training steps do, and left the streams advanced, so a run that planned (ruda-train with
// --memory-limit) trained on other masks than one that did not.
class StreamsKept {
 public:
  explicit StreamsKept(const Module& module) : module_(module), kept_(dropout_positions(module)) {}
  ~StreamsKept() { set_dropout_positions(module_, kept_); }
  StreamsKept(const StreamsKept&) = delete;
  StreamsKept& operator=(const StreamsKept&) = delete;

 private:
  const Module& module_;
  std::vector<std::uint64_t> kept_;
};
}  // namespace

StepProbe probe_step(const Module& module, Communicator& comm, const std::function<Tensor(std::int64_t)>& step,
                     std::int64_t samples, int micro_batches) {
  if (!step) fail<ArgumentError>("probe_step", "the step function is empty");
  if (samples < 2) fail<ArgumentError>("probe_step", "needs a second micro-batch of at least 2 samples, got ", samples);
  if (micro_batches < 1) fail<ArgumentError>("probe_step", "micro_batches must be at least 1, got ", micro_batches);
  // The measurement decides whether the configuration fits: it must not fail on the limit itself.
  memory::LimitSuspended measuring;
  // Nor may it count as a step of the automatic overlap trial, or measure the smaller schedule.
  const ShardSchedule::Probing probing;
  const StreamsKept streams(module);
  // The transient above what is live before the forward, with the previous micro-batch's
  // gradients alive during it as in a training loop (loss, zero_grad, backward).
  // Accumulating (micro_batches > 1): as the training loop runs it, gradients cleared before the
  // first forward, then each micro-batch's forward and backward adding to them.
  auto transient = [&](std::int64_t batch) {
    memory::reset_peak();
    const std::int64_t before = memory::stats().live_bytes;
    if (micro_batches == 1) {
      const Tensor loss = step(batch);
      module.zero_grad();
      loss.backward();
    } else {
      module.zero_grad();
      Tensor total;  // the step's loss, summed over its micro-batches as a training loop does
      for (int m = 0; m < micro_batches; ++m) {
        const Tensor loss = step(batch);
        loss.backward();
        total = total.defined() ? total + loss.detach() : loss.detach();
      }
    }
    return memory::stats().peak_bytes - before;
  };
  // A step that throws leaves the module as a successful probe does (gradients cleared, the peak
  // counter reset) before its error goes on: the probe's gradients stayed, and a run that caught
  // the error and went on started with them.
  std::int64_t one = 0, more = 0;
  try {
    transient(1);  // once first, so that gradients exist as they do from the second step on
    one = transient(1);
    more = transient(samples);
    // A schedule whose automatic overlap trial has not decided may train either way: measured
    // synchronous too, the larger figures planned (every rank meets the same schedules).
    if (ShardSchedule::Probing::met_undecided()) {
      const ShardSchedule::Probing synchronous(true);
      transient(1);
      one = std::max(one, transient(1));
      more = std::max(more, transient(samples));
    }
  } catch (...) {
    module.zero_grad();
    memory::reset_peak();
    throw;
  }
  module.zero_grad();
  memory::reset_peak();
  // Every rank plans with the largest figures (ranks differ by padding and by their samples).
  const auto worst = agree_on_max(comm, {static_cast<double>(one), static_cast<double>(more)}, "memory plan");
  const auto at_one = static_cast<std::int64_t>(worst[0]), at_more = static_cast<std::int64_t>(worst[1]);
  // Rounded up, so that the line is never below the measurement at `samples`.
  const std::int64_t per_sample = std::max<std::int64_t>(0, (at_more - at_one + samples - 2) / (samples - 1));
  return {at_one - per_sample, per_sample, micro_batches > 1};
}

MemoryPlan plan_memory(const Module& module, int world_size, std::int64_t global_batch, const StepProbe& probe,
                       const PlanOptions& options) {
  return plan_memory_of(module, world_size, global_batch, probe, options, false);
}

namespace {
// Whether `plan` is over `limit` on some rank.
bool any_rank_over(Communicator& comm, const MemoryPlan& plan, std::int64_t limit) {
  const bool over = limit > 0 && plan.peak() > limit;
  return agree_on_max(comm, {over ? 1.0 : 0.0}, "memory plan")[0] > 0;
}
}  // namespace

MemoryPlan plan_memory(const Module& module, Communicator& comm, std::int64_t global_batch,
                       const std::function<Tensor(std::int64_t)>& step, std::int64_t limit,
                       const PlanOptions& options) {
  if (!step) fail<ArgumentError>("plan_memory", "the step function is empty");
  require_limit("plan_memory", limit);
  const int world = comm.world_size();
  // Accumulating steps are measured as two micro-batches: the second sees the first's gradients,
  // as every later one does.
  const int micro_batches = options.accumulating ? 2 : 1;
  MemoryPlan plan =
      plan_memory_of(module, world, global_batch, probe_step(module, comm, step, 2, micro_batches), options, true);
  if (!any_rank_over(comm, plan, limit) && plan.local_batch > 2) {
    plan = plan_memory_of(module, world, global_batch, probe_step(module, comm, step, plan.local_batch, micro_batches),
                          options, true);
  }
  return plan;
}

std::string MemorySchedule::describe(bool grouped) const {
  std::string out = grouped ? std::to_string(max_unsharded_groups) +
                                  (max_unsharded_groups == 1 ? " unsharded group, " : " unsharded groups, ")
                            : std::string();
  out += strategy == CheckpointStrategy::retain ? "retain" : "recompute";
  if (recompute_gelu) out += ", GELU recomputed";
  if (activation_checkpointing) out += ", activation checkpointing";
  if (micro_batches > 1) out += ", " + std::to_string(micro_batches) + " micro-batches";
  return out;
}

namespace {

void apply(const Module& module, const MemorySchedule& schedule, const FitOptions& options) {
  // (A dense module, planned at world 1, or one sharded per parameter, has less to set.)
  if (any_sharded(module, true)) set_max_unsharded_groups(module, schedule.max_unsharded_groups);
  if (any_sharded(module, false)) set_checkpoint_strategy(module, schedule.strategy);
  if (options.set_activation_checkpointing) options.set_activation_checkpointing(schedule.activation_checkpointing);
  if (options.set_recompute_gelu) options.set_recompute_gelu(schedule.recompute_gelu);
}

// The schedules to try after `configured`, fewest concessions first; among as many concessions,
// those that give up less come first: fewer unsharded groups (more groups kept first), then
// recompute, then the GELU recompute (a GEMM more per block), then activation checkpointing (a
// whole forward more), then more micro-batches.
// `sharded`: some parameter of the module is sharded, so the strategy applies; `grouped`: it is
// sharded in groups (per parameter, it has no schedule of groups to shrink). A concession that
// does not apply was measured, changed nothing, and could be reported as the schedule chosen.
std::vector<MemorySchedule> concessions(const MemorySchedule& configured, bool sharded, bool grouped,
                                        bool can_checkpoint, bool can_recompute_gelu,
                                        const std::vector<std::int64_t>& micro_batches) {
  struct Candidate {
    MemorySchedule schedule;
    int count, micro, checkpointing, gelu, recomputing, groups_given_up;
  };
  std::vector<Candidate> all;
  const bool may_recompute = sharded && configured.strategy == CheckpointStrategy::retain;
  const bool may_checkpoint = can_checkpoint && !configured.activation_checkpointing;
  const bool may_recompute_gelu = can_recompute_gelu && !configured.recompute_gelu;
  const int fewest_groups = grouped ? 1 : configured.max_unsharded_groups;
  for (int groups = configured.max_unsharded_groups; groups >= fewest_groups; --groups) {
    for (int recompute = 0; recompute <= (may_recompute ? 1 : 0); ++recompute) {
      for (int gelu = 0; gelu <= (may_recompute_gelu ? 1 : 0); ++gelu) {
        for (int checkpoint = 0; checkpoint <= (may_checkpoint ? 1 : 0); ++checkpoint) {
          for (std::size_t m = 0; m < micro_batches.size(); ++m) {
            MemorySchedule s = configured;
            s.max_unsharded_groups = groups;
            if (recompute) s.strategy = CheckpointStrategy::recompute;
            if (gelu) s.recompute_gelu = true;
            if (checkpoint) s.activation_checkpointing = true;
            s.micro_batches = micro_batches[m];
            const int fewer = groups < configured.max_unsharded_groups ? 1 : 0;
            const int smaller = m > 0 ? 1 : 0;
            const int count = fewer + recompute + gelu + checkpoint + smaller;
            if (count == 0) continue;
            all.push_back(
                {s, count, static_cast<int>(m), checkpoint, gelu, recompute, configured.max_unsharded_groups - groups});
          }
        }
      }
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(a.count, a.micro, a.checkpointing, a.gelu, a.recomputing, a.groups_given_up) <
           std::tie(b.count, b.micro, b.checkpointing, b.gelu, b.recomputing, b.groups_given_up);
  });
  std::vector<MemorySchedule> out;
  for (const auto& c : all) out.push_back(c.schedule);
  return out;
}

}  // namespace

FittedSchedule fit_schedule(const Module& module, Communicator& comm, std::int64_t global_batch,
                            const std::function<Tensor(std::int64_t)>& step, std::int64_t limit,
                            const MemorySchedule& configured, const FitOptions& options) {
  FittedSchedule fit;
  if (!step) fail<ArgumentError>("fit_schedule", "the step function is empty");
  require_world_and_batch("fit_schedule", comm.world_size(), global_batch);
  require_limit("fit_schedule", limit);
  if (options.max_micro_batches < 1) {
    fail<ArgumentError>("fit_schedule", "FitOptions::max_micro_batches must be at least 1, got ",
                        options.max_micro_batches);
  }
  // Whether m micro-batches on every rank divide the global batch (a product that overflows does not).
  auto divides = [&](std::int64_t m) {
    std::int64_t per_step = 0;
    return m >= 1 && !__builtin_mul_overflow(m, static_cast<std::int64_t>(comm.world_size()), &per_step) &&
           global_batch % per_step == 0;
  };
  if (!divides(configured.micro_batches)) {
    fail<ArgumentError>("fit_schedule", configured.micro_batches, " micro-batches do not divide the local batch (",
                        global_batch, " over ", comm.world_size(), " ranks)");
  }
  // More micro-batches: the configured count times 2, 4, ... while they divide the local batch.
  std::vector<std::int64_t> micro_batches = {configured.micro_batches};
  for (std::int64_t m = configured.micro_batches; m <= options.max_micro_batches / 2 && divides(2 * m);) {
    m *= 2;
    micro_batches.push_back(m);
  }
  auto measure = [&](const MemorySchedule& schedule) {
    apply(module, schedule, options);  // drops any weights a previous probe left gathered
    PlanOptions plan_options = options.plan;
    plan_options.accumulating = schedule.micro_batches > 1;
    MemoryPlan plan = plan_memory(module, comm, global_batch / schedule.micro_batches, step, limit, plan_options);
    plan.schedule = schedule.describe();
    fit.tried.push_back(schedule);
    fit.schedule = schedule;
    fit.plan = plan;
    fit.fits = !any_rank_over(comm, plan, limit);
    return plan;
  };
  fit.configured = measure(configured);
  fit.ladder = concessions(configured, any_sharded(module, false), any_sharded(module, true),
                           static_cast<bool>(options.set_activation_checkpointing),
                           static_cast<bool>(options.set_recompute_gelu), micro_batches);
  if (fit.fits || fit.ladder.empty()) {
    if (!fit.fits) apply(module, configured, options);
    return fit;
  }
  // The leanest schedule (every concession, the ladder's last) next: each concession only gives
  // memory back, so where the leanest does not fit none does, and the refusal costs two measures
  // rather than one per schedule, two probe steps each (`ruda-train lm` at batch 8 on one rank
  // offers 31 schedules: a d 512, 8-block, context-512 model took minutes to refuse).
  const MemoryPlan leanest = measure(fit.ladder.back());
  if (!fit.fits) {  // nothing fits: report the leanest, run the configured one
    apply(module, configured, options);
    return fit;
  }
  for (std::size_t i = 0; i + 1 < fit.ladder.size(); ++i) {
    measure(fit.ladder[i]);
    if (fit.fits) return fit;
  }
  // Only the leanest fits: measured already, applied again.
  apply(module, fit.ladder.back(), options);
  fit.schedule = fit.ladder.back();
  fit.plan = leanest;
  fit.fits = true;
  return fit;
}

std::int64_t largest_fitting_batch(const Module& module, int world_size, std::int64_t global_batch,
                                   const StepProbe& probe, std::int64_t limit, const PlanOptions& options) {
  require_world_and_batch("largest_fitting_batch", world_size, global_batch);
  require_limit("largest_fitting_batch", limit);
  require_probe("largest_fitting_batch", probe);
  // Candidates are k * world_size for k in [1, largest]: below global_batch, divisible by the world.
  const std::int64_t largest = (global_batch - 1) / world_size;
  auto fits = [&](std::int64_t k) {
    return limit <= 0 || plan_memory(module, world_size, k * world_size, probe, options).peak() <= limit;
  };
  if (largest < 1) return 0;
  if (fits(largest)) return largest * world_size;
  // The plan grows with the batch (the probe is linear in it): bisect for the last k that fits,
  // a few dozen plans even for a batch near INT64_MAX (a walk down by world_size never ended).
  std::int64_t lo = 0, hi = largest;  // fits(lo) (or lo == 0), !fits(hi)
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo * world_size;
}

int smallest_fitting_world(const Module& module, std::int64_t global_batch, const std::optional<StepProbe>& probe,
                           std::int64_t limit, const PlanOptions& options, int max_world) {
  if (max_world <= 0)
    fail<ArgumentError>("smallest_fitting_world", "max_world (the largest world size to try) must be positive, got ",
                        max_world);
  require_world_and_batch("smallest_fitting_world", max_world, global_batch);
  require_limit("smallest_fitting_world", limit);
  if (probe) require_probe("smallest_fitting_world", *probe);
  PlanOptions full = options;  // the answer is a fully sharded world
  full.shard_ranks = 0;
  // No world larger than the batch divides it (and counting to INT_MAX overflowed `world`).
  const std::int64_t last = std::min<std::int64_t>(max_world, global_batch);
  for (std::int64_t w = 1; w <= last; ++w) {
    if (global_batch % w != 0) continue;
    const int world = static_cast<int>(w);
    const MemoryPlan plan =
        probe ? plan_memory(module, world, global_batch, *probe, full) : plan_state(module, world, global_batch, full);
    if (limit <= 0 || plan.peak() <= limit) return world;
  }
  return 0;
}

std::string MemoryPlan::table(std::int64_t limit) const {
  require_limit("MemoryPlan::table", limit);
  std::string out;
  auto row = [&](const char* what, std::int64_t bytes, const std::string& note) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "  %-12s %10s  %s\n", what, memory::format_bytes(bytes).c_str(), note.c_str());
    out += buf;
  };
  // A measured plan holds the parameters not sharded whole (a dense model measured over 2 ranks
  // read "1/2 of each").
  const std::string sharded = shard_ranks > 1 ? "1/" + std::to_string(shard_ranks) + " of each" : "whole";
  const std::string share = replicated == 0 || shard_ranks <= 1 ? sharded
                            : replicated == parameters          ? "whole (not sharded)"
                                                       : sharded + " sharded one, " + memory::format_bytes(replicated) +
                                                             " of parameters whole (not sharded)";
  const std::string hybrid = shard_ranks == world_size
                                 ? ""
                                 : ", hybrid: sharded over the " + std::to_string(shard_ranks) +
                                       (shard_ranks == 1 ? " rank" : " ranks") + " of a node, replicated over " +
                                       std::to_string(world_size / shard_ranks) + " nodes";
  out += "memory plan per rank (" + std::to_string(world_size) + (world_size > 1 ? " ranks" : " rank") + hybrid +
         // A step of micro-batches is planned for one of them (the schedule names their count).
         (probe.accumulating ? ", micro-batch " : ", local batch ") + std::to_string(local_batch) +
         (schedule.empty() ? "" : "; " + schedule) + "):\n";
  row("parameters", parameters, share);
  row("gradients", gradients, share);
  row("optimizer", optimizer, share);
  if (measured()) {
    row("step", step, "gathered weights, activations, batch (measured)");
  } else {
    row("step", gathered, "at least: the largest gathered weight (activations not measured)");
  }
  row(measured() ? "peak" : "peak, at least", peak(), limit > 0 ? "limit " + memory::format_bytes(limit) : "no limit");
  return out;
}

}  // namespace ruda::nn
