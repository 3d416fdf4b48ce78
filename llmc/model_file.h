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

// Values converted per piece by the two functions below, which bounds their buffer.
constexpr int64_t kConvertChunk = int64_t(1) << 22;

// Reads n 16-bit values piece by piece (read(buffer, count, index of the first)) and converts them into out.
template <class Read>
inline void read_converted(int64_t n, float* out, float (*convert)(uint16_t), const Read& read) {
    std::vector<uint16_t> buf(size_t(std::min(n, kConvertChunk)));
    for (int64_t done = 0; done < n; done += kConvertChunk) {
        const int64_t m = std::min(kConvertChunk, n - done);
        read(buf.data(), m, done);
        std::transform(buf.begin(), buf.begin() + m, out + done, convert);
    }
}

// Writes n values at f's position as fp32, or as bf16 (rounded to nearest even) when bf16.
inline void write_floats(File& f, const float* values, int64_t n, bool bf16) {
    if (!bf16) {
        f.write_all(values, size_t(n) * sizeof(float));
        return;
    }
    std::vector<uint16_t> buf(size_t(std::min(n, kConvertChunk)));
    for (int64_t done = 0; done < n; done += kConvertChunk) {
        const int64_t m = std::min(kConvertChunk, n - done);
        std::transform(values + done, values + done + m, buf.begin(), float_to_bf16);
        f.write_all(buf.data(), size_t(m) * sizeof(uint16_t));
    }
}

struct ModelFileInfo {
    GPT2Config config;
    int version = 0;
};

// The model file format for llmc_header.h's reader.
inline const LlmcFileSpec& model_file_spec() {
    const char* retired = "is llm.c's old unpadded-vocabulary format; re-export it with a current train_gpt2.py "
                          "(version 3 = fp32 or 5 = bf16)";
    static const LlmcFileSpec spec{"model file", "a model file", kModelMagic, {kModelVersionFp32, kModelVersionBf16},
                                   "3 = fp32 or 5 = bf16", {{1, retired}, {2, retired}}};
    return spec;
}

// Reads and validates the header of an open model file against its length.
inline ModelFileInfo read_model_header(File& f) {
    const LlmcHeader h = read_llmc_header(f, model_file_spec());
    const char* path = h.path.c_str();
    const int32_t* v = h.ints;
    ModelFileInfo info{{v[2], v[3], v[7] == 0 ? v[3] : v[7], v[4], v[5], v[6]}, h.version()};
    const GPT2Config& c = info.config;
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
    const float* end = wte + int64_t(c.padded_vocab_size) * C;
    const float* bad = std::find_if(wte + int64_t(c.vocab_size) * C, end, [](float v) { return v != 0.0f; });
    if (bad != end) {
        const int64_t i = bad - wte;
        fail(kExitData,
             "model file '%s': padded vocabulary row %lld of wte (offset %lld) holds %g, but rows %d..%d must be zero",
             path.c_str(), (long long)(i / C), (long long)(kModelHeaderBytes + i * model_bytes_per_param(version)),
             double(wte[i]), c.vocab_size, c.padded_vocab_size - 1);
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
        read_converted(n, params->data(), bf16_to_float,
                       [&](uint16_t* buf, int64_t m, int64_t) { f.read_exact(buf, size_t(m) * sizeof(uint16_t)); });
    }
    check_padded_rows_zero(info.config, params->data(), path, info.version);
    return info;
}

// The bytes of a model file header for shape c and version (3 = fp32, 5 = bf16); the payload follows it.
inline std::vector<char> model_file_header(const GPT2Config& c, int version) {
    const int32_t h[kModelHeaderInts] = {kModelMagic, version,     c.max_seq_len, c.vocab_size,
                                         c.num_layers, c.num_heads, c.channels,    c.padded_vocab_size};
    return std::vector<char>(reinterpret_cast<const char*>(h), reinterpret_cast<const char*>(h) + sizeof(h));
}

// Writes `params` (num_parameters(c) floats, in param_tensors order) as version 3 (fp32) or 5 (bf16),
// whole or not at all (write_file_atomically): an existing file is replaced only by a complete one.
inline void write_model_file(const std::string& path, const GPT2Config& c, const float* params, int version) {
    if (model_bytes_per_param(version) == 0) {
        fail(kExitUsage, "model file '%s': cannot write version %d (3 = fp32 or 5 = bf16)", path.c_str(), version);
    }
    validate_config(c, kExitUsage, format("model file '%s': cannot write an invalid shape", path.c_str()));
    const std::vector<char> h = model_file_header(c, version);
    write_file_atomically(path, [&](File& f) {
        f.write_all(h.data(), h.size());
        write_floats(f, params, num_parameters(c), version == kModelVersionBf16);
    });
}

}  // namespace llmc
