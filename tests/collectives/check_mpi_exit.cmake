# Runs an MPI job and checks how it ends: cmake -DMPIEXEC=... -DRANKS=n -DPROGRAM=... -DMODE=...
#   -DEXPECT_EXIT=zero|nonzero [-DEXPECT_OUTPUT=fragment]
# A job that hangs is killed after 60 s and fails the check, as does a job that exits the wrong way.
execute_process(
  COMMAND ${MPIEXEC} -n ${RANKS} --oversubscribe --bind-to none --mca btl self,vader ${PROGRAM} ${MODE}
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
message(STATUS "exit: ${result}\n--- stdout\n${out}--- stderr\n${err}")
if(NOT result MATCHES "^[0-9]+$")
  message(FATAL_ERROR "the job did not end by itself: ${result}")
endif()
if(EXPECT_EXIT STREQUAL "zero" AND NOT result EQUAL 0)
  message(FATAL_ERROR "expected exit 0, got ${result}")
endif()
if(EXPECT_EXIT STREQUAL "nonzero" AND result EQUAL 0)
  message(FATAL_ERROR "expected a non-zero exit, got 0")
endif()
if(DEFINED EXPECT_OUTPUT)
  string(FIND "${out}${err}" "${EXPECT_OUTPUT}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the output lacks '${EXPECT_OUTPUT}'")
  endif()
endif()
