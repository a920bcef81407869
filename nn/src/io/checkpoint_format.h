// The on-disk format of sharded checkpoints (internal to nn): file names, the block checksums,
// index.json parsed and validated once for every reader (load, verify, list, consolidate), and
// the rank files, opened with their identity checked. checkpoint.cpp builds the operations on it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ruda/nn/checkpoint.h>
#include <ruda/nn/safetensors.h>
#include <nlohmann/json_fwd.hpp>

namespace ruda::nn::ckpt {

inline constexpr const char* kFormat = "ruda-sharded-checkpoint";
// Version 2 adds the checksums of every piece to the index and the step to every rank file.
// Version 1 checkpoints still load and verify, with no checksums to check their data against.
// 1: no checksums; 2: a checksum per block of every piece; 3: and one over the index itself
// (kIndexChecksumKey), so that an edited or damaged index.json is an error, not a different model;
// 4: a parameter the optimizer does not update is marked "optimized": false and has no optimizer
// state (a frozen backbone's zero moments were kept in memory and written to every checkpoint);
// 5: nor has one it updates but that has taken no step (a frozen backbone given to the optimizer
// with its head): it records no "state_dtypes", and its own step count is 0.
inline constexpr int kVersion = 5;
inline constexpr const char* kIndexChecksumKey = "index_xxh3";
inline constexpr std::size_t kMaxLatestBytes = 4096;
inline constexpr int kMaxWorldSize = 1 << 24;  // the largest world size an index may have
// The largest step a checkpoint may record: 2^53, exact in every JSON reader (a double) and far
// from int64's end, which a training loop's step + k arithmetic on a resumed INT64_MAX overflowed.
inline constexpr std::int64_t kMaxStep = std::int64_t{1} << 53;

// A piece's bytes are checked in blocks (kChecksumBlockBytes), each with its own XXH3-64 hash: a
// load that reshards reads parts of pieces and checks the whole blocks around what it reads (at
// most two blocks more than its range per tensor), instead of reading whole pieces or trusting
// what it did not check. The hashes cost 16 bytes of index per block, 0.025 % of the data.
inline constexpr std::size_t kChecksumBlock = kChecksumBlockBytes;
inline constexpr std::size_t kHashDigits = 16;
static_assert(safetensors::kChunkBytes % kChecksumBlock == 0, "chunked reads must start on block boundaries");

/// IOError "checkpoint <where>: <what>".
[[noreturn]] void fail(const std::string& where, const std::string& what);

/// FNV-1a of `text`: the same value in every process of one build (std::hash need not be), for
/// ranks comparing what each holds without sending it.
std::uint64_t fingerprint(std::string_view text);

std::string step_name(std::int64_t step);
/// rank-00000-of-00002.safetensors; with `alternate`, rank-00000-of-00002.b.safetensors: the name a
/// step saved again writes beside the plain one, which the index in place may still name (its
/// files are replaced only when the new index replaces it).
std::string rank_file(int rank, int world, bool alternate = false);
/// Whether `name` is a rank file's name of either form (for the upkeep of a rewritten step).
bool is_rank_file_name(const std::string& name);
inline std::string model_tensor(const std::string& param) { return "model/" + param; }
inline std::string optim_tensor(const std::string& param, const std::string& state) {
  return "optim/" + param + "/" + state;
}
/// A rank file's own record of what it is, checked against the index on every read: the rank,
/// world size and step it was written for, and where each of its tensors' pieces starts in the
/// flattened tensor (`offsets`: tensor name -> element offset). The offsets make an index whose
/// pieces were reordered (self-consistent, every checksum matching) fail instead of loading
/// permuted weights; files written before they were recorded lack them and are read as before.
std::map<std::string, std::string> rank_file_metadata(int rank, int world, std::int64_t step,
                                                      const std::map<std::string, std::int64_t>& offsets);

/// Appends the hash of every kChecksumBlock-byte block of `data` (the last one shorter), 16 hex
/// digits each. `data` must start on a block boundary of its piece.
void append_block_hashes(std::string& out, const void* data, std::size_t bytes);

// A piece of a parameter: elements [offset, offset + count) of the flattened tensor, in `rank`'s file.
struct IndexPiece {
  int rank = 0;
  std::int64_t offset = 0, count = 0;
  std::map<std::string, std::string> hashes;  // tensor name in the rank file -> its blocks' hashes (version 2)
};

struct IndexParam {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  std::int64_t numel = 0;
  std::uint64_t id = 0;
  bool sharded = false;
  std::vector<IndexPiece> pieces;  // by offset, tiling [0, numel) exactly
  // Whether the optimizer that saved the checkpoint updated it: only then do its pieces hold
  // optimizer state (every parameter's do in checkpoints before version 4).
  bool optimized = true;
  // Whether its pieces hold optimizer state (has_state()): version 5 on, an optimized parameter
  // that had taken no step has none (it records no state dtypes).
  bool stateless = false;
  bool has_state() const { return optimized && !stateless; }
  // The dtype of each of its optimizer state tensors (by state name; recorded since the index
  // has them: empty in older checkpoints, whose state is checked against the optimizer only).
  std::map<std::string, DType> state_dtypes;
  // Its own optimizer step count, where it differs from the optimizer's (a parameter that had no
  // gradient in some steps); none: the optimizer's.
  std::optional<std::int64_t> steps;
};

// One optimizer parameter group as saved: its settings and its parameters by name.
struct IndexGroup {
  std::string name;
  double lr_scale = 1.0;
  std::optional<double> weight_decay;  // none: the optimizer's own
  std::vector<std::string> params;
  bool operator==(const IndexGroup&) const = default;
};

// index.json, validated: every value the readers use has been checked for kind and range, so
// nothing an index says can send a read or a write outside a tensor or a file.
struct Index {
  std::string dir, path;  // the step directory and its index.json
  // fingerprint() of index.json's text (read_index; 0 for an index parsed from JSON): ranks that
  // load one checkpoint together compare it, wherever each finds the checkpoint.
  std::uint64_t text_fingerprint = 0;
  int version = kVersion;
  std::int64_t step = 0;
  int world_size = 0;
  std::vector<std::string> files;
  std::vector<IndexParam> params;
  bool has_optimizer = false;
  // The optimizer that wrote the state ("AdamW", "SGD", ...; absent in older checkpoints).
  std::optional<std::string> optimizer_kind;
  std::int64_t optimizer_steps = 0;
  double lr = 0;
  std::vector<std::string> optimizer_state;
  // The optimizer's parameter groups (absent in checkpoints written before groups existed).
  std::optional<std::vector<IndexGroup>> optimizer_groups;
  // The optimizer's settings besides its rate, by name ("beta1", "momentum", ...; a flag as 0 or
  // 1): absent in older checkpoints and for an optimizer outside nn.
  std::map<std::string, double> optimizer_settings;
  std::map<std::string, std::string> extra;
  // The dropout streams of the saved module, by module path: seed and position (absent in older
  // checkpoints, and for a module without dropout).
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> streams;

  bool has_checksums() const { return version >= 2; }
  // The tensors a piece of `p` has in its rank file: the parameter's values, then its optimizer state.
  std::vector<std::string> tensors(const IndexParam& p) const {
    std::vector<std::string> out = {model_tensor(p.name)};
    if (!p.has_state()) return out;
    for (const auto& s : optimizer_state) out.push_back(optim_tensor(p.name, s));
    return out;
  }
};

/// index.json of step directory `dir`, read (a regular file of bounded size) and validated.
Index read_index(const std::string& dir);
/// An index given as JSON (`path` names it in errors), validated as read_index validates.
Index parse_index(const nlohmann::json& j, const std::string& path, const std::string& dir);

/// The index with its checksum (kIndexChecksumKey: XXH3-64, as hex, of the compact JSON of the
/// index without that key) added: what publish() writes.
nlohmann::json with_index_checksum(nlohmann::json index);

// The rank files of a checkpoint, opened on first use. Each is checked as it opens: a regular file
// with a valid header (safetensors::Reader), written for this checkpoint's rank, world size and
// step, so that a file swapped with another rank's or left from another step is refused by name.
class RankFiles {
 public:
  explicit RankFiles(const Index& index);
  ~RankFiles();
  safetensors::Reader& open(int rank);
  /// Tensor `name` of `rank`'s file, checked to hold `count` elements (of `dtype`, when given)
  /// and, with checksums, to have one hash in `piece` per block.
  const safetensors::TensorInfo& tensor(int rank, const std::string& name, std::int64_t count,
                                        std::optional<DType> dtype, const IndexPiece& piece);
  std::uint64_t bytes_read() const;

 private:
  void check_identity(const safetensors::Reader& file, int rank) const;
  const Index& index_;
  std::vector<std::unique_ptr<safetensors::Reader>> readers_;
  // Each open file's recorded piece offsets (none: a file written before they were recorded).
  std::vector<std::optional<std::map<std::string, std::int64_t>>> offsets_;
};

/// Elements [first, first + count) of tensor `name` (one piece, of `elem`-byte elements) of
/// `file` into `out`. With `hashes`, every block the range touches is read whole and checked: the
/// blocks inside the range straight into `out`, the ones at its two ends through a scratch block.
void read_checked(const safetensors::Reader& file, const std::string& name, std::size_t elem, const std::string* hashes,
                  std::int64_t first, std::int64_t count, char* out);

/// Streams a whole piece of tensor `name` to consume(data, bytes) in chunks of at most
/// safetensors::kChunkBytes, checking every block against `hashes` when given.
void stream_checked(const safetensors::Reader& file, const std::string& name, std::int64_t count,
                    const std::string* hashes, const std::function<void(const char*, std::size_t)>& consume);

}  // namespace ruda::nn::ckpt
