#include <ruda/autograd.h>
#include <ruda/nn/layers.h>
#include <ruda/nn/recompute.h>

#include "model/replay.h"
#include "sharding/gather_scope.h"

namespace ruda::nn {

namespace {

// Grad mode on for a scope (backward runs with it off).
struct GradEnabled {
  bool previous = autograd::is_grad_enabled();
  GradEnabled() { autograd::set_grad_enabled(true); }
  ~GradEnabled() { autograd::set_grad_enabled(previous); }
};

}  // namespace

Tensor checkpoint(UnaryModule& block, const Tensor& x) {
  if (!x.defined()) fail<ArgumentError>("checkpoint", "the input tensor is undefined");
  if (!autograd::is_grad_enabled()) return block.forward(x);
  // The node's inputs: x, and one parameter leaf that needs a gradient, so that the node is
  // recorded even when x needs none (the first block after an embedding whose table is frozen).
  // Parameter gradients are not returned through the node: the nested backward accumulates them.
  // (One walk of the block's parameters serves the anchor, the versions below and `sharded`.)
  const std::vector<std::pair<std::string, Param>> params = block.named_parameters();
  Tensor anchor;
  for (const auto& [name, p] : params) {
    if (p.data().requires_grad()) {
      anchor = p.data();
      break;
    }
  }
  // Nothing the node could carry a gradient to: the block runs as it is. A parameter it reads
  // without having registered it (a table its parent holds) then still gets its gradient, which a
  // node with no input needing one dropped; where nothing needs one, no graph is recorded anyway.
  if (!anchor.defined() && !x.requires_grad()) return block.forward(x);
  // The parameters as the forward read them: one changed in place before the recompute (an
  // optimizer step between forward and backward) would make it mix the old upstream gradient with
  // the new weights, silently, where the plain block's backward refuses its saved weight's change.
  // (A tensor swapped in by set_data or fully_shard is read instead, as documented: only the
  // tensors held here are checked.)
  struct Used {
    std::string name;
    Tensor data;
    std::uint64_t version;
  };
  std::vector<Used> used;
  for (const auto& [name, p] : params) {
    if (!p.is_deferred()) used.push_back({name, p.data(), p.data().version()});
  }
  CheckpointReplay::State as_in_forward = CheckpointReplay::snapshot(block);
  const Tensor result = autograd::no_grad([&] {
    const CheckpointReplay::Recording recording(as_in_forward);  // the draws its dropouts take
    return block.forward(x);
  });
  if (!result.defined()) fail<ArgumentError>("checkpoint", "the block returned an undefined tensor");
  // An integer result carries no gradient (argmax): nothing to recompute for.
  if (!is_floating(result.dtype())) return result;
  // The node goes on a handle of its own: the block may return a tensor that exists beside this
  // call (x itself from an identity block, a parameter, a stored buffer), whose own graph or
  // leafhood a node recorded on it would overwrite (a parameter that stopped being a leaf; a
  // buffer whose node's recompute returned the buffer again, recursing without end).
  Tensor output = result.detach();
  // A sharded block's recompute gathers its weights: its node must run in every rank's backward,
  // reached by the loss or not, so that the ranks' collectives pair up (always-run). A block
  // without sharded parameters needs no such guarantee, and its node is an ordinary one: freed
  // with the forward's output when no backward comes (a validation forward with grad mode on),
  // as PyTorch's checkpoint graph is. Listed as always-run, such nodes ran in the next training
  // backward: recomputed for nothing, holding their inputs, on a module that might be gone.
  bool sharded = false;
  for (const auto& [name, p] : params) sharded = sharded || p.is_sharded();
  UnaryModule* target = &block;
  autograd::record("checkpoint", output, {x, anchor}, {x},
                   [target, alive = block.lifetime(), as_in_forward = std::move(as_in_forward), used = std::move(used)](
                       const Tensor& grad, const autograd::Saved& saved, autograd::GradMask needs) {
                     if (alive.expired()) {
                       // A sharded block destroyed before a backward ran its pending node: nothing left to
                       // recompute (every rank destroys its model alike), and no loss needs it.
                       if (!autograd::reached()) return std::vector<Tensor>{Tensor(), Tensor()};
                       fail<AutogradError>("backward", "checkpoint: the checkpointed block was destroyed before the ",
                                           "backward that recomputes it; keep the block alive until then");
                     }
                     for (const Used& u : used) {
                       if (u.data.version() != u.version) {
                         fail<AutogradError>("backward", "checkpoint: parameter '", u.name, "' ", u.data.shape(),
                                             " was modified in place after the forward that used it (version ",
                                             u.version, ", now ", u.data.version(),
                                             "); its recompute would not be the forward's: run the backward first");
                       }
                     }
                     Tensor input = saved[0].get().detach();
                     if (needs[0]) input.set_requires_grad(true);
                     Tensor recomputed;
                     {
                       GradEnabled grad_on;
                       RetainGathered retain;
                       // The recompute runs the block as the forward did: the forward's training flags (a
                       // model put in eval mode between forward and backward recomputed without its
                       // dropout masks: wrong gradients) and its masks, read on this thread alone: the
                       // model's own flags and streams stay as they are (restoring the positions the
                       // forward ended at rewound every draw made since: a later forward's, two
                       // micro-batches or a validation pass; or another thread's, made meanwhile).
                       const CheckpointReplay replay(as_in_forward);
                       recomputed = target->forward(input);
                     }
                     // A result that depends on nothing needing a gradient (a stored buffer, a forward under
                     // no_grad) passes none, as the plain block's would.
                     if (!recomputed.requires_grad()) return std::vector<Tensor>{Tensor(), Tensor()};
                     autograd::backward(recomputed, grad);
                     return std::vector<Tensor>{needs[0] ? input.grad() : Tensor(), Tensor()};
                   },
                   {.always_run = sharded, .owner = block.lifetime()});
  return output;
}

}  // namespace ruda::nn

namespace ruda {
RUDA_DEFINE_THREAD_FLAG(nn::RetainGathered)
}  // namespace ruda
