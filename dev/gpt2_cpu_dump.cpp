/*
Runs the CPU reference GPT-2 on a given model file and batches and dumps what it computed, for the
comparison with PyTorch (test/gpt2_torch_ref.py, driven by test/test_gpt2_vs_torch.sh).

    gpt2_cpu_dump --model M.bin [--tokens TOK --out OUT.bin [--fp64] [--steps 10] [--lr ...] ...]
                  [--write-model W.bin --write-version 3|5]

TOK holds int32 values: B, T, the number of batches (at least steps + 1), then per batch B*T inputs
and B*T targets. OUT receives float64 values, in this order:
    the loss of batch 0, its logits (B*T*Vp), the gradient of every parameter (file order),
    the losses of batches 0..steps (one AdamW update after each but the last), the global gradient
    norms before clipping of batches 0..steps-1.
--write-model writes the parameters as loaded (before any step), so the writer can be compared with
the file it read or converted to the other precision.

Does not provide: a training loop for real use (train_gpt2 is that).
*/
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "llmc/gpt2_config.h"
#include "llmc/gpt2_cpu.h"
#include "llmc/model_file.h"
#include "llmc/utils.h"

using namespace llmc;

namespace {

struct Options {
    std::string model, tokens, out, write_model;
    int write_version = kModelVersionFp32;
    bool fp64 = false;
    int steps = 10;
    cpu::AdamW adamw{1e-3, 0.9, 0.95, 1e-8, 0.1};
    double clip = 1.0;
};

struct Batches {
    int B = 0, T = 0, count = 0;
    std::vector<int32_t> data;  // count x (inputs, targets), each B*T
    const int* inputs(int i) const { return data.data() + size_t(i) * 2 * B * T; }
    const int* targets(int i) const { return inputs(i) + size_t(B) * T; }
};

Batches read_batches(const std::string& path) {
    File f(path, File::Mode::Read);
    int32_t h[3];
    f.read_exact(h, sizeof(h));
    Batches b;
    b.B = h[0];
    b.T = h[1];
    b.count = h[2];
    if (b.B < 1 || b.T < 1 || b.count < 1 || int64_t(b.B) * b.T > (1 << 24) || b.count > 4096) {
        fail(kExitData, "tokens file '%s': header B=%d T=%d batches=%d is not sensible", path.c_str(), b.B, b.T, b.count);
    }
    int64_t n = int64_t(b.count) * 2 * b.B * b.T;
    if (f.size() != 12 + 4 * n) {
        fail(kExitData, "tokens file '%s' is %lld bytes, its header needs %lld", path.c_str(), (long long)f.size(),
             (long long)(12 + 4 * n));
    }
    b.data.resize(size_t(n));
    f.read_exact(b.data.data(), size_t(n) * 4);
    return b;
}

template <class Real>
void run(const Options& o, const GPT2Config& c, const std::vector<float>& params) {
    Batches batches = read_batches(o.tokens);
    if (batches.count < o.steps + 1) {
        fail(kExitUsage, "tokens file '%s' has %d batches, --steps %d needs %d", o.tokens.c_str(), batches.count,
             o.steps, o.steps + 1);
    }
    cpu::GPT2<Real> model(c, params);
    std::vector<double> out;
    auto append = [&out](const auto& v) { out.insert(out.end(), v.begin(), v.end()); };
    std::vector<double> losses, norms;
    for (int step = 0; step <= o.steps; step++) {
        double loss = model.forward(batches.inputs(step), batches.targets(step), batches.B, batches.T);
        losses.push_back(loss);
        if (step == o.steps) break;
        model.zero_grad();
        model.backward();
        if (step == 0) {
            out.push_back(loss);
            append(model.activations().logits);
            append(model.grads);
        }
        double norm = model.grad_norm();
        norms.push_back(norm);
        model.update(o.adamw, step + 1, cpu::clip_scale(norm, o.clip));
    }
    append(losses);
    append(norms);
    File f(o.out, File::Mode::Write);
    f.write_all(out.data(), out.size() * sizeof(double));
    f.close();
    std::printf("%s: %s, %d steps, losses %.6f -> %.6f\n", o.fp64 ? "fp64" : "fp32", describe(c).c_str(), o.steps,
                losses.front(), losses.back());
}

const char* kUsage =
    "usage: gpt2_cpu_dump --model M.bin [--tokens TOK --out OUT.bin] [--fp64] [--steps N] [--lr X] [--beta1 X]\n"
    "                     [--beta2 X] [--eps X] [--wd X] [--clip X] [--write-model W.bin --write-version 3|5]\n";

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; i++) {
        std::string flag = argv[i];
        if (flag == "--fp64") {
            o.fp64 = true;
            continue;
        }
        if (i + 1 >= argc) fail(kExitUsage, "%s needs a value\n%s", flag.c_str(), kUsage);
        const char* v = argv[++i];
        if (flag == "--model") o.model = v;
        else if (flag == "--tokens") o.tokens = v;
        else if (flag == "--out") o.out = v;
        else if (flag == "--write-model") o.write_model = v;
        else if (flag == "--write-version") o.write_version = std::atoi(v);
        else if (flag == "--steps") o.steps = std::atoi(v);
        else if (flag == "--lr") o.adamw.learning_rate = std::strtod(v, nullptr);
        else if (flag == "--beta1") o.adamw.beta1 = std::strtod(v, nullptr);
        else if (flag == "--beta2") o.adamw.beta2 = std::strtod(v, nullptr);
        else if (flag == "--eps") o.adamw.eps = std::strtod(v, nullptr);
        else if (flag == "--wd") o.adamw.weight_decay = std::strtod(v, nullptr);
        else if (flag == "--clip") o.clip = std::strtod(v, nullptr);
        else fail(kExitUsage, "unknown flag '%s'\n%s", flag.c_str(), kUsage);
    }
    if (o.model.empty() || o.tokens.empty() != o.out.empty() || o.steps < 0) fail(kExitUsage, "%s", kUsage);
    return o;
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options o = parse(argc, argv);
        std::vector<float> params;
        ModelFileInfo info = read_model_file(o.model, &params);
        if (!o.write_model.empty()) write_model_file(o.write_model, info.config, params.data(), o.write_version);
        if (!o.tokens.empty()) {
            if (o.fp64) {
                run<double>(o, info.config, params);
            } else {
                run<float>(o, info.config, params);
            }
        }
        return 0;
    });
}
