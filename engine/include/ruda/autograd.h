// Reverse-mode automatic differentiation: grad mode, the recording API that ops use, saved tensors
// and their recompute policy.
//
// Each differentiable op records one Node on its output: the edges to its inputs, exactly the
// tensors its backward needs (`saved`), and a closure that maps the output's gradient to the
// inputs' gradients. backward() runs the nodes in reverse creation order (a topological order
// that is the same on every rank running the same program) and accumulates into leaves' grad().
//
// Threads: graphs built on different threads share no mutable state, and may run backward at
// the same time, also through shared leaves (a model's parameters): each leaf's gradient is
// accumulated under a lock, so every contribution arrives (in an order that may vary, so f32 sums
// may round differently from run to run). A graph may be begun on one thread and continued or
// differentiated on another when its tensors are handed over with synchronization (a join, a
// mutex, a future): the node numbering is one process-wide sequence. Grad mode, the always-run
// list (pending_always_run) and at_backward_end are per thread: an always-run node runs in its
// own thread's next backward unless another thread's backward reaches it first. What no lock
// covers: one graph differentiated on two threads at once, and a sharded model (its collectives
// must be issued in the same order on every rank) driven from more than one thread per rank.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ruda/tensor.h>

namespace ruda::autograd {

/// Whether ops on this thread record gradients (on by default).
bool is_grad_enabled() noexcept;
void set_grad_enabled(bool enabled) noexcept;

/// Turns gradient recording off for its lifetime on this thread.
class NoGradGuard {
 public:
  NoGradGuard() noexcept : previous_(is_grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

/// Runs f() with gradient recording off.
template <class F>
decltype(auto) no_grad(F&& f) {
  NoGradGuard guard;
  return std::forward<F>(f)();
}

/// Attaches a recipe that reproduces t's value. A node that saves t for its backward keeps the
/// recipe instead of the data and calls it (without grad) when its backward runs: the
/// "recompute" checkpoint strategy. The recipe must not capture t itself. Such a node is
/// always-run (its recipe may be a collective); `owner` (what the recipe reads: a shard group)
/// becomes the node's RecordOptions::owner, so that the node is dropped once that is gone.
void set_recompute(Tensor& t, std::function<Tensor()> recipe, std::weak_ptr<const void> owner = {});

/// A tensor kept for a backward: the data (detached, so outputs do not hold their own node), or the
/// recompute recipe of a tensor that has one.
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& tensor);
  /// The saved value; a recomputed one is produced anew on each call. AutogradError if the data
  /// was modified in place since it was saved (its storage's version moved on), or if the
  /// recomputed one is undefined or of another shape or dtype than the tensor saved.
  Tensor get() const;
  bool is_recomputed() const noexcept { return recipe_ != nullptr; }
  bool defined() const noexcept { return value_.defined() || recipe_ != nullptr; }
  /// The recipe's owner (set_recompute), empty when none.
  const std::weak_ptr<const void>& recipe_owner() const noexcept { return recipe_owner_; }

 private:
  Tensor value_;
  std::uint64_t version_ = 0;
  std::shared_ptr<const std::function<Tensor()>> recipe_;
  std::weak_ptr<const void> recipe_owner_;
  // What the recipe must give back: the saved tensor's shape and dtype.
  Shape recipe_shape_;
  DType recipe_dtype_ = DType::f32;
};

/// Which inputs of a node need a gradient: bits for up to 64 inputs, a shared flag per input for
/// more (a concat of many tensors), so that no node is limited in its inputs.
class GradMask {
 public:
  explicit GradMask(std::uint64_t bits = 0) : bits_(bits) {}
  explicit GradMask(std::shared_ptr<const std::vector<bool>> flags) : flags_(std::move(flags)) {}
  bool operator[](std::size_t input) const noexcept {
    if (flags_) return input < flags_->size() && (*flags_)[input];
    return input < 64 && ((bits_ >> input) & 1u);
  }

 private:
  std::uint64_t bits_ = 0;
  std::shared_ptr<const std::vector<bool>> flags_;
};

using Saved = std::vector<SavedTensor>;
/// Maps the output's gradient to one gradient per input (undefined where the mask is off or the
/// gradient is zero). Runs with grad mode off.
using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad, const Saved& saved, GradMask needs)>;

struct RecordOptions {
  /// Run this node in the next backward of its thread even when the loss does not reach it (with
  /// a zero gradient; a node reached that way is not freed, so its own graph's backward can still
  /// run through it). Collective-bearing nodes use it so that every rank runs the same collectives
  /// in the same order. A node that saves a recomputed tensor is always-run too, because its
  /// recompute may itself be a collective.
  bool always_run = false;
  /// For an always-run node whose backward is a collective (a reduce-scatter): its gradients hold
  /// other ranks' too, so they pass on where this rank's loss did not reach the node. Without it,
  /// what an always-run node the loss did not reach hands on (zeros) is dropped: its inputs get no
  /// gradient from it, as in a graph without the node (see reached()). Only with always_run (an
  /// ArgumentError otherwise).
  bool collective = false;
  /// For an always-run node: what it belongs to (a module, a shard group). Once that is destroyed
  /// the node is dropped from its thread's always-run list: a pending node of a model that is gone
  /// (a forward with grad mode on that no backward followed) no longer runs in the next backward
  /// of an unrelated graph. It still runs when that backward's loss reaches it. Empty: none.
  std::weak_ptr<const void> owner = {};
  /// The backward function takes its output gradient with any strides (its kernel reads them):
  /// the engine then does not make it contiguous first, as it does for every other node.
  bool strided_grad = false;
};

/// True when grad mode is on and any input requires a gradient.
template <class... Tensors>
bool needs_grad(const Tensors&... inputs) {
  return is_grad_enabled() && ((inputs.defined() && inputs.requires_grad()) || ...);
}

/// Records a node named `name` producing `output` from `inputs`, keeping `saved` for backward.
/// Does nothing when grad mode is off or no input requires a gradient, nor for an output that is
/// not a float tensor (an i64 or bool result carries no gradient: it stays a tensor that does
/// not require grad, as PyTorch marks a custom function's integer outputs non-differentiable),
/// always-run nodes aside. A null name, an empty backward function or an undefined output is an
/// ArgumentError either way.
void record(const char* name, Tensor& output, const std::vector<Tensor>& inputs, const std::vector<Tensor>& saved,
            BackwardFn backward, RecordOptions options = {});

/// The op name of a node ("matmul", "add", ...).
std::string_view node_name(const Node& node) noexcept;

/// Backpropagates from `root` with gradient `grad`, accumulating into the leaves' grad(). Without
/// retain_graph the graph's saved tensors are freed as it goes.
void backward(const Tensor& root, const Tensor& grad, bool retain_graph = false);

/// Whether a backward() is running on this thread (including inside a node's own nested backward).
bool in_backward() noexcept;

/// Inside a node's backward: whether the loss reached the node, through gradients that flowed to
/// it. False for an always-run node that runs with a zero gradient because none reached it
/// (RecordOptions::always_run), and for the nodes of a backward such a node runs nested (a
/// checkpointed block's recompute). True outside a backward. Sharded gradient sinks read it: a
/// parameter that no rank's loss reached gets no gradient, as in the dense model.
bool reached() noexcept;

/// Whether the backward running on this thread has added to `leaf`'s gradient from a node the
/// loss reached (not only what an unreached always-run node handed on: zeros, or other ranks'
/// gradients through a collective). False outside a backward. What tells a sharded parameter's
/// gradient of zeros, to be taken back, from one that a loss term on its local slice added to.
bool loss_reached(const Tensor& leaf);

/// Marks `leaf` as replaced by its holder (a parameter whose data Param::set_data or fully_shard
/// swapped for a new tensor): a later backward whose loss reaches it raises AutogradError with
/// `why`, instead of adding a gradient that nobody reads while the holder's new tensor gets none.
/// What only an unreached always-run node hands it (zeros) is dropped. ArgumentError for an
/// undefined tensor, a non-leaf or an empty reason.
void retire_leaf(const Tensor& leaf, std::string why);

/// For a node that routes a leaf's gradient elsewhere instead of handing it back (a shard group's
/// gather, whose gradient goes to its sink): inside a backward whose loss reached the running
/// node (reached()), the AutogradError a retired `leaf` gets; nothing otherwise.
void refuse_if_retired(const Tensor& leaf);

/// The number of the outermost backward() running (or last run) on this thread: tells one backward
/// from the next. Numbers are unique in the process (one counter for every thread) and increase.
std::uint64_t backward_serial() noexcept;

/// Queues `callback` to run when the outermost backward() running on this thread returns, after
/// every node has run: how work a node starts without waiting for it (a non-blocking reduce-scatter
/// of gradients) is finished before the caller sees the gradients. Callbacks run in the order
/// queued; if backward throws they are dropped unrun. Outside a backward: an AutogradError; an
/// empty callback: an ArgumentError.
void at_backward_end(std::function<void()> callback);

/// Whether t is the only way to its memory: no other Tensor holds its impl or its storage (no
/// copy of the handle, no view), and no graph produced it. Its holder may then keep it or write
/// into it without a copy: a backward function its incoming gradient (the engine drops that
/// gradient once the function returns), a gradient sink a gradient it was handed. A backward may
/// hand one tensor to several inputs (add passes its gradient on to both), so a gradient that is
/// not exclusively owned must be copied before it is kept or written.
bool exclusively_owned(const Tensor& t);

/// Always-run nodes recorded on this thread and not yet run by a backward.
std::size_t pending_always_run() noexcept;

/// Drops them, and with them the graph they keep: for a step abandoned without its backward (a
/// forward or a loss that threw, an out-of-memory error caught to retry with a smaller batch, a
/// batch skipped for its loss). Otherwise they stay pending until the next backward, which runs
/// them (a sharded model's gathers then reduce-scatter zeros), and keep their activations until
/// then: a sharded model's retry after an out-of-memory error ran out again, holding the failed
/// forward's. Every rank of a sharded model must drop alike (their collectives must match), and
/// it drops all of this thread's (a forward whose backward is still to come included). Returns
/// how many it dropped. A backward that throws keeps a retained graph's (it may be run again)
/// and drops the others'.
std::size_t drop_pending_always_run() noexcept;

}  // namespace ruda::autograd
