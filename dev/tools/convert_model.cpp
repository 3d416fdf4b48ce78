/*
convert_model: converts a GPT-2 model between llm.c model files and Hugging Face folders, any way round.

    convert_model -i gpt2_124M.bin -o gpt2_hf -f hf --tokenizer-dir .deps/gpt2
    convert_model -i gpt2_hf -o gpt2_124M_bf16.bin -f llmc-bf16

Input: an llm.c model file (version 3 fp32 or 5 bf16) or a Hugging Face GPT-2 folder (config.json and
model.safetensors or sharded safetensors; F32, F16 or BF16), told apart by whether the path is a file
or a directory (llmc/model_io.h). Output formats: llmc (version 3, fp32), llmc-bf16 (version 5), hf
(F32 safetensors), hf-bf16 (BF16 safetensors); without -f, a name ending in .bin is llmc, anything else
hf. With --tokenizer-dir, a Hugging Face output also gets GPT-2's tokenizer files (vocab.json and
merges.txt copied from encoder.json and vocab.bpe, and tokenizer_config.json). Converting to a format
of lower precision rounds (bf16: to nearest even); fp32 -> fp32 and bf16 -> bf16 are exact, so llm.c
file -> folder -> llm.c file reproduces the file byte for byte when its Vp is V rounded up to 128, as
llm.c and our trainers write it (a folder holds V only, and is read back with that Vp).

Prints what it read and wrote; for models above 50M parameters, progress lines every 10%. Errors are
one line naming the file and tensor, with utils.h's exit codes (2 usage, 3 files, 4 contents).

Does not: change the shape, vocabulary or padding (Hugging Face inputs get Vp = V rounded up to 128),
shard its Hugging Face output, or read pytorch_model.bin pickles.
*/
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "llmc/flags.h"
#include "llmc/model_io.h"
#include "llmc/utils.h"

using namespace llmc;

namespace {

struct Options {
    std::string input, output, format, tokenizer_dir;
    bool quiet = false;
};

bool parse_args(int argc, char** argv, Options& o) {
    Flags flags("convert_model",
                "Converts a GPT-2 model between llm.c model files (.bin, version 3 fp32 / 5 bf16) and Hugging Face "
                "folders (config.json + safetensors).");
    flags.add("i", "input", &o.input, "model to read: an llm.c model file or a Hugging Face folder")
        .add("o", "output", &o.output, "where to write: a file (llmc formats) or a folder (hf formats)")
        .add("f", "format", &o.format,
             "output format: llmc, llmc-bf16, hf or hf-bf16 (default: llmc for a name ending .bin, else hf)")
        .add("", "tokenizer-dir", &o.tokenizer_dir,
             "hf formats: also write GPT-2's tokenizer, from this folder's encoder.json and vocab.bpe "
             "(e.g. .deps/gpt2)")
        .add_switch("q", "quiet", &o.quiet, "print errors only");
    if (!flags.parse(argc, argv)) return false;
    if (o.input.empty()) fail(kExitUsage, "no input model: give -i PATH (see convert_model --help)");
    if (o.output.empty()) fail(kExitUsage, "no output: give -o PATH (see convert_model --help)");
    return true;
}

ModelFormat output_format(const Options& o) {
    if (!o.format.empty()) return parse_model_format(o.format);
    const std::string& out = o.output;
    return out.size() > 4 && out.compare(out.size() - 4, 4, ".bin") == 0 ? ModelFormat::Llmc : ModelFormat::Hf;
}

// Prints "<verb> 10% (tensor)" lines as a big model's bytes pass each tenth; silent for small models.
ModelIoProgress progress_printer(const char* verb, int64_t num_params, bool quiet) {
    if (quiet || num_params <= 50'000'000) return nullptr;
    auto next = std::make_shared<int>(1);
    return [verb, next](int64_t done, int64_t total, const std::string& what) {
        while (*next <= 10 && done * 10 >= total * *next) {
            std::printf("  %s %3d%% (%s)\n", verb, *next * 10, what.c_str());
            std::fflush(stdout);
            ++*next;
        }
    };
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int convert(const Options& o) {
    const ModelFormat fmt = output_format(o);
    if (!o.tokenizer_dir.empty() && !is_hf_format(fmt)) {
        fail(kExitUsage, "--tokenizer-dir applies to the hf formats only; %s has no tokenizer files",
             model_format_name(fmt));
    }
    auto t0 = std::chrono::steady_clock::now();
    ModelInfo info = probe_model(o.input);
    const int64_t n = num_parameters(info.config);
    if (!o.quiet) {
        std::printf("input: %s\nshape: %s, %lld parameters\n", info.describe().c_str(), describe(info.config).c_str(),
                    (long long)n);
        std::fflush(stdout);
    }
    std::vector<float> params = load_model_params(o.input, info, progress_printer("read", n, o.quiet));
    const double read_s = seconds_since(t0);

    auto t1 = std::chrono::steady_clock::now();
    SaveOptions save;
    save.tokenizer_dir = o.tokenizer_dir;
    save.progress = progress_printer("wrote", n, o.quiet);
    save_model(o.output, fmt, info.config, params.data(), save);
    if (!o.quiet) {
        std::printf("output: %s as %s (read %.1f s, written %.1f s)\n", o.output.c_str(), model_format_name(fmt),
                    read_s, seconds_since(t1));
        if (is_hf_format(fmt) && o.tokenizer_dir.empty()) {
            std::printf("note: no tokenizer files written (give --tokenizer-dir with GPT-2's encoder.json and "
                        "vocab.bpe, e.g. .deps/gpt2)\n");
        }
    }
    return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        return parse_args(argc, argv, o) ? convert(o) : kExitOk;
    });
}
