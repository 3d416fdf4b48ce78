/*
Flash attention for the causal multi-head self-attention, head sizes 64 and 128: tensor-core kernels that
never store the (T x T) scores. Arguments as attention_forward/attention_backward of llmc/attention.cuh,
which dispatches here: qkv (B,T,3C) holds q, k, v with head h at columns h*HS of each; out (B,T,C).
  flash_forward<HS>:  out and lse (B,NH,T) fp32, lse[b,h,t] = ln sum_{k<=t} exp(scale * q_t.k_k); online
                      softmax in the log2 domain (llmc/flash_common.cuh), query blocks longest first.
  flash_backward<HS>: dqkv (B,T,3C), OVERWRITTEN; three kernels: D = rowsum(dout * out), dK/dV per key
                      block, dQ per query block (its own pass: no atomics).
  flash_tiling<HS>(): the tiling the launchers run by default; every tiling gives the same bits.
  flash_lse_bytes, flash_scratch_bytes: the sizes of lse and of D.
mma.sync m16n8k16 (bf16 operands, fp32 accumulation), ldmatrix from padded shared tiles, cp.async loads
(rows past T zero-filled). Deterministic: every output element is written by one thread after a fixed
sequence of operations. Limits (checked): HS 64 or 128, B*NH <= 65535, 16-byte aligned pointers, dqkv
not aliasing the inputs, sm_80 or newer. Hopper's HS 64 kernels: llmc/flash_attention_sm90.cuh. Budgets
and timings: docs/lab-notes.md and docs/performance.md, "Flash attention".
*/
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flash_common.cuh"
#include "llmc/utils.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "llmc/flash_attention.cuh needs sm_80 or newer (bf16 mma.sync, cp.async): build with GPU_ARCH=80 or above"
#endif

namespace llmc {

namespace flash_detail {

using namespace flash_common;

// ----------------------------------------------------------------------------------------------------
// PTX wrappers. The "memory" clobbers keep shared-memory reads and async copies inside their barriers.

__device__ inline void cp_async16(void* dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes)
                 : "memory");
}

// The pipelined kernels commit each step's copies as a group and wait for all but the newest N groups.
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ inline void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ inline void cp_async_wait_all() {
    cp_async_commit();
    cp_async_wait<0>();
}

__device__ inline void ldsm_x4(uint32_t (&r)[4], const floatX* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}

__device__ inline void ldsm_x4_trans(uint32_t (&r)[4], const floatX* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}

// c (16x8 fp32) += a (16x16 bf16, row) * b (16x8 bf16, col).
__device__ inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ----------------------------------------------------------------------------------------------------
// Tiles. m16n8k16 fragments (lane = 4 * g + q): A (row g / g+8, k 2q.. / 2q+8..), B (k 2q.. / 2q+8..,
// col g), C (row g / g+8, col 2q..). Shared tiles are [row][HS + 8]: the pad avoids bank conflicts.

constexpr int kThreads = 128;  // 4 warps, 16 * MT rows of the block's tile each
constexpr int kWarps = kThreads / kWarpSize;

// Rows per block: MT row tiles of 16 per warp (MT = 2 uses each loaded B fragment twice).
template <int MT>
constexpr int block_m() {
    return kWarps * 16 * MT;
}

template <int HS>
constexpr int row_stride() {
    return HS + 8;
}

// Rows row0 .. row0+ROWS-1 of a (rows, HS) slice (row r at g + r * stride); rows >= T are zero-filled
// (0 * NaN would still be NaN).
template <int HS, int ROWS>
__device__ inline void load_tile(floatX* s, const floatX* g, int64_t stride, int row0, int T) {
    constexpr int kChunks = HS / 8;
    for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
        const int r = i / kChunks, c = (i % kChunks) * 8;
        const int t = row0 + r;
        const floatX* src = g + int64_t(min(t, T - 1)) * stride + c;
        cp_async16(s + r * row_stride<HS>() + c, src, t < T);
    }
}

// A fragment (16x16) at (row0, col0) of a shared tile.
template <int HS>
__device__ inline void load_a(uint32_t (&a)[4], const floatX* s, int row0, int col0, int lane) {
    ldsm_x4(a, s + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * row_stride<HS>() + col0 + (lane >> 4) * 8);
}

// B fragments of two k-steps (k = col0..col0+31) for columns n = row0..row0+7 of a tile stored [n][k].
template <int HS>
__device__ inline void load_b_nk(uint32_t (&b)[4], const floatX* s, int row0, int col0, int lane) {
    ldsm_x4(b, s + (row0 + (lane & 7)) * row_stride<HS>() + col0 + (lane >> 3) * 8);
}

// B fragments of one k-step (k = row0..row0+15) for n = col0..+7 and col0+8..+15 of a tile stored [k][n].
template <int HS>
__device__ inline void load_b_kn(uint32_t (&b)[4], const floatX* s, int row0, int col0, int lane) {
    ldsm_x4_trans(b, s + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * row_stride<HS>() + col0 + (lane >> 4) * 8);
}

// acc[mt] (16 x N) += rows arow0 + 16 mt .. +15 of sA times B^T, B = N rows of sB [n][HS]; each B fragment
// serves all MT row tiles, and every row sees the same mma steps whatever MT is.
template <int HS, int N, int MT>
__device__ inline void mma_rows_by_rows(float (&acc)[MT][N / 8][4], const floatX* sA, int arow0, const floatX* sB,
                                        int lane) {
#pragma unroll
    for (int k2 = 0; k2 < HS / 32; k2++) {
        uint32_t a[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            load_a<HS>(a[mt][0], sA, arow0 + 16 * mt, k2 * 32, lane);
            load_a<HS>(a[mt][1], sA, arow0 + 16 * mt, k2 * 32 + 16, lane);
        }
#pragma unroll
        for (int nt = 0; nt < N / 8; nt++) {
            uint32_t b[4];
            load_b_nk<HS>(b, sB, nt * 8, k2 * 32, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16(acc[mt][nt], a[mt][0], b[0], b[1]);
                mma_bf16(acc[mt][nt], a[mt][1], b[2], b[3]);
            }
        }
    }
}

// acc[mt] (16 x HS) += P[mt] (fp32 accumulators rounded to bf16) * sB (K rows [k][HS]).
template <int HS, int K, int MT>
__device__ inline void mma_acc_by_tile(float (&acc)[MT][HS / 8][4], const float (&p)[MT][K / 8][4],
                                       const floatX* sB, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) acc_frag(a[mt], p[mt], kk);
#pragma unroll
        for (int np = 0; np < HS / 16; np++) {
            uint32_t b[4];
            load_b_kn<HS>(b, sB, kk * 16, np * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Key block j's K and V tiles (kBlockN rows each) into dst (K) and dst + one tile (V), as async copies.
template <int HS>
__device__ inline void kv_load(floatX* dst, const floatX* base, int C, int64_t C3, int j, int T) {
    load_tile<HS, kBlockN>(dst, base + C, C3, j * kBlockN, T);
    load_tile<HS, kBlockN>(dst + kBlockN * row_stride<HS>(), base + 2 * C, C3, j * kBlockN, T);
}

// One step of a loop over key blocks: makes block j's K, V ready for every warp and returns its K tile (V
// one tile later). Pipe: issues block j+1 into the other buffer first, then waits only for block j.
template <int HS, bool Pipe>
__device__ inline const floatX* kv_step(floatX* sKV, const floatX* base, int C, int64_t C3, int j, int n_blocks,
                                        int T) {
    constexpr int kPair = 2 * kBlockN * row_stride<HS>();
    const int buf = Pipe ? (j & 1) : 0;
    __syncthreads();  // every warp is done with the K, V pair about to be filled
    if constexpr (Pipe) {
        if (j + 1 < n_blocks) {
            kv_load<HS>(sKV + (buf ^ 1) * kPair, base, C, C3, j + 1, T);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
    } else {
        kv_load<HS>(sKV, base, C, C3, j, T);
        cp_async_wait_all();
    }
    __syncthreads();
    return sKV + buf * kPair;
}

// ----------------------------------------------------------------------------------------------------
// Forward. Block (query block, b*NH + h), longest first; s2 = scale * log2(e) * q.k.

// Pipe: K, V double-buffered; MT: row tiles per warp. All variants give the same bits; a warp skips key
// blocks wholly above its rows' diagonal.
template <int HS, bool Pipe = false, int MT = 1>
constexpr size_t fwd_smem() {
    return size_t(block_m<MT>() + (Pipe ? 4 : 2) * kBlockN) * row_stride<HS>() * sizeof(floatX);
}

template <int HS, bool Pipe = false, int MT = 1>
static __global__ void __launch_bounds__(kThreads)
    flash_fwd_kernel(floatX* out, float* lse, const floatX* qkv, int T, int NH, float scale_log2) {
    constexpr int BM = block_m<MT>();
    extern __shared__ uint4 smem[];
    floatX* sQ = reinterpret_cast<floatX*>(smem);
    floatX* sKV = sQ + BM * row_stride<HS>();  // K then V; with Pipe, a second K, V pair after them
    constexpr int kTile = kBlockN * row_stride<HS>();
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int C = NH * HS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * HS;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int wrow0 = warp * 16 * MT;
    const int wfirst = q0 + wrow0, wlast = wfirst + 16 * MT - 1;  // this warp's query rows

    load_tile<HS, BM>(sQ, base, C3, q0, T);
    if constexpr (Pipe) kv_load<HS>(sKV, base, C, C3, 0, T);
    cp_async_wait_all();
    __syncthreads();
    uint32_t qf[MT][HS / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++) load_a<HS>(qf[mt][kk], sQ, wrow0 + 16 * mt, kk * 16, lane);
    }

    float o[MT][HS / 8][4];
    zero(o);
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
    const int n_blocks = ceil_div(min(T, q0 + BM), kBlockN);
    for (int j = 0; j < n_blocks; j++) {
        const int k0 = j * kBlockN;
        const floatX* sK = kv_step<HS, Pipe>(sKV, base, C, C3, j, n_blocks, T);
        const floatX* sV = sK + kTile;
        if (k0 > wlast) continue;  // every key after every row of this warp

        float s[MT][kBlockN / 8][4];
        zero(s);
#pragma unroll
        for (int k2 = 0; k2 < HS / 32; k2++) {
#pragma unroll
            for (int nt = 0; nt < kBlockN / 8; nt++) {
                uint32_t bf[4];
                load_b_nk<HS>(bf, sK, nt * 8, k2 * 32, lane);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_bf16(s[mt][nt], qf[mt][2 * k2], bf[0], bf[1]);
                    mma_bf16(s[mt][nt], qf[mt][2 * k2 + 1], bf[2], bf[3]);
                }
            }
        }
        // Keys above the diagonal or past T get -inf; only blocks reaching them pay for the test.
        if (k0 + kBlockN - 1 > wfirst || k0 + kBlockN > T) {
            mask_block<MT, kBlockN>(s, wfirst, k0, -INFINITY, lane, [T](int r, int c) { return c <= r && c < T; });
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++) softmax_step<HS>(s[mt], m[mt], l[mt], o[mt], scale_log2);
        mma_acc_by_tile<HS, kBlockN, MT>(o, s, sV, lane);
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        store_forward_rows<HS>(out + int64_t(b) * T * C + h * HS, C, lse + int64_t(bh) * T, o[mt], m[mt], l[mt],
                               wfirst + 16 * mt, T, lane);
    }
}
// Backward, 2: dK, dV of one block of keys (as mma rows), over the query blocks at or after it, BQ at a
// time: S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q, scaled at the end.
// Same bits for any BQ, MT and Pipe.

template <int HS, int MT>
constexpr int dkdv_bq() {
    // queries per step: keeps the S^T and dP^T accumulators small for HS = 128 and for MT = 2
    return HS <= 64 && MT == 1 ? 64 : 32;
}

// Pipe: two buffers of Q, dO, lse and D; query block i+1 loads while block i computes.
template <int HS, bool Pipe = false, int MT = 1>
constexpr size_t dkdv_smem() {
    return size_t(2 * block_m<MT>() + (Pipe ? 4 : 2) * dkdv_bq<HS, MT>()) * row_stride<HS>() * sizeof(floatX) +
           (Pipe ? 4 : 2) * dkdv_bq<HS, MT>() * sizeof(float);
}

template <int HS, bool Pipe = false, int MT = 1>
static __global__ void __launch_bounds__(kThreads)
    flash_bwd_dkdv_kernel(floatX* dqkv, const floatX* qkv, const floatX* dout, const float* lse, const float* D,
                          int T, int NH, float scale_log2, float scale) {
    constexpr int BM = block_m<MT>();
    constexpr int BQ = dkdv_bq<HS, MT>();
    constexpr int kQTile = BQ * row_stride<HS>();
    constexpr int kBufs = Pipe ? 2 : 1;
    extern __shared__ uint4 smem[];
    floatX* sK = reinterpret_cast<floatX*>(smem);
    floatX* sV = sK + BM * row_stride<HS>();
    floatX* sQdO = sV + BM * row_stride<HS>();  // per buffer: Q, then dO
    float* sLD = reinterpret_cast<float*>(sQdO + 2 * kBufs * kQTile);  // per buffer: lse, then D
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int k0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int C = NH * HS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * HS;
    const floatX* dobase = dout + int64_t(b) * T * C + h * HS;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int wrow0 = warp * 16 * MT;
    const int wfirst = k0 + wrow0, wlast = wfirst + 16 * MT - 1;  // this warp's keys

    // Query block i's Q, dO (async copies) and lse, D (plain stores) into buffer `buf`.
    auto load_queries = [&](int i, int buf) {
        const int q0 = i * BQ;
        floatX* bQ = sQdO + 2 * buf * kQTile;
        float* bL = sLD + 2 * buf * BQ;
        load_tile<HS, BQ>(bQ, base, C3, q0, T);
        load_tile<HS, BQ>(bQ + kQTile, dobase, C, q0, T);
        for (int t = threadIdx.x; t < BQ; t += kThreads) {
            const int qi = q0 + t;
            bL[t] = qi < T ? lse[int64_t(bh) * T + qi] * kLog2e : 0.0f;
            bL[BQ + t] = qi < T ? D[int64_t(bh) * T + qi] : 0.0f;
        }
    };
    load_tile<HS, BM>(sK, base + C, C3, k0, T);
    load_tile<HS, BM>(sV, base + 2 * C, C3, k0, T);
    float dk[MT][HS / 8][4], dv[MT][HS / 8][4];
    zero(dk);
    zero(dv);
    const int n_qblocks = ceil_div(T, BQ), i0 = k0 / BQ;
    if constexpr (Pipe) {
        load_queries(i0, 0);
        cp_async_commit();
    }
    for (int i = i0; i < n_qblocks; i++) {
        const int q0 = i * BQ;
        const int buf = Pipe ? ((i - i0) & 1) : 0;
        __syncthreads();  // every warp is done with the Q, dO, lse, D buffer about to be filled
        if constexpr (Pipe) {
            if (i + 1 < n_qblocks) {
                load_queries(i + 1, buf ^ 1);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
        } else {
            load_queries(i, 0);
            cp_async_wait_all();
        }
        __syncthreads();
        if (q0 + BQ - 1 < wfirst) continue;  // every query before every key of this warp
        const floatX* sQ = sQdO + 2 * buf * kQTile;
        const floatX* sdO = sQ + kQTile;
        const float* sL = sLD + 2 * buf * BQ;
        const float* sD = sL + BQ;

        float st[MT][BQ / 8][4];
        zero(st);
        mma_rows_by_rows<HS, BQ, MT>(st, sK, wrow0, sQ, lane);
        for_each_element<MT, BQ>(lane, [&](int mt, int nt, int e, int, int c) {
            st[mt][nt][e] = exp2_fast(fmaf(st[mt][nt][e], scale_log2, -sL[c]));
        });
        // Queries before the key (above the diagonal) or past T get P = 0.
        if (q0 < wlast || q0 + BQ > T) {
            mask_block<MT, BQ>(st, wfirst, q0, 0.0f, lane, [T](int r, int c) { return c >= r && c < T; });
        }
        mma_acc_by_tile<HS, BQ, MT>(dv, st, sdO, lane);

        float dpt[MT][BQ / 8][4];
        zero(dpt);
        mma_rows_by_rows<HS, BQ, MT>(dpt, sV, wrow0, sdO, lane);
        for_each_element<MT, BQ>(lane, [&](int mt, int nt, int e, int, int c) {
            dpt[mt][nt][e] = st[mt][nt][e] * (dpt[mt][nt][e] - sD[c]);
        });
        mma_acc_by_tile<HS, BQ, MT>(dk, dpt, sQ, lane);
    }
    // The loop ran at least once, so the K, V copies issued before it have landed.
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        store_rows<HS>(dqkv + int64_t(b) * T * C3 + C + h * HS, C3, dk[mt], scale, scale, wfirst + 16 * mt, T, lane);
        store_rows<HS>(dqkv + int64_t(b) * T * C3 + 2 * C + h * HS, C3, dv[mt], 1.0f, 1.0f, wfirst + 16 * mt, T,
                       lane);
    }
}

// Backward, 3: dQ of one block of queries over the key blocks up to the diagonal, dQ += dS K, scaled at
// the end; its own pass so no two blocks add into one dQ element. Same bits for all variants.

template <int HS, bool Pipe = false, int MT = 1>
constexpr size_t dq_smem() {
    return size_t(2 * block_m<MT>() + (Pipe ? 4 : 2) * kBlockN) * row_stride<HS>() * sizeof(floatX);
}

template <int HS, bool Pipe = false, int MT = 1>
static __global__ void __launch_bounds__(kThreads)
    flash_bwd_dq_kernel(floatX* dqkv, const floatX* qkv, const floatX* dout, const float* lse, const float* D, int T,
                        int NH, float scale_log2, float scale) {
    constexpr int BM = block_m<MT>();
    constexpr int KS = MT == 1 ? kBlockN : kBlockN / 2;
    extern __shared__ uint4 smem[];
    floatX* sQ = reinterpret_cast<floatX*>(smem);
    floatX* sdO = sQ + BM * row_stride<HS>();
    floatX* sKV = sdO + BM * row_stride<HS>();  // K then V; with Pipe, a second K, V pair after them
    constexpr int kTile = kBlockN * row_stride<HS>();
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int C = NH * HS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * HS;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, g = lane >> 2;
    const int wrow0 = warp * 16 * MT;
    const int wfirst = q0 + wrow0, wlast = wfirst + 16 * MT - 1;  // this warp's query rows
    int row[MT][2];
    float lse2[MT][2], Dr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            row[mt][r] = wfirst + 16 * mt + g + 8 * r;
            lse2[mt][r] = row[mt][r] < T ? lse[int64_t(bh) * T + row[mt][r]] * kLog2e : 0.0f;
            Dr[mt][r] = row[mt][r] < T ? D[int64_t(bh) * T + row[mt][r]] : 0.0f;
        }
    }
    load_tile<HS, BM>(sQ, base, C3, q0, T);
    load_tile<HS, BM>(sdO, dout + int64_t(b) * T * C + h * HS, C, q0, T);
    if constexpr (Pipe) {
        kv_load<HS>(sKV, base, C, C3, 0, T);
        cp_async_commit();
    }

    float dq[MT][HS / 8][4];
    zero(dq);
    const int n_blocks = ceil_div(min(T, q0 + BM), kBlockN);
    for (int j = 0; j < n_blocks; j++) {
        const int k0 = j * kBlockN;
        const floatX* sK = kv_step<HS, Pipe>(sKV, base, C, C3, j, n_blocks, T);
        const floatX* sV = sK + kTile;
        // The block's keys in parts of KS (fewer live registers; the same k-step order).
#pragma unroll
        for (int part = 0; part < kBlockN / KS; part++) {
            const int kp = k0 + part * KS;
            if (kp > wlast) continue;  // every key after every row of this warp
            const floatX* sKp = sK + part * KS * row_stride<HS>();
            const floatX* sVp = sV + part * KS * row_stride<HS>();
            float s[MT][KS / 8][4];
            zero(s);
            mma_rows_by_rows<HS, KS, MT>(s, sQ, wrow0, sKp, lane);
            for_each_element<MT, KS>(lane, [&](int mt, int nt, int e, int, int) {
                s[mt][nt][e] = exp2_fast(fmaf(s[mt][nt][e], scale_log2, -lse2[mt][e >> 1]));
            });
            if (kp + KS - 1 > wfirst || kp + KS > T) {
                mask_block<MT, KS>(s, wfirst, kp, 0.0f, lane, [T](int r, int c) { return c <= r && c < T; });
            }
            float dp[MT][KS / 8][4];
            zero(dp);
            mma_rows_by_rows<HS, KS, MT>(dp, sdO, wrow0, sVp, lane);
            for_each_element<MT, KS>(lane, [&](int mt, int nt, int e, int, int) {
                dp[mt][nt][e] = s[mt][nt][e] * (dp[mt][nt][e] - Dr[mt][e >> 1]);
            });
            mma_acc_by_tile<HS, KS, MT>(dq, dp, sKp, lane);
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        store_rows<HS>(dqkv + int64_t(b) * T * C3 + h * HS, C3, dq[mt], scale, scale, wfirst + 16 * mt, T, lane);
    }
}

}  // namespace flash_detail

// Bytes of lse (B,NH,T) fp32, the state flash_forward saves for flash_backward.
inline size_t flash_lse_bytes(int B, int NH, int T) { return size_t(B) * size_t(NH) * size_t(T) * sizeof(float); }

// Bytes of flash_backward's scratch: D (B,NH,T) fp32.
inline size_t flash_scratch_bytes(int B, int NH, int T) { return flash_lse_bytes(B, NH, T); }

// How the trainer runs these kernels per head size: double-buffering (pipe) and 16-row tiles per warp
// (tiles). Every choice gives the same bits (timings: docs/performance.md); Hopper HS 64 runs sm90's.
struct FlashTiling {
    bool fwd_pipe;
    int fwd_tiles;
    bool kv_pipe;  // dK/dV
    int kv_tiles;
    bool q_pipe;  // dQ
    int q_tiles;
};

template <int HS>
constexpr FlashTiling flash_tiling() {
    return HS == 64 ? FlashTiling{true, 2, false, 2, true, 2} : FlashTiling{false, 1, false, 1, false, 1};
}

// out (B,T,C) and lse (B,NH,T) from qkv (B,T,3C), C = NH * HS; any Pipe and MT give the same bits.
template <int HS, bool Pipe = flash_tiling<HS>().fwd_pipe, int MT = flash_tiling<HS>().fwd_tiles>
void flash_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, cudaStream_t stream) {
    static_assert(HS == 64 || HS == 128, "flash attention kernels exist for HS 64 and 128");
    static_assert(MT == 1 || (MT == 2 && HS == 64), "two row tiles per warp only for HS 64");
    using namespace flash_detail;
    check_args("flash_forward", B, T, NH);
    require_aligned16_each("flash_forward", {{"out", out}, {"lse", lse}, {"qkv", qkv}});
    allow_smem(flash_fwd_kernel<HS, Pipe, MT>, fwd_smem<HS, Pipe, MT>());
    const float scale_log2 = kLog2e / sqrtf(float(HS));
    const dim3 grid(unsigned(ceil_div(T, block_m<MT>())), unsigned(B * NH));
    flash_fwd_kernel<HS, Pipe, MT>
        <<<grid, kThreads, fwd_smem<HS, Pipe, MT>(), stream>>>(out, lse, qkv, T, NH, scale_log2);
    cudaCheckLaunch();
}

// dqkv (B,T,3C), overwritten, from dout and the forward's qkv, out and lse; D: scratch of
// flash_scratch_bytes. dqkv must not alias the inputs.
template <int HS, bool Pipe = flash_tiling<HS>().kv_pipe, int MT = flash_tiling<HS>().kv_tiles,
          int MTQ = flash_tiling<HS>().q_tiles, bool PipeQ = flash_tiling<HS>().q_pipe>
void flash_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse, int B,
                    int T, int NH, float* D, cudaStream_t stream) {
    static_assert(HS == 64 || HS == 128, "flash attention kernels exist for HS 64 and 128");
    static_assert((MT == 1 || (MT == 2 && HS == 64)) && (MTQ == 1 || (MTQ == 2 && HS == 64)),
                  "two row tiles per warp only for HS 64");
    using namespace flash_detail;
    check_args("flash_backward", B, T, NH);
    require_aligned16_each("flash_backward",
                           {{"dqkv", dqkv}, {"dout", dout}, {"qkv", qkv}, {"out", out}, {"lse", lse}, {"D", D}});
    flash_backward_dot<HS>(D, out, dout, B, T, NH, stream);
    allow_smem(flash_bwd_dkdv_kernel<HS, Pipe, MT>, dkdv_smem<HS, Pipe, MT>());
    allow_smem(flash_bwd_dq_kernel<HS, PipeQ, MTQ>, dq_smem<HS, PipeQ, MTQ>());
    const float scale = 1.0f / sqrtf(float(HS)), scale_log2 = scale * kLog2e;
    const dim3 grid_kv(unsigned(ceil_div(T, block_m<MT>())), unsigned(B * NH));
    flash_bwd_dkdv_kernel<HS, Pipe, MT><<<grid_kv, kThreads, dkdv_smem<HS, Pipe, MT>(), stream>>>(
        dqkv, qkv, dout, lse, D, T, NH, scale_log2, scale);
    cudaCheckLaunch();
    const dim3 grid_q(unsigned(ceil_div(T, block_m<MTQ>())), unsigned(B * NH));
    flash_bwd_dq_kernel<HS, PipeQ, MTQ><<<grid_q, kThreads, dq_smem<HS, PipeQ, MTQ>(), stream>>>(
        dqkv, qkv, dout, lse, D, T, NH, scale_log2, scale);
    cudaCheckLaunch();
}

}  // namespace llmc
