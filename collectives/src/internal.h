// Pieces shared by the communicators: reduction kernels and the wording of errors.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ruda/collectives.h>
#include <ruda/dtype.h>

namespace ruda::collectives_detail {

/// dst[i] = sources[0][i] + sources[1][i] + ... in the order given (bit-reproducible). 16-bit
/// floats add in f32 and round once (Accumulate::f32) or round after every addition (native);
/// i64 wraps around. dst may be one of the sources (same index, same element); count may be 0.
void sum(const void* const* sources, int n, void* dst, std::int64_t count, DType dtype, Accumulate accumulate);
/// dst[i] = the largest of the sources' elements, NaN if any of them is NaN. dst may be a source.
void max(const void* const* sources, int n, void* dst, std::int64_t count, DType dtype);

/// The type partial sums travel in: f32 for 16-bit floats accumulated in f32, else the dtype.
DType partial_type(DType dtype, Accumulate accumulate);
/// dst = partial + own elementwise: one step of a ring. `partial` holds partial_type values,
/// `own` the dtype's; dst is either (partial_type for the next step, the dtype for the result).
/// dst may be `partial` itself.
void add_partial(const void* partial, const void* own, void* dst, DType dst_type, std::int64_t count, DType dtype,
                 Accumulate accumulate);
/// dst = src converted between any of f32, f64, bf16, f16 and i64 of equal kind (a plain copy when equal).
void convert(const void* src, DType from, void* dst, DType to, std::int64_t count);

/// Copies bytes; large copies (`streaming`) write past the caches (non-temporal stores), which on
/// copies of many MiB is up to twice as fast as memcpy and leaves the caches to other data.
/// Ends with a store fence, so the bytes are visible to other threads after the next release.
void copy(void* dst, const void* src, std::size_t bytes, bool streaming);
/// Outputs of at least this many bytes are written with streaming stores.
inline constexpr std::size_t kStreamingBytes = std::size_t(8) << 20;

/// all_gather(f32, 8192, "layers.3.weight"), reduce_scatter(bf16, 4096, native), broadcast(f32, 8, root 1).
std::string describe(const char* op, DType dtype, std::int64_t count, const std::string& extra, const std::string& tag);
/// An order-check fingerprint with the call's shape after a separator ("#17 all_gather(f32, 6)\x1f[2, 3]"),
/// the fingerprint without it, and with it shown as text ("#17 all_gather(f32, 6) of [2, 3]").
std::string with_shape(std::string fingerprint, const std::string& shape);
std::string without_shape(const std::string& fingerprint);
std::string shape_shown(const std::string& fingerprint);
/// The two-sided message of a mismatch: ranks with the same call are grouped,
/// "collective #17 differs: rank 0 all_gather(...), rank 1 reduce_scatter(...)".
std::string mismatch_message(std::uint64_t sequence, const std::vector<std::string>& calls);
/// "#17 all_gather(...)": a call with its sequence number, as in histories and fingerprints.
std::string numbered(std::uint64_t sequence, const std::string& call);
/// Splits a fingerprint "#17 all_gather(...)" into 17 and "all_gather(...)" (0 and the whole
/// text if it does not start with a number).
std::pair<std::uint64_t, std::string> split_fingerprint(const std::string& fingerprint);
/// "rank 2" or "ranks 1, 3".
std::string rank_list(const std::vector<int>& ranks);
/// Why the parser would refuse this link model ("a bandwidth below 1 bit/s"), or "" when it is
/// off (bandwidth 0) or usable: a bandwidth of at least 1 bit/s, a latency within [0, 1 hour].
std::string link_problem(const LinkModel& link);

}  // namespace ruda::collectives_detail
