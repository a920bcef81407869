// Planning a rank's memory before the first step (ZeRO-3's contract made concrete).
//
// Each rank holds 1/N of every parameter, of its gradient and of the optimizer's state (AdamW: two
// moments per element, f32 for a 16-bit parameter), 16 bytes per f32 element over N ranks, plus,
// while a step runs, the weights gathered for the layer computing, their full gradients, and the
// activations kept for backward. The state part follows from shapes alone, so it is known for a model built under
// DeferredInit before anything is allocated. The step part depends on the model's code: it is
// measured by running the step's forward and backward on micro-batches (probe_step) and
// interpolated linearly in the local batch, which activations are.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>

#include <ruda/collectives.h>
#include <ruda/nn/module.h>
#include <ruda/nn/sharded.h>

namespace ruda::nn {

struct PlanOptions {
  /// Optimizer tensors per parameter element (AdamW: 2, SGD with momentum: 1, SGD: 0).
  int optimizer_states = 2;
  /// Each optimizer tensor of an f16/bf16 parameter is f32, as Adam's moments are
  /// (Adam::moment_dtype). false: each has its parameter's dtype, as SGD's momentum buffer.
  bool f32_states_for_16bit = true;
  /// The dtype gathers move and layers compute in (default: each parameter's own).
  std::optional<DType> compute_dtype = std::nullopt;
  /// The ranks each parameter is sharded over: under hybrid sharding the ranks of a node
  /// (ShardMesh::ranks_per_node), each node holding a replica. 0: the world size (full sharding).
  int shard_ranks = 0;
  /// The step runs several micro-batches (gradient accumulation): the earlier ones' gradients stay
  /// alive through each later backward. plan_memory with a step function then measures it so (a
  /// probe of two accumulating micro-batches); given a probe of one batch, the plan adds the
  /// gradients to the step instead (an upper bound).
  bool accumulating = false;
};

/// The transient bytes of a training step above the state held before it, as measured on this
/// rank: `fixed` + `per_sample` x local batch (the largest over the ranks).
struct StepProbe {
  std::int64_t fixed = 0;
  std::int64_t per_sample = 0;
  /// Measured as a step of accumulating micro-batches (probe_step's micro_batches > 1).
  bool accumulating = false;
  /// Saturates at INT64_MAX (a plan no limit admits) where the product or the sum overflows.
  std::int64_t at(std::int64_t local_batch) const {
    std::int64_t scaled = 0, out = 0;
    if (__builtin_mul_overflow(per_sample, local_batch, &scaled) || __builtin_add_overflow(fixed, scaled, &out))
      return INT64_MAX;
    return out;
  }
};

/// Per-rank bytes at one world size.
struct MemoryPlan {
  int world_size = 1;
  int shard_ranks = 1;  // the ranks the state is sharded over (world_size, or a node's under hybrid sharding)
  std::int64_t local_batch = 0;
  std::int64_t parameters = 0;  // this rank's slices of every parameter
  std::int64_t gradients = 0;   // their gradients (alive from the first backward on)
  std::int64_t optimizer = 0;   // the optimizer's state
  /// Of `parameters`: those held whole on every rank (a measured plan of a model not sharded, or
  /// sharded in part); the table says so instead of "1/N of each".
  std::int64_t replicated = 0;
  std::int64_t gathered = 0;  // the largest gathered weight, whole: the least a step adds
  std::int64_t step = -1;     // measured transient of a step (gathered weights + activations + batch); -1: unknown
  StepProbe probe;            // what `step` was read from, when measured
  std::string schedule;       // the schedule `step` was measured with (MemorySchedule::describe), if given
  /// The predicted peak: the state plus the step (or, unmeasured, plus `gathered` only: a lower bound).
  /// Saturates at INT64_MAX, as StepProbe::at does.
  std::int64_t peak() const {
    std::int64_t out = 0;
    for (const std::int64_t bytes : {parameters, gradients, optimizer, step >= 0 ? step : gathered}) {
      if (__builtin_add_overflow(out, bytes, &out)) return INT64_MAX;
    }
    return out;
  }
  bool measured() const { return step >= 0; }
  /// A short table, one line per part, and the total against `limit` (0: none).
  std::string table(std::int64_t limit = 0) const;
};

/// The state part of the plan for `world_size` ranks from shapes alone (works on deferred
/// parameters; allocates nothing). A frozen parameter (requires_grad off) counts no gradient and
/// no optimizer state (an optimizer given it makes none, and checkpoints save none: see
/// Optimizer::has_state). `step` stays unknown.
MemoryPlan plan_state(const Module& module, int world_size, std::int64_t global_batch, const PlanOptions& options = {});

/// Measures a step's transient bytes: `step(b)` must compute this rank's loss on b samples and
/// return it; probe_step runs its backward like a training step (gradients of the previous
/// micro-batch alive during the forward, freed before backward) at b = 1 and b = `samples`, takes
/// the largest figures over the ranks (a collective: every rank must call it), and leaves every
/// gradient cleared and the peak counter reset. Parameters are not changed, nor the Dropouts'
/// streams (their positions are put back: training after a plan draws the masks it draws
/// without one). The memory limit is suspended while it measures: the plan decides.
///
/// A step's peak is convex in the batch (the most, over the step's moments, of a constant plus a
/// multiple of the batch), so the line through the two measurements is exact at both and
/// conservative between them, but may fall short beyond `samples`: measure cheaply at 2 samples
/// to refuse what clearly does not fit, then at the local batch itself for the plan that is used.
///
/// `micro_batches` > 1 measures a step of that many micro-batches of b samples each, as a training
/// loop with gradient accumulation runs it: gradients cleared once before the first forward, each
/// backward adding to them, the peak over all of them.
StepProbe probe_step(const Module& module, Communicator& comm, const std::function<Tensor(std::int64_t)>& step,
                     std::int64_t samples = 2, int micro_batches = 1);

/// The plan at `world_size` with the measured step at that world size's local batch. A probe
/// below 0 at one sample, or falling as samples grow, is an ArgumentError (probe_step makes none).
MemoryPlan plan_memory(const Module& module, int world_size, std::int64_t global_batch, const StepProbe& probe,
                       const PlanOptions& options = {});

/// The plan at comm's world size, measured: a probe at 2 samples and, unless that already puts
/// some rank over `limit`, a second at the local batch (so the plan used is exact there, and a
/// configuration far over the limit is refused before a whole batch's activations are allocated).
/// `step` as for probe_step. Collective. The module is planned as it runs: a parameter neither
/// sharded nor deferred (a replicated one, or a model not given to fully_shard) is whole on every
/// rank, with its gradient and optimizer state (plan_state, planning before fully_shard, takes
/// every parameter as one to be sharded).
MemoryPlan plan_memory(const Module& module, Communicator& comm, std::int64_t global_batch,
                       const std::function<Tensor(std::int64_t)>& step, std::int64_t limit,
                       const PlanOptions& options = {});

/// What a sharded step may trade for memory: the knobs fit_schedule turns.
struct MemorySchedule {
  /// FullyShardOptions::max_unsharded_groups.
  int max_unsharded_groups = 2;
  /// ShardPolicy::strategy of every sharded parameter.
  CheckpointStrategy strategy = CheckpointStrategy::recompute;
  /// Whether the model recomputes its blocks in backward (FitOptions::set_activation_checkpointing).
  bool activation_checkpointing = false;
  /// Micro-batches per step (gradient accumulation, set_requires_all_reduce): each computes
  /// 1/micro_batches of the local batch. The caller runs them; fit_schedule plans for one.
  std::int64_t micro_batches = 1;
  /// Whether the model's MLPs recompute their GELU pre-activations in backward instead of keeping
  /// them (GeluBackward::recompute; FitOptions::set_recompute_gelu).
  bool recompute_gelu = false;
  /// "2 unsharded groups, recompute", with ", activation checkpointing", ", GELU recomputed" and
  /// ", 4 micro-batches" when on. `grouped` false (parameters sharded one by one, which have no
  /// groups to keep unsharded): without the groups' count.
  std::string describe(bool grouped = true) const;
  bool operator==(const MemorySchedule&) const = default;
};

struct FitOptions {
  PlanOptions plan;
  /// The most micro-batches a step may be split into (powers of 2 times the configured count that
  /// divide the local batch): the last concession, 1 (the default) offers none.
  std::int64_t max_micro_batches = 1;
  /// Turns the model's activation checkpointing on or off; empty: the model offers none.
  std::function<void(bool)> set_activation_checkpointing;
  /// Turns the recompute of the MLPs' GELU pre-activations on or off (GPT::set_gelu_backward);
  /// empty: the model offers none.
  std::function<void(bool)> set_recompute_gelu;
};

struct FittedSchedule {
  bool fits = false;
  /// The configured schedule's plan (the first measured).
  MemoryPlan configured;
  /// The chosen schedule and its plan; when nothing fits, the leanest one (every concession).
  MemorySchedule schedule;
  MemoryPlan plan;
  /// The schedules after the configured one, in the order they are offered (fewest concessions
  /// first; the last is the leanest). Empty when the module offers no concession.
  std::vector<MemorySchedule> ladder;
  /// Every schedule measured, in the order measured: the configured one; where it is over the
  /// limit, the leanest; where that fits, the ladder from its start up to the first that fits.
  std::vector<MemorySchedule> tried;
};

/// Measures the step (as plan_memory does) with `configured`, and, if some rank is over `limit`,
/// with the schedules that trade speed for memory, fewest concessions first, then in this order:
/// fewer unsharded groups (down to 1, the computing group alone), recompute instead of retain,
/// the GELU pre-activations recomputed (when offered: one GEMM more per block, one [tokens, 4d]
/// tensor less), activation checkpointing (when offered), more micro-batches (up to FitOptions::max_micro_batches;
/// `global_batch` is the whole step's, and a schedule's plan is one micro-batch's). The first schedule whose plan fits
/// on every rank is applied to `module` (sharded by fully_shard) and returned; when none fits, the configured one is
/// applied again and `fits` is false. Before the others, the leanest schedule (every concession) is measured: each
/// concession only gives memory back, so where the leanest is over the limit nothing is, and the search ends there
/// (a refusal costs two measures, not one per schedule). Collective: every rank measures the same candidates.
/// In every planner here `limit` is bytes per rank, 0 for none; a negative one is an ArgumentError,
/// as is FitOptions::max_micro_batches below 1.
FittedSchedule fit_schedule(const Module& module, Communicator& comm, std::int64_t global_batch,
                            const std::function<Tensor(std::int64_t)>& step, std::int64_t limit,
                            const MemorySchedule& configured, const FitOptions& options = {});

/// The largest global batch below `global_batch`, divisible by `world_size`, whose plan with
/// `probe` fits `limit`, or 0 if none does.
std::int64_t largest_fitting_batch(const Module& module, int world_size, std::int64_t global_batch,
                                   const StepProbe& probe, std::int64_t limit, const PlanOptions& options = {});

/// The smallest world size in 1..max_world that divides global_batch and whose plan, fully sharded
/// (options.shard_ranks is not used), fits
/// `limit`, or 0 if none does.
int smallest_fitting_world(const Module& module, std::int64_t global_batch, const std::optional<StepProbe>& probe,
                           std::int64_t limit, const PlanOptions& options = {}, int max_world = 1024);

}  // namespace ruda::nn
