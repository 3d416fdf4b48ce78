/*
CPU tests of the reference GPT-2 (cpu/gpt2_cpu.h), its configuration (llmc/gpt2_config.h) and the model
file format (llmc/model_file.h).

The central one is the gradient check: the model runs in double precision and every parameter tensor's
analytic gradient is compared with central finite differences at sampled entries. The float model is
then checked against the double one, so the float path the GPU is compared with is covered too. The
comparison with PyTorch lives in test/test_gpt2_vs_torch.sh.
*/
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "cpu/gpt2_cpu.h"
#include "llmc/gpt2_config.h"
#include "llmc/model_file.h"
#include "llmc/utils.h"
#include "test/test_util.h"
#include "test/expect_error.h"

using namespace llmc;
using llmc::test::random_tokens;
using llmc::test::read_bytes;
using llmc::test::write_bytes;
using llmc::test::TempDir;

namespace {

// 2 layers, C=32, 4 heads, an odd vocabulary (67, padded to 128) and maxT=12 > T, so that padded rows
// and unused position rows exist.
GPT2Config tiny_config() { return make_config(2, 32, 4, 67, 12); }

// GPT-2 initialisation, then every tensor made non-trivial: matrices 5x larger (so attention is far
// from uniform), LayerNorm weights around 1 and biases around 0 but random. Padded rows stay zero.
std::vector<float> random_params(const GPT2Config& c, uint64_t seed) {
    std::vector<float> p(size_t(num_parameters(c)));
    init_parameters(c, seed, p.data());
    auto tensors = param_tensors(c);
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo& t = tensors[size_t(i)];
        for (int64_t j = 0; j < t.numel; j++) {
            float& x = p[size_t(t.offset + j)];
            double r = counter_normal(seed + 1000, uint64_t(i), uint64_t(j));
            if (t.decayed) {
                x *= 5.0f;
            } else if (i == kLn1w || i == kLn2w || i == kLnfw) {
                x = float(1.0 + 0.2 * r);
            } else {
                x = float(0.1 * r);
            }
        }
    }
    return p;
}

// max |a - b| / max |b|: a relative error that stays meaningful where single entries are near zero.
template <class A, class B>
double max_rel_error(const A* a, const B* b, int64_t n) {
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < n; i++) {
        diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
        scale = std::max(scale, std::fabs(double(b[i])));
    }
    return scale > 0 ? diff / scale : diff;
}

// Sets the OpenMP thread count for a scope and restores it: more threads than cores, left behind,
// would slow every later test by orders of magnitude.
class ThreadCount {
public:
    explicit ThreadCount(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
    ~ThreadCount() { omp_set_num_threads(saved_); }
    ThreadCount(const ThreadCount&) = delete;
    ThreadCount& operator=(const ThreadCount&) = delete;

private:
    int saved_;
};

void set_header_int(std::vector<char>& bytes, int index, int32_t value) {
    std::memcpy(bytes.data() + 4 * index, &value, 4);
}

uint32_t float_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

float bits_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Configuration

TEST(GPT2Config, DescriptorsGiveGPT2Shapes) {
    struct Row {
        const char* name;
        int L, C, NH;
    } rows[] = {{"d2", 2, 128, 2},     {"d6", 6, 384, 6},     {"d12", 12, 768, 12},
                {"d24", 24, 1024, 16}, {"d36", 36, 1280, 20}, {"d48", 48, 1600, 25}};
    for (const Row& r : rows) {
        GPT2Config c = config_from_descriptor(r.name);
        EXPECT_EQ(c.num_layers, r.L) << r.name;
        EXPECT_EQ(c.channels, r.C) << r.name;
        EXPECT_EQ(c.num_heads, r.NH) << r.name;
        EXPECT_EQ(c.vocab_size, 50257);
        EXPECT_EQ(c.padded_vocab_size, 50304);
        EXPECT_EQ(c.max_seq_len, 1024);
    }
    // d12 is the count llm.c prints for GPT-2 124M (padded vocabulary); the others are Vp*C + maxT*C +
    // L*(12C^2 + 13C) + 2C worked out by hand.
    EXPECT_EQ(num_parameters(config_from_descriptor("d12")), 124475904);
    EXPECT_EQ(num_parameters(config_from_descriptor("d24")), 354871296);
    EXPECT_EQ(num_parameters(config_from_descriptor("d36")), 774090240);
    EXPECT_EQ(num_parameters(config_from_descriptor("d48")), 1557686400);
    expect_error([] { config_from_descriptor("d13"); }, kExitUsage, {"d13", "d12"});
    expect_error([] { config_from_descriptor(""); }, kExitUsage, {"descriptor"});
}

TEST(GPT2Config, ExplicitShapesAndValidation) {
    EXPECT_EQ(make_config(2, 32, 4, 67, 12).padded_vocab_size, 128);
    EXPECT_EQ(make_config(2, 32, 4, 128, 12).padded_vocab_size, 128);
    EXPECT_EQ(make_config(2, 32, 4, 129, 12).padded_vocab_size, 256);
    expect_error([] { make_config(2, 30, 4); }, kExitUsage, {"channels 30", "num_heads 4"});
    expect_error([] { make_config(0, 32, 4); }, kExitUsage, {"num_layers 0"});
    expect_error([] { make_config(2, 32, 4, 0); }, kExitUsage, {"vocab_size 0"});
    GPT2Config c = make_config(2, 32, 4, 67, 12);
    c.padded_vocab_size = 66;
    EXPECT_NE(config_problem(c).find("padded_vocab_size 66"), std::string::npos) << config_problem(c);
}

TEST(GPT2Config, ParameterTensorsInLlmcOrder) {
    GPT2Config c = make_config(3, 48, 6, 100, 20);  // Vp = 128
    auto t = param_tensors(c);
    const char* names[] = {"wte", "wpe",  "ln1w", "ln1b", "qkvw",    "qkvb",    "attprojw", "attprojb",
                           "ln2w", "ln2b", "fcw",  "fcb",  "fcprojw", "fcprojb", "lnfw",     "lnfb"};
    int64_t sizes[] = {128 * 48, 20 * 48, 3 * 48, 3 * 48, 3 * 144 * 48, 3 * 144, 3 * 48 * 48, 3 * 48,
                       3 * 48,   3 * 48,  3 * 192 * 48, 3 * 192, 3 * 48 * 192, 3 * 48, 48, 48};
    int64_t offset = 0;
    for (int i = 0; i < kNumParamTensors; i++) {
        EXPECT_STREQ(t[size_t(i)].name, names[i]);
        EXPECT_EQ(t[size_t(i)].numel, sizes[i]) << names[i];
        EXPECT_EQ(t[size_t(i)].offset, offset) << names[i];
        int64_t prod = 1;
        for (int d = 0; d < t[size_t(i)].ndim; d++) prod *= t[size_t(i)].shape[d];
        EXPECT_EQ(prod, sizes[i]) << names[i];
        bool matrix = i == kWte || i == kWpe || i == kQkvw || i == kAttprojw || i == kFcw || i == kFcprojw;
        EXPECT_EQ(t[size_t(i)].decayed, matrix) << names[i];
        offset += sizes[i];
    }
    EXPECT_EQ(num_parameters(c), offset);
    EXPECT_EQ(t[kQkvw].ndim, 3);
    EXPECT_EQ(t[kQkvw].shape[1], 144);
    EXPECT_EQ(t[kFcprojw].shape[2], 192);
    GPT2Config d12 = config_from_descriptor("d12");
    EXPECT_DOUBLE_EQ(flops_per_token(d12, 1024), 6.0 * 124475904 + 6.0 * 12 * 768 * 1024);
}

TEST(GPT2Config, InitialisationIsGPT2sAndDeterministic) {
    GPT2Config c = make_config(4, 64, 4, 1000, 64);
    const size_t n = size_t(num_parameters(c));
    std::vector<float> a(n), b(n), other(n);
    {
        ThreadCount one(1);
        init_parameters(c, 1337, a.data());
    }
    {
        ThreadCount three(3);
        init_parameters(c, 1337, b.data());
    }
    init_parameters(c, 1338, other.data());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0) << "init depends on the thread count";
    EXPECT_NE(std::memcmp(a.data(), other.data(), n * sizeof(float)), 0) << "the seed does not matter";

    auto t = param_tensors(c);
    auto stats = [&](int i, int64_t count) {
        double s = 0, s2 = 0;
        for (int64_t j = 0; j < count; j++) {
            double x = a[size_t(t[size_t(i)].offset + j)];
            s += x;
            s2 += x * x;
        }
        return std::make_pair(s / count, std::sqrt(s2 / count - (s / count) * (s / count)));
    };
    const int64_t live_wte = int64_t(c.vocab_size) * c.channels;
    for (int i : {int(kWte), int(kWpe), int(kQkvw), int(kFcw)}) {
        auto [mean, sd] = stats(i, i == kWte ? live_wte : t[size_t(i)].numel);
        EXPECT_NEAR(mean, 0.0, 0.002) << t[size_t(i)].name;
        EXPECT_NEAR(sd, 0.02, 0.0006) << t[size_t(i)].name;
    }
    for (int i : {int(kAttprojw), int(kFcprojw)}) {
        auto [mean, sd] = stats(i, t[size_t(i)].numel);
        EXPECT_NEAR(mean, 0.0, 0.001) << t[size_t(i)].name;
        EXPECT_NEAR(sd, 0.02 / std::sqrt(8.0), 0.0003) << t[size_t(i)].name;
    }
    for (int64_t j = live_wte; j < t[kWte].numel; j++) ASSERT_EQ(a[size_t(t[kWte].offset + j)], 0.0f) << "padded row";
    for (int i : {int(kLn1w), int(kLn2w), int(kLnfw)}) {
        for (int64_t j = 0; j < t[size_t(i)].numel; j++) ASSERT_EQ(a[size_t(t[size_t(i)].offset + j)], 1.0f);
    }
    for (int i : {int(kLn1b), int(kQkvb), int(kAttprojb), int(kLn2b), int(kFcb), int(kFcprojb), int(kLnfb)}) {
        for (int64_t j = 0; j < t[size_t(i)].numel; j++) ASSERT_EQ(a[size_t(t[size_t(i)].offset + j)], 0.0f);
    }
}

// ---------------------------------------------------------------------------------------------------
// The model

// Every parameter tensor's gradient against central finite differences, in double precision.
TEST(GPT2Cpu, GradientsMatchFiniteDifferences) {
    const GPT2Config c = tiny_config();
    const int B = 2, T = 8;
    cpu::GPT2<double> model(c, random_params(c, 7));
    std::vector<int> inputs = random_tokens<int>(size_t(B * T), c.vocab_size, 1);
    std::vector<int> targets = random_tokens<int>(size_t(B * T), c.vocab_size, 2);
    double loss = model.forward(inputs.data(), targets.data(), B, T);
    EXPECT_GT(loss, 1.0);
    model.zero_grad();
    model.backward();

    std::mt19937 rng(3);
    const double h = 1e-5;
    double worst = 0;
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo& t = model.tensor(i);
        // Sample where gradients are non-zero (real vocabulary rows, positions < T), plus one entry
        // that must have a zero gradient where there is one (a padded row, an unused position).
        int64_t live = i == kWte ? int64_t(c.vocab_size) * c.channels : i == kWpe ? int64_t(T) * c.channels : t.numel;
        std::vector<int64_t> entries;
        std::uniform_int_distribution<int64_t> pick(0, live - 1);
        for (int k = 0; k < 12; k++) entries.push_back(pick(rng));
        if (i == kWte || i == kWpe) entries.push_back(live + 5);
        double largest_fd = 0;
        for (int64_t j : entries) {
            double& p = model.params[size_t(t.offset + j)];
            const double saved = p;
            p = saved + h;
            double up = model.forward(inputs.data(), targets.data(), B, T);
            p = saved - h;
            double down = model.forward(inputs.data(), targets.data(), B, T);
            p = saved;
            double fd = (up - down) / (2 * h);
            double analytic = model.grads[size_t(t.offset + j)];
            double err = std::fabs(analytic - fd);
            worst = std::max(worst, err / std::max(std::fabs(fd), 1e-3));
            EXPECT_LE(err, 1e-9 + 1e-6 * std::fabs(fd))
                << t.name << "[" << j << "]: analytic " << analytic << " finite difference " << fd;
            if (j >= live) {
                EXPECT_EQ(analytic, 0.0) << t.name << "[" << j << "] must get no gradient";
            }
            largest_fd = std::max(largest_fd, std::fabs(fd));
        }
        EXPECT_GT(largest_fd, 1e-5) << t.name << ": the sampled gradients are all ~0, the check would be vacuous";
    }
    std::printf("gradient check: worst |analytic - finite difference| / max(|fd|, 1e-3) = %.3g\n", worst);
}

// A tiny model whose parameters and tokens are closed-form expressions (so another implementation can
// build it without this code) has a loss, logit and gradients known as literal numbers, so that a
// constant changed consistently in forward and backward (LayerNorm's epsilon, the GELU, the attention
// scale) fails here without PyTorch. The literals are the double model's; PyTorch 1.13 in float64 on
// the same parameters (dev/gpt2_torch.py's forward) gives the same 12 significant digits.
TEST(GPT2Cpu, FixedModelMatchesLiteralValues) {
    const GPT2Config c = tiny_config();
    std::vector<float> p(size_t(num_parameters(c)));
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo t = param_tensors(c)[size_t(i)];
        for (int64_t j = 0; j < t.numel; j++) {
            const double u = std::sin(0.7 * double(j) + 1.9 * i + 0.3);
            double v = t.decayed ? 0.2 * u : (i == kLn1w || i == kLn2w || i == kLnfw) ? 1.0 + 0.1 * u : 0.05 * u;
            if (i == kWte && j >= int64_t(c.vocab_size) * c.channels) v = 0;
            p[size_t(t.offset + j)] = float(v);
        }
    }
    const int B = 2, T = 5;
    std::vector<int> inputs(B * T), targets(B * T);
    for (int k = 0; k < B * T; k++) {
        inputs[size_t(k)] = (7 * k + 3) % c.vocab_size;
        targets[size_t(k)] = (5 * k + 1) % c.vocab_size;
    }
    struct Entry {
        int tensor;
        int64_t index;
        double grad;
    };
    const Entry entries[] = {
        {kWte, 101, -1.738726442316e-02},      {kWte, 2143, -3.114950867729e-03},   {kWpe, 39, -5.523303767426e-02},
        {kLn1w, 35, 3.851817237872e-04},       {kLn1b, 9, 3.447633135651e-04},      {kQkvw, 1234, 2.563575098467e-03},
        {kQkvb, 70, 1.084833912342e-02},       {kAttprojw, 1524, -5.237661854147e-02},
        {kAttprojb, 17, 6.365497958376e-03},   {kLn2w, 30, 1.510414749768e-02},     {kFcw, 4000, 2.378351516359e-02},
        {kFcb, 205, -1.221883056324e-02},      {kFcprojw, 6318, 2.715831274001e-02},
        {kFcprojb, 33, -6.108283584285e-02},   {kLnfw, 0, 4.739655986906e-02},      {kLnfb, 31, 5.535301246572e-02},
    };
    const double loss = 4.543671761264, logit0 = -0.635079281633, norm = 7.017814690368;

    cpu::GPT2<double> d(c, p);
    EXPECT_NEAR(d.forward(inputs.data(), targets.data(), B, T), loss, 1e-11);
    EXPECT_NEAR(d.activations().logits[0], logit0, 1e-11);
    d.zero_grad();
    d.backward();
    for (const Entry& e : entries) {
        EXPECT_NEAR(d.grad(e.tensor)[e.index], e.grad, 1e-13) << d.tensor(e.tensor).name << "[" << e.index << "]";
    }
    EXPECT_NEAR(d.grad_norm(), norm, 1e-11);

    // The float model, the oracle of the GPU kernels, to 1e-6 (relative for the norm, a sum of squares).
    cpu::GPT2<float> f(c, p);
    EXPECT_NEAR(f.forward(inputs.data(), targets.data(), B, T), loss, 1e-6);
    EXPECT_NEAR(f.activations().logits[0], logit0, 1e-6);
    f.zero_grad();
    f.backward();
    for (const Entry& e : entries) {
        EXPECT_NEAR(f.grad(e.tensor)[e.index], e.grad, 1e-6) << f.tensor(e.tensor).name << "[" << e.index << "]";
    }
    EXPECT_NEAR(f.grad_norm(), norm, 1e-6 * norm);
}

// The float model (what the GPU is compared with) agrees with the double one.
TEST(GPT2Cpu, FloatAgreesWithDouble) {
    const GPT2Config c = tiny_config();
    const int B = 3, T = 11;
    std::vector<float> p = random_params(c, 11);
    cpu::GPT2<float> f(c, p);
    cpu::GPT2<double> d(c, p);
    std::vector<int> inputs = random_tokens<int>(size_t(B * T), c.vocab_size, 4);
    std::vector<int> targets = random_tokens<int>(size_t(B * T), c.vocab_size, 5);
    double lf = f.forward(inputs.data(), targets.data(), B, T);
    double ld = d.forward(inputs.data(), targets.data(), B, T);
    EXPECT_NEAR(lf, ld, 1e-6 * ld);
    const size_t nl = f.activations().logits.size();
    EXPECT_LT(max_rel_error(f.activations().logits.data(), d.activations().logits.data(), int64_t(nl)), 1e-6);
    f.zero_grad();
    f.backward();
    d.zero_grad();
    d.backward();
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo& t = f.tensor(i);
        double err = max_rel_error(f.grad(i), d.grad(i), t.numel);
        EXPECT_LT(err, 1e-5) << t.name;
    }
    EXPECT_NEAR(f.grad_norm(), d.grad_norm(), 1e-6 * d.grad_norm());
}

// The loss and the softmax only see the first V logits: garbage in the padded rows of wte changes
// the padded logits and nothing else, bit for bit.
TEST(GPT2Cpu, PaddedVocabularyNeverReachesTheLoss) {
    const GPT2Config c = tiny_config();
    const int B = 2, T = 9;
    std::vector<float> p = random_params(c, 21);
    cpu::GPT2<float> clean(c, p);
    const ParamTensorInfo wte = param_tensors(c)[kWte];
    for (int64_t j = int64_t(c.vocab_size) * c.channels; j < wte.numel; j++) p[size_t(wte.offset + j)] = 3.0f;
    cpu::GPT2<float> dirty(c, p);
    std::vector<int> inputs = random_tokens<int>(size_t(B * T), c.vocab_size, 6);
    std::vector<int> targets = random_tokens<int>(size_t(B * T), c.vocab_size, 7);
    double l1 = clean.forward(inputs.data(), targets.data(), B, T);
    double l2 = dirty.forward(inputs.data(), targets.data(), B, T);
    EXPECT_EQ(l1, l2);
    const auto& a = dirty.activations();
    bool padded_logit_nonzero = false;
    for (int n = 0; n < B * T; n++) {
        for (int v = c.vocab_size; v < c.padded_vocab_size; v++) {
            padded_logit_nonzero |= a.logits[size_t(n * c.padded_vocab_size + v)] != 0.0f;
            ASSERT_EQ(a.probs[size_t(n * c.padded_vocab_size + v)], 0.0f);
        }
    }
    EXPECT_TRUE(padded_logit_nonzero);
    clean.zero_grad();
    clean.backward();
    dirty.zero_grad();
    dirty.backward();
    for (int64_t j = int64_t(c.vocab_size) * c.channels; j < wte.numel; j++) ASSERT_EQ(dirty.grads[size_t(j)], 0.0f);
    EXPECT_EQ(std::memcmp(clean.grads.data(), dirty.grads.data(), clean.grads.size() * sizeof(float)), 0);
}

// Attention is causal: changing the token at position t leaves the logits before t untouched.
TEST(GPT2Cpu, AttentionIsCausal) {
    const GPT2Config c = tiny_config();
    const int B = 1, T = 10, t_changed = 6;
    cpu::GPT2<float> model(c, random_params(c, 31));
    std::vector<int> inputs = random_tokens<int>(size_t(T), c.vocab_size, 8);
    model.forward(inputs.data(), nullptr, B, T);
    std::vector<float> before = model.activations().logits;
    inputs[t_changed] = (inputs[t_changed] + 1) % c.vocab_size;
    model.forward(inputs.data(), nullptr, B, T);
    const std::vector<float>& after = model.activations().logits;
    const size_t row = size_t(c.padded_vocab_size);
    EXPECT_EQ(std::memcmp(before.data(), after.data(), t_changed * row * sizeof(float)), 0);
    EXPECT_NE(std::memcmp(before.data() + t_changed * row, after.data() + t_changed * row, row * sizeof(float)), 0);
}

TEST(GPT2Cpu, ResultsDoNotDependOnTheThreadCount) {
    const GPT2Config c = tiny_config();
    const int B = 3, T = 7;
    std::vector<float> p = random_params(c, 41);
    std::vector<int> inputs = random_tokens<int>(size_t(B * T), c.vocab_size, 9);
    std::vector<int> targets = random_tokens<int>(size_t(B * T), c.vocab_size, 10);
    auto run = [&](int threads) {
        ThreadCount count(threads);
        cpu::GPT2<float> m(c, p);
        double loss = m.forward(inputs.data(), targets.data(), B, T);
        m.zero_grad();
        m.backward();
        m.update(cpu::AdamW{1e-3, 0.9, 0.95, 1e-8, 0.1}, 1, cpu::clip_scale(m.grad_norm(), 1.0));
        return std::make_pair(loss, m.params);
    };
    auto one = run(1), three = run(3);
    EXPECT_EQ(one.first, three.first);
    EXPECT_EQ(std::memcmp(one.second.data(), three.second.data(), one.second.size() * sizeof(float)), 0);
}

TEST(GPT2Cpu, RejectsBadInputs) {
    const GPT2Config c = tiny_config();
    cpu::GPT2<float> model(c, random_params(c, 51));
    std::vector<int> tokens(26, 1);
    expect_error([&] { model.forward(tokens.data(), tokens.data(), 2, 13); }, kExitUsage, {"T=13", "maxT=12"});
    tokens[5] = c.vocab_size;
    expect_error([&] { model.forward(tokens.data(), nullptr, 2, 8); }, kExitData, {"input token 5", "67"});
    tokens[5] = 0;
    tokens[3] = -1;
    expect_error([&] { model.forward(tokens.data() + 10, tokens.data(), 2, 8); }, kExitData, {"target token 3"});
    cpu::GPT2<float> fresh(c, random_params(c, 51));
    expect_error([&] { fresh.backward(); }, kExitUsage, {"forward"});
}

// ---------------------------------------------------------------------------------------------------
// Optimizer

TEST(GPT2Cpu, GradNormAndClipScale) {
    const GPT2Config c = tiny_config();
    cpu::GPT2<float> model(c);
    double sum = 0;
    for (size_t i = 0; i < model.grads.size(); i++) {
        model.grads[i] = float(counter_normal(5, 0, i) * 1e-2);
        sum += double(model.grads[i]) * model.grads[i];
    }
    EXPECT_NEAR(model.grad_norm(), std::sqrt(sum), 1e-12 * std::sqrt(sum));
    EXPECT_DOUBLE_EQ(cpu::clip_scale(4.0, 1.0), 0.25);
    EXPECT_DOUBLE_EQ(cpu::clip_scale(0.5, 1.0), 1.0);
    EXPECT_DOUBLE_EQ(cpu::clip_scale(4.0, 0.0), 1.0);  // 0 turns clipping off
}

// Two AdamW steps against the update written out by hand in double, on a decayed and an undecayed tensor.
TEST(GPT2Cpu, AdamWMatchesItsDefinition) {
    const GPT2Config c = tiny_config();
    cpu::GPT2<float> model(c, random_params(c, 61));
    const cpu::AdamW opt{2e-3, 0.8, 0.9, 1e-6, 0.3};
    const double scale = 0.7;
    const std::vector<float> p0 = model.params;
    std::vector<double> m(p0.size(), 0), v(p0.size(), 0), p(p0.begin(), p0.end());
    auto tensors = param_tensors(c);
    for (int step = 1; step <= 2; step++) {
        for (size_t i = 0; i < model.grads.size(); i++) model.grads[i] = float(counter_normal(step, 1, i) * 1e-3);
        model.update(opt, step, scale);
        for (int ti = 0; ti < kNumParamTensors; ti++) {
            const ParamTensorInfo& t = tensors[size_t(ti)];
            double wd = t.decayed ? double(opt.weight_decay) : 0.0;
            for (int64_t j = 0; j < t.numel; j++) {
                size_t i = size_t(t.offset + j);
                double g = double(model.grads[i]) * scale;
                m[i] = double(opt.beta1) * m[i] + (1 - double(opt.beta1)) * g;
                v[i] = double(opt.beta2) * v[i] + (1 - double(opt.beta2)) * g * g;
                double mh = m[i] / (1 - std::pow(double(opt.beta1), step));
                double vh = v[i] / (1 - std::pow(double(opt.beta2), step));
                p[i] -= double(opt.learning_rate) * (mh / (std::sqrt(vh) + double(opt.eps)) + wd * p[i]);
            }
        }
    }
    double worst = 0;
    for (size_t i = 0; i < p.size(); i++) worst = std::max(worst, std::fabs(double(model.params[i]) - p[i]));
    EXPECT_LT(worst, 2e-7);
    // The update moved every parameter by about lr per step, so the comparison above is not vacuous.
    EXPECT_GT(std::fabs(double(model.params[100]) - double(p0[100])), 1e-3);
}

// With zero gradients only the decoupled weight decay acts, and only on the matrices.
TEST(GPT2Cpu, WeightDecayOnlyOnMatrices) {
    const GPT2Config c = tiny_config();
    cpu::GPT2<float> model(c, random_params(c, 71));
    const std::vector<float> before = model.params;
    model.zero_grad();
    model.update(cpu::AdamW{0.01, 0.9, 0.95, 1e-8, 0.5}, 1);
    for (const ParamTensorInfo& t : param_tensors(c)) {
        for (int64_t j = 0; j < t.numel; j++) {
            size_t i = size_t(t.offset + j);
            float expected = t.decayed ? before[i] - 0.01f * 0.5f * before[i] : before[i];
            ASSERT_NEAR(model.params[i], expected, 1e-7f * std::fabs(before[i])) << t.name << "[" << j << "]";
        }
    }
}

// A few hundred AdamW steps on one batch memorise it: the loss must fall far.
TEST(GPT2Cpu, TrainingLowersTheLoss) {
    const GPT2Config c = tiny_config();
    const int B = 2, T = 8;
    std::vector<float> p(size_t(num_parameters(c)));
    init_parameters(c, 3, p.data());
    cpu::GPT2<float> model(c, p);
    std::vector<int> tokens = random_tokens<int>(size_t(B * T + 1), c.vocab_size, 12);
    std::vector<int> inputs(tokens.begin(), tokens.end() - 1), targets(tokens.begin() + 1, tokens.end());
    double first = 0, last = 0;
    for (int step = 1; step <= 60; step++) {
        last = model.forward(inputs.data(), targets.data(), B, T);
        if (step == 1) first = last;
        model.zero_grad();
        model.backward();
        model.update(cpu::AdamW{1e-2, 0.9, 0.95, 1e-8, 0.0}, step, cpu::clip_scale(model.grad_norm(), 1.0));
    }
    EXPECT_NEAR(first, std::log(double(c.vocab_size)), 0.2);  // a fresh model guesses uniformly
    EXPECT_LT(last, 0.3 * first);
}

// ---------------------------------------------------------------------------------------------------
// Model files

TEST(ModelFile, Bf16RoundsToNearestEven) {
    EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
    EXPECT_EQ(float_to_bf16(bits_float(0x3F808000u)), 0x3F80);  // tie, 0x3F80 is even: down
    EXPECT_EQ(float_to_bf16(bits_float(0x3F818000u)), 0x3F82);  // tie, 0x3F81 is odd: up
    EXPECT_EQ(float_to_bf16(bits_float(0x3F808001u)), 0x3F81);  // above the tie: up
    EXPECT_EQ(float_to_bf16(bits_float(0x3F807FFFu)), 0x3F80);  // below the tie: down
    EXPECT_EQ(float_to_bf16(bits_float(0xBF818000u)), 0xBF82);  // sign does not change the rounding
    EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
    EXPECT_EQ(float_to_bf16(bits_float(0x7F800000u)), 0x7F80);  // inf
    EXPECT_EQ(float_to_bf16(bits_float(0x7F7FFFFFu)), 0x7F80);  // FLT_MAX rounds up to inf
    EXPECT_EQ(float_to_bf16(bits_float(0x00018000u)), 0x0002);  // subnormal tie to even
    uint16_t nan = float_to_bf16(bits_float(0x7F800001u));  // mantissa only in the dropped bits
    EXPECT_TRUE(std::isnan(bf16_to_float(nan)));
    EXPECT_EQ(float_bits(bf16_to_float(0x3F82)), 0x3F820000u);
}

TEST(ModelFile, Fp32RoundTripIsExact) {
    TempDir dir;
    const GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 81);
    write_model_file(dir.file("m.bin"), c, p.data(), kModelVersionFp32);
    std::vector<char> bytes = read_bytes(dir.file("m.bin"));
    ASSERT_EQ(int64_t(bytes.size()), kModelHeaderBytes + 4 * num_parameters(c));
    int32_t h[256];
    std::memcpy(h, bytes.data(), sizeof(h));
    EXPECT_EQ(h[0], 20240326);
    EXPECT_EQ(h[1], 3);
    EXPECT_EQ(h[2], 12);
    EXPECT_EQ(h[3], 67);
    EXPECT_EQ(h[4], 2);
    EXPECT_EQ(h[5], 4);
    EXPECT_EQ(h[6], 32);
    EXPECT_EQ(h[7], 128);
    for (int i = 8; i < 256; i++) ASSERT_EQ(h[i], 0);
    EXPECT_EQ(std::memcmp(bytes.data() + 1024, p.data(), p.size() * 4), 0);

    std::vector<float> back;
    ModelFileInfo info = read_model_file(dir.file("m.bin"), &back);
    EXPECT_EQ(info.version, 3);
    EXPECT_TRUE(info.config == c);
    ASSERT_EQ(back.size(), p.size());
    EXPECT_EQ(std::memcmp(back.data(), p.data(), p.size() * 4), 0);
}

TEST(ModelFile, Bf16RoundTrip) {
    TempDir dir;
    const GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 91);
    write_model_file(dir.file("m.bin"), c, p.data(), kModelVersionBf16);
    EXPECT_EQ(int64_t(read_bytes(dir.file("m.bin")).size()), kModelHeaderBytes + 2 * num_parameters(c));
    std::vector<float> back;
    ModelFileInfo info = read_model_file(dir.file("m.bin"), &back);
    EXPECT_EQ(info.version, 5);
    EXPECT_TRUE(info.config == c);
    ASSERT_EQ(back.size(), p.size());
    size_t changed = 0;
    for (size_t i = 0; i < p.size(); i++) {
        ASSERT_EQ(float_bits(back[i]), float_bits(bf16_to_float(float_to_bf16(p[i])))) << i;
        ASSERT_LE(std::fabs(back[i] - p[i]), std::fabs(p[i]) * (1.0f / 256));
        changed += back[i] != p[i];
    }
    EXPECT_GT(changed, p.size() / 2);  // it really was stored in 16 bits
    // bf16 -> fp32 -> bf16 is exact, so writing what was read gives the same file.
    write_model_file(dir.file("again.bin"), c, back.data(), kModelVersionBf16);
    EXPECT_EQ(read_bytes(dir.file("m.bin")), read_bytes(dir.file("again.bin")));
}

TEST(ModelFile, ValidationErrorsNameTheFileAndTheProblem) {
    TempDir dir;
    const GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 101);
    const std::string good = dir.file("good.bin");
    write_model_file(good, c, p.data(), kModelVersionFp32);
    const std::vector<char> bytes = read_bytes(good);
    std::vector<float> out;
    auto load = [&](const std::string& path) { return [&out, path] { read_model_file(path, &out); }; };
    auto variant = [&](const char* name, auto edit) {
        std::vector<char> b = bytes;
        edit(b);
        write_bytes(dir.file(name), b);
        return dir.file(name);
    };

    std::string f = variant("magic.bin", [](auto& b) { set_header_int(b, 0, 20240520); });
    expect_error(load(f), kExitData, {"magic.bin", "bad magic 20240520", "20240326"});
    f = variant("version.bin", [](auto& b) { set_header_int(b, 1, 4); });
    expect_error(load(f), kExitData, {"version.bin", "unsupported version 4", "3 = fp32 or 5 = bf16"});
    f = variant("old.bin", [](auto& b) { set_header_int(b, 1, 1); });
    expect_error(load(f), kExitData, {"old.bin", "version 1", "re-export"});
    f = variant("truncated.bin", [](auto& b) { b.resize(b.size() - 1); });
    expect_error(load(f), kExitData, {"truncated.bin", "truncated", std::to_string(bytes.size() - 1).c_str()});
    f = variant("long.bin", [](auto& b) { b.insert(b.end(), 4, 0); });
    expect_error(load(f), kExitData, {"long.bin", "trailing"});
    f = variant("short.bin", [](auto& b) { b.resize(100); });
    expect_error(load(f), kExitData, {"short.bin", "shorter than its 1024-byte header"});
    f = variant("heads.bin", [](auto& b) { set_header_int(b, 5, 5); });
    expect_error(load(f), kExitData, {"heads.bin", "invalid shape", "not a multiple of num_heads 5"});
    f = variant("vp.bin", [](auto& b) { set_header_int(b, 7, 64); });
    expect_error(load(f), kExitData, {"vp.bin", "padded_vocab_size 64"});
    f = variant("negative.bin", [](auto& b) { set_header_int(b, 4, -2); });
    expect_error(load(f), kExitData, {"negative.bin", "num_layers -2"});
    // A shape that is valid but does not fit the data: one layer more needs more bytes.
    f = variant("layers.bin", [](auto& b) { set_header_int(b, 4, 3); });
    expect_error(load(f), kExitData, {"layers.bin", "L=3", "truncated"});
    f = variant("padrow.bin", [&](auto& b) {
        float x = 0.5f;
        std::memcpy(b.data() + 1024 + 4 * (int64_t(c.vocab_size) * c.channels + 3), &x, 4);
    });
    expect_error(load(f), kExitData, {"padrow.bin", "padded vocabulary row 67", "must be zero"});
    expect_error(load(dir.file("missing.bin")), kExitIo, {"missing.bin"});

    GPT2Config other = c;
    other.num_layers = 3;
    expect_error([&] { read_model_file(good, &out, &other); }, kExitData, {"good.bin", "L=2", "L=3", "expected"});
    EXPECT_NO_THROW(read_model_file(good, &out, &c));
    expect_error([&] { write_model_file(dir.file("v4.bin"), c, p.data(), 4); }, kExitUsage, {"version 4"});
}

// Only versions 3 and 5 are model files. Every other version is refused, on reading even when the file
// has exactly the length of a bf16 (or fp32) payload, and on writing before a file appears.
TEST(ModelFile, OnlyVersions3And5AreReadOrWritten) {
    TempDir dir;
    const GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 121);
    write_model_file(dir.file("v5.bin"), c, p.data(), kModelVersionBf16);
    write_model_file(dir.file("v3.bin"), c, p.data(), kModelVersionFp32);
    const std::vector<char> v5 = read_bytes(dir.file("v5.bin")), v3 = read_bytes(dir.file("v3.bin"));
    std::vector<float> out;
    for (int32_t version : {6, 7, 4, 0, -5, 1000, INT32_MAX}) {
        SCOPED_TRACE("version " + std::to_string(version));
        for (const std::vector<char>* payload : {&v5, &v3}) {
            std::vector<char> b = *payload;
            set_header_int(b, 1, version);
            write_bytes(dir.file("other.bin"), b);
            expect_error([&] { read_model_file(dir.file("other.bin"), &out); }, kExitData,
                         {"other.bin", format("unsupported version %d at offset 4", version), "3 = fp32 or 5 = bf16"});
            File f(dir.file("other.bin"), File::Mode::Read);
            expect_error([&] { read_model_header(f); }, kExitData, {format("unsupported version %d", version)});
        }
        expect_error([&] { write_model_file(dir.file("w.bin"), c, p.data(), version); }, kExitUsage,
                     {"w.bin", format("cannot write version %d", version)});
        EXPECT_FALSE(std::filesystem::exists(dir.file("w.bin")));
        EXPECT_EQ(model_bytes_per_param(version), 0);
    }
    EXPECT_EQ(model_bytes_per_param(3), 4);
    EXPECT_EQ(model_bytes_per_param(5), 2);
}

// header[7] == 0 (no padded size recorded) means an unpadded vocabulary: Vp = V rows of wte.
TEST(ModelFile, ZeroPaddedVocabMeansUnpadded) {
    TempDir dir;
    GPT2Config c = tiny_config();
    c.padded_vocab_size = c.vocab_size;
    std::vector<float> p = random_params(make_config(2, 32, 4, 67, 12), 111);
    p.resize(size_t(num_parameters(c)));  // any values will do: only the layout is checked here
    write_model_file(dir.file("u.bin"), c, p.data(), kModelVersionFp32);
    std::vector<char> b = read_bytes(dir.file("u.bin"));
    set_header_int(b, 7, 0);
    write_bytes(dir.file("u.bin"), b);
    std::vector<float> back;
    ModelFileInfo info = read_model_file(dir.file("u.bin"), &back);
    EXPECT_EQ(info.config.padded_vocab_size, 67);
    EXPECT_EQ(back, p);
    // The same header with the padded size's data length is rejected: the length decides.
    std::vector<char> padded = read_bytes(dir.file("u.bin"));
    padded.insert(padded.end() - 0, size_t(128 - 67) * 32 * 4, 0);
    write_bytes(dir.file("p.bin"), padded);
    expect_error([&] { read_model_file(dir.file("p.bin"), &back); }, kExitData, {"p.bin", "Vp=67", "trailing"});
}

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
