// Internals shared by the oneDNN kernels: the engine, per-thread streams and scratchpads, the
// primitive cache, intra-op thread control and the fallback log. Private to backends/onednn; the
// only file set that includes oneDNN's headers.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ruda/backend.h>
#include <oneapi/dnnl/dnnl.hpp>

namespace ruda::onednn::detail {

/// The process's CPU engine (thread-safe in oneDNN; created on first use, never destroyed so that
/// no primitive outlives it during static destruction).
const dnnl::engine& cpu_engine();

/// The oneDNN data type of a ruda dtype, if oneDNN has one (no f64, i64 or bool in oneDNN 2.x).
std::optional<dnnl::memory::data_type> dnnl_type(DType dtype);

// --- primitive cache ---

/// What identifies a primitive: op kind, algorithm, dtypes, dims, strides, attributes and the
/// thread count it is built for, as a flat list of integers.
class Key {
 public:
  Key& operator<<(std::int64_t v) {
    if (size_ == values_.size()) overflow();
    values_[size_++] = v;
    return *this;
  }
  Key& operator<<(float v);  // by bit pattern, so alpha = 1 and alpha = 1 + ulp differ
  bool operator==(const Key& other) const;
  std::size_t hash() const;

 private:
  [[noreturn]] static void overflow();
  std::array<std::int64_t, 80> values_{};
  std::size_t size_ = 0;
};

/// A built primitive with the memory descriptors of its execution arguments, or the reason oneDNN
/// cannot run that configuration (a refusal is cached like a primitive, so it is asked once).
struct Primitive {
  dnnl::primitive primitive;
  std::vector<std::pair<int, dnnl::memory::desc>> args;  // execution argument index -> descriptor
  dnnl::memory::desc scratchpad;                         // empty when none is needed
  int threads = 1;                                       // the OpenMP team it was built and runs with
  bool defers_signals = false;                           // a gemm:jit kernel (context.cpp, SignalShield)
  std::string refusal;                                   // non-empty: oneDNN cannot run it
  mutable std::atomic<bool> recently_used{true};         // for the cache's eviction sweep

  bool refused() const { return !refusal.empty(); }
};

/// Builds a primitive from its descriptor: rejects oneDNN's reference ("ref:") implementations,
/// which are scalar loops slower than the Eigen kernels, and records the descriptors of `arg_ids`.
std::shared_ptr<Primitive> make_primitive(const dnnl::primitive_desc& pd, const std::vector<int>& arg_ids);

/// oneDNN's matmul implementation of `desc` whose name starts with `prefix` (e.g. "gemm:"), else
/// its first choice. `desc` must outlive the call: oneDNN 2.6's next_impl() reads the operation
/// descriptor again (walking from a temporary found nothing past the first candidate).
dnnl::matmul::primitive_desc matmul_impl(const dnnl::matmul::desc& desc, const dnnl::primitive_attr& attr,
                                         std::string_view prefix);
/// A refusal with that reason.
std::shared_ptr<Primitive> refuse(std::string reason);

/// The primitive of `key`, built by `make` (returning std::shared_ptr<Primitive>) on a miss while
/// the OpenMP thread count is `threads`. A dnnl::error thrown by `make` becomes a cached refusal.
/// Thread-safe; `make` runs outside the lock.
template <class Make>
std::shared_ptr<const Primitive> lookup(Key key, int threads, Make&& make);

// --- execution ---

/// One execution argument: oneDNN's argument index and the buffer.
struct Arg {
  int index;
  const void* data;
};

/// Runs a cached primitive on this thread's stream with its OpenMP team size, and waits for it.
/// `args` must name the same arguments on every call for one primitive.
void execute(const std::shared_ptr<const Primitive>& p, std::initializer_list<Arg> args);

// --- sizes and threads ---

/// Below this many values an elementwise, softmax or reduction kernel runs on Eigen: a oneDNN
/// call costs about half a microsecond however small the tensor, more than Eigen needs for a few
/// thousand values (measured on this project's AVX-512 machine).
inline constexpr std::int64_t kMinElements = 4096;
/// Below this many multiply-adds (batch * m * n * k) a product runs on Eigen, for the same reason.
inline constexpr std::int64_t kMinProduct = 8192;
/// The note for kernels that stay on Eigen for their size.
inline constexpr std::string_view kSmallReason = "a small tensor: Eigen beats oneDNN's fixed cost per call";

/// Whether RUDA_ONEDNN_KERNELS=all asks for every kernel oneDNN can run, including those where
/// the Eigen kernel was measured faster (see kernel_policy.h).
bool all_kernels_requested();

/// Threads for an elementwise-like kernel over `elements` values: ruda's intra-op count for this
/// thread, fewer when the work is too small to amortize waking an OpenMP team.
int threads_for(std::int64_t elements);
/// The same for a product of `flops` floating-point operations.
int threads_for_flops(double flops);

// --- visibility of fallbacks ---

/// "[2, 3]": dimensions for messages.
std::string dims_string(const dnnl::memory::dims& dims);

/// Records that `op` on `dtype` did not run as a native oneDNN primitive and why; prints it to
/// stderr once when RUDA_LOG=debug.
void note_fallback(std::string_view op, DType dtype, std::string_view reason);

// --- implementation of lookup ---

struct KeyHash {
  std::size_t operator()(const Key& k) const { return k.hash(); }
};

std::shared_ptr<const Primitive> find_cached(const Key& key);
std::shared_ptr<const Primitive> insert_cached(const Key& key, std::shared_ptr<Primitive> p);
std::shared_ptr<Primitive> refusal_of(const dnnl::error& e);
/// OutOfMemoryError for a primitive whose creation the system refused memory.
[[noreturn]] void primitive_memory_refused();

/// Sets the calling thread's OpenMP team size (which oneDNN reads) for its lifetime, then restores
/// the previous one.
class ThreadScope {
 public:
  explicit ThreadScope(int threads);
  ~ThreadScope();
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  int restore_ = 0;
};

template <class Make>
std::shared_ptr<const Primitive> lookup(Key key, int threads, Make&& make) {
  key << std::int64_t{threads};
  if (auto hit = find_cached(key)) return hit;
  std::shared_ptr<Primitive> built;
  {
    // Some implementations (brgemm matmul) size their thread partition when created.
    ThreadScope scope(threads);
    try {
      built = make();
    } catch (const dnnl::error& e) {
      built = refusal_of(e);  // (OutOfMemoryError where oneDNN ran out of memory)
    } catch (const std::bad_alloc&) {
      primitive_memory_refused();
    }
  }
  built->threads = threads;
  return insert_cached(key, std::move(built));
}

}  // namespace ruda::onednn::detail
