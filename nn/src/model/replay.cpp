#include "model/replay.h"

namespace ruda::nn {

namespace {
thread_local CheckpointReplay* innermost = nullptr;
}  // namespace

CheckpointReplay::CheckpointReplay(const Module& block, const std::vector<bool>& flags,
                                   const std::vector<std::uint64_t>& draws)
    : outer_(innermost) {
  std::size_t f = 0, d = 0;
  for (const auto& [path, m] : block.named_modules()) {
    if (f < flags.size()) training_.emplace(m, flags[f++]);
    if (const auto* dropout = dynamic_cast<const Dropout*>(m); dropout && d < draws.size()) {
      next_draw_.emplace(dropout, draws[d++]);
    }
  }
  innermost = this;
}

CheckpointReplay::~CheckpointReplay() { innermost = outer_; }

const bool* CheckpointReplay::training_of(const Module& m) noexcept {
  for (const CheckpointReplay* r = innermost; r; r = r->outer_) {
    if (const auto it = r->training_.find(&m); it != r->training_.end()) return &it->second;
  }
  return nullptr;
}

std::uint64_t* CheckpointReplay::next_draw_of(const Dropout& d) noexcept {
  for (CheckpointReplay* r = innermost; r; r = r->outer_) {
    if (const auto it = r->next_draw_.find(&d); it != r->next_draw_.end()) return &it->second;
  }
  return nullptr;
}

}  // namespace ruda::nn
