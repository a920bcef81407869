#include "stop.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string_view>
#include <thread>

namespace ruda::train {

namespace {

constexpr int kSignals[] = {SIGINT, SIGTERM, SIGUSR1};

// Written by the watcher thread, read by the ranks.
std::atomic<int> g_received{0};

std::mutex g_mutex;
int g_holders = 0;       // StopSignals alive
bool g_seen = false;     // a signal came while they were: the next one ends the process
bool g_watched = false;  // watch_stop_signals ran

bool ignored(int signal) {
  struct sigaction current {};
  return sigaction(signal, nullptr, &current) == 0 && current.sa_handler == SIG_IGN;
}

// The signals to take: those the process does not ignore. (Linux keeps an ignored signal pending
// while it is blocked, where sigwait would take it: a shell's background job, which ignores
// SIGINT, would have stopped at a Ctrl-C meant for the foreground.)
sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  for (const int s : kSignals) {
    if (!ignored(s)) sigaddset(&set, s);
  }
  return set;
}

// Ends the process by `signal` as its default action would: from any thread, the signal
// unblocked there with the default disposition.
[[noreturn]] void end_by(int signal) {
  std::signal(signal, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, signal);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  ::raise(signal);
  std::_Exit(128 + signal);  // (not reached: the default action of each of them ends the process)
}

void watch(sigset_t set) {
  for (;;) {
    int signal = 0;
    if (sigwait(&set, &signal) != 0) continue;
    std::unique_lock lock(g_mutex);
    if (g_holders > 0 && !g_seen) {
      g_seen = true;
      g_received.store(signal);
      continue;
    }
    lock.unlock();
    end_by(signal);
  }
}

}  // namespace

void watch_stop_signals() {
  std::lock_guard lock(g_mutex);
  if (g_watched) return;
  g_watched = true;
  // Blocked here, before any other thread exists, so that every thread inherits the mask: a
  // signal is then taken by the watcher alone, which runs no kernel.
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread watcher(watch, set);
  pthread_setname_np(watcher.native_handle(), "ruda-signals");  // (ps -L, /proc/PID/task/*/comm)
  watcher.detach();
}

StopSignals::StopSignals() {
  std::lock_guard lock(g_mutex);
  if (g_holders++ > 0) return;
  g_seen = false;
  g_received.store(0);
}

StopSignals::~StopSignals() {
  std::unique_lock lock(g_mutex);
  if (--g_holders > 0) return;
  const int signal = g_received.exchange(0);
  lock.unlock();
  if (signal != 0) end_by(signal);
}

int StopSignals::received() { return g_received.load(std::memory_order_relaxed); }

void StopSignals::acknowledge() { g_received.store(0, std::memory_order_relaxed); }

void send_for_test(int signal) {
  // To the process, as one from outside comes (raise() would direct it at this thread, where it
  // is blocked), and recorded before this returns, as a handler would have had it; one the process
  // ignores is discarded at once.
  ::kill(::getpid(), signal);
  if (ignored(signal)) return;
  for (int waited = 0; StopSignals::received() == 0 && waited < 10000; ++waited) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string signal_name(int signal) {
  switch (signal) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "signal " + std::to_string(signal);
  }
}

RaiseForTest raise_for_test() {
  const char* env = std::getenv("RUDA_TEST_RAISE");
  if (env == nullptr || *env == '\0') return {};
  const std::string_view value(env);
  const std::size_t at = value.find('@');
  const std::string_view name = value.substr(0, at);
  RaiseForTest r;
  r.signal = name == "TERM" ? SIGTERM : name == "INT" ? SIGINT : name == "USR1" ? SIGUSR1 : 0;
  char* end = nullptr;
  const std::string step(at == std::string_view::npos ? "" : value.substr(at + 1));
  if (r.signal != 0 && step == "end") {
    r.step = -1;
    return r;
  }
  errno = 0;
  r.step = std::strtoll(step.c_str(), &end, 10);
  if (r.signal == 0 || step.empty() || *end != '\0' || errno == ERANGE || r.step < 1) {
    throw std::invalid_argument("RUDA_TEST_RAISE=" + std::string(value) +
                                ": expected TERM@N, INT@N or USR1@N, N >= 1 or end");
  }
  return r;
}

}  // namespace ruda::train
