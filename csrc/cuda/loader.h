// Loading the kernels' fatbin and asking the GPU for its attributes.
#pragma once

#include <cuda.h>

#include <string>

#include "plan.h"

namespace flash_cce::cuda {

// Throws std::runtime_error naming `what` unless r is CUDA_SUCCESS.
void check(CUresult r, const char* what);

// The image of the fatbin that the driver picked for this GPU.
struct Image {
  int arch = 0;           // __CUDA_ARCH__ it was compiled for (e.g. 900, 800)
  int binary = 0;         // compute capability of the loaded machine code (e.g. 90)
  int device = 0;         // the GPU's compute capability
  bool jit = false;       // PTX compiled by the driver at load time
  bool wgmma = false;     // holds the Hopper kernels
};

// Kernel `name` of the fatbin (loaded for GPU `ordinal` at the first call),
// allowed `smem` bytes of dynamic shared memory.
CUfunction kernel_function(const std::string& name, int ordinal, int smem);

// The fatbin image the driver loaded for GPU `ordinal`.
const Image& loaded_image(int ordinal);

// The attributes the launch planning reads, asked once per GPU.
DeviceInfo device_info(int ordinal);

} // namespace flash_cce::cuda
