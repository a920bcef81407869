# ctest driver: install ruda into a fresh prefix, then configure, build and run the consumer.
#   cmake -DRUDA_BUILD=<build dir> -DSOURCE=<this dir> -DWORK=<scratch dir> [-DFLAGS=...] [-DLINK_FLAGS=...] -P run.cmake
# FLAGS and LINK_FLAGS are the ruda build's own (a sanitizer build's consumer must use the sanitizer too).
file(REMOVE_RECURSE "${WORK}")
foreach(step
    "${CMAKE_COMMAND};--install;${RUDA_BUILD};--prefix;${WORK}/prefix"
    "${CMAKE_COMMAND};-S;${SOURCE};-B;${WORK}/build;-G;Ninja;-DCMAKE_BUILD_TYPE=Release;-DCMAKE_PREFIX_PATH=${WORK}/prefix;-DCMAKE_CXX_FLAGS=${FLAGS};-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}"
    "${CMAKE_COMMAND};--build;${WORK}/build"
    "${WORK}/build/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "step failed (${result}): ${step}\n${out}\n${err}")
  endif()
  message("${out}")
endforeach()
