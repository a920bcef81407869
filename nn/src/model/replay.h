// A block as a forward ran it, for nn::checkpoint's recompute on the calling thread: its modules'
// training flags and its dropouts' next draws, which Module::is_training and Dropout::take read
// on this thread alone, in place of the modules' own, while the CheckpointReplay lives. The modules
// themselves are not touched: other threads may run forwards of the same model meanwhile (graphs
// on different threads may run backward at once, through shared parameters), and their flags and
// draws stay theirs. Setting the flags and stream positions on the shared modules for the
// recompute and putting them back after raced with those threads' forwards, and a draw another
// thread took during the recompute was rewound and taken again.
#pragma once

#include <cstdint>
#include <unordered_map>

#include <ruda/nn/layers.h>
#include <ruda/nn/module.h>

namespace ruda::nn {

class CheckpointReplay {
 public:
  /// What a forward of a block runs with, taken before it: each module's training flag and each
  /// Dropout's next draw (inside a recompute, the replayed ones: checkpoints nested in a block).
  struct State {
    std::unordered_map<const Module*, bool> training;
    std::unordered_map<const Dropout*, std::uint64_t> next_draw;
  };
  static State snapshot(const Module& block);

  /// Replays `state` on this thread until destroyed.
  explicit CheckpointReplay(State state);
  ~CheckpointReplay();
  CheckpointReplay(const CheckpointReplay&) = delete;
  CheckpointReplay& operator=(const CheckpointReplay&) = delete;

  /// The flag of `m` in this thread's innermost replay that holds it; nullptr when none does.
  static const bool* training_of(const Module& m) noexcept;
  /// The next draw of `d` likewise, which the caller advances.
  static std::uint64_t* next_draw_of(const Dropout& d) noexcept;

 private:
  State state_;
  CheckpointReplay* outer_;  // a recompute inside a recompute (nested checkpoints) replays its own block first
};

}  // namespace ruda::nn
