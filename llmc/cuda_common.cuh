/*
What every GPU layer kernel shares: floatX (bf16, the type of parameters, gradients and activations),
Pack128<T> with load128/store128 for 16-byte access, warp and block reductions in a fixed order (no
atomics), ceil_div and round_up, launcher argument checks, rand.h's counter-based RNG, and
stochastic_round_bf16 (expected result x). Kernels in these headers are `static`, so several translation
units may include the same header. Error checks: cuda_utils.cuh.
*/
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "llmc/cuda_utils.cuh"
#include "llmc/rand.h"
#include "llmc/utils.h"

namespace llmc {

using floatX = __nv_bfloat16;

constexpr int kWarpSize = 32;

template <class T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

template <class T>
__host__ __device__ constexpr T round_up(T a, T b) {
    return ceil_div(a, b) * b;
}

// Sub-buffers carved out of one scratch allocation start on 256-byte boundaries (cudaMalloc's alignment).
inline size_t align256(size_t bytes) { return round_up<size_t>(bytes, 256); }

// 16 bytes of T: the unit of the widest single load or store instruction.
template <class T>
struct alignas(16) Pack128 {
    static constexpr int size = int(16 / sizeof(T));
    T v[size];

    __device__ T& operator[](int i) { return v[i]; }
    __device__ const T& operator[](int i) const { return v[i]; }
};
using PackX = Pack128<floatX>;  // 8 bf16
constexpr int kPackX = PackX::size;

template <class T>
__device__ inline Pack128<T> load128(const T* p) {
    return *reinterpret_cast<const Pack128<T>*>(p);
}

// Streaming load: the data will not be reused soon, so it should not evict what will.
template <class T>
__device__ inline Pack128<T> load128cs(const T* p) {
    int4 raw = __ldcs(reinterpret_cast<const int4*>(p));
    Pack128<T> out;
    memcpy(&out, &raw, sizeof(out));
    return out;
}

template <class T>
__device__ inline void store128(T* p, const Pack128<T>& x) {
    *reinterpret_cast<Pack128<T>*>(p) = x;
}

// Butterfly reductions: every lane ends with the same value, computed in an order fixed by the lane
// numbering alone.
__device__ inline float warp_sum(float v) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ inline float warp_max(float v) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over a 1-D block whose size is a multiple of 32 (at most 1024); every thread gets the result. All
// threads of the block must call it. The leading barrier lets it be called several times in a row.
__device__ inline float block_sum(float v) {
    __shared__ float partial[kWarpSize];
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int warps = blockDim.x / kWarpSize;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

// Launchers of vectorised kernels call these; a violation is a caller's bug or an unsupported shape.
inline void require_pack_multiple(int64_t n, const char* what) {
    if (n % kPackX != 0) fail(kExitUsage, "%s: %lld is not a multiple of %d", what, (long long)n, kPackX);
}

inline void require_aligned16(const void* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) fail(kExitUsage, "%s: pointer %p is not 16-byte aligned", what, p);
}

// ----------------------------------------------------------------------------------------------------
// Stochastic rounding, fed by rand.h's counter-based generator (rng_key, rng_u32).

// x rounded to one of its two bf16 neighbours, away from zero with probability (dropped bits) / 2^16 (16
// random bits added to the dropped ones carry that often). Infinities and NaNs pass through.
__device__ inline floatX stochastic_round_bf16(float x, uint32_t random) {
    uint32_t bits = __float_as_uint(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return __float2bfloat16_rn(x);
    bits = (bits + (random & 0xffffu)) & 0xffff0000u;
    __nv_bfloat16_raw raw;
    raw.x = uint16_t(bits >> 16);
    return floatX(raw);
}

// ----------------------------------------------------------------------------------------------------

static __global__ void convert_to_bf16_kernel(floatX* out, const float* in, int64_t n) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16_rn(in[i]);
}

// out[i] = in[i] rounded to nearest bf16 (e.g. the bf16 parameters from fp32 master weights at start).
inline void convert_to_bf16(floatX* out, const float* in, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    const int block = 256;
    convert_to_bf16_kernel<<<unsigned(ceil_div<int64_t>(n, block)), block, 0, stream>>>(out, in, n);
    cudaCheckLaunch();
}

}  // namespace llmc
