// ruda's ring reduce-scatter over MPI point-to-point messages (internal to ruda_mpi). Which sizes
// use it instead of MPI_Reduce_scatter_block is measured (algorithm_choice.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "mpi_support.h"

namespace ruda::mpi_detail {

/// The ring's scratch space, kept from call to call (a fresh buffer costs page faults each time).
struct RingScratch {
  Buffer partial, incoming, staging;
  std::size_t bytes() const noexcept { return partial.size() + incoming.size() + staging.size(); }
  void release() noexcept {
    partial.release();
    incoming.release();
    staging.release();
  }
};

/// recv = this rank's block (`count` elements) of the elementwise sum over the ranks of `send`
/// (size blocks of `count`), by a ring of size - 1 steps over `comm` (size > 1, count > 0).
/// Deterministic from run to run; the sum of block b starts at rank b + 1.
void ring_reduce_scatter(MPI_Comm comm, int rank, int size, const void* send, void* recv, std::int64_t count,
                         DType dtype, Accumulate accumulate, RingScratch& scratch);

}  // namespace ruda::mpi_detail
