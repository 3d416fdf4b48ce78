/*
LayerNorm and the residual addition on the GPU, with the argument meanings of cpu/gpt2_cpu.h's
layernorm_forward, layernorm_backward and residual_forward (eps 1e-5, statistics over C channels).
  layernorm_forward: one warp a row, fp32 two-pass statistics, the row held in registers for C <= 7 * 256.
  residual_forward:  out = a + b.
  layernorm_backward: dinp += (the residual stream's gradient), dweight +=, dbias +=; the weight sums in
      fixed 256-row chunks and a fixed order (no atomics: bitwise reproducible). Optionally next_dbias +=
      dinp's column sums (bit for bit bias_grad_accumulate) and dinp = dres + ... from another buffer.
C must be a multiple of 8 and the buffers 16-byte aligned (checked).
*/
#pragma once

#include <cstdint>
#include <type_traits>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

namespace llmc {

constexpr float kLayerNormEpsF = 1e-5f;
constexpr int kLayerNormBlock = 256;  // 8 rows per block in the row kernels
constexpr int kLayerNormRowsPerBlock = kLayerNormBlock / kWarpSize;

namespace detail {

// f(p, c) for each of the lane's packs p of a row of C channels, c = (p * 32 + lane) * 8 < C: unrolled
// up to P packs, or (P = 0) as many as C needs.
template <int P, class F>
__device__ inline void for_lane_packs(int C, F&& f) {
    const int lane = threadIdx.x % kWarpSize;
    if constexpr (P > 0) {
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int c = (p * kWarpSize + lane) * kPackX;
            if (c < C) f(p, c);
        }
    } else {
        for (int p = 0, c = lane * kPackX; c < C; p++, c += kWarpSize * kPackX) f(p, c);
    }
}

// The packs of a row a lane holds in registers between LayerNorm's passes; 0: C too large.
inline int layernorm_held_packs(int C) {
    const int packs = ceil_div(C, kWarpSize * kPackX);
    return packs <= 3 ? 3 : packs <= 4 ? 4 : packs <= 7 ? 7 : 0;
}

// Normalises one row, by one warp, into out, with mean and rstd. x(p, c) gives the lane's pack p (registers,
// or memory when P = 0).
template <int P, class X>
__device__ inline void layernorm_row(floatX* out, float* mean, float* rstd, X&& x, const floatX* weight,
                                     const floatX* bias, int64_t row, int C) {
    const int lane = threadIdx.x % kWarpSize;
    float sum = 0.0f;
    for_lane_packs<P>(C, [&](int p, int c) {
        const PackX v = x(p, c);
        for (int k = 0; k < kPackX; k++) sum += float(v[k]);
    });
    const float m = warp_sum(sum) / float(C);
    float var = 0.0f;
    for_lane_packs<P>(C, [&](int p, int c) {
        const PackX v = x(p, c);
        for (int k = 0; k < kPackX; k++) {
            const float d = float(v[k]) - m;
            var += d * d;
        }
    });
    const float s = 1.0f / sqrtf(warp_sum(var) / float(C) + kLayerNormEpsF);
    for_lane_packs<P>(C, [&](int p, int c) {
        const PackX v = x(p, c);
        const PackX w = load128(weight + c);
        const PackX b = load128(bias + c);
        PackX o;
        for (int k = 0; k < kPackX; k++) o[k] = __float2bfloat16_rn((float(v[k]) - m) * s * float(w[k]) + float(b[k]));
        store128(out + row * C + c, o);
    });
    if (lane == 0) {
        if (mean != nullptr) mean[row] = m;
        if (rstd != nullptr) rstd[row] = s;
    }
}

inline void check_layernorm_args(const char* fn, int C, std::initializer_list<const void*> pointers) {
    require_pack_multiple(C, fn);
    for (const void* p : pointers) require_aligned16(p, fn);
}

}  // namespace detail

// A warp a row; the row held in registers (P > 0) or read in each pass (P = 0).
template <int P>
static __global__ void __launch_bounds__(kLayerNormBlock)
    layernorm_forward_kernel(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* weight,
                             const floatX* bias, int64_t N, int C) {
    const int64_t row = int64_t(blockIdx.x) * kLayerNormRowsPerBlock + threadIdx.x / kWarpSize;
    if (row < N) {
        const floatX* x = inp + row * C;
        if constexpr (P > 0) {
            PackX held[P];
            detail::for_lane_packs<P>(C, [&](int p, int c) { held[p] = load128(x + c); });
            detail::layernorm_row<P>(out, mean, rstd, [&](int p, int) { return held[p]; }, weight, bias, row, C);
        } else {
            detail::layernorm_row<0>(out, mean, rstd, [&](int, int c) { return load128(x + c); }, weight, bias, row, C);
        }
    }
}

namespace detail {
// The row launcher's checks: C and the inputs as check_layernorm_args; out 16-byte aligned; the packs a lane
// holds in registers 0 (read in each pass), or 3, 4 or 7 covering C.
inline void check_layernorm_rows(const char* fn, int C, std::initializer_list<const void*> inputs, const floatX* out,
                                 int held) {
    check_layernorm_args(fn, C, inputs);
    require_aligned16(out, fn);
    if (held != 0 && ((held != 3 && held != 4 && held != 7) || held * kWarpSize * kPackX < C)) {
        fail(kExitUsage, "%s: %d packs a lane held, need 0, or 3, 4 or 7 covering C = %d", fn, held, C);
    }
}

// f(std::integral_constant<int, P>{}) for the P that `held` names (checked by check_layernorm_rows).
template <class F>
void with_held_packs(int held, F&& f) {
    switch (held) {
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 0>{}); break;
    }
}

// layernorm_forward with `held` packs in registers (the same bits as 0); test/test_kernels.cu compares.
inline void layernorm_forward_rows(int held, floatX* out, float* mean, float* rstd, const floatX* inp,
                                   const floatX* weight, const floatX* bias, int64_t N, int C, cudaStream_t stream) {
    check_layernorm_rows("layernorm_forward", C, {inp, weight, bias}, out, held);
    if (N == 0) return;
    const unsigned grid = unsigned(ceil_div<int64_t>(N, kLayerNormRowsPerBlock));
    with_held_packs(held, [&](auto packs) {
        constexpr int P = decltype(packs)::value;
        layernorm_forward_kernel<P><<<grid, kLayerNormBlock, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C);
    });
    cudaCheckLaunch();
}
}  // namespace detail

inline void layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* weight,
                              const floatX* bias, int64_t N, int C, cudaStream_t stream) {
    detail::layernorm_forward_rows(detail::layernorm_held_packs(C), out, mean, rstd, inp, weight, bias, N, C, stream);
}

// ----------------------------------------------------------------------------------------------------
// Backward.

constexpr int kLayerNormRowsPerChunk = 256;
constexpr int kLayerNormColumnsPerBlock = kWarpSize * kPackX;  // 256 channels: a pack per lane

inline int64_t layernorm_chunks(int64_t N) { return ceil_div<int64_t>(N, kLayerNormRowsPerChunk); }

// fp32 partial sums per chunk of rows: dweight's and dbias's (2C a chunk), then next_dbias's (C a chunk).
inline size_t layernorm_backward_scratch_bytes(int64_t N, int C) {
    return size_t(layernorm_chunks(N)) * 3 * size_t(C) * sizeof(float);
}

namespace detail {
// dinp[row] = dres[row] + rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = weight * dout,
// by one warp (dres == dinp: in place).
__device__ inline void layernorm_backward_row(floatX* dinp, const floatX* dres, const floatX* dout, const floatX* inp,
                                               const floatX* weight, const float* mean, const float* rstd, int64_t row,
                                               int C) {
    const int lane = threadIdx.x % kWarpSize;
    const floatX* x = inp + row * C;
    const floatX* d = dout + row * C;
    const float m = mean[row], s = rstd[row];
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
    for (int c = lane * kPackX; c < C; c += kWarpSize * kPackX) {
        const PackX px = load128(x + c), pd = load128(d + c), pw = load128(weight + c);
        for (int k = 0; k < kPackX; k++) {
            const float dnorm = float(pw[k]) * float(pd[k]);
            dnorm_sum += dnorm;
            dnorm_norm_sum += dnorm * (float(px[k]) - m) * s;
        }
    }
    const float dnorm_mean = warp_sum(dnorm_sum) / float(C);
    const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / float(C);
    floatX* dx = dinp + row * C;
    const floatX* dr = dres + row * C;
    for (int c = lane * kPackX; c < C; c += kWarpSize * kPackX) {
        const PackX px = load128(x + c), pd = load128(d + c), pw = load128(weight + c);
        PackX o = load128(dr + c);
        for (int k = 0; k < kPackX; k++) {
            const float norm = (float(px[k]) - m) * s;
            const float dnorm = float(pw[k]) * float(pd[k]);
            o[k] = __float2bfloat16_rn(float(o[k]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
        }
        store128(dx + c, o);
    }
}
}  // namespace detail

// detail::layernorm_backward_row for every row, a warp each.
static __global__ void __launch_bounds__(kLayerNormBlock)
    layernorm_backward_dinp_kernel(floatX* dinp, const floatX* dres, const floatX* dout, const floatX* inp,
                                   const floatX* weight, const float* mean, const float* rstd, int64_t N, int C) {
    const int64_t row = int64_t(blockIdx.x) * kLayerNormRowsPerBlock + threadIdx.x / kWarpSize;
    if (row < N) detail::layernorm_backward_row(dinp, dres, dout, inp, weight, mean, rstd, row, C);
}

// Block (x, chunk): channels [x * 256, + 256) over the chunk's rows; partial[chunk] = (dweight sums,
// dbias sums) and, with kSumDinp, partial_dinp[chunk] = dinp's sums (after the dinp kernel).
template <bool kSumDinp>
static __global__ void __launch_bounds__(kLayerNormBlock)
    layernorm_backward_partial_kernel(float* partial, float* partial_dinp, const floatX* dout, const floatX* inp,
                                      const floatX* dinp, const float* mean, const float* rstd, int64_t N, int C) {
    __shared__ float sums_w[kLayerNormRowsPerBlock][kLayerNormColumnsPerBlock];
    __shared__ float sums_b[kLayerNormRowsPerBlock][kLayerNormColumnsPerBlock];
    __shared__ float sums_r[kSumDinp ? kLayerNormRowsPerBlock : 1][kLayerNormColumnsPerBlock];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int64_t chunk = blockIdx.y;
    const int c0 = blockIdx.x * kLayerNormColumnsPerBlock + lane * kPackX;
    const int64_t row_end = min(N, (chunk + 1) * kLayerNormRowsPerChunk);
    float acc_w[kPackX] = {}, acc_b[kPackX] = {}, acc_r[kPackX] = {};
    if (c0 < C) {
        for (int64_t n = chunk * kLayerNormRowsPerChunk + warp; n < row_end; n += kLayerNormRowsPerBlock) {
            const PackX px = load128(inp + n * C + c0), pd = load128(dout + n * C + c0);
            PackX pr;
            if constexpr (kSumDinp) pr = load128(dinp + n * C + c0);
            const float m = mean[n], s = rstd[n];
            for (int k = 0; k < kPackX; k++) {
                const float d = float(pd[k]);
                acc_w[k] += (float(px[k]) - m) * s * d;
                acc_b[k] += d;
                if constexpr (kSumDinp) acc_r[k] += float(pr[k]);
            }
        }
    }
    for (int k = 0; k < kPackX; k++) {
        sums_w[warp][lane * kPackX + k] = acc_w[k];
        sums_b[warp][lane * kPackX + k] = acc_b[k];
        if constexpr (kSumDinp) sums_r[warp][lane * kPackX + k] = acc_r[k];
    }
    __syncthreads();
    const int c = blockIdx.x * kLayerNormColumnsPerBlock + threadIdx.x;
    if (c < C) {
        float w = 0.0f, b = 0.0f, r = 0.0f;
        for (int i = 0; i < kLayerNormRowsPerBlock; i++) {
            w += sums_w[i][threadIdx.x];
            b += sums_b[i][threadIdx.x];
            if constexpr (kSumDinp) r += sums_r[i][threadIdx.x];
        }
        partial[chunk * 2 * C + c] = w;
        partial[chunk * 2 * C + C + c] = b;
        if constexpr (kSumDinp) partial_dinp[chunk * C + c] = r;
    }
}

// Adds the chunks' partials into dweight and dbias (and partial_dinp's into next_dbias): a block per 32
// channels, warp w adds chunks w, w + 32, ..., then warp 0 the warps' sums in order (for next_dbias, the
// order of bias_grad_final_kernel). The order depends only on the number of chunks.
constexpr int kLayerNormFinalWarps = 32;
// next_dbias keeps bias_grad_accumulate's bits only while the chunks, warps and orders are its own.
static_assert(kLayerNormRowsPerChunk == kBiasGradRowsPerChunk && kLayerNormBlock == kBiasGradBlock &&
                  kLayerNormColumnsPerBlock == kBiasGradColumnsPerBlock && kLayerNormFinalWarps == kBiasGradFinalWarps,
              "LayerNorm backward's column sums must follow the bias gradient's chunks and orders");

static __global__ void __launch_bounds__(kLayerNormFinalWarps * kWarpSize)
    layernorm_backward_final_kernel(floatX* dweight, floatX* dbias, floatX* next_dbias, const float* partial,
                                    const float* partial_dinp, int64_t chunks, int C) {
    __shared__ float sums_w[kLayerNormFinalWarps][kWarpSize], sums_b[kLayerNormFinalWarps][kWarpSize];
    __shared__ float sums_r[kLayerNormFinalWarps][kWarpSize];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int c = blockIdx.x * kWarpSize + lane;
    const bool writer = warp == 0 && c < C, next = next_dbias != nullptr;
    const float old_w = writer ? float(dweight[c]) : 0.0f, old_b = writer ? float(dbias[c]) : 0.0f;
    const float old_r = writer && next ? float(next_dbias[c]) : 0.0f;
    float w = 0.0f, b = 0.0f, r = 0.0f;
    if (c < C) {
#pragma unroll 8
        for (int64_t k = warp; k < chunks; k += kLayerNormFinalWarps) {
            w += partial[k * 2 * C + c];
            b += partial[k * 2 * C + C + c];
        }
        if (next) {
#pragma unroll 8
            for (int64_t k = warp; k < chunks; k += kLayerNormFinalWarps) r += partial_dinp[k * C + c];
        }
    }
    sums_w[warp][lane] = w;
    sums_b[warp][lane] = b;
    sums_r[warp][lane] = r;
    __syncthreads();
    if (writer) {
        float tw = 0.0f, tb = 0.0f, tr = 0.0f;
        for (int i = 0; i < kLayerNormFinalWarps; i++) {
            tw += sums_w[i][lane];
            tb += sums_b[i][lane];
            tr += sums_r[i][lane];
        }
        dweight[c] = __float2bfloat16_rn(old_w + tw);
        dbias[c] = __float2bfloat16_rn(old_b + tb);
        if (next) next_dbias[c] = __float2bfloat16_rn(old_r + tr);
    }
}

namespace detail {

// The dinp and partial kernels in one pass over the rows, for C <= 256 * P: block = one chunk, each warp
// and row as there, so the same bits, with dout and inp read once. All of a row's loads are issued
// before anything is stored; the warps' sums live in shared memory. kSumDinp: dinp's sums too.
template <int P, bool kSumDinp>
static __global__ void __launch_bounds__(kLayerNormBlock, 2)
    layernorm_backward_fused_kernel(floatX* dinp, const floatX* dres, float* partial, float* partial_dinp,
                                    const floatX* dout, const floatX* inp, const floatX* weight, const float* mean,
                                    const float* rstd, int64_t N, int C) {
    // acc[warp][0 dweight, 1 dbias, 2 dinp][p][half][lane]: channels (p * 32 + lane) * 8 + 4 * half ..
    extern __shared__ float4 acc[];
    constexpr int kSums = kSumDinp ? 3 : 2;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    auto slot = [&](int w, int wb, int p, int half, int l) {
        return (((w * kSums + wb) * P + p) * 2 + half) * kWarpSize + l;
    };
    const int64_t chunk = blockIdx.x;
    const int64_t row_end = min(N, (chunk + 1) * kLayerNormRowsPerChunk);
#pragma unroll
    for (int p = 0; p < P; p++) {
        for (int wb = 0; wb < kSums; wb++) {
            acc[slot(warp, wb, p, 0, lane)] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            acc[slot(warp, wb, p, 1, lane)] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    for (int64_t row = chunk * kLayerNormRowsPerChunk + warp; row < row_end; row += kLayerNormRowsPerBlock) {
        PackX x[P], d[P], o[P];  // the row's inp, dout and old dinp (from dres)
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int c = (p * kWarpSize + lane) * kPackX;
            if (c < C) {
                x[p] = load128(inp + row * C + c);
                d[p] = load128(dout + row * C + c);
                o[p] = load128(dres + row * C + c);
            }
        }
        const float m = mean[row], s = rstd[row];
        float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int c = (p * kWarpSize + lane) * kPackX;
            if (c >= C) continue;
            const PackX pw = load128(weight + c);
            for (int k = 0; k < kPackX; k++) {
                const float dnorm = float(pw[k]) * float(d[p][k]);
                dnorm_sum += dnorm;
                dnorm_norm_sum += dnorm * (float(x[p][k]) - m) * s;
            }
        }
        const float dnorm_mean = warp_sum(dnorm_sum) / float(C);
        const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / float(C);
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int c = (p * kWarpSize + lane) * kPackX;
            if (c >= C) continue;
            const PackX pw = load128(weight + c);
            float4* aw = &acc[slot(warp, 0, p, 0, lane)];
            float4* ab = &acc[slot(warp, 1, p, 0, lane)];
            float sw[kPackX], sb[kPackX];
            for (int h = 0; h < 2; h++) {
                const float4 vw = aw[h * kWarpSize], vb = ab[h * kWarpSize];
                sw[4 * h] = vw.x, sw[4 * h + 1] = vw.y, sw[4 * h + 2] = vw.z, sw[4 * h + 3] = vw.w;
                sb[4 * h] = vb.x, sb[4 * h + 1] = vb.y, sb[4 * h + 2] = vb.z, sb[4 * h + 3] = vb.w;
            }
            for (int k = 0; k < kPackX; k++) {
                const float norm = (float(x[p][k]) - m) * s;
                const float dnorm = float(pw[k]) * float(d[p][k]);
                o[p][k] = __float2bfloat16_rn(float(o[p][k]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
                const float dv = float(d[p][k]);
                sw[k] += (float(x[p][k]) - m) * s * dv;
                sb[k] += dv;
            }
            for (int h = 0; h < 2; h++) {
                aw[h * kWarpSize] = make_float4(sw[4 * h], sw[4 * h + 1], sw[4 * h + 2], sw[4 * h + 3]);
                ab[h * kWarpSize] = make_float4(sb[4 * h], sb[4 * h + 1], sb[4 * h + 2], sb[4 * h + 3]);
            }
            store128(dinp + row * C + c, o[p]);
            if constexpr (kSumDinp) {
                float4* ar = &acc[slot(warp, 2, p, 0, lane)];
                for (int h = 0; h < 2; h++) {
                    float4 v = ar[h * kWarpSize];
                    v.x += float(o[p][4 * h]), v.y += float(o[p][4 * h + 1]);
                    v.z += float(o[p][4 * h + 2]), v.w += float(o[p][4 * h + 3]);
                    ar[h * kWarpSize] = v;
                }
            }
        }
    }
    // partial[chunk] = (dweight sums, dbias sums): 0 + warp 0's + warp 1's + ...
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += kLayerNormBlock) {
        const int p = c / kLayerNormColumnsPerBlock, l = (c / kPackX) % kWarpSize, k = c % kPackX;
        float tw = 0.0f, tb = 0.0f, tr = 0.0f;
        for (int w = 0; w < kLayerNormRowsPerBlock; w++) {
            tw += reinterpret_cast<const float*>(&acc[slot(w, 0, p, k / 4, l)])[k % 4];
            tb += reinterpret_cast<const float*>(&acc[slot(w, 1, p, k / 4, l)])[k % 4];
            if constexpr (kSumDinp) tr += reinterpret_cast<const float*>(&acc[slot(w, 2, p, k / 4, l)])[k % 4];
        }
        partial[chunk * 2 * C + c] = tw;
        partial[chunk * 2 * C + C + c] = tb;
        if constexpr (kSumDinp) partial_dinp[chunk * C + c] = tr;
    }
}

// Shared memory of layernorm_backward_fused_kernel<P, kSumDinp>: 8 KiB a pack per sum (opted in).
constexpr size_t layernorm_backward_fused_smem(int P, bool sum_dinp) {
    return size_t(kLayerNormRowsPerBlock) * (sum_dinp ? 3 : 2) * size_t(P) * kLayerNormColumnsPerBlock * sizeof(float);
}

// Whether two blocks of the fused kernel with dinp's sums fit on an SM of the current device at C.
inline bool layernorm_backward_fused_sums_fit(int C) {
    const int P = ceil_div(C, kLayerNormColumnsPerBlock);
    int device = 0, per_sm = 0;
    cudaCheck(cudaGetDevice(&device));
    cudaCheck(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    return 2 * (layernorm_backward_fused_smem(P, true) + 1024) <= size_t(per_sm);  // 1 KiB the system's a block
}

// Packs of 8 channels per lane the fused kernel is instantiated for (C up to 768).
constexpr int kLayerNormFusedMaxPacks = 3;

// The fused kernel (C up to 256 * kLayerNormFusedMaxPacks) or the separate ones (any C), the same bits;
// test/test_kernels.cu compares them. partial_dinp may be null: no column sums of dinp.
inline bool layernorm_backward_fuses(int C) {
    return ceil_div(C, kLayerNormColumnsPerBlock) <= kLayerNormFusedMaxPacks;
}

inline void layernorm_backward_rows_fused(floatX* dinp, const floatX* dres, float* partial, float* partial_dinp,
                                          const floatX* dout, const floatX* inp, const floatX* weight,
                                          const float* mean, const float* rstd, int64_t N, int C,
                                          cudaStream_t stream) {
    if (!layernorm_backward_fuses(C)) {
        fail(kExitUsage, "layernorm_backward: the fused kernel takes C up to %d, not %d",
             kLayerNormFusedMaxPacks * kLayerNormColumnsPerBlock, C);
    }
    auto launch = [&](auto p, auto sum_dinp) {
        constexpr int P = decltype(p)::value;
        constexpr bool S = decltype(sum_dinp)::value;
        constexpr size_t smem = layernorm_backward_fused_smem(P, S);
        static_assert(smem <= 113 * 1024, "two blocks an SM of sm_90");
        auto kernel = layernorm_backward_fused_kernel<P, S>;
        if constexpr (smem > 48 * 1024) {  // at every launch: the setting is the current device's
            cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        }
        kernel<<<unsigned(layernorm_chunks(N)), kLayerNormBlock, smem, stream>>>(
            dinp, dres, partial, partial_dinp, dout, inp, weight, mean, rstd, N, C);
    };
    auto with_sums = [&](auto p) {
        partial_dinp != nullptr ? launch(p, std::true_type{}) : launch(p, std::false_type{});
    };
    switch (ceil_div(C, kLayerNormColumnsPerBlock)) {
        case 1: with_sums(std::integral_constant<int, 1>{}); break;
        case 2: with_sums(std::integral_constant<int, 2>{}); break;
        default: with_sums(std::integral_constant<int, 3>{}); break;
    }
    cudaCheckLaunch();
}

inline void layernorm_backward_rows_separate(floatX* dinp, const floatX* dres, float* partial, float* partial_dinp,
                                             const floatX* dout, const floatX* inp, const floatX* weight,
                                             const float* mean, const float* rstd, int64_t N, int C,
                                             cudaStream_t stream) {
    layernorm_backward_dinp_kernel<<<unsigned(ceil_div<int64_t>(N, kLayerNormRowsPerBlock)), kLayerNormBlock, 0,
                                     stream>>>(dinp, dres, dout, inp, weight, mean, rstd, N, C);
    cudaCheckLaunch();
    const dim3 grid(unsigned(ceil_div(C, kLayerNormColumnsPerBlock)), unsigned(layernorm_chunks(N)));
    auto* kernel =
        partial_dinp != nullptr ? layernorm_backward_partial_kernel<true> : layernorm_backward_partial_kernel<false>;
    kernel<<<grid, kLayerNormBlock, 0, stream>>>(partial, partial_dinp, dout, inp, dinp, mean, rstd, N, C);
    cudaCheckLaunch();
}

}  // namespace detail

// dinp (N,C) +=, dweight (C) +=, dbias (C) += the gradients of out = LayerNorm(inp) given dout and the
// forward's mean and rstd; dinp must not alias dout or inp. next_dbias (optional, C): += dinp's column
// sums, bit for bit as bias_grad_accumulate.
// dres (optional, not overlapping dinp): dinp = dres + the LayerNorm's part; dres left as it was.
inline void layernorm_backward(floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                               const floatX* weight, const float* mean, const float* rstd, int64_t N, int C,
                               float* scratch, size_t scratch_bytes, cudaStream_t stream, floatX* next_dbias = nullptr,
                               const floatX* dres = nullptr) {
    detail::check_layernorm_args("layernorm_backward", C, {dinp, dout, inp, weight, dres});
    if (dres == nullptr) {
        dres = dinp;
    } else if (overlaps_partly<floatX>(dres, dinp, N * C)) {
        fail(kExitUsage, "layernorm_backward: dres (%p) and dinp (%p) overlap without being the same rows (N=%lld C=%d)",
             static_cast<const void*>(dres), static_cast<const void*>(dinp), (long long)N, C);
    }
    if (scratch_bytes < layernorm_backward_scratch_bytes(N, C)) {
        fail(kExitUsage, "layernorm_backward: scratch of %zu bytes, N=%lld C=%d needs %zu", scratch_bytes,
             (long long)N, C, layernorm_backward_scratch_bytes(N, C));
    }
    if (N == 0) return;
    const int64_t chunks = layernorm_chunks(N);
    float* partial_dinp = next_dbias != nullptr ? scratch + chunks * 2 * C : nullptr;
    if (detail::layernorm_backward_fuses(C)) {
        // Where the sums would halve the fused kernel's blocks an SM: next_dbias from its own pass.
        const bool own_pass = partial_dinp != nullptr && !detail::layernorm_backward_fused_sums_fit(C);
        detail::layernorm_backward_rows_fused(dinp, dres, scratch, own_pass ? nullptr : partial_dinp, dout, inp, weight,
                                              mean, rstd, N, C, stream);
        if (own_pass) {
            bias_grad_accumulate(next_dbias, dinp, N, C, partial_dinp, size_t(chunks) * C * sizeof(float), stream);
            next_dbias = nullptr;
            partial_dinp = nullptr;
        }
    } else {
        detail::layernorm_backward_rows_separate(dinp, dres, scratch, partial_dinp, dout, inp, weight, mean, rstd, N,
                                                 C, stream);
    }
    layernorm_backward_final_kernel<<<unsigned(ceil_div(C, kWarpSize)), kLayerNormFinalWarps * kWarpSize, 0, stream>>>(
        dweight, dbias, next_dbias, scratch, partial_dinp, chunks, C);
    cudaCheckLaunch();
}

}  // namespace llmc
