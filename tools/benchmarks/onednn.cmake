# oneDNN suites of ruda-bench (included by tools/CMakeLists.txt). The direct-oneDNN peers call
# oneDNN themselves, so the bench links it too.
if(RUDA_HAVE_ONEDNN)
  target_sources(ruda-bench PRIVATE ${CMAKE_CURRENT_LIST_DIR}/bench_onednn.cpp)
  target_link_libraries(ruda-bench PRIVATE DNNL::dnnl)
endif()
