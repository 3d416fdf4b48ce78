/*
The fused classifier: softmax, cross-entropy loss and its gradient in one pass over the logits, with
the meanings of crossentropy_forward/crossentropy_backward in llmc/gpt2_cpu.h.

Provides:
  fused_classifier: for each of the N = B*T rows of logits (N,Vp) bf16, one block computes the softmax
                    over the first V columns (never the Vp - V padded ones) in fp32, writes the loss
                    -log p[target] = logsumexp - logit[target] to losses[row] (fp32, overwritten), and,
                    when write_dlogits is set, overwrites the row in place with dlogits = (softmax -
                    onehot(target)) * dloss, padded columns set to 0. With write_dlogits off the logits
                    are left untouched (evaluation). No probabilities are stored.
  mean_loss:        the mean of N per-row losses, summed by one block in a fixed order (fp64 partial
                    sums), written to a device float; deterministic.
Block reductions use fixed trees, so the results are bitwise reproducible. Vp must be a multiple of 8.
Targets are trusted: the data loader validates them.

Does not provide: the classifier matmul (matmul.cuh, logits = lnf @ wte^T), label smoothing, or
ignored positions (every row has a target).
*/
#pragma once

#include <cstdint>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

namespace llmc {

constexpr int kClassifierBlock = 512;

namespace detail {

// Running (max, sum of exp(x - max)) of two parts combined into one.
__device__ inline void softmax_merge(float& m, float& s, float m2, float s2) {
    const float nm = fmaxf(m, m2);
    if (nm == -INFINITY) return;  // both parts empty
    s = s * expf(m - nm) + s2 * expf(m2 - nm);
    m = nm;
}

}  // namespace detail

static __global__ void __launch_bounds__(kClassifierBlock)
    fused_classifier_kernel(floatX* logits, float* losses, const int* targets, float dloss, int V, int Vp,
                            bool write_dlogits) {
    __shared__ float warp_m[kClassifierBlock / kWarpSize], warp_s[kClassifierBlock / kWarpSize];
    __shared__ float row_m, row_s;
    const int64_t row = blockIdx.x;
    floatX* x = logits + row * Vp;
    const int target = targets[row];
    const float target_logit = float(x[target]);  // read by every thread before any thread overwrites x

    // Pass 1: each thread's running max and sum over its packs.
    float m = -INFINITY, s = 0.0f;
    for (int c = threadIdx.x * kPackX; c < V; c += kClassifierBlock * kPackX) {
        const PackX p = load128(x + c);
        float pm = -INFINITY;
        for (int k = 0; k < kPackX; k++) {
            if (c + k < V) pm = fmaxf(pm, float(p[k]));
        }
        float ps = 0.0f;
        for (int k = 0; k < kPackX; k++) {
            if (c + k < V) ps += expf(float(p[k]) - pm);
        }
        detail::softmax_merge(m, s, pm, ps);
    }
    // Fixed tree: lanes by xor butterfly (lane 0's result is used), then warp results in warp order.
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        detail::softmax_merge(m, s, m2, s2);
    }
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    if (lane == 0) {
        warp_m[warp] = m;
        warp_s[warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float bm = warp_m[0], bs = warp_s[0];
        for (int w = 1; w < kClassifierBlock / kWarpSize; w++) detail::softmax_merge(bm, bs, warp_m[w], warp_s[w]);
        row_m = bm;
        row_s = bs;
        losses[row] = logf(bs) + bm - target_logit;
    }
    __syncthreads();
    if (!write_dlogits) return;

    // Pass 2: the gradient in place.
    const float rm = row_m, rs = row_s;
    for (int c = threadIdx.x * kPackX; c < Vp; c += kClassifierBlock * kPackX) {
        PackX p = load128(x + c);
        for (int k = 0; k < kPackX; k++) {
            const int v = c + k;
            float g = 0.0f;
            if (v < V) g = (expf(float(p[k]) - rm) / rs - (v == target ? 1.0f : 0.0f)) * dloss;
            p[k] = __float2bfloat16_rn(g);
        }
        store128(x + c, p);
    }
}

// losses (N) = cross-entropy of each row of logits (N,Vp) against targets (N); with write_dlogits,
// logits is replaced by dloss * d(loss)/d(logits). dloss is the weight of each row's loss in the
// total, e.g. 1 / (B * T * gradient accumulation steps).
inline void fused_classifier(floatX* logits, float* losses, const int* targets, float dloss, int64_t N, int V, int Vp,
                             bool write_dlogits, cudaStream_t stream) {
    require_pack_multiple(Vp, "fused_classifier: Vp");
    require_aligned16(logits, "fused_classifier: logits");
    if (V < 1 || V > Vp) fail(kExitUsage, "fused_classifier: V=%d is not in [1, Vp=%d]", V, Vp);
    if (N == 0) return;
    fused_classifier_kernel<<<unsigned(N), kClassifierBlock, 0, stream>>>(logits, losses, targets, dloss, V, Vp,
                                                                          write_dlogits);
    cudaCheckLaunch();
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

}  // namespace llmc
