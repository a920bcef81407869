#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <ruda/backend.h>
#include <ruda/error.h>
#include <ruda/tensor.h>

#include "internal.h"
#include "op_descriptors.h"

#ifdef RUDA_HAVE_OPENMP
#include <omp.h>
#endif

namespace ruda {

namespace detail {
// Defined by the backends folder: registers the backends this build contains. The engine calls it
// once, before the first lookup, so registration does not depend on static initializers that a
// linker may drop.
void register_builtin_backends();
}  // namespace detail

namespace {

struct Entry {
  std::string name;
  std::function<std::unique_ptr<Backend>()> factory;
  std::unique_ptr<Backend> instance;
  std::once_flag created;
};

struct Registry {
  std::mutex mutex;
  std::vector<std::unique_ptr<Entry>> entries;  // stable addresses: backends live as long as the process
  std::atomic<Backend*> default_backend{nullptr};
};

Registry& storage() {
  static Registry r;
  return r;
}

Registry& registry() {
  static std::once_flag builtins;
  std::call_once(builtins, [] { detail::register_builtin_backends(); });
  return storage();
}

std::string names_list(const Registry& r) {
  std::string out;
  for (const auto& e : r.entries) out += (out.empty() ? "" : ", ") + e->name;
  return out;
}

Backend& instance_of(Entry& e) {
  std::call_once(e.created, [&] {
    e.instance = e.factory();
    if (!e.instance) fail<BackendError>("get_backend", "the factory of backend '", e.name, "' returned nothing");
  });
  return *e.instance;
}

}  // namespace

namespace ops {

void check_unary_with_derivative(UnaryOp op, const View& x, const View& y, const View& dydx) {
  // The name is built only for a message: this runs on every call.
  const std::string_view op_name = unary_info(op).name;
  auto name = [op_name] { return std::string(op_name) + " with derivative"; };
  const std::int64_t n = x.numel();
  if (y.numel() != n || dydx.numel() != n) {
    fail<ShapeError>(name(), "x has ", n, " values, y ", y.numel(), ", dydx ", dydx.numel(), "; all three must match");
  }
  if (y.dtype != x.dtype || dydx.dtype != x.dtype) {
    fail<DTypeError>(name(), "x is ", dtype_name(x.dtype), ", y ", dtype_name(y.dtype), ", dydx ",
                     dtype_name(dydx.dtype), "; all three must match");
  }
  if (!x.is_contiguous() || !y.is_contiguous() || !dydx.is_contiguous()) {
    fail<ShapeError>(name(), "x, y and dydx (", dtype_name(x.dtype), ", ", n, " values) must be contiguous");
  }
  if (n == 0) return;
  if (!x.data || !y.data || !dydx.data) {
    fail<ArgumentError>(name(), "x, y and dydx (", dtype_name(x.dtype), ", ", n, " values) all need data");
  }
  const std::size_t bytes = static_cast<std::size_t>(n) * dtype_size(x.dtype);
  auto overlap = [bytes](const View& a, const View& b) {
    const auto* pa = static_cast<const std::byte*>(a.data);
    const auto* pb = static_cast<const std::byte*>(b.data);
    return pa < pb + bytes && pb < pa + bytes;
  };
  if (overlap(y, x) || overlap(y, dydx)) {
    fail<ArgumentError>(name(), "y (", dtype_name(x.dtype), ", ", n, " values) overlaps x or dydx");
  }
  if (dydx.data != x.data && overlap(dydx, x)) {
    fail<ArgumentError>(name(), "dydx overlaps x (", dtype_name(x.dtype), ", ", n, " values) without being x itself");
  }
}

}  // namespace ops

void Backend::add_scaled(const View& x, double alpha, const View& y) {
  const Shape shape(y.shape.begin(), y.shape.begin() + y.ndim);
  const Tensor factor = detail::arithmetic_scalar_tensor(alpha, Options(x.dtype, this));  // overflows as arithmetic
  Tensor scaled = empty(shape, Options(x.dtype, this));
  binary(BinaryOp::mul, x, detail::broadcast_view(factor, shape), scaled.view());
  binary(BinaryOp::add, y, scaled.view(), y);
}

void Backend::unary_with_derivative(UnaryOp op, const View& x, const View& y, const View& dydx) {
  ops::check_unary_with_derivative(op, x, y, dydx);
  unary(op, x, y);
  // gy = 1, and the derivative's own buffer where dydx is x (the backward reads x while it
  // writes: a kernel need not allow its output to be its input); engine tensors, so that the
  // memory limit and statistics see them.
  const Shape shape(x.shape.begin(), x.shape.begin() + x.ndim);
  const Tensor ones = full(shape, 1.0, Options(x.dtype, this));
  if (dydx.data != x.data) {
    unary_backward(op, x, y, ones.view(), dydx);
    return;
  }
  const Tensor out = empty(shape, Options(x.dtype, this));
  unary_backward(op, x, y, ones.view(), out.view());
  copy(out.view(), dydx);
}

void register_backend(std::string name, std::function<std::unique_ptr<Backend>()> factory) {
  if (name.empty()) fail<ArgumentError>("register_backend", "the backend's name is empty");
  if (!factory) fail<ArgumentError>("register_backend", "the factory of backend '", name, "' is empty");
  Registry& r = storage();
  std::lock_guard lock(r.mutex);
  for (const auto& e : r.entries) {
    if (e->name == name) fail<BackendError>("register_backend", "a backend named '", name, "' is registered already");
  }
  auto entry = std::make_unique<Entry>();
  entry->name = std::move(name);
  entry->factory = std::move(factory);
  r.entries.push_back(std::move(entry));
}

Backend& get_backend(std::string_view name) {
  Registry& r = registry();
  Entry* found = nullptr;
  {
    std::lock_guard lock(r.mutex);
    for (const auto& e : r.entries) {
      if (e->name == name) found = e.get();
    }
    if (!found) {
      fail<BackendError>("get_backend", "unknown backend '", name, "' (available: ", names_list(r), ")");
    }
  }
  return instance_of(*found);
}

std::vector<std::string> available_backends() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& e : r.entries) names.push_back(e->name);
  return names;
}

Backend& default_backend() {
  Registry& r = registry();
  if (Backend* b = r.default_backend.load(std::memory_order_acquire)) return *b;
  Backend* chosen = nullptr;
  if (const char* env = std::getenv("RUDA_BACKEND"); env && *env) {
    try {
      chosen = &get_backend(env);
    } catch (const BackendError& e) {
      throw BackendError(std::string("RUDA_BACKEND: ") + e.what());
    }
  } else {
    const auto names = available_backends();
    const bool has_onednn = std::find(names.begin(), names.end(), "onednn") != names.end();
    chosen = &get_backend(has_onednn ? "onednn" : "eigen");
  }
  Backend* expected = nullptr;
  r.default_backend.compare_exchange_strong(expected, chosen, std::memory_order_acq_rel);
  return *r.default_backend.load(std::memory_order_acquire);
}

void set_default_backend(std::string_view name) {
  Backend& b = get_backend(name);
  registry().default_backend.store(&b, std::memory_order_release);
}

int hardware_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

int max_num_threads() { return std::max(256, 16 * hardware_threads()); }

namespace {
// A thread count for `op` (`text` as the caller wrote it): positive and at most
// max_num_threads(). (libgomp ends the process, it does not throw, when it cannot allocate or
// start the threads asked for.)
void check_thread_count(long long threads, std::string_view op, const std::string& text) {
  if (threads < 1) fail<ArgumentError>(op, "thread count must be positive, got ", text);
  if (threads > max_num_threads()) {
    fail<ArgumentError>(op, "thread count ", text, " is more than ruda allows on this machine (", max_num_threads(),
                        ": 16 per hardware thread, at least 256)");
  }
}
void check_thread_count(long long threads, std::string_view op) {
  check_thread_count(threads, op, std::to_string(threads));
}

// The thread count in environment variable `name`, 0 when unset or empty. `whole`: the text must
// be a number and nothing else (RUDA_NUM_THREADS); otherwise its leading number counts, as OpenMP
// reads OMP_NUM_THREADS (a nested list such as "4,2" gives 4), and text without a positive one
// leaves the default. A count out of long long's range reads as too many, named by its own text.
int env_thread_count(const char* name, bool whole) {
  const char* env = std::getenv(name);
  if (!env || !*env) return 0;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(env, &end, 10);
  const bool number = end != env && (!whole || *end == '\0');
  if (!number && whole) fail<ArgumentError>(name, "not a whole number of threads: '", env, "'");
  if (!number || (!whole && n < 1)) return 0;
  check_thread_count(errno == ERANGE ? (n < 0 ? -1 : std::numeric_limits<long long>::max()) : n, name, env);
  return static_cast<int>(n);
}

std::atomic<int> g_default_threads{0};  // 0: the cores
thread_local int t_threads = 0;         // 0: not set on this thread yet
}  // namespace

int num_threads_from_env() { return env_thread_count("RUDA_NUM_THREADS", true); }

void set_num_threads(int threads) {
  check_thread_count(threads, "set_num_threads");
  t_threads = threads;
#ifdef RUDA_HAVE_OPENMP
  omp_set_num_threads(threads);  // per calling thread: emulated ranks each set their own
#endif
}

int num_threads() {
  if (t_threads == 0) {
    int n = num_threads_from_env();
    if (n == 0) n = env_thread_count("OMP_NUM_THREADS", false);
    set_num_threads(n > 0 ? n : default_num_threads());
  }
  return t_threads;
}

void set_default_num_threads(int threads) {
  check_thread_count(threads, "set_default_num_threads");
  g_default_threads.store(threads, std::memory_order_relaxed);
}

int default_num_threads() {
  const int n = g_default_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : hardware_threads();
}

}  // namespace ruda
