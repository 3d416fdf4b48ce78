/*
Runs the CPU reference GPT-2 on a given model file and batches and dumps what it computed, for the
comparison with PyTorch (test/oracles/gpt2_torch_ref.py, driven by test/test_gpt2_vs_torch.sh).

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
#include <string>
#include <vector>

#include "cpu/gpt2_cpu.h"
#include "llmc/flags.h"
#include "llmc/gpt2_config.h"
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
    // Whole or not at all: a failed write keeps an earlier dump as it was.
    write_file_atomically(o.out, [&](File& f) { f.write_all(out.data(), out.size() * sizeof(double)); });
    std::printf("%s: %s, %d steps, losses %.6f -> %.6f\n", o.fp64 ? "fp64" : "fp32", describe(c).c_str(), o.steps,
                losses.front(), losses.back());
}

// Returns false when --help was given (the usage has then been printed).
bool parse(int argc, char** argv, Options& o) {
    Flags flags("gpt2_cpu_dump",
                "Runs the CPU reference GPT-2 on a model file and batches and dumps what it computed (float64).");
    flags.add("", "model", &o.model, "the model file to load (llm.c's .bin, fp32 or bf16)")
        .add("", "tokens", &o.tokens, "batches to run: int32 B, T, count, then per batch B*T inputs and B*T targets")
        .add("", "out", &o.out, "where the float64 results go (needed with --tokens)")
        .add_switch("", "fp64", &o.fp64, "run the model in double precision")
        .add("", "steps", &o.steps, "AdamW updates (the tokens file needs steps + 1 batches)", 0, 4095)
        .add("", "lr", &o.adamw.learning_rate, "AdamW learning rate")
        .add("", "beta1", &o.adamw.beta1, "AdamW beta1")
        .add("", "beta2", &o.adamw.beta2, "AdamW beta2")
        .add("", "eps", &o.adamw.eps, "AdamW epsilon")
        .add("", "wd", &o.adamw.weight_decay, "AdamW weight decay")
        .add("", "clip", &o.clip, "clip gradients to this global norm")
        .add("", "write-model", &o.write_model, "also write the parameters as loaded (before any step) here")
        .add("", "write-version", &o.write_version, "the version --write-model writes: 3 (fp32) or 5 (bf16)", 3, 5);
    if (!flags.parse(argc, argv)) return false;
    if (o.model.empty()) fail(kExitUsage, "--model FILE is needed (see gpt2_cpu_dump --help)");
    if (o.tokens.empty() != o.out.empty()) fail(kExitUsage, "--tokens and --out go together (see gpt2_cpu_dump --help)");
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        if (!parse(argc, argv, o)) return 0;
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
