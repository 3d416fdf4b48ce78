/*
fp8_epilogue_lab: which cuBLASLt FP8 matmul outputs and epilogues exist on this GPU, what they cost, and
what their amax and FP8 outputs hold. The MLP's remaining bf16 matmuls (fcproj forward, the fc and
fcproj backward) need their FP8 operands written by the matmul before them; this lab asks cuBLASLt
whether it can do that and at what price.

  build/fp8_epilogue_lab [--B 64] [--T 1024] [--C 768] [--warmup 5] [--reps 20]

At N = B*T rows it runs, each from E4M3 operands (activations ~ N(0, 1), weights ~ N(0, 0.02)):
  fc (N, 4C) from K = C, forward variants:
    bf16 D, GELU_AUX_BIAS (the trainer's fc today);  bf16 D, BIAS;  bf16 D, BIAS and AMAX_D;
    bf16 D, GELU_AUX_BIAS and AMAX_D;  E4M3 D (scale_d, amax_d), BIAS;  E4M3 D, GELU_AUX_BIAS with a bf16
    aux;  E4M3 D, GELU_AUX_BIAS with an fp16 aux;
  fcproj (N, C) from K = 4C: bf16 D with BIAS, fast accumulation off and on;
  fcproj dW (C, 4C) from K = N (E5M2 x E4M3, accumulating);
  fcproj dX (N, 4C) from K = C (E5M2 x E4M3): bf16 D, DGELU (bf16 aux); E5M2 D (scale_d, amax_d), DGELU;
    bf16 D, DGELU and AMAX_D.
For each: whether the heuristic offers an algorithm (else "unsupported" with the status), and the median
time of --reps runs. Checks, where the variant runs: AMAX_D against max |D| of the bf16 output (does it
see the epilogue's output?), the FP8 D (dequantised with 1 / scale_d) against the bf16 D of the same
epilogue (relative Frobenius error), and whether an FP8 D saturates or writes NaN when scale_d is 16x too
large (E4M3 has no infinity: an unsaturated overflow is NaN).

Exit 0 after printing; it judges nothing (a lab: docs/lab-notes.md says what was learned). Needs a GPU
with FP8 tensor cores; elsewhere it says so and exits 0.
*/
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flags.h"
#include "llmc/fp8.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

using namespace llmc;

namespace {

struct Options {
    int B = 64, T = 1024, C = 768, warmup = 5, reps = 20;
};

__global__ void fill_kernel(floatX* x, int64_t n, uint64_t seed, float stddev) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        uint64_t z = (seed + 1) * 0xd1342543de82ef95ull + uint64_t(i) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        // a sum of two uniforms, centred: roughly bell-shaped, unit variance
        const float u = float(z >> 40) * (1.0f / 16777216.0f), v = float((z >> 16) & 0xffffff) * (1.0f / 16777216.0f);
        x[i] = floatX(stddev * (u + v - 1.0f) * 2.4494897f);
    }
}

// sums[0] += (fp8 value * descale - ref)^2, sums[1] += ref^2; counts[0] += NaN bytes, counts[1] += bytes at +-max.
template <class Fp8>
__global__ void compare_fp8_kernel(const __nv_fp8_storage_t* q, const floatX* ref, int64_t n, const float* scale,
                                   double* sums, unsigned long long* counts) {
    double d2 = 0, r2 = 0;
    unsigned long long nan = 0, at_max = 0;
    const float descale = 1.0f / *scale;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float v = fp8_value<Fp8>(q[i]);
        if (isnan(v)) {
            nan++;
            continue;
        }
        if (fabsf(v) == Fp8Format<Fp8>::kMax) at_max++;
        const float r = float(ref[i]);
        d2 += double(v * descale - r) * double(v * descale - r);
        r2 += double(r) * double(r);
    }
    atomicAdd(&sums[0], d2);
    atomicAdd(&sums[1], r2);
    atomicAdd(&counts[0], nan);
    atomicAdd(&counts[1], at_max);
}


const char* type_name(cudaDataType_t t) {
    switch (t) {
        case CUDA_R_16BF: return "bf16";
        case CUDA_R_16F: return "fp16";
        case CUDA_R_8F_E4M3: return "E4M3";
        case CUDA_R_8F_E5M2: return "E5M2";
        default: return "?";
    }
}

// One variant: D (M, N) row-major = P (M, K) Q (N, K)^T, both K-major, as Fp8Gemm lays them out.
struct Variant {
    std::string name;
    int64_t M, N, K;
    cudaDataType_t p_type, q_type, d_type;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    cudaDataType_t aux_type = CUDA_R_16BF;
    bool amax = false, fast = false, accumulate = false;
};

struct Buffers {
    const void *p, *q;
    void* d;
    void* aux;
    const floatX* bias;
    const float *descale_p, *descale_q, *scale_d;
    float* amax_d;
};

// Runs the variant (timed) when cuBLASLt has an algorithm for it; returns whether it did.
bool run_variant(const CublasLt& lt, cudaStream_t stream, const Options& o, const Variant& v, const Buffers& b) {
    detail::LtMatmulDesc desc;
    desc.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    desc.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(b.descale_q));
    desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(b.descale_p));
    desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(v.fast ? 1 : 0));
    const bool fp8_d = v.d_type == CUDA_R_8F_E4M3 || v.d_type == CUDA_R_8F_E5M2;
    if (fp8_d) desc.set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void*>(b.scale_d));
    if (v.amax) desc.set(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(b.amax_d));
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, v.epilogue);
    const bool bias = v.epilogue == CUBLASLT_EPILOGUE_BIAS || v.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const bool aux = v.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || v.epilogue == CUBLASLT_EPILOGUE_GELU_AUX ||
                     v.epilogue == CUBLASLT_EPILOGUE_DGELU;
    if (bias) {
        desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_16BF);
        desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(b.bias));
    }
    if (aux) {
        desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, b.aux);
        desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t(v.N));
        desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, int32_t(v.aux_type));
    }
    detail::LtLayout a(v.q_type, v.K, v.N, v.K, 1, 0), bl(v.p_type, v.K, v.M, v.K, 1, 0);
    // C: bf16 (an FP8 D takes a bf16 C, unread at beta 0); D: the variant's type.
    detail::LtLayout c(CUDA_R_16BF, v.N, v.M, v.N, 1, 0), d(v.d_type, v.N, v.M, v.N, 1, 0);
    detail::LtPreference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(lt.workspace_bytes()));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(lt.handle(), desc.d, a.l, bl.l, c.l, d.l, pref.p, 1, &result, &found);
    const double flops = 2.0 * double(v.M) * double(v.N) * double(v.K);
    std::printf("%-44s P %s Q %s D %s%s: ", v.name.c_str(), type_name(v.p_type), type_name(v.q_type),
                type_name(v.d_type), aux ? (std::string(", aux ") + type_name(v.aux_type)).c_str() : "");
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        std::printf("unsupported (status %d, %d algorithms)\n", int(st), found);
        return false;
    }
    const float alpha = 1.0f, beta = v.accumulate ? 1.0f : 0.0f;
    // An FP8 D gets no C pointer of its own: beta is 0 and C is not read.
    const void* cptr = fp8_d ? nullptr : b.d;
    auto run = [&]() {
        cublasCheck(cublasLtMatmul(lt.handle(), desc.d, &alpha, b.q, a.l, b.p, bl.l, &beta, cptr, c.l, b.d, d.l,
                                   &result.algo, lt.workspace(), lt.workspace_bytes(), stream));
    };
    const float ms = median_ms(stream, o.warmup, o.reps, run);
    std::printf("%7.3f ms  %6.0f TFLOP/s\n", ms, flops / (ms * 1e-3) / 1e12);
    return true;
}

float read_float(const float* p) {
    float v = 0;
    cudaCheck(cudaMemcpy(&v, p, sizeof(float), cudaMemcpyDeviceToHost));
    return v;
}

float amax_of(const floatX* x, int64_t n, unsigned int* bits, cudaStream_t stream) {
    fp8_amax(x, n, bits, stream);
    unsigned int u = 0;
    cudaCheck(cudaMemcpyAsync(&u, bits, sizeof(u), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

template <class Fp8>
void compare_fp8(const char* what, const void* q, const floatX* ref, int64_t n, const float* scale, cudaStream_t stream) {
    DeviceBuffer<double> sums(2);
    DeviceBuffer<unsigned long long> counts(2);
    cudaCheck(cudaMemsetAsync(sums.get(), 0, sums.bytes(), stream));
    cudaCheck(cudaMemsetAsync(counts.get(), 0, counts.bytes(), stream));
    compare_fp8_kernel<Fp8><<<1056, 256, 0, stream>>>(static_cast<const __nv_fp8_storage_t*>(q), ref, n, scale,
                                                       sums.get(), counts.get());
    cudaCheckLaunch();
    double s[2];
    unsigned long long c[2];
    cudaCheck(cudaMemcpyAsync(s, sums.get(), sizeof(s), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaMemcpyAsync(c, counts.get(), sizeof(c), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    std::printf("    %-60s rel err %.2e, NaN bytes %llu, at +-max %llu of %lld\n", what, std::sqrt(s[0] / s[1]), c[0],
                c[1], (long long)n);
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&]() -> int {
        Options o;
        Flags flags("fp8_epilogue_lab", "Which cuBLASLt FP8 outputs and epilogues run, their cost, amax and saturation.");
        flags.add("", "B", &o.B, "batch size", 1, 1 << 16)
            .add("", "T", &o.T, "sequence length", 1, 1 << 20)
            .add("", "C", &o.C, "channels; a multiple of 16", 16, 1 << 16)
            .add("", "warmup", &o.warmup, "untimed runs before timing", 0, 1000)
            .add("", "reps", &o.reps, "timed runs (median)", 1, 10000);
        if (!flags.parse(argc, argv)) return 0;
        const int64_t N = int64_t(o.B) * o.T, C = o.C;
        if (N % 16 != 0 || C % 16 != 0) fail(kExitUsage, "fp8_epilogue_lab: B*T and C must be multiples of 16");
        if (cuda_device_count() == 0 || !fp8_supported()) {
            std::printf("fp8_epilogue_lab: no GPU with FP8 tensor cores; nothing to measure\n");
            return 0;
        }
        cudaDeviceProp prop{};
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        std::printf("device: %s; cuBLASLt %zu; N=%lld C=%lld\n", prop.name, cublasLtGetVersion(), (long long)N,
                    (long long)C);
        const CublasLt lt;
        const Stream stream;
        // Operands: x (N, 4C) covers the largest activation, w (4C, 4C) the largest weight; E4M3 / E5M2 copies.
        DeviceBuffer<floatX> x(size_t(N * 4 * C)), w(size_t(16 * C * C)), g(size_t(N * 4 * C)), bias(size_t(4 * C));
        fill_kernel<<<1056, 256, 0, stream>>>(x.get(), N * 4 * C, 1, 1.0f);
        fill_kernel<<<1056, 256, 0, stream>>>(w.get(), 16 * C * C, 2, 0.02f);
        fill_kernel<<<1056, 256, 0, stream>>>(g.get(), N * 4 * C, 3, 1e-3f);
        fill_kernel<<<1056, 256, 0, stream>>>(bias.get(), 4 * C, 4, 0.02f);
        cudaCheckLaunch();
        DeviceBuffer<__nv_fp8_e4m3> x8(size_t(N * 4 * C)), w8(size_t(16 * C * C));
        DeviceBuffer<__nv_fp8_e5m2> g8(size_t(N * 4 * C));
        DeviceBuffer<unsigned int> amax_bits(16);
        DeviceBuffer<float> scales(32);  // descale x at 0, w at 4, g at 8; scale_d at 12; amax_d at 16
        fp8_amax(x.get(), N * 4 * C, amax_bits.get(), stream);
        fp8_cast(x8.get(), x.get(), N * 4 * C, amax_bits.get(), scales.get(), stream);
        fp8_amax(w.get(), 16 * C * C, amax_bits.get() + 4, stream);
        fp8_cast(w8.get(), w.get(), 16 * C * C, amax_bits.get() + 4, scales.get() + 4, stream);
        fp8_amax(g.get(), N * 4 * C, amax_bits.get() + 8, stream);
        fp8_cast(g8.get(), g.get(), N * 4 * C, amax_bits.get() + 8, scales.get() + 8, stream);
        float* scale_d = scales.get() + 12;
        float* amax_d = scales.get() + 16;
        DeviceBuffer<floatX> d16(size_t(N * 4 * C)), pre(size_t(N * 4 * C)), ref(size_t(N * 4 * C));
        DeviceBuffer<__half> pre16(size_t(N * 4 * C));
        DeviceBuffer<uint8_t> d8(size_t(N * 4 * C));
        Buffers b{x8.get(), w8.get(), d16.get(), pre.get(), bias.get(), scales.get(), scales.get() + 4, scale_d, amax_d};
        const float one = 1.0f;
        cudaCheck(cudaMemcpy(scale_d, &one, sizeof(float), cudaMemcpyHostToDevice));
        auto set_scale = [&](float s) { cudaCheck(cudaMemcpy(scale_d, &s, sizeof(float), cudaMemcpyHostToDevice)); };
        const cudaDataType_t E4 = CUDA_R_8F_E4M3, E5 = CUDA_R_8F_E5M2, BF = CUDA_R_16BF;
        const int64_t D4C = N * 4 * C;

        std::printf("\nfc: (N, 4C) from K = C\n");
        Variant fc{"fc  GELU_AUX_BIAS (the trainer's)", N, 4 * C, C, E4, E4, BF, CUBLASLT_EPILOGUE_GELU_AUX_BIAS};
        fc.fast = true;
        run_variant(lt, stream, o, fc, b);
        cudaCheck(cudaMemcpy(ref.get(), d16.get(), size_t(D4C) * sizeof(floatX), cudaMemcpyDeviceToDevice));  // GELU out
        const float gelu_amax = amax_of(ref.get(), D4C, amax_bits.get() + 12, stream);
        const float pre_amax = amax_of(pre.get(), D4C, amax_bits.get() + 12, stream);
        std::printf("    max |GELU output| %.6g, max |pre-GELU| %.6g\n", gelu_amax, pre_amax);
        Variant v = fc;
        v.name = "fc  BIAS";
        v.epilogue = CUBLASLT_EPILOGUE_BIAS;
        run_variant(lt, stream, o, v, b);
        v.name = "fc  BIAS, AMAX_D";
        v.amax = true;
        cudaCheck(cudaMemset(amax_d, 0, sizeof(float)));
        if (run_variant(lt, stream, o, v, b)) {
            std::printf("    AMAX_D %.6g, max |D| of the bf16 D %.6g\n", read_float(amax_d),
                        amax_of(d16.get(), D4C, amax_bits.get() + 12, stream));
        }
        v.name = "fc  GELU_AUX_BIAS, AMAX_D";
        v.epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
        cudaCheck(cudaMemset(amax_d, 0, sizeof(float)));
        if (run_variant(lt, stream, o, v, b)) std::printf("    AMAX_D %.6g\n", read_float(amax_d));
        // FP8 D: scale_d from the bf16 runs' amax (as delayed scaling would from the last step's).
        b.d = d8.get();
        v.d_type = E4;
        v.name = "fc  E4M3 D, BIAS, AMAX_D";
        v.epilogue = CUBLASLT_EPILOGUE_BIAS;
        set_scale(448.0f / pre_amax);
        cudaCheck(cudaMemset(amax_d, 0, sizeof(float)));
        if (run_variant(lt, stream, o, v, b)) {
            std::printf("    AMAX_D %.6g (pre-GELU max %.6g)\n", read_float(amax_d), pre_amax);
            compare_fp8<__nv_fp8_e4m3>("E4M3 D / scale_d against the bf16 pre-GELU", d8.get(), pre.get(), D4C, scale_d,
                                        stream);
        }
        v.name = "fc  E4M3 D, GELU_AUX_BIAS, AMAX_D";
        v.epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
        set_scale(448.0f / gelu_amax);
        cudaCheck(cudaMemset(amax_d, 0, sizeof(float)));
        DeviceBuffer<floatX> pre_keep{size_t(D4C)};
        cudaCheck(cudaMemcpy(pre_keep.get(), pre.get(), size_t(D4C) * sizeof(floatX), cudaMemcpyDeviceToDevice));
        if (run_variant(lt, stream, o, v, b)) {
            std::printf("    AMAX_D %.6g (GELU max %.6g)\n", read_float(amax_d), gelu_amax);
            compare_fp8<__nv_fp8_e4m3>("E4M3 D / scale_d against the bf16 GELU output", d8.get(), ref.get(), D4C, scale_d,
                                        stream);
            set_scale(16.0f * 448.0f / gelu_amax);
            run_variant(lt, stream, o, v, b);
            compare_fp8<__nv_fp8_e4m3>("the same with scale_d 16x too large", d8.get(), ref.get(), D4C, scale_d, stream);
        }
        v.name = "fc  E4M3 D, GELU_AUX_BIAS, AMAX_D";
        v.aux_type = CUDA_R_16F;
        b.aux = pre16.get();
        set_scale(448.0f / gelu_amax);
        if (run_variant(lt, stream, o, v, b)) {
            compare_fp8<__nv_fp8_e4m3>("E4M3 D / scale_d against the bf16 GELU output", d8.get(), ref.get(), D4C, scale_d,
                                        stream);
        }
        b.aux = pre.get();
        b.d = d16.get();

        std::printf("\nfcproj: (N, C) from K = 4C\n");
        Variant fp{"fcproj  BIAS", N, C, 4 * C, E4, E4, BF, CUBLASLT_EPILOGUE_BIAS};
        run_variant(lt, stream, o, fp, b);
        fp.name = "fcproj  BIAS, fast accumulation";
        fp.fast = true;
        run_variant(lt, stream, o, fp, b);

        std::printf("\nfcproj dW: (C, 4C) from K = N, accumulating\n");
        Buffers bw = b;
        bw.p = g8.get();  // dD^T (C, N): any E5M2 bytes of that size
        bw.q = x8.get();  // GELU^T (4C, N)
        bw.descale_p = scales.get() + 8;
        bw.descale_q = scales.get();
        Variant dw{"fcproj dW", C, 4 * C, N, E5, E4, BF};
        dw.accumulate = true;
        run_variant(lt, stream, o, dw, bw);

        std::printf("\nfcproj dX: (N, 4C) from K = C, times GELU'(pre-GELU)\n");
        Buffers bx = b;
        bx.p = g8.get();  // dD (N, C)
        bx.q = w8.get();  // fcproj W^T (4C, C)
        bx.descale_p = scales.get() + 8;
        bx.aux = pre_keep.get();
        Variant dx{"fcproj dX  DGELU", N, 4 * C, C, E5, E4, BF, CUBLASLT_EPILOGUE_DGELU};
        run_variant(lt, stream, o, dx, bx);
        cudaCheck(cudaMemcpy(ref.get(), d16.get(), size_t(D4C) * sizeof(floatX), cudaMemcpyDeviceToDevice));
        const float dfch_amax = amax_of(ref.get(), D4C, amax_bits.get() + 12, stream);
        dx.name = "fcproj dX  DGELU, AMAX_D";
        dx.amax = true;
        cudaCheck(cudaMemset(amax_d, 0, sizeof(float)));
        if (run_variant(lt, stream, o, dx, bx)) {
            std::printf("    AMAX_D %.6g, max |D| %.6g\n", read_float(amax_d), dfch_amax);
        }
        dx.name = "fcproj dX  E5M2 D, DGELU, AMAX_D";
        dx.d_type = E5;
        bx.d = d8.get();
        set_scale(57344.0f / dfch_amax);
        if (run_variant(lt, stream, o, dx, bx)) {
            compare_fp8<__nv_fp8_e5m2>("E5M2 D / scale_d against the bf16 DGELU output", d8.get(), ref.get(), D4C,
                                        scale_d, stream);
        }
        dx.name = "fcproj dX  E4M3 D, DGELU, AMAX_D";
        dx.d_type = E4;
        set_scale(448.0f / dfch_amax);
        if (run_variant(lt, stream, o, dx, bx)) {
            compare_fp8<__nv_fp8_e4m3>("E4M3 D / scale_d against the bf16 DGELU output", d8.get(), ref.get(), D4C,
                                        scale_d, stream);
        }
        dx.name = "fcproj dX  plain (no epilogue)";
        dx.d_type = BF;
        dx.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
        dx.amax = false;
        bx.d = d16.get();
        run_variant(lt, stream, o, dx, bx);
        cudaCheck(cudaStreamSynchronize(stream));
        return 0;
    });
}
