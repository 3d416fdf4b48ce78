/*
The classifier's forward on Hopper (sm_90a) in our own matmul, with the softmax's exponentials in its
epilogue: no logits are written and no softmax pass reads them.
  classifier90_available(), classifier90_applies(N, C, Vp) (N % 128, C % 64, Vp % 8 == 0),
  classifier90_partial_count(N, Vp): the floats of Classifier90Scratch::partial.
  classifier90_exp_forward: Y (N,Vp) bf16 = e^(x - x_t) (x_t the target logit), loss log(s) with s = 1 +
      the row's sum of Y over the other columns below V, padded columns 0. With dloss > 0 Y becomes the
      gradient up to a row scale (target column 1 - s, lnf scaled in place by dloss / s); with dloss = 0
      the target column is 0 and lnf left as it was.
  classifier90_scale_rows: x (N,C) *= dloss / s per row: d(lnf) from the Y wte matmul.
A persistent kernel: a TMA producer warpgroup feeding a ring of stages and two wgmma consumer
warpgroups (128 x 256 output tiles); the epilogue's row sums are added by a later kernel in a fixed
order, so results repeat bit for bit. Y overflows only where a token's loss exceeds ~88 nats (the loss is
then inf, which the step guard sees). Design and timings: docs/lab-notes.md, docs/performance.md.
*/
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes through the runtime)
#include <cudaTypedefs.h>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flash_common.cuh"
#include "llmc/sm90.cuh"
#include "llmc/utils.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CLASSIFIER90_DEVICE 1
#else
#define CLASSIFIER90_DEVICE 0
#endif

namespace llmc {

// Per-row numbers of classifier90_exp_forward: c (N) target logits, partial the tiles' row sums, sums (N) s.
struct Classifier90Scratch {
    float* c = nullptr;
    float* partial = nullptr;
    float* sums = nullptr;
};

namespace classifier90_detail {

using namespace flash_common;

constexpr int kBM = 128;            // output rows per tile (64 per consumer warpgroup)
constexpr int kBN = 256;            // output columns per tile (wte rows)
constexpr int kBK = 64;             // k per stage: one 128-byte swizzled row
constexpr int kStages = 3;          // the ring of shared-memory stages
constexpr int kGroupM = 16;         // row blocks per group of the tile order
constexpr int kThreads = 384;       // producer + two consumer warpgroups
constexpr int kABytes = kBM * kBK * 2;         // 16 KiB
constexpr int kBBytes = kBN * kBK * 2;         // 32 KiB
constexpr int kOutBox = 64;                    // output TMA box: 64 rows x 64 columns (128 bytes)
constexpr int kOutBoxBytes = 64 * kOutBox * 2; // 8 KiB
constexpr int kOutWGBytes = 64 * kBN * 2;      // 32 KiB: one consumer's 64 x 256 block, 4 boxes
constexpr int kSmemData = kStages * (kABytes + kBBytes) + 2 * kOutWGBytes;
constexpr int kSmem = kSmemData + 1024 + 2 * kStages * 8;  // + alignment slack + the barriers

// ------------------------------------------------------------------------------------------------
// Device helpers (sm_90a).

__device__ inline void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ inline void mbar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ inline void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until the barrier's phase of this parity has completed.
__device__ inline void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    } while (!done);
}
__device__ inline void tma_load_2d(uint8_t* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
            "r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
        : "memory");
}
__device__ inline void tma_store_2d(const CUtensorMap* map, const uint8_t* src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(c0), "r"(c1), "r"(smem_addr(src))
                 : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ inline void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ inline void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ inline void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ inline void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ inline void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}

// Descriptor of a K-major operand in the 128-byte swizzle (8-row groups 1024 bytes apart).
__device__ inline uint64_t desc_sw128(uint32_t addr) {
    return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ inline void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ inline void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous wgmma.
__device__ inline void fence_acc(float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator registers d[i..i+7] as inline-asm operands, read and written.
#define CLS90_ACC8(i)                                                                                             \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),     \
        "+f"(d[i + 7])

// d (64 x 256 fp32) += A (64 x 16, K-major, shared) * B (256 x 16, K-major); d = A * B when scale_d is 0.
__device__ inline void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if CLASSIFIER90_DEVICE
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : CLS90_ACC8(0), CLS90_ACC8(8), CLS90_ACC8(16), CLS90_ACC8(24), CLS90_ACC8(32), CLS90_ACC8(40), CLS90_ACC8(48),
          CLS90_ACC8(56), CLS90_ACC8(64), CLS90_ACC8(72), CLS90_ACC8(80), CLS90_ACC8(88), CLS90_ACC8(96),
          CLS90_ACC8(104), CLS90_ACC8(112), CLS90_ACC8(120)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

#undef CLS90_ACC8

// Tile t of the order: groups of kGroupM row blocks, the row block fastest inside a group.
__device__ inline void tile_coords(int t, int m_tiles, int n_tiles, int& m_blk, int& n_blk) {
    const int per_group = kGroupM * n_tiles;
    const int group = t / per_group, within = t % per_group;
    const int first = group * kGroupM, rows = min(kGroupM, m_tiles - first);
    m_blk = first + within % rows;
    n_blk = within / rows;
}

// The exp epilogue on one of a thread's two rows: d = e^(x - c) (flushed to 0 below 2^-126), 0 at the
// target's column and columns >= V; returns the sum of the rest.
template <int Half>
__device__ inline float exp_half(float (&d)[128], float c2, int target, int n0, int col_base, int V, bool all_below_v) {
    float s = 0.0f;
    if (all_below_v && (target < n0 || target >= n0 + kBN)) {
#pragma unroll
        for (int j = 0; j < 32; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float y = exp2_fast(fmaf(d[4 * j + 2 * Half + e], kLog2e, -c2));
                s += y;
                d[4 * j + 2 * Half + e] = y;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < 32; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = col_base + 8 * j + e;
                const float y =
                    (col < V && col != target) ? exp2_fast(fmaf(d[4 * j + 2 * Half + e], kLog2e, -c2)) : 0.0f;
                s += y;
                d[4 * j + 2 * Half + e] = y;
            }
        }
    }
    return s;
}

// out = bf16(e^(x - c_row)), x = lnf wte^T, 0 at the target and columns >= V; partial[row * n_tiles + n_tile]
// = the tile's sum of the other columns (fp32).
static __global__ void __launch_bounds__(kThreads, 1)
    cls_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const __grid_constant__ CUtensorMap map_out, int M, int Vp, int V, int K, const float* offsets,
                    const int* targets, float* partial) {
#if CLASSIFIER90_DEVICE
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* sA = smem;
    uint8_t* sB = sA + kStages * kABytes;
    uint8_t* sOut = sB + kStages * kBBytes;
    uint64_t* full = reinterpret_cast<uint64_t*>(sOut + 2 * kOutWGBytes);
    uint64_t* empty = full + kStages;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const int m_tiles = M / kBM, n_tiles = (Vp + kBN - 1) / kBN, n_total = m_tiles * n_tiles, kb_count = K / kBK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int stage = 0;
            uint32_t phase = 0;
            for (int t = blockIdx.x; t < n_total; t += gridDim.x) {
                int mb, nb;
                tile_coords(t, m_tiles, n_tiles, mb, nb);
                for (int kb = 0; kb < kb_count; kb++) {
                    mbar_wait(&empty[stage], phase ^ 1);
                    mbar_expect(&full[stage], kABytes + kBBytes);
                    tma_load_2d(sA + stage * kABytes, &map_a, &full[stage], kb * kBK, mb * kBM);
                    tma_load_2d(sB + stage * kBBytes, &map_b, &full[stage], kb * kBK, nb * kBN);
                    if (++stage == kStages) {
                        stage = 0;
                        phase ^= 1;
                    }
                }
            }
        }
        return;
    }

    // consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1, warp = tid / 32, lane = tid % 32;
    uint8_t* my_out = sOut + cw * kOutWGBytes;
    float d[128];
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < n_total; t += gridDim.x) {
        int mb, nb;
        tile_coords(t, m_tiles, n_tiles, mb, nb);
        // This thread's rows r0 = 16 warp + lane / 4 and r0 + 8; their offsets and targets load under the k-loop.
        const int r0 = 16 * warp + lane / 4;
        const int row0 = mb * kBM + cw * 64 + r0, row1 = row0 + 8;
        const float c2_0 = offsets[row0] * kLog2e, c2_1 = offsets[row1] * kLog2e;
        const int tg0 = targets[row0], tg1 = targets[row1];
        int prev = 0;
        for (int kb = 0; kb < kb_count; kb++) {
            mbar_wait(&full[stage], phase);
            const uint32_t a_base = smem_addr(sA + stage * kABytes) + cw * (64 * 128);
            const uint32_t b_base = smem_addr(sB + stage * kBBytes);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < kBK / 16; kk++) {
                wgmma_m64n256k16(d, desc_sw128(a_base + kk * 32), desc_sw128(b_base + kk * 32), (kb | kk) != 0);
            }
            wg_commit();
            if (kb > 0) {
                wg_wait<1>();
                fence_acc(d);
                mbar_arrive(&empty[prev]);
            }
            prev = stage;
            if (++stage == kStages) {
                stage = 0;
                phase ^= 1;
            }
        }
        wg_wait<0>();
        fence_acc(d);
        mbar_arrive(&empty[prev]);

        // Epilogue: columns 8 j + 2 (lane % 4) + {0, 1}, j = 0..31 (d[4j], d[4j+1] on r0; d[4j+2], d[4j+3] on r0 + 8).
        const int col_base = nb * kBN + 2 * (lane % 4);
        const int n0 = nb * kBN;
        const bool all_below_v = n0 + kBN <= V;
        float s0 = exp_half<0>(d, c2_0, tg0, n0, col_base, V, all_below_v);
        float s1 = exp_half<1>(d, c2_1, tg1, n0, col_base, V, all_below_v);
        s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
        s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
        if (lane % 4 == 0) {
            partial[int64_t(row0) * n_tiles + nb] = s0;
            partial[int64_t(row1) * n_tiles + nb] = s1;
        }
        // The previous tile's stores must have read the staging block before it is overwritten.
        if (tid == 0) bulk_wait_read();
        named_sync(1 + cw, 128);
        const uint32_t out_base = smem_addr(my_out);
        const int mi = lane / 8, rr = lane % 8;
        const int srow = 16 * warp + (mi & 1) * 8 + rr;
#pragma unroll
        for (int jj = 0; jj < 16; jj++) {
            const int j = 2 * jj;
            const int chunk = j + (mi >> 1);  // 16-byte chunk of the 256-column row this lane addresses
            const int box = chunk / 8, cc = chunk % 8;
            const uint32_t addr = out_base + box * kOutBoxBytes + srow * 128 + ((cc ^ (srow & 7)) << 4);
            stmatrix_x4(addr, pack_bf16(d[4 * j], d[4 * j + 1]), pack_bf16(d[4 * j + 2], d[4 * j + 3]),
                        pack_bf16(d[4 * j + 4], d[4 * j + 5]), pack_bf16(d[4 * j + 6], d[4 * j + 7]));
        }
        fence_proxy_async();
        named_sync(1 + cw, 128);
        if (tid == 0) {
            for (int b = 0; b < kBN / kOutBox; b++) {
                const int col = nb * kBN + b * kOutBox;
                if (col < Vp) tma_store_2d(&map_out, my_out + b * kOutBoxBytes, col, mb * kBM + cw * 64);
            }
            bulk_commit();
        }
    }
    if (tid == 0) bulk_wait_all();
#endif
}

// c[row] = lnf[row] . wte[targets[row]] in fp32 (one warp a row, a fixed order).
static __global__ void target_logit_kernel(float* c, const floatX* lnf, const floatX* wte, const int* targets, int64_t N,
                                    int C) {
    const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= N) return;
    const floatX* x = lnf + row * C;
    const floatX* w = wte + int64_t(targets[row]) * C;
    float acc = 0.0f;
    for (int k = lane; k < C; k += 32) acc = fmaf(float(x[k]), float(w[k]), acc);
    for (int o = 16; o > 0; o /= 2) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (lane == 0) c[row] = acc;
}

// x (C values, C even) *= r, by one warp.
__device__ inline void scale_row(float r, floatX* x, int C, int lane) {
    __nv_bfloat162* v2 = reinterpret_cast<__nv_bfloat162*>(x);
    for (int k = lane; k < C / 2; k += 32) {
        const float2 v = __bfloat1622float2(v2[k]);
        v2[k] = __floats2bfloat162_rn(v.x * r, v.y * r);
    }
}

// Per row (one warp): s = 1 + the tiles' sums (a fixed tree), loss = log(s); with dloss > 0 also
// Y[row, target] = 1 - s and lnf[row] *= dloss / s.
static __global__ void finish_kernel(floatX* y, float* losses, float* sums, floatX* lnf, const float* partial,
                              const int* targets, float dloss, int64_t N, int n_tiles, int C, int Vp) {
    const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= N) return;
    const float* p = partial + row * n_tiles;
    float t = 0.0f;
    for (int n = lane; n < n_tiles; n += 32) t += p[n];
    for (int o = 16; o > 0; o /= 2) t += __shfl_down_sync(0xffffffffu, t, o);
    const float tail = __shfl_sync(0xffffffffu, t, 0), s = 1.0f + tail;
    if (lane == 0) {
        sums[row] = s;
        losses[row] = logf(s);
        if (dloss > 0.0f) y[row * Vp + targets[row]] = __float2bfloat16_rn(-tail);
    }
    if (dloss > 0.0f) scale_row(dloss / s, lnf + row * C, C, lane);
}

// x[row] *= dloss / sums[row] (one warp a row).
static __global__ void scale_rows_kernel(floatX* x, const float* sums, float dloss, int64_t N, int C) {
    const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= N) return;
    scale_row(dloss / sums[row], x + row * C, C, lane);
}

// The TMA descriptor of a (rows, cols) row-major bf16 matrix in box_rows x box_cols swizzled boxes.
inline CUtensorMap tensor_map(const floatX* base, int64_t cols, int64_t rows, int box_cols, int box_rows,
                              const char* what) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    CUtensorMap map{};
    const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
    const cuuint64_t strides[1] = {cuuint64_t(cols) * sizeof(floatX)};
    const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)}, elem_strides[2] = {1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<floatX*>(base), dims, strides, box,
                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fail(kExitCuda, "classifier90: cuTensorMapEncodeTiled for %s (%lld x %lld) failed with CUresult %d", what,
             (long long)rows, (long long)cols, int(r));
    }
    return map;
}

inline void launch_gemm(floatX* out, const floatX* lnf, const floatX* wte, int64_t N, int C, int V, int Vp,
                        const float* c, const int* targets, float* partial, cudaStream_t stream) {
    static const int sms = [] {
        int dev = 0, n = 0;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
        cudaCheck(cudaFuncSetAttribute(cls_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
        return n;
    }();
    const CUtensorMap map_a = tensor_map(lnf, C, N, kBK, kBM, "lnf");
    const CUtensorMap map_b = tensor_map(wte, C, Vp, kBK, kBN, "wte");
    const CUtensorMap map_out = tensor_map(out, Vp, N, kOutBox, 64, "logits");
    const int64_t tiles = (N / kBM) * ((Vp + kBN - 1) / kBN);
    const int grid = int(std::min<int64_t>(sms, tiles));
    cls_gemm_kernel<<<grid, kThreads, kSmem, stream>>>(map_a, map_b, map_out, int(N), Vp, V, C, c, targets, partial);
    cudaCheckLaunch();
}

// The shapes the kernels take (classifier90_applies), one rule for the check and the query.
inline bool shapes_ok(int64_t N, int C, int Vp) {
    return N > 0 && N % kBM == 0 && C > 0 && C % kBK == 0 && Vp % 8 == 0 && N <= (int64_t(1) << 30) / 2;
}

inline void check_shapes(const char* what, int64_t N, int C, int Vp) {
    if (!shapes_ok(N, C, Vp)) {
        fail(kExitUsage, "%s: N=%lld C=%d Vp=%d, need N and C positive, N a multiple of %d (at most 2^29), C of %d "
             "and Vp of 8", what, (long long)N, C, Vp, kBM, kBK);
    }
}

}  // namespace classifier90_detail

inline bool classifier90_available() { return sm90a_available(); }

inline bool classifier90_applies(int64_t N, int C, int Vp) { return classifier90_detail::shapes_ok(N, C, Vp); }

inline size_t classifier90_partial_count(int64_t N, int Vp) {
    return size_t(N) * size_t((Vp + classifier90_detail::kBN - 1) / classifier90_detail::kBN);
}

inline void classifier90_exp_forward(floatX* y, float* losses, floatX* lnf, const floatX* wte, const int* targets,
                                     float dloss, int64_t N, int C, int V, int Vp, const Classifier90Scratch& scratch,
                                     cudaStream_t stream) {
    using namespace classifier90_detail;
    if (!classifier90_available()) {
        fail(kExitUsage, "classifier90_exp_forward: needs a build for sm_90a and a compute 9.0 GPU");
    }
    check_shapes("classifier90_exp_forward", N, C, Vp);
    if (V < 1 || V > Vp) fail(kExitUsage, "classifier90_exp_forward: V=%d is not in [1, Vp=%d]", V, Vp);
    const unsigned warp_blocks = unsigned((N + 7) / 8);
    target_logit_kernel<<<warp_blocks, 256, 0, stream>>>(scratch.c, lnf, wte, targets, N, C);
    cudaCheckLaunch();
    launch_gemm(y, lnf, wte, N, C, V, Vp, scratch.c, targets, scratch.partial, stream);
    finish_kernel<<<warp_blocks, 256, 0, stream>>>(y, losses, scratch.sums, lnf, scratch.partial, targets, dloss, N,
                                                   (Vp + kBN - 1) / kBN, C, Vp);
    cudaCheckLaunch();
}

inline void classifier90_scale_rows(floatX* x, const float* sums, float dloss, int64_t N, int C, cudaStream_t stream) {
    if (N == 0) return;
    if (C % 2 != 0) fail(kExitUsage, "classifier90_scale_rows: C=%d is odd", C);
    classifier90_detail::scale_rows_kernel<<<unsigned((N + 7) / 8), 256, 0, stream>>>(x, sums, dloss, N, C);
    cudaCheckLaunch();
}

}  // namespace llmc
