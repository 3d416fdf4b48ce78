/*
Hugging Face GPT-2 folders (config.json + safetensors, as GPT2LMHeadModel saves them), read into and
written from our flat fp32 parameter array.
Reading: config.json must describe a model ours computes exactly (gpt2, gelu_new, eps 1e-5, n_inner 4C,
tied embeddings, ...), else the key and value are named. Weights from model.safetensors or the index's
shards, F32/F16/BF16, with or without "transformer."; GPT-2's mask buffers are ignored, lm_head must
equal wte, any other tensor is refused. Conv1D (in, out) weights are transposed; the vocabulary is
padded to Vp with zero rows.
Writing: config.json, model.safetensors (F32 or BF16, no lm_head) and optionally the tokenizer files,
each whole or not at all. Errors name the folder, file and tensor or key (kExitData / kExitIo).
*/
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "llmc/gpt2_config.h"
#include "llmc/safetensors.h"
#include "llmc/utils.h"

namespace llmc {

constexpr const char* kHfPrefix = "transformer.";
constexpr int kGpt2EndOfText = 50256;

// Called as reading or writing moves along: bytes of parameters done, of total, and what was just done.
using ModelIoProgress = std::function<void(int64_t done, int64_t total, const std::string& what)>;

// One Hugging Face tensor and where it lives in our flat parameter array.
struct HfTensorMap {
    std::string name;            // without the "transformer." prefix
    int ours = 0;                // ParamTensor
    int layer = -1;              // -1 for tensors outside the blocks
    std::vector<int64_t> shape;  // Hugging Face's shape
    bool transposed = false;     // Conv1D weight: (in, out) there, (out, in) here
    int64_t offset = 0;          // first element in our flat array
    int64_t numel = 0;           // elements (wte: the V real rows only)
};

// Every tensor of the model, in our flat order (kind by kind, layer by layer inside a kind).
inline std::vector<HfTensorMap> hf_tensor_map(const GPT2Config& c) {
    // By ParamTensor; after "h.{l}." for layer tensors, the whole name otherwise.
    static const char* const names[kNumParamTensors] = {
        "wte.weight", "wpe.weight", "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
        "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
        "mlp.c_proj.weight", "mlp.c_proj.bias", "ln_f.weight", "ln_f.bias"};
    const auto tensors = param_tensors(c);
    std::vector<HfTensorMap> out;
    for (int k = 0; k < kNumParamTensors; k++) {
        const ParamTensorInfo& info = tensors[size_t(k)];
        if (k < kLn1w || k > kFcprojb) {  // outside the blocks; wte's V real rows only
            std::vector<int64_t> shape(info.shape, info.shape + info.ndim);
            if (k == kWte) shape[0] = c.vocab_size;
            const int64_t numel = shape.size() == 2 ? shape[0] * shape[1] : shape[0];
            out.push_back({names[k], k, -1, shape, false, info.offset, numel});
            continue;
        }
        // Ours lead with L; the 3-d ones are Conv1D weights, (out, in) here and (in, out) there.
        std::vector<int64_t> shape(info.shape + 1, info.shape + info.ndim);
        const bool transposed = info.ndim == 3;
        if (transposed) std::swap(shape[0], shape[1]);
        const int64_t per_layer = info.numel / c.num_layers;
        for (int l = 0; l < c.num_layers; l++) {
            out.push_back({format("h.%d.%s", l, names[k]), k, l, shape, transposed, info.offset + l * per_layer,
                           per_layer});
        }
    }
    return out;
}

// dst (rows x cols) = src (cols x rows) transposed, in tiles so both sides stay in cache.
inline void transpose_into(float* dst, const float* src, int64_t rows, int64_t cols) {
    const int64_t tile = 32;
#pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        for (int64_t c0 = 0; c0 < cols; c0 += tile) {
            for (int64_t r = r0; r < std::min(rows, r0 + tile); r++) {
                for (int64_t c = c0; c < std::min(cols, c0 + tile); c++) dst[r * cols + c] = src[c * rows + r];
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------------
// config.json

// The model shape a config.json describes, refusing what our model does not compute (`where`: the file).
inline GPT2Config hf_config_from_json(const nlohmann::json& j, const std::string& where) {
    auto bad = [&](const std::string& what) {
        fail(kExitData, "Hugging Face config '%s': %s", where.c_str(), what.c_str());
    };
    if (!j.is_object()) bad("not a JSON object");
    auto value_of = [&](const char* key) { return j.contains(key) ? json_excerpt(j[key]) : std::string("(absent)"); };
    if (!j.contains("model_type") || j["model_type"] != "gpt2") {
        bad(format("model_type is %s; only \"gpt2\" models can be read", value_of("model_type").c_str()));
    }
    auto required_int = [&](const char* key) {
        if (!j.contains(key)) bad(format("'%s' is missing", key));
        const nlohmann::json& v = j[key];
        if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (int64_t(1) << 30)) {
            bad(format("'%s' is %s, not a positive integer", key, json_excerpt(v).c_str()));
        }
        return int(v.get<int64_t>());
    };
    // Read in this order, which decides the error a config with several bad keys gets.
    const int L = required_int("n_layer"), NH = required_int("n_head"), C = required_int("n_embd"),
              T = required_int("n_positions"), V = required_int("vocab_size");
    const GPT2Config c{T, V, padded_vocab(V), L, NH, C};
    validate_config(c, kExitData, format("Hugging Face config '%s'", where.c_str()));

    // Keys absent from a config take transformers' defaults, which are what we compute.
    using Check = std::function<bool(const nlohmann::json&)>;
    auto refuse_unless = [&](const char* key, const Check& ok, const char* we_compute) {
        if (j.contains(key) && !ok(j[key])) {
            bad(format("%s is %s, but this program's GPT-2 computes %s", key, json_excerpt(j[key]).c_str(),
                       we_compute));
        }
    };
    auto is_bool = [](bool want) {
        return [want](const nlohmann::json& v) { return v.is_boolean() && v.get<bool>() == want; };
    };
    refuse_unless("activation_function",
                  [](const nlohmann::json& v) { return v == "gelu_new" || v == "gelu_pytorch_tanh"; },
                  "the tanh GELU (\"gelu_new\")");
    refuse_unless("layer_norm_epsilon",
                  [](const nlohmann::json& v) { return v.is_number() && std::fabs(v.get<double>() - 1e-5) <= 1e-12; },
                  "LayerNorm with epsilon 1e-5");
    refuse_unless("scale_attn_weights", is_bool(true), "attention scaled by 1/sqrt(head size)");
    refuse_unless("scale_attn_by_inverse_layer_idx", is_bool(false), "attention not scaled by the layer index");
    refuse_unless("add_cross_attention", is_bool(false), "no cross-attention");
    refuse_unless("tie_word_embeddings", is_bool(true), "an output layer tied to the token embedding (wte)");
    const int64_t width = 4 * int64_t(c.channels);
    refuse_unless("n_inner",
                  [width](const nlohmann::json& v) {
                      return v.is_null() || (v.is_number_integer() && v.get<int64_t>() == width);
                  },
                  "an MLP of width 4 x n_embd (n_inner null)");
    return c;
}

// The config.json of our model (unpadded vocabulary, no dropout); torch_dtype "float32" or "bfloat16".
inline nlohmann::json hf_config_json(const GPT2Config& c, const std::string& torch_dtype) {
    // GPT-2's <|endoftext|>, where the vocabulary has it; other vocabularies name no special token.
    const nlohmann::json eot = c.vocab_size > kGpt2EndOfText ? nlohmann::json(kGpt2EndOfText) : nlohmann::json();
    // The keys are sorted when written (nlohmann::json's objects are std::maps), whatever the order here.
    return {{"architectures", nlohmann::json::array({"GPT2LMHeadModel"})}, {"model_type", "gpt2"},
            {"n_layer", c.num_layers}, {"n_head", c.num_heads}, {"n_embd", c.channels},
            {"n_positions", c.max_seq_len}, {"n_ctx", c.max_seq_len}, {"n_inner", nullptr},
            {"vocab_size", c.vocab_size}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", 1e-5},
            {"initializer_range", 0.02}, {"attn_pdrop", 0.0}, {"embd_pdrop", 0.0}, {"resid_pdrop", 0.0},
            {"scale_attn_weights", true}, {"scale_attn_by_inverse_layer_idx", false},
            {"reorder_and_upcast_attn", false}, {"tie_word_embeddings", true}, {"use_cache", true},
            {"bos_token_id", eot}, {"eos_token_id", eot}, {"torch_dtype", torch_dtype}};
}

// ----------------------------------------------------------------------------------------------------
// Small file helpers (this header's own).

// False when nothing is at path, true for a regular file (or a link to one); anything else is refused
// with the system's reason and what was expected.
inline bool hf_file_present(const std::string& path, const char* expected) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 && errno == ENOENT) return false;
    const std::string why = why_not_regular_file(path);
    if (!why.empty()) fail(kExitIo, "'%s': %s (expected %s)", path.c_str(), why.c_str(), expected);
    return true;
}

inline nlohmann::json read_json_file(const std::string& path) {
    File f(path, File::Mode::Read);
    const int64_t size = f.size();
    if (size > (int64_t(1) << 30)) {
        fail(kExitData, "'%s' is %lld bytes, too large for a JSON file", path.c_str(), (long long)size);
    }
    std::string text(size_t(size), '\0');
    f.read_exact(text.data(), text.size());
    return parse_json_strictly(text, format("'%s'", path.c_str()), 0);
}

// Writes `bytes` to path whole or not at all (write_file_atomically), so a reader never sees half a file.
inline void write_file_replacing(const std::string& path, const std::string& bytes) {
    write_file_atomically(path, [&](File& f) { f.write_all(bytes.data(), bytes.size()); });
}

// ----------------------------------------------------------------------------------------------------
// Reading

struct HfFolder {
    GPT2Config config;
    std::vector<std::string> files;  // the safetensors files, as paths
    std::map<std::string, std::pair<size_t, std::string>> where;  // our HF name -> (file index, stored name)
    bool has_lm_head = false;  // lm_head.weight, in files[lm_head_file], which must equal wte
    size_t lm_head_file = 0;
    std::string dtype;  // "fp32", "bf16", "fp16", or "mixed (...)"
};

// The files of the sharded layout, from the index's weight_map (returned in *weight_map).
inline std::vector<std::string> hf_shard_files(const std::string& dir, const std::string& index_path,
                                               std::map<std::string, std::string>* weight_map) {
    nlohmann::json index = read_json_file(index_path);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
        fail(kExitData, "'%s' has no weight_map object (a sharded safetensors index maps tensor names to files)",
             index_path.c_str());
    }
    std::set<std::string> names;
    for (auto& [tensor, file] : index["weight_map"].items()) {
        if (!file.is_string()) {
            fail(kExitData, "'%s': weight_map entry for tensor '%s' is %s, not a file name", index_path.c_str(),
                 tensor.c_str(), json_excerpt(file).c_str());
        }
        const std::string f = file.get<std::string>();
        if (f.empty() || f.find('/') != std::string::npos) {
            fail(kExitData, "'%s': weight_map sends tensor '%s' to '%s', which is not a file in the folder",
                 index_path.c_str(), tensor.c_str(), f.c_str());
        }
        names.insert(f);
        (*weight_map)[tensor] = f;
    }
    if (names.empty()) fail(kExitData, "'%s': weight_map is empty", index_path.c_str());
    std::vector<std::string> files;
    for (const std::string& n : names) files.push_back(dir + "/" + n);
    return files;
}

// Validates a Hugging Face GPT-2 folder without reading its weights: config, headers, every tensor.
inline HfFolder probe_hf_folder(const std::string& dir) {
    HfFolder h;
    const std::string config_path = dir + "/config.json";
    if (!hf_file_present(config_path, "config.json, a JSON file")) {
        fail(kExitIo, "'%s' is a directory without config.json, so not a Hugging Face model folder (expected "
             "config.json and model.safetensors)", dir.c_str());
    }
    h.config = hf_config_from_json(read_json_file(config_path), config_path);

    const std::string single = dir + "/model.safetensors", index_path = dir + "/model.safetensors.index.json";
    std::string index_used;
    std::map<std::string, std::string> weight_map;
    if (hf_file_present(single, "a safetensors file")) {
        h.files = {single};
    } else if (hf_file_present(index_path, "a JSON file")) {
        h.files = hf_shard_files(dir, index_path, &weight_map);
        index_used = index_path;
    } else if (regular_file_exists(dir + "/pytorch_model.bin")) {
        fail(kExitData, "'%s' holds pytorch_model.bin, a Python pickle, which this program does not read; save the "
             "model as safetensors (transformers: save_pretrained(dir, safe_serialization=True))", dir.c_str());
    } else {
        fail(kExitIo, "'%s' has config.json but neither model.safetensors nor model.safetensors.index.json",
             dir.c_str());
    }

    // Every stored name -> the file holding it; a name in two shards is ambiguous.
    std::map<std::string, size_t> stored;
    std::vector<std::unique_ptr<SafetensorsFile>> files;
    for (size_t i = 0; i < h.files.size(); i++) {
        if (!hf_file_present(h.files[i], "a safetensors file")) {
            fail(kExitIo, "'%s' names the shard '%s', which does not exist", index_used.c_str(), h.files[i].c_str());
        }
        files.push_back(std::make_unique<SafetensorsFile>(h.files[i]));
        for (const SafetensorsTensor& t : files.back()->tensors()) {
            auto [it, inserted] = stored.emplace(t.name, i);
            if (!inserted) {
                fail(kExitData, "Hugging Face model '%s': tensor '%s' is in both '%s' and '%s'", dir.c_str(),
                     t.name.c_str(), h.files[it->second].c_str(), h.files[i].c_str());
            }
        }
    }
    for (const auto& [tensor, file] : weight_map) {
        auto it = stored.find(tensor);
        if (it == stored.end() || h.files[it->second] != dir + "/" + file) {
            fail(kExitData, "'%s' puts tensor '%s' in '%s', but that file does not hold it", index_used.c_str(),
                 tensor.c_str(), file.c_str());
        }
    }

    std::set<std::string> used, dtypes;
    const std::string files_named = h.files.size() == 1 ? "'" + h.files[0] + "'" : "the shards of '" + index_used + "'";
    for (const HfTensorMap& m : hf_tensor_map(h.config)) {
        const std::string prefixed = kHfPrefix + m.name;
        const bool with = stored.count(prefixed) > 0, without = stored.count(m.name) > 0;
        if (with && without) {
            fail(kExitData, "Hugging Face model '%s' holds both '%s' and '%s'; which one is the model's is ambiguous",
                 dir.c_str(), prefixed.c_str(), m.name.c_str());
        }
        // A serializer that keeps one name of tied tensors may keep the head's: then it holds the embedding.
        const bool head_only = !with && !without && m.ours == kWte && stored.count("lm_head.weight") > 0;
        if (!with && !without && !head_only) {
            fail(kExitData, "Hugging Face model '%s': tensor '%s' (or '%s') is missing from %s", dir.c_str(),
                 prefixed.c_str(), m.name.c_str(), files_named.c_str());
        }
        const std::string name = with ? prefixed : without ? m.name : "lm_head.weight";
        const size_t fi = stored[name];
        const SafetensorsTensor& t = files[fi]->require(name);
        if (!safetensors_float_dtype(t.dtype)) {
            fail(kExitData, "'%s': tensor '%s' has dtype %s; GPT-2 weights must be F32, F16 or BF16",
                 h.files[fi].c_str(), name.c_str(), t.dtype.c_str());
        }
        if (t.shape != m.shape) {
            fail(kExitData, "'%s': tensor '%s' has shape %s, but config.json's model needs %s%s", h.files[fi].c_str(),
                 name.c_str(), t.shape_string().c_str(), SafetensorsTensor{"", "", m.shape}.shape_string().c_str(),
                 m.transposed ? " (Conv1D layout: in, out)" : "");
        }
        h.where[m.name] = {fi, name};
        used.insert(name);
        dtypes.insert(t.dtype);
    }
    if (auto it = stored.find("lm_head.weight"); it != stored.end() && used.count(it->first) == 0) {
        const SafetensorsTensor& t = files[it->second]->require(it->first);
        const std::vector<int64_t> wte_shape = {h.config.vocab_size, h.config.channels};
        if (t.shape != wte_shape || !safetensors_float_dtype(t.dtype)) {
            fail(kExitData, "'%s': tensor 'lm_head.weight' (%s %s) is not an output layer of wte's shape; this "
                 "program's GPT-2 ties its output layer to wte", h.files[it->second].c_str(), t.dtype.c_str(),
                 t.shape_string().c_str());
        }
        h.has_lm_head = true;
        h.lm_head_file = it->second;
        used.insert(it->first);
    }
    // What is left must be one of the attention-mask buffers older transformers saved.
    for (const auto& [name, fi] : stored) {
        if (used.count(name)) continue;
        std::string n = name.rfind(kHfPrefix, 0) == 0 ? name.substr(std::strlen(kHfPrefix)) : name;
        int layer = -1, consumed = 0;
        char kind[16] = {0};
        bool buffer = std::sscanf(n.c_str(), "h.%d.attn.%15[a-z_]%n", &layer, kind, &consumed) == 2 &&
                      consumed == int(n.size()) && layer >= 0 && layer < h.config.num_layers &&
                      (std::strcmp(kind, "bias") == 0 || std::strcmp(kind, "masked_bias") == 0);
        if (!buffer) {
            fail(kExitData, "'%s': tensor '%s' is not part of a GPT-2 model of config.json's shape (%s); refusing to "
                 "drop it", h.files[fi].c_str(), name.c_str(), describe(h.config).c_str());
        }
    }
    std::string names;
    for (const std::string& d : dtypes) {
        names += (names.empty() ? "" : ", ") + std::string(d == "F32" ? "fp32" : d == "BF16" ? "bf16" : "fp16");
    }
    h.dtype = dtypes.size() == 1 ? names : "mixed (" + names + ")";
    return h;
}

// Reads the folder probe_hf_folder() described into params (num_parameters(h.config) floats, our order).
inline void read_hf_params(const HfFolder& h, float* params, const ModelIoProgress& progress = nullptr) {
    std::vector<std::unique_ptr<SafetensorsFile>> files;
    for (const std::string& f : h.files) files.push_back(std::make_unique<SafetensorsFile>(f));
    const GPT2Config& c = h.config;
    const int64_t C = c.channels;
    // Tensor `name` of file fi, which must still have the shape the probe saw.
    auto reopen = [&](size_t fi, const std::string& name, const std::vector<int64_t>& shape) {
        const SafetensorsTensor* t = files[fi]->find(name);
        if (t == nullptr || t->shape != shape) {
            fail(kExitData, "'%s': tensor '%s' changed since the folder was checked", h.files[fi].c_str(),
                 name.c_str());
        }
        return t;
    };
    const std::vector<HfTensorMap> map = hf_tensor_map(c);
    int64_t total = 0, done = 0;
    for (const HfTensorMap& m : map) total += m.numel * int64_t(sizeof(float));
    std::vector<float> scratch;
    for (const HfTensorMap& m : map) {
        const auto& [fi, name] = h.where.at(m.name);
        const SafetensorsTensor* t = reopen(fi, name, m.shape);
        if (m.transposed) {
            scratch.resize(size_t(m.numel));
            files[fi]->read_floats(*t, scratch.data());
            transpose_into(params + m.offset, scratch.data(), m.shape[1], m.shape[0]);
        } else {
            files[fi]->read_floats(*t, params + m.offset);
        }
        done += m.numel * int64_t(sizeof(float));
        if (progress) progress(done, total, name);
    }
    float* wte = params + param_tensors(c)[kWte].offset;
    std::fill(wte + int64_t(c.vocab_size) * C, wte + int64_t(c.padded_vocab_size) * C, 0.0f);
    if (!h.has_lm_head) return;

    const SafetensorsTensor* head = reopen(h.lm_head_file, "lm_head.weight", {c.vocab_size, C});
    scratch.resize(size_t(head->numel));
    files[h.lm_head_file]->read_floats(*head, scratch.data());
    const auto diff = std::mismatch(scratch.begin(), scratch.end(), wte,
                                    [](float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; });
    if (diff.first != scratch.end()) {
        const int64_t i = diff.second - wte;
        fail(kExitData,
             "'%s': lm_head.weight differs from wte at row %lld, column %lld (%g vs %g): the output layer is not tied "
             "to the token embedding, which this program's GPT-2 requires", h.files[h.lm_head_file].c_str(),
             (long long)(i / C), (long long)(i % C), double(*diff.first), double(*diff.second));
    }
}

// ----------------------------------------------------------------------------------------------------
// Writing

// Checks that dir holds GPT-2's tokenizer files (encoder.json, vocab.bpe) for a vocabulary of V tokens.
inline void check_tokenizer_dir(const std::string& dir, int vocab_size) {
    for (const char* name : {"encoder.json", "vocab.bpe"}) {
        if (!regular_file_exists(dir + "/" + name)) {
            fail(kExitIo, "tokenizer directory '%s' has no %s (GPT-2's encoder.json and vocab.bpe are expected there)",
                 dir.c_str(), name);
        }
    }
    nlohmann::json encoder = read_json_file(dir + "/encoder.json");
    if (!encoder.is_object() || int64_t(encoder.size()) != vocab_size) {
        fail(kExitUsage, "tokenizer '%s/encoder.json' has %lld tokens but the model's vocabulary is %d; the tokenizer "
             "does not belong to this model", dir.c_str(), (long long)(encoder.is_object() ? encoder.size() : 0),
             vocab_size);
    }
}

// Writes our model as a Hugging Face folder at dir (created if missing): config.json, model.safetensors
// (F32, or BF16 when bf16), and the tokenizer files when tokenizer_dir is not empty.
inline void write_hf_folder(const std::string& dir, const GPT2Config& c, const float* params, bool bf16,
                            const std::string& tokenizer_dir = "", const ModelIoProgress& progress = nullptr) {
    validate_config(c, kExitUsage, format("Hugging Face model '%s': cannot write an invalid shape", dir.c_str()));
    if (!tokenizer_dir.empty()) check_tokenizer_dir(tokenizer_dir, c.vocab_size);
    std::error_code ec;
    if (std::filesystem::exists(dir, ec) && !directory_exists(dir)) {
        fail(kExitIo, "'%s' exists and is not a directory; a Hugging Face model is written as a folder", dir.c_str());
    }
    std::filesystem::create_directories(dir, ec);
    if (ec) fail(kExitIo, "cannot create directory '%s': %s", dir.c_str(), ec.message().c_str());
    if (regular_file_exists(dir + "/model.safetensors.index.json")) {
        fail(kExitIo, "'%s' holds a sharded model (model.safetensors.index.json) that a new model.safetensors would "
             "not replace; write into an empty directory", dir.c_str());
    }

    // Layer by layer, as save_pretrained orders them; the data section follows the declaration order.
    // wte and wpe (layer -1), then the layers, then ln_f; within each, in hf_tensor_map's order.
    std::vector<HfTensorMap> order = hf_tensor_map(c);
    auto place = [&](const HfTensorMap& m) { return m.ours == kLnfw || m.ours == kLnfb ? c.num_layers : m.layer; };
    std::stable_sort(order.begin(), order.end(), [&](const auto& a, const auto& b) { return place(a) < place(b); });
    std::vector<SafetensorsSpec> specs;
    int64_t total = 0, done = 0;
    for (const HfTensorMap& m : order) {
        specs.push_back({kHfPrefix + m.name, bf16 ? "BF16" : "F32", m.shape});
        total += m.numel * int64_t(bf16 ? 2 : 4);
    }
    // Through model.safetensors.tmp, synced and renamed: a failed or interrupted export keeps the old file.
    write_file_atomically(dir + "/model.safetensors", [&](File& f) {
        SafetensorsWriter w(f, specs);
        std::vector<float> scratch;
        for (const HfTensorMap& m : order) {
            if (m.transposed) {
                scratch.resize(size_t(m.numel));
                transpose_into(scratch.data(), params + m.offset, m.shape[0], m.shape[1]);
                w.write(scratch.data(), m.numel);
            } else {
                w.write(params + m.offset, m.numel);
            }
            done += m.numel * int64_t(bf16 ? 2 : 4);
            if (progress) progress(done, total, kHfPrefix + m.name);
        }
        w.finish();
    });
    write_file_replacing(dir + "/config.json", hf_config_json(c, bf16 ? "bfloat16" : "float32").dump(2) + "\n");

    if (!tokenizer_dir.empty()) {
        write_file_replacing(dir + "/vocab.json", read_text_file(tokenizer_dir + "/encoder.json"));
        write_file_replacing(dir + "/merges.txt", read_text_file(tokenizer_dir + "/vocab.bpe"));
        const nlohmann::json tc = {{"tokenizer_class", "GPT2Tokenizer"}, {"model_max_length", c.max_seq_len},
                                   {"bos_token", "<|endoftext|>"}, {"eos_token", "<|endoftext|>"},
                                   {"unk_token", "<|endoftext|>"}, {"add_prefix_space", false}, {"errors", "replace"}};
        write_file_replacing(dir + "/tokenizer_config.json", tc.dump(2) + "\n");
    } else {
        // No tokenizer: an earlier export's files there would be loaded with these weights, so they go.
        for (const char* name : {"vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json",
                                 "special_tokens_map.json"}) {
            const std::string path = dir + "/" + name;
            if (regular_file_exists(path) && !std::filesystem::remove(path, ec)) {
                fail(kExitIo, "cannot remove the earlier tokenizer file '%s': %s", path.c_str(), ec.message().c_str());
            }
        }
    }
}

}  // namespace llmc
