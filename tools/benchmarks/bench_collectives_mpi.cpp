// Suite "collectives-mpi" of ruda-bench-mpi (run it under mpiexec; rank 0 prints): ruda's MPI
// all_gather against raw MPI_Allgather, and ruda's reduce_scatter against the better of two raw
// algorithms (MPI_Reduce_scatter_block, and a ring written here directly on MPI point-to-point
// calls), on the same buffers in the same run, f32, 4 KiB ... 64 MiB in total; and whether a
// non-blocking all_gather / reduce_scatter really overlaps with computation.
//
// Bus bandwidth = (n - 1) / n * total bytes / time. ruda runs through the *_into forms, on the
// buffers the raw calls use, so both sides move exactly the same memory.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <ruda/backend.h>
#include <ruda/mpi.h>
#include <ruda/tensor.h>

#include "bench.h"

namespace ruda::bench {
namespace {

// MPI lives for the whole process: from static initialization (before main parses the command
// line) until static destruction.
MpiEnvironment& environment() {
  static MpiEnvironment env;
  return env;
}

bool is_rank_zero() { return environment().world_rank() == 0; }

void check(int code, const char* call) {
  if (code != MPI_SUCCESS) throw CollectiveError(std::string(call) + " failed in the benchmark");
}

// Times the same thing on every rank; each rank measures its own calls (the collectives keep
// them in step) and rank 0's figures are reported.
template <class F>
Stats timed(const Context& ctx, MPI_Comm comm, F&& f) {
  check(MPI_Barrier(comm), "MPI_Barrier");
  return measure(ctx, f);
}

// "0.42x": how fast `seconds` runs relative to `reference` (reference / seconds).
std::string format_ratio(double seconds, double reference) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2fx", reference / seconds);
  return text;
}

Stats summary(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  const std::size_t n = seconds.size();
  const double median = n % 2 ? seconds[n / 2] : 0.5 * (seconds[n / 2 - 1] + seconds[n / 2]);
  return Stats{median, seconds.front(), seconds.back()};
}

// Times the calls alternately (f g, g f, f g, ...), each run started by a barrier, so that changes
// in the machine's load hit every side alike and no side always runs first after the warm-ups.
std::vector<Stats> timed_alternating(const Context& ctx, MPI_Comm comm,
                                     const std::vector<std::function<void()>>& calls) {
  auto once = [&](const std::function<void()>& call) {
    check(MPI_Barrier(comm), "MPI_Barrier");
    const auto start = std::chrono::steady_clock::now();
    call();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const std::size_t n = calls.size();
  for (int i = 0; i < 2; ++i) {
    for (const auto& call : calls) once(call);
  }
  std::vector<std::vector<double>> seconds(n);
  const int runs = ctx.quick ? 3 : ctx.repeats;
  for (int i = 0; i < runs; ++i) {
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t j = i % 2 == 0 ? k : n - 1 - k;
      seconds[j].push_back(once(calls[j]));
    }
  }
  std::vector<Stats> out;
  for (auto& s : seconds) out.push_back(summary(std::move(s)));
  return out;
}

// The raw ring: reduce-scatter of f32 sums written directly on MPI_Isend/MPI_Irecv, the textbook
// algorithm (n - 1 steps; in step s a rank sends the running sum of block rank - s - 1 to the
// right and adds its own part of block rank - s - 2 to what comes from the left), pipelined in
// segments of 512 KiB with two in flight, on scratch buffers allocated once per size.
class RawRing {
 public:
  RawRing(MPI_Comm comm, std::int64_t count) : comm_(comm), count_(count) {
    check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
    seg_ = std::min<std::int64_t>(count, kSegment);
    running_.assign(static_cast<std::size_t>(count), 0.0f);
    incoming_.assign(static_cast<std::size_t>(2 * seg_), 0.0f);
  }
  void operator()(const float* send, float* recv) {
    if (size_ == 1) {  // the reduce-scatter of one rank is its input, copied (as ruda's and MPI's)
      std::copy(send, send + count_, recv);
      return;
    }
    const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
    const std::int64_t segments = (count_ + seg_ - 1) / seg_;
    for (int step = 0; step < size_ - 1; ++step) {
      const int send_block = (rank_ + 2 * size_ - step - 1) % size_;
      const int recv_block = (rank_ + 2 * size_ - step - 2) % size_;
      const bool last = step == size_ - 2;
      const float* out = step == 0 ? send + send_block * count_ : running_.data();
      float* sum = last ? recv : running_.data();
      MPI_Request requests[2][2];
      auto post = [&](std::int64_t j) {
        const int slot = static_cast<int>(j % 2);
        const int len = static_cast<int>(std::min(seg_, count_ - j * seg_));
        check(MPI_Irecv(incoming_.data() + slot * seg_, len, MPI_FLOAT, left, 7201, comm_, &requests[slot][0]),
              "MPI_Irecv");
        check(MPI_Isend(out + j * seg_, len, MPI_FLOAT, right, 7201, comm_, &requests[slot][1]), "MPI_Isend");
      };
      post(0);
      for (std::int64_t j = 0; j < segments; ++j) {
        if (j + 1 < segments) post(j + 1);
        const int slot = static_cast<int>(j % 2);
        check(MPI_Waitall(2, requests[slot], MPI_STATUSES_IGNORE), "MPI_Waitall");
        const std::int64_t len = std::min(seg_, count_ - j * seg_);
        const float* in = incoming_.data() + slot * seg_;
        const float* own = send + recv_block * count_ + j * seg_;
        float* dst = sum + j * seg_;
        for (std::int64_t i = 0; i < len; ++i) dst[i] = in[i] + own[i];
      }
    }
  }

 private:
  static constexpr std::int64_t kSegment = (512 << 10) / 4;
  MPI_Comm comm_;
  std::int64_t count_, seg_ = 1;
  int rank_ = 0, size_ = 1;
  std::vector<float> running_, incoming_;
};

// Buffers of one size, allocated (and touched) outside the timed runs.
struct Buffers {
  Buffers(std::int64_t total, int n)
      : count(total / 4 / n),
        local(ones({count})),
        gathered(zeros({count * n})),
        full(ones({count * n})),
        piece(zeros({count})) {}
  std::int64_t count;  // f32 elements per rank
  Tensor local, gathered, full, piece;
};

void bandwidth(Context& ctx, MpiCommunicator& comm, MPI_Comm raw) {
  const int n = comm.world_size();
  const std::vector<std::int64_t> sizes = collective_totals(ctx);
  struct Figures {
    Stats ruda_gather, raw_gather, ruda_scatter, raw_ring, raw_scatter, allocating_gather;
    std::string chosen;
  };
  std::vector<Figures> figures(sizes.size());
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    Buffers b(sizes[k], n);
    const int repeats = repeats_for(sizes[k]);
    const int c = static_cast<int>(b.count);
    std::vector<Stats> gather = timed_alternating(
        ctx, raw,
        {[&] {
           for (int i = 0; i < repeats; ++i) comm.all_gather_into(b.gathered, b.local);
         },
         [&] {
           for (int i = 0; i < repeats; ++i) {
             check(MPI_Allgather(b.local.data_ptr(), c, MPI_FLOAT, b.gathered.data_ptr(), c, MPI_FLOAT, raw),
                   "MPI_Allgather");
           }
         }});
    figures[k].ruda_gather = gather[0];
    figures[k].raw_gather = gather[1];
    // ruda's reduce_scatter (which measures its two algorithms at its first call, in the warm-up
    // runs) and the raw ring, alternating.
    RawRing ring(raw, b.count);
    std::vector<Stats> scatter = timed_alternating(ctx, raw,
                                                   {[&] {
                                                      for (int i = 0; i < repeats; ++i)
                                                        comm.reduce_scatter_into(b.piece, b.full);
                                                    },
                                                    [&] {
                                                      for (int i = 0; i < repeats; ++i) {
                                                        ring(static_cast<const float*>(b.full.data_ptr()),
                                                             static_cast<float*>(b.piece.data_ptr()));
                                                      }
                                                    }});
    figures[k].ruda_scatter = scatter[0];
    figures[k].raw_ring = scatter[1];
    figures[k].chosen = std::string(comm.reduce_scatter_algorithm(static_cast<std::size_t>(sizes[k])));
  }
  // MPI_Reduce_scatter_block and the allocating all_gather come after all of them: they allocate
  // and free large buffers on every call, which here slows the other process's next transfers
  // for a while (measured: the ring ran up to 4x slower right after MPI_Reduce_scatter_block at
  // 16-64 MiB). Run after run, MPI_Reduce_scatter_block is in the state it would be in if chosen.
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    Buffers b(sizes[k], n);
    const int repeats = repeats_for(sizes[k]);
    const int c = static_cast<int>(b.count);
    figures[k].raw_scatter = timed(ctx, raw, [&] {
      for (int i = 0; i < repeats; ++i) {
        check(MPI_Reduce_scatter_block(b.full.data_ptr(), b.piece.data_ptr(), c, MPI_FLOAT, MPI_SUM, raw),
              "MPI_Reduce_scatter_block");
      }
    });
    if (sizes[k] == (16 << 20)) {
      // The allocating form: each result is fresh memory, whose first touch costs page faults.
      figures[k].allocating_gather = timed(ctx, raw, [&] {
        for (int i = 0; i < repeats; ++i) (void)comm.all_gather(b.local);
      });
    }
  }
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const Figures& f = figures[k];
    const double bus_gb = 1e-9 * static_cast<double>(sizes[k]) * (n - 1) / n * repeats_for(sizes[k]);
    const std::string suffix = " n=" + std::to_string(n) + " " + size_name(sizes[k]);
    // Bus bandwidth; at one rank, where nothing crosses a bus and MPI's work is a copy, the time
    // per call instead (what ruda's own path adds shows there undiluted).
    const std::string unit = n > 1 ? "GB/s" : "us per call";
    auto figure = [&](const Stats& seconds) {
      return n > 1 ? rate(seconds, bus_gb) : scaled(seconds, 1e6 / repeats_for(sizes[k]));
    };
    ctx.report(Result{"collectives-mpi", "mpi all_gather" + suffix, ctx.backend, unit, figure(f.ruda_gather),
                      figure(f.raw_gather), "MPI_Allgather"});
    if (sizes[k] == (16 << 20)) {
      ctx.report(Result{"collectives-mpi", "mpi all_gather (allocating)" + suffix, ctx.backend, unit,
                        figure(f.allocating_gather), figure(f.raw_gather), "MPI_Allgather"});
    }
    // The peer is the better raw algorithm at this size; the name says which ruda chose.
    const bool ring_better = f.raw_ring.median < f.raw_scatter.median;
    ctx.report(Result{
        "collectives-mpi", "mpi reduce_scatter" + suffix + " (" + f.chosen + ")", ctx.backend, unit,
        figure(f.ruda_scatter), figure(ring_better ? f.raw_ring : f.raw_scatter),
        ring_better
            ? "raw ring (MPI_Reduce_scatter_block " + format_ratio(f.raw_scatter.median, f.raw_ring.median) + ")"
            : "MPI_Reduce_scatter_block (raw ring " + format_ratio(f.raw_ring.median, f.raw_scatter.median) + ")"});
  }
}

// A non-blocking collective started before some work and waited for after it, against the two
// one after the other. The work lasts about as long as the collective and is either matmuls
// (competing for this rank's cores with MPI's copies and the progress thread's polling) or a
// sleep (work that leaves the CPU free, as an accelerator would). Ratio 1 means no overlap, 0.5
// a perfect one.
void overlap(Context& ctx, MpiCommunicator& comm, MPI_Comm raw) {
  const int n = comm.world_size();
  const std::int64_t total = ctx.quick ? 4 << 20 : 16 << 20;
  const std::int64_t count = total / 4 / n;
  // Into buffers allocated once: fresh results would add page faults to both sides.
  const Tensor local = ones({count}), gathered = zeros({count * n});
  const Tensor full = ones({count * n}), piece = zeros({count});
  const Tensor a = ones({256, 256}), b = ones({256, 256});
  const Stats one_matmul = timed(ctx, raw, [&] { (void)matmul(a, b); });
  for (const bool gather : {true, false}) {
    auto start = [&] {
      return gather ? comm.all_gather_into_async(gathered, local) : comm.reduce_scatter_into_async(piece, full);
    };
    const Stats alone = timed(ctx, raw, [&] { (void)start().wait(); });
    // Every rank must run the same number of matmuls: take rank 0's calibration.
    double calibrated = std::max(1.0, alone.median / one_matmul.median);
    check(MPI_Bcast(&calibrated, 1, MPI_DOUBLE, 0, raw), "MPI_Bcast");
    const int matmuls = static_cast<int>(calibrated);
    const auto nap = std::chrono::duration<double>(alone.median);
    const std::vector<std::pair<std::string, std::function<void()>>> works = {
        {"matmul",
         [&] {
           for (int i = 0; i < matmuls; ++i) (void)matmul(a, b);
         }},
        {"sleep", [&] { std::this_thread::sleep_for(nap); }}};
    for (const auto& [work_name, work] : works) {
      const Stats work_alone = timed(ctx, raw, work);
      const Stats both = timed(ctx, raw, [&] {
        Work w = start();
        work();
        (void)w.wait();
      });
      const Stats serial{alone.median + work_alone.median, alone.min + work_alone.min, alone.max + work_alone.max};
      ctx.report(Result{"collectives-mpi",
                        std::string("overlap ") + (gather ? "all_gather" : "reduce_scatter") + " + " + work_name +
                            " n=" + std::to_string(n) + " " + size_name(total),
                        ctx.backend, "ms", scaled(both, 1e3), scaled(serial, 1e3), "one after the other"});
    }
  }
}

void run(Context& ctx) {
  if (ctx.backend != available_backends().front()) return;  // MPI does not depend on the backend
  MpiCommunicator comm;
  comm.set_order_check(false);
  MPI_Comm raw = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &raw), "MPI_Comm_dup");
  bandwidth(ctx, comm, raw);
  overlap(ctx, comm, raw);
  MPI_Comm_free(&raw);
}

// A suite's failure on this rank: named with the rank, then the job ends (MPI_Abort) where other
// ranks may be waiting for this one in a collective.
int report_failure_and_end_job(const std::string& message) {
  std::cerr << message << " (rank " << environment().world_rank() << " of " << environment().world_size() << ")"
            << std::endl;
  if (environment().world_size() > 1) MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

const bool registered = [] {
  environment();
  should_print = &is_rank_zero;
  report_failure = &report_failure_and_end_job;
  return register_suite("collectives-mpi", run);
}();

}  // namespace
}  // namespace ruda::bench
