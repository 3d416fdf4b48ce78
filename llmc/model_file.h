/*
Model files in llm.c's layout, so that llm.c's files load here and ours load in llm.c: a header of 256
int32 (20240326, version 3 = fp32 or 5 = bf16, maxT, V, L, NH, C, Vp, zeros), then param_tensors()
back to back, row-major. A header[7] of 0 means unpadded (Vp = V, the file length decides); versions 1
and 2 are refused with a hint to re-export. The readers validate magic, version, shapes, length and
that wte's padded rows are zero, naming the file, offset and what was expected.
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "llmc/gpt2_config.h"
#include "llmc/llmc_header.h"
#include "llmc/utils.h"

namespace llmc {

constexpr int32_t kModelMagic = 20240326;
constexpr int kModelVersionFp32 = 3;
constexpr int kModelVersionBf16 = 5;
constexpr int kModelHeaderInts = kLlmcHeaderInts;
constexpr int64_t kModelHeaderBytes = kLlmcHeaderBytes;

inline int model_bytes_per_param(int version) {
    return version == kModelVersionFp32 ? 4 : version == kModelVersionBf16 ? 2 : 0;
}

// Round to nearest, ties to even; NaN stays NaN (made quiet, sign kept), overflow rounds to infinity.
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);
    uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t((bits + rounding) >> 16);
}

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

struct ModelFileInfo {
    GPT2Config config;
    int version = 0;
};

// The model file format for llmc_header.h's reader.
inline const LlmcFileSpec& model_file_spec() {
    static const LlmcFileSpec spec{
        "model file", "a model file", kModelMagic, {kModelVersionFp32, kModelVersionBf16}, "3 = fp32 or 5 = bf16",
        {{1, "is llm.c's old unpadded-vocabulary format; re-export it with a current train_gpt2.py (version 3 = fp32 "
             "or 5 = bf16)"},
         {2, "is llm.c's old unpadded-vocabulary format; re-export it with a current train_gpt2.py (version 3 = fp32 "
             "or 5 = bf16)"}}};
    return spec;
}

// Reads and validates the header of an open model file against its length.
inline ModelFileInfo read_model_header(File& f) {
    const LlmcHeader h = read_llmc_header(f, model_file_spec());
    const char* path = h.path.c_str();
    ModelFileInfo info;
    info.version = h.version();
    GPT2Config& c = info.config;
    c.max_seq_len = h.ints[2];
    c.vocab_size = h.ints[3];
    c.num_layers = h.ints[4];
    c.num_heads = h.ints[5];
    c.channels = h.ints[6];
    c.padded_vocab_size = h.ints[7] == 0 ? h.ints[3] : h.ints[7];
    validate_config(c, kExitData, format("model file '%s': the header (offsets 8..31) holds an invalid shape", path));
    check_llmc_file_size(h, model_file_spec(), uint64_t(num_parameters(c)), model_bytes_per_param(info.version),
                         "parameter", format("version %d, shape %s", info.version, describe(c).c_str()));
    return info;
}

// The padded rows of wte must be zero: they receive no gradient, and llm.c's writer and ours keep them so.
// A non-zero value means the file was not written as a GPT-2 model file of this layout.
inline void check_padded_rows_zero(const GPT2Config& c, const float* params, const std::string& path, int version) {
    const int64_t C = c.channels;
    const float* wte = params + param_tensors(c)[kWte].offset;
    for (int64_t i = int64_t(c.vocab_size) * C; i < int64_t(c.padded_vocab_size) * C; i++) {
        if (wte[i] != 0.0f) {
            fail(kExitData,
                 "model file '%s': padded vocabulary row %lld of wte (offset %lld) holds %g, but rows %d..%d must be "
                 "zero", path.c_str(), (long long)(i / C),
                 (long long)(kModelHeaderBytes + i * model_bytes_per_param(version)), double(wte[i]), c.vocab_size,
                 c.padded_vocab_size - 1);
        }
    }
}

// Reads a whole model file into `params` (resized to num_parameters), converting bf16 to fp32. With
// `expected`, the file's shape must equal it (for a caller that has already sized a model).
inline ModelFileInfo read_model_file(const std::string& path, std::vector<float>* params,
                                     const GPT2Config* expected = nullptr) {
    File f(path, File::Mode::Read);
    ModelFileInfo info = read_model_header(f);
    if (expected != nullptr && info.config != *expected) {
        fail(kExitData, "model file '%s' holds a model of shape %s, but shape %s was expected", path.c_str(),
             describe(info.config).c_str(), describe(*expected).c_str());
    }
    const int64_t n = num_parameters(info.config);
    params->resize(size_t(n));
    if (info.version == kModelVersionFp32) {
        f.read_exact(params->data(), size_t(n) * sizeof(float));
    } else {
        const int64_t chunk = int64_t(1) << 22;
        std::vector<uint16_t> buf(size_t(std::min(n, chunk)));
        for (int64_t done = 0; done < n; done += chunk) {
            int64_t m = std::min(chunk, n - done);
            f.read_exact(buf.data(), size_t(m) * sizeof(uint16_t));
            for (int64_t j = 0; j < m; j++) (*params)[size_t(done + j)] = bf16_to_float(buf[size_t(j)]);
        }
    }
    check_padded_rows_zero(info.config, params->data(), path, info.version);
    return info;
}

// Fills a model file header for shape c and version (3 = fp32, 5 = bf16); the payload follows it.
inline void make_model_header(const GPT2Config& c, int version, int32_t (&h)[kModelHeaderInts]) {
    std::fill(std::begin(h), std::end(h), 0);
    h[0] = kModelMagic;
    h[1] = version;
    h[2] = c.max_seq_len;
    h[3] = c.vocab_size;
    h[4] = c.num_layers;
    h[5] = c.num_heads;
    h[6] = c.channels;
    h[7] = c.padded_vocab_size;
}

// Writes `params` (num_parameters(c) floats, in param_tensors order) as version 3 (fp32) or 5 (bf16),
// whole or not at all (write_file_atomically): an existing file is replaced only by a complete one.
inline void write_model_file(const std::string& path, const GPT2Config& c, const float* params, int version) {
    if (model_bytes_per_param(version) == 0) {
        fail(kExitUsage, "model file '%s': cannot write version %d (3 = fp32 or 5 = bf16)", path.c_str(), version);
    }
    validate_config(c, kExitUsage, format("model file '%s': cannot write an invalid shape", path.c_str()));
    int32_t h[kModelHeaderInts];
    make_model_header(c, version, h);
    const int64_t n = num_parameters(c);
    write_file_atomically(path, [&](File& f) {
        f.write_all(h, sizeof(h));
        if (version == kModelVersionFp32) {
            f.write_all(params, size_t(n) * sizeof(float));
        } else {
            const int64_t chunk = int64_t(1) << 22;
            std::vector<uint16_t> buf(size_t(std::min(n, chunk)));
            for (int64_t done = 0; done < n; done += chunk) {
                int64_t m = std::min(chunk, n - done);
                for (int64_t j = 0; j < m; j++) buf[size_t(j)] = float_to_bf16(params[done + j]);
                f.write_all(buf.data(), size_t(m) * sizeof(uint16_t));
            }
        }
    });
}

}  // namespace llmc
