// The oneDNN backend's entry point and its introspection: counters and facts about this process,
// for tests, benchmarks and diagnostics. Free of oneDNN headers on purpose: code that includes it
// (tests, tools) needs no oneDNN include path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ruda/backend.h>

namespace ruda::onednn {

/// The backend registered as "onednn" (backends/builtin.cpp calls it once).
std::unique_ptr<Backend> make_backend();

struct Stats {
  std::int64_t primitives_created = 0;  // oneDNN primitives built: cache misses that oneDNN accepted
  std::int64_t refusals = 0;            // configurations oneDNN refused (remembered, so asked once each)
  std::int64_t cache_hits = 0;          // lookups answered from the cache
  std::int64_t executions = 0;          // primitive executions
  std::int64_t cached = 0;              // entries in the cache now
};
/// Process-wide counters of the primitive cache.
Stats stats();
/// Shorthand for stats().primitives_created.
std::int64_t primitives_created();

/// Entries the primitive cache keeps ($RUDA_ONEDNN_CACHE_CAPACITY, default 4096). Beyond it, the
/// entries unused since the previous sweep go first. Lowering it evicts at once.
std::size_t cache_capacity();
void set_cache_capacity(std::size_t entries);
/// The capacity a RUDA_ONEDNN_CACHE_CAPACITY text gives: a whole number of at least 1, else (none,
/// or a text that is no such number, with a warning on stderr) the default, 4096.
std::size_t cache_capacity_from(const char* text);

/// The ISA oneDNN dispatches to after ONEDNN_MAX_CPU_ISA ("avx512_core_bf16", "avx2", ...).
std::string cpu_isa();
/// Whether bf16 matmuls run on native bf16 instructions; where not, they are computed in f32.
bool bf16_native();

/// Whether every kernel oneDNN can run does (RUDA_ONEDNN_KERNELS=all). By default the kernels that
/// measured faster on Eigen (f32 transcendental activations, backward passes from the output,
/// f32 broadcasts; see backends/onednn/README.md) run there.
bool all_kernels();

/// The oneDNN implementations primitives were built with: per primitive kind ("matmul") and
/// implementation ("gemm:jit", "brg:avx512_core_amx", ...), how many were built. Says which of
/// oneDNN's kernels run on this CPU (e.g. whether bf16 products reach AMX).
struct Implementation {
  std::string primitive, implementation;
  std::int64_t built = 0;
};
std::vector<Implementation> implementations();

/// One distinct way an op did not run as a native oneDNN primitive of its own dtype.
struct Fallback {
  std::string op, dtype, reason;
};
/// The most distinct fallbacks recorded: past them one last entry says the log is full (some
/// reasons name the shapes refused, so a program whose shapes keep changing would grow it forever).
inline constexpr std::size_t kMaxFallbacks = 1024;
/// Every distinct (op, dtype, reason) seen so far, in order, up to kMaxFallbacks. With
/// RUDA_LOG=debug each is also printed to stderr once, when first taken.
std::vector<Fallback> fallbacks();

}  // namespace ruda::onednn
