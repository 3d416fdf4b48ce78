/*
GPU tests of the layer kernels (llmc/encoder.cuh, layernorm.cuh, matmul.cuh, attention.cuh with
flash_attention.cuh, and flash_attention_sm90.cuh where it runs (Hopper), gelu.cuh, classifier.cuh,
global_norm.cuh, adamw.cuh) against the fp32 CPU reference (cpu/gpt2_cpu.h): the kernels the trainer runs,
as it runs them.

Every kernel gets random inputs rounded to bf16; the CPU reference runs in fp32 on exactly those
values. Shapes are deliberately not multiples of the block sizes (T=37 and 97, C=48 and 96, NH=3,
V=101 padded to 128, row counts around the 256-row reduction chunks) plus one realistic case (C=768,
NH=12, T=64) and the GPT-2 vocabulary for the classifier. Attention has its own cases: both of its
paths (flash for HS 64 and 128, cuBLASLt for HS 16, 32 and 48) at T = 1, 37, 64, 65, 97 and 200, and
its saved state too (flash's lse against a double reference, the cuBLASLt path's probabilities), and
the cuBLASLt forward's attention groups against separate rows, the wgmma backward's bias column sums
(bitwise, in the kernels' order); the encoder with explicit positions.
Outputs that a kernel overwrites are poisoned with NaN bit patterns first, so an element that is not
written shows up as non-finite; outputs that a kernel adds to start from random values, and their
error is measured against the size of what was added: ||got - ref|| / ||ref - initial||. Tolerances:
1e-2 for bf16 results (one bf16 rounding is 2^-9 = 2e-3 relative), 1e-5 for fp32 ones, exact where the
math is exact (sums of two bf16 values). Every backward, attention's forward, the classifier, the norm
and AdamW run twice and must agree bitwise, and so must LayerNorm backward's fused kernel and the
separate kernels where both can run.
Each comparison prints its relative error, so a run shows the margins. GELU is also held to the exact
function's bf16 rounding (GeluForwardRoundsLikeTheExactFunction says why).
*/
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpu/gpt2_cpu.h"
#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/encoder.cuh"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/gpt2_config.h"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"
#include "test/expect_error.h"
#include "test/gpu_test.h"

using namespace llmc;

namespace {

using test::download;
using test::upload;

// Both halves of the linear layer's backward (matmul_backward_dx, then matmul_backward_dw) in one call, as
// the model makes them: dinp (may be null), dweight (OC,C) +=, dbias (OC, may be null) +=. scratch:
// matmul_backward_scratch_bytes(N, OC) bytes when dbias is given.
void matmul_backward(const CublasLt& lt, floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout,
                     const floatX* inp, const floatX* weight, int64_t N, int C, int OC, float* scratch,
                     size_t scratch_bytes, cudaStream_t stream, const floatX* pre_gelu = nullptr) {
    if (N == 0) return;
    if (dinp != nullptr) matmul_backward_dx(lt, dinp, dout, weight, N, C, OC, stream, pre_gelu);
    matmul_backward_dw(lt, dweight, dbias, dout, inp, N, C, OC, scratch, scratch_bytes, stream);
}

constexpr double kTolBf16 = 1e-2;
constexpr double kTolFp32 = 1e-5;

// The legacy default stream: synchronous cudaMemcpy calls are ordered with the kernels on it.
const cudaStream_t kStream = nullptr;

struct Shape {
    int B, T, C, NH, V, Vp;
    std::string name() const { return format("B=%d T=%d C=%d NH=%d V=%d Vp=%d", B, T, C, NH, V, Vp); }
    int64_t N() const { return int64_t(B) * T; }
};

// N = 111 (under one 256-row chunk), 776 (three chunks and a bit) and the realistic 128.
const Shape kShapes[] = {
    {3, 37, 96, 3, 101, 128},
    {3, 37, 48, 3, 101, 128},
    {8, 97, 96, 3, 101, 128},
    {2, 64, 768, 12, 101, 128},
};

float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Normal values with the given mean and deviation, rounded to bf16 (so host and device hold the same).
std::vector<float> random_bf16(size_t n, uint64_t seed, float stddev = 1.0f, float mean = 0.0f) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> dist(mean, stddev);
    std::vector<float> v(n);
    for (float& x : v) x = bf16_round(dist(gen));
    return v;
}

std::vector<int> random_tokens(size_t n, int vocab, uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::uniform_int_distribution<int> dist(0, vocab - 1);
    std::vector<int> v(n);
    for (int& x : v) x = dist(gen);
    return v;
}

DeviceBuffer<floatX> upload_bf16(const std::vector<float>& v) {
    std::vector<floatX> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = __float2bfloat16(v[i]);
    DeviceBuffer<floatX> d(v.size());
    cudaCheck(cudaMemcpy(d.get(), h.data(), h.size() * sizeof(floatX), cudaMemcpyHostToDevice));
    return d;
}

std::vector<float> download_bf16(const floatX* p, size_t n) {
    cudaCheck(cudaDeviceSynchronize());
    std::vector<floatX> h(n);
    cudaCheck(cudaMemcpy(h.data(), p, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __bfloat162float(h[i]);
    return v;
}

// Raw bytes, for bitwise comparisons.
template <class T>
std::vector<unsigned char> bytes_of(const T* p, size_t n) {
    return download(reinterpret_cast<const unsigned char*>(p), n * sizeof(T));
}

// All bits set: NaN in bf16 and in fp32.
template <class T>
void poison(DeviceBuffer<T>& d) {
    cudaCheck(cudaMemset(d.get(), 0xff, d.bytes()));
}

// ||got - ref|| / ||ref - base|| (base = 0 when null), after checking every value is finite.
void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref, double tol,
                  const std::vector<float>* base = nullptr) {
    ASSERT_EQ(got.size(), ref.size()) << what;
    size_t nonfinite = 0;
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) {
            nonfinite++;
            continue;
        }
        const double d = double(got[i]) - ref[i];
        const double r = double(ref[i]) - (base != nullptr ? (*base)[i] : 0.0);
        num += d * d;
        den += r * r;
    }
    const double rel = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
    std::printf("    %-44s rel err %.2e (tol %.0e)\n", what.c_str(), rel, tol);
    EXPECT_EQ(nonfinite, 0u) << what << ": " << nonfinite << " of " << got.size()
                             << " values not finite (not written?)";
    EXPECT_GT(den, 0.0) << what << ": the reference is trivially zero";
    EXPECT_LE(rel, tol) << what;
}

void expect_bitwise(const std::string& what, const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
    ASSERT_EQ(a.size(), b.size()) << what;
    EXPECT_TRUE(std::memcmp(a.data(), b.data(), a.size()) == 0) << what << ": two runs differ";
}

class KernelTest : public GpuTest {};

// ----------------------------------------------------------------------------------------------------

TEST_F(KernelTest, EncoderForwardMatchesCpuExactly) {
    for (const Shape& s : kShapes) {
        SCOPED_TRACE(s.name());
        std::printf("  %s\n", s.name().c_str());
        const int maxT = s.T + 3;
        const auto wte = random_bf16(size_t(s.Vp) * s.C, 1), wpe = random_bf16(size_t(maxT) * s.C, 2);
        const auto tokens = random_tokens(size_t(s.N()), s.V, 3);
        std::vector<float> ref(size_t(s.N()) * s.C);
        cpu::encoder_forward<float>(ref.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, s.C);
        for (float& x : ref) x = bf16_round(x);

        auto d_wte = upload_bf16(wte), d_wpe = upload_bf16(wpe);
        auto d_tokens = upload(tokens);
        DeviceBuffer<floatX> d_out(ref.size());
        poison(d_out);
        encoder_forward(d_out.get(), d_tokens.get(), d_wte.get(), d_wpe.get(), s.B, s.T, s.C, kStream);
        const auto got = download_bf16(d_out.get(), ref.size());
        expect_close("encoder out", got, ref, 0.0);
        EXPECT_TRUE(std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)) == 0) << "not bitwise equal";
    }
}

// With explicit positions (packed rows): out[b,t] = wte[inp[b,t]] + wpe[positions[b,t]], exactly.
TEST_F(KernelTest, EncoderForwardTakesExplicitPositions) {
    const int B = 3, T = 37, C = 96, V = 101, maxT = 64;
    const auto wte = random_bf16(size_t(V) * C, 11), wpe = random_bf16(size_t(maxT) * C, 12);
    const auto tokens = random_tokens(size_t(B) * T, V, 13), positions = random_tokens(size_t(B) * T, maxT, 14);
    std::vector<float> ref(size_t(B) * T * C);
    for (size_t bt = 0; bt < size_t(B) * T; bt++) {
        for (int c = 0; c < C; c++) {
            ref[bt * C + size_t(c)] = bf16_round(wte[size_t(tokens[bt]) * C + size_t(c)] + wpe[size_t(positions[bt]) * C + size_t(c)]);
        }
    }
    auto d_wte = upload_bf16(wte), d_wpe = upload_bf16(wpe);
    auto d_tokens = upload(tokens), d_positions = upload(positions);
    DeviceBuffer<floatX> d_out(ref.size());
    poison(d_out);
    encoder_forward(d_out.get(), d_tokens.get(), d_wte.get(), d_wpe.get(), B, T, C, kStream, d_positions.get());
    const auto got = download_bf16(d_out.get(), ref.size());
    expect_close("encoder out, explicit positions", got, ref, 0.0);
    EXPECT_TRUE(std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)) == 0) << "not bitwise equal";
}

TEST_F(KernelTest, EncoderBackwardMatchesCpuAndIsDeterministic) {
    struct Case {
        Shape s;
        bool repeated;  // most positions hold one token: a run longer than a block
    };
    std::vector<Case> cases;
    for (const Shape& s : kShapes) cases.push_back({s, false});
    cases.push_back({{8, 64, 48, 3, 101, 128}, true});
    for (const Case& c : cases) {
        const Shape& s = c.s;
        SCOPED_TRACE(s.name() + (c.repeated ? " repeated token" : ""));
        std::printf("  %s%s\n", s.name().c_str(), c.repeated ? " (token 7 at ~3/4 of the positions)" : "");
        const int maxT = s.T + 3;
        const size_t N = size_t(s.N());
        auto tokens = random_tokens(N, s.V, 4);
        if (c.repeated) {
            std::mt19937_64 gen(5);
            for (int& t : tokens) {
                if (gen() % 4 != 0) t = 7;
            }
        }
        const auto dout = random_bf16(N * s.C, 6);
        const auto dwte0 = random_bf16(size_t(s.Vp) * s.C, 7, 0.5f), dwpe0 = random_bf16(size_t(maxT) * s.C, 8, 0.5f);
        std::vector<float> dwte_ref = dwte0, dwpe_ref = dwpe0;
        cpu::encoder_backward<float>(dwte_ref.data(), dwpe_ref.data(), dout.data(), tokens.data(), s.B, s.T, s.C);

        auto d_dout = upload_bf16(dout);
        auto d_tokens = upload(tokens);
        const size_t scratch_bytes = encoder_backward_scratch_bytes(s.B, s.T, s.Vp);
        DeviceBuffer<char> scratch(scratch_bytes);
        std::vector<unsigned char> first_wte, first_wpe;
        for (int run = 0; run < 2; run++) {
            auto d_dwte = upload_bf16(dwte0), d_dwpe = upload_bf16(dwpe0);
            poison(scratch);
            encoder_backward(d_dwte.get(), d_dwpe.get(), d_dout.get(), d_tokens.get(), s.B, s.T, s.C, s.Vp,
                             scratch.get(), scratch_bytes, kStream);
            if (run == 0) {
                const auto dwte = download_bf16(d_dwte.get(), dwte0.size());
                const auto dwpe = download_bf16(d_dwpe.get(), dwpe0.size());
                expect_close("dwte (relative to what was added)", dwte, dwte_ref, kTolBf16, &dwte0);
                expect_close("dwpe (relative to what was added)", dwpe, dwpe_ref, kTolBf16, &dwpe0);
                std::vector<bool> present(size_t(s.Vp), false);
                for (int t : tokens) present[size_t(t)] = true;
                for (int v = 0; v < s.Vp; v++) {
                    if (present[size_t(v)]) continue;
                    for (int ch = 0; ch < s.C; ch++) {
                        ASSERT_EQ(dwte[size_t(v) * s.C + ch], dwte0[size_t(v) * s.C + ch])
                            << "dwte row " << v << " changed";
                    }
                }
                for (size_t i = size_t(s.T) * s.C; i < dwpe0.size(); i++) {
                    ASSERT_EQ(dwpe[i], dwpe0[i]) << "dwpe row " << i / s.C << " >= T changed";
                }
                first_wte = bytes_of(d_dwte.get(), dwte0.size());
                first_wpe = bytes_of(d_dwpe.get(), dwpe0.size());
            } else {
                expect_bitwise("dwte", bytes_of(d_dwte.get(), dwte0.size()), first_wte);
                expect_bitwise("dwpe", bytes_of(d_dwpe.get(), dwpe0.size()), first_wpe);
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------------

TEST_F(KernelTest, LayerNormForwardMatchesCpu) {
    for (const Shape& s : kShapes) {
        SCOPED_TRACE(s.name());
        std::printf("  %s\n", s.name().c_str());
        const int64_t N = s.N();
        const auto inp = random_bf16(size_t(N) * s.C, 10, 2.0f, 0.3f);
        const auto weight = random_bf16(size_t(s.C), 11, 0.1f, 1.0f), bias = random_bf16(size_t(s.C), 12, 0.1f);
        std::vector<float> out_ref(inp.size()), mean_ref(static_cast<size_t>(N)), rstd_ref(static_cast<size_t>(N));
        cpu::layernorm_forward<float>(out_ref.data(), mean_ref.data(), rstd_ref.data(), inp.data(), weight.data(),
                                      bias.data(), N, s.C);

        auto d_inp = upload_bf16(inp), d_w = upload_bf16(weight), d_b = upload_bf16(bias);
        DeviceBuffer<floatX> d_out(inp.size());
        DeviceBuffer<float> d_mean(static_cast<size_t>(N)), d_rstd(static_cast<size_t>(N));
        poison(d_out);
        poison(d_mean);
        poison(d_rstd);
        layernorm_forward(d_out.get(), d_mean.get(), d_rstd.get(), d_inp.get(), d_w.get(), d_b.get(), N, s.C, kStream);
        const auto out = download_bf16(d_out.get(), inp.size());
        expect_close("layernorm out", out, out_ref, kTolBf16);
        expect_close("layernorm mean (fp32)", download(d_mean.get(), size_t(N)), mean_ref, kTolFp32);
        expect_close("layernorm rstd (fp32)", download(d_rstd.get(), size_t(N)), rstd_ref, kTolFp32);
    }
}

// For C up to 7 * 256 the forward kernel holds a row in registers between LayerNorm's passes; the same
// launch reading the row from memory in each pass (what larger C runs) must give the same bits, and both
// must match the CPU.
TEST_F(KernelTest, LayerNormForwardHeldRowsKeepTheBits) {
    const struct { int64_t N; int C; } cases[] = {{37, 72}, {300, 768}, {150, 1024}, {53, 1280}, {70, 1600},
                                                  {41, 2048}};
    for (const auto& cs : cases) {
        const int64_t N = cs.N;
        const int C = cs.C;
        const size_t n = size_t(N) * C;
        const int held = detail::layernorm_held_packs(C);
        SCOPED_TRACE(format("N=%lld C=%d, %d packs a lane held", (long long)N, C, held));
        std::printf("  N=%lld C=%d: %d packs a lane held\n", (long long)N, C, held);
        const auto inp = random_bf16(n, 30, 2.0f, 0.3f);
        const auto weight = random_bf16(size_t(C), 32, 0.1f, 1.0f), bias = random_bf16(size_t(C), 33, 0.1f);
        std::vector<float> out_ref(n), mean_ref(static_cast<size_t>(N)), rstd_ref(static_cast<size_t>(N));
        cpu::layernorm_forward<float>(out_ref.data(), mean_ref.data(), rstd_ref.data(), inp.data(), weight.data(),
                                      bias.data(), N, C);
        auto d_inp = upload_bf16(inp), d_w = upload_bf16(weight), d_bias = upload_bf16(bias);
        // Ways: held, read in each pass.
        std::vector<unsigned char> bits[2][3];  // [way][out, mean, rstd]
        for (int way = 0; way < 2; way++) {
            SCOPED_TRACE(way == 0 ? "held" : "read in each pass");
            DeviceBuffer<floatX> d_out(n);
            DeviceBuffer<float> d_mean(static_cast<size_t>(N)), d_rstd(static_cast<size_t>(N));
            poison(d_out);
            poison(d_mean);
            poison(d_rstd);
            detail::layernorm_forward_rows(way == 0 ? held : 0, d_out.get(), d_mean.get(), d_rstd.get(), d_inp.get(),
                                           d_w.get(), d_bias.get(), N, C, kStream);
            bits[way][0] = bytes_of(d_out.get(), n);
            bits[way][1] = bytes_of(d_mean.get(), size_t(N));
            bits[way][2] = bytes_of(d_rstd.get(), size_t(N));
            expect_close("out", download_bf16(d_out.get(), n), out_ref, kTolBf16);
            expect_close("mean (fp32)", download(d_mean.get(), size_t(N)), mean_ref, kTolFp32);
            expect_close("rstd (fp32)", download(d_rstd.get(), size_t(N)), rstd_ref, kTolFp32);
        }
        SCOPED_TRACE("read in each pass against held rows");
        expect_bitwise("out", bits[1][0], bits[0][0]);
        expect_bitwise("mean", bits[1][1], bits[0][1]);
        expect_bitwise("rstd", bits[1][2], bits[0][2]);
    }
    expect_error([&] {
        DeviceBuffer<floatX> x(64 * 1024);
        detail::layernorm_forward_rows(3, x.get(), nullptr, nullptr, x.get(), x.get(), x.get(), 64, 1024, kStream);
    }, kExitUsage, {"layernorm_forward: 3 packs a lane held, need 0, or 3, 4 or 7 covering C = 1024"});
}

TEST_F(KernelTest, LayerNormBackwardMatchesCpuAndIsDeterministic) {
    // kShapes, plus C = 384 and 640 (the fused kernel with 2 and 3 packs per lane, the last one partial),
    // C = 1024 (the two-kernel path), and N = 8500 (34 chunks: the final kernel's warps add more than one
    // chunk each, as at the trainer's 256) at C = 48 and 768.
    std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
    shapes.push_back({3, 300, 384, 6, 101, 128});
    shapes.push_back({1, 333, 640, 10, 101, 128});
    shapes.push_back({2, 4250, 48, 3, 101, 128});
    shapes.push_back({4, 2125, 768, 12, 101, 128});
    shapes.push_back({2, 150, 1024, 16, 101, 128});
    for (const Shape& s : shapes) {
        SCOPED_TRACE(s.name());
        std::printf("  %s\n", s.name().c_str());
        const int64_t N = s.N();
        const size_t n = size_t(N) * s.C;
        const auto inp = random_bf16(n, 20, 2.0f, 0.3f), dout = random_bf16(n, 21);
        const auto weight = random_bf16(size_t(s.C), 22, 0.1f, 1.0f), bias = random_bf16(size_t(s.C), 23, 0.1f);
        std::vector<float> out(n), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
        cpu::layernorm_forward<float>(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N,
                                      s.C);
        const auto dinp0 = random_bf16(n, 24), dw0 = random_bf16(size_t(s.C), 25, 4.0f),
                   db0 = random_bf16(size_t(s.C), 26, 4.0f);
        std::vector<float> dinp_ref = dinp0, dw_ref = dw0, db_ref = db0;
        cpu::layernorm_backward<float>(dinp_ref.data(), dw_ref.data(), db_ref.data(), dout.data(), inp.data(),
                                       weight.data(), mean.data(), rstd.data(), N, s.C);

        auto d_inp = upload_bf16(inp), d_dout = upload_bf16(dout), d_w = upload_bf16(weight);
        auto d_mean = upload(mean), d_rstd = upload(rstd);
        const size_t scratch_bytes = layernorm_backward_scratch_bytes(N, s.C);
        DeviceBuffer<float> scratch(scratch_bytes / sizeof(float));
        // next_dbias: the next linear layer's bias gradient, dinp's column sums added to it.
        const auto nb0 = random_bf16(size_t(s.C), 27, 4.0f);
        const std::vector<unsigned char> nb0_bits = bytes_of(upload_bf16(nb0).get(), size_t(s.C));
        std::vector<unsigned char> first[4];
        const std::vector<unsigned char> dinp0_bits = bytes_of(upload_bf16(dinp0).get(), n);
        // The trainer's path twice, then without next_dbias, then reading the gradient to add to from another
        // buffer (dres: GPT2's backward with weight gradients on a second stream).
        for (int run = 0; run < 4; run++) {
            const bool next = run != 2, from_dres = run == 3;
            auto d_dinp = upload_bf16(dinp0), d_dw = upload_bf16(dw0), d_db = upload_bf16(db0), d_nb = upload_bf16(nb0);
            auto d_dres = upload_bf16(dinp0);
            if (from_dres) poison(d_dinp);
            poison(scratch);
            layernorm_backward(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(), d_w.get(), d_mean.get(),
                               d_rstd.get(), N, s.C, scratch.get(), scratch_bytes, kStream, next ? d_nb.get() : nullptr,
                               from_dres ? d_dres.get() : nullptr);
            if (from_dres) {
                expect_bitwise("dres left as it was", bytes_of(d_dres.get(), n), dinp0_bits);
            }
            std::vector<unsigned char> bits[4] = {bytes_of(d_dinp.get(), n), bytes_of(d_dw.get(), size_t(s.C)),
                                                  bytes_of(d_db.get(), size_t(s.C)), bytes_of(d_nb.get(), size_t(s.C))};
            if (run == 0) {
                expect_close("dinp (relative to what was added)", download_bf16(d_dinp.get(), n), dinp_ref, kTolBf16,
                             &dinp0);
                expect_close("dweight (relative to what was added)", download_bf16(d_dw.get(), size_t(s.C)), dw_ref,
                             kTolBf16, &dw0);
                expect_close("dbias (relative to what was added)", download_bf16(d_db.get(), size_t(s.C)), db_ref,
                             kTolBf16, &db0);
                // next_dbias: bit for bit what bias_grad_accumulate adds from the dinp just written.
                auto d_nb_ref = upload_bf16(nb0);
                const size_t bias_scratch_bytes = matmul_backward_scratch_bytes(N, s.C);
                DeviceBuffer<float> bias_scratch(bias_scratch_bytes / sizeof(float));
                bias_grad_accumulate(d_nb_ref.get(), d_dinp.get(), N, s.C, bias_scratch.get(), bias_scratch_bytes,
                                     kStream);
                expect_bitwise("next_dbias against bias_grad_accumulate over dinp", bits[3],
                               bytes_of(d_nb_ref.get(), size_t(s.C)));
                const std::vector<float> nb = download_bf16(d_nb.get(), size_t(s.C));
                std::vector<float> nb_cpu = nb0;
                const std::vector<float> dinp_now = download_bf16(d_dinp.get(), n);
                for (int64_t r = 0; r < N; r++) {
                    for (int c = 0; c < s.C; c++) nb_cpu[size_t(c)] += dinp_now[size_t(r) * s.C + c];
                }
                expect_close("next_dbias (relative to what was added)", nb, nb_cpu, kTolBf16, &nb0);
                for (int i = 0; i < 4; i++) first[i] = bits[i];
            } else {
                SCOPED_TRACE(from_dres ? "from dres" : next ? "run twice" : "without next_dbias");
                expect_bitwise("dinp", bits[0], first[0]);
                expect_bitwise("dweight", bits[1], first[1]);
                expect_bitwise("dbias", bits[2], first[2]);
                if (next) {
                    expect_bitwise("next_dbias", bits[3], first[3]);
                } else {
                    expect_bitwise("next_dbias (not asked for)", bits[3], nb0_bits);
                }
            }
        }
        // Where the fused kernel runs (C <= 768), the separate row and partial kernels (what larger C runs)
        // must give the same dinp and chunk partials (dinp's column sums included) bit for bit.
        if (detail::layernorm_backward_fuses(s.C)) {
            SCOPED_TRACE("fused kernel against the separate kernels, in place and from dres");
            const size_t n_partial = scratch_bytes / sizeof(float);
            float* partial_dinp = scratch.get() + layernorm_chunks(N) * 2 * s.C;
            // way 0: fused, 1: separate, 2 and 3: the same from dres (dinp poisoned, dres left alone).
            std::vector<unsigned char> dinp_bits[4], partial_bits[4];
            for (int way = 0; way < 4; way++) {
                const bool from_dres = way >= 2;
                auto d_dinp = upload_bf16(dinp0), d_dres = upload_bf16(dinp0);
                if (from_dres) poison(d_dinp);
                poison(scratch);
                auto rows = way % 2 == 0 ? detail::layernorm_backward_rows_fused : detail::layernorm_backward_rows_separate;
                rows(d_dinp.get(), from_dres ? d_dres.get() : d_dinp.get(), scratch.get(), partial_dinp, d_dout.get(),
                     d_inp.get(), d_w.get(), d_mean.get(), d_rstd.get(), N, s.C, kStream);
                dinp_bits[way] = bytes_of(d_dinp.get(), n);
                partial_bits[way] = bytes_of(scratch.get(), n_partial);
                if (from_dres) expect_bitwise("dres left as it was", bytes_of(d_dres.get(), n), dinp0_bits);
            }
            const char* names[4] = {"fused", "separate", "fused from dres", "separate from dres"};
            for (int way = 1; way < 4; way++) {
                SCOPED_TRACE(names[way]);
                expect_bitwise("dinp", dinp_bits[way], dinp_bits[0]);
                expect_bitwise("dweight, dbias and dinp chunk partials", partial_bits[way], partial_bits[0]);
            }
        }
    }
    expect_error([&] {
        DeviceBuffer<floatX> x(16 * 1024);
        DeviceBuffer<float> f(3 * 1024);
        detail::layernorm_backward_rows_fused(x.get(), x.get(), f.get(), nullptr, x.get(), x.get(), x.get(), f.get(),
                                              f.get(), 16, 1024, kStream);
    }, kExitUsage, {"layernorm_backward: the fused kernel takes C up to 768, not 1024"});
    expect_error([&] {  // dinp is rows 1-2 of x, dres rows 0-1: one row overlaps
        DeviceBuffer<floatX> x(3 * 64), dout(2 * 64), w(64);
        DeviceBuffer<float> stats(2);
        const size_t sb = layernorm_backward_scratch_bytes(2, 64);
        DeviceBuffer<float> scratch(sb / sizeof(float));
        layernorm_backward(x.get() + 64, w.get(), w.get(), dout.get(), dout.get(), w.get(), stats.get(), stats.get(), 2,
                           64, scratch.get(), sb, kStream, nullptr, x.get());
    }, kExitUsage, {"layernorm_backward: dres", "and dinp", "overlap"});
}

// ----------------------------------------------------------------------------------------------------

struct LinearCase {
    int C, OC;
    bool bias, gelu;
    const char* name;
};

std::vector<LinearCase> linear_cases(const Shape& s) {
    return {
        {s.C, 3 * s.C, true, false, "qkv: C -> 3C + bias"},
        {s.C, s.C, true, false, "attproj: C -> C + bias"},
        {s.C, s.Vp, false, false, "classifier: C -> Vp, no bias"},
        {s.C, 4 * s.C, true, true, "fc + GELU: C -> 4C + bias"},
    };
}

TEST_F(KernelTest, MatmulForwardMatchesCpu) {
    CublasLt lt;
    for (const Shape& s : kShapes) {
        for (const LinearCase& c : linear_cases(s)) {
            SCOPED_TRACE(s.name() + " " + c.name);
            std::printf("  %s, %s\n", s.name().c_str(), c.name);
            const int64_t N = s.N();
            const auto inp = random_bf16(size_t(N) * c.C, 30);
            const auto weight = random_bf16(size_t(c.OC) * c.C, 31, 1.0f / std::sqrt(float(c.C)));
            const auto bias = random_bf16(size_t(c.OC), 32, 0.5f);
            std::vector<float> pre_ref(size_t(N) * c.OC);
            cpu::matmul_forward<float>(pre_ref.data(), inp.data(), weight.data(), c.bias ? bias.data() : nullptr, N,
                                       c.C, c.OC);
            std::vector<float> out_ref = pre_ref;
            if (c.gelu) cpu::gelu_forward<float>(out_ref.data(), pre_ref.data(), int64_t(pre_ref.size()));

            auto d_inp = upload_bf16(inp), d_w = upload_bf16(weight), d_b = upload_bf16(bias);
            DeviceBuffer<floatX> d_out(out_ref.size()), d_pre(pre_ref.size());
            poison(d_out);
            poison(d_pre);
            matmul_forward(lt, d_out.get(), d_inp.get(), d_w.get(), c.bias ? d_b.get() : nullptr, N, c.C, c.OC, kStream,
                           c.gelu ? d_pre.get() : nullptr);
            expect_close(c.gelu ? "out = GELU(inp @ W^T + b)" : "out", download_bf16(d_out.get(), out_ref.size()),
                         out_ref, kTolBf16);
            if (c.gelu) expect_close("pre_gelu", download_bf16(d_pre.get(), pre_ref.size()), pre_ref, kTolBf16);
            if (c.gelu) continue;
            // With a residual (the projections' residual add in the epilogue): out = residual + inp @ W^T (+ b),
            // into another buffer (the residual left as it was) and in place.
            const auto res = random_bf16(out_ref.size(), 33, 2.0f);
            std::vector<float> res_ref(out_ref.size());
            for (size_t i = 0; i < res_ref.size(); i++) res_ref[i] = res[i] + pre_ref[i];
            auto d_res = upload_bf16(res);
            poison(d_out);
            matmul_forward(lt, d_out.get(), d_inp.get(), d_w.get(), c.bias ? d_b.get() : nullptr, N, c.C, c.OC, kStream,
                           nullptr, d_res.get());
            expect_close("out = residual + inp @ W^T (+ b)", download_bf16(d_out.get(), res_ref.size()), res_ref,
                         kTolBf16);
            const auto res_after = download_bf16(d_res.get(), res.size());
            EXPECT_EQ(std::memcmp(res_after.data(), res.data(), res.size() * sizeof(float)), 0)
                << "the residual changed";
            matmul_forward(lt, d_res.get(), d_inp.get(), d_w.get(), c.bias ? d_b.get() : nullptr, N, c.C, c.OC, kStream,
                           nullptr, d_res.get());
            expect_close("in place: residual += inp @ W^T (+ b)", download_bf16(d_res.get(), res_ref.size()), res_ref,
                         kTolBf16);
        }
    }
    expect_error([&] {
        CublasLt lt2;
        DeviceBuffer<floatX> x(64 * 64), w(64 * 64), out(64 * 64), pre(64 * 64);
        matmul_forward(lt2, out.get(), x.get(), w.get(), nullptr, 64, 64, 64, kStream, pre.get(), x.get());
    }, kExitUsage, {"matmul_forward: a residual and a GELU output in one call"});
    expect_error([&] {  // out is rows 1-64 of y, the residual rows 0-63
        CublasLt lt2;
        DeviceBuffer<floatX> x(64 * 64), w(64 * 64), y(65 * 64);
        matmul_forward(lt2, y.get() + 64, x.get(), w.get(), nullptr, 64, 64, 64, kStream, nullptr, y.get());
    }, kExitUsage, {"matmul_forward: residual", "and out", "overlap"});
}

TEST_F(KernelTest, MatmulBackwardMatchesCpuAndIsDeterministic) {
    CublasLt lt;
    for (const Shape& s : kShapes) {
        struct Case {
            int C, OC;
            bool bias, dgelu;
            const char* name;
        };
        const Case cases[] = {
            {s.C, 3 * s.C, true, false, "qkv: C -> 3C + bias"},
            {s.C, s.Vp, false, false, "classifier: C -> Vp, no bias"},
            {4 * s.C, s.C, true, true, "fcproj: 4C -> C + bias, dinp through GELU'"},
        };
        for (const Case& c : cases) {
            SCOPED_TRACE(s.name() + " " + c.name);
            std::printf("  %s, %s\n", s.name().c_str(), c.name);
            const int64_t N = s.N();
            const size_t n_in = size_t(N) * c.C, n_out = size_t(N) * c.OC, n_w = size_t(c.OC) * c.C;
            const auto inp = random_bf16(n_in, 40), dout = random_bf16(n_out, 41);
            const auto weight = random_bf16(n_w, 42, 1.0f / std::sqrt(float(c.C)));
            const auto pre_gelu = random_bf16(n_in, 43, 2.0f);
            const auto dw0 = random_bf16(n_w, 44, 4.0f), db0 = random_bf16(size_t(c.OC), 45, 8.0f);
            std::vector<float> dinp_ref(n_in, 0.0f), dw_ref = dw0, db_ref = db0;
            cpu::matmul_backward<float>(dinp_ref.data(), dw_ref.data(), c.bias ? db_ref.data() : nullptr, dout.data(),
                                        inp.data(), weight.data(), N, c.C, c.OC);
            if (c.dgelu) {
                const std::vector<float> through = dinp_ref;
                std::fill(dinp_ref.begin(), dinp_ref.end(), 0.0f);
                cpu::gelu_backward<float>(dinp_ref.data(), pre_gelu.data(), through.data(), int64_t(n_in));
            }

            auto d_inp = upload_bf16(inp), d_dout = upload_bf16(dout), d_w = upload_bf16(weight);
            auto d_pre = upload_bf16(pre_gelu);
            const size_t scratch_bytes = matmul_backward_scratch_bytes(N, c.OC);
            DeviceBuffer<float> scratch(scratch_bytes / sizeof(float));
            DeviceBuffer<floatX> d_dinp(n_in);
            std::vector<unsigned char> first[3];
            for (int run = 0; run < 2; run++) {
                auto d_dw = upload_bf16(dw0), d_db = upload_bf16(db0);
                poison(d_dinp);
                poison(scratch);
                matmul_backward(lt, d_dinp.get(), d_dw.get(), c.bias ? d_db.get() : nullptr, d_dout.get(), d_inp.get(),
                                d_w.get(), N, c.C, c.OC, scratch.get(), scratch_bytes, kStream,
                                c.dgelu ? d_pre.get() : nullptr);
                std::vector<unsigned char> bits[3] = {bytes_of(d_dinp.get(), n_in), bytes_of(d_dw.get(), n_w),
                                                      bytes_of(d_db.get(), size_t(c.OC))};
                if (run == 0) {
                    expect_close(c.dgelu ? "dinp = (dout @ W) * GELU'(pre)" : "dinp = dout @ W",
                                 download_bf16(d_dinp.get(), n_in), dinp_ref, kTolBf16);
                    expect_close("dweight (relative to what was added)", download_bf16(d_dw.get(), n_w), dw_ref,
                                 kTolBf16, &dw0);
                    const auto db = download_bf16(d_db.get(), size_t(c.OC));
                    if (c.bias) {
                        expect_close("dbias (relative to what was added)", db, db_ref, kTolBf16, &db0);
                    } else {
                        EXPECT_TRUE(db == db0) << "dbias changed although no bias was given";
                    }
                    for (int i = 0; i < 3; i++) first[i] = bits[i];
                } else {
                    expect_bitwise("dinp", bits[0], first[0]);
                    expect_bitwise("dweight", bits[1], first[1]);
                    expect_bitwise("dbias", bits[2], first[2]);
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------------

// attention_forward/backward run flash attention for HS 64 and 128 and the cuBLASLt path for other head
// sizes; every case names the path it must take, so the dispatch is pinned too. T is 1 (one key per
// query), 37, 65 (one row into a second 64-row flash tile), 97 and 200 (a partial fourth tile), none a
// multiple of the tiles or of the cuBLASLt path's 8-column padding; plus the d12 head layout at T=64.
struct AttentionCase {
    int B, T, C, NH;
    bool flash;
    std::string name() const {
        return format("B=%d T=%d C=%d NH=%d HS=%d (%s)", B, T, C, NH, C / NH, flash ? "flash" : "cuBLASLt");
    }
};

const AttentionCase kAttentionCases[] = {
    {2, 1, 128, 2, true},  {3, 37, 192, 3, true}, {2, 65, 128, 2, true}, {1, 200, 256, 4, true},
    {2, 64, 768, 12, true}, {2, 1, 256, 2, true},  {2, 37, 256, 2, true}, {1, 65, 384, 3, true},
    {1, 200, 256, 2, true}, {2, 1, 48, 3, false},  {3, 37, 96, 3, false}, {2, 65, 96, 2, false},
    {8, 97, 96, 3, false},  {1, 200, 144, 3, false},
};

// lse[b,h,t] = ln sum_{k<=t} exp(q_t.k_k / sqrt(HS)) in double, from the same (bf16) values as the GPU.
std::vector<float> attention_lse_ref(const std::vector<float>& qkv, int B, int T, int C, int NH) {
    const int HS = C / NH;
    const double scale = 1.0 / std::sqrt(double(HS));
    std::vector<float> lse(size_t(B) * NH * T);
    std::vector<double> s(static_cast<size_t>(T));
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            for (int t = 0; t < T; t++) {
                const float* q = &qkv[(size_t(b) * T + size_t(t)) * 3 * C + size_t(h) * HS];
                double m = -INFINITY;
                for (int k = 0; k <= t; k++) {
                    const float* kp = &qkv[(size_t(b) * T + size_t(k)) * 3 * C + size_t(C) + size_t(h) * HS];
                    double dot = 0;
                    for (int d = 0; d < HS; d++) dot += double(q[d]) * kp[d];
                    s[size_t(k)] = scale * dot;
                    m = std::max(m, s[size_t(k)]);
                }
                double sum = 0;
                for (int k = 0; k <= t; k++) sum += std::exp(s[size_t(k)] - m);
                lse[(size_t(b) * NH + size_t(h)) * T + size_t(t)] = float(m + std::log(sum));
            }
        }
    }
    return lse;
}

// Elements part*C .. part*C+C-1 of every row of a (N, 3C) tensor: dq, dk or dv of dqkv.
std::vector<float> qkv_part(const std::vector<float>& x, int64_t N, int C, int part) {
    std::vector<float> r(size_t(N) * C);
    for (int64_t i = 0; i < N; i++) {
        std::copy_n(x.begin() + (i * 3 + part) * C, C, r.begin() + i * C);
    }
    return r;
}

// cuBLASLt tuning (always on in the trainer): every linear-layer matmul gives bitwise what the heuristic's
// first choice gives, at d12's layer widths and the LM head's; a second call of a tuned shape uses the cache.
TEST_F(KernelTest, MatmulTuningKeepsTheBits) {
    struct Case {
        int64_t N;
        int C, OC;
        bool bias, gelu, dgelu;  // gelu: GELU epilogue forward; dgelu: dinp through GELU'
        const char* name;
        bool residual = false;  // the forward adds a residual (C, beta = 1, another buffer than D)
    };
    const Case cases[] = {
        {4096, 768, 2304, true, false, false, "qkv 768 -> 2304 + bias"},
        {4096, 768, 768, true, false, false, "attproj 768 -> 768 + bias"},
        {4096, 768, 3072, true, true, false, "fc 768 -> 3072 + bias, GELU"},
        {4096, 3072, 768, true, false, true, "fcproj 3072 -> 768 + bias, dinp through GELU'"},
        {1024, 768, 50304, false, false, false, "LM head 768 -> 50304"},
        {4096, 3072, 768, true, false, false, "fcproj 3072 -> 768 + bias + the residual", true},
    };
    CublasLt plain, tuned;
    tuned.set_tuning(true);
    size_t tuned_keys = 0;
    for (const Case& c : cases) {
        SCOPED_TRACE(c.name);
        std::printf("  %s, N=%lld\n", c.name, (long long)c.N);
        const size_t n_in = size_t(c.N) * c.C, n_out = size_t(c.N) * c.OC, n_w = size_t(c.OC) * c.C;
        auto d_inp = upload_bf16(random_bf16(n_in, 60)), d_w = upload_bf16(random_bf16(n_w, 61, 0.03f));
        auto d_b = upload_bf16(random_bf16(size_t(c.OC), 62, 0.5f)), d_dout = upload_bf16(random_bf16(n_out, 63));
        auto d_pre_in = upload_bf16(random_bf16(n_in, 64, 2.0f));
        auto d_res = upload_bf16(random_bf16(n_out, 67, 2.0f));
        const size_t scratch_bytes = matmul_backward_scratch_bytes(c.N, c.OC);
        DeviceBuffer<float> scratch(scratch_bytes / sizeof(float));
        std::vector<unsigned char> bits[2][5];
        for (int t = 0; t < 2; t++) {
            const CublasLt& lt = t == 0 ? plain : tuned;
            for (int call = 0; call < (t == 1 ? 2 : 1); call++) {
                DeviceBuffer<floatX> out(n_out), pre(n_out), dinp(n_in);
                auto dw = upload_bf16(random_bf16(n_w, 65)), db = upload_bf16(random_bf16(size_t(c.OC), 66));
                poison(out);
                poison(pre);
                poison(dinp);
                matmul_forward(lt, out.get(), d_inp.get(), d_w.get(), c.bias ? d_b.get() : nullptr, c.N, c.C, c.OC,
                               kStream, c.gelu ? pre.get() : nullptr, c.residual ? d_res.get() : nullptr);
                matmul_backward(lt, dinp.get(), dw.get(), c.bias ? db.get() : nullptr, d_dout.get(), d_inp.get(),
                                d_w.get(), c.N, c.C, c.OC, scratch.get(), scratch_bytes, kStream,
                                c.dgelu ? d_pre_in.get() : nullptr);
                std::vector<unsigned char> b[5] = {bytes_of(out.get(), n_out),
                                                   c.gelu ? bytes_of(pre.get(), n_out) : std::vector<unsigned char>{},
                                                   bytes_of(dinp.get(), n_in), bytes_of(dw.get(), n_w),
                                                   bytes_of(db.get(), size_t(c.OC))};
                if (t == 1 && call == 0) tuned_keys = tuned.tuned().size();
                if (t == 1 && call == 1) {
                    EXPECT_EQ(tuned.tuned().size(), tuned_keys) << "a second call of the same shapes tuned again";
                }
                if (t == 0) {
                    for (int i = 0; i < 5; i++) bits[0][i] = b[i];
                } else {
                    const char* names[5] = {"out", "pre_gelu", "dinp", "dweight", "dbias"};
                    for (int i = 0; i < 5; i++) {
                        expect_bitwise(format("%s (tuned, call %d)", names[i], call + 1), b[i], bits[0][i]);
                    }
                }
            }
        }
    }
    // Forward and dinp of each case are tuned (the weight gradients accumulate into D, beta = 1: never tuned;
    // the residual's forward reads C from its own buffer, so it is). The last case's dinp, a plain matmul,
    // is not the fcproj case's, which runs through GELU'.
    EXPECT_EQ(tuned.tuned().size(), 2 * std::size(cases));
    EXPECT_TRUE(plain.tuned().empty());
    int moved = 0;
    for (const auto& kv : tuned.tuned()) {
        const CublasLt::Tuned& t = kv.second;
        EXPECT_GE(t.candidates, 1);
        EXPECT_GE(t.same_bits, 1);
        EXPECT_LE(t.same_bits, t.candidates);
        EXPECT_LT(t.rank, t.candidates);
        EXPECT_LE(t.chosen_ms, t.first_ms);
        EXPECT_GT(t.chosen_ms, 0.0f);
        moved += t.rank != 0;
    }
    std::printf("  %zu shapes tuned, %d run another algorithm than the heuristic's first\n", tuned.tuned().size(),
                moved);
}

TEST_F(KernelTest, AttentionForwardBackwardMatchCpuAndAreDeterministic) {
    CublasLt lt;
    for (const AttentionCase& s : kAttentionCases) {
        SCOPED_TRACE(s.name());
        std::printf("  %s\n", s.name().c_str());
        const int HS = s.C / s.NH;
        ASSERT_EQ(attention_uses_flash(HS), s.flash) << "attention_forward/backward take the other path";
        const int64_t N = int64_t(s.B) * s.T;
        const int Tp = attention_padded_len(s.T);
        const size_t n_qkv = size_t(N) * 3 * s.C, n_out = size_t(N) * s.C, n_rows = size_t(s.B) * s.NH * s.T;
        // Larger than unit deviation so the softmax is far from uniform.
        const auto qkv = random_bf16(n_qkv, 50, 1.5f), dout = random_bf16(n_out, 51);
        std::vector<float> out_ref(n_out), att_ref(n_rows * s.T), dqkv_ref(n_qkv, 0.0f);
        cpu::attention_forward<float>(out_ref.data(), att_ref.data(), qkv.data(), s.B, s.T, s.C, s.NH);
        cpu::attention_backward<float>(dqkv_ref.data(), dout.data(), qkv.data(), att_ref.data(), s.B, s.T, s.C, s.NH);

        auto d_qkv = upload_bf16(qkv), d_dout = upload_bf16(dout);
        const size_t saved_bytes = attention_saved_bytes(s.B, s.NH, s.T, HS);
        const size_t scratch_bytes = attention_scratch_bytes(s.B, s.NH, s.T, HS);
        EXPECT_EQ(saved_bytes, s.flash ? n_rows * sizeof(float) : n_rows * size_t(Tp) * sizeof(floatX))
            << "saved state: lse (B,NH,T) fp32 with flash, att (B,NH,T,Tp) bf16 otherwise";
        DeviceBuffer<char> saved(saved_bytes), scratch(scratch_bytes);
        DeviceBuffer<floatX> d_out(n_out), d_dqkv(n_qkv);

        // Forward twice into poisoned buffers: checked against the CPU, then bitwise against the first run.
        std::vector<unsigned char> first_out, first_saved;
        for (int run = 0; run < 2; run++) {
            poison(d_out);
            poison(saved);
            poison(scratch);
            attention_forward(lt, d_out.get(), saved.get(), saved_bytes, d_qkv.get(), s.B, s.T, s.C, s.NH,
                              scratch.get(), scratch_bytes, kStream);
            if (run == 1) {
                expect_bitwise("out (forward twice)", bytes_of(d_out.get(), n_out), first_out);
                expect_bitwise("saved state (forward twice)", bytes_of(saved.get(), saved_bytes), first_saved);
                break;
            }
            expect_close("out", download_bf16(d_out.get(), n_out), out_ref, kTolBf16);
            if (s.flash) {
                // fp32 statistics from bf16 inputs, summed in another order than the double reference.
                expect_close("lse (fp32)", download(reinterpret_cast<const float*>(saved.get()), n_rows),
                             attention_lse_ref(qkv, s.B, s.T, s.C, s.NH), kTolFp32);
            } else {
                const auto att = download_bf16(reinterpret_cast<const floatX*>(saved.get()), n_rows * size_t(Tp));
                std::vector<float> att_valid(n_rows * s.T);
                size_t nonzero_masked = 0;
                for (size_t row = 0; row < n_rows; row++) {
                    const size_t t = row % size_t(s.T);
                    for (int t2 = 0; t2 < Tp; t2++) {
                        const float a = att[row * Tp + size_t(t2)];
                        if (t2 < s.T) att_valid[row * s.T + size_t(t2)] = a;
                        if (size_t(t2) > t && a != 0.0f) nonzero_masked++;
                    }
                }
                expect_close("att (probabilities, first T columns)", att_valid, att_ref, kTolBf16);
                EXPECT_EQ(nonzero_masked, 0u) << "att must be 0 above the diagonal and in the padding columns";
            }
            first_out = bytes_of(d_out.get(), n_out);
            first_saved = bytes_of(saved.get(), saved_bytes);
        }

        // Backward twice, dqkv and scratch poisoned each time: checked, then bitwise against the first run.
        std::vector<unsigned char> first_dqkv;
        for (int run = 0; run < 2; run++) {
            poison(d_dqkv);
            poison(scratch);
            attention_backward(lt, d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(), saved.get(), saved_bytes,
                               s.B, s.T, s.C, s.NH, scratch.get(), scratch_bytes, kStream);
            if (run == 1) {
                expect_bitwise("dqkv (backward twice)", bytes_of(d_dqkv.get(), n_qkv), first_dqkv);
                break;
            }
            const auto dqkv = download_bf16(d_dqkv.get(), n_qkv);
            expect_close("dqkv", dqkv, dqkv_ref, kTolBf16);
            // Each part alone too (at T = 1, dq and dk are 0: a single key gets all the weight).
            if (s.T > 1) {
                const char* names[3] = {"dq", "dk", "dv"};
                for (int part = 0; part < 3; part++) {
                    expect_close(names[part], qkv_part(dqkv, N, s.C, part), qkv_part(dqkv_ref, N, s.C, part),
                                 kTolBf16);
                }
            }
            first_dqkv = bytes_of(d_dqkv.get(), n_qkv);
        }
    }
}

// attention_backward's bias_sums (the wgmma kernels; where they do not run, skipped with a message): dqkv
// bitwise what it is without them, and each 64-row block's column sums of it bitwise the host's in the
// kernels' order (per warp of 16 rows: rows g and g + 8 first, then the eight g pairwise, ((0 + 1) + (2 +
// 3)) + ((4 + 5) + (6 + 7)); then the four warps in order); every sum written (poisoned first). Their
// total against bias_grad_accumulate's over the same dqkv: the same column sums in another order, within
// fp32 rounding. T not a multiple of 64 is refused.
TEST_F(KernelTest, AttentionBackwardSumsBiasColumnsAsItStores) {
    if (!attention_backward_sums_available(2, 128, 128, 2)) {
        GTEST_SKIP() << "skipped: the bias sums need the sm_90a attention kernels (a GPU_ARCH=90 build on compute 9.0)";
    }
    CublasLt lt;
    struct Case { int B, T, NH; };
    for (const Case s : {Case{2, 128, 2}, Case{1, 256, 3}, Case{3, 64, 1}, Case{2, 64, 12}}) {
        const int C = s.NH * 64;
        const int64_t N = int64_t(s.B) * s.T, C3 = 3 * int64_t(C), blocks = N / 64;
        SCOPED_TRACE(format("B=%d T=%d NH=%d", s.B, s.T, s.NH));
        std::printf("  B=%d T=%d NH=%d\n", s.B, s.T, s.NH);
        const auto qkv = random_bf16(size_t(N * C3), 60 + s.T, 1.5f), dout = random_bf16(size_t(N * C), 61 + s.T);
        auto d_qkv = upload_bf16(qkv), d_dout = upload_bf16(dout);
        const size_t saved_bytes = attention_saved_bytes(s.B, s.NH, s.T, 64);
        const size_t scratch_bytes = attention_scratch_bytes(s.B, s.NH, s.T, 64);
        DeviceBuffer<char> saved(saved_bytes), scratch(scratch_bytes);
        DeviceBuffer<floatX> out(size_t(N * C)), dqkv(size_t(N * C3));
        DeviceBuffer<float> sums(size_t(blocks * C3));
        attention_forward(lt, out.get(), saved.get(), saved_bytes, d_qkv.get(), s.B, s.T, C, s.NH, scratch.get(),
                          scratch_bytes, kStream);
        auto backward = [&](float* bias_sums) {
            poison(dqkv);
            attention_backward(lt, dqkv.get(), d_dout.get(), d_qkv.get(), out.get(), saved.get(), saved_bytes, s.B, s.T,
                               C, s.NH, scratch.get(), scratch_bytes, kStream, bias_sums);
        };
        backward(nullptr);
        const auto plain = bytes_of(dqkv.get(), size_t(N * C3));
        poison(sums);
        backward(sums.get());
        expect_bitwise("dqkv with the bias sums", bytes_of(dqkv.get(), size_t(N * C3)), plain);
        const std::vector<float> x = download_bf16(dqkv.get(), size_t(N * C3));
        const std::vector<float> got = download(sums.get(), sums.size());
        size_t wrong = 0;
        for (int64_t b = 0; b < blocks; b++) {
            for (int64_t c = 0; c < C3; c++) {
                float warps[4];
                for (int w = 0; w < 4; w++) {
                    const int64_t r0 = b * 64 + 16 * w;
                    float v[8];
                    for (int g = 0; g < 8; g++) v[g] = x[size_t((r0 + g) * C3 + c)] + x[size_t((r0 + g + 8) * C3 + c)];
                    warps[w] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
                }
                const float want = ((warps[0] + warps[1]) + warps[2]) + warps[3];
                wrong += std::memcmp(&want, &got[size_t(b * C3 + c)], sizeof(float)) != 0;
            }
        }
        EXPECT_EQ(wrong, 0u) << "column sums other than the host's in the kernels' order (of " << blocks * C3 << ")";
        // The bias gradient from them (bias_grad_from_partials) against the bias pass over the same dqkv
        // (bias_grad_accumulate): both into a zeroed bf16 bias, the same sums in other orders.
        DeviceBuffer<floatX> db_sums{size_t(C3)}, db_pass{size_t(C3)};
        DeviceBuffer<float> pass_scratch(matmul_backward_scratch_bytes(N, int(C3)) / sizeof(float) + 1);
        cudaCheck(cudaMemset(db_sums.get(), 0, db_sums.bytes()));
        cudaCheck(cudaMemset(db_pass.get(), 0, db_pass.bytes()));
        bias_grad_from_partials(db_sums.get(), sums.get(), blocks, int(C3), kStream);
        bias_grad_accumulate(db_pass.get(), dqkv.get(), N, int(C3), pass_scratch.get(), pass_scratch.bytes(), kStream);
        expect_close("dbias from the sums (against the bias pass)", download_bf16(db_sums.get(), size_t(C3)),
                     download_bf16(db_pass.get(), size_t(C3)), kTolBf16);
    }
    expect_error(
        [&] {
            const int B = 1, T = 96, C = 128, NH = 2;
            DeviceBuffer<floatX> x(size_t(B) * T * 3 * C);
            DeviceBuffer<char> saved(attention_saved_bytes(B, NH, T, 64)), scratch(attention_scratch_bytes(B, NH, T, 64));
            DeviceBuffer<float> sums(size_t(B) * T * 3 * C);
            attention_backward(lt, x.get(), x.get(), x.get(), x.get(), saved.get(), saved.bytes(), B, T, C, NH,
                               scratch.get(), scratch.bytes(), kStream, sums.get());
        },
        kExitUsage, {"attention_backward", "T a multiple of 64"});
    cudaCheck(cudaDeviceSynchronize());
}

// Attention groups (the cuBLASLt forward; the multiple-choice evaluation's packed rows): position t sees
// the earlier positions of group 0 and of its own group only. The reference: for each group g, the
// positions of group 0 and of g, gathered in order into a row of their own, through the CPU's plain
// causal attention; its outputs at g's positions are what the grouped row must give there (group 0's
// from a row of group 0 alone). Row 0 is laid out as the evaluation does it (a prefix, four groups of
// 9, 17, 1 and 12 positions, padding of group -1); row 1 interleaves groups 0..3 at random, which the
// rule covers too. Also: the probabilities are 0 wherever masked, and a run with groups null is the
// plain causal path.
TEST_F(KernelTest, AttentionGroupsMatchSeparateRows) {
    CublasLt lt;
    for (const std::pair<int, int>& shape : {std::pair<int, int>{128, 2}, std::pair<int, int>{96, 3}}) {
        const int B = 2, T = 61, C = shape.first, NH = shape.second, HS = C / NH;
        SCOPED_TRACE(format("C=%d NH=%d HS=%d", C, NH, HS));
        std::printf("  B=%d T=%d C=%d NH=%d HS=%d\n", B, T, C, NH, HS);
        std::vector<int> groups;
        for (int t = 0; t < 13; t++) groups.push_back(0);
        const int lengths[4] = {9, 17, 1, 12};
        for (int g = 0; g < 4; g++) {
            for (int j = 0; j < lengths[g]; j++) groups.push_back(g + 1);
        }
        while (int(groups.size()) < T) groups.push_back(-1);
        const auto mixed = random_tokens(size_t(T), 4, 70);
        groups.insert(groups.end(), mixed.begin(), mixed.end());
        const size_t n_qkv = size_t(B) * T * 3 * C, n_out = size_t(B) * T * C;
        const auto qkv = random_bf16(n_qkv, 71, 1.5f);
        std::vector<float> out_ref(n_out, NAN);
        for (int b = 0; b < B; b++) {
            std::set<int> seen(groups.begin() + b * T, groups.begin() + (b + 1) * T);
            for (int g : seen) {
                std::vector<int> at;  // the row's positions of group 0 and g, in order
                for (int t = 0; t < T; t++) {
                    const int gt = groups[size_t(b * T + t)];
                    if (gt == 0 || gt == g) at.push_back(t);
                }
                const int n = int(at.size());
                std::vector<float> sub(size_t(n) * 3 * C), sub_out(size_t(n) * C), sub_att(size_t(NH) * n * n);
                for (int i = 0; i < n; i++) {
                    std::copy_n(qkv.begin() + (int64_t(b) * T + at[size_t(i)]) * 3 * C, 3 * C, sub.begin() + int64_t(i) * 3 * C);
                }
                cpu::attention_forward<float>(sub_out.data(), sub_att.data(), sub.data(), 1, n, C, NH);
                for (int i = 0; i < n; i++) {
                    if (groups[size_t(b * T + at[size_t(i)])] != g) continue;
                    std::copy_n(sub_out.begin() + int64_t(i) * C, C, out_ref.begin() + (int64_t(b) * T + at[size_t(i)]) * C);
                }
            }
        }
        auto d_qkv = upload_bf16(qkv);
        auto d_groups = upload(groups);
        const int Tp = attention_padded_len(T);
        const size_t att_n = size_t(B) * NH * T * Tp;
        DeviceBuffer<floatX> d_out(n_out), d_att(att_n);
        DeviceBuffer<char> scratch(attention_cublaslt_scratch_bytes(B, NH, T, HS));
        poison(d_out);
        poison(d_att);
        attention_forward_cublaslt(lt, d_out.get(), d_att.get(), d_qkv.get(), B, T, C, NH, scratch.get(),
                                   scratch.bytes(), kStream, d_groups.get());
        expect_close("out with groups", download_bf16(d_out.get(), n_out), out_ref, kTolBf16);
        const auto att = download_bf16(d_att.get(), att_n);
        size_t nonzero_masked = 0, bad_rows = 0;
        for (size_t row = 0; row < size_t(B) * NH * T; row++) {
            const int t = int(row % size_t(T)), b = int(row / (size_t(NH) * T));
            const int gt = groups[size_t(b * T + t)];
            double sum = 0;
            for (int t2 = 0; t2 < Tp; t2++) {
                const float a = att[row * Tp + size_t(t2)];
                const bool visible = t2 <= t && (groups[size_t(b * T + t2)] == 0 || groups[size_t(b * T + t2)] == gt);
                if (!visible && a != 0.0f) nonzero_masked++;
                sum += a;
            }
            bad_rows += std::fabs(sum - 1.0) > 2e-2;
        }
        EXPECT_EQ(nonzero_masked, 0u) << "att must be 0 wherever a group hides a key";
        EXPECT_EQ(bad_rows, 0u) << "rows of att that do not sum to 1";
        // Without groups: the plain causal attention of the whole rows.
        std::vector<float> plain_ref(n_out), plain_att(size_t(B) * NH * T * T);
        cpu::attention_forward<float>(plain_ref.data(), plain_att.data(), qkv.data(), B, T, C, NH);
        poison(d_out);
        attention_forward_cublaslt(lt, d_out.get(), d_att.get(), d_qkv.get(), B, T, C, NH, scratch.get(),
                                   scratch.bytes(), kStream, nullptr);
        expect_close("out without groups", download_bf16(d_out.get(), n_out), plain_ref, kTolBf16);
    }
}

TEST_F(KernelTest, AttentionRejectsBadArguments) {
    CublasLt lt;
    const int B = 2, T = 37, C = 128, NH = 2, HS = C / NH;  // flash
    const size_t N = size_t(B) * T;
    const size_t saved_bytes = attention_saved_bytes(B, NH, T, HS);
    const size_t scratch_bytes = attention_scratch_bytes(B, NH, T, HS);
    DeviceBuffer<floatX> qkv(N * 3 * C), out(N * C), dqkv(N * 3 * C);
    DeviceBuffer<char> saved(saved_bytes), scratch(scratch_bytes);
    auto fwd = [&](const floatX* in, size_t sb, int c, int nh) {
        attention_forward(lt, out.get(), saved.get(), sb, in, B, T, c, nh, scratch.get(), scratch_bytes, kStream);
    };
    auto bwd = [&](size_t scb) {
        attention_backward(lt, dqkv.get(), out.get(), qkv.get(), out.get(), saved.get(), saved_bytes, B, T, C, NH,
                           scratch.get(), scb, kStream);
    };
    expect_error([&] { fwd(qkv.get(), saved_bytes - 1, C, NH); }, kExitUsage, {"attention_forward", "saved state"});
    expect_error([&] { bwd(scratch_bytes - 1); }, kExitUsage, {"attention_backward", "scratch"});
    expect_error([&] { fwd(qkv.get() + 1, saved_bytes, C, NH); }, kExitUsage, {"qkv", "16-byte aligned"});
    expect_error([&] { fwd(qkv.get(), saved_bytes, 36, 3); }, kExitUsage, {"attention_forward", "head size", "12"});
    expect_error([&] { fwd(qkv.get(), saved_bytes, 128, 3); }, kExitUsage, {"attention_forward", "multiple of NH"});
    // One grid row per (b, h): B*NH above 65535 is refused before anything is launched.
    expect_error(
        [&] {
            attention_forward(lt, out.get(), saved.get(), SIZE_MAX, qkv.get(), 70000, 1, 64, 1, scratch.get(),
                              scratch_bytes, kStream);
        },
        kExitUsage, {"flash", "_forward", "B*NH"});  // flash_forward, or flash90_forward on Hopper
    // The cuBLASLt path (HS = 32) checks its scratch.
    expect_error(
        [&] {
            attention_forward(lt, out.get(), saved.get(), saved_bytes, qkv.get(), 1, 4, 64, 2, scratch.get(),
                              attention_scratch_bytes(1, 2, 4, 32) - 1, kStream);
        },
        kExitUsage, {"attention_forward_cublaslt", "scratch"});
    cudaCheck(cudaDeviceSynchronize());
}

// ----------------------------------------------------------------------------------------------------

TEST_F(KernelTest, GeluForwardMatchesCpu) {
    for (const Shape& s : kShapes) {
        SCOPED_TRACE(s.name());
        std::printf("  %s\n", s.name().c_str());
        const size_t n = size_t(s.N()) * 4 * s.C;
        const auto inp = random_bf16(n, 60, 2.0f);
        std::vector<float> out_ref(n);
        cpu::gelu_forward<float>(out_ref.data(), inp.data(), int64_t(n));

        auto d_inp = upload_bf16(inp);
        DeviceBuffer<floatX> d_out(n);
        poison(d_out);
        gelu_forward(d_out.get(), d_inp.get(), int64_t(n), kStream);
        expect_close("gelu out", download_bf16(d_out.get(), n), out_ref, kTolBf16);
    }
}

// The recompute kernel rounds GPT-2's GELU to bf16 as the exact function would, for all but the few
// inputs where fp32 cannot: in the negative tail (x below about -2) 1 + tanh(u) cancels, so the fp32
// formula's few-ulp error becomes up to 1e-5 relative and may move the bf16 rounding (a CPU emulation of
// the fp32 formula misses 0.008% of N(0, 1) inputs). A tolerance on the values cannot see a mistyped
// constant (0.0447 for 0.044715 moves outputs by ~1e-5 relative, a twentieth of a bf16 step); the count of
// wrongly rounded outputs can (0.8% of the same inputs). Bound: 0.1%.
TEST_F(KernelTest, GeluForwardRoundsLikeTheExactFunction) {
    constexpr double kMaxMisrounded = 1e-3;
    const size_t n = size_t(1) << 22;
    const auto inp = random_bf16(n, 61, 1.0f);
    std::vector<float> exact(n);
    for (size_t i = 0; i < n; i++) {
        const double x = inp[i];
        const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
        exact[i] = bf16_round(float(0.5 * x * (1.0 + std::tanh(u))));
    }
    auto d_inp = upload_bf16(inp);
    DeviceBuffer<floatX> d_out(n);
    poison(d_out);
    gelu_forward(d_out.get(), d_inp.get(), int64_t(n), kStream);
    const std::vector<float> got = download_bf16(d_out.get(), n);
    size_t misrounded = 0, worst = 0;
    for (size_t i = 0; i < n; i++) {
        ASSERT_TRUE(std::isfinite(got[i])) << "element " << i;
        if (got[i] != exact[i]) {
            misrounded++;
            if (misrounded == 1 || std::fabs(inp[i]) > std::fabs(inp[worst])) worst = i;
        }
    }
    const double fraction = double(misrounded) / double(n);
    std::printf("  gelu: %zu of %zu outputs rounded otherwise than the exact GELU (%.4f%%)%s\n", misrounded, n,
                100.0 * fraction,
                misrounded ? format(", e.g. x = %g: %g, exact %g", inp[worst], got[worst], exact[worst]).c_str() : "");
    EXPECT_LE(fraction, kMaxMisrounded);
}

// ----------------------------------------------------------------------------------------------------

TEST_F(KernelTest, FusedClassifierMatchesCpuAndIsDeterministic) {
    std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
    shapes.push_back({2, 64, 768, 12, kGPT2VocabSize, padded_vocab(kGPT2VocabSize)});
    for (const Shape& s : shapes) {
        SCOPED_TRACE(s.name());
        std::printf("  %s\n", s.name().c_str());
        const int64_t N = s.N();
        const size_t n = size_t(N) * s.Vp;
        // Padded columns hold garbage too: the kernel must ignore them for the loss and zero their gradient.
        const auto logits = random_bf16(n, 70, 3.0f);
        const auto targets = random_tokens(size_t(N), s.V, 71);
        const float dloss = 1.0f / float(N);
        std::vector<float> probs(n), losses_ref(static_cast<size_t>(N)), dlogits_ref(n, 0.0f);
        cpu::crossentropy_forward<float>(probs.data(), losses_ref.data(), logits.data(), targets.data(), N, s.V, s.Vp);
        cpu::crossentropy_backward<float>(dlogits_ref.data(), probs.data(), targets.data(), dloss, N, s.V, s.Vp);
        double mean_ref = 0;
        for (float l : losses_ref) mean_ref += l;
        mean_ref /= double(N);

        auto d_targets = upload(targets);
        DeviceBuffer<float> d_losses(static_cast<size_t>(N)), d_mean(1);
        const auto logit_bits = [&] {
            auto d = upload_bf16(logits);
            return bytes_of(d.get(), n);
        }();

        // Evaluation: losses only, logits untouched.
        auto d_eval = upload_bf16(logits);
        poison(d_losses);
        fused_classifier(d_eval.get(), d_losses.get(), d_targets.get(), dloss, N, s.V, s.Vp, false, kStream);
        const auto eval_losses = bytes_of(d_losses.get(), size_t(N));
        expect_bitwise("logits unchanged without dlogits", bytes_of(d_eval.get(), n), logit_bits);

        std::vector<unsigned char> first_dlogits, first_losses, first_mean;
        for (int run = 0; run < 2; run++) {
            auto d_logits = upload_bf16(logits);
            poison(d_losses);
            poison(d_mean);
            fused_classifier(d_logits.get(), d_losses.get(), d_targets.get(), dloss, N, s.V, s.Vp, true, kStream);
            mean_loss(d_mean.get(), d_losses.get(), N, kStream);
            if (run == 0) {
                const auto dlogits = download_bf16(d_logits.get(), n);
                expect_close("losses (fp32)", download(d_losses.get(), size_t(N)), losses_ref, kTolFp32);
                expect_close("dlogits", dlogits, dlogits_ref, kTolBf16);
                size_t padded_nonzero = 0;
                for (int64_t row = 0; row < N; row++) {
                    for (int v = s.V; v < s.Vp; v++) padded_nonzero += dlogits[size_t(row) * s.Vp + size_t(v)] != 0.0f;
                }
                EXPECT_EQ(padded_nonzero, 0u) << "padded columns of dlogits must be 0";
                const float mean = download(d_mean.get(), 1)[0];
                std::printf("    mean loss %.6f, reference %.6f\n", double(mean), mean_ref);
                EXPECT_LE(std::fabs(double(mean) - mean_ref), kTolFp32 * mean_ref);
                first_dlogits = bytes_of(d_logits.get(), n);
                first_losses = bytes_of(d_losses.get(), size_t(N));
                first_mean = bytes_of(d_mean.get(), 1);
                expect_bitwise("losses with and without dlogits", first_losses, eval_losses);
            } else {
                expect_bitwise("dlogits", bytes_of(d_logits.get(), n), first_dlogits);
                expect_bitwise("losses", bytes_of(d_losses.get(), size_t(N)), first_losses);
                expect_bitwise("mean loss", bytes_of(d_mean.get(), 1), first_mean);
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------------

TEST_F(KernelTest, GlobalNormAndClipScaleMatchCpuAndAreDeterministic) {
    const int64_t sizes[] = {1, 7, 8, 1000003, int64_t(kGlobalNormBlocks) * kGlobalNormBlock * kPackX * 2 + 5};
    DeviceBuffer<float> scratch(kGlobalNormScratchBytes / sizeof(float)), d_norm(1), d_scale(1);
    for (int64_t n : sizes) {
        SCOPED_TRACE(format("n=%lld", (long long)n));
        std::printf("  n = %lld\n", (long long)n);
        const auto g = random_bf16(size_t(n), 80, 0.01f);
        double sq = 0;
        for (float x : g) sq += double(x) * x;
        const double norm_ref = std::sqrt(sq);
        auto d_g = upload_bf16(g);

        std::vector<unsigned char> first;
        for (int run = 0; run < 2; run++) {
            poison(d_norm);
            poison(d_scale);
            global_norm(d_norm.get(), d_scale.get(), d_g.get(), n, 0.5f * float(norm_ref), scratch.get(),
                        kGlobalNormScratchBytes, kStream);
            const float norm = download(d_norm.get(), 1)[0], scale = download(d_scale.get(), 1)[0];
            if (run == 0) {
                const double scale_ref = cpu::clip_scale(norm_ref, 0.5 * norm_ref);
                std::printf("    norm %.8e (reference %.8e), clip scale %.7f (reference %.7f)\n", double(norm),
                            norm_ref, double(scale), scale_ref);
                EXPECT_LE(std::fabs(norm - norm_ref), kTolFp32 * norm_ref);
                EXPECT_LE(std::fabs(scale - scale_ref), kTolFp32 * scale_ref);
                first = bytes_of(d_norm.get(), 1);
            } else {
                expect_bitwise("norm", bytes_of(d_norm.get(), 1), first);
            }
        }
        for (float max_norm : {2.0f * float(norm_ref), 0.0f}) {
            poison(d_scale);
            global_norm(nullptr, d_scale.get(), d_g.get(), n, max_norm, scratch.get(), kGlobalNormScratchBytes,
                        kStream);
            EXPECT_EQ(download(d_scale.get(), 1)[0], 1.0f) << "max_norm " << max_norm << " must not clip";
        }
    }
}

// ----------------------------------------------------------------------------------------------------

static __global__ void stochastic_round_test_kernel(floatX* out, float x, uint64_t key, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = stochastic_round_bf16(x, rng_u32(key, uint64_t(i)));
}

static __global__ void rng_test_kernel(uint32_t* out, uint64_t key, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = rng_u32(key, uint64_t(i));
}

// The two bf16 neighbours of x: toward zero (truncation) and away from zero.
void bf16_neighbours(float x, float& toward_zero, float& away) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint32_t lo = bits & 0xffff0000u, hi = lo + 0x10000u;
    std::memcpy(&toward_zero, &lo, 4);
    std::memcpy(&away, &hi, 4);
}

TEST_F(KernelTest, StochasticRoundingIsUnbiasedAndRngMatchesHost) {
    const int n = 1 << 20;
    DeviceBuffer<floatX> d_out(n);
    DeviceBuffer<uint32_t> d_rng(n);
    const uint64_t key = rng_key(1234, 5);
    rng_test_kernel<<<ceil_div(n, 256), 256>>>(d_rng.get(), key, n);
    cudaCheckLaunch();
    const auto words = download(d_rng.get(), size_t(n));
    for (int i = 0; i < n; i += 9973) ASSERT_EQ(words[size_t(i)], rng_u32(key, uint64_t(i))) << "index " << i;

    for (float x : {1.0f + 0.3f * 0x1p-7f, -3.0f - 0.85f * 0x1p-6f, 1.5f, 1e-30f * 1.37f}) {
        SCOPED_TRACE(format("x=%.9g", double(x)));
        float lo, hi;
        bf16_neighbours(x, lo, hi);
        const double expected_up = lo == x ? 0.0 : (double(x) - lo) / (double(hi) - lo);
        poison(d_out);
        stochastic_round_test_kernel<<<ceil_div(n, 256), 256>>>(d_out.get(), x, key, n);
        cudaCheckLaunch();
        const auto got = download_bf16(d_out.get(), size_t(n));
        size_t up = 0, other = 0;
        double mean = 0;
        for (float y : got) {
            if (y == hi) up++;
            else if (y != lo) other++;
            mean += y;
        }
        mean /= n;
        const double frac = double(up) / n;
        std::printf("  x = %.9g: rounded away from zero %.4f of the time (expected %.4f), mean %.9g\n", double(x), frac,
                    expected_up, mean);
        EXPECT_EQ(other, 0u) << "results other than the two neighbours";
        EXPECT_NEAR(frac, expected_up, 0.005);  // > 10 standard deviations for 2^20 samples
        EXPECT_NEAR(mean, double(x), 0.005 * std::fabs(double(hi) - double(lo)) + 1e-12 * std::fabs(double(x)));
    }
}

TEST_F(KernelTest, AdamWMatchesCpuRoundsStochasticallyAndIsReproducible) {
    const GPT2Config config = make_config(2, 48, 3, 101, 37);
    const size_t n = size_t(num_parameters(config));
    const auto tensors = param_tensors(config);
    cpu::AdamW opt;
    opt.learning_rate = 1e-2;
    opt.weight_decay = 0.1;
    AdamWSettings settings;
    settings.learning_rate = float(opt.learning_rate);
    settings.beta1 = float(opt.beta1);
    settings.beta2 = float(opt.beta2);
    settings.eps = float(opt.eps);
    settings.weight_decay = float(opt.weight_decay);
    const std::vector<float> master0 = [&] {
        std::mt19937_64 gen(90);
        std::normal_distribution<float> dist(0.0f, 0.5f);
        std::vector<float> v(n);
        for (float& x : v) x = dist(gen);
        return v;
    }();
    const int steps = 3;
    const float grad_scales[steps] = {0.7f, 0.35f, 1.0f};  // the last step passes no scale pointer (= 1)
    std::vector<std::vector<float>> grads;
    for (int k = 0; k < steps; k++) grads.push_back(random_bf16(n, 91 + uint64_t(k), 0.05f));

    cpu::GPT2<float> model(config, master0);
    std::vector<std::vector<float>> master_ref;
    for (int k = 0; k < steps; k++) {
        model.grads = grads[size_t(k)];
        model.update(opt, k + 1, grad_scales[k]);
        master_ref.push_back(model.params);
    }

    struct Run {
        std::vector<unsigned char> params, master, m, v;
    };
    auto run_gpu = [&](uint64_t seed, bool check) {
        auto d_master = upload(master0);
        DeviceBuffer<floatX> d_params(n);
        DeviceBuffer<float> d_m(n), d_v(n), d_scale(1);
        cudaCheck(cudaMemset(d_m.get(), 0, d_m.bytes()));
        cudaCheck(cudaMemset(d_v.get(), 0, d_v.bytes()));
        poison(d_params);
        convert_to_bf16(d_params.get(), d_master.get(), int64_t(n), kStream);
        if (check) {
            const auto p = download_bf16(d_params.get(), n);
            size_t wrong = 0;
            for (size_t i = 0; i < n; i++) wrong += p[i] != bf16_round(master0[i]);
            EXPECT_EQ(wrong, 0u) << "convert_to_bf16 is not round-to-nearest";
        }
        const AdamWTensors table = adamw_tensors(param_tensors(config));
        for (int k = 0; k < steps; k++) {
            auto d_grads = upload_bf16(grads[size_t(k)]);
            const bool scaled = grad_scales[k] != 1.0f;
            if (scaled) cudaCheck(cudaMemcpy(d_scale.get(), &grad_scales[k], sizeof(float), cudaMemcpyHostToDevice));
            adamw_update(d_params.get(), d_master.get(), d_m.get(), d_v.get(), d_grads.get(), table, settings, k + 1,
                         seed, scaled ? d_scale.get() : nullptr, kStream);
            if (!check) continue;
            SCOPED_TRACE(format("step %d", k + 1));
            std::printf("  step %d (grad scale %.2f)\n", k + 1, double(grad_scales[k]));
            const auto master = download(d_master.get(), n);
            const std::vector<float>& before = k == 0 ? master0 : master_ref[size_t(k - 1)];
            for (int i = 0; i < kNumParamTensors; i++) {
                const ParamTensorInfo& t = tensors[size_t(i)];
                const auto slice = [&](const std::vector<float>& v) {
                    return std::vector<float>(v.begin() + t.offset, v.begin() + t.offset + t.numel);
                };
                const auto base = slice(before);
                // The update is ~lr per step while fp32 rounding of the weights is ~1e-7 of them: 1e-4 of
                // the update leaves room for that and catches a missed or misapplied weight decay (1e-3).
                expect_close(format("master %s (relative to the update)", t.name), slice(master),
                             slice(master_ref[size_t(k)]), 1e-4, &base);
            }
            const auto params = download_bf16(d_params.get(), n);
            size_t not_neighbour = 0, up = 0, inexact = 0;
            for (size_t i = 0; i < n; i++) {
                float lo, hi;
                bf16_neighbours(master[i], lo, hi);
                if (lo == master[i]) {
                    not_neighbour += params[i] != master[i];
                    continue;
                }
                inexact++;
                if (params[i] == hi) up++;
                else if (params[i] != lo) not_neighbour++;
            }
            EXPECT_EQ(not_neighbour, 0u) << "bf16 parameters that are not a neighbour of the master weight";
            // Dropped bits are close to uniform, so about half the values round away from zero.
            const double frac = double(up) / double(inexact);
            std::printf("    %.3f of the bf16 parameters rounded away from zero\n", frac);
            EXPECT_GT(frac, 0.4);
            EXPECT_LT(frac, 0.6);
        }
        if (check) {
            expect_close("adam m", download(d_m.get(), n), model.adam_m, kTolFp32);
            expect_close("adam v", download(d_v.get(), n), model.adam_v, kTolFp32);
        }
        return Run{bytes_of(d_params.get(), n), bytes_of(d_master.get(), n), bytes_of(d_m.get(), n),
                   bytes_of(d_v.get(), n)};
    };

    const Run a = run_gpu(7, true), b = run_gpu(7, false), c = run_gpu(8, false);
    expect_bitwise("params, same seed", a.params, b.params);
    expect_bitwise("master, same seed", a.master, b.master);
    expect_bitwise("m, same seed", a.m, b.m);
    expect_bitwise("v, same seed", a.v, b.v);
    expect_bitwise("master, different seed (the seed only affects rounding)", a.master, c.master);
    size_t differ = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t x, y;
        std::memcpy(&x, &a.params[2 * i], 2);
        std::memcpy(&y, &c.params[2 * i], 2);
        differ += x != y;
    }
    std::printf("  different seeds: %.3f of the bf16 parameters differ\n", double(differ) / double(n));
    EXPECT_GT(double(differ), 0.25 * double(n)) << "a different seed should change many roundings";
}

}  // namespace

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
