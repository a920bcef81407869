// The tape: recording nodes and running backward.
#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <mutex>
#include <unordered_set>

#include "internal.h"

namespace ruda::autograd {

using detail::impl_of;
using detail::impl_ptr_of;

namespace {
thread_local bool t_grad_enabled = true;
// Creation order of nodes; backward runs in decreasing order, which is a topological order (a
// consumer is always created after its inputs) that depends only on the program, not on
// addresses, so ranks running the same program run the same sequence. One counter for the
// process, not one per thread: a graph whose first ops ran on one thread and whose last ops ran
// on another (the tensors handed over through a join, a mutex or a future) must still order its
// consumers after their producers. With a counter per thread, a consumer recorded on a thread
// that had recorded fewer nodes sorted before its producer, which then saw no gradient and was
// skipped: the producer's leaves got none, without an error. A hand-over orders the two
// increments, so relaxed ones suffice.
std::atomic<std::uint64_t> g_next_sequence{1};
// Always-run nodes stay per thread: with ranks emulated as threads, a rank's backward must run its
// own (the collectives of its sharded layers), never another rank's.
thread_local std::vector<std::shared_ptr<Node>> t_always_run;
// The size of t_always_run at which record() next drops the nodes another thread's backward ran
// and freed (a checkpointed forward on a worker thread, its backward on another): without it
// they stayed listed, and the worker's next backward failed on them as "freed by an earlier
// backward".
thread_local std::size_t t_always_run_prune_at = 64;
// The node whose backward is running on this thread, for error messages about its saved tensors.
thread_local const char* t_running_node = nullptr;
// Whether the loss reached the node whose backward is running (autograd::reached), and whether it
// hands its gradients on (reached, or carrying other ranks'); both true outside a backward. A
// backward nested in the node's (a checkpointed block's recompute) starts from them.
thread_local bool t_running_reached = true;
thread_local bool t_running_passes = true;
// How many backward() calls are running on this thread (a checkpointed block nests one), and what
// the outermost one runs when it returns.
thread_local int t_backward_depth = 0;
thread_local std::uint64_t t_backward_serial = 0;
// Serials come from one process-wide counter: a backward on one thread is never taken for another
// thread's (a leaf's loss_gradient_serial, a sink's count), whichever thread ran more of them.
std::atomic<std::uint64_t> g_next_backward_serial{1};
thread_local std::vector<std::function<void()>> t_backward_end;

// Removes from an always-run list the nodes a backward has run and freed (on any thread), and
// those whose owner is gone (RecordOptions::owner).
void drop_released(std::vector<std::shared_ptr<Node>>& nodes) noexcept {
  std::erase_if(nodes, [](const std::shared_ptr<Node>& n) {
    return n->released.load(std::memory_order_acquire) || (n->has_owner && n->owner.expired());
  });
}

// Gradient accumulation into a leaf takes one of these locks (picked by the leaf's address):
// threads running backward at once through shared parameters (two graphs over one model) add
// into the same .grad, which unguarded lost whole contributions and raced on the tensor handle.
// Striped, so that a leaf needs no mutex of its own; uncontended, a lock costs ~20 ns a leaf.
std::mutex& leaf_lock(const detail::TensorImpl& leaf) {
  static std::array<std::mutex, 64> locks;
  return locks[(reinterpret_cast<std::uintptr_t>(&leaf) >> 6) % locks.size()];
}

// For a leaf its holder replaced (retire_leaf), under the leaf's lock: an AutogradError where the
// loss reached the node adding to it, true (add nothing) where only an unreached always-run node
// did, false for a leaf still in use.
bool refuse_retired(const detail::TensorImpl& leaf, bool from_loss) {
  if (!leaf.retired) return false;
  if (from_loss) fail<AutogradError>("backward", *leaf.retired);
  return true;
}
}  // namespace

namespace {
// What a node being destroyed owned that may keep other nodes alive: its producers (edges), its
// saved tensors (whose impls hold their own producers' nodes) and its backward function (whose
// captures may hold tensors).
struct NodeRemains {
  std::vector<Edge> next;
  Saved saved;
  BackwardFn backward;
};
// The list the outermost ~Node running on this thread releases; null when none runs. A raw
// pointer to that destructor's local: a thread_local container could be gone before the nodes
// other thread_locals hold are freed at thread exit.
thread_local std::vector<NodeRemains>* t_node_remains = nullptr;
}  // namespace

Node::~Node() {
  // Freed by recursion, a graph's depth became the call stack's: 200k chained ops (an unrolled
  // RNN) overflowed it, and so did 100k where each node holds its producer twice (y * y, through
  // two edges and a saved input; y + f(y)), which a check of each producer's use count missed. So
  // a node hands what it owns to the outermost ~Node on its thread, which releases the list one
  // entry at a time: a nested ~Node only appends to it and returns. The stack stays two deep.
  NodeRemains mine{std::move(next), std::move(saved), std::move(backward)};
  if (t_node_remains) {
    t_node_remains->push_back(std::move(mine));
    return;
  }
  std::vector<NodeRemains> remains;
  remains.push_back(std::move(mine));
  t_node_remains = &remains;
  while (!remains.empty()) {
    NodeRemains last = std::move(remains.back());
    remains.pop_back();
  }  // `last` is released here; the nodes it freed appended theirs
  t_node_remains = nullptr;
}

bool in_backward() noexcept { return t_backward_depth > 0; }
bool reached() noexcept { return t_running_reached; }
bool loss_reached(const Tensor& leaf) {
  detail::require_defined("loss_reached", leaf);
  return t_backward_depth > 0 && impl_of(leaf)->loss_gradient_serial == t_backward_serial;
}
std::uint64_t backward_serial() noexcept { return t_backward_serial; }

void retire_leaf(const Tensor& leaf, std::string why) {
  detail::require_defined("retire_leaf", leaf);
  detail::TensorImpl& impl = *impl_of(leaf);
  if (impl.grad_fn)
    fail<ArgumentError>("retire_leaf", "a ", dtype_name(impl.dtype), " ", impl.shape, " tensor that a ",
                        impl.grad_fn->name, " node produced is not a leaf");
  if (why.empty()) fail<ArgumentError>("retire_leaf", "the reason is empty");
  auto reason = std::make_shared<const std::string>(std::move(why));
  const std::lock_guard lock(leaf_lock(impl));
  impl.retired = std::move(reason);
}

void refuse_if_retired(const Tensor& leaf) {
  detail::require_defined("refuse_if_retired", leaf);
  const detail::TensorImpl& impl = *impl_of(leaf);
  const std::lock_guard lock(leaf_lock(impl));
  refuse_retired(impl, t_backward_depth > 0 && t_running_reached);
}

void at_backward_end(std::function<void()> callback) {
  if (!callback) fail<ArgumentError>("at_backward_end", "the callback is empty");
  if (t_backward_depth == 0) fail<AutogradError>("at_backward_end", "called outside a backward");
  t_backward_end.push_back(std::move(callback));
}

bool is_grad_enabled() noexcept { return t_grad_enabled; }
void set_grad_enabled(bool enabled) noexcept { t_grad_enabled = enabled; }

void set_recompute(Tensor& t, std::function<Tensor()> recipe, std::weak_ptr<const void> owner) {
  detail::require_defined("set_recompute", t);
  impl_of(t)->recompute = recipe ? std::make_shared<const std::function<Tensor()>>(std::move(recipe)) : nullptr;
  impl_of(t)->recompute_owner = impl_of(t)->recompute ? std::move(owner) : std::weak_ptr<const void>{};
}

SavedTensor::SavedTensor(const Tensor& tensor) {
  if (!tensor.defined()) return;
  if (impl_of(tensor)->recompute) {
    recipe_ = impl_of(tensor)->recompute;
    recipe_owner_ = impl_of(tensor)->recompute_owner;
    recipe_shape_ = tensor.shape();
    recipe_dtype_ = tensor.dtype();
  } else {
    value_ = tensor.detach();
    version_ = value_.version();
  }
}

Tensor SavedTensor::get() const {
  if (!recipe_) {
    if (value_.defined() && value_.version() != version_) {
      fail<AutogradError>("backward", "a ", dtype_name(value_.dtype()), " ", value_.shape(), " tensor saved by ",
                          t_running_node ? t_running_node : "a node",
                          " was modified in place after it was saved (version ", version_, ", now ", value_.version(),
                          "); modify a clone() instead");
    }
    return value_;
  }
  NoGradGuard guard;
  Tensor value = (*recipe_)();
  // A recipe that gives back something else would be computed with as the saved tensor: a
  // different shape could even broadcast into a wrong gradient without an error.
  if (!value.defined() || value.shape() != recipe_shape_ || value.dtype() != recipe_dtype_) {
    fail<AutogradError>("backward", "the recompute recipe of a ", dtype_name(recipe_dtype_), " ", recipe_shape_,
                        " tensor saved by ", t_running_node ? t_running_node : "a node", " returned ",
                        value.defined() ? std::string(dtype_name(value.dtype())) + " " + to_string(value.shape())
                                        : std::string("an undefined tensor"));
  }
  return value;
}

std::string_view node_name(const Node& node) noexcept { return node.name; }

void record(const char* name, Tensor& output, const std::vector<Tensor>& inputs, const std::vector<Tensor>& saved,
            BackwardFn backward_fn, RecordOptions options) {
  // Checked whether or not it records: a caller's mistake shows on its first run, not only under grad.
  if (!name) fail<ArgumentError>("record", "the node has no name (nullptr)");
  if (!backward_fn) fail<ArgumentError>("record", name, ": the backward function is empty");
  if (!output.defined()) fail<ArgumentError>("record", name, ": the output tensor is undefined");
  if (options.collective && !options.always_run) {
    // Run only where the loss reaches it, its collective would wait for ranks whose loss does not.
    fail<ArgumentError>("record", name, ": a collective node must be always-run (RecordOptions::always_run)");
  }
  for (const Tensor& in : inputs) {
    // The node would hang on its own input: a leaf stopped being one, and the node's edge back to
    // it made a cycle that was never freed.
    if (in.defined() && impl_ptr_of(in) == impl_ptr_of(output)) {
      fail<ArgumentError>("record", name, ": the output is one of the inputs (", dtype_name(output.dtype()), " ",
                          output.shape(), "); record on a new tensor (an op's result)");
    }
  }
  // An output that already has a node (recorded twice: the first node's graph was cut off without
  // a word) or is a leaf that requires grad (a user's parameter, which would silently stop being a
  // leaf and never receive its gradient).
  if (const auto& existing = impl_of(output)->grad_fn) {
    fail<ArgumentError>("record", name, ": the output (", dtype_name(output.dtype()), " ", output.shape(),
                        ") already has a node, ", existing->name, "; record on a new tensor (an op's result)");
  }
  if (output.requires_grad()) {
    fail<ArgumentError>("record", name, ": the output (", dtype_name(output.dtype()), " ", output.shape(),
                        ") is a leaf that requires grad; record on a new tensor (an op's result)");
  }
  if (!t_grad_enabled) return;
  bool any = false;
  for (const Tensor& in : inputs) any = any || (in.defined() && in.requires_grad());
  if (!any) return;
  // An integer or bool output would otherwise require grad, which set_requires_grad refuses such
  // a tensor, and carry a graph into integer arithmetic (o * o of a user op's i64 output passed
  // gradients on). Always-run nodes are kept: they must run on every rank whatever they produce.
  if (!is_floating(output.dtype()) && !options.always_run) return;

  auto node = std::make_shared<Node>();
  node->name = name;
  node->sequence = g_next_sequence.fetch_add(1, std::memory_order_relaxed);
  node->next.resize(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    if (!in.defined() || !in.requires_grad()) continue;
    if (impl_of(in)->grad_fn) {
      node->next[i].node = impl_of(in)->grad_fn;
    } else {
      node->next[i].leaf = impl_ptr_of(in);
    }
  }
  node->saved.reserve(saved.size());
  bool recomputes = false;
  for (const Tensor& s : saved) {
    node->saved.emplace_back(s);
    recomputes = recomputes || node->saved.back().is_recomputed();
  }
  node->backward = std::move(backward_fn);
  node->always_run = options.always_run || recomputes;
  node->collective = options.collective;
  node->strided_grad = options.strided_grad;
  // Given an owner: its control block orders apart from an empty weak_ptr's (none). An expired
  // owner is still one, so expired() alone cannot tell the two apart. Without one, a node that
  // is always-run for a recomputed tensor takes the recipe's owner.
  const std::weak_ptr<const void> none;
  auto is_owner = [&](const std::weak_ptr<const void>& w) { return w.owner_before(none) || none.owner_before(w); };
  node->owner = options.owner;
  for (const SavedTensor& s : node->saved) {
    if (is_owner(node->owner)) break;
    if (s.is_recomputed()) node->owner = s.recipe_owner();
  }
  node->has_owner = is_owner(node->owner);
  node->out_shape = output.shape();
  node->out_dtype = output.dtype();
  node->out_backend = &output.backend();
  impl_of(output)->grad_fn = node;
  impl_of(output)->requires_grad = true;
  if (node->always_run) {
    t_always_run.push_back(std::move(node));
    if (t_always_run.size() >= t_always_run_prune_at) {
      drop_released(t_always_run);
      t_always_run_prune_at = std::max<std::size_t>(64, 2 * t_always_run.size());
    }
  }
}

std::size_t pending_always_run() noexcept {
  drop_released(t_always_run);
  return t_always_run.size();
}

std::size_t drop_pending_always_run() noexcept {
  drop_released(t_always_run);
  const std::size_t dropped = t_always_run.size();
  t_always_run.clear();
  return dropped;
}

bool exclusively_owned(const Tensor& t) {
  return impl_ptr_of(t).use_count() == 1 && impl_of(t)->storage.use_count() == 1 && !impl_of(t)->grad_fn;
}

namespace {

// Gradients flowing into one place are summed. A backward may hand the same tensor to several
// inputs (add passes its gradient through), so the sum goes into the accumulator in place only
// where it is provably ours alone; out of place otherwise. In place, the residual stream's sums
// (one per block input in a transformer's backward) neither allocate nor touch fresh memory.
void accumulate(Tensor& into, Tensor grad) {
  if (!into.defined()) {
    into = std::move(grad);
  } else if (exclusively_owned(into) && into.is_contiguous() && !into.shares_storage(grad)) {
    into.add_(grad);
  } else {
    into = into + grad;
  }
}

// `by` and `input`: the node whose input the leaf is, named in the error as for a node's input
// (none for the root itself).
void accumulate_leaf(detail::TensorImpl& leaf, Tensor grad, bool from_loss, const Node* by = nullptr,
                     std::size_t input = 0) {
  // A leaf frozen (set_requires_grad(false)) after the forward that used it gets nothing, as
  // PyTorch's AccumulateGrad decides at backward time too; the sharded layers' gradient sinks
  // read requires_grad when they reduce, so dense and sharded models agree.
  if (!leaf.requires_grad) return;
  grad = detail::dense(grad);  // a leaf's gradient is read raw (optimizers, collectives)
  if (grad.shape() != leaf.shape || grad.dtype() != leaf.dtype) {
    if (by) {
      fail<AutogradError>("backward", by->name, " produced a gradient ", dtype_name(grad.dtype()), " ", grad.shape(),
                          " for its input ", input, ", a leaf of ", dtype_name(leaf.dtype), " ", leaf.shape);
    }
    fail<AutogradError>("backward", "gradient ", dtype_name(grad.dtype()), " ", grad.shape(), " does not match leaf ",
                        dtype_name(leaf.dtype), " ", leaf.shape);
  }
  const std::lock_guard lock(leaf_lock(leaf));
  if (refuse_retired(leaf, from_loss)) return;
  if (!leaf.grad.defined()) {
    leaf.grad = exclusively_owned(grad) ? std::move(grad) : grad.clone();
    impl_of(leaf.grad)->backend = leaf.backend;  // a leaf's gradient lives where the leaf does
  } else {
    leaf.grad.add_(grad);  // the leaf's gradient buffer is its own: accumulate in place
  }
  if (from_loss) leaf.loss_gradient_serial = t_backward_serial;
}

// Zeroes what no slice wrote into a pending gradient that slices built (Node::written), so that
// it is whole before anything but another slice reads it.
void complete_pending(Node& node) {
  Node::WrittenRegions& w = node.written;
  if (!w.partial) return;
  std::int64_t at = 0;
  const std::int64_t extent = node.out_shape[static_cast<std::size_t>(w.axis)];
  auto zero = [&](std::int64_t begin, std::int64_t end) {
    if (begin < end) node.pending.slice(w.axis, begin, end).fill_(0);
  };
  for (const auto& [begin, end] : w.intervals) {
    zero(at, begin);
    at = end;
  }
  zero(at, extent);
  w = {};
}

// Writes g into region [start, start + length) of `axis` of a pending gradient that slices are
// building: a copy where nothing was written yet, an add where something was. A region on another
// axis completes the gradient first and adds.
void write_region(Node& producer, const Node::InputRegion& r, const Tensor& g) {
  Node::WrittenRegions& w = producer.written;
  Tensor& into = producer.pending;
  const std::int64_t begin = r.start, end = r.start + r.length;
  if (w.axis != r.axis) {
    complete_pending(producer);
    into.slice(r.axis, begin, end).add_(g);
    return;
  }
  // The written intervals that meet [begin, end), and the gaps between them, in order.
  std::int64_t at = begin;
  for (const auto& [wb, we] : w.intervals) {
    if (we <= at || wb >= end) continue;
    if (at < wb) into.slice(r.axis, at, wb).copy_(g.slice(r.axis, at - begin, wb - begin));
    const std::int64_t ob = std::max(wb, at), oe = std::min(we, end);
    into.slice(r.axis, ob, oe).add_(g.slice(r.axis, ob - begin, oe - begin));
    at = oe;
  }
  if (at < end) into.slice(r.axis, at, end).copy_(g.slice(r.axis, at - begin, end - begin));
  // Merge [begin, end) into the intervals.
  std::vector<std::pair<std::int64_t, std::int64_t>> merged;
  std::pair<std::int64_t, std::int64_t> added{begin, end};
  bool placed = false;
  for (const auto& iv : w.intervals) {
    if (iv.second < added.first) {
      merged.push_back(iv);
    } else if (iv.first > added.second) {
      if (!placed) merged.push_back(added), placed = true;
      merged.push_back(iv);
    } else {
      added = {std::min(added.first, iv.first), std::max(added.second, iv.second)};
    }
  }
  if (!placed) merged.push_back(added);
  w.intervals = std::move(merged);
  const std::int64_t extent = producer.out_shape[static_cast<std::size_t>(r.axis)];
  if (w.intervals.size() == 1 && w.intervals[0].first == 0 && w.intervals[0].second == extent) w = {};  // whole
}

// A slice node's gradient added into its region of the producer's pending gradient (see
// Node::input_region), in place when that gradient is ours alone; false where its input is a
// leaf (add_into_leaf_region).
bool add_into_region(const Node& node, const Tensor& g) {
  if (!node.input_region || node.next.size() != 1 || !node.next[0].node) return false;
  Node& producer = *node.next[0].node;
  const Node::InputRegion& r = *node.input_region;
  Tensor& into = producer.pending;
  if (!into.defined()) {
    into = empty(producer.out_shape, Options(producer.out_dtype, producer.out_backend));
    producer.written = {true, r.axis, {}};
  } else if (!producer.written.partial && (!exclusively_owned(into) || !into.is_contiguous())) {
    into = into.clone();  // shared with another input's gradient (add passes its own on): copy first
  }
  if (producer.written.partial) {
    write_region(producer, r, g);
  } else {
    into.slice(r.axis, r.start, r.start + r.length).add_(g);
  }
  return true;
}

// What a node's gradient tells the node it flows into: the loss reached it, or other ranks'
// gradients (an unreached collective's, or what such a gradient reached) arrive with it.
void mark(Node& target, const Node& from) {
  if (from.reached) {
    target.reached = true;
  } else {
    target.carries = true;
  }
}

// A slice node whose input is a leaf (a parameter sliced directly): its gradient is added into
// its region of the leaf's gradient, made zeros of the leaf's shape first if it has none, instead
// of one zero-padded full-size gradient per slice added whole. False where the node's own
// backward must run instead (a gradient of another shape or dtype, whose error it reports).
bool add_into_leaf_region(const Node& node, const Tensor& g) {
  if (!node.input_region || node.next.size() != 1 || !node.next[0].leaf) return false;
  detail::TensorImpl& leaf = *node.next[0].leaf;
  const Node::InputRegion& r = *node.input_region;
  Shape expected = leaf.shape;
  if (r.axis < 0 || static_cast<std::size_t>(r.axis) >= expected.size()) return false;
  expected[static_cast<std::size_t>(r.axis)] = r.length;
  if (g.shape() != expected || g.dtype() != leaf.dtype) return false;
  if (!leaf.requires_grad) return true;  // frozen after the forward: nothing (accumulate_leaf)
  const std::lock_guard lock(leaf_lock(leaf));
  if (refuse_retired(leaf, node.reached)) return true;
  if (!leaf.grad.defined()) {
    leaf.grad = zeros(leaf.shape, Options(leaf.dtype, leaf.backend));
  } else if (leaf.grad.shape() != leaf.shape || leaf.grad.dtype() != leaf.dtype) {
    return false;
  }
  leaf.grad.slice(r.axis, r.start, r.start + r.length).add_(g);
  if (node.reached) leaf.loss_gradient_serial = t_backward_serial;
  return true;
}

}  // namespace

void backward(const Tensor& root, const Tensor& grad, bool retain_graph) {
  detail::require_defined("backward", root);
  detail::require_defined("backward", grad);
  if (grad.shape() != root.shape() || grad.dtype() != root.dtype()) {
    fail<AutogradError>("backward", "output gradient ", dtype_name(grad.dtype()), " ", grad.shape(),
                        " does not match output ", dtype_name(root.dtype()), " ", root.shape());
  }
  // This thread's always-run nodes, taken for this backward. A retained graph may be
  // differentiated again, also after a backward that threw (a user retrying it): its always-run
  // nodes go back to the list, or the retry skipped those the loss does not reach on this rank
  // while other ranks ran them, and the ranks' collectives fell out of step.
  struct TakenAlwaysRun {
    std::vector<std::shared_ptr<Node>> nodes;
    bool retain;
    // (Otherwise they are freed with `nodes`, after ClearPending below has reset them.)
    void put_back() {
      if (!retain) return;
      for (auto& n : nodes) t_always_run.push_back(std::move(n));
      nodes.clear();
    }
    ~TakenAlwaysRun() {
      try {
        put_back();
      } catch (...) {  // (out of memory while unwinding: the list stays short rather than terminate)
      }
    }
  } taken{{}, retain_graph};
  std::vector<std::shared_ptr<Node>>& always_run = taken.nodes;
  always_run.swap(t_always_run);
  drop_released(always_run);  // run and freed by a backward on another thread
  if (!root.requires_grad() && always_run.empty()) {
    fail<AutogradError>("backward", "the ", root.shape(), " tensor does not require grad and has no graph");
  }

  NoGradGuard no_grad;
  struct Depth {
    Depth() {
      if (t_backward_depth++ == 0) t_backward_serial = g_next_backward_serial.fetch_add(1, std::memory_order_relaxed);
    }
    ~Depth() {
      // An outermost backward that throws drops its callbacks: the work they would finish belongs to
      // a step that failed.
      if (--t_backward_depth == 0 && std::uncaught_exceptions() > 0) t_backward_end.clear();
    }
  } depth;
  // Every node reachable from the root, then every node reachable only from always-run nodes.
  // The latter run with zero gradients (keeping ranks in step) but are not freed: they may belong
  // to another graph whose own backward is still to come (two forwards, then two backwards).
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  auto visit = [&](Node* n) {
    if (n && seen.insert(n).second) stack.push_back(n);
  };
  auto drain = [&] {
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      order.push_back(n);
      for (const Edge& e : n->next) visit(e.node.get());
    }
  };
  visit(impl_of(root)->grad_fn.get());
  drain();
  const std::unordered_set<Node*> from_root(order.begin(), order.end());
  for (const auto& n : always_run) visit(n.get());
  drain();
  std::sort(order.begin(), order.end(), [](const Node* a, const Node* b) { return a->sequence > b->sequence; });

  // Pending gradients must not outlive this call, even when a node throws.
  struct ClearPending {
    std::vector<Node*>& nodes;
    ~ClearPending() {
      for (Node* n : nodes) {
        n->pending = Tensor();
        n->written = {};
        n->reached = false;
        n->carries = false;
      }
    }
  } clear{order};

  // A nested backward (a checkpointed block's, run by its node) reaches what that node's own
  // gradient reached: nothing, where the node runs only because it is always-run.
  const bool root_reached = t_running_reached, root_passes = t_running_passes;
  if (Node* first = impl_of(root)->grad_fn.get()) {
    first->pending = grad;
    first->reached = root_reached;
    first->carries = root_passes && !root_reached;
  } else if (root.requires_grad() && root_passes) {
    accumulate_leaf(*impl_of(root), grad, root_reached);
  }

  auto release_unless_retained = [&](Node* node) {
    if (retain_graph || !from_root.count(node)) return;
    node->backward = nullptr;
    node->saved.clear();
    node->released.store(true, std::memory_order_release);
  };
  for (Node* node : order) {
    if (node->released.load(std::memory_order_relaxed)) {
      fail<AutogradError>("backward", "the graph through ", node->name,
                          " was freed by an earlier backward; pass retain_graph=true to keep it");
    }
    complete_pending(*node);
    Tensor g = std::move(node->pending);
    if (!g.defined()) {
      if (!node->always_run) continue;
      g = zeros(node->out_shape, Options(node->out_dtype, node->out_backend));
    }
    // A view op's backward may hand on a view (permute's is a permuted g): every backward
    // function receives a contiguous gradient, so none has to ask, unless its node says it
    // reads strides (strided_grad).
    if (!node->strided_grad) g = detail::dense(g);
    GradMask mask;
    if (node->next.size() <= 64) {
      std::uint64_t bits = 0;
      for (std::size_t i = 0; i < node->next.size(); ++i) {
        if (node->next[i].connected()) bits |= std::uint64_t{1} << i;
      }
      mask = GradMask(bits);
    } else {  // more inputs than bits (concat of many tensors): a flag per input
      auto flags = std::make_shared<std::vector<bool>>(node->next.size());
      for (std::size_t i = 0; i < node->next.size(); ++i) (*flags)[i] = node->next[i].connected();
      mask = GradMask(std::move(flags));
    }
    // Restored, not cleared: a node's backward may run a nested backward (activation checkpointing).
    struct RestoreRunning {
      const char* previous = t_running_node;
      bool previous_reached = t_running_reached, previous_passes = t_running_passes;
      ~RestoreRunning() {
        t_running_node = previous;
        t_running_reached = previous_reached;
        t_running_passes = previous_passes;
      }
    } restore_running;
    t_running_node = node->name;
    t_running_reached = node->reached;
    // What an always-run node the loss did not reach hands on is zeros: dropped, so that the
    // inputs it alone would reach get no gradient (the dense graph's leaves get none), unless it
    // is a collective, whose gradients hold other ranks' too, or carries such gradients. (A node
    // that is not always-run and that nothing reached, the root of such a node's nested backward,
    // has nothing to run for.)
    const bool passes = node->reached || node->carries || node->collective;
    t_running_passes = passes;
    if (!passes && !node->always_run) {
      release_unless_retained(node);
      continue;
    }
    if (passes && add_into_region(*node, g)) {
      mark(*node->next[0].node, *node);
      release_unless_retained(node);
      continue;
    }
    if (passes && add_into_leaf_region(*node, g)) {
      release_unless_retained(node);
      continue;
    }
    std::vector<Tensor> grads = node->backward(g, node->saved, mask);
    g = Tensor();
    if (grads.size() != node->next.size()) {
      fail<AutogradError>("backward", node->name, " returned ", grads.size(), " gradients for ", node->next.size(),
                          " inputs");
    }
    for (std::size_t i = 0; i < grads.size(); ++i) {
      Edge& e = node->next[i];
      if (!grads[i].defined() || !e.connected() || !passes) continue;
      if (e.node && (grads[i].shape() != e.node->out_shape || grads[i].dtype() != e.node->out_dtype)) {
        fail<AutogradError>("backward", node->name, " produced a gradient ", dtype_name(grads[i].dtype()), " ",
                            grads[i].shape(), " for its input ", i, " of ", dtype_name(e.node->out_dtype), " ",
                            e.node->out_shape);
      }
      if (e.node) {
        complete_pending(*e.node);
        accumulate(e.node->pending, std::move(grads[i]));
        mark(*e.node, *node);
      } else {
        accumulate_leaf(*e.leaf, std::move(grads[i]), node->reached, node, i);
      }
    }
    release_unless_retained(node);
  }
  taken.put_back();  // (a retained graph's, before the backward-end callbacks run)
  if (t_backward_depth == 1) {
    // Run with the depth still counted, so that a callback queueing another is still "in backward";
    // one that throws drops the rest (see Depth).
    for (std::size_t i = 0; i < t_backward_end.size(); ++i) {
      std::function<void()> callback = std::move(t_backward_end[i]);
      callback();
    }
    t_backward_end.clear();
  }
}

}  // namespace ruda::autograd
