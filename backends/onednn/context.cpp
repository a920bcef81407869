// The oneDNN context: engine, per-thread streams and scratchpads, the primitive cache, thread
// control, the fallback log and the introspection functions of onednn.h.
#include "context.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>

#include <ruda/error.h>

#include <oneapi/dnnl/dnnl_debug.h>

#include "eigen/kernel_util.h"
#include "onednn.h"

#ifdef RUDA_HAVE_OPENMP
#include <omp.h>
#endif

namespace ruda::onednn {
namespace detail {

const dnnl::engine& cpu_engine() {
  static const dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

std::optional<dnnl::memory::data_type> dnnl_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return dnnl::memory::data_type::f32;
    case DType::bf16:
      return dnnl::memory::data_type::bf16;
    case DType::f16:
      return dnnl::memory::data_type::f16;
    default:
      return std::nullopt;
  }
}

// --- keys ---

Key& Key::operator<<(float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return *this << std::int64_t{bits};
}

bool Key::operator==(const Key& other) const {
  return size_ == other.size_ && std::equal(values_.begin(), values_.begin() + size_, other.values_.begin());
}

std::size_t Key::hash() const {
  // FNV-1a over the 64-bit words, then a final avalanche (splitmix64) so that keys differing in
  // one small dimension spread over the buckets.
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < size_; ++i) {
    h ^= static_cast<std::uint64_t>(values_[i]);
    h *= 0x100000001b3ull;
  }
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return static_cast<std::size_t>(h);
}

void Key::overflow() { fail<BackendError>("onednn", "primitive cache key exceeds its capacity (an internal error)"); }

// --- the cache ---

namespace {

std::size_t initial_capacity() { return cache_capacity_from(std::getenv("RUDA_ONEDNN_CACHE_CAPACITY")); }

struct Cache {
  std::shared_mutex mutex;
  std::unordered_map<Key, std::shared_ptr<const Primitive>, KeyHash> map;
  std::atomic<std::size_t> capacity{initial_capacity()};
  std::atomic<std::int64_t> created{0}, refused{0}, hits{0}, executions{0};
  // Primitives built per (primitive kind, oneDNN implementation), for implementations().
  std::mutex built_mutex;
  std::map<std::pair<std::string, std::string>, std::int64_t> built;
};

// Never destroyed: primitives may be in use by threads still running while statics are torn down,
// and oneDNN's own globals may already be gone by then.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

// Drops the entries no lookup touched since the previous sweep (second-chance eviction: no list
// to update on every hit, so hits stay under the shared lock). Called with the unique lock held.
void sweep(Cache& c) {
  for (auto it = c.map.begin(); it != c.map.end();) {
    if (it->second->recently_used.exchange(false, std::memory_order_relaxed)) {
      ++it;
    } else {
      it = c.map.erase(it);
    }
  }
}

}  // namespace

std::shared_ptr<const Primitive> find_cached(const Key& key) {
  Cache& c = cache();
  std::shared_lock lock(c.mutex);
  const auto it = c.map.find(key);
  if (it == c.map.end()) return nullptr;
  it->second->recently_used.store(true, std::memory_order_relaxed);
  c.hits.fetch_add(1, std::memory_order_relaxed);
  return it->second;
}

std::shared_ptr<const Primitive> insert_cached(const Key& key, std::shared_ptr<Primitive> p) {
  Cache& c = cache();
  std::unique_lock lock(c.mutex);
  // Another thread may have built the same primitive meanwhile: keep the first, so every thread
  // runs one object.
  if (const auto it = c.map.find(key); it != c.map.end()) return it->second;
  const std::size_t capacity = c.capacity.load(std::memory_order_relaxed);
  if (c.map.size() >= capacity) sweep(c);
  if (c.map.size() >= capacity) c.map.clear();  // all were in use since the last sweep
  c.map.emplace(key, p);
  return p;
}

std::shared_ptr<Primitive> refuse(std::string reason) {
  cache().refused.fetch_add(1, std::memory_order_relaxed);
  auto p = std::make_shared<Primitive>();
  p->refusal = std::move(reason);
  return p;
}

// oneDNN 2.6 does not check the allocation of the buffer it generates a primitive's code into:
// where the system refuses it (an address-space limit, ulimit -v or a batch system's h_vmem, near
// its end) the creation crashed inside libdnnl (SIGSEGV) instead of failing. Before creating one,
// the system must grant this much more address space (reserved, never touched, and given back);
// otherwise an OutOfMemoryError says why. A primitive's code and its creation's own buffers take
// far less: the guard costs one mmap/munmap per primitive created, and primitives are cached.
constexpr std::size_t kJitHeadroom = std::size_t{16} << 20;

static void require_jit_headroom() {
  void* p = ::mmap(nullptr, kJitHeadroom, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) primitive_memory_refused();
  ::munmap(p, kJitHeadroom);
}

void primitive_memory_refused() {
  fail<OutOfMemoryError>("onednn",
                         "creating a primitive: out of memory: the system refused memory oneDNN "
                         "allocates itself");
}

std::shared_ptr<Primitive> refusal_of(const dnnl::error& e) {
  // Out of memory is no property of the configuration: raised, never cached as a refusal (which
  // would send every later call of this shape to the Eigen kernel).
  if (e.status == dnnl_out_of_memory) primitive_memory_refused();
  if (e.status == dnnl_unimplemented) return refuse("oneDNN has no implementation for this configuration on this CPU");
  return refuse(std::string("oneDNN rejected the configuration: ") + e.what());
}

std::shared_ptr<Primitive> make_primitive(const dnnl::primitive_desc& pd, const std::vector<int>& arg_ids) {
  const char* impl = pd.impl_info_str();
  if (std::strncmp(impl, "ref", 3) == 0) {
    return refuse("oneDNN offers only its reference kernel here (" + std::string(impl) +
                  "), slower than the Eigen kernel");
  }
  require_jit_headroom();
  auto p = std::make_shared<Primitive>();
  p->primitive = dnnl::primitive(pd);
  p->defers_signals = std::strncmp(impl, "gemm:jit", 8) == 0;
  for (int id : arg_ids) p->args.emplace_back(id, pd.query_md(dnnl::query::exec_arg_md, id));
  p->scratchpad = pd.scratchpad_desc();
  Cache& c = cache();
  c.created.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(c.built_mutex);  // creation is rare: a lock here costs nothing per call
  ++c.built[{dnnl_prim_kind2str(static_cast<dnnl_primitive_kind_t>(pd.get_kind())), impl}];
  return p;
}

// A primitive descriptor walks its candidates in place, so the first choice is made apart.
dnnl::matmul::primitive_desc matmul_impl(const dnnl::matmul::desc& desc, const dnnl::primitive_attr& attr,
                                         std::string_view prefix) {
  dnnl::matmul::primitive_desc walker(desc, attr, cpu_engine());
  do {
    if (std::string_view(walker.impl_info_str()).substr(0, prefix.size()) == prefix) return walker;
  } while (walker.next_impl());
  return dnnl::matmul::primitive_desc(desc, attr, cpu_engine());
}

// --- execution ---

namespace {

dnnl::stream& thread_stream() {
  // One in-order stream per thread: a CPU stream runs primitives on the calling thread, and
  // giving each thread its own keeps concurrent ranks from sharing one.
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

// The scratchpad of the calling thread, grown to the largest request: primitives are built with
// a user scratchpad so that executions take no scratch memory of their own (oneDNN's gemm:jit
// path may still allocate its packing buffers inside), and a thread runs one primitive at a time.
void* thread_scratchpad(std::size_t bytes) {
  thread_local kernels::Scratch<std::byte> buffer;  // on 64-byte boundaries
  if (buffer.size() < bytes) {
    buffer = {};  // the old one freed before the larger one is allocated
    buffer.resize(bytes);
  }
  return buffer.data();
}

void check(dnnl_status_t status, const char* what) {
  if (status == dnnl_out_of_memory) {
    // oneDNN's own allocations (its gemm path's packing buffers, a memory object), refused by the
    // system: out of memory like any other refusal, which callers (auto-fit) catch as such.
    fail<OutOfMemoryError>("onednn", what, ": out of memory: the system refused memory oneDNN allocates itself");
  }
  if (status != dnnl_success)
    fail<BackendError>("onednn", what, " failed with oneDNN status ", static_cast<int>(status));
}

// The memory objects a thread last used with one primitive. Creating a dnnl_memory_t costs about
// as much as running a small kernel (an allocation each), so a thread keeps them for the
// primitives it runs and only points them at the new buffers (set_data_handle, ~5 ns).
class Binding {
 public:
  Binding() = default;
  Binding(const Binding&) = delete;
  Binding& operator=(const Binding&) = delete;
  ~Binding() { release(); }

  bool bound_to(const Primitive* p) const { return primitive_.get() == p; }

  void bind(const std::shared_ptr<const Primitive>& p, std::initializer_list<Arg> args) {
    release();
    for (const Arg& arg : args) {
      const auto it = std::find_if(p->args.begin(), p->args.end(), [&](const auto& a) { return a.first == arg.index; });
      if (it == p->args.end())
        fail<BackendError>("onednn", "argument ", arg.index, " was not recorded for this primitive");
      add(arg.index, it->second);
    }
    if (p->scratchpad.get_size() > 0) add(DNNL_ARG_SCRATCHPAD, p->scratchpad);
    primitive_ = p;  // keeps the primitive (and so the descriptors) alive while bound
  }

  // Points the memory objects at this call's buffers (same arguments, same order as bound).
  void point(std::initializer_list<Arg> args, dnnl_stream_t stream, std::size_t scratchpad_bytes) {
    int i = 0;
    for (const Arg& arg : args) {
      if (i >= count_ || args_[i].arg != arg.index)
        fail<BackendError>("onednn", "arguments differ between calls of one primitive");
      check(dnnl_memory_set_data_handle_v2(args_[i].memory, const_cast<void*>(arg.data), stream), "set_data_handle");
      ++i;
    }
    if (scratchpad_bytes > 0) {
      check(dnnl_memory_set_data_handle_v2(args_[i].memory, thread_scratchpad(scratchpad_bytes), stream),
            "set_data_handle");
    }
  }

  int count() const { return count_; }
  const dnnl_exec_arg_t* args() const { return args_; }

 private:
  void add(int index, const dnnl::memory::desc& md) {
    if (count_ == kMax) fail<BackendError>("onednn", "too many execution arguments");
    dnnl_memory_t m = nullptr;
    check(dnnl_memory_create(&m, &md.data, cpu_engine().get(), DNNL_MEMORY_NONE), "memory creation");
    args_[count_++] = dnnl_exec_arg_t{index, m};
  }
  void release() {
    for (int i = 0; i < count_; ++i) dnnl_memory_destroy(args_[i].memory);
    count_ = 0;
    primitive_.reset();
  }

  static constexpr int kMax = 12;
  std::shared_ptr<const Primitive> primitive_;
  dnnl_exec_arg_t args_[kMax] = {};
  int count_ = 0;
};

// This thread's bindings, direct-mapped by primitive address: a training step's few dozen
// primitives each keep their slot from one step to the next.
Binding& binding_for(const Primitive* p) {
  constexpr std::size_t kSlots = 128;
  thread_local std::array<Binding, kSlots> slots;
  const auto h = reinterpret_cast<std::uintptr_t>(p);
  return slots[(h >> 6 ^ h >> 13) % kSlots];
}

// The asynchronous signals: all but those a fault raises on the thread that caused it (blocked,
// they would end the process rather than wait) and the two no thread can block.
const sigset_t& asynchronous_signals() {
  static const sigset_t set = [] {
    sigset_t s;
    sigfillset(&s);
    for (const int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT, SIGKILL, SIGSTOP}) {
      sigdelset(&s, fault);
    }
    return s;
  }();
  return set;
}

// oneDNN 2.6's f32 gemm:jit kernels point the stack pointer at a heap workspace (on AVX-512 when
// K > 84; oneDNN issue 4845, fixed in 3.11), so a signal handled on a thread running one wrote
// the handler's frame over the heap: the next free() aborted ("munmap_chunk(): invalid pointer";
// ruda-train stopped by SIGTERM did, 3 runs in ~45), or a saved tensor read garbage. While a
// shield lives the calling thread defers asynchronous signals (a handler runs when it ends, after
// the product), and the OpenMP workers that run parts of the product never take them: blocked for
// good, once per team size of each calling thread (the process's other threads, or the caller
// between products, take process-directed signals; a signal sent to a worker itself waits).
class SignalShield {
 public:
  SignalShield(bool active, [[maybe_unused]] int threads) : active_(active && !t_blocked_for_good) {
    if (!active_) return;
    pthread_sigmask(SIG_BLOCK, &asynchronous_signals(), &previous_);
#ifdef RUDA_HAVE_OPENMP
    thread_local int shielded_team = 1;
    if (threads > shielded_team && !omp_in_parallel()) {
#pragma omp parallel num_threads(threads)
      if (omp_get_thread_num() != 0) {
        pthread_sigmask(SIG_BLOCK, &asynchronous_signals(), nullptr);
        t_blocked_for_good = true;  // (its products then skip the two system calls)
      }
      shielded_team = threads;
    }
#endif
  }
  ~SignalShield() {
    if (active_) pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  SignalShield(const SignalShield&) = delete;
  SignalShield& operator=(const SignalShield&) = delete;

 private:
  static thread_local bool t_blocked_for_good;
  bool active_;
  sigset_t previous_{};
};
thread_local bool SignalShield::t_blocked_for_good = false;

}  // namespace

void execute(const std::shared_ptr<const Primitive>& p, std::initializer_list<Arg> args) {
  dnnl::stream& stream = thread_stream();
  Binding& binding = binding_for(p.get());
  if (!binding.bound_to(p.get())) binding.bind(p, args);
  binding.point(args, stream.get(), p->scratchpad.get_size());
  {
    const SignalShield shield(p->defers_signals, p->threads);
    ThreadScope scope(p->threads);
    check(dnnl_primitive_execute(p->primitive.get(), stream.get(), binding.count(), binding.args()),
          "primitive execution");
    check(dnnl_stream_wait(stream.get()), "stream wait");
  }
  cache().executions.fetch_add(1, std::memory_order_relaxed);
}

// --- threads ---

ThreadScope::ThreadScope(int threads) {
#ifdef RUDA_HAVE_OPENMP
  ruda::num_threads();  // applies ruda's count to this thread's OpenMP state if not done yet
  const int current = omp_get_max_threads();
  if (threads != current) {
    omp_set_num_threads(threads);
    restore_ = current;
  }
#else
  (void)threads;
#endif
}

ThreadScope::~ThreadScope() {
#ifdef RUDA_HAVE_OPENMP
  if (restore_ > 0) omp_set_num_threads(restore_);
#endif
}

bool all_kernels_requested() {
  static const bool all = [] {
    const char* env = std::getenv("RUDA_ONEDNN_KERNELS");
    if (!env || !*env) return false;
    if (std::string_view(env) == "all") return true;
    std::fprintf(stderr, "ruda: ignoring RUDA_ONEDNN_KERNELS='%s': the one setting is all\n", env);
    return false;
  }();
  return all;
}

int threads_for(std::int64_t elements) {
  // Below ~32k values a single thread finishes an elementwise kernel in about the time it takes
  // to wake an OpenMP team (a few microseconds), the same grain the Eigen kernels use.
  constexpr std::int64_t kGrain = 32768;
  const std::int64_t wanted = std::max<std::int64_t>(1, (elements + kGrain - 1) / kGrain);
  return static_cast<int>(std::min<std::int64_t>(ruda::num_threads(), wanted));
}

int threads_for_flops(double flops) {
  // ~4 MFLOP is tens of microseconds on one core: less than that is not worth a second thread.
  constexpr double kGrain = 4.0 * (1 << 20);
  const double wanted = std::max(1.0, std::ceil(flops / kGrain));
  return static_cast<int>(std::min<double>(ruda::num_threads(), wanted));
}

// --- fallbacks ---

std::string dims_string(const dnnl::memory::dims& dims) {
  std::string out = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

namespace {

struct FallbackLog {
  std::mutex mutex;
  std::set<std::tuple<std::string, std::string, std::string>, std::less<>> seen;
  std::vector<Fallback> in_order;
  const bool print = [] {
    const char* env = std::getenv("RUDA_LOG");
    if (!env || !*env) return false;
    if (std::string_view(env) == "debug") return true;
    // Said, not ignored in silence (as the other RUDA_* variables are): a misspelt level printed nothing.
    std::fprintf(stderr, "ruda: ignoring RUDA_LOG='%s': the one level is debug\n", env);
    return false;
  }();
};

FallbackLog& fallback_log() {
  static FallbackLog* log = new FallbackLog;  // used from any thread until exit
  return *log;
}

}  // namespace

void note_fallback(std::string_view op, DType dtype, std::string_view reason) {
  FallbackLog& log = fallback_log();
  const std::string_view type = dtype_name(dtype);
  std::lock_guard lock(log.mutex);
  if (log.seen.find(std::tuple(op, type, reason)) != log.seen.end()) return;
  // Some reasons name the shapes refused, so a program whose shapes keep changing found new ones
  // without end (0.74 KB each: 25 MB after 38000 shapes, while the primitive cache stays bounded).
  if (log.in_order.size() >= kMaxFallbacks) {
    if (log.in_order.size() == kMaxFallbacks) {
      log.in_order.push_back(Fallback{"(any)", "(any)",
                                      "the log is full: later fallbacks (" + std::to_string(kMaxFallbacks) +
                                          " distinct ones recorded) are neither recorded nor printed"});
      if (log.print) std::fprintf(stderr, "ruda[onednn] fallback: %s\n", log.in_order.back().reason.c_str());
    }
    return;
  }
  log.seen.emplace(std::string(op), std::string(type), std::string(reason));
  log.in_order.push_back(Fallback{std::string(op), std::string(type), std::string(reason)});
  if (log.print) {
    std::fprintf(stderr, "ruda[onednn] fallback: %.*s (%.*s): %.*s\n", static_cast<int>(op.size()), op.data(),
                 static_cast<int>(type.size()), type.data(), static_cast<int>(reason.size()), reason.data());
  }
}

}  // namespace detail

// --- introspection (onednn.h) ---

Stats stats() {
  detail::Cache& c = detail::cache();
  Stats s;
  s.primitives_created = c.created.load(std::memory_order_relaxed);
  s.refusals = c.refused.load(std::memory_order_relaxed);
  s.cache_hits = c.hits.load(std::memory_order_relaxed);
  s.executions = c.executions.load(std::memory_order_relaxed);
  std::shared_lock lock(c.mutex);
  s.cached = static_cast<std::int64_t>(c.map.size());
  return s;
}

std::int64_t primitives_created() { return stats().primitives_created; }

std::size_t cache_capacity() { return detail::cache().capacity.load(std::memory_order_relaxed); }

// A whole number of entries, at least 1. atol read "abc" as 0 and "1e3" as 1 (silently the
// default, or a cache of one entry); a text that is no count keeps the default with a warning:
// this runs inside the first oneDNN call, where an error would name an unrelated op.
std::size_t cache_capacity_from(const char* text) {
  constexpr std::size_t kDefault = 4096;
  if (!text || !*text) return kDefault;
  std::size_t n = 0;
  const char* end = text + std::strlen(text);
  const auto [at, error] = std::from_chars(text, end, n);
  if (error == std::errc() && at == end && n > 0) return n;
  std::fprintf(stderr, "ruda: ignoring RUDA_ONEDNN_CACHE_CAPACITY='%s': not a whole number of entries of at least 1\n",
               text);
  return kDefault;
}

void set_cache_capacity(std::size_t entries) {
  if (entries == 0) fail<ArgumentError>("onednn::set_cache_capacity", "the capacity must be positive");
  detail::Cache& c = detail::cache();
  c.capacity.store(entries, std::memory_order_relaxed);
  std::unique_lock lock(c.mutex);
  while (c.map.size() > entries) c.map.erase(c.map.begin());
}

std::string cpu_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::all:
      return "all";
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
  }
  return "unknown";
}

bool all_kernels() { return detail::all_kernels_requested(); }

bool bf16_native() {
  // ISA values are bit sets of their features: an ISA has native bf16 when it contains every bit
  // of avx512_core_bf16 (AMX does; avx512_core only emulates bf16, avx2 has none in oneDNN 2.6).
  static const bool native = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (isa & bf16) == bf16;
  }();
  return native;
}

std::vector<Implementation> implementations() {
  detail::Cache& c = detail::cache();
  std::lock_guard lock(c.built_mutex);
  std::vector<Implementation> out;
  for (const auto& [kind_impl, count] : c.built) out.push_back({kind_impl.first, kind_impl.second, count});
  return out;
}

std::vector<Fallback> fallbacks() {
  detail::FallbackLog& log = detail::fallback_log();
  std::lock_guard lock(log.mutex);
  return log.in_order;
}

}  // namespace ruda::onednn
