// A block as a forward ran it, for nn::checkpoint's recompute on the calling thread: its modules'
// training flags and the draws its dropouts took, which Module::is_training and Dropout::take read
// on this thread alone, in place of the modules' own, while the CheckpointReplay lives. The modules
// themselves are not touched: other threads may run forwards of the same model meanwhile (graphs
// on different threads may run backward at once, through shared parameters), and their flags and
// draws stay theirs. Setting the flags and stream positions on the shared modules for the
// recompute and putting them back after raced with those threads' forwards, and a draw another
// thread took during the recompute was rewound and taken again.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <ruda/nn/layers.h>
#include <ruda/nn/module.h>

namespace ruda::nn {

class CheckpointReplay {
 public:
  /// The stream positions one Dropout's draws took in a forward, in order (each with its span,
  /// world x count), and where its stream stood before it.
  struct Draws {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> taken;
    std::uint64_t before = 0;
    std::size_t used = 0;  // replayed so far
    /// The next draw's position: the forward's own, then on from its last (or from `before`).
    std::uint64_t next() const noexcept;
  };
  /// What a forward of a block runs with: each module's training flag, taken before it, and each
  /// Dropout's draws, recorded while it runs (Recording). Positions read before the forward were
  /// not the ones it took where another thread drew from a shared Dropout in between: the
  /// recompute replayed another mask than the forward's (wrong gradients).
  struct State {
    std::unordered_map<const Module*, bool> training;
    std::unordered_map<const Dropout*, Draws> draws;
  };
  static State snapshot(const Module& block);

  /// While alive, the draws this thread's Dropouts of `state` take are recorded into it (the
  /// positions they return, which inside a recompute are the replayed ones: nested checkpoints).
  class Recording {
   public:
    explicit Recording(State& state);
    ~Recording();
    Recording(const Recording&) = delete;
    Recording& operator=(const Recording&) = delete;

   private:
    State& state_;
    Recording* outer_;
    friend class CheckpointReplay;
  };

  /// Replays `state` on this thread until destroyed.
  explicit CheckpointReplay(State state);
  ~CheckpointReplay();
  CheckpointReplay(const CheckpointReplay&) = delete;
  CheckpointReplay& operator=(const CheckpointReplay&) = delete;

  /// The flag of `m` in this thread's innermost replay that holds it; nullptr when none does.
  static const bool* training_of(const Module& m) noexcept;
  /// The draws of `d` likewise, which the caller advances (Draws::used).
  static Draws* draws_of(const Dropout& d) noexcept;
  /// Notes a draw `d` took at `position` (`span` values) in this thread's recording, if any.
  static void record(const Dropout& d, std::uint64_t position, std::uint64_t span) noexcept;

 private:
  State state_;
  CheckpointReplay* outer_;  // a recompute inside a recompute (nested checkpoints) replays its own block first
};

}  // namespace ruda::nn
