#include "model/replay.h"

#include <utility>

namespace ruda::nn {

namespace {
thread_local CheckpointReplay* innermost = nullptr;
}  // namespace

CheckpointReplay::State CheckpointReplay::snapshot(const Module& block) {
  State state;
  for (const auto& [path, m] : block.named_modules()) {
    state.training.emplace(m, m->is_training());
    if (const auto* dropout = dynamic_cast<const Dropout*>(m)) state.next_draw.emplace(dropout, dropout->next_draw());
  }
  return state;
}

CheckpointReplay::CheckpointReplay(State state) : state_(std::move(state)), outer_(innermost) { innermost = this; }

CheckpointReplay::~CheckpointReplay() { innermost = outer_; }

const bool* CheckpointReplay::training_of(const Module& m) noexcept {
  for (const CheckpointReplay* r = innermost; r; r = r->outer_) {
    if (const auto it = r->state_.training.find(&m); it != r->state_.training.end()) return &it->second;
  }
  return nullptr;
}

std::uint64_t* CheckpointReplay::next_draw_of(const Dropout& d) noexcept {
  for (CheckpointReplay* r = innermost; r; r = r->outer_) {
    if (const auto it = r->state_.next_draw.find(&d); it != r->state_.next_draw.end()) return &it->second;
  }
  return nullptr;
}

}  // namespace ruda::nn
