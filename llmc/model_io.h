/*
One entry point for every model format, for both trainers and the converter: a file is an llm.c model
file (model_file.h), a directory a Hugging Face folder (hf_model.h).
    ModelInfo info = probe_model(path);                   // shape, format, dtype; no weights read
    std::vector<float> p = load_model_params(path, info); // fp32, param_tensors() order, Vp rows
    save_model(out, ModelFormat::Hf, info.config, p.data(), SaveOptions{".deps/gpt2"});
probe_model() validates all it can without the weights, so a trainer checks the shape before allocating;
load_model_params() refuses NaN or infinity. Save formats: llmc (fp32), llmc-bf16, hf (F32), hf-bf16.
Errors name the path: kExitIo for the path, kExitData for contents, kExitUsage for a bad format name.
*/
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/gpt2_config.h"
#include "llmc/hf_model.h"
#include "llmc/model_file.h"
#include "llmc/utils.h"

namespace llmc {

enum class ModelFormat { Llmc, LlmcBf16, Hf, HfBf16 };

// By ModelFormat: its name, and where it goes in an output directory.
constexpr const char* kModelFormatNames[][2] = {
    {"llmc", "model.bin"}, {"llmc-bf16", "model_bf16.bin"}, {"hf", "hf"}, {"hf-bf16", "hf_bf16"}};

inline const char* model_format_name(ModelFormat f) { return kModelFormatNames[int(f)][0]; }

inline ModelFormat parse_model_format(const std::string& name) {
    for (int f = 0; f < 4; f++) {
        if (name == kModelFormatNames[f][0]) return ModelFormat(f);
    }
    fail(kExitUsage, "unknown model format '%s' (expected llmc, llmc-bf16, hf or hf-bf16)", name.c_str());
}

inline bool is_hf_format(ModelFormat f) { return f == ModelFormat::Hf || f == ModelFormat::HfBf16; }

struct ModelInfo {
    std::string path;
    GPT2Config config;
    bool hf = false;       // a Hugging Face folder; else an llm.c model file
    int llmc_version = 0;  // 3 or 5 for an llm.c file
    std::string dtype;     // how the weights are stored: "fp32", "bf16", "fp16" or "mixed (...)"
    HfFolder folder;       // for a Hugging Face folder: its files and where each tensor is

    std::string describe() const {
        return hf ? format("Hugging Face folder '%s' (%s, %zu safetensors file%s)", path.c_str(), dtype.c_str(),
                           folder.files.size(), folder.files.size() == 1 ? "" : "s")
                  : format("llm.c model file '%s' (version %d, %s)", path.c_str(), llmc_version, dtype.c_str());
    }
};

// True unless nothing is at path, so that a trainer tells a path from a descriptor such as "d12" and hands
// whatever is there, even what cannot be read (a FIFO, a link loop), to probe_model(), which says why.
inline bool model_path_exists(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 || errno != ENOENT;
}

inline ModelInfo probe_model(const std::string& path) {
    if (directory_exists(path)) {
        HfFolder folder = probe_hf_folder(path);
        return {path, folder.config, true, 0, folder.dtype, folder};
    }
    if (!hf_file_present(path, "an llm.c model file or a Hugging Face folder")) {
        fail(kExitIo, "model '%s' does not exist (expected an llm.c model file or a Hugging Face folder)",
             path.c_str());
    }
    File f(path, File::Mode::Read);
    const ModelFileInfo m = read_model_header(f);
    return {path, m.config, false, m.version, m.version == kModelVersionFp32 ? "fp32" : "bf16", {}};
}

// Refuses parameters holding NaN or infinity, naming the first such tensor and how many (a model loaded
// with them trains to nan from the first step).
inline void check_params_finite(const ModelInfo& info, const float* params) {
    auto non_finite = [params](int64_t i) {
        uint32_t bits;  // by the bits, so that no floating-point flag can assume the test away
        std::memcpy(&bits, &params[i], sizeof(bits));
        return (bits & 0x7f800000u) == 0x7f800000u;
    };
    auto count = [&](int64_t begin, int64_t end) {
        int64_t k = 0;
#pragma omp parallel for reduction(+ : k)
        for (int64_t i = begin; i < end; i++) k += non_finite(i);
        return k;
    };
    const int64_t total = count(0, num_parameters(info.config));
    if (total == 0) return;
    std::string where;
    if (info.hf) {
        for (const HfTensorMap& m : hf_tensor_map(info.config)) {
            const int64_t k = count(m.offset, m.offset + m.numel);
            if (k == 0) continue;
            const auto& [file, name] = info.folder.where.at(m.name);
            where = format(": %lld in tensor '%s' of '%s'", (long long)k, name.c_str(),
                           info.folder.files[file].c_str());
            break;
        }
    } else {
        for (const ParamTensorInfo& t : param_tensors(info.config)) {
            const int64_t k = count(t.offset, t.offset + t.numel);
            if (k == 0) continue;
            int64_t first = t.offset;
            while (!non_finite(first)) first++;
            where = format(": %lld in tensor %s, the first at offset %lld", (long long)k, t.name,
                           (long long)(kModelHeaderBytes + first * model_bytes_per_param(info.llmc_version)));
            break;
        }
    }
    fail(kExitData, "%s '%s': %lld parameter%s not finite (NaN or infinity)%s; a model with non-finite parameters "
         "can be neither trained nor converted", info.hf ? "Hugging Face model" : "model file", info.path.c_str(),
         (long long)total, total == 1 ? " is" : "s are", where.c_str());
}

// The parameters of the model probe_model(path) described: fp32, in param_tensors() order, with the
// padded vocabulary rows zero; refused where any is not finite (check_params_finite).
inline std::vector<float> load_model_params(const std::string& path, const ModelInfo& info,
                                            const ModelIoProgress& progress = nullptr) {
    std::vector<float> params;
    if (info.hf) {
        if (!directory_exists(path)) fail(kExitIo, "Hugging Face model '%s' is no longer a directory", path.c_str());
        HfFolder now = probe_hf_folder(path);
        if (now.config != info.config || now.files != info.folder.files || now.where != info.folder.where) {
            fail(kExitData, "Hugging Face model '%s' changed since it was first read (now %s, was %s)", path.c_str(),
                 describe(now.config).c_str(), describe(info.config).c_str());
        }
        params.assign(size_t(num_parameters(now.config)), 0.0f);
        read_hf_params(now, params.data(), progress);
    } else {
        read_model_file(path, &params, &info.config);
    }
    check_params_finite(info, params.data());
    return params;
}

struct SaveOptions {
    std::string tokenizer_dir;  // Hugging Face formats: copy GPT-2's tokenizer from here ("" writes none)
    ModelIoProgress progress;
};

// The tokenizer a Hugging Face export copies: vocab_dir when it holds GPT-2's encoder.json and vocab.bpe
// for vocab_size tokens, else "" with *note saying why (the export then goes without tokenizer files).
inline std::string tokenizer_for_export(const std::string& vocab_dir, int vocab_size, std::string* note) {
    note->clear();
    const bool encoder = regular_file_exists(vocab_dir + "/encoder.json"), merges = regular_file_exists(vocab_dir + "/vocab.bpe");
    if (!encoder && !merges) return "";
    if (!encoder || !merges) {
        *note = format("'%s' has %s but not %s: the Hugging Face export gets no tokenizer files", vocab_dir.c_str(),
                       encoder ? "encoder.json" : "vocab.bpe", encoder ? "vocab.bpe" : "encoder.json");
        return "";
    }
    const nlohmann::json e = read_json_file(vocab_dir + "/encoder.json");
    const int64_t n = e.is_object() ? int64_t(e.size()) : 0;
    if (n != vocab_size) {
        *note = format("'%s/encoder.json' has %lld tokens, the model's vocabulary %d: the Hugging Face export gets "
                       "no tokenizer files", vocab_dir.c_str(), (long long)n, vocab_size);
        return "";
    }
    return vocab_dir;
}

// Writes params (num_parameters(c) floats, param_tensors() order) as `format` at path: a file for the
// llm.c formats, a directory (created if missing) for the Hugging Face ones.
inline void save_model(const std::string& path, ModelFormat fmt, const GPT2Config& c, const float* params,
                       const SaveOptions& options = {}) {
    if (is_hf_format(fmt)) {
        write_hf_folder(path, c, params, fmt == ModelFormat::HfBf16, options.tokenizer_dir, options.progress);
        return;
    }
    if (directory_exists(path)) {
        fail(kExitIo, "cannot write an llm.c model file to '%s': it is a directory (name a file, e.g. %s/model.bin)",
             path.c_str(), path.c_str());
    }
    write_model_file(path, c, params, fmt == ModelFormat::Llmc ? kModelVersionFp32 : kModelVersionBf16);
}

// A list of formats: "llmc,hf" -> formats; "none" (or "0") -> none; "1" -> llmc, as the flag once was a switch.
inline std::vector<ModelFormat> parse_save_formats(const std::string& list) {
    std::vector<ModelFormat> formats;
    if (list == "none" || list == "0" || list.empty()) return formats;
    if (list == "1") return {ModelFormat::Llmc};
    for (const std::string& name : split(list, ',')) {
        const ModelFormat f = parse_model_format(name);
        if (std::find(formats.begin(), formats.end(), f) == formats.end()) formats.push_back(f);
    }
    return formats;
}

// Where a format goes in the output directory.
inline std::string saved_model_path(const std::string& dir, ModelFormat f) {
    return dir + "/" + kModelFormatNames[int(f)][1];
}

}  // namespace llmc
