#include "model/replay.h"

#include <utility>

namespace ruda::nn {

namespace {
thread_local CheckpointReplay* innermost = nullptr;
thread_local CheckpointReplay::Recording* recording = nullptr;
}  // namespace

std::uint64_t CheckpointReplay::Draws::next() const noexcept {
  if (used < taken.size()) return taken[used].first;
  return taken.empty() ? before : taken.back().first + taken.back().second;
}

CheckpointReplay::State CheckpointReplay::snapshot(const Module& block) {
  State state;
  for (const auto& [path, m] : block.named_modules()) {
    state.training.emplace(m, m->is_training());
    if (const auto* dropout = dynamic_cast<const Dropout*>(m)) state.draws[dropout].before = dropout->next_draw();
  }
  return state;
}

CheckpointReplay::Recording::Recording(State& state) : state_(state), outer_(recording) { recording = this; }

CheckpointReplay::Recording::~Recording() { recording = outer_; }

void CheckpointReplay::record(const Dropout& d, std::uint64_t position, std::uint64_t span) noexcept {
  if (!recording) return;
  // (A Dropout outside the block, which its forward reaches anyway, is replayed from its own
  // stream, as before: only the block's own are recorded.)
  const auto it = recording->state_.draws.find(&d);
  if (it == recording->state_.draws.end()) return;
  try {
    it->second.taken.emplace_back(position, span);
  } catch (...) {  // out of memory for a pair: the recompute continues from the last one recorded
  }
}

CheckpointReplay::CheckpointReplay(State state) : state_(std::move(state)), outer_(innermost) { innermost = this; }

CheckpointReplay::~CheckpointReplay() { innermost = outer_; }

const bool* CheckpointReplay::training_of(const Module& m) noexcept {
  for (const CheckpointReplay* r = innermost; r; r = r->outer_) {
    if (const auto it = r->state_.training.find(&m); it != r->state_.training.end()) return &it->second;
  }
  return nullptr;
}

CheckpointReplay::Draws* CheckpointReplay::draws_of(const Dropout& d) noexcept {
  for (CheckpointReplay* r = innermost; r; r = r->outer_) {
    if (const auto it = r->state_.draws.find(&d); it != r->state_.draws.end()) return &it->second;
  }
  return nullptr;
}

}  // namespace ruda::nn
