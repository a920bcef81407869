// The fused attention's exp pass (attention_kernel.h, exp_shifted) on the CPU's 16-lane AVX-512
// vectors in builds whose own vectors are 8 lanes wide. GCC 12 builds drop AVX-512 from ruda's code
// (CMakeLists.txt: it miscompiles constant vectors), so on an AVX-512 CPU Eigen's packet exp ran at
// half the width the CPU has; the softmax passes of the attention are exp-bound. This kernel is
// compiled for AVX-512 in a file of its own, chosen at run time by the CPU's features, and uses no
// Eigen code (whose inline functions compiled for two ISAs would be an ODR hazard).
#pragma once

#include <cstdint>

namespace ruda::kernels::attention::detail {

/// exp(row[c] - shift) in place for c in [0, n), with the exact operations of the 8-lane f32 kernel
/// (ops::detail::pexp_float_normal_range, fused multiply-adds included) lane for lane, and its
/// summation order: partial[l] receives the sum the 8-lane kernel's lane l holds (its packets in
/// order, then the tail's packet padded with -inf), for the caller to reduce across lanes as it
/// does. So the results are bit for bit the 8-lane kernel's.
using ExpShiftedWide = void (*)(float* row, std::int64_t n, float shift, float* partial);

/// The wide kernel where it applies: an x86-64 build with AVX2 and FMA but not AVX-512 (8-lane
/// Eigen packets with fused multiply-adds) on a CPU with AVX-512F. nullptr elsewhere.
ExpShiftedWide exp_shifted_wide();

}  // namespace ruda::kernels::attention::detail
