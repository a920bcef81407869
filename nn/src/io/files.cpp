// The atomic writer and the non-blocking reader every file of nn goes through (see files.h).
#include "io/files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <optional>
#include <random>
#include <utility>

#include <ruda/error.h>

namespace ruda::safetensors {

namespace {

constexpr const char* kCheckpoint = "checkpoint ";
constexpr std::size_t kSuffixLength = 6;  // the XXXXXX of .tmp-XXXXXX

[[noreturn]] void fail_as(const std::string& origin, const std::string& path, const std::string& what) {
  throw IOError(origin + ruda::detail::shown_nul(path) + ": " + what);
}
std::string os_error(int code = errno) { return std::strerror(code); }

std::atomic<std::int64_t> g_bytes_written{0};

// Six characters from [0-9a-z], different from call to call and from process to process.
std::string random_suffix() {
  static std::atomic<std::uint64_t> counter{0};
  thread_local std::mt19937_64 engine([] {
    std::random_device device;
    const auto now = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::seed_seq seed{device(), device(), static_cast<unsigned>(::getpid()), static_cast<unsigned>(now),
                       static_cast<unsigned>(now >> 32)};
    return std::mt19937_64(seed);
  }());
  std::uint64_t bits = engine() ^ (counter.fetch_add(1) * 0x9e3779b97f4a7c15ull);
  std::string out(kSuffixLength, '0');
  for (char& c : out) {
    c = "0123456789abcdefghijklmnopqrstuvwxyz"[bits % 36];
    bits /= 36;
  }
  return out;
}

}  // namespace

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "regular file";
  if (S_ISDIR(mode)) return "directory";
  if (S_ISLNK(mode)) return "symbolic link";
  if (S_ISFIFO(mode)) return "FIFO";
  if (S_ISSOCK(mode)) return "socket";
  if (S_ISCHR(mode)) return "character device";
  if (S_ISBLK(mode)) return "block device";
  return "special file";
}

std::optional<std::string> temporary_base(const std::string& name) {
  const std::size_t at = name.rfind(".tmp");
  if (at == std::string::npos || at == 0) return std::nullopt;
  const std::string rest = name.substr(at + 4);
  const bool fresh = rest.size() == kSuffixLength + 1 && rest[0] == '-' &&
                     std::all_of(rest.begin() + 1, rest.end(),
                                 [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z'); });
  if (!rest.empty() && !fresh) return std::nullopt;  // (empty: the fixed name of earlier versions)
  return name.substr(0, at);
}

void refuse_nul(const std::string& path, const std::string& origin) {
  if (path.find('\0') != std::string::npos) {
    fail_as(origin, path, "contains a NUL character, where the system would cut the path short");
  }
}

int open_regular_file(const std::string& path, const std::string& origin, std::uint64_t* size) {
  refuse_nul(path, origin);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail_as(origin, path, "cannot open: " + os_error());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int code = errno;
    ::close(fd);
    fail_as(origin, path, "cannot stat: " + os_error(code));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail_as(origin, path, std::string("is not a regular file but a ") + file_kind(st.st_mode));
  }
  // A regular file: reads behave as without the flag, but blocking reads are what callers expect.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  if (size) *size = static_cast<std::uint64_t>(st.st_size);
  return fd;
}

namespace detail {
namespace {
// The sum of /proc/meminfo's `keys` in bytes; nullopt where one is missing.
std::optional<std::uint64_t> meminfo_bytes(std::initializer_list<const char*> keys) {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return std::nullopt;
  std::uint64_t total = 0;
  std::size_t found = 0;
  char line[256];
  while (std::fgets(line, sizeof line, f)) {
    for (const char* key : keys) {
      const std::size_t n = std::strlen(key);
      unsigned long long kb = 0;
      if (std::strncmp(line, key, n) == 0 && line[n] == ':' && std::sscanf(line + n + 1, " %llu kB", &kb) == 1) {
        total += static_cast<std::uint64_t>(kb) * 1024;
        ++found;
      }
    }
  }
  std::fclose(f);
  return found == keys.size() ? std::optional<std::uint64_t>(total) : std::nullopt;
}

// The smaller of `memory` and what the address-space and data limits (ulimit -v, -d) leave.
std::uint64_t within_limits(std::uint64_t memory) {
  std::uint64_t out = memory;
  unsigned long long size_pages = 0, data_pages = 0, skip = 0;
  bool have_statm = false;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    have_statm =
        std::fscanf(f, "%llu %llu %llu %llu %llu %llu", &size_pages, &skip, &skip, &skip, &skip, &data_pages) == 6;
    std::fclose(f);
  }
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  auto headroom = [&](int resource, std::uint64_t used) {
    rlimit limit{};
    if (have_statm && ::getrlimit(resource, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
      const auto cap = static_cast<std::uint64_t>(limit.rlim_cur);
      out = std::min(out, cap > used ? cap - used : 0);
    }
  };
  headroom(RLIMIT_AS, size_pages * page);
  headroom(RLIMIT_DATA, data_pages * page);
  return out;
}
}  // namespace

std::uint64_t allocatable_bytes() {
  return within_limits(meminfo_bytes({"MemAvailable"}).value_or(std::numeric_limits<std::uint64_t>::max()));
}

std::uint64_t memory_ceiling_bytes() {
  return within_limits(meminfo_bytes({"MemTotal", "SwapTotal"}).value_or(std::numeric_limits<std::uint64_t>::max()));
}
}  // namespace detail

namespace testing {
std::int64_t crash_after_bytes() {
  static const std::int64_t limit = [] {
    const char* env = std::getenv("RUDA_TEST_CRASH_AFTER_BYTES");
    return env && *env ? std::atoll(env) : -1;
  }();
  return limit;
}
}  // namespace testing

namespace {
// The temporaries of the atomic writes in flight, where a signal handler can read them: fixed
// slots of fixed size (no allocation, no lock), each free, being filled, or holding a path.
constexpr int kTemporarySlots = 16;
struct TemporarySlot {
  enum State : int { free, filling, held };
  std::atomic<int> state{free};
  char path[PATH_MAX + 1] = {};
};
TemporarySlot g_temporaries[kTemporarySlots];

// A slot now holding `path`, or -1 (all taken, or a path too long: that write is not covered).
int hold_temporary(const std::string& path) {
  if (path.size() > PATH_MAX) return -1;
  for (int i = 0; i < kTemporarySlots; ++i) {
    int expected = TemporarySlot::free;
    if (!g_temporaries[i].state.compare_exchange_strong(expected, TemporarySlot::filling)) continue;
    std::memcpy(g_temporaries[i].path, path.c_str(), path.size() + 1);
    g_temporaries[i].state.store(TemporarySlot::held);
    return i;
  }
  return -1;
}

void release_temporary(int slot) noexcept {
  if (slot >= 0) g_temporaries[slot].state.store(TemporarySlot::free);
}

extern "C" void remove_temporaries_and_end(int signal) {
  // Async-signal-safe only: unlink, signal, raise.
  for (TemporarySlot& slot : g_temporaries) {
    if (slot.state.load() == TemporarySlot::held) ::unlink(slot.path);
  }
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}
}  // namespace

void remove_temporaries_on_signals() {
  for (const int signal : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction action {};
    action.sa_handler = remove_temporaries_and_end;
    sigemptyset(&action.sa_mask);
    ::sigaction(signal, &action, nullptr);
  }
}

namespace detail {

AtomicFile::AtomicFile(std::string path, std::string origin, bool crash_simulation)
    : path_(std::move(path)), origin_(std::move(origin)), crash_simulation_(crash_simulation) {
  refuse_nul(path_, origin_);
  const std::filesystem::path p(path_);
  const std::string name = p.filename().string();
  if (name.empty() || name == "." || name == "..") {
    fail("is not a file name to write (empty, or the name of a directory)");
  }
  check_destination();
  // `name`.tmp-XXXXXX, with `name` cut where the whole would pass the longest name a directory
  // entry may have (a name that fits would otherwise fail for its temporary's length alone).
  const std::size_t room = NAME_MAX - (4 + 1 + kSuffixLength);
  const std::string stem = name.substr(0, std::min(name.size(), room));
  for (int attempt = 0;; ++attempt) {
    temp_ = (p.parent_path() / (stem + ".tmp-" + random_suffix())).string();
    // 0666 less the umask, as any new file; a replaced file's own permissions below.
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd_ >= 0) {
      slot_ = hold_temporary(temp_);  // removed by a signal's handler (remove_temporaries_on_signals)
      break;
    }
    if (errno != EEXIST || attempt == 99) {
      const std::string why = os_error();
      settled_ = true;  // nothing was created
      fail("cannot create " + temp_ + ": " + why);
    }
  }
  // The file it replaces keeps its permissions: a 0600 file of private weights became 0644
  // (readable by every user) when a save replaced it.
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::fchmod(fd_, st.st_mode & 07777) != 0) {
    const std::string why = os_error();
    discard();
    fail("cannot give the new file the permissions of the file it replaces: " + why);
  }
}

AtomicFile::~AtomicFile() { discard(); }

void AtomicFile::fail(const std::string& what) const { fail_as(origin_, path_, what); }

void AtomicFile::check_destination() const {
  struct stat st {};
  if (::lstat(path_.c_str(), &st) != 0) return;  // missing (or unreachable: creating the temporary says why)
  if (S_ISREG(st.st_mode)) return;
  if (S_ISLNK(st.st_mode)) {
    fail(
        "is a symbolic link: not replaced (the rename would replace the link, not write to its target); "
        "give the target's path to write there");
  }
  fail(std::string("is a ") + file_kind(st.st_mode) + ", not a regular file: not replaced");
}

void AtomicFile::write(const void* data, std::size_t size) {
  if (fd_ < 0) fail("written after its commit (or a failed one)");
  const auto* p = static_cast<const char*>(data);
  const std::int64_t crash = crash_simulation_ ? testing::crash_after_bytes() : -1;
  while (size > 0) {
    std::size_t chunk = size;
    if (crash >= 0) {
      const std::int64_t left = crash - g_bytes_written.load();
      if (left <= 0) ::_exit(86);  // a simulated kill in the middle of a checkpoint
      chunk = std::min<std::size_t>(chunk, static_cast<std::size_t>(left));
    }
    const ssize_t n = ::write(fd_, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string why = os_error();
      discard();
      fail("write failed: " + why);
    }
    if (crash_simulation_) g_bytes_written += n;
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

void AtomicFile::seek(std::uint64_t offset) {
  if (fd_ < 0) fail("written after its commit (or a failed one)");
  if (::lseek(fd_, static_cast<off_t>(offset), SEEK_SET) < 0) {
    const std::string why = os_error();
    discard();
    fail("seek failed: " + why);
  }
}

void AtomicFile::commit() {
  if (fd_ < 0) fail("committed again after its commit (or a failed one)");
  try {
    if (::fsync(fd_) != 0) fail("fsync failed: " + os_error());
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) fail("close failed: " + os_error());
    check_destination();  // again: what appeared while the file was written
    if (::rename(temp_.c_str(), path_.c_str()) != 0) fail("rename failed: " + os_error());
  } catch (...) {
    discard();
    throw;
  }
  settled_ = true;
  release_temporary(std::exchange(slot_, -1));
  // The rename itself is durable once the directory is.
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  sync_directory(dir.empty() ? "." : dir);
}

void AtomicFile::discard() noexcept {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  if (!settled_) ::unlink(temp_.c_str());
  settled_ = true;  // unlinked once: its name is never used again
  release_temporary(std::exchange(slot_, -1));
}

}  // namespace detail

void write_text_atomically(const std::string& path, const std::string& text) {
  detail::AtomicFile file(path, kCheckpoint);
  file.write(text.data(), text.size());
  file.commit();
}

std::string read_text_file(const std::string& path, std::size_t max_bytes) {
  std::uint64_t size = 0;
  const int fd = open_regular_file(path, kCheckpoint, &size);
  std::string text;
  try {
    if (size > max_bytes) {
      fail_as(
          kCheckpoint, path,
          "is " + std::to_string(size) + " bytes, more than the " + std::to_string(max_bytes) + " this file may have");
    }
    text.resize(static_cast<std::size_t>(size));
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail_as(kCheckpoint, path, "read failed: " + os_error());
      if (n == 0) break;  // shrank while reading
      done += static_cast<std::size_t>(n);
    }
    text.resize(done);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return text;
}

}  // namespace ruda::safetensors
