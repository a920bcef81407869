# ctest driver: install ruda into a fresh prefix, then configure, build and run the consumer.
#   cmake -DRUDA_BUILD=<build dir> -DSOURCE=<this dir> -DWORK=<scratch dir> -P run.cmake
file(REMOVE_RECURSE "${WORK}")
foreach(step
    "${CMAKE_COMMAND};--install;${RUDA_BUILD};--prefix;${WORK}/prefix"
    "${CMAKE_COMMAND};-S;${SOURCE};-B;${WORK}/build;-G;Ninja;-DCMAKE_BUILD_TYPE=Release;-DCMAKE_PREFIX_PATH=${WORK}/prefix"
    "${CMAKE_COMMAND};--build;${WORK}/build"
    "${WORK}/build/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "step failed (${result}): ${step}\n${out}\n${err}")
  endif()
  message("${out}")
endforeach()
