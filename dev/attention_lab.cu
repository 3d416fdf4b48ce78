/*
attention_lab: the flash-attention kernels of llmc/flash_attention.cuh and llmc/flash_attention_sm90.cuh,
and the variants of them the trainer does not run, checked against an fp32 reference and against each
other, and timed against the cuBLASLt path of llmc/attention.cuh (design, expectations and results:
docs/lab-notes.md, "Flash attention").

  build/attention_lab

The trainer's kernels live in the headers (it runs them for HS 64 and 128 through llmc/attention.cuh,
tiled as flash_tiling<HS>() says, or the wgmma kernels on an sm_90a build on Hopper); this file holds what
only the lab needs: fp32 reference kernels straight from the definition (one warp per row), the wgmma
kernels with the choices the header fixes left open (namespace lab90: warpgroups per block, tiles loaded
by TMA or cp.async, register caps), the checks and the timing table.
Checks (exit 1 on any failure): out, lse, dq, dk, dv against the fp32 reference (relative error norm;
lse max abs), outputs poisoned with NaN before each launch (so an unwritten element shows), forward and
backward run twice and compared bitwise, and every other variant bitwise equal to the plainest mma.sync
tiling: the other tilings (Pipe: double-buffered tiles; MT: two row tiles of 16 per warp, HS 64) with the
trainer's among them, and, on an sm_90a build on Hopper, the header's wgmma kernels and the lab90 ones,
after a selftest of the wgmma building blocks (swizzled tiles, descriptors, one and four accumulated
blocks); T = 1, 37, 64, 65, 1000, 1024 and small and large B*NH, HS 64 and 128. Then times (CUDA events,
median of 25 after warm-up) every variant and the cuBLASLt path at the d12 shapes, checks them against
each other and prints a table. Event timings drift with the GPU's clocks; `bash dev/gpu_runs.sh
attention-ncu` times the same launches under Nsight Compute at fixed clocks.

Does not provide: tests for the trainer (test/test_kernels.cu tests attention_forward/backward, both
paths, against the CPU reference).
*/
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "llmc/attention.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flash_attention.cuh"
#include "llmc/flash_attention_sm90.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

using namespace llmc;

// ----------------------------------------------------------------------------------------------------
// Variants of the wgmma kernels of llmc/flash_attention_sm90.cuh that the trainer does not run: several
// warpgroups per block (WG: 64 * WG rows, the warpgroups sharing the tiles the block loads), tiles loaded
// with cp.async by every thread instead of TMA (Tma = false: each thread computes its 16-byte chunks'
// swizzled addresses), and other register caps (MinKV, MinQ: blocks per SM). The kernels are the
// header's with those three choices open; WG = 1, Tma, MinKV = 3, MinQ = 4 is what the header runs. Every
// variant must give the header's bits (each row sees the same operations on the same tile contents).
// Outside the anonymous namespace: only the sm_90a build's kernels call these helpers, and other builds
// would warn about unreferenced internal functions.

namespace lab90 {
using namespace llmc::flash_common;
using flash90_detail::acc_to_a;
using flash90_detail::align_smem;
using flash90_detail::kAlign;
using flash90_detail::kHS;
using flash90_detail::kRows;
using flash90_detail::kTileBytes;
using flash90_detail::kWGThreads;
using flash90_detail::mbar_expect;
using flash90_detail::mbar_init;
using flash90_detail::mbar_init_fence;
using flash90_detail::mbar_wait;
using flash90_detail::product;
using flash90_detail::products;
using flash90_detail::rows_tensor_map;
using flash90_detail::SmemA;
using flash90_detail::tma_tile;
using flash90_detail::zero8;

// Rows row0 .. row0+63 of a (rows, 64) bf16 slice (row r at g + r * stride) into a swizzled tile; rows
// >= T zero-filled. All nthreads threads of the block take part.
__device__ inline void load_tile_sw(uint8_t* s, const floatX* g, int64_t stride, int row0, int T, int tid,
                                    int nthreads) {
    for (int i = tid; i < kRows * 8; i += nthreads) {
        const int r = i >> 3, c = i & 7;
        const int t = row0 + r;
        flash_detail::cp_async16(s + r * 128 + ((c ^ (r & 7)) << 4), g + int64_t(min(t, T - 1)) * stride + c * 8,
                                 t < T);
    }
}

// After this thread's cp.async copies have landed: makes them visible to wgmma, which reads shared memory
// through the async proxy. A __syncthreads() must follow before any warpgroup reads the tiles.
__device__ inline void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// One step of a double-buffered loop over n_steps tiles (or tile sets): the barrier that lets the buffer
// of step + 1 be refilled (every warpgroup is done with it), load_next(step + 1) issued when there is
// such a step, then step's copies waited for, fenced for wgmma and a barrier, so every warpgroup may read
// them. The copies of step 0 must have been issued and committed before the loop.
template <class LoadNext>
__device__ inline void pipeline_step(int step, int n_steps, LoadNext load_next) {
    __syncthreads();
    if (step + 1 < n_steps) {
        load_next(step + 1);
        flash_detail::cp_async_commit();
        flash_detail::cp_async_wait<1>();
    } else {
        flash_detail::cp_async_wait<0>();
    }
    fence_async_proxy();
    __syncthreads();
}

// A fragments (wgmma m64k16, the mma.sync m16n8k16 layout per warp: warp w of the warpgroup holds rows
// 16w..16w+15) of all four k-steps of a warpgroup's 64 x 64 swizzled tile (the selftests' register A).
__device__ inline void load_a_frags(uint32_t (&a)[4][4], const uint8_t* tile, int warp, int lane) {
    const int row = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const int chunk = 2 * kk + (lane >> 4);
        flash_detail::ldsm_x4(a[kk], reinterpret_cast<const floatX*>(tile + row * 128 + ((chunk ^ (row & 7)) << 4)));
    }
}

// Where a kernel's 64 x 64 tiles come from: columns col .. col + 63 of batch b of a (B, T, cols) tensor,
// through its TMA map, or from g (the column's first element of batch b, rows `stride` elements apart).
struct TileSource {
    const CUtensorMap* map;
    const floatX* g;
    int64_t stride;
    int col, b;
};

// Rows row .. row + 63 of src into the swizzled tile at dst. Tma: issued by the calling thread alone, its
// bytes counted on bar (announced by the caller's mbar_expect); else every one of nthreads threads copies
// its share with cp.async (committed by the caller).
template <bool Tma>
__device__ inline void load_tile(uint8_t* dst, const TileSource& src, int row, int T, int tid, int nthreads,
                                 uint64_t* bar) {
    if constexpr (Tma) {
        tma_tile(dst, src.map, bar, src.col, row, src.b);
    } else {
        load_tile_sw(dst, src.g, src.stride, row, T, tid, nthreads);
    }
}

// The tiles that stay for the whole block: WG tiles of a at dst_a and, when b is given, WG of b at dst_b,
// rows row0 + 64 w, on bars[0] (Tma: by the calling thread alone).
template <bool Tma, int WG>
__device__ inline void load_fixed(uint8_t* dst_a, const TileSource& a, uint8_t* dst_b, const TileSource* b, int row0,
                                  int T, int tid, int nthreads, uint64_t (&bars)[3]) {
    if constexpr (Tma) mbar_expect(&bars[0], (b != nullptr ? 2 : 1) * WG * kTileBytes);
    for (int w = 0; w < WG; w++) {
        load_tile<Tma>(dst_a + w * kTileBytes, a, row0 + kRows * w, T, tid, nthreads, bars);
        if (b != nullptr) load_tile<Tma>(dst_b + w * kTileBytes, *b, row0 + kRows * w, T, tid, nthreads, bars);
    }
}

// Step n of a stream of tile pairs: rows row .. row + 63 of a and b into buffer n & 1 of `stream` (two
// tiles per buffer), on bars[1 + (n & 1)] (Tma: by the calling thread alone).
template <bool Tma>
__device__ inline void load_stream_pair(uint8_t* stream, const TileSource& a, const TileSource& b, int n, int row,
                                        int T, int tid, int nthreads, uint64_t (&bars)[3]) {
    uint8_t* dst = stream + (n & 1) * 2 * kTileBytes;
    uint64_t* bar = &bars[1 + (n & 1)];
    if constexpr (Tma) mbar_expect(bar, 2 * kTileBytes);
    load_tile<Tma>(dst, a, row, T, tid, nthreads, bar);
    load_tile<Tma>(dst + kTileBytes, b, row, T, tid, nthreads, bar);
}

// The prologue of a kernel's loads: with Tma, thread 0 sets up the three barriers (the fixed tiles', the
// two stream buffers') and the block waits for that; issue_first then loads the fixed tiles on bars[0]
// and step 0 of the stream, by thread 0 (Tma) or by every thread (cp.async, one commit group each), and
// each_first is every thread's own part of step 0. Tma: returns after the fixed tiles have arrived.
template <bool Tma, class IssueFirst, class EachFirst>
__device__ inline void loads_begin(uint64_t (&bars)[3], int tid, IssueFirst issue_first, EachFirst each_first) {
    if constexpr (Tma) {
        if (tid == 0) {
            for (int i = 0; i < 3; i++) mbar_init(&bars[i]);
            mbar_init_fence();
        }
        __syncthreads();
        if (tid == 0) issue_first();
        each_first();
        mbar_wait(&bars[0], 0);
    } else {
        issue_first();
        each_first();
        flash_detail::cp_async_commit();
    }
}

// One step of a double-buffered stream of n_steps tile sets (buffer step & 1, on bars[1 + buffer] with
// Tma): frees the other buffer (a barrier), loads step + 1 into it (issue_next by thread 0 with Tma, by
// every thread with cp.async; each_next by every thread), then waits for this step's tiles. cp.async:
// pipeline_step.
template <bool Tma, class IssueNext, class EachNext>
__device__ inline void loads_step(int step, int n_steps, uint64_t (&bars)[3], int tid, IssueNext issue_next,
                                  EachNext each_next) {
    if constexpr (Tma) {
        __syncthreads();
        if (step + 1 < n_steps) {
            if (tid == 0) issue_next(step + 1);
            each_next(step + 1);
        }
        mbar_wait(&bars[1 + (step & 1)], (step >> 1) & 1);
    } else {
        pipeline_step(step, n_steps, [&](int next) {
            issue_next(next);
            each_next(next);
        });
    }
}

// This thread's warpgroup in a block of WG warpgroups, in a form ptxas can see to be uniform across the
// warpgroup (a shuffle from lane 0), so that branches on it do not count as divergent around wgmma (which
// would serialize the wgmma: ptxas's C7520).
template <int WG>
__device__ inline int warpgroup_index() {
    if constexpr (WG == 1) {
        return 0;
    } else {
        return __shfl_sync(0xffffffffu, int(threadIdx.x) / kWGThreads, 0);
    }
}

// Shared memory of each kernel (plus kAlign for the alignment).
template <int WG>
constexpr size_t smem90_fwd() {  // Q tiles of the warpgroups, two K, V pairs
    return size_t(WG + 4) * kTileBytes + kAlign;
}
template <int WG>
constexpr size_t smem90_dq() {  // Q and dO tiles of the warpgroups, two K, V pairs
    return size_t(2 * WG + 4) * kTileBytes + kAlign;
}
template <int WG>
constexpr size_t smem90_dkdv() {  // K and V tiles of the warpgroups, two Q, dO pairs, two lse, D pairs
    return size_t(2 * WG + 4) * kTileBytes + 2 * 2 * kRows * sizeof(float) + kAlign;
}

// ----------------------------------------------------------------------------------------------------
// Forward: block = 64 * WG queries of one (b, h), longest first; loop over 64-key blocks up to the
// diagonal, K and V of block j + 1 loading while block j computes: S = Q K^T, wait, softmax, O += P V, wait.

template <int WG, bool Tma>
static __global__ void __launch_bounds__(WG * kWGThreads)
    lab90_fwd_kernel(floatX* out, float* lse, const floatX* qkv, const __grid_constant__ CUtensorMap qkv_map, int T,
                       int NH, float scale_log2) {
#if FLASH90_DEVICE
    constexpr int BM = kRows * WG, kThreads = WG * kWGThreads;
    extern __shared__ uint8_t smem_raw[];
    __shared__ alignas(8) uint64_t bars[3];  // Tma: Q, K/V buffer 0, K/V buffer 1
    uint8_t* sQ = align_smem(smem_raw);
    uint8_t* sKV = sQ + WG * kTileBytes;  // [buffer][K, V]
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int C = NH * kHS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * kHS;
    const int tid = threadIdx.x, wg = warpgroup_index<WG>(), warp = (tid / kWarpSize) % 4, lane = tid % kWarpSize;
    const int wfirst = q0 + kRows * wg, wlast = wfirst + kRows - 1;  // this warpgroup's queries
    const int row0 = wfirst + 16 * warp;                              // this warp's

    const TileSource q_src{&qkv_map, base, C3, h * kHS, b}, k_src{&qkv_map, base + C, C3, C + h * kHS, b},
        v_src{&qkv_map, base + 2 * C, C3, 2 * C + h * kHS, b};
    auto load_kv = [&](int j) { load_stream_pair<Tma>(sKV, k_src, v_src, j, j * kRows, T, tid, kThreads, bars); };
    auto nothing = [](int) {};
    loads_begin<Tma>(
        bars, tid,
        [&] {
            load_fixed<Tma, WG>(sQ, q_src, nullptr, nullptr, q0, T, tid, kThreads, bars);
            load_kv(0);
        },
        [] {});

    uint32_t pa[4][4];
    float o[8][4], s[1][8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    zero8(o);
    const int n_blocks = ceil_div(min(T, q0 + BM), kRows);
    for (int j = 0; j < n_blocks; j++) {
        const int k0 = j * kRows, buf = j & 1;
        loads_step<Tma>(j, n_blocks, bars, tid, load_kv, nothing);
        if (k0 > wlast) continue;  // every key after every query of this warpgroup
        const uint8_t* sK = sKV + buf * 2 * kTileBytes;
        zero8(s[0]);
        product<false>(s[0], SmemA{sQ + wg * kTileBytes}, sK);
        if (k0 + kRows - 1 > wfirst || k0 + kRows > T) {
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
// Backward, dK/dV: block = 64 * WG keys of one (b, h), longest first; loop over the 64-query blocks from
// the block's first key to T with Q, dO, lse, D of block i + 1 loading while block i computes. Keys are
// the rows: S^T = K Q^T, P^T = exp2(S^T * scale_log2 - lse2), dV += P^T dO, dP^T = V dO^T,
// dS^T = P^T (dP^T - D), dK += dS^T Q; dK scaled once at the end.

template <int WG, int MinBlocks, bool Tma>
static __global__ void __launch_bounds__(WG * kWGThreads, MinBlocks)
    lab90_dkdv_kernel(floatX* dqkv, const floatX* qkv, const floatX* dout, const float* lse, const float* D,
                        const __grid_constant__ CUtensorMap qkv_map, const __grid_constant__ CUtensorMap dout_map,
                        int T, int NH, float scale_log2, float scale) {
#if FLASH90_DEVICE
    constexpr int BM = kRows * WG, kThreads = WG * kWGThreads;
    extern __shared__ uint8_t smem_raw[];
    __shared__ alignas(8) uint64_t bars[3];  // Tma: K and V, Q/dO buffer 0, Q/dO buffer 1
    uint8_t* sK = align_smem(smem_raw);
    uint8_t* sV = sK + WG * kTileBytes;
    uint8_t* sQdO = sV + WG * kTileBytes;                              // [buffer][Q, dO]
    float* sLD = reinterpret_cast<float*>(sQdO + 4 * kTileBytes);  // [buffer][lse2, D]
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int k0 = blockIdx.x * BM;
    const int C = NH * kHS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * kHS;
    const floatX* dobase = dout + int64_t(b) * T * C + h * kHS;
    const int tid = threadIdx.x, wg = warpgroup_index<WG>(), warp = (tid / kWarpSize) % 4, lane = tid % kWarpSize;
    const int wfirst = k0 + kRows * wg, wlast = wfirst + kRows - 1;  // this warpgroup's keys
    const int row0 = wfirst + 16 * warp;

    const TileSource q_src{&qkv_map, base, C3, h * kHS, b}, k_src{&qkv_map, base + C, C3, C + h * kHS, b},
        v_src{&qkv_map, base + 2 * C, C3, 2 * C + h * kHS, b}, do_src{&dout_map, dobase, C, h * kHS, b};
    const int i0 = k0 / kRows, n_qblocks = ceil_div(T, kRows);
    // Step n (query block i0 + n) into buffer n & 1: its Q and dO tiles, and (every thread, plain loads, one
    // step ahead: the barrier that starts the step that reads them makes them visible) its lse and D.
    auto load_tiles = [&](int n) {
        load_stream_pair<Tma>(sQdO, q_src, do_src, n, (i0 + n) * kRows, T, tid, kThreads, bars);
    };
    auto load_lse_d = [&](int n) {
        const int q0 = (i0 + n) * kRows;
        float* bL = sLD + (n & 1) * 2 * kRows;
        for (int t = tid; t < kRows; t += kThreads) {
            const int qi = q0 + t;
            bL[t] = qi < T ? lse[int64_t(bh) * T + qi] * kLog2e : 0.0f;
            bL[kRows + t] = qi < T ? D[int64_t(bh) * T + qi] : 0.0f;
        }
    };
    loads_begin<Tma>(
        bars, tid,
        [&] {
            load_fixed<Tma, WG>(sK, k_src, sV, &v_src, k0, T, tid, kThreads, bars);
            load_tiles(0);
        },
        [&] { load_lse_d(0); });

    uint32_t pa[4][4], da[4][4];
    float dk[8][4], dv[8][4], st[1][8][4], dpt[8][4];
    zero8(dk);
    zero8(dv);
    for (int i = i0; i < n_qblocks; i++) {
        const int q0 = i * kRows, buf = (i - i0) & 1;
        loads_step<Tma>(i - i0, n_qblocks - i0, bars, tid, load_tiles, load_lse_d);
        if (q0 + kRows - 1 < wfirst) continue;  // every query before every key of this warpgroup
        const uint8_t* sQ = sQdO + buf * 2 * kTileBytes;
        const uint8_t* sdO = sQ + kTileBytes;
        const float* sL = sLD + buf * 2 * kRows;
        const float* sD = sL + kRows;

        zero8(st[0]);
        zero8(dpt);
        products<false>(st[0], SmemA{sK + wg * kTileBytes}, sQ, dpt, SmemA{sV + wg * kTileBytes}, sdO);
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
#endif
}

// ----------------------------------------------------------------------------------------------------
// Backward, dQ: block = 64 * WG queries of one (b, h), longest first; loop over the key blocks up to the
// diagonal: S = Q K^T, P = exp2(S * scale_log2 - lse2), dP = dO V^T, dS = P (dP - D), dQ += dS K.

template <int WG, int MinBlocks, bool Tma>
static __global__ void __launch_bounds__(WG * kWGThreads, MinBlocks)
    lab90_dq_kernel(floatX* dqkv, const floatX* qkv, const floatX* dout, const float* lse, const float* D,
                      const __grid_constant__ CUtensorMap qkv_map, const __grid_constant__ CUtensorMap dout_map, int T,
                      int NH, float scale_log2, float scale) {
#if FLASH90_DEVICE
    constexpr int BM = kRows * WG, kThreads = WG * kWGThreads;
    extern __shared__ uint8_t smem_raw[];
    __shared__ alignas(8) uint64_t bars[3];  // Tma: Q and dO, K/V buffer 0, K/V buffer 1
    uint8_t* sQ = align_smem(smem_raw);
    uint8_t* sdO = sQ + WG * kTileBytes;
    uint8_t* sKV = sdO + WG * kTileBytes;  // [buffer][K, V]
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int C = NH * kHS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * kHS;
    const int tid = threadIdx.x, wg = warpgroup_index<WG>(), warp = (tid / kWarpSize) % 4, lane = tid % kWarpSize;
    const int g = lane >> 2;
    const int wfirst = q0 + kRows * wg, wlast = wfirst + kRows - 1;
    const int row0 = wfirst + 16 * warp;
    float lse2[2], Dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        lse2[r] = row < T ? lse[int64_t(bh) * T + row] * kLog2e : 0.0f;
        Dr[r] = row < T ? D[int64_t(bh) * T + row] : 0.0f;
    }

    const TileSource q_src{&qkv_map, base, C3, h * kHS, b}, k_src{&qkv_map, base + C, C3, C + h * kHS, b},
        v_src{&qkv_map, base + 2 * C, C3, 2 * C + h * kHS, b},
        do_src{&dout_map, dout + int64_t(b) * T * C + h * kHS, C, h * kHS, b};
    auto load_kv = [&](int j) { load_stream_pair<Tma>(sKV, k_src, v_src, j, j * kRows, T, tid, kThreads, bars); };
    auto nothing = [](int) {};
    loads_begin<Tma>(
        bars, tid,
        [&] {
            load_fixed<Tma, WG>(sQ, q_src, sdO, &do_src, q0, T, tid, kThreads, bars);
            load_kv(0);
        },
        [] {});

    uint32_t da[4][4];
    float dq[8][4], s[1][8][4], dp[8][4];
    zero8(dq);
    const int n_blocks = ceil_div(min(T, q0 + BM), kRows);
    for (int j = 0; j < n_blocks; j++) {
        const int k0 = j * kRows, buf = j & 1;
        loads_step<Tma>(j, n_blocks, bars, tid, load_kv, nothing);
        if (k0 > wlast) continue;
        const uint8_t* sK = sKV + buf * 2 * kTileBytes;
        zero8(s[0]);
        zero8(dp);
        products<false>(s[0], SmemA{sQ + wg * kTileBytes}, sK, dp, SmemA{sdO + wg * kTileBytes}, sK + kTileBytes);
        for_each_element<1, kRows>(lane, [&](int, int nt, int e, int, int) {
            s[0][nt][e] = exp2_fast(fmaf(s[0][nt][e], scale_log2, -lse2[e >> 1]));
        });
        if (k0 + kRows - 1 > wfirst || k0 + kRows > T) {
            mask_block<1, kRows>(s, row0, k0, 0.0f, lane, [T](int r, int c) { return c <= r && c < T; });
        }
        for_each_element<1, kRows>(lane, [&](int, int nt, int e, int, int) {
            dp[nt][e] = s[0][nt][e] * (dp[nt][e] - Dr[e >> 1]);
        });
        acc_to_a(da, dp);
        product<true>(dq, da, sK);
    }
    store_rows<kHS>(dqkv + int64_t(b) * T * C3 + h * kHS, C3, dq, scale, scale, row0, T, lane);
#endif
}


// The maps a launch passes: real ones with Tma, zeros (unused) without.
template <bool Tma>
inline CUtensorMap maybe_map(const floatX* base, int64_t cols, int T, int B, const char* what) {
    if constexpr (Tma) {
        return rows_tensor_map(base, cols, T, B, what);
    } else {
        return CUtensorMap{};
    }
}

// As flash90_forward, with WG warpgroups per block and the tiles loaded by TMA or cp.async.
template <int WG, bool Tma>
void forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, cudaStream_t stream) {
    static_assert(WG == 1 || WG == 2 || WG == 3, "1 to 3 warpgroups per block");
    check_args("lab90::forward", B, T, NH);
    const CUtensorMap qkv_map = maybe_map<Tma>(qkv, 3 * int64_t(NH) * kHS, T, B, "qkv");
    allow_smem(lab90_fwd_kernel<WG, Tma>, smem90_fwd<WG>());
    const float scale_log2 = kLog2e / sqrtf(float(kHS));
    const dim3 grid(unsigned(ceil_div(T, kRows * WG)), unsigned(B * NH));
    lab90_fwd_kernel<WG, Tma><<<grid, WG * kWGThreads, smem90_fwd<WG>(), stream>>>(out, lse, qkv, qkv_map, T, NH,
                                                                                   scale_log2);
    cudaCheckLaunch();
}

// As flash90_backward, with WG (dK/dV) and WGQ (dQ) warpgroups per block, the dK/dV and dQ kernels'
// registers capped for MinKV and MinQ blocks per SM (1 leaves ptxas free), the tiles loaded by TMA or
// cp.async.
template <int WG, int WGQ, int MinKV, int MinQ, bool Tma>
void backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse, int B, int T,
              int NH, float* D, cudaStream_t stream) {
    static_assert(WG >= 1 && WG <= 3 && WGQ >= 1 && WGQ <= 3, "1 to 3 warpgroups per block");
    check_args("lab90::backward", B, T, NH);
    flash_backward_dot<kHS>(D, out, dout, B, T, NH, stream);
    const CUtensorMap qkv_map = maybe_map<Tma>(qkv, 3 * int64_t(NH) * kHS, T, B, "qkv");
    const CUtensorMap dout_map = maybe_map<Tma>(dout, int64_t(NH) * kHS, T, B, "dout");
    allow_smem(lab90_dkdv_kernel<WG, MinKV, Tma>, smem90_dkdv<WG>());
    allow_smem(lab90_dq_kernel<WGQ, MinQ, Tma>, smem90_dq<WGQ>());
    const float scale = 1.0f / sqrtf(float(kHS)), scale_log2 = scale * kLog2e;
    const dim3 grid_kv(unsigned(ceil_div(T, kRows * WG)), unsigned(B * NH));
    lab90_dkdv_kernel<WG, MinKV, Tma><<<grid_kv, WG * kWGThreads, smem90_dkdv<WG>(), stream>>>(
        dqkv, qkv, dout, lse, D, qkv_map, dout_map, T, NH, scale_log2, scale);
    cudaCheckLaunch();
    const dim3 grid_q(unsigned(ceil_div(T, kRows * WGQ)), unsigned(B * NH));
    lab90_dq_kernel<WGQ, MinQ, Tma><<<grid_q, WGQ * kWGThreads, smem90_dq<WGQ>(), stream>>>(
        dqkv, qkv, dout, lse, D, qkv_map, dout_map, T, NH, scale_log2, scale);
    cudaCheckLaunch();
}

// A warpgroup's 64 x 64 fp32 accumulator (m64n64 D layout) into d, row-major.
__device__ inline void store_acc64(float* d, const float (&acc)[8][4], int warp, int lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 8; i++) {
        for (int e = 0; e < 4; e++) d[(16 * warp + g + 8 * (e >> 1)) * 64 + 8 * i + 2 * q + (e & 1)] = acc[i][e];
    }
}

}  // namespace lab90

namespace {

// ----------------------------------------------------------------------------------------------------
// fp32 reference: one warp per (b, h, row), lane j holding elements j, j+32, .. of HS (HS a multiple of 32,
// at most 128), straight from the definition: lse and out per query (online softmax in fp32), D = dout .
// out_ref, then dq per query and dk, dv per key, each from the reference lse and D.

constexpr int kRefPer = 4;  // elements per lane at HS = 128

__global__ void ref_forward_kernel(float* out, float* lse, const floatX* qkv, int B, int T, int NH, int HS) {
    const int64_t idx = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    const int lane = threadIdx.x % kWarpSize, per = HS / kWarpSize;
    if (idx >= int64_t(B) * NH * T) return;  // the whole warp: idx is the same for its lanes
    const int t = int(idx % T), bh = int(idx / T), b = bh / NH, h = bh % NH;
    const int C = NH * HS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* qp = qkv + (int64_t(b) * T + t) * C3 + h * HS;
    const float scale = 1.0f / sqrtf(float(HS));
    float qv[kRefPer], o[kRefPer];
#pragma unroll
    for (int j = 0; j < kRefPer; j++) {
        qv[j] = j < per ? float(qp[lane + kWarpSize * j]) : 0.0f;
        o[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int k = 0; k <= t; k++) {
        const floatX* kp = qkv + (int64_t(b) * T + k) * C3 + C + h * HS;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < kRefPer; j++) s += j < per ? qv[j] * float(kp[lane + kWarpSize * j]) : 0.0f;
        s = warp_sum(s) * scale;
        const float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int j = 0; j < kRefPer; j++) {
            o[j] = o[j] * corr + (j < per ? p * float(kp[C + lane + kWarpSize * j]) : 0.0f);
        }
        m = mn;
    }
    float* op = out + (int64_t(b) * T + t) * C + h * HS;
#pragma unroll
    for (int j = 0; j < kRefPer; j++) {
        if (j < per) op[lane + kWarpSize * j] = o[j] / l;
    }
    if (lane == 0) lse[idx] = m + logf(l);
}

__global__ void ref_dot_kernel(float* D, const float* out, const floatX* dout, int B, int T, int NH, int HS) {
    const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= int64_t(B) * NH * T) return;
    const int t = int(idx % T), bh = int(idx / T), b = bh / NH, h = bh % NH;
    const int64_t off = (int64_t(b) * T + t) * NH * HS + h * HS;
    float acc = 0.0f;
    for (int d = 0; d < HS; d++) acc += out[off + d] * float(dout[off + d]);
    D[idx] = acc;
}

// Warp (b, h, t) writes dq of query t if rows_are_queries, else dk and dv of key t.
__global__ void ref_backward_kernel(float* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                    const float* D, int B, int T, int NH, int HS, bool rows_are_queries) {
    const int64_t idx = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    const int lane = threadIdx.x % kWarpSize, per = HS / kWarpSize;
    if (idx >= int64_t(B) * NH * T) return;
    const int t = int(idx % T), bh = int(idx / T), b = bh / NH, h = bh % NH;
    const int C = NH * HS;
    const int64_t C3 = 3 * int64_t(C);
    const float scale = 1.0f / sqrtf(float(HS));
    auto qkv_at = [&](int row, int part, int j) {
        return j < per ? float(qkv[(int64_t(b) * T + row) * C3 + part * C + h * HS + lane + kWarpSize * j]) : 0.0f;
    };
    auto dout_at = [&](int row, int j) {
        return j < per ? float(dout[(int64_t(b) * T + row) * C + h * HS + lane + kWarpSize * j]) : 0.0f;
    };
    float* g0 = dqkv + (int64_t(b) * T + t) * C3 + h * HS;
    float x[kRefPer], y[kRefPer], acc0[kRefPer], acc1[kRefPer];
    // Own row: q and dout for a query, k and v for a key.
#pragma unroll
    for (int j = 0; j < kRefPer; j++) {
        x[j] = rows_are_queries ? qkv_at(t, 0, j) : qkv_at(t, 1, j);
        y[j] = rows_are_queries ? dout_at(t, j) : qkv_at(t, 2, j);
        acc0[j] = acc1[j] = 0.0f;
    }
    const int lo = rows_are_queries ? 0 : t, hi = rows_are_queries ? t : T - 1;
    for (int i = lo; i <= hi; i++) {
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int j = 0; j < kRefPer; j++) {
            s += x[j] * (rows_are_queries ? qkv_at(i, 1, j) : qkv_at(i, 0, j));
            dp += y[j] * (rows_are_queries ? qkv_at(i, 2, j) : dout_at(i, j));
        }
        s = warp_sum(s);
        dp = warp_sum(dp);
        const int qi = rows_are_queries ? t : i;
        const float p = expf(s * scale - lse[int64_t(bh) * T + qi]);
        const float ds = p * (dp - D[int64_t(bh) * T + qi]) * scale;
#pragma unroll
        for (int j = 0; j < kRefPer; j++) {
            if (rows_are_queries) {
                acc0[j] += ds * qkv_at(i, 1, j);
            } else {
                acc0[j] += ds * qkv_at(i, 0, j);
                acc1[j] += p * dout_at(i, j);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kRefPer; j++) {
        if (j >= per) continue;
        if (rows_are_queries) {
            g0[lane + kWarpSize * j] = acc0[j];
        } else {
            g0[C + lane + kWarpSize * j] = acc0[j];
            g0[2 * C + lane + kWarpSize * j] = acc1[j];
        }
    }
}

__global__ void fill_uniform_kernel(floatX* p, size_t n, uint64_t key, float amp) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        const float u = float(rng_u32(key, i) >> 8) * (1.0f / 16777216.0f);
        p[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * amp);
    }
}


// The wgmma building blocks of llmc/flash_attention_sm90.cuh on one warpgroup: A, B (64 x 64 bf16, row-major
// in global memory) through swizzled tiles; d_nt = A B^T (B read K-major), d_nn = A B (B read MN-major).
// Checked on the host against a double-precision product, so a wrong descriptor shows by itself.
__global__ void wgmma_selftest_kernel(float* d_nt, float* d_nn, const floatX* a, const floatX* b) {
#if FLASH90_DEVICE
    using namespace lab90;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* sA = align_smem(smem_raw);
    uint8_t* sB = sA + kTileBytes;
    const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
    load_tile_sw(sA, a, 64, 0, 64, tid, kWGThreads);
    load_tile_sw(sB, b, 64, 0, 64, tid, kWGThreads);
    flash_detail::cp_async_commit();
    flash_detail::cp_async_wait<0>();
    fence_async_proxy();
    __syncthreads();
    uint32_t af[4][4];
    load_a_frags(af, sA, warp, lane);
    float nt[8][4], nn[8][4];
    zero8(nt);
    zero8(nn);
    product<false>(nt, af, sB);
    product<true>(nn, af, sB);
    store_acc64(d_nt, nt, warp, lane);
    store_acc64(d_nn, nn, warp, lane);
#endif
}

// The same over nblk blocks of B (nblk * 64 rows), accumulated: d_nt = sum_j A B_j^T, d_nn = sum_j A B_j.
// mode 0: B blocks double-buffered, block j + 1 loading while block j computes (as the flash90 kernels);
// 1: one buffer, each block loaded and waited for before it computes; 2: all blocks loaded up front; 3: as 2
// with A's fragments loaded again for every block.
__global__ void wgmma_pipe_selftest_kernel(float* d_nt, float* d_nn, const floatX* a, const floatX* b, int nblk,
                                           int mode) {
#if FLASH90_DEVICE
    using namespace lab90;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* sA = align_smem(smem_raw);
    uint8_t* sB = sA + kTileBytes;  // mode 0: 2 buffers; 1: 1; 2: nblk
    const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int T = nblk * 64;
    load_tile_sw(sA, a, 64, 0, 64, tid, kWGThreads);
    if (mode == 0) load_tile_sw(sB, b, 64, 0, T, tid, kWGThreads);
    if (mode >= 2) {
        for (int j = 0; j < nblk; j++) load_tile_sw(sB + j * kTileBytes, b, 64, j * 64, T, tid, kWGThreads);
    }
    flash_detail::cp_async_commit();
    uint32_t af[4][4];
    float nt[8][4], nn[8][4];
    zero8(nt);
    zero8(nn);
    for (int j = 0; j < nblk; j++) {
        const uint8_t* tile = sB;
        if (mode == 0) {  // the kernels' loop step
            tile = sB + (j & 1) * kTileBytes;
            pipeline_step(j, nblk, [&](int next) {
                load_tile_sw(sB + (next & 1) * kTileBytes, b, 64, next * 64, T, tid, kWGThreads);
            });
        } else {
            __syncthreads();
            if (mode == 1) {
                load_tile_sw(sB, b, 64, j * 64, T, tid, kWGThreads);
                flash_detail::cp_async_commit();
            } else {
                tile = sB + j * kTileBytes;
            }
            flash_detail::cp_async_wait<0>();
            fence_async_proxy();
            __syncthreads();
        }
        if (j == 0 || mode == 3) load_a_frags(af, sA, warp, lane);
        product<false>(nt, af, tile);
        product<true>(nn, af, tile);
    }
    store_acc64(d_nt, nt, warp, lane);
    store_acc64(d_nn, nn, warp, lane);
#endif
}

// ----------------------------------------------------------------------------------------------------
// Host side.

struct Shape {
    int B, T, NH, HS;
    std::string str() const {
        return "B" + std::to_string(B) + " T" + std::to_string(T) + " NH" + std::to_string(NH) + " HS" +
               std::to_string(HS);
    }
};

struct Row {
    std::string shape, impl;
    double fwd_ms = -1, bwd_ms = -1;
    size_t saved = 0;
    double err = -1;
    std::string det;
};

template <class T>
std::vector<T> to_host(const T* d, size_t n) {
    std::vector<T> h(n);
    cudaCheck(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

void poison(void* p, size_t bytes) { cudaCheck(cudaMemset(p, 0xff, bytes)); }  // all-ones: NaN in bf16 and fp32

// ||x - ref|| / ||ref|| over the elements (b, t, part*C + c), c < C, of (B,T,width) tensors; the
// denominator is at least 1e-3 * sqrt(n), so a (near-)zero reference (dq at T = 1) is compared by RMS.
// Counts NaNs of x.
template <class X, class R>
double rel_err(const std::vector<X>& x, const std::vector<R>& ref, int64_t rows, int width, int part, int C,
               size_t* nans) {
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; r++) {
        for (int c = 0; c < C; c++) {
            const size_t i = size_t(r) * width + size_t(part) * C + c;
            const double xv = double(float(x[i])), rv = double(float(ref[i]));
            if (std::isnan(xv)) (*nans)++;
            num += (xv - rv) * (xv - rv);
            den += rv * rv;
        }
    }
    const double floor = 1e-3 * std::sqrt(double(rows) * C);
    return std::sqrt(num) / std::max(std::sqrt(den), floor);
}

template <class Fn>
double time_ms(Fn&& fn, cudaStream_t stream) {
    return llmc::median_ms(stream, 5, 25, fn);
}

// Runs wgmma_selftest_kernel; returns the number of failed checks (0 where wgmma is not available).
int wgmma_selftest() {
    if (!flash90_available()) {
        std::printf("wgmma selftest: skipped (not an sm_90a build on a compute 9.0 GPU)\n");
        return 0;
    }
    std::vector<floatX> ha(64 * 64), hb(64 * 64);
    for (int i = 0; i < 64 * 64; i++) {
        ha[i] = __float2bfloat16_rn(float((i * 37 + 11) % 17 - 8) / 8.0f);
        hb[i] = __float2bfloat16_rn(float((i * 53 + 5) % 13 - 6) / 4.0f);
    }
    DeviceBuffer<floatX> a(64 * 64), b(64 * 64);
    DeviceBuffer<float> nt(64 * 64), nn(64 * 64);
    cudaCheck(cudaMemcpy(a.get(), ha.data(), a.bytes(), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(b.get(), hb.data(), b.bytes(), cudaMemcpyHostToDevice));
    const size_t smem = 2 * flash90_detail::kTileBytes + flash90_detail::kAlign;
    wgmma_selftest_kernel<<<1, flash90_detail::kWGThreads, smem>>>(nt.get(), nn.get(), a.get(), b.get());
    cudaCheckLaunch();
    cudaCheck(cudaDeviceSynchronize());
    const auto hnt = to_host(nt.get(), 64 * 64), hnn = to_host(nn.get(), 64 * 64);
    double e_nt = 0, e_nn = 0;
    for (int r = 0; r < 64; r++) {
        for (int c = 0; c < 64; c++) {
            double snt = 0, snn = 0;
            for (int k = 0; k < 64; k++) {
                snt += double(float(ha[r * 64 + k])) * double(float(hb[c * 64 + k]));
                snn += double(float(ha[r * 64 + k])) * double(float(hb[k * 64 + c]));
            }
            e_nt = std::max(e_nt, std::fabs(snt - hnt[r * 64 + c]));
            e_nn = std::max(e_nn, std::fabs(snn - hnn[r * 64 + c]));
        }
    }
    // Products of these bf16 values are exact in fp32 sums of 64 terms, up to rounding of partial sums.
    const bool ok_nt = e_nt < 1e-3, ok_nn = e_nn < 1e-3;
    std::printf("wgmma selftest: A B^T (K-major B) max abs err %.3g %s; A B (MN-major B) max abs err %.3g %s\n",
                e_nt, ok_nt ? "ok" : "FAIL", e_nn, ok_nn ? "ok" : "FAIL");
    int failed = (ok_nt ? 0 : 1) + (ok_nn ? 0 : 1);

    // Accumulated over 4 blocks of B, three ways of loading them.
    const int nblk = 4;
    std::vector<floatX> hb4(nblk * 64 * 64);
    for (int i = 0; i < int(hb4.size()); i++) hb4[i] = __float2bfloat16_rn(float((i * 29 + 3) % 11 - 5) / 4.0f);
    DeviceBuffer<floatX> b4(hb4.size());
    cudaCheck(cudaMemcpy(b4.get(), hb4.data(), b4.bytes(), cudaMemcpyHostToDevice));
    const char* modes[4] = {"double-buffered", "one buffer", "all loaded", "all loaded, A reloaded"};
    for (int mode = 0; mode < 4; mode++) {
        const size_t sm = size_t(1 + (mode >= 2 ? nblk : 2)) * flash90_detail::kTileBytes + flash90_detail::kAlign;
        cudaCheck(cudaFuncSetAttribute(wgmma_pipe_selftest_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(sm)));
        wgmma_pipe_selftest_kernel<<<1, flash90_detail::kWGThreads, sm>>>(nt.get(), nn.get(), a.get(), b4.get(), nblk,
                                                                          mode);
        cudaCheckLaunch();
        cudaCheck(cudaDeviceSynchronize());
        const auto pnt = to_host(nt.get(), 64 * 64), pnn = to_host(nn.get(), 64 * 64);
        double ent = 0, enn = 0;
        for (int r = 0; r < 64; r++) {
            for (int c = 0; c < 64; c++) {
                double snt = 0, snn = 0;
                for (int j = 0; j < nblk; j++) {
                    for (int k = 0; k < 64; k++) {
                        const double av = double(float(ha[r * 64 + k]));
                        snt += av * double(float(hb4[(j * 64 + c) * 64 + k]));
                        snn += av * double(float(hb4[(j * 64 + k) * 64 + c]));
                    }
                }
                // d_nn sums A B_j over j, each B_j read as a 64 x 64 block of its own
                ent = std::max(ent, std::fabs(snt - pnt[r * 64 + c]));
                enn = std::max(enn, std::fabs(snn - pnn[r * 64 + c]));
            }
        }
        const bool ok = ent < 1e-2 && enn < 1e-2;
        std::printf("wgmma selftest, %d blocks %s: A B^T err %.3g, A B err %.3g %s\n", nblk, modes[mode], ent, enn,
                    ok ? "ok" : "FAIL");
        failed += ok ? 0 : 1;
    }
    return failed;
}

constexpr double kTolOut = 1e-2, kTolGrad = 2e-2, kTolVsCublaslt = 3e-2;

// One shape: both implementations, checked (against the fp32 reference when with_ref, else flash against
// the cuBLASLt path) and, when timed, timed. Returns the number of failed checks.
int run_case(const CublasLt& lt, const Shape& s, bool with_ref, bool timed, std::vector<Row>& rows) {
    const int B = s.B, T = s.T, NH = s.NH, HS = s.HS, C = NH * HS;
    const size_t n_qkv = size_t(B) * T * 3 * C, n_out = size_t(B) * T * C, n_lse = size_t(B) * NH * T;
    const cudaStream_t stream = 0;
    DeviceBuffer<floatX> qkv(n_qkv), dout(n_out), out(n_out), dqkv(n_qkv), dqkv2(n_qkv), out2(n_out);
    DeviceBuffer<float> lse(n_lse), D(n_lse);
    const uint64_t seed = uint64_t(B) * 1000003u + uint64_t(T) * 131u + uint64_t(NH) * 7u + uint64_t(HS);
    fill_uniform_kernel<<<1024, 256>>>(qkv.get(), n_qkv, rng_key(seed, 1), 2.0f);
    fill_uniform_kernel<<<1024, 256>>>(dout.get(), n_out, rng_key(seed, 2), 1.0f);
    cudaCheckLaunch();

    // "flash": the mma.sync kernels with the plainest tiling (no double buffering, one 16-row tile per
    // warp), which every other variant must match bit for bit.
    auto fwd = [&](floatX* o) {
        if (HS == 64) flash_forward<64, false, 1>(o, lse.get(), qkv.get(), B, T, NH, stream);
        else flash_forward<128, false, 1>(o, lse.get(), qkv.get(), B, T, NH, stream);
    };
    auto bwd = [&](floatX* g) {
        if (HS == 64) {
            flash_backward<64, false, 1, 1, false>(g, dout.get(), qkv.get(), out.get(), lse.get(), B, T, NH, D.get(),
                                                   stream);
        } else {
            flash_backward<128, false, 1, 1, false>(g, dout.get(), qkv.get(), out.get(), lse.get(), B, T, NH, D.get(),
                                                    stream);
        }
    };
    // The other tilings (Pipe: double-buffered tiles; MT: two row tiles per warp, HS 64 only; the template
    // arguments are <HS, Pipe, MT> forward and <HS, Pipe, MT, MTQ, PipeQ> backward): the same arithmetic per
    // row, so the same bits are required. "flash_tiling" is what the trainer runs (llmc/flash_attention.cuh)
    // where the wgmma kernels do not.
    struct Variant {
        const char* name;
        std::function<void(floatX*)> fwd, bwd;
    };
    std::vector<Variant> variants;
    auto add = [&](const char* name, auto f, auto b) {
        variants.push_back({name, [&, f](floatX* o) { f(o, lse.get(), qkv.get(), B, T, NH, stream); },
                            [&, b](floatX* g) { b(g, dout.get(), qkv.get(), out.get(), lse.get(), B, T, NH, D.get(), stream, nullptr); }});
    };
    if (HS == 64) {
        add("flash pipelined", flash_forward<64, true, 1>, flash_backward<64, true, 1, 1, true>);
        add("flash 2 tiles", flash_forward<64, false, 2>, flash_backward<64, false, 2, 2, false>);
        add("pipelined 2 tiles", flash_forward<64, true, 2>, flash_backward<64, true, 2, 2, true>);
        add("pipe 2t, dkdv 1t", flash_forward<64, true, 2>, flash_backward<64, true, 1, 2, true>);
        add("flash_tiling (trainer's)", flash_forward<64>, flash_backward<64>);
    } else {
        add("flash pipelined", flash_forward<128, true, 1>, flash_backward<128, true, 1, 1, true>);
        add("flash_tiling (trainer's)", flash_forward<128>, flash_backward<128>);
    }
    int failures = 0;
    auto check = [&](bool ok, const char* what, double v) {
        if (!ok) {
            std::fprintf(stderr, "FAIL %s: %s (%g)\n", s.str().c_str(), what, v);
            failures++;
        }
    };

    poison(out.get(), out.bytes());
    poison(lse.get(), lse.bytes());
    fwd(out.get());
    poison(out2.get(), out2.bytes());
    fwd(out2.get());  // same lse again
    poison(dqkv.get(), dqkv.bytes());
    poison(D.get(), D.bytes());
    bwd(dqkv.get());
    poison(dqkv2.get(), dqkv2.bytes());
    poison(D.get(), D.bytes());
    bwd(dqkv2.get());
    cudaCheck(cudaDeviceSynchronize());
    const auto h_out = to_host(out.get(), n_out), h_out2 = to_host(out2.get(), n_out);
    const auto h_dqkv = to_host(dqkv.get(), n_qkv), h_dqkv2 = to_host(dqkv2.get(), n_qkv);
    const auto h_lse = to_host(lse.get(), n_lse);
    const bool det = std::memcmp(h_out.data(), h_out2.data(), n_out * sizeof(floatX)) == 0 &&
                     std::memcmp(h_dqkv.data(), h_dqkv2.data(), n_qkv * sizeof(floatX)) == 0;
    check(det, "flash forward/backward twice not bitwise equal", 0);
    std::vector<bool> same(variants.size());
    for (size_t v = 0; v < variants.size(); v++) {
        poison(out2.get(), out2.bytes());
        poison(lse.get(), lse.bytes());
        variants[v].fwd(out2.get());
        poison(dqkv2.get(), dqkv2.bytes());
        poison(D.get(), D.bytes());
        variants[v].bwd(dqkv2.get());
        cudaCheck(cudaDeviceSynchronize());
        same[v] = std::memcmp(to_host(out2.get(), n_out).data(), h_out.data(), n_out * sizeof(floatX)) == 0 &&
                  std::memcmp(to_host(dqkv2.get(), n_qkv).data(), h_dqkv.data(), n_qkv * sizeof(floatX)) == 0 &&
                  std::memcmp(to_host(lse.get(), n_lse).data(), h_lse.data(), n_lse * sizeof(float)) == 0;
        if (!same[v]) {
            std::fprintf(stderr, "FAIL %s: %s differs from flash (out, lse or dqkv not bitwise equal)\n",
                         s.str().c_str(), variants[v].name);
            failures++;
        }
    }

    // The wgmma kernels (HS 64 on an sm_90a build; llmc/flash_attention_sm90.cuh): checked for determinism,
    // against the reference (or flash) below, and bitwise against flash: wgmma sums the same 16-wide k-steps
    // in the same order as mma.sync, and the first H200 run found every output bit equal, which this keeps.
    // Each runs its own forward into out2 and lse and its backward from them.
    struct Other {
        const char* name;
        std::function<void(floatX*)> fwd;
        std::function<void(floatX*, const floatX*)> bwd;  // (dqkv, its forward's out)
        std::vector<floatX> out, dqkv;
        bool det = false;
    };
    std::vector<Other> others;
    if (HS == 64 && flash90_available()) {
        auto addo = [&](const char* name, auto f, auto b) {
            others.push_back({name, [&, f](floatX* o) { f(o, lse.get(), qkv.get(), B, T, NH, stream); },
                              [&, b](floatX* g, const floatX* o) {
                                  b(g, dout.get(), qkv.get(), o, lse.get(), B, T, NH, D.get(), stream);
                              },
                              {}, {}, false});
        };
        addo("wgmma (trainer's)", flash90_forward, [](auto... a) { flash90_backward(a...); });
        addo("wgmma WG1, cp.async", lab90::forward<1, false>, lab90::backward<1, 1, 1, 1, false>);
        addo("wgmma WG2, cp.async", lab90::forward<2, false>, lab90::backward<2, 2, 1, 1, false>);
        addo("wgmma kv3 q4, cp.async", lab90::forward<1, false>, lab90::backward<1, 1, 3, 4, false>);
        addo("wgmma kv3 q4, TMA", lab90::forward<1, true>, lab90::backward<1, 1, 3, 4, true>);
        addo("wgmma WG1, TMA", lab90::forward<1, true>, lab90::backward<1, 1, 1, 1, true>);
        addo("wgmma WG2, TMA", lab90::forward<2, true>, lab90::backward<2, 2, 1, 1, true>);
    }
    for (Other& v : others) {
        poison(out2.get(), out2.bytes());
        poison(lse.get(), lse.bytes());
        v.fwd(out2.get());
        poison(dqkv2.get(), dqkv2.bytes());
        poison(D.get(), D.bytes());
        v.bwd(dqkv2.get(), out2.get());
        cudaCheck(cudaDeviceSynchronize());
        v.out = to_host(out2.get(), n_out);
        v.dqkv = to_host(dqkv2.get(), n_qkv);
        const auto v_lse = to_host(lse.get(), n_lse);
        poison(out2.get(), out2.bytes());
        v.fwd(out2.get());
        poison(dqkv2.get(), dqkv2.bytes());
        v.bwd(dqkv2.get(), out2.get());
        cudaCheck(cudaDeviceSynchronize());
        v.det = std::memcmp(to_host(out2.get(), n_out).data(), v.out.data(), n_out * sizeof(floatX)) == 0 &&
                std::memcmp(to_host(dqkv2.get(), n_qkv).data(), v.dqkv.data(), n_qkv * sizeof(floatX)) == 0;
        check(v.det, (std::string(v.name) + ": forward/backward twice not bitwise equal").c_str(), 0);
        size_t nans = 0;
        for (float x : v_lse) nans += std::isnan(x) ? 1 : 0;
        check(nans == 0, (std::string(v.name) + ": NaN in lse").c_str(), double(nans));
        const bool same_bits = std::memcmp(v.out.data(), h_out.data(), n_out * sizeof(floatX)) == 0 &&
                               std::memcmp(v.dqkv.data(), h_dqkv.data(), n_qkv * sizeof(floatX)) == 0 &&
                               std::memcmp(v_lse.data(), h_lse.data(), n_lse * sizeof(float)) == 0;
        check(same_bits, (std::string(v.name) + ": out, lse or dqkv not bitwise equal to flash").c_str(), 0);
    }

    // The cuBLASLt path (llmc/attention.cuh runs it for head sizes other than 64 and 128).
    const size_t att_bytes = attention_cublaslt_saved_bytes(B, NH, T);
    const size_t scratch_bytes = attention_cublaslt_scratch_bytes(B, NH, T, HS);
    DeviceBuffer<floatX> att(att_bytes / sizeof(floatX)), l_out(n_out), l_dqkv(n_qkv);
    DeviceBuffer<char> scratch(scratch_bytes);
    auto lfwd = [&] {
        attention_forward_cublaslt(lt, l_out.get(), att.get(), qkv.get(), B, T, C, NH, scratch.get(), scratch_bytes,
                                   stream);
    };
    auto lbwd = [&] {
        attention_backward_cublaslt(lt, l_dqkv.get(), dout.get(), qkv.get(), att.get(), B, T, C, NH, scratch.get(),
                                    scratch_bytes, stream);
    };
    poison(l_out.get(), l_out.bytes());
    poison(l_dqkv.get(), l_dqkv.bytes());
    lfwd();
    lbwd();
    cudaCheck(cudaDeviceSynchronize());
    const auto hl_out = to_host(l_out.get(), n_out), hl_dqkv = to_host(l_dqkv.get(), n_qkv);

    const int64_t nrows = int64_t(B) * T;
    size_t nan_flash = 0, nan_cublaslt = 0;
    for (float v : h_lse) nan_flash += std::isnan(v) ? 1 : 0;
    double err_flash = 0, err_cublaslt = 0;
    std::vector<float> ref_out, ref_dqkv;  // the fp32 reference where it ran
    if (with_ref) {
        DeviceBuffer<float> r_out(n_out), r_lse(n_lse), r_D(n_lse), r_dqkv(n_qkv);
        const unsigned blocks = unsigned(ceil_div<int64_t>(int64_t(n_lse), 128));  // a thread per row
        const unsigned warp_blocks = unsigned(ceil_div<int64_t>(int64_t(n_lse), 128 / kWarpSize));  // a warp per row
        ref_forward_kernel<<<warp_blocks, 128>>>(r_out.get(), r_lse.get(), qkv.get(), B, T, NH, HS);
        ref_dot_kernel<<<blocks, 128>>>(r_D.get(), r_out.get(), dout.get(), B, T, NH, HS);
        for (bool queries : {true, false}) {
            ref_backward_kernel<<<warp_blocks, 128>>>(r_dqkv.get(), dout.get(), qkv.get(), r_lse.get(), r_D.get(), B,
                                                      T, NH, HS, queries);
        }
        cudaCheckLaunch();
        cudaCheck(cudaDeviceSynchronize());
        ref_out = to_host(r_out.get(), n_out);
        ref_dqkv = to_host(r_dqkv.get(), n_qkv);
        const auto& hr_out = ref_out;
        const auto& hr_dqkv = ref_dqkv;
        const auto hr_lse = to_host(r_lse.get(), n_lse);
        double lse_err = 0;
        for (size_t i = 0; i < n_lse; i++) lse_err = std::max(lse_err, double(std::fabs(h_lse[i] - hr_lse[i])));
        check(lse_err < 2e-2, "lse max abs error", lse_err);
        const double eo = rel_err(h_out, hr_out, nrows, C, 0, C, &nan_flash);
        check(eo < kTolOut, "out rel err", eo);
        err_flash = eo;
        err_cublaslt = rel_err(hl_out, hr_out, nrows, C, 0, C, &nan_cublaslt);
        const char* names[3] = {"dq rel err", "dk rel err", "dv rel err"};
        for (int part = 0; part < 3; part++) {
            const double e = rel_err(h_dqkv, hr_dqkv, nrows, 3 * C, part, C, &nan_flash);
            check(e < kTolGrad, names[part], e);
            err_flash = std::max(err_flash, e);
            err_cublaslt = std::max(err_cublaslt, rel_err(hl_dqkv, hr_dqkv, nrows, 3 * C, part, C, &nan_cublaslt));
        }
    } else {
        err_flash = rel_err(h_out, hl_out, nrows, C, 0, C, &nan_flash);
        for (int part = 0; part < 3; part++) {
            err_flash = std::max(err_flash, rel_err(h_dqkv, hl_dqkv, nrows, 3 * C, part, C, &nan_flash));
        }
        check(err_flash < kTolVsCublaslt, "flash vs cuBLASLt path rel err", err_flash);
    }
    check(nan_flash == 0, "NaN (unwritten or invalid) elements in flash out/dqkv/lse", double(nan_flash));
    std::vector<double> other_err(others.size(), 0.0);
    for (size_t v = 0; v < others.size(); v++) {
        size_t nans = 0;
        const std::string name = others[v].name;
        // Against the reference where it ran, else against flash (both bf16 kernels: the cuBLASLt bound).
        const double tol_out = with_ref ? kTolOut : kTolVsCublaslt, tol_grad = with_ref ? kTolGrad : kTolVsCublaslt;
        double e = with_ref ? rel_err(others[v].out, ref_out, nrows, C, 0, C, &nans)
                            : rel_err(others[v].out, h_out, nrows, C, 0, C, &nans);
        check(e < tol_out, (name + ": out rel err").c_str(), e);
        other_err[v] = e;
        const char* parts[3] = {": dq rel err", ": dk rel err", ": dv rel err"};
        for (int part = 0; part < 3; part++) {
            e = with_ref ? rel_err(others[v].dqkv, ref_dqkv, nrows, 3 * C, part, C, &nans)
                         : rel_err(others[v].dqkv, h_dqkv, nrows, 3 * C, part, C, &nans);
            check(e < tol_grad, (name + parts[part]).c_str(), e);
            other_err[v] = std::max(other_err[v], e);
        }
        check(nans == 0, (name + ": NaN (unwritten or invalid) elements in out/dqkv").c_str(), double(nans));
    }


    Row fr{s.str(), "flash", -1, -1, flash_lse_bytes(B, NH, T) + flash_scratch_bytes(B, NH, T), err_flash,
           det ? "yes" : "NO"};
    Row lr{s.str(), "cuBLASLt path", -1, -1, att_bytes + scratch_bytes, with_ref ? err_cublaslt : -1,
           "-"};
    std::vector<Row> vrows;
    for (size_t v = 0; v < variants.size(); v++) {
        vrows.push_back(Row{s.str(), variants[v].name, -1, -1, fr.saved, -1, same[v] ? "= flash" : "DIFFERS"});
    }
    for (size_t v = 0; v < others.size(); v++) {
        vrows.push_back(Row{s.str(), others[v].name, -1, -1, fr.saved, other_err[v], others[v].det ? "yes" : "NO"});
    }
    if (timed) {
        for (size_t v = 0; v < others.size(); v++) {
            Row& r = vrows[variants.size() + v];
            r.fwd_ms = time_ms([&] { others[v].fwd(out2.get()); }, stream);
            r.bwd_ms = time_ms([&] { others[v].bwd(dqkv2.get(), out2.get()); }, stream);
        }
        fr.fwd_ms = time_ms([&] { fwd(out.get()); }, stream);
        fr.bwd_ms = time_ms([&] { bwd(dqkv.get()); }, stream);
        for (size_t v = 0; v < variants.size(); v++) {
            vrows[v].fwd_ms = time_ms([&] { variants[v].fwd(out2.get()); }, stream);
            vrows[v].bwd_ms = time_ms([&] { variants[v].bwd(dqkv2.get()); }, stream);
        }
        lr.fwd_ms = time_ms(lfwd, stream);
        lr.bwd_ms = time_ms(lbwd, stream);
    }
    rows.push_back(fr);
    for (const Row& r : vrows) rows.push_back(r);
    rows.push_back(lr);
    return failures;
}

}  // namespace

int main() {
    return run_main([] {
        if (cuda_device_count() == 0) fail(kExitCuda, "attention_lab needs a GPU");
        CublasLt lt;
        std::vector<Row> rows;
        int failures = wgmma_selftest();
        const Shape checked[] = {{1, 1, 12, 64},   {2, 37, 12, 64},  {1, 64, 12, 64},  {3, 65, 4, 64},
                                 {2, 1000, 12, 64}, {1, 1024, 12, 64}, {16, 1024, 12, 64}, {1, 1, 6, 128},
                                 {2, 37, 6, 128},   {2, 1000, 6, 128}, {1, 1024, 6, 128}};
        for (const Shape& s : checked) failures += run_case(lt, s, true, false, rows);
        const Shape timed[] = {{16, 1024, 12, 64}, {64, 1024, 12, 64}};
        for (const Shape& s : timed) failures += run_case(lt, s, false, true, rows);

        std::printf("\n%-24s | %-24s | %8s | %8s | %12s | %11s | %s\n", "shape", "impl", "fwd ms", "bwd ms",
                    "saved bytes", "max rel err", "deterministic");
        for (const Row& r : rows) {
            char f[32] = "-", b[32] = "-", e[32] = "-";
            if (r.fwd_ms >= 0) std::snprintf(f, sizeof(f), "%.3f", r.fwd_ms);
            if (r.bwd_ms >= 0) std::snprintf(b, sizeof(b), "%.3f", r.bwd_ms);
            if (r.err >= 0) std::snprintf(e, sizeof(e), "%.2e", r.err);
            std::printf("%-24s | %-24s | %8s | %8s | %12zu | %11s | %s\n", r.shape.c_str(), r.impl.c_str(), f, b,
                        r.saved, e, r.det.c_str());
        }
        std::printf("max rel err: against the fp32 reference (rows with '-' times), else flash against the cuBLASLt "
                    "path.\n");
        std::printf("saved bytes: flash = lse + D scratch; cuBLASLt = att + scratch (both also keep qkv and out).\n");
        std::printf("%s: %d failed check(s)\n", failures == 0 ? "PASS" : "FAIL", failures);
        return failures == 0 ? 0 : 1;
    });
}
