// Files as nn writes and reads them (internal to nn). Every file nn writes (safetensors files,
// checkpoint indexes and pointers, the decompressed copies of data sets) goes through one atomic
// writer, AtomicFile; every file it reads is opened through open_regular_file, which never blocks
// on a FIFO and refuses anything that is not a regular file.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace ruda::safetensors {

/// Writes a text file atomically (AtomicFile): a failure at any point leaves no temporary behind.
/// Errors read "checkpoint <path>: ...", as the checkpoint code's own.
void write_text_atomically(const std::string& path, const std::string& text);
/// Reads a whole text file of at most `max_bytes`; IOError "checkpoint <path>: ..." if it is
/// missing, not a regular file (a directory, a FIFO: never blocks), or larger.
std::string read_text_file(const std::string& path, std::size_t max_bytes);

/// IOError "<origin><path>: contains a NUL character ..." for a path the system would cut at its
/// first NUL (safetensors::write("/d/q\0z") wrote /d/q); nothing otherwise.
void refuse_nul(const std::string& path, const std::string& origin);

/// Opens `path` for reading without ever blocking (O_NONBLOCK, cleared once the file is known to be
/// regular: opening a FIFO would otherwise wait for a writer forever) and returns the descriptor,
/// with its size in `size` when given. IOError "<origin><path>: ..." if it cannot be opened or is
/// not a regular file ("is not a regular file but a FIFO"); nothing is left open then.
int open_regular_file(const std::string& path, const std::string& origin, std::uint64_t* size = nullptr);

/// Makes the entries of directory `dir` durable (fsync of the directory: a rename or an unlink in
/// it survives a crash once this returns); best effort, as a directory may refuse to be opened.
void sync_directory(const std::string& dir);

/// What a file of this mode is, for messages: "directory", "FIFO", "character device", ...
const char* file_kind(mode_t mode);

/// The name of the file a temporary file of AtomicFile's is written for, when `name` (a file
/// name, no directory) is one: `base`.tmp-XXXXXX (`base` cut short if it is very long), or
/// `base`.tmp as versions before it named them; nullopt otherwise. For the upkeep that removes
/// what killed writers left.
std::optional<std::string> temporary_base(const std::string& name);

/// A JSON library error's text with every byte outside printable ASCII written as \xNN: its parse
/// errors quote the last bytes read, which in a damaged file may be any bytes (a message with a
/// raw 0xFF in it was no longer UTF-8 text).
std::string printable_error(const std::exception& e);

/// Parses JSON text (throwing the library's parse errors) with every object's keys checked to be
/// distinct: `duplicate` gets the first key an object repeats, "" if none.
nlohmann::json parse_distinct_keys(const std::string& text, std::string& duplicate);

/// Why JSON text from a file must not be parsed into a tree, or nullopt: nesting deeper than
/// `max_depth` (printing or comparing such a tree recursed until the stack overflowed), or a tree
/// larger than this process can allocate (about 20 times the text for long arrays of small
/// numbers: a parse that ran out of memory ended in std::terminate, not an exception). One pass
/// of the library's SAX parser, which neither recurses nor builds anything.
std::optional<std::string> json_refusal(const std::string& text, std::size_t max_depth);

namespace detail {

/// A file written atomically: the bytes go to a temporary file beside `path`, which commit()
/// flushes to disk (fsync) and renames over `path` (then syncs the directory), so that `path`
/// always holds the old complete file or the new one, and a failure or a kill at any point leaves
/// the old one. Every writer of nn's files uses it.
///
/// - The temporary file is `path`.tmp-XXXXXX in `path`'s directory, a name nobody else has,
///   created with O_CREAT | O_EXCL | O_NOFOLLOW: never an existing file, never through a symbolic
///   link planted at its name, and never shared by two writers of the same path (each writes its
///   own; the last rename wins, and each file it leaves is complete).
/// - The destination must be missing or a regular file (the rename replaces it). Anything else is
///   refused with an IOError naming it, before a byte is written and again just before the rename:
///   a directory, a FIFO, a socket or a device (the rename would replace the node itself, which
///   another program reads or writes), and a symbolic link, even to a regular file: the rename
///   would replace the link rather than write to its target, so neither reading of "write through
///   the link" is done silently; give the target's path instead. (What appears at `path` between
///   the last check and the rename is replaced, as rename(2) does.)
/// - A failure at any point (the constructor, write, commit, or destruction without commit)
///   removes the temporary file.
class AtomicFile {
 public:
  /// `origin` starts every error message ("safetensors: ", "checkpoint ", or "" for data files),
  /// followed by `path`. With `crash_simulation`, the bytes written count towards
  /// testing::crash_after_bytes() (checkpoint files, not the data sets' copies).
  AtomicFile(std::string path, std::string origin, bool crash_simulation = true);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t size);
  /// Moves where the next write() goes (from the file's start).
  void seek(std::uint64_t offset);
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what) const;
  void check_destination() const;
  void discard() noexcept;
  std::string path_, temp_, origin_;
  bool crash_simulation_;
  int fd_ = -1;
  int slot_ = -1;         // where a signal handler finds the temporary (files.cpp), -1 for none
  bool settled_ = false;  // renamed into place, or its temporary removed
};

/// Bytes this process may still allocate: the smaller of the system's MemAvailable and what the
/// address-space and data limits (ulimit -v, -d) leave; unknown parts count as unlimited.
std::uint64_t allocatable_bytes();
/// The most this process could ever hold: the system's memory and swap (MemTotal + SwapTotal),
/// within the same limits. A size beyond it fails whatever else is freed first.
std::uint64_t memory_ceiling_bytes();
}  // namespace detail

namespace testing {
/// Crash simulation for tests: when RUDA_TEST_CRASH_AFTER_BYTES=N is set in the environment, a
/// write of an AtomicFile (with crash_simulation) that has written N bytes in this process ends
/// the process at once (_exit(86)), as a kill would. Returns N, or -1 when unset.
std::int64_t crash_after_bytes();
}  // namespace testing

}  // namespace ruda::safetensors
