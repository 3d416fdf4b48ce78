/*
What the Hopper-only kernels (llmc/flash_attention_sm90.cuh, llmc/classifier_sm90.cuh) share on the host.

Provides:
  sm90a_available():     true where sm_90a code can run: built for it (the Makefile does so for GPU_ARCH=90
                         and defines LLMC_SM90A) and the current device is compute 9.0.
  tensor_map_encoder():  the driver's cuTensorMapEncodeTiled (TMA descriptors), reached through the runtime
                         so that nothing links libcuda; fails with a message where the driver lacks it.

Does not provide: device code (each kernel header keeps its own wgmma and TMA wrappers).
*/
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only)
#include <cudaTypedefs.h>

#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

namespace llmc {

inline bool sm90a_available() {
#if defined(LLMC_SM90A)
    static const bool ok = [] {
        int dev = 0, major = 0, minor = 0;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        cudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        return major == 9 && minor == 0;
    }();
    return ok;
#else
    return false;
#endif
}

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
            fail(kExitCuda, "the driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12 or later)");
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    return encode;
}

}  // namespace llmc
