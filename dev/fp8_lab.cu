/*
fp8_lab: how much faster, and how much less exact, would a GPT-2 step's matmuls be with FP8 operands and
per-tensor scales than with the bf16 ones the trainer runs?

  build/fp8_lab [--B 64] [--T 1024] [--C 768] [--Vp 50304] [--layers 12] [--warmup 5] [--reps 20]
                [--fast-accum 0|1] [--tol 0.08] [--tol-bwd 0.15]

For each matmul of the model (qkv: C -> 3C, attention projection: C -> C, fc: C -> 4C, fc projection:
4C -> C, each with a bias; the LM head: C -> Vp without one), at N = B*T rows, with inputs shaped like
the trainer's (activations ~ N(0, 1), weights ~ N(0, 0.02), output gradients ~ N(0, 1e-3), from a seeded
hash):
  - forward D (N, OC) = X (N, K) W (OC, K)^T + bias. bf16: llmc/matmul.cuh's matmul_forward, as the
    trainer calls it (bias epilogue). fp8: X and W each cast to E4M3 with a per-tensor scale 448 / amax
    (current scaling: one pass for the amax, one for the cast), then one cuBLASLt matmul in the "TN"
    layout FP8 requires on Hopper (both operands K-major: our row-major X and W already are), bf16
    output, fp32 accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM from --fast-accum), the dequantising
    scales through CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER and the bias in the epilogue;
  - backward dX (N, K) = dD (N, OC) W and dW (OC, K) = dD^T X. bf16: two plain gemm() calls. fp8: the
    gradient dD in E5M2 (scale 57344 / amax: 2 mantissa bits, the range gradients need), the other
    operand in E4M3; "TN" needs every operand K-major, so dX takes a transposed copy of W (K, OC) and dW
    transposed copies of dD (OC, N) and X (K, N), each made by a cast that transposes through shared
    memory (a trainer would write X's transposed copy where X is produced, and W's once per step).
Each is timed with CUDA events (median of --reps after --warmup), the casts separately from the matmuls.
The fp8 results are compared with the bf16 ones: relative error ||D8 - D16|| / ||D16|| (Frobenius),
which must be under --tol forward and --tol-bwd backward, and the largest |D8 - D16| over max |D16|.
The summaries add the per-layer calls --layers times and the LM head once: one B x T micro-batch's
forward and backward matmul time, bf16 against fp8 with and without the casts of the activations and
gradients (weights' casts are once per step, so listed apart).

Exit 1 when an fp8 result is outside its tolerance. Needs a GPU with FP8 tensor cores (compute
capability 8.9 or 9.0+); elsewhere it says so and exits 0.

Does not provide: delayed scaling from an amax history, fused casts, the bias gradient, sustained timing
under a power cap (dev/matmul_lab.cu --sustain does that for bf16), or anything in the trainer.
*/
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
    int B = 64, T = 1024, C = 768, Vp = 50304, layers = 12, warmup = 5, reps = 20;
    bool fast_accum = false;
    double tol = 0.08, tol_bwd = 0.15;
};

bool parse_args(int argc, char** argv, Options& o) {
    Flags flags("fp8_lab", "Times and checks a GPT-2 step's matmuls in FP8 (E4M3, E5M2 gradients) against bf16.");
    flags.add("", "B", &o.B, "batch size", 1, 1 << 16)
        .add("", "T", &o.T, "sequence length", 1, 1 << 20)
        .add("", "C", &o.C, "channels (qkv: 3C, fc: 4C); a multiple of 16", 16, 1 << 16)
        .add("", "Vp", &o.Vp, "padded vocabulary size (the LM head's OC); a multiple of 16", 16, 1 << 22)
        .add("", "layers", &o.layers, "layers: the per-layer calls' count in the summary", 1, 1024)
        .add("", "warmup", &o.warmup, "untimed runs before timing", 0, 1000)
        .add("", "reps", &o.reps, "timed runs (median)", 1, 10000)
        .add("", "fast-accum", &o.fast_accum, "cuBLASLt's FP8 fast accumulation (less exact, faster)")
        .add("", "tol", &o.tol, "largest relative Frobenius error of an fp8 forward result against bf16", 0.0, 1.0)
        .add("", "tol-bwd", &o.tol_bwd, "the same for the backward results (E5M2 gradients)", 0.0, 1.0);
    if (!flags.parse(argc, argv)) return false;
    if ((int64_t(o.B) * o.T) % 16 != 0 || o.C % 16 != 0 || o.Vp % 16 != 0) {
        fail(kExitUsage, "fp8_lab: FP8 matmuls need B*T, C and Vp to be multiples of 16 (B*T=%lld C=%d Vp=%d)",
             (long long)o.B * o.T, o.C, o.Vp);
    }
    std::fputs(flags.settings_table().c_str(), stdout);
    return true;
}

// A normal-ish value from (seed, index): the sum of four uniforms, centred and scaled to unit variance.
// The seed is spread over the 64 bits first: tensors filled from nearby seeds (seed, seed + 3) would
// otherwise share hash inputs at shifted indices and come out correlated.
__device__ float hashed_normal(uint64_t seed, int64_t i) {
    float sum = 0.0f;
    const uint64_t base = (seed + 1) * 0xd1342543de82ef95ull;
    for (int k = 0; k < 4; k++) {
        uint64_t z = base + uint64_t(i) * 4 + uint64_t(k) + 0x9e3779b97f4a7c15ull;
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


// How far a is from the reference b: ||a - b|| / ||b|| (Frobenius), and max |a - b| / max |b|.
struct Diff {
    double rel = 0, max = 0;
};

Diff compare(const floatX* a, const floatX* b, int64_t n, cudaStream_t stream) {
    DeviceBuffer<double> sums(2);
    DeviceBuffer<unsigned int> maxima(2);
    cudaCheck(cudaMemsetAsync(sums.get(), 0, 2 * sizeof(double), stream));
    cudaCheck(cudaMemsetAsync(maxima.get(), 0, 2 * sizeof(unsigned int), stream));
    compare_kernel<<<kGrid, kBlock, 0, stream>>>(a, b, n, sums.get(), maxima.get());
    cudaCheckLaunch();
    double host_sums[2];
    unsigned int host_max[2];
    cudaCheck(cudaMemcpyAsync(host_sums, sums.get(), sizeof(host_sums), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaMemcpyAsync(host_max, maxima.get(), sizeof(host_max), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    float max_diff, max_ref;
    std::memcpy(&max_diff, &host_max[0], 4);
    std::memcpy(&max_ref, &host_max[1], 4);
    Diff e;
    e.rel = host_sums[1] > 0 ? std::sqrt(host_sums[0] / host_sums[1]) : 0.0;
    e.max = max_ref > 0 ? double(max_diff) / double(max_ref) : 0.0;
    return e;
}

struct Row {
    std::string name;
    int per_step;
    int64_t K, OC;
    // forward
    float bf16_ms, fp8_ms, cast_x_ms, cast_w_ms;
    Diff err;
    // backward: dX = dD W, dW = dD^T X
    float dx16_ms, dw16_ms, dx8_ms, dw8_ms, cast_dd_ms, cast_ddt_ms, cast_xt_ms, cast_wt_ms;
    Diff dx_err, dw_err;
};

// Per-tensor amax slots, each 16-byte aligned (cuBLASLt wants its scale pointers so).
enum Slot { kX, kW, kDD, kDDt, kXt, kWt, kSlots };
constexpr int kSlotStride = 4;

Row run_case(const CublasLt& lt, cudaStream_t stream, const Options& o, const char* name, int per_step, int64_t K,
             int64_t OC, bool with_bias, uint64_t seed) {
    const int64_t N = int64_t(o.B) * o.T;
    DeviceBuffer<floatX> x{size_t(N * K)}, w{size_t(OC * K)}, bias{size_t(OC)}, d16{size_t(N * OC)}, d8{size_t(N * OC)};
    DeviceBuffer<__nv_fp8_e4m3> x8{size_t(N * K)}, w8{size_t(OC * K)};
    DeviceBuffer<unsigned int> amax(kSlots * kSlotStride);
    DeviceBuffer<float> descale(kSlots * kSlotStride);
    auto slot_amax = [&](Slot k) { return amax.get() + k * kSlotStride; };
    auto slot_descale = [&](Slot k) { return descale.get() + k * kSlotStride; };
    fill_normal_kernel<<<kGrid, kBlock, 0, stream>>>(x.get(), N * K, seed, 1.0f);
    cudaCheckLaunch();
    fill_normal_kernel<<<kGrid, kBlock, 0, stream>>>(w.get(), OC * K, seed + 1, 0.02f);
    cudaCheckLaunch();
    fill_normal_kernel<<<kGrid, kBlock, 0, stream>>>(bias.get(), OC, seed + 2, 0.02f);
    cudaCheckLaunch();

    auto cast = [&](auto* dst, const floatX* src, int64_t n, Slot k) {
        fp8_amax(src, n, slot_amax(k), stream);
        fp8_cast(dst, src, n, slot_amax(k), slot_descale(k), stream);
    };
    // src (rows, cols) -> dst (cols, rows).
    auto cast_transposed = [&](auto* dst, const floatX* src, int64_t rows, int64_t cols, Slot k) {
        fp8_amax(src, rows * cols, slot_amax(k), stream);
        fp8_cast_transposed(dst, src, rows, cols, slot_amax(k), slot_descale(k), stream);
    };
    auto time = [&](auto f) { return median_ms(stream, o.warmup, o.reps, f); };

    const floatX* b = with_bias ? bias.get() : nullptr;
    Row r{};
    r.name = name;
    r.per_step = per_step;
    r.K = K;
    r.OC = OC;
    // Forward.
    r.bf16_ms = time([&] { matmul_forward(lt, d16.get(), x.get(), w.get(), b, N, int(K), int(OC), stream); });
    r.cast_x_ms = time([&] { cast(x8.get(), x.get(), N * K, kX); });
    r.cast_w_ms = time([&] { cast(w8.get(), w.get(), OC * K, kW); });
    {
        const Fp8Gemm mm(lt, N, OC, K, x8.get(), w8.get(), slot_descale(kX), slot_descale(kW), d8.get(), b,
                         o.fast_accum);
        r.fp8_ms = time([&] { mm.run(stream); });
        r.err = compare(d8.get(), d16.get(), N * OC, stream);
    }

    // Backward: d16 becomes the output gradient dD.
    floatX* dd = d16.get();
    fill_normal_kernel<<<kGrid, kBlock, 0, stream>>>(dd, N * OC, seed + 3, 1e-3f);
    cudaCheckLaunch();
    DeviceBuffer<floatX> dx16{size_t(N * K)}, dx8{size_t(N * K)}, dw16{size_t(OC * K)}, dw8{size_t(OC * K)};
    DeviceBuffer<__nv_fp8_e5m2> dd8{size_t(N * OC)}, ddt8{size_t(N * OC)};
    DeviceBuffer<__nv_fp8_e4m3> xt8{size_t(N * K)}, wt8{size_t(OC * K)};
    r.dx16_ms = time([&] {
        gemm(lt, stream, N, K, OC, GemmOperand{dd, OC, false, 0}, GemmOperand{w.get(), K, false, 0}, dx16.get(),
             CUDA_R_16BF, K, 0, 1, 1.0f, 0.0f);
    });
    r.dw16_ms = time([&] {
        gemm(lt, stream, OC, K, N, GemmOperand{dd, OC, true, 0}, GemmOperand{x.get(), K, false, 0}, dw16.get(),
             CUDA_R_16BF, K, 0, 1, 1.0f, 0.0f);
    });
    r.cast_dd_ms = time([&] { cast(dd8.get(), dd, N * OC, kDD); });
    r.cast_ddt_ms = time([&] { cast_transposed(ddt8.get(), dd, N, OC, kDDt); });
    r.cast_xt_ms = time([&] { cast_transposed(xt8.get(), x.get(), N, K, kXt); });
    r.cast_wt_ms = time([&] { cast_transposed(wt8.get(), w.get(), OC, K, kWt); });
    {
        // dX (N, K) = dD (N, OC) @ (W^T (K, OC))^T.
        const Fp8Gemm mm(lt, N, K, OC, dd8.get(), wt8.get(), slot_descale(kDD), slot_descale(kWt), dx8.get(), nullptr,
                         o.fast_accum);
        r.dx8_ms = time([&] { mm.run(stream); });
        r.dx_err = compare(dx8.get(), dx16.get(), N * K, stream);
    }
    {
        // dW (OC, K) = dD^T (OC, N) @ (X^T (K, N))^T.
        const Fp8Gemm mm(lt, OC, K, N, ddt8.get(), xt8.get(), slot_descale(kDDt), slot_descale(kXt), dw8.get(), nullptr,
                         o.fast_accum);
        r.dw8_ms = time([&] { mm.run(stream); });
        r.dw_err = compare(dw8.get(), dw16.get(), OC * K, stream);
    }
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
        if (!fp8_supported()) {
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
        bool ok = true;
        auto mark = [](double err, double tol) { return err <= tol ? "" : "  <- above its tolerance"; };
        std::printf("\nforward  D = X W^T + bias (E4M3 x E4M3)\n%-8s %8s %8s %8s %9s %9s %7s %9s %9s\n", "matmul",
                    "bf16 ms", "fp8 ms", "speedup", "cast x ms", "cast w ms", "TF/s 8", "rel err", "max err");
        double total16 = 0, total8 = 0, total8_cast = 0, weights_cast = 0;
        for (const Row& r : rows) {
            const double flops = 2.0 * N * double(r.K) * double(r.OC);
            std::printf("%-8s %8.3f %8.3f %7.2fx %9.3f %9.3f %7.0f %9.2e %9.2e%s\n", r.name.c_str(), r.bf16_ms, r.fp8_ms,
                        r.bf16_ms / r.fp8_ms, r.cast_x_ms, r.cast_w_ms, flops / (r.fp8_ms * 1e-3) / 1e12, r.err.rel,
                        r.err.max, mark(r.err.rel, o.tol));
            ok = ok && r.err.rel <= o.tol;
            total16 += r.per_step * r.bf16_ms;
            total8 += r.per_step * r.fp8_ms;
            total8_cast += r.per_step * (r.fp8_ms + r.cast_x_ms);
            weights_cast += r.per_step * (r.cast_w_ms + r.cast_wt_ms);
        }
        std::printf("\nbackward dX = dD W, dW = dD^T X (E5M2 gradient x E4M3)\n%-8s %8s %8s %8s %8s %8s %9s %9s %9s "
                    "%9s %9s\n", "matmul", "dX bf16", "dX fp8", "dW bf16", "dW fp8", "speedup", "cast dD", "cast dDt",
                    "cast Xt", "dX err", "dW err");
        double btotal16 = 0, btotal8 = 0, btotal8_cast = 0;
        for (const Row& r : rows) {
            const double b16 = r.dx16_ms + r.dw16_ms, b8 = r.dx8_ms + r.dw8_ms;
            std::printf("%-8s %8.3f %8.3f %8.3f %8.3f %7.2fx %9.3f %9.3f %9.3f %9.2e %9.2e%s%s\n", r.name.c_str(),
                        r.dx16_ms, r.dx8_ms, r.dw16_ms, r.dw8_ms, b16 / b8, r.cast_dd_ms, r.cast_ddt_ms, r.cast_xt_ms,
                        r.dx_err.rel, r.dw_err.rel, mark(r.dx_err.rel, o.tol_bwd), mark(r.dw_err.rel, o.tol_bwd));
            ok = ok && r.dx_err.rel <= o.tol_bwd && r.dw_err.rel <= o.tol_bwd;
            btotal16 += r.per_step * b16;
            btotal8 += r.per_step * b8;
            btotal8_cast += r.per_step * (b8 + r.cast_dd_ms + r.cast_ddt_ms + r.cast_xt_ms);
        }
        std::printf("\nmatmuls of one %d x %d micro-batch (per-layer calls x %d, LM head once):\n", o.B, o.T, o.layers);
        std::printf("  forward:  bf16 %.2f ms; fp8 %.2f ms (%.2fx); fp8 with each activation's cast %.2f ms (%.2fx)\n",
                    total16, total8, total16 / total8, total8_cast, total16 / total8_cast);
        std::printf("  backward: bf16 %.2f ms; fp8 %.2f ms (%.2fx); fp8 with the gradients' casts and X's transposed "
                    "copy %.2f ms (%.2fx)\n", btotal16, btotal8, btotal16 / btotal8, btotal8_cast, btotal16 / btotal8_cast);
        std::printf("  both:     bf16 %.2f ms; fp8 %.2f ms (%.2fx); with those casts %.2f ms (%.2fx); the weights' casts "
                    "(W and W^T, once per step) %.2f ms\n", total16 + btotal16, total8 + btotal8,
                    (total16 + btotal16) / (total8 + btotal8), total8_cast + btotal8_cast,
                    (total16 + btotal16) / (total8_cast + btotal8_cast), weights_cast);
        std::printf("%s: every fp8 result within relative error %.3g (forward) and %.3g (backward) of bf16\n",
                    ok ? "PASS" : "FAIL", o.tol, o.tol_bwd);
        return ok ? 0 : 1;
    });
}
