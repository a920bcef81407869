// The MPI communicator: MPI collectives where they are good, a ring of ruda's own for
// reduce_scatter, a progress thread for the non-blocking forms, and typed errors throughout.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <future>
#include <mutex>
#include <thread>

#include <ruda/mpi.h>

#include "internal.h"

namespace ruda {

namespace {

namespace cd = collectives_detail;

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

void check(int code, const char* call) {
  if (code != MPI_SUCCESS) throw CollectiveError(std::string(call) + " failed: " + mpi_error_text(code));
}

// 16-bit floats travel as raw 16-bit words: MPI has no bf16, and only ruda's operations read them.
MPI_Datatype mpi_type(DType dtype) {
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
constexpr std::int64_t kMaxCount = INT_MAX;

int int_count(std::int64_t count, const char* call) {
  if (count > kMaxCount) {
    throw CollectiveError(std::string(call) + ": " + std::to_string(count) +
                          " elements per rank exceed MPI's count limit of " + std::to_string(kMaxCount));
  }
  return static_cast<int>(count);
}

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

// User-defined MPI operations: inout = in (op) inout, on ruda's kernels (NaN-propagating max,
// 16-bit sums rounded at every step).
template <DType D>
void max_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const void* sources[2] = {inout, in};
  cd::max(sources, 2, inout, *len, D);
}
template <DType D>
void native_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const void* sources[2] = {inout, in};
  cd::sum(sources, 2, inout, *len, D, Accumulate::native);
}

// The ring's segments: small enough that a received segment is still in cache when it is added,
// large enough that per-message costs vanish.
constexpr std::int64_t kSegmentBytes = 512 * 1024;
// A reduce_scatter of at most this many bytes in all uses MPI_Reduce_scatter_block instead.
constexpr std::size_t kSmallBytes = 64 * 1024;
constexpr int kRingTag = 7001;

}  // namespace

// --- MpiEnvironment ---

MpiEnvironment::MpiEnvironment() { init(nullptr, nullptr); }
MpiEnvironment::MpiEnvironment(int& argc, char**& argv) { init(&argc, &argv); }

void MpiEnvironment::init(int* argc, char*** argv) {
  uncaught_ = std::uncaught_exceptions();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) throw CollectiveError("MpiEnvironment: MPI was finalized already and cannot start again");
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    MPI_Query_thread(&provided);
  } else {
    check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    owns_ = true;
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    if (owns_) MPI_Finalize();
    owns_ = false;
    throw CollectiveError("MpiEnvironment: MPI provides thread level " + std::to_string(provided) +
                          ", ruda needs MPI_THREAD_MULTIPLE (" + std::to_string(MPI_THREAD_MULTIPLE) +
                          ") for its progress thread");
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiEnvironment::~MpiEnvironment() {
  if (std::uncaught_exceptions() > uncaught_) return;  // unwinding: see the class comment
  if (owns_ && active()) MPI_Finalize();
}

bool MpiEnvironment::active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

int MpiEnvironment::world_rank() const {
  int rank = 0;
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  return rank;
}

int MpiEnvironment::world_size() const {
  int size = 0;
  check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  return size;
}

// --- MpiCommunicator::Impl ---

struct MpiCommunicator::Impl {
  MPI_Comm data = MPI_COMM_NULL;     // collectives and the ring's messages
  MPI_Comm control = MPI_COMM_NULL;  // the order check's fingerprints
  int rank = 0, size = 1;
  MPI_Op max_f32 = MPI_OP_NULL, max_f64 = MPI_OP_NULL, max_bf16 = MPI_OP_NULL, max_f16 = MPI_OP_NULL;
  MPI_Op sum_bf16 = MPI_OP_NULL, sum_f16 = MPI_OP_NULL;
  Buffer partial, incoming, staging, wide;

  // The progress thread and its queue. Tasks run in the order they were started.
  struct Task {
    std::function<void()> run;
    std::promise<void> done;
  };
  std::mutex mutex;
  std::condition_variable wake;  // the worker: a task arrived or stop
  std::condition_variable idle;  // drain(): the queue emptied
  std::deque<std::shared_ptr<Task>> queue;
  bool busy = false, stop = false;
  std::string failed;  // the error of a non-blocking collective that failed, if any
  std::thread worker;

  explicit Impl(MPI_Comm parent) {
    if (!MpiEnvironment::active()) {
      throw CollectiveError("MpiCommunicator: MPI is not initialized (create a ruda::MpiEnvironment first)");
    }
    try {
      create(parent);
    } catch (...) {
      release();
      throw;
    }
  }

  ~Impl() {
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    wake.notify_all();
    if (worker.joinable()) worker.join();
    release();
  }

  void create(MPI_Comm parent) {
    check(MPI_Comm_dup(parent, &data), "MPI_Comm_dup");
    check(MPI_Comm_dup(parent, &control), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(data, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(control, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(data, &rank), "MPI_Comm_rank");
    check(MPI_Comm_size(data, &size), "MPI_Comm_size");
    check(MPI_Op_create(&max_op<DType::f32>, 1, &max_f32), "MPI_Op_create");
    check(MPI_Op_create(&max_op<DType::f64>, 1, &max_f64), "MPI_Op_create");
    check(MPI_Op_create(&max_op<DType::bf16>, 1, &max_bf16), "MPI_Op_create");
    check(MPI_Op_create(&max_op<DType::f16>, 1, &max_f16), "MPI_Op_create");
    check(MPI_Op_create(&native_sum_op<DType::bf16>, 1, &sum_bf16), "MPI_Op_create");
    check(MPI_Op_create(&native_sum_op<DType::f16>, 1, &sum_f16), "MPI_Op_create");
  }

  void release() noexcept {
    if (!MpiEnvironment::active()) return;  // finalized: MPI freed everything
    for (MPI_Op* op : {&max_f32, &max_f64, &max_bf16, &max_f16, &sum_bf16, &sum_f16}) {
      if (*op != MPI_OP_NULL) MPI_Op_free(op);
    }
    if (data != MPI_COMM_NULL) MPI_Comm_free(&data);
    if (control != MPI_COMM_NULL) MPI_Comm_free(&control);
  }

  // --- progress thread ---

  std::shared_future<void> submit(std::function<void()> run) {
    auto task = std::make_shared<Task>();
    task->run = std::move(run);
    std::shared_future<void> future = task->done.get_future().share();
    {
      std::lock_guard lock(mutex);
      if (!worker.joinable()) worker = std::thread([this] { work(); });
      queue.push_back(std::move(task));
    }
    wake.notify_one();
    return future;
  }

  void work() {
    std::unique_lock lock(mutex);
    for (;;) {
      wake.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;
      std::shared_ptr<Task> task = std::move(queue.front());
      queue.pop_front();
      busy = true;
      const std::string earlier = failed;
      lock.unlock();
      try {
        // After a failure the ranks may disagree on what was done: run nothing more.
        if (!earlier.empty()) throw CollectiveError("not started: " + earlier);
        task->run();
        task->done.set_value();
      } catch (...) {
        std::string what = "unknown error";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        task->done.set_exception(std::current_exception());
        lock.lock();
        if (failed.empty()) failed = "an earlier non-blocking collective on this communicator failed: " + what;
        lock.unlock();
      }
      lock.lock();
      busy = false;
      if (queue.empty()) idle.notify_all();
    }
  }

  bool is_idle() {
    std::lock_guard lock(mutex);
    return queue.empty() && !busy;
  }

  // Waits for the collectives in flight: a blocking one must come after them on every rank, and
  // never run beside them on this MPI communicator.
  void drain() {
    std::unique_lock lock(mutex);
    idle.wait(lock, [&] { return queue.empty() && !busy; });
    if (!failed.empty()) throw CollectiveError(failed);
  }

  // --- collectives (run by the calling thread after drain(), or by the worker) ---

  void all_gather(const void* send, void* recv, std::int64_t count, DType dtype) {
    const int n = int_count(count, "MPI_Allgather");
    const MPI_Datatype type = mpi_type(dtype);
    check(MPI_Allgather(send, n, type, recv, n, type, data), "MPI_Allgather");
  }

  // A ring of size - 1 steps. In step s, this rank sends the running sum of block
  // (rank - s - 1) to the right and receives the running sum of block (rank - s - 2) from the
  // left, adding its own contribution; after the last step it holds the full sum of its own
  // block. Each step moves in segments, double-buffered: while one segment is added, the next
  // is already on its way. 16-bit data accumulated in f32 travels as f32 partial sums.
  void reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype, Accumulate accumulate) {
    const std::size_t esize = dtype_size(dtype);
    if (size == 1 || count == 0) {
      if (count > 0) std::memcpy(recv, send, static_cast<std::size_t>(count) * esize);
      return;
    }
    if (static_cast<std::size_t>(count) * static_cast<std::size_t>(size) * esize <= kSmallBytes) {
      small_reduce_scatter(send, recv, count, dtype, accumulate);
      return;
    }
    const DType ptype = cd::partial_type(dtype, accumulate);
    const std::size_t psize = dtype_size(ptype);
    const MPI_Datatype mpi_ptype = mpi_type(ptype);
    const int right = (rank + 1) % size, left = (rank + size - 1) % size;
    const std::int64_t seg = std::max<std::int64_t>(1, kSegmentBytes / static_cast<std::int64_t>(psize));
    const std::int64_t segments = (count + seg - 1) / seg;
    const std::size_t seg_bytes = static_cast<std::size_t>(seg) * psize;

    std::byte* running = size > 2 ? partial.get(static_cast<std::size_t>(count) * psize) : nullptr;
    std::byte* in = incoming.get(2 * seg_bytes);
    std::byte* stage = ptype != dtype ? staging.get(2 * seg_bytes) : nullptr;
    auto own = [&](int block, std::int64_t j) {
      return static_cast<const std::byte*>(send) +
             (static_cast<std::size_t>(block) * static_cast<std::size_t>(count) + static_cast<std::size_t>(j * seg)) *
                 esize;
    };

    for (int step = 0; step < size - 1; ++step) {
      const int send_block = (rank + 2 * size - step - 1) % size;
      const int recv_block = (rank + 2 * size - step - 2) % size;
      const bool last = step == size - 2;
      MPI_Request requests[2][2];
      auto length = [&](std::int64_t j) { return static_cast<int>(std::min(seg, count - j * seg)); };
      auto post = [&](std::int64_t j) {
        const int len = length(j);
        const int slot = static_cast<int>(j % 2);
        const void* out;
        if (step > 0) {
          out = running + static_cast<std::size_t>(j) * seg_bytes;
        } else if (stage) {
          std::byte* s = stage + static_cast<std::size_t>(slot) * seg_bytes;
          cd::convert(own(send_block, j), dtype, s, ptype, len);
          out = s;
        } else {
          out = own(send_block, j);
        }
        check(MPI_Irecv(in + static_cast<std::size_t>(slot) * seg_bytes, len, mpi_ptype, left, kRingTag, data,
                        &requests[slot][0]),
              "MPI_Irecv");
        check(MPI_Isend(out, len, mpi_ptype, right, kRingTag, data, &requests[slot][1]), "MPI_Isend");
      };
      post(0);
      for (std::int64_t j = 0; j < segments; ++j) {
        if (j + 1 < segments) post(j + 1);
        const int slot = static_cast<int>(j % 2);
        check(MPI_Waitall(2, requests[slot], MPI_STATUSES_IGNORE), "MPI_Waitall");
        const void* received = in + static_cast<std::size_t>(slot) * seg_bytes;
        if (last) {
          void* dst = static_cast<std::byte*>(recv) + static_cast<std::size_t>(j * seg) * esize;
          cd::add_partial(received, own(recv_block, j), dst, dtype, length(j), dtype, accumulate);
        } else {
          // Segment j of the running sum went out already (its send completed above).
          cd::add_partial(received, own(recv_block, j), running + static_cast<std::size_t>(j) * seg_bytes, ptype,
                          length(j), dtype, accumulate);
        }
      }
    }
  }

  // Small reductions are bound by latency, not bandwidth: MPI's own algorithm needs fewer rounds
  // than the ring's size - 1, and its temporary costs little at this size. 16-bit data
  // accumulated in f32 is widened first.
  void small_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype, Accumulate accumulate) {
    const int n = int_count(count, "MPI_Reduce_scatter_block");
    if (is_16bit_float(dtype) && accumulate == Accumulate::f32) {
      const std::size_t total = static_cast<std::size_t>(count) * static_cast<std::size_t>(size);
      float* w = reinterpret_cast<float*>(wide.get((total + static_cast<std::size_t>(count)) * sizeof(float)));
      cd::convert(send, dtype, w, DType::f32, static_cast<std::int64_t>(total));
      check(MPI_Reduce_scatter_block(w, w + total, n, MPI_FLOAT, MPI_SUM, data), "MPI_Reduce_scatter_block");
      cd::convert(w + total, DType::f32, recv, dtype, count);
      return;
    }
    MPI_Op op = MPI_SUM;
    if (dtype == DType::bf16) op = sum_bf16;
    if (dtype == DType::f16) op = sum_f16;
    check(MPI_Reduce_scatter_block(send, recv, n, mpi_type(dtype), op, data), "MPI_Reduce_scatter_block");
  }

  void all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op, Accumulate accumulate) {
    const bool half = is_16bit_float(dtype);
    if (half && op == Reduction::sum && accumulate == Accumulate::f32) {
      // Sum in f32 and round once: widen, reduce the f32 values, narrow.
      float* w = reinterpret_cast<float*>(wide.get(static_cast<std::size_t>(count) * sizeof(float)));
      cd::convert(send, dtype, w, DType::f32, count);
      allreduce_pieces(MPI_IN_PLACE, w, count, DType::f32, MPI_FLOAT, MPI_SUM);
      cd::convert(w, DType::f32, recv, dtype, count);
      return;
    }
    MPI_Op mpi_op = MPI_SUM;
    if (op == Reduction::max) {
      switch (dtype) {
        case DType::f32:
          mpi_op = max_f32;
          break;
        case DType::f64:
          mpi_op = max_f64;
          break;
        case DType::bf16:
          mpi_op = max_bf16;
          break;
        case DType::f16:
          mpi_op = max_f16;
          break;
        default:
          mpi_op = MPI_MAX;
          break;
      }
    } else if (half) {
      mpi_op = dtype == DType::bf16 ? sum_bf16 : sum_f16;
    }
    allreduce_pieces(send, recv, count, dtype, mpi_type(dtype), mpi_op);
  }

  void allreduce_pieces(const void* send, void* recv, std::int64_t count, DType dtype, MPI_Datatype type, MPI_Op op) {
    const std::size_t esize = dtype_size(dtype);
    for (std::int64_t offset = 0; offset < count || (count == 0 && offset == 0); offset += kMaxCount) {
      const int n = static_cast<int>(std::min(kMaxCount, count - offset));
      const void* s = send == MPI_IN_PLACE
                          ? MPI_IN_PLACE
                          : static_cast<const std::byte*>(send) + static_cast<std::size_t>(offset) * esize;
      check(
          MPI_Allreduce(s, static_cast<std::byte*>(recv) + static_cast<std::size_t>(offset) * esize, n, type, op, data),
          "MPI_Allreduce");
      if (count == 0) break;
    }
  }

  void broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root) {
    const std::size_t esize = dtype_size(dtype);
    if (rank == root && count > 0) std::memcpy(recv, send, static_cast<std::size_t>(count) * esize);
    for (std::int64_t offset = 0; offset < count || (count == 0 && offset == 0); offset += kMaxCount) {
      const int n = static_cast<int>(std::min(kMaxCount, count - offset));
      check(MPI_Bcast(static_cast<std::byte*>(recv) + static_cast<std::size_t>(offset) * esize, n, mpi_type(dtype),
                      root, data),
            "MPI_Bcast");
      if (count == 0) break;
    }
  }

  std::vector<std::string> exchange(const std::string& fingerprint) {
    constexpr std::size_t kRecordBytes = MpiCommunicator::kFingerprintBytes;
    std::vector<char> mine(kRecordBytes, '\0');
    std::memcpy(mine.data(), fingerprint.data(), std::min(fingerprint.size(), kRecordBytes - 1));
    std::vector<char> all(kRecordBytes * static_cast<std::size_t>(size));
    check(MPI_Allgather(mine.data(), static_cast<int>(kRecordBytes), MPI_CHAR, all.data(),
                        static_cast<int>(kRecordBytes), MPI_CHAR, control),
          "MPI_Allgather (order check)");
    std::vector<std::string> out;
    for (int r = 0; r < size; ++r) {
      const char* record = all.data() + static_cast<std::size_t>(r) * kRecordBytes;
      out.emplace_back(record, strnlen(record, kRecordBytes));
    }
    return out;
  }
};

// A non-blocking collective queued on the progress thread. It holds the input and the output,
// so both stay alive until the collective is done even if the caller drops the Work.
class QueuedState final : public Work::State {
 public:
  QueuedState(std::shared_future<void> done, Tensor out) : done_(std::move(done)), out_(std::move(out)) {}
  Tensor wait() override {
    done_.get();  // rethrows the collective's error
    return std::move(out_);
  }
  bool ready() override { return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }

 private:
  std::shared_future<void> done_;
  Tensor out_;
};

// --- MpiCommunicator ---

MpiCommunicator::MpiCommunicator() : MpiCommunicator(std::make_unique<Impl>(MPI_COMM_WORLD)) {}

MpiCommunicator::MpiCommunicator(std::unique_ptr<Impl> impl)
    : Communicator(impl->rank, impl->size), impl_(std::move(impl)) {}

MpiCommunicator::~MpiCommunicator() {
  if (!impl_) return;
  if (std::uncaught_exceptions() > 0) {
    // Unwinding after an error: the other ranks may be anywhere, so neither wait for the
    // collectives in flight nor run the final order check, either could hang. With work still
    // in flight the communicator cannot be freed safely; leave it (the process is about to end:
    // mpi_abort_on_exception aborts the job).
    if (!impl_->is_idle()) (void)impl_.release();
    return;
  }
  try {
    impl_->drain();
  } catch (const std::exception&) {
    // Its error was reported to whoever waited for it.
  }
  if (order_check() && MpiEnvironment::active()) {
    // A last fingerprint: a rank that skipped the final collectives meets the others here, and
    // both sides learn of it instead of waiting forever.
    const std::string end = cd::numbered(current_sequence() + 1, "end of communicator");
    try {
      const std::vector<std::string> all = impl_->exchange(end);
      if (std::any_of(all.begin(), all.end(), [&](const std::string& f) { return f != end; })) {
        std::vector<std::string> calls;
        for (const auto& f : all) {
          auto [n, text] = cd::split_fingerprint(f);
          calls.push_back(n == current_sequence() + 1 ? text : f);
        }
        std::fprintf(stderr, "ruda: rank %d: %s\n", rank(),
                     cd::mismatch_message(current_sequence() + 1, calls).c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ruda: rank %d: final order check failed: %s\n", rank(), e.what());
    }
  }
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::split(int color, int key) {
  if (color < 0) fail<ArgumentError>("MpiCommunicator::split", "rank ", rank(), ": color must be >= 0, got ", color);
  impl_->drain();
  MPI_Comm part = MPI_COMM_NULL;
  check(MPI_Comm_split(impl_->data, color, key, &part), "MPI_Comm_split");
  try {
    auto impl = std::make_unique<Impl>(part);
    MPI_Comm_free(&part);
    auto comm = std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(impl)));
    comm->set_order_check(order_check());
    return comm;
  } catch (...) {
    if (part != MPI_COMM_NULL) MPI_Comm_free(&part);
    throw;
  }
}

std::size_t MpiCommunicator::buffer_bytes() const {
  return impl_->partial.size() + impl_->incoming.size() + impl_->staging.size() + impl_->wide.size();
}

void MpiCommunicator::release_buffers() {
  impl_->drain();
  impl_->partial.release();
  impl_->incoming.release();
  impl_->staging.release();
  impl_->wide.release();
}

void MpiCommunicator::do_all_gather(const void* send, void* recv, std::int64_t count, DType dtype) {
  impl_->drain();
  impl_->all_gather(send, recv, count, dtype);
}

void MpiCommunicator::do_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                                        Accumulate accumulate) {
  impl_->drain();
  impl_->reduce_scatter(send, recv, count, dtype, accumulate);
}

void MpiCommunicator::do_all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op,
                                    Accumulate accumulate) {
  impl_->drain();
  impl_->all_reduce(send, recv, count, dtype, op, accumulate);
}

void MpiCommunicator::do_broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root) {
  impl_->drain();
  impl_->broadcast(send, recv, count, dtype, root);
}

void MpiCommunicator::do_barrier() {
  impl_->drain();
  check(MPI_Barrier(impl_->data), "MPI_Barrier");
}

Work MpiCommunicator::start_all_gather(const Tensor& local, Tensor out, std::int64_t count) {
  int_count(count, "MPI_Allgather");  // fail now, not at wait()
  Impl* impl = impl_.get();
  auto future = impl->submit(
      [impl, local, out, count] { impl->all_gather(local.data_ptr(), out.data_ptr(), count, local.dtype()); });
  return Work(std::make_unique<QueuedState>(std::move(future), std::move(out)));
}

Work MpiCommunicator::start_reduce_scatter(const Tensor& full, Tensor out, std::int64_t count, Accumulate accumulate) {
  Impl* impl = impl_.get();
  auto future = impl->submit([impl, full, out, count, accumulate] {
    impl->reduce_scatter(full.data_ptr(), out.data_ptr(), count, full.dtype(), accumulate);
  });
  return Work(std::make_unique<QueuedState>(std::move(future), std::move(out)));
}

std::vector<std::string> MpiCommunicator::exchange_fingerprints(const std::string& fingerprint) {
  // On the control communicator, from the calling thread: it may run while the progress thread
  // is inside a collective on the data communicator.
  return impl_->exchange(fingerprint);
}

int mpi_abort_on_exception(const std::function<int()>& fn) {
  std::string what;
  try {
    return fn();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown exception";
  }
  int rank = -1, size = 0;
  const bool active = MpiEnvironment::active();
  if (active) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  std::fprintf(stderr, "ruda: rank %d of %d failed: %s\n", rank, size, what.c_str());
  std::fflush(stderr);
  if (active) MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

}  // namespace ruda
