# ctest driver: install ruda into a fresh prefix, then configure, build and run the consumers as a
# user would, without LD_LIBRARY_PATH: README's example, a sharded training check, the MPI one
# under mpiexec -n 2 (where ruda::mpi was built), and the installed ruda-train --help (where the
# tools were built).
#   cmake -DRUDA_BUILD=<build dir> -DSOURCE=<this dir> -DREADME=<README.md> -DWORK=<scratch dir>
#         [-DFLAGS=...] [-DLINK_FLAGS=...] [-DMPIEXEC=...] [-DSTATIC_FROM=<ruda source> [-DWERROR=ON]]
#         -P run.cmake
# FLAGS and LINK_FLAGS are the ruda build's own (a sanitizer build's consumer must use the sanitizer too).
# STATIC_FROM: instead of installing RUDA_BUILD, build the libraries alone from that source tree
# as README says (-DBUILD_SHARED_LIBS=OFF and the RUDA_BUILD_* options off), install them, and
# consume that static package: its private dependencies are found by the package itself.
file(REMOVE_RECURSE "${WORK}")
unset(ENV{LD_LIBRARY_PATH})

# README's example: the first C++ block that includes <ruda/nn.h>, compiled as it stands.
file(READ "${README}" readme)
string(REGEX MATCH "```cpp\n(#include <ruda/nn.h>[^`]*)```" found "${readme}")
if(NOT found)
  message(FATAL_ERROR "${README} has no C++ example that includes <ruda/nn.h>")
endif()
file(WRITE "${WORK}/readme_example.cpp" "${CMAKE_MATCH_1}")
# Its snippets that are not whole programs, each compiled inside readme_snippets.cpp.
foreach(snippet "readme_sharded_gpt;nn::DeferredInit deferred;" "readme_shard_mesh;const ShardMesh mesh")
  list(GET snippet 0 name)
  list(GET snippet 1 start)
  string(FIND "${readme}" "```cpp\n${start}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${README} has no C++ snippet that starts with '${start}'")
  endif()
  math(EXPR at "${at} + 7")
  string(SUBSTRING "${readme}" ${at} -1 rest)
  string(FIND "${rest}" "```" end)
  string(SUBSTRING "${rest}" 0 ${end} code)
  file(WRITE "${WORK}/snippets/${name}.inc" "${code}")
endforeach()

set(prefix "${WORK}/prefix")
function(run_step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    string(REPLACE ";" " " shown "${ARGN}")
    message(FATAL_ERROR "step failed (${result}): ${shown}\n${out}\n${err}")
  endif()
  message("${out}")
endfunction()

if(STATIC_FROM)
  run_step(${CMAKE_COMMAND} -S ${STATIC_FROM} -B ${WORK}/ruda-static -G Ninja -DCMAKE_BUILD_TYPE=Release
           -DBUILD_SHARED_LIBS=OFF -DRUDA_BUILD_TESTS=OFF -DRUDA_BUILD_TOOLS=OFF -DRUDA_BUILD_BENCHMARKS=OFF
           -DRUDA_WERROR=${WERROR})
  run_step(${CMAKE_COMMAND} --build ${WORK}/ruda-static --parallel 2)
  run_step(${CMAKE_COMMAND} --install ${WORK}/ruda-static --prefix ${prefix})
else()
  run_step(${CMAKE_COMMAND} --install ${RUDA_BUILD} --prefix ${prefix})
endif()
run_step(${CMAKE_COMMAND} -S ${SOURCE} -B ${WORK}/build -G Ninja -DCMAKE_BUILD_TYPE=Release
         -DCMAKE_PREFIX_PATH=${prefix} "-DCMAKE_CXX_FLAGS=${FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}"
         -DREADME_EXAMPLE=${WORK}/readme_example.cpp -DREADME_SNIPPETS=${WORK}/snippets)
run_step(${CMAKE_COMMAND} --build ${WORK}/build)
run_step(${WORK}/build/readme_example)
run_step(${WORK}/build/readme_snippets)
run_step(${WORK}/build/consumer)
if(EXISTS ${WORK}/build/consumer_hidden)
  run_step(${WORK}/build/consumer_hidden)
endif()
if(EXISTS ${WORK}/build/consumer_mpi)
  if(NOT MPIEXEC)
    message(FATAL_ERROR "ruda::mpi was built but no mpiexec was given")
  endif()
  run_step(${MPIEXEC} -n 2 --oversubscribe --bind-to none --mca btl self,vader ${WORK}/build/consumer_mpi)
endif()
if(EXISTS ${prefix}/bin/ruda-train)
  run_step(${prefix}/bin/ruda-train --help)
  run_step(${prefix}/bin/ruda-ckpt --help)
endif()
