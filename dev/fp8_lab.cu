/*
fp8_lab: how much faster, and how much less exact, would a GPT-2 step's forward matmuls be with FP8
(E4M3) operands and per-tensor scales than with the bf16 ones the trainer runs?

  build/fp8_lab [--B 64] [--T 1024] [--C 768] [--Vp 50304] [--layers 12] [--warmup 5] [--reps 20]
                [--fast-accum 0|1] [--tol 0.08]

For each forward matmul of the model (qkv: C -> 3C, attention projection: C -> C, fc: C -> 4C, fc
projection: 4C -> C, each with a bias; the LM head: C -> Vp without one), at N = B*T rows, with inputs
shaped like the trainer's (activations ~ N(0, 1), weights ~ N(0, 0.02), from a seeded hash):
  - bf16: llmc/matmul.cuh's matmul_forward, as the trainer calls it (bias epilogue);
  - fp8: the input and the weight each cast to E4M3 with a per-tensor scale 448 / amax (current scaling:
    one pass for the amax, one for the cast), then one cuBLASLt matmul in the "TN" layout FP8 requires
    (the weight transposed: our row-major (OC, C) is already that), bf16 output, fp32 accumulation
    (CUBLASLT_MATMUL_DESC_FAST_ACCUM from --fast-accum), the dequantising scales through
    CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER and the bias in the epilogue.
Each is timed with CUDA events (median of --reps after --warmup), the casts separately from the matmul
(a trainer would fuse the activation's cast into the kernel that produces it, and cast weights once per
step). The fp8 output is compared with the bf16 one: relative error ||D8 - D16|| / ||D16|| (Frobenius),
which must be under --tol (E4M3 keeps 3 mantissa bits: a relative rounding of up to 1/16 per operand),
and the largest |D8 - D16| over max |D16|. The summary adds the per-layer calls --layers times and the
LM head once: the forward matmul time of one B x T micro-batch, bf16 against fp8 with and without the
casts of the activations.

Exit 1 when an fp8 result is outside --tol. Needs a GPU with FP8 tensor cores (compute capability 8.9 or
9.0+); elsewhere it says so and exits 0.

Does not provide: the backward matmuls (dinp and dweight need the other operand transposed in FP8, or
E5M2 gradients), delayed scaling from an amax history, sustained timing under a power cap
(dev/matmul_lab.cu --sustain does that for bf16), or anything in the trainer.
*/
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flags.h"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

using namespace llmc;

namespace {

struct Options {
    int B = 64, T = 1024, C = 768, Vp = 50304, layers = 12, warmup = 5, reps = 20;
    bool fast_accum = false;
    double tol = 0.08;
};

bool parse_args(int argc, char** argv, Options& o) {
    Flags flags("fp8_lab", "Times and checks a GPT-2 forward's matmuls in FP8 (E4M3) against bf16.");
    flags.add("", "B", &o.B, "batch size", 1, 1 << 16)
        .add("", "T", &o.T, "sequence length", 1, 1 << 20)
        .add("", "C", &o.C, "channels (qkv: 3C, fc: 4C); a multiple of 16", 16, 1 << 16)
        .add("", "Vp", &o.Vp, "padded vocabulary size (the LM head's OC); a multiple of 16", 16, 1 << 22)
        .add("", "layers", &o.layers, "layers: the per-layer calls' count in the summary", 1, 1024)
        .add("", "warmup", &o.warmup, "untimed runs before timing", 0, 1000)
        .add("", "reps", &o.reps, "timed runs (median)", 1, 10000)
        .add("", "fast-accum", &o.fast_accum, "cuBLASLt's FP8 fast accumulation (less exact, faster)")
        .add("", "tol", &o.tol, "largest relative Frobenius error of an fp8 result against bf16", 0.0, 1.0);
    if (!flags.parse(argc, argv)) return false;
    if ((int64_t(o.B) * o.T) % 16 != 0 || o.C % 16 != 0 || o.Vp % 16 != 0) {
        fail(kExitUsage, "fp8_lab: FP8 matmuls need B*T, C and Vp to be multiples of 16 (B*T=%lld C=%d Vp=%d)",
             (long long)o.B * o.T, o.C, o.Vp);
    }
    std::fputs(flags.settings_table().c_str(), stdout);
    return true;
}

constexpr float kE4M3Max = 448.0f;

// A normal-ish value from (seed, index): the sum of four uniforms, centred and scaled to unit variance.
__device__ float hashed_normal(uint64_t seed, int64_t i) {
    float sum = 0.0f;
    for (int k = 0; k < 4; k++) {
        uint64_t z = seed + uint64_t(i) * 4 + uint64_t(k) + 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        sum += float(z >> 40) * (1.0f / 16777216.0f);
    }
    return (sum - 2.0f) * 1.7320508f;  // var of a sum of 4 uniforms is 1/3
}

__global__ void fill_normal_kernel(floatX* x, int64_t n, uint64_t seed, float stddev) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        x[i] = floatX(stddev * hashed_normal(seed, i));
    }
}

// amax = max |x| (a float's bits order like the value for non-negative floats, so an unsigned atomicMax).
__global__ void amax_kernel(const floatX* x, int64_t n, unsigned int* amax_bits) {
    float m = 0.0f;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        m = fmaxf(m, fabsf(float(x[i])));
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x % kWarpSize == 0) atomicMax(amax_bits, __float_as_uint(m));
}

// q = E4M3(x * 448 / amax) (saturating), and descale = amax / 448 for the matmul.
__global__ void cast_e4m3_kernel(__nv_fp8_e4m3* q, const floatX* x, int64_t n, const unsigned int* amax_bits,
                                 float* descale) {
    const float amax = __uint_as_float(*amax_bits);
    const float scale = amax > 0.0f ? kE4M3Max / amax : 1.0f;
    if (blockIdx.x == 0 && threadIdx.x == 0) *descale = 1.0f / scale;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        q[i] = __nv_fp8_e4m3(float(x[i]) * scale);
    }
}

// sums[0] += (a - b)^2, sums[1] += b^2, sums[2] = max |a - b|, sums[3] = max |b| (the maxima as float bits).
__global__ void compare_kernel(const floatX* a, const floatX* b, int64_t n, double* sums, unsigned int* maxima) {
    double diff2 = 0.0, ref2 = 0.0;
    float max_diff = 0.0f, max_ref = 0.0f;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float x = float(a[i]), y = float(b[i]);
        diff2 += double(x - y) * double(x - y);
        ref2 += double(y) * double(y);
        max_diff = fmaxf(max_diff, fabsf(x - y));
        max_ref = fmaxf(max_ref, fabsf(y));
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        diff2 += __shfl_xor_sync(0xffffffffu, diff2, offset);
        ref2 += __shfl_xor_sync(0xffffffffu, ref2, offset);
        max_diff = fmaxf(max_diff, __shfl_xor_sync(0xffffffffu, max_diff, offset));
        max_ref = fmaxf(max_ref, __shfl_xor_sync(0xffffffffu, max_ref, offset));
    }
    if (threadIdx.x % kWarpSize == 0) {
        atomicAdd(&sums[0], diff2);
        atomicAdd(&sums[1], ref2);
        atomicMax(&maxima[0], __float_as_uint(max_diff));
        atomicMax(&maxima[1], __float_as_uint(max_ref));
    }
}

constexpr int kGrid = 1056, kBlock = 256;

// D (N, OC) bf16 = (descale_x * X8 (N, K)) @ (descale_w * W8 (OC, K))^T + bias, through cuBLASLt.
class Fp8Matmul {
public:
    Fp8Matmul(const CublasLt& lt, cudaStream_t stream, int64_t N, int64_t K, int64_t OC, const __nv_fp8_e4m3* x8,
              const __nv_fp8_e4m3* w8, const float* descale_x, const float* descale_w, const floatX* bias, floatX* d,
              bool fast_accum)
        : lt_(lt), stream_(stream), x8_(x8), w8_(w8), d_(d),
          // In cuBLAS's column-major terms D is (OC, N): A is the weight, our row-major (OC, K) read as a
          // column-major (K, OC) and used transposed; B is the input, row-major (N, K) = column-major (K, N).
          a_(CUDA_R_8F_E4M3, K, OC, K, 1, 0), b_(CUDA_R_8F_E4M3, K, N, K, 1, 0), c_(CUDA_R_16BF, OC, N, OC, 1, 0) {
        desc_.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
        desc_.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
        desc_.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(descale_w));
        desc_.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(descale_x));
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
            fail(kExitCuda, "cuBLASLt has no FP8 algorithm for N=%lld K=%lld OC=%lld (bf16 output%s)", (long long)N,
                 (long long)K, (long long)OC, bias != nullptr ? ", bias" : "");
        }
        algo_ = result.algo;
    }
    void run() const {
        const float alpha = 1.0f, beta = 0.0f;
        cublasCheck(cublasLtMatmul(lt_.handle(), desc_.d, &alpha, w8_, a_.l, x8_, b_.l, &beta, d_, c_.l, d_, c_.l,
                                   &algo_, lt_.workspace(), lt_.workspace_bytes(), stream_));
    }

private:
    const CublasLt& lt_;
    cudaStream_t stream_;
    const __nv_fp8_e4m3 *x8_, *w8_;
    floatX* d_;
    detail::LtMatmulDesc desc_;
    detail::LtLayout a_, b_, c_;
    detail::LtPreference pref_;
    cublasLtMatmulAlgo_t algo_{};
};

// The median of reps timed runs of f after warmup untimed ones, in ms.
template <class F>
float median_ms(cudaStream_t stream, int warmup, int reps, F f) {
    for (int i = 0; i < warmup; i++) f();
    Event start(true), stop(true);
    std::vector<float> ms;
    for (int i = 0; i < reps; i++) {
        cudaCheck(cudaEventRecord(start, stream));
        f();
        cudaCheck(cudaEventRecord(stop, stream));
        cudaCheck(cudaEventSynchronize(stop));
        float t = 0;
        cudaCheck(cudaEventElapsedTime(&t, start, stop));
        ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

struct Row {
    std::string name;
    int per_step;
    float bf16_ms, fp8_ms, cast_x_ms, cast_w_ms;
    double rel_err, max_err;
};

Row run_case(const CublasLt& lt, cudaStream_t stream, const Options& o, const char* name, int per_step, int64_t K,
             int64_t OC, bool with_bias, uint64_t seed) {
    const int64_t N = int64_t(o.B) * o.T;
    DeviceBuffer<floatX> x{size_t(N * K)}, w{size_t(OC * K)}, bias{size_t(OC)}, d16{size_t(N * OC)}, d8{size_t(N * OC)};
    DeviceBuffer<__nv_fp8_e4m3> x8{size_t(N * K)}, w8{size_t(OC * K)};
    // Slots 0 (the input) and kScaleSlot (the weight): each scale 16-byte aligned, as cuBLASLt wants its
    // scale pointers.
    constexpr int kScaleSlot = 4;
    DeviceBuffer<unsigned int> amax(2 * kScaleSlot);
    DeviceBuffer<float> descale(2 * kScaleSlot);
    DeviceBuffer<double> sums(2);
    DeviceBuffer<unsigned int> maxima(2);
    fill_normal_kernel<<<kGrid, kBlock, 0, stream>>>(x.get(), N * K, seed, 1.0f);
    cudaCheckLaunch();
    fill_normal_kernel<<<kGrid, kBlock, 0, stream>>>(w.get(), OC * K, seed + 1, 0.02f);
    cudaCheckLaunch();
    fill_normal_kernel<<<kGrid, kBlock, 0, stream>>>(bias.get(), OC, seed + 2, 0.02f);
    cudaCheckLaunch();

    auto cast = [&](const floatX* src, __nv_fp8_e4m3* dst, int64_t n, int slot) {
        cudaCheck(cudaMemsetAsync(amax.get() + slot, 0, sizeof(unsigned int), stream));
        amax_kernel<<<kGrid, kBlock, 0, stream>>>(src, n, amax.get() + slot);
        cudaCheckLaunch();
        cast_e4m3_kernel<<<kGrid, kBlock, 0, stream>>>(dst, src, n, amax.get() + slot, descale.get() + slot);
        cudaCheckLaunch();
    };
    const floatX* b = with_bias ? bias.get() : nullptr;
    Row r{name, per_step, 0, 0, 0, 0, 0, 0};
    r.bf16_ms = median_ms(stream, o.warmup, o.reps,
                          [&] { matmul_forward(lt, d16.get(), x.get(), w.get(), b, N, int(K), int(OC), stream); });
    r.cast_x_ms = median_ms(stream, o.warmup, o.reps, [&] { cast(x.get(), x8.get(), N * K, 0); });
    r.cast_w_ms = median_ms(stream, o.warmup, o.reps, [&] { cast(w.get(), w8.get(), OC * K, kScaleSlot); });
    const Fp8Matmul mm(lt, stream, N, K, OC, x8.get(), w8.get(), descale.get(), descale.get() + kScaleSlot, b,
                       d8.get(), o.fast_accum);
    r.fp8_ms = median_ms(stream, o.warmup, o.reps, [&] { mm.run(); });

    cudaCheck(cudaMemsetAsync(sums.get(), 0, 2 * sizeof(double), stream));
    cudaCheck(cudaMemsetAsync(maxima.get(), 0, 2 * sizeof(unsigned int), stream));
    compare_kernel<<<kGrid, kBlock, 0, stream>>>(d8.get(), d16.get(), N * OC, sums.get(), maxima.get());
    cudaCheckLaunch();
    double host_sums[2];
    unsigned int host_max[2];
    cudaCheck(cudaMemcpyAsync(host_sums, sums.get(), sizeof(host_sums), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaMemcpyAsync(host_max, maxima.get(), sizeof(host_max), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    float max_diff, max_ref;
    std::memcpy(&max_diff, &host_max[0], 4);
    std::memcpy(&max_ref, &host_max[1], 4);
    r.rel_err = host_sums[1] > 0 ? std::sqrt(host_sums[0] / host_sums[1]) : 0.0;
    r.max_err = max_ref > 0 ? double(max_diff) / double(max_ref) : 0.0;
    return r;
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&]() -> int {
        Options o;
        if (!parse_args(argc, argv, o)) return 0;
        if (cuda_device_count() == 0) fail(kExitCuda, "fp8_lab needs a GPU");
        cudaDeviceProp prop{};
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        if (prop.major * 10 + prop.minor < 89) {
            std::printf("fp8_lab: %s (compute capability %d.%d) has no FP8 tensor cores; nothing to measure\n",
                        prop.name, prop.major, prop.minor);
            return 0;
        }
        std::printf("device: %s; cuBLASLt %zu; fast accumulation %s\n", prop.name, cublasLtGetVersion(),
                    o.fast_accum ? "on" : "off");
        const CublasLt lt;
        const Stream stream;
        const int C = o.C;
        std::vector<Row> rows;
        rows.push_back(run_case(lt, stream, o, "qkv", o.layers, C, 3 * C, true, 11));
        rows.push_back(run_case(lt, stream, o, "attproj", o.layers, C, C, true, 22));
        rows.push_back(run_case(lt, stream, o, "fc", o.layers, C, 4 * C, true, 33));
        rows.push_back(run_case(lt, stream, o, "fcproj", o.layers, 4 * C, C, true, 44));
        rows.push_back(run_case(lt, stream, o, "lm_head", 1, C, o.Vp, false, 55));

        const double N = double(o.B) * o.T;
        std::printf("\n%-8s %8s %8s %8s %9s %9s %7s %9s %9s\n", "matmul", "bf16 ms", "fp8 ms", "speedup",
                    "cast x ms", "cast w ms", "TF/s 8", "rel err", "max err");
        double total16 = 0, total8 = 0, total8_cast = 0;
        bool ok = true;
        const int64_t shapes[5][2] = {{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}, {C, o.Vp}};
        for (size_t i = 0; i < rows.size(); i++) {
            const Row& r = rows[i];
            const double flops = 2.0 * N * double(shapes[i][0]) * double(shapes[i][1]);
            std::printf("%-8s %8.3f %8.3f %7.2fx %9.3f %9.3f %7.0f %9.2e %9.2e%s\n", r.name.c_str(), r.bf16_ms, r.fp8_ms,
                        r.bf16_ms / r.fp8_ms, r.cast_x_ms, r.cast_w_ms, flops / (r.fp8_ms * 1e-3) / 1e12, r.rel_err,
                        r.max_err, r.rel_err <= o.tol ? "" : "  <- above --tol");
            ok = ok && r.rel_err <= o.tol;
            total16 += r.per_step * r.bf16_ms;
            total8 += r.per_step * r.fp8_ms;
            total8_cast += r.per_step * (r.fp8_ms + r.cast_x_ms);
        }
        std::printf("\nforward matmuls of one %d x %d micro-batch (per-layer calls x %d, LM head once):\n", o.B, o.T,
                    o.layers);
        std::printf("  bf16 %.2f ms; fp8 %.2f ms (%.2fx); fp8 with each activation's cast %.2f ms (%.2fx)\n", total16,
                    total8, total16 / total8, total8_cast, total16 / total8_cast);
        std::printf("%s: every fp8 result within relative error %.3g of bf16\n", ok ? "PASS" : "FAIL", o.tol);
        return ok ? 0 : 1;
    });
}
