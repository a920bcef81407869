// Sharded checkpoints of a module and its optimizer.
//
// Layout of a checkpoint directory (dir/step-00001234/):
//   rank-00000-of-00004.safetensors ... one file per rank: its unpadded slices of every parameter
//       ("model/<name>") and of its optimizer state ("optim/<name>/<state>"), dtypes kept, and
//       in its metadata the rank, world size and step it was written for (a step saved again
//       writes rank-00000-of-00004.b.safetensors beside the old files, and back the next time;
//       the index names each rank's file, and replacing the index swaps the new files in);
//   index.json    names, parameter numbers, logical shapes, dtypes, the world size, which file holds
//       which element range of each parameter with an XXH3-64 hash of every 64 KiB block of it,
//       the optimizer's kind, scalar state (steps, lr), each parameter's own step count where it
//       differs (it had no gradient in some steps) and state tensors' dtypes, and the caller's
//       extra state (step, RNG, data position, model description), and the seed and position of
//       each Dropout's stream by module path (restored by load_checkpoint).
// Writes are atomic and ordered: every rank writes its file (temporary file, flush, rename) and
// reports its checksums, all ranks agree that every file is complete, rank 0 writes index.json the
// same way, and then points dir/latest at the new directory. Killed at any moment, the previous
// checkpoint stays loadable; what the kill left (temporary files, steps without an index) is
// removed by the next save.
//
// Reading checks before it trusts: index.json is validated as a whole (the same function serves
// load, verify, list and consolidate), every rank file must be a regular file written for the
// index's rank, world size and step (a swapped or stale file is refused), and every block read
// must match its hash. Loading reads only the bytes each rank needs: with the same world size its
// own file's slices; with another world size the element ranges of the new slice from whichever
// files hold them (resharding), never a full tensor per rank.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <ruda/collectives.h>
#include <ruda/nn/module.h>
#include <ruda/nn/optim.h>

namespace ruda::nn {

struct CheckpointInfo {
  std::string directory;  // the step directory that was written or read
  std::int64_t step = 0;
  int world_size = 0;  // the world size it was saved with
  std::map<std::string, std::string> extra;
  std::uint64_t bytes_read = 0;  // by load_checkpoint on this rank: headers and the ranges it needed
  /// save_checkpoint on rank 0: what the directory's upkeep (removing leftovers of killed saves and
  /// old steps) skipped because it could not inspect or remove it, in one message; the save
  /// itself succeeded. load_checkpoint: what it did not load that a caller may expect (no
  /// optimizer state for the optimizer given); the load itself succeeded.
  std::vector<std::string> warnings = {};
};

/// Saves `module` (sharded over comm or dense) and `optimizer` (may be null) as checkpoint `step`
/// under `dir`, keeping the newest `keep` checkpoints (0: keep all). Collective over comm. A step
/// saved again keeps its old files and index until the new index replaces it: a failed or killed
/// save leaves it whole. IOError on every rank, before anything is written, for an empty `dir`, a
/// negative step or keep, extra state that is not UTF-8, or ranks that name different
/// directories, steps or models. Every IOError it raises is raised on every rank alike (a rank's
/// failed write names that rank and its error on all); only a collective's own failure
/// (CollectiveError) is one rank's. `comm` must be the communicator the module was sharded over
/// (ShardingError on each rank, before any collective, otherwise). Hybrid (fully_shard over a
/// ShardMesh): every rank calls it over mesh.shard(); the first replica (replicate rank 0) writes
/// and the others wait for its outcome, returning the same info or raising IOError naming its
/// failure.
CheckpointInfo save_checkpoint(const std::string& dir, std::int64_t step, const Module& module, Optimizer* optimizer,
                               Communicator& comm, const std::map<std::string, std::string>& extra = {}, int keep = 2);

/// The checksummed unit of a piece: a resharding load reads at most two such blocks per tensor
/// beyond its own range, to check them.
inline constexpr std::size_t kChecksumBlockBytes = std::size_t{64} << 10;

struct LoadOptions {
  /// Check every block read against its hash in the index (default). Off saves the hashing
  /// (XXH3; from the page cache a checked load takes ~1.4x the
  /// unchecked time, from disk the read dominates: tools/bench --suite checkpoint), not the
  /// reading; the index, the files' headers and their identity are checked either way.
  bool verify_checksums = true;
};

/// Loads a checkpoint into `module` (sharded at comm's world size, or dense) and `optimizer` (may
/// be null). `path` is a step directory or a checkpoint directory (its latest complete step).
/// Parameters are matched by name; a missing name, a shape or dtype mismatch, a missing, swapped,
/// stale, damaged or non-regular file raise IOError naming what is wrong, as does optimizer state
/// of another kind of optimizer, with other state tensors, or of another dtype. Collective: the ranks
/// agree on the outcome, so that if any rank fails every rank raises (the failing rank its own
/// error, the others an IOError naming it and its error). The ranks must load the same checkpoint
/// (the same index.json, wherever each finds it) into the same model, with an optimizer on all or
/// none: otherwise every rank raises an IOError naming the ranks that differ, before anything is
/// loaded. A checkpoint the index shows does not fit (names, shapes, dtypes, the optimizer's kind,
/// state and groups) is refused before anything is loaded too; after a failure while reading (a
/// damaged or missing file) the module's values and the optimizer's state are unspecified (its step
/// counts and rate are set last, so they keep their values). A checkpoint without
/// optimizer state (a model-only one: ruda-ckpt split of a consolidated file) loads into a run with
/// an optimizer, which keeps its fresh state: the returned info's `warnings` says so.
CheckpointInfo load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer, Communicator& comm,
                               const LoadOptions& options = {});

/// The step directory `path` designates (itself, or the latest complete step under it); IOError if none,
/// saying whether `path` does not exist or is something else than a checkpoint (a file, say).
std::string resolve_checkpoint(const std::string& path);
/// What part of a checkpoint `path` would replace, as a phrase ("lies inside the step directory
/// D", "is the latest pointer of the checkpoint directory D"), or "" when it is none: a file in a
/// step directory (step-N, or any directory holding an index.json, which loads as a step), a
/// `latest` beside step directories, or a directory's save lock (.ruda-save.lock). Writers of
/// other files (consolidate, ruda-train's metrics) refuse such a path: writing it would damage a
/// checkpoint.
std::string checkpoint_member(const std::string& path);
/// Why `dir` cannot be a checkpoint directory, as a phrase ("is a checkpoint step (it holds an
/// index.json), ...", "lies inside D, a checkpoint step"), or "" when it can: a step directory
/// itself, or any place inside one, where a checkpoint would be hidden behind the step (readers
/// take a directory holding an index.json for a step) and removed by its directory's upkeep.
/// save_checkpoint and split_checkpoint refuse such a directory (IOError).
std::string checkpoint_dir_conflict(const std::string& dir);
/// Whether checkpoint directory `dir` holds a complete checkpoint (a step with its index), whatever
/// its `latest` pointer says. IOError naming it if `latest` is there but not a pointer file.
bool holds_checkpoint(const std::string& dir);

struct CheckpointEntry {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  std::uint64_t id = 0;  // its number in the saved module (1, 2, ... in named_parameters order; 0: a split's)
  bool sharded = false;
  std::vector<std::string> optimizer_state;  // names of the per-parameter optimizer tensors
};

/// What a checkpoint holds, from its index (no tensor data is read).
struct CheckpointSummary {
  CheckpointInfo info;
  int version = 0;         // of the format: 1 had no checksums
  bool checksums = false;  // whether the index holds checksums of the data
  std::vector<CheckpointEntry> params;
  std::int64_t optimizer_steps = -1;  // -1 without optimizer state
  std::vector<std::string> files;
};
CheckpointSummary describe_checkpoint(const std::string& path);

/// Checks that the checkpoint `saved` continues this run before anything is loaded: its extra
/// state must name the same model (extra["model"] == model, else an IOError naming both, so a
/// checkpoint of another model is not reported as a shape mismatch), and every setting of the data
/// stream it recorded must equal this run's (else an ArgumentError naming the setting and both
/// values: the resumed run would train on other samples). Settings it did not record pass.
void check_resumable(const CheckpointInfo& saved, const std::string& model,
                     const std::map<std::string, std::string>& data_stream);

/// Validates the index as load_checkpoint does, opens every file and checks its header and identity
/// against the index, and reads every byte of every piece, checking each block against its hash;
/// returns the bytes checked. IOError on the first problem.
std::uint64_t verify_checkpoint(const std::string& path);

/// Writes one full safetensors file with every parameter at its logical shape (names without
/// prefix, the checkpoint's extra state as metadata): for other tools, or to change layouts.
/// IOError, before anything is written, if `output_file` is a file of the checkpoint, lies inside
/// its step directory or is its `latest` pointer, however spelled or linked, or is not a regular
/// file (a FIFO, a device, a directory, a symbolic link: see safetensors::write).
void consolidate_checkpoint(const std::string& path, const std::string& output_file);

/// Cuts a full safetensors file (a consolidated checkpoint, or any file of float tensors) into a
/// sharded checkpoint for `world_size` ranks at out_dir/step-<step>, without optimizer state.
/// IOError, before anything is written, if the input lies where the split writes or removes (inside
/// that step directory, out_dir's `latest`, a step directory of out_dir without an index), and
/// for any directory it cannot create (a file in the way), naming the path.
CheckpointInfo split_checkpoint(const std::string& input_file, int world_size, const std::string& out_dir,
                                std::int64_t step = 0);

}  // namespace ruda::nn
