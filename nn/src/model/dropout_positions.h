// The draw positions of every Dropout in a module, and putting them back: an activation
// checkpoint's recompute must draw the forward's masks again (nn::checkpoint), and a memory probe's
// steps must leave training's masks as they were (probe_step).
#pragma once

#include <cstdint>
#include <vector>

#include <ruda/nn/layers.h>
#include <ruda/nn/module.h>

namespace ruda::nn {

/// Each Dropout's stream position, in named_modules' order (its next draw: inside a checkpoint's
/// recompute, the replayed one, so that a checkpoint nested in the block records its forward's).
inline std::vector<std::uint64_t> dropout_positions(const Module& module) {
  std::vector<std::uint64_t> positions;
  for (const auto& [path, m] : module.named_modules()) {
    if (const auto* d = dynamic_cast<const Dropout*>(m)) positions.push_back(d->next_draw());
  }
  return positions;
}

/// Puts back what dropout_positions gave for the same module. (The module is const to its
/// callers, whose step or block moves the streams through these same objects anyway.)
inline void set_dropout_positions(const Module& module, const std::vector<std::uint64_t>& positions) {
  std::size_t i = 0;
  for (const auto& [path, m] : module.named_modules()) {
    if (const auto* d = dynamic_cast<const Dropout*>(m))
      const_cast<Dropout*>(d)->generator().set_offset(positions.at(i++));
  }
}

}  // namespace ruda::nn
