// The fused attention kernel (flash-attention style), shared by both backends: query blocks
// against streamed key blocks with an online softmax, so that no [Tq, Tk] matrix per head ever
// exists; the backward recomputes each block's weights from the saved logsumexp. The block
// products go through a GEMM policy: Eigen's products here (attention.cpp), oneDNN's matmul
// primitives in backends/onednn/attention.cpp. Private to the backends.
//
// Types: T is the storage type of q, k, v and the outputs; G the operand type of the block
// products (T itself, or f32 where the policy cannot multiply T: Eigen widens 16-bit blocks);
// Acc the type of scores, softmax statistics and accumulators (f32, f64 for f64).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include <ruda/backend.h>
#include <ruda/random.h>

#include "exp_wide.h"
#include "kernel_util.h"
#include "vector_math.h"

namespace ruda::kernels::attention {

struct Blocks {
  std::int64_t q = 0, kv = 0;
};

/// Query and key block sizes. PyTorch's CPU kernel uses kv blocks of 512 and q blocks of 32, 64
/// or 256 by length (DESIGN.md §10); measured here (one thread's CPU time of a causal forward and
/// backward, B 1, H 12, D 64, both backends, f32 and bf16), smaller key blocks win: causal
/// attention skips more of the area above the diagonal, and the blocks stay in L2. At T = 1024,
/// 256 x 256 took 0.75-0.85x the time of 256 x 512 (oneDNN f32 66 vs 75 ms, bf16 35 vs 43 ms); at
/// T = 512, 128 x 128 took 0.65-0.7x of 64 x 512. At T = 128 one 128-row query block per head
/// halves the block products (each a oneDNN execution with its fixed cost): fused / composed
/// 0.92 against 1.02 with 64-row blocks (oneDNN f32, B 1, H 12, same run each; 2-core EPYC).
inline Blocks block_sizes(std::int64_t tq, std::int64_t tk) {
  const std::int64_t q = tq < 768 ? 128 : 256;
  const std::int64_t kv = tk < 768 ? 128 : 256;
  return {std::max<std::int64_t>(1, std::min(q, tq)), std::max<std::int64_t>(1, std::min(kv, tk))};
}

/// The block products of the Eigen backend: c[m, n] (row stride ldc) = alpha * op(a) op(b)
/// (+ c when accumulating), op(a) [m, k] and op(b) [k, n] row-major with row strides lda, ldb
/// (transposed operands are stored [k, m] and [n, k]). Single-threaded: it runs inside the
/// kernel's own parallel loop, where Eigen does not start threads of its own.
template <class S>
struct EigenBlockGemm {
  using Matrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using In = Eigen::Map<const Matrix, 0, Eigen::OuterStride<>>;
  using Out = Eigen::Map<Matrix, 0, Eigen::OuterStride<>>;

  void operator()(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const S* a, std::int64_t lda,
                  const S* b, std::int64_t ldb, S* c, std::int64_t ldc, S alpha, bool accumulate) const {
    const In A(a, ta ? k : m, ta ? m : k, Eigen::OuterStride<>(lda));
    const In B(b, tb ? n : k, tb ? k : n, Eigen::OuterStride<>(ldb));
    Out C(c, m, n, Eigen::OuterStride<>(ldc));
    auto run = [&](const auto& l, const auto& r) {
      if (accumulate) {
        C.noalias() += alpha * (l * r);
      } else {
        C.noalias() = alpha * (l * r);
      }
    };
    if (ta && tb) {
      run(A.transpose(), B.transpose());
    } else if (ta) {
      run(A.transpose(), B);
    } else if (tb) {
      run(A, B.transpose());
    } else {
      run(A, B);
    }
  }
};

namespace detail {

/// Runs work(i) for every item in [0, items) on up to num_threads() threads, each taking the next
/// item from a shared counter (items of unequal cost, as causal blocks are, balance themselves).
/// make_worker() builds each thread's worker (its scratch). The first exception stops the loop
/// and is rethrown on the calling thread: none may leave an OpenMP region.
template <class MakeWorker>
void for_each_item(std::int64_t items, MakeWorker&& make_worker) {
  if (items <= 0) return;
  std::atomic<std::int64_t> next{0};
  std::mutex error_mutex;
  std::exception_ptr error;
  const std::int64_t workers = std::min<std::int64_t>(num_threads(), items);
  parallel_for(workers, 1, [&](std::int64_t w0, std::int64_t w1) {
    for (std::int64_t w = w0; w < w1; ++w) {
      try {
        auto work = make_worker();
        for (std::int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) work(i);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
        next.store(items);
      }
    }
  });
  if (error) std::rethrow_exception(error);
}

/// Whether a block-product policy wants its q, k, v and dO operands dense (row stride = row
/// length): a policy says so with `static constexpr bool kDenseOperands = true`.
template <class Gemm>
constexpr bool wants_dense_operands() {
  if constexpr (requires { Gemm::kDenseOperands; }) {
    return Gemm::kDenseOperands;
  } else {
    return false;
  }
}

/// A block of `rows` rows of `cols` values at row stride `ld`, as G: the block itself when T is G
/// (and it is dense, or `dense` is not asked for), else a copy in `buffer` (row stride cols),
/// converted where T is not G.
template <class G, class T>
constexpr bool stages(std::int64_t rows, std::int64_t cols, std::int64_t ld, bool dense) {
  return !std::is_same_v<G, T> || (dense && ld != cols && rows != 1);
}
template <class G, class T>
const G* stage(const T* src, std::int64_t rows, std::int64_t cols, std::int64_t ld, Scratch<G>& buffer,
               std::int64_t& out_ld, bool dense = false) {
  if constexpr (std::is_same_v<G, T>) {
    if (!stages<G, T>(rows, cols, ld, dense)) {
      out_ld = ld;
      return src;
    }
    buffer.resize(static_cast<std::size_t>(rows * cols));
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy(src + r * ld, src + r * ld + cols, buffer.data() + r * cols);
    }
    out_ld = cols;
    return buffer.data();
  } else {
    buffer.resize(static_cast<std::size_t>(rows * cols));
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) buffer[r * cols + c] = static_cast<G>(Num<T>::load(src[r * ld + c]));
    }
    out_ld = cols;
    return buffer.data();
  }
}

/// `src` (rows x cols, row stride ld) as G in `buffer` (same strides), or src itself when G is Acc.
template <class G, class Acc>
const G* as_operand(const Acc* src, std::int64_t rows, std::int64_t cols, std::int64_t ld, Scratch<G>& buffer) {
  if constexpr (std::is_same_v<G, Acc>) {
    return src;
  } else {
    buffer.resize(static_cast<std::size_t>(rows * ld));
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) buffer[r * ld + c] = Num<G>::store(src[r * ld + c]);
    }
    return buffer.data();
  }
}

/// sum_c a[c] b[c] in Acc, over eight interleaved partial sums added in a fixed order at the end:
/// the compiler keeps them in one vector register (a single running sum is a chain of dependent
/// scalar adds), and the order does not depend on the rows' addresses.
template <class Acc, class T>
Acc row_dot(const T* a, const T* b, std::int64_t n) {
  constexpr std::int64_t kLanes = 8;
  Acc part[kLanes] = {};
  std::int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (std::int64_t l = 0; l < kLanes; ++l)
      part[l] += static_cast<Acc>(Num<T>::load(a[c + l])) * static_cast<Acc>(Num<T>::load(b[c + l]));
  }
  for (std::int64_t l = 0; c + l < n; ++l)
    part[l] += static_cast<Acc>(Num<T>::load(a[c + l])) * static_cast<Acc>(Num<T>::load(b[c + l]));
  Acc s = 0;
  for (const Acc v : part) s += v;
  return s;
}

/// A [B, H, T, D] view's rows: element (b, h, t, :) starts at row(b, h, t).
template <class T>
struct Rows {
  T* base = nullptr;
  std::int64_t sb = 0, sh = 0, st = 0;
  explicit Rows(const View& v)
      : base(v.data ? v.ptr<T>() : nullptr), sb(v.strides[0]), sh(v.strides[1]), st(v.strides[2]) {}
  T* row(std::int64_t b, std::int64_t h, std::int64_t t) const { return base + b * sb + h * sh + t * st; }
};

/// exp(row[c] - shift) in place for c in [0, n), returning their sum, added in a fixed order (the
/// lanes of whole packets, the tail's packet, then across lanes) that does not follow the row's
/// address. f32: Eigen's packet exp without its general ldexp (ops::detail::
/// pexp_float_normal_range): Eigen's bits for arguments down to -87, 0 below about -87.7 (Eigen's
/// clamp gave 2.9e-39 there: a weight negligible beside the row's largest, 1). The softmax passes
/// are exp-bound: `tools/bench --suite attention`, the library before this pass alternated with
/// it, three runs each (2-core Zen 4), read fused / composed f32 0.384-0.410 against 0.406-0.412
/// at T = 1024 and 0.369-0.375 against 0.388-0.396 at T = 2048. f64: Eigen's exp.
template <class Acc>
Acc exp_shifted_packets(Acc* row, std::int64_t n, Acc shift) {
  if constexpr (std::is_same_v<Acc, float>) {
    using namespace Eigen::internal;
    using Packet = packet_traits<float>::type;
    constexpr std::int64_t kLanes = packet_traits<float>::size;
    const Packet s = pset1<Packet>(shift);
    Packet sum = pset1<Packet>(0.0f);
    std::int64_t c = 0;
    for (; c + kLanes <= n; c += kLanes) {
      const Packet e = ops::detail::pexp_float_normal_range(psub(ploadu<Packet>(row + c), s));
      pstoreu(row + c, e);
      sum = padd(sum, e);
    }
    if (c < n) {
      // The tail as one packet, padded with -inf (exp 0, adding nothing to the sum).
      alignas(64) float tail[kLanes];
      std::fill(tail, tail + kLanes, -std::numeric_limits<float>::infinity());
      std::copy(row + c, row + n, tail);
      const Packet e = ops::detail::pexp_float_normal_range(psub(pload<Packet>(tail), s));
      pstore(tail, e);
      std::copy(tail, tail + (n - c), row + c);
      sum = padd(sum, e);
    }
    return predux(sum);
  } else {
    Eigen::Map<Eigen::Array<Acc, Eigen::Dynamic, 1>> r(row, n);
    r = (r - shift).exp();
    return r.sum();
  }
}

/// exp_shifted_packets, on the CPU's 16-lane vectors where the build's are 8 lanes wide and the CPU
/// has AVX-512 (exp_wide.h): the same bits, the exp pass at twice the width. `ruda-bench --suite
/// attention`'s "softmax exp pass" row (4096 rows of 256, against the 8-lane kernel in the same
/// run; 2-core Xeon with AMX, GCC 12 build): 0.64-0.66 of the time, three runs. In the whole op a
/// small gain (the same suite's fwd+bwd rows, the two kernels alternated through a temporary
/// switch, medians of 3: 24.41 against 24.48 ms at T = 1024, 87.1 against 91.0 at T = 2048): the
/// block products dominate the kernel.
template <class Acc>
Acc exp_shifted(Acc* row, std::int64_t n, Acc shift) {
  if constexpr (std::is_same_v<Acc, float>) {
    using namespace Eigen::internal;
    using Packet = packet_traits<float>::type;
    if constexpr (packet_traits<float>::size == 8) {
      if (const ExpShiftedWide wide = exp_shifted_wide()) {
        alignas(64) float partial[8];
        wide(row, n, shift, partial);
        return predux(pload<Packet>(partial));
      }
    }
  }
  return exp_shifted_packets(row, n, shift);
}

/// The dropout fate of the weights (b, h, i, j0 .. j0 + n): keep[c] is 0 or 1 / (1 - p), as
/// ruda::dropout decides for element offset + ((b * H + h) * Tq + i) * Tk + j of the weights. The
/// draws come a row segment at a time (random::uniform_floats, eight counters a vector): one
/// scalar Philox a weight made attention with dropout 0.1 take 4x the time of attention without
/// (B 1, H 12, T 1024, f32 forward and backward on oneDNN, 128-144 against 36 ms; now 57-62).
template <class Acc>
void dropout_row(const AttentionDesc& d, std::int64_t bh, std::int64_t i, std::int64_t j0, std::int64_t n, Acc* keep) {
  const std::int64_t tq = d.q.shape[2], tk = d.k.shape[2];
  const float p = static_cast<float>(d.dropout);
  const Acc scale = static_cast<Acc>(1.0 / (1.0 - d.dropout));
  const std::uint64_t first = d.offset + static_cast<std::uint64_t>((bh * tq + i) * tk + j0);
  constexpr std::int64_t kPiece = 256;
  float draws[kPiece];
  for (std::int64_t c0 = 0; c0 < n; c0 += kPiece) {
    const std::int64_t m = std::min(kPiece, n - c0);
    random::uniform_floats(d.seed, first + static_cast<std::uint64_t>(c0), m, draws);
    for (std::int64_t c = 0; c < m; ++c) keep[c0 + c] = draws[c] >= p ? scale : Acc(0);
  }
}

/// How many keys of block [j0, j0 + cols) query i may see.
inline std::int64_t visible(bool causal, std::int64_t i, std::int64_t j0, std::int64_t cols) {
  return causal ? std::clamp<std::int64_t>(i - j0 + 1, 0, cols) : cols;
}

/// Rows of the chunks a causal block that crosses the diagonal is cut into.
constexpr std::int64_t kDiagonalChunk = 64;

/// Rows [first, first + rows) of a query block, multiplied against the first `cols` keys of a key
/// block; `masked` when some of those keys lie after some of the rows' queries.
struct Chunk {
  std::int64_t first = 0, rows = 0, cols = 0;
  bool masked = false;
};

/// The chunks of query block [i0, i0 + rows) against key block [j0, j0 + cols), in row order. A
/// block off the diagonal is one chunk. One that crosses it is cut into chunks of kDiagonalChunk
/// rows, each against the keys its last row may see: the area above the diagonal is not
/// multiplied, only the triangles inside each chunk are (a square 128 block computes 3/4 of
/// itself, a 256 block 5/8, against all of it uncut). Chunks that see no key are left out.
/// Measured (`tools/bench --suite attention`, oneDNN, causal fwd+bwd B 1 H 12 D 64, this kernel's
/// previous libraries alternated with these, 3 runs each; 2-core Zen 4): time chunked / uncut f32
/// 0.77 at T = 128, 0.85 at 512, 0.93 at 1024, 0.96 at 2048; bf16 0.92, 0.95, 0.94, 0.99.
/// 32-row chunks measured no better (more, smaller products), within this VM's noise.
template <class Body>
void for_each_chunk(bool causal, std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t cols, Body&& body) {
  if (!causal || j0 + cols - 1 <= i0) {
    body(Chunk{0, rows, cols, false});
    return;
  }
  const std::int64_t step = rows >= 2 * kDiagonalChunk ? kDiagonalChunk : rows;
  for (std::int64_t a = 0; a < rows; a += step) {
    const std::int64_t n = std::min(step, rows - a);
    const std::int64_t seen = std::min(cols, i0 + a + n - j0);  // keys the chunk's last row sees
    if (seen <= 0) continue;
    body(Chunk{a, n, seen, j0 + seen - 1 > i0 + a});
  }
}

/// dst[c] = src[c] as T, for c in [0, n): an accumulator row written out.
template <class T, class Acc>
void store_row(const Acc* src, T* dst, std::int64_t n) {
  for (std::int64_t c = 0; c < n; ++c) dst[c] = Num<T>::store(static_cast<compute_t<T>>(src[c]));
}

/// How many items a backward splits each of B x H heads into (over interleaved sets of its
/// `key_blocks` key blocks): 1 when the heads alone give every thread work.
inline std::int64_t head_splits(std::int64_t bh_count, std::int64_t key_blocks) {
  const std::int64_t threads = num_threads();
  return bh_count >= threads ? 1 : std::min<std::int64_t>(key_blocks, (threads + bh_count - 1) / bh_count);
}

/// The backward's working memory as large as a head's slice, charged to the calling thread's rank
/// (charge_working_memory): dQ's partial sums of split heads ([bh][split][Tq][D] of Acc), or else
/// each worker's [Tq, D] dQ accumulator, and each worker's copies of the head's queries and output
/// gradients where they are staged ([Tq, D] and [Tq, Dv] of G). A long sequence's went past the
/// rank's limit unseen (q [1, 1, 16384, 128] f32: 8.4 MB a worker).
template <class Acc, class G>
ruda::detail::Charge charge_backward_memory(std::int64_t bh_count, std::int64_t splits, std::int64_t tq,
                                            std::int64_t dim, std::int64_t dv, bool need_dq, bool staged_q,
                                            bool staged_dout) {
  const std::int64_t workers = std::min<std::int64_t>(num_threads(), bh_count * splits);
  std::int64_t acc = 0;
  if (need_dq) acc = splits > 1 ? bh_count * splits * tq * dim : workers * tq * dim;
  const auto staged_bytes = static_cast<std::int64_t>(
      workers * ((staged_q ? tq * dim : 0) + (staged_dout ? tq * dv : 0)) * static_cast<std::int64_t>(sizeof(G)));
  const auto acc_size = static_cast<std::int64_t>(sizeof(Acc));
  return charge_working_memory(acc + (staged_bytes + acc_size - 1) / acc_size,
                               std::is_same_v<Acc, double> ? DType::f64 : DType::f32,
                               "scaled_dot_product_attention backward (working memory)");
}

/// The dQ of split heads: each row's partial sums ([bh][split][Tq][D] in `parts`) added in split
/// order, so that no two threads write one value and the result does not depend on timing.
template <class T, class Acc>
void sum_split_dq(const Rows<T>& dq, const Acc* parts, std::int64_t bh_count, std::int64_t heads, std::int64_t tq,
                  std::int64_t dim, std::int64_t splits) {
  parallel_for(bh_count * tq, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(1, dim * splits)),
               [&](std::int64_t r0, std::int64_t r1) {
                 for (std::int64_t r = r0; r < r1; ++r) {
                   const std::int64_t bh = r / tq, i = r % tq;
                   T* o = dq.row(bh / heads, bh % heads, i);
                   for (std::int64_t c = 0; c < dim; ++c) {
                     Acc s = 0;
                     for (std::int64_t sp = 0; sp < splits; ++sp) s += parts[((bh * splits + sp) * tq + i) * dim + c];
                     o[c] = Num<T>::store(static_cast<compute_t<T>>(s));
                   }
                 }
               });
}

}  // namespace detail

/// The forward: out and lse of desc. make_gemm() returns a block-product policy for one thread
/// (called like EigenBlockGemm<Acc> with operands of G).
template <class T, class G, class Acc, class MakeGemm>
void forward(const AttentionDesc& d, MakeGemm&& make_gemm) {
  using namespace detail;
  using Array = Eigen::Array<Acc, Eigen::Dynamic, 1>;
  const std::int64_t batch = d.q.shape[0], heads = d.q.shape[1], tq = d.q.shape[2], dim = d.q.shape[3];
  const std::int64_t tk = d.k.shape[2], dv = d.v.shape[3], bh_count = batch * heads;
  const Blocks bs = block_sizes(tq, tk);
  const std::int64_t nq = (tq + bs.q - 1) / bs.q, nk = (tk + bs.kv - 1) / bs.kv;
  const Rows<const T> q(d.q), k(d.k), v(d.v);
  const Rows<T> out(d.out);
  Acc* const lse = d.lse.ptr<Acc>();
  const Acc scale = static_cast<Acc>(d.scale);
  const Acc minus_inf = -std::numeric_limits<Acc>::infinity();

  for_each_item(bh_count * nq, [&] {
    // One thread's scratch: scores (qBlock x kvBlock), accumulator (qBlock x Dv), statistics.
    using Gemm = decltype(make_gemm());
    struct Worker {
      Gemm gemm;
      Scratch<Acc> scores, acc, max, sum, keep;
      Scratch<G> probs, qbuf, kbuf, vbuf;
      explicit Worker(Gemm g) : gemm(std::move(g)) {}
    };
    constexpr bool dense = wants_dense_operands<Gemm>();
    auto w = std::make_shared<Worker>(make_gemm());
    w->scores.resize(static_cast<std::size_t>(bs.q * bs.kv));
    w->acc.resize(static_cast<std::size_t>(bs.q * dv));
    w->max.resize(static_cast<std::size_t>(bs.q));
    w->sum.resize(static_cast<std::size_t>(bs.q));
    if (d.dropout > 0) w->keep.resize(static_cast<std::size_t>(bs.kv));
    return [&, w](std::int64_t item) {
      // Longest causal rows first (the last query blocks), every head's before the next block.
      const std::int64_t bh = item % bh_count, qi = nq - 1 - item / bh_count;
      const std::int64_t b = bh / heads, h = bh % heads, i0 = qi * bs.q, rows = std::min(bs.q, tq - i0);
      std::int64_t ldq = 0, ldk = 0, ldv = 0;
      const G* qb = stage<G>(q.row(b, h, i0), rows, dim, q.st, w->qbuf, ldq, dense);
      std::fill(w->max.begin(), w->max.end(), minus_inf);
      std::fill(w->sum.begin(), w->sum.end(), Acc(0));
      std::fill(w->acc.begin(), w->acc.end(), Acc(0));
      // Key blocks entirely above the diagonal (every key after the block's last query) are skipped.
      const std::int64_t kend = d.causal ? std::min(nk, (i0 + rows - 1) / bs.kv + 1) : nk;
      for (std::int64_t kj = 0; kj < kend; ++kj) {
        const std::int64_t j0 = kj * bs.kv, cols = std::min(bs.kv, tk - j0);
        const G* kb = stage<G>(k.row(b, h, j0), cols, dim, k.st, w->kbuf, ldk, dense);
        const G* vb = stage<G>(v.row(b, h, j0), cols, dv, v.st, w->vbuf, ldv, dense);
        for_each_chunk(d.causal, i0, rows, j0, cols, [&](const Chunk& c) {
          // Scores of the chunk's rows against its keys (row stride c.cols), then the online
          // softmax of each row over them, then their weighted values into the rows' accumulators.
          // The scale rides on the product (its alpha), not on a pass of its own over the scores.
          Acc* const s = w->scores.data();
          w->gemm(false, true, c.rows, c.cols, dim, qb + c.first * ldq, ldq, kb, ldk, s, c.cols, scale, false);
          for (std::int64_t r = 0; r < c.rows; ++r) {
            const std::int64_t row_index = c.first + r;  // in the query block
            Acc* const sr = s + r * c.cols;
            const std::int64_t n = c.masked ? visible(true, i0 + row_index, j0, c.cols) : c.cols;
            Eigen::Map<Array> row(sr, n);
            const Acc block_max = n ? row.maxCoeff() : minus_inf;
            const Acc m = std::max(w->max[row_index], block_max);
            std::fill(sr + n, sr + c.cols, Acc(0));
            if (m == minus_inf) {  // nothing visible yet (cannot happen: key 0 always is) or -inf scores
              row.setZero();
              continue;
            }
            const Acc rescale = std::exp(w->max[row_index] - m);  // 0 on the first visible block
            // Masked keys are zeroed, never exponentiated from -inf.
            w->sum[row_index] = w->sum[row_index] * rescale + exp_shifted(sr, n, m);
            w->max[row_index] = m;
            if (rescale != Acc(1)) Eigen::Map<Array>(w->acc.data() + row_index * dv, dv) *= rescale;
            if (d.dropout > 0 && n > 0) {
              // The softmax's sum counts every weight; dropout acts on the normalized weights after.
              dropout_row(d, bh, i0 + row_index, j0, n, w->keep.data());
              row *= Eigen::Map<const Array>(w->keep.data(), n);
            }
          }
          const G* pb = as_operand<G>(s, c.rows, c.cols, c.cols, w->probs);
          w->gemm(false, false, c.rows, dv, c.cols, pb, c.cols, vb, ldv, w->acc.data() + c.first * dv, dv, Acc(1),
                  true);
        });
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        const Acc inv = Acc(1) / w->sum[r];
        T* o = out.row(b, h, i0 + r);
        for (std::int64_t c = 0; c < dv; ++c) o[c] = Num<T>::store(static_cast<compute_t<T>>(w->acc[r * dv + c] * inv));
        lse[d.lse.strides[0] * b + d.lse.strides[1] * h + d.lse.strides[2] * (i0 + r)] =
            w->max[r] + std::log(w->sum[r]);
      }
    };
  });
}

/// The backward: dq, dk, dv (those with data) of desc. Parallel over B x H and, when that is
/// fewer than the threads, over interleaved sets of key blocks as well: each item owns its key
/// rows' dK and dV outright, and the dQ of a split head is summed afterwards from one buffer per
/// item, in a fixed order. No two threads ever write one value.
template <class T, class G, class Acc, class MakeGemm>
void backward(const AttentionDesc& d, MakeGemm&& make_gemm) {
  using namespace detail;
  using Array = Eigen::Array<Acc, Eigen::Dynamic, 1>;
  const std::int64_t batch = d.q.shape[0], heads = d.q.shape[1], tq = d.q.shape[2], dim = d.q.shape[3];
  const std::int64_t tk = d.k.shape[2], dv = d.v.shape[3], bh_count = batch * heads;
  const Blocks bs = block_sizes(tq, tk);
  const std::int64_t nq = (tq + bs.q - 1) / bs.q, nk = (tk + bs.kv - 1) / bs.kv;
  const bool need_dq = d.dq.data != nullptr, need_dk = d.dk.data != nullptr, need_dv = d.dv.data != nullptr;
  const bool need_ds = need_dq || need_dk;
  const Rows<const T> q(d.q), k(d.k), v(d.v), out(d.out), dout(d.dout);
  const Rows<T> dq(d.dq), dk(d.dk), dv_rows(d.dv);
  const Acc* const lse = d.lse.ptr<const Acc>();
  const Acc scale = static_cast<Acc>(d.scale);
  const std::int64_t splits = head_splits(bh_count, nk);
  constexpr bool dense = wants_dense_operands<decltype(make_gemm())>();
  const ruda::detail::Charge charged = charge_backward_memory<Acc, G>(
      bh_count, splits, tq, dim, dv, need_dq, stages<G, T>(tq, dim, q.st, dense), stages<G, T>(tq, dv, dout.st, dense));
  // Per-item dQ partial sums of split heads ([bh][split][Tq][D]); none when heads are not split.
  Scratch<Acc> dq_parts(need_dq && splits > 1 ? static_cast<std::size_t>(bh_count * splits * tq * dim) : 0);

  for_each_item(bh_count * splits, [&] {
    using Gemm = decltype(make_gemm());
    struct Worker {
      Gemm gemm;
      Scratch<Acc> p, dp, keep, dq_acc, dk_acc, dv_acc, delta;
      Scratch<G> pd, ds, qbuf, kbuf, vbuf, obuf;
      explicit Worker(Gemm g) : gemm(std::move(g)) {}
    };
    auto w = std::make_shared<Worker>(make_gemm());
    const std::size_t block = static_cast<std::size_t>(bs.q * bs.kv);
    w->p.resize(block);
    w->dp.resize(need_ds ? block : 0);
    if (d.dropout > 0) w->keep.resize(block);
    w->pd.resize(d.dropout > 0 || !std::is_same_v<G, Acc> ? block : 0);
    w->dk_acc.resize(static_cast<std::size_t>(bs.kv * dim));
    w->dv_acc.resize(static_cast<std::size_t>(bs.kv * dv));
    w->delta.resize(static_cast<std::size_t>(tq));
    if (need_dq && splits == 1) w->dq_acc.resize(static_cast<std::size_t>(tq * dim));
    return [&, w](std::int64_t item) {
      const std::int64_t bh = item % bh_count, split = item / bh_count, b = bh / heads, h = bh % heads;
      const Acc* const lse_bh = lse + d.lse.strides[0] * b + d.lse.strides[1] * h;
      // delta_i = rowsum(dO * O): the softmax backward's row term, dO_i . O_i (dropout included).
      for (std::int64_t i = 0; i < tq; ++i) w->delta[i] = row_dot<Acc>(out.row(b, h, i), dout.row(b, h, i), dv);
      Acc* dq_acc = nullptr;
      if (need_dq) {
        dq_acc = splits == 1 ? w->dq_acc.data() : dq_parts.data() + (bh * splits + split) * tq * dim;
        std::fill(dq_acc, dq_acc + tq * dim, Acc(0));
      }
      // The head's queries and output gradients, staged once (every key block reads them).
      std::int64_t ldq = 0, ldo = 0;
      const G* q_head = stage<G>(q.row(b, h, 0), tq, dim, q.st, w->qbuf, ldq, dense);
      const G* o_head = stage<G>(dout.row(b, h, 0), tq, dv, dout.st, w->obuf, ldo, dense);
      for (std::int64_t kj = split; kj < nk; kj += splits) {
        const std::int64_t j0 = kj * bs.kv, cols = std::min(bs.kv, tk - j0);
        std::int64_t ldk = 0, ldv = 0;
        const G* kb = stage<G>(k.row(b, h, j0), cols, dim, k.st, w->kbuf, ldk, dense);
        const G* vb = stage<G>(v.row(b, h, j0), cols, dv, v.st, w->vbuf, ldv, dense);
        std::fill(w->dk_acc.begin(), w->dk_acc.end(), Acc(0));
        std::fill(w->dv_acc.begin(), w->dv_acc.end(), Acc(0));
        // Query blocks that see none of these keys (all rows before the block's first key) are skipped.
        const std::int64_t first = d.causal ? j0 / bs.q : 0;
        for (std::int64_t qi = first; qi < nq; ++qi) {
          const std::int64_t i0 = qi * bs.q, rows = std::min(bs.q, tq - i0);
          const G* qb_block = q_head + i0 * ldq;
          const G* ob_block = o_head + i0 * ldo;
          for_each_chunk(d.causal, i0, rows, j0, cols, [&](const Chunk& c) {
            // The chunk's rows [ci, ci + c.rows) against the block's first c.cols keys; every
            // [c.rows, c.cols] buffer below has row stride c.cols.
            const std::int64_t ci = i0 + c.first, n_rows = c.rows, n_cols = c.cols;
            const G* qb = qb_block + c.first * ldq;
            const G* ob = ob_block + c.first * ldo;
            // scale * S (the forward's scores: the same block product, with the scale as its alpha),
            // then P = exp(scale * S - lse) on visible keys, 0 on masked ones.
            Acc* const p = w->p.data();
            w->gemm(false, true, n_rows, n_cols, dim, qb, ldq, kb, ldk, p, n_cols, scale, false);
            for (std::int64_t r = 0; r < n_rows; ++r) {
              Acc* const pr = p + r * n_cols;
              const std::int64_t n = c.masked ? visible(true, ci + r, j0, n_cols) : n_cols;
              exp_shifted(pr, n, lse_bh[d.lse.strides[2] * (ci + r)]);  // as in the forward
              std::fill(pr + n, pr + n_cols, Acc(0));
              if (d.dropout > 0) {
                Acc* const keep = w->keep.data() + r * n_cols;
                dropout_row(d, bh, ci + r, j0, n, keep);
                std::fill(keep + n, keep + n_cols, Acc(0));
              }
            }
            // The weights that multiplied V: P, or P with the dropout mask applied.
            const G* pd = nullptr;
            if (d.dropout > 0) {
              for (std::int64_t e = 0; e < n_rows * n_cols; ++e) w->pd[e] = Num<G>::store(p[e] * w->keep[e]);
              pd = w->pd.data();
            } else {
              pd = as_operand<G>(p, n_rows, n_cols, n_cols, w->pd);
            }
            // dV += Pd^T dO
            if (need_dv) {
              w->gemm(true, false, n_cols, dv, n_rows, pd, n_cols, ob, ldo, w->dv_acc.data(), dv, Acc(1), true);
            }
            if (!need_ds) return;
            // dP = dO V^T (through the mask when dropping), dS = P * (dP - delta)
            Acc* const dp = w->dp.data();
            w->gemm(false, true, n_rows, n_cols, dv, ob, ldo, vb, ldv, dp, n_cols, Acc(1), false);
            for (std::int64_t r = 0; r < n_rows; ++r) {
              Eigen::Map<Array> dpr(dp + r * n_cols, n_cols);
              if (d.dropout > 0) dpr *= Eigen::Map<const Array>(w->keep.data() + r * n_cols, n_cols);
              dpr = Eigen::Map<const Array>(p + r * n_cols, n_cols) * (dpr - w->delta[ci + r]);
            }
            const G* ds = as_operand<G>(dp, n_rows, n_cols, n_cols, w->ds);
            // dQ += scale dS K, dK += scale dS^T Q
            if (need_dq) {
              w->gemm(false, false, n_rows, dim, n_cols, ds, n_cols, kb, ldk, dq_acc + ci * dim, dim, scale, true);
            }
            if (need_dk) {
              w->gemm(true, false, n_cols, dim, n_rows, ds, n_cols, qb, ldq, w->dk_acc.data(), dim, scale, true);
            }
          });
        }
        for (std::int64_t r = 0; r < cols; ++r) {
          if (need_dk) store_row(w->dk_acc.data() + r * dim, dk.row(b, h, j0 + r), dim);
          if (need_dv) store_row(w->dv_acc.data() + r * dv, dv_rows.row(b, h, j0 + r), dv);
        }
      }
      if (need_dq && splits == 1) {
        for (std::int64_t i = 0; i < tq; ++i) store_row(dq_acc + i * dim, dq.row(b, h, i), dim);
      }
    };
  });

  if (need_dq && splits > 1) sum_split_dq(dq, dq_parts.data(), bh_count, heads, tq, dim, splits);
}

}  // namespace ruda::kernels::attention
