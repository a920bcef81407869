// Which kernels run on Eigen although oneDNN could run them, because the Eigen kernel is faster.
//
// Measured with oneDNN 2.6.3 on the project machine (AMD Zen 4, AVX-512 with BF16, 2 threads),
// 64K and 1M values, 10th-percentile times of interleaved runs (tools/bench: onednn-kernels shows
// the same comparison through the engine). A kernel is listed when oneDNN took at least ~15% longer
// at both sizes:
//   f32 forward:  log 0.6x, rsqrt (pow -1/2) 0.02x, tanh 0.7-0.85x, sigmoid 0.7x (against Eigen's
//                 rational approximation; its exact form since 2026-12-04 is 1.5x slower than
//                 oneDNN's, so sigmoid runs there again), gelu 0.7-0.9x,
//                 silu 0.4x (oneDNN's time relative to Eigen's, as a speed ratio)
//   backward:     every *_use_dst_for_bwd algorithm (relu, tanh, sigmoid, sqrt) and log 0.25x in
//                 f32, 0.45x in bf16; softplus 0.45x; silu 0.5-0.75x; f32 gelu (tanh) 0.8x
//   f32 binary:   any broadcast operand 0.55-0.7x
//   f32 sums:     over the innermost axis 0.7-0.85x
// In bf16 Eigen widens values in scalar chunks and oneDNN's native kernels win by 1.5-16x, so
// only the kernels slow in both dtypes are listed for bf16. Where oneDNN wins or ties (matmul,
// softmax, sqrt and the other simple forwards, same-shape binaries) it runs, unless its kernel gets
// special values wrong (exp, log, rsqrt, relu forwards; abs, relu backwards: the `avoid_*` reasons
// of the descriptors, which RUDA_ONEDNN_KERNELS=all does not override). RUDA_ONEDNN_KERNELS=all sends
// every kernel to oneDNN, e.g. on CPUs where oneDNN's kernels are the faster ones.
//
// Re-measured 2026-12 (Zen 4, 2 threads, 4M values, `ruda-bench --suite onednn-kernels` with the
// default policy and with RUDA_ONEDNN_KERNELS=all), after the GCC 12 workaround had taken AVX-512
// away from ruda's own code: in both an AVX2 build (the default with GCC 12) and an AVX-512 build,
// Eigen's f32 tanh runs at ~0.1 Gelem/s, oneDNN's at 1.9-2.3 (16-23x), and gelu (tanh) at 16x
// forward and 18x forward+backward, so tanh and gelu (tanh) forwards and gelu (tanh)'s backward now
// run on oneDNN. Eigen's gelu (erf) forward read 4.5 Gelem/s in an AVX-512 build (1.7x oneDNN's 2.6)
// and 0.7 under AVX2, so it went to Eigen only in AVX-512 builds. (The difference was wider packets
// of scalar code, not a vectorized erf: EIGEN_FAST_MATH=0 turns Eigen's packet erf off in both.)
//
// Re-measured 2026-12 again (same Zen 4, AVX2 build, 4M values, `ruda-bench --suite onednn-kernels`)
// after backends/eigen/vector_math.h gave Eigen's kernels packet erf and tanh (both had been
// scalar all along: EIGEN_FAST_MATH=0 turns them off, not AVX2 alone), Melem/s Eigen vs oneDNN:
//   f32 forward:  gelu (erf) 4584 vs 2781 (1.65x), gelu (tanh) 3380 vs 1652 (2.0x),
//                 tanh 5535 vs 3228 (1.7x)
//   bf16 forward: gelu (tanh) 2765 vs 1614 (1.7x); gelu (erf) 2293 vs 2768 and tanh 4104 vs 4264
//                 (oneDNN as fast or faster)
//   backward (from the forward+backward rows less the forward): gelu (erf) f32 0.51 vs 0.43 ns a
//                 value, gelu (tanh) 0.54 vs 0.40: oneDNN's stay
// So gelu (erf) and tanh forwards run on Eigen in f32, gelu (tanh)'s in every dtype (f16 not
// measured: it is widened to f32 like bf16, where Eigen won). gelu (tanh)'s backward left oneDNN
// after all (2026-12-07, its descriptor's avoid_backward): NaN from |x| ~1e15; Eigen's takes the
// 0.54 ns a value above against its 0.40.
// tanh's backward (an Eigen multiply-add reading y) stays on Eigen: 1.36 Gelem/s forward+backward
// against 1.11 with oneDNN's use_dst backward. The same runs agree with the binary and reduction
// rows below (oneDNN a broadcast multiply 0.93x, a same-shape add 0.94x, a sum over the innermost
// axis 0.74x of Eigen's); the other unary rows were not re-measured in an AVX-512 build.
//
// gelu (erf)'s f32 backward moved to Eigen (2026-12-03) on figures from inside the training step,
// where the isolated rows above mislead: oneDNN's eltwise backward on the default GPT's
// [2048, 1024] read 1.9-4.3 ms a call by DNNL_VERBOSE over `ruda-train lm` (bimodal between phases
// of one process, 1.0 ms in an isolated loop), Eigen's 1.6-1.9 ms (perf's share of the step, and a
// timer around the call). `ruda-bench --suite models --quick`, this policy's library alternated
// with the previous one, 10 runs each: the GPT f32 step's fraction of GEMM 0.782 against 0.768 at
// the median (this VM's run-to-run spread is ~0.1). bf16 stays on oneDNN: Eigen widens 16-bit
// values in chunks, and in the step the two were a coin toss (2.5-3.0 ms against 2.0-3.7).
//
// gelu (erf)'s forward moved to Eigen in bf16 too (2026-12-03, third session), for linear_gelu:
// with grad it computes the GELU and its derivative in one Eigen pass
// (Backend::unary_with_derivative), and its no-grad forward must run the same kernel as that
// pass (a checkpointed block's first pass and its recompute give the same bits). The bf16 step
// gained more (~17 -> ~10 ms of GELU work a step) than the standalone forward loses (Eigen's
// bf16 gelu (erf) read ~0.83x oneDNN's rate in the rows above).
//
// The unary ops' part of this policy is in their descriptors (forward_slower and backward_slower
// in engine/src/op_descriptors.h); the binary and reduction parts are below.
#pragma once

#include <ruda/backend.h>

#include "context.h"
#include "op_descriptors.h"

namespace ruda::onednn::detail {

inline constexpr std::string_view kEigenFasterReason =
    "Eigen's kernel is faster here (measured against oneDNN 2.6; RUDA_ONEDNN_KERNELS=all overrides)";

/// A unary kernel whose descriptor says oneDNN's is slower (in this direction) for this dtype.
inline bool eigen_faster_unary(ops::Slower slower, DType dtype) {
  if (all_kernels_requested()) return false;
  switch (slower) {
    case ops::Slower::never:
      return false;
    case ops::Slower::f32:
      return dtype == DType::f32;
    case ops::Slower::always:
      return true;
  }
  return false;
}

inline bool eigen_faster_broadcast_binary(DType dtype) { return !all_kernels_requested() && dtype == DType::f32; }

inline bool eigen_faster_innermost_sum(DType dtype) { return !all_kernels_requested() && dtype == DType::f32; }

// softmax / log_softmax forward in f32 (2026-12-04, Zen 4, 2 threads, `ruda-bench --suite
// onednn-kernels`, softmax over 1024 of 4M values, two alternated runs): Eigen 2227-2692 Melem/s
// against oneDNN's 2001 before its NaN-line scan (reduce.cpp) and 1663 after it. bf16 stays on
// oneDNN (Eigen's widening loop: 266-295 against 1525-2671).
inline bool eigen_faster_softmax(DType dtype) { return !all_kernels_requested() && dtype == DType::f32; }

// The fused attention's backward (backends/onednn/attention.cpp): on transposed blocks, with the
// softmax's passes as oneDNN post-ops of the block products, against the shared kernel's, with
// those passes in ruda's own vector loops (2026-12-05, 2-core Xeon with AMX, `ruda-bench --suite
// attention`, the two libraries alternated, 3 runs each, medians, causal fwd+bwd, B 1, H 12,
// D 64): bf16 took 0.84x the time at T = 512, 1024 and 2048 (0.88x at 128; the conversions of
// the weights and their gradient to bf16 go into the products too); f32 1.01-1.07x. Where the f32
// time goes: `ruda-bench --suite gemm-onednn`, its "attention backward block" rows (one thread,
// 128 x 64 x 256, each against the same product alone in the same run): the product with
// exp(. - lse) fused ran at 0.56 of the plain product's rate in f32 (108 against 191 GFLOP/s,
// ~17 us more for 32768 weights), the softmax gradient's at 0.65. So f32 keeps the shared backward.
inline bool shared_attention_backward_faster(DType dtype) { return !all_kernels_requested() && dtype == DType::f32; }

}  // namespace ruda::onednn::detail
