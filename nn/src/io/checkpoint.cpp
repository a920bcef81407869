// Sharded checkpoints: each rank writes its slices and reports their checksums, rank 0 writes the
// index; loading reshards by reading only the element ranges each rank needs, checking every
// block it reads. The format itself (names, checksums, the index parser, the rank files) is in
// checkpoint_format.cpp; this file holds the operations and the checkpoint directory's upkeep.
#include <cxxabi.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <tuple>
#include <typeinfo>

#include <ruda/autograd.h>
#include <ruda/nn/checkpoint.h>
#include <ruda/nn/layers.h>
#include <ruda/nn/safetensors.h>
#include <ruda/nn/sharded.h>
#include <nlohmann/json.hpp>

#include "io/checkpoint_format.h"
#include "io/files.h"

namespace ruda::nn {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace ckpt;

namespace {

// The dtype the index records for tensor `name` of parameter `p`: the parameter's for its values,
// the optimizer state's own where the index records it (nullopt in older checkpoints).
std::optional<DType> recorded_dtype(const IndexParam& p, const std::string& name) {
  if (name == model_tensor(p.name)) return p.dtype;
  for (const auto& [state, dtype] : p.state_dtypes) {
    if (name == optim_tensor(p.name, state)) return dtype;
  }
  return std::nullopt;
}

// The dtype an optimizer state of `p` is stored in: the index's record, or, in a checkpoint from
// before the records (version 4 and older), the parameter's dtype, which every state had then.
DType stored_state_dtype(const IndexParam& p, const std::string& state) {
  const auto recorded = p.state_dtypes.find(state);
  return recorded != p.state_dtypes.end() ? recorded->second : p.dtype;
}

// Calls visit(file, tensor name, param, piece) for every piece of every tensor (parameter values
// and optimizer state) of a checkpoint, after opening every file (so each one's identity is checked,
// including files that hold no piece).
template <class Visit>
void for_each_piece(const Index& index, RankFiles& files, Visit&& visit) {
  for (int r = 0; r < index.world_size; ++r) files.open(r);
  for (const IndexParam& p : index.params) {
    for (const IndexPiece& piece : p.pieces) {
      for (const auto& name : index.tensors(p)) {
        files.tensor(piece.rank, name, piece.count, recorded_dtype(p, name), piece);
        visit(files.open(piece.rank), name, p, piece);
      }
    }
  }
}

// Runs fn, turning what an unexpected index or file makes the JSON library throw into the
// IOError every checkpoint problem is.
template <class F>
auto with_index_errors(const std::string& dir, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const json::exception& e) {
    fail(dir, "index.json is malformed: " + safetensors::printable_error(e));
  }
}

// --- the checkpoint directory ---

// "step-" and digits only, as step_dir_name writes them: a directory of the user's that merely starts
// with "step-" (step-notes/) is not ruda's, and upkeep must never remove it.
bool is_step_name(const std::string& name) {
  return name.size() > 5 && name.rfind("step-", 0) == 0 &&
         std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Whether step directory name `a` names an earlier step than `b` (both is_step_name): by number,
// not as text, since step_name's %08lld grows a digit at 100000000 ("step-100000000" sorted
// before "step-99999999"). Digit strings are compared without converting them, so no number of
// digits overflows; one number spelled with more leading zeros orders by its spelling, after.
bool step_before(const std::string& a, const std::string& b) {
  auto digits = [](const std::string& name) {
    const std::size_t first = name.find_first_not_of('0', 5);
    return first == std::string::npos ? std::string_view() : std::string_view(name).substr(first);
  };
  const std::string_view x = digits(a), y = digits(b);
  if (x.size() != y.size()) return x.size() < y.size();
  if (x != y) return x < y;
  return a < b;
}

bool is_complete_step(const fs::path& step_dir) {
  std::error_code ec;
  return fs::is_regular_file(step_dir / "index.json", ec);
}

// std::filesystem's create_directories without its exception: an IOError naming what is in the
// way (a file where a directory of the path should be), else the directory and the system's reason.
void create_directories(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!ec) return;
  for (fs::path p = dir; !p.empty(); p = p.parent_path()) {
    std::error_code probing;
    const fs::file_status status = fs::status(p, probing);
    if (fs::exists(status) && !fs::is_directory(status))
      fail(p.string(), "is not a directory, so " + dir.string() + " cannot be created in it");
    if (p == p.parent_path()) break;
  }
  fail(dir.string(), "cannot create the directory: " + ec.message());
}

constexpr const char* kSaveLockName = ".ruda-save.lock";

// One save at a time into a checkpoint directory: an exclusive flock on its .ruda-save.lock,
// held from preparing the step to publishing it. Two processes saving into one directory at once
// removed each other's temporaries and rank files and overwrote each other's, and published
// indexes whose files the other had replaced, each reporting success. The second is refused (an
// IOError), not queued: a directory taking two runs' saves is a mistake of its own (each run's
// pruning would remove the other's steps). The file stays (unlinking it would let a third process
// lock a new file while a second holds the old one). flock is per machine: on a network file
// system it may not reach other machines' processes.
class SaveLock {
 public:
  explicit SaveLock(const fs::path& dir) {
    nn::create_directories(dir);
    const fs::path file = dir / kSaveLockName;
    // Read-only: flock needs no write access, so another user's lock file in a shared directory
    // locks as well; created 0666 less the umask, as ruda's other files, only where it is missing
    // (opening without O_CREAT first: a sticky directory may refuse O_CREAT on another's file).
    fd_ = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0 && errno == ENOENT) fd_ = ::open(file.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0666);
    if (fd_ < 0) fail(dir.string(), "cannot open its save lock " + file.string() + ": " + std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      ::close(fd_);
      if (error == EWOULDBLOCK) {
        fail(dir.string(), "another save into this checkpoint directory is running (it holds " + file.string() +
                               "): a directory takes one save at a time");
      }
      fail(dir.string(), "cannot lock " + file.string() + ": " + std::strerror(error));
    }
  }
  ~SaveLock() { ::close(fd_); }  // (closing releases the lock)
  SaveLock(const SaveLock&) = delete;
  SaveLock& operator=(const SaveLock&) = delete;

 private:
  int fd_ = -1;
};

// What an entry is, for messages.
std::string kind_of(fs::file_type type) {
  switch (type) {
    case fs::file_type::regular:
      return "regular file";
    case fs::file_type::directory:
      return "directory";
    case fs::file_type::symlink:
      return "symbolic link";
    case fs::file_type::fifo:
      return "FIFO";
    case fs::file_type::socket:
      return "socket";
    default:
      return "special file";
  }
}

// Whether `inner` is `outer` or lies inside it, compared as canonical paths (links resolved as far
// as the paths exist), so that another spelling of the same place is caught too.
bool lies_within(const fs::path& inner, const fs::path& outer) {
  std::error_code ec_inner, ec_outer;
  const fs::path a = fs::weakly_canonical(inner, ec_inner), b = fs::weakly_canonical(outer, ec_outer);
  if (ec_inner || ec_outer) return false;
  auto i = a.begin();
  for (auto o = b.begin(); o != b.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == a.end() || *i != *o) return false;
  }
  return true;
}

// Whether `a` and `b` name one file: an existing one (hard links and symbolic links included), or
// one path that does not exist yet.
bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  return (fs::equivalent(a, b, ec) && !ec) || (lies_within(a, b) && lies_within(b, a));
}

// The newest step directory of `dir` that has an index ("" when none): what a checkpoint
// directory holds when its `latest` pointer is missing or points at nothing (a kill between a
// step's index and its pointer leaves exactly that).
std::string newest_complete_step(const fs::path& dir) {
  std::error_code ec;
  std::string best;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (is_step_name(n) && is_complete_step(it->path()) && (best.empty() || step_before(best, n))) best = n;
  }
  return best;
}

// `latest` is ruda's pointer file or absent; anything else (a directory, a FIFO, a symbolic link
// that loops or points elsewhere) is refused by name rather than followed.
void check_latest_pointer(const fs::path& dir) {
  std::error_code ec;
  const fs::path latest = dir / "latest";
  const fs::file_status status = fs::symlink_status(latest, ec);
  if (ec || status.type() == fs::file_type::not_found || status.type() == fs::file_type::regular) return;
  fail(latest.string(), std::string("is a ") +
                            (status.type() == fs::file_type::directory ? "directory"
                             : status.type() == fs::file_type::symlink ? "symbolic link"
                                                                       : "special file") +
                            ", not ruda's pointer file: remove it");
}

// Cleaning and pruning are upkeep after the new checkpoint is published: an entry they cannot
// inspect or remove (a foreign symbolic link that loops, a directory they may not enter) is
// skipped and named in the save's warnings, and never fails the save. Entries that are not
// ruda's (other names, symbolic links, files where a step directory would be) are left alone.
struct Upkeep {
  std::vector<std::string> skipped;
  void skip(const fs::path& path, const std::error_code& ec) {
    skipped.push_back(path.string() + " (" + ec.message() + ")");
  }
  // The entry's own type, not its target's; nullopt (and a note) when it cannot be read.
  std::optional<fs::file_type> type_of(const fs::directory_entry& entry) {
    std::error_code ec;
    const fs::file_status status = entry.symlink_status(ec);
    if (ec) {
      skip(entry.path(), ec);
      return std::nullopt;
    }
    return status.type();
  }
  // The names of `dir`'s entries that are step directories of ruda's naming (not links).
  std::vector<fs::directory_entry> step_dirs(const fs::path& dir) {
    std::vector<fs::directory_entry> out;
    std::error_code ec;
    fs::directory_iterator it(dir, ec);
    for (const fs::directory_iterator end; !ec && it != end; it.increment(ec)) {
      if (is_step_name(it->path().filename().string()) && type_of(*it) == fs::file_type::directory) out.push_back(*it);
    }
    if (ec) skip(dir, ec);
    return out;
  }
  void remove_all(const fs::path& path) {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) skip(path, ec);
  }
};

// Whether `name` is a temporary file of one of ruda's files in a step directory (a rank file's,
// the index's) or, with `pointer`, of the latest pointer: see safetensors::temporary_base.
bool is_our_temporary(const std::string& name, bool pointer) {
  const auto base = safetensors::temporary_base(name);
  if (!base) return false;
  return pointer ? *base == "latest" : is_rank_file_name(*base) || *base == "index.json";
}

// Removes ruda's temporary files (regular files only: a link planted at such a name is not ruda's)
// in a step directory, or (`pointer`) the latest pointer's only, in the checkpoint directory.
void remove_temporaries(const fs::path& dir, bool pointer, Upkeep& upkeep) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  for (const fs::directory_iterator end; !ec && it != end; it.increment(ec)) {
    if (!is_our_temporary(it->path().filename().string(), pointer) || upkeep.type_of(*it) != fs::file_type::regular)
      continue;
    std::error_code removing;
    fs::remove(it->path(), removing);
    if (removing) upkeep.skip(it->path(), removing);
  }
  if (ec) upkeep.skip(dir, ec);
}

// The first directory from `from` upward that is a checkpoint step of ruda's naming, with its
// index or beside a latest pointer ("" when none): what lies inside it goes when the step is
// pruned. Above a path only such a step counts: no reader looks upward, so a project's own
// index.json higher up (a web root, a data set's manifest) marks nothing.
fs::path enclosing_step(fs::path from) {
  for (fs::path up = std::move(from); !up.empty() && up != up.parent_path(); up = up.parent_path()) {
    std::error_code probing;
    if (!is_step_name(up.filename().string()) || !fs::is_directory(up, probing)) continue;
    if (fs::exists(fs::symlink_status(up / "index.json", probing)) ||
        fs::exists(fs::symlink_status(up.parent_path() / "latest", probing)))
      return up;
  }
  return {};
}

void remove_unlisted_rank_files(const fs::path& step_dir, const std::vector<std::string>& listed, Upkeep* upkeep);

// Whether `step_dir`'s rank files are other than one file per rank of one world: a rank's file
// under both names, or files of two world sizes. A rewrite of a complete step killed after its
// new rank files were written, before its index named them, leaves that; the step, resumed from
// and never saved again, kept them (70 MB beside 70 MB in a probe) until it was pruned, if ever.
bool holds_unlisted_rank_files(const fs::path& step_dir, Upkeep& upkeep) {
  std::set<std::string> ranks, worlds;
  std::size_t files = 0;
  std::error_code ec;
  fs::directory_iterator it(step_dir, ec);
  for (const fs::directory_iterator end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (!is_rank_file_name(name)) continue;
    ++files;
    if (const std::size_t b = name.rfind(".b.safetensors"); b != std::string::npos) name.erase(b, 2);
    ranks.insert(name);
    worlds.insert(name.substr(name.find("-of-")));
  }
  if (ec) upkeep.skip(step_dir, ec);
  return ranks.size() != files || worlds.size() > 1;
}

// Removes what killed saves leave behind: temporary files (ruda's own names only, regular files
// only) and step directories without an index, except `current` (the step just saved), of which
// only the temporaries go: every rank's file of this save is in place, so one there is a killed
// earlier save's of the same step (a run stopped during it, resumed from the step before, saves
// the step again). In a complete step, rank files its index does not name go too (a killed
// rewrite's; the index is read only for a step that holds such files). Run by rank 0 once the
// new checkpoint is published, so that a kill during the cleaning loses nothing.
void remove_leftovers(const fs::path& dir, const std::string& current, Upkeep& upkeep) {
  remove_temporaries(dir, true, upkeep);
  for (const fs::directory_entry& entry : upkeep.step_dirs(dir)) {
    if (entry.path().filename() == current) {
      remove_temporaries(entry.path(), false, upkeep);
      continue;
    }
    if (!is_complete_step(entry.path())) {
      // A kill leaves no index.json at all (it is renamed into place whole). One that is there
      // but no regular file (a directory, a dangling link) is damage to look at, not a leftover:
      // its rank files were deleted with it. Left alone, and named in the warnings.
      std::error_code probing;
      if (fs::exists(fs::symlink_status(entry.path() / "index.json", probing))) {
        upkeep.skipped.push_back(entry.path().string() + " (its index.json is not a regular file)");
        continue;
      }
      upkeep.remove_all(entry.path());
      continue;
    }
    remove_temporaries(entry.path(), false, upkeep);
    if (holds_unlisted_rank_files(entry.path(), upkeep)) {
      try {
        remove_unlisted_rank_files(entry.path(), read_index(entry.path().string()).files, &upkeep);
      } catch (const std::exception& e) {
        upkeep.skipped.push_back(entry.path().string() + " (its index cannot be read: " + e.what() + ")");
      }
    }
  }
}

// Keeps the newest `keep` complete steps (and `current`, whatever its number). A step is removed
// index first: a kill in the middle leaves an incomplete step (cleaned at the next save), never
// one that looks complete with files missing.
void prune(const fs::path& dir, int keep, const std::string& current, Upkeep& upkeep) {
  if (keep <= 0) return;
  std::vector<std::string> steps;
  for (const fs::directory_entry& entry : upkeep.step_dirs(dir)) {
    if (is_complete_step(entry.path())) steps.push_back(entry.path().filename().string());
  }
  std::sort(steps.begin(), steps.end(), step_before);
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < steps.size(); ++i) {
    if (steps[i] == current) continue;
    std::error_code ec;
    fs::remove(dir / steps[i] / "index.json", ec);
    if (ec) {
      upkeep.skip(dir / steps[i] / "index.json", ec);
      continue;  // still complete: removing the rest would leave an index over missing files
    }
    safetensors::sync_directory((dir / steps[i]).string());
    upkeep.remove_all(dir / steps[i]);
  }
}

}  // namespace

std::string resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  // A step directory (its index.json is read and checked later, by name, whatever it is).
  if (fs::exists(fs::symlink_status(fs::path(path) / "index.json", ec))) return path;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) fail(path, "does not exist");
  if (ec) fail(path, "cannot be inspected: " + ec.message());
  if (status.type() != fs::file_type::directory) {
    fail(path, "is a " + kind_of(status.type()) +
                   ", not a checkpoint (a step directory with its index.json, or a directory of steps)");
  }
  // The latest pointer, else the newest complete step directory.
  check_latest_pointer(path);
  const fs::path latest = fs::path(path) / "latest";
  if (fs::exists(fs::symlink_status(latest, ec))) {
    const std::string text = safetensors::read_text_file(latest.string(), kMaxLatestBytes);
    const std::string name = text.substr(0, text.find('\n'));
    // ruda writes one step name and a newline, atomically: anything else is damage, refused by
    // name (it was passed over for the newest step, which may be another run's line of steps).
    // A step name whose step is gone is what a kill between saving and pruning can leave: the
    // newest complete step then, as below.
    if (!is_step_name(name) || name.find('/') != std::string::npos || (text != name && text != name + "\n")) {
      std::string shown = text.substr(0, 64);
      for (char& c : shown) {
        if (static_cast<unsigned char>(c) < 0x20) c = '?';
      }
      fail(latest.string(), "holds '" + shown + (text.size() > 64 ? "...'" : "'") +
                                ", not the name of a step (ruda's pointer is one line, step-N): fix or remove it");
    }
    // A step whose index.json is there, whatever it is: reading it names what is wrong with it.
    if (fs::exists(fs::symlink_status(fs::path(path) / name / "index.json", ec)))
      return (fs::path(path) / name).string();
  }
  const std::string best = newest_complete_step(path);
  if (best.empty()) fail(path, "holds no complete checkpoint");
  return (fs::path(path) / best).string();
}

std::string checkpoint_member(const std::string& path) {
  std::error_code ec;
  const fs::path full = fs::weakly_canonical(fs::path(path), ec);
  const fs::path p = ec ? fs::path(path) : full;
  const fs::path parent = p.parent_path();
  if (!parent.empty() && is_step_name(parent.filename().string()) && fs::is_directory(parent, ec)) {
    return "lies inside the step directory " + parent.string() + " of a checkpoint";
  }
  // Any directory with an index.json loads as a step (a checkpoint copied to best/, or given by
  // path to --resume and ruda-ckpt), whatever its name: its files were overwritten when only
  // step-N names counted.
  if (!parent.empty() && fs::exists(fs::symlink_status(parent / "index.json", ec))) {
    return "lies inside " + parent.string() + ", a checkpoint step (it holds an index.json)";
  }
  // Deeper inside a step (step-4/export/model.safetensors): pruning step 4 removed it with the step.
  if (const fs::path step = enclosing_step(parent.parent_path()); !step.empty())
    return "lies inside the step directory " + step.string() + " of a checkpoint";
  // The save lock (SaveLock): ruda-train's --metrics took it, and a resumed run rewrites its metrics
  // beside the file and renames them over it, after which two saves would lock different files.
  if (p.filename() == kSaveLockName) return "is the save lock of the checkpoint directory " + parent.string();
  // The latest pointer, or a file named like a step, of a directory that holds steps: the next
  // save of that step found a file where its directory goes and failed, after the training.
  const bool pointer = p.filename() == "latest", step_named = is_step_name(p.filename().string());
  if ((pointer || step_named) && !parent.empty()) {
    for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code probing;
      if (!is_step_name(it->path().filename().string()) || !it->is_directory(probing)) continue;
      return pointer ? "is the latest pointer of the checkpoint directory " + parent.string()
                     : "is named like a step of the checkpoint directory " + parent.string() +
                           " (a save of that step would find this file where its directory goes)";
    }
  }
  return {};
}

// Where a checkpoint directory `dir` is a checkpoint step itself or lies inside one (at any depth),
// what the error says; "" otherwise. Readers take a directory holding an index.json for a step, so
// a checkpoint saved there was hidden (--resume-latest resumed the outer step), and a step's own
// directory prunes it (pruning, or the leftovers of a step without an index). Above `dir`, a step
// as enclosing_step finds it.
std::string checkpoint_dir_conflict(const std::string& dir) {
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(fs::path(dir), ec);
  const fs::path p = ec ? fs::path(dir) : canonical;
  if (fs::exists(fs::symlink_status(p / "index.json", ec))) {
    return "holds an index.json, so readers take it for a checkpoint step: save into another directory (a "
           "checkpoint's steps go in the directory that holds them)";
  }
  if (const fs::path step = enclosing_step(p.parent_path()); !step.empty())
    return "lies inside the step directory " + step.string() + " of a checkpoint";
  return {};
}

bool holds_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  check_latest_pointer(dir);
  return !newest_complete_step(dir).empty();
}

namespace {

// Runs a phase of a save on every rank and agrees on its outcome: if any rank failed, every rank
// raises an IOError about `step_dir` that names each failing rank and its own error.
void run_agreed_or_fail(Communicator& comm, const std::string& step_dir, const char* phase,
                        const std::function<void()>& fn) {
  const auto failures = run_agreed(comm, std::string("checkpoint ") + phase, fn);
  if (!failures.empty()) fail(step_dir, std::string(phase) + " failed on " + describe(failures));
}

// The element range of a parameter this rank holds in a checkpoint: its slice without padding,
// or the whole tensor on rank 0 for a dense parameter.
struct Piece {
  std::int64_t offset = 0, count = 0;
};
Piece piece_of(const Param& p, int rank) {
  if (p.is_sharded()) return {p.shard()->offset(), p.shard()->real_elements()};
  return rank == 0 ? Piece{0, p.data().numel()} : Piece{0, 0};
}

// What a parameter is in the index, apart from where its pieces lie.
struct ParamHeader {
  std::string name;
  std::uint64_t id = 0;
  Shape shape;
  DType dtype = DType::f32;
  bool sharded = false;
  std::vector<std::pair<std::string, DType>> state;  // the optimizer's state tensors: names and dtypes
  std::optional<std::int64_t> steps;  // the parameter's own step count, where it differs from the optimizer's
  bool optimized = true;              // whether the optimizer updates it (only then has it state)
  bool stateful = true;               // whether its optimizer state is saved (saves_state)
};

// Whether a checkpoint holds `p`'s optimizer state: where the optimizer updates it and has made
// its state, or it has taken steps (an optimizer that says it has none yet though). A parameter
// that has taken no step (a frozen backbone given to the optimizer with its head) gets none made
// and none written: a resume starts it afresh, with zero state and a count of 0, as it would be.
bool saves_state(const Optimizer* optimizer, const Param& p) {
  return optimizer && optimizer->updates(p) && (optimizer->has_state(p) || optimizer->steps_of(p) > 0);
}

// What the index records as the optimizer's kind: the optimizers of nn by name (an Adam with
// decoupled weight decay is AdamW), any other by its C++ type. A load into another kind is refused.
std::string optimizer_kind(const Optimizer& optimizer) {
  if (const auto* adam = dynamic_cast<const Adam*>(&optimizer))
    return adam->options().decoupled_weight_decay ? "AdamW" : "Adam";
  if (dynamic_cast<const SGD*>(&optimizer)) return "SGD";
  int status = 0;
  char* demangled = abi::__cxa_demangle(typeid(optimizer).name(), nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : typeid(optimizer).name();
  std::free(demangled);
  return name;
}

// The optimizer's settings besides its rate (which a load restores): a resume must continue with
// the same, as with its groups, so they are recorded and compared (a weight decay the "decay"
// group takes from the optimizer was not, though one a group set itself was).
std::map<std::string, double> optimizer_settings(const Optimizer& optimizer) {
  if (const auto* adam = dynamic_cast<const Adam*>(&optimizer)) {
    const AdamOptions& o = adam->options();
    return {{"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps}, {"weight_decay", o.weight_decay}};
  }
  if (const auto* sgd = dynamic_cast<const SGD*>(&optimizer)) {
    const SGDOptions& o = sgd->options();
    return {{"momentum", o.momentum},
            {"dampening", o.dampening},
            {"nesterov", o.nesterov ? 1.0 : 0.0},
            {"weight_decay", o.weight_decay}};
  }
  return {};
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
  return out.empty() ? "none" : out;
}

// The optimizer's groups as a checkpoint records them: settings and parameter names.
std::vector<ckpt::IndexGroup> groups_of(const Optimizer& optimizer,
                                        const std::vector<std::pair<std::string, Param>>& named) {
  std::map<ParamId, std::string> name_of;
  for (const auto& [name, p] : named) name_of.emplace(p.id(), name);
  std::vector<ckpt::IndexGroup> out;
  for (const ParamGroup& g : optimizer.groups()) {
    ckpt::IndexGroup saved{g.name, g.lr_scale, g.weight_decay, {}};
    for (const Param& p : g.params) {
      const auto it = name_of.find(p.id());
      saved.params.push_back(it != name_of.end() ? it->second
                                                 : "<not in the module: id " + std::to_string(p.id()) + ">");
    }
    out.push_back(std::move(saved));
  }
  return out;
}

std::string describe(const std::vector<ckpt::IndexGroup>& groups) {
  std::string out;
  for (const auto& g : groups) {
    std::ostringstream part;
    part << g.name << " (" << g.params.size() << (g.params.size() == 1 ? " parameter" : " parameters");
    // Their names, the first few: two groups of as many parameters otherwise read alike.
    for (std::size_t i = 0; i < g.params.size() && i < 3; ++i) part << (i ? ", '" : ": '") << g.params[i] << "'";
    if (g.params.size() > 3) part << " and " << g.params.size() - 3 << " more";
    part << "; lr x" << g.lr_scale << ", weight decay ";
    if (g.weight_decay) {
      part << *g.weight_decay;
    } else {
      part << "the optimizer's";
    }
    part << ")";
    out += (out.empty() ? "" : ", ") + part.str();
  }
  return out;
}

// The module's dropout streams by module path: {"seed", "offset"} each ({} without dropout).
json dropout_streams(const Module& module) {
  json streams = json::object();
  for (const auto& [path, m] : module.named_modules()) {
    if (const auto* dropout = dynamic_cast<const Dropout*>(m)) {
      streams[path] = {{"seed", dropout->generator().seed()}, {"offset", dropout->generator().offset()}};
    }
  }
  return streams;
}

// Puts the streams the index recorded back into the module's Dropouts of the same paths (a
// checkpoint without them, older or of a model without dropout, leaves them as they are).
void restore_dropout_streams(const Index& index, Module& module) {
  for (const auto& [path, m] : module.named_modules()) {
    auto* dropout = dynamic_cast<Dropout*>(m);
    const auto found = index.streams.find(path);
    if (dropout && found != index.streams.end()) {
      dropout->generator() = Generator(found->second.first, found->second.second);
    }
  }
}

// The index of a checkpoint from each rank's report of the pieces it wrote
// ({"pieces": {name: {"offset", "count", "xxh3": {tensor: hashes}}}}): no piece is derived twice.
json build_index(std::int64_t step, int world, const std::vector<ParamHeader>& params, const Optimizer* optimizer,
                 const std::vector<ckpt::IndexGroup>& optimizer_groups, const std::map<std::string, std::string>& extra,
                 const std::vector<json>& reports, const json& streams = json::object()) {
  json index = {{"format", kFormat}, {"version", kVersion}, {"step", step}, {"world_size", world}};
  json files = json::array();  // each rank's file by the name it wrote (see new_rank_file)
  for (int r = 0; r < world; ++r) files.push_back(reports[static_cast<std::size_t>(r)].at("file"));
  index["files"] = files;
  json jparams = json::object();
  for (const ParamHeader& p : params) {
    json pieces = json::array();
    for (int r = 0; r < world; ++r) {
      const json& mine = reports[static_cast<std::size_t>(r)].at("pieces");
      if (!mine.contains(p.name)) continue;
      json piece = mine.at(p.name);
      // Each rank decides from its own optimizer what it writes; the index says what rank 0
      // decided, so a rank that wrote other tensors (its state made where rank 0's was not) would
      // leave an index that names tensors its file lacks, or the reverse.
      const std::size_t tensors = 1 + (p.optimized && p.stateful ? p.state.size() : 0);
      if (piece.at("xxh3").size() != tensors) {
        fail(reports[static_cast<std::size_t>(r)].at("file").get<std::string>(),
             "holds " + std::to_string(piece.at("xxh3").size()) + " tensors of parameter '" + p.name +
                 "' where rank 0's index records " + std::to_string(tensors) +
                 ": the ranks' optimizers disagree on whether it has state");
      }
      piece["rank"] = r;
      pieces.push_back(std::move(piece));
    }
    jparams[p.name] = {
        {"id", p.id},           {"shape", p.shape}, {"dtype", dtype_name(p.dtype)}, {"numel", shape_numel(p.shape)},
        {"sharded", p.sharded}, {"pieces", pieces}};
    if (optimizer && !p.optimized) {
      jparams[p.name]["optimized"] = false;
    } else if (optimizer) {
      // (Version 5 on, a parameter without "state_dtypes" has no state in the files.)
      if (p.stateful) {
        json dtypes = json::object();
        for (const auto& [state, dtype] : p.state) dtypes[state] = dtype_name(dtype);
        jparams[p.name]["state_dtypes"] = dtypes;
      }
      if (p.steps) jparams[p.name]["steps"] = *p.steps;
    }
  }
  index["params"] = jparams;
  if (optimizer) {
    json groups = json::array();
    for (const auto& g : optimizer_groups) {
      groups.push_back({{"name", g.name},
                        {"lr_scale", g.lr_scale},
                        {"weight_decay", g.weight_decay ? json(*g.weight_decay) : json(nullptr)},
                        {"params", g.params}});
    }
    std::vector<std::string> state_names;
    const auto first =
        std::find_if(params.begin(), params.end(), [](const ParamHeader& p) { return p.optimized && p.stateful; });
    if (first != params.end()) {
      for (const auto& [state, dtype] : first->state) state_names.push_back(state);
    }
    index["optimizer"] = {{"kind", optimizer_kind(*optimizer)},
                          {"steps", optimizer->steps()},
                          {"lr", optimizer->lr()},
                          {"state", state_names},
                          {"groups", groups}};
    const auto settings = optimizer_settings(*optimizer);
    if (!settings.empty()) index["optimizer"]["settings"] = settings;
  }
  if (!streams.empty()) index["streams"] = streams;
  index["extra"] = extra;
  return index;
}

// Writes this rank's file (its piece of every parameter and of its optimizer state) and returns
// its report for the index: where each piece lies and the hashes of its blocks.
json write_rank_file(const std::string& path, std::int64_t step, int rank, int world,
                     const std::vector<std::pair<std::string, Param>>& params, Optimizer* optimizer) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::int64_t> offsets;
  json pieces = json::object();
  for (const auto& [name, p] : params) {
    const Piece piece = piece_of(p, rank);
    std::vector<std::pair<std::string, Tensor>> mine = {{model_tensor(name), p.data()}};
    if (saves_state(optimizer, p)) {
      for (const auto& [state, t] : optimizer->state(p)) mine.emplace_back(optim_tensor(name, state), t);
    }
    json hashes = json::object();
    for (auto& [tensor, t] : mine) {
      t = t.reshape({-1}).slice(0, 0, piece.count);
      std::string h;
      append_block_hashes(h, t.data_ptr(), t.nbytes());
      hashes[tensor] = h;
      tensors.emplace_back(tensor, t);
      if (piece.count > 0) offsets[tensor] = piece.offset;
    }
    if (piece.count > 0) pieces[name] = {{"offset", piece.offset}, {"count", piece.count}, {"xxh3", hashes}};
  }
  safetensors::write(path, tensors, rank_file_metadata(rank, world, step, offsets));
  return {{"file", fs::path(path).filename().string()}, {"pieces", pieces}};
}

// Every rank's report of its rank file, on every rank; if any rank failed to write its file (its
// `error` is not empty), every rank raises an IOError about `step_dir` naming the failing ranks.
// One exchange carries both, so a successful save costs no separate agreement.
std::vector<json> agree_on_reports(Communicator& comm, const std::string& step_dir, const json& report,
                                   const std::string& error) {
  const std::vector<std::string> texts =
      all_gather_text(comm, error.empty() ? report.dump() : json{{"error", error}}.dump(), "checkpoint files");
  std::vector<RankFailure> failures;
  std::vector<json> reports;
  for (std::size_t r = 0; r < texts.size(); ++r) {
    reports.push_back(json::parse(texts[r]));
    if (reports.back().contains("error")) failures.push_back({static_cast<int>(r), reports.back()["error"]});
  }
  if (!failures.empty()) fail(step_dir, "writing the rank files failed on " + describe(failures));
  return reports;
}

// A step directory whose index cannot be read is no checkpoint: it stops looking like one before
// it is rewritten (its index goes).
void unpublish(const std::string& step_dir) {
  std::error_code ec;
  const fs::path index = fs::path(step_dir) / "index.json";
  if (fs::remove(index, ec)) safetensors::sync_directory(step_dir);
  if (ec) fail(index.string(), "cannot be removed before the step is rewritten: " + ec.message());
}

// Removes the rank files of `step_dir` (regular files of either name form) that `listed` does not
// name: what a rewrite replaced, or what a killed or failed one left. With `upkeep`, a file that
// cannot be removed is noted there; without, it is an error (the rewrite needs it gone).
void remove_unlisted_rank_files(const fs::path& step_dir, const std::vector<std::string>& listed, Upkeep* upkeep) {
  std::error_code ec;
  fs::directory_iterator it(step_dir, ec);
  for (const fs::directory_iterator end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!is_rank_file_name(name) || std::find(listed.begin(), listed.end(), name) != listed.end()) continue;
    std::error_code probing, removing;
    if (it->symlink_status(probing).type() != fs::file_type::regular || probing) continue;
    fs::remove(it->path(), removing);
    if (!removing) continue;
    if (!upkeep) fail(it->path().string(), "cannot be removed before the step is rewritten: " + removing.message());
    upkeep->skip(it->path(), removing);
  }
  if (ec && !upkeep) fail(step_dir.string(), "cannot be listed before the step is rewritten: " + ec.message());
  if (ec) upkeep->skip(step_dir, ec);
}

// Whether `step_dir` has an index that names rank file `name` (false where it has none, or one
// that cannot be read).
bool index_names(const std::string& step_dir, const std::string& name) {
  try {
    const auto listed = read_index(step_dir).files;
    return std::find(listed.begin(), listed.end(), name) != listed.end();
  } catch (const std::exception&) {
    return false;
  }
}

// Makes `step_dir` ready for a save or a split (one process: rank 0). A step saved again (a run
// resumed from an earlier step reaches it again) keeps its files and its index until the new index
// replaces it: the new rank files are written beside the ones the index names (new_rank_file),
// and renaming the new index over the old one swaps them in at once, so that a save that fails
// or is killed at any point leaves the old step whole. For that, no file the index names may be
// taken for a new one: a rank file it does not name (left by a killed rewrite) goes now. An index
// that cannot be read goes too: the step is no checkpoint to keep.
void prepare_step(const std::string& step_dir) {
  create_directories(step_dir);
  std::error_code ec;
  if (fs::symlink_status(fs::path(step_dir) / "index.json", ec).type() == fs::file_type::not_found) return;
  std::vector<std::string> listed;
  try {
    listed = read_index(step_dir).files;
  } catch (const std::exception&) {
    unpublish(step_dir);
    return;
  }
  remove_unlisted_rank_files(step_dir, listed, nullptr);
}

// The name rank `rank` writes its new file under: the plain name, unless a regular file has it
// (the file the step's index names, when the step is saved again), then the alternate one. After
// prepare_step, at most one of the two names is a file the index names, so a new file never
// replaces one. Each rank decides for its own names, which only it writes.
std::string new_rank_file(const std::string& step_dir, int rank, int world) {
  const std::string plain = rank_file(rank, world);
  std::error_code ec;
  const bool taken = fs::symlink_status(fs::path(step_dir) / plain, ec).type() == fs::file_type::regular;
  return taken ? rank_file(rank, world, /*alternate=*/true) : plain;
}

// What a save or a split would otherwise find wrong only when it publishes the index, after every
// rank file is written: refused before anything is written, naming the checkpoint directory.
void check_save_arguments(const std::string& dir, std::int64_t step, int world,
                          const std::map<std::string, std::string>& extra, int keep) {
  if (dir.empty()) fail("''", "is no checkpoint directory (the name is empty; '.' is the working directory)");
  if (dir.find('\0') != std::string::npos) {
    fail(dir, "contains a NUL character, where the system would cut the path short");
  }
  if (const std::string nested = checkpoint_dir_conflict(dir); !nested.empty()) fail(dir, nested);
  if (step < 0 || step > kMaxStep) {
    fail(dir, "the step must be between 0 and 2^53 (" + std::to_string(kMaxStep) + "), got " + std::to_string(step));
  }
  if (world < 1 || world > kMaxWorldSize) {
    fail(dir,
         "the world size must be between 1 and " + std::to_string(kMaxWorldSize) + ", got " + std::to_string(world));
  }
  if (keep < 0) fail(dir, "keep must be at least 0 (0 keeps every step), got " + std::to_string(keep));
  for (const auto& [key, value] : extra) {
    // The index is JSON: its strings must be UTF-8.
    try {
      (void)json(key).dump();
    } catch (const json::exception&) {
      fail(dir, "an extra state key is not UTF-8 text, which the index cannot hold");
    }
    try {
      (void)json(value).dump();
    } catch (const json::exception&) {
      fail(dir, "extra state '" + key + "' is not UTF-8 text, which the index cannot hold");
    }
  }
}

// Rank 0, once every rank file is complete: the index (validated as any reader will validate
// it, so a layout no reader accepts is never published), then the latest pointer, then the
// cleaning of what earlier kills left and of old steps.
std::vector<std::string> publish(const fs::path& dir, const std::string& step_dir, std::int64_t step,
                                 const json& unchecked_index, int keep, bool* index_written = nullptr) {
  const std::string index_path = (fs::path(step_dir) / "index.json").string();
  const json index = with_index_checksum(unchecked_index);
  const Index parsed = parse_index(index, index_path, step_dir);
  // Every rank reported its file written; rank 0 must see each one where the index will name it.
  // Ranks saving into directories of one path that are not one directory (a node-local disk on
  // each machine) published a step that held rank 0's file alone, with latest naming it.
  for (std::size_t r = 0; r < parsed.files.size(); ++r) {
    std::error_code ec;
    if (!fs::is_regular_file(fs::path(step_dir) / parsed.files[r], ec)) {
      fail(step_dir, "rank " + std::to_string(r) + " wrote " + parsed.files[r] +
                         " but rank 0 does not see it there: every rank must save into one directory that all "
                         "ranks share (one file system), since rank 0 writes the index of every rank's files");
    }
  }
  safetensors::write_text_atomically(index_path, index.dump(1));  // the swap: the new files are the step's
  if (index_written) *index_written = true;
  safetensors::write_text_atomically((dir / "latest").string(), step_name(step) + "\n");
  Upkeep upkeep;
  remove_unlisted_rank_files(step_dir, parsed.files, &upkeep);  // the files the new ones replaced
  remove_leftovers(dir, step_name(step), upkeep);
  prune(dir, keep, step_name(step), upkeep);
  return upkeep.skipped;
}

}  // namespace

namespace {
// "rank 2" or "ranks 1, 3".
std::string rank_list(const std::vector<int>& list) {
  std::string out = list.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < list.size(); ++i) out += (i ? ", " : "") + std::to_string(list[i]);
  return out;
}

// The model a save writes or a load fills, as the ranks must agree on it: the parameters' names,
// shapes, dtypes and sharding, and the optimizer or none: its kind, settings and groups, and its
// rate where `with_rate` (a save records rank 0's; a load sets the checkpoint's). Ranks saving with
// another optimizer had their state recorded as rank 0's kind, groups and rate.
std::uint64_t model_fingerprint(const std::vector<std::pair<std::string, Param>>& params, const Optimizer* optimizer,
                                bool with_rate) {
  std::ostringstream settings;
  settings.precision(17);
  if (!optimizer) {
    settings << "no optimizer";
  } else {
    // A parameter the module does not hold is named by its id, which differs between emulated
    // ranks: one placeholder, so that save's own check names it instead of "different models".
    auto groups = groups_of(*optimizer, params);
    for (auto& g : groups) {
      for (auto& name : g.params) {
        if (name.rfind("<not in the module", 0) == 0) name = "<not in the module>";
      }
    }
    settings << optimizer_kind(*optimizer) << ' ' << describe(groups);
    if (with_rate) settings << " lr " << optimizer->lr();
    if (const auto* adam = dynamic_cast<const Adam*>(optimizer)) {
      const AdamOptions& o = adam->options();
      settings << " betas " << o.beta1 << ' ' << o.beta2 << " eps " << o.eps << " decay " << o.weight_decay;
    } else if (const auto* sgd = dynamic_cast<const SGD*>(optimizer)) {
      const SGDOptions& o = sgd->options();
      settings << " momentum " << o.momentum << " dampening " << o.dampening << " nesterov " << o.nesterov << " decay "
               << o.weight_decay;
    }
  }
  std::string what = settings.str();
  for (const auto& [name, p] : params) {
    what += '\0' + name + ' ' + to_string(p.shape()) + ' ' + std::string(dtype_name(p.data().dtype())) +
            (p.is_sharded() ? " sharded" : " dense");
  }
  return fingerprint(what);
}

// "no optimizer", or "AdamW, lr 0.001": what an error about the ranks' optimizers names.
std::string optimizer_text(const Optimizer* optimizer) {
  if (!optimizer) return "no optimizer";
  std::ostringstream out;
  out << optimizer_kind(*optimizer) << ", lr " << optimizer->lr() << ", " << optimizer->groups().size()
      << (optimizer->groups().size() == 1 ? " group" : " groups");
  return out.str();
}

// Every rank's `values` (the same count on each), rank after rank: one all_gather.
std::vector<std::int64_t> every_rank(Communicator& comm, const std::vector<std::uint64_t>& values, const char* tag) {
  std::vector<std::int64_t> mine;
  for (const std::uint64_t v : values) mine.push_back(static_cast<std::int64_t>(v));
  const auto n = static_cast<std::int64_t>(mine.size());
  return comm.all_gather(from_vector<std::int64_t>(mine, {n}), {.tag = tag}).to_vector<std::int64_t>();
}

// Every parameter the optimizer updates is one of the module's: the state of another would be in
// no checkpoint (saving refused it only when publishing, after every rank file was written).
void check_optimizer_in_module(const std::string& dir, const Optimizer& optimizer,
                               const std::vector<std::pair<std::string, Param>>& params) {
  std::set<ParamId> held;
  for (const auto& [name, p] : params) held.insert(p.id());
  for (const Param& p : optimizer.params()) {
    if (!held.count(p.id())) {
      ckpt::fail(dir, "the optimizer updates a parameter " + to_string(p.shape()) + " (id " + std::to_string(p.id()) +
                          ") that the module does not hold: its state would be in no checkpoint");
    }
  }
}

// The ranks save one checkpoint: the same directory and step, the same parameters (names, shapes,
// dtypes, sharding) and optimizer or none. Ranks that disagreed each wrote their own files and
// the published index named a rank file that no rank had written (or rank 0's model alone, the
// others' dropped). Every rank learns every rank's fingerprints (one all_gather of two numbers)
// and all raise the same error, naming the ranks that differ from rank 0.
void agree_on_checkpoint(Communicator& comm, const std::string& dir, std::int64_t step,
                         const std::vector<std::pair<std::string, Param>>& params, const Optimizer* optimizer) {
  if (comm.world_size() == 1) return;
  const std::vector<std::int64_t> all =
      every_rank(comm, {fingerprint(dir + '\0' + std::to_string(step)), model_fingerprint(params, optimizer, true)},
                 "checkpoint: the ranks' directory, step and parameters");
  std::vector<int> other_place, other_model;
  for (int r = 1; r < comm.world_size(); ++r) {
    const auto i = static_cast<std::size_t>(2 * r);
    if (all[i] != all[0]) other_place.push_back(r);
    if (all[i + 1] != all[1]) other_model.push_back(r);
  }
  const std::string mine_text = "this rank, " + std::to_string(comm.rank()) + ": '" + dir + "' step " +
                                std::to_string(step) + ", " + std::to_string(params.size()) + " parameters";
  if (!other_place.empty()) {
    ckpt::fail(dir, "the ranks save to different places: " + rank_list(other_place) +
                        " gave a directory or step other than rank 0's (" + mine_text +
                        "); every rank must save the same checkpoint");
  }
  if (!other_model.empty()) {
    ckpt::fail(dir, "the ranks save different models: " + rank_list(other_model) +
                        " hold other parameters (names, shapes, dtypes or sharding) or another optimizer (kind, "
                        "settings, groups or rate) than rank 0 (" +
                        mine_text + ", " + optimizer_text(optimizer) + ")");
  }
}

// The ranks load one checkpoint into one model: the same index.json (by its text: each rank may
// find the checkpoint under its own path) and the same parameters and optimizer or none. Ranks
// that read different checkpoints (two steps, `latest` read before and after a save moved it)
// each loaded their own slices, mixing two checkpoints into one model without a word.
void agree_on_loading(Communicator& comm, const Index& index, const std::vector<std::pair<std::string, Param>>& params,
                      const Optimizer* optimizer) {
  if (comm.world_size() == 1) return;
  const std::vector<std::int64_t> all = every_rank(
      comm,
      {index.text_fingerprint, static_cast<std::uint64_t>(index.step), model_fingerprint(params, optimizer, false)},
      "checkpoint load: the ranks' index and parameters");
  std::vector<int> other_index, other_model;
  std::string steps;
  for (int r = 1; r < comm.world_size(); ++r) {
    const auto i = static_cast<std::size_t>(3 * r);
    if (all[i] != all[0]) {
      other_index.push_back(r);
      steps += "; rank " + std::to_string(r) + " read step " + std::to_string(all[i + 1]);
    }
    if (all[i + 2] != all[2]) other_model.push_back(r);
  }
  const std::string mine_text = "this rank, " + std::to_string(comm.rank()) + ", read " + index.path + " of step " +
                                std::to_string(index.step) + "; rank 0 read step " + std::to_string(all[1]);
  if (!other_index.empty()) {
    ckpt::fail(index.dir, "the ranks load different checkpoints: " + rank_list(other_index) +
                              " read another index.json than rank 0 (" + mine_text + steps +
                              "); every rank must load the same checkpoint");
  }
  if (!other_model.empty()) {
    ckpt::fail(index.dir, "the ranks load into different models: " + rank_list(other_model) +
                              " hold other parameters (names, shapes, dtypes or sharding) or another optimizer "
                              "(kind, settings or groups) than rank 0 (this rank, " +
                              std::to_string(comm.rank()) + ": " + std::to_string(params.size()) + " parameters, " +
                              optimizer_text(optimizer) + ")");
  }
}

// The communicator a hybrid model's parameters are replicated over (null for a full or dense
// one), once every sharded parameter is found sharded over `comm` itself. Checked here, on each
// rank before any collective: a save over another communicator (the world of a hybrid model, whose
// parameters are sharded per node) wrote files whose pieces overlapped and failed only at
// publishing, after every file was written.
Communicator* replicate_of(const std::vector<std::pair<std::string, Param>>& params, const Communicator& comm) {
  Communicator* replicate = nullptr;
  for (const auto& [name, p] : params) {
    if (!p.is_sharded()) continue;
    const ShardInfo& info = *p.shard();
    const bool same = info.comm ? info.comm == &comm : info.world_size == comm.world_size() && info.rank == comm.rank();
    if (!same) {
      ruda::fail<ShardingError>("save_checkpoint", "rank ", comm.rank(), " of ", comm.world_size(), ": parameter '",
                                name, "' is sharded over another communicator (rank ", info.rank, " of ",
                                info.world_size,
                                "); save over the communicator fully_shard was given (hybrid: ShardMesh::shard(), on "
                                "every rank)");
    }
    if (info.replicate) replicate = info.replicate;
  }
  return replicate;
}

CheckpointInfo save_shards(const std::string& dir, std::int64_t step, const Module& module, Optimizer* optimizer,
                           Communicator& comm, const std::map<std::string, std::string>& extra, int keep) {
  const int rank = comm.rank(), world = comm.world_size();
  const std::string step_dir = (fs::path(dir) / step_name(step)).string();
  const auto params = module.named_parameters();
  agree_on_checkpoint(comm, dir, step, params, optimizer);

  // 1. Every rank checks the arguments (what would fail only at publishing, after every file is
  // written), and rank 0 prepares the step directory; no rank writes until both are done. A step
  // directory written before (a run resumed from an earlier step reaches it again) keeps its
  // files and index until step 4 replaces the index (prepare_step).
  std::optional<SaveLock> lock;  // rank 0's, until the save returns or throws
  run_agreed_or_fail(comm, dir.empty() ? "''" : dir, "preparing the directory", [&] {
    check_save_arguments(dir, step, world, extra, keep);
    if (optimizer) check_optimizer_in_module(dir, *optimizer, params);
    if (rank != 0) return;
    lock.emplace(dir);
    check_latest_pointer(dir);  // a pointer that cannot be replaced would fail only after every file is written
    prepare_step(step_dir);
  });

  // 2. Every rank writes its file, beside any the step's index names, and reports its name, where
  // its pieces lie and their checksums; 3. every rank learns every rank's report, or the failing
  // ranks' own errors (then each removes the file it wrote: no index names it).
  json report;
  std::string error;
  const std::string file = (fs::path(step_dir) / new_rank_file(step_dir, rank, world)).string();
  bool written = false;
  try {
    create_directories(step_dir);
    report = write_rank_file(file, step, rank, world, params, optimizer);
    written = true;
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::vector<json> reports;
  try {
    reports = agree_on_reports(comm, step_dir, report, error);
  } catch (...) {
    std::error_code ec;
    if (written) fs::remove(file, ec);
    throw;
  }

  // 4. Rank 0 publishes.
  std::vector<std::string> skipped;
  bool index_written = false;  // rank 0's
  const auto failures = run_agreed(comm, "checkpoint publishing the index", [&] {
    if (rank != 0) return;
    std::vector<ParamHeader> headers;
    for (const auto& [name, p] : params) {
      // The parameter's number in the module, not its process-wide id: that depends on what the
      // process made before (emulated ranks build their models at once: the same run wrote a
      // different index each time), and two runs of one program must write the same bytes.
      const auto number = static_cast<std::uint64_t>(headers.size() + 1);
      headers.push_back({name, number, p.shape(), p.data().dtype(), p.is_sharded(), {}, {}});
      // A module's parameter the optimizer does not update (frozen) has no state and no count.
      if (optimizer && !optimizer->updates(p)) headers.back().optimized = false;
      if (optimizer && optimizer->updates(p)) {
        headers.back().stateful = saves_state(optimizer, p);
        if (headers.back().stateful) {
          for (const auto& [state, t] : optimizer->state(p)) headers.back().state.emplace_back(state, t.dtype());
        }
        // (The optimizer counts each parameter's steps: one that had no gradient in some is resumed so.)
        if (const std::int64_t own = optimizer->steps_of(p); own != optimizer->steps()) headers.back().steps = own;
      }
    }
    const auto groups = optimizer ? groups_of(*optimizer, params) : std::vector<ckpt::IndexGroup>{};
    skipped = publish(dir, step_dir, step,
                      build_index(step, world, headers, optimizer, groups, extra, reports, dropout_streams(module)),
                      keep, &index_written);
  });
  if (!failures.empty()) {
    // Every rank is past the phase (it failed on some, agreed on all). Where it failed before the
    // index named the new files (a full disk refusing index.json), no reader will ever take them:
    // each rank removes its own, which upkeep would otherwise remove only at the next save,
    // keeping a checkpoint's worth of space on the disk that just ran out of it. Where the index
    // was written (the latest pointer failed after it), the files are the step's and stay. Rank
    // 0 says which (another rank's view of the directory may lag: a network file system).
    // (Only rank 0 publishes: the largest flag is its own.)
    if (agree_on_max(comm, {index_written ? 1.0 : 0.0}, "checkpoint: whether the index was written")[0] == 0) {
      std::error_code ec;
      fs::remove(file, ec);
    }
    fail(step_dir, "publishing the index failed on " + describe(failures));
  }
  CheckpointInfo info{step_dir, step, world, extra};
  if (!skipped.empty()) {
    std::string warning = "checkpoint upkeep in " + dir + " skipped what it could not inspect or remove: ";
    for (std::size_t i = 0; i < skipped.size(); ++i) warning += (i ? ", " : "") + skipped[i];
    info.warnings.push_back(std::move(warning));
  }
  return info;
}
}  // namespace

CheckpointInfo save_checkpoint(const std::string& dir, std::int64_t step, const Module& module, Optimizer* optimizer,
                               Communicator& comm, const std::map<std::string, std::string>& extra, int keep) {
  autograd::NoGradGuard guard;
  Communicator* const replicate = replicate_of(module.named_parameters(), comm);
  if (!replicate) return save_shards(dir, step, module, optimizer, comm, extra, keep);
  // Hybrid: every replica holds the same shards (and optimizer state). The first (replicate rank 0)
  // writes them over its shard communicator; the others write nothing (each replica saving over
  // its own raced on one step directory, and could publish an index of files another replica
  // had replaced) and wait for its outcome, so that a failed save fails on every rank alike.
  CheckpointInfo info{(fs::path(dir) / step_name(step)).string(), step, comm.world_size(), extra};
  std::exception_ptr mine;
  std::string error;
  if (replicate->rank() == 0) {
    try {
      info = save_shards(dir, step, module, optimizer, comm, extra, keep);
    } catch (const std::exception& e) {
      mine = std::current_exception();
      error = e.what();
    }
  }
  const auto failures = agree_on_failure(*replicate, error, "checkpoint of the first replica");
  if (mine) std::rethrow_exception(mine);
  if (!failures.empty()) ckpt::fail(dir, "the first replica's save failed: " + describe(failures));
  return info;
}

namespace {
CheckpointInfo load_from(const Index& index, Module& module, Optimizer* optimizer, bool verify) {
  CheckpointInfo info{index.dir, index.step, index.world_size, index.extra};
  const auto params = module.named_parameters();
  std::map<std::string, const IndexParam*> by_name;
  for (const auto& p : index.params) by_name[p.name] = &p;
  if (index.params.size() != params.size()) {
    // Named, as a renamed parameter is: the first the model has and the checkpoint lacks, or the
    // first the checkpoint holds and the model does not.
    std::string which;
    for (const auto& [name, p] : params) {
      if (!by_name.count(name)) {
        which = "; it has no parameter '" + name + "'";
        break;
      }
    }
    if (which.empty()) {
      std::set<std::string> names;
      for (const auto& [name, p] : params) names.insert(name);
      for (const auto& p : index.params) {
        if (!names.count(p.name)) {
          which = "; the model has no parameter '" + p.name + "'";
          break;
        }
      }
    }
    fail(index.dir, "holds " + std::to_string(index.params.size()) + " parameters, the model has " +
                        std::to_string(params.size()) + which);
  }
  if (optimizer) check_optimizer_in_module(index.dir, *optimizer, params);
  // The state a parameter takes from the checkpoint: where this optimizer updates it and the
  // saving one had state for it. One this optimizer updates that has none in the checkpoint (not
  // updated then, or no step taken) starts afresh, with no state (zeros, where this optimizer has
  // some) and a step count of 0; one it does not update takes none.
  auto loads_state = [&](const std::string& name, const Param& p) {
    const auto found = by_name.find(name);
    return optimizer && index.has_optimizer && optimizer->updates(p) && found != by_name.end() &&
           found->second->has_state();
  };
  if (optimizer && index.has_optimizer) {
    // The state must be this optimizer's: of its kind (where the index records it), and with the
    // same state tensors, none left over (an AdamW checkpoint loaded into SGD without momentum used to
    // drop its moments silently and take its step count).
    const std::string kind = optimizer_kind(*optimizer);
    if (index.optimizer_kind && *index.optimizer_kind != kind) {
      fail(index.dir, "holds the state of the " + *index.optimizer_kind + " optimizer; the optimizer loading it is " +
                          kind + " (one optimizer's state does not continue another's)");
    }
    std::vector<std::string> saved_state = index.optimizer_state;
    std::sort(saved_state.begin(), saved_state.end());
    for (const auto& [name, p] : params) {
      if (!loads_state(name, p)) continue;
      std::vector<std::string> mine;
      for (const auto& [state, t] : optimizer->state(p)) mine.push_back(state);
      std::vector<std::string> sorted = mine;
      std::sort(sorted.begin(), sorted.end());
      if (sorted != saved_state) {
        fail(index.dir,
             "holds " +
                 (index.optimizer_state.empty() ? std::string("no optimizer state tensors")
                                                : "the optimizer state " + quoted_list(index.optimizer_state)) +
                 " for each parameter with state" +
                 (index.optimizer_kind ? " (" + *index.optimizer_kind + ")" : std::string()) + ", but the " + kind +
                 " optimizer loading it keeps " + quoted_list(mine) + " for parameter '" + name +
                 "': a checkpoint of another optimizer, or of other settings");
      }
    }
    // The groups decide each parameter's rate and decay: a resume must continue with the same.
    // A checkpoint from before groups existed had one group of every parameter. Parameters with
    // no state in the checkpoint (not updated then, or no step taken: a frozen backbone) have no
    // history to continue and may join any group now (unfrozen with a rate of their own).
    auto stateless = [&](const std::string& name) {
      const auto found = by_name.find(name);
      return found != by_name.end() && !found->second->has_state();
    };
    // A group left with none of those (a new one for an unfrozen backbone) is no history either.
    auto with_state = [&](std::vector<ckpt::IndexGroup> groups) {
      for (auto& g : groups) std::erase_if(g.params, stateless);
      std::erase_if(groups, [](const ckpt::IndexGroup& g) { return g.params.empty(); });
      return groups;
    };
    // Compared as sets: each group's parameters in name order, the groups by name. An optimizer
    // given the same parameters in another order (or its groups in another order) updates them
    // alike, and was refused (with two descriptions that read the same).
    auto canonical = [](std::vector<ckpt::IndexGroup> groups) {
      for (auto& g : groups) std::sort(g.params.begin(), g.params.end());
      std::sort(groups.begin(), groups.end(), [](const ckpt::IndexGroup& a, const ckpt::IndexGroup& b) {
        return std::tie(a.name, a.params) < std::tie(b.name, b.params);
      });
      return groups;
    };
    const auto mine = canonical(with_state(groups_of(*optimizer, params)));
    std::vector<ckpt::IndexGroup> saved;
    if (index.optimizer_groups) {
      saved = *index.optimizer_groups;
    } else {
      saved.push_back({"default", 1.0, std::nullopt, {}});
      for (const auto& [name, p] : params) saved.back().params.push_back(name);
    }
    saved = canonical(with_state(saved));
    if (saved != mine) {
      fail(index.dir, "was saved with the optimizer groups " + describe(saved) + "; this optimizer's are " +
                          describe(mine) + " (their names, parameters, lr scales and weight decays must match)");
    }
    // Its settings too (PyTorch's load_state_dict overwrites them with the saved ones, silently).
    for (const auto& [setting, value] : optimizer_settings(*optimizer)) {
      const auto saved_setting = index.optimizer_settings.find(setting);
      if (saved_setting != index.optimizer_settings.end() && saved_setting->second != value) {
        auto shortest = [](double v) {  // the shortest text that reads back as v: 0.1, not 0.10000000000000001
          std::array<char, 32> text;
          return std::string(text.data(), std::to_chars(text.data(), text.data() + text.size(), v).ptr);
        };
        fail(index.dir, "was saved by " + kind + " with " + setting + " " + shortest(saved_setting->second) +
                            "; this optimizer's is " + shortest(value) +
                            " (a resume continues with the saved settings: build the optimizer with them)");
      }
    }
  }
  RankFiles files(index);
  // Fills [want.offset, want.offset + want.count) of tensor `name` of `entry` into `out` from the
  // pieces that overlap it: the resharding read.
  auto gather_range = [&](const IndexParam& entry, const std::string& name, std::optional<DType> dtype,
                          std::size_t elem, Piece want, void* out) {
    for (const IndexPiece& piece : entry.pieces) {
      const std::int64_t lo = std::max(piece.offset, want.offset);
      const std::int64_t hi = std::min(piece.offset + piece.count, want.offset + want.count);
      if (lo >= hi) continue;
      const auto& t = files.tensor(piece.rank, name, piece.count, dtype, piece);
      if (dtype_size(t.dtype) != elem) {
        fail(files.open(piece.rank).path(),
             "tensor '" + name + "' is " + safetensors::format_dtype(t.dtype) + ", the model's state is not");
      }
      read_checked(files.open(piece.rank), name, elem,
                   verify && index.has_checksums() ? &piece.hashes.at(name) : nullptr, lo - piece.offset, hi - lo,
                   static_cast<char*>(out) + (lo - want.offset) * static_cast<std::int64_t>(elem));
    }
  };

  // Every mismatch the index shows, before anything is loaded: a refused checkpoint changes
  // nothing (checked inside the loop, the parameters before the mismatch and their moments were
  // overwritten, the step counts not: a "resume, or start afresh" caller went on with a mixture).
  for (const auto& [name, p] : params) {
    const auto found = by_name.find(name);
    if (found == by_name.end()) fail(index.dir, "has no parameter '" + name + "'");
    const IndexParam& entry = *found->second;
    if (entry.shape != p.shape()) {
      fail(index.dir, "parameter '" + name + "' is " + to_string(entry.shape) + " in the checkpoint but " +
                          to_string(p.shape()) + " in the model");
    }
    if (entry.dtype != p.data().dtype()) {
      fail(index.dir, "parameter '" + name + "' is " + std::string(dtype_name(entry.dtype)) +
                          " in the checkpoint but " + std::string(dtype_name(p.data().dtype())) + " in the model");
    }
    if (!loads_state(name, p)) continue;
    for (const auto& [state, t] : optimizer->state(p)) {
      const DType stored = stored_state_dtype(entry, state);
      if (stored != t.dtype() && !(is_16bit_float(stored) && t.dtype() == DType::f32)) {
        fail(index.dir, "optimizer state '" + state + "' of parameter '" + name + "' is " +
                            std::string(dtype_name(stored)) + " in the checkpoint but " +
                            std::string(dtype_name(t.dtype())) + " in the optimizer");
      }
    }
  }
  for (const auto& [name, p] : params) {
    const IndexParam& entry = *by_name.at(name);
    const Piece want =
        p.is_sharded() ? Piece{p.shard()->offset(), p.shard()->real_elements()} : Piece{0, p.data().numel()};
    // Padding stays zero: fill the whole local tensor, then the real part from the files.
    Tensor& data = p.data();
    Tensor staged = zeros({data.numel()}, Options(entry.dtype, &data.backend()));
    gather_range(entry, model_tensor(name), entry.dtype, dtype_size(entry.dtype), want, staged.data_ptr());
    data.detach().reshape({-1}).copy_(staged);
    if (optimizer && index.has_optimizer && optimizer->updates(p) && !entry.has_state()) {
      // Afresh: state this optimizer made already is zeroed, none is made. (Zeroed state stays
      // made, so the next save writes it, as zeros with a count of 0: the optimizers have no way
      // to drop a parameter's state. Training continues the same either way.)
      if (optimizer->has_state(p)) {
        for (auto& [state, t] : optimizer->state(p)) t.fill_(0.0);
      }
    } else if (loads_state(name, p)) {
      for (auto& [state, t] : optimizer->state(p)) {  // (names and dtypes the index's: checked above)
        // A 16-bit state into an f32 one is widened (copy_ casts): Adam's moments of a 16-bit
        // parameter, which checkpoints before 2026-12-07 hold in the parameter's dtype.
        const DType stored = stored_state_dtype(entry, state);
        Tensor staged_state = zeros({t.numel()}, Options(stored, &t.backend()));
        gather_range(entry, optim_tensor(name, state), stored, dtype_size(stored), want, staged_state.data_ptr());
        t.reshape({-1}).copy_(staged_state);
      }
    }
  }
  if (optimizer && index.has_optimizer) {
    optimizer->set_steps(index.optimizer_steps);
    for (const auto& [name, p] : params) {
      const auto found = by_name.find(name);
      if (found == by_name.end() || !optimizer->updates(p)) continue;
      if (!found->second->has_state()) {
        optimizer->set_steps_of(p, 0);
      } else if (found->second->steps) {
        optimizer->set_steps_of(p, *found->second->steps);
      }
    }
    try {
      optimizer->set_lr(index.lr);
    } catch (const ArgumentError& e) {  // a value of the index, not of the caller
      fail(index.path, std::string("holds optimizer state the optimizer refuses: ") + e.what());
    }
  }
  restore_dropout_streams(index, module);
  info.bytes_read = files.bytes_read();
  return info;
}
}  // namespace

CheckpointInfo load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer, Communicator& comm,
                               const LoadOptions& options) {
  autograd::NoGradGuard guard;
  // Each phase runs on every rank, and every rank learns whether every rank completed it: none
  // goes on (or reports success) while another fails.
  auto agreed = [&](const std::function<void()>& phase) {
    std::exception_ptr mine;
    std::string error;
    try {
      phase();
    } catch (const std::exception& e) {
      mine = std::current_exception();
      error = e.what();
    }
    const auto failures = agree_on_failure(comm, error, "checkpoint load");
    if (mine) std::rethrow_exception(mine);
    if (!failures.empty()) fail(path, "loading failed on " + describe(failures));
  };
  std::optional<Index> index;
  agreed([&] { index = read_index(resolve_checkpoint(path)); });
  agree_on_loading(comm, *index, module.named_parameters(), optimizer);
  CheckpointInfo info;
  agreed([&] {
    info =
        with_index_errors(index->dir, [&] { return load_from(*index, module, optimizer, options.verify_checksums); });
  });
  if (optimizer && !index->has_optimizer) {
    // A model-only checkpoint (ruda-ckpt split of a consolidated file, or one saved without an
    // optimizer) loads into a run with one: its moments and step counts start afresh, which a
    // resume must not do without saying so.
    info.warnings.push_back("checkpoint " + index->dir +
                            " holds no optimizer state: the optimizer starts afresh (zero moments, step counts 0)");
  }
  return info;
}

void check_resumable(const CheckpointInfo& saved, const std::string& model,
                     const std::map<std::string, std::string>& data_stream) {
  const auto found = saved.extra.find("model");
  if (found == saved.extra.end() || found->second != model) {
    throw IOError("checkpoint " + saved.directory + " holds model '" +
                  (found == saved.extra.end() ? "?" : found->second) + "', this run trains '" + model + "'");
  }
  for (const auto& [setting, value] : data_stream) {
    const auto recorded = saved.extra.find(setting);
    if (recorded != saved.extra.end() && recorded->second != value) {
      throw ArgumentError(setting + " " + value + " differs from the " + setting + " " + recorded->second + " of " +
                          saved.directory + ": the resumed run would train on other samples");
    }
  }
}

CheckpointSummary describe_checkpoint(const std::string& path) {
  const Index index = read_index(resolve_checkpoint(path));
  CheckpointSummary out;
  out.info = {index.dir, index.step, index.world_size, index.extra};
  out.version = index.version;
  out.checksums = index.has_checksums();
  out.files = index.files;
  if (index.has_optimizer) out.optimizer_steps = index.optimizer_steps;
  for (const IndexParam& p : index.params)
    out.params.push_back({p.name, p.shape, p.dtype, p.id, p.sharded,
                          p.has_state() ? index.optimizer_state : std::vector<std::string>{}});
  return out;
}

std::uint64_t verify_checkpoint(const std::string& path) {
  const Index index = read_index(resolve_checkpoint(path));
  std::uint64_t bytes = 0;
  RankFiles files(index);
  // Chunked: checking a file of any size holds at most safetensors::kChunkBytes of it.
  with_index_errors(index.dir, [&] {
    for_each_piece(
        index, files,
        [&](safetensors::Reader& file, const std::string& tensor, const IndexParam&, const IndexPiece& piece) {
          stream_checked(file, tensor, piece.count, index.has_checksums() ? &piece.hashes.at(tensor) : nullptr,
                         [&](const char*, std::size_t n) { bytes += n; });
        });
  });
  return bytes;
}

namespace {
std::map<std::string, std::string> consolidated_metadata(const Index& index) {
  auto metadata = index.extra;
  metadata["step"] = std::to_string(index.step);
  metadata["source"] = index.dir;
  return metadata;
}
}  // namespace

void consolidate_checkpoint(const std::string& path, const std::string& output_file) {
  // Before anything is read: a name that is no file's (it used to fail only at the rename, after
  // the whole output was written to ".tmp" in the working directory).
  const std::string name = fs::path(output_file).filename().string();
  if (name.empty() || name == "." || name == "..") {
    fail(path, "cannot be consolidated into '" + output_file + "': not a file name (empty, or a directory's path)");
  }
  const Index index = read_index(resolve_checkpoint(path));
  // The output must not replace what is being read: a file of the checkpoint, anything inside its
  // step directory, or its checkpoint directory's latest pointer. (Its temporary file is always a
  // new one, never an existing file: see safetensors::detail::AtomicFile.)
  const fs::path step_dir(index.dir);
  if (lies_within(output_file, step_dir)) {
    fail(output_file, "lies inside the step directory " + index.dir +
                          " being consolidated: writing it there would damage the checkpoint");
  }
  std::vector<fs::path> inputs = {index.path};
  for (const auto& f : index.files) inputs.push_back(step_dir / f);
  std::error_code ec;
  const fs::path canonical_step = fs::weakly_canonical(step_dir, ec);
  if (!ec && is_step_name(canonical_step.filename().string()))
    inputs.push_back(canonical_step.parent_path() / "latest");
  for (const fs::path& input : inputs) {
    if (same_file(output_file, input))
      fail(output_file, "is " + input.string() + ", part of the checkpoint being consolidated");
  }
  // Nor any other checkpoint's files (another step's rank file or index, a latest pointer).
  if (const std::string member = checkpoint_member(output_file); !member.empty()) {
    fail(output_file, member + ": consolidating into it would damage that checkpoint");
  }
  // Streamed: the header first (the index gives every shape), then each parameter's pieces in
  // offset order, copied from the rank files through one bounded buffer and checked on the way.
  // No tensor is held, so a model of any size consolidates in safetensors::kChunkBytes of memory.
  std::vector<safetensors::TensorHeader> header;
  for (const IndexParam& p : index.params) header.push_back({p.name, p.dtype, p.shape});
  RankFiles files(index);
  with_index_errors(index.dir, [&] {
    safetensors::Writer out(output_file, header, consolidated_metadata(index));
    for_each_piece(
        index, files,
        [&](safetensors::Reader& file, const std::string& tensor, const IndexParam& p, const IndexPiece& piece) {
          if (tensor != model_tensor(p.name)) return;  // optimizer state is not part of a consolidated model
          stream_checked(file, tensor, piece.count, index.has_checksums() ? &piece.hashes.at(tensor) : nullptr,
                         [&](const char* data, std::size_t n) { out.write(data, n); });
        });
    out.commit();
  });
}

namespace {
// Where `rank` of `world` holds a tensor of `numel` elements in a split checkpoint: fully_shard's
// layout, slices of ceil(numel / world) (the last ones short or empty).
Piece split_piece(std::int64_t numel, int world, int rank) {
  const ShardInfo layout = ShardInfo::layout({numel}, rank, world);
  return {std::min(numel, layout.offset()), layout.real_elements()};  // an empty piece starts at the end
}

// Writes `rank`'s file of a split checkpoint: its slice of every input tensor, streamed from the
// input's byte ranges (no slice is held whole) and hashed on the way. Returns its report, as
// write_rank_file does.
json write_split_rank(const safetensors::Reader& input, int rank, int world, std::int64_t step,
                      const std::string& path) {
  std::vector<safetensors::TensorHeader> header;
  std::map<std::string, std::int64_t> offsets;
  for (const auto& t : input.tensors()) {
    const Piece p = split_piece(t.numel(), world, rank);
    header.push_back({model_tensor(t.name), t.dtype, {p.count}});
    if (p.count > 0) offsets[model_tensor(t.name)] = p.offset;
  }
  safetensors::Writer out(path, header, rank_file_metadata(rank, world, step, offsets));
  json pieces = json::object();
  for (const auto& t : input.tensors()) {
    const Piece p = split_piece(t.numel(), world, rank);
    std::string hashes;
    // Chunks start at multiples of kChunkBytes from the piece's start: on its block boundaries.
    input.read_range_chunked(t.name, p.offset, p.count, [&](const char* data, std::size_t n) {
      append_block_hashes(hashes, data, n);
      out.write(data, n);
    });
    if (p.count > 0)
      pieces[t.name] = {{"offset", p.offset}, {"count", p.count}, {"xxh3", {{model_tensor(t.name), hashes}}}};
  }
  out.commit();
  return {{"file", fs::path(path).filename().string()}, {"pieces", pieces}};
}
}  // namespace

CheckpointInfo split_checkpoint(const std::string& input_file, int world_size, const std::string& out_dir,
                                std::int64_t step) {
  check_save_arguments(out_dir, step, world_size, {}, 0);  // before the input is read (its extra below)
  safetensors::Reader input(input_file);
  // A rank file of a sharded checkpoint holds flat slices and optimizer state under its own names,
  // not a model: split would take them for parameters.
  if (const auto& m = input.metadata(); m.count("format") && m.at("format") == kFormat) {
    const auto field = [&](const char* key) { return m.count(key) ? m.at(key) : std::string("?"); };
    fail(input_file, "is a rank file of a sharded checkpoint (rank " + field("rank") + " of " + field("world_size") +
                         "), not a full model: consolidate its step first (ruda-ckpt consolidate STEP_DIR FILE)");
  }
  std::vector<ParamHeader> headers;
  for (const auto& t : input.tensors()) {
    if (!is_floating(t.dtype)) fail(input_file, "tensor '" + t.name + "' is not floating-point");
    headers.push_back({t.name, 0, t.shape, t.dtype, true, {}, {}});
  }
  std::map<std::string, std::string> extra = input.metadata();
  extra.erase("step");
  extra.erase("source");
  check_save_arguments(out_dir, step, world_size, extra, 0);
  const std::string step_dir = (fs::path(out_dir) / step_name(step)).string();
  // The input must survive the split: not inside the step directory it writes, not the pointer
  // publishing replaces, not inside a step directory without an index (publishing removes those).
  const fs::path input_path(input_file);
  auto refuse_input = [&](const std::string& why) {
    fail(input_file, "cannot be split into " + out_dir + ": it " + why + ", which the split would overwrite or remove");
  };
  if (lies_within(input_path, step_dir)) refuse_input("lies inside the step directory " + step_dir);
  if (same_file(input_path, fs::path(out_dir) / "latest"))
    refuse_input("is " + (fs::path(out_dir) / "latest").string());
  {
    std::error_code ec;
    for (fs::directory_iterator it(out_dir, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code probing;
      if (is_step_name(it->path().filename().string()) && it->is_directory(probing) && !is_complete_step(it->path()) &&
          lies_within(input_path, it->path()))
        refuse_input("lies inside " + it->path().string() + ", a step directory without an index");
    }
  }
  // A split writes the model alone: replacing a step that holds optimizer state would drop it.
  // An index that cannot be read (damaged, or of a newer format) may hold it too: its rank files
  // are what a repair or a newer ruda would load, so it is refused as well (it was taken for a
  // step with nothing to keep, and its files of optimizer state deleted).
  if (is_complete_step(step_dir)) {
    bool has_optimizer = false;
    try {
      has_optimizer = read_index(step_dir).has_optimizer;
    } catch (const IOError& e) {
      fail(step_dir, std::string("exists with an index that cannot be read (") + e.what() +
                         "); a split would replace its files: give another --step, or remove the step first");
    }
    if (has_optimizer) {
      fail(step_dir,
           "exists and holds optimizer state, which a split (the model alone) would drop: give another "
           "--step, or remove the step first");
    }
  }
  const SaveLock lock(out_dir);
  check_latest_pointer(out_dir);  // as a save: a pointer that cannot be replaced fails before any file is written
  prepare_step(step_dir);         // as a save: a step split again keeps its files until the new index replaces it
  std::vector<json> reports;
  std::vector<std::string> written;
  try {
    for (int rank = 0; rank < world_size; ++rank) {
      const std::string file = (fs::path(step_dir) / new_rank_file(step_dir, rank, world_size)).string();
      reports.push_back(write_split_rank(input, rank, world_size, step, file));
      written.push_back(file);
    }
    publish(out_dir, step_dir, step, build_index(step, world_size, headers, nullptr, {}, extra, reports), 0);
  } catch (...) {
    // No index names them (a failed write, or an index the disk refused), unless publishing
    // failed after the index (the latest pointer): then they are the step's.
    std::error_code ec;
    for (const auto& file : written) {
      if (!index_names(step_dir, fs::path(file).filename().string())) fs::remove(file, ec);
    }
    throw;
  }
  return CheckpointInfo{step_dir, step, world_size, extra};
}

}  // namespace ruda::nn
