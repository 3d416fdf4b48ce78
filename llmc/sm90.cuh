/*
What the Hopper-only kernels share on the host: sm90a_available() (built for sm_90a, LLMC_SM90A, and
running on compute 9.0) and tensor_map_encoder() (the driver's cuTensorMapEncodeTiled, reached through
the runtime so nothing links libcuda).
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
