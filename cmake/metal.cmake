# Metal kernels. metal/*.metal and the MLX headers they include are joined at
# build time into one source (cmake/metal_inline.py) that the module embeds and
# Metal compiles at first use, so no Xcode is needed to build. Where Xcode's
# Metal compiler works, a flash_cce.metallib is also built from that same
# source and installed beside the module; the runtime prefers it.
# AUTO turns this on when building for Apple with MLX's Metal headers.
set(FLASH_CCE_METAL "AUTO" CACHE STRING "Metal kernels: AUTO, ON or OFF")
set(FLASH_CCE_METALLIB "AUTO" CACHE STRING
    "Also build flash_cce.metallib: AUTO (where xcrun metal works), ON or OFF")
set(FLASH_CCE_MACOS_STUBS "" CACHE PATH
    "Stand-ins for SDK headers and libobjc (.ci/macos-stubs), for the macOS compile check on Linux only")

set(_fcce_mlx_metal "${MLX_ROOT}/include/mlx/backend/metal/device.h")
if(FLASH_CCE_METAL STREQUAL "AUTO")
  if(APPLE AND EXISTS "${_fcce_mlx_metal}" AND EXISTS "${MLX_ROOT}/include/metal_cpp")
    set(FLASH_CCE_METAL ON)
  else()
    set(FLASH_CCE_METAL OFF)
  endif()
endif()
message(STATUS "flash_cce Metal kernels: ${FLASH_CCE_METAL}")
if(NOT FLASH_CCE_METAL)
  return()
endif()
if(NOT EXISTS "${_fcce_mlx_metal}" OR NOT EXISTS "${MLX_ROOT}/include/metal_cpp")
  message(FATAL_ERROR "FLASH_CCE_METAL=ON needs MLX's Metal headers and metal_cpp "
                      "(the macOS mlx wheel); ${MLX_ROOT}/include has none")
endif()

# The kernels as one self-contained source: a C++ header for the module and a
# .metal file for the metallib.
file(GLOB _fcce_metal_sources CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/metal/*.metal")
file(GLOB _fcce_metal_headers CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/metal/*.h")
list(SORT _fcce_metal_sources)
set(_fcce_gen "${CMAKE_CURRENT_BINARY_DIR}/metal")
set(_fcce_source_h "${_fcce_gen}/flash_cce_metal_source.h")
set(_fcce_source_metal "${_fcce_gen}/flash_cce.metal")
add_custom_command(
  OUTPUT "${_fcce_source_metal}" "${_fcce_source_h}"
  COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/cmake/metal_inline.py"
          -I "${MLX_ROOT}/include" -o "${_fcce_source_metal}" --cpp "${_fcce_source_h}"
          --depfile "${_fcce_gen}/flash_cce_metal.d" ${_fcce_metal_sources}
  DEPENDS ${_fcce_metal_sources} ${_fcce_metal_headers}
          "${CMAKE_CURRENT_SOURCE_DIR}/cmake/metal_inline.py"
  DEPFILE "${_fcce_gen}/flash_cce_metal.d"
  COMMENT "Inlining metal/*.metal and MLX's Metal headers into one source"
  VERBATIM)

target_sources(flash_cce_core PRIVATE
  csrc/metal/metal_head.cpp csrc/metal/kernel_source.cpp "${_fcce_source_h}")
target_compile_definitions(flash_cce_core PUBLIC FLASH_CCE_METAL PRIVATE _METAL_)
target_include_directories(flash_cce_core PRIVATE "${_fcce_gen}" "${MLX_ROOT}/include/metal_cpp")

if(FLASH_CCE_MACOS_STUBS)
  # Cross check on Linux: stand-in SDK headers, and a libobjc stub for the
  # objc_msgSend that metal-cpp calls.
  target_include_directories(flash_cce_core SYSTEM PRIVATE "${FLASH_CCE_MACOS_STUBS}")
  target_link_directories(flash_cce_core PUBLIC "${FLASH_CCE_MACOS_STUBS}")
  target_link_libraries(flash_cce_core PUBLIC objc)
  set(FLASH_CCE_METALLIB OFF)
else()
  target_link_libraries(flash_cce_core PUBLIC "-framework Metal" "-framework Foundation" objc)
endif()

# The metallib, built from the very source the module embeds. A Metal compiler
# that rejects it must not fail the install: the module then compiles the
# source at run time, and the self-check decides.
if(FLASH_CCE_METALLIB STREQUAL "AUTO")
  execute_process(COMMAND xcrun -sdk macosx metal --version
                  RESULT_VARIABLE _fcce_xcrun OUTPUT_QUIET ERROR_QUIET)
  if(_fcce_xcrun EQUAL 0)
    set(FLASH_CCE_METALLIB ON)
  else()
    set(FLASH_CCE_METALLIB OFF)
  endif()
endif()
message(STATUS "flash_cce metallib: ${FLASH_CCE_METALLIB}")
if(FLASH_CCE_METALLIB)
  set(_fcce_min_macos "${CMAKE_OSX_DEPLOYMENT_TARGET}")
  if(NOT _fcce_min_macos)
    set(_fcce_min_macos 14.0) # bfloat needs Metal 3.1 (macOS 14), as MLX's wheel
  endif()
  set(_fcce_stamp "${_fcce_gen}/flash_cce.metallib.stamp")
  add_custom_command(
    OUTPUT "${_fcce_stamp}"
    COMMAND "${CMAKE_COMMAND}" -DSOURCE=${_fcce_source_metal}
            -DOUTPUT=${_fcce_gen}/flash_cce.metallib -DMIN_MACOS=${_fcce_min_macos}
            -DSTAMP=${_fcce_stamp} -P "${CMAKE_CURRENT_SOURCE_DIR}/cmake/metallib.cmake"
    DEPENDS "${_fcce_source_metal}" "${CMAKE_CURRENT_SOURCE_DIR}/cmake/metallib.cmake"
    COMMENT "Building flash_cce.metallib"
    VERBATIM)
  add_custom_target(flash_cce_metallib DEPENDS "${_fcce_stamp}")
  add_dependencies(flash_cce_core flash_cce_metallib)
  install(FILES "${_fcce_gen}/flash_cce.metallib" DESTINATION . OPTIONAL)
endif()
