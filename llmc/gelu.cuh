/*
GPT-2's tanh GELU as an elementwise kernel (gelu_forward, n a multiple of 8), which the model runs to
recompute the MLP's GELU output in backward (-r 1); forward and backward otherwise use the matmuls'
cuBLASLt epilogues (llmc/matmul.cuh).
*/
#pragma once

#include <cstdint>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

namespace llmc {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

__device__ inline float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + kGeluCubic * x * x * x)));
}

static __global__ void gelu_forward_kernel(floatX* out, const floatX* inp, int64_t n) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    if (i >= n) return;
    const PackX x = load128(inp + i);
    PackX o;
    for (int k = 0; k < kPackX; k++) o[k] = __float2bfloat16_rn(gelu(float(x[k])));
    store128(out + i, o);
}

inline void gelu_forward(floatX* out, const floatX* inp, int64_t n, cudaStream_t stream) {
    require_pack_multiple(n, "gelu_forward: n");
    require_aligned16(out, "gelu_forward: out");
    require_aligned16(inp, "gelu_forward: inp");
    if (n == 0) return;
    const int block = 256;
    gelu_forward_kernel<<<unsigned(ceil_div<int64_t>(n / kPackX, block)), block, 0, stream>>>(out, inp, n);
    cudaCheckLaunch();
}

}  // namespace llmc
