# Collective benchmarks (included by tools/CMakeLists.txt): the emulated-ranks suite joins
# ruda-bench; the MPI suites are ruda-bench-mpi, to run under mpiexec (rank 0 prints).
# cluster-calibrate (bench_cluster_mpi.cpp) runs through tools/cluster-sim calibrate.
target_sources(ruda-bench PRIVATE ${CMAKE_CURRENT_LIST_DIR}/bench_collectives.cpp)

if(RUDA_HAVE_MPI)
  add_executable(ruda-bench-mpi $<TARGET_OBJECTS:ruda_bench_main> ${CMAKE_CURRENT_LIST_DIR}/bench_collectives_mpi.cpp
                                ${CMAKE_CURRENT_LIST_DIR}/bench_train_mpi.cpp ${CMAKE_CURRENT_LIST_DIR}/bench_cluster_mpi.cpp
                                ${CMAKE_CURRENT_LIST_DIR}/bench_overlap_mpi.cpp ${CMAKE_CURRENT_LIST_DIR}/bench_hybrid_mpi.cpp)
  target_link_libraries(ruda-bench-mpi PRIVATE ruda ruda_mpi ruda_options MPI::MPI_CXX CLI11::CLI11
                        nlohmann_json::nlohmann_json)
endif()
