/*
Flash attention on Hopper's warpgroup tensor-core instructions (wgmma), head size 64: the same kernels,
arguments, saved state (lse), scratch (D) and bits as flash_forward<64>/flash_backward<64> of
llmc/flash_attention.cuh, which stays the path for every other GPU and head size.
Entry points (at the end of the file): flash90_available, flash90_forward and flash90_backward (optionally
with the bias's column sums).
A block is one warpgroup (128 threads) owning 64 rows. The fixed operand stays in shared memory as
wgmma's A; the streamed one (64 rows a step, double-buffered) is B. TMA loads the tiles (rows past T
arrive as zeros) in the 128-byte swizzle; the fixed operands never enter registers (ptxas would
serialise the wgmma). Numerics as the mma.sync kernels (llmc/flash_common.cuh), bit for bit. Design and
measurements: docs/design.md, docs/lab-notes.md ("Flash attention").
*/
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes through the runtime)
#include <cudaTypedefs.h>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flash_common.cuh"
#include "llmc/sm90.cuh"
#include "llmc/utils.h"

// Device code for sm_90a (wgmma is an "a" feature): __CUDA_ARCH_FEAT_SM90_ALL is defined there only.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH90_DEVICE 1
#else
#define FLASH90_DEVICE 0
#endif

namespace llmc {

// The blocks per SM that the backward kernels' registers are capped for; the same bits for any value.
constexpr int kFlash90KvMinBlocks = 3, kFlash90QMinBlocks = 4;

namespace flash90_detail {
using namespace flash_common;

constexpr int kHS = 64;
constexpr int kRows = 64;                          // rows per block and per streamed tile
constexpr int kWGThreads = 128;                    // one warpgroup per block
constexpr int kTileBytes = kRows * kHS * 2;        // 8 KiB: 64 rows of 128 bytes
constexpr int kAlign = 1024;                       // the 128-byte swizzle repeats every 8 rows

// Dynamic shared memory rounded up to the swizzle's 1024-byte period (the launchers ask for kAlign more).
__device__ inline uint8_t* align_smem(uint8_t* p) {
    const uint32_t a = smem_addr(p);
    return p + ((kAlign - (a & (kAlign - 1))) & (kAlign - 1));
}

// TMA tile loads: one thread asks for a 64 x 64 tile, written swizzled (rows past T as zeros); the
// threads wait on an mbarrier that counts the bytes in.
__device__ inline void mbar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
}
// After mbar_init, before any other thread or the TMA unit uses the barriers (then a __syncthreads()).
__device__ inline void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// The issuing thread's arrival, announcing `bytes` to come from TMA loads that signal this barrier.
__device__ inline void mbar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
// Waits until the barrier's phase with this parity has completed (its bytes all arrived).
__device__ inline void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "mbar_retry:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra mbar_retry;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
// Rows row.., columns col.. (64 each) of batch `batch` of map's (B, T, cols) tensor into a swizzled tile.
__device__ inline void tma_tile(uint8_t* dst, const CUtensorMap* map, uint64_t* bar, int col, int row, int batch) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(batch), "r"(smem_addr(bar))
        : "memory");
}

// Where a kernel's 64 x 64 tiles come from: columns col.. of batch b of a (B, T, cols) tensor.
struct TileSource {
    const CUtensorMap* map;
    int col, b;
};

// The tiles that stay for the whole block (a, and b when given), rows row0.., on bars[0]. One thread.
__device__ inline void load_fixed(uint8_t* dst_a, const TileSource& a, uint8_t* dst_b, const TileSource* b, int row0,
                                  uint64_t (&bars)[3]) {
    mbar_expect(&bars[0], (b != nullptr ? 2 : 1) * kTileBytes);
    tma_tile(dst_a, a.map, bars, a.col, row0, a.b);
    if (b != nullptr) tma_tile(dst_b, b->map, bars, b->col, row0, b->b);
}

// Step n of a stream of tile pairs into buffer n & 1 of `stream`, on bars[1 + (n & 1)]. One thread.
__device__ inline void load_stream_pair(uint8_t* stream, const TileSource& a, const TileSource& b, int n, int row,
                                        uint64_t (&bars)[3]) {
    uint8_t* dst = stream + (n & 1) * 2 * kTileBytes;
    uint64_t* bar = &bars[1 + (n & 1)];
    mbar_expect(bar, 2 * kTileBytes);
    tma_tile(dst, a.map, bar, a.col, row, a.b);
    tma_tile(dst + kTileBytes, b.map, bar, b.col, row, b.b);
}

// The prologue of a kernel's loads: barriers set up, fixed tiles and step 0 issued (issue_first by
// thread 0, each_first by every thread); returns once the fixed tiles have arrived.
template <class IssueFirst, class EachFirst>
__device__ inline void loads_begin(uint64_t (&bars)[3], int tid, IssueFirst issue_first, EachFirst each_first) {
    if (tid == 0) {
        for (int i = 0; i < 3; i++) mbar_init(&bars[i]);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) issue_first();
    each_first();
    mbar_wait(&bars[0], 0);
}

// One step of a double-buffered stream: frees the other buffer, loads step + 1 into it, waits for this one.
template <class IssueNext, class EachNext>
__device__ inline void loads_step(int step, int n_steps, uint64_t (&bars)[3], int tid, IssueNext issue_next,
                                  EachNext each_next) {
    __syncthreads();
    if (step + 1 < n_steps) {
        if (tid == 0) issue_next(step + 1);
        each_next(step + 1);
    }
    mbar_wait(&bars[1 + (step & 1)], (step >> 1) & 1);
}

// A fragments of the four k-steps from a 64 x 64 fp32 accumulator (D layout = A layout in bf16 pairs).
__device__ inline void acc_to_a(uint32_t (&a)[4][4], const float (&d)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) acc_frag(a[kk], d, kk);
}

// Shared-memory matrix descriptor of a swizzled tile (128-byte swizzle, 8-row groups 1024 bytes apart);
// K-major or MN-major B.
template <bool MNMajor>
__device__ inline uint64_t tile_desc(const uint8_t* tile, int kk) {
    const uint32_t addr = smem_addr(tile) + (MNMajor ? kk * 2048 : kk * 32);
    const uint64_t lbo = MNMajor ? 1024 : 16, sbo = 1024;
    return uint64_t((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (uint64_t(1) << 62);
}

// Keeps the compiler from moving accesses of an accumulator across the asynchronous wgmma that owns it.
__device__ inline void fence_acc(float (&d)[8][4]) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[i][e])::"memory");
    }
}

__device__ inline void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ inline void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// The 32 accumulator registers of an m64n64 wgmma (d[8][4]), as inline-asm operands %0..%31 read and written.
#define FLASH90_ACC_OPERANDS(d)                                                                                    \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),       \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),   \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),   \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),   \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])

// d (64 x 64 fp32) += A (registers, one k-step) * B (shared). Issues only: the caller fences and waits.
template <bool MNMajor>
__device__ inline void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
#if FLASH90_DEVICE
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
        "}\n"
        : FLASH90_ACC_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(MNMajor ? 1 : 0));
#endif
}

// d (64 x 64 fp32) += A (shared, K-major swizzled tile) * B (shared): wgmma_rs with A in shared memory.
template <bool MNMajor>
__device__ inline void wgmma_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
#if FLASH90_DEVICE
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n"
        "}\n"
        : FLASH90_ACC_OPERANDS(d)
        : "l"(desc_a), "l"(desc_b), "r"(1), "n"(MNMajor ? 1 : 0));
#endif
}

#undef FLASH90_ACC_OPERANDS

// The A operand of a product: a 64 x 64 swizzled tile in shared memory, read by wgmma directly.
struct SmemA {
    const uint8_t* tile;
};

// Issues d += A (four k-steps) * B (a 64 x 64 swizzled tile) as four wgmma.
template <bool MNMajor>
__device__ inline void issue_product(float (&d)[8][4], const uint32_t (&a)[4][4], const uint8_t* tile) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wgmma_rs<MNMajor>(d, a[kk], tile_desc<MNMajor>(tile, kk));
}
template <bool MNMajor>
__device__ inline void issue_product(float (&d)[8][4], SmemA a, const uint8_t* tile) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wgmma_ss<MNMajor>(d, tile_desc<false>(a.tile, kk), tile_desc<MNMajor>(tile, kk));
}

// d0 += A0 * B0 and d1 += A1 * B1 (B1 = nullptr: d0 only) as one wgmma group, waited for before returning.
template <bool MNMajor, class A0, class A1>
__device__ inline void products(float (&d0)[8][4], const A0& a0, const uint8_t* b0, float (&d1)[8][4], const A1& a1,
                                const uint8_t* b1) {
    fence_acc(d0);
    if (b1 != nullptr) fence_acc(d1);
    wg_fence();
    issue_product<MNMajor>(d0, a0, b0);
    if (b1 != nullptr) issue_product<MNMajor>(d1, a1, b1);
    wg_commit();
    wg_wait_all();
    fence_acc(d0);
    if (b1 != nullptr) fence_acc(d1);
}

template <bool MNMajor, class A>
__device__ inline void product(float (&d)[8][4], const A& a, const uint8_t* b) {
    products<MNMajor>(d, a, b, d, a, nullptr);
}

// Shared memory of each kernel (plus kAlign). Forward: Q and two K, V pairs; dQ: Q, dO and two K, V
// pairs; dK/dV: K, V, two Q, dO pairs and two lse, D pairs.
constexpr size_t kSmemFwd = 5 * size_t(kTileBytes) + kAlign;
constexpr size_t kSmemDq = 6 * size_t(kTileBytes) + kAlign;
constexpr size_t kSmemDkdv = 6 * size_t(kTileBytes) + 2 * 2 * kRows * sizeof(float) + kAlign;

// The column sums of a block's 64 x 64 bf16 tile (bf16(acc * mul)) into row row_base / 64 of sums, in a
// fixed order (lanes, then shuffles xor 4, 8, 16, then warps in order through `stage`). Every thread
// calls it; it starts with a barrier. T % 64 == 0.
__device__ inline void store_tile_sums(float* sums, int64_t ld, int64_t row_base, int col,
                                       const float (&acc)[kHS / 8][4], float mul, float* stage, int warp,
                                       int lane) {
    const int g = lane >> 2, q = lane & 3;
    float s[kHS / 8][2];
#pragma unroll
    for (int dt = 0; dt < kHS / 8; dt++) {
        const __nv_bfloat162 a = __floats2bfloat162_rn(acc[dt][0] * mul, acc[dt][1] * mul);  // row g
        const __nv_bfloat162 b = __floats2bfloat162_rn(acc[dt][2] * mul, acc[dt][3] * mul);  // row g + 8
        s[dt][0] = __low2float(a) + __low2float(b);
        s[dt][1] = __high2float(a) + __high2float(b);
    }
#pragma unroll
    for (int off = 4; off < kWarpSize; off <<= 1) {
#pragma unroll
        for (int dt = 0; dt < kHS / 8; dt++) {
            s[dt][0] += __shfl_xor_sync(0xffffffffu, s[dt][0], off);
            s[dt][1] += __shfl_xor_sync(0xffffffffu, s[dt][1], off);
        }
    }
    __syncthreads();
    if (g == 0) {
#pragma unroll
        for (int dt = 0; dt < kHS / 8; dt++) {
            *reinterpret_cast<float2*>(stage + warp * kHS + dt * 8 + 2 * q) = make_float2(s[dt][0], s[dt][1]);
        }
    }
    __syncthreads();
    const int tid = threadIdx.x;
    if (tid < kHS) {
        const float t = ((stage[tid] + stage[kHS + tid]) + stage[2 * kHS + tid]) + stage[3 * kHS + tid];
        sums[(row_base / kRows) * ld + col + tid] = t;
    }
}

// ----------------------------------------------------------------------------------------------------
// Forward: block = 64 queries of one (b, h), longest first; over 64-key blocks up to the diagonal, the
// next K, V loading while this one computes.

static __global__ void __launch_bounds__(kWGThreads)
    flash90_fwd_kernel(floatX* out, float* lse, const floatX* qkv, const __grid_constant__ CUtensorMap qkv_map, int T,
                       int NH, float scale_log2) {
#if FLASH90_DEVICE
    extern __shared__ uint8_t smem_raw[];
    __shared__ alignas(8) uint64_t bars[3];  // Q, K/V buffer 0, K/V buffer 1
    uint8_t* sQ = align_smem(smem_raw);
    uint8_t* sKV = sQ + kTileBytes;  // [buffer][K, V]
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * kRows;
    const int C = NH * kHS;
    const int tid = threadIdx.x, warp = (tid / kWarpSize) % 4, lane = tid % kWarpSize;
    const int wlast = q0 + kRows - 1;  // this block's last query
    const int row0 = q0 + 16 * warp;   // this warp's first

    const TileSource q_src{&qkv_map, h * kHS, b}, k_src{&qkv_map, C + h * kHS, b}, v_src{&qkv_map, 2 * C + h * kHS, b};
    auto load_kv = [&](int j) { load_stream_pair(sKV, k_src, v_src, j, j * kRows, bars); };
    auto nothing = [](int) {};
    loads_begin(
        bars, tid,
        [&] {
            load_fixed(sQ, q_src, nullptr, nullptr, q0, bars);
            load_kv(0);
        },
        [] {});

    uint32_t pa[4][4];
    float o[8][4], s[1][8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    zero(o);
    const int n_blocks = ceil_div(min(T, q0 + kRows), kRows);
    for (int j = 0; j < n_blocks; j++) {
        const int k0 = j * kRows, buf = j & 1;
        loads_step(j, n_blocks, bars, tid, load_kv, nothing);
        if (k0 > wlast) continue;  // every key after every query of this block
        const uint8_t* sK = sKV + buf * 2 * kTileBytes;
        zero(s[0]);
        product<false>(s[0], SmemA{sQ}, sK);
        if (k0 + kRows - 1 > q0 || k0 + kRows > T) {
            mask_block<1, kRows>(s, row0, k0, -INFINITY, lane, [T](int r, int c) { return c <= r && c < T; });
        }
        softmax_step<kHS>(s[0], m, l, o, scale_log2);
        acc_to_a(pa, s[0]);
        product<true>(o, pa, sK + kTileBytes);
    }
    store_forward_rows<kHS>(out + int64_t(b) * T * C + h * kHS, C, lse + int64_t(bh) * T, o, m, l, row0, T, lane);
#endif
}

// ----------------------------------------------------------------------------------------------------
// Backward, dK/dV: block = 64 keys of one (b, h), longest first; over the query blocks from the first key
// to T, the next Q, dO, lse, D loading. S^T = K Q^T, dV += P^T dO, dS^T = P^T (dP^T - D), dK += dS^T Q.

static __global__ void __launch_bounds__(kWGThreads, kFlash90KvMinBlocks)
    flash90_dkdv_kernel(floatX* dqkv, const floatX* qkv, const floatX* dout, const float* lse, const float* D,
                        const __grid_constant__ CUtensorMap qkv_map, const __grid_constant__ CUtensorMap dout_map,
                        int T, int NH, float scale_log2, float scale, float* sums) {
#if FLASH90_DEVICE
    extern __shared__ uint8_t smem_raw[];
    __shared__ alignas(8) uint64_t bars[3];  // K and V, Q/dO buffer 0, Q/dO buffer 1
    uint8_t* sK = align_smem(smem_raw);
    uint8_t* sV = sK + kTileBytes;
    uint8_t* sQdO = sV + kTileBytes;                               // [buffer][Q, dO]
    float* sLD = reinterpret_cast<float*>(sQdO + 4 * kTileBytes);  // [buffer][lse2, D]
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int k0 = blockIdx.x * kRows;
    const int C = NH * kHS;
    const int64_t C3 = 3 * int64_t(C);
    const int tid = threadIdx.x, warp = (tid / kWarpSize) % 4, lane = tid % kWarpSize;
    const int wlast = k0 + kRows - 1;  // this block's last key
    const int row0 = k0 + 16 * warp;   // this warp's first

    const TileSource q_src{&qkv_map, h * kHS, b}, k_src{&qkv_map, C + h * kHS, b},
        v_src{&qkv_map, 2 * C + h * kHS, b}, do_src{&dout_map, h * kHS, b};
    const int i0 = k0 / kRows, n_qblocks = ceil_div(T, kRows);
    // Step n into buffer n & 1: Q and dO tiles, and (every thread, one step ahead) its lse and D.
    auto load_tiles = [&](int n) { load_stream_pair(sQdO, q_src, do_src, n, (i0 + n) * kRows, bars); };
    auto load_lse_d = [&](int n) {
        const int q0 = (i0 + n) * kRows;
        float* bL = sLD + (n & 1) * 2 * kRows;
        for (int t = tid; t < kRows; t += kWGThreads) {
            const int qi = q0 + t;
            bL[t] = qi < T ? lse[int64_t(bh) * T + qi] * kLog2e : 0.0f;
            bL[kRows + t] = qi < T ? D[int64_t(bh) * T + qi] : 0.0f;
        }
    };
    loads_begin(
        bars, tid,
        [&] {
            load_fixed(sK, k_src, sV, &v_src, k0, bars);
            load_tiles(0);
        },
        [&] { load_lse_d(0); });

    uint32_t pa[4][4], da[4][4];
    float dk[8][4], dv[8][4], st[1][8][4], dpt[8][4];
    zero(dk);
    zero(dv);
    for (int i = i0; i < n_qblocks; i++) {
        const int q0 = i * kRows, buf = (i - i0) & 1;
        loads_step(i - i0, n_qblocks - i0, bars, tid, load_tiles, load_lse_d);
        if (q0 + kRows - 1 < k0) continue;  // every query before every key of this block
        const uint8_t* sQ = sQdO + buf * 2 * kTileBytes;
        const uint8_t* sdO = sQ + kTileBytes;
        const float* sL = sLD + buf * 2 * kRows;
        const float* sD = sL + kRows;

        zero(st[0]);
        zero(dpt);
        products<false>(st[0], SmemA{sK}, sQ, dpt, SmemA{sV}, sdO);
        for_each_element<1, kRows>(lane, [&](int, int nt, int e, int, int c) {
            st[0][nt][e] = exp2_fast(fmaf(st[0][nt][e], scale_log2, -sL[c]));
        });
        // Queries before the key (above the diagonal) or past T get P = 0.
        if (q0 < wlast || q0 + kRows > T) {
            mask_block<1, kRows>(st, row0, q0, 0.0f, lane, [T](int r, int c) { return c >= r && c < T; });
        }
        for_each_element<1, kRows>(lane, [&](int, int nt, int e, int, int c) {
            dpt[nt][e] = st[0][nt][e] * (dpt[nt][e] - sD[c]);
        });
        acc_to_a(pa, st[0]);
        acc_to_a(da, dpt);
        products<true>(dv, pa, sdO, dk, da, sQ);
    }
    // A block's first query block starts at its first key, so the loop ran at least once.
    store_rows<kHS>(dqkv + int64_t(b) * T * C3 + C + h * kHS, C3, dk, scale, scale, row0, T, lane);
    store_rows<kHS>(dqkv + int64_t(b) * T * C3 + 2 * C + h * kHS, C3, dv, 1.0f, 1.0f, row0, T, lane);
    if (sums != nullptr) {
        const int64_t row_base = int64_t(b) * T + k0;
        float* stage = reinterpret_cast<float*>(sQdO);
        store_tile_sums(sums, C3, row_base, C + h * kHS, dk, scale, stage, warp, lane);
        store_tile_sums(sums, C3, row_base, 2 * C + h * kHS, dv, 1.0f, stage, warp, lane);
    }
#endif
}

// ----------------------------------------------------------------------------------------------------
// Backward, dQ: block = 64 queries of one (b, h); over the key blocks up to the diagonal, dQ += dS K.
// First each block computes D of its rows (rowsum(dO * O)) for the dK/dV kernel, which runs after.

static __global__ void __launch_bounds__(kWGThreads, kFlash90QMinBlocks)
    flash90_dq_kernel(floatX* dqkv, const floatX* qkv, const floatX* dout, const floatX* out, const float* lse,
                      float* D, const __grid_constant__ CUtensorMap qkv_map,
                      const __grid_constant__ CUtensorMap dout_map, int T, int NH, float scale_log2, float scale,
                      float* sums) {
#if FLASH90_DEVICE
    extern __shared__ uint8_t smem_raw[];
    __shared__ alignas(8) uint64_t bars[3];  // Q and dO, K/V buffer 0, K/V buffer 1
    uint8_t* sQ = align_smem(smem_raw);
    uint8_t* sdO = sQ + kTileBytes;
    uint8_t* sKV = sdO + kTileBytes;  // [buffer][K, V]
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * kRows;
    const int C = NH * kHS;
    const int64_t C3 = 3 * int64_t(C);
    const int tid = threadIdx.x, warp = (tid / kWarpSize) % 4, lane = tid % kWarpSize;
    const int g = lane >> 2;
    const int wlast = q0 + kRows - 1;
    const int row0 = q0 + 16 * warp;
    float lse2[2], Dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        lse2[r] = row < T ? lse[int64_t(bh) * T + row] * kLog2e : 0.0f;
    }
    // D of the block's rows as flash_bwd_dot_kernel computes it (the same bits).
    constexpr int kDotLanes = kHS / 8, kDotRowsPerPass = kWGThreads / kDotLanes;
    constexpr int kDotPasses = kRows / kDotRowsPerPass;
    __shared__ float sD[kRows];
    const int sub = tid % kDotLanes;
    PackX o_part[kDotPasses];
#pragma unroll
    for (int p = 0; p < kDotPasses; p++) {
        const int t = q0 + tid / kDotLanes + p * kDotRowsPerPass;
        if (t < T) o_part[p] = load128(out + ((int64_t(b) * T + t) * NH + h) * kHS + sub * 8);
    }

    const TileSource q_src{&qkv_map, h * kHS, b}, k_src{&qkv_map, C + h * kHS, b},
        v_src{&qkv_map, 2 * C + h * kHS, b}, do_src{&dout_map, h * kHS, b};
    auto load_kv = [&](int j) { load_stream_pair(sKV, k_src, v_src, j, j * kRows, bars); };
    auto nothing = [](int) {};
    loads_begin(
        bars, tid,
        [&] {
            load_fixed(sQ, q_src, sdO, &do_src, q0, bars);
            load_kv(0);
        },
        [] {});
#pragma unroll
    for (int p = 0; p < kDotPasses; p++) {
        const int rr = tid / kDotLanes + p * kDotRowsPerPass, t = q0 + rr;
        // Row rr's 16-byte part sub sits at part sub ^ (rr % 8) of its 128 bytes (the 128-byte swizzle).
        PackX d;
        if (t < T) d = *reinterpret_cast<const PackX*>(sdO + rr * 2 * kHS + ((sub ^ (rr & 7)) << 4));
        const float acc = row_dot<kHS>(t < T, o_part[p], d);
        if (sub == 0) {
            sD[rr] = acc;  // 0 past T, where Dr is 0
            if (t < T) D[int64_t(bh) * T + t] = acc;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; r++) Dr[r] = sD[16 * warp + g + 8 * r];

    uint32_t da[4][4];
    float dq[8][4], s[1][8][4], dp[8][4];
    zero(dq);
    const int n_blocks = ceil_div(min(T, q0 + kRows), kRows);
    for (int j = 0; j < n_blocks; j++) {
        const int k0 = j * kRows, buf = j & 1;
        loads_step(j, n_blocks, bars, tid, load_kv, nothing);
        if (k0 > wlast) continue;
        const uint8_t* sK = sKV + buf * 2 * kTileBytes;
        zero(s[0]);
        zero(dp);
        products<false>(s[0], SmemA{sQ}, sK, dp, SmemA{sdO}, sK + kTileBytes);
        for_each_element<1, kRows>(lane, [&](int, int nt, int e, int, int) {
            s[0][nt][e] = exp2_fast(fmaf(s[0][nt][e], scale_log2, -lse2[e >> 1]));
        });
        if (k0 + kRows - 1 > q0 || k0 + kRows > T) {
            mask_block<1, kRows>(s, row0, k0, 0.0f, lane, [T](int r, int c) { return c <= r && c < T; });
        }
        for_each_element<1, kRows>(lane, [&](int, int nt, int e, int, int) {
            dp[nt][e] = s[0][nt][e] * (dp[nt][e] - Dr[e >> 1]);
        });
        acc_to_a(da, dp);
        product<true>(dq, da, sK);
    }
    store_rows<kHS>(dqkv + int64_t(b) * T * C3 + h * kHS, C3, dq, scale, scale, row0, T, lane);
    if (sums != nullptr) {
        store_tile_sums(sums, C3, int64_t(b) * T + q0, h * kHS, dq, scale, reinterpret_cast<float*>(sKV), warp, lane);
    }
#endif
}

// The TMA descriptor of a (B, T, cols) bf16 tensor read in swizzled 64 x 64 tiles (rows past T zero-filled).
inline CUtensorMap rows_tensor_map(const floatX* base, int64_t cols, int T, int B, const char* what) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    CUtensorMap map{};
    const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(T), cuuint64_t(B)};
    const cuuint64_t row_bytes = cuuint64_t(cols) * sizeof(floatX);
    const cuuint64_t strides[2] = {row_bytes, cuuint64_t(T) * row_bytes};  // bytes between rows, between batches
    const cuuint32_t box[3] = {kHS, kRows, 1}, elem_strides[3] = {1, 1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<floatX*>(base), dims, strides, box,
                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fail(kExitCuda, "flash90: cuTensorMapEncodeTiled for %s (B=%d T=%d cols=%lld) failed with CUresult %d", what,
             B, T, (long long)cols, int(r));
    }
    return map;
}

}  // namespace flash90_detail

// Whether flash90_forward/flash90_backward can run here: built for sm_90a and running on compute 9.0.
inline bool flash90_available() { return sm90a_available(); }

// As flash_forward<64> (same arguments, same lse), on wgmma. Needs flash90_available().
inline void flash90_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, cudaStream_t stream) {
    using namespace flash90_detail;
    if (!flash90_available()) fail(kExitUsage, "flash90_forward: needs a build for sm_90a and a compute 9.0 GPU");
    check_args("flash90_forward", B, T, NH);
    require_aligned16_each("flash90_forward", {{"out", out}, {"lse", lse}, {"qkv", qkv}});
    const CUtensorMap qkv_map = rows_tensor_map(qkv, 3 * int64_t(NH) * kHS, T, B, "qkv");
    allow_smem(flash90_fwd_kernel, kSmemFwd);
    const float scale_log2 = kLog2e / sqrtf(float(kHS));
    const dim3 grid(unsigned(ceil_div(T, kRows)), unsigned(B * NH));
    flash90_fwd_kernel<<<grid, kWGThreads, kSmemFwd, stream>>>(out, lse, qkv, qkv_map, T, NH, scale_log2);
    cudaCheckLaunch();
}

// As flash_backward<64>, on wgmma. sums (optional; (B T / 64, 3C) floats, T % 64 == 0): each 64-row
// block's column sums of dqkv, for bias_grad_from_partials; dqkv's bits do not change with it. Both backward
// launches: dQ, which computes D, then dK/dV.
inline void flash90_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                             int B, int T, int NH, float* D, cudaStream_t stream, float* sums = nullptr) {
    using namespace flash90_detail;
    const char* fn = "flash90_backward";
    if (!flash90_available()) fail(kExitUsage, "%s: needs a build for sm_90a and a compute 9.0 GPU", fn);
    check_args(fn, B, T, NH);
    if (sums != nullptr) {
        if (T % kRows != 0) fail(kExitUsage, "%s: the column sums need T a multiple of %d (T = %d)", fn, kRows, T);
        require_aligned16(sums, "flash90_backward: sums");
    }
    require_aligned16(dqkv, "flash90_backward: dqkv");
    require_aligned16_each("flash90_backward", {{"dout", dout}, {"qkv", qkv}, {"out", out}, {"lse", lse}, {"D", D}});
    const CUtensorMap qkv_map = rows_tensor_map(qkv, 3 * int64_t(NH) * kHS, T, B, "qkv");
    const CUtensorMap dout_map = rows_tensor_map(dout, int64_t(NH) * kHS, T, B, "dout");
    allow_smem(flash90_dkdv_kernel, kSmemDkdv);
    allow_smem(flash90_dq_kernel, kSmemDq);
    const float scale = 1.0f / sqrtf(float(kHS)), scale_log2 = scale * kLog2e;
    const dim3 grid(unsigned(ceil_div(T, kRows)), unsigned(B * NH));
    // dQ first: it computes D (flash_backward_dot's bits) and leaves it for dK/dV.
    flash90_dq_kernel<<<grid, kWGThreads, kSmemDq, stream>>>(dqkv, qkv, dout, out, lse, D, qkv_map, dout_map, T, NH,
                                                             scale_log2, scale, sums);
    cudaCheckLaunch();
    flash90_dkdv_kernel<<<grid, kWGThreads, kSmemDkdv, stream>>>(dqkv, qkv, dout, lse, D, qkv_map, dout_map, T, NH,
                                                                 scale_log2, scale, sums);
    cudaCheckLaunch();
}

}  // namespace llmc
