// The ring reduce-scatter. See mpi_ring.h.
#include "mpi_ring.h"

#include <algorithm>
#include <cstring>

#include "internal.h"

namespace ruda::mpi_detail {

namespace cd = collectives_detail;

namespace {

// The ring's segments: small enough that a received segment is still in cache when it is added,
// large enough that per-message costs vanish.
constexpr std::int64_t kSegmentBytes = 512 * 1024;
constexpr int kRingTag = 7001;  // the ring's messages on the data communicator

}  // namespace

// A ring of size - 1 steps. In step s, this rank sends the running sum of block
// (rank - s - 1) to the right and receives the running sum of block (rank - s - 2) from the
// left, adding its own contribution; after the last step it holds the full sum of its own
// block. Each step moves in segments, double-buffered: while one segment is added, the next
// is already on its way. 16-bit data accumulated in f32 travels as f32 partial sums.
void ring_reduce_scatter(MPI_Comm comm, int rank, int size, const void* send, void* recv, std::int64_t count,
                         DType dtype, Accumulate accumulate, RingScratch& scratch) {
  const std::size_t esize = dtype_size(dtype);
  const DType ptype = cd::partial_type(dtype, accumulate);
  const std::size_t psize = dtype_size(ptype);
  const MPI_Datatype mpi_ptype = mpi_type(ptype);
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  const std::int64_t seg = std::max<std::int64_t>(1, kSegmentBytes / static_cast<std::int64_t>(psize));
  const std::int64_t segments = (count + seg - 1) / seg;
  const std::size_t seg_bytes = static_cast<std::size_t>(seg) * psize;

  std::byte* running = size > 2 ? scratch.partial.get(static_cast<std::size_t>(count) * psize) : nullptr;
  std::byte* in = scratch.incoming.get(2 * seg_bytes);
  std::byte* stage = ptype != dtype ? scratch.staging.get(2 * seg_bytes) : nullptr;
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
      check(MPI_Irecv(in + static_cast<std::size_t>(slot) * seg_bytes, len, mpi_ptype, left, kRingTag, comm,
                      &requests[slot][0]),
            "MPI_Irecv");
      check(MPI_Isend(out, len, mpi_ptype, right, kRingTag, comm, &requests[slot][1]), "MPI_Isend");
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

}  // namespace ruda::mpi_detail
