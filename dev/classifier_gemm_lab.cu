/*
classifier_gemm_lab: can our own Hopper matmul run the classifier's forward (logits = lnf wte^T: N = B*T
rows, Vp columns, C = 768) near cuBLASLt's speed, and with the exponential epilogue of the lab notes'
design ("Y = e^(x - x_t)") beat cuBLASLt's matmul followed by the softmax pass?

  build/classifier_gemm_lab [--rows 65536] [--C 768] [--V 50257] [--Vp 50304] [--reps 30] [--rounds 3]
                            [--check-rows 48] [--seed 1]

The kernel (sm_90a only): persistent, one block per SM, three warpgroups. The first is the producer: one
thread asks the tensor memory accelerator (TMA) for each k-step's tiles of lnf (128 rows x 64) and wte
(256 rows x 64) into a ring of kStages shared-memory stages, in the 128-byte swizzle wgmma reads, each
stage's arrival counted by an mbarrier ("full") and its release by another ("empty"). The other two are
consumers: each multiplies its 64 of the tile's 128 rows by the 256 wte rows with
wgmma.m64n256k16 (bf16 operands from shared memory, 128 fp32 accumulators a thread), keeping one
k-step's products in flight while it frees the stage before. Tiles are 128 x 256 of the output, visited
in groups of kGroupM row blocks (each group's lnf stays in L2 while wte streams past once). The epilogue
rounds to bf16, writes each warpgroup's 64 x 256 block into shared memory with stmatrix (in the swizzle
the output's TMA map reads) and stores it with TMA (columns past Vp are clipped), so the next tile's
loads are already under way while it runs.

Two epilogues:
  plain: the logits in bf16, as cuBLASLt's matmul writes them (the speed to match).
  exp:   Y = e^(x - c) in bf16 with c = x_t, the row's target logit (lnf_i . wte[t_i], computed before the
         matmul by a small kernel: one warp a row), the target's column and the padded columns stored as 0,
         and each 256-column tile's row sums of the other columns in fp32 (partial[n_tile][row]); a third
         kernel adds them in a fixed order: s = 1 + tail, the loss log(s). Nothing is atomic, so the
         results repeat bit for bit. The backward would read Y where it reads dlogits today (lab notes).

Checks (exit 1 on a failure): on --check-rows rows (first, last, and seeded ones between), every column
against a double-precision reference on the host: plain within one bf16 step of the exact logit (plus
1e-4); exp within 2^-8 + 1e-4 relative of e^(x - c) using the device's c, 0 at the target and padded
columns; s within 1e-4 relative; the loss against the reference and against fused_classifier's loss on
cuBLASLt's logits. Over the whole tensor, our plain logits against cuBLASLt's: how many equal bit for
bit, and how many differ by more than one bf16 step (must be none).

Timing: per call, CUDA events around each run, --reps runs back to back per variant and --rounds rounds
with the variants interleaved; medians over all runs after the first round. Variants: cuBLASLt's matmul
alone (matmul_forward, what the trainer runs), cuBLASLt + fused_classifier (the trainer's classifier
forward with dlogits written), our plain matmul, our exp path (target logits + matmul + row sums). Short
bursts run at higher clocks than a power-capped training step (performance.md, "the power cap").

Inputs: lnf uniform in [-1.73, 1.73] (unit variance, like a LayerNorm output), wte uniform in [-0.1,
0.1] with the padded rows zero (logits of standard deviation ~1.6), targets uniform in [0, V).

Does not provide: the backward (Y times wte and its transpose, the row scale and the target term),
ping-pong consumers (the tensor cores idle during the epilogue), TMA multicast within a cluster, any other
shape than rows a multiple of 128 and C a multiple of 64.
*/
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes through the runtime)
#include <cudaTypedefs.h>

#include "llmc/classifier.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flags.h"
#include "llmc/flash_common.cuh"
#include "llmc/matmul.cuh"
#include "llmc/rand.h"
#include "llmc/utils.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CLS_GEMM_DEVICE 1
#else
#define CLS_GEMM_DEVICE 0
#endif

using namespace llmc;

namespace {

using flash_common::pack_bf16;
using flash_common::smem_addr;

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
constexpr float kLog2e = 1.4426950408889634f;

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

// Descriptor of a K-major operand in the 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes
// apart (the leading offset is unused for this layout).
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

// d (64 x 256 per warpgroup, fp32) += A (64 x 16, K-major in shared memory) * B (256 x 16, K-major), or
// d = A * B when scale_d is 0.
__device__ inline void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if CLS_GEMM_DEVICE
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
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

// Tile t of the order: groups of kGroupM row blocks, the row block fastest inside a group.
__device__ inline void tile_coords(int t, int m_tiles, int n_tiles, int& m_blk, int& n_blk) {
    const int per_group = kGroupM * n_tiles;
    const int group = t / per_group, within = t % per_group;
    const int first = group * kGroupM, rows = min(kGroupM, m_tiles - first);
    m_blk = first + within % rows;
    n_blk = within / rows;
}

// Exp = false: out = bf16(lnf wte^T). Exp = true: out = bf16(e^(x - c_row)), 0 at the row's target and at
// columns >= V; partial[n_tile * M + row] = the tile's sum of the other columns (fp32).
template <bool Exp>
__global__ void __launch_bounds__(kThreads, 1)
    cls_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const __grid_constant__ CUtensorMap map_out, int M, int Vp, int V, int K, const float* offsets,
                    const int* targets, float* partial) {
#if CLS_GEMM_DEVICE
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

        // Epilogue. This thread's accumulators: rows r0 = 16 warp + lane / 4 and r0 + 8 of the warpgroup's
        // 64, columns 8 j + 2 (lane % 4) + {0, 1} for j = 0..31 (d[4j], d[4j+1] on r0; d[4j+2], d[4j+3] on r0 + 8).
        const int r0 = 16 * warp + lane / 4;
        const int row0 = mb * kBM + cw * 64 + r0, row1 = row0 + 8;
        const int col_base = nb * kBN + 2 * (lane % 4);
        if constexpr (Exp) {
            const float c0 = offsets[row0] * kLog2e, c1 = offsets[row1] * kLog2e;
            const int t0 = targets[row0], t1 = targets[row1];
            float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
            for (int j = 0; j < 32; j++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = col_base + 8 * j + e;
                    const float y0 = (col < V && col != t0) ? exp2f(fmaf(d[4 * j + e], kLog2e, -c0)) : 0.0f;
                    const float y1 = (col < V && col != t1) ? exp2f(fmaf(d[4 * j + 2 + e], kLog2e, -c1)) : 0.0f;
                    s0 += y0;
                    s1 += y1;
                    d[4 * j + e] = y0;
                    d[4 * j + 2 + e] = y1;
                }
            }
            s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
            s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
            s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
            s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
            if (lane % 4 == 0) {
                partial[int64_t(nb) * M + row0] = s0;
                partial[int64_t(nb) * M + row1] = s1;
            }
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

// c[row] = lnf[row] . wte[targets[row]] in fp32 (one warp a row).
__global__ void target_logit_kernel(float* c, const floatX* lnf, const floatX* wte, const int* targets, int M, int K) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= M) return;
    const floatX* x = lnf + int64_t(row) * K;
    const floatX* w = wte + int64_t(targets[row]) * K;
    float acc = 0.0f;
    for (int k = lane; k < K; k += 32) acc = fmaf(float(x[k]), float(w[k]), acc);
    for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) c[row] = acc;
}

// s = 1 + the tiles' partial sums in tile order; loss = log(s).
__global__ void row_sums_kernel(float* sums, float* losses, const float* partial, int M, int n_tiles) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= M) return;
    float s = 0.0f;
    for (int n = 0; n < n_tiles; n++) s += partial[int64_t(n) * M + row];
    sums[row] = 1.0f + s;
    losses[row] = logf(1.0f + s);
}

// Over two bf16 tensors: how many elements are equal bit for bit, and how many differ by more than one
// bf16 step of the larger magnitude plus 1e-4 (near 0 the two fp32 sums' own rounding decides).
__global__ void compare_kernel(unsigned long long* counts, const floatX* a, const floatX* b, int64_t n) {
    unsigned long long same = 0, far = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float x = float(a[i]), y = float(b[i]);
        same += (__bfloat16_as_ushort(a[i]) == __bfloat16_as_ushort(b[i]));
        far += fabsf(x - y) > fmaxf(fabsf(x), fabsf(y)) * (1.0f / 128.0f) * 1.01f + 1e-4f;
    }
    atomicAdd(&counts[0], same);
    atomicAdd(&counts[1], far);
}

// ------------------------------------------------------------------------------------------------
// Host side.

struct Options {
    int rows = 65536;
    int C = 768;
    int V = 50257;
    int Vp = 50304;
    int reps = 30;
    int rounds = 3;
    int check_rows = 48;
    int seed = 1;
};

CUtensorMap tensor_map_2d(const floatX* base, int64_t cols, int64_t rows, int box_cols, int box_rows,
                          const char* what) {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
            fail(kExitCuda, "classifier_gemm_lab: the driver has no cuTensorMapEncodeTiled");
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    CUtensorMap map{};
    const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
    const cuuint64_t strides[1] = {cuuint64_t(cols) * sizeof(floatX)};
    const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)}, elem_strides[2] = {1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<floatX*>(base), dims, strides, box,
                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fail(kExitCuda, "classifier_gemm_lab: cuTensorMapEncodeTiled for %s (%lld x %lld) failed with CUresult %d",
             what, (long long)rows, (long long)cols, int(r));
    }
    return map;
}

void fill_uniform(std::vector<floatX>& h, uint64_t seed, float amp) {
    const uint64_t key = rng_key(seed, 0);
    for (size_t i = 0; i < h.size(); i++) {
        const float u = float(rng_u32(key, i) >> 8) * (1.0f / 16777216.0f);
        h[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * amp);
    }
}

float median(std::vector<float> v) {
    if (v.empty()) return 0.0f;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        Flags flags("classifier_gemm_lab",
                    "Our Hopper matmul for the classifier's forward (plain, and with the exp epilogue) against "
                    "cuBLASLt and cuBLASLt + fused_classifier.");
        flags.add("", "rows", &o.rows, "rows N = B*T (a multiple of 128)", 128, 1 << 22)
            .add("", "C", &o.C, "channels (a multiple of 64)", 64, 1 << 14)
            .add("", "V", &o.V, "vocabulary size", 1, 1 << 22)
            .add("", "Vp", &o.Vp, "padded vocabulary size (a multiple of 64, >= V)", 64, 1 << 22)
            .add("", "reps", &o.reps, "timed runs per variant per round", 1, 100000)
            .add("", "rounds", &o.rounds, "rounds (the first is warm-up)", 2, 1000)
            .add("", "check-rows", &o.check_rows, "rows checked against the host's double-precision reference", 2,
                 1 << 20)
            .add("", "seed", &o.seed, "seed of the inputs", 0, 1 << 30);
        if (!flags.parse(argc, argv)) return 0;
        std::fputs(flags.settings_table().c_str(), stdout);
        if (o.rows % kBM != 0) fail(kExitUsage, "classifier_gemm_lab: --rows %d is not a multiple of %d", o.rows, kBM);
        if (o.C % kBK != 0) fail(kExitUsage, "classifier_gemm_lab: --C %d is not a multiple of %d", o.C, kBK);
        if (o.Vp % 64 != 0 || o.V > o.Vp) fail(kExitUsage, "classifier_gemm_lab: need V <= Vp and Vp a multiple of 64");
        int dev = 0, major = 0, minor = 0, sms = 0;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        cudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
#if !defined(LLMC_SM90A)
        fail(kExitUsage, "classifier_gemm_lab: built without sm_90a (make GPU_ARCH=90)");
#endif
        if (major != 9 || minor != 0) fail(kExitUsage, "classifier_gemm_lab: needs a compute 9.0 GPU (Hopper)");
        cudaDeviceProp prop{};
        cudaCheck(cudaGetDeviceProperties(&prop, dev));
        std::printf("GPU: %s, %d SMs\n", prop.name, sms);

        const int M = o.rows, K = o.C, V = o.V, Vp = o.Vp;
        const int n_tiles = (Vp + kBN - 1) / kBN;
        std::vector<floatX> h_lnf(size_t(M) * K), h_wte(size_t(Vp) * K);
        fill_uniform(h_lnf, uint64_t(o.seed) * 3 + 1, 1.7320508f);
        fill_uniform(h_wte, uint64_t(o.seed) * 3 + 2, 0.1f);
        for (size_t i = size_t(V) * K; i < h_wte.size(); i++) h_wte[i] = __float2bfloat16_rn(0.0f);
        std::vector<int> h_targets(M);
        {
            const uint64_t key = rng_key(uint64_t(o.seed) * 3 + 3, 0);
            for (int i = 0; i < M; i++) h_targets[i] = int(rng_u32(key, uint64_t(i)) % uint32_t(V));
        }
        DeviceBuffer<floatX> lnf(h_lnf.size()), wte(h_wte.size()), ours(size_t(M) * Vp), lt_out(size_t(M) * Vp);
        DeviceBuffer<int> targets(M);
        DeviceBuffer<float> c(M), partial(size_t(n_tiles) * M), sums(M), losses(M), lt_losses(M);
        DeviceBuffer<unsigned long long> counts(2);
        cudaCheck(cudaMemcpy(lnf.get(), h_lnf.data(), lnf.bytes(), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(wte.get(), h_wte.data(), wte.bytes(), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(targets.get(), h_targets.data(), targets.bytes(), cudaMemcpyHostToDevice));

        const CUtensorMap map_a = tensor_map_2d(lnf.get(), K, M, kBK, kBM, "lnf");
        const CUtensorMap map_b = tensor_map_2d(wte.get(), K, Vp, kBK, kBN, "wte");
        const CUtensorMap map_out = tensor_map_2d(ours.get(), Vp, M, kOutBox, 64, "out");
        cudaCheck(cudaFuncSetAttribute(cls_gemm_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
        cudaCheck(cudaFuncSetAttribute(cls_gemm_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
        const int tiles = (M / kBM) * n_tiles;
        const int grid = std::min(sms, tiles);
        cudaStream_t stream = nullptr;
        CublasLt lt;
        const float dloss = 1.0f / float(M);

        auto run_plain = [&] {
            cls_gemm_kernel<false><<<grid, kThreads, kSmem, stream>>>(map_a, map_b, map_out, M, Vp, V, K, nullptr,
                                                                      nullptr, nullptr);
            cudaCheckLaunch();
        };
        auto run_exp = [&] {
            target_logit_kernel<<<(M + 7) / 8, 256, 0, stream>>>(c.get(), lnf.get(), wte.get(), targets.get(), M, K);
            cudaCheckLaunch();
            cls_gemm_kernel<true><<<grid, kThreads, kSmem, stream>>>(map_a, map_b, map_out, M, Vp, V, K, c.get(),
                                                                     targets.get(), partial.get());
            cudaCheckLaunch();
            row_sums_kernel<<<(M + 255) / 256, 256, 0, stream>>>(sums.get(), losses.get(), partial.get(), M, n_tiles);
            cudaCheckLaunch();
        };
        auto run_lt = [&] { matmul_forward(lt, lt_out.get(), lnf.get(), wte.get(), nullptr, M, K, Vp, stream); };
        auto run_lt_ce = [&] {
            run_lt();
            fused_classifier(lt_out.get(), lt_losses.get(), targets.get(), dloss, M, V, Vp, true, stream);
        };

        // ---- checks
        bool ok = true;
        std::vector<int> check;
        {
            const int n = std::min(o.check_rows, M);
            const uint64_t key = rng_key(uint64_t(o.seed) * 3 + 4, 0);
            for (int i = 0; i < n; i++) {
                if (i < n / 3) check.push_back(i);
                else if (i < 2 * n / 3) check.push_back(M - 1 - (i - n / 3));
                else check.push_back(int(rng_u32(key, uint64_t(i)) % uint32_t(M)));
            }
        }
        std::vector<std::vector<double>> exact(check.size(), std::vector<double>(Vp));
#pragma omp parallel for schedule(dynamic)
        for (int ci = 0; ci < int(check.size()); ci++) {
            const floatX* x = h_lnf.data() + size_t(check[ci]) * K;
            std::vector<double> xd(K);
            for (int k = 0; k < K; k++) xd[k] = double(float(x[k]));
            for (int v = 0; v < Vp; v++) {
                const floatX* w = h_wte.data() + size_t(v) * K;
                double acc = 0.0;
                for (int k = 0; k < K; k++) acc += xd[k] * double(float(w[k]));
                exact[ci][v] = acc;
            }
        }
        std::vector<floatX> row(Vp);
        auto fetch_row = [&](const floatX* base, int r) {
            cudaCheck(cudaMemcpy(row.data(), base + size_t(r) * Vp, size_t(Vp) * sizeof(floatX), cudaMemcpyDeviceToHost));
        };

        // plain
        cudaCheck(cudaMemset(ours.get(), 0xff, ours.bytes()));  // NaN poison: an unwritten element shows
        run_plain();
        run_lt();
        cudaCheck(cudaDeviceSynchronize());
        {
            double worst = 0.0;
            long bad = 0;
            for (size_t ci = 0; ci < check.size(); ci++) {
                fetch_row(ours.get(), check[ci]);
                for (int v = 0; v < Vp; v++) {
                    const double e = exact[ci][v], g = double(float(row[v]));
                    const double tol = std::fabs(e) / 128.0 + 1e-4;
                    const double err = std::fabs(g - e);
                    if (!(err <= tol)) bad++;
                    worst = std::max(worst, std::isfinite(err) ? err / tol : 1e30);
                }
            }
            std::printf("plain: %zu rows x %d columns against the double reference: %ld outside one bf16 step + 1e-4 "
                        "(worst %.3f of the tolerance)\n",
                        check.size(), Vp, bad, worst);
            ok = ok && bad == 0;
            cudaCheck(cudaMemset(counts.get(), 0, counts.bytes()));
            compare_kernel<<<sms * 8, 256>>>(counts.get(), ours.get(), lt_out.get(), int64_t(M) * Vp);
            cudaCheckLaunch();
            unsigned long long hc[2];
            cudaCheck(cudaMemcpy(hc, counts.get(), sizeof(hc), cudaMemcpyDeviceToHost));
            const double total = double(M) * Vp;
            std::printf("plain against cuBLASLt's logits, all %.0f elements: %.4f%% bitwise equal, %llu more than one bf16 "
                        "step + 1e-4 apart\n",
                        total, 100.0 * double(hc[0]) / total, hc[1]);
            ok = ok && hc[1] == 0;
        }
        // exp
        cudaCheck(cudaMemset(ours.get(), 0xff, ours.bytes()));
        run_exp();
        run_lt_ce();
        cudaCheck(cudaDeviceSynchronize());
        {
            std::vector<float> hc(M), hs(M), hl(M), hll(M);
            cudaCheck(cudaMemcpy(hc.data(), c.get(), c.bytes(), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(hs.data(), sums.get(), sums.bytes(), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(hl.data(), losses.get(), losses.bytes(), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(hll.data(), lt_losses.get(), lt_losses.bytes(), cudaMemcpyDeviceToHost));
            long bad_y = 0, bad_zero = 0, bad_s = 0;
            double worst_y = 0.0, worst_s = 0.0, worst_loss = 0.0, worst_lt_loss = 0.0;
            for (size_t ci = 0; ci < check.size(); ci++) {
                const int r = check[ci], t = h_targets[r];
                fetch_row(ours.get(), r);
                double s_ref = 1.0, lse_max = -1e300;
                for (int v = 0; v < V; v++) lse_max = std::max(lse_max, exact[ci][v]);
                double lse = 0.0;
                for (int v = 0; v < V; v++) lse += std::exp(exact[ci][v] - lse_max);
                const double loss_ref = std::log(lse) + lse_max - exact[ci][t];
                for (int v = 0; v < Vp; v++) {
                    const double g = double(float(row[v]));
                    if (v == t || v >= V) {
                        if (g != 0.0) bad_zero++;
                        continue;
                    }
                    const double e = std::exp(exact[ci][v] - double(hc[r]));
                    s_ref += e;
                    const double err = std::fabs(g - e), tol = e * (1.0 / 256.0 + 1e-4) + 1e-30;
                    if (!(err <= tol)) bad_y++;
                    worst_y = std::max(worst_y, std::isfinite(err) ? err / tol : 1e30);
                }
                const double es = std::fabs(double(hs[r]) - s_ref) / s_ref;
                if (!(es <= 1e-4)) bad_s++;
                worst_s = std::max(worst_s, es);
                worst_loss = std::max(worst_loss, std::fabs(double(hl[r]) - loss_ref));
                worst_lt_loss = std::max(worst_lt_loss, std::fabs(double(hll[r]) - loss_ref));
            }
            std::printf("exp: %zu rows: %ld values outside 2^-8 + 1e-4 of e^(x - c) (worst %.3f of the tolerance), %ld "
                        "target or padded columns not 0, %ld row sums outside 1e-4 relative (worst %.2e)\n",
                        check.size(), bad_y, worst_y, bad_zero, bad_s, worst_s);
            std::printf("loss against the double reference, worst of the checked rows: ours %.3e, fused_classifier on "
                        "cuBLASLt's bf16 logits %.3e\n",
                        worst_loss, worst_lt_loss);
            double worst_pair = 0.0;
            for (int r = 0; r < M; r++) worst_pair = std::max(worst_pair, double(std::fabs(hl[r] - hll[r])));
            std::printf("loss, ours against fused_classifier's, all %d rows: worst difference %.3e\n", M, worst_pair);
            ok = ok && bad_y == 0 && bad_zero == 0 && bad_s == 0 && worst_loss < 1e-3;
        }
        if (!ok) {
            std::printf("FAILED: a check above is outside its tolerance\n");
            return 1;
        }

        // ---- timing
        struct Variant {
            const char* name;
            std::function<void()> run;
            std::vector<float> ms;
        };
        std::vector<Variant> variants;
        variants.push_back({"cuBLASLt matmul", run_lt, {}});
        variants.push_back({"cuBLASLt + fused_classifier", run_lt_ce, {}});
        variants.push_back({"ours, plain", run_plain, {}});
        variants.push_back({"ours, exp (+ target logits, row sums)", run_exp, {}});
        std::vector<cudaEvent_t> ev(size_t(2 * o.reps));
        for (auto& e : ev) cudaCheck(cudaEventCreate(&e));
        for (int round = 0; round < o.rounds; round++) {
            for (auto& v : variants) {
                for (int i = 0; i < o.reps; i++) {
                    cudaCheck(cudaEventRecord(ev[2 * i], stream));
                    v.run();
                    cudaCheck(cudaEventRecord(ev[2 * i + 1], stream));
                }
                cudaCheck(cudaEventSynchronize(ev[2 * o.reps - 1]));
                if (round == 0) continue;
                for (int i = 0; i < o.reps; i++) {
                    float ms = 0.0f;
                    cudaCheck(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
                    v.ms.push_back(ms);
                }
            }
        }
        for (auto& e : ev) cudaCheck(cudaEventDestroy(e));
        const double flop = 2.0 * M * double(Vp) * K;
        std::printf("\n%-40s %10s %10s %10s\n", "variant", "median ms", "TFLOP/s", "vs cuBLASLt");
        const float base = median(variants[0].ms);
        for (auto& v : variants) {
            const float m = median(v.ms);
            std::printf("%-40s %10.3f %10.1f %10.3f\n", v.name, m, flop / (m * 1e-3) / 1e12, m / base);
        }
        return 0;
    });
}
