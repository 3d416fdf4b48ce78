/*
attention_lab: a flash-attention forward and backward for the trainer's causal attention, checked against
an fp32 reference and timed against llmc/attention.cuh (design and expectations: dev/ATTENTION.md).

  build/attention_lab

Provides (in this file only, not yet a layer of the trainer):
  flash_forward<HS>:  out (B,T,C) and lse (B,NH,T) fp32 (the natural-log logsumexp of each scaled score
                      row) straight from qkv (B,T,3C); no permute, nothing quadratic in T is stored.
  flash_backward<HS>: dqkv (B,T,3C), overwritten, from dout (B,T,C), qkv, out and lse. Three kernels:
                      D = rowsum(dout * out); dK, dV per key block (loop over query blocks, accumulators
                      in registers); dQ per query block (loop over key blocks, P recomputed). Every
                      element of dqkv is written by exactly one thread, no atomics: deterministic.
  Tensor cores through mma.sync m16n8k16 bf16 with fp32 accumulation, operands via ldmatrix; tiles of 64
  queries x 64 keys, 4 warps (16 rows each); HS = 64 and 128.
Checks (exit 1 on any failure): out, dq, dk, dv against fp32 reference kernels (relative error norm),
outputs poisoned with NaN before each launch (so an unwritten element shows), forward and backward run
twice and compared bitwise; T = 1, 37, 64, 1000, 1024 and small and large B*NH. Then times (CUDA events,
median of 25 after warm-up) both implementations at the d12 shapes and prints a table.

Does not provide: dropout, non-causal masks, HS other than 64/128, wgmma/TMA (Hopper-only paths).
*/
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/attention.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

using namespace llmc;

namespace {

// ----------------------------------------------------------------------------------------------------
// PTX wrappers. The "memory" clobbers keep the compiler from moving shared-memory reads and the async
// copies across the barriers that order them.

__device__ inline uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ inline void cp_async16(void* dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes)
                 : "memory");
}

__device__ inline void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
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

// Two floats as a bf16 pair, lo in the low half (the lower column of an mma operand).
__device__ inline uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, sizeof(r));
    return r;
}

// ----------------------------------------------------------------------------------------------------
// Tiles. Fragment layouts of m16n8k16 (lane = 4 * g + q): A regs (row g, k 2q..2q+1), (row g+8, ..),
// (row g, k 2q+8..), (row g+8, k 2q+8..); B regs (k 2q..2q+1, col g), (k 2q+8.., col g); C (row g, col
// 2q..2q+1), (row g+8, ..). Shared tiles are row-major [row][HS + 8]: the 16-byte pad puts the 8 rows an
// ldmatrix reads in 8 different bank quads.

constexpr int kThreads = 128;  // 4 warps, 16 rows of the block's tile each
constexpr int kBlockM = 64;    // rows (queries in forward and dQ, keys in dK/dV) per block
constexpr int kBlockN = 64;    // keys per step (forward, dQ)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int HS>
constexpr int row_stride() {
    return HS + 8;
}

// Rows row0 .. row0+ROWS-1 of a (rows, HS) slice whose row r starts at g + r * stride; rows >= T are
// zero-filled (zeros, not garbage: a masked probability 0 times a NaN would still be NaN).
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

// B fragments of two k-steps (k = col0..col0+31) for the 8 columns n = row0..row0+7 of a tile stored
// [n][k]: b[0], b[1] for k-step col0, b[2], b[3] for col0 + 16.
template <int HS>
__device__ inline void load_b_nk(uint32_t (&b)[4], const floatX* s, int row0, int col0, int lane) {
    ldsm_x4(b, s + (row0 + (lane & 7)) * row_stride<HS>() + col0 + (lane >> 3) * 8);
}

// B fragments of one k-step (k = row0..row0+15) for two column groups (n = col0..+7 and col0+8..+15)
// of a tile stored [k][n]: b[0], b[1] for n = col0.., b[2], b[3] for col0 + 8.
template <int HS>
__device__ inline void load_b_kn(uint32_t (&b)[4], const floatX* s, int row0, int col0, int lane) {
    ldsm_x4_trans(b, s + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * row_stride<HS>() + col0 + (lane >> 4) * 8);
}

// acc (16 x N of this warp) += A (16 x HS rows arow0.. of sA) * B^T, B = N rows of sB [n][HS].
template <int HS, int N>
__device__ inline void mma_rows_by_rows(float (&acc)[N / 8][4], const floatX* sA, int arow0, const floatX* sB,
                                        int lane) {
#pragma unroll
    for (int k2 = 0; k2 < HS / 32; k2++) {
        uint32_t a0[4], a1[4];
        load_a<HS>(a0, sA, arow0, k2 * 32, lane);
        load_a<HS>(a1, sA, arow0, k2 * 32 + 16, lane);
#pragma unroll
        for (int nt = 0; nt < N / 8; nt++) {
            uint32_t b[4];
            load_b_nk<HS>(b, sB, nt * 8, k2 * 32, lane);
            mma_bf16(acc[nt], a0, b[0], b[1]);
            mma_bf16(acc[nt], a1, b[2], b[3]);
        }
    }
}

// acc (16 x HS) += P (16 x K, fp32 accumulators of a previous mma, rounded to bf16) * sB (K rows [k][HS]).
template <int HS, int K>
__device__ inline void mma_acc_by_tile(float (&acc)[HS / 8][4], const float (&p)[K / 8][4], const floatX* sB,
                                       int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        const uint32_t a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                               pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                               pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int np = 0; np < HS / 16; np++) {
            uint32_t b[4];
            load_b_kn<HS>(b, sB, kk * 16, np * 16, lane);
            mma_bf16(acc[2 * np], a, b[0], b[1]);
            mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

template <int N>
__device__ inline void zero(float (&acc)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

// Writes a warp's 16 x HS accumulator block (times mul) as bf16: row r of the block goes to dst + (row0 +
// r) * stride, rows >= T skipped.
template <int HS>
__device__ inline void store_rows(floatX* dst, int64_t stride, const float (&acc)[HS / 8][4], float mul_a,
                                  float mul_b, int row0, int T, int lane) {
    const int g = lane >> 2, q = lane & 3;
    const int ra = row0 + g, rb = ra + 8;
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) {
        const int col = dt * 8 + 2 * q;
        if (ra < T) {
            *reinterpret_cast<__nv_bfloat162*>(dst + int64_t(ra) * stride + col) =
                __floats2bfloat162_rn(acc[dt][0] * mul_a, acc[dt][1] * mul_a);
        }
        if (rb < T) {
            *reinterpret_cast<__nv_bfloat162*>(dst + int64_t(rb) * stride + col) =
                __floats2bfloat162_rn(acc[dt][2] * mul_b, acc[dt][3] * mul_b);
        }
    }
}

// ----------------------------------------------------------------------------------------------------
// Forward. Block (query block, b*NH + h); query blocks are issued longest first (the last ones see the
// most keys). Online softmax in the log2 domain: s2 = scale * log2(e) * q.k.

template <int HS>
constexpr size_t fwd_smem() {
    return size_t(kBlockM + 2 * kBlockN) * row_stride<HS>() * sizeof(floatX);
}

template <int HS>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(floatX* out, float* lse, const floatX* qkv, int T,
                                                             int NH, float scale_log2) {
    extern __shared__ uint4 smem[];
    floatX* sQ = reinterpret_cast<floatX*>(smem);
    floatX* sK = sQ + kBlockM * row_stride<HS>();
    floatX* sV = sK + kBlockN * row_stride<HS>();
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;
    const int C = NH * HS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * HS;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, g = lane >> 2, q = lane & 3;
    const int wrow0 = warp * 16;
    const int row[2] = {q0 + wrow0 + g, q0 + wrow0 + g + 8};

    load_tile<HS, kBlockM>(sQ, base, C3, q0, T);
    cp_async_wait_all();
    __syncthreads();
    uint32_t qf[HS / 16][4];
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) load_a<HS>(qf[kk], sQ, wrow0, kk * 16, lane);

    float o[HS / 8][4];
    zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const int n_blocks = ceil_div(min(T, q0 + kBlockM), kBlockN);
    for (int j = 0; j < n_blocks; j++) {
        const int k0 = j * kBlockN;
        __syncthreads();  // every warp is done with the previous K, V
        load_tile<HS, kBlockN>(sK, base + C, C3, k0, T);
        load_tile<HS, kBlockN>(sV, base + 2 * C, C3, k0, T);
        cp_async_wait_all();
        __syncthreads();

        float s[kBlockN / 8][4];
        zero(s);
#pragma unroll
        for (int k2 = 0; k2 < HS / 32; k2++) {
#pragma unroll
            for (int nt = 0; nt < kBlockN / 8; nt++) {
                uint32_t bf[4];
                load_b_nk<HS>(bf, sK, nt * 8, k2 * 32, lane);
                mma_bf16(s[nt], qf[2 * k2], bf[0], bf[1]);
                mma_bf16(s[nt], qf[2 * k2 + 1], bf[2], bf[3]);
            }
        }
        // Keys above the diagonal or past T get -inf; only blocks reaching them pay for the test.
        const bool masked = k0 + kBlockN - 1 > q0 || k0 + kBlockN > T;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + nt * 8 + 2 * q + (e & 1);
                float v = s[nt][e] * scale_log2;
                if (masked && (key > row[e >> 1] || key >= T)) v = -INFINITY;
                s[nt][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        }
        float sub[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            sub[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // a row with nothing unmasked yet stays at 0
            const float corr = exp2f(m[r] - sub[r]);
            m[r] = mx[r];
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
                s[nt][e] = exp2f(s[nt][e] - sub[e >> 1]);
                rs[e >> 1] += s[nt][e];
            }
        }
        l[0] += rs[0];
        l[1] += rs[1];
        mma_acc_by_tile<HS, kBlockN>(o, s, sV, lane);
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        if (q == 0 && row[r] < T) lse[int64_t(bh) * T + row[r]] = (m[r] + log2f(l[r])) * kLn2;
    }
    store_rows<HS>(out + int64_t(b) * T * C + h * HS, C, o, inv[0], inv[1], q0 + wrow0, T, lane);
}

// ----------------------------------------------------------------------------------------------------
// Backward, 1: D[b,h,t] = sum_d dout * out over one head's row; HS/8 lanes per row, fixed shuffle tree.

template <int HS>
__global__ void __launch_bounds__(kThreads) flash_bwd_dot_kernel(float* D, const floatX* out, const floatX* dout,
                                                                 int B, int T, int NH) {
    constexpr int kLanes = HS / 8;
    const int64_t r = int64_t(blockIdx.x) * (kThreads / kLanes) + threadIdx.x / kLanes;  // (b, t, h) order
    const int sub = threadIdx.x % kLanes;
    const bool valid = r < int64_t(B) * T * NH;
    float acc = 0.0f;
    if (valid) {
        const PackX o = load128(out + r * HS + sub * 8), d = load128(dout + r * HS + sub * 8);
#pragma unroll
        for (int i = 0; i < 8; i++) acc += float(o[i]) * float(d[i]);
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (valid && sub == 0) {
        const int h = int(r % NH);
        const int64_t bt = r / NH;
        const int t = int(bt % T), b = int(bt / T);
        D[(int64_t(b) * NH + h) * T + t] = acc;
    }
}

// Backward, 2: dK, dV of one block of kBlockM keys (16 per warp, as rows), looping over the query blocks
// at or after it, BQ queries at a time. Transposed products keep keys as the mma rows, so P^T and dS^T
// are already A operands: S^T = K Q^T, P^T = exp2(S^T * scale_log2 - lse2), dV += P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q, and dK is scaled once at the end.

template <int HS>
constexpr int dkdv_bq() {
    return HS <= 64 ? 64 : 32;  // queries per step: keeps the S^T and dP^T accumulators small for HS = 128
}

template <int HS>
constexpr size_t dkdv_smem() {
    return size_t(2 * kBlockM + 2 * dkdv_bq<HS>()) * row_stride<HS>() * sizeof(floatX) +
           2 * dkdv_bq<HS>() * sizeof(float);
}

template <int HS>
__global__ void __launch_bounds__(kThreads)
    flash_bwd_dkdv_kernel(floatX* dqkv, const floatX* qkv, const floatX* dout, const float* lse, const float* D,
                          int T, int NH, float scale_log2, float scale) {
    constexpr int BQ = dkdv_bq<HS>();
    extern __shared__ uint4 smem[];
    floatX* sK = reinterpret_cast<floatX*>(smem);
    floatX* sV = sK + kBlockM * row_stride<HS>();
    floatX* sQ = sV + kBlockM * row_stride<HS>();
    floatX* sdO = sQ + BQ * row_stride<HS>();
    float* sL = reinterpret_cast<float*>(sdO + BQ * row_stride<HS>());
    float* sD = sL + BQ;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int k0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;
    const int C = NH * HS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * HS;
    const floatX* dobase = dout + int64_t(b) * T * C + h * HS;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, g = lane >> 2, q = lane & 3;
    const int wrow0 = warp * 16;
    const int key[2] = {k0 + wrow0 + g, k0 + wrow0 + g + 8};

    load_tile<HS, kBlockM>(sK, base + C, C3, k0, T);
    load_tile<HS, kBlockM>(sV, base + 2 * C, C3, k0, T);
    float dk[HS / 8][4], dv[HS / 8][4];
    zero(dk);
    zero(dv);
    const int n_qblocks = ceil_div(T, BQ);
    for (int i = k0 / BQ; i < n_qblocks; i++) {
        const int q0 = i * BQ;
        __syncthreads();  // every warp is done with the previous Q, dO, lse, D
        load_tile<HS, BQ>(sQ, base, C3, q0, T);
        load_tile<HS, BQ>(sdO, dobase, C, q0, T);
        for (int t = threadIdx.x; t < BQ; t += kThreads) {
            const int qi = q0 + t;
            sL[t] = qi < T ? lse[int64_t(bh) * T + qi] * kLog2e : 0.0f;
            sD[t] = qi < T ? D[int64_t(bh) * T + qi] : 0.0f;
        }
        cp_async_wait_all();
        __syncthreads();

        float st[BQ / 8][4];
        zero(st);
        mma_rows_by_rows<HS, BQ>(st, sK, wrow0, sQ, lane);
        // Queries before the key (above the diagonal) or past T get P = 0.
        const bool masked = q0 < k0 + kBlockM - 1 || q0 + BQ > T;
#pragma unroll
        for (int nt = 0; nt < BQ / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = nt * 8 + 2 * q + (e & 1), qi = q0 + c;
                const float p = exp2f(st[nt][e] * scale_log2 - sL[c]);
                st[nt][e] = masked && (qi < key[e >> 1] || qi >= T) ? 0.0f : p;
            }
        }
        mma_acc_by_tile<HS, BQ>(dv, st, sdO, lane);

        float dpt[BQ / 8][4];
        zero(dpt);
        mma_rows_by_rows<HS, BQ>(dpt, sV, wrow0, sdO, lane);
#pragma unroll
        for (int nt = 0; nt < BQ / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = nt * 8 + 2 * q + (e & 1);
                dpt[nt][e] = st[nt][e] * (dpt[nt][e] - sD[c]);
            }
        }
        mma_acc_by_tile<HS, BQ>(dk, dpt, sQ, lane);
    }
    // A block's first query block starts at or before k0, so the loop ran at least once and the K, V
    // copies issued before it have landed.
    store_rows<HS>(dqkv + int64_t(b) * T * C3 + C + h * HS, C3, dk, scale, scale, k0 + wrow0, T, lane);
    store_rows<HS>(dqkv + int64_t(b) * T * C3 + 2 * C + h * HS, C3, dv, 1.0f, 1.0f, k0 + wrow0, T, lane);
}

// Backward, 3: dQ of one block of kBlockM queries, looping over the key blocks up to the diagonal with P
// recomputed from lse: S = Q K^T, P, dP = dO V^T, dS = P (dP - D), dQ += dS K, scaled at the end.
// Separate from the dK/dV pass (FlashAttention-2's deterministic mode) so that no two blocks add into
// the same dQ element.

template <int HS>
constexpr size_t dq_smem() {
    return size_t(2 * kBlockM + 2 * kBlockN) * row_stride<HS>() * sizeof(floatX);
}

template <int HS>
__global__ void __launch_bounds__(kThreads)
    flash_bwd_dq_kernel(floatX* dqkv, const floatX* qkv, const floatX* dout, const float* lse, const float* D, int T,
                        int NH, float scale_log2, float scale) {
    extern __shared__ uint4 smem[];
    floatX* sQ = reinterpret_cast<floatX*>(smem);
    floatX* sdO = sQ + kBlockM * row_stride<HS>();
    floatX* sK = sdO + kBlockM * row_stride<HS>();
    floatX* sV = sK + kBlockN * row_stride<HS>();
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;
    const int C = NH * HS;
    const int64_t C3 = 3 * int64_t(C);
    const floatX* base = qkv + int64_t(b) * T * C3 + h * HS;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, g = lane >> 2, q = lane & 3;
    const int wrow0 = warp * 16;
    const int row[2] = {q0 + wrow0 + g, q0 + wrow0 + g + 8};
    float lse2[2], Dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lse2[r] = row[r] < T ? lse[int64_t(bh) * T + row[r]] * kLog2e : 0.0f;
        Dr[r] = row[r] < T ? D[int64_t(bh) * T + row[r]] : 0.0f;
    }
    load_tile<HS, kBlockM>(sQ, base, C3, q0, T);
    load_tile<HS, kBlockM>(sdO, dout + int64_t(b) * T * C + h * HS, C, q0, T);

    float dq[HS / 8][4];
    zero(dq);
    const int n_blocks = ceil_div(min(T, q0 + kBlockM), kBlockN);
    for (int j = 0; j < n_blocks; j++) {
        const int k0 = j * kBlockN;
        __syncthreads();  // every warp is done with the previous K, V
        load_tile<HS, kBlockN>(sK, base + C, C3, k0, T);
        load_tile<HS, kBlockN>(sV, base + 2 * C, C3, k0, T);
        cp_async_wait_all();
        __syncthreads();

        float s[kBlockN / 8][4];
        zero(s);
        mma_rows_by_rows<HS, kBlockN>(s, sQ, wrow0, sK, lane);
        const bool masked = k0 + kBlockN - 1 > q0 || k0 + kBlockN > T;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int k = k0 + nt * 8 + 2 * q + (e & 1);
                const float p = exp2f(s[nt][e] * scale_log2 - lse2[e >> 1]);
                s[nt][e] = masked && (k > row[e >> 1] || k >= T) ? 0.0f : p;
            }
        }
        float dp[kBlockN / 8][4];
        zero(dp);
        mma_rows_by_rows<HS, kBlockN>(dp, sdO, wrow0, sV, lane);
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) dp[nt][e] = s[nt][e] * (dp[nt][e] - Dr[e >> 1]);
        }
        mma_acc_by_tile<HS, kBlockN>(dq, dp, sK, lane);
    }
    store_rows<HS>(dqkv + int64_t(b) * T * C3 + h * HS, C3, dq, scale, scale, q0 + wrow0, T, lane);
}

// ----------------------------------------------------------------------------------------------------
// Launchers.

template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
    if (bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    }
}

template <int HS>
void flash_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, cudaStream_t stream) {
    allow_smem(flash_fwd_kernel<HS>, fwd_smem<HS>());
    const float scale_log2 = kLog2e / sqrtf(float(HS));
    const dim3 grid(unsigned(ceil_div(T, kBlockM)), unsigned(B * NH));
    flash_fwd_kernel<HS><<<grid, kThreads, fwd_smem<HS>(), stream>>>(out, lse, qkv, T, NH, scale_log2);
    cudaCheckLaunch();
}

// Scratch of flash_backward: D, (B,NH,T) fp32.
size_t flash_scratch_bytes(int B, int T, int NH) { return size_t(B) * NH * T * sizeof(float); }

template <int HS>
void flash_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse, int B,
                    int T, int NH, float* D, cudaStream_t stream) {
    const int64_t rows = int64_t(B) * T * NH;
    flash_bwd_dot_kernel<HS><<<unsigned(ceil_div<int64_t>(rows, kThreads / (HS / 8))), kThreads, 0, stream>>>(
        D, out, dout, B, T, NH);
    cudaCheckLaunch();
    allow_smem(flash_bwd_dkdv_kernel<HS>, dkdv_smem<HS>());
    allow_smem(flash_bwd_dq_kernel<HS>, dq_smem<HS>());
    const float scale = 1.0f / sqrtf(float(HS)), scale_log2 = scale * kLog2e;
    const dim3 grid(unsigned(ceil_div(T, kBlockM)), unsigned(B * NH));
    flash_bwd_dkdv_kernel<HS><<<grid, kThreads, dkdv_smem<HS>(), stream>>>(dqkv, qkv, dout, lse, D, T, NH,
                                                                            scale_log2, scale);
    cudaCheckLaunch();
    flash_bwd_dq_kernel<HS><<<grid, kThreads, dq_smem<HS>(), stream>>>(dqkv, qkv, dout, lse, D, T, NH, scale_log2,
                                                                        scale);
    cudaCheckLaunch();
}

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

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <class Fn>
double time_ms(Fn&& fn, cudaStream_t stream) {
    Event start(true), stop(true);
    for (int i = 0; i < 5; i++) fn();
    std::vector<double> ms;
    for (int i = 0; i < 25; i++) {
        cudaCheck(cudaEventRecord(start, stream));
        fn();
        cudaCheck(cudaEventRecord(stop, stream));
        cudaCheck(cudaEventSynchronize(stop));
        float t = 0;
        cudaCheck(cudaEventElapsedTime(&t, start, stop));
        ms.push_back(t);
    }
    return median(ms);
}

constexpr double kTolOut = 1e-2, kTolGrad = 2e-2, kTolVsLlmc = 3e-2;

// One shape: both implementations, checked (against the fp32 reference when with_ref, else flash against
// llmc) and, when timed, timed. Returns the number of failed checks.
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

    auto fwd = [&](floatX* o) {
        if (HS == 64) flash_forward<64>(o, lse.get(), qkv.get(), B, T, NH, stream);
        else flash_forward<128>(o, lse.get(), qkv.get(), B, T, NH, stream);
    };
    auto bwd = [&](floatX* g) {
        if (HS == 64) flash_backward<64>(g, dout.get(), qkv.get(), out.get(), lse.get(), B, T, NH, D.get(), stream);
        else flash_backward<128>(g, dout.get(), qkv.get(), out.get(), lse.get(), B, T, NH, D.get(), stream);
    };
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

    // The current path.
    const size_t n_att = attention_att_elements(B, NH, T), scratch_bytes = attention_scratch_bytes(B, T, C, NH);
    DeviceBuffer<floatX> att(n_att), l_out(n_out), l_dqkv(n_qkv);
    DeviceBuffer<char> scratch(scratch_bytes);
    auto lfwd = [&] {
        attention_forward(lt, l_out.get(), att.get(), qkv.get(), B, T, C, NH, scratch.get(), scratch_bytes, stream);
    };
    auto lbwd = [&] {
        attention_backward(lt, l_dqkv.get(), dout.get(), qkv.get(), att.get(), B, T, C, NH, scratch.get(),
                           scratch_bytes, stream);
    };
    poison(l_out.get(), l_out.bytes());
    poison(l_dqkv.get(), l_dqkv.bytes());
    lfwd();
    lbwd();
    cudaCheck(cudaDeviceSynchronize());
    const auto hl_out = to_host(l_out.get(), n_out), hl_dqkv = to_host(l_dqkv.get(), n_qkv);

    const int64_t nrows = int64_t(B) * T;
    size_t nan_flash = 0, nan_llmc = 0;
    for (float v : h_lse) nan_flash += std::isnan(v) ? 1 : 0;
    double err_flash = 0, err_llmc = 0;
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
        const auto hr_out = to_host(r_out.get(), n_out), hr_dqkv = to_host(r_dqkv.get(), n_qkv);
        const auto hr_lse = to_host(r_lse.get(), n_lse);
        double lse_err = 0;
        for (size_t i = 0; i < n_lse; i++) lse_err = std::max(lse_err, double(std::fabs(h_lse[i] - hr_lse[i])));
        check(lse_err < 2e-2, "lse max abs error", lse_err);
        const double eo = rel_err(h_out, hr_out, nrows, C, 0, C, &nan_flash);
        check(eo < kTolOut, "out rel err", eo);
        err_flash = eo;
        err_llmc = rel_err(hl_out, hr_out, nrows, C, 0, C, &nan_llmc);
        const char* names[3] = {"dq rel err", "dk rel err", "dv rel err"};
        for (int part = 0; part < 3; part++) {
            const double e = rel_err(h_dqkv, hr_dqkv, nrows, 3 * C, part, C, &nan_flash);
            check(e < kTolGrad, names[part], e);
            err_flash = std::max(err_flash, e);
            err_llmc = std::max(err_llmc, rel_err(hl_dqkv, hr_dqkv, nrows, 3 * C, part, C, &nan_llmc));
        }
    } else {
        err_flash = rel_err(h_out, hl_out, nrows, C, 0, C, &nan_flash);
        for (int part = 0; part < 3; part++) {
            err_flash = std::max(err_flash, rel_err(h_dqkv, hl_dqkv, nrows, 3 * C, part, C, &nan_flash));
        }
        check(err_flash < kTolVsLlmc, "flash vs llmc rel err", err_flash);
    }
    check(nan_flash == 0, "NaN (unwritten or invalid) elements in flash out/dqkv/lse", double(nan_flash));

    Row fr{s.str(), "flash", -1, -1, n_lse * sizeof(float) + flash_scratch_bytes(B, T, NH), err_flash,
           det ? "yes" : "NO"};
    Row lr{s.str(), "llmc (cuBLASLt)", -1, -1, n_att * sizeof(floatX) + scratch_bytes, with_ref ? err_llmc : -1,
           "-"};
    if (timed) {
        fr.fwd_ms = time_ms([&] { fwd(out.get()); }, stream);
        fr.bwd_ms = time_ms([&] { bwd(dqkv.get()); }, stream);
        lr.fwd_ms = time_ms(lfwd, stream);
        lr.bwd_ms = time_ms(lbwd, stream);
    }
    rows.push_back(fr);
    rows.push_back(lr);
    return failures;
}

}  // namespace

int main() {
    return run_main([] {
        if (cuda_device_count() == 0) fail(kExitCuda, "attention_lab needs a GPU");
        CublasLt lt;
        std::vector<Row> rows;
        int failures = 0;
        const Shape checked[] = {{1, 1, 12, 64},   {2, 37, 12, 64},  {1, 64, 12, 64},  {3, 65, 4, 64},
                                 {2, 1000, 12, 64}, {1, 1024, 12, 64}, {16, 1024, 12, 64}, {1, 1, 6, 128},
                                 {2, 37, 6, 128},   {2, 1000, 6, 128}, {1, 1024, 6, 128}};
        for (const Shape& s : checked) failures += run_case(lt, s, true, false, rows);
        const Shape timed[] = {{16, 1024, 12, 64}, {64, 1024, 12, 64}};
        for (const Shape& s : timed) failures += run_case(lt, s, false, true, rows);

        std::printf("\n%-24s | %-16s | %8s | %8s | %12s | %11s | %s\n", "shape", "impl", "fwd ms", "bwd ms",
                    "saved bytes", "max rel err", "deterministic");
        for (const Row& r : rows) {
            char f[32] = "-", b[32] = "-", e[32] = "-";
            if (r.fwd_ms >= 0) std::snprintf(f, sizeof(f), "%.3f", r.fwd_ms);
            if (r.bwd_ms >= 0) std::snprintf(b, sizeof(b), "%.3f", r.bwd_ms);
            if (r.err >= 0) std::snprintf(e, sizeof(e), "%.2e", r.err);
            std::printf("%-24s | %-16s | %8s | %8s | %12zu | %11s | %s\n", r.shape.c_str(), r.impl.c_str(), f, b,
                        r.saved, e, r.det.c_str());
        }
        std::printf("max rel err: against the fp32 reference (rows with '-' times), else flash against llmc.\n");
        std::printf("saved bytes: flash = lse + D scratch; llmc = att + scratch (both also keep qkv and out).\n");
        std::printf("%s: %d failed check(s)\n", failures == 0 ? "PASS" : "FAIL", failures);
        return failures == 0 ? 0 : 1;
    });
}
