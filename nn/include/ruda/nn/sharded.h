// Fully sharded parameters (ZeRO-3 / FSDP): every rank holds 1/N of each parameter, its gradient
// and its optimizer state, and gathers a layer's full weights only while that layer computes.
//
// Layout: a parameter of `numel` logical elements is flattened and cut into world_size equal
// slices of ceil(numel / world_size) elements; rank r owns logical elements
// [r*s, min((r+1)*s, numel)). Padding lies only after the last logical element and is zero, so
// trailing ranks may hold padding only (numel < world_size).
//
// Gradients: gather's backward is a reduce-scatter SUM into the local gradient. The global loss is
// the sum of the ranks' losses, so normalize each rank's loss by the GLOBAL sample/token count
// before backward (see global_count) and never all-reduce these gradients again.
//
// Collective discipline: every rank must run the same collective-bearing layers in the same
// order. Each gather records an always-run node, so every gathered parameter is reduce-scattered
// once per backward (with zeros when the loss did not reach it on this rank), in reverse gather
// order on every rank; with Recompute, every op that saved a gathered weight runs in backward too.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ruda/collectives.h>
#include <ruda/nn/module.h>

namespace ruda::nn {

class Linear;
class Embedding;
class ShardGroup;  // the parameters one fully_shard call took (private to nn)

/// A sharding or shard-topology error (bad world size, rank, slice length, communicator mismatch).
class ShardingError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

/// What the backward of an op that used a gathered weight keeps.
enum class CheckpointStrategy {
  retain,     // the gathered full weight, from forward to backward (more memory, one gather fewer)
  recompute,  // only the shard: the weight is gathered again in backward ("reshard after forward")
};

constexpr bool is_valid(CheckpointStrategy strategy) noexcept {
  switch (strategy) {
    case CheckpointStrategy::retain:
    case CheckpointStrategy::recompute:
      return true;
  }
  return false;
}

/// How the weight all-gather moves the shards.
enum class GatherQuantization : std::uint8_t {
  none,  // in the compute dtype
  /// int8 codes with one f32 scale per block of kQuantizationBlock elements (ZeRO++'s qwZ): each
  /// rank quantizes its own slice of each parameter, in blocks of that parameter alone (symmetric,
  /// scale = max|x| / 127), from its current values at every gather, and every rank dequantizes
  /// into the compute dtype: about 1/4 of the f32 bytes. Only
  /// the gathered values are approximate (each element within scale / 2, plus half a unit of a
  /// 16-bit compute dtype where the dequantized value is rounded to it): parameters, gradients
  /// and optimizer state stay in full precision, and the gradient's reduce-scatter is not
  /// quantized. A NaN or infinity in a slice is a ShardingError on every rank naming the parameter.
  int8,
};
constexpr bool is_valid(GatherQuantization q) noexcept {
  switch (q) {
    case GatherQuantization::none:
    case GatherQuantization::int8:
      return true;
  }
  return false;
}
/// Elements per int8 quantization block (each with its own scale).
inline constexpr std::int64_t kQuantizationBlock = 2048;

/// `x` (any float dtype, any shape; read as a flat sequence) as int8 codes with one f32 scale per
/// block of `block` elements (the last block may be short): scale = max|x| / 127 over the block (0
/// for a block of zeros, rounded up where the quotient rounds below max|x| / 127.5 among subnormals),
/// code = round(x / scale): each value within scale / 2. A block with a non-finite value gets a NaN
/// scale (it dequantizes as NaN) and codes that mark its non-finite elements (1) and the others (0).
/// Values are read in f32: an f64 value beyond f32's range counts as an infinity, one below its
/// smallest subnormal as 0.
struct Int8Blocks {
  std::vector<std::int8_t> codes;
  std::vector<float> scales;
};
Int8Blocks quantize_int8(const Tensor& x, std::int64_t block = kQuantizationBlock);
/// The values `blocks` stands for, as a 1-D tensor of `dtype`: code x its block's scale.
Tensor dequantize_int8(const Int8Blocks& blocks, DType dtype, std::int64_t block = kQuantizationBlock);

struct ShardPolicy {
  CheckpointStrategy strategy = CheckpointStrategy::recompute;
  /// Cast the local slice to this dtype before gathering (e.g. bf16): the gather moves the narrow
  /// dtype and the layer computes in it; the stored parameter keeps its dtype.
  std::optional<DType> compute_dtype = std::nullopt;
  /// How 16-bit gradient sums accumulate in the reduce-scatter: in f32 with one rounding
  /// (ruda's default), or in the 16-bit compute dtype itself (the reference implementation's behaviour).
  /// Hybrid sharding rounds twice: the node's reduce-scatter delivers its sum in the 16-bit dtype,
  /// and the all-reduce across nodes accumulates those sums (in f32, per this setting) and rounds again.
  Accumulate reduce = Accumulate::f32;
  /// How the weight all-gather moves the shards (int8: ZeRO++'s qwZ; grouped parameters only).
  GatherQuantization gather_quantization = GatherQuantization::none;
};

/// Sharding metadata of a Param (its data is the local slice).
struct ShardInfo {
  Shape logical_shape;
  std::int64_t numel = 0;       // logical elements
  std::int64_t shard_size = 0;  // ceil(numel / world_size): the local slice's length
  int rank = 0;
  int world_size = 1;
  ShardPolicy policy;
  /// The communicator Param::value() gathers through (set by fully_shard; may be null).
  Communicator* comm = nullptr;
  /// comm's liveness(): a communicator destroyed while the model is still used is a
  /// ShardingError at the next Param::value() (or gradient norm), not a read of freed memory.
  std::weak_ptr<const void> comm_alive;
  /// Hybrid sharding: the communicator across nodes over which the reduced gradient shard is
  /// all-reduced (the parameter is replicated over it); null under full sharding.
  Communicator* replicate = nullptr;
  /// Hybrid: the gradient holds sums of this node's ranks only (a backward without the all-reduce
  /// across nodes, set_requires_all_reduce): the next all-reduce includes it.
  bool gradient_partial = false;
  /// Hybrid accumulation: the complete (already all-reduced) gradient the parameter held when
  /// backwards without the all-reduce began to add node-partial sums to it, set aside so that
  /// only those sums cross nodes at the next all-reduce; added back after it (or when that
  /// backward takes its gradient back). Param::zero_grad (and so Module's and the optimizers')
  /// drops it with the gradient.
  Tensor complete_gradient;
  /// The backward (autograd::backward_serial) whose reduction gave the parameter its gradient
  /// where it had none: taken back at that backward's end if no rank's loss reached the parameter.
  std::uint64_t gradient_made_by = 0;
  /// Names the parameter in collective tags and messages ("layers.2.weight").
  std::string name;
  /// The group that gathers it with the rest of its module (set by fully_shard), and its place
  /// there; null on the per-parameter path (ShardedParameter, the seed-style layers).
  std::shared_ptr<ShardGroup> group;
  std::size_t group_index = 0;
  /// The module whose fully_shard call sharded it (null for the seed-style layers): a later call on
  /// that same module with another policy would shard nothing, and is refused. Only compared,
  /// never dereferenced.
  const void* sharded_by = nullptr;

  /// The layout of a tensor of `logical_shape` at `rank` of `world_size`: slices of
  /// ceil(numel / world_size) elements in rank order, the last ones short or empty. Every sharded
  /// tensor (parameters, checkpoint pieces, the memory plan's figures) follows it.
  static ShardInfo layout(const Shape& logical_shape, int rank, int world_size);
  /// Logical elements held by this rank (the rest of its slice is padding).
  std::int64_t real_elements() const;
  /// Offset of this rank's first element in the flattened logical tensor.
  std::int64_t offset() const { return static_cast<std::int64_t>(rank) * shard_size; }
  /// "parameter 'layers.2.weight' [4, 3]", or "an unnamed parameter [4, 3]", for messages.
  std::string describe() const;
  /// ShardingError naming `op` where `comm`'s rank or world size are not this shard's (a gather or
  /// a norm over another communicator would pair other ranks' slices).
  void require_communicator(const char* op, const Communicator& comm) const;
};

class ShardedParameter {
 public:
  /// A parameter from an already loaded local slice (no full tensor needed: how sharded
  /// checkpoints load). Validates topology (world_size > 0, 0 <= rank < world_size), the logical
  /// shape (non-empty, every extent > 0, element count without overflow), the slice (1-D of
  /// length ceil(numel / world_size)) and its dtype (f32, f64, f16 or bf16), each with a
  /// ShardingError (or DTypeError) naming what is wrong.
  static ShardedParameter from_local(const Param& local, const Shape& logical_shape, int rank, int world_size);
  /// This rank's slice of a loaded full value: a new leaf (no graph to the source) with the same
  /// parameter id and requires_grad. Tied parameters share one id and so one local storage.
  /// `name` names it in collective tags and messages (default: unnamed).
  static ShardedParameter from_full(const Param& full, int rank, int world_size, const std::string& name = {});

  /// The full tensor, gathered through `comm` (whose rank and world size must match), in the
  /// stored dtype. Backward: reduce-scatter SUM into the local gradient.
  Tensor gather(Communicator& comm) const;
  /// The same, cast to `dtype` before the gather (the gather moves the narrow dtype, its backward
  /// reduce-scatters in it); the stored dtype does not change.
  Tensor gather_with_compute_dtype(Communicator& comm, DType dtype) const;

  const Param& param() const noexcept { return param_; }
  const ShardInfo& info() const { return *param_.shard(); }
  ShardInfo& info() { return *param_.shard(); }
  const Shape& logical_shape() const { return info().logical_shape; }
  int rank() const { return info().rank; }
  int world_size() const { return info().world_size; }

 private:
  explicit ShardedParameter(Param param) : param_(std::move(param)) {}
  Param param_;
};

/// Gathers a sharded Param's full value through `comm` with its policy (and an optional compute
/// dtype overriding the policy's). Throws ShardingError if comm's rank or world size differ.
Tensor gather_param(const Param& param, Communicator& comm, std::optional<DType> compute_dtype = std::nullopt);

/// All-gather of 1-D local slices as a node of the autograd graph (backward: reduce-scatter SUM),
/// always run: where no rank's loss reached the gathered value, `local` gets a gradient of zeros
/// (gather_param, which knows the parameter, takes such a gradient back at the backward's end).
/// Communicator::all_gather is the plain collective, which autograd does not see. `owner` (what the slice belongs to,
/// e.g. its parameter's shard info): once it is destroyed the pending node is dropped rather than run in a later,
/// unrelated backward (RecordOptions::owner).
Tensor differentiable_all_gather(const Tensor& local, Communicator& comm, const CollectiveOptions& options = {},
                                 std::weak_ptr<const void> owner = {});

/// Whether a schedule overlaps communication with compute: prefetching the next group's
/// all-gather and letting reduce-scatters run while backward goes on. Overlap needs a core for
/// communication to progress on; where compute has them all, it can make a step slower.
enum class Overlap {
  /// Measured: the first steps alternate overlapping and synchronous collectives (three of each,
  /// after the first), the ranks agree on the slower rank's medians with one all-reduce, and the
  /// faster way stays. Never slower than synchronous collectives, beyond those trial steps.
  automatic,
  on,
  off,  // no prefetch; each collective runs on the calling thread (blocking), no hand-off
};
constexpr bool is_valid(Overlap overlap) noexcept {
  switch (overlap) {
    case Overlap::automatic:
    case Overlap::on:
    case Overlap::off:
      return true;
  }
  return false;
}

/// What a schedule decided (overlap_report).
struct OverlapReport {
  bool decided = false;  // automatic, and its trial is over (or on/off from the start)
  bool overlapping = true;
  double step_seconds_overlapping = 0, step_seconds_synchronous = 0;  // the trial's medians (automatic)
};

/// How fully_shard groups a module's parameters and schedules their collectives.
struct FullyShardOptions {
  ShardPolicy policy = {};
  /// One group per call: the module's parameters gathered by one all-gather and their gradients
  /// reduced by one reduce-scatter (per compute dtype). Off: each parameter is gathered and
  /// reduce-scattered on its own, as ShardedParameter does.
  bool group = true;
  /// Issue the next group's all-gather (in forward order; the previous group's in a backward
  /// that gathers again) before this group computes, so that it travels while this one computes.
  bool prefetch = true;
  /// Overlap communication with compute (prefetch, reduce-scatters in flight): measured, on or off.
  Overlap overlap = Overlap::automatic;
  /// At most this many groups hold full weights (or a gather in flight) at once, not counting the
  /// groups whose modules enclose the one computing (a root stays unsharded while its blocks
  /// compute): peak memory is the shards + the enclosing groups + this many of the largest group
  /// + activations.
  int max_unsharded_groups = 2;
  /// Hybrid sharding (FSDP2's HSDP): the communicator across nodes (ShardMesh::replicate()). The
  /// parameters are sharded over the communicator given to fully_shard (the node's,
  /// ShardMesh::shard()) and replicated over this one: every all-gather stays inside the node; each
  /// group's gradient is reduce-scattered inside the node and its shard then all-reduced across
  /// nodes, without waiting, while backward goes on. Both collectives SUM (no divide): with each
  /// rank's loss divided by the global count, the sum is the gradient. Null: full sharding. Set by
  /// the ShardMesh overload of fully_shard (from ShardMesh::replicate()), which has checked that
  /// the two communicators tile the world; the Communicator overload refuses it (ShardingError).
  /// Needs `group`.
  Communicator* replicate = nullptr;
};

/// Shards the parameters of `module` (recursively, tied parameters once) that no earlier call
/// sharded over `comm` in place, as one group: each Param keeps its id but holds this rank's
/// slice, and Param::value() gathers its group through comm. Apply it bottom-up, like FSDP2:
/// each block first, then the root, which takes what is left (embeddings, final norm, head) and
/// the blocks' groups into its schedule; the group and schedule options of the last call apply.
/// Any module can be sharded this way; the optimizer must be created afterwards. Returns the
/// number of parameters sharded by this call. A policy applies to the parameters its call
/// shards: a call on a module an earlier call sharded whole, with another policy (a compute dtype
/// added later), would shard nothing and is a ShardingError.
std::size_t fully_shard(Module& module, Communicator& comm, const FullyShardOptions& options);
std::size_t fully_shard(Module& module, Communicator& comm, ShardPolicy policy = {});
/// Hybrid sharding over `mesh`: sharded over mesh.shard() (inside a node), replicated over
/// mesh.replicate() (across nodes); see FullyShardOptions::replicate. The mesh must outlive the
/// module's use. Each rank then holds 1/ranks_per_node of the parameters, gradients and optimizer
/// state: with one rank per node this is plain data parallelism. Replicated (non-sharded)
/// parameters still take broadcast_replicated / all_reduce_replicated_gradients over mesh.world();
/// clip_grad_norm takes mesh.shard() (the shards of one replica make the whole).
std::size_t fully_shard(Module& module, const ShardMesh& mesh, FullyShardOptions options = {});

/// Drops the full weights the groups of `module`'s schedule hold (and gathers they prefetched).
/// A group keeps its weights after its forward until the limit, a backward or the next forward
/// needs the room, so that a weight used twice in one pass (a tied head) is gathered once; call
/// this after an evaluation under no_grad to give that memory back at once.
void reshard(const Module& module);

/// What the schedule of `module`'s groups decided about overlap (not decided: no group yet, or
/// the trial is still running).
OverlapReport overlap_report(const Module& module);

/// Changes, after fully_shard, how many groups of `module`'s schedule may hold full weights at
/// once (FullyShardOptions::max_unsharded_groups, at least 1). Drops the weights held now. A
/// module with no parameter sharded in a group (dense, or sharded per parameter) is a ShardingError.
void set_max_unsharded_groups(const Module& module, int groups);
/// Changes what backward keeps of the gathered weights of `module`'s sharded parameters
/// (ShardPolicy::strategy), for the forwards that follow. A module with no sharded parameter is a
/// ShardingError.
void set_checkpoint_strategy(const Module& module, CheckpointStrategy strategy);

/// Gradient accumulation under hybrid sharding (FSDP2's set_requires_all_reduce): with `required`
/// off, the backwards that follow reduce-scatter each group's gradient inside the node and add it to
/// the sharded gradients without the all-reduce across nodes; the next backward with it on
/// all-reduces the accumulated shard (its own part added to what the backwards before it left)
/// once. So K micro-batches with it off for all but the last cost one cross-node all-reduce, and
/// give the gradient of one batch of their union (each micro-batch's loss still divided by the
/// global count). On by default; no effect under full sharding, where every backward only
/// reduce-scatters anyway.
void set_requires_all_reduce(const Module& module, bool required);

/// Fixes the order in which the groups of `modules` (each given to fully_shard, all in one
/// schedule) run in forward, for prefetching; by default it is recorded in the first forward.
void set_forward_order(const std::vector<const Module*>& modules);

// --- parameters left replicated (plain data parallelism) ---
// A model may shard only some layers (say, FullyShardedLinear for the big ones) and keep the rest
// whole on every rank. Those replicated parameters need the classic data-parallel treatment:
// the same initial value everywhere, and gradients summed over the ranks after each backward.

/// Copies rank `root`'s value of every replicated (non-sharded) parameter of `module` to all
/// ranks, so that ranks which initialized differently start alike. Returns how many it copied.
std::size_t broadcast_replicated(const Module& module, Communicator& comm, int root = 0);

/// Sums the gradients of every replicated parameter of `module` over the ranks (all-reduce SUM,
/// one flat buffer per dtype), in place; call it after backward and before clipping or the
/// optimizer step. With each rank's loss divided by the GLOBAL count (global_count), the sum is
/// the gradient of the global loss, as for sharded parameters. A parameter that got no gradient
/// on this rank takes part with zeros, so the ranks never disagree on the collective; one that got
/// none on any rank keeps none (the optimizer skips it, as in the dense model). Sharded
/// parameters are skipped (their gathers' backward already reduce-scattered them), and so are
/// frozen ones (requires_grad off). Returns the number of parameters summed.
std::size_t all_reduce_replicated_gradients(const Module& module, Communicator& comm);

/// x @ W + b with W sharded ([input, output] layout) and an optional sharded bias [output].
class FullyShardedLinear : public Module {
 public:
  /// Converts a loaded dense layer (create the optimizer after this). `name` ("blocks.2.fc1")
  /// prefixes the parameters' names in collective tags and error messages ("blocks.2.fc1.weight").
  static std::shared_ptr<FullyShardedLinear> from_full(const Linear& layer, int rank, int world_size,
                                                       ShardPolicy policy = {}, const std::string& name = {});
  /// Over any leading axes of x; gathers the weights through comm for this call.
  Tensor forward(const Tensor& x, Communicator& comm) const;
  const Param& weight() const { return weight_; }
  const Param& bias() const { return bias_; }

 private:
  Param weight_, bias_;
};

/// Rows of a sharded [vocabulary, features] table by i64 indices [batch, seq] -> [batch, seq, features].
class FullyShardedEmbedding : public Module {
 public:
  /// As FullyShardedLinear::from_full.
  static std::shared_ptr<FullyShardedEmbedding> from_full(const Embedding& layer, int rank, int world_size,
                                                          ShardPolicy policy = {}, const std::string& name = {});
  Tensor forward(const Tensor& indices, Communicator& comm) const;
  const Param& weight() const { return weight_; }

 private:
  Param weight_;
};

}  // namespace ruda::nn
