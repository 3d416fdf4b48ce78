/*
Causal multi-head self-attention on the GPU, with cpu/gpt2_cpu.h's argument meanings: qkv (B,T,3C) holds
q, k, v with head h at columns h*HS of each; out (B,T,C); scale 1/sqrt(HS).
  attention_forward, attention_backward: HS 64 and 128 run flash attention (llmc/flash_attention.cuh,
      or on sm_90a Hopper for HS 64 llmc/flash_attention_sm90.cuh); any other head size the cuBLASLt
      path below. attention_uses_flash(HS) says which.
  attention_saved_bytes / attention_scratch_bytes: per layer, the state kept for backward (flash: lse;
      cuBLASLt: att (B,NH,T,Tp) bf16) and the scratch of either direction.
  attention_forward_cublaslt, attention_backward_cublaslt: permute, batched matmuls with a causal
      softmax in fp32, permute back; Tp = T rounded up to a multiple of 8. Memory quadratic in T.
      With groups (B,T) (forward only; evaluation) position t sees t2 <= t only where groups[t2] is 0
      or groups[t]: a shared context and several continuations in one row (mc_eval.h).
dqkv is OVERWRITTEN and must not alias the inputs. Checked, with an error naming the function: shapes,
HS a multiple of 8, saved and scratch sizes, 16-byte aligned pointers. Deterministic (no atomics); the
two paths agree within bf16 rounding. Backward's option: bias_sums (64-row blocks' column sums, where the
wgmma kernels run).
*/
#pragma once

#include <cmath>
#include <cstdint>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flash_attention.cuh"
#include "llmc/flash_attention_sm90.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

namespace llmc {

// The head sizes flash attention has kernels for; attention_forward/backward use it for these.
inline bool attention_uses_flash(int HS) { return HS == 64 || HS == 128; }

// Row length of the cuBLASLt path's attention matrices (att, and the scores in scratch).
inline int attention_padded_len(int T) { return round_up(T, 8); }

namespace detail {

// Scratch of both directions of the cuBLASLt path; forward uses q, k, v, y and the fp32 scores.
struct AttentionScratch {
    floatX *q = nullptr, *k = nullptr, *v = nullptr, *y = nullptr;  // y doubles as dy in backward
    floatX *dq = nullptr, *dk = nullptr, *dv = nullptr;
    float* scores = nullptr;       // preatt in forward, datt in backward: (B,NH,T,Tp)
    floatX* dpreatt = nullptr;     // (B,NH,T,Tp)
    size_t total = 0;
};

inline AttentionScratch attention_scratch_layout(void* base, int B, int T, int C, int NH) {
    const size_t nc = align256(size_t(B) * size_t(T) * size_t(C) * sizeof(floatX));
    const size_t square = size_t(B) * size_t(NH) * size_t(T) * size_t(attention_padded_len(T));
    const size_t scores = align256(square * sizeof(float)), dpre = align256(square * sizeof(floatX));
    AttentionScratch s;
    s.total = 7 * nc + scores + dpre;
    if (base != nullptr) {
        char* p = static_cast<char*>(base);
        floatX** slots[7] = {&s.q, &s.k, &s.v, &s.y, &s.dq, &s.dk, &s.dv};
        for (int i = 0; i < 7; i++) *slots[i] = reinterpret_cast<floatX*>(p + size_t(i) * nc);
        s.scores = reinterpret_cast<float*>(p + 7 * nc);
        s.dpreatt = reinterpret_cast<floatX*>(p + 7 * nc + scores);
    }
    return s;
}

inline void check_attention_args(const char* fn, int B, int T, int C, int NH) {
    if (B < 1 || T < 1 || NH < 1 || C < 1) {
        fail(kExitUsage, "%s: B=%d T=%d C=%d NH=%d must all be at least 1", fn, B, T, C, NH);
    }
    if (C % NH != 0) fail(kExitUsage, "%s: C=%d is not a multiple of NH=%d", fn, C, NH);
    if ((C / NH) % kPackX != 0) {
        fail(kExitUsage, "%s: head size HS = C/NH = %d/%d = %d is not a multiple of %d", fn, C, NH, C / NH, kPackX);
    }
}

inline void check_size(const char* fn, const char* what, size_t have, size_t need, int B, int T, int C, int NH) {
    if (have < need) {
        fail(kExitUsage, "%s: %s of %zu bytes, B=%d T=%d C=%d NH=%d needs %zu", fn, what, have, B, T, C, NH, need);
    }
}

}  // namespace detail

// Bytes of the cuBLASLt path's saved att (B,NH,T,Tp) bf16 and of its scratch.
inline size_t attention_cublaslt_saved_bytes(int B, int NH, int T) {
    return size_t(B) * size_t(NH) * size_t(T) * size_t(attention_padded_len(T)) * sizeof(floatX);
}

inline size_t attention_cublaslt_scratch_bytes(int B, int NH, int T, int HS) {
    return detail::attention_scratch_layout(nullptr, B, T, NH * HS, NH).total;
}

// Bytes of the state attention_forward saves for attention_backward, for one layer.
inline size_t attention_saved_bytes(int B, int NH, int T, int HS) {
    return attention_uses_flash(HS) ? flash_lse_bytes(B, NH, T) : attention_cublaslt_saved_bytes(B, NH, T);
}

// Bytes of the scratch attention_forward and attention_backward need (the larger of the two).
inline size_t attention_scratch_bytes(int B, int NH, int T, int HS) {
    return attention_uses_flash(HS) ? flash_scratch_bytes(B, NH, T) : attention_cublaslt_scratch_bytes(B, NH, T, HS);
}

constexpr int kAttentionBlock = 256;
constexpr int kAttentionRowsPerBlock = kAttentionBlock / kWarpSize;

// Where element i of a (B,NH,T,HS) tensor sits in a (B,T,...) one with `row` elements a (b, t) row and
// head h at h * HS.
__device__ inline int64_t attention_row_offset(int64_t i, int T, int NH, int HS, int64_t row) {
    const int d = int(i % HS);
    const int t = int((i / HS) % T);
    const int h = int((i / (int64_t(HS) * T)) % NH);
    const int b = int(i / (int64_t(HS) * T * NH));
    return (int64_t(b) * T + t) * row + int64_t(h) * HS + d;
}

// qkv (B,T,3,NH,HS) -> q, k, v (B,NH,T,HS); one thread per 8 elements of each.
static __global__ void attention_split_qkv_kernel(floatX* q, floatX* k, floatX* v, const floatX* qkv, int B, int T,
                                                  int NH, int HS) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    const int64_t C = int64_t(NH) * HS;
    if (i >= int64_t(B) * T * C) return;
    const floatX* src = qkv + attention_row_offset(i, T, NH, HS, 3 * C);
    store128(q + i, load128(src));
    store128(k + i, load128(src + C));
    store128(v + i, load128(src + 2 * C));
}

// (B,NH,T,HS) <-> (B,T,NH,HS): to_heads moves a (B,T,C) tensor into heads, else back.
static __global__ void attention_heads_kernel(floatX* dst, const floatX* src, int B, int T, int NH, int HS,
                                              bool to_heads) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;  // index in (B,NH,T,HS)
    const int64_t C = int64_t(NH) * HS;
    if (i >= int64_t(B) * T * C) return;
    const int64_t j = attention_row_offset(i, T, NH, HS, C);  // index in (B,T,NH,HS)
    if (to_heads) {
        store128(dst + i, load128(src + j));
    } else {
        store128(dst + j, load128(src + i));
    }
}

// dq, dk, dv (B,NH,T,HS) -> dqkv (B,T,3,NH,HS).
static __global__ void attention_merge_dqkv_kernel(floatX* dqkv, const floatX* dq, const floatX* dk, const floatX* dv,
                                                   int B, int T, int NH, int HS) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    const int64_t C = int64_t(NH) * HS;
    if (i >= int64_t(B) * T * C) return;
    floatX* dst = dqkv + attention_row_offset(i, T, NH, HS, 3 * C);
    store128(dst, load128(dq + i));
    store128(dst + C, load128(dk + i));
    store128(dst + 2 * C, load128(dv + i));
}

// One warp per row (b, h, t) of the scores: att[t2] = softmax over the visible t2 (t2 <= t, and with
// groups (B,T) only those of group 0 or of t's group), 0 elsewhere up to Tp.
static __global__ void __launch_bounds__(kAttentionBlock)
    attention_softmax_kernel(floatX* att, const float* preatt, const int* groups, int64_t rows, int T, int NH,
                             int Tp) {
    const int64_t row = int64_t(blockIdx.x) * kAttentionRowsPerBlock + threadIdx.x / kWarpSize;
    if (row >= rows) return;
    const int lane = threadIdx.x % kWarpSize;
    const int t = int(row % T);
    const int* g = groups != nullptr ? groups + (row / (int64_t(NH) * T)) * T : nullptr;  // this b's row
    const int gt = g != nullptr ? g[t] : 0;
    auto visible = [&](int t2) { return t2 <= t && (g == nullptr || g[t2] == 0 || g[t2] == gt); };
    const float* x = preatt + row * Tp;
    floatX* a = att + row * Tp;
    float m = -INFINITY;
    for (int t2 = lane; t2 <= t; t2 += kWarpSize) {
        if (visible(t2)) m = fmaxf(m, x[t2]);
    }
    m = warp_max(m);
    float sum = 0.0f;
    for (int t2 = lane; t2 <= t; t2 += kWarpSize) {
        if (visible(t2)) sum += expf(x[t2] - m);
    }
    sum = warp_sum(sum);
    for (int t2 = lane; t2 < Tp; t2 += kWarpSize) {
        a[t2] = __float2bfloat16_rn(visible(t2) ? expf(x[t2] - m) / sum : 0.0f);
    }
}

// One warp per row: dpreatt[t2] = scale * att[t2] * (datt[t2] - sum_j att[j] * datt[j]) for t2 <= t.
static __global__ void __launch_bounds__(kAttentionBlock)
    attention_softmax_backward_kernel(floatX* dpreatt, const floatX* att, const float* datt, int64_t rows, int T,
                                      int Tp, float scale) {
    const int64_t row = int64_t(blockIdx.x) * kAttentionRowsPerBlock + threadIdx.x / kWarpSize;
    if (row >= rows) return;
    const int lane = threadIdx.x % kWarpSize;
    const int t = int(row % T);
    const floatX* a = att + row * Tp;
    const float* da = datt + row * Tp;
    floatX* dp = dpreatt + row * Tp;
    float dot = 0.0f;
    for (int t2 = lane; t2 <= t; t2 += kWarpSize) dot += float(a[t2]) * da[t2];
    dot = warp_sum(dot);
    for (int t2 = lane; t2 < Tp; t2 += kWarpSize) {
        dp[t2] = __float2bfloat16_rn(t2 <= t ? scale * float(a[t2]) * (da[t2] - dot) : 0.0f);
    }
}

inline unsigned attention_pack_blocks(int B, int T, int C, int block) {
    return unsigned(ceil_div<int64_t>(int64_t(B) * T * C / kPackX, block));
}

// out (B,T,C) and att (B,NH,T,Tp) from qkv (B,T,3C); groups (B,T) device int32 or null (causal).
inline void attention_forward_cublaslt(const CublasLt& lt, floatX* out, floatX* att, const floatX* qkv, int B, int T,
                                       int C, int NH, void* scratch, size_t scratch_bytes, cudaStream_t stream,
                                       const int* groups = nullptr) {
    const char* fn = "attention_forward_cublaslt";
    detail::check_attention_args(fn, B, T, C, NH);
    const detail::AttentionScratch s = detail::attention_scratch_layout(scratch, B, T, C, NH);
    detail::check_size(fn, "scratch", scratch_bytes, s.total, B, T, C, NH);
    require_aligned16_each(fn, {{"out", out}, {"att", att}, {"qkv", qkv}, {"scratch", scratch}});
    const int HS = C / NH, Tp = attention_padded_len(T), BNH = B * NH;
    const int64_t head = int64_t(T) * HS, square = int64_t(T) * Tp, rows = int64_t(BNH) * T;
    const int block = 256;
    attention_split_qkv_kernel<<<attention_pack_blocks(B, T, C, block), block, 0, stream>>>(s.q, s.k, s.v, qkv, B, T,
                                                                                            NH, HS);
    cudaCheckLaunch();
    const float scale = 1.0f / sqrtf(float(HS));
    gemm(lt, stream, T, T, HS, GemmOperand{s.q, HS, false, head}, GemmOperand{s.k, HS, true, head}, s.scores,
         CUDA_R_32F, Tp, square, BNH, scale, 0.0f);
    attention_softmax_kernel<<<unsigned(ceil_div<int64_t>(rows, kAttentionRowsPerBlock)), kAttentionBlock, 0,
                               stream>>>(att, s.scores, groups, rows, T, NH, Tp);
    cudaCheckLaunch();
    gemm(lt, stream, T, HS, T, GemmOperand{att, Tp, false, square}, GemmOperand{s.v, HS, false, head}, s.y,
         CUDA_R_16BF, HS, head, BNH, 1.0f, 0.0f);
    attention_heads_kernel<<<attention_pack_blocks(B, T, C, block), block, 0, stream>>>(out, s.y, B, T, NH, HS, false);
    cudaCheckLaunch();
}

// dqkv (B,T,3C) from dout (B,T,C), the forward's input qkv and its att. dqkv must not alias the inputs.
inline void attention_backward_cublaslt(const CublasLt& lt, floatX* dqkv, const floatX* dout, const floatX* qkv,
                                        const floatX* att, int B, int T, int C, int NH, void* scratch,
                                        size_t scratch_bytes, cudaStream_t stream) {
    const char* fn = "attention_backward_cublaslt";
    detail::check_attention_args(fn, B, T, C, NH);
    const detail::AttentionScratch s = detail::attention_scratch_layout(scratch, B, T, C, NH);
    detail::check_size(fn, "scratch", scratch_bytes, s.total, B, T, C, NH);
    require_aligned16_each(fn, {{"dqkv", dqkv}, {"dout", dout}, {"qkv", qkv}, {"att", att}, {"scratch", scratch}});
    const int HS = C / NH, Tp = attention_padded_len(T), BNH = B * NH;
    const int64_t head = int64_t(T) * HS, square = int64_t(T) * Tp, rows = int64_t(BNH) * T;
    const int block = 256;
    floatX* dy = s.y;
    attention_split_qkv_kernel<<<attention_pack_blocks(B, T, C, block), block, 0, stream>>>(s.q, s.k, s.v, qkv, B, T,
                                                                                            NH, HS);
    cudaCheckLaunch();
    attention_heads_kernel<<<attention_pack_blocks(B, T, C, block), block, 0, stream>>>(dy, dout, B, T, NH, HS, true);
    cudaCheckLaunch();
    gemm(lt, stream, T, T, HS, GemmOperand{dy, HS, false, head}, GemmOperand{s.v, HS, true, head}, s.scores,
         CUDA_R_32F, Tp, square, BNH, 1.0f, 0.0f);
    gemm(lt, stream, T, HS, T, GemmOperand{att, Tp, true, square}, GemmOperand{dy, HS, false, head}, s.dv, CUDA_R_16BF,
         HS, head, BNH, 1.0f, 0.0f);
    const float scale = 1.0f / sqrtf(float(HS));
    attention_softmax_backward_kernel<<<unsigned(ceil_div<int64_t>(rows, kAttentionRowsPerBlock)), kAttentionBlock, 0,
                                        stream>>>(s.dpreatt, att, s.scores, rows, T, Tp, scale);
    cudaCheckLaunch();
    gemm(lt, stream, T, HS, T, GemmOperand{s.dpreatt, Tp, false, square}, GemmOperand{s.k, HS, false, head}, s.dq,
         CUDA_R_16BF, HS, head, BNH, 1.0f, 0.0f);
    gemm(lt, stream, T, HS, T, GemmOperand{s.dpreatt, Tp, true, square}, GemmOperand{s.q, HS, false, head}, s.dk,
         CUDA_R_16BF, HS, head, BNH, 1.0f, 0.0f);
    attention_merge_dqkv_kernel<<<attention_pack_blocks(B, T, C, block), block, 0, stream>>>(dqkv, s.dq, s.dk, s.dv, B,
                                                                                             T, NH, HS);
    cudaCheckLaunch();
}

// out (B,T,C) from qkv (B,T,3C), saving attention_saved_bytes of state in `saved` for backward.
inline void attention_forward(const CublasLt& lt, floatX* out, void* saved, size_t saved_bytes, const floatX* qkv,
                              int B, int T, int C, int NH, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
    const char* fn = "attention_forward";
    detail::check_attention_args(fn, B, T, C, NH);
    const int HS = C / NH;
    detail::check_size(fn, "saved state", saved_bytes, attention_saved_bytes(B, NH, T, HS), B, T, C, NH);
    require_aligned16(saved, "attention_forward: saved");
    if (attention_uses_flash(HS)) {
        float* lse = static_cast<float*>(saved);
        if (HS == 64 && flash90_available()) {
            flash90_forward(out, lse, qkv, B, T, NH, stream);
        } else if (HS == 64) {
            flash_forward<64>(out, lse, qkv, B, T, NH, stream);
        } else {
            flash_forward<128>(out, lse, qkv, B, T, NH, stream);
        }
    } else {
        attention_forward_cublaslt(lt, out, static_cast<floatX*>(saved), qkv, B, T, C, NH, scratch, scratch_bytes,
                                   stream);
    }
}

// Whether this build's wgmma backward can add up the column sums for the shape (HS 64, T % 64 == 0,
// sm_90a build).
inline bool attention_backward_sums_shape(int T, int C, int NH) {
#if defined(LLMC_SM90A)
    return T >= 1 && NH >= 1 && C % NH == 0 && C / NH == 64 && T % 64 == 0;
#else
    return false;
#endif
}
// Whether attention_backward can add up each 64-row block's column sums of dqkv as it stores it (the shape,
// and the device runs the wgmma kernels). bias_sums holds (B T / kAttentionSumRows, 3C) floats.
constexpr int kAttentionSumRows = flash90_detail::kRows;
inline bool attention_backward_sums_available(int B, int T, int C, int NH) {
    return B >= 1 && attention_backward_sums_shape(T, C, NH) && flash90_available();
}

// dqkv (B,T,3C), overwritten, from dout and the forward's qkv, out and saved state; no aliasing.
inline void attention_backward(const CublasLt& lt, floatX* dqkv, const floatX* dout, const floatX* qkv,
                               const floatX* out, const void* saved, size_t saved_bytes, int B, int T, int C, int NH,
                               void* scratch, size_t scratch_bytes, cudaStream_t stream, float* bias_sums = nullptr) {
    const char* fn = "attention_backward";
    detail::check_attention_args(fn, B, T, C, NH);
    const int HS = C / NH;
    detail::check_size(fn, "saved state", saved_bytes, attention_saved_bytes(B, NH, T, HS), B, T, C, NH);
    require_aligned16(saved, "attention_backward: saved");
    if (bias_sums != nullptr && !attention_backward_sums_available(B, T, C, NH)) {
        fail(kExitUsage, "%s: the bias column sums need head size 64, T a multiple of 64 and the sm_90a kernels "
             "(B=%d T=%d C=%d NH=%d)", fn, B, T, C, NH);
    }
    if (attention_uses_flash(HS)) {
        detail::check_size(fn, "scratch", scratch_bytes, flash_scratch_bytes(B, NH, T), B, T, C, NH);
        float* D = static_cast<float*>(scratch);
        const float* lse = static_cast<const float*>(saved);
        if (HS == 64 && flash90_available()) {
            flash90_backward(dqkv, dout, qkv, out, lse, B, T, NH, D, stream, bias_sums);
        } else if (HS == 64) {
            flash_backward<64>(dqkv, dout, qkv, out, lse, B, T, NH, D, stream);
        } else {
            flash_backward<128>(dqkv, dout, qkv, out, lse, B, T, NH, D, stream);
        }
    } else {
        attention_backward_cublaslt(lt, dqkv, dout, qkv, static_cast<const floatX*>(saved), B, T, C, NH, scratch,
                                    scratch_bytes, stream);
    }
}

}  // namespace llmc
