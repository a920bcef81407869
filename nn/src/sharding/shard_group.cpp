// Shard groups and their schedule (see shard_group.h for the order of events).
#include "sharding/shard_group.h"

#include <algorithm>
#include <map>
#include <utility>

#include <ruda/autograd.h>

#include "sharding/gather_scope.h"
#include "sharding/quantize.h"

namespace ruda::nn {

namespace {

// A gradient of `numel` elements as the [world, slice] rows a reduce-scatter splits, with zero
// padding after the last element (as the per-parameter path pads).
Tensor as_rows(const Tensor& grad, std::int64_t numel, std::int64_t world, std::int64_t slice) {
  const Tensor flat = grad.reshape({-1});
  if (numel == world * slice) return flat.reshape({world, slice});
  Tensor padded = zeros({world * slice}, Options(flat.dtype(), &flat.backend()));
  padded.slice(0, 0, numel).copy_(flat);
  return padded.reshape({world, slice});
}

// A backward without the all-reduce across nodes is about to add its node-partial sum to `p`'s
// gradient: a complete gradient held from an earlier backward (one with the all-reduce) is set
// aside first. Left in, it crossed nodes again with the partial sums at the window's end, and
// came back multiplied by the node count (on, off, on over 2 nodes gave twice the first batch's).
void set_complete_gradient_aside(const Param& p) {
  ShardInfo& info = *p.shard();
  if (info.gradient_partial || info.complete_gradient.defined()) return;
  Tensor grad = p.data().grad();
  if (!grad.defined()) return;
  info.complete_gradient = grad;
  p.data().set_grad(Tensor());
}

// The partial sums of `p` have crossed nodes (or were taken back): the complete gradient set
// aside is added to them again.
void restore_complete_gradient(const Param& p) {
  ShardInfo& info = *p.shard();
  if (!info.complete_gradient.defined()) return;
  const Tensor held = std::exchange(info.complete_gradient, Tensor());
  Tensor grad = p.data().grad();
  if (grad.defined()) {
    grad.add_(held);
  } else {
    p.data().set_grad(held);
  }
}

}  // namespace

// --- gradients: post-backward ---

void GradientSink::deposit(std::size_t index, const Tensor& grad, bool from_loss) {
  const auto owner = group.lock();
  const std::uint64_t now = autograd::backward_serial();
  if (serial != now) {  // the first deposit of this backward
    serial = now;
    remaining = nodes;
    reached.assign(params.size(), 0);
    if (owner) {
      owner->schedule()->enter_phase(true);
      owner->schedule()->touched(shared_from_this());
    }
  }
  started = true;
  // Uses of one value in one graph arrive as the engine would sum them: the latest use first.
  if (from_loss) {
    // Whether `grad` is autograd's alone is asked now, while autograd's handle is the only other
    // one: later, from inside this node's run, ours would not be (see accumulate).
    fresh[index] = grads[index].defined() || autograd::exclusively_owned(grad);
    grads[index] = grads[index].defined() ? grads[index] + grad : grad;
    reached[index] = 1;
  }
  const std::size_t b = bucket_of[index];
  if (--remaining[b] > 0) return;
  issue(b);
  for (std::size_t other = 0; other < buckets.size(); ++other) {
    if (remaining[other] > 0) return;  // a bucket still collecting
  }
  if (owner) {
    owner->schedule()->reduce_started(shared_from_this());
    owner->finished_backward(*this);
    owner->schedule()->after_backward_of(*owner);
  }
}

void GradientSink::issue(std::size_t b) {
  // The bucket's gradients side by side as [world, part] rows, reduce-scattered without
  // waiting. A member without a node (frozen, or not used in this graph) contributes zeros.
  remaining[b] = 0;
  const ShardBucket& bucket = buckets[b];
  Communicator& c = comm.get("backward", tag);
  const std::int64_t world = c.world_size();
  std::vector<Tensor> columns;
  handed_fresh[b] = bucket.members.size() == 1 && fresh[bucket.members.front()];
  for (const std::size_t i : bucket.members) {
    const Param p = ParamAccess::lock(params[i]);
    if (!p.defined()) fail<ShardingError>("backward", "a parameter of ", tag, " was destroyed before its backward");
    const ShardInfo& info = *p.shard();
    Tensor g = std::move(grads[i]);
    grads[i] = Tensor();
    fresh[i] = 0;
    if (!g.defined()) g = zeros(info.logical_shape, Options(bucket.dtype, &p.data().backend()));
    columns.push_back(as_rows(g, info.numel, world, info.shard_size));
  }
  const Tensor rows = columns.size() == 1 ? columns.front() : concat(columns, 1);
  const CollectiveOptions options{.tag = tag, .accumulate = bucket.accumulate};
  const std::shared_ptr<ShardGroup> owner = group.lock();
  works[b] = !owner || owner->schedule()->overlapping()
                 ? c.reduce_scatter_async(rows.reshape({-1}), options)
                 : Work::completed(c.reduce_scatter(rows.reshape({-1}), options));
}

void GradientSink::flush() {
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    if (remaining[b] > 0 && remaining[b] < nodes[b]) issue(b);
  }
  finish();
  serial = 0;
}

void GradientSink::reduce_across() {
  if (!replicate) return;
  const std::shared_ptr<ShardGroup> owner = group.lock();
  const bool across = !owner || owner->schedule()->requires_all_reduce();
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    if (!works[b].valid()) continue;
    Tensor sum = works[b].wait();
    works[b] = Work();
    for (const std::size_t i : buckets[b].members) replaces[i] = 0;
    if (!across) {  // accumulating: the node's sum waits in the gradient for a later all-reduce
      reduced[b] = std::move(sum);
      continue;
    }
    // The node's sum of this shard (plus the partial sums earlier backwards left in the
    // gradients), summed over the replicas: SUM, as the reduce-scatter (each rank's loss is
    // already divided by the global count).
    const ShardBucket& bucket = buckets[b];
    // `sum` may be the gradient autograd handed over (world size 1): add to a copy, in the
    // gradients' dtype (a bf16 compute dtype would round the partial sums).
    bool own = false;
    for (std::size_t m = 0; m < bucket.members.size(); ++m) {
      const Param p = ParamAccess::lock(params[bucket.members[m]]);
      if (!p.defined() || !p.shard()->gradient_partial) continue;
      p.shard()->gradient_partial = false;
      const Tensor held = p.data().grad();
      if (!held.defined()) continue;
      if (!own) sum = held.dtype() == sum.dtype() ? sum.clone() : cast(sum, held.dtype());
      own = true;
      const std::int64_t begin = bucket.offsets[m];
      Tensor piece = sum.slice(0, begin, begin + p.shard()->shard_size);
      piece.add_(held.dtype() == piece.dtype() ? held : cast(held, piece.dtype()));
      replaces[bucket.members[m]] = 1;
    }
    all_reduces[b] =
        replicate.get("backward", tag)
            .all_reduce_async(sum, Reduction::sum, {.tag = tag + " across nodes", .accumulate = bucket.accumulate});
  }
}

void GradientSink::finish() {
  autograd::NoGradGuard no_grad;
  reduce_across();
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    if (reduced[b].defined()) {  // hybrid, accumulating: node-local partial sums
      const Tensor sum = std::move(reduced[b]);
      reduced[b] = Tensor();
      for (const std::size_t i : buckets[b].members) {
        if (const Param p = ParamAccess::lock(params[i]); p.defined() && p.data().requires_grad())
          set_complete_gradient_aside(p);
      }
      accumulate(b, sum);
      for (const std::size_t i : buckets[b].members) {
        if (const Param p = ParamAccess::lock(params[i]); p.defined()) p.shard()->gradient_partial = true;
      }
      continue;
    }
    Work& work = replicate ? all_reduces[b] : works[b];
    if (!work.valid()) continue;
    const Tensor sum = work.wait();
    work = Work();
    accumulate(b, sum);
    if (replicate) {
      for (const std::size_t i : buckets[b].members) {
        if (const Param p = ParamAccess::lock(params[i]); p.defined()) restore_complete_gradient(p);
      }
    }
  }
}

void GradientSink::accumulate(std::size_t b, const Tensor& reduced) {
  const ShardBucket& bucket = buckets[b];
  // A new gradient can be a slice of the bucket's sum instead of a copy where that sum is ours
  // alone (the members' slices are disjoint): a reduce-scatter's new tensor, a concatenation, a
  // lone member's gradient handed back as is (world size 1) that was autograd's alone when
  // deposited, even where this runs inside that deposit, while autograd still holds its handle
  // (it drops it when the node returns, and reads it no more); not one that autograd gave to
  // another input as well. (Cloning those cost the MLP's f32 step at world size 1 ~2%: a copy
  // of every gradient.)
  const bool own = autograd::exclusively_owned(reduced) || handed_fresh[b];
  for (std::size_t m = 0; m < bucket.members.size(); ++m) {
    const Param p = ParamAccess::lock(params[bucket.members[m]]);
    if (!p.defined()) continue;
    Tensor leaf = p.data();
    if (!leaf.requires_grad()) continue;
    const std::int64_t begin = bucket.offsets[m];
    const Tensor piece = reduced.slice(0, begin, begin + p.shard()->shard_size);
    Tensor grad = leaf.grad();
    if (grad.defined() && replaces[bucket.members[m]]) {
      grad.copy_(piece.dtype() == leaf.dtype() ? piece : cast(piece, leaf.dtype()));
    } else if (grad.defined()) {
      grad.add_(piece.dtype() == leaf.dtype() ? piece : cast(piece, leaf.dtype()));
    } else {
      leaf.set_grad(piece.dtype() != leaf.dtype() ? cast(piece, leaf.dtype()) : own ? piece : piece.clone());
      p.shard()->gradient_made_by = autograd::backward_serial();
    }
  }
}

// --- the group ---

struct ShardGroup::Values {
  std::vector<Tensor> values;  // per member: the full tensor (no graph; each use gets a node)
  std::vector<ShardBucket> buckets;
  std::vector<Tensor> sources;
  std::vector<std::uint64_t> versions;
  bool backward = false;               // unsharded during a backward (recompute, or a checkpointed block)
  std::shared_ptr<GradientSink> sink;  // where the uses' nodes deposit; made by the first use that records
};

ShardGroup::ShardGroup(const Module* module, const std::vector<Param>& params, Communicator& comm,
                       Communicator* replicate, std::shared_ptr<ShardSchedule> schedule)
    : module_(module),
      comm_(&comm),
      replicate_(replicate),
      schedule_(std::move(schedule)),
      ordinal_(comm.next_ordinal()) {
  for (const Param& p : params) params_.push_back(ParamAccess::weak(p));
  schedule_->add(this);
  rename();
}

ShardGroup::~ShardGroup() { schedule_->remove(this); }

Param ShardGroup::param(std::size_t index) const {
  Param p = ParamAccess::lock(params_.at(index));
  if (!p.defined()) fail<ShardingError>("gather", "a parameter of ", tag_, " was destroyed");
  return p;
}

void ShardGroup::rename() {
  std::vector<std::string> names;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Param p = ParamAccess::lock(params_[i]);
    names.push_back(p.defined() ? p.shard()->name : std::string("?"));
  }
  // The group's name: the module prefix its parameters share ("blocks.0"), or "root".
  std::string prefix = names.empty() ? std::string() : names.front();
  for (const std::string& n : names) {
    std::size_t common = 0;
    while (common < prefix.size() && common < n.size() && prefix[common] == n[common]) ++common;
    prefix.resize(common);
  }
  const std::size_t dot = prefix.rfind('.');
  name_ = dot == std::string::npos ? std::string("root") : prefix.substr(0, dot);
  // A group named by no module path is the top of its own fully_shard call: sibling submodules
  // sharded without their parent ("weight, bias" each) had the same tag, so that ranks running
  // them in different orders joined one's slices with the other's, undetected, even by the
  // order check. Its number among the groups made over its communicator tells them apart.
  tag_ = "group '" + name_ + "'" + (name_ == "root" ? " #" + std::to_string(ordinal_) : std::string()) + " (";
  for (std::size_t i = 0; i < names.size() && i < 3; ++i) tag_ += (i ? ", " : "") + names[i];
  tag_ += names.size() > 3 ? ", ... " + std::to_string(names.size()) + " parameters)" : ")";
}

bool ShardGroup::encloses(const ShardGroup& other) const noexcept {
  for (std::shared_ptr<const ShardGroup> g = other.parent_.lock(); g; g = g->parent_.lock()) {
    if (g.get() == this) return true;
  }
  return false;
}

std::vector<ShardBucket> ShardGroup::make_buckets() const {
  std::vector<ShardBucket> buckets;
  const auto world = static_cast<std::size_t>(comm_.get("gather", tag_).world_size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Param p = param(i);
    const ShardInfo& info = *p.shard();
    const DType dtype = info.policy.compute_dtype.value_or(p.data().dtype());
    const bool alone = world * static_cast<std::size_t>(info.shard_size) * dtype_size(dtype) >= kOwnBucketBytes;
    const bool int8 = info.policy.gather_quantization == GatherQuantization::int8;
    auto it = alone ? buckets.end() : std::find_if(buckets.begin(), buckets.end(), [&](const ShardBucket& b) {
      return !b.alone && b.dtype == dtype && b.accumulate == info.policy.reduce && b.int8 == int8;
    });
    if (it == buckets.end()) {
      it = buckets.insert(buckets.end(), ShardBucket{});
      it->dtype = dtype;
      it->accumulate = info.policy.reduce;
      it->alone = alone;
      it->int8 = int8;
    }
    it->members.push_back(i);
    it->offsets.push_back(it->part);
    it->part += info.shard_size;
  }
  return buckets;
}

PendingGather ShardGroup::start_gather() const {
  autograd::NoGradGuard no_grad;
  PendingGather gather;
  gather.buckets = make_buckets();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor& local = param(i).data();
    gather.sources.push_back(local);
    gather.versions.push_back(local.version());
  }
  for (const ShardBucket& bucket : gather.buckets) {
    // A rank's part: its slices back to back, in the compute dtype; or quantized from the
    // current full-precision values into int8 codes and scales.
    std::vector<Tensor> part;
    for (const std::size_t i : bucket.members) {
      // int8 codes quantize f32 values: a bucket's members may be stored in different float dtypes
      // (they share the compute dtype), and concat takes one.
      part.push_back(cast(gather.sources[i], bucket.int8 ? DType::f32 : bucket.dtype));
    }
    Tensor local = part.size() == 1 ? part.front() : concat(part, 0);
    if (bucket.int8) local = pack_int8(local, {bucket.part, bucket.offsets});
    Communicator& c = comm_.get("gather", tag_);
    gather.works.push_back(schedule_->overlapping() ? c.all_gather_async(local, {.tag = tag_})
                                                    : Work::completed(c.all_gather(local, {.tag = tag_})));
  }
  return gather;
}

bool ShardGroup::current(const std::vector<Tensor>& sources, const std::vector<std::uint64_t>& versions) const {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Param p = ParamAccess::lock(params_[i]);
    if (!p.defined() || p.is_deferred() || !p.data().defined() || !p.data().is_same(sources[i]) ||
        p.data().version() != versions[i])
      return false;
  }
  return true;
}

std::shared_ptr<ShardGroup::Values> ShardGroup::finish_gather(PendingGather gather, bool backward) {
  autograd::NoGradGuard no_grad;
  auto out = std::make_shared<Values>();
  out->values.resize(params_.size());
  out->backward = backward;
  const std::int64_t world = comm_.get("gather", tag_).world_size();
  for (std::size_t b = 0; b < gather.buckets.size(); ++b) {
    const ShardBucket& bucket = gather.buckets[b];
    Tensor full = gather.works[b].wait();
    if (bucket.int8) {
      // Every rank has the same words, so every rank refuses a non-finite slice alike.
      std::optional<NonFinite> bad;
      full = unpack_int8(full, static_cast<int>(world), {bucket.part, bucket.offsets}, bucket.dtype, &bad);
      if (bad) {
        std::size_t m = 0;
        while (m + 1 < bucket.members.size() && bucket.offsets[m + 1] <= bad->offset) ++m;
        // (An f64 value beyond f32's range is an infinity to the f32 quantization.)
        const Param holder = param(bucket.members[m]);
        fail<ShardingError>(
            "gather (int8)", holder.shard()->describe(), " holds a NaN or an infinity",
            holder.data().dtype() == DType::f64 ? " (or an f64 value beyond f32's range, where the scales are)" : "",
            " (in rank ", bad->rank, "'s slice",
            replicate_ ? " on node " + std::to_string(replicate_.get("gather", tag_).rank()) : std::string(),
            "): its gather cannot be quantized to int8");
      }
    }
    for (std::size_t m = 0; m < bucket.members.size(); ++m) {
      const std::size_t i = bucket.members[m];
      const ShardInfo& info = *param(i).shard();
      // Copy-out: this parameter's columns of the [world, part] rows (a view when it is alone).
      // A copy, not a strided view: a parameter's value is contiguous, for every raw reader.
      const Tensor columns = bucket.members.size() == 1
                                 ? full
                                 : full.reshape({world, bucket.part})
                                       .slice(1, bucket.offsets[m], bucket.offsets[m] + info.shard_size)
                                       .contiguous()
                                       .reshape({-1});
      out->values[i] = columns.slice(0, 0, info.numel).reshape(info.logical_shape);
    }
  }
  out->buckets = std::move(gather.buckets);
  out->sources = std::move(gather.sources);
  out->versions = std::move(gather.versions);
  return out;
}

std::shared_ptr<GradientSink> ShardGroup::make_sink(const std::vector<ShardBucket>& buckets) {
  auto sink = std::make_shared<GradientSink>();
  sink->comm = comm_;
  sink->replicate = replicate_;
  sink->tag = tag_;
  sink->params = params_;
  sink->buckets = buckets;
  sink->bucket_of.resize(params_.size());
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    for (const std::size_t i : buckets[b].members) sink->bucket_of[i] = b;
  }
  sink->nodes.assign(buckets.size(), 0);
  sink->remaining = sink->nodes;
  sink->grads.resize(params_.size());
  sink->works.resize(buckets.size());
  sink->all_reduces.resize(buckets.size());
  sink->reduced.resize(buckets.size());
  sink->replaces.assign(params_.size(), 0);
  sink->fresh.assign(params_.size(), 0);
  sink->handed_fresh.assign(buckets.size(), 0);
  sink->group = weak_from_this();
  return sink;
}

namespace {
// Refuses a recompute of parameter `p` whose slice is no longer the one a forward used (`used`, at
// `version`).
void require_unchanged(const Param& p, const Tensor& used, std::uint64_t version) {
  const ShardInfo& info = *p.shard();
  const std::string what(dtype_name(used.dtype()));
  if (!p.data().is_same(used)) {
    fail<AutogradError>("backward", info.describe(), " (", what, ") was replaced (Param::set_data) after the ",
                        "forward that used it; its recomputed value would not be the forward's (backward first, or ",
                        "CheckpointStrategy::retain)");
  }
  if (used.version() != version) {
    fail<AutogradError>("backward", info.describe(), " (", what, ") was modified in place after the forward that ",
                        "used it (version ", version, ", now ", used.version(), "); its recomputed value would not ",
                        "be the forward's (backward first, or CheckpointStrategy::retain)");
  }
}
}  // namespace

Tensor ShardGroup::use(std::size_t index) {
  Values& v = *values_;
  const Tensor& local = v.sources[index];
  if (!autograd::is_grad_enabled() || !local.requires_grad()) return v.values[index];
  if (!v.sink || v.sink->started) v.sink = make_sink(v.buckets);
  // This use's own node over the shared value: a graph frees its nodes, not another graph's.
  // Always-run, as every gather: each rank deposits every gradient (zeros where its loss did not
  // reach the value), so each bucket's reduce-scatter runs on every rank.
  Tensor value = v.values[index].detach();
  const std::shared_ptr<GradientSink> sink = v.sink;
  // `local` is held by the node's edge anyway; the lambda's handle tells whether its parameter's
  // data was replaced since (fully_shard's caller cannot have: a sharded parameter; set_data).
  autograd::record("all_gather", value, {local}, {},
                   [sink, index, local](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
                     // After the deposit: its reduce-scatter is issued on this rank as on the
                     // others, whose loss may not reach the retired slice (they raise nothing).
                     sink->deposit(index, g, autograd::reached());
                     autograd::refuse_if_retired(local);
                     return std::vector<Tensor>{Tensor()};
                   },
                   {.always_run = true, .owner = weak_from_this()});
  ++sink->nodes[sink->bucket_of[index]];
  if (!RetainGathered::active() && param(index).shard()->policy.strategy == CheckpointStrategy::recompute) {
    // Ops that save this value keep the recipe instead: the group unshards again in backward.
    // The slice this forward gathered, and its version: a recompute gathers the slices of
    // backward's time, so one changed since (an optimizer step, an in-place edit, set_data) would
    // give backward other weights than the forward used, silently; the dense model's backward
    // refuses the same change of a weight it saved, and so does this one.
    autograd::set_recompute(
        value,
        [group = weak_from_this(), index, used = local, version = local.version()] {
          const auto g = group.lock();
          if (!g) fail<ShardingError>("backward", "the group of a recomputed weight was destroyed");
          // Only where the loss reached the node that reads the weight: an unreached one (a
          // forward with grad mode on that no backward took, run with zeros by the next backward
          // so that the ranks' gathers pair up) computes nothing from it. Checked there, an
          // optimizer step after such a forward made the next training backward fail.
          if (autograd::reached()) require_unchanged(g->param(index), used, version);
          return g->value(index);
        },
        weak_from_this());
  }
  return value;
}

bool ShardGroup::usable(const Values& v, bool backward) const {
  return v.backward == backward && current(v.sources, v.versions);
}

Tensor ShardGroup::value(std::size_t index) {
  const bool backward = autograd::in_backward();
  schedule_->enter_phase(backward);  // first: a backward begins by taking the forward's values still held
  if (!values_ || !usable(*values_, backward)) {
    values_.reset();
    // Pre-forward (or pre-backward): take the prefetched gather if it still holds the current
    // slices, otherwise issue it now; then let the schedule prefetch the neighbour.
    schedule_->before_unshard(*this, backward);
    std::optional<PendingGather> gather = std::move(prefetch_);
    prefetch_.reset();
    if (!gather || !current(gather->sources, gather->versions)) gather = start_gather();
    values_ = finish_gather(std::move(*gather), backward);
    schedule_->after_unshard(*this, backward);
  }
  return use(index);
}

void ShardGroup::all_reduce_partial_gradients(Communicator& replicate) {
  autograd::NoGradGuard no_grad;
  for (const auto& weak : params_) {
    const Param p = ParamAccess::lock(weak);
    if (!p.defined() || !p.shard()->gradient_partial) continue;
    p.shard()->gradient_partial = false;
    Tensor grad = p.data().grad();
    if (grad.defined()) {
      grad.copy_(replicate.all_reduce(grad, Reduction::sum, {.tag = p.shard()->name + " (accumulated) across nodes"}));
    }
    restore_complete_gradient(p);
  }
}

bool ShardGroup::regathers_in_backward() const {
  for (const auto& weak : params_) {
    const Param p = ParamAccess::lock(weak);
    if (p.defined() && p.shard()->policy.strategy == CheckpointStrategy::recompute) return true;
  }
  return false;
}

void ShardGroup::drop_prefetch() noexcept {
  prefetch_.reset();
  if (!unsharded()) schedule_->resharded(*this);
}

void ShardGroup::start_prefetch() {
  if (!prefetch_) prefetch_ = start_gather();
}

void ShardGroup::reshard() noexcept {
  values_.reset();
  prefetch_.reset();
  schedule_->resharded(*this);
}

void ShardGroup::reshard_unless(bool backward) noexcept {
  if (values_ && values_->backward != backward) {
    if (backward) {
      // A backward begins while the forward's values are still held (the last groups of the
      // forward, the root): it takes them instead of gathering them again, as FSDP2 does for its
      // root, and drops them after this group's post-backward like the values it gathers itself.
      values_->backward = true;
    } else {
      values_.reset();  // a forward begins: a backward's values are of no use to it
    }
  }
  if (!unsharded()) schedule_->resharded(*this);
}

void ShardGroup::finished_backward(const GradientSink& sink) noexcept {
  backward_done_ = autograd::backward_serial();
  // Post-backward: values unsharded for this backward (a recompute or a checkpointed block) are
  // done with; the forward's were dropped when the backward began.
  if (values_ && values_->backward && (!values_->sink || values_->sink.get() == &sink)) {
    values_.reset();
    if (!unsharded()) schedule_->resharded(*this);
  }
}

// --- the schedule ---

void ShardSchedule::remove(ShardGroup* group) noexcept {
  std::erase(groups_, group);
  std::erase(order_, group);
  std::erase(backward_order_, group);
  std::erase(backward_seen_, group);
  std::erase(unsharded_, group);
}

void ShardSchedule::set_forward_order(std::vector<ShardGroup*> order) {
  order_ = std::move(order);
  order_fixed_ = true;
}

void ShardSchedule::enter_phase(bool backward) {
  if (backward == backward_) return;
  backward_ = backward;
  for (ShardGroup* g : groups_) g->reshard_unless(backward);
  // A new forward with reductions still queued: the backward that issued them failed, and its
  // gradients are not wanted (the collectives still complete on every rank).
  if (!backward) {
    reducing_.clear();
    reducing_across_.clear();
    touched_.clear();
  }
}

std::size_t ShardSchedule::unsharded_around(const ShardGroup& computing) const {
  return static_cast<std::size_t>(std::count_if(unsharded_.begin(), unsharded_.end(), [&](const ShardGroup* g) {
    return g != &computing && !g->encloses(computing);
  }));
}

void ShardSchedule::before_unshard(ShardGroup& group, bool backward) {
  enter_phase(backward);
  // The orders prefetching follows: the forward's, each group as first met, and the order in
  // which the last backward unsharded groups again (Recompute; which ones depends on what the
  // forward left unsharded and on activation checkpointing, so each backward records it anew).
  std::vector<ShardGroup*>& order = backward ? backward_seen_ : order_;
  if (!order_fixed_ && std::find(order.begin(), order.end(), &group) == order.end()) order.push_back(&group);
  // Room for this group under the limit: reshard the least recently unsharded groups that neither
  // are it nor enclose it (a root stays unsharded while its blocks compute).
  const std::size_t limit = static_cast<std::size_t>(std::max(1, max_unsharded_));
  while (unsharded_around(group) + 1 > limit) {
    auto victim = std::find_if(unsharded_.begin(), unsharded_.end(),
                               [&](const ShardGroup* g) { return g != &group && !g->encloses(group); });
    (*victim)->reshard();
  }
}

ShardGroup* ShardSchedule::neighbour(const ShardGroup& group, bool backward) const {
  if (backward && order_fixed_) {  // a set order runs backwards in backward
    const auto it = std::find(order_.begin(), order_.end(), &group);
    return it == order_.end() || it == order_.begin() ? nullptr : *(it - 1);
  }
  const std::vector<ShardGroup*>& order = backward ? backward_order_ : order_;
  const auto it = std::find(order.begin(), order.end(), &group);
  return it == order.end() || it + 1 == order.end() ? nullptr : *(it + 1);
}

void ShardSchedule::after_unshard(ShardGroup& group, bool backward) {
  std::erase(unsharded_, &group);
  unsharded_.push_back(&group);
  if (!prefetch_ || !overlapping()) return;
  ShardGroup* next = neighbour(group, backward);
  if (!next || next->unsharded()) return;
  const std::size_t limit = static_cast<std::size_t>(std::max(1, max_unsharded_));
  const std::size_t needed = unsharded_around(group) + 1 + (next->encloses(group) ? 0 : 1);
  if (needed > limit) return;
  next->start_prefetch();
  unsharded_.push_back(next);
}

void ShardSchedule::resharded(ShardGroup& group) noexcept { std::erase(unsharded_, &group); }

ShardGroup* ShardSchedule::next_backward_gather() const {
  const std::uint64_t now = autograd::backward_serial();
  // With a fixed order, only groups whose backward gathers again (Recompute): Retain's backward
  // uses the values its graph kept and gathers nothing.
  const auto pending = [&](const ShardGroup* g) {
    return g->backward_done() != now && !g->unsharded() && (!order_fixed_ || g->regathers_in_backward());
  };
  if (order_fixed_) {
    const auto it = std::find_if(order_.rbegin(), order_.rend(), pending);
    return it == order_.rend() ? nullptr : *it;
  }
  const auto it = std::find_if(backward_order_.begin(), backward_order_.end(), pending);
  return it == backward_order_.end() ? nullptr : *it;
}

void ShardSchedule::after_backward_of(const ShardGroup&) {
  if (!prefetch_ || !overlapping()) return;
  ShardGroup* next = next_backward_gather();
  if (!next) return;
  const std::size_t limit = static_cast<std::size_t>(std::max(1, max_unsharded_));
  if (unsharded_around(*next) + 1 > limit) return;
  next->start_prefetch();
  unsharded_.push_back(next);
}

void ShardSchedule::reduce_started(std::shared_ptr<GradientSink> sink) {
  reducing_.push_back(std::move(sink));
  // At most two reduce-scatters in flight: their full gradient buffers are the backward's
  // transient memory, like the unsharded weights are the forward's. None when not overlapping.
  finish_reductions(overlapping() ? 2 : 0);
}

void ShardSchedule::touched(std::shared_ptr<GradientSink> sink) {
  touched_.push_back(std::move(sink));
  const std::uint64_t now = autograd::backward_serial();
  if (queued_serial_ == now) return;
  queued_serial_ = now;
  autograd::at_backward_end([schedule = weak_from_this()] {
    if (const auto s = schedule.lock()) s->end_backward();
  });
}

void ShardSchedule::finish_reductions(std::size_t keep) {
  while (reducing_.size() > keep) {
    std::shared_ptr<GradientSink> sink = std::move(reducing_.front());
    reducing_.pop_front();
    if (!sink->replicate) {
      sink->finish();
      continue;
    }
    // Hybrid: the reduced shard goes on across nodes while backward goes on; at most `keep` of
    // those in flight too (their buffers are a shard each: small).
    sink->reduce_across();
    reducing_across_.push_back(std::move(sink));
  }
  while (reducing_across_.size() > keep) {
    const std::shared_ptr<GradientSink> sink = std::move(reducing_across_.front());
    reducing_across_.pop_front();
    sink->finish();
  }
}

void ShardSchedule::end_backward() {
  finish_reductions(0);
  if (!order_fixed_) backward_order_ = std::exchange(backward_seen_, {});
  // A gather prefetched for a group this backward did not use after all: its memory goes now
  // (the collective still completes on every rank).
  for (ShardGroup* g : groups_) g->drop_prefetch();
  // In the order they were first reached: the same on every rank.
  std::vector<std::shared_ptr<GradientSink>> sinks;
  sinks.swap(touched_);
  for (const auto& sink : sinks) sink->flush();
  drop_unreached_gradients(sinks);
  // Hybrid accumulation: a group this backward did not reach still holds its node's partial sums
  // from earlier micro-batches; they cross nodes now, or the replicas would step apart. The flags
  // are alike on every rank (every rank runs the same program), and so are these all-reduces.
  if (replicate_ && requires_all_reduce_) {
    for (ShardGroup* g : groups_) g->all_reduce_partial_gradients(replicate_.get("backward", "the partial gradients"));
  }
  enter_phase(false);
  if (!report_.decided && probing == 0) time_step();
}

void take_back_unreached(const std::vector<ReachCandidate>& candidates, Communicator& comm, Communicator* replicate,
                         const std::string& tag) {
  if (candidates.empty()) return;
  std::vector<double> flags;
  for (const ReachCandidate& c : candidates) flags.push_back(c.reached ? 1 : 0);
  Tensor reached = comm.all_reduce(from_values(flags, {static_cast<std::int64_t>(flags.size())}, DType::f32),
                                   Reduction::sum, {.tag = tag});
  if (replicate) reached = replicate->all_reduce(reached, Reduction::sum, {.tag = tag + " across nodes"});
  const std::vector<float> anywhere = reached.to_vector<float>();
  for (std::size_t k = 0; k < candidates.size(); ++k) {
    // A gradient from an earlier backward (accumulation) stays: this one added zeros to it.
    if (anywhere[k] != 0 || !candidates[k].made_now) continue;
    const Param p = ParamAccess::lock(candidates[k].param);
    if (!p.defined() || autograd::loss_reached(p.data())) continue;
    p.data().set_grad(Tensor());
    p.shard()->gradient_partial = false;
    restore_complete_gradient(p);  // what an earlier backward left stays the gradient
  }
}

void ShardSchedule::drop_unreached_gradients(const std::vector<std::shared_ptr<GradientSink>>& sinks) {
  // The flags of one backward in one collective, not a column more in each bucket's
  // reduce-scatter: a large parameter's bucket is reduced straight from its gradient, which an
  // extra column would copy. Per parameter, not per sink: a checkpointed block's recompute
  // deposits into a sink of its own beside the forward's. The same sinks and members in the same
  // order on every rank (touched()), so the same candidates.
  std::vector<ReachCandidate> candidates;
  std::map<const Param::State*, std::size_t> index;
  const std::uint64_t now = autograd::backward_serial();
  for (const auto& sink : sinks) {
    for (std::size_t i = 0; i < sink->params.size(); ++i) {
      const auto state = sink->params[i].lock();
      if (!state) continue;  // destroyed alike on every rank
      const auto [at, fresh] = index.emplace(state.get(), candidates.size());
      if (fresh) {
        const Param p = ParamAccess::lock(sink->params[i]);
        candidates.push_back({sink->params[i], false, p.shard()->gradient_made_by == now});
      }
      if (sink->reached[i]) candidates[at->second].reached = true;
    }
  }
  take_back_unreached(candidates, comm_.get("backward", "the reached flags"),
                      replicate_ ? &replicate_.get("backward", "the reached flags") : nullptr,
                      "shard groups: which parameters the loss reached");
}

thread_local int ShardSchedule::probing = 0;
thread_local bool ShardSchedule::probe_synchronous = false;
thread_local bool ShardSchedule::probe_met_undecided = false;

bool ShardSchedule::overlapping() const noexcept {
  // A probe measures each schedule while the trial has not decided (Probing).
  if (probing > 0 && !report_.decided) {
    probe_met_undecided = true;
    return !probe_synchronous;
  }
  return report_.overlapping;
}

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
}  // namespace

void ShardSchedule::time_step() {
  // A step runs from one backward's end to the next, in the mode set at the first one's end.
  constexpr std::size_t kTrialSteps = 3;
  const auto now = std::chrono::steady_clock::now();
  if (last_end_) trial_[report_.overlapping].push_back(std::chrono::duration<double>(now - *last_end_).count());
  last_end_ = now;
  if (trial_[0].size() < kTrialSteps || trial_[1].size() < kTrialSteps) {
    if (!trial_[0].empty() || !trial_[1].empty()) report_.overlapping = !report_.overlapping;
    return;
  }
  // The ranks must agree (prefetching changes the order of the backward's collectives): the
  // slowest rank's medians decide, the same on every rank.
  Tensor medians = comm_.get("shard groups", "the overlap trial")
                       .all_reduce(from_values({median(trial_[1]), median(trial_[0])}, {2}, DType::f64), Reduction::max,
                                   {.tag = "shard groups: the overlap trial's step times"});
  // Hybrid: every node decides alike too, so that the ranks' collectives interleave alike.
  if (replicate_) {
    medians = replicate_.get("shard groups", "the overlap trial")
                  .all_reduce(medians, Reduction::max, {.tag = "shard groups: the overlap trial across nodes"});
  }
  const std::vector<double> slowest = medians.to_vector<double>();
  report_ = OverlapReport{.decided = true,
                          .overlapping = slowest[0] <= slowest[1],
                          .step_seconds_overlapping = slowest[0],
                          .step_seconds_synchronous = slowest[1]};
}

void ShardSchedule::reshard_all() noexcept {
  for (ShardGroup* g : std::vector<ShardGroup*>(groups_)) g->reshard();
}

}  // namespace ruda::nn
