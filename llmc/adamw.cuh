/*
The AdamW update on the GPU for mixed precision (fp32 master weights and moments, bf16 gradients in,
bf16 parameters out): the same update as GPT2::update in cpu/gpt2_cpu.h. adamw_update() is one launch
over a table of (offset, size, decayed) ranges (AdamWTensors, from the model). The bf16 parameter is the
new master weight rounded stochastically, keyed by (seed, step) and the element's flat index, so a step
is reproducible, also sharded (ZeRO-1: state_offset) and after a resume. grad_scale is a device pointer
(null: 1; NaN: skip the update, adamw_guard), so clipping needs no host synchronisation.
*/
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

namespace llmc {

struct AdamWSettings {
    float learning_rate = 0.0f;
    float beta1 = 0.9f;
    float beta2 = 0.95f;
    float eps = 1e-8f;
    float weight_decay = 0.0f;  // applied only to tensors flagged decayed
    bool stochastic_rounding = true;  // false: the bf16 parameter is the master weight rounded to nearest
};

// Passed to the kernel by value, so it stays small.
struct AdamWTensors {
    static constexpr int kMax = 32;
    int count = 0;
    int64_t offset[kMax] = {};
    int64_t numel[kMax] = {};
    int decayed[kMax] = {};

    void add(int64_t tensor_offset, int64_t tensor_numel, bool tensor_decayed) {
        if (count == kMax) fail(kExitUsage, "AdamWTensors: more than %d tensors", kMax);
        offset[count] = tensor_offset;
        numel[count] = tensor_numel;
        decayed[count] = tensor_decayed ? 1 : 0;
        count++;
    }
    int64_t max_numel() const {
        int64_t m = 0;
        for (int i = 0; i < count; i++) m = numel[i] > m ? numel[i] : m;
        return m;
    }
};

// The table of every tensor in `infos`, each with an offset, numel and decayed (GPT-2's param_tensors()).
template <class Infos>
AdamWTensors adamw_tensors(const Infos& infos) {
    AdamWTensors t;
    for (const auto& info : infos) t.add(info.offset, info.numel, info.decayed);
    return t;
}

// The part of each tensor that lies in [begin, end), with its decay flag: a ZeRO-1 rank's table.
inline AdamWTensors restrict_tensors(const AdamWTensors& all, int64_t begin, int64_t end) {
    AdamWTensors t;
    for (int i = 0; i < all.count; i++) {
        const int64_t b = all.offset[i] > begin ? all.offset[i] : begin;
        const int64_t e = all.offset[i] + all.numel[i] < end ? all.offset[i] + all.numel[i] : end;
        if (e > b) t.add(b, e - b, all.decayed[i] != 0);
    }
    return t;
}

constexpr int kAdamWBlock = 256;
constexpr int kAdamWMaxBlocksPerTensor = 4096;

struct AdamWStepArgs {
    float lr, beta1, beta2, bias_correction1, bias_correction2, eps;
    uint64_t rng_key;
    int stochastic;
};

// One element's update: moments and master weight in place, the new bf16 parameter returned.
__device__ inline floatX adamw_element(float g, float& m, float& v, float& w, float wd, const AdamWStepArgs& a,
                                       int64_t idx) {
    m = a.beta1 * m + (1.0f - a.beta1) * g;
    v = a.beta2 * v + (1.0f - a.beta2) * g * g;
    const float m_hat = m / a.bias_correction1, v_hat = v / a.bias_correction2;
    w -= a.lr * (m_hat / (sqrtf(v_hat) + a.eps) + wd * w);
    return a.stochastic ? stochastic_round_bf16(w, rng_u32(a.rng_key, uint64_t(idx))) : __float2bfloat16_rn(w);
}

// vec: offsets and buffers aligned so a thread takes 4 neighbouring elements in 128/64-bit accesses.
static __global__ void __launch_bounds__(kAdamWBlock)
    adamw_kernel(floatX* params, float* master, float* m, float* v, const floatX* grads, AdamWTensors tensors,
                 AdamWStepArgs args, float weight_decay, const float* grad_scale, int64_t state_offset, int vec) {
    const int t = blockIdx.y;
    const int64_t offset = tensors.offset[t], n = tensors.numel[t];
    const float wd = tensors.decayed[t] ? weight_decay : 0.0f;
    const float scale = grad_scale != nullptr ? *grad_scale : 1.0f;
    if (scale != scale) return;  // NaN: the step guard skips this update (adamw_guard)
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
    if (vec) {
        for (int64_t q = first; q < n / 4; q += stride) {
            const int64_t idx = offset + 4 * q, sidx = idx - state_offset;
            float4 mq = *reinterpret_cast<const float4*>(m + sidx), vq = *reinterpret_cast<const float4*>(v + sidx);
            float4 wq = *reinterpret_cast<const float4*>(master + sidx);
            const uint2 graw = *reinterpret_cast<const uint2*>(grads + idx);
            floatX gx[4];
            memcpy(gx, &graw, sizeof(graw));
            floatX px[4];
            px[0] = adamw_element(float(gx[0]) * scale, mq.x, vq.x, wq.x, wd, args, idx);
            px[1] = adamw_element(float(gx[1]) * scale, mq.y, vq.y, wq.y, wd, args, idx + 1);
            px[2] = adamw_element(float(gx[2]) * scale, mq.z, vq.z, wq.z, wd, args, idx + 2);
            px[3] = adamw_element(float(gx[3]) * scale, mq.w, vq.w, wq.w, wd, args, idx + 3);
            *reinterpret_cast<float4*>(m + sidx) = mq;
            *reinterpret_cast<float4*>(v + sidx) = vq;
            *reinterpret_cast<float4*>(master + sidx) = wq;
            uint2 praw;
            memcpy(&praw, px, sizeof(praw));
            *reinterpret_cast<uint2*>(params + idx) = praw;
        }
    }
    for (int64_t i = (vec ? n / 4 * 4 : 0) + first; i < n; i += stride) {
        const int64_t idx = offset + i, sidx = idx - state_offset;
        float mi = m[sidx], vi = v[sidx], w = master[sidx];
        params[idx] = adamw_element(float(grads[idx]) * scale, mi, vi, w, wd, args, idx);
        m[sidx] = mi;
        v[sidx] = vi;
        master[sidx] = w;
    }
}

// The step guard: a step whose norm or any loss is not finite, or whose mean loss is above loss_limit,
// sets the scale adamw_kernel reads to NaN ("leave everything as it is"), on the device, so every rank
// takes the same decision without a synchronisation.
static __global__ void adamw_guard_kernel(float* grad_scale, const float* norm, const float* losses, int n,
                                          float loss_limit) {
    bool bad = !isfinite(*norm);
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        bad = bad || !isfinite(losses[i]);
        sum += losses[i];
    }
    if (bad || (n > 0 && sum / float(n) > loss_limit)) *grad_scale = NAN;
}

inline void adamw_guard(float* grad_scale, const float* norm, const float* losses, int n, float loss_limit,
                        cudaStream_t stream) {
    adamw_guard_kernel<<<1, 1, 0, stream>>>(grad_scale, norm, losses, n, loss_limit);
    cudaCheckLaunch();
}

// Whether adamw_update() takes 4 elements per thread for these buffers and table (else one; same bits).
inline bool adamw_four_wide(const floatX* params, const float* master, const float* m, const float* v,
                            const floatX* grads, const AdamWTensors& tensors, int64_t state_offset = 0) {
    bool vec = state_offset % 4 == 0;
    for (const void* p : {static_cast<const void*>(params), static_cast<const void*>(master),
                          static_cast<const void*>(m), static_cast<const void*>(v), static_cast<const void*>(grads)}) {
        vec = vec && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    }
    for (int i = 0; i < tensors.count; i++) vec = vec && tensors.offset[i] % 4 == 0;
    return vec;
}

// One AdamW step (step from 1) over the table's tensors: params, grads (bf16) and master, m, v (fp32) are
// flat buffers; master, m and v start at flat index state_offset (a ZeRO-1 shard's start, else 0).
inline void adamw_update(floatX* params, float* master, float* m, float* v, const floatX* grads,
                         const AdamWTensors& tensors, const AdamWSettings& s, int step, uint64_t seed,
                         const float* grad_scale, cudaStream_t stream, int64_t state_offset = 0) {
    if (step < 1) fail(kExitUsage, "adamw_update: step %d, AdamW steps count from 1", step);
    if (tensors.count == 0) return;
    // The same float expressions as the CPU reference, so both see identical corrections.
    const float bias_correction1 = 1.0f - std::pow(s.beta1, float(step));
    const float bias_correction2 = 1.0f - std::pow(s.beta2, float(step));
    const bool vec = adamw_four_wide(params, master, m, v, grads, tensors, state_offset);
    const int64_t blocks = ceil_div<int64_t>(vec ? ceil_div<int64_t>(tensors.max_numel(), 4) : tensors.max_numel(),
                                             kAdamWBlock);
    if (blocks == 0) return;
    const dim3 grid(unsigned(blocks < kAdamWMaxBlocksPerTensor ? blocks : kAdamWMaxBlocksPerTensor),
                    unsigned(tensors.count));
    const AdamWStepArgs args{s.learning_rate, s.beta1, s.beta2, bias_correction1, bias_correction2, s.eps,
                             rng_key(seed, uint64_t(step)), s.stochastic_rounding ? 1 : 0};
    adamw_kernel<<<grid, kAdamWBlock, 0, stream>>>(params, master, m, v, grads, tensors, args, s.weight_decay,
                                                   grad_scale, state_offset, vec ? 1 : 0);
    cudaCheckLaunch();
}

}  // namespace llmc
