// Activation checkpointing: trade compute for memory by keeping only a block's input through the
// forward pass and recomputing the block's forward in backward.
//
// checkpoint(block, x) runs block.forward(x) without recording a graph, so none of the block's
// activations stay alive; it records one node that keeps x. In backward that node runs the block's
// forward again as the forward ran it (each module's training flag as it was then, and the same
// dropout draws), then puts flags and draw positions back, and backpropagates through it at once.
// The draws replayed are those of the Dropout modules registered under the block: a block that
// draws from a Dropout or a Generator held elsewhere gets other masks in the recompute, and so
// other gradients (PyTorch replays its global generator; ruda's dropouts each have their own). Sharded
// weights are gathered again by that recomputation, on every rank in the same order, and kept
// until the block's backward, which follows immediately; so a block costs the same collectives as
// with CheckpointStrategy::recompute (two gathers and a reduce-scatter per parameter). Gradients
// are bitwise those of running the block directly. The node always runs in backward (with a zero
// gradient where the loss does not reach it), so ranks never disagree on its collectives.
#pragma once

#include <ruda/nn/module.h>

namespace ruda::nn {

/// block.forward(x), keeping only x for backward. `block` must stay alive until the backward has
/// run. Under no_grad it is simply block.forward(x).
Tensor checkpoint(UnaryModule& block, const Tensor& x);

}  // namespace ruda::nn
