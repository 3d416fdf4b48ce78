/*
The embedding layer on the GPU, with cpu/gpt2_cpu.h's encoder_forward/encoder_backward meanings.
  encoder_forward:  out (B,T,C) = wte[inp[b,t]] + wpe[t] (or wpe[positions[b,t]], unchecked), in fp32
                    and rounded once.
  encoder_backward: dwte[v] += dout over the positions holding token v, dwpe[t] += dout over b.
                    Deterministic without atomics: positions sorted by token (CUB's stable radix sort),
                    each run of equal tokens summed in a fixed order by its first position.
  encoder_backward_scratch_bytes: its scratch (queries CUB).
C must be a multiple of 8. Token ids are trusted (the data loader validates them).
*/
#pragma once

#include <cstdint>

#include <cub/device/device_radix_sort.cuh>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

namespace llmc {

static __global__ void encoder_forward_kernel(floatX* out, const int* inp, const floatX* wte, const floatX* wpe,
                                              const int* positions, int64_t N, int T, int C) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    if (i >= N * C) return;
    const int64_t bt = i / C;
    const int c = int(i % C);
    const int t = positions != nullptr ? positions[bt] : int(bt % T);
    const PackX e = load128(wte + int64_t(inp[bt]) * C + c);
    const PackX p = load128(wpe + int64_t(t) * C + c);
    PackX o;
    for (int k = 0; k < kPackX; k++) o[k] = __float2bfloat16_rn(float(e[k]) + float(p[k]));
    store128(out + i, o);
}

inline void encoder_forward(floatX* out, const int* inp, const floatX* wte, const floatX* wpe, int B, int T, int C,
                            cudaStream_t stream, const int* positions = nullptr) {
    require_pack_multiple(C, "encoder_forward: C");
    const int64_t N = int64_t(B) * T;
    if (N == 0) return;
    const int block = 256;
    encoder_forward_kernel<<<unsigned(ceil_div<int64_t>(N * C / kPackX, block)), block, 0, stream>>>(
        out, inp, wte, wpe, positions, N, T, C);
    cudaCheckLaunch();
}

// ----------------------------------------------------------------------------------------------------

constexpr int kEncoderBackwardBlock = 256;  // 8 warps
constexpr int kEncoderBackwardWarps = kEncoderBackwardBlock / kWarpSize;
constexpr int kEncoderBackwardColumns = kWarpSize * kPackX;  // channels per block: a pack per lane

// Bits that hold every token id below Vp, so the radix sort does no more passes than needed.
inline int token_bits(int Vp) {
    int bits = 1;
    while (bits < 31 && (int64_t(1) << bits) < Vp) bits++;
    return bits;
}

namespace detail {

// Scratch layout: sorted tokens, positions in order, positions sorted by token, CUB's temporary storage.
struct EncoderScratch {
    unsigned* sorted_tokens = nullptr;
    int* positions = nullptr;
    int* sorted_positions = nullptr;
    void* cub_temp = nullptr;
    size_t cub_bytes = 0;
    size_t total = 0;
};

inline EncoderScratch encoder_scratch_layout(void* base, int N, int Vp) {
    EncoderScratch s;
    cudaCheck(cub::DeviceRadixSort::SortPairs(nullptr, s.cub_bytes, static_cast<const unsigned*>(nullptr),
                                              static_cast<unsigned*>(nullptr), static_cast<const int*>(nullptr),
                                              static_cast<int*>(nullptr), N, 0, token_bits(Vp)));
    const size_t ints = align256(size_t(N) * sizeof(int));
    s.total = 3 * ints + align256(s.cub_bytes);
    if (base != nullptr) {
        char* p = static_cast<char*>(base);
        s.sorted_tokens = reinterpret_cast<unsigned*>(p);
        s.positions = reinterpret_cast<int*>(p + ints);
        s.sorted_positions = reinterpret_cast<int*>(p + 2 * ints);
        s.cub_temp = p + 3 * ints;
    }
    return s;
}

}  // namespace detail

inline size_t encoder_backward_scratch_bytes(int B, int T, int Vp) {
    return detail::encoder_scratch_layout(nullptr, B * T, Vp).total;
}

static __global__ void iota_kernel(int* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i;
}

// Block (i, y): if sorted position i starts a run of equal tokens, sums dout over the run for the
// channels [y * 256, y * 256 + 256) and adds the sums to that token's row of dwte; otherwise it exits.
static __global__ void __launch_bounds__(kEncoderBackwardBlock)
    encoder_backward_wte_kernel(floatX* dwte, const floatX* dout, const unsigned* sorted_tokens,
                                const int* sorted_positions, int N, int C) {
    __shared__ float sums[kEncoderBackwardWarps][kEncoderBackwardColumns];
    const int start = blockIdx.x;
    const unsigned token = sorted_tokens[start];
    if (start > 0 && sorted_tokens[start - 1] == token) return;  // uniform over the block

    // The run is a prefix of what follows, so a block-wide count of matches finds its end.
    int end = start + 1;
    for (;;) {
        const int j = end + int(threadIdx.x);
        const int count = __syncthreads_count(j < N && sorted_tokens[j] == token);
        end += count;
        if (count < kEncoderBackwardBlock) break;
    }

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int c0 = blockIdx.y * kEncoderBackwardColumns + lane * kPackX;
    float acc[kPackX] = {};
    if (c0 < C) {
        for (int j = start + warp; j < end; j += kEncoderBackwardWarps) {
            const PackX d = load128(dout + int64_t(sorted_positions[j]) * C + c0);
            for (int k = 0; k < kPackX; k++) acc[k] += float(d[k]);
        }
    }
    for (int k = 0; k < kPackX; k++) sums[warp][lane * kPackX + k] = acc[k];
    __syncthreads();
    const int c = blockIdx.y * kEncoderBackwardColumns + threadIdx.x;
    if (c < C) {
        float s = 0.0f;
        for (int w = 0; w < kEncoderBackwardWarps; w++) s += sums[w][threadIdx.x];
        floatX* dst = dwte + int64_t(token) * C + c;
        *dst = __float2bfloat16_rn(float(*dst) + s);
    }
}

// One thread per (t, 8 channels), summing over b in order.
static __global__ void encoder_backward_wpe_kernel(floatX* dwpe, const floatX* dout, int B, int T, int C) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    if (i >= int64_t(T) * C) return;
    float acc[kPackX] = {};
    for (int b = 0; b < B; b++) {
        const PackX d = load128(dout + int64_t(b) * T * C + i);
        for (int k = 0; k < kPackX; k++) acc[k] += float(d[k]);
    }
    PackX w = load128(dwpe + i);
    for (int k = 0; k < kPackX; k++) w[k] = __float2bfloat16_rn(float(w[k]) + acc[k]);
    store128(dwpe + i, w);
}

// dwte (Vp,C) += per-token sums of dout (B,T,C); dwpe (maxT,C) += sums over b (rows t < T only).
// scratch: encoder_backward_scratch_bytes(B, T, Vp) bytes of device memory.
inline void encoder_backward(floatX* dwte, floatX* dwpe, const floatX* dout, const int* inp, int B, int T, int C,
                             int Vp, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
    require_pack_multiple(C, "encoder_backward: C");
    const int N = B * T;
    if (N == 0) return;
    detail::EncoderScratch s = detail::encoder_scratch_layout(scratch, N, Vp);
    if (scratch_bytes < s.total) {
        fail(kExitUsage, "encoder_backward: scratch of %zu bytes, B=%d T=%d Vp=%d needs %zu", scratch_bytes, B, T, Vp,
             s.total);
    }
    iota_kernel<<<unsigned(ceil_div(N, 256)), 256, 0, stream>>>(s.positions, N);
    cudaCheckLaunch();
    cudaCheck(cub::DeviceRadixSort::SortPairs(s.cub_temp, s.cub_bytes, reinterpret_cast<const unsigned*>(inp),
                                              s.sorted_tokens, s.positions, s.sorted_positions, N, 0, token_bits(Vp),
                                              stream));
    const dim3 grid(unsigned(N), unsigned(ceil_div(C, kEncoderBackwardColumns)));
    encoder_backward_wte_kernel<<<grid, kEncoderBackwardBlock, 0, stream>>>(dwte, dout, s.sorted_tokens,
                                                                          s.sorted_positions, N, C);
    cudaCheckLaunch();
    const int block = 256;
    encoder_backward_wpe_kernel<<<unsigned(ceil_div<int64_t>(int64_t(T) * C / kPackX, block)), block, 0, stream>>>(
        dwpe, dout, B, T, C);
    cudaCheckLaunch();
}

}  // namespace llmc
