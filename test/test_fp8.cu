/*
GPU tests of the FP8 building blocks (llmc/fp8.cuh) against host computations on the same values. Skipped
without a GPU, or on one without FP8 tensor cores (compute capability below 8.9).

  - fp8_amax_fold (zeroed first: fp8_amax below): the exact max |x| (its float bits) of bf16 values, zeros
    and negatives included;
  - fp8_amax_batch: each of several tensors' exact amax (sizes 1 to 2.4M, 16-byte aligned or not) in one
    launch, nothing else written;
  - fp8_cast (E4M3 and E5M2): every byte equal to the host's conversion of x * scale (round to nearest,
    saturating), scale = kMax / amax, the descale exactly 1 / scale; an all-zero tensor gets scale 1;
  - fp8_dequantize: every value equal to bf16(q * descale) on both of its paths, and a round trip
    within half an FP8 ulp plus bf16's rounding of every value in the format's normal range;
  - fp8_cast_transposed: byte for byte the transpose of fp8_cast's result, at shapes that are not
    multiples of its 64 x 64 tiles;
  - Fp8Gemm: D against the product of the dequantised operands computed in double on the host, within
    5e-3 relative (Frobenius) and 1e-2 of max |D| for any element (D is rounded to bf16, 2^-9 relative;
    fp32 accumulation adds little): E4M3 x E4M3 with a bias, E5M2 x E4M3 without; and the backward's use,
    dX = dD W from dD in E5M2 and a transposed E4M3 copy of W, against the same product and within 0.15
    of the bf16 one (E5M2 keeps 2 mantissa bits);
  - Fp8Gemm's accumulate: D = D0 + the product, within the same bounds;
  - Fp8Gemm refuses shapes that are not multiples of 16, two E5M2 operands and unaligned pointers.
  - Fp8Gemm's FP8 output (E4M3, with a bias, with the GELU epilogue): each byte the host's
    conversion of the same matmul's bf16 D times scale_d, or (at most 2% of them, where bf16's rounding
    crossed an FP8 rounding boundary) its neighbour; no NaN, also with a scale_d 16x too large (it
    saturates at kMax); AMAX_D within bf16's half ulp of max |D|; the GELU input (aux) as with a bf16 D;
    and refusals of accumulate, the GELU-gradient epilogue, a missing or unaligned scale_d;
  - fp8_history_push and fp8_delayed_scales: the history shifted newest-first with its count (at most
    len), each slot's scale exactly kMax / the largest of its last len amaxes (1 when all are zero),
    strided slots read and written at their stride only; an inf or NaN amax enters as 0; the count of
    slots whose new amax outgrew their history's largest by more than 3% (none for an empty history);
  - fp8_cast_pair: the row-major bytes equal to the host's conversion and the transposed ones their
    transpose, written into columns of a wider matrix (the bytes around left alone), on the 16-byte path
    and at shapes that are not multiples of 16, and with the row-major copy left out; its column sums of
    each 64-row block bitwise equal to the host's sums in row order;
  - fp8_dgelu_cast_pair: x * GELU'(aux) at a given scale, each byte the host's conversion (the same
    formula in fp32) or, where tanhf's last bit moved it across a rounding boundary (at most 0.1%), its
    neighbour; the transposed copy the row-major one's transpose; the amax and the column sums g's;
  - LayerNorm forward and the fused residual + LayerNorm writing E4M3 (LayerNormFp8Out): every byte the
    host's conversion of the bf16 call's output at the given scale, also with a scale 8x too large (it
    saturates, no NaN); the same amax, mean, rstd and residual as the bf16 call, bit for bit;
  - fp8_transpose: byte for byte the transpose, written into columns of a wider matrix (the bytes around
    left alone), on its 16-byte path and at shapes that are not multiples of its tiles or of 16;
  - fused_classifier_fp8 (llmc/classifier.cuh): the losses bitwise equal to fused_classifier's, every
    dlogit in E5M2 times the descale within E5M2's rounding (2^-3 relative, plus half its smallest step)
    of fused_classifier's bf16 one, padded columns exactly 0, at rows held in registers, in shared
    memory and streamed, and the descale dloss / 57344;
  - each matmul the model's FP8 mode runs (llmc/gpt2.cuh: qkv, fc with its GELU, lm_head, attproj's and
    fcproj's dX, the latter with the GELU gradient, the classifier's dX and dW from E5M2 dlogits, and
    qkv's dX and dW from dqkv cast both ways by fp8_cast_pair),
    at d12's widths, cast and called as the model does
    (fast accumulation forward),
    against the bf16 matmul (llmc/matmul.cuh) on the same bf16 operands: within 0.06 relative
    (Frobenius) forward, GELU input included (E4M3 on both operands: a lab measured 3.8e-2,
    docs/performance.md, "FP8 matmuls in the lab"),
    0.10 backward (E5M2 gradient: 5.9e-2), and any element within 0.2 (forward) or 0.3 (backward) of
    max |D| (the classifier's and qkv's backward: 0.10 and 0.3, dW accumulating onto a gradient already
    there);
    and qkv's and fc's weight gradients from the E4M3 LayerNorm output the model keeps
    (read back with fp8_dequantize) against the bf16 input, within the forward's 0.06 and 0.2;
  - attention_backward_fp8 (llmc/attention.cuh; where the sm_90a kernels run, else skipped with a message):
    every byte of both layouts the host's conversion of attention_backward's bf16 dqkv at the given scale
    (E4M3 and E5M2; at the amax's scale and 16x above it, where many saturate), written over poison (NaN),
    each 64-row block's column sums bitwise the host's in row order (fp8_cast_pair's, above), the amax
    bf16 dqkv's; T not a multiple of 64 refused.
*/
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/fp8.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"
#include "test/expect_error.h"
#include "test/gpu_test.h"
#include "test/matmul_backward.h"

using namespace llmc;

namespace {

using test::download;
using test::upload;

class Fp8Test : public GpuTest {
protected:
    void SetUp() override {
        GpuTest::SetUp();
        if (IsSkipped()) return;
        if (!fp8_supported()) GTEST_SKIP() << "skipped: this GPU has no FP8 tensor cores (compute capability < 8.9)";
    }
};

const cudaStream_t kStream = nullptr;

// *amax_bits = the float bits of max |x| over n bf16 values (zeroed first).
inline void fp8_amax(const floatX* x, int64_t n, unsigned int* amax_bits, cudaStream_t stream) {
    cudaCheck(cudaMemsetAsync(amax_bits, 0, sizeof(unsigned int), stream));
    fp8_amax_fold(x, n, amax_bits, stream);
}

// Normal values times stddev rounded to bf16, every 17th a zero (so zeros are cast too).
std::vector<floatX> random_bf16(size_t n, uint64_t seed, float stddev) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> dist(0.0f, stddev);
    std::vector<floatX> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __float2bfloat16(i % 17 == 5 ? 0.0f : dist(gen));
    return v;
}

float host_amax(const std::vector<floatX>& x) {
    float m = 0.0f;
    for (floatX v : x) m = std::max(m, std::fabs(__bfloat162float(v)));
    return m;
}

template <class Fp8>
float dequantize(Fp8 q) {
    return float(q);
}

// A tensor cast on the GPU: its bytes, amax and descale, plus the host's view.
template <class Fp8>
struct Cast {
    std::vector<Fp8> q;
    float amax = 0, descale = 0;
};

template <class Fp8>
Cast<Fp8> cast_on_gpu(const std::vector<floatX>& x, int64_t rows, int64_t cols, bool transposed,
                      DeviceBuffer<Fp8>& q, DeviceBuffer<unsigned int>& amax, DeviceBuffer<float>& descale) {
    auto d_x = upload(x);
    cudaCheck(cudaMemset(q.get(), 0xff, q.bytes()));  // poisoned: every byte must be written
    fp8_amax(d_x.get(), rows * cols, amax.get(), kStream);
    if (transposed) {
        fp8_cast_transposed(q.get(), d_x.get(), rows, cols, amax.get(), descale.get(), kStream);
    } else {
        fp8_cast(q.get(), d_x.get(), rows * cols, amax.get(), descale.get(), kStream);
    }
    Cast<Fp8> c;
    c.q = download(q.get(), size_t(rows * cols));
    const unsigned int bits = download(amax.get(), 1)[0];
    std::memcpy(&c.amax, &bits, sizeof(float));
    c.descale = download(descale.get(), 1)[0];
    return c;
}

template <class Fp8>
void check_cast(const char* what, size_t n, float stddev, uint64_t seed) {
    SCOPED_TRACE(format("%s, %s, n=%zu", what, Fp8Format<Fp8>::kName, n));
    const std::vector<floatX> x = stddev > 0 ? random_bf16(n, seed, stddev) : std::vector<floatX>(n, __float2bfloat16(0.0f));
    DeviceBuffer<Fp8> q(n);
    DeviceBuffer<unsigned int> amax(4);
    DeviceBuffer<float> descale(4);
    const Cast<Fp8> c = cast_on_gpu<Fp8>(x, 1, int64_t(n), false, q, amax, descale);
    const float want_amax = host_amax(x);
    EXPECT_EQ(c.amax, want_amax);
    const float scale = fp8_scale<Fp8>(want_amax);
    if (want_amax == 0.0f) EXPECT_EQ(scale, 1.0f);
    EXPECT_EQ(c.descale, 1.0f / scale);
    size_t wrong = 0, saturated = 0;
    for (size_t i = 0; i < n; i++) {
        const __nv_fp8_storage_t want = fp8_quantize<Fp8>(__bfloat162float(x[i]), scale);
        wrong += std::memcmp(&c.q[i], &want, 1) != 0;
        saturated += std::fabs(dequantize(c.q[i])) == Fp8Format<Fp8>::kMax;
    }
    std::printf("  %s %s: %zu values, amax %g, %zu at the format's largest\n", what, Fp8Format<Fp8>::kName, n,
                double(want_amax), saturated);
    EXPECT_EQ(wrong, 0u) << "bytes other than the host's conversion";
    if (want_amax > 0.0f) EXPECT_GE(saturated, 1u) << "amax must map onto the largest value";
}

TEST_F(Fp8Test, CastsMatchTheHostConversion) {
    for (size_t n : {size_t(1), size_t(1000), size_t(300001)}) {
        check_cast<__nv_fp8_e4m3>("activations", n, 1.0f, 1 + n);
        check_cast<__nv_fp8_e5m2>("gradients", n, 1e-3f, 2 + n);
    }
    check_cast<__nv_fp8_e4m3>("all zero", 333, 0.0f, 3);
    check_cast<__nv_fp8_e5m2>("all zero", 333, 0.0f, 3);
}

// fp8_amax_batch: each tensor's amax exactly max |x| (its float bits), for tensors of many sizes (1 value to
// many blocks' worth), some 16-byte aligned (8 values a thread, the tail one by one) and some not, in one
// launch; every other slot left alone.
TEST_F(Fp8Test, AmaxBatchMeasuresEveryTensor) {
    const std::vector<size_t> sizes = {1, 7, 8, 1000, 4099, 300001, 2359296, 16387};
    const std::vector<size_t> misalign = {0, 3, 0, 1, 0, 5, 0, 7};  // values past a 16-byte boundary
    std::vector<size_t> starts;
    size_t total = 0;
    for (size_t i = 0; i < sizes.size(); i++) {
        const size_t at = (total + kPackX - 1) / kPackX * kPackX + misalign[i];
        starts.push_back(at);
        total = at + sizes[i];
    }
    const std::vector<floatX> all = random_bf16(total, 140, 0.02f);
    auto d_all = upload(all);
    DeviceBuffer<unsigned int> amax(4 * sizes.size() + 4);
    cudaCheck(cudaMemset(amax.get(), 0, amax.bytes()));
    std::vector<Fp8AmaxJob> jobs;
    std::vector<float> want;
    for (size_t i = 0; i < sizes.size(); i++) {
        const size_t at = starts[i];
        jobs.push_back({d_all.get() + at, int64_t(sizes[i]), amax.get() + 4 * i});
        ASSERT_EQ(reinterpret_cast<uintptr_t>(jobs.back().x) % 16 == 0, misalign[i] == 0) << "tensor " << i;
        want.push_back(host_amax(std::vector<floatX>(all.begin() + long(at), all.begin() + long(at + sizes[i]))));
    }
    const int64_t blocks = fp8_amax_batch_plan(jobs);
    EXPECT_EQ(jobs[6].blocks, 144) << "2,359,296 values, 16,384 a block";
    EXPECT_EQ(jobs[0].blocks, 1);
    EXPECT_EQ(jobs.back().first_block + jobs.back().blocks, blocks);
    auto d_jobs = upload(jobs);
    fp8_amax_batch(d_jobs.get(), int(jobs.size()), blocks, kStream);
    const std::vector<unsigned int> got = download(amax.get(), amax.size());
    for (size_t i = 0; i < sizes.size(); i++) {
        float a;
        std::memcpy(&a, &got[4 * i], sizeof(float));
        EXPECT_EQ(a, want[i]) << "tensor " << i << " of " << sizes[i] << " values";
        for (int k = 1; k < 4; k++) EXPECT_EQ(got[4 * i + k], 0u) << "slot padding " << i;
    }
    EXPECT_EQ(got[4 * sizes.size()], 0u);
}

// fp8_dequantize gives bf16(q * descale) for every byte, on the packed path (n a multiple of 8, aligned)
// and the plain one (an odd n, or an output off its 16-byte alignment).
template <class Fp8>
void check_dequantize(size_t n, size_t out_offset, uint64_t seed) {
    SCOPED_TRACE(format("%s, n=%zu, output offset %zu", Fp8Format<Fp8>::kName, n, out_offset));
    const std::vector<floatX> x = random_bf16(n, seed, 0.7f);
    DeviceBuffer<Fp8> q(n);
    DeviceBuffer<unsigned int> amax(4);
    DeviceBuffer<float> descale(4);
    const Cast<Fp8> c = cast_on_gpu<Fp8>(x, 1, int64_t(n), false, q, amax, descale);
    DeviceBuffer<floatX> out(n + out_offset);
    cudaCheck(cudaMemset(out.get(), 0xff, out.bytes()));
    fp8_dequantize(out.get() + out_offset, q.get(), int64_t(n), descale.get(), kStream);
    const std::vector<floatX> got = download(out.get() + out_offset, n);
    // Beside the exact check, the round trip keeps x to within half an FP8 ulp (2^-4 relative for E4M3,
    // 2^-3 for E5M2) plus bf16's rounding (2^-9), for values in the format's normal range.
    const bool e4m3 = Fp8Format<Fp8>::kType == CUDA_R_8F_E4M3;
    const double min_normal = e4m3 ? std::ldexp(1.0, -6) : std::ldexp(1.0, -14);
    const double bound = (e4m3 ? std::ldexp(1.0, -4) : std::ldexp(1.0, -3)) + std::ldexp(1.0, -8);
    size_t wrong = 0, normal = 0;
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        __nv_fp8_storage_t b;
        std::memcpy(&b, &c.q[i], 1);
        const floatX want = __float2bfloat16(fp8_value<Fp8>(b) * c.descale);
        wrong += std::memcmp(&got[i], &want, sizeof(floatX)) != 0;
        const double xi = __bfloat162float(x[i]);
        if (std::fabs(xi) / c.descale < min_normal) continue;
        normal++;
        worst = std::max(worst, std::fabs(double(__bfloat162float(got[i])) - xi) / std::fabs(xi));
    }
    EXPECT_EQ(wrong, 0u) << "values other than bf16(q * descale)";
    EXPECT_GT(normal, n / 2);
    EXPECT_LE(worst, bound) << "round trip of a normal value";
    std::printf("  dequantize %s: n=%zu, worst relative round trip %.3g over %zu normal values (bound %.3g)\n",
                Fp8Format<Fp8>::kName, n, worst, normal, bound);
}

TEST_F(Fp8Test, DequantizeGivesBackTheScaledValues) {
    check_dequantize<__nv_fp8_e4m3>(4096, 0, 20);
    check_dequantize<__nv_fp8_e4m3>(1001, 0, 21);
    check_dequantize<__nv_fp8_e4m3>(4096, 1, 22);
    check_dequantize<__nv_fp8_e5m2>(4096, 0, 23);
    check_dequantize<__nv_fp8_e5m2>(777, 3, 24);
}

template <class Fp8>
void check_transposed(int64_t rows, int64_t cols, uint64_t seed) {
    SCOPED_TRACE(format("%s, %lld x %lld", Fp8Format<Fp8>::kName, (long long)rows, (long long)cols));
    const std::vector<floatX> x = random_bf16(size_t(rows * cols), seed, 0.5f);
    DeviceBuffer<Fp8> q(size_t(rows * cols));
    DeviceBuffer<unsigned int> amax(4);
    DeviceBuffer<float> descale(4);
    const Cast<Fp8> plain = cast_on_gpu<Fp8>(x, rows, cols, false, q, amax, descale);
    const Cast<Fp8> t = cast_on_gpu<Fp8>(x, rows, cols, true, q, amax, descale);
    EXPECT_EQ(t.descale, plain.descale);
    size_t wrong = 0;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) wrong += std::memcmp(&t.q[size_t(c * rows + r)], &plain.q[size_t(r * cols + c)], 1) != 0;
    }
    EXPECT_EQ(wrong, 0u) << "transposed bytes that differ from the plain cast's";
}

TEST_F(Fp8Test, TransposedCastIsTheTransposeOfTheCast) {
    for (const std::pair<int64_t, int64_t>& shape : {std::pair<int64_t, int64_t>{77, 45}, {1, 33}, {64, 32}, {129, 1}}) {
        check_transposed<__nv_fp8_e4m3>(shape.first, shape.second, 10);
        check_transposed<__nv_fp8_e5m2>(shape.first, shape.second, 11);
    }
}

// ||got - ref|| / ||ref|| and max |got - ref| / max |ref|.
void expect_close(const char* what, const std::vector<floatX>& got, const std::vector<double>& ref, double tol_rel,
                  double tol_max) {
    ASSERT_EQ(got.size(), ref.size());
    double num = 0, den = 0, max_diff = 0, max_ref = 0;
    size_t nonfinite = 0;
    for (size_t i = 0; i < got.size(); i++) {
        const double g = __bfloat162float(got[i]);
        if (!std::isfinite(g)) {
            nonfinite++;
            continue;
        }
        num += (g - ref[i]) * (g - ref[i]);
        den += ref[i] * ref[i];
        max_diff = std::max(max_diff, std::fabs(g - ref[i]));
        max_ref = std::max(max_ref, std::fabs(ref[i]));
    }
    const double rel = std::sqrt(num / den), worst = max_diff / max_ref;
    std::printf("    %-40s rel err %.2e (tol %.0e), worst element %.2e of max (tol %.0e)\n", what, rel, tol_rel, worst,
                tol_max);
    EXPECT_EQ(nonfinite, 0u) << what << ": values not finite (not written?)";
    EXPECT_GT(den, 0.0) << what;
    EXPECT_LE(rel, tol_rel) << what;
    EXPECT_LE(worst, tol_max) << what;
}

// D (M, N) = P (M, K) Q (N, K)^T (+ bias) on the host, in double, from dequantised bytes times descales.
template <class P, class Q>
std::vector<double> host_product(const std::vector<P>& p, float dp, const std::vector<Q>& q, float dq, int64_t M,
                                 int64_t N, int64_t K, const std::vector<floatX>* bias) {
    std::vector<double> d(size_t(M * N));
    for (int64_t m = 0; m < M; m++) {
        for (int64_t n = 0; n < N; n++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++) {
                s += double(dequantize(p[size_t(m * K + k)])) * double(dequantize(q[size_t(n * K + k)]));
            }
            d[size_t(m * N + n)] = s * double(dp) * double(dq) + (bias ? double(__bfloat162float((*bias)[size_t(n)])) : 0.0);
        }
    }
    return d;
}

template <class P, class Q>
void check_gemm(int64_t M, int64_t N, int64_t K, bool with_bias, uint64_t seed) {
    SCOPED_TRACE(format("M=%lld N=%lld K=%lld, P %s, Q %s%s", (long long)M, (long long)N, (long long)K,
                        Fp8Format<P>::kName, Fp8Format<Q>::kName, with_bias ? ", bias" : ""));
    std::printf("  M=%lld N=%lld K=%lld, P %s, Q %s%s\n", (long long)M, (long long)N, (long long)K, Fp8Format<P>::kName,
                Fp8Format<Q>::kName, with_bias ? ", bias" : "");
    const CublasLt lt;
    const std::vector<floatX> p = random_bf16(size_t(M * K), seed, 1.0f), q = random_bf16(size_t(N * K), seed + 1, 0.02f);
    const std::vector<floatX> bias = random_bf16(size_t(N), seed + 2, 0.02f);
    DeviceBuffer<P> p8(size_t(M * K));
    DeviceBuffer<Q> q8(size_t(N * K));
    DeviceBuffer<unsigned int> amax(8);
    DeviceBuffer<float> descale(8);  // P's at 0, Q's at 4: 16-byte aligned, as cuBLASLt wants
    auto d_p = upload(p), d_q = upload(q), d_bias = upload(bias);
    fp8_amax(d_p.get(), M * K, amax.get(), kStream);
    fp8_cast(p8.get(), d_p.get(), M * K, amax.get(), descale.get(), kStream);
    fp8_amax(d_q.get(), N * K, amax.get() + 4, kStream);
    fp8_cast(q8.get(), d_q.get(), N * K, amax.get() + 4, descale.get() + 4, kStream);
    DeviceBuffer<floatX> d(size_t(M * N));
    cudaCheck(cudaMemset(d.get(), 0xff, d.bytes()));
    const Fp8Gemm gemm(lt, M, N, K, p8.get(), q8.get(), descale.get(), descale.get() + 4, d.get(),
                       with_bias ? d_bias.get() : nullptr);
    gemm.run(kStream);
    const std::vector<float> ds = download(descale.get(), 8);
    const std::vector<double> ref = host_product(download(p8.get(), size_t(M * K)), ds[0], download(q8.get(), size_t(N * K)),
                                                 ds[4], M, N, K, with_bias ? &bias : nullptr);
    expect_close("D against the dequantised product", download(d.get(), size_t(M * N)), ref, 5e-3, 1e-2);
}

TEST_F(Fp8Test, GemmMatchesTheDequantizedProduct) {
    check_gemm<__nv_fp8_e4m3, __nv_fp8_e4m3>(48, 80, 112, true, 20);
    check_gemm<__nv_fp8_e4m3, __nv_fp8_e4m3>(256, 16, 768, false, 21);
    check_gemm<__nv_fp8_e5m2, __nv_fp8_e4m3>(64, 32, 256, false, 22);
    check_gemm<__nv_fp8_e4m3, __nv_fp8_e5m2>(32, 48, 144, true, 23);
}

// The backward's dX (N, K) = dD (N, OC) W (OC, K): P = dD in E5M2, Q = W^T (K, OC) in E4M3 from the
// transposing cast.
TEST_F(Fp8Test, BackwardThroughATransposedCopy) {
    const int64_t N = 96, K = 64, OC = 160;
    const CublasLt lt;
    const std::vector<floatX> dd = random_bf16(size_t(N * OC), 30, 1e-3f), w = random_bf16(size_t(OC * K), 31, 0.02f);
    DeviceBuffer<__nv_fp8_e5m2> dd8(size_t(N * OC));
    DeviceBuffer<__nv_fp8_e4m3> wt8(size_t(OC * K));
    DeviceBuffer<unsigned int> amax(8);
    DeviceBuffer<float> descale(8);
    auto d_dd = upload(dd), d_w = upload(w);
    fp8_amax(d_dd.get(), N * OC, amax.get(), kStream);
    fp8_cast(dd8.get(), d_dd.get(), N * OC, amax.get(), descale.get(), kStream);
    fp8_amax(d_w.get(), OC * K, amax.get() + 4, kStream);
    fp8_cast_transposed(wt8.get(), d_w.get(), OC, K, amax.get() + 4, descale.get() + 4, kStream);
    DeviceBuffer<floatX> dx(size_t(N * K));
    cudaCheck(cudaMemset(dx.get(), 0xff, dx.bytes()));
    const Fp8Gemm gemm(lt, N, K, OC, dd8.get(), wt8.get(), descale.get(), descale.get() + 4, dx.get());
    gemm.run(kStream);
    const std::vector<floatX> got = download(dx.get(), size_t(N * K));
    const std::vector<float> ds = download(descale.get(), 8);
    expect_close("dX against the dequantised product", got,
                 host_product(download(dd8.get(), size_t(N * OC)), ds[0], download(wt8.get(), size_t(OC * K)), ds[4], N,
                              K, OC, nullptr),
                 5e-3, 1e-2);
    std::vector<double> exact(size_t(N * K), 0.0);  // from the bf16 values: what FP8 approximates
    for (int64_t n = 0; n < N; n++) {
        for (int64_t o = 0; o < OC; o++) {
            const double g = __bfloat162float(dd[size_t(n * OC + o)]);
            for (int64_t k = 0; k < K; k++) exact[size_t(n * K + k)] += g * double(__bfloat162float(w[size_t(o * K + k)]));
        }
    }
    expect_close("dX against the bf16 operands' product", got, exact, 0.15, 0.3);
}

// D = D0 + P Q^T with Fp8Epilogue::accumulate.
TEST_F(Fp8Test, GemmAccumulatesOntoD) {
    const int64_t M = 64, N = 48, K = 96;
    const CublasLt lt;
    const std::vector<floatX> p = random_bf16(size_t(M * K), 35, 1.0f), q = random_bf16(size_t(N * K), 36, 0.02f);
    const std::vector<floatX> d0 = random_bf16(size_t(M * N), 37, 0.5f);
    DeviceBuffer<__nv_fp8_e5m2> p8(size_t(M * K));
    DeviceBuffer<__nv_fp8_e4m3> q8(size_t(N * K));
    DeviceBuffer<unsigned int> amax(8);
    DeviceBuffer<float> descale(8);
    auto d_p = upload(p), d_q = upload(q), d = upload(d0);
    fp8_amax(d_p.get(), M * K, amax.get(), kStream);
    fp8_cast(p8.get(), d_p.get(), M * K, amax.get(), descale.get(), kStream);
    fp8_amax(d_q.get(), N * K, amax.get() + 4, kStream);
    fp8_cast(q8.get(), d_q.get(), N * K, amax.get() + 4, descale.get() + 4, kStream);
    fp8_matmul(lt, kStream, M, N, K, p8.get(), q8.get(), descale.get(), descale.get() + 4, d.get(),
               Fp8Epilogue{nullptr, nullptr, nullptr, /*accumulate=*/true});
    const std::vector<float> ds = download(descale.get(), 8);
    std::vector<double> ref = host_product(download(p8.get(), size_t(M * K)), ds[0], download(q8.get(), size_t(N * K)),
                                           ds[4], M, N, K, nullptr);
    for (size_t i = 0; i < ref.size(); i++) ref[i] += double(__bfloat162float(d0[i]));
    expect_close("D0 + the dequantised product", download(d.get(), size_t(M * N)), ref, 5e-3, 1e-2);
}

// fp8_transpose of a rows x cols byte matrix into columns [at, at + rows) of a (cols, ld) one.
void check_transpose(int64_t rows, int64_t cols, int64_t ld, int64_t at, uint64_t seed) {
    SCOPED_TRACE(format("%lld x %lld into rows of %lld at column %lld", (long long)rows, (long long)cols, (long long)ld,
                        (long long)at));
    std::mt19937_64 gen(seed);
    std::vector<__nv_fp8_e5m2> src(size_t(rows * cols)), dst(size_t(cols * ld));
    for (auto& b : src) b.__x = __nv_fp8_storage_t(gen() & 0xffu);
    for (auto& b : dst) b.__x = __nv_fp8_storage_t(gen() & 0xffu);
    auto d_src = upload(src), d_dst = upload(dst);
    fp8_transpose(d_dst.get() + at, ld, d_src.get(), rows, cols, kStream);
    const std::vector<__nv_fp8_e5m2> got = download(d_dst.get(), dst.size());
    size_t wrong = 0, touched = 0;
    for (int64_t c = 0; c < cols; c++) {
        for (int64_t j = 0; j < ld; j++) {
            const size_t i = size_t(c * ld + j);
            if (j >= at && j < at + rows) {
                wrong += got[i].__x != src[size_t((j - at) * cols + c)].__x;
            } else {
                touched += got[i].__x != dst[i].__x;
            }
        }
    }
    EXPECT_EQ(wrong, 0u) << "transposed bytes that differ from the source's";
    EXPECT_EQ(touched, 0u) << "bytes outside the destination columns changed";
}

TEST_F(Fp8Test, TransposeCopiesEveryByte) {
    check_transpose(128, 192, 128, 0, 50);   // whole tiles, 16-byte accesses
    check_transpose(96, 160, 256, 48, 51);   // into the middle of wider rows, 16-byte accesses, partial tiles
    check_transpose(77, 45, 100, 3, 52);     // nothing a multiple of 16: byte by byte
    check_transpose(1, 70, 17, 16, 53);
    expect_error([&] {
        DeviceBuffer<__nv_fp8_e5m2> a(64);
        fp8_transpose(a.get(), 4, a.get(), 8, 8, kStream);
    }, kExitUsage, {"fp8_transpose: 8 x 8 into rows of 4"});
}

// fp8_cast_pair of x (rows, cols): q row-major byte for byte the host's conversion (unless q is left
// null), and its transpose in columns [at, at + rows) of a (cols, ld) matrix whose other bytes stay; the
// column sums of each 64-row block bitwise the host's.
template <class Fp8>
void check_cast_pair(int64_t rows, int64_t cols, int64_t ld, int64_t at, bool with_q, uint64_t seed) {
    SCOPED_TRACE(format("%s %lld x %lld, transposed into rows of %lld at column %lld%s", Fp8Format<Fp8>::kName,
                        (long long)rows, (long long)cols, (long long)ld, (long long)at, with_q ? "" : ", no q"));
    const std::vector<floatX> x = random_bf16(size_t(rows * cols), seed, 0.3f);
    std::mt19937_64 gen(seed + 1);
    std::vector<Fp8> qt0(size_t(cols * ld));
    for (auto& b : qt0) b.__x = __nv_fp8_storage_t(gen() & 0xffu);
    auto d_x = upload(x);
    auto d_qt = upload(qt0);
    DeviceBuffer<Fp8> q(size_t(rows * cols));
    DeviceBuffer<unsigned int> amax(4);
    DeviceBuffer<float> descale(4);
    const int64_t blocks = ceil_div<int64_t>(rows, kFp8CastPairRows);
    DeviceBuffer<float> sums(size_t(blocks * cols));
    cudaCheck(cudaMemset(q.get(), 0xff, q.bytes()));
    cudaCheck(cudaMemset(descale.get(), 0xff, descale.bytes()));
    cudaCheck(cudaMemset(sums.get(), 0xff, sums.bytes()));
    fp8_amax(d_x.get(), rows * cols, amax.get(), kStream);
    fp8_cast_pair(with_q ? q.get() : nullptr, d_qt.get() + at, ld, d_x.get(), rows, cols, amax.get(), descale.get(),
                  kStream, sums.get());
    // The column sums of each block of rows, added in row order in fp32 as the kernel does: bitwise.
    const std::vector<float> got_sums = download(sums.get(), sums.size());
    size_t wrong_sums = 0;
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t c = 0; c < cols; c++) {
            float want = 0.0f;
            for (int64_t r = b * kFp8CastPairRows; r < std::min(rows, (b + 1) * kFp8CastPairRows); r++) {
                want += __bfloat162float(x[size_t(r * cols + c)]);
            }
            wrong_sums += std::memcmp(&want, &got_sums[size_t(b * cols + c)], sizeof(float)) != 0;
        }
    }
    EXPECT_EQ(wrong_sums, 0u) << "column sums other than the host's (same order, fp32)";
    const float scale = fp8_scale<Fp8>(host_amax(x));
    EXPECT_EQ(download(descale.get(), 1)[0], 1.0f / scale);
    const std::vector<Fp8> got_q = download(q.get(), q.size()), got_qt = download(d_qt.get(), qt0.size());
    size_t wrong_q = 0, wrong_qt = 0, touched = 0;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            const __nv_fp8_storage_t want = fp8_quantize<Fp8>(__bfloat162float(x[size_t(r * cols + c)]), scale);
            const __nv_fp8_storage_t got = with_q ? got_q[size_t(r * cols + c)].__x : __nv_fp8_storage_t(0xff);
            wrong_q += got != (with_q ? want : __nv_fp8_storage_t(0xff));
            wrong_qt += got_qt[size_t(c * ld + at + r)].__x != want;
        }
    }
    for (int64_t c = 0; c < cols; c++) {
        for (int64_t j = 0; j < ld; j++) {
            if (j < at || j >= at + rows) touched += got_qt[size_t(c * ld + j)].__x != qt0[size_t(c * ld + j)].__x;
        }
    }
    EXPECT_EQ(wrong_q, 0u) << "row-major bytes other than the host's conversion (or written with q null)";
    EXPECT_EQ(wrong_qt, 0u) << "transposed bytes other than the host's conversion";
    EXPECT_EQ(touched, 0u) << "bytes outside the transposed copy's columns changed";
}

TEST_F(Fp8Test, CastPairWritesTheCastBothWays) {
    check_cast_pair<__nv_fp8_e5m2>(128, 192, 128, 0, true, 70);  // whole tiles, 16-byte accesses
    check_cast_pair<__nv_fp8_e5m2>(96, 160, 256, 48, true, 71);  // partial tiles, into the middle of wider rows
    check_cast_pair<__nv_fp8_e5m2>(200, 80, 208, 0, true, 75);   // rows not a multiple of the 64-row blocks
    check_cast_pair<__nv_fp8_e4m3>(80, 2304, 80, 0, true, 72);   // qkv's width
    check_cast_pair<__nv_fp8_e5m2>(77, 45, 100, 3, true, 73);    // nothing a multiple of 16: value by value
    check_cast_pair<__nv_fp8_e4m3>(64, 48, 64, 0, false, 74);    // the transposed copy only
    expect_error([&] {
        DeviceBuffer<floatX> x(64);
        DeviceBuffer<__nv_fp8_e5m2> q(64);
        DeviceBuffer<unsigned int> a(4);
        DeviceBuffer<float> d(4);
        fp8_cast_pair(q.get(), q.get(), 4, x.get(), 8, 8, a.get(), d.get(), kStream);
    }, kExitUsage, {"fp8_cast_pair: 8 x 8 into rows of 4"});
}

// fused_classifier_fp8 against fused_classifier on the same logits (the file's comment).
void check_classifier_fp8(int64_t N, int V, int Vp, uint64_t seed) {
    SCOPED_TRACE(format("N=%lld V=%d Vp=%d", (long long)N, V, Vp));
    std::printf("  classifier N=%lld V=%d Vp=%d\n", (long long)N, V, Vp);
    const size_t n = size_t(N) * size_t(Vp);
    const std::vector<floatX> logits = random_bf16(n, seed, 3.0f);
    std::mt19937_64 gen(seed + 1);
    std::vector<int> targets(static_cast<size_t>(N));
    for (int& t : targets) t = int(gen() % uint64_t(V));
    const float dloss = 1.0f / float(N);
    auto d_bf16 = upload(logits), d_logits = upload(logits);
    auto d_targets = upload(targets);
    DeviceBuffer<float> ref_losses(static_cast<size_t>(N)), losses(static_cast<size_t>(N)), descale(4);
    DeviceBuffer<__nv_fp8_e5m2> q(n);
    cudaCheck(cudaMemset(q.get(), 0xff, q.bytes()));
    cudaCheck(cudaMemset(losses.get(), 0xff, losses.bytes()));
    fused_classifier(d_bf16.get(), ref_losses.get(), d_targets.get(), dloss, N, V, Vp, true, kStream);
    fused_classifier_fp8(d_logits.get(), losses.get(), d_targets.get(), dloss, N, V, Vp, q.get(), descale.get(), kStream);
    const std::vector<float> want_losses = download(ref_losses.get(), size_t(N)), got_losses = download(losses.get(), size_t(N));
    EXPECT_EQ(0, std::memcmp(want_losses.data(), got_losses.data(), size_t(N) * sizeof(float))) << "losses differ";
    const std::vector<floatX> untouched = download(d_logits.get(), n);
    EXPECT_EQ(0, std::memcmp(untouched.data(), logits.data(), n * sizeof(floatX))) << "the logits were written";
    const float d = download(descale.get(), 1)[0];
    EXPECT_NEAR(d, dloss / 57344.0f, 1e-6 * dloss / 57344.0f);
    const std::vector<floatX> want = download(d_bf16.get(), n);
    const std::vector<__nv_fp8_e5m2> got = download(q.get(), n);
    const double floor = std::ldexp(1.0, -17) * double(d);  // half of E5M2's smallest step, in dlogit units
    size_t wrong = 0, padded_nonzero = 0;
    double worst = 0;
    for (int64_t r = 0; r < N; r++) {
        for (int v = 0; v < Vp; v++) {
            const size_t i = size_t(r) * Vp + size_t(v);
            const double g = double(float(got[i])) * d, w = __bfloat162float(want[i]);
            if (v >= V) {
                padded_nonzero += got[i].__x != 0;
                continue;
            }
            // bf16's own rounding of the reference (2^-9) on top of E5M2's (2^-3)
            const double err = std::fabs(g - w), bound = (0.125 + 0.004) * std::fabs(w) + floor;
            worst = std::max(worst, err / bound);
            wrong += !(err <= bound);
        }
    }
    std::printf("    worst dlogit error %.2f of its bound\n", worst);
    EXPECT_EQ(wrong, 0u) << "dlogits beyond E5M2's rounding of the bf16 ones";
    EXPECT_EQ(padded_nonzero, 0u) << "padded columns must be 0";
}

TEST_F(Fp8Test, FusedClassifierWritesE5M2Dlogits) {
    check_classifier_fp8(16, 250, 256, 60);        // one pack a thread at most
    check_classifier_fp8(8, 50257, 50304, 61);     // GPT-2's rows: registers and shared memory
    check_classifier_fp8(4, 60000, 60000, 62);     // longer rows: packs streamed from memory too
    expect_error([&] {
        DeviceBuffer<floatX> x(256);
        DeviceBuffer<__nv_fp8_e5m2> q(256);
        DeviceBuffer<float> l(1), ds(4);
        DeviceBuffer<int> t(1);
        fused_classifier_fp8(x.get(), l.get(), t.get(), 0.0f, 1, 250, 256, q.get(), ds.get(), kStream);
    }, kExitUsage, {"fused_classifier_fp8: dloss=0"});
}

TEST_F(Fp8Test, GemmRefusesWhatItCannotRun) {
    const CublasLt lt;
    DeviceBuffer<__nv_fp8_e4m3> a(64 * 64 + 16);
    DeviceBuffer<__nv_fp8_e5m2> g(64 * 64);
    DeviceBuffer<float> descale(8);
    DeviceBuffer<floatX> d(64 * 64);
    expect_error([&] { Fp8Gemm(lt, 40, 64, 64, a.get(), a.get(), descale.get(), descale.get() + 4, d.get()); },
                 kExitUsage, {"Fp8Gemm: M=40 N=64 K=64", "positive multiple of 16"});
    expect_error([&] { Fp8Gemm(lt, 64, 64, 8, a.get(), a.get(), descale.get(), descale.get() + 4, d.get()); },
                 kExitUsage, {"K=8"});
    expect_error([&] { Fp8Gemm(lt, 64, 64, 64, g.get(), g.get(), descale.get(), descale.get() + 4, d.get()); },
                 kExitUsage, {"both operands E5M2"});
    expect_error([&] { Fp8Gemm(lt, 64, 64, 64, a.get() + 1, a.get(), descale.get(), descale.get() + 4, d.get()); },
                 kExitUsage, {"Fp8Gemm: P", "16-byte aligned"});
    expect_error([&] { Fp8Gemm(lt, 64, 64, 64, a.get(), a.get(), descale.get() + 1, descale.get() + 4, d.get()); },
                 kExitUsage, {"descale_p"});
}

// fp8_dgelu_cast_pair of x (rows, cols) with GELU input aux at a given scale: g = x * GELU'(aux) (the host
// computes it in fp32 with the same formula), each byte the host's conversion of g * scale or (where the
// device's tanhf and the host's differ in the last bit at a rounding boundary; at most 0.1%) its neighbour,
// the transposed copy the row-major one's transpose byte for byte, the amax max |g| and the column sums g's.
void check_dgelu_cast_pair(int64_t rows, int64_t cols, uint64_t seed) {
    SCOPED_TRACE(format("fp8_dgelu_cast_pair %lld x %lld", (long long)rows, (long long)cols));
    const std::vector<floatX> x = random_bf16(size_t(rows * cols), seed, 1e-3f), aux = random_bf16(size_t(rows * cols), seed + 1, 1.5f);
    std::vector<float> g(x.size());
    float amax_host = 0.0f;
    for (size_t i = 0; i < g.size(); i++) {
        const float a = __bfloat162float(aux[i]);
        const float t = std::tanh(kGeluScale * (a + kGeluCubic * a * a * a));
        const float d = 0.5f * (1.0f + t) + 0.5f * a * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * kGeluCubic * a * a);
        g[i] = __bfloat162float(x[i]) * d;
        amax_host = std::max(amax_host, std::fabs(g[i]));
    }
    const float scale = 0.5f * 57344.0f / amax_host;  // as a delayed scale may be: not this tensor's own
    auto d_x = upload(x), d_aux = upload(aux);
    DeviceBuffer<__nv_fp8_e5m2> q(size_t(rows * cols)), qt(size_t(rows * cols));
    DeviceBuffer<float> d_scale(4);
    DeviceBuffer<unsigned int> amax(4);
    const int64_t blocks = ceil_div<int64_t>(rows, kFp8CastPairRows);
    DeviceBuffer<float> sums(size_t(blocks * cols));
    cudaCheck(cudaMemcpy(d_scale.get(), &scale, sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemset(amax.get(), 0, amax.bytes()));
    cudaCheck(cudaMemset(q.get(), 0x7f, q.bytes()));
    cudaCheck(cudaMemset(qt.get(), 0x7f, qt.bytes()));
    fp8_dgelu_cast_pair(q.get(), qt.get(), rows, d_x.get(), d_aux.get(), rows, cols, d_scale.get(), amax.get(), kStream,
                        sums.get());
    const std::vector<__nv_fp8_e5m2> got_q = download(q.get(), q.size()), got_qt = download(qt.get(), qt.size());
    size_t differ = 0, far = 0, transposed = 0;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            const size_t i = size_t(r * cols + c);
            const float want = fp8_value<__nv_fp8_e5m2>(fp8_quantize<__nv_fp8_e5m2>(g[i], scale));
            const float got = float(got_q[i]);
            if (got != want) {
                differ++;
                if (!(std::fabs(got - want) <= std::fabs(want) * 0x1p-2f + 0x1p-16f)) far++;
            }
            transposed += got_qt[size_t(c * rows + r)].__x != got_q[i].__x;
        }
    }
    std::printf("  fp8_dgelu_cast_pair %lld x %lld: %zu bytes differ from the host's (%zu by more than a step)\n",
                (long long)rows, (long long)cols, differ, far);
    EXPECT_EQ(far, 0u);
    EXPECT_LE(differ, got_q.size() / 1000);
    EXPECT_EQ(transposed, 0u) << "the transposed copy is not the row-major one's transpose";
    const unsigned int bits = download(amax.get(), 1)[0];
    float got_amax;
    std::memcpy(&got_amax, &bits, sizeof(float));
    EXPECT_NEAR(got_amax, amax_host, amax_host * 1e-5f);
    const std::vector<float> got_sums = download(sums.get(), sums.size());
    size_t wrong_sums = 0;
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t c = 0; c < cols; c++) {
            double want = 0.0, mag = 0.0;
            for (int64_t r = b * kFp8CastPairRows; r < std::min(rows, (b + 1) * kFp8CastPairRows); r++) {
                want += g[size_t(r * cols + c)];
                mag += std::fabs(g[size_t(r * cols + c)]);
            }
            wrong_sums += !(std::fabs(got_sums[size_t(b * cols + c)] - want) <= 1e-5 * mag + 1e-30);
        }
    }
    EXPECT_EQ(wrong_sums, 0u) << "column sums of g other than the host's";
}

TEST_F(Fp8Test, DgeluCastPairCastsTheGeluGradient) {
    check_dgelu_cast_pair(128, 3072, 90);  // fc's width, whole tiles
    check_dgelu_cast_pair(200, 80, 91);    // partial tiles
    check_dgelu_cast_pair(77, 45, 92);     // nothing a multiple of 16: value by value
    expect_error([&] {
        DeviceBuffer<floatX> x(64);
        DeviceBuffer<__nv_fp8_e5m2> q(64);
        DeviceBuffer<unsigned int> a(4);
        fp8_dgelu_cast_pair(q.get(), q.get(), 8, x.get(), nullptr, 8, 8, nullptr, a.get(), kStream);
    }, kExitUsage, {"fp8_dgelu_cast_pair: needs aux and a scale"});
}

// LayerNorm forward (fused with the residual add or not) writing E4M3 at a given scale against the same
// call writing bf16: the bytes fp8_quantize makes of the bf16 output, and every other output bitwise.
void check_layernorm_fp8(int64_t N, int C, bool fused, float oversize, uint64_t seed) {
    SCOPED_TRACE(format("N=%lld C=%d %s, scale x%g", (long long)N, C, fused ? "fused" : "plain", double(oversize)));
    const size_t n = size_t(N) * C;
    const auto a = random_bf16(n, seed, 2.0f), b = random_bf16(n, seed + 1, 0.5f);
    const auto w = random_bf16(size_t(C), seed + 2, 1.0f), bias = random_bf16(size_t(C), seed + 3, 0.2f);
    auto d_a = upload(a), d_b = upload(b), d_w = upload(w), d_bias = upload(bias);
    DeviceBuffer<floatX> out(n), res16(n), res8(n);
    DeviceBuffer<__nv_fp8_e4m3> q(n);
    DeviceBuffer<float> stats(4 * size_t(N)), scale(4);
    DeviceBuffer<unsigned int> amax(8);
    cudaCheck(cudaMemset(amax.get(), 0, amax.bytes()));
    cudaCheck(cudaMemset(q.get(), 0xff, q.bytes()));  // poisoned: every byte must be written
    cudaCheck(cudaMemset(res8.get(), 0xff, res8.bytes()));
    float* st = stats.get();
    auto run = [&](floatX* o, floatX* res, float* mean, float* rstd, unsigned int* am, LayerNormFp8Out f) {
        if (fused) {
            fused_residual_layernorm_forward(res, o, mean, rstd, d_a.get(), d_b.get(), d_w.get(), d_bias.get(), N, C,
                                             kStream, am, f);
        } else {
            layernorm_forward(o, mean, rstd, d_a.get(), d_w.get(), d_bias.get(), N, C, kStream, am, f);
        }
    };
    run(out.get(), res16.get(), st, st + N, amax.get(), {});
    const auto out16 = download(out.get(), n);
    const float s = fp8_scale<__nv_fp8_e4m3>(host_amax(out16)) * oversize;
    cudaCheck(cudaMemcpy(scale.get(), &s, sizeof(float), cudaMemcpyHostToDevice));
    run(nullptr, res8.get(), st + 2 * N, st + 3 * N, amax.get() + 4, {q.get(), scale.get()});
    const auto got = download(q.get(), n);
    size_t wrong = 0, saturated = 0, nan = 0;
    for (size_t i = 0; i < n; i++) {
        const __nv_fp8_storage_t want = fp8_quantize<__nv_fp8_e4m3>(__bfloat162float(out16[i]), s);
        wrong += std::memcmp(&got[i], &want, 1) != 0;
        saturated += std::fabs(float(got[i])) == Fp8Format<__nv_fp8_e4m3>::kMax;
        nan += std::isnan(float(got[i]));
    }
    std::printf("  N=%lld C=%d %s scale x%g: %zu at the largest\n", (long long)N, C, fused ? "fused" : "plain",
                double(oversize), saturated);
    EXPECT_EQ(wrong, 0u) << "E4M3 bytes other than the host's conversion of the bf16 output";
    EXPECT_EQ(nan, 0u);
    EXPECT_GE(saturated, 1u);
    const auto am = download(amax.get(), 8);
    EXPECT_EQ(am[0], am[4]) << "amax";
    const auto stat = download(st, 4 * size_t(N));
    EXPECT_EQ(std::memcmp(stat.data(), stat.data() + 2 * N, 2 * size_t(N) * sizeof(float)), 0) << "mean, rstd";
    if (fused) {
        const auto r16 = download(res16.get(), n), r8 = download(res8.get(), n);
        EXPECT_EQ(std::memcmp(r16.data(), r8.data(), n * sizeof(floatX)), 0) << "residual";
    }
}

TEST_F(Fp8Test, LayerNormWritesE4m3AsTheCastWould) {
    for (bool fused : {false, true}) {
        check_layernorm_fp8(100, 768, fused, 1.0f, 120);
        check_layernorm_fp8(37, 1600, fused, 1.0f, 121);  // d48's width: several packs a lane, partial
        check_layernorm_fp8(64, 72, fused, 8.0f, 122);    // scale too large: saturates
    }
    expect_error([&] {
        DeviceBuffer<floatX> x(64 * 8);
        DeviceBuffer<__nv_fp8_e4m3> q(64 * 8);
        layernorm_forward(nullptr, nullptr, nullptr, x.get(), x.get(), x.get(), 8, 64, kStream, nullptr,
                          {q.get(), nullptr});
    }, kExitUsage, {"layernorm_forward: an E4M3 output needs its scale"});
}

// Fp8Gemm's FP8 output: D = fp8(result * scale_d) with its amax, against the same matmul's bf16 D (the
// file's comment).
template <class D>
void check_fp8_output(int64_t M, int64_t N, int64_t K, bool gelu, float oversize, uint64_t seed) {
    SCOPED_TRACE(format("M=%lld N=%lld K=%lld, D %s%s, scale_d x %g", (long long)M, (long long)N, (long long)K,
                        Fp8Format<D>::kName, gelu ? ", GELU" : "", oversize));
    std::printf("  FP8 output: M=%lld N=%lld K=%lld, D %s%s, scale_d %g x kMax / amax\n", (long long)M, (long long)N,
                (long long)K, Fp8Format<D>::kName, gelu ? ", GELU" : "", oversize);
    const CublasLt lt;
    const std::vector<floatX> p = random_bf16(size_t(M * K), seed, 1.0f), q = random_bf16(size_t(N * K), seed + 1, 0.05f);
    const std::vector<floatX> bias = random_bf16(size_t(N), seed + 2, 0.1f);
    DeviceBuffer<__nv_fp8_e4m3> p8(size_t(M * K)), q8(size_t(N * K));
    DeviceBuffer<unsigned int> amax(8);
    DeviceBuffer<float> scales(16);  // descales P 0, Q 4; scale_d 8; amax_d 12
    auto d_p = upload(p), d_q = upload(q), d_bias = upload(bias);
    fp8_amax(d_p.get(), M * K, amax.get(), kStream);
    fp8_cast(p8.get(), d_p.get(), M * K, amax.get(), scales.get(), kStream);
    fp8_amax(d_q.get(), N * K, amax.get() + 4, kStream);
    fp8_cast(q8.get(), d_q.get(), N * K, amax.get() + 4, scales.get() + 4, kStream);
    // The bf16 D of the same matmul and epilogue: the reference.
    DeviceBuffer<floatX> d16(size_t(M * N)), aux16(size_t(M * N)), aux8(size_t(M * N));
    fp8_matmul(lt, kStream, M, N, K, p8.get(), q8.get(), scales.get(), scales.get() + 4, d16.get(),
               Fp8Epilogue{d_bias.get(), gelu ? aux16.get() : nullptr, nullptr});
    const std::vector<floatX> ref = download(d16.get(), size_t(M * N));
    const float ref_amax = host_amax(ref);
    ASSERT_GT(ref_amax, 0.0f);
    const float scale = oversize * Fp8Format<D>::kMax / ref_amax;
    const float sentinel = -1.0f;
    cudaCheck(cudaMemcpy(scales.get() + 8, &scale, sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(scales.get() + 12, &sentinel, sizeof(float), cudaMemcpyHostToDevice));
    DeviceBuffer<D> d8(size_t(M * N));
    cudaCheck(cudaMemset(d8.get(), 0x7f, d8.bytes()));  // NaN in both formats: every byte must be written
    cudaCheck(cudaMemset(aux8.get(), 0xff, aux8.bytes()));
    fp8_matmul(lt, kStream, M, N, K, p8.get(), q8.get(), scales.get(), scales.get() + 4, d8.get(), scales.get() + 8,
               scales.get() + 12, Fp8Epilogue{d_bias.get(), gelu ? aux8.get() : nullptr, nullptr});
    const std::vector<D> got = download(d8.get(), size_t(M * N));
    const float got_amax = download(scales.get() + 12, 1)[0];
    // The amax is of the fp32 result before bf16 rounding: within bf16's half ulp of the reference's.
    EXPECT_NEAR(got_amax, ref_amax, ref_amax * 0x1p-8f) << "AMAX_D";
    size_t nan = 0, differ = 0, far = 0, saturated = 0;
    for (size_t i = 0; i < got.size(); i++) {
        const float v = dequantize(got[i]);
        if (std::isnan(v)) {
            nan++;
            continue;
        }
        if (std::fabs(v) == Fp8Format<D>::kMax) saturated++;
        // The host's conversion of the bf16 reference: the same byte, or (where bf16's rounding of the fp32
        // result moved it across an FP8 rounding boundary) a neighbour.
        const float want = dequantize(D(__bfloat162float(ref[i]) * scale));  // saturating
        if (v != want) {
            differ++;
            const bool e4m3 = Fp8Format<D>::kKind == __NV_E4M3;
            const float step = std::max(std::fabs(want), std::fabs(v)) * (e4m3 ? 0x1p-3f : 0x1p-2f) +
                               (e4m3 ? 0x1p-9f : 0x1p-16f);  // plus the smallest subnormal
            if (std::fabs(v - want) > step) far++;
        }
    }
    std::printf("    %zu bytes differ from the host's conversion of the bf16 D (%zu by more than one step), %zu at "
                "+-kMax\n", differ, far, saturated);
    EXPECT_EQ(nan, 0u) << "NaN bytes: not written, or an overflow not saturated";
    EXPECT_EQ(far, 0u);
    EXPECT_LE(differ, got.size() / 50) << "more than 2% of the bytes differ";
    if (oversize > 1.0f) {
        EXPECT_GT(saturated, 0u) << "a scale_d too large must clip at kMax";
    }
    if (gelu) {
        // The aux (GELU's input) stays bf16, as with a bf16 D.
        const std::vector<floatX> a8 = download(aux8.get(), size_t(M * N)), a16 = download(aux16.get(), size_t(M * N));
        size_t aux_far = 0;
        for (size_t i = 0; i < a8.size(); i++) {
            const float x = __bfloat162float(a8[i]), y = __bfloat162float(a16[i]);
            if (!(std::fabs(x - y) <= std::fabs(y) * 0x1p-7f + 1e-6f)) aux_far++;
        }
        EXPECT_EQ(aux_far, 0u) << "the GELU input (aux) differs from the bf16 D's beyond bf16 rounding";
    }
}

TEST_F(Fp8Test, GemmWritesAnFp8OutputAndItsAmax) {
    check_fp8_output<__nv_fp8_e4m3>(64, 96, 128, false, 1.0f, 80);
    check_fp8_output<__nv_fp8_e4m3>(128, 64, 256, true, 1.0f, 81);
    check_fp8_output<__nv_fp8_e4m3>(32, 48, 64, false, 1.0f, 82);
    check_fp8_output<__nv_fp8_e4m3>(64, 96, 128, true, 16.0f, 83);  // saturates, never NaN
}

TEST_F(Fp8Test, GemmRefusesFp8OutputsItCannotWrite) {
    const CublasLt lt;
    DeviceBuffer<__nv_fp8_e4m3> a(64 * 64), d(64 * 64);
    DeviceBuffer<float> scales(16);
    DeviceBuffer<floatX> aux(64 * 64);
    expect_error([&] {
        Fp8Gemm(lt, 64, 64, 64, a.get(), a.get(), scales.get(), scales.get() + 4, d.get(), scales.get() + 8, nullptr,
                Fp8Epilogue{nullptr, nullptr, nullptr, /*accumulate=*/true});
    }, kExitUsage, {"FP8 D takes neither accumulate"});
    expect_error([&] {
        Fp8Gemm(lt, 64, 64, 64, a.get(), a.get(), scales.get(), scales.get() + 4, d.get(), scales.get() + 8, nullptr,
                Fp8Epilogue{nullptr, nullptr, aux.get()});
    }, kExitUsage, {"GELU-gradient"});
    expect_error([&] {
        Fp8Gemm(lt, 64, 64, 64, a.get(), a.get(), scales.get(), scales.get() + 4, d.get(), nullptr, nullptr, Fp8Epilogue{});
    }, kExitUsage, {"needs scale_d"});
    expect_error([&] {
        Fp8Gemm(lt, 64, 64, 64, a.get(), a.get(), scales.get(), scales.get() + 4, d.get(), scales.get() + 9, nullptr,
                Fp8Epilogue{});
    }, kExitUsage, {"scale_d", "16-byte aligned"});
}

// fp8_delayed_scales and fp8_history_push against the host's view of a history.
TEST_F(Fp8Test, DelayedScalesComeFromTheHistory) {
    const int slots = 3, len = 4, stride = 4;
    DeviceBuffer<float> history(size_t(slots * len + 4)), amax(size_t(slots * stride)), scale(size_t(slots * stride)),
        descale(size_t(slots * stride));
    cudaCheck(cudaMemset(history.get(), 0, history.bytes()));
    float* count = history.get() + slots * len;
    DeviceBuffer<float> outgrown(1);
    cudaCheck(cudaMemset(outgrown.get(), 0, outgrown.bytes()));
    float host_outgrown = 0;  // the slots whose new amax was past their history's largest by more than 3%
    std::vector<std::vector<float>> host(static_cast<size_t>(slots));  // newest first
    // Slot 2 stays all zero (scale 1); slot 0 grows then shrinks (the largest of the last 4 rules).
    const float pushes[6][3] = {{1.0f, 8.0f, 0}, {2.0f, 4.0f, 0}, {0.5f, 2.0f, 0}, {0.25f, 1.0f, 0}, {0.125f, 0.5f, 0},
                                {0.0625f, 0.25f, 0}};
    for (int k = 0; k < 6; k++) {
        std::vector<float> a(size_t(slots * stride), 99.0f);  // what lies between the strided slots is not read
        for (int s = 0; s < slots; s++) a[size_t(s * stride)] = pushes[k][s];
        cudaCheck(cudaMemcpy(amax.get(), a.data(), amax.bytes(), cudaMemcpyHostToDevice));
        for (int s = 0; s < slots; s++) {
            const float before = host[size_t(s)].empty() ? 0.0f
                                 : *std::max_element(host[size_t(s)].begin(), host[size_t(s)].end());
            if (before > 0 && pushes[k][s] > before * detail::kFp8Saturated) host_outgrown += 1;
        }
        fp8_history_push(history.get(), slots, len, amax.get(), stride, count, kStream, outgrown.get());
        fp8_delayed_scales<__nv_fp8_e4m3>(history.get(), slots, len, scale.get(), descale.get(), stride, kStream);
        EXPECT_EQ(download(outgrown.get(), 1)[0], host_outgrown) << "the outgrown count after push " << k;
        const std::vector<float> h = download(history.get(), history.size());
        const std::vector<float> sc = download(scale.get(), scale.size()), ds = download(descale.get(), descale.size());
        for (int s = 0; s < slots; s++) {
            host[size_t(s)].insert(host[size_t(s)].begin(), pushes[k][s]);
            host[size_t(s)].resize(size_t(len), 0.0f);
            float ref = 0;
            for (int i = 0; i < len; i++) {
                EXPECT_EQ(h[size_t(s * len + i)], host[size_t(s)][size_t(i)]) << "push " << k << " slot " << s << " entry " << i;
                ref = std::max(ref, host[size_t(s)][size_t(i)]);
            }
            const float want = ref > 0 ? 448.0f / ref : 1.0f;
            EXPECT_EQ(sc[size_t(s * stride)], want) << "push " << k << " slot " << s;
            EXPECT_EQ(ds[size_t(s * stride)], 1.0f / want) << "push " << k << " slot " << s;
        }
        EXPECT_EQ(h[size_t(slots * len)], float(std::min(k + 1, len))) << "the count after push " << k;
    }
    // After 6 pushes slot 0 holds 0.0625 .. 0.5 and its scale is 448 / 0.5: the 1.0 and 2.0 of the first two
    // pushes have aged out.
    EXPECT_EQ(download(scale.get(), 1)[0], 448.0f / 0.5f);
    // An overflowing step's amax (inf, NaN) enters as 0: the scales stay those of the finite entries.
    std::vector<float> a(size_t(slots * stride), 99.0f);
    a[0] = INFINITY;
    a[size_t(stride)] = NAN;
    a[size_t(2 * stride)] = -INFINITY;
    cudaCheck(cudaMemcpy(amax.get(), a.data(), amax.bytes(), cudaMemcpyHostToDevice));
    fp8_history_push(history.get(), slots, len, amax.get(), stride, count, kStream, outgrown.get());
    fp8_delayed_scales<__nv_fp8_e4m3>(history.get(), slots, len, scale.get(), descale.get(), stride, kStream);
    const std::vector<float> h = download(history.get(), history.size()), sc = download(scale.get(), scale.size());
    for (int s = 0; s < slots; s++) EXPECT_EQ(h[size_t(s * len)], 0.0f) << "a non-finite amax in slot " << s;
    EXPECT_EQ(sc[0], 448.0f / 0.25f);  // 0, 0.0625, 0.125, 0.25
    EXPECT_EQ(sc[size_t(stride)], 448.0f / 1.0f);
    EXPECT_EQ(sc[size_t(2 * stride)], 1.0f);
    // Only slot 0's second push (2 after 1) outgrew its history; non-finite amaxes count nothing.
    EXPECT_EQ(host_outgrown, 1.0f);
    EXPECT_EQ(download(outgrown.get(), 1)[0], 1.0f) << "after the non-finite amaxes";
    // At the margin, each from the histories {0.25}, {1.0} and {} (empty): 0.25 x 1.03125 in slot 0 is not
    // past its history, 0.25 x 1.0625 is; 64 in slot 1 is; slot 2 (empty) counts nothing however large.
    for (const float a0 : {0.25f * 1.03125f, 0.25f * 1.0625f}) {
        std::vector<float> hist(history.size(), 0.0f);
        hist[0] = 0.25f;
        hist[size_t(len)] = 1.0f;
        cudaCheck(cudaMemcpy(history.get(), hist.data(), history.bytes(), cudaMemcpyHostToDevice));
        std::vector<float> b(size_t(slots * stride), 99.0f);
        b[0] = a0;
        b[size_t(stride)] = 64.0f;
        b[size_t(2 * stride)] = 1e30f;
        cudaCheck(cudaMemcpy(amax.get(), b.data(), amax.bytes(), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemset(outgrown.get(), 0, outgrown.bytes()));
        fp8_history_push(history.get(), slots, len, amax.get(), stride, count, kStream, outgrown.get());
        EXPECT_EQ(download(outgrown.get(), 1)[0], a0 == 0.25f * 1.03125f ? 1.0f : 2.0f) << "slot 0's amax " << a0;
    }
}

// The model's FP8 matmuls against its bf16 ones (the file's comment).
class ModelMatmuls {
public:
    static constexpr int64_t kN = 256, kC = 768, kVp = 50304;
    const CublasLt lt;
    DeviceBuffer<unsigned int> amax{8};
    DeviceBuffer<float> descale{8};  // P's at 0, Q's at 4

    // x (n bf16) into q with its own scale, into slot 0 (P) or 1 (Q), optionally transposed (rows x cols).
    template <class Fp8>
    void cast(Fp8* q, const floatX* x, int64_t rows, int64_t cols, int slot, bool transposed = false) {
        fp8_amax(x, rows * cols, amax.get() + 4 * slot, kStream);
        if (transposed) {
            fp8_cast_transposed(q, x, rows, cols, amax.get() + 4 * slot, descale.get() + 4 * slot, kStream);
        } else {
            fp8_cast(q, x, rows * cols, amax.get() + 4 * slot, descale.get() + 4 * slot, kStream);
        }
    }
    std::vector<double> as_double(const floatX* d, size_t n) {
        std::vector<double> v(n);
        const std::vector<floatX> h = download(d, n);
        for (size_t i = 0; i < n; i++) v[i] = __bfloat162float(h[i]);
        return v;
    }

    // out (N, OC) = x (N, C) W (OC, C)^T (+ bias), with gelu: GELU of it, aux its input.
    void forward(const char* what, int64_t OC, bool bias, bool gelu, uint64_t seed) {
        std::printf("  %s: %lld x %lld x %lld%s%s\n", what, (long long)kN, (long long)OC, (long long)kC,
                    bias ? ", bias" : "", gelu ? ", GELU" : "");
        auto x = upload(random_bf16(size_t(kN * kC), seed, 1.0f)), w = upload(random_bf16(size_t(OC * kC), seed + 1, 0.02f));
        auto b = upload(random_bf16(size_t(OC), seed + 2, 0.02f));
        DeviceBuffer<__nv_fp8_e4m3> x8(size_t(kN * kC)), w8(size_t(OC * kC));
        cast(x8.get(), x.get(), kN, kC, 0);
        cast(w8.get(), w.get(), OC, kC, 1);
        DeviceBuffer<floatX> ref(size_t(kN * OC)), ref_aux(size_t(kN * OC)), got(size_t(kN * OC)), got_aux(size_t(kN * OC));
        for (auto* buf : {&ref, &ref_aux, &got, &got_aux}) cudaCheck(cudaMemset(buf->get(), 0xff, buf->bytes()));
        matmul_forward(lt, ref.get(), x.get(), w.get(), bias ? b.get() : nullptr, kN, int(kC), int(OC), kStream,
                       gelu ? ref_aux.get() : nullptr);
        fp8_matmul(lt, kStream, kN, OC, kC, x8.get(), w8.get(), descale.get(), descale.get() + 4, got.get(),
                   Fp8Epilogue{bias ? b.get() : nullptr, gelu ? got_aux.get() : nullptr, nullptr}, /*fast_accum=*/true);
        const size_t n = size_t(kN * OC);
        expect_close(format("%s: D, FP8 against bf16", what).c_str(), download(got.get(), n), as_double(ref.get(), n), 0.06,
                     0.2);
        if (gelu) {
            expect_close(format("%s: GELU input, FP8 against bf16", what).c_str(), download(got_aux.get(), n),
                         as_double(ref_aux.get(), n), 0.06, 0.2);
        }
    }

    // dX (N, IC) = dD (N, OC) W (OC, IC), with dgelu: times GELU'(pre) (N, IC).
    void backward_dx(const char* what, int64_t OC, int64_t IC, bool dgelu, uint64_t seed) {
        std::printf("  %s: dX %lld x %lld from dD %lld x %lld%s\n", what, (long long)kN, (long long)IC, (long long)kN,
                    (long long)OC, dgelu ? ", GELU gradient" : "");
        auto dd = upload(random_bf16(size_t(kN * OC), seed, 1e-4f)), w = upload(random_bf16(size_t(OC * IC), seed + 1, 0.02f));
        auto pre = upload(random_bf16(size_t(kN * IC), seed + 2, 1.0f)), x = upload(random_bf16(size_t(kN * IC), seed + 3, 1.0f));
        DeviceBuffer<__nv_fp8_e5m2> dd8(size_t(kN * OC));
        DeviceBuffer<__nv_fp8_e4m3> wt8(size_t(OC * IC));
        cast(dd8.get(), dd.get(), kN, OC, 0);
        cast(wt8.get(), w.get(), OC, IC, 1, /*transposed=*/true);
        DeviceBuffer<floatX> ref(size_t(kN * IC)), got(size_t(kN * IC)), dw(size_t(OC * IC));
        cudaCheck(cudaMemset(ref.get(), 0xff, ref.bytes()));
        cudaCheck(cudaMemset(got.get(), 0xff, got.bytes()));
        cudaCheck(cudaMemset(dw.get(), 0, dw.bytes()));
        matmul_backward(lt, ref.get(), dw.get(), nullptr, dd.get(), x.get(), w.get(), kN, int(IC), int(OC), nullptr, 0,
                        kStream, dgelu ? pre.get() : nullptr);
        fp8_matmul(lt, kStream, kN, IC, OC, dd8.get(), wt8.get(), descale.get(), descale.get() + 4, got.get(),
                   Fp8Epilogue{nullptr, nullptr, dgelu ? pre.get() : nullptr});
        const size_t n = size_t(kN * IC);
        expect_close(format("%s: dX, FP8 against bf16", what).c_str(), download(got.get(), n), as_double(ref.get(), n), 0.10,
                     0.3);
    }

    // dW (OC, C) += dD (N, OC)^T X (N, C), a bf16 matmul whose X is the LayerNorm output FP8 keeps for
    // backward (E4M3, read back with fp8_dequantize), against the same matmul on X in bf16.
    void backward_dw(const char* what, int64_t OC, uint64_t seed) {
        std::printf("  %s: dW %lld x %lld over %lld rows, X from its E4M3 copy\n", what, (long long)OC, (long long)kC,
                    (long long)kN);
        auto dd = upload(random_bf16(size_t(kN * OC), seed, 1e-4f)), x = upload(random_bf16(size_t(kN * kC), seed + 1, 1.0f));
        auto w = upload(random_bf16(size_t(OC * kC), seed + 2, 0.02f));
        DeviceBuffer<__nv_fp8_e4m3> x8(size_t(kN * kC));
        cast(x8.get(), x.get(), kN, kC, 0);
        DeviceBuffer<floatX> xq(size_t(kN * kC)), ref(size_t(OC * kC)), got(size_t(OC * kC));
        fp8_dequantize(xq.get(), x8.get(), kN * kC, descale.get(), kStream);
        cudaCheck(cudaMemset(ref.get(), 0, ref.bytes()));
        cudaCheck(cudaMemset(got.get(), 0, got.bytes()));
        matmul_backward(lt, nullptr, ref.get(), nullptr, dd.get(), x.get(), w.get(), kN, int(kC), int(OC), nullptr, 0, kStream);
        matmul_backward(lt, nullptr, got.get(), nullptr, dd.get(), xq.get(), w.get(), kN, int(kC), int(OC), nullptr, 0, kStream);
        const size_t n = size_t(OC * kC);
        expect_close(format("%s: dW, X from E4M3 against bf16", what).c_str(), download(got.get(), n), as_double(ref.get(), n),
                     0.06, 0.2);
    }

    // qkv's backward as the model runs it with qkv.grad: dD in E5M2 both ways from fp8_cast_pair (its amax
    // from fp8_amax here, from attention's backward in the model), X^T a byte transpose of the E4M3 copy
    // forward keeps; dX = dD W (Q: W^T in E4M3) and dW += dD^T X (accumulating onto a nonzero gradient),
    // against matmul_backward on the bf16 operands; the bias gradient from the cast's column sums against
    // bias_grad_accumulate (the same sums in another order: within bf16's rounding).
    void qkv_backward(uint64_t seed) {
        const int64_t OC = 3 * kC;
        std::printf("  qkv.grad: dX %lld x %lld, dW %lld x %lld, from dD in E5M2 both ways\n", (long long)kN,
                    (long long)kC, (long long)OC, (long long)kC);
        auto dd = upload(random_bf16(size_t(kN * OC), seed, 1e-4f)), w = upload(random_bf16(size_t(OC * kC), seed + 1, 0.02f));
        auto x = upload(random_bf16(size_t(kN * kC), seed + 2, 1.0f));
        const std::vector<floatX> dw0 = random_bf16(size_t(OC * kC), seed + 3, 1e-3f);
        DeviceBuffer<__nv_fp8_e4m3> x8(size_t(kN * kC)), xt8(size_t(kN * kC)), wt8(size_t(OC * kC));
        DeviceBuffer<__nv_fp8_e5m2> dd8(size_t(kN * OC)), ddt8(size_t(kN * OC));
        DeviceBuffer<unsigned int> dd_amax(4);
        DeviceBuffer<float> dd_descale(4);
        cast(x8.get(), x.get(), kN, kC, 0);
        fp8_transpose(xt8.get(), kN, x8.get(), kN, kC, kStream);
        cast(wt8.get(), w.get(), OC, kC, 1, /*transposed=*/true);
        fp8_amax(dd.get(), kN * OC, dd_amax.get(), kStream);
        const int64_t blocks = ceil_div<int64_t>(kN, kFp8CastPairRows);
        DeviceBuffer<float> partial(size_t(blocks * OC)), scratch(matmul_backward_scratch_bytes(kN, int(OC)) / sizeof(float));
        fp8_cast_pair(dd8.get(), ddt8.get(), kN, dd.get(), kN, OC, dd_amax.get(), dd_descale.get(), kStream,
                      partial.get());
        const std::vector<floatX> db0 = random_bf16(size_t(OC), seed + 4, 1e-3f);
        auto ref_db = upload(db0), got_db = upload(db0);
        bias_grad_accumulate(ref_db.get(), dd.get(), kN, int(OC), scratch.get(), scratch.bytes(), kStream);
        bias_grad_from_partials(got_db.get(), partial.get(), blocks, int(OC), kStream);
        expect_close("qkv.grad: dbias from the cast's sums", download(got_db.get(), size_t(OC)),
                     as_double(ref_db.get(), size_t(OC)), 1e-2, 1e-2);
        auto ref_dw = upload(dw0), got_dw = upload(dw0);
        DeviceBuffer<floatX> ref_dx(size_t(kN * kC)), got_dx(size_t(kN * kC));
        cudaCheck(cudaMemset(got_dx.get(), 0xff, got_dx.bytes()));
        matmul_backward(lt, ref_dx.get(), ref_dw.get(), nullptr, dd.get(), x.get(), w.get(), kN, int(kC), int(OC),
                        nullptr, 0, kStream);
        fp8_matmul(lt, kStream, kN, kC, OC, dd8.get(), wt8.get(), dd_descale.get(), descale.get() + 4, got_dx.get());
        fp8_matmul(lt, kStream, OC, kC, kN, ddt8.get(), xt8.get(), dd_descale.get(), descale.get(), got_dw.get(),
                   Fp8Epilogue{nullptr, nullptr, nullptr, /*accumulate=*/true});
        expect_close("qkv.grad: dX, FP8 against bf16", download(got_dx.get(), size_t(kN * kC)),
                     as_double(ref_dx.get(), size_t(kN * kC)), 0.10, 0.3);
        expect_close("qkv.grad: dW (accumulated), FP8 against bf16", download(got_dw.get(), size_t(OC * kC)),
                     as_double(ref_dw.get(), size_t(OC * kC)), 0.10, 0.3);
    }

    // The classifier's backward as the model runs it with lm_head.grad: dlogits in E5M2 from
    // fused_classifier_fp8, their transpose, d(lnf) = dlogits wte (Q: wte^T in E4M3) and dwte += dlogits^T
    // lnf (Q: lnf^T in E4M3), against matmul_backward on fused_classifier's bf16 dlogits. dwte starts from
    // the same nonzero gradient in both (the embedding's part, or earlier micro-batches).
    void lm_head_backward(uint64_t seed) {
        const int64_t V = 50257;
        std::printf("  lm_head.grad: dX %lld x %lld, dW %lld x %lld, from E5M2 dlogits\n", (long long)kN, (long long)kC,
                    (long long)kVp, (long long)kC);
        auto x = upload(random_bf16(size_t(kN * kC), seed, 1.0f)), w = upload(random_bf16(size_t(kVp * kC), seed + 1, 0.05f));
        const std::vector<floatX> dw0 = random_bf16(size_t(kVp * kC), seed + 2, 3e-6f);
        std::mt19937_64 gen(seed + 3);
        std::vector<int> targets(static_cast<size_t>(kN));
        for (int& t : targets) t = int(gen() % uint64_t(V));
        auto d_targets = upload(targets);
        DeviceBuffer<floatX> logits(size_t(kN * kVp));
        DeviceBuffer<float> losses(static_cast<size_t>(kN));
        matmul_forward(lt, logits.get(), x.get(), w.get(), nullptr, kN, int(kC), int(kVp), kStream);
        DeviceBuffer<__nv_fp8_e5m2> dl(size_t(kN * kVp)), dlt(size_t(kN * kVp));
        DeviceBuffer<float> dl_descale(4);
        const float dloss = 1.0f / float(kN);
        fused_classifier_fp8(logits.get(), losses.get(), d_targets.get(), dloss, kN, int(V), int(kVp), dl.get(),
                             dl_descale.get(), kStream);
        fp8_transpose(dlt.get(), kN, dl.get(), kN, kVp, kStream);
        fused_classifier(logits.get(), losses.get(), d_targets.get(), dloss, kN, int(V), int(kVp), true, kStream);
        DeviceBuffer<__nv_fp8_e4m3> wt8(size_t(kVp * kC)), xt8(size_t(kN * kC));
        cast(wt8.get(), w.get(), kVp, kC, 1, /*transposed=*/true);
        cast(xt8.get(), x.get(), kN, kC, 0, /*transposed=*/true);
        auto ref_dw = upload(dw0), got_dw = upload(dw0);
        DeviceBuffer<floatX> ref_dx(size_t(kN * kC)), got_dx(size_t(kN * kC));
        cudaCheck(cudaMemset(got_dx.get(), 0xff, got_dx.bytes()));
        matmul_backward(lt, ref_dx.get(), ref_dw.get(), nullptr, logits.get(), x.get(), w.get(), kN, int(kC), int(kVp),
                        nullptr, 0, kStream);
        fp8_matmul(lt, kStream, kN, kC, kVp, dl.get(), wt8.get(), dl_descale.get(), descale.get() + 4, got_dx.get());
        fp8_matmul(lt, kStream, kVp, kC, kN, dlt.get(), xt8.get(), dl_descale.get(), descale.get(), got_dw.get(),
                   Fp8Epilogue{nullptr, nullptr, nullptr, /*accumulate=*/true});
        expect_close("lm_head.grad: dX, FP8 against bf16", download(got_dx.get(), size_t(kN * kC)),
                     as_double(ref_dx.get(), size_t(kN * kC)), 0.10, 0.3);
        expect_close("lm_head.grad: dW (accumulated), FP8 against bf16", download(got_dw.get(), size_t(kVp * kC)),
                     as_double(ref_dw.get(), size_t(kVp * kC)), 0.10, 0.3);
    }
};

TEST_F(Fp8Test, EachModelMatmulIsCloseToItsBf16Matmul) {
    ModelMatmuls m;
    const int64_t C = ModelMatmuls::kC;
    m.forward("qkv", 3 * C, true, false, 40);
    m.forward("fc", 4 * C, true, true, 41);
    m.forward("lm_head", ModelMatmuls::kVp, false, false, 42);
    m.backward_dx("attproj.dx", C, C, false, 43);
    m.backward_dx("fcproj.dx", C, 4 * C, true, 44);
    m.backward_dw("qkv.dw", 3 * C, 45);
    m.backward_dw("fc.dw", 4 * C, 46);
    m.lm_head_backward(47);
    m.qkv_backward(48);
}

// attention_backward_fp8 against attention_backward's bf16 dqkv at the same scale (the file's comment).
template <class G>
void check_attention_fp8(int B, int T, int NH, float over, uint64_t seed) {
    const int C = NH * 64;
    const int64_t N = int64_t(B) * T, C3 = 3 * int64_t(C);
    SCOPED_TRACE(format("%s B=%d T=%d NH=%d, scale %gx the amax's", Fp8Format<G>::kName, B, T, NH, double(over)));
    CublasLt lt;
    const std::vector<floatX> qkv = random_bf16(size_t(N * C3), seed, 1.0f), dout = random_bf16(size_t(N * C), seed + 1, 0.1f);
    auto d_qkv = upload(qkv), d_dout = upload(dout);
    const size_t saved_bytes = attention_saved_bytes(B, NH, T, 64), scratch_bytes = attention_scratch_bytes(B, NH, T, 64);
    DeviceBuffer<uint8_t> saved(saved_bytes), scratch(scratch_bytes);
    DeviceBuffer<floatX> out(size_t(N * C)), dqkv(size_t(N * C3));
    DeviceBuffer<unsigned int> amax(4), amax8(4);
    attention_forward(lt, out.get(), saved.get(), saved_bytes, d_qkv.get(), B, T, C, NH, scratch.get(), scratch_bytes,
                      kStream);
    cudaCheck(cudaMemset(amax.get(), 0, amax.bytes()));
    attention_backward(lt, dqkv.get(), d_dout.get(), d_qkv.get(), out.get(), saved.get(), saved_bytes, B, T, C, NH,
                       scratch.get(), scratch_bytes, kStream, amax.get());
    const std::vector<floatX> x = download(dqkv.get(), size_t(N * C3));
    const float a = host_amax(x);
    ASSERT_GT(a, 0.0f);
    const float scale = fp8_scale<G>(a) * over;
    auto d_scale = upload(std::vector<float>{scale, 0.0f, 0.0f, 0.0f});
    const int64_t blocks = N / 64;
    DeviceBuffer<uint8_t> q(size_t(N * C3)), qt(size_t(N * C3));
    DeviceBuffer<float> sums(size_t(blocks * C3));
    cudaCheck(cudaMemset(q.get(), 0xff, q.bytes()));  // NaN in either format: every byte must be written
    cudaCheck(cudaMemset(qt.get(), 0xff, qt.bytes()));
    cudaCheck(cudaMemset(sums.get(), 0xff, sums.bytes()));
    cudaCheck(cudaMemset(amax8.get(), 0, amax8.bytes()));
    Flash90Fp8Out f;
    f.q = q.get();
    f.qt = qt.get();
    f.sums = sums.get();
    f.scale = d_scale.get();
    f.amax_bits = amax8.get();
    attention_backward_fp8<G>(f, d_dout.get(), d_qkv.get(), out.get(), saved.get(), saved_bytes, B, T, C, NH,
                              scratch.get(), scratch_bytes, kStream);
    EXPECT_EQ(download(amax8.get(), 1)[0], download(amax.get(), 1)[0]) << "the amax of bf16 dqkv";
    const std::vector<uint8_t> got_q = download(q.get(), q.size()), got_qt = download(qt.get(), qt.size());
    const std::vector<float> got_sums = download(sums.get(), sums.size());
    size_t wrong_q = 0, wrong_qt = 0, wrong_sums = 0, saturated = 0;
    for (int64_t r = 0; r < N; r++) {
        for (int64_t c = 0; c < C3; c++) {
            const __nv_fp8_storage_t want = fp8_quantize<G>(__bfloat162float(x[size_t(r * C3 + c)]), scale);
            wrong_q += got_q[size_t(r * C3 + c)] != want;
            wrong_qt += got_qt[size_t(c * N + r)] != want;
            saturated += std::fabs(fp8_value<G>(want)) == Fp8Format<G>::kMax;
        }
    }
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t c = 0; c < C3; c++) {
            float want = 0.0f;
            for (int64_t r = b * 64; r < (b + 1) * 64; r++) want += __bfloat162float(x[size_t(r * C3 + c)]);
            wrong_sums += std::memcmp(&want, &got_sums[size_t(b * C3 + c)], sizeof(float)) != 0;
        }
    }
    std::printf("  attention_backward_fp8 %s B=%d T=%d NH=%d, scale %gx: amax %g, %zu of %lld at the format's largest\n",
                Fp8Format<G>::kName, B, T, NH, double(over), double(a), saturated, (long long)(N * C3));
    EXPECT_EQ(wrong_q, 0u) << "row-major bytes other than the host's conversion of bf16 dqkv";
    EXPECT_EQ(wrong_qt, 0u) << "transposed bytes other than the host's conversion of bf16 dqkv";
    EXPECT_EQ(wrong_sums, 0u) << "column sums other than the host's (row order, fp32)";
    EXPECT_GE(saturated, 1u) << "the amax must reach the format's largest";
}

TEST_F(Fp8Test, AttentionBackwardWritesDqkvInFp8AsTheCastWould) {
    if (!attention_backward_fp8_available(2, 128, 128, 2)) {
        GTEST_SKIP() << "skipped: attention_backward_fp8 needs the sm_90a kernels (a GPU_ARCH=90 build on compute 9.0)";
    }
    check_attention_fp8<__nv_fp8_e5m2>(2, 128, 2, 1.0f, 90);  // two batches, a 64-row block each side of the diagonal
    check_attention_fp8<__nv_fp8_e4m3>(1, 256, 3, 1.0f, 91);  // three heads, four blocks of keys
    check_attention_fp8<__nv_fp8_e5m2>(3, 64, 1, 16.0f, 92);  // a scale 16x too large: saturates, no NaN
    check_attention_fp8<__nv_fp8_e4m3>(1, 192, 2, 16.0f, 93);
    expect_error([&] {
        DeviceBuffer<floatX> x(size_t(96) * 3 * 128);
        Flash90Fp8Out f;
        attention_backward_fp8<__nv_fp8_e5m2>(f, x.get(), x.get(), x.get(), x.get(), attention_saved_bytes(1, 2, 96, 64), 1,
                                              96, 128, 2, x.get(), attention_scratch_bytes(1, 2, 96, 64), kStream);
    }, kExitUsage, {"attention_backward_fp8", "T a multiple of 64"});
}

}  // namespace
