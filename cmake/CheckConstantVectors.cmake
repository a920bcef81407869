# ruda_check_constant_vectors(FLAGS): stops the configure step when the compiler, with FLAGS and
# optimization on, stores constant initializers wrongly. GCC 12 turned {100, 100, 100, 0} into four
# 100s (a broadcast of the first element) under some -mtune settings and with AVX-512, which left
# tensor shapes and kernel constants silently wrong; ruda's own flags avoid the known triggers
# (CMakeLists.txt), and this check catches any that remain on the CPU and compiler at hand.
include(CheckCXXSourceRuns)

function(ruda_check_constant_vectors flags)
  if(CMAKE_CROSSCOMPILING)
    return()  # nothing to run the probe on
  endif()
  string(REPLACE ";" " " flag_text "${flags}")
  foreach(level -O2 -O3)
    # One result per compiler, flags and level: changing RUDA_MARCH checks again.
    string(MD5 key "${CMAKE_CXX_COMPILER} ${CMAKE_CXX_COMPILER_VERSION} ${level} ${flag_text}")
    set(result_var "RUDA_CONSTANT_VECTORS_OK_${key}")
    set(CMAKE_REQUIRED_FLAGS "${level} ${flag_text}")
    set(CMAKE_REQUIRED_QUIET ON)
    check_cxx_source_runs([=[
#include <cstddef>
#include <cstdint>
#include <vector>
// noipa: the callee reads the bytes the vector holds; nothing is folded across the call. The
// expected values are static data, read element by element, never stored as a vector constant.
template <class T>
__attribute__((noipa)) bool same(const std::vector<T>& v, const T* expected, std::size_t n) {
  if (v.size() != n) return false;
  for (std::size_t i = 0; i < n; ++i)
    if (v[i] != expected[i]) return false;
  return true;
}
static const std::int64_t shape[] = {100, 100, 100, 0};
static const double coefficients[] = {1, 1, 0, 0};
static const float mask[] = {1, 1, 1, 1, 1, 1, 1, 0};
static const std::int32_t lanes[] = {7, 7, 7, 7, 7, 7, 7, 1};
static const std::int64_t wide[] = {5, 5, 5, 5, 5, 5, 5, 9};
int main() {
  // A shape with a trailing zero extent, a coefficient table, masks: the patterns GCC 12 broadcast.
  const bool ok = same(std::vector<std::int64_t>{100, 100, 100, 0}, shape, 4) &&
                  same(std::vector<double>{1, 1, 0, 0}, coefficients, 4) &&
                  same(std::vector<float>{1, 1, 1, 1, 1, 1, 1, 0}, mask, 8) &&
                  same(std::vector<std::int32_t>{7, 7, 7, 7, 7, 7, 7, 1}, lanes, 8) &&
                  same(std::vector<std::int64_t>{5, 5, 5, 5, 5, 5, 5, 9}, wide, 8);
  return ok ? 0 : 1;
}
]=] ${result_var})
    if(NOT ${result_var})
      message(FATAL_ERROR
        "ruda: ${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION} with '${level} ${flag_text}' stores constant "
        "vectors wrongly on this machine (it broadcasts their first element; a known GCC 12 defect under some "
        "-mtune and AVX-512 settings), so ruda would compute with wrong shapes and constants. Configure with "
        "-DRUDA_MARCH=x86-64-v3 (or another -march whose tuning is unaffected), or use GCC 13 or newer.")
    endif()
  endforeach()
endfunction()
