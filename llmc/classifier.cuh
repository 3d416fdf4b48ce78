/*
The fused classifier: softmax, cross-entropy loss and its gradient in one kernel over the logits, with
the meanings of crossentropy_forward/crossentropy_backward in cpu/gpt2_cpu.h.
  fused_classifier: per row of logits (N,Vp) bf16, one block: softmax over the first V columns in fp32,
      losses[row] = logsumexp - logit[target] (overwritten), and with write_dlogits the row overwritten
      by (softmax - onehot(target)) * dloss, padded columns 0. Without it the logits are untouched.
  mean_loss: the mean of N losses, in a fixed order (fp64 partials): deterministic.
  gather_positions: out (M,C) = rows positions[i] of inp, the classifier's input at the positions an
      evaluation scores (positions trusted).
The kernel is bound by memory and the exponentials: three passes (max, sum and loss, gradient) over a
row read from memory once (held in registers and shared memory up to 13 * 4096 columns), one ex2 per
exponential. Padded columns are -inf (gradient exactly 0). Fixed reduction trees, no atomics: bitwise
reproducible. Vp must be a multiple of 8; targets are trusted (the data loader checks them); sm_80+.
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
#error "llmc/classifier.cuh needs sm_80 or newer (cp.async): build with GPU_ARCH=80 or above"
#endif

namespace llmc {

constexpr int kClassifierBlock = 512;
// Thread t's packs are at columns 8t + j * kClassifierColumnStride, j = 0, 1, ...
constexpr int kClassifierColumnStride = kClassifierBlock * kPackX;
// How many 8-column packs a thread holds between the passes: in registers (two 512-thread blocks an SM
// leave 64 registers a thread) and in shared memory (40 KB a block, under the 48 KB static limit).
constexpr int kClassifierRegisterPacks = 8;
constexpr int kClassifierSharedPacks = 5;

namespace detail {

// e^(x - m) for x <= m by one ex2; x - m of bf16 values is exact in fp32 where it matters.
__device__ inline float exp_shifted(float x, float m) {
    return flash_common::exp2_fast((x - m) * flash_common::kLog2e);
}

// A pack of 8 bf16 logits as four 32-bit words (column 2i in the low half of word i).
struct alignas(16) LogitPack {
    uint32_t w[kPackX / 2];
};

__device__ inline float low_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ inline float high_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// kReadOnce: a streaming load (evict first), for data that will not be read again.
template <bool kReadOnce>
__device__ inline LogitPack load_logit_words(const floatX* p) {
    const int4* q = reinterpret_cast<const int4*>(p);
    const int4 raw = kReadOnce ? __ldcs(q) : *q;
    LogitPack out;
    memcpy(&out, &raw, sizeof(out));
    return out;
}

// 16 bytes from global to shared memory, bypassing registers; visible after copy_async_wait_all().
__device__ inline void copy16_async(void* shared, const void* global) {
    const uint32_t s = uint32_t(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(global) : "memory");
}

__device__ inline void copy_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Sets every column >= V of the pack at column c to -inf; a pack wholly past V need not have been loaded.
__device__ inline void mask_padded(LogitPack& p, int c, int V) {
    if (c + kPackX <= V) return;
    for (int i = 0; i < kPackX / 2; i++) {
        if (c + 2 * i >= V) {
            p.w[i] = 0xff80ff80u;  // -inf, -inf
        } else if (c + 2 * i + 1 >= V) {
            p.w[i] = (p.w[i] & 0xffffu) | 0xff800000u;
        }
    }
}

// The pack at column c of row x, masked; memory is read only when the pack holds a column < V.
__device__ inline LogitPack load_logit_pack(const floatX* x, int c, int V) {
    LogitPack p;
    if (c < V) p = load_logit_words<false>(x + c);
    mask_padded(p, c, V);
    return p;
}

__device__ inline float pack_max(const LogitPack& p) {
    __nv_bfloat162 h[kPackX / 2];
    memcpy(h, &p, sizeof(h));
    const __nv_bfloat162 m = __hmax2(__hmax2(h[0], h[1]), __hmax2(h[2], h[3]));  // exact; ignores NaN like fmaxf
    return fmaxf(__low2float(m), __high2float(m));
}

// Sum over the pack of e^(x - m), in a fixed tree.
__device__ inline float pack_exp_sum(const LogitPack& p, float m) {
    float e[kPackX];
    for (int i = 0; i < kPackX / 2; i++) {
        e[2 * i] = exp_shifted(low_bf16(p.w[i]), m);
        e[2 * i + 1] = exp_shifted(high_bf16(p.w[i]), m);
    }
    return ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
}

// The dlogits of pack p (column c) at columns c + 2i, c + 2i + 1: e^(x - m) * scale (= dloss / sum),
// minus dloss at the target. Padded columns give exactly 0.
__device__ inline float2 grad_pair(const LogitPack& p, int i, int c, float m, float scale, int target, float dloss) {
    float lo = exp_shifted(low_bf16(p.w[i]), m) * scale;
    float hi = exp_shifted(high_bf16(p.w[i]), m) * scale;
    if (unsigned(target - c) < unsigned(kPackX)) {
        if (c + 2 * i == target) lo -= dloss;
        if (c + 2 * i + 1 == target) hi -= dloss;
    }
    return make_float2(lo, hi);
}

// Writes the pack's dlogits (grad_pair) to out in bf16.
__device__ inline void store_grad_pack(floatX* out, const LogitPack& p, int c, float m, float scale, int target,
                                       float dloss) {
    uint32_t w[kPackX / 2];
    for (int i = 0; i < kPackX / 2; i++) {
        const float2 g = grad_pair(p, i, c, m, scale, target, dloss);
        const __nv_bfloat162 h = __floats2bfloat162_rn(g.x, g.y);
        memcpy(&w[i], &h, sizeof(h));
    }
    *reinterpret_cast<int4*>(out) = make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

// The maximum over a 1-D block (a multiple of 32 threads), given to every thread; all threads call it.
__device__ inline float block_max(float v) {
    __shared__ float partial[kWarpSize];
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < int(blockDim.x) / kWarpSize ? partial[lane] : -INFINITY;
    return warp_max(v);
}

}  // namespace detail

// One block per row: the first R packs in registers, the next S in shared memory, any more read in each
// pass.
template <int R, int S>
static __global__ void __launch_bounds__(kClassifierBlock, 2)
    fused_classifier_kernel(floatX* logits, float* losses, const int* targets, float dloss, int V, int Vp,
                            bool write_dlogits) {
    constexpr int kStride = kClassifierColumnStride;
    __shared__ detail::LogitPack stash[S > 0 ? S : 1][kClassifierBlock];  // [j][t]: conflict-free
    __shared__ float target_logit;
    const int64_t row = blockIdx.x;
    floatX* x = logits + row * Vp;
    // Read before any thread overwrites x: the writes come after the barriers of the reductions.
    if (threadIdx.x == 0) target_logit = float(x[targets[row]]);

    const int c0 = int(threadIdx.x) * kPackX;
    floatX* xt = x + c0;  // this thread's held packs are at constant offsets from here
    const int c_streamed = c0 + (R + S) * kStride;
    // A shared pack, masked (each thread reads only the slots it filled).
    const auto stashed = [&](int j) {
        detail::LogitPack p = stash[j][threadIdx.x];
        detail::mask_padded(p, c0 + (R + j) * kStride, V);
        return p;
    };

    // Pass 1, the row max. Every load of the held packs is issued before any is used.
#pragma unroll
    for (int j = 0; j < S; j++) {
        if (c0 + (R + j) * kStride < V) detail::copy16_async(&stash[j][threadIdx.x], xt + (R + j) * kStride);
    }
    detail::LogitPack held[R > 0 ? R : 1];
#pragma unroll
    for (int j = 0; j < R; j++) {
        if (c0 + j * kStride < V) held[j] = detail::load_logit_words<true>(xt + j * kStride);  // read once
    }
    if (S > 0) detail::copy_async_wait_all();
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < R; j++) {
        detail::mask_padded(held[j], c0 + j * kStride, V);
        m = fmaxf(m, detail::pack_max(held[j]));
    }
#pragma unroll
    for (int j = 0; j < S; j++) m = fmaxf(m, detail::pack_max(stashed(j)));
#pragma unroll 1  // one pack at a time: registers are scarce
    for (int c = c_streamed; c < V; c += kStride) m = fmaxf(m, detail::pack_max(detail::load_logit_pack(x, c, V)));
    m = detail::block_max(m);

    // Pass 2, the sum of e^(x - m) (every thread adds its packs in the same order) and the loss.
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < R; j++) s += detail::pack_exp_sum(held[j], m);
#pragma unroll
    for (int j = 0; j < S; j++) s += detail::pack_exp_sum(stashed(j), m);
#pragma unroll 1
    for (int c = c_streamed; c < V; c += kStride) s += detail::pack_exp_sum(detail::load_logit_pack(x, c, V), m);
    s = block_sum(s);  // the same fixed tree in every thread, so every thread holds the same sum
    if (threadIdx.x == 0) losses[row] = (m - target_logit) + logf(s);
    if (!write_dlogits) return;

    // Pass 3, the gradient, in place (each thread overwrites only the packs it read).
    const float scale = dloss / s;
    const int target = targets[row];
    const auto store = [&](int c, const detail::LogitPack& p) {
        detail::store_grad_pack(x + c, p, c, m, scale, target, dloss);
    };
#pragma unroll
    for (int j = 0; j < R; j++) {
        if (c0 + j * kStride < Vp) store(c0 + j * kStride, held[j]);
    }
#pragma unroll
    for (int j = 0; j < S; j++) {
        if (c0 + (R + j) * kStride < Vp) store(c0 + (R + j) * kStride, stashed(j));
    }
#pragma unroll 1
    for (int c = c_streamed; c < Vp; c += kStride) store(c, detail::load_logit_pack(x, c, V));
}

namespace detail {
// The kernel's launch, a block a row: the held packs only where a row has more than one pack a thread.
inline void launch_classifier(floatX* logits, float* losses, const int* targets, float dloss, int64_t N, int V, int Vp,
                              bool write_dlogits, cudaStream_t stream) {
    constexpr int R = kClassifierRegisterPacks, S = kClassifierSharedPacks;
    using Kernel = decltype(&fused_classifier_kernel<0, 0>);
    const Kernel kernels[2] = {fused_classifier_kernel<0, 0>, fused_classifier_kernel<R, S>};
    kernels[Vp > kClassifierColumnStride]<<<unsigned(N), kClassifierBlock, 0, stream>>>(logits, losses, targets, dloss,
                                                                                        V, Vp, write_dlogits);
    cudaCheckLaunch();
}
}  // namespace detail

// losses (N) = cross-entropy of each row of logits (N,Vp) against targets; with write_dlogits, logits is
// replaced by dloss * d(loss)/d(logits) (dloss: the row's weight in the total, e.g. 1 / (B T accum)).
inline void fused_classifier(floatX* logits, float* losses, const int* targets, float dloss, int64_t N, int V, int Vp,
                             bool write_dlogits, cudaStream_t stream) {
    require_pack_multiple(Vp, "fused_classifier: Vp");
    require_aligned16(logits, "fused_classifier: logits");
    if (V < 1 || V > Vp) fail(kExitUsage, "fused_classifier: V=%d is not in [1, Vp=%d]", V, Vp);
    if (N == 0) return;
    detail::launch_classifier(logits, losses, targets, dloss, N, V, Vp, write_dlogits, stream);
}

constexpr int kMeanLossBlock = 1024;

static __global__ void __launch_bounds__(kMeanLossBlock) mean_loss_kernel(float* out, const float* losses, int64_t N) {
    __shared__ double partial[kMeanLossBlock];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < N; i += kMeanLossBlock) s += double(losses[i]);
    partial[threadIdx.x] = s;
    __syncthreads();
    for (int stride = kMeanLossBlock / 2; stride > 0; stride /= 2) {
        if (int(threadIdx.x) < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = float(partial[0] / double(N));
}

// *mean = (sum of losses[0..N)) / N, on the device; read it on the host when it is needed.
inline void mean_loss(float* mean, const float* losses, int64_t N, cudaStream_t stream) {
    if (N < 1) fail(kExitUsage, "mean_loss: N=%lld", (long long)N);
    mean_loss_kernel<<<1, kMeanLossBlock, 0, stream>>>(mean, losses, N);
    cudaCheckLaunch();
}

// ----------------------------------------------------------------------------------------------------

static __global__ void gather_positions_kernel(floatX* out, const floatX* inp, const int* positions, int64_t M,
                                               int C) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    if (i >= M * C) return;
    const int64_t row = i / C;
    const int c = int(i % C);
    store128(out + i, load128(inp + int64_t(positions[row]) * C + c));
}

// out (M,C) row i = inp (N,C) row positions[i] (in [0, N), unchecked). C a multiple of 8, buffers 16-byte
// aligned, not overlapping.
inline void gather_positions(floatX* out, const floatX* inp, const int* positions, int64_t M, int C,
                             cudaStream_t stream) {
    require_pack_multiple(C, "gather_positions: C");
    require_aligned16(out, "gather_positions: out");
    require_aligned16(inp, "gather_positions: inp");
    if (M == 0) return;
    const int block = 256;
    gather_positions_kernel<<<unsigned(ceil_div<int64_t>(M * C / kPackX, block)), block, 0, stream>>>(
        out, inp, positions, M, C);
    cudaCheckLaunch();
}

}  // namespace llmc
