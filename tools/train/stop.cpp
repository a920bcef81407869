#include "stop.h"

#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string_view>

namespace ruda::train {

namespace {

// Written by the handler, read by the ranks: a lock-free atomic is async-signal-safe.
std::atomic<int> g_received{0};
static_assert(std::atomic<int>::is_always_lock_free);

std::mutex g_mutex;
int g_holders = 0;
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGUSR1};
constexpr int kCount = sizeof kSignals / sizeof kSignals[0];
struct sigaction g_previous[kCount];

extern "C" void record_signal(int signal) { g_received.store(signal, std::memory_order_relaxed); }

}  // namespace

StopSignals::StopSignals() {
  std::lock_guard lock(g_mutex);
  if (g_holders++ > 0) return;
  g_received.store(0);
  struct sigaction action {};
  action.sa_handler = record_signal;
  sigemptyset(&action.sa_mask);
  // SA_RESETHAND: the first signal puts back the default (a second one ends the process);
  // SA_RESTART: a system call the signal interrupted (a file write, a poll) resumes.
  action.sa_flags = SA_RESETHAND | SA_RESTART;
  for (int i = 0; i < kCount; ++i) {
    sigaction(kSignals[i], &action, &g_previous[i]);
    if (g_previous[i].sa_handler == SIG_IGN) sigaction(kSignals[i], &g_previous[i], nullptr);
  }
}

StopSignals::~StopSignals() {
  std::lock_guard lock(g_mutex);
  if (--g_holders > 0) return;
  for (int i = 0; i < kCount; ++i) sigaction(kSignals[i], &g_previous[i], nullptr);
  if (const int signal = g_received.exchange(0)) ::raise(signal);
}

int StopSignals::received() { return g_received.load(std::memory_order_relaxed); }

void StopSignals::acknowledge() { g_received.store(0, std::memory_order_relaxed); }

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
