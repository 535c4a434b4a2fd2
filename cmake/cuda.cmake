# CUDA kernels: compiled by nvcc into a fatbin that the module loads with the
# driver API (libmlx links the CUDA runtime statically, so kernels registered by
# our own runtime would be invisible to MLX's graphs). AUTO turns this on when
# MLX has CUDA headers and nvcc exists.
if(FLASH_CCE_CUDA STREQUAL "AUTO")
  find_program(FLASH_CCE_NVCC nvcc HINTS /usr/local/cuda/bin)
  if(FLASH_CCE_NVCC AND EXISTS "${MLX_ROOT}/include/mlx/backend/cuda/device.h"
     AND EXISTS "${MLX_ROOT}/include/cccl")
    set(FLASH_CCE_CUDA ON)
  else()
    set(FLASH_CCE_CUDA OFF)
  endif()
endif()
message(STATUS "flash_cce CUDA kernels: ${FLASH_CCE_CUDA}")
if(NOT FLASH_CCE_CUDA)
  return()
endif()
if(EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/CMakeLists.txt")
  add_subdirectory(csrc/cuda)
endif()
