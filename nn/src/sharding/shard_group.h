// Shard groups: the unit of communication of fully sharded parameters (private to nn).
//
// One fully_shard call makes one ShardGroup of the module's parameters that no group holds yet.
// A group unshards all its parameters with one all-gather per bucket (parameters of one compute
// dtype and reduce policy; usually the whole group) and reduces all their gradients with one
// reduce-scatter per bucket. The per-parameter layout does not change: each parameter is still
// cut into world_size slices, so checkpoints, optimizers and resharding see no difference. Only
// the wire format does: a rank's part of a bucket is its slices back to back, so the gathered
// buffer is [rank 0: p0 p1 ...][rank 1: p0 p1 ...]..., and the copy-out picks each parameter's
// columns.
//
// The schedule, in the order a step meets it (ShardGroup::value is the only entry: layers call
// Param::value(), and the first call of a pass for any parameter of a group is its pre-forward):
//   pre-forward   wait for this group's prefetched all-gather, or issue it; reshard groups beyond
//                 the limit (least recently unsharded first, never one that encloses this one);
//                 issue the all-gather of the next group in forward order.
//   post-forward  nothing to do: the group stays unsharded until the limit drops it (Retain keeps
//                 its values in the graph anyway; Recompute keeps a recipe). Groups still
//                 unsharded when the backward begins (the forward's last ones, the root) keep their
//                 values for it, so their recipes gather nothing.
//   pre-backward  the first recompute recipe of the group unshards it again (or takes the
//                 prefetched gather) and issues the all-gather of the group before it.
//   post-backward the group's gradient nodes have all run: copy the gradients into one buffer and
//                 issue its reduce-scatter without waiting; the one before it is finished then
//                 (at most two in flight), and the end of the backward finishes the rest, writing
//                 each parameter's slice into its gradient.
// Every rank runs the same program, so every rank issues the same collectives in the same order.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ruda/collectives.h>
#include <ruda/nn/sharded.h>

#include "model/param_state.h"

namespace ruda::nn {

class ShardSchedule;

/// A parameter whose full value takes at least this many bytes (in its compute dtype) is a bucket
/// of its own: gathered straight into its full tensor and reduced straight from its gradient. On a
/// CPU, batching it with others costs more than the collective's latency that batching saves: its
/// copy-out and its gradient's copy-in are memory traffic the size of the weight. Measured with
/// ruda-train mlp over 2 MPI ranks (whose Linear layers' weights are 31 KB... 4 MB): copying
/// every weight through a group's buffer took 6.5 ms of CPU time per step more per rank (13.0
/// s against 9.9 s for an epoch); a small parameter's own all-gather costs ~5 us.
constexpr std::size_t kOwnBucketBytes = std::size_t{256} << 10;

/// Parameters of a group gathered by one collective: one compute dtype and one reduce policy, and
/// either all the group's small parameters or one large one (kOwnBucketBytes).
struct ShardBucket {
  DType dtype = DType::f32;
  Accumulate accumulate = Accumulate::f32;
  bool alone = false;                 // one parameter of at least kOwnBucketBytes
  bool int8 = false;                  // gathered as int8 codes and scales (GatherQuantization::int8)
  std::vector<std::size_t> members;   // indices into the group's parameters
  std::vector<std::int64_t> offsets;  // each member's offset in one rank's part
  std::int64_t part = 0;              // one rank's part: the members' slices back to back
};

/// An all-gather of a group, issued and not yet copied out.
struct PendingGather {
  std::vector<ShardBucket> buckets;
  std::vector<Work> works;              // one per bucket
  std::vector<Tensor> sources;          // the parameters' local data as gathered (to notice a replacement)
  std::vector<std::uint64_t> versions;  // and its versions (to notice an in-place update)
};

/// A communicator the sharded model keeps by address after fully_shard returns, with the token
/// that expires when it is destroyed (Communicator::liveness()). Reached only through get(),
/// which raises a ShardingError naming the operation where the communicator (or the ShardMesh
/// that owned it) is gone, instead of calling into freed memory; address() compares identities.
class CommRef {
 public:
  CommRef() = default;
  explicit CommRef(Communicator* comm) : comm_(comm), alive_(comm ? comm->liveness() : std::weak_ptr<const void>()) {}
  Communicator* address() const noexcept { return comm_; }
  explicit operator bool() const noexcept { return comm_ != nullptr; }
  /// The communicator; ShardingError "<op>: <of>: ..." where it was destroyed.
  Communicator& get(std::string_view op, std::string_view of) const {
    if (alive_.expired()) {
      fail<ShardingError>(op, of,
                          ": the communicator the model was sharded over (fully_shard) was destroyed: keep "
                          "it, and a ShardMesh, alive while the model is used");
    }
    return *comm_;
  }

 private:
  Communicator* comm_ = nullptr;
  std::weak_ptr<const void> alive_;
};

/// A parameter that no rank's loss may have reached in a backward (a shard group's member, a
/// parameter gathered on the per-parameter path): whether this rank's loss reached it, and whether
/// this backward gave it the gradient it has (it had none before).
struct ReachCandidate {
  std::weak_ptr<Param::State> param;
  bool reached = false;
  bool made_now = false;
};

/// The end of a backward: sums the candidates' reached flags over `comm`, then `replicate` (hybrid
/// sharding; may be null), one small all-reduce each, tagged `tag`; every rank passes the same
/// candidates in the same order. Every rank reduce-scatters every gradient (zeros for what its
/// loss did not reach), so a parameter no rank's loss reached got a gradient of zeros: where this
/// backward made it, it is taken back, unless a loss term on the local slice added to it
/// (autograd::loss_reached), so that the optimizer skips the parameter as it skips the dense
/// model's (no weight decay, no momentum step, its own step count).
void take_back_unreached(const std::vector<ReachCandidate>& candidates, Communicator& comm, Communicator* replicate,
                         const std::string& tag);

/// Where the gradient nodes of one unshard deposit: each use of a full value in a pass records a
/// node (so that separate graphs free theirs separately); the nodes of a bucket sum into one
/// gradient per parameter, and when the last has run, the bucket's gradients go into one buffer
/// and one reduce-scatter. Holds no full value (the values' nodes hold the sink), so nothing keeps
/// a gathered weight alive through it.
struct GradientSink : std::enable_shared_from_this<GradientSink> {
  CommRef comm;
  CommRef replicate;  // hybrid: each reduced shard is all-reduced over it
  std::string tag;
  std::vector<std::weak_ptr<Param::State>> params;  // weak: a parameter's shard info holds its group
  std::vector<ShardBucket> buckets;
  std::vector<std::size_t> bucket_of;  // per member of the group
  std::vector<int> nodes;              // per bucket: the nodes recorded
  std::vector<int> remaining;          // per bucket: nodes still to run in this backward
  std::vector<Tensor> grads;           // per member: the sum deposited in this backward
  /// Per member: its deposited gradient was autograd's alone (a fresh product's, or a sum of
  /// uses): once the node that deposited it returns, the sink's handles are the only ones.
  std::vector<char> fresh;
  /// Per bucket: what its reduce-scatter returned is fresh deposits' storage (world size 1 hands
  /// the bucket's one gradient back as it is), so that no other tensor can see it change.
  std::vector<char> handed_fresh;
  std::vector<Work> works;        // per bucket: the reduce-scatter in flight
  std::vector<Work> all_reduces;  // per bucket (hybrid): the all-reduce across nodes in flight
  std::vector<Tensor> reduced;    // per bucket (hybrid): the node's sum, kept without an all-reduce
  /// Per member (hybrid): its gradient's earlier partial sums went into the all-reduce, whose
  /// result replaces the gradient instead of adding to it.
  std::vector<char> replaces;
  /// Per member, in this backward: a node the loss reached deposited (autograd::reached).
  std::vector<char> reached;
  std::weak_ptr<ShardGroup> group;
  std::uint64_t serial = 0;  // the backward (autograd::backward_serial) being counted
  bool started = false;      // a backward has run some of its nodes: it takes no further use

  /// A use's node ran: `grad` is its gradient, zeros where `from_loss` is false (an always-run
  /// node the loss did not reach), which then counts only towards the bucket's nodes.
  void deposit(std::size_t index, const Tensor& grad, bool from_loss);
  /// The end of a backward: issues what a node that did not run left unissued (a graph run by
  /// two backwards), waits for the reduce-scatters and adds each slice to its parameter's
  /// gradient.
  void flush();
  /// Hybrid: waits for the reduce-scatters in flight and starts the all-reduce of each reduced
  /// shard across nodes, without waiting. Nothing to do under full sharding.
  void reduce_across();
  /// Waits for the reduce-scatters (and all-reduces) in flight and adds each slice to its
  /// parameter's gradient.
  void finish();

 private:
  void issue(std::size_t bucket);
  /// Adds (or, for members in `replaces`, writes) each member's piece of `reduced` to its gradient.
  void accumulate(std::size_t bucket, const Tensor& reduced);
};

class ShardGroup : public std::enable_shared_from_this<ShardGroup> {
 public:
  ShardGroup(const Module* module, const std::vector<Param>& params, Communicator& comm, Communicator* replicate,
             std::shared_ptr<ShardSchedule> schedule);
  ~ShardGroup();
  ShardGroup(const ShardGroup&) = delete;
  ShardGroup& operator=(const ShardGroup&) = delete;

  /// The full value of the group's parameter `index` (ShardInfo::group_index) for computing,
  /// unsharding the whole group first unless it is unsharded for this pass already.
  Tensor value(std::size_t index);

  const std::string& name() const noexcept { return name_; }
  const Module* module() const noexcept { return module_; }
  std::size_t size() const noexcept { return params_.size(); }
  /// The group's parameter `index` (ShardingError if its module was destroyed).
  Param param(std::size_t index) const;
  /// The communicator it is sharded over, for identity comparisons only (CommRef).
  Communicator* comm() const noexcept { return comm_.address(); }
  /// Hybrid sharding: the communicator across nodes, for identity comparisons; null under full sharding.
  Communicator* replicate() const noexcept { return replicate_.address(); }
  const std::shared_ptr<ShardSchedule>& schedule() const noexcept { return schedule_; }
  void join(std::shared_ptr<ShardSchedule> schedule) noexcept { schedule_ = std::move(schedule); }
  /// The group whose module encloses this one's (made by a later fully_shard on an ancestor),
  /// null when there is none or it was destroyed (its parameters were: a replaced head's).
  std::shared_ptr<ShardGroup> parent() const noexcept { return parent_.lock(); }
  void set_parent(const std::shared_ptr<ShardGroup>& parent) noexcept { parent_ = parent; }
  /// Whether this group's module encloses `other`'s.
  bool encloses(const ShardGroup& other) const noexcept;
  /// Names the group in collective tags and messages: "group 'blocks.0' (12 parameters: ...)".
  const std::string& tag() const noexcept { return tag_; }
  /// Derives the name and tag from the parameters' names (again after an enclosing fully_shard
  /// renamed them relative to its module).
  void rename();

  // --- for the schedule ---
  /// Holds full values or a gather in flight.
  bool unsharded() const noexcept { return values_ != nullptr || prefetch_.has_value(); }
  /// Issues this group's all-gather without waiting (a prefetch).
  void start_prefetch();
  /// Drops a prefetched gather not used (it still completes, every rank took part).
  void drop_prefetch() noexcept;
  /// Hybrid: all-reduces over `replicate` the gradients that still hold node-local partial sums.
  void all_reduce_partial_gradients(Communicator& replicate);
  /// Whether any parameter's backward gathers again (Recompute).
  bool regathers_in_backward() const;
  /// Drops the full values and a prefetch not used (it still completes, every rank took part).
  void reshard() noexcept;
  /// When a phase begins: a backward takes the forward's values still held (no second gather);
  /// a forward drops a backward's.
  void reshard_unless(bool backward) noexcept;
  /// Post-backward: `sink`'s reduce-scatters were issued.
  void finished_backward(const GradientSink& sink) noexcept;
  /// The backward (autograd::backward_serial) whose post-backward this group last had.
  std::uint64_t backward_done() const noexcept { return backward_done_; }

 private:
  struct Values;
  std::vector<ShardBucket> make_buckets() const;
  PendingGather start_gather() const;
  std::shared_ptr<Values> finish_gather(PendingGather gather, bool backward);
  std::shared_ptr<GradientSink> make_sink(const std::vector<ShardBucket>& buckets);
  /// One use of the unsharded value: with grad on, a node of its own into the sink.
  Tensor use(std::size_t index);
  bool usable(const Values& values, bool backward) const;
  /// Whether the parameters still hold these local tensors at these versions.
  bool current(const std::vector<Tensor>& sources, const std::vector<std::uint64_t>& versions) const;

  std::string name_, tag_;
  const Module* module_;
  std::vector<std::weak_ptr<Param::State>> params_;  // weak: each parameter's shard info holds the group
  CommRef comm_;
  CommRef replicate_;
  // Weak: the parent is owned by its own parameters' shard info, and dies with them while this
  // group lives on (a root's head replaced after fully_shard); a raw pointer was read after free
  // by every forward (encloses) and by the next fully_shard.
  std::weak_ptr<ShardGroup> parent_;
  std::shared_ptr<ShardSchedule> schedule_;
  std::uint64_t ordinal_ = 0;  // its communicator's next_ordinal() when made
  std::shared_ptr<Values> values_;
  std::optional<PendingGather> prefetch_;
  std::uint64_t backward_done_ = 0;
};

/// The groups that run in one forward pass (a root and the groups under it): the forward order,
/// which of them are unsharded, the limit, and the reduce-scatters in flight.
class ShardSchedule : public std::enable_shared_from_this<ShardSchedule> {
 public:
  ShardSchedule(Communicator& comm, const FullyShardOptions& options) : comm_(&comm) { set_options(options); }

  void set_options(const FullyShardOptions& options) {
    replicate_ = CommRef(options.replicate);
    prefetch_ = options.prefetch;
    max_unsharded_ = options.max_unsharded_groups;
    overlap_ = options.overlap;
    report_ = OverlapReport{.decided = overlap_ != Overlap::automatic, .overlapping = overlap_ != Overlap::off};
  }
  void set_max_unsharded(int groups) noexcept { max_unsharded_ = groups; }
  /// Hybrid: whether backward all-reduces the reduced shards across nodes (set_requires_all_reduce).
  void set_requires_all_reduce(bool required) noexcept { requires_all_reduce_ = required; }
  bool requires_all_reduce() const noexcept { return requires_all_reduce_; }
  const OverlapReport& overlap() const noexcept { return report_; }
  /// Whether this step overlaps (prefetch, reduce-scatters in flight): as decided, or as the
  /// automatic trial alternates.
  bool overlapping() const noexcept;
  /// While alive, this thread's steps are probes (the memory plan's): the automatic trial does
  /// not count them. Until it has decided, they run overlapping, or synchronously where
  /// `synchronous` is set: which of the two needs more memory depends on the model and the world
  /// (a 1-rank MLP's synchronous step peaked 18% above its overlapping one), so a probe that
  /// meets an undecided schedule (met_undecided) measures both and plans for the larger.
  struct Probing {
    explicit Probing(bool synchronous = false) noexcept : outer_(probe_synchronous) {
      ++probing;
      probe_synchronous = synchronous;
      if (probing == 1) probe_met_undecided = false;
    }
    ~Probing() {
      --probing;
      probe_synchronous = outer_;
    }
    Probing(const Probing&) = delete;
    Probing& operator=(const Probing&) = delete;
    /// Whether a step of this thread's probes so far ran a schedule whose trial had not decided.
    static bool met_undecided() noexcept { return probe_met_undecided; }

   private:
    bool outer_;
  };
  /// Fixes the forward order (otherwise recorded in the first forward).
  void set_forward_order(std::vector<ShardGroup*> order);
  const std::vector<ShardGroup*>& forward_order() const noexcept { return order_; }
  void add(ShardGroup* group) { groups_.push_back(group); }
  void remove(ShardGroup* group) noexcept;
  const std::vector<ShardGroup*>& groups() const noexcept { return groups_; }

  /// Before `group` unshards in this phase: drops the other phase's values, records the forward
  /// order, and reshards groups until it fits under the limit.
  void before_unshard(ShardGroup& group, bool backward);
  /// After it unsharded: prefetches its neighbour in this phase's order if the limit allows.
  void after_unshard(ShardGroup& group, bool backward);
  void resharded(ShardGroup& group) noexcept;

  /// Post-backward of a group: its reduce-scatters were issued. Finishes all but the newest two.
  void reduce_started(std::shared_ptr<GradientSink> sink);
  /// After a group's post-backward: prefetches the next group the backward must gather again,
  /// if the limit allows (the groups the backward took from the forward gather nothing, so no
  /// pre-backward of theirs issues it).
  void after_backward_of(const ShardGroup& group);
  /// A sink's first deposit in this backward: the end of the backward flushes it.
  void touched(std::shared_ptr<GradientSink> sink);
  /// Drops the values kept from the other phase when a forward or a backward begins.
  void enter_phase(bool backward);
  /// Drops every group's full values and prefetches (nn::reshard).
  void reshard_all() noexcept;

 private:
  void end_backward();
  /// After the sinks are flushed: agrees with the other ranks (one all-reduce of a flag per
  /// parameter) on which parameters no rank's loss reached, and takes back the gradients of zeros
  /// this backward gave them.
  void drop_unreached_gradients(const std::vector<std::shared_ptr<GradientSink>>& sinks);
  /// The automatic overlap trial: one more step timed; decides after enough of both kinds.
  void time_step();
  /// Finishes reduce-scatters until `keep` are in flight (hybrid: starts their all-reduces across
  /// nodes, and finishes those until `keep` are in flight).
  void finish_reductions(std::size_t keep);
  /// Unsharded groups (or prefetching) that do not enclose `computing`.
  std::size_t unsharded_around(const ShardGroup& computing) const;
  ShardGroup* neighbour(const ShardGroup& group, bool backward) const;
  /// The next group this backward will gather: by the fixed order backwards, or as the last
  /// backward gathered them; one neither unsharded nor done with this backward.
  ShardGroup* next_backward_gather() const;

  static thread_local int probing;               // Probing scopes alive on this thread
  static thread_local bool probe_synchronous;    // the innermost Probing's schedule
  static thread_local bool probe_met_undecided;  // Probing::met_undecided
  CommRef comm_;                                 // the decision's all-reduce
  CommRef replicate_;                            // hybrid: the decision's all-reduce across nodes too
  bool prefetch_ = true;
  bool requires_all_reduce_ = true;
  int max_unsharded_ = 2;
  Overlap overlap_ = Overlap::automatic;
  OverlapReport report_;
  std::vector<double> trial_[2];  // step seconds: synchronous, overlapping
  std::optional<std::chrono::steady_clock::time_point> last_end_;
  bool backward_ = false;
  bool order_fixed_ = false;
  std::vector<ShardGroup*> groups_;
  std::vector<ShardGroup*> order_;           // forward order, recorded or set
  std::vector<ShardGroup*> backward_order_;  // the groups the last backward unsharded again, in order
  std::vector<ShardGroup*> backward_seen_;   // the same, being recorded by this backward
  std::uint64_t queued_serial_ = 0;          // the backward whose end is queued
  std::vector<std::shared_ptr<GradientSink>> touched_;
  std::vector<ShardGroup*> unsharded_;  // least recently unsharded first
  std::deque<std::shared_ptr<GradientSink>> reducing_;
  std::deque<std::shared_ptr<GradientSink>> reducing_across_;  // hybrid: all-reduces in flight
};

/// Whether any parameter of `module` is sharded (`in_groups`: in a group, fully_shard's default,
/// so that the schedule settings such as set_max_unsharded_groups apply to it).
bool any_sharded(const Module& module, bool in_groups);

}  // namespace ruda::nn
