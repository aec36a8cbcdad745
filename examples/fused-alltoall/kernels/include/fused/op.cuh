// The reduction the fused all-to-all applies: found through the include
// folder the example hands NVRTC (CompileOptions::include_dirs) or nvcc
// (-I), not through gin's headers. FUSED_SCALE comes from a define.
#pragma once

#ifndef FUSED_SCALE
#error "FUSED_SCALE must be defined (CompileOptions::defines, or -DFUSED_SCALE=...)"
#endif

#ifdef FUSED_USE_CCCL
// CCCL (libcu++), where it was found: CUDA_HOME/include/cccl or the NVRTC
// wheel's include/cccl.
#include <cuda/std/functional>
using FusedPlus = cuda::std::plus<float>;
#else
struct FusedPlus {
  __device__ float operator()(float a, float b) const { return a + b; }
};
#endif

namespace fused {
// out = FUSED_SCALE * (acc + x)
__device__ __forceinline__ float add(float acc, float x) { return FusedPlus{}(acc, x); }
__device__ __forceinline__ float finish(float acc) { return acc * (float)FUSED_SCALE; }
}  // namespace fused
