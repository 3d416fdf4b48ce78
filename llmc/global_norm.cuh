/*
The global L2 norm of the gradients and the clipping factor, on the device so the host need not wait.
global_norm() reads one flat bf16 buffer of n gradients and writes norm = sqrt(sum of squares) / ranks
and scale = clip / ranks (clip = max_norm / norm when 0 < max_norm < norm, else 1: cpu/gpt2_cpu.h's
clip_scale); scale can go straight to adamw_update. With data parallel the buffer holds the ranks' sum
(a bf16 mean would round by 1/W), so both divide by W in fp32. Two fixed-order stages (a fixed block
count), no atomics: bitwise reproducible on every GPU. For ZeRO-1, global_norm_sumsq() and
global_norm_finish() split it around the caller's all-reduce, with the same bits.
*/
#pragma once

#include <cstdint>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

namespace llmc {

constexpr int kGlobalNormBlocks = 512;
constexpr int kGlobalNormBlock = 512;

// Scratch global_norm needs: one fp32 partial per block.
constexpr size_t kGlobalNormScratchBytes = kGlobalNormBlocks * sizeof(float);

static __global__ void __launch_bounds__(kGlobalNormBlock)
    global_norm_partial_kernel(float* partial, const floatX* g, int64_t n) {
    const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t packs = n / kPackX;
    float s = 0.0f;
    for (int64_t p = tid; p < packs; p += stride) {
        const PackX x = load128cs(g + p * kPackX);
        for (int k = 0; k < kPackX; k++) {
            const float v = float(x[k]);
            s += v * v;
        }
    }
    const int64_t tail = packs * kPackX + tid;
    if (tail < n) {
        const float v = float(g[tail]);
        s += v * v;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// The sum of the partials, in one fixed order; thread 0's value is the one to use.
__device__ inline float global_norm_sum_partials(const float* partial) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < kGlobalNormBlocks; i += blockDim.x) s += partial[i];
    return block_sum(s);
}

__device__ inline void global_norm_store(float* norm, float* scale, float sumsq, float max_norm, int ranks) {
    const float nrm = sqrtf(sumsq) / float(ranks);
    if (norm != nullptr) *norm = nrm;
    const float clip = (max_norm > 0.0f && nrm > max_norm) ? max_norm / nrm : 1.0f;
    if (scale != nullptr) *scale = clip / float(ranks);
}

static __global__ void __launch_bounds__(kGlobalNormBlock)
    global_norm_final_kernel(float* norm, float* scale, const float* partial, float max_norm, int ranks) {
    const float s = global_norm_sum_partials(partial);
    if (threadIdx.x == 0) global_norm_store(norm, scale, s, max_norm, ranks);
}

static __global__ void __launch_bounds__(kGlobalNormBlock)
    global_norm_sumsq_kernel(float* sumsq, const float* partial) {
    const float s = global_norm_sum_partials(partial);
    if (threadIdx.x == 0) *sumsq = s;
}

static __global__ void global_norm_finish_kernel(float* norm, float* scale, const float* sumsq, float max_norm,
                                                 int ranks) {
    global_norm_store(norm, scale, *sumsq, max_norm, ranks);
}

inline void check_global_norm_ranks(int ranks, const char* who) {
    if (ranks < 1) fail(kExitUsage, "%s: ranks %d, need at least 1", who, ranks);
}

// The first stage of global_norm and global_norm_sumsq: scratch checked, the partial sums into it.
inline void global_norm_partials(const char* fn, const floatX* grads, int64_t n, float* scratch, size_t scratch_bytes,
                                 cudaStream_t stream) {
    if (scratch_bytes < kGlobalNormScratchBytes) {
        fail(kExitUsage, "%s: scratch of %zu bytes, needs %zu", fn, scratch_bytes, kGlobalNormScratchBytes);
    }
    global_norm_partial_kernel<<<kGlobalNormBlocks, kGlobalNormBlock, 0, stream>>>(scratch, grads, n);
    cudaCheckLaunch();
}

// norm and scale (either may be null) from grads (n bf16, 16-byte aligned), the sum of `ranks` ranks'
// gradients. scratch: kGlobalNormScratchBytes.
inline void global_norm(float* norm, float* scale, const floatX* grads, int64_t n, float max_norm, float* scratch,
                        size_t scratch_bytes, cudaStream_t stream, int ranks = 1) {
    require_aligned16(grads, "global_norm: grads");
    check_global_norm_ranks(ranks, "global_norm");
    global_norm_partials("global_norm", grads, n, scratch, scratch_bytes, stream);
    global_norm_final_kernel<<<1, kGlobalNormBlock, 0, stream>>>(norm, scale, scratch, max_norm, ranks);
    cudaCheckLaunch();
}

// *sumsq = the sum of squares of grads[0, n) (n may be 0). scratch as for global_norm.
inline void global_norm_sumsq(float* sumsq, const floatX* grads, int64_t n, float* scratch, size_t scratch_bytes,
                              cudaStream_t stream) {
    require_aligned16(grads, "global_norm_sumsq: grads");
    global_norm_partials("global_norm_sumsq", grads, n, scratch, scratch_bytes, stream);
    global_norm_sumsq_kernel<<<1, kGlobalNormBlock, 0, stream>>>(sumsq, scratch);
    cudaCheckLaunch();
}

// norm and scale (either may be null) from a sum of squares on the device, of gradients summed over
// `ranks` ranks (as for global_norm).
inline void global_norm_finish(float* norm, float* scale, const float* sumsq, float max_norm, cudaStream_t stream,
                               int ranks = 1) {
    check_global_norm_ranks(ranks, "global_norm_finish");
    global_norm_finish_kernel<<<1, 1, 0, stream>>>(norm, scale, sumsq, max_norm, ranks);
    cudaCheckLaunch();
}

}  // namespace llmc
