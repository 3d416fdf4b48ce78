/*
What the flash-attention kernels of llmc/flash_attention.cuh (mma.sync) and llmc/flash_attention_sm90.cuh
(wgmma) share, so both compute the same softmax, masks, stores and D = rowsum(dout * out) with the same
operations and so give the same bits, plus the launchers' argument checks. Element helpers work on a
warp's accumulators in the m16n8 C-fragment layout (lane = 4 * g + q: row g, columns 2q..2q+1, then row
g + 8), which is also wgmma's per-warp m64 layout.
*/
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

namespace llmc {

// require_aligned16 of each named pointer, the error naming "fn: name".
inline void require_aligned16_each(const char* fn, std::initializer_list<std::pair<const char*, const void*>> named) {
    for (const auto& [name, p] : named) {
        if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
            fail(kExitUsage, "%s: %s: pointer %p is not 16-byte aligned", fn, name, p);
        }
    }
}

namespace flash_common {

__device__ inline uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Two floats as a bf16 pair, lo in the low half (the lower column of an mma operand).
__device__ inline uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, sizeof(r));
    return r;
}

// A fragment (16x16 bf16) of k-step kk from fp32 accumulators p in the C layout (= the A layout in pairs).
template <int N>
__device__ inline void acc_frag(uint32_t (&a)[4], const float (&p)[N][4], int kk) {
    a[0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
    a[1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
    a[2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
}

template <int N>
__device__ inline void zero(float (&acc)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

template <int M, int N>
__device__ inline void zero(float (&acc)[M][N][4]) {
#pragma unroll
    for (int i = 0; i < M; i++) zero(acc[i]);
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kBlockN = 64;  // keys per step of the online softmax

// 2^x on the special-function unit (exp2f without the fix-up below 2^-126; probabilities flush to 0).
__device__ inline float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// f(mt, nt, e, r, c) for every element acc[mt][nt][e] of a warp's (16 * MT) x N accumulator block, r its
// row and c its column.
template <int MT, int N, class F>
__device__ inline void for_each_element(int lane, F f) {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < N / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) f(mt, nt, e, 16 * mt + g + 8 * (e >> 1), nt * 8 + 2 * q + (e & 1));
        }
    }
}

// Sets to `fill` every element of a warp's accumulator block (rows row0.., columns col0..) where
// keep(row, col) is false; run only on blocks crossing the diagonal or T.
template <int MT, int N, class Keep>
__device__ inline void mask_block(float (&acc)[MT][N / 8][4], int row0, int col0, float fill, int lane, Keep keep) {
    for_each_element<MT, N>(lane, [&](int mt, int nt, int e, int r, int c) {
        if (!keep(row0 + r, col0 + c)) acc[mt][nt][e] = fill;
    });
}

// Writes a warp's 16 x HS accumulator block (times mul) as bf16 rows at dst + (row0 + r) * stride, rows
// >= T skipped.
template <int HS>
__device__ inline void store_rows(floatX* dst, int64_t stride, const float (&acc)[HS / 8][4], float mul_a,
                                  float mul_b, int row0, int T, int lane) {
    const int g = lane >> 2, q = lane & 3;
    const int ra = row0 + g, rb = ra + 8;
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) {
        const int col = dt * 8 + 2 * q;
        if (ra < T) {
            const __nv_bfloat162 v = __floats2bfloat162_rn(acc[dt][0] * mul_a, acc[dt][1] * mul_a);
            *reinterpret_cast<__nv_bfloat162*>(dst + int64_t(ra) * stride + col) = v;
        }
        if (rb < T) {
            const __nv_bfloat162 v = __floats2bfloat162_rn(acc[dt][2] * mul_b, acc[dt][3] * mul_b);
            *reinterpret_cast<__nv_bfloat162*>(dst + int64_t(rb) * stride + col) = v;
        }
    }
}

// One key block of the online softmax for 16 query rows: s (raw scores, masked ones -inf) becomes
// P = exp2(s * scale_log2 - m) with m the new running max (log2 domain); l and o are rescaled first.
template <int HS>
__device__ inline void softmax_step(float (&s)[kBlockN / 8][4], float (&m)[2], float (&l)[2], float (&o)[HS / 8][4],
                                    float scale_log2) {
    // max(s) * scale rounds to the same float as max(s * scale).
    float bm[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) bm[e >> 1] = fmaxf(bm[e >> 1], s[nt][e]);
    }
    float sub[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        bm[r] = fmaxf(bm[r], __shfl_xor_sync(0xffffffffu, bm[r], 1));
        bm[r] = fmaxf(bm[r], __shfl_xor_sync(0xffffffffu, bm[r], 2));
        const float mx = fmaxf(m[r], bm[r] * scale_log2);
        sub[r] = mx == -INFINITY ? 0.0f : mx;  // a row with nothing unmasked yet stays at 0
        const float corr = exp2_fast(m[r] - sub[r]);
        m[r] = mx;
        l[r] *= corr;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++) {
            o[dt][2 * r] *= corr;
            o[dt][2 * r + 1] *= corr;
        }
    }
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            s[nt][e] = exp2_fast(fmaf(s[nt][e], scale_log2, -sub[e >> 1]));
            rs[e >> 1] += s[nt][e];
        }
    }
    l[0] += rs[0];
    l[1] += rs[1];
}

// The forward's end for 16 rows from row0: lse (natural log) and out rows = o / l; rows >= T skipped.
template <int HS>
__device__ inline void store_forward_rows(floatX* out_bh, int C, float* lse_bh, const float (&o)[HS / 8][4],
                                          const float (&m)[2], const float (&l)[2], int row0, int T, int lane) {
    const int g = lane >> 2, q = lane & 3;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lr = l[r];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        inv[r] = lr > 0.0f ? 1.0f / lr : 0.0f;
        const int row = row0 + g + 8 * r;
        if (q == 0 && row < T) lse_bh[row] = (m[r] + log2f(lr)) * kLn2;
    }
    store_rows<HS>(out_bh, C, o, inv[0], inv[1], row0, T, lane);
}

// ----------------------------------------------------------------------------------------------------
// The backward's first pass: D[b,h,t] = sum_d dout * out over one head's row, HS/8 lanes a row.

constexpr int kDotThreads = 128;

// One row's D from its HS / 8 consecutive lanes (8 columns of o and d each), products in order then a
// fixed shuffle tree; every lane calls it (valid false adds 0). The one definition of D's sums.
template <int HS>
__device__ inline float row_dot(bool valid, const PackX& o, const PackX& d) {
    float acc = 0.0f;
    if (valid) {
#pragma unroll
        for (int i = 0; i < 8; i++) acc += float(o[i]) * float(d[i]);
    }
#pragma unroll
    for (int off = HS / 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
}

template <int HS>
static __global__ void __launch_bounds__(kDotThreads)
    flash_bwd_dot_kernel(float* D, const floatX* out, const floatX* dout, int B, int T, int NH) {
    constexpr int kLanes = HS / 8;
    const int64_t r = int64_t(blockIdx.x) * (kDotThreads / kLanes) + threadIdx.x / kLanes;  // (b, t, h) order
    const int sub = threadIdx.x % kLanes;
    const bool valid = r < int64_t(B) * T * NH;
    PackX o, d;
    if (valid) {
        o = load128(out + r * HS + sub * 8);
        d = load128(dout + r * HS + sub * 8);
    }
    const float acc = row_dot<HS>(valid, o, d);
    if (valid && sub == 0) {
        const int h = int(r % NH);
        const int64_t bt = r / NH;
        const int t = int(bt % T), b = int(bt / T);
        D[(int64_t(b) * NH + h) * T + t] = acc;
    }
}

// D (B,NH,T) fp32, the first pass of both backward paths.
template <int HS>
void flash_backward_dot(float* D, const floatX* out, const floatX* dout, int B, int T, int NH, cudaStream_t stream) {
    const int64_t rows = int64_t(B) * T * NH;
    flash_bwd_dot_kernel<HS><<<unsigned(ceil_div<int64_t>(rows, kDotThreads / (HS / 8))), kDotThreads, 0, stream>>>(
        D, out, dout, B, T, NH);
    cudaCheckLaunch();
}

// ----------------------------------------------------------------------------------------------------
// Launcher helpers.

template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
    if (bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    }
}

constexpr int64_t kMaxGridY = 65535;

inline void check_args(const char* fn, int B, int T, int NH) {
    if (B < 1 || T < 1 || NH < 1) fail(kExitUsage, "%s: B=%d T=%d NH=%d must all be at least 1", fn, B, T, NH);
    if (int64_t(B) * NH > kMaxGridY) {
        fail(kExitUsage, "%s: B*NH = %lld is more than %lld (one grid row per batch row and head)", fn,
             (long long)(int64_t(B) * NH), (long long)kMaxGridY);
    }
}

}  // namespace flash_common

}  // namespace llmc
