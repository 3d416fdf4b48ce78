/*
GPT-2's GELU (the tanh approximation) as standalone elementwise kernels, with the meanings of
gelu_forward/gelu_backward in llmc/gpt2_cpu.h.

Provides: gelu_forward (out = GELU(inp)) and gelu_backward (dinp = GELU'(inp) * dout, OVERWRITTEN
rather than added as on the CPU; dinp may be dout itself). Math in fp32 with tanhf; n a multiple of 8.
The matmul epilogues (matmul.cuh: GELU_AUX forward, DGELU backward) do the same work fused into the
matmuls; these kernels are for when the fusion is off and for checking it.

Does not provide: the exact (erf) GELU.
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

__device__ inline float gelu_grad(float x) {
    const float th = tanhf(kGeluScale * (x + kGeluCubic * x * x * x));
    const float dth = (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * dth;
}

static __global__ void gelu_forward_kernel(floatX* out, const floatX* inp, int64_t n) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    if (i >= n) return;
    const PackX x = load128(inp + i);
    PackX o;
    for (int k = 0; k < kPackX; k++) o[k] = __float2bfloat16_rn(gelu(float(x[k])));
    store128(out + i, o);
}

static __global__ void gelu_backward_kernel(floatX* dinp, const floatX* inp, const floatX* dout, int64_t n) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    if (i >= n) return;
    const PackX x = load128(inp + i);
    const PackX d = load128(dout + i);
    PackX o;
    for (int k = 0; k < kPackX; k++) o[k] = __float2bfloat16_rn(gelu_grad(float(x[k])) * float(d[k]));
    store128(dinp + i, o);
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

inline void gelu_backward(floatX* dinp, const floatX* inp, const floatX* dout, int64_t n, cudaStream_t stream) {
    require_pack_multiple(n, "gelu_backward: n");
    require_aligned16(dinp, "gelu_backward: dinp");
    require_aligned16(inp, "gelu_backward: inp");
    require_aligned16(dout, "gelu_backward: dout");
    if (n == 0) return;
    const int block = 256;
    gelu_backward_kernel<<<unsigned(ceil_div<int64_t>(n / kPackX, block)), block, 0, stream>>>(dinp, inp, dout, n);
    cudaCheckLaunch();
}

}  // namespace llmc
