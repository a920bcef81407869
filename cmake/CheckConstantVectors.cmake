# ruda_check_constant_vectors(FLAGS): stops the configure step when the compiler, with FLAGS and
# optimization on, stores constant initializers wrongly. GCC 12 turned {100, 100, 100, 0} into four
# 100s (a broadcast of the first element) under some -mtune settings and with AVX-512, which left
# tensor shapes and kernel constants silently wrong; ruda's own flags avoid the known triggers
# (CMakeLists.txt), and this probe catches any that remain on the CPU and compiler at hand.
#
# Only a probe that builds, runs and reports a wrong element (exit code 3) is a miscompile; a probe
# that fails to build or run (a sanitizer's runtime refusing to start, say) is reported as such, with
# its output. Passing verdicts are cached per compiler, flags and CPU; failures never are, so fixing
# the cause and configuring again checks again.

set(RUDA_CONSTANT_VECTORS_SOURCE [=[
#include <cstddef>
#include <cstdint>
#include <vector>
// The callee reads the bytes the vector holds; nothing is folded across the call. The expected
// values are static data, read element by element, never stored as a vector constant.
#if defined(__has_attribute)
#if __has_attribute(noipa)
#define RUDA_PROBE_OPAQUE __attribute__((noipa))
#endif
#endif
#ifndef RUDA_PROBE_OPAQUE
#define RUDA_PROBE_OPAQUE __attribute__((noinline))
#endif
template <class T>
RUDA_PROBE_OPAQUE bool same(const std::vector<T>& v, const T* expected, std::size_t n) {
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
  return ok ? 0 : 3;
}
]=])

function(ruda_check_constant_vectors flags)
  if(CMAKE_CROSSCOMPILING AND NOT CMAKE_CROSSCOMPILING_EMULATOR)
    message(STATUS "ruda: cross-compiling without an emulator: the constant-vector probe is not run")
    return()
  endif()
  string(REPLACE ";" " " flag_text "${flags}")
  # -march=native means this CPU: a build folder reused on another CPU checks again.
  cmake_host_system_information(RESULT cpu QUERY PROCESSOR_DESCRIPTION)
  set(probe_dir "${CMAKE_BINARY_DIR}/CMakeFiles/ruda_constant_vectors")
  file(WRITE "${probe_dir}/probe.cpp" "${RUDA_CONSTANT_VECTORS_SOURCE}")
  foreach(level -O2 -O3)
    string(MD5 key "${CMAKE_CXX_COMPILER} ${CMAKE_CXX_COMPILER_VERSION} ${level} ${flag_text} ${CMAKE_CXX_FLAGS} \
${CMAKE_EXE_LINKER_FLAGS} ${cpu}")
    set(verdict "RUDA_CONSTANT_VECTORS_OK_${key}")
    if(${verdict})
      continue()
    endif()
    separate_arguments(level_and_flags UNIX_COMMAND "${level} ${flag_text}")
    try_run(run_result compiled "${probe_dir}/build${level}" "${probe_dir}/probe.cpp"
            COMPILE_DEFINITIONS ${level_and_flags}
            COMPILE_OUTPUT_VARIABLE compile_output
            RUN_OUTPUT_VARIABLE run_output)
    if(NOT compiled)
      message(FATAL_ERROR "ruda: the constant-vector probe (cmake/CheckConstantVectors.cmake) did not build with "
                          "'${level} ${flag_text}':\n${compile_output}")
    endif()
    if(run_result STREQUAL "3")
      message(FATAL_ERROR
        "ruda: ${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION} with '${level} ${flag_text}' stores constant "
        "vectors wrongly on this machine (it broadcasts their first element; a known GCC 12 defect under some "
        "-mtune and AVX-512 settings), so ruda would compute with wrong shapes and constants. Keep "
        "RUDA_GCC12_NO_AVX512 ON (it adds -mno-avx512f -mtune=generic with GCC < 13), configure with another "
        "RUDA_MARCH (e.g. -DRUDA_MARCH=x86-64-v3), or use GCC 13 or newer.")
    elseif(NOT run_result STREQUAL "0")
      message(FATAL_ERROR "ruda: the constant-vector probe (cmake/CheckConstantVectors.cmake) built with "
                          "'${level} ${flag_text}' but did not run to its end (result '${run_result}'):\n${run_output}")
    endif()
    set(${verdict} TRUE CACHE INTERNAL "constant vectors stored correctly with these flags")
  endforeach()
  message(STATUS "ruda: constant vectors are stored correctly with '${flag_text}' at -O2 and -O3")
endfunction()
