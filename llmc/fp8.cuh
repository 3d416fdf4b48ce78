/*
FP8 building blocks (GPUs of compute capability 8.9 and 9.x: Ada, Hopper): per-tensor scaled casts from
bf16 and the cuBLASLt FP8 matmul. The trainer does not use them yet; dev/fp8_lab.cu measures them.

Formats: E4M3 (3 mantissa bits, largest 448) for activations and weights, E5M2 (2 bits, largest 57344)
for gradients. A tensor x is stored as q = fp8(x * scale) with scale = kMax / amax (amax = max |x|), so
its largest value lands on the format's largest, and the matmul multiplies by descale = 1 / scale. An
all-zero tensor gets scale 1. Conversions round to nearest and saturate to the finite range
(__NV_SATFINITE: never inf or NaN from a finite input).

Provides:
  Fp8Format<Fp8>:       kMax and the cuBLASLt data type of __nv_fp8_e4m3 and __nv_fp8_e5m2.
  fp8_supported():      whether device 0 has FP8 tensor cores (compute capability 8.9 or higher).
  fp8_amax:             *amax_bits = the float bits of max |x| over n bf16 values (zeroed first; floats
                        >= 0 order like their bits, so blocks combine with an unsigned atomicMax:
                        exact, whatever the order).
  fp8_cast:             q = fp8(x * scale) from amax_bits (fp8_amax's), and *descale = 1 / scale.
  fp8_cast_transposed:  the same from x (rows, cols) row-major into q (cols, rows) row-major, through
                        32 x 32 tiles in shared memory (coalesced both ways): the K-major copy a
                        backward matmul needs.
  Fp8Gemm:              D (M, N) bf16 row-major = (descale_p * P (M, K)) @ (descale_q * Q (N, K))^T
                        (+ bias (N) in the epilogue), P and Q FP8 row-major ("TN": both K-major, the only
                        layout Hopper's FP8 matmuls take), fp32 accumulation (fast accumulation on
                        request), descales read from device pointers at each run. Not both operands
                        E5M2 (cuBLASLt has no such kernel). M, N and K multiples of 16, pointers 16-byte
                        aligned: checked, with errors naming the operand.
Every call is checked; casts on `stream`.

Does not provide: delayed scaling (an amax history), casts fused into the kernels that write the
operands, FP8 outputs, or anything about which matmuls of the model should run in FP8.
*/
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
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

namespace detail {

constexpr int kFp8Grid = 1056, kFp8Block = 256;
constexpr int kFp8Tile = 32, kFp8TileRows = 8;

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

// Blocks of 32 x 8 threads, one 32 x 32 tile each: x's rows r0.., columns c0.. into q's rows c0.., columns r0...
template <class Fp8>
__global__ void fp8_cast_transposed_kernel(__nv_fp8_storage_t* q, const floatX* x, int64_t rows, int64_t cols,
                                           const unsigned int* amax_bits, float* descale) {
    __shared__ float tile[kFp8Tile][kFp8Tile + 1];
    const float scale = fp8_scale<Fp8>(__uint_as_float(*amax_bits));
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *descale = 1.0f / scale;
    const int64_t r0 = int64_t(blockIdx.y) * kFp8Tile, c0 = int64_t(blockIdx.x) * kFp8Tile;
    for (int j = threadIdx.y; j < kFp8Tile; j += kFp8TileRows) {
        const int64_t r = r0 + j, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[j][threadIdx.x] = float(x[r * cols + c]);
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kFp8Tile; j += kFp8TileRows) {
        const int64_t c = c0 + j, r = r0 + threadIdx.x;  // q's row c, column r
        if (r < rows && c < cols) q[c * rows + r] = fp8_quantize<Fp8>(tile[threadIdx.x][j], scale);
    }
}

}  // namespace detail

inline void fp8_amax(const floatX* x, int64_t n, unsigned int* amax_bits, cudaStream_t stream) {
    cudaCheck(cudaMemsetAsync(amax_bits, 0, sizeof(unsigned int), stream));
    if (n == 0) return;
    detail::fp8_amax_kernel<<<detail::kFp8Grid, detail::kFp8Block, 0, stream>>>(x, n, amax_bits);
    cudaCheckLaunch();
}

template <class Fp8>
void fp8_cast(Fp8* q, const floatX* x, int64_t n, const unsigned int* amax_bits, float* descale, cudaStream_t stream) {
    detail::fp8_cast_kernel<Fp8><<<detail::kFp8Grid, detail::kFp8Block, 0, stream>>>(
        reinterpret_cast<__nv_fp8_storage_t*>(q), x, n, amax_bits, descale);
    cudaCheckLaunch();
}

template <class Fp8>
void fp8_cast_transposed(Fp8* q, const floatX* x, int64_t rows, int64_t cols, const unsigned int* amax_bits,
                         float* descale, cudaStream_t stream) {
    if (rows < 1 || cols < 1 || ceil_div<int64_t>(rows, detail::kFp8Tile) > 65535) {
        fail(kExitUsage, "fp8_cast_transposed: %lld x %lld; need both >= 1 and at most %d rows", (long long)rows,
             (long long)cols, 65535 * detail::kFp8Tile);
    }
    const dim3 grid(unsigned(ceil_div<int64_t>(cols, detail::kFp8Tile)), unsigned(ceil_div<int64_t>(rows, detail::kFp8Tile)));
    detail::fp8_cast_transposed_kernel<Fp8><<<grid, dim3(detail::kFp8Tile, detail::kFp8TileRows), 0, stream>>>(
        reinterpret_cast<__nv_fp8_storage_t*>(q), x, rows, cols, amax_bits, descale);
    cudaCheckLaunch();
}

// The file's comment. The operands, descales, bias and output are fixed at construction (cuBLASLt reads
// the descales at each run, so a cast before run() may change them).
class Fp8Gemm {
public:
    template <class P, class Q>
    Fp8Gemm(const CublasLt& lt, int64_t M, int64_t N, int64_t K, const P* p, const Q* q, const float* descale_p,
            const float* descale_q, floatX* d, const floatX* bias = nullptr, bool fast_accum = false)
        : lt_(lt), p_(p), q_(q), d_(d),
          // cuBLASLt is column-major: D^T (N, M) = A^T B with A = Q read as (K, N) and B = P read as (K, M).
          a_(Fp8Format<Q>::kType, K, N, K, 1, 0), b_(Fp8Format<P>::kType, K, M, K, 1, 0),
          c_(CUDA_R_16BF, N, M, N, 1, 0) {
        const char* fn = "Fp8Gemm";
        if (M < 16 || N < 16 || K < 16 || M % 16 != 0 || N % 16 != 0 || K % 16 != 0) {
            fail(kExitUsage, "%s: M=%lld N=%lld K=%lld; FP8 matmuls need each a positive multiple of 16", fn,
                 (long long)M, (long long)N, (long long)K);
        }
        if (Fp8Format<P>::kType == CUDA_R_8F_E5M2 && Fp8Format<Q>::kType == CUDA_R_8F_E5M2) {
            fail(kExitUsage, "%s: both operands E5M2; one must be E4M3", fn);
        }
        require_aligned16(p, "Fp8Gemm: P");
        require_aligned16(q, "Fp8Gemm: Q");
        require_aligned16(d, "Fp8Gemm: D");
        require_aligned16(descale_p, "Fp8Gemm: descale_p");
        require_aligned16(descale_q, "Fp8Gemm: descale_q");
        if (bias != nullptr) require_aligned16(bias, "Fp8Gemm: bias");
        desc_.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
        desc_.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
        desc_.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(descale_q));
        desc_.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(descale_p));
        desc_.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(fast_accum ? 1 : 0));
        if (bias != nullptr) {
            desc_.set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
            desc_.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_16BF);
            desc_.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));
        }
        pref_.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(lt.workspace_bytes()));
        cublasLtMatmulHeuristicResult_t result{};
        int found = 0;
        cublasCheck(cublasLtMatmulAlgoGetHeuristic(lt.handle(), desc_.d, a_.l, b_.l, c_.l, c_.l, pref_.p, 1, &result,
                                                   &found));
        if (found == 0) {
            fail(kExitCuda, "%s: cuBLASLt has no algorithm for M=%lld N=%lld K=%lld, P %s, Q %s, bf16 output%s", fn,
                 (long long)M, (long long)N, (long long)K, Fp8Format<P>::kName, Fp8Format<Q>::kName,
                 bias != nullptr ? ", bias" : "");
        }
        algo_ = result.algo;
    }
    Fp8Gemm(const Fp8Gemm&) = delete;
    Fp8Gemm& operator=(const Fp8Gemm&) = delete;

    void run(cudaStream_t stream) const {
        const float alpha = 1.0f, beta = 0.0f;
        cublasCheck(cublasLtMatmul(lt_.handle(), desc_.d, &alpha, q_, a_.l, p_, b_.l, &beta, d_, c_.l, d_, c_.l,
                                   &algo_, lt_.workspace(), lt_.workspace_bytes(), stream));
    }

private:
    const CublasLt& lt_;
    const void *p_, *q_;
    floatX* d_;
    detail::LtMatmulDesc desc_;
    detail::LtLayout a_, b_, c_;
    detail::LtPreference pref_;
    cublasLtMatmulAlgo_t algo_{};
};

}  // namespace llmc
