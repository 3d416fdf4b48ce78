/*
The GPU model (llmc/gpt2.cuh), whole, against the fp32 CPU reference (cpu/gpt2_cpu.h). The trainer's
flag and plan checks, which need no GPU, are tested by test/test_trainer_flags.sh.

Both models start from identical weights: GPT-2's initialisation with LayerNorm weights and all biases
perturbed (so that their gradients are not trivially structured), rounded to bf16 on the host, so the
GPU's bf16 parameters and fp32 master weights and the CPU's fp32 parameters hold the same numbers.
Inputs and targets are random tokens. Compared, as ||gpu - cpu|| / ||cpu|| unless stated:
  - logits (the first V columns; the padded ones must be exactly 0 since the padded rows of wte are 0):
    tolerance 5e-2. The GPU rounds every activation to bf16 (2^-9 = 2e-3 relative each time) and the
    residual stream carries those roundings through all layers: the CPU reference with the GPU's bf16
    roundings inserted after every layer gave 5e-3 at d2 and 9e-3 at d12 (B=4, T=64), for the logits and
    for every gradient tensor alike, so 5e-2 leaves a margin of 5x or more; a wrong kernel, layout or
    offset gives errors of order 1.
  - the mean loss: |gpu - cpu| / cpu <= 1e-2 (a loss near ln(V) = 10.8 averages the per-row errors away;
    expected ~1e-3).
  - the gradient of every one of the 16 parameter tensors: tolerance 5e-2 each, for the same reason as
    the logits (the gradients themselves are bf16 and accumulate in bf16; dwte gets the classifier's and
    the embedding's parts). Each tensor's error is printed, so a run shows the margins.
  - 10 AdamW steps (lr 3e-3, weight decay 0.1, clip 1.0, the same batch every step so the loss must
    fall): each step's loss within 2e-2 relative and each gradient norm within 5e-2 of the CPU's, and the
    loss must fall by at least 5% over the steps (so the update really does something). The GPU rounds
    its parameters stochastically from the fp32 master weights, so the two drift apart slowly.
  - gradient accumulation: two micro-batches of B/2 with dloss 1/(B*T) give the gradient of the whole
    batch (CPU reference on B) within 5e-2.
  - a forward smaller than the allocation (B=1, T=10, as sampling does) matches the CPU.
  - determinism: two fresh models, same weights and batches, 5 training steps: losses, norms and the
    final bf16 parameters bitwise identical.
  - backward's weight gradients on a second stream (levels 1 and 2): the same losses, norms, gradients and
    final parameters as one stream, bit for bit, over 3 steps of 2 micro-batches.
  - the classifier's exp forward (Hopper, sm_90a, at the shapes it takes): the mean loss (1e-2), each
    row's loss against the CPU's (1e-2) and against the evaluation forward's from bf16 logits (max
    |difference| 1e-2), its output Y against e^(L - L_t) from the evaluation's logits L (1e-2; the target
    column, -(the row's other values' sum), 1e-2; the padded columns exactly 0), every gradient (5e-2),
    and a second step's loss and gradients bit for bit.
  - forward_scored (the classifier at some positions only) against forward() at the same positions, for
    a full batch and a packed one (more, shorter rows than allocated), at scattered positions in every
    row, in no particular order, including the first and the last of the batch: each loss within
    2e-3 + 2^-7 |target logit|, and the mean equal to the mean of the M losses (1e-6 relative: both sum
    in double and round once to float). The transformer's kernels are the same, so the final LayerNorm
    is bitwise the same and the gather copies it exactly; only the lm_head matmul differs: cuBLASLt may
    pick another algorithm for M rows than for B*T, whose fp32 sums over C differ in their last bits and
    may round a logit to the other bf16 neighbour. That moves a loss by at most one bf16 ulp of the
    target logit (at most 2^-7 of it; the other logits enter through the softmax, weighted by their
    probabilities, which are ~1/V here), so 2e-3 covers the rest with a wide margin on losses of ~7-11,
    while a wrong row, target or offset gives errors of order 1. forward_scored refuses M = 0, M above
    the allocated B x T (it takes more than the batch's B*T: repeats) and a batch the model was not allocated for (a position outside the batch is
    refused where positions are built, McPackedBatcher: test_mc_eval.cpp).
Shapes: d2 (C=128, NH=2) and a small explicit model (L=3, C=96, NH=3, HS=32, V=1000 padded to 1024,
maxT=80) at B=4, T=64; d6 and d12 at B=4, T=64; d2 at B=4, T=1024. d6 and d12 at T=1024 take minutes on
the CPU side and run only with LLMC_LONG_TESTS=1 (they skip with a message otherwise). The GPT-2 shapes
(HS=64) run flash attention, the C=96 model the cuBLASLt attention path; the AdamW, smaller-forward and
determinism tests run both d2 and the C=96 model.
*/
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cpu/gpt2_cpu.h"
#include "llmc/gpt2.cuh"
#include "llmc/model_file.h"
#include "test/expect_error.h"
#include "test/gpu_test.h"
#include "test/test_util.h"

using namespace llmc;
using llmc::test::random_tokens;

namespace {

constexpr double kTolLogits = 5e-2;
constexpr double kTolLoss = 1e-2;
constexpr double kTolGrad = 5e-2;
constexpr double kTolStepLoss = 2e-2;
constexpr double kTolNorm = 5e-2;

float bf16_round(float x) { return bf16_to_float(float_to_bf16(x)); }

// GPT-2's initialisation, LayerNorm weights 1 + N(0, 0.1) and biases N(0, 0.02), all rounded to bf16.
std::vector<float> test_parameters(const GPT2Config& c, uint64_t seed) {
    std::vector<float> p(size_t(num_parameters(c)));
    init_parameters(c, seed, p.data());
    auto tensors = param_tensors(c);
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo& t = tensors[size_t(i)];
        if (t.decayed) continue;
        const bool ln_weight = i == kLn1w || i == kLn2w || i == kLnfw;
        for (int64_t j = 0; j < t.numel; j++) {
            const double n = counter_normal(seed + 1, uint64_t(i), uint64_t(j));
            p[size_t(t.offset + j)] = float(ln_weight ? 1.0 + 0.1 * n : 0.02 * n);
        }
    }
    for (float& x : p) x = bf16_round(x);
    return p;
}

template <class T>
DeviceBuffer<T> upload(const std::vector<T>& v) {
    DeviceBuffer<T> d(v.size());
    cudaCheck(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    cudaCheck(cudaDeviceSynchronize());
    return d;
}

template <class T>
std::vector<T> download(const T* p, size_t n, cudaStream_t stream) {
    cudaCheck(cudaStreamSynchronize(stream));
    std::vector<T> v(n);
    cudaCheck(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

std::vector<float> download_bf16(const floatX* p, size_t n, cudaStream_t stream) {
    std::vector<floatX> h = download(p, n, stream);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __bfloat162float(h[i]);
    return v;
}

float download_scalar(const float* p, cudaStream_t stream) { return download(p, 1, stream)[0]; }

// ||got - ref|| / ||ref|| over matching elements, after checking every value is finite; prints it.
double expect_close(const std::string& what, const float* got, const float* ref, size_t n, double tol) {
    size_t nonfinite = 0;
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!std::isfinite(got[i])) {
            nonfinite++;
            continue;
        }
        const double d = double(got[i]) - double(ref[i]);
        num += d * d;
        den += double(ref[i]) * double(ref[i]);
    }
    const double rel = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
    std::printf("    %-28s rel err %.2e (tol %.0e)\n", what.c_str(), rel, tol);
    EXPECT_EQ(nonfinite, 0u) << what << ": " << nonfinite << " of " << n << " values are not finite";
    EXPECT_GT(den, 0.0) << what << ": the reference is zero";
    EXPECT_LE(rel, tol) << what;
    return rel;
}

// The exp forward's output Y (what backward reads in place of dlogits, up to a row scale) against the
// evaluation forward's logits L from the same lnf: Y[r][j] = e^(L_j - L_t) for the other columns j < V (t
// the row's target), Y[r][t] = -(their sum), and 0 past V. Checked element by element because the loss and
// the gradients cannot see every slip here: at initialisation each row's softmax is close to uniform, so
// a tile's rows computed from another row's lnf leave the losses within 1e-4 and the gradients within
// their tolerance, while Y moves by 9e-2 (2e-3 unmutated, at d2 B=4 T=64).
void check_exp_output(const std::vector<float>& y, const std::vector<float>& logits, const std::vector<int>& targets,
                      size_t N, int V, int Vp) {
    double num = 0, den = 0, num_t = 0, den_t = 0;
    size_t nonfinite = 0, padded_nonzero = 0;
    for (size_t r = 0; r < N; r++) {
        const int t = targets[r];
        const double lt = logits[r * Vp + t];
        double tail = 0;
        for (int j = 0; j < V; j++) {
            if (j == t) continue;
            const double want = std::exp(double(logits[r * Vp + j]) - lt), got = y[r * Vp + j];
            tail += want;
            if (!std::isfinite(got)) {
                nonfinite++;
                continue;
            }
            num += (got - want) * (got - want);
            den += want * want;
        }
        const double got_t = y[r * Vp + t];
        nonfinite += !std::isfinite(got_t);
        if (std::isfinite(got_t)) num_t += (got_t + tail) * (got_t + tail);
        den_t += tail * tail;
        for (int j = V; j < Vp; j++) padded_nonzero += y[r * Vp + j] != 0.0f;
    }
    const double rel = std::sqrt(num / den), rel_t = std::sqrt(num_t / den_t);
    std::printf("    exp forward's Y against e^(L - L_t) from the evaluation's logits: rel err %.2e (tol 1e-2), "
                "target column %.2e (tol 1e-2)\n", rel, rel_t);
    EXPECT_EQ(nonfinite, 0u) << "the exp forward's Y has values that are not finite";
    EXPECT_LE(rel, 1e-2) << "the exp forward's Y must be e^(L - L_t) in the columns other than the target";
    EXPECT_LE(rel_t, 1e-2) << "the exp forward's Y must hold -(the row's other values' sum) at the target";
    EXPECT_EQ(padded_nonzero, 0u) << "the exp forward's Y must be 0 in the padded columns";
}

struct Case {
    std::string name;
    GPT2Config config;
    int B, T;
    bool long_running;
};

std::vector<Case> cases() {
    return {
        {"d2 B=4 T=64", config_from_descriptor("d2"), 4, 64, false},
        {"L3 C96 NH3 V1000 B=4 T=64", make_config(3, 96, 3, 1000, 80), 4, 64, false},
        {"d6 B=4 T=64", config_from_descriptor("d6"), 4, 64, false},
        {"d12 B=4 T=64", config_from_descriptor("d12"), 4, 64, false},
        {"d2 B=4 T=1024", config_from_descriptor("d2"), 4, 1024, false},
        {"d6 B=4 T=1024", config_from_descriptor("d6"), 4, 1024, true},
        {"d12 B=4 T=1024", config_from_descriptor("d12"), 4, 1024, true},
    };
}

bool long_tests_enabled() {
    const char* v = std::getenv("LLMC_LONG_TESTS");
    return v != nullptr && std::string(v) == "1";
}

class GPT2GpuTest : public GpuTest, public ::testing::WithParamInterface<Case> {};

// Logits and loss of an evaluation forward, then the gradients of a training forward and backward. With
// exp_classifier, the training forward runs the classifier's exp forward (llmc/classifier_sm90.cuh), whose
// loss comes from fp32 logits: it is checked against the reference instead of against the evaluation's.
void check_forward_backward(const Case& k, bool exp_classifier = false) {
    const GPT2Config& c = k.config;
    const int B = k.B, T = k.T, V = c.vocab_size, Vp = c.padded_vocab_size;
    const size_t N = size_t(B) * T;
    std::printf("  %s: %s\n", k.name.c_str(), describe(c).c_str());
    const std::vector<float> params = test_parameters(c, 11);
    const std::vector<int> inputs = random_tokens<int>(N, V, 12), targets = random_tokens<int>(N, V, 13);

    cpu::GPT2<float> ref(c, params);
    const double ref_loss = ref.forward(inputs.data(), targets.data(), B, T);
    ref.zero_grad();
    ref.backward();

    Stream stream;
    GPT2 gpu(c, B, T, stream);
    gpu.set_classifier_exp(exp_classifier);
    ASSERT_EQ(gpu.classifier_exp_applies(int64_t(N)), exp_classifier) << "the exp forward must run exactly when asked";
    gpu.set_parameters(params);
    auto d_in = upload(inputs), d_tg = upload(targets);

    gpu.forward(d_in.get(), d_tg.get(), B, T);
    const std::vector<float> logits = download_bf16(gpu.logits(), N * Vp, stream);
    const float eval_loss = download_scalar(gpu.mean_loss(), stream);
    const std::vector<float> eval_losses = download(gpu.losses(), N, stream);
    std::vector<float> got(N * V), want(N * V);
    size_t padded_nonzero = 0;
    for (size_t r = 0; r < N; r++) {
        for (int v = 0; v < Vp; v++) {
            if (v < V) {
                got[r * V + v] = logits[r * Vp + v];
                want[r * V + v] = ref.activations().logits[r * Vp + v];
            } else {
                padded_nonzero += logits[r * Vp + v] != 0.0f;
            }
        }
    }
    expect_close("logits", got.data(), want.data(), got.size(), kTolLogits);
    EXPECT_EQ(padded_nonzero, 0u) << "padded logits must be 0";
    std::printf("    loss %.6f, reference %.6f\n", double(eval_loss), ref_loss);
    EXPECT_LE(std::fabs(double(eval_loss) - ref_loss), kTolLoss * ref_loss);

    gpu.zero_grad();
    gpu.forward(d_in.get(), d_tg.get(), B, T, nullptr, 1.0f / float(N));
    if (exp_classifier) check_exp_output(download_bf16(gpu.logits(), N * Vp, stream), logits, targets, N, V, Vp);
    gpu.backward(d_in.get(), B, T);
    const float train_loss = download_scalar(gpu.mean_loss(), stream);
    if (exp_classifier) {
        std::printf("    training loss %.6f (exp forward), reference %.6f\n", double(train_loss), ref_loss);
        EXPECT_LE(std::fabs(double(train_loss) - ref_loss), kTolLoss * ref_loss);
        EXPECT_NE(train_loss, eval_loss) << "the exp forward's loss (fp32 logits) should not be the bf16 logits' bit for bit";
        // Row by row: against the reference, and against the evaluation's losses from the same lnf through bf16
        // logits. The two differ by the logits' bf16 rounding, under 1e-3 at these shapes; a slip in the
        // exp's offset or in the tiles' sums moves a row by about as much as its target logit (0.2-0.5 here),
        // which the mean above can hide.
        const std::vector<float> train_losses = download(gpu.losses(), N, stream);
        expect_close("losses (exp forward)", train_losses.data(), ref.activations().losses.data(), N, kTolLoss);
        double worst = 0;
        for (size_t r = 0; r < N; r++) worst = std::max(worst, std::fabs(double(train_losses[r]) - eval_losses[r]));
        std::printf("    exp forward's losses against the evaluation's: max |difference| %.2e (tol 1e-2)\n", worst);
        EXPECT_LE(worst, 1e-2) << "the exp forward's per-row losses must match the evaluation forward's";
    } else {
        EXPECT_EQ(train_loss, eval_loss) << "the training forward must compute the same loss";
    }
    const std::vector<float> grads = download_bf16(gpu.grads(), size_t(gpu.num_parameters()), stream);
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo& t = gpu.tensor(i);
        expect_close(std::string("grad ") + t.name, grads.data() + t.offset, ref.grads.data() + t.offset,
                     size_t(t.numel), kTolGrad);
    }
    if (exp_classifier) {  // no atomics anywhere: a second step gives the same bits
        gpu.zero_grad();
        gpu.forward(d_in.get(), d_tg.get(), B, T, nullptr, 1.0f / float(N));
        gpu.backward(d_in.get(), B, T);
        EXPECT_EQ(download_scalar(gpu.mean_loss(), stream), train_loss) << "the exp forward's loss must repeat";
        const std::vector<float> again = download_bf16(gpu.grads(), size_t(gpu.num_parameters()), stream);
        EXPECT_TRUE(std::memcmp(again.data(), grads.data(), grads.size() * sizeof(float)) == 0)
            << "the exp forward's gradients must repeat bit for bit";
    }
}

TEST_P(GPT2GpuTest, ForwardAndBackwardMatchCpu) {
    const Case& k = GetParam();
    if (k.long_running && !long_tests_enabled()) GTEST_SKIP() << "skipped: set LLMC_LONG_TESTS=1 to run " << k.name;
    check_forward_backward(k);
}

// The bf16 model with the classifier's exp forward on Hopper (sm_90a), at the shapes it takes.
TEST_P(GPT2GpuTest, ExpClassifierForwardAndBackwardMatchCpu) {
    const Case& k = GetParam();
    if (k.long_running && !long_tests_enabled()) GTEST_SKIP() << "skipped: set LLMC_LONG_TESTS=1 to run " << k.name;
    if (!classifier90_available()) GTEST_SKIP() << "skipped: the exp classifier needs a Hopper GPU and an sm_90a build";
    if (!classifier90_applies(int64_t(k.B) * k.T, k.config.channels, k.config.padded_vocab_size)) {
        GTEST_SKIP() << "skipped: " << k.name << " is not a shape the exp classifier takes (C a multiple of 64)";
    }
    check_forward_backward(k, /*exp_classifier=*/true);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GPT2GpuTest, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                             std::string n;
                             for (char ch : info.param.name) n += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                             return n;
                         });

class GPT2TrainingTest : public GpuTest {};

TEST_F(GPT2TrainingTest, TenAdamWStepsMatchCpu) {
    for (const Case& k : {cases()[0], cases()[1]}) {
        SCOPED_TRACE(k.name);
        std::printf("  %s\n", k.name.c_str());
        const GPT2Config& c = k.config;
        const int B = k.B, T = k.T;
        const size_t N = size_t(B) * T;
        const std::vector<float> params = test_parameters(c, 21);
        const std::vector<int> inputs = random_tokens<int>(N, c.vocab_size, 22);
        const std::vector<int> targets = random_tokens<int>(N, c.vocab_size, 23);
        const float lr = 3e-3f, clip = 1.0f, wd = 0.1f;

        cpu::GPT2<float> ref(c, params);
        cpu::AdamW opt;
        opt.learning_rate = lr;
        opt.weight_decay = wd;

        Stream stream;
        GPT2 gpu(c, B, T, stream);
        gpu.set_parameters(params);
        auto d_in = upload(inputs), d_tg = upload(targets);
        AdamWSettings settings;
        settings.learning_rate = lr;
        settings.weight_decay = wd;

        // Two references. `ref` trains its own fp32 weights: its losses show the two trajectories stay together.
        // `here` is the CPU model at the GPU's current (bf16, stochastically rounded) weights: its loss and gradient
        // norm check this step's arithmetic, which a comparison with the drifting fp32 trajectory cannot do once
        // a loss spike amplifies the drift (seen on the H200: the norm at step 8 was 3.48 against 4.12 on the fp32
        // trajectory, while the losses agreed to 0.4%).
        double first = 0, last = 0;
        for (int step = 1; step <= 10; step++) {
            const double ref_loss = ref.forward(inputs.data(), targets.data(), B, T);
            ref.zero_grad();
            ref.backward();
            const double ref_norm = ref.grad_norm();
            ref.update(opt, step, cpu::clip_scale(ref_norm, clip));

            cpu::GPT2<float> here(c, download_bf16(gpu.params(), size_t(gpu.num_parameters()), stream));
            const double here_loss = here.forward(inputs.data(), targets.data(), B, T);
            here.zero_grad();
            here.backward();
            const double here_norm = here.grad_norm();

            gpu.zero_grad();
            gpu.forward(d_in.get(), d_tg.get(), B, T, nullptr, 1.0f / float(N));
            gpu.backward(d_in.get(), B, T);
            gpu.update(settings, clip, step, 7);
            const double loss = download_scalar(gpu.mean_loss(), stream);
            const double norm = download_scalar(gpu.grad_norm(), stream);
            std::printf("    step %2d  loss %.6f (cpu at these weights %.6f, fp32 trajectory %.6f)  norm %.5f (cpu at these "
                        "weights %.5f, fp32 trajectory %.5f)\n",
                        step, loss, here_loss, ref_loss, norm, here_norm, ref_norm);
            EXPECT_LE(std::fabs(loss - ref_loss), kTolStepLoss * ref_loss) << "step " << step << ": trajectories diverged";
            EXPECT_LE(std::fabs(loss - here_loss), kTolStepLoss * here_loss) << "step " << step;
            EXPECT_LE(std::fabs(norm - here_norm), kTolNorm * here_norm) << "step " << step;
            if (step == 1) first = ref_loss;
            last = loss;
        }
        EXPECT_LT(last, 0.95 * first) << "ten steps on one batch must lower the loss";
    }
}

TEST_F(GPT2TrainingTest, GradientAccumulationMatchesOneBigBatch) {
    const GPT2Config c = config_from_descriptor("d2");
    const int B = 4, T = 64, half = B / 2;
    const size_t N = size_t(B) * T, Nh = size_t(half) * T;
    const std::vector<float> params = test_parameters(c, 31);
    const std::vector<int> inputs = random_tokens<int>(N, c.vocab_size, 32);
    const std::vector<int> targets = random_tokens<int>(N, c.vocab_size, 33);

    cpu::GPT2<float> ref(c, params);
    ref.forward(inputs.data(), targets.data(), B, T);
    ref.zero_grad();
    ref.backward();

    Stream stream;
    GPT2 gpu(c, half, T, stream);
    gpu.set_parameters(params);
    auto d_in = upload(inputs), d_tg = upload(targets);
    gpu.zero_grad();
    for (int micro = 0; micro < 2; micro++) {
        gpu.forward(d_in.get() + micro * Nh, d_tg.get() + micro * Nh, half, T, nullptr, 1.0f / float(N));
        gpu.backward(d_in.get() + micro * Nh, half, T);
    }
    const std::vector<float> grads = download_bf16(gpu.grads(), size_t(gpu.num_parameters()), stream);
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo& t = gpu.tensor(i);
        expect_close(std::string("accumulated grad ") + t.name, grads.data() + t.offset, ref.grads.data() + t.offset,
                     size_t(t.numel), kTolGrad);
    }
}

// d2 (HS = 64: flash attention) and the C96 model (HS = 32: the cuBLASLt attention path).
TEST_F(GPT2TrainingTest, SmallerForwardThanAllocatedMatchesCpu) {
    for (const Case& k : {cases()[0], cases()[1]}) {
        SCOPED_TRACE(k.name);
        std::printf("  %s\n", k.name.c_str());
        const GPT2Config& c = k.config;
        const int B = 1, T = 10;
        const std::vector<float> params = test_parameters(c, 41);
        const std::vector<int> inputs = random_tokens<int>(size_t(B) * T, c.vocab_size, 42);
        cpu::GPT2<float> ref(c, params);
        ref.forward(inputs.data(), nullptr, B, T);

        Stream stream;
        GPT2 gpu(c, 4, 64, stream);
        gpu.set_parameters(params);
        auto d_in = upload(inputs);
        gpu.forward(d_in.get(), nullptr, B, T);
        const std::vector<float> logits = download_bf16(gpu.logits(), size_t(T) * c.padded_vocab_size, stream);
        expect_close("logits B=1 T=10", logits.data(), ref.activations().logits.data(), logits.size(), kTolLogits);
    }
}

// Both attention paths, as above; the file's comment says why the tolerance.
TEST_F(GPT2TrainingTest, ScoredForwardMatchesForwardAtThosePositions) {
    constexpr double kTolScoredLoss = 2e-3;
    for (const Case& k : {cases()[0], cases()[1]}) {
        SCOPED_TRACE(k.name);
        std::printf("  %s\n", k.name.c_str());
        const GPT2Config& c = k.config;
        const int V = c.vocab_size, Vp = c.padded_vocab_size;
        const std::vector<float> params = test_parameters(c, 61);
        Stream stream;
        GPT2 gpu(c, 4, 64, stream);
        gpu.set_parameters(params);
        // The allocated batch, and a packed one of more, shorter rows (as the multiple-choice evaluation runs).
        for (const std::pair<int, int>& shape : {std::pair<int, int>{4, 64}, std::pair<int, int>{6, 32}}) {
            const int B = shape.first, T = shape.second, N = B * T;
            SCOPED_TRACE(format("B=%d T=%d", B, T));
            const std::vector<int> inputs = random_tokens<int>(size_t(N), V, 62 + uint64_t(B));
            const std::vector<int> targets = random_tokens<int>(size_t(N), V, 63 + uint64_t(B));
            auto d_in = upload(inputs), d_tg = upload(targets);
            gpu.forward(d_in.get(), d_tg.get(), B, T);
            const std::vector<float> full = download(gpu.losses(), size_t(N), stream);
            const std::vector<float> logits = download_bf16(gpu.logits(), size_t(N) * Vp, stream);

            // The last position first, the first position, both ends of every row, and a scattered few.
            std::vector<int> pos = {N - 1, 0};
            for (int r = 0; r < B; r++) {
                pos.push_back(r * T + T - 1);
                pos.push_back(r * T + (r == 0 ? 1 : 0));
                pos.push_back(r * T + (5 * r + 3) % T);
            }
            SplitMix64 rng(64);
            for (int i = 0; i < 12; i++) pos.push_back(int(rng.below(uint64_t(N))));
            pos.push_back(pos[5]);  // a repeat is allowed
            const int64_t M = int64_t(pos.size());
            std::vector<int> tgt;
            for (int p : pos) tgt.push_back(targets[size_t(p)]);
            auto d_pos = upload(pos), d_tgt = upload(tgt);
            gpu.forward_scored(d_in.get(), B, T, d_pos.get(), d_tgt.get(), M);
            const std::vector<float> scored = download(gpu.losses(), size_t(M), stream);
            const float mean = download_scalar(gpu.mean_loss(), stream);

            double worst = 0, sum = 0;
            int bitwise = 0;
            for (int64_t i = 0; i < M; i++) {
                const size_t p = size_t(pos[size_t(i)]);
                const double target_logit = logits[p * size_t(Vp) + size_t(tgt[size_t(i)])];
                const double d = std::fabs(double(scored[size_t(i)]) - double(full[p]));
                worst = std::max(worst, d);
                bitwise += std::memcmp(&scored[size_t(i)], &full[p], sizeof(float)) == 0;
                EXPECT_TRUE(std::isfinite(scored[size_t(i)])) << "scored loss " << i << " at position " << p;
                EXPECT_LE(d, kTolScoredLoss + std::ldexp(std::fabs(target_logit), -7))
                    << "scored loss " << i << " at position " << p << ": " << scored[size_t(i)] << ", forward() "
                    << full[p];
                sum += double(scored[size_t(i)]);
            }
            const double want_mean = sum / double(M);
            std::printf("    B=%d T=%d: %lld positions, %d bitwise equal to forward()'s, worst difference %.3g; "
                        "mean %.7f (of the M losses %.7f)\n", B, T, (long long)M, bitwise, worst, double(mean),
                        want_mean);
            EXPECT_NEAR(double(mean), want_mean, 1e-6 * want_mean);
        }
    }
}

TEST_F(GPT2TrainingTest, ScoredForwardRefusesBadCounts) {
    const GPT2Config c = config_from_descriptor("d2");
    Stream stream;
    GPT2 gpu(c, 2, 16, stream);
    DeviceBuffer<int> d_in(64), d_pos(64), d_tgt(64);
    cudaCheck(cudaMemset(d_in.get(), 0, d_in.bytes()));
    cudaCheck(cudaMemset(d_pos.get(), 0, d_pos.bytes()));
    cudaCheck(cudaMemset(d_tgt.get(), 0, d_tgt.bytes()));
    auto scored = [&](int B, int T, int64_t M) {
        return [&gpu, &d_in, &d_pos, &d_tgt, B, T, M] {
            gpu.forward_scored(d_in.get(), B, T, d_pos.get(), d_tgt.get(), M);
        };
    };
    expect_error(scored(2, 16, 0), kExitUsage, {"GPT2 forward_scored: M=0 scored positions for B=2 T=16",
                                                "1 <= M <= the allocated B x T = 32"});
    expect_error(scored(2, 16, 33), kExitUsage, {"M=33", "allocated B x T = 32"});
    // Repeated positions may outnumber the batch's (a short context's last position, once per ending),
    // up to the allocated rows.
    scored(1, 16, 32)();
    expect_error(scored(1, 16, 33), kExitUsage, {"M=33 scored positions for B=1 T=16", "allocated B x T = 32"});
    expect_error(scored(3, 16, 4), kExitUsage, {"GPT2 forward_scored: B=3 T=16"});
    expect_error(scored(1, 17, 4), kExitUsage, {"GPT2 forward_scored: B=1 T=17"});
    const GPT2::PackedRows half{d_pos.get(), nullptr};
    expect_error([&] { gpu.forward_scored(d_in.get(), 2, 16, d_pos.get(), d_tgt.get(), 4, nullptr, &half); },
                 kExitUsage, {"GPT2 forward_scored: packed rows need both positions and groups"});
    cudaCheck(cudaStreamSynchronize(stream));
}

// Both attention paths, as above.
TEST_F(GPT2TrainingTest, TwoRunsAreBitwiseIdentical) {
    for (const Case& k : {cases()[0], cases()[1]}) {
        SCOPED_TRACE(k.name);
        std::printf("  %s\n", k.name.c_str());
        const GPT2Config& c = k.config;
        const int B = 4, T = 64, steps = 5;
        const size_t N = size_t(B) * T;
        const std::vector<float> params = test_parameters(c, 51);
        std::vector<std::vector<int>> batches;
        for (int s = 0; s < 2 * steps; s++) batches.push_back(random_tokens<int>(N, c.vocab_size, 52 + uint64_t(s)));

        struct Run {
            std::vector<float> losses, norms;
            std::vector<floatX> final_params;
        };
        auto run = [&]() {
            Stream stream;
            GPT2 gpu(c, B, T, stream);
            gpu.set_parameters(params);
            AdamWSettings settings;
            settings.learning_rate = 3e-3f;
            settings.weight_decay = 0.1f;
            Run r;
            for (int s = 0; s < steps; s++) {
                auto d_in = upload(batches[size_t(2 * s)]), d_tg = upload(batches[size_t(2 * s + 1)]);
                gpu.zero_grad();
                gpu.forward(d_in.get(), d_tg.get(), B, T, nullptr, 1.0f / float(N));
                gpu.backward(d_in.get(), B, T);
                gpu.update(settings, 1.0f, s + 1, 1234);
                r.losses.push_back(download_scalar(gpu.mean_loss(), stream));
                r.norms.push_back(download_scalar(gpu.grad_norm(), stream));
            }
            r.final_params = download(gpu.params(), size_t(gpu.num_parameters()), stream);
            return r;
        };
        const Run a = run(), b = run();
        for (int s = 0; s < steps; s++) {
            std::printf("    step %d  loss %.9g / %.9g  norm %.9g / %.9g\n", s + 1, double(a.losses[size_t(s)]),
                        double(b.losses[size_t(s)]), double(a.norms[size_t(s)]), double(b.norms[size_t(s)]));
        }
        EXPECT_EQ(0, std::memcmp(a.losses.data(), b.losses.data(), a.losses.size() * sizeof(float))) << "losses differ";
        EXPECT_EQ(0, std::memcmp(a.norms.data(), b.norms.data(), a.norms.size() * sizeof(float))) << "norms differ";
        EXPECT_EQ(0, std::memcmp(a.final_params.data(), b.final_params.data(), a.final_params.size() * sizeof(floatX)))
            << "final parameters differ";
        EXPECT_NE(a.losses.front(), a.losses.back()) << "the steps changed nothing";
    }
}

// Backward's weight gradients on a second stream (GPT2::set_dw_stream) run the same kernels on the same
// inputs: levels 1 and 2 must give level 0's losses, gradient norms, final gradients and parameters bit for
// bit, over steps of two micro-batches (the side stream's accumulation into the gradients of the first
// micro-batch, and the next micro-batch's forward after it, are ordered too). d2 runs flash attention
// (whose backward sums dqkv's columns for qkv's bias where the Hopper kernels run), C=96 the cuBLASLt one.
// A model with -r 1 runs backward on one stream; a level past 2 is refused.
TEST_F(GPT2TrainingTest, WeightGradientsOnASecondStreamKeepTheBits) {
    for (const Case& k : {cases()[0], cases()[1]}) {
        SCOPED_TRACE(k.name);
        const GPT2Config& c = k.config;
        const int B = 4, T = 64, steps = 3, micro = 2;
        const size_t N = size_t(B) * T;
        const std::vector<float> params = test_parameters(c, 61);
        std::vector<std::vector<int>> batches;
        for (int s = 0; s < 2 * steps * micro; s++) {
            batches.push_back(random_tokens<int>(N, c.vocab_size, 62 + uint64_t(s)));
        }
        struct Run {
            std::vector<float> losses, norms;
            std::vector<floatX> grads, final_params;
        };
        auto run = [&](int level) {
            Stream stream;
            GPT2 gpu(c, B, T, stream);
            gpu.set_dw_stream(level);
            EXPECT_EQ(gpu.dw_stream_applies(), level);
            gpu.set_parameters(params);
            AdamWSettings settings;
            settings.learning_rate = 3e-3f;
            settings.weight_decay = 0.1f;
            Run r;
            std::vector<DeviceBuffer<int>> d_batches;
            for (const auto& b : batches) d_batches.push_back(upload(b));
            for (int s = 0; s < steps; s++) {
                gpu.zero_grad();
                for (int m = 0; m < micro; m++) {
                    const size_t i = size_t(2 * (s * micro + m));
                    gpu.forward(d_batches[i].get(), d_batches[i + 1].get(), B, T, nullptr, 1.0f / float(N * micro));
                    gpu.backward(d_batches[i].get(), B, T);
                    r.losses.push_back(download_scalar(gpu.mean_loss(), stream));
                }
                if (s == steps - 1) r.grads = download(gpu.grads(), size_t(gpu.num_parameters()), stream);
                gpu.update(settings, 1.0f, s + 1, 4321);
                r.norms.push_back(download_scalar(gpu.grad_norm(), stream));
            }
            r.final_params = download(gpu.params(), size_t(gpu.num_parameters()), stream);
            return r;
        };
        const Run base = run(0);
        for (int level : {1, 2}) {
            SCOPED_TRACE("level " + std::to_string(level));
            const Run r = run(level);
            for (size_t i = 0; i < r.losses.size(); i++) {
                std::printf("    level %d micro-batch %zu  loss %.9g / %.9g\n", level, i + 1, double(r.losses[i]),
                            double(base.losses[i]));
            }
            EXPECT_EQ(0, std::memcmp(r.losses.data(), base.losses.data(), r.losses.size() * sizeof(float)))
                << "losses differ";
            EXPECT_EQ(0, std::memcmp(r.norms.data(), base.norms.data(), r.norms.size() * sizeof(float)))
                << "norms differ";
            EXPECT_EQ(0, std::memcmp(r.grads.data(), base.grads.data(), r.grads.size() * sizeof(floatX)))
                << "the last step's gradients differ";
            EXPECT_EQ(0, std::memcmp(r.final_params.data(), base.final_params.data(),
                                     r.final_params.size() * sizeof(floatX)))
                << "final parameters differ";
        }
        EXPECT_NE(base.losses.front(), base.losses.back()) << "the steps changed nothing";
    }
    Stream stream;
    GPT2 recompute(cases()[0].config, 4, 64, stream, nullptr, 0, /*recompute_gelu=*/true);
    recompute.set_dw_stream(2);
    EXPECT_EQ(recompute.dw_stream(), 2);
    EXPECT_EQ(recompute.dw_stream_applies(), 0) << "-r 1 runs backward on one stream";
    expect_error([&] { recompute.set_dw_stream(3); }, kExitUsage, {"weight-gradient stream level 3, need 0, 1 or 2"});
    // What the side stream holds shows in memory(): level 2's second residual gradient buffer among the
    // activation gradients, its scratch and cuBLASLt workspace in scratch.
    const GPT2Config& c = cases()[0].config;
    GPT2 one(c, 4, 64, stream), two(c, 4, 64, stream);
    two.set_dw_stream(2);
    EXPECT_EQ(two.memory().activation_grads - one.memory().activation_grads,
              size_t(4 * 64) * size_t(c.channels) * sizeof(floatX));
    EXPECT_GT(two.memory().scratch, one.memory().scratch + kCublasWorkspaceBytes - 1);
}

}  // namespace
