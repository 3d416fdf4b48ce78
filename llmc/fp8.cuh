/*
FP8 building blocks (GPUs of compute capability 8.9 and 9.x: Ada, Hopper): per-tensor scaled casts from
bf16 and the cuBLASLt FP8 matmul. The model's FP8 mode (llmc/gpt2.cuh, the trainer's --fp8) is built on
them; docs/performance.md, "FP8 matmuls in the lab", measures them.

Formats: E4M3 (3 mantissa bits, largest 448) for activations and weights, E5M2 (2 bits, largest 57344)
for gradients. A tensor x is stored as q = fp8(x * scale) with scale = kMax / amax (amax = max |x|), so
its largest value lands on the format's largest, and the matmul multiplies by descale = 1 / scale. An
all-zero tensor gets scale 1. Conversions round to nearest and saturate to the finite range
(__NV_SATFINITE: never inf or NaN from a finite input).

Provides (each described where it is defined): Fp8Format<Fp8> (kMax, the cuBLASLt type), fp8_supported();
the amax (fp8_amax_fold, fp8_amax_batch; kernels that write a tensor fold their own with
fp8_record_amax, llmc/cuda_common.cuh); casts (fp8_cast, fp8_cast_transposed, fp8_cast_pair and
fp8_dgelu_cast_pair: row-major and transposed in one pass, the two K-major copies a gradient's FP8 dX and
dW read), fp8_transpose, fp8_dequantize; delayed scaling (fp8_delayed_scales, fp8_history_push); and
Fp8Gemm / fp8_matmul: D = (descale_p P)(descale_q Q)^T, both operands FP8 K-major ("TN", the only layout
Hopper's FP8 matmuls take), fp32 accumulation, bf16 or E4M3 D, with Fp8Epilogue's bias, GELU, GELU' or
accumulate. Every call is checked; casts run on `stream`. docs/design.md says why the kernels are shaped so.

Does not provide: the LayerNorm kernels' own E4M3 outputs (llmc/layernorm.cuh, LayerNormFp8Out), or an
FP8 output with the GELU-gradient epilogue (cuBLASLt has none).
*/
#pragma once

#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/gelu.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

namespace llmc {

template <class Fp8>
struct Fp8Format;
template <>
struct Fp8Format<__nv_fp8_e4m3> {
    static constexpr float kMax = 448.0f;
    static constexpr cudaDataType_t kType = CUDA_R_8F_E4M3;
    static constexpr __nv_fp8_interpretation_t kKind = __NV_E4M3;
    static constexpr const char* kName = "E4M3";
};
template <>
struct Fp8Format<__nv_fp8_e5m2> {
    static constexpr float kMax = 57344.0f;
    static constexpr cudaDataType_t kType = CUDA_R_8F_E5M2;
    static constexpr __nv_fp8_interpretation_t kKind = __NV_E5M2;
    static constexpr const char* kName = "E5M2";
};

inline bool fp8_supported() {
    if (cuda_device_count() == 0) return false;
    cudaDeviceProp prop{};
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    return prop.major * 10 + prop.minor >= 89;
}

// The scale that maps amax onto the format's largest value (1 for an all-zero tensor), on host and device.
template <class Fp8>
__host__ __device__ inline float fp8_scale(float amax) {
    return amax > 0.0f ? Fp8Format<Fp8>::kMax / amax : 1.0f;
}

// x * scale rounded to nearest, saturating to the finite range.
template <class Fp8>
__host__ __device__ inline __nv_fp8_storage_t fp8_quantize(float x, float scale) {
    return __nv_cvt_float_to_fp8(x * scale, __NV_SATFINITE, Fp8Format<Fp8>::kKind);
}

// The value of an FP8 byte.
template <class Fp8>
__host__ __device__ inline float fp8_value(__nv_fp8_storage_t b) {
    Fp8 v;
    v.__x = b;
    return float(v);
}

namespace detail {

constexpr int kFp8Grid = 1056, kFp8Block = 256;
constexpr int kFp8ByteTile = 64, kFp8ByteTileThreads = 256;  // fp8_transpose: 16 bytes a thread a tile
constexpr int kFp8TilesPerBlock = 2;  // fp8_transpose and fp8_cast_pair: row tiles a block, loaded together
// fp8_cast_pair's row tiles a block: one with the GELU gradient, whose two-tile kernel needs 96 registers
// (2 blocks an SM) where one tile needs about half.
constexpr int fp8_cast_pair_tiles(bool aux) { return aux ? 1 : kFp8TilesPerBlock; }

__global__ void fp8_amax_kernel(const floatX* x, int64_t n, unsigned int* amax_bits) {
    float m = 0.0f;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        m = fmaxf(m, fabsf(float(x[i])));
    }
    m = warp_max(m);
    if (threadIdx.x % kWarpSize == 0) atomicMax(amax_bits, __float_as_uint(m));
}

template <class Fp8>
__global__ void fp8_cast_kernel(__nv_fp8_storage_t* q, const floatX* x, int64_t n, const unsigned int* amax_bits,
                                float* descale) {
    const float scale = fp8_scale<Fp8>(__uint_as_float(*amax_bits));
    if (blockIdx.x == 0 && threadIdx.x == 0) *descale = 1.0f / scale;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        q[i] = fp8_quantize<Fp8>(float(x[i]), scale);
    }
}

// Eight values a thread: x 16-byte aligned, q 8-byte aligned, n a multiple of 8.
template <class Fp8>
__global__ void fp8_cast_packed_kernel(uint2* q, const floatX* x, int64_t packs, const unsigned int* amax_bits,
                                       float* descale) {
    const float scale = fp8_scale<Fp8>(__uint_as_float(*amax_bits));
    if (blockIdx.x == 0 && threadIdx.x == 0) *descale = 1.0f / scale;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
        const PackX p = load128(x + i * kPackX);
        uint32_t w[2] = {0, 0};
        for (int k = 0; k < kPackX; k++) w[k / 4] |= uint32_t(fp8_quantize<Fp8>(float(p[k]), scale)) << (8 * (k % 4));
        q[i] = make_uint2(w[0], w[1]);
    }
}

// The byte tiles of fp8_transpose and fp8_cast_pair: [row][word of 4 columns], padded.
using Fp8ByteTile = uint32_t[kFp8ByteTile][kFp8ByteTile / 4 + 1];

// The second half of a byte-tile transpose: the tile (rows r0.., columns c0.. of the source) goes to dst
// rows c0.., columns r0... Thread t takes the 4 x 4 bytes at tile rows 4 s.. (s = t % 16) and columns
// 4 q.. (q = t / 16): four 4-byte words read from shared memory, transposed with byte permutes, and
// written as 4 bytes to each of dst rows c0 + 4 q + j (16 threads write a dst row's 64 bytes).
// `vector`: 4-byte stores are aligned wherever the 4 bytes are all in range.
__device__ inline void fp8_store_tile_transposed(const Fp8ByteTile& tile, uint8_t* dst, int64_t ldd, int64_t r0,
                                                 int64_t c0, int64_t rows, int64_t cols, bool vector) {
    const int q = int(threadIdx.x) / 16, s = int(threadIdx.x) % 16;
    const uint32_t w0 = tile[4 * s][q], w1 = tile[4 * s + 1][q], w2 = tile[4 * s + 2][q], w3 = tile[4 * s + 3][q];
    // Byte b of word k is column 4 q + b of row 4 s + k; out[j] gathers byte j of the four words.
    const uint32_t lo01 = __byte_perm(w0, w1, 0x5140), lo23 = __byte_perm(w2, w3, 0x5140);
    const uint32_t hi01 = __byte_perm(w0, w1, 0x7362), hi23 = __byte_perm(w2, w3, 0x7362);
    const uint32_t out[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                             __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
    const int64_t r = r0 + 4 * s;
    if (r >= rows) return;
    for (int j = 0; j < 4; j++) {
        const int64_t c = c0 + 4 * q + j;  // dst row
        if (c >= cols) return;
        if (vector && r + 4 <= rows) {
            *reinterpret_cast<uint32_t*>(dst + c * ldd + r) = out[j];
        } else {
            for (int b = 0; b < 4 && r + b < rows; b++) dst[c * ldd + r + b] = uint8_t(out[j] >> (8 * b));
        }
    }
}

// kFp8TilesPerBlock 64 x 64 byte tiles (one below the other) per block of 256 threads: for each, thread t
// reads 16 bytes of src row r0 + t/4 (columns c0 + 16 (t%4) ..), all of them before any is stored, then
// the tiles go out through fp8_store_tile_transposed. `vector`: the caller checked that 16-byte loads and
// 4-byte stores are aligned wherever all their bytes are in range.
__global__ void __launch_bounds__(kFp8ByteTileThreads)
    fp8_transpose_kernel(uint8_t* dst, int64_t ldd, const uint8_t* src, int64_t rows, int64_t cols, bool vector) {
    __shared__ Fp8ByteTile tile[kFp8TilesPerBlock];
    const int64_t c0 = int64_t(blockIdx.x) * kFp8ByteTile;
    const int line = int(threadIdx.x) / 4, seg = int(threadIdx.x) % 4;
    uint32_t w[kFp8TilesPerBlock][4];
#pragma unroll
    for (int h = 0; h < kFp8TilesPerBlock; h++) {
        const int64_t r = (int64_t(blockIdx.y) * kFp8TilesPerBlock + h) * kFp8ByteTile + line, c = c0 + 16 * seg;
        for (int k = 0; k < 4; k++) w[h][k] = 0;
        if (r >= rows) continue;
        if (vector && c + 16 <= cols) {
            const uint4 v = *reinterpret_cast<const uint4*>(src + r * cols + c);
            w[h][0] = v.x, w[h][1] = v.y, w[h][2] = v.z, w[h][3] = v.w;
        } else {
            for (int k = 0; k < 16 && c + k < cols; k++) {
                w[h][k / 4] |= uint32_t(src[r * cols + c + k]) << (8 * (k % 4));
            }
        }
    }
#pragma unroll
    for (int h = 0; h < kFp8TilesPerBlock; h++) {
        for (int k = 0; k < 4; k++) tile[h][line][4 * seg + k] = w[h][k];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < kFp8TilesPerBlock; h++) {
        const int64_t r0 = (int64_t(blockIdx.y) * kFp8TilesPerBlock + h) * kFp8ByteTile;
        fp8_store_tile_transposed(tile[h], dst, ldd, r0, c0, rows, cols, vector);
    }
}

// GELU's derivative (tanh approximation, llmc/gelu.cuh's gelu), in fp32.
__device__ inline float gelu_grad(float x) {
    const float t = tanhf(kGeluScale * (x + kGeluCubic * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
}

// fp8_cast_pair's kernel, tiled as fp8_transpose_kernel (fp8_cast_pair_tiles(kAux) tiles a block): for
// each tile, thread t reads 16 bf16 values of x row r0 + t/4 (columns c0 + 16 (t%4) ..; all tiles' loads
// first), writes their FP8 bytes to q's same place (if kRowMajor) and through the tile to qt. `vector`:
// x (and aux), q, qt 16-byte aligned, cols and ldt multiples of 16. kSums: the values also go to a float
// tile, whose 64 columns threads 0..63 sum in row order into col_sums' row for that tile. kAux: each
// value is x * GELU'(aux). The scale is *scale_in (delayed) or from amax_bits; descale (unless null)
// gets 1 / scale; amax_out (unless null) folds in max |value|.
template <class Fp8, bool kAux, bool kSums, bool kRowMajor>
__global__ void __launch_bounds__(kFp8ByteTileThreads)
    fp8_cast_pair_kernel(uint8_t* q, uint8_t* qt, int64_t ldt, const floatX* x, const floatX* aux, int64_t rows,
                         int64_t cols, const unsigned int* amax_bits, const float* scale_in, float* descale,
                         unsigned int* amax_out, bool vector, float* col_sums) {
    constexpr int H = fp8_cast_pair_tiles(kAux);
    __shared__ Fp8ByteTile tile[H];
    __shared__ float values[kSums ? H : 1][kSums ? kFp8ByteTile : 1][kFp8ByteTile + 1];
    const float scale = scale_in != nullptr ? *scale_in : fp8_scale<Fp8>(__uint_as_float(*amax_bits));
    if (descale != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *descale = 1.0f / scale;
    const int64_t c0 = int64_t(blockIdx.x) * kFp8ByteTile;
    const int line = int(threadIdx.x) / 4, seg = int(threadIdx.x) % 4;
    const int64_t c = c0 + 16 * seg;
    auto row_of = [&](int h) { return (int64_t(blockIdx.y) * H + h) * kFp8ByteTile + line; };
    // Every tile's 16-byte loads in flight together.
    PackX px[H][2], pa[H][2];
#pragma unroll
    for (int h = 0; h < H; h++) {
        const int64_t r = row_of(h);
        if (r < rows && vector && c + 16 <= cols) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                px[h][i] = load128(x + r * cols + c + i * kPackX);
                if constexpr (kAux) pa[h][i] = load128(aux + r * cols + c + i * kPackX);
            }
        }
    }
    float lane_max = 0.0f;
#pragma unroll
    for (int h = 0; h < H; h++) {
        const int64_t r = row_of(h);
        uint32_t w[4] = {0, 0, 0, 0};
        if (r < rows && vector && c + 16 <= cols) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
#pragma unroll
                for (int k = 0; k < kPackX; k += 2) {
                    const int j = i * kPackX + k;
                    float v0 = float(px[h][i][k]), v1 = float(px[h][i][k + 1]);
                    if constexpr (kAux) {
                        v0 *= gelu_grad(float(pa[h][i][k]));
                        v1 *= gelu_grad(float(pa[h][i][k + 1]));
                    }
                    lane_max = fmaxf(lane_max, fmaxf(fabsf(v0), fabsf(v1)));
                    const uint32_t pair = __nv_cvt_float2_to_fp8x2(make_float2(v0 * scale, v1 * scale), __NV_SATFINITE,
                                                                   Fp8Format<Fp8>::kKind);
                    w[j / 4] |= pair << (8 * (j % 4));
                    if constexpr (kSums) {
                        values[h][line][16 * seg + j] = v0;
                        values[h][line][16 * seg + j + 1] = v1;
                    }
                }
            }
            if constexpr (kRowMajor) *reinterpret_cast<uint4*>(q + r * cols + c) = make_uint4(w[0], w[1], w[2], w[3]);
        } else if (r < rows) {
            for (int k = 0; k < 16; k++) {
                float v = 0.0f;
                if (c + k < cols) {
                    v = float(x[r * cols + c + k]);
                    if constexpr (kAux) v *= gelu_grad(float(aux[r * cols + c + k]));
                }
                lane_max = fmaxf(lane_max, fabsf(v));
                if constexpr (kSums) values[h][line][16 * seg + k] = v;
                if (c + k >= cols) continue;
                const __nv_fp8_storage_t b = fp8_quantize<Fp8>(v, scale);
                w[k / 4] |= uint32_t(b) << (8 * (k % 4));
                if constexpr (kRowMajor) q[r * cols + c + k] = b;
            }
        } else if constexpr (kSums) {
            for (int k = 0; k < 16; k++) values[h][line][16 * seg + k] = 0.0f;
        }
        for (int k = 0; k < 4; k++) tile[h][line][4 * seg + k] = w[k];
    }
    fp8_record_amax_block(amax_out, lane_max);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < H; h++) {
        const int64_t r0 = (int64_t(blockIdx.y) * H + h) * kFp8ByteTile;
        if (r0 >= rows) break;
        if constexpr (kSums) {
            if (threadIdx.x < kFp8ByteTile && c0 + threadIdx.x < cols) {
                float sum = 0.0f;
                for (int j = 0; j < kFp8ByteTile; j++) sum += values[h][j][threadIdx.x];
                col_sums[(r0 / kFp8ByteTile) * cols + c0 + threadIdx.x] = sum;
            }
        }
        fp8_store_tile_transposed(tile[h], qt, ldt, r0, c0, rows, cols, vector);
    }
}

template <class Fp8>
__global__ void fp8_dequantize_kernel(floatX* x, const __nv_fp8_storage_t* q, int64_t n, const float* descale) {
    const float d = *descale;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        x[i] = floatX(fp8_value<Fp8>(q[i]) * d);
    }
}

// Eight values a thread: q 8-byte aligned, x 16-byte aligned, n a multiple of 8.
template <class Fp8>
__global__ void fp8_dequantize_packed_kernel(floatX* x, const uint2* q, int64_t packs, const float* descale) {
    const float d = *descale;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
        const uint2 w = q[i];
        PackX p;
        for (int k = 0; k < kPackX; k++) {
            const uint32_t word = k < 4 ? w.x : w.y;
            const auto b = __nv_fp8_storage_t((word >> (8 * (k % 4))) & 0xffu);
            p[k] = floatX(fp8_value<Fp8>(b) * d);
        }
        store128(x + i * kPackX, p);
    }
}

}  // namespace detail

// Folds max |x| over n bf16 values into *amax_bits (an unsigned atomicMax of the float's bits: what a
// producer kernel does with fp8_record_amax), without zeroing it first.
inline void fp8_amax_fold(const floatX* x, int64_t n, unsigned int* amax_bits, cudaStream_t stream) {
    if (n == 0) return;
    detail::fp8_amax_kernel<<<detail::kFp8Grid, detail::kFp8Block, 0, stream>>>(x, n, amax_bits);
    cudaCheckLaunch();
}

// One tensor of fp8_amax_batch: n bf16 values at x, their amax folded into *amax_bits; its blocks
// [first_block, first_block + blocks) of the launch (fp8_amax_batch_plan sets them).
struct Fp8AmaxJob {
    const floatX* x;
    int64_t n;
    unsigned int* amax_bits;
    int64_t first_block = 0, blocks = 0;
};

namespace detail {
constexpr int64_t kFp8AmaxBatchValuesPerBlock = int64_t(kFp8Block) * kPackX * 8;  // 8 packs a thread

// Block b works on the job whose blocks include b (a binary search over the jobs, in block order), taking
// every job.blocks-th stretch of it: 8 values a thread where x is 16-byte aligned, the rest one by one.
__global__ void fp8_amax_batch_kernel(const Fp8AmaxJob* jobs, int count) {
    const int64_t b = blockIdx.x;
    int lo = 0, hi = count - 1;  // the last job with first_block <= b
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (jobs[mid].first_block <= b) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    const Fp8AmaxJob j = jobs[lo];
    const int64_t t = (b - j.first_block) * blockDim.x + threadIdx.x, stride = j.blocks * blockDim.x;
    const int64_t packs = reinterpret_cast<uintptr_t>(j.x) % 16 == 0 ? j.n / kPackX : 0;
    float m = 0.0f;
#pragma unroll 4
    for (int64_t i = t; i < packs; i += stride) {
        const PackX p = load128(j.x + i * kPackX);
        for (int k = 0; k < kPackX; k++) m = fmaxf(m, fabsf(float(p[k])));
    }
    for (int64_t i = packs * kPackX + t; i < j.n; i += stride) m = fmaxf(m, fabsf(float(j.x[i])));
    m = warp_max(m);
    if (threadIdx.x % kWarpSize == 0) atomicMax(j.amax_bits, __float_as_uint(m));
}
}  // namespace detail

// Gives each job blocks in proportion to its size (one per kFp8AmaxBatchValuesPerBlock values, at least
// one), in order; returns the launch's blocks.
inline int64_t fp8_amax_batch_plan(std::vector<Fp8AmaxJob>& jobs) {
    int64_t blocks = 0;
    for (Fp8AmaxJob& j : jobs) {
        if (j.n < 0) fail(kExitUsage, "fp8_amax_batch: a tensor of %lld values", (long long)j.n);
        j.first_block = blocks;
        j.blocks = std::max<int64_t>(1, ceil_div<int64_t>(j.n, detail::kFp8AmaxBatchValuesPerBlock));
        blocks += j.blocks;
    }
    if (blocks > int64_t(INT32_MAX)) fail(kExitUsage, "fp8_amax_batch: %lld blocks", (long long)blocks);
    return blocks;
}

// fp8_amax_fold for `count` tensors in one launch of `blocks` blocks (jobs: a device array planned by
// fp8_amax_batch_plan; each *amax_bits zeroed by the caller), for the many weight tensors cast once per
// step.
inline void fp8_amax_batch(const Fp8AmaxJob* jobs, int count, int64_t blocks, cudaStream_t stream) {
    if (count < 0 || blocks < count || blocks > int64_t(INT32_MAX)) {
        fail(kExitUsage, "fp8_amax_batch: %d tensors in %lld blocks", count, (long long)blocks);
    }
    if (count == 0) return;
    detail::fp8_amax_batch_kernel<<<unsigned(blocks), detail::kFp8Block, 0, stream>>>(jobs, count);
    cudaCheckLaunch();
}

// q = fp8(x * scale), scale from amax_bits (fp8_amax_fold's, or a producer's); *descale = 1 / scale.
template <class Fp8>
void fp8_cast(Fp8* q, const floatX* x, int64_t n, const unsigned int* amax_bits, float* descale, cudaStream_t stream) {
    if (n % kPackX == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0) {
        const int64_t packs = n / kPackX;
        const unsigned grid = unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div<int64_t>(packs, detail::kFp8Block),
                                                                             int64_t(detail::kFp8Grid) * 4)));
        detail::fp8_cast_packed_kernel<Fp8><<<grid, detail::kFp8Block, 0, stream>>>(reinterpret_cast<uint2*>(q), x, packs,
                                                                                    amax_bits, descale);
    } else {
        detail::fp8_cast_kernel<Fp8><<<detail::kFp8Grid, detail::kFp8Block, 0, stream>>>(
            reinterpret_cast<__nv_fp8_storage_t*>(q), x, n, amax_bits, descale);
    }
    cudaCheckLaunch();
}

// x = bf16(q * descale), rounded to nearest: a saved FP8 tensor back in bf16 for a bf16 matmul.
template <class Fp8>
void fp8_dequantize(floatX* x, const Fp8* q, int64_t n, const float* descale, cudaStream_t stream) {
    if (n == 0) return;
    if (n % kPackX == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0) {
        const int64_t packs = n / kPackX;
        const unsigned grid = unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div<int64_t>(packs, detail::kFp8Block),
                                                                             int64_t(detail::kFp8Grid) * 4)));
        detail::fp8_dequantize_packed_kernel<Fp8><<<grid, detail::kFp8Block, 0, stream>>>(
            x, reinterpret_cast<const uint2*>(q), packs, descale);
    } else {
        detail::fp8_dequantize_kernel<Fp8><<<detail::kFp8Grid, detail::kFp8Block, 0, stream>>>(
            x, reinterpret_cast<const __nv_fp8_storage_t*>(q), n, descale);
    }
    cudaCheckLaunch();
}

namespace detail {
// The grid of the byte-tile kernels (64 columns by `tiles` 64-row tiles a block) for a (rows, cols) source
// written transposed into rows of `ld` (its name ld_name), after checking the sizes.
inline dim3 byte_tile_grid(const char* fn, const char* ld_name, int64_t rows, int64_t cols, int64_t ld, int tiles) {
    const int64_t block_rows = int64_t(kFp8ByteTile) * tiles;
    if (rows < 1 || cols < 1 || ld < rows || ceil_div<int64_t>(rows, block_rows) > 65535) {
        fail(kExitUsage, "%s: %lld x %lld into rows of %lld; need both >= 1, %s >= rows and at most %lld rows", fn,
             (long long)rows, (long long)cols, (long long)ld, ld_name, (long long)(65535 * block_rows));
    }
    return dim3(unsigned(ceil_div<int64_t>(cols, kFp8ByteTile)), unsigned(ceil_div<int64_t>(rows, block_rows)));
}
}  // namespace detail

// dst (cols, ld) row-major, columns [0, rows) = the transpose of src (rows, cols) row-major (FP8 bytes,
// copied exactly; the rest of dst is not touched). ld >= rows.
template <class Fp8>
void fp8_transpose(Fp8* dst, int64_t ld, const Fp8* src, int64_t rows, int64_t cols, cudaStream_t stream) {
    const dim3 grid = detail::byte_tile_grid("fp8_transpose", "ld", rows, cols, ld, detail::kFp8TilesPerBlock);
    const bool vector = reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
                        cols % 16 == 0 && ld % 16 == 0;
    detail::fp8_transpose_kernel<<<grid, detail::kFp8ByteTileThreads, 0, stream>>>(
        reinterpret_cast<uint8_t*>(dst), ld, reinterpret_cast<const uint8_t*>(src), rows, cols, vector);
    cudaCheckLaunch();
}

// Rows per block of fp8_cast_pair's column sums.
constexpr int kFp8CastPairRows = detail::kFp8ByteTile;

namespace detail {
// fp8_cast_pair and fp8_dgelu_cast_pair: checks and launch.
template <class Fp8>
void launch_cast_pair(const char* fn, Fp8* q, Fp8* qt, int64_t ldt, const floatX* x, const floatX* aux, int64_t rows,
                      int64_t cols, const unsigned int* amax_bits, const float* scale_in, float* descale,
                      unsigned int* amax_out, float* col_sums, cudaStream_t stream) {
    const dim3 grid = byte_tile_grid(fn, "ldt", rows, cols, ldt, fp8_cast_pair_tiles(aux != nullptr));
    const bool vector = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(aux) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(qt) % 16 == 0 &&
                        cols % 16 == 0 && ldt % 16 == 0;
    auto* qb = reinterpret_cast<uint8_t*>(q);
    auto* qtb = reinterpret_cast<uint8_t*>(qt);
    auto launch = [&](auto kernel) {
        kernel<<<grid, kFp8ByteTileThreads, 0, stream>>>(qb, qtb, ldt, x, aux, rows, cols, amax_bits, scale_in, descale,
                                                         amax_out, vector, col_sums);
    };
    if (aux != nullptr) {
        if (q == nullptr) fail(kExitUsage, "%s: needs the row-major copy q", fn);
        col_sums != nullptr ? launch(fp8_cast_pair_kernel<Fp8, true, true, true>)
                            : launch(fp8_cast_pair_kernel<Fp8, true, false, true>);
    } else if (col_sums != nullptr) {
        q != nullptr ? launch(fp8_cast_pair_kernel<Fp8, false, true, true>)
                     : launch(fp8_cast_pair_kernel<Fp8, false, true, false>);
    } else {
        q != nullptr ? launch(fp8_cast_pair_kernel<Fp8, false, false, true>)
                     : launch(fp8_cast_pair_kernel<Fp8, false, false, false>);
    }
    cudaCheckLaunch();
}
}  // namespace detail

// The cast of x (rows, cols) bf16 row-major with amax_bits' scale (as fp8_cast), written twice in one
// pass: into q (rows, cols) row-major (unless q is null) and transposed into columns [0, rows) of qt
// (cols, ldt) row-major, ldt >= rows: the two K-major operands of a gradient's FP8 dX and dW. *descale set.
// With col_sums ((ceil(rows / kFp8CastPairRows), cols) floats): each block of kFp8CastPairRows rows' column
// sums of x, added in row order (fp32), for the bias gradient (bias_grad_from_partials, llmc/matmul.cuh)
// without a pass of its own.
template <class Fp8>
void fp8_cast_pair(Fp8* q, Fp8* qt, int64_t ldt, const floatX* x, int64_t rows, int64_t cols,
                   const unsigned int* amax_bits, float* descale, cudaStream_t stream, float* col_sums = nullptr) {
    detail::launch_cast_pair("fp8_cast_pair", q, qt, ldt, x, static_cast<const floatX*>(nullptr), rows, cols,
                             amax_bits, static_cast<const float*>(nullptr), descale,
                             static_cast<unsigned int*>(nullptr), col_sums, stream);
}

// The same for the GELU's backward: the values cast are g = x * GELU'(aux) (aux: GELU's input, (rows, cols)
// like x; x: the gradient of GELU's output, e.g. a matmul's bf16 dX), at a given scale (*scale, delayed
// scaling: g's amax is known only once it is computed) into q and qt as fp8_cast_pair; max |g| is folded
// into *amax_bits (zero it first) for the next scale, and col_sums (unless null) are g's.
template <class Fp8>
void fp8_dgelu_cast_pair(Fp8* q, Fp8* qt, int64_t ldt, const floatX* x, const floatX* aux, int64_t rows, int64_t cols,
                         const float* scale, unsigned int* amax_bits, cudaStream_t stream, float* col_sums = nullptr) {
    if (aux == nullptr || scale == nullptr) fail(kExitUsage, "fp8_dgelu_cast_pair: needs aux and a scale");
    detail::launch_cast_pair("fp8_dgelu_cast_pair", q, qt, ldt, x, aux, rows, cols,
                             static_cast<const unsigned int*>(nullptr), scale, static_cast<float*>(nullptr), amax_bits,
                             col_sums, stream);
}

namespace detail {

// Delayed scaling's kernels (one thread a slot; slots are few): fp8_delayed_scales and fp8_history_push.
template <class Fp8>
__global__ void fp8_delayed_scale_kernel(const float* history, int slots, int len, float* scale, float* descale,
                                         int stride) {
    const int s = int(blockIdx.x * blockDim.x + threadIdx.x);
    if (s >= slots) return;
    float ref = 0.0f;
    for (int i = 0; i < len; i++) ref = fmaxf(ref, history[int64_t(s) * len + i]);
    const float sc = fp8_scale<Fp8>(ref);
    scale[int64_t(s) * stride] = sc;
    descale[int64_t(s) * stride] = 1.0f / sc;
}

// How far past the largest amax of its history a tensor's amax must be for fp8_history_push to count it
// as outgrown (saturated): a value up to kMax x 1.03 clips to kMax with less error than rounding makes in
// the top binade (its step is kMax / 14 in E4M3, kMax / 7 in E5M2).
constexpr float kFp8Saturated = 1.03125f;

__global__ void fp8_history_push_kernel(float* history, int slots, int len, const float* amax, int stride, float* count,
                                        float* outgrown) {
    const int s = int(blockIdx.x * blockDim.x + threadIdx.x);
    if (s == 0 && count != nullptr) *count = fminf(*count + 1.0f, float(len));
    if (s >= slots) return;
    float* h = history + int64_t(s) * len;
    float ref = 0.0f;  // what the scale of the write just measured came from
    for (int i = 0; i < len; i++) ref = fmaxf(ref, h[i]);
    for (int i = len - 1; i > 0; i--) h[i] = h[i - 1];
    const float a = amax[int64_t(s) * stride];
    h[0] = isfinite(a) ? a : 0.0f;  // a step that overflowed (skipped by the step guard) must not set 16 steps' scales
    if (outgrown != nullptr && ref > 0.0f && isfinite(a) && a > ref * kFp8Saturated) atomicAdd(outgrown, 1.0f);
}

}  // namespace detail

// Delayed scaling, for an FP8 tensor written by a kernel that needs its scale before it knows the amax
// (Fp8Gemm's FP8 output): each of `slots` tensors keeps the amax of its last `len` writes in history
// ((slots, len) floats, entry 0 the newest, zeros for writes not yet made) and is written with
// scale = kMax / (their largest) (1 for an all-zero history). fp8_delayed_scales writes each slot's scale
// and descale = 1 / scale at [s * stride]. fp8_history_push shifts each history by one, puts amax[s * stride]
// in front (0 if not finite: the step guard skips such a step, and it must not zero the next len scales),
// counts the writes in *count (unless null; a float, at most len), and adds to *outgrown (unless null; a
// float) one per slot whose new amax passed its non-empty history's largest by more than kFp8Saturated:
// that write saturated at kMax, delayed scaling having fallen one write behind.
template <class Fp8>
void fp8_delayed_scales(const float* history, int slots, int len, float* scale, float* descale, int stride,
                        cudaStream_t stream) {
    if (slots < 1 || len < 1 || stride < 1) {
        fail(kExitUsage, "fp8_delayed_scales: %d slots of %d entries, stride %d; need all >= 1", slots, len, stride);
    }
    detail::fp8_delayed_scale_kernel<Fp8><<<unsigned(ceil_div(slots, 128)), 128, 0, stream>>>(history, slots, len, scale,
                                                                                             descale, stride);
    cudaCheckLaunch();
}
inline void fp8_history_push(float* history, int slots, int len, const float* amax, int stride, float* count,
                             cudaStream_t stream, float* outgrown = nullptr) {
    if (slots < 1 || len < 1 || stride < 1) {
        fail(kExitUsage, "fp8_history_push: %d slots of %d entries, stride %d; need all >= 1", slots, len, stride);
    }
    detail::fp8_history_push_kernel<<<unsigned(ceil_div(slots, 128)), 128, 0, stream>>>(history, slots, len, amax, stride,
                                                                                          count, outgrown);
    cudaCheckLaunch();
}

// x (rows, cols) row-major cast into q (cols, rows) row-major: fp8_cast_pair's transposed copy alone.
template <class Fp8>
void fp8_cast_transposed(Fp8* q, const floatX* x, int64_t rows, int64_t cols, const unsigned int* amax_bits,
                         float* descale, cudaStream_t stream) {
    fp8_cast_pair<Fp8>(nullptr, q, rows, x, rows, cols, amax_bits, descale, stream);
}

// What Fp8Gemm's epilogue adds (at most one of gelu_aux and dgelu_aux; the auxiliary matrices are (M, N)
// row-major bf16, like D):
//   bias       D += bias (N), broadcast over rows;
//   gelu_aux   aux = the product (+ bias), D = GELU(aux) (tanh approximation);
//   dgelu_aux  D = the product * GELU'(aux);
//   accumulate D += the product (+ bias) instead of D = (a gradient summed over micro-batches).
struct Fp8Epilogue {
    const floatX* bias = nullptr;
    floatX* gelu_aux = nullptr;
    const floatX* dgelu_aux = nullptr;
    bool accumulate = false;
};

// D (M, N) bf16 row-major = (descale_p P (M, K)) (descale_q Q (N, K))^T, P and Q FP8 row-major, fp32
// accumulation (fast on request), with Fp8Epilogue's extras. Not both operands E5M2 (cuBLASLt has no such
// kernel); M, N, K multiples of 16 and pointers 16-byte aligned, checked with errors naming the operand.
// The operands, descales, bias and output are fixed at construction (cuBLASLt reads the descales at each
// run, so a cast before run() may change them).
class Fp8Gemm {
public:
    template <class P, class Q>
    Fp8Gemm(const CublasLt& lt, int64_t M, int64_t N, int64_t K, const P* p, const Q* q, const float* descale_p,
            const float* descale_q, floatX* d, const floatX* bias = nullptr, bool fast_accum = false)
        : Fp8Gemm(lt, M, N, K, p, q, descale_p, descale_q, d, Fp8Epilogue{bias, nullptr, nullptr}, fast_accum) {}

    template <class P, class Q>
    Fp8Gemm(const CublasLt& lt, int64_t M, int64_t N, int64_t K, const P* p, const Q* q, const float* descale_p,
            const float* descale_q, floatX* d, const Fp8Epilogue& epilogue, bool fast_accum = false)
        : Fp8Gemm(lt, M, N, K, p, q, descale_p, descale_q, static_cast<void*>(d), CUDA_R_16BF, nullptr, nullptr,
                  epilogue, fast_accum) {}

    // An E4M3 D instead of bf16 (cuBLASLt 13.1 has no E5M2 D for E4M3 operands, nor an amax of a bf16 D):
    // D = fp8(result * *scale_d), rounded to nearest, saturating (a scale too large clips, never NaN);
    // amax_d (unless null) gets max |result| (after the epilogue, before scale_d), delayed scaling's next
    // measure. Epilogue: bias or GELU (aux stays bf16), not accumulate or GELU' (no such kernels on Hopper).
    template <class P, class Q, class D>
    Fp8Gemm(const CublasLt& lt, int64_t M, int64_t N, int64_t K, const P* p, const Q* q, const float* descale_p,
            const float* descale_q, D* d, const float* scale_d, float* amax_d, const Fp8Epilogue& epilogue,
            bool fast_accum = false)
        : Fp8Gemm(lt, M, N, K, p, q, descale_p, descale_q, static_cast<void*>(d), Fp8Format<D>::kType, scale_d, amax_d,
                  epilogue, fast_accum) {
        if (scale_d == nullptr) fail(kExitUsage, "Fp8Gemm: an FP8 D (%s) needs scale_d", Fp8Format<D>::kName);
    }
    Fp8Gemm(const Fp8Gemm&) = delete;
    Fp8Gemm& operator=(const Fp8Gemm&) = delete;

    void run(cudaStream_t stream) const {
        const float alpha = 1.0f;
        // An FP8 D reads no C (beta is 0): cuBLASLt takes a null C then.
        const void* c = d_type_ == CUDA_R_16BF ? d_ : nullptr;
        cublasCheck(cublasLtMatmul(lt_.handle(), desc_.d, &alpha, q_, a_.l, p_, b_.l, &beta_, c, c_.l, d_, d_layout_.l,
                                   &algo_, lt_.workspace(), lt_.workspace_bytes(), stream));
    }

private:
    template <class P, class Q>
    Fp8Gemm(const CublasLt& lt, int64_t M, int64_t N, int64_t K, const P* p, const Q* q, const float* descale_p,
            const float* descale_q, void* d, cudaDataType_t d_type, const float* scale_d, float* amax_d,
            const Fp8Epilogue& epilogue, bool fast_accum)
        : lt_(lt), p_(p), q_(q), d_(d), d_type_(d_type),
          // cuBLASLt is column-major: D^T (N, M) = A^T B with A = Q read as (K, N) and B = P read as (K, M).
          a_(Fp8Format<Q>::kType, K, N, K, 1, 0), b_(Fp8Format<P>::kType, K, M, K, 1, 0),
          c_(CUDA_R_16BF, N, M, N, 1, 0), d_layout_(d_type, N, M, N, 1, 0), beta_(epilogue.accumulate ? 1.0f : 0.0f) {
        const char* fn = "Fp8Gemm";
        const bool fp8_d = d_type != CUDA_R_16BF;
        if (M < 16 || N < 16 || K < 16 || M % 16 != 0 || N % 16 != 0 || K % 16 != 0) {
            fail(kExitUsage, "%s: M=%lld N=%lld K=%lld; FP8 matmuls need each a positive multiple of 16", fn,
                 (long long)M, (long long)N, (long long)K);
        }
        if (Fp8Format<P>::kType == CUDA_R_8F_E5M2 && Fp8Format<Q>::kType == CUDA_R_8F_E5M2) {
            fail(kExitUsage, "%s: both operands E5M2; one must be E4M3", fn);
        }
        if (epilogue.gelu_aux != nullptr && epilogue.dgelu_aux != nullptr) {
            fail(kExitUsage, "%s: both a GELU and a GELU-gradient epilogue asked for", fn);
        }
        if (fp8_d && (epilogue.accumulate || epilogue.dgelu_aux != nullptr)) {
            fail(kExitUsage, "%s: an FP8 D takes neither accumulate nor the GELU-gradient epilogue", fn);
        }
        require_aligned16(p, "Fp8Gemm: P");
        require_aligned16(q, "Fp8Gemm: Q");
        require_aligned16(d, "Fp8Gemm: D");
        require_aligned16(descale_p, "Fp8Gemm: descale_p");
        require_aligned16(descale_q, "Fp8Gemm: descale_q");
        desc_.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
        desc_.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
        desc_.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(descale_q));
        desc_.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(descale_p));
        desc_.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(fast_accum ? 1 : 0));
        if (fp8_d) {
            require_aligned16(scale_d, "Fp8Gemm: scale_d");
            desc_.set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void*>(scale_d));
            if (amax_d != nullptr) {
                require_aligned16(amax_d, "Fp8Gemm: amax_d");
                desc_.set(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(amax_d));
            }
        }
        cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_DEFAULT;
        const void* aux = nullptr;
        if (epilogue.gelu_aux != nullptr) {
            e = epilogue.bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
            aux = epilogue.gelu_aux;
            require_aligned16(aux, "Fp8Gemm: GELU input (aux)");
        } else if (epilogue.dgelu_aux != nullptr) {
            if (epilogue.bias != nullptr) fail(kExitUsage, "%s: a bias with the GELU-gradient epilogue", fn);
            e = CUBLASLT_EPILOGUE_DGELU;
            aux = epilogue.dgelu_aux;
            require_aligned16(aux, "Fp8Gemm: GELU input (aux)");
        } else if (epilogue.bias != nullptr) {
            e = CUBLASLT_EPILOGUE_BIAS;
        }
        if (epilogue.bias != nullptr) {
            require_aligned16(epilogue.bias, "Fp8Gemm: bias");
            desc_.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_16BF);
            desc_.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(epilogue.bias));
        }
        if (aux != nullptr) {
            desc_.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
            desc_.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t(N));
            desc_.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, int32_t(CUDA_R_16BF));
        }
        desc_.set(CUBLASLT_MATMUL_DESC_EPILOGUE, e);
        pref_.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(lt.workspace_bytes()));
        cublasLtMatmulHeuristicResult_t result{};
        int found = 0;
        cublasCheck(cublasLtMatmulAlgoGetHeuristic(lt.handle(), desc_.d, a_.l, b_.l, c_.l, d_layout_.l, pref_.p, 1,
                                                   &result, &found));
        if (found == 0) {
            fail(kExitCuda, "%s: cuBLASLt has no algorithm for M=%lld N=%lld K=%lld, P %s, Q %s, %s output, epilogue %s",
                 fn, (long long)M, (long long)N, (long long)K, Fp8Format<P>::kName, Fp8Format<Q>::kName,
                 d_type == CUDA_R_8F_E4M3 ? "E4M3" : d_type == CUDA_R_8F_E5M2 ? "E5M2" : "bf16",
                 detail::epilogue_name(e));
        }
        algo_ = result.algo;
    }

    const CublasLt& lt_;
    const void *p_, *q_;
    void* d_;
    cudaDataType_t d_type_;
    detail::LtMatmulDesc desc_;
    detail::LtLayout a_, b_, c_, d_layout_;
    detail::LtPreference pref_;
    float beta_;
    cublasLtMatmulAlgo_t algo_{};
};

// D = P Q^T through one Fp8Gemm (the heuristic's first choice, looked up at each call as gemm() does).
template <class P, class Q>
void fp8_matmul(const CublasLt& lt, cudaStream_t stream, int64_t M, int64_t N, int64_t K, const P* p, const Q* q,
                const float* descale_p, const float* descale_q, floatX* d, const Fp8Epilogue& epilogue = {},
                bool fast_accum = false) {
    const Fp8Gemm gemm(lt, M, N, K, p, q, descale_p, descale_q, d, epilogue, fast_accum);
    gemm.run(stream);
}
// The same into an FP8 D (Fp8Gemm's FP8-output constructor): D = fp8(P Q^T * *scale_d), max |P Q^T| in *amax_d.
template <class P, class Q, class D>
void fp8_matmul(const CublasLt& lt, cudaStream_t stream, int64_t M, int64_t N, int64_t K, const P* p, const Q* q,
                const float* descale_p, const float* descale_q, D* d, const float* scale_d, float* amax_d,
                const Fp8Epilogue& epilogue = {}, bool fast_accum = false) {
    const Fp8Gemm gemm(lt, M, N, K, p, q, descale_p, descale_q, d, scale_d, amax_d, epilogue, fast_accum);
    gemm.run(stream);
}

}  // namespace llmc
