// What ruda-train shows people: a progress bar on a terminal (plain lines otherwise), a metrics
// file of JSON lines, and human-readable durations and sizes. Printing happens on rank 0 only.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

namespace ruda::train {

inline std::string duration(double seconds) {
  char buf[32];
  const long s = static_cast<long>(seconds + 0.5);
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, s / 60 % 60);
  } else if (s >= 60) {
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%.1fs", seconds);
  }
  return buf;
}

/// A rate with three significant figures down to 0.01 ("11600", "76.2", "0.45"): a GPT-2-sized
/// model at batch 1 trains under one sample a second, which "%.0f" printed as 0.
inline std::string rate(double per_second) {
  char buf[32];
  std::snprintf(buf, sizeof buf, per_second >= 100 ? "%.0f" : per_second >= 10 ? "%.1f" : "%.2f", per_second);
  return buf;
}

class Progress {
 public:
  Progress(bool enabled, std::int64_t total_steps, std::int64_t log_every)
      : enabled_(enabled),
        tty_(::isatty(STDERR_FILENO)),
        total_(total_steps),
        log_every_(log_every),
        start_(std::chrono::steady_clock::now()) {}

  /// After a step: the bar on a terminal (redrawn at most 10 times a second), a line every log_every steps otherwise.
  void step(std::int64_t step, const std::string& where, double loss, double samples_per_second) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double done = static_cast<double>(step - first_step_ + 1);
    const double eta = done > 0 ? elapsed / done * static_cast<double>(total_ - step - 1) : 0;
    if (tty_) {
      if (std::chrono::duration<double>(now - last_draw_).count() < 0.1 && step + 1 < total_) return;
      last_draw_ = now;
      constexpr int kWidth = 24;
      const int filled =
          total_ > 0 ? static_cast<int>(kWidth * static_cast<double>(step + 1) / static_cast<double>(total_)) : 0;
      std::string bar(static_cast<std::size_t>(filled), '#');
      bar.resize(kWidth, '.');
      std::fprintf(stderr, "\r[%s] step %lld/%lld %s loss %.4f %s samples/s ETA %s   ", bar.c_str(),
                   static_cast<long long>(step + 1), static_cast<long long>(total_), where.c_str(), loss,
                   rate(samples_per_second).c_str(), duration(eta).c_str());
      std::fflush(stderr);
      drawn_ = true;
    } else if (log_every_ > 0 && ((step + 1) % log_every_ == 0 || step + 1 == total_)) {
      std::printf("step %lld/%lld %s loss %.4f %s samples/s ETA %s\n", static_cast<long long>(step + 1),
                  static_cast<long long>(total_), where.c_str(), loss, rate(samples_per_second).c_str(),
                  duration(eta).c_str());
      std::fflush(stdout);
    }
  }
  /// A line that must not be overwritten by the bar (evaluation results, checkpoints).
  void line(const std::string& text) {
    if (!enabled_) return;
    if (drawn_) {
      std::fprintf(stderr, "\n");
      drawn_ = false;
    }
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
  }
  void set_first_step(std::int64_t step) { first_step_ = step; }

 private:
  bool enabled_, tty_;
  std::int64_t total_, log_every_, first_step_ = 0;
  std::chrono::steady_clock::time_point start_, last_draw_{};
  bool drawn_ = false;
};

/// JSON lines, one object per record, flushed as written (a crash keeps what was logged).
class Metrics {
 public:
  Metrics() = default;
  /// A fresh file (resumed_from < 0), or, for a run resumed from step `resumed_from`, the file's
  /// lines up to that step: the lines of the steps after it were the run the checkpoint left
  /// behind, which this one trains again (each step appeared twice, with two values), and a line
  /// a kill cut short would run into the next one.
  Metrics(const std::string& path, std::int64_t resumed_from) {
    if (path.empty()) return;
    path_ = path;
    if (resumed_from >= 0) keep_steps_up_to(resumed_from);
    errno = 0;
    out_.open(path, resumed_from >= 0 ? std::ios::app : std::ios::trunc);
    if (!out_) throw std::runtime_error("--metrics " + path + ": cannot be opened for writing" + cause());
  }
  /// Throws where the line could not be written (the caller has every rank learn it).
  void write(const nlohmann::json& record) {
    if (!out_.is_open()) return;
    errno = 0;
    out_ << record.dump() << '\n';
    out_.flush();
    if (!out_) throw std::runtime_error("--metrics " + path_ + ": writing a line failed" + cause());
  }

 private:
  // " (<the system's reason>)" where the failed stream operation left one in errno.
  static std::string cause() { return errno != 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string(); }

  // Rewrites the file (beside it, then renamed over it) without the lines of steps after `step`
  // and without a last line that is not whole JSON; other lines are kept as they are.
  void keep_steps_up_to(std::int64_t step) {
    std::ifstream in(path_, std::ios::binary);
    if (!in) return;  // no file yet: nothing to keep
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    std::string kept;
    // A file that does not end with a newline is rewritten too: the next line would join its last.
    bool rewrite = !text.empty() && text.back() != '\n';
    for (std::size_t begin = 0; begin < text.size();) {
      std::size_t end = text.find('\n', begin);
      const bool last = end == std::string::npos || end + 1 == text.size();
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(begin, end - begin);
      begin = end + 1;
      const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      const bool whole = !record.is_discarded();
      if ((!whole && last) || (whole && record.is_object() && record.contains("step") &&
                               record["step"].is_number_integer() && record["step"].get<std::int64_t>() > step)) {
        rewrite = true;
        continue;
      }
      kept += line + '\n';
    }
    if (!rewrite) return;
    // A new file of its own name (mkstemp: created exclusively, never through a link): at a fixed
    // name, a symbolic link planted there was followed, the file it named emptied, and the link
    // renamed over the metrics file.
    std::string temporary = path_ + ".tmp-XXXXXX";
    const int fd = ::mkstemp(temporary.data());
    if (fd < 0) throw std::runtime_error("cannot rewrite metrics file " + path_ + cause());
    std::size_t done = 0;
    int code = ::fchmod(fd, 0644) == 0 ? 0 : errno;
    while (code == 0 && done < kept.size()) {
      const ssize_t n = ::write(fd, kept.data() + done, kept.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        code = n < 0 ? errno : ENOSPC;
      else
        done += static_cast<std::size_t>(n);
    }
    if (::close(fd) != 0 && code == 0) code = errno;
    if (code == 0 && std::rename(temporary.c_str(), path_.c_str()) != 0) code = errno;
    if (code != 0) {
      std::remove(temporary.c_str());
      throw std::runtime_error("cannot rewrite metrics file " + path_ + " (" + std::strerror(code) + ")");
    }
  }

  std::string path_;
  std::ofstream out_;
};

}  // namespace ruda::train
