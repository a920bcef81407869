// What the MPI communicator's files share (internal to ruda_mpi): MPI errors as CollectiveError,
// ruda's dtypes as MPI types, MPI's int counts, and a reusable scratch buffer.
#pragma once

#include <mpi.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include <ruda/collectives.h>
#include <ruda/dtype.h>
#include <ruda/error.h>

namespace ruda::mpi_detail {

inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

inline void check(int code, const char* call) {
  if (code != MPI_SUCCESS) throw CollectiveError(std::string(call) + " failed: " + mpi_error_text(code));
}

// 16-bit floats travel as raw 16-bit words: MPI has no bf16, and only ruda's operations read them.
inline MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i64:
      return MPI_INT64_T;
    case DType::bf16:
    case DType::f16:
      return MPI_UINT16_T;
    case DType::boolean:
      break;
  }
  throw CollectiveError("no MPI type for dtype " + std::string(dtype_name(dtype)));
}

// MPI counts are int. Elementwise operations go in pieces of at most this many elements.
inline constexpr std::int64_t kMaxCount = INT_MAX;

inline int int_count(std::int64_t count, const char* call) {
  if (count > kMaxCount) {
    throw CollectiveError(std::string(call) + ": " + std::to_string(count) +
                          " elements per rank exceed MPI's count limit of " + std::to_string(kMaxCount));
  }
  return static_cast<int>(count);
}

// A lock for state held for a few stores at a time (BasicLockable, for std::lock_guard):
// uncontended, one atomic exchange and one store, where a mutex costs about twice that. A waiter
// yields after a while, so a holder that was preempted on a busy machine gets to finish.
class SpinLock {
 public:
  void lock() noexcept {
    for (int spins = 0; locked_.exchange(true, std::memory_order_acquire); ++spins) {
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins > 64) std::this_thread::yield();
      }
    }
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

// A 64-byte aligned scratch buffer that grows on demand and is reused from call to call.
class Buffer {
 public:
  std::byte* get(std::size_t bytes) {
    if (bytes > size_) {
      const std::size_t rounded = (bytes + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, rounded);
      if (!p)
        fail<OutOfMemoryError>("MPI collective", "out of memory: the system refused a ", rounded,
                               "-byte scratch buffer");
      data_.reset(static_cast<std::byte*>(p));
      size_ = rounded;
    }
    return data_.get();
  }
  std::size_t size() const noexcept { return size_; }
  void release() noexcept {
    data_.reset();
    size_ = 0;
  }

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t size_ = 0;
};

}  // namespace ruda::mpi_detail
