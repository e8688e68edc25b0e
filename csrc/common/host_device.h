// TF_HOST_DEVICE marks the functions shared by the CPU and CUDA kernels:
// __host__ __device__ under nvcc, nothing for the host compiler.
#pragma once

#ifdef __CUDACC__
#define TF_HOST_DEVICE __host__ __device__
#else
#define TF_HOST_DEVICE
#endif
