// Block order of the forward-only kernels: plain integer arithmetic, shared by
// the kernels and the host tests.
#pragma once

#include <algorithm>

#ifdef __CUDACC__
#define FCCE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FCCE_HOST_DEVICE inline
#endif

namespace flash_cce::cuda {

struct FwdBlock {
  int mt, split;
};

// The (m tile, split) of forward block b of p.m_tiles x p.splits. Blocks run
// in groups of p.m_group m tiles, the m tile fastest within a group: the rows
// of h in flight are those of one group, and each split's W tiles are read by
// the group's blocks together. m_group = m_tiles gives the plain m-fastest
// order. P: anything with those three int fields (FwdParams in the kernels).
template <class P>
FCCE_HOST_DEVICE FwdBlock fwd_block(const P& p, int b) {
  const int per = p.m_group * p.splits, g = b / per, r = b - g * per;
#ifdef __CUDA_ARCH__
  const int gm = min(p.m_group, p.m_tiles - g * p.m_group);
#else
  const int gm = std::min(p.m_group, p.m_tiles - g * p.m_group);
#endif
  return {g * p.m_group + r % gm, r / gm};
}

} // namespace flash_cce::cuda
